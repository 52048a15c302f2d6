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

// The warp loop of the fused quantisers below: one warp per (row, 128-block) of [Mpad, K], 4
// values per lane, grid-stride over warps; value4(m, c0, v) computes and stores the bf16 outputs of
// row m < M, columns c0..c0+3 (c0 a multiple of 4: 8-byte accesses) and returns them in v as f32;
// rows m >= M quantise zeros (scale 1), as quant_act_1x128.
template <class Value4>
__device__ __forceinline__ void quant_rows_1x128(unsigned char* q, float* s, int M, int Mpad, int K, Value4 value4) {
  int lane = threadIdx.x & 31, KB = K / 128;
  i64 nwarps = (i64)Mpad * KB, stride = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp < nwarps; warp += stride) {
    int m = (int)(warp / KB), kb = (int)(warp % KB);
    int c0 = kb * 128 + lane * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (m < M) value4(m, c0, v);
    quant_block_1x128(v, q + (i64)m * K + c0, 1, s + (i64)kb * Mpad + m);
  }
}

// SwiGLU fused with quant_act_1x128 (the MLP's down projection input). gu is [M, 2K] ([gate | up]
// per row). Writes y[m, c] = bf16(silu(gate) * up) exactly as the swiglu kernel, and q / s exactly
// as quant_act_1x128 would from that y (same warp layout and reductions; rows m >= M are zero with
// scale 1). CPU twin: cpu::elementwise::swiglu then weights::fp8::quantize_act_1x128.
extern "C" __global__ void swiglu_quant_1x128(const bf16* gu, bf16* y, unsigned char* q, float* s, int M,
                                              int Mpad, int K) {
  quant_rows_1x128(q, s, M, Mpad, K, [=](int m, int c0, float v[4]) {
    const bf16* row = gu + (i64)m * 2 * K;
    bf16 gate[4], up[4], h[4];
    load_bf16x4(row + c0, gate);
    load_bf16x4(row + K + c0, up);
    for (int j = 0; j < 4; j++) {
      h[j] = to_bf(silu_f(bf(gate[j])) * bf(up[j]));
      v[j] = bf(h[j]);
    }
    store_bf16x4(y + (i64)m * K + c0, h);
  });
}

// GELU in place fused with quant_act_1x128 of its output (the vision MLPs' fc2 input). x is
// [M, K]; writes x[m, c] = bf16(gelu(x[m, c])) exactly as the gelu kernel, and q / s exactly as
// quant_act_1x128 would from that x. CPU twin: cpu::elementwise::gelu then
// weights::fp8::quantize_act_1x128.
extern "C" __global__ void gelu_quant_1x128(bf16* x, unsigned char* q, float* s, int M, int Mpad, int K,
                                            int tanh_mode) {
  quant_rows_1x128(q, s, M, Mpad, K, [=](int m, int c0, float v[4]) {
    bf16* e = x + (i64)m * K + c0;
    bf16 h[4];
    load_bf16x4(e, h);
    for (int j = 0; j < 4; j++) {
      h[j] = to_bf(gelu_f(bf(h[j]), tanh_mode));
      v[j] = bf(h[j]);
    }
    store_bf16x4(e, h);
  });
}
