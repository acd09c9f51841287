//! HF's `tojson` filter: Python's `json.dumps`, not minijinja's HTML-safe
//! serializer. Chat templates print tool schemas and tool-call arguments with
//! it, so its spacing, escaping, key order and number formatting have to match
//! Python's byte for byte for the prompt to be the one the model was trained on.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

use super::pycompat::{map_pairs, py_float_repr, py_str};

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` (the same positional order), not minijinja's HTML-safe one.
pub(super) fn tojson(
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
