// tigon/core/colsum.cuh - deterministic column sums of per-block partials: the second phase of
// every weight-gradient reduction (RMSNorm / LayerNorm dW, ...). Block partials are written by the
// op's kernel into caller-provided workspace ([parts, cols] fp32); this sums each column in a fixed
// order and writes (or adds to) the gradient in its own dtype. No float atomics anywhere.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "config.hpp"
#include "device.hpp"
#include "launch.cuh"
#include "dtype.hpp"
#include "math.hpp"
#include "status.hpp"

TIGON_NAMESPACE_BEGIN

namespace detail {

inline constexpr int kColSumCols = 32;    // columns per block (one warp wide: coalesced rows)
inline constexpr int kColSumSlices = 32;  // partial rows summed in parallel, then combined in order

// Block (32 columns) x (32 slices): thread (x, y) sums rows y, y + 32, ... of column x; then warp
// w combines the 32 slice sums of column w with a fixed shuffle tree. The same order every call.
// blockIdx.y selects the partials / output pair (column_sums: two gradients in one launch; the
// second pair is null when the grid has one row of blocks).
template <class Out>
TIGON_KERNEL void __launch_bounds__(kColSumCols* kColSumSlices)
    column_sum_kernel(const float* __restrict__ partials0, Out* __restrict__ out0,
                      const float* __restrict__ partials1, Out* __restrict__ out1, std::int64_t parts,
                      std::int64_t cols, bool accumulate) {
  detail::grid_dependency_sync();
  __shared__ float sums[kColSumSlices][kColSumCols + 1];
  const float* __restrict__ partials = blockIdx.y == 0 ? partials0 : partials1;
  Out* __restrict__ out = blockIdx.y == 0 ? out0 : out1;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * kColSumCols;
  const std::int64_t col = col0 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (std::int64_t p = threadIdx.y; p < parts; p += kColSumSlices) s += partials[p * cols + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  float total = sums[threadIdx.x][threadIdx.y];  // warp y: column col0 + y, lane x: slice x
#pragma unroll
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  const std::int64_t c = col0 + threadIdx.y;
  if (threadIdx.x == 0 && c < cols) {
    if (accumulate) total += to_float(out[c]);
    out[c] = from_float<Out>(total);
  }
}

}  // namespace detail

// column_sum (below) of two partial arrays of the same shape into out0 and out1 (e.g. dW and dB) in one
// launch; partials1 / out1 null: partials0 only.
template <Element Out>
[[nodiscard]] inline Status column_sums(const float* partials0, Out* out0, const float* partials1, Out* out1,
                                        std::int64_t parts, std::int64_t cols, bool accumulate,
                                        cudaStream_t stream, const char* op) {
  const bool two = partials1 != nullptr && out1 != nullptr;
  const dim3 block(detail::kColSumCols, detail::kColSumSlices);
  const dim3 grid(static_cast<unsigned>(ceil_div<std::int64_t>(cols, detail::kColSumCols)), two ? 2u : 1u);
  return detail::launch(op, detail::column_sum_kernel<Out>, {grid, block, 0, stream}, partials0, out0,
                        two ? partials1 : nullptr, two ? out1 : nullptr, parts, cols, accumulate);
}

// out[c] (+)= sum over p of partials[p * cols + c], summed in the same order on every call.
template <Element Out>
[[nodiscard]] inline Status column_sum(const float* partials, std::int64_t parts, std::int64_t cols,
                                       Out* out, bool accumulate, cudaStream_t stream,
                                       const char* op) {
  return column_sums<Out>(partials, out, nullptr, nullptr, parts, cols, accumulate, stream, op);
}

TIGON_NAMESPACE_END
