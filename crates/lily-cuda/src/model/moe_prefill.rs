//! Prefill MoE as grouped GEMMs, kept apart from the decode path: it has its
//! own sort/gather/combine kernels and buffers (`Grouped`).

use anyhow::Result;

use super::CudaModel;
use crate::kernels::moe::{moe_assign, moe_combine, moe_count, moe_gather, moe_silu_mul, MoeDims};
use crate::weights::moe_dims;
use crate::weights::DevLayer;

impl CudaModel {
    /// Prefill experts: sort the chunk's (token, slot) pairs by expert, run
    /// each expert's rows through cuBLAS (gate|up, SiLU, down), the shared
    /// expert over all tokens, then add the weighted sum into the residual.
    /// Each expert's weights are read once per chunk instead of once per token.
    pub(super) fn moe_grouped(&self, lw: &DevLayer, t: usize) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let gr = &s.grouped;
        let MoeDims { d, e, k, f, fs } = moe_dims(cfg);
        let pairs = t * k;
        g.zero(gr.counts.ptr, e * 4)?;
        moe_count(g, s.idx.ptr, pairs, gr.counts.ptr)?;
        // the GEMM sizes are needed on the host: one sync per layer of a prefill chunk
        let counts: Vec<i32> = g.download(gr.counts.ptr, e)?;
        let mut offsets = Vec::with_capacity(e);
        let mut acc = 0i32;
        for c in &counts {
            offsets.push(acc);
            acc += c;
        }
        g.upload(gr.offsets.ptr, &offsets)?;
        moe_assign(
            g,
            s.idx.ptr,
            pairs,
            k,
            e,
            gr.offsets.ptr,
            gr.rowmap.ptr,
            gr.src.ptr,
        )?;
        moe_gather(g, s.h.ptr, gr.src.ptr, gr.xs.ptr, pairs, d)?;
        for (x, (&c, &o)) in counts.iter().zip(&offsets).enumerate() {
            if c == 0 {
                continue;
            }
            let (c, o) = (c as usize, o as usize);
            g.gemm_bf16_f32(
                gr.xs.at(o * d * 2),
                lw.gate_up.at(x * 2 * f * d * 2),
                gr.ys.at(o * 2 * f * 4),
                c,
                2 * f,
                d,
            )?;
        }
        moe_silu_mul(g, gr.ys.ptr, gr.hs.ptr, pairs, f)?;
        for (x, (&c, &o)) in counts.iter().zip(&offsets).enumerate() {
            if c == 0 {
                continue;
            }
            let (c, o) = (c as usize, o as usize);
            g.gemm_bf16_f32(
                gr.hs.at(o * f * 2),
                lw.down.at(x * d * f * 2),
                gr.ys.at(o * d * 4),
                c,
                d,
                f,
            )?;
        }
        g.gemm_bf16_f32(s.h.ptr, lw.shared_gate_up.ptr, gr.ysh.ptr, t, 2 * fs, d)?;
        moe_silu_mul(g, gr.ysh.ptr, gr.hsh.ptr, t, fs)?;
        g.gemm_bf16_f32(gr.hsh.ptr, lw.shared_down.ptr, gr.osh.ptr, t, d, fs)?;
        moe_combine(
            g,
            gr.ys.ptr,
            gr.osh.ptr,
            gr.rowmap.ptr,
            s.wts.ptr,
            s.x.ptr,
            t,
            d,
            k,
        )
    }
}
