// Block-scaled FP8 GEMM on Hopper's warpgroup MMAs (sm_90a), with a LoRA pair's B side added in the
// epilogue: Y = X·Wᵀ (+ lscale · T·Bᵀ, added to X·Wᵀ rounded to BF16, as the cuBLASLt path and
// PEFT add it).
//
// Why by hand: cuBLASLt runs the FP8 projections well (one algorithm per shape, 128 x 128 tiles),
// but it can add nothing to an output except β·C, so each LoRA's B side is a second, BF16 GEMM
// that reads and writes the whole output again (`gemm.lora_b`: 29 ms of a 16K prefill and 14 ms of
// a packed round, bench/NOTES.md). Here the LoRA product lands in the same f32 accumulators.
//
// Operands (the layouts gemm.rs hands cuBLASLt), X, xs, W, T and B as TMA tensor maps
// (src/backend/cuda/tma.rs): X [M][K] E4M3 codes (M is the padded row count, a multiple of 16), xs
// [K/128][M] f32 activation scales; W [N][K] E4M3, ws [N/128][K/128] f32 (a pointer); Y [M][ldy]
// BF16, columns 0 .. N. LoRA (lwin != nullptr): T [lm][lr] BF16 (the A side's product; lm is the
// real row count), B [lcols][lr] BF16 for output columns lcol0 .. lcol0 + lcols (block-diagonal
// over the parts of a fused pair), lwin [N/128][2] the rank columns [rb, re) a column tile needs
// (its parts'; B's other rank columns of its rows are zero), lscale the pair's scale. Bias
// (bias != nullptr): [N] f32, added to the output rounded to BF16 and rounded again, after the
// LoRA, as `add_bias8` adds it to the stored output (the vision tower's projections: ~40 ms of
// add_bias8 launches in a two-photo request). Rows and columns past a map's edges read as zeros.
//
// Shape: a persistent grid, one block an SM, the tiles of BM = 64·NC rows x 128 columns dealt out
// round-robin in a fixed order (gemm_fp8_tile). A block is a producer warpgroup and NC consumer
// warpgroups:
// - the producer's first thread copies each 128-wide k-block's X and W tiles (rows of 128 bytes in
//   the 128-byte swizzle the descriptors name) and the X scales of the tile's rows into an
//   ST-stage ring by TMA (a few instructions a stage: the cp.async form spent ~20 a 16-byte copy
//   over a whole warpgroup and starved the consumers, bench/NOTES.md), with the k-block's W scale
//   stored beside them; a stage is "full" when its bytes have landed and "empty" when every
//   consumer warp has read it. After a tile's k-blocks come its LoRA stages through the same ring:
//   T's rows and B's rows, 64 rank columns (one 128-byte row) a stage.
// - with clusters of two (the _m kernels) the two blocks take row tiles 2i and 2i + 1 of one column
//   tile, each copies half of the W tile's rows into both blocks (TMA multicast), and a stage is
//   empty when the consumers of both have read it.
// - a consumer warpgroup owns 64 rows: per k-block four wgmma m64n128k32 (E4M3 x E4M3, f32) into
//   `acc`, then out += acc · (xs·ws) per row, so the tensor cores' FP8 sums are promoted to full
//   f32 once every 128 K (DeepSeek's recipe, which the checkpoint's scales are made for); per LoRA
//   stage four wgmma m64n128k16 (BF16) into acc, then out += lscale · acc, out having been rounded
//   to BF16 before the first. Then out is rounded to BF16 into a staging tile in shared memory
//   and stored by TMA — in the _d kernels' FP8 form only once the next tile's first k-block MMAs
//   are issued: the tile ends with its values packed into 32 BF16-pair registers (acc and out free),
//   and gemm_fp8_store_tile runs between the next tile's first commit and the wait for it, so the
//   epilogue's shared-memory stores and barriers run while the tensor cores work instead of
//   leaving them idle while all NC warpgroups store at once. The same arithmetic in the same
//   order: the same bits.
// GLU form (gemm_fp8_glu_<rows>, the MLP's gate/up projection, W's rows [gate; up] of N/2 each):
// column tile t holds gate's W rows 64t .. 64t + 64 and up's N/2 + 64t .. (two 64-row TMA boxes
// into the halves of the W tile, each with its own W scale; LoRA B's rows likewise), so a thread
// holds gate and up of the same h columns; a unit is the pair of tiles 2i, 2i + 1 (one 128-block of
// h). The epilogue rounds gate and up to BF16 (the values the plain form stores), computes
// h = bf16(silu(gate) · up) (swiglu_quant_1x128's arithmetic), stores h, and after the pair's
// second tile quantises the 128 h columns of each row as quant_act_1x128 would from h (the first
// tile's values read back from its staging slice): codes by TMA, scales directly. The 2·N/2-wide
// gate/up output is never stored or read again; the bits are those of the plain form followed by
// swiglu_quant_1x128 (tests/gpu swiglu_epilogue_matches_unfused_bitwise). Opt-in: the epilogue's
// arithmetic (expf and divisions per element) holds the tensor cores ~3 µs a tile, as much as the
// stored output and swiglu_quant_1x128 cost (bench/NOTES.md, nineteenth session).
// Batch invariance: the tile shape, the k order and the promotion are the same whatever M is, so a
// row's result is the same bits whatever else shares the call (tests/gpu checks it bitwise). The
// results are also cuBLASLt's bits (its block-scaled kernel promotes the same way; measured on an
// H100), and the same for 128- and 192-row tiles.
// CPU twin: matmul of src/backend/cpu/linear.rs (dequantised FP8 GEMM plus LoRA in f32; not the
// same bits: its sums run in another order).

template <int NC>
struct GemmFp8Tiles {
  static constexpr int BM = 64 * NC, BN = 128, BK = 128;
  // Ring stages (layout::gemm_fp8_stages): what fits beside the output tile's staging. One
  // consumer (gemm_bf16_64) has small stages and keeps 8 in flight: its launches stream a large X
  // through few bytes of work a stage.
  static constexpr int ST = NC == 1 ? 8 : NC == 2 ? 5 : 4;
  static constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // one stage's X and W tiles
  static constexpr int STAGE = A_BYTES + B_BYTES;
  static constexpr int OUT_HALF = BM * 128;  // the output tile's staging: two halves of 64 columns
  // Registers per thread after setmaxnreg (128·P + 128·NC·C <= 65,536: one block an SM).
  static constexpr int PRODUCER_REGS = NC == 3 ? 32 : 40, CONSUMER_REGS = NC == 3 ? 160 : 232;
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
  const TmaMap* x;   // X [M][K] u8, box 128 x BM rows, 128-byte swizzle
  const TmaMap* xs;  // xs [K/128][M] f32, box BM x 1
  const TmaMap* w;   // W [N][K] u8, box 128 x 128 / CL rows, 128-byte swizzle
  const TmaMap* lt;  // T [lm][lr] bf16, box 64 x BM rows, 128-byte swizzle (LoRA only)
  const TmaMap* lb;  // B [lcols][lr] bf16, box 64 x 128 / CL rows, 128-byte swizzle (LoRA only)
  const TmaMap* y;   // Y [M][ldy] bf16 (columns 0 .. N), box 64 x 64 rows, 128-byte swizzle (GLU: h)
  const TmaMap* q;   // GLU only: h's FP8 codes [M][N/2] u8, box 128 x 64 rows, 128-byte swizzle
  const float* ws;
  int M, N, K;
  const int* lwin;
  int lcol0;
  float lscale;
  const float* bias;
  float* qs;  // GLU only: h's activation scales [N/256][M]
  // PLAIN only: the K slice (columns, a multiple of 64) whose products are summed in the tensor
  // cores before they are added to the output in f32, slice after slice; with `part` != nullptr
  // (the split form) a unit is one tile's one slice and writes that slice's f32 sums to
  // part[slice][M][N] for gemm_bf16_slices_sum, instead of the output.
  int kslice;
  float* part;
};

// The four MMAs of ring stage s into acc (not committed): acc starts over (fresh) or adds to
// what it holds (the PLAIN form's stages within one K slice).
template <int NC, bool LORA>
__device__ __forceinline__ void gemm_fp8_mmas(float (&acc)[64], unsigned a_lo, unsigned b_lo, int s, bool fresh) {
#pragma unroll
  for (int ks = 0; ks < 4; ks++) {
    const unsigned off = (unsigned)(s * GemmFp8Tiles<NC>::STAGE + 32 * ks) >> 4;
    const unsigned long long da = smem_desc_of(a_lo + off, 1024), db = smem_desc_of(b_lo + off, 1024);
    if constexpr (LORA) wgmma_ss_m64n128(acc, da, db, !fresh || ks > 0);
    else wgmma_fp8_m64n128k32(acc, da, db, !fresh || ks > 0);
  }
}

// A consumer warpgroup's MMAs of ring stage s into acc, after waiting for the stage to be full, and
// the wait for them: an FP8 k-block (four k32 steps) or a BF16 LoRA stage (four k16 steps), both
// 128 bytes of each row. a_lo, b_lo: the descriptor low words of stage 0's X rows of this
// warpgroup and W tile. The TMA wrote the stage through the async proxy the tensor cores read
// through: no proxy fence. `meanwhile` runs between the MMAs' commit and the wait for them (it
// must not touch acc): the _d kernels' store of the previous tile.
template <int NC, bool LORA, typename Meanwhile>
__device__ __forceinline__ void gemm_fp8_stage(float (&acc)[64], unsigned long long* full, unsigned parity,
                                               unsigned a_lo, unsigned b_lo, int s, bool fresh, Meanwhile&& meanwhile) {
  mbar_wait(full, parity);
  wgmma_fence();
  gemm_fp8_mmas<NC, LORA>(acc, a_lo, b_lo, s, fresh);
  wgmma_commit();
  meanwhile();
  wgmma_wait0();
  fence_regs(acc);
}
template <int NC, bool LORA>
__device__ __forceinline__ void gemm_fp8_stage(float (&acc)[64], unsigned long long* full, unsigned parity,
                                               unsigned a_lo, unsigned b_lo, int s, bool fresh = true) {
  gemm_fp8_stage<NC, LORA>(acc, full, parity, a_lo, b_lo, s, fresh, [] {});
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

// gemm_fp8_promote for a GLU tile, whose two 64-column halves (gate's and up's rows of W) have
// their own W scales: columns 0 .. 63 (j < 8) take f0 / f1, columns 64 .. 127 take g0 / g1.
__device__ __forceinline__ void gemm_fp8_promote_halves(float (&out)[64], const float (&acc)[64], float f0, float f1,
                                                        float g0, float g1) {
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const float a = j < 8 ? f0 : g0, b = j < 8 ? f1 : g1;
    out[4 * j + 0] = fmaf(acc[4 * j + 0], a, out[4 * j + 0]);
    out[4 * j + 1] = fmaf(acc[4 * j + 1], a, out[4 * j + 1]);
    out[4 * j + 2] = fmaf(acc[4 * j + 2], b, out[4 * j + 2]);
    out[4 * j + 3] = fmaf(acc[4 * j + 3], b, out[4 * j + 3]);
  }
}

// This thread's 64 h values of a GLU tile as bf16 pairs in the warpgroup's 64 x 128-byte slice of
// a staging half (the output tile's swizzle): h[4j], h[4j + 1] at row rw, h[4j + 2], h[4j + 3] at
// rw + 8, columns 8j + 2tg and the next.
__device__ __forceinline__ void glu_stage_h(unsigned char* slice, const float (&h)[32], int rw, int tg) {
#pragma unroll
  for (int j = 0; j < 8; j++) {
    unsigned char* at = slice + 4 * tg + ((j ^ (rw & 7)) << 4);
    *(unsigned*)(at + rw * 128) = pack_f32(h[4 * j + 0], h[4 * j + 1]);
    *(unsigned*)(at + (rw + 8) * 128) = pack_f32(h[4 * j + 2], h[4 * j + 3]);
  }
}

// The epilogue of a GLU tile (kernel doc): h = bf16(silu(gate) · up) of this thread's 2 rows x 16
// columns, from the tile's gate half (out[0 .. 31]) and up half (out[32 .. 63]) each rounded to
// BF16 as the stored gate/up output was, with swiglu_quant_1x128's arithmetic. Tile `half` 0 of a
// pair stores its h and keeps its rows' partial amax; tile 1 stores its h, completes the amax of
// the pair's 128 h columns, and quantises both tiles' values (tile 0's read back from its staging
// slice) into h's FP8 codes and scales, as quant_act_1x128 would from h.
template <int NC>
__device__ __forceinline__ void gemm_fp8_glu_epilogue(const GemmFp8Args& p, const float (&out)[64], float (&amax)[2],
                                                      unsigned char* staged, int half, int cw, int rw, int rl,
                                                      int tg, int m0, int nt) {
  using T = GemmFp8Tiles<NC>;
  float h[32], a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i++) {
    const float g = bf(to_bf(out[i])), u = bf(to_bf(out[32 + i]));
    h[i] = bf(to_bf(silu_f(g) * u));
    if (i & 2) a1 = fmaxf(a1, fabsf(h[i]));
    else a0 = fmaxf(a0, fabsf(h[i]));
  }
  unsigned char* first = staged + cw * 64 * 128;  // tile 0's h, then the pair's codes
  unsigned char* second = staged + T::OUT_HALF + cw * 64 * 128;
  const bool leader = (threadIdx.x & 127) == 0;
  if (half == 0) {
    if (leader) bulk_wait_read0();  // the previous pair's stores have read the staging slices
    named_bar_sync(1 + cw, 128);
    glu_stage_h(first, h, rw, tg);
    fence_proxy_async();
    named_bar_sync(1 + cw, 128);
    if (leader) {
      tma_store_2d(p.y, first, 64 * nt, m0 + cw * 64);
      bulk_commit();
    }
    amax[0] = a0;
    amax[1] = a1;
    return;
  }
  // The amax of each row's 128 h columns: this thread's 16 of each tile, then the row's 4 threads.
  a0 = fmaxf(a0, amax[0]);
  a1 = fmaxf(a1, amax[1]);
  a0 = fmaxf(a0, __shfl_xor_sync(0xffffffffu, a0, 1));
  a0 = fmaxf(a0, __shfl_xor_sync(0xffffffffu, a0, 2));
  a1 = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, 1));
  a1 = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, 2));
  const float sc0 = act_scale_1x128(a0), sc1 = act_scale_1x128(a1);
  float h0[32];  // tile 0's values, where this thread staged them
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const unsigned char* at = first + 4 * tg + ((j ^ (rw & 7)) << 4);
    const unsigned r0 = *(const unsigned*)(at + rw * 128), r1 = *(const unsigned*)(at + (rw + 8) * 128);
    h0[4 * j + 0] = __uint_as_float(r0 << 16);
    h0[4 * j + 1] = __uint_as_float(r0 & 0xffff0000u);
    h0[4 * j + 2] = __uint_as_float(r1 << 16);
    h0[4 * j + 3] = __uint_as_float(r1 & 0xffff0000u);
  }
  if (leader) bulk_wait_read0();  // tile 0's store has read `first`
  named_bar_sync(1 + cw, 128);
  glu_stage_h(second, h, rw, tg);
  // The codes: a 128-byte row of the pair's h columns, tile 0's at 8j + 2tg, tile 1's 64 further.
  auto codes = [](float x, float y, float sc) {
    return (unsigned short)(act_code_e4m3(x, sc) | (act_code_e4m3(y, sc) << 8));
  };
#pragma unroll
  for (int j = 0; j < 8; j++) {
#pragma unroll
    for (int t = 0; t < 2; t++) {
      const float* v = t == 0 ? h0 : h;
      const int chunk = 4 * t + (j >> 1), within = 8 * (j & 1) + 2 * tg;
      unsigned char* at = first + within + ((chunk ^ (rw & 7)) << 4);
      *(unsigned short*)(at + rw * 128) = codes(v[4 * j + 0], v[4 * j + 1], sc0);
      *(unsigned short*)(at + (rw + 8) * 128) = codes(v[4 * j + 2], v[4 * j + 3], sc1);
    }
  }
  fence_proxy_async();
  named_bar_sync(1 + cw, 128);
  if (leader) {
    tma_store_2d(p.y, second, 64 * nt, m0 + cw * 64);
    tma_store_2d(p.q, first, 128 * (nt >> 1), m0 + cw * 64);
    bulk_commit();
  }
  if (tg == 0) {
    const int r = m0 + rl;
    if (r < p.M) p.qs[(i64)(nt >> 1) * p.M + r] = sc0;
    if (r + 8 < p.M) p.qs[(i64)(nt >> 1) * p.M + r + 8] = sc1;
  }
}

// A finished tile's epilogue on this consumer warpgroup's 64 rows, in two halves so that only
// half as many registers wait for the store as `out` holds (DEFER, kernel doc).
// First: the bias if any (bf16(bf16(out) + bias[c]), add_bias8's arithmetic on the output it would
// have read), then this thread's values rounded to BF16 pairs: packed[2j] its first row's columns
// 8j + 2tg and the next, packed[2j + 1] the same columns of its second row.
__device__ __forceinline__ void gemm_fp8_pack_tile(float (&out)[64], const float* bias, int n0, int tg,
                                                   unsigned (&packed)[32]) {
  if (bias != nullptr) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const float2 b = *(const float2*)(bias + n0 + 8 * j + 2 * tg);
      out[4 * j + 0] = bf(to_bf(out[4 * j + 0])) + b.x;
      out[4 * j + 1] = bf(to_bf(out[4 * j + 1])) + b.y;
      out[4 * j + 2] = bf(to_bf(out[4 * j + 2])) + b.x;
      out[4 * j + 3] = bf(to_bf(out[4 * j + 3])) + b.y;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; j++) {
    packed[2 * j] = pack_f32(out[4 * j + 0], out[4 * j + 1]);
    packed[2 * j + 1] = pack_f32(out[4 * j + 2], out[4 * j + 3]);
  }
}

// Second: the packed values into the warpgroup's rows of the staging tile (the 128-byte swizzle
// keeps a warp's 8 rows on distinct banks), stored by one thread's TMA while the warpgroup goes on
// (the direct 4-byte stores were ~18% of the stall samples: the LSU queue full under the copies'
// traffic, ncu).
template <int NC>
__device__ __forceinline__ void gemm_fp8_store_tile(const GemmFp8Args& p, const unsigned (&packed)[32],
                                                    unsigned char* staged, int cw, int warp, int lane, int m0,
                                                    int n0) {
  using T = GemmFp8Tiles<NC>;
  const bool leader = (threadIdx.x & 127) == 0;
  if (leader) bulk_wait_read0();  // the previous tile's store has read the staging rows
  named_bar_sync(1 + cw, 128);
  const int rw = warp * 16 + (lane >> 2);  // this thread's rows within the warpgroup's 64
#pragma unroll
  for (int j = 0; j < 16; j++) {
    unsigned char* half = staged + (j >> 3) * T::OUT_HALF + cw * 64 * 128 + 4 * (lane & 3);
    const int c = j & 7;
    *(unsigned*)(half + rw * 128 + ((c ^ (rw & 7)) << 4)) = packed[2 * j];
    *(unsigned*)(half + (rw + 8) * 128 + ((c ^ (rw & 7)) << 4)) = packed[2 * j + 1];
  }
  fence_proxy_async();
  named_bar_sync(1 + cw, 128);
  if (leader) {
    tma_store_2d(p.y, staged + cw * 64 * 128, n0, m0 + cw * 64);
    tma_store_2d(p.y, staged + T::OUT_HALF + cw * 64 * 128, n0 + 64, m0 + cw * 64);
    bulk_commit();
  }
}

// The PLAIN form's K columns [slice·kslice, end) of a unit: all of K when the launch is whole
// (slices 1), else the unit's slice. The producer and the consumers walk the same stages.
__device__ __forceinline__ int gemm_plain_end(const GemmFp8Args& p, int slice, int slices) {
  return slices > 1 ? min(p.K, (slice + 1) * p.kslice) : p.K;
}

// The row block mt and column block nt of this block's unit u: with clusters of two (CL = 2) a unit
// is a pair of row blocks sharing a column block, the cluster's block of rank r taking row block
// 2·mt2 + r (past the last row block when mtiles is odd: its rows read as zeros and are not
// stored), so both blocks run the same stages in step, as the W tiles they share demand.
template <int CL>
__device__ __forceinline__ void gemm_fp8_unit(int u, int mtiles, int ntiles, unsigned rank, int& mt, int& nt) {
  int m2;
  gemm_fp8_tile(u, (mtiles + CL - 1) / CL, ntiles, m2, nt);
  mt = CL * m2 + (int)rank;
}

// CL: blocks of a cluster (1, or 2 sharing each W tile: each loads half of its rows and multicasts
// them to both, halving W's traffic from L2).
// PLAIN: a BF16 GEMM Y = T·Bᵀ over K BF16 columns and nothing else (the LoRA A side, T = X·Aᵀ:
// N is the pair's rank, not a multiple of 128, its last column tile cut by the maps' edges): no
// FP8 k-blocks, the LoRA stages over the whole K, summed slice by slice (GemmFp8Args::kslice); with
// `part` the split form, a unit per (tile, slice), each slice's sums to `part` for
// gemm_bf16_slices_sum. Whole or split, a row's sums are the same bits whatever M is.
// GLU: the MLP's gate/up projection (W's rows [gate; up], N/2 each) with the SwiGLU and the down
// projection's FP8 input in the epilogue (kernel doc); CL = 1 only.
template <int NC, int CL, bool PLAIN, bool GLU = false, bool DEFER_EPILOGUE = false>
__device__ void gemm_fp8(const GemmFp8Args& p) {
  static_assert(!GLU || (CL == 1 && !PLAIN), "the GLU form is one block, FP8");
  using T = GemmFp8Tiles<NC>;
  constexpr int BM = T::BM, ST = T::ST;
  constexpr int TPU = GLU ? 2 : 1;  // column tiles a unit: a GLU unit is the pair of one 128-block of h
  // The FP8 form's epilogue waits in `packed` until the next tile's first MMAs are issued (the _d
  // kernels, kernel doc). Not the GLU form (its epilogue's registers beside acc and out would not
  // fit) nor PLAIN.
  constexpr bool DEFER = DEFER_EPILOGUE && !PLAIN && !GLU;
  // The bytes a stage's full barrier waits for: the X tile, the W tile (all of it, from whichever
  // block of the cluster) and the X scales; a LoRA stage's T and B tiles are as many bytes as X
  // and W.
  constexpr unsigned STAGE_TX = T::STAGE + BM * 4, LORA_TX = T::STAGE;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* stages = smem_1024(smem_raw);  // [ST] { X tile BM x 128 B, W tile 128 x 128 B }
  unsigned char* staged = stages + ST * T::STAGE;  // [2][BM][128 B] the output tile, swizzled
  float* sa = (float*)(staged + 2 * T::OUT_HALF);  // [ST][BM] the X scales of the tile's rows
  float* sw = sa + ST * BM;                       // [ST][2] the W scale of the k-block (and a pad)
  unsigned long long* full = (unsigned long long*)(sw + 2 * ST);
  unsigned long long* empty = full + ST;

  const unsigned rank = CL > 1 ? cluster_rank() : 0;
  // (PLAIN: N need not be whole 128-column tiles, and K is all LoRA stages' columns.)
  const int mtiles = (p.M + BM - 1) / BM, ntiles = PLAIN ? (p.N + 127) / 128 : p.N / 128;
  const int kblocks = PLAIN ? 0 : p.K / 128;
  // The split PLAIN form: a unit is one tile's one K slice (slice = unit % slices).
  const int slices = PLAIN && p.part != nullptr ? (p.K + p.kslice - 1) / p.kslice : 1;
  const int units = (mtiles + CL - 1) / CL * (ntiles / TPU) * slices, unit0 = blockIdx.x / CL,
            unit_step = gridDim.x / CL;
  const int up0 = p.N / 2;  // GLU: up's first row of W (and of B)
  if (threadIdx.x == 0) {
    for (int i = 0; i < ST; i++) {
      mbar_init(full + i, 1);             // the producer's arrival (with the bytes it expects)
      mbar_init(empty + i, 4 * NC * CL);  // one arrival per consumer warp of the cluster
    }
    if constexpr (CL > 1) fence_mbar_init_cluster();
  }
  if constexpr (CL > 1) cluster_sync();  // the peer's barriers exist before anything reaches them
  else __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);

  if (wg == 0) {
    // ---- producer: warp 0 walks the stages, its lane 0 issues the copies; the warp fetches the
    // tile's W scales 32 k-blocks at a time and hands each stage's on with a shuffle.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(T::PRODUCER_REGS));
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
      const bool issue = lane == 0;
      if (issue && !PLAIN) {  // (PLAIN's X, xs and W maps are zeros, never read)
        tma_prefetch_map(p.x);
        tma_prefetch_map(p.xs);
        tma_prefetch_map(p.w);
      }
      int it = 0;
      auto acquire = [&](int s) {
        if (it >= ST) mbar_wait(empty + s, ((it / ST) - 1) & 1);
      };
      for (int u = unit0; u < units; u += unit_step) {
        int mt, nu;
        gemm_fp8_unit<CL>(u / slices, mtiles, ntiles / TPU, rank, mt, nu);
        const int slice = u % slices;
        for (int ti = 0; ti < TPU; ti++) {  // the unit's column tiles (GLU: the pair's)
          const int nt = nu * TPU + ti;
          const int m0 = mt * BM, n0 = nt * 128, wrow = n0 + (int)rank * (128 / CL);
          // GLU: the tile's 64 gate rows of W (and B) and the up rows of the same h columns; their
          // W scales are those of 128-row blocks nt / 2 and up0 / 128 + nt / 2.
          const int grow = 64 * nt, urow = up0 + 64 * nt;
          float wpart = 0.f, upart = 0.f;  // lane l: the W scale(s) of k-block 32·⌊kb / 32⌋ + l
          for (int kb = 0; kb < kblocks; kb++, it++) {
            if ((kb & 31) == 0) {
              const bool in = kb + lane < kblocks;
              if constexpr (GLU) {
                wpart = in ? p.ws[(i64)(nt >> 1) * kblocks + kb + lane] : 0.f;
                upart = in ? p.ws[(i64)(up0 / 128 + (nt >> 1)) * kblocks + kb + lane] : 0.f;
              } else {
                wpart = in ? p.ws[(i64)nt * kblocks + kb + lane] : 0.f;
              }
            }
            const float wscale = __shfl_sync(0xffffffffu, wpart, kb & 31);
            const float uscale = GLU ? __shfl_sync(0xffffffffu, upart, kb & 31) : 0.f;
            const int s = it % ST;
            acquire(s);
            if (issue) {
              unsigned char* A = stages + s * T::STAGE;
              unsigned char* B = A + T::A_BYTES + (int)rank * (T::B_BYTES / CL);
              sw[2 * s] = wscale;  // visible to the consumers through the arrival's release
              if constexpr (GLU) sw[2 * s + 1] = uscale;
              mbar_arrive_expect_tx(full + s, STAGE_TX);
              tma_load_2d(A, p.x, kb * 128, m0, full + s);
              tma_load_2d(sa + s * BM, p.xs, m0, kb, full + s);
              if constexpr (GLU) {
                tma_load_2d(B, p.w, kb * 128, grow, full + s);
                tma_load_2d(B + T::B_BYTES / 2, p.w, kb * 128, urow, full + s);
              } else if constexpr (CL > 1) {
                tma_load_2d_multicast(B, p.w, kb * 128, wrow, full + s, (1 << CL) - 1);
              } else {
                tma_load_2d(B, p.w, kb * 128, wrow, full + s);
              }
            }
          }
          if (!PLAIN && p.lwin == nullptr) continue;
          // PLAIN: all of K, or the unit's slice of it.
          const int re = PLAIN ? gemm_plain_end(p, slice, slices) : p.lwin[2 * nt + 1];
          for (int r = PLAIN ? slice * p.kslice : p.lwin[2 * nt]; r < re; r += 64, it++) {
            // T's and B's rank columns r .. r + 64: those past the window are other parts' ranks,
            // where this tile's rows of B are zero (block-diagonal B), or past the rank (zeros).
            const int s = it % ST;
            acquire(s);
            if (issue) {
              unsigned char* A = stages + s * T::STAGE;
              unsigned char* B = A + T::A_BYTES + (int)rank * (T::B_BYTES / CL);
              mbar_arrive_expect_tx(full + s, LORA_TX);
              tma_load_2d(A, p.lt, r, m0, full + s);
              if constexpr (GLU) {
                tma_load_2d(B, p.lb, r, grow - p.lcol0, full + s);
                tma_load_2d(B + T::B_BYTES / 2, p.lb, r, urow - p.lcol0, full + s);
              } else if constexpr (CL > 1) {
                tma_load_2d_multicast(B, p.lb, r, wrow - p.lcol0, full + s, (1 << CL) - 1);
              } else {
                tma_load_2d(B, p.lb, r, wrow - p.lcol0, full + s);
              }
            }
          }
        }
      }
    }
  } else {
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
    // Stage s is free again once every consumer warp of the cluster has read it (its W rows came
    // from both blocks).
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) {
        if constexpr (CL > 1) {
#pragma unroll
          for (unsigned c = 0; c < CL; c++) mbar_arrive_cluster(empty + s, c);
        } else {
          mbar_arrive(empty + s);
        }
      }
    };
    float glu_amax[2];  // GLU: the partial amax of this thread's rows over the pair's first tile
    // A finished tile's output as BF16 pairs (gemm_fp8_pack_tile); with DEFER, the tile they belong
    // to (row 0 and column 0; none while pend_m0 < 0) until they are stored.
    unsigned packed[32];
    int pend_m0 = -1, pend_n0 = 0;
    for (int u = unit0; u < units; u += unit_step) {
      int mt, nu;
      gemm_fp8_unit<CL>(u / slices, mtiles, ntiles / TPU, rank, mt, nu);
      const int slice = u % slices;
#pragma unroll 1
      for (int ti = 0; ti < TPU; ti++) {  // the unit's column tiles (GLU: the pair's)
        const int nt = nu * TPU + ti;
        const int m0 = mt * BM, n0 = nt * 128;
        // A k-block's promotion: this thread's two rows' factors are their X scales times the W
        // scale (GLU: the gate half's and the up half's); the stage is released before the FMAs.
        auto promote = [&](int s) {
          const float w = sw[2 * s], f0 = sa[s * BM + rl] * w, f1 = sa[s * BM + rl + 8] * w;
          if constexpr (GLU) {
            const float wu = sw[2 * s + 1], g0 = sa[s * BM + rl] * wu, g1 = sa[s * BM + rl + 8] * wu;
            release(s);
            gemm_fp8_promote_halves(out, acc, f0, f1, g0, g1);
          } else {
            release(s);
            gemm_fp8_promote(out, acc, f0, f1);
          }
        };
        int kb = 0;
        // (The FP8 form always has a k-block: the host never sends K = 0, gemm_fp8.rs `eligible`;
        // so with DEFER a pending store always meets the next tile's first k-block.)
        if (DEFER && kblocks > 0) {
          // The first k-block, with the previous tile's store between its MMAs' commit and the
          // wait for them (the MMAs write acc only; `packed` is free once stored). Peeled off the
          // loop so that `packed` is not live across the other k-blocks.
          const int s = it % ST;
          gemm_fp8_stage<NC, false>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s, true, [&] {
            if (pend_m0 >= 0) gemm_fp8_store_tile<NC>(p, packed, staged, cw, warp, lane, pend_m0, pend_n0);
#pragma unroll
            for (int i = 0; i < 64; i++) out[i] = 0.f;
          });
          promote(s);
          kb++, it++;
        } else {
#pragma unroll
          for (int i = 0; i < 64; i++) out[i] = 0.f;
        }
        for (; kb < kblocks; kb++, it++) {
          const int s = it % ST;
          gemm_fp8_stage<NC, false>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s);
          promote(s);
        }
        if constexpr (PLAIN) {
          // Slice by slice: a slice's stages summed by the tensor cores in acc, then out += acc in
          // f32, slices in order (the split form's gemm_bf16_slices_sum adds its slices' sums in the
          // same order from zero: the same bits).
          const int r0 = slice * p.kslice, re = gemm_plain_end(p, slice, slices);
          for (int r = r0; r < re; r += 64, it++) {
            const int s = it % ST;
            const bool first = (r - r0) % p.kslice == 0, last = r + 64 >= re || (r + 64 - r0) % p.kslice == 0;
            gemm_fp8_stage<NC, true>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s, first);
            release(s);
            if (last) gemm_fp8_promote(out, acc, 1.f, 1.f);
          }
          if (slices > 1) {
            // The split form: this slice's f32 sums of this thread's two rows, 2 x 32 columns.
            const int row = m0 + rl;
#pragma unroll
            for (int j = 0; j < 16; j++) {
              const int c = n0 + 8 * j + 2 * tg;  // N % 8 == 0: c < N means c + 1 < N
              float* at = p.part + ((i64)slice * p.M + row) * p.N + c;
              if (c < p.N && row < p.M) *(float2*)at = make_float2(out[4 * j + 0], out[4 * j + 1]);
              if (c < p.N && row + 8 < p.M) *(float2*)(at + 8 * (i64)p.N) = make_float2(out[4 * j + 2], out[4 * j + 3]);
            }
            continue;
          }
        } else if (p.lwin != nullptr) {
          // The LoRA is added to the base projection rounded to BF16, as the cuBLASLt path adds its
          // separate B GEMM to the stored output (and PEFT to the base layer's BF16 output): the
          // kernel moves where the sum happens, not the arithmetic.
#pragma unroll
          for (int i = 0; i < 64; i++) out[i] = bf(to_bf(out[i]));
          const int re = p.lwin[2 * nt + 1];
          for (int r = p.lwin[2 * nt]; r < re; r += 64, it++) {
            const int s = it % ST;
            gemm_fp8_stage<NC, true>(acc, full + s, (it / ST) & 1, a_lo, b_lo, s);
            release(s);
            gemm_fp8_promote(out, acc, p.lscale, p.lscale);
          }
        }
        if constexpr (GLU) {
          gemm_fp8_glu_epilogue<NC>(p, out, glu_amax, staged, ti, cw, warp * 16 + (lane >> 2), rl, tg, m0, nt);
          continue;
        }
        gemm_fp8_pack_tile(out, PLAIN ? nullptr : p.bias, n0, tg, packed);
        if constexpr (DEFER) {
          pend_m0 = m0;  // stored under the next tile's first MMAs, or after the last tile
          pend_n0 = n0;
        } else {
          gemm_fp8_store_tile<NC>(p, packed, staged, cw, warp, lane, m0, n0);
        }
      }
    }
    if (DEFER && pend_m0 >= 0) gemm_fp8_store_tile<NC>(p, packed, staged, cw, warp, lane, pend_m0, pend_n0);
    if ((threadIdx.x & 127) == 0) bulk_wait0();  // the shared memory stays until the stores read it
  }
  // A block of a cluster may not exit while its peer can still write into its shared memory or
  // arrive on its barriers.
  if constexpr (CL > 1) cluster_sync();
}
#endif  // IMAJEV_WGMMA

// Entries exist on every architecture (the kernel table loads them by name); off Hopper they do
// nothing, and the host only launches them on sm_90. gemm_fp8_128: 128-row tiles (two consumer
// warpgroups of 232 registers); gemm_fp8_192: 192-row tiles (three of 160), 17% fewer bytes a FLOP
// from L2 and more rows of padding at small M; the _m forms run in clusters of two blocks that
// share each W tile (the grid a multiple of two). All give the same bits.
#ifdef IMAJEV_WGMMA
#define GEMM_FP8_BODY(NC, CL, PLAIN, GLU, DEFER) \
  gemm_fp8<NC, CL, PLAIN, GLU, DEFER>(            \
      GemmFp8Args{&x, &xs, &w, &lt, &lb, &y, &q, ws, M, N, K, lwin, lcol0, lscale, bias, qs, kslice, part});
#else
#define GEMM_FP8_BODY(NC, CL, PLAIN, GLU, DEFER)
#endif
#define GEMM_FP8_ENTRY(NAME, NC, CL, PLAIN, GLU, DEFER, ATTRS)                                                 \
  extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) ATTRS NAME(                                  \
      const __grid_constant__ TmaMap x, const __grid_constant__ TmaMap xs, const __grid_constant__ TmaMap w,   \
      const __grid_constant__ TmaMap lt, const __grid_constant__ TmaMap lb, const __grid_constant__ TmaMap y,  \
      const __grid_constant__ TmaMap q, const float* ws, int M, int N, int K, const int* lwin, int lcol0,      \
      float lscale, const float* bias, float* qs, int kslice, float* part) {                                   \
    pdl_begin();                                                                                               \
    GEMM_FP8_BODY(NC, CL, PLAIN, GLU, DEFER)                                                                   \
  }
GEMM_FP8_ENTRY(gemm_fp8_128, 2, 1, false, false, false, )
GEMM_FP8_ENTRY(gemm_fp8_192, 3, 1, false, false, false, )
GEMM_FP8_ENTRY(gemm_fp8_128m, 2, 2, false, false, false, __cluster_dims__(2, 1, 1))
GEMM_FP8_ENTRY(gemm_fp8_192m, 3, 2, false, false, false, __cluster_dims__(2, 1, 1))
// gemm_fp8_<rows>d: the FP8 form with a tile's store deferred under the next tile's first MMAs
// (kernel doc); the same bits as gemm_fp8_<rows>.
GEMM_FP8_ENTRY(gemm_fp8_128d, 2, 1, false, false, true, )
GEMM_FP8_ENTRY(gemm_fp8_192d, 3, 1, false, false, true, )
// gemm_bf16_<rows>: the PLAIN form (the LoRA A side), same parameters: only lt (X), lb (A), y, M, N
// (the rank), K (BF16 columns), kslice and part are read (no bias, scale 1). gemm_bf16_64 (one
// consumer warpgroup, 64-row tiles) is the whole form for large M: a LoRA A side is one column
// tile, so at 7,816 rows 192-row tiles are 41 units on 132 SMs and 64-row tiles 123; a row's sums
// are the same bits on every tile height.
GEMM_FP8_ENTRY(gemm_bf16_64, 1, 1, true, false, false, )
GEMM_FP8_ENTRY(gemm_bf16_128, 2, 1, true, false, false, )
GEMM_FP8_ENTRY(gemm_bf16_192, 3, 1, true, false, false, )

// The split PLAIN form's second step: y[m][n] = bf16(((0 + part[0][m][n]) + part[1][m][n]) + ...),
// the slices in order, as the whole form adds them in its accumulators (the same bits); one thread
// per 4 columns of a row (N % 8 == 0). Why split: at a few hundred rows the whole form has a unit
// per row tile, six for 977 rows, each walking all of K alone (the LoRA A sides' ~15 µs a launch
// on cuBLASLt, bench/NOTES.md); split, the units are tiles times slices.
extern "C" __global__ void gemm_bf16_slices_sum(const float* part, int slices, int M, int N, bf16* y) {
  pdl_begin();
  const i64 quads = (i64)M * N / 4, i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= quads) return;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int sl = 0; sl < slices; sl++) {
    const float4 v = ((const float4*)part)[sl * quads + i];
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
  }
  const bf16 h[4] = {to_bf(a.x), to_bf(a.y), to_bf(a.z), to_bf(a.w)};
  store_bf16x4(y + 4 * i, h);
}
// gemm_fp8_glu_<rows>: the GLU form (the MLP's gate/up projection with the SwiGLU and its FP8
// quantisation in the epilogue): y is h [M][N/2] bf16, q and qs its codes and scales (no bias).
GEMM_FP8_ENTRY(gemm_fp8_glu_128, 2, 1, false, true, false, )
GEMM_FP8_ENTRY(gemm_fp8_glu_192, 3, 1, false, true, false, )
