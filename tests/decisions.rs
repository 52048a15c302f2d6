//! Decisions against the Python reference implementation of the contract.
//!
//! `tests/fixtures/decisions/cases.json` comes from `tools/decision_cases.py`, which runs
//! `tools/reference_decide.py` (imajev's rules, transformers fp32 + PEFT, one full forward per
//! pass) on synthetic tiny models. Here the same requests go through the server's own path —
//! wire parsing, planning with prefix sharing, the CPU engine, rotation combining, calibration,
//! answers — and every answer field must match: strings, booleans and key order exactly, numbers
//! within 1e-4. Rejected requests must be rejected with the same status.
//!
//! The answered cases are also answered with the two-level question tree, within the same
//! tolerance. A second test checks that prefix sharing changes nothing: every pass run from
//! scratch gives the same readout logits as the shared-prefix, forked, batched path.

mod common;

use imajev_serve::api::{
    decide_direct, run_engine, ApiError, Decided, EngineCall, ParseContext, RequestBody,
};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::decision::{Calibration, Codebook, ContractMode, Decider, DecisionSettings};
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{ImageLimits, ImageProcessorConfig, PatchedImage};
use imajev_serve::tokenizer::QwenTokenizer;
use imajev_serve::worker::{BatchLimits, DecisionEngine, EngineOutput, QuestionTree};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TOL: f64 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/decisions")
}

struct Model {
    bundle: common::TinyModel,
    tokenizer: Arc<QwenTokenizer>,
    codebook: Codebook,
}

fn synthesize(spec: &Value) -> Model {
    let m = common::from_spec(spec, &fixtures());
    let rows = spec["readout_rows"].as_u64().unwrap() as usize;
    let tokenizer = Arc::new(QwenTokenizer::from_model_dir(&m.model).unwrap());
    let codebook = Codebook::for_adapter(&m.adapter, &tokenizer, rows).unwrap();
    Model { bundle: m, tokenizer, codebook }
}

fn decider(m: &Model, server: &Value) -> Arc<Decider> {
    let (tok, codebook) = (m.tokenizer.clone(), m.codebook.clone());
    let calibration = server["calibration"].as_str().map(|f| Calibration::load(&fixtures().join(f)).unwrap());
    let mode = match server["contract"].as_str().unwrap() {
        "imajev" => ContractMode::Imajev,
        "typesafe" => ContractMode::Typesafe,
        c => panic!("contract {c}"),
    };
    Arc::new(Decider::new(
        tok,
        codebook,
        DecisionSettings {
            rotations: server["rotations"].as_u64().unwrap() as usize,
            calibration,
            mode,
            max_input_tokens: server["max_input_tokens"].as_u64().unwrap() as usize,
            model_name: server["model_name"].as_str().unwrap().to_string(),
        },
    ))
}

/// The case's request through the server's request pipeline, the engine called with `run`.
fn decide_case(
    case: &Value,
    d: &Arc<Decider>,
    ctx: &ParseContext,
    run: impl FnOnce(EngineCall) -> Result<EngineOutput, ApiError>,
) -> Result<Decided, ApiError> {
    let body = RequestBody::json(serde_json::to_vec(&case["request"]).unwrap());
    decide_direct(body, ctx.clone(), d.clone(), run)
}

/// Compares `want` (reference) and `got`; object key order matters (answers and probabilities
/// are ordered), numbers within TOL.
fn compare(path: &str, want: &Value, got: &Value, errors: &mut Vec<String>) {
    match (want, got) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            if (a - b).abs() > TOL {
                errors.push(format!("{path}: {b} vs reference {a} (|Δ| {:.2e})", (a - b).abs()));
            }
        }
        (Value::Object(a), Value::Object(b)) => {
            let ka: Vec<&String> = a.keys().collect();
            let kb: Vec<&String> = b.keys().collect();
            if ka != kb {
                errors.push(format!("{path}: keys {kb:?} vs reference {ka:?}"));
                return;
            }
            for (k, v) in a {
                compare(&format!("{path}.{k}"), v, &b[k], errors);
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                errors.push(format!("{path}: {} items vs reference {}", b.len(), a.len()));
                return;
            }
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                compare(&format!("{path}[{i}]"), x, y, errors);
            }
        }
        (a, b) if a == b => {}
        (a, b) => errors.push(format!("{path}: {b} vs reference {a}")),
    }
}

fn load_cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap()
}

#[test]
fn answers_match_the_python_reference() {
    let doc = load_cases();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 40, "the decision golden set shrank");
    let mut models: HashMap<u64, (Model, Qwen35<CpuBackend>)> = HashMap::new();
    let mut failures = Vec::new();
    let (mut answered, mut rejected) = (0, 0);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let seed = case["model"]["seed"].as_u64().unwrap();
        let (m, engine) = models.entry(seed).or_insert_with(|| {
            let m = synthesize(&case["model"]);
            let e = Qwen35::load(CpuBackend::default(), &m.bundle.model, Some(&m.bundle.adapter)).unwrap();
            (m, e)
        });
        let d = decider(m, &case["server"]);
        let ctx = ParseContext {
            mode: d.settings.mode,
            max_questions: 64,
            max_options: d.max_options(),
            image_limits: ImageLimits::default(),
            image_config: ImageProcessorConfig::from_model_dir(&m.bundle.model).unwrap(),
        };
        let expected = &case["expected"];
        let outcome = decide_case(case, &d, &ctx, |call| run_engine(engine, call, BatchLimits::default()))
            .map_err(|e| {
                assert!(e.status < 500, "{name}: {} {}", e.status, e.summary());
                e.status
            });
        if let Some(status) = expected.get("rejected") {
            rejected += 1;
            match outcome {
                Err(s) if s as u64 == status.as_u64().unwrap() => {}
                Err(s) => failures.push(format!("{name}: rejected with {s}, reference {status}")),
                Ok(_) => failures.push(format!("{name}: answered, reference rejects with {status}")),
            }
            continue;
        }
        answered += 1;
        let got = match outcome {
            Ok(decided) => decided.response,
            Err(s) => {
                failures.push(format!("{name}: rejected with {s}, reference answers"));
                continue;
            }
        };
        let mut errors = Vec::new();
        compare("model", &expected["model"], &got["model"], &mut errors);
        compare("answers", &expected["answers"], &got["answers"], &mut errors);
        for (k, v) in expected["usage"].as_object().unwrap() {
            compare(&format!("usage.{k}"), v, &got["usage"][k], &mut errors);
        }
        // The two-level question tree (each question's shared tokens once inside the forward)
        // answers the same within the tolerance.
        let two_level = BatchLimits { question_tree: QuestionTree::TwoLevel, ..Default::default() };
        match decide_case(case, &d, &ctx, |call| run_engine(engine, call, two_level)) {
            Ok(decided) => {
                compare("two-level answers", &expected["answers"], &decided.response["answers"], &mut errors)
            }
            Err(e) => errors.push(format!("two-level tree: {} {}", e.status, e.summary())),
        }
        if !errors.is_empty() {
            failures.push(format!("{name}:\n    {}", errors.join("\n    ")));
        }
    }
    eprintln!(
        "{answered} answered and {rejected} rejected reference cases checked (one- and two-level trees)"
    );
    assert!(
        failures.is_empty(),
        "{} case(s) differ from the reference:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every pass from scratch (one full forward per pass, the way imajev's torch server runs) gives
/// the same logits as the shared-prefix paths: prefill then forks in tiny batches, and the prefix
/// with every pass in one forward.
#[test]
fn prefix_sharing_equals_running_every_pass_from_scratch() {
    let doc = load_cases();
    let cases: Vec<&Value> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("expected").and_then(|e| e.get("answers")).is_some())
        .collect();
    let m = synthesize(&cases[0]["model"]);
    let engine = Qwen35::load(CpuBackend::default(), &m.bundle.model, Some(&m.bundle.adapter)).unwrap();
    let mut checked = 0;
    let mut worst = 0f64;
    for case in cases.iter().filter(|c| c["model"]["seed"] == cases[0]["model"]["seed"]).take(12) {
        let d = decider(&m, &case["server"]);
        let ctx = ParseContext {
            mode: d.settings.mode,
            max_questions: 64,
            max_options: d.max_options(),
            image_limits: ImageLimits::default(),
            image_config: ImageProcessorConfig::default(),
        };
        // The engine call of the request pipeline, run three ways on the same plan and pixels.
        decide_case(case, &d, &ctx, |call| {
            let (plan, images) = (&call.plan, call.images.iter().collect::<Vec<&PatchedImage>>());
            // Tiny batches, too, so batching itself is exercised differently from the default.
            let shared = engine
                .run(
                    plan,
                    &images,
                    BatchLimits {
                        max_tokens: 64,
                        max_sequences: 3,
                        min_shared_tokens: 0,
                        ..Default::default()
                    },
                    &|| Ok(()),
                )
                .unwrap();
            assert!(shared.prefill_ms > 0.0, "tiny batches take the separate prefill");
            // And the whole request as one forward (prefix + every pass continuing it).
            let one = BatchLimits { min_shared_tokens: usize::MAX, ..Default::default() };
            let fused = engine.run(plan, &images, one, &|| Ok(())).unwrap();
            assert_eq!(fused.prefill_ms, 0.0, "{}: the prefix and passes were not one forward", case["name"]);
            for (q, sp) in plan.scored.iter().enumerate() {
                for (p, pass) in sp.passes.iter().enumerate() {
                    let mut ids = plan.prefix.clone();
                    ids.extend(&sp.common);
                    ids.extend(&pass.suffix);
                    let (_, h, _) = engine.prefill(&ids, &images).unwrap();
                    let scratch = engine.readout(&h).unwrap().remove(0);
                    let e = common::rel_err(&shared.logits[q][p], &scratch);
                    worst = worst.max(e);
                    assert!(
                        e < 1e-5,
                        "{}: scored question {q} pass {p}: shared vs scratch {e:.2e}",
                        case["name"]
                    );
                    let e = common::rel_err(&fused.logits[q][p], &scratch);
                    worst = worst.max(e);
                    assert!(
                        e < 1e-5,
                        "{}: scored question {q} pass {p}: one forward vs scratch {e:.2e}",
                        case["name"]
                    );
                    checked += 1;
                }
            }
            Ok(shared)
        })
        .unwrap();
    }
    eprintln!("{checked} passes: shared-prefix vs from-scratch worst relative difference {worst:.2e}");
    assert!(checked >= 20);
}
