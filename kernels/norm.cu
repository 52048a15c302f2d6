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

// Residual add fused with the next RMSNorm, one block per row of length d (launch it with the
// block size rms_norm uses, so the sum of squares reduces in the same order):
// x = bf16(x + y) exactly as add_bf16, then out = rms_norm(x) exactly as rms_norm on that rounded
// x. CPU twin: add_assign then kernels::rms_norm. Each thread re-reads only the elements it wrote.
extern "C" __global__ void add_rms_norm(bf16* x, const bf16* y, const float* w, bf16* out, int d, float eps,
                                        float offset) {
  __shared__ float sh[32];
  bf16* xr = x + (i64)blockIdx.x * d;
  const bf16* yr = y + (i64)blockIdx.x * d;
  bf16* orow = out + (i64)blockIdx.x * d;
  float ss = 0.f;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    bf16 s = to_bf(bf(xr[c]) + bf(yr[c]));
    xr[c] = s;
    float v = bf(s);
    ss += v * v;
  }
  ss = block_sum(ss, sh);
  float r = rsqrtf(ss / d + eps);
  for (int c = threadIdx.x; c < d; c += blockDim.x) orow[c] = to_bf(bf(xr[c]) * r * (offset + w[c]));
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
// Row = token * heads + head; z of that row is z[token * z_ld + head * d ..] (z is a block of the
// fused input projection, row stride z_ld elements).
extern "C" __global__ void rms_norm_gated(const float* x, const bf16* z, i64 z_ld, int heads, const float* w,
                                          bf16* y, i64 rows, int d, float eps) {
  i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* xr = x + row * d;
  const bf16* zr = z + (row / heads) * z_ld + (row % heads) * d;
  float ss = 0.f;
  for (int c = lane; c < d; c += 32) ss += xr[c] * xr[c];
  float r = rsqrtf(warp_sum(ss) / d + eps);
  for (int c = lane; c < d; c += 32) y[row * d + c] = to_bf(w[c] * (xr[c] * r) * silu_f(bf(zr[c])));
}
