//! `synth --profile trained-like` writes what src/synth/profile.rs says it writes: outlier and
//! massive channels of the stated magnitudes where it says, log-normal norm gains around 1,
//! DeltaNet gates in the Mamba-2 ranges, residual branches scaled by 1/√(2·layers), LoRA at the
//! stated share of the base weight, the same bytes for the same seed, and the random profile
//! unchanged as the default. Tiny preset, CPU: a few seconds.

use imajev_serve::synth::profile::{
    ResidualOutliers, DT_RANGE, LORA_RATIO, MASSIVE_SCALE, MASSIVE_TOKENS, NORM_LOG_STD, OUTLIER_SCALE,
};
use imajev_serve::synth::{self, Layout, ModelOptions, Profile, SynthDtype};
use imajev_serve::weights::WeightStore;
use std::path::Path;

const SEED: u64 = 11;

fn write(dir: &Path, profile: Profile, seed: u64) -> WeightStore {
    let cfg = synth::preset("tiny").unwrap();
    let opts = ModelOptions { dtype: SynthDtype::Bf16, seed, profile, layout: Layout::Flat };
    synth::write_model_with(&cfg, &opts, dir).unwrap();
    WeightStore::open_model_dir(dir).unwrap()
}

fn get(s: &WeightStore, name: &str) -> Vec<f32> {
    s.get(name).unwrap().to_f32().unwrap()
}

fn std(v: &[f32]) -> f64 {
    let m = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (*x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

fn median_abs(v: impl Iterator<Item = f32>) -> f32 {
    let mut a: Vec<f32> = v.map(f32::abs).collect();
    a.sort_by(f32::total_cmp);
    a[a.len() / 2]
}

#[test]
fn trained_like_has_the_stated_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), Profile::TrainedLike, SEED);
    let cfg = synth::preset("tiny").unwrap();
    let t = &cfg.text_config;
    let h = t.hidden_size;
    let p = "model.language_model.";

    // Outlier channels in every embedding row at OUTLIER_SCALE× the typical entry; massive
    // channels only in the rows of <|im_start|> and <|endoftext|>.
    let emb = get(&s, &format!("{p}embed_tokens.weight"));
    let chans = ResidualOutliers::new(h, SEED);
    let (outl, mass): (Vec<usize>, Vec<usize>) =
        (chans.outliers.iter().map(|c| c.0).collect(), chans.massive.iter().map(|c| c.0).collect());
    assert_eq!(outl.len(), 4);
    assert_eq!(mass.len(), 2);
    for token in [0usize, 1000, 151_000, 248_300] {
        let row = &emb[token * h..(token + 1) * h];
        let typical = median_abs((0..h).filter(|c| !outl.contains(c) && !mass.contains(c)).map(|c| row[c]));
        assert!(typical < 1.5, "token {token}: typical entry {typical}");
        for &c in &outl {
            let r = row[c].abs() / OUTLIER_SCALE;
            assert!(
                (0.75..1.25).contains(&r),
                "token {token} channel {c}: {} is not ~{OUTLIER_SCALE}",
                row[c]
            );
        }
        for &c in &mass {
            assert!(row[c].abs() < 5.0, "token {token}: massive channel {c} = {} outside its tokens", row[c]);
        }
    }
    for token in MASSIVE_TOKENS {
        let row = &emb[token as usize * h..(token as usize + 1) * h];
        for &c in &mass {
            let r = row[c].abs() / MASSIVE_SCALE;
            assert!(
                (0.99..1.01).contains(&r),
                "token {token} channel {c}: {} is not ~{MASSIVE_SCALE}",
                row[c]
            );
        }
    }

    // Norm gains: log-normal around 1 (zero-centred norms store gain − 1).
    let mut logs = Vec::new();
    for i in 0..t.num_hidden_layers {
        for n in ["input_layernorm", "post_attention_layernorm"] {
            logs.extend(get(&s, &format!("{p}layers.{i}.{n}.weight")).iter().map(|w| (1.0 + w).ln()));
        }
    }
    let sd = std(&logs);
    assert!(logs.iter().all(|l| l.is_finite()), "every gain 1 + w is positive");
    assert!((sd - NORM_LOG_STD as f64).abs() < 0.04, "log-gain std {sd:.3}, stated {NORM_LOG_STD}");

    // DeltaNet gates: A = exp(A_log) in [1, 16], Δt = softplus(dt_bias) in DT_RANGE (bf16-rounded).
    let kinds = t.layer_kinds().unwrap();
    let mut dts = Vec::new();
    for (i, _) in
        kinds.iter().enumerate().filter(|(_, k)| **k == imajev_serve::engine::LayerKind::LinearAttention)
    {
        for a in get(&s, &format!("{p}layers.{i}.linear_attn.A_log")) {
            assert!((-0.01..=16f32.ln() + 0.02).contains(&a), "layer {i}: A_log {a} outside ln [1, 16]");
        }
        for b in get(&s, &format!("{p}layers.{i}.linear_attn.dt_bias")) {
            let dt = (1.0 + b.exp()).ln();
            assert!(
                dt > DT_RANGE.0 * 0.98 && dt < DT_RANGE.1 * 1.02,
                "layer {i}: Δt {dt} outside {DT_RANGE:?}"
            );
            dts.push(dt);
        }
    }
    assert!(dts.len() >= 12);

    // Residual branches: down_proj std = 1/√in · 1/√(2·layers); gate_proj unscaled.
    let scale = 1.0 / ((2 * t.num_hidden_layers) as f64).sqrt();
    for i in 0..t.num_hidden_layers {
        let d = std(&get(&s, &format!("{p}layers.{i}.mlp.down_proj.weight")));
        let g = std(&get(&s, &format!("{p}layers.{i}.mlp.gate_proj.weight")));
        let want_d = scale / (t.intermediate_size as f64).sqrt();
        let want_g = 1.0 / (h as f64).sqrt();
        assert!((d / want_d - 1.0).abs() < 0.1, "layer {i}: down_proj std {d:.4}, want {want_d:.4}");
        assert!((g / want_g - 1.0).abs() < 0.1, "layer {i}: gate_proj std {g:.4}, want {want_g:.4}");
    }

    // LoRA: ‖B·A·α/r‖_F ≈ LORA_RATIO · ‖W‖_F.
    let adir = dir.path().join("adapter");
    synth::write_adapter_with(&cfg, 4, 8.0, 12, SEED, Profile::TrainedLike, SynthDtype::Bf16, &adir).unwrap();
    let a = WeightStore::open_files(&[adir.join("adapter_model.safetensors")]).unwrap();
    let m = format!("{p}layers.1.mlp.up_proj");
    let la = get(&a, &format!("base_model.model.{m}.lora_A.weight"));
    let lb = get(&a, &format!("base_model.model.{m}.lora_B.weight"));
    let (r, inp, out) = (4, h, t.intermediate_size);
    let mut frob = 0f64;
    for o in 0..out {
        for i in 0..inp {
            let v: f64 =
                (0..r).map(|k| lb[o * r + k] as f64 * la[k * inp + i] as f64).sum::<f64>() * 8.0 / 4.0;
            frob += v * v;
        }
    }
    let w = get(&s, &format!("{m}.weight"));
    let ratio = frob.sqrt() / w.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    assert!((ratio / LORA_RATIO as f64 - 1.0).abs() < 0.35, "LoRA ratio {ratio:.3}, stated {LORA_RATIO}");
}

#[test]
fn profiles_are_deterministic_and_random_stays_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = |sub: &str, profile, seed| {
        let d = dir.path().join(sub);
        write(&d, profile, seed);
        std::fs::read(d.join("model.safetensors")).unwrap()
    };
    let a = bytes("a", Profile::TrainedLike, 3);
    assert_eq!(a, bytes("b", Profile::TrainedLike, 3), "same seed, same bytes");
    assert_ne!(a, bytes("c", Profile::TrainedLike, 4), "the seed matters");
    let random = bytes("d", Profile::Random, 3);
    assert_ne!(a, random, "the profile matters");
    // `write_model` (what the tests use) is the random profile.
    let cfg = synth::preset("tiny").unwrap();
    synth::write_model(&cfg, SynthDtype::Bf16, 3, &dir.path().join("e")).unwrap();
    assert_eq!(random, std::fs::read(dir.path().join("e/model.safetensors")).unwrap());
    // The random profile has no outlier channels.
    let s = WeightStore::open_model_dir(&dir.path().join("e")).unwrap();
    let emb = get(&s, "model.language_model.embed_tokens.weight");
    let h = cfg.text_config.hidden_size;
    let row = &emb[1000 * h..1001 * h];
    assert!(row.iter().all(|v| v.abs() < 8.0), "random profile: no outliers");
}
