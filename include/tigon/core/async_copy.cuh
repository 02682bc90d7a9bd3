// tigon/core/async_copy.cuh - asynchronous global -> shared copies: per-thread cp.async (sm_80+),
// the way the row kernels keep several rows in flight without holding them in registers (a thread
// that reads back only what it copied itself needs no barrier: waiting on its own copy groups is
// enough); and the bulk-copy engine with a shared-memory barrier (sm_90+), the way one thread
// moves a whole slice of a row into shared memory for the block. Also the L2 prefetch hint.
#pragma once

#include <cstdint>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

// Copy kBytes (4, 8 or 16) from global to shared memory, asynchronously.
template <int kBytes>
TIGON_DEVICE void cp_async(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
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
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// Close the group of copies issued since the last commit.
TIGON_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
TIGON_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- Bulk copies completed through an mbarrier (sm_90+) ----
// Declared for every target, so that code choosing them at run time compiles everywhere; on
// devices before sm_90 their bodies trap (callers check the compute capability first).

TIGON_DEVICE unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TIGON_SM90_ASM(...) __trap()
#else
#define TIGON_SM90_ASM(...) asm volatile(__VA_ARGS__)
#endif

// One thread initialises a barrier that completes a phase after one arrival and its transaction
// bytes; the fence makes the initialisation visible to the bulk-copy engine.
TIGON_DEVICE void mbarrier_init(std::uint64_t* bar) {
  TIGON_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
  TIGON_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Order this thread's earlier generic-proxy accesses of shared memory before later bulk copies
// into it (after a block barrier: every thread's reads of the buffer come first).
TIGON_DEVICE void fence_proxy_async_shared() { TIGON_SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The one arrival of the barrier's phase, announcing `bytes` of bulk copies to come.
TIGON_DEVICE void mbarrier_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  TIGON_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this block's
// shared memory with the bulk-copy engine; completion is counted on `bar`.
TIGON_DEVICE void bulk_copy_g2s(void* smem, const void* gmem, unsigned bytes, std::uint64_t* bar) {
  TIGON_SM90_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Wait until the barrier's phase with this parity has completed. kCluster: acquire at cluster
// scope (what other blocks of the cluster wrote into this block's shared memory, as with
// cluster_store_async_f4); otherwise at the block's.
template <bool kCluster = false>
TIGON_DEVICE void mbarrier_wait(std::uint64_t* bar, unsigned parity) {
  const unsigned b = smem_u32(bar);
  unsigned done = 0;
  do {
    if constexpr (kCluster) {
      TIGON_SM90_ASM(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(b), "r"(parity)
          : "memory");
    } else {
      TIGON_SM90_ASM(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(b), "r"(parity)
          : "memory");
    }
  } while (done == 0);
}

// The two halves of a thread-block cluster barrier (sm_90+), for a block that has work to do
// between announcing that it reached a point and waiting for the other blocks to reach it: every
// thread of every block of the cluster calls arrive, then wait, alternately, the same number of
// times (a warp's threads together: .aligned). arrive releases this thread's earlier memory
// accesses (distributed shared memory included) to the threads that wait, and wait acquires them.
TIGON_DEVICE void cluster_arrive() { TIGON_SM90_ASM("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
// An arrival that releases nothing (after mbarrier_init, whose fence releases the initialisation).
TIGON_DEVICE void cluster_arrive_relaxed() {
  TIGON_SM90_ASM("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
TIGON_DEVICE void cluster_wait() { TIGON_SM90_ASM("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// ---- Messages between the blocks of a cluster (sm_90+) ----

// The address of `p` (this block's shared memory) in block `rank` of the cluster.
TIGON_DEVICE unsigned cluster_smem_addr(const void* p, unsigned rank) {
  unsigned r = 0;
  TIGON_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}

// Store 16 bytes into another block's shared memory (`slot`, from cluster_smem_addr) without
// waiting for it: the store counts its bytes on that block's barrier (`bar`, likewise), whose
// phase the receiver armed with mbarrier_arrive_expect_tx for every byte it awaits, and whose
// completion makes the bytes visible to the threads that wait on it (mbarrier_wait<true>).
TIGON_DEVICE void cluster_store_async_f4(unsigned slot, unsigned bar, float a, float b, float c, float d) {
  TIGON_SM90_ASM(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(slot),
      "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
      : "memory");
}

// This block's rank in its cluster, and the cluster's blocks.
TIGON_DEVICE unsigned cluster_rank() {
  unsigned r = 0;
  TIGON_SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
TIGON_DEVICE unsigned cluster_blocks() {
  unsigned r = 1;
  TIGON_SM90_ASM("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return r;
}

#undef TIGON_SM90_ASM

TIGON_NAMESPACE_END
