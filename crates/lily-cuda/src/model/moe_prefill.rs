//! Prefill MoE as grouped GEMMs on the tensor cores, kept apart from the
//! decode path: it has its own sort and combine kernels and buffers (`Grouped`).

use anyhow::Result;

use super::CudaModel;
use crate::kernels::moe::{moe_assign, moe_combine, moe_count, MoeDims};
use crate::kernels::moe_grouped::{moe_down_grouped, moe_gate_up_grouped, moe_tiles, Groups};
use crate::weights::moe_dims;
use crate::weights::DevLayer;

impl CudaModel {
    /// Prefill experts: sort the chunk's (token, slot) pairs by expert on the
    /// device, one grouped launch for every expert's gate|up with SiLU and one
    /// for down, the shared expert through the same kernels as one group, then
    /// the weighted sum into the residual. Each expert's weights are read once
    /// per chunk, and nothing waits on the host.
    pub(super) fn moe_grouped(&self, lw: &DevLayer, t: usize) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let gr = &s.grouped;
        let MoeDims { d, e, k, f, fs } = moe_dims(cfg);
        let pairs = t * k;
        g.zero(gr.counts.ptr, e * 4)?;
        moe_count(g, s.idx.ptr, pairs, gr.counts.ptr)?;
        moe_tiles(g, gr.counts.ptr, pairs, e, gr.offsets.ptr, &gr.tiles)?;
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
        self.mark("moe sort", 0)?;
        let experts = Groups::Experts {
            pairs,
            e,
            tiles: &gr.tiles,
            offsets: gr.offsets.ptr,
            counts: gr.counts.ptr,
        };
        moe_gate_up_grouped(
            g,
            &experts,
            s.h.ptr,
            Some(gr.src.ptr),
            &lw.gate_up,
            gr.hs.ptr,
            f,
            d,
        )?;
        self.mark("moe gate/up", 0)?;
        moe_down_grouped(g, &experts, gr.hs.ptr, &lw.down, gr.ys.ptr, d, f)?;
        self.mark("moe down", 0)?;
        let shared = Groups::One { rows: t };
        moe_gate_up_grouped(
            g,
            &shared,
            s.h.ptr,
            None,
            &lw.shared_gate_up,
            gr.hsh.ptr,
            fs,
            d,
        )?;
        moe_down_grouped(g, &shared, gr.hsh.ptr, &lw.shared_down, gr.osh.ptr, d, fs)?;
        self.mark("moe shared", 0)?;
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
