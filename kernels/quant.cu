// Dynamic per-token FP8 (E4M3) activation quantisation, one scale per 128 consecutive inputs.
// CPU twin: backend::cuda::host::quantize_act_1x128.
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
  float v[4], amax = 0.f;
  for (int j = 0; j < 4; j++) {
    v[j] = m < M ? bf(x[(i64)m * K + kb * 128 + lane * 4 + j]) : 0.f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
  amax = warp_max(amax);
  float sc = amax > 0.f ? amax / 448.f : 1.f;
  for (int j = 0; j < 4; j++) q[(i64)m * K + kb * 128 + lane * 4 + j] = __nv_fp8_e4m3(v[j] / sc).__x;
  if (lane == 0) s[(i64)kb * Mpad + m] = sc;
}
