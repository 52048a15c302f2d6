// Softmax attention for the Qwen3.5 gated full-attention layers and the vision tower.
// Rust binding: src/backend/cuda/attention.rs. CPU twins: cpu::attention::{gated_attention,
// vision_attention, rotate_half_inplace, attention_parts} and cpu::norm::rms_norm
// (src/backend/cpu/).
//
// Segment table, SEG = 8 x i64 per sequence of the packed batch:
//   [q_start, nq, k_shared, v_shared, shared_len, k_own, v_own, own_len]
// The sequence's query rows are q_start .. q_start+nq of the batch. Its keys/values are
// shared_len rows of an immutable shared prefix (k_shared / v_shared, may be 0 rows) followed by
// its own rows at k_own / v_own, each [rows, kv_heads, hd] bf16; attn_prep appends the new keys
// at own row own_len + i, so key j of the sequence is shared row j (j < shared_len) or own row
// j - shared_len. Causal: query i sees keys 0 ..= shared_len + own_len + i.
#define SEG 8

// One block (4 warps) per token. For each q head: optional zero-centred RMSNorm over hd, NeoX
// rotary on the first `rot` dims with the f32 cos/sin row of this token, -> qout [n, heads, hd].
// For each kv head: the same for k, and both k and v are written to cache row base_len + i.
// Source element (t, head h, dim c) is src[t*row + h*head + c].
extern "C" __global__ void attn_prep(
    const bf16* qsrc, i64 q_row, int q_head, const bf16* ksrc, i64 k_row, const bf16* vsrc, i64 v_row,
    const float* qw, const float* kw, int norm, float eps, const float* cos, const float* sin, int rot,
    const i64* segs, int nseg, bf16* qout, int heads, int kvh, int hd) {
  pdl_begin();
  __shared__ float sb[4][256];
  const i64 t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = find_row_segment<SEG>(segs, nseg, t);  // the sequences tile the rows in order: host-checked
  if (s < 0) return;
  const i64 krow = segs[SEG * s + 7] + (t - segs[SEG * s]);
  bf16* kc = (bf16*)segs[SEG * s + 5];
  bf16* vc = (bf16*)segs[SEG * s + 6];
  const int half = rot / 2;
  float* b = sb[warp];
  for (int u = warp; u < heads + 2 * kvh; u += 4) {
    if (u >= heads + kvh) {  // value head: plain copy into the cache
      int g = u - heads - kvh;
      for (int c = lane; c < hd; c += 32) vc[(krow * kvh + g) * hd + c] = vsrc[t * v_row + (i64)g * hd + c];
      continue;
    }
    const bool is_q = u < heads;
    const int h = is_q ? u : u - heads;
    const bf16* src = is_q ? qsrc + t * q_row + (i64)h * q_head : ksrc + t * k_row + (i64)h * hd;
    float ss = 0.f;
    for (int c = lane; c < hd; c += 32) { float v = bf(src[c]); b[c] = v; ss += v * v; }
    if (norm) {
      const float* w = is_q ? qw : kw;
      float r = rsqrtf(warp_sum(ss) / hd + eps);
      for (int c = lane; c < hd; c += 32) b[c] = b[c] * r * (1.f + w[c]);
    }
    __syncwarp();
    bf16* dst = is_q ? qout + (t * heads + h) * hd : kc + (krow * kvh + h) * hd;
    for (int c = lane; c < hd; c += 32) {
      float v = b[c];
      if (c < rot) {
        float cs = cos[t * rot + c], sn = sin[t * rot + c];
        v = c < half ? v * cs - b[c + half] * sn : v * cs + b[c - half] * sn;
      }
      dst[c] = to_bf(v);
    }
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------
// Flash-attention (FA2 style) with bf16 mma.sync m16n8k16 and f32 accumulation / online softmax.
// Block = 4 warps = 64 query rows of one head of one sequence; key/value tiles of 64 rows are
// staged in shared memory. HDP is the head dim rounded up to a supported size (16..256); dims
// >= hd are zero. The reduction order of a row does not depend on the other rows in the batch.

__device__ __forceinline__ unsigned pack_bf(bf16 lo, bf16 hi) {
  return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}

// Tile of `rows` rows x HDP columns into shared memory (leading dimension LD), zero-filled past
// `valid` rows and hd columns. Row r is row j0 + r of a sequence stored as `alen` rows at `a`
// followed by rows at `b` (row stride `stride` elements in both); `b` must be a valid address
// (zero-filled copies still name one).
template <int HDP, int LD>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* a, int alen, const bf16* b, i64 stride, int j0,
                                          int valid, int hd, int rows) {
  if ((hd & 7) == 0) {
    constexpr int V = HDP / 8;
    for (int i = threadIdx.x; i < rows * V; i += blockDim.x) {
      int r = i / V, c = (i % V) * 8, j = j0 + r;
      bool ok = r < valid && c < hd;
      const bf16* src = !ok ? b : j < alen ? a + (i64)j * stride + c : b + (i64)(j - alen) * stride + c;
      cp_async16(dst + r * LD + c, src, ok);  // all of a thread's copies in flight at once
    }
    cp_async_wait_all();
  } else {
    for (int i = threadIdx.x; i < rows * HDP; i += blockDim.x) {
      int r = i / HDP, c = i % HDP, j = j0 + r;
      bf16 v = __float2bfloat16(0.f);
      if (r < valid && c < hd) v = j < alen ? a[(i64)j * stride + c] : b[(i64)(j - alen) * stride + c];
      dst[r * LD + c] = v;
    }
  }
}

template <int HDP>
__device__ void attn_fwd(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,
                         const bf16* gate, i64 gate_row, int gate_head, bf16* out) {
  constexpr int BQ = 64, BK = 64, LD = HDP + 8, NT = HDP / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = (bf16*)smem_raw;
  bf16* Ks = Qs + BQ * LD;
  bf16* Vs = Ks + BK * LD;
  const int tile = blockIdx.x, h = blockIdx.y;
  const i64* sg = segs + SEG * blockIdx.z;
  const i64 q_start = sg[0];
  const int nq = (int)sg[1];
  const int shared_len = (int)sg[4];
  const int kvlen = shared_len + (int)sg[7] + nq;
  if (tile * BQ >= nq) return;
  const int g = h / (heads / kvh);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int qbase = tile * BQ;
  const int offset = kvlen - nq;
  const int qlast = min(nq, qbase + BQ) - 1;
  const int klimit = causal ? min(kvlen, offset + qlast + 1) : kvlen;

  load_tile<HDP, LD>(Qs, q + ((q_start + qbase) * heads + h) * (i64)hd, BQ, q, (i64)heads * hd, 0, nq - qbase, hd, BQ);
  const i64 kstride = (i64)kvh * hd;
  const bf16* ks_ = (const bf16*)sg[2] + (i64)g * hd;
  const bf16* vs_ = (const bf16*)sg[3] + (i64)g * hd;
  const bf16* ko_ = (const bf16*)sg[5] + (i64)g * hd;
  const bf16* vo_ = (const bf16*)sg[6] + (i64)g * hd;

  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const int r0 = warp * 16 + gr;  // this thread's two rows in the tile: r0 and r0 + 8
  const int qi0 = qbase + r0, qi1 = qi0 + 8;

  for (int kt = 0; kt * BK < klimit; kt++) {
    __syncthreads();
    load_tile<HDP, LD>(Ks, ks_, shared_len, ko_, kstride, kt * BK, kvlen - kt * BK, hd, BK);
    load_tile<HDP, LD>(Vs, vs_, shared_len, vo_, kstride, kt * BK, kvlen - kt * BK, hd, BK);
    __syncthreads();

    // S = Q K^T for 16 rows x 64 keys per warp.
    float sacc[BK / 8][4];
#pragma unroll
    for (int nt = 0; nt < BK / 8; nt++) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HDP / 16; ks++) {
      const bf16* qa = Qs + r0 * LD + ks * 16 + tg * 2;
      unsigned a[4] = {*(const unsigned*)qa, *(const unsigned*)(qa + 8 * LD), *(const unsigned*)(qa + 8),
                       *(const unsigned*)(qa + 8 * LD + 8)};
#pragma unroll
      for (int nt = 0; nt < BK / 8; nt++) {
        const bf16* kb = Ks + (nt * 8 + gr) * LD + ks * 16 + tg * 2;
        unsigned b[2] = {*(const unsigned*)kb, *(const unsigned*)(kb + 8)};
        mma_bf16_16816(sacc[nt], a, b);
      }
    }
    // Scale, mask, online softmax (each row's 64 scores are spread over the 4 lanes of a quad).
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < BK / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int col = kt * BK + nt * 8 + tg * 2 + (e & 1);
        int qi = e < 2 ? qi0 : qi1;
        bool ok = col < kvlen && (!causal || col <= offset + qi);
        float v = ok ? sacc[nt][e] * scale_log2 : NEG_INF;
        sacc[nt][e] = v;
        if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == NEG_INF ? 0.f : mn0, base1 = mn1 == NEG_INF ? 0.f : mn1;
    const float c0 = exp2f(m0 - base0), c1 = exp2f(m1 - base1);
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < BK / 8; nt++) {
      sacc[nt][0] = exp2f(sacc[nt][0] - base0);
      sacc[nt][1] = exp2f(sacc[nt][1] - base0);
      sacc[nt][2] = exp2f(sacc[nt][2] - base1);
      sacc[nt][3] = exp2f(sacc[nt][3] - base1);
      ps0 += sacc[nt][0] + sacc[nt][1];
      ps1 += sacc[nt][2] + sacc[nt][3];
    }
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
    l0 = l0 * c0 + ps0;
    l1 = l1 * c1 + ps1;
    m0 = mn0;
    m1 = mn1;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) { o[nt][0] *= c0; o[nt][1] *= c0; o[nt][2] *= c1; o[nt][3] *= c1; }
    // O += P V: the score accumulators are already laid out as the A operand.
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      unsigned a[4] = {pack_f32(sacc[2 * kk][0], sacc[2 * kk][1]), pack_f32(sacc[2 * kk][2], sacc[2 * kk][3]),
                       pack_f32(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]),
                       pack_f32(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3])};
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const bf16* vb = Vs + (kk * 16 + tg * 2) * LD + nt * 8 + gr;
        unsigned b[2] = {pack_bf(vb[0], vb[LD]), pack_bf(vb[8 * LD], vb[9 * LD])};
        mma_bf16_16816(o[nt], a, b);
      }
    }
  }

  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      int qi = e < 2 ? qi0 : qi1;
      int col = nt * 8 + tg * 2 + (e & 1);
      if (qi >= nq || col >= hd) continue;
      float v = o[nt][e] * (e < 2 ? inv0 : inv1);
      i64 row = q_start + qi;
      if (gate) v *= sigmoid_f(bf(gate[row * gate_row + (i64)h * gate_head + col]));
      out[(row * heads + h) * hd + col] = to_bf(v);
    }
  }
}

#define ATTN_ENTRY(HDP)                                                                                    \
  extern "C" __global__ void __launch_bounds__(128) attn_fwd_##HDP(                                         \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,            \
      const bf16* gate, i64 gate_row, int gate_head, bf16* out) {                                          \
    pdl_begin();                                                                                           \
    attn_fwd<HDP>(q, segs, heads, kvh, hd, causal, scale_log2, gate, gate_row, gate_head, out);            \
  }
ATTN_ENTRY(16)
ATTN_ENTRY(32)
ATTN_ENTRY(64)
ATTN_ENTRY(128)
ATTN_ENTRY(256)

// ---------------------------------------------------------------------------------------------
// attn_fwd_q128_<HDP>: the same attention (same segment table, masks, gate and output) for long
// sequences. A block is 8 warps = 128 query rows of one head (twice attn_fwd's 64, so every key/
// value tile read from L2 serves twice the rows); key/value tiles of BK rows are double-buffered
// in shared memory with cp.async (tile j+1 loads while tile j is multiplied); all mma operands come
// from shared memory through ldmatrix (x4; .trans for V), four times fewer shared-memory
// instructions than attn_fwd's scalar loads. BK = 32 for HDP 256 (Q 66 KB + 2 x (K + V) 66 KB: one
// block per SM), 64 otherwise. Blocks run heads fastest (blockIdx.x), so the heads of a kv group
// read a key tile from L2 at about the same time, and the last query tiles of a causal sequence
// (the longest) first. Only the tiles a causal diagonal or the sequence end cuts are masked.
// A row's arithmetic depends only on its own query, keys and BK, never on the other rows of the
// batch. CPU twin: as attn_fwd.

__device__ __forceinline__ void ldsm_x4(unsigned* r, const bf16* p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const bf16* p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// Issues (does not wait for) the copies of `rows` rows x HDP columns into dst (leading dimension
// LD), zero-filling rows past `valid` and columns past hd; row r is row j0 + r of a sequence stored
// as `alen` rows at `a` followed by rows at `b` (both with row stride `stride`). hd % 8 == 0.
template <int HDP, int LD>
__device__ __forceinline__ void issue_tile(bf16* dst, const bf16* a, int alen, const bf16* b, i64 stride, int j0,
                                           int valid, int hd, int rows) {
  constexpr int V = HDP / 8;
  for (int i = threadIdx.x; i < rows * V; i += blockDim.x) {
    int r = i / V, c = (i % V) * 8, j = j0 + r;
    bool ok = r < valid && c < hd;
    const bf16* src = !ok ? b : j < alen ? a + (i64)j * stride + c : b + (i64)(j - alen) * stride + c;
    cp_async16(dst + r * LD + c, src, ok);
  }
}

// out[row, h, col..col+1] = bf16(v · sigmoid(gate)) (no gate: bf16(v)).
__device__ __forceinline__ void store_gated(bf16* out, const bf16* gate, i64 gate_row, int gate_head, i64 row,
                                            int heads, int h, int hd, int col, float v0, float v1) {
  if (gate) {
    const bf16* gp = gate + row * gate_row + (i64)h * gate_head + col;
    v0 *= sigmoid_f(bf(gp[0]));
    v1 *= sigmoid_f(bf(gp[1]));
  }
  bf16* dst = out + (row * heads + h) * hd + col;
  dst[0] = to_bf(v0);
  dst[1] = to_bf(v1);
}

// issue_tile for one ROWS-row K or V tile by the (256) threads of attn_fwd_q128 (KvTileCopies'
// fast path for the padded layout): when the tile is whole (ROWS valid rows, all in the shared
// prefix or all in the own rows, hd = HDP), each thread copies its fixed 16-byte chunk of every
// (256 / (HDP/8))-th row with one pointer increment per copy. The same bytes land in the same places.
template <int HDP, int LD, int ROWS>
__device__ __forceinline__ void issue_kv_tile(bf16* dst, const bf16* a, int alen, const bf16* b, i64 stride, int j0,
                                              int valid, int hd) {
  constexpr int V = HDP / 8, RS = 256 / V, NU = ROWS / RS;
  if constexpr (NU > 0 && ROWS % RS == 0) {
    if (blockDim.x == 256 && valid >= ROWS && hd == HDP && (j0 + ROWS <= alen || j0 >= alen)) {
      const int t = threadIdx.x, c = (t % V) * 8, r0 = t / V;
      const bf16* src = (j0 >= alen ? b + (i64)(j0 - alen) * stride : a + (i64)j0 * stride) + (i64)r0 * stride + c;
      bf16* d = dst + r0 * LD + c;
#pragma unroll
      for (int u = 0; u < NU; u++) cp_async16(d + u * RS * LD, src + (i64)u * RS * stride, true);
      return;
    }
  }
  issue_tile<HDP, LD>(dst, a, alen, b, stride, j0, valid, hd, ROWS);
}

// MT m-tiles of 16 rows per warp: each K/V fragment read from shared memory then serves 16·MT rows
// (half the shared-memory traffic per FLOP at MT = 2). Measured at head dim 64 (4 warps of 32 rows,
// 2 blocks per SM): 203 TFLOP/s vs 213 with MT = 1 (8 warps of 16 rows), so every instance uses
// MT = 1; the parameter stays for the record and for head dims where more warps do not fit.
template <int HDP, int BK, int MT>
__device__ void attn_fwd_q128(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal,
                              float scale_log2, const bf16* gate, i64 gate_row, int gate_head, bf16* out,
                              int kv_split, int nsplit, float* part) {
  constexpr int BQ = 128, LD = HDP + 8, NT = HDP / 8, ST = BK / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = (bf16*)smem_raw;
  bf16* Ks = Qs + BQ * LD;           // [2][BK][LD]
  bf16* Vs = Ks + 2 * BK * LD;       // [2][BK][LD]
  const int h = blockIdx.x;
  const i64* sg = segs + SEG * blockIdx.z;
  const i64 q_start = sg[0];
  const int nq = (int)sg[1];
  const int tiles = (nq + BQ - 1) / BQ;
  // Split mode (kv_split > 0, sequences of at most BQ rows): blockIdx.y is the key range.
  const int tile = kv_split ? 0 : tiles - 1 - (int)blockIdx.y;  // longest (last) tiles first
  if (tile < 0) return;
  const int shared_len = (int)sg[4];
  const int kvlen = shared_len + (int)sg[7] + nq;
  const int g = h / (heads / kvh);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int qbase = tile * BQ;
  const int offset = kvlen - nq;
  const int qlast = min(nq, qbase + BQ) - 1;
  const int klimit = causal ? min(kvlen, offset + qlast + 1) : kvlen;
  // Keys below `clean` are visible to every row of the block: tiles entirely below need no mask.
  const int clean = causal ? min(kvlen, offset + qbase + 1) : kvlen;
  // Key tiles [kt0, ntiles): all of them, or in split mode those of key range blockIdx.y
  // (kv_split is a multiple of BK).
  const int kbeg = kv_split ? (int)blockIdx.y * kv_split : 0;
  const int kend = kv_split ? min(klimit, kbeg + kv_split) : klimit;
  const int kt0 = kbeg / BK;
  const int ntiles = kend > kbeg ? (kend + BK - 1) / BK : kt0;

  const i64 kstride = (i64)kvh * hd;
  const bf16* ks_ = (const bf16*)sg[2] + (i64)g * hd;
  const bf16* vs_ = (const bf16*)sg[3] + (i64)g * hd;
  const bf16* ko_ = (const bf16*)sg[5] + (i64)g * hd;
  const bf16* vo_ = (const bf16*)sg[6] + (i64)g * hd;
  issue_tile<HDP, LD>(Qs, q + ((q_start + qbase) * heads + h) * (i64)hd, BQ, q, (i64)heads * hd, 0, nq - qbase, hd, BQ);
  if (ntiles > kt0) {
    const int j0 = kt0 * BK, nb = kt0 & 1;
    issue_kv_tile<HDP, LD, BK>(Ks + nb * BK * LD, ks_, shared_len, ko_, kstride, j0, kvlen - j0, hd);
    issue_kv_tile<HDP, LD, BK>(Vs + nb * BK * LD, vs_, shared_len, vo_, kstride, j0, kvlen - j0, hd);
  }
  cp_async_commit();

  float o[MT][NT][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
  }
  // Row of the tile held by (m-tile mt, half hr) of this thread: warp·16·MT + 16·mt + gr + 8·hr.
  const int wrow = warp * 16 * MT + gr;
  // ldmatrix row addresses of this lane: A (Q) rows 0..15 of an m-tile at column +0 / +8; B (K)
  // keys of two 8-key groups at column +0 / +8; V (trans) keys +0..7 / +8..15 at dims +0 / +8.
  const bf16* qa_base = Qs + (warp * 16 * MT + (lane & 15)) * LD + (lane >> 4) * 8;
  const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_col = ((lane >> 3) & 1) * 8;
  const int vb_row = (lane & 7) + (((lane >> 3) & 1) << 3), vb_col = (lane >> 4) * 8;

  for (int kt = kt0; kt < ntiles; kt++) {
    cp_async_wait_group<0>();
    __syncthreads();  // tile kt (and Q) landed for all threads; everyone is done with tile kt - 1
    const int buf = kt & 1;
    if (kt + 1 < ntiles) {
      const int nb = buf ^ 1, j0 = (kt + 1) * BK;
      issue_kv_tile<HDP, LD, BK>(Ks + nb * BK * LD, ks_, shared_len, ko_, kstride, j0, kvlen - j0, hd);
      issue_kv_tile<HDP, LD, BK>(Vs + nb * BK * LD, vs_, shared_len, vo_, kstride, j0, kvlen - j0, hd);
    }
    cp_async_commit();
    const bf16* Kt = Ks + buf * BK * LD;
    const bf16* Vt = Vs + buf * BK * LD;

    // S = Q K^T: 16·MT rows x BK keys per warp.
    float sacc[MT][ST][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < ST; nt++) sacc[mt][nt][0] = sacc[mt][nt][1] = sacc[mt][nt][2] = sacc[mt][nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HDP / 16; ks++) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) ldsm_x4(a[mt], qa_base + mt * 16 * LD + ks * 16);
#pragma unroll
      for (int nt = 0; nt < ST; nt += 2) {
        unsigned b[4];
        ldsm_x4(b, Kt + (nt * 8 + kb_row) * LD + ks * 16 + kb_col);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16_16816(sacc[mt][nt], a[mt], b);
          mma_bf16_16816(sacc[mt][nt + 1], a[mt], b + 2);
        }
      }
    }
    const bool masked = (kt + 1) * BK > clean;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const int qi0 = qbase + wrow + 16 * mt, qi1 = qi0 + 8;
      float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < ST; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float v = sacc[mt][nt][e] * scale_log2;
          if (masked) {
            int col = kt * BK + nt * 8 + tg * 2 + (e & 1);
            int qi = e < 2 ? qi0 : qi1;
            if (!(col < kvlen && (!causal || col <= offset + qi))) v = NEG_INF;
          }
          sacc[mt][nt][e] = v;
          if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
        }
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
      const float base0 = mn0 == NEG_INF ? 0.f : mn0, base1 = mn1 == NEG_INF ? 0.f : mn1;
      const float c0 = exp2f(m[mt][0] - base0), c1 = exp2f(m[mt][1] - base1);
      float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < ST; nt++) {
        sacc[mt][nt][0] = exp2f(sacc[mt][nt][0] - base0);
        sacc[mt][nt][1] = exp2f(sacc[mt][nt][1] - base0);
        sacc[mt][nt][2] = exp2f(sacc[mt][nt][2] - base1);
        sacc[mt][nt][3] = exp2f(sacc[mt][nt][3] - base1);
        ps0 += sacc[mt][nt][0] + sacc[mt][nt][1];
        ps1 += sacc[mt][nt][2] + sacc[mt][nt][3];
      }
      ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
      ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
      ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
      ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
      l[mt][0] = l[mt][0] * c0 + ps0;
      l[mt][1] = l[mt][1] * c1 + ps1;
      m[mt][0] = mn0;
      m[mt][1] = mn1;
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        o[mt][nt][0] *= c0;
        o[mt][nt][1] *= c0;
        o[mt][nt][2] *= c1;
        o[mt][nt][3] *= c1;
      }
    }
    // O += P V: the score accumulators are already laid out as the A operand.
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        a[mt][0] = pack_f32(sacc[mt][2 * kk][0], sacc[mt][2 * kk][1]);
        a[mt][1] = pack_f32(sacc[mt][2 * kk][2], sacc[mt][2 * kk][3]);
        a[mt][2] = pack_f32(sacc[mt][2 * kk + 1][0], sacc[mt][2 * kk + 1][1]);
        a[mt][3] = pack_f32(sacc[mt][2 * kk + 1][2], sacc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        unsigned b[4];
        ldsm_x4_trans(b, Vt + (kk * 16 + vb_row) * LD + nt * 8 + vb_col);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16_16816(o[mt][nt], a[mt], b);
          mma_bf16_16816(o[mt][nt + 1], a[mt], b + 2);
        }
      }
    }
  }
  cp_async_wait_group<0>();  // nothing may be in flight into shared memory when the block exits

  if (kv_split) {
    // The range's unnormalised output and its (max, sum) per row, f32, for attn_split_combine:
    // slot (sequence blockIdx.z, head, range) holds [BQ][HDP] then m [BQ] and l [BQ].
    float* slot = part + (((i64)blockIdx.z * heads + h) * nsplit + blockIdx.y) * (BQ * HDP + 2 * BQ);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
      for (int hr = 0; hr < 2; hr++) {
        const int r = wrow + 16 * mt + 8 * hr;
        if (qbase + r >= nq) continue;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          const int col = nt * 8 + tg * 2;
          *(float2*)(slot + r * HDP + col) = make_float2(o[mt][nt][2 * hr], o[mt][nt][2 * hr + 1]);
        }
        if (tg == 0) {
          slot[BQ * HDP + r] = m[mt][hr];
          slot[BQ * HDP + BQ + r] = l[mt][hr];
        }
      }
    }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
      const int qi = qbase + wrow + 16 * mt + 8 * hr;
      const float inv = l[mt][hr] > 0.f ? 1.f / l[mt][hr] : 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const int col = nt * 8 + tg * 2;
        if (qi >= nq || col >= hd) continue;
        float v0 = o[mt][nt][2 * hr] * inv, v1 = o[mt][nt][2 * hr + 1] * inv;
        store_gated(out, gate, gate_row, gate_head, q_start + qi, heads, h, hd, col, v0, v1);
      }
    }
  }
}

// Split over keys: a sequence of at most 128 query rows over a long cache (a pass over a long
// prefix) has one query tile per head, so one block would walk all its keys alone. Instead, blocks
// (head, key range of kv_split keys, sequence) write partial results, and attn_split_combine merges
// the ranges of each row in range order. The ranges are fixed multiples of kv_split from key 0 and
// a sequence is split by its own length and rows only, so its arithmetic never depends on the batch.
#define ATTN_Q128_ENTRY(HDP, BK, MT, MINB)                                                                 \
  extern "C" __global__ void __launch_bounds__(128 / MT * 2, MINB) attn_fwd_q128_##HDP(                     \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,            \
      const bf16* gate, i64 gate_row, int gate_head, bf16* out, int kv_split, int nsplit, float* part) {  \
    pdl_begin();                                                                                          \
    attn_fwd_q128<HDP, BK, MT>(q, segs, heads, kvh, hd, causal, scale_log2, gate, gate_row, gate_head, out, \
                               kv_split, nsplit, part);                                                     \
  }
ATTN_Q128_ENTRY(64, 64, 1, 2)
ATTN_Q128_ENTRY(128, 64, 1, 1)
ATTN_Q128_ENTRY(256, 32, 1, 1)

// Merges the key ranges of split attention: one block of 64 threads per (row, head, sequence);
// for a row, M = max of the ranges' maxima, L = sum l_j 2^(m_j - M), out = (sum o_j 2^(m_j - M)) / L
// in range order j = 0, 1, ..., then the gate, as attn_fwd's epilogue. Ranges a row cannot see
// (m = -inf, l = 0) add nothing.
template <int HDP>
__device__ void attn_split_combine(const float* part, const i64* segs, int heads, int hd, int nsplit,
                                   const bf16* gate, i64 gate_row, int gate_head, bf16* out) {
  constexpr int BQ = 128;
  const int r = blockIdx.x, h = blockIdx.y;
  const i64* sg = segs + SEG * blockIdx.z;
  if (r >= (int)sg[1]) return;
  const float* slots = part + ((i64)blockIdx.z * heads + h) * nsplit * (BQ * HDP + 2 * BQ);
  float M = NEG_INF;
  for (int j = 0; j < nsplit; j++) M = fmaxf(M, slots[(i64)j * (BQ * HDP + 2 * BQ) + BQ * HDP + r]);
  const float base = M == NEG_INF ? 0.f : M;
  float L = 0.f;
  for (int j = 0; j < nsplit; j++) {
    const float* sl = slots + (i64)j * (BQ * HDP + 2 * BQ);
    L += sl[BQ * HDP + BQ + r] * exp2f(sl[BQ * HDP + r] - base);
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int col = 2 * threadIdx.x; col < hd; col += 2 * blockDim.x) {
    float v0 = 0.f, v1 = 0.f;
    for (int j = 0; j < nsplit; j++) {
      const float* sl = slots + (i64)j * (BQ * HDP + 2 * BQ);
      const float f = sl[BQ * HDP + BQ + r] > 0.f ? exp2f(sl[BQ * HDP + r] - base) : 0.f;
      v0 += f * sl[r * HDP + col];
      v1 += f * sl[r * HDP + col + 1];
    }
    store_gated(out, gate, gate_row, gate_head, sg[0] + r, heads, h, hd, col, v0 * inv, v1 * inv);
  }
}

#define ATTN_COMBINE_ENTRY(HDP)                                                                            \
  extern "C" __global__ void __launch_bounds__(64) attn_split_combine_##HDP(                               \
      const float* part, const i64* segs, int heads, int hd, int nsplit, const bf16* gate, i64 gate_row,   \
      int gate_head, bf16* out) {                                                                          \
    pdl_begin();                                                                                           \
    attn_split_combine<HDP>(part, segs, heads, hd, nsplit, gate, gate_row, gate_head, out);                \
  }
ATTN_COMBINE_ENTRY(64)
ATTN_COMBINE_ENTRY(128)
ATTN_COMBINE_ENTRY(256)

// ---------------------------------------------------------------------------------------------
// attn_fwd_wgmma_<HDP> (Hopper, sm_90a): the same attention with warpgroup MMAs, key tiles of
// BK = 64 (attn_fwd_wgmma_k128_64: BK = 128 at head dim 64, an option until measured: it halves the
// per-tile work — barriers, waits, copies' bookkeeping, row reductions — per score where the
// kernel is issue-bound, and costs 48 registers). A block is two
// warpgroups (256 threads) of 64 query rows each; S = Q K^T and O += P V are wgmma.mma_async: Q, K
// and V are read by the tensor cores straight from shared memory, once per warpgroup of 64 rows
// (mma.sync reads every K/V fragment once per warp of 16 rows, and attn_fwd_q128 is bound by
// those shared-memory reads at ~210 TFLOP/s). P stays in registers (the S accumulators are the A
// fragments). K/V tiles of BK keys are double-buffered with cp.async as in attn_fwd_q128.
//
// Shared memory holds every operand in the 128-byte-swizzled layout the descriptors name: a tile
// of R rows x HDP columns is HDP/64 column blocks, each R rows of 128 bytes in which the 16-byte
// chunk c of row r sits at chunk c ^ (r % 8); the region starts 1024-byte aligned. Descriptors:
// Q and K (K-major: rows are the M/N dimension, head dims contiguous): SBO = 1024 (8 rows),
// k16 step = +32 bytes within a column block, next column block = + R·128; V (the B of P V is
// N-major: head dims contiguous per key): SBO = 1024 (8 keys), LBO = 64 keys·128 bytes (the next
// 64 head dims), k16 step = +2048 (16 keys).
// Arithmetic: f32 accumulation, the softmax exactly as attn_fwd_q128 (per row: scale, mask, max,
// exp2, sums over 64-key tiles in order), so a row never depends on the other rows of the batch.
// CPU twin: as attn_fwd.

#ifdef IMAJEV_WGMMA
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B from shared memory (K-major descriptors);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_ss_m64n64(float (&d)[32], unsigned long long da, unsigned long long db,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 64] += A[64 x 16] B[16 x 64], A from registers (the mma.sync m16n8k16 A fragment of
// each warp's 16 rows), B from shared memory, N-major (transposed).
__device__ __forceinline__ void wgmma_rs_m64n64(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 8] += A[64 x 16] B[16 x 8], A from registers (as wgmma_rs_m64n64), B from shared memory,
// N-major. With B all ones, D's columns are the rows' sums of A: attn_fwd_wgmma_tsum_64's row
// sums of P.
__device__ __forceinline__ void wgmma_rs_m64n8(float (&d)[4], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 256] += A[64 x 16] B[16 x 256], A from registers (the mma.sync m16n8k16 A fragment of
// each warp's 16 rows), B from shared memory, N-major (transposed).
__device__ __forceinline__ void wgmma_rs_m64n256(float (&d)[128], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// 2^x in one MUFU instruction (exp2f adds a range check and two multiplies for denormal results;
// flushing those to zero changes nothing here: they are added to a sum that is at least 1).
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A BF16 pair of ones (attn_fwd_wgmma_tsum_64's shared ones).
constexpr unsigned ONES2 = 0x3F803F80u;

// Issues the copy of 16-byte chunk i (row i / (HDP/8)) of a tile of `rows` rows x HDP columns into
// a swizzled tile at dst (see above), zero-filled when its row is past `valid` or its columns past
// hd; row r is row j0 + r of a sequence stored as `alen` rows at `a` followed by rows at `b`.
template <int HDP>
__device__ __forceinline__ void issue_chunk_sw(unsigned char* dst, const bf16* a, int alen, const bf16* b, i64 stride,
                                               int j0, int valid, int hd, int rows, int i) {
  constexpr int V = HDP / 8;  // 16-byte chunks per row
  const int r = i / V, c = i % V, col = c * 8, j = j0 + r;
  const bool ok = r < valid && col < hd;
  const bf16* src = !ok ? b : j < alen ? a + (i64)j * stride + col : b + (i64)(j - alen) * stride + col;
  unsigned char* d = dst + (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  cp_async16(d, src, ok);
}

// Issues the copies of `rows` rows x HDP columns into a swizzled tile at dst (see above), zero-
// filling rows past `valid` and columns past hd; rows as issue_tile's.
template <int HDP>
__device__ __forceinline__ void issue_tile_sw(unsigned char* dst, const bf16* a, int alen, const bf16* b, i64 stride,
                                              int j0, int valid, int hd, int rows) {
  for (int i = threadIdx.x; i < rows * (HDP / 8); i += blockDim.x)
    issue_chunk_sw<HDP>(dst, a, alen, b, stride, j0, valid, hd, rows, i);
}

// The K and V tile copies of attn_fwd_wgmma(_ov): issue_tile_sw for one 64-row tile by the 256
// threads of the block, with a fast path for whole tiles (64 valid rows, all in the shared prefix
// or all in the own rows, hd = HDP: every tile of a long sequence but its last), where each thread
// copies its fixed 16-byte chunk c = t % (HDP/8) of rows t / (HDP/8) + u·(2048/HDP). Everything of
// that path that does not change from tile to tile is computed once per block, here: the byte
// address of this thread's chunk in row 0 of the shared prefix and, rebased so that sequence row j
// is at the same offset j·stride, of the own rows, for K and for V, and its place in the swizzled
// tile. A whole tile then costs a select, a multiply-add and the copies per matrix (computing them
// per tile was ~45 instructions per matrix, ~90 of the ~350 per tile and thread at head dim 64,
// where the kernel is issue-bound: SASS, NOTES). The same bytes land in the same places either way.
template <int HDP, int ROWS = 64>
struct KvTileCopies {
  static constexpr int V = HDP / 8, RS = 256 / V, NU = ROWS / RS;  // chunks per row, row step, copies
  static constexpr int TILE = ROWS * HDP * 2;                        // bytes of one tile buffer
  static_assert(RS % 8 == 0, "the row step must keep the swizzle phase");
  unsigned char *kt, *vt;         // the K and V tile buffers (buffer b at + b·TILE)
  const bf16 *ks, *ko, *vs, *vo;  // the shared prefix's and the own rows' keys and values
  i64 stride;
  int alen;
  unsigned long long off;  // byte offset of this thread's chunk in a block of rows
  unsigned kd, vd;         // shared-space address of this thread's chunk in buffer 0 of K and of V
  unsigned fast;           // 256 threads and hd == HDP: the fast path's block-wide conditions

  __device__ __forceinline__ KvTileCopies(unsigned char* kt_, unsigned char* vt_, const bf16* ks_, const bf16* ko_,
                                          const bf16* vs_, const bf16* vo_, int alen_, i64 stride_, int hd)
      : kt(kt_), vt(vt_), ks(ks_), ko(ko_), vs(vs_), vo(vo_), stride(stride_), alen(alen_) {
    const int t = threadIdx.x, c = t % V, r0 = t / V;
    off = kept_u64((unsigned long long)(((i64)r0 * stride + c * 8) * 2));
    const unsigned doff = (c >> 3) * ROWS * 128 + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
    kd = kept_u32((unsigned)__cvta_generic_to_shared(kt) + doff);
    vd = kept_u32((unsigned)__cvta_generic_to_shared(vt) + doff);
    fast = kept_u32(blockDim.x == 256 && hd == HDP);
  }
  __device__ __forceinline__ bool whole(int j0, int valid) const {
    return fast && valid >= ROWS && (j0 + ROWS <= alen || j0 >= alen);
  }
  // The fast path's copies of one matrix: `rows` is its first row j0 (prefix or own rows).
  __device__ __forceinline__ void copy_whole(unsigned d, const bf16* rows) const {
    const unsigned long long src = (unsigned long long)rows + off;
#pragma unroll
    for (int u = 0; u < NU; u++)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + u * RS * 128),
                   "l"(src + (unsigned long long)((i64)u * RS * stride * 2)));
  }
  // Rows j0.. of K (v = false) or V into tile buffer `buf`; `valid` rows exist from j0.
  __device__ __forceinline__ void issue(int buf, bool v, int j0, int valid, int hd) const {
    if (whole(j0, valid)) {
      const bool own = j0 >= alen;
      const i64 row = (i64)(own ? j0 - alen : j0) * stride;
      copy_whole((v ? vd : kd) + buf * TILE, (v ? (own ? vo : vs) : (own ? ko : ks)) + row);
    } else {
      issue_tile_sw<HDP>((v ? vt : kt) + buf * TILE, v ? vs : ks, alen, v ? vo : ko, stride, j0, valid, hd, ROWS);
    }
  }
  // Both K and V of the rows j0.. into tile buffer `buf` (one test and one row offset for both).
  __device__ __forceinline__ void issue_both(int buf, int j0, int valid, int hd) const {
    if (whole(j0, valid)) {
      const bool own = j0 >= alen;
      const i64 row = (i64)(own ? j0 - alen : j0) * stride;
      copy_whole(kd + buf * TILE, (own ? ko : ks) + row);
      copy_whole(vd + buf * TILE, (own ? vo : vs) + row);
    } else {
      issue_tile_sw<HDP>(kt + buf * TILE, ks, alen, ko, stride, j0, valid, hd, ROWS);
      issue_tile_sw<HDP>(vt + buf * TILE, vs, alen, vo, stride, j0, valid, hd, ROWS);
    }
  }
};

// The descriptor low words attn_fwd_wgmma(_ov) use every tile, computed once and held in
// registers (kept_u32): this warpgroup's 64 rows of Q, and buffer `buf` of K and of V (BK keys x
// HDP each, buffer 1 right after buffer 0).
template <int HDP, int BK = 64>
struct WgmmaDescs {
  static constexpr unsigned TILE16 = BK * HDP * 2 / 16;
  unsigned q, k0, v0;
  __device__ __forceinline__ WgmmaDescs(const unsigned char* Qw, const unsigned char* Ks, const unsigned char* Vs)
      : q(kept_u32(smem_desc_lo(Qw, 16))), k0(kept_u32(smem_desc_lo(Ks, 16))),
        v0(kept_u32(smem_desc_lo(Vs, BK * 128))) {}
  __device__ __forceinline__ unsigned k(int buf) const { return k0 + buf * TILE16; }
  __device__ __forceinline__ unsigned v(int buf) const { return v0 + buf * TILE16; }
};

// The online softmax of one key tile (2·NS keys: NS scores per thread) for this thread's two rows
// r0 (qi0) and r0 + 8 (qi1), shared by attn_fwd_wgmma, attn_fwd_wgmma_ov and attn_fwd_ws so that
// they compute the same bits for the same tile size. s[4j + e] is row
// (e < 2 ? qi0 : qi1), key kcol0 + 8j + 2tg + (e & 1); when `masked`, keys past kvlen (and, causal,
// after the row's position offset + qi) become -inf. The max is taken over the raw scores (the scale
// is positive) and the scale folded into the one FMA before ex2: p = 2^(s·scale − max·scale), left in
// s. Updates the running max m and sum l per row and returns in c the factors by which O must be
// rescaled. At head dim 64 the softmax is what limits these kernels (issue-bound: ncu, NOTES), so
// every instruction per score counts.
//
// wgmma_softmax_p is all of it but the sums (m updated, P left in s, c returned): the softmax of
// attn_fwd_wgmma_tsum_64, whose sums the tensor cores take (wgmma_row_sums) from the BF16 P the
// numerator multiplies, saving the add per score and the shuffles per tile; not
// wgmma_softmax_tile's bits, whose sums are of the f32 P before rounding.
template <int NS>
__device__ __forceinline__ void wgmma_softmax_p(float (&s)[NS], bool masked, int kcol0, int kvlen, int causal,
                                                int offset, int qi0, int qi1, int tg, float scale_log2, float& m0,
                                                float& m1, float& c0, float& c1) {
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int j = 0; j < NS / 4; j++) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float v = s[4 * j + e];
      if (masked) {
        const int col = kcol0 + 8 * j + 2 * tg + (e & 1);
        const int qi = e < 2 ? qi0 : qi1;
        if (!(col < kvlen && (!causal || col <= offset + qi))) v = NEG_INF;
        s[4 * j + e] = v;
      }
      if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float b0 = mn0 == NEG_INF ? 0.f : mn0 * scale_log2, b1 = mn1 == NEG_INF ? 0.f : mn1 * scale_log2;
  c0 = ex2_ftz(fmaf(m0, scale_log2, -b0));
  c1 = ex2_ftz(fmaf(m1, scale_log2, -b1));
  m0 = mn0;
  m1 = mn1;
#pragma unroll
  for (int j = 0; j < NS / 4; j++) {
    s[4 * j + 0] = ex2_ftz(fmaf(s[4 * j + 0], scale_log2, -b0));
    s[4 * j + 1] = ex2_ftz(fmaf(s[4 * j + 1], scale_log2, -b0));
    s[4 * j + 2] = ex2_ftz(fmaf(s[4 * j + 2], scale_log2, -b1));
    s[4 * j + 3] = ex2_ftz(fmaf(s[4 * j + 3], scale_log2, -b1));
  }
}

template <int NS>
__device__ __forceinline__ void wgmma_softmax_tile(float (&s)[NS], bool masked, int kcol0, int kvlen, int causal,
                                                   int offset, int qi0, int qi1, int tg, float scale_log2, float& m0,
                                                   float& m1, float& l0, float& l1, float& c0, float& c1) {
  wgmma_softmax_p(s, masked, kcol0, kvlen, causal, offset, qi0, qi1, tg, scale_log2, m0, m1, c0, c1);
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int j = 0; j < NS / 4; j++) {
    ps0 += s[4 * j + 0] + s[4 * j + 1];
    ps1 += s[4 * j + 2] + s[4 * j + 3];
  }
  ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
  ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
  ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
  ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
  l0 = l0 * c0 + ps0;
  l1 = l1 * c1 + ps1;
}

// Accumulators in the S/O layout (a[4j + e]: row qi0 for e < 2, qi1 otherwise) times c0 or c1.
template <int N>
__device__ __forceinline__ void scale_rows(float (&a)[N], float c0, float c1) {
#pragma unroll
  for (int j = 0; j < N / 4; j++) {
    a[4 * j + 0] *= c0;
    a[4 * j + 1] *= c0;
    a[4 * j + 2] *= c1;
    a[4 * j + 3] *= c1;
  }
}

// O *= c per row, only when some row of the warp saw a new max: multiplying by 1 changes no bit,
// so skipping it is exact, and after the first tiles the max rarely moves (at head dim 256 the
// rescale is 128 multiplies per thread against 32 scores).
template <int NO>
__device__ __forceinline__ void wgmma_rescale_o(float (&o)[NO], float c0, float c1) {
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) scale_rows(o, c0, c1);
}

// P's k16 slices as BF16 A fragments of the P V MMA (the S accumulator layout is the A layout).
template <int NS>
__device__ __forceinline__ void wgmma_pack_p(const float (&s)[NS], unsigned (&pa)[NS / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < NS / 8; kk++) {
    pa[kk][0] = pack_f32(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack_f32(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack_f32(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack_f32(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// The P V MMAs of one key tile of 16·KT keys: O += P V_t (V_t N-major in the swizzled layout;
// vlo is smem_desc_lo(V_t, 16·KT · 128)).
template <int HDP, int NO, int KT>
__device__ __forceinline__ void wgmma_pv_tile(float (&o)[NO], const unsigned (&pa)[KT][4], unsigned vlo) {
#pragma unroll
  for (int kk = 0; kk < KT; kk++) {
    const unsigned long long db = smem_desc_of(vlo + ((kk * 16 * 128) >> 4), 1024);
    if constexpr (HDP == 64) wgmma_rs_m64n64(o, pa[kk], db);
    else wgmma_rs_m64n256(o, pa[kk], db);
  }
}

// The rows' sums of P of one key tile of 16·KT keys on the tensor cores: ls += P · ones, one
// wgmma_rs_m64n8 per k16 slice. ones_db describes shared memory holding nothing but BF16 ones, so
// whatever bytes its layout names, B is all ones and ls[0] (= ls[1]) is row qi0's sum, ls[2] (=
// ls[3]) row qi1's: the sum of the BF16 P the P V MMAs multiply, accumulated in f32.
template <int KT>
__device__ __forceinline__ void wgmma_row_sums(float (&ls)[4], const unsigned (&pa)[KT][4],
                                               unsigned long long ones_db) {
#pragma unroll
  for (int kk = 0; kk < KT; kk++) wgmma_rs_m64n8(ls, pa[kk], ones_db);
}

// The S MMAs of one key tile of 2·NS keys (64 or 128): s = Q_w K_t^T (the warpgroup's 64 rows
// of Q, BQ rows per column block; qlo and klo are smem_desc_lo(Q_w, 16) and smem_desc_lo(K_t, 16)).
template <int HDP, int BQ, int NS>
__device__ __forceinline__ void wgmma_qk_tile(float (&s)[NS], unsigned qlo, unsigned klo) {
  constexpr int BK = 2 * NS;  // 64 rows x BK keys over 128 threads: BK / 2 scores each
  static_assert(BK == 64 || BK == 128, "key tiles of 64 or 128");
#pragma unroll
  for (int ks = 0; ks < HDP / 16; ks++) {
    const int cb = ks >> 2, off = (ks & 3) * 32;
    const unsigned long long da = smem_desc_of(qlo + ((cb * BQ * 128 + off) >> 4), 1024);
    const unsigned long long db = smem_desc_of(klo + ((cb * BK * 128 + off) >> 4), 1024);
    if constexpr (BK == 128) wgmma_ss_m64n128(s, da, db, ks > 0);
    else wgmma_ss_m64n64(s, da, db, ks > 0);
  }
}

// Writes this thread's two rows of O / l (rows qi0 and qi1 of the sequence, those below nq), gated.
template <int NO>
__device__ __forceinline__ void wgmma_store_rows(const float (&o)[NO], float l0, float l1, int qi0, int qi1, int nq,
                                                 int hd, int tg, bf16* out, const bf16* gate, i64 gate_row,
                                                 int gate_head, i64 q_start, int heads, int h) {
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    const int qi = hr == 0 ? qi0 : qi1;
    const float inv = (hr == 0 ? l0 : l1) > 0.f ? 1.f / (hr == 0 ? l0 : l1) : 0.f;
#pragma unroll
    for (int j = 0; j < NO / 4; j++) {
      const int col = 8 * j + 2 * tg;
      if (qi >= nq || col >= hd) continue;
      store_gated(out, gate, gate_row, gate_head, q_start + qi, heads, h, hd, col, o[4 * j + 2 * hr] * inv,
                  o[4 * j + 2 * hr + 1] * inv);
    }
  }
}

// A block's head and its query tile counted from the last, from blockIdx: x the head and y the
// tile (heads fastest: the query heads of a KV group read its key tiles from L2 at about the same
// time, but the blocks on the GPU at once stream every group's keys), or GROUPED: x = r + R·tile
// for the group's query head r < R = heads / kvh, y the KV group (a group's query tiles run
// together, its heads fastest, so the blocks on the GPU at once share one or two groups' keys and
// values in L2; without GQA, R = 1, a head's tiles). The order of the blocks is all it changes:
// a block's work and arithmetic are the same.
template <bool GROUPED>
__device__ __forceinline__ int block_head(int heads, int kvh) {
  if constexpr (GROUPED) {
    const int R = heads / kvh;
    return (int)blockIdx.y * R + (int)blockIdx.x % R;
  } else {
    return (int)blockIdx.x;
  }
}
template <bool GROUPED>
__device__ __forceinline__ int block_tile_from_last(int heads, int kvh) {
  return GROUPED ? (int)blockIdx.x / (heads / kvh) : (int)blockIdx.y;
}

// What one block of attn_fwd_wgmma(_ov) works on, from the segment table (its head and query tile
// as block_head / block_tile_from_last, z the sequence): its BQ-row query tile, the key tiles of
// BK keys it walks (causal: up to its last row's position), the first key that needs a mask, and
// its KV group's keys and values (the shared prefix's, then the sequence's own). False when the
// sequence has no such tile.
struct WgmmaBlock {
  i64 q_start, kstride;
  int nq, shared_len, kvlen, qbase, offset, clean, ntiles;
  const bf16 *ks, *vs, *ko, *vo;
};
template <int BQ, int BK, bool GROUPED = false>
__device__ __forceinline__ bool wgmma_block(WgmmaBlock& b, const i64* segs, int heads, int kvh, int hd, int causal) {
  const i64* sg = segs + SEG * blockIdx.z;
  b.q_start = sg[0];
  b.nq = (int)sg[1];
  const int tile = (b.nq + BQ - 1) / BQ - 1 - block_tile_from_last<GROUPED>(heads, kvh);
  if (tile < 0) return false;
  b.shared_len = (int)sg[4];
  b.kvlen = b.shared_len + (int)sg[7] + b.nq;
  const int g = block_head<GROUPED>(heads, kvh) / (heads / kvh);
  b.qbase = tile * BQ;
  b.offset = b.kvlen - b.nq;
  const int qlast = min(b.nq, b.qbase + BQ) - 1;
  const int klimit = causal ? min(b.kvlen, b.offset + qlast + 1) : b.kvlen;
  b.clean = causal ? min(b.kvlen, b.offset + b.qbase + 1) : b.kvlen;
  b.ntiles = (klimit + BK - 1) / BK;
  b.kstride = (i64)kvh * hd;
  b.ks = (const bf16*)sg[2] + (i64)g * hd;
  b.vs = (const bf16*)sg[3] + (i64)g * hd;
  b.ko = (const bf16*)sg[5] + (i64)g * hd;
  b.vo = (const bf16*)sg[6] + (i64)g * hd;
  return true;
}

// The start of key tile kt of a block's walk from tile kt0 (attn_fwd_wgmma's loops): waits for
// its copies (and Q's, before the first), makes them visible to the tensor cores, and starts the
// copies of tile kt + ST - 1 into the buffer tile kt - 1 used (ST = 2: double buffering; ST = 3:
// the copies two tiles ahead, tile kt + 1's still in flight, one copy group a tile, empty past the
// last). Returns tile kt's buffer.
template <int HDP, int BK, int ST = 2>
__device__ __forceinline__ int wgmma_tile_begin(const KvTileCopies<HDP, BK>& kv, int kt, int kt0, int ntiles,
                                                int kvlen, int hd) {
  static_assert(ST == 2 || ST == 3, "two or three K/V buffers");
  cp_async_wait_group<ST - 2>();
  fence_proxy_async();
  __syncthreads();  // tile kt (and Q) landed, visible to the tensor cores; tile kt - 1 is done
  const int buf = (kt - kt0) % ST;
  if (kt + ST - 1 < ntiles) {
    const int nb = (buf + ST - 1) % ST, j0 = (kt + ST - 1) * BK;
    kv.issue_both(nb, j0, kvlen - j0, hd);
  }
  cp_async_commit();
  return buf;
}

// The key tiles kt0..ntiles of one block of attn_fwd_wgmma (and attn_fwd_wgmma_split, over one key
// range): tile kt0 (and Q) already in flight into buffer 0; per tile: wait for it, start the next
// tile's copies into the other buffer, S = Q K^T, the online softmax, O += P V. Updates this
// thread's O accumulators and its two rows' running max and sum. With TSUM
// (attn_fwd_wgmma_tsum_64) the softmax is wgmma_softmax_p and each tile's row sums come
// from the tensor cores (wgmma_row_sums over the BF16 ones at ones_lo, a descriptor's low word,
// into accumulators live only during the P V MMAs), added to the running sums after the wait.
template <int HDP, int BQ, int BK, int NO, bool TSUM = false, int ST = 2>
__device__ __forceinline__ void wgmma_key_tiles(const KvTileCopies<HDP, BK>& kv, const WgmmaDescs<HDP, BK>& desc,
                                                int kt0, int ntiles, int clean, int kvlen, int causal, int offset,
                                                int qi0, int qi1, int tg, float scale_log2, int hd, float (&o)[NO],
                                                float& m0, float& m1, float& l0, float& l1, unsigned ones_lo = 0) {
  for (int kt = kt0; kt < ntiles; kt++) {
    const int buf = wgmma_tile_begin<HDP, BK, ST>(kv, kt, kt0, ntiles, kvlen, hd);

    // S = Q K^T (64 rows x BK keys per warpgroup).
    float s[BK / 2];
    wgmma_fence();
    wgmma_qk_tile<HDP, BQ>(s, desc.q, desc.k(buf));
    wgmma_commit();
    wgmma_wait0();

    const bool masked = (kt + 1) * BK > clean;
    float c0, c1;
    if constexpr (TSUM)
      wgmma_softmax_p(s, masked, kt * BK, kvlen, causal, offset, qi0, qi1, tg, scale_log2, m0, m1, c0, c1);
    else
      wgmma_softmax_tile(s, masked, kt * BK, kvlen, causal, offset, qi0, qi1, tg, scale_log2, m0, m1, l0, l1, c0, c1);
    wgmma_rescale_o(o, c0, c1);
    // O += P V: P's k16 slices are the A fragments of the S accumulators (all packed before the
    // fence, so no register the MMAs read changes between them).
    unsigned pa[BK / 16][4];
    wgmma_pack_p(s, pa);
    float ts[4] = {0.f, 0.f, 0.f, 0.f};  // TSUM: this tile's row sums (wgmma_row_sums' layout)
    wgmma_fence();
    wgmma_pv_tile<HDP>(o, pa, desc.v(buf));
    if constexpr (TSUM) wgmma_row_sums(ts, pa, smem_desc_of(ones_lo, 1024));
    wgmma_commit();
    wgmma_wait0();
    if constexpr (TSUM) {
      l0 = l0 * c0 + ts[0];
      l1 = l1 * c1 + ts[2];
    }
  }
}

// TSUM (attn_fwd_wgmma_tsum_64): the softmax of wgmma_softmax_p, and after the
// K and V buffers 4 KB of BF16 ones (1024-aligned: every buffer before it is a multiple of 1 KB),
// the B of the rows' sums. ST: K/V buffers (wgmma_tile_begin).
template <int HDP, int BK, bool TSUM = false, bool GROUPED = false, int ST = 2>
__device__ void attn_fwd_wgmma(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal,
                               float scale_log2, const bf16* gate, i64 gate_row, int gate_head, bf16* out) {
  constexpr int BQ = 128, NO = HDP / 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* Qs = smem_1024(smem_raw);       // BQ x HDP
  unsigned char* Ks = Qs + BQ * HDP * 2;         // [ST] BK x HDP
  unsigned char* Vs = Ks + ST * BK * HDP * 2;    // [ST] BK x HDP
  unsigned char* ones = Vs + ST * BK * HDP * 2;  // TSUM: 4 KB of BF16 ones
  const int h = block_head<GROUPED>(heads, kvh);
  WgmmaBlock B;
  if (!wgmma_block<BQ, BK, GROUPED>(B, segs, heads, kvh, hd, causal)) return;
  // 256 threads x 16 bytes; the first tile's fence and barrier make them visible to the MMAs.
  if constexpr (TSUM) reinterpret_cast<uint4*>(ones)[threadIdx.x] = make_uint4(ONES2, ONES2, ONES2, ONES2);
  const i64 q_start = B.q_start;
  const int nq = B.nq, shared_len = B.shared_len, kvlen = B.kvlen, qbase = B.qbase, offset = B.offset;
  const int clean = B.clean, ntiles = B.ntiles;
  const i64 kstride = B.kstride;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  issue_tile_sw<HDP>(Qs, q + ((q_start + qbase) * heads + h) * (i64)hd, BQ, q, (i64)heads * hd, 0, nq - qbase, hd, BQ);
  const KvTileCopies<HDP, BK> kv(Ks, Vs, B.ks, B.ko, B.vs, B.vo, shared_len, kstride, hd);
  if (ntiles > 0) kv.issue_both(0, 0, kvlen, hd);
  cp_async_commit();
  if constexpr (ST == 3) {  // the second tile in flight too (an empty group when there is none)
    if (ntiles > 1) kv.issue_both(1, BK, kvlen - BK, hd);
    cp_async_commit();
  }

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  // This thread's rows of the tile: the warpgroup's 64, the warp's 16, then gr and gr + 8.
  const int r0 = wg * 64 + warp * 16 + gr;
  const int qi0 = qbase + r0, qi1 = qi0 + 8;
  // The warpgroup's 64 rows of Q start 64 rows (8 swizzle groups) into each column block.
  const WgmmaDescs<HDP, BK> desc(Qs + wg * 64 * 128, Ks, Vs);

  wgmma_key_tiles<HDP, BQ, BK, NO, TSUM, ST>(kv, desc, 0, ntiles, clean, kvlen, causal, offset, qi0, qi1, tg,
                                             scale_log2, hd, o, m0, m1, l0, l1,
                                             TSUM ? kept_u32(smem_desc_lo(ones, 1024)) : 0u);
  cp_async_wait_group<0>();
  wgmma_store_rows<NO>(o, l0, l1, qi0, qi1, nq, hd, tg, out, gate, gate_row, gate_head, q_start, heads, h);
}
// ---------------------------------------------------------------------------------------------
// attn_fwd_ws_<HDP> (Hopper, sm_90a): attn_fwd_wgmma's attention, warp-specialised as
// FlashAttention-3 does, so that loads, tensor-core MMAs and the softmax overlap instead of taking
// turns. A block is 1 + NC warpgroups over 64·NC query rows of one head (NC = 2; attn_fwd_ws3_64:
// 3, FA3's 192 x 128 tiles at head dim 64):
// - warpgroup 0 (the producer, 56 registers per thread after setmaxnreg; 32 at NC = 3) copies Q
//   and the K and V tiles into ST-stage rings; a stage is handed over through mbarriers: "full"
//   when its bytes have landed, "empty" when every consumer's MMAs have read it. K and V have
//   separate rings, so K of tile j+1 can load while V of tile j is still in use. With `kv_maps`
//   (TMA maps of each sequence's four key/value row ranges, built by the host) a K or V tile that
//   lies in one range is HDP/64 TMA boxes issued by one thread (the map's edge reads as zeros past
//   the range's rows, as the copies zero-fill); otherwise (no maps, or the tile straddling the
//   shared prefix and the own rows) the 128 threads copy it with cp.async. Either way every
//   producer thread arrives on the full barrier through cp.async.mbarrier.arrive (after its copies
//   of Q, at tile 0), and a TMA tile's bytes are added to the phase by mbar_expect_tx first. Why
//   TMA: the cp.async copies of a 64 x 256 tile are 16 per thread per K or V tile, and the
//   producer shares the SM's issue slots with the consumers (the copies were the top cost of the
//   head-dim-256 kernels, bench/NOTES.md).
// - warpgroups 1 .. NC (the consumers, 224 registers; 160 at NC = 3) own 64 query rows each. Per
//   key tile j they issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, then run the softmax of
//   S_j while P_{j-1} V_{j-1} is still on the tensor cores (FA3's intra-warpgroup pipelining), and
//   named barriers make the consumers issue their MMAs in turn, in a ring, so one's softmax runs
//   under the others' MMAs (FA3's ping-pong at NC = 2).
// Tiles: HDP 64: 128 keys, 3 stages (4 at NC = 3); HDP 256: 64 keys, 2 stages (Q 64 KB + rings
// 128 KB). Same swizzled layout and descriptors as attn_fwd_wgmma. The softmax folds the scale into
// one FMA before ex2 (p = 2^(s·scale − max·scale)); otherwise it is attn_fwd_wgmma's, per row, over
// key tiles in order: a row's arithmetic depends only on its own query, its keys and the tile size,
// never on NC or the other rows of the batch (attn_fwd_ws3_64 gives attn_fwd_wgmma_k128_64's
// bits). CPU twin: as attn_fwd.

// Issues the copies of `rows` rows x HDP columns into a swizzled tile (issue_tile_sw's layout and
// rows), spread over `n` threads of which this is `t`. LEAN keeps the loop rolled, one copy's
// addresses live at a time: attn_fwd_ws3_64's producer has 32 registers a thread (unrolled, it
// spills).
template <int HDP, bool LEAN = false>
__device__ __forceinline__ void issue_tile_sw_by(unsigned char* dst, const bf16* a, int alen, const bf16* b,
                                                 i64 stride, int j0, int valid, int hd, int rows, int t, int n) {
#pragma unroll(LEAN ? 1 : 4)
  for (int i = t; i < rows * (HDP / 8); i += n) issue_chunk_sw<HDP>(dst, a, alen, b, stride, j0, valid, hd, rows, i);
}

// NC consumer warpgroups (2, or 3 at head dim 64: attn_fwd_ws3_64) of 64 query rows each.
// Registers per thread after setmaxnreg: the producer's and the consumers' (128·P + 128·NC·C =
// 65,536, all of the SM's, for the one block an SM).
template <int HDP, int NC = 2>
struct WsTiles {
  static_assert(NC == 2 || (NC == 3 && HDP == 64), "three consumers only at head dim 64");
  static constexpr int BQ = 64 * NC;
  static constexpr int BK = HDP == 64 ? 128 : 64;
  static constexpr int ST = HDP == 64 ? (NC == 3 ? 4 : 3) : 2;
  static constexpr int NS = BK / 2;   // S accumulators per thread (64 rows x BK keys per warpgroup)
  static constexpr int NO = HDP / 2;  // O accumulators per thread
  static constexpr int TILE = BK * HDP * 2;
  static constexpr int PRODUCER_REGS = NC == 2 ? 56 : 32, CONSUMER_REGS = NC == 2 ? 224 : 160;
  static constexpr bool LEAN_PRODUCER = NC == 3;
  static_assert(128 * PRODUCER_REGS + 128 * NC * CONSUMER_REGS <= 65536, "one block's registers");
};

// S = Q K^T for the warpgroup's 64 rows and BK keys (Q's column blocks are BQ rows apart).
template <int HDP, int NC>
__device__ __forceinline__ void ws_qk(float (&s)[WsTiles<HDP, NC>::NS], const unsigned char* Qw,
                                      const unsigned char* Kt) {
  constexpr int BQ = WsTiles<HDP, NC>::BQ, BK = WsTiles<HDP, NC>::BK;
#pragma unroll
  for (int ks = 0; ks < HDP / 16; ks++) {
    const int cb = ks >> 2, off = (ks & 3) * 32;
    const unsigned long long da = smem_desc(Qw + cb * BQ * 128 + off, 16, 1024);
    const unsigned long long db = smem_desc(Kt + cb * BK * 128 + off, 16, 1024);
    if constexpr (BK == 128) wgmma_ss_m64n128(s, da, db, ks > 0);
    else wgmma_ss_m64n64(s, da, db, ks > 0);
  }
}

// O += P V for the warpgroup's 64 rows; P's k16 slices are in registers.
template <int HDP>
__device__ __forceinline__ void ws_pv(float (&o)[WsTiles<HDP>::NO], const unsigned (&pa)[WsTiles<HDP>::BK / 16][4],
                                      const unsigned char* Vt) {
  constexpr int BK = WsTiles<HDP>::BK;  // the same for every NC
#pragma unroll
  for (int kk = 0; kk < BK / 16; kk++) {
    const unsigned long long db = smem_desc(Vt + kk * 16 * 128, BK * 128, 1024);
    if constexpr (HDP == 64) wgmma_rs_m64n64(o, pa[kk], db);
    else wgmma_rs_m64n256(o, pa[kk], db);
  }
}

// The copies of one whole K or V tile of ROWS rows (all valid, all in one of a sequence's two row
// ranges, hd = HDP) by the 128 producer threads of attn_fwd_ws3_64: thread t copies chunk t % V of
// rows t / V + u·(128 / V), so its swizzle phase and its place in a row block never change and each
// further copy is two additions (issue_tile_sw_by's per-copy index arithmetic is ~15 instructions;
// the producer shares the SM's issue slots with the consumers). The same bytes land in the same
// places as issue_tile_sw_by's.
template <int HDP, int ROWS>
__device__ __forceinline__ void issue_whole_tile_by128(unsigned char* dst, const bf16* rows, i64 stride, int t) {
  constexpr int V = HDP / 8, RS = 128 / V;  // chunks per row, rows per step
  static_assert(RS % 8 == 0 && ROWS % RS == 0, "the row step must keep the swizzle phase");
  const int c = t % V, r0 = t / V;
  const char* src = (const char*)(rows + (i64)r0 * stride + c * 8);
  unsigned char* d = dst + (c >> 3) * ROWS * 128 + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
#pragma unroll 1
  for (int u = 0; u < ROWS / RS; u++, src += (i64)RS * stride * 2, d += RS * 128) cp_async16(d, src, true);
}

// kv_maps (nullptr: cp.async only): [sequence][4] maps K shared, V shared, K own, V own, each over
// the range's rows x kvh·hd columns, boxes of 64 columns x BK rows, 128-byte swizzle; used only
// when hd == HDP (the host passes none otherwise).
template <int HDP, int NC = 2, bool GROUPED = false>
__device__ void attn_fwd_ws(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,
                            const bf16* gate, i64 gate_row, int gate_head, bf16* out, const TmaMap* kv_maps) {
  using T = WsTiles<HDP, NC>;
  constexpr int BQ = T::BQ, BK = T::BK, ST = T::ST, NS = T::NS, NO = T::NO;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* base = smem_1024(smem_raw);
  unsigned char* Qs = base;                // BQ x HDP
  unsigned char* Ks = Qs + BQ * HDP * 2;   // [ST] BK x HDP
  unsigned char* Vs = Ks + ST * T::TILE;   // [ST] BK x HDP
  unsigned long long* bars = (unsigned long long*)(Vs + ST * T::TILE);
  unsigned long long* full_k = bars;
  unsigned long long* full_v = bars + ST;
  unsigned long long* empty_k = bars + 2 * ST;
  unsigned long long* empty_v = bars + 3 * ST;

  const int h = block_head<GROUPED>(heads, kvh);
  const i64* sg = segs + SEG * blockIdx.z;
  const i64 q_start = sg[0];
  const int nq = (int)sg[1];
  const int tiles = (nq + BQ - 1) / BQ;
  const int tile = tiles - 1 - block_tile_from_last<GROUPED>(heads, kvh);
  if (tile < 0) return;  // the whole block, before any barrier
  const int shared_len = (int)sg[4];
  const int kvlen = shared_len + (int)sg[7] + nq;
  const int g = h / (heads / kvh);
  const int qbase = tile * BQ;
  const int offset = kvlen - nq;
  const int qlast = min(nq, qbase + BQ) - 1;
  const int klimit = causal ? min(kvlen, offset + qlast + 1) : kvlen;
  const int clean = causal ? min(kvlen, offset + qbase + 1) : kvlen;
  // >= 1: every sequence sees at least one key. Broadcast from lane 0 (as the warpgroup index
  // below), so the compiler knows the loops and branches around the MMAs are warp-uniform and
  // does not serialise the wgmma.
  const int ntiles = __shfl_sync(0xffffffffu, (klimit + BK - 1) / BK, 0);

  if (threadIdx.x == 0) {
    for (int i = 0; i < ST; i++) {
      mbar_init(full_k + i, 128);  // every producer thread arrives once its copies landed
      mbar_init(full_v + i, 128);
      mbar_init(empty_k + i, 4 * NC);  // one arrival per consumer warp
      mbar_init(empty_v + i, 4 * NC);
    }
  }
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);

  if (wg == 0) {
    // ---- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(T::PRODUCER_REGS));
    const int t = threadIdx.x;
    const i64 kstride = (i64)kvh * hd;
    const bf16* ks_ = (const bf16*)sg[2] + (i64)g * hd;
    const bf16* vs_ = (const bf16*)sg[3] + (i64)g * hd;
    const bf16* ko_ = (const bf16*)sg[5] + (i64)g * hd;
    const bf16* vo_ = (const bf16*)sg[6] + (i64)g * hd;
    // K_j (with Q at j = 0) and V_j in order; each stage's full barrier is arrived on by the copies
    // themselves when they land (cp.async.mbarrier.arrive), so the producer never waits for its own
    // copies, only for a stage to be released: it runs ST tiles ahead of the consumers for K and V
    // independently. (Its first version waited for each group one behind and announced K_j only
    // after issuing V_j, which sat behind the release of V_{j-ST}: measured slower than attn_fwd_wgmma.)
    // Rows j0 .. j0 + BK of K or V (the shared prefix's rows `sh`, then the own rows `own`) into
    // tile buffer dst; with the lean producer, whole tiles take issue_whole_tile_by128.
    // which: 0 for K, 1 for V (the map of the tile's range in kv_maps); bar: the stage's full barrier.
    const TmaMap* maps = kv_maps == nullptr ? nullptr : kv_maps + 4 * (i64)blockIdx.z;
    auto issue_kv = [&](unsigned char* dst, const bf16* sh, const bf16* own, int j0, int which,
                        unsigned long long* bar) {
      if (maps != nullptr && (j0 + BK <= shared_len || j0 >= shared_len)) {
        if (t == 0) {
          const bool in_own = j0 >= shared_len;
          const TmaMap* m = maps + 2 * in_own + which;
          mbar_expect_tx(bar, T::TILE);
#pragma unroll
          for (int cb = 0; cb < HDP / 64; cb++)
            tma_load_2d(dst + cb * BK * 128, m, g * hd + cb * 64, in_own ? j0 - shared_len : j0, bar);
        }
        return;
      }
      if constexpr (T::LEAN_PRODUCER) {
        if (hd == HDP && kvlen - j0 >= BK && (j0 + BK <= shared_len || j0 >= shared_len)) {
          const bf16* rows = j0 >= shared_len ? own + (i64)(j0 - shared_len) * kstride : sh + (i64)j0 * kstride;
          issue_whole_tile_by128<HDP, BK>(dst, rows, kstride, t);
          return;
        }
      }
      issue_tile_sw_by<HDP, T::LEAN_PRODUCER>(dst, sh, shared_len, own, kstride, j0, kvlen - j0, hd, BK, t, 128);
    };
    for (int j = 0; j < ntiles; j++) {
      const int s = j % ST, use = j / ST, j0 = j * BK;
      if (j >= ST) mbar_wait(empty_k + s, (use - 1) & 1);
      if (j == 0)
        issue_tile_sw_by<HDP, T::LEAN_PRODUCER>(Qs, q + ((q_start + qbase) * heads + h) * (i64)hd, BQ, q,
                                                (i64)heads * hd, 0, nq - qbase, hd, BQ, t, 128);
      issue_kv(Ks + s * T::TILE, ks_, ko_, j0, 0, full_k + s);
      mbar_arrive_on_copies(full_k + s);
      if (j >= ST) mbar_wait(empty_v + s, (use - 1) & 1);
      issue_kv(Vs + s * T::TILE, vs_, vo_, j0, 1, full_v + s);
      mbar_arrive_on_copies(full_v + s);
    }
    // A thread may not exit with copies in flight into shared memory that others read (wait_all
    // also covers copies not committed to a group).
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(T::CONSUMER_REGS));
  const int cw = wg - 1;  // 0 .. NC - 1
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  const int r0 = cw * 64 + warp * 16 + gr;
  const int qi0 = qbase + r0, qi1 = qi0 + 8;
  const unsigned char* Qw = Qs + cw * 64 * 128;
  // Turns in a ring (ping-pong at NC = 2): consumer cw issues its MMAs after bar.sync on barrier
  // 1 + cw and then lets the next one go (bar.arrive on its barrier). The last consumer opens the
  // first turn for consumer 0; it skips its last arrive, so no barrier is left half-arrived when
  // the block ends.
  const int my_bar = 1 + cw, next_bar = cw == NC - 1 ? 1 : cw + 2;
  if (cw == NC - 1) named_bar_arrive(next_bar, 256);
  const int turns = ntiles + 1;
  int turn = 0;
  auto begin_turn = [&]() { named_bar_sync(my_bar, 256); };
  auto end_turn = [&]() {
    turn++;
    if (cw != NC - 1 || turn < turns) named_bar_arrive(next_bar, 256);
  };
  auto release = [&](unsigned long long* b) {
    if (lane == 0) mbar_arrive(b);
  };

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i] = 0.f;
  float s[NS];
  unsigned pa[BK / 16][4];
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

  // Softmax of S_j in place (s becomes P in f32): wgmma_softmax_tile, the same bits as
  // attn_fwd_wgmma's for the same tile size; returns the rescale factors of O through c0/c1.
  auto softmax = [&](int j, float& c0, float& c1) {
    wgmma_softmax_tile(s, (j + 1) * BK > clean, j * BK, kvlen, causal, offset, qi0, qi1, tg, scale_log2, m0, m1, l0,
                       l1, c0, c1);
  };
  auto rescale_and_pack = [&](float c0, float c1) {
    scale_rows(o, c0, c1);
    wgmma_pack_p(s, pa);
  };

  // The copies were made by the producer's generic-proxy cp.async and are read by the tensor cores
  // through the async proxy: after observing a full barrier, each consumer thread fences the
  // proxies before its MMAs read the stage.
  // Tile 0: S_0 alone.
  mbar_wait(full_k, 0);
  fence_proxy_async();
  begin_turn();
  wgmma_fence();
  ws_qk<HDP, NC>(s, Qw, Ks);
  wgmma_commit();
  end_turn();
  wgmma_wait0();
  fence_regs(s);
  release(empty_k);
  {
    float c0, c1;
    softmax(0, c0, c1);
    rescale_and_pack(c0, c1);
  }
  for (int j = 1; j < ntiles; j++) {
    const int sk = j % ST, sv = (j - 1) % ST;
    mbar_wait(full_v + sv, ((j - 1) / ST) & 1);  // V_{j-1} was issued before K_j
    mbar_wait(full_k + sk, (j / ST) & 1);
    fence_proxy_async();
    begin_turn();
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    ws_qk<HDP, NC>(s, Qw, Ks + sk * T::TILE);
    wgmma_commit();
    ws_pv<HDP>(o, pa, Vs + sv * T::TILE);
    wgmma_commit();
    end_turn();
    wgmma_wait1();  // S_j is ready; P_{j-1} V_{j-1} may still run
    fence_regs(s);
    release(empty_k + sk);
    float c0, c1;
    softmax(j, c0, c1);
    wgmma_wait0();
    fence_regs(o);
    fence_regs(pa);
    release(empty_v + sv);
    rescale_and_pack(c0, c1);
  }
  {
    const int sv = (ntiles - 1) % ST;
    mbar_wait(full_v + sv, ((ntiles - 1) / ST) & 1);
    fence_proxy_async();
    begin_turn();
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    ws_pv<HDP>(o, pa, Vs + sv * T::TILE);
    wgmma_commit();
    end_turn();
    wgmma_wait0();
    fence_regs(o);
  }
  wgmma_store_rows<NO>(o, l0, l1, qi0, qi1, nq, hd, tg, out, gate, gate_row, gate_head, q_start, heads, h);
}
#endif  // IMAJEV_WGMMA

// Entries exist on every architecture (the kernel table loads them by name); off Hopper they do
// nothing, and the host only launches them on sm_90.
#ifdef IMAJEV_WGMMA
#define ATTN_WGMMA_BODY(HDP, BK, TSUM, GROUPED, ST)                                                        \
  attn_fwd_wgmma<HDP, BK, TSUM, GROUPED, ST>(q, segs, heads, kvh, hd, causal, scale_log2, gate, gate_row, \
                                             gate_head, out);
#else
#define ATTN_WGMMA_BODY(HDP, BK, TSUM, GROUPED, ST)
#endif
#define ATTN_WGMMA_ENTRY(NAME, HDP, BK, MIN_BLOCKS, TSUM, GROUPED, ST)                                  \
  extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                  \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,        \
      const bf16* gate, i64 gate_row, int gate_head, bf16* out) {                                      \
    pdl_begin();                                                                                       \
    ATTN_WGMMA_BODY(HDP, BK, TSUM, GROUPED, ST)                                                        \
  }
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_64, 64, 64, 1, false, false, 2)
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_256, 256, 64, 1, false, false, 2)
// 128-key tiles at head dim 64 (the vision tower): half the per-tile bookkeeping per score, held to
// 128 registers so that two blocks share an SM as attn_fwd_wgmma_64's do.
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_k128_64, 64, 128, 2, false, false, 2)
// The same kernels with the blocks in KV-group order (block_head; grid: R·tiles, kvh, sequences):
// the blocks on the GPU at once share one or two groups' keys and values in L2 instead of
// streaming every group's (268 MB at 65,536 patches of the vision tower, 16 heads without GQA; 195
// MB at 47.7K tokens of the 4B's 4 groups); the same bits.
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_g_256, 256, 64, 1, false, true, 2)
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_k128g_64, 64, 128, 2, false, true, 2)
// attn_fwd_wgmma_k128g_64 with three K/V buffers (the copies two tiles ahead): 113 KB of shared
// memory, so two blocks still share an SM (228 KB); for the barrier stalls at each tile's start
// (the top stall of the two-buffer kernel, ncu: bench/NOTES.md). The same bits.
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_k128g3_64, 64, 128, 2, false, true, 3)
// attn_fwd_wgmma_k128_64 with the rows' sums on the tensor cores (wgmma_softmax_p, wgmma_row_sums): one
// instruction fewer per score; opt-in: no faster on an H100 (bench/NOTES.md).
ATTN_WGMMA_ENTRY(attn_fwd_wgmma_tsum_64, 64, 128, 2, true, false, 2)

#ifdef IMAJEV_WGMMA
#define ATTN_WS_BODY(HDP, NC, GROUPED) \
  attn_fwd_ws<HDP, NC, GROUPED>(q, segs, heads, kvh, hd, causal, scale_log2, gate, gate_row, gate_head, out, kv_maps);
#else
#define ATTN_WS_BODY(HDP, NC, GROUPED)
#endif
#define ATTN_WS_ENTRY(NAME, HDP, NC, GROUPED)                                                              \
  extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) NAME(                                    \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,            \
      const bf16* gate, i64 gate_row, int gate_head, bf16* out, const TmaMap* kv_maps) {                   \
    pdl_begin();                                                                                           \
    ATTN_WS_BODY(HDP, NC, GROUPED)                                                                         \
  }
ATTN_WS_ENTRY(attn_fwd_ws_64, 64, 2, false)
ATTN_WS_ENTRY(attn_fwd_ws_256, 256, 2, false)
// FlashAttention-3's shape at head dim 64 (the vision tower): three consumers over 192 query rows,
// so one block per SM keeps three warpgroups on the MMAs and the softmax (attn_fwd_ws_64 has two,
// where attn_fwd_wgmma_k128_64's two blocks have four); each K/V tile serves 192 rows. Opt-in: on an
// H100 it matched k128 at 65,536 patches (41.3 vs 41.2 ms) and was 7% slower at 16K (bench/NOTES.md),
// both in the heads-first order; its blocks now run in KV-group order (block_head) as Auto's
// vision kernel does (unmeasured in that order).
ATTN_WS_ENTRY(attn_fwd_ws3_64, 64, 3, true)
