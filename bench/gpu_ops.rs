//! Single-op timings of the CUDA backend at Qwen3.5-4B shapes (a benchmark, not a test: nothing is
//! asserted; correctness is `tests/gpu/`). Compare kernels here, in isolation, before whole
//! requests (`bench/gpu_bench.py`).
//!
//! `cargo run --release --example bench_gpu_ops -- [--json bench/results/h200-ops.json] [--long]
//! [--only gemm,gemm-algos,lora-a-algos,mlp,fp8-own,norm,attention,vision,deltanet,deltanet-wg,narrow,conv] [--lengths 16384]` (`--only`:
//! those groups; `--lengths`: the sequence lengths instead of 2K (4K, 16K with `--long`); e.g.
//! under a profiler)
//!
//! * FP8 and BF16 GEMMs of the three large projection shapes at M = 2048;
//! * only when named in `--only` (`gemm-algos`): every cuBLASLt algorithm a fixed plan could use
//!   for the five FP8 projection shapes and the five narrow BF16 shapes of a forward (the four
//!   LoRA A sides and DeltaNet's b/a projection)
//!   (`Blas::candidates`: the heuristic's answers at the reference M under the plan's split-K
//!   preference), each timed at 977, 7,816 and 16,384 rows or at `--lengths` (FP8-padded), cold
//!   L2, median device time of 20 runs; per
//!   shape the candidate of least total time among those every M accepts, its ratio to today's
//!   pick (the heuristic's first), and whether each such candidate's rows are bitwise equal
//!   across the row counts (a pin must keep batch invariance); last, the `IMAJEV_GEMM_PINS` value
//!   that would pin the winners (see src/backend/cuda/gemm.rs); `lora-a-algos`: the narrow BF16
//!   shapes alone;
//! * only when named in `--only` (`mlp`): Qwen3.5-4B's MLP with rank-64 LoRA at 977, 7,816 and
//!   16,384 rows (or at `--lengths`): on Hopper the gate/up output stored then the SwiGLU kernel
//!   against the GLU form (`swiglu_epilogue`), elsewhere the gate/up LoRA B side as its own GEMM
//!   against it fused into the SwiGLU (`mlp_lora_fused`), and their ratio;
//! * only when named in `--only` (`fp8-own`): the five FP8 projection shapes, plain and with a
//!   rank-64 LoRA, and the 4B MLP with LoRA, on cuBLASLt beside our `gemm_fp8_128` / `_192` and
//!   their clusters of two sharing W (`_128m` / `_192m`; LoRA B in the epilogue), and `_192` with
//!   the LoRA A side on `gemm_bf16_192` / `_64` (`own192+A`; `own192+A whole` never splits its K,
//!   `whole192` also keeps 192-row tiles), at
//!   977, 7,816 and 16,384 rows (or at `--lengths`), with ratios;
//! * RMSNorm with and without the fused FP8 quantisation;
//! * causal gated attention of one sequence (2K, and with `--long` 4K and 16K tokens) and the
//!   benchmark request's passes: 11 forks × 73 tokens over a shared 2K (16K with `--long`)
//!   prefix, TFLOP/s counted over the causal half; the 128-row kernel beside the 64-row one;
//! * the Gated DeltaNet mixer of one sequence and of 11 forks × 73 tokens (their final states
//!   kept, and not kept as the server runs passes; at 2,048 rows also 96 forks × 73 and 96 × 64,
//!   a packed round's passes with and without their 9-row second chunks), once with each
//!   tensor-core chunk scan (plain, pipelined and the wide plain one: the same bits, the rest of
//!   the mixer the same kernels), their difference and ratio; with `IMAJEV_PROFILE=kernels` also
//!   each configuration's kernels and their own device time; the warpgroup scan (`GdnScan::Warpgroup`, Hopper's default) beside the by-length scans
//!   (alone with `--only deltanet-wg`), and its one-warpgroup kernel beside the paired one
//!   (`gdn_wg_pair`) and the lean one (`gdn_wg_lean`);
//! * only when named in `--only` (`conv`): the DeltaNet mixer (warpgroup scan) at 977, 2,048
//!   (with the 11 forks × 73) and 16,304 rows (or at `--lengths`) under each `gdn_conv` tiling
//!   of `IMAJEV_CONV_TILINGS` (default `8x1,8x4,8x16,4x1,4x4,4x16`; the same bits, so only the
//!   conv's time differs: with `IMAJEV_PROFILE=kernels` each run's `gdn_conv_*` line);
//! * the narrow BF16 GEMMs (DeltaNet a/b, LoRA A: n <= 128; LoRA B: k <= 256, accumulating) on
//!   our kernels (split and whole shapes forced, and the default choice) beside cuBLASLt, at
//!   977 rows (the 256-token request's forward), 4K, 16K and 47,692 rows (the 2-image request)
//!   or at `--lengths`;
//! * the cuBLASLt algorithm fixed for each large GEMM shape.

use anyhow::{Context, Result};
use cudarc::driver::{sys::CUevent_flags, CudaContext, CudaSlice, CudaStream, DevicePtr};
use imajev_serve::backend::cuda::deltanet::ConvTiling;
use imajev_serve::backend::cuda::gemm::{Blas, Gemm, GemmKind};
use imajev_serve::backend::cuda::gemm_fp8::Fp8Gemm;
use imajev_serve::backend::cuda::narrow::NarrowGemm;
use imajev_serve::backend::cuda::{AttentionKernel, CudaBackend, CudaOptions, CudaTensor, GdnScan};
use imajev_serve::backend::{AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs};
use imajev_serve::engine::positions;
use imajev_serve::synth;
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;
use imajev_serve::weights::fp8::{fp8_rows, quantize_act_1x128, quantize_fp8_blocks};
use serde_json::json;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// One measured op.
struct Timing {
    name: String,
    ms: f64,
    tflops: Option<f64>,
}

fn time_ms(g: &CudaBackend, iters: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    g.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    g.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

fn tiling(lens: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            at += l;
            at - l..at
        })
        .collect()
}

/// `values` as a BF16 device tensor of `shape` (an upload is F32; a row gather makes it BF16, as
/// the model's activations are).
fn bf16_tensor(g: &CudaBackend, values: &[f32], shape: &[usize]) -> Result<CudaTensor> {
    g.gather_rows(&g.upload(values, shape)?, &(0..shape[0]).collect::<Vec<_>>())
}

/// A BF16 device tensor of random values.
fn bf16_input(g: &CudaBackend, rng: &mut SplitMix, shape: &[usize]) -> Result<CudaTensor> {
    let n: usize = shape.iter().product();
    bf16_tensor(g, &rng.bf16_normals(n, 1.0), shape)
}

/// The FP8 projection GEMMs of a forward of Qwen3.5-4B: (what, N, K, the output's row stride:
/// in_proj's FP8 columns sit beside its 64 BF16 b/a columns, as `CudaLinear` lays them out).
const FP8_SHAPES: [(&str, usize, usize, usize); 5] = [
    ("mlp gate/up", 18432, 2560, 18432),
    ("DeltaNet in_proj qkvz", 12288, 2560, 12352),
    ("attention qkv", 10240, 2560, 10240),
    ("mlp down", 2560, 9216, 2560),
    ("out_proj / o_proj", 2560, 4096, 2560),
];
/// The narrow BF16 GEMMs of a forward of Qwen3.5-4B with the rank-64 adapter, all on cuBLASLt:
/// the LoRA A sides (pairs that read the same input fused into one GEMM, N = the pairs' ranks) and
/// DeltaNet's b/a projection (the BF16 part of in_proj, written beside its FP8 columns):
/// (what, N, K, the output's row stride).
const NARROW_BF16_SHAPES: [(&str, usize, usize, usize); 5] = [
    ("LoRA A in_proj qkv+z, mlp gate+up", 128, 2560, 128),
    ("LoRA A attention q+k+v", 192, 2560, 192),
    ("LoRA A out_proj / o_proj", 64, 4096, 64),
    ("LoRA A mlp down", 64, 9216, 64),
    ("DeltaNet in_proj b/a", 64, 2560, 12352),
];
/// Bytes written before each timed GEMM of `gemm-algos` (twice the H200's 50 MB L2): in a forward
/// a projection's weights come after other layers' weights, never warm from its own last call.
const L2_FLUSH: usize = 128 << 20;

/// FP8 activations of `rows` rows (a multiple of 16) and width `k` as the backend quantises them
/// (`quantize_act_1x128`: E4M3 `[rows][k]`, 1×128 scales `[k/128][rows]`): 1024 random rows,
/// repeated (the values do not change a GEMM's speed, and each row index still has one input
/// whatever the row count, which is all the bitwise check across row counts needs).
fn fp8_activations(rng: &mut SplitMix, rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let base = rows.min(1024);
    let (q, s) = quantize_act_1x128(&rng.bf16_normals(base * k, 1.0), base, k);
    let bpad = fp8_rows(base);
    let q = (0..rows).flat_map(|r| &q[(r % base) * k..(r % base + 1) * k]).copied().collect();
    let s =
        (0..k / 128).flat_map(|kb| (0..rows).map(move |r| (kb, r))).map(|(kb, r)| s[kb * bpad + r % base]);
    (q, s.collect())
}

/// `fp8-own`'s side-by-side rows: the first side (cuBLASLt) sets `base`, each later one prints
/// its time over it.
fn ratio_to_first(base: &mut Option<f64>, label: &str, ms: f64) {
    match *base {
        None => *base = Some(ms),
        Some(b) => println!("  {label} / cuBLASLt = {:.3}", ms / b),
    }
}

/// The device address of `s` (no event guard kept: everything here runs on one stream).
fn dptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    s.device_ptr(stream).0
}

/// Median device time of `f` over 20 runs (after 3 unmeasured), each after writing `flush` so
/// that it starts with a cold L2. CUDA events around each run, so no host time is counted.
fn time_cold(
    stream: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut marks = Vec::new();
    for _ in 0..20 {
        stream.memset_zeros(flush)?;
        let start = stream.record_event(timing)?;
        f()?;
        marks.push((start, stream.record_event(timing)?));
    }
    stream.synchronize()?;
    let mut ms = marks.iter().map(|(a, b)| a.elapsed_ms(b).map(f64::from)).collect::<Result<Vec<_>, _>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

struct Bench<'a> {
    g: &'a CudaBackend,
    rng: SplitMix,
    out: Vec<Timing>,
}

impl Bench<'_> {
    fn push(&mut self, name: String, ms: f64, flop: Option<f64>) {
        let tflops = flop.map(|f| f / ms / 1e9);
        match tflops {
            Some(t) => println!("{name:<62} {ms:9.3} ms  {t:6.0} TFLOP/s"),
            None => println!("{name:<62} {ms:9.3} ms"),
        }
        self.out.push(Timing { name, ms, tflops });
    }

    fn gemms(&mut self) -> Result<()> {
        let (g, m) = (self.g, 2048);
        for (name, n, k) in
            [("in_proj qkvz", 12288usize, 2560usize), ("out_proj", 2560, 4096), ("mlp down", 2560, 9216)]
        {
            let v = self.rng.bf16_normals(n * k, 0.02);
            let x = bf16_input(g, &mut self.rng, &[m, k])?;
            for (fmt, w) in
                [("fp8", MemoryTensor::fp8("w", &[n, k], &v)), ("bf16", MemoryTensor::bf16("w", &[n, k], &v))]
            {
                let l = g.linear(&[w.part()])?;
                let ms = time_ms(g, 10, &mut || g.matmul(&x, &l).map(|_| ()))?;
                self.push(
                    format!("{fmt} GEMM {name} N={n} K={k} M={m} (incl. act quant)"),
                    ms,
                    Some(2.0 * (m * n * k) as f64),
                );
            }
        }
        Ok(())
    }

    /// Qwen3.5-4B's MLP with LoRA (rank 64 on gate, up and down) at `rows` rows, side by side: on
    /// Hopper's own FP8 GEMM the gate/up output stored then `swiglu_quant_1x128`, against the GLU
    /// form (`swiglu_epilogue`: the SwiGLU in the GEMM's epilogue); elsewhere the gate/up LoRA B
    /// side as its own GEMM against it fused into the SwiGLU (`mlp_lora_fused`).
    fn mlp(&mut self, rows: &[usize]) -> Result<()> {
        let g = self.g;
        let hopper = g.info().hopper();
        let (base_label, new_label) =
            if hopper { ("gate/up stored", "GLU form") } else { ("LoRA B GEMM", "LoRA B fused") };
        // (Off Hopper `swiglu_epilogue` does nothing; on Hopper `mlp_lora_fused` does nothing: the
        // own GEMM takes the LoRA B side in its epilogue.)
        let unfused = CudaBackend::new(
            0,
            CudaOptions { mlp_lora_fused: false, swiglu_epilogue: false, ..g.options().clone() },
        )?;
        let fused = CudaBackend::new(
            0,
            CudaOptions { mlp_lora_fused: true, swiglu_epilogue: true, ..g.options().clone() },
        )?;
        let (h, k, r) = (2560usize, 9216usize, 64usize);
        let mut t = |name: &str, shape: &[usize], std: f32, fp8: bool| {
            let v = self.rng.bf16_normals(shape.iter().product(), std);
            if fp8 {
                MemoryTensor::fp8(name, shape, &v)
            } else {
                MemoryTensor::bf16(name, shape, &v)
            }
        };
        let (wg, wu, wd) =
            (t("gate", &[k, h], 0.02, true), t("up", &[k, h], 0.02, true), t("down", &[h, k], 0.02, true));
        let (ga, gb) = (t("gate.A", &[r, h], 0.02, false), t("gate.B", &[k, r], 0.02, false));
        let (ua, ub) = (t("up.A", &[r, h], 0.02, false), t("up.B", &[k, r], 0.02, false));
        let (da, db) = (t("down.A", &[r, k], 0.02, false), t("down.B", &[h, r], 0.02, false));
        let gate_up = [wg.lora_part(&ga, &gb, 2.0), wu.lora_part(&ua, &ub, 2.0)];
        let down = [wd.lora_part(&da, &db, 2.0)];
        for &m in rows {
            let x_h = self.rng.bf16_normals(m * h, 1.0);
            let mut times = Vec::new();
            for (label, be) in [(base_label, &unfused), (new_label, &fused)] {
                let (gu, d) = (be.linear(&gate_up)?, be.linear(&down)?);
                let x = bf16_tensor(be, &x_h, &[m, h])?;
                let ms = time_ms(be, 10, &mut || be.swiglu_mlp(&x, &gu, &d).map(|_| ()))?;
                let flop = 2.0 * (m * 3 * h * k) as f64;
                self.push(format!("MLP 4B + LoRA r{r}, M={m}, {label}"), ms, Some(flop));
                times.push(ms);
                if let Some(report) = be.kernel_report()? {
                    println!("  kernels of the {label} runs (warm-up included):\n{report}");
                }
            }
            println!("  MLP M={m}: {new_label} / {base_label} = {:.3}", times[1] / times[0]);
        }
        Ok(())
    }

    /// `--only fp8-own` (module doc): each FP8 projection shape with a rank-64 LoRA on all its
    /// columns, and the 4B MLP, on cuBLASLt (LoRA B its own GEMM; the MLP's gate/up B fused into
    /// the SwiGLU) beside `gemm_fp8_128`, `gemm_fp8_192` (alone and with the LoRA A side on
    /// `gemm_bf16_192`), their deferred-store forms and `gemm_fp8_192m` (LoRA B in their
    /// epilogue), at `rows` rows; the plain projection (no LoRA) too. Times include the LoRA A
    /// GEMM and the activation quantisation, as a forward runs them.
    fn fp8_own(&mut self, rows: &[usize]) -> Result<()> {
        let g = self.g;
        if !g.info().hopper() {
            println!("fp8-own: not a Hopper GPU, skipped");
            return Ok(());
        }
        // own192+A: the LoRA A side split over K slices up to layout::LORA_A_SPLIT_ROWS rows, whole
        // on 64-row tiles past them (the same bits); own128d / own192d: a tile stored under the
        // next tile's first MMAs.
        let sides: Vec<(&str, CudaBackend)> = [
            ("cuBLASLt", Fp8Gemm::Cublas, false, None, None),
            ("own128", Fp8Gemm::Own128, false, None, None),
            ("own192", Fp8Gemm::Own192, false, None, None),
            ("own192+A", Fp8Gemm::Own192, true, None, None),
            ("own128d", Fp8Gemm::Own128Deferred, false, None, None),
            ("own192d", Fp8Gemm::Own192Deferred, false, None, None),
            ("own192m", Fp8Gemm::Own192Multicast, false, None, None),
        ]
        .into_iter()
        .map(|(l, f, a, split_rows, whole_rows)| {
            let o = CudaOptions {
                fp8_gemm: f,
                lora_a_own: a,
                lora_a_split_rows: split_rows,
                lora_a_whole_rows: whole_rows,
                ..g.options().clone()
            };
            CudaBackend::new(0, o).map(|b| (l, b))
        })
        .collect::<Result<_>>()?;
        let r = 64usize;
        for (what, n, k, _) in FP8_SHAPES {
            let w = MemoryTensor::fp8("w", &[n, k], &self.rng.bf16_normals(n * k, 0.02));
            let a = MemoryTensor::bf16("A", &[r, k], &self.rng.bf16_normals(r * k, 0.02));
            let bm = MemoryTensor::bf16("B", &[n, r], &self.rng.bf16_normals(n * r, 0.02));
            for &m in rows {
                let x_h = self.rng.bf16_normals(m * k, 1.0);
                for (lora, part) in [("", w.part()), (" + LoRA r64", w.lora_part(&a, &bm, 2.0))] {
                    let mut base = None;
                    for (label, be) in &sides {
                        let l = be.linear(std::slice::from_ref(&part))?;
                        let x = bf16_tensor(be, &x_h, &[m, k])?;
                        let ms = time_ms(be, 10, &mut || be.matmul(&x, &l).map(|_| ()))?;
                        let name = format!("fp8 {what} N={n} K={k}{lora} M={m}, {label}");
                        self.push(name, ms, Some(2.0 * (m * n * k) as f64));
                        ratio_to_first(&mut base, label, ms);
                    }
                }
            }
        }
        let (h, k) = (2560usize, 9216usize);
        let mut t = |name: &str, shape: &[usize], fp8: bool| {
            let v = self.rng.bf16_normals(shape.iter().product(), 0.02);
            if fp8 {
                MemoryTensor::fp8(name, shape, &v)
            } else {
                MemoryTensor::bf16(name, shape, &v)
            }
        };
        let (wg, wu, wd) = (t("gate", &[k, h], true), t("up", &[k, h], true), t("down", &[h, k], true));
        let (ga, gb, ua, ub) = (
            t("gA", &[r, h], false),
            t("gB", &[k, r], false),
            t("uA", &[r, h], false),
            t("uB", &[k, r], false),
        );
        let (da, db) = (t("dA", &[r, k], false), t("dB", &[h, r], false));
        let gate_up = [wg.lora_part(&ga, &gb, 2.0), wu.lora_part(&ua, &ub, 2.0)];
        let down = [wd.lora_part(&da, &db, 2.0)];
        for &m in rows {
            let x_h = self.rng.bf16_normals(m * h, 1.0);
            let mut base = None;
            for (label, be) in &sides {
                let (gu, d) = (be.linear(&gate_up)?, be.linear(&down)?);
                let x = bf16_tensor(be, &x_h, &[m, h])?;
                let ms = time_ms(be, 10, &mut || be.swiglu_mlp(&x, &gu, &d).map(|_| ()))?;
                self.push(
                    format!("MLP 4B + LoRA r{r}, M={m}, {label}"),
                    ms,
                    Some(2.0 * (m * 3 * h * k) as f64),
                );
                ratio_to_first(&mut base, label, ms);
                if let Some(report) = be.kernel_report()? {
                    println!("  kernels of the {label} runs (warm-up included):\n{report}");
                }
            }
        }
        Ok(())
    }

    /// `--only gemm-algos` (module doc). Runs on its own stream and `Blas` in the backend's
    /// (primary) context, so it times cuBLASLt's candidates as such, whatever pins are set.
    /// `fp8` false: the narrow BF16 shapes only (`--only lora-a-algos`).
    fn gemm_algos(&mut self, rows: &[usize], fp8: bool) -> Result<()> {
        let ctx = CudaContext::new(self.g.info().ordinal)?;
        let stream = ctx.new_stream()?;
        let blas = Blas::new(stream.clone())?;
        for p in blas.pins() {
            println!("pin in effect for the model (not for the candidates below): {p}");
        }
        let mut ms: Vec<usize> = rows.iter().map(|&m| fp8_rows(m)).collect();
        ms.sort_unstable();
        ms.dedup();
        let mmax = ms[ms.len() - 1];
        let mut flush = stream.alloc_zeros::<u8>(L2_FLUSH)?;
        let mut winners = Vec::new();
        let fp8_shapes: &[_] = if fp8 { &FP8_SHAPES } else { &[] };
        for &(what, n, k, ldy) in fp8_shapes {
            let (wq, ws) = quantize_fp8_blocks(&self.rng.bf16_normals(n * k, 0.02), n, k);
            let (xq, xs) = fp8_activations(&mut self.rng, mmax, k);
            let (wq, ws, xq) = (stream.clone_htod(&wq)?, stream.clone_htod(&ws)?, stream.clone_htod(&xq)?);
            // Each row count's scales: the first `m` rows of the `[k/128][mmax]` ones.
            let xs = ms
                .iter()
                .map(|&m| {
                    let s: Vec<f32> =
                        (0..k / 128).flat_map(|kb| &xs[kb * mmax..kb * mmax + m]).copied().collect();
                    stream.clone_htod(&s)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut y = stream.alloc_zeros::<u16>(mmax * ldy)?;
            let (w, x, yp, w_scale) =
                (dptr(&wq, &stream), dptr(&xq, &stream), dptr(&y, &stream), dptr(&ws, &stream));
            let gemm = |i: usize| Gemm {
                kind: GemmKind::Fp8Block,
                n,
                m: ms[i],
                k,
                w,
                ldw: k,
                x,
                ldx: k,
                y: yp,
                ldy,
                alpha: 1.0,
                beta: 0.0,
                w_scale,
                x_scale: dptr(&xs[i], &stream),
            };
            let name = format!("fp8 GEMM {what} N={n} K={k}");
            winners
                .extend(self.sweep_candidates(&blas, &stream, &mut flush, &ms, &name, &mut y, ldy, &gemm)?);
        }
        // The narrow BF16 shapes (the LoRA A sides, DeltaNet's b/a): planned at a small M with
        // split K allowed (`Blas::plan`'s narrow rule), then run at every M, a packed round's
        // ~7,800 rows too.
        let to_bits =
            |v: Vec<f32>| v.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        for (what, n, k, ldy) in NARROW_BF16_SHAPES {
            let a = stream.clone_htod(&to_bits(self.rng.bf16_normals(n * k, 0.02)))?;
            // 1024 random rows, repeated (as fp8_activations: each row index has one input).
            let base = to_bits(self.rng.bf16_normals(1024 * k, 1.0));
            let x: Vec<u16> =
                (0..mmax).flat_map(|r| &base[(r % 1024) * k..(r % 1024 + 1) * k]).copied().collect();
            let x = stream.clone_htod(&x)?;
            let mut y = stream.alloc_zeros::<u16>(mmax * ldy)?;
            let (w, xp, yp) = (dptr(&a, &stream), dptr(&x, &stream), dptr(&y, &stream));
            let gemm = |i: usize| Gemm {
                kind: GemmKind::Bf16,
                n,
                m: ms[i],
                k,
                w,
                ldw: k,
                x: xp,
                ldx: k,
                y: yp,
                ldy,
                alpha: 1.0,
                beta: 0.0,
                w_scale: 0,
                x_scale: 0,
            };
            let name = format!("bf16 GEMM {what} N={n} K={k}");
            winners
                .extend(self.sweep_candidates(&blas, &stream, &mut flush, &ms, &name, &mut y, ldy, &gemm)?);
        }
        match winners.is_empty() {
            true => println!("\nno shape has a faster fixed candidate than today's pick"),
            false => println!("\nIMAJEV_GEMM_PINS='{}'", winners.join(";")),
        }
        Ok(())
    }

    /// One shape of `gemm-algos`: every candidate cuBLASLt offers for it, timed at each of `ms`
    /// rows (`gemm(i)` is the GEMM at `ms[i]` rows, writing `y` with row stride `ldy`), whether
    /// its rows are bitwise the same at every row count, and the pin proposed for the shape (the
    /// `IMAJEV_GEMM_PINS` entry), if any.
    #[allow(clippy::too_many_arguments)]
    fn sweep_candidates(
        &mut self,
        blas: &Blas,
        stream: &Arc<CudaStream>,
        flush: &mut CudaSlice<u8>,
        ms: &[usize],
        name: &str,
        y: &mut CudaSlice<u16>,
        ldy: usize,
        gemm: &dyn Fn(usize) -> Gemm,
    ) -> Result<Option<String>> {
        let mmin = ms[0];
        let last = gemm(ms.len() - 1);
        let (kind, n, k) = (last.kind, last.n, last.k);
        let cands = blas.candidates(&last)?;
        let flop = |m: usize| 2.0 * (m * n * k) as f64;
        println!(
            "\n{name} (ldy {ldy}): {} candidates at M={} in cuBLASLt's order (* today's pick), \
             median of 20 runs, L2 flushed before each; ms and TFLOP/s:",
            cands.len(),
            imajev_serve::backend::cuda::gemm::reference_m(kind, n)
        );
        let head: String = ms.iter().map(|m| format!("{:>16}", format!("M={m}"))).collect();
        println!("    # rank{head}  total ms    rows  candidate");
        // Per candidate: the time at each row count (None: rejected), the total over them
        // when every count took it, and whether its first `mmin` rows were bitwise the same
        // at every count.
        let mut rows_out = Vec::new();
        for (ci, c) in cands.iter().enumerate() {
            let mut times = Vec::new();
            let mut rejected = Vec::new();
            for (i, m) in ms.iter().enumerate() {
                match time_cold(stream, flush, &mut || blas.run_candidate(&gemm(i), c)) {
                    Ok(t) => times.push(Some(t)),
                    Err(e) => {
                        times.push(None);
                        rejected.push(format!("M={m}: {e:#}"));
                    }
                }
            }
            let total: Option<f64> = times.iter().copied().sum();
            // Bitwise rows across row counts (only for candidates every count takes).
            let invariant = match total {
                Some(_) => {
                    let mut first_rows = Vec::new();
                    for i in (0..ms.len()).rev() {
                        stream.memset_zeros(y)?;
                        blas.run_candidate(&gemm(i), c)?;
                        first_rows.push(stream.clone_dtoh(&y.slice(0..mmin * ldy))?);
                    }
                    Some(first_rows.iter().all(|r| *r == first_rows[0]))
                }
                None => None,
            };
            let cells: String = times
                .iter()
                .zip(ms)
                .map(|(t, &m)| match t {
                    Some(t) => format!("{t:9.3} {:6.0}", flop(m) / t / 1e9),
                    None => format!("{:>16}", "rejected"),
                })
                .collect();
            let mark = if c.heuristic_first { "*" } else { " " };
            let total_s = total.map_or("-".into(), |t| format!("{t:.3}"));
            let inv = match invariant {
                Some(true) => "OK",
                Some(false) => "FAILED",
                None => "-",
            };
            println!("{mark}{ci:>4} {:>4}{cells}  {total_s:>8}  {inv:>6}  {c}", c.rank);
            for r in &rejected {
                println!("           rejected at {r}");
            }
            for (t, &m) in times.iter().zip(ms) {
                if let Some(t) = *t {
                    let today = if c.heuristic_first { " (today's pick)" } else { "" };
                    self.out.push(Timing {
                        name: format!("gemm-algos {name} M={m} [{c}]{today}"),
                        ms: t,
                        tflops: Some(flop(m) / t / 1e9),
                    });
                }
            }
            rows_out.push((total, invariant));
        }
        let today = cands.iter().position(|c| c.heuristic_first).context("today's pick is a candidate")?;
        let best_of = |need_invariant: bool| {
            (0..cands.len())
                .filter(|&i| !need_invariant || rows_out[i].1 == Some(true))
                .filter_map(|i| rows_out[i].0.map(|t| (i, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
        };
        // Today's total, None when some row count rejects it (the plan falls back per M there).
        let today_total = rows_out[today].0;
        let vs_today = |t: f64| match today_total {
            Some(d) => format!("{:.3}x today's pick ({d:.3} ms)", t / d),
            None => "today's pick is rejected at some row count".to_string(),
        };
        let Some((best, best_total)) = best_of(false) else {
            println!("  no candidate is accepted at every row count");
            return Ok(None);
        };
        println!(
            "  best fixed candidate #{best}: {best_total:.3} ms over the row counts, {}: {}",
            vs_today(best_total),
            cands[best]
        );
        let inv = if rows_out[best].1 == Some(true) { "OK" } else { "FAILED" };
        let counts = ms.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", ");
        let one = if ms.len() < 2 { " (one row count: nothing compared)" } else { "" };
        println!("  row invariance (rows 0..{mmin} at M={counts}): {inv}{one}");
        self.out.push(Timing {
            name: format!(
                "gemm-algos {name} best over M={counts}: [{}], {}, row invariance {inv}",
                cands[best],
                vs_today(best_total)
            ),
            ms: best_total,
            tflops: None,
        });
        // A pin is proposed for the fastest candidate with bitwise rows when it beats today's
        // pick by at least 1% (less is within the noise of 20 runs), or when today's pick
        // needs a per-M fallback somewhere.
        match best_of(true) {
            Some((b, _)) if b == today => {
                println!("  no pin: today's pick is the fastest fixed candidate with bitwise rows")
            }
            Some((b, t)) if today_total.is_none_or(|d| t < 0.99 * d) => {
                if b != best {
                    println!("  fastest with bitwise rows: #{b}, {}: {}", vs_today(t), cands[b]);
                }
                println!("  pin: {}", cands[b].pin());
                return Ok(Some(cands[b].pin().to_string()));
            }
            Some((b, _)) => {
                println!("  no pin: the fastest with bitwise rows (#{b}) is within 1% of today's pick")
            }
            None => println!("  no pin: no candidate kept its rows bitwise across the row counts"),
        }
        Ok(None)
    }

    /// The row norms at `m` rows each: RMSNorm and the residual add + RMSNorm at the text width
    /// (2,560: the input and post-attention norms, with the FP8 quantisation of their output, as
    /// in a forward), the residual add + LayerNorm at the vision tower's width (1,024), and
    /// at 2,048 rows the norm + a small FP8 projection with the quantisation fused vs in its own
    /// launch.
    fn norms(&mut self, lengths: &[usize]) -> Result<()> {
        let g = self.g;
        // An FP8 projection loaded first: the norms then write their output's FP8 quantisation
        // (the `_quant` kernels a forward runs), as they do once a model is loaded.
        let wp = MemoryTensor::fp8("w", &[128, 2560], &self.rng.bf16_normals(128 * 2560, 0.02));
        let _fp8 = g.linear(&[wp.part()])?;
        for &m in lengths {
            let iters = if m > 8192 { 10 } else { 20 };
            let d = 2560;
            let x = bf16_input(g, &mut self.rng, &[m, d])?;
            let y = bf16_input(g, &mut self.rng, &[m, d])?;
            let w = g.upload(&self.rng.bf16_normals(d, 0.1), &[d])?;
            // Each line says whether its own kernel wrote the quantisation.
            let what = |t: CudaTensor| if t.has_fp8_activations() { " + fused FP8 quantisation" } else { "" };
            let fused = what(g.rms_norm(&x, &w, 1e-6, 1.0)?);
            let ms = time_ms(g, iters, &mut || g.rms_norm(&x, &w, 1e-6, 1.0).map(|_| ()))?;
            self.push(format!("rms_norm [{m}, {d}]{fused}"), ms, None);
            // The residual grows by y each call; its values do not change the kernel's work.
            let mut res = bf16_input(g, &mut self.rng, &[m, d])?;
            let fused = what(g.add_rms_norm(&mut res, &y, &w, 1e-6, 1.0)?);
            let ms = time_ms(g, iters, &mut || g.add_rms_norm(&mut res, &y, &w, 1e-6, 1.0).map(|_| ()))?;
            self.push(format!("add_rms_norm [{m}, {d}]{fused}"), ms, None);
            let dv = 1024;
            let yv = bf16_input(g, &mut self.rng, &[m, dv])?;
            let wv = g.upload(&self.rng.bf16_normals(dv, 0.1), &[dv])?;
            let bv = g.upload(&self.rng.bf16_normals(dv, 0.1), &[dv])?;
            let mut resv = bf16_input(g, &mut self.rng, &[m, dv])?;
            let fused = what(g.add_layer_norm(&mut resv, &yv, &wv, &bv, 1e-6)?);
            let ms = time_ms(g, iters, &mut || g.add_layer_norm(&mut resv, &yv, &wv, &bv, 1e-6).map(|_| ()))?;
            self.push(format!("add_layer_norm [{m}, {dv}]{fused}"), ms, None);
        }
        // Norm + a small FP8 projection (N = 128), fused vs the quantisation in its own kernel.
        let (m, d) = (2048, 2560);
        let u = CudaBackend::new(0, CudaOptions { unfused_act_quant: true, ..g.options().clone() })?;
        let xv = self.rng.bf16_normals(m * d, 1.0);
        let wv = self.rng.bf16_normals(d, 0.1);
        for (label, be) in [("fused quantisation", g), ("quant_act_1x128 launch", &u)] {
            let l = be.linear(&[wp.part()])?;
            let x = bf16_tensor(be, &xv, &[m, d])?;
            let w = be.upload(&wv, &[d])?;
            let ms = time_ms(be, 20, &mut || be.matmul(&be.rms_norm(&x, &w, 1e-6, 1.0)?, &l).map(|_| ()))?;
            self.push(format!("rms_norm + fp8 GEMM N=128 [{m}, {d}], {label}"), ms, None);
        }
        Ok(())
    }

    /// The narrow BF16 GEMMs at `m` rows on each backend of `sides` (the same inputs): narrow
    /// outputs `y = x·wᵀ` (n <= 128) and LoRA B's `y += 2·t·Bᵀ` (k = the fused rank).
    fn narrow(&mut self, sides: &[(&str, &CudaBackend)], m: usize) -> Result<()> {
        let iters = if m > 8192 { 5 } else { 20 };
        for (what, n, k, beta) in [
            ("DeltaNet a/b, LoRA A r64", 64usize, 2560usize, 0.0f32),
            ("LoRA A r128 (two parts)", 128, 2560, 0.0),
            ("LoRA A r64 of the down projection", 64, 9216, 0.0),
            ("LoRA B r64 (o_proj, out_proj, down)", 2560, 64, 1.0),
            ("LoRA B r128 (in_proj, two parts)", 12288, 128, 1.0),
            ("LoRA B r128 (gate/up)", 18432, 128, 1.0),
        ] {
            let xv = self.rng.bf16_normals(m * k, 1.0);
            let wv = self.rng.bf16_normals(n * k, 0.02);
            let mut first = None;
            // The split/whole choice is the narrow-output kernel's: LoRA B runs on the first two.
            let sides = if beta == 0.0 { sides } else { &sides[..2.min(sides.len())] };
            for &(label, g) in sides {
                let (x, w) = (bf16_tensor(g, &xv, &[m, k])?, bf16_tensor(g, &wv, &[n, k])?);
                let mut y = bf16_tensor(g, &vec![0.0; m * n], &[m, n])?;
                let ms = time_ms(g, iters, &mut || g.bf16_gemm(&x, &w, &mut y, 2.0, beta))?;
                let vs = match first {
                    None => {
                        first = Some(ms);
                        String::new()
                    }
                    Some(f) => format!(" ({:.2}x the first)", ms / f),
                };
                self.push(
                    format!("narrow {what} N={n} K={k} M={m}, {label}{vs}"),
                    ms,
                    Some(2.0 * (m * n * k) as f64),
                );
            }
        }
        Ok(())
    }

    /// Causal attention of one sequence of `m` tokens, and 11 passes of 73 tokens over a shared
    /// prefix of `m` tokens (as the benchmark request's passes).
    fn attention(&mut self, g: &CudaBackend, kernel: &str, dims: AttentionDims, m: usize) -> Result<()> {
        let AttentionDims { heads, head_dim: hd, rotary_dim: rot, .. } = dims;
        let per_pair = 4.0 * (heads * hd) as f64; // q·k and p·v, 2 FLOP each per (query, key, dim)
        let nw = g.upload(&self.rng.bf16_normals(hd, 0.1), &[hd])?;
        let tables = |start: usize, n: usize| -> Result<_> {
            let pos: Vec<i64> = (start as i64..(start + n) as i64).collect();
            let (cos, sin) =
                positions::text_rope_tables(&[pos.clone(), pos.clone(), pos], 1e7, rot, [11, 11, 10]);
            Ok((g.upload(&cos, &[n, rot])?, g.upload(&sin, &[n, rot])?))
        };
        let qkv = bf16_input(g, &mut self.rng, &[m, dims.qkv_width()])?;
        let (cos, sin) = tables(0, m)?;
        let inputs = AttentionInputs { qkv: &qkv, q_norm: &nw, k_norm: &nw, cos: &cos, sin: &sin };
        let iters = if m > 8192 { 3 } else { 5 };
        let ms = time_ms(g, iters, &mut || {
            let mut c = g.new_kv_cache(&dims)?;
            g.gated_attention(&inputs, &dims, &tiling(&[m]), &[], &mut [&mut c]).map(|_| ())
        })?;
        self.push(
            format!("gated_attention 4B, 1×{m} tokens causal, {kernel}"),
            ms,
            Some(per_pair * (m * m) as f64 / 2.0),
        );
        // The prefix's cache, shared; 11 forks continue it by 73 tokens each.
        let mut prefix = g.new_kv_cache(&dims)?;
        g.gated_attention(&inputs, &dims, &tiling(&[m]), &[], &mut [&mut prefix])?;
        g.share_kv(&mut prefix)?;
        let lens = [73usize; 11];
        let n: usize = lens.iter().sum();
        let qkv = bf16_input(g, &mut self.rng, &[n, dims.qkv_width()])?;
        let (cos, sin) = tables(m, n)?;
        let inputs = AttentionInputs { qkv: &qkv, q_norm: &nw, k_norm: &nw, cos: &cos, sin: &sin };
        let ms = time_ms(g, 5, &mut || {
            let mut forks: Vec<_> = lens.iter().map(|_| prefix.clone()).collect();
            let mut refs: Vec<_> = forks.iter_mut().collect();
            g.gated_attention(&inputs, &dims, &tiling(&lens), &[], &mut refs).map(|_| ())
        })?;
        let pairs: f64 = lens.iter().map(|&l| (l * m) as f64 + (l * l) as f64 / 2.0).sum();
        self.push(
            format!("gated_attention 4B, 11 passes × 73 over a {m}-token prefix, {kernel}"),
            ms,
            Some(per_pair * pairs),
        );
        Ok(())
    }

    /// The vision tower's bidirectional attention over one image of `m` patches (16 heads of 64).
    fn vision(&mut self, g: &CudaBackend, kernel: &str, m: usize) -> Result<()> {
        let (heads, hd) = (16usize, 64usize);
        let qkv = bf16_input(g, &mut self.rng, &[m, 3 * heads * hd])?;
        let ang: Vec<f32> = (0..m * hd).map(|i| (i % 977) as f32 * 0.01).collect();
        let cos = g.upload(&ang.iter().map(|a| a.cos()).collect::<Vec<_>>(), &[m, hd])?;
        let sin = g.upload(&ang.iter().map(|a| a.sin()).collect::<Vec<_>>(), &[m, hd])?;
        let ms =
            time_ms(g, 3, &mut || g.vision_attention(&qkv, &cos, &sin, heads, &tiling(&[m])).map(|_| ()))?;
        self.push(
            format!("vision_attention 16×64, 1×{m} patches, {kernel}"),
            ms,
            Some(4.0 * (heads * hd) as f64 * (m * m) as f64),
        );
        Ok(())
    }

    /// The Gated DeltaNet mixer of one sequence of `m` tokens and, with `forks`, of 11 forks × 73
    /// tokens of one state, on each backend of `scans` (the same inputs uploaded to each).
    fn deltanet(
        &mut self,
        scans: &[(&str, &CudaBackend)],
        dims: DeltaNetDims,
        m: usize,
        forks: bool,
    ) -> Result<()> {
        let (ch, pw, vh, dv) = (dims.conv_channels(), dims.proj_width(), dims.value_heads, dims.value_dim);
        let proj_h = self.rng.bf16_normals(m * pw, 1.0);
        let conv_h = self.rng.bf16_normals(ch * 4, 0.5);
        let lens = [73usize; 11];
        let mut single = Vec::new();
        let mut forked = Vec::new();
        for &(label, g) in scans {
            let proj = bf16_tensor(g, &proj_h, &[m, pw])?;
            let conv = bf16_tensor(g, &conv_h, &[ch, 4])?;
            let (alog, dtb, nw) = (
                g.upload(&vec![1.0; vh], &[vh])?,
                g.upload(&vec![0.0; vh], &[vh])?,
                g.upload(&vec![1.0; dv], &[dv])?,
            );
            let inputs = DeltaNetInputs {
                proj: &proj,
                conv_weight: &conv,
                a_log: &alog,
                dt_bias: &dtb,
                norm_weight: &nw,
            };
            // Each configuration's kernels (the profiler's report drains its events).
            let report = |what: &str| -> Result<()> {
                if let Some(report) = g.kernel_report()? {
                    println!("  kernels of the {label} runs, {what} (warm-up included):\n{report}");
                }
                Ok(())
            };
            let ms = time_ms(g, 5, &mut || {
                let mut s = g.new_delta_state(&dims)?;
                g.gated_delta_net(&inputs, &dims, &tiling(&[m]), &[], &mut [&mut s], &[]).map(|_| ())
            })?;
            self.push(format!("gated_delta_net 4B, 1×{m} tokens, {label}"), ms, None);
            single.push(ms);
            report(&format!("1×{m}"))?;
            if forks {
                // `lens.len()` forks of one state, read out only (their final states not kept, as
                // the server runs passes) and, with `kept`, also with their states kept.
                let passes = |lens: &[usize], x: &CudaTensor, kept: bool| -> Result<(f64, f64)> {
                    let base = g.new_delta_state(&dims)?;
                    let inputs = DeltaNetInputs { proj: x, ..inputs };
                    let run = |keep: &[bool]| {
                        time_ms(g, 5, &mut || {
                            let mut forks: Vec<_> = lens.iter().map(|_| base.clone()).collect();
                            let mut refs: Vec<_> = forks.iter_mut().collect();
                            g.gated_delta_net(&inputs, &dims, &tiling(lens), &[], &mut refs, keep).map(|_| ())
                        })
                    };
                    let ms = if kept { run(&[])? } else { f64::NAN };
                    let unkept = run(&vec![false; lens.len()])?;
                    Ok((ms, unkept))
                };
                // The benchmark request's passes: 11 forks of one state, 73 tokens each (two chunks).
                let n: usize = lens.iter().sum();
                let x = g.gather_rows(&proj, &(0..n).collect::<Vec<_>>())?;
                let (ms, unkept) = passes(&lens, &x, true)?;
                self.push(format!("gated_delta_net 4B, 11 forks × 73 tokens, {label}"), ms, None);
                self.push(
                    format!("gated_delta_net 4B, 11 forks × 73 tokens, states not kept, {label}"),
                    unkept,
                    None,
                );
                forked.push(ms);
                report("11 forks × 73")?;
                // A packed round's passes (8 requests × 12 sequences): 73 tokens (a full chunk
                // and a 9-row one) against 64 (the full chunk alone): what the short chunks cost.
                let round_h = self.rng.bf16_normals(96 * 73 * pw, 1.0);
                let round = bf16_tensor(g, &round_h, &[96 * 73, pw])?;
                for len in [73usize, 64] {
                    let x = g.gather_rows(&round, &(0..96 * len).collect::<Vec<_>>())?;
                    let (_, unkept) = passes(&[len; 96], &x, false)?;
                    self.push(
                        format!("gated_delta_net 4B, 96 forks × {len} tokens, states not kept, {label}"),
                        unkept,
                        None,
                    );
                    report(&format!("96 forks × {len}"))?;
                }
            }
        }
        for (what, t) in [(format!("1×{m} tokens"), &single), ("11 forks × 73".to_string(), &forked)] {
            if let [a, b] = t[..] {
                println!(
                    "  {what}: {} − {} = {:.3} ms per layer, ratio {:.2}",
                    scans[0].0,
                    scans[1].0,
                    a - b,
                    a / b
                );
            }
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json_out = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let long = args.iter().any(|a| a == "--long");
    const GROUPS: [&str; 12] = [
        "conv",
        "gemm",
        "gemm-algos",
        "lora-a-algos",
        "mlp",
        "fp8-own",
        "norm",
        "attention",
        "vision",
        "deltanet",
        "deltanet-wg",
        "narrow",
    ];
    let only: Option<Vec<String>> = args.iter().position(|a| a == "--only").map(|i| match args.get(i + 1) {
        Some(v) => v.split(',').map(str::to_string).collect(),
        None => Vec::new(),
    });
    if let Some(o) = &only {
        if o.is_empty() || o.iter().any(|x| !GROUPS.contains(&x.as_str())) {
            anyhow::bail!("--only takes a comma-separated list of {}", GROUPS.join(","));
        }
    }
    let run = |group: &str| only.as_ref().is_none_or(|o| o.iter().any(|x| x == group));
    // `gemm-algos` only when asked for by name (it times ~100 GEMMs per shape).
    let named = |group: &str| only.as_ref().is_some_and(|o| o.iter().any(|x| x == group));
    let g = CudaBackend::new(0, CudaOptions::default()).context("this benchmark needs a CUDA GPU")?;
    println!("{}", g.describe());
    let t = synth::preset("qwen3.5-4b")?.text_config;
    let (attn, delta) = (t.attention_dims()?, t.deltanet_dims());
    let mut b = Bench { g: &g, rng: SplitMix::new(99), out: Vec::new() };
    if run("gemm") {
        b.gemms()?;
    }
    let lengths_arg: Option<Vec<usize>> = match args.iter().position(|a| a == "--lengths") {
        Some(i) => Some(
            args.get(i + 1)
                .map(|v| v.split(',').map(str::parse).collect::<Result<Vec<usize>, _>>())
                .transpose()?
                .filter(|l| !l.is_empty())
                .context("--lengths takes a comma-separated list of token counts, e.g. 16384")?,
        ),
        None => None,
    };
    if run("norm") {
        b.norms(lengths_arg.as_deref().unwrap_or(&[977, 4817, 16304]))?;
    }
    if named("mlp") {
        b.mlp(lengths_arg.as_deref().unwrap_or(&[977, 7816, 16384]))?;
    }
    if named("fp8-own") {
        b.fp8_own(lengths_arg.as_deref().unwrap_or(&[977, 7816, 16384]))?;
    }
    if named("gemm-algos") || named("lora-a-algos") {
        b.gemm_algos(lengths_arg.as_deref().unwrap_or(&[977, 7816, 16384]), named("gemm-algos"))?;
    }
    let lengths: &[usize] = match &lengths_arg {
        Some(l) => l,
        None if long => &[2048, 4096, 16384],
        None => &[2048],
    };
    let q64 = CudaBackend::new(0, CudaOptions { attention: AttentionKernel::Rows64, ..g.options().clone() })?;
    let hopper = g.info().hopper();
    let q128 =
        CudaBackend::new(0, CudaOptions { attention: AttentionKernel::Rows128, ..g.options().clone() })?;
    let wg = CudaBackend::new(0, CudaOptions { attention: AttentionKernel::Wgmma, ..g.options().clone() })?;
    let ov = CudaBackend::new(0, CudaOptions { attention: AttentionKernel::Overlap, ..g.options().clone() })?;
    let k128 =
        CudaBackend::new(0, CudaOptions { attention: AttentionKernel::WgmmaK128, ..g.options().clone() })?;
    let grouped =
        CudaBackend::new(0, CudaOptions { attention: AttentionKernel::WgmmaGrouped, ..g.options().clone() })?;
    let grouped3 = CudaBackend::new(
        0,
        CudaOptions { attention: AttentionKernel::WgmmaGrouped3, ..g.options().clone() },
    )?;
    let tsum = CudaBackend::new(
        0,
        CudaOptions { attention: AttentionKernel::WgmmaTensorSums, ..g.options().clone() },
    )?;
    let ws3 = CudaBackend::new(
        0,
        CudaOptions { attention: AttentionKernel::WarpSpecialized3, ..g.options().clone() },
    )?;
    // The two-consumer warp-specialised kernel: its key/value tiles come by TMA since the
    // thirtieth session (with cp.async copies it was slower than wgmma, NOTES); at head dim 256
    // beside wgmma. Its three-consumer form (192 query rows, vision only) is in the vision rows.
    let ws = CudaBackend::new(
        0,
        CudaOptions { attention: AttentionKernel::WarpSpecialized, ..g.options().clone() },
    )?;
    for &m in lengths.iter().filter(|_| run("attention")) {
        b.attention(&q128, "128-row tiles", attn, m)?;
        b.attention(&q64, "64-row tiles", attn, m)?;
        if hopper {
            b.attention(&wg, "wgmma", attn, m)?;
            b.attention(&grouped, "wgmma, grouped order", attn, m)?;
            b.attention(&ov, "wgmma, softmax overlapped", attn, m)?;
            b.attention(&ws, "warp-specialised, TMA", attn, m)?;
        }
    }
    for &m in lengths.iter().filter(|_| run("vision")) {
        b.vision(&q128, "128-row tiles", m)?;
        b.vision(&q64, "64-row tiles", m)?;
        if hopper {
            b.vision(&wg, "wgmma", m)?;
            b.vision(&ov, "wgmma, softmax overlapped", m)?;
            b.vision(&k128, "wgmma, 128-key tiles", m)?;
            b.vision(&grouped, "wgmma, 128-key tiles, grouped order", m)?;
            b.vision(&grouped3, "wgmma, 128-key tiles, grouped order, 3 buffers", m)?;
            b.vision(&tsum, "wgmma, 128-key tiles, tensor-core sums", m)?;
            b.vision(&ws3, "warp-specialised, 3 consumers", m)?;
        }
    }
    // One 4096² photo: 65,536 patches, the vision attention of the long requests.
    if long && hopper && run("vision") {
        b.vision(&wg, "wgmma", 65_536)?;
        b.vision(&ov, "wgmma, softmax overlapped", 65_536)?;
        b.vision(&k128, "wgmma, 128-key tiles", 65_536)?;
        b.vision(&grouped, "wgmma, 128-key tiles, grouped order", 65_536)?;
        b.vision(&grouped3, "wgmma, 128-key tiles, grouped order, 3 buffers", 65_536)?;
        b.vision(&tsum, "wgmma, 128-key tiles, tensor-core sums", 65_536)?;
        b.vision(&ws3, "warp-specialised, 3 consumers", 65_536)?;
    }
    if run("narrow") {
        let side = |narrow_gemm, narrow_whole_rows| {
            CudaBackend::new(0, CudaOptions { narrow_gemm, narrow_whole_rows, ..g.options().clone() })
        };
        let ours = side(NarrowGemm::Both, None)?;
        let split = side(NarrowGemm::Both, Some(usize::MAX))?;
        let whole = side(NarrowGemm::Both, Some(0))?;
        let cublas = side(NarrowGemm::Cublas, None)?;
        let sides = [("cuBLASLt", &cublas), ("ours", &ours), ("ours split", &split), ("ours whole", &whole)];
        let rows: &[usize] = match &lengths_arg {
            Some(l) => l,
            None => &[977, 4096, 16384, 47692],
        };
        for &m in rows {
            b.narrow(&sides, m)?;
        }
    }
    // Both tensor-core chunk scans side by side (each forced; the mixer's other kernels are the same).
    let scan = |gdn_scan, gdn_tf32| {
        CudaBackend::new(0, CudaOptions { gdn_ffma: false, gdn_scan, gdn_tf32, ..g.options().clone() })
    };
    let (plain, piped) = (scan(GdnScan::Plain, false)?, scan(GdnScan::Pipelined, false)?);
    if plain.options().gdn_ffma {
        println!("IMAJEV_GDN_FFMA=1 is set: both DeltaNet rows below are the FMA scan");
    }
    let scans = [("plain tc scan", &plain), ("pipelined tc scan", &piped)];
    // The one-TF32-MMA products (`gdn_tf32`), each beside its 3xTF32 twin (the ratio line).
    let (plain1, piped1) = (scan(GdnScan::Plain, true)?, scan(GdnScan::Pipelined, true)?);
    // The split delta rule (`GdnScan::Split`), each beside the pipelined scan of its precision.
    let (split3, split1) = (scan(GdnScan::Split, false)?, scan(GdnScan::Split, true)?);
    // The wide plain scan (one block per head over all value columns) beside the plain one.
    let wide1 = scan(GdnScan::Wide, true)?;
    let tf32 = [
        [("plain tc scan", &plain), ("plain TF32 scan", &plain1)],
        [("pipelined tc scan", &piped), ("pipelined TF32 scan", &piped1)],
        [("plain TF32 scan", &plain1), ("wide TF32 scan", &wide1)],
        [("pipelined tc scan", &piped), ("split 3xTF32", &split3)],
        [("pipelined TF32 scan", &piped1), ("split TF32", &split1)],
    ];
    // The warpgroup scan (its own prep and scan; the default on Hopper) beside the by-length scans
    // (the default elsewhere).
    let (by_length, warpgroup) = (scan(GdnScan::ByLength, true)?, scan(GdnScan::Warpgroup, true)?);
    let wg_pair = [("by-length scans", &by_length), ("warpgroup scan", &warpgroup)];
    // Its two kernels (the same bits), each forced.
    let wg_kernel = |producer| {
        CudaBackend::new(
            0,
            CudaOptions {
                gdn_wg_producer: Some(producer),
                gdn_wg_lean: false,
                ..warpgroup.options().clone()
            },
        )
    };
    let (wg_one, wg_producer) = (wg_kernel(false)?, wg_kernel(true)?);
    let wg_kernels = [("warpgroup, one warpgroup", &wg_one), ("warpgroup, producer", &wg_producer)];
    // The one-warpgroup kernel beside the paired one (two warpgroups a block sharing the copies).
    let wg_paired = CudaBackend::new(
        0,
        CudaOptions { gdn_wg_producer: Some(false), gdn_wg_pair: true, ..warpgroup.options().clone() },
    )?;
    let wg_pairing = [("warpgroup, one warpgroup", &wg_one), ("warpgroup, paired", &wg_paired)];
    let wg_lean = CudaBackend::new(
        0,
        CudaOptions { gdn_wg_producer: Some(false), gdn_wg_lean: true, ..warpgroup.options().clone() },
    )?;
    let wg_leaning = [("warpgroup, one warpgroup", &wg_one), ("warpgroup, lean", &wg_lean)];
    if named("conv") {
        let list =
            std::env::var("IMAJEV_CONV_TILINGS").unwrap_or_else(|_| "8x1,8x4,8x16,4x1,4x4,4x16".into());
        let mut tilings = Vec::new();
        for t in list.split(',') {
            let tiling: ConvTiling = t.parse().map_err(|e| anyhow::anyhow!("IMAJEV_CONV_TILINGS: {e}"))?;
            let be =
                CudaBackend::new(0, CudaOptions { gdn_conv: Some(tiling), ..warpgroup.options().clone() })?;
            tilings.push((format!("conv {t}"), be));
        }
        for &m in lengths_arg.as_deref().unwrap_or(&[977, 2048, 16304]) {
            for (label, be) in &tilings {
                b.deltanet(&[(label, be)], delta, m, m == 2048)?;
            }
        }
    }
    for &m in lengths.iter().filter(|_| run("deltanet")) {
        b.deltanet(&scans, delta, m, m == 2048)?;
        for pair in &tf32 {
            b.deltanet(pair, delta, m, m == 2048)?;
        }
    }
    for &m in lengths.iter().filter(|_| run("deltanet") || run("deltanet-wg")) {
        b.deltanet(&wg_pair, delta, m, m == 2048)?;
        b.deltanet(&wg_kernels, delta, m, m == 2048)?;
        b.deltanet(&wg_pairing, delta, m, m == 2048)?;
        b.deltanet(&wg_leaning, delta, m, m == 2048)?;
    }
    println!(
        "\ncuBLASLt plans of the large shapes (algorithm fixed per shape at M={}):",
        imajev_serve::backend::cuda::gemm::M_REF
    );
    for p in g.gemm_plans().iter().filter(|p| p.n * p.k >= 1 << 20) {
        let config = p.config.map_or("(no config)".into(), |c| c.to_string());
        let pinned = if p.pinned { ", pinned" } else { "" };
        println!("  {:?} N={} K={}: {config}{pinned}", p.kind, p.n, p.k);
    }
    println!("GEMM calls that left their fixed algorithm: {}", g.gemm_fallbacks());
    if let Some(path) = json_out {
        let info = g.info();
        let doc = json!({
            "command": args.join(" "),
            "gpu": info.name,
            "driver": info.driver_version,
            "cublaslt": info.cublaslt_version,
            "ops": b.out.iter().map(|t| json!({"name": t.name, "ms": t.ms, "tflops": t.tflops})).collect::<Vec<_>>(),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
