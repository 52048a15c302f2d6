//! Projections: a [`CudaLinear`] holds a projection's parts concatenated along the output dim,
//! one FP8 or BF16 cuBLASLt GEMM per run of equal format, an f32 bias and the LoRA pairs fused
//! into one unmerged BF16 pair; `matmul` runs them; `readout` is the f32 readout head.
//! Which format a part gets is decided in [`super::layout`] (no GPU needed); the GEMMs themselves
//! are [`super::gemm`]'s. Kernels: `add_bias`, `readout_f32` (kernels/elementwise.cu); CPU twin:
//! `matmul` / `readout` of src/backend/cpu/linear.rs.

use super::gemm::{Gemm, GemmKind};
use super::gemm_fp8::LoraEpilogue;
use super::launch::{grid1, launch_config, Arg};
use super::layout::{self, PartFormat, PartInfo};
use super::readback::CudaReadout;
use super::tensor::{bf16_values, ActFp8, CudaTensor};
use super::CudaBackend;
use crate::backend::LinearPart;
use crate::weights::fp8::{fp8_rows, quantize_fp8_blocks};
use crate::weights::{StoredDtype, TensorRef};
use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::atomic::Ordering;

enum GroupWeight {
    Bf16(CudaSlice<bf16>),
    Fp8 { w: CudaSlice<u8>, scales: CudaSlice<f32> },
}

struct LinearGroup {
    cols: Range<usize>,
    weight: GroupWeight,
}

/// The LoRA pairs of a projection's parts, fused into one pair: `a` stacks every part's A
/// (`[Σr, in]`), `b` is block-diagonal over the output columns `cols` (`[cols, Σr]`, part i's B
/// in its own rows and rank columns, exact zeros elsewhere), so two GEMMs serve all parts. Zeros
/// add nothing to the f32 sums, so each column's result is the unfused one.
pub(super) struct CudaLora {
    cols: Range<usize>,
    rank: usize,
    /// Each adapted part's output columns and rank, in order (its rank columns of `b` follow the
    /// previous parts').
    parts: Vec<(Range<usize>, usize)>,
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    scale: f32,
    /// For `gemm_fp8`'s epilogue: the FP8 group (index into the projection's groups) holding
    /// every adapted column, and its tiles' rank windows (`layout::lora_rank_windows`); None
    /// when no FP8 group holds them all or the kernel cannot take the ranks.
    epilogue: Option<(usize, CudaSlice<i32>)>,
    /// The same for the GLU form's tiles (`layout::lora_rank_windows_glu`), when the FP8 group of
    /// `epilogue` is the whole projection and whole 256-column blocks (an MLP's gate/up projection
    /// has this shape; `swiglu_project` is what uses it).
    glu_windows: Option<CudaSlice<i32>>,
}

/// What `gemm_fp8_glu_<rows>` reads of an MLP's gate/up projection: its one FP8 group's weights and
/// scales, and its LoRA pair with the GLU tiles' rank windows.
struct GluForm<'a> {
    w: &'a CudaSlice<u8>,
    scales: &'a CudaSlice<f32>,
    lora: Option<(&'a CudaLora, &'a CudaSlice<i32>)>,
}

/// A projection: its parts concatenated along the output dim and grouped into one FP8 or BF16
/// GEMM per run of equal format; bias in f32; LoRA pairs unmerged in BF16.
pub struct CudaLinear {
    pub(super) in_dim: usize,
    pub(super) out_dim: usize,
    groups: Vec<LinearGroup>,
    bias: Option<CudaSlice<f32>>,
    loras: Vec<CudaLora>,
}

impl CudaLinear {
    /// E.g. `fp8[0..12288] bf16[12288..12352] lora×2`.
    pub fn summary(&self) -> String {
        let mut s: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                let f = match g.weight {
                    GroupWeight::Bf16(_) => "bf16",
                    GroupWeight::Fp8 { .. } => "fp8",
                };
                format!("{f}[{}..{}]", g.cols.start, g.cols.end)
            })
            .collect();
        if !self.loras.is_empty() {
            s.push(format!("lora×{}", self.loras.iter().map(|l| l.parts.len()).sum::<usize>()));
        }
        s.join(" ")
    }
    /// Bytes of its device buffers: weights as kept (FP8 codes and scales, or BF16), the f32
    /// bias and the BF16 LoRA factors.
    pub fn bytes(&self) -> usize {
        let weights: usize = self
            .groups
            .iter()
            .map(|g| match &g.weight {
                GroupWeight::Bf16(w) => w.len() * std::mem::size_of::<bf16>(),
                GroupWeight::Fp8 { w, scales } => w.len() + scales.len() * std::mem::size_of::<f32>(),
            })
            .sum();
        let bias = self.bias.as_ref().map_or(0, |b| b.len() * std::mem::size_of::<f32>());
        let lora: usize =
            self.loras.iter().map(|l| (l.a.len() + l.b.len()) * std::mem::size_of::<bf16>()).sum();
        weights + bias + lora
    }
    /// Whether its LoRA pair can go to `gemm_fp8`'s epilogue (an FP8 group holds every adapted
    /// part and the kernel takes the ranks); used when that kernel runs the FP8 GEMMs (the Hopper default).
    pub fn lora_in_fp8_epilogue(&self) -> bool {
        self.loras.iter().any(|l| l.epilogue.is_some())
    }
    pub fn has_fp8(&self) -> bool {
        self.groups.iter().any(|g| matches!(g.weight, GroupWeight::Fp8 { .. }))
    }

    /// The rank per part of [`CudaLinear::swiglu_lora`] when this projection has that form (for
    /// tests and logs).
    pub fn swiglu_lora_rank(&self) -> Option<usize> {
        self.swiglu_lora().map(|(_, r)| r)
    }

    /// The LoRA pair of an MLP's fused gate/up projection in the form `swiglu_lora_quant_1x128_<r>`
    /// takes: one pair over all columns, of two parts (gate = the first half of the columns, up =
    /// the second) of equal rank `r` ([`layout::SWIGLU_LORA_RANKS`]). Returns it and `r`.
    pub(super) fn swiglu_lora(&self) -> Option<(&CudaLora, usize)> {
        let [l] = &self.loras[..] else { return None };
        layout::swiglu_lora_rank(&l.parts, &l.cols, self.out_dim).map(|r| (l, r))
    }
}

impl CudaLora {
    /// The LoRA scale the B side is multiplied by, and its fused B `[cols, rank]` (row-major).
    pub(super) fn b_side(&self) -> (f32, &CudaSlice<bf16>) {
        (self.scale, &self.b)
    }
}

fn check_2d(t: &TensorRef) -> Result<(usize, usize)> {
    match t.shape {
        [r, c] => Ok((*r, *c)),
        s => bail!("{} must be 2-D, has shape {s:?}", t.name),
    }
}

/// FP8 bytes + `[out/128][in/128]` multipliers of one part: the checkpoint's own when they are
/// 128×128 blocks, else the RTN recipe applied to its values (in 128-row stripes, in parallel;
/// blocks are independent so this equals `quantize_fp8_blocks` on the whole matrix).
fn fp8_part(t: &TensorRef) -> Result<(Vec<u8>, Vec<f32>)> {
    let (o, i) = check_2d(t)?;
    if t.dtype == StoredDtype::F8E4M3 && scales_are_128(t) {
        let s = t.scale_inv.expect("checked");
        let scales = s.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        return Ok((t.bytes.to_vec(), scales));
    }
    let w = t.to_f32()?;
    let stripes: Vec<(Vec<u8>, Vec<f32>)> =
        w.par_chunks(128 * i).map(|s| quantize_fp8_blocks(s, s.len() / i, i)).collect();
    let mut q = Vec::with_capacity(o * i);
    let mut sc = Vec::with_capacity(o / 128 * (i / 128));
    for (a, b) in stripes {
        q.extend(a);
        sc.extend(b);
    }
    Ok((q, sc))
}

fn scales_are_128(t: &TensorRef) -> bool {
    match (t.scale_inv, t.shape) {
        (Some(s), [o, i]) => {
            s.shape == [o / 128, i / 128]
                && o % 128 == 0
                && i % 128 == 0
                && s.block.is_none_or(|b| b == [128, 128])
        }
        _ => false,
    }
}

impl CudaBackend {
    /// The GEMMs of `matmul` (FP8 and BF16 groups, bias, LoRA) on the BF16 input `xs` `[m, k]`
    /// and, when the projection has FP8 groups, its quantisation (what `quantize` makes from
    /// `xs`).
    pub(super) fn matmul_quantised(
        &self,
        xs: &CudaSlice<bf16>,
        fp8: Option<&ActFp8>,
        m: usize,
        k: usize,
        w: &CudaLinear,
    ) -> Result<CudaTensor> {
        // With gemm_fp8, a pair inside an FP8 group goes to that GEMM's epilogue: its A side first.
        let epi = w.loras.iter().find(|l| l.epilogue.is_some()).filter(|_| m > 0 && self.own_fp8_gemm());
        let t = epi.map(|l| self.lora_a(xs, m, k, l)).transpose()?;
        let (y, fused) = self.project(xs, fp8, m, k, w, epi.zip(t.as_ref()))?;
        if let (Some(l), Some(t)) = (epi, &t) {
            if !fused {
                self.lora_b(&y, w.out_dim, m, l, t)?;
            }
        }
        self.add_loras(&y, xs, m, k, w, epi)?;
        Ok(self.bf16_tensor(y, &[m, w.out_dim]))
    }

    /// `y += scale · (x·Aᵀ)·Bᵀ` for each LoRA pair of `w` but `except` (two GEMMs each).
    fn add_loras(
        &self,
        y: &CudaSlice<bf16>,
        xs: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaLinear,
        except: Option<&CudaLora>,
    ) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        for l in w.loras.iter().filter(|l| !except.is_some_and(|e| std::ptr::eq(*l, e))) {
            let t = self.lora_a(xs, m, k, l)?;
            self.lora_b(y, w.out_dim, m, l, &t)?;
        }
        Ok(())
    }

    /// The FP8 and BF16 GEMMs and the bias of a projection, without its LoRA: `[rows, out_dim]`
    /// (rows: the FP8 padded row count when there are FP8 groups, else `m`). `epilogue`: a pair
    /// with its A side's product `t`, for `gemm_fp8`'s epilogue on its FP8 group; returns whether
    /// that GEMM took it (else the caller adds its B side).
    fn project(
        &self,
        xs: &CudaSlice<bf16>,
        fp8: Option<&ActFp8>,
        m: usize,
        k: usize,
        w: &CudaLinear,
        epilogue: Option<(&CudaLora, &CudaSlice<bf16>)>,
    ) -> Result<(CudaSlice<bf16>, bool)> {
        let n = w.out_dim;
        let rows_alloc = fp8.map(|f| f.mpad).unwrap_or(m);
        let y = self.alloc_bf16(rows_alloc * n)?;
        let yp = self.p(&y);
        let mut fused = false;
        // A one-group projection's bias goes to gemm_fp8's epilogue when that kernel runs it (the
        // vision tower's projections); otherwise add_bias8 adds it to the output below.
        let epilogue_bias = match &w.bias {
            Some(b) if w.groups.len() == 1 => self.p(b),
            _ => 0,
        };
        let mut bias_added = false;
        for (gi, g) in w.groups.iter().enumerate() {
            let yg = yp + 2 * g.cols.start as u64;
            let gemm = match &g.weight {
                GroupWeight::Fp8 { w: wq, scales } => self.fp8_gemm_of(
                    wq,
                    scales,
                    fp8.expect("quantised by the caller"),
                    g.cols.len(),
                    k,
                    yg,
                    n,
                ),
                GroupWeight::Bf16(wb) => Gemm {
                    kind: GemmKind::Bf16,
                    n: g.cols.len(),
                    m,
                    k,
                    w: self.p(wb),
                    ldw: k,
                    x: self.p(xs),
                    ldx: k,
                    y: yg,
                    ldy: n,
                    alpha: 1.0,
                    beta: 0.0,
                    w_scale: 0,
                    x_scale: 0,
                },
            };
            let lora = epilogue.and_then(|(l, t)| match &l.epilogue {
                Some((eg, windows)) if *eg == gi => Some(self.lora_epilogue(l, t, m, g.cols.start, windows)),
                _ => None,
            });
            let own = matches!(g.weight, GroupWeight::Fp8 { .. })
                && self.gemm_fp8(&gemm, lora.as_ref(), epilogue_bias)?;
            fused |= own && lora.is_some();
            bias_added |= own && epilogue_bias != 0;
            if !own {
                self.gemm(&gemm).with_context(|| format!("{:?} GEMM N={} K={k} M={m}", gemm.kind, gemm.n))?;
            }
        }
        if let Some(b) = w.bias.as_ref().filter(|_| !bias_added) {
            let args = [Arg::Ptr(yp), Arg::Ptr(self.p(b)), Arg::I64(m as i64), Arg::I32(n as i32)];
            if m > 0 && n % 8 == 0 && yp % 16 == 0 {
                // 128 threads of 8 columns across, row blocks down: ~2K blocks in all.
                let across = grid1(n / 8, 128);
                let down = (m as u32).clamp(1, (2048 / across).max(1));
                self.launch("add_bias8", launch_config((across, down, 1), 128, 0), &args)?;
            } else if m > 0 {
                self.launch("add_bias", launch_config((grid1(m * n, 256), 1, 1), 256, 0), &args)?;
            }
        }
        Ok((y, fused))
    }

    /// The block-scaled FP8 GEMM of an FP8 group (`wq`, `scales`: `n` rows of `k`) over the
    /// quantised input `a` (all its padded rows), into `y` with row stride `ldy`.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_of(
        &self,
        wq: &CudaSlice<u8>,
        scales: &CudaSlice<f32>,
        a: &ActFp8,
        n: usize,
        k: usize,
        y: u64,
        ldy: usize,
    ) -> Gemm {
        Gemm {
            kind: GemmKind::Fp8Block,
            n,
            m: a.mpad,
            k,
            w: self.p(wq),
            ldw: k,
            x: self.p(&a.q),
            ldx: k,
            y,
            ldy,
            alpha: 1.0,
            beta: 0.0,
            w_scale: self.p(scales),
            x_scale: self.p(&a.s),
        }
    }

    /// What `gemm_fp8`'s epilogue reads of pair `l` over a group starting at output column
    /// `group_col0`: its A side's product `t` (`m` rows), B, and the tiles' rank `windows`.
    fn lora_epilogue(
        &self,
        l: &CudaLora,
        t: &CudaSlice<bf16>,
        m: usize,
        group_col0: usize,
        windows: &CudaSlice<i32>,
    ) -> LoraEpilogue {
        LoraEpilogue {
            t: self.p(t),
            rows: m,
            b: self.p(&l.b),
            rank: l.rank,
            col0: l.cols.start - group_col0,
            cols: l.cols.len(),
            windows: self.p(windows),
            scale: l.scale,
        }
    }

    /// The MLP's gate/up projection `w` of `x` with the SwiGLU and the down projection's FP8 input
    /// in its epilogue (`gemm_fp8_glu_<rows>`, [`CudaBackend::gemm_fp8_glu`]): returns
    /// `h = silu(gate)·up` `[rows, out_dim / 2]` in BF16 (rows: the FP8 padded row count; the down
    /// projection's LoRA A side reads its first `m`) and its quantisation, the bits
    /// `matmul` + `swiglu_quant_1x128` give; or None (nothing launched) when the form cannot take
    /// `w`: not one FP8 group over all columns, a bias, a LoRA pair outside that group's
    /// epilogue, a width that is not whole 256-column blocks, or the kernel off.
    pub(super) fn swiglu_project(
        &self,
        x: &CudaTensor,
        w: &CudaLinear,
    ) -> Result<Option<(CudaSlice<bf16>, ActFp8)>> {
        let (m, k) = x.rows_cols();
        let Some(GluForm { w: wq, scales, lora }) = self.glu_form(w).filter(|_| m > 0 && k == w.in_dim)
        else {
            return Ok(None);
        };
        let h = w.out_dim / 2;
        let xs = self.bf16_of(x)?;
        with_input_fp8(self, x, xs.s(), w, |fp8| {
            let a = fp8.expect("an FP8 projection's input is quantised");
            let t = lora.map(|(l, _)| self.lora_a(xs.s(), m, k, l)).transpose()?;
            let epilogue =
                lora.zip(t.as_ref()).map(|((l, windows), t)| self.lora_epilogue(l, t, m, 0, windows));
            let y = self.alloc_bf16(a.mpad * h)?;
            let q = self.alloc_act_fp8(m, h)?;
            let gemm = self.fp8_gemm_of(wq, scales, a, w.out_dim, k, self.p(&y), h);
            Ok(self.gemm_fp8_glu(&gemm, epilogue.as_ref(), &q)?.then_some((y, q)))
        })
    }

    /// Whether [`CudaBackend::swiglu_project`] runs the MLP whose gate/up projection is `w` (for
    /// tests and logs).
    pub fn swiglu_epilogue_takes(&self, w: &CudaLinear) -> bool {
        self.glu_form(w).is_some()
    }

    /// What the GLU form reads of `w`, or None when it cannot run `w` (see `swiglu_project`).
    fn glu_form<'a>(&self, w: &'a CudaLinear) -> Option<GluForm<'a>> {
        let [g] = &w.groups[..] else { return None };
        let GroupWeight::Fp8 { w: wq, scales } = &g.weight else { return None };
        let lora = match &w.loras[..] {
            [] => None,
            [l] => Some((l, l.glu_windows.as_ref()?)),
            _ => return None,
        };
        let takes = self.own_fp8_gemm()
            && self.state.options.swiglu_epilogue
            && w.bias.is_none()
            && g.cols == (0..w.out_dim)
            && w.out_dim % 256 == 0;
        takes.then_some(GluForm { w: wq, scales, lora })
    }

    /// A LoRA pair's A side: `x·Aᵀ` `[m, rank]` in BF16 (`gemm.lora_a`).
    pub(super) fn lora_a(
        &self,
        xs: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        l: &CudaLora,
    ) -> Result<CudaSlice<bf16>> {
        let t = self.alloc_bf16(m * l.rank)?;
        let g = Gemm {
            kind: GemmKind::Bf16,
            n: l.rank,
            m,
            k,
            w: self.p(&l.a),
            ldw: k,
            x: self.p(xs),
            ldx: k,
            y: self.p(&t),
            ldy: l.rank,
            alpha: 1.0,
            beta: 0.0,
            w_scale: 0,
            x_scale: 0,
        };
        if !self.gemm_bf16_own(&g).context("LoRA A GEMM (own kernel)")? {
            self.gemm_named(&g, "gemm.lora_a").context("LoRA A GEMM")?;
        }
        Ok(t)
    }

    /// A LoRA pair's B side: `y[:, cols] += scale · t·Bᵀ` on `y` `[m, n]` (`gemm.lora_b`: a BF16
    /// GEMM accumulating, β = 1).
    fn lora_b(
        &self,
        y: &CudaSlice<bf16>,
        n: usize,
        m: usize,
        l: &CudaLora,
        t: &CudaSlice<bf16>,
    ) -> Result<()> {
        let g = Gemm {
            kind: GemmKind::Bf16,
            n: l.cols.len(),
            m,
            k: l.rank,
            w: self.p(&l.b),
            ldw: l.rank,
            x: self.p(t),
            ldx: l.rank,
            y: self.p(y) + 2 * l.cols.start as u64,
            ldy: n,
            alpha: l.scale,
            beta: 1.0,
            w_scale: 0,
            x_scale: 0,
        };
        self.gemm_named(&g, "gemm.lora_b").context("LoRA B GEMM")
    }
}

/// `Backend::linear` (the trait documents the contract).
pub(super) fn linear(be: &CudaBackend, parts: &[LinearPart]) -> Result<CudaLinear> {
    ensure!(!parts.is_empty(), "a projection needs at least one block");
    let in_dim = check_2d(&parts[0].weight)?.1;
    let mut formats = Vec::with_capacity(parts.len());
    for p in parts {
        let (o, i) = check_2d(&p.weight)?;
        ensure!(i == in_dim, "{} has {} inputs, expected {}", p.weight.name, i, in_dim);
        let info =
            PartInfo { dtype: p.weight.dtype, out: o, inp: i, scales_are_128x128: scales_are_128(&p.weight) };
        formats.push((
            layout::part_format(&info, be.state.options.quantize_fp8, be.state.options.dequantize_fp8),
            o,
        ));
    }
    let out_dim: usize = formats.iter().map(|f| f.1).sum();
    let mut groups = Vec::new();
    for g in layout::group_parts(&formats) {
        let weight = match g.format {
            PartFormat::Fp8 => {
                let mut q = Vec::with_capacity(g.cols.len() * in_dim);
                let mut s = Vec::new();
                for p in &parts[g.parts.clone()] {
                    let (a, b) =
                        fp8_part(&p.weight).with_context(|| format!("FP8 weights of {}", p.weight.name))?;
                    q.extend(a);
                    s.extend(b);
                }
                GroupWeight::Fp8 { w: be.htod(&q)?, scales: be.htod(&s)? }
            }
            PartFormat::Bf16 => {
                let mut w = Vec::with_capacity(g.cols.len() * in_dim);
                for p in &parts[g.parts.clone()] {
                    w.extend(bf16_values(&p.weight)?);
                }
                GroupWeight::Bf16(be.htod(&w)?)
            }
        };
        groups.push(LinearGroup { cols: g.cols, weight });
    }
    let mut bias = None;
    if parts.iter().any(|p| p.bias.is_some()) {
        let mut b = Vec::with_capacity(out_dim);
        for p in parts {
            let o = p.weight.shape[0];
            match &p.bias {
                Some(t) => {
                    ensure!(t.shape == [o], "{} must have shape [{o}]", t.name);
                    b.extend(t.to_f32()?);
                }
                None => b.extend(std::iter::repeat_n(0f32, o)),
            }
        }
        bias = Some(be.htod(&b)?);
    }
    // (columns, A [r, in], B [out, r], scale) of every adapted part, fused into one pair.
    let mut found = Vec::new();
    let mut col = 0;
    for p in parts {
        let o = p.weight.shape[0];
        if let Some(l) = &p.lora {
            let (r, ai) = check_2d(&l.a)?;
            let (bo, br) = check_2d(&l.b)?;
            ensure!(
                ai == in_dim && bo == o && br == r,
                "LoRA {} / {} shapes do not fit {}",
                l.a.name,
                l.b.name,
                p.weight.name
            );
            found.push((col..col + o, bf16_values(&l.a)?, l.b.to_f32()?, r, l.scale));
        }
        col += o;
    }
    let mut loras = Vec::new();
    if !found.is_empty() {
        let span = found[0].0.start..found[found.len() - 1].0.end;
        let rank: usize = found.iter().map(|f| f.3).sum();
        // One GEMM scale when the parts agree (PEFT: alpha/r per module), else folded into B.
        let common = found[0].4;
        let same = found.iter().all(|f| f.4 == common);
        let mut a = Vec::with_capacity(rank * in_dim);
        let mut b = vec![bf16::ZERO; span.len() * rank];
        let mut r0 = 0;
        for (cols, fa, fb, r, scale) in &found {
            a.extend_from_slice(fa);
            let k = if same { 1.0 } else { *scale };
            for (i, row) in fb.chunks_exact(*r).enumerate() {
                let dst = (cols.start - span.start + i) * rank + r0;
                for (j, v) in row.iter().enumerate() {
                    b[dst + j] = bf16::from_f32(v * k);
                }
            }
            r0 += r;
        }
        let parts: Vec<(Range<usize>, usize)> = found.iter().map(|f| (f.0.clone(), f.3)).collect();
        let epilogue = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| matches!(g.weight, GroupWeight::Fp8 { .. }))
            .find_map(|(gi, g)| layout::lora_rank_windows(&parts, &g.cols).map(|w| (gi, w)));
        let glu_windows = match &epilogue {
            Some((gi, _)) if groups[*gi].cols == (0..out_dim) => {
                layout::lora_rank_windows_glu(&parts, &groups[*gi].cols).map(|w| be.htod(&w)).transpose()?
            }
            _ => None,
        };
        let epilogue = epilogue.map(|(gi, w)| be.htod(&w).map(|w| (gi, w))).transpose()?;
        loras.push(CudaLora {
            cols: span,
            rank,
            parts,
            a: be.htod(&a)?,
            b: be.htod(&b)?,
            scale: if same { common } else { 1.0 },
            epilogue,
            glu_windows,
        });
    }
    let linear = CudaLinear { in_dim, out_dim, groups, bias, loras };
    if linear.has_fp8() {
        be.state.fp8_linears.store(true, Ordering::Relaxed);
    }
    Ok(linear)
}

/// `Backend::matmul` (the trait documents the contract).
pub(super) fn matmul(be: &CudaBackend, x: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
    let (m, k) = x.rows_cols();
    ensure!(k == w.in_dim, "matmul: input width {k}, projection expects {}", w.in_dim);
    let xs = be.bf16_of(x)?;
    with_input_fp8(be, x, xs.s(), w, |fp8| be.matmul_quantised(xs.s(), fp8, m, k, w))
}

/// [`matmul`] with the LoRA B side of `lora` (one of `w`'s pairs) left to the caller: the
/// projection's GEMMs and bias, and `lora`'s A side `x·Aᵀ` `[m, rank]`. The consumer adds
/// `scale · t·Bᵀ` where it reads the output (quant.rs `swiglu_mlp`); `w`'s other pairs, if any,
/// are applied here.
pub(super) fn matmul_deferring_lora(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &CudaLinear,
    lora: &CudaLora,
) -> Result<(CudaTensor, CudaSlice<bf16>)> {
    let (m, k) = x.rows_cols();
    ensure!(k == w.in_dim, "matmul: input width {k}, projection expects {}", w.in_dim);
    let xs = be.bf16_of(x)?;
    let (y, _) = with_input_fp8(be, x, xs.s(), w, |fp8| be.project(xs.s(), fp8, m, k, w, None))?;
    be.add_loras(&y, xs.s(), m, k, w, Some(lora))?;
    let t = be.lora_a(xs.s(), m, k, lora)?;
    Ok((be.bf16_tensor(y, &[m, w.out_dim]), t))
}

/// Runs `f` with the FP8 quantisation of `x` a projection with FP8 groups reads: the one a fused
/// norm attached to `x`, else `quant_act_1x128` of it (the same bits); None for BF16-only
/// projections and empty inputs.
fn with_input_fp8<R>(
    be: &CudaBackend,
    x: &CudaTensor,
    xs: &CudaSlice<bf16>,
    w: &CudaLinear,
    f: impl FnOnce(Option<&ActFp8>) -> Result<R>,
) -> Result<R> {
    let (m, k) = x.rows_cols();
    if !w.has_fp8() || m == 0 {
        return f(None);
    }
    match &x.fp8 {
        Some(a) => {
            ensure!(a.mpad == fp8_rows(m), "attached FP8 activations of another row count");
            f(Some(a))
        }
        None => f(Some(&be.quantize(xs, m, k)?)),
    }
}

/// `Backend::readout_start` (the trait documents the contract): the f32 product on the device,
/// then its copy to the host queued behind it ([`super::readback`]).
pub(super) fn readout_start(be: &CudaBackend, h: &CudaTensor, w: &CudaTensor) -> Result<CudaReadout> {
    let (m, k) = h.rows_cols();
    let (rows, wk) = w.rows_cols();
    ensure!(k == wk, "readout: hidden {k} vs weight width {wk}");
    if m * rows == 0 {
        return Ok(be.readback_empty());
    }
    let (hs, ws) = (be.bf16_of(h)?, be.f32_of(w)?);
    let y = be.alloc_f32(m * rows)?;
    be.launch(
        "readout_f32",
        launch_config((grid1(m * rows * 32, 256), 1, 1), 256, 0),
        &[
            Arg::Ptr(be.p(hs.s())),
            Arg::Ptr(be.p(ws.s())),
            Arg::Ptr(be.p(&y)),
            Arg::I32(m as i32),
            Arg::I32(rows as i32),
            Arg::I32(k as i32),
        ],
    )?;
    be.readback_start(&y, m * rows)
}
