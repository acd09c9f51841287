"""Clients that leave, clients that do not read, and graceful shutdown."""

import json
import signal
import socket
import threading
import time

import openai
import pytest

from conftest import API_KEY, MODEL, Server

HI = [{"role": "user", "content": "Hi"}]


def raw_post(port, path, body):
    """Sends a request on a raw socket and returns the socket (unread)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    b = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n".encode()
        + b
    )
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_the_generation(server, stream):
    server.wait_idle()
    before = server.finished().get("cancelled", 0)
    tokens0 = server.metrics()["lily_generation_tokens_total"]
    s = raw_post(server.port, "/v1/chat/completions", {"messages": HI, "max_tokens": 1000, "stream": stream})
    server.wait_for(lambda m: m["lily_requests_running"] == 1, what="running")
    time.sleep(0.3)
    s.close()
    t0 = time.time()
    m = server.wait_idle(timeout=10)
    assert time.time() - t0 < 5
    assert server.finished().get("cancelled", 0) == before + 1
    # It stopped long before its 1000 tokens.
    assert m["lily_generation_tokens_total"] - tokens0 < 500
    # The next request is served normally.
    r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_a_client_that_does_not_read_blocks_nobody(server):
    """A stream nobody reads (its socket buffers fill up) must not stall the
    engine: the requests behind it are answered."""
    server.wait_idle()
    lazy = raw_post(server.port, "/v1/chat/completions", {"messages": HI, "max_tokens": 400, "stream": True, "logprobs": True, "top_logprobs": 20})
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        server.wait_for(lambda m: m["lily_requests_running"] == 1, what="running")
        t0 = time.time()
        r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        assert r.usage.completion_tokens == 3
        assert time.time() - t0 < 60
    finally:
        lazy.close()
    server.wait_idle()


def test_cancelled_while_queued(server):
    """A request whose client leaves while it waits is never run."""
    server.wait_idle()
    before = server.finished()
    first = raw_post(server.port, "/v1/chat/completions", {"messages": HI, "max_tokens": 50, "lily_test_delay_ms": 20})
    server.wait_for(lambda m: m["lily_requests_running"] == 1, what="running")
    queued = raw_post(server.port, "/v1/chat/completions", {"messages": HI, "max_tokens": 50, "stream": True})
    server.wait_for(lambda m: m["lily_queue_depth"] == 1, what="queued")
    queued.close()
    data = b""
    while b"\r\n0\r\n\r\n" not in data and b'"usage"' not in data:
        part = first.recv(65536)
        if not part:
            break
        data += part
    first.close()
    assert b"HTTP/1.1 200" in data
    server.wait_idle()
    after = server.finished()
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0) + 1


def test_graceful_shutdown_finishes_running_requests():
    s = Server("--shutdown-timeout", "30")
    try:
        c = s.client()
        stream = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, stream=True, extra_body={"lily_test_delay_ms": 25})
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        finish = None
        for ch in it:
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        assert finish == "length"
        assert s.proc.wait(30) == 0
        log = "".join(s.log)
        assert "shutting down" in log and "stopped" in log
    finally:
        s.kill()


def test_shutdown_cancels_what_outlives_the_grace_period():
    s = Server("--shutdown-timeout", "1")
    try:
        c = s.client()
        got = {}

        def waiting():
            try:
                c.chat.completions.create(model=MODEL, messages=HI, max_tokens=1000)
            except openai.APIStatusError as e:
                got["queued"] = e.status_code

        stream = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2000, stream=True, extra_body={"lily_test_delay_ms": 10})
        it = iter(stream)
        next(it)
        t = threading.Thread(target=waiting)
        t.start()
        s.wait_for(lambda m: m["lily_queue_depth"] == 1, what="queued")
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "shutting down" in str(e.value)
        t.join(30)
        assert got.get("queued") == 503
        assert s.proc.wait(30) == 0
        assert time.time() - t0 < 15
    finally:
        s.kill()


def test_second_signal_cancels_at_once():
    s = Server("--shutdown-timeout", "600")
    try:
        stream = s.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3000, stream=True, extra_body={"lily_test_delay_ms": 10})
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
        assert s.proc.wait(30) == 0
    finally:
        s.kill()
