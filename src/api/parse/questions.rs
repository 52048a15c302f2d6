//! Step 6 of the wire rules: the questions, in request order. Each question's type, its
//! instructions and criteria flattened to the text the model reads (imajev's
//! `jev_api.flatten_instructions` / `flatten_description`), and every text within
//! `contracts.Text`'s limits. Asset placeholders in instructions and descriptions are replaced
//! here; option values and labels are keys and stay as sent.

use super::assets::Replacer;
use super::ParseContext;
use crate::api::error::{ApiError, Loc};
use crate::decision::prompt::{multi_label_question, UNKNOWN_KEY};
use crate::decision::pyjson::{self, py_len};
use crate::decision::{ContractMode, Question, QuestionKind};
use serde_json::{Map, Value};

/// Longest instructions / description / question text, in Python characters (`contracts.Text`).
pub const MAX_TEXT: usize = 2000;
/// Longest choice option value (`contracts.Option.value`).
pub const MAX_OPTION_VALUE: usize = 128;
pub const MAX_MULTI_LABELS: usize = 32;
pub const MIN_SCORE_LEVELS: usize = 2;
pub const MAX_SCORE_LEVELS: usize = 10;
pub const DEFAULT_MULTI_THRESHOLD: f64 = 0.5;

/// The `questions` object → the questions in request order (ids kept verbatim).
pub(super) fn check_questions(
    questions: Option<&Value>,
    ctx: &ParseContext,
    replace: &Replacer,
    qloc: Loc,
) -> Result<Vec<Question>, ApiError> {
    let questions = match questions {
        Some(Value::Object(q)) if !q.is_empty() => q,
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid(
                qloc,
                "'questions' is empty: send at least one question",
                "too_short",
            ))
        }
        None => {
            return Err(ApiError::invalid(
                qloc,
                "'questions' is required: an object of question id → question",
                "missing",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                qloc,
                "'questions' must be an object of question id → question",
                "type_error",
            ))
        }
    };
    if questions.len() > ctx.max_questions {
        return Err(ApiError::invalid(
            qloc,
            format!(
                "a request has at most {} questions; got {}: split it into several requests",
                ctx.max_questions,
                questions.len()
            ),
            "too_long",
        ));
    }
    let mut out = Vec::with_capacity(questions.len());
    for (name, q) in questions {
        out.push(Question {
            id: name.clone(),
            kind: question(name, q, &qloc.at(name.as_str()), ctx, replace)?,
        });
    }
    Ok(out)
}

fn question(
    name: &str,
    q: &Value,
    loc: &Loc,
    ctx: &ParseContext,
    replace: &Replacer,
) -> Result<QuestionKind, ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid(loc.clone(), "question ids must be non-empty strings", "value_error"));
    }
    let Value::Object(q) = q else {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("question {name:?} must be an object with 'type' and 'instructions'"),
            "type_error",
        ));
    };
    let kind = match q.get("type") {
        Some(Value::String(t)) if matches!(t.as_str(), "noul" | "choice" | "score" | "multi") => t.as_str(),
        other => {
            let shown = other.map(|v| v.to_string()).unwrap_or_else(|| "missing".into());
            return Err(ApiError::invalid(
                loc.at("type"),
                format!("question {name:?} has unsupported type {shown}; use noul, choice, score or multi"),
                if other.is_none() { "missing" } else { "value_error" },
            ));
        }
    };
    let iloc = loc.at("instructions");
    let instructions = match q.get("instructions") {
        Some(v) => Some(flatten_instructions(&replace.value(v), &iloc)?),
        None if ctx.mode == ContractMode::Typesafe && kind == "noul" => None,
        None => {
            let hint = if kind == "noul" && ctx.mode == ContractMode::Imajev {
                " (a noul without instructions is accepted only in the TypeSafe contract mode)"
            } else {
                ""
            };
            return Err(ApiError::invalid(
                iloc,
                format!("question {name:?} needs 'instructions'{hint}"),
                "missing",
            ));
        }
    };
    let criteria = q.get("criteria").unwrap_or(&Value::Null);
    let cloc = loc.at("criteria");
    match kind {
        "noul" => {
            let empty = Map::new();
            let c = match criteria {
                Value::Null => &empty,
                Value::Object(c) => c,
                _ => {
                    return Err(ApiError::invalid(
                        cloc,
                        format!("noul question {name:?}: criteria must be an object with optional 'true' and 'false' descriptions"),
                        "type_error",
                    ))
                }
            };
            let side = |key: &str| -> Result<Option<String>, ApiError> {
                let l = cloc.at(key);
                let d = flatten_description(&replace.value(c.get(key).unwrap_or(&Value::Null)), &l)?;
                d.map(|d| check_text(d, &l)).transpose()
            };
            let yes = side("true")?;
            let no = side("false")?;
            let question = match instructions {
                Some(i) => i,
                None => yes.clone().or_else(|| no.clone()).ok_or_else(|| {
                    ApiError::invalid(
                        iloc.clone(),
                        format!("question {name:?} needs 'instructions' or a criteria description"),
                        "missing",
                    )
                })?,
            };
            Ok(QuestionKind::Noul { question: check_text(question, &iloc)?, yes, no })
        }
        "choice" => {
            let instructions = instructions.expect("checked above");
            let Value::Object(c) = criteria else {
                return Err(ApiError::invalid(
                    cloc,
                    format!("choice question {name:?} needs a criteria object of option → description"),
                    "type_error",
                ));
            };
            if c.len() < 2 || c.len() > ctx.max_options {
                return Err(ApiError::invalid(
                    cloc,
                    format!("choice question {name:?} needs 2-{} options; got {}", ctx.max_options, c.len()),
                    if c.len() < 2 { "too_short" } else { "too_long" },
                ));
            }
            let mut options = Vec::with_capacity(c.len());
            for (value, desc) in c {
                let l = cloc.at(value.as_str());
                let n = py_len(value);
                if n == 0 || n > MAX_OPTION_VALUE {
                    return Err(ApiError::invalid(
                        l,
                        format!("option values must be 1-{MAX_OPTION_VALUE} characters; got {n}"),
                        if n == 0 { "too_short" } else { "too_long" },
                    ));
                }
                if value == UNKNOWN_KEY {
                    return Err(ApiError::invalid(
                        l,
                        "the option value __unknown__ is reserved; rename the option",
                        "value_error",
                    ));
                }
                let d =
                    flatten_description(&replace.value(desc), &l)?.map(|d| check_text(d, &l)).transpose()?;
                options.push((value.clone(), d));
            }
            Ok(QuestionKind::Choice { question: check_text(instructions, &iloc)?, options })
        }
        "score" => {
            let instructions = instructions.expect("checked above");
            let Value::Array(levels) = criteria else {
                return Err(ApiError::invalid(
                    cloc,
                    format!("score question {name:?} needs an ordered criteria list of level descriptions, lowest first (not an object)"),
                    "type_error",
                ));
            };
            if levels.len() < MIN_SCORE_LEVELS || levels.len() > MAX_SCORE_LEVELS {
                return Err(ApiError::invalid(
                    cloc,
                    format!(
                        "score question {name:?} needs {MIN_SCORE_LEVELS}-{MAX_SCORE_LEVELS} levels; got {}",
                        levels.len()
                    ),
                    if levels.len() < MIN_SCORE_LEVELS { "too_short" } else { "too_long" },
                ));
            }
            let mut out = Vec::with_capacity(levels.len());
            for (i, d) in levels.iter().enumerate() {
                let l = cloc.at(i);
                let Some(d) = flatten_description(&replace.value(d), &l)? else {
                    return Err(ApiError::invalid(l, format!("level {i} needs a description"), "missing"));
                };
                out.push(check_text(d, &l)?);
            }
            Ok(QuestionKind::Score { question: check_text(instructions, &iloc)?, levels: out })
        }
        _ => {
            let instructions = instructions.expect("checked above");
            let c = match criteria {
                Value::Object(c) if !c.is_empty() => c,
                _ => {
                    return Err(ApiError::invalid(
                        cloc,
                        format!(
                        "multi question {name:?} needs a non-empty criteria object of label → description"
                    ),
                        if criteria.is_object() { "too_short" } else { "type_error" },
                    ))
                }
            };
            if c.len() > MAX_MULTI_LABELS {
                return Err(ApiError::invalid(
                    cloc,
                    format!("multi question {name:?} has {} labels; at most {MAX_MULTI_LABELS}", c.len()),
                    "too_long",
                ));
            }
            let tloc = loc.at("threshold");
            let threshold = match q.get("threshold") {
                None => DEFAULT_MULTI_THRESHOLD,
                Some(Value::Number(n)) => match n.as_f64() {
                    Some(t) if t.is_finite() && (0.0..=1.0).contains(&t) => t,
                    _ => {
                        return Err(ApiError::invalid(
                            tloc,
                            "threshold must be a number in [0, 1]",
                            "value_error",
                        ))
                    }
                },
                Some(_) => {
                    return Err(ApiError::invalid(tloc, "threshold must be a number in [0, 1]", "type_error"))
                }
            };
            let mut labels = Vec::with_capacity(c.len());
            for (label, desc) in c {
                let l = cloc.at(label.as_str());
                let d = flatten_description(&replace.value(desc), &l)?;
                check_text(multi_label_question(&instructions, label, d.as_deref()), &l)?;
                labels.push((label.clone(), d));
            }
            Ok(QuestionKind::Multi { instructions, labels, threshold })
        }
    }
}

/// `jev_api._text`: strings as they are, anything else as `json.dumps(v, ensure_ascii=False)`.
fn text_of(v: &Value, loc: &Loc) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        other => pyjson::dumps(other, pyjson::PLAIN).map_err(|e| {
            ApiError::invalid(
                loc.clone(),
                format!("contains the number {} that is not finite; send finite numbers", e.0),
                "value_error",
            )
        }),
    }
}

/// `jev_api.flatten_instructions`: a non-empty string; an object as `key: value` lines; an
/// array as one line per item.
pub fn flatten_instructions(v: &Value, loc: &Loc) -> Result<String, ApiError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::Object(m) if !m.is_empty() => {
            let lines: Result<Vec<String>, ApiError> =
                m.iter().map(|(k, v)| Ok(format!("{k}: {}", text_of(v, loc)?))).collect();
            Ok(lines?.join("\n"))
        }
        Value::Array(a) if !a.is_empty() => {
            let lines: Result<Vec<String>, ApiError> = a.iter().map(|v| text_of(v, loc)).collect();
            Ok(lines?.join("\n"))
        }
        _ => Err(ApiError::invalid(
            loc.clone(),
            "'instructions' must be a non-empty string, object or array",
            "value_error",
        )),
    }
}

/// `jev_api.flatten_description`: null → none; a string; an object as `"; "`-joined `k: v`; an
/// array as `"; "`-joined items; empty results are none. Numbers and booleans are refused.
pub fn flatten_description(v: &Value, loc: &Loc) -> Result<Option<String>, ApiError> {
    let s = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s.clone(),
        Value::Object(m) => {
            let parts: Result<Vec<String>, ApiError> =
                m.iter().map(|(k, v)| Ok(format!("{k}: {}", text_of(v, loc)?))).collect();
            parts?.join("; ")
        }
        Value::Array(a) => {
            let parts: Result<Vec<String>, ApiError> = a.iter().map(|v| text_of(v, loc)).collect();
            parts?.join("; ")
        }
        _ => {
            return Err(ApiError::invalid(
                loc.clone(),
                "a description must be null, a string, an object or an array",
                "type_error",
            ))
        }
    };
    Ok(if s.is_empty() { None } else { Some(s) })
}

/// `contracts.Text`: 1..=2000 Python characters.
fn check_text(s: String, loc: &Loc) -> Result<String, ApiError> {
    let n = py_len(&s);
    if n == 0 {
        return Err(ApiError::invalid(loc.clone(), "must not be empty", "too_short"));
    }
    if n > MAX_TEXT {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("is {n} characters; the limit is {MAX_TEXT}: shorten it"),
            "too_long",
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::parse::test_support::*;
    use serde_json::json;

    #[test]
    fn questions_rules() {
        assert_eq!(err(json!({"state": {}})).1, "invalid_request");
        assert_eq!(err(json!({"questions": {}})).1, "invalid_request");
        assert_eq!(err(json!({"questions": []})).1, "invalid_request");
        let many: Map<String, Value> = (0..65).map(|i| (format!("q{i}"), noul(json!("?")))).collect();
        assert!(err(json!({"questions": many})).2.contains("at most 64"));
        let many: Map<String, Value> = (0..64).map(|i| (format!("q{i}"), noul(json!("?")))).collect();
        assert!(check(json!({"questions": many})).is_ok());
        assert_eq!(err(json!({"questions": {"": noul(json!("?"))}})).1, "invalid_request");
        assert!(err(json!({"questions": {"q": "Is it?"}})).2.contains("must be an object"));
        let m = err(json!({"questions": {"q": {"type": "boolean", "instructions": "?"}}})).2;
        assert!(m.contains("unsupported type \"boolean\"; use noul, choice, score or multi"), "{m}");
        assert!(err(json!({"questions": {"q": {"instructions": "?"}}}))
            .2
            .contains("unsupported type missing"));
        // Any non-empty id works and is kept verbatim, in request order.
        let r = check(json!({"questions": {"ticket-1": noul(json!("a")), "with space": noul(json!("b")), "질문 🎯": noul(json!("c"))}}))
            .unwrap();
        let ids: Vec<&str> = r.questions.iter().map(|q| q.id.as_str()).collect();
        assert_eq!(ids, ["ticket-1", "with space", "질문 🎯"]);
    }

    #[test]
    fn instructions_flattening() {
        let q = |i: Value| check(json!({"questions": {"q": noul(i)}})).map(|r| r.questions[0].kind.clone());
        let text = |k: QuestionKind| match k {
            QuestionKind::Noul { question, .. } => question,
            _ => unreachable!(),
        };
        assert_eq!(text(q(json!("Is it?")).unwrap()), "Is it?");
        assert_eq!(
            text(q(json!({"task": "Decide", "include": ["refunds", "chargebacks"], "n": 1.0, "o": {"a": null}})).unwrap()),
            "task: Decide\ninclude: [\"refunds\", \"chargebacks\"]\nn: 1.0\no: {\"a\": null}"
        );
        assert_eq!(text(q(json!(["Route it.", 5, ["x"], "é"])).unwrap()), "Route it.\n5\n[\"x\"]\né");
        for bad in [json!(""), json!({}), json!([]), json!(null), json!(7), json!(true)] {
            assert_eq!(q(bad.clone()).unwrap_err().status, 422, "{bad}");
        }
        assert!(q(json!("i".repeat(2000))).is_ok());
        assert!(q(json!("é".repeat(2001))).unwrap_err().summary().contains("2001 characters"));
        // Missing instructions: refused in imajev mode, for every type in TypeSafe mode but noul.
        assert!(
            check(json!({"questions": {"q": {"type": "noul", "criteria": {"true": "yes it is"}}}})).is_err()
        );
        let r = check_ts(json!({"state": "", "questions": {"q": {"type": "noul", "criteria": {"true": {"a": 1}, "false": "no"}}}})).unwrap();
        assert_eq!(
            r.questions[0].kind,
            QuestionKind::Noul { question: "a: 1".into(), yes: Some("a: 1".into()), no: Some("no".into()) }
        );
        let r = check_ts(
            json!({"state": "", "questions": {"q": {"type": "noul", "criteria": {"false": "nope"}}}}),
        )
        .unwrap();
        assert_eq!(
            r.questions[0].kind,
            QuestionKind::Noul { question: "nope".into(), yes: None, no: Some("nope".into()) }
        );
        assert!(check_ts(json!({"state": "", "questions": {"q": {"type": "noul"}}})).is_err());
        assert!(check_ts(json!({"state": "", "questions": {"q": {"type": "noul", "instructions": null, "criteria": {"true": "x"}}}})).is_err());
        assert!(check_ts(
            json!({"state": "", "questions": {"q": {"type": "choice", "criteria": {"a": null, "b": null}}}})
        )
        .is_err());
    }

    #[test]
    fn descriptions() {
        let l = Loc::body();
        assert_eq!(flatten_description(&json!(null), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!(""), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!({}), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!([]), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!([""]), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!("x"), &l).unwrap().as_deref(), Some("x"));
        assert_eq!(
            flatten_description(&json!({"owns": ["invoices", "refunds"], "n": 2}), &l).unwrap().as_deref(),
            Some("owns: [\"invoices\", \"refunds\"]; n: 2")
        );
        assert_eq!(
            flatten_description(&json!(["bugs", null, 1e2]), &l).unwrap().as_deref(),
            Some("bugs; null; 100.0")
        );
        assert!(flatten_description(&json!(5), &l).is_err());
        assert!(flatten_description(&json!(false), &l).is_err());
    }

    #[test]
    fn noul_choice_score_multi() {
        let one = |q: Value| check(json!({"questions": {"q": q}})).map(|r| r.questions[0].kind.clone());
        // noul criteria
        assert_eq!(
            one(json!({"type": "noul", "instructions": "?", "criteria": {"true": "yes", "false": null}}))
                .unwrap(),
            QuestionKind::Noul { question: "?".into(), yes: Some("yes".into()), no: None }
        );
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": null})).is_ok());
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": "yes"})).is_err());
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": {"true": "d".repeat(2001)}}))
            .is_err());
        // choice
        let c = |crit: Value| one(json!({"type": "choice", "instructions": "Which?", "criteria": crit}));
        assert_eq!(
            c(json!({"Billing": {"owns": ["a"]}, "Tech": ["bugs", "outages"], "Sales": "", "Other": null}))
                .unwrap(),
            QuestionKind::Choice {
                question: "Which?".into(),
                options: vec![
                    ("Billing".into(), Some("owns: [\"a\"]".into())),
                    ("Tech".into(), Some("bugs; outages".into())),
                    ("Sales".into(), None),
                    ("Other".into(), None)
                ]
            }
        );
        assert!(c(json!({"a": null})).is_err());
        assert!(c(json!({})).is_err());
        assert!(c(json!(["a", "b"])).is_err());
        assert!(c(json!({"a": null, "__unknown__": null})).is_err());
        assert!(c(json!({"a": null, "": null})).is_err());
        assert!(c(json!({"a": null, "y".repeat(129): null})).is_err());
        assert!(c(json!({"a": null, "é".repeat(128): null})).is_ok());
        assert!(c(json!({"a": 5, "b": null})).is_err());
        assert!(c(json!({"a": "d".repeat(2001), "b": null})).is_err());
        let n255: Map<String, Value> = (0..255).map(|i| (i.to_string(), Value::Null)).collect();
        assert!(c(Value::Object(n255)).is_ok());
        let n256: Map<String, Value> = (0..256).map(|i| (i.to_string(), Value::Null)).collect();
        assert!(c(Value::Object(n256)).unwrap_err().summary().contains("2-255 options; got 256"));
        // score
        let s = |crit: Value| one(json!({"type": "score", "instructions": "How much?", "criteria": crit}));
        assert_eq!(
            s(json!(["low", {"label": "high"}])).unwrap(),
            QuestionKind::Score {
                question: "How much?".into(),
                levels: vec!["low".into(), "label: high".into()]
            }
        );
        assert!(s(json!({"0": "low", "1": "high"})).is_err());
        assert!(s(json!(["only"])).is_err());
        assert!(s(json!((0..11).map(|i| i.to_string()).collect::<Vec<_>>())).is_err());
        assert!(s(json!((0..10).map(|i| i.to_string()).collect::<Vec<_>>())).is_ok());
        assert!(s(json!(["low", null])).is_err());
        assert!(s(json!(["low", ""])).is_err());
        assert!(s(json!(["low", "x".repeat(2001)])).is_err());
        // multi
        let m = |crit: Value, t: Option<Value>| {
            let mut q = json!({"type": "multi", "instructions": "Which?", "criteria": crit});
            if let Some(t) = t {
                q["threshold"] = t;
            }
            one(q)
        };
        assert_eq!(
            m(json!({"a": null, "b": "bee"}), Some(json!(1))).unwrap(),
            QuestionKind::Multi {
                instructions: "Which?".into(),
                labels: vec![("a".into(), None), ("b".into(), Some("bee".into()))],
                threshold: 1.0
            }
        );
        assert!(
            matches!(m(json!({"a": null}), None).unwrap(), QuestionKind::Multi { threshold, .. } if threshold == 0.5)
        );
        assert!(m(json!({}), None).is_err());
        assert!(
            m(json!((0..33).map(|i| (format!("l{i}"), Value::Null)).collect::<Map<_, _>>()), None).is_err()
        );
        assert!(
            m(json!((0..32).map(|i| (format!("l{i}"), Value::Null)).collect::<Map<_, _>>()), None).is_ok()
        );
        for t in [json!(1.5), json!(-0.1), json!(true), json!(null), json!("0.5")] {
            assert!(m(json!({"a": null}), Some(t.clone())).is_err(), "{t}");
        }
        // The label's question (instructions + label + description) must fit in 2000 characters.
        let q = json!({"type": "multi", "instructions": "w".repeat(1990), "criteria": {"label": "abc"}});
        assert!(one(q).is_err());
    }
}
