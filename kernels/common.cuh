// Helpers shared by every kernel in this folder. The loader (src/backend/cuda/compile.rs)
// prepends this file to each .cu source before NVRTC compiles it for the running GPU.
//
// Conventions: activations are bf16, every reduction and every nonlinearity runs in f32, and a
// value is rounded to bf16 once, when it is stored. Pointers that the host passes as raw device
// addresses (u64) arrive here as ordinary pointers.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

// Every kernel's first statement (a unit test in compile.rs holds every entry to it). With
// programmatic dependent launch (`IMAJEV_PDL=1`, sm_90) the host lets each kernel launch before the
// previous one in the stream has finished, so its launch and block scheduling overlap that
// kernel's last wave: `griddepcontrol.wait` then blocks until the previous grid has completed and
// its writes are visible — nothing is read or written before — and `launch_dependents` lets the
// next kernel launch as soon as this grid's blocks are all running. Launched without the
// attribute, both are no-ops; off sm_90 they are not compiled.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)gridDim.x * blockDim.x)

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16(x); }  // round to nearest even

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
// PyTorch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
// GELU: tanh_mode 1 = gelu_pytorch_tanh, 0 = the exact erf GELU (elementwise gelu, gelu_quant_1x128).
__device__ __forceinline__ float gelu_f(float v, int tanh_mode) {
  if (tanh_mode) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * v * (1.f + tanhf(c * (v + 0.044715f * v * v * v)));
  }
  return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the
// same value; the reduction order depends only on blockDim, never on the data or the batch.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : 0.f;
  return warp_sum(t);
}

// The entry of a segment table whose rows hold row t, or -1: `segs` holds `nseg` entries of
// STRIDE i64s, each starting [first row, row count, ...], ascending and disjoint (empty entries
// allowed). A binary search for the last entry starting at or before t: a packed round has ~100
// sequences and the kernels that look a row's sequence up do it per block (a linear scan was up to
// 100 dependent global loads each).
template <int STRIDE>
__device__ __forceinline__ int find_row_segment(const i64* segs, int nseg, i64 t) {
  int lo = 0, hi = nseg - 1, s = -1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (segs[STRIDE * mid] <= t) {
      s = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return s >= 0 && t < segs[STRIDE * s] + segs[STRIDE * s + 1] ? s : -1;
}

// Asynchronous global -> shared copies (sm_80+), zero-filled when !valid (gmem must still be a
// mapped address). cp_async_wait_all() waits for all of this thread's copies; with groups,
// cp_async_commit() closes the thread's current group and cp_async_wait_group<N>() waits until at
// most N of its groups (the N most recently committed) are still in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// D[16 x 8] += A[16 x 16] B[16 x 8], bf16 operands, f32 accumulation (mma.sync m16n8k16, row.col):
// lane l = 4 gr + tg holds A rows gr, gr+8 at k 2tg.., 2tg+8.. (a0..a3), B column gr at k 2tg..,
// 2tg+8.. (b0, b1), D rows gr, gr+8 at columns 2tg, 2tg+1 (d0, d1 / d2, d3).
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Per-token 1×128 FP8 (E4M3) activation quantisation, shared by quant_act_1x128 and every kernel
// that writes it fused with the op producing the activations (swiglu_quant_1x128, the *_quant row
// norms): the scale of a 128-block whose largest |value| is amax, and the code of a value v of a
// block with scale sc. One definition, so the fused kernels give quant_act_1x128's bits.
__device__ __forceinline__ float act_scale_1x128(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }
__device__ __forceinline__ unsigned char act_code_e4m3(float v, float sc) { return __nv_fp8_e4m3(v / sc).__x; }

// One 128-block quantised by one warp, 4 values per lane: the block's amax over the warp, its
// scale, the codes and (lane 0) the scale. `q` is where this lane's first code goes and `step`
// the distance between its codes: 1 when lane l holds columns 4l..4l+3 (quant_act_1x128,
// swiglu_quant_1x128, the *_quant row norms), 32 when it holds l, l+32, l+64, l+96
// (rms_norm_gated_quant). Every quantising kernel ends here, so all give quant_act_1x128's bits.
// With step 1 the four codes go out as one 4-byte store (q is then 4-byte aligned: every caller's
// first column is a multiple of 4 in a row of a multiple of 128 bytes).
__device__ __forceinline__ void quant_block_1x128(const float v[4], unsigned char* q, int step, float* scale) {
  float amax = 0.f;
  for (int j = 0; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
  float sc = act_scale_1x128(warp_max(amax));
  if (step == 1) {
    unsigned packed = 0;
    for (int j = 0; j < 4; j++) packed |= (unsigned)act_code_e4m3(v[j], sc) << (8 * j);
    *(unsigned*)q = packed;
  } else {
    for (int j = 0; j < 4; j++) q[j * step] = act_code_e4m3(v[j], sc);
  }
  if ((threadIdx.x & 31) == 0) *scale = sc;
}

// Two f32 rounded to bf16 (each to nearest even) as one 32-bit pair, lo in the low half.
__device__ __forceinline__ unsigned pack_f32(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *(unsigned*)&v;
}

// Four consecutive bf16 as one 8-byte load / store (p 8-byte aligned), and as f32 (exact).
__device__ __forceinline__ void load_bf16x4(const bf16* p, bf16 h[4]) {
  const uint2 u = *(const uint2*)p;
  h[0] = __ushort_as_bfloat16((unsigned short)(u.x & 0xffffu));
  h[1] = __ushort_as_bfloat16((unsigned short)(u.x >> 16));
  h[2] = __ushort_as_bfloat16((unsigned short)(u.y & 0xffffu));
  h[3] = __ushort_as_bfloat16((unsigned short)(u.y >> 16));
}
__device__ __forceinline__ void store_bf16x4(bf16* p, const bf16 h[4]) {
  uint2 u;
  u.x = (unsigned)__bfloat16_as_ushort(h[0]) | ((unsigned)__bfloat16_as_ushort(h[1]) << 16);
  u.y = (unsigned)__bfloat16_as_ushort(h[2]) | ((unsigned)__bfloat16_as_ushort(h[3]) << 16);
  *(uint2*)p = u;
}

// Values the compiler must keep in a register rather than recompute where they are used (it
// rematerialises cheap-looking address arithmetic inside loops: attention.cu's KvTileCopies and
// gemm_fp8.cu's producer keep their addresses with these): a volatile asm cannot be re-executed.
__device__ __forceinline__ unsigned kept_u32(unsigned x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}
__device__ __forceinline__ unsigned long long kept_u64(unsigned long long x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}

// The first 1024-byte boundary in a kernel's dynamic shared memory (the host adds 1024 bytes of
// slack): where the 128-byte-swizzled tiles of the Hopper kernels start.
__device__ __forceinline__ unsigned char* smem_1024(unsigned char* raw) {
  return raw + ((1024 - ((unsigned)__cvta_generic_to_shared(raw) & 1023)) & 1023);
}

// A tensor map (the driver's CUtensorMap, 128 opaque bytes the host encodes: src/backend/cuda/
// tma.rs) passed as a `const __grid_constant__` kernel parameter (declared on every architecture:
// kernel signatures name it; the TMA copies below are sm_90 only).
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};

// Hopper warpgroup MMAs (sm_90a only: IMAJEV_WGMMA is defined where they compile; kernels that use
// them keep empty entries elsewhere, and the host launches those only on sm_90). The primitives
// every wgmma kernel needs: the fences and waits, and shared-memory matrix descriptors for the
// 128-byte-swizzled layout (a tile of R rows is column blocks of R rows x 128 bytes, the 16-byte
// chunk c of row r at chunk c ^ (r % 8), 1024-byte aligned; SBO 1024 = 8 rows).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define IMAJEV_WGMMA 1
#endif

#ifdef IMAJEV_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Makes this thread's completed generic-proxy writes to shared memory (cp.async) visible to the
// async proxy the tensor cores read through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ unsigned long long smem_desc(const void* p, unsigned lbo, unsigned sbo) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// smem_desc's low word (start address / 16 and leading byte offset / 16). Descriptors of two
// addresses a multiple of 16 bytes apart differ only in it, by the distance / 16 (the 14-bit
// address field never carries: shared memory is below 256 KB), so attn_fwd_wgmma(_ov) compute it
// once per buffer and add compile-time offsets, where building each descriptor from its address
// took ~5 instructions, 8 descriptors per tile (SASS, NOTES).
__device__ __forceinline__ unsigned smem_desc_lo(const void* p, unsigned lbo) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return ((a & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16);
}
// The descriptor of a low word from smem_desc_lo and the stride byte offset: equal to smem_desc.
__device__ __forceinline__ unsigned long long smem_desc_of(unsigned lo, unsigned sbo) {
  return (unsigned long long)lo | ((unsigned long long)(((sbo & 0x3FFFF) >> 4) | (1u << 30)) << 32);
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B from shared memory (K-major descriptors);
// scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_ss_m64n128(float (&d)[64], unsigned long long da, unsigned long long db,
                                                int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// Producer/consumer hand-over (mbarriers, named barriers) and register pinning around wgmma.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(b))
               : "memory");
}
// Arrives on the barrier once every cp.async this thread issued so far has landed, without waiting
// for them (.noinc: the arrival is one of the counted ones, the barrier's count is not raised).
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned long long* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
// Waits until the phase with the given parity (0, 1, 0, ...: the use count of the stage, mod 2)
// has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of accumulator registers across this point
// while an MMA that owns them is in flight.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) asm volatile("" : "+r"(r[i][e])::"memory");
}

// ---- TMA (the tensor memory accelerator) and thread-block clusters.
// The copies take a TmaMap's generic address (see TmaMap above).
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)m) : "memory");
}
// Arrives on the barrier (release) and raises the bytes its current phase waits for by `bytes`:
// the phase completes once every counted thread arrived and that many bytes of copies landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes)
               : "memory");
}
// Raises the bytes the barrier's current phase waits for by `bytes`, without arriving: for a phase
// whose arrivals come from elsewhere (attn_fwd_ws's producer threads, all of which arrive on the
// stage through cp.async whether or not this thread's tile came by TMA).
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
// The box of map m at element coordinates (c0 innermost, c1) into shared memory at dst, counted
// on barrier b. Coordinates outside the tensor (negative or past its end) read as zeros, and the
// whole box's bytes are still counted.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* m, int c0, int c1, unsigned long long* b) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"((unsigned long long)m), "r"(c0), "r"(c1), "r"(smem_u32(b))
      : "memory");
}
// tma_load_2d into the same shared-memory offset of every block of the cluster in `mask`, each
// block's barrier at b's offset counting the bytes it received.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TmaMap* m, int c0, int c1,
                                                      unsigned long long* b, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%2, %3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
      "l"((unsigned long long)m), "r"(c0), "r"(c1), "r"(smem_u32(b)), "h"(mask)
      : "memory");
}
// The box of map m at (c0, c1) from shared memory at src to global memory (rows and columns past
// the tensor's edges are not written), in this thread's current bulk group. The shared-memory
// writes it reads must be made visible to the async proxy first (fence_proxy_async).
__device__ __forceinline__ void tma_store_2d(const TmaMap* m, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   (unsigned long long)m),
               "r"(c0), "r"(c1), "r"(smem_u32(src))
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk stores have read their shared memory (it may be reused) ...
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// ... or have completed.
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Arrives on the barrier at b's offset in the shared memory of cluster block `rank` (this
// block's own included), release at CTA scope: what it orders is this thread's reads of shared
// memory before whoever waits on the barrier overwrites it. (`.release.cluster` compiled to a
// MEMBAR.ALL.GPU before every arrival, a wait for all the thread's outstanding global stores.)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned long long* b, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.release.cta.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_u32(b)),
      "r"(rank)
      : "memory");
}
// Every thread of every block of the cluster (that has not exited) meets here; the initialised
// barriers and everything written before are visible to the cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// Makes this thread's mbarrier initialisations visible to the cluster (before cluster_sync).
__device__ __forceinline__ void fence_mbar_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
#endif  // IMAJEV_WGMMA
