//! Parity of the CPU engine with Hugging Face transformers 5.17 (+ PEFT), float32 reference.
//!
//! `tests/fixtures/golden/cases.json` comes from `tools/golden.py`: for each model variant it ran
//! `imajev-serve synth` (same config, dtype and seed as here), loaded the result with
//! `Qwen3_5ForConditionalGeneration` + `PeftModel`, and recorded the expanded input ids, the
//! final-normed hidden state of the last token and the f32 readout logits. This test re-creates
//! the same checkpoints with the library's synth, runs the CPU engine on the same prompts and
//! images, and requires max |Δ| / max |reference| ≤ 1e-4.

mod common;

use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::Backend;
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig};
use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden")
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length differs");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()).fold(0f64, f64::max) / scale
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

#[test]
fn engine_matches_transformers_fp32() {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap();
    let models: HashMap<String, common::TinyModel> = doc["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap().to_string(), common::from_spec(m, &fixtures())))
        .collect();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "the golden set shrank");
    let mut worst = 0f64;
    let mut failures = Vec::new();
    let mut loaded: HashMap<(String, bool), Qwen35<CpuBackend>> = HashMap::new();
    for (i, case) in cases.iter().enumerate() {
        let name = case["model"].as_str().unwrap().to_string();
        let with_adapter = case["adapter"].as_bool().unwrap();
        let s = &models[&name];
        let model = loaded.entry((name.clone(), with_adapter)).or_insert_with(|| {
            Qwen35::load(CpuBackend::default(), &s.model, with_adapter.then_some(s.adapter.as_path()))
                .unwrap()
        });
        let tok = QwenTokenizer::from_model_dir(&s.model).unwrap();
        let ids = tok.encode(case["prompt"].as_str().unwrap()).unwrap();
        let pcfg = ImageProcessorConfig::from_model_dir(&s.model).unwrap();
        let patched: Vec<_> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let bytes = std::fs::read(fixtures().join("images").join(n.as_str().unwrap())).unwrap();
                load_and_preprocess(&bytes, &ImageLimits::default(), &pcfg).unwrap().1
            })
            .collect();
        let refs: Vec<&_> = patched.iter().collect();
        let (_, hidden, layout) = model.prefill(&ids, &refs).unwrap();
        let want_ids: Vec<u32> =
            case["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(layout.ids, want_ids, "case {i} ({name}): expanded input ids differ");
        let h = model.backend.download(&hidden).unwrap();
        let e = rel_err(&h, &floats(&case["hidden_last"]));
        let mut line = format!(
            "case {i:2} {name:9} adapter={with_adapter:5} images={:?} tokens={}: hidden {e:.2e}",
            case["images"],
            want_ids.len()
        );
        worst = worst.max(e);
        if e > TOLERANCE {
            failures.push(format!("case {i}: hidden_last rel err {e:.3e}"));
        }
        if with_adapter {
            let logits = model.readout(&hidden).unwrap().remove(0);
            let e = rel_err(&logits, &floats(&case["readout_logits"]));
            line += &format!(", readout {e:.2e}");
            worst = worst.max(e);
            if e > TOLERANCE {
                failures.push(format!("case {i}: readout_logits rel err {e:.3e}"));
            }
        }
        eprintln!("{line}");
    }
    eprintln!("worst relative error {worst:.3e} (tolerance {TOLERANCE:.0e})");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
