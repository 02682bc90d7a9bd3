// tigon/core/colsum.cuh - deterministic column sums of per-block partials: the second phase of
// every weight-gradient reduction (RMSNorm / LayerNorm dW, ...). Block partials are written by the
// op's kernel into caller-provided workspace ([parts, cols] fp32); this sums each column in a fixed
// order and writes (or adds to) the gradient in its own dtype. No float atomics anywhere.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "config.hpp"
#include "device.hpp"
#include "dtype.hpp"
#include "math.hpp"
#include "status.hpp"

TIGON_NAMESPACE_BEGIN

namespace detail {

inline constexpr int kColSumCols = 32;    // columns per block (one warp wide: coalesced rows)
inline constexpr int kColSumSlices = 8;   // partial rows summed in parallel, then combined in order

template <class Out>
TIGON_KERNEL void __launch_bounds__(kColSumCols* kColSumSlices)
    column_sum_kernel(const float* __restrict__ partials, std::int64_t parts, std::int64_t cols,
                      Out* __restrict__ out, bool accumulate) {
  __shared__ float sums[kColSumSlices][kColSumCols + 1];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kColSumCols + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
    for (std::int64_t p = threadIdx.y; p < parts; p += kColSumSlices) s += partials[p * cols + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kColSumSlices; ++i) total += sums[i][threadIdx.x];
    if (accumulate) total += to_float(out[col]);
    out[col] = from_float<Out>(total);
  }
}

}  // namespace detail

// out[c] (+)= sum over p of partials[p * cols + c], summed in the same order on every call.
template <Element Out>
[[nodiscard]] inline Status column_sum(const float* partials, std::int64_t parts, std::int64_t cols,
                                       Out* out, bool accumulate, cudaStream_t stream,
                                       const char* op) {
  const dim3 block(detail::kColSumCols, detail::kColSumSlices);
  const dim3 grid(static_cast<unsigned>(ceil_div<std::int64_t>(cols, detail::kColSumCols)));
  detail::column_sum_kernel<Out><<<grid, block, 0, stream>>>(partials, parts, cols, out, accumulate);
  return check_launch(op);
}

TIGON_NAMESPACE_END
