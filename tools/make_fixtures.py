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

import json
import os
import shutil
import sys
from pathlib import Path

import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_gen.cases import CASES, N_DECODE, OUT_ROOT  # noqa: E402
from fixture_gen.readme import write_readme  # noqa: E402
from fixture_gen.reference import run_case  # noqa: E402


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
