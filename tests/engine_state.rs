//! The forkable state: chunked and recurrent delta rules agree, and a forked prefix state
//! extended with a suffix equals one forward over prefix + suffix.

mod common;

use common::{fixtures, rel_err, tiny};
use imajev_serve::backend::cpu::deltanet::{delta_rule_chunked, delta_rule_recurrent, DeltaRuleInputs};
use imajev_serve::backend::cpu::{CpuBackend, DeltaRuleMode};
use imajev_serve::backend::Backend;
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig, PatchedImage};
use imajev_serve::synth::rng::SplitMix;
use imajev_serve::synth::SynthDtype;
use imajev_serve::tokenizer::QwenTokenizer;

/// `n` test inputs uniform in (−1, 1), from the project's generator.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix::new(seed);
    (0..n).map(|_| rng.uniform() * 2.0 - 1.0).collect()
}

fn normalize_rows(x: &mut [f32], d: usize, scale: f32) {
    for r in x.chunks_mut(d) {
        let n = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
        r.iter_mut().for_each(|v| *v *= scale / n);
    }
}

#[test]
fn chunked_and_recurrent_delta_rules_agree() {
    let (n, heads, dk, dv) = (203, 3, 16, 12);
    let mut q = noise(n * heads * dk, 1);
    let mut k = noise(n * heads * dk, 2);
    normalize_rows(&mut q, dk, 1.0 / (dk as f32).sqrt());
    normalize_rows(&mut k, dk, 1.0);
    let v = noise(n * heads * dv, 3);
    let g: Vec<f32> = noise(n * heads, 4).iter().map(|x| -0.3 * (x + 1.0)).collect();
    let beta: Vec<f32> = noise(n * heads, 5).iter().map(|x| 0.5 + 0.5 * x).collect();
    let x = DeltaRuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, n, heads, dk, dv };
    let init = noise(heads * dk * dv, 6);
    let mut s_ref = init.clone();
    let o_ref = delta_rule_recurrent(&x, &mut s_ref);
    for chunk in [64, 16, 7, 1, 500] {
        let mut s = init.clone();
        let o = delta_rule_chunked(&x, &mut s, chunk);
        let (eo, es) = (rel_err(&o, &o_ref), rel_err(&s, &s_ref));
        assert!(eo < 1e-5 && es < 1e-5, "chunk {chunk}: output {eo:.2e}, state {es:.2e}");
    }
}

/// Whether `a` and `b` hold the same values bit for bit.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn prompt_ids(tok: &QwenTokenizer, images: usize, text: &str) -> Vec<u32> {
    let p = format!(
        "<|im_start|>user\n{}{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|vision_start|><|image_pad|><|vision_end|>".repeat(images),
        text
    );
    tok.encode(&p).unwrap()
}

fn load_image(name: &str) -> PatchedImage {
    let bytes = std::fs::read(fixtures().join("golden/images").join(name)).unwrap();
    load_and_preprocess(&bytes, &ImageLimits::default(), &ImageProcessorConfig::default()).unwrap().1
}

const TEXT: &str = "Ticket: the printer on floor 3 shows E-204 after the update; 日本語も少し。 Which team? \
A: infra\nB: facilities\nC: identity\nD: unknown — cannot be determined from the available evidence";

#[test]
fn whole_model_chunked_equals_recurrent() {
    let m = tiny(SynthDtype::F32, 21);
    let tok = QwenTokenizer::from_model_dir(&m.model).unwrap();
    let ids = prompt_ids(&tok, 0, &TEXT.repeat(4));
    assert!(ids.len() > 3 * 64, "needs more than 3 chunks, has {}", ids.len());
    let run = |mode| {
        let model = Qwen35::load(CpuBackend { delta_rule: mode }, &m.model, Some(&m.adapter)).unwrap();
        let (_, h, _) = model.prefill(&ids, &[]).unwrap();
        (model.backend.download(&h).unwrap(), model.readout(&h).unwrap().remove(0))
    };
    let (hc, lc) = run(DeltaRuleMode::Chunked(64));
    let (hr, lr) = run(DeltaRuleMode::Recurrent);
    assert!(rel_err(&hc, &hr) < 1e-5, "hidden {:.2e}", rel_err(&hc, &hr));
    assert!(rel_err(&lc, &lr) < 1e-5, "readout {:.2e}", rel_err(&lc, &lr));
}

#[test]
fn extending_forks_of_a_prefix_equals_full_forwards() {
    let m = tiny(SynthDtype::Bf16, 22);
    let tok = QwenTokenizer::from_model_dir(&m.model).unwrap();
    let model = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let images = [load_image("wide.png"), load_image("tall.png")];
    let refs: Vec<&PatchedImage> = images.iter().collect();
    let full = prompt_ids(&tok, 2, &format!("{TEXT} Question: "));
    // Split where a request's shared prefix ends: after "Question: " minus the template tail.
    let tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n").unwrap();
    let prefix = &full[..full.len() - tail.len()];
    let suffix_texts = [
        "Which team handles it?\nA: infra\nB: facilities".to_string(),
        "x".to_string(),
        format!("{} and more text.", TEXT.repeat(2)), // longer than one 64-token chunk
    ];
    let suffixes: Vec<Vec<u32>> = suffix_texts
        .iter()
        .map(|s| {
            let mut ids = tok.encode(s).unwrap();
            ids.extend_from_slice(&tail);
            ids
        })
        .collect();
    assert!(suffixes[2].len() > 64);

    let (mut prefix_state, _, _) = model.prefill(prefix, &refs).unwrap();
    // Forks of a shared (frozen) prefix reference its KV rows instead of copying them.
    prefix_state.share(&model.backend).unwrap();
    let mut forks: Vec<_> = (0..suffixes.len()).map(|_| prefix_state.fork()).collect();
    let suffix_refs: Vec<&[u32]> = suffixes.iter().map(|s| s.as_slice()).collect();
    let batched = model.extend(&mut forks, &suffix_refs).unwrap();
    let batched = model.backend.download(&batched).unwrap();
    let d = model.hidden_size();
    for (i, s) in suffixes.iter().enumerate() {
        let mut ids = prefix.to_vec();
        ids.extend_from_slice(s);
        let (_, h, _) = model.prefill(&ids, &refs).unwrap();
        let h = model.backend.download(&h).unwrap();
        let e = rel_err(&batched[i * d..(i + 1) * d], &h);
        assert!(e < 1e-5, "suffix {i}: extend vs full forward {e:.2e}");
        // One at a time from a fresh fork gives the same as the batch.
        let mut one = vec![prefix_state.fork()];
        let h1 = model.backend.download(&model.extend(&mut one, &[s.as_slice()]).unwrap()).unwrap();
        assert!(rel_err(&h1, &h) < 1e-5);
        assert_eq!(one[0].tokens, prefix_state.tokens + s.len());
    }
    // The prefix state itself was not touched by its forks.
    let mut again = vec![prefix_state.fork()];
    let h_again = model.backend.download(&model.extend(&mut again, &[suffix_refs[0]]).unwrap()).unwrap();
    assert!(rel_err(&h_again, &batched[..d]) < 1e-6);
    // A fork can be extended twice: prefix + a + b equals prefix + (a ++ b).
    let mut two = vec![prefix_state.fork()];
    let a = tok.encode("Which team").unwrap();
    let b = &suffixes[0][a.len()..];
    assert_eq!(&suffixes[0][..a.len()], &a[..]);
    model.extend(&mut two, &[&a]).unwrap();
    let h2 = model.backend.download(&model.extend(&mut two, &[b]).unwrap()).unwrap();
    assert!(rel_err(&h2, &batched[..d]) < 1e-5);
}

#[test]
fn prefix_and_forks_in_one_forward_equal_prefill_then_extend() {
    let m = tiny(SynthDtype::Bf16, 23);
    let tok = QwenTokenizer::from_model_dir(&m.model).unwrap();
    let model = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let images = [load_image("wide.png")];
    let refs: Vec<&PatchedImage> = images.iter().collect();
    let prefix = prompt_ids(&tok, 1, &TEXT.repeat(2));
    assert!(prefix.len() > 64, "the prefix spans more than one chunk");
    let suffixes: Vec<Vec<u32>> =
        ["A: infra", "x", &TEXT.repeat(2)].iter().map(|s| tok.encode(s).unwrap()).collect();
    let suffix_refs: Vec<&[u32]> = suffixes.iter().map(|s| s.as_slice()).collect();
    let d = model.hidden_size();

    // Reference: prefill, share, fork, extend.
    let (mut p, hp, layout) = model.prefill(&prefix, &refs).unwrap();
    p.share(&model.backend).unwrap();
    let mut forks: Vec<_> = suffixes.iter().map(|_| p.fork()).collect();
    let he = model.backend.download(&model.extend(&mut forks, &suffix_refs).unwrap()).unwrap();
    let hp = model.backend.download(&hp).unwrap();

    let feats = model.encode_images(&refs).unwrap();
    let (states, h) = model.prefill_extend(&layout, &feats, &suffix_refs).unwrap();
    let h = model.backend.download(&h).unwrap();
    assert_eq!(h.len(), (1 + suffixes.len()) * d);
    assert!(rel_err(&h[..d], &hp) < 1e-6, "prefix row {:.2e}", rel_err(&h[..d], &hp));
    assert!(rel_err(&h[d..], &he) < 1e-6, "suffix rows {:.2e}", rel_err(&h[d..], &he));
    // Bitwise, in fact: every row's arithmetic is the same (batch-invariant GEMMs, the same
    // key/value parts in attention, the same delta-rule chunks).
    assert!(
        same_bits(&h[..d], &hp) && same_bits(&h[d..], &he),
        "one forward vs prefill then extend: other bits"
    );
    assert_eq!(states[0].tokens, p.tokens);
    for (i, s) in suffixes.iter().enumerate() {
        assert_eq!(states[1 + i].tokens, p.tokens + s.len());
        assert_eq!(states[1 + i].next_pos, forks[i].next_pos);
    }
    // The states continue like the reference's: one more token on each.
    let more = tok.encode(" B: facilities").unwrap();
    let mut tails = states;
    let mut ref_tails: Vec<_> = std::iter::once(p.fork()).chain(forks).collect();
    let all: Vec<&[u32]> = tails.iter().map(|_| more.as_slice()).collect();
    let a = model.backend.download(&model.extend(&mut tails, &all).unwrap()).unwrap();
    let b = model.backend.download(&model.extend(&mut ref_tails, &all).unwrap()).unwrap();
    assert!(rel_err(&a, &b) < 1e-6, "continued states {:.2e}", rel_err(&a, &b));
}

#[test]
fn a_tree_forward_rejects_bad_parents() {
    let m = tiny(SynthDtype::Bf16, 24);
    let model = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let l0 = model.layout(&[1, 2, 3], &[], 0).unwrap();
    let l1 = model.layout(&[4, 5], &[], l0.next_pos).unwrap();
    let off = model.layout(&[4, 5], &[], 0).unwrap();
    let run = |segs: Vec<imajev_serve::engine::Segment<CpuBackend>>| {
        let mut states: Vec<_> = segs.iter().map(|_| model.new_state().unwrap()).collect();
        let mut refs: Vec<_> = states.iter_mut().collect();
        model.forward(&segs, &mut refs).map(|_| ()).unwrap_err().to_string()
    };
    use imajev_serve::engine::Segment;
    let e = run(vec![
        Segment { layout: &l1, images: &[], parent: Some(1) },
        Segment { layout: &l0, images: &[], parent: None },
    ]);
    assert!(e.contains("does not come before"), "{e}");
    let e = run(vec![
        Segment { layout: &l0, images: &[], parent: None },
        Segment { layout: &off, images: &[], parent: Some(0) },
    ]);
    assert!(e.contains("does not start where its parent"), "{e}");
}

/// A read-out-only forward (`forward_readout`, `extend_readout`) returns the same rows bit for bit
/// as `forward`/`extend`, finishes the states that the forward continues itself (a prefix, a
/// question's shared tokens) exactly as `forward` does, and marks the others spent: continuing
/// one is an error, not a silently wrong answer.
#[test]
fn readout_forwards_skip_only_the_states_nothing_continues() {
    use imajev_serve::engine::Segment;
    let m = tiny(SynthDtype::Bf16, 25);
    let tok = QwenTokenizer::from_model_dir(&m.model).unwrap();
    let model = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let prefix = prompt_ids(&tok, 0, &TEXT.repeat(2));
    assert!(prefix.len() > 64, "the prefix spans more than one chunk");
    let enc = |s: &str| tok.encode(s).unwrap();
    let (common, pass_a, pass_b, pass_c, other) =
        (enc(" Which team?"), enc(" A: infra"), enc(&TEXT.repeat(2)), enc("x"), enc(" unrelated"));
    // Root 0; its shared question tokens 1 continued by passes 2 and 3; pass 4 straight off the
    // root; an independent sequence 5.
    let l0 = model.layout(&prefix, &[], 0).unwrap();
    let l1 = model.layout(&common, &[], l0.next_pos).unwrap();
    let l2 = model.layout(&pass_a, &[], l1.next_pos).unwrap();
    let l3 = model.layout(&pass_b, &[], l1.next_pos).unwrap();
    let l4 = model.layout(&pass_c, &[], l0.next_pos).unwrap();
    let l5 = model.layout(&other, &[], 0).unwrap();
    let segs = [
        Segment { layout: &l0, images: &[], parent: None },
        Segment { layout: &l1, images: &[], parent: Some(0) },
        Segment { layout: &l4, images: &[], parent: Some(0) },
        Segment { layout: &l5, images: &[], parent: None },
        Segment { layout: &l2, images: &[], parent: Some(1) },
        Segment { layout: &l3, images: &[], parent: Some(1) },
    ];
    let run = |readout: bool| {
        let mut states: Vec<_> = segs.iter().map(|_| model.new_state().unwrap()).collect();
        let mut refs: Vec<_> = states.iter_mut().collect();
        let h =
            if readout { model.forward_readout(&segs, &mut refs) } else { model.forward(&segs, &mut refs) };
        (model.backend.download(&h.unwrap()).unwrap(), states)
    };
    let (h_all, mut s_all) = run(false);
    let (h_read, mut s_read) = run(true);
    assert!(same_bits(&h_all, &h_read), "read-out rows differ from the full forward's");
    let spent: Vec<bool> = s_read.iter().map(|s| s.is_spent()).collect();
    assert_eq!(
        spent,
        [false, false, true, true, true, true],
        "only the root and the shared tokens stay usable"
    );
    assert!(s_all.iter().all(|s| !s.is_spent()));
    // The kept states continue exactly like the full forward's.
    let more = enc(" B: facilities");
    for j in [0, 1] {
        let a = model
            .backend
            .download(&model.extend(std::slice::from_mut(&mut s_all[j]), &[&more]).unwrap())
            .unwrap();
        let b = model
            .backend
            .download(&model.extend(std::slice::from_mut(&mut s_read[j]), &[&more]).unwrap())
            .unwrap();
        assert!(same_bits(&a, &b), "state {j} continues differently after the read-out forward");
    }
    // A spent state cannot be continued (as a root: a child's state is replaced by its parent's).
    for s in &mut s_read[2..] {
        let e = model.extend(std::slice::from_mut(s), &[&more]).unwrap_err().to_string();
        assert!(e.contains("left unfinished"), "{e}");
    }
    // extend_readout: the same rows as extend, every state spent.
    let (mut p, _, _) = model.prefill(&prefix, &[]).unwrap();
    p.share(&model.backend).unwrap();
    let suffixes: [&[u32]; 3] = [&pass_a, &pass_b, &pass_c];
    let mut full: Vec<_> = suffixes.iter().map(|_| p.fork()).collect();
    let mut read: Vec<_> = suffixes.iter().map(|_| p.fork()).collect();
    let a = model.backend.download(&model.extend(&mut full, &suffixes).unwrap()).unwrap();
    let b = model.backend.download(&model.extend_readout(&mut read, &suffixes).unwrap()).unwrap();
    assert!(same_bits(&a, &b), "extend_readout rows differ from extend's");
    assert!(read.iter().all(|s| s.is_spent()) && full.iter().all(|s| !s.is_spent()) && !p.is_spent());
}

/// The vision tower keeps the rotary tables of the last image set on the device (they depend only
/// on the patch grids): features of an image are the same bits whether its tables were just made,
/// kept from the request before, or made again after images of other sizes replaced them.
#[test]
fn vision_features_do_not_depend_on_kept_rotary_tables() {
    let m = tiny(SynthDtype::F32, 25);
    let model = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let (wide, tall) = (load_image("wide.png"), load_image("tall.png"));
    assert_ne!(wide.grid_thw, tall.grid_thw, "two sizes, so the tables are replaced");
    let features = |imgs: &[&PatchedImage]| -> Vec<Vec<f32>> {
        let feats = model.encode_images(imgs).unwrap();
        feats.iter().map(|f| model.backend.download(f).unwrap()).collect()
    };
    let first = features(&[&wide]);
    let kept = features(&[&wide]);
    let other = features(&[&tall]);
    let again = features(&[&wide]);
    let same =
        |a: &[Vec<f32>], b: &[Vec<f32>]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_bits(x, y));
    assert!(!first[0].is_empty() && !other[0].is_empty());
    assert!(same(&first, &kept), "tables kept from the request before: other bits");
    assert!(same(&first, &again), "tables made again after another size: other bits");
    // And the tall image's own tables are its own: alone after the wide one as in a fresh model.
    let fresh = Qwen35::load(CpuBackend::default(), &m.model, Some(&m.adapter)).unwrap();
    let feats = fresh.encode_images(&[&tall]).unwrap();
    let alone: Vec<Vec<f32>> = feats.iter().map(|f| fresh.backend.download(f).unwrap()).collect();
    assert!(same(&other, &alone), "tables replaced after another size: other bits than a fresh model's");
}
