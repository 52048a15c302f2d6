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
//
// Layout: a block of 4 warps owns 64 rows x all n (<= NP) columns of one split; warp w owns rows
// 16w..16w+15 (mma.sync m16n8k16, NP/8 accumulator tiles of 4 floats per thread). X and W tiles
// of 32 columns go through 3 shared-memory stages with cp.async (rows of 40 bf16 = 80 bytes:
// the 8 row addresses of an ldmatrix fall in 8 distinct 4-bank groups, no conflicts). Rows past m
// and weight rows past n are zero-filled, never read from memory. The host requires k % 32 == 0,
// n % 8 == 0 and 16-byte aligned rows of X and W (else cuBLASLt runs the GEMM).
// Output: one split (k <= KS) writes bf16 to Y directly; otherwise each split writes f32 partials
// part[s][m][n], and the last split block of a row block to finish (an arrival counter per row
// block, arrivals[blockIdx.x]: a counter, not a reduction, so nothing about the sum depends on
// who arrives last) adds the splits in order s = 0, 1, ... and writes Y, then zeroes its counter
// for the next GEMM (the host keeps 8,192 counters, zero between GEMMs, and sends taller GEMMs to
// cuBLASLt).

constexpr int NARROW_KS = 512;  // columns of K per split (src/backend/cuda/narrow.rs: KSPLIT)
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

__device__ __forceinline__ void narrow_cp16(bf16* dst, const bf16* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
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
    narrow_cp16(xs + r * NARROW_LD + c, ok ? x + (row0 + r) * ldx + c0 + c : x, ok);
  }
  for (int i = threadIdx.x; i < NP * CH; i += blockDim.x) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = r < n;
    narrow_cp16(ws + r * NARROW_LD + c, ok ? w + (i64)r * ldw + c0 + c : w, ok);
  }
}

// The sum of the splits of rows r0.. (`rows` of them) in order, scaled and rounded into Y. Reads
// through L2 (__ldcg): the partials were written by other blocks.
__device__ __forceinline__ void narrow_sum_splits(const float* part, int splits, i64 m, int n, float alpha, bf16* y,
                                                  i64 ldy, i64 r0, int rows) {
  const int half = n / 2;
  for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
    const i64 r = r0 + i / half;
    const int c = (i % half) * 2;
    float s0 = 0.f, s1 = 0.f;
    for (int s = 0; s < splits; s++) {
      const float2 v = __ldcg((const float2*)(part + ((i64)s * m + r) * n + c));
      s0 += v.x;
      s1 += v.y;
    }
    *(__nv_bfloat162*)(y + r * ldy + c) = __floats2bfloat162_rn(alpha * s0, alpha * s1);
  }
}

template <int NP>
__device__ void gemm_narrow(const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float alpha,
                            bf16* y, i64 ldy, float* part, unsigned* arrivals) {
  constexpr int NT = NP / 8;
  __shared__ __align__(16) bf16 xs[NARROW_STAGES][NARROW_BM * NARROW_LD];
  __shared__ __align__(16) bf16 ws[NARROW_STAGES][NP * NARROW_LD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const i64 row0 = (i64)blockIdx.x * NARROW_BM;
  const int split = blockIdx.y, k0 = split * NARROW_KS, k1 = min(k, k0 + NARROW_KS);
  const int chunks = (k1 - k0) / NARROW_KC;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // Stages c + 1 and c + 2 are in flight while stage c is multiplied (one commit group per stage,
  // empty past the last, so that "wait until one group is pending" always means stage c landed).
#pragma unroll
  for (int c = 0; c < NARROW_STAGES - 1; c++) {
    if (c < chunks) narrow_stage<NP>(xs[c], ws[c], x, ldx, w, ldw, row0, m, n, k0 + c * NARROW_KC);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int c = 0; c < chunks; c++) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NARROW_STAGES - 2) : "memory");
    __syncthreads();  // stage c landed for every thread, and stage c - 1's buffer is free
    const int next = c + NARROW_STAGES - 1;
    if (next < chunks) {
      const int nb = next % NARROW_STAGES;
      narrow_stage<NP>(xs[nb], ws[nb], x, ldx, w, ldw, row0, m, n, k0 + next * NARROW_KC);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
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
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  const i64 ra = row0 + warp * 16 + gr, rb = ra + 8;
#pragma unroll
  for (int j = 0; j < NT; j++) {
    const int col = 8 * j + 2 * tg;
    if (col >= n) continue;
    if (gridDim.y == 1) {
      if (ra < m) *(__nv_bfloat162*)(y + ra * ldy + col) = __floats2bfloat162_rn(alpha * acc[j][0], alpha * acc[j][1]);
      if (rb < m) *(__nv_bfloat162*)(y + rb * ldy + col) = __floats2bfloat162_rn(alpha * acc[j][2], alpha * acc[j][3]);
    } else {
      float* p = part + (i64)split * m * n;
      if (ra < m) *(float2*)(p + ra * n + col) = make_float2(acc[j][0], acc[j][1]);
      if (rb < m) *(float2*)(p + rb * n + col) = make_float2(acc[j][2], acc[j][3]);
    }
  }
  if (gridDim.y == 1) return;
  // Release this block's partials, count it in; the last of the row block's splits sums them.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(arrivals + blockIdx.x, 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  narrow_sum_splits(part, gridDim.y, m, n, alpha, y, ldy, row0, (int)min((i64)NARROW_BM, m - row0));
  if (threadIdx.x == 0) arrivals[blockIdx.x] = 0u;
}

#define NARROW_ENTRY(NP)                                                                                      \
  extern "C" __global__ void __launch_bounds__(128) gemm_narrow_##NP(                                         \
      const bf16* x, i64 ldx, const bf16* w, i64 ldw, i64 m, int n, int k, float alpha, bf16* y, i64 ldy,     \
      float* part, unsigned* arrivals) {                                                                      \
    gemm_narrow<NP>(x, ldx, w, ldw, m, n, k, alpha, y, ldy, part, arrivals);                                  \
  }
NARROW_ENTRY(32)
NARROW_ENTRY(64)
NARROW_ENTRY(128)

// gemm_narrow_k_acc: Y[r, c] = bf16(Y[r, c] + alpha · sum over j < k of X[r, j] · W[c, j]), as
// cuBLASLt's beta = 1 GEMM, for k <= 256. A block of 8 warps owns a 128 x 128 tile of Y; warp w
// owns rows 32·(w % 4).. and columns 64·(w / 4).. (2 x 8 accumulator tiles of m16n8). K goes in
// 32-column stages, two buffers (the next stage's copies in flight while this one multiplies).
// The epilogue reads each Y pair this thread owns, adds, rounds and writes it back: every element
// of Y is read once and written once. Grid (ceil(n / 128), ceil(m / 128)).
constexpr int NK_BM = 128, NK_BN = 128;

template <int ROWS>
__device__ __forceinline__ void narrow_k_rows(bf16* dst, const bf16* src, i64 ld, i64 first, i64 limit, int c0) {
  constexpr int CH = NARROW_KC / 8;
  for (int i = threadIdx.x; i < ROWS * CH; i += blockDim.x) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = first + r < limit;
    narrow_cp16(dst + r * NARROW_LD + c, ok ? src + (first + r) * ld + c0 + c : src, ok);
  }
}

extern "C" __global__ void __launch_bounds__(256, 2) gemm_narrow_k_acc(const bf16* x, i64 ldx, const bf16* w, i64 ldw,
                                                                       i64 m, int n, int k, float alpha, bf16* y,
                                                                       i64 ldy) {
  __shared__ __align__(16) bf16 xs[2][NK_BM * NARROW_LD];
  __shared__ __align__(16) bf16 ws[2][NK_BN * NARROW_LD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;
  const i64 row0 = (i64)blockIdx.y * NK_BM;
  const int col0 = blockIdx.x * NK_BN;
  const int chunks = k / NARROW_KC;

  float acc[2][8][4];
#pragma unroll
  for (int a = 0; a < 2; a++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[a][j][0] = acc[a][j][1] = acc[a][j][2] = acc[a][j][3] = 0.f;

  narrow_k_rows<NK_BM>(xs[0], x, ldx, row0, m, 0);
  narrow_k_rows<NK_BN>(ws[0], w, ldw, col0, n, 0);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  for (int c = 0; c < chunks; c++) {
    if (c + 1 < chunks) {
      narrow_k_rows<NK_BM>(xs[(c + 1) & 1], x, ldx, row0, m, (c + 1) * NARROW_KC);
      narrow_k_rows<NK_BN>(ws[(c + 1) & 1], w, ldw, col0, n, (c + 1) * NARROW_KC);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
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

#pragma unroll
  for (int mt = 0; mt < 2; mt++) {
    const i64 ra = row0 + wm * 32 + mt * 16 + gr, rb = ra + 8;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int col = col0 + wn * 64 + 8 * j + 2 * tg;
      if (col >= n) continue;  // n % 8 == 0: col + 1 < n whenever col < n
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const i64 r = h == 0 ? ra : rb;
        if (r >= m) continue;
        __nv_bfloat162* p = (__nv_bfloat162*)(y + r * ldy + col);
        const float2 old = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(old.x + alpha * acc[mt][j][2 * h], old.y + alpha * acc[mt][j][2 * h + 1]);
      }
    }
  }
}
