// attn_fwd_wgmma_ov_<HDP> (Hopper, sm_90a): attn_fwd_wgmma with the softmax of each key tile
// overlapped with the previous tile's P·V MMAs inside the warpgroup (FlashAttention-3's intra-
// warpgroup pipelining). Continues kernels/attention.cu (one compilation unit: it uses its
// helpers). Rust binding: src/backend/cuda/attention.rs (`AttentionKernel::Overlap`). CPU twin:
// as attn_fwd. Tested in tests/gpu/attention.rs against the CPU and bitwise against attn_fwd_wgmma.
//
// Why: attn_fwd_wgmma runs, per warpgroup and 64-key tile, S = Q K^T → wait → softmax → O += P V →
// wait, so its tensor cores idle through every softmax unless another warpgroup happens to be in
// an MMA; at head dim 64 the softmax costs about as many issue cycles as the MMAs take (ncu: issue-
// bound, 68% of issue slots busy, NOTES). Here iteration j issues S_j = Q K_j^T and then
// O += P_{j-1} V_{j-1} back to back, waits for S_j only, runs the softmax of tile j while the P·V
// MMAs of tile j − 1 run, then waits for those and rescales O. Same grid, block, shared memory and
// swizzled layout as attn_fwd_wgmma; V lags K by one tile in the double buffers (tile j's K and
// tile j − 1's V are read in iteration j), so the copies issued at the top of iteration j are K_{j+1}
// (over K_{j−1}, whose MMAs completed in iteration j − 1) and V_j (over V_{j−2}, likewise).
//
// Same bits as attn_fwd_wgmma: every tile's scores, softmax (wgmma_softmax_tile), rescale and P·V
// accumulation are the same operations on the same values in the same order; only when they are
// issued differs. Costs 16 registers for the second set of P fragments.

#ifdef IMAJEV_WGMMA
template <int HDP>
__device__ void attn_fwd_wgmma_ov(const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal,
                                  float scale_log2, const bf16* gate, i64 gate_row, int gate_head, bf16* out) {
  constexpr int BQ = 128, BK = 64, NO = HDP / 2;
  extern __shared__ __align__(16) unsigned char smem_ov[];
  unsigned char* Qs = smem_1024(smem_ov);     // BQ x HDP
  unsigned char* Ks = Qs + BQ * HDP * 2;      // [2] BK x HDP
  unsigned char* Vs = Ks + 2 * BK * HDP * 2;  // [2] BK x HDP
  const int h = blockIdx.x;
  WgmmaBlock B;
  if (!wgmma_block<BQ, BK>(B, segs, heads, kvh, hd, causal)) return;
  const i64 q_start = B.q_start;
  const int nq = B.nq, shared_len = B.shared_len, kvlen = B.kvlen, qbase = B.qbase, offset = B.offset;
  const int clean = B.clean, ntiles = B.ntiles;
  const i64 kstride = B.kstride;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  issue_tile_sw<HDP>(Qs, q + ((q_start + qbase) * heads + h) * (i64)hd, BQ, q, (i64)heads * hd, 0, nq - qbase, hd, BQ);
  const KvTileCopies<HDP> kv(Ks, Vs, B.ks, B.ko, B.vs, B.vo, shared_len, kstride, hd);
  if (ntiles > 0) kv.issue(0, false, 0, kvlen, hd);
  cp_async_commit();

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const int r0 = wg * 64 + warp * 16 + gr;
  const int qi0 = qbase + r0, qi1 = qi0 + 8;
  const WgmmaDescs<HDP> desc(Qs + wg * 64 * 128, Ks, Vs);
  unsigned pprev[BK / 16][4];  // P of tile kt - 1, read by its P·V MMAs issued in iteration kt
#pragma unroll
  for (int kk = 0; kk < BK / 16; kk++) pprev[kk][0] = pprev[kk][1] = pprev[kk][2] = pprev[kk][3] = 0u;

  for (int kt = 0; kt < ntiles; kt++) {
    cp_async_wait_group<0>();
    fence_proxy_async();
    __syncthreads();  // K_kt and V_{kt-1} landed and visible; every MMA of iteration kt - 1 is done
    const int buf = kt & 1;
    if (kt + 1 < ntiles) {
      const int j0 = (kt + 1) * BK;
      kv.issue(buf ^ 1, false, j0, kvlen - j0, hd);
    }
    {
      const int j0 = kt * BK;
      kv.issue(buf, true, j0, kvlen - j0, hd);
    }
    cp_async_commit();

    float s[32];
    wgmma_fence();  // s, o and pprev were last written by ordinary instructions
    wgmma_qk_tile<HDP, BQ>(s, desc.q, desc.k(buf));
    wgmma_commit();
    if (kt > 0) {
      wgmma_pv_tile<HDP>(o, pprev, desc.v(buf ^ 1));
      wgmma_commit();
      wgmma_wait1();  // S_kt done; the P·V of tile kt - 1 may still run
    } else {
      wgmma_wait0();
    }
    fence_regs(s);

    const bool masked = (kt + 1) * BK > clean;
    float c0, c1;
    wgmma_softmax_tile(s, masked, kt * BK, kvlen, causal, offset, qi0, qi1, tg, scale_log2, m0, m1, l0, l1, c0, c1);
    unsigned pcur[BK / 16][4];
    wgmma_pack_p(s, pcur);
    wgmma_wait0();  // the P·V of tile kt - 1: O and pprev are free
    fence_regs(o);
    fence_regs(pprev);
    wgmma_rescale_o(o, c0, c1);
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++)
#pragma unroll
      for (int e = 0; e < 4; e++) pprev[kk][e] = pcur[kk][e];
  }
  // The last tile's P·V (its V was copied at the top of the last iteration).
  cp_async_wait_group<0>();
  fence_proxy_async();
  __syncthreads();
  if (ntiles > 0) {
    wgmma_fence();
    wgmma_pv_tile<HDP>(o, pprev, desc.v((ntiles - 1) & 1));
    wgmma_commit();
    wgmma_wait0();
    fence_regs(o);
  }
  wgmma_store_rows<NO>(o, l0, l1, qi0, qi1, nq, hd, tg, out, gate, gate_row, gate_head, q_start, heads, h);
}
#define ATTN_WGMMA_OV_BODY(HDP) \
  attn_fwd_wgmma_ov<HDP>(q, segs, heads, kvh, hd, causal, scale_log2, gate, gate_row, gate_head, out);
#else
#define ATTN_WGMMA_OV_BODY(HDP)
#endif  // IMAJEV_WGMMA

#define ATTN_WGMMA_OV_ENTRY(HDP, MIN_BLOCKS)                                                               \
  extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) attn_fwd_wgmma_ov_##HDP(                   \
      const bf16* q, const i64* segs, int heads, int kvh, int hd, int causal, float scale_log2,            \
      const bf16* gate, i64 gate_row, int gate_head, bf16* out) {                                          \
    pdl_begin();                                                                                           \
    ATTN_WGMMA_OV_BODY(HDP)                                                                                \
  }
// Two blocks per SM at head dim 64 (at most 128 registers), as attn_fwd_wgmma gets with 106.
ATTN_WGMMA_OV_ENTRY(64, 2)
ATTN_WGMMA_OV_ENTRY(256, 1)
