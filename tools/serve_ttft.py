#!/usr/bin/env python3
"""Time to first token through `lily serve`, as a client sees it.

Starts `LILY serve ARGS...` on a free port, waits for /health, then sends
streamed /v1/completions requests whose prompts are about --tokens tokens of
varied text (each request a different prompt, so nothing can be reused), and
times each from sending the request to the first streamed token. Prints one
JSON object: the prompt tokens the server counted (usage), each request's
time to first token and total time, and the median.

usage: serve_ttft.py --lily PATH --tokens 24000 [--requests 3] [--out FILE] -- serve args...
  e.g. serve_ttft.py --lily .carry/lily --tokens 24000 -- --device cuda --synthetic full --max-seq 32768
"""
import argparse
import json
import random
import time

from serve_process import lily_serve, stream


def prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["river", "compile", "kernel", "lantern", "orbit", "matrix", "harbor", "signal", "pepper", "quartz",
             "tensor", "meadow", "cache", "violet", "engine", "summit", "copper", "thread", "glacier", "token"]
    return " ".join(rng.choice(words) + (str(rng.randrange(100)) if rng.random() < 0.3 else "") for _ in range(n_words))


def request(port: int, text: str) -> dict:
    body = {"prompt": text, "max_tokens": 8, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, None
    for t, ev in stream(port, "/v1/completions", body, 600):
        if first is None and ev.get("choices") and ev["choices"][0].get("text"):
            first = t
        if ev.get("usage"):
            usage = ev["usage"]
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "usage": usage}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", required=True)
    ap.add_argument("--tokens", type=int, default=24000, help="about this many prompt tokens")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("serve", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    with lily_serve(a.lily, a.serve) as port:
        # a short warm-up request, then the timed ones (about 1.6 tokens a word of this text with the Qwen vocabulary)
        request(port, prompt(50, 0))
        runs = [request(port, prompt(int(a.tokens / 1.6), 1 + i)) for i in range(a.requests)]
        ttfts = sorted(r["ttft_s"] for r in runs)
        res = {"prompt_tokens": [r["usage"]["prompt_tokens"] if r["usage"] else None for r in runs],
               "runs": runs, "median_ttft_s": ttfts[len(ttfts) // 2]}
        print(json.dumps(res))
        if a.out:
            json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
