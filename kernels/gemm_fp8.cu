// Block-scaled FP8 GEMM on Hopper's warpgroup MMAs (sm_90a), with a LoRA pair's B side added in the
// epilogue: Y = X·Wᵀ (+ lscale · T·Bᵀ), one rounding to BF16.
//
// Why by hand: cuBLASLt runs the FP8 projections well (one algorithm per shape, 128 x 128 tiles),
// but it can add nothing to an output except β·C, so each LoRA's B side is a second, BF16 GEMM
// that reads and writes the whole output again (`gemm.lora_b`: 29 ms of a 16K prefill and 14 ms of
// a packed round, bench/NOTES.md). Here the LoRA product lands in the same f32 accumulators.
//
// Operands (the layouts gemm.rs hands cuBLASLt): X [M][K] E4M3 codes (M is the padded row count, a
// multiple of 16), xs [K/128][M] f32 activation scales; W [N][K] E4M3, ws [N/128][K/128] f32;
// Y [M][ldy] BF16, columns 0 .. N. LoRA (lwin != nullptr): T [lm][lr] BF16 (the A side's product;
// lm is the real row count), B [lcols][lr] BF16 for output columns lcol0 .. lcol0 + lcols (block-
// diagonal over the parts of a fused pair), lwin [N/128][2] the rank columns [rb, re) a column tile
// needs (its parts'; B's other rank columns of its rows are zero), lscale the pair's scale.
//
// Shape: a persistent grid, one block an SM, the tiles of BM = 64·NC rows x 128 columns dealt out
// round-robin in a fixed order (gemm_fp8_tile). A block is a producer warpgroup and NC consumer
// warpgroups:
// - the producer copies each 128-wide k-block's X and W tiles (rows of 128 bytes in the 128-byte
//   swizzle the descriptors name, as attention.cu's tiles), the X scales of the tile's rows and
//   the k-block's W scale into an ST-stage ring with cp.async; a stage is "full" when its copies have landed (they arrive
//   on its mbarrier themselves) and "empty" when every consumer warp has read it. After a tile's
//   k-blocks come its LoRA stages through the same ring: T's rows and B's rows, 64 rank columns
//   (one 128-byte row) a stage, zero past the window.
// - a consumer warpgroup owns 64 rows: per k-block four wgmma m64n128k32 (E4M3 x E4M3, f32) into
//   `acc`, then out += acc · (xs·ws) per row, so the tensor cores' FP8 sums are promoted to full
//   f32 once every 128 K (DeepSeek's recipe, which the checkpoint's scales are made for); per LoRA
//   stage four wgmma m64n128k16 (BF16) into acc, then out += lscale · acc. Then out is rounded to
//   BF16 once and stored.
// Batch invariance: the tile shape, the k order and the promotion are the same whatever M is, so a
// row's result is the same bits whatever else shares the call (tests/gpu checks it bitwise). The
// results are also cuBLASLt's bits (its block-scaled kernel promotes the same way; measured on an
// H100), and the same for 128- and 192-row tiles.
// CPU twin: matmul of src/backend/cpu/linear.rs (dequantised FP8 GEMM plus LoRA in f32; not the
// same bits: its sums run in another order).

template <int NC>
struct GemmFp8Tiles {
  static constexpr int BM = 64 * NC, BN = 128, BK = 128;
  static constexpr int ST = NC == 2 ? 6 : 5;               // ring stages (layout::gemm_fp8_stages)
  static constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // one stage's X and W tiles
  static constexpr int STAGE = A_BYTES + B_BYTES;
  // Registers per thread after setmaxnreg (128·P + 128·NC·C <= 65,536: one block an SM).
  static constexpr int PRODUCER_REGS = NC == 2 ? 40 : 32, CONSUMER_REGS = NC == 2 ? 232 : 160;
  static_assert(128 * PRODUCER_REGS + 128 * NC * CONSUMER_REGS <= 65536, "one block's registers");
};

// The tile's row block mt and column block nt: row blocks in groups of 8, column blocks outer
// within a group, so the tiles one wave of blocks works on share their X and W tiles in L2.
__device__ __forceinline__ void gemm_fp8_tile(int tile, int mtiles, int ntiles, int& mt, int& nt) {
  constexpr int GM = 8;
  const int g = tile / (GM * ntiles), in = tile - g * GM * ntiles;
  const int gm = min(GM, mtiles - g * GM);
  mt = g * GM + in % gm;
  nt = in / gm;
}

#ifdef IMAJEV_WGMMA
// D[64 x 128] (+)= A[64 x 32] B[32 x 128], E4M3 x E4M3 from shared memory (K-major descriptors);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_fp8_m64n128k32(float (&d)[64], unsigned long long da, unsigned long long db,
                                                    int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

struct GemmFp8Args {
  const unsigned char* x;
  const float* xs;
  const unsigned char* w;
  const float* ws;
  bf16* y;
  int M, N, K;
  i64 ldy;
  const bf16* lt;
  const bf16* lb;
  const int* lwin;
  int lm, lr, lcol0, lcols;
  float lscale;
};

// The four MMAs of ring stage s into acc (not committed).
template <int NC, bool LORA>
__device__ __forceinline__ void gemm_fp8_mmas(float (&acc)[64], unsigned a_lo, unsigned b_lo, int s) {
#pragma unroll
  for (int ks = 0; ks < 4; ks++) {
    const unsigned off = (unsigned)(s * GemmFp8Tiles<NC>::STAGE + 32 * ks) >> 4;
    const unsigned long long da = smem_desc_of(a_lo + off, 1024), db = smem_desc_of(b_lo + off, 1024);
    if constexpr (LORA) wgmma_ss_m64n128(acc, da, db, ks > 0);
    else wgmma_fp8_m64n128k32(acc, da, db, ks > 0);
  }
}

// A consumer warpgroup's MMAs of ring stage s (after waiting for it to be full) into acc, committed
// as one group: an FP8 k-block (four k32 steps) or a BF16 LoRA stage (four k16 steps), both 128
// bytes of each row. a_lo, b_lo: the descriptor low words of stage 0's X rows of this warpgroup
// and W tile.
template <int NC, bool LORA>
__device__ __forceinline__ void gemm_fp8_issue(float (&acc)[64], unsigned long long* full, unsigned parity,
                                               unsigned a_lo, unsigned b_lo, int s) {
  mbar_wait(full, parity);
  // The copies were made through the generic proxy; the tensor cores read through the async one.
  fence_proxy_async();
  wgmma_fence();
  gemm_fp8_mmas<NC, LORA>(acc, a_lo, b_lo, s);
  wgmma_commit();
}

// gemm_fp8_issue, then waiting for the MMAs.
template <int NC, bool LORA>
__device__ __forceinline__ void gemm_fp8_stage(float (&acc)[64], unsigned long long* full, unsigned parity,
                                               unsigned a_lo, unsigned b_lo, int s) {
  gemm_fp8_issue<NC, LORA>(acc, full, parity, a_lo, b_lo, s);
  wgmma_wait0();
  fence_regs(acc);
}

// out += acc times f0 (this thread's first row) or f1 (its second), one FMA each: a k-block's
// promotion, or a LoRA stage's scale (f0 = f1).
__device__ __forceinline__ void gemm_fp8_promote(float (&out)[64], const float (&acc)[64], float f0, float f1) {
#pragma unroll
  for (int j = 0; j < 16; j++) {
    out[4 * j + 0] = fmaf(acc[4 * j + 0], f0, out[4 * j + 0]);
    out[4 * j + 1] = fmaf(acc[4 * j + 1], f0, out[4 * j + 1]);
    out[4 * j + 2] = fmaf(acc[4 * j + 2], f1, out[4 * j + 2]);
    out[4 * j + 3] = fmaf(acc[4 * j + 3], f1, out[4 * j + 3]);
  }
}

// OVL (gemm_fp8_128o): two accumulator sets, so that a k-block's promotion runs while the next
// k-block's MMAs are on the tensor cores (one more wgmma group in flight); same arithmetic, same bits.
template <int NC, bool OVL>
__device__ void gemm_fp8(const GemmFp8Args& p) {
  using T = GemmFp8Tiles<NC>;
  constexpr int BM = T::BM, ST = T::ST;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* stages = smem_1024(smem_raw);  // [ST] { X tile BM x 128 B, W tile 128 x 128 B }
  float* sa = (float*)(stages + ST * T::STAGE);  // [ST][BM] the X scales of the tile's rows
  float* sw = sa + ST * BM;                       // [ST][2] the W scale of the k-block (and a pad)
  unsigned long long* full = (unsigned long long*)(sw + 2 * ST);
  unsigned long long* empty = full + ST;

  const int mtiles = (p.M + BM - 1) / BM, ntiles = p.N / 128, tiles = mtiles * ntiles, kblocks = p.K / 128;
  if (threadIdx.x == 0) {
    for (int i = 0; i < ST; i++) {
      mbar_init(full + i, 128);     // every producer thread arrives once its copies landed
      mbar_init(empty + i, 4 * NC);  // one arrival per consumer warp
    }
  }
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);

  if (wg == 0) {
    // ---- producer: thread t copies the 16-byte chunk c = t % 8 of rows t / 8 + 16·u, so its
    // swizzle phase and its place in a row never change (rows 16 apart share r % 8).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(T::PRODUCER_REGS));
    const int t = threadIdx.x, c = t & 7, r0 = t >> 3;
    const unsigned doff = r0 * 128 + ((c ^ (r0 & 7)) << 4);
    int it = 0;
    auto acquire = [&](int s) {
      if (it >= ST) mbar_wait(empty + s, ((it / ST) - 1) & 1);
    };
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int mt, nt;
      gemm_fp8_tile(tile, mtiles, ntiles, mt, nt);
      const int m0 = mt * BM, n0 = nt * 128;
      const unsigned char* xrow = p.x + (i64)(m0 + r0) * p.K + c * 16;
      const unsigned char* wrow = p.w + (i64)(n0 + r0) * p.K + c * 16;
      for (int kb = 0; kb < kblocks; kb++, it++) {
        const int s = it % ST;
        acquire(s);
        unsigned char* A = stages + s * T::STAGE + doff;
        unsigned char* B = A + T::A_BYTES;
#pragma unroll 1
        for (int u = 0; u < BM / 16; u++) {
          const bool ok = m0 + r0 + 16 * u < p.M;
          cp_async16(A + u * 2048, ok ? xrow + (i64)16 * u * p.K + kb * 128 : p.x, ok);
        }
#pragma unroll 1
        for (int u = 0; u < 8; u++) cp_async16(B + u * 2048, wrow + (i64)16 * u * p.K + kb * 128, true);
        if (t < BM / 4) {
          const bool ok = m0 + 4 * t < p.M;  // M is a multiple of 16: 4 rows are all in or all out
          cp_async16(sa + s * BM + 4 * t, ok ? p.xs + (i64)kb * p.M + m0 + 4 * t : p.xs, ok);
        } else if (t == BM / 4) {
          // The W scale travels with the stage: a load of it by the consumers after their MMAs
          // was an L2 round trip on every k-block's critical path (ncu: long_scoreboard on top).
          cp_async4(sw + 2 * s, p.ws + (i64)nt * kblocks + kb, true);
        }
        mbar_arrive_on_copies(full + s);
      }
      if (p.lwin == nullptr) continue;
      const int re = p.lwin[2 * nt + 1];
      for (int r = p.lwin[2 * nt]; r < re; r += 64, it++) {
        const int s = it % ST;
        acquire(s);
        unsigned char* A = stages + s * T::STAGE + doff;
        unsigned char* B = A + T::A_BYTES;
        const int col = r + 8 * c;  // this thread's 8 rank columns
        const bool cok = col < re;
#pragma unroll 1
        for (int u = 0; u < BM / 16; u++) {
          const int row = m0 + r0 + 16 * u;
          const bool ok = cok && row < p.lm;
          cp_async16(A + u * 2048, ok ? p.lt + (i64)row * p.lr + col : p.lt, ok);
        }
#pragma unroll 1
        for (int u = 0; u < 8; u++) {
          const int row = n0 + r0 + 16 * u - p.lcol0;
          const bool ok = cok && row >= 0 && row < p.lcols;
          cp_async16(B + u * 2048, ok ? p.lb + (i64)row * p.lr + col : p.lb, ok);
        }
        mbar_arrive_on_copies(full + s);
      }
    }
    // A thread may not exit with copies in flight into shared memory that others read.
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(T::CONSUMER_REGS));
  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tg = lane & 3;
  const int rl = cw * 64 + warp * 16 + (lane >> 2);  // this thread's rows in the tile: rl, rl + 8
  // Descriptor low words of stage 0's X rows of this warpgroup and W tile; stage s, k step ks is
  // (s·STAGE + 32·ks) / 16 further.
  const unsigned a_lo = kept_u32(smem_desc_lo(stages + cw * 64 * 128, 16));
  const unsigned b_lo = kept_u32(smem_desc_lo(stages + T::A_BYTES, 16));
  int it = 0;
  float acc[64], out[64];
  float acc2[OVL ? 64 : 1];  // the second set of the overlapped form
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);
  };
  // This thread's two rows' promotion factors for stage s: their X scales times the W scale.
  auto factors = [&](int s, float& f0, float& f1) {
    const float w = sw[2 * s];
    f0 = sa[s * BM + rl] * w;
    f1 = sa[s * BM + rl + 8] * w;
  };
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int mt, nt;
    gemm_fp8_tile(tile, mtiles, ntiles, mt, nt);
    const int m0 = mt * BM, n0 = nt * 128;
#pragma unroll
    for (int i = 0; i < 64; i++) out[i] = 0.f;
    if constexpr (OVL) {
      // K/128 is even here (the host's choice): k-blocks in pairs, both groups issued together,
      // the first promoted while the second is on the tensor cores (attn_fwd_ws's S and P·V shape:
      // ptxas serialised every wgmma (C7514) when a pair's second group was issued after the
      // first had been waited for, the sets swapping roles).
      for (int kb = 0; kb < kblocks; kb += 2) {
        const int s0 = it % ST, s1 = (it + 1) % ST;
        mbar_wait(full + s0, (it / ST) & 1);
        mbar_wait(full + s1, ((it + 1) / ST) & 1);
        fence_proxy_async();
        wgmma_fence();
        gemm_fp8_mmas<NC, false>(acc, a_lo, b_lo, s0);
        wgmma_commit();
        gemm_fp8_mmas<NC, false>(acc2, a_lo, b_lo, s1);
        wgmma_commit();
        wgmma_wait1();
        fence_regs(acc);
        float f0, f1, g0, g1;
        factors(s0, f0, f1);
        release(s0);
        gemm_fp8_promote(out, acc, f0, f1);
        wgmma_wait0();
        fence_regs(acc2);
        factors(s1, g0, g1);
        release(s1);
        gemm_fp8_promote(out, acc2, g0, g1);
        it += 2;
      }
    } else {
      for (int kb = 0; kb < kblocks; kb++, it++) {
        const int s = it % ST;
        gemm_fp8_stage<NC, false>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s);
        float f0, f1;
        factors(s, f0, f1);
        release(s);
        gemm_fp8_promote(out, acc, f0, f1);
      }
    }
    if (p.lwin != nullptr) {
      const int re = p.lwin[2 * nt + 1];
      for (int r = p.lwin[2 * nt]; r < re; r += 64, it++) {
        const int s = it % ST;
        gemm_fp8_stage<NC, true>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s);
        release(s);
        gemm_fp8_promote(out, acc, p.lscale, p.lscale);
      }
    }
    const int row0 = m0 + rl, row1 = row0 + 8;
    bf16* y0 = p.y + (i64)row0 * p.ldy + n0 + 2 * tg;
    bf16* y1 = y0 + 8 * p.ldy;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      if (row0 < p.M) *(unsigned*)(y0 + 8 * j) = pack_f32(out[4 * j + 0], out[4 * j + 1]);
      if (row1 < p.M) *(unsigned*)(y1 + 8 * j) = pack_f32(out[4 * j + 2], out[4 * j + 3]);
    }
  }
}
#endif  // IMAJEV_WGMMA

// Entries exist on every architecture (the kernel table loads them by name); off Hopper they do
// nothing, and the host only launches them on sm_90. gemm_fp8_128: 128-row tiles (two consumer
// warpgroups of 232 registers); gemm_fp8_192: 192-row tiles (three of 160), 17% fewer bytes a FLOP
// from L2 and more rows of padding at small M; gemm_fp8_128o: gemm_fp8_128 with k-blocks in pairs
// (even K/128 only), the same bits.
#ifdef IMAJEV_WGMMA
#define GEMM_FP8_BODY(NC, OVL) \
  gemm_fp8<NC, OVL>(GemmFp8Args{x, xs, w, ws, y, M, N, K, ldy, lt, lb, lwin, lm, lr, lcol0, lcols, lscale});
#else
#define GEMM_FP8_BODY(NC, OVL)
#endif
#define GEMM_FP8_ENTRY(NAME, NC, OVL)                                                                              \
  extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1)                                             \
      NAME(const unsigned char* x, const float* xs, const unsigned char* w, const float* ws, bf16* y, int M,  \
           int N, int K, i64 ldy, const bf16* lt, const bf16* lb, const int* lwin, int lm, int lr, int lcol0, \
           int lcols, float lscale) {                                                                         \
    GEMM_FP8_BODY(NC, OVL)                                                                                    \
  }
GEMM_FP8_ENTRY(gemm_fp8_128, 2, false)
GEMM_FP8_ENTRY(gemm_fp8_192, 3, false)
GEMM_FP8_ENTRY(gemm_fp8_128o, 2, true)
