//! The device suite: the CUDA backend against the CPU reference (which matches transformers fp32,
//! `tests/golden.rs`), one test per operation family, each in the file named after it
//! (`gemm.rs` checks src/backend/cuda/linear.rs and quant.rs; the others mirror their names).
//!
//! Runs on a machine with an NVIDIA GPU; elsewhere each test prints `skipped: no CUDA device
//! (...)` and passes. Each test prints its table of checks and fails if any row failed:
//! * elementwise, norms (with the FP8 quantisation of their output fused in, bitwise against the
//!   norm + `quant_act_1x128`), projections (BF16 and block-FP8 GEMMs, LoRA, the activation
//!   quantiser against its CPU twin, bitwise batch invariance), attention, DeltaNet (both chunk
//!   scans), on random inputs of Qwen3.5-4B and ragged shapes;
//! * the whole engine (vision + decoder + LoRA + readout) on the golden tiny models, and a
//!   4B-wide 4-layer FP8 model with and without the fused norm quantisation (bitwise);
//! * prefix + forks on the GPU (separately and inside one forward) equal full GPU forwards, forks
//!   are independent, and a sequence's result does not depend on what else is in the batch.
//!
//! Errors are `max |gpu − cpu| / max |cpu|`; BF16 activations give ~4e-3 per rounding, so op
//! tolerances are 1e-2..2e-2 and the engine's 3e-2. Op timings are not here: they are
//! `bench/gpu_ops.rs` (`cargo run --release --example bench_gpu_ops`).

mod attention;
mod deltanet;
mod elementwise;
mod engine;
mod gemm;
mod harness;
mod norm;

use harness::{gpu, Report};
use imajev_serve::backend::cuda::AttentionKernel;
use imajev_serve::synth::rng::SplitMix;

#[test]
fn elementwise_ops_match_cpu() {
    let Some(d) = gpu("elementwise") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(7));
    rep.guard("elem", "data movement", |rep| elementwise::data_movement(&d.g, &d.c, rep, &mut rng));
    rep.guard("elem", "activations", |rep| elementwise::activations(&d.g, &d.c, rep, &mut rng));
    rep.guard("elem", "image patch rows", |rep| elementwise::image_patch_rows(&d.g, rep, &mut rng));
    rep.guard("elem", "queued copies", |rep| elementwise::queued_copies(&d.g, rep, &mut rng));
    rep.finish("elementwise");
}

#[test]
fn norms_match_cpu_and_fused_fp8_quantisation_is_bitwise() {
    let Some(d) = gpu("norm") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(8));
    rep.guard("norm", "row norms", |rep| norm::row_norms(&d.g, &d.c, rep, &mut rng));
    rep.guard("norm", "fused norm quantisation", |rep| norm::fused_norm_quant(&d.g, rep, &mut rng));
    rep.finish("norm");
}

#[test]
fn projections_match_cpu_and_are_batch_invariant() {
    let Some(d) = gpu("gemm") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(9));
    rep.guard("gemm", "matmul", |rep| gemm::gemm_checks(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "narrow", |rep| gemm::narrow(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "LoRA B", |rep| gemm::lora_b(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "swiglu_matmul", |rep| gemm::swiglu_matmul(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "swiglu_mlp (fused LoRA)", |rep| gemm::swiglu_mlp(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "readout", |rep| gemm::readout(&d.g, &d.c, rep, &mut rng));
    rep.guard("gemm", "64K-row batches", |rep| gemm::large_batches(&d.g, rep, &mut rng));
    rep.finish("gemm");
}

/// The block-scaled FP8 GEMM on our own Hopper kernel with LoRA pairs in its epilogue
/// (the Hopper default, `IMAJEV_FP8_GEMM=own|own192|own128m|own192m|own128d|own192d`; gemm.rs `own_fp8`): against its dequantised operands, the CPU
/// and cuBLASLt, and bitwise across M.
#[test]
fn own_fp8_gemm_matches_cpu_and_cublas() {
    let Some(d) = gpu("gemm (own FP8)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(16));
    rep.guard("gemm", "own FP8 GEMM", |rep| gemm::own_fp8(&d.g, &d.c, rep, &mut rng));
    rep.finish("gemm (own FP8)");
}

/// The MLP on the FP8 kernel's GLU form (the SwiGLU in the gate/up GEMM's epilogue; Hopper only):
/// bitwise against the stored gate/up output + `swiglu_quant_1x128`, and against the CPU.
#[test]
fn swiglu_epilogue_matches_unfused_bitwise() {
    let Some(d) = gpu("gemm (GLU form)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(17));
    rep.guard("gemm", "GLU form", |rep| gemm::swiglu_epilogue(&d.g, &d.c, rep, &mut rng));
    rep.finish("gemm (GLU form)");
}

#[test]
fn attention_matches_cpu() {
    let Some(d) = gpu("attention") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(10));
    rep.guard("attn", "attention", |rep| attention::cases(&d.g, &d.c, rep, &mut rng));
    rep.finish("attention");
}

/// The warpgroup-MMA attention (Hopper only; elsewhere it is never launched).
#[test]
fn wgmma_attention_matches_cpu() {
    let Some(d) = gpu("attention (wgmma)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(12));
    rep.guard("attn", "attention (wgmma)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::Wgmma)
    });
    rep.finish("attention (wgmma)");
}

/// The warp-specialised warpgroup-MMA attention (Hopper only; elsewhere it is never launched).
#[test]
fn warp_specialised_attention_matches_cpu() {
    let Some(d) = gpu("attention (ws)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(13));
    rep.guard("attn", "attention (ws)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::WarpSpecialized)
    });
    rep.finish("attention (ws)");
}

/// The warpgroup-MMA attention with the softmax overlapped with the P·V MMAs (Hopper only):
/// against the CPU as the others, and bitwise against `Wgmma` (the same arithmetic, reordered issue).
#[test]
fn overlapped_attention_matches_cpu_and_wgmma_bitwise() {
    let Some(d) = gpu("attention (ov)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(14));
    rep.guard("attn", "attention (ov)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::Overlap)
    });
    rep.guard("attn", "attention (ov vs wgmma)", |rep| {
        attention::same_bits(&d.g, rep, &mut rng, AttentionKernel::Wgmma, AttentionKernel::Overlap)
    });
    rep.finish("attention (ov)");
}

/// The warpgroup-MMA attention with 128-key tiles at head dim 64 (Hopper only): against the CPU,
/// and bitwise against the warp-specialised kernel, whose tiles are the same size at both head
/// dims (128 keys at 64, 64 at 256) and whose softmax and MMAs are the same operations in the same
/// order.
#[test]
fn wgmma_k128_attention_matches_cpu_and_ws_bitwise() {
    let Some(d) = gpu("attention (wgmma-k128)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(15));
    rep.guard("attn", "attention (wgmma-k128)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::WgmmaK128)
    });
    rep.guard("attn", "attention (wgmma-k128 vs ws)", |rep| {
        attention::same_bits(
            &d.g,
            rep,
            &mut rng,
            AttentionKernel::WarpSpecialized,
            AttentionKernel::WgmmaK128,
        )
    });
    // The same kernels with the blocks in KV-group order (the sequences fastest for split passes):
    // against the CPU on every case (the split passes over a 16K prefix and the trees among them,
    // which same_bits does not have), and bitwise against the heads-fastest order, which is all
    // that differs (head dim 256 with GQA, 64 without).
    rep.guard("attn", "attention (wgmma-grouped)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::WgmmaGrouped)
    });
    rep.guard("attn", "attention (wgmma-grouped vs wgmma-k128)", |rep| {
        attention::same_bits(&d.g, rep, &mut rng, AttentionKernel::WgmmaK128, AttentionKernel::WgmmaGrouped)
    });
    // Three K/V buffers (opt-in): the copies run further ahead, the arithmetic is the same.
    rep.guard("attn", "attention (wgmma-grouped3 vs wgmma-grouped)", |rep| {
        attention::same_bits(
            &d.g,
            rep,
            &mut rng,
            AttentionKernel::WgmmaGrouped,
            AttentionKernel::WgmmaGrouped3,
        )
    });
    // Auto (the default): at head dim 256 it sends sequences of 2,048+ query rows to ws and the
    // rest to wgmma in two launches over subsets of the segment table (same_bits' 4,097-row
    // sequence beside five short ones, and a 16,384-row one alone); at head dim 64 its kernel is
    // the three-buffer one in KV-group order. Bitwise against the one-kernel side.
    rep.guard("attn", "attention (auto vs wgmma-k128)", |rep| {
        attention::same_bits(&d.g, rep, &mut rng, AttentionKernel::WgmmaK128, AttentionKernel::Auto)
    });
    rep.finish("attention (wgmma-k128)");
}

/// The 128-key warpgroup-MMA attention with its rows' sums on the tensor cores (opt-in
/// `AttentionKernel::WgmmaTensorSums`, Hopper only; head dim 256 runs the 64-key kernel): against
/// the CPU at the tolerance of the other kernels, on the inputs of
/// `wgmma_k128_attention_matches_cpu_and_ws_bitwise` (the same seed), so the two reports' errors
/// compare case by case.
#[test]
fn wgmma_tsum_attention_matches_cpu() {
    let Some(d) = gpu("attention (wgmma-tsum)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(15));
    rep.guard("attn", "attention (wgmma-tsum)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::WgmmaTensorSums)
    });
    rep.finish("attention (wgmma-tsum)");
}

/// The warp-specialised attention with three consumers over 192 query rows at head dim 64 (opt-in
/// `AttentionKernel::WarpSpecialized3`, Hopper only; head dim 256 runs the default kernel): against
/// the CPU on the inputs of `wgmma_k128_attention_matches_cpu_and_ws_bitwise` (the same seed), and
/// bitwise against `WgmmaK128`, whose 128-key tiles, softmax and MMA order it shares: only the rows
/// per block differ, and a row never depends on the others.
#[test]
fn ws3_attention_matches_cpu_and_k128_bitwise() {
    let Some(d) = gpu("attention (ws3)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(15));
    rep.guard("attn", "attention (ws3)", |rep| {
        attention::hopper_cases(&d.g, &d.c, rep, &mut rng, AttentionKernel::WarpSpecialized3)
    });
    rep.guard("attn", "attention (ws3 vs wgmma-k128)", |rep| {
        attention::same_bits(
            &d.g,
            rep,
            &mut rng,
            AttentionKernel::WgmmaK128,
            AttentionKernel::WarpSpecialized3,
        )
    });
    rep.finish("attention (ws3)");
}

#[test]
fn deltanet_matches_cpu_with_both_scans() {
    let Some(d) = gpu("deltanet") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(11));
    rep.guard("gdn", "deltanet", |rep| deltanet::cases(&d.g, &d.c, rep, &mut rng));
    rep.guard("gdn", "deltanet (states not kept)", |rep| deltanet::unkept_state_cases(&d.g, rep, &mut rng));
    rep.finish("deltanet");
}

/// `gdn_conv`'s tilings (rows a window, groups a block) give the same bits.
#[test]
fn conv_tilings_bitwise() {
    let Some(d) = gpu("deltanet conv tilings") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(29));
    rep.guard("gdn", "conv tilings", |rep| deltanet::conv_tiling_cases(&d.g, rep, &mut rng));
    rep.finish("deltanet conv tilings");
}

/// The one-TF32-MMA chunk scans (`gdn_tf32`, the default).
#[test]
fn tf32_deltanet_scans_match_cpu() {
    let Some(d) = gpu("deltanet (TF32)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(15));
    rep.guard("gdn", "deltanet (TF32)", |rep| deltanet::tf32_cases(&d.g, &d.c, rep, &mut rng));
    rep.finish("deltanet (TF32)");
}

/// The wide plain scan (opt-in `GdnScan::Wide`), TF32 and 3xTF32, bitwise against the plain scan.
#[test]
fn wide_deltanet_scan_matches_cpu_and_the_plain_scan() {
    let Some(d) = gpu("deltanet (wide)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(17));
    rep.guard("gdn", "deltanet (wide)", |rep| deltanet::wide_cases(&d.g, &d.c, rep, &mut rng));
    rep.finish("deltanet (wide)");
}

/// The split delta rule (opt-in `GdnScan::Split`), 3xTF32 and TF32.
#[test]
fn split_deltanet_matches_cpu() {
    let Some(d) = gpu("deltanet (split)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(16));
    rep.guard("gdn", "deltanet (split)", |rep| deltanet::split_cases(&d.g, &d.c, rep, &mut rng));
    rep.finish("deltanet (split)");
}

/// The warpgroup scan (opt-in `GdnScan::Warpgroup`, Hopper only).
#[test]
fn warpgroup_deltanet_matches_cpu() {
    let Some(d) = gpu("deltanet (warpgroup)") else { return };
    let (mut rep, mut rng) = (Report::default(), SplitMix::new(17));
    rep.guard("gdn", "deltanet (warpgroup)", |rep| deltanet::warpgroup_cases(&d.g, &d.c, rep, &mut rng));
    rep.finish("deltanet (warpgroup)");
}

#[test]
fn engine_matches_cpu_and_goldens() {
    let Some(d) = gpu("engine") else { return };
    let mut rep = Report::default();
    rep.guard("engine", "golden models", |rep| engine::engine(&d.g, rep));
    rep.guard("engine", "fused norm quant, 4B-wide 4-layer FP8 model", |rep| engine::fused_engine(&d.g, rep));
    rep.finish("engine");
}

#[test]
fn forks_and_one_forward_trees_match_full_forwards() {
    let Some(d) = gpu("extend") else { return };
    let mut rep = Report::default();
    rep.guard("extend", "prefix + extend", |rep| engine::prefix_extend(&d.g, rep));
    rep.guard("extend", "final synchronize", |_| imajev_serve::backend::Backend::synchronize(&d.g));
    rep.finish("extend");
}
