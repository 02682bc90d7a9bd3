// tigon/core/async_copy.cuh - asynchronous global -> shared copies (cp.async, sm_80+), the way the
// row kernels keep several rows in flight without holding them in registers. A thread that reads
// back only what it copied itself needs no barrier: waiting on its own copy groups is enough.
#pragma once

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

// Close the group of copies issued since the last commit.
TIGON_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
TIGON_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

TIGON_NAMESPACE_END
