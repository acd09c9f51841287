//! Incremental parser for Qwen3.5/3.6 output: reasoning, answer content and tool calls.
//!
//! The parser is fed decoded text in arbitrary pieces (split anywhere, even inside a tag) and
//! returns [`Event`]s as soon as they are certain. The result never depends on how the text was
//! split: the merged events of any chunking equal those of [`parse_all`] on the whole text.
//!
//! # Format (chat template's generation prompt, MODEL.md section 6)
//! Thinking on: the prompt ends with `<think>\n`, so the output is
//! `reasoning\n</think>\n\nanswer`. Thinking off: the prompt ends with `<think>\n\n</think>\n\n`
//! and the output is the answer only. Tool calls sit in the answer:
//! `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>`.
//!
//! # Rules (whitespace = Unicode whitespace, as `str::trim`)
//! 1. Start: leading whitespace of the output is dropped; a `<think>` right there is dropped
//!    too and switches to reasoning, even when the prompt had thinking off.
//! 2. Reasoning is everything up to the first `</think>`, trimmed at both ends. While streaming,
//!    trailing whitespace of reasoning is held back until non-whitespace reasoning follows
//!    (then it is emitted) or `</think>` comes (then it is dropped). A stream that ends inside
//!    reasoning yields all of it as reasoning (trimmed). `<think>`/`<tool_call>` text inside
//!    reasoning is reasoning, with one exception (as vLLM's `qwen3` reasoning parser, because
//!    Qwen3.5 may open a tool call without closing `</think>`): when tools are given, a
//!    `<tool_call>` followed (after whitespace) by `<function=` ends reasoning implicitly and
//!    starts the answer there.
//! 3. Content: the answer's leading whitespace (after `</think>`, or at the start of the output
//!    when thinking is off) is dropped, and so is the whitespace right after each complete
//!    `</tool_call>`. Everything else is kept verbatim, including text and whitespace before a
//!    `<tool_call>`, text after the calls, trailing whitespace, and a second `</think>`.
//! 4. Tool calls are recognised only when tools are given (`Some`, even empty), with this
//!    grammar (ws = any whitespace, possibly none):
//!    `<tool_call>` ws `<function=NAME>` (ws `<parameter=KEY>` VALUE `</parameter>`)* ws
//!    `</function>` ws `</tool_call>`. NAME and KEY are non-empty, at most 256 bytes, without
//!    whitespace, `<` or `>`. VALUE is the raw text up to the first `</parameter>` (it may span
//!    lines and contain `<`, look-alike tags, even `<parameter=`), minus exactly one leading and
//!    one trailing `\n`. A repeated KEY keeps the last value. Anything else (unknown text
//!    between the parts, an empty name, a missing `</function>`, a block still open at the end
//!    of the stream) is malformed: the `<tool_call>` tag itself is emitted as Content and
//!    parsing resumes right after it, so malformed text comes back verbatim and a later valid
//!    call is still found. A call to a function that is not among `tools` is still returned as
//!    a [`ToolCall`] (its values stay strings); the API layer decides what to do with it.
//! 5. Values are converted per `parameters.properties[KEY]` of the matching tool; see
//!    [`convert_value`].
//!
//! Held back while streaming: only a suffix that could start a tag we look for (`</think>`,
//! and `<tool_call>` when tools are given), the trailing whitespace of reasoning, and a tool
//! call block until it is complete or known to be malformed.

use serde_json::{Map, Number, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TC_OPEN: &str = "<tool_call>";
const TC_CLOSE: &str = "</tool_call>";
const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
const MAX_NAME: usize = 256;

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// Compact JSON object string, as OpenAI's `function.arguments`.
    pub fn arguments_json(&self) -> String {
        serde_json::to_string(&self.arguments).unwrap_or_else(|_| "{}".to_string())
    }
}

/// A piece of parsed output. Text events are never empty.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Start,
    Reasoning,
    Answer,
    ToolCall,
}

/// Streaming parser; see the module docs for the rules.
pub struct OutputParser {
    in_reasoning: bool,
    tools: Option<Vec<Value>>,
    mode: Mode,
    /// Drop leading whitespace of the next text in the current mode.
    strip: bool,
    /// In a tool call, waiting for `</parameter>`: nothing changes until a `>` arrives.
    wait_gt: bool,
    buf: String,
    out: Vec<Event>,
}

enum Block {
    /// A complete call and the byte length of the block.
    Complete(ToolCall, usize),
    /// A valid prefix; `true` when waiting inside a parameter value.
    Incomplete(bool),
    Invalid,
}

impl OutputParser {
    /// `in_reasoning`: the prompt ended inside `<think>` (thinking on). `tools`: OpenAI tool
    /// objects `[{type:"function", function:{name, parameters: JSON schema}}]`, used to convert
    /// parameter values to the schema's types; `None` = no tools, so `<tool_call>` text stays
    /// plain content.
    pub fn new(in_reasoning: bool, tools: Option<&[Value]>) -> OutputParser {
        OutputParser {
            in_reasoning,
            tools: tools.map(|t| t.to_vec()),
            mode: Mode::Start,
            strip: true,
            wait_gt: false,
            buf: String::new(),
            out: Vec::new(),
        }
    }

    /// Feed the next piece of decoded text; returns the events that are now certain
    /// (adjacent text events of the same kind merged).
    pub fn push(&mut self, text: &str) -> Vec<Event> {
        self.buf.push_str(text);
        if !self.wait_gt || text.contains('>') {
            while self.step(false) {}
        }
        std::mem::take(&mut self.out)
    }

    /// End of generation: flush everything held back (an unfinished tool call comes back as
    /// plain Content text, verbatim). The parser is then empty; pushing more text continues
    /// in the mode it was in.
    pub fn finish(&mut self) -> Vec<Event> {
        while self.step(true) {}
        debug_assert!(self.buf.is_empty());
        self.wait_gt = false;
        std::mem::take(&mut self.out)
    }

    /// One state-machine step; returns true if it changed mode (so another step may progress).
    fn step(&mut self, fin: bool) -> bool {
        match self.mode {
            Mode::Start => self.step_start(fin),
            Mode::Reasoning => self.step_reasoning(fin),
            Mode::Answer => self.step_answer(fin),
            Mode::ToolCall => self.step_tool_call(fin),
        }
    }

    fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }

    /// Drops leading whitespace while `strip` is set; true if the buffer is then empty.
    fn strip_leading(&mut self) -> bool {
        if self.strip {
            let n = lead_ws(&self.buf);
            self.consume(n);
            if self.buf.is_empty() {
                return true;
            }
            self.strip = false;
        }
        self.buf.is_empty()
    }

    fn set_mode(&mut self, mode: Mode, strip: bool) {
        self.mode = mode;
        self.strip = strip;
        self.wait_gt = false;
    }

    fn step_start(&mut self, fin: bool) -> bool {
        let ws = lead_ws(&self.buf);
        let rest = &self.buf[ws..];
        if rest.starts_with(THINK_OPEN) {
            self.consume(ws + THINK_OPEN.len());
            self.set_mode(Mode::Reasoning, true);
            return true;
        }
        if !fin && THINK_OPEN.starts_with(rest) {
            return false; // whitespace and maybe a prefix of `<think>`: wait
        }
        let mode = if self.in_reasoning {
            Mode::Reasoning
        } else {
            Mode::Answer
        };
        self.set_mode(mode, true);
        true
    }

    fn step_reasoning(&mut self, fin: bool) -> bool {
        if self.strip_leading() {
            return false;
        }
        let tools = self.tools.is_some();
        let mut from = 0;
        loop {
            let close = find_from(&self.buf, THINK_CLOSE, from);
            let tc = if tools {
                find_from(&self.buf, TC_OPEN, from)
            } else {
                None
            };
            let tc = tc.filter(|&t| close.is_none_or(|c| t < c));
            match (close, tc) {
                (Some(c), None) => {
                    push_text(&mut self.out, true, self.buf[..c].trim_end());
                    self.consume(c + THINK_CLOSE.len());
                    self.set_mode(Mode::Answer, true);
                    return true;
                }
                (_, Some(t)) => {
                    let after = self.buf[t + TC_OPEN.len()..].trim_start();
                    if after.starts_with(FN_OPEN) {
                        // Implicit end of reasoning: the answer starts at `<tool_call>`.
                        push_text(&mut self.out, true, self.buf[..t].trim_end());
                        self.consume(t);
                        self.set_mode(Mode::Answer, true);
                        return true;
                    }
                    if !fin && FN_OPEN.starts_with(after) {
                        let e = self.buf[..t].trim_end().len();
                        push_text(&mut self.out, true, &self.buf[..e]);
                        self.consume(e);
                        return false;
                    }
                    from = t + TC_OPEN.len(); // just text; look further
                }
                (None, None) => {
                    let hold = if fin {
                        self.buf.len()
                    } else if tools {
                        partial_tag_start(&self.buf, &[THINK_CLOSE, TC_OPEN])
                    } else {
                        partial_tag_start(&self.buf, &[THINK_CLOSE])
                    };
                    let e = self.buf[..hold].trim_end().len();
                    push_text(&mut self.out, true, &self.buf[..e]);
                    self.consume(if fin { self.buf.len() } else { e });
                    return false;
                }
            }
        }
    }

    fn step_answer(&mut self, fin: bool) -> bool {
        if self.strip_leading() {
            return false;
        }
        if self.tools.is_none() {
            push_text(&mut self.out, false, &self.buf);
            self.buf.clear();
            return false;
        }
        if let Some(t) = self.buf.find(TC_OPEN) {
            push_text(&mut self.out, false, &self.buf[..t]);
            self.consume(t);
            self.set_mode(Mode::ToolCall, false);
            return true;
        }
        let hold = if fin {
            self.buf.len()
        } else {
            partial_tag_start(&self.buf, &[TC_OPEN])
        };
        push_text(&mut self.out, false, &self.buf[..hold]);
        self.consume(hold);
        false
    }

    fn step_tool_call(&mut self, fin: bool) -> bool {
        match parse_block(&self.buf, self.tools.as_deref()) {
            Block::Complete(call, n) => {
                self.out.push(Event::ToolCall(call));
                self.consume(n);
                self.set_mode(Mode::Answer, true);
                true
            }
            Block::Incomplete(in_value) if !fin => {
                self.wait_gt = in_value;
                false
            }
            _ => {
                push_text(&mut self.out, false, TC_OPEN);
                self.consume(TC_OPEN.len());
                self.set_mode(Mode::Answer, false);
                true
            }
        }
    }
}

/// Convenience: parse a whole output at once (push + finish); returns
/// (reasoning, content, tool calls).
pub fn parse_all(
    text: &str,
    in_reasoning: bool,
    tools: Option<&[Value]>,
) -> (String, String, Vec<ToolCall>) {
    let mut p = OutputParser::new(in_reasoning, tools);
    let mut events = p.push(text);
    events.extend(p.finish());
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    for e in events {
        match e {
            Event::Reasoning(s) => reasoning.push_str(&s),
            Event::Content(s) => content.push_str(&s),
            Event::ToolCall(c) => calls.push(c),
        }
    }
    (reasoning, content, calls)
}

/// Merges adjacent text events of the same kind and drops empty ones.
pub fn merge_events(events: impl IntoIterator<Item = Event>) -> Vec<Event> {
    let mut out = Vec::new();
    for e in events {
        match e {
            Event::Reasoning(s) => push_text(&mut out, true, &s),
            Event::Content(s) => push_text(&mut out, false, &s),
            call => out.push(call),
        }
    }
    out
}

fn push_text(out: &mut Vec<Event>, reasoning: bool, s: &str) {
    if s.is_empty() {
        return;
    }
    match (out.last_mut(), reasoning) {
        (Some(Event::Reasoning(r)), true) => r.push_str(s),
        (Some(Event::Content(c)), false) => c.push_str(s),
        (_, true) => out.push(Event::Reasoning(s.to_string())),
        (_, false) => out.push(Event::Content(s.to_string())),
    }
}

fn lead_ws(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

fn find_from(s: &str, pat: &str, from: usize) -> Option<usize> {
    s[from..].find(pat).map(|i| i + from)
}

/// Start of the longest suffix of `s` that is a proper prefix of one of `tags` (else `s.len()`).
fn partial_tag_start(s: &str, tags: &[&str]) -> usize {
    let b = s.as_bytes();
    let mut best = b.len();
    for tag in tags {
        let t = tag.as_bytes();
        for k in (1..t.len().min(b.len() + 1)).rev() {
            if b[b.len() - k..] == t[..k] {
                best = best.min(b.len() - k); // tags are ASCII starting with '<': a char boundary
                break;
            }
        }
    }
    best
}

/// `s[p..]` starts with `lit` → position after it; a prefix of it → Incomplete; else Invalid.
fn expect(s: &str, p: usize, lit: &str) -> Result<usize, Block> {
    let r = &s[p..];
    if r.starts_with(lit) {
        Ok(p + lit.len())
    } else if lit.starts_with(r) {
        Err(Block::Incomplete(false))
    } else {
        Err(Block::Invalid)
    }
}

/// A function or parameter name up to `>`; returns it and the position after `>`.
fn read_name(s: &str, p: usize) -> Result<(String, usize), Block> {
    for (i, c) in s[p..].char_indices() {
        if c == '>' {
            return if i == 0 {
                Err(Block::Invalid)
            } else {
                Ok((s[p..p + i].to_string(), p + i + 1))
            };
        }
        if c == '<' || c.is_whitespace() || i >= MAX_NAME {
            return Err(Block::Invalid);
        }
    }
    Err(Block::Incomplete(false))
}

/// Parses a tool call block at the start of `s` (which starts with `<tool_call>`).
fn parse_block(s: &str, tools: Option<&[Value]>) -> Block {
    match parse_block_inner(s, tools) {
        Ok(b) | Err(b) => b,
    }
}

fn parse_block_inner(s: &str, tools: Option<&[Value]>) -> Result<Block, Block> {
    let mut p = TC_OPEN.len();
    p += lead_ws(&s[p..]);
    p = expect(s, p, FN_OPEN)?;
    let (name, np) = read_name(s, p)?;
    p = np;
    let props = schema_properties(tools, &name);
    let mut arguments = Map::new();
    loop {
        p += lead_ws(&s[p..]);
        let r = &s[p..];
        if r.starts_with(PARAM_OPEN) {
            let (key, np) = read_name(s, p + PARAM_OPEN.len())?;
            p = np;
            let Some(end) = s[p..].find(PARAM_CLOSE) else {
                return Ok(Block::Incomplete(true));
            };
            let raw = &s[p..p + end];
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let value = convert_value(raw, props.and_then(|m| m.get(&key)));
            arguments.insert(key, value);
            p += end + PARAM_CLOSE.len();
        } else if r.starts_with(FN_CLOSE) {
            p += FN_CLOSE.len();
            break;
        } else if PARAM_OPEN.starts_with(r) || FN_CLOSE.starts_with(r) {
            return Ok(Block::Incomplete(false));
        } else {
            return Ok(Block::Invalid);
        }
    }
    p += lead_ws(&s[p..]);
    p = expect(s, p, TC_CLOSE)?;
    Ok(Block::Complete(ToolCall { name, arguments }, p))
}

/// `parameters.properties` of the first tool named `name` that has them.
fn schema_properties<'a>(tools: Option<&'a [Value]>, name: &str) -> Option<&'a Map<String, Value>> {
    tools?.iter().find_map(|t| {
        let f = t.get("function").unwrap_or(t);
        if f.get("name")?.as_str()? != name {
            return None;
        }
        f.get("parameters")?.get("properties")?.as_object()
    })
}

/// Converts a raw parameter value using its property schema.
///
/// Types come from `type` (a string or a list), else from the members of `anyOf`/`oneOf`/
/// `allOf`, else from the kinds of the `enum`/`const` values; aliases are normalised
/// (`int*`/`long`/`short`/`uint*` → integer, `num*`/`float*`/`double` → number, `bool*` →
/// boolean, `dict*` → object, `list*`/`arr*` → array). No schema or no known type → the raw
/// string (as vLLM's `qwen3_coder`). Otherwise, on the trimmed text:
/// - `null` allowed and the text is `null` → null;
/// - then, for each allowed type in the order integer, number, boolean, object, array: integer
///   → an i64/u64 if it parses; number → an integer if the text is one, else a finite f64;
///   boolean → `true`/`false` (case-insensitive); object/array → JSON of that kind, else a
///   lenient Python-style literal (quotes `'`/`"`, `True`/`False`/`None`, tuples, trailing
///   commas) of that kind;
/// - nothing fits: a non-string type and the text `null` → null; else the raw string.
pub fn convert_value(raw: &str, schema: Option<&Value>) -> Value {
    let mut types = Vec::new();
    if let Some(s) = schema {
        collect_types(s, &mut types, 0);
    }
    if types.is_empty() {
        return Value::String(raw.to_string());
    }
    let has = |x: &str| types.iter().any(|t| t == x);
    let t = raw.trim();
    if has("null") && t == "null" {
        return Value::Null;
    }
    for ty in ["integer", "number", "boolean", "object", "array"] {
        if !has(ty) {
            continue;
        }
        let v = match ty {
            "integer" => parse_int(t),
            "number" => parse_number(t),
            "boolean" => parse_bool(t),
            kind => parse_structured(t, kind == "object"),
        };
        if let Some(v) = v {
            return v;
        }
    }
    if !has("string") && t == "null" {
        return Value::Null;
    }
    Value::String(raw.to_string())
}

fn collect_types(s: &Value, out: &mut Vec<String>, depth: usize) {
    if depth > 8 {
        return;
    }
    match s.get("type") {
        Some(Value::String(t)) => out.push(normalize_type(t)),
        Some(Value::Array(a)) => {
            out.extend(a.iter().filter_map(|t| t.as_str()).map(normalize_type))
        }
        _ => {}
    }
    if !out.is_empty() {
        return;
    }
    for k in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(a)) = s.get(k) {
            for sub in a {
                collect_types(sub, out, depth + 1);
            }
        }
    }
    if !out.is_empty() {
        return;
    }
    let consts = s
        .get("enum")
        .and_then(|e| e.as_array())
        .map(|a| a.iter().collect::<Vec<_>>());
    for v in consts.unwrap_or_else(|| s.get("const").into_iter().collect()) {
        out.push(
            match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_f64() => "number",
                Value::Number(_) => "integer",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            }
            .to_string(),
        );
    }
}

fn normalize_type(t: &str) -> String {
    let t = t.trim().to_ascii_lowercase();
    let n = if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| t.starts_with(p))
    {
        "integer"
    } else if ["num", "float", "double", "decimal"]
        .iter()
        .any(|p| t.starts_with(p))
    {
        "number"
    } else if t.starts_with("bool") {
        "boolean"
    } else if t.starts_with("dict") || t == "object" {
        "object"
    } else if t.starts_with("list") || t.starts_with("arr") {
        "array"
    } else if ["str", "text", "char", "varchar", "enum"]
        .iter()
        .any(|p| t.starts_with(p))
    {
        "string"
    } else {
        return t;
    };
    n.to_string()
}

fn parse_int(t: &str) -> Option<Value> {
    t.parse::<i64>()
        .map(Value::from)
        .ok()
        .or_else(|| t.parse::<u64>().map(Value::from).ok())
}

fn parse_number(t: &str) -> Option<Value> {
    parse_int(t).or_else(|| {
        let first = t.trim_start_matches(['+', '-']).chars().next()?;
        if !(first.is_ascii_digit() || first == '.') {
            return None; // reject inf / nan spellings
        }
        t.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
    })
}

fn parse_bool(t: &str) -> Option<Value> {
    if t.eq_ignore_ascii_case("true") {
        Some(Value::Bool(true))
    } else if t.eq_ignore_ascii_case("false") {
        Some(Value::Bool(false))
    } else {
        None
    }
}

fn parse_structured(t: &str, object: bool) -> Option<Value> {
    let kind_ok = |v: &Value| if object { v.is_object() } else { v.is_array() };
    if let Ok(v) = serde_json::from_str::<Value>(t) {
        if kind_ok(&v) {
            return Some(v);
        }
    }
    let mut lit = Literal {
        s: t.as_bytes(),
        i: 0,
    };
    let v = lit.value(0)?;
    lit.ws();
    (lit.i == lit.s.len() && kind_ok(&v)).then_some(v)
}

/// A lenient Python-literal / JSON5-ish reader, used when JSON parsing fails.
struct Literal<'a> {
    s: &'a [u8],
    i: usize,
}

impl Literal<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 64 {
            return None;
        }
        self.ws();
        match self.peek()? {
            b'{' => {
                self.i += 1;
                let mut m = Map::new();
                loop {
                    self.ws();
                    if self.peek()? == b'}' {
                        self.i += 1;
                        return Some(Value::Object(m));
                    }
                    let k = match self.value(depth + 1)? {
                        Value::String(s) => s,
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        _ => return None,
                    };
                    self.ws();
                    if self.peek()? != b':' {
                        return None;
                    }
                    self.i += 1;
                    let v = self.value(depth + 1)?;
                    m.insert(k, v);
                    self.ws();
                    match self.peek()? {
                        b',' => self.i += 1,
                        b'}' => {}
                        _ => return None,
                    }
                }
            }
            open @ (b'[' | b'(') => {
                let close = if open == b'[' { b']' } else { b')' };
                self.i += 1;
                let mut a = Vec::new();
                loop {
                    self.ws();
                    if self.peek()? == close {
                        self.i += 1;
                        return Some(Value::Array(a));
                    }
                    a.push(self.value(depth + 1)?);
                    self.ws();
                    match self.peek()? {
                        b',' => self.i += 1,
                        c if c == close => {}
                        _ => return None,
                    }
                }
            }
            q @ (b'"' | b'\'') => self.string(q),
            _ => {
                let st = self.i;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || b"+-._".contains(&c))
                {
                    self.i += 1;
                }
                match std::str::from_utf8(&self.s[st..self.i]).ok()? {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    w => parse_number(w),
                }
            }
        }
    }

    fn string(&mut self, quote: u8) -> Option<Value> {
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = self.peek()?;
            self.i += 1;
            if c == quote {
                return String::from_utf8(out).ok().map(Value::String);
            }
            if c != b'\\' {
                out.push(c);
                continue;
            }
            let e = self.peek()?;
            self.i += 1;
            match e {
                b'n' => out.push(b'\n'),
                b't' => out.push(b'\t'),
                b'r' => out.push(b'\r'),
                b'b' => out.push(8),
                b'f' => out.push(12),
                b'0' => out.push(0),
                b'\n' => {} // line continuation
                b'u' | b'x' => {
                    let n = if e == b'u' { 4 } else { 2 };
                    let hex = std::str::from_utf8(self.s.get(self.i..self.i + n)?).ok()?;
                    let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                    self.i += n;
                    out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                }
                other => out.push(other), // \\ \' \" \/ and unknown escapes keep the character
            }
        }
    }
}
