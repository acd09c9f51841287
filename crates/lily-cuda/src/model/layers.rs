//! One step's forward pass, block by block: the launches prefill runs and a
//! decode step records into its graph, apart from set-up and the step API.

use anyhow::Result;

use super::bytes::{
    attention_core_bytes, attention_prep_bytes, gdn_conv_bytes, gdn_core_bytes, moe_expert_bytes,
    moe_gate_up_bytes,
};
use super::{moe_dims, CudaModel, CudaState};
use crate::gpu::{Arg, DevBuf};
use crate::sampling::{greedy_finish, greedy_lm_head};
use crate::weights::{DevLayer, DevMixer};

impl CudaModel {
    /// y[T, N] f32 = x[T, K] bf16 . W[N, K]^T: Lily's GEMV for one token, cuBLAS otherwise.
    fn linear(&self, x: u64, w: &DevBuf, y: u64, t: usize, n: usize, k: usize) -> Result<()> {
        debug_assert_eq!(w.bytes, n * k * 2);
        if t == 1 {
            self.gpu.launch(
                "gemv_kernel",
                (n.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(w.ptr),
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                ],
            )
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
        p: [(&DevBuf, u64, usize); 3],
        norm: &DevBuf,
    ) -> Result<()> {
        if t > 1 {
            for (w, y, n) in p {
                self.linear(x, w, y, t, n, k)?;
            }
            return Ok(());
        }
        let rows: usize = p.iter().map(|e| e.2).sum();
        let mut args = vec![Arg::Ptr(x), Arg::I32(k as i32)];
        for (w, y, n) in p {
            debug_assert_eq!(w.bytes, n * k * 2);
            args.extend([Arg::Ptr(w.ptr), Arg::Ptr(y), Arg::I32(n as i32)]);
        }
        // the layer's first decode kernel: it resets the layer's flags
        let clear = if self.opts.route_slot || self.opts.gdn_signal {
            self.s.flags.ptr
        } else {
            0
        };
        self.flags_cleared
            .store(!self.gpu.skipping(), std::sync::atomic::Ordering::Relaxed);
        args.extend([
            Arg::Ptr(self.s.x.ptr),
            Arg::Ptr(norm.ptr),
            Arg::F32(self.cfg.rms_norm_eps),
            Arg::Ptr(clear),
            Arg::I32((super::FLAG_BYTES / 8) as i32),
        ]);
        self.gpu.launch(
            "gemv3_kernel",
            (rows.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }

    fn add_norm(&self, x: u64, delta: Option<u64>, w: &DevBuf, out: u64, t: usize) -> Result<()> {
        let d = self.cfg.hidden_size;
        self.gpu.launch(
            "add_rmsnorm_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(delta.unwrap_or(0)),
                Arg::Ptr(w.ptr),
                Arg::Ptr(out),
                Arg::I32(d as i32),
                Arg::F32(self.cfg.rms_norm_eps),
            ],
        )
    }

    /// Run T tokens (their ids at device address `ids`: `s.ids` for prefill,
    /// `s.next` for a decode step, starting at `st.pos` which is in `s.pos`)
    /// through every layer; leaves the residual stream in `s.x`.
    pub(super) fn layers(&self, st: &mut CudaState, t: usize, ids: u64) -> Result<()> {
        let cfg = &self.cfg;
        let g = &self.gpu;
        let s = &self.s;
        let d = cfg.hidden_size;
        g.launch(
            "embed_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.w.embed.ptr),
                Arg::Ptr(ids),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
            ],
        )?;
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
        self.mark("attn qkv proj", (a.q.bytes + a.k.bytes + a.v.bytes) as u64)?;
        let gated = cfg.attn_output_gate as i32;
        g.launch(
            "qk_prep_kernel",
            (t as u32, (hq + hkv) as u32, 1),
            (dh as u32, 1, 1),
            0,
            &[
                Arg::Ptr(s.big.ptr),
                Arg::Ptr(s.k.ptr),
                Arg::Ptr(s.v.ptr),
                Arg::Ptr(a.q_norm.ptr),
                Arg::Ptr(a.k_norm.ptr),
                Arg::Ptr(s.pos.ptr),
                Arg::Ptr(s.q.ptr),
                Arg::Ptr(kv.0.ptr),
                Arg::Ptr(kv.1.ptr),
                Arg::I32(hq as i32),
                Arg::I32(hkv as i32),
                Arg::I32(dh as i32),
                Arg::I32(cfg.rotary_dim as i32),
                Arg::F32(cfg.rope_theta as f32),
                Arg::F32(cfg.rms_norm_eps),
                Arg::I32(gated),
            ],
        )?;
        self.mark("attn qk prep", attention_prep_bytes(cfg))?;
        if t == 1 {
            // decode: split-K over the cache (flash decoding), then a merge
            crate::attention::attention_decode(
                g,
                s.q.ptr,
                kv.0.ptr,
                kv.1.ptr,
                s.big.ptr,
                s.pos.ptr,
                s.h.ptr,
                s.att.ptr,
                self.att_splits,
                hq,
                hkv,
                dh,
                (dh as f32).powf(-0.5),
                gated != 0,
            )?;
        } else {
            g.launch(
                "attention_kernel",
                (t as u32, hq as u32, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(s.q.ptr),
                    Arg::Ptr(kv.0.ptr),
                    Arg::Ptr(kv.1.ptr),
                    Arg::Ptr(s.big.ptr),
                    Arg::Ptr(s.pos.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::I32(hq as i32),
                    Arg::I32(hkv as i32),
                    Arg::I32(dh as i32),
                    Arg::F32((dh as f32).powf(-0.5)),
                    Arg::I32(gated),
                ],
            )?;
        }
        self.mark(
            "attn core",
            attention_core_bytes(cfg, self.prof_pos()) - attention_prep_bytes(cfg),
        )?;
        self.out_proj(&a.o, hq * dh, t, None)?;
        self.mark("attn o proj", a.o.bytes as u64)
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
        self.mark("gdn in proj", (w.qkv.bytes + w.z.bytes + w.ba.bytes) as u64)?;
        // decode: the core counts its blocks done in the layer's flags, and
        // the output projection starts on the count
        let done = (t == 1 && self.opts.gdn_signal && self.flags_usable())
            .then_some(s.flags.ptr + super::GDN_DONE_OFFSET);
        if t == 1 {
            // decode: conv, recurrence step and gated norm in one kernel
            crate::gdn::gdn_decode(
                g,
                s.big.ptr,
                st.0.ptr,
                w.conv.ptr,
                s.ba.ptr,
                w.a_log.ptr,
                w.dt_bias.ptr,
                s.z.ptr,
                w.norm.ptr,
                st.1.ptr,
                s.h.ptr,
                hk,
                hv,
                dv,
                cfg.rms_norm_eps,
                done.unwrap_or(0),
            )?;
        } else {
            g.launch(
                "conv_silu_kernel",
                (c.div_ceil(128) as u32, 1, 1),
                (128, 1, 1),
                0,
                &[
                    Arg::Ptr(s.big.ptr),
                    Arg::Ptr(st.0.ptr),
                    Arg::Ptr(w.conv.ptr),
                    Arg::Ptr(s.conv.ptr),
                    Arg::I32(t as i32),
                    Arg::I32(c as i32),
                    Arg::I32(wd as i32),
                ],
            )?;
            self.mark("gdn conv", gdn_conv_bytes(cfg))?;
            // prefill: the chunked (UT-transform) form, parallel over chunks
            crate::gdn::gdn_chunked_prefill(
                g,
                Some(&s.gdn),
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
            g.launch(
                "gated_rmsnorm_kernel",
                ((t * hv) as u32, 1, 1),
                (dv as u32, 1, 1),
                0,
                &[
                    Arg::Ptr(s.q.ptr),
                    Arg::Ptr(s.z.ptr),
                    Arg::Ptr(w.norm.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::I32(dv as i32),
                    Arg::F32(cfg.rms_norm_eps),
                ],
            )?;
        }
        // (decode: the conv runs inside the core kernel)
        let conv = if t == 1 { 0 } else { gdn_conv_bytes(cfg) };
        self.mark("gdn core", gdn_core_bytes(cfg) - conv)?;
        let ready = done.map(|p| (p, crate::gdn::gdn_decode_blocks(hv)));
        self.out_proj(&w.out, hv * dv, t, ready)?;
        self.mark("gdn out proj", w.out.bytes as u64)
    }

    pub(super) fn silu_mul(&self, y: u64, out: u64, rows: usize, f: usize) -> Result<()> {
        self.gpu.launch(
            "moe_silu_mul_kernel",
            (((rows * f).div_ceil(256)).min(65_535) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(out),
                Arg::U64(rows as u64),
                Arg::I32(f as i32),
            ],
        )
    }

    /// A mixer's output projection h[T, k] -> delta[T, D]; for one decode
    /// token with the residual add fused in (x += W h; the router and the
    /// experts norm x themselves), which prefill runs as its own kernel.
    /// `ready`: (count, n), h's producer's early signal (gemv.cu input_wait).
    fn out_proj(&self, w: &DevBuf, k: usize, t: usize, ready: Option<(u64, u32)>) -> Result<()> {
        let (d, s) = (self.cfg.hidden_size, &self.s);
        if t > 1 {
            return self.linear(s.h.ptr, w, s.delta.ptr, t, d, k);
        }
        self.gpu.launch(
            "gemv_add_norm_kernel",
            (d.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(w.ptr),
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(s.delta.ptr),
                Arg::I32(d as i32),
                Arg::I32(k as i32),
                Arg::Ptr(s.x.ptr),
                Arg::Ptr(0), // no norm: x += W h
                Arg::Ptr(s.h.ptr),
                Arg::F32(self.cfg.rms_norm_eps),
                Arg::Ptr(s.counter.ptr),
                Arg::Ptr(ready.map_or(0, |r| r.0)),
                Arg::I32(ready.map_or(0, |r| r.1 as i32)),
            ],
        )
    }

    /// The MoE block. A decode token's router norms the residual stream
    /// itself (`post_norm`, every block) and writes the normed input to `s.h`
    /// for the gate/up products; each gate/up block takes the top-K of the
    /// router's logits itself, and one publishes it with the weights in the
    /// route slot for the down product's blocks (`CudaOptions::route_slot`);
    /// `final_norm` (after the last layer) runs in the down product's last
    /// block, into `s.h`.
    fn moe(&self, lw: &DevLayer, t: usize, final_norm: Option<&DevBuf>) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, e, k, f, fs) = moe_dims(cfg);
        if t == 1 {
            g.launch(
                "router_decode_kernel",
                ((e + 1).div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(lw.router.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::Ptr(s.rl.ptr),
                    Arg::I32(d as i32),
                    Arg::I32(e as i32),
                    Arg::Ptr(s.x.ptr),
                    Arg::Ptr(lw.post_norm.ptr),
                    Arg::F32(cfg.rms_norm_eps),
                    Arg::Ptr(s.h.ptr), // the normed input, for the gate/up products
                ],
            )?;
        } else {
            self.linear(s.h.ptr, &lw.router, s.rl.ptr, t, e + 1, d)?;
            g.launch(
                "router_topk_kernel",
                (t.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(s.rl.ptr),
                    Arg::I32(t as i32),
                    Arg::I32(e as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(s.idx.ptr),
                    Arg::Ptr(s.wts.ptr),
                ],
            )?;
        }
        self.mark("moe router", lw.router.bytes as u64)?;
        if t > 1 {
            self.moe_grouped(lw, t)?;
            return self.mark("moe experts", moe_expert_bytes(cfg));
        }
        let fmax = f.max(fs);
        // the shared down matrix asked into L2 by gate/up (CudaOptions::l2_ahead)
        let ahead = self.opts.l2_ahead.then_some(&lw.shared_down);
        // the routing published by gate/up for down (the D = 2048 path)
        let route = if self.opts.route_slot && d == 2048 && self.flags_usable() {
            s.flags.ptr
        } else {
            0
        };
        g.launch(
            "moe_gate_up_kernel",
            (fmax.div_ceil(8) as u32, (k + 1) as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(lw.gate_up.ptr),
                Arg::Ptr(lw.shared_gate_up.ptr),
                Arg::Ptr(s.idx.ptr),
                Arg::Ptr(s.moe_h.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(s.rl.ptr), // each block routes from the logits
                Arg::I32(e as i32),
                Arg::Ptr(route),
                Arg::Ptr(ahead.map_or(0, |b| b.ptr)),
                Arg::U64(ahead.map_or(0, |b| b.bytes as u64)),
            ],
        )?;
        self.mark("moe gate/up", moe_gate_up_bytes(cfg))?;
        // one decode token: the final RMSNorm fused into the last down product
        g.launch(
            "moe_down_norm_kernel",
            (d.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.moe_h.ptr),
                Arg::Ptr(lw.down.ptr),
                Arg::Ptr(lw.shared_down.ptr),
                Arg::Ptr(s.rl.ptr),
                Arg::I32(e as i32),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(final_norm.map_or(0, |n| n.ptr)),
                Arg::Ptr(s.h.ptr),
                Arg::F32(cfg.rms_norm_eps),
                Arg::Ptr(s.counter.ptr),
                Arg::Ptr(route),
            ],
        )?;
        self.mark("moe down", moe_expert_bytes(cfg) - moe_gate_up_bytes(cfg))
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
            Some(hs) => hs.launch(g, self.w.lm_head.ptr, s.h.ptr, s.valid.ptr, s.best.ptr)?,
            None => greedy_lm_head(
                g,
                self.w.lm_head.ptr,
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

    fn mark(&self, name: &'static str, bytes: u64) -> Result<()> {
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
