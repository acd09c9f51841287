//! The OpenAI request bodies, read from JSON by hand so that every wrong type
//! or value gets a 400 naming the parameter. Unknown fields are ignored.

use lily_engine::sampling::{SamplingOverrides, SamplingParams};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Typed access to the fields of a JSON object; `null` counts as absent.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<'a> Fields<'a> {
    pub fn new(v: &'a Value, prefix: &str) -> Result<Fields<'a>, ApiError> {
        match v.as_object() {
            Some(map) => Ok(Fields {
                map,
                prefix: prefix.to_string(),
            }),
            None if prefix.is_empty() => Err(ApiError::bad_request(format!(
                "The request body must be a JSON object, got {}",
                kind(v)
            ))),
            None => Err(ApiError::invalid(
                prefix,
                format!("'{prefix}' must be an object, got {}", kind(v)),
            )),
        }
    }

    fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, want: &str, v: &Value) -> ApiError {
        let n = self.name(key);
        ApiError::invalid(n.clone(), format!("'{n}' must be {want}, got {}", kind(v)))
            .code("invalid_type")
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "a boolean", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    pub fn f32(&self, key: &str) -> Result<Option<f32>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if x.is_finite() {
                    Ok(Some(x))
                } else {
                    let n = self.name(key);
                    Err(ApiError::invalid(
                        n.clone(),
                        format!("'{n}' is out of range"),
                    ))
                }
            }
            Some(v) => Err(self.wrong(key, "a number", v)),
        }
    }

    pub fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        let too_large = || {
            let n = self.name(key);
            ApiError::invalid(n.clone(), format!("'{n}' is out of range"))
        };
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                if let Some(i) = n.as_i64() {
                    return Ok(Some(i));
                }
                if n.is_u64() {
                    return Err(too_large());
                }
                match n.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                    Some(f) if f.fract() == 0.0 => Err(too_large()),
                    _ => Err(self.wrong(key, "an integer", &Value::Number(n.clone()))),
                }
            }
            Some(v) => Err(self.wrong(key, "an integer", v)),
        }
    }

    /// An integer in [lo, hi].
    pub fn int_in(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.i64(key)? {
            Some(i) if i < lo || i > hi => {
                let n = self.name(key);
                let range = if hi == i64::MAX {
                    format!(">= {lo}")
                } else {
                    format!("between {lo} and {hi}")
                };
                Err(ApiError::invalid(
                    n.clone(),
                    format!("'{n}' must be {range}, got {i}"),
                ))
            }
            x => Ok(x),
        }
    }

    pub fn f32_in(
        &self,
        key: &str,
        lo: f32,
        hi: f32,
        lo_open: bool,
    ) -> Result<Option<f32>, ApiError> {
        match self.f32(key)? {
            Some(x) if x > hi || x < lo || (lo_open && x == lo) => {
                let n = self.name(key);
                let l = if lo_open { "(" } else { "[" };
                Err(ApiError::invalid(
                    n.clone(),
                    format!("'{n}' must be in {l}{lo}, {hi}], got {x}"),
                ))
            }
            x => Ok(x),
        }
    }

    pub fn obj(&self, key: &str) -> Result<Option<Fields<'a>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Object(_)) => Fields::new(v, &self.name(key)).map(Some),
            Some(v) => Err(self.wrong(key, "an object", v)),
        }
    }

    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(key, "an array", v)),
        }
    }
}

/// Fields shared by chat and text completions.
#[derive(Clone, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// (token id, bias added to its logit)
    pub logit_bias: Vec<(u32, f32)>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Test hooks (only honoured when the server runs with `--test-hooks`).
    pub test_script: Option<String>,
    pub test_delay_ms: u64,
}

impl Common {
    pub fn parse(f: &Fields, max_tokens_keys: &[&str]) -> Result<Common, ApiError> {
        let mut c = Common {
            model: f.str("model")?.map(str::to_string),
            ..Default::default()
        };
        if let Some(n) = f.int_in("n", 1, i64::MAX)? {
            if n != 1 {
                return Err(ApiError::invalid(
                    "n",
                    format!("'n' must be 1: this server returns one choice per request, got {n}"),
                )
                .code("unsupported_value"));
            }
        }
        for k in max_tokens_keys {
            if let Some(n) = f.int_in(k, 1, i64::MAX)? {
                c.max_tokens = Some(n as usize);
            }
        }
        c.temperature = f.f32_in("temperature", 0.0, 100.0, false)?;
        c.top_p = f.f32_in("top_p", 0.0, 1.0, true)?;
        c.top_k = match f.i64("top_k")? {
            None => None,
            Some(-1) | Some(0) => Some(0),
            Some(k) if k > 0 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("'top_k' must be -1 (off), 0 (off) or positive, got {k}"),
                ))
            }
        };
        c.min_p = f.f32_in("min_p", 0.0, 1.0, false)?;
        c.presence_penalty = f.f32_in("presence_penalty", -2.0, 2.0, false)?;
        c.frequency_penalty = f.f32_in("frequency_penalty", -2.0, 2.0, false)?;
        c.repetition_penalty = f.f32_in("repetition_penalty", 0.0, 100.0, true)?;
        c.seed = match f.get("seed") {
            Some(Value::Number(n)) if n.is_u64() => n.as_u64(),
            _ => f.i64("seed")?.map(|s| s as u64),
        };
        if let Some(b) = f.obj("logit_bias")? {
            for k in b.map.keys() {
                let p = format!("logit_bias.{k}");
                let id = k.trim().parse::<u32>().map_err(|_| {
                    ApiError::invalid(
                        p.clone(),
                        format!("'logit_bias' keys must be token ids, got {k:?}"),
                    )
                })?;
                let x = b.f32_in(k, -100.0, 100.0, false)?.ok_or_else(|| {
                    ApiError::invalid(p.clone(), format!("'{p}' must be a number"))
                })?;
                c.logit_bias.push((id, x));
            }
        }
        c.stop = match f.get("stop") {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => {
                if a.len() > 64 {
                    return Err(ApiError::invalid(
                        "stop",
                        "'stop' may hold at most 64 strings",
                    ));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_str().map(str::to_string).ok_or_else(|| {
                            ApiError::invalid(
                                format!("stop[{i}]"),
                                format!("'stop[{i}]' must be a string, got {}", kind(v)),
                            )
                            .code("invalid_type")
                        })
                    })
                    .collect::<Result<_, _>>()?
            }
            Some(v) => return Err(f.wrong("stop", "a string or an array of strings", v)),
        };
        if let Some(i) = c.stop.iter().position(|s| s.len() > 1024) {
            return Err(ApiError::invalid(
                "stop",
                format!("stop string {i} is longer than 1024 bytes"),
            ));
        }
        c.stream = f.bool("stream")?.unwrap_or(false);
        if let Some(so) = f.obj("stream_options")? {
            c.include_usage = so.bool("include_usage")?.unwrap_or(false);
        }
        c.test_script = f.str("lily_test_script")?.map(str::to_string);
        c.test_delay_ms = f.int_in("lily_test_delay_ms", 0, 1000)?.unwrap_or(0) as u64;
        Ok(c)
    }

    /// The server's defaults (generation_config.json) overridden by the request.
    pub fn sampling(&self, defaults: &SamplingParams) -> Result<SamplingParams, ApiError> {
        SamplingOverrides {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
        .apply(defaults)
        .map(|mut p| {
            p.logit_bias = self.logit_bias.clone();
            p
        })
        .map_err(|e| ApiError::bad_request(e.to_string()))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: Common,
    /// Messages as the chat template takes them.
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: ToolChoice,
    pub enable_thinking: Option<bool>,
    pub preserve_thinking: bool,
    /// `Some(n)`: log-probabilities with n alternatives.
    pub logprobs: Option<usize>,
}

pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let f = Fields::new(body, "")?;
    let common = Common::parse(&f, &["max_tokens", "max_completion_tokens"])?;
    let messages = match f.array("messages")? {
        None => {
            return Err(ApiError::invalid("messages", "'messages' is required")
                .code("missing_required_parameter"))
        }
        Some(m) if m.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "'messages' must not be empty",
            ))
        }
        Some(m) => m
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let tools = match f.array("tools")? {
        None => None,
        Some(t) => Some(
            t.iter()
                .enumerate()
                .map(|(i, t)| tool(i, t))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let tool_choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, got {other:?}"),
                ))
            }
        },
        Some(v @ Value::Object(_)) => {
            let o = Fields::new(v, "tool_choice")?;
            if let Some(t) = o.str("type")? {
                if t != "function" {
                    return Err(ApiError::invalid("tool_choice.type", format!("'tool_choice.type' must be \"function\", got {t:?}")));
                }
            }
            // {"type": "function", "function": {"name"}}, or the flat {"type": "function", "name"}
            let nested = o.obj("function")?.map(|fun| fun.str("name")).transpose()?.flatten();
            let name = match nested {
                Some(n) => n,
                None => o
                    .str("name")?
                    .ok_or_else(|| ApiError::invalid("tool_choice.function.name", "'tool_choice.function.name' is required"))?,
            };
            ToolChoice::Named(name.to_string())
        }
        Some(v) => return Err(f.wrong("tool_choice", "a string or an object", v)),
    };
    match (&tool_choice, &tools) {
        (ToolChoice::Required | ToolChoice::Named(_), None) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' requires 'tools'",
            ));
        }
        (ToolChoice::Named(n), Some(t))
            if !t.iter().any(|t| t["function"]["name"].as_str() == Some(n)) =>
        {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("'tool_choice' names the function {n:?}, which is not among 'tools'"),
            ));
        }
        _ => {}
    }
    let mut enable_thinking = f.bool("enable_thinking")?;
    let mut preserve_thinking = false;
    if let Some(k) = f.obj("chat_template_kwargs")? {
        if let Some(b) = k.bool("enable_thinking")? {
            enable_thinking = Some(b);
        }
        preserve_thinking = k.bool("preserve_thinking")?.unwrap_or(false);
    }
    let top = f.int_in("top_logprobs", 0, 20)?;
    let logprobs = match (f.bool("logprobs")?.unwrap_or(false), top) {
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs': true",
            ));
        }
        _ => None,
    };
    if let Some(rf) = f.obj("response_format")? {
        match rf.str("type")? {
            None | Some("text") => {}
            Some(t) => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!("response_format {t:?} is not supported (only \"text\")"),
                )
                .code("unsupported_value"))
            }
        }
    }
    Ok(ChatRequest {
        common,
        messages,
        tools,
        tool_choice,
        enable_thinking,
        preserve_thinking,
        logprobs,
    })
}

/// One message, checked and put in the form the chat template reads.
fn message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let p = format!("messages[{i}]");
    let f = Fields::new(m, &p)?;
    let role = f
        .str("role")?
        .ok_or_else(|| ApiError::invalid(format!("{p}.role"), format!("'{p}.role' is required")))?;
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        other => {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!(
                "'{p}.role' must be one of system, developer, user, assistant, tool; got {other:?}"
            ),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    let content = match f.get("content") {
        None => Value::Null,
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let pp = format!("{p}.content[{j}]");
                let pf = Fields::new(part, &pp)?;
                match (pf.str("type")?, pf.get("text")) {
                    (Some("text") | None, Some(Value::String(t))) => {
                        text.push(Value::String(t.clone()))
                    }
                    (Some("text") | None, other) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.text"),
                            format!(
                                "'{pp}.text' must be a string, got {}",
                                other.map(kind).unwrap_or("nothing")
                            ),
                        ))
                    }
                    (Some(t), _) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("content parts of type {t:?} are not supported: only text"),
                        )
                        .code("unsupported_value"))
                    }
                }
            }
            Value::Array(
                text.into_iter()
                    .map(|t| serde_json::json!({"type": "text", "text": t}))
                    .collect(),
            )
        }
        Some(v) => return Err(f.wrong("content", "a string or an array of content parts", v)),
    };
    out.insert("content".into(), content);
    if role == "assistant" {
        let reasoning = match f.str("reasoning_content")? {
            Some(r) => Some(r),
            None => f.str("reasoning")?,
        };
        if let Some(r) = reasoning {
            out.insert("reasoning_content".into(), r.into());
        }
        if let Some(calls) = f.array("tool_calls")? {
            let mut list = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let cp = format!("{p}.tool_calls[{j}]");
                let cf = Fields::new(c, &cp)?;
                let fun = cf.obj("function")?.ok_or_else(|| {
                    ApiError::invalid(
                        format!("{cp}.function"),
                        format!("'{cp}.function' is required"),
                    )
                })?;
                let name = fun.str("name")?.filter(|n| !n.is_empty()).ok_or_else(|| {
                    ApiError::invalid(
                        format!("{cp}.function.name"),
                        format!("'{cp}.function.name' is required"),
                    )
                })?;
                let args = match fun.get("arguments") {
                    None => Value::Object(Map::new()),
                    Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
                    Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{cp}.function.arguments"),
                                format!("'{cp}.function.arguments' must be a JSON object encoded as a string"),
                            ))
                        }
                    },
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(v) => return Err(fun.wrong("arguments", "a string", v)),
                };
                let mut call = Map::new();
                if let Some(id) = cf.str("id")? {
                    call.insert("id".into(), id.into());
                }
                call.insert("type".into(), "function".into());
                call.insert(
                    "function".into(),
                    serde_json::json!({"name": name, "arguments": args}),
                );
                list.push(Value::Object(call));
            }
            if !list.is_empty() {
                out.insert("tool_calls".into(), Value::Array(list));
            }
        }
    }
    if role == "tool" {
        if let Some(id) = f.str("tool_call_id")? {
            out.insert("tool_call_id".into(), id.into());
        }
    }
    if let Some(n) = f.str("name")? {
        out.insert("name".into(), n.into());
    }
    Ok(Value::Object(out))
}

fn tool(i: usize, t: &Value) -> Result<Value, ApiError> {
    let p = format!("tools[{i}]");
    let f = Fields::new(t, &p)?;
    if let Some(ty) = f.str("type")? {
        if ty != "function" {
            return Err(ApiError::invalid(
                format!("{p}.type"),
                format!("'{p}.type' must be \"function\", got {ty:?}"),
            )
            .code("unsupported_value"));
        }
    }
    let fun = f.obj("function")?.ok_or_else(|| {
        ApiError::invalid(
            format!("{p}.function"),
            format!("'{p}.function' is required"),
        )
    })?;
    let name = fun.str("name")?.unwrap_or("");
    if name.is_empty()
        || name.len() > 256
        || name
            .chars()
            .any(|c| c.is_whitespace() || c == '<' || c == '>')
    {
        return Err(ApiError::invalid(
            format!("{p}.function.name"),
            format!(
                "'{p}.function.name' must be a non-empty name without spaces or angle brackets"
            ),
        ));
    }
    fun.str("description")?;
    fun.obj("parameters")?;
    let mut t = t.clone();
    t["type"] = "function".into();
    Ok(t)
}

/// A completions prompt: text or token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
    pub echo: bool,
    pub logprobs: Option<usize>,
}

pub fn parse_completion(body: &Value) -> Result<CompletionRequest, ApiError> {
    let f = Fields::new(body, "")?;
    let common = Common::parse(&f, &["max_tokens"])?;
    let bad_prompt = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of token ids, or an array holding one of those",
        )
    };
    let ids = |a: &Vec<Value>| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(bad_prompt)
            })
            .collect()
    };
    let prompt = match f.get("prompt") {
        None => {
            return Err(ApiError::invalid("prompt", "'prompt' is required")
                .code("missing_required_parameter"))
        }
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid("prompt", "'prompt' must not be empty"))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Prompt::Tokens(ids(a)?),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(inner) if !inner.is_empty() => Prompt::Tokens(ids(inner)?),
            _ => return Err(bad_prompt()),
        },
        Some(Value::Array(a)) if a.iter().all(|v| v.is_string() || v.is_array()) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "'prompt' holds {} prompts: this server takes one per request",
                    a.len()
                ),
            )
            .code("unsupported_value"))
        }
        Some(_) => return Err(bad_prompt()),
    };
    if let Some(b) = f.int_in("best_of", 1, i64::MAX)? {
        if b != 1 {
            return Err(
                ApiError::invalid("best_of", "'best_of' must be 1").code("unsupported_value")
            );
        }
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(
            ApiError::invalid("suffix", "'suffix' is not supported").code("unsupported_value")
        );
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    let logprobs = f.int_in("logprobs", 0, 20)?.map(|n| n as usize);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid(
            "logprobs",
            "'logprobs' together with 'echo' is not supported",
        )
        .code("unsupported_value"));
    }
    Ok(CompletionRequest {
        common,
        prompt,
        echo,
        logprobs,
    })
}
