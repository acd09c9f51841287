#!/usr/bin/env python3
"""An agent's conversation through `lily serve`, as a client sees it: the
prompt cache's time to first token, turn by turn, and the decode speed of
the sampling settings Qwen recommends.

Starts `LILY serve ARGS...` on a free port, waits for /health, then:
1. Turns: a conversation whose first message is about --history tokens of
   varied text, growing by about --turn tokens a turn (the answer and a new
   message). Each turn is a streamed chat request (thinking off, greedy,
   --answer tokens): its time to first token, prompt tokens and the cached
   tokens the server reports.
2. Cold: the last turn's messages under another system message (nothing
   cached): its time to first token, the uncached reference.
3. Decode: one request per sampling setting (plain greedy, sampled, with
   presence_penalty 1.5, with repetition_penalty 1.1, with top_logprobs 5),
   --decode tokens each: tokens after the first over the time after the
   first (stream arrival times).
Prints one JSON object (also to --out) and a short table on stderr.

usage: serve_agent.py --lily PATH [--history 6000] [--turn 300] [--turns 6] [--out FILE] -- serve args...
  e.g. serve_agent.py --lily .carry/lily --out agent.json -- --device cuda --synthetic full --max-seq 16384
"""
import argparse
import json
import random
import sys
import time
import urllib.request

from serve_process import lily_serve, stream

WORDS = ["river", "compile", "kernel", "lantern", "orbit", "matrix", "harbor", "signal", "pepper", "quartz",
         "tensor", "meadow", "cache", "violet", "engine", "summit", "copper", "thread", "glacier", "token"]


def text(n_tokens: int, seed: int) -> str:
    """About n_tokens tokens of varied words (about 1.6 tokens a word)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.3 else "")
                    for _ in range(int(n_tokens / 1.6)))


def chat(port: int, messages: list, max_tokens: int, **sampling) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0, **sampling}
    t0 = time.perf_counter()
    arrivals, content, usage = [], [], None
    for t, ev in stream(port, "/v1/chat/completions", body):
        for c in ev.get("choices") or []:
            d = c.get("delta") or {}
            piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
            if piece:
                arrivals.append(t)
                content.append(d.get("content") or "")
        if ev.get("usage"):
            usage = ev["usage"]
    return {"ttft_s": arrivals[0] if arrivals else None, "total_s": time.perf_counter() - t0,
            "arrivals": arrivals, "content": "".join(content), "usage": usage}


PHASES = ("lily_request_prepare_seconds_sum", "lily_request_queue_seconds_sum", "lily_engine_first_token_seconds_sum")


def phase_sums(port: int) -> dict:
    """The server's running sums of the time-to-first-token phases (/metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        body = r.read().decode()
    out = {}
    for line in body.splitlines():
        name, _, v = line.partition(" ")
        if name in PHASES:
            out[name] = float(v)
    return out


def timed_chat(port: int, messages: list, max_tokens: int) -> dict:
    """`chat`, with the server's phases of this request (prepare, queue, engine to the first token)."""
    before = phase_sums(port)
    r = chat(port, messages, max_tokens)
    after = phase_sums(port)
    r["phases_ms"] = {k.split("_seconds")[0].replace("lily_", ""): round((after.get(k, 0) - before.get(k, 0)) * 1e3, 2)
                      for k in PHASES}
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", required=True)
    ap.add_argument("--history", type=int, default=6000, help="tokens of the first message, about")
    ap.add_argument("--turn", type=int, default=300, help="tokens of each new message, about")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=32, help="tokens answered each turn")
    ap.add_argument("--decode", type=int, default=256, help="tokens of each decode measurement")
    ap.add_argument("--out")
    ap.add_argument("serve", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    with lily_serve(a.lily, a.serve) as port:
        chat(port, [{"role": "user", "content": "warm up"}], 4)
        # 1. the conversation
        msgs = [{"role": "system", "content": "You are an agent. Keep answers short."},
                {"role": "user", "content": text(a.history, 1)}]
        turns = []
        for t in range(a.turns):
            last = list(msgs)
            r = timed_chat(port, msgs, a.answer)
            u = r["usage"] or {}
            turns.append({"turn": t, "prompt_tokens": u.get("prompt_tokens"),
                          "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                          "ttft_s": r["ttft_s"], "phases_ms": r["phases_ms"]})
            msgs += [{"role": "assistant", "content": r["content"]},
                     {"role": "user", "content": text(a.turn, 100 + t)}]
        # 2. a cold conversation of the last turn's size
        cold_msgs = [{"role": "system", "content": "You are a different agent!"}] + last[1:]
        c = timed_chat(port, cold_msgs, a.answer)
        cold = {"prompt_tokens": (c["usage"] or {}).get("prompt_tokens"),
                "cached_tokens": ((c["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
                "ttft_s": c["ttft_s"], "phases_ms": c["phases_ms"]}
        # 3. decode speeds
        settings = {
            "greedy": {},
            "sampled": {"temperature": 1.0, "top_p": 0.95, "extra_top_k": 20},
            "presence_penalty 1.5": {"temperature": 1.0, "top_p": 0.95, "extra_top_k": 20, "presence_penalty": 1.5},
            "repetition_penalty 1.1": {"temperature": 1.0, "top_p": 0.95, "extra_top_k": 20,
                                       "repetition_penalty": 1.1},
            "top_logprobs 5": {"temperature": 1.0, "top_p": 0.95, "extra_top_k": 20, "logprobs": True,
                               "top_logprobs": 5},
        }
        decode = {}
        for name, s in settings.items():
            s = dict(s)
            if "extra_top_k" in s:
                s["top_k"] = s.pop("extra_top_k")
            r = chat(port, [{"role": "user", "content": text(200, 7)}], a.decode, seed=3, **s)
            arr = r["arrivals"]
            n = (r["usage"] or {}).get("completion_tokens") or len(arr)
            span = arr[-1] - arr[0] if len(arr) > 1 else None
            decode[name] = {"completion_tokens": n, "tok_s": (n - 1) / span if span else None}
        res = {"turns": turns, "cold": cold, "decode": decode,
               "ttft_ratio_after_first": [round(x["ttft_s"] / cold["ttft_s"], 4) for x in turns[1:]]
               if cold["ttft_s"] else None}
        print(json.dumps(res))
        if a.out:
            json.dump(res, open(a.out, "w"), indent=1)
        # the server's phases: the request's preparation (parse, template, tokenizer), its wait in
        # the queue, the engine's time to the first token (restore, prefill, first step); the rest
        # of the client's time to first token is HTTP and streaming
        print("turn  prompt  cached  ttft ms  prepare  queue  engine", file=sys.stderr)
        rows = [(f"{x['turn']:>4}", x) for x in turns] + [("cold", cold)]
        for label, x in rows:
            p = x["phases_ms"]
            print(f"{label}  {x['prompt_tokens']:>6}  {x['cached_tokens']:>6}  {x['ttft_s'] * 1e3:7.1f}  "
                  f"{p['request_prepare']:7.1f}  {p['request_queue']:5.1f}  {p['engine_first_token']:6.1f}",
                  file=sys.stderr)
        for name, d in decode.items():
            print(f"decode {name:<24} {d['tok_s'] or 0:8.1f} tok/s ({d['completion_tokens']} tokens)",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
