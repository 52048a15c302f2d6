//! `adapter/manifest.json`: what the released model is and what its files must hold.
//!
//! The manifest names the base and adapter repositories at pinned revisions, every file the
//! server reads (with its role), the tensors of every safetensors file (name, dtype, shape), the
//! config.json facts, the LoRA, codebook and calibration facts, the serving recipe and the
//! release's public name, description and date. It carries no hashes: those are only known from
//! a download, so they live in the lock that `verify --pin` writes ([`super::lock`]).
//!
//! Tensor names may hold one `{set}` placeholder naming an index set of the component
//! (`layers.{linear}.linear_attn.A_log` over the DeltaNet layers), so the 723 tensors of the base
//! read as the 43 rules a person can check against the model's spec.
//!
//! This file only parses and validates the manifest; it opens no model file.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;

/// The manifest of the release this binary serves, compiled in from `adapter/manifest.json`.
const BUILTIN: &str = include_str!("../../adapter/manifest.json");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub schema_version: u32,
    pub release: ReleaseInfo,
    pub recipe: Recipe,
    pub base: Component,
    pub adapter: Component,
    pub lora: LoraFacts,
    pub codebook: CodebookFacts,
    #[serde(default)]
    pub calibrations: Vec<CalibrationFacts>,
}

/// What `GET /v1/models` and every response call the model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseInfo {
    pub name: String,
    pub description: String,
    /// `YYYY-MM-DD`.
    pub release_date: String,
}

/// The released serving flags (`runtime/serve.env` spells them as environment variables).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// `cuda` or `cpu`.
    pub device: String,
    /// `none`, `fp8` or `bf16` (the `--quantize` values).
    pub quantize: String,
    pub rotations: usize,
    /// `imajev` or `typesafe`.
    pub contract: String,
    /// A file of the adapter folder.
    pub calibration: String,
}

/// The base model or the adapter: one Hugging Face repository at one revision.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Component {
    pub repo: String,
    /// The 40-hex commit the files come from.
    pub revision: String,
    /// The folder name the README's download commands write to.
    pub folder: String,
    pub licence: String,
    /// `hf download --exclude` patterns (copies the server never reads).
    #[serde(default)]
    pub download_exclude: Vec<String>,
    /// Files the server reads besides the weight files.
    pub files: Vec<FileFact>,
    /// Dotted config.json keys and the values they must have.
    #[serde(default)]
    pub config: BTreeMap<String, serde_json::Value>,
    /// Named index lists the `{set}` placeholders of tensor names run over.
    #[serde(default)]
    pub index_sets: BTreeMap<String, Vec<usize>>,
    pub weights: Vec<WeightSet>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileFact {
    pub path: String,
    pub role: String,
}

/// One safetensors file, or a `*.safetensors.index.json` and the shards it names.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightSet {
    pub file: String,
    pub role: String,
    /// Tensors under these prefixes may be present and are not checked (`mtp.`: the multi-token
    /// prediction head, which a prefill-only server never reads).
    #[serde(default)]
    pub ignore_prefixes: Vec<String>,
    pub tensors: Vec<TensorRule>,
}

impl WeightSet {
    pub fn is_index(&self) -> bool {
        self.file.ends_with(".index.json")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRule {
    pub name: String,
    pub dtype: Dtypes,
    pub shape: Vec<usize>,
}

/// One safetensors dtype name (`BF16`) or the list of those allowed.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Dtypes {
    One(String),
    Any(Vec<String>),
}

/// A tensor the manifest requires, after expanding its placeholder.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpectedTensor {
    pub name: String,
    pub dtypes: Vec<String>,
    pub shape: Vec<usize>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraFacts {
    /// The adapter's PEFT config file.
    pub config: String,
    /// The adapter's LoRA weight file.
    pub weights: String,
    pub r: usize,
    pub lora_alpha: f64,
    /// Module suffixes (`mlp.down_proj`) of the base projections the LoRA adapts, each in every
    /// decoder layer that has it.
    pub targets: Vec<String>,
    /// How many base projections carry a LoRA pair.
    pub modules: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodebookFacts {
    /// `decision_readout.json`.
    pub file: String,
    /// The readout weight file whose rows the codes answer to.
    pub readout: String,
    pub codes: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationFacts {
    pub file: String,
    /// `calibration_version`, where the published record states it.
    #[serde(default)]
    pub version: Option<String>,
    /// The temperature of every bucket, where one temperature was fitted for all.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// How many type × option-count buckets the file has.
    #[serde(default)]
    pub buckets: Option<usize>,
}

const QUANTIZE: [&str; 3] = ["none", "fp8", "bf16"];
const DEVICES: [&str; 2] = ["cuda", "cpu"];
const CONTRACTS: [&str; 2] = ["imajev", "typesafe"];

impl Manifest {
    /// The manifest compiled into this binary (`adapter/manifest.json`).
    pub fn builtin() -> &'static Manifest {
        static M: OnceLock<Manifest> = OnceLock::new();
        // A test parses and validates the same text, so this cannot fail in a released binary.
        M.get_or_init(|| {
            Manifest::from_json(BUILTIN).expect("adapter/manifest.json is valid (its unit tests parse it)")
        })
    }

    pub fn load(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the manifest {}", path.display()))?;
        Manifest::from_json(&text).with_context(|| format!("manifest {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Manifest> {
        let m: Manifest = serde_json::from_str(text)?;
        m.validate()?;
        Ok(m)
    }

    fn validate(&self) -> Result<()> {
        if self.schema_version != 1 {
            bail!("schema_version {} is not supported (this binary reads 1)", self.schema_version);
        }
        let r = &self.release;
        if r.name.trim().is_empty() || r.description.trim().is_empty() {
            bail!("release.name and release.description must not be empty");
        }
        if !is_date(&r.release_date) {
            bail!("release.release_date {:?} is not YYYY-MM-DD", r.release_date);
        }
        let rc = &self.recipe;
        if !DEVICES.contains(&rc.device.as_str()) {
            bail!("recipe.device {:?} is not one of {DEVICES:?}", rc.device);
        }
        if !QUANTIZE.contains(&rc.quantize.as_str()) {
            bail!("recipe.quantize {:?} is not one of {QUANTIZE:?}", rc.quantize);
        }
        if !CONTRACTS.contains(&rc.contract.as_str()) {
            bail!("recipe.contract {:?} is not one of {CONTRACTS:?}", rc.contract);
        }
        if rc.rotations == 0 {
            bail!("recipe.rotations must be at least 1");
        }
        for (what, c) in [("base", &self.base), ("adapter", &self.adapter)] {
            c.validate().with_context(|| what.to_string())?;
        }
        let adapter_files = self.adapter.all_named_files();
        for (what, f) in [
            ("recipe.calibration", &rc.calibration),
            ("lora.config", &self.lora.config),
            ("lora.weights", &self.lora.weights),
            ("codebook.file", &self.codebook.file),
            ("codebook.readout", &self.codebook.readout),
        ] {
            if !adapter_files.contains(f.as_str()) {
                bail!("{what} {f:?} is not a file of adapter.files or adapter.weights");
            }
        }
        for c in &self.calibrations {
            if !adapter_files.contains(c.file.as_str()) {
                bail!("calibrations: {:?} is not a file of adapter.files", c.file);
            }
        }
        if self.lora.r == 0 || self.lora.modules == 0 || self.lora.targets.is_empty() {
            bail!("lora: r, modules and targets must be set");
        }
        if self.codebook.codes < 2 {
            bail!("codebook.codes must be at least 2");
        }
        Ok(())
    }

    /// The commands that download the release into `root` (the README's, word for word).
    pub fn download_commands(&self, root: &str) -> Vec<String> {
        [&self.base, &self.adapter]
            .iter()
            .map(|c| {
                let mut cmd = format!(
                    "hf download {} --revision {} --local-dir {root}/{}",
                    c.repo, c.revision, c.folder
                );
                for x in &c.download_exclude {
                    cmd.push_str(&format!(" --exclude '{x}'"));
                }
                cmd
            })
            .collect()
    }
}

impl Component {
    fn validate(&self) -> Result<()> {
        if self.revision.len() != 40 || !self.revision.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("revision {:?} is not a 40-hex commit", self.revision);
        }
        if self.folder.is_empty() || self.folder.contains('/') {
            bail!("folder {:?} must be one path component", self.folder);
        }
        let mut seen = BTreeSet::new();
        for f in self.files.iter().map(|f| &f.path).chain(self.weights.iter().map(|w| &w.file)) {
            if !is_relative_file(f) {
                bail!("{f:?} must be a relative path inside the folder");
            }
            if !seen.insert(f.as_str()) {
                bail!("{f:?} is listed twice");
            }
        }
        for w in &self.weights {
            if !w.file.ends_with(".safetensors") && !w.is_index() {
                bail!("weights file {:?} must be a .safetensors file or a .safetensors.index.json", w.file);
            }
            let tensors = self.expected_tensors(w)?;
            let mut names = BTreeSet::new();
            for t in &tensors {
                if !names.insert(t.name.as_str()) {
                    bail!("{}: tensor {} is listed twice", w.file, t.name);
                }
            }
        }
        Ok(())
    }

    /// Every file named by `files` and `weights` (shards of an index are not named here).
    pub fn all_named_files(&self) -> BTreeSet<&str> {
        self.files
            .iter()
            .map(|f| f.path.as_str())
            .chain(self.weights.iter().map(|w| w.file.as_str()))
            .collect()
    }

    /// The tensors of `set`, placeholders expanded, in manifest order.
    pub fn expected_tensors(&self, set: &WeightSet) -> Result<Vec<ExpectedTensor>> {
        let mut out = Vec::new();
        for rule in &set.tensors {
            let dtypes = match &rule.dtype {
                Dtypes::One(d) => vec![d.clone()],
                Dtypes::Any(v) => v.clone(),
            };
            if dtypes.is_empty() {
                bail!("{}: tensor {} allows no dtype", set.file, rule.name);
            }
            match placeholder(&rule.name)? {
                None => {
                    out.push(ExpectedTensor { name: rule.name.clone(), dtypes, shape: rule.shape.clone() })
                }
                Some((before, key, after)) => {
                    let Some(indices) = self.index_sets.get(key) else {
                        bail!(
                            "{}: tensor {} names the index set {{{key}}}, which index_sets lacks",
                            set.file,
                            rule.name
                        );
                    };
                    for i in indices {
                        out.push(ExpectedTensor {
                            name: format!("{before}{i}{after}"),
                            dtypes: dtypes.clone(),
                            shape: rule.shape.clone(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Splits `a.{set}.b` into (`a.`, `set`, `.b`); `None` without a placeholder.
fn placeholder(name: &str) -> Result<Option<(&str, &str, &str)>> {
    let Some(open) = name.find('{') else {
        if name.contains('}') {
            bail!("tensor name {name:?} has an unmatched '}}'");
        }
        return Ok(None);
    };
    let Some(len) = name[open..].find('}') else { bail!("tensor name {name:?} has an unmatched '{{'") };
    let (before, key, after) = (&name[..open], &name[open + 1..open + len], &name[open + len + 1..]);
    if key.is_empty() || after.contains('{') || after.contains('}') {
        bail!("tensor name {name:?} must hold at most one {{set}} placeholder");
    }
    Ok(Some((before, key, after)))
}

fn is_date(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && b.iter().enumerate().all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit())
        && matches!(s[5..7].parse::<u32>(), Ok(1..=12))
        && matches!(s[8..10].parse::<u32>(), Ok(1..=31))
}

fn is_relative_file(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('/') && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_manifest_describes_imajev_4b() {
        let m = Manifest::builtin();
        assert_eq!(m.release.name, "imajev-4b");
        let base = &m.base;
        let tensors = base.expected_tensors(&base.weights[0]).unwrap();
        // Spec §8: text 2 + 32·5 + 24·9 + 8·6 = 426, vision 24·12 + 9 = 297.
        assert_eq!(tensors.len(), 426 + 297);
        let lora = m.adapter.expected_tensors(&m.adapter.weights[0]).unwrap();
        assert_eq!(lora.len(), 2 * m.lora.modules);
        // The published LoRA parameter count of the phase-3 adapter.
        let params: usize = lora.iter().map(|t| t.shape.iter().product::<usize>()).sum();
        assert_eq!(params, 121_896_960);
        let readout = m.adapter.expected_tensors(&m.adapter.weights[1]).unwrap();
        assert_eq!(readout[0].shape, vec![m.codebook.codes, 2560]);
    }

    #[test]
    fn placeholders_expand_over_their_index_set_and_bad_ones_are_refused() {
        assert_eq!(placeholder("a.{x}.b").unwrap(), Some(("a.", "x", ".b")));
        assert_eq!(placeholder("plain").unwrap(), None);
        for bad in ["a.{x", "a.x}", "a.{}.b", "a.{x}.{y}"] {
            assert!(placeholder(bad).is_err(), "{bad}");
        }
        let mut m: serde_json::Value = serde_json::from_str(BUILTIN).unwrap();
        m["base"]["weights"][0]["tensors"][2]["name"] =
            "model.language_model.layers.{nope}.input_layernorm.weight".into();
        let e = Manifest::from_json(&m.to_string()).unwrap_err();
        assert!(format!("{e:#}").contains("{nope}"), "{e:#}");
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let base: serde_json::Value = serde_json::from_str(BUILTIN).unwrap();
        type Edit = fn(&mut serde_json::Value);
        let cases: [(&str, Edit); 6] = [
            ("revision", |m| m["base"]["revision"] = "main".into()),
            ("release_date", |m| m["release"]["release_date"] = "26 Sep 2026".into()),
            ("recipe.quantize", |m| m["recipe"]["quantize"] = "int4".into()),
            ("recipe.calibration", |m| m["recipe"]["calibration"] = "calibration-rot8.json".into()),
            ("listed twice", |m| {
                let f = m["adapter"]["files"][0].clone();
                m["adapter"]["files"].as_array_mut().unwrap().push(f)
            }),
            ("relative path", |m| m["base"]["files"][0]["path"] = "../config.json".into()),
        ];
        for (needle, edit) in cases {
            let mut m = base.clone();
            edit(&mut m);
            let e = Manifest::from_json(&m.to_string()).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{needle}: {e:#}");
        }
    }

    #[test]
    fn download_commands_pin_both_revisions() {
        let m = Manifest::builtin();
        let cmds = m.download_commands("models");
        assert_eq!(
            cmds[0],
            "hf download Qwen/Qwen3.5-4B --revision 851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a --local-dir models/Qwen3.5-4B"
        );
        assert_eq!(
            cmds[1],
            "hf download mohit67890/imajev-4b --revision c9e5f132465da85d31735ec502d5557982671a7d --local-dir models/imajev-4b --exclude 'mlx/*'"
        );
    }
}
