// Gated DeltaNet (the Qwen3.5 linear-attention mixer), everything after the input projection.
// Rust binding: src/backend/cuda/deltanet.rs. CPU twin: cpu::deltanet::{gated_delta_net,
// causal_conv_silu, l2_normalize_rows, delta_rule_chunked} and cpu::norm::rms_norm_gated
// (src/backend/cpu/).
//
// Conv segment table, 4 x i64 per sequence: [row_start, len, hist_in, hist_out]; a history is the
// sequence's conv history [kernel-1, C] f32 (oldest first), read from hist_in and the updated one
// written to hist_out (the same buffer, or a fresh one when a fork shares its parent's). Scan
// segment table, 4 x i64 per sequence: [first_chunk, n_chunks, state_in, state_out]; a state is
// [vh, dk, dv] f32, likewise read from state_in and written to state_out. hist_out or state_out 0:
// nothing reads that sequence's final history or state (a pass that is only read out), so it is not
// written, and the scans skip the state update after its last chunk (its outputs are the same
// bits: a chunk's outputs are computed from the state before its update). Chunk table, 2 x int per
// chunk of 64 rows: [row_start, len] (chunks never straddle sequences).

#define CHUNK 64

// The columns of a chunk's row-major T, P and K^T (gdn_chunk_prep_rm_<DK>) that the warpgroup scan
// copies: the chunk's len rounded up to whole 16-byte copies. Of T and P it copies rows < len only;
// everything past is zero or an identity row in the full tiles, and the scan zero-fills it instead
// (the products give the same values: R's rows past len are zero), so the prep writes only this.
__device__ __forceinline__ int rm_read_cols(int len) { return (len + 3) & ~3; }

// gdn_conv: conv taps kept in registers (taps past it are read from global memory).
#define CONV_REG_TAPS 4

// Four consecutive bf16 as they lie in memory (lo = the first): vec, one 8-byte load (p 8-byte
// aligned), else four 2-byte loads.
__device__ __forceinline__ uint2 load4_bf16_raw(const bf16* p, bool vec) {
  if (vec) return *(const uint2*)p;
  const unsigned short* u = (const unsigned short*)p;
  return make_uint2((unsigned)u[0] | ((unsigned)u[1] << 16), (unsigned)u[2] | ((unsigned)u[3] << 16));
}
// The four bf16 of load4_bf16_raw as f32 (exact: a bf16 is the top half of an f32).
__device__ __forceinline__ void unpack4_bf16(uint2 u, float* o) {
  o[0] = __uint_as_float(u.x << 16);
  o[1] = __uint_as_float(u.x & 0xffff0000u);
  o[2] = __uint_as_float(u.y << 16);
  o[3] = __uint_as_float(u.y & 0xffff0000u);
}
// Four consecutive bf16 -> f32 (load4_bf16_raw then unpack4_bf16).
__device__ __forceinline__ void load4_bf16(const bf16* p, bool vec, float* o) { unpack4_bf16(load4_bf16_raw(p, vec), o); }

// Causal depthwise conv (f32, taps j = 0..kw-1, tap kw-1 on the current row; rows before the
// sequence start come from its history) + SiLU, split [q | k | v], q and k L2-normalised per key
// head (x * rsqrt(sum x^2 + 1e-6)), q * dk^-1/2; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
// Inputs are blocks of the fused projection with row stride ld (elements): channel c of row t is
// x[t*ld + c] (c < C = 2*kh*dk + vh*dv), b and a of value head h are b[t*ld + h], a[t*ld + h].
// A thread owns 4 consecutive channels and the block's groups·GROUP consecutive rows, which it
// walks a group of GROUP rows at a time (gdn_conv_<GROUP>: 8 rows with two blocks an SM, 4 with
// three, both without spills). With kw == CONV_REG_TAPS (Qwen3.5's 4) the input rows
// stream through a register window: the next group's GROUP input rows are loaded before this
// group is computed, so their loads are in flight while it computes and stores (the kernel is
// bound by how many bytes each SM keeps in flight: ncu, bench/NOTES.md). A group that lies inside
// one sequence past its first kw-1 rows (nearly every group of a long prefill) is computed from the
// window; any other group (a sequence's first rows, a group across two sequences, kw != 4) runs the
// row loop, which reads the sequence's history and keeps the register taps' inputs from row to row.
// Both give a row the same sum in the same order, and a row's arithmetic does not depend on
// `groups` or on the other rows: same bits for every grid (the host picks `groups` for speed). The
// dk/4 lanes (4..32, aligned within the warp) of a key head reduce its sum of squares with
// shuffles. Grid (ceil(n / (groups·GROUP)), ceil(C/4 / blockDim.x)), blockDim.x a multiple of 32.
// segs: the conv segment table of the sequences that have rows, in row order (find_row_segment).
// vec != 0: 8-byte loads of x (x 8-byte aligned and ld % 4 == 0, checked by the host). At most 256
// threads (the host's choice).
template <int GROUP>
__device__ __forceinline__ void gdn_conv(const bf16* x, i64 ld, int vec, const bf16* convw, int kw, const i64* segs,
                                         int nseg, i64 n, int groups, const bf16* b, const bf16* a,
                                         const float* alog, const float* dtb, float* qo, float* ko, float* vo,
                                         float* beta, float* gout, int kh, int vh, int dk, int dv) {
  // The streamed window of a group (kw == CONV_REG_TAPS): its GROUP rows and the kw-1 before.
  constexpr int WINDOW = GROUP + CONV_REG_TAPS - 1;
  const int C = 2 * kh * dk + vh * dv, kd = kh * dk;
  const int grp = blockIdx.y * blockDim.x + threadIdx.x;
  const int c0 = 4 * grp;
  const bool active = c0 < C;  // C % 4 == 0: a group is all in or all out
  const int G = dk / 4;        // lanes per key head
  float wr[4][CONV_REG_TAPS];
#pragma unroll
  for (int e = 0; e < 4; e++)
#pragma unroll
    for (int j = 0; j < CONV_REG_TAPS; j++) wr[e][j] = active && j < kw ? bf(convw[(i64)(c0 + e) * kw + j]) : 0.f;
  // The end of every output row: the key heads' sums of squares (shuffles: every lane of the warp
  // must get here), L2 norms and scales, the f32 stores.
  auto emit = [&](i64 t, const float (&v)[4]) {
    float ss = v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
    for (int o = G >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (active) {
      float sc = 1.f;
      float* dst;
      if (c0 < 2 * kd) {
        sc = rsqrtf(ss + 1e-6f);
        if (c0 < kd) {
          sc *= rsqrtf((float)dk);
          dst = qo + t * kd + c0;
        } else {
          dst = ko + t * kd + (c0 - kd);
        }
        *(float4*)dst = make_float4(v[0] * sc, v[1] * sc, v[2] * sc, v[3] * sc);
      } else {
        dst = vo + t * (i64)(vh * dv) + (c0 - 2 * kd);
        *(float4*)dst = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
  };
  // Rows t .. t_end-1 one at a time, any kw, from their sequences' inputs and histories. Row-level
  // control flow is uniform over the block (depends on blockIdx and the row only), so every lane of
  // a warp reaches the shuffles.
  auto row_loop = [&](i64 t_begin, i64 t_end) {
    i64 row0 = 0, row1 = 0;  // the current sequence's rows [row0, row1)
    const float* hist = nullptr;
    // The inputs of the register taps for the last row computed (win[j]: local row i + j - (kw-1)),
    // so that the next row of the same sequence loads one new input row instead of kw.
    float win[CONV_REG_TAPS][4];
    int last_i = -2;  // local row of the inputs in win; -2: none (a new sequence or the first row)
    for (i64 t = t_begin; t < t_end; t++) {
      if (t < row0 || t >= row1) {
        const int s = find_row_segment<4>(segs, nseg, t);
        if (s < 0) continue;
        row0 = segs[4 * s];
        row1 = row0 + segs[4 * s + 1];
        hist = (const float*)segs[4 * s + 2];
        last_i = -2;
      }
      const int i = (int)(t - row0);
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      if (active) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f}, xv[4];
        // Input row l of this sequence (l < 0: its history).
        auto input = [&](int l, float (&o)[4]) {
          if (l >= 0) {
            load4_bf16(x + (row0 + l) * ld + c0, vec != 0, o);
          } else {
#pragma unroll
            for (int e = 0; e < 4; e++) o[e] = hist[(i64)(kw - 1 + l) * C + c0 + e];
          }
        };
        const int jl = min(kw, CONV_REG_TAPS) - 1;  // the last register tap
        if (i == last_i + 1) {
          // Slide: register taps 0..jl-1 take the previous row's taps 1..jl; tap jl is read.
#pragma unroll
          for (int j = 0; j + 1 < CONV_REG_TAPS; j++)
            if (j < jl)
#pragma unroll
              for (int e = 0; e < 4; e++) win[j][e] = win[j + 1][e];
          input(i + jl - (kw - 1), xv);
#pragma unroll
          for (int j = 0; j < CONV_REG_TAPS; j++)
            if (j == jl)
#pragma unroll
              for (int e = 0; e < 4; e++) win[j][e] = xv[e];
        } else {
#pragma unroll
          for (int j = 0; j < CONV_REG_TAPS; j++)
            if (j < kw) input(i + j - (kw - 1), win[j]);
        }
        last_i = i;
#pragma unroll
        for (int j = 0; j < CONV_REG_TAPS; j++) {
          if (j < kw) {
#pragma unroll
            for (int e = 0; e < 4; e++) acc[e] += wr[e][j] * win[j][e];
          }
        }
        for (int j = CONV_REG_TAPS; j < kw; j++) {
          input(i + j - (kw - 1), xv);
#pragma unroll
          for (int e = 0; e < 4; e++) acc[e] += bf(convw[(i64)(c0 + e) * kw + j]) * xv[e];
        }
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = silu_f(acc[e]);
      }
      emit(t, v);
    }
  };

  const i64 t0 = (i64)blockIdx.x * groups * GROUP, t_last = min(n, t0 + (i64)groups * GROUP);
  const bool stream = kw == CONV_REG_TAPS && active;
  constexpr int K1 = CONV_REG_TAPS - 1;  // kw - 1 when the window is used
  // win[l]: input row t + l - K1 of the group starting at row t (zero past the batch's rows).
  uint2 win[WINDOW];
#pragma unroll
  for (int l = 0; l < WINDOW; l++) {
    const i64 r = t0 + l - K1;
    win[l] = stream && r >= 0 && r < n ? load4_bf16_raw(x + r * ld + c0, vec != 0) : make_uint2(0u, 0u);
  }
  i64 seg0 = 0, seg1 = 0;  // the rows [seg0, seg1) of the sequence of the last group looked up
  for (i64 t = t0; t < t_last; t += GROUP) {
    bool fast = false;
    if (kw == CONV_REG_TAPS && t + GROUP <= t_last) {
      if (t < seg0 || t >= seg1) {
        const int s = find_row_segment<4>(segs, nseg, t);
        seg0 = s >= 0 ? segs[4 * s] : 0;
        seg1 = s >= 0 ? seg0 + segs[4 * s + 1] : 0;
      }
      fast = t - seg0 >= K1 && t + GROUP <= seg1;
    }
    // The next group's input rows: in flight while a window group computes (after a row-loop
    // group, which keeps its own inputs, so that the window is not live through it).
    uint2 next[GROUP];
    auto load_next = [&]() {
#pragma unroll
      for (int u = 0; u < GROUP; u++) {
        const i64 r = t + GROUP + u;
        next[u] = stream && r < t_last ? load4_bf16_raw(x + r * ld + c0, vec != 0) : make_uint2(0u, 0u);
      }
    };
    if (fast) {
      load_next();
      // Output row t + r reads win[r + j], taps j = 0..kw-1: the row loop's sum, in its order.
#pragma unroll
      for (int r = 0; r < GROUP; r++) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (active) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < CONV_REG_TAPS; j++) {
            float xv[4];
            unpack4_bf16(win[r + j], xv);
#pragma unroll
            for (int e = 0; e < 4; e++) acc[e] += wr[e][j] * xv[e];
          }
#pragma unroll
          for (int e = 0; e < 4; e++) v[e] = silu_f(acc[e]);
        }
        emit(t + r, v);
      }
    } else {
      row_loop(t, min(t + GROUP, t_last));
      load_next();
    }
#pragma unroll
    for (int l = 0; l < WINDOW; l++) win[l] = l < K1 ? win[l + GROUP] : next[l - K1];
  }
  // The gates of the block's rows: one (row, value head) per thread of the grid's columns.
  const int nthreads = gridDim.y * blockDim.x;
  const int rows = (int)(t_last - t0);
  for (int i = grp; i < rows * vh; i += nthreads) {
    const int h = i % vh;
    const i64 t = t0 + i / vh;
    const float ea = -expf(alog[h]), db = dtb[h];
    beta[t * vh + h] = sigmoid_f(bf(b[t * ld + h]));
    gout[t * vh + h] = ea * softplus_f(bf(a[t * ld + h]) + db);
  }
}
#define GDN_CONV_ENTRY(GROUP, MINB)                                                                         \
  extern "C" __global__ void __launch_bounds__(256, MINB) gdn_conv_##GROUP(                                 \
      const bf16* x, i64 ld, int vec, const bf16* convw, int kw, const i64* segs, int nseg, i64 n, int groups, \
      const bf16* b, const bf16* a, const float* alog, const float* dtb, float* qo, float* ko, float* vo,      \
      float* beta, float* gout, int kh, int vh, int dk, int dv) {                                            \
    pdl_begin();                                                                                             \
    gdn_conv<GROUP>(x, ld, vec, convw, kw, segs, nseg, n, groups, b, a, alog, dtb, qo, ko, vo, beta, gout, kh, vh, \
                    dk, dv);                                                                                 \
  }
GDN_CONV_ENTRY(8, 2)
GDN_CONV_ENTRY(4, 3)

// After gdn_conv: the history becomes the last kw-1 inputs of [history; new rows] (x as in
// gdn_conv: channel c of row t at x[t*ld + c]). One thread per (channel, sequence); rows are
// shifted in ascending order, which is safe in place (in == out).
extern "C" __global__ void gdn_conv_hist(const bf16* x, i64 ld, const i64* segs, int C, int kw) {
  pdl_begin();
  const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
  if (c >= C) return;
  const i64 row0 = segs[4 * s];
  const int len = (int)segs[4 * s + 1];
  const float* hin = (const float*)segs[4 * s + 2];
  float* hout = (float*)segs[4 * s + 3];
  if (hout == nullptr) return;  // not kept
  const int h = kw - 1;
  for (int r = 0; r < h; r++) {
    int src = len - h + r;
    float v = src >= 0 ? bf(x[(row0 + src) * ld + c]) : hin[(i64)(h + src) * C + c];
    hout[(i64)r * C + c] = v;
  }
}

// x rounded to TF32 (10-bit mantissa, to nearest, ties away), as the bits of an f32 / as an f32.
__device__ __forceinline__ unsigned f2tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(f2tf32(x)); }

// Stages rows row0.. (len of them, zeros up to 64) of key head hk of q and k, transposed: Xt[d][i] at
// Xt + d*LDQK + i. Global reads are 16-byte and coalesced (a warp reads 4 float4 from each of 8
// rows); the transposed shared stores of a warp hit 16 banks (2-way) thanks to the 68-float stride.
constexpr int LDQK = CHUNK + 4;
template <int DK, int THREADS = 256>
__device__ __forceinline__ void stage_qk_t(float* Kt, float* Qt, const float* qn, const float* kn, i64 row0, int len,
                                           int kh, int hk) {
  // Blocks are THREADS threads; compile-time trip counts let a thread's loads (4 rows of k and q
  // at a time) be in flight together instead of one L2 round trip per iteration.
  constexpr int N = CHUNK * DK / 4 / THREADS > 0 ? CHUNK * DK / 4 / THREADS : 1;
  constexpr int G = N < 4 ? N : 4;
#pragma unroll
  for (int u0 = 0; u0 < N; u0 += G) {
    float4 kv[G], qv[G];
#pragma unroll
    for (int u = 0; u < G; u++) {
      const int t = threadIdx.x + THREADS * (u0 + u);
      const int i = (t & 7) + 8 * ((t >> 3) / (DK / 4)), d = 4 * ((t >> 3) % (DK / 4));
      kv[u] = qv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t < CHUNK * DK / 4 && i < len) {
        const i64 src = ((row0 + i) * kh + hk) * DK + d;
        kv[u] = *(const float4*)(kn + src);
        qv[u] = *(const float4*)(qn + src);
      }
    }
#pragma unroll
    for (int u = 0; u < G; u++) {
      const int t = threadIdx.x + THREADS * (u0 + u);
      if (t >= CHUNK * DK / 4) continue;
      const int i = (t & 7) + 8 * ((t >> 3) / (DK / 4)), d = 4 * ((t >> 3) % (DK / 4));
      Kt[(d + 0) * LDQK + i] = kv[u].x;
      Kt[(d + 1) * LDQK + i] = kv[u].y;
      Kt[(d + 2) * LDQK + i] = kv[u].z;
      Kt[(d + 3) * LDQK + i] = kv[u].w;
      Qt[(d + 0) * LDQK + i] = qv[u].x;
      Qt[(d + 1) * LDQK + i] = qv[u].y;
      Qt[(d + 2) * LDQK + i] = qv[u].z;
      Qt[(d + 3) * LDQK + i] = qv[u].w;
    }
  }
}

// Copies NC columns c0.. (ncols of them real, a multiple of 4; the rest zero) of a [DK][dv] state
// into S [DK][ld] with 16-byte asynchronous copies (the caller waits).
template <int DK, int NC = 32>
__device__ __forceinline__ void load_state_async(float* S, int ld, const float* state_in, int dv, int c0, int ncols) {
  for (int idx = threadIdx.x; idx < DK * (NC / 4); idx += blockDim.x) {
    const int d = idx / (NC / 4), c = (idx % (NC / 4)) * 4;
    const bool ok = c < ncols;
    cp_async16(S + d * ld + c, state_in + (ok ? (i64)d * dv + c0 + c : 0), ok);
  }
}

// Threads 0..63: beta of the chunk's rows and gamma = cumsum(g) as two 32-row warp scans; the
// caller adds gam[31] to rows 32.. after a barrier. Rows past len get beta = g = 0.
__device__ __forceinline__ void chunk_gates(float* gam, float* bet, const float* g, const float* beta, i64 row0,
                                            int len, int vh, int hv) {
  const int t = threadIdx.x;
  if (t >= CHUNK) return;
  const bool ok = t < len;
  float x = ok ? g[(row0 + t) * vh + hv] : 0.f;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float u = __shfl_up_sync(0xffffffffu, x, o);
    if ((t & 31) >= o) x += u;
  }
  gam[t] = x;
  bet[t] = ok ? beta[(row0 + t) * vh + hv] : 0.f;
}

// Everything a scan chunk starts from, after the barrier that ends the previous chunk: q and k
// staged transposed, R <- v (columns c0.., row stride ldr, zeros past len / ncols) by cp.async,
// gamma and beta; returns after the barriers that make them visible (gamma's upper half fixed up).
// NC: the block's value columns (32, or all of them up to 128 in the wide scan); THREADS: its size.
template <int DK, int NC = 32, int THREADS = 256>
__device__ __forceinline__ void chunk_inputs(float* Kt, float* Qt, float* R, int ldr, float* gam, float* bet,
                                             const float* qn, const float* kn, const float* v, const float* g,
                                             const float* beta, i64 row0, int len, int kh, int hk, int vh, int hv,
                                             int dv, int c0, int ncols) {
  __syncthreads();
  stage_qk_t<DK, THREADS>(Kt, Qt, qn, kn, row0, len, kh, hk);
  for (int idx = threadIdx.x; idx < CHUNK * (NC / 4); idx += blockDim.x) {
    const int i = idx / (NC / 4), c = (idx % (NC / 4)) * 4;
    const bool ok = i < len && c < ncols;
    cp_async16(R + i * ldr + c, v + (ok ? ((row0 + i) * vh + hv) * dv + c0 + c : 0), ok);
  }
  chunk_gates(gam, bet, g, beta, row0, len, vh, hv);
  cp_async_wait_all();
  __syncthreads();
  if (threadIdx.x >= 32 && threadIdx.x < CHUNK) gam[threadIdx.x] += gam[31];
  __syncthreads();
}

// Where a scan block writes value head hv's final state: state_out of scan table entry s offset to
// the head, or nullptr when the entry's state_out is 0 (not kept).
template <int DK>
__device__ __forceinline__ float* scan_state_out(const i64* segs, int s, int hv, int dv) {
  const i64 out = segs[4 * s + 3];
  return out == 0 ? nullptr : (float*)out + (i64)hv * DK * dv;
}

// The twin of load_state_async: waits for outstanding copies (a sequence with no rows still copies
// its state), then writes the real columns of S [DK][ld] back to a [DK][dv] state (nothing when
// state is nullptr: not kept).
template <int DK, int NC = 32>
__device__ __forceinline__ void store_state(float* state, int dv, int c0, int ncols, const float* S, int ld) {
  cp_async_wait_all();
  __syncthreads();
  if (state == nullptr) return;
  for (int idx = threadIdx.x; idx < DK * NC; idx += blockDim.x) {
    const int d = idx / NC, c = idx % NC;
    if (c < ncols) state[(i64)d * dv + c0 + c] = S[d * ld + c];
  }
}

// Chunk matrices, all f32, per chunk of <= 64 rows (rows past the chunk's length have beta = g = 0 and
// zero q, k, v, so they add nothing). gamma = cumsum(g) inside the chunk (per value head);
//   P[i][j] = e^{gamma_i - gamma_j} q_i.k_j              (j <= i, else 0)
//   A[i][j] = beta_i e^{gamma_i - gamma_j} k_i.k_j       (j < i, else 0)
//   T = (I + A)^-1                                       (unit lower triangular)
// Both are stored TRANSPOSED, tp[(chunk*vh + hv)*2 + {0: T, 1: P}][j][i], so that the scan reads the
// entries of 4 consecutive rows i of one column j with one 16-byte load. gdn_chunk_prep_rm_<DK> (RM,
// for the warpgroup scan of deltanet_wg.cu, whose operands are whole rows) stores them ROW-MAJOR,
// tp[...][i][j], and also writes each chunk's K^T, kt[(chunk*kh + hk)][d][i] (zeros past the
// chunk's length), from the staging; all three rounded to TF32 (the tensor cores would otherwise
// truncate these shared-memory operands; the mma.sync scans round theirs with cvt.rna too), and
// only where that scan reads them: T and P rows < len, columns < rm_read_cols(len), K^T columns
// < rm_read_cols(len) (a pass's 9-row second chunk: ~7 KB of a head pair's 64 KB). Rows past len
// are never computed: their products are +0 and their T rows e_i (the loops' exact result).

// One column c of T = (I + A)^-1 by forward substitution, T_i = e_i - sum_{j<i} A_ij T_j, in
// registers (no barriers), stored as chunk_prep stores it. Only rows < ROWS (>= the chunk's len)
// are computed: A's rows past len are +0, so the loop would give exactly e_c's entry there (1 or
// +0), which rows ROWS.. take directly. Same bits for every ROWS >= len.
template <int ROWS, bool RM>
__device__ __forceinline__ void prep_solve_store(const float* Ah, int c, int len, float* Tg) {
  constexpr int LDA = CHUNK + 1;
  float x[CHUNK];
#pragma unroll
  for (int i = 0; i < CHUNK; i++) {
    float s0 = i == c ? 1.f : 0.f, s1 = 0.f;
    if (i < ROWS) {
#pragma unroll
      for (int j = 0; j + 1 < i; j += 2) {
        s0 -= Ah[i * LDA + j] * x[j];
        s1 -= Ah[i * LDA + j + 1] * x[j + 1];
      }
      if (i & 1) s0 -= Ah[i * LDA + i - 1] * x[i - 1];
    }
    x[i] = s0 + s1;
  }
  if (RM) {
    if (c >= rm_read_cols(len)) return;
#pragma unroll
    for (int i = 0; i < ROWS; i++)
      if (i < len) Tg[i * CHUNK + c] = round_tf32(x[i]);
  } else {
#pragma unroll
    for (int i = 0; i < CHUNK; i += 4)
      *(float4*)(Tg + c * CHUNK + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
  }
}

// gdn_chunk_prep_<DK>: one block of 256 threads per (chunk, key head). q.k and k.k depend on the key
// head only and are computed once for its vh/kh value heads: thread (ti, tj) = (tid/16, tid%16) holds
// the 4x4 tile rows 4ti.., cols 4tj.. of both (tiles above the diagonal are zero) from q and k staged
// transposed in shared memory ([DK][64]: 16-byte loads of 4 rows). Then, two value heads at a time,
// P goes straight to global memory and A to shared memory (over the staging, no longer needed), and
// one thread per column c of T runs the forward substitution T_i = e_i - sum_{j<i} A_ij T_j for its
// column in registers (no barriers inside the solve; prep_solve_store above).
template <int DK, bool RM>
__device__ void chunk_prep(const float* qn, const float* kn, const float* beta, const float* g,
                           const int* chunks, int kh, int vh, float* tp, float* kt) {
  extern __shared__ __align__(16) float smem_prep[];
  constexpr int LDA = CHUNK + 1;
  constexpr int STAGE = (2 * DK * LDQK > 2 * CHUNK * LDA) ? 2 * DK * LDQK : 2 * CHUNK * LDA;
  float* Kt = smem_prep;             // [DK][68]   (staging)
  float* Qt = Kt + DK * LDQK;        // [DK][68]   (staging)
  float* As = smem_prep;             // [2][64][65] (after the dot products)
  float* gam = smem_prep + STAGE;    // [2][64]
  float* bet = gam + 2 * CHUNK;      // [2][64]
  const int ck = blockIdx.x, hk = blockIdx.y, r = vh / kh, tid = threadIdx.x;
  const i64 row0 = chunks[2 * ck];
  const int len = chunks[2 * ck + 1];
  stage_qk_t<DK>(Kt, Qt, qn, kn, row0, len, kh, hk);
  __syncthreads();
  if (RM) {
    float* kto = kt + ((i64)ck * kh + hk) * DK * CHUNK;
#pragma unroll
    for (int u = 0; u < DK * CHUNK / 4 / 256; u++) {
      const int idx = tid + 256 * u, d = idx >> 4, i4 = 4 * (idx & 15);
      if (i4 >= len) continue;  // the scan reads only the chunk's columns (rm_read_cols)
      const float4 k4 = *(const float4*)(Kt + d * LDQK + i4);
      *(float4*)(kto + d * CHUNK + i4) = make_float4(round_tf32(k4.x), round_tf32(k4.y), round_tf32(k4.z), round_tf32(k4.w));
    }
  }
  const int ti = tid >> 4, tj = tid & 15;
  float kk[4][4], qk[4][4];
#pragma unroll
  for (int a = 0; a < 4; a++)
#pragma unroll
    for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.f;
  if (tj <= ti && 4 * ti < len) {  // rows past len are zero: their sums stay +0
#pragma unroll 4
    for (int d = 0; d < DK; d++) {
      const float4 ki = *(const float4*)(Kt + d * LDQK + 4 * ti);
      const float4 kj = *(const float4*)(Kt + d * LDQK + 4 * tj);
      const float4 qi = *(const float4*)(Qt + d * LDQK + 4 * ti);
      const float xi[4] = {ki.x, ki.y, ki.z, ki.w}, yi[4] = {qi.x, qi.y, qi.z, qi.w}, xj[4] = {kj.x, kj.y, kj.z, kj.w};
#pragma unroll
      for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
          kk[a][b] += xi[a] * xj[b];
          qk[a][b] += yi[a] * xj[b];
        }
    }
  }
  for (int base = 0; base < r; base += 2) {
    const int nh = min(2, r - base);
    __syncthreads();  // staging reads done (first pair) / previous pair's solve done
    if (tid < 2 * CHUNK) {
      // gamma: inclusive scan of g over the chunk, 64 values per head = two warps.
      const int h = tid >> 6, i = tid & 63, hv = hk * r + base + h;
      const bool ok = h < nh && i < len;
      float v = ok ? g[(row0 + i) * vh + hv] : 0.f;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_up_sync(0xffffffffu, v, o);
        if ((tid & 31) >= o) v += u;
      }
      gam[tid] = v;
      bet[tid] = ok ? beta[(row0 + i) * vh + hv] : 0.f;
    }
    __syncthreads();
    if (tid < 2 * CHUNK && (tid & 63) >= 32) gam[tid] += gam[(tid & ~63) + 31];
    __syncthreads();
    for (int h = 0; h < nh; h++) {
      const int hv = hk * r + base + h;
      float* Ah = As + h * CHUNK * LDA;
      float* Pg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK + CHUNK * CHUNK;
      const float* gh = gam + h * CHUNK;
      float pv[4][4];
#pragma unroll
      for (int b = 0; b < 4; b++) {
        const int j = 4 * tj + b;
#pragma unroll
        for (int a = 0; a < 4; a++) {
          const int i = 4 * ti + a;
          const float e = j <= i ? expf(gh[i] - gh[j]) : 0.f;
          Ah[i * LDA + j] = j < i ? bet[h * CHUNK + i] * kk[a][b] * e : 0.f;
          pv[a][b] = j <= i ? qk[a][b] * e : 0.f;
        }
        if (!RM) *(float4*)(Pg + j * CHUNK + 4 * ti) = make_float4(pv[0][b], pv[1][b], pv[2][b], pv[3][b]);
      }
      if (RM && 4 * ti < len && 4 * tj < len) {  // only the tiles the scan reads (rm_read_cols)
#pragma unroll
        for (int a = 0; a < 4; a++)
          *(float4*)(Pg + (4 * ti + a) * CHUNK + 4 * tj) =
              make_float4(round_tf32(pv[a][0]), round_tf32(pv[a][1]), round_tf32(pv[a][2]), round_tf32(pv[a][3]));
      }
    }
    __syncthreads();
    if (tid < nh * CHUNK) {
      const int h = tid >> 6, c = tid & 63, hv = hk * r + base + h;
      const float* Ah = As + h * CHUNK * LDA;
      float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
      // A pass's short second chunk solves 16 rows; a row past len is e_c either way.
      if (len <= 16) prep_solve_store<16, RM>(Ah, c, len, Tg);
      else prep_solve_store<CHUNK, RM>(Ah, c, len, Tg);
    }
  }
}

#define PREP_ENTRY(NAME, DK, RM)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) NAME(const float* qn, const float* kn, const float* beta,     \
                                                         const float* g, const int* chunks, int kh, int vh,      \
                                                         float* tp, float* kt) {                                 \
    pdl_begin();                                                                                                 \
    chunk_prep<DK, RM>(qn, kn, beta, g, chunks, kh, vh, tp, kt);                                                  \
  }
PREP_ENTRY(gdn_chunk_prep_16, 16, false)
PREP_ENTRY(gdn_chunk_prep_32, 32, false)
PREP_ENTRY(gdn_chunk_prep_64, 64, false)
PREP_ENTRY(gdn_chunk_prep_128, 128, false)
PREP_ENTRY(gdn_chunk_prep_rm_32, 32, true)
PREP_ENTRY(gdn_chunk_prep_rm_64, 64, true)
PREP_ENTRY(gdn_chunk_prep_rm_128, 128, true)

// The sequential part, per (sequence, value head, 32 value columns c0..): for each chunk in order,
//   R_i  = beta_i (v_i - e^{gamma_i} k_i S)          (S: the state before the chunk, [dk, 32])
//   Vn   = T R                                        (= U - W S of the WY form)
//   O_i  = e^{gamma_i} q_i S + sum_{j<=i} P_ij Vn_j
//   S   <- e^{gamma_last} S + sum_i e^{gamma_last - gamma_i} k_i^T Vn_i
// O is written in f32 to out [n, vh, dv]. Block of 256 threads. Row x column work (kS, qS, Vn, O) is
// tiled 4 rows x 2 columns per thread (rows 4*(tid/16).., columns 2*(tid%16)..), the state update
// 4 state rows x 4 columns per thread; q and k are staged transposed ([DK][64], k padded to 68) so 4 rows are one
// 16-byte load; the q staging is reused for T and P (also transposed) once q S is done. Warps whose
// rows are all past the chunk's length skip the row work; the state update sums over real rows only.
template <int DK>
__device__ void chunk_scan(const float* qn, const float* kn, const float* v, const float* beta, const float* g,
                           const float* tp, const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {
  extern __shared__ __align__(16) float smem_scan[];
  constexpr int QREG = (DK * LDQK > 2 * CHUNK * CHUNK) ? DK * LDQK : 2 * CHUNK * CHUNK;
  constexpr int LDK = LDQK;        // the state update's 4 rows per load hit 4 banks with stride 68
  float* Kt = smem_scan;           // [DK][68]
  float* Qt = Kt + DK * LDK;       // [DK][68], then Tt [64][64] and Pt [64][64]
  float* Tt = Qt;
  float* Pt = Qt + CHUNK * CHUNK;
  float* S = Qt + QREG;            // [DK][32]
  float* R = S + DK * 32;          // [64][32]
  float* Vn = R + CHUNK * 32;      // [64][32]
  float* gam = Vn + CHUNK * 32;
  float* bet = gam + CHUNK;
  float* fac = bet + CHUNK;
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * 32, hk = hv / (vh / kh), tid = threadIdx.x;
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1];
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);
  const int ncols = min(32, dv - c0);
  const int rg = tid >> 4, cg = tid & 15, i0 = 4 * rg, cc = 2 * cg;
  // S is updated after chunk ck when ck + 1 < last_update: after every chunk, except the last
  // one of a state that is not kept.
  const int last_update = first + nch + (state != nullptr);
  load_state_async<DK>(S, 32, state_in, dv, c0, ncols);  // waited for with the first chunk's copies
  for (int ck = first; ck < first + nch; ck++) {
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    chunk_inputs<DK>(Kt, Qt, R, 32, gam, bet, qn, kn, v, g, beta, row0, len, kh, hk, vh, hv, dv, c0, ncols);
    // k S and q S for rows i0..i0+3, columns cc, cc+1.
    float ks[4][2], qs[4][2];
#pragma unroll
    for (int a = 0; a < 4; a++) ks[a][0] = ks[a][1] = qs[a][0] = qs[a][1] = 0.f;
    if (i0 < len) {
#pragma unroll 4
      for (int d = 0; d < DK; d++) {
        const float4 k4 = *(const float4*)(Kt + d * LDK + i0);
        const float4 q4 = *(const float4*)(Qt + d * LDK + i0);
        const float2 s2 = *(const float2*)(S + d * 32 + cc);
        const float kr[4] = {k4.x, k4.y, k4.z, k4.w}, qr[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int a = 0; a < 4; a++) {
          ks[a][0] += kr[a] * s2.x;
          ks[a][1] += kr[a] * s2.y;
          qs[a][0] += qr[a] * s2.x;
          qs[a][1] += qr[a] * s2.y;
        }
      }
    }
    __syncthreads();  // q is no longer needed: its staging now takes T and P
    const float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
    for (int idx = tid; idx < 2 * CHUNK * CHUNK / 4; idx += blockDim.x) cp_async16(Tt + 4 * idx, Tg + 4 * idx, true);
#pragma unroll
    for (int a = 0; a < 4; a++) {
      const int i = i0 + a;
      const float e = expf(gam[i]);
      R[i * 32 + cc] = bet[i] * (R[i * 32 + cc] - e * ks[a][0]);
      R[i * 32 + cc + 1] = bet[i] * (R[i * 32 + cc + 1] - e * ks[a][1]);
    }
    if (tid < CHUNK) fac[tid] = expf(gam[CHUNK - 1] - gam[tid]);
    cp_async_wait_all();
    __syncthreads();
    // Vn = T R over j <= min(i0 + 3, len - 1) (T is lower triangular; rows past len are never read).
    const int jmax = min(i0 + 3, len - 1);
    float acc[4][2];
#pragma unroll
    for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = 0.f;
    for (int j = 0; i0 < len && j <= jmax; j++) {
      const float4 t4 = *(const float4*)(Tt + j * CHUNK + i0);
      const float2 r2 = *(const float2*)(R + j * 32 + cc);
      const float tr[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
      for (int a = 0; a < 4; a++) {
        acc[a][0] += tr[a] * r2.x;
        acc[a][1] += tr[a] * r2.y;
      }
    }
#pragma unroll
    for (int a = 0; a < 4; a++) *(float2*)(Vn + (i0 + a) * 32 + cc) = make_float2(acc[a][0], acc[a][1]);
    __syncthreads();
    // O = e^gamma (q S) + P Vn.
#pragma unroll
    for (int a = 0; a < 4; a++) {
      const float e = expf(gam[i0 + a]);
      acc[a][0] = e * qs[a][0];
      acc[a][1] = e * qs[a][1];
    }
    for (int j = 0; i0 < len && j <= jmax; j++) {
      const float4 p4 = *(const float4*)(Pt + j * CHUNK + i0);
      const float2 v2 = *(const float2*)(Vn + j * 32 + cc);
      const float pr[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
      for (int a = 0; a < 4; a++) {
        acc[a][0] += pr[a] * v2.x;
        acc[a][1] += pr[a] * v2.y;
      }
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
      const int i = i0 + a;
      if (i < len) {
        float* o = out + ((row0 + i) * vh + hv) * dv + c0;
        if (cc < ncols) o[cc] = acc[a][0];
        if (cc + 1 < ncols) o[cc + 1] = acc[a][1];
      }
    }
    // S <- e^{gamma_last} S + sum_{i < len} fac_i k_i^T Vn_i: per thread state rows d0 + 4a (a < 4),
    // columns c4..c4+3; a warp's four d0 are consecutive, so with k's stride of 68 they hit 4 banks.
    const float el = expf(gam[CHUNK - 1]);
    const int tasks = (ck + 1 < last_update) ? DK / 4 * 8 : 0;
    for (int t = tid; t < tasks; t += blockDim.x) {
      const int d0 = 16 * (t >> 5) + ((t >> 3) & 3), c4 = 4 * (t & 7);
      float sa[4][4];
#pragma unroll
      for (int a = 0; a < 4; a++) {
        const float4 s4 = *(const float4*)(S + (d0 + 4 * a) * 32 + c4);
        sa[a][0] = el * s4.x;
        sa[a][1] = el * s4.y;
        sa[a][2] = el * s4.z;
        sa[a][3] = el * s4.w;
      }
      for (int i = 0; i < len; i++) {
        const float f = fac[i];
        const float4 v4 = *(const float4*)(Vn + i * 32 + c4);
        const float vr[4] = {f * v4.x, f * v4.y, f * v4.z, f * v4.w};
#pragma unroll
        for (int a = 0; a < 4; a++) {
          const float k = Kt[(d0 + 4 * a) * LDK + i];
#pragma unroll
          for (int b = 0; b < 4; b++) sa[a][b] += k * vr[b];
        }
      }
#pragma unroll
      for (int a = 0; a < 4; a++) *(float4*)(S + (d0 + 4 * a) * 32 + c4) = make_float4(sa[a][0], sa[a][1], sa[a][2], sa[a][3]);
    }
  }
  store_state<DK>(state, dv, c0, ncols, S, 32);
}

#define SCAN_ENTRY(DK)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan_##DK(                                   \
      const float* qn, const float* kn, const float* v, const float* beta, const float* g, const float* tp, \
      const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {                            \
    pdl_begin();                                                                                           \
    chunk_scan<DK>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);                                 \
  }
SCAN_ENTRY(16)
SCAN_ENTRY(32)
SCAN_ENTRY(64)
SCAN_ENTRY(128)

// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan_tc_<DK>: the same scan with the four products on tensor cores, each as 3xTF32
// (x = hi + lo in TF32; a.b ~ hi.hi + hi.lo + lo.hi, f32 accumulation), which keeps f32-level
// accuracy for the recurrent state at a fraction of the FFMA kernel's instructions. Same grid,
// tables and outputs as gdn_chunk_scan_<DK>; 8 warps:
//   k S (warps 0-3, 16 rows each) and q S (warps 4-7), both 64 x 32 over DK;
//   Vn = T R (warps 0-3), O = e^gamma q S + P Vn (warps 4-7), both over j < 16*(warp%4)+16;
//   S <- e^{gamma_last} S + (fac k)^T Vn (warp w: state rows 16w.., over the chunk's real rows).
// gdn_chunk_scan_tf32_<DK> (and _tf32_pipelined_<DK> below): the same kernels with each product as
// ONE TF32 MMA (mma_p<1>), to measure how much of the per-chunk latency is the 3xTF32 chain.
// m16n8k8 TF32 fragments (gr = lane/4, tg = lane%4): A a0 (gr,tg) a1 (gr+8,tg) a2 (gr,tg+4)
// a3 (gr+8,tg+4); B b0 (tg,gr) b1 (tg+4,gr); C c0 (gr,2tg) c1 (gr,2tg+1) c2 (gr+8,2tg) c3 (gr+8,2tg+1).

__device__ __forceinline__ void mma_tf32_1688(float* d, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
struct TfA { unsigned hi[4], lo[4]; };
struct TfB { unsigned hi[2], lo[2]; };
__device__ __forceinline__ TfA split_a(float a0, float a1, float a2, float a3) {
  TfA r;
  const float a[4] = {a0, a1, a2, a3};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    r.hi[i] = f2tf32(a[i]);
    r.lo[i] = f2tf32(a[i] - __uint_as_float(r.hi[i]));
  }
  return r;
}
__device__ __forceinline__ TfB split_b(float b0, float b1) {
  TfB r;
  r.hi[0] = f2tf32(b0);
  r.lo[0] = f2tf32(b0 - __uint_as_float(r.hi[0]));
  r.hi[1] = f2tf32(b1);
  r.lo[1] = f2tf32(b1 - __uint_as_float(r.hi[1]));
  return r;
}
__device__ __forceinline__ void mma3(float* d, const TfA& a, const TfB& b) {
  mma_tf32_1688(d, a.lo, b.hi);
  mma_tf32_1688(d, a.hi, b.lo);
  mma_tf32_1688(d, a.hi, b.hi);
}
// One product on tensor cores at the scan's precision: P = 3 is 3xTF32 (f32-level), P = 1 one TF32
// MMA on the rounded operands (10-bit mantissas, as cuBLAS's TF32 mode; the lo halves computed by
// split_a/split_b are then dead code). The accumulator is f32 either way.
template <int P>
__device__ __forceinline__ void mma_p(float* d, const TfA& a, const TfB& b) {
  static_assert(P == 1 || P == 3, "P: 1 (TF32) or 3 (3xTF32)");
  if constexpr (P == 1) mma_tf32_1688(d, a.hi, b.hi);
  else mma3(d, a, b);
}
// A (16 x 8 at rows m0, cols k0) of A[m][k] = X[k*ld + m] (X stored transposed).
__device__ __forceinline__ TfA frag_at(const float* X, int ld, int m0, int k0, int gr, int tg) {
  return split_a(X[(k0 + tg) * ld + m0 + gr], X[(k0 + tg) * ld + m0 + gr + 8], X[(k0 + tg + 4) * ld + m0 + gr],
                 X[(k0 + tg + 4) * ld + m0 + gr + 8]);
}
// B (8 x 8 at rows k0, cols n0) of B[k][n] = X[k*ld + n].
__device__ __forceinline__ TfB frag_b(const float* X, int ld, int k0, int n0, int gr, int tg) {
  return split_b(X[(k0 + tg) * ld + n0 + gr], X[(k0 + tg + 4) * ld + n0 + gr]);
}

// acc[nt] += A . B over k in [0, kend): A is 16 rows m0.. of X stored transposed (X[k*LDX + m]), B
// the 8·NT columns of Y[k*LDY + n] (NT 8-column tiles; 4 in the 32-column scans).
template <int LDX, int LDY, int P, int NT>
__device__ __forceinline__ void mma_rows(float (&acc)[NT][4], const float* X, const float* Y, int m0, int kend,
                                         int gr, int tg) {
#pragma unroll 2
  for (int k0 = 0; k0 < kend; k0 += 8) {
    const TfA a = frag_at(X, LDX, m0, k0, gr, tg);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) mma_p<P>(acc[nt], a, frag_b(Y, LDY, k0, 8 * nt, gr, tg));
  }
}
// Stores the 16 x 8·NT accumulator tile at rows r0.. of Y (row stride LDY).
template <int LDY, int NT>
__device__ __forceinline__ void store_rows(float* Y, const float (&acc)[NT][4], int r0, int gr, int tg) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const int c = 8 * nt + 2 * tg;
    *(float2*)(Y + (r0 + gr) * LDY + c) = make_float2(acc[nt][0], acc[nt][1]);
    *(float2*)(Y + (r0 + gr + 8) * LDY + c) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// The plain chunk scan over NC value columns with THREADS threads (WARPS = THREADS / 32, a
// multiple of 8): gdn_chunk_scan_{tc,tf32}_<DK> is NC 32 with 8 warps, one block per (sequence,
// value head, 32 columns); gdn_chunk_scan_{tc,tf32}_wide_<DK> (below) NC 128 with 16 warps, one
// block per (sequence, value head). Per chunk, with the tiles of 16 rows x 8 columns:
//   k S (the first WARPS/2 warps) and q S (the others): rows 16(h%4).., NC/(WARPS/8) columns from
//     (h/4) NC/(WARPS/8), h the warp's index in its half;
//   Vn = T R: warp w rows 16(w%4).., columns 32(w/4).. (warps past NC/8 idle);
//   O = e^gamma q S + P Vn: the q S warps, on their tiles;
//   S <- e^{gamma_last} S + (fac k)^T Vn: warp w state rows 16(w%8).., NC/(WARPS/8) columns from
//     (w/8) NC/(WARPS/8).
// Every output and state element is the same MMA sequence over the same k order on the same
// operand values for any (NC, THREADS), and every elementwise step the same f32 expression: the
// plain and wide scans give the same bits (the device suite compares them bitwise).
template <int DK, int P, int NC, int THREADS>
__device__ void chunk_scan_tc_cols(const float* qn, const float* kn, const float* v, const float* beta,
                                   const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                   int vh, int dv, float* out) {
  constexpr int WARPS = THREADS / 32;
  static_assert((WARPS & (WARPS - 1)) == 0 && WARPS >= 8 && NC % (WARPS / 8) == 0 && NC % 32 == 0,
                "tile assignment");
  constexpr int CW = NC / (WARPS / 8);  // columns of a warp's k S / q S / O / state tiles
  constexpr int NT = CW / 8;
  extern __shared__ __align__(16) float smem_tc[];
  constexpr int LD = LDQK;                     // 68
  constexpr int LS = NC + 8;                   // S, R, Vn row stride: conflict-free B fragments
  constexpr int QREG = (DK * LD > 2 * CHUNK * LD) ? DK * LD : 2 * CHUNK * LD;
  float* Kt = smem_tc;                         // [DK][68]
  float* Qt = Kt + DK * LD;                    // [DK][68], then Tt [64][68] and Pt [64][68]
  float* Tt = Qt;
  float* Pt = Qt + CHUNK * LD;
  float* S = Qt + QREG;                        // [DK][LS]
  float* R = S + DK * LS;                      // [64][LS]
  float* Vn = R + CHUNK * LS;                  // [64][LS]
  float* gam = Vn + CHUNK * LS;
  float* bet = gam + CHUNK;
  float* fac = bet + CHUNK;
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * NC, hk = hv / (vh / kh), tid = threadIdx.x;
  // Masked to WARPS - 1 (a no-op for THREADS threads) so the compiler knows warp < WARPS and folds
  // the tile offsets that are 0 at 8 warps.
  const int warp = (tid >> 5) & (WARPS - 1), lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1];
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);
  const int ncols = min(NC, dv - c0);
  const int m0 = 16 * (warp & 3);  // this warp's rows in the row products and in Vn
  const bool kwarp = warp < WARPS / 2;
  const int ch = CW * ((warp & (WARPS / 2 - 1)) >> 2);   // k S / q S / O: this warp's columns
  const int cv = 32 * (warp >> 2);                       // Vn: this warp's 32 columns
  const int d0 = 16 * (warp & 7), cs = CW * (warp >> 3);  // state update: rows and columns
  load_state_async<DK, NC>(S, LS, state_in, dv, c0, ncols);  // waited for with the first chunk's copies
  for (int ck = first; ck < first + nch; ck++) {
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    chunk_inputs<DK, NC, THREADS>(Kt, Qt, R, LS, gam, bet, qn, kn, v, g, beta, row0, len, kh, hk, vh, hv, dv, c0,
                                  ncols);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    if (m0 < len) mma_rows<LD, LS, P>(acc, kwarp ? Kt : Qt, S + ch, m0, DK, gr, tg);
    __syncthreads();  // q is no longer needed: its staging now takes T and P
    const float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
    for (int idx = tid; idx < 2 * CHUNK * CHUNK / 4; idx += blockDim.x) {  // rolled: fewer instructions
      const int row = idx / 16, q4 = (idx % 16) * 4;  // row 0..127 over [T; P]
      cp_async16(Tt + row * LD + q4, Tg + 4 * idx, true);
    }
    if (kwarp) {
      // R_i = beta_i (v_i - e^{gamma_i} (k S)_i) on this thread's fragment elements.
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = m0 + gr + 8 * (e >> 1), c = ch + 8 * nt + 2 * tg + (e & 1);
          R[i * LS + c] = bet[i] * (R[i * LS + c] - expf(gam[i]) * acc[nt][e]);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] *= expf(gam[m0 + gr + 8 * (e >> 1)]);
    }
    if (tid < CHUNK) fac[tid] = expf(gam[CHUNK - 1] - gam[tid]);
    cp_async_wait_all();
    __syncthreads();
    // Vn = T R, 16 x 32 tiles. T is lower triangular: columns j < m0 + 16 suffice. Rows past len
    // come out 0 (their T row is e_i and R row 0) and are written, since the state update reads them.
    if (cv < NC) {
      float vacc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; nt++) vacc[nt][0] = vacc[nt][1] = vacc[nt][2] = vacc[nt][3] = 0.f;
      if (m0 < len) mma_rows<LD, LS, P>(vacc, Tt, R + cv, m0, m0 + 16, gr, tg);
      store_rows<LS>(Vn + cv, vacc, m0, gr, tg);
    }
    __syncthreads();
    // O = e^gamma q S + P Vn (the q S warps), rows below len and real columns written out.
    if (!kwarp && m0 < len) {
      mma_rows<LD, LS, P>(acc, Pt, Vn + ch, m0, m0 + 16, gr, tg);
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = m0 + gr + 8 * (e >> 1), c = ch + 8 * nt + 2 * tg + (e & 1);
          if (i < len && c < ncols) out[((row0 + i) * vh + hv) * dv + c0 + c] = acc[nt][e];
        }
    }
    // S <- e^{gamma_last} S + (fac k)^T Vn over real rows: warp w its rows d0.., columns cs...
    // (not after the last chunk of a state that is not kept).
    if (d0 < DK && (state != nullptr || ck + 1 < first + nch)) {
      const float el = expf(gam[CHUNK - 1]);
      float sacc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const int c = cs + 8 * nt + 2 * tg;
        sacc[nt][0] = el * S[(d0 + gr) * LS + c];
        sacc[nt][1] = el * S[(d0 + gr) * LS + c + 1];
        sacc[nt][2] = el * S[(d0 + gr + 8) * LS + c];
        sacc[nt][3] = el * S[(d0 + gr + 8) * LS + c + 1];
      }
      const int kmax = (len + 7) & ~7;
      for (int k0 = 0; k0 < kmax; k0 += 8) {
        const float f0 = fac[k0 + tg], f1 = fac[k0 + tg + 4];
        const TfA a = split_a(f0 * Kt[(d0 + gr) * LD + k0 + tg], f0 * Kt[(d0 + gr + 8) * LD + k0 + tg],
                              f1 * Kt[(d0 + gr) * LD + k0 + tg + 4], f1 * Kt[(d0 + gr + 8) * LD + k0 + tg + 4]);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mma_p<P>(sacc[nt], a, frag_b(Vn, LS, k0, cs + 8 * nt, gr, tg));
      }
      store_rows<LS>(S + cs, sacc, d0, gr, tg);
    }
  }
  store_state<DK, NC>(state, dv, c0, ncols, S, LS);
}
template <int DK, int P>
__device__ void chunk_scan_tc(const float* qn, const float* kn, const float* v, const float* beta, const float* g,
                              const float* tp, const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {
  chunk_scan_tc_cols<DK, P, 32, 256>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);
}

// The entry points of a chunk scan: TC_<DK> (3xTF32 products) and TF32_<DK> (one TF32 MMA each)
// of the scan template FN, launch bounds BOUNDS.
#define SCAN_TC_ENTRIES(TC, TF32, FN, BOUNDS, DK)                                                          \
  extern "C" __global__ void __launch_bounds__ BOUNDS TC##_##DK(                                           \
      const float* qn, const float* kn, const float* v, const float* beta, const float* g, const float* tp, \
      const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {                            \
    pdl_begin();                                                                                           \
    FN<DK, 3>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);                                      \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__ BOUNDS TF32##_##DK(                                         \
      const float* qn, const float* kn, const float* v, const float* beta, const float* g, const float* tp, \
      const int* chunks, const i64* segs, int kh, int vh, int dv, float* out) {                            \
    pdl_begin();                                                                                           \
    FN<DK, 1>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);                                      \
  }
SCAN_TC_ENTRIES(gdn_chunk_scan_tc, gdn_chunk_scan_tf32, chunk_scan_tc, (256), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc, gdn_chunk_scan_tf32, chunk_scan_tc, (256), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc, gdn_chunk_scan_tf32, chunk_scan_tc, (256), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc, gdn_chunk_scan_tf32, chunk_scan_tc, (256), 128)

// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan_{tc,tf32}_wide_<DK>: gdn_chunk_scan_{tc,tf32}_<DK> with one block per (sequence,
// value head) over all its value columns (dv <= 128, 16 warps), where the plain scan runs four
// blocks of 32 columns that each stage the chunk's q and k, load its T and P and compute its gates
// — four times the global round trips and staging per (sequence, head), and four times the blocks
// (a packed round of 96 short sequences: 12,288 blocks a layer). Each warp's MMAs cover 64
// columns where they covered 32, so a warp has twice the independent accumulators per k step.
// Same BITS as the plain scan (chunk_scan_tc_cols). The host picks it for short launches whose
// plain grid would take more than one wave (deltanet.rs scan_kernel): a packed round of 96
// sequences 29.3 -> 21.1 ms, a lone 2,048-token sequence 1.6x slower (bench/NOTES.md).
// Shared memory (layout::delta_tc_wide_smem_bytes): k and q staged transposed [DK][68] (q's
// staging then holds T and P), S [DK][136], R and Vn [64][136], the gates: 209,664 bytes at dk 128,
// one block per SM (16 warps, as two plain blocks).
template <int DK, int P>
__device__ void chunk_scan_tc_wide(const float* qn, const float* kn, const float* v, const float* beta, const float* g,
                                   const float* tp, const int* chunks, const i64* segs, int kh, int vh, int dv,
                                   float* out) {
  chunk_scan_tc_cols<DK, P, 128, 512>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);
}

SCAN_TC_ENTRIES(gdn_chunk_scan_tc_wide, gdn_chunk_scan_tf32_wide, chunk_scan_tc_wide, (512, 1), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_wide, gdn_chunk_scan_tf32_wide, chunk_scan_tc_wide, (512, 1), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_wide, gdn_chunk_scan_tf32_wide, chunk_scan_tc_wide, (512, 1), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_wide, gdn_chunk_scan_tf32_wide, chunk_scan_tc_wide, (512, 1), 128)

// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan_tc_pipelined_<DK>: gdn_chunk_scan_tc_<DK> with the next chunk's inputs in flight
// while the current chunk computes, for long sequences. Same grid, tables and outputs, and the
// same BITS: every product is the same 3xTF32 mma3 sequence over the same k order on the same
// operand values, every elementwise step the same f32 expression on the same values (the gates'
// exponentials are computed once per chunk, by one warp, instead of where they are used: expf of a
// value is one value). Only where operands live, which warp computes which tile, and when inputs
// arrive differ, so the host may pick either kernel per launch (by sequence length) and a
// sequence's result still never depends on what else is in the batch.
//
// Why: a long sequence is few blocks (16K tokens: 128), so the scan is latency-bound, and the tc
// scan waited on global memory for each chunk twice (q/k/v/gates, then T/P) behind 6 barriers.
// Here:
//   * q and k are copied row-major by cp.async (no register staging, no transposed stores;
//     stride DK+4 makes the row-major A fragments of k S and q S conflict-free, the state
//     update's column-wise ones 2-way, as the tc scan's k S ones were); T and P keep the prep's
//     transposed layout at stride 72 (conflict-free A fragments);
//   * K, Q and V (R is computed in place over V) have two buffers: chunk c+1's are copied while
//     chunk c computes. T and P have one buffer each, refilled as soon as chunk c is done with
//     them: T[c+1] after T R of chunk c, P[c] at the top of chunk c (it is read at its end);
//   * the gates of chunk c+1 (gamma = cumsum g with the tc scan's shuffle sequence, e^gamma,
//     the decay factors e^{gamma_63 - gamma}, beta) are computed by warp 4 while warps 0-3 compute
//     Vn = T R of chunk c, from g and beta it loaded at the top of chunk c;
//   * 3 barriers per chunk; warps 0-3 update the state (two 16-row tiles each at dk 128, sharing
//     the Vn fragments) while warps 4-7 compute O, instead of warps 4-7 doing both in turn.
// One chunk c, buffer b = (c - first) & 1, cp.async groups committed by every thread in the
// same order (empty when there is nothing to copy) so that the waits count alike:
//   wait<1> (K,Q,V[c] in; T[c] may fly) | bar | copy P[c]; commit | copy K,Q,V[c+1] -> b^1; commit
//   | k S (warps 0-3), q S (4-7) | R = beta (v - e^gamma k S), e^gamma q S
//   | wait<2> (T[c] in) | bar | Vn = T R (warps 0-3); gates of c+1 -> b^1 (warp 4)
//   | wait<1> (P[c] in) | bar | copy T[c+1]; commit | O = e^gamma q S + P Vn (4-7), S update (0-3)
// A buffer is refilled only after the barrier that follows its last read (K,Q,V[c-1] and P[c-1]:
// read before the top barrier of chunk c; T[c]: read before the third barrier of chunk c).
// Shared memory (layout::delta_tc_pipelined_smem_bytes): 224,768 bytes at dk 128, so one block
// per SM; the short-request path keeps gdn_chunk_scan_tc_<DK> (two per SM).

// A (16 x 8 at rows m0, cols k0) of A[m][k] = X[m*ld + k] (X stored row-major): the values of
// frag_at on the transposed copy of X.
__device__ __forceinline__ TfA frag_a(const float* X, int ld, int m0, int k0, int gr, int tg) {
  return split_a(X[(m0 + gr) * ld + k0 + tg], X[(m0 + gr + 8) * ld + k0 + tg], X[(m0 + gr) * ld + k0 + tg + 4],
                 X[(m0 + gr + 8) * ld + k0 + tg + 4]);
}

// mma_rows with A stored row-major (X[m*LDX + k]): the same mma3 sequence on the same values.
template <int LDX, int LDY, int P>
__device__ __forceinline__ void mma_rows_rm(float (&acc)[4][4], const float* X, const float* Y, int m0, int kend,
                                            int gr, int tg) {
#pragma unroll 2
  for (int k0 = 0; k0 < kend; k0 += 8) {
    const TfA a = frag_a(X, LDX, m0, k0, gr, tg);
#pragma unroll
    for (int nt = 0; nt < 4; nt++) mma_p<P>(acc[nt], a, frag_b(Y, LDY, k0, 8 * nt, gr, tg));
  }
}

// cp.async of a chunk's k and q rows of key head hk, row-major [64][DK+4], and of its v columns
// c0.. [64][40] (zeros past len and past ncols, as the tc scan stages them). 256 threads, each
// with fixed columns and every (256 / (DK/4))-th row, so the trip counts are compile-time and
// the per-thread offsets do not change from chunk to chunk. A zero-filled copy reads nothing but
// is still given a mapped address (the chunk's first row, or v itself).
template <int DK>
__device__ __forceinline__ void chunk_kqv_async(float* Ks, float* Qs, float* Vs, const float* qn, const float* kn,
                                                const float* v, i64 row0, int len, int kh, int hk, int vh, int hv,
                                                int dv, int c0, int ncols) {
  constexpr int LQ = DK + 4, PER_ROW = DK / 4, ROWS = 256 / PER_ROW;  // 16-byte pieces per row, rows per pass
  const int i0 = threadIdx.x / PER_ROW, d = 4 * (threadIdx.x % PER_ROW);
  const i64 first = (row0 * kh + hk) * DK + d, rstride = (i64)kh * DK;
#pragma unroll
  for (int u = 0; u < CHUNK / ROWS; u++) {
    const int i = i0 + ROWS * u;
    const bool ok = i < len;
    const i64 src = first + (ok ? i * rstride : 0);
    cp_async16(Ks + i * LQ + d, kn + src, ok);
    cp_async16(Qs + i * LQ + d, qn + src, ok);
  }
  const int vi0 = threadIdx.x / 8, c = (threadIdx.x % 8) * 4;
#pragma unroll
  for (int u = 0; u < CHUNK / 32; u++) {
    const int i = vi0 + 32 * u;
    const bool ok = i < len && c < ncols;
    cp_async16(Vs + i * 40 + c, v + (ok ? ((row0 + i) * vh + hv) * dv + c0 + c : 0), ok);
  }
}

// cp.async of one 64 x 64 chunk matrix (T or P, stored transposed by the prep) into [64][72]:
// thread t copies 16 bytes of rows t/16 + 16u. 256 threads.
__device__ __forceinline__ void chunk_mat_async(float* dst, const float* src) {
  const int r0 = threadIdx.x / 16, q4 = (threadIdx.x % 16) * 4;
#pragma unroll
  for (int u = 0; u < CHUNK / 16; u++) {
    const int row = r0 + 16 * u;
    cp_async16(dst + row * (CHUNK + 8) + q4, src + row * CHUNK + q4, true);
  }
}

// The gates of one chunk by one warp, lane l holding g and beta of rows l and l + 32 (zeros past
// the chunk's length): gamma by the same shuffle scans as chunk_gates (two 32-row scans, the upper
// one plus gamma_31), then G[0..64) = e^gamma, G[64..128) = e^{gamma_63 - gamma}, G[128..192) = beta
// (the values the tc scan computes where it uses them).
__device__ __forceinline__ void chunk_gates_warp(float* G, float g0, float g1, float b0, float b1, int lane) {
  float x0 = g0, x1 = g1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float u0 = __shfl_up_sync(0xffffffffu, x0, o);
    const float u1 = __shfl_up_sync(0xffffffffu, x1, o);
    if (lane >= o) {
      x0 += u0;
      x1 += u1;
    }
  }
  x1 += __shfl_sync(0xffffffffu, x0, 31);
  const float last = __shfl_sync(0xffffffffu, x1, 31);
  G[lane] = expf(x0);
  G[lane + 32] = expf(x1);
  G[CHUNK + lane] = expf(last - x0);
  G[CHUNK + lane + 32] = expf(last - x1);
  G[2 * CHUNK + lane] = b0;
  G[2 * CHUNK + lane + 32] = b1;
}

template <int DK, int P>
__device__ void chunk_scan_tc_pipelined(const float* qn, const float* kn, const float* v, const float* beta,
                                        const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                        int vh, int dv, float* out) {
  extern __shared__ __align__(16) float smem_tcp[];
  constexpr int LQ = DK + 4;                  // K, Q row stride
  constexpr int LT = CHUNK + 8;               // T, P row stride (72: conflict-free A fragments)
  constexpr int LS = 40;                      // S, V/R, Vn row stride (as the tc scan)
  constexpr int QK = CHUNK * LQ, VB = CHUNK * LS, GB = 3 * CHUNK;
  float* Kb = smem_tcp;                       // [2][64][LQ]
  float* Qb = Kb + 2 * QK;                    // [2][64][LQ]
  float* Vb = Qb + 2 * QK;                    // [2][64][40]: v, then R in place
  float* Tt = Vb + 2 * VB;                    // [64][72]
  float* Pt = Tt + CHUNK * LT;                // [64][72]
  float* S = Pt + CHUNK * LT;                 // [DK][40]
  float* Vn = S + DK * LS;                    // [64][40]
  float* gates = Vn + VB;                     // [2][3][64]: e^gamma, decay factors, beta
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * 32, hk = hv / (vh / kh), tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1], end = first + nch;
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);
  const int ncols = min(32, dv - c0);
  const int m0 = 16 * (warp & 3);  // this warp's rows in the row products
  const bool kwarp = warp < 4;
  const float* tph = tp + (i64)hv * 2 * CHUNK * CHUNK;  // T of chunk ck at tph + ck * vh * 2 * 64 * 64
  const i64 tstride = (i64)vh * 2 * CHUNK * CHUNK;
  // Prologue: the state with chunk `first`'s K, Q, V (one group), its T (the next group), its
  // gates (warp 4; seen by all after the loop's first barrier).
  i64 row0 = 0, nrow0 = 0;
  int len = 0, nlen = 0;
  load_state_async<DK>(S, LS, state_in, dv, c0, ncols);
  if (nch > 0) {
    row0 = chunks[2 * first];
    len = chunks[2 * first + 1];
    chunk_kqv_async<DK>(Kb, Qb, Vb, qn, kn, v, row0, len, kh, hk, vh, hv, dv, c0, ncols);
  }
  cp_async_commit();
  if (nch > 0) chunk_mat_async(Tt, tph + first * tstride);
  cp_async_commit();
  if (nch > 0 && warp == 4) {
    const float g0 = lane < len ? g[(row0 + lane) * vh + hv] : 0.f;
    const float g1 = lane + 32 < len ? g[(row0 + lane + 32) * vh + hv] : 0.f;
    const float b0 = lane < len ? beta[(row0 + lane) * vh + hv] : 0.f;
    const float b1 = lane + 32 < len ? beta[(row0 + lane + 32) * vh + hv] : 0.f;
    chunk_gates_warp(gates, g0, g1, b0, b1, lane);
  }
  if (nch > 1) {
    nrow0 = chunks[2 * first + 2];
    nlen = chunks[2 * first + 3];
  }
  for (int ck = first; ck < end; ck++) {
    const int b = (ck - first) & 1;
    const float* K = Kb + b * QK;
    const float* Q = Qb + b * QK;
    float* R = Vb + b * VB;
    const float* G = gates + b * GB;
    const bool has_next = ck + 1 < end;
    cp_async_wait_group<1>();  // this chunk's K, Q, V (and the state); its T may still be in flight
    __syncthreads();           // ... visible to all; chunk ck-1 is done with S, Vn, P and buffer b^1
    chunk_mat_async(Pt, tph + ck * tstride + CHUNK * CHUNK);
    cp_async_commit();
    if (has_next)
      chunk_kqv_async<DK>(Kb + (b ^ 1) * QK, Qb + (b ^ 1) * QK, Vb + (b ^ 1) * VB, qn, kn, v, nrow0, nlen, kh, hk,
                          vh, hv, dv, c0, ncols);
    cp_async_commit();
    // Warp 4: the next chunk's g and beta, into registers (used after k S / q S).
    float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f;
    if (has_next && warp == 4) {
      g0 = lane < nlen ? g[(nrow0 + lane) * vh + hv] : 0.f;
      g1 = lane + 32 < nlen ? g[(nrow0 + lane + 32) * vh + hv] : 0.f;
      b0 = lane < nlen ? beta[(nrow0 + lane) * vh + hv] : 0.f;
      b1 = lane + 32 < nlen ? beta[(nrow0 + lane + 32) * vh + hv] : 0.f;
    }
    // The chunk after next, for the next iteration's copies.
    i64 n2row0 = 0;
    int n2len = 0;
    if (ck + 2 < end) {
      n2row0 = chunks[2 * ck + 4];
      n2len = chunks[2 * ck + 5];
    }
    // k S (warps 0-3) or q S (warps 4-7): rows m0..m0+15, 4 column tiles of 8.
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    if (m0 < len) mma_rows_rm<LQ, LS, P>(acc, kwarp ? K : Q, S, m0, DK, gr, tg);
    if (kwarp) {
      // R_i = beta_i (v_i - e^{gamma_i} (k S)_i) on this thread's fragment elements.
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = m0 + gr + 8 * (e >> 1), c = 8 * nt + 2 * tg + (e & 1);
          R[i * LS + c] = G[2 * CHUNK + i] * (R[i * LS + c] - G[i] * acc[nt][e]);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] *= G[m0 + gr + 8 * (e >> 1)];
    }
    cp_async_wait_group<2>();  // T of this chunk
    __syncthreads();
    // Vn = T R (warps 0-3), as the tc scan: columns j < m0 + 16, rows past len written (as 0).
    if (kwarp) {
      float vacc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; nt++) vacc[nt][0] = vacc[nt][1] = vacc[nt][2] = vacc[nt][3] = 0.f;
      if (m0 < len) mma_rows<LT, LS, P>(vacc, Tt, R, m0, m0 + 16, gr, tg);
      store_rows<LS>(Vn, vacc, m0, gr, tg);
    } else if (warp == 4 && has_next) {
      chunk_gates_warp(gates + (b ^ 1) * GB, g0, g1, b0, b1, lane);
    }
    cp_async_wait_group<1>();  // P of this chunk
    __syncthreads();           // Vn and P visible; T is free
    if (has_next) chunk_mat_async(Tt, tph + (ck + 1) * tstride);
    cp_async_commit();
    if (!kwarp) {
      // O = e^gamma q S + P Vn (warps 4-7), rows below len written out.
      if (m0 < len) {
        mma_rows<LT, LS, P>(acc, Pt, Vn, m0, m0 + 16, gr, tg);
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int i = m0 + gr + 8 * (e >> 1), c = 8 * nt + 2 * tg + (e & 1);
            if (i < len && c < ncols) out[((row0 + i) * vh + hv) * dv + c0 + c] = acc[nt][e];
          }
      }
    } else if (state != nullptr || has_next) {
      // S <- e^{gamma_last} S + (fac k)^T Vn over the chunk's real rows: warp w (0-3) updates the
      // state row tiles 16w.. and, at dk 128, 16(w+4).. (each element as in the tc scan); not
      // after the last chunk of a state that is not kept.
      constexpr int NT = DK > 64 ? 2 : 1;
      const float el = G[CHUNK - 1];
      const int kmax = (len + 7) & ~7;
      float sacc[NT][4][4];
#pragma unroll
      for (int t = 0; t < NT; t++) {
        const int d0 = 16 * (warp + 4 * t);
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
          const int c = 8 * nt + 2 * tg;
          const bool in = d0 < DK;
          sacc[t][nt][0] = in ? el * S[(d0 + gr) * LS + c] : 0.f;
          sacc[t][nt][1] = in ? el * S[(d0 + gr) * LS + c + 1] : 0.f;
          sacc[t][nt][2] = in ? el * S[(d0 + gr + 8) * LS + c] : 0.f;
          sacc[t][nt][3] = in ? el * S[(d0 + gr + 8) * LS + c + 1] : 0.f;
        }
      }
      if (16 * warp < DK) {
        for (int k0 = 0; k0 < kmax; k0 += 8) {
          const float f0 = G[CHUNK + k0 + tg], f1 = G[CHUNK + k0 + tg + 4];
          TfB bv[4];
#pragma unroll
          for (int nt = 0; nt < 4; nt++) bv[nt] = frag_b(Vn, LS, k0, 8 * nt, gr, tg);
#pragma unroll
          for (int t = 0; t < NT; t++) {
            const int d0 = 16 * (warp + 4 * t);
            const TfA a = split_a(f0 * K[(k0 + tg) * LQ + d0 + gr], f0 * K[(k0 + tg) * LQ + d0 + gr + 8],
                                  f1 * K[(k0 + tg + 4) * LQ + d0 + gr], f1 * K[(k0 + tg + 4) * LQ + d0 + gr + 8]);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) mma_p<P>(sacc[t][nt], a, bv[nt]);
          }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
          const int d0 = 16 * (warp + 4 * t);
          if (d0 < DK) store_rows<LS>(S, sacc[t], d0, gr, tg);
        }
      }
    }
    row0 = nrow0;
    len = nlen;
    nrow0 = n2row0;
    nlen = n2len;
  }
  store_state<DK>(state, dv, c0, ncols, S, LS);
}

SCAN_TC_ENTRIES(gdn_chunk_scan_tc_pipelined, gdn_chunk_scan_tf32_pipelined, chunk_scan_tc_pipelined, (256, 1), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_pipelined, gdn_chunk_scan_tf32_pipelined, chunk_scan_tc_pipelined, (256, 1), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_pipelined, gdn_chunk_scan_tf32_pipelined, chunk_scan_tc_pipelined, (256, 1), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_pipelined, gdn_chunk_scan_tf32_pipelined, chunk_scan_tc_pipelined, (256, 1), 128)
