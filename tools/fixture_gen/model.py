"""Config/model construction and checks: the random model of a case, loading it back,
parameter comparison and counts, GDN decay range, reading all checkpoint tensors."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from .cases import Case


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


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
