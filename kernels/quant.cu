// Dynamic per-token FP8 (E4M3) activation quantisation, one scale per 128 consecutive inputs.
// Rust binding: src/backend/cuda/quant.rs. CPU twin: weights::fp8::quantize_act_1x128
// (src/weights/fp8.rs).
//
// q is [Mpad, K] row-major; rows m >= M are zero with scale 1. The scales are written
// [K/128][Mpad] (M contiguous, "MN-major"): the only layout cuBLASLt's VEC128_32F B-scale mode reads
// correctly on sm_90 (measured, shared/spec/gpu-stack.md); the natural [M][K/128] gives garbage.
// One warp per (row, 128-block), 4 values per lane.
extern "C" __global__ void quant_act_1x128(const bf16* x, unsigned char* q, float* s, int M, int Mpad, int K) {
  pdl_begin();
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
  pdl_begin();
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
  pdl_begin();
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

// swiglu_lora_quant_1x128_<R>: swiglu_quant_1x128 with the gate/up projection's LoRA B side done
// here, so the [M, 2K] gate/up output is read once: unfused, a LoRA B GEMM reads and writes all of
// it (beta = 1) before the SwiGLU reads it again, ~half of all LoRA B traffic in a forward.
//   gu [M, 2K]: the gate | up FP8 GEMMs' output without LoRA;
//   t  [M, 2R]: t_gate | t_up, the LoRA A GEMM's output (rank R per part);
//   b  [2K, 2R]: the projection's fused block-diagonal B (linear.rs CudaLora): row c < K holds
//      B_gate[c] in columns 0..R, row K + c holds B_up[c] in columns R..2R (zeros elsewhere, not read).
// Writes y[m, c] = bf16(silu(g) * up) with g = bf16(gate + scale * t_gate . B_gate[c]) (u likewise):
// the values the unfused lora_b GEMM leaves, up to the order of its 64-term f32 sums; then q / s
// exactly as quant_act_1x128 would from y (rows M..Mpad zero with scale 1). Rows never mix: a row's
// bits do not depend on M (batch invariance). CPU twin: cpu::linear::matmul (the LoRA in f32), then
// cpu::elementwise::swiglu and weights::fp8::quantize_act_1x128.
// Block: 64 rows x 128 columns of y (one 1x128 quantisation block per row), 256 threads. Every
// operand tile is copied to shared memory at once (cp.async, 16 bytes, coalesced); warp w computes
// the LoRA terms of rows 16 (w % 4).., columns 64 (w / 4).. for gate and up with mma.sync (row
// strides padded by 16 bytes: conflict-free fragment loads), adds them to its gate/up values and
// writes h = silu(g) * u over the gate tile; then warp w stores and quantises rows 8w..8w+7, a lane
// 4 columns, as swiglu_quant_1x128 does. Shared memory: layout::swiglu_lora_smem_bytes (89,088
// bytes at R = 64: two blocks per SM).
__device__ __forceinline__ unsigned ld_smem_u32(const bf16* p) { return *(const unsigned*)p; }

template <int R>
__device__ void swiglu_lora_quant(const bf16* gu, const bf16* t, const bf16* b, float scale, bf16* y,
                                  unsigned char* q, float* s, int M, int Mpad, int K) {
  constexpr int ROWS = 64, COLS = 128, LT = 2 * R + 8, LB = R + 8, LG = COLS + 8;
  static_assert(R % 16 == 0 && R <= 64, "rank per part: a multiple of 16, at most 64");
  extern __shared__ __align__(16) bf16 smem_sl[];
  bf16* Ts = smem_sl;         // [64][LT]: t of rows r0..
  bf16* Bg = Ts + ROWS * LT;  // [128][LB]: B_gate of columns c0..
  bf16* Bu = Bg + COLS * LB;  // [128][LB]: B_up of columns c0..
  bf16* Gs = Bu + COLS * LB;  // [64][LG]: gate of rows r0.., columns c0.. (then h)
  bf16* Us = Gs + ROWS * LG;  // [64][LG]: up
  const int r0 = blockIdx.x * ROWS, c0 = blockIdx.y * COLS, tid = threadIdx.x;
  for (int i = tid; i < ROWS * (2 * R / 8); i += blockDim.x) {
    const int r = i / (2 * R / 8), c = (i % (2 * R / 8)) * 8;
    const bool ok = r0 + r < M;
    cp_async16(Ts + r * LT + c, t + (ok ? (i64)(r0 + r) * 2 * R + c : 0), ok);
  }
  for (int i = tid; i < COLS * (R / 8); i += blockDim.x) {
    const int n = i / (R / 8), c = (i % (R / 8)) * 8;
    cp_async16(Bg + n * LB + c, b + (i64)(c0 + n) * 2 * R + c, true);
    cp_async16(Bu + n * LB + c, b + (i64)(K + c0 + n) * 2 * R + R + c, true);
  }
  for (int i = tid; i < ROWS * (COLS / 8); i += blockDim.x) {
    const int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
    const bool ok = r0 + r < M;
    const bf16* row = gu + (ok ? (i64)(r0 + r) * 2 * K : 0);
    cp_async16(Gs + r * LG + c, row + c0 + c, ok);
    cp_async16(Us + r * LG + c, row + K + c0 + c, ok);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
  float ag[8][4], au[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) ag[nt][e] = au[nt][e] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < R; k0 += 16) {
    const bf16* ta = Ts + (m0 + gr) * LT + k0 + 2 * tg;
    const unsigned a_g[4] = {ld_smem_u32(ta), ld_smem_u32(ta + 8 * LT), ld_smem_u32(ta + 8),
                             ld_smem_u32(ta + 8 * LT + 8)};
    const unsigned a_u[4] = {ld_smem_u32(ta + R), ld_smem_u32(ta + 8 * LT + R), ld_smem_u32(ta + R + 8),
                             ld_smem_u32(ta + 8 * LT + R + 8)};
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
      const int n = (n0 + 8 * nt + gr) * LB + k0 + 2 * tg;
      const unsigned b_g[2] = {ld_smem_u32(Bg + n), ld_smem_u32(Bg + n + 8)};
      const unsigned b_u[2] = {ld_smem_u32(Bu + n), ld_smem_u32(Bu + n + 8)};
      mma_bf16_16816(ag[nt], a_g, b_g);
      mma_bf16_16816(au[nt], a_u, b_u);
    }
  }
  // h over the gate tile: each element is read and written by the thread that owns it.
#pragma unroll
  for (int nt = 0; nt < 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int at = (m0 + gr + 8 * (e >> 1)) * LG + n0 + 8 * nt + 2 * tg + (e & 1);
      const float g = bf(to_bf(fmaf(scale, ag[nt][e], bf(Gs[at]))));
      const float u = bf(to_bf(fmaf(scale, au[nt][e], bf(Us[at]))));
      Gs[at] = to_bf(silu_f(g) * u);
    }
  __syncthreads();
  const int c = c0 + 4 * lane;
#pragma unroll 1
  for (int i = 0; i < ROWS / 8; i++) {
    const int r = warp * (ROWS / 8) + i, m = r0 + r;
    if (m >= Mpad) break;  // the same for the whole warp (quant_block_1x128 shuffles)
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (m < M) {
      bf16 h[4];
      load_bf16x4(Gs + r * LG + 4 * lane, h);
      for (int j = 0; j < 4; j++) v[j] = bf(h[j]);
      store_bf16x4(y + (i64)m * K + c, h);
    }
    quant_block_1x128(v, q + (i64)m * K + c, 1, s + (i64)(c0 / COLS) * Mpad + m);
  }
}

#define SWIGLU_LORA_ENTRY(R)                                                                               \
  extern "C" __global__ void __launch_bounds__(256, 2) swiglu_lora_quant_1x128_##R(                       \
      const bf16* gu, const bf16* t, const bf16* b, float scale, bf16* y, unsigned char* q, float* s, int M, \
      int Mpad, int K) {                                                                                   \
    pdl_begin();                                                                                           \
    swiglu_lora_quant<R>(gu, t, b, scale, y, q, s, M, Mpad, K);                                            \
  }
SWIGLU_LORA_ENTRY(16)
SWIGLU_LORA_ENTRY(32)
SWIGLU_LORA_ENTRY(64)
