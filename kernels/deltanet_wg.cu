// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan_wg_<DK> (Hopper, sm_90a; continues deltanet.cu, one compilation unit): the chunk
// scan with the recurrent state held in registers as a warpgroup-MMA accumulator, FlashInfer's
// shape (NOTES: "How FlashInfer's SM90 delta-rule prefill gets ~1.6 µs a chunk") with our TF32
// precision. Why: the mma.sync scans keep S in shared memory and load every operand fragment per
// warp and k step; at 16K tokens the pipelined one spends ~5.7 µs a chunk on that dependent chain
// (1.49 ms a layer on the H200, issue 10's target 0.5). Here one warpgroup (128 threads) per
// (sequence, value head, 64 value columns) walks the chunks; per chunk, with the state transposed
// (S^T: 64 value columns x DK) as the f32 accumulator of wgmma.m64n{DK}k8:
//   X  = S^T K^T,  Y = S^T Q^T                  (A = S^T from registers, B = K, Q rows from smem)
//   R^T = beta (V^T - e^gamma X)                (elementwise, on the accumulators);  Y *= e^gamma
//   Vn^T = R^T T^T                              (B = T rows, from the prep's row-major T)
//   O^T = Y + Vn^T P^T                          (B = P rows)
//   S^T <- e^{gamma_last} S^T + (fac Vn)^T K    (B = K^T rows, written by the prep)
// Every product is one TF32 wgmma (operands rounded to TF32 by cvt.rna, f32 accumulation), the
// precision of the default TF32 scans, but not their bits (the tensor cores sum in another order),
// so GdnScan::Warpgroup runs it for every launch, never per launch.
//
// Layout trick: a TF32 A fragment holds columns tg and tg+4 of its 8-column k step, an accumulator
// columns 2tg and 2tg+1. So an accumulator becomes the next product's A operand without shuffles if
// its columns are the rows of a chunk in the order sigma within each group of 8:
// accumulator column n = 8a + 2t + e holds row sigma(n) = 8a + t + 4e. Every B operand whose rows
// index chunk rows (K, Q, T, P) is copied with its smem row n = row sigma(n) (whole 16-byte rows:
// cp.async still works), and K^T's rows (key dims) likewise, so the state's accumulator column n
// is key dim sigma(n); the k index of every product is then in natural order.
//
// Shared memory (layout::delta_wg_smem_bytes), operands in the 128-byte-swizzled K-major layout of
// common.cuh, 1024-byte aligned: K, Q and the gates of two chunks, K^T, T and P of one chunk, V
// [64][72] f32 of one chunk, 8 mbarriers. 217,664 bytes at DK 128: one block per SM.
// Warp-specialised (FlashAttention-3's hand-over, as attn_fwd_ws): warpgroup 0 issues every copy
// and computes the gates (its warp 0), running ahead of the consumers (K, Q, gates two chunks, V
// and K^T/T/P one); a stage is "full" when its copies have landed (cp.async.mbarrier.arrive, the
// producer never waits for its own copies) and "empty" when each consumer warp has released it.
// Warpgroup 1 does the products above and writes O. gdn_chunk_scan_wg1_<DK> is the same kernel
// without the producer: one warpgroup copies between its products (cp.async groups and block
// barriers), for short launches where a producer has nothing to run ahead of; the same products
// in the same order on the same values, so the same bits. (A first version without the producer spent
// ~2,900 instructions a warp and chunk, most of them copy addressing, and ran at the pipelined
// scan's 1.45 ms a call at 16K on the H100.)
// Tables and outputs as gdn_chunk_scan_<DK>; tp holds T and P ROW-MAJOR (gdn_chunk_prep_rm_<DK>)
// and kt the chunks' K^T [chunk][kh][DK][64]. CPU twin: cpu::deltanet::delta_rule_chunked.

#ifdef IMAJEV_WGMMA
// D[64 x 32] (+)= A[64 x 8] B[8 x 32], TF32 operands, f32 accumulation: A from registers (each warp's
// 16 rows as the mma.sync m16n8k8 TF32 A fragment), B from shared memory (K-major descriptor);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[16], const unsigned (&a)[4], unsigned long long db,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// D[64 x 64] (+)= A[64 x 8] B[8 x 64], TF32 operands, f32 accumulation: A from registers (each warp's
// 16 rows as the mma.sync m16n8k8 TF32 A fragment), B from shared memory (K-major descriptor);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 8] B[8 x 128], TF32 operands, f32 accumulation: A from registers (each warp's
// 16 rows as the mma.sync m16n8k8 TF32 A fragment), B from shared memory (K-major descriptor);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long db,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// Accumulators and A fragments pass through fence_regs (common.cuh) before each wgmma_fence and
// after each wait: the compiler may otherwise sink their definitions past the fence (ptxas then
// serialises the MMAs or fences each one) or hoist reads above the wait.

// sigma: the chunk row (or key dim) whose values sit in accumulator column / smem row n. Twin:
// layout::wg_row (unit-tested to turn accumulators into A fragments in natural k order).
__device__ __forceinline__ int wg_row(int n) { return (n & ~7) | ((n & 1) << 2) | ((n >> 1) & 3); }

// The bits of x as a TF32 operand, rounded to nearest (ties away from zero): the tensor cores ignore
// an operand's low 13 bits, so adding half their range gives cvt.rna's value in one integer add (a
// chunk converts ~200 values a thread, all on the scan's chain).
__device__ __forceinline__ unsigned tf32_operand(float x) { return __float_as_uint(x) + 0x1000u; }

// The A fragment of k step kk from a 64-column accumulator (see the layout trick above).
template <int N>
__device__ __forceinline__ void wg_a_frag(unsigned (&a)[4], const float (&acc)[N], int kk) {
  a[0] = tf32_operand(acc[4 * kk]);
  a[1] = tf32_operand(acc[4 * kk + 2]);
  a[2] = tf32_operand(acc[4 * kk + 1]);
  a[3] = tf32_operand(acc[4 * kk + 3]);
}

// The cp.async copies of a K-major tile of ROWS rows x W floats (W/4 16-byte chunks a row) into the
// swizzled layout, smem row n holding source row sigma(n). Thread t copies chunks q = q0 + TPR v of
// rows n = n0 + RP u (n0 = t / TPR, q0 = t % TPR, RP = 128 / TPR rows a pass): RP is a multiple of 8,
// so sigma(n) = sigma(n0) + RP u and n % 8 = n0 % 8, and every address is a per-thread constant plus
// compile-time steps (the per-row index arithmetic was most of the first version's instructions).
// Consecutive threads read consecutive 16 bytes of a row.
template <int ROWS, int W>
struct WgTileCopy {
  static constexpr int PER_ROW = W / 4, TPR = PER_ROW < 16 ? PER_ROW : 16, RP = 128 / TPR;
  static constexpr int NU = ROWS / RP, NV = PER_ROW / TPR;
  static_assert(RP % 8 == 0 && ROWS % RP == 0 && PER_ROW % TPR == 0 && TPR % 8 == 0, "copy shape");
  int src_row;  // sigma(n0): the source row of this thread's first row
  int src_col;  // 4 q0: its first float in a row
  unsigned dst;  // byte offset of (row n0, chunk q0) in the tile
  __device__ __forceinline__ WgTileCopy() {
    const int n0 = threadIdx.x / TPR, q0 = threadIdx.x % TPR;
    src_row = wg_row(n0);
    src_col = 4 * q0;
    dst = (q0 >> 3) * ROWS * 128 + n0 * 128 + (((q0 & 7) ^ (n0 & 7)) << 4);
  }
  // Copies rows from src (the tile's source row 0; row r at src + r * stride), zero-filling source
  // rows from `valid` on and columns from `cols` on (a multiple of 4; their copies read
  // `fallback`, a mapped address, and move no bytes).
  __device__ __forceinline__ void operator()(unsigned char* tile, const float* src, i64 stride, int valid,
                                             const float* fallback, int cols = W) const {
    const float* s0 = src + src_row * stride + src_col;
#pragma unroll
    for (int u = 0; u < NU; u++) {
#pragma unroll
      for (int v = 0; v < NV; v++) {
        const bool ok = src_row + RP * u < valid && src_col + v * 4 * TPR < cols;
        cp_async16(tile + dst + u * RP * 128 + v * (TPR / 8) * ROWS * 128,
                   ok ? s0 + RP * u * stride + v * 4 * TPR : fallback, ok);
      }
    }
  }
};

// B descriptor of k step kk (8 TF32 = 32 bytes) of a K-major tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ unsigned long long wg_desc(unsigned lo, int kk) {
  return smem_desc_of(lo + (((kk >> 2) * ROWS * 128 + (kk & 3) * 32) >> 4), 1024);
}

constexpr int WG_LDV = CHUNK + 8;  // V row stride: a warp's R reads (8 columns x 4 rows) hit 32 banks

// PAIR (gdn_chunk_scan_wg2_<DK>, without WS): two consumer warpgroups, one block per (sequence,
// value head, 128 value columns), warpgroup w taking columns 64w .. 64w + 64: the K, Q, K^T, T, P
// tiles and the gates of a chunk are copied once for both (by warpgroup 0; each copies its own V),
// so a short launch runs half as many blocks of one SM each. K and Q have one buffer (two would not
// fit beside a second V): the next chunk's are copied once every warp is past the first products,
// with its V. Each warpgroup's products are wg1's, in the same order: the same bits.
// LEAN (gdn_chunk_scan_wgl_<DK>, without WS and PAIR): wg1 in a third of its shared memory, so that
// two blocks share an SM: one K and one Q tile, and once a chunk's first products have read them,
// the chunk's T and P are copied over Q and its K^T over K. Nothing is copied ahead (each chunk
// waits for its K, Q, V and then its T, P, K^T), which costs little where a sequence has one or
// two chunks (the passes: nothing to run ahead of) and the other block on the SM computes while
// one waits. The same products in the same order on the same values as wg1: the same bits.
template <int DK, bool WS, bool PAIR = false, bool LEAN = false>
__device__ void chunk_scan_wg(const float* qn, const float* kn, const float* v, const float* beta, const float* g,
                              const float* tp, const float* ktg, const int* chunks, const i64* segs, int kh, int vh,
                              int dv, float* out) {
  extern __shared__ __align__(16) unsigned char smem_wg_raw[];
  // 1024-byte aligned by pointer arithmetic on the shared array, so the compiler keeps knowing
  // these are shared-memory addresses (LDS, not generic loads).
  unsigned char* base =
      smem_wg_raw + ((1024u - ((unsigned)__cvta_generic_to_shared(smem_wg_raw) & 1023u)) & 1023u);
  static_assert(!(PAIR && WS), "the paired form has no producer");
  static_assert(!(LEAN && (WS || PAIR)), "the lean form is wg1's");
  constexpr int QKB = CHUNK * DK * 4;        // bytes of one chunk's K (or Q)
  constexpr int NS = DK / 2;                 // state accumulators per thread
  constexpr int KQBUF = PAIR || LEAN ? 1 : 2;  // K, Q buffers
  constexpr int NWG = PAIR ? 2 : 1;          // consumer warpgroups
  constexpr int TPB = 2 * CHUNK * CHUNK * 4;  // T and P
  // LEAN: Q's buffer also holds T and P, so it is the larger of the two (layout::delta_wgl_smem_bytes).
  constexpr int QSLOT = LEAN && TPB > QKB ? TPB : QKB;
  unsigned char* KQ = base;                  // [KQBUF][K | Q]
  unsigned char* Ktb = LEAN ? KQ : KQ + 2 * KQBUF * QKB;  // K^T: DK rows x 64 (LEAN: over K)
  unsigned char* Tb = LEAN ? KQ + QKB : Ktb + QKB;         // T: 64 rows x 64 (LEAN: over Q)
  unsigned char* Pb = Tb + CHUNK * CHUNK * 4;
  float* Vs = (float*)(LEAN ? KQ + QKB + QSLOT : Pb + CHUNK * CHUNK * 4);  // [NWG][64][WG_LDV]
  float* gates = Vs + NWG * CHUNK * WG_LDV;      // [2][3][64]: e^gamma, decay factors, beta
  unsigned long long* bars = (unsigned long long*)(gates + 6 * CHUNK);
  unsigned long long *full_a = bars, *empty_a = bars + 2;  // [2] each: K, Q and the gates of a chunk
  unsigned long long *full_v = bars + 4, *empty_v = bars + 5, *full_b = bars + 6, *empty_b = bars + 7;
  const int wgi = PAIR ? (int)(threadIdx.x >> 7) : 0;  // this consumer warpgroup (PAIR)
  float* V = Vs + wgi * CHUNK * WG_LDV;                  // its V
  const int s = blockIdx.x, hv = blockIdx.y, c0 = PAIR ? blockIdx.z * 128 + 64 * wgi : blockIdx.z * 64;
  const int hk = hv / (vh / kh);
  // Who copies the shared tiles and writes the gates (PAIR: warpgroup 0, its warp 0).
  const bool copier = !PAIR || threadIdx.x < 128;
  const int first = (int)segs[4 * s], nch = (int)segs[4 * s + 1], end = first + nch;
  const int ncols = min(64, dv - c0);
  const i64 vrs = (i64)vh * dv;
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
  // The copies and the gates of one chunk, by the 128 threads of one warpgroup (the producer with
  // WS, else the consumers themselves between their products).
  const WgTileCopy<CHUNK, DK> kq_copy;
  const WgTileCopy<CHUNK, CHUNK> tp_copy;
  const WgTileCopy<DK, CHUNK> kt_copy;
  const int vq = 4 * (tid & 15), vi0 = tid >> 4;
  const i64 tstride = (i64)vh * 2 * CHUNK * CHUNK, kstride = (i64)kh * DK * CHUNK;
  const float* tph = tp + (i64)hv * 2 * CHUNK * CHUNK;
  const float* kth = ktg + (i64)hk * DK * CHUNK;
  auto copy_kq = [&](int b, int ck) {
    const i64 r0 = chunks[2 * ck];
    const int ln = chunks[2 * ck + 1];
    const i64 off = (r0 * kh + hk) * DK, rs = (i64)kh * DK;
    kq_copy(KQ + 2 * b * QKB, kn + off, rs, ln, kn + off);
    kq_copy(KQ + (2 * b + 1) * QKB, qn + off, rs, ln, qn + off);
  };
  // Warp 0 of the copying warpgroup only.
  auto write_gates = [&](int b, int ck) {
    const i64 r0 = chunks[2 * ck];
    const int ln = chunks[2 * ck + 1];
    const float g0 = lane < ln ? g[(r0 + lane) * vh + hv] : 0.f;
    const float g1 = lane + 32 < ln ? g[(r0 + lane + 32) * vh + hv] : 0.f;
    const float b0 = lane < ln ? beta[(r0 + lane) * vh + hv] : 0.f;
    const float b1 = lane + 32 < ln ? beta[(r0 + lane + 32) * vh + hv] : 0.f;
    chunk_gates_warp(gates + b * 3 * CHUNK, g0, g1, b0, b1, lane);
  };
  // v rows [64][WG_LDV], natural order: thread t copies chunk t % 16 of rows t / 16 + 8 u.
  auto copy_v = [&](int ck) {
    const i64 r0 = chunks[2 * ck];
    const int ln = chunks[2 * ck + 1];
    const float* s0 = v + (r0 + vi0) * vrs + hv * dv + c0 + vq;
    const bool col = vq < ncols;
#pragma unroll
    for (int u = 0; u < CHUNK / 8; u++) {
      const bool ok = col && vi0 + 8 * u < ln;
      cp_async16(V + (vi0 + 8 * u) * WG_LDV + vq, ok ? s0 + 8 * u * vrs : v, ok);
    }
  };
  // Only the part the prep wrote (rm_read_cols); the rest of each tile is zero-filled: T's and P's
  // rows past the chunk's length meet zero rows of R and are never stored, K^T's columns past it
  // are zeros anyway. A full chunk copies the whole tiles.
  auto copy_tpk = [&](int ck) {
    const float* t = tph + ck * tstride;
    const int ln = chunks[2 * ck + 1], cols = rm_read_cols(ln);
    tp_copy(Tb, t, CHUNK, ln, t, cols);
    tp_copy(Pb, t + CHUNK * CHUNK, CHUNK, ln, t, cols);
    kt_copy(Ktb, kth + ck * kstride, CHUNK, DK, t, cols);
  };
  if constexpr (WS) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2; i++) {
        mbar_init(full_a + i, 128 + 32);  // every producer thread's copies, and warp 0's gates
        mbar_init(empty_a + i, 4);        // one arrival per consumer warp
      }
      mbar_init(full_v, 128);
      mbar_init(empty_v, 4);
      mbar_init(full_b, 128);
      mbar_init(empty_b, 4);
    }
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
    if (wg == 0) {
      // ---- producer: every copy, and the gates (warp 0), one chunk ahead of the consumers (K, Q
      // and the gates two: they have two buffers); a stage is announced by its copies landing
      // (mbar_arrive_on_copies) and refilled once every consumer warp has released it.
      for (int ck = first; ck < end; ck++) {
        const int n = ck - first, b = n & 1;
        if (n >= 2) mbar_wait(empty_a + b, ((n >> 1) - 1) & 1);
        copy_kq(b, ck);
        mbar_arrive_on_copies(full_a + b);
        if (warp == 0) {
          write_gates(b, ck);
          mbar_arrive(full_a + b);
        }
        if (n >= 1) mbar_wait(empty_v, (n - 1) & 1);
        copy_v(ck);
        mbar_arrive_on_copies(full_v);
        if (n >= 1) mbar_wait(empty_b, (n - 1) & 1);
        copy_tpk(ck);
        mbar_arrive_on_copies(full_b);
      }
      // No thread may exit with copies in flight into shared memory that others read.
      cp_async_wait_all();
      return;
    }
  } else if constexpr (LEAN) {
    // K, Q, V and the gates of the first chunk; T, P and K^T once its first products are done.
    if (nch > 0) {
      copy_kq(0, first);
      copy_v(first);
    }
    cp_async_commit();
    if (nch > 0 && warp == 0) write_gates(0, first);
  } else {
    // One warpgroup copies between its products, cp.async groups committed by every thread in the
    // same order (empty when nothing is copied): {K,Q,V of the first chunk} {K^T,T,P of it}, then
    // per chunk c {K,Q of c+1} {V of c+1} {K^T,T,P of c+1}.
    if (nch > 0) {
      if (copier) copy_kq(0, first);
      copy_v(first);
    }
    cp_async_commit();
    if (nch > 0 && copier) copy_tpk(first);
    cp_async_commit();
    if (nch > 0 && copier && warp == 0) write_gates(0, first);
  }

  // ---- consumers: the products and the outputs, one warpgroup.
  const int gr = lane >> 2, tg = lane & 3;
  const float* state_in = (const float*)segs[4 * s + 2] + (i64)hv * DK * dv;
  float* state = scan_state_out<DK>(segs, s, hv, dv);
  const int cw = 16 * warp + gr;  // this thread's value columns: cw and cw + 8
  const unsigned kq_lo = smem_desc_lo(KQ, 16), kt_lo = smem_desc_lo(Ktb, 16), t_lo = smem_desc_lo(Tb, 16),
                 p_lo = smem_desc_lo(Pb, 16);
  auto release = [&](unsigned long long* bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // The state, transposed: sa[4j + e] is value column cw + 8 (e >> 1), key dim 8j + tg + 4 (e & 1).
  float sa[NS];
#pragma unroll
  for (int j = 0; j < NS / 4; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int c = cw + 8 * (e >> 1), d = 8 * j + tg + 4 * (e & 1);
      sa[4 * j + e] = c < ncols ? state_in[(i64)d * dv + c0 + c] : 0.f;
    }
  float x[32], y[32], vn[32];
#pragma unroll
  for (int e = 0; e < 32; e++) x[e] = y[e] = vn[e] = 0.f;
  for (int ck = first; ck < end; ck++) {
    const int n = ck - first, b = LEAN ? 0 : n & 1, kb = PAIR ? 0 : b;  // gates' buffer, K and Q's
    const i64 row0 = chunks[2 * ck];
    const int len = chunks[2 * ck + 1];
    const float* G = gates + b * 3 * CHUNK;
    const bool has_next = ck + 1 < end;
    if constexpr (WS) {
      mbar_wait(full_a + b, (n >> 1) & 1);  // K, Q and the gates of this chunk
      fence_proxy_async();
    } else if constexpr (LEAN) {
      cp_async_wait_group<0>();  // K, Q, V of this chunk
      fence_proxy_async();
      __syncthreads();  // ... and the gates, visible to all
    } else {
      cp_async_wait_group<1>();  // K, Q, V of this chunk (its K^T, T, P may still fly)
      fence_proxy_async();
      __syncthreads();  // ... visible to all; chunk ck-1 is done with buffer b^1 and the gates b^1
      if (!PAIR && has_next) copy_kq(b ^ 1, ck + 1);
      cp_async_commit();  // (PAIR: empty, so both forms count the same groups)
    }
    // X = S^T K^T and Y = S^T Q^T.
    {
      unsigned as[DK / 8][4];
#pragma unroll
      for (int kk = 0; kk < DK / 8; kk++) wg_a_frag(as[kk], sa, kk);
      const unsigned klo = kq_lo + ((2 * kb * QKB) >> 4), qlo = kq_lo + (((2 * kb + 1) * QKB) >> 4);
      fence_regs(as);
      fence_regs(x);
      fence_regs(y);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 8; kk++) wgmma_tf32_rs(x, as[kk], wg_desc<CHUNK>(klo, kk), kk > 0);
#pragma unroll
      for (int kk = 0; kk < DK / 8; kk++) wgmma_tf32_rs(y, as[kk], wg_desc<CHUNK>(qlo, kk), kk > 0);
      wgmma_commit();
      wgmma_wait0();
      fence_regs(x);
      fence_regs(y);
    }
    if constexpr (LEAN) {
      __syncthreads();  // every warp's X and Y are done with K and Q: K^T over K, T and P over Q
      copy_tpk(ck);
      cp_async_commit();
    }
    // R^T = beta (V^T - e^gamma X) in place of X (Y is scaled by e^gamma after Vn).
    if constexpr (WS) mbar_wait(full_v, n & 1);
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = 8 * j + tg + 4 * (e & 1), c = cw + 8 * (e >> 1);
        x[4 * j + e] = G[2 * CHUNK + i] * (V[i * WG_LDV + c] - G[i] * x[4 * j + e]);
      }
    if constexpr (WS) {
      release(empty_v);
      mbar_wait(full_b, n & 1);  // K^T, T and P of this chunk
      fence_proxy_async();
    } else if constexpr (LEAN) {
      cp_async_wait_group<0>();  // K^T, T and P of this chunk
      fence_proxy_async();
      __syncthreads();
    } else {
      __syncthreads();  // every thread is done with V (and warp 0 may overwrite the gates b^1; PAIR:
                        // with K and Q, read by the first products)
      if (has_next) {
        if (PAIR && copier) copy_kq(0, ck + 1);
        copy_v(ck + 1);
      }
      cp_async_commit();
      if (has_next && copier && warp == 0) write_gates(b ^ 1, ck + 1);
      cp_async_wait_group<2>();  // K^T, T, P of this chunk
      fence_proxy_async();
      __syncthreads();
    }
    // Vn^T = R^T T^T.
    {
      unsigned ar[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; kk++) wg_a_frag(ar[kk], x, kk);
      fence_regs(ar);
      fence_regs(vn);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; kk++) wgmma_tf32_rs(vn, ar[kk], wg_desc<CHUNK>(t_lo, kk), kk > 0);
      wgmma_commit();
      wgmma_wait0();
      fence_regs(vn);
    }
    // Y *= e^gamma.
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) y[4 * j + e] *= G[8 * j + tg + 4 * (e & 1)];
    // O^T = Y + Vn^T P^T; S^T <- e^{gamma_last} S^T + (fac Vn)^T K. Also after the last chunk of a
    // state nobody reads: skipping it behind a branch made ptxas serialise every MMA of the stage.
    {
      unsigned av[8][4], af[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; kk++) {
        wg_a_frag(av[kk], vn, kk);
        float f[4];
#pragma unroll
        for (int e = 0; e < 4; e++) f[e] = vn[4 * kk + e] * G[CHUNK + 8 * kk + tg + 4 * (e & 1)];
        af[kk][0] = tf32_operand(f[0]);
        af[kk][1] = tf32_operand(f[2]);
        af[kk][2] = tf32_operand(f[1]);
        af[kk][3] = tf32_operand(f[3]);
      }
      const float el = G[CHUNK - 1];
#pragma unroll
      for (int e = 0; e < NS; e++) sa[e] *= el;
      fence_regs(av);
      fence_regs(af);
      fence_regs(y);
      fence_regs(sa);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; kk++) wgmma_tf32_rs(y, av[kk], wg_desc<CHUNK>(p_lo, kk), 1);
#pragma unroll
      for (int kk = 0; kk < 8; kk++) wgmma_tf32_rs(sa, af[kk], wg_desc<DK>(kt_lo, kk), 1);
      wgmma_commit();
      wgmma_wait0();
      fence_regs(y);
      fence_regs(sa);
    }
    if constexpr (WS) {
      release(empty_b);
      release(empty_a + b);  // K and Q were read by the first products, the gates up to here
    } else if constexpr (LEAN) {
      __syncthreads();  // every warp is done with K^T, T, P, V and the gates
      if (has_next) {
        copy_kq(0, ck + 1);
        copy_v(ck + 1);
      }
      cp_async_commit();
      if (has_next && warp == 0) write_gates(0, ck + 1);
    } else {
      __syncthreads();  // every warp's products are done with K^T, T and P
      if (has_next && copier) copy_tpk(ck + 1);
      cp_async_commit();
    }
    {
      // Row i = 8j + tg + 4 (e & 1), column cw + 8 (e >> 1): a per-thread base plus steps.
      float* o0 = out + (row0 + tg) * vrs + hv * dv + c0 + cw;
      const bool c_in0 = cw < ncols, c_in1 = cw + 8 < ncols;
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int di = 8 * j + 4 * (e & 1);
          if (tg + di < len && (e >> 1 ? c_in1 : c_in0)) o0[di * vrs + 8 * (e >> 1)] = y[4 * j + e];
        }
    }
  }
  if constexpr (!WS) cp_async_wait_group<0>();  // nothing may be in flight into shared memory at exit
  if (state != nullptr) {
#pragma unroll
    for (int j = 0; j < NS / 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int c = cw + 8 * (e >> 1), d = 8 * j + tg + 4 * (e & 1);
        if (c < ncols) state[(i64)d * dv + c0 + c] = sa[4 * j + e];
      }
  }
}
#endif  // IMAJEV_WGMMA

// Entries exist on every architecture (the kernel table loads them by name); off Hopper they do
// nothing, and the host only launches them on sm_90.
#ifdef IMAJEV_WGMMA
#define SCAN_WG_BODY(DK, WS, PAIR, LEAN) \
  chunk_scan_wg<DK, WS, PAIR, LEAN>(qn, kn, v, beta, g, tp, kt, chunks, segs, kh, vh, dv, out);
#else
#define SCAN_WG_BODY(DK, WS, PAIR, LEAN)
#endif
// gdn_chunk_scan_wg_<DK>: the producer warpgroup and the consumer warpgroup (256 threads);
// gdn_chunk_scan_wg1_<DK>: one warpgroup that copies between its products (128 threads), for short
// launches (the same products in the same order on the same values: the same bits);
// gdn_chunk_scan_wg2_<DK>: two such warpgroups sharing a (sequence, head)'s tiles (PAIR above);
// gdn_chunk_scan_wgl_<DK>: wg1 in a third of the shared memory, two blocks an SM (LEAN above).
#define SCAN_WG_ENTRY(NAME, DK, WS, PAIR, LEAN, THREADS, MINB)                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB)                                                \
      NAME(const float* qn, const float* kn, const float* v, const float* beta, const float* g,              \
           const float* tp, const float* kt, const int* chunks, const i64* segs, int kh, int vh, int dv,     \
           float* out) {                                                                                     \
    pdl_begin();                                                                                             \
    SCAN_WG_BODY(DK, WS, PAIR, LEAN)                                                                         \
  }
SCAN_WG_ENTRY(gdn_chunk_scan_wg_32, 32, true, false, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg_64, 64, true, false, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg_128, 128, true, false, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg1_32, 32, false, false, false, 128, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg1_64, 64, false, false, false, 128, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg1_128, 128, false, false, false, 128, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg2_32, 32, false, true, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg2_64, 64, false, true, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wg2_128, 128, false, true, false, 256, 1)
SCAN_WG_ENTRY(gdn_chunk_scan_wgl_32, 32, false, false, true, 128, 2)
SCAN_WG_ENTRY(gdn_chunk_scan_wgl_64, 64, false, false, true, 128, 2)
SCAN_WG_ENTRY(gdn_chunk_scan_wgl_128, 128, false, false, true, 128, 2)
