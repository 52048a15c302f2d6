// Row norms, f32 inside, one bf16 rounding at the output.
// CPU twins: kernels::{rms_norm, layer_norm, rms_norm_gated} in src/backend/cpu/kernels.rs.

// One block per row of length d: y = x * rsqrt(mean(x^2) + eps) * (offset + w).
extern "C" __global__ void rms_norm(const bf16* x, const float* w, bf16* y, int d, float eps, float offset) {
  __shared__ float sh[32];
  const bf16* xr = x + (i64)blockIdx.x * d;
  bf16* yr = y + (i64)blockIdx.x * d;
  float ss = 0.f;
  for (int c = threadIdx.x; c < d; c += blockDim.x) { float v = bf(xr[c]); ss += v * v; }
  ss = block_sum(ss, sh);
  float r = rsqrtf(ss / d + eps);
  for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = to_bf(bf(xr[c]) * r * (offset + w[c]));
}

// One block per row: nn.LayerNorm with bias (biased variance, two passes).
extern "C" __global__ void layer_norm(const bf16* x, const float* w, const float* b, bf16* y, int d, float eps) {
  __shared__ float sh[32];
  const bf16* xr = x + (i64)blockIdx.x * d;
  bf16* yr = y + (i64)blockIdx.x * d;
  float s = 0.f;
  for (int c = threadIdx.x; c < d; c += blockDim.x) s += bf(xr[c]);
  float mean = block_sum(s, sh) / d;
  float v = 0.f;
  for (int c = threadIdx.x; c < d; c += blockDim.x) { float t = bf(xr[c]) - mean; v += t * t; }
  float r = rsqrtf(block_sum(v, sh) / d + eps);
  for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = to_bf((bf(xr[c]) - mean) * r * w[c] + b[c]);
}

// Gated RMSNorm of the DeltaNet output, one warp per (token, value head) row of length d:
// y = w * x * rsqrt(mean(x^2) + eps) * silu(z)  (norm before gate; x is the f32 delta-rule output).
extern "C" __global__ void rms_norm_gated(const float* x, const bf16* z, const float* w, bf16* y,
                                          i64 rows, int d, float eps) {
  i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* xr = x + row * d;
  float ss = 0.f;
  for (int c = lane; c < d; c += 32) ss += xr[c] * xr[c];
  float r = rsqrtf(warp_sum(ss) / d + eps);
  for (int c = lane; c < d; c += 32) y[row * d + c] = to_bf(w[c] * (xr[c] * r) * silu_f(bf(z[row * d + c])));
}
