//! The published release's file layouts load as they are (issue 12, point 5): `synth --layout
//! release` writes the Qwen3.5-4B file set (shards + `model.safetensors.index.json`, `mtp.*`,
//! `generation_config.json`, the release's config keys) and, with `--dtype fp8`, Qwen's block-FP8
//! pack (E4M3 weights with f32 `weight_scale_inv`, `modules_to_not_convert`, vision tower BF16).
//! The loader must find every tensor through the index, dequantise the FP8 blocks with their
//! scales, ignore `mtp.*`, and give the same forward as the flat single-file layout of the same
//! values: bitwise (the CPU engine is deterministic and the stored values are identical), and
//! the FP8 pack within FP8's rounding of the BF16 checkpoint.
//!
//! Tiny preset, one image and a text prompt, CPU: about 10 s of test time on 2 cores.

mod common;

use common::{fixtures, rel_err};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::Backend;
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig};
use imajev_serve::synth::{self, Layout, ModelOptions, Profile, SynthDtype};
use imajev_serve::tokenizer::QwenTokenizer;
use imajev_serve::weights::{StoredDtype, WeightStore};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const SEED: u64 = 5;

fn write(dir: &Path, name: &str, dtype: SynthDtype, layout: Layout) -> PathBuf {
    let cfg = synth::preset("tiny").unwrap();
    let out = dir.join(name);
    let opts = ModelOptions { dtype, seed: SEED, profile: Profile::TrainedLike, layout };
    synth::write_model_with(&cfg, &opts, &out).unwrap();
    out
}

fn adapter(dir: &Path) -> PathBuf {
    let cfg = synth::preset("tiny").unwrap();
    let out = dir.join("adapter");
    synth::write_adapter_with(&cfg, 4, 8.0, 12, SEED, Profile::TrainedLike, SynthDtype::Bf16, &out).unwrap();
    out
}

/// The decoder's last hidden state (every token) and the readout logits of the last token, for
/// a prompt with one image.
fn forward(model: &Path, adapter: &Path) -> (Vec<f32>, Vec<f32>) {
    let tok = QwenTokenizer::from_model_dir(model).unwrap();
    let ids = tok
        .encode(
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Which team owns the printer? \
             A: infra\nB: facilities\nC: unknown<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        )
        .unwrap();
    let bytes = std::fs::read(fixtures().join("golden/images/small.png")).unwrap();
    let img = load_and_preprocess(
        &bytes,
        &ImageLimits::default(),
        &ImageProcessorConfig::from_model_dir(model).unwrap(),
    )
    .unwrap()
    .1;
    let m = Qwen35::load(CpuBackend::default(), model, Some(adapter)).unwrap();
    let (_, h, _) = m.prefill(&ids, &[&img]).unwrap();
    (m.backend.download(&h).unwrap(), m.readout(&h).unwrap().remove(0))
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The release's file set: shards named as the release names them, an index that lists exactly
/// the tensors the shards hold, `mtp.*` among them, and the release's side files.
fn check_file_set(dir: &Path) -> WeightStore {
    let index = json(&dir.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let shards: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(shards.len() >= 2, "the release is sharded: {shards:?}");
    let n = shards.len();
    for (k, s) in shards.iter().enumerate() {
        assert_eq!(*s, format!("model-{:05}-of-{n:05}.safetensors", k + 1));
    }
    assert!(!dir.join("model.safetensors").exists(), "no flat file beside the shards");
    let files: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
    let store = WeightStore::open_files(&files).unwrap();
    let held: BTreeSet<&str> = store.names().collect();
    let listed: BTreeSet<&str> = map.keys().map(|k| k.as_str()).collect();
    assert_eq!(held, listed, "the index lists exactly the shards' tensors");
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();
    assert!(index["metadata"]["total_size"].as_u64().unwrap() < total, "total_size counts tensor bytes only");
    assert!(held.contains("mtp.fc.weight") && held.contains("mtp.layers.0.mlp.down_proj.weight"));
    for f in [
        "config.json",
        "generation_config.json",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ] {
        assert!(dir.join(f).exists(), "the release has {f}");
    }
    let gen = json(&dir.join("generation_config.json"));
    assert_eq!(gen["eos_token_id"], serde_json::json!([248046, 248044]));
    let cfg = json(&dir.join("config.json"));
    for key in
        ["mtp_num_hidden_layers", "layer_types", "mamba_ssm_dtype", "rope_parameters", "initializer_range"]
    {
        assert!(cfg["text_config"].get(key).is_some(), "text_config.{key} as the release has it");
    }
    store
}

#[test]
fn the_release_layouts_load_and_forward_as_the_flat_layout() {
    let dir = tempfile::tempdir().unwrap();
    let a = adapter(dir.path());
    let flat_bf16 = write(dir.path(), "flat-bf16", SynthDtype::Bf16, Layout::Flat);
    let rel_bf16 = write(dir.path(), "release-bf16", SynthDtype::Bf16, Layout::Release);
    let flat_fp8 = write(dir.path(), "flat-fp8", SynthDtype::Fp8, Layout::Flat);
    let rel_fp8 = write(dir.path(), "release-fp8", SynthDtype::Fp8, Layout::Release);

    // The BF16 release: its file set, and no FP8 anywhere.
    let store = check_file_set(&rel_bf16);
    assert!(store.names().all(|n| store.get(n).unwrap().dtype == StoredDtype::BF16));
    assert!(json(&rel_bf16.join("config.json")).get("quantization_config").is_none());

    // The FP8 pack: Qwen's quantization_config, E4M3 text projections each with an f32
    // [ceil(out/128), ceil(in/128)] weight_scale_inv, BF16 where the pack keeps BF16.
    let store = check_file_set(&rel_fp8);
    let q = &json(&rel_fp8.join("config.json"))["quantization_config"];
    assert_eq!((q["quant_method"].as_str(), q["fmt"].as_str()), (Some("fp8"), Some("e4m3")));
    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
    let skip: Vec<&str> =
        q["modules_to_not_convert"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for m in [
        "model.visual.blocks.0.attn.qkv",
        "model.visual.merger.linear_fc2",
        "model.language_model.layers.0.linear_attn.in_proj_a",
        "model.language_model.layers.0.linear_attn.in_proj_b",
    ] {
        assert!(skip.contains(&m), "modules_to_not_convert lists {m} (multimodal paths)");
    }
    let mut fp8 = 0;
    for name in store.names() {
        let t = store.get(name).unwrap();
        if t.dtype == StoredDtype::F8E4M3 {
            fp8 += 1;
            let module = name.strip_suffix(".weight").unwrap();
            assert!(!skip.contains(&module), "{name} is FP8 but listed as not converted");
            assert!(!name.starts_with("model.visual."), "{name}: the pack keeps the vision tower BF16");
            let s = t.scale_inv.expect("FP8 weights carry their scale");
            assert_eq!(s.shape, [t.shape[0].div_ceil(128), t.shape[1].div_ceil(128)], "{name}");
        } else if name.ends_with("weight_scale_inv") {
            let w = name.replace("weight_scale_inv", "weight");
            assert_eq!(store.get(&w).unwrap().dtype, StoredDtype::F8E4M3, "{name} belongs to an FP8 weight");
        } else {
            assert_eq!(t.dtype, StoredDtype::BF16, "{name}");
        }
    }
    assert!(
        store
            .names()
            .any(|n| n.starts_with("mtp.layers.0.") && store.get(n).unwrap().dtype == StoredDtype::F8E4M3),
        "MTP kept in FP8"
    );
    assert!(fp8 >= 4 * 3 + 4, "every text projection is FP8 ({fp8})");

    // The forwards.
    let (h_flat, l_flat) = forward(&flat_bf16, &a);
    let (h_rel, l_rel) = forward(&rel_bf16, &a);
    assert!(
        h_flat == h_rel && l_flat == l_rel,
        "BF16: the release layout gives the flat layout's forward, bitwise"
    );
    let (h_flat8, l_flat8) = forward(&flat_fp8, &a);
    let (h_rel8, l_rel8) = forward(&rel_fp8, &a);
    assert!(
        h_flat8 == h_rel8 && l_flat8 == l_rel8,
        "FP8: the release pack gives the flat FP8 forward, bitwise"
    );
    // The pack's weights are the BF16 values through E4M3 128×128 blocks: the forward moves by
    // FP8's rounding (E4M3 has 3 mantissa bits: ≤ 6.25% per weight, far less on average), not
    // by a misread scale (a transposed or missing scale grid moves it by O(1)).
    let (eh, el) = (rel_err(&h_rel8, &h_rel), rel_err(&l_rel8, &l_rel));
    eprintln!("FP8 pack vs BF16: hidden {eh:.3e}, readout {el:.3e} (bound 0.08)");
    assert!(eh < 0.08 && el < 0.08, "FP8 pack vs BF16: hidden {eh:.3e}, readout {el:.3e}");
    assert!(eh > 0.0, "the FP8 pack is quantised");
}
