//! The wire rules agree with the Python reference (`tools/reference_decide.py`'s
//! `compile_request`) on every case of `tests/fixtures/api/wire_cases.json`: the same refusals
//! (status and code), and for accepted requests the same state text, the same questions and
//! option texts the model will read, and the same images in the same order.

use imajev_serve::api::parse::{check_request, parse_json, ParseContext};
use imajev_serve::api::Loc;
use imajev_serve::decision::prompt::scored_questions;
use imajev_serve::decision::{pyjson, ContractMode, DecisionRequest, QuestionKind};
use imajev_serve::image::{ImageLimits, ImageProcessorConfig};
use serde_json::Value;
use sha2::Digest;

fn ctx(contract: &str) -> ParseContext {
    ParseContext {
        mode: if contract == "typesafe" { ContractMode::Typesafe } else { ContractMode::Imajev },
        max_questions: 64,
        max_options: 255,
        image_limits: ImageLimits::default(),
        image_config: ImageProcessorConfig::default(),
    }
}

#[test]
fn wire_rules_match_the_python_reference() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/api/wire_cases.json");
    let file: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = file["cases"].as_array().unwrap();
    assert!(cases.len() > 300);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let body = case["body"].as_str().unwrap();
        let want = &case["expected"];
        let got = parse_json(body.as_bytes(), Loc::body())
            .and_then(|v| check_request(v, None, &ctx(case["contract"].as_str().unwrap())));
        match (got, want.get("status")) {
            (Err(e), Some(status)) => {
                if status.as_u64() != Some(e.status as u64) || want["code"].as_str() != Some(e.code) {
                    failures.push(format!(
                        "{name}: refused with {} {} ({}), the reference says {} {}",
                        e.status,
                        e.code,
                        e.summary(),
                        status,
                        want["code"]
                    ));
                }
            }
            (Err(e), None) => failures.push(format!("{name}: refused with {e}, the reference accepts it")),
            (Ok(_), Some(status)) => failures
                .push(format!("{name}: accepted, the reference refuses it with {status} {}", want["code"])),
            (Ok(r), None) => {
                let state = pyjson::dumps(&r.state, pyjson::PROMPT_STATE).unwrap();
                if state != want["state"].as_str().unwrap() {
                    failures.push(format!("{name}: state {state:?} != {:?}", want["state"]));
                }
                let thresholds: Vec<f64> = r
                    .questions
                    .iter()
                    .filter_map(|q| match &q.kind {
                        QuestionKind::Multi { threshold, .. } => Some(*threshold),
                        _ => None,
                    })
                    .collect();
                let want_t: Vec<f64> =
                    want["thresholds"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
                if thresholds != want_t {
                    failures.push(format!("{name}: thresholds {thresholds:?} != {want_t:?}"));
                }
                let images: Vec<String> =
                    r.images.iter().map(|b| hex::encode(sha2::Sha256::digest(&b.bytes))).collect();
                let want_i: Vec<String> = want["images"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_string())
                    .collect();
                if images != want_i {
                    failures.push(format!("{name}: images {images:?} != {want_i:?}"));
                }
                let req = DecisionRequest { state: r.state, questions: r.questions, images: vec![] };
                let fs = scored_questions(&req);
                let want_f = want["fields"].as_array().unwrap();
                if fs.len() != want_f.len() {
                    failures.push(format!("{name}: {} fields != {}", fs.len(), want_f.len()));
                    continue;
                }
                for (f, w) in fs.iter().zip(want_f) {
                    let keys: Vec<&str> = f.candidates.iter().map(|c| c.0.as_str()).collect();
                    let texts: Vec<&str> = f.candidates.iter().map(|c| c.1.as_str()).collect();
                    let wk: Vec<&str> =
                        w["keys"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
                    let wt: Vec<&str> =
                        w["texts"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
                    if f.kind.calibration_name() != w["kind"].as_str().unwrap()
                        || f.text != w["question"].as_str().unwrap()
                        || keys != wk
                        || texts != wt
                    {
                        failures.push(format!(
                            "{name}: field {:?} {:?} {keys:?} {texts:?} != {} {:?} {wk:?} {wt:?}",
                            f.kind, f.text, w["kind"], w["question"]
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
