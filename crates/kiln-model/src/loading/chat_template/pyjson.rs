//! `json.dumps` as Python writes it, for the `tojson` filter of chat templates.
//! Hugging Face renders templates with `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`, not Jinja's HTML-safe `tojson`, so tool schemas come
//! out with `", "` and `": "` separators, raw non-ASCII text, unescaped `<` and `&`, and
//! floats in Python's `repr` form (`1.0`, `1e-05`).

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Formatting options, named as `json.dumps` names them.
pub(super) struct Options {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Spaces (or the string) per nesting level; `None` keeps everything on one line.
    pub indent: Option<String>,
    /// Between items.
    pub item_sep: String,
    /// Between a key and its value.
    pub key_sep: String,
    /// Emit object keys in sorted order instead of insertion order.
    pub sort_keys: bool,
}

impl Options {
    /// Reads the filter's keyword arguments: `ensure_ascii`, `indent`, `separators`,
    /// `sort_keys`, with Python's defaults.
    pub(super) fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
        let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
        let indent = match kwargs.get::<Option<Value>>("indent")? {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => match v.as_str() {
                Some(s) => Some(s.to_string()),
                None => {
                    let n = usize::try_from(v.clone()).map_err(|_| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            format!("tojson: indent {v} is not a count or a string"),
                        )
                    })?;
                    Some(" ".repeat(n))
                }
            },
        };
        let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
            Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
            Some(s) => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: separators must be two strings, got {}", s.len()),
                ));
            }
            None if indent.is_some() => (",".to_string(), ": ".to_string()),
            None => (", ".to_string(), ": ".to_string()),
        };
        kwargs.assert_all_used()?;
        Ok(Options { ensure_ascii, indent, item_sep, key_sep, sort_keys })
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, **opts)`.
pub(super) fn dumps(value: &Value, opts: &Options) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &Options, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, opts: &Options, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v)?,
        ValueKind::String => write_string(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        ValueKind::Map | ValueKind::Plain => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(ErrorKind::UndefinedError, "tojson: cannot serialize an undefined value"));
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {other} value"),
            ));
        }
    }
    Ok(())
}

/// Python turns non-string keys into strings: numbers as written, booleans and None as
/// their JSON names.
fn key_string(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key)?;
            s
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be strings, not {other}"),
            ));
        }
    })
}

fn write_number(out: &mut String, v: &Value) -> Result<(), Error> {
    if v.is_integer() {
        if let Ok(i) = i128::try_from(v.clone()) {
            let _ = write!(out, "{i}");
            return Ok(());
        }
        if let Ok(u) = u128::try_from(v.clone()) {
            let _ = write!(out, "{u}");
            return Ok(());
        }
    }
    let f = f64::try_from(v.clone())?;
    out.push_str(&python_float_repr(f));
    Ok(())
}

/// Python's `repr(float)` as `json.dumps` writes it: the shortest digits that round-trip,
/// fixed notation for decimal exponents -4..16 (with `.0` when integral), scientific with a
/// signed two-digit exponent otherwise; `NaN`, `Infinity`, `-Infinity` for non-finite.
pub(super) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    } else if exp >= 0 {
        let point = exp as usize + 1;
        if digits.len() <= point {
            out.push_str(&digits);
            out.push_str(&"0".repeat(point - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    } else {
        out.push_str("0.");
        out.push_str(&"0".repeat((-exp - 1) as usize));
        out.push_str(&digits);
    }
    out
}

/// A JSON string literal with Python's escapes.
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (-2.5e-7, "-2.5e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python_layouts() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!({
            "b": [1, 2.0, "x<&>\"\n", null, true, []],
            "a": {"é": {}},
        })));
        // serde_json keeps insertion order in this workspace (llguidance turns on its
        // `preserve_order`), and the filter keeps the order it is given, as Python's
        // `json.dumps` keeps a dict's.
        assert_eq!(
            dumps(&v, &Options::default()).unwrap(),
            r#"{"b": [1, 2.0, "x<&>\"\n", null, true, []], "a": {"é": {}}}"#
        );
        let opts = Options {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ensure_ascii: true,
            ..Options::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"x<&>\\\"\\n\",\n    null,\n    true,\n    []\n  ],\n  \"a\": {\n    \"\\u00e9\": {}\n  }\n}"
        );
    }
}
