//! Chat templates: render OpenAI-style messages into the prompt text the model
//! was trained on, the way HF transformers' `apply_chat_template` does.
//!
//! The checkpoint's own template (`chat_template.jinja`, or the `chat_template`
//! of `tokenizer_config.json`) is preferred; [`ChatTemplate::builtin`] is Lily's
//! copy of the Qwen3.6 template for checkpoints that ship none.
//!
//! The renderer is `minijinja` set up like transformers' `_compile_jinja_template`
//! (jinja2 `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`,
//! no trailing newline kept, loop controls, `raise_exception`, `strftime_now` and
//! a `tojson` that is `json.dumps(x, ensure_ascii=False)`), plus Python
//! compatibility where minijinja's defaults differ from jinja2 on Python objects:
//! string methods (`.startswith`, `.split`, `.strip`, `.items()`, `.get`, …),
//! printing (`True`, `None`, `1.0`), `|string` and `|trim`.
//!
//! JSON objects keep the key order of the `serde_json::Value`s given to
//! [`ChatTemplate::render`]; with serde_json's default (sorted) maps that order is
//! alphabetical, so HF's insertion order (which `tojson` of the tool schemas and
//! the order of tool-call parameters depend on) needs serde_json's
//! `preserve_order` feature.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context as _, Result};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State};

/// Name under which the template is stored in its environment.
const NAME: &str = "chat_template";

/// Options of one rendering, named as the template variables they set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// Append the header of a new assistant turn (`<|im_start|>assistant\n…`).
    pub add_generation_prompt: bool,
    /// Let the model think; false makes the Qwen template emit an empty think block.
    pub enable_thinking: bool,
    /// Qwen3.6: keep the reasoning of every past assistant turn, not only the
    /// turns after the last user query.
    pub preserve_thinking: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            add_generation_prompt: true,
            enable_thinking: true,
            preserve_thinking: false,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … as HF passes them to the template.
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// The checkpoint's own template: `chat_template.jinja` in `dir`, else the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` of which the one named "default" is taken), else `None`.
    /// The special tokens of `tokenizer_config.json` (`bos_token`, `eos_token`, …)
    /// are made available to the template, as HF does.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", config_path.display()))?,
            )
        } else {
            None
        };

        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .with_context(|| format!("reading {}", jinja_path.display()))?,
            )
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => {
                    let mut names = Vec::new();
                    let mut found = None;
                    for entry in list {
                        let name = entry.get("name").and_then(|n| n.as_str());
                        let template = entry.get("template").and_then(|t| t.as_str());
                        match (name, template) {
                            (Some("default"), Some(t)) => {
                                found = Some(t.to_string());
                                break;
                            }
                            (Some(n), Some(_)) => names.push(n.to_string()),
                            _ => anyhow::bail!(
                                "{}: chat_template list entries must be {{name, template}} strings",
                                config_path.display()
                            ),
                        }
                    }
                    match found {
                        Some(t) => Some(t),
                        None => anyhow::bail!(
                            "{}: chat_template list has no \"default\" entry (names: {})",
                            config_path.display(),
                            names.join(", ")
                        ),
                    }
                }
                Some(other) => anyhow::bail!(
                    "{}: chat_template must be a string or a list, found {}",
                    config_path.display(),
                    json_kind(other)
                ),
            }
        };

        let Some(source) = source else {
            return Ok(None);
        };
        let origin = if jinja_path.is_file() {
            jinja_path
        } else {
            config_path
        };
        let mut template = ChatTemplate::from_source(&source)
            .with_context(|| format!("compiling the chat template of {}", origin.display()))?;
        if let Some(config) = &config {
            template.special_tokens = special_tokens(config);
        }
        Ok(Some(template))
    }

    /// Lily's built-in Qwen3.6 template.
    pub fn builtin() -> ChatTemplate {
        ChatTemplate::from_source(include_str!("chat_template.jinja"))
            .expect("the built-in chat template compiles")
    }

    /// Compile a template from its source.
    pub fn from_source(src: &str) -> Result<ChatTemplate> {
        let mut env = new_environment();
        env.add_template_owned(NAME, strip_generation_tags(src))
            .map_err(|e| anyhow!("invalid chat template: {}", describe(&e)))?;
        Ok(ChatTemplate {
            source: src.to_string(),
            env,
            special_tokens: Vec::new(),
        })
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render a conversation.
    ///
    /// `messages` are OpenAI-style objects `{role, content, reasoning_content?,
    /// tool_calls?, tool_call_id?, name?}` whose content is a string, a list of
    /// parts (`{type: "text", text}`, images, videos) or null; `tools` are OpenAI
    /// tool objects. Tool-call `arguments` given as a JSON string (the OpenAI wire
    /// form) are parsed into an object first, as HF templates iterate them as a
    /// mapping; a string that is not a JSON object is left as it is.
    /// Errors raised by the template (`raise_exception`) come back as `Err`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        opts: &RenderOptions,
    ) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| to_value(&normalize_message(m)))
            .collect();
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert(
            "tools".into(),
            match tools {
                Some(t) => Value::from(t.iter().map(to_value).collect::<Vec<_>>()),
                None => Value::from(()),
            },
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        ctx.insert("enable_thinking".into(), Value::from(opts.enable_thinking));
        ctx.insert(
            "preserve_thinking".into(),
            Value::from(opts.preserve_thinking),
        );

        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        template
            .render(Value::from(ctx))
            .map_err(|e| anyhow!("chat template: {}", describe(&e)))
    }
}

/// An error with its causes, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `bos_token` & co. from a tokenizer_config (a string, or an AddedToken object
/// with `content`), as HF's `special_tokens_map`.
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        let token = match config.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_string),
            _ => None,
        };
        if let Some(t) = token {
            out.push((key.to_string(), t));
        }
    }
    out
}

/// Tool-call arguments sent as JSON strings become objects.
fn normalize_message(message: &serde_json::Value) -> serde_json::Value {
    let mut message = message.clone();
    if let Some(calls) = message.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
        for call in calls {
            let target = match call.get_mut("function") {
                Some(f) if f.is_object() => f,
                _ => call,
            };
            if let Some(args) = target.get_mut("arguments") {
                if let serde_json::Value::String(s) = args {
                    if let Ok(parsed @ serde_json::Value::Object(_)) =
                        serde_json::from_str::<serde_json::Value>(s)
                    {
                        *args = parsed;
                    }
                }
            }
        }
    }
    message
}

// ------------------------------------------------------------------ values

/// A JSON object as a template mapping that keeps its keys in the order given.
#[derive(Debug)]
struct JsonMap {
    entries: Vec<(Value, Value)>,
}

impl Object for JsonMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.entries.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

fn to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(m) => Value::from_object(JsonMap {
            entries: m
                .iter()
                .map(|(k, v)| (Value::from(k.as_str()), to_value(v)))
                .collect(),
        }),
    }
}

/// Key/value pairs of a mapping, in its order.
fn map_pairs(v: &Value) -> Option<Vec<(Value, Value)>> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    Some(v.as_object()?.try_iter_pairs()?.collect())
}

// -------------------------------------------------------------- environment

fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("default delimiters are valid"),
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(unknown_method);
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Undefined | ValueKind::String => minijinja::escape_formatter(out, state, value),
        _ => out.write_str(&py_str(value)).map_err(Error::from),
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", string_filter);
    env.add_filter("trim", trim_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = match message.as_str() {
        Some(s) => s.to_string(),
        None => py_str(&message),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's string methods, with Python's whitespace in the strip family;
/// everything else goes to minijinja-contrib's pycompat.
fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars: Option<String> = match args {
            [] => None,
            [c] if c.is_none() => None,
            [c] => Some(
                c.as_str()
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            format!("{method} arg must be None or str"),
                        )
                    })?
                    .to_string(),
            ),
            _ => return Err(Error::from(ErrorKind::TooManyArguments)),
        };
        let (left, right) = (method != "rstrip", method != "lstrip");
        return Ok(Value::from(py_strip(s, chars.as_deref(), left, right)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.isspace`.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_space(c),
    };
    let mut s = s;
    if left {
        s = s.trim_start_matches(strip);
    }
    if right {
        s = s.trim_end_matches(strip);
    }
    s
}

/// jinja2's `trim`: `str(value).strip(chars)`.
fn trim_filter(value: &Value, chars: Option<String>) -> Value {
    let s = match value.as_str() {
        Some(s) => s.to_string(),
        None => py_str(value),
    };
    Value::from(py_strip(&s, chars.as_deref(), true, true))
}

/// jinja2's `string`: Python's `str()` (strings, including safe ones, unchanged).
fn string_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        value.clone()
    } else {
        Value::from(py_str(value))
    }
}

// --------------------------------------------------------------- python str

/// Python's `repr(float)`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if f == 0.0 {
        return format!("{sign}0.0");
    }
    // Shortest round-trip digits, as Python's repr uses.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1; // value = 0.DIGITS x 10^decpt
    if decpt > -4 && decpt <= 16 {
        if decpt <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(decpt as usize - digits.len())
            )
        } else {
            let (a, b) = digits.split_at(decpt as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let e = decpt - 1;
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if e < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", e.abs())
    }
}

/// Python's `repr(str)`.
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if matches!(c, '\u{1680}' | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}'
                | '\u{205f}'..='\u{2064}' | '\u{3000}' | '\u{feff}') =>
            {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `str()` of a template value (what jinja2 prints).
fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr()` of a template value.
fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if !v.is_integer() => match f64::try_from(v.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => v.to_string(),
        },
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq => match v.try_iter() {
            Ok(items) => format!(
                "[{}]",
                items.map(|x| py_repr(&x)).collect::<Vec<_>>().join(", ")
            ),
            Err(_) => v.to_string(),
        },
        ValueKind::Map => match map_pairs(v) {
            Some(pairs) => format!(
                "{{{}}}",
                pairs
                    .iter()
                    .map(|(k, x)| format!("{}: {}", py_repr(k), py_repr(x)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => v.to_string(),
        },
        _ => v.to_string(),
    }
}

// ------------------------------------------------------------------- tojson

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` (the same positional order), not minijinja's HTML-safe one.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |pos: Option<Value>, key: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(key)?;
        Ok(kw.or(pos).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) if v.is_integer() => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        Some(v) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: bad indent {v}"),
            ))
        }
    };
    let (item_sep, key_sep) = match pick(separators, "separators")? {
        None => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap().to_string(),
                    b.as_str().unwrap().to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    };
    let sort_keys = pick(None, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    dump_json(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

fn dump_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn not_serializable(v: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: {} is not JSON serializable", v.kind()),
    )
}

fn dump_json(v: &Value, o: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            out.push_str(&if f.is_nan() {
                "NaN".to_string()
            } else if f.is_infinite() {
                if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
            } else {
                py_float_repr(f)
            });
        }
        ValueKind::String => dump_json_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Seq => {
            let items: Vec<Value> = v.try_iter()?.collect();
            dump_container(out, o, level, '[', ']', &items, |x, out, level| {
                dump_json(x, o, level, out)
            })?;
        }
        ValueKind::Map => {
            let mut pairs = map_pairs(v).ok_or_else(|| not_serializable(v))?;
            if o.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            dump_container(out, o, level, '{', '}', &pairs, |(k, x), out, level| {
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
                    ValueKind::Number => py_str(k),
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                k.kind()
                            ),
                        ))
                    }
                };
                dump_json_str(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dump_json(x, o, level, out)
            })?;
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

/// Python json's layout of a list or dict, with or without `indent`.
fn dump_container<T>(
    out: &mut String,
    o: &JsonOpts,
    level: usize,
    open: char,
    close: char,
    items: &[T],
    mut each: impl FnMut(&T, &mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let inner = level + 1;
    let newline_indent = o
        .indent
        .as_ref()
        .map(|ind| format!("\n{}", ind.repeat(inner)));
    if let Some(nl) = &newline_indent {
        out.push_str(nl);
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&o.item_sep);
            if let Some(nl) = &newline_indent {
                out.push_str(nl);
            }
        }
        each(item, out, inner)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(level));
    }
    out.push(close);
    Ok(())
}

// ------------------------------------------------------------- strftime_now

/// HF's `strftime_now(format)`, on the UTC clock, for the common directives.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let tod = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + if leap && month > 2 { 1 } else { 0 };
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match d {
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'm' => write!(out, "{month:02}"),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:2}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'B' => write!(out, "{}", MONTHS[(month - 1) as usize]),
            'b' | 'h' => write!(out, "{}", &MONTHS[(month - 1) as usize][..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'j' => write!(out, "{yday:03}"),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

// ------------------------------------------------------ {% generation %} tags

/// transformers' `{% generation %}…{% endgeneration %}` (assistant-mask
/// tracking) is not jinja2 core; it renders its body unchanged. Turn the tags
/// into `{% if true %}`/`{% endif %}` so the whitespace control stays the same.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open_ctl, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, close_ctl) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], c.to_string()),
            _ => (body, String::new()),
        };
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{open_ctl} if true {close_ctl}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{open_ctl} endif {close_ctl}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e300, "1e+300"),
            (123.456, "123.456"),
        ] {
            assert_eq!(py_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn strftime_known_date() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %b %j %I%p %%", t),
            "2024-02-29 13:05:09 Thu Feb 060 01PM %"
        );
        assert_eq!(strftime("%d %B %Y, %A", 0), "01 January 1970, Thursday");
    }

    #[test]
    fn generation_tags() {
        assert_eq!(
            strip_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}"
        );
    }
}
