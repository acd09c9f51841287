"""Reference computation with HF transformers: token choice, the reference forward passes,
reload checks, f32-compute logits, and `run_case` (one case directory end to end)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM

from .cases import N_DECODE, NEAR, OUT_ROOT, Case
from .model import assert_same_params, build_model, gdn_decay_range, load_hf, param_count
from .released import check_released_equal, to_released_layout


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


def case_geometry(c: Case) -> dict:
    """A case's model geometry as cases.json records it (the keys in this order)."""
    return {
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
    }


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
        **case_geometry(c),
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
