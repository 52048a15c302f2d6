// Gated DeltaNet (the Qwen3.5 linear-attention mixer), everything after the input projection.
// CPU twin: CpuBackend::gated_delta_net with kernels::{causal_conv_silu, l2_normalize_rows,
// delta_rule_chunked, rms_norm_gated} (src/backend/cpu).
//
// Conv segment table, 3 x i64 per sequence: [row_start, len, hist_ptr]; hist is the sequence's
// conv history [kernel-1, C] f32 (oldest first). Scan segment table, 3 x i64 per sequence:
// [first_chunk, n_chunks, state_ptr]; state is [vh, dk, dv] f32. Chunk table, 2 x int per chunk
// of 64 rows: [row_start, len] (chunks never straddle sequences).

#define CHUNK 64

__device__ __forceinline__ int find_seg3(const i64* segs, int nseg, i64 t) {
  for (int s = 0; s < nseg; s++)
    if (t >= segs[3 * s] && t < segs[3 * s] + segs[3 * s + 1]) return s;
  return -1;
}

// Asynchronous global -> shared copies (sm_80+), zero-filled when !valid (gmem must still be a
// mapped address). cp_async_wait_all() waits for all of this thread's copies.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Causal depthwise conv + SiLU of channel c at sequence position i (history for i + j - (kw-1) < 0).
__device__ __forceinline__ float conv_silu(const bf16* qkv, i64 row0, int i, int C, const float* hist,
                                           const bf16* w, int kw, int c) {
  float acc = 0.f;
  for (int j = 0; j < kw; j++) {
    int l = i + j - (kw - 1);
    float x = l >= 0 ? bf(qkv[(row0 + l) * C + c]) : hist[(i64)(kw - 1 + l) * C + c];
    acc += bf(w[(i64)c * kw + j]) * x;
  }
  return silu_f(acc);
}

// One block (8 warps) per token: conv + SiLU, split [q | k | v], q and k L2-normalised per key
// head (x * rsqrt(sum x^2 + 1e-6)), q * dk^-1/2; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
extern "C" __global__ void gdn_conv(const bf16* qkv, const bf16* convw, int kw, const i64* segs, int nseg,
                                    const bf16* b, const bf16* a, const float* alog, const float* dtb,
                                    float* qo, float* ko, float* vo, float* beta, float* gout,
                                    int kh, int vh, int dk, int dv) {
  const i64 t = blockIdx.x;
  const int s = find_seg3(segs, nseg, t);
  if (s < 0) return;
  const i64 row0 = segs[3 * s];
  const int i = (int)(t - row0);
  const float* hist = (const float*)segs[3 * s + 2];
  const int C = 2 * kh * dk + vh * dv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int u = warp; u < 2 * kh + vh; u += nw) {
    if (u < 2 * kh) {
      float vals[8], ss = 0.f;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        int d = lane + 32 * j;
        float v = d < dk ? conv_silu(qkv, row0, i, C, hist, convw, kw, u * dk + d) : 0.f;
        vals[j] = v;
        ss += v * v;
      }
      float r = rsqrtf(warp_sum(ss) + 1e-6f);
      if (u < kh) r *= rsqrtf((float)dk);
      float* dst = u < kh ? qo + (t * kh + u) * dk : ko + (t * kh + (u - kh)) * dk;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        int d = lane + 32 * j;
        if (d < dk) dst[d] = vals[j] * r;
      }
    } else {
      int hv = u - 2 * kh;
      for (int d = lane; d < dv; d += 32)
        vo[(t * vh + hv) * dv + d] = conv_silu(qkv, row0, i, C, hist, convw, kw, 2 * kh * dk + hv * dv + d);
    }
  }
  for (int h = threadIdx.x; h < vh; h += blockDim.x) {
    beta[t * vh + h] = sigmoid_f(bf(b[t * vh + h]));
    gout[t * vh + h] = -expf(alog[h]) * softplus_f(bf(a[t * vh + h]) + dtb[h]);
  }
}

// After gdn_conv: the history becomes the last kw-1 inputs of [history; new rows]. One thread per
// (channel, sequence); rows are shifted in ascending order, which is safe in place.
extern "C" __global__ void gdn_conv_hist(const bf16* qkv, const i64* segs, int C, int kw) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
  if (c >= C) return;
  const i64 row0 = segs[3 * s];
  const int len = (int)segs[3 * s + 1];
  float* hist = (float*)segs[3 * s + 2];
  const int h = kw - 1;
  for (int r = 0; r < h; r++) {
    int src = len - h + r;
    float v = src >= 0 ? bf(qkv[(row0 + src) * C + c]) : hist[(i64)(h + src) * C + c];
    hist[(i64)r * C + c] = v;
  }
}

// Per (chunk, value head), independent of the state: gamma = cumsum(g) inside the chunk,
//   A[i][j] = beta_i e^{gamma_i - gamma_j} k_i.k_j  (j < i),   P[i][j] = e^{gamma_i - gamma_j} q_i.k_j  (j <= i),
//   T = (I + A)^-1 (unit lower triangular, forward substitution row by row).
// Writes T and P to tp[(chunk*vh + hv)*2 + {0,1}][64][64]. Block of 256 threads; rows past the
// chunk's length are zero (beta = g = 0), so they add nothing.
extern "C" __global__ void gdn_chunk_prep(const float* qn, const float* kn, const float* beta, const float* g,
                                          const int* chunks, int kh, int vh, int dk, float* tp) {
  extern __shared__ __align__(16) float smem_prep[];
  float* sm = smem_prep;
  const int ld = dk + 1;
  float* Kc = sm;
  float* Qc = Kc + CHUNK * ld;
  float* A = Qc + CHUNK * ld;
  float* T = A + CHUNK * (CHUNK + 1);
  float* gam = T + CHUNK * (CHUNK + 1);
  float* bet = gam + CHUNK;
  const int ck = blockIdx.x, hv = blockIdx.y, hk = hv / (vh / kh);
  const i64 row0 = chunks[2 * ck];
  const int len = chunks[2 * ck + 1];
  for (int idx = threadIdx.x; idx < CHUNK * dk; idx += blockDim.x) {
    int i = idx / dk, d = idx % dk;
    bool ok = i < len;
    i64 src = ok ? ((row0 + i) * kh + hk) * dk + d : 0;
    cp_async4(Kc + i * ld + d, kn + src, ok);
    cp_async4(Qc + i * ld + d, qn + src, ok);
  }
  for (int i = threadIdx.x; i < CHUNK; i += blockDim.x) {
    bet[i] = i < len ? beta[(row0 + i) * vh + hv] : 0.f;
    gam[i] = i < len ? g[(row0 + i) * vh + hv] : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 1; i < CHUNK; i++) gam[i] += gam[i - 1];
  __syncthreads();
  float* P = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK + CHUNK * CHUNK;
  for (int idx = threadIdx.x; idx < CHUNK * CHUNK; idx += blockDim.x) {
    int i = idx / CHUNK, j = idx % CHUNK;
    float kk = 0.f, qk = 0.f;
    if (j <= i)
      for (int d = 0; d < dk; d++) { kk += Kc[i * ld + d] * Kc[j * ld + d]; qk += Qc[i * ld + d] * Kc[j * ld + d]; }
    float e = j <= i ? expf(gam[i] - gam[j]) : 0.f;
    A[i * (CHUNK + 1) + j] = j < i ? bet[i] * kk * e : 0.f;
    P[idx] = j <= i ? qk * e : 0.f;
  }
  __syncthreads();
  // T_i = e_i - sum_{j<i} A_ij T_j; 64 columns x 4 partial sums (256 threads).
  const int col = threadIdx.x >> 2, part = threadIdx.x & 3;
  for (int i = 0; i < CHUNK; i++) {
    float s = 0.f;
    for (int j = part; j < i; j += 4) s += A[i * (CHUNK + 1) + j] * T[j * (CHUNK + 1) + col];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (part == 0) T[i * (CHUNK + 1) + col] = (i == col ? 1.f : 0.f) - s;
    __syncthreads();
  }
  float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
  for (int idx = threadIdx.x; idx < CHUNK * CHUNK; idx += blockDim.x)
    Tg[idx] = T[(idx / CHUNK) * (CHUNK + 1) + idx % CHUNK];
}

// The sequential part, per (sequence, value head, 32 value columns): for each chunk in order,
//   R_i  = beta_i (v_i - e^{gamma_i} k_i S)          (S: the state before the chunk, [dk, 32])
//   Vn   = T R                                        (= U - W S of the WY form)
//   O_i  = e^{gamma_i} q_i S + sum_{j<=i} P_ij Vn_j
//   S   <- e^{gamma_last} S + sum_i e^{gamma_last - gamma_i} k_i^T Vn_i
// O is written in f32 to out [n, vh, dv]. Block of 256 threads = 8 warps; a thread owns value
// column c = lane and 8 rows of the chunk (i0 = 8*warp) or DK/8 rows of the state (d0 = warp*DK/8).
// Chunk inputs are staged with cp.async (16-byte, zero-filled past the chunk / the columns);
// dk and dv are multiples of 4 (checked by the host).

template <int DK>
__device__ void chunk_scan(const float* qn, const float* kn, const float* v, const float* beta, const float* g,
                           const float* tp, const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {
  extern __shared__ __align__(16) float smem_scan[];
  float* S = smem_scan;            // [DK][32]
  float* Kc = S + DK * 32;         // [64][DK]
  float* Qc = Kc + CHUNK * DK;     // [64][DK]
  float* Tm = Qc + CHUNK * DK;     // [64][64]
  float* Pm = Tm + CHUNK * CHUNK;  // [64][64]
  float* R = Pm + CHUNK * CHUNK;   // [64][32]
  float* Vn = R + CHUNK * 32;      // [64][32]
  float* gam = Vn + CHUNK * 32;
  float* bet = gam + CHUNK;
  float* fac = bet + CHUNK;
  constexpr int PD = DK / 8;       // state rows per thread
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * 32, hk = hv / (vh / kh);
  const int first = (int)segs[3 * s], nch = (int)segs[3 * s + 1];
  float* state = (float*)segs[3 * s + 2] + (i64)hv * DK * dv;
  const int ncols = min(32, dv - c0);
  const int c = threadIdx.x & 31, w = threadIdx.x >> 5, i0 = w * 8, d0 = w * PD;
  for (int idx = threadIdx.x; idx < DK * 32; idx += blockDim.x) {
    int d = idx / 32, cc = idx % 32;
    S[idx] = cc < ncols ? state[(i64)d * dv + c0 + cc] : 0.f;
  }
  for (int ck = first; ck < first + nch; ck++) {
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    __syncthreads();
    for (int idx = threadIdx.x; idx < CHUNK * DK / 4; idx += blockDim.x) {
      int i = idx / (DK / 4), d = (idx % (DK / 4)) * 4;
      bool ok = i < len;
      i64 src = ok ? ((row0 + i) * kh + hk) * DK + d : 0;
      cp_async16(Kc + i * DK + d, kn + src, ok);
      cp_async16(Qc + i * DK + d, qn + src, ok);
    }
    const float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
    for (int idx = threadIdx.x; idx < CHUNK * CHUNK / 4; idx += blockDim.x) {
      cp_async16(Tm + 4 * idx, Tg + 4 * idx, true);
      cp_async16(Pm + 4 * idx, Tg + CHUNK * CHUNK + 4 * idx, true);
    }
    for (int idx = threadIdx.x; idx < CHUNK * 8; idx += blockDim.x) {
      int i = idx / 8, cc = (idx % 8) * 4;
      bool ok = i < len && cc < ncols;
      cp_async16(R + i * 32 + cc, v + (ok ? ((row0 + i) * vh + hv) * dv + c0 + cc : 0), ok);
    }
    for (int i = threadIdx.x; i < CHUNK; i += blockDim.x) {
      bet[i] = i < len ? beta[(row0 + i) * vh + hv] : 0.f;
      gam[i] = i < len ? g[(row0 + i) * vh + hv] : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 1; i < CHUNK; i++) gam[i] += gam[i - 1];
    __syncthreads();
    if (threadIdx.x < CHUNK) fac[threadIdx.x] = expf(gam[CHUNK - 1] - gam[threadIdx.x]);
    // k S and q S for rows i0..i0+7, column c.
    float ks[8], qs[8];
#pragma unroll
    for (int r = 0; r < 8; r++) ks[r] = qs[r] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DK; d += 4) {
      const float s0 = S[d * 32 + c], s1 = S[(d + 1) * 32 + c], s2 = S[(d + 2) * 32 + c], s3 = S[(d + 3) * 32 + c];
#pragma unroll
      for (int r = 0; r < 8; r++) {
        const float4 kv = *(const float4*)(Kc + (i0 + r) * DK + d);
        const float4 qv = *(const float4*)(Qc + (i0 + r) * DK + d);
        ks[r] += kv.x * s0 + kv.y * s1 + kv.z * s2 + kv.w * s3;
        qs[r] += qv.x * s0 + qv.y * s1 + qv.z * s2 + qv.w * s3;
      }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
      int i = i0 + r;
      R[i * 32 + c] = bet[i] * (R[i * 32 + c] - expf(gam[i]) * ks[r]);
    }
    __syncthreads();
    // Vn = T R (T is unit lower triangular with exact zeros above the diagonal).
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; r++) acc[r] = 0.f;
    for (int j = 0; j < i0 + 8; j += 4) {
      const float r0 = R[j * 32 + c], r1 = R[(j + 1) * 32 + c], r2 = R[(j + 2) * 32 + c], r3 = R[(j + 3) * 32 + c];
#pragma unroll
      for (int r = 0; r < 8; r++) {
        const float4 t = *(const float4*)(Tm + (i0 + r) * CHUNK + j);
        acc[r] += t.x * r0 + t.y * r1 + t.z * r2 + t.w * r3;
      }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) Vn[(i0 + r) * 32 + c] = acc[r];
    __syncthreads();
    // O = e^gamma (q S) + P Vn (P is zero above the diagonal).
#pragma unroll
    for (int r = 0; r < 8; r++) acc[r] = expf(gam[i0 + r]) * qs[r];
    for (int j = 0; j < i0 + 8; j += 4) {
      const float v0 = Vn[j * 32 + c], v1 = Vn[(j + 1) * 32 + c], v2 = Vn[(j + 2) * 32 + c], v3 = Vn[(j + 3) * 32 + c];
#pragma unroll
      for (int r = 0; r < 8; r++) {
        const float4 p = *(const float4*)(Pm + (i0 + r) * CHUNK + j);
        acc[r] += p.x * v0 + p.y * v1 + p.z * v2 + p.w * v3;
      }
    }
    if (c < ncols) {
#pragma unroll
      for (int r = 0; r < 8; r++)
        if (i0 + r < len) out[((row0 + i0 + r) * vh + hv) * dv + c0 + c] = acc[r];
    }
    // S <- e^{gamma_last} S + sum_i fac_i k_i^T Vn_i, rows d0..d0+PD of column c.
    const float el = expf(gam[CHUNK - 1]);
    float sacc[PD];
#pragma unroll
    for (int r = 0; r < PD; r++) sacc[r] = el * S[(d0 + r) * 32 + c];
    for (int i = 0; i < CHUNK; i++) {
      const float f = fac[i] * Vn[i * 32 + c];
      const float* kr = Kc + i * DK + d0;
      if constexpr (PD % 4 == 0) {
#pragma unroll
        for (int r = 0; r < PD; r += 4) {
          const float4 k4 = *(const float4*)(kr + r);
          sacc[r] += k4.x * f;
          sacc[r + 1] += k4.y * f;
          sacc[r + 2] += k4.z * f;
          sacc[r + 3] += k4.w * f;
        }
      } else {
#pragma unroll
        for (int r = 0; r < PD; r++) sacc[r] += kr[r] * f;
      }
    }
#pragma unroll
    for (int r = 0; r < PD; r++) S[(d0 + r) * 32 + c] = sacc[r];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < DK * 32; idx += blockDim.x) {
    int d = idx / 32, cc = idx % 32;
    if (cc < ncols) state[(i64)d * dv + c0 + cc] = S[idx];
  }
}

#define SCAN_ENTRY(DK)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan_##DK(                                   \
      const float* qn, const float* kn, const float* v, const float* beta, const float* g, const float* tp, \
      const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {                            \
    chunk_scan<DK>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);                                 \
  }
SCAN_ENTRY(16)
SCAN_ENTRY(32)
SCAN_ENTRY(64)
SCAN_ENTRY(128)
