"""The official `openai` package against `lily serve`: models, chat (streamed
and not), text completions, sampling options, thinking, log-probabilities."""

import math

import openai
import pytest

from conftest import MODEL

HI = [{"role": "user", "content": "Hello!"}]


def test_models(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "lily"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nonexistent")


def test_chat_non_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.message.role == "assistant"
    assert c.message.tool_calls is None
    # Thinking is on by default and the random model never closes </think>:
    # everything it wrote is reasoning.
    reasoning = c.message.model_extra["reasoning_content"]
    assert isinstance(reasoning, str) and reasoning
    assert c.message.content == ""
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def collect_stream(stream):
    """Accumulates a streamed chat answer."""
    out = {"role": None, "content": "", "reasoning": "", "finish": None, "usage": None, "chunks": 0, "ids": set(), "tool_calls": {}}
    for ch in stream:
        out["chunks"] += 1
        out["ids"].add(ch.id)
        assert ch.object == "chat.completion.chunk" and ch.model == MODEL
        if ch.usage is not None:
            assert ch.choices == []
            out["usage"] = ch.usage
            continue
        (c,) = ch.choices
        d = c.delta
        if d.role:
            out["role"] = d.role
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            acc = out["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.id or acc["id"]
            if tc.function:
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
        if c.finish_reason:
            assert out["finish"] is None
            out["finish"] = c.finish_reason
    return out


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    s = collect_stream(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert s["role"] == "assistant" and s["finish"] == "length" and len(s["ids"]) == 1
    assert s["reasoning"] == whole.choices[0].message.model_extra["reasoning_content"]
    assert s["content"] == whole.choices[0].message.content
    assert s["usage"].completion_tokens == 10
    assert s["usage"].prompt_tokens == whole.usage.prompt_tokens
    assert s["usage"].prompt_tokens_details.cached_tokens == 0
    # Without include_usage there is no usage chunk.
    s = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert s["usage"] is None and s["finish"] == "length"


def test_max_completion_tokens_and_sampling_options(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}],
        max_completion_tokens=3,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=11,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_seed_repeats_a_sampled_answer(client):
    def run(seed):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=1.0, seed=seed, extra_body={"top_k": 0})
        return r.choices[0].message.model_extra["reasoning_content"]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_multi_turn_and_developer_role(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour", "reasoning_content": "greet back"},
            {"role": "user", "content": "How are you?"},
        ],
        max_tokens=2,
    )
    assert r.usage.completion_tokens == 2


def test_reasoning_and_content_are_split(client):
    script = "The user greets me.\nI should greet back.\n</think>\n\nHello! How can I help?"
    r = client.chat.completions.create(model=MODEL, messages=HI, extra_body={"lily_test_script": script})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user greets me.\nI should greet back."
    assert m.content == "Hello! How can I help?"
    assert r.choices[0].finish_reason == "stop"
    s = collect_stream(client.chat.completions.create(model=MODEL, messages=HI, stream=True, extra_body={"lily_test_script": script}))
    assert s["reasoning"] == "The user greets me.\nI should greet back."
    assert s["content"] == "Hello! How can I help?"
    assert s["finish"] == "stop"


def test_thinking_off_per_request(client):
    on = client.chat.completions.create(model=MODEL, messages=HI, extra_body={"lily_test_script": "Plain answer."})
    off = client.chat.completions.create(
        model=MODEL, messages=HI, extra_body={"lily_test_script": "Plain answer.", "chat_template_kwargs": {"enable_thinking": False}}
    )
    # Thinking on: text without </think> is all reasoning. Off: all content.
    assert on.choices[0].message.model_extra["reasoning_content"] == "Plain answer."
    assert off.choices[0].message.content == "Plain answer."
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    # The thinking-off prompt ends with an empty think block: more tokens.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_preserve_thinking_keeps_past_reasoning(client):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "a long chain of thought " * 5},
        {"role": "user", "content": "Bye"},
    ]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    kept = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    assert kept.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_stop_strings(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(
        model=MODEL, messages=HI, stop=["STOP", "never"], extra_body={"lily_test_script": "alpha beta STOP gamma", **off}
    )
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=HI, stop="gam", extra_body={"lily_test_script": "alpha beta STOP gamma", **off})
    assert r.choices[0].message.content == "alpha beta STOP "


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 5
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.bytes == list(t.token.encode())
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert sum(math.exp(x) for x in tops) <= 1.0 + 1e-4
        # Greedy: the chosen token is the most likely one.
        assert abs(t.logprob - tops[0]) < 1e-5
    # Streamed: the same log-probabilities, spread over the chunks.
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in lp]
    assert all(abs(a.logprob - b.logprob) < 1e-6 for a, b in zip(streamed, lp))
    # A forced token has probability 1.
    r = client.chat.completions.create(model=MODEL, messages=HI, logprobs=True, extra_body={"lily_test_script": "Yes"})
    assert [t.logprob for t in r.choices[0].logprobs.content] == [0.0]
    # Without logprobs: null.
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert r.choices[0].logprobs is None


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.finish_reason == "length" and isinstance(c.text, str) and c.text
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == 8  # "1, 2, 3," in the Qwen3.6 vocabulary
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # Token ids give the same answer as the text they encode.
    ids = client.completions.create(model=MODEL, prompt=[16, 11, 220, 17, 11, 220, 18, 11], max_tokens=5, temperature=0)
    assert ids.usage.prompt_tokens == 8 and ids.choices[0].text == c.text
    # Default max_tokens is 16, as OpenAI's.
    d = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert d.usage.completion_tokens == 16
    # echo
    e = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Echo me")


def test_completions_streamed_and_logprobs(client):
    kw = dict(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    whole = client.completions.create(**kw)
    text, finish, usage = "", None, None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage:
            usage = ch.usage
            continue
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
    assert text == whole.choices[0].text and finish == "length" and usage.completion_tokens == 6
    r = client.completions.create(logprobs=2, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    r = client.completions.create(model=MODEL, prompt="x", extra_body={"lily_test_script": "forced text"})
    assert r.choices[0].text == "forced text" and r.choices[0].finish_reason == "stop"


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=1,
        user="someone",
        metadata={"a": "b"},
        store=False,
        parallel_tool_calls=False,
        extra_body={"some_new_field": {"nested": [1, 2]}, "guided_json": None},
    )
    assert r.usage.completion_tokens == 1


def test_logit_bias(client):
    # Token 9419 is "Hello": a +100 bias makes greedy decoding repeat it.
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logit_bias={"9419": 100})
    assert r.choices[0].text == "HelloHelloHello"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"9419": 101})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"999999999": 1})
