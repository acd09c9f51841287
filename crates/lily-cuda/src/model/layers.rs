//! One step's forward pass, block by block: the launches prefill runs and a
//! decode step records into its graph, apart from set-up and the step API.

use anyhow::Result;

use super::bytes::{
    attention_core_bytes, attention_prep_bytes, gdn_conv_bytes, gdn_core_bytes, moe_expert_bytes,
    moe_gate_up_bytes,
};
use super::{CudaModel, CudaState};
use crate::gpu::{DevBuf, DevMat};
use crate::kernels::attention::{
    attention, attention_decode, qk_prep, Attend, Heads, QkPrep, Rope,
};
use crate::kernels::embed::embed;
use crate::kernels::gdn::{conv_silu, gdn_decode, GdnDecode};
use crate::kernels::gdn_chunked::gdn_chunked_prefill;
use crate::kernels::gemv::{gemv, gemv3, gemv_add, Normed, Projection};
use crate::kernels::moe::{
    moe_down_norm, moe_gate_up, router_decode, router_topk, DownNorm, GateUp, PREFETCHED_HIDDEN,
};
use crate::kernels::moe_grouped::{moe_down_grouped, Groups};
use crate::kernels::norm::{add_rmsnorm, gated_rmsnorm};
use crate::kernels::sampling::{greedy_finish, greedy_lm_head};
use crate::weights::moe_dims;
use crate::weights::{DevLayer, DevMixer};

impl CudaModel {
    /// y[T, N] f32 = x[T, K] bf16 . W[N, K]^T: Lily's GEMV for one token, cuBLAS otherwise.
    /// `linear` for a weight that may be block FP8: the grouped GEMM as one
    /// group, the codes dequantized in its main loop.
    fn project(&self, x: u64, w: &DevMat, y: u64, t: usize, n: usize, k: usize) -> Result<()> {
        if w.is_fp8() {
            return moe_down_grouped(&self.gpu, &Groups::One { rows: t }, x, w, y, n, k);
        }
        self.linear(x, &w.data, y, t, n, k)
    }

    fn linear(&self, x: u64, w: &DevBuf, y: u64, t: usize, n: usize, k: usize) -> Result<()> {
        debug_assert_eq!(w.bytes, n * k * 2);
        if t == 1 {
            gemv(&self.gpu, w, x, y, n, k)
        } else {
            self.gpu.gemm_bf16_f32(x, w.ptr, y, t, n, k)
        }
    }

    /// Three projections of the same input x[T, K]: one launch for a decode
    /// token, three GEMMs for prefill. Each entry is (weight [N, K], y [T, N], N).
    /// A decode token's input is `norm` of the residual stream, computed by
    /// the kernel itself (`x` unused); prefill's is `x`, normed before.
    fn linear3(
        &self,
        x: u64,
        t: usize,
        k: usize,
        p: [(&DevMat, u64, usize); 3],
        norm: &DevBuf,
    ) -> Result<()> {
        if t > 1 {
            for (w, y, n) in p {
                self.project(x, w, y, t, n, k)?;
            }
            return Ok(());
        }
        // the layer's first decode kernel: it resets the layer's flags
        self.flags_cleared
            .store(!self.gpu.skipping(), std::sync::atomic::Ordering::Relaxed);
        gemv3(
            &self.gpu,
            Normed {
                x: self.s.x.ptr,
                w1p: norm.ptr,
                eps: self.cfg.rms_norm_eps,
            },
            k,
            p.map(|(w, y, rows)| Projection { w, y, rows }),
            (self.s.flags.ptr, super::FLAG_BYTES / 8),
        )
    }

    fn add_norm(&self, x: u64, delta: Option<u64>, w: &DevBuf, out: u64, t: usize) -> Result<()> {
        let d = self.cfg.hidden_size;
        add_rmsnorm(&self.gpu, x, delta, w.ptr, out, t, d, self.cfg.rms_norm_eps)
    }

    /// Run T tokens (their ids at device address `ids`: `s.ids` for prefill,
    /// `s.next` for a decode step, starting at `st.pos` which is in `s.pos`)
    /// through every layer; leaves the residual stream in `s.x`.
    pub(super) fn layers(&self, st: &mut CudaState, t: usize, ids: u64) -> Result<()> {
        let cfg = &self.cfg;
        let g = &self.gpu;
        let s = &self.s;
        let d = cfg.hidden_size;
        embed(g, self.w.embed.ptr, ids, s.x.ptr, t, d)?;
        let norm_bytes = (d * 4 * 3 + d * 2) as u64;
        self.mark("embed", (d * 2 + d * 4) as u64)?;
        // One decode token: each RMSNorm is computed by the blocks of the
        // kernels that read it (the mixer's input projections and the router,
        // which passes its copy on to the experts) from the residual stream, which the output
        // projections and the down product update in place; only the final
        // norm runs in the last block of the last down product, leaving the
        // final-normed hidden state in `s.h` for the lm_head.
        let fused = t == 1;
        for (l, (lw, ls)) in self.w.layers.iter().zip(st.layers.iter()).enumerate() {
            if !fused {
                self.add_norm(s.x.ptr, None, &lw.input_norm, s.h.ptr, t)?;
                self.mark("norms", norm_bytes)?;
            }
            match &lw.mixer {
                DevMixer::Attention(_) => self.attention(lw, ls, t)?,
                DevMixer::Gdn(_) => self.gdn(lw, ls, t)?,
            }
            if !fused {
                self.add_norm(s.x.ptr, Some(s.delta.ptr), &lw.post_norm, s.h.ptr, t)?;
                self.mark("norms", norm_bytes)?;
            }
            // the final norm, after the last layer (decode: in the down product's last block)
            let final_norm = (l + 1 == self.w.layers.len()).then_some(&self.w.norm);
            self.moe(lw, t, final_norm)
                .map_err(|e| e.context(format!("layer {l} moe")))?;
        }
        Ok(())
    }

    fn attention(&self, lw: &DevLayer, kv: &(DevBuf, DevBuf), t: usize) -> Result<()> {
        let DevMixer::Attention(a) = &lw.mixer else {
            unreachable!()
        };
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, hq, hkv, dh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        self.linear3(
            s.h.ptr,
            t,
            d,
            [
                (&a.q, s.big.ptr, cfg.q_proj_rows()),
                (&a.k, s.k.ptr, hkv * dh),
                (&a.v, s.v.ptr, hkv * dh),
            ],
            &lw.input_norm,
        )?;
        self.mark(
            "attn qkv proj",
            (a.q.total_bytes() + a.k.total_bytes() + a.v.total_bytes()) as u64,
        )?;
        let gated = cfg.attn_output_gate;
        let heads = Heads { hq, hkv, dh };
        qk_prep(
            g,
            &QkPrep {
                qg: s.big.ptr,
                k: s.k.ptr,
                v: s.v.ptr,
                q_norm: a.q_norm.ptr,
                k_norm: a.k_norm.ptr,
                pos: s.pos.ptr,
                q_out: s.q.ptr,
                kcache: kv.0.ptr,
                vcache: kv.1.ptr,
            },
            heads,
            Rope {
                rotary_dim: cfg.rotary_dim,
                theta: cfg.rope_theta as f32,
                eps: cfg.rms_norm_eps,
            },
            gated,
            t,
        )?;
        self.mark("attn qk prep", attention_prep_bytes(cfg))?;
        let at = Attend {
            q: s.q.ptr,
            kcache: kv.0.ptr,
            vcache: kv.1.ptr,
            qg: s.big.ptr,
            pos: s.pos.ptr,
            out: s.h.ptr,
        };
        let scale = (dh as f32).powf(-0.5);
        if t == 1 {
            // decode: split-K over the cache (flash decoding), then a merge
            attention_decode(g, &at, heads, scale, gated, &s.att, self.att_splits)?;
        } else {
            attention(g, &at, heads, scale, gated, t)?;
        }
        self.mark(
            "attn core",
            attention_core_bytes(cfg, self.prof_pos()) - attention_prep_bytes(cfg),
        )?;
        self.out_proj(&a.o, hq * dh, t)?;
        self.mark("attn o proj", a.o.total_bytes() as u64)
    }

    fn gdn(&self, lw: &DevLayer, st: &(DevBuf, DevBuf), t: usize) -> Result<()> {
        let DevMixer::Gdn(w) = &lw.mixer else {
            unreachable!()
        };
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, c, hk, hv, dv, wd) = (
            cfg.hidden_size,
            cfg.conv_dim(),
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        );
        self.linear3(
            s.h.ptr,
            t,
            d,
            [
                (&w.qkv, s.big.ptr, c),
                (&w.z, s.z.ptr, hv * dv),
                (&w.ba, s.ba.ptr, 2 * hv),
            ],
            &lw.input_norm,
        )?;
        self.mark(
            "gdn in proj",
            (w.qkv.total_bytes() + w.z.total_bytes() + w.ba.total_bytes()) as u64,
        )?;
        if t == 1 {
            // decode: conv, recurrence step and gated norm in one kernel
            gdn_decode(
                g,
                &GdnDecode {
                    mixed: s.big.ptr,
                    conv_state: st.0.ptr,
                    conv_w: w.conv.ptr,
                    ba: s.ba.ptr,
                    a_log: w.a_log.ptr,
                    dt_bias: w.dt_bias.ptr,
                    z: s.z.ptr,
                    norm_w: w.norm.ptr,
                    state: st.1.ptr,
                    out: s.h.ptr,
                },
                hk,
                hv,
                dv,
                cfg.rms_norm_eps,
            )?;
        } else {
            conv_silu(g, s.big.ptr, st.0.ptr, w.conv.ptr, s.conv.ptr, t, c, wd)?;
            self.mark("gdn conv", gdn_conv_bytes(cfg))?;
            // prefill: the chunked (UT-transform) form, parallel over chunks
            gdn_chunked_prefill(
                g,
                &s.gdn,
                s.conv.ptr,
                s.ba.ptr,
                w.a_log.ptr,
                w.dt_bias.ptr,
                st.1.ptr,
                s.q.ptr,
                t,
                hk,
                hv,
                dv,
            )?;
            gated_rmsnorm(
                g,
                s.q.ptr,
                s.z.ptr,
                w.norm.ptr,
                s.h.ptr,
                t * hv,
                dv,
                cfg.rms_norm_eps,
            )?;
        }
        // (decode: the conv runs inside the core kernel)
        let conv = if t == 1 { 0 } else { gdn_conv_bytes(cfg) };
        self.mark("gdn core", gdn_core_bytes(cfg) - conv)?;
        self.out_proj(&w.out, hv * dv, t)?;
        self.mark("gdn out proj", w.out.total_bytes() as u64)
    }

    /// A mixer's output projection h[T, k] -> delta[T, D]; for one decode
    /// token with the residual add fused in (x += W h; the router and the
    /// experts norm x themselves), which prefill runs as its own kernel.
    fn out_proj(&self, w: &DevMat, k: usize, t: usize) -> Result<()> {
        let (d, s) = (self.cfg.hidden_size, &self.s);
        if t > 1 {
            return self.project(s.h.ptr, w, s.delta.ptr, t, d, k);
        }
        gemv_add(&self.gpu, w, s.h.ptr, s.x.ptr, d, k)
    }

    /// The MoE block. A decode token's router norms the residual stream
    /// itself (`post_norm`, every block) and writes the normed input to `s.h`
    /// for the gate/up products; each gate/up block takes the top-K of the
    /// router's logits itself, and one publishes it with the weights in the
    /// route slot for the down product's blocks; `final_norm` (after the last
    /// layer) runs in the down product's last block, into `s.h`.
    fn moe(&self, lw: &DevLayer, t: usize, final_norm: Option<&DevBuf>) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let dims = moe_dims(cfg);
        let (d, e, k) = (dims.d, dims.e, dims.k);
        if t == 1 {
            let input = Normed {
                x: s.x.ptr,
                w1p: lw.post_norm.ptr,
                eps: cfg.rms_norm_eps,
            };
            router_decode(g, &lw.router, input, s.rl.ptr, d, e, s.h.ptr)?;
        } else {
            self.linear(s.h.ptr, &lw.router, s.rl.ptr, t, e + 1, d)?;
            router_topk(g, s.rl.ptr, t, e, k, s.idx.ptr, s.wts.ptr)?;
        }
        self.mark("moe router", lw.router.bytes as u64)?;
        if t > 1 {
            self.moe_grouped(lw, t)?;
            return self.mark("moe combine", 0);
        }
        // the routing published by gate/up for down (the d = 2048 path; not
        // in an ablation capture that drops the flags' clearing)
        let route = (d == PREFETCHED_HIDDEN && self.flags_usable()).then_some(s.flags.ptr);
        moe_gate_up(
            g,
            dims,
            &GateUp {
                x: s.h.ptr,
                gate_up: &lw.gate_up,
                shared_gate_up: &lw.shared_gate_up,
                logits: s.rl.ptr,
                h: s.moe_h.ptr,
                route,
                ahead: &lw.shared_down,
            },
        )?;
        let fp8 = lw.gate_up.is_fp8();
        self.mark("moe gate/up", moe_gate_up_bytes(cfg, fp8))?;
        // one decode token: the final RMSNorm fused into the last down product
        moe_down_norm(
            g,
            dims,
            &DownNorm {
                h: s.moe_h.ptr,
                down: &lw.down,
                shared_down: &lw.shared_down,
                logits: s.rl.ptr,
                x: s.x.ptr,
                final_norm: final_norm.map(|n| (n.ptr, s.h.ptr, cfg.rms_norm_eps)),
                counter: s.counter.ptr,
                route,
            },
        )?;
        self.mark(
            "moe down",
            moe_expert_bytes(cfg, fp8) - moe_gate_up_bytes(cfg, fp8),
        )
    }

    /// Logits of rows [r0, r0+n) of the residual stream into `out` ([n, V] f32).
    pub(super) fn head(&self, r0: usize, n: usize, out: u64) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let s = &self.s;
        self.add_norm(s.x.at(r0 * d * 4), None, &self.w.norm, s.h.ptr, n)?;
        self.linear(s.h.ptr, &self.w.lm_head, out, n, v, d)?;
        self.mark("lm_head", (self.w.lm_head.bytes + v * 4) as u64)
    }

    /// The decode step's lm_head (`layers(_, 1)` left the final-normed hidden
    /// state in `s.h`): logits into `s.logits`, and the greedy choice among ids
    /// below `s.valid` into `s.next` with `s.pos` advanced when `advance`
    /// (so the next step can be launched without the host touching either;
    /// a profiled step stays where it is). With `screen` (the model holds the
    /// int8 copy), only the greedy choice, through the screen
    /// (kernels/lm_head.cu): `s.logits` is not written.
    pub(super) fn lm_head_decode(&self, advance: bool, screen: bool) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let s = &self.s;
        debug_assert_eq!(self.w.lm_head.bytes, v * d * 2);
        let g = &self.gpu;
        let max_pos = if advance { self.opts.max_seq - 1 } else { 0 };
        let hs = self.screen.as_ref().filter(|_| screen);
        match hs {
            Some(hs) => hs.launch(g, &self.w.lm_head, s.h.ptr, s.valid.ptr, s.best.ptr)?,
            None => greedy_lm_head(
                g,
                &self.w.lm_head,
                s.h.ptr,
                s.logits.ptr,
                v,
                d,
                s.valid.ptr,
                s.best.ptr,
            )?,
        }
        // (the screen's threshold is cleared with `best`)
        let clear = hs.map_or(0, |hs| hs.threshold());
        greedy_finish(
            g,
            s.best.ptr,
            s.next.ptr,
            s.pos.ptr,
            max_pos,
            s.host_next.dev,
            clear,
        )?;
        match hs {
            // its own name in the profile's table: its bytes are the int8 copy's
            Some(hs) => self.mark("lm_head screen", hs.step_bytes()),
            None => self.mark("lm_head", (self.w.lm_head.bytes + v * 4) as u64),
        }
    }

    pub(super) fn mark(&self, name: &'static str, bytes: u64) -> Result<()> {
        self.prof.mark(&self.gpu.stream, name, bytes)?;
        if let Some(a) = self.ablate.lock().unwrap().as_mut() {
            self.gpu.set_skip(a.passed(name));
        }
        Ok(())
    }

    /// Whether the next launch may use the layer's flags: the layer's
    /// clearing launch was recorded and this one is not dropped (an ablation
    /// capture drops launches, which would leave no signal, or a stale one).
    fn flags_usable(&self) -> bool {
        self.flags_cleared
            .load(std::sync::atomic::Ordering::Relaxed)
            && !self.gpu.skipping()
    }

    /// The position a profiled step runs at (for the KV bytes it reads).
    fn prof_pos(&self) -> usize {
        self.prof_pos.load(std::sync::atomic::Ordering::Relaxed)
    }
}
