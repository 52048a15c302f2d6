// Dynamic per-token FP8 (E4M3) activation quantisation, one scale per 128 consecutive inputs.
// Rust binding: src/backend/cuda/quant.rs. CPU twin: weights::fp8::quantize_act_1x128
// (src/weights/fp8.rs).
//
// q is [Mpad, K] row-major; rows m >= M are zero with scale 1. The scales are written
// [K/128][Mpad] (M contiguous, "MN-major"): the only layout cuBLASLt's VEC128_32F B-scale mode reads
// correctly on sm_90 (measured, shared/spec/gpu-stack.md); the natural [M][K/128] gives garbage.
// One warp per (row, 128-block), 4 values per lane.
extern "C" __global__ void quant_act_1x128(const bf16* x, unsigned char* q, float* s, int M, int Mpad, int K) {
  i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31, KB = K / 128;
  if (warp >= (i64)Mpad * KB) return;
  int m = (int)(warp / KB), kb = (int)(warp % KB);
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (m < M) {
    bf16 h[4];
    load_bf16x4(x + (i64)m * K + kb * 128 + lane * 4, h);
    for (int j = 0; j < 4; j++) v[j] = bf(h[j]);
  }
  quant_block_1x128(v, q + (i64)m * K + kb * 128 + lane * 4, 1, s + (i64)kb * Mpad + m);
}

// The warp loop of the fused quantisers below: a warp handles QUANT_ITEMS consecutive (row,
// 128-block) items of [Mpad, K], 4 values per lane, grid-stride over warps. load(m, c0, raw) issues
// the reads of row m < M, columns c0..c0+3 (c0 a multiple of 4: 8-byte accesses) into raw;
// finish(m, c0, raw, v) computes and stores the bf16 outputs and returns them in v as f32. Every
// item's reads are issued before the first is finished, so a warp has QUANT_ITEMS items' loads in
// flight (with one, these kernels ran at ~40% of the copy rate at full occupancy). Rows m >= M
// quantise zeros (scale 1), as quant_act_1x128. Each item is computed as with one item per warp.
// The launch bounds below keep 5 (SwiGLU) and 6 (GELU) blocks of 256 threads per SM without
// spilling: 40-48 warps with two items' loads each, against 64 warps with one before.
#define QUANT_ITEMS 2  // = FUSED_QUANT_ITEMS in src/backend/cuda/quant.rs
template <class Raw, class Load, class Finish>
__device__ __forceinline__ void quant_rows_1x128(unsigned char* q, float* s, int M, int Mpad, int K, Load load,
                                                 Finish finish) {
  // Item counts fit in 32 bits (Mpad * K / 128 <= 65,536 rows * 72 blocks); 32-bit division.
  const int lane = threadIdx.x & 31, KB = K / 128;
  const unsigned nitems = (unsigned)Mpad * KB, stride = (gridDim.x * blockDim.x) >> 5;
  for (unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp * QUANT_ITEMS < nitems; warp += stride) {
    const unsigned item0 = warp * QUANT_ITEMS;
    Raw raw[QUANT_ITEMS];
#pragma unroll
    for (int u = 0; u < QUANT_ITEMS; u++) {
      const unsigned item = item0 + u;
      const int m = (int)(item / KB), c0 = (int)(item % KB) * 128 + lane * 4;
      if (item < nitems && m < M) load(m, c0, raw[u]);
    }
#pragma unroll
    for (int u = 0; u < QUANT_ITEMS; u++) {
      const unsigned item = item0 + u;
      if (item >= nitems) break;  // the same for the whole warp (quant_block_1x128 shuffles)
      const int m = (int)(item / KB), kb = (int)(item % KB), c0 = kb * 128 + lane * 4;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      if (m < M) finish(m, c0, raw[u], v);
      quant_block_1x128(v, q + (i64)m * K + c0, 1, s + (i64)kb * Mpad + m);
    }
  }
}

// SwiGLU fused with quant_act_1x128 (the MLP's down projection input). gu is [M, 2K] ([gate | up]
// per row). Writes y[m, c] = bf16(silu(gate) * up) exactly as the swiglu kernel, and q / s exactly
// as quant_act_1x128 would from that y (same warp layout and reductions; rows m >= M are zero with
// scale 1). CPU twin: cpu::elementwise::swiglu then weights::fp8::quantize_act_1x128.
struct SwigluRaw {
  bf16 gate[4], up[4];
};
extern "C" __global__ void __launch_bounds__(256, 5)
    swiglu_quant_1x128(const bf16* gu, bf16* y, unsigned char* q, float* s, int M, int Mpad, int K) {
  quant_rows_1x128<SwigluRaw>(
      q, s, M, Mpad, K,
      [=](int m, int c0, SwigluRaw& r) {
        const bf16* row = gu + (i64)m * 2 * K;
        load_bf16x4(row + c0, r.gate);
        load_bf16x4(row + K + c0, r.up);
      },
      [=](int m, int c0, const SwigluRaw& r, float v[4]) {
        bf16 h[4];
        for (int j = 0; j < 4; j++) {
          h[j] = to_bf(silu_f(bf(r.gate[j])) * bf(r.up[j]));
          v[j] = bf(h[j]);
        }
        store_bf16x4(y + (i64)m * K + c0, h);
      });
}

// GELU in place fused with quant_act_1x128 of its output (the vision MLPs' fc2 input). x is
// [M, K]; writes x[m, c] = bf16(gelu(x[m, c])) exactly as the gelu kernel, and q / s exactly as
// quant_act_1x128 would from that x. CPU twin: cpu::elementwise::gelu then
// weights::fp8::quantize_act_1x128.
struct GeluRaw {
  bf16 h[4];
};
extern "C" __global__ void __launch_bounds__(256, 6)
    gelu_quant_1x128(bf16* x, unsigned char* q, float* s, int M, int Mpad, int K, int tanh_mode) {
  quant_rows_1x128<GeluRaw>(
      q, s, M, Mpad, K, [=](int m, int c0, GeluRaw& r) { load_bf16x4(x + (i64)m * K + c0, r.h); },
      [=](int m, int c0, const GeluRaw& r, float v[4]) {
        bf16 h[4];
        for (int j = 0; j < 4; j++) {
          h[j] = to_bf(gelu_f(bf(r.h[j]), tanh_mode));
          v[j] = bf(h[j]);
        }
        store_bf16x4(x + (i64)m * K + c0, h);
      });
}
