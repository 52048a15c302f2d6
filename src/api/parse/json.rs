//! Step 0 of the wire rules: the body's bytes → the JSON of the fields the rules read, without
//! building anything for the fields they ignore.
//!
//! Why by hand: a `serde_json::Value` costs ~50–100 bytes per JSON value, so a 16 MB body of
//! `{"pad": [0, 0, …]}` (an ignored field) used to take ~850 MB while parsing. Here the body is
//! first checked as JSON with `serde::de::IgnoredAny` (which allocates nothing), plus the two
//! checks it skips in the strings it ignores (UTF-8, lone surrogate escapes), then a
//! structural scan ([`top_level_members`]) finds the top-level members and counts the values
//! inside each; only the members the rules read ([`READ_FIELDS`]) are parsed into `Value`s, after
//! their value count is checked against [`MAX_JSON_VALUES`] and their memory is reserved from
//! the in-flight budget ([`crate::api::budget`]). serde_json has no streaming API that skips
//! top-level members by name while keeping json.loads' duplicate-key rule (the last value wins,
//! at the first key's place), hence the scan.
//!
//! Knows nothing of what the fields mean: that is the other steps' job.

use crate::api::budget::Reservation;
use crate::api::error::{ApiError, Loc};
use serde_json::{Map, Value};

/// The top-level members the wire rules read; every other member is checked as JSON and skipped.
pub const READ_FIELDS: [&str; 4] = ["state", "questions", "images", "assets"];

/// Most JSON values (objects, arrays, strings, keys, numbers, literals) the read members may hold
/// together. A state within its 131,072-byte limit holds at most ~65,000; this bound keeps the
/// parsed form of any accepted body within ~50 MB.
pub const MAX_JSON_VALUES: usize = 500_000;

/// Bytes a parsed value costs beyond its text (the `Value`, map entry and allocation overheads),
/// for the memory budget.
const VALUE_OVERHEAD: usize = 96;

/// One member of the top-level object: where its key and value lie in the body, and how many
/// JSON values the value holds (itself included, object keys counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub key: std::ops::Range<usize>,
    pub value: std::ops::Range<usize>,
    pub values: usize,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The end of the string starting at `body[start] == b'"'` (one past its closing quote).
fn string_end(body: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < body.len() {
        match body[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    body.len()
}

/// The four hex digits at `body[at..at + 4]`, if they are four hex digits.
fn hex4(body: &[u8], at: usize) -> Option<u16> {
    body.get(at..at + 4)?.iter().try_fold(0u16, |n, &c| Some(n << 4 | (c as char).to_digit(16)? as u16))
}

/// The first `\u` escape of `body` that is a lone UTF-16 surrogate, as its byte offset: a high
/// surrogate (`\uD800`–`\uDBFF`) not followed at once by a low one (`\uDC00`–`\uDFFF`), or a
/// low one not preceded by a high one. serde_json refuses these in every string it parses into
/// a `String` (keys, and every string of a read member) but skips them unchecked in what it
/// ignores, so the whole body is checked here the way a full parse checks it. `body` must be
/// valid JSON (checked before): every backslash in it then starts an escape inside a string.
/// Linear time, no allocation.
fn lone_surrogate(body: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(k) = body.get(i..).and_then(|rest| rest.iter().position(|&b| b == b'\\')) {
        let at = i + k;
        let unicode = body.get(at + 1) == Some(&b'u');
        let Some(n) = hex4(body, at + 2).filter(|_| unicode) else {
            // A one-character escape (`\\`, `\"`, `\n`, …): skipped whole.
            i = at + 2;
            continue;
        };
        i = at + 6;
        match n {
            0xD800..=0xDBFF => {
                if body.get(i..i + 2) == Some(b"\\u") && matches!(hex4(body, i + 2), Some(0xDC00..=0xDFFF)) {
                    i += 6;
                } else {
                    return Some(at);
                }
            }
            0xDC00..=0xDFFF => return Some(at),
            _ => {}
        }
    }
    None
}

/// The members of the top-level object of `body`, which must be valid JSON (checked before);
/// None when the top-level value is not an object. Linear time, no recursion, no allocation
/// beyond the list.
pub fn top_level_members(body: &[u8]) -> Option<Vec<Member>> {
    let mut i = 0;
    while i < body.len() && is_ws(body[i]) {
        i += 1;
    }
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut members = Vec::new();
    loop {
        while i < body.len() && (is_ws(body[i]) || body[i] == b',') {
            i += 1;
        }
        if i >= body.len() || body[i] == b'}' {
            return Some(members);
        }
        // A key, a colon, then one value.
        let key_start = i;
        i = string_end(body, i);
        let key = key_start..i;
        while i < body.len() && (is_ws(body[i]) || body[i] == b':') {
            i += 1;
        }
        let value_start = i;
        let mut depth = 0usize;
        let mut values = 0usize;
        let mut expect_value = true;
        while i < body.len() {
            let b = body[i];
            match b {
                b'"' => {
                    if expect_value {
                        values += 1;
                    }
                    expect_value = false;
                    i = string_end(body, i);
                    if depth == 0 {
                        break;
                    }
                    continue;
                }
                b'{' | b'[' => {
                    values += 1;
                    depth += 1;
                    expect_value = true;
                }
                b'}' | b']' => {
                    if depth == 0 {
                        break;
                    }
                    depth -= 1;
                    expect_value = false;
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                b',' | b':' => {
                    if depth == 0 {
                        break;
                    }
                    expect_value = true;
                }
                _ if is_ws(b) => {
                    if depth == 0 && !expect_value {
                        break;
                    }
                }
                _ => {
                    // A number or a literal: counted where it starts.
                    if expect_value {
                        values += 1;
                        expect_value = false;
                    }
                }
            }
            i += 1;
        }
        let mut end = i;
        while end > value_start && is_ws(body[end - 1]) {
            end -= 1;
        }
        members.push(Member { key, value: value_start..end, values });
    }
}

/// Parses JSON bytes (a leading UTF-8 BOM is skipped, as Python's `json.loads(bytes)` does).
pub fn parse_json(body: &[u8], loc: Loc) -> Result<Value, ApiError> {
    parse_json_within(body, loc, &mut Reservation::none())
}

/// [`parse_json`] keeping only [`READ_FIELDS`] of a top-level object (any other top-level value
/// is returned as `null`, which the rules refuse as not an object), the values they hold counted
/// and their memory reserved in `held` first.
pub fn parse_json_within(body: &[u8], loc: Loc, held: &mut Reservation) -> Result<Value, ApiError> {
    let sent = body.len();
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    // Byte offsets in errors count from the start of the body as sent, BOM included.
    let bom = sent - body.len();
    let bad =
        |e: serde_json::Error| ApiError::bad_json(loc.clone(), format!("the body is not valid JSON: {e}"));
    // serde_json skips ignored strings without checking their UTF-8, so the whole body is checked
    // here (linear, no allocation): a body a full parse refuses is refused the same way.
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::bad_json(
            loc,
            format!("the body is not valid JSON: invalid UTF-8 at byte {}", bom + e.valid_up_to()),
        ));
    }
    serde_json::from_slice::<serde::de::IgnoredAny>(body).map_err(bad)?;
    // Likewise lone surrogate escapes, which serde_json's IgnoredAny skips unchecked.
    if let Some(at) = lone_surrogate(body) {
        let escape = String::from_utf8_lossy(&body[at..at + 6]);
        let high = matches!(hex4(body, at + 2), Some(0xD800..=0xDBFF));
        let rule = if high {
            "a \\uD800-\\uDBFF escape must be followed at once by a \\uDC00-\\uDFFF escape"
        } else {
            "a \\uDC00-\\uDFFF escape must come right after a \\uD800-\\uDBFF escape"
        };
        return Err(ApiError::bad_json(
            loc,
            format!(
                "the body is not valid JSON: lone UTF-16 surrogate escape {escape} at byte {} in a string ({rule}: the pair stands for one character above U+FFFF)",
                bom + at
            ),
        ));
    }
    let Some(members) = top_level_members(body) else {
        return Ok(Value::Null);
    };
    let mut out = Map::new();
    let mut total = 0usize;
    for m in members {
        let key: String = serde_json::from_slice(&body[m.key.clone()]).map_err(bad)?;
        if !READ_FIELDS.contains(&key.as_str()) {
            continue;
        }
        total += m.values;
        if total > MAX_JSON_VALUES {
            return Err(ApiError::too_large(format!(
                "the request holds more than {MAX_JSON_VALUES} JSON values (objects, arrays, strings, numbers) in {}: send fewer (the state may hold at most 131072 bytes)",
                READ_FIELDS.join(", ")
            )));
        }
        let cost = m.value.len().saturating_add(m.values.saturating_mul(VALUE_OVERHEAD));
        held.grow(cost, 0, "parsing the request's JSON")?;
        let v: Value = serde_json::from_slice(&body[m.value.clone()]).map_err(bad)?;
        out.insert(key, v);
    }
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Values and keys in a parsed value, as [`Member::values`] counts them.
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Array(a) => a.iter().map(count).sum(),
            Value::Object(m) => m.values().map(|x| 1 + count(x)).sum(),
            _ => 0,
        }
    }

    #[test]
    fn members_and_counts() {
        let body = br#" { "a" : [1, {"b": "x,]}\"", "c": [true, null, -1.5e3]}, []] ,"st\u0061te":"s",
            "n": 12 , "o": {} }"#;
        let ms = top_level_members(body).unwrap();
        let keys: Vec<&str> = ms.iter().map(|m| std::str::from_utf8(&body[m.key.clone()]).unwrap()).collect();
        assert_eq!(keys, [r#""a""#, r#""st\u0061te""#, r#""n""#, r#""o""#]);
        for m in &ms {
            let v: Value = serde_json::from_slice(&body[m.value.clone()]).unwrap();
            assert_eq!(m.values, count(&v), "{v}");
        }
        assert_eq!(top_level_members(b"{}").unwrap(), vec![]);
        assert_eq!(top_level_members(b"[1]"), None);
        assert_eq!(top_level_members(b"\"x\""), None);
    }

    #[test]
    fn only_read_fields_are_kept_last_duplicate_wins_at_the_first_place() {
        let v = parse_json(
            br#"{"questions": 1, "pad": [0, 0, {"x": 1}], "state": {"a": 1}, "questions": 2, "model": "m"}"#,
            Loc::body(),
        )
        .unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"{"questions":2,"state":{"a":1}}"#);
        assert_eq!(parse_json(b"[1, 2]", Loc::body()).unwrap(), Value::Null);
        // Invalid UTF-8 in a string nothing reads is still not JSON (found by tests/fuzz.rs).
        let e = parse_json(b"[1, {\"st\xF0\xF8ate\": 1}]", Loc::body()).unwrap_err();
        assert_eq!(e.code, "bad_json");
        let e = parse_json(b"{\"pad\": \"\xFF\", \"state\": \"x\"}", Loc::body()).unwrap_err();
        assert_eq!(e.code, "bad_json");
        assert_eq!(parse_json(b"\xEF\xBB\xBF{\"images\": []}", Loc::body()).unwrap(), json!({"images": []}));
        // Ignored members must still be JSON.
        let e = parse_json(br#"{"pad": [0, 0,], "state": 1}"#, Loc::body()).unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_json"));
        let e = parse_json(br#"{"state": 1} x"#, Loc::body()).unwrap_err();
        assert_eq!(e.code, "bad_json");
    }

    /// A lone UTF-16 surrogate escape is not JSON to serde_json's full parse (every string it
    /// parses into a `String`), but its IgnoredAny skips it: refused the same way wherever it
    /// lies, the escape and its place named (found by tests/fuzz.rs, IMAJEV_FUZZ_SEED=
    /// 1796414150940201886: a lone `\ud800` in a key inside a top-level array was "not an
    /// object" instead of bad_json).
    #[test]
    fn lone_surrogate_escapes_are_bad_json_wherever_they_lie() {
        // `{s}` ends a string; the first two are skipped unread, the rest are read.
        let places = [
            r#"[1, 2, {"a{s}": 1}]"#,
            r#"{"pad": [0, {"x": "a{s}"}], "state": "x"}"#,
            r#"{"pad{s}": 1, "state": "x"}"#,
            r#"{"state": {"k{s}": 1}}"#,
            r#"{"state": ["a{s}"]}"#,
        ];
        // (the string's end, the lone escape the error names)
        let lone = [
            (r"\ud800", r"\ud800"),             // high, at the end of the string
            (r"\ud800b", r"\ud800"),            // high, then a character
            (r"\uDBFF\u0041", r"\uDBFF"),       // high, then a non-surrogate escape
            (r"\ud800\n", r"\ud800"),           // high, then a one-character escape
            (r"\ud800\\udc00", r"\ud800"),      // high, then `\\` and the text `udc00`
            (r"\ud800\ud800\udc00", r"\ud800"), // high, then a pair
            (r"\udc00", r"\udc00"),             // low
            (r"\uDFFFb", r"\uDFFF"),            // low, then a character
            (r"\udc00\ud800", r"\udc00"),       // a pair the wrong way round
            (r"\u0041\udc00", r"\udc00"),       // low, after a non-surrogate escape
        ];
        for place in places {
            for (end, named) in lone {
                let body = place.replace("{s}", end);
                assert!(serde_json::from_slice::<Value>(body.as_bytes()).is_err(), "{body}");
                let e = parse_json(body.as_bytes(), Loc::body()).unwrap_err();
                assert_eq!((e.status, e.code), (422, "bad_json"), "{body}");
                let want = format!(
                    "lone UTF-16 surrogate escape {named} at byte {} in a string",
                    body.find(named).unwrap()
                );
                assert!(e.summary().contains(&want), "{body}: {}", e.summary());
            }
        }
        // Pairs, boundaries and escaped backslashes are characters: kept as a full parse keeps them.
        let fine = [
            r"\ud800\udc00",
            r"\uDBFF\uDFFFb",
            r"\ud83d\ude00\n",
            r"\u00e9\ud7ff\ue000",
            r"\\ud800",
            r"\\\ud83d\ude00",
        ];
        for place in places {
            for end in fine {
                let body = place.replace("{s}", end);
                let full: Value = serde_json::from_slice(body.as_bytes()).unwrap();
                let kept = parse_json(body.as_bytes(), Loc::body())
                    .unwrap_or_else(|e| panic!("{body}: {}", e.summary()));
                let want = match full {
                    Value::Object(m) => Value::Object(
                        m.into_iter().filter(|(k, _)| READ_FIELDS.contains(&k.as_str())).collect(),
                    ),
                    _ => Value::Null,
                };
                assert_eq!(kept, want, "{body}");
            }
        }
        assert_eq!(
            parse_json(br#"{"state": "\ud83d\ude00"}"#, Loc::body()).unwrap(),
            json!({"state": "\u{1F600}"})
        );
    }

    /// The byte an error names is the byte of the body as the client sent it: a leading UTF-8 BOM
    /// (skipped, as Python's `json.loads(bytes)` skips it) still counts.
    #[test]
    fn error_offsets_count_a_leading_bom() {
        for bom in [&b""[..], b"\xEF\xBB\xBF"] {
            let mut body = bom.to_vec();
            body.extend_from_slice(br#"{"state": "a\ud800"}"#);
            let at = body.windows(6).position(|w| w == br"\ud800").unwrap();
            let e = parse_json(&body, Loc::body()).unwrap_err();
            assert!(e.summary().contains(&format!("at byte {at} ")), "{}", e.summary());
            let mut body = bom.to_vec();
            body.extend_from_slice(b"{\"state\": \"a\xFF\"}");
            let at = body.iter().position(|&b| b == 0xFF).unwrap();
            let e = parse_json(&body, Loc::body()).unwrap_err();
            assert!(e.summary().ends_with(&format!("invalid UTF-8 at byte {at}")), "{}", e.summary());
        }
    }

    /// Issue 16, item 4: 16 MB of an ignored field's zeros used to build a ~850 MB `Value`
    /// tree; now it costs nothing beyond the scan, and a read field holding too many values is
    /// refused (413) before it is built.
    #[test]
    fn ignored_fields_cost_nothing_and_read_fields_are_capped() {
        let budget = crate::api::budget::MemoryBudget::new(1 << 20);
        let mut pad = b"{\"pad\": [".to_vec();
        pad.extend(b"0,".repeat(8 << 20));
        pad.extend(b"0], \"state\": \"x\"}");
        let mut held = budget.empty();
        let v = parse_json_within(&pad, Loc::body(), &mut held).unwrap();
        assert_eq!(v, json!({"state": "x"}));
        assert!(held.bytes() < 1024, "{}", held.bytes());
        drop(held);
        // The same zeros in the state: over the value cap.
        let mut state = b"{\"state\": [".to_vec();
        state.extend(b"0,".repeat(MAX_JSON_VALUES));
        state.extend(b"0]}");
        let e = parse_json_within(&state, Loc::body(), &mut budget.empty()).unwrap_err();
        assert_eq!((e.status, e.code), (413, "request_too_large"));
        assert!(e.summary().contains("500000 JSON values"), "{}", e.summary());
        // Under the cap, but over this budget: 413 before anything is built.
        let mut state = b"{\"state\": [".to_vec();
        state.extend(b"0,".repeat(20_000));
        state.extend(b"0]}");
        let e = parse_json_within(&state, Loc::body(), &mut budget.empty()).unwrap_err();
        assert_eq!(e.status, 413);
        assert!(e.summary().contains("memory budget"), "{}", e.summary());
        assert_eq!(budget.used(), 0);
    }
}
