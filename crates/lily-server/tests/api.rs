//! Request parsing: every wrong type or unsupported value is a 400 naming the
//! parameter; unknown fields are ignored; messages come out as the chat
//! template reads them.

use lily_server::api::{parse_chat, parse_completion, Prompt, ToolChoice};
use serde_json::{json, Value};

fn chat_err(body: Value) -> (String, Option<String>) {
    let e = parse_chat(&body).expect_err(&body.to_string());
    assert_eq!(e.status.as_u16(), 400, "{body}");
    (e.message, e.param)
}

fn user() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

#[test]
fn chat_accepts_the_openai_fields_and_ignores_unknown_ones() {
    let r = parse_chat(&json!({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning": "thought",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": -3,
        "stop": ["a", "b"], "stream": true, "stream_options": {"include_usage": true},
        "logprobs": true, "top_logprobs": 4,
        "chat_template_kwargs": {"enable_thinking": false, "preserve_thinking": true, "other": 1},
        "some_future_field": {"x": [1, 2]}, "user": "u", "parallel_tool_calls": true, "n": 1,
    }))
    .unwrap();
    assert_eq!(r.messages[0]["role"], "system");
    assert_eq!(r.messages[1]["content"][1]["text"], "b");
    assert_eq!(r.messages[2]["reasoning_content"], "thought");
    assert_eq!(
        r.messages[2]["tool_calls"][0]["function"]["arguments"],
        json!({"x": 1})
    );
    assert_eq!(r.messages[3]["tool_call_id"], "call_1");
    assert_eq!(r.tool_choice, ToolChoice::Named("f".into()));
    assert_eq!(r.common.max_tokens, Some(7));
    assert_eq!(r.common.top_k, Some(0));
    assert_eq!(r.common.seed, Some(-3i64 as u64));
    let big = parse_chat(&json!({"messages": user(), "seed": u64::MAX, "logit_bias": {"12": -100, "7": 2.5},
                                 "tool_choice": {"type": "function", "name": "f"}, "tools": [{"type": "function", "function": {"name": "f"}}]}))
    .unwrap();
    assert_eq!(big.common.seed, Some(u64::MAX));
    assert_eq!(big.common.logit_bias, vec![(12, -100.0), (7, 2.5)]);
    assert_eq!(big.tool_choice, ToolChoice::Named("f".into()));
    assert_eq!(r.common.stop, vec!["a", "b"]);
    assert!(r.common.stream && r.common.include_usage);
    assert_eq!(r.logprobs, Some(4));
    assert_eq!(
        (r.enable_thinking, r.preserve_thinking),
        (Some(false), true)
    );
    // null means absent
    let r =
        parse_chat(&json!({"messages": user(), "temperature": null, "stop": null, "tools": null}))
            .unwrap();
    assert_eq!(r.common.temperature, None);
    assert!(r.tools.is_none());
}

#[test]
fn chat_rejects_bad_values_naming_the_parameter() {
    let cases: Vec<(Value, &str)> = vec![
        (json!([1, 2]), ""),
        (json!({}), "messages"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (json!({"messages": user(), "n": 2}), "n"),
        (json!({"messages": user(), "n": "1"}), "n"),
        (json!({"messages": user(), "max_tokens": 0}), "max_tokens"),
        (json!({"messages": user(), "max_tokens": 1.5}), "max_tokens"),
        (
            json!({"messages": user(), "max_tokens": 1e300}),
            "max_tokens",
        ),
        (
            json!({"messages": user(), "max_completion_tokens": "5"}),
            "max_completion_tokens",
        ),
        (
            json!({"messages": user(), "temperature": "hot"}),
            "temperature",
        ),
        (
            json!({"messages": user(), "temperature": -1}),
            "temperature",
        ),
        (json!({"messages": user(), "top_p": 0}), "top_p"),
        (json!({"messages": user(), "top_k": -2}), "top_k"),
        (json!({"messages": user(), "min_p": 2}), "min_p"),
        (
            json!({"messages": user(), "presence_penalty": 3}),
            "presence_penalty",
        ),
        (
            json!({"messages": user(), "frequency_penalty": [1]}),
            "frequency_penalty",
        ),
        (
            json!({"messages": user(), "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (json!({"messages": user(), "seed": "x"}), "seed"),
        (json!({"messages": user(), "stop": 5}), "stop"),
        (json!({"messages": user(), "stop": ["a", 1]}), "stop[1]"),
        (
            json!({"messages": user(), "stop": "x".repeat(1025)}),
            "stop",
        ),
        (json!({"messages": user(), "stream": "yes"}), "stream"),
        (
            json!({"messages": user(), "stream_options": {"include_usage": 1}}),
            "stream_options.include_usage",
        ),
        (
            json!({"messages": user(), "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            json!({"messages": user(), "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"messages": user(), "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tools": [{"type": "retrieval"}]}),
            "tools[0].type",
        ),
        (
            json!({"messages": user(), "tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function.name",
        ),
        (json!({"messages": user(), "tools": {"a": 1}}), "tools"),
        (
            json!({"messages": user(), "chat_template_kwargs": {"enable_thinking": "no"}}),
            "chat_template_kwargs.enable_thinking",
        ),
        (
            json!({"messages": user(), "response_format": {"type": "json_schema"}}),
            "response_format.type",
        ),
        (json!({"messages": user(), "model": 3}), "model"),
        (
            json!({"messages": user(), "logit_bias": {"abc": 1}}),
            "logit_bias.abc",
        ),
        (
            json!({"messages": user(), "logit_bias": {"5": 200}}),
            "logit_bias.5",
        ),
        (json!({"messages": user(), "logit_bias": [1]}), "logit_bias"),
    ];
    for (body, param) in cases {
        let (msg, p) = chat_err(body.clone());
        assert!(!msg.is_empty());
        if param.is_empty() {
            assert_eq!(p, None, "{body}");
        } else {
            assert_eq!(p.as_deref(), Some(param), "{body}: {msg}");
        }
    }
}

#[test]
fn completion_prompts() {
    let p = |v: Value| parse_completion(&json!({"prompt": v})).map(|r| r.prompt);
    assert_eq!(p(json!("abc")).unwrap(), Prompt::Text("abc".into()));
    assert_eq!(p(json!(["abc"])).unwrap(), Prompt::Text("abc".into()));
    assert_eq!(p(json!([1, 2, 3])).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
    assert_eq!(p(json!([[4, 5]])).unwrap(), Prompt::Tokens(vec![4, 5]));
    for bad in [
        json!(["a", "b"]),
        json!([[1], [2]]),
        json!([]),
        json!([-1]),
        json!([1.5]),
        json!(5),
        json!({"a": 1}),
        json!([4294967296u64]),
    ] {
        let e = p(bad.clone()).expect_err(&bad.to_string());
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("prompt")),
            "{bad}"
        );
    }
    assert!(parse_completion(&json!({})).is_err());
    assert!(parse_completion(&json!({"prompt": "x", "best_of": 2})).is_err());
    assert!(parse_completion(&json!({"prompt": "x", "suffix": "y"})).is_err());
    assert!(parse_completion(&json!({"prompt": "x", "echo": true, "logprobs": 2})).is_err());
    let r =
        parse_completion(&json!({"prompt": "x", "logprobs": 2, "echo": false, "max_tokens": 3}))
            .unwrap();
    assert_eq!((r.logprobs, r.common.max_tokens), (Some(2), Some(3)));
}
