//! Batch invariance on the CPU: a request's logits are bit-identical whether it runs alone or
//! packed into one forward with 1–7 other requests of different lengths (text, one and two
//! images), with one- and two-level question trees; and a two-level tree gives the bits of the
//! separate prefill → shared question tokens → passes path it replaces, within rounding of the
//! one-level tree; rounds launched while another is in flight, and a request alone in one
//! forward, get the bits of their plain runs.

mod common;

use common::packing::{self, bits, prepare, run_packed, Prepared};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::decision::Decider;
use imajev_serve::engine::Qwen35;
use imajev_serve::image::ImageProcessorConfig;
use imajev_serve::synth::SynthDtype;
use imajev_serve::worker::{BatchLimits, QuestionTree};
use std::sync::Arc;

/// Room for all eight requests in one forward.
fn roomy(question_tree: QuestionTree) -> BatchLimits {
    BatchLimits { max_tokens: 1 << 16, max_sequences: 1 << 10, question_tree, ..Default::default() }
}

/// The tiny BF16 model of `seed` on the CPU, its decision layer with `rotations`, and the eight
/// requests of `packing::bodies` planned for it (the model's files live as long as the first).
fn cpu_engine(
    seed: u64,
    rotations: usize,
) -> (common::TinyModel, Qwen35<CpuBackend>, Vec<Prepared>, Arc<Decider>) {
    let m = common::tiny(SynthDtype::Bf16, seed);
    let engine = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let d = packing::decider(&m.model, &m.adapter, 12, rotations);
    let reqs = prepare(&d, &packing::bodies(true), ImageProcessorConfig::default());
    (m, engine, reqs, d)
}

#[test]
fn packed_requests_get_the_bits_they_get_alone() {
    let (_m, engine, reqs, d) = cpu_engine(31, 2);
    assert_eq!(reqs.len(), 8);
    // A text request (0), a one-image (5) and a two-image request (6) in turn, packed with
    // 1..=7 others.
    let cases: Vec<(usize, usize)> = (1..=7).map(|k| ([0, 5, 6][k % 3], k)).collect();
    for tree in [QuestionTree::OneLevel, QuestionTree::TwoLevel] {
        let bad = packing::packed_vs_alone(&engine, &d, &reqs, &cases, roomy(tree));
        assert!(
            bad.is_empty(),
            "{tree:?}: {} of {} packings changed a request:\n{}",
            bad.len(),
            cases.len(),
            bad.join("\n")
        );
    }
}

/// Rounds launched while the round before is still in flight, as the engine thread overlaps them
/// (`--overlap-rounds`), get the bits they get on their own. On the CPU a launch has run when it
/// returns; this checks the launch/finish split itself (which job and pass each logit goes to).
#[test]
fn rounds_in_flight_get_the_bits_they_get_alone() {
    let (_m, engine, reqs, _) = cpu_engine(33, 2);
    for tree in [QuestionTree::OneLevel, QuestionTree::TwoLevel] {
        let bad = packing::in_flight_vs_alone(&engine, &reqs, &packing::round_groups(), roomy(tree));
        assert!(bad.is_empty(), "{tree:?}:\n{}", bad.join("\n"));
    }
}

/// A request over the budget runs alone; with `alone_forward_tokens` its prefix and passes still
/// run as one forward, which gives the bits of the prefix forward followed by the passes it
/// replaces (one and two levels, text and images).
#[test]
fn a_request_alone_in_one_forward_gets_the_bits_of_prefix_then_passes() {
    let (_m, engine, reqs, _) = cpu_engine(34, 2);
    for tree in [QuestionTree::OneLevel, QuestionTree::TwoLevel] {
        for (i, r) in reqs.iter().enumerate() {
            let size = roomy(tree).one_forward(&r.plan).unwrap();
            // One token over the budget: alone; its passes still fit one batch. Prefix then passes,
            // with two levels each question's shared tokens in a forward of their own (the
            // arithmetic of the two-level tree); with one level inside every pass, as in the tree.
            let min_shared_tokens = if tree == QuestionTree::TwoLevel { 0 } else { usize::MAX };
            let apart = BatchLimits { max_tokens: size.tokens - 1, min_shared_tokens, ..roomy(tree) };
            let one = BatchLimits { alone_forward_tokens: size.tokens, ..apart };
            assert!(one.one_forward(&r.plan).is_none() && one.alone_in_one_forward(&r.plan), "{}", r.name);
            let (a, b) = (
                run_packed(&engine, &reqs, &[i], apart).remove(0),
                run_packed(&engine, &reqs, &[i], one).remove(0),
            );
            assert!(a.prefill_ran && !b.prefill_ran, "{}: the paths that ran", r.name);
            assert_eq!(b.forwards.len(), 1, "{}: one forward", r.name);
            assert_eq!(bits(&a), bits(&b), "{tree:?}, {}: other logits in one forward", r.name);
        }
    }
}

/// The two-level tree in one forward runs exactly the arithmetic of the path it replaces
/// (prefix prefilled and shared, each question's shared tokens extended and shared, each pass
/// extended from them), so the bits agree; against the one-level tree (the question's tokens
/// inside every pass, chunked differently by the delta rule) they agree within rounding.
#[test]
fn two_level_trees_equal_the_separate_forwards_they_replace() {
    let (_m, engine, reqs, _) = cpu_engine(32, 4);
    let two = roomy(QuestionTree::TwoLevel);
    let one = roomy(QuestionTree::OneLevel);
    // Too small for one forward: prefix, then every question's shared tokens (min 0: always),
    // then every pass, each alone.
    let separate = BatchLimits { max_tokens: 1, max_sequences: 1, min_shared_tokens: 0, ..two };
    let all: Vec<usize> = (0..reqs.len()).collect();
    let packed = run_packed(&engine, &reqs, &all, two);
    let mut shared_tokens = 0;
    for (i, r) in reqs.iter().enumerate() {
        let sep = run_packed(&engine, &reqs, &[i], separate).remove(0);
        assert!(sep.prefill_ms > 0.0, "{}: the separate path ran", r.name);
        assert_eq!(packed[i].prefill_ms, 0.0, "{}: one forward", r.name);
        assert_eq!(bits(&packed[i]), bits(&sep), "{}: two-level tree vs separate forwards", r.name);
        // Both ran the plan's tokens: the prefix, each question's shared tokens once, every suffix.
        assert_eq!((packed[i].tokens, sep.tokens), (r.plan.processed_tokens, r.plan.processed_tokens));
        let flat = run_packed(&engine, &reqs, &[i], one).remove(0);
        let (a, b): (Vec<f32>, Vec<f32>) = (
            packed[i].logits.iter().flatten().flatten().copied().collect(),
            flat.logits.iter().flatten().flatten().copied().collect(),
        );
        let e = common::rel_err(&a, &b);
        assert!(e < 1e-5, "{}: two-level vs one-level tree {e:.2e}", r.name);
        assert!(flat.tokens >= packed[i].tokens);
        shared_tokens += flat.tokens - packed[i].tokens;
    }
    assert!(shared_tokens > 100, "the requests share question tokens ({shared_tokens} saved)");
}
