//! Projections (src/backend/cuda/linear.rs, cuBLASLt) against the CPU: BF16 and block-FP8 GEMMs,
//! bias and LoRA, the FP8 activation quantiser against its CPU twin, the FP8 GEMM against an f32
//! GEMM of its own dequantised operands, bitwise batch invariance, SwiGLU fused with the FP8
//! quantisation, and the f32 readout.

use super::harness::{bit_diff, rel, rms_rel, variant, Report};
use anyhow::{ensure, Result};
use imajev_serve::backend::cpu::linear::matmul_xwt;
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::gemm_fp8::Fp8Gemm;
use imajev_serve::backend::cuda::narrow::NarrowGemm;
use imajev_serve::backend::cuda::CudaBackend;
use imajev_serve::backend::{Backend, LinearPart, LoraPair};
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;
use imajev_serve::weights::fp8::{dequantize_act_1x128, dequantize_fp8_blocks, fp8_rows, quantize_act_1x128};

pub fn gemm_checks(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";

    // BF16 GEMM, out_proj shape.
    let (n, k, m) = (2560, 4096, 300);
    let w = MemoryTensor::bf16("bf16.weight", &[n, k], &rng.bf16_normals(n * k, 0.02));
    let x = rng.bf16_normals(m * k, 1.0);
    let (lg, lc) = (g.linear(&[w.part()])?, c.linear(&[w.part()])?);
    let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
    let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
    rep.check(p, "bf16 N=2560 K=4096 M=300", rel(&yg, &yc), 1e-2);
    invariance(g, rep, "bf16 N=2560 K=4096", &lg, &x, k, &yg)?;

    // Bias + LoRA on two of three parts (vision qkv-like), ragged M.
    let (k2, m2) = (1024, 201);
    let parts_w: Vec<MemoryTensor> = [1024usize, 1024, 1024]
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            MemoryTensor::bf16(&format!("qkv{i}.weight"), &[o, k2], &rng.bf16_normals(o * k2, 0.03))
        })
        .collect();
    let bias: Vec<MemoryTensor> = (0..3)
        .map(|i| MemoryTensor::f32(&format!("qkv{i}.bias"), &[1024], &rng.bf16_normals(1024, 0.5)))
        .collect();
    let la: Vec<MemoryTensor> = (0..2)
        .map(|i| MemoryTensor::bf16(&format!("l{i}.A"), &[16, k2], &rng.bf16_normals(16 * k2, 0.05)))
        .collect();
    let lb: Vec<MemoryTensor> = (0..2)
        .map(|i| MemoryTensor::bf16(&format!("l{i}.B"), &[1024, 16], &rng.bf16_normals(1024 * 16, 0.05)))
        .collect();
    let parts: Vec<LinearPart> = (0..3)
        .map(|i| LinearPart {
            weight: parts_w[i].r(),
            bias: Some(bias[i].r()),
            lora: match i {
                0 => Some(LoraPair { a: la[0].r(), b: lb[0].r(), scale: 2.0 }),
                2 => Some(LoraPair { a: la[1].r(), b: lb[1].r(), scale: 0.5 }),
                _ => None,
            },
        })
        .collect();
    let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
    let x2 = rng.bf16_normals(m2 * k2, 1.0);
    let e = rel(
        &g.download(&g.matmul(&g.upload(&x2, &[m2, k2])?, &lg)?)?,
        &c.matmul(&c.upload(&x2, &[m2, k2])?, &lc)?.data,
    );
    rep.check(p, format!("bf16 + bias + LoRA r16 on parts 0,2 [{}] M=201", lg.summary()), e, 1e-2);

    // Block FP8, activation magnitudes varying per (row, 128-block), weight magnitudes per block.
    let (n, k, m) = (2560, 4096, 300);
    let (w8, x) = varied_fp8_case(rng, n, k, m);
    let (lg, lc) = (g.linear(&[w8.part()])?, c.linear(&[w8.part()])?);
    ensure!(lg.summary() == "fp8[0..2560]", "FP8 checkpoint weight placed as {}", lg.summary());
    let xg = g.upload(&x, &[m, k])?;
    let yg = g.download(&g.matmul(&xg, &lg)?)?;
    // The quantiser against its CPU twin.
    let (qg, sg) = g.quantize_activations(&xg)?;
    let (qh, sh) = quantize_act_1x128(&x, m, k);
    let byte_diff = qg.iter().zip(&qh).filter(|(a, b)| a != b).count();
    rep.check(
        p,
        "fp8 act quant [300, 4096]: bytes ≠ CPU twin (fraction)",
        byte_diff as f64 / qh.len() as f64,
        1e-4,
    );
    rep.check(p, "fp8 act quant: scales [K/128][M] vs CPU twin", rel(&sg, &sh), 1e-6);
    // The GEMM against an f32 GEMM of exactly its dequantised operands.
    let mpad = fp8_rows(m);
    let xd = dequantize_act_1x128(&qg, &sg, m, mpad, k);
    let wd = dequantised(&w8, n, k)?;
    let mut yref = vec![0f32; m * n];
    matmul_xwt(&xd, m, k, &wd, n, &mut yref, false);
    rep.check(p, "fp8 N=2560 K=4096 M=300 vs dequantised operands (max)", rel(&yg, &yref), 1e-2);
    rep.check(p, "fp8 … same (rms, probe measured 1.7e-3)", rms_rel(&yg, &yref), 3e-3);
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
    let ws = in_proj_parts(rng, &outs, k, 2);
    let la = [
        MemoryTensor::bf16("a0", &[8, k], &rng.bf16_normals(8 * k, 0.05)),
        MemoryTensor::bf16("a2", &[8, k], &rng.bf16_normals(8 * k, 0.05)),
    ];
    let lb = [
        MemoryTensor::bf16("b0", &[8192, 8], &rng.bf16_normals(8192 * 8, 0.05)),
        MemoryTensor::bf16("b2", &[32, 8], &rng.bf16_normals(32 * 8, 0.05)),
    ];
    let parts: Vec<LinearPart> = (0..4)
        .map(|i| LinearPart {
            weight: ws[i].r(),
            bias: None,
            lora: match i {
                0 => Some(LoraPair { a: la[0].r(), b: lb[0].r(), scale: 2.0 }),
                2 => Some(LoraPair { a: la[1].r(), b: lb[1].r(), scale: 2.0 }),
                _ => None,
            },
        })
        .collect();
    let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
    let x = rng.bf16_normals(m * k, 1.0);
    let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
    let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
    let n = 12352;
    let fp8_cols: Vec<(Vec<f32>, Vec<f32>)> =
        (0..m).map(|r| (yg[r * n..r * n + 12288].to_vec(), yc[r * n..r * n + 12288].to_vec())).collect();
    let bf_cols: Vec<(Vec<f32>, Vec<f32>)> = (0..m)
        .map(|r| (yg[r * n + 12288..(r + 1) * n].to_vec(), yc[r * n + 12288..(r + 1) * n].to_vec()))
        .collect();
    let cat = |v: &[(Vec<f32>, Vec<f32>)], first: bool| -> Vec<f32> {
        v.iter().flat_map(|p| if first { p.0.clone() } else { p.1.clone() }).collect()
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
    let gq = variant(g, |o| o.quantize_fp8 = true)?;
    let (n, k, m) = (1024, 2560, 33);
    let w = MemoryTensor::bf16("q.weight", &[n, k], &rng.bf16_normals(n * k, 0.02));
    let lq = gq.linear(&[w.part()])?;
    ensure!(lq.summary() == "fp8[0..1024]", "quantize_fp8 placed {}", lq.summary());
    let x = rng.bf16_normals(m * k, 1.0);
    let e = rel(
        &gq.download(&gq.matmul(&gq.upload(&x, &[m, k])?, &lq)?)?,
        &c.matmul(&c.upload(&x, &[m, k])?, &c.linear(&[w.part()])?)?.data,
    );
    rep.check(p, "quantize_fp8 at load: N=1024 K=2560 M=33 vs CPU bf16 weights", e, 1e-1);
    Ok(())
}

/// The narrow BF16 GEMMs (src/backend/cuda/narrow.rs: n <= 128, K split by a constant) against
/// the CPU and bitwise across M: one split (k <= 256, written directly), several (f32 partials
/// added in order), a last split shorter than the others, each padded width (32, 64, 128), an
/// output narrower than its width, and a LoRA A beside a BF16 projection; and the whole shape
/// (one block walks every split of its rows, as tall batches run) bitwise equal to the split one.
pub fn narrow(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";
    // The kernels are opt-in (cuBLASLt runs these shapes by default): checked on backends that
    // use them, split where M allows it and whole.
    let g = &variant(g, |o| o.narrow_gemm = NarrowGemm::N)?;
    let whole = variant(g, |o| o.narrow_whole_rows = Some(0))?;
    for (n, k) in [(64usize, 2560usize), (32, 2560), (128, 9216), (64, 512), (8, 96), (24, 1056), (96, 4096)]
    {
        let m = 300;
        let w = MemoryTensor::bf16("narrow.weight", &[n, k], &rng.bf16_normals(n * k, 0.02));
        let x = rng.bf16_normals(m * k, 1.0);
        let (lg, lc) = (g.linear(&[w.part()])?, c.linear(&[w.part()])?);
        let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
        let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
        rep.check(p, format!("narrow bf16 N={n} K={k} M={m}"), rel(&yg, &yc), 1e-2);
        invariance(g, rep, &format!("narrow bf16 N={n} K={k}"), &lg, &x, k, &yg)?;
        let yw = whole.download(&whole.matmul(&whole.upload(&x, &[m, k])?, &whole.linear(&[w.part()])?)?)?;
        let differ = yw.iter().zip(&yg).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        rep.check(
            p,
            format!("narrow bf16 N={n} K={k} M={m}: whole ≠ split (bitwise count)"),
            differ as f64,
            0.0,
        );
    }
    // A LoRA (A: n = rank 64 on the narrow kernel, B on gemm_narrow_k_acc) on a 256-wide BF16
    // projection.
    let (n, k, r, m) = (256usize, 2560usize, 64usize, 203usize);
    let w = MemoryTensor::bf16("p.weight", &[n, k], &rng.bf16_normals(n * k, 0.02));
    let a = MemoryTensor::bf16("p.A", &[r, k], &rng.bf16_normals(r * k, 0.05));
    let b = MemoryTensor::bf16("p.B", &[n, r], &rng.bf16_normals(n * r, 0.05));
    let parts = [w.lora_part(&a, &b, 2.0)];
    let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
    let x = rng.bf16_normals(m * k, 1.0);
    let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
    let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
    rep.check(p, format!("bf16 N={n} K={k} + LoRA r{r} (A on the narrow kernel) M={m}"), rel(&yg, &yc), 1e-2);
    invariance(g, rep, &format!("bf16 N={n} K={k} + LoRA r{r}"), &lg, &x, k, &yg)?;
    Ok(())
}

/// The LoRA B side on gemm_narrow_k_acc (`y += α·t·Bᵀ`, k = the fused rank) against the CPU and
/// bitwise across M: fused ranks 64, 128 (two parts, block-diagonal B) and 192 (three parts, as a
/// q/k/v projection; its A side is wider than the narrow kernel and runs on cuBLASLt), outputs
/// that end inside a 128-column tile and rows that end inside a 128-row tile, on a BF16 projection
/// (tight tolerance) and on FP8 ones as the model runs them.
pub fn lora_b(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    // The k kernel is opt-in (cuBLASLt runs LoRA B by default): checked on a backend that uses it.
    let g = &variant(g, |o| o.narrow_gemm = NarrowGemm::Both)?;
    let (k, r, m) = (1024usize, 64usize, 300usize);
    for (outs, fp8) in [(vec![2560usize], false), (vec![1304, 1296], true), (vec![512, 136, 136], true)] {
        let n: usize = outs.iter().sum();
        let mk = |name: String, rows: usize, cols: usize, sd: f32, rng: &mut SplitMix| {
            MemoryTensor::bf16(&name, &[rows, cols], &rng.bf16_normals(rows * cols, sd))
        };
        let ws: Vec<MemoryTensor> = outs
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let (name, v) = (format!("p{i}.weight"), rng.bf16_normals(o * k, 0.02));
                if fp8 {
                    MemoryTensor::fp8(&name, &[o, k], &v)
                } else {
                    MemoryTensor::bf16(&name, &[o, k], &v)
                }
            })
            .collect();
        let a: Vec<MemoryTensor> = (0..outs.len()).map(|i| mk(format!("p{i}.A"), r, k, 0.05, rng)).collect();
        let b: Vec<MemoryTensor> =
            outs.iter().enumerate().map(|(i, &o)| mk(format!("p{i}.B"), o, r, 0.05, rng)).collect();
        let parts: Vec<LinearPart> = (0..outs.len()).map(|i| ws[i].lora_part(&a[i], &b[i], 2.0)).collect();
        let (lg, lc) = (g.linear(&parts)?, c.linear(&parts)?);
        let x = rng.bf16_normals(m * k, 1.0);
        let yg = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &lg)?)?;
        let yc = c.matmul(&c.upload(&x, &[m, k])?, &lc)?.data;
        let kind = if fp8 { "fp8" } else { "bf16" };
        let name = format!(
            "{kind} N={n} K={k} + LoRA rank {} ({} parts, B on the k kernel)",
            r * outs.len(),
            outs.len()
        );
        // FP8: the activation quantisation error against the CPU's f32, as gemm_checks allows.
        rep.check("gemm", format!("{name} M={m} vs CPU f32"), rel(&yg, &yc), if fp8 { 8e-2 } else { 1e-2 });
        invariance(g, rep, &name, &lg, &x, k, &yg)?;
    }
    Ok(())
}

/// Rows of a GEMM must not depend on how many rows share the call: bitwise.
pub fn invariance(
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
        bad += y.iter().zip(&full[..mm * n]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        worst = worst.max(rel(&y, &full[..mm * n]));
    }
    rep.check(
        "gemm",
        format!("{name}: rows of M∈{{1,7,64,129}} ≠ rows of M={} (bitwise count)", full.len() / n),
        bad as f64,
        0.0,
    );
    if bad > 0 {
        rep.info("gemm", format!("{name}: … max rel difference"), worst, "");
    }
    Ok(())
}

/// Rows of GEMMs at the 64K-token ceiling (past the 30K rows where cuBLASLt once rejected a
/// fixed algorithm) equal the rows of small batches, bitwise: the LoRA A shapes (BF16, N = 64,
/// K = 2560 and 9216), in_proj b/a (BF16, N = 32) and the FP8 down projection; no GEMM left its
/// algorithm. Whichever route the options give the narrow shapes (our kernels or cuBLASLt).
pub fn large_batches(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let m = 65_536;
    let before = g.gemm_fallbacks();
    for (name, n, k, fp8) in [
        ("bf16 LoRA A", 64usize, 2560usize, false),
        ("bf16 LoRA A of down", 64, 9216, false),
        ("bf16 in_proj b", 32, 2560, false),
        ("fp8 down", 2560, 9216, true),
    ] {
        let v = rng.bf16_normals(n * k, 0.02);
        let w = if fp8 { MemoryTensor::fp8("w", &[n, k], &v) } else { MemoryTensor::bf16("w", &[n, k], &v) };
        let l = g.linear(&[w.part()])?;
        let x = rng.bf16_normals(m * k, 1.0);
        let full = g.download(&g.matmul(&g.upload(&x, &[m, k])?, &l)?)?;
        let mut bad = 0usize;
        // The first rows alone, and the last rows alone (they sit in the last row block).
        for (first, rows) in [(0usize, 1usize), (0, 129), (m - 77, 77)] {
            let y = g.download(&g.matmul(&g.upload(&x[first * k..(first + rows) * k], &[rows, k])?, &l)?)?;
            bad += y
                .iter()
                .zip(&full[first * n..(first + rows) * n])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
        }
        rep.check(
            "gemm",
            format!("{name} N={n} K={k}: rows of M={m} ≠ the same rows alone (bitwise count)"),
            bad as f64,
            0.0,
        );
    }
    rep.check(
        "gemm",
        format!("GEMM calls that left their fixed algorithm at M={m}"),
        (g.gemm_fallbacks() - before) as f64,
        0.0,
    );
    Ok(())
}

/// SwiGLU fused with the FP8 activation quantisation, bitwise against the unfused path.
pub fn swiglu_matmul(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";
    // SwiGLU fused with the FP8 activation quantisation, 4B down_proj shape: bitwise equal to
    // the GPU's unfused swiglu + matmul (plain and with a LoRA that reads the BF16 rows).
    let (n, k) = (2560, 9216);
    let w8 = MemoryTensor::fp8("down.weight", &[n, k], &rng.bf16_normals(n * k, 0.02));
    let la = MemoryTensor::bf16("down.A", &[8, k], &rng.bf16_normals(8 * k, 0.05));
    let lb = MemoryTensor::bf16("down.B", &[n, 8], &rng.bf16_normals(n * 8, 0.05));
    let (lg, lc) = (g.linear(&[w8.part()])?, c.linear(&[w8.part()])?);
    let lora = [w8.lora_part(&la, &lb, 2.0)];
    let lgl = g.linear(&lora)?;
    ensure!(lg.summary() == "fp8[0..2560]", "FP8 checkpoint weight placed as {}", lg.summary());
    for m in [1usize, 37, 130] {
        let gu = rng.bf16_normals(m * 2 * k, 2.0);
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
}

/// The MLP with its gate/up LoRA B side fused into the SwiGLU (`swiglu_lora_quant_1x128_64`,
/// `mlp_lora_fused`) at Qwen3.5-4B's shapes (2560 → 2 × 9216 → 2560, LoRA rank 64 on gate, up and
/// down, scale 2): against the unfused GPU MLP (the LoRA B GEMM; the same values up to the order of
/// its 64-term sums and one bf16 rounding fewer, then FP8 activation codes that flip with them: on
/// the H200 1.1–1.5e-2 apart, where a LoRA side lost or misplaced is ~0.3), against the CPU (f32:
/// within the quantisation error, and no further from it than the unfused MLP is), and
/// batch-invariant (the rows of a 37-row call bit for bit the first rows of a 977-row call).
pub fn swiglu_mlp(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";
    let (h, k, r) = (2560usize, 9216usize, 64usize);
    // On cuBLASLt's FP8 GEMMs: the own kernel (the Hopper default) takes the gate/up LoRA into its
    // epilogue, and the fused SwiGLU kernel is what the cuBLASLt path runs.
    let fused = variant(g, |o| {
        o.mlp_lora_fused = true;
        o.fp8_gemm = Fp8Gemm::Cublas
    })?;
    let plain = variant(g, |o| {
        o.mlp_lora_fused = false;
        o.fp8_gemm = Fp8Gemm::Cublas
    })?;
    if !fused.options().mlp_lora_fused || plain.options().mlp_lora_fused {
        rep.flag(p, "swiglu_mlp fused vs unfused", false, "IMAJEV_MLP_LORA_FUSED forces one: unset it");
        return Ok(());
    }
    let mlp = LoraMlp::random(rng, h, k, r);
    let (gate_up, down) = (mlp.gate_up(), mlp.down());
    let (fgu, fd) = (fused.linear(&gate_up)?, fused.linear(&down)?);
    let (pgu, pd) = (plain.linear(&gate_up)?, plain.linear(&down)?);
    let (cgu, cd) = (c.linear(&gate_up)?, c.linear(&down)?);
    rep.flag(
        p,
        format!("swiglu_mlp: [{}] takes the fused kernel (rank per part {r})", fgu.summary()),
        fgu.swiglu_lora_rank() == Some(r),
        "CudaLinear::swiglu_lora refused the gate/up projection",
    );
    let x_all = rng.bf16_normals(977 * h, 1.0);
    let mut first_rows = Vec::new();
    for m in [1usize, 37, 130, 977] {
        let x = &x_all[..m * h];
        let of = fused.download(&fused.swiglu_mlp(&fused.upload(x, &[m, h])?, &fgu, &fd)?)?;
        let op = plain.download(&plain.swiglu_mlp(&plain.upload(x, &[m, h])?, &pgu, &pd)?)?;
        rep.check(p, format!("swiglu_mlp fused vs unfused GPU, M={m}"), rel(&of, &op), 3e-2);
        if m == 37 || m == 130 {
            let want = c.swiglu_mlp(&c.upload(x, &[m, h])?, &cgu, &cd)?.data;
            let (fused_err, plain_err) = (rel(&of, &want), rel(&op, &want));
            rep.check(p, format!("swiglu_mlp fused vs CPU f32 (quantisation error), M={m}"), fused_err, 8e-2);
            rep.check(
                p,
                format!("swiglu_mlp fused's CPU error / unfused's ({plain_err:.3e}), M={m}"),
                fused_err / plain_err.max(1e-12),
                1.2,
            );
        }
        if m == 37 {
            first_rows = of;
        } else if m == 977 {
            rep.check(
                p,
                "swiglu_mlp fused: rows of a 37-row call vs the same rows of a 977-row call (bitwise)",
                rel(&first_rows, &of[..37 * h]),
                0.0,
            );
        }
    }
    Ok(())
}

/// The MLP on the FP8 kernel's GLU form (`swiglu_epilogue`, opt-in on Hopper: the SwiGLU and the
/// down projection's FP8 input in the gate/up GEMM's epilogue) against the same MLP with the gate/up
/// output stored and `swiglu_quant_1x128` (the same kernels otherwise): bitwise, with rank-64 LoRA
/// pairs on gate and up, with a LoRA on up alone (rank 16: windows that cover one part), and
/// without LoRA; against the CPU (within the quantisation error); and batch-invariant (the rows of
/// a 37-row call bit for bit the first rows of a 4,097-row call).
pub fn swiglu_epilogue(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";
    if !g.info().hopper() {
        rep.flag(p, "GLU form: not a Hopper GPU, never launched, not checked", true, "");
        return Ok(());
    }
    let on = variant(g, |o| o.swiglu_epilogue = true)?;
    let off = variant(g, |o| o.swiglu_epilogue = false)?;
    let (h, k) = (2560usize, 9216usize);
    let mlp = LoraMlp::random(rng, h, k, 64);
    let (ua16, ub16) = lora_factors("up16", k, h, 16, rng);
    let down = mlp.down();
    let cases: [(&str, Vec<LinearPart>); 3] = [
        ("LoRA r64 on gate and up", mlp.gate_up().to_vec()),
        ("LoRA r16 on up", vec![mlp.gate.part(), mlp.up.lora_part(&ua16, &ub16, 0.5)]),
        ("no LoRA", vec![mlp.gate.part(), mlp.up.part()]),
    ];
    let x_all = rng.bf16_normals(4097 * h, 1.0);
    for (what, gate_up) in &cases {
        let (ogu, od) = (on.linear(gate_up)?, on.linear(&down)?);
        let (fgu, fd) = (off.linear(gate_up)?, off.linear(&down)?);
        rep.flag(
            p,
            format!("GLU form ({what}): [{}] takes it, not with the switch off", ogu.summary()),
            on.swiglu_epilogue_takes(&ogu) && !off.swiglu_epilogue_takes(&fgu),
            "CudaBackend::swiglu_epilogue_takes",
        );
        let (cgu, cd) = (c.linear(gate_up)?, c.linear(&down)?);
        let mut first_rows = Vec::new();
        for m in [1usize, 37, 130, 977, 4097] {
            let x = &x_all[..m * h];
            let yo = on.download(&on.swiglu_mlp(&on.upload(x, &[m, h])?, &ogu, &od)?)?;
            let yf = off.download(&off.swiglu_mlp(&off.upload(x, &[m, h])?, &fgu, &fd)?)?;
            rep.check(
                p,
                format!("GLU form vs gate/up + swiglu_quant ({what}), M={m} (bitwise)"),
                rel(&yo, &yf),
                0.0,
            );
            if m == 37 || m == 130 {
                let want = c.swiglu_mlp(&c.upload(x, &[m, h])?, &cgu, &cd)?.data;
                rep.check(p, format!("GLU form vs CPU f32 ({what}), M={m}"), rel(&yo, &want), 8e-2);
            }
            if m == 37 {
                first_rows = yo;
            } else if m == 4097 {
                rep.check(
                    p,
                    format!("GLU form ({what}): rows of a 37-row call vs a 4,097-row call's (bitwise)"),
                    rel(&first_rows, &yo[..37 * h]),
                    0.0,
                );
            }
        }
    }
    Ok(())
}

/// The f32 readout head.
pub fn readout(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let (p, d) = ("gemm", 2560);
    let h = rng.bf16_normals(5 * d, 1.0);
    let rw = MemoryTensor::f32("readout", &[12, d], &rng.bf16_normals(12 * d, 0.05));
    let e = rel(
        &g.readout(&g.upload(&h, &[5, d])?, &g.param_f32(&rw.r())?)?,
        &c.readout(&c.upload(&h, &[5, d])?, &c.param_f32(&rw.r())?)?,
    );
    rep.check(p, "readout f32 [5, 2560] × [12, 2560]ᵀ", e, 1e-5);
    Ok(())
}

/// The block-scaled FP8 GEMM on our own kernel (src/backend/cuda/gemm_fp8.rs, both tile heights)
/// with LoRA pairs in its epilogue, against the GEMM of its own dequantised operands, the CPU and
/// cuBLASLt (+ its separate LoRA B GEMM), and bitwise across M: a plain projection with scales
/// varying per block; an in_proj-like one (three FP8 parts, a part boundary inside a 128-column
/// tile, a part without LoRA, ranks 16/64/32 so windows run past a 64-column rank chunk, a BF16
/// part after them); and the MLP, whose gate/up LoRA then takes the epilogue instead of the fused
/// SwiGLU kernel.
pub fn own_fp8(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "gemm";
    if !g.info().hopper() {
        rep.flag(p, "own FP8 GEMM: not a Hopper GPU, never launched, not checked", true, "");
        return Ok(());
    }
    let cublas = variant(g, |o| o.fp8_gemm = Fp8Gemm::Cublas)?;
    if cublas.options().fp8_gemm != Fp8Gemm::Cublas {
        rep.flag(p, "own FP8 GEMM vs cuBLASLt", false, "IMAJEV_FP8_GEMM forces one: unset it");
        return Ok(());
    }
    // Plain FP8, N=2560 K=4096, magnitudes varying per weight block and per activation 128-block.
    let (n, k, m) = (2560, 4096, 300);
    let (w8, x) = varied_fp8_case(rng, n, k, m);
    let wd = dequantised(&w8, n, k)?;
    let yb = cublas.download(&cublas.matmul(&cublas.upload(&x, &[m, k])?, &cublas.linear(&[w8.part()])?)?)?;

    // in_proj-like: FP8 parts of 1024, 896 (no LoRA) and 2048 columns (FP8 parts are whole
    // 128-blocks, so no tile straddles two), then a BF16 part of 32.
    let (k2, m2) = (2560, 977);
    let outs = [1024usize, 896, 2048, 32];
    let ranks = [16usize, 0, 32, 0];
    let ws = in_proj_parts(rng, &outs, k2, 3);
    let la: Vec<MemoryTensor> = (0..4)
        .map(|i| {
            MemoryTensor::bf16(
                &format!("a{i}"),
                &[ranks[i].max(1), k2],
                &rng.bf16_normals(ranks[i].max(1) * k2, 0.05),
            )
        })
        .collect();
    let lb: Vec<MemoryTensor> = (0..4)
        .map(|i| {
            let r = ranks[i].max(1);
            MemoryTensor::bf16(&format!("b{i}"), &[outs[i], r], &rng.bf16_normals(outs[i] * r, 0.05))
        })
        .collect();
    let parts: Vec<LinearPart> = (0..4)
        .map(|i| if ranks[i] > 0 { ws[i].lora_part(&la[i], &lb[i], 2.0) } else { ws[i].part() })
        .collect();
    let x2 = rng.bf16_normals(m2 * k2, 1.0);
    let y2b = cublas.download(&cublas.matmul(&cublas.upload(&x2, &[m2, k2])?, &cublas.linear(&parts)?)?)?;
    let y2c = c.matmul(&c.upload(&x2, &[m2, k2])?, &c.linear(&parts)?)?.data;
    // Ranks 16 and 128 on the adjacent parts 0 and 1: part 1's tiles need rank columns [16, 144),
    // two 64-column chunks from 16.
    let big_a = MemoryTensor::bf16("a1w", &[128, k2], &rng.bf16_normals(128 * k2, 0.05));
    let big_b = MemoryTensor::bf16("b1w", &[outs[1], 128], &rng.bf16_normals(outs[1] * 128, 0.05));
    // A vision-tower-like projection with a bias (the epilogue adds it, as add_bias8 after
    // cuBLASLt), plain and with a LoRA pair (the bias after the LoRA, as in the unfused path).
    let (n4, k4, m4) = (1024, 1024, 977);
    let (w4, x4) = varied_fp8_case(rng, n4, k4, m4);
    let b4 = MemoryTensor::f32("proj.bias", &[n4], &rng.bf16_normals(n4, 0.5));
    let (a4, bb4) = (
        MemoryTensor::bf16("proj.A", &[16, k4], &rng.bf16_normals(16 * k4, 0.05)),
        MemoryTensor::bf16("proj.B", &[n4, 16], &rng.bf16_normals(n4 * 16, 0.05)),
    );
    let biased = [LinearPart { bias: Some(b4.r()), ..w4.part() }];
    let biased_lora = [LinearPart { bias: Some(b4.r()), ..w4.lora_part(&a4, &bb4, 2.0) }];
    let y4b = cublas.download(&cublas.matmul(&cublas.upload(&x4, &[m4, k4])?, &cublas.linear(&biased)?)?)?;
    let y4c = c.matmul(&c.upload(&x4, &[m4, k4])?, &c.linear(&biased_lora)?)?.data;
    // Several tiles a block (352 tiles of 192 rows, 512 of 128, on one block an SM): every tile
    // but a block's first is stored under the next tile's MMAs by the _d kernels; plain and with a
    // bias, bitwise against cuBLASLt (+ add_bias8).
    let (n5, k5, m5) = (4096, 2560, 2000);
    let (w5, x5) = varied_fp8_case(rng, n5, k5, m5);
    let b5 = MemoryTensor::f32("many.bias", &[n5], &rng.bf16_normals(n5, 0.5));
    let many = [[w5.part()], [LinearPart { bias: Some(b5.r()), ..w5.part() }]];
    let mut y5b = Vec::new();
    for parts in &many {
        y5b.push(cublas.download(&cublas.matmul(&cublas.upload(&x5, &[m5, k5])?, &cublas.linear(parts)?)?)?);
    }
    let mut outputs: Vec<Vec<f32>> = Vec::new();
    for (kind, label) in [
        (Fp8Gemm::Own128, "own128"),
        (Fp8Gemm::Own192, "own192"),
        (Fp8Gemm::Own128Multicast, "own128m"),
        (Fp8Gemm::Own192Multicast, "own192m"),
        (Fp8Gemm::Own128Deferred, "own128d"),
        (Fp8Gemm::Own192Deferred, "own192d"),
    ] {
        let o = variant(g, |o| o.fp8_gemm = kind)?;
        let lo = o.linear(&[w8.part()])?;
        let y = o.download(&o.matmul(&o.upload(&x, &[m, k])?, &lo)?)?;
        let (qg, sg) = o.quantize_activations(&o.upload(&x, &[m, k])?)?;
        let xd = dequantize_act_1x128(&qg, &sg, m, fp8_rows(m), k);
        let mut yref = vec![0f32; m * n];
        matmul_xwt(&xd, m, k, &wd, n, &mut yref, false);
        rep.check(
            p,
            format!("{label} fp8 N=2560 K=4096 M=300 vs dequantised operands (max)"),
            rel(&y, &yref),
            1e-2,
        );
        rep.check(p, format!("{label} … same (rms; cuBLASLt's probe 1.7e-3)"), rms_rel(&y, &yref), 3e-3);
        rep.check(p, format!("{label} … vs cuBLASLt (max)"), rel(&y, &yb), 1e-2);
        invariance(&o, rep, &format!("{label} fp8 N=2560 K=4096"), &lo, &x, k, &y)?;

        let l2 = o.linear(&parts)?;
        rep.flag(
            p,
            format!("{label} [{}]: the LoRA pair goes to the FP8 GEMM's epilogue", l2.summary()),
            l2.lora_in_fp8_epilogue(),
            "no FP8 group holds the adapted parts: the epilogue is not tested",
        );
        let y2 = o.download(&o.matmul(&o.upload(&x2, &[m2, k2])?, &l2)?)?;
        let name = format!("{label} [{}] + LoRA r16/r32 on parts 0, 2", l2.summary());
        as_close_as(rep, &format!("{name} M={m2}"), &y2, ("cuBLASLt + lora_b", &y2b), &y2c);
        invariance(&o, rep, &name, &l2, &x2, k2, &y2)?;

        let wide = [
            ws[0].lora_part(&la[0], &lb[0], 2.0),
            ws[1].lora_part(&big_a, &big_b, 2.0),
            ws[2].part(),
            ws[3].part(),
        ];
        let (lw, cw) = (o.linear(&wide)?, c.linear(&wide)?);
        let yw = o.download(&o.matmul(&o.upload(&x2, &[m2, k2])?, &lw)?)?;
        let ywc = c.matmul(&c.upload(&x2, &[m2, k2])?, &cw)?.data;
        rep.check(
            p,
            format!("{label} LoRA r16 + r128 on adjacent parts (two rank chunks) M={m2} vs CPU f32"),
            rel(&yw, &ywc),
            8e-2,
        );
        let y4 = o.download(&o.matmul(&o.upload(&x4, &[m4, k4])?, &o.linear(&biased)?)?)?;
        rep.check(
            p,
            format!("{label} fp8 + bias in the epilogue N={n4} K={k4} M={m4} vs cuBLASLt + add_bias8 (bitwise count)"),
            y4.iter().zip(&y4b).filter(|(a, b)| a.to_bits() != b.to_bits()).count() as f64,
            0.0,
        );
        let y4l = o.download(&o.matmul(&o.upload(&x4, &[m4, k4])?, &o.linear(&biased_lora)?)?)?;
        rep.check(p, format!("{label} fp8 + LoRA r16 + bias M={m4} vs CPU f32"), rel(&y4l, &y4c), 8e-2);
        for (parts, (yb5, what)) in many.iter().zip(y5b.iter().zip(["", " + bias"])) {
            let y5 = o.download(&o.matmul(&o.upload(&x5, &[m5, k5])?, &o.linear(parts)?)?)?;
            rep.check(
                p,
                format!("{label} fp8{what} N={n5} K={k5} M={m5}, several tiles a block, vs cuBLASLt (bitwise count)"),
                bit_diff(&y5, yb5) as f64,
                0.0,
            );
        }
        outputs.push([y, y2, yw, y4, y4l].concat());
    }
    // A row's arithmetic should not depend on the tile height (each warpgroup's 64 rows run the
    // same k order and promotion): if these are the same bits, the height may follow M freely.
    let bits_differ = |a: usize, b: usize| {
        outputs[a].iter().zip(&outputs[b]).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
    };
    let differ = bits_differ(0, 1);
    rep.info(p, "own128 vs own192 outputs: elements not bitwise equal", differ as f64, "0: tile height free");
    // Clusters sharing W tiles change where the bytes come from, not the sums; a deferred store
    // changes when a tile's output leaves, not its values.
    for (c, plain, label) in [
        (2, 0, "own128m vs own128"),
        (3, 1, "own192m vs own192"),
        (4, 0, "own128d vs own128"),
        (5, 1, "own192d vs own192"),
    ] {
        rep.check(
            p,
            format!("{label} outputs: elements not bitwise equal"),
            bits_differ(plain, c) as f64,
            0.0,
        );
    }
    // The MLP with the gate/up LoRA in the epilogue (and the down projection's).
    let h = 2560usize;
    let mlp = LoraMlp::random(rng, h, 9216, 64);
    let (gate_up, down) = (mlp.gate_up(), mlp.down());
    let o = variant(g, |o| o.fp8_gemm = Fp8Gemm::Own128)?;
    let (ogu, od) = (o.linear(&gate_up)?, o.linear(&down)?);
    let (bgu, bd) = (cublas.linear(&gate_up)?, cublas.linear(&down)?);
    let (cgu, cd) = (c.linear(&gate_up)?, c.linear(&down)?);
    let x3 = rng.bf16_normals(130 * h, 1.0);
    let yo = o.download(&o.swiglu_mlp(&o.upload(&x3, &[130, h])?, &ogu, &od)?)?;
    let yb = cublas.download(&cublas.swiglu_mlp(&cublas.upload(&x3, &[130, h])?, &bgu, &bd)?)?;
    let yc = c.swiglu_mlp(&c.upload(&x3, &[130, h])?, &cgu, &cd)?.data;
    rep.check(p, "own128 swiglu_mlp (LoRA in the epilogues) M=130 vs CPU f32", rel(&yo, &yc), 8e-2);
    rep.check(
        p,
        format!("own128 swiglu_mlp: CPU error / cuBLASLt path's ({:.3e})", rel(&yb, &yc)),
        rel(&yo, &yc) / rel(&yb, &yc).max(1e-12),
        1.2,
    );

    // The LoRA A sides on the kernel's BF16 form (`lora_a_own`, opt-in): T's sums run in another
    // order than cuBLASLt's, so a few of T's BF16 roundings differ; the projections must stay as
    // close to the CPU as with cuBLASLt's A side, and rows bitwise across M. (Every A side here
    // fits the form: K 2560 / 9216 in 64-column stages, ranks 48 / 128 / 64.)
    let with = |own: bool| {
        variant(g, |o| {
            o.fp8_gemm = Fp8Gemm::Own192;
            o.lora_a_own = own;
        })
    };
    let (oa, o192) = (with(true)?, with(false)?);
    if !oa.own_lora_a() || o192.own_lora_a() {
        rep.flag(p, "own LoRA A vs cuBLASLt's", false, "IMAJEV_LORA_A forces one: unset it");
        return Ok(());
    }
    let (la2, l192) = (oa.linear(&parts)?, o192.linear(&parts)?);
    let ya = oa.download(&oa.matmul(&oa.upload(&x2, &[m2, k2])?, &la2)?)?;
    let y192 = o192.download(&o192.matmul(&o192.upload(&x2, &[m2, k2])?, &l192)?)?;
    let name = "own192 + own LoRA A, in_proj-like r16/r32";
    as_close_as(rep, &format!("{name} M={m2}"), &ya, ("own192 with cuBLASLt's A side", &y192), &y2c);
    invariance(&oa, rep, name, &la2, &x2, k2, &ya)?;
    let (agu, ad) = (oa.linear(&gate_up)?, oa.linear(&down)?);
    let ym = oa.download(&oa.swiglu_mlp(&oa.upload(&x3, &[130, h])?, &agu, &ad)?)?;
    rep.check(p, "own192 + own LoRA A swiglu_mlp M=130 vs CPU f32", rel(&ym, &yc), 8e-2);
    rep.check(
        p,
        "own192 + own LoRA A swiglu_mlp: CPU error / cuBLASLt path's",
        rel(&ym, &yc) / rel(&yb, &yc).max(1e-12),
        1.2,
    );
    // Split (a unit per tile and 256-column K slice, then gemm_bf16_slices_sum) and whole (a unit
    // per tile, the slices' sums added in its accumulators) are the same arithmetic: the same bits,
    // so the form may follow M; and whole on 64-row tiles (gemm_bf16_64, one consumer, the default
    // past the split rows) or on the FP8 GEMM's 192-row tiles likewise.
    let forced = |split_rows: usize, whole_rows: Option<usize>| {
        variant(g, |o| {
            o.fp8_gemm = Fp8Gemm::Own192;
            o.lora_a_own = true;
            o.lora_a_split_rows = Some(split_rows);
            o.lora_a_whole_rows = whole_rows;
        })
    };
    let (split, whole, whole192) = (forced(usize::MAX, None)?, forced(0, None)?, forced(0, Some(192))?);
    let projected = |b: &CudaBackend| -> Result<Vec<f32>> {
        let y = b.download(&b.matmul(&b.upload(&x2, &[m2, k2])?, &b.linear(&parts)?)?)?;
        let mlp = b.download(&b.swiglu_mlp(
            &b.upload(&x3, &[130, h])?,
            &b.linear(&gate_up)?,
            &b.linear(&down)?,
        )?)?;
        Ok([y, mlp].concat())
    };
    let (ys, yw, yw192) = (projected(&split)?, projected(&whole)?, projected(&whole192)?);
    rep.check(
        p,
        format!("own LoRA A split vs whole (64-row tiles): in_proj-like r16/r32 M={m2} and swiglu_mlp (K 9216) M=130 (bitwise count)"),
        bit_diff(&ys, &yw) as f64,
        0.0,
    );
    rep.check(
        p,
        "own LoRA A whole on 64- vs 192-row tiles: the same (bitwise count)",
        bit_diff(&yw, &yw192) as f64,
        0.0,
    );
    let n2: usize = outs.iter().sum();
    rep.check(
        p,
        format!("own LoRA A split: in_proj-like M={m2} vs CPU f32"),
        rel(&ys[..m2 * n2], &y2c),
        8e-2,
    );
    Ok(())
}

/// An MLP's FP8 gate, up (`[k, h]`) and down (`[h, k]`) weights and a rank-`r` LoRA pair on each,
/// drawn from `rng` in that order (weights, then the pairs; std 0.02), applied with scale 2.
struct LoraMlp {
    gate: MemoryTensor,
    up: MemoryTensor,
    down: MemoryTensor,
    loras: [(MemoryTensor, MemoryTensor); 3],
}

impl LoraMlp {
    fn random(rng: &mut SplitMix, h: usize, k: usize, r: usize) -> Self {
        let w = |name: &str, o: usize, i: usize, rng: &mut SplitMix| {
            MemoryTensor::fp8(name, &[o, i], &rng.bf16_normals(o * i, 0.02))
        };
        let (gate, up, down) = (w("gate", k, h, rng), w("up", k, h, rng), w("down", h, k, rng));
        let loras = [
            lora_factors("gate", k, h, r, rng),
            lora_factors("up", k, h, r, rng),
            lora_factors("down", h, k, r, rng),
        ];
        LoraMlp { gate, up, down, loras }
    }
    fn gate_up(&self) -> [LinearPart<'_>; 2] {
        let [(ga, gb), (ua, ub), _] = &self.loras;
        [self.gate.lora_part(ga, gb, 2.0), self.up.lora_part(ua, ub, 2.0)]
    }
    fn down(&self) -> [LinearPart<'_>; 1] {
        let (da, db) = &self.loras[2];
        [self.down.lora_part(da, db, 2.0)]
    }
}

/// A rank-`r` LoRA pair of an `[o, i]` projection: A `[r, i]`, B `[o, r]`, BF16 of std 0.02.
fn lora_factors(
    name: &str,
    o: usize,
    i: usize,
    r: usize,
    rng: &mut SplitMix,
) -> (MemoryTensor, MemoryTensor) {
    (
        MemoryTensor::bf16(&format!("{name}.A"), &[r, i], &rng.bf16_normals(r * i, 0.02)),
        MemoryTensor::bf16(&format!("{name}.B"), &[o, r], &rng.bf16_normals(o * r, 0.02)),
    )
}

/// A projection `y` on another kernel path than `reference` (its label and output), both against
/// the CPU's f32 `cpu`: `y` within 8e-2 of the CPU, its CPU error at most 1.2x the reference's,
/// and within 3e-2 of the reference.
fn as_close_as(rep: &mut Report, name: &str, y: &[f32], (label, reference): (&str, &[f32]), cpu: &[f32]) {
    let p = "gemm";
    rep.check(p, format!("{name} vs CPU f32"), rel(y, cpu), 8e-2);
    rep.check(
        p,
        format!("{name}: CPU error / {label}'s ({:.3e})", rel(reference, cpu)),
        rel(y, cpu) / rel(reference, cpu).max(1e-12),
        1.2,
    );
    rep.check(p, format!("{name} vs {label} (max)"), rel(y, reference), 3e-2);
}

/// Weights of a fused projection's parts of `outs` rows each: the first `fp8` parts block-FP8, the
/// rest BF16 (a GDN in_proj: FP8 q/k/v/z, BF16 b/a).
fn in_proj_parts(rng: &mut SplitMix, outs: &[usize], k: usize, fp8: usize) -> Vec<MemoryTensor> {
    outs.iter()
        .enumerate()
        .map(|(i, &o)| {
            let v = rng.bf16_normals(o * k, 0.02);
            if i < fp8 {
                MemoryTensor::fp8(&format!("in{i}.weight"), &[o, k], &v)
            } else {
                MemoryTensor::bf16(&format!("in{i}.weight"), &[o, k], &v)
            }
        })
        .collect()
}

/// An FP8 weight `[n, k]` whose magnitudes vary per 128 x 128 block and a BF16 input `[m, k]`
/// whose magnitudes vary per (row, 128-block), so every scale matters.
fn varied_fp8_case(rng: &mut SplitMix, n: usize, k: usize, m: usize) -> (MemoryTensor, Vec<f32>) {
    let wv: Vec<f32> = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            rng.gaussian() * 0.05 * 2f32.powi((((r / 128) * 5 + (c / 128) * 3) % 9) as i32 - 4)
        })
        .collect();
    let x = (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            half::bf16::from_f32(rng.gaussian() * 2f32.powi(((r * 7 + (c / 128) * 3) % 9) as i32 - 4))
                .to_f32()
        })
        .collect();
    (MemoryTensor::fp8("fp8.weight", &[n, k], &wv), x)
}

/// The f32 values of a block-FP8 weight `[n, k]` (its codes times its 128 x 128 scales).
fn dequantised(w8: &MemoryTensor, n: usize, k: usize) -> Result<Vec<f32>> {
    let (shape, scales) = w8.scale.as_ref().expect("an FP8 tensor has scales");
    dequantize_fp8_blocks(&w8.bytes, &[n, k], scales, shape, Some([128, 128]))
}
