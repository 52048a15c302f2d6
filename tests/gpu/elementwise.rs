//! Data movement and elementwise ops (kernels/elementwise.cu) against the CPU: embeddings, row
//! gathers and scatters, column splits, concatenation (all exact), image patch rows (bitwise the
//! host's f32 rows rounded to BF16), residual adds, SwiGLU, GELU; and the copies that run behind
//! queued work (src/backend/cuda/staging.rs, readback.rs): uploads through the pinned ring over
//! several turns, readouts left in flight and collected out of order.

use super::harness::{rel, Report};
use anyhow::Result;
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::CudaBackend;
use imajev_serve::backend::{Backend, Gelu, LinearPart, PatchGeometry, RgbImage};
use imajev_serve::image::patchify;
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;

const P: &str = "elem";

pub fn data_movement(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = P;
    let (v, d) = (4096, 2560);
    let table = MemoryTensor::bf16("embed", &[v, d], &rng.bf16_normals(v * d, 1.0));
    let (tg, tc) = (g.param(&table.r())?, c.param(&table.r())?);
    let ids: Vec<u32> = (0..300).map(|_| rng.below(v) as u32).collect();
    rep.check(
        p,
        "embed 300 ids of [4096, 2560]",
        rel(&g.download(&g.embed(&tg, &ids)?)?, &c.embed(&tc, &ids)?.data),
        0.0,
    );
    let pos = MemoryTensor::bf16("pos", &[2304, 1024], &rng.bf16_normals(2304 * 1024, 1.0));
    let (pg, pc) = (g.param(&pos.r())?, c.param(&pos.r())?);
    let idx: Vec<u32> = (0..4 * 256).map(|_| rng.below(2304) as u32).collect();
    let w: Vec<f32> = (0..4 * 256).map(|_| rng.uniform()).collect();
    let e = rel(&g.download(&g.embed_bag(&pg, &idx, &w, 4)?)?, &c.embed_bag(&pc, &idx, &w, 4)?.data);
    rep.check(p, "embed_bag 256×4 taps of [2304, 1024]", e, 1e-2);
    let (n, d) = (37, 12352);
    let x = rng.bf16_normals(n * d, 1.0);
    let (xg, xc) = (g.upload(&x, &[n, d])?, c.upload(&x, &[n, d])?);
    let widths = [8192, 4096, 32, 32];
    let (sg, sc) = (g.split_cols(&xg, &widths)?, c.split_cols(&xc, &widths)?);
    let mut worst = 0f64;
    for (a, b) in sg.iter().zip(&sc) {
        worst = worst.max(rel(&g.download(a)?, &b.data));
    }
    rep.check(p, "split_cols [37, 12352] → 8192|4096|32|32", worst, 0.0);
    let rows = [36usize, 0, 5, 5, 17];
    let e = rel(&g.download(&g.gather_rows(&sg[2], &rows)?)?, &c.gather_rows(&sc[2], &rows)?.data);
    rep.check(p, "gather_rows 5 of [37, 32]", e, 0.0);
    let src = rng.bf16_normals(3 * 4096, 1.0);
    let (mut dg, mut dc) = (
        g.gather_rows(&sg[1], &(0..37).collect::<Vec<_>>())?,
        c.gather_rows(&sc[1], &(0..37).collect::<Vec<_>>())?,
    );
    g.scatter_rows(&mut dg, &[3, 30, 11], &g.upload(&src, &[3, 4096])?)?;
    c.scatter_rows(&mut dc, &[3, 30, 11], &c.upload(&src, &[3, 4096])?)?;
    rep.check(p, "scatter_rows 3 into [37, 4096]", rel(&g.download(&dg)?, &dc.data), 0.0);
    let e = rel(
        &g.download(&g.concat_rows(&[
            &sg[0],
            &g.upload(&SplitMix::new(3).bf16_normals(5 * 8192, 1.0), &[5, 8192])?,
        ])?)?,
        &c.concat_rows(&[&sc[0], &c.upload(&SplitMix::new(3).bf16_normals(5 * 8192, 1.0), &[5, 8192])?])?
            .data,
    );
    rep.check(p, "concat_rows [37, 8192] + [5, 8192]", e, 0.0);
    Ok(())
}

pub fn activations(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = P;
    let (m, d) = (300, 2560);
    let x = rng.bf16_normals(m * d, 2.0);
    let y = rng.bf16_normals(m * d, 1.0);
    let (mut ag, mut ac) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
    g.add_assign(&mut ag, &g.upload(&y, &[m, d])?)?;
    c.add_assign(&mut ac, &c.upload(&y, &[m, d])?)?;
    rep.check(p, "add_assign [300, 2560]", rel(&g.download(&ag)?, &ac.data), 1e-2);
    let gu = rng.bf16_normals(64 * 2 * 9216, 2.0);
    let e = rel(
        &g.download(&g.swiglu(&g.upload(&gu, &[64, 2 * 9216])?)?)?,
        &c.swiglu(&c.upload(&gu, &[64, 2 * 9216])?)?.data,
    );
    rep.check(p, "swiglu [64, 2×9216]", e, 1e-2);
    for (kind, name) in [(Gelu::Tanh, "gelu tanh [300, 2560]"), (Gelu::Erf, "gelu erf [300, 2560]")] {
        let (mut hg, mut hc) = (g.upload(&x, &[m, d])?, c.upload(&x, &[m, d])?);
        g.gelu(&mut hg, kind)?;
        c.gelu(&mut hc, kind)?;
        rep.check(p, name, rel(&g.download(&hg)?, &hc.data), 1e-2);
    }
    Ok(())
}

/// `image_patches` against the host's rows (`patchify`, what the CPU backend uploads) rounded to
/// BF16 once, as `cast_f32_bf16` rounded them before: two images of different sizes in one call
/// (the second starts mid-buffer), one of them a whole 4096² photo, and a table with a distinct
/// value per channel and level.
pub fn image_patch_rows(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let geometry = PatchGeometry { patch: 16, temporal: 2, merge: 2 };
    let mut lut = [[0f32; 256]; 3];
    for (c, t) in lut.iter_mut().enumerate() {
        for (v, x) in t.iter_mut().enumerate() {
            *x = (v as f32 - 127.5) / (127.5 + c as f32) + rng.uniform() * 1e-3;
        }
    }
    let sizes = [(96usize, 64usize), (4096, 4096)];
    let pixels: Vec<Vec<u8>> =
        sizes.iter().map(|&(w, h)| (0..w * h * 3).map(|_| rng.below(256) as u8).collect()).collect();
    let images: Vec<RgbImage<'_>> = sizes
        .iter()
        .zip(&pixels)
        .map(|(&(width, height), rgb)| RgbImage { rgb, width, height, lut: &lut })
        .collect();
    let mut want = Vec::new();
    for im in &images {
        let mut rows = vec![0f32; (im.width / 16) * (im.height / 16) * geometry.row_len()];
        patchify(im.rgb, im.width, im.lut, geometry, &mut rows);
        want.extend(rows.iter().map(|&v| half::bf16::from_f32(v).to_f32()));
    }
    let got = g.download(&g.image_patches(&images, geometry)?)?;
    let differ = if got.len() == want.len() {
        got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count() as f64
    } else {
        f64::INFINITY
    };
    rep.check(P, "image_patches 96×64 + 4096² (values that differ from the host rows in BF16)", differ, 0.0);
    Ok(())
}

/// Uploads through the staging ring while the device is kept busy, so that the ring turns over
/// (several times its 32 MiB) with copies still queued: every tensor must arrive as sent. Then
/// readouts queued behind device work and collected in another order than queued, more of them
/// at once than the pinned pool keeps: each must equal the same readout waited for at once.
pub fn queued_copies(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let p = P;
    // ~30 ms of GEMMs queued ahead of the copies (the host fills the ring far faster).
    let (m, k) = (4096, 4096);
    let w = MemoryTensor::bf16("busy", &[k, k], &rng.bf16_normals(k * k, 0.02));
    let lin = g.linear(&[LinearPart { weight: w.r(), bias: None, lora: None }])?;
    let x = g.upload(&rng.bf16_normals(m * k, 1.0), &[m, k])?;
    let busy = |g: &CudaBackend| -> Result<()> {
        for _ in 0..200 {
            g.matmul(&x, &lin)?;
        }
        Ok(())
    };
    busy(g)?;
    // 48 tensors of 1.5 MiB (f32: staged, one quarter holds five): 72 MiB, over two turns.
    let sent: Vec<Vec<f32>> =
        (0..48).map(|i| (0..384 * 1024).map(|j| (i * 1_000_003 + j) as f32).collect()).collect();
    let uploaded: Vec<_> = sent.iter().map(|v| g.upload(v, &[384, 1024])).collect::<Result<_>>()?;
    let mut worst = 0f64;
    for (t, v) in uploaded.iter().zip(&sent) {
        worst = worst.max(rel(&g.download(t)?, v));
    }
    rep.check(p, "48 uploads of 1.5 MiB through the staging ring behind queued GEMMs", worst, 0.0);

    let d = 2560;
    let head = MemoryTensor::f32("readout", &[12, d], &rng.bf16_normals(12 * d, 0.05));
    let head = g.param_f32(&head.r())?;
    let hidden: Vec<Vec<f32>> = (0..6).map(|i| rng.bf16_normals((3 + i) * d, 1.0)).collect();
    let want: Vec<Vec<f32>> =
        hidden.iter().map(|h| g.readout(&g.upload(h, &[h.len() / d, d])?, &head)).collect::<Result<_>>()?;
    let mut pending = Vec::new();
    for h in &hidden {
        busy(g)?;
        pending.push(g.readout_start(&g.upload(h, &[h.len() / d, d])?, &head)?);
    }
    // Out of order: the last first, then the rest from the front.
    let last = pending.pop().expect("six readouts");
    let mut got = vec![g.readout_finish(last)?];
    for r in pending {
        got.push(g.readout_finish(r)?);
    }
    got.rotate_left(1);
    let bitwise = got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    rep.flag(
        p,
        "6 readouts in flight behind GEMMs, collected out of order",
        bitwise,
        "bitwise vs waited at once",
    );
    Ok(())
}
