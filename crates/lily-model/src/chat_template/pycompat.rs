//! Python semantics for template values, where minijinja's defaults differ
//! from jinja2 running on Python objects (as in HF transformers): `str()` and
//! `repr()` of values (what the template prints: `True`, `None`, `1.0`, quoted
//! strings in lists), the string methods minijinja-contrib lacks or gets
//! differently (`.strip` family with Python's whitespace), jinja2's `|string`
//! and `|trim`, and the globals transformers adds (`raise_exception`,
//! `strftime_now`). Kept apart from the rendering so the compatibility rules can
//! be read, and tested, on their own; the `tojson` filter builds on the printing
//! helpers here.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

/// Key/value pairs of a mapping, in its order.
pub(super) fn map_pairs(v: &Value) -> Option<Vec<(Value, Value)>> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    Some(v.as_object()?.try_iter_pairs()?.collect())
}

/// transformers' `raise_exception(message)`: the template fails with `message`.
pub(super) fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = match message.as_str() {
        Some(s) => s.to_string(),
        None => py_str(&message),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's string methods, with Python's whitespace in the strip family;
/// everything else goes to minijinja-contrib's pycompat.
pub(super) fn unknown_method(
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
pub(super) fn trim_filter(value: &Value, chars: Option<String>) -> Value {
    let s = match value.as_str() {
        Some(s) => s.to_string(),
        None => py_str(value),
    };
    Value::from(py_strip(&s, chars.as_deref(), true, true))
}

/// jinja2's `string`: Python's `str()` (strings, including safe ones, unchanged).
pub(super) fn string_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        value.clone()
    } else {
        Value::from(py_str(value))
    }
}

// --------------------------------------------------------------- python str

/// Python's `repr(float)`.
pub(super) fn py_float_repr(f: f64) -> String {
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
pub(super) fn py_str(v: &Value) -> String {
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

// ------------------------------------------------------------- strftime_now

/// HF's `strftime_now(format)`, on the UTC clock, for the common directives.
pub(super) fn strftime_now(format: String) -> Result<Value, Error> {
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
}
