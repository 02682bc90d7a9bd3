// tigon/norm/layer_norm.cuh - LayerNorm forward and backward.
//
//   mean = sum(x) / cols                                  (fp32, one per row, saved)
//   rstd = 1 / sqrt(sum((x - mean)^2) / cols + eps)       (biased variance; fp32, saved)
//   y    = (x - mean) * rstd * w + b                      (fp32, one rounding to T)
//
// The numerics of torch.nn.functional.layer_norm on float, half and bfloat16 inputs: statistics
// and arithmetic in fp32, y rounded once to the input dtype. The variance is computed from the
// centred values (two passes over the row held on chip), not as E[x^2] - mean^2.
//
// The row machinery is RMSNorm's (norm/row_kernel.cuh: compiled shapes, the cp.async pipeline,
// partial gradient rows; core/reduce.cuh: group reductions; core/colsum.cuh: the fixed-order
// column sum of dW and dB). The header reads in four layers: arguments, math (host + device),
// kernels, launchers. The first two compile under any C++20 compiler; kernels and launchers need
// nvcc.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "../core/config.hpp"
#include "../core/dispatch.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "row_kernel.cuh"

#if defined(__CUDACC__)
#include "../core/colsum.cuh"
#include "../core/device.hpp"
#include "../core/launch.cuh"
#include "../core/reduce.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// Row strides are in elements; 0 means contiguous (the stride equals cols).
template <class T, class W = T>
struct LayerNormForwardArgs {
  const T* x = nullptr;       // [rows, cols]
  T* y = nullptr;             // [rows, cols]; may be x itself (in place)
  const W* weight = nullptr;  // [cols], or null: w = 1
  const W* bias = nullptr;    // [cols], or null: b = 0
  float* mean = nullptr;      // [rows] fp32, or null: not saved
  float* rstd = nullptr;      // [rows] fp32, or null: not saved
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t x_stride = 0;
  std::int64_t y_stride = 0;
  float eps = 1e-5f;  // torch's default
};

template <class T, class W = T>
struct LayerNormBackwardArgs {
  const T* dy = nullptr;        // [rows, cols] upstream gradient
  const T* x = nullptr;         // [rows, cols] the forward's input
  const W* weight = nullptr;    // [cols], or null if the forward had none
  const float* mean = nullptr;  // [rows] saved by the forward (required)
  const float* rstd = nullptr;  // [rows] saved by the forward (required)
  T* dx = nullptr;              // [rows, cols]; may be dy or x itself (in place)
  W* dweight = nullptr;         // [cols], or null: not computed. Needs weight and the workspace.
  W* dbias = nullptr;           // [cols], or null: not computed. Needs the workspace.
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dy_stride = 0;
  std::int64_t x_stride = 0;
  std::int64_t dx_stride = 0;
  bool accumulate_dweight = false;  // dweight and dbias += gradient instead of =
  void* workspace = nullptr;        // layer_norm_backward_workspace_bytes() bytes, 16-byte aligned
  std::size_t workspace_bytes = 0;
};

// ------------------------------------------------------------------------------------------------
// 2. Math: one row element at a time, in fp32, on host and device
// ------------------------------------------------------------------------------------------------

namespace layer_norm_math {

TIGON_HD float mean(float sum, std::int64_t cols) { return sum / static_cast<float>(cols); }

// 1 / sqrt(var + eps) from the sum of squared deviations from the mean (the biased variance).
TIGON_HD float rstd(float centred_sum_sq, std::int64_t cols, float eps) {
  return rsqrt_f32(centred_sum_sq / static_cast<float>(cols) + eps);
}

// y before its rounding to T; w = 1 and b = 0 stand for a missing weight or bias.
TIGON_HD float forward(float x, float mean, float rstd, float w, float b) {
  return (x - mean) * rstd * w + b;
}

// Backward, all in fp32, with xhat = (x - mean) * rstd and g = dy * w (dy without a weight):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
//   dW = sum over rows of dy * xhat,   dB = sum over rows of dy.
TIGON_HD float dx(float g, float xhat, float rstd, float mean_g, float mean_g_xhat) {
  return rstd * (g - mean_g - xhat * mean_g_xhat);
}

TIGON_HD float dweight_term(float dy, float xhat) { return dy * xhat; }

}  // namespace layer_norm_math

// ------------------------------------------------------------------------------------------------
// Validation (host only, before anything touches the device)
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class W>
Status validate(const LayerNormForwardArgs<T, W>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.y, op, "y"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRowMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.x_stride, a.cols, op, "x_stride"));
  TIGON_CHECK(row_stride(a.y_stride, a.cols, op, "y_stride"));
  if (!(a.eps >= 0.0f) || a.eps == __builtin_inff()) {
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  const MatrixView x = MatrixView::of(a.x, a.rows, a.cols, a.x_stride);
  const MatrixView y = MatrixView::of(a.y, a.rows, a.cols, a.y_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView b = MatrixView::of(a.bias, 1, a.cols, 0);
  const MatrixView m = MatrixView::of(a.mean, 1, a.rows, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  TIGON_CHECK(same_or_disjoint(y, x, op, "y", "x"));
  TIGON_CHECK(disjoint(y, w, op, "y", "weight"));
  TIGON_CHECK(disjoint(y, b, op, "y", "bias"));
  for (const auto& [stat, name] : {std::pair{m, "mean"}, std::pair{r, "rstd"}}) {
    if (stat.ptr == nullptr) continue;
    TIGON_CHECK(disjoint(stat, x, op, name, "x"));
    TIGON_CHECK(disjoint(stat, y, op, name, "y"));
    TIGON_CHECK(disjoint(stat, w, op, name, "weight"));
    TIGON_CHECK(disjoint(stat, b, op, name, "bias"));
  }
  TIGON_CHECK(disjoint(r, m, op, "rstd", "mean"));
  return Status();
}

// Gradients reduced over the rows through the workspace: dW and / or dB.
template <class T, class W>
int layer_norm_grads(const LayerNormBackwardArgs<T, W>& a) {
  return (a.dweight != nullptr ? 1 : 0) + (a.dbias != nullptr ? 1 : 0);
}

// with_workspace: the launcher (true) also checks what it can of the workspace without the device
// (present, aligned, at least one partial row per gradient); the exact size is checked after the
// plan. The workspace query passes false.
template <class T, class W>
Status validate(const LayerNormBackwardArgs<T, W>& a, const char* op, bool with_workspace) {
  using namespace check;
  TIGON_CHECK(not_null(a.dy, op, "dy"));
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.mean, op, "mean"));
  TIGON_CHECK(not_null(a.rstd, op, "rstd"));
  TIGON_CHECK(not_null(a.dx, op, "dx"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRowMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.dy_stride, a.cols, op, "dy_stride"));
  TIGON_CHECK(row_stride(a.x_stride, a.cols, op, "x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.cols, op, "dx_stride"));
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without weight has no dW)");
  }
  const MatrixView dy = MatrixView::of(a.dy, a.rows, a.cols, a.dy_stride);
  const MatrixView x = MatrixView::of(a.x, a.rows, a.cols, a.x_stride);
  const MatrixView dx = MatrixView::of(a.dx, a.rows, a.cols, a.dx_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView m = MatrixView::of(a.mean, 1, a.rows, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  const MatrixView dw = MatrixView::of(a.dweight, 1, a.cols, 0);
  const MatrixView db = MatrixView::of(a.dbias, 1, a.cols, 0);
  TIGON_CHECK(same_or_disjoint(dx, dy, op, "dx", "dy"));
  TIGON_CHECK(same_or_disjoint(dx, x, op, "dx", "x"));
  TIGON_CHECK(disjoint(dx, w, op, "dx", "weight"));
  TIGON_CHECK(disjoint(dx, m, op, "dx", "mean"));
  TIGON_CHECK(disjoint(dx, r, op, "dx", "rstd"));
  for (const auto& [grad, name] : {std::pair{dw, "dweight"}, std::pair{db, "dbias"}}) {
    if (grad.ptr == nullptr) continue;
    TIGON_CHECK(disjoint(grad, dy, op, name, "dy"));
    TIGON_CHECK(disjoint(grad, x, op, name, "x"));
    TIGON_CHECK(disjoint(grad, dx, op, name, "dx"));
    TIGON_CHECK(disjoint(grad, w, op, name, "weight"));
    TIGON_CHECK(disjoint(grad, m, op, name, "mean"));
    TIGON_CHECK(disjoint(grad, r, op, name, "rstd"));
  }
  TIGON_CHECK(disjoint(db, dw, op, "dbias", "dweight"));
  const int grads = layer_norm_grads(a);
  if (with_workspace && grads > 0) {
    // Every plan has at least one partial row per gradient.
    TIGON_CHECK(workspace(a.workspace, a.workspace_bytes,
                          partial_rows_bytes(grads, a.cols), op));
  }
  return Status();
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Launch shapes (host + device constants; tested on the host)
// ------------------------------------------------------------------------------------------------

// Tuning knobs of the compiled (fixed hidden size) kernels, as RmsNormPolicy's (less the casting
// mode, which LayerNorm does not have). A trainer may pass its own policy.
template <int kFwdVecPerThread_ = 4, int kFwdBlockThreads_ = 256, int kBwdVecPerThread_ = 2,
          int kBwdBlockThreads_ = 512, int kBwdMinBlocksPerSm_ = 1, int kStages_ = 3,
          bool kFwdPersistent_ = false, bool kStreamingStores_ = false, bool kBwdKeepRows_ = false,
          bool kFwdDirect_ = true, int kFwdMinBlocksPerSm_ = 0, int kFwdPrefetch_ = 2>
struct LayerNormPolicy {
  static_assert(kFwdMinBlocksPerSm_ >= 0 && kFwdMinBlocksPerSm_ <= 32, "0 (no bound) to 32 blocks per SM");
  static_assert(kFwdPrefetch_ >= 0 && kFwdPrefetch_ <= 2, "forward prefetch: 0, 1 or 2");
  // Forward: what the blocks ask the L2 for around the grid-dependency wait, as RmsNormPolicy's
  // (2, the default: the first wave its rows before the wait and the second wave's after it).
  static constexpr int kFwdPrefetch = kFwdPrefetch_;
  // Forward: the second __launch_bounds__ argument, a floor on the blocks per SM that caps
  // registers (0, the default: none), as RmsNormPolicy's.
  static constexpr int kFwdMinBlocksPerSm = kFwdMinBlocksPerSm_;
  // Non-persistent forward: each thread reads its vectors of the row straight from global memory
  // into registers (true: the default, 0.7-1.3 points faster than staging at 16384 x 4096 on the
  // H200 in two runs), or the row is staged through shared memory with cp.async (false).
  static constexpr bool kFwdDirect = kFwdDirect_;
  static constexpr int kFwdVecPerThread = kFwdVecPerThread_;  // 16-byte vectors per thread per row
  static constexpr int kFwdBlockThreads = kFwdBlockThreads_;  // target block size (rows side by side)
  static constexpr int kBwdVecPerThread = kBwdVecPerThread_;
  static constexpr int kBwdBlockThreads = kBwdBlockThreads_;
  static constexpr int kBwdMinBlocksPerSm = kBwdMinBlocksPerSm_;  // caps registers for occupancy
  // Rows each row group keeps in flight through shared memory (cp.async), lowered automatically
  // when the rows do not fit.
  static constexpr int kStages = kStages_;
  // Forward grid: resident blocks walking all rows (true), or one block per row-group set (false:
  // the default, as RMSNorm's, whose forward streams closer to the copy rate so on the H200).
  static constexpr bool kFwdPersistent = kFwdPersistent_;
  // Store y / dx with the streaming (evict-first) cache hint.
  static constexpr bool kStreamingStores = kStreamingStores_;
  // Backward: keep the row's x and dy in registers between the row sums and dx (true: RMSNorm's
  // default), or read them again from shared memory (false: the default here, fewer registers;
  // on the H200 at 16384 x 4096 it led keeping by 3-5 points of the copy rate in four runs out
  // of five, level in the other). w is read once per thread either way.
  static constexpr bool kBwdKeepRows = kBwdKeepRows_;
};
using LayerNormDefaultPolicy = LayerNormPolicy<>;

namespace detail {

// A non-persistent forward walks one row per group: one stage is all it uses.
template <class T, int kCols, class P>
using LnFwdPipe =
    RowPipeline<FwdRowShape<T, kCols, P>, T, kCols, 1, P::kFwdPersistent ? P::kStages : 1>;  // x
// The direct forward (non-persistent, kFwdDirect): no stages, no shared memory.
template <class P>
inline constexpr bool kLnFwdDirect = P::kFwdDirect && !P::kFwdPersistent;
template <class T, int kCols, class P>
inline constexpr int kLnFwdStages = kLnFwdDirect<P> ? 0 : LnFwdPipe<T, kCols, P>::kStages;
template <class T, int kCols, class P>
inline constexpr int kLnFwdSmem = kLnFwdDirect<P> ? 0 : LnFwdPipe<T, kCols, P>::kSmemBytes;
template <class T, int kCols, class P>
using LnBwdPipe = RowPipeline<BwdRowShape<T, kCols, P>, T, kCols, 2, P::kStages>;  // x, dy

inline constexpr int kLnGeneralThreads = 256;  // block of the general (any size) kernels
inline constexpr int kLnGeneralBwdBlocksPerSm = 2;
// The general backward accumulates dW and dB in shared memory up to this row length (2 x 22 KB,
// under the 48 KB default), in the workspace beyond it.
inline constexpr std::int64_t kLnGeneralSmemAccCols = 5632;

// Workspace of the backward: `parts` fp32 partial rows for each requested gradient (dW, then dB).
constexpr std::size_t layer_norm_workspace_bytes(std::int64_t parts, std::int64_t cols, int grads) {
  return grads == 0 ? 0 : partial_rows_bytes(parts * grads, cols);
}

}  // namespace detail

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class W>
struct LnFwdParams {
  const T* x;
  T* y;
  const W* w;
  const W* b;
  float* mean;
  float* rstd;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t xs, ys;
  float eps;
  std::int64_t wave_blocks = 0;  // compiled kernel: blocks resident at once (set at launch)
};

template <class T, class W>
struct LnBwdParams {
  const T* dy;
  const T* x;
  const W* w;
  const float* mean;
  const float* rstd;
  T* dx;
  float* dw_part;  // [parts, cols] partial dW rows, or null when dW is not wanted
  float* db_part;  // [parts, cols] partial dB rows, or null when dB is not wanted
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t dys, xs, dxs;
};

// Fixed hidden size: a row group owns one row at a time, with the next kStages - 1 rows in flight
// through shared memory (pipelined_rows); the row stays in registers for its three uses (sum,
// centred sum of squares, output), so it is read from DRAM once. Two group reductions per row.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(FwdRowShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    layer_norm_fwd_kernel(const LnFwdParams<T, W> p) {
  using S = FwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = kLnFwdStages<T, kCols, P>;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_w = p.w != nullptr;
  const bool has_b = p.b != nullptr;
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  // L2 prefetches around the wait (policy kFwdPrefetch): hints, not accesses.
  const bool first_wave = blockIdx.x < p.wave_blocks;
  prefetch_first_row<P::kFwdPrefetch, S>(p.x, p.xs, first, p.rows, first_wave, t);
  detail::grid_dependency_sync();
  prefetch_second_wave_row<P::kFwdPrefetch, S>(p.x, p.xs, first + p.wave_blocks * S::kGroups, p.rows,
                                               first_wave, t);
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  const T* const src[1] = {p.x};
  const std::int64_t stride[1] = {p.xs};
  int parity = 0;

  pipelined_rows<S, kCols, kStages, 1>(stages, src, stride, p.rows, first, step, t,
                                       [&](std::int64_t row, const T* xr) {
    AlignedVec<T, kV> xv[kVPT];
    float sum[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        xv[v] = load_vec<kV>(xr + i * kV);
#pragma unroll
        for (int c = 0; c < kV; ++c) sum[0] += to_float(xv[v].v[c]);
      }
    }
    Reduce::sum(sum, tmp, g, t, parity);
    parity ^= 1;
    const float mean = layer_norm_math::mean(sum[0], kCols);
    float sq[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float d = to_float(xv[v].v[c]) - mean;
          sq[0] += d * d;
        }
      }
    }
    Reduce::sum(sq, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = layer_norm_math::rstd(sq[0], kCols, p.eps);
    if (t == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      if (p.rstd != nullptr) p.rstd[row] = rstd;
    }
    T* yr = p.y + row * p.ys;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        // w and b as fp32, with explicit 1 / 0 when absent: written as `has_w ? w : 1` per
        // element, ptxas kept both rows' vectors live across the reductions (117 registers at
        // 4096 bf16 instead of 63).
        float wf[kV], bf[kV];
        if (has_w) {
          const AlignedVec<W, kV> wv = load_vec<kV>(p.w + i * kV);
#pragma unroll
          for (int c = 0; c < kV; ++c) wf[c] = to_float(wv.v[c]);
        } else {
#pragma unroll
          for (int c = 0; c < kV; ++c) wf[c] = 1.0f;
        }
        if (has_b) {
          const AlignedVec<W, kV> bv = load_vec<kV>(p.b + i * kV);
#pragma unroll
          for (int c = 0; c < kV; ++c) bf[c] = to_float(bv.v[c]);
        } else {
#pragma unroll
          for (int c = 0; c < kV; ++c) bf[c] = 0.0f;
        }
        AlignedVec<T, kV> yv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          yv.v[c] = from_float<T>(layer_norm_math::forward(to_float(xv[v].v[c]), mean, rstd, wf[c], bf[c]));
        }
        store_vec_hinted<P::kStreamingStores>(yr + i * kV, yv);
      }
    }
  });
}

// Fixed hidden size backward: the same pipeline over x and dy; one group reduction per row (sum of
// g and of g * (x - mean)); each thread keeps its columns' dW and dB in registers across all the
// rows it visits, and each row group writes one partial row of each at the end. The saved mean and
// rstd of the next row are loaded while the current one is computed.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(BwdRowShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    layer_norm_bwd_kernel(const LnBwdParams<T, W> p) {
  detail::grid_dependency_sync();
  using S = BwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = LnBwdPipe<T, kCols, P>::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool want_dw = p.dw_part != nullptr;
  const bool want_db = p.db_part != nullptr;
  // [group][stage][x | dy][kCols]
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * 2 * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  const T* const src[2] = {p.x, p.dy};
  const std::int64_t stride[2] = {p.xs, p.dys};

  // dW / dB accumulators, and w of this thread's columns as fp32, read once.
  float acc_w[kVPT][kV] = {}, acc_b[kVPT][kV] = {};
  float wk[kVPT][kV];
  load_row_weights<S, false>(p.w, 0.0f, t, wk);
  float next_mean = 0.0f, next_rstd = 0.0f;
  if (first < p.rows) {
    next_mean = p.mean[first];
    next_rstd = p.rstd[first];
  }
  int parity = 0;

  pipelined_rows<S, kCols, kStages, 2>(stages, src, stride, p.rows, first, step, t,
                                       [&](std::int64_t row, const T* xr) {
    const T* dyr = xr + kCols;
    const float mean = next_mean;
    const float rstd = next_rstd;
    if (row + step < p.rows) {
      next_mean = p.mean[row + step];
      next_rstd = p.rstd[row + step];
    }
    AlignedVec<T, kV> xk[kVPT], dyk[kVPT];
    float s[2] = {0.0f, 0.0f};  // sum(g), sum(g * (x - mean))
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        xk[v] = load_vec<kV>(xr + i * kV);
        dyk[v] = load_vec<kV>(dyr + i * kV);
        float xf[kV], dyf[kV];
        to_floats(xk[v], xf);
        to_floats(dyk[v], dyf);
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float gr = dyf[c] * wk[v][c];
          s[0] += gr;
          s[1] += gr * (xf[c] - mean);
        }
      }
    }
    Reduce::sum(s, tmp, g, t, parity);
    parity ^= 1;
    const float mean_g = s[0] / static_cast<float>(kCols);
    const float mean_g_xhat = rstd * s[1] / static_cast<float>(kCols);
    T* dxr = p.dx + row * p.dxs;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        // The row again: from the registers of the first loop, or re-read from shared memory.
        AlignedVec<T, kV> xv, dyv;
        if constexpr (P::kBwdKeepRows) {
          xv = xk[v];
          dyv = dyk[v];
        } else {
          xv = load_vec<kV>(xr + i * kV);
          dyv = load_vec<kV>(dyr + i * kV);
        }
        float xf[kV], dyf[kV];
        to_floats(xv, xf);
        to_floats(dyv, dyf);
        AlignedVec<T, kV> dxv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float xhat = (xf[c] - mean) * rstd;
          const float gr = dyf[c] * wk[v][c];
          dxv.v[c] = from_float<T>(layer_norm_math::dx(gr, xhat, rstd, mean_g, mean_g_xhat));
          if (want_dw) acc_w[v][c] += layer_norm_math::dweight_term(dyf[c], xhat);
          if (want_db) acc_b[v][c] += dyf[c];
        }
        store_vec_hinted<P::kStreamingStores>(dxr + i * kV, dxv);
      }
    }
  });

  // One partial row per row group (no cross-group combine, so no block-wide barrier here).
  const std::int64_t part = (static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g) * kCols;
  if (want_dw) store_partial_row<S>(p.dw_part + part, acc_w, t);
  if (want_db) store_partial_row<S>(p.db_part + part, acc_b, t);
}

// Any hidden size: one row per block at a time, three passes over the row (sum, centred sum of
// squares, output; the second and third are served from L1/L2), kV = 16-byte vectors when
// pointers and strides allow it, else single elements.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kLnGeneralThreads)
    layer_norm_fwd_general_kernel(const LnFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kLnGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  const bool has_b = p.b != nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = p.x + row * p.xs;
    float sum[1] = {0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + static_cast<std::int64_t>(i) * kV);
#pragma unroll
      for (int k = 0; k < kV; ++k) sum[0] += to_float(xv.v[k]);
    }
    Reduce::sum(sum, tmp);
    const float mean = layer_norm_math::mean(sum[0], p.cols);
    float sq[1] = {0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + static_cast<std::int64_t>(i) * kV);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float d = to_float(xv.v[k]) - mean;
        sq[0] += d * d;
      }
    }
    Reduce::sum(sq, tmp);
    const float rstd = layer_norm_math::rstd(sq[0], p.cols, p.eps);
    if (threadIdx.x == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      if (p.rstd != nullptr) p.rstd[row] = rstd;
    }
    T* yr = p.y + row * p.ys;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<W, kV> wv, bv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      if (has_b) bv = load_vec<kV>(p.b + c);
      AlignedVec<T, kV> yv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        yv.v[k] = from_float<T>(layer_norm_math::forward(to_float(xv.v[k]), mean, rstd,
                                                         has_w ? to_float(wv.v[k]) : 1.0f,
                                                         has_b ? to_float(bv.v[k]) : 0.0f));
      }
      store_vec(yr + c, yv);
    }
  }
}

// Any hidden size backward. dW and dB are accumulated per block in shared memory when the row fits
// (kLnGeneralSmemAccCols), else directly in the block's partial rows of the workspace; each column
// belongs to one thread, so either way the sums are race-free and in a fixed order.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kLnGeneralThreads)
    layer_norm_bwd_general_kernel(const LnBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kLnGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ float smem_dw[];  // [dW | dB][cols] when smem_acc
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  const bool want_dw = p.dw_part != nullptr;
  const bool want_db = p.db_part != nullptr;
  const std::int64_t part = static_cast<std::int64_t>(blockIdx.x) * p.cols;
  float* acc_w = want_dw ? (smem_acc ? smem_dw : p.dw_part + part) : nullptr;
  float* acc_b = want_db ? (smem_acc ? smem_dw + p.cols : p.db_part + part) : nullptr;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      if (want_dw) acc_w[i * kV + k] = 0.0f;
      if (want_db) acc_b[i * kV + k] = 0.0f;
    }
  }
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* dyr = p.dy + row * p.dys;
    const T* xr = p.x + row * p.xs;
    const float mean = p.mean[row];
    const float rstd = p.rstd[row];
    float s[2] = {0.0f, 0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float gr = to_float(dyv.v[k]) * (has_w ? to_float(wv.v[k]) : 1.0f);
        s[0] += gr;
        s[1] += gr * (to_float(xv.v[k]) - mean);
      }
    }
    Reduce::sum(s, tmp);
    const float mean_g = s[0] / static_cast<float>(p.cols);
    const float mean_g_xhat = rstd * s[1] / static_cast<float>(p.cols);
    T* dxr = p.dx + row * p.dxs;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> dxv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float xhat = (to_float(xv.v[k]) - mean) * rstd;
        const float dyf = to_float(dyv.v[k]);
        const float gr = dyf * (has_w ? to_float(wv.v[k]) : 1.0f);
        dxv.v[k] = from_float<T>(layer_norm_math::dx(gr, xhat, rstd, mean_g, mean_g_xhat));
        if (want_dw) acc_w[c + k] += layer_norm_math::dweight_term(dyf, xhat);
        if (want_db) acc_b[c + k] += dyf;
      }
      store_vec(dxr + c, dxv);
    }
  }
  if (smem_acc) {
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        if (want_dw) p.dw_part[part + i * kV + k] = acc_w[i * kV + k];
        if (want_db) p.db_part[part + i * kV + k] = acc_b[i * kV + k];
      }
    }
  }
}

// ---- launch planning: which kernel, what grid, how much workspace -----------------------------

namespace ln {

template <class T, class W, int kV>
bool fwd_vectorizable(const LnFwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.y, p.ys, kV) &&
         (p.w == nullptr || is_aligned(p.w, kV * sizeof(W))) &&
         (p.b == nullptr || is_aligned(p.b, kV * sizeof(W)));
}

template <class T, class W, int kV>
bool bwd_vectorizable(const LnBwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) && rows_aligned(p.x, p.xs, kV) &&
         rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
}

template <class T, class W>
LnFwdParams<T, W> fwd_params(const LayerNormForwardArgs<T, W>& a) {
  return {a.x,    a.y,    a.weight, a.bias, a.mean, a.rstd, a.rows, a.cols,
          a.x_stride ? a.x_stride : a.cols, a.y_stride ? a.y_stride : a.cols, a.eps};
}

template <class T, class W>
LnBwdParams<T, W> bwd_params(const LayerNormBackwardArgs<T, W>& a) {
  return {a.dy,   a.x,    a.weight, a.mean, a.rstd, a.dx, nullptr, nullptr, a.rows, a.cols,
          a.dy_stride ? a.dy_stride : a.cols, a.x_stride ? a.x_stride : a.cols,
          a.dx_stride ? a.dx_stride : a.cols};
}

// kCols == 0: only the general kernels are candidates.
template <class T, class W, int kCols, class P>
Status plan_forward(const LnFwdParams<T, W>& p, const DeviceInfo& dev, RowPlan& plan) {
  plan = RowPlan{};
  if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
    using S = FwdRowShape<T, kCols, P>;
    constexpr int kSmem = kLnFwdSmem<T, kCols, P>;
    // The compiled kernel's shared-memory pipeline must fit this device's per-block limit.
    if (fwd_vectorizable<T, W, S::kVec>(p) && kSmem + 1024 <= dev.smem_per_block_optin) {
      return plan_compiled_rows<layer_norm_fwd_kernel<T, W, kCols, P>, S::kThreads, kSmem>(
          p.rows, S::kGroups, P::kFwdPersistent, dev, plan);
    }
  }
  int occ = 0;
  if (fwd_vectorizable<T, W, kVecElems<T>>(p)) {
    plan.kernel = RowKernel::general_vec;
    TIGON_CHECK((blocks_per_sm<layer_norm_fwd_general_kernel<T, W, kVecElems<T>>, kLnGeneralThreads>(
        dev.device, occ)));
  } else {
    plan.kernel = RowKernel::general_scalar;
    TIGON_CHECK((blocks_per_sm<layer_norm_fwd_general_kernel<T, W, 1>, kLnGeneralThreads>(dev.device, occ)));
  }
  plan.grid = static_cast<int>(
      std::min<std::int64_t>(p.rows, static_cast<std::int64_t>(occ) * dev.sm_count));
  return Status();
}

template <class T, class W, int kCols, class P>
Status plan_backward(const LnBwdParams<T, W>& p, int grads, const DeviceInfo& dev, RowPlan& plan) {
  plan = RowPlan{};
  bool compiled = false;
  if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
    using S = BwdRowShape<T, kCols, P>;
    constexpr int kSmem = LnBwdPipe<T, kCols, P>::kSmemBytes;
    if (bwd_vectorizable<T, W, S::kVec>(p) && kSmem + 1024 <= dev.smem_per_block_optin) {
      TIGON_CHECK((plan_compiled_rows<layer_norm_bwd_kernel<T, W, kCols, P>, S::kThreads, kSmem>(
          p.rows, S::kGroups, true, dev, plan)));
      compiled = true;
    }
  }
  if (!compiled) {
    plan.kernel = bwd_vectorizable<T, W, kVecElems<T>>(p) ? RowKernel::general_vec
                                                          : RowKernel::general_scalar;
    plan.grid = static_cast<int>(std::min<std::int64_t>(
        p.rows, static_cast<std::int64_t>(kLnGeneralBwdBlocksPerSm) * dev.sm_count));
    plan.parts = plan.grid;
  }
  plan.workspace_bytes = layer_norm_workspace_bytes(plan.parts, p.cols, grads);
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_forward(const LnFwdParams<T, W>& p, const RowPlan& plan, cudaStream_t stream) {
  constexpr const char* kOp = "layer_norm_forward";
  switch (plan.kernel) {
    case RowKernel::compiled:
      if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
        LnFwdParams<T, W> q = p;
        q.wave_blocks = plan.resident;
        TIGON_CHECK(launch(kOp, layer_norm_fwd_kernel<T, W, kCols, P>, {dim3(plan.grid), dim3(FwdRowShape<T, kCols, P>::kThreads), kLnFwdSmem<T, kCols, P>, stream}, q));
      }
      break;
    case RowKernel::general_vec:
      TIGON_CHECK(launch(kOp, layer_norm_fwd_general_kernel<T, W, kVecElems<T>>, {dim3(plan.grid), dim3(kLnGeneralThreads), 0, stream}, p));
      break;
    case RowKernel::general_scalar:
      TIGON_CHECK(launch(kOp, layer_norm_fwd_general_kernel<T, W, 1>, {dim3(plan.grid), dim3(kLnGeneralThreads), 0, stream}, p));
      break;
  }
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_backward(const LnBwdParams<T, W>& p, const RowPlan& plan, W* dweight, W* dbias,
                       bool accumulate, cudaStream_t stream) {
  constexpr const char* kOp = "layer_norm_backward";
  if (plan.kernel == RowKernel::compiled) {
    if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
      TIGON_CHECK(launch(kOp, layer_norm_bwd_kernel<T, W, kCols, P>, {dim3(plan.grid), dim3(BwdRowShape<T, kCols, P>::kThreads), LnBwdPipe<T, kCols, P>::kSmemBytes, stream}, p));
    }
  } else {
    const bool smem_acc =
        (p.dw_part != nullptr || p.db_part != nullptr) && p.cols <= kLnGeneralSmemAccCols;
    const std::size_t smem = smem_acc ? 2 * static_cast<std::size_t>(p.cols) * sizeof(float) : 0;
    if (plan.kernel == RowKernel::general_vec) {
      TIGON_CHECK(launch(kOp, layer_norm_bwd_general_kernel<T, W, kVecElems<T>>, {dim3(plan.grid), dim3(kLnGeneralThreads), smem, stream}, p, smem_acc));
    } else {
      TIGON_CHECK(launch(kOp, layer_norm_bwd_general_kernel<T, W, 1>, {dim3(plan.grid), dim3(kLnGeneralThreads), smem, stream}, p, smem_acc));
    }
  }
  // dW and dB: one launch (either may be absent).
  if (dweight == nullptr && dbias == nullptr) return Status();
  return column_sums(dweight != nullptr ? p.dw_part : p.db_part, dweight != nullptr ? dweight : dbias,
                     dweight != nullptr && dbias != nullptr ? p.db_part : nullptr,
                     dweight != nullptr ? dbias : nullptr, plan.parts, p.cols, accumulate, stream, kOp);
}

// Forward / backward for one candidate size (0: general only).
template <class T, class W, int kCols, class P>
Status forward(const LayerNormForwardArgs<T, W>& a, cudaStream_t stream) {
  const LnFwdParams<T, W> p = fwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_forward<T, W, kCols, P>(p, dev, plan)));
  return launch_forward<T, W, kCols, P>(p, plan, stream);
}

template <class T, class W, int kCols, class P>
Status backward_workspace(const LayerNormBackwardArgs<T, W>& a, std::size_t& bytes) {
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(bwd_params(a), layer_norm_grads(a), dev, plan)));
  bytes = plan.workspace_bytes;
  return Status();
}

template <class T, class W, int kCols, class P>
Status backward(const LayerNormBackwardArgs<T, W>& a, cudaStream_t stream) {
  constexpr const char* kOp = "layer_norm_backward";
  LnBwdParams<T, W> p = bwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(p, layer_norm_grads(a), dev, plan)));
  TIGON_CHECK(check::workspace(a.workspace, a.workspace_bytes, plan.workspace_bytes, kOp));
  // Workspace: [dW partial rows][dB partial rows], each present only when requested.
  float* ws = static_cast<float*>(a.workspace);
  const std::int64_t rows_of_parts = static_cast<std::int64_t>(plan.parts) * p.cols;
  if (a.dweight != nullptr) p.dw_part = ws;
  if (a.dbias != nullptr) p.db_part = ws + (a.dweight != nullptr ? rows_of_parts : 0);
  return launch_backward<T, W, kCols, P>(p, plan, a.dweight, a.dbias, a.accumulate_dweight, stream);
}

template <int kCols>
Status check_compiled(std::int64_t cols, const char* op) {
  if (cols == kCols) return Status();
  return Status::error(Errc::invalid_size, op, "cols",
                       std::to_string(cols) + " does not match the compiled hidden size " +
                           std::to_string(kCols));
}

}  // namespace ln

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: layer_norm_forward(args, stream) picks the compiled instance for the sizes
// in TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do
// not allow 16-byte accesses. Compile-time hidden size: layer_norm_forward<bf16, 4096>(args,
// stream) instantiates only that shape (plus the general kernel for misaligned inputs).
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status layer_norm_forward(const LayerNormForwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "layer_norm_forward"));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) { return detail::ln::forward<T, W, decltype(n)::value, LayerNormDefaultPolicy>(args, stream); },
      [&] { return detail::ln::forward<T, W, 0, LayerNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = LayerNormDefaultPolicy, class W>
[[nodiscard]] Status layer_norm_forward(const LayerNormForwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "layer_norm_forward"));
  TIGON_CHECK(detail::ln::check_compiled<kCols>(args.cols, "layer_norm_forward"));
  return detail::ln::forward<T, W, kCols, Policy>(args, stream);
}

// Bytes of workspace layer_norm_backward(args) needs: 0 without dweight and dbias, else one fp32
// row of partial sums per row group of the launch per requested gradient (a function of the
// device, the shape and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status layer_norm_backward_workspace_bytes(const LayerNormBackwardArgs<T, W>& args,
                                                         std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "layer_norm_backward_workspace_bytes", false));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) {
        return detail::ln::backward_workspace<T, W, decltype(n)::value, LayerNormDefaultPolicy>(args, bytes);
      },
      [&] { return detail::ln::backward_workspace<T, W, 0, LayerNormDefaultPolicy>(args, bytes); });
}

template <class T, int kCols, class Policy = LayerNormDefaultPolicy, class W>
[[nodiscard]] Status layer_norm_backward_workspace_bytes(const LayerNormBackwardArgs<T, W>& args,
                                                         std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "layer_norm_backward_workspace_bytes", false));
  TIGON_CHECK(detail::ln::check_compiled<kCols>(args.cols, "layer_norm_backward_workspace_bytes"));
  return detail::ln::backward_workspace<T, W, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status layer_norm_backward(const LayerNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "layer_norm_backward", true));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) { return detail::ln::backward<T, W, decltype(n)::value, LayerNormDefaultPolicy>(args, stream); },
      [&] { return detail::ln::backward<T, W, 0, LayerNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = LayerNormDefaultPolicy, class W>
[[nodiscard]] Status layer_norm_backward(const LayerNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "layer_norm_backward", true));
  TIGON_CHECK(detail::ln::check_compiled<kCols>(args.cols, "layer_norm_backward"));
  return detail::ln::backward<T, W, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
