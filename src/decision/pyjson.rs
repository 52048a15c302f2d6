//! Python's `json.dumps`, byte for byte, for the text the model reads.
//!
//! imajev renders the state with `json.dumps(state, sort_keys=True, ensure_ascii=False)` and
//! structured instructions with `json.dumps(value, ensure_ascii=False)`; the prompt tokens — and
//! therefore the answers — depend on every byte: key order (code point order when sorted),
//! `", "`/`": "` separators, escapes (`\n`, `\"`, `\\`, `\u001f`), raw non-ASCII, Python's float
//! repr (`1.0`, `1e-05`, `1e+16`, `-0.0`) and arbitrary-precision integers. serde_json writes none
//! of these the Python way, so this small writer does. Numbers arrive as serde_json
//! `arbitrary_precision` literals and are re-printed the way Python would after `json.loads`.

use serde_json::{Number, Value};

/// How to write a JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    pub sort_keys: bool,
    /// `(",", ":")` instead of Python's default `(", ", ": ")`.
    pub compact: bool,
}

/// `json.dumps(v, sort_keys=True, ensure_ascii=False)` — the state line of the prompt.
pub const PROMPT_STATE: Style = Style { sort_keys: true, compact: false };
/// `json.dumps(v, ensure_ascii=False)` — structured instructions and descriptions.
pub const PLAIN: Style = Style { sort_keys: false, compact: false };
/// `json.dumps(v, ensure_ascii=False, separators=(",", ":"))` — the state size limit.
pub const COMPACT: Style = Style { sort_keys: false, compact: true };

/// A number that Python cannot write with `allow_nan=False` (a float literal too large for f64).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFinite(pub String);

/// Writes `v` as Python's `json.dumps` would (with `allow_nan=False`).
pub fn dumps(v: &Value, style: Style) -> Result<String, NonFinite> {
    let mut out = String::new();
    write_value(v, style, &mut out)?;
    Ok(out)
}

fn write_value(v: &Value, style: Style, out: &mut String) -> Result<(), NonFinite> {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => out.push_str(&number(n)?),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(if style.compact { "," } else { ", " });
                }
                write_value(item, style, out)?;
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if style.sort_keys {
                // Rust orders strings by UTF-8 bytes, which is code point order, as Python sorts.
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(if style.compact { "," } else { ", " });
                }
                write_string(k, out);
                out.push_str(if style.compact { ":" } else { ": " });
                write_value(item, style, out)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// A JSON string literal as `json.dumps(..., ensure_ascii=False)` writes it. Every character
/// that is escaped is ASCII, so the text between escapes is copied as whole byte runs (a state
/// is written twice per request, for the size limit and for the prompt; char by char, a 120 KB
/// state took ~0.3 ms each time).
pub fn write_string(s: &str, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    let mut run = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..0x20 => "",
            _ => continue,
        };
        out.push_str(&s[run..i]);
        if escape.is_empty() {
            out.push_str(&format!("\\u{b:04x}"));
        } else {
            out.push_str(escape);
        }
        run = i + 1;
    }
    out.push_str(&s[run..]);
    out.push('"');
}

/// A number as Python prints it after `json.loads`: integer literals stay integers (any size),
/// everything else is a float printed with `repr`.
pub fn number(n: &Number) -> Result<String, NonFinite> {
    let text = n.to_string();
    let is_int = !text.contains(['.', 'e', 'E']);
    if is_int {
        // Python ints: "-0" is 0; JSON forbids leading zeros, so the digits are canonical.
        let digits = text.trim_start_matches('-');
        if digits.bytes().all(|b| b == b'0') {
            return Ok("0".into());
        }
        return Ok(text);
    }
    let f: f64 = text.parse().map_err(|_| NonFinite(text.clone()))?;
    if !f.is_finite() {
        return Err(NonFinite(text));
    }
    Ok(float_repr(f))
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional for exponents in
/// −4..16, else `d.ddde±XX`; integral values keep `.0`.
pub fn float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digit count; when two such strings are equally near
    // (an exact tie) Python keeps the even one, so re-round the exact value to that many digits
    // (Rust's fixed-precision formatting is exact and rounds half to even).
    let shortest = format!("{:e}", f);
    let n = shortest.split_once('e').unwrap().0.chars().filter(|c| c.is_ascii_digit()).count();
    let sci = format!("{:.*e}", n - 1, f);
    let (mantissa, exp) = sci.split_once('e').expect("scientific notation");
    let exp: i32 = exp.parse().expect("exponent");
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        // Positional: place the decimal point after exp + 1 digits.
        let point = exp + 1;
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() == 1 { digits.clone() } else { format!("{}.{}", &digits[..1], &digits[1..]) };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

/// Python's `str.strip()` (what Jinja's `trim` does): Unicode whitespace as `str.isspace`
/// defines it, which adds the four information separators U+001C–U+001F to White_Space.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Python's `str.isspace()` for one character.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Length in Python characters (code points).
pub fn py_len(s: &str) -> usize {
    s.chars().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The character-by-character writer [`write_string`] replaced: the reference it must equal.
    fn write_string_by_chars(s: &str, out: &mut String) {
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
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }

    #[test]
    fn string_runs_equal_the_char_by_char_writer() {
        let mut cases: Vec<String> =
            (0u32..0x100).filter_map(char::from_u32).map(|c| format!("a{c}\u{e9}{c}")).collect();
        cases.extend(
            ["", "\"", "\\", "\u{1f}", "\u{7f}\u{80}\u{2028}\u{2029}\u{fffd}\u{1f600}", "\\u0041 \\n"]
                .map(String::from),
        );
        cases.push("Printer \u{2014} \"E-204\"\n\ttab\u{0}\u{1}\r\\ 日本語 😀 ".repeat(5000));
        for s in &cases {
            let (mut fast, mut reference) = (String::from("x"), String::from("x"));
            write_string(s, &mut fast);
            write_string_by_chars(s, &mut reference);
            assert_eq!(fast, reference, "{s:?}");
        }
    }

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-0.0, "-0.0"),
            (123.456, "123.456"),
            (1.5e300, "1.5e+300"),
            (2.5e-7, "2.5e-07"),
            (-12345678.9, "-12345678.9"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (9007199254740993.0, "9007199254740992.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn dumps_matches_python() {
        let v = parse(
            r#"{"b": 1, "a": [1.0, -0, 12345678901234567890123, 1e5, "x\"y\\z\n\t\u0001é😀\u2028"], "A": {"z": null, "y": true}}"#,
        );
        assert_eq!(
            dumps(&v, PROMPT_STATE).unwrap(),
            "{\"A\": {\"y\": true, \"z\": null}, \"a\": [1.0, 0, 12345678901234567890123, 100000.0, \"x\\\"y\\\\z\\n\\t\\u0001é😀\u{2028}\"], \"b\": 1}"
        );
        assert_eq!(dumps(&parse(r#"{"b":1,"a":[]}"#), PLAIN).unwrap(), "{\"b\": 1, \"a\": []}");
        assert_eq!(dumps(&parse(r#"{"b":1,"a":[1,2]}"#), COMPACT).unwrap(), "{\"b\":1,\"a\":[1,2]}");
        assert_eq!(dumps(&parse(r#""a\u007fb""#), PLAIN).unwrap(), "\"a\u{7f}b\"");
        assert!(dumps(&parse("[1e400]"), PLAIN).is_err());
    }

    #[test]
    fn strip_is_python_strip() {
        assert_eq!(py_strip(" \t\nx y\u{a0}\u{1f}\u{2028}"), "x y");
        assert_eq!(py_strip("x\u{200b}"), "x\u{200b}");
    }
}

#[cfg(test)]
mod python_corpus {
    /// `tests/fixtures/pyjson/float_repr.txt`: `<f64 bits hex> <json.dumps(f)>` from CPython 3.11.
    #[test]
    fn float_repr_matches_cpython_on_4000_values() {
        let text = include_str!("../../tests/fixtures/pyjson/float_repr.txt");
        let mut n = 0;
        for line in text.lines() {
            let (bits, want) = line.split_once(' ').unwrap();
            let f = f64::from_bits(u64::from_str_radix(bits, 16).unwrap());
            assert_eq!(super::float_repr(f), want, "bits {bits}");
            n += 1;
        }
        assert!(n > 3900);
    }
}
