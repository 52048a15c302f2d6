//! Host-side bookkeeping of the CUDA backend that needs no GPU: the CPU twin of the FP8
//! activation quantiser and its scale layout, how a fused projection's parts map to FP8 and BF16
//! GEMMs, the delta-rule chunk table, KV-cache growth, and the NVRTC target name. All of it is
//! unit-tested on CPU-only machines; the kernels that consume these layouts are tested on the GPU
//! (`tests/gpu.rs`).

use crate::engine::weights::StoredDtype;
use std::ops::Range;

/// Side of a block-FP8 scale block (1×128 for activations, 128×128 for weights).
pub const FP8_BLOCK: usize = 128;
/// Largest finite E4M3 value.
pub const FP8_MAX: f32 = 448.0;
/// FP8 GEMMs run on a row count padded to this multiple (pad rows are zero with scale 1).
pub const FP8_ROW_ALIGN: usize = 16;
/// Tokens per chunk of the chunked gated delta rule (the kernels are written for 64).
pub const DELTA_CHUNK: usize = 64;

/// Rows an FP8 GEMM with `m` activation rows is run on.
pub fn fp8_rows(m: usize) -> usize {
    m.div_ceil(FP8_ROW_ALIGN).max(1) * FP8_ROW_ALIGN
}

/// Index of the scale of activation row `m`, 128-block `kb`, in the `[K/128][mpad]` layout that
/// cuBLASLt's `VEC128_32F` B-scale mode reads (rows contiguous per k-block).
#[inline]
pub fn act_scale_index(m: usize, kb: usize, mpad: usize) -> usize {
    kb * mpad + m
}

/// CPU twin of `quant_act_1x128` (kernels/quant.cu): per row and 128-wide block,
/// `s = max|x| / 448` (1 for an all-zero block), `q = e4m3(x / s)` round-to-nearest-even.
/// `x` is `[m, k]` (already bf16-representable values); returns `q` `[mpad, k]` and the scales
/// `[k/128][mpad]`, with `mpad = fp8_rows(m)` and zero pad rows.
pub fn quantize_act_1x128(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), m * k);
    assert_eq!(k % FP8_BLOCK, 0, "K must be a multiple of 128");
    let mpad = fp8_rows(m);
    let kb_n = k / FP8_BLOCK;
    let mut q = vec![0u8; mpad * k];
    let mut s = vec![1f32; kb_n * mpad];
    for r in 0..m {
        for kb in 0..kb_n {
            let blk = &x[r * k + kb * FP8_BLOCK..r * k + (kb + 1) * FP8_BLOCK];
            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sc = if amax > 0.0 { amax / FP8_MAX } else { 1.0 };
            s[act_scale_index(r, kb, mpad)] = sc;
            for (j, &v) in blk.iter().enumerate() {
                q[r * k + kb * FP8_BLOCK + j] = float8::F8E4M3::from_f32(v / sc).to_bits();
            }
        }
    }
    (q, s)
}

/// `x[r, c] = e4m3(q[r, c]) · s[c/128][r]` for the first `m` rows.
pub fn dequantize_act_1x128(q: &[u8], s: &[f32], m: usize, mpad: usize, k: usize) -> Vec<f32> {
    let lut = crate::engine::weights::fp8_e4m3_table();
    let mut out = vec![0f32; m * k];
    for r in 0..m {
        for c in 0..k {
            out[r * k + c] =
                lut[q[r * k + c] as usize] * s[act_scale_index(r, c / FP8_BLOCK, mpad)];
        }
    }
    out
}

/// How one row block of a projection is stored on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartFormat {
    /// E4M3 with `[out/128][in/128]` f32 multipliers; block-scaled cuBLASLt GEMM.
    Fp8,
    /// BF16; BF16 cuBLASLt GEMM with f32 accumulation.
    Bf16,
}

/// What a checkpoint tensor looks like, for choosing its GPU format.
#[derive(Debug, Clone, Copy)]
pub struct PartInfo {
    pub dtype: StoredDtype,
    pub out: usize,
    pub inp: usize,
    /// For an FP8 tensor: its scale grid is exactly `[out/128, in/128]` with 128×128 blocks.
    pub scales_are_128x128: bool,
}

/// FP8 checkpoint weights with 128×128 scales stay FP8; with `quantize`, other weights whose dims
/// are multiples of 128 are quantised at load; everything else (ragged dims such as in_proj_a/b
/// or small test models, FP8 tensors with other block sizes) is BF16.
/// With `dequantize`, everything is BF16 (FP8 checkpoints dequantised at load).
pub fn part_format(p: &PartInfo, quantize: bool, dequantize: bool) -> PartFormat {
    let aligned = p.out % FP8_BLOCK == 0 && p.inp % FP8_BLOCK == 0 && p.out > 0 && p.inp > 0;
    match p.dtype {
        _ if dequantize => PartFormat::Bf16,
        StoredDtype::F8E4M3 if aligned && p.scales_are_128x128 => PartFormat::Fp8,
        _ if aligned && quantize => PartFormat::Fp8,
        _ => PartFormat::Bf16,
    }
}

/// A run of consecutive parts with the same format, computed by one GEMM into output columns
/// `cols` (the projection's parts are concatenated along the output dim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartGroup {
    pub format: PartFormat,
    pub parts: Range<usize>,
    pub cols: Range<usize>,
}

/// Groups consecutive parts of equal format. `parts[i] = (format, out_i)`.
pub fn group_parts(parts: &[(PartFormat, usize)]) -> Vec<PartGroup> {
    let mut groups: Vec<PartGroup> = Vec::new();
    let mut col = 0;
    for (i, &(f, out)) in parts.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if g.format == f => {
                g.parts.end = i + 1;
                g.cols.end = col + out;
            }
            _ => groups.push(PartGroup {
                format: f,
                parts: i..i + 1,
                cols: col..col + out,
            }),
        }
        col += out;
    }
    groups
}

/// Chunks of the delta rule for a packed batch: `chunks` holds `[row_start, len]` pairs (chunks
/// start at each sequence's first row and never cross sequences), `per_segment[s]` is
/// `(first chunk, chunk count)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkTable {
    pub chunks: Vec<i32>,
    pub per_segment: Vec<(usize, usize)>,
}

impl ChunkTable {
    pub fn len(&self) -> usize {
        self.chunks.len() / 2
    }
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

pub fn chunk_table(segments: &[Range<usize>], chunk: usize) -> ChunkTable {
    let mut chunks = Vec::new();
    let mut per_segment = Vec::with_capacity(segments.len());
    for seg in segments {
        let first = chunks.len() / 2;
        let mut start = seg.start;
        while start < seg.end {
            let len = chunk.min(seg.end - start);
            chunks.push(start as i32);
            chunks.push(len as i32);
            start += len;
        }
        per_segment.push((first, chunks.len() / 2 - first));
    }
    ChunkTable {
        chunks,
        per_segment,
    }
}

/// Capacity (rows) of a KV cache that holds `current` rows and must hold `needed`: at least 1.5×
/// the old capacity (amortised O(1) appends), rounded up to 256 rows.
pub fn kv_capacity(current: usize, needed: usize) -> usize {
    let want = needed.max(current + current / 2).max(1);
    want.div_ceil(256) * 256
}

/// The NVRTC `--gpu-architecture` for a compute capability: `sm_90a` on Hopper (the arch-specific
/// target that also enables wgmma/setmaxnreg), `sm_XY` elsewhere.
pub fn gpu_arch(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// The padded head dim the attention kernel is instantiated for (`attn_fwd_<HDP>`).
pub fn attention_head_dim(hd: usize) -> Option<usize> {
    [16, 32, 64, 128, 256].into_iter().find(|&p| hd <= p)
}

/// Dynamic shared memory of `attn_fwd_<hdp>`: Q, K and V tiles of 64 rows, row stride hdp + 8.
pub fn attention_smem_bytes(hdp: usize) -> usize {
    3 * 64 * (hdp + 8) * 2
}

/// Dynamic shared memory of `gdn_chunk_scan_tc_<dk>` (kernels/deltanet.cu): k [dk][68], q [dk][68]
/// reused for T and P [2][64][68], S [dk][40], R and Vn [64][40], gamma, beta, decay factors [64].
pub fn delta_tc_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (dk * (c + 4) + (dk * (c + 4)).max(2 * c * (c + 4)) + dk * 40 + 2 * c * 40 + 3 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_prep_<dk>` and `gdn_chunk_scan_<dk>` (kernels/deltanet.cu).
pub fn delta_smem_bytes(dk: usize) -> (usize, usize) {
    let c = DELTA_CHUNK;
    // prep: max(q and k staged [dk][68], A of two value heads [2][64][65]) + gamma, beta [2][64] each.
    let prep = ((2 * dk * (c + 4)).max(2 * c * (c + 1)) + 4 * c) * 4;
    // scan: k [dk][68], q [dk][68] reused for T and P [2][64][64], S [dk][32], R and Vn [64][32],
    // gamma, beta, decay factors [64].
    let scan = (dk * (c + 4) + (dk * (c + 4)).max(2 * c * c) + dk * 32 + 2 * c * 32 + 3 * c) * 4;
    (prep, scan)
}

/// Largest power of two (≤ 256) dividing a device address: the alignment cuBLASLt is told about.
pub fn ptr_alignment(addr: u64) -> u32 {
    if addr == 0 {
        return 256;
    }
    (1u64 << addr.trailing_zeros().min(8)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rows_pad_to_sixteen() {
        assert_eq!(fp8_rows(0), 16);
        assert_eq!(fp8_rows(1), 16);
        assert_eq!(fp8_rows(16), 16);
        assert_eq!(fp8_rows(17), 32);
        assert_eq!(fp8_rows(1000), 1008);
    }

    #[test]
    fn activation_scales_are_k_block_major() {
        // Row r, block kb lives at kb·mpad + r: all rows of one k-block are contiguous.
        let (m, k) = (3, 256);
        let mpad = fp8_rows(m);
        let mut x = vec![0f32; m * k];
        for r in 0..m {
            for c in 0..k {
                // A different magnitude in every (row, block), so a transposed read would be wrong.
                x[r * k + c] = (1 + r * 2 + c / 128) as f32 * if c % 2 == 0 { 1.0 } else { -0.5 };
            }
        }
        let (q, s) = quantize_act_1x128(&x, m, k);
        assert_eq!(s.len(), 2 * mpad);
        for r in 0..m {
            for kb in 0..2 {
                let want = (1 + r * 2 + kb) as f32 / FP8_MAX;
                assert_eq!(s[kb * mpad + r], want, "scale of row {r} block {kb}");
            }
        }
        // Pad rows: zero bytes, unit scale.
        assert!(q[m * k..].iter().all(|&b| b == 0));
        assert!((m..mpad).all(|r| s[r] == 1.0 && s[mpad + r] == 1.0));
        // Each block's largest value maps to ±448 exactly.
        let back = dequantize_act_1x128(&q, &s, m, mpad, k);
        for r in 0..m {
            for c in [0, 128] {
                assert_eq!(q[r * k + c], float8::F8E4M3::from_f32(448.0).to_bits());
                assert!((back[r * k + c] - x[r * k + c]).abs() <= 1e-6 * x[r * k + c].abs());
            }
        }
    }

    #[test]
    fn activation_quantisation_error_is_e4m3_sized() {
        let (m, k) = (5, 384);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 << (i % 5)) as f32)
            .collect();
        let (q, s) = quantize_act_1x128(&x, m, k);
        let back = dequantize_act_1x128(&q, &s, m, fp8_rows(m), k);
        for r in 0..m {
            for kb in 0..k / 128 {
                let blk = r * k + kb * 128..r * k + (kb + 1) * 128;
                let amax = x[blk.clone()].iter().fold(0f32, |a, v| a.max(v.abs()));
                for i in blk {
                    // 3 mantissa bits: half an ulp is ≤ 1/16 relative, plus subnormal spacing near 0.
                    let tol = x[i].abs() / 16.0 + amax / 448.0 * 2f32.powi(-9);
                    assert!(
                        (back[i] - x[i]).abs() <= tol * 1.0001,
                        "x {} back {}",
                        x[i],
                        back[i]
                    );
                }
            }
        }
    }

    #[test]
    fn zero_block_gets_unit_scale() {
        let (q, s) = quantize_act_1x128(&[0f32; 128], 1, 128);
        assert!(q.iter().all(|&b| b == 0));
        assert_eq!(s[0], 1.0);
    }

    #[test]
    fn formats_follow_dtype_alignment_and_option() {
        let p = |dtype, out, inp, sc| PartInfo {
            dtype,
            out,
            inp,
            scales_are_128x128: sc,
        };
        use StoredDtype::*;
        assert_eq!(
            part_format(&p(F8E4M3, 8192, 2560, true), false, false),
            PartFormat::Fp8
        );
        assert_eq!(
            part_format(&p(F8E4M3, 8192, 2560, false), false, false),
            PartFormat::Bf16
        );
        assert_eq!(
            part_format(&p(F8E4M3, 32, 2560, true), false, false),
            PartFormat::Bf16
        );
        assert_eq!(
            part_format(&p(BF16, 8192, 2560, false), false, false),
            PartFormat::Bf16
        );
        assert_eq!(
            part_format(&p(BF16, 8192, 2560, false), true, false),
            PartFormat::Fp8
        );
        assert_eq!(
            part_format(&p(F32, 32, 2560, false), true, false),
            PartFormat::Bf16
        );
        assert_eq!(part_format(&p(BF16, 64, 64, false), true, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(F8E4M3, 8192, 2560, true), false, true), PartFormat::Bf16);
    }

    #[test]
    fn parts_group_by_format_in_order() {
        use PartFormat::*;
        // Qwen3.5-4B in_proj: qkv 8192 (fp8) + z 4096 (fp8) + b 32 + a 32 (bf16).
        let g = group_parts(&[(Fp8, 8192), (Fp8, 4096), (Bf16, 32), (Bf16, 32)]);
        assert_eq!(
            g,
            vec![
                PartGroup {
                    format: Fp8,
                    parts: 0..2,
                    cols: 0..12288
                },
                PartGroup {
                    format: Bf16,
                    parts: 2..4,
                    cols: 12288..12352
                },
            ]
        );
        let g = group_parts(&[(Bf16, 10), (Fp8, 128), (Bf16, 5)]);
        assert_eq!(g.len(), 3);
        assert_eq!(g[2].cols, 138..143);
        assert!(group_parts(&[]).is_empty());
    }

    #[test]
    fn chunk_table_splits_each_sequence() {
        let t = chunk_table(&[0..130, 130..131, 131..131, 131..195], 64);
        assert_eq!(t.chunks, vec![0, 64, 64, 64, 128, 2, 130, 1, 131, 64]);
        assert_eq!(t.per_segment, vec![(0, 3), (3, 1), (4, 0), (4, 1)]);
        assert_eq!(t.len(), 5);
    }

    #[test]
    fn kv_capacity_grows_geometrically() {
        assert_eq!(kv_capacity(0, 1), 256);
        assert_eq!(kv_capacity(0, 3000), 3072);
        assert_eq!(kv_capacity(3072, 3073), 4608);
        assert_eq!(kv_capacity(256, 10_000), 10_240);
        // Appending one row at a time reallocates O(log n) times.
        let (mut cap, mut reallocs) = (0, 0);
        for len in 1..=100_000 {
            if len > cap {
                cap = kv_capacity(cap, len);
                reallocs += 1;
            }
        }
        assert!(reallocs < 25, "{reallocs} reallocations");
    }

    #[test]
    fn arch_names() {
        assert_eq!(gpu_arch(9, 0), "sm_90a");
        assert_eq!(gpu_arch(8, 9), "sm_89");
        assert_eq!(gpu_arch(12, 0), "sm_120");
    }

    #[test]
    fn attention_instances_and_smem() {
        assert_eq!(attention_head_dim(16), Some(16));
        assert_eq!(attention_head_dim(24), Some(32));
        assert_eq!(attention_head_dim(256), Some(256));
        assert_eq!(attention_head_dim(257), None);
        assert_eq!(attention_smem_bytes(256), 101_376);
        let (prep, scan) = delta_smem_bytes(128);
        assert!(prep <= 227 * 1024 && scan <= 227 * 1024, "{prep} {scan}");
        // Two scan blocks per SM (228 KiB, 1 KiB reserved per block) for either kernel.
        assert!(2 * (scan + 1024) <= 228 * 1024, "{scan}");
        let tc = delta_tc_smem_bytes(128);
        assert_eq!(tc, 111_360);
        assert!(2 * (tc + 1024) <= 228 * 1024, "{tc}");
    }

    #[test]
    fn alignment_of_addresses() {
        assert_eq!(ptr_alignment(0x7f00_0000_0000), 256);
        assert_eq!(ptr_alignment(0x7f00_0000_0008), 8);
        assert_eq!(ptr_alignment(0x7f00_0000_0082), 2);
    }
}
