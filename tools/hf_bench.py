#!/usr/bin/env python3
"""The PyTorch peer on the same weights as `lily bench --synthetic NAME`:
HF transformers 5.17 (bf16, batch 1, on the GPU) with the synthetic model's
exact weights (built by tools/hf_compare.py from `lily synthetic-export`).

Prefill: one forward over P prompt tokens with logits_to_keep=1, median of
--runs after a warm-up. Decode: `generate` greedy, G new tokens after a C-token
prompt, minus the prefill time, median of --runs after a warm-up.
Prints one JSON object (and writes it with --out).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import time

import torch

from hf_compare import build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="full")
    ap.add_argument("--lily", default=".carry/lily")
    ap.add_argument("--prompt-len", default="512,4096,16384")
    ap.add_argument("--context", default="512,4096")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    exp = f"/tmp/exp-{a.synthetic}"
    if not os.path.exists(f"{exp}/procedural.json"):
        subprocess.run([a.lily, "synthetic-export", "--synthetic", a.synthetic, "--out", exp], check=True)
    model = build(exp, "cuda", attn="sdpa")
    random.seed(3)
    vocab = 248077

    def ids(n):
        return torch.tensor([[random.randrange(vocab) for _ in range(n)]], device="cuda")

    def timed(f):
        torch.cuda.synchronize()
        t = time.time()
        f()
        torch.cuda.synchronize()
        return time.time() - t

    res = {"engine": "transformers " + __import__("transformers").__version__, "torch": torch.__version__, "prefill": [], "decode": []}
    with torch.no_grad():
        for p in [int(x) for x in a.prompt_len.split(",") if x]:
            x = ids(p)
            timed(lambda: model(input_ids=x, logits_to_keep=1, use_cache=False))
            ts = [timed(lambda: model(input_ids=x, logits_to_keep=1, use_cache=False)) for _ in range(a.runs)]
            s = statistics.median(ts)
            res["prefill"].append({"prompt_len": p, "prefill_tok_s": p / s, "ttft_ms": s * 1e3})
            print(res["prefill"][-1], flush=True)
        for c in [int(x) for x in a.context.split(",") if x]:
            x = ids(c)
            gen = lambda n: model.generate(input_ids=x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            timed(lambda: gen(2))
            pre = statistics.median([timed(lambda: gen(1)) for _ in range(a.runs)])
            ts = [timed(lambda: gen(a.gen + 1)) - pre for _ in range(a.runs)]
            s = statistics.median(ts)
            res["decode"].append({"context": c, "gen": a.gen, "decode_tok_s": a.gen / s, "ms_per_token": s * 1e3 / a.gen})
            print(res["decode"][-1], flush=True)
    print(json.dumps(res))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
