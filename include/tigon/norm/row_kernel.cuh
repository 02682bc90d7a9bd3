// tigon/norm/row_kernel.cuh - the machinery the row-wise normalisation kernels share (RMSNorm,
// LayerNorm, fused residual-add + RMSNorm):
//
//   - RowShape: every constant of a compiled row layout (vector width, row-group width, vectors
//     per thread, row groups per block);
//   - RowPipeline: the shared-memory stages of a compiled backward, lowered to what fits;
//   - prefetch_first_row / prefetch_second_wave_row: the forwards' L2 prefetch around the
//     grid-dependency wait;
//   - direct_rows, stage_row / pipelined_rows: a row group's walk over its rows, straight from
//     global memory or with the next kStages - 1 rows of each input in flight through shared
//     memory (cp.async);
//   - store_partial_row: one fp32 partial weight-gradient row per row group, summed afterwards in
//     a fixed order by column_sum (core/colsum.cuh).
//
// The host side (policy, plan, launch) is norm/launch.cuh. The shape traits compile under any
// C++20 compiler (the host tests check them); the device helpers need nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"

#if defined(__CUDACC__)
#include "../core/async_copy.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

namespace detail {

// Threads that share one row: ceil(vectors / vpt), as a power of two up to a warp or whole warps.
constexpr int row_group_threads(int num_vec, int vec_per_thread) {
  int t = ceil_div(num_vec, vec_per_thread);
  if (t <= 32) return next_pow2(t);
  t = round_up(t, 32);
  return t > 1024 ? 1024 : t;
}

// Every constant of one compiled row shape: kCols columns of T, vpt vectors per thread, a block of
// about kBlockTarget threads holding kGroups rows side by side.
template <class T, int kCols, int kVecPerThreadTarget, int kBlockTarget>
struct RowShape {
  static_assert(kCols > 0, "the hidden size must be positive");
  static constexpr int kVec = pow2_divisor(kCols, kVecElems<T>);  // elements per access
  static constexpr int kNumVec = kCols / kVec;
  static constexpr int kGroupThreads = row_group_threads(kNumVec, kVecPerThreadTarget);
  static constexpr int kVecPerThread = ceil_div(kNumVec, kGroupThreads);
  static constexpr bool kExact = kNumVec % kGroupThreads == 0;  // no thread idles in the last vector
  static constexpr int kGroups = kBlockTarget > kGroupThreads ? kBlockTarget / kGroupThreads : 1;
  static constexpr int kThreads = kGroupThreads * kGroups;
  static constexpr int kAccessBytes = kVec * static_cast<int>(sizeof(T));
  // Compiled backwards stage rows through cp.async, which moves 4, 8 or 16 bytes; the forwards
  // follow the same rule, so that a shape has a compiled instance in both directions or neither.
  static constexpr bool kCompilable = kAccessBytes >= 4;
  static_assert(kVecPerThread <= 32,
                "hidden size too large to hold a row in registers: use the runtime launcher");
  static_assert(kGroupThreads <= 32 || kGroups <= 15, "too many row groups per block");
};

// The forward and backward shapes of a policy (NormPolicy's members, norm/launch.cuh).
template <class T, int kCols, class P>
using FwdRowShape = RowShape<T, kCols, P::kFwdVecPerThread, P::kFwdBlockThreads>;
template <class T, int kCols, class P>
using BwdRowShape = RowShape<T, kCols, P::kBwdVecPerThread, P::kBwdBlockThreads>;

// Hopper / Ampere opt-in limit (227 KB) less 1 KB for the kernels' static shared memory; the plan
// also checks the device's own limit.
inline constexpr int kMaxSmemPerBlock = 226 * 1024;

// Shared-memory pipeline of a compiled kernel: kTensors row buffers per stage per row group.
template <class Shape, class T, int kCols, int kTensors, int kStagesWanted>
struct RowPipeline {
  static constexpr int kRowBytes = kCols * static_cast<int>(sizeof(T));
  static constexpr int kPerStage = Shape::kGroups * kTensors * kRowBytes;
  static constexpr int kFit = kMaxSmemPerBlock / kPerStage;
  static constexpr int kStages = kFit < 1 ? 1 : (kFit < kStagesWanted ? kFit : kStagesWanted);
  static constexpr int kSmemBytes = kStages * kPerStage;
};

// The pipeline of a compiled backward staging kTensors inputs, P::kBwdStages deep.
template <class T, int kCols, class P, int kTensors>
using BwdRowPipe = RowPipeline<BwdRowShape<T, kCols, P>, T, kCols, kTensors, P::kBwdStages>;

// Whether a compiled instance exists for kCols (0 means "general kernels only").
template <template <class, int, class> class Shape, class T, int kCols, class P>
constexpr bool compiled_available() {
  if constexpr (kCols <= 0) {
    return false;
  } else {
    return Shape<T, kCols, P>::kCompilable;
  }
}

}  // namespace detail

#if defined(__CUDACC__)

namespace detail {

// Ask the L2 for one row (this thread's chunks; one request per 128-byte line), before the
// kernel's grid_dependency_sync(): a hint that puts the first row's lines on their way while the
// kernel before drains (core/launch.cuh).
template <class S, class T>
TIGON_DEVICE void prefetch_row_l2(const T* src, int t) {
#pragma unroll
  for (int v = 0; v < S::kVecPerThread; ++v) {
    const int i = v * S::kGroupThreads + t;
    if (S::kExact || i < S::kNumVec) {
      prefetch_l2_line_of(src + i * S::kVec, S::kAccessBytes);
    }
  }
}

// Ask the L2 for one row: one bulk prefetch by the group's first thread when the row is made of
// 16-byte vectors (so it starts 16-byte aligned and is a multiple of 16 bytes long), else one
// request per 128-byte line (prefetch_row_l2). A hint: it returns nothing and orders nothing.
template <class S, class T>
TIGON_DEVICE void prefetch_row_l2_bulk(const T* src, int t) {
  if constexpr (S::kAccessBytes == 16) {
    if (t == 0) prefetch_l2_bulk(src, static_cast<unsigned>(S::kNumVec * 16));
  } else {
    prefetch_row_l2<S>(src, t);
  }
}

// The RMSNorm and LayerNorm forwards' L2 prefetch around the grid-dependency wait: before it, only
// the first wave's blocks (`first_wave`: those resident at once) ask for their row group's first
// row; right after it they ask for `next`, the row their place takes in the second wave; later
// blocks ask for nothing. Hints, not accesses; before the wait TIGON_NO_PDL_PREFETCH compiles them
// out.
template <class S, class T>
TIGON_DEVICE void prefetch_first_row(const T* base, std::int64_t stride, std::int64_t first,
                                     std::int64_t rows, bool first_wave, int t) {
#if !defined(TIGON_NO_PDL_PREFETCH)
  if (first_wave && first < rows) prefetch_row_l2_bulk<S>(base + first * stride, t);
#else
  (void)base, (void)stride, (void)first, (void)rows, (void)first_wave, (void)t;
#endif
}
template <class S, class T>
TIGON_DEVICE void prefetch_second_wave_row(const T* base, std::int64_t stride, std::int64_t next,
                                           std::int64_t rows, bool first_wave, int t) {
  if (first_wave && next < rows) prefetch_row_l2_bulk<S>(base + next * stride, t);
}

// Issue the copies of one row (this thread's chunks) into a shared-memory stage; the caller
// commits the group (an empty group past the last row keeps the per-thread group count uniform).
template <class S, class T>
TIGON_DEVICE void stage_row(T* dst, const T* src, int t, bool valid) {
  if (valid) {
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) cp_async<S::kAccessBytes>(dst + i * S::kVec, src + i * S::kVec);
    }
  }
}

// One row group's walk over the rows first, first + step, ... < rows straight from global memory:
// body(row, pointer to the row).
template <class T, class Body>
TIGON_DEVICE void direct_rows(const T* base, std::int64_t stride, std::int64_t rows,
                              std::int64_t first, std::int64_t step, Body&& body) {
  for (std::int64_t row = first; row < rows; row += step) body(row, base + row * stride);
}

// One row group's walk over the rows first, first + step, ... < rows, with the next kStages - 1
// rows of each of kTensors inputs in flight through the group's shared-memory stages, laid out
// [stage][tensor][kCols]. body(row, buf) runs once per row after this thread's copies of it have
// landed; input i of the row is at buf + i * kCols. Each thread must read back only the chunks it
// copied itself (vectors v * kGroupThreads + t): waiting on its own copy groups is then enough and
// no barrier guards the buffers. A null source is not staged (its buffer holds garbage).
template <class S, int kCols, int kStages, int kTensors, class T, class Body>
TIGON_DEVICE void pipelined_rows(T* stages, const T* const (&src)[kTensors],
                                 const std::int64_t (&stride)[kTensors], std::int64_t rows,
                                 std::int64_t first, std::int64_t step, int t, Body&& body) {
  static_assert(kStages >= 1, "at least one stage");
  auto issue = [&](std::int64_t r, int stage) {
    const bool valid = r < rows;
#pragma unroll
    for (int i = 0; i < kTensors; ++i) {
      if (src[i] != nullptr) {
        stage_row<S>(stages + (stage * kTensors + i) * kCols, src[i] + r * stride[i], t, valid);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(first + s * step, s);
  int k = 0;
  for (std::int64_t row = first; row < rows; row += step, ++k) {
    issue(row + (kStages - 1) * step, (k + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();
    body(row, static_cast<const T*>(stages + (k % kStages) * kTensors * kCols));
  }
  cp_async_wait<0>();
}

// This thread's columns of the weight as fp32, read once (a thread owns the same columns in every
// row it visits): out[v][c] = w (plus `offset` with kOffset), or 1 without a weight. Lanes past
// the row (not kExact) get values they never use.
template <class S, bool kOffset, class W>
TIGON_DEVICE void load_row_weights(const W* w, float offset, int t, float (&out)[S::kVecPerThread][S::kVec]) {
#pragma unroll
  for (int v = 0; v < S::kVecPerThread; ++v) {
    const int i = v * S::kGroupThreads + t;
    AlignedVec<W, S::kVec> wv{};
    if (w != nullptr && (S::kExact || i < S::kNumVec)) wv = load_vec<S::kVec>(w + i * S::kVec);
#pragma unroll
    for (int c = 0; c < S::kVec; ++c) {
      if constexpr (kOffset) {
        out[v][c] = w != nullptr ? offset + to_float(wv.v[c]) : 1.0f;
      } else {
        out[v][c] = w != nullptr ? to_float(wv.v[c]) : 1.0f;
      }
    }
  }
}

// Write this thread's columns of a row group's fp32 partial row (acc[v][c] is column
// (v * kGroupThreads + t) * kVec + c) with whole 32-byte sectors per store instruction: with
// 8-element vectors (bf16 / half) the two lanes of a pair trade halves so that each 16-byte store
// pair covers one vector; with 4-element vectors each lane's 16 bytes follow its neighbour's.
// Scalar stores, 4 bytes in each 32-byte sector per instruction, took about 9 us at the end of the
// backward for 264 rows of 4096 columns on one H200 (docs/performance.md). Every lane of the warp
// must call it together, each for its own row group (the pair exchange is a full-warp shuffle);
// `part` is 16-byte aligned (the workspace is validated so; rows of kCols floats keep it).
template <class S>
TIGON_DEVICE void store_partial_row(float* part, const float (&acc)[S::kVecPerThread][S::kVec], int t) {
  constexpr int kV = S::kVec;
  if constexpr (kV == 8 && S::kGroupThreads % 2 == 0 && S::kNumVec % 2 == 0 && S::kThreads % 32 == 0) {
    const bool odd = (t & 1) != 0;
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      // The even lane keeps its low half and takes its partner's low half; the odd lane the high
      // halves. Both lanes of a pair are in range or neither (kNumVec is even).
      float send[4], recv[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) send[c] = odd ? acc[v][c] : acc[v][4 + c];
#pragma unroll
      for (int c = 0; c < 4; ++c) recv[c] = __shfl_xor_sync(0xffffffffu, send[c], 1);
      if (S::kExact || i < S::kNumVec) {
        const int even = i & ~1;
        const float4 first = odd ? make_float4(recv[0], recv[1], recv[2], recv[3])
                                 : make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
        const float4 second = odd ? make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7])
                                  : make_float4(recv[0], recv[1], recv[2], recv[3]);
        const int half = odd ? 4 : 0;
        *reinterpret_cast<float4*>(part + even * kV + half) = first;         // vector `even`
        *reinterpret_cast<float4*>(part + (even + 1) * kV + half) = second;  // vector `even + 1`
      }
    }
  } else if constexpr (kV == 4) {
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        *reinterpret_cast<float4*>(part + i * kV) = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
      }
    }
  } else {
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
#pragma unroll
        for (int c = 0; c < kV; ++c) part[i * kV + c] = acc[v][c];
      }
    }
  }
}

}  // namespace detail

#endif  // __CUDACC__

TIGON_NAMESPACE_END
