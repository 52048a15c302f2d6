//! Requests packed into one forward against the same requests alone, for any engine: the CPU
//! test (tests/batch_invariance.rs) and the GPU one (tests/gpu_service.rs) share this.

use base64::Engine as _;
use imajev_serve::api::{parse_request, ParseContext, RequestBody};
use imajev_serve::decision::{
    Codebook, ContractMode, Decider, DecisionRequest, DecisionSettings, Plan, Timings,
};
use imajev_serve::image::{ImageLimits, ImageProcessorConfig, PatchedImage};
use imajev_serve::tokenizer::QwenTokenizer;
use imajev_serve::worker::{BatchLimits, DecisionEngine, EngineOutput, PackedJob, Round, RoundResults};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

/// A request ready for the engine: what the request pipeline makes of a body.
pub struct Prepared {
    pub name: String,
    pub request: DecisionRequest,
    pub plan: Plan,
    pub images: Vec<PatchedImage>,
}

/// The decision layer for a synthetic model's adapter (`rows` readout rows), imajev contract.
pub fn decider(model: &Path, adapter: &Path, rows: usize, rotations: usize) -> Arc<Decider> {
    let tok = Arc::new(QwenTokenizer::from_model_dir(model).unwrap());
    let codebook = Codebook::for_adapter(adapter, &tok, rows).unwrap();
    let settings = DecisionSettings {
        rotations,
        calibration: None,
        mode: ContractMode::Imajev,
        max_input_tokens: 1 << 20,
        model_name: "x".into(),
    };
    Arc::new(Decider::new(tok, codebook, settings))
}

fn data_url(name: &str) -> String {
    let bytes = std::fs::read(super::fixtures().join("golden/images").join(name)).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn words(n: usize, seed: usize) -> String {
    const W: &[&str] = &[
        "printer",
        "network",
        "outage",
        "invoice",
        "refund",
        "badge",
        "floor",
        "laptop",
        "firmware",
        "vendor",
        "urgent",
        "meeting",
        "database",
        "backup",
        "ticket",
        "escalation",
        "日本語",
        "café",
    ];
    (0..n).map(|i| W[(i * 7 + seed * 3) % W.len()]).collect::<Vec<_>>().join(" ")
}

/// Request bodies of different lengths and kinds: text only (short to several DeltaNet chunks),
/// one image, two images, every question type, long shared question tokens.
pub fn bodies(with_images: bool) -> Vec<(String, Value)> {
    let choice = |n: usize| {
        let opts: serde_json::Map<String, Value> =
            (0..n).map(|i| (format!("opt{i}"), json!(format!("about the {}", words(2, i))))).collect();
        json!({"type": "choice", "instructions": "Which team should handle this?", "criteria": opts})
    };
    let noul = json!({"type": "noul", "instructions": "Does the reporter need an answer today?"});
    let score = |n: usize| {
        json!({"type": "score", "instructions": "How many people are affected?",
               "criteria": (0..n).map(|i| format!("level {i}")).collect::<Vec<_>>()})
    };
    let multi = json!({"type": "multi", "instructions": "Which topics does it touch?",
                       "criteria": {"hardware": "devices", "money": null, "access": ["badges", "accounts"]}});
    let mut out = vec![
        (
            "text, short".to_string(),
            json!({"state": {"ticket": "printer E-204"}, "questions": {"a": noul, "b": choice(3)}}),
        ),
        (
            "text, ~150 words".into(),
            json!({"state": {"ticket": words(150, 1)}, "questions": {"t": choice(4), "s": score(3)}}),
        ),
        (
            "text, ~250 words, multi".into(),
            json!({"state": {"log": words(250, 2), "n": 3}, "questions": {"m": multi, "u": noul}}),
        ),
        (
            "text, long question".into(),
            json!({"state": "plain text state", "questions": {"q": {"type": "score",
                   "instructions": words(90, 3), "criteria": ["none", "some", "many", "all"]}}}),
        ),
        ("text, one word".into(), json!({"state": {"x": 1}, "questions": {"n": noul}})),
    ];
    if with_images {
        out.push((
            "one image".into(),
            json!({"state": {"note": "see photo"}, "images": [data_url("wide.png")], "questions": {"n": noul, "c": choice(2)}}),
        ));
        out.push((
            "two images".into(),
            json!({"state": {"note": words(40, 4)}, "images": [data_url("wide.png"), data_url("tall.png")],
                   "questions": {"c": choice(5)}}),
        ));
        out.push((
            "small image, text".into(),
            json!({"state": {"note": words(80, 5)}, "images": [data_url("small.png")], "questions": {"s": score(4), "n": noul}}),
        ));
    }
    out
}

/// Parses and plans every body as the request pipeline does.
pub fn prepare(
    decider: &Decider,
    bodies: &[(String, Value)],
    image_config: ImageProcessorConfig,
) -> Vec<Prepared> {
    let ctx = ParseContext {
        mode: ContractMode::Imajev,
        max_questions: 64,
        max_options: decider.max_options(),
        image_limits: ImageLimits::default(),
        image_config,
    };
    bodies
        .iter()
        .map(|(name, body)| {
            let parsed = parse_request(RequestBody::json(serde_json::to_vec(body).unwrap()), &ctx)
                .unwrap_or_else(|e| panic!("{name}: {} {}", e.status, e.summary()));
            let plan = decider.plan(&parsed.request).unwrap();
            Prepared { name: name.clone(), request: parsed.request, plan, images: parsed.pixels }
        })
        .collect()
}

/// Runs `reqs[i]` for each `i` of `which` as one packed run.
pub fn run_packed(
    engine: &dyn DecisionEngine,
    reqs: &[Prepared],
    which: &[usize],
    limits: BatchLimits,
) -> Vec<EngineOutput> {
    let images: Vec<Vec<&PatchedImage>> = which.iter().map(|&i| reqs[i].images.iter().collect()).collect();
    let go = || Ok(());
    let jobs = packed_jobs(reqs, which, &images, &go);
    answered(reqs, which, engine.run_packed(&jobs, limits))
}

/// The jobs of `reqs[i]` for each `i` of `which`, with their images' references.
fn packed_jobs<'a>(
    reqs: &'a [Prepared],
    which: &[usize],
    images: &'a [Vec<&'a PatchedImage>],
    go: &'a dyn Fn() -> Result<(), imajev_serve::worker::StopReason>,
) -> Vec<PackedJob<'a>> {
    which
        .iter()
        .zip(images)
        .map(|(&i, imgs)| PackedJob { plan: &reqs[i].plan, images: imgs, keep_going: go })
        .collect()
}

/// Each result of `reqs[i]` for `i` of `which`, a failure a panic naming the request.
fn answered(reqs: &[Prepared], which: &[usize], results: RoundResults) -> Vec<EngineOutput> {
    results
        .into_iter()
        .zip(which)
        .map(|(r, &i)| r.unwrap_or_else(|e| panic!("{}: {e:#}", reqs[i].name)))
        .collect()
}

/// Runs each group of `reqs` as one round the way the engine thread overlaps them
/// ([`BatchLimits::overlap_rounds`]): a round is launched while the one before it is still in
/// flight (after waiting until that one is nearly done), then the one before is finished.
/// One output per request of each group.
pub fn run_rounds_in_flight(
    engine: &dyn DecisionEngine,
    reqs: &[Prepared],
    groups: &[Vec<usize>],
    limits: BatchLimits,
) -> Vec<Vec<EngineOutput>> {
    let go = || Ok(());
    let mut outs = Vec::new();
    let mut in_flight: Option<(Round, &Vec<usize>)> = None;
    for group in groups {
        let images: Vec<Vec<&PatchedImage>> =
            group.iter().map(|&i| reqs[i].images.iter().collect()).collect();
        let jobs = packed_jobs(reqs, group, &images, &go);
        if let Some((round, _)) = &in_flight {
            engine.wait_nearly_done(round);
        }
        let launched = engine.launch_round(&jobs, limits);
        if let Some((round, which)) = in_flight.replace((launched, group)) {
            outs.push(answered(reqs, which, engine.finish_round(round)));
        }
    }
    if let Some((round, which)) = in_flight {
        outs.push(answered(reqs, which, engine.finish_round(round)));
    }
    outs
}

/// Each group of `groups` run as rounds in flight ([`run_rounds_in_flight`]) against the same
/// group run on its own: logits bitwise. Returns the mismatches.
pub fn in_flight_vs_alone(
    engine: &dyn DecisionEngine,
    reqs: &[Prepared],
    groups: &[Vec<usize>],
    limits: BatchLimits,
) -> Vec<String> {
    let overlapped = run_rounds_in_flight(engine, reqs, groups, limits);
    let mut bad = Vec::new();
    for (group, got) in groups.iter().zip(overlapped) {
        let alone = run_packed(engine, reqs, group, limits);
        for ((&i, a), b) in group.iter().zip(&alone).zip(&got) {
            if bits(a) != bits(b) {
                bad.push(format!("{} in round {group:?}: other logits with a round in flight", reqs[i].name));
            }
        }
    }
    bad
}

/// Rounds of text requests (0..5 of [`bodies`]) one after another, and one with an image (5) in
/// the middle: for [`in_flight_vs_alone`].
pub fn round_groups() -> Vec<Vec<usize>> {
    vec![vec![0, 1], vec![2, 3, 4], vec![1, 4], vec![0], vec![5, 0], vec![3, 0, 2], vec![4]]
}

/// Bits of every logit, in order.
pub fn bits(out: &EngineOutput) -> Vec<u32> {
    out.logits.iter().flatten().flatten().map(|x| x.to_bits()).collect()
}

/// The answers object of a response built from `out`, as text.
pub fn answers(decider: &Decider, req: &Prepared, out: &EngineOutput) -> String {
    let response = decider.respond(&req.request, &req.plan, &out.logits, Timings::default());
    serde_json::to_string(&response["answers"]).unwrap()
}

/// Each `(target, k)`: the target request packed with the `k` requests after it (different
/// lengths and kinds; the target first, in the middle or last) against the target alone: logits
/// bitwise, answers byte for byte, and the packed run was ONE forward. Returns the mismatches.
pub fn packed_vs_alone(
    engine: &dyn DecisionEngine,
    decider: &Decider,
    reqs: &[Prepared],
    cases: &[(usize, usize)],
    limits: BatchLimits,
) -> Vec<String> {
    let mut bad = Vec::new();
    let mut alone: Vec<Option<EngineOutput>> = reqs.iter().map(|_| None).collect();
    for &(t, k) in cases {
        let alone = alone[t].get_or_insert_with(|| run_packed(engine, reqs, &[t], limits).remove(0));
        assert_eq!(alone.packed_with, 1);
        let mut which: Vec<usize> = (1..=k).map(|d| (t + d) % reqs.len()).collect();
        let at = (k * 3) % (k + 1);
        which.insert(at, t);
        let outs = run_packed(engine, reqs, &which, limits);
        let what = format!(
            "{:?} with {k} other(s) ({})",
            reqs[t].name,
            which.iter().filter(|&&i| i != t).map(|&i| reqs[i].name.as_str()).collect::<Vec<_>>().join("; ")
        );
        if outs.iter().any(|o| o.packed_with != k + 1) {
            bad.push(format!("{what}: not one forward"));
        }
        let got = &outs[at];
        let (a, b) = (bits(alone), bits(got));
        if a != b {
            let n = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            bad.push(format!("{what}: {n} of {} logits differ in their bits", a.len()));
        } else if answers(decider, &reqs[t], alone) != answers(decider, &reqs[t], got) {
            bad.push(format!("{what}: answers differ"));
        }
    }
    bad
}
