// BF16 GEMMs with one narrow dimension, on our own kernels instead of cuBLASLt. Rust binding:
// src/backend/cuda/narrow.rs. CPU twin: cpu::linear::matmul_xwt (src/backend/cpu/linear.rs).
//   * gemm_narrow_<NP>: Y[m, 0..n) = alpha · X[m, k] · W[n, k]^T with n <= 128 (the DeltaNet a/b
//     projections, n = 64 or 32, and every LoRA A, n = the rank);
//   * gemm_narrow_k_acc: Y[m, 0..n) += alpha · X[m, k] · W[n, k]^T with k <= 256 (every LoRA B:
//     k = the rank, n = the projection's adapted columns).
//
// Why not cuBLASLt: batch invariance fixes one algorithm per shape, and for narrow outputs it is
// chosen at a small M (split K, so a 256-token request fills the GPU). At M = 47.7K that
// algorithm ran 2.8 ms per call for 16 GFLOP (~6 TFLOP/s, NOTES), and no one algorithm is good at
// both ends. Here the split is a function of K only: split s covers columns [s·KS, (s+1)·KS) of
// K, each split's block walks its columns in order with f32 MMA accumulation, and the splits are
// added in order s = 0, 1, .... A row's result therefore depends on nothing
// but its own X row and W — not on M, on which block it sits in, or on what else is in the batch.
// The LoRA B side is bound by reading and writing Y (its arithmetic is tiny); cuBLASLt's
// accumulating GEMM ran it at about half the copy rate (NOTES), gemm_narrow_k_acc reads each Y
// element once and writes it once, the rank's products in registers, no split.
// Measured since (bench/NOTES.md, 2026-12-04): cuBLASLt's plans, now fixed at 4,096 rows, hold to
// 65,536 rows bitwise and were faster in whole requests; these kernels are opt-in
// (IMAJEV_NARROW_GEMM), kept for comparisons.
//
// Layout: a block of 4 warps owns 64 rows x all n (<= NP) columns; warp w owns rows 16w..16w+15
// (mma.sync m16n8k16, NP/8 accumulator tiles of 4 floats per thread). X and W tiles of 32
// columns go through 3 shared-memory stages with cp.async (rows of 40 bf16 = 80 bytes: the 8 row
// addresses of an ldmatrix fall in 8 distinct 4-bank groups, no conflicts). Rows past m and
// weight rows past n are zero-filled, never read from memory. The host requires k % 32 == 0,
// n % 8 == 0 and 16-byte aligned rows of X and W (else cuBLASLt runs the GEMM).
// Two launch shapes, the same arithmetic (a row's bits are the same in both):
//   * split (gemm_narrow_<NP>, short M: enough blocks to fill the GPU): block (row block, split s)
//     computes split s alone and writes its f32 partial part[s][m][n]; gemm_narrow_sum then adds
//     the splits in order 0 + p0 + p1 + ... and writes Y;
//   * whole (gemm_narrow_whole_<NP>, tall M: the row blocks alone fill the GPU, and the partials
//     would double the bytes moved): one block walks every split of its rows in order, each split
//     accumulated from zero as above, and adds it to a running total 0 + p0 + p1 + ... in registers.
// With one split both shapes are the whole one (the host launches it).

constexpr int NARROW_KS = 256;  // columns of K per split (src/backend/cuda/narrow.rs: KSPLIT)
constexpr int NARROW_BM = 64;   // rows per block
constexpr int NARROW_KC = 32;   // columns per shared-memory stage
constexpr int NARROW_LD = NARROW_KC + 8;
constexpr int NARROW_STAGES = 3;  // 3 x (64 + 128) rows x 80 bytes = 46,080 bytes at NP = 128

__device__ __forceinline__ void narrow_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void narrow_ldmatrix_x4(unsigned* r, const bf16* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// The copies of one stage: X rows row0.. (64 x 32) and W rows 0..NP (NP x 32), columns c0...
// Zero-filled copies still name a valid address (the operand's base).
template <int NP>
__device__ __forceinline__ void narrow_stage(bf16* xs, bf16* ws, const bf16* x, i64 ldx, const bf16* w, i64 ldw,
                                             i64 row0, i64 m, int n, int c0) {
  constexpr int CH = NARROW_KC / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < NARROW_BM * CH; i += blockDim.x) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = row0 + r < m;
    cp_async16(xs + r * NARROW_LD + c, ok ? x + (row0 + r) * ldx + c0 + c : x, ok);
  }
  for (int i = threadIdx.x; i < NP * CH; i += blockDim.x) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = r < n;
    cp_async16(ws + r * NARROW_LD + c, ok ? w + (i64)r * ldw + c0 + c : w, ok);
  }
}

// acc += X[rows of this block, k0..k1) · W[0..NP, k0..k1)^T, the columns in 32-column stages in
// order (stages c + 1 and c + 2 in flight while stage c is multiplied: one commit group per stage,
// empty past the last, so that "wait until one group is pending" always means stage c landed).
template <int NP>
__device__ __forceinline__ void narrow_columns(float (*acc)[4], bf16 (*xs)[NARROW_BM * NARROW_LD],
                                               bf16 (*ws)[NP * NARROW_LD], const bf16* x, i64 ldx, const bf16* w,
                                               i64 ldw, i64 row0, i64 m, int n, int k0, int k1) {
  constexpr int NT = NP / 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = (k1 - k0) / NARROW_KC;
#pragma unroll
  for (int c = 0; c < NARROW_STAGES - 1; c++) {
    if (c < chunks) narrow_stage<NP>(xs[c], ws[c], x, ldx, w, ldw, row0, m, n, k0 + c * NARROW_KC);
    cp_async_commit();
  }
  for (int c = 0; c < chunks; c++) {
    cp_async_wait_group<NARROW_STAGES - 2>();
    __syncthreads();  // stage c landed for every thread, and stage c - 1's buffer is free
    const int next = c + NARROW_STAGES - 1;
    if (next < chunks) {
      const int nb = next % NARROW_STAGES;
      narrow_stage<NP>(xs[nb], ws[nb], x, ldx, w, ldw, row0, m, n, k0 + next * NARROW_KC);
    }
    cp_async_commit();
    const int buf = c % NARROW_STAGES;
#pragma unroll
    for (int kk = 0; kk < NARROW_KC / 16; kk++) {
      unsigned a[4];
      // Lanes 0-15: rows 0-15 at column 0 of the k16 slice; lanes 16-31: the same rows at 8.
      narrow_ldmatrix_x4(a, xs[buf] + (warp * 16 + (lane & 15)) * NARROW_LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        // Two n8 tiles: lanes 0-7 / 8-15 rows 8j.. at columns 0 / 8, lanes 16-23 / 24-31 rows 8j+8..
        unsigned b[4];
        narrow_ldmatrix_x4(b, ws[buf] + (8 * j + (lane & 7) + ((lane >> 4) << 3)) * NARROW_LD + kk * 16 +
                                  ((lane >> 3) & 1) * 8);
        narrow_mma(acc[j], a, b[0], b[1]);
        narrow_mma(acc[j + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait_group<0>();
  __syncthreads();  // every warp is done with the stages before the next split refills them
}

// gemm_narrow_sum: Y[r, c..c+4) = bf16(alpha · (0 + p0 + p1 + ...)) for every row r and column
// quad c of a split GEMM, the splits added in order; one thread per quad. Its own launch over all
// rows at once: summed inside the split kernel by the last block of each row block to finish, the
// 64 rows x n x splits partials went through one block's 128 threads with a few loads in flight
// each (the 977-row GEMM took 18 us there, cuBLASLt 12: bench/NOTES.md). Eight splits' loads are
// issued before their adds (predicated past the last split: only splits are added, so the sum is
// the same bits).
extern "C" __global__ void __launch_bounds__(256) gemm_narrow_sum(const float* part, int splits, i64 m, int n,
                                                                  float alpha, bf16* y, i64 ldy) {
  pdl_begin();
  const int quads = n / 4;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m * quads) return;
  const i64 r = i / quads;
  const int c = (int)(i % quads) * 4;
  const i64 stride = m * n;
  const float* p = part + r * n + c;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int at = 0; at < splits; at += 8) {
    float4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++)
      if (at + u < splits) v[u] = __ldg((const float4*)(p + (at + u) * stride));
#pragma unroll
    for (int u = 0; u < 8; u++) {
      if (at + u < splits) {
        s.x += v[u].x;
        s.y += v[u].y;
        s.z += v[u].z;
        s.w += v[u].w;
      }
    }
  }
  *(__nv_bfloat162*)(y + r * ldy + c) = __floats2bfloat162_rn(alpha * s.x, alpha * s.y);
  *(__nv_bfloat162*)(y + r * ldy + c + 2) = __floats2bfloat162_rn(alpha * s.z, alpha * s.w);
}

// One split per block (the split shape above).
template <int NP>
__device__ void gemm_narrow(const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float* part) {
  constexpr int NT = NP / 8;
  __shared__ __align__(16) bf16 xs[NARROW_STAGES][NARROW_BM * NARROW_LD];
  __shared__ __align__(16) bf16 ws[NARROW_STAGES][NP * NARROW_LD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const i64 row0 = (i64)blockIdx.x * NARROW_BM;
  const int split = blockIdx.y, k0 = split * NARROW_KS, k1 = min(k, k0 + NARROW_KS);

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  narrow_columns<NP>(acc, xs, ws, x, ldx, w, ldw, row0, m, n, k0, k1);

  const i64 ra = row0 + warp * 16 + gr, rb = ra + 8;
  float* p = part + (i64)split * m * n;
#pragma unroll
  for (int j = 0; j < NT; j++) {
    const int col = 8 * j + 2 * tg;
    if (col >= n) continue;
    if (ra < m) *(float2*)(p + ra * n + col) = make_float2(acc[j][0], acc[j][1]);
    if (rb < m) *(float2*)(p + rb * n + col) = make_float2(acc[j][2], acc[j][3]);
  }
}

// Every split of a row block in one block, summed in registers (the whole shape above).
template <int NP>
__device__ void gemm_narrow_whole(const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float alpha,
                                  bf16* y, i64 ldy) {
  constexpr int NT = NP / 8;
  __shared__ __align__(16) bf16 xs[NARROW_STAGES][NARROW_BM * NARROW_LD];
  __shared__ __align__(16) bf16 ws[NARROW_STAGES][NP * NARROW_LD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const i64 row0 = (i64)blockIdx.x * NARROW_BM;

  float total[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) total[j][0] = total[j][1] = total[j][2] = total[j][3] = 0.f;
  for (int k0 = 0; k0 < k; k0 += NARROW_KS) {
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    narrow_columns<NP>(acc, xs, ws, x, ldx, w, ldw, row0, m, n, k0, min(k, k0 + NARROW_KS));
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) total[j][e] += acc[j][e];
  }

  const i64 ra = row0 + warp * 16 + gr, rb = ra + 8;
#pragma unroll
  for (int j = 0; j < NT; j++) {
    const int col = 8 * j + 2 * tg;
    if (col >= n) continue;
    if (ra < m)
      *(__nv_bfloat162*)(y + ra * ldy + col) = __floats2bfloat162_rn(alpha * total[j][0], alpha * total[j][1]);
    if (rb < m)
      *(__nv_bfloat162*)(y + rb * ldy + col) = __floats2bfloat162_rn(alpha * total[j][2], alpha * total[j][3]);
  }
}

#define NARROW_ENTRY(NP)                                                                                      \
  extern "C" __global__ void __launch_bounds__(128)                                                           \
      gemm_narrow_##NP(const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float* part) {    \
    pdl_begin();                                                                                              \
    gemm_narrow<NP>(x, ldx, w, ldw, m, n, k, part);                                                           \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(128) gemm_narrow_whole_##NP(                                   \
      const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float alpha, bf16* y, i64 ldy) {   \
    pdl_begin();                                                                                              \
    gemm_narrow_whole<NP>(x, ldx, w, ldw, m, n, k, alpha, y, ldy);                                            \
  }
NARROW_ENTRY(32)
NARROW_ENTRY(64)
NARROW_ENTRY(128)

// gemm_narrow_k_acc: Y[r, c] = bf16(Y[r, c] + alpha · sum over j < k of X[r, j] · W[c, j]), as
// cuBLASLt's beta = 1 GEMM, for k <= 256. A block of 8 warps owns a 128 x 128 tile of Y; warp w
// owns rows 32·(w % 4).. and columns 64·(w / 4).. (2 x 8 accumulator tiles of m16n8). K goes in
// 32-column stages, two buffers (the next stage's copies in flight while this one multiplies).
// The Y tile is copied into shared memory with 16-byte cp.async under the first stage's
// multiplies (coalesced, and in flight while the tensor cores work: an epilogue that loads its
// pairs of Y from global memory waits for each load in turn); the epilogue adds in shared memory
// and the tile goes back with 16-byte stores. Every element of Y is read once and written once.
// The host requires Y 16-byte aligned with ldy % 8 == 0 (n % 8 == 0: a 16-byte chunk of a row is
// all inside n or all outside). Grid (ceil(n / 128), ceil(m / 128)); dynamic shared memory
// NK_SMEM_BYTES (src/backend/cuda/narrow.rs: ACC_SMEM_BYTES).
constexpr int NK_BM = 128, NK_BN = 128;
constexpr int NK_LDY = NK_BN + 8;  // 272-byte rows: a warp's pairs (8 rows x 4) hit 32 banks
constexpr int NK_SMEM_BYTES = (2 * (NK_BM + NK_BN) * NARROW_LD + NK_BM * NK_LDY) * 2;  // 75,776

template <int ROWS>
__device__ __forceinline__ void narrow_k_rows(bf16* dst, const bf16* src, i64 ld, i64 first, i64 limit, int c0) {
  constexpr int CH = NARROW_KC / 8;
  for (int i = threadIdx.x; i < ROWS * CH; i += blockDim.x) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = first + r < limit;
    cp_async16(dst + r * NARROW_LD + c, ok ? src + (first + r) * ld + c0 + c : src, ok);
  }
}

extern "C" __global__ void __launch_bounds__(256, 2) gemm_narrow_k_acc(const bf16* x, i64 ldx, const bf16* w, i64 ldw,
                                                                       i64 m, int n, int k, float alpha, bf16* y,
                                                                       i64 ldy) {
  pdl_begin();
  extern __shared__ __align__(16) unsigned char smem_nk[];
  bf16(*xs)[NK_BM * NARROW_LD] = reinterpret_cast<bf16(*)[NK_BM * NARROW_LD]>(smem_nk);
  bf16(*ws)[NK_BN * NARROW_LD] = reinterpret_cast<bf16(*)[NK_BN * NARROW_LD]>(xs + 2);
  bf16* ys = reinterpret_cast<bf16*>(ws + 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;
  const i64 row0 = (i64)blockIdx.y * NK_BM;
  const int col0 = blockIdx.x * NK_BN;
  const int chunks = k / NARROW_KC;
  constexpr int YCH = NK_BN / 8;  // 16-byte chunks per row of the Y tile

  float acc[2][8][4];
#pragma unroll
  for (int a = 0; a < 2; a++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[a][j][0] = acc[a][j][1] = acc[a][j][2] = acc[a][j][3] = 0.f;

  narrow_k_rows<NK_BM>(xs[0], x, ldx, row0, m, 0);
  narrow_k_rows<NK_BN>(ws[0], w, ldw, col0, n, 0);
  cp_async_commit();
  for (int c = 0; c < chunks; c++) {
    if (c + 1 < chunks) {
      narrow_k_rows<NK_BM>(xs[(c + 1) & 1], x, ldx, row0, m, (c + 1) * NARROW_KC);
      narrow_k_rows<NK_BN>(ws[(c + 1) & 1], w, ldw, col0, n, (c + 1) * NARROW_KC);
    }
    if (c == 0) {
      // The Y tile, in the same group as stage 1 (waited for at the latest after the loop).
      for (int i = threadIdx.x; i < NK_BM * YCH; i += blockDim.x) {
        const int r = i / YCH, cc = (i % YCH) * 8;
        const bool ok = row0 + r < m && col0 + cc < n;
        cp_async16(ys + r * NK_LDY + cc, ok ? y + (row0 + r) * ldy + col0 + cc : y, ok);
      }
    }
    cp_async_commit();
    cp_async_wait_group<1>();
    __syncthreads();  // stage c landed for every thread
    const bf16* xb = xs[c & 1];
    const bf16* wb = ws[c & 1];
#pragma unroll
    for (int kk = 0; kk < NARROW_KC / 16; kk++) {
      unsigned a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
        narrow_ldmatrix_x4(a[mt], xb + (wm * 32 + mt * 16 + (lane & 15)) * NARROW_LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        unsigned b[4];
        narrow_ldmatrix_x4(b, wb + (wn * 64 + 8 * j + (lane & 7) + ((lane >> 4) << 3)) * NARROW_LD + kk * 16 +
                                  ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          narrow_mma(acc[mt][j], a[mt], b[0], b[1]);
          narrow_mma(acc[mt][j + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with buffer c & 1 before stage c + 2 refills it
  }
  cp_async_wait_group<0>();
  __syncthreads();  // the Y tile landed for every thread

  // Each thread's pairs: old + alpha·acc, rounded once, in place (each pair has one owner).
#pragma unroll
  for (int mt = 0; mt < 2; mt++) {
    const int ra = wm * 32 + mt * 16 + gr;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int col = wn * 64 + 8 * j + 2 * tg;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        __nv_bfloat162* p = (__nv_bfloat162*)(ys + (ra + 8 * h) * NK_LDY + col);
        const float2 old = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(old.x + alpha * acc[mt][j][2 * h], old.y + alpha * acc[mt][j][2 * h + 1]);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NK_BM * YCH; i += blockDim.x) {
    const int r = i / YCH, cc = (i % YCH) * 8;
    if (row0 + r < m && col0 + cc < n) *(uint4*)(y + (row0 + r) * ldy + col0 + cc) = *(const uint4*)(ys + r * NK_LDY + cc);
  }
}
