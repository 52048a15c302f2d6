//! Token layout of a multimodal sequence: `<|image_pad|>` expansion, 3-row (T, H, W) mRoPE
//! positions, and the rotary and position-embedding tables derived from them.
//!
//! Positions follow transformers' `get_rope_index`: text tokens advance all three rows together;
//! an image of merged grid `h'×w'` places its tokens at `(cur, cur+r, cur+c)` and then advances
//! `cur` by `max(h', w')`. A sequence may start at any `cur` (a continuation of a prefix state).

use anyhow::{bail, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;

/// A sequence ready for the decoder: expanded ids, positions, where image features go.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceLayout {
    pub ids: Vec<u32>,
    /// `[T, H, W]` position rows, one entry per token.
    pub positions: [Vec<i64>; 3],
    /// `(image index, rows of this sequence that take its merged features)`.
    pub images: Vec<(usize, Range<usize>)>,
    /// The text position after this sequence (`max position + 1`).
    pub next_pos: i64,
}

/// Expands each `image_pad` in `ids` to its image's merged token count and assigns positions.
///
/// `grids[i]` is image i's patch grid `(t, h, w)`; images are taken in order of appearance;
/// `merge` is the spatial merge size; `start` is the first text position.
pub fn layout(
    ids: &[u32],
    image_pad: u32,
    grids: &[[usize; 3]],
    merge: usize,
    start: i64,
) -> Result<SequenceLayout> {
    let pads = ids.iter().filter(|&&t| t == image_pad).count();
    if pads != grids.len() {
        bail!(
            "the prompt has {pads} <|image_pad|> token(s) but {} image(s) were given; write one \
             <|vision_start|><|image_pad|><|vision_end|> per image",
            grids.len()
        );
    }
    let mut out = SequenceLayout {
        ids: Vec::new(),
        positions: [vec![], vec![], vec![]],
        images: vec![],
        next_pos: start,
    };
    let mut cur = start;
    let mut img = 0;
    for &t in ids {
        if t != image_pad {
            out.ids.push(t);
            for row in out.positions.iter_mut() {
                row.push(cur);
            }
            cur += 1;
            continue;
        }
        let [gt, gh, gw] = grids[img];
        if gh % merge != 0 || gw % merge != 0 || gt == 0 {
            bail!("image {img} has grid {:?}, not a multiple of the merge size {merge}", grids[img]);
        }
        let (mh, mw) = (gh / merge, gw / merge);
        let first = out.ids.len();
        for ti in 0..gt {
            for r in 0..mh {
                for c in 0..mw {
                    out.ids.push(image_pad);
                    out.positions[0].push(cur + ti as i64);
                    out.positions[1].push(cur + r as i64);
                    out.positions[2].push(cur + c as i64);
                }
            }
        }
        out.images.push((img, first..out.ids.len()));
        cur += mh.max(mw) as i64;
        img += 1;
    }
    out.next_pos = cur;
    Ok(out)
}

/// Inverse frequencies `1 / θ^(2j/dim)` for `j < dim/2`, in f32 as transformers computes them.
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|j| {
            let e = (2 * j) as f32 / dim as f32;
            1.0 / (theta as f32).powf(e)
        })
        .collect()
}

/// Text cos/sin tables `[n, rotary_dim]` with interleaved mRoPE: frequency `j` takes its
/// position from H when `j % 3 == 1 && j < 3·sec[1]`, from W when `j % 3 == 2 && j < 3·sec[2]`,
/// else from T; the half-table is repeated (`cat(freqs, freqs)`).
///
/// Built on the host before a forward's first layer, so it is on the critical path of every
/// engine round: one table row per distinct position triple (a packed round repeats each pass's
/// positions in every pass of every request — ~250 distinct among ~7,800 rows — where a 16K
/// prefix has none to share), the rows in parallel. The same `sin_cos` of the same angle per
/// entry as row by row, so the same bits.
pub fn text_rope_tables(
    positions: &[Vec<i64>; 3],
    theta: f64,
    rotary_dim: usize,
    section: [usize; 3],
) -> (Vec<f32>, Vec<f32>) {
    let inv = inv_freq(theta, rotary_dim);
    let half = rotary_dim / 2;
    let n = positions[0].len();
    // The position row (T, H, W) each frequency reads.
    let source: Vec<usize> = (0..half)
        .map(|j| {
            if j % 3 == 1 && j < 3 * section[1] {
                1
            } else if j % 3 == 2 && j < 3 * section[2] {
                2
            } else {
                0
            }
        })
        .collect();
    let fill = |key: [i64; 3], cos: &mut [f32], sin: &mut [f32]| {
        for (j, (f, &row)) in inv.iter().zip(&source).enumerate() {
            let (s, c) = (key[row] as f32 * f).sin_cos();
            cos[j] = c;
            cos[j + half] = c;
            sin[j] = s;
            sin[j + half] = s;
        }
    };
    let key = |t: usize| [positions[0][t], positions[1][t], positions[2][t]];
    // The distinct triples and each row's: text (T = H = W on every row, the common case) over
    // the range of its positions when that is not much wider than the rows; else hashed.
    let (distinct, slots): (Vec<[i64; 3]>, Vec<usize>) = match text_span(positions) {
        Some((lo, hi)) if ((hi - lo) as u64) < 2 * n as u64 => {
            ((lo..=hi).map(|p| [p; 3]).collect(), positions[0].iter().map(|&p| (p - lo) as usize).collect())
        }
        _ => {
            let mut distinct = Vec::new();
            let mut slot_of: HashMap<[i64; 3], usize> = HashMap::new();
            let slots = (0..n)
                .map(|t| {
                    *slot_of.entry(key(t)).or_insert_with(|| {
                        distinct.push(key(t));
                        distinct.len() - 1
                    })
                })
                .collect();
            (distinct, slots)
        }
    };
    let table = |keys: &[[i64; 3]]| {
        let mut cos = vec![0f32; keys.len() * rotary_dim];
        let mut sin = vec![0f32; keys.len() * rotary_dim];
        if rotary_dim > 0 {
            cos.par_chunks_mut(rotary_dim)
                .zip(sin.par_chunks_mut(rotary_dim))
                .zip(keys.par_iter())
                .for_each(|((c, s), &k)| fill(k, c, s));
        }
        (cos, sin)
    };
    let (ucos, usin) = table(&distinct);
    if rotary_dim == 0 || (distinct.len() == n && slots.iter().enumerate().all(|(t, &i)| t == i)) {
        // Every row its own position, in order (a prefix).
        return (ucos, usin);
    }
    let spread = |u: &[f32]| spread_rows(u, rotary_dim, &slots, |&i| i);
    (spread(&ucos), spread(&usin))
}

/// `(lo, hi)` of the positions when every row is a text position (T = H = W) and there is one;
/// else None.
fn text_span(positions: &[Vec<i64>; 3]) -> Option<(i64, i64)> {
    let n = positions[0].len();
    let text = (0..n).all(|t| positions[0][t] == positions[1][t] && positions[1][t] == positions[2][t]);
    (text && n > 0).then(|| positions[0].iter().fold((i64::MAX, i64::MIN), |(l, h), &p| (l.min(p), h.max(p))))
}

/// Rows of `width` values: row t is `table`'s row `row_of(&rows[t])`, copied in parallel.
fn spread_rows<T: Sync>(
    table: &[f32],
    width: usize,
    rows: &[T],
    row_of: impl Fn(&T) -> usize + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; rows.len() * width];
    out.par_chunks_mut(width).zip(rows.par_iter()).for_each(|(row, r)| {
        let i = row_of(r);
        row.copy_from_slice(&table[i * width..(i + 1) * width]);
    });
    out
}

/// The text rotary table rows of positions `0 .. n`, kept (one per model): a row of a text position
/// (T = H = W) depends on nothing but the position, and requests keep asking for the same ones —
/// a 16K prefix's are 16K rows × `rotary_dim` × cos and sin (~7.9 ms of `sin_cos` and fresh pages on
/// the 2-core development host, `examples/host_time`, before the forward's first layer can run).
/// [`TextRopeCache::tables`] answers a call whose rows are all text positions from the kept rows
/// (made on first need, with [`text_rope_tables`]' arithmetic: the same bits), borrowing them
/// outright when the positions run `lo, lo + 1, ...`; anything else goes to [`text_rope_tables`].
pub struct TextRopeCache {
    theta: f64,
    rotary_dim: usize,
    section: [usize; 3],
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl TextRopeCache {
    /// Positions at or past this are never kept (their tables are made per call): 131,072 rows
    /// are 64 MiB at rotary_dim 64, twice the 64K-token ceiling.
    pub const MAX_POSITIONS: usize = 1 << 17;

    pub fn new(theta: f64, rotary_dim: usize, section: [usize; 3]) -> Self {
        Self { theta, rotary_dim, section, cos: Vec::new(), sin: Vec::new() }
    }

    /// Positions whose rows are kept so far.
    pub fn kept(&self) -> usize {
        self.cos.len().checked_div(self.rotary_dim).unwrap_or(0)
    }

    /// The cos and sin tables of `positions` (as [`text_rope_tables`] makes them).
    pub fn tables(
        &mut self,
        positions: &[Vec<i64>; 3],
    ) -> (std::borrow::Cow<'_, [f32]>, std::borrow::Cow<'_, [f32]>) {
        use std::borrow::Cow;
        let (rd, n) = (self.rotary_dim, positions[0].len());
        let span =
            text_span(positions).filter(|&(lo, hi)| rd > 0 && lo >= 0 && (hi as usize) < Self::MAX_POSITIONS);
        let Some((lo, hi)) = span else {
            let (c, s) = text_rope_tables(positions, self.theta, rd, self.section);
            return (Cow::Owned(c), Cow::Owned(s));
        };
        let need = hi as usize + 1;
        if self.kept() < need {
            // Grow to the next power of two (at least 4,096 rows), so a run of longer requests
            // makes the rows a few times, not once per request.
            let rows = need.next_power_of_two().clamp(4096, Self::MAX_POSITIONS);
            let from = self.kept() as i64;
            let more: [Vec<i64>; 3] = std::array::from_fn(|_| (from..rows as i64).collect());
            let (c, s) = text_rope_tables(&more, self.theta, rd, self.section);
            self.cos.extend_from_slice(&c);
            self.sin.extend_from_slice(&s);
        }
        let lo = lo as usize;
        if positions[0].iter().enumerate().all(|(t, &p)| p as usize == lo + t) {
            let range = lo * rd..(lo + n) * rd;
            return (Cow::Borrowed(&self.cos[range.clone()]), Cow::Borrowed(&self.sin[range]));
        }
        let gather = |kept: &[f32]| Cow::Owned(spread_rows(kept, rd, &positions[0], |&p| p as usize));
        (gather(&self.cos), gather(&self.sin))
    }
}

/// `(row, col)` of every patch of a `(t, h, w)` grid in merge-block order
/// (block row, block col, in-block row, in-block col), frames repeated.
pub fn patch_coords(grid: [usize; 3], merge: usize) -> Vec<(usize, usize)> {
    let [t, h, w] = grid;
    let mut v = Vec::with_capacity(t * h * w);
    for _ in 0..t {
        for br in 0..h / merge {
            for bc in 0..w / merge {
                for ir in 0..merge {
                    for ic in 0..merge {
                        v.push((br * merge + ir, bc * merge + ic));
                    }
                }
            }
        }
    }
    v
}

/// Vision rotary tables `[n, head_dim]`: angles `[row·f | col·f | row·f | col·f]` with
/// `f_i = 1/θ^(2i/(head_dim/2))`, `i < head_dim/4`. Rows and columns take few distinct values
/// (256 for a 4096² photo against its 65,536 patches), so each `(v·f_i).sin_cos()` is computed
/// once per value and the rows are filled from those, in parallel when there are many.
pub fn vision_rope_tables(coords: &[(usize, usize)], head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let inv = inv_freq(theta, head_dim / 2);
    let q = inv.len();
    let values = coords.iter().map(|&(r, c)| r.max(c) + 1).max().unwrap_or(0);
    // (sin, cos) of v·f_i at [v·q + i].
    let angles: Vec<(f32, f32)> =
        (0..values).flat_map(|v| inv.iter().map(move |f| (v as f32 * f).sin_cos())).collect();
    let mut cos = vec![0f32; coords.len() * head_dim];
    let mut sin = vec![0f32; coords.len() * head_dim];
    let fill = |cos: &mut [f32], sin: &mut [f32], (r, c): (usize, usize)| {
        for i in 0..q {
            let (sr, cr) = angles[r * q + i];
            let (sc, cc) = angles[c * q + i];
            for rep in 0..2 {
                let o = rep * 2 * q;
                cos[o + i] = cr;
                sin[o + i] = sr;
                cos[o + q + i] = cc;
                sin[o + q + i] = sc;
            }
        }
    };
    if coords.len() >= 4096 {
        use rayon::prelude::*;
        cos.par_chunks_mut(head_dim)
            .zip(sin.par_chunks_mut(head_dim))
            .zip(coords.par_iter())
            .for_each(|((c, s), &rc)| fill(c, s, rc));
    } else {
        for ((c, s), &rc) in cos.chunks_mut(head_dim).zip(sin.chunks_mut(head_dim)).zip(coords) {
            fill(c, s, rc);
        }
    }
    (cos, sin)
}

/// Bilinear (align_corners) resampling of the learned `side×side` position grid to each patch:
/// 4 table indices and weights per patch, in transformers' tap order
/// `(r0,c0), (r0,c1), (r1,c0), (r1,c1)`.
pub fn pos_embed_taps(grid: [usize; 3], merge: usize, side: usize) -> (Vec<u32>, Vec<f32>) {
    let [_, h, w] = grid;
    let axis = |i: usize, size: usize| -> ([usize; 2], [f32; 2]) {
        let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
        let fl = src.floor();
        let mut taps = [0usize; 2];
        let mut wts = [0f32; 2];
        for o in 0..2 {
            taps[o] = ((fl as i64 + o as i64).clamp(0, side as i64 - 1)) as usize;
            let dist = (src - fl - o as f32).abs();
            wts[o] = (1.0 - dist).max(0.0);
        }
        (taps, wts)
    };
    let coords = patch_coords(grid, merge);
    let mut idx = Vec::with_capacity(coords.len() * 4);
    let mut wts = Vec::with_capacity(coords.len() * 4);
    for (r, c) in coords {
        let (rt, rw) = axis(r, h);
        let (ct, cw) = axis(c, w);
        for a in 0..2 {
            for b in 0..2 {
                idx.push((rt[a] * side + ct[b]) as u32);
                wts.push(rw[a] * cw[b]);
            }
        }
    }
    (idx, wts)
}

#[cfg(test)]
mod tests {
    #[test]
    fn kept_text_rope_rows_give_the_tables_text_rope_tables_makes() {
        let (theta, rd, sec) = (10_000_000.0, 64, [11, 11, 10]);
        let mut cache = TextRopeCache::new(theta, rd, sec);
        let text = |p: Vec<i64>| -> [Vec<i64>; 3] { [p.clone(), p.clone(), p] };
        let cases: Vec<[Vec<i64>; 3]> = vec![
            text((0..300).collect()),                      // a prefix: borrowed rows
            text((5000..5073).collect()),                  // past the kept rows: they grow
            text((0..3).flat_map(|_| 300..373).collect()), // passes repeating their positions
            text(vec![7, 3, 3, 9000, 0]),                  // any text positions: gathered
            // An image's rows (H, W differ from T): not text, made per call.
            [vec![10, 11, 11, 12], vec![10, 11, 12, 12], vec![10, 12, 11, 12]],
            text(vec![]),
            text(vec![TextRopeCache::MAX_POSITIONS as i64, 1]), // past what is ever kept
        ];
        for (i, pos) in cases.iter().enumerate() {
            let (want_cos, want_sin) = text_rope_tables(pos, theta, rd, sec);
            let (cos, sin) = cache.tables(pos);
            let bits = |a: &[f32]| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&cos), bits(&want_cos), "case {i}: cos");
            assert_eq!(bits(&sin), bits(&want_sin), "case {i}: sin");
        }
        assert_eq!(cache.kept(), 16_384, "5,073 positions asked, grown to a power of two past 9,000");
        assert!(matches!(cache.tables(&text((10..20).collect())).0, std::borrow::Cow::Borrowed(_)));
    }

    use super::*;

    #[test]
    fn vision_rope_tables_equal_the_angles_computed_per_patch() {
        // Enough patches for the parallel fill, and a non-square grid (rows ≠ columns).
        let coords = patch_coords([1, 64, 96], 2);
        let (hd, theta) = (64, 10000.0);
        let (cos, sin) = vision_rope_tables(&coords, hd, theta);
        let inv = inv_freq(theta, hd / 2);
        let q = inv.len();
        for (p, &(r, c)) in coords.iter().enumerate() {
            for (i, f) in inv.iter().enumerate() {
                let (sr, cr) = (r as f32 * f).sin_cos();
                let (sc, cc) = (c as f32 * f).sin_cos();
                for o in [p * hd, p * hd + 2 * q] {
                    assert_eq!((cos[o + i], sin[o + i]), (cr, sr), "patch {p} row angle {i}");
                    assert_eq!((cos[o + q + i], sin[o + q + i]), (cc, sc), "patch {p} column angle {i}");
                }
            }
        }
    }

    #[test]
    fn spec_two_image_example() {
        // qwen35.md §4.2: 4 text tokens, a 32×48 grid, 2 text, a 20×20 grid, then text.
        let pad = 248056;
        let ids = [1, 2, 3, 248053, pad, 248054, 248053, pad, 248054, 7];
        let l = layout(&ids, pad, &[[1, 32, 48], [1, 20, 20]], 2, 0).unwrap();
        assert_eq!(l.images[0].1, 4..4 + 384);
        let e1 = 4 + 384;
        assert_eq!(l.positions[0][e1], 28); // <|vision_end|>
        assert_eq!(l.positions[0][e1 + 1], 29); // <|vision_start|>
        let s2 = e1 + 2;
        assert_eq!(l.images[1].1, s2..s2 + 100);
        assert_eq!((l.positions[0][s2], l.positions[1][s2 + 99], l.positions[2][s2 + 99]), (30, 39, 39));
        assert_eq!(l.positions[0][s2 + 100], 40);
        assert_eq!(l.positions[0][s2 + 101], 41);
        assert_eq!(l.next_pos, 42);
        // image 1 last token: row 15, col 23
        assert_eq!((l.positions[1][4 + 383], l.positions[2][4 + 383]), (4 + 15, 4 + 23));
    }

    #[test]
    fn pad_count_must_match() {
        assert!(layout(&[1, 248056], 248056, &[], 2, 0).is_err());
    }

    #[test]
    fn text_positions_continue_from_start() {
        let l = layout(&[5, 6, 7], 248056, &[], 2, 10).unwrap();
        assert_eq!(l.positions[2], vec![10, 11, 12]);
        assert_eq!(l.next_pos, 13);
    }

    #[test]
    fn rope_tables_of_repeated_positions_equal_row_by_row_ones() {
        // Prefix 0..5, two passes from 5, an image-like row, in a packed order; and all distinct.
        let t: Vec<i64> = [(0..5).collect::<Vec<_>>(), (5..9).collect(), vec![3], (5..9).collect()].concat();
        let mut h = t.clone();
        h[9] = 7;
        for pos in
            [[t.clone(), h.clone(), t.clone()], [(0..13).collect(), (0..13).collect(), (0..13).collect()]]
        {
            let (cos, sin) = text_rope_tables(&pos, 1e7, 64, [11, 11, 10]);
            for r in 0..pos[0].len() {
                let one = [vec![pos[0][r]], vec![pos[1][r]], vec![pos[2][r]]];
                let (c1, s1) = text_rope_tables(&one, 1e7, 64, [11, 11, 10]);
                assert_eq!(&cos[r * 64..(r + 1) * 64], &c1[..], "cos row {r}");
                assert_eq!(&sin[r * 64..(r + 1) * 64], &s1[..], "sin row {r}");
            }
        }
        let inv = inv_freq(1e7, 64);
        let (cos, _) = text_rope_tables(&[t.clone(), h.clone(), t.clone()], 1e7, 64, [11, 11, 10]);
        assert_eq!(cos[9 * 64 + 1], (7.0 * inv[1]).cos(), "row 9 reads its own H position");
        assert_eq!(cos[10 * 64 + 1], (5.0 * inv[1]).cos());
    }

    #[test]
    fn mrope_sections_pick_rows() {
        let pos = [vec![3], vec![5], vec![7]];
        let (cos, _) = text_rope_tables(&pos, 1e7, 64, [11, 11, 10]);
        let inv = inv_freq(1e7, 64);
        assert_eq!(cos[0], (3.0 * inv[0]).cos());
        assert_eq!(cos[1], (5.0 * inv[1]).cos());
        assert_eq!(cos[2], (7.0 * inv[2]).cos());
        assert_eq!(cos[30], (3.0 * inv[30]).cos()); // 30 % 3 == 0 → T
        assert_eq!(cos[31], (5.0 * inv[31]).cos()); // 31 < 33 → H
        assert_eq!(cos[32], cos[0]);
    }
}
