//! The Python compatibility layer of the chat-template environment: where minijinja differs
//! from jinja2 (and from the Python values transformers' templates expect), these helpers fill
//! the gap — Python `str()`/`repr()` printing, extra string methods, a `tojson` filter with
//! `json.dumps` semantics, jinja2's `is sequence`, and `strftime_now`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};

use super::raise_exception;

pub(super) fn install_python_compat(env: &mut Environment<'static>) {
    env.set_unknown_method_callback(python_method);
    env.set_formatter(
        |out: &mut Output, state: &mut State, value: &Value| match value.kind() {
            ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
                out.write_str(&py_str(value)).map_err(Error::from)
            }
            _ => minijinja::escape_formatter(out, state, value),
        },
    );
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| Value::from(py_str(value)));
    // jinja2: anything with __len__ and __getitem__ (str, list, dict) is a sequence.
    env.add_test("sequence", |value: &Value| {
        value.is_undefined()
            || matches!(
                value.kind(),
                ValueKind::Seq | ValueKind::String | ValueKind::Map
            )
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: &str| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        strftime(format, now)
    });
}

/// Python methods on values: the extras below, then minijinja-contrib's `pycompat`.
fn python_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let Some(s) = value.as_str()
        && let Some(result) = extra_string_method(s, method, args)?
    {
        return Ok(result);
    }
    if value.kind() == ValueKind::Seq && method == "index" {
        let (needle,): (&Value,) = minijinja::value::from_args(args)?;
        for (i, item) in value.try_iter()?.enumerate() {
            if &item == needle {
                return Ok(Value::from(i));
            }
        }
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("{} is not in list", py_repr(needle)),
        ));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn extra_string_method(
    s: &str,
    method: &str,
    args: &[Value],
) -> std::result::Result<Option<Value>, Error> {
    use minijinja::value::from_args;
    let padded =
        |width: usize, fill: Option<&str>, left: usize| -> std::result::Result<Value, Error> {
            let fill = fill.unwrap_or(" ");
            let mut fill_chars = fill.chars();
            let (Some(fill), None) = (fill_chars.next(), fill_chars.next()) else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "the fill character must be exactly one character long",
                ));
            };
            let len = s.chars().count();
            let total = width.saturating_sub(len);
            let left = left.min(total);
            let mut out = String::with_capacity(s.len() + total);
            out.extend(std::iter::repeat_n(fill, left));
            out.push_str(s);
            out.extend(std::iter::repeat_n(fill, total - left));
            Ok(Value::from(out))
        };
    Ok(Some(match method {
        "rsplit" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let parts: Vec<&str> = match (sep, maxsplit) {
                (Some(""), _) => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
                }
                (Some(sep), Some(n)) if n >= 0 => s.rsplitn(n as usize + 1, sep).collect(),
                (Some(sep), _) => s.rsplit(sep).collect(),
                (None, Some(n)) if n >= 0 => rsplit_whitespace(s, n as usize),
                (None, _) => s.split_whitespace().rev().collect(),
            };
            Value::from_iter(parts.into_iter().rev().map(Value::from))
        }
        "removeprefix" => {
            let (prefix,): (&str,) = from_args(args)?;
            Value::from(s.strip_prefix(prefix).unwrap_or(s))
        }
        "removesuffix" => {
            let (suffix,): (&str,) = from_args(args)?;
            Value::from(s.strip_suffix(suffix).unwrap_or(s))
        }
        "partition" | "rpartition" => {
            let (sep,): (&str,) = from_args(args)?;
            if sep.is_empty() {
                return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
            }
            let found = if method == "partition" {
                s.find(sep)
            } else {
                s.rfind(sep)
            };
            match found {
                Some(i) => Value::from(vec![
                    Value::from(&s[..i]),
                    Value::from(sep),
                    Value::from(&s[i + sep.len()..]),
                ]),
                None if method == "partition" => {
                    Value::from(vec![Value::from(s), Value::from(""), Value::from("")])
                }
                None => Value::from(vec![Value::from(""), Value::from(""), Value::from(s)]),
            }
        }
        "index" | "rindex" => {
            let (needle,): (&str,) = from_args(args)?;
            let found = if method == "index" {
                s.find(needle)
            } else {
                s.rfind(needle)
            };
            match found {
                Some(i) => Value::from(s[..i].chars().count()),
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "substring not found",
                    ));
                }
            }
        }
        "zfill" => {
            let (width,): (usize,) = from_args(args)?;
            let (sign, digits) = match s.chars().next() {
                Some(c @ ('+' | '-')) => (Some(c), &s[1..]),
                _ => (None, s),
            };
            let pad = width.saturating_sub(s.chars().count());
            let mut out = String::new();
            out.extend(sign);
            out.extend(std::iter::repeat_n('0', pad));
            out.push_str(digits);
            Value::from(out)
        }
        "ljust" | "rjust" | "center" => {
            let (width, fill): (usize, Option<&str>) = from_args(args)?;
            let total = width.saturating_sub(s.chars().count());
            let left = match method {
                "ljust" => 0,
                "rjust" => total,
                // CPython: left = pad/2 + (pad & width & 1)
                _ => total / 2 + (total & width & 1),
            };
            padded(width, fill, left)?
        }
        _ => return Ok(None),
    }))
}

fn rsplit_whitespace(s: &str, maxsplit: usize) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut rest = s.trim_end();
    while parts.len() < maxsplit {
        match rest.rfind(char::is_whitespace) {
            Some(i) => {
                let ws_len = rest[i..].chars().next().map_or(1, char::len_utf8);
                parts.push(&rest[i + ws_len..]);
                rest = rest[..i].trim_end();
            }
            None => break,
        }
    }
    if !rest.is_empty() {
        parts.push(rest);
    }
    parts
}

/// Python `str(value)`: strings as-is, `None`/`True`/`False`, floats like `repr(float)`, and
/// lists/dicts as their Python reprs.
pub(super) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(value),
    }
}

/// Python `repr(value)` for the JSON-like values templates see.
fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_py_repr(&mut out, value);
    out
}

fn write_py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => match float_of(value) {
            Some(f) => out.push_str(&py_float_repr(f)),
            None => write!(out, "{value}").expect("writing to a String"),
        },
        ValueKind::String => write_py_string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, (key, item)) in map_pairs(value).into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_repr(out, &key);
                out.push_str(": ");
                write_py_repr(out, &item);
            }
            out.push('}');
        }
        _ => write!(out, "{value}").expect("writing to a String"),
    }
}

fn write_py_string_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let code = c as u32;
                if code <= 0xff {
                    write!(out, "\\x{code:02x}")
                } else if code <= 0xffff {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                }
                .expect("writing to a String");
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Approximates Python's `str.isprintable` (controls, non-space separators, common format chars).
fn py_printable(c: char) -> bool {
    !(c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}'))
}

fn float_of(value: &Value) -> Option<f64> {
    if value.kind() != ValueKind::Number || value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// Python's `repr(float)`: shortest round-trip digits, scientific outside 1e-4 <= |x| < 1e16.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f < 0.0 { "-inf".into() } else { "inf".into() };
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    let sci = format!("{:e}", f.abs()); // shortest digits: "1.5e-7", "1e20", "0e0"
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let mantissa = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

fn map_pairs(value: &Value) -> Vec<(Value, Value)> {
    match value.as_object().and_then(|obj| obj.try_iter_pairs()) {
        Some(pairs) => pairs.collect(),
        None => Vec::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// tojson = json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The `tojson` filter with transformers' signature: `ensure_ascii` and `indent` positional or
/// keyword, `separators` and `sort_keys` keyword only.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let pick =
        |positional: Option<Value>, name: &str| -> std::result::Result<Option<Value>, Error> {
            Ok(match kwargs.get::<Option<Value>>(name)? {
                Some(v) => Some(v),
                None => positional,
            })
        };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let sort_keys = pick(None, "sort_keys")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int, a string or None",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match pick(None, "separators")? {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match (
                parts.first().and_then(Value::as_str),
                parts.get(1).and_then(Value::as_str),
                parts.len(),
            ) {
                (Some(item), Some(key), 2) => (item.to_owned(), key.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match float_of(value) {
            Some(f) if f.is_nan() => out.push_str("NaN"),
            Some(f) if f.is_infinite() => {
                out.push_str(if f < 0.0 { "-Infinity" } else { "Infinity" })
            }
            Some(f) => out.push_str(&py_float_repr(f)),
            None => write!(out, "{value}").expect("writing to a String"),
        },
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_container(out, '[', ']', items.len(), style, depth, |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for (key, item) in map_pairs(value) {
                pairs.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_json_container(out, '{', '}', pairs.len(), style, depth, |out, i| {
                write_json_string(out, &pairs[i].0, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &pairs[i].1, style, depth + 1)
            })?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn write_json_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    style: &JsonStyle,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), Error>,
) -> std::result::Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// json.dumps turns str/int/float/bool/None keys into strings; anything else is a TypeError.
fn json_key(key: &Value) -> std::result::Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number => match float_of(key) {
            Some(f) => py_float_repr(f),
            None => key.to_string(),
        },
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    })
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                write!(out, "\\u{:04x}", c as u32).expect("writing to a String")
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(out, "\\u{unit:04x}").expect("writing to a String");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// strftime_now: Python's datetime.now().strftime(fmt), in UTC (no time-zone database here).

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
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

/// Formats a Unix timestamp (UTC) with the common strftime directives (`%Y %y %m %d %e %H %I
/// %M %S %p %a %A %b %B %h %j %F %T %D %%`, plus glibc's `%-d` style unpadded forms).
/// Unknown directives are copied through.
pub fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, value: i64, width: usize| {
            if unpadded {
                write!(out, "{value}")
            } else {
                write!(out, "{value:0width$}")
            }
            .expect("writing to a String")
        };
        match chars.next() {
            Some('Y') => write!(out, "{year}").expect("writing to a String"),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => write!(out, "{day:>2}").expect("writing to a String"),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, day_of_year, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('b' | 'h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}").expect("writing to a String"),
            Some('T') => {
                write!(out, "{hour:02}:{minute:02}:{second:02}").expect("writing to a String")
            }
            Some('D') => write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100))
                .expect("writing to a String"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::chat_template::tests::render_str;
    use crate::text::chat_template::{ChatTemplate, SpecialTokens};
    use serde_json::json;

    fn eval(expr: &str) -> String {
        render_str(&format!("{{{{ {expr} }}}}"), json!([])).unwrap()
    }

    #[test]
    fn python_float_repr_matches_cpython() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-7, "1e-07"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456.789, "123456.789"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
        ];
        for (value, expected) in cases {
            assert_eq!(py_float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let data = json!({"b": [1, 2.0, null, true], "a": "é<&>\"\n"});
        let template = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0].a | tojson(ensure_ascii=true) }}|{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}|{{ [] | tojson(indent=2) }}",
            SpecialTokens::default(),
        )
        .unwrap();
        let out = template
            .render(
                &[data],
                None::<&[serde_json::Value]>,
                false,
                &serde_json::Map::new(),
            )
            .unwrap();
        // serde_json is built with preserve_order: key order is the input's, as in Python; sort_keys sorts.
        let expected = concat!(
            r#"{"b": [1, 2.0, null, true], "a": "é<&>\"\n"}|"#,
            "{\n  \"b\": [\n    1,\n    2.0,\n    null,\n    true\n  ],\n  \"a\": \"é<&>\\\"\\n\"\n}|",
            r#""\u00e9<&>\"\n"|"#,
            r#"{"a":"é<&>\"\n","b":[1,2.0,null,true]}|[]"#,
        );
        assert_eq!(out, expected);
    }

    #[test]
    fn values_print_like_python_str() {
        assert_eq!(eval("none"), "None");
        assert_eq!(eval("true"), "True");
        assert_eq!(eval("1.0 * 3"), "3.0");
        assert_eq!(eval("[1, 'a', none, 2.5]"), "[1, 'a', None, 2.5]");
        assert_eq!(eval("false | string"), "False");
        assert_eq!(eval("\"it's\" | string"), "it's");
        assert_eq!(eval("[\"it's\"] | string"), "[\"it's\"]");
        assert_eq!(eval("undefined_thing"), "");
    }

    #[test]
    fn python_string_methods_work() {
        assert_eq!(
            eval("'  a b  '.strip() + '|' + 'xxhixx'.strip('x') + '|' + 'ab'.upper()"),
            "a b|hi|AB"
        );
        assert_eq!(
            eval("'a,b,c'.split(',')[-1] + 'a,b,c'.rsplit(',', 1)[0]"),
            "ca,b"
        );
        assert_eq!(eval("'a b  c'.rsplit(none, 1)"), "['a b', 'c']");
        assert_eq!(
            eval("'<x>'.startswith('<') and 'y.md'.endswith(('.txt', '.md'))"),
            "True"
        );
        assert_eq!(
            eval("'v1.2'.removeprefix('v') + 'f.py'.removesuffix('.py')"),
            "1.2f"
        );
        assert_eq!(eval("'k=v=w'.partition('=')"), "['k', '=', 'v=w']");
        assert_eq!(eval("'k=v=w'.rpartition('=')[0]"), "k=v");
        assert_eq!(
            eval("'-42'.zfill(5) + 'ab'.center(5, '*') + 'ab'.rjust(4)"),
            "-0042**ab*  ab"
        );
        assert_eq!(eval("'héllo'.index('l')"), "2");
        assert_eq!(eval("'a-b'.replace('-', '+')"), "a+b");
        assert_eq!(eval("{'a': 1}.items() | list"), "[['a', 1]]");
    }

    #[test]
    fn jinja2_tests_and_loop_helpers() {
        assert_eq!(eval("'s' is sequence"), "True");
        assert_eq!(eval("{'a': 1} is mapping"), "True");
        assert_eq!(eval("[1] is string"), "False");
        let out = render_str(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if not loop.first %}{{ loop.previtem.role }}>{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ messages | length }}",
            json!([{"role": "user"}, {"role": "assistant"}, {"role": "user"}]),
        )
        .unwrap();
        assert_eq!(out, "user>assistant>33");
    }

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of the year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime("%d %b %Y, %A %a %B %j %I%p %-d/%-m %y %%", t),
            "29 Feb 2024, Thursday Thu February 060 01PM 29/2 24 %"
        );
        assert_eq!(strftime("%F %T", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime("%Q", 0), "%Q");
    }
}
