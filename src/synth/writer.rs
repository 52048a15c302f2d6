//! A streaming safetensors writer: the header is computed from the specs, then each tensor is
//! generated and written in header order, an FP8 weight together with its block scales. The
//! `safetensors` crate's writer needs every tensor in memory up front and orders them itself, so
//! it can do neither (a 4B checkpoint would need its whole size in RAM).

use super::tensors::{values, Spec, Store};
use crate::weights::fp8::quantize_fp8_blocks;
use crate::weights::scale_name;
use anyhow::{Context, Result};
use rayon::prelude::*;
use serde_json::json;
use std::io::{BufWriter, Write};
use std::path::Path;

fn dtype_name(s: Store) -> &'static str {
    match s {
        Store::F32 => "F32",
        Store::Bf16 => "BF16",
        Store::Fp8 => "F8_E4M3",
    }
}

/// One output tensor (or an FP8 weight + its scales) ready to write.
struct Encoded {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn encode(spec: &Spec, seed: u64) -> Vec<Encoded> {
    let v = values(spec, seed);
    match spec.store {
        Store::F32 => vec![Encoded {
            name: spec.name.clone(),
            dtype: "F32",
            shape: spec.shape.clone(),
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }],
        Store::Bf16 => vec![Encoded {
            name: spec.name.clone(),
            dtype: "BF16",
            shape: spec.shape.clone(),
            bytes: v.par_iter().flat_map_iter(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        }],
        Store::Fp8 => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let (q, s) = quantize_fp8_blocks(&v, rows, cols);
            let sname = scale_name(&spec.name);
            vec![
                Encoded {
                    name: spec.name.clone(),
                    dtype: dtype_name(Store::Fp8),
                    shape: spec.shape.clone(),
                    bytes: q,
                },
                Encoded {
                    name: sname,
                    dtype: "F32",
                    shape: vec![rows.div_ceil(128), cols.div_ceil(128)],
                    bytes: s.iter().flat_map(|x| x.to_le_bytes()).collect(),
                },
            ]
        }
    }
}

/// Bytes a spec will occupy on disk.
pub fn stored_bytes(spec: &Spec) -> u64 {
    let n: u64 = spec.shape.iter().product::<usize>() as u64;
    match spec.store {
        Store::F32 => 4 * n,
        Store::Bf16 => 2 * n,
        Store::Fp8 => n + 4 * (spec.shape[0].div_ceil(128) * spec.shape[1].div_ceil(128)) as u64,
    }
}

/// Writes safetensors files, streaming: the header is computed from the specs, then each tensor
/// is generated and written in header order.
pub fn write_safetensors(
    path: &Path,
    specs: &[Spec],
    seed: u64,
    mut on_tensor: impl FnMut(u64),
) -> Result<()> {
    // Layout pass: names, dtypes, shapes and offsets without generating any values.
    let mut entries = serde_json::Map::new();
    entries.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for s in specs {
        let mut push = |name: &str, dtype: &str, shape: &[usize], len: u64| {
            entries.insert(
                name.to_string(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
            );
            offset += len;
        };
        let n = s.shape.iter().product::<usize>() as u64;
        match s.store {
            Store::Fp8 => {
                push(&s.name, "F8_E4M3", &s.shape, n);
                let ss = [s.shape[0].div_ceil(128), s.shape[1].div_ceil(128)];
                push(&scale_name(&s.name), "F32", &ss, 4 * (ss[0] * ss[1]) as u64);
            }
            other => push(&s.name, dtype_name(other), &s.shape, stored_bytes(s)),
        }
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(entries))?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(&header)?;
    for s in specs {
        for e in encode(s, seed) {
            debug_assert!(!e.name.is_empty() && !e.dtype.is_empty() && !e.shape.is_empty());
            w.write_all(&e.bytes)?;
        }
        on_tensor(stored_bytes(s));
    }
    w.flush()?;
    Ok(())
}
