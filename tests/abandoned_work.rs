//! Work the engine abandons says where it stopped: a request whose deadline passes (or whose
//! caller leaves) between two steps is stopped there, and the error names the stage — before the
//! first stage, inside the vision tower after how many blocks, after vision, inside a lone
//! prefix's forward (or a lone request's one forward) after how many layers, or between question
//! passes after how many ran — with the reason. The worker logs that stage with the request id
//! and the caller's 504 names it (`src/worker/mod.rs`, `src/api/server.rs`; the real server's log
//! and 504 are checked by tests/adversarial.rs).

mod common;

use common::packing::{self, prepare, Prepared};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{ImageProcessorConfig, PatchedImage};
use imajev_serve::synth::SynthDtype;
use imajev_serve::worker::{BatchLimits, DecisionEngine, PackedJob, RunError, Stage, StopReason};
use std::cell::Cell;

/// Runs `req` with a `keep_going` that says go `ok` times, then stops for `why`.
fn stop_after(
    engine: &dyn DecisionEngine,
    req: &Prepared,
    limits: BatchLimits,
    ok: usize,
    why: StopReason,
) -> Result<(), (StopReason, Stage)> {
    let asked = Cell::new(0);
    let go = || {
        asked.set(asked.get() + 1);
        if asked.get() > ok {
            Err(why)
        } else {
            Ok(())
        }
    };
    let images: Vec<&PatchedImage> = req.images.iter().collect();
    let job = PackedJob { plan: &req.plan, images: &images, keep_going: &go };
    match engine.run_packed(&[job], limits).pop().unwrap() {
        Ok(_) => Ok(()),
        Err(RunError::Stopped(r, stage)) => Err((r, stage)),
        Err(e) => panic!("{}: {e:#}", req.name),
    }
}

#[test]
fn a_stopped_run_names_the_stage_it_abandoned() {
    let m = common::tiny(SynthDtype::Bf16, 41);
    let engine = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let config = imajev_serve::engine::ModelConfig::from_file(&m.model.join("config.json")).unwrap();
    let (depth, layers) = (config.vision_config.depth, config.text_config.num_hidden_layers);
    let d = packing::decider(&m.model, &m.adapter, 12, 2);
    let reqs = prepare(&d, &packing::bodies(true), ImageProcessorConfig::default());
    let two_images = reqs.iter().find(|r| r.name == "two images").unwrap();
    let text = reqs.iter().find(|r| r.name == "text, ~150 words").unwrap();
    let packed = BatchLimits { max_tokens: 1 << 16, max_sequences: 1 << 10, ..Default::default() };
    // Too small for one forward: the request runs alone (prefix, then passes one at a time; no
    // question's shared tokens run as their own stage).
    let alone =
        BatchLimits { max_tokens: 1, max_sequences: 1, min_shared_tokens: usize::MAX, ..Default::default() };
    let deadline = StopReason::Deadline;

    // One packed forward: a check before anything, one before each vision block, one after vision.
    assert_eq!(stop_after(&engine, two_images, packed, 0, deadline), Err((deadline, Stage::Start)));
    for ran in [0, 1, depth - 1] {
        assert_eq!(
            stop_after(&engine, two_images, packed, 1 + ran, StopReason::CallerGone),
            Err((StopReason::CallerGone, Stage::Vision { block: ran, blocks: depth })),
            "stopped after {ran} vision blocks"
        );
    }
    assert_eq!(stop_after(&engine, two_images, packed, 1 + depth, deadline), Err((deadline, Stage::Prefill)));
    assert_eq!(stop_after(&engine, two_images, packed, 2 + depth, deadline), Ok(()));

    // Alone: before every layer of the prefix, after the prefix and after every batch of passes
    // (here: one pass a batch).
    let total = text.plan.scored.iter().map(|q| q.passes.len()).sum::<usize>();
    assert!(total >= 3, "{total} passes");
    assert_eq!(stop_after(&engine, text, alone, 0, deadline), Err((deadline, Stage::Start)));
    assert_eq!(stop_after(&engine, text, alone, 1, deadline), Err((deadline, Stage::Prefill)));
    for layer in [0, 1, layers - 1] {
        assert_eq!(
            stop_after(&engine, text, alone, 2 + layer, StopReason::CallerGone),
            Err((StopReason::CallerGone, Stage::PrefixLayers { layer, layers })),
            "stopped after {layer} prefix layers"
        );
    }
    // No vision blocks without images; the prefix ran, then a check after every batch of passes.
    let first_pass_check = 2 + layers;
    assert_eq!(
        stop_after(&engine, text, alone, first_pass_check, deadline),
        Err((deadline, Stage::Questions { done: 0, total }))
    );
    for done in 1..total {
        assert_eq!(
            stop_after(&engine, text, alone, first_pass_check + done, deadline),
            Err((deadline, Stage::Questions { done, total })),
        );
    }
    assert_eq!(stop_after(&engine, text, alone, first_pass_check + total, deadline), Ok(()));

    // Alone, but its prefix and passes in one forward (`alone_forward_tokens`): before every
    // layer of that forward, and nothing after it.
    let tree = packed.one_forward(&text.plan).unwrap().tokens;
    let one = BatchLimits {
        max_tokens: tree - 1,
        max_sequences: 1 << 10,
        alone_forward_tokens: tree,
        ..Default::default()
    };
    assert!(one.one_forward(&text.plan).is_none() && one.alone_in_one_forward(&text.plan));
    assert_eq!(stop_after(&engine, text, one, 0, deadline), Err((deadline, Stage::Start)));
    assert_eq!(stop_after(&engine, text, one, 1, deadline), Err((deadline, Stage::Prefill)));
    for layer in [0, 1, layers - 1] {
        assert_eq!(
            stop_after(&engine, text, one, 2 + layer, deadline),
            Err((deadline, Stage::PrefixLayers { layer, layers })),
            "stopped after {layer} layers of the one forward"
        );
    }
    assert_eq!(stop_after(&engine, text, one, 2 + layers, deadline), Ok(()));
}

#[test]
fn stages_read_as_what_was_given_up() {
    let cases = [
        (Stage::Queued, "while queued (nothing ran)"),
        (Stage::Vision { block: 3, blocks: 27 }, "in the vision tower (after 3 of 27 blocks)"),
        (Stage::PrefixLayers { layer: 9, layers: 32 }, "in the prompt's forward (after 9 of 32 layers)"),
        (Stage::Questions { done: 5, total: 16 }, "between question passes (5 of 16 ran)"),
    ];
    for (stage, text) in cases {
        assert_eq!(stage.to_string(), text);
    }
    let e = RunError::Stopped(StopReason::Deadline, Stage::Prefill);
    assert_eq!(e.to_string(), "stopped after vision, before the prompt's forward: deadline passed");
}
