#!/usr/bin/env python3
"""FP8 golden fixtures for Lily: tiny random Qwen3.5/3.6-MoE (`qwen3_5_moe`) checkpoints in the
layout of the official `Qwen/Qwen3.6-35B-A3B-FP8` / `Qwen/Qwen3.5-35B-A3B-FP8` releases
(fine-grained FP8: float8_e4m3fn weights with one `weight_scale_inv` per 128x128 block), plus
reference outputs computed by HF transformers on the EXACT dequantized weights.

Provenance
----------
No real weights are involved. For each case the script

1. builds the model the way `tools/make_fixtures.py` does (`fixture_gen.model.build_model`:
   `Qwen3_5MoeTextConfig` + `Qwen3_5MoeForCausalLM`, seeded, every parameter perturbed by
   `perturb_`, parameters cast to the case's base dtype), then upcasts the parameters to f32
   (exact) and rewrites it into the released layout with `fixture_gen.released.to_released_layout`
   (`model.language_model.` prefix, per-expert experts, dummy `model.visual.*` / `mtp.*` tensors);
2. decides per tensor, by the rule of the official config, what becomes FP8: every 2-D `*.weight`
   whose module name is NOT in `modules_to_not_convert` (exact module-name match, the list
   enumerates every module by its full name like the official one). In the text model that is
   exactly q/k/v/o_proj, linear_attn.in_proj_qkv / in_proj_z / out_proj, the shared expert's
   gate/up/down_proj and every routed expert's gate/up/down_proj. Embeddings, lm_head, norms,
   the router `mlp.gate`, `mlp.shared_expert_gate`, `linear_attn.in_proj_a` / `in_proj_b`,
   conv1d, A_log and dt_bias stay in the base dtype;
3. quantizes each such matrix W [out, in] (f32 values, exactly the base-dtype values) per
   128x128 block (the last block of a dimension that is not a multiple of 128 is partial):
       s_blk  = fl32(amax(|W_blk|) / 448)          (1.0 for an all-zero block)
       s_st   = s_blk rounded (RNE) to the scale storage dtype (bf16 or f32)  -> weight_scale_inv
       q      = fp8_e4m3fn_RNE(clamp(fl32(W / s_st), -448, 448))          -> weight
   and defines the dequantized weight FROM THE STORED VALUES:
       W_deq[r, c] = fl32(f32(q[r, c]) * f32(s_st[r // 128, c // 128]))
   (`weight_scale_inv` MULTIPLIES, as in transformers' Fp8Dequantize and vLLM);
4. loads W_deq (and the base-dtype values of everything else, upcast to f32) into the f32 HF
   model, `save_pretrained` / `from_pretrained` it (f32, asserting bit-equal parameters) and
   computes the reference on that model exactly like the bf16/f32 fixtures
   (`fixture_gen.reference.choose_tokens` + `run_reference`: full forward, hidden states,
   router logits and choices, prefill + 5 cached decode steps), all in f32;
5. writes the FP8 checkpoint (config.json with a top-level `quantization_config`,
   generation_config.json, one or more safetensors files, index json when sharded) and
   `reference.safetensors`; for `fp8-tiny` also the unquantized base it was quantized from
   (`fp8-tiny-base/`: same names and layout, each FP8 weight as its base-dtype values W, no
   scales, no quantization_config, no reference), asserted to re-quantize with `quantize` to
   exactly the codes and scales written to fp8-tiny;
6. verifies: reads the written files back, dequantizes them with an independent per-block loop
   and checks every parameter bit-equal to the reference model; loads the directory with
   transformers' own FP8 support (`Qwen3_5MoeForCausalLM.from_pretrained`, which on a CPU-only
   machine dequantizes on load) and records its parameter / logits differences (asserted
   bit-equal where HF's dequantizer is exact, see the README);
7. writes the "bad" variants (copies of the tiny case with one defect each) and
   `fixtures/models-fp8/cases.json` + `fixtures/models-fp8/README.md`.

How to run
----------
    python tools/make_fp8_fixtures.py      # venv with torch, transformers==5.17.0, accelerate

CPU only, deterministic, seeded per case; `fixtures/models-fp8/` is deleted and rewritten.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_gen.cases import FULL, LIN, N_DECODE, NEAR, REPO, Case  # noqa: E402
from fixture_gen.model import (  # noqa: E402
    assert_same_params,
    build_model,
    gdn_decay_range,
    load_all,
    param_count,
)
from fixture_gen.readme import fmt_layers  # noqa: E402
from fixture_gen.reference import case_geometry, choose_tokens, run_reference  # noqa: E402
from fixture_gen.released import released_config, to_released_layout  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM  # noqa: E402

OUT_ROOT = REPO / "fixtures" / "models-fp8"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
BLOCK = (128, 128)
PREFIX = "model.language_model."
GENERATOR = "tools/make_fp8_fixtures.py"


# --------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Fp8Case:
    base: Case  # geometry + base dtype (`base.dtype`: dtype of every non-FP8 tensor)
    scale_dtype: str  # storage dtype of weight_scale_inv: "bfloat16" | "float32"
    split_scale: str | None = None  # sharded only: a weight whose weight_scale_inv goes to another shard
    note: str = ""

    @property
    def name(self) -> str:
        return self.base.name


CASES = [
    Fp8Case(
        # official-like: bf16 everything else, bf16 scales, sharded. Every FP8 dimension is either
        # <= 128 (one, possibly partial, block) or a multiple of 128, so transformers' CPU
        # dequantizer is exact on it (asserted).
        base=Case(
            name="fp8-bf16scale-sharded",
            seed=3001, dtype="bfloat16", T=32, vocab=160, hidden=256,
            layer_types=[LIN, FULL],
            heads=2, kv_heads=1, head_dim=64,  # q_proj [256, 256] = 2x2 full blocks; o_proj [256, 128]
            lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32,  # in_proj_qkv [256, 256], z [128, 256]
            experts=4, top_k=2, moe_inter=40, shared_inter=64,  # experts [40, 256]: 1 partial x 2 blocks
            rope_theta=1e7, partial_rotary=0.25,
            layout="released", fused=False, shards=3,
        ),
        scale_dtype="bfloat16",
        split_scale="model.language_model.layers.0.mlp.experts.1.down_proj.weight",
        note="official-like dtypes (bf16 tensors, bf16 scales), 3 shards, one scale in another shard than its weight",
    ),
    Fp8Case(
        # f32 everything else, f32 scales, one file. Dimensions > 128 that are not multiples of
        # 128 (hidden 160 = 128 + 32, shared expert 200 = 128 + 72, q_proj 192, in_proj_qkv 240,
        # value dim 144): every such matrix has 2 blocks per dimension, the last one partial.
        base=Case(
            name="fp8-f32scale-partial",
            seed=3002, dtype="float32", T=40, vocab=136, hidden=160,
            layer_types=[FULL, LIN],
            heads=2, kv_heads=1, head_dim=48,  # q_proj [192, 160], o_proj [160, 96]
            lin_k_heads=1, lin_v_heads=2, lin_k_dim=48, lin_v_dim=72,  # in_proj_qkv [240, 160], out_proj [160, 144]
            experts=4, top_k=2, moe_inter=40, shared_inter=200,  # shared gate/up [200, 160], down [160, 200]
            rope_theta=1e6, partial_rotary=0.5,
            layout="released", fused=False, shards=1,
        ),
        scale_dtype="float32",
        note="f32 tensors and f32 scales, 1 file, partial blocks in both dimensions of most FP8 matrices",
    ),
    Fp8Case(
        # the base of the bad variants; also a cheap valid case
        base=Case(
            name="fp8-tiny",
            seed=3003, dtype="bfloat16", T=16, vocab=64, hidden=32,
            layer_types=[LIN, FULL],
            heads=2, kv_heads=1, head_dim=16,
            lin_k_heads=1, lin_v_heads=2, lin_k_dim=16, lin_v_dim=16,
            experts=2, top_k=1, moe_inter=72, shared_inter=16,  # experts [72, 32]: 2 blocks of 64 rows if the block were 64
            rope_theta=1e7, partial_rotary=0.25,
            layout="released", fused=False, shards=1,
        ),
        scale_dtype="bfloat16",
        note="tiny; the bad-* variants are copies of it with one defect each",
    ),
]

BAD_BASE = "fp8-tiny"
# case -> directory of its unquantized base checkpoint (for a load-time quantization test; not a case)
UNQUANT_BASE = {"fp8-tiny": "fp8-tiny-base"}
# name -> (description, expected behaviour)
BAD_VARIANTS = {
    "bad-missing-scale-inv": (
        "`model.language_model.layers.0.mlp.experts.1.down_proj.weight_scale_inv` removed (the weight stays F8_E4M3)",
        "refuse: an F8_E4M3 weight without its weight_scale_inv",
    ),
    "bad-block-size-64": (
        "config `weight_block_size: [64, 64]`; tensors unchanged (scales shaped for 128x128, e.g. experts "
        "[72, 32] carry a [1, 1] scale where 64x64 blocks need [2, 1])",
        "refuse: unsupported block size (and/or scale shape mismatch)",
    ),
    "bad-activation-static": (
        "config `activation_scheme: \"static\"`; tensors unchanged (no input scales)",
        "refuse: only dynamic activation quantization is supported (vLLM rejects block-wise + static too)",
    ),
    "bad-input-scale": (
        "an extra F32 scalar `model.language_model.layers.1.self_attn.q_proj.input_scale` (config still dynamic)",
        "refuse: unexpected tensor / static activation scale present",
    ),
    "bad-scale-shape": (
        "`model.language_model.layers.1.self_attn.o_proj.weight_scale_inv` stored as [1, 2] instead of [1, 1]",
        "refuse: weight_scale_inv shape != [ceil(out/128), ceil(in/128)]",
    ),
}


# --------------------------------------------------------------------------------------------
# the FP8 format


def quant_config(modules: list) -> dict:
    # key order as in the Qwen3-Next FP8 config copy (alphabetical)
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": modules,
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
    }


def modules_to_not_convert(c: Case) -> list:
    """The skip list in the style of the official Qwen FP8 configs: full module names, one entry
    per module and layer (Qwen3-Next-80B-A3B-FP8 pattern, Qwen3.5 names; in_proj_a, in_proj_b AND
    in_proj_ba for every linear-attention layer as reported for Qwen3.6-35B-A3B-FP8)."""
    mods = ["lm_head", PREFIX + "embed_tokens"]
    for i, t in enumerate(c.layer_types):
        p = f"{PREFIX}layers.{i}."
        layer = [p + "input_layernorm", p + "post_attention_layernorm", p + "mlp.gate", p + "mlp.shared_expert_gate"]
        if t == LIN:
            layer += [p + f"linear_attn.{m}" for m in ("A_log", "conv1d", "dt_bias", "in_proj_a", "in_proj_b",
                                                         "in_proj_ba", "norm")]
        else:
            layer += [p + "self_attn.q_norm", p + "self_attn.k_norm"]
        mods += sorted(layer)
    mods += ["model.visual.merger.linear_fc2"]
    mods += ["mtp.fc", "mtp.layers.0.input_layernorm", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate",
             "mtp.layers.0.post_attention_layernorm", "mtp.layers.0.self_attn.k_norm", "mtp.layers.0.self_attn.q_norm",
             "mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"]
    return mods


def is_fp8(name: str, t: torch.Tensor, skip: set) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and name[: -len(".weight")] not in skip


def scale_shape(shape) -> tuple:
    return (math.ceil(shape[0] / BLOCK[0]), math.ceil(shape[1] / BLOCK[1]))


def expand_scale(s: torch.Tensor, shape) -> torch.Tensor:
    """[ceil(R/128), ceil(C/128)] -> [R, C] (f32): element (r, c) gets s[r // 128, c // 128]."""
    return s.float().repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[: shape[0], : shape[1]]


def quantize(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple:
    """W [R, C] (f32) -> (q float8_e4m3fn [R, C], s scale_dtype [ceil(R/128), ceil(C/128)])."""
    assert w.dtype == torch.float32 and w.dim() == 2
    R, C = w.shape
    nr, nc = scale_shape(w.shape)
    s = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            amax = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]].abs().max()
            s[i, j] = amax / FP8_MAX if amax > 0 else 1.0
    s_st = s.to(scale_dtype)
    q = (w / expand_scale(s_st, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s_st


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    assert q.dtype == FP8 and tuple(s.shape) == scale_shape(q.shape), (q.shape, s.shape)
    return q.float() * expand_scale(s, q.shape)


def decode_e4m3fn(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> f32 by the bit formula (independent of torch's cast): sign = b >> 7,
    e = (b >> 3) & 15, m = b & 7; e == 0: (-1)^sign * m/8 * 2^-6 (subnormal); e == 15 and m == 7: NaN;
    else (-1)^sign * (1 + m/8) * 2^(e-7)."""
    b = q.view(torch.uint8).to(torch.int64)
    sign = 1.0 - 2.0 * (b >> 7).to(torch.float64)
    e, m = (b >> 3) & 15, (b & 7).to(torch.float64)
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64)))
    assert not bool(((e == 15) & (b & 7 == 7)).any()), "NaN in an FP8 tensor"
    return (sign * mag).to(torch.float32)


def dequantize_loop(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent block loop (bit-formula FP8 decode), used to check the written files."""
    R, C = q.shape
    out = torch.empty(R, C, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * BLOCK[0], min(R, (i + 1) * BLOCK[0])), slice(j * BLOCK[1], min(C, (j + 1) * BLOCK[1]))
            out[rs, cs] = decode_e4m3fn(q[rs, cs]) * s[i, j].to(torch.float32)
    return out


# --------------------------------------------------------------------------------------------
# layout helpers


def released_to_text(tensors: dict, c: Case) -> dict:
    """Released names (per-expert, prefixed) -> the text model's state-dict names (fused experts)."""
    out, experts = {}, {}
    for k, t in tensors.items():
        if k.startswith("model.visual.") or k.startswith("mtp."):
            continue
        assert k == "lm_head.weight" or k.startswith(PREFIX), k
        k = k if k == "lm_head.weight" else "model." + k[len(PREFIX) :]
        if ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault(pre, {})[(int(e), proj)] = t
            continue
        out[k] = t
    for pre, d in experts.items():
        E = c.experts
        gate_up = [torch.cat([d[(e, "gate_proj.weight")], d[(e, "up_proj.weight")]], 0) for e in range(E)]
        out[pre + ".mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[pre + ".mlp.experts.down_proj"] = torch.stack([d[(e, "down_proj.weight")] for e in range(E)]).contiguous()
        assert len(d) == 3 * E
    return out


def write_shards(tensors: dict, dst: Path, n: int, split_scale: str | None) -> list:
    names = sorted(tensors)
    if n == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    sizes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    total = sum(sizes.values())
    per = total / n
    shard_of, acc = {}, 0
    for k in names:
        shard_of[k] = min(int(acc // per), n - 1)
        acc += sizes[k]
    if split_scale is not None:
        sk = split_scale[: -len("weight")] + "weight_scale_inv"
        if shard_of[sk] == shard_of[split_scale]:
            shard_of[sk] = (shard_of[split_scale] + 1) % n
        assert shard_of[sk] != shard_of[split_scale]
    files, weight_map = [], {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        group = [k for k in names if shard_of[k] == i]
        assert group, "empty shard"
        save_file({k: tensors[k].contiguous() for k in group}, str(dst / fname), metadata={"format": "pt"})
        files.append(fname)
        for k in group:
            weight_map[k] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files + ["model.safetensors.index.json"]


# --------------------------------------------------------------------------------------------
# one case


@torch.no_grad()
def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens[None], use_cache=False).logits[0].float()


@torch.no_grad()
def run_case(fc: Fp8Case) -> dict:
    c = fc.base
    print(f"== {c.name}", flush=True)
    case_dir = OUT_ROOT / c.name
    base_dt = getattr(torch, c.dtype)
    scale_dt = getattr(torch, fc.scale_dtype)
    skip = modules_to_not_convert(c)
    skip_set = set(skip)

    # 1. the random model, its values rounded to the base dtype, held in f32
    model = build_model(c)
    for p in model.parameters():
        p.data = p.data.to(torch.float32)
    model.config.dtype = torch.float32
    gen = torch.Generator().manual_seed(c.seed * 104729 + 5)  # dummy visual/mtp tensors

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(str(tmp / "text0"), safe_serialization=True)
        rel = to_released_layout(tmp / "text0", tmp / "rel0", dataclasses.replace(c, shards=1), gen)
        del rel["mtp.fc.weight"]  # [D, 2D] dummy: by far the largest dummy; other visual/mtp dummies stay
        text_cfg = json.loads((tmp / "text0" / "config.json").read_text())
        gen_cfg = (tmp / "text0" / "generation_config.json").read_text()

        # 2./3. quantize per the rule; everything else in the base dtype (exact: values are base-dtype values)
        ckpt, deq, quantized = {}, {}, []
        base_w = {}  # FP8 weight name -> its pre-quantization base-dtype values W
        err_rel = 0.0
        for k in sorted(rel):
            t = rel[k]
            if is_fp8(k, t, skip_set):
                w = t.to(torch.float32)
                b = t.to(base_dt)
                assert torch.equal(b.to(torch.float32), w), f"{k} is not exactly representable in {c.dtype}"
                base_w[k] = b
                q, s = quantize(w, scale_dt)
                ckpt[k] = q
                ckpt[k[: -len("weight")] + "weight_scale_inv"] = s
                deq[k] = dequantize(q, s)
                quantized.append(k)
                # quantization error relative to the block amax (informational)
                err_rel = max(err_rel, ((deq[k] - w).abs() / expand_scale(s, w.shape) / FP8_MAX).max().item())
            else:
                b = t.to(base_dt)
                assert torch.equal(b.to(t.dtype), t), f"{k} is not exactly representable in {c.dtype}"
                ckpt[k] = b
                deq[k] = b.to(torch.float32)
        assert_quantized_roles(quantized, c)

        # logits of the unquantized model (informational: how far FP8 moves the outputs)
        unq_model = model

        # 4. the f32 model with the dequantized weights, through save_pretrained/from_pretrained
        qmodel = build_model(c)  # same architecture; every parameter is overwritten below
        for p in qmodel.parameters():
            p.data = p.data.to(torch.float32)
        qmodel.config.dtype = torch.float32
        sd = released_to_text(deq, c)
        qmodel.load_state_dict(sd, strict=True)
        qmodel.save_pretrained(str(tmp / "text1"), safe_serialization=True)
        ref_model = Qwen3_5MoeForCausalLM.from_pretrained(
            str(tmp / "text1"), attn_implementation="eager", dtype=torch.float32
        ).eval()
        assert_same_params(qmodel, ref_model, f"{c.name}: from_pretrained(save_pretrained)")
        for k, v in sd.items():
            assert torch.equal(ref_model.state_dict()[k], v), k
        experts_impl = ref_model.config._experts_implementation
        tokens, token_attempt = choose_tokens(ref_model, c)
        ref = run_reference(ref_model, c, tokens)
        logits = ref["tensors"]["logits"]
        unq_diff = (logits_of(unq_model, tokens) - logits).abs().max().item()
        # the shortcut "dequantize to bf16 at load" (what a bf16 engine / HF's bf16 dequant holds), f32 compute
        bf_model = Qwen3_5MoeForCausalLM.from_pretrained(
            str(tmp / "text1"), attn_implementation="eager", dtype=torch.float32
        ).eval()
        for p in bf_model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
        bf16w_diff = (logits_of(bf_model, tokens) - logits).abs().max().item()
        del bf_model

    # 5. the case directory
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    cfg = released_config(text_cfg, c)
    cfg["text_config"]["dtype"] = c.dtype  # text0 was saved in f32; the checkpoint's base dtype is c.dtype
    cfg = {k: v for k, v in cfg.items() if k != "transformers_version"}
    cfg["quantization_config"] = quant_config(skip)
    cfg["transformers_version"] = transformers.__version__
    (case_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (case_dir / "generation_config.json").write_text(gen_cfg)
    weight_files = write_shards(ckpt, case_dir, c.shards, fc.split_scale)
    save_file(ref["tensors"], str(case_dir / "reference.safetensors"), metadata={
        "generator": f"{GENERATOR} case={c.name} torch={torch.__version__} transformers={transformers.__version__}",
    })

    if c.name in UNQUANT_BASE:
        write_unquant_base(OUT_ROOT / UNQUANT_BASE[c.name], case_dir, cfg, gen_cfg, ckpt, base_w, c, scale_dt)

    # 6. checks
    check_files(case_dir, c, ckpt, ref_model)
    hf = check_hf_fp8_load(case_dir, c, ref_model, tokens, logits, quantized, ckpt)

    files = sorted(p.name for p in case_dir.iterdir())
    fp8_shapes = sorted({tuple(ckpt[k].shape) for k in quantized})
    partial_dims = sorted({d for sh in fp8_shapes for d in sh if d % BLOCK[0] != 0})
    decay_lo, decay_hi = gdn_decay_range(ref_model)
    info = {
        "name": c.name,
        "note": fc.note,
        "dtype": c.dtype,
        "scale_dtype": fc.scale_dtype,
        "weight_block_size": list(BLOCK),
        "T": c.T,
        "n_decode": N_DECODE,
        "layout": "released",
        "experts_layout": "per_expert",
        "sharded": c.shards > 1,
        "n_shards": c.shards,
        "scale_in_other_shard": fc.split_scale,
        **case_geometry(c),
        "params": param_count(ref_model),
        "n_fp8_tensors": len(quantized),
        "n_fp8_tensors_text": sum(1 for k in quantized if not k.startswith("mtp.")),
        "fp8_shapes": [list(s) for s in fp8_shapes],
        "fp8_scale_shapes": [list(scale_shape(s)) for s in fp8_shapes],
        "partial_block_dims": partial_dims,
        "max_blocks_in_one_matrix": max(scale_shape(s)[0] * scale_shape(s)[1] for s in fp8_shapes),
        "files": files,
        "weight_files": weight_files,
        "bytes": sum(p.stat().st_size for p in case_dir.iterdir()),
        "max_abs_logit": ref["max_abs_logit"],
        "min_top1_gap": ref["min_top1_gap"],
        "n_top1_near": ref["n_top1_near"],
        "n_top1_ties": ref["n_top1_ties"],
        "hf_prefill_vs_full_max_abs_diff": ref["prefill_diff"],
        "hf_decode_vs_full_max_abs_diff": ref["decode_diff"],
        "min_router_margin": ref["min_router_margin"],
        "n_router_decisions": ref["n_router_decisions"],
        "n_router_ties": ref["n_router_ties"],
        "n_router_near": ref["n_router_near"],
        "gdn_base_decay_range": [decay_lo, decay_hi],
        "quant_max_err_rel_block_amax": err_rel,
        "unquantized_vs_fp8_logits_max_abs_diff": unq_diff,
        "bf16_dequant_vs_exact_logits_max_abs_diff": bf16w_diff,
        **hf,
        "hf_experts_implementation": experts_impl,
        "token_draw_attempt": token_attempt,
    }
    print(json.dumps({k: info[k] for k in (
        "max_abs_logit", "min_top1_gap", "min_router_margin", "hf_decode_vs_full_max_abs_diff",
        "unquantized_vs_fp8_logits_max_abs_diff", "bf16_dequant_vs_exact_logits_max_abs_diff",
        "hf_fp8_load_params_bit_equal", "hf_fp8_load_logits_max_abs_diff", "bytes")}), flush=True)
    return info


def _has_key(obj, key: str) -> bool:
    if isinstance(obj, dict):
        return key in obj or any(_has_key(v, key) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_key(v, key) for v in obj)
    return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (bit-for-bit comparison, also for -0.0 / NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def write_unquant_base(dst: Path, case_dir: Path, cfg: dict, gen_cfg: str, ckpt: dict, base_w: dict, c: Case,
                       scale_dt: torch.dtype) -> None:
    """The base checkpoint the case was quantized from: the case's config without
    `quantization_config`, the same generation_config, and one model.safetensors with every tensor
    of the case under the same name, each FP8 weight replaced by its base-dtype values W and no
    weight_scale_inv. No reference.safetensors (not a case). Asserts that `quantize` on the
    tensors read back from it reproduces the codes and scales read back from the case's files."""
    print(f"   + {dst.name}", flush=True)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    base_dt = getattr(torch, c.dtype)
    bcfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    assert not _has_key(bcfg, "quantization_config")
    (dst / "config.json").write_text(json.dumps(bcfg, indent=2) + "\n")
    (dst / "generation_config.json").write_text(gen_cfg)
    scales = {k for k in ckpt if k.endswith(".weight_scale_inv")}
    assert {k[: -len("weight_scale_inv")] + "weight" for k in scales} == set(base_w)
    tensors = {k: (base_w[k] if k in base_w else ckpt[k]) for k in ckpt if k not in scales}
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})

    # checks: files read back, against the case's files read back
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    got, case = load_all(dst), load_all(case_dir)
    assert set(got) == set(case) - scales, set(got) ^ (set(case) - scales)
    assert (dst / "generation_config.json").read_bytes() == (case_dir / "generation_config.json").read_bytes()
    ccfg = json.loads((case_dir / "config.json").read_text())
    assert json.loads((dst / "config.json").read_text()) == {k: v for k, v in ccfg.items() if k != "quantization_config"}
    for k, t in got.items():
        assert t.dtype == base_dt, (k, t.dtype)
        assert tuple(t.shape) == tuple(case[k].shape), (k, t.shape, case[k].shape)
        if k not in base_w:
            assert torch.equal(t, case[k]) and torch.equal(t, ckpt[k]), k
            continue
        assert case[k].dtype == FP8, k
        sk = k[: -len("weight")] + "weight_scale_inv"
        q, s = quantize(t.to(torch.float32), scale_dt)
        assert s.dtype == case[sk].dtype == scale_dt, (sk, s.dtype, case[sk].dtype)
        assert torch.equal(_bits(q), _bits(case[k])), f"{dst.name}: re-quantized {k} != {case_dir.name}"
        assert torch.equal(_bits(s), _bits(case[sk])), f"{dst.name}: re-quantized {sk} != {case_dir.name}"
        assert torch.equal(_bits(q), _bits(ckpt[k])) and torch.equal(_bits(s), _bits(ckpt[sk])), k
    print(f"     {len(base_w)} FP8 weights re-quantize bit-equal to {case_dir.name}; {len(got)} tensors", flush=True)


def assert_quantized_roles(quantized: list, c: Case) -> None:
    """The FP8 set must be exactly the official one: attention / GDN projections, shared expert,
    routed experts (+ the dummy MTP expert)."""
    roles = set()
    for k in quantized:
        if k.startswith("mtp."):
            assert k == "mtp.layers.0.mlp.experts.0.gate_proj.weight", k
            continue
        assert k.startswith(PREFIX + "layers."), k
        rest = k.split(".", 4)[4]  # after model.language_model.layers.N.
        if ".experts." in rest:
            rest = "mlp.experts.*." + rest.split(".", 3)[3]
        roles.add(rest)
    want = {f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    want |= {f"mlp.experts.*.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    if LIN in c.layer_types:
        want |= {f"linear_attn.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "out_proj")}
    if FULL in c.layer_types:
        want |= {f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert roles == want, roles ^ want


def check_files(case_dir: Path, c: Case, ckpt: dict, ref_model) -> None:
    """Read the written checkpoint back, dequantize with the block loop, compare bit for bit."""
    got = load_all(case_dir)
    assert set(got) == set(ckpt), set(got) ^ set(ckpt)
    if c.shards > 1:
        idx = json.loads((case_dir / "model.safetensors.index.json").read_text())
        assert set(idx["weight_map"]) == set(got)
        assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    deq = {}
    for k, t in got.items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == FP8 else t, ckpt[k].view(torch.uint8) if t.dtype == FP8
                           else ckpt[k]), k
        if k.endswith("weight_scale_inv"):
            continue
        if t.dtype == FP8:
            s = got[k[: -len("weight")] + "weight_scale_inv"]
            assert tuple(s.shape) == scale_shape(t.shape)
            deq[k] = dequantize_loop(t, s)
        else:
            assert t.dtype == getattr(torch, c.dtype), (k, t.dtype)
            deq[k] = t.to(torch.float32)
    sd = released_to_text(deq, c)
    ref_sd = ref_model.state_dict()
    assert set(sd) == set(ref_sd), set(sd) ^ set(ref_sd)
    for k in sd:
        assert torch.equal(sd[k], ref_sd[k]), f"{c.name}: dequantized file tensor {k} differs from the reference model"


@torch.no_grad()
def check_hf_fp8_load(case_dir: Path, c: Case, ref_model, tokens, logits, quantized, ckpt) -> dict:
    """transformers' own FP8 loading of the case directory (CPU only: FineGrainedFP8 dequantizes on
    load). Two findings recorded per case:

    * `Qwen3_5MoeForConditionalGeneration` (the released architecture) sees the top-level
      `quantization_config` and dequantizes. Its Fp8Dequantize derives the block size as
      dim // n_blocks, which is 128 only when the dimension is <= 128 or a multiple of 128: where
      that holds for every FP8 matrix the result must equal the reference model bit for bit
      (asserted); otherwise the difference is recorded.
    * `Qwen3_5MoeForCausalLM` (text class) reads only `text_config` and so never sees the
      top-level `quantization_config`: it loads the raw FP8 values as if they were weights and
      reports the scales as unexpected keys (recorded, not asserted)."""
    from transformers import Qwen3_5MoeForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_exact = all(d <= BLOCK[0] or d % BLOCK[0] == 0 for k in quantized for d in ckpt[k].shape)
    out = {"hf_dequant_expected_exact": hf_exact}
    ref_sd = ref_model.state_dict()
    mx = max(1.0, logits.abs().max().item())
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        m = Qwen3_5MoeForConditionalGeneration.from_pretrained(
            str(case_dir), attn_implementation="eager", dtype=torch.float32).eval()
        sd = m.state_dict()
        pdiff, equal = 0.0, True
        for k, a in ref_sd.items():
            b = sd["model.language_model." + k[len("model."):]] if k.startswith("model.") else sd[k]
            pdiff = max(pdiff, (a.float() - b.float()).abs().max().item())
            equal = equal and a.dtype == b.dtype and torch.equal(a, b)
        ldiff = (logits_of(m, tokens) - logits).abs().max().item()
        if hf_exact:
            assert equal, f"{c.name}: transformers' FP8 load gives other parameters (max diff {pdiff})"
            assert ldiff <= 1e-4 * mx, ldiff
        out.update({"hf_fp8_load_params_bit_equal": equal, "hf_fp8_load_params_max_abs_diff": pdiff,
                    "hf_fp8_load_logits_max_abs_diff": ldiff})
        del m
        t = Qwen3_5MoeForCausalLM.from_pretrained(str(case_dir), attn_implementation="eager", dtype=torch.float32).eval()
        out["hf_text_class_sees_quantization_config"] = getattr(t.config, "quantization_config", None) is not None
        out["hf_text_class_logits_max_abs_diff"] = (logits_of(t, tokens) - logits).abs().max().item()
    finally:
        hf_logging.set_verbosity(verbosity)
    return out


# --------------------------------------------------------------------------------------------
# bad variants


def write_bad_variants() -> list:
    src = OUT_ROOT / BAD_BASE
    infos = []
    for name, (what, expect) in BAD_VARIANTS.items():
        dst = OUT_ROOT / name
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir()
        cfg = json.loads((src / "config.json").read_text())
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if name == "bad-missing-scale-inv":
            del tensors[PREFIX + "layers.0.mlp.experts.1.down_proj.weight_scale_inv"]
        elif name == "bad-block-size-64":
            cfg["quantization_config"]["weight_block_size"] = [64, 64]
        elif name == "bad-activation-static":
            cfg["quantization_config"]["activation_scheme"] = "static"
        elif name == "bad-input-scale":
            tensors[PREFIX + "layers.1.self_attn.q_proj.input_scale"] = torch.tensor(0.5, dtype=torch.float32)
        elif name == "bad-scale-shape":
            k = PREFIX + "layers.1.self_attn.o_proj.weight_scale_inv"
            assert tuple(tensors[k].shape) == (1, 1)
            tensors[k] = torch.cat([tensors[k], tensors[k]], 1).contiguous()
        else:
            raise AssertionError(name)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
        infos.append({"name": name, "base": BAD_BASE, "defect": what, "expected": expect,
                      "files": sorted(p.name for p in dst.iterdir()),
                      "bytes": sum(p.stat().st_size for p in dst.iterdir())})
    return infos


# --------------------------------------------------------------------------------------------
# README


def _shape_list(i: dict) -> str:
    return ", ".join(f"{a}×{b}→{sa}×{sb}" for (a, b), (sa, sb) in zip(i["fp8_shapes"], i["fp8_scale_shapes"]))


def _g(x, fmt=".2e") -> str:
    return "—" if x is None else format(x, fmt)


def write_readme(infos: list, bad: list) -> None:
    tv, trv = torch.__version__, transformers.__version__
    geo, fp8rows, res = [], [], []
    for i in infos:
        layout = f"released, per-expert, {i['n_shards']} shards" if i["sharded"] else "released, per-expert, 1 file"
        geo.append(
            f"| `{i['name']}` | {i['dtype']} | {i['scale_dtype']} | {layout} | {i['T']} | {i['vocab_size']} | "
            f"{i['hidden_size']} | `{fmt_layers(i['layer_types'])}` | {i['num_attention_heads']}/{i['num_key_value_heads']} | "
            f"{i['head_dim']} | {i['rotary_dim']} ({i['partial_rotary_factor']:g}) | {i['rope_theta']:g} | "
            f"{i['linear_num_key_heads']}/{i['linear_num_value_heads']} | {i['linear_key_head_dim']}/{i['linear_value_head_dim']} | "
            f"{i['num_experts']}/{i['num_experts_per_tok']} | {i['moe_intermediate_size']}/{i['shared_expert_intermediate_size']} | "
            f"{i['bytes'] / 1024:.0f} KiB |")
        fp8rows.append(
            f"| `{i['name']}` | {i['n_fp8_tensors']} ({i['n_fp8_tensors_text']} text + 1 MTP dummy) | {_shape_list(i)} | "
            f"{', '.join(map(str, i['partial_block_dims']))} | {i['max_blocks_in_one_matrix']} |")
        res.append(
            f"| `{i['name']}` | {i['max_abs_logit']:.3f} | {i['min_top1_gap']:.3g} / {i['n_top1_ties']} / {i['n_top1_near']} | "
            f"{i['min_router_margin']:.3g} / {i['n_router_ties']} / {i['n_router_near']} of {i['n_router_decisions']} | "
            f"{i['hf_prefill_vs_full_max_abs_diff']:.2e} | {i['hf_decode_vs_full_max_abs_diff']:.2e} | "
            f"{i['unquantized_vs_fp8_logits_max_abs_diff']:.3f} | {i['bf16_dequant_vs_exact_logits_max_abs_diff']:.3f} | "
            f"{'bit-equal' if i['hf_fp8_load_params_bit_equal'] else _g(i['hf_fp8_load_params_max_abs_diff'], '.3f')} / "
            f"{_g(i['hf_fp8_load_logits_max_abs_diff'], '.3g')} | {i['hf_text_class_logits_max_abs_diff']:.1f} |")
    bad_rows = [f"| `{b['name']}` | {b['defect']} | {b['expected']} |" for b in bad]
    dtypes = {i["name"]: i["dtype"] for i in infos}
    base_paras = [
        f"**Unquantized base** (`{d}`, not a case: no `reference.safetensors`, not in `cases.json`): the checkpoint\n"
        f"`{n}` was quantized from — the same `config.json` without `quantization_config`, the same\n"
        f"`generation_config.json` and one `model.safetensors` holding every tensor of `{n}` under the same name\n"
        f"and layout, except that each FP8 weight is stored as its pre-quantization values W ({dtypes[n]}) and\n"
        f"there are no `weight_scale_inv` tensors ({sum(p.stat().st_size for p in (OUT_ROOT / d).iterdir()) / 1024:.0f} KiB). "
        f"For load-time quantization tests: the rule above applied to it\n"
        f"must give `{n}`'s codes and scales bit for bit (the generator asserts this on the files read back)."
        for n, d in UNQUANT_BASE.items()]
    total = sum(p.stat().st_size for p in OUT_ROOT.rglob("*") if p.is_file())
    text = f"""# FP8 golden model fixtures (`qwen3_5_moe`, fine-grained FP8 like `Qwen/Qwen3.6-35B-A3B-FP8`)

Generated by `tools/make_fp8_fixtures.py` — regenerate everything with

    python -m venv /tmp/fp8env && /tmp/fp8env/bin/pip install torch transformers=={trv} accelerate
    /tmp/fp8env/bin/python tools/make_fp8_fixtures.py

(CPU only, deterministic: two runs give identical bytes; `fixtures/models-fp8/` is deleted and rewritten).
Versions: **torch {tv}**, **transformers {trv}**, eager attention, experts implementation
`{infos[0]['hf_experts_implementation']}`, pure-PyTorch GDN/conv fallbacks. Size of all files but this README:
{total / 1024:.0f} KiB.

These cases are deliberately **not** in `fixtures/models/cases.json` (the Rust tests iterate over
that file and would fail until an FP8 loader exists); they have their own `cases.json` here with
the same per-case keys plus the FP8 ones (`scale_dtype`, `fp8_shapes`, `fp8_scale_shapes`, …) and a
`bad_cases` list.

## 1. The format of the official Qwen FP8 checkpoints

What a loader must accept (Q = the released `Qwen/Qwen3.6-35B-A3B-FP8` / `Qwen/Qwen3.5-35B-A3B-FP8`;
sources in §1.1; **[V]** seen in a source, **[D]** derived, **[?]** uncertain):

| item | value |
|---|---|
| where | top-level `config.json` key `quantization_config`, beside `text_config` / `vision_config` (not inside `text_config`) [V: TRT-LLM compat code copies it from there; HF's `Qwen3_5MoeForConditionalGeneration` reads it there, measured §1.2] |
| `quant_method` | `"fp8"` [V] |
| `fmt` | `"e4m3"` [V] (informational; HF and vLLM ignore it) |
| `activation_scheme` | `"dynamic"` [V] — activations are quantized per token and per 128-wide group at run time by FP8 kernels; there are **no** activation/input scale tensors |
| `weight_block_size` | `[128, 128]` [V] — `[block_out, block_in]` |
| `modules_to_not_convert` | full module names, one entry per module and layer [V for Qwen3-Next, collapsed copy for Qwen3.6]: `lm_head`, an embedding entry [?: `model.embed_tokens` in one source, absent in Qwen3-Next], per layer `input_layernorm`, `post_attention_layernorm`, `mlp.gate`, `mlp.shared_expert_gate`, linear-attention layers `linear_attn.{{A_log, conv1d, dt_bias, in_proj_a, in_proj_b, in_proj_ba, norm}}`, full-attention layers `self_attn.{{q_norm, k_norm}}` (prefix `model.language_model.layers.N.`), vision linears `model.visual.blocks.N.{{attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2}}` (+ merger), `mtp.fc` and the MTP layer's norms / `mlp.gate` / `mlp.shared_expert_gate`, `mtp.norm`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`. The exact byte-for-byte list of the 35B release was not found [?] |
| FP8 tensors | `<module>.weight`, dtype `F8_E4M3` (= `torch.float8_e4m3fn`: byte b, sign b>>7, exponent e=(b>>3)&15 (bias 7), mantissa m=b&7; e=0: ±m/8·2⁻⁶; e=15,m=7: NaN (never in a valid file); else ±(1+m/8)·2^(e−7); no infinities, max 448), shape `[out, in]` unchanged [V] |
| scale tensors | `<module>.weight_scale_inv`, shape `[ceil(out/128), ceil(in/128)]` [V: HF FP8Linear, vLLM BlockQuantScaleParameter]; dtype **BF16** in Qwen3.6-35B-A3B-FP8 per one source, and Qwen FP8 releases differ: BF16 (Qwen3-1.7B/32B-FP8), F16 (Qwen3-4B-Instruct-2507-FP8), while DeepSeek-style checkpoints use F32 — accept BF16, F16 and F32 [V] |
| meaning | **multiply**: `W[r, c] = f32(q[r, c]) * f32(weight_scale_inv[r // 128, c // 128])` — the name is DeepSeek-V3's (it is the inverse of the quantization multiplier 448/amax) [V: HF Fp8Dequantize / Fp8Quantize, vLLM `scaled_dequantize`] |
| partial blocks | the last block of a dimension that is not a multiple of 128 is partial and has its own scale (ceil) [V: shapes in HF/vLLM]. All FP8 dimensions of the real 35B-A3B are multiples of 128 (2048, 512, 8192, 4096) [D], so partial blocks only occur in small test models |
| FP8 modules (text) | `self_attn.{{q,k,v,o}}_proj`, `linear_attn.{{in_proj_qkv, in_proj_z, out_proj}}`, `mlp.shared_expert.{{gate,up,down}}_proj`, every routed expert `mlp.experts.E.{{gate,up,down}}_proj` [V: third-party re-quantization "identical on-disk format" + tensor count below]; the MTP layer's attention / shared expert / experts are FP8 too [D: tensor count] |
| stays BF16 | `embed_tokens`, `lm_head`, all norms (`input_layernorm`, `post_attention_layernorm`, `q_norm`, `k_norm`, `linear_attn.norm`, final `norm`), router `mlp.gate` [E, D], `mlp.shared_expert_gate` [1, D], `linear_attn.in_proj_a` / `in_proj_b` [32, 2048], `conv1d`, `A_log`, `dt_bias`, the whole vision tower, `mtp.fc` and MTP norms [V + D] |
| experts | **per expert** (`…mlp.experts.E.gate_proj.weight` + `…weight_scale_inv`, etc.), not the fused `gate_up_proj` that the BF16 release most likely uses (see MODEL.md) [V: third-party "un-fused to match Qwen's official per-expert layout"; D: tensor count] |
| names | released layout: `model.language_model.…`, `lm_head.weight`, `model.visual.…`, `mtp.…` (like the BF16 release) |
| files | 42 safetensors shards + `model.safetensors.index.json`; a weight and its scale may sit in different shards (the index maps each tensor separately) [V count; D] |

**Tensor-count check [D].** A served copy of the 35B-A3B FP8 release has 64,196 tensors, 1,560 of them
`mtp.*` and 333 vision (ATLAS). With per-expert FP8 + one scale each for attention, GDN
qkv/z/out, shared expert and experts, and everything else unscaled: per layer 2 norms + router +
shared gate + 6 (shared expert w+s) + 1536 (256×3 experts w+s) = 1546; + 12 per linear-attention
layer (qkv, z, out w+s = 6; in_proj_a, in_proj_b, conv1d, A_log, dt_bias, norm = 6) and + 10 per
full-attention layer (q, k, v, o w+s = 8; q_norm, k_norm) → 30·1558 + 10·1556 + 3 (embed, norm,
lm_head) = **62,303** = 64,196 − 1,560 − 333 exactly. The MTP layer: 1536 (experts) + 8 (attention
w+s) + 6 (shared expert w+s) + 4 norms + router + shared gate + `mtp.fc` + 3 MTP norms = **1,560**
exactly, so `mtp.fc` is unscaled BF16 and the MTP experts/attention are FP8. The vision count 333 =
27 blocks × 12 + 9 is the full BF16 tower (no scales). Quantizing `in_proj_a/b` or
`shared_expert_gate`, or fusing the experts, would break these sums.

### 1.1 Sources

- **QN** — a verbatim copy of the `Qwen/Qwen3-Next-80B-A3B-Instruct-FP8` `config.json` (as printed by
  transformers 5.7.0) in a public GitHub model report (code search): flat config, `quantization_config`
  = `{{activation_scheme: dynamic, fmt: e4m3, modules_to_not_convert: [lm_head, model.layers.N.{{input_layernorm,
  linear_attn.{{A_log,conv1d,dt_bias,in_proj_ba,norm}}, mlp.gate, mlp.shared_expert_gate, post_attention_layernorm,
  self_attn.{{k_norm,q_norm}}}}, mtp.fc, mtp.layers.0.{{input_layernorm, mlp.gate, mlp.shared_expert_gate,
  post_attention_layernorm, self_attn.k_norm, self_attn.q_norm}}, mtp.norm, mtp.pre_fc_norm_embedding,
  mtp.pre_fc_norm_hidden], quant_method: fp8, weight_block_size: [128, 128]}}` (no embedding, no final-norm entry).
- **AIC** — a test in an inference-configurator project (code search; appears to be NVIDIA
  `ai-dynamo/aiconfigurator`, `_QWEN36_FP8_EXCLUSIONS`): "`Qwen/Qwen3.6-35B-A3B-FP8`
  `quantization_config.modules_to_not_convert` (native fp8_block, no hf_quant_config), per-layer
  entries collapsed to layer 0": `lm_head`, `model.embed_tokens`, `model.language_model.layers.0.{{input_layernorm,
  linear_attn.A_log, linear_attn.conv1d, linear_attn.dt_bias, linear_attn.in_proj_a, linear_attn.in_proj_b,
  linear_attn.in_proj_ba, linear_attn.norm, mlp.gate, mlp.shared_expert_gate, post_attention_layernorm,
  self_attn.k_norm, self_attn.q_norm}}`, `model.visual.blocks.0.{{attn.proj, attn.qkv, mlp.linear_fc1,
  mlp.linear_fc2}}`, `mtp.fc`, `mtp.layers.0.mlp.gate`, `mtp.layers.0.self_attn.q_norm`, `mtp.norm`; its
  test states that no GEMM (projection, shared expert) is excluded but in_proj_a/in_proj_b are.
- **FR** — model page of `gsting/Qwen3.6-35B-A3B-abliterated-FP8` (friendli.ai mirror), which claims an
  "identical on-disk format to the official Qwen/Qwen3.6-35B-A3B-FP8": quant_method fp8, activation_scheme
  dynamic, fmt e4m3, weight_block_size [128, 128], "Scale dtype / key: bf16, `*.weight_scale_inv`"; FP8:
  self_attn q/k/v/o, linear_attn in_proj_qkv / in_proj_z / out_proj, shared_expert gate/up/down, all 256
  experts "un-fused to match Qwen's official per-expert layout"; BF16 "matches Qwen's modules_to_not_convert":
  lm_head, embed_tokens, layer norms, q/k norms, linear_attn A_log, conv1d, dt_bias, in_proj_a, in_proj_b,
  in_proj_ba, norm.
- **ATLAS** — github.com/0xBakeer/inference-atlas PR #145 ("Registry: the official FP8 pack of
  Qwen3.6-35B-A3B", read from the served checkpoint): `fp8`, `fmt: e4m3`, `activation_scheme: dynamic`;
  42 shards / 64,196 tensors; MTP 1,560 tensors kept; vision 333 tensors kept.
- **HF** — transformers {trv}: `utils/quantization_config.py` `FineGrainedFP8Config` (activation_scheme
  dynamic|static, weight_block_size, modules_to_not_convert, `ignored_layers` alias);
  `integrations/finegrained_fp8.py` `FP8Linear` (weight `float8_e4m3fn` [out, in], `weight_scale_inv`
  f32 `[ceil(out/b0), ceil(in/b1)]`, `activation_scale` only for static), `Fp8Quantize` (scale_inv =
  amax/448 per block, q = clamp(w·448/amax) → fp8; skips shapes not divisible by the block),
  `Fp8Dequantize` (`q.float() * scale_inv.float()` per block); `quantizers/quantizers_utils.py`
  `should_convert_module` (an entry matches by `re.match(entry + "\\.")`, `re.match(entry)` or
  `name.endswith(entry)` — i.e. a prefix/regex match: `…mlp.gate` also matches `…mlp.gate_proj` of dense
  models); `quantizer_finegrained_fp8.py` (no GPU ⇒ `dequantize=True`).
- **VLLM** — `vllm/model_executor/layers/quantization/fp8.py` (`Fp8Config.from_config`: `ignored_layers`, else
  `modules_to_not_convert`; block-wise requires `activation_scheme == "dynamic"` else ValueError; scale param
  `weight_scale_inv` f32 `[(out+127)//128, (in+127)//128]`), `utils/quant_utils.py` (`is_layer_skipped`:
  exact `prefix in ignored_layers` by default; a fused module is checked shard by shard and raises if only
  some shards are listed; `scaled_quantize` /
  `scaled_dequantize` = the same amax/448 and multiply rule), `models/qwen3_5.py` (the GDN `in_proj_b` is
  built with prefix `…in_proj_ba`, `in_proj_a` with `…in_proj_a`, so with exact matching the skip list
  needs `in_proj_ba` (and `in_proj_a`) for both to stay BF16 — which is why the Qwen lists carry
  `in_proj_ba` although no such tensor exists; per-expert `experts.E.*` and fused `experts.gate_up_proj`
  both load).
- **TRT** — TensorRT-LLM `Qwen35ConfigCompat` ("Copy top-level quantization_config into text_config";
  normalizes `model.language_model.` → `model.`, drops `model.visual.*` / `mtp.*`, maps `in_proj_[ab]` →
  `in_proj_ba`).
- Scale dtypes of other Qwen FP8 releases: modular/modular#7142 (`Qwen/Qwen3-1.7B-FP8`: 196 scale tensors,
  all BF16, e.g. `model.layers.0.mlp.down_proj.weight_scale_inv` [16, 48]), HabanaAI/vllm-fork#2141 (BF16
  scales in FP8 Qwen3 dense models, verified with Qwen3-32B-FP8), InternLM/lmdeploy#4276
  (`Qwen/Qwen3-4B-Instruct-2507-FP8` `weight_scale_inv` in half precision).

**Uncertain:** the exact `modules_to_not_convert` of the 35B releases (the embedding entry's spelling, the
visual entries, whether `model.language_model.norm` is listed); the scale dtype of Qwen3.5-35B-A3B-FP8
(BF16 reported for 3.6); the rounding Qwen used to quantize (amax/448 is the common rule, the loader does
not need it). A loader should decide per tensor from the file (`F8_E4M3` dtype + a sibling
`weight_scale_inv`), check that against the config, and treat `modules_to_not_convert` as a consistency
check — not as the source of truth.

### 1.2 Traps measured with transformers {trv} (recorded per case in `cases.json`)

- `Qwen3_5MoeForCausalLM.from_pretrained` on these directories reads only `text_config`, **never sees the
  top-level `quantization_config`**, loads the raw FP8 values as weights and ignores the scales
  (`hf_text_class_logits_max_abs_diff` ≈ 10). Use `Qwen3_5MoeForConditionalGeneration` for FP8.
- On a machine without a GPU, transformers dequantizes on load with `Fp8Dequantize`, which derives the
  block size as `dim // n_blocks` instead of 128. That is right when every FP8 dimension is ≤ 128 or a
  multiple of 128 (then our checkpoints load **bit-equal** to the reference model, asserted for
  `fp8-bf16scale-sharded` and `fp8-tiny`) and wrong otherwise (`fp8-f32scale-partial`: e.g. the 200 rows of
  the shared expert's gate_proj are split 100 + 100 instead of 128 + 72, its 160 columns 80 + 80). HF's CPU path is therefore not a reference for partial blocks;
  the reference here is computed from our own dequantization, checked by an independent block loop.

## 2. What the fixtures contain

**Rule for what is FP8** (same as the official config): a tensor is FP8 iff it is a 2-D `<module>.weight`
and `<module>` is not in `modules_to_not_convert` (exact full-name match; the fixture's list enumerates
every module like the official one: `lm_head`, `model.language_model.embed_tokens`, per layer the norms,
`mlp.gate`, `mlp.shared_expert_gate`, `linear_attn.{{A_log, conv1d, dt_bias, in_proj_a, in_proj_b,
in_proj_ba, norm}}` or `self_attn.{{q_norm, k_norm}}`, `model.visual.merger.linear_fc2`, and the QN-style
`mtp.*` entries). The generator asserts that this yields exactly q/k/v/o_proj, in_proj_qkv, in_proj_z,
out_proj, shared_expert.{{gate,up,down}}_proj and every expert's gate/up/down_proj (+ the dummy MTP expert).

**Quantization rule** (per 128×128 block of W [out, in], held in f32; W holds exactly the base-dtype values):

    s      = fl32(amax(|W_block|) / 448)        # 1.0 for an all-zero block; a partial block uses its own elements
    s_st   = round_to_nearest_even(s, scale dtype)            # stored as weight_scale_inv (BF16 or F32)
    q      = float8_e4m3fn_RNE(clamp(fl32(W / s_st), -448, 448))   # stored as weight

**Dequantization = the ground truth the reference uses:** `W_deq[r, c] = fl32(f32(q[r, c]) · f32(s_st[r // 128,
c // 128]))` (one f32 multiply; exact when the scale is BF16). Everything not FP8 is stored in the case's
base dtype (`dtype` in config.json) and used as is (upcast exactly).

**Reference:** the HF model (`Qwen3_5MoeForCausalLM`, f32, eager) is loaded with exactly `W_deq` and the
base-dtype values, saved and reloaded with `save_pretrained`/`from_pretrained` (bit-equal), and run in
**f32**: same procedure and tensors as `fixtures/models/README.md` (`tokens`, `logits`, `hidden_states`,
`last_layer_out`, `logits_decode`, `router_logits`, `router_topk_idx`, `router_topk_weight`; no
`logits_f32` — everything is already f32). The written files are read back, dequantized with an
independent block loop and checked bit-equal to the reference model's parameters.

**Layout** (like the BF16 released fixtures): nested `config.json` (`Qwen3_5MoeForConditionalGeneration`,
`text_config` with `dtype` = base dtype, dummy `vision_config`) **plus top-level `quantization_config`**,
`generation_config.json`, `model.language_model.` names, per-expert experts (FP8), dummy
`model.visual.*` tensors (base dtype), dummy `mtp.*` tensors (`mtp.pre_fc_norm_embedding`, `mtp.norm`,
`mtp.layers.0.mlp.gate` in the base dtype, `mtp.layers.0.mlp.experts.0.gate_proj` **FP8 with its scale**);
the large `mtp.fc` dummy of the BF16 fixtures is left out to save space. In `fp8-bf16scale-sharded`,
`model.language_model.layers.0.mlp.experts.1.down_proj.weight_scale_inv` is deliberately in another
shard than its weight.

{chr(10).join(base_paras)}

## 3. Cases

| case | base dtype | scale dtype | layout | T | V | D | layers | H/KV | hd | rot | θ | Hk/Hv | Dk/Dv | E/k | F/Fs | size |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(geo)}

FP8 matrices (shape → `weight_scale_inv` shape), dimensions that are not multiples of 128 (partial
last block), most blocks in one matrix:

| case | FP8 tensors | shapes → scale shapes | partial-block dims | max blocks |
|---|---|---|---|---|
{chr(10).join(fp8rows)}

## 4. Reference numbers and tolerances

Columns as in `fixtures/models/README.md` (top-1 gap and router margin: min / exact ties / < {NEAR}), plus:
**unquant** = max |logits of the same model before quantization − `logits`| (how much FP8 moves the
outputs: an engine that ignores or misapplies the scales is far off); **bf16-deq** = max |logits with
`W_deq` rounded to BF16 (f32 compute) − `logits`| (the cost of dequantizing to BF16 at load time);
**HF FP8 load** = transformers' own FP8 loading (`Qwen3_5MoeForConditionalGeneration`, CPU dequantize):
parameters vs the reference model / max logits diff; **HF text class** = max logits diff of
`Qwen3_5MoeForCausalLM.from_pretrained` (ignores the quantization config, §1.2).

| case | max\\|logit\\| | top-1 gap | router margin | prefill diff | decode diff | unquant | bf16-deq | HF FP8 load | HF text class |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(res)}

Suggested tolerances for a Rust engine: an engine that dequantizes exactly (f32 product of the FP8 value
and the scale) and computes in f32 should match `logits` within ~1e-4 (like the f32 fixtures; HF's own
prefill-vs-decode disagreement is a few 1e-6). An engine that dequantizes to BF16 or computes in BF16
should expect at least the **bf16-deq** column, and routing flips where the router margin is small
(check `router_topk_idx`).

## 5. Bad variants (no reference; for error tests)

Each is a copy of `{BAD_BASE}` (its config, generation_config and single `model.safetensors`) with exactly
one defect. A loader should refuse each with a clear message naming the tensor / key.

| directory | defect | expected |
|---|---|---|
{chr(10).join(bad_rows)}
"""
    (OUT_ROOT / "README.md").write_text(text)


def main(argv: list) -> None:
    if argv:
        sys.exit("usage: make_fp8_fixtures.py   (always regenerates every case)")
    if OUT_ROOT.exists():
        shutil.rmtree(OUT_ROOT)
    OUT_ROOT.mkdir(parents=True)
    infos = [run_case(fc) for fc in CASES]
    bad = write_bad_variants()
    (OUT_ROOT / "cases.json").write_text(json.dumps({
        "generator": GENERATOR,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "n_decode": N_DECODE,
        "cases": infos,
        "bad_cases": bad,
    }, indent=2) + "\n")
    write_readme(infos, bad)
    total = sum(p.stat().st_size for p in OUT_ROOT.rglob("*") if p.is_file())
    print(f"total fixture size: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
