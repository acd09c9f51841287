#!/usr/bin/env python3
"""One table from `lily bench --json` and tools/hf_bench.py outputs of the same
run: each size, both engines, and Lily's speed-up."""
import json
import os
import sys

lily = json.load(open(sys.argv[1]))
# (the peer's file may be missing when its run failed: Lily's rows alone then)
hf = json.load(open(sys.argv[2])) if len(sys.argv) > 2 and os.path.exists(sys.argv[2]) else {"prefill": [], "decode": []}
print(f"Lily: {lily['device']}, {lily['model']}; peer: {hf.get('engine', '?')} (torch {hf.get('torch', '?')})")
# which kernels the peer really ran (hf_bench.py's fast_paths; older files lack it)
fp = hf.get("fast_paths")
if fp:
    print(f"peer fast paths: {fp.get('summary', '?')}")
    if fp.get("fallback_warnings"):  # transformers names the function in backquotes
        names = [w.split("`")[1] if w.count("`") >= 2 else w[:60] for w in fp["fallback_warnings"]]
        print(f"peer ran PyTorch reference code (transformers' warnings) for: {', '.join(names)}")
elif "engine" in hf:
    print("peer fast paths: not recorded (hf_bench.py before fast_paths)")
print(f"{'':8} {'size':>8} {'Lily tok/s':>12} {'HF tok/s':>10} {'Lily/HF':>8} {'Lily % floor':>13}")
for kind, key, val in (("prefill", "prompt_len", "prefill_tok_s"), ("decode", "context", "decode_tok_s")):
    theirs = {r[key]: r[val] for r in hf.get(kind, [])}
    for r in lily[kind]:
        x, y = r[val], theirs.get(r[key])
        pct = f"{r['pct_of_floor']:.0f}%" if "pct_of_floor" in r else ""
        print(f"{kind:8} {r[key]:>8} {x:>12.1f} {(f'{y:.1f}' if y else '-'):>10} {(f'{x / y:.1f}x' if y else '-'):>8} {pct:>13}")
