"""The released `Qwen/Qwen3.6-35B-A3B` checkpoint layout: config, rewriting a save_pretrained
checkpoint into it, and the tensor-by-tensor check against the original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from .cases import FULL, Case
from .model import load_all


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
