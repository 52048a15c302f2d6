//! The demo bundle `serve --demo` runs: the tiny synthetic Qwen3.5 (the real
//! tokenizer, random weights) and an imajev-style adapter, written to a temporary folder, so the
//! whole API can be tried on a fresh machine with nothing downloaded. Its answers are
//! meaningless, and the server says so when it starts.

use crate::decision::Codebook;
use crate::release::Manifest;
use crate::synth::{self, SynthDtype};
use crate::tokenizer::QwenTokenizer;
use anyhow::Result;
use std::path::PathBuf;

/// The demo bundle: the tiny synthetic Qwen3.5 (real tokenizer, random weights) and an
/// imajev-style adapter with a 256-code readout, written to a temporary folder.
pub fn demo_bundle() -> Result<(tempfile::TempDir, PathBuf, PathBuf)> {
    let dir = tempfile::Builder::new().prefix("imajev-demo-").tempdir()?;
    let cfg = synth::preset("tiny")?;
    let model = dir.path().join("model");
    let adapter = dir.path().join("adapter");
    synth::write_model(&cfg, SynthDtype::Bf16, 20261202, &model)?;
    synth::write_adapter(&cfg, 8, 16.0, 256, 20261202, &adapter)?;
    Codebook::derive(&QwenTokenizer::builtin()?, 256)?.write(&adapter.join("decision_readout.json"))?;
    Ok((dir, model, adapter))
}

/// The name the demo answers under.
pub const MODEL_NAME: &str = "imajev-demo";

/// `GET /v1/models` → `models[].description` of the demo.
pub const DESCRIPTION: &str =
    "Demo: a tiny random-weight Qwen3.5 with the real tokenizer; answers are meaningless";

/// Printed on stderr when the demo starts (text logs); names the release to serve instead.
fn notice(release: &Manifest) -> String {
    let rule = "=".repeat(78);
    format!(
        "\n{rule}\n  DEMO MODE (--demo): serving a tiny RANDOM-WEIGHT Qwen3.5 with the real\n  \
         tokenizer. The API is real; the ANSWERS ARE MEANINGLESS. To serve decisions,\n  \
         give --model ({}) and --adapter ({}) instead.\n{rule}",
        release.base.repo, release.adapter.repo
    )
}

/// Says loudly that the answers are meaningless: a banner on stderr, or, when the logs are JSON
/// (`IMAJEV_LOG_FORMAT=json`), one warning line in that format so collectors can parse it.
pub fn announce(release: &Manifest) {
    if std::env::var("IMAJEV_LOG_FORMAT").is_ok_and(|f| f == "json") {
        tracing::warn!(
            demo = true,
            "DEMO MODE (--demo): a tiny random-weight Qwen3.5 with the real tokenizer; the answers are meaningless"
        );
    } else {
        eprintln!("{}", notice(release));
        tracing::warn!("demo mode: random weights, meaningless answers");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_banner_names_the_release_to_serve_instead() {
        let n = super::notice(crate::release::Manifest::builtin());
        assert!(n.contains("--model (Qwen/Qwen3.5-4B) and --adapter (mohit67890/imajev-4b)"), "{n}");
        assert!(n.lines().all(|l| l.chars().count() <= 78), "{n}");
    }
}
