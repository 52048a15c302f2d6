//! The kernels of `kernels/*.cu`, compiled at start-up by NVRTC for the GPU that is actually
//! there, loaded as CUBIN, and cached on disk so later starts skip NVRTC.
//!
//! Sources are embedded with `include_str!`, so the binary needs no kernel files at run time;
//! NVRTC needs the CUDA headers (`cuda_bf16.h`, `cuda_fp8.h`) only when something has to be
//! compiled. A cache entry is keyed by the SHA-256 of (source, NVRTC options with the target
//! architecture, compute capability and NVRTC version; not the header folder, whose headers come
//! with that NVRTC) and carries a checksum of its payload; an entry that is truncated, corrupt or
//! rejected by the driver is rebuilt, never fatal. Not the GPU's name or the driver version: NVRTC
//! writes the same CUBIN for every GPU of one architecture (an H100 and an H200 are both sm_90a),
//! and a driver at least as new as that NVRTC loads it (an older one rejects it: rebuilt), so one
//! cache serves a fleet of mixed cards and drivers. [`precompile`] fills a cache for a GPU that is
//! not there (`imajev-serve precompile-kernels`): the same compile path and keys, so a machine that
//! has the GPU loads the entries instead of spending ~50 s in NVRTC at its first start.

use super::launch::{KernelFile, KERNELS};
use super::CudaOptions;
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Prepended to every kernel file (shared typedefs and reductions).
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// The program NVRTC sees for a kernel file: the common header, then the file (with `#line` so
/// diagnostics name the real file and line).
pub fn full_source(f: &KernelFile) -> String {
    format!("{COMMON}\n#line 1 \"kernels/{}.cu\"\n{}", f.name, f.source)
}

/// NVRTC options for a target architecture and CUDA include directory.
pub fn compile_options(arch: &str, include_dir: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        format!("--include-path={}", include_dir.display()),
        "-lineinfo".to_string(),
    ]
}

/// Cache key: hex SHA-256 over the program, its options (except the header folder, where a
/// toolkit happens to be installed) and the device/driver tag.
pub fn cache_key(source: &str, options: &[String], device_tag: &str) -> String {
    let mut h = Sha256::new();
    let options = options.iter().filter(|o| !o.starts_with("--include-path=")).map(|s| s.as_str());
    for part in std::iter::once(source).chain(options).chain(std::iter::once(device_tag)) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// What a kernel cache entry is keyed by besides the program and its options: the compute
/// capability and the NVRTC version, e.g. `9.0|13.0` (see the module doc for why not the GPU's
/// name or the driver).
pub fn device_tag(cc: (i32, i32), nvrtc: (i32, i32)) -> String {
    format!("{}.{}|{}.{}", cc.0, cc.1, nvrtc.0, nvrtc.1)
}

/// The cache file of kernel file `name` under `key` in `dir`.
fn cache_path(dir: &Path, name: &str, key: &str) -> PathBuf {
    dir.join(format!("{name}-{}.cubin", &key[..32]))
}

/// `$IMAJEV_KERNEL_CACHE`, else `$XDG_CACHE_HOME/imajev-serve/kernels`, else
/// `~/.cache/imajev-serve/kernels`; `None` when none can be determined (then nothing is cached).
pub fn default_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("IMAJEV_KERNEL_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("imajev-serve/kernels")))
        .or_else(|| env("HOME").map(|p| p.join(".cache/imajev-serve/kernels")))
}

/// Where the CUDA headers are: `$CUDA_HOME/include`, `$CUDA_PATH/include`, then
/// `/usr/local/cuda/include`. Returns the first that holds `cuda_bf16.h`, or `Err(default)` with
/// the path that would have been used, when none does.
pub fn cuda_include_dir() -> std::result::Result<PathBuf, PathBuf> {
    let mut candidates = Vec::new();
    for k in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(k).filter(|v| !v.is_empty()) {
            candidates.push(PathBuf::from(v).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    match candidates.iter().find(|p| p.join("cuda_bf16.h").is_file()) {
        Some(p) => Ok(p.clone()),
        None => Err(candidates[0].clone()),
    }
}

const MAGIC: &[u8; 8] = b"IMJCUBN1";

/// Payload of a cache file, or `None` if it is missing, truncated or fails its checksum.
pub fn read_cache(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() < MAGIC.len() + 32 || &bytes[..MAGIC.len()] != MAGIC {
        return None;
    }
    let (sum, payload) = bytes[MAGIC.len()..].split_at(32);
    if payload.is_empty() || Sha256::digest(payload).as_slice() != sum {
        return None;
    }
    Some(payload.to_vec())
}

/// Writes a cache file atomically (temporary file + rename).
pub fn write_cache(path: &Path, payload: &[u8]) -> Result<()> {
    let dir = path.parent().ok_or_else(|| anyhow!("cache path {} has no parent", path.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut bytes = Vec::with_capacity(MAGIC.len() + 32 + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&Sha256::digest(payload));
    bytes.extend_from_slice(payload);
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Compiles one program with NVRTC and returns its CUBIN.
pub fn nvrtc_cubin(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).context("kernel source contains a NUL byte")?;
    let fname = std::ffi::CString::new(format!("{name}.cu"))?;
    let prog =
        result::create_program(&src, Some(&fname)).map_err(|e| anyhow!("nvrtcCreateProgram: {e:?}"))?;
    let out = (|| -> Result<Vec<u8>> {
        // SAFETY: `prog` was created above and is destroyed only after this closure.
        let compiled = unsafe { result::compile_program(prog, options) };
        if let Err(e) = compiled {
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            bail!(
                "NVRTC could not compile kernels/{name}.cu ({e:?}) with {options:?}:\n{}",
                log.trim_end_matches('\0')
            );
        }
        let mut size = 0usize;
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
        if size == 0 {
            bail!(
                "NVRTC produced no CUBIN for kernels/{name}.cu (is --gpu-architecture a real sm_XY target?)"
            );
        }
        let mut buf = vec![0u8; size];
        unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) }
            .result()
            .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
        Ok(buf)
    })();
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The NVRTC version as `major.minor`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((a, b))
}

/// Loads every kernel module: from the disk cache when a valid entry exists, else NVRTC (the
/// missing ones in parallel), writing the cache. Returns the functions and (cached, compiled).
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    options: &CudaOptions,
    arch: &str,
    device_tag: &str,
) -> Result<(HashMap<&'static str, CudaFunction>, usize, usize)> {
    let include = cuda_include_dir();
    let include_path = match &include {
        Ok(p) | Err(p) => p.clone(),
    };
    let opts = compile_options(arch, &include_path);
    let cache_dir = options.kernel_cache_dir.clone().or_else(default_cache_dir);
    struct Job {
        file: KernelFile,
        source: String,
        path: Option<PathBuf>,
        cubin: Option<Vec<u8>>,
    }
    let mut jobs: Vec<Job> = KERNELS
        .iter()
        .map(|f| {
            let source = full_source(f);
            let key = cache_key(&source, &opts, device_tag);
            let path = cache_dir.as_ref().map(|d| cache_path(d, f.name, &key));
            let cubin = path.as_deref().and_then(read_cache);
            Job { file: *f, source, path, cubin }
        })
        .collect();
    let mut modules = HashMap::new();
    let mut cached = 0;
    for j in jobs.iter_mut() {
        if let Some(bin) = &j.cubin {
            match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.clone())) {
                Ok(m) => {
                    modules.insert(j.file.name, m);
                    cached += 1;
                }
                Err(e) => {
                    tracing::warn!(
                        "cached kernels/{}.cu CUBIN was rejected by the driver ({e:?}); rebuilding",
                        j.file.name
                    );
                    j.cubin = None;
                }
            }
        }
    }
    let todo: Vec<&Job> = jobs.iter().filter(|j| !modules.contains_key(j.file.name)).collect();
    let compiled = todo.len();
    if !todo.is_empty() {
        if let Err(p) = &include {
            bail!(
                "NVRTC needs the CUDA headers (cuda_bf16.h, cuda_fp8.h) to build the kernels, and {} has none: set CUDA_HOME \
                 to a CUDA 13 toolkit whose include/ holds cuda_bf16.h (or fill the kernel cache from a machine that has one)",
                p.display()
            );
        }
        tracing::info!(count = todo.len(), arch, "compiling CUDA kernels with NVRTC");
        let bins = compile_all(todo.iter().map(|j| (j.file.name, j.source.as_str())), &opts);
        for (j, bin) in todo.iter().zip(bins) {
            let bin = bin?;
            if let Some(p) = &j.path {
                if let Err(e) = write_cache(p, &bin) {
                    tracing::warn!("could not cache kernels/{}.cu: {e:#}", j.file.name);
                }
            }
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(bin))
                .map_err(|e| anyhow!("loading the CUBIN of kernels/{}.cu: {e:?}", j.file.name))?;
            modules.insert(j.file.name, m);
        }
    }
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SMEM;
    let mut funcs = HashMap::new();
    for file in KERNELS {
        let m = modules.get(file.name).ok_or_else(|| anyhow!("kernels/{}.cu is not loaded", file.name))?;
        for kf in file.functions {
            let f = m
                .load_function(kf.name)
                .map_err(|e| anyhow!("kernels/{}.cu has no function {}: {e:?}", file.name, kf.name))?;
            if kf.max_dynamic_smem > 0 {
                f.set_attribute(MAX_SMEM, kf.max_dynamic_smem as i32)?;
            }
            funcs.insert(kf.name, f);
        }
    }
    Ok((funcs, cached, compiled))
}

/// NVRTC over several programs `(name, source)` at once, one thread each; results in order.
fn compile_all<'a>(
    programs: impl Iterator<Item = (&'a str, &'a str)>,
    opts: &[String],
) -> Vec<Result<Vec<u8>>> {
    std::thread::scope(|s| {
        let hs: Vec<_> =
            programs.map(|(name, source)| s.spawn(move || nvrtc_cubin(name, source, opts))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("NVRTC thread panicked")))).collect()
    })
}

/// Fills `dir` with the cache entries of every kernel file for a GPU of `device_tag` and `arch`
/// (e.g. `sm_90a`), compiled by this machine's NVRTC with the CUDA headers of
/// [`cuda_include_dir`]; no GPU needed. The tag must name this NVRTC's version (the backend keys
/// entries by the NVRTC that would otherwise compile them). Returns the files written.
pub fn precompile(dir: &Path, device_tag: &str, arch: &str) -> Result<Vec<PathBuf>> {
    let include = cuda_include_dir().map_err(|p| {
        anyhow!("NVRTC needs the CUDA headers (cuda_bf16.h): none in {}; set CUDA_HOME", p.display())
    })?;
    let opts = compile_options(arch, &include);
    let sources: Vec<(&str, String)> = KERNELS.iter().map(|f| (f.name, full_source(f))).collect();
    let bins = compile_all(sources.iter().map(|(n, s)| (*n, s.as_str())), &opts);
    let mut written = Vec::new();
    for ((name, source), bin) in sources.iter().zip(bins) {
        let path = cache_path(dir, name, &cache_key(source, &opts, device_tag));
        write_cache(&path, &bin?)?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_embedded_and_names_its_cpu_twin() {
        assert!(COMMON.contains("block_sum"));
        for f in KERNELS {
            assert!(f.source.contains("__global__"), "{} has no kernel", f.name);
            assert!(f.source.contains("CPU twin"), "{} does not name its CPU twin", f.name);
            let full = full_source(f);
            assert!(full.starts_with(COMMON) && full.contains(&format!("#line 1 \"kernels/{}.cu\"", f.name)));
        }
    }

    /// Programmatic dependent launch (`CudaOptions::pdl`) is safe only if no kernel touches memory
    /// before `griddepcontrol.wait`: every entry's first statement must be `pdl_begin()`, macro
    /// entries included (their lines end in backslashes).
    #[test]
    fn every_kernel_entry_begins_with_pdl_begin() {
        let mut entries = 0;
        for f in KERNELS {
            let src = f.source;
            for (at, _) in src.match_indices("extern \"C\" __global__") {
                let rest = &src[at..];
                // The parameter list's end: the first `)` followed (blanks and backslashes aside) by `{`.
                let body = rest
                    .match_indices(')')
                    .map(|(i, _)| rest[i + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\'))
                    .find(|after| after.starts_with('{'))
                    .unwrap_or_else(|| panic!("kernels/{}.cu: an entry without a body", f.name));
                let first = body[1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let name: String = rest.lines().next().unwrap_or("").chars().take(120).collect();
                assert!(
                    first.starts_with("pdl_begin();"),
                    "kernels/{}.cu: `{name}` does not begin with pdl_begin()",
                    f.name
                );
                entries += 1;
            }
        }
        assert!(entries >= 50, "only {entries} kernel entries found");
    }

    #[test]
    fn key_depends_on_every_input() {
        let o = compile_options("sm_90a", Path::new("/usr/local/cuda/include"));
        assert!(o.contains(&"--gpu-architecture=sm_90a".to_string()));
        let k = cache_key("src", &o, "9.0|13.0");
        assert_eq!(k.len(), 64);
        assert_eq!(k, cache_key("src", &o, "9.0|13.0"));
        assert_ne!(k, cache_key("src2", &o, "9.0|13.0"));
        assert_ne!(k, cache_key("src", &o, "9.0|12.8"));
        assert_ne!(
            k,
            cache_key("src", &compile_options("sm_89", Path::new("/usr/local/cuda/include")), "9.0|13.0")
        );
        // Length-prefixed: moving bytes between fields changes the key.
        assert_ne!(cache_key("ab", &["c".into()], "d"), cache_key("a", &["bc".into()], "d"));
        // Not where the headers are: a cache filled elsewhere (precompile) serves this machine.
        let elsewhere = compile_options("sm_90a", Path::new("/opt/pip/nvidia/cu13/include"));
        assert_eq!(k, cache_key("src", &elsewhere, "9.0|13.0"));
        assert_eq!(device_tag((9, 0), (13, 0)), "9.0|13.0");
    }

    /// With NVRTC and the headers present, precompile writes one valid entry per kernel file, at
    /// the path and under the key load_kernels looks up for that device tag, and each entry holds
    /// every function the kernel table names for its file (a name the table lists but no
    /// `extern "C"` entry defines would only fail on a GPU, when the module loads).
    #[test]
    fn precompile_fills_the_cache_load_kernels_reads() {
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } || cuda_include_dir().is_err() {
            eprintln!("skipped: NVRTC or the CUDA headers not found");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let tag = device_tag((9, 0), nvrtc_version().unwrap());
        let written = precompile(dir.path(), &tag, "sm_90a").unwrap();
        assert_eq!(written.len(), KERNELS.len());
        let opts = compile_options("sm_90a", &cuda_include_dir().unwrap());
        for f in KERNELS {
            let p = cache_path(dir.path(), f.name, &cache_key(&full_source(f), &opts, &tag));
            let bin = read_cache(&p).unwrap_or_else(|| panic!("no valid entry for kernels/{}.cu", f.name));
            assert!(bin.starts_with(b"\x7fELF"));
            for func in f.functions {
                // The ELF string table holds each defined symbol's name, NUL-terminated.
                let symbol = [func.name.as_bytes(), b"\0"].concat();
                assert!(
                    bin.windows(symbol.len()).any(|w| w == symbol.as_slice()),
                    "kernels/{}.cu defines no function {}",
                    f.name,
                    func.name
                );
            }
        }
    }

    /// Where NVRTC and the CUDA headers are installed (no GPU needed), every kernel file must
    /// compile for sm_90a through the same path the backend uses; elsewhere this only says so.
    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC (libnvrtc.so) not found");
            return;
        }
        let Ok(include) = cuda_include_dir() else {
            eprintln!("skipped: no CUDA headers (set CUDA_HOME)");
            return;
        };
        let opts = compile_options("sm_90a", &include);
        for f in KERNELS {
            let cubin = nvrtc_cubin(f.name, &full_source(f), &opts).unwrap();
            assert!(cubin.starts_with(b"\x7fELF"), "kernels/{}.cu: not an ELF CUBIN", f.name);
        }
        eprintln!("NVRTC {:?}: {} kernel files compiled for sm_90a", nvrtc_version().unwrap(), KERNELS.len());
    }

    #[test]
    fn cache_round_trip_and_corruption_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/x.cubin");
        assert!(read_cache(&p).is_none());
        write_cache(&p, b"\x7fELF payload").unwrap();
        assert_eq!(read_cache(&p).unwrap(), b"\x7fELF payload");
        // Flip one payload byte: checksum mismatch.
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert!(read_cache(&p).is_none());
        // Truncated and foreign files are misses too.
        std::fs::write(&p, &bytes[..20]).unwrap();
        assert!(read_cache(&p).is_none());
        std::fs::write(&p, b"not a cache file at all, definitely longer than forty bytes").unwrap();
        assert!(read_cache(&p).is_none());
        // A rewrite repairs it.
        write_cache(&p, b"fresh").unwrap();
        assert_eq!(read_cache(&p).unwrap(), b"fresh");
    }
}
