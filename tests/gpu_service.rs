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
        // A body holds its share of the in-flight memory budget, so it is not Clone: one per use.
        let json = serde_json::to_vec(&case["request"]).unwrap();
        let body = || RequestBody::json(json.clone());
        if parse_request(body(), &ctx).is_err() {
            continue;
        }
        // The same request through the request pipeline on each engine.
        let answer = |engine: &dyn DecisionEngine| {
            let run = |call| run_engine(engine, call, BatchLimits::default());
            decide_direct(body(), ctx.clone(), d.clone(), run).unwrap().response
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

/// A tiny-preset config widened to the 4B's projection widths (4 layers, the tiny vision tower
/// feeding 2560): the golden tiny models are 64 wide, too narrow for the block-FP8 GEMMs the
/// service runs (cuBLASLt refuses K = 256), so FP8 batch invariance is checked on this one.
fn wide_fp8_config(dir: &std::path::Path) -> std::path::PathBuf {
    let mut v = imajev_serve::synth::preset_json("tiny").expect("the tiny preset");
    let t = &mut v["text_config"];
    for (k, n) in [
        ("hidden_size", 2560),
        ("intermediate_size", 4096),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
    ] {
        t[k] = n.into();
    }
    t["rope_parameters"]["partial_rotary_factor"] = serde_json::json!(0.25);
    t["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    v["vision_config"]["out_hidden_size"] = 2560.into();
    let path = dir.join("config-wide.json");
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
    path
}

/// Issue 11's batch invariance on the GPU: each request packed into one forward with 1..=7
/// others (text, one and two images) gets the bits it gets alone — on the tiny BF16 model and on
/// a 4B-wide FP8 model (the serving precision), with one- and two-level question trees. Also the
/// two-level tree against the separate prefill → shared question tokens → passes path it
/// replaces (the same arithmetic: within 3e-2, and the bits that differ are printed) and
/// against the one-level tree (within 3e-2 on BF16, 8e-2 on FP8: another summation order).
#[test]
fn gpu_packed_requests_get_the_bits_they_get_alone() {
    use common::packing::{self, bits, prepare, run_packed};
    use imajev_serve::image::ImageProcessorConfig;
    use imajev_serve::synth::SynthDtype;
    use imajev_serve::worker::QuestionTree;
    if let Err(e) = cuda_backend(Quantize::None) {
        eprintln!("skipped: no usable CUDA device ({e:#})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let wide_cfg = wide_fp8_config(dir.path());
    let models = [
        ("tiny bf16", common::bundle("tiny", SynthDtype::Bf16, 41, 8, 16.0, 12)),
        ("4B-wide 4-layer fp8", common::bundle(wide_cfg.to_str().unwrap(), SynthDtype::Fp8, 42, 8, 16.0, 12)),
    ];
    let roomy = |question_tree| BatchLimits {
        max_tokens: 1 << 16,
        max_sequences: 1 << 10,
        question_tree,
        ..Default::default()
    };
    let mut failures = Vec::new();
    for (name, m) in &models {
        let engine = Qwen35::load(cuda_backend(Quantize::None).unwrap(), &m.model, Some(&m.adapter)).unwrap();
        let d = packing::decider(&m.model, &m.adapter, 12, 4);
        let image_config = ImageProcessorConfig::from_model_dir(&m.model).unwrap_or_default();
        let reqs = prepare(&d, &packing::bodies(true), image_config);
        let cases: Vec<(usize, usize)> =
            [0, 5, 6].iter().flat_map(|&t| (1..=7).map(move |k| (t, k))).collect();
        for tree in [QuestionTree::OneLevel, QuestionTree::TwoLevel] {
            let bad = packing::packed_vs_alone(&engine, &d, &reqs, &cases, roomy(tree));
            eprintln!("{name}, {tree:?}: {} packings, {} changed a request", cases.len(), bad.len());
            failures.extend(bad.into_iter().map(|b| format!("{name}, {tree:?}: {b}")));
        }
        // Rounds queued while the one before is in flight (`--overlap-rounds`): the readout of
        // one round waits in pinned memory while the next is queued behind it.
        for tree in [QuestionTree::OneLevel, QuestionTree::TwoLevel] {
            let bad = packing::in_flight_vs_alone(&engine, &reqs, &packing::round_groups(), roomy(tree));
            eprintln!(
                "{name}, {tree:?}: {} rounds in flight, {} requests changed",
                packing::round_groups().len(),
                bad.len()
            );
            failures.extend(bad.into_iter().map(|b| format!("{name}, {tree:?}: {b}")));
        }
        // The two-level tree vs the separate forwards it replaces, and vs the one-level tree.
        let separate = BatchLimits {
            max_tokens: 1,
            max_sequences: 1,
            min_shared_tokens: 0,
            ..roomy(QuestionTree::TwoLevel)
        };
        let all: Vec<usize> = (0..reqs.len()).collect();
        let two = run_packed(&engine, &reqs, &all, roomy(QuestionTree::TwoLevel));
        let one = run_packed(&engine, &reqs, &all, roomy(QuestionTree::OneLevel));
        for (i, r) in reqs.iter().enumerate() {
            let sep = run_packed(&engine, &reqs, &[i], separate).remove(0);
            let flat = |o: &imajev_serve::worker::EngineOutput| -> Vec<f32> {
                o.logits.iter().flatten().flatten().copied().collect()
            };
            let e_sep = common::rel_err(&flat(&two[i]), &flat(&sep));
            let e_one = common::rel_err(&flat(&two[i]), &flat(&one[i]));
            let differ = bits(&two[i]).iter().zip(bits(&sep)).filter(|(a, b)| *a != b).count();
            eprintln!(
                "{name}, {:25} two-level vs separate forwards {e_sep:.2e} ({differ} logits with other bits), vs one-level {e_one:.2e}",
                r.name
            );
            // The one-level tree computes the same mathematics in another order (the question's
            // DeltaNet chunks start elsewhere), and FP8 activation rounding amplifies the f32
            // differences through 4 random-weight layers. The H200 measured up to 3.8e-2 (3xTF32
            // scan products) and 5.8e-2 (TF32, the default) on the 4B-wide FP8 model, ≤ 4e-3 and
            // 9.4e-3 on the tiny BF16 one (bench/NOTES.md). A wrong tree is off by far more.
            let one_level_tol = if name.contains("fp8") { 8e-2 } else { 3e-2 };
            if e_sep > 3e-2 || e_one > one_level_tol {
                failures.push(format!("{name}, {}: two-level tree off by {e_sep:.2e} / {e_one:.2e}", r.name));
            }
            // Alone (one token over the budget), prefix then passes against its one forward
            // (`alone_forward_tokens`): the same arithmetic, the passes' attention and scans as
            // children of the prefix in the same call rather than forks of its finished state.
            let size = roomy(QuestionTree::OneLevel).one_forward(&r.plan).unwrap();
            let apart = BatchLimits {
                max_tokens: size.tokens - 1,
                min_shared_tokens: usize::MAX,
                ..roomy(QuestionTree::OneLevel)
            };
            let alone_apart = run_packed(&engine, &reqs, &[i], apart).remove(0);
            let alone_one =
                run_packed(&engine, &reqs, &[i], BatchLimits { alone_forward_tokens: size.tokens, ..apart })
                    .remove(0);
            let e_alone = common::rel_err(&flat(&alone_one), &flat(&alone_apart));
            let differ = bits(&alone_one).iter().zip(bits(&alone_apart)).filter(|(a, b)| *a != b).count();
            eprintln!(
                "{name}, {:25} alone in one forward vs prefix then passes {e_alone:.2e} ({differ} logits with other bits)",
                r.name
            );
            if alone_apart.prefill_ran == alone_one.prefill_ran || e_alone > 3e-2 {
                failures.push(format!("{name}, {}: alone in one forward off by {e_alone:.2e}", r.name));
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}
