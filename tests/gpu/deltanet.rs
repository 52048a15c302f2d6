//! Gated DeltaNet (kernels/deltanet.cu) against the CPU: conv, gates, the chunk scans (tensor
//! cores plain and pipelined, CUDA cores), states that continue across calls and fork (also
//! inside one call: a prefix and its continuations, a 2-token parent), and the final recurrent
//! states; the pipelined scan also bit for bit against the plain one, and a sequence's bits do
//! not depend on which of the two its batch made run.

use super::harness::{bit_diff, cat_cols, rel, tiling, tree_note, variant, Report};
use anyhow::Result;
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::deltanet::{
    split_kernels, warpgroup_scan_runs, ConvTiling, PIPELINED_MIN_CHUNKS,
};
use imajev_serve::backend::cuda::{CudaBackend, CudaTensor, GdnScan};
use imajev_serve::backend::{Backend, DeltaNetDims, DeltaNetInputs};
use imajev_serve::synth::memory::MemoryTensor;
use imajev_serve::synth::rng::SplitMix;
use std::ops::Range;

/// The cases: Qwen3.5-4B shapes, a tree call, a small value_dim; then the other scan.
pub fn cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let d4b = DELTANET_4B;
    delta_case(g, c, rep, rng, "4B", d4b, &[&[70, 1, 130], &[3, 64, 65]], &[])?;
    // Prefixes and their continuations in one call (a 2-token parent: its children's conv
    // history reaches into the parent's old history), beside an independent sequence whose
    // state is updated in place.
    let tree = [None, Some(0), Some(0), None, None, Some(4)];
    delta_case(g, c, rep, rng, "4B", d4b, &[&[130, 1, 70, 66, 2, 5], &[3, 64, 65, 1, 2, 9]], &tree)?;
    let alt = DELTANET_SMALL_VALUE_DIM;
    delta_case(g, c, rep, rng, "alt", alt, &[&[100, 5], &[1, 70]], &[])?;
    // The other chunk scan (CUDA cores when the default is tensor cores), same checks.
    let other = !g.options().gdn_ffma;
    let gf = variant(g, |o| o.gdn_ffma = other)?;
    let tag = if gf.options().gdn_ffma { "FMA scan" } else { "tensor-core scan" };
    delta_case(&gf, c, rep, rng, &format!("4B, {tag}"), d4b, &[&[70, 1, 130], &[3, 64, 65]], &[])?;
    delta_case(
        &gf,
        c,
        rep,
        rng,
        &format!("4B, {tag}"),
        d4b,
        &[&[130, 1, 70, 66, 2, 5], &[3, 64, 65, 1, 2, 9]],
        &tree,
    )?;
    delta_case(&gf, c, rep, rng, &format!("alt, {tag}"), alt, &[&[100, 5], &[1, 70]], &[])?;
    pipelined_cases(g, c, rep, rng)
}

/// A backend on the tensor-core scans (the FMA scan off) with `scan` forced and, given, the
/// products' precision (`Some(true)`: one TF32 MMA each, `Some(false)`: 3xTF32). The environment
/// can still override them: the callers check `options()`.
fn tc_scan(g: &CudaBackend, scan: GdnScan, tf32: Option<bool>) -> Result<CudaBackend> {
    variant(g, |o| {
        o.gdn_ffma = false;
        if let Some(tf32) = tf32 {
            o.gdn_tf32 = tf32;
        }
        o.gdn_scan = scan;
    })
}

/// The pipelined tensor-core scan (`GdnScan::Pipelined`, forced) where its pipeline changes shape
/// (1, 63, 64, 65 and 127 rows; 4,097 and 16,384 rows = 65 and 256 chunks) and in a tree (a
/// 2-token parent and a 4,097-token parent with children, one of them 600 tokens long), each
/// continued by a second call: against the CPU twin, and BITWISE against the plain tensor-core
/// scan (`GdnScan::Plain`) on the same inputs (outputs and final states after every call), with
/// 3xTF32 products (the default TF32 products have the same checks in `tf32_cases`). Then batch
/// invariance under the default choice by length.
pub fn pipelined_cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let tc = |scan| tc_scan(g, scan, Some(false));
    let (piped, plain) = (tc(GdnScan::Pipelined)?, tc(GdnScan::Plain)?);
    let forced = |be: &CudaBackend, scan| !be.options().gdn_ffma && be.options().gdn_scan == scan;
    if !(forced(&piped, GdnScan::Pipelined) && forced(&plain, GdnScan::Plain)) {
        rep.flag(
            "gdn",
            "pipelined vs plain tensor-core scan",
            false,
            "IMAJEV_GDN_FFMA=1 forces the FMA scan: unset it",
        );
        return Ok(());
    }
    twin_cases(&piped, ("plain tc scan", &plain), c, rep, rng, "pipelined scan")?;
    batch_invariance_across_scans(g, rep, rng)
}

/// `be` against the CPU twin and BITWISE against `twin` (outputs and final states after every
/// call): 4B shapes at 1, 63, 64, 65, 127, 4,097 and 16,384 rows, then a tree (a 2-token parent and a
/// 4,097-token parent with children), then a small value dim.
fn twin_cases(
    be: &CudaBackend,
    twin: (&str, &CudaBackend),
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    name: &str,
) -> Result<()> {
    let twin = Some(twin);
    let (d4b, alt) = (DELTANET_4B, DELTANET_SMALL_VALUE_DIM);
    let lens: &[&[usize]] = &[&[1, 63, 64, 65, 127, 4097, 16384], &[2, 64, 1, 70, 65, 3, 130]];
    delta_case_vs(be, twin, c, rep, rng, &format!("4B, {name}"), d4b, lens, &[])?;
    let tree = [None, Some(0), Some(0), None, Some(3), Some(3), Some(3), None];
    let lens: &[&[usize]] = &[&[2, 70, 5, 4097, 73, 1, 600, 65], &[3, 64, 65, 1, 2, 9, 130, 1]];
    delta_case_vs(be, twin, c, rep, rng, &format!("4B, {name}"), d4b, lens, &tree)?;
    let lens: &[&[usize]] = &[&[100, 5, 700], &[1, 70, 64]];
    delta_case_vs(be, twin, c, rep, rng, &format!("alt, {name}"), alt, lens, &[])
}

/// The one-TF32-MMA scans (`gdn_tf32`, the default): plain and pipelined against the CPU twin (final
/// states within 4e-3 instead of 3xTF32's 1e-3: operands rounded to 10-bit mantissas) at the
/// lengths where the pipeline changes shape and in a tree, and bitwise against each other.
pub fn tf32_cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let tf32 = |scan| tc_scan(g, scan, Some(true));
    let (piped, plain) = (tf32(GdnScan::Pipelined)?, tf32(GdnScan::Plain)?);
    if piped.options().gdn_ffma {
        rep.flag("gdn", "TF32 scans", false, "IMAJEV_GDN_FFMA=1 forces the FMA scan: unset it");
        return Ok(());
    }
    let twin = Some(("plain TF32 scan", &plain));
    let d4b = DELTANET_4B;
    let lens: &[&[usize]] = &[&[1, 63, 64, 65, 127, 4097, 16384], &[2, 64, 1, 70, 65, 3, 130]];
    delta_case_vs(&piped, twin, c, rep, rng, "4B, pipelined TF32 scan", d4b, lens, &[])?;
    let tree = [None, Some(0), Some(0), None, Some(3), Some(3), Some(3), None];
    let lens: &[&[usize]] = &[&[2, 70, 5, 4097, 73, 1, 600, 65], &[3, 64, 65, 1, 2, 9, 130, 1]];
    delta_case_vs(&piped, twin, c, rep, rng, "4B, pipelined TF32 scan", d4b, lens, &tree)?;
    let alt = DELTANET_SMALL_VALUE_DIM;
    delta_case_vs(
        &plain,
        None,
        c,
        rep,
        rng,
        "alt, plain TF32 scan",
        alt,
        &[&[100, 5, 700], &[1, 70, 64]],
        &[],
    )
}

/// The wide plain scan (`GdnScan::Wide`: one block per (sequence, value head) over all value
/// columns), with TF32 and with 3xTF32 products: against the CPU twin and BITWISE against the plain
/// scan of the same precision (outputs and final states after every call), at 1, 63, 64, 65, 127
/// and 4,097 rows, in a tree (a 2-token parent and a 4,097-token parent with children) and with a
/// value dim of 24 (one block, 104 of its 128 columns padding).
pub fn wide_cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    for tf32 in [true, false] {
        let scan = |gdn_scan| tc_scan(g, gdn_scan, Some(tf32));
        let (wide, plain) = (scan(GdnScan::Wide)?, scan(GdnScan::Plain)?);
        if wide.options().gdn_ffma || wide.options().gdn_scan != GdnScan::Wide {
            rep.flag(
                "gdn",
                "wide scan",
                false,
                "IMAJEV_GDN_FFMA / IMAJEV_GDN_SCAN force another scan: unset them",
            );
            return Ok(());
        }
        let p = if tf32 { "TF32" } else { "3xTF32" };
        let tname = format!("plain {p} scan");
        let twin = Some((tname.as_str(), &plain));
        let (d4b, alt) = (DELTANET_4B, DELTANET_SMALL_VALUE_DIM);
        let lens: &[&[usize]] = &[&[1, 63, 64, 65, 127, 4097], &[2, 64, 1, 70, 65, 3]];
        delta_case_vs(&wide, twin, c, rep, rng, &format!("4B, wide {p} scan"), d4b, lens, &[])?;
        let tree = [None, Some(0), Some(0), None, Some(3), Some(3), Some(3), None];
        let lens: &[&[usize]] = &[&[2, 70, 5, 4097, 73, 1, 600, 65], &[3, 64, 65, 1, 2, 9, 130, 1]];
        delta_case_vs(&wide, twin, c, rep, rng, &format!("4B, wide {p} scan"), d4b, lens, &tree)?;
        let lens: &[&[usize]] = &[&[100, 5, 700], &[1, 70, 64]];
        delta_case_vs(&wide, twin, c, rep, rng, &format!("alt, wide {p} scan"), alt, lens, &[])?;
    }
    Ok(())
}

/// The split delta rule (`GdnScan::Split`, kernels/deltanet_split.cu), with 3xTF32 and with TF32
/// products: against the CPU twin at the lengths where chunks and buffers change shape, in a tree
/// (children start from their parents' new states), at a small value dim; and a sequence's bits
/// alone and beside a 16,384-token one.
pub fn split_cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    for tf32 in [false, true] {
        let be = tc_scan(g, GdnScan::Split, Some(tf32))?;
        let dims = DELTANET_4B;
        if split_kernels(be.options(), dims.key_dim, dims.value_dim).is_none() {
            rep.flag("gdn", "split delta rule", false, "IMAJEV_GDN_FFMA=1 forces the FMA scan: unset it");
            return Ok(());
        }
        other_order_cases(&be, c, rep, rng, if tf32 { "split TF32" } else { "split 3xTF32" })?;
    }
    Ok(())
}

/// A scan that sums in another order than the tensor-core scans (so no bitwise twin): against the
/// CPU twin at 1, 63, 64, 65, 127, 4,097 and 16,384 rows, in a tree (children start from their
/// parents' new states), at the small value dim; and a sequence's bits alone and beside a
/// 16,384-token one.
fn other_order_cases(
    be: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    tag: &str,
) -> Result<()> {
    let dims = DELTANET_4B;
    let lens: &[&[usize]] = &[&[1, 63, 64, 65, 127, 4097, 16384], &[2, 64, 1, 70, 65, 3, 130]];
    delta_case(be, c, rep, rng, &format!("4B, {tag}"), dims, lens, &[])?;
    let tree = [None, Some(0), Some(0), None, Some(3), Some(3), Some(3), None];
    let lens: &[&[usize]] = &[&[2, 70, 5, 4097, 73, 1, 600, 65], &[3, 64, 65, 1, 2, 9, 130, 1]];
    delta_case(be, c, rep, rng, &format!("4B, {tag}"), dims, lens, &tree)?;
    let alt = DELTANET_SMALL_VALUE_DIM;
    delta_case(be, c, rep, rng, &format!("alt, {tag}"), alt, &[&[100, 5, 700], &[1, 70, 64]], &[])?;
    alone_and_beside(be, rep, rng, tag)
}

/// The warpgroup scan (`GdnScan::Warpgroup`, kernels/deltanet_wg.cu; Hopper): against the CPU twin
/// where chunks and the copy pipeline change shape (1, 63, 64, 65, 127, 4,097 and 16,384 rows), in a
/// tree (children start from their parents' new states), at key dim 32 with a value dim of 24 (40
/// of the block's 64 value columns padding); states kept and not kept give the same outputs; and a
/// sequence's bits alone and beside a 16,384-token one; then its one-warpgroup kernel bitwise
/// against its producer kernel (both forced).
pub fn warpgroup_cases(g: &CudaBackend, c: &CpuBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let be = tc_scan(g, GdnScan::Warpgroup, Some(true))?;
    let dims = DELTANET_4B;
    if !warpgroup_scan_runs(be.options(), dims.key_dim, be.info().hopper()) {
        rep.flag(
            "gdn",
            "warpgroup scan",
            false,
            "it runs on sm_90 only, and IMAJEV_GDN_FFMA / IMAJEV_GDN_SCAN must not force another scan",
        );
        return Ok(());
    }
    other_order_cases(&be, c, rep, rng, "warpgroup scan")?;
    // Its two kernels, each forced: the one-warpgroup kernel BITWISE against the producer one.
    let forced = |producer| {
        variant(&be, |o| {
            o.gdn_scan = GdnScan::Warpgroup;
            o.gdn_wg_producer = Some(producer);
            o.gdn_wg_lean = false;
        })
    };
    let (one, producer) = (forced(false)?, forced(true)?);
    if one.options().gdn_wg_producer != Some(false)
        || producer.options().gdn_wg_producer != Some(true)
        || one.options().gdn_wg_lean
    {
        rep.flag(
            "gdn",
            "warpgroup scan kernels",
            false,
            "IMAJEV_GDN_WG or IMAJEV_GDN_WG_LEAN forces one: unset them",
        );
        return Ok(());
    }
    twin_cases(&one, ("producer warpgroup scan", &producer), c, rep, rng, "one-warpgroup scan")?;
    // The paired kernel (two warpgroups a block sharing the copies) for every launch, BITWISE
    // against the one-warpgroup kernel.
    let pair = paired_scan(&be)?;
    if !pair.options().gdn_wg_pair {
        rep.flag("gdn", "paired warpgroup scan", false, "IMAJEV_GDN_WG_PAIR forces it off: unset it");
        return Ok(());
    }
    twin_cases(&pair, ("one-warpgroup scan", &one), c, rep, rng, "paired warpgroup scan")?;
    // The lean kernel (a third of the shared memory, two blocks an SM) for every launch, BITWISE
    // against the one-warpgroup kernel.
    let lean = variant(&be, |o| {
        o.gdn_scan = GdnScan::Warpgroup;
        o.gdn_wg_producer = Some(false);
        o.gdn_wg_pair = false;
        o.gdn_wg_lean = true;
    })?;
    if !lean.options().gdn_wg_lean {
        rep.flag("gdn", "lean warpgroup scan", false, "IMAJEV_GDN_WG_LEAN forces it off: unset it");
        return Ok(());
    }
    twin_cases(&lean, ("one-warpgroup scan", &one), c, rep, rng, "lean warpgroup scan")
}

/// The warpgroup scan with its paired kernel (`gdn_chunk_scan_wg2_<dk>`) for every launch.
fn paired_scan(g: &CudaBackend) -> Result<CudaBackend> {
    variant(g, |o| {
        o.gdn_scan = GdnScan::Warpgroup;
        o.gdn_wg_producer = Some(false);
        o.gdn_wg_pair = true;
    })
}

/// Final states that are not kept (`keep` false, as for read-out-only passes), under each scan:
/// a tree call — a 4,097-token parent continued by 73, 1 and 600 tokens, a 2-token parent
/// continued by 65, and an independent 130-token sequence whose state (it has seen 100 tokens)
/// is updated in place — once keeping every state and once keeping none. The outputs must be the
/// same bits, the parents' final states too (a parent is always kept), and the independent
/// sequence's state and conv history must be untouched (nothing written for it).
pub fn unkept_state_cases(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let dims = DELTANET_4B;
    let wts = DeltaWeights::random(rng, dims);
    let pw = dims.proj_width();
    let lens = [4097, 73, 1, 600, 2, 65, 130];
    let tree = [None, Some(0), Some(0), Some(0), None, Some(4), None];
    let n: usize = lens.iter().sum();
    let proj = rng.bf16_normals(n * pw, 1.0);
    let warm = rng.bf16_normals(100 * pw, 1.0);
    let variants = [
        ("plain", tc_scan(g, GdnScan::Plain, None)?),
        ("wide", tc_scan(g, GdnScan::Wide, None)?),
        ("pipelined", tc_scan(g, GdnScan::Pipelined, None)?),
        ("by length", tc_scan(g, GdnScan::ByLength, None)?),
        ("split", tc_scan(g, GdnScan::Split, None)?),
        ("warpgroup", tc_scan(g, GdnScan::Warpgroup, None)?),
        ("paired warpgroup", paired_scan(g)?),
        ("FMA", variant(g, |o| o.gdn_ffma = true)?),
    ];
    for (name, be) in &variants {
        let states = || -> Result<Vec<_>> {
            let mut v = (0..lens.len() - 1).map(|_| be.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
            let mut own = vec![be.new_delta_state(&dims)?];
            wts.run(be, &warm, dims, &tiling(&[100]), &[], &mut own)?;
            v.extend(own);
            Ok(v)
        };
        let segs = tiling(&lens);
        let mut s_all = states()?;
        let o_all = be.download(&wts.run_keeping(be, &proj, dims, &segs, &tree, &mut s_all, &[])?)?;
        let mut s_none = states()?;
        let (hist0, rec0) = (s_none[6].conv_history()?, s_none[6].recurrent()?);
        let o_none =
            be.download(&wts.run_keeping(be, &proj, dims, &segs, &tree, &mut s_none, &[false; 7])?)?;
        let mut diff = bit_diff(&o_all, &o_none);
        for p in [0, 4] {
            diff += bit_diff(&s_all[p].recurrent()?, &s_none[p].recurrent()?)
                + bit_diff(&s_all[p].conv_history()?, &s_none[p].conv_history()?);
        }
        rep.check(
            "gdn",
            format!("{name} scan: keeping no state vs every state: output and parent-state values whose bits differ"),
            diff as f64,
            0.0,
        );
        let touched = bit_diff(&rec0, &s_none[6].recurrent()?) + bit_diff(&hist0, &s_none[6].conv_history()?);
        let moved = bit_diff(&rec0, &s_all[6].recurrent()?);
        rep.check(
            "gdn",
            format!(
                "{name} scan: an in-place state not kept: values written ({moved} of its state values change when it is kept)"
            ),
            touched as f64 + if moved == 0 { 1.0 } else { 0.0 },
            0.0,
        );
    }
    Ok(())
}

/// `gdn_conv`'s tilings (rows a thread computes from one window, groups a block: the default by
/// row count, `gdn_conv_8` and `gdn_conv_4` with one, a few and the most groups) BITWISE against
/// one group of 8 (the kernel's row loop and window paths as the pre-streaming kernel ran them):
/// the mixer's outputs, final states and conv histories over a packed tree call whose sequences
/// start, end and fork at every offset within a group — a 4,097-token parent continued by 73, 1
/// and 600 tokens, a 2-token parent continued by 65 (its children's windows reach into its old
/// history), sequences of 3, 5, 9, 63, 64 and 1,000 tokens, and one continued in place from a
/// 100-token state; then the small value dim.
pub fn conv_tiling_cases(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    let one_group = ConvTiling::new(8, 1).map_err(anyhow::Error::msg)?;
    let reference = variant(g, |o| o.gdn_conv = Some(one_group))?;
    if reference.options().gdn_conv != Some(one_group) {
        rep.flag("gdn", "conv tilings", false, "IMAJEV_GDN_CONV forces one tiling: unset it");
        return Ok(());
    }
    let mut backends = vec![("default".to_string(), variant(g, |o| o.gdn_conv = None)?)];
    for t in ["8x2", "8x7", "8x64", "4x1", "4x3", "4x64"] {
        let tiling: ConvTiling = t.parse().map_err(anyhow::Error::msg)?;
        backends.push((t.to_string(), variant(g, |o| o.gdn_conv = Some(tiling))?));
    }
    let lens = [4097, 73, 1, 600, 2, 65, 3, 5, 9, 63, 64, 1000, 130];
    let tree = [None, Some(0), Some(0), Some(0), None, Some(4), None, None, None, None, None, None, None];
    for (tag, dims) in [("4B", DELTANET_4B), ("alt", DELTANET_SMALL_VALUE_DIM)] {
        let wts = DeltaWeights::random(rng, dims);
        let pw = dims.proj_width();
        let n: usize = lens.iter().sum();
        let proj = rng.bf16_normals(n * pw, 1.0);
        let warm = rng.bf16_normals(100 * pw, 1.0);
        let run = |be: &CudaBackend| -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
            let mut states =
                (0..lens.len() - 1).map(|_| be.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
            let mut own = vec![be.new_delta_state(&dims)?];
            wts.run(be, &warm, dims, &tiling(&[100]), &[], &mut own)?;
            states.extend(own);
            let out = be.download(&wts.run(be, &proj, dims, &tiling(&lens), &tree, &mut states)?)?;
            let mut kept = Vec::new();
            for s in &states {
                kept.push(s.recurrent()?);
                kept.push(s.conv_history()?);
            }
            Ok((out, kept))
        };
        let (want_out, want_states) = run(&reference)?;
        for (name, be) in &backends {
            let (out, states) = run(be)?;
            let diff = bit_diff(&want_out, &out)
                + want_states.iter().zip(&states).map(|(a, b)| bit_diff(a, b)).sum::<usize>();
            rep.check(
                "gdn",
                format!(
                    "{tag}, conv tiling {name} vs 8x1: output, state and history values whose bits differ"
                ),
                diff as f64,
                0.0,
            );
        }
    }
    Ok(())
}

/// A 447-token sequence continued from a state alone, and beside a 16,384-token one: its output
/// rows and final state must agree bit for bit.
fn alone_and_beside(be: &CudaBackend, rep: &mut Report, rng: &mut SplitMix, tag: &str) -> Result<()> {
    let dims = DELTANET_4B;
    let (short, long) = (447usize, 16384usize);
    let wts = DeltaWeights::random(rng, dims);
    let pw = dims.proj_width();
    let mut base = vec![be.new_delta_state(&dims)?];
    wts.run(be, &rng.bf16_normals(100 * pw, 1.0), dims, &tiling(&[100]), &[], &mut base)?;
    let xs = rng.bf16_normals(short * pw, 1.0);
    let xl = rng.bf16_normals(long * pw, 1.0);
    let mut s_alone = vec![base[0].clone()];
    let o_alone = be.download(&wts.run(be, &xs, dims, &tiling(&[short]), &[], &mut s_alone)?)?;
    let mut s_beside = vec![be.new_delta_state(&dims)?, base[0].clone()];
    let both = [xl.as_slice(), xs.as_slice()].concat();
    let o_beside = be.download(&wts.run(be, &both, dims, &tiling(&[long, short]), &[], &mut s_beside)?)?;
    let w = dims.value_heads * dims.value_dim;
    let diff = bit_diff(&o_alone, &o_beside[long * w..])
        + bit_diff(&s_alone[0].recurrent()?, &s_beside[1].recurrent()?);
    rep.check(
        "gdn",
        format!("{tag}: {short} tokens alone vs beside {long}: output and state values whose bits differ"),
        diff as f64,
        0.0,
    );
    Ok(())
}

/// Under `GdnScan::ByLength`, sequences of `PIPELINED_MIN_CHUNKS − 1` chunks run alone with the
/// pipelined scan (one sequence: its grid fits one wave of one block per SM, on the H200), the
/// plain one (two sequences: two plain blocks per SM fit them) or the wide one (twelve: 1,536 plain
/// blocks would not fit), and beside a 16,384-token sequence with the pipelined one: both runs
/// (from the same state, forks of one that has seen 100 tokens) must give their output rows and
/// final states bit for bit. The same under `GdnScan::PlainByLength` (the plain scan alone).
fn batch_invariance_across_scans(g: &CudaBackend, rep: &mut Report, rng: &mut SplitMix) -> Result<()> {
    for (scan, shorts) in [
        (GdnScan::ByLength, 1),
        (GdnScan::ByLength, 2),
        (GdnScan::ByLength, 12),
        (GdnScan::PlainByLength, 12),
    ] {
        batch_invariance_under(g, scan, shorts, rep, rng)?;
    }
    Ok(())
}

fn batch_invariance_under(
    g: &CudaBackend,
    scan: GdnScan,
    shorts: usize,
    rep: &mut Report,
    rng: &mut SplitMix,
) -> Result<()> {
    let be = tc_scan(g, scan, None)?;
    if be.options().gdn_ffma || be.options().gdn_scan != scan {
        rep.flag(
            "gdn",
            "batch invariance across the scans",
            false,
            "IMAJEV_GDN_FFMA / IMAJEV_GDN_SCAN force one scan: unset them",
        );
        return Ok(());
    }
    let dims = DELTANET_4B;
    let (short, long): (usize, usize) = ((PIPELINED_MIN_CHUNKS - 1) * 64 - 1, 16384);
    let alone = be.chunk_scan_kernel(&dims, short.div_ceil(64), shorts)?.name;
    let beside = be.chunk_scan_kernel(&dims, long.div_ceil(64), shorts + 1)?.name;
    // What each case is there to compare (the one-sequence case depends on the GPU's SMs: any).
    let (ok, want) = match (scan, shorts) {
        (GdnScan::ByLength, 1) => (true, "any scan alone"),
        (GdnScan::ByLength, 2) => (alone != beside, "another scan alone than beside"),
        (GdnScan::ByLength, _) => (alone.contains("_wide_"), "the wide scan alone"),
        _ => (alone != beside && !alone.contains("_wide_"), "the plain scan alone"),
    };
    rep.flag(
        "gdn",
        format!(
            "scan by length ({scan:?}): {shorts} × {short} tokens alone run {alone}, beside {long} {beside}"
        ),
        ok,
        format!("expected {want}"),
    );
    let wts = DeltaWeights::random(rng, dims);
    let pw = dims.proj_width();
    let mut base = vec![be.new_delta_state(&dims)?];
    wts.run(&be, &rng.bf16_normals(100 * pw, 1.0), dims, &tiling(&[100]), &[], &mut base)?;
    let xs = rng.bf16_normals(shorts * short * pw, 1.0);
    let xl = rng.bf16_normals(long * pw, 1.0);
    let mut s_alone = vec![base[0].clone(); shorts];
    let o_alone =
        be.download(&wts.run(&be, &xs, dims, &tiling(&vec![short; shorts]), &[], &mut s_alone)?)?;
    let mut s_beside = vec![base[0].clone(); shorts + 1];
    s_beside[0] = be.new_delta_state(&dims)?;
    let both = [xl.as_slice(), xs.as_slice()].concat();
    let lens: Vec<usize> = std::iter::once(long).chain(std::iter::repeat_n(short, shorts)).collect();
    let o_beside = be.download(&wts.run(&be, &both, dims, &tiling(&lens), &[], &mut s_beside)?)?;
    let w = dims.value_heads * dims.value_dim;
    let mut diff = bit_diff(&o_alone, &o_beside[long * w..]);
    for (a, b) in s_alone.iter().zip(&s_beside[1..]) {
        diff += bit_diff(&a.recurrent()?, &b.recurrent()?);
    }
    rep.check(
        "gdn",
        format!(
            "batch invariance ({scan:?}): {shorts} × {short} tokens alone vs beside {long}: output and state values whose bits differ"
        ),
        diff as f64,
        0.0,
    );
    Ok(())
}

/// The Gated DeltaNet shapes of Qwen3.5-4B.
pub const DELTANET_4B: DeltaNetDims = DeltaNetDims {
    key_heads: 16,
    value_heads: 32,
    key_dim: 128,
    value_dim: 128,
    conv_kernel: 4,
    norm_eps: 1e-6,
};

/// Small Gated DeltaNet shapes whose value_dim is not a multiple of 32 (nor 128).
pub const DELTANET_SMALL_VALUE_DIM: DeltaNetDims =
    DeltaNetDims { key_heads: 2, value_heads: 6, key_dim: 32, value_dim: 24, conv_kernel: 4, norm_eps: 1e-6 };

/// The parameters of a Gated DeltaNet layer besides its projections, random (conv taps, A_log,
/// dt_bias, the gated-norm weight), and one mixer call with them.
pub struct DeltaWeights {
    conv: MemoryTensor,
    alog: MemoryTensor,
    dtb: MemoryTensor,
    nw: MemoryTensor,
}

impl DeltaWeights {
    pub fn random(rng: &mut SplitMix, dims: DeltaNetDims) -> Self {
        let (ch, kw, vh, dv) = (dims.conv_channels(), dims.conv_kernel, dims.value_heads, dims.value_dim);
        let conv = MemoryTensor::bf16("conv", &[ch, kw], &rng.bf16_normals(ch * kw, 0.5));
        let alog = (0..vh).map(|_| (1.0 + 15.0 * rng.uniform()).ln()).collect::<Vec<_>>();
        let alog = MemoryTensor::f32("A_log", &[vh], &alog);
        let dtb = MemoryTensor::f32("dt_bias", &[vh], &rng.bf16_normals(vh, 0.5));
        let nw = rng.bf16_normals(dv, 0.1).iter().map(|v| 1.0 + v).collect::<Vec<_>>();
        let nw = MemoryTensor::f32("norm", &[dv], &nw);
        DeltaWeights { conv, alog, dtb, nw }
    }

    /// `gated_delta_net` on the fused projection `proj` (`[n, proj_width]`), every state kept.
    pub fn run<B: Backend>(
        &self,
        be: &B,
        proj: &[f32],
        dims: DeltaNetDims,
        segs: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [B::DeltaState],
    ) -> Result<B::Tensor> {
        self.run_keeping(be, proj, dims, segs, parents, states, &[])
    }

    /// [`DeltaWeights::run`] with `keep` (see `Backend::gated_delta_net`).
    #[allow(clippy::too_many_arguments)]
    pub fn run_keeping<B: Backend>(
        &self,
        be: &B,
        proj: &[f32],
        dims: DeltaNetDims,
        segs: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [B::DeltaState],
        keep: &[bool],
    ) -> Result<B::Tensor> {
        let pw = dims.proj_width();
        let t = (
            be.upload(proj, &[proj.len() / pw, pw])?,
            be.param(&self.conv.r())?,
            be.param(&self.alog.r())?,
            be.param(&self.dtb.r())?,
            be.param(&self.nw.r())?,
        );
        let inputs =
            DeltaNetInputs { proj: &t.0, conv_weight: &t.1, a_log: &t.2, dt_bias: &t.3, norm_weight: &t.4 };
        let mut refs: Vec<_> = states.iter_mut().collect();
        be.gated_delta_net(&inputs, &dims, segs, parents, &mut refs, keep)
    }
}

#[allow(clippy::too_many_arguments)]
pub fn delta_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    name: &str,
    dims: DeltaNetDims,
    calls: &[&[usize]],
    tree: &[Option<usize>],
) -> Result<()> {
    delta_case_vs(g, None, c, rep, rng, name, dims, calls, tree)
}

/// [`delta_case`], and with `twin` (a name and a second CUDA backend) the same calls on the same
/// inputs also on the twin, whose outputs and final states must equal `g`'s bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn delta_case_vs(
    g: &CudaBackend,
    twin: Option<(&str, &CudaBackend)>,
    c: &CpuBackend,
    rep: &mut Report,
    rng: &mut SplitMix,
    name: &str,
    dims: DeltaNetDims,
    calls: &[&[usize]],
    tree: &[Option<usize>],
) -> Result<()> {
    let DeltaNetDims { value_heads: vh, value_dim: dv, .. } = dims;
    let ch = dims.conv_channels();
    let nseq = calls[0].len();
    let mut gs = (0..nseq).map(|_| g.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
    let mut cs = (0..nseq).map(|_| c.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
    let mut ts = match twin {
        Some((_, t)) => (0..nseq).map(|_| t.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let wts = DeltaWeights::random(rng, dims);
    for (ci, lens) in calls.iter().enumerate() {
        let n: usize = lens.iter().sum();
        let segs = tiling(lens);
        // The first call may run a tree (children continue their parent within the call).
        let parents = if ci == 0 { tree } else { &[] };
        let qkv = rng.bf16_normals(n * ch, 1.0);
        let z = rng.bf16_normals(n * vh * dv, 1.0);
        let b = rng.bf16_normals(n * vh, 1.0);
        let a = rng.bf16_normals(n * vh, 1.0);
        // The fused projection [q | k | v | z | b | a].
        let (proj, pw) = cat_cols(n, &[&qkv, &z, &b, &a]);
        assert_eq!(pw, dims.proj_width());
        let og = g.download(&wts.run(g, &proj, dims, &segs, parents, &mut gs)?)?;
        let oc = c.download(&wts.run(c, &proj, dims, &segs, parents, &mut cs)?)?;
        rep.check(
            "gdn",
            format!("gated_delta_net {name} call {ci} lens {lens:?}{}: output", tree_note(parents)),
            rel(&og, &oc),
            2e-2,
        );
        let mut worst = 0f64;
        for (a, b) in gs.iter().zip(&cs) {
            worst = worst.max(rel(&a.recurrent()?, b.recurrent()));
        }
        // 3xTF32 and FMA scans keep f32-level products; one TF32 MMA rounds operands to 10 bits.
        let state_tol = if g.options().gdn_tf32 && !g.options().gdn_ffma { 4e-3 } else { 1e-3 };
        rep.check(
            "gdn",
            format!("gated_delta_net {name} call {ci}: final recurrent states (f32)"),
            worst,
            state_tol,
        );
        if let Some((tname, t)) = twin {
            let ot = t.download(&wts.run(t, &proj, dims, &segs, parents, &mut ts)?)?;
            let mut diff = bit_diff(&og, &ot);
            for (a, b) in gs.iter().zip(&ts) {
                diff += bit_diff(&a.recurrent()?, &b.recurrent()?);
            }
            rep.check(
                "gdn",
                format!("gated_delta_net {name} call {ci}: output and state values whose bits differ from the {tname}"),
                diff as f64,
                0.0,
            );
        }
    }
    // A fork (clone) is a deep copy: changing the original leaves it alone.
    let before = gs[0].recurrent()?;
    let fork = gs[0].clone();
    let x = rng.bf16_normals(dims.proj_width(), 1.0);
    wts.run(g, &x, dims, &tiling(&[1]), &[], &mut gs[..1])?;
    let same = fork.recurrent()? == before && gs[0].recurrent()? != before;
    rep.flag("gdn", format!("gated_delta_net {name}: cloned state independent of the original"), same, "");
    Ok(())
}

/// One `gated_delta_net` call on `g` and on `u` with the same random inputs and fresh states;
/// with `zero_head`, one (token, head) gate is driven to silu(z) = −0, a 128-block of zeros.
pub fn delta_pair(
    g: &CudaBackend,
    u: &CudaBackend,
    rng: &mut SplitMix,
    dims: DeltaNetDims,
    lens: &[usize],
    zero_head: bool,
) -> Result<(CudaTensor, CudaTensor)> {
    let DeltaNetDims { value_heads: vh, value_dim: dv, .. } = dims;
    let ch = dims.conv_channels();
    let n: usize = lens.iter().sum();
    let wts = DeltaWeights::random(rng, dims);
    let qkv = rng.bf16_normals(n * ch, 1.0);
    let mut z = rng.bf16_normals(n * vh * dv, 1.0);
    if zero_head {
        let h = vh / 2;
        z[h * dv..(h + 1) * dv].fill(-30000.0);
    }
    let b = rng.bf16_normals(n * vh, 1.0);
    let a = rng.bf16_normals(n * vh, 1.0);
    let (proj, _) = cat_cols(n, &[&qkv, &z, &b, &a]);
    let segs = tiling(lens);
    let run = |be: &CudaBackend| -> Result<CudaTensor> {
        let mut states = (0..lens.len()).map(|_| be.new_delta_state(&dims)).collect::<Result<Vec<_>>>()?;
        wts.run(be, &proj, dims, &segs, &[], &mut states)
    };
    Ok((run(g)?, run(u)?))
}
