"""The fixture cases (`Case`, `CASES`) and the constants shared by the generator
(output directory, number of decode steps, near-tie threshold, layer type names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
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
