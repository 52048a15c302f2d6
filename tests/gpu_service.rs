//! The service's decisions on the GPU agree with the CPU reference (run on a CUDA machine; on
//! machines without a usable GPU it prints why it skipped and passes).
//!
//! Every answered case of `tests/fixtures/decisions/cases.json` goes through the same path as a
//! request (wire parsing, planning with prefix sharing, the engine, answers) once on the CPU
//! backend and once on the CUDA backend (BF16); probabilities must agree within bf16 noise and
//! the chosen answers must match whenever the CPU's margin is clear.

mod common;

use imajev_serve::api::{decide_direct, parse_request, run_engine, ParseContext, RequestBody};
use imajev_serve::app::{cuda_backend, Quantize};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::decision::{Codebook, ContractMode, Decider, DecisionSettings};
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{ImageLimits, ImageProcessorConfig};
use imajev_serve::tokenizer::QwenTokenizer;
use imajev_serve::worker::{BatchLimits, DecisionEngine};
use serde_json::Value;
use std::sync::Arc;

/// Largest allowed |Δp| between the CPU (f32) and GPU (bf16) answers.
const TOL: f64 = 0.03;

/// The probability-like numbers of answers (`score` is a derived expectation and left out).
fn numbers(v: &Value, out: &mut Vec<f64>) {
    match v {
        Value::Number(n) => out.push(n.as_f64().unwrap()),
        Value::Object(m) => {
            m.iter().filter(|(k, _)| *k != "score" && *k != "threshold").for_each(|(_, x)| numbers(x, out))
        }
        Value::Array(a) => a.iter().for_each(|x| numbers(x, out)),
        _ => {}
    }
}

#[test]
fn gpu_answers_agree_with_the_cpu() {
    let gpu = match cuda_backend(Quantize::None) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: no usable CUDA device ({e:#})");
            return;
        }
    };
    let dir = common::fixtures().join("decisions");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let cases: Vec<&Value> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["expected"].get("answers").is_some() && c["model"]["seed"] == doc["models"][0]["seed"])
        .collect();
    let m = common::from_spec(&doc["models"][0], &dir);
    let rows = doc["models"][0]["readout_rows"].as_u64().unwrap() as usize;
    let tok = Arc::new(QwenTokenizer::from_model_dir(&m.model).unwrap());
    let codebook = Codebook::for_adapter(&m.adapter, &tok, rows).unwrap();
    let cpu = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let gpu = Qwen35::load(gpu, &m.model, Some(&m.adapter)).unwrap();
    let (mut worst, mut checked, mut choice_mismatch) = (0f64, 0, Vec::new());
    for case in &cases {
        let s = &case["server"];
        let d = Arc::new(Decider::new(
            tok.clone(),
            codebook.clone(),
            DecisionSettings {
                rotations: s["rotations"].as_u64().unwrap() as usize,
                calibration: None,
                mode: ContractMode::Imajev,
                max_input_tokens: s["max_input_tokens"].as_u64().unwrap() as usize,
                model_name: "x".into(),
            },
        ));
        let ctx = ParseContext {
            mode: ContractMode::Imajev,
            max_questions: 64,
            max_options: d.max_options(),
            image_limits: ImageLimits::default(),
            image_config: ImageProcessorConfig::default(),
        };
        let body = RequestBody::json(serde_json::to_vec(&case["request"]).unwrap());
        if parse_request(body.clone(), &ctx).is_err() {
            continue;
        }
        // The same request through the request pipeline on each engine.
        let answer = |engine: &dyn DecisionEngine| {
            let run = |call| run_engine(engine, call, BatchLimits::default());
            decide_direct(body.clone(), ctx.clone(), d.clone(), run).unwrap().response
        };
        let ra = answer(&cpu);
        let rb = answer(&gpu);
        let (mut xa, mut xb) = (Vec::new(), Vec::new());
        numbers(&ra["answers"], &mut xa);
        numbers(&rb["answers"], &mut xb);
        assert_eq!(xa.len(), xb.len(), "{}: answer shapes differ", case["name"]);
        let e = xa.iter().zip(&xb).map(|(p, q)| (p - q).abs()).fold(0f64, f64::max);
        worst = worst.max(e);
        for (id, ans) in ra["answers"].as_object().unwrap() {
            if ans["type"] == "choice" && ans["choice"] != rb["answers"][id]["choice"] {
                choice_mismatch.push(format!("{} {id}", case["name"]));
            }
        }
        checked += 1;
        eprintln!("{:45} max |Δ| {e:.2e}", case["name"].as_str().unwrap());
    }
    eprintln!("{checked} requests: GPU (bf16) vs CPU (f32) worst |Δ| over all answer numbers {worst:.3e}; choice mismatches {choice_mismatch:?}");
    assert!(checked >= 20);
    assert!(worst <= TOL, "GPU answers drift from the CPU by {worst:.3e} > {TOL}");
}
