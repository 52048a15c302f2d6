//! Attention (kernels/attention.cu) against the CPU: gated GQA attention over caches that continue
//! across calls and fork through shared prefixes (also inside one call: a parent and its
//! children), every GQA head of a group, and the vision tower's bidirectional attention.

use super::harness::{bit_diff, cat_cols, rel, tiling, tree_note, variant, Report};
use anyhow::Result;
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::{AttentionKernel, CudaBackend};
use imajev_serve::backend::{AttentionDims, AttentionInputs, Backend};
use imajev_serve::engine::positions;
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;

/// The cases: Qwen3.5-4B shapes, a tree call, the tiny and an odd-headed model, vision.
pub fn cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let d4b = AttentionDims { heads: 16, kv_heads: 4, head_dim: 256, rotary_dim: 64, norm_eps: 1e-6 };
    attention_case(g, c, rep, rng, "4B", d4b, &[&[70, 1, 133], &[5, 64, 1], &[2, 3, 100]], &[])?;
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
    // The lengths around the 64- and 128-row tiles and the 32/64-key tiles, a long one, then every
    // cache continues; a 2-token parent with two children; one 16K-token sequence. The same with
    // the 64-row kernel (the reference the 128-row one replaced).
    let lengths: &[&[usize]] = &[&[1, 63, 64, 65, 127, 4097], &[3, 70, 1, 128, 2, 5]];
    attention_case(g, c, rep, rng, "4B", d4b, lengths, &[])?;
    attention_case(g, c, rep, rng, "4B", d4b, &[&[2, 5, 70], &[1, 1, 1]], &[None, Some(0), Some(0)])?;
    attention_case(g, c, rep, rng, "4B", d4b, &[&[16384], &[73]], &[])?;
    // Passes over long caches split their keys into 4096-key ranges (in the second call here:
    // 2 ranges each), also beside their 9000-row parent in one call (3 ranges).
    attention_case(g, c, rep, rng, "4B", d4b, &[&[4097, 4200, 5000], &[73, 1, 128]], &[])?;
    let tree = [None, Some(0), Some(0), Some(0)];
    attention_case(g, c, rep, rng, "4B", d4b, &[&[9000, 73, 128, 1], &[1, 2, 3, 4]], &tree)?;
    let q64 = variant(g, |o| o.attention = AttentionKernel::Rows64)?;
    attention_case(&q64, c, rep, rng, "4B, 64-row kernel", d4b, lengths, &[])?;
    // The default is the wgmma kernel on Hopper: the 128-row mma.sync kernel explicitly too.
    let q128 = variant(g, |o| o.attention = AttentionKernel::Rows128)?;
    attention_case(&q128, c, rep, rng, "4B, 128-row kernel", d4b, lengths, &[])?;
    attention_case(
        &q128,
        c,
        rep,
        rng,
        "4B, 128-row kernel",
        d4b,
        &[&[100, 37, 1, 64, 70], &[3, 1, 5, 2, 9]],
        &[None, Some(0), Some(0), None, Some(3)],
    )?;
    vision_case(&q128, c, rep, rng, 16, 64, &[1, 127, 4097])?;
    let tiny = AttentionDims { heads: 4, kv_heads: 2, head_dim: 32, rotary_dim: 16, norm_eps: 1e-6 };
    attention_case(g, c, rep, rng, "tiny", tiny, &[&[37, 100], &[3, 1]], &[])?;
    let alt = AttentionDims { heads: 3, kv_heads: 1, head_dim: 64, rotary_dim: 16, norm_eps: 1e-6 };
    attention_case(g, c, rep, rng, "alt", alt, &[&[50], &[20]], &[])?;
    vision_case(g, c, rep, rng, 16, 64, &[100, 64, 256])?;
    vision_case(g, c, rep, rng, 16, 64, &[1, 127, 4097])?;
    vision_case(&q64, c, rep, rng, 16, 64, &[100, 64, 256])?;
    vision_case(g, c, rep, rng, 2, 16, &[16, 64])?;
    Ok(())
}

/// The attention cases of Qwen3.5-4B shapes and the vision tower on a Hopper kernel (`Wgmma`, the
/// default on Hopper, so `cases` runs it as well, or `WarpSpecialized`; this keeps their checks
/// together). Lengths cross the key tiles (64 and 128) and the ring stages (2 and 3) of both.
pub fn hopper_cases(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    kernel: AttentionKernel,
) -> Result<()> {
    let label = match kernel {
        AttentionKernel::WarpSpecialized => "4B ws",
        AttentionKernel::WarpSpecialized3 => "4B ws3",
        AttentionKernel::Overlap => "4B ov",
        AttentionKernel::WgmmaK128 => "4B wgmma-k128",
        AttentionKernel::WgmmaGrouped => "4B wgmma-grouped",
        AttentionKernel::WgmmaGrouped3 => "4B wgmma-grouped3",
        AttentionKernel::WgmmaTensorSums => "4B wgmma-tsum",
        _ => "4B wgmma",
    };
    if !g.info().hopper() {
        rep.flag(
            "attn",
            format!("{label} attention: not a Hopper GPU, never launched, not checked"),
            true,
            "",
        );
        return Ok(());
    }
    let w = variant(g, |o| o.attention = kernel)?;
    let d4b = AttentionDims { heads: 16, kv_heads: 4, head_dim: 256, rotary_dim: 64, norm_eps: 1e-6 };
    attention_case(&w, c, rep, rng, label, d4b, &[&[70, 1, 133], &[5, 64, 1]], &[])?;
    attention_case(&w, c, rep, rng, label, d4b, &[&[1, 63, 64, 65, 127, 4097], &[3, 70, 1, 128, 2, 5]], &[])?;
    attention_case(
        &w,
        c,
        rep,
        rng,
        label,
        d4b,
        &[&[100, 37, 1, 64, 70], &[3, 1, 5, 2, 9]],
        &[None, Some(0), Some(0), None, Some(3)],
    )?;
    attention_case(&w, c, rep, rng, label, d4b, &[&[16384], &[73]], &[])?;
    vision_case(&w, c, rep, rng, 16, 64, &[100, 64, 256])?;
    vision_case(&w, c, rep, rng, 16, 64, &[1, 127, 4097])?;
    vision_case(&w, c, rep, rng, 16, 64, &[128, 129, 385, 640, 1000])?;
    if kernel == AttentionKernel::WarpSpecialized3 {
        // Around its 192-row query tiles.
        vision_case(&w, c, rep, rng, 16, 64, &[191, 192, 193, 383, 384, 577])?;
    }
    Ok(())
}

pub fn section(h: usize) -> [usize; 3] {
    [h.div_ceil(3), (h + 1) / 3, h / 3]
}

#[allow(clippy::too_many_arguments)]
pub fn attention_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    name: &str,
    dims: AttentionDims,
    calls: &[&[usize]],
    tree: &[Option<usize>],
) -> Result<()> {
    let AttentionDims { heads, kv_heads: kvh, head_dim: hd, rotary_dim: rot, .. } = dims;
    let nseq = calls[0].len();
    let mut gc = (0..nseq).map(|_| g.new_kv_cache(&dims)).collect::<Result<Vec<_>>>()?;
    let mut cc = (0..nseq).map(|_| c.new_kv_cache(&dims)).collect::<Result<Vec<_>>>()?;
    let mut pos0 = vec![0i64; nseq];
    let qn = MemoryTensor::f32("q_norm", &[hd], &rng.bf16_normals(hd, 0.1));
    let kn = MemoryTensor::f32("k_norm", &[hd], &rng.bf16_normals(hd, 0.1));
    for (ci, lens) in calls.iter().enumerate() {
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        // The first call may run a tree (children continue their parent within the call).
        let parents = if ci == 0 { tree } else { &[] };
        let qg = rng.bf16_normals(n * heads * 2 * hd, 1.0);
        let k = rng.bf16_normals(n * kvh * hd, 1.0);
        let v = rng.bf16_normals(n * kvh * hd, 1.0);
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
            ($b:expr, $caches:expr) => {
                run!($b, $caches, gated_attention)
            };
            ($b:expr, $caches:expr, $op:ident) => {{
                let b = $b;
                let t = (
                    b.upload(&qkv, &[n, qkv_w])?,
                    b.param(&qn.r())?,
                    b.param(&kn.r())?,
                    b.upload(&cos, &[n, rot])?,
                    b.upload(&sin, &[n, rot])?,
                );
                let inputs = AttentionInputs { qkv: &t.0, q_norm: &t.1, k_norm: &t.2, cos: &t.3, sin: &t.4 };
                let mut refs: Vec<_> = $caches.iter_mut().collect();
                let o = b.$op(&inputs, &dims, &segs, parents, &mut refs)?;
                b.download(&o)?
            }};
        }
        // The same call attending only each segment's last row (the model's last layer), on
        // copies of the caches: equal to those rows of the full call — bitwise unless the row's
        // keys split into ranges (more than 4096 of them), then to the tolerance.
        let mut gc_last = gc.clone();
        let ol = run!(g, gc_last, gated_attention_last_rows);
        let og = run!(g, gc);
        let w = heads * hd;
        let (mut bits, mut worst) = (0usize, 0f64);
        for (si, seg) in segs.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            let (full, last) = (&og[(seg.end - 1) * w..seg.end * w], &ol[si * w..(si + 1) * w]);
            if g.kv_len(&gc[si]) <= 4096 {
                bits += full.iter().zip(last).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            }
            worst = worst.max(rel(last, full));
        }
        rep.check(
            "attn",
            format!("… last rows only, call {ci}: short rows ≠ full call (bitwise count)"),
            bits as f64,
            0.0,
        );
        rep.check("attn", format!("… last rows only, call {ci}: vs full call"), worst, 2e-2);
        let oc = run!(c, cc);
        let lens_ok = gc.iter().zip(&cc).all(|(a, b)| g.kv_len(a) == c.kv_len(b));
        rep.check(
            "attn",
            format!(
                "gated_attention {name} h{heads}/{kvh} d{hd} rot{rot} call {ci} lens {lens:?}{}",
                tree_note(parents)
            ),
            rel(&og, &oc),
            2e-2,
        );
        if !lens_ok {
            rep.flag(
                "attn",
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

pub fn vision_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    heads: usize,
    hd: usize,
    lens: &[usize],
) -> Result<()> {
    let n: usize = lens.iter().sum();
    let segs = tiling(lens);
    let qkv = rng.bf16_normals(n * 3 * heads * hd, 1.0);
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
    rep.check("attn", format!("vision_attention h{heads} d{hd} segments {lens:?}"), rel(&og, &oc), 2e-2);
    Ok(())
}

/// Two Hopper attention kernels that must compute the same bits (one reorders the other's issue
/// only): the 4B text attention (head dim 256, causal, a tree of forks over a shared prefix and a
/// 16K sequence) and the vision attention (head dim 64, ragged segments and one of 16K patches),
/// each once per kernel on the same inputs, compared bit for bit.
pub fn same_bits(
    g: &CudaBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    a: AttentionKernel,
    b: AttentionKernel,
) -> Result<()> {
    if !g.info().hopper() {
        rep.flag("attn", format!("{a:?} vs {b:?}: not a Hopper GPU, never launched, not checked"), true, "");
        return Ok(());
    }
    let (ga, gb) = (variant(g, |o| o.attention = a)?, variant(g, |o| o.attention = b)?);
    for lens in [&[1usize, 63, 64, 65, 127, 4097][..], &[16_384][..]] {
        let d4b = AttentionDims { heads: 16, kv_heads: 4, head_dim: 256, rotary_dim: 64, norm_eps: 1e-6 };
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        let qkv = rng.bf16_normals(n * d4b.qkv_width(), 1.0);
        let qn = rng.bf16_normals(256, 0.1);
        let kn = rng.bf16_normals(256, 0.1);
        let pos: Vec<i64> = lens.iter().flat_map(|&l| 0..l as i64).collect();
        let (cos, sin) = positions::text_rope_tables(&[pos.clone(), pos.clone(), pos], 1e7, 64, section(32));
        let mut outs = vec![];
        for be in [&ga, &gb] {
            let mut caches = (0..lens.len()).map(|_| be.new_kv_cache(&d4b)).collect::<Result<Vec<_>>>()?;
            let t = (
                be.upload(&qkv, &[n, d4b.qkv_width()])?,
                be.param(&MemoryTensor::f32("q_norm", &[256], &qn).r())?,
                be.param(&MemoryTensor::f32("k_norm", &[256], &kn).r())?,
                be.upload(&cos, &[n, 64])?,
                be.upload(&sin, &[n, 64])?,
            );
            let inputs = AttentionInputs { qkv: &t.0, q_norm: &t.1, k_norm: &t.2, cos: &t.3, sin: &t.4 };
            let mut refs: Vec<_> = caches.iter_mut().collect();
            outs.push(be.download(&be.gated_attention(&inputs, &d4b, &segs, &[], &mut refs)?)?);
        }
        rep.check(
            "attn",
            format!("gated_attention 4B {a:?} vs {b:?} lens {lens:?}: differing values (bitwise count)"),
            bit_diff(&outs[0], &outs[1]) as f64,
            0.0,
        );
    }
    for lens in [&[100usize, 64, 256, 1, 127, 4097][..], &[16_384][..]] {
        let (heads, hd) = (16, 64);
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        let qkv = rng.bf16_normals(n * 3 * heads * hd, 1.0);
        let ang: Vec<f32> = (0..n * hd).map(|_| rng.uniform() * 20.0).collect();
        let cos: Vec<f32> = ang.iter().map(|x| x.cos()).collect();
        let sin: Vec<f32> = ang.iter().map(|x| x.sin()).collect();
        let mut outs = vec![];
        for be in [&ga, &gb] {
            outs.push(be.download(&be.vision_attention(
                &be.upload(&qkv, &[n, 3 * heads * hd])?,
                &be.upload(&cos, &[n, hd])?,
                &be.upload(&sin, &[n, hd])?,
                heads,
                &segs,
            )?)?);
        }
        rep.check(
            "attn",
            format!("vision_attention {a:?} vs {b:?} segments {lens:?}: differing values (bitwise count)"),
            bit_diff(&outs[0], &outs[1]) as f64,
            0.0,
        );
    }
    Ok(())
}
