// mlagen/ptx.cuh — thin wrappers over the PTX instructions that sm_90 and sm_120 share:
// cp.async (Ampere+), cp.async.bulk + mbarrier transaction counts (sm_90+: the 1-D bulk copy of the
// TMA engine, no tensor map), ldmatrix, mma.sync m16n8k16 bf16 -> fp32. No wgmma, tcgen05 or setmaxnreg.
// Fragment layouts follow the PTX ISA, "Matrix Fragments for mma.m16n8k16" (warp-level MMA).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

// MLAGEN_MBAR_WAIT 0 (every shipped build): mbarrier waits loop on try_wait, which may suspend the thread until the
// phase completes; 1: a test_wait spin, for A/B timing (tools/device_ab_define.py).
#ifndef MLAGEN_MBAR_WAIT
#define MLAGEN_MBAR_WAIT 0
#endif
#if MLAGEN_MBAR_WAIT != 0 && MLAGEN_MBAR_WAIT != 1
#error "MLAGEN_MBAR_WAIT must be 0 (try_wait) or 1 (test_wait spin)"
#endif

namespace mlagen {
namespace ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// MLAGEN_CP_ASYNC_CA 0 (every shipped build): 16-byte copies bypass L1 (.cg) unless the caller asks for .ca
// (kCacheL1: dimsplit_t's bf16 producer, MLAGEN_DST_COPY_L1); 1: every 16-byte copy allocates in L1 (.ca), a diagnostic
// build for the L2 -> SM bytes of each form (perf-notes v25, v40: .cg copies cross L2 -> SM as 1.5x their bytes, .ca
// as 1.07x).
#ifndef MLAGEN_CP_ASYNC_CA
#define MLAGEN_CP_ASYNC_CA 0
#endif

// cp.async of kBytes (4, 8 or 16) global -> shared. src_bytes = 0 fills the destination with
// zeros and reads nothing (PTX ISA: cp.async "src-size"), used for tokens past kv_len.
template <int kBytes, bool kCacheL1 = (MLAGEN_CP_ASYNC_CA != 0)>
__device__ __forceinline__ void cp_async_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async size must be 4, 8 or 16 bytes");
  const uint32_t dst = smem_u32(smem_dst);
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16 && !kCacheL1 && MLAGEN_CP_ASYNC_CA == 0) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem_src), "n"(kBytes),
                 "r"(src_bytes));
  }
}

// The mbarrier's pending count drops by one when all of this thread's earlier cp.async complete
// (.noinc: the arrival is counted in the barrier's init count). PTX ISA "cp.async.mbarrier.arrive".
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Hint: bring the 128-byte line holding `p` (global memory) into L2 (PTX ISA "prefetch"); no register result,
// nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier").
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrive_count));
}

// Makes mbarrier.init visible to the async proxy (the bulk-copy engine signals the barrier).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival that also expects `tx_bytes` more bytes of bulk-copy transactions in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(tx_bytes)
               : "memory");
}

#if MLAGEN_MBAR_WAIT == 1  // diagnostic: a test_wait spin (never suspends the thread)
#define MLAGEN_MBAR_WAIT_OP "test_wait"
#else
#define MLAGEN_MBAR_WAIT_OP "try_wait"
#endif
// Blocks until the phase with parity `phase` of `bar` has completed (acquire at CTA scope).
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier." MLAGEN_MBAR_WAIT_OP ".parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
#undef MLAGEN_MBAR_WAIT_OP

// Bulk copy of `bytes` (multiple of 16; 16-byte aligned addresses) global -> shared; completion
// is counted on `bar` as transaction bytes (PTX ISA "cp.async.bulk").
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// ---- thread-block clusters and distributed shared memory (sm_90 and sm_120; PTX ISA "mapa",
// "barrier.cluster", "st.shared::cluster", mbarrier at cluster scope). No multicast.
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// shared::cluster address of the variable at `smem_addr` (a shared::cta address) in CTA `rank`.
__device__ __forceinline__ uint32_t map_to_cta(uint32_t smem_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}

// Every thread of every CTA of the cluster arrives, then waits (release / acquire at cluster scope).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void st_cluster_v4(uint32_t cluster_addr, float a, float b, float c, float d) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_addr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

// 16 bytes to another CTA's shared memory (a shared::cluster address from map_to_cta) that complete
// 16 transaction bytes on that CTA's mbarrier `cluster_bar_addr` (PTX ISA "st.async"; sm_90+, no
// multicast). The receiver announces the bytes with mbarrier.arrive.expect_tx and waits on its own
// barrier at CTA scope, as for a bulk copy: no GPU-scope fence on the sender (a release.cluster
// arrival compiles to MEMBAR.ALL.GPU) and no L1 invalidation on the receiver (acquire.cluster does).
__device__ __forceinline__ void st_async_cluster_v4(uint32_t cluster_addr, float a, float b, float c, float d,
                                                    uint32_t cluster_bar_addr) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(cluster_bar_addr)
               : "memory");
}

// The same with 32-bit words (e.g. fp16 pairs): 16 or 8 bytes per thread.
__device__ __forceinline__ void st_async_cluster_v4_b32(uint32_t cluster_addr, uint32_t a, uint32_t b, uint32_t c,
                                                        uint32_t d, uint32_t cluster_bar_addr) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(a), "r"(b), "r"(c), "r"(d), "r"(cluster_bar_addr)
               : "memory");
}
__device__ __forceinline__ void st_async_cluster_v2_b32(uint32_t cluster_addr, uint32_t a, uint32_t b,
                                                        uint32_t cluster_bar_addr) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n" ::"r"(
                   cluster_addr),
               "r"(a), "r"(b), "r"(cluster_bar_addr)
               : "memory");
}

// fp32 pair -> fp16x2 (lo in bits 0-15), round to nearest, finite values beyond fp16's range clamped to +-65504
// (PTX ISA: cvt, .satfinite); and back, exactly.
__device__ __forceinline__ uint32_t pack_f16x2_satfinite(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ void unpack_f16x2(uint32_t w, float& lo, float& hi) {
  asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi)
      : "r"(w));
}

// Arrival on an mbarrier of another CTA of the cluster; orders this thread's earlier stores (release.cluster).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t cluster_bar_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar_addr) : "memory");
}

// The same at CTA scope (release.cta, the default semantics; no fence in SASS, where release.cluster adds
// MEMBAR.ALL.GPU): a consumer telling a producer in another CTA that a buffer's reads are done, the pattern
// CUTLASS's ClusterBarrier::arrive(cta_id) uses.
__device__ __forceinline__ void mbarrier_arrive_cluster_cta(uint32_t cluster_bar_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar_addr) : "memory");
}

// Local arrival (release at CTA scope), e.g. a consumer warp freeing a pipeline stage.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Waits for phase `phase` of a local barrier whose arrivals come from other CTAs (acquire.cluster).
__device__ __forceinline__ void mbarrier_wait_parity_cluster(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAITC_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAITC_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l/8, row l%8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem_row)));
}

// Two 8x8 b16 matrices, transposed; lanes 0-15 give the row addresses (matrix l/8, row l%8).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(smem_row)));
}

// D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x by one MUFU.EX2 (PTX ISA "ex2": .approx.ftz, max relative error 2^-22; subnormal results flush to
// +0, 2^-inf = +0). exp2f() wraps the same instruction in a range check and two multiplies for subnormals.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x by one MUFU.RCP (PTX ISA "rcp": .approx.ftz, max error 1 ulp over the full range; subnormal inputs and
// results flush to zero). 1.f / x is the IEEE division: a refinement and a slow-path call around the same instruction.
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) by one MUFU.LG2 (PTX ISA "lg2": .approx.ftz, max absolute error 2^-22.6 for the mantissa; subnormal inputs
// flush to zero, lg2(+0) = -inf). log2f() adds a range reduction and special-case code.
__device__ __forceinline__ float lg2_approx_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32): the
// warps of one group wait for each other without stopping the rest of the CTA.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive at named barrier `id` without waiting (the producers' side of a bar.arrive / bar.sync pair).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The two bf16 halves of a bf16x2 word as floats (low half first).
__device__ __forceinline__ float2 unpack_bf16x2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

// ---- Programmatic dependent launch (PTX ISA "griddepcontrol", sm_90+; sm_120 has it). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the previous kernel in the stream still runs:
// it must call griddep_wait() before touching anything that kernel writes. griddep_wait() returns once every CTA of
// the previous grid has exited and its memory operations are visible. griddep_launch_dependents() lets the next
// grid be scheduled once every CTA of this grid has called it (or exited). Both are no-ops without a dependent
// launch, and compile to nothing below sm_90.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- Grid-wide arrival counters in global memory (PTX ISA memory consistency model: release / acquire at gpu
// scope). A CTA's earlier global stores, made CTA-wide by a bar.sync before the release, are visible to a thread
// whose acquire load reads the released value (or a later one), and to its CTA after a following bar.sync.
__device__ __forceinline__ void red_release_gpu_add(unsigned int* addr, unsigned int v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int ld_acquire_gpu(const unsigned int* addr) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// The SM's cycle counter (PTX %clock64): diagnostic timing of one warp's waits (MLAGEN_DST_TRACE builds).
__device__ __forceinline__ uint64_t clock64_cycles() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t));
  return t;
}

// Global nanosecond timer (PTX %globaltimer; coarse, but monotonic across SMs): bounds spin-waits.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

}  // namespace ptx
}  // namespace mlagen
