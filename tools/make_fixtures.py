#!/usr/bin/env python3
"""Golden fixtures for Lily: tiny random Qwen3.5/3.6-MoE (`qwen3_5_moe`) checkpoints
plus reference outputs computed by HF transformers.

Provenance
----------
Every case is a *small random* model built with the reference implementation,
`transformers.models.qwen3_5_moe` (transformers 5.17.0, torch on the CPU):
`Qwen3_5MoeTextConfig` + `Qwen3_5MoeForCausalLM`, `attn_implementation="eager"`.
No real weights are involved. For each case the script

1. builds the config (explicit `layer_types`, `rope_parameters` with rope_type
   "default", rope_theta, partial_rotary_factor, mrope_section, mrope_interleaved)
   and the model under `torch.manual_seed(case.seed)`;
2. overwrites EVERY parameter with seeded random values (see `perturb_`): HF's
   init (std 0.02 linears, zero RMSNorm weights, ones RMSNormGated weights,
   dt_bias = 1, A_log = log U(0.01, 16)) would make most of the math degenerate
   (1+w == 1, near-zero activations, decays down to exp(-16)). Linears get
   std 1/sqrt(fan_in), norms init + N(0, 0.2), A = exp(A_log) ~ U(0.03, 0.6) and
   dt_bias ~ N(0.5, 0.5) give per-step decays exp(g) mostly in (0.2, 0.99);
3. casts the PARAMETERS to the case dtype (float32 or bfloat16; `model.to(bf16)`
   would also round the f32 RoPE inv_freq buffer, which from_pretrained does not),
   writes the checkpoint with `save_pretrained(safe_serialization=True)` and loads
   it back with `from_pretrained` (asserting bit-equal parameters and buffers):
   the reference runs on that loaded model, exactly as a user would get it;
4. draws T random token ids (seeded; redrawn a few times if the forward pass has
   an exact routing tie or an exact top-1 tie) and runs ONE forward pass over all
   T tokens (`use_cache=False`, `output_hidden_states=True`,
   `output_router_logits=True`, forward hooks for the raw last-layer output and
   the router's top-k choice);
5. recomputes the logits a second way: prefill of the first T-5 tokens with a
   cache (DynamicCache built by the model), then the last 5 tokens one at a time
   through the cache (GDN recurrent kernel + conv-state update + KV cache). The
   max |differences| against step 4 go to the README;
6. for "released" cases, rewrites the checkpoint into the layout of the released
   `Qwen/Qwen3.6-35B-A3B` repo (see `to_released_layout`): nested config
   (`Qwen3_5MoeForConditionalGeneration`, `text_config`, dummy `vision_config`),
   `model.language_model.` prefix, dummy `model.visual.*` and `mtp.*` tensors,
   optionally fused experts, optionally sharded with `model.safetensors.index.json`,
   optionally A_log stored as F32 inside a bf16 checkpoint. Each rewritten
   checkpoint is verified tensor by tensor against the save_pretrained output
   (bit-exact after undoing the rename/fuse);
7. loads every case directory back with `Qwen3_5MoeForCausalLM.from_pretrained`
   (and released ones also with `Qwen3_5MoeForConditionalGeneration`), asserts
   bit-equal parameters and reference logits within a tight tolerance (not always
   bit-exact: other memory alignment of the loaded tensors changes CPU summation
   order), and records the differences;
8. writes `fixtures/models/<case>/reference.safetensors`, `fixtures/models/cases.json`
   and `fixtures/models/README.md`.

Reference tensors (all in `reference.safetensors`, see the README for details):
  tokens              int64   [T]
  logits              float32 [T, V]       full forward, no cache (bf16 values upcast in bf16 cases)
  hidden_states       float32 [L+1, T, D]  HF output_hidden_states: [0] = embeddings,
                                           [i] = output of layer i-1 for i in 1..L-1,
                                           [L] = FINAL-NORMED output (HF replaces the raw
                                           last-layer output by last_hidden_state)
  last_layer_out      float32 [T, D]       raw output of the last decoder layer (pre final norm)
  logits_decode       float32 [5, V]       logits of the last 5 tokens via prefill(T-5)+5 cached steps
  router_logits       float32 [L, T, E]    router logits (before softmax) per layer
  router_topk_idx     int64   [L, T, k]    experts chosen by HF (torch.topk order)
  router_topk_weight  float32 [L, T, k]    their renormalised routing weights
  logits_f32          float32 [T, V]       bf16 cases only: the bf16 checkpoint run in f32
                                           (from_pretrained(dtype=float32)), no cache

How to run
----------
    /opt/refenv/bin/python tools/make_fixtures.py            # regenerate everything
    /opt/refenv/bin/python tools/make_fixtures.py CASE ...   # only some cases (README/cases.json
                                                             #   are still rewritten for all)

The venv holds `torch transformers==5.17.0 safetensors numpy`. Everything runs on the
CPU; it is deterministic (seeded per case) and re-runnable: each case directory is
deleted and regenerated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO / "fixtures" / "models"
N_DECODE = 5  # tokens fed one at a time through the cache
NEAR = 0.05  # "near tie" threshold for top-1 logit gaps and router top-k margins (a few bf16 ulps)

LIN, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass
class Case:
    name: str
    seed: int
    dtype: str  # "float32" | "bfloat16"
    T: int
    vocab: int
    hidden: int
    layer_types: list
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    rope_theta: float
    partial_rotary: float
    rms_eps: float = 1e-6
    conv_kernel: int = 4
    layout: str = "text"  # "text" (save_pretrained as is) | "released"
    fused: bool = False  # released only: experts as gate_up_proj / down_proj
    shards: int = 1  # released only: number of safetensors files
    a_log_f32: bool = False  # released bf16 only: store A_log as F32

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def mrope_section(self) -> list:
        # sums to rotary_dim/2 like the real [11, 11, 10] for rotary_dim 64 (no effect on text-only input)
        half = self.rotary_dim // 2
        a = (half + 2) // 3
        b = (half - a + 1) // 2
        return [a, b, half - a - b]


CASES = [
    Case(
        name="f32-text-perexpert",
        seed=1001, dtype="float32", T=24, vocab=256, hidden=32,
        layer_types=[LIN, LIN, LIN, FULL],  # interval 4 like the real model
        heads=4, kv_heads=2, head_dim=16,  # GQA 2, head_dim != hidden/heads (8)
        lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,  # Hv/Hk = 2
        experts=4, top_k=2, moe_inter=16, shared_inter=24,
        rope_theta=1e7, partial_rotary=0.25,
    ),
    Case(
        name="f32-text-perexpert-long",
        seed=1002, dtype="float32", T=150, vocab=256, hidden=32,
        layer_types=[FULL, LIN, LIN],  # starts with full attention
        heads=4, kv_heads=4, head_dim=8,  # GQA 1, head_dim == hidden/heads
        lin_k_heads=2, lin_v_heads=6, lin_k_dim=16, lin_v_dim=8,  # Hv/Hk = 3, Dk != Dv
        experts=6, top_k=3, moe_inter=16, shared_inter=16,
        rope_theta=10000.0, partial_rotary=0.5,
    ),
    Case(
        name="f32-released-fused",
        seed=1003, dtype="float32", T=40, vocab=264, hidden=40,
        layer_types=[LIN, FULL, LIN, FULL],  # interval 2
        heads=8, kv_heads=2, head_dim=12,  # GQA 4, head_dim != 40/8
        lin_k_heads=4, lin_v_heads=4, lin_k_dim=8, lin_v_dim=12,  # Hv/Hk = 1, Dk != Dv
        experts=8, top_k=1, moe_inter=16, shared_inter=16,
        rope_theta=1e6, partial_rotary=1.0,
        layout="released", fused=True,
    ),
    Case(
        name="f32-released-perexpert-sharded",
        seed=1004, dtype="float32", T=140, vocab=260, hidden=32,
        layer_types=[LIN, LIN, FULL, LIN, FULL],  # irregular pattern
        heads=2, kv_heads=1, head_dim=32,  # GQA 2, head_dim != 32/2
        lin_k_heads=1, lin_v_heads=3, lin_k_dim=12, lin_v_dim=16,  # Hv/Hk = 3, Dk != Dv
        experts=5, top_k=4, moe_inter=20, shared_inter=12,
        rope_theta=1e7, partial_rotary=0.25, rms_eps=1e-5,
        layout="released", fused=False, shards=3,
    ),
    Case(
        name="bf16-text-perexpert",
        seed=2001, dtype="bfloat16", T=32, vocab=288, hidden=48,
        layer_types=[LIN, LIN, LIN, FULL],
        heads=4, kv_heads=1, head_dim=32,  # GQA 4, head_dim != 48/4
        lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32,  # Hv/Hk = 2
        experts=6, top_k=2, moe_inter=24, shared_inter=32,
        rope_theta=1e7, partial_rotary=0.25,
    ),
    Case(
        name="bf16-released-fused-sharded",
        seed=2002, dtype="bfloat16", T=130, vocab=256, hidden=48,
        layer_types=[LIN, LIN, FULL, LIN, LIN],  # interval 3 (truncated)
        heads=4, kv_heads=2, head_dim=24,  # GQA 2, head_dim != 48/4
        lin_k_heads=2, lin_v_heads=6, lin_k_dim=16, lin_v_dim=24,  # Hv/Hk = 3, Dk != Dv
        experts=8, top_k=3, moe_inter=24, shared_inter=24,
        rope_theta=1e7, partial_rotary=0.5,
        layout="released", fused=True, shards=2, a_log_f32=True,
    ),
    Case(
        name="bf16-released-perexpert",
        seed=2003, dtype="bfloat16", T=130, vocab=256, hidden=48,
        layer_types=[FULL, LIN, FULL, LIN],  # starts with full attention, interval 2 shifted
        heads=6, kv_heads=6, head_dim=16,  # GQA 1, head_dim != 48/6
        lin_k_heads=3, lin_v_heads=3, lin_k_dim=16, lin_v_dim=8,  # Hv/Hk = 1, Dk != Dv
        experts=4, top_k=1, moe_inter=24, shared_inter=16,
        rope_theta=5e6, partial_rotary=1.0,
        layout="released", fused=False,
    ),
]


# --------------------------------------------------------------------------------------
# model construction


def make_config(c: Case) -> Qwen3_5MoeTextConfig:
    assert len(c.layer_types) >= 1 and c.heads % c.kv_heads == 0 and c.lin_v_heads % c.lin_k_heads == 0
    assert c.rotary_dim % 2 == 0
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=len(c.layer_types),
        layer_types=list(c.layer_types),
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        linear_num_key_heads=c.lin_k_heads,
        linear_num_value_heads=c.lin_v_heads,
        linear_key_head_dim=c.lin_k_dim,
        linear_value_head_dim=c.lin_v_dim,
        linear_conv_kernel_dim=c.conv_kernel,
        num_experts=c.experts,
        num_experts_per_tok=c.top_k,
        moe_intermediate_size=c.moe_inter,
        shared_expert_intermediate_size=c.shared_inter,
        rms_norm_eps=c.rms_eps,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary,
            "mrope_section": c.mrope_section,
            "mrope_interleaved": True,
        },
    )
    # sanity: the value inside rope_parameters is the one the model uses
    assert cfg.rope_parameters["partial_rotary_factor"] == c.partial_rotary
    return cfg


@torch.no_grad()
def perturb_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter with seeded random values (model still in float32)."""

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            v = normal(shape, 1.0)
        elif name == "lm_head.weight":
            v = normal(shape, 2.0 / math.sqrt(shape[1]))
        elif name.endswith("linear_attn.norm.weight"):  # RMSNormGated: plain weight, init ones
            v = normal(shape, 0.2, 1.0)
        elif name.endswith("norm.weight"):  # zero-centred RMSNorm (1 + w), init zeros
            # input/post_attention layernorm, final norm, q_norm, k_norm
            v = normal(shape, 0.2)
        elif name.endswith("linear_attn.A_log"):
            a = torch.rand(shape, generator=gen) * (0.6 - 0.03) + 0.03  # A = exp(A_log) in (0.03, 0.6)
            v = a.log()
        elif name.endswith("linear_attn.dt_bias"):
            v = normal(shape, 0.5, 0.5)
        elif name.endswith("conv1d.weight"):  # [C, 1, K]
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):  # router [E, D]
            v = normal(shape, 1.5 / math.sqrt(shape[1]))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2F, D]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith("experts.down_proj"):  # [E, D, F]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith(".weight") and p.dim() == 2:  # every other nn.Linear [out, in]
            v = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise RuntimeError(f"parameter {name} {shape} not covered by perturb_")
        p.copy_(v)


def build_model(c: Case) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(c.seed)
    cfg = make_config(c)
    model = Qwen3_5MoeForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(c.seed * 7919 + 17)
    perturb_(model, gen)
    # cast the parameters only: `model.to(bf16)` would also round the f32 RoPE `inv_freq`
    # buffer to bf16, which from_pretrained(dtype=bf16) does not do
    dt = getattr(torch, c.dtype)
    for p in model.parameters():
        p.data = p.data.to(dt)
    model.config.dtype = dt
    return model.eval()


def load_hf(ckpt: Path, c: Case) -> Qwen3_5MoeForCausalLM:
    m = Qwen3_5MoeForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager", dtype=getattr(torch, c.dtype))
    return m.eval()


def assert_same_params(ref, got, what: str) -> None:
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert set(ref_sd) == set(got_sd), set(ref_sd) ^ set(got_sd)
    for k in ref_sd:
        assert ref_sd[k].dtype == got_sd[k].dtype and torch.equal(ref_sd[k], got_sd[k]), f"{what}: differs at {k}"
    for (k, a), (_, b) in zip(ref.named_buffers(), got.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: buffer {k} differs"


# --------------------------------------------------------------------------------------
# reference computation


@torch.no_grad()
def count_exact_ties(model, c: Case, tokens: torch.Tensor) -> tuple:
    """(#routing decisions whose k-th and (k+1)-th router logits are exactly equal,
    #rows whose two largest logits are exactly equal). In bf16 both happen by chance; an exact
    routing tie makes HF's choice depend on torch.topk's tie-breaking."""
    out = model(input_ids=tokens[None], use_cache=False, output_router_logits=True)
    n_route = 0
    if c.top_k < c.experts:
        for r in out.router_logits:
            srt = r.float().sort(dim=-1, descending=True).values
            n_route += int((srt[:, c.top_k - 1] == srt[:, c.top_k]).sum())
    top2 = out.logits[0].float().topk(2, dim=-1).values
    return n_route, int((top2[:, 0] == top2[:, 1]).sum())


def choose_tokens(model, c: Case, attempts: int = 48) -> tuple:
    """Draw T random token ids (seeded); redraw (up to `attempts` times) while the forward pass
    has exact routing ties or exact top-1 ties, keeping the best draw. Returns (tokens, attempt)."""
    best = None
    for attempt in range(attempts):
        gen = torch.Generator().manual_seed(c.seed * 104729 + 3 + 1000003 * attempt)
        tokens = torch.randint(0, c.vocab, (c.T,), generator=gen, dtype=torch.int64)
        ties = count_exact_ties(model, c, tokens)
        if best is None or ties < best[0]:
            best = (ties, tokens, attempt)
        if ties == (0, 0):
            break
    return best[1], best[2]


@torch.no_grad()
def run_reference(model, c: Case, tokens: torch.Tensor) -> dict:
    ids = tokens[None, :]
    last_out = {}

    def hook(_m, _a, out):
        last_out["h"] = out[0] if isinstance(out, tuple) else out

    routed = []

    def router_hook(_m, _a, out):
        _logits, scores, idx = out
        routed.append((idx.clone(), scores.float().clone()))

    hooks = [model.model.layers[-1].register_forward_hook(hook)]
    hooks += [layer.mlp.gate.register_forward_hook(router_hook) for layer in model.model.layers]
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True, output_router_logits=True)
    for h in hooks:
        h.remove()
    assert len(routed) == len(c.layer_types)
    router_topk_idx = torch.stack([r[0] for r in routed]).to(torch.int64)  # [L, T, k]
    router_topk_weight = torch.stack([r[1] for r in routed])  # [L, T, k]
    logits = out.logits[0].float()
    hs = torch.stack([x[0].float() for x in out.hidden_states])
    assert hs.shape == (len(c.layer_types) + 1, c.T, c.hidden), hs.shape
    router = torch.stack([r.float().reshape(c.T, c.experts) for r in out.router_logits])
    last_layer_out = last_out["h"][0].float()
    # hidden_states[-1] must be the final-normed output (HF ties it to last_hidden_state)
    assert torch.equal(model.model.norm(last_out["h"])[0].float(), hs[-1])

    # second way: prefill T-N_DECODE tokens, then N_DECODE single-token steps through the cache
    n_pre = c.T - N_DECODE
    o = model(input_ids=ids[:, :n_pre], use_cache=True)
    pkv = o.past_key_values
    prefill_diff = (o.logits[0].float() - logits[:n_pre]).abs().max().item()
    dec = []
    for t in range(n_pre, c.T):
        o = model(input_ids=ids[:, t : t + 1], past_key_values=pkv, use_cache=True)
        pkv = o.past_key_values
        dec.append(o.logits[0, -1].float())
    logits_decode = torch.stack(dec)
    decode_diff = (logits_decode - logits[n_pre:]).abs().max().item()

    # routing margins: gap between the k-th and (k+1)-th router logit (HF picks top-k of softmax(logits))
    if c.top_k < c.experts:
        srt = router.sort(dim=-1, descending=True).values
        gaps = srt[..., c.top_k - 1] - srt[..., c.top_k]
        margin = gaps.min().item()
        router_ties = int((gaps == 0).sum())
        router_near = int((gaps < NEAR).sum())
    else:
        margin, router_ties, router_near = float("inf"), 0, 0
    top2 = logits.topk(2, dim=-1).values
    top1_gaps = top2[:, 0] - top2[:, 1]
    return {
        "tensors": {
            "tokens": tokens.to(torch.int64).contiguous(),
            "logits": logits.contiguous(),
            "hidden_states": hs.contiguous(),
            "last_layer_out": last_layer_out.contiguous(),
            "logits_decode": logits_decode.contiguous(),
            "router_logits": router.contiguous(),
            "router_topk_idx": router_topk_idx.contiguous(),
            "router_topk_weight": router_topk_weight.contiguous(),
        },
        "max_abs_logit": logits.abs().max().item(),
        "min_top1_gap": top1_gaps.min().item(),
        "n_top1_near": int((top1_gaps < NEAR).sum()),
        "n_top1_ties": int((top1_gaps == 0).sum()),
        "n_router_decisions": router.shape[0] * router.shape[1],
        "n_router_ties": router_ties,
        "n_router_near": router_near,
        "prefill_diff": prefill_diff,
        "decode_diff": decode_diff,
        "min_router_margin": margin,
    }


def gdn_decay_range(model) -> tuple:
    """Range of exp(g) over the reference run is data dependent; report exp(-A * softplus(dt_bias)) instead."""
    lo, hi = 1.0, 0.0
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            la = layer.linear_attn
            g = -la.A_log.float().exp() * torch.nn.functional.softplus(la.dt_bias.float())
            lo = min(lo, g.exp().min().item())
            hi = max(hi, g.exp().max().item())
    return lo, hi


# --------------------------------------------------------------------------------------
# checkpoint layouts


def load_all(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        if f.name == "reference.safetensors":
            continue
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                assert k not in out, k
                out[k] = fh.get_tensor(k)
    return out


def released_config(text_cfg: dict, c: Case) -> dict:
    tc = {k: v for k, v in text_cfg.items() if k not in ("architectures", "transformers_version")}
    tc["model_type"] = "qwen3_5_moe_text"
    # like the real config: partial_rotary_factor both at text_config level and in rope_parameters
    tc["partial_rotary_factor"] = c.partial_rotary
    # keys present in the released text_config that HF's text config does not define
    tc["attn_output_gate"] = True
    tc["mamba_ssm_dtype"] = "float32"
    tc["mtp_num_hidden_layers"] = 1
    tc["mtp_use_dedicated_embeddings"] = False
    n = len(c.layer_types)
    for interval in range(1, n + 1):
        if all((c.layer_types[i] == FULL) == ((i + 1) % interval == 0) for i in range(n)):
            tc["full_attention_interval"] = interval
            break
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "dtype": c.dtype,
        "image_token_id": c.vocab - 4,
        "video_token_id": c.vocab - 3,
        "vision_start_token_id": c.vocab - 2,
        "vision_end_token_id": c.vocab - 1,
        "tie_word_embeddings": False,
        "text_config": tc,
        "vision_config": {
            "model_type": "qwen3_5_moe_vision",
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_size": 8,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 16,
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": c.hidden,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_patch_size": 1,
        },
        "transformers_version": transformers.__version__,
    }


def to_released_layout(src: Path, dst: Path, c: Case, gen: torch.Generator) -> dict:
    """Rewrite a save_pretrained (text, per-expert) checkpoint into the released layout.

    Returns the dict of tensors written (name -> tensor)."""
    dt = getattr(torch, c.dtype)
    text_tensors = load_all(src)
    out = {}
    E = c.experts
    for name, t in text_tensors.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        assert name.startswith("model."), name
        new = "model.language_model." + name[len("model.") :]
        if c.a_log_f32 and name.endswith("linear_attn.A_log"):
            t = t.to(torch.float32)  # values are bf16-exact
        out[new] = t
    if c.fused:
        for L in range(len(c.layer_types)):
            p = f"model.language_model.layers.{L}.mlp.experts."
            gate = [out.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
            up = [out.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
            down = [out.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
            out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)]).contiguous()
            out[p + "down_proj"] = torch.stack(down).contiguous()
    # dummy tensors that loaders must skip
    D, F = c.hidden, c.moe_inter

    def rnd(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(dt)

    out["model.visual.patch_embed.proj.weight"] = rnd(8, 3, 1, 2, 2)
    out["model.visual.patch_embed.proj.bias"] = rnd(8)
    out["model.visual.blocks.0.norm1.weight"] = rnd(8)
    out["model.visual.merger.linear_fc2.weight"] = rnd(D, 32)
    out["mtp.fc.weight"] = rnd(D, 2 * D)
    out["mtp.pre_fc_norm_embedding.weight"] = rnd(D)
    out["mtp.norm.weight"] = rnd(D)
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = rnd(F, D)  # MTP keeps per-expert names
    out["mtp.layers.0.mlp.gate.weight"] = rnd(E, D)

    dst.mkdir(parents=True, exist_ok=True)
    text_cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(released_config(text_cfg, c), indent=2, sort_keys=False) + "\n")
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")

    names = sorted(out)
    if c.shards == 1:
        save_file({k: out[k].contiguous() for k in names}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        sizes = {k: out[k].numel() * out[k].element_size() for k in names}
        total = sum(sizes.values())
        per = total / c.shards
        groups = [[] for _ in range(c.shards)]
        acc = 0
        for k in names:
            i = min(int(acc // per), c.shards - 1)
            groups[i].append(k)
            acc += sizes[k]
        assert all(groups), "empty shard"
        weight_map = {}
        for i, g in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{c.shards:05d}.safetensors"
            save_file({k: out[k].contiguous() for k in g}, str(dst / fname), metadata={"format": "pt"})
            for k in g:
                weight_map[k] = fname
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def check_released_equal(text_dir: Path, rel_dir: Path, c: Case) -> None:
    """Reload the released files and undo rename/fuse: must equal the save_pretrained tensors bit for bit."""
    a = load_all(text_dir)
    b = load_all(rel_dir)
    back = {}
    for k, t in b.items():
        if k.startswith("model.visual.") or k.startswith("mtp."):
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model.") :]
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                back[f"{p}{e}.gate_proj.weight"] = t[e, :F]
                back[f"{p}{e}.up_proj.weight"] = t[e, F:]
            continue
        if k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                back[f"{p}{e}.down_proj.weight"] = t[e]
            continue
        back[k] = t
    assert set(a) == set(back), set(a) ^ set(back)
    for k in a:
        x, y = a[k], back[k]
        if y.dtype != x.dtype:
            assert c.a_log_f32 and k.endswith("A_log") and y.dtype == torch.float32, (k, x.dtype, y.dtype)
            y = y.to(x.dtype)
        assert x.shape == y.shape and torch.equal(x, y), k
    if c.shards > 1:
        idx = json.loads((rel_dir / "model.safetensors.index.json").read_text())
        assert set(idx["weight_map"]) == set(b)
        assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())


@torch.no_grad()
def check_hf_reload(ckpt: Path, c: Case, ref_model, tokens: torch.Tensor, logits: torch.Tensor) -> float:
    """Load a case directory back with transformers: every parameter and buffer must equal the
    reference model bit for bit; returns max |logits(reloaded) - reference logits|."""
    m = load_hf(ckpt, c)
    assert m.config.rope_parameters["partial_rotary_factor"] == c.partial_rotary
    assert list(m.config.layer_types) == list(c.layer_types)
    assert_same_params(ref_model, m, f"{c.name}: reload of {ckpt}")
    got = m(input_ids=tokens[None], use_cache=False).logits[0].float()
    d = (got - logits).abs().max().item()
    # Not always bit-exact: tensors loaded from another file offset have another memory alignment,
    # and CPU matmul kernels may then sum in another order (~1e-6 in f32; bf16 rounding can then
    # flip by an ulp and propagate). Allow 1e-4 relative (f32) / 4 bf16 ulps of the largest logit.
    mx = max(1.0, logits.abs().max().item())
    tol = 1e-4 * mx if c.dtype == "float32" else 4 * 2.0 ** (math.floor(math.log2(mx)) - 7)
    assert d <= tol, f"{c.name}: HF reload gives logits diff {d} > {tol}"
    return d


@torch.no_grad()
def check_hf_condgen(ckpt: Path, c: Case, tokens: torch.Tensor, logits: torch.Tensor) -> float:
    """Released layout only: load with the released architecture class (vision tower partly
    random: the dummy vision tensors do not cover it) and run the text-only forward."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    m = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(ckpt), attn_implementation="eager", dtype=getattr(torch, c.dtype)
    ).eval()
    got = m(input_ids=tokens[None], use_cache=False).logits[0].float()
    d = (got - logits).abs().max().item()
    mx = max(1.0, logits.abs().max().item())
    tol = 1e-4 * mx if c.dtype == "float32" else 4 * 2.0 ** (math.floor(math.log2(mx)) - 7)
    assert d <= tol, f"{c.name}: Qwen3_5MoeForConditionalGeneration logits diff {d} > {tol}"
    return d


@torch.no_grad()
def run_f32_compute(ckpt: Path, c: Case, tokens: torch.Tensor) -> dict:
    """bf16 cases: the same bf16 checkpoint loaded with dtype=float32 (weights upcast exactly)
    and run in f32. An engine that keeps bf16 weights but computes in f32 should match these
    logits tightly, while HF's bf16 logits differ from them by bf16 noise and routing flips."""
    m = Qwen3_5MoeForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager", dtype=torch.float32).eval()
    out = m(input_ids=tokens[None], use_cache=False, output_router_logits=True)
    logits = out.logits[0].float().contiguous()
    margin = float("inf")
    if c.top_k < c.experts:
        for r in out.router_logits:
            srt = r.float().sort(dim=-1, descending=True).values
            margin = min(margin, (srt[:, c.top_k - 1] - srt[:, c.top_k]).min().item())
    top2 = logits.topk(2, dim=-1).values
    return {
        "logits_f32": logits,
        "f32_compute_min_router_margin": margin,
        "f32_compute_min_top1_gap": (top2[:, 0] - top2[:, 1]).min().item(),
    }


# --------------------------------------------------------------------------------------


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_case(c: Case) -> dict:
    print(f"== {c.name}", flush=True)
    case_dir = OUT_ROOT / c.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model = build_model(c)
    gen = torch.Generator().manual_seed(c.seed * 104729 + 5)  # dummy visual/mtp tensors

    with tempfile.TemporaryDirectory() as tmp:
        text_dir = Path(tmp) / "text"
        model.save_pretrained(str(text_dir), safe_serialization=True)
        # the reference runs on the model as transformers loads it from the checkpoint
        ref_model = load_hf(text_dir, c)
        assert_same_params(model, ref_model, f"{c.name}: from_pretrained(save_pretrained)")
        experts_impl = ref_model.config._experts_implementation
        tokens, token_attempt = choose_tokens(ref_model, c)
        ref = run_reference(ref_model, c, tokens)
        if c.layout == "text":
            shutil.copytree(text_dir, case_dir)
        else:
            to_released_layout(text_dir, case_dir, c, gen)
            check_released_equal(text_dir, case_dir, c)
    reload_diff = check_hf_reload(case_dir, c, ref_model, tokens, ref["tensors"]["logits"])
    condgen_diff = check_hf_condgen(case_dir, c, tokens, ref["tensors"]["logits"]) if c.layout == "released" else None
    decay_lo, decay_hi = gdn_decay_range(ref_model)
    f32_info = {}
    if c.dtype != "float32":
        f32_info = run_f32_compute(case_dir, c, tokens)
        ref["tensors"]["logits_f32"] = f32_info.pop("logits_f32")
        f32_info["bf16_vs_f32_compute_logits_max_abs_diff"] = (
            (ref["tensors"]["logits"] - ref["tensors"]["logits_f32"]).abs().max().item()
        )
        agree = int((ref["tensors"]["logits"].argmax(-1) == ref["tensors"]["logits_f32"].argmax(-1)).sum())
        f32_info["bf16_vs_f32_compute_argmax_agree"] = f"{agree}/{c.T}"

    # a single metadata key: safetensors writes multi-key metadata in a non-deterministic order
    save_file(ref["tensors"], str(case_dir / "reference.safetensors"), metadata={
        "generator": f"tools/make_fixtures.py case={c.name} torch={torch.__version__} "
        f"transformers={transformers.__version__}",
    })
    files = sorted(p.name for p in case_dir.iterdir())
    size = sum(p.stat().st_size for p in case_dir.iterdir())
    info = {
        "name": c.name,
        "dtype": c.dtype,
        "T": c.T,
        "n_decode": N_DECODE,
        "layout": c.layout,
        "experts_layout": "fused" if c.fused else "per_expert",
        "sharded": c.shards > 1,
        "n_shards": c.shards,
        "a_log_f32": c.a_log_f32,
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "num_hidden_layers": len(c.layer_types),
        "layer_types": c.layer_types,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "linear_num_key_heads": c.lin_k_heads,
        "linear_num_value_heads": c.lin_v_heads,
        "linear_key_head_dim": c.lin_k_dim,
        "linear_value_head_dim": c.lin_v_dim,
        "linear_conv_kernel_dim": c.conv_kernel,
        "num_experts": c.experts,
        "num_experts_per_tok": c.top_k,
        "moe_intermediate_size": c.moe_inter,
        "shared_expert_intermediate_size": c.shared_inter,
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary,
        "rotary_dim": c.rotary_dim,
        "rms_norm_eps": c.rms_eps,
        "params": param_count(model),
        "files": files,
        "bytes": size,
        "max_abs_logit": ref["max_abs_logit"],
        "min_top1_gap": ref["min_top1_gap"],
        "hf_prefill_vs_full_max_abs_diff": ref["prefill_diff"],
        "hf_decode_vs_full_max_abs_diff": ref["decode_diff"],
        "min_router_margin": ref["min_router_margin"],
        "n_top1_near": ref["n_top1_near"],
        "n_top1_ties": ref["n_top1_ties"],
        "n_router_decisions": ref["n_router_decisions"],
        "n_router_ties": ref["n_router_ties"],
        "n_router_near": ref["n_router_near"],
        "gdn_base_decay_range": [decay_lo, decay_hi],
        "hf_reload_logits_max_abs_diff": reload_diff,
        "hf_condgen_logits_max_abs_diff": condgen_diff,
        "hf_experts_implementation": experts_impl,
        "token_draw_attempt": token_attempt,
        **f32_info,
    }
    print(json.dumps({k: info[k] for k in ("max_abs_logit", "min_top1_gap", "hf_prefill_vs_full_max_abs_diff",
                                            "hf_decode_vs_full_max_abs_diff", "min_router_margin", "n_top1_near", "n_top1_ties", "token_draw_attempt",
                                            "n_router_ties", "n_router_near", "hf_reload_logits_max_abs_diff",
                                            "hf_condgen_logits_max_abs_diff",
                                            "gdn_base_decay_range", "bytes")}), flush=True)
    return info


def fmt_layers(lt) -> str:
    return "".join("F" if t == FULL else "L" for t in lt)


def write_readme(infos: list) -> None:
    geo_rows, res_rows = [], []
    for i in infos:
        layout = i["layout"] + (", fused" if i["experts_layout"] == "fused" else ", per-expert")
        layout += f", {i['n_shards']} shards" if i["sharded"] else ", 1 file"
        if i["a_log_f32"]:
            layout += ", A_log F32"
        geo_rows.append(
            f"| `{i['name']}` | {i['dtype']} | {layout} | {i['T']} | {i['vocab_size']} | {i['hidden_size']} | "
            f"`{fmt_layers(i['layer_types'])}` | {i['num_attention_heads']}/{i['num_key_value_heads']} | "
            f"{i['head_dim']} | {i['rotary_dim']} ({i['partial_rotary_factor']:g}) | {i['rope_theta']:g} | "
            f"{i['linear_num_key_heads']}/{i['linear_num_value_heads']} | "
            f"{i['linear_key_head_dim']}/{i['linear_value_head_dim']} | "
            f"{i['num_experts']}/{i['num_experts_per_tok']} | {i['moe_intermediate_size']}/"
            f"{i['shared_expert_intermediate_size']} | {i['rms_norm_eps']:g} | {i['params']} | {i['bytes'] / 1024:.0f} KiB |"
        )
        cg = i.get("hf_condgen_logits_max_abs_diff")
        res_rows.append(
            f"| `{i['name']}` | {i['max_abs_logit']:.3f} | {i['min_top1_gap']:.3g} / {i['n_top1_ties']} / "
            f"{i['n_top1_near']} | {i['hf_prefill_vs_full_max_abs_diff']:.2e} | "
            f"{i['hf_decode_vs_full_max_abs_diff']:.2e} | {i['min_router_margin']:.3g} / {i['n_router_ties']} / "
            f"{i['n_router_near']} of {i['n_router_decisions']} | {i['hf_reload_logits_max_abs_diff']:.2e} | "
            f"{'—' if cg is None else f'{cg:.2e}'} | {i['gdn_base_decay_range'][0]:.2f}–{i['gdn_base_decay_range'][1]:.3f} |"
        )
    bf_rows = [
        f"| `{i['name']}` | {i['bf16_vs_f32_compute_logits_max_abs_diff']:.3f} | "
        f"{i['bf16_vs_f32_compute_argmax_agree']} | {i['f32_compute_min_router_margin']:.3g} | "
        f"{i['f32_compute_min_top1_gap']:.3g} |"
        for i in infos
        if i["dtype"] != "float32"
    ]
    tv, trv = torch.__version__, transformers.__version__
    total = sum(i["bytes"] for i in infos)
    text = f"""# Golden model fixtures (`qwen3_5_moe`)

Generated by `tools/make_fixtures.py` — regenerate everything with

    /opt/refenv/bin/python tools/make_fixtures.py

(CPU only, deterministic, seeded per case; every case directory is deleted and rewritten).
Versions: **torch {tv}**, **transformers {trv}** (`Qwen3_5MoeTextConfig` +
`Qwen3_5MoeForCausalLM`, `attn_implementation="eager"`, experts implementation
`{infos[0].get('hf_experts_implementation')}` = the transformers default; the pure-PyTorch GDN/conv
fallbacks are used, flash-linear-attention and causal-conv1d are not installed).

Each case is a tiny *random* model. Every parameter is overwritten with seeded random values
so that no HF init special case hides a bug: linears N(0, 1/fan_in), router N(0, (1.5)²/D),
lm_head N(0, 4/D), embeddings N(0, 1), zero-centred RMSNorm weights (layer norms, final norm,
q_norm, k_norm; used as 1+w) N(0, 0.2²), RMSNormGated weight (`linear_attn.norm`, used as w)
1 + N(0, 0.2²), A = exp(A_log) ~ U(0.03, 0.6), dt_bias ~ N(0.5, 0.5²), conv1d N(0, 1/4).
The reference is computed on the model **as `from_pretrained` loads it from the
`save_pretrained` output** (parameters in the case dtype, RoPE `inv_freq` in f32).
`cases.json` lists every case with its full geometry, layout flags and the numbers below.

## Cases

`L` = linear_attention (Gated DeltaNet), `F` = full_attention. H/KV = attention heads / KV heads;
hd = head_dim; rot = rotary dims per head = int(hd · partial_rotary_factor) (factor in brackets);
Hk/Hv = GDN key / value heads; Dk/Dv = GDN key / value head dims; E/k = experts / top-k;
F/Fs = expert / shared-expert intermediate size.

| case | dtype | layout | T | V | D | layers | H/KV | hd | rot | θ | Hk/Hv | Dk/Dv | E/k | F/Fs | eps | params | size |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(geo_rows) + f"""

Total: {total / 1024:.0f} KiB.

## Reference numbers

- **max\\|logit\\|** over all T×V logits.
- **top-1 gap** = min over rows of (largest − second largest logit) / #rows where they are exactly
  equal / #rows where the gap is < {NEAR}. Only compare argmax on rows with a clear gap.
- **prefill diff** = max |logits(prefill of the first T−5 tokens with a cache) − logits(full forward)|;
  **decode diff** = the same for the last 5 tokens fed one at a time through HF's cache (GDN
  recurrent kernel + conv state + KV cache), i.e. HF's own chunked vs recurrent agreement
  (`logits_decode` holds these decode logits). In bf16 a difference of 1 ulp (0.0156/0.03125 for
  |logit| in [2,4)/[4,8)) is HF's own noise.
- **router margin** = min over all (layer, token) of the gap between the k-th and (k+1)-th
  largest router logit / #exact ties / #gaps < {NEAR}, of all routing decisions. The token ids were
  redrawn (seeded, see `token_draw_attempt` in cases.json) until no routing decision is an exact
  tie and, where possible, no row has an exact top-1 tie. An engine whose router logits differ by
  more than the margin routes that token to another expert; in bf16, with near-ties at the
  1-ulp level, expect an occasional routing flip unless the engine reproduces HF's bf16 rounding
  points exactly (`router_topk_idx` tells you whether a mismatch is a routing flip).
- **reload diff** = max |logits| difference when the case directory is loaded back with
  `Qwen3_5MoeForCausalLM.from_pretrained` (all parameters and buffers were checked bit-equal);
  **condgen diff** = the same with `Qwen3_5MoeForConditionalGeneration.from_pretrained`
  (released layout only, text-only input). Non-zero values come from other memory alignment of
  the loaded tensors (CPU kernels then sum in another order): HF is not bit-reproducible even
  against itself at that level.
- **decay** = range over GDN heads of exp(−exp(A_log)·softplus(dt_bias)), the per-step decay at
  a = 0 (the actual exp(g) also depends on `in_proj_a(x)`).

| case | max\\|logit\\| | top-1 gap (min / ties / near) | prefill diff | decode diff | router margin (min / ties / near) | reload diff | condgen diff | decay |
|---|---|---|---|---|---|---|---|---|
""" + "\n".join(res_rows) + f"""

bf16 cases, HF bf16 vs the same weights computed in f32 (`logits` vs `logits_f32`):

| case | max \|logits − logits_f32\| | argmax agreement | f32-compute router margin | f32-compute top-1 gap |
|---|---|---|---|---|
""" + "\n".join(bf_rows) + f"""

bf16 noise is large in these tiny random models (O(1) on logits of magnitude ~8, and a routing
flip with k = 1 changes a token completely), so the bf16 `logits` are only a tight target for an
engine that reproduces HF's bf16 rounding points. An independent float64 implementation of the
MODEL.md math matches `logits` of the f32 cases and `logits_f32` of the bf16 cases to ~3e-5.

Suggested tolerances for a Rust engine: f32 cases, and `logits_f32` of bf16 cases (bf16 weights,
f32 compute) — logits within ~1e-4 abs (HF's own chunked vs recurrent disagreement is ~1e-5);
bf16 compute against `logits` — a few bf16 ulps of max|logit| (≈0.1–0.2) on most rows, with
isolated larger deviations where a routing near-tie flips (check `router_topk_idx`).

## Case directory layout

**Text layout** (`layout = "text"`): exactly what `Qwen3_5MoeForCausalLM.save_pretrained(dir,
safe_serialization=True)` writes in transformers {trv}:

- `config.json` — flat text config: `architectures: ["Qwen3_5MoeForCausalLM"]`,
  `model_type: "qwen3_5_moe_text"`, `layer_types`, `head_dim`, `linear_*`, `num_experts`, …, `dtype`,
  and `rope_parameters: {{"rope_type": "default", "rope_theta", "partial_rotary_factor",
  "mrope_section", "mrope_interleaved"}}`. **Trap:** it also holds a top-level
  `"partial_rotary_factor": 0.25` (the config class's backward-compat default) even when
  `rope_parameters.partial_rotary_factor` differs (cases with factor 0.5 / 1.0). HF uses the value
  in `rope_parameters` (priority: `rope_parameters` > top-level key > 0.25 default). No
  `rope_theta` at top level.
- `generation_config.json`
- `model.safetensors` — `model.embed_tokens.weight`, `model.norm.weight`, `model.layers.L.…`,
  `lm_head.weight`; experts **per expert**: `model.layers.L.mlp.experts.E.gate_proj.weight` [F, D],
  `…experts.E.up_proj.weight` [F, D], `…experts.E.down_proj.weight` [D, F]. (transformers {trv}
  holds experts fused in memory — `experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F] —
  and un-fuses them on save through its `qwen3_5_moe_text` conversion mapping.) All tensors are in
  the case dtype (A_log and dt_bias included).
- `reference.safetensors`

**Released layout** (`layout = "released"`), mimicking `Qwen/Qwen3.6-35B-A3B`:

- `config.json` — `architectures: ["Qwen3_5MoeForConditionalGeneration"]`,
  `model_type: "qwen3_5_moe"`, `dtype`, dummy `image_token_id`/`video_token_id`/
  `vision_start_token_id`/`vision_end_token_id`, `tie_word_embeddings: false`,
  `text_config` (`model_type: "qwen3_5_moe_text"`, `rope_parameters` inside it,
  `partial_rotary_factor` also at text_config level and equal to the one in `rope_parameters`, plus
  the released-only keys `attn_output_gate: true`, `mamba_ssm_dtype: "float32"`,
  `mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings: false`, and
  `full_attention_interval` when the pattern is periodic; `layer_types` is always explicit), and a
  small dummy `vision_config`.
- `generation_config.json`
- weights: `model.safetensors`, or `model-0000k-of-0000n.safetensors` +
  `model.safetensors.index.json` (`{{"metadata": {{"total_size": <bytes of tensor data>}},
  "weight_map": {{name: file}}}}`). Names: `model.language_model.X` for every text tensor,
  `lm_head.weight` unchanged, plus dummy `model.visual.*` and `mtp.*` tensors that the engine must
  skip (`mtp.layers.0.mlp.experts.0.gate_proj.weight` keeps per-expert naming even in fused cases).
  **Fused** cases store `model.language_model.layers.L.mlp.experts.gate_up_proj` [E, 2F, D]
  (rows 0..F−1 = gate, F..2F−1 = up) and `…mlp.experts.down_proj` [E, D, F] (no `.weight` suffix)
  instead of the per-expert tensors. **A_log F32**: a bf16 checkpoint whose `linear_attn.A_log`
  tensors are stored as F32 (bf16-exact values; HF casts them to bf16 on load, which is what the
  reference ran with).
- `reference.safetensors`

Released checkpoints were verified tensor by tensor (after undoing rename/fuse) against the
`save_pretrained` output, and load with both `Qwen3_5MoeForCausalLM` and
`Qwen3_5MoeForConditionalGeneration` (`from_pretrained`), reproducing the reference logits.

## reference.safetensors

| tensor | dtype | shape | meaning |
|---|---|---|---|
| `tokens` | I64 | [T] | random token ids in [0, V) (no BOS); positions are 0..T−1 |
| `logits` | F32 | [T, V] | one forward over all T tokens, no cache (bf16 cases: HF's bf16 logits, upcast exactly) |
| `hidden_states` | F32 | [L+1, T, D] | HF `output_hidden_states`: `[0]` = embedding output; `[i]` = output of decoder layer i−1 (residual stream after its MoE) for i = 1..L−1; **`[L]` = output of the final RMSNorm** (HF replaces the last layer's raw output by `last_hidden_state`, i.e. post-norm; `lm_head([L])` = `logits`) |
| `last_layer_out` | F32 | [T, D] | raw output of the last decoder layer (before the final norm) |
| `logits_decode` | F32 | [5, V] | logits of tokens T−5..T−1 from prefill(T−5) + 5 single-token cached steps |
| `router_logits` | F32 | [L, T, E] | router logits x·W_gateᵀ (before softmax; bf16 values in bf16 cases) per layer |
| `router_topk_idx` | I64 | [L, T, k] | experts HF selected (torch.topk order: descending probability) |
| `router_topk_weight` | F32 | [L, T, k] | their renormalised weights, as HF used them (cast to the case dtype, then upcast) |
| `logits_f32` | F32 | [T, V] | **bf16 cases only**: the same bf16 weights upcast exactly and run in f32 (`from_pretrained(dtype=float32)`), no cache — the target for an engine that keeps bf16 weights but computes in f32 |

Text-only input: the three mRoPE position streams are equal, so the rotary embedding is plain
1-D NeoX RoPE with position = token index, whatever `mrope_section` says.
"""
    (OUT_ROOT / "README.md").write_text(text)


def main(argv: list) -> None:
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    only = set(argv)
    unknown = only - set(names)
    if unknown:
        sys.exit(f"unknown case(s): {sorted(unknown)}")
    infos = []
    prev = {}
    cases_json = OUT_ROOT / "cases.json"
    if only and cases_json.exists():
        prev = {i["name"]: i for i in json.loads(cases_json.read_text())["cases"]}
    for c in CASES:
        if only and c.name not in only:
            if c.name not in prev:
                sys.exit(f"{c.name}: no previous cases.json entry; run without arguments")
            infos.append(prev[c.name])
            continue
        infos.append(run_case(c))
    # drop directories of cases that no longer exist
    for d in OUT_ROOT.iterdir():
        if d.is_dir() and d.name not in names:
            shutil.rmtree(d)
    cases_json.write_text(json.dumps({
        "generator": "tools/make_fixtures.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "n_decode": N_DECODE,
        "cases": infos,
    }, indent=2) + "\n")
    write_readme(infos)
    total = sum(p.stat().st_size for p in OUT_ROOT.rglob("*") if p.is_file())
    print(f"total fixture size: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
