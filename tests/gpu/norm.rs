//! Row norms (kernels/norm.cu) against the CPU, and the norms that write the FP8 quantisation of
//! their output (`*_quant`) bitwise against the norm followed by `quant_act_1x128`.

use super::deltanet::{delta_pair, DELTANET_4B, DELTANET_SMALL_VALUE_DIM};
use super::harness::{bit_diff, rel, variant, Report};
use anyhow::{ensure, Result};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::{CudaBackend, CudaLinear, CudaTensor};
use imajev_serve::backend::{Backend, Gelu};
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;
use imajev_serve::weights::fp8::quantize_act_1x128;

/// RMSNorm, LayerNorm and the residual add fused with RMSNorm against the CPU.
pub fn row_norms(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "norm";
    let (m, d) = (300, 2560);
    let x = rng.bf16_normals(m * d, 2.0);
    let w = MemoryTensor::f32("norm", &[d], &rng.bf16_normals(d, 0.2));
    let (xg, xc) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
    let (wg, wc) = (g.param(&w.r())?, c.param(&w.r())?);
    let e = rel(&g.download(&g.rms_norm(&xg, &wg, 1e-6, 1.0)?)?, &c.rms_norm(&xc, &wc, 1e-6, 1.0)?.data);
    rep.check(p, "rms_norm [300, 2560] offset 1", e, 1e-2);
    let (d2, m2) = (1024, 420);
    let x2 = rng.bf16_normals(m2 * d2, 3.0);
    let (lw, lb) = (
        MemoryTensor::f32("lw", &[d2], &rng.bf16_normals(d2, 1.0)),
        MemoryTensor::f32("lb", &[d2], &rng.bf16_normals(d2, 0.5)),
    );
    let (x2g, x2c) = (g.upload(&x2, &[m2, d2])?, c.upload(&x2, &[m2, d2])?);
    let e = rel(
        &g.download(&g.layer_norm(&x2g, &g.param(&lw.r())?, &g.param(&lb.r())?, 1e-6)?)?,
        &c.layer_norm(&x2c, &c.param(&lw.r())?, &c.param(&lb.r())?, 1e-6)?.data,
    );
    rep.check(p, "layer_norm [420, 1024]", e, 1e-2);
    // Residual add fused with the next LayerNorm (the vision blocks) against the CPU's add + norm,
    // the updated x too.
    let y2 = rng.bf16_normals(m2 * d2, 1.0);
    let (mut xg2, mut xc2) = (g.upload(&x2, &[m2, d2])?, c.upload(&x2, &[m2, d2])?);
    let hg =
        g.add_layer_norm(&mut xg2, &g.upload(&y2, &[m2, d2])?, &g.param(&lw.r())?, &g.param(&lb.r())?, 1e-6)?;
    let hc =
        c.add_layer_norm(&mut xc2, &c.upload(&y2, &[m2, d2])?, &c.param(&lw.r())?, &c.param(&lb.r())?, 1e-6)?;
    rep.check(p, "add_layer_norm [420, 1024]: norm vs CPU", rel(&g.download(&hg)?, &hc.data), 1e-2);
    rep.check(p, "add_layer_norm [420, 1024]: updated x vs CPU", rel(&g.download(&xg2)?, &xc2.data), 1e-2);
    // Residual add fused with the next RMSNorm: vs the CPU add + norm, and bitwise vs the
    // GPU's own add_assign + rms_norm (same rounding, same reduction order).
    for (rows, d, off) in [(300usize, 2560usize, 1.0f32), (37, 1000, 0.0)] {
        let x = rng.bf16_normals(rows * d, 2.0);
        let y = rng.bf16_normals(rows * d, 1.0);
        let w = MemoryTensor::f32("norm", &[d], &rng.bf16_normals(d, 0.2));
        let (wg, wc) = (g.param(&w.r())?, c.param(&w.r())?);
        let (yg, yc) = (g.upload(&y, &[rows, d])?, c.upload(&y, &[rows, d])?);
        let (mut fg, mut ug, mut xc) =
            (g.upload(&x, &[rows, d])?, g.upload(&x, &[rows, d])?, c.upload(&x, &[rows, d])?);
        let hg = g.download(&g.add_rms_norm(&mut fg, &yg, &wg, 1e-6, off)?)?;
        c.add_assign(&mut xc, &yc)?;
        let hc = c.rms_norm(&xc, &wc, 1e-6, off)?.data;
        g.add_assign(&mut ug, &yg)?;
        let hu = g.download(&g.rms_norm(&ug, &wg, 1e-6, off)?)?;
        let xf = g.download(&fg)?;
        rep.check(p, format!("add_rms_norm [{rows}, {d}] offset {off}: norm vs CPU"), rel(&hg, &hc), 1e-2);
        rep.check(p, format!("add_rms_norm [{rows}, {d}]: updated x vs CPU"), rel(&xf, &xc.data), 1e-2);
        rep.check(
            p,
            format!("add_rms_norm [{rows}, {d}]: norm, x vs GPU add_assign + rms_norm (bitwise)"),
            rel(&hg, &hu).max(rel(&xf, &g.download(&ug)?)),
            0.0,
        );
    }
    Ok(())
}

/// Fused norm output `fused` (on `g`, which must have attached its FP8 quantisation) against the
/// unfused output `plain` (on `u`, quantised by quant_act_1x128): the bf16 bits, the FP8 codes and
/// the scales (padding rows included) must all be identical; the codes and scales also against
/// the CPU twin `quantize_act_1x128` of the downloaded output (the tolerance of the
/// quant_act_1x128 check in `gemm_checks`).
pub fn same_norm_quant(
    g: &CudaBackend,
    u: &CudaBackend,
    rep: &mut Report,
    name: &str,
    fused: &CudaTensor,
    plain: &CudaTensor,
) -> Result<()> {
    let p = "norm";
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
        rep.info(
            p,
            format!("{name}: … mismatches"),
            f64::NAN,
            format!("bf16 {dy}, codes {codes}, scales {ds}"),
        );
    }
    let (m, k) = fused.rows_cols();
    let (qh, sh) = quantize_act_1x128(&yf, m, k);
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
pub fn fused_norm_quant(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = "norm";
    // The reference: the same options with the fusion switched off.
    let u = variant(g, |o| o.unfused_act_quant = true)?;
    // FP8 projections on both: this is what turns the fusion on in g. `mixed` has an FP8 group,
    // a BF16 group and a LoRA (the BF16 paths read the bf16 rows, the FP8 one the attachment).
    let d = 2560;
    let w8 = MemoryTensor::fp8("proj.weight", &[256, d], &rng.bf16_normals(256 * d, 0.02));
    let wb = MemoryTensor::bf16("proj_b.weight", &[32, d], &rng.bf16_normals(32 * d, 0.02));
    let la = MemoryTensor::bf16("proj.A", &[8, d], &rng.bf16_normals(8 * d, 0.05));
    let lb = MemoryTensor::bf16("proj.B", &[256, 8], &rng.bf16_normals(256 * 8, 0.05));
    let mixed = [w8.lora_part(&la, &lb, 2.0), wb.part()];
    let (lg, lgm) = (g.linear(&[w8.part()])?, g.linear(&mixed)?);
    let _ = u.linear(&[w8.part()])?;
    ensure!(
        lgm.summary() == "fp8[0..256] bf16[256..288] lora×1",
        "mixed projection placed as {}",
        lgm.summary()
    );
    // Inputs whose magnitude varies per (row, 128-block), so the scales differ; in some cases a
    // zero row (scale 1 from amax 0) and a zeroed column block (w = −offset).
    let input = |rng: &mut SplitMix, m: usize, d: usize| -> Vec<f32> {
        (0..m * d)
            .map(|i| {
                let (r, c) = (i / d, i % d);
                half::bf16::from_f32(rng.gaussian() * 2f32.powi(((r * 5 + (c / 128) * 3) % 7) as i32 - 3))
                    .to_f32()
            })
            .collect()
    };
    // A matmul on the fused output (attachment) vs on a copy without it (quant_act_1x128).
    let gemm_same = |rep: &mut Report, name: &str, t: &CudaTensor, l: &CudaLinear, m: usize| -> Result<()> {
        let copy = g.gather_rows(t, &(0..m).collect::<Vec<_>>())?;
        ensure!(!copy.has_fp8_activations(), "gather_rows copied an attachment");
        let (a, b) = (g.download(&g.matmul(t, l)?)?, g.download(&g.matmul(&copy, l)?)?);
        rep.check(
            p,
            format!("{name}: matmul on it ≠ on a copy without (bitwise count)"),
            bit_diff(&a, &b) as f64,
            0.0,
        );
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
        let mut wv = rng.bf16_normals(d, 0.2);
        if zeros {
            x[(m / 2) * d..(m / 2 + 1) * d].fill(0.0);
            wv[..128].fill(-off);
        }
        let y = input(rng, m, d);
        let w = MemoryTensor::f32("norm", &[d], &wv);
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
        // LayerNorm (the vision tower's norms), plain and with the residual add, the same way.
        let bias = MemoryTensor::f32("norm.bias", &[d], &rng.bf16_normals(d, 0.1));
        let (bg, bu) = (g.param(&bias.r())?, u.param(&bias.r())?);
        let name = format!("layer_norm_quant [{m}, {d}]");
        let hg = g.layer_norm(&g.upload(&x, &[m, d])?, &wg, &bg, 1e-6)?;
        let hu = u.layer_norm(&u.upload(&x, &[m, d])?, &wu, &bu, 1e-6)?;
        same_norm_quant(g, &u, rep, &name, &hg, &hu)?;
        if d == 2560 {
            gemm_same(rep, &format!("{name} → fp8"), &hg, &lg, m)?;
        }
        let name = format!("add_layer_norm_quant [{m}, {d}]");
        let (mut xg, mut xu, mut xf) =
            (g.upload(&x, &[m, d])?, u.upload(&x, &[m, d])?, u.upload(&x, &[m, d])?);
        let hg = g.add_layer_norm(&mut xg, &g.upload(&y, &[m, d])?, &wg, &bg, 1e-6)?;
        // The reference is the unfused pair; u's own add_layer_norm (the fused kernel without the
        // quantisation) must equal it too.
        u.add_assign(&mut xu, &u.upload(&y, &[m, d])?)?;
        let hu = u.layer_norm(&xu, &wu, &bu, 1e-6)?;
        let hf = u.add_layer_norm(&mut xf, &u.upload(&y, &[m, d])?, &wu, &bu, 1e-6)?;
        same_norm_quant(g, &u, rep, &name, &hg, &hu)?;
        let (xg, xu, xf, hu, hf) =
            (g.download(&xg)?, u.download(&xu)?, u.download(&xf)?, u.download(&hu)?, u.download(&hf)?);
        rep.check(
            p,
            format!("{name}: updated x ≠ add_assign's; add_layer_norm without quantisation ≠ add + norm (bitwise count)"),
            (bit_diff(&xg, &xu) + bit_diff(&xf, &xu) + bit_diff(&hf, &hu)) as f64,
            0.0,
        );
    }
    // GELU fused with the FP8 quantisation of the next projection (gelu_quant_1x128: the vision
    // MLPs' fc2 and the merger's) against gelu, then the projection quantising on its own: the
    // GELU output and the projection's output bitwise.
    let k = 4096;
    let wf = MemoryTensor::fp8("fc2.weight", &[256, k], &rng.bf16_normals(256 * k, 0.02));
    let (lfg, lfu) = (g.linear(&[wf.part()])?, u.linear(&[wf.part()])?);
    for (m, kind) in [(1usize, Gelu::Tanh), (16, Gelu::Erf), (37, Gelu::Tanh), (300, Gelu::Erf)] {
        let x = input(rng, m, k);
        let (mut tg, mut tu) = (g.upload(&x, &[m, k])?, u.upload(&x, &[m, k])?);
        let yg = g.gelu_matmul(&mut tg, kind, &lfg)?;
        u.gelu(&mut tu, kind)?;
        let yu = u.matmul(&tu, &lfu)?;
        let (dg, dy) =
            (bit_diff(&g.download(&tg)?, &u.download(&tu)?), bit_diff(&g.download(&yg)?, &u.download(&yu)?));
        rep.check(
            p,
            format!("gelu_quant_1x128 [{m}, {k}] {kind:?} → fp8: gelu output, projection ≠ unfused (bitwise count)"),
            (dg + dy) as f64,
            0.0,
        );
    }
    // Widths that are not whole 128-blocks, and norms over part of a row, attach nothing.
    let x = rng.bf16_normals(7 * 1000, 1.0);
    let w = MemoryTensor::f32("norm", &[1000], &rng.bf16_normals(1000, 0.2));
    let h = g.rms_norm(&g.upload(&x, &[7, 1000])?, &g.param(&w.r())?, 1e-6, 1.0)?;
    let x2 = rng.bf16_normals(3 * 512, 1.0);
    let w2 = MemoryTensor::f32("norm", &[128], &rng.bf16_normals(128, 0.2));
    let h2 = g.rms_norm(&g.upload(&x2, &[3, 512])?, &g.param(&w2.r())?, 1e-6, 1.0)?;
    rep.flag(
        p,
        "rms_norm: no FP8 attachment for d = 1000, nor for 128-wide norms of 512-wide rows",
        !h.has_fp8_activations() && !h2.has_fp8_activations(),
        "",
    );

    // Every in-place change drops the attachment; a matmul afterwards quantises the new contents.
    let (m, d) = (37, 2560);
    let w = MemoryTensor::f32("norm", &[d], &rng.bf16_normals(d, 0.2));
    let wg = g.param(&w.r())?;
    let fresh = |rng: &mut SplitMix| -> Result<_> {
        g.rms_norm(&g.upload(&input(rng, m, d), &[m, d])?, &wg, 1e-6, 1.0)
    };
    let other = g.upload(&rng.bf16_normals(m * d, 1.0), &[m, d])?;
    let mut t = fresh(rng)?;
    let attached = t.has_fp8_activations();
    g.add_assign(&mut t, &other)?;
    let mut dropped = vec![("add_assign", !t.has_fp8_activations())];
    gemm_same(rep, "after add_assign on a fused norm output", &t, &lg, m)?;
    let mut t = fresh(rng)?;
    g.scatter_rows(&mut t, &[3, 30], &g.upload(&rng.bf16_normals(2 * d, 1.0), &[2, d])?)?;
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
    let d4b = DELTANET_4B;
    let wo = MemoryTensor::fp8("out_proj.weight", &[256, 4096], &rng.bf16_normals(256 * 4096, 0.02));
    let lo = g.linear(&[wo.part()])?;
    for lens in [&[1usize][..], &[16], &[37], &[70, 1, 130]] {
        let (og, ou) = delta_pair(g, &u, rng, d4b, lens, true)?;
        let n: usize = lens.iter().sum();
        let name = format!("rms_norm_gated_quant 4B lens {lens:?}");
        same_norm_quant(g, &u, rep, &name, &og, &ou)?;
        gemm_same(rep, &format!("{name} → out_proj fp8"), &og, &lo, n)?;
    }
    // value_dim ≠ 128: the plain kernel, no attachment, same output.
    let alt = DELTANET_SMALL_VALUE_DIM;
    let (og, ou) = delta_pair(g, &u, rng, alt, &[20, 3], false)?;
    rep.flag(p, "gated_delta_net value_dim 24: no FP8 attachment", !og.has_fp8_activations(), "");
    rep.check(
        p,
        "gated_delta_net value_dim 24: output ≠ unfused backend (bitwise count)",
        bit_diff(&g.download(&og)?, &u.download(&ou)?) as f64,
        0.0,
    );
    Ok(())
}
