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
//! This module is the rendering side: loading and compiling the template, the
//! environment, turning messages and tools into template values, and the render
//! entry points. The Python/jinja2 behaviour those templates rely on lives in
//! `pycompat` (methods, filters, `str()`/`repr()`, the HF globals) and
//! `tojson` (HF's `json.dumps` filter).
//!
//! JSON objects keep the key order of the `serde_json::Value`s given to
//! [`ChatTemplate::render`]; with serde_json's default (sorted) maps that order is
//! alphabetical, so HF's insertion order (which `tojson` of the tool schemas and
//! the order of tool-call parameters depend on) needs serde_json's
//! `preserve_order` feature.

mod pycompat;
mod tojson;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context as _, Result};
use minijinja::value::{Enumerator, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error};

use pycompat::{py_str, raise_exception, strftime_now, string_filter, trim_filter, unknown_method};
use tojson::tojson;

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
        ChatTemplate::from_source(include_str!("../chat_template.jinja"))
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
    fn generation_tags() {
        assert_eq!(
            strip_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}"
        );
    }
}
