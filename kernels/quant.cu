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
  float v[4];
  for (int j = 0; j < 4; j++) v[j] = m < M ? bf(x[(i64)m * K + kb * 128 + lane * 4 + j]) : 0.f;
  quant_block_1x128(v, q + (i64)m * K + kb * 128 + lane * 4, 1, s + (i64)kb * Mpad + m);
}

// SwiGLU fused with quant_act_1x128 (the MLP's down projection input). gu is [M, 2K] ([gate | up]
// per row). Writes y[m, c] = bf16(silu(gate) * up) exactly as the swiglu kernel, and q / s exactly
// as quant_act_1x128 would from that y (same warp layout and reductions; rows m >= M are zero with
// scale 1). CPU twin: cpu::elementwise::swiglu then weights::fp8::quantize_act_1x128.
// One warp per (row, 128-block) of [Mpad, K], 4 values per lane; grid-stride over warps.
extern "C" __global__ void swiglu_quant_1x128(const bf16* gu, bf16* y, unsigned char* q, float* s, int M,
                                              int Mpad, int K) {
  int lane = threadIdx.x & 31, KB = K / 128;
  i64 nwarps = (i64)Mpad * KB, stride = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp < nwarps; warp += stride) {
    int m = (int)(warp / KB), kb = (int)(warp % KB);
    int c0 = kb * 128 + lane * 4;
    float v[4];
    for (int j = 0; j < 4; j++) {
      v[j] = 0.f;
      if (m < M) {
        const bf16* row = gu + (i64)m * 2 * K;
        bf16 h = to_bf(silu_f(bf(row[c0 + j])) * bf(row[K + c0 + j]));
        y[(i64)m * K + c0 + j] = h;
        v[j] = bf(h);
      }
    }
    quant_block_1x128(v, q + (i64)m * K + c0, 1, s + (i64)kb * Mpad + m);
  }
}
