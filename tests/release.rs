//! `verify` on a synthetic release (the tiny Qwen3.5 of `synth`, described by
//! tests/fixtures/release/tiny-manifest.json): unpinned it passes on content; pinned it passes;
//! then one byte flipped, a tensor dropped, the readout swapped, the codebook edited, a LoRA pair
//! removed, a lock from another revision — each refused, naming the file.

mod common;

use common::fixtures;
use imajev_serve::release::{pin, verify, Lock, Manifest, ReleaseDirs, Report, Status};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_imajev-serve"))
}

/// A synthetic release under `root`: `model/`, `adapter/` (+ the calibration fixture).
fn synth_release(root: &Path, seed: u64, readout_rows: usize) -> ReleaseDirs {
    let dirs = ReleaseDirs { model: root.join("model"), adapter: root.join("adapter") };
    let st = bin()
        .args(["synth", "--config", "tiny", "--seed", &seed.to_string(), "--out"])
        .arg(&dirs.model)
        .arg("--adapter-out")
        .arg(&dirs.adapter)
        .args(["--lora-rank", "8", "--lora-alpha", "16", "--readout-rows", &readout_rows.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::copy(
        fixtures().join("release/calibration-rot4.json"),
        dirs.adapter.join("calibration-rot4.json"),
    )
    .unwrap();
    dirs
}

fn tiny_manifest() -> Manifest {
    Manifest::load(&fixtures().join("release/tiny-manifest.json")).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// The files of the failed rows, and the failed checks.
fn refused(report: &Report) -> (BTreeSet<String>, BTreeSet<&'static str>) {
    assert!(!report.passed(), "expected a refusal:\n{report}");
    (report.failures().map(|r| r.file.clone()).collect(), report.failures().map(|r| r.check).collect())
}

fn detail<'a>(report: &'a Report, check: &str) -> &'a str {
    &report
        .failures()
        .find(|r| r.check == check)
        .unwrap_or_else(|| panic!("no failed {check} row:\n{report}"))
        .detail
}

fn set<const N: usize>(items: [&str; N]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Rewrites a safetensors file without `drop`.
fn drop_tensor(path: &Path, drop: &str) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| n != drop).collect();
    assert_eq!(kept.len() + 1, st.len(), "{drop} was in the file");
    let out = safetensors::serialize(kept, None).unwrap();
    std::fs::write(path, out).unwrap();
}

#[test]
fn verify_passes_a_pinned_synth_release_and_refuses_each_tampering_by_file() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_manifest();
    let pristine = synth_release(&tmp.path().join("pristine"), 7, 256);
    let dirs = ReleaseDirs { model: tmp.path().join("work/model"), adapter: tmp.path().join("work/adapter") };
    let reset = || {
        for (from, to) in [(&pristine.model, &dirs.model), (&pristine.adapter, &dirs.adapter)] {
            let _ = std::fs::remove_dir_all(to);
            copy_dir(from, to);
        }
    };
    reset();

    // Without a lock: every content check passes, every file is listed unpinned.
    let report = verify(&m, &dirs, None);
    assert!(report.passed(), "{report}");
    let unpinned: Vec<&str> =
        report.rows.iter().filter(|r| r.status == Status::NotPinned).map(|r| r.file.as_str()).collect();
    assert_eq!(unpinned.len(), 3 + 1 + 3 + 2, "{report}");
    assert!(report.to_string().contains("file hashes NOT checked"), "{report}");
    for check in ["config", "tensors", "lora", "codebook", "calibration"] {
        assert!(report.rows.iter().any(|r| r.check == check && r.status == Status::Ok), "{check}:\n{report}");
    }

    // Pin, then verify against the lock.
    let (pinned, lock) = pin(&m, &dirs);
    let lock = lock.unwrap_or_else(|| panic!("pin refused:\n{pinned}"));
    let lock_path = tmp.path().join("release.lock.json");
    lock.write(&lock_path).unwrap();
    let lock = Lock::read(&lock_path).unwrap();
    assert_eq!(lock.adapter.files.len(), 5);
    assert_eq!(lock.base.files.len(), 4);
    let check = |what: &str| {
        let r = verify(&m, &dirs, Some((&lock_path, &lock)));
        eprintln!("== {what}\n{r}");
        r
    };
    let report = check("pristine");
    assert!(report.passed() && !report.unpinned(), "{report}");
    assert!(report.to_string().ends_with("checks passed\n"), "{report}");

    // One byte flipped in the LoRA weights: only its hash differs.
    let lora = dirs.adapter.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&lora).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&lora, bytes).unwrap();
    let report = check("one byte flipped");
    assert_eq!(refused(&report), (set(["adapter/adapter_model.safetensors"]), ["sha256"].into()));
    assert!(detail(&report, "sha256").contains("but the lock has"), "{report}");
    assert!(report.to_string().lines().last().unwrap().contains("REFUSED: 1 of"), "{report}");
    reset();

    // A tensor dropped from the base: its hash and its tensor table.
    drop_tensor(&dirs.model.join("model.safetensors"), "model.language_model.layers.1.linear_attn.A_log");
    let report = check("tensor dropped");
    assert_eq!(refused(&report), (set(["model/model.safetensors"]), ["sha256", "tensors"].into()));
    assert!(
        detail(&report, "tensors").contains("model.language_model.layers.1.linear_attn.A_log is missing"),
        "{report}"
    );
    let (pin_report, none) = pin(&m, &dirs);
    assert!(none.is_none(), "pin must refuse a release that fails its content checks:\n{pin_report}");
    reset();

    // The readout swapped for another of the same shape (another seed): only the hash tells.
    let other = synth_release(&tmp.path().join("other"), 8, 256);
    std::fs::copy(
        other.adapter.join("decision_readout.safetensors"),
        dirs.adapter.join("decision_readout.safetensors"),
    )
    .unwrap();
    let report = check("readout swapped, same shape");
    assert_eq!(refused(&report), (set(["adapter/decision_readout.safetensors"]), ["sha256"].into()));
    reset();

    // The readout swapped for a 255-row one: hash, tensors and codebook all name it.
    let short = synth_release(&tmp.path().join("short"), 7, 255);
    std::fs::copy(
        short.adapter.join("decision_readout.safetensors"),
        dirs.adapter.join("decision_readout.safetensors"),
    )
    .unwrap();
    let report = check("readout swapped, 255 rows");
    let (files, checks) = refused(&report);
    assert_eq!(checks, ["sha256", "tensors", "codebook"].into());
    assert!(files.contains("adapter/decision_readout.safetensors"), "{report}");
    assert!(detail(&report, "tensors")
        .contains("weight in decision_readout.safetensors has shape [255, 64], the manifest says [256, 64]"));
    assert!(detail(&report, "codebook").contains("the readout has 255 rows"), "{report}");
    reset();

    // The codebook edited: one token id changed.
    let cb_path = dirs.adapter.join("decision_readout.json");
    let mut cb: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cb_path).unwrap()).unwrap();
    cb["codes"][3]["token_id"] = serde_json::json!(cb["codes"][4]["token_id"].as_u64().unwrap());
    std::fs::write(&cb_path, serde_json::to_string_pretty(&cb).unwrap()).unwrap();
    let report = check("codebook edited");
    assert_eq!(refused(&report), (set(["adapter/decision_readout.json"]), ["sha256", "codebook"].into()));
    assert!(detail(&report, "codebook").contains("code #3"), "{report}");
    reset();

    // A LoRA pair removed: the tensor table and the coverage both say which module.
    let module = "model.language_model.layers.2.mlp.down_proj";
    for part in ["lora_A", "lora_B"] {
        drop_tensor(
            &dirs.adapter.join("adapter_model.safetensors"),
            &format!("base_model.model.{module}.{part}.weight"),
        );
    }
    let report = check("LoRA pair removed");
    assert_eq!(
        refused(&report),
        (set(["adapter/adapter_model.safetensors"]), ["sha256", "tensors", "lora"].into())
    );
    assert!(
        detail(&report, "lora").contains(&format!("{module} is a target the LoRA does not cover")),
        "{report}"
    );
    reset();

    // The calibration file of another fit.
    let cal_path = dirs.adapter.join("calibration-rot4.json");
    let text =
        std::fs::read_to_string(&cal_path).unwrap().replace("\"boolean:2\": 1.25", "\"boolean:2\": 1.5");
    std::fs::write(&cal_path, text).unwrap();
    let report = check("calibration edited");
    assert_eq!(refused(&report), (set(["adapter/calibration-rot4.json"]), ["sha256", "calibration"].into()));
    assert!(detail(&report, "calibration").contains("bucket boolean:2 has T = 1.5"), "{report}");
    reset();

    // A lock pinned from another adapter revision is refused as a whole.
    let mut stale = lock.clone();
    stale.adapter.revision = "2".repeat(40);
    let report = verify(&m, &dirs, Some((&lock_path, &stale)));
    let (files, checks) = refused(&report);
    assert_eq!(checks, ["lock"].into());
    assert_eq!(files, [lock_path.display().to_string()].into());

    // A missing file is named as missing.
    std::fs::remove_file(dirs.model.join("preprocessor_config.json")).unwrap();
    let report = check("file missing");
    assert_eq!(refused(&report), (set(["model/preprocessor_config.json"]), ["sha256"].into()));
    assert!(detail(&report, "sha256").starts_with("missing"), "{report}");
}

#[test]
fn a_changed_architecture_is_refused_by_the_config_check() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = synth_release(tmp.path(), 3, 256);
    let path = dirs.model.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["text_config"]["layer_types"][3] = "linear_attention".into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let report = verify(&tiny_manifest(), &dirs, None);
    let (files, checks) = refused(&report);
    assert_eq!((files, checks), (set(["model/config.json"]), ["config"].into()));
    assert!(
        detail(&report, "config").starts_with("text_config.layer_types is [\"linear_attention\""),
        "{report}"
    );
}
