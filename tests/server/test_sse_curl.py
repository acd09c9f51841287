"""SSE framing as `curl` sees it: headers, `data:` events separated by blank
lines, one JSON object per event, `data: [DONE]` last."""

import json
import shutil
import subprocess

import pytest

from conftest import API_KEY, MODEL, sse_events

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl(server, path, body, *extra):
    out = subprocess.run(
        ["curl", "-sS", "-N", "-i", "--max-time", "60", f"{server.base}{path}", "-H", f"Authorization: Bearer {API_KEY}",
         "-H", "Content-Type: application/json", "-d", json.dumps(body), *extra],
        capture_output=True,
        check=True,
    ).stdout
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    return lines[0], headers, body


def data_events(body):
    events = sse_events(body)
    datas = []
    for ev in events:
        fields = [f for f, _ in ev]
        if fields == [""]:
            continue  # a keep-alive comment
        assert fields == ["data"], ev
        datas.append(ev[0][1])
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    return [json.loads(d) for d in datas[:-1]]


def test_chat_sse_framing(server):
    status, headers, body = curl(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    assert status.startswith("HTTP/1.1 200")
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert body.endswith(b"data: [DONE]\n\n")
    chunks = data_events(body)
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # Every chunk but the last carries "usage": null when usage is asked for.
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_sse_framing(server):
    status, headers, body = curl(server, "/v1/completions", {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 4, "stream": True})
    assert status.startswith("HTTP/1.1 200") and headers["content-type"].startswith("text/event-stream")
    chunks = data_events(body)
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_error_inside_a_stream_is_json_not_sse(server):
    # Errors found before the stream starts are plain JSON with their status.
    status, headers, body = curl(server, "/v1/chat/completions", {"messages": [], "stream": True})
    assert status.startswith("HTTP/1.1 400") and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["param"] == "messages"


def test_tool_call_sse(server):
    script = "</think>\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}}]
    _, _, body = curl(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": tools, "stream": True, "lily_test_script": script})
    chunks = data_events(body)
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) == 1
    (call,) = calls[0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"x":1}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
