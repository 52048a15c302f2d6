//! Safetensors headers of a release's weight files: tensor names, dtypes and shapes, read through
//! the `safetensors` crate (which also checks that the data offsets cover the file exactly).
//! Files are memory-mapped and only their header pages are touched; no tensor is read.
//! The engine's weight store is not used on purpose: `verify` must be able to describe a file the
//! engine would refuse, and must not depend on how the engine lays weights out.

use super::manifest::WeightSet;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorHeader {
    /// The safetensors dtype name (`BF16`, `F32`, `F8_E4M3`, …).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// The file (relative to the component folder) that holds it.
    pub file: String,
}

/// The tensors of one weight set and the files they came from.
#[derive(Debug, Clone, Default)]
pub struct WeightFiles {
    /// The set's file and, for an index, every shard it names (relative paths).
    pub files: Vec<String>,
    pub tensors: BTreeMap<String, TensorHeader>,
}

/// The header of one safetensors file: name → (dtype, shape).
pub fn read_header(path: &Path) -> Result<BTreeMap<String, (String, Vec<usize>)>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the map is read-only and dropped before returning; a file changed underneath would
    // at worst give a wrong header, which the sha256 check of the same file reports.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&map)
        .map_err(|e| anyhow::anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, (info.dtype.to_string(), info.shape.clone())))
        .collect())
}

/// Reads the headers of `set` inside `dir`: one safetensors file, or an index and its shards
/// (every tensor the index names must be in the shard it names, and every shard tensor indexed).
pub fn read_weight_set(dir: &Path, set: &WeightSet) -> Result<WeightFiles> {
    let mut out = WeightFiles { files: vec![set.file.clone()], ..Default::default() };
    if !set.is_index() {
        for (name, (dtype, shape)) in read_header(&dir.join(&set.file))? {
            out.tensors.insert(name, TensorHeader { dtype, shape, file: set.file.clone() });
        }
        return Ok(out);
    }
    let index_path = dir.join(&set.file);
    let text =
        std::fs::read_to_string(&index_path).with_context(|| format!("reading {}", index_path.display()))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", index_path.display()))?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{} has no weight_map object", index_path.display());
    };
    let mut by_shard: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (name, shard) in map {
        let Some(shard) = shard.as_str() else {
            bail!("{}: the shard of {name} is not a string", index_path.display())
        };
        if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == ".." {
            bail!("{}: shard {shard:?} must be a file name inside the folder", index_path.display());
        }
        by_shard.entry(shard.to_string()).or_default().push(name);
    }
    for (shard, names) in &by_shard {
        let header = read_header(&dir.join(shard))?;
        for name in names {
            if !header.contains_key(*name) {
                bail!(
                    "{}: {} names {shard} for {name}, which that shard does not hold",
                    index_path.display(),
                    set.file
                );
            }
        }
        for (name, (dtype, shape)) in header {
            if map.get(&name).and_then(|s| s.as_str()) != Some(shard.as_str()) {
                bail!(
                    "{}: tensor {name} is not indexed to this shard in {}",
                    dir.join(shard).display(),
                    set.file
                );
            }
            out.tensors.insert(name, TensorHeader { dtype, shape, file: shard.clone() });
        }
        out.files.push(shard.clone());
    }
    Ok(out)
}
