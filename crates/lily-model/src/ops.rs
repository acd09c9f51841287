//! Op contracts: the math of every step of the forward pass, defined once.
//! The CPU backend (`lily-cpu`) implements each plainly and is the oracle;
//! the CUDA backend implements them fused and is tested against the CPU.
//!
//! Symbol legend (released sizes in brackets):
//! T tokens in the step; D hidden [2048]; V vocab rows [248,320]; E experts [256];
//! K experts per token [8]; F expert FFN width [512]; Hq query heads [16];
//! Hkv KV heads [2]; Dh attention head dim [256]; Dr rotary dims [64];
//! Hk GDN q/k heads [16]; Hv GDN v heads [32]; Dk, Dv GDN head dims [128];
//! C conv channels = 2*Hk*Dk + Hv*Dv [8192]; W conv width [4]; P position.
//!
//! Dtypes: weights are bf16/f16/f32 and read widened to f32; all arithmetic is
//! f32. When the weights are bf16 (or f16), activations are rounded to that
//! dtype at the boundaries where HF transformers materialises them (each
//! linear's output, each norm's output, the residual stream), so a bf16
//! checkpoint is compared against HF run in bf16 on equal terms.
//!
//! - `rmsnorm1p(x; w)` [T, N] -> [T, N]: `x * rsqrt(mean(x^2) + eps) * (1 + w)`;
//!   used for input/post-attention/final norms and the q/k head norms (N = Dh).
//! - `gated_rmsnorm(o, z; w)` per GDN head [Dv]: `w * (o * rsqrt(mean(o^2) + eps)) * silu(z)`;
//!   the weight is plain (not 1 + w) and shared by all Hv heads.
//! - `linear(x; W)` [T, in] x [out, in] -> [T, out]: `x W^T`, no bias.
//! - `rope(x, P)` on the first Dr dims of each q/k head, NeoX halves:
//!   `inv_freq[j] = theta^(-2j/Dr)`, `a = P * inv_freq[j]` (f32), for i < Dr/2:
//!   `x'[i] = x[i] cos a_i - x[i+Dr/2] sin a_i`, `x'[i+Dr/2] = x[i+Dr/2] cos a_i + x[i] sin a_i`.
//! - `gated_attention`: q_proj -> per head [q (Dh) | gate (Dh)]; q, k rmsnorm1p per head;
//!   rope; causal softmax attention with scale Dh^-1/2, query head h reads KV head
//!   h / (Hq/Hkv); output * sigmoid(gate); o_proj. Appends T rows to the KV cache.
//! - `causal_conv1d_silu` [T, C] with state [C, W-1] (the previous W-1 inputs,
//!   zeros at sequence start): `y[t,c] = silu(sum_j w[c,j] x[t-W+1+j, c])`; the state
//!   becomes the last W-1 inputs.
//! - `gdn_gates`: `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)` [T, Hv].
//! - `gdn_recurrence` per v head j, state S [Dk, Dv] f32, q/k from head j / (Hv/Hk),
//!   q, k L2-normalised (`x * rsqrt(sum x^2 + 1e-6)`), q scaled by Dk^-1/2:
//!   `S = exp(g) S; u = S^T k; S += k (beta (v - u))^T; o = S^T q`.
//!   The chunked form (chunk 64, UT transform) computes the same thing for prefill.
//! - `moe`: `p = softmax(x Wr^T)` over all E (f32); top-K of p; renormalise to sum 1;
//!   `sum_k w_k * down_k(silu(gate_k x) * up_k x)` + `sigmoid(x . w_sg) * shared(x)`.
//! - `lm_head`: final rmsnorm1p, then `linear` to V logits.
