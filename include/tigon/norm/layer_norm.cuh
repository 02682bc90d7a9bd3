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
// column sum of dW and dB), the plan and the launches the norms' shared layer (norm/launch.cuh).
// The header reads in four layers: arguments, math (host + device), kernels, launchers.
// Arguments, math, validation and the policy compile under any C++20 compiler; kernels and
// launchers need nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "launch.cuh"
#include "row_kernel.cuh"

#if defined(__CUDACC__)
#include "../core/colsum.cuh"
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
  TIGON_CHECK(check_not_null({{a.x, "x"}, {a.y, "y"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols, {{a.x_stride, "x_stride"}, {a.y_stride, "y_stride"}}, op));
  TIGON_CHECK(check_eps(a.eps, op));
  const Named x = matrix(a.x, a.rows, a.cols, a.x_stride, "x");
  const Named y = matrix(a.y, a.rows, a.cols, a.y_stride, "y");
  const Named w = row_vector(a.weight, a.cols, "weight");
  const Named b = row_vector(a.bias, a.cols, "bias");
  const Named m = row_vector(a.mean, a.rows, "mean");
  const Named r = row_vector(a.rstd, a.rows, "rstd");
  TIGON_CHECK(check_same_or_disjoint(y, {x}, op));
  TIGON_CHECK(check_disjoint(y, {w, b}, op));
  TIGON_CHECK(check_disjoint(m, {x, y, w, b}, op));
  TIGON_CHECK(check_disjoint(r, {x, y, w, b, m}, op));
  return Status();
}

// Gradients reduced over the rows through the workspace: dW and / or dB.
template <class T, class W>
int layer_norm_grads(const LayerNormBackwardArgs<T, W>& a) {
  return (a.dweight != nullptr ? 1 : 0) + (a.dbias != nullptr ? 1 : 0);
}

// with_workspace: the launcher (true) also checks what it can of the workspace without the device;
// the workspace query passes false.
template <class T, class W>
Status validate(const LayerNormBackwardArgs<T, W>& a, const char* op, bool with_workspace, std::size_t used = 0) {
  TIGON_CHECK(check_not_null(
      {{a.dy, "dy"}, {a.x, "x"}, {a.mean, "mean"}, {a.rstd, "rstd"}, {a.dx, "dx"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols,
                         {{a.dy_stride, "dy_stride"}, {a.x_stride, "x_stride"}, {a.dx_stride, "dx_stride"}},
                         op));
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without weight has no dW)");
  }
  const Named dy = matrix(a.dy, a.rows, a.cols, a.dy_stride, "dy");
  const Named x = matrix(a.x, a.rows, a.cols, a.x_stride, "x");
  const Named dx = matrix(a.dx, a.rows, a.cols, a.dx_stride, "dx");
  const Named w = row_vector(a.weight, a.cols, "weight");
  const Named m = row_vector(a.mean, a.rows, "mean");
  const Named r = row_vector(a.rstd, a.rows, "rstd");
  const Named dw = row_vector(a.dweight, a.cols, "dweight");
  TIGON_CHECK(check_same_or_disjoint(dx, {dy, x}, op));
  TIGON_CHECK(check_disjoint(dx, {w, m, r}, op));
  TIGON_CHECK(check_disjoint(dw, {dy, x, dx, w, m, r}, op));
  const Named db = row_vector(a.dbias, a.cols, "dbias");
  TIGON_CHECK(check_disjoint(db, {dy, x, dx, w, m, r, dw}, op));
  return check_partials_workspace(with_workspace, layer_norm_grads(a), a.workspace, a.workspace_bytes,
                                  a.cols, op, {dy, x, dx, w, m, r, dw, db}, used);
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Policy
// ------------------------------------------------------------------------------------------------

// The tuning parameters of LayerNorm's compiled kernels (NormPolicy's members and defaults,
// norm/launch.cuh). Derive and override a member to tune:
//   struct WarpPerRow : tigon::LayerNormPolicy { static constexpr int kFwdVecPerThread = 16; };
struct LayerNormPolicy : NormPolicy {};
using LayerNormDefaultPolicy = LayerNormPolicy;  // the former name of the default

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

// Fixed hidden size: a row group owns one row; kGroups groups per block, one block per kGroups
// rows. Each thread loads its vectors of the row straight into registers, where they stay for
// their three uses (sum, centred sum of squares, output): x is read from DRAM once. Two group
// reductions per row. The L2 prefetch around the grid-dependency wait is RMSNorm's.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(FwdRowShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    layer_norm_fwd_kernel(const LnFwdParams<T, W> p) {
  using S = FwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_w = p.w != nullptr;
  const bool has_b = p.b != nullptr;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const bool first_wave = blockIdx.x < p.wave_blocks;
  prefetch_first_row<S>(p.x, p.xs, first, p.rows, first_wave, t);
  detail::grid_dependency_sync();
  prefetch_second_wave_row<S>(p.x, p.xs, first + p.wave_blocks * S::kGroups, p.rows, first_wave, t);
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  int parity = 0;

  direct_rows(p.x, p.xs, p.rows, first, step, [&](std::int64_t row, const T* xr) {
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
        store_vec(yr + i * kV, yv);
      }
    }
  });
}

// Fixed hidden size backward, on a persistent grid: each row group keeps the next kStages - 1 rows
// of x and dy in flight through shared memory (pipelined_rows); one group reduction per row (sum
// of g and of g * (x - mean)), after which dx reads the row again from shared memory; each thread
// keeps its columns' dW and dB in registers across all the rows it visits, and each row group
// writes one partial row of each at the end. The saved mean and rstd of the next row are loaded
// while the current one is computed.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(BwdRowShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    layer_norm_bwd_kernel(const LnBwdParams<T, W> p) {
  detail::grid_dependency_sync();
  using S = BwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = BwdRowPipe<T, kCols, P, 2>::kStages;
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
        // The row again, from shared memory (fewer registers than keeping it from the first loop).
        const AlignedVec<T, kV> xv = load_vec<kV>(xr + i * kV);
        const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + i * kV);
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
        store_vec(dxr + i * kV, dxv);
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
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    layer_norm_fwd_general_kernel(const LnFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kGeneralThreads;
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
// (kGeneralAccFloats), else directly in the block's partial rows of the workspace; each column
// belongs to one thread, so either way the sums are race-free and in a fixed order.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    layer_norm_bwd_general_kernel(const LnBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kGeneralThreads;
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

// ---- the ops: what the shared launch layer (norm/launch.cuh) needs of each direction -----------

template <class T_, class W>
struct LnFwdOp : SingleInstance {
  using T = T_;
  using Args = LayerNormForwardArgs<T, W>;
  using Params = LnFwdParams<T, W>;
  static constexpr const char* kName = "layer_norm_forward";
  static Status validate(const Args& a, const char* op) { return detail::validate(a, op); }
  static Params params(const Args& a) {
    return {a.x,    a.y,    a.weight, a.bias, a.mean, a.rstd, a.rows, a.cols,
            resolved_stride(a.x_stride, a.cols), resolved_stride(a.y_stride, a.cols), a.eps};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.y, p.ys, kV) &&
           (p.w == nullptr || is_aligned(p.w, kV * sizeof(W))) &&
           (p.b == nullptr || is_aligned(p.b, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &layer_norm_fwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &layer_norm_fwd_general_kernel<T, W, kV>; }
};

// dW and dB: `parts` partial rows each in the workspace, [dW partial rows][dB partial rows] (each
// present only when requested), summed by one column_sums launch.
template <class T_, class W>
struct LnBwdOp : SingleInstance {
  using T = T_;
  using Args = LayerNormBackwardArgs<T, W>;
  using Params = LnBwdParams<T, W>;
  static constexpr const char* kName = "layer_norm_backward";
  static constexpr const char* kWorkspaceName = "layer_norm_backward_workspace_bytes";
  static constexpr int kTensors = 2;  // x, dy
  static constexpr int kAccRows = 2;  // dW, dB
  static Status validate(const Args& a, const char* op, bool ws, std::size_t used = 0) {
    return detail::validate(a, op, ws, used);
  }
  static Params params(const Args& a) {
    return {a.dy,   a.x,    a.weight, a.mean, a.rstd, a.dx, nullptr, nullptr, a.rows, a.cols,
            resolved_stride(a.dy_stride, a.cols), resolved_stride(a.x_stride, a.cols),
            resolved_stride(a.dx_stride, a.cols)};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) && rows_aligned(p.x, p.xs, kV) &&
           rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &layer_norm_bwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &layer_norm_bwd_general_kernel<T, W, kV>; }
  static int grads(const Args& a) { return layer_norm_grads(a); }
  static void set_workspace(Params& p, const Args& a, float* ws, int parts) {
    const std::int64_t rows_of_parts = static_cast<std::int64_t>(parts) * p.cols;
    if (a.dweight != nullptr) p.dw_part = ws;
    if (a.dbias != nullptr) p.db_part = ws + (a.dweight != nullptr ? rows_of_parts : 0);
  }
  static Status sum_partials(const Params& p, const Args& a, int parts, cudaStream_t stream,
                             const char* op) {
    if (a.dweight == nullptr && a.dbias == nullptr) return Status();
    const bool both = a.dweight != nullptr && a.dbias != nullptr;
    return column_sums(a.dweight != nullptr ? p.dw_part : p.db_part,
                       a.dweight != nullptr ? a.dweight : a.dbias, both ? p.db_part : nullptr,
                       both ? a.dbias : nullptr, parts, p.cols, a.accumulate_dweight, stream, op);
  }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: layer_norm_forward(args, stream) picks the compiled instance for the sizes
// in TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do
// not allow 16-byte accesses. Compile-time hidden size: layer_norm_forward<bf16, 4096>(args,
// stream) instantiates only that shape (plus the general kernel for misaligned inputs), with the
// policy given (LayerNormPolicy by default).
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status layer_norm_forward(const LayerNormForwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_forward<detail::LnFwdOp<T, W>, detail::kAnyCols, LayerNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = LayerNormPolicy, class W>
[[nodiscard]] Status layer_norm_forward(const LayerNormForwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_forward<detail::LnFwdOp<T, W>, kCols, Policy>(args, stream);
}

// Bytes of workspace layer_norm_backward(args) needs: 0 without dweight and dbias, else one fp32
// row of partial sums per row group of the launch per requested gradient (a function of the
// device, the shape and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status layer_norm_backward_workspace_bytes(const LayerNormBackwardArgs<T, W>& args,
                                                         std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::LnBwdOp<T, W>, detail::kAnyCols, LayerNormPolicy>(
      args, bytes);
}

template <class T, int kCols, class Policy = LayerNormPolicy, class W>
[[nodiscard]] Status layer_norm_backward_workspace_bytes(const LayerNormBackwardArgs<T, W>& args,
                                                         std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::LnBwdOp<T, W>, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status layer_norm_backward(const LayerNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_backward<detail::LnBwdOp<T, W>, detail::kAnyCols, LayerNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = LayerNormPolicy, class W>
[[nodiscard]] Status layer_norm_backward(const LayerNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_backward<detail::LnBwdOp<T, W>, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
