//! The demo bundle `serve` runs without `--model`: the tiny synthetic Qwen3.5 (the real
//! tokenizer, random weights) and an imajev-style adapter, written to a temporary folder, so the
//! whole API can be tried on a fresh machine with nothing downloaded. Its answers are
//! meaningless, and the server says so when it starts.

use crate::decision::Codebook;
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

/// Printed on stderr when the demo starts.
pub const DEMO_NOTICE: &str = "\n\
==============================================================================\n\
  DEMO MODE: no --model given. Serving a tiny RANDOM-WEIGHT Qwen3.5 with the\n\
  real tokenizer. The API is real; the ANSWERS ARE MEANINGLESS. Point --model\n\
  at Qwen/Qwen3.5-4B and --adapter at mohit67890/imajev-4b to serve decisions.\n\
==============================================================================";
