#!/usr/bin/env python3
"""Render Lily's built-in chat template with HF transformers and record the
results as fixtures for the Rust renderer (crates/lily-model/tests/chat_template.rs).

    /opt/refenv/bin/python tools/make_template_fixtures.py

The template source is crates/lily-model/src/chat_template.jinja; it is rendered
by the tokenizer's `apply_chat_template(..., chat_template=SRC, tokenize=False)`
(transformers' jinja2 environment: trim_blocks, lstrip_blocks, its own `tojson`,
`raise_exception`), with the tokenizer of fixtures/qwen3.6-tokenizer (which has
no template of its own; its special tokens are passed to the template as HF does).

Writes fixtures/chat_template/renders.json: a list of
  {name, messages, tools, add_generation_prompt, enable_thinking,
   preserve_thinking, expected}                       -- rendered text
or {..., error: true, error_message}                  -- the template raised.
Tool-call arguments are given to HF as dicts (what HF templates expect); the
Rust test also renders them as OpenAI-style JSON strings.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "crates", "lily-model", "src", "chat_template.jinja")
TOKENIZER = os.path.join(ROOT, "fixtures", "qwen3.6-tokenizer")
OUT = os.path.join(ROOT, "fixtures", "chat_template", "renders.json")

# ----------------------------------------------------------------- tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — température, humidité, 天气.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}

SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the knowledge base.\nReturns ranked passages ✨.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "description": "Optional filters",
                    "properties": {
                        "lang": {"type": "string", "enum": ["en", "de", "日本語"]},
                        "after": {"type": "string", "format": "date"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "score": {"type": "number", "minimum": 0.0, "maximum": 1.5},
                    },
                    "required": ["lang"],
                },
                "limit": {"type": "integer", "default": 10},
                "exact": {"type": "boolean", "default": False},
            },
            "required": ["query"],
        },
    },
}

TOOLS = [WEATHER, SEARCH]


def call(name, arguments, call_id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        c["id"] = call_id
    return c


# ------------------------------------------------------------- conversations

CASES = []


def case(name, messages, tools=None, add_generation_prompt=True, enable_thinking=True,
         preserve_thinking=False):
    CASES.append({
        "name": name,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "enable_thinking": enable_thinking,
        "preserve_thinking": preserve_thinking,
    })


U = lambda text: {"role": "user", "content": text}
A = lambda text, **kw: {"role": "assistant", "content": text, **kw}
S = lambda text: {"role": "system", "content": text}
T = lambda text, call_id=None: {"role": "tool", "content": text, **({"tool_call_id": call_id} if call_id else {})}

case("hello", [U("hello")])
case("single_user_thinking_off", [U("What is 2+2?")], enable_thinking=False)
case("user_whitespace_trimmed", [U("  \n  padded question \t\n")])
case("system_user", [S("You are a helpful assistant."), U("Hi there!")])
case("system_user_thinking_off", [S("You are terse."), U("Name a color.")], enable_thinking=False)
case("system_empty_no_tools", [S(""), U("hi")])
case("multi_turn", [
    S("You are a helpful assistant."),
    U("Hi"),
    A("Hello! How can I help?"),
    U("Tell me a joke."),
    A("Why did the chicken cross the road? To get to the other side."),
    U("Another one, please."),
])
case("multi_turn_thinking_off", [
    U("Hi"), A("Hello!"), U("Bye"),
], enable_thinking=False)
case("multi_turn_no_generation_prompt", [
    U("Hi"), A("Hello!"), U("How are you?"), A("Fine, thanks."),
], add_generation_prompt=False)
case("reasoning_content_history_dropped", [
    U("What is 17*3?"),
    A("17*3 = 51.", reasoning_content="17*3 = 17*2 + 17 = 34 + 17 = 51."),
    U("And 17*4?"),
])
case("reasoning_content_last_turn_kept", [
    U("What is 17*3?"),
    A("17*3 = 51.", reasoning_content="\n17*3 = 51, check: 50+1.\n"),
], add_generation_prompt=False)
case("reasoning_content_empty_last_turn", [
    U("Say hi."),
    A("Hi!", reasoning_content=""),
], add_generation_prompt=False)
case("inline_think_last_turn", [
    U("Capital of France?"),
    A("<think>\nThe user asks for the capital of France. It is Paris.\n</think>\n\nParis."),
], add_generation_prompt=False)
case("inline_think_history", [
    U("Capital of France?"),
    A("<think>\nParis, obviously.\n</think>\n\nParis."),
    U("And Italy?"),
])
case("inline_think_without_open_tag", [
    U("Capital of Spain?"),
    A("Madrid it is.\n</think>\n\nMadrid."),
], add_generation_prompt=False)
case("reasoning_content_overrides_inline", [
    U("q"),
    A("<think>inline</think>answer", reasoning_content="explicit"),
], add_generation_prompt=False)
case("preserve_thinking_history", [
    U("What is 17*3?"),
    A("51.", reasoning_content="17*3 = 51."),
    U("And 17*4?"),
    A("<think>\n17*4 = 68.\n</think>\n\n68."),
    U("And 17*5?"),
], preserve_thinking=True)
case("preserve_thinking_off_same_history", [
    U("What is 17*3?"),
    A("51.", reasoning_content="17*3 = 51."),
    U("And 17*4?"),
    A("<think>\n17*4 = 68.\n</think>\n\n68."),
    U("And 17*5?"),
], preserve_thinking=False)
case("preserve_thinking_no_reasoning", [
    U("a"), A("b"), U("c"),
], preserve_thinking=True, enable_thinking=False)
case("text_parts", [
    {"role": "system", "content": [{"type": "text", "text": "System in parts."}]},
    {"role": "user", "content": [{"type": "text", "text": "First part. "}, {"type": "text", "text": "Second part."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Answer in parts."}]},
    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
])
case("unicode_and_specials_in_content", [
    U("Ünïcödé ✓ 日本語 🙂 \"quotes\" 'apostrophes' <b>tags</b> & backslash \\ tab\tend"),
])
case("tools_no_system", [U("What's the weather in Paris?")], tools=TOOLS)
case("tools_with_system", [S("You are a weather bot."), U("Weather in Zürich?")], tools=TOOLS)
case("tools_with_empty_system", [S("   "), U("hi")], tools=[WEATHER])
case("tools_thinking_off", [U("Search for rust docs")], tools=TOOLS, enable_thinking=False)
case("tool_call_single", [
    U("What's the weather in Paris?"),
    A("", tool_calls=[call("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}, "call_1")]),
], tools=TOOLS, add_generation_prompt=False)
case("tool_call_with_content", [
    U("What's the weather in Paris?"),
    A("Let me check the weather.", reasoning_content="Need the weather tool.",
      tool_calls=[call("get_weather", {"city": "Paris"})]),
], tools=TOOLS, add_generation_prompt=False)
case("tool_call_value_types", [
    U("Search."),
    A("", tool_calls=[call("search_docs", {
        "query": "multi-line\nquery with \"quotes\" and ünïcode",
        "filters": {"lang": "日本語", "tags": ["a", "b c"], "score": 0.75, "nested": {"deep": [1, 2.5, None, True]}},
        "limit": 5,
        "exact": True,
        "ratio": 1.0,
        "big": 12345678901234,
        "neg": -3,
        "nothing": None,
        "off": False,
        "empty_list": [],
        "empty_obj": {},
        "tiny": 1e-7,
        "json_like_string": "{\"not\": \"parsed\"}",
        "number_string": "42",
    })]),
], tools=TOOLS, add_generation_prompt=False)
case("tool_calls_several", [
    U("Weather in Paris and Rome, and search docs."),
    A("I'll make three calls.", tool_calls=[
        call("get_weather", {"city": "Paris"}, "c1"),
        call("get_weather", {"city": "Rome", "unit": "fahrenheit"}, "c2"),
        call("search_docs", {"query": "weather APIs", "limit": 2}, "c3"),
    ]),
], tools=TOOLS, add_generation_prompt=False)
case("tool_call_no_arguments", [
    U("ping"),
    A("", tool_calls=[call("get_weather", {})]),
], tools=TOOLS, add_generation_prompt=False)
case("tool_response_single", [
    U("What's the weather in Paris?"),
    A("", tool_calls=[call("get_weather", {"city": "Paris"}, "call_1")]),
    T('{"temperature": 21, "condition": "sunny"}', "call_1"),
], tools=TOOLS)
case("tool_responses_consecutive", [
    U("Weather in Paris and Rome?"),
    A("", tool_calls=[call("get_weather", {"city": "Paris"}, "c1"), call("get_weather", {"city": "Rome"}, "c2")]),
    T("Paris: 21C, sunny", "c1"),
    T("Rome: 25C, cloudy\nwind 10 km/h", "c2"),
], tools=TOOLS)
case("tool_turn_then_answer", [
    S("Be concise."),
    U("Weather in Paris?"),
    A("Checking.", reasoning_content="I should call get_weather.",
      tool_calls=[call("get_weather", {"city": "Paris"}, "c1")]),
    T("21C, sunny", "c1"),
    A("It's 21°C and sunny in Paris.", reasoning_content="The tool says 21C sunny."),
], tools=TOOLS, add_generation_prompt=False)
case("tool_turn_then_answer_then_new_query", [
    U("Weather in Paris?"),
    A("", reasoning_content="Call the tool.", tool_calls=[call("get_weather", {"city": "Paris"})]),
    T("21C"),
    A("21°C in Paris.", reasoning_content="Answer."),
    U("And in Rome?"),
], tools=TOOLS)
case("tool_turn_then_new_query_preserve", [
    U("Weather in Paris?"),
    A("", reasoning_content="Call the tool.", tool_calls=[call("get_weather", {"city": "Paris"})]),
    T("21C"),
    A("21°C in Paris.", reasoning_content="Answer."),
    U("And in Rome?"),
], tools=TOOLS, preserve_thinking=True)
case("multi_step_tools_after_query", [
    U("Find docs then weather"),
    A("", tool_calls=[call("search_docs", {"query": "x"})]),
    T("doc1"),
    A("", reasoning_content="now weather", tool_calls=[call("get_weather", {"city": "Oslo"})]),
    T("-2C"),
], tools=TOOLS)
case("user_message_wrapped_tool_response_not_query", [
    U("Real question"),
    A("Calling.", tool_calls=[call("get_weather", {"city": "Oslo"})]),
    U("<tool_response>\n-2C\n</tool_response>"),
], tools=TOOLS)
case("tool_calls_without_tools", [
    U("Weather?"),
    A("", tool_calls=[call("get_weather", {"city": "Paris"})]),
    T("sunny"),
])
case("content_none_assistant", [
    U("Weather?"),
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"})]},
    T("sunny"),
], tools=[WEATHER])
case("empty_tools_list", [U("hi")], tools=[])
case("image_and_video_parts", [
    {"role": "user", "content": [
        {"type": "image", "image": "file:///a.png"},
        {"type": "text", "text": "What is in this image and this video?"},
        {"type": "video", "video": "file:///b.mp4"},
        {"type": "image_url", "image_url": {"url": "data:..."}},
    ]},
])
# The official template opens the user turn only after a non-tool message.
case("tool_message_first_quirk", [T("orphan result"), U("q")])

# errors
case("error_system_not_first", [U("hi"), S("late system")])
case("error_no_user_message", [S("sys only")])
case("error_only_assistant", [A("hello")])
case("error_only_tool_responses_as_user", [U("<tool_response>\nx\n</tool_response>")])
case("error_unknown_role", [U("hi"), {"role": "developer", "content": "dev"}])
case("error_empty_messages", [])
case("error_image_in_system_with_tools", [
    {"role": "system", "content": [{"type": "image", "image": "x"}]}, U("hi"),
], tools=[WEATHER])
case("error_bad_content_part", [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])


def main():
    from transformers import AutoTokenizer

    with open(TEMPLATE, encoding="utf-8") as f:
        src = f.read()
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    out = []
    for c in CASES:
        kwargs = dict(
            chat_template=src,
            tokenize=False,
            add_generation_prompt=c["add_generation_prompt"],
            enable_thinking=c["enable_thinking"],
            preserve_thinking=c["preserve_thinking"],
        )
        if c["tools"] is not None:
            kwargs["tools"] = c["tools"]
        rec = dict(c)
        try:
            if not c["messages"]:
                # transformers refuses an empty conversation before rendering; render
                # the template directly to get its own error.
                from transformers.utils.chat_template_utils import render_jinja_template

                render_jinja_template(
                    conversations=[c["messages"]], tools=c["tools"], chat_template=src,
                    add_generation_prompt=c["add_generation_prompt"],
                    enable_thinking=c["enable_thinking"], preserve_thinking=c["preserve_thinking"],
                )
                raise AssertionError("expected an error")
            rec["expected"] = tok.apply_chat_template(c["messages"], **kwargs)
            if c["name"].startswith("error_"):
                sys.exit(f"{c['name']}: expected an error, got {rec['expected']!r}")
        except Exception as e:  # jinja2.TemplateError from raise_exception
            if not c["name"].startswith("error_"):
                raise
            rec["error"] = True
            rec["error_message"] = str(e)
        out.append(rec)

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n_err = sum(1 for r in out if r.get("error"))
    print(f"wrote {OUT}: {len(out)} cases ({n_err} errors)")


if __name__ == "__main__":
    main()
