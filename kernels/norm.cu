// Row norms, f32 inside, one bf16 rounding at the output.
// Rust binding: src/backend/cuda/norm.rs. CPU twins: cpu::norm::{rms_norm, layer_norm,
// rms_norm_gated} (src/backend/cpu/norm.rs); the add_ variants: add_assign, then the norm.
//
// The *_quant variants also write the per-token 1×128 FP8 quantisation of the bf16 rows they
// store, for an FP8 projection that reads them: q [Mpad, d·heads] and scales [K/128][Mpad] exactly
// as quant_act_1x128 (quant.cu) would make them from that bf16 output (amax over the rounded
// values of each 128-block, the same act_scale_1x128 / act_code_e4m3 of common.cuh; rows
// M..Mpad zero with scale 1), so the projection needs no quant_act_1x128 launch. Their bf16
// outputs are bit-identical to the plain kernels': the same helpers below compute the sum of
// squares (same thread/stride order, same block_sum) and each output value; only which thread
// stores which column changes. CPU twin of a *_quant kernel: its plain op's twin, then
// weights::fp8::quantize_act_1x128 of the result.

// The row norms' reductions visit a row's columns in one fixed order per (d, blockDim): with d a
// multiple of 4, thread t takes the groups of 4 consecutive columns 4t, 4t + 4·blockDim.x, ...
// (8-byte accesses; the rows start 8-byte aligned), else the single columns t, t + blockDim.x, ...;
// f(c, h) gets column group c's values h[0..w) (w = 4 or 1) and returns their contribution, summed
// in order, then block_sum. Every norm kernel reduces through it, so plain and fused kernels give
// the same bits.
template <class F>
__device__ __forceinline__ float row_reduce(int d, float* sh, F f) {
  float acc = 0.f;
  if (d % 4 == 0) {
    for (int c = 4 * threadIdx.x; c < d; c += 4 * blockDim.x) acc += f(c, 4);
  } else {
    for (int c = threadIdx.x; c < d; c += blockDim.x) acc += f(c, 1);
  }
  return block_sum(acc, sh);
}

// Values w (4 or 1) of row xr from column c, as bf16.
__device__ __forceinline__ void row_values(const bf16* xr, int c, int w, bf16 h[4]) {
  if (w == 4) {
    load_bf16x4(xr + c, h);
  } else {
    h[0] = xr[c];
  }
}

// 1 / rms of a row of length d, one block per row (row_reduce's order). rms_norm and rms_norm_quant
// share it (and add_rms_norm's first pass reduces in the same order), so all give the same r.
__device__ __forceinline__ float row_rsqrt(const bf16* xr, int d, float eps, float* sh) {
  const float ss = row_reduce(d, sh, [&](int c, int w) {
    bf16 h[4];
    row_values(xr, c, w, h);
    float a = 0.f;
    for (int j = 0; j < w; j++) { float v = bf(h[j]); a += v * v; }
    return a;
  });
  return rsqrtf(ss / d + eps);
}

// The add_ kernels' first pass over columns c.. (w of them): xr = bf16(xr + yr) exactly as
// add_bf16, stored, and returned in h.
__device__ __forceinline__ void add_row_values(bf16* xr, const bf16* yr, int c, int w, bf16 h[4]) {
  bf16 y[4];
  row_values(xr, c, w, h);
  row_values(yr, c, w, y);
  for (int j = 0; j < w; j++) h[j] = to_bf(bf(h[j]) + bf(y[j]));
  if (w == 4) {
    store_bf16x4(xr + c, h);
  } else {
    xr[c] = h[0];
  }
}

// add_rms_norm's first pass: xr[c] = bf16(xr[c] + yr[c]) exactly as add_bf16, and 1 / rms of the
// stored (rounded) row, in row_rsqrt's order.
__device__ __forceinline__ float add_row_rsqrt(bf16* xr, const bf16* yr, int d, float eps, float* sh) {
  const float ss = row_reduce(d, sh, [&](int c, int w) {
    bf16 h[4];
    add_row_values(xr, yr, c, w, h);
    float a = 0.f;
    for (int j = 0; j < w; j++) { float v = bf(h[j]); a += v * v; }
    return a;
  });
  return rsqrtf(ss / d + eps);
}

__device__ __forceinline__ bf16 rms_out(bf16 x, float r, float offset, float w) { return to_bf(bf(x) * r * (offset + w)); }

// The output pass of the fused row norms (d % 128 == 0): warp w of the block takes the row's
// 128-column blocks w, w + warps, ...; lane l the 4 columns 4l..4l+3 of a block (quant_act_1x128's
// layout). Stores yr and the block's codes qr and scale s[kb·Mpad + m].
__device__ __forceinline__ void rms_out_quant(const bf16* xr, const float* w, float r, float offset, bf16* yr,
                                              unsigned char* qr, float* s, int m, int Mpad, int d) {
  int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int kb = threadIdx.x >> 5; kb < d / 128; kb += nw) {
    int c0 = kb * 128 + lane * 4;
    bf16 x4[4], h[4];
    load_bf16x4(xr + c0, x4);
    const float4 w4 = *(const float4*)(w + c0);
    const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
    float v[4];
    for (int j = 0; j < 4; j++) {
      h[j] = rms_out(x4[j], r, offset, wv[j]);
      v[j] = bf(h[j]);
    }
    store_bf16x4(yr + c0, h);
    quant_block_1x128(v, qr + c0, 1, s + (i64)kb * Mpad + m);
  }
}

// A padding row m (M <= m < Mpad) of a quantisation: zero codes (quant_act_1x128 quantises zeros)
// and scale 1 for each of its d / 128 blocks. One block per row.
__device__ __forceinline__ void quant_pad_row(unsigned char* qr, float* s, int m, int Mpad, int d) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) qr[c] = 0;
  for (int kb = threadIdx.x; kb < d / 128; kb += blockDim.x) s[(i64)kb * Mpad + m] = 1.f;
}

// One block per row of length d: y = x * rsqrt(mean(x^2) + eps) * (offset + w).
extern "C" __global__ void rms_norm(const bf16* x, const float* w, bf16* y, int d, float eps, float offset) {
  pdl_begin();
  __shared__ float sh[32];
  const bf16* xr = x + (i64)blockIdx.x * d;
  bf16* yr = y + (i64)blockIdx.x * d;
  float r = row_rsqrt(xr, d, eps, sh);
  for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = rms_out(xr[c], r, offset, w[c]);
}

// rms_norm fused with quant_act_1x128 of its output (d % 128 == 0). Grid Mpad blocks: blocks
// m < M are rms_norm's rows (same block size, same bits), blocks m >= M write the padding rows.
// CPU twin: cpu::norm::rms_norm then weights::fp8::quantize_act_1x128.
extern "C" __global__ void rms_norm_quant(const bf16* x, const float* w, bf16* y, unsigned char* q, float* s, int M,
                                          int Mpad, int d, float eps, float offset) {
  pdl_begin();
  __shared__ float sh[32];
  int m = blockIdx.x;
  if (m >= M) {  // whole block: no barrier below is reached by part of it
    quant_pad_row(q + (i64)m * d, s, m, Mpad, d);
    return;
  }
  const bf16* xr = x + (i64)m * d;
  float r = row_rsqrt(xr, d, eps, sh);
  rms_out_quant(xr, w, r, offset, y + (i64)m * d, q + (i64)m * d, s, m, Mpad, d);
}

// Residual add fused with the next RMSNorm, one block per row of length d (launch it with the
// block size rms_norm uses, so the sum of squares reduces in the same order):
// x = bf16(x + y) exactly as add_bf16, then out = rms_norm(x) exactly as rms_norm on that rounded
// x. CPU twin: add_assign then cpu::norm::rms_norm. The output pass reads x columns other threads
// stored: block_sum's __syncthreads orders those writes first.
extern "C" __global__ void add_rms_norm(bf16* x, const bf16* y, const float* w, bf16* out, int d, float eps,
                                        float offset) {
  pdl_begin();
  __shared__ float sh[32];
  bf16* xr = x + (i64)blockIdx.x * d;
  bf16* orow = out + (i64)blockIdx.x * d;
  float r = add_row_rsqrt(xr, y + (i64)blockIdx.x * d, d, eps, sh);
  for (int c = threadIdx.x; c < d; c += blockDim.x) orow[c] = rms_out(xr[c], r, offset, w[c]);
}

// add_rms_norm fused with quant_act_1x128 of out (d % 128 == 0); grid Mpad blocks as
// rms_norm_quant. The output pass reads x columns other threads of the block stored: block_sum's
// __syncthreads orders those global writes before the reads. CPU twin: add_assign, then
// cpu::norm::rms_norm, then weights::fp8::quantize_act_1x128.
extern "C" __global__ void add_rms_norm_quant(bf16* x, const bf16* y, const float* w, bf16* out, unsigned char* q,
                                              float* s, int M, int Mpad, int d, float eps, float offset) {
  pdl_begin();
  __shared__ float sh[32];
  int m = blockIdx.x;
  if (m >= M) {
    quant_pad_row(q + (i64)m * d, s, m, Mpad, d);
    return;
  }
  bf16* xr = x + (i64)m * d;
  float r = add_row_rsqrt(xr, y + (i64)m * d, d, eps, sh);
  rms_out_quant(xr, w, r, offset, out + (i64)m * d, q + (i64)m * d, s, m, Mpad, d);
}

// LayerNorm (nn.LayerNorm with bias, biased variance, two passes) of a row of length d, one block
// per row: thread t sums columns t, t + blockDim.x, ... in order, then block_sum, for the mean and
// then for the variance. layer_norm, layer_norm_quant and the add_ variants share these helpers
// and the block size, so all give the same mean, 1/std and outputs.
__device__ __forceinline__ float ln_var_rsqrt(const bf16* xr, int d, float mean, float eps, float* sh) {
  const float v = row_reduce(d, sh, [&](int c, int w) {
    bf16 h[4];
    row_values(xr, c, w, h);
    float a = 0.f;
    for (int j = 0; j < w; j++) { float t = bf(h[j]) - mean; a += t * t; }
    return a;
  });
  return rsqrtf(v / d + eps);
}
__device__ __forceinline__ void ln_stats(const bf16* xr, int d, float eps, float* sh, float& mean, float& r) {
  mean = row_reduce(d, sh, [&](int c, int w) {
    bf16 h[4];
    row_values(xr, c, w, h);
    float a = 0.f;
    for (int j = 0; j < w; j++) a += bf(h[j]);
    return a;
  }) / d;
  r = ln_var_rsqrt(xr, d, mean, eps, sh);
}
// The add_ variants' first pass: xr[c] = bf16(xr[c] + yr[c]) exactly as add_bf16, summing the
// stored (rounded) values in ln_stats' order; the variance pass re-reads this thread's columns, the
// output pass others' too (after block_sum's __syncthreads).
__device__ __forceinline__ void add_ln_stats(bf16* xr, const bf16* yr, int d, float eps, float* sh, float& mean,
                                             float& r) {
  mean = row_reduce(d, sh, [&](int c, int w) {
    bf16 h[4];
    add_row_values(xr, yr, c, w, h);
    float a = 0.f;
    for (int j = 0; j < w; j++) a += bf(h[j]);
    return a;
  }) / d;
  r = ln_var_rsqrt(xr, d, mean, eps, sh);
}
__device__ __forceinline__ bf16 ln_out(bf16 x, float mean, float r, float w, float b) {
  return to_bf((bf(x) - mean) * r * w + b);
}
// The output pass of the quantising LayerNorms (d % 128 == 0), in rms_out_quant's layout.
__device__ __forceinline__ void ln_out_quant(const bf16* xr, const float* w, const float* b, float mean, float r,
                                             bf16* yr, unsigned char* qr, float* s, int m, int Mpad, int d) {
  int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int kb = threadIdx.x >> 5; kb < d / 128; kb += nw) {
    int c0 = kb * 128 + lane * 4;
    bf16 x4[4], h[4];
    load_bf16x4(xr + c0, x4);
    const float4 w4 = *(const float4*)(w + c0), b4 = *(const float4*)(b + c0);
    const float wv[4] = {w4.x, w4.y, w4.z, w4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
    float v[4];
    for (int j = 0; j < 4; j++) {
      h[j] = ln_out(x4[j], mean, r, wv[j], bv[j]);
      v[j] = bf(h[j]);
    }
    store_bf16x4(yr + c0, h);
    quant_block_1x128(v, qr + c0, 1, s + (i64)kb * Mpad + m);
  }
}

// One block per row: y = LayerNorm(x) · w + b.
extern "C" __global__ void layer_norm(const bf16* x, const float* w, const float* b, bf16* y, int d, float eps) {
  pdl_begin();
  __shared__ float sh[32];
  const bf16* xr = x + (i64)blockIdx.x * d;
  bf16* yr = y + (i64)blockIdx.x * d;
  float mean, r;
  ln_stats(xr, d, eps, sh, mean, r);
  for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = ln_out(xr[c], mean, r, w[c], b[c]);
}

// layer_norm fused with quant_act_1x128 of its output (d % 128 == 0; grid Mpad blocks as
// rms_norm_quant). CPU twin: cpu::norm::layer_norm then weights::fp8::quantize_act_1x128.
extern "C" __global__ void layer_norm_quant(const bf16* x, const float* w, const float* b, bf16* y, unsigned char* q,
                                            float* s, int M, int Mpad, int d, float eps) {
  pdl_begin();
  __shared__ float sh[32];
  int m = blockIdx.x;
  if (m >= M) {
    quant_pad_row(q + (i64)m * d, s, m, Mpad, d);
    return;
  }
  const bf16* xr = x + (i64)m * d;
  float mean, r;
  ln_stats(xr, d, eps, sh, mean, r);
  ln_out_quant(xr, w, b, mean, r, y + (i64)m * d, q + (i64)m * d, s, m, Mpad, d);
}

// The residual add fused with the next LayerNorm (the vision tower's blocks): x = bf16(x + y)
// exactly as add_bf16, then out = layer_norm(x) exactly as layer_norm on that rounded x.
// CPU twin: add_assign then cpu::norm::layer_norm.
extern "C" __global__ void add_layer_norm(bf16* x, const bf16* y, const float* w, const float* b, bf16* out, int d,
                                          float eps) {
  pdl_begin();
  __shared__ float sh[32];
  bf16* xr = x + (i64)blockIdx.x * d;
  bf16* orow = out + (i64)blockIdx.x * d;
  float mean, r;
  add_ln_stats(xr, y + (i64)blockIdx.x * d, d, eps, sh, mean, r);
  for (int c = threadIdx.x; c < d; c += blockDim.x) orow[c] = ln_out(xr[c], mean, r, w[c], b[c]);
}

// add_layer_norm fused with quant_act_1x128 of out (d % 128 == 0; grid Mpad blocks). The output
// pass reads x columns other threads stored: block_sum's __syncthreads orders those writes first.
// CPU twin: add_assign, cpu::norm::layer_norm, then weights::fp8::quantize_act_1x128.
extern "C" __global__ void add_layer_norm_quant(bf16* x, const bf16* y, const float* w, const float* b, bf16* out,
                                                unsigned char* q, float* s, int M, int Mpad, int d, float eps) {
  pdl_begin();
  __shared__ float sh[32];
  int m = blockIdx.x;
  if (m >= M) {
    quant_pad_row(q + (i64)m * d, s, m, Mpad, d);
    return;
  }
  bf16* xr = x + (i64)m * d;
  float mean, r;
  add_ln_stats(xr, y + (i64)m * d, d, eps, sh, mean, r);
  ln_out_quant(xr, w, b, mean, r, out + (i64)m * d, q + (i64)m * d, s, m, Mpad, d);
}

// The gated norm's arithmetic, shared by rms_norm_gated and rms_norm_gated_quant so that both give
// the same bits. One row is one warp: lane l adds the squares of columns l, l + 32, ... in order
// into ss (ss += x * x each), then 1 / rms from the lanes' sums.
__device__ __forceinline__ float gated_rsqrt(float ss, int d, float eps) { return rsqrtf(warp_sum(ss) / d + eps); }
// One output value from x, the gate z (bf16 as f32), the weight w and the row's 1 / rms.
__device__ __forceinline__ float gated_out(float x, float z, float w, float r) { return w * (x * r) * silu_f(z); }

// Gated RMSNorm of the DeltaNet output, one warp per (token, value head) row of length d:
// y = w * x * rsqrt(mean(x^2) + eps) * silu(z)  (norm before gate; x is the f32 delta-rule output).
// Row = token * heads + head; z of that row is z[token * z_ld + head * d ..] (z is a block of the
// fused input projection, row stride z_ld elements).
extern "C" __global__ void rms_norm_gated(const float* x, const bf16* z, i64 z_ld, int heads, const float* w,
                                          bf16* y, i64 rows, int d, float eps) {
  pdl_begin();
  i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* xr = x + row * d;
  const bf16* zr = z + (row / heads) * z_ld + (row % heads) * d;
  float ss = 0.f;
  for (int c = lane; c < d; c += 32) ss += xr[c] * xr[c];
  const float r = gated_rsqrt(ss, d, eps);
  for (int c = lane; c < d; c += 32) y[row * d + c] = to_bf(gated_out(xr[c], bf(zr[c]), w[c], r));
}

// rms_norm_gated fused with quant_act_1x128 of y, for d == 128 (the host passes d and launches this
// only then): y is [M, heads·128], so the 128-block `head` of token t is exactly row t·heads + head,
// one warp: amax is a warp reduction, q[t, head·128 + c] = q[row·128 + c], scale at
// s[head·Mpad + t]. Warps cover Mpad·heads rows; those of tokens t >= M write the padding (zero
// codes, scale 1). The bf16 output is rms_norm_gated's (same lanes, same arithmetic).
// CPU twin: cpu::norm::rms_norm_gated then weights::fp8::quantize_act_1x128.
extern "C" __global__ void rms_norm_gated_quant(const float* x, const bf16* z, i64 z_ld, int heads, const float* w,
                                                bf16* y, unsigned char* q, float* s, int M, int Mpad, int d,
                                                float eps) {
  pdl_begin();
  i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (row >= (i64)Mpad * heads) return;
  int t = (int)(row / heads), head = (int)(row % heads);
  if (t >= M) {
    for (int j = 0; j < 4; j++) q[row * 128 + lane + 32 * j] = 0;
    if (lane == 0) s[(i64)head * Mpad + t] = 1.f;
    return;
  }
  const float* xr = x + row * d;
  const bf16* zr = z + (i64)t * z_ld + (i64)head * d;
  // Every input of the row is loaded first (all twelve loads in flight at once), then the sum of
  // squares in rms_norm_gated's order, gated_rsqrt and gated_out on the registers.
  float xv[4], zv[4], wv[4];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const int c = lane + 32 * j;
    xv[j] = xr[c];
    zv[j] = bf(zr[c]);
    wv[j] = w[c];
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; j++) ss += xv[j] * xv[j];
  const float r = gated_rsqrt(ss, d, eps);
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const bf16 h = to_bf(gated_out(xv[j], zv[j], wv[j], r));
    y[row * 128 + lane + 32 * j] = h;
    v[j] = bf(h);
  }
  quant_block_1x128(v, q + row * 128 + lane, 32, s + (i64)head * Mpad + t);
}
