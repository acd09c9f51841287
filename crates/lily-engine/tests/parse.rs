//! Tests for the incremental Qwen3.5/3.6 output parser (`lily_engine::parse`).

use lily_engine::parse::{convert_value, merge_events, parse_all, Event, OutputParser, ToolCall};
use serde_json::{json, Value};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "ratio": {"type": "number"},
            "count": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object"},
            "maybe": {"type": ["string", "null"]},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "mode": {"enum": ["fast", "slow"]}
        }}}}),
        json!({"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}),
    ]
}

const WEATHER_CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

fn args(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn call(name: &str, a: Value) -> ToolCall {
    ToolCall {
        name: name.to_string(),
        arguments: args(a),
    }
}

/// Feeds `chunks` one by one, then finishes; returns the merged events.
fn run_chunks<S: AsRef<str>>(
    chunks: &[S],
    in_reasoning: bool,
    tools: Option<&[Value]>,
) -> Vec<Event> {
    let mut p = OutputParser::new(in_reasoning, tools);
    let mut ev = Vec::new();
    for c in chunks {
        let out = p.push(c.as_ref());
        assert!(out
            .iter()
            .all(|e| !matches!(e, Event::Reasoning(s) | Event::Content(s) if s.is_empty())));
        ev.extend(out);
    }
    ev.extend(p.finish());
    merge_events(ev)
}

/// Tiny deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Parses `text` whole, then checks that every chunking (all 2-way splits, single characters,
/// random chunkings with a fixed seed) gives the same merged events. Returns the whole-text events.
fn check_splits(text: &str, in_reasoning: bool, tools: Option<&[Value]>) -> Vec<Event> {
    let whole = run_chunks(&[text], in_reasoning, tools);
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    for &i in &bounds {
        let got = run_chunks(&[&text[..i], &text[i..]], in_reasoning, tools);
        assert_eq!(got, whole, "split at byte {i} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    assert_eq!(
        run_chunks(&chars, in_reasoning, tools),
        whole,
        "char-by-char of {text:?}"
    );
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for trial in 0..40 {
        let mut chunks = Vec::new();
        let mut k = 0;
        while k + 1 < bounds.len() {
            let step = 1 + (rng.next() % 12) as usize;
            let j = (k + step).min(bounds.len() - 1);
            chunks.push(&text[bounds[k]..bounds[j]]);
            k = j;
        }
        assert_eq!(
            run_chunks(&chunks, in_reasoning, tools),
            whole,
            "random chunking {trial} of {text:?}"
        );
    }
    // parse_all agrees with the merged events.
    let (r, c, calls) = parse_all(text, in_reasoning, tools);
    let mut er = String::new();
    let mut ec = String::new();
    let mut ecalls = Vec::new();
    for e in &whole {
        match e {
            Event::Reasoning(s) => er.push_str(s),
            Event::Content(s) => ec.push_str(s),
            Event::ToolCall(t) => ecalls.push(t.clone()),
        }
    }
    assert_eq!((r, c, calls), (er, ec, ecalls));
    whole
}

#[test]
fn thinking_then_answer() {
    let text = "The user asks 2+2.\n\nThat is 4.\n</think>\n\nThe answer is **4**.";
    let ev = check_splits(text, true, None);
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("The user asks 2+2.\n\nThat is 4.".into()),
            Event::Content("The answer is **4**.".into()),
        ]
    );
    // Same with tools given: no tool call, same split.
    assert_eq!(check_splits(text, true, Some(&tools())), ev);
}

#[test]
fn thinking_then_tool_call() {
    let text = format!("I should look up the weather.\n</think>\n\n{WEATHER_CALL}");
    let t = tools();
    let ev = check_splits(&text, true, Some(&t));
    let expected = call("get_weather", json!({"city": "Paris", "days": 3}));
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("I should look up the weather.".into()),
            Event::ToolCall(expected.clone())
        ]
    );
    assert_eq!(expected.arguments_json(), r#"{"city":"Paris","days":3}"#);
    // End-of-turn whitespace after the call is dropped.
    let (r, c, calls) = parse_all(&format!("{text}\n"), true, Some(&t));
    assert_eq!(
        (r.as_str(), c.as_str(), calls),
        ("I should look up the weather.", "", vec![expected])
    );
}

#[test]
fn two_tool_calls_after_text() {
    let second = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>";
    let text = format!(
        "Checking both cities.\n</think>\n\nLet me check both.\n\n{WEATHER_CALL}\n{second}\n"
    );
    let ev = check_splits(&text, true, Some(&tools()));
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("Checking both cities.".into()),
            Event::Content("Let me check both.\n\n".into()),
            Event::ToolCall(call("get_weather", json!({"city": "Paris", "days": 3}))),
            Event::ToolCall(call("get_weather", json!({"city": "London"}))),
        ]
    );
}

#[test]
fn text_after_calls_is_content() {
    let text = format!("{WEATHER_CALL}\n\n  Done: see above.\n");
    let ev = check_splits(&text, false, Some(&tools()));
    assert_eq!(
        ev,
        vec![
            Event::ToolCall(call("get_weather", json!({"city": "Paris", "days": 3}))),
            Event::Content("Done: see above.\n".into()),
        ]
    );
}

#[test]
fn multiline_value_with_angle_brackets() {
    let body = "fn main() {\n    if a < b && c<d {\n        // </param and </parameter look-alikes, <parameter=x> too\n    }\n}\n\n";
    let text = format!(
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a < b.rs\n</parameter>\n<parameter=content>\n{body}\n</parameter>\n</function>\n</tool_call>"
    );
    let ev = check_splits(&text, false, Some(&tools()));
    assert_eq!(
        ev,
        vec![Event::ToolCall(call(
            "write_file",
            json!({"path": "src/a < b.rs", "content": body})
        ))]
    );
    // Exactly one newline is stripped at each end; an empty value is empty.
    let t = "<tool_call>\n<function=write_file>\n<parameter=path>\n\n x \n\n</parameter>\n<parameter=content>\n</parameter>\n</function>\n</tool_call>";
    let (_, c, calls) = parse_all(t, false, Some(&tools()));
    assert_eq!(c, "");
    assert_eq!(
        calls,
        vec![call(
            "write_file",
            json!({"path": "\n x \n", "content": ""})
        )]
    );
}

#[test]
fn nested_json_arguments() {
    let text = "<tool_call>\n<function=set_flags>\n<parameter=tags>\n[\"a\", \"b<c\"]\n</parameter>\n<parameter=opts>\n{\"k\": {\"n\": [1, 2.5, null]}, \"s\": \"x\"}\n</parameter>\n</function>\n</tool_call>";
    let ev = check_splits(text, false, Some(&tools()));
    let expected = call(
        "set_flags",
        json!({"tags": ["a", "b<c"], "opts": {"k": {"n": [1, 2.5, null]}, "s": "x"}}),
    );
    assert_eq!(ev, vec![Event::ToolCall(expected.clone())]);
    assert_eq!(
        expected.arguments_json(),
        // keys in the order the model wrote them (serde_json preserve_order)
        r#"{"tags":["a","b<c"],"opts":{"k":{"n":[1,2.5,null]},"s":"x"}}"#
    );
    // Python-style literal fallback.
    let py = "<tool_call>\n<function=set_flags>\n<parameter=opts>\n{'a': True, 'b': None, 'c': ('x', 1,), 'd': \"it's\"}\n</parameter>\n<parameter=tags>\n['q', 'r',]\n</parameter>\n</function>\n</tool_call>";
    let (_, _, calls) = parse_all(py, false, Some(&tools()));
    assert_eq!(
        calls,
        vec![call(
            "set_flags",
            json!({"opts": {"a": true, "b": null, "c": ["x", 1], "d": "it's"}, "tags": ["q", "r"]})
        )]
    );
}

#[test]
fn booleans_numbers_and_fallbacks() {
    let p = |k: &str, v: &str| format!("<parameter={k}>\n{v}\n</parameter>\n");
    let text = format!(
        "<tool_call>\n<function=set_flags>\n{}{}{}{}{}{}</function>\n</tool_call>",
        p("enabled", "True"),
        p("ratio", "0.25"),
        p("count", "-2"),
        p("maybe", "null"),
        p("limit", "7"),
        p("mode", "fast"),
    );
    let ev = check_splits(&text, false, Some(&tools()));
    assert_eq!(
        ev,
        vec![Event::ToolCall(call(
            "set_flags",
            json!({"enabled": true, "ratio": 0.25, "count": -2, "maybe": null, "limit": 7, "mode": "fast"})
        ))]
    );
    let schema = |t: Value| json!({ "type": t });
    assert_eq!(convert_value("3", Some(&schema(json!("number")))), json!(3));
    assert!(convert_value("3", Some(&schema(json!("number")))).is_i64());
    assert_eq!(
        convert_value("1e3", Some(&schema(json!("number")))),
        json!(1000.0)
    );
    assert_eq!(
        convert_value("inf", Some(&schema(json!("number")))),
        json!("inf")
    );
    assert_eq!(
        convert_value("3.5", Some(&schema(json!("integer")))),
        json!("3.5")
    );
    assert_eq!(
        convert_value("FALSE", Some(&schema(json!("boolean")))),
        json!(false)
    );
    assert_eq!(
        convert_value("yes", Some(&schema(json!("boolean")))),
        json!("yes")
    );
    assert_eq!(
        convert_value("null", Some(&schema(json!("integer")))),
        json!(null)
    );
    assert_eq!(
        convert_value("null", Some(&schema(json!("string")))),
        json!("null")
    );
    assert_eq!(
        convert_value(" 42 ", Some(&schema(json!(["integer", "string"])))),
        json!(42)
    );
    assert_eq!(
        convert_value("forty", Some(&schema(json!(["integer", "string"])))),
        json!("forty")
    );
    assert_eq!(
        convert_value("{not json", Some(&schema(json!("object")))),
        json!("{not json")
    );
    assert_eq!(
        convert_value("[1]", Some(&schema(json!("object")))),
        json!("[1]")
    );
    assert_eq!(convert_value("12", None), json!("12"));
    assert_eq!(
        convert_value("12", Some(&json!({"description": "no type"}))),
        json!("12")
    );
    assert_eq!(convert_value("5", Some(&json!({"enum": [1, 5]}))), json!(5));
}

#[test]
fn unknown_function_and_parameter_stay_strings() {
    let text =
        "<tool_call>\n<function=launch>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>";
    let ev = check_splits(text, false, Some(&tools()));
    assert_eq!(ev, vec![Event::ToolCall(call("launch", json!({"n": "3"})))]);
    let text = "<tool_call>\n<function=get_weather>\n<parameter=units>\n3\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        parse_all(text, false, Some(&tools())).2,
        vec![call("get_weather", json!({"units": "3"}))]
    );
    // Empty tools list still parses calls.
    assert_eq!(parse_all(text, false, Some(&[][..])).2.len(), 1);
}

#[test]
fn no_thinking() {
    let text = "\n\nHello there.\nHow can I help? a < b </think> stays\n";
    let ev = check_splits(text, false, Some(&tools()));
    assert_eq!(
        ev,
        vec![Event::Content(
            "Hello there.\nHow can I help? a < b </think> stays\n".into()
        )]
    );
    assert_eq!(check_splits(text, false, None), ev);
}

#[test]
fn model_emitted_think_tag_is_tolerated() {
    let text = "<think>\nHmm.\n</think>\n\nHi!";
    let expected = vec![
        Event::Reasoning("Hmm.".into()),
        Event::Content("Hi!".into()),
    ];
    assert_eq!(check_splits(text, true, None), expected);
    assert_eq!(check_splits(text, false, None), expected);
    assert_eq!(
        check_splits(&format!("\n{text}"), false, Some(&tools())),
        expected
    );
    // `<think>` later in reasoning is just text.
    let ev = check_splits("a <think> b</think>c", true, None);
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("a <think> b".into()),
            Event::Content("c".into())
        ]
    );
}

#[test]
fn stream_ending_inside_reasoning() {
    let text = "Still thinking about <tool_call> and </thin and <tool_call>\nnot a call\n\n";
    let ev = check_splits(text, true, Some(&tools()));
    assert_eq!(ev, vec![Event::Reasoning(text.trim_end().into())]);
    assert_eq!(check_splits(text, true, None), ev);
    assert_eq!(check_splits("", true, Some(&tools())), vec![]);
    assert_eq!(check_splits("\n\n", true, None), vec![]);
}

#[test]
fn tool_call_inside_reasoning_ends_it() {
    // Qwen3.5 may open a call without `</think>` (vLLM's qwen3 parser treats it as the end).
    let text = format!("I need the weather.\n\n{WEATHER_CALL}");
    let ev = check_splits(&text, true, Some(&tools()));
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("I need the weather.".into()),
            Event::ToolCall(call("get_weather", json!({"city": "Paris", "days": 3}))),
        ]
    );
    // Without tools it is all reasoning.
    assert_eq!(
        check_splits(&text, true, None),
        vec![Event::Reasoning(text.clone())]
    );
}

#[test]
fn reasoning_and_content_do_not_leak() {
    let reasoning = "R1 <tool <think </thin </think\nR2 <tool_call> R3";
    let content = "C1 </think> C2 <tool_cal C3 <tool_call";
    let text = format!("{reasoning}\n</think>\n\n{content}");
    for tools in [None, Some(tools())] {
        let ev = check_splits(&text, true, tools.as_deref());
        assert_eq!(
            ev,
            vec![
                Event::Reasoning(reasoning.into()),
                Event::Content(content.into())
            ]
        );
    }
}

#[test]
fn malformed_calls_are_verbatim_content() {
    let cases = [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "<tool_call>\nhello world\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nand then\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n</function>\ntrailing</tool_call>",
        "Sure. <tool_call>",
        "Sure. <tool_call>\n<func",
        "<tool_call><tool_call>\n<function=f\n",
    ];
    for text in cases {
        let ev = check_splits(text, false, Some(&tools()));
        assert_eq!(ev, vec![Event::Content(text.into())], "{text:?}");
        // Also after reasoning.
        let ev = check_splits(&format!("think\n</think>\n\n{text}"), true, Some(&tools()));
        assert_eq!(
            ev,
            vec![
                Event::Reasoning("think".into()),
                Event::Content(text.into())
            ],
            "{text:?}"
        );
    }
    // Valid format but no tools: plain content.
    let text = format!("Calling.\n{WEATHER_CALL}\n");
    assert_eq!(
        check_splits(&text, false, None),
        vec![Event::Content(text.clone())]
    );
}

#[test]
fn malformed_then_valid_call() {
    let text = format!("<tool_call>\ngarbage\n{WEATHER_CALL}");
    let ev = check_splits(&text, false, Some(&tools()));
    assert_eq!(
        ev,
        vec![
            Event::Content("<tool_call>\ngarbage\n".into()),
            Event::ToolCall(call("get_weather", json!({"city": "Paris", "days": 3}))),
        ]
    );
}

#[test]
fn streaming_is_live() {
    let t = tools();
    let mut p = OutputParser::new(true, Some(&t));
    assert_eq!(p.push("Think"), vec![Event::Reasoning("Think".into())]);
    // Trailing whitespace and a possible tag start are held back, nothing more.
    assert_eq!(p.push("ing a\n"), vec![Event::Reasoning("ing a".into())]);
    assert_eq!(p.push("b </th"), vec![Event::Reasoning("\nb".into())]);
    assert_eq!(p.push("ink>\n"), vec![]);
    assert_eq!(p.push("\nAns"), vec![Event::Content("Ans".into())]);
    assert_eq!(p.push("wer <"), vec![Event::Content("wer ".into())]);
    assert_eq!(p.push("b <tool_c"), vec![Event::Content("<b ".into())]);
    assert_eq!(
        p.push("all>\n<function=get_weather>\n<parameter=city>\nParis"),
        vec![]
    );
    assert_eq!(
        p.push("\n</parameter>\n</function>\n</tool_call>"),
        vec![Event::ToolCall(call(
            "get_weather",
            json!({"city": "Paris"})
        ))]
    );
    assert_eq!(p.push("\n"), vec![]);
    assert_eq!(p.finish(), vec![]);

    // Without tools, content is never held back.
    let mut p = OutputParser::new(false, None);
    assert_eq!(
        p.push("x <tool_c"),
        vec![Event::Content("x <tool_c".into())]
    );
    // An unfinished call is flushed verbatim at the end.
    let mut p = OutputParser::new(false, Some(&t));
    assert_eq!(p.push("<tool_call>\n<function=get_weather>\n"), vec![]);
    assert_eq!(
        p.finish(),
        vec![Event::Content(
            "<tool_call>\n<function=get_weather>\n".into()
        )]
    );
}

#[test]
fn unicode_text_splits() {
    let text = "Überlegung: 日本語 ✓\n</think>\n\nAntwort: café 🎉 <tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🇨🇭\n</parameter>\n</function>\n</tool_call>";
    let ev = check_splits(text, true, Some(&tools()));
    assert_eq!(
        ev,
        vec![
            Event::Reasoning("Überlegung: 日本語 ✓".into()),
            Event::Content("Antwort: café 🎉 ".into()),
            Event::ToolCall(call("get_weather", json!({"city": "Zürich 🇨🇭"}))),
        ]
    );
}
