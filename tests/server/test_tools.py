"""Tool calls end to end with the `openai` client.

The model's text is forced with the test-only hook `lily_test_script` (see
conftest.py), written in the format Qwen3.6 produces; the server's parser turns
it into OpenAI `tool_calls`. `tool_choice` forcing is checked on the real
(random) model: the answer must open the call."""

import json

import pytest

from conftest import MODEL

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}},
    },
]
ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]

ONE_CALL = (
    "The user wants the weather.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)
TWO_CALLS = (
    "Two things to do.\n</think>\n\nLet me look both up.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=search>\n<parameter=query>\nmulti\nline \"quoted\" <b>text</b>\n</parameter>\n"
    "<parameter=filters>\n{\"lang\": \"fr\", \"n\": 2}\n</parameter>\n</function>\n</tool_call>"
)


def test_tool_call_non_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"lily_test_script": ONE_CALL})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert c.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3, "metric": True}


def test_tool_calls_streamed(client):
    from test_openai_client import collect_stream

    s = collect_stream(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True, extra_body={"lily_test_script": TWO_CALLS}))
    assert s["finish"] == "tool_calls"
    assert s["reasoning"] == "Two things to do."
    assert s["content"] == "Let me look both up.\n\n"
    calls = [s["tool_calls"][i] for i in sorted(s["tool_calls"])]
    assert [c["name"] for c in calls] == ["get_weather", "search"]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Lyon"}
    assert json.loads(calls[1]["arguments"]) == {"query": 'multi\nline "quoted" <b>text</b>', "filters": {"lang": "fr", "n": 2}}
    # Non-streamed, the same calls.
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"lily_test_script": TWO_CALLS})
    got = [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls]
    assert got == [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert r.choices[0].message.content == "Let me look both up.\n\n"


def test_tool_result_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"lily_test_script": ONE_CALL})
    msg = first.choices[0].message
    history = ASK + [
        {
            "role": "assistant",
            "content": msg.content,
            "tool_calls": [{"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}} for t in msg.tool_calls],
        },
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": json.dumps({"temp_c": 21, "sky": "clear"})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, extra_body={"lily_test_script": "Done.\n</think>\n\nIt is 21°C and clear in Paris."}
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is 21°C and clear in Paris."
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_tool_choice_none_leaves_the_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", extra_body={"lily_test_script": ONE_CALL})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert c.message.content.startswith("<tool_call>\n<function=get_weather>")
    # And the tools are not in the prompt.
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens - 100


@pytest.mark.parametrize(
    "choice,prefix",
    [
        ({"type": "function", "function": {"name": "search"}}, "<tool_call>\n<function=search>\n"),
        ("required", "<tool_call>\n<function="),
    ],
)
def test_tool_choice_forces_a_call(client, choice, prefix):
    # The random model, thinking off: the answer must open the call. (It then
    # writes gibberish, so the call is malformed and comes back as content.)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    c = r.choices[0]
    text = c.message.content or ""
    assert text.startswith(prefix) or c.message.tool_calls, (text, c.message.tool_calls)


def test_forced_named_call_is_parsed(client):
    # Forcing plus a well-formed continuation (scripted) gives a real call.
    script = "<tool_call>\n<function=search>\n<parameter=query>\nlily\n</parameter>\n</function>\n</tool_call>"
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}},
        extra_body={"lily_test_script": script, "chat_template_kwargs": {"enable_thinking": False}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "lily"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_malformed_call_comes_back_as_content(client):
    bad = "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"lily_test_script": bad})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert c.message.content == "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"


def test_tool_choice_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
        )
    assert "arguments" in e.value.body["param"]
