//! Segment trees two levels deep, run as one-level mixer calls.
//!
//! A backend's sequence mixers ([`Backend::gated_attention`], [`Backend::gated_delta_net`]) take a
//! packed batch whose segments may continue a parent of the same call, one level deep
//! ([`check_parents`]). A request's two-level tree — its shared prefix, each question's tokens
//! shared by that question's rotations, then each rotation's own tokens — runs here as two such
//! calls per mixer: first the roots and the segments that continue them, then the segments of the
//! second level, each starting from a fork of its parent's state as the first call left it (for
//! attention, the parent's cache is frozen first with [`Backend::share_kv`], so a fork reads the
//! root's and the parent's keys as one shared part — exactly what a separate prefill, share,
//! fork and extend would give it). The projections around the mixers still see every row in one
//! GEMM; only the mixers are split, and a one-level tree goes straight through as one call.
//!
//! This is composed from the backend's own calls (gather, concat, share, clone and the one-level
//! mixers), so every backend runs deeper trees the same way. It knows nothing about models,
//! requests or questions.

use super::{check_parents, AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs};
use anyhow::{ensure, Result};
use std::ops::Range;

/// The deepest tree [`TreeCalls`] runs: a root, its children and their children.
pub const MAX_DEPTH: usize = 2;

/// One one-level mixer call of a tree: some of the batch's segments, their rows, and how they
/// relate inside the call.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeCall {
    /// Batch segment indices, ascending.
    pub segments: Vec<usize>,
    /// The batch rows of those segments, in order (the rows this call's inputs are gathered from).
    pub rows: Vec<usize>,
    /// The segments' rows in the call's own (gathered) batch; they tile `0..rows.len()`.
    pub ranges: Vec<Range<usize>>,
    /// Per segment of the call, its parent as an index into `segments` (empty: none has one).
    pub parents: Vec<Option<usize>>,
    /// `(segment, parent)` batch indices: before this call, the segment's state becomes a fork
    /// of its parent's (the parent ran in an earlier call).
    pub forks: Vec<(usize, usize)>,
}

/// A packed batch's segment tree as the mixer calls that run it: one call when no segment is
/// deeper than one level, two otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeCalls {
    /// Rows of the whole batch.
    pub rows: usize,
    /// Per segment: 0 for a root, 1 for its children, 2 for theirs.
    pub depth: Vec<usize>,
    /// Per segment: whether another segment continues it (its final mixer states are read).
    pub continued: Vec<bool>,
    pub calls: Vec<TreeCall>,
    /// Batch segment order of the segments as the calls list them (the order in which per-segment
    /// results come out of the calls), when that is not already `0..segments`.
    segment_order: Option<Vec<usize>>,
    /// Likewise for the rows.
    row_order: Option<Vec<usize>>,
}

impl TreeCalls {
    /// Plans the calls for `parents` (empty, or one entry per segment; a parent comes before its
    /// children; at most [`MAX_DEPTH`] levels) over `segments`, which tile the batch rows in order.
    pub fn new(parents: &[Option<usize>], segments: &[Range<usize>]) -> Result<Self> {
        let n = segments.len();
        ensure!(parents.is_empty() || parents.len() == n, "{} parents for {n} segments", parents.len());
        let rows = segments.last().map_or(0, |s| s.end);
        super::check_tiling(segments, rows)?;
        let parent = |j: usize| parents.get(j).copied().flatten();
        let mut depth = vec![0usize; n];
        let mut continued = vec![false; n];
        for j in 0..n {
            if let Some(p) = parent(j) {
                ensure!(p < j, "segment {j}'s parent {p} does not come before it");
                depth[j] = depth[p] + 1;
                continued[p] = true;
                ensure!(
                    depth[j] <= MAX_DEPTH,
                    "segment {j} is {} levels below its root; at most {MAX_DEPTH} are supported",
                    depth[j]
                );
            }
        }
        let all_rows = || segments.iter().flat_map(|s| s.clone()).collect::<Vec<_>>();
        if depth.iter().all(|&d| d <= 1) {
            let call = TreeCall {
                segments: (0..n).collect(),
                rows: all_rows(),
                ranges: segments.to_vec(),
                parents: parents.to_vec(),
                forks: Vec::new(),
            };
            check_parents(&call.parents, n)?;
            return Ok(TreeCalls {
                rows,
                depth,
                continued,
                calls: vec![call],
                segment_order: None,
                row_order: None,
            });
        }
        let mut calls = Vec::new();
        for level in [0..=1, 2..=2] {
            let members: Vec<usize> = (0..n).filter(|&j| level.contains(&depth[j])).collect();
            let local = |j: usize| members.iter().position(|&m| m == j);
            let mut call = TreeCall {
                segments: members.clone(),
                rows: Vec::new(),
                ranges: Vec::new(),
                parents: Vec::new(),
                forks: Vec::new(),
            };
            for &j in &members {
                let at = call.rows.len();
                call.rows.extend(segments[j].clone());
                call.ranges.push(at..call.rows.len());
                match parent(j) {
                    Some(p) if local(p).is_some() => call.parents.push(local(p)),
                    Some(p) => {
                        call.forks.push((j, p));
                        call.parents.push(None);
                    }
                    None => call.parents.push(None),
                }
            }
            if call.parents.iter().all(Option::is_none) {
                call.parents.clear();
            }
            check_parents(&call.parents, call.segments.len())?;
            calls.push(call);
        }
        let seg_order: Vec<usize> = calls.iter().flat_map(|c| c.segments.iter().copied()).collect();
        let row_order: Vec<usize> = calls.iter().flat_map(|c| c.rows.iter().copied()).collect();
        let identity = |v: &[usize]| v.iter().enumerate().all(|(i, &x)| i == x);
        let inverse = |v: &[usize]| {
            let mut inv = vec![0; v.len()];
            v.iter().enumerate().for_each(|(i, &x)| inv[x] = i);
            inv
        };
        Ok(TreeCalls {
            rows,
            depth,
            continued,
            segment_order: (!identity(&seg_order)).then(|| inverse(&seg_order)),
            row_order: (!identity(&row_order)).then(|| inverse(&row_order)),
            calls,
        })
    }

    /// Whether the tree is one mixer call (no segment two levels deep).
    pub fn is_single(&self) -> bool {
        self.calls.len() == 1
    }
}

/// The call's rows of `x` (all of `x` when the tree is one call).
fn call_rows<B: Backend>(
    b: &B,
    tree: &TreeCalls,
    call: &TreeCall,
    x: &B::Tensor,
) -> Result<Option<B::Tensor>> {
    if tree.is_single() {
        return Ok(None);
    }
    Ok(Some(b.gather_rows(x, &call.rows)?))
}

/// The calls' outputs, one row per batch row (`last_rows`: per segment), in batch order.
fn assemble<B: Backend>(b: &B, tree: &TreeCalls, outs: Vec<B::Tensor>, last_rows: bool) -> Result<B::Tensor> {
    let mut outs = outs;
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    let refs: Vec<&B::Tensor> = outs.iter().collect();
    let all = b.concat_rows(&refs)?;
    let order = if last_rows { &tree.segment_order } else { &tree.row_order };
    match order {
        Some(inv) => b.gather_rows(&all, inv),
        None => Ok(all),
    }
}

/// The call's members of a per-segment slice of mutable references.
fn members<'s, T>(all: &'s mut [&mut T], call: &TreeCall) -> Vec<&'s mut T> {
    let mut want = call.segments.iter().peekable();
    let mut out = Vec::with_capacity(call.segments.len());
    for (j, x) in all.iter_mut().enumerate() {
        if want.peek() == Some(&&j) {
            want.next();
            out.push(&mut **x);
        }
    }
    out
}

/// [`Backend::gated_attention`] (or, with `last_rows`, [`Backend::gated_attention_last_rows`])
/// over a tree of up to [`MAX_DEPTH`] levels. `rope` holds the `(cos, sin)` tables of each call's
/// rows (one pair per entry of `tree.calls`).
#[allow(clippy::too_many_arguments)]
pub fn gated_attention<B: Backend>(
    b: &B,
    tree: &TreeCalls,
    qkv: &B::Tensor,
    q_norm: &B::Tensor,
    k_norm: &B::Tensor,
    rope: &[(B::Tensor, B::Tensor)],
    dims: &AttentionDims,
    caches: &mut [&mut B::KvCache],
    last_rows: bool,
) -> Result<B::Tensor> {
    ensure!(rope.len() == tree.calls.len(), "{} rotary tables for {} calls", rope.len(), tree.calls.len());
    ensure!(caches.len() == tree.depth.len(), "one cache per segment");
    let mut outs = Vec::with_capacity(tree.calls.len());
    for (call, (cos, sin)) in tree.calls.iter().zip(rope) {
        for &(j, p) in &call.forks {
            // The parent's rows become one shared part, then the fork references it.
            b.share_kv(caches[p])?;
            *caches[j] = caches[p].clone();
        }
        let gathered = call_rows(b, tree, call, qkv)?;
        let x = AttentionInputs { qkv: gathered.as_ref().unwrap_or(qkv), q_norm, k_norm, cos, sin };
        let mut mine = members(caches, call);
        outs.push(if last_rows {
            b.gated_attention_last_rows(&x, dims, &call.ranges, &call.parents, &mut mine)?
        } else {
            b.gated_attention(&x, dims, &call.ranges, &call.parents, &mut mine)?
        });
    }
    assemble(b, tree, outs, last_rows)
}

/// [`Backend::gated_delta_net`] over a tree of up to [`MAX_DEPTH`] levels. `keep` as there, per
/// batch segment (empty: every final state is kept); a segment that another continues, in this
/// call or the next, is always kept.
pub fn gated_delta_net<B: Backend>(
    b: &B,
    tree: &TreeCalls,
    x: &DeltaNetInputs<B::Tensor>,
    dims: &DeltaNetDims,
    states: &mut [&mut B::DeltaState],
    keep: &[bool],
) -> Result<B::Tensor> {
    ensure!(states.len() == tree.depth.len(), "one state per segment");
    ensure!(
        keep.is_empty() || keep.len() == states.len(),
        "{} keep flags for {} segments",
        keep.len(),
        states.len()
    );
    let mut outs = Vec::with_capacity(tree.calls.len());
    for call in &tree.calls {
        for &(j, p) in &call.forks {
            *states[j] = states[p].clone();
        }
        let gathered = call_rows(b, tree, call, x.proj)?;
        let xc = DeltaNetInputs { proj: gathered.as_ref().unwrap_or(x.proj), ..*x };
        let kept: Vec<bool> = if keep.is_empty() {
            Vec::new()
        } else {
            call.segments.iter().map(|&j| keep[j] || tree.continued[j]).collect()
        };
        let mut mine = members(states, call);
        outs.push(b.gated_delta_net(&xc, dims, &call.ranges, &call.parents, &mut mine, &kept)?);
    }
    assemble(b, tree, outs, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiling(lens: &[usize]) -> Vec<Range<usize>> {
        let mut at = 0;
        lens.iter()
            .map(|&l| {
                at += l;
                at - l..at
            })
            .collect()
    }

    #[test]
    fn one_level_trees_are_one_call() {
        let segs = tiling(&[3, 2, 2, 4]);
        let t = TreeCalls::new(&[None, Some(0), Some(0), None], &segs).unwrap();
        assert!(t.is_single());
        assert_eq!(t.calls[0].ranges, segs);
        assert_eq!(t.calls[0].parents, vec![None, Some(0), Some(0), None]);
        assert_eq!(t.depth, vec![0, 1, 1, 0]);
        assert_eq!(t.continued, vec![true, false, false, false]);
        let t = TreeCalls::new(&[], &segs).unwrap();
        assert!(t.is_single() && t.calls[0].parents.is_empty());
    }

    #[test]
    fn two_level_trees_split_into_two_calls() {
        // Two requests: root 0 with question 1 (rotations 3, 4) and pass 2 (no shared tokens);
        // root 5 with question 6 (rotation 7). The segments come in any valid order.
        let lens = [5, 2, 3, 1, 1, 4, 2, 1];
        let segs = tiling(&lens);
        let parents = [None, Some(0), Some(0), Some(1), Some(1), None, Some(5), Some(6)];
        let t = TreeCalls::new(&parents, &segs).unwrap();
        assert_eq!(t.calls.len(), 2);
        assert_eq!(t.depth, vec![0, 1, 1, 2, 2, 0, 1, 2]);
        assert_eq!(t.continued, vec![true, true, false, false, false, true, true, false]);
        let (a, b) = (&t.calls[0], &t.calls[1]);
        assert_eq!(a.segments, vec![0, 1, 2, 5, 6]);
        assert_eq!(a.parents, vec![None, Some(0), Some(0), None, Some(3)]);
        assert_eq!(a.ranges, tiling(&[5, 2, 3, 4, 2]));
        assert_eq!(a.rows, [(0..10).collect::<Vec<_>>(), (12..18).collect()].concat());
        assert!(a.forks.is_empty());
        assert_eq!(b.segments, vec![3, 4, 7]);
        assert!(b.parents.is_empty());
        assert_eq!(b.forks, vec![(3, 1), (4, 1), (7, 6)]);
        assert_eq!(b.rows, vec![10, 11, 18]);
        // Results come back in batch order.
        let rows: Vec<usize> = t.calls.iter().flat_map(|c| c.rows.iter().copied()).collect();
        let inv = t.row_order.as_ref().unwrap();
        assert!((0..19).all(|r| rows[inv[r]] == r));
        let segs_out: Vec<usize> = t.calls.iter().flat_map(|c| c.segments.iter().copied()).collect();
        let inv = t.segment_order.as_ref().unwrap();
        assert!((0..8).all(|s| segs_out[inv[s]] == s));
    }

    #[test]
    fn level_ordered_batches_need_no_reordering() {
        let segs = tiling(&[4, 2, 3, 1, 1, 2]);
        let parents = [None, Some(0), None, Some(2), Some(1), Some(3)];
        let t = TreeCalls::new(&parents, &segs).unwrap();
        assert_eq!(t.calls.len(), 2);
        assert_eq!((t.row_order.clone(), t.segment_order.clone()), (None, None));
    }

    #[test]
    fn bad_trees_are_refused() {
        let segs = tiling(&[1, 1, 1, 1]);
        let e = TreeCalls::new(&[None, Some(0), Some(1), Some(2)], &segs).unwrap_err().to_string();
        assert!(e.contains("at most 2"), "{e}");
        let e = TreeCalls::new(&[Some(1), None, None, None], &segs).unwrap_err().to_string();
        assert!(e.contains("does not come before"), "{e}");
        let e = TreeCalls::new(&[None, None], &segs).unwrap_err().to_string();
        assert!(e.contains("2 parents for 4 segments"), "{e}");
    }
}
