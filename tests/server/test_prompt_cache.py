"""The prompt cache through `lily serve`: a conversation's later turns, a
regenerated turn and a second conversation on the same system prompt report
the history they reused (`usage.prompt_tokens_details.cached_tokens`), give
the greedy answers a server without a cache gives, and show in /metrics."""

import pytest

from conftest import MODEL, Server

SYSTEM = "You are a terse assistant for a shipping company. " * 8
# user turns long enough to be saved: a snapshot is taken 32 tokens or more past the last one
DETAIL = " It left the depot on Monday and was due on Thursday, but the tracking page has said nothing since."


@pytest.fixture(scope="module")
def servers():
    cached, plain = Server("--max-seq", "2048"), Server("--max-seq", "2048", "--prompt-cache-mib", "0")
    yield cached, plain
    for s in (cached, plain):
        assert s.stop() == 0, "".join(s.log)
        assert "panicked" not in "".join(s.log), "".join(s.log)


def ask(server, messages, n=8):
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=n,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    u = r.usage
    return r.choices[0].message.content, u.prompt_tokens, u.prompt_tokens_details.cached_tokens


def test_turns_reuse_the_history_and_answer_as_without_cache(servers):
    cached, plain = servers
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is parcel 1?" + DETAIL}]
    prev_prompt, before = 0, 0
    for turn in range(3):
        answer, prompt, hit = ask(cached, msgs)
        want, want_prompt, want_hit = ask(plain, msgs)
        assert (answer, prompt) == (want, want_prompt), f"turn {turn}"
        assert want_hit == 0
        if turn == 0:
            assert hit == 0
        else:
            # resumed at least at the last turn's answer header (the template
            # renders a past answer without the generation prompt's tail)
            assert prev_prompt - 8 <= hit < prompt, (turn, hit, prompt, prev_prompt)
        before, prev_prompt = prev_prompt, prompt
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And parcel {turn + 2}?" + DETAIL}]
    # regenerate the last turn with another message: the history is reused up
    # to the previous answer's header (no mark at the last message's start)
    msgs[-1] = {"role": "user", "content": "Never mind: what are your opening hours?" + DETAIL}
    answer, prompt, hit = ask(cached, msgs)
    assert answer == ask(plain, msgs)[0]
    assert before - 8 <= hit < prompt, (hit, prompt, before)
    # another conversation on the same system prompt resumes after it, not after the first conversation
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you ship to Norway?"}]
    answer, prompt, hit = ask(cached, other)
    assert answer == ask(plain, other)[0]
    assert 60 < hit < prompt - 5, (hit, prompt)
    m = cached.metrics()
    assert m["lily_prompt_cache_hits_total"] >= 4
    assert m["lily_prompt_cache_misses_total"] >= 1
    assert m["lily_prompt_cache_hit_tokens_total"] >= 4 * 60
    assert m["lily_prompt_cache_entries"] > 0 and m["lily_prompt_cache_bytes"] > 0
    assert m["lily_prompt_cache_bytes"] <= m["lily_prompt_cache_budget_bytes"]
    assert m["lily_prompt_cache_failures_total"] == 0
    p = plain.metrics()
    assert p["lily_prompt_cache_budget_bytes"] == 0 and p["lily_prompt_cache_entries"] == 0
