// tigon/core/async_copy.cuh - asynchronous global -> shared copies: per-thread cp.async (sm_80+),
// the way the row kernels keep several rows in flight without holding them in registers (a thread
// that reads back only what it copied itself needs no barrier: waiting on its own copy groups is
// enough); and the bulk-copy engine with a shared-memory barrier (sm_90+), the way one thread
// moves a whole slice of a row into shared memory for the block. Also the L2 prefetch hint.
#pragma once

#include <cuda/ptx>
#include <cuda_pipeline_primitives.h>

#include <cstdint>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

// Copy kBytes (4, 8 or 16) from global to shared memory, asynchronously.
template <int kBytes>
TIGON_DEVICE void cp_async(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
  // Inline PTX: cuda::memcpy_async needs a pipeline or barrier object, and the primitive
  // __pipeline_memcpy_async changes the sm_80 SASS of the RMSNorm backward.
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(kBytes)
                 : "memory");
  }
}

// Before grid_dependency_sync(), a kernel may ask the L2 for the lines of its first loads, so that
// the blocks scheduled while the kernel before them drains have their data on its way when the
// wait returns (one H200, back to back at the benchmark shapes: the RoPE forward 0.0847-0.0849 ->
// 0.0838-0.0839 ms, the RMSNorm forward 0.0661-0.0663 -> 0.0659-0.0661 ms; docs/performance.md).
// A prefetch is a hint: it returns nothing to the thread and orders nothing, and the L2 is where
// every write of the kernel before lands, so a line it brings in early is never stale. The thread
// whose `bytes`-wide vector at `p` starts a 128-byte line asks for that line (vectors of up to 16
// bytes read side by side by consecutive threads: one request per line). TIGON_NO_PDL_PREFETCH
// compiles it out.
TIGON_DEVICE void prefetch_l2_line_of(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(TIGON_NO_PDL_PREFETCH)
  if ((reinterpret_cast<std::uintptr_t>(p) & 127u) < static_cast<unsigned>(bytes)) {
    // Inline PTX: libcu++ (CUDA 13.0) has no plain L2 prefetch (cuda::apply_access_property's
    // prefetches carry an eviction priority).
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
#else
  (void)p;
  (void)bytes;
#endif
}

// Ask the L2 for `bytes` (a multiple of 16, from a 16-byte aligned address) of global memory with
// the bulk-copy engine (sm_90+; a hint like prefetch_l2_line_of: it returns nothing and orders
// nothing, and one instruction covers a whole range).
TIGON_DEVICE void prefetch_l2_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Inline PTX: cuda::ptx in CUDA 13.0 (CCCL 3.0) has no cp.async.bulk.prefetch.
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// Close the group of copies issued since the last commit.
TIGON_DEVICE void cp_async_commit() { __pipeline_commit(); }

// Wait until at most kPending of this thread's committed groups are still in flight (more than 8:
// waits as for 8).
template <int kPending>
TIGON_DEVICE void cp_async_wait() {
  static_assert(kPending >= 0, "a count of copy groups");
  __pipeline_wait_prior(kPending);
}

// ---- Bulk copies completed through an mbarrier (sm_90+) ----
// Declared for every target, so that code choosing them at run time compiles everywhere; on
// devices before sm_90 their bodies trap (callers check the compute capability first).

TIGON_DEVICE unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// TIGON_SM90(statements): the statements on sm_90+, a trap before (likewise TIGON_SM90_ASM for
// an inline-PTX statement).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TIGON_SM90_ASM(...) __trap()
#define TIGON_SM90(...) __trap()
#else
#define TIGON_SM90_ASM(...) asm volatile(__VA_ARGS__)
#define TIGON_SM90(...) \
  do {                  \
    __VA_ARGS__;        \
  } while (0)
#endif

// One thread initialises a barrier that completes a phase after one arrival and its transaction
// bytes; the fence makes the initialisation visible to the bulk-copy engine.
TIGON_DEVICE void mbarrier_init(std::uint64_t* bar) {
  TIGON_SM90(cuda::ptx::mbarrier_init(bar, 1);
             cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster));
}

// Order this thread's earlier generic-proxy accesses of shared memory before later bulk copies
// into it (after a block barrier: every thread's reads of the buffer come first).
TIGON_DEVICE void fence_proxy_async_shared() { TIGON_SM90(cuda::ptx::fence_proxy_async(cuda::ptx::space_shared)); }

// The one arrival of the barrier's phase, announcing `bytes` of bulk copies to come.
TIGON_DEVICE void mbarrier_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  TIGON_SM90((void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                                         cuda::ptx::space_shared, bar, bytes));
}

// Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this block's
// shared memory with the bulk-copy engine; completion is counted on `bar`.
TIGON_DEVICE void bulk_copy_g2s(void* smem, const void* gmem, unsigned bytes, std::uint64_t* bar) {
  TIGON_SM90(cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem, gmem, bytes, bar));
}

// Wait until the barrier's phase with this parity has completed. kCluster: acquire at cluster
// scope (what other blocks of the cluster wrote into this block's shared memory, as with
// cluster_store_async_f4); otherwise at the block's.
template <bool kCluster = false>
TIGON_DEVICE void mbarrier_wait(std::uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)bar;
  (void)parity;
  __trap();
#else
  if constexpr (kCluster) {
    while (!cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, bar, parity)) {
    }
  } else {
    while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
    }
  }
#endif
}

// The two halves of a thread-block cluster barrier (sm_90+), for a block that has work to do
// between announcing that it reached a point and waiting for the other blocks to reach it: every
// thread of every block of the cluster calls arrive, then wait, alternately, the same number of
// times (a warp's threads together). arrive releases this thread's earlier memory accesses
// (distributed shared memory included) to the threads that wait, and wait acquires them.
TIGON_DEVICE void cluster_arrive() { TIGON_SM90(cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_release)); }
// An arrival that releases nothing (after mbarrier_init, whose fence releases the initialisation).
TIGON_DEVICE void cluster_arrive_relaxed() { TIGON_SM90(cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_relaxed)); }
TIGON_DEVICE void cluster_wait() { TIGON_SM90(cuda::ptx::barrier_cluster_wait(cuda::ptx::sem_acquire)); }

// ---- Messages between the blocks of a cluster (sm_90+) ----

// The address of `p` (this block's shared memory) in block `rank` of the cluster.
// Inline PTX: cuda::ptx in CUDA 13.0 has no mapa (__cluster_map_shared_rank returns a generic
// address, not the shared::cluster one st.async takes).
TIGON_DEVICE unsigned cluster_smem_addr(const void* p, unsigned rank) {
  unsigned r = 0;
  TIGON_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}

// Store 16 bytes into another block's shared memory (`slot`, from cluster_smem_addr) without
// waiting for it: the store counts its bytes on that block's barrier (`bar`, likewise), whose
// phase the receiver armed with mbarrier_arrive_expect_tx for every byte it awaits, and whose
// completion makes the bytes visible to the threads that wait on it (mbarrier_wait<true>).
// Inline PTX: cuda::ptx::st_async takes generic pointers, this takes mapa's shared::cluster
// addresses.
TIGON_DEVICE void cluster_store_async_f4(unsigned slot, unsigned bar, float a, float b, float c, float d) {
  TIGON_SM90_ASM(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(slot),
      "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
      : "memory");
}

// This block's rank in its cluster, and the cluster's blocks.
TIGON_DEVICE unsigned cluster_rank() {
  unsigned r = 0;
  TIGON_SM90(r = cuda::ptx::get_sreg_cluster_ctarank());
  return r;
}
TIGON_DEVICE unsigned cluster_blocks() {
  unsigned r = 1;
  TIGON_SM90(r = cuda::ptx::get_sreg_cluster_nctarank());
  return r;
}

#undef TIGON_SM90_ASM
#undef TIGON_SM90

TIGON_NAMESPACE_END
