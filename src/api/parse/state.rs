//! Steps 1 and 5 of the wire rules for the state: whether the contract lets it be missing, how a
//! value that is not an object or a string is wrapped, asset placeholders in its strings, and
//! `contracts.Request.bounds` (nesting, size, finite numbers). The data URLs it carries are cut out
//! earlier ([`super::images::extract_embedded`]).

use super::assets::Replacer;
use crate::api::error::{ApiError, Loc};
use crate::decision::pyjson;
use crate::decision::ContractMode;
use serde_json::{Map, Value};

/// Compact UTF-8 JSON size limit of the state (`contracts.MAX_STATE_BYTES`, phase 3).
pub const MAX_STATE_BYTES: usize = 131_072;
/// Deepest state nesting (`contracts.Request.bounds`: the top level is depth 0).
pub const MAX_STATE_DEPTH: usize = 8;

/// Step 1: the TypeSafe contract needs a state that is present and not null.
pub(super) fn require_state(
    state: &Value,
    present: bool,
    mode: ContractMode,
    loc: Loc,
) -> Result<(), ApiError> {
    if mode == ContractMode::Typesafe && state.is_null() {
        let why = if present { "'state' must not be null" } else { "'state' is required" };
        return Err(ApiError::invalid(
            loc,
            format!("{why}: send a string, an object or an array (use \"\" or {{}} for no state)"),
            "missing",
        ));
    }
    Ok(())
}

/// Step 5: a missing state is `{}`, an object or a string stays as it is, anything else becomes
/// `{"state": value}`; then placeholders are replaced and the bounds checked.
pub(super) fn finish_state(
    state: Value,
    present: bool,
    replace: &Replacer,
    loc: &Loc,
) -> Result<Value, ApiError> {
    let state = match state {
        _ if !present => Value::Object(Map::new()),
        s @ (Value::Object(_) | Value::String(_)) => s,
        other => {
            let mut m = Map::new();
            m.insert("state".into(), other);
            Value::Object(m)
        }
    };
    let state = replace.value(&state);
    check_state(&state, loc)?;
    Ok(state)
}

fn depth_ok(v: &Value, depth: usize) -> bool {
    if depth > MAX_STATE_DEPTH {
        return false;
    }
    match v {
        Value::Object(m) => m.values().all(|x| depth_ok(x, depth + 1)),
        Value::Array(a) => a.iter().all(|x| depth_ok(x, depth + 1)),
        _ => true,
    }
}

/// `contracts.Request.bounds`: nesting ≤ 8, finite numbers, ≤ 131,072 bytes of compact JSON.
pub fn check_state(state: &Value, loc: &Loc) -> Result<(), ApiError> {
    if !depth_ok(state, 0) {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("State nesting exceeds {MAX_STATE_DEPTH}: flatten the state (at most {MAX_STATE_DEPTH} levels of objects/arrays)"),
            "value_error",
        ));
    }
    let compact = pyjson::dumps(state, pyjson::COMPACT).map_err(|e| {
        ApiError::invalid(
            loc.clone(),
            format!("State contains the number {} that is not finite; send finite numbers", e.0),
            "value_error",
        )
    })?;
    if compact.len() > MAX_STATE_BYTES {
        return Err(ApiError::invalid(
            loc.clone(),
            format!(
                "State exceeds {MAX_STATE_BYTES} bytes ({} bytes of compact UTF-8 JSON): shorten it",
                compact.len()
            ),
            "too_long",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::parse::test_support::*;
    use serde_json::json;

    #[test]
    fn state_defaults_and_wrapping() {
        let q = json!({"q": noul(json!("Is it?"))});
        assert_eq!(check(json!({"questions": q})).unwrap().state, json!({}));
        assert_eq!(check(json!({"state": null, "questions": q})).unwrap().state, json!({"state": null}));
        assert_eq!(
            check(json!({"state": [1, "a"], "questions": q})).unwrap().state,
            json!({"state": [1, "a"]})
        );
        assert_eq!(check(json!({"state": 3.5, "questions": q})).unwrap().state, json!({"state": 3.5}));
        assert_eq!(check(json!({"state": "text", "questions": q})).unwrap().state, json!("text"));
        assert_eq!(check(json!({"state": {"a": 1}, "questions": q})).unwrap().state, json!({"a": 1}));
        // TypeSafe: state required and not null; lists still wrapped.
        assert_eq!(check_ts(json!({"questions": q})).unwrap_err().status, 422);
        assert_eq!(check_ts(json!({"state": null, "questions": q})).unwrap_err().status, 422);
        assert_eq!(check_ts(json!({"state": ["a"], "questions": q})).unwrap().state, json!({"state": ["a"]}));
        // model and unknown fields are ignored.
        assert!(check(json!({"model": 5, "x_trace": {}, "seed": 7, "questions": q})).is_ok());
    }

    #[test]
    fn state_limits() {
        let q = json!({"q": noul(json!("Is it?"))});
        let mut deep = json!("leaf");
        for _ in 0..8 {
            deep = json!({"d": deep});
        }
        // Eight levels of objects below the top: the leaf is at depth 8 — allowed.
        assert!(check(json!({"state": deep.clone(), "questions": q})).is_ok());
        // Wrapped inside one more object: depth 9.
        let (s, c, m) = err(json!({"state": {"x": deep}, "questions": q}));
        assert_eq!((s, c), (422, "invalid_request"));
        assert!(m.contains("nesting"), "{m}");
        // An empty list nine levels down is also too deep (the check runs before looking inside).
        let mut deep = json!([]);
        for _ in 0..9 {
            deep = json!([deep]);
        }
        assert_eq!(err(json!({"state": deep, "questions": q})).0, 422);
        // Size: compact JSON bytes, exactly at the limit and one over. {"s":"…"} is 8 bytes + n.
        let ok = "z".repeat(MAX_STATE_BYTES - 8);
        assert!(check(json!({"state": {"s": ok}, "questions": q})).is_ok());
        let over = "z".repeat(MAX_STATE_BYTES - 7);
        assert!(err(json!({"state": {"s": over}, "questions": q})).2.contains("131072"));
        // Multi-byte characters count as their UTF-8 bytes.
        let e = "é".repeat(MAX_STATE_BYTES / 2);
        assert_eq!(err(json!({"state": {"s": e}, "questions": q})).0, 422);
        // Non-finite numbers.
        let v: Value = serde_json::from_str(
            r#"{"state": {"x": 1e400}, "questions": {"q": {"type": "noul", "instructions": "?"}}}"#,
        )
        .unwrap();
        assert!(err(v).2.contains("not finite"));
    }
}
