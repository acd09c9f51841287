//! Prefill MoE as grouped GEMMs, kept apart from the decode path: it has its
//! own sort/gather/combine kernels and buffers (`Grouped`).

use anyhow::Result;

use super::{moe_dims, CudaModel};
use crate::gpu::Arg;
use crate::weights::DevLayer;

impl CudaModel {
    /// Prefill experts: sort the chunk's (token, slot) pairs by expert, run
    /// each expert's rows through cuBLAS (gate|up, SiLU, down), the shared
    /// expert over all tokens, then add the weighted sum into the residual.
    /// Each expert's weights are read once per chunk instead of once per token.
    pub(super) fn moe_grouped(&self, lw: &DevLayer, t: usize) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let gr = &s.grouped;
        let (d, e, k, f, fs) = moe_dims(cfg);
        let pairs = t * k;
        g.zero(gr.counts.ptr, e * 4)?;
        g.launch(
            "moe_count_kernel",
            (pairs.div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.idx.ptr),
                Arg::I32(pairs as i32),
                Arg::Ptr(gr.counts.ptr),
            ],
        )?;
        // the GEMM sizes are needed on the host: one sync per layer of a prefill chunk
        let counts: Vec<i32> = g.download(gr.counts.ptr, e)?;
        let mut offsets = Vec::with_capacity(e);
        let mut acc = 0i32;
        for c in &counts {
            offsets.push(acc);
            acc += c;
        }
        g.upload(gr.offsets.ptr, &offsets)?;
        g.launch(
            "moe_assign_kernel",
            (e as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.idx.ptr),
                Arg::I32(pairs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(gr.offsets.ptr),
                Arg::Ptr(gr.rowmap.ptr),
                Arg::Ptr(gr.src.ptr),
            ],
        )?;
        g.launch(
            "moe_gather_kernel",
            (pairs as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(gr.src.ptr),
                Arg::Ptr(gr.xs.ptr),
                Arg::I32(d as i32),
            ],
        )?;
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
        self.silu_mul(gr.ys.ptr, gr.hs.ptr, pairs, f)?;
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
        self.silu_mul(gr.ysh.ptr, gr.hsh.ptr, t, fs)?;
        g.gemm_bf16_f32(gr.hsh.ptr, lw.shared_down.ptr, gr.osh.ptr, t, d, fs)?;
        g.launch(
            "moe_combine_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(gr.ys.ptr),
                Arg::Ptr(gr.osh.ptr),
                Arg::Ptr(gr.rowmap.ptr),
                Arg::Ptr(s.wts.ptr),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
                Arg::I32(k as i32),
            ],
        )
    }
}
