//! The command-line contracts other tools rely on: `synth`, `forward`, `tokenize`.

mod common;

use common::{fixtures, rel_err};
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_imajev-serve"))
}

fn sha_dir(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn synth_is_deterministic_and_forward_prints_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let run_synth = |out: &str, seed: &str| {
        let st = bin()
            .args(["synth", "--config", "tiny", "--dtype", "fp8", "--seed", seed, "--out"])
            .arg(dir.path().join(out))
            .arg("--adapter-out")
            .arg(dir.path().join(format!("{out}-adapter")))
            .args(["--lora-rank", "2", "--lora-alpha", "4", "--readout-rows", "5"])
            .status()
            .unwrap();
        assert!(st.success());
    };
    run_synth("a", "5");
    run_synth("b", "5");
    run_synth("c", "6");
    assert_eq!(sha_dir(&dir.path().join("a")), sha_dir(&dir.path().join("b")), "same seed, same bytes");
    assert_eq!(sha_dir(&dir.path().join("a-adapter")), sha_dir(&dir.path().join("b-adapter")));
    assert_ne!(sha_dir(&dir.path().join("a")), sha_dir(&dir.path().join("c")));
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["weight_block_size"], serde_json::json!([128, 128]));

    // forward: one image, adapter → input_ids (expanded), hidden_last, readout_logits.
    let input = dir.path().join("in.json");
    let img = fixtures().join("golden/images/wide.png");
    std::fs::write(
        &input,
        serde_json::json!({
            "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Is it broken?<|im_end|>\n",
            "images": [img]
        })
        .to_string(),
    )
    .unwrap();
    let out_path = dir.path().join("out.json");
    let st = bin()
        .arg("forward")
        .arg("--model")
        .arg(dir.path().join("a"))
        .arg("--adapter")
        .arg(dir.path().join("a-adapter"))
        .arg("--input")
        .arg(&input)
        .arg("--out")
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(st.success());
    let out: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let ids: Vec<u64> = out["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let pads = ids.iter().filter(|&&t| t == 248056).count();
    assert_eq!(pads, 78, "150×61 → 192×416 → 6×13 merged tokens");
    assert_eq!(out["hidden_last"].as_array().unwrap().len(), 64);
    assert_eq!(out["readout_logits"].as_array().unwrap().len(), 5);

    // Without --out it prints the same JSON on stdout; without --adapter there are no logits.
    let o = bin()
        .arg("forward")
        .arg("--model")
        .arg(dir.path().join("a"))
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    assert!(o.status.success());
    let printed: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(printed.get("readout_logits").is_none());
    let h1: Vec<f32> =
        out["hidden_last"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    let h2: Vec<f32> =
        printed["hidden_last"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert!(rel_err(&h1, &h2) > 1e-4, "the adapter must change the hidden state");

    // Errors are reported, not panics: an image count that does not match the prompt.
    std::fs::write(&input, serde_json::json!({"prompt": "no image here", "images": [img]}).to_string())
        .unwrap();
    let o = bin()
        .arg("forward")
        .arg("--model")
        .arg(dir.path().join("a"))
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("<|image_pad|>"), "{err}");
}

#[test]
fn tokenize_reads_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = bin()
        .args(["tokenize", "--model"])
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all("<|im_start|>user\nHello! 毕老师！".as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ids: Vec<u32> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids, vec![248045, 846, 198, 9419, 0, 220, 97169, 97621, 6115]);
}

/// `forward --dump-layers DIR` writes what tools/first_divergence.py reads: f32
/// `hidden_states.{0..=layers}` `[tokens, hidden]`, `final_norm` (the final norm of the last
/// one, whose last row is `hidden_last`), i64 `input_ids` with the image pads expanded (the ids
/// `forward` printed), and `layer_types` in the metadata.
#[test]
fn forward_dump_layers_writes_what_first_divergence_reads() {
    use safetensors::{Dtype, SafeTensors};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let st = bin()
        .args(["synth", "--config", "tiny", "--dtype", "bf16", "--profile", "trained-like", "--out"])
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success());
    let input = dir.path().join("in.json");
    let prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Is it broken?<|im_end|>\n";
    let img = fixtures().join("golden/images/small.png");
    std::fs::write(&input, serde_json::json!({"prompt": prompt, "images": [img]}).to_string()).unwrap();
    let (out_path, dump) = (dir.path().join("out.json"), dir.path().join("dump"));
    let st = bin()
        .arg("forward")
        .arg("--model")
        .arg(&model)
        .arg("--input")
        .arg(&input)
        .arg("--out")
        .arg(&out_path)
        .arg("--dump-layers")
        .arg(&dump)
        .status()
        .unwrap();
    assert!(st.success());
    let out: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let ids: Vec<i64> = out["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let hidden_last: Vec<f32> =
        out["hidden_last"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let kinds: Vec<&str> =
        cfg["text_config"]["layer_types"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let h = cfg["text_config"]["hidden_size"].as_u64().unwrap() as usize;

    let bytes = std::fs::read(dump.join("hidden_states.safetensors")).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["layer_types"], kinds.join(","));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| {
        let t = st.tensor(name).unwrap_or_else(|_| panic!("the dump has {name}"));
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        assert_eq!(t.shape(), [ids.len(), h], "{name}");
        t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<f32>>()
    };
    let hidden: Vec<Vec<f32>> = (0..=kinds.len()).map(|i| f32s(&format!("hidden_states.{i}"))).collect();
    assert!(st.tensor(&format!("hidden_states.{}", kinds.len() + 1)).is_err(), "one entry per boundary");
    let t = st.tensor("input_ids").unwrap();
    assert_eq!((t.dtype(), t.shape()), (Dtype::I64, &[ids.len()][..]));
    let dumped: Vec<i64> =
        t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(dumped, ids, "the ids forward printed, image pads expanded");
    assert!(ids.iter().filter(|&&t| t == 248056).count() > 0);

    // final_norm is x/rms(x)·(1 + w) of the last boundary, and its last row is hidden_last.
    let store = imajev_serve::weights::WeightStore::open_model_dir(&model).unwrap();
    let w = store.get("model.language_model.norm.weight").unwrap().to_f32().unwrap();
    let fin = f32s("final_norm");
    let last = &hidden[kinds.len()];
    for (r, (x, y)) in last.chunks(h).zip(fin.chunks(h)).enumerate() {
        let rms = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / h as f64 + 1e-6).sqrt();
        let want: Vec<f32> = x.iter().zip(&w).map(|(v, w)| (*v as f64 / rms) as f32 * (1.0 + w)).collect();
        assert!(rel_err(y, &want) < 1e-4, "row {r}: final_norm is not the norm of the last layer");
    }
    assert!(rel_err(&fin[fin.len() - h..], &hidden_last) < 1e-6, "the last row of final_norm is hidden_last");
    // Every layer changes the residual stream, and layer 0's input is the embedding.
    for i in 1..hidden.len() {
        assert!(hidden[i] != hidden[i - 1], "layer {} left the stream unchanged", i - 1);
    }
    let emb = store.get("model.language_model.embed_tokens.weight").unwrap().to_f32().unwrap();
    let t0 = ids[0] as usize;
    assert_eq!(&hidden[0][..h], &emb[t0 * h..(t0 + 1) * h], "hidden_states.0 is the embedding");
}
