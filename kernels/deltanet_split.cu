// The chunked gated delta rule split as flash-linear-attention and FlashInfer split it, so that the
// only sequential work is the state recurrence. Appended to kernels/deltanet.cu by the loader (one
// compilation unit: it uses that file's TF32 fragments, cp.async helpers and gate scans, and the
// T and P that gdn_chunk_prep_<DK> writes). Rust binding: src/backend/cuda/deltanet.rs
// (`GdnScan::Split`, opt-in while it is measured). CPU twin: cpu::deltanet::delta_rule_chunked
// (the same mathematics; not the same bits).
//
// Why: the tc scans carry, per chunk and in order, k S, R = beta (v - e^gamma k S), Vn = T R,
// O = e^gamma q S + P Vn and the state update, behind 3-6 barriers, so a chunk costs ~11-15 us
// however little arithmetic it holds. In the WY form
//   W = T diag(beta e^gamma) K   [64 x dk],      U = T diag(beta) V   [64 x dv]
// Vn = T R = U - W S, and only the state needs the chunks in order:
//   gdn_split_wu_<DK>     every (chunk, value head) in parallel: W and U;
//   gdn_split_state_<DK>  per (sequence, value head, 32 value columns), chunks in order:
//                         H_c = S (saved for the output), Vn = U - W S,
//                         S <- e^{gamma_63} S + (fac K)^T Vn; two barriers per chunk, the next
//                         chunk's K, W and U copied meanwhile;
//   gdn_split_out_<DK>    every (chunk, value head, 32 value columns) in parallel:
//                         O = e^gamma q H_c + P Vn.
// Products as in the tc scans (mma_p<P>: 3xTF32, or one TF32 MMA for the _tf32 entries). U - W S
// sums in another order than T (beta (v - e^gamma k S)), so the bits are not the tc scans': the
// host picks this path by option for every launch, never per launch, and a sequence's result
// still depends on nothing but its own rows and state. Rows past a chunk's length have beta = 0
// and zero k, v, so their W, U and Vn rows are zero and they add nothing.
// Scratch, f32: W [chunks, vh, 64, DK], U and Vn [chunks, vh, 64, dv], H [chunks, vh, DK, dv].
// dv <= 128 (the host checks; the tc scans take any dv).

constexpr int SPLIT_LS = 40;     // 32-column tiles (S, H, U, Vn): conflict-free B fragments
constexpr int SPLIT_LT = CHUNK + 8;  // T and P, transposed: conflict-free A fragments
constexpr int SPLIT_LV = 128 + 4;    // beta v in gdn_split_wu (dv <= 128)

// gdn_split_wu_<DK>: one block of 256 threads per (chunk, value head). Tasks of 16 rows x 32
// columns (4 row tiles x the column blocks of W then U) go round the 8 warps; T is lower
// triangular, so a row tile needs the columns j < m0 + 16 only.
template <int DK, int P>
__device__ void split_wu(const float* kn, const float* v, const float* beta, const float* g, const float* tp,
                         const int* chunks, int kh, int vh, int dv, float* w, float* u) {
  extern __shared__ __align__(16) float smem_wu[];
  constexpr int DKP = DK < 32 ? 32 : DK, LK = DKP + 4;
  float* Tt = smem_wu;                  // [64][72]
  float* Bk = Tt + CHUNK * SPLIT_LT;    // [64][DKP+4]: beta e^gamma k (columns past DK zero)
  float* Bv = Bk + CHUNK * LK;          // [64][132]: beta v (columns past dv zero)
  float* gam = Bv + CHUNK * SPLIT_LV;   // [64]
  float* bet = gam + CHUNK;             // [64]
  const int ck = blockIdx.x, hv = blockIdx.y, hk = hv / (vh / kh), tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const i64 row0 = chunks[2 * ck];
  const int len = chunks[2 * ck + 1];
  const int dvp = (dv + 31) & ~31;
  const float* Tg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
  for (int idx = tid; idx < CHUNK * CHUNK / 4; idx += blockDim.x) {
    const int row = idx / 16, q4 = (idx % 16) * 4;
    cp_async16(Tt + row * SPLIT_LT + q4, Tg + 4 * idx, true);
  }
  for (int idx = tid; idx < CHUNK * DKP / 4; idx += blockDim.x) {
    const int i = idx / (DKP / 4), d = (idx % (DKP / 4)) * 4;
    const bool ok = i < len && d < DK;
    cp_async16(Bk + i * LK + d, kn + (ok ? ((row0 + i) * kh + hk) * DK + d : 0), ok);
  }
  for (int idx = tid; idx < CHUNK * dvp / 4; idx += blockDim.x) {
    const int i = idx / (dvp / 4), c = (idx % (dvp / 4)) * 4;
    const bool ok = i < len && c < dv;
    cp_async16(Bv + i * SPLIT_LV + c, v + (ok ? ((row0 + i) * vh + hv) * dv + c : 0), ok);
  }
  chunk_gates(gam, bet, g, beta, row0, len, vh, hv);
  cp_async_wait_all();
  __syncthreads();
  if (tid >= 32 && tid < CHUNK) gam[tid] += gam[31];
  __syncthreads();
  for (int idx = tid; idx < CHUNK * DKP; idx += blockDim.x) {
    const int i = idx / DKP, d = idx % DKP;
    Bk[i * LK + d] *= bet[i] * expf(gam[i]);
  }
  for (int idx = tid; idx < CHUNK * dvp; idx += blockDim.x) {
    const int i = idx / dvp, c = idx % dvp;
    Bv[i * SPLIT_LV + c] *= bet[i];
  }
  __syncthreads();
  const int wblocks = DKP / 32, tasks = 4 * (wblocks + dvp / 32);
  float* wout = w + ((i64)ck * vh + hv) * CHUNK * DK;
  float* uout = u + ((i64)ck * vh + hv) * CHUNK * dv;
  for (int t = warp; t < tasks; t += blockDim.x / 32) {
    const int m0 = 16 * (t & 3), cb = t >> 2;
    const bool is_w = cb < wblocks;
    const int c0 = 32 * (is_w ? cb : cb - wblocks);
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    if (is_w) mma_rows<SPLIT_LT, LK, P>(acc, Tt, Bk + c0, m0, m0 + 16, gr, tg);
    else mma_rows<SPLIT_LT, SPLIT_LV, P>(acc, Tt, Bv + c0, m0, m0 + 16, gr, tg);
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = m0 + gr + 8 * (e >> 1), c = c0 + 8 * nt + 2 * tg + (e & 1);
        if (is_w) {
          if (c < DK) wout[i * DK + c] = acc[nt][e];
        } else if (c < dv) {
          uout[i * dv + c] = acc[nt][e];
        }
      }
  }
}

// gdn_split_state_<DK>: one block of 128 threads (4 warps) per (sequence, value head, 32 value
// columns c0..), walking the sequence's chunks from its state (segment table as the tc scans').
// Per chunk, buffer b = (ck - first) & 1:
//   wait (K, W, U[ck] in) | bar | copy K, W, U[ck+1] -> b^1 | H_ck = S -> global
//   | Vn = U - W S (warp w: rows 16w..) -> shared and global; gates of ck+1 (warp 0)
//   | bar | S <- e^{gamma_63} S + (fac K)^T Vn over the real rows (warp w: state row tiles w, w+4)
// A buffer is refilled only after the top barrier that follows its last read.
template <int DK, int P>
__device__ void split_state(const float* kn, const float* g, const float* w, const float* u, const int* chunks,
                           const i64* segs, int kh, int vh, int dv, float* h, float* vn) {
  extern __shared__ __align__(16) float smem_st[];
  constexpr int LK = DK + 4, LS = SPLIT_LS, KB = CHUNK * LK, UB = CHUNK * LS, GB = 3 * CHUNK;
  float* Kb = smem_st;       // [2][64][DK+4]
  float* Wb = Kb + 2 * KB;   // [2][64][DK+4]
  float* Ub = Wb + 2 * KB;   // [2][64][40]
  float* S = Ub + 2 * UB;    // [DK][40]
  float* Vn = S + DK * LS;   // [64][40]
  float* gates = Vn + UB;    // [2][3][64]: chunk_gates_warp's e^gamma, decay factors (beta unused)
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * 32, hk = hv / (vh / kh), tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1], end = first + nch;
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);
  const int ncols = min(32, dv - c0);
  auto load = [&](int ck, int b) {
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    const float* wg = w + ((i64)ck * vh + hv) * CHUNK * DK;
    for (int idx = tid; idx < CHUNK * DK / 4; idx += blockDim.x) {
      const int i = idx / (DK / 4), d = (idx % (DK / 4)) * 4;
      const bool ok = i < len;
      cp_async16(Kb + b * KB + i * LK + d, kn + (ok ? ((row0 + i) * kh + hk) * DK + d : 0), ok);
      cp_async16(Wb + b * KB + i * LK + d, wg + i * DK + d, true);
    }
    const float* ug = u + ((i64)ck * vh + hv) * CHUNK * dv + c0;
    for (int idx = tid; idx < CHUNK * 8; idx += blockDim.x) {
      const int i = idx / 8, c = (idx % 8) * 4;
      const bool ok = c < ncols;
      cp_async16(Ub + b * UB + i * LS + c, ok ? ug + (i64)i * dv + c : u, ok);
    }
  };
  auto gates_of = [&](int ck, float* G) {  // warp 0
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    const float g0 = lane < len ? g[(row0 + lane) * vh + hv] : 0.f;
    const float g1 = lane + 32 < len ? g[(row0 + lane + 32) * vh + hv] : 0.f;
    chunk_gates_warp(G, g0, g1, 0.f, 0.f, lane);
  };
  load_state_async<DK>(S, LS, state_in, dv, c0, ncols);
  if (nch > 0) load(first, 0);
  cp_async_commit();
  if (nch > 0 && warp == 0) gates_of(first, gates);
  for (int ck = first; ck < end; ck++) {
    const int b = (ck - first) & 1, len = chunks[2 * ck + 1];
    cp_async_wait_group<0>();
    __syncthreads();  // chunk ck's K, W, U (the state, at first) and gates visible; ck-1 done with b^1
    if (ck + 1 < end) load(ck + 1, b ^ 1);
    cp_async_commit();
    const float* K = Kb + b * KB;
    const float* W = Wb + b * KB;
    const float* U = Ub + b * UB;
    const float* G = gates + b * GB;
    float* hc = h + ((i64)ck * vh + hv) * DK * dv + c0;
    for (int idx = tid; idx < DK * 8; idx += blockDim.x) {
      const int d = idx / 8, c = (idx % 8) * 4;
      if (c < ncols) *(float4*)(hc + (i64)d * dv + c) = *(const float4*)(S + d * LS + c);
    }
    {
      const int m0 = 16 * warp;
      float acc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      if (m0 < len) mma_rows_rm<LK, LS, P>(acc, W, S, m0, DK, gr, tg);
      float* vg = vn + ((i64)ck * vh + hv) * CHUNK * dv + c0;
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = m0 + gr + 8 * (e >> 1), c = 8 * nt + 2 * tg + (e & 1);
          const float x = U[i * LS + c] - acc[nt][e];
          Vn[i * LS + c] = x;
          if (i < len && c < ncols) vg[(i64)i * dv + c] = x;
        }
    }
    if (warp == 0 && ck + 1 < end) gates_of(ck + 1, gates + (b ^ 1) * GB);
    __syncthreads();  // Vn visible; every read of S done
    if (state == nullptr && ck + 1 == end) break;  // not kept: nothing reads the last update
    constexpr int NT = (DK / 16 + 3) / 4;
    const float el = G[CHUNK - 1];
    const int kmax = (len + 7) & ~7;
    float sacc[NT][4][4];
#pragma unroll
    for (int t = 0; t < NT; t++) {
      const int d0 = 16 * (warp + 4 * t);
      const bool in = d0 < DK;
#pragma unroll
      for (int nt = 0; nt < 4; nt++) {
        const int c = 8 * nt + 2 * tg;
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
          if (d0 >= DK) continue;
          const TfA a = split_a(f0 * K[(k0 + tg) * LK + d0 + gr], f0 * K[(k0 + tg) * LK + d0 + gr + 8],
                                f1 * K[(k0 + tg + 4) * LK + d0 + gr], f1 * K[(k0 + tg + 4) * LK + d0 + gr + 8]);
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
  store_state<DK>(state, dv, c0, ncols, S, LS);
}

// gdn_split_out_<DK>: one block of 128 threads per (chunk, value head, 32 value columns c0..);
// warp w computes rows 16w..: O = e^gamma (q H_c) + P Vn (P lower triangular: j < 16w + 16).
template <int DK, int P>
__device__ void split_out(const float* qn, const float* beta, const float* g, const float* tp, const float* h,
                          const float* vn, const int* chunks, int kh, int vh, int dv, float* out) {
  extern __shared__ __align__(16) float smem_o[];
  constexpr int LQ = DK + 4, LS = SPLIT_LS;
  float* Qs = smem_o;                  // [64][DK+4]
  float* Hs = Qs + CHUNK * LQ;         // [DK][40]
  float* Pt = Hs + DK * LS;            // [64][72]
  float* Vs = Pt + CHUNK * SPLIT_LT;   // [64][40]
  float* gam = Vs + CHUNK * LS;        // [64]
  float* bet = gam + CHUNK;            // [64] (chunk_gates writes it; unused here)
  const int ck = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * 32, hk = hv / (vh / kh), tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const i64 row0 = chunks[2 * ck];
  const int len = chunks[2 * ck + 1];
  const int ncols = min(32, dv - c0);
  for (int idx = tid; idx < CHUNK * DK / 4; idx += blockDim.x) {
    const int i = idx / (DK / 4), d = (idx % (DK / 4)) * 4;
    const bool ok = i < len;
    cp_async16(Qs + i * LQ + d, qn + (ok ? ((row0 + i) * kh + hk) * DK + d : 0), ok);
  }
  const float* hc = h + ((i64)ck * vh + hv) * DK * dv + c0;
  for (int idx = tid; idx < DK * 8; idx += blockDim.x) {
    const int d = idx / 8, c = (idx % 8) * 4;
    const bool ok = c < ncols;
    cp_async16(Hs + d * LS + c, ok ? hc + (i64)d * dv + c : h, ok);
  }
  const float* Pg = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK + CHUNK * CHUNK;
  for (int idx = tid; idx < CHUNK * CHUNK / 4; idx += blockDim.x) {
    const int row = idx / 16, q4 = (idx % 16) * 4;
    cp_async16(Pt + row * SPLIT_LT + q4, Pg + 4 * idx, true);
  }
  const float* vg = vn + ((i64)ck * vh + hv) * CHUNK * dv + c0;
  for (int idx = tid; idx < CHUNK * 8; idx += blockDim.x) {
    const int i = idx / 8, c = (idx % 8) * 4;
    const bool ok = i < len && c < ncols;
    cp_async16(Vs + i * LS + c, ok ? vg + (i64)i * dv + c : vn, ok);
  }
  chunk_gates(gam, bet, g, beta, row0, len, vh, hv);
  cp_async_wait_all();
  __syncthreads();
  if (tid >= 32 && tid < CHUNK) gam[tid] += gam[31];
  __syncthreads();
  const int m0 = 16 * warp;
  if (m0 >= len) return;
  float acc[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  mma_rows_rm<LQ, LS, P>(acc, Qs, Hs, m0, DK, gr, tg);
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[nt][e] *= expf(gam[m0 + gr + 8 * (e >> 1)]);
  mma_rows<SPLIT_LT, LS, P>(acc, Pt, Vs, m0, m0 + 16, gr, tg);
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int i = m0 + gr + 8 * (e >> 1), c = 8 * nt + 2 * tg + (e & 1);
      if (i < len && c < ncols) out[((row0 + i) * vh + hv) * dv + c0 + c] = acc[nt][e];
    }
}

// Entries gdn_split_{wu,state,out}_<DK> with 3xTF32 products, gdn_split_{wu,state,out}_tf32_<DK>
// with one TF32 MMA each (the names are spelled out: the kernel table's test looks for them).
#define SPLIT_WU_ENTRY(NAME, DK, P)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) NAME##DK(                                                 \
      const float* kn, const float* v, const float* beta, const float* g, const float* tp, const int* chunks, \
      int kh, int vh, int dv, float* w, float* u) {                                                           \
    pdl_begin();                                                                                              \
    split_wu<DK, P>(kn, v, beta, g, tp, chunks, kh, vh, dv, w, u);                                            \
  }
#define SPLIT_STATE_ENTRY(NAME, DK, P)                                                                        \
  extern "C" __global__ void __launch_bounds__(128) NAME##DK(                                                 \
      const float* kn, const float* g, const float* w, const float* u, const int* chunks, const i64* segs,    \
      int kh, int vh, int dv, float* h, float* vn) {                                                          \
    pdl_begin();                                                                                              \
    split_state<DK, P>(kn, g, w, u, chunks, segs, kh, vh, dv, h, vn);                                         \
  }
#define SPLIT_OUT_ENTRY(NAME, DK, P)                                                                          \
  extern "C" __global__ void __launch_bounds__(128) NAME##DK(                                                 \
      const float* qn, const float* beta, const float* g, const float* tp, const float* h, const float* vn,   \
      const int* chunks, int kh, int vh, int dv, float* out) {                                                \
    pdl_begin();                                                                                              \
    split_out<DK, P>(qn, beta, g, tp, h, vn, chunks, kh, vh, dv, out);                                        \
  }
SPLIT_WU_ENTRY(gdn_split_wu_, 16, 3)
SPLIT_WU_ENTRY(gdn_split_wu_, 32, 3)
SPLIT_WU_ENTRY(gdn_split_wu_, 64, 3)
SPLIT_WU_ENTRY(gdn_split_wu_, 128, 3)
SPLIT_WU_ENTRY(gdn_split_wu_tf32_, 16, 1)
SPLIT_WU_ENTRY(gdn_split_wu_tf32_, 32, 1)
SPLIT_WU_ENTRY(gdn_split_wu_tf32_, 64, 1)
SPLIT_WU_ENTRY(gdn_split_wu_tf32_, 128, 1)
SPLIT_STATE_ENTRY(gdn_split_state_, 16, 3)
SPLIT_STATE_ENTRY(gdn_split_state_, 32, 3)
SPLIT_STATE_ENTRY(gdn_split_state_, 64, 3)
SPLIT_STATE_ENTRY(gdn_split_state_, 128, 3)
SPLIT_STATE_ENTRY(gdn_split_state_tf32_, 16, 1)
SPLIT_STATE_ENTRY(gdn_split_state_tf32_, 32, 1)
SPLIT_STATE_ENTRY(gdn_split_state_tf32_, 64, 1)
SPLIT_STATE_ENTRY(gdn_split_state_tf32_, 128, 1)
SPLIT_OUT_ENTRY(gdn_split_out_, 16, 3)
SPLIT_OUT_ENTRY(gdn_split_out_, 32, 3)
SPLIT_OUT_ENTRY(gdn_split_out_, 64, 3)
SPLIT_OUT_ENTRY(gdn_split_out_, 128, 3)
SPLIT_OUT_ENTRY(gdn_split_out_tf32_, 16, 1)
SPLIT_OUT_ENTRY(gdn_split_out_tf32_, 32, 1)
SPLIT_OUT_ENTRY(gdn_split_out_tf32_, 64, 1)
SPLIT_OUT_ENTRY(gdn_split_out_tf32_, 128, 1)
