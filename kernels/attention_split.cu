// attn_fwd_wgmma_split_<HDP> (Hopper, sm_90a): split-key attention for short sequences over long
// caches (the question passes over a long prefix), with warpgroup MMAs and the query heads of one
// KV group in one tile. Continues kernels/attention.cu (one compilation unit: it uses its helpers).
// Rust binding: src/backend/cuda/attention.rs (the split path of `attention_core`). CPU twin: as
// attn_fwd. Tested in tests/gpu/attention.rs (the tree and 73-rows-over-16K cases of hopper_cases).
//
// Why: attn_fwd_q128's split mode gives each (head, key range) its own block of 128 query rows,
// so a 73-row pass leaves 43% of every tile empty and its KV group's keys and values are read once
// per query head (4 times at Qwen3.5-4B's 16 heads over 4 KV heads), on mma.sync (~140 TFLOP/s
// for 11 passes over a 47.7K prefix, NOTES). Here a block takes 128 rows of the R = heads / kvh
// query heads of KV group g stacked: grouped row ρ = head_in_group · nq + qi (nq <= 128 rows per
// sequence, so at most R tiles per group), over one key range of kv_split keys, with
// attn_fwd_wgmma's tiles, copies, MMAs and softmax (wgmma_softmax_tile): each row's arithmetic is
// that of a row of attn_fwd_wgmma restricted to the range's key tiles.
//
// Output: as attn_fwd_q128's split mode, for attn_split_combine: slot (sequence, head, range) holds
// the range's unnormalised output [128][HDP] at row qi, then the rows' running max in log2 units
// (max score · scale_log2, -inf when the row saw no key of the range) [128] and sums [128]; a
// range none of a row's keys reach still writes its slot (zeros, -inf, 0). Which tile a row shares
// and with which other rows depends on its sequence's row count only: tiles past a row's last
// visible key add exact zeros, so a row's bits never depend on the rest of the batch.

#ifdef IMAJEV_WGMMA
// The Q tile of grouped rows rbase.. (BQ of them, those below `rows` real): row r is query row
// qi = (rbase + r) % nq of head g·R + (rbase + r) / nq, in issue_tile_sw's swizzled layout.
template <int HDP, int BQ>
__device__ __forceinline__ void issue_q_grouped_sw(unsigned char* dst, const bf16* q, i64 q_start, int heads, int hd,
                                                   int g, int R, int nq, int rbase, int rows) {
  constexpr int V = HDP / 8;
  for (int i = threadIdx.x; i < BQ * V; i += blockDim.x) {
    const int r = i / V, c = i % V, col = c * 8, rho = rbase + r;
    const bool ok = rho < rows && col < hd;
    const bf16* src = ok ? q + ((q_start + rho % nq) * heads + g * R + rho / nq) * (i64)hd + col : q;
    cp_async16(dst + (c >> 3) * BQ * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok);
  }
}

// A block's (head tile, key range, sequence) from blockIdx: x, y, z (the sequences slowest: the
// blocks on the GPU at once cover about one sequence, so each pass streams the whole shared prefix
// from DRAM), or with SEQ_FAST x the sequence, y the head tile, z the key range (the blocks of one
// key range run together over every sequence and every KV group: the passes of a tree read one
// shared prefix, and each of its ranges is read from DRAM about once). The order of the blocks is
// all it changes.
struct SplitBlock {
  int head_tile, range, seq;
};
template <bool SEQ_FAST>
__device__ __forceinline__ SplitBlock split_block() {
  if constexpr (SEQ_FAST) return SplitBlock{(int)blockIdx.y, (int)blockIdx.z, (int)blockIdx.x};
  else return SplitBlock{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
}

template <int HDP, bool SEQ_FAST = false>
__device__ void attn_fwd_wgmma_split(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal,
                                     float scale_log2, int kv_split, int nsplit, float* part) {
  constexpr int BQ = 128, BK = 64, NO = HDP / 2;
  extern __shared__ __align__(16) unsigned char smem_split[];
  unsigned char* Qs = smem_1024(smem_split);  // BQ x HDP
  unsigned char* Ks = Qs + BQ * HDP * 2;      // [2] BK x HDP
  unsigned char* Vs = Ks + 2 * BK * HDP * 2;  // [2] BK x HDP
  const SplitBlock blk = split_block<SEQ_FAST>();
  const int R = heads / kvh, g = blk.head_tile / R, rbase = (blk.head_tile % R) * BQ;
  const i64* sg = segs + SEG * blk.seq;
  const i64 q_start = sg[0];
  const int nq = (int)sg[1], rows = R * nq;
  if (rbase >= rows) return;  // the whole block
  const int shared_len = (int)sg[4];
  const int kvlen = shared_len + (int)sg[7] + nq, offset = kvlen - nq;
  // The tile's query rows: within one head qi runs from first % nq to last % nq; a tile that
  // crosses into the next head holds qi 0 and nq - 1.
  const int first = rbase, last = min(rows, rbase + BQ) - 1;
  const bool one_head = first / nq == last / nq;
  const int qmin = one_head ? first % nq : 0, qmax = one_head ? last % nq : nq - 1;
  const int klimit = causal ? min(kvlen, offset + qmax + 1) : kvlen;
  const int clean = causal ? min(kvlen, offset + qmin + 1) : kvlen;
  const int kbeg = blk.range * kv_split, kend = min(klimit, kbeg + kv_split);
  const int kt0 = kbeg / BK, ntiles = kend > kbeg ? (kend + BK - 1) / BK : kt0;
  const i64 kstride = (i64)kvh * hd;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;

  issue_q_grouped_sw<HDP, BQ>(Qs, q, q_start, heads, hd, g, R, nq, rbase, rows);
  const KvTileCopies<HDP> kv(Ks, Vs, (const bf16*)sg[2] + (i64)g * hd, (const bf16*)sg[5] + (i64)g * hd,
                             (const bf16*)sg[3] + (i64)g * hd, (const bf16*)sg[6] + (i64)g * hd, shared_len,
                             kstride, hd);
  if (ntiles > kt0) kv.issue_both(0, kt0 * BK, kvlen - kt0 * BK, hd);
  cp_async_commit();

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  // This thread's two rows of the tile and their query rows.
  const int r0 = wg * 64 + warp * 16 + gr, r1 = r0 + 8;
  const int qi0 = (rbase + r0) % nq, qi1 = (rbase + r1) % nq;
  const WgmmaDescs<HDP> desc(Qs + wg * 64 * 128, Ks, Vs);

  wgmma_key_tiles<HDP, BQ, BK>(kv, desc, kt0, ntiles, clean, kvlen, causal, offset, qi0, qi1, tg, scale_log2, hd, o,
                               m0, m1, l0, l1);
  cp_async_wait_group<0>();  // nothing may be in flight into shared memory when the block exits

  // The range's partial result per row, in attn_fwd_q128's split layout (max in log2 units).
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    const int rho = rbase + (hr == 0 ? r0 : r1);
    if (rho >= rows) continue;
    const int h = g * R + rho / nq, qi = rho % nq;
    const float mraw = hr == 0 ? m0 : m1;
    float* slot = part + (((i64)blk.seq * heads + h) * nsplit + blk.range) * (BQ * HDP + 2 * BQ);
#pragma unroll
    for (int j = 0; j < NO / 4; j++) {
      const int col = 8 * j + 2 * tg;
      *(float2*)(slot + qi * HDP + col) = make_float2(o[4 * j + 2 * hr], o[4 * j + 2 * hr + 1]);
    }
    if (tg == 0) {
      slot[BQ * HDP + qi] = mraw == NEG_INF ? NEG_INF : mraw * scale_log2;
      slot[BQ * HDP + BQ + qi] = hr == 0 ? l0 : l1;
    }
  }
}
#endif  // IMAJEV_WGMMA

// Entries exist on every architecture (the kernel table loads them by name); off Hopper they do
// nothing, and the host only launches them on sm_90.
#ifdef IMAJEV_WGMMA
#define ATTN_WGMMA_SPLIT_BODY(HDP, SEQ_FAST) \
  attn_fwd_wgmma_split<HDP, SEQ_FAST>(q, segs, heads, kvh, hd, causal, scale_log2, kv_split, nsplit, part);
#else
#define ATTN_WGMMA_SPLIT_BODY(HDP, SEQ_FAST)
#endif
#define ATTN_WGMMA_SPLIT_ENTRY(NAME, HDP, SEQ_FAST)                                                        \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                               \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,            \
      int kv_split, int nsplit, float* part) {                                                             \
    pdl_begin();                                                                                           \
    ATTN_WGMMA_SPLIT_BODY(HDP, SEQ_FAST)                                                                   \
  }
ATTN_WGMMA_SPLIT_ENTRY(attn_fwd_wgmma_split_64, 64, false)
ATTN_WGMMA_SPLIT_ENTRY(attn_fwd_wgmma_split_256, 256, false)
// Sequences fastest (grid: sequences, heads, key ranges): the passes over one shared prefix read
// each of its key ranges together.
ATTN_WGMMA_SPLIT_ENTRY(attn_fwd_wgmma_splitg_64, 64, true)
ATTN_WGMMA_SPLIT_ENTRY(attn_fwd_wgmma_splitg_256, 256, true)
