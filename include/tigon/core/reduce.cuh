// tigon/core/reduce.cuh - reductions inside a warp, inside a group of threads that owns one row,
// and over a whole block (CUB). All sums are in fp32 and in a fixed order: the same inputs give
// bitwise the same result.
#pragma once

#include <cub/block/block_reduce.cuh>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

// `op` across kWidth consecutive lanes (kWidth a power of two <= 32), in a fixed butterfly order;
// every lane gets the result.
template <int kWidth, int N, class Op>
TIGON_DEVICE void warp_allreduce(float (&v)[N], Op op) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0);
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = op(v[i], __shfl_xor_sync(0xffffffffu, v[i], offset, kWidth));
  }
}

struct SumOp {
  TIGON_DEVICE float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {  // fmaxf: a NaN loses to a number
  TIGON_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Sum across kWidth consecutive lanes; every lane gets the sum.
template <int kWidth, int N>
TIGON_DEVICE void warp_allreduce_sum(float (&v)[N]) {
  warp_allreduce<kWidth>(v, SumOp{});
}

// Synchronise the kThreads threads of one row group: a named barrier (ids 1..15), or the block
// barrier when the group is the whole block.
template <int kThreads, int kGroups>
TIGON_DEVICE void group_barrier(int group) {
  if constexpr (kGroups == 1) {
    __syncthreads();
  } else {
    // Inline PTX: the intrinsic __barrier_sync_count emits the non-aligned barrier.sync, around
    // which ptxas adds a fallback for divergent warps (LayerNorm forward: 808 -> 952 SASS
    // instructions); bar.sync is barrier.sync.aligned.
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(kThreads) : "memory");
  }
}

// All-reduce (sum) of N floats across each group of kThreads threads; a block holds kGroups such
// groups side by side, each working on its own row. kThreads is a power of two up to 32 (shuffles
// only) or a multiple of 32 up to 1024 (shuffles, then one named barrier per call). The shared
// storage is double-buffered, so back-to-back calls need one barrier each, not two; callers
// alternate `parity` between consecutive calls.
template <int kThreads, int kGroups, int N = 1>
struct GroupAllReduce {
  static_assert(kGroups >= 1 && (kThreads <= 32 || kGroups <= 15),
                "row groups of whole warps synchronise on named barriers: at most 15 of them");
  static_assert((kThreads <= 32 && (kThreads & (kThreads - 1)) == 0) ||
                    (kThreads % 32 == 0 && kThreads <= 1024),
                "a row group is a power of two up to a warp, or whole warps");
  static constexpr int kWarps = kThreads > 32 ? kThreads / 32 : 1;

  struct TempStorage {
    float partial[2][kGroups][kWarps][N];
  };

  TIGON_DEVICE static void sum(float (&v)[N], TempStorage& tmp, int group, int thread_in_group,
                               int parity) {
    if constexpr (kThreads <= 32) {
      warp_allreduce_sum<kThreads>(v);
    } else {
      warp_allreduce_sum<32>(v);
      const int warp = thread_in_group / 32;
      if ((thread_in_group & 31) == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) tmp.partial[parity][group][warp][i] = v[i];
      }
      group_barrier<kThreads, kGroups>(group);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += tmp.partial[parity][group][w][i];
        v[i] = s;
      }
    }
  }
};

// All-reduce (sum) of N floats over a whole block of kThreads threads, on CUB's BlockReduce,
// with the result broadcast to every thread. Two block barriers per call.
template <int kThreads, int N = 1>
struct BlockAllReduce {
  struct Pair {
    float v[N];
  };
  struct PairSum {
    TIGON_DEVICE Pair operator()(const Pair& a, const Pair& b) const {
      Pair r;
#pragma unroll
      for (int i = 0; i < N; ++i) r.v[i] = a.v[i] + b.v[i];
      return r;
    }
  };
  using Reduce = cub::BlockReduce<Pair, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    Pair result;
  };

  TIGON_DEVICE static void sum(float (&v)[N], TempStorage& tmp) {
    Pair p;
#pragma unroll
    for (int i = 0; i < N; ++i) p.v[i] = v[i];
    const Pair total = Reduce(tmp.reduce).Reduce(p, PairSum{});
    if (threadIdx.x == 0) tmp.result = total;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = tmp.result.v[i];
    __syncthreads();  // tmp may be reused by the next call
  }
};

TIGON_NAMESPACE_END
