"""Bounded load: 32 concurrent `openai` clients, 256 chat requests (most
streamed, about a fifth leaving mid-stream, some not streamed). Every request
must complete or be cancelled cleanly, the metrics must add up, and the
server's memory must come back to its warmed-up baseline."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MODEL, Server

CLIENTS = 32
REQUESTS = 256
WARMUP = 64
RSS_SLACK_MB = 50


def one_request(server, local, i, seed):
    rng = random.Random(seed * 100003 + i)
    if not hasattr(local, "client"):
        local.client = server.client(timeout=300)
    c = local.client
    max_tokens = rng.randint(4, 16)
    msgs = [{"role": "user", "content": f"Request {i}: " + " ".join(rng.choice(["tell", "me", "about", "the", "sea", "sky"]) for _ in range(rng.randint(1, 30)))}]
    kind = rng.random()
    kw = dict(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0.7, seed=i)
    if kind < 0.1:
        r = c.chat.completions.create(**kw)
        assert r.choices[0].finish_reason in ("length", "stop")
        n = r.usage.completion_tokens
        assert n <= max_tokens and (n == max_tokens) == (r.choices[0].finish_reason == "length")
        return ("complete", n)
    leave_after = rng.randint(1, 3) if kind < 0.3 else None
    chunks, finish, usage = 0, None, None
    with c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw) as stream:
        for ch in stream:
            chunks += 1
            if ch.usage:
                usage = ch.usage
            elif ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
            if leave_after is not None and chunks >= leave_after:
                return ("left", 0)  # closing the stream drops the connection
    assert finish in ("length", "stop") and usage is not None, (finish, usage)
    assert usage.completion_tokens <= max_tokens
    return ("complete", usage.completion_tokens)


def run_load(server, n, seed):
    local = threading.local()
    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(lambda i: one_request(server, local, i, seed), range(n)))


def test_concurrent_streaming_load():
    s = Server()
    try:
        warm = run_load(s, WARMUP, seed=1)
        s.wait_idle(60)
        time.sleep(0.5)
        base_rss = s.rss_mb()
        m0, f0 = s.metrics(), s.finished()

        t0 = time.time()
        results = run_load(s, REQUESTS, seed=2)
        elapsed = time.time() - t0
        m1 = s.wait_idle(120)
        time.sleep(0.5)
        rss = s.rss_mb()
        f1 = s.finished()

        complete = [n for kind, n in results if kind == "complete"]
        left = sum(1 for kind, _ in results if kind == "left")
        assert len(complete) + left == REQUESTS
        assert left >= REQUESTS // 10, left
        d = {k: f1.get(k, 0) - f0.get(k, 0) for k in set(f0) | set(f1)}
        # Each request ended exactly once, and only as stop, length or cancelled.
        assert sum(d.values()) == REQUESTS, d
        assert set(k for k, v in d.items() if v) <= {"stop", "length", "cancelled"}, d
        assert d.get("stop", 0) + d.get("length", 0) >= len(complete)
        # A client that left after its answer was done is not a cancellation.
        assert 1 <= d.get("cancelled", 0) <= left
        assert m1["lily_generation_tokens_total"] - m0["lily_generation_tokens_total"] >= sum(complete)
        assert m1["lily_time_to_first_token_seconds_count"] > m0["lily_time_to_first_token_seconds_count"]
        # The engine's part of the time to first token is observed at the same moment, for the
        # same requests, and is never longer than the whole; preparation and queueing are
        # observed for every request the engine took.
        ttft = [m1[f"lily_time_to_first_token_seconds_{x}"] - m0[f"lily_time_to_first_token_seconds_{x}"] for x in ("count", "sum")]
        eng = [m1[f"lily_engine_first_token_seconds_{x}"] - m0[f"lily_engine_first_token_seconds_{x}"] for x in ("count", "sum")]
        assert eng[0] == ttft[0] and 0 < eng[1] <= ttft[1], (eng, ttft)
        taken = m1["lily_request_queue_seconds_count"] - m0["lily_request_queue_seconds_count"]
        assert taken >= ttft[0] and m1["lily_request_prepare_seconds_count"] - m0["lily_request_prepare_seconds_count"] == taken
        assert m1["lily_inter_token_latency_seconds_count"] > m0["lily_inter_token_latency_seconds_count"]
        assert m1["lily_requests_rejected_total"] == 0
        assert not any(k.startswith("lily_http_requests_total") and 'status="5' in k for k in m1)
        # Memory back near the warmed-up baseline.
        assert rss <= base_rss + RSS_SLACK_MB, (base_rss, rss)
        print(f"\nload: {REQUESTS} requests from {CLIENTS} clients in {elapsed:.1f}s; {left} left mid-stream, "
              f"{d.get('cancelled', 0)} cancelled; RSS {base_rss:.0f} -> {rss:.0f} MB (warm-up {len(warm)})")
        # Still serving.
        r = s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert r.usage.completion_tokens == 1
    finally:
        code = s.stop()
    assert code == 0, "".join(s.log)
    assert "panicked" not in "".join(s.log)
