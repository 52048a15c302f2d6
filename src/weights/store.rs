//! Tensors of a Hugging Face model directory, memory-mapped, never copied until a backend asks.
//!
//! A directory holds either one `model.safetensors` or shards listed in
//! `model.safetensors.index.json` (any other `*.safetensors` files are used when neither exists).
//! Each file is mapped once; headers are parsed once; a [`TensorRef`] is a borrowed view of one
//! tensor's raw little-endian bytes plus, for block-FP8 weights, its `weight_scale_inv` companion.
//! Conversion to f32 (BF16/F16 widening, FP8 block dequantisation through [`super::fp8`]) happens
//! here so both backends and the tests share one definition of what the bytes mean.

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{tensor::Metadata, Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Element type of a stored tensor (the subset of safetensors dtypes a Qwen3.5 checkpoint uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    F16,
    BF16,
    F8E4M3,
}

impl StoredDtype {
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::F16 | StoredDtype::BF16 => 2,
            StoredDtype::F8E4M3 => 1,
        }
    }

    fn from_safetensors(d: Dtype, name: &str) -> Result<Self> {
        Ok(match d {
            Dtype::F32 => StoredDtype::F32,
            Dtype::F16 => StoredDtype::F16,
            Dtype::BF16 => StoredDtype::BF16,
            Dtype::F8_E4M3 => StoredDtype::F8E4M3,
            other => bail!("tensor {name} has dtype {other:?}; supported: F32, F16, BF16, F8_E4M3"),
        })
    }
}

/// One tensor's bytes inside a mapped file.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: StoredDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    /// For an FP8 weight: the `[ceil(out/bn), ceil(in/bk)]` f32 dequantisation multipliers.
    pub scale_inv: Option<ScaleRef<'a>>,
}

#[derive(Clone, Copy)]
pub struct ScaleRef<'a> {
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    /// The checkpoint's `weight_block_size`, when its config gives one.
    pub block: Option<[usize; 2]>,
}

impl<'a> TensorRef<'a> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor as f32, row-major. FP8 weights are dequantised with their block scales.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = self.numel();
        if self.bytes.len() != n * self.dtype.size() {
            bail!("tensor {} has {} bytes, expected {}", self.name, self.bytes.len(), n * self.dtype.size());
        }
        Ok(match self.dtype {
            StoredDtype::F32 => {
                self.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            StoredDtype::BF16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            StoredDtype::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            StoredDtype::F8E4M3 => {
                let scale = self
                    .scale_inv
                    .ok_or_else(|| anyhow!("FP8 tensor {} has no weight_scale_inv", self.name))?;
                super::fp8::dequantize_fp8_blocks(
                    self.bytes,
                    self.shape,
                    scale.bytes,
                    scale.shape,
                    scale.block,
                )
                .with_context(|| format!("dequantising {}", self.name))?
            }
        })
    }
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    meta: Metadata,
}

/// Every tensor of a model (or adapter) directory, by name.
pub struct WeightStore {
    files: Vec<MappedFile>,
    /// name → (file, shape, dtype, byte range)
    index: HashMap<String, Entry>,
    /// `quantization_config.weight_block_size` of the model, if any.
    fp8_block: Option<[usize; 2]>,
}

struct Entry {
    file: usize,
    dtype: StoredDtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

impl WeightStore {
    /// Maps the safetensors files of a model directory.
    pub fn open_model_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{} has no weight_map object", index_path.display()))?;
            let mut names: Vec<String> =
                map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|f| dir.join(f)).collect()
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("listing {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!(
                    "{} holds no model.safetensors, no model.safetensors.index.json and no *.safetensors",
                    dir.display()
                );
            }
            found
        };
        Self::open_files(&files)
    }

    /// Maps the given safetensors files (later files may not repeat a tensor name).
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (fi, path) in paths.iter().enumerate() {
            let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: the file is opened read-only and the mapping lives as long as the store.
            // Like every mmap-based loader we assume nobody truncates checkpoint files under us.
            let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
            for (name, info) in meta.tensors() {
                let dtype = StoredDtype::from_safetensors(info.dtype, &name)?;
                let start = 8 + header_len + info.data_offsets.0;
                let end = 8 + header_len + info.data_offsets.1;
                if end > map.len() {
                    bail!("{}: tensor {name} runs past the end of the file", path.display());
                }
                if index
                    .insert(name.clone(), Entry { file: fi, dtype, shape: info.shape.clone(), start, end })
                    .is_some()
                {
                    bail!("tensor {name} appears in more than one file");
                }
            }
            files.push(MappedFile { path: path.clone(), map, meta });
        }
        Ok(WeightStore { files, index, fp8_block: None })
    }

    /// Sets the FP8 block size from the model's `quantization_config.weight_block_size`.
    pub fn set_fp8_block(&mut self, block: Option<[usize; 2]>) {
        self.fp8_block = block;
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    /// Total bytes mapped (for progress and memory reports).
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.map.len() as u64).sum()
    }

    pub fn file_paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Metadata (`__metadata__`) of the first file, e.g. `{"format": "pt"}`.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        self.files
            .first()
            .and_then(|f| f.meta.metadata().clone())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default()
    }

    fn raw(&self, name: &str) -> Option<(&Entry, &[u8])> {
        let e = self.index.get(name)?;
        Some((e, &self.files[e.file].map[e.start..e.end]))
    }

    /// A tensor by name, with its FP8 scale attached when it is a block-FP8 weight.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        let (key, e) = self
            .index
            .get_key_value(name)
            .ok_or_else(|| anyhow!("tensor {name} is missing from the checkpoint"))?;
        let key = key.as_str();
        let bytes = &self.files[e.file].map[e.start..e.end];
        let scale_inv = if e.dtype == StoredDtype::F8E4M3 {
            let sname = scale_name(name);
            let (se, sbytes) = self.raw(&sname).ok_or_else(|| anyhow!("FP8 tensor {name} has no {sname}"))?;
            if se.dtype != StoredDtype::F32 {
                bail!("{sname} must be F32");
            }
            Some(ScaleRef { shape: &se.shape, bytes: sbytes, block: self.fp8_block })
        } else {
            None
        };
        Ok(TensorRef { name: key, dtype: e.dtype, shape: &e.shape, bytes, scale_inv })
    }

    /// Like [`WeightStore::get`], and checks the shape.
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<TensorRef<'_>> {
        let t = self.get(name)?;
        if t.shape != shape {
            bail!("tensor {name} has shape {:?}, expected {:?}", t.shape, shape);
        }
        Ok(t)
    }

    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.get_shaped(name, shape)?.to_f32()
    }
}

/// `x.weight` → `x.weight_scale_inv`.
pub fn scale_name(weight_name: &str) -> String {
    match weight_name.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.weight_scale_inv"),
        None => format!("{weight_name}_scale_inv"),
    }
}
