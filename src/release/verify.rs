//! `imajev-serve verify`: is this download the release the manifest describes?
//!
//! * `sha256` — every file the server reads has the size and hash the lock states (without a
//!   lock the files are listed as unpinned: only their contents are checked);
//! * `config` — config.json has the architecture the manifest states;
//! * `tensors` — every weight file holds exactly the manifest's tensors, with their dtypes and
//!   shapes (tensors under an ignored prefix, like the `mtp.` head, may be present);
//! * `lora` — adapter_config.json has the manifest's r and lora_alpha, and the LoRA pairs cover
//!   exactly the base projections the manifest names, each pair's shapes fitting its base weight;
//! * `codebook` — decision_readout.json equals the codebook the base tokenizer gives, one code
//!   per readout row;
//! * `calibration` — each calibration file parses and has the manifest's version and temperature.
//!
//! [`pin`] runs the same content checks and, only when they pass, hashes the files into a
//! [`Lock`]. Nothing here loads weights or knows how the engine uses them.

use super::headers::{read_weight_set, TensorHeader, WeightFiles};
use super::lock::{hash_file, ComponentLock, FileHash, Lock};
use super::manifest::{Component, Manifest};
use super::report::{Report, Status};
use crate::decision::{Calibration, Codebook};
use crate::tokenizer::QwenTokenizer;
use anyhow::{anyhow, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Where the two folders of a release are.
#[derive(Debug, Clone)]
pub struct ReleaseDirs {
    pub model: PathBuf,
    pub adapter: PathBuf,
}

impl ReleaseDirs {
    /// `<root>/<base.folder>` and `<root>/<adapter.folder>`, where the README's download
    /// commands put them.
    pub fn under(root: &Path, manifest: &Manifest) -> Self {
        ReleaseDirs { model: root.join(&manifest.base.folder), adapter: root.join(&manifest.adapter.folder) }
    }
}

/// One of the two folders, with what the manifest says about it.
struct Side<'a> {
    component: &'a Component,
    dir: &'a Path,
    /// How files of this folder are named in the report (`<folder name>/<file>`).
    label: String,
}

impl Side<'_> {
    fn file(&self, rel: &str) -> String {
        format!("{}/{rel}", self.label)
    }
}

fn sides<'a>(m: &'a Manifest, dirs: &'a ReleaseDirs) -> [Side<'a>; 2] {
    let label = |d: &Path| {
        d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| d.display().to_string())
    };
    [
        Side { component: &m.base, dir: &dirs.model, label: label(&dirs.model) },
        Side { component: &m.adapter, dir: &dirs.adapter, label: label(&dirs.adapter) },
    ]
}

/// The content checks (everything but hashes) and the files each folder must hash.
struct Contents {
    report: Report,
    /// Per side (base, adapter): relative paths, in manifest order, shards after their index.
    files: [Vec<String>; 2],
}

/// Checks `dirs` against `manifest` and, when `lock` is given, against the lock.
pub fn verify(manifest: &Manifest, dirs: &ReleaseDirs, lock: Option<(&Path, &Lock)>) -> Report {
    let contents = check_contents(manifest, dirs);
    let sides = sides(manifest, dirs);
    let mut report = Report::default();
    let mut files = contents.files.clone();
    if let Some((path, lock)) = lock {
        report.rows.push(check_lock_header(manifest, path, lock));
        // A file the lock names is checked even when the manifest does not name it (a shard of
        // an index that no longer reads).
        for (i, locked) in [&lock.base, &lock.adapter].into_iter().enumerate() {
            for f in locked.files.keys() {
                if !files[i].contains(f) {
                    files[i].push(f.clone());
                }
            }
        }
    }
    let hashes = hash_files(&sides, &files);
    for (i, side) in sides.iter().enumerate() {
        let locked = lock.map(|(_, l)| if i == 0 { &l.base } else { &l.adapter });
        for (rel, hash) in files[i].iter().zip(&hashes[i]) {
            let (status, detail) = match (hash, locked.map(|l| l.files.get(rel))) {
                (Err(e), _) => (Status::Failed, e.clone()),
                (Ok(h), None) => {
                    (Status::NotPinned, format!("{} bytes, sha256 {}", h.bytes, short(&h.sha256)))
                }
                (Ok(_), Some(None)) => {
                    (Status::Failed, "not in the lock (the lock was pinned from other files)".to_string())
                }
                (Ok(h), Some(Some(want))) if h == want => {
                    (Status::Ok, format!("{} bytes, sha256 {} as locked", h.bytes, short(&h.sha256)))
                }
                (Ok(h), Some(Some(want))) => (Status::Failed, mismatch(h, want)),
            };
            report.push("sha256", side.file(rel), status, detail);
        }
    }
    report.rows.extend(contents.report.rows);
    report
}

/// The content checks, then, only if they all pass, the lock of the files' hashes. The report has
/// one `sha256` row per file (its new hash) followed by the content rows.
pub fn pin(manifest: &Manifest, dirs: &ReleaseDirs) -> (Report, Option<Lock>) {
    let contents = check_contents(manifest, dirs);
    let sides = sides(manifest, dirs);
    let hashes = hash_files(&sides, &contents.files);
    let mut report = Report::default();
    let mut locked: [BTreeMap<String, FileHash>; 2] = Default::default();
    for (i, side) in sides.iter().enumerate() {
        for (rel, hash) in contents.files[i].iter().zip(&hashes[i]) {
            match hash {
                Ok(h) => {
                    report.push(
                        "sha256",
                        side.file(rel),
                        Status::Ok,
                        format!("{} bytes, sha256 {} pinned", h.bytes, short(&h.sha256)),
                    );
                    locked[i].insert(rel.clone(), h.clone());
                }
                Err(e) => report.push("sha256", side.file(rel), Status::Failed, e.clone()),
            }
        }
    }
    report.rows.extend(contents.report.rows);
    if !report.passed() {
        return (report, None);
    }
    let [base_files, adapter_files] = locked;
    let component =
        |c: &Component, files| ComponentLock { repo: c.repo.clone(), revision: c.revision.clone(), files };
    let lock = Lock {
        lock_version: 1,
        release: manifest.release.name.clone(),
        base: component(&manifest.base, base_files),
        adapter: component(&manifest.adapter, adapter_files),
    };
    (report, Some(lock))
}

fn short(sha: &str) -> String {
    format!("{}…", &sha[..sha.len().min(16)])
}

fn mismatch(got: &FileHash, want: &FileHash) -> String {
    let mut s = format!("sha256 {} but the lock has {}", short(&got.sha256), short(&want.sha256));
    if got.bytes != want.bytes {
        s.push_str(&format!("; {} bytes, the lock has {}", got.bytes, want.bytes));
    }
    s
}

fn check_lock_header(m: &Manifest, path: &Path, lock: &Lock) -> super::report::Row {
    let mut problems = Vec::new();
    if lock.release != m.release.name {
        problems.push(format!("pinned for release {:?}, the manifest is {:?}", lock.release, m.release.name));
    }
    for (what, l, c) in [("base", &lock.base, &m.base), ("adapter", &lock.adapter, &m.adapter)] {
        if l.repo != c.repo || l.revision != c.revision {
            problems.push(format!(
                "{what} pinned from {}@{}, the manifest pins {}@{}",
                l.repo, l.revision, c.repo, c.revision
            ));
        }
    }
    let (status, detail) = if problems.is_empty() {
        (
            Status::Ok,
            format!(
                "{} @ {} + {} @ {}",
                m.base.repo,
                &m.base.revision[..12],
                m.adapter.repo,
                &m.adapter.revision[..12]
            ),
        )
    } else {
        (Status::Failed, problems.join("; "))
    };
    super::report::Row { check: "lock", file: path.display().to_string(), status, detail }
}

/// Hashes every file, in parallel over files; a missing file is an error naming it.
fn hash_files(sides: &[Side; 2], files: &[Vec<String>; 2]) -> [Vec<Result<FileHash, String>>; 2] {
    use rayon::prelude::*;
    let hash = |dir: &Path, rel: &String| -> Result<FileHash, String> {
        let path = dir.join(rel);
        if !path.is_file() {
            return Err(format!("missing ({} does not exist)", path.display()));
        }
        hash_file(&path).map_err(|e| format!("{e:#}"))
    };
    [
        files[0].par_iter().map(|rel| hash(sides[0].dir, rel)).collect(),
        files[1].par_iter().map(|rel| hash(sides[1].dir, rel)).collect(),
    ]
}

fn check_contents(m: &Manifest, dirs: &ReleaseDirs) -> Contents {
    let sides = sides(m, dirs);
    let mut report = Report::default();
    let mut files: [Vec<String>; 2] = Default::default();
    // Tensors of each side's weight sets, by set file; None where a set could not be read.
    let mut weights: [BTreeMap<String, Option<WeightFiles>>; 2] = Default::default();
    for (i, side) in sides.iter().enumerate() {
        files[i].extend(side.component.files.iter().map(|f| f.path.clone()));
        if !side.component.config.is_empty() {
            let (status, detail) = outcome(check_config(side));
            report.push("config", side.file("config.json"), status, detail);
        }
        for set in &side.component.weights {
            match read_weight_set(side.dir, set) {
                Ok(found) => {
                    let (status, detail) = outcome(compare_tensors(side.component, set, &found));
                    report.push("tensors", side.file(&set.file), status, detail);
                    files[i].extend(found.files.iter().cloned());
                    weights[i].insert(set.file.clone(), Some(found));
                }
                Err(e) => {
                    report.push("tensors", side.file(&set.file), Status::Failed, format!("{e:#}"));
                    files[i].push(set.file.clone());
                    weights[i].insert(set.file.clone(), None);
                }
            }
        }
    }
    let [base_side, adapter_side] = &sides;
    let (status, detail) = outcome(check_lora(m, base_side, adapter_side, &weights[0], &weights[1]));
    report.push("lora", adapter_side.file(&m.lora.weights), status, detail);
    let (status, detail) = outcome(check_codebook(m, base_side, adapter_side, &weights[1]));
    report.push("codebook", adapter_side.file(&m.codebook.file), status, detail);
    for c in &m.calibrations {
        let (status, detail) = outcome(check_calibration(adapter_side, c));
        report.push("calibration", adapter_side.file(&c.file), status, detail);
    }
    Contents { report, files }
}

fn outcome(r: Result<String>) -> (Status, String) {
    match r {
        Ok(detail) => (Status::Ok, detail),
        Err(e) => (Status::Failed, format!("{e:#}")),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Numbers compare by value (2560 = 2560.0), everything else structurally.
fn json_equal(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (a, b) {
        (Number(x), Number(y)) => x.as_f64() == y.as_f64() && x.as_f64().is_some(),
        (Array(x), Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_equal(p, q)),
        (Object(x), Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

fn check_config(side: &Side) -> Result<String> {
    let config = read_json(&side.dir.join("config.json"))?;
    let mut problems = Vec::new();
    for (key, want) in &side.component.config {
        let got = key.split('.').try_fold(&config, |v, k| v.get(k));
        match got {
            None => problems.push(format!("{key} is missing (the manifest says {want})")),
            Some(got) if !json_equal(got, want) => {
                problems.push(format!("{key} is {got}, the manifest says {want}"))
            }
            Some(_) => {}
        }
    }
    if problems.is_empty() {
        Ok(format!("{} architecture facts as the manifest states", side.component.config.len()))
    } else {
        Err(anyhow!("{}", list(&problems)))
    }
}

/// At most five problems, then how many more.
fn list(problems: &[String]) -> String {
    let mut s = problems.iter().take(5).cloned().collect::<Vec<_>>().join("; ");
    if problems.len() > 5 {
        s.push_str(&format!("; and {} more", problems.len() - 5));
    }
    s
}

fn compare_tensors(c: &Component, set: &super::manifest::WeightSet, found: &WeightFiles) -> Result<String> {
    let expected = c.expected_tensors(set)?;
    let mut problems = Vec::new();
    let mut wanted = BTreeSet::new();
    for t in &expected {
        wanted.insert(t.name.as_str());
        match found.tensors.get(&t.name) {
            None => problems.push(format!("{} is missing", t.name)),
            Some(h) => {
                if !t.dtypes.contains(&h.dtype) {
                    problems.push(format!(
                        "{} in {} is {}, the manifest says {}",
                        t.name,
                        h.file,
                        h.dtype,
                        t.dtypes.join(" or ")
                    ));
                }
                if h.shape != t.shape {
                    problems.push(format!(
                        "{} in {} has shape {:?}, the manifest says {:?}",
                        t.name, h.file, h.shape, t.shape
                    ));
                }
            }
        }
    }
    let mut ignored = 0;
    for (name, h) in &found.tensors {
        if wanted.contains(name.as_str()) {
            continue;
        }
        if set.ignore_prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            ignored += 1;
        } else {
            problems.push(format!("{name} in {} is not in the manifest", h.file));
        }
    }
    if !problems.is_empty() {
        return Err(anyhow!("{}", list(&problems)));
    }
    let noun = if expected.len() == 1 { "tensor" } else { "tensors" };
    let mut detail = format!("{} {noun}: names, dtypes and shapes as the manifest lists", expected.len());
    if found.files.len() > 1 {
        detail.push_str(&format!(" ({} shards)", found.files.len() - 1));
    }
    if ignored > 0 {
        detail.push_str(&format!("; {ignored} unused ({}) not checked", set.ignore_prefixes.join(", ")));
    }
    Ok(detail)
}

const LORA_PREFIX: &str = "base_model.model.";

fn check_lora(
    m: &Manifest,
    base: &Side,
    adapter: &Side,
    base_weights: &BTreeMap<String, Option<WeightFiles>>,
    adapter_weights: &BTreeMap<String, Option<WeightFiles>>,
) -> Result<String> {
    let facts = &m.lora;
    let config = read_json(&adapter.dir.join(&facts.config))?;
    let r = config.get("r").and_then(|v| v.as_u64());
    let alpha = config.get("lora_alpha").and_then(|v| v.as_f64());
    if r != Some(facts.r as u64) || alpha != Some(facts.lora_alpha) {
        return Err(anyhow!(
            "{} has r {} and lora_alpha {}; the manifest says r {} and lora_alpha {}",
            facts.config,
            r.map_or("missing".into(), |v| v.to_string()),
            alpha.map_or("missing".into(), |v| v.to_string()),
            facts.r,
            facts.lora_alpha
        ));
    }
    for flag in ["use_dora", "use_rslora"] {
        if config.get(flag).and_then(|v| v.as_bool()) == Some(true) {
            return Err(anyhow!("{} sets {flag}; the release is a plain LoRA", facts.config));
        }
    }
    let Some(Some(lora)) = adapter_weights.get(&facts.weights) else {
        return Err(anyhow!("{} could not be read (see its tensors row)", adapter.file(&facts.weights)));
    };
    let mut base_tensors: BTreeMap<&str, &TensorHeader> = BTreeMap::new();
    for (file, set) in base_weights {
        let Some(set) = set else {
            return Err(anyhow!("{} could not be read (see its tensors row)", base.file(file)));
        };
        base_tensors.extend(set.tensors.iter().map(|(n, h)| (n.as_str(), h)));
    }
    // Module path → (A, B) from the adapter file.
    let mut pairs: BTreeMap<&str, [Option<&TensorHeader>; 2]> = BTreeMap::new();
    let mut problems = Vec::new();
    for (name, h) in &lora.tensors {
        let rest = name.strip_prefix(LORA_PREFIX);
        let (module, slot) = match rest {
            Some(r) if r.ends_with(".lora_A.weight") => (&r[..r.len() - ".lora_A.weight".len()], 0),
            Some(r) if r.ends_with(".lora_B.weight") => (&r[..r.len() - ".lora_B.weight".len()], 1),
            _ => {
                problems.push(format!("{name} is not a {LORA_PREFIX}<module>.lora_A/lora_B.weight"));
                continue;
            }
        };
        pairs.entry(module).or_default()[slot] = Some(h);
    }
    for (module, [a, b]) in &pairs {
        let (Some(a), Some(b)) = (a, b) else {
            problems.push(format!("{module} has only one of lora_A / lora_B"));
            continue;
        };
        let Some(w) = base_tensors.get(format!("{module}.weight").as_str()) else {
            problems.push(format!("{module} has a LoRA pair but the base has no {module}.weight"));
            continue;
        };
        let fits = matches!((a.shape.as_slice(), b.shape.as_slice(), w.shape.as_slice()),
            ([ra, i], [o, rb], [wo, wi]) if *ra == facts.r && *rb == facts.r && i == wi && o == wo);
        if !fits {
            problems.push(format!(
                "{module}: lora_A {:?} and lora_B {:?} do not fit the base weight {:?} at r {}",
                a.shape, b.shape, w.shape, facts.r
            ));
        }
    }
    let targeted: BTreeSet<&str> = base_tensors
        .keys()
        .filter_map(|n| n.strip_suffix(".weight"))
        .filter(|module| {
            module.starts_with("model.language_model.layers.")
                && facts.targets.iter().any(|t| module.ends_with(&format!(".{t}")))
        })
        .collect();
    for module in targeted.iter().filter(|m| !pairs.contains_key(*m)) {
        problems.push(format!("{module} is a target the LoRA does not cover"));
    }
    for module in pairs.keys().filter(|m| !targeted.contains(*m)) {
        problems.push(format!("{module} is adapted but is not one of the manifest's targets"));
    }
    if pairs.len() != facts.modules {
        problems.push(format!(
            "{} modules carry a LoRA pair, the manifest says {}",
            pairs.len(),
            facts.modules
        ));
    }
    if !problems.is_empty() {
        return Err(anyhow!("{}", list(&problems)));
    }
    Ok(format!(
        "{} base projections adapted (r {}, lora_alpha {}), each pair fitting its base weight; no target left out",
        pairs.len(),
        facts.r,
        facts.lora_alpha
    ))
}

fn check_codebook(
    m: &Manifest,
    base: &Side,
    adapter: &Side,
    adapter_weights: &BTreeMap<String, Option<WeightFiles>>,
) -> Result<String> {
    let facts = &m.codebook;
    let Some(Some(readout)) = adapter_weights.get(&facts.readout) else {
        return Err(anyhow!("{} could not be read (see its tensors row)", adapter.file(&facts.readout)));
    };
    let rows = match readout.tensors.values().collect::<Vec<_>>().as_slice() {
        [t] if t.shape.len() == 2 => t.shape[0],
        _ => return Err(anyhow!("{} must hold one 2-D tensor (the readout)", adapter.file(&facts.readout))),
    };
    let file = Codebook::read(&adapter.dir.join(&facts.file))?;
    if file.codes.len() != facts.codes || rows != facts.codes {
        return Err(anyhow!(
            "{} lists {} codes and the readout has {rows} rows; the manifest says {}",
            facts.file,
            file.codes.len(),
            facts.codes
        ));
    }
    let tokenizer_path = base.dir.join("tokenizer.json");
    let tokenizer = QwenTokenizer::from_file(&tokenizer_path)?;
    let derived = Codebook::derive(&tokenizer, rows)?;
    if let Some(i) = file.codes.iter().zip(&derived.codes).position(|(a, b)| a != b) {
        return Err(anyhow!(
            "code #{i} is {:?} (token {}) but {} gives {:?} (token {}): the adapter does not match this tokenizer",
            file.codes[i].code,
            file.codes[i].token_id,
            base.file("tokenizer.json"),
            derived.codes[i].code,
            derived.codes[i].token_id
        ));
    }
    Ok(format!(
        "{} codes ({} … {}) = the codebook {} gives, one per readout row",
        rows,
        file.codes[0].code,
        file.codes[rows - 1].code,
        base.file("tokenizer.json")
    ))
}

fn check_calibration(adapter: &Side, facts: &super::manifest::CalibrationFacts) -> Result<String> {
    let cal = Calibration::load(&adapter.dir.join(&facts.file))?;
    let mut problems = Vec::new();
    if let Some(v) = &facts.version {
        if &cal.version != v {
            problems.push(format!("calibration_version is {:?}, the manifest says {v:?}", cal.version));
        }
    }
    if let Some(n) = facts.buckets {
        if cal.temperatures.len() != n {
            problems.push(format!("{} temperature buckets, the manifest says {n}", cal.temperatures.len()));
        }
    }
    if let Some(t) = facts.temperature {
        for (bucket, got) in &cal.temperatures {
            if *got != t {
                problems.push(format!("bucket {bucket} has T = {got}, the manifest says {t}"));
            }
        }
    }
    if !problems.is_empty() {
        return Err(anyhow!("{}", list(&problems)));
    }
    Ok(format!("version {:?}, {} buckets", cal.version, cal.temperatures.len()))
}
