//! The CUDA backend against the CPU reference (which matches transformers fp32, `tests/golden.rs`).
//!
//! Runs on a machine with an NVIDIA GPU; elsewhere it prints `skipped: no CUDA device (...)` and
//! passes. Three parts, one table at the end:
//! (a) every op of the `Backend` trait on random inputs of Qwen3.5-4B and ragged shapes,
//!     including the FP8 GEMM against a GEMM of its own dequantised operands with activation
//!     magnitudes that vary per (row, 128-block), the activation quantiser against its CPU twin,
//!     bitwise batch invariance of the GEMMs, and the row norms with the FP8 quantisation of their
//!     output fused in (`*_quant`) bitwise against the norm + `quant_act_1x128`;
//! (b) the whole engine (vision + decoder + LoRA + readout) on the golden tiny models, and a
//!     4B-wide 4-layer FP8 model with and without the fused norm quantisation (bitwise);
//! (c) prefix + extend of forks on the GPU equals full GPU forwards, forks are independent, and a
//!     sequence's result does not depend on what else is in the batch.
//!
//! Errors are `max |gpu − cpu| / max |cpu|`; BF16 activations give ~4e-3 per rounding, so op
//! tolerances are 1e-2..2e-2 and the engine's 3e-2.

use anyhow::{anyhow, ensure, Result};
use imajev_serve::backend::cpu::{kernels::matmul_xwt, CpuBackend};
use imajev_serve::backend::cuda::{host, CudaBackend, CudaLinear, CudaOptions, CudaTensor};
use imajev_serve::backend::{
    AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart,
    LoraPair,
};
use imajev_serve::synth::{self, SynthDtype};
use imajev_serve::weights::{dequantize_fp8_blocks, ScaleRef, StoredDtype, TensorRef};
use imajev_serve::engine::{positions, Qwen35};
use imajev_serve::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig};
use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::Value;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// Report

struct Row {
    part: &'static str,
    name: String,
    value: f64,
    tol: f64,
    ok: bool,
    note: String,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
}

impl Report {
    fn check(&mut self, part: &'static str, name: impl Into<String>, value: f64, tol: f64) -> bool {
        let ok = value.is_finite() && value <= tol;
        self.rows.push(Row {
            part,
            name: name.into(),
            value,
            tol,
            ok,
            note: String::new(),
        });
        ok
    }
    fn flag(
        &mut self,
        part: &'static str,
        name: impl Into<String>,
        ok: bool,
        note: impl Into<String>,
    ) {
        self.rows.push(Row {
            part,
            name: name.into(),
            value: f64::NAN,
            tol: f64::NAN,
            ok,
            note: note.into(),
        });
    }
    fn info(
        &mut self,
        part: &'static str,
        name: impl Into<String>,
        value: f64,
        note: impl Into<String>,
    ) {
        self.rows.push(Row {
            part,
            name: name.into(),
            value,
            tol: f64::NAN,
            ok: true,
            note: note.into(),
        });
    }
    fn fail(&mut self, part: &'static str, name: impl Into<String>, e: anyhow::Error) {
        self.rows.push(Row {
            part,
            name: name.into(),
            value: f64::NAN,
            tol: f64::NAN,
            ok: false,
            note: format!("ERROR: {e:#}"),
        });
    }
    fn print(&self) {
        println!(
            "\n{:<6} {:<64} {:>10} {:>9}  {:<4} note",
            "part", "check", "value", "tol", "ok"
        );
        println!("{}", "-".repeat(110));
        for r in &self.rows {
            let v = if r.value.is_nan() {
                "-".to_string()
            } else {
                format!("{:.3e}", r.value)
            };
            let t = if r.tol.is_nan() {
                "-".to_string()
            } else {
                format!("{:.0e}", r.tol)
            };
            println!(
                "{:<6} {:<64} {:>10} {:>9}  {:<4} {}",
                r.part,
                r.name,
                v,
                t,
                if r.ok { "ok" } else { "FAIL" },
                r.note
            );
        }
        let bad = self.rows.iter().filter(|r| !r.ok).count();
        println!("{} checks, {} failed", self.rows.len(), bad);
    }
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).abs())
        .fold(
            0f64,
            |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
        )
        / scale
}

fn rms_rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

// ---------------------------------------------------------------------------------------------
// Inputs

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `n` normal values times `scale`, rounded to bf16 (so GPU and CPU see identical inputs).
fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| half::bf16::from_f32(rng.normal() * scale).to_f32())
        .collect()
}

/// A tensor owned by the test, viewable as a checkpoint `TensorRef`.
struct Owned {
    name: String,
    dtype: StoredDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
    scale_shape: Vec<usize>,
    scale: Option<Vec<u8>>,
}

impl Owned {
    fn bf16(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let bytes = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        Owned {
            name: name.into(),
            dtype: StoredDtype::BF16,
            shape: shape.to_vec(),
            bytes,
            scale_shape: vec![],
            scale: None,
        }
    }
    fn f32(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Owned {
            name: name.into(),
            dtype: StoredDtype::F32,
            shape: shape.to_vec(),
            bytes,
            scale_shape: vec![],
            scale: None,
        }
    }
    /// Block FP8 with the synth RTN recipe (what an FP8 checkpoint holds).
    fn fp8(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let (q, s) = synth::quantize_fp8_blocks(v, shape[0], shape[1]);
        Owned {
            name: name.into(),
            dtype: StoredDtype::F8E4M3,
            shape: shape.to_vec(),
            bytes: q,
            scale_shape: vec![shape[0].div_ceil(128), shape[1].div_ceil(128)],
            scale: Some(s.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }
    fn r(&self) -> TensorRef<'_> {
        TensorRef {
            name: &self.name,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
            scale_inv: self.scale.as_ref().map(|s| ScaleRef {
                shape: &self.scale_shape,
                bytes: s,
                block: Some([128, 128]),
            }),
        }
    }
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

/// Row-major `[n, w_i]` blocks concatenated along columns into `[n, Σ w_i]` (the layout of a
/// fused projection). Returns the data and the total width.
fn cat_cols(n: usize, parts: &[&[f32]]) -> (Vec<f32>, usize) {
    let widths: Vec<usize> = parts.iter().map(|p| p.len().checked_div(n).unwrap_or(0)).collect();
    let w: usize = widths.iter().sum();
    let mut out = Vec::with_capacity(n * w);
    for r in 0..n {
        for (p, &pw) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p[r * pw..(r + 1) * pw]);
        }
    }
    (out, w)
}

// ---------------------------------------------------------------------------------------------
// (a) ops

fn ops(g: &CudaBackend, c: &CpuBackend, rep: &mut Report) {
    let p = "ops";
    let mut rng = Rng(7);
    let mut run =
        |name: &str, rep: &mut Report, f: &mut dyn FnMut(&mut Report, &mut Rng) -> Result<()>| {
            if let Err(e) = f(rep, &mut rng) {
                rep.fail(p, name.to_string(), e);
            }
        };

    run("data movement", rep, &mut |rep, rng| {
        let (v, d) = (4096, 2560);
        let table = Owned::bf16("embed", &[v, d], &randn(rng, v * d, 1.0));
        let (tg, tc) = (g.param(&table.r())?, c.param(&table.r())?);
        let ids: Vec<u32> = (0..300).map(|_| rng.below(v) as u32).collect();
        rep.check(
            p,
            "embed 300 ids of [4096, 2560]",
            rel(
                &g.download(&g.embed(&tg, &ids)?)?,
                &c.embed(&tc, &ids)?.data,
            ),
            0.0,
        );
        let pos = Owned::bf16("pos", &[2304, 1024], &randn(rng, 2304 * 1024, 1.0));
        let (pg, pc) = (g.param(&pos.r())?, c.param(&pos.r())?);
        let idx: Vec<u32> = (0..4 * 256).map(|_| rng.below(2304) as u32).collect();
        let w: Vec<f32> = (0..4 * 256).map(|_| rng.uniform()).collect();
        let e = rel(
            &g.download(&g.embed_bag(&pg, &idx, &w, 4)?)?,
            &c.embed_bag(&pc, &idx, &w, 4)?.data,
        );
        rep.check(p, "embed_bag 256×4 taps of [2304, 1024]", e, 1e-2);
        let (n, d) = (37, 12352);
        let x = randn(rng, n * d, 1.0);
        let (xg, xc) = (g.upload(&x, &[n, d])?, c.upload(&x, &[n, d])?);
        let widths = [8192, 4096, 32, 32];
        let (sg, sc) = (g.split_cols(&xg, &widths)?, c.split_cols(&xc, &widths)?);
        let mut worst = 0f64;
        for (a, b) in sg.iter().zip(&sc) {
            worst = worst.max(rel(&g.download(a)?, &b.data));
        }
        rep.check(p, "split_cols [37, 12352] → 8192|4096|32|32", worst, 0.0);
        let rows = [36usize, 0, 5, 5, 17];
        let e = rel(
            &g.download(&g.gather_rows(&sg[2], &rows)?)?,
            &c.gather_rows(&sc[2], &rows)?.data,
        );
        rep.check(p, "gather_rows 5 of [37, 32]", e, 0.0);
        let src = randn(rng, 3 * 4096, 1.0);
        let (mut dg, mut dc) = (
            g.gather_rows(&sg[1], &(0..37).collect::<Vec<_>>())?,
            c.gather_rows(&sc[1], &(0..37).collect::<Vec<_>>())?,
        );
        g.scatter_rows(&mut dg, &[3, 30, 11], &g.upload(&src, &[3, 4096])?)?;
        c.scatter_rows(&mut dc, &[3, 30, 11], &c.upload(&src, &[3, 4096])?)?;
        rep.check(
            p,
            "scatter_rows 3 into [37, 4096]",
            rel(&g.download(&dg)?, &dc.data),
            0.0,
        );
        let e = rel(
            &g.download(&g.concat_rows(&[
                &sg[0],
                &g.upload(&randn(&mut Rng(3), 5 * 8192, 1.0), &[5, 8192])?,
            ])?)?,
            &c.concat_rows(&[
                &sc[0],
                &c.upload(&randn(&mut Rng(3), 5 * 8192, 1.0), &[5, 8192])?,
            ])?
            .data,
        );
        rep.check(p, "concat_rows [37, 8192] + [5, 8192]", e, 0.0);
        Ok(())
    });

    run("elementwise", rep, &mut |rep, rng| {
        let (m, d) = (300, 2560);
        let x = randn(rng, m * d, 2.0);
        let w = Owned::f32("norm", &[d], &randn(rng, d, 0.2));
        let (xg, xc) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
        let (wg, wc) = (g.param(&w.r())?, c.param(&w.r())?);
        let e = rel(
            &g.download(&g.rms_norm(&xg, &wg, 1e-6, 1.0)?)?,
            &c.rms_norm(&xc, &wc, 1e-6, 1.0)?.data,
        );
        rep.check(p, "rms_norm [300, 2560] offset 1", e, 1e-2);
        let (d2, m2) = (1024, 420);
        let x2 = randn(rng, m2 * d2, 3.0);
        let (lw, lb) = (
            Owned::f32("lw", &[d2], &randn(rng, d2, 1.0)),
            Owned::f32("lb", &[d2], &randn(rng, d2, 0.5)),
        );
        let (x2g, x2c) = (g.upload(&x2, &[m2, d2])?, c.upload(&x2, &[m2, d2])?);
        let e = rel(
            &g.download(&g.layer_norm(&x2g, &g.param(&lw.r())?, &g.param(&lb.r())?, 1e-6)?)?,
            &c.layer_norm(&x2c, &c.param(&lw.r())?, &c.param(&lb.r())?, 1e-6)?
                .data,
        );
        rep.check(p, "layer_norm [420, 1024]", e, 1e-2);
        let y = randn(rng, m * d, 1.0);
        let (mut ag, mut ac) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
        g.add_assign(&mut ag, &g.upload(&y, &[m, d])?)?;
        c.add_assign(&mut ac, &c.upload(&y, &[m, d])?)?;
        rep.check(
            p,
            "add_assign [300, 2560]",
            rel(&g.download(&ag)?, &ac.data),
            1e-2,
        );
        // Residual add fused with the next RMSNorm: vs the CPU add + norm, and bitwise vs the
        // GPU's own add_assign + rms_norm (same rounding, same reduction order).
        for (rows, d, off) in [(300usize, 2560usize, 1.0f32), (37, 1000, 0.0)] {
            let x = randn(rng, rows * d, 2.0);
            let y = randn(rng, rows * d, 1.0);
            let w = Owned::f32("norm", &[d], &randn(rng, d, 0.2));
            let (wg, wc) = (g.param(&w.r())?, c.param(&w.r())?);
            let (yg, yc) = (g.upload(&y, &[rows, d])?, c.upload(&y, &[rows, d])?);
            let (mut fg, mut ug, mut xc) = (
                g.upload(&x, &[rows, d])?,
                g.upload(&x, &[rows, d])?,
                c.upload(&x, &[rows, d])?,
            );
            let hg = g.download(&g.add_rms_norm(&mut fg, &yg, &wg, 1e-6, off)?)?;
            c.add_assign(&mut xc, &yc)?;
            let hc = c.rms_norm(&xc, &wc, 1e-6, off)?.data;
            g.add_assign(&mut ug, &yg)?;
            let hu = g.download(&g.rms_norm(&ug, &wg, 1e-6, off)?)?;
            let xf = g.download(&fg)?;
            rep.check(
                p,
                format!("add_rms_norm [{rows}, {d}] offset {off}: norm vs CPU"),
                rel(&hg, &hc),
                1e-2,
            );
            rep.check(
                p,
                format!("add_rms_norm [{rows}, {d}]: updated x vs CPU"),
                rel(&xf, &xc.data),
                1e-2,
            );
            rep.check(
                p,
                format!("add_rms_norm [{rows}, {d}]: norm, x vs GPU add_assign + rms_norm (bitwise)"),
                rel(&hg, &hu).max(rel(&xf, &g.download(&ug)?)),
                0.0,
            );
        }
        let gu = randn(rng, 64 * 2 * 9216, 2.0);
        let e = rel(
            &g.download(&g.swiglu(&g.upload(&gu, &[64, 2 * 9216])?)?)?,
            &c.swiglu(&c.upload(&gu, &[64, 2 * 9216])?)?.data,
        );
        rep.check(p, "swiglu [64, 2×9216]", e, 1e-2);
        for (kind, name) in [
            (Gelu::Tanh, "gelu tanh [300, 2560]"),
            (Gelu::Erf, "gelu erf [300, 2560]"),
        ] {
            let (mut hg, mut hc) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
            g.gelu(&mut hg, kind)?;
            c.gelu(&mut hc, kind)?;
            rep.check(p, name, rel(&g.download(&hg)?, &hc.data), 1e-2);
        }
        let h = randn(rng, 5 * d, 1.0);
        let rw = Owned::f32("readout", &[12, d], &randn(rng, 12 * d, 0.05));
        let e = rel(
            &g.readout(&g.upload(&h, &[5, d])?, &g.param_f32(&rw.r())?)?,
            &c.readout(&c.upload(&h, &[5, d])?, &c.param_f32(&rw.r())?)?,
        );
        rep.check(p, "readout f32 [5, 2560] × [12, 2560]ᵀ", e, 1e-5);
        Ok(())
    });

    run("matmul", rep, &mut |rep, rng| gemm_checks(g, c, rep, rng));

    run("swiglu_matmul", rep, &mut |rep, rng| {
        // SwiGLU fused with the FP8 activation quantisation, 4B down_proj shape: bitwise equal to
        // the GPU's unfused swiglu + matmul (plain and with a LoRA that reads the BF16 rows).
        let (n, k) = (2560, 9216);
        let w8 = Owned::fp8("down.weight", &[n, k], &randn(rng, n * k, 0.02));
        let la = Owned::bf16("down.A", &[8, k], &randn(rng, 8 * k, 0.05));
        let lb = Owned::bf16("down.B", &[n, 8], &randn(rng, n * 8, 0.05));
        let (lg, lc) = (g.linear(&[part(&w8)])?, c.linear(&[part(&w8)])?);
        let lora = [lora_part(&w8, &la, &lb, 2.0)];
        let lgl = g.linear(&lora)?;
        ensure!(
            lg.summary() == "fp8[0..2560]",
            "FP8 checkpoint weight placed as {}",
            lg.summary()
        );
        for m in [1usize, 37, 130] {
            let gu = randn(rng, m * 2 * k, 2.0);
            let gug = g.upload(&gu, &[m, 2 * k])?;
            let fused = g.download(&g.swiglu_matmul(&gug, &lg)?)?;
            let plain = g.download(&g.matmul(&g.swiglu(&gug)?, &lg)?)?;
            rep.check(
                p,
                format!("swiglu_matmul fp8 N={n} K={k} M={m} vs GPU swiglu + matmul (bitwise)"),
                rel(&fused, &plain),
                0.0,
            );
            if m == 37 {
                let want = c.swiglu_matmul(&c.upload(&gu, &[m, 2 * k])?, &lc)?.data;
                rep.check(
                    p,
                    format!("swiglu_matmul fp8 N={n} K={k} M={m} vs CPU f32 (quantisation error)"),
                    rel(&fused, &want),
                    8e-2,
                );
                let fused = g.download(&g.swiglu_matmul(&gug, &lgl)?)?;
                let plain = g.download(&g.matmul(&g.swiglu(&gug)?, &lgl)?)?;
                rep.check(
                    p,
                    format!("swiglu_matmul [{}] M={m} vs GPU swiglu + matmul (bitwise)", lgl.summary()),
                    rel(&fused, &plain),
                    0.0,
                );
            }
        }
        Ok(())
    });

    run("fused norm quantisation", rep, &mut |rep, rng| fused_norm_quant(g, rep, rng));

    run("attention", rep, &mut |rep, rng| {
        let d4b = AttentionDims {
            heads: 16,
            kv_heads: 4,
            head_dim: 256,
            rotary_dim: 64,
            norm_eps: 1e-6,
        };
        attention_case(
            g,
            c,
            rep,
            rng,
            "4B",
            d4b,
            &[&[70, 1, 133], &[5, 64, 1], &[2, 3, 100]],
            &[],
        )?;
        // A prefix and its continuations in one call (the parent's rows become the children's
        // shared part), next to an independent sequence; then every cache continues.
        attention_case(
            g,
            c,
            rep,
            rng,
            "4B",
            d4b,
            &[&[100, 37, 1, 64, 70], &[3, 1, 5, 2, 9]],
            &[None, Some(0), Some(0), None, Some(3)],
        )?;
        let tiny = AttentionDims {
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            rotary_dim: 16,
            norm_eps: 1e-6,
        };
        attention_case(g, c, rep, rng, "tiny", tiny, &[&[37, 100], &[3, 1]], &[])?;
        let alt = AttentionDims {
            heads: 3,
            kv_heads: 1,
            head_dim: 64,
            rotary_dim: 16,
            norm_eps: 1e-6,
        };
        attention_case(g, c, rep, rng, "alt", alt, &[&[50], &[20]], &[])?;
        vision_case(g, c, rep, rng, 16, 64, &[100, 64, 256])?;
        vision_case(g, c, rep, rng, 2, 16, &[16, 64])?;
        Ok(())
    });

    run("deltanet", rep, &mut |rep, rng| {
        let d4b = D4B;
        delta_case(g, c, rep, rng, "4B", d4b, &[&[70, 1, 130], &[3, 64, 65]], &[])?;
        // Prefixes and their continuations in one call (a 2-token parent: its children's conv
        // history reaches into the parent's old history), beside an independent sequence whose
        // state is updated in place.
        let tree = [None, Some(0), Some(0), None, None, Some(4)];
        delta_case(g, c, rep, rng, "4B", d4b, &[&[130, 1, 70, 66, 2, 5], &[3, 64, 65, 1, 2, 9]], &tree)?;
        let alt = DALT;
        delta_case(g, c, rep, rng, "alt", alt, &[&[100, 5], &[1, 70]], &[])?;
        // The other chunk scan (CUDA cores when the default is tensor cores), same checks.
        let other = !g.options().gdn_ffma;
        let gf = CudaBackend::new(0, CudaOptions { gdn_ffma: other, ..g.options().clone() })?;
        let tag = if gf.options().gdn_ffma { "FMA scan" } else { "tensor-core scan" };
        delta_case(&gf, c, rep, rng, &format!("4B, {tag}"), d4b, &[&[70, 1, 130], &[3, 64, 65]], &[])?;
        delta_case(&gf, c, rep, rng, &format!("4B, {tag}"), d4b, &[&[130, 1, 70, 66, 2, 5], &[3, 64, 65, 1, 2, 9]], &tree)?;
        delta_case(&gf, c, rep, rng, &format!("alt, {tag}"), alt, &[&[100, 5], &[1, 70]], &[])?;
        Ok(())
    });
}

/// Positions where two f32 slices differ in their bits (a length mismatch counts every position of
/// the longer one).
fn bit_diff(a: &[f32], b: &[f32]) -> usize {
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

/// Fused norm output `fused` (on `g`, which must have attached its FP8 quantisation) against the
/// unfused output `plain` (on `u`, quantised by quant_act_1x128): the bf16 bits, the FP8 codes and
/// the scales (padding rows included) must all be identical; the codes and scales also against
/// the CPU twin `host::quantize_act_1x128` of the downloaded output (the tolerance of the
/// quant_act_1x128 check in `gemm_checks`).
fn same_norm_quant(
    g: &CudaBackend,
    u: &CudaBackend,
    rep: &mut Report,
    name: &str,
    fused: &CudaTensor,
    plain: &CudaTensor,
) -> Result<()> {
    let p = "ops";
    rep.flag(
        p,
        format!("{name}: fused output carries its FP8 quantisation"),
        fused.has_fp8_activations() && !plain.has_fp8_activations(),
        format!("fused {} plain {}", fused.has_fp8_activations(), plain.has_fp8_activations()),
    );
    let (yf, yp) = (g.download(fused)?, u.download(plain)?);
    // The attached quantisation on g, quant_act_1x128's on u ([Mpad, K] and [K/128][Mpad]).
    let ((qf, sf), (qp, sp)) = (g.quantize_activations(fused)?, u.quantize_activations(plain)?);
    let codes = if qf.len() == qp.len() {
        qf.iter().zip(&qp).filter(|(a, b)| a != b).count()
    } else {
        qf.len().max(qp.len())
    };
    let (dy, ds) = (bit_diff(&yf, &yp), bit_diff(&sf, &sp));
    rep.check(
        p,
        format!("{name}: bf16 out, codes, scales ≠ unfused (bitwise)"),
        (dy + codes + ds) as f64,
        0.0,
    );
    if dy + codes + ds > 0 {
        rep.info(p, format!("{name}: … mismatches"), f64::NAN, format!("bf16 {dy}, codes {codes}, scales {ds}"));
    }
    let (m, k) = fused.rows_cols();
    let (qh, sh) = host::quantize_act_1x128(&yf, m, k);
    let off = qf.iter().zip(&qh).filter(|(a, b)| a != b).count() + qf.len().abs_diff(qh.len());
    let es = rel(&sf, &sh);
    rep.check(
        p,
        format!("{name}: codes ≠ CPU twin (fraction; scales to 1e-6)"),
        if es <= 1e-6 { off as f64 / qh.len().max(1) as f64 } else { f64::INFINITY },
        1e-4,
    );
    Ok(())
}

/// The row norms with the FP8 quantisation of their output fused in (`*_quant` kernels) against
/// the unfused path (the norm, then quant_act_1x128), bitwise, for several row counts (M = 1, a
/// multiple of the 16-row padding, and not), plus: a matmul reading the attached quantisation
/// equals one on a copy without it (bitwise), and every in-place op drops the attachment.
fn fused_norm_quant(g: &CudaBackend, rep: &mut Report, rng: &mut Rng) -> Result<()> {
    let p = "ops";
    // The reference: the same options with the fusion switched off.
    let u = CudaBackend::new(0, CudaOptions { unfused_act_quant: true, ..g.options().clone() })?;
    // FP8 projections on both: this is what turns the fusion on in g. `mixed` has an FP8 group,
    // a BF16 group and a LoRA (the BF16 paths read the bf16 rows, the FP8 one the attachment).
    let d = 2560;
    let w8 = Owned::fp8("proj.weight", &[256, d], &randn(rng, 256 * d, 0.02));
    let wb = Owned::bf16("proj_b.weight", &[32, d], &randn(rng, 32 * d, 0.02));
    let la = Owned::bf16("proj.A", &[8, d], &randn(rng, 8 * d, 0.05));
    let lb = Owned::bf16("proj.B", &[256, 8], &randn(rng, 256 * 8, 0.05));
    let mixed = [lora_part(&w8, &la, &lb, 2.0), part(&wb)];
    let (lg, lgm) = (g.linear(&[part(&w8)])?, g.linear(&mixed)?);
    let _ = u.linear(&[part(&w8)])?;
    ensure!(
        lgm.summary() == "fp8[0..256] bf16[256..288] lora×1",
        "mixed projection placed as {}",
        lgm.summary()
    );
    // Inputs whose magnitude varies per (row, 128-block), so the scales differ; in some cases a
    // zero row (scale 1 from amax 0) and a zeroed column block (w = −offset).
    let input = |rng: &mut Rng, m: usize, d: usize| -> Vec<f32> {
        (0..m * d)
            .map(|i| {
                let (r, c) = (i / d, i % d);
                half::bf16::from_f32(rng.normal() * 2f32.powi(((r * 5 + (c / 128) * 3) % 7) as i32 - 3))
                    .to_f32()
            })
            .collect()
    };
    // A matmul on the fused output (attachment) vs on a copy without it (quant_act_1x128).
    let gemm_same = |rep: &mut Report, name: &str, t: &CudaTensor, l: &CudaLinear, m: usize| -> Result<()> {
        let copy = g.gather_rows(t, &(0..m).collect::<Vec<_>>())?;
        ensure!(!copy.has_fp8_activations(), "gather_rows copied an attachment");
        let (a, b) = (g.download(&g.matmul(t, l)?)?, g.download(&g.matmul(&copy, l)?)?);
        rep.check(p, format!("{name}: matmul on it ≠ on a copy without (bitwise count)"), bit_diff(&a, &b) as f64, 0.0);
        Ok(())
    };
    for (m, d, off, zeros) in [
        (1usize, 2560usize, 1.0f32, false),
        (16, 2560, 1.0, true),
        (37, 2560, 0.0, true),
        (300, 2560, 1.0, false),
        (5, 128, 1.0, true),
        (19, 4096, 0.0, false),
    ] {
        let mut x = input(rng, m, d);
        let mut wv = randn(rng, d, 0.2);
        if zeros {
            x[(m / 2) * d..(m / 2 + 1) * d].fill(0.0);
            wv[..128].fill(-off);
        }
        let y = input(rng, m, d);
        let w = Owned::f32("norm", &[d], &wv);
        let (wg, wu) = (g.param(&w.r())?, u.param(&w.r())?);
        let name = format!("rms_norm_quant [{m}, {d}] offset {off}");
        let hg = g.rms_norm(&g.upload(&x, &[m, d])?, &wg, 1e-6, off)?;
        let hu = u.rms_norm(&u.upload(&x, &[m, d])?, &wu, 1e-6, off)?;
        same_norm_quant(g, &u, rep, &name, &hg, &hu)?;
        if d == 2560 {
            gemm_same(rep, &format!("{name} → fp8"), &hg, &lg, m)?;
            gemm_same(rep, &format!("{name} → [{}]", lgm.summary()), &hg, &lgm, m)?;
        }
        let name = format!("add_rms_norm_quant [{m}, {d}] offset {off}");
        let (mut xg, mut xu) = (g.upload(&x, &[m, d])?, u.upload(&x, &[m, d])?);
        let hg = g.add_rms_norm(&mut xg, &g.upload(&y, &[m, d])?, &wg, 1e-6, off)?;
        let hu = u.add_rms_norm(&mut xu, &u.upload(&y, &[m, d])?, &wu, 1e-6, off)?;
        same_norm_quant(g, &u, rep, &name, &hg, &hu)?;
        rep.check(
            p,
            format!("{name}: updated x ≠ unfused (bitwise count)"),
            bit_diff(&g.download(&xg)?, &u.download(&xu)?) as f64,
            0.0,
        );
        if d == 2560 {
            gemm_same(rep, &format!("{name} → fp8"), &hg, &lg, m)?;
        }
    }
    // Widths that are not whole 128-blocks, and norms over part of a row, attach nothing.
    let x = randn(rng, 7 * 1000, 1.0);
    let w = Owned::f32("norm", &[1000], &randn(rng, 1000, 0.2));
    let h = g.rms_norm(&g.upload(&x, &[7, 1000])?, &g.param(&w.r())?, 1e-6, 1.0)?;
    let x2 = randn(rng, 3 * 512, 1.0);
    let w2 = Owned::f32("norm", &[128], &randn(rng, 128, 0.2));
    let h2 = g.rms_norm(&g.upload(&x2, &[3, 512])?, &g.param(&w2.r())?, 1e-6, 1.0)?;
    rep.flag(
        p,
        "rms_norm: no FP8 attachment for d = 1000, nor for 128-wide norms of 512-wide rows",
        !h.has_fp8_activations() && !h2.has_fp8_activations(),
        "",
    );

    // Every in-place change drops the attachment; a matmul afterwards quantises the new contents.
    let (m, d) = (37, 2560);
    let w = Owned::f32("norm", &[d], &randn(rng, d, 0.2));
    let wg = g.param(&w.r())?;
    let fresh = |rng: &mut Rng| -> Result<_> { g.rms_norm(&g.upload(&input(rng, m, d), &[m, d])?, &wg, 1e-6, 1.0) };
    let other = g.upload(&randn(rng, m * d, 1.0), &[m, d])?;
    let mut t = fresh(rng)?;
    let attached = t.has_fp8_activations();
    g.add_assign(&mut t, &other)?;
    let mut dropped = vec![("add_assign", !t.has_fp8_activations())];
    gemm_same(rep, "after add_assign on a fused norm output", &t, &lg, m)?;
    let mut t = fresh(rng)?;
    g.scatter_rows(&mut t, &[3, 30], &g.upload(&randn(rng, 2 * d, 1.0), &[2, d])?)?;
    dropped.push(("scatter_rows", !t.has_fp8_activations()));
    gemm_same(rep, "after scatter_rows into a fused norm output", &t, &lg, m)?;
    let mut t = fresh(rng)?;
    g.gelu(&mut t, Gelu::Tanh)?;
    dropped.push(("gelu", !t.has_fp8_activations()));
    let mut t = fresh(rng)?;
    let h = g.add_rms_norm(&mut t, &other, &wg, 1e-6, 1.0)?;
    dropped.push(("add_rms_norm (its x)", !t.has_fp8_activations() && h.has_fp8_activations()));
    gemm_same(rep, "x of add_rms_norm after the add", &t, &lg, m)?;
    let t = g.reshape(fresh(rng)?, &[m, d])?;
    dropped.push(("reshape", !t.has_fp8_activations()));
    let bad: Vec<&str> = dropped.iter().filter(|d| !d.1).map(|d| d.0).collect();
    rep.flag(
        p,
        "in-place ops (add_assign, scatter_rows, gelu, add_rms_norm's x, reshape) drop the attachment",
        attached && bad.is_empty(),
        if attached { format!("kept by {bad:?}") } else { "norm output had none".into() },
    );

    // rms_norm_gated_quant: the DeltaNet output of the 4B shapes (value_dim 128), fused vs not,
    // then its out projection (K = 4096) on the attachment vs a copy.
    let d4b = D4B;
    let wo = Owned::fp8("out_proj.weight", &[256, 4096], &randn(rng, 256 * 4096, 0.02));
    let lo = g.linear(&[part(&wo)])?;
    for lens in [&[1usize][..], &[16], &[37], &[70, 1, 130]] {
        let (og, ou) = delta_pair(g, &u, rng, d4b, lens, true)?;
        let n: usize = lens.iter().sum();
        let name = format!("rms_norm_gated_quant 4B lens {lens:?}");
        same_norm_quant(g, &u, rep, &name, &og, &ou)?;
        gemm_same(rep, &format!("{name} → out_proj fp8"), &og, &lo, n)?;
    }
    // value_dim ≠ 128: the plain kernel, no attachment, same output.
    let alt = DALT;
    let (og, ou) = delta_pair(g, &u, rng, alt, &[20, 3], false)?;
    rep.flag(
        p,
        "gated_delta_net value_dim 24: no FP8 attachment",
        !og.has_fp8_activations(),
        "",
    );
    rep.check(
        p,
        "gated_delta_net value_dim 24: output ≠ unfused backend (bitwise count)",
        bit_diff(&g.download(&og)?, &u.download(&ou)?) as f64,
        0.0,
    );
    Ok(())
}

/// One `gated_delta_net` call on `g` and on `u` with the same random inputs and fresh states;
/// with `zero_head`, one (token, head) gate is driven to silu(z) = −0, a 128-block of zeros.
fn delta_pair(
    g: &CudaBackend,
    u: &CudaBackend,
    rng: &mut Rng,
    dims: DeltaNetDims,
    lens: &[usize],
    zero_head: bool,
) -> Result<(CudaTensor, CudaTensor)> {
    let DeltaNetDims {
        value_heads: vh,
        value_dim: dv,
        ..
    } = dims;
    let ch = dims.conv_channels();
    let n: usize = lens.iter().sum();
    let wts = DeltaWeights::random(rng, dims);
    let qkv = randn(rng, n * ch, 1.0);
    let mut z = randn(rng, n * vh * dv, 1.0);
    if zero_head {
        let h = vh / 2;
        z[h * dv..(h + 1) * dv].fill(-30000.0);
    }
    let b = randn(rng, n * vh, 1.0);
    let a = randn(rng, n * vh, 1.0);
    let (proj, _) = cat_cols(n, &[&qkv, &z, &b, &a]);
    let segs = tiling(lens);
    let run = |be: &CudaBackend| -> Result<CudaTensor> {
        let mut states = (0..lens.len()).map(|_| be.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
        wts.run(be, &proj, dims, &segs, &[], &mut states)
    };
    Ok((run(g)?, run(u)?))
}

fn part(w: &Owned) -> LinearPart<'_> {
    LinearPart {
        weight: w.r(),
        bias: None,
        lora: None,
    }
}

/// A block with a LoRA adapter `scale · (x·Aᵀ)·Bᵀ`.
fn lora_part<'a>(w: &'a Owned, a: &'a Owned, b: &'a Owned, scale: f32) -> LinearPart<'a> {
    LinearPart {
        lora: Some(LoraPair { a: a.r(), b: b.r(), scale }),
        ..part(w)
    }
}

fn gemm_checks(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut Rng) -> Result<()> {
    let p = "gemm";

    // BF16 GEMM, out_proj shape.
    let (n, k, m) = (2560, 4096, 300);
    let w = Owned::bf16("bf16.weight", &[n, k], &randn(rng, n * k, 0.02));
    let x = randn(rng, m * k, 1.0);
    let (lg, lc) = (g.linear(&[part(&w)])?, c.linear(&[part(&w)])?);
    let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
    let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
    rep.check(p, "bf16 N=2560 K=4096 M=300", rel(&yg, &yc), 1e-2);
    invariance(g, rep, "bf16 N=2560 K=4096", &lg, &x, k, &yg)?;

    // Bias + LoRA on two of three parts (vision qkv-like), ragged M.
    let (k2, m2) = (1024, 201);
    let parts_w: Vec<Owned> = [1024usize, 1024, 1024]
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            Owned::bf16(
                &format!("qkv{i}.weight"),
                &[o, k2],
                &randn(rng, o * k2, 0.03),
            )
        })
        .collect();
    let bias: Vec<Owned> = (0..3)
        .map(|i| Owned::f32(&format!("qkv{i}.bias"), &[1024], &randn(rng, 1024, 0.5)))
        .collect();
    let la: Vec<Owned> = (0..2)
        .map(|i| Owned::bf16(&format!("l{i}.A"), &[16, k2], &randn(rng, 16 * k2, 0.05)))
        .collect();
    let lb: Vec<Owned> = (0..2)
        .map(|i| {
            Owned::bf16(
                &format!("l{i}.B"),
                &[1024, 16],
                &randn(rng, 1024 * 16, 0.05),
            )
        })
        .collect();
    let parts: Vec<LinearPart> = (0..3)
        .map(|i| LinearPart {
            weight: parts_w[i].r(),
            bias: Some(bias[i].r()),
            lora: match i {
                0 => Some(LoraPair {
                    a: la[0].r(),
                    b: lb[0].r(),
                    scale: 2.0,
                }),
                2 => Some(LoraPair {
                    a: la[1].r(),
                    b: lb[1].r(),
                    scale: 0.5,
                }),
                _ => None,
            },
        })
        .collect();
    let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
    let x2 = randn(rng, m2 * k2, 1.0);
    let e = rel(
        &g.download(&g.matmul(&g.upload(&x2, &[m2, k2])?, &lg)?)?,
        &c.matmul(&c.upload(&x2, &[m2, k2])?, &lc)?.data,
    );
    rep.check(
        p,
        format!(
            "bf16 + bias + LoRA r16 on parts 0,2 [{}] M=201",
            lg.summary()
        ),
        e,
        1e-2,
    );

    // Block FP8, activation magnitudes varying per (row, 128-block), weight magnitudes per block.
    let (n, k, m) = (2560, 4096, 300);
    let wv: Vec<f32> = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            rng.normal() * 0.05 * 2f32.powi((((r / 128) * 5 + (c / 128) * 3) % 9) as i32 - 4)
        })
        .collect();
    let w8 = Owned::fp8("fp8.weight", &[n, k], &wv);
    let x: Vec<f32> = (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            half::bf16::from_f32(rng.normal() * 2f32.powi(((r * 7 + (c / 128) * 3) % 9) as i32 - 4))
                .to_f32()
        })
        .collect();
    let (lg, lc) = (g.linear(&[part(&w8)])?, c.linear(&[part(&w8)])?);
    ensure!(
        lg.summary() == "fp8[0..2560]",
        "FP8 checkpoint weight placed as {}",
        lg.summary()
    );
    let xg = g.upload(&x, &[m, k])?;
    let yg = g.download(&g.matmul(&xg, &lg)?)?;
    // The quantiser against its CPU twin.
    let (qg, sg) = g.quantize_activations(&xg)?;
    let (qh, sh) = host::quantize_act_1x128(&x, m, k);
    let byte_diff = qg.iter().zip(&qh).filter(|(a, b)| a != b).count();
    rep.check(
        p,
        "fp8 act quant [300, 4096]: bytes ≠ CPU twin (fraction)",
        byte_diff as f64 / qh.len() as f64,
        1e-4,
    );
    rep.check(
        p,
        "fp8 act quant: scales [K/128][M] vs CPU twin",
        rel(&sg, &sh),
        1e-6,
    );
    // The GEMM against an f32 GEMM of exactly its dequantised operands.
    let mpad = host::fp8_rows(m);
    let xd = host::dequantize_act_1x128(&qg, &sg, m, mpad, k);
    let wd = dequantize_fp8_blocks(
        &w8.bytes,
        &[n, k],
        w8.scale.as_ref().unwrap(),
        &w8.scale_shape,
        Some([128, 128]),
    )?;
    let mut yref = vec![0f32; m * n];
    matmul_xwt(&xd, m, k, &wd, n, &mut yref, false);
    rep.check(
        p,
        "fp8 N=2560 K=4096 M=300 vs dequantised operands (max)",
        rel(&yg, &yref),
        1e-2,
    );
    rep.check(
        p,
        "fp8 … same (rms, probe measured 1.7e-3)",
        rms_rel(&yg, &yref),
        3e-3,
    );
    rep.check(
        p,
        "fp8 … vs CPU f32 activations (quantisation error)",
        rel(&yg, &c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data),
        8e-2,
    );
    invariance(g, rep, "fp8 N=2560 K=4096", &lg, &x, k, &yg)?;

    // A fused GDN in_proj of the 4B model: FP8 qkv+z, BF16 b+a (N not a multiple of 128), LoRA.
    let (k, m) = (2560, 70);
    let outs = [8192usize, 4096, 32, 32];
    let ws: Vec<Owned> = outs
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            let v = randn(rng, o * k, 0.02);
            if i < 2 {
                Owned::fp8(&format!("in{i}.weight"), &[o, k], &v)
            } else {
                Owned::bf16(&format!("in{i}.weight"), &[o, k], &v)
            }
        })
        .collect();
    let la = [
        Owned::bf16("a0", &[8, k], &randn(rng, 8 * k, 0.05)),
        Owned::bf16("a2", &[8, k], &randn(rng, 8 * k, 0.05)),
    ];
    let lb = [
        Owned::bf16("b0", &[8192, 8], &randn(rng, 8192 * 8, 0.05)),
        Owned::bf16("b2", &[32, 8], &randn(rng, 32 * 8, 0.05)),
    ];
    let parts: Vec<LinearPart> = (0..4)
        .map(|i| LinearPart {
            weight: ws[i].r(),
            bias: None,
            lora: match i {
                0 => Some(LoraPair {
                    a: la[0].r(),
                    b: lb[0].r(),
                    scale: 2.0,
                }),
                2 => Some(LoraPair {
                    a: la[1].r(),
                    b: lb[1].r(),
                    scale: 2.0,
                }),
                _ => None,
            },
        })
        .collect();
    let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
    let x = randn(rng, m * k, 1.0);
    let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
    let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
    let n = 12352;
    let fp8_cols: Vec<(Vec<f32>, Vec<f32>)> = (0..m)
        .map(|r| {
            (
                yg[r * n..r * n + 12288].to_vec(),
                yc[r * n..r * n + 12288].to_vec(),
            )
        })
        .collect();
    let bf_cols: Vec<(Vec<f32>, Vec<f32>)> = (0..m)
        .map(|r| {
            (
                yg[r * n + 12288..(r + 1) * n].to_vec(),
                yc[r * n + 12288..(r + 1) * n].to_vec(),
            )
        })
        .collect();
    let cat = |v: &[(Vec<f32>, Vec<f32>)], first: bool| -> Vec<f32> {
        v.iter()
            .flat_map(|p| if first { p.0.clone() } else { p.1.clone() })
            .collect()
    };
    rep.check(
        p,
        format!("4B in_proj [{}] M=70: fp8 columns vs CPU", lg.summary()),
        rel(&cat(&fp8_cols, true), &cat(&fp8_cols, false)),
        8e-2,
    );
    rep.check(
        p,
        "4B in_proj: bf16 columns (b, a + LoRA) vs CPU",
        rel(&cat(&bf_cols, true), &cat(&bf_cols, false)),
        1e-2,
    );

    // quantize_fp8: a BF16 checkpoint projection quantised at load.
    let gq = CudaBackend::new(
        0,
        CudaOptions {
            quantize_fp8: true,
            ..Default::default()
        },
    )?;
    let (n, k, m) = (1024, 2560, 33);
    let w = Owned::bf16("q.weight", &[n, k], &randn(rng, n * k, 0.02));
    let lq = gq.linear(&[part(&w)])?;
    ensure!(
        lq.summary() == "fp8[0..1024]",
        "quantize_fp8 placed {}",
        lq.summary()
    );
    let x = randn(rng, m * k, 1.0);
    let e = rel(
        &gq.download(&gq.matmul(&gq.upload(&x, &[m, k])?, &lq)?)?,
        &c.matmul(&c.upload(&x, &[m, k])?, &c.linear(&[part(&w)])?)?
            .data,
    );
    rep.check(
        p,
        "quantize_fp8 at load: N=1024 K=2560 M=33 vs CPU bf16 weights",
        e,
        1e-1,
    );
    Ok(())
}

/// Rows of a GEMM must not depend on how many rows share the call: bitwise.
fn invariance(
    g: &CudaBackend,
    rep: &mut Report,
    name: &str,
    w: &<CudaBackend as Backend>::Linear,
    x: &[f32],
    k: usize,
    full: &[f32],
) -> Result<()> {
    let n = g.linear_out(w);
    let mut bad = 0usize;
    let mut worst = 0f64;
    for mm in [1usize, 7, 64, 129] {
        let y = g.download(&g.matmul(&g.upload(&x[..mm * k], &[mm, k])?, w)?)?;
        bad += y
            .iter()
            .zip(&full[..mm * n])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        worst = worst.max(rel(&y, &full[..mm * n]));
    }
    rep.check(
        "gemm",
        format!("{name}: rows of M∈{{1,7,64,129}} ≠ rows of M=300 (bitwise count)"),
        bad as f64,
        0.0,
    );
    if bad > 0 {
        rep.info("gemm", format!("{name}: … max rel difference"), worst, "");
    }
    Ok(())
}

fn section(h: usize) -> [usize; 3] {
    [h.div_ceil(3), (h + 1) / 3, h / 3]
}

/// ` parents [..]` for a call that runs a tree, else nothing.
fn tree_note(parents: &[Option<usize>]) -> String {
    if parents.is_empty() {
        return String::new();
    }
    let p: Vec<String> = parents.iter().map(|p| p.map_or("-".into(), |i| i.to_string())).collect();
    format!(" parents [{}]", p.join(","))
}

#[allow(clippy::too_many_arguments)]
fn attention_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut Rng,
    name: &str,
    dims: AttentionDims,
    calls: &[&[usize]],
    tree: &[Option<usize>],
) -> Result<()> {
    let AttentionDims {
        heads,
        kv_heads: kvh,
        head_dim: hd,
        rotary_dim: rot,
        ..
    } = dims;
    let nseq = calls[0].len();
    let mut gc = (0..nseq)
        .map(|_| g.new_kv_cache(&dims))
        .collect::<Result<Vec<_>>>()?;
    let mut cc = (0..nseq)
        .map(|_| c.new_kv_cache(&dims))
        .collect::<Result<Vec<_>>>()?;
    let mut pos0 = vec![0i64; nseq];
    let qn = Owned::f32("q_norm", &[hd], &randn(rng, hd, 0.1));
    let kn = Owned::f32("k_norm", &[hd], &randn(rng, hd, 0.1));
    for (ci, lens) in calls.iter().enumerate() {
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        // The first call may run a tree (children continue their parent within the call).
        let parents = if ci == 0 { tree } else { &[] };
        let qg = randn(rng, n * heads * 2 * hd, 1.0);
        let k = randn(rng, n * kvh * hd, 1.0);
        let v = randn(rng, n * kvh * hd, 1.0);
        let mut pos: [Vec<i64>; 3] = [vec![], vec![], vec![]];
        for (s, &l) in lens.iter().enumerate() {
            if let Some(p) = parents.get(s).copied().flatten() {
                pos0[s] = pos0[p];
            }
            for t in 0..l as i64 {
                for r in pos.iter_mut() {
                    r.push(pos0[s] + t);
                }
            }
            pos0[s] += l as i64;
        }
        let (cos, sin) = positions::text_rope_tables(&pos, 1e7, rot, section(rot / 2));
        // The fused projection [query/gate | key | value].
        let (qkv, qkv_w) = cat_cols(n, &[&qg, &k, &v]);
        assert_eq!(qkv_w, dims.qkv_width());
        macro_rules! run {
            ($b:expr, $caches:expr) => {{
                let b = $b;
                let t = (
                    b.upload(&qkv, &[n, qkv_w])?,
                    b.param(&qn.r())?,
                    b.param(&kn.r())?,
                    b.upload(&cos, &[n, rot])?,
                    b.upload(&sin, &[n, rot])?,
                );
                let inputs = AttentionInputs {
                    qkv: &t.0,
                    q_norm: &t.1,
                    k_norm: &t.2,
                    cos: &t.3,
                    sin: &t.4,
                };
                let mut refs: Vec<_> = $caches.iter_mut().collect();
                let o = b.gated_attention(&inputs, &dims, &segs, parents, &mut refs)?;
                b.download(&o)?
            }};
        }
        let og = run!(g, gc);
        let oc = run!(c, cc);
        let lens_ok = gc.iter().zip(&cc).all(|(a, b)| g.kv_len(a) == c.kv_len(b));
        rep.check(
            "ops",
            format!("gated_attention {name} h{heads}/{kvh} d{hd} rot{rot} call {ci} lens {lens:?}{}", tree_note(parents)),
            rel(&og, &oc),
            2e-2,
        );
        if !lens_ok {
            rep.flag(
                "ops",
                format!("gated_attention {name}: kv_len"),
                false,
                "GPU and CPU cache lengths differ",
            );
        }
        // Freeze the even sequences' rows into a shared prefix (as a prefix state before forking)
        // and continue with a fork of sequence 0: the next call reads shared + own rows.
        for s in (0..nseq).step_by(2) {
            g.share_kv(&mut gc[s])?;
            c.share_kv(&mut cc[s])?;
        }
        gc[0] = gc[0].clone();
        cc[0] = cc[0].clone();
    }
    Ok(())
}

fn vision_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut Rng,
    heads: usize,
    hd: usize,
    lens: &[usize],
) -> Result<()> {
    let n: usize = lens.iter().sum();
    let segs = tiling(lens);
    let qkv = randn(rng, n * 3 * heads * hd, 1.0);
    let ang: Vec<f32> = (0..n * hd).map(|_| rng.uniform() * 20.0).collect();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
    let og = g.download(&g.vision_attention(
        &g.upload(&qkv, &[n, 3 * heads * hd])?,
        &g.upload(&cos, &[n, hd])?,
        &g.upload(&sin, &[n, hd])?,
        heads,
        &segs,
    )?)?;
    let oc = c
        .vision_attention(
            &c.upload(&qkv, &[n, 3 * heads * hd])?,
            &c.upload(&cos, &[n, hd])?,
            &c.upload(&sin, &[n, hd])?,
            heads,
            &segs,
        )?
        .data;
    rep.check(
        "ops",
        format!("vision_attention h{heads} d{hd} segments {lens:?}"),
        rel(&og, &oc),
        2e-2,
    );
    Ok(())
}

/// The Gated DeltaNet shapes of Qwen3.5-4B.
const D4B: DeltaNetDims = DeltaNetDims {
    key_heads: 16,
    value_heads: 32,
    key_dim: 128,
    value_dim: 128,
    conv_kernel: 4,
    norm_eps: 1e-6,
};

/// Small Gated DeltaNet shapes whose value_dim is not a multiple of 32 (nor 128).
const DALT: DeltaNetDims = DeltaNetDims {
    key_heads: 2,
    value_heads: 6,
    key_dim: 32,
    value_dim: 24,
    conv_kernel: 4,
    norm_eps: 1e-6,
};

/// The parameters of a Gated DeltaNet layer besides its projections, random (conv taps, A_log,
/// dt_bias, the gated-norm weight), and one mixer call with them.
struct DeltaWeights {
    conv: Owned,
    alog: Owned,
    dtb: Owned,
    nw: Owned,
}

impl DeltaWeights {
    fn random(rng: &mut Rng, dims: DeltaNetDims) -> Self {
        let (ch, kw, vh, dv) = (dims.conv_channels(), dims.conv_kernel, dims.value_heads, dims.value_dim);
        let conv = Owned::bf16("conv", &[ch, kw], &randn(rng, ch * kw, 0.5));
        let alog = (0..vh).map(|_| (1.0 + 15.0 * rng.uniform()).ln()).collect::<Vec<_>>();
        let alog = Owned::f32("A_log", &[vh], &alog);
        let dtb = Owned::f32("dt_bias", &[vh], &randn(rng, vh, 0.5));
        let nw = randn(rng, dv, 0.1).iter().map(|v| 1.0 + v).collect::<Vec<_>>();
        let nw = Owned::f32("norm", &[dv], &nw);
        DeltaWeights { conv, alog, dtb, nw }
    }

    /// `gated_delta_net` on the fused projection `proj` (`[n, proj_width]`).
    fn run<B: Backend>(
        &self,
        be: &B,
        proj: &[f32],
        dims: DeltaNetDims,
        segs: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [B::DeltaState],
    ) -> Result<B::Tensor> {
        let pw = dims.proj_width();
        let t = (
            be.upload(proj, &[proj.len() / pw, pw])?,
            be.param(&self.conv.r())?,
            be.param(&self.alog.r())?,
            be.param(&self.dtb.r())?,
            be.param(&self.nw.r())?,
        );
        let inputs = DeltaNetInputs { proj: &t.0, conv_weight: &t.1, a_log: &t.2, dt_bias: &t.3, norm_weight: &t.4 };
        let mut refs: Vec<_> = states.iter_mut().collect();
        be.gated_delta_net(&inputs, &dims, segs, parents, &mut refs)
    }
}

#[allow(clippy::too_many_arguments)]
fn delta_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut Rng,
    name: &str,
    dims: DeltaNetDims,
    calls: &[&[usize]],
    tree: &[Option<usize>],
) -> Result<()> {
    let DeltaNetDims {
        value_heads: vh,
        value_dim: dv,
        ..
    } = dims;
    let ch = dims.conv_channels();
    let nseq = calls[0].len();
    let mut gs = (0..nseq)
        .map(|_| g.new_delta_state(&dims))
        .collect::<Result<Vec<_>>>()?;
    let mut cs = (0..nseq)
        .map(|_| c.new_delta_state(&dims))
        .collect::<Result<Vec<_>>>()?;
    let wts = DeltaWeights::random(rng, dims);
    for (ci, lens) in calls.iter().enumerate() {
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        // The first call may run a tree (children continue their parent within the call).
        let parents = if ci == 0 { tree } else { &[] };
        let qkv = randn(rng, n * ch, 1.0);
        let z = randn(rng, n * vh * dv, 1.0);
        let b = randn(rng, n * vh, 1.0);
        let a = randn(rng, n * vh, 1.0);
        // The fused projection [q | k | v | z | b | a].
        let (proj, pw) = cat_cols(n, &[&qkv, &z, &b, &a]);
        assert_eq!(pw, dims.proj_width());
        let og = g.download(&wts.run(g, &proj, dims, &segs, parents, &mut gs)?)?;
        let oc = c.download(&wts.run(c, &proj, dims, &segs, parents, &mut cs)?)?;
        rep.check(
            "ops",
            format!("gated_delta_net {name} call {ci} lens {lens:?}{}: output", tree_note(parents)),
            rel(&og, &oc),
            2e-2,
        );
        let mut worst = 0f64;
        for (a, b) in gs.iter().zip(&cs) {
            worst = worst.max(rel(&a.recurrent()?, b.recurrent()));
        }
        rep.check(
            "ops",
            format!("gated_delta_net {name} call {ci}: final recurrent states (f32)"),
            worst,
            1e-3,
        );
    }
    // A fork (clone) is a deep copy: changing the original leaves it alone.
    let before = gs[0].recurrent()?;
    let fork = gs[0].clone();
    let x = randn(rng, dims.proj_width(), 1.0);
    wts.run(g, &x, dims, &tiling(&[1]), &[], &mut gs[..1])?;
    let same = fork.recurrent()? == before && gs[0].recurrent()? != before;
    rep.flag(
        "ops",
        format!("gated_delta_net {name}: cloned state independent of the original"),
        same,
        "",
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// (b) engine on the golden models, (c) prefix + extend

/// The golden fixtures: beside the sources this was built from, else under the current directory
/// (the test binary is built on one machine and run from the repository root on the GPU machine).
fn fixtures() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    if built.join("cases.json").exists() {
        built
    } else {
        PathBuf::from("tests/fixtures/golden")
    }
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

struct Synthesized {
    _dir: tempfile::TempDir,
    model: PathBuf,
    adapter: PathBuf,
}

fn synthesize(spec: &Value) -> Result<Synthesized> {
    let dir = tempfile::tempdir()?;
    let cfg_name = spec["config"].as_str().unwrap();
    let cfg = if cfg_name.ends_with(".json") {
        synth::preset(fixtures().join(cfg_name).to_str().unwrap())?
    } else {
        synth::preset(cfg_name)?
    };
    let dtype = match spec["dtype"].as_str().unwrap() {
        "f32" => SynthDtype::F32,
        "bf16" => SynthDtype::Bf16,
        "fp8" => SynthDtype::Fp8,
        other => return Err(anyhow!("dtype {other}")),
    };
    let seed = spec["seed"].as_u64().unwrap();
    let (model, adapter) = (dir.path().join("model"), dir.path().join("adapter"));
    synth::write_model(&cfg, dtype, seed, &model)?;
    let a = &spec["adapter"];
    synth::write_adapter(
        &cfg,
        a["rank"].as_u64().unwrap() as usize,
        a["alpha"].as_f64().unwrap(),
        a["readout_rows"].as_u64().unwrap() as usize,
        seed,
        &adapter,
    )?;
    Ok(Synthesized {
        _dir: dir,
        model,
        adapter,
    })
}

fn images(case: &Value, model: &Path) -> Result<Vec<imajev_serve::image::PatchedImage>> {
    let pcfg = ImageProcessorConfig::from_model_dir(model)?;
    case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let bytes = std::fs::read(fixtures().join("images").join(n.as_str().unwrap()))?;
            Ok(load_and_preprocess(&bytes, &ImageLimits::default(), &pcfg)?.1)
        })
        .collect()
}

fn engine(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "engine";
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json"))?)?;
    let mut models = HashMap::new();
    for m in doc["models"].as_array().unwrap() {
        models.insert(m["name"].as_str().unwrap().to_string(), synthesize(m)?);
    }
    type Pair = (Qwen35<CpuBackend>, Qwen35<CudaBackend>);
    let mut loaded: HashMap<(String, bool), Pair> = HashMap::new();
    for (i, case) in doc["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["model"].as_str().unwrap().to_string();
        let with_adapter = case["adapter"].as_bool().unwrap();
        let s = &models[&name];
        if let std::collections::hash_map::Entry::Vacant(e) =
            loaded.entry((name.clone(), with_adapter))
        {
            let ad = with_adapter.then_some(s.adapter.as_path());
            e.insert((
                Qwen35::load(CpuBackend::default(), &s.model, ad)?,
                Qwen35::load(g.clone(), &s.model, ad)?,
            ));
        }
        let (cm, gm) = &loaded[&(name.clone(), with_adapter)];
        let tok = QwenTokenizer::from_model_dir(&s.model)?;
        let ids = tok.encode(case["prompt"].as_str().unwrap())?;
        let imgs = images(case, &s.model)?;
        let refs: Vec<&_> = imgs.iter().collect();
        let t0 = Instant::now();
        let (_, hg, _) = gm.prefill(&ids, &refs)?;
        let hgv = gm.backend.download(&hg)?;
        let gpu_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (_, hc, _) = cm.prefill(&ids, &refs)?;
        let hcv = cm.backend.download(&hc)?;
        let label = format!(
            "case {i:2} {name} adapter={with_adapter} images={} tokens={}",
            refs.len(),
            case["input_ids"].as_array().unwrap().len()
        );
        rep.check(p, format!("{label}: hidden vs CPU"), rel(&hgv, &hcv), 3e-2);
        rep.info(
            p,
            format!("case {i:2}: hidden vs transformers fp32 golden"),
            rel(&hgv, &floats(&case["hidden_last"])),
            format!("GPU prefill {gpu_ms:.1} ms"),
        );
        if with_adapter {
            let (lg, lc) = (gm.readout(&hg)?.remove(0), cm.readout(&hc)?.remove(0));
            rep.check(
                p,
                format!("case {i:2}: readout logits vs CPU"),
                rel(&lg, &lc),
                3e-2,
            );
            rep.flag(
                p,
                format!("case {i:2}: readout argmax agrees"),
                argmax(&lg) == argmax(&lc),
                format!("gpu {} cpu {}", argmax(&lg), argmax(&lc)),
            );
        }
    }
    Ok(())
}

/// Whole forwards with the FP8 activation quantisation fused into the norms equal forwards with
/// it in its own kernel, bitwise: an FP8 checkpoint whose norms are whole 128-blocks wide (the
/// golden tiny models are 64 wide, so their norms never fuse), four layers of the 4B's widths
/// (cuBLASLt's block-scaled FP8 GEMM refuses K = 256, so no narrower model) with a 4096-wide
/// MLP; a prefill (input norms, post-attention norms, DeltaNet gated norms, the last layer's norm
/// on gathered rows) and a batched extend of two forks.
fn fused_engine(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "engine";
    let mut v = synth::tiny_config();
    let t = &mut v["text_config"];
    for (k, n) in [
        ("hidden_size", 2560),
        ("intermediate_size", 4096),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
    ] {
        t[k] = n.into();
    }
    t["rope_parameters"]["partial_rotary_factor"] = serde_json::json!(0.25);
    t["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    v["vision_config"]["out_hidden_size"] = 2560.into();
    let dir = tempfile::tempdir()?;
    let cfg_path = dir.path().join("config-128.json");
    std::fs::write(&cfg_path, serde_json::to_string(&v)?)?;
    let cfg = synth::preset(cfg_path.to_str().unwrap())?;
    let (model, adapter) = (dir.path().join("model"), dir.path().join("adapter"));
    synth::write_model(&cfg, SynthDtype::Fp8, 21, &model)?;
    synth::write_adapter(&cfg, 4, 8.0, 12, 21, &adapter)?;
    let u = CudaBackend::new(0, CudaOptions { unfused_act_quant: true, ..g.options().clone() })?;
    let gm = Qwen35::load(g.clone(), &model, Some(&adapter))?;
    let um = Qwen35::load(u, &model, Some(&adapter))?;
    let tok = QwenTokenizer::from_model_dir(&model)?;
    let ids = tok.encode(
        "State: the printer on the third floor prints every page twice and the toner light is on. \
         Question: what should the office manager do first? Answer",
    )?;
    let ((mut sg, hg, _), (mut su, hu, _)) = (gm.prefill(&ids, &[])?, um.prefill(&ids, &[])?);
    let (hgv, huv) = (gm.backend.download(&hg)?, um.backend.download(&hu)?);
    let (lg, lu) = (gm.readout(&hg)?.remove(0), um.readout(&hu)?.remove(0));
    rep.check(
        p,
        format!("fused norm quant, 4B-wide 4-layer FP8 model, prefill {} tokens: hidden + readout ≠ unfused (bitwise)", ids.len()),
        (bit_diff(&hgv, &huv) + bit_diff(&lg, &lu)) as f64,
        0.0,
    );
    let (s1, s2) = (tok.encode(" Restart it")?, tok.encode(" Call the vendor and ask for a new drum unit")?);
    sg.share(&gm.backend)?;
    su.share(&um.backend)?;
    let mut fg = vec![sg.fork(), sg.fork()];
    let mut fu = vec![su.fork(), su.fork()];
    let eg = gm.backend.download(&gm.extend(&mut fg, &[&s1, &s2])?)?;
    let eu = um.backend.download(&um.extend(&mut fu, &[&s1, &s2])?)?;
    rep.check(
        p,
        "… extend of 2 forks: hidden ≠ unfused (bitwise)",
        bit_diff(&eg, &eu) as f64,
        0.0,
    );
    Ok(())
}

fn prefix_extend(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "extend";
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json"))?)?;
    let spec = doc["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "tiny-bf16")
        .ok_or_else(|| anyhow!("no tiny-bf16"))?;
    let s = synthesize(spec)?;
    let model = Qwen35::load(g.clone(), &s.model, Some(&s.adapter))?;
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["model"] == "tiny-bf16" && !c["images"].as_array().unwrap().is_empty())
        .unwrap();
    let tok = QwenTokenizer::from_model_dir(&s.model)?;
    let ids = tok.encode(case["prompt"].as_str().unwrap())?;
    let imgs = images(case, &s.model)?;
    let refs: Vec<&_> = imgs.iter().collect();
    let split = ids.len() - 12;
    let (prefix, suffix) = ids.split_at(split);
    let suffix2 = tok.encode("Question: is the printer broken? Answer")?;
    let (mut st, _, _) = model.prefill(prefix, &refs)?;
    st.share(&model.backend)?;
    let tokens_before = st.tokens;
    let mut forks = vec![st.fork(), st.fork()];
    let h = model.extend(&mut forks, &[suffix, &suffix2])?;
    let hv = model.backend.download(&h)?;
    let d = model.hidden_size();
    let logits = model.readout(&h)?;
    for (r, suf) in [suffix, &suffix2[..]].iter().enumerate() {
        let full: Vec<u32> = prefix.iter().chain(suf.iter()).copied().collect();
        let (_, hf, _) = model.prefill(&full, &refs)?;
        let hfv = model.backend.download(&hf)?;
        rep.check(
            p,
            format!(
                "fork {r}: prefix {} + suffix {} (batched extend) vs full forward",
                prefix.len(),
                suf.len()
            ),
            rel(&hv[r * d..(r + 1) * d], &hfv),
            3e-2,
        );
        let lf = model.readout(&hf)?.remove(0);
        rep.flag(
            p,
            format!("fork {r}: readout argmax agrees with full forward"),
            argmax(&logits[r]) == argmax(&lf),
            "",
        );
    }
    rep.flag(
        p,
        "prefix state untouched by extending its forks",
        st.tokens == tokens_before,
        "",
    );
    // The prefix and both suffixes as ONE forward (the forks made inside it) equal prefill,
    // share, fork, extend — bitwise, as every row's arithmetic is the same — and the states it
    // leaves continue like the forks'.
    let feats = model.encode_images(&refs)?;
    let layout = model.layout(prefix, &refs, 0)?;
    let (mut tree, ht) = model.prefill_extend(&layout, &feats, &[suffix, &suffix2])?;
    let htv = model.backend.download(&ht)?;
    let e = rel(&htv[d..], &hv);
    rep.check(p, "prefix + 2 forks in one forward vs prefill then extend", e, 3e-2);
    rep.flag(
        p,
        "… bitwise identical",
        htv[d..].iter().zip(&hv).all(|(a, b)| a.to_bits() == b.to_bits()),
        format!("max rel diff {e:.2e}"),
    );
    let more = tok.encode(" Answer again")?;
    let mut tails: Vec<_> = tree.drain(1..).collect();
    let a = model.backend.download(&model.extend(&mut tails, &[&more, &more])?)?;
    let b = model.backend.download(&model.extend(&mut forks, &[&more, &more])?)?;
    let e = rel(&a, &b);
    rep.check(p, "states left by the one forward continue like the forks'", e, 3e-2);
    rep.flag(
        p,
        "… bitwise identical",
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        format!("max rel diff {e:.2e}"),
    );
    // The original, extended alone, equals fork 0 extended in a batch of two: the forks did not
    // write into its caches, and a row does not depend on its batch companions.
    let mut alone = vec![st];
    let ha = model
        .backend
        .download(&model.extend(&mut alone, &[suffix])?)?;
    let e = rel(&ha, &hv[..d]);
    let bitwise = ha
        .iter()
        .zip(&hv[..d])
        .all(|(a, b)| a.to_bits() == b.to_bits());
    rep.check(
        p,
        "original extended alone vs fork 0 extended in a batch of 2",
        e,
        3e-2,
    );
    rep.flag(
        p,
        "… bitwise identical (batch invariance)",
        bitwise,
        format!("max rel diff {e:.2e}"),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// (d) timings of single ops at Qwen3.5-4B shapes (informational, no assertions)

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

fn perf(g: &CudaBackend) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut rng = Rng(99);
    let m = 2048;
    for (name, n, k) in [
        ("in_proj qkvz", 12288usize, 2560usize),
        ("out_proj", 2560, 4096),
        ("mlp down", 2560, 9216),
    ] {
        let v = randn(&mut rng, n * k, 0.02);
        let x = g.upload(&randn(&mut rng, m * k, 1.0), &[m, k])?;
        let x = g.gather_rows(&x, &(0..m).collect::<Vec<_>>())?; // BF16 input, as in the model
        for (fmt, w) in [
            ("fp8", Owned::fp8("w", &[n, k], &v)),
            ("bf16", Owned::bf16("w", &[n, k], &v)),
        ] {
            let l = g.linear(&[part(&w)])?;
            let ms = time_ms(g, 10, &mut || g.matmul(&x, &l).map(|_| ()))?;
            out.push(format!("{fmt:>4} GEMM {name:<13} N={n:<5} K={k:<4} M={m}: {ms:7.3} ms  {:6.0} TFLOP/s (incl. act quant)", 2.0 * (m * n * k) as f64 / ms / 1e9));
        }
    }
    let d = 2560;
    let x = g.gather_rows(
        &g.upload(&randn(&mut rng, m * d, 1.0), &[m, d])?,
        &(0..m).collect::<Vec<_>>(),
    )?;
    let w = g.upload(&randn(&mut rng, d, 0.1), &[d])?;
    let fused = g.rms_norm(&x, &w, 1e-6, 1.0)?.has_fp8_activations();
    let ms = time_ms(g, 20, &mut || g.rms_norm(&x, &w, 1e-6, 1.0).map(|_| ()))?;
    out.push(format!(
        "rms_norm [{m}, {d}]{}: {ms:.3} ms ({:.0} GB/s of bf16 in + out)",
        if fused { " + fused FP8 quantisation" } else { "" },
        (4 * m * d) as f64 / ms / 1e6
    ));
    // Norm + a small FP8 projection (N = 128: the GEMM itself is a few µs), fused vs with the
    // quantisation in its own kernel (a backend with the fusion off).
    let u = CudaBackend::new(0, CudaOptions { unfused_act_quant: true, ..g.options().clone() })?;
    let wp = Owned::fp8("w", &[128, d], &randn(&mut rng, 128 * d, 0.02));
    let xv = randn(&mut rng, m * d, 1.0);
    let wv = randn(&mut rng, d, 0.1);
    let mut pair = Vec::new();
    for be in [g, &u] {
        let l = be.linear(&[part(&wp)])?;
        let x = be.gather_rows(&be.upload(&xv, &[m, d])?, &(0..m).collect::<Vec<_>>())?;
        let w = be.upload(&wv, &[d])?;
        pair.push(time_ms(be, 20, &mut || be.matmul(&be.rms_norm(&x, &w, 1e-6, 1.0)?, &l).map(|_| ()))?);
    }
    out.push(format!(
        "rms_norm + fp8 GEMM N=128 [{m}, {d}]: fused quantisation {:.3} ms, quant_act_1x128 launch {:.3} ms",
        pair[0], pair[1]
    ));
    let dims = AttentionDims {
        heads: 16,
        kv_heads: 4,
        head_dim: 256,
        rotary_dim: 64,
        norm_eps: 1e-6,
    };
    let bf = |v: Vec<f32>, shape: &[usize]| -> Result<_> {
        let t = g.upload(&v, shape)?;
        g.gather_rows(&t, &(0..shape[0]).collect::<Vec<_>>())
    };
    // The fused projection [query/gate | key | value], BF16 as in the model.
    let qkv_w = dims.qkv_width();
    let qkv = bf(randn(&mut rng, m * qkv_w, 1.0), &[m, qkv_w])?;
    let nw = g.upload(&randn(&mut rng, 256, 0.1), &[256])?;
    let pos: Vec<i64> = (0..m as i64).collect();
    let (cos, sin) =
        positions::text_rope_tables(&[pos.clone(), pos.clone(), pos], 1e7, 64, [11, 11, 10]);
    let (cos, sin) = (g.upload(&cos, &[m, 64])?, g.upload(&sin, &[m, 64])?);
    let inputs = AttentionInputs {
        qkv: &qkv,
        q_norm: &nw,
        k_norm: &nw,
        cos: &cos,
        sin: &sin,
    };
    let ms = time_ms(g, 5, &mut || {
        let mut c = g.new_kv_cache(&dims)?;
        g.gated_attention(&inputs, &dims, &tiling(&[m]), &[], &mut [&mut c])
            .map(|_| ())
    })?;
    out.push(format!(
        "gated_attention 4B, 1×{m} tokens causal: {ms:.3} ms ({:.0} TFLOP/s)",
        4.0 * 16.0 * 256.0 * (m * m) as f64 / 2.0 / ms / 1e9
    ));
    let dd = D4B;
    let (ch, pw) = (dd.conv_channels(), dd.proj_width());
    let t = (
        // The fused projection [q | k | v | z | b | a], BF16 as in the model.
        bf(randn(&mut rng, m * pw, 1.0), &[m, pw])?,
        bf(randn(&mut rng, ch * 4, 0.5), &[ch, 4])?,
        g.upload(&[1.0; 32], &[32])?,
        g.upload(&[0.0; 32], &[32])?,
        g.upload(&[1.0; 128], &[128])?,
    );
    let inputs = DeltaNetInputs {
        proj: &t.0,
        conv_weight: &t.1,
        a_log: &t.2,
        dt_bias: &t.3,
        norm_weight: &t.4,
    };
    let ms = time_ms(g, 5, &mut || {
        let mut s = g.new_delta_state(&dd)?;
        g.gated_delta_net(&inputs, &dd, &tiling(&[m]), &[], &mut [&mut s])
            .map(|_| ())
    })?;
    out.push(format!("gated_delta_net 4B, 1×{m} tokens: {ms:.3} ms"));
    // The benchmark request's extend: 11 forks of one state, 73 tokens each (two chunks).
    let lens = [73usize; 11];
    let n11: usize = lens.iter().sum();
    let base = g.new_delta_state(&dd)?;
    let ms = time_ms(g, 5, &mut || {
        let mut forks: Vec<_> = (0..lens.len()).map(|_| base.clone()).collect();
        let mut refs: Vec<_> = forks.iter_mut().collect();
        let rows: Vec<usize> = (0..n11).collect();
        let x = g.gather_rows(&t.0, &rows)?;
        let inputs = DeltaNetInputs { proj: &x, ..inputs };
        g.gated_delta_net(&inputs, &dd, &tiling(&lens), &[], &mut refs).map(|_| ())
    })?;
    out.push(format!("gated_delta_net 4B, 11 forks × 73 tokens: {ms:.3} ms (incl. a row gather)"));
    Ok(out)
}

#[test]
fn cuda_backend_matches_cpu() {
    let g = match CudaBackend::new(0, CudaOptions::default()) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no CUDA device ({e:#})");
            return;
        }
    };
    let i = g.info();
    println!("{}", g.describe());
    println!(
        "kernels: {} from cache, {} compiled, {:.2} s",
        i.kernels_cached, i.kernels_compiled, i.kernel_seconds
    );
    let c = CpuBackend::default();
    let mut rep = Report::default();
    let t = Instant::now();
    ops(&g, &c, &mut rep);
    println!("(a) ops: {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    if let Err(e) = engine(&g, &mut rep) {
        rep.fail("engine", "golden models", e);
    }
    if let Err(e) = fused_engine(&g, &mut rep) {
        rep.fail("engine", "fused norm quant, 4B-wide 4-layer FP8 model", e);
    }
    println!("(b) engine: {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    if let Err(e) = prefix_extend(&g, &mut rep) {
        rep.fail("extend", "prefix + extend", e);
    }
    println!("(c) extend: {:.1} s", t.elapsed().as_secs_f64());
    if let Err(e) = g.synchronize() {
        rep.fail("device", "final synchronize", e);
    }
    rep.print();
    println!("\n(d) single-op timings at Qwen3.5-4B shapes (no assertions):");
    match perf(&g) {
        Ok(lines) => lines.iter().for_each(|l| println!("  {l}")),
        Err(e) => println!("  perf failed: {e:#}"),
    }
    println!(
        "\ncuBLASLt plans of the large shapes (algorithm fixed per shape at M={}):",
        imajev_serve::backend::cuda::gemm::M_REF
    );
    for p in g.gemm_plans().iter().filter(|p| p.n * p.k >= 1 << 20) {
        println!(
            "  {:?} N={} K={}: algo {} tile {} splitK {} stages {}",
            p.kind, p.n, p.k, p.algo_id, p.tile_id, p.splitk, p.stages
        );
    }
    println!(
        "GEMM calls that left their fixed algorithm: {}",
        g.gemm_fallbacks()
    );
    let failed: Vec<String> = rep
        .rows
        .iter()
        .filter(|r| !r.ok)
        .map(|r| format!("{} {}: {:.3e} {}", r.part, r.name, r.value, r.note))
        .collect();
    assert!(
        failed.is_empty(),
        "{} GPU checks failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
