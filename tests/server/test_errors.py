"""Every error case, in OpenAI's shape, over raw HTTP and through the
`openai` client: 400 (invalid JSON, wrong types, unsupported values, prompts
past --max-seq), 401, 404, 405, 413, 429 with Retry-After; and a bounded fuzz
of wrong values that must never get a 5xx or take the server down."""

import json
import socket
import threading
import time

import openai
import pytest

from conftest import API_KEY, MODEL, Server, error_shape

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def small():
    """A server with small limits: 1 MiB bodies, 1 waiting request, 256 tokens, thinking off by default."""
    s = Server("--max-body-mib", "1", "--queue", "1", "--max-seq", "256", "--no-think")
    yield s
    assert s.stop() == 0, "".join(s.log)


def check(resp, status, param=None, code=None):
    st, headers, body = resp
    assert st == status, (st, body)
    assert headers["content-type"].startswith("application/json")
    e = error_shape(body)
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e


def test_invalid_json(server):
    for body in [b"{bad json", b"", b"   ", b'{"messages": [}', b"\xff\xfe\x00", '{"messages": "\ud800"}'.encode("utf-8", "surrogatepass")]:
        e = check(server.post("/v1/chat/completions", body), 400)
        assert e["type"] == "invalid_request_error"
    for body in [b"null", b"[]", b"42", b'"text"']:
        check(server.post("/v1/chat/completions", body), 400)
        check(server.post("/v1/completions", body), 400)
    # Deep nesting is refused, not a stack overflow.
    check(server.post("/v1/chat/completions", b"[" * 100000 + b"]" * 100000), 400)


def test_wrong_types_and_values(server):
    cases = [
        ({"messages": "hi"}, "messages"),
        ({"messages": HI, "max_tokens": "10"}, "max_tokens"),
        ({"messages": HI, "max_tokens": -1}, "max_tokens"),
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "top_p": 5}, "top_p"),
        ({"messages": HI, "stream": 1}, "stream"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages[0].content[0].type"),
        ({"messages": HI, "n": 3}, "n"),
        ({"messages": HI, "response_format": {"type": "json_object"}}, "response_format.type"),
    ]
    for body, param in cases:
        check(server.post("/v1/chat/completions", body), 400, param=param)
    check(server.post("/v1/completions", {"prompt": ["a", "b"]}), 400, param="prompt")
    check(server.post("/v1/completions", {"prompt": [1, 999999999]}), 400, param="prompt")
    check(server.post("/v1/completions", {"prompt": ""}), 400, param="prompt")
    # A template error (no user message) is the client's: 400.
    check(server.post("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}), 400, param="messages")


def test_openai_client_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model=MODEL, messages=HI)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-0.5)


def test_auth(server):
    body = {"messages": HI, "max_tokens": 1}
    e = check(server.post("/v1/chat/completions", body, auth=False), 401, code="invalid_api_key")
    assert "Authorization" in e["message"]
    check(server.post("/v1/chat/completions", body, auth=False, headers={"Authorization": "Bearer wrong"}), 401)
    check(server.post("/v1/chat/completions", body, auth=False, headers={"Authorization": "Bearer " + API_KEY + "x"}), 401)
    check(server.post("/v1/chat/completions", body, auth=False, headers={"Authorization": "Basic " + API_KEY}), 401)
    check(server.request("GET", "/v1/models", auth=False), 401)
    st, _, _ = server.post("/v1/chat/completions", body, auth=False, headers={"Authorization": "bearer " + API_KEY})
    assert st == 200
    # Health and metrics are open (for probes and scrapers).
    assert server.request("GET", "/health", auth=False)[0] == 200
    assert server.request("GET", "/metrics", auth=False)[0] == 200


def test_not_found_and_method(server):
    check(server.request("GET", "/v1/nope"), 404)
    check(server.post("/v2/chat/completions", {"messages": HI}), 404)
    check(server.request("GET", "/"), 404)
    check(server.request("GET", "/v1/models/" + "gpt-4o"), 404, code="model_not_found")
    e = check(server.post("/v1/chat/completions", {"model": "other-model", "messages": HI}), 404, param="model", code="model_not_found")
    assert "other-model" in e["message"]
    check(server.request("GET", "/v1/chat/completions"), 405)
    check(server.request("DELETE", "/v1/models"), 405)


def test_prompt_longer_than_max_seq(small):
    long = [{"role": "user", "content": "hello " * 400}]
    e = check(small.post("/v1/chat/completions", {"messages": long}), 400, code="context_length_exceeded")
    assert "256" in e["message"]
    n = int(e["message"].split("has ")[1].split(" input")[0])
    assert n > 256
    # Room for the prompt but not for max_tokens.
    e = check(small.post("/v1/chat/completions", {"messages": HI, "max_tokens": 300}), 400, param="max_tokens", code="context_length_exceeded")
    assert "256" in e["message"] and "300" in e["message"]
    e = check(small.post("/v1/completions", {"prompt": list(range(300))}), 400, param="prompt", code="context_length_exceeded")
    assert "300" in e["message"]
    # The openai client sees a BadRequestError.
    with pytest.raises(openai.BadRequestError) as err:
        small.client().chat.completions.create(model=MODEL, messages=long)
    assert err.value.body["code"] == "context_length_exceeded"
    # Without max_tokens, the answer may take the rest of --max-seq.
    st, _, b = small.post("/v1/chat/completions", {"messages": HI, "lily_test_script": "ok"})
    assert st == 200 and json.loads(b)["choices"][0]["message"]["content"] == "ok"


def test_body_too_large(small):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    e = check(small.post("/v1/chat/completions", big), 413, code="request_too_large")
    assert str(1 << 20) in e["message"]
    # Chunked, without a Content-Length.
    s = socket.create_connection(("127.0.0.1", small.port), timeout=30)
    try:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
        s.sendall(head.encode())
        chunk = b"x" * 65536
        try:
            for _ in range(40):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        data = b""
        while b"\r\n\r\n" not in data:
            part = s.recv(65536)
            if not part:
                break
            data += part
        assert data.startswith(b"HTTP/1.1 413"), data[:200]
    finally:
        s.close()


def test_queue_full(small):
    """--queue 1: one request runs, one waits, the third is refused with 429
    and Retry-After; the client's departure frees the places."""
    slow = {"messages": HI, "max_tokens": 200, "lily_test_delay_ms": 20, "stream": True}
    conns = []

    def open_stream():
        s = socket.create_connection(("127.0.0.1", small.port), timeout=30)
        body = json.dumps(slow).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        conns.append(s)

    try:
        open_stream()
        small.wait_for(lambda m: m["lily_requests_running"] == 1, what="first request running")
        open_stream()
        small.wait_for(lambda m: m["lily_queue_depth"] == 1, what="second request queued")
        st, headers, body = small.post("/v1/chat/completions", {"messages": HI, "max_tokens": 1})
        check((st, headers, body), 429, code="queue_full")
        assert int(headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            small.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
        assert small.metrics()["lily_requests_rejected_total"] >= 2
    finally:
        for s in conns:
            s.close()
    # Both departed clients are cancelled; the server takes requests again.
    small.wait_idle(timeout=30)
    st, _, _ = small.post("/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert st == 200


def test_no_think_server_default(small):
    r = small.client().chat.completions.create(model=MODEL, messages=HI, extra_body={"lily_test_script": "Direct."})
    assert r.choices[0].message.content == "Direct."
    r = small.client().chat.completions.create(
        model=MODEL, messages=HI, extra_body={"lily_test_script": "Direct.", "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert r.choices[0].message.model_extra["reasoning_content"] == "Direct."


WRONG = [None, True, False, 0, -1, 1.5, 1e308, -1e308, 2**64, "", "x", [], [1], ["a", 2], {}, {"a": None}, [[]]]
FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stream", "stream_options",
    "logprobs", "top_logprobs", "n", "tools", "tool_choice", "chat_template_kwargs", "response_format", "enable_thinking",
]


def test_fuzz_never_5xx(server):
    """Each field set to each wrong-ish value (bounded: ~400 requests); the answer
    is 200 or a 4xx in OpenAI's shape, and the server stays healthy."""
    n_ok = 0
    for field in FIELDS:
        for v in WRONG:
            body = {"messages": HI, "max_tokens": 1, field: v}
            if field in ("max_tokens", "max_completion_tokens"):
                body.pop("max_tokens")
                body[field] = v
            st, _, b = server.post("/v1/chat/completions", body)
            assert st in (200, 400, 404), (field, v, st, b)
            if st == 200:
                n_ok += 1
                if body.get("stream") is True:
                    assert b"data: [DONE]" in b
                else:
                    json.loads(b)
            else:
                error_shape(b)
    for field in ["prompt", "echo", "logprobs", "best_of", "suffix", "max_tokens", "stop"]:
        for v in WRONG:
            body = {"prompt": "x", "max_tokens": 1, field: v}
            if field == "max_tokens" and v is None:
                body["max_tokens"] = 1
            st, _, b = server.post("/v1/completions", body)
            assert st in (200, 400), (field, v, st, b)
            if st != 200:
                error_shape(b)
    # Messages of every odd shape.
    odd = [
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [None]}],
        [{"role": "tool", "content": "result"}],
        [{"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "system", "content": "late system"}],
        [{"role": "user", "content": "x", "tool_calls": 5}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}, {"role": "user", "content": "x"}],
        [{"role": "assistant", "tool_calls": [{"function": {}}]}, {"role": "user", "content": "x"}],
        [{"role": "user", "content": "\u0000\ufffd{%raw%}{{ x }}<|im_end|><think>"}],
        [{"role": "user", "content": "x" * 5000}],
    ]
    for m in odd:
        st, _, b = server.post("/v1/chat/completions", {"messages": m, "max_tokens": 1})
        assert st in (200, 400), (m, st, b)
        if st != 200:
            error_shape(b)
    assert n_ok > 10
    assert server.request("GET", "/health")[0] == 200
    m = server.metrics()
    assert not any(k.startswith("lily_http_requests_total") and 'status="5' in k for k in m), m


def test_bad_requests_do_not_disturb_a_stream(server):
    """A stream runs while malformed requests arrive; it completes intact."""
    result = {}

    def stream():
        c = server.client()
        text, finish = "", None
        for ch in c.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0, stream=True):
            if ch.choices:
                text += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                finish = ch.choices[0].finish_reason or finish
        result["stream"] = (text, finish)

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(30):
        server.post("/v1/chat/completions", b"{garbage")
        server.post("/v1/chat/completions", {"messages": 5})
        server.post("/v1/completions", {"prompt": [-5]})
    t.join(60)
    ref = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0)
    assert result["stream"] == (ref.choices[0].message.model_extra["reasoning_content"], "length")
