// The chunk scan with the recurrent state in registers, transposed so that every product a warp
// needs is local to its own rows. Appended to kernels/deltanet.cu by the loader (one compilation
// unit: it uses that file's TF32 fragments, cp.async helpers, gate scan and state-table helpers,
// and reads the T and P that gdn_chunk_prep_<DK> writes). Rust binding: src/backend/cuda/deltanet.rs
// (`GdnScan::Rows`, opt-in while it is measured). CPU twin: cpu::deltanet::delta_rule_chunked.
//
// Why: the tc scans hold S in shared memory and split each chunk's products between warps (k S on
// four warps, q S on four others, then T R, then O and the state update), so a chunk is a chain of
// phases behind 3-6 block barriers with every fragment re-read from shared memory; a 16K-token
// sequence costs 1.49 ms a layer (H200), ~5.8 us a chunk. Written for value rows instead, the whole
// recurrence is row-local: with S^T [dv][DK] (row c = value column c of the state),
//   (k S)^T = S^T K^T,  R^T = beta (V^T - e^gamma (k S)^T),  Vn^T = R^T T^T,
//   O^T = e^gamma (q S)^T + Vn^T P^T,  S^T <- e^{gamma_63} S^T + (fac Vn^T) K,
// and value row c of every result needs only row c of S^T and of the chunk's shared matrices. So
// warp w owns 16 rows of S^T (all DK columns) as mma.sync accumulators for the whole sequence:
// each product takes its A operand straight from the previous product's accumulators (no shared
// memory, no barrier between products), and only the chunk's K, Q, V, T and P are shared.
// An accumulator's 8-column group holds columns 2tg, 2tg+1 where an A fragment wants k = tg,
// tg+4: the k order of each 8-step is relabelled (position tg <-> column 2tg, tg+4 <-> 2tg+1) and
// the B fragments are read in the same relabelled order, which is only an address pattern.
//
// Products as in the tc scans (mma_p<P>: 3xTF32, or one TF32 MMA for the _tf32 entries), but
// summed in another order, so the bits are not the tc scans': the host chooses this family for
// every launch, never per launch. Within it, every element is the same chain of MMAs whichever
// NW a block has, so the three block shapes below give the same bits and the host may pick either
// per launch (a sequence's result never depends on the batch).
//   gdn_chunk_scan_{tc,tf32}_rows_<DK>:      NW = 2 warps, 32 value columns a block (dv / 32
//     blocks per head: 128 blocks for a lone 16K sequence); the next chunk's K, Q and V copied
//     while this one computes (two stages); for long sequences.
//   gdn_chunk_scan_{tc,tf32}_rows64_<DK>:    NW = 4 warps, 64 columns, two stages: the same for
//     long sequences with half the blocks and twice the warps an SM (CudaOptions::gdn_rows_columns).
//   gdn_chunk_scan_{tc,tf32}_rows_wide_<DK>: NW = 8 warps, 128 value columns a block (one block
//     per (sequence, head), K, Q, T and P staged once for all columns), one stage; for many short
//     sequences.
// Per chunk, with b the chunk's buffer (two stages):
//   wait (K, Q, V of c) | bar | copy T, P of c | copy K, Q, V of c+1 | warp 0: gates of c+1
//   | k S, R (registers) | wait (T, P) | bar | Vn = T R, q S, O (stored), S update (registers)
// Rows past the chunk's length have beta = 0 and zero k, q, v (copies zero-filled), so their R,
// Vn and O rows are zero and they add nothing; their 8-row tiles are skipped.
// Shared memory (layout::delta_rows_smem_bytes): K and Q [stages][64][DK+4], V [stages][64][cols+4],
// T and P [64][68], gates [stages][3][64]: 189,952 bytes at dk 128 (two stages, 32 columns),
// 206,336 (two stages, 64 columns), 136,960 (one stage, 128 columns). The host requires dv to be
// a multiple of the block's columns.

// acc[nt] (zeroed here) = the warp's 16 rows of S^T times X^T over DK, for the chunk's 8-row tiles
// nt < tiles of X (K or Q, row-major [64][LK]): (k S)^T or (q S)^T. S's accumulators are the A
// operand, each 8-step in the relabelled k order; X's two values of a B fragment are adjacent.
template <int DK, int LK, int P>
__device__ __forceinline__ void rows_times_state(float (&acc)[8][4], const float (&S)[DK / 8][4], const float* X,
                                                 int tiles, int gr, int tg) {
#pragma unroll
  for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < DK / 8; kk++) {
    const TfA a = split_a(S[kk][0], S[kk][2], S[kk][1], S[kk][3]);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
      if (nt < tiles) {
        const float2 xb = *(const float2*)(X + (8 * nt + gr) * LK + 8 * kk + 2 * tg);
        mma_p<P>(acc[nt], a, split_b(xb.x, xb.y));
      }
  }
}

// acc[nt] += A M over the chunk's rows, where A is a [16][64] accumulator set (R^T or Vn^T, the
// relabelled k order) and M a lower-triangular chunk matrix in the prep's transposed layout
// (Ms[k][n] = M[n][k], stride LT): Vn^T = R^T Tᵀ and Vn^T Pᵀ. Tiles above the diagonal (k tile >
// n tile) and past the chunk's rows are skipped: their products are zero.
template <int LT, int P>
__device__ __forceinline__ void rows_times_lower(float (&acc)[8][4], const float (&A)[8][4], const float* Ms,
                                                 int tiles, int gr, int tg) {
#pragma unroll
  for (int kk = 0; kk < 8; kk++)
    if (kk < tiles) {
      const TfA a = split_a(A[kk][0], A[kk][2], A[kk][1], A[kk][3]);
#pragma unroll
      for (int nt = kk; nt < 8; nt++)
        if (nt < tiles) {
          const float* mb = Ms + (8 * kk + 2 * tg) * LT + 8 * nt + gr;
          mma_p<P>(acc[nt], a, split_b(mb[0], mb[LT]));
        }
    }
}

template <int DK, int P, int NW, int STAGES>
__device__ void chunk_scan_rows(const float* qn, const float* kn, const float* v, const float* beta,
                                const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                int vh, int dv, float* out) {
  static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
  constexpr int COLS = 16 * NW;     // value columns of the block (16 rows of S^T a warp)
  constexpr int LK = DK + 4;        // K, Q row stride: conflict-free fragment loads
  constexpr int LV = COLS + 4;      // V row stride
  constexpr int LT = CHUNK + 4;     // T, P row stride
  constexpr int NTD = DK / 8;       // 8-column tiles of S^T
  constexpr int KQ = CHUNK * LK, VB = CHUNK * LV, GB = 3 * CHUNK;
  constexpr int THREADS = 32 * NW;
  extern __shared__ __align__(16) float smem_rows[];
  float* Kb = smem_rows;                // [STAGES][64][LK]
  float* Qb = Kb + STAGES * KQ;         // [STAGES][64][LK]
  float* Vb = Qb + STAGES * KQ;         // [STAGES][64][LV]: the block's value columns
  float* Ts = Vb + STAGES * VB;         // [64][LT]: T as the prep stores it, [i][j] = T[j][i]
  float* Ps = Ts + CHUNK * LT;          // [64][LT]: P likewise, [j][i] = P[i][j]
  float* gates = Ps + CHUNK * LT;       // [STAGES][3][64]: e^gamma, decay factors, beta
  const int s = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * COLS, hk = hv / (vh / kh), tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
  const int cw = 16 * warp;  // this warp's first value column within the block
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1], end = first + nch;
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);

  auto load_kqv = [&](int st, i64 r0, int ln) {
    float* K = Kb + st * KQ;
    float* Q = Qb + st * KQ;
    float* V = Vb + st * VB;
    for (int idx = tid; idx < CHUNK * (DK / 4); idx += THREADS) {
      const int i = idx / (DK / 4), d = 4 * (idx % (DK / 4));
      const bool ok = i < ln;
      const i64 src = ok ? ((r0 + i) * kh + hk) * DK + d : 0;
      cp_async16(K + i * LK + d, kn + src, ok);
      cp_async16(Q + i * LK + d, qn + src, ok);
    }
    for (int idx = tid; idx < CHUNK * (COLS / 4); idx += THREADS) {
      const int i = idx / (COLS / 4), c = 4 * (idx % (COLS / 4));
      const bool ok = i < ln;
      cp_async16(V + i * LV + c, v + (ok ? ((r0 + i) * vh + hv) * dv + c0 + c : 0), ok);
    }
  };
  auto load_tp = [&](int ck) {
    const float* src = tp + ((i64)ck * vh + hv) * 2 * CHUNK * CHUNK;
    for (int idx = tid; idx < CHUNK * CHUNK / 4; idx += THREADS) {
      const int r = idx / (CHUNK / 4), q4 = 4 * (idx % (CHUNK / 4));
      cp_async16(Ts + r * LT + q4, src + r * CHUNK + q4, true);
      cp_async16(Ps + r * LT + q4, src + CHUNK * CHUNK + r * CHUNK + q4, true);
    }
  };
  auto gates_of = [&](float* G, i64 r0, int ln) {  // warp 0
    const float g0 = lane < ln ? g[(r0 + lane) * vh + hv] : 0.f;
    const float g1 = lane + 32 < ln ? g[(r0 + lane + 32) * vh + hv] : 0.f;
    const float b0 = lane < ln ? beta[(r0 + lane) * vh + hv] : 0.f;
    const float b1 = lane + 32 < ln ? beta[(r0 + lane + 32) * vh + hv] : 0.f;
    chunk_gates_warp(G, g0, g1, b0, b1, lane);
  };

  // S^T of this thread: tile nt, element e at value column c0 + cw + gr + 8 (e >> 1), key
  // column d = 8 nt + 2 tg + (e & 1) (the m16n8 accumulator layout).
  float S[NTD][4];
#pragma unroll
  for (int nt = 0; nt < NTD; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      S[nt][e] = state_in[(i64)(8 * nt + 2 * tg + (e & 1)) * dv + c0 + cw + gr + 8 * (e >> 1)];

  i64 row0 = 0;
  int len = 0;
  if (nch > 0) {
    row0 = chunks[2 * first];
    len = chunks[2 * first + 1];
  }
  if constexpr (STAGES == 2) {
    if (nch > 0) load_kqv(0, row0, len);
    cp_async_commit();
    if (nch > 0 && warp == 0) gates_of(gates, row0, len);
  }
  for (int ck = first; ck < end; ck++) {
    const int b = STAGES == 2 ? (ck - first) & 1 : 0;
    const bool has_next = ck + 1 < end;
    i64 nrow0 = 0;
    int nlen = 0;
    if (has_next) {
      nrow0 = chunks[2 * ck + 2];
      nlen = chunks[2 * ck + 3];
    }
    if constexpr (STAGES == 2) {
      cp_async_wait_group<0>();  // K, Q, V of this chunk
      __syncthreads();           // ... visible, with its gates; chunk ck-1 is done with T, P, buffer b^1
      load_tp(ck);
      cp_async_commit();
      if (has_next) load_kqv(b ^ 1, nrow0, nlen);
      cp_async_commit();
      if (has_next && warp == 0) gates_of(gates + (b ^ 1) * GB, nrow0, nlen);
    } else {
      __syncthreads();  // chunk ck-1 is done with every buffer
      load_kqv(0, row0, len);
      load_tp(ck);
      cp_async_commit();
      if (warp == 0) gates_of(gates, row0, len);
      cp_async_wait_group<0>();
      __syncthreads();
    }
    const float* K = Kb + b * KQ;
    const float* Q = Qb + b * KQ;
    const float* V = Vb + b * VB;
    const float* G = gates + b * GB;
    const int tiles = (len + 7) >> 3;  // 8-row tiles of the chunk holding its rows

    // (k S)^T: this warp's 16 value rows x the chunk's rows, over DK; then R^T in place.
    float r[8][4];
    rows_times_state<DK, LK, P>(r, S, K, tiles, gr, tg);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = 8 * nt + 2 * tg + (e & 1), c = cw + gr + 8 * (e >> 1);
        r[nt][e] = G[2 * CHUNK + i] * (V[i * LV + c] - G[i] * r[nt][e]);
      }
    if constexpr (STAGES == 2) {
      cp_async_wait_group<1>();  // T and P of this chunk (the next chunk's K, Q, V may fly)
      __syncthreads();
    }

    // Vn^T = R^T T^T: Vn^T[c][j] = sum_{i <= j} R^T[c][i] T[j][i].
    float vn[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) vn[nt][0] = vn[nt][1] = vn[nt][2] = vn[nt][3] = 0.f;
    rows_times_lower<LT, P>(vn, r, Ts, tiles, gr, tg);

    // O^T = e^gamma (q S)^T + Vn^T P^T (P[i][j] = 0 for j > i), stored for the chunk's rows.
    float o[8][4];
    rows_times_state<DK, LK, P>(o, S, Q, tiles, gr, tg);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[nt][e] *= G[8 * nt + 2 * tg + (e & 1)];
    rows_times_lower<LT, P>(o, vn, Ps, tiles, gr, tg);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = 8 * nt + 2 * tg + (e & 1);
        if (i < len) out[((row0 + i) * vh + hv) * dv + c0 + cw + gr + 8 * (e >> 1)] = o[nt][e];
      }

    // S^T <- e^{gamma_63} S^T + (fac Vn^T) K over the chunk's rows; not after the last chunk of a
    // state that is not kept.
    if (state != nullptr || has_next) {
      const float el = G[CHUNK - 1];
#pragma unroll
      for (int nt = 0; nt < NTD; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) S[nt][e] *= el;
#pragma unroll
      for (int kk = 0; kk < 8; kk++)
        if (kk < tiles) {
          const int j = 8 * kk + 2 * tg;
          const float f0 = G[CHUNK + j], f1 = G[CHUNK + j + 1];
          const TfA a = split_a(f0 * vn[kk][0], f0 * vn[kk][2], f1 * vn[kk][1], f1 * vn[kk][3]);
#pragma unroll
          for (int nt = 0; nt < NTD; nt++) {
            const float* kb = K + j * LK + 8 * nt + gr;
            mma_p<P>(S[nt], a, split_b(kb[0], kb[LK]));
          }
        }
    }
    row0 = nrow0;
    len = nlen;
  }
  cp_async_wait_all();
  if (state != nullptr) {
#pragma unroll
    for (int nt = 0; nt < NTD; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        state[(i64)(8 * nt + 2 * tg + (e & 1)) * dv + c0 + cw + gr + 8 * (e >> 1)] = S[nt][e];
  }
}

template <int DK, int P>
__device__ void chunk_scan_rows_long(const float* qn, const float* kn, const float* v, const float* beta,
                                     const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                     int vh, int dv, float* out) {
  chunk_scan_rows<DK, P, 2, 2>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);
}
template <int DK, int P>
__device__ void chunk_scan_rows_64(const float* qn, const float* kn, const float* v, const float* beta,
                                   const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                   int vh, int dv, float* out) {
  chunk_scan_rows<DK, P, 4, 2>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);
}
template <int DK, int P>
__device__ void chunk_scan_rows_wide(const float* qn, const float* kn, const float* v, const float* beta,
                                     const float* g, const float* tp, const int* chunks, const i64* segs, int kh,
                                     int vh, int dv, float* out) {
  chunk_scan_rows<DK, P, 8, 1>(qn, kn, v, beta, g, tp, chunks, segs, kh, vh, dv, out);
}

SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows, gdn_chunk_scan_tf32_rows, chunk_scan_rows_long, (64, 1), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows, gdn_chunk_scan_tf32_rows, chunk_scan_rows_long, (64, 1), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows, gdn_chunk_scan_tf32_rows, chunk_scan_rows_long, (64, 1), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows, gdn_chunk_scan_tf32_rows, chunk_scan_rows_long, (64, 1), 128)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows64, gdn_chunk_scan_tf32_rows64, chunk_scan_rows_64, (128, 1), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows64, gdn_chunk_scan_tf32_rows64, chunk_scan_rows_64, (128, 1), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows64, gdn_chunk_scan_tf32_rows64, chunk_scan_rows_64, (128, 1), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows64, gdn_chunk_scan_tf32_rows64, chunk_scan_rows_64, (128, 1), 128)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows_wide, gdn_chunk_scan_tf32_rows_wide, chunk_scan_rows_wide, (256, 1), 16)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows_wide, gdn_chunk_scan_tf32_rows_wide, chunk_scan_rows_wide, (256, 1), 32)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows_wide, gdn_chunk_scan_tf32_rows_wide, chunk_scan_rows_wide, (256, 1), 64)
SCAN_TC_ENTRIES(gdn_chunk_scan_tc_rows_wide, gdn_chunk_scan_tf32_rows_wide, chunk_scan_rows_wide, (256, 1), 128)
