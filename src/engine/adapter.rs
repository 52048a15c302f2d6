//! The imajev adapter folder: a PEFT LoRA (`adapter_config.json` + `adapter_model.safetensors`)
//! applied unmerged, and the float32 decision readout (`decision_readout.safetensors`).
//!
//! LoRA tensors are looked up by the module path of the base model
//! (`model.language_model.layers.L.mlp.down_proj` → `base_model.model.<path>.lora_A.weight`).
//! Every pair in the file must land on a projection of the model; anything the loader cannot
//! place is an error, never silently dropped.

use crate::backend::LoraPair;
use crate::weights::{StoredDtype, TensorRef, WeightStore};
use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize)]
pub struct AdapterConfig {
    #[serde(default)]
    pub peft_type: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub bias: Option<String>,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    pub rank_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub target_modules: Option<serde_json::Value>,
}

const PREFIX: &str = "base_model.model.";

/// A loaded LoRA adapter.
pub struct LoraAdapter {
    pub dir: PathBuf,
    pub config: AdapterConfig,
    pub scale: f32,
    store: WeightStore,
    /// Module paths (relative to the base model) that have an A/B pair in the file.
    modules: BTreeSet<String>,
}

impl LoraAdapter {
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path).with_context(|| {
            format!("reading {} (is {} a PEFT adapter folder?)", cfg_path.display(), dir.display())
        })?;
        let config: AdapterConfig =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", cfg_path.display()))?;
        if let Some(pt) = &config.peft_type {
            if pt != "LORA" {
                bail!("adapter peft_type is {pt:?}; only LORA is supported");
            }
        }
        if config.use_dora {
            bail!("DoRA adapters (use_dora: true) are not supported");
        }
        if config.fan_in_fan_out {
            bail!("fan_in_fan_out adapters are not supported");
        }
        if config.bias.as_deref().is_some_and(|b| b != "none") {
            bail!("LoRA bias {:?} is not supported (imajev adapters use \"none\")", config.bias);
        }
        if config.modules_to_save.as_ref().is_some_and(|m| !m.is_null()) {
            bail!("modules_to_save is not supported: the readout lives in decision_readout.safetensors");
        }
        let nonempty = |m: &Option<serde_json::Map<String, serde_json::Value>>| {
            m.as_ref().is_some_and(|m| !m.is_empty())
        };
        if nonempty(&config.rank_pattern) || nonempty(&config.alpha_pattern) {
            bail!("per-module rank_pattern / alpha_pattern are not supported");
        }
        if config.r == 0 {
            bail!("adapter r must be > 0");
        }
        let scale = if config.use_rslora {
            config.lora_alpha / (config.r as f64).sqrt()
        } else {
            config.lora_alpha / config.r as f64
        } as f32;
        let weights = dir.join("adapter_model.safetensors");
        if !weights.exists() {
            bail!("{} is missing", weights.display());
        }
        let store = WeightStore::open_files(&[weights])?;
        let mut modules = BTreeSet::new();
        for name in store.names() {
            let Some(rest) = name.strip_prefix(PREFIX) else {
                bail!("adapter tensor {name} does not start with {PREFIX:?}");
            };
            let module = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
                m
            } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
                m
            } else {
                bail!("adapter tensor {name} is not a lora_A/lora_B weight");
            };
            modules.insert(module.to_string());
        }
        for m in &modules {
            for part in ["lora_A", "lora_B"] {
                let key = format!("{PREFIX}{m}.{part}.weight");
                if !store.contains(&key) {
                    bail!("adapter has no {key}");
                }
            }
        }
        Ok(LoraAdapter { dir: dir.to_path_buf(), config, scale, store, modules })
    }

    /// The LoRA pair of a base-model module, if the adapter has one.
    pub fn pair(&self, module: &str) -> Result<Option<LoraPair<'_>>> {
        if !self.modules.contains(module) {
            return Ok(None);
        }
        let a = self.store.get(&format!("{PREFIX}{module}.lora_A.weight"))?;
        let b = self.store.get(&format!("{PREFIX}{module}.lora_B.weight"))?;
        for t in [&a, &b] {
            if t.dtype == StoredDtype::F8E4M3 {
                bail!("LoRA tensor {} is FP8; LoRA weights must be F32, BF16 or F16", t.name);
            }
        }
        Ok(Some(LoraPair { a, b, scale: self.scale }))
    }

    pub fn modules(&self) -> &BTreeSet<String> {
        &self.modules
    }

    pub fn parameter_count(&self) -> usize {
        self.store.names().map(|n| self.store.get(n).map(|t| t.numel()).unwrap_or(0)).sum()
    }
}

/// Path of the readout weights inside an adapter folder.
pub fn readout_path(adapter_dir: &Path) -> PathBuf {
    adapter_dir.join("decision_readout.safetensors")
}

/// Opens `decision_readout.safetensors` and checks key, dtype, shape and finiteness.
pub struct ReadoutFile {
    store: WeightStore,
}

impl ReadoutFile {
    pub fn open(path: &Path, hidden: usize) -> Result<Self> {
        let store = WeightStore::open_files(&[path.to_path_buf()])?;
        let file = ReadoutFile { store };
        let t = file.tensor()?;
        if t.dtype != StoredDtype::F32 {
            bail!("{}: readout weight must be F32", path.display());
        }
        match t.shape {
            [rows, h] if *h == hidden && *rows >= 2 => {}
            s => bail!("{}: readout weight has shape {s:?}, expected [rows ≥ 2, {hidden}]", path.display()),
        }
        if t.to_f32()?.iter().any(|v| !v.is_finite()) {
            bail!("{}: readout weight has non-finite values", path.display());
        }
        Ok(file)
    }

    pub fn tensor(&self) -> Result<TensorRef<'_>> {
        self.store.get("weight").map_err(|_| anyhow!("readout file must hold one tensor named \"weight\""))
    }

    pub fn rows(&self) -> usize {
        self.tensor().map(|t| t.shape[0]).unwrap_or(0)
    }
}
