// tigon/norm/add_rms_norm.cuh - fused residual add + RMSNorm, the pre-norm transformer step
// (`hidden_states = residual + hidden_states; y = norm(hidden_states)`), forward and backward:
//
//   s = T(x + residual)       (an fp32 add rounded once to T, as the framework's add stores it)
//   y = RMSNorm(s)            (rms_norm.cuh: the same casting modes, offset and saved rstd)
//
// The forward returns y and s (s is the next residual stream; it may overwrite the residual or x).
// The backward takes dy and the gradient of s from its other uses (the residual stream of the
// layers above; null = zero) and returns ONE tensor, the total gradient of s, which is both the
// gradient of x and of the residual (they are equal: s = x + residual):
//
//   dx = d_residual = dsum + RMSNorm-backward(dy, s)      (fp32, rounded once to T)
//   dW as RMSNorm's, with s in place of x.
//
// One pass over memory each way instead of an add kernel plus an RMSNorm kernel: the forward reads
// x and the residual and writes s and y (the separate add writes s and the norm reads it back); the
// backward reads dy, dsum and s and writes dx.
//
// The math is rms_norm_math's, the row machinery norm/row_kernel.cuh's, the policy RmsNormPolicy.
// The header reads in four layers: arguments, math (host + device), kernels, launchers. The first
// two compile under any C++20 compiler; kernels and launchers need nvcc.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/dispatch.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "rms_norm.cuh"
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
struct AddRmsNormForwardArgs {
  const T* x = nullptr;         // [rows, cols] the sublayer's output (hidden_states)
  const T* residual = nullptr;  // [rows, cols] the residual stream
  T* y = nullptr;               // [rows, cols] RMSNorm(s); may be x or residual itself
  T* sum = nullptr;             // [rows, cols] s = x + residual; may be residual or x itself
  const W* weight = nullptr;    // [cols], or null: no affine transform
  float* rstd = nullptr;        // [rows] fp32 (of s), or null: not saved
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t x_stride = 0;
  std::int64_t residual_stride = 0;
  std::int64_t y_stride = 0;
  std::int64_t sum_stride = 0;
  float eps = 1e-6f;
  float offset = 0.0f;  // y = shat * (offset + w); Gemma uses 1
  RmsNormCasting casting = RmsNormCasting::llama;
};

template <class T, class W = T>
struct AddRmsNormBackwardArgs {
  const T* dy = nullptr;        // [rows, cols] gradient of y
  const T* dsum = nullptr;      // [rows, cols] gradient of s from its other uses, or null: zero
  const T* sum = nullptr;       // [rows, cols] the forward's s
  const W* weight = nullptr;    // [cols], or null if the forward had none
  const float* rstd = nullptr;  // [rows] saved by the forward, or null: recomputed from s and eps
  T* dx = nullptr;              // [rows, cols] the total gradient of s, = of x = of the residual;
                                // may be dy, dsum or sum itself (in place)
  W* dweight = nullptr;         // [cols], or null: not computed. Needs weight and the workspace.
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dy_stride = 0;
  std::int64_t dsum_stride = 0;
  std::int64_t sum_stride = 0;
  std::int64_t dx_stride = 0;
  float eps = 1e-6f;  // used only when rstd is null
  float offset = 0.0f;
  RmsNormCasting casting = RmsNormCasting::llama;
  bool accumulate_dweight = false;  // dweight += gradient (gradient accumulation) instead of =
  void* workspace = nullptr;        // add_rms_norm_backward_workspace_bytes() bytes, 16-byte aligned
  std::size_t workspace_bytes = 0;
};

// ------------------------------------------------------------------------------------------------
// 2. Math: one row element at a time, in fp32, on host and device (the norm is rms_norm_math)
// ------------------------------------------------------------------------------------------------

namespace add_rms_norm_math {

// s = x + residual as T holds it: an fp32 add rounded once, which is what `residual +
// hidden_states` stores for half and bfloat16 tensors (and the plain fp32 sum for float).
template <class T>
TIGON_HD T sum(float x, float residual) {
  return from_float<T>(x + residual);
}

// The total gradient of s: the gradient from its other uses plus the norm's dx, in fp32; the
// caller rounds it to T once.
TIGON_HD float dsum_total(float dsum, float dx_norm) { return dsum + dx_norm; }

}  // namespace add_rms_norm_math

// ------------------------------------------------------------------------------------------------
// Validation (host only, before anything touches the device)
// ------------------------------------------------------------------------------------------------

namespace detail {

inline Status check_eps_casting(float eps, bool check_eps, RmsNormCasting casting, const char* op) {
  if (check_eps && (!(eps >= 0.0f) || eps == __builtin_inff())) {
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  if (casting != RmsNormCasting::llama && casting != RmsNormCasting::gemma &&
      casting != RmsNormCasting::none) {
    return Status::error(Errc::invalid_value, op, "casting", "unknown casting mode");
  }
  return Status();
}

template <class T, class W>
Status validate(const AddRmsNormForwardArgs<T, W>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.residual, op, "residual"));
  TIGON_CHECK(not_null(a.y, op, "y"));
  TIGON_CHECK(not_null(a.sum, op, "sum"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRowMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.x_stride, a.cols, op, "x_stride"));
  TIGON_CHECK(row_stride(a.residual_stride, a.cols, op, "residual_stride"));
  TIGON_CHECK(row_stride(a.y_stride, a.cols, op, "y_stride"));
  TIGON_CHECK(row_stride(a.sum_stride, a.cols, op, "sum_stride"));
  TIGON_CHECK(check_eps_casting(a.eps, true, a.casting, op));
  const MatrixView x = MatrixView::of(a.x, a.rows, a.cols, a.x_stride);
  const MatrixView res = MatrixView::of(a.residual, a.rows, a.cols, a.residual_stride);
  const MatrixView y = MatrixView::of(a.y, a.rows, a.cols, a.y_stride);
  const MatrixView s = MatrixView::of(a.sum, a.rows, a.cols, a.sum_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  TIGON_CHECK(same_or_disjoint(s, x, op, "sum", "x"));
  TIGON_CHECK(same_or_disjoint(s, res, op, "sum", "residual"));
  TIGON_CHECK(same_or_disjoint(y, x, op, "y", "x"));
  TIGON_CHECK(same_or_disjoint(y, res, op, "y", "residual"));
  TIGON_CHECK(disjoint(y, s, op, "y", "sum"));
  TIGON_CHECK(disjoint(y, w, op, "y", "weight"));
  TIGON_CHECK(disjoint(s, w, op, "sum", "weight"));
  if (a.rstd != nullptr) {
    TIGON_CHECK(disjoint(r, x, op, "rstd", "x"));
    TIGON_CHECK(disjoint(r, res, op, "rstd", "residual"));
    TIGON_CHECK(disjoint(r, y, op, "rstd", "y"));
    TIGON_CHECK(disjoint(r, s, op, "rstd", "sum"));
    TIGON_CHECK(disjoint(r, w, op, "rstd", "weight"));
  }
  return Status();
}

// with_workspace: the launcher (true) also checks what it can of the workspace without the device
// (present, aligned, at least one partial row); the exact size is checked after the plan. The
// workspace query passes false.
template <class T, class W>
Status validate(const AddRmsNormBackwardArgs<T, W>& a, const char* op, bool with_workspace) {
  using namespace check;
  TIGON_CHECK(not_null(a.dy, op, "dy"));
  TIGON_CHECK(not_null(a.sum, op, "sum"));
  TIGON_CHECK(not_null(a.dx, op, "dx"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRowMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.dy_stride, a.cols, op, "dy_stride"));
  TIGON_CHECK(row_stride(a.dsum_stride, a.cols, op, "dsum_stride"));
  TIGON_CHECK(row_stride(a.sum_stride, a.cols, op, "sum_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.cols, op, "dx_stride"));
  TIGON_CHECK(check_eps_casting(a.eps, a.rstd == nullptr, a.casting, op));
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without affine has no dW)");
  }
  const MatrixView dy = MatrixView::of(a.dy, a.rows, a.cols, a.dy_stride);
  const MatrixView ds = MatrixView::of(a.dsum, a.rows, a.cols, a.dsum_stride);
  const MatrixView s = MatrixView::of(a.sum, a.rows, a.cols, a.sum_stride);
  const MatrixView dx = MatrixView::of(a.dx, a.rows, a.cols, a.dx_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView dw = MatrixView::of(a.dweight, 1, a.cols, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  TIGON_CHECK(same_or_disjoint(dx, dy, op, "dx", "dy"));
  TIGON_CHECK(same_or_disjoint(dx, ds, op, "dx", "dsum"));
  TIGON_CHECK(same_or_disjoint(dx, s, op, "dx", "sum"));
  TIGON_CHECK(disjoint(dx, w, op, "dx", "weight"));
  TIGON_CHECK(disjoint(dx, r, op, "dx", "rstd"));
  if (a.dweight != nullptr) {
    TIGON_CHECK(disjoint(dw, dy, op, "dweight", "dy"));
    TIGON_CHECK(disjoint(dw, ds, op, "dweight", "dsum"));
    TIGON_CHECK(disjoint(dw, s, op, "dweight", "sum"));
    TIGON_CHECK(disjoint(dw, dx, op, "dweight", "dx"));
    TIGON_CHECK(disjoint(dw, w, op, "dweight", "weight"));
    TIGON_CHECK(disjoint(dw, r, op, "dweight", "rstd"));
    if (with_workspace) {
      // Every plan has at least one partial row.
      TIGON_CHECK(workspace(a.workspace, a.workspace_bytes, partial_rows_bytes(1, a.cols), op));
    }
  }
  return Status();
}

// A non-persistent forward walks one row per group: one stage is all it uses.
template <class T, int kCols, class P>
using AddRmsFwdPipe = RowPipeline<FwdRowShape<T, kCols, P>, T, kCols, 2,
                                  P::kFwdPersistent ? P::kStages : 1>;  // x, residual
// The non-persistent forward may read x and the residual straight into registers (kFwdDirect,
// RMSNorm's kRmsFwdDirect rule): no shared memory then.
template <class T, int kCols, class P>
inline constexpr int kAddRmsFwdSmem = kRmsFwdDirect<P> ? 0 : AddRmsFwdPipe<T, kCols, P>::kSmemBytes;
template <class T, int kCols, class P>
using AddRmsBwdPipe = RowPipeline<BwdRowShape<T, kCols, P>, T, kCols, 3, P::kStages>;  // s, dy, dsum

inline constexpr int kAddRmsGeneralThreads = 256;  // block of the general (any size) kernels
inline constexpr int kAddRmsGeneralBwdBlocksPerSm = 2;
// The general backward accumulates dW in shared memory up to this row length (44 KB, under the
// 48 KB default), in the workspace beyond it.
inline constexpr std::int64_t kAddRmsGeneralSmemAccCols = 11264;

}  // namespace detail

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class W>
struct AddRmsFwdParams {
  const T* x;
  const T* r;
  T* y;
  T* s;
  const W* w;
  float* rstd;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t xs, rs, ys, ss;
  float eps, offset;
  RmsNormCasting casting;
};

template <class T, class W>
struct AddRmsBwdParams {
  const T* dy;
  const T* ds;  // null: zero
  const T* s;
  const W* w;
  const float* rstd;
  T* dx;
  float* partials;  // [parts, cols] partial dW rows, or null when dW is not wanted
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t dys, dss, ss, dxs;
  float eps, offset;
  RmsNormCasting casting;
};

// Fixed hidden size: x and the residual read straight into registers (kFwdDirect, the default for
// the non-persistent grid) or staged through shared memory (pipelined_rows); s is computed,
// written and kept in registers for the sum of squares and the output, so every input is read
// from DRAM once and s is never read back.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(FwdRowShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    add_rms_norm_fwd_kernel(const AddRmsFwdParams<T, W> p) {
  using S = FwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = AddRmsFwdPipe<T, kCols, P>::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_w = p.w != nullptr;
  const RmsNormCasting casting =
      P::kCasting < 0 ? p.casting : static_cast<RmsNormCasting>(P::kCasting);
  // [group][stage][x | residual][kCols]
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * 2 * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  if (first < p.rows) {  // before the wait: a hint (launch.cuh)
    prefetch_row_l2<S>(p.x + first * p.xs, t);
    prefetch_row_l2<S>(p.r + first * p.rs, t);
  }
  detail::grid_dependency_sync();
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  const T* const src[2] = {p.x, p.r};
  const std::int64_t stride[2] = {p.xs, p.rs};
  int parity = 0;

  // One row from its x and residual vectors (x_at(v, i), r_at(v, i): this thread's v-th vector,
  // vector index i of the row): s written and kept in registers, the row's sum of squares
  // reduced, y written.
  auto do_row = [&](std::int64_t row, auto&& x_at, auto&& r_at) {
    T* sr = p.s + row * p.ss;
    AlignedVec<T, kV> sv[kVPT];
    float ss[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        const AlignedVec<T, kV> xv = x_at(v, i);
        const AlignedVec<T, kV> rv = r_at(v, i);
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          sv[v].v[c] = add_rms_norm_math::sum<T>(to_float(xv.v[c]), to_float(rv.v[c]));
          const float f = to_float(sv[v].v[c]);
          ss[0] += f * f;
        }
        store_vec_hinted<P::kStreamingStores>(sr + i * kV, sv[v]);
      }
    }
    Reduce::sum(ss, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = rms_norm_math::rstd(ss[0], kCols, p.eps);
    if (t == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
    const float r = rms_norm_math::effective_rstd<T>(rstd, casting);
    T* yr = p.y + row * p.ys;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        AlignedVec<W, kV> wv;
        if (has_w) wv = load_vec<kV>(p.w + i * kV);
        AlignedVec<T, kV> yv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float sc = rms_norm_math::scale<T>(has_w ? to_float(wv.v[c]) : 0.0f, has_w, p.offset,
                                                   casting);
          yv.v[c] = from_float<T>(rms_norm_math::forward<T>(to_float(sv[v].v[c]), r, sc, casting));
        }
        store_vec_hinted<P::kStreamingStores>(yr + i * kV, yv);
      }
    }
  };

  if constexpr (kRmsFwdDirect<P>) {
    (void)stages;
    (void)src;
    (void)stride;
    for (std::int64_t row = first; row < p.rows; row += step) {
      const T* xg = p.x + row * p.xs;
      const T* rg = p.r + row * p.rs;
      AlignedVec<T, kV> xv[kVPT], rv[kVPT];
#pragma unroll
      for (int v = 0; v < kVPT; ++v) {  // every load in flight before the first use
        const int i = v * S::kGroupThreads + t;
        if (S::kExact || i < S::kNumVec) {
          xv[v] = load_vec_hinted<P::kFwdDirectStream, kV>(xg + i * kV);
          rv[v] = load_vec_hinted<P::kFwdDirectStream, kV>(rg + i * kV);
        }
      }
      do_row(row, [&](int v, int) { return xv[v]; }, [&](int v, int) { return rv[v]; });
    }
  } else {
    pipelined_rows<S, kCols, kStages, 2>(stages, src, stride, p.rows, first, step, t,
                                         [&](std::int64_t row, const T* xr) {
      const T* rr = xr + kCols;
      do_row(row, [&](int, int i) { return load_vec<kV>(xr + i * kV); },
             [&](int, int i) { return load_vec<kV>(rr + i * kV); });
    });
  }
}

// Fixed hidden size backward: s, dy and dsum staged (dsum only when given); one group reduction
// per row; dx = dsum + the norm's dx, rounded once; each thread keeps its columns' dW in registers
// across the rows it visits and each row group writes one partial dW row at the end. The saved
// rstd of the next row is loaded while the current one is computed.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(BwdRowShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    add_rms_norm_bwd_kernel(const AddRmsBwdParams<T, W> p) {
  detail::grid_dependency_sync();
  using S = BwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = AddRmsBwdPipe<T, kCols, P>::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_ds = p.ds != nullptr;
  const bool saved = p.rstd != nullptr;
  const RmsNormCasting casting =
      P::kCasting < 0 ? p.casting : static_cast<RmsNormCasting>(P::kCasting);
  const bool want_dw = p.partials != nullptr;
  // [group][stage][s | dy | dsum][kCols]
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * 3 * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  const T* const src[3] = {p.s, p.dy, p.ds};
  const std::int64_t stride[3] = {p.ss, p.dys, p.dss};

  // dW accumulators, and (offset + w) of this thread's columns, read once.
  float acc[kVPT][kV] = {};
  float wk[kVPT][kV];
  load_row_weights<S, true>(p.w, p.offset, t, wk);
  float next_rstd = saved && first < p.rows ? p.rstd[first] : 0.0f;
  int parity = 0;

  pipelined_rows<S, kCols, kStages, 3>(stages, src, stride, p.rows, first, step, t,
                                       [&](std::int64_t row, const T* sr) {
    const T* dyr = sr + kCols;
    const T* dsr = sr + 2 * kCols;
    const float saved_rstd = next_rstd;
    if (saved && row + step < p.rows) next_rstd = p.rstd[row + step];
    AlignedVec<T, kV> sk[kVPT], dyk[kVPT];
    // r[0] = sum(dn * s), r[1] = sum(s^2) (only for the rstd when it was not saved: the branch is
    // taken once per row, outside the element loop)
    float r[2] = {0.0f, 0.0f};
    auto row_sums = [&](auto with_sq) {
#pragma unroll
      for (int v = 0; v < kVPT; ++v) {
        const int i = v * S::kGroupThreads + t;
        if (S::kExact || i < S::kNumVec) {
          sk[v] = load_vec<kV>(sr + i * kV);
          dyk[v] = load_vec<kV>(dyr + i * kV);
          float sf[kV], dyf[kV];
          to_floats(sk[v], sf);
          to_floats(dyk[v], dyf);
#pragma unroll
          for (int c = 0; c < kV; ++c) {
            r[0] += dyf[c] * wk[v][c] * sf[c];
            if constexpr (decltype(with_sq)::value) r[1] += sf[c] * sf[c];
          }
        }
      }
    };
    if (saved) {
      row_sums(std::false_type{});
    } else {
      row_sums(std::true_type{});
    }
    Reduce::sum(r, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = saved ? saved_rstd : rms_norm_math::rstd(r[1], kCols, p.eps);
    const float mean_dot = rstd * r[0] / static_cast<float>(kCols);
    T* dxr = p.dx + row * p.dxs;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        // The row again: from the registers of the first loop, or re-read from shared memory.
        AlignedVec<T, kV> sv, dyv, dsv;
        if constexpr (P::kBwdKeepRows) {
          sv = sk[v];
          dyv = dyk[v];
        } else {
          sv = load_vec<kV>(sr + i * kV);
          dyv = load_vec<kV>(dyr + i * kV);
        }
        if (has_ds) dsv = load_vec<kV>(dsr + i * kV);
        float shat[kV], dyf[kV], dsf[kV];
        to_floats(sv, shat);
        to_floats(dyv, dyf);
        if (has_ds) to_floats(dsv, dsf);
        AlignedVec<T, kV> dxv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          shat[c] *= rstd;
          float d = rms_norm_math::dx(dyf[c] * wk[v][c], shat[c], rstd, mean_dot);
          if (has_ds) d = add_rms_norm_math::dsum_total(dsf[c], d);
          dxv.v[c] = from_float<T>(d);
        }
        if (want_dw) add_dweight_terms<T>(dyf, shat, casting, acc[v]);
        store_vec_hinted<P::kStreamingStores>(dxr + i * kV, dxv);
      }
    }
  });

  // One partial row per row group (no cross-group combine, so no block-wide barrier here).
  if (want_dw) {
    store_partial_row<S>(p.partials + (static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g) * kCols,
                         acc, t);
  }
}

// Any hidden size: one row per block at a time, two passes over the row: the first adds, writes s
// and reduces; the second reads s back (this thread's own writes, from L1/L2) and writes y.
// kV = 16-byte vectors when pointers and strides allow it, else single elements.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kAddRmsGeneralThreads)
    add_rms_norm_fwd_general_kernel(const AddRmsFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kAddRmsGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = p.x + row * p.xs;
    const T* rr = p.r + row * p.rs;
    T* sr = p.s + row * p.ss;
    float ss[1] = {0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      const AlignedVec<T, kV> rv = load_vec<kV>(rr + c);
      AlignedVec<T, kV> sv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        sv.v[k] = add_rms_norm_math::sum<T>(to_float(xv.v[k]), to_float(rv.v[k]));
        const float f = to_float(sv.v[k]);
        ss[0] += f * f;
      }
      store_vec(sr + c, sv);
    }
    Reduce::sum(ss, tmp);
    const float rstd = rms_norm_math::rstd(ss[0], p.cols, p.eps);
    if (threadIdx.x == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
    const float r = rms_norm_math::effective_rstd<T>(rstd, p.casting);
    T* yr = p.y + row * p.ys;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> sv = load_vec<kV>(sr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> yv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float sc = rms_norm_math::scale<T>(has_w ? to_float(wv.v[k]) : 0.0f, has_w, p.offset,
                                                 p.casting);
        yv.v[k] = from_float<T>(rms_norm_math::forward<T>(to_float(sv.v[k]), r, sc, p.casting));
      }
      store_vec(yr + c, yv);
    }
  }
}

// Any hidden size backward. dW is accumulated per block in shared memory when the row fits
// (kAddRmsGeneralSmemAccCols), else directly in the block's partial row of the workspace; each
// column belongs to one thread, so either way the sums are race-free and in a fixed order.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kAddRmsGeneralThreads)
    add_rms_norm_bwd_general_kernel(const AddRmsBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kAddRmsGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ float smem_dw[];
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  const bool has_ds = p.ds != nullptr;
  const bool want_dw = p.partials != nullptr;
  float* part = want_dw ? p.partials + static_cast<std::int64_t>(blockIdx.x) * p.cols : nullptr;
  float* acc = smem_acc ? smem_dw : part;
  if (want_dw) {
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
#pragma unroll
      for (int k = 0; k < kV; ++k) acc[i * kV + k] = 0.0f;
    }
  }
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* dyr = p.dy + row * p.dys;
    const T* sr = p.s + row * p.ss;
    const T* dsr = p.ds + (has_ds ? row * p.dss : 0);
    float r[2] = {0.0f, 0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> sv = load_vec<kV>(sr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float sf = to_float(sv.v[k]);
        const float dn = to_float(dyv.v[k]) * (has_w ? p.offset + to_float(wv.v[k]) : 1.0f);
        r[0] += dn * sf;
        r[1] += sf * sf;
      }
    }
    Reduce::sum(r, tmp);
    const float rstd = p.rstd != nullptr ? p.rstd[row] : rms_norm_math::rstd(r[1], p.cols, p.eps);
    const float mean_dot = rstd * r[0] / static_cast<float>(p.cols);
    T* dxr = p.dx + row * p.dxs;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> sv = load_vec<kV>(sr + c);
      AlignedVec<T, kV> dsv;
      if (has_ds) dsv = load_vec<kV>(dsr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> dxv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float shat = to_float(sv.v[k]) * rstd;
        const float dyf = to_float(dyv.v[k]);
        const float dn = dyf * (has_w ? p.offset + to_float(wv.v[k]) : 1.0f);
        float d = rms_norm_math::dx(dn, shat, rstd, mean_dot);
        if (has_ds) d = add_rms_norm_math::dsum_total(to_float(dsv.v[k]), d);
        dxv.v[k] = from_float<T>(d);
        if (want_dw) acc[c + k] += rms_norm_math::dweight_term<T>(dyf, shat, p.casting);
      }
      store_vec(dxr + c, dxv);
    }
  }
  if (want_dw && smem_acc) {
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
#pragma unroll
      for (int k = 0; k < kV; ++k) part[i * kV + k] = acc[i * kV + k];
    }
  }
}

// ---- launch planning: which kernel, what grid, how much workspace -----------------------------

namespace add_rms {

template <class T, class W, int kV>
bool fwd_vectorizable(const AddRmsFwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.r, p.rs, kV) &&
         rows_aligned(p.y, p.ys, kV) && rows_aligned(p.s, p.ss, kV) &&
         (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
}

template <class T, class W, int kV>
bool bwd_vectorizable(const AddRmsBwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) &&
         (p.ds == nullptr || rows_aligned(p.ds, p.dss, kV)) && rows_aligned(p.s, p.ss, kV) &&
         rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
}

template <class T, class W>
AddRmsFwdParams<T, W> fwd_params(const AddRmsNormForwardArgs<T, W>& a) {
  auto st = [&](std::int64_t s) { return s ? s : a.cols; };
  return {a.x,    a.residual, a.y,        a.sum,         a.weight,          a.rstd,
          a.rows, a.cols,     st(a.x_stride), st(a.residual_stride), st(a.y_stride), st(a.sum_stride),
          a.eps,  a.offset,   a.casting};
}

template <class T, class W>
AddRmsBwdParams<T, W> bwd_params(const AddRmsNormBackwardArgs<T, W>& a) {
  auto st = [&](std::int64_t s) { return s ? s : a.cols; };
  return {a.dy,   a.dsum, a.sum,          a.weight,          a.rstd,         a.dx,
          nullptr, a.rows, a.cols,        st(a.dy_stride),   st(a.dsum_stride), st(a.sum_stride),
          st(a.dx_stride), a.eps, a.offset, a.casting};
}

// kCols == 0: only the general kernels are candidates.
template <class T, class W, int kCols, class P>
Status plan_forward(const AddRmsFwdParams<T, W>& p, const DeviceInfo& dev, RowPlan& plan) {
  plan = RowPlan{};
  if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
    using S = FwdRowShape<T, kCols, P>;
    constexpr int kSmem = kAddRmsFwdSmem<T, kCols, P>;
    // The compiled kernel's shared-memory pipeline must fit this device's per-block limit.
    if (fwd_vectorizable<T, W, S::kVec>(p) && kSmem + 1024 <= dev.smem_per_block_optin) {
      return plan_compiled_rows<add_rms_norm_fwd_kernel<T, W, kCols, P>, S::kThreads, kSmem>(
          p.rows, S::kGroups, P::kFwdPersistent, dev, plan);
    }
  }
  int occ = 0;
  if (fwd_vectorizable<T, W, kVecElems<T>>(p)) {
    plan.kernel = RowKernel::general_vec;
    TIGON_CHECK((blocks_per_sm<add_rms_norm_fwd_general_kernel<T, W, kVecElems<T>>,
                               kAddRmsGeneralThreads>(dev.device, occ)));
  } else {
    plan.kernel = RowKernel::general_scalar;
    TIGON_CHECK((blocks_per_sm<add_rms_norm_fwd_general_kernel<T, W, 1>, kAddRmsGeneralThreads>(
        dev.device, occ)));
  }
  plan.grid = static_cast<int>(
      std::min<std::int64_t>(p.rows, static_cast<std::int64_t>(occ) * dev.sm_count));
  return Status();
}

template <class T, class W, int kCols, class P>
Status plan_backward(const AddRmsBwdParams<T, W>& p, bool want_dw, const DeviceInfo& dev,
                     RowPlan& plan) {
  plan = RowPlan{};
  bool compiled = false;
  if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
    using S = BwdRowShape<T, kCols, P>;
    constexpr int kSmem = AddRmsBwdPipe<T, kCols, P>::kSmemBytes;
    if (bwd_vectorizable<T, W, S::kVec>(p) && kSmem + 1024 <= dev.smem_per_block_optin) {
      TIGON_CHECK((plan_compiled_rows<add_rms_norm_bwd_kernel<T, W, kCols, P>, S::kThreads, kSmem>(
          p.rows, S::kGroups, true, dev, plan)));
      compiled = true;
    }
  }
  if (!compiled) {
    plan.kernel = bwd_vectorizable<T, W, kVecElems<T>>(p) ? RowKernel::general_vec
                                                          : RowKernel::general_scalar;
    plan.grid = static_cast<int>(std::min<std::int64_t>(
        p.rows, static_cast<std::int64_t>(kAddRmsGeneralBwdBlocksPerSm) * dev.sm_count));
    plan.parts = plan.grid;
  }
  plan.workspace_bytes = want_dw ? partial_rows_bytes(plan.parts, p.cols) : 0;
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_forward(const AddRmsFwdParams<T, W>& p, const RowPlan& plan, cudaStream_t stream) {
  constexpr const char* kOp = "add_rms_norm_forward";
  switch (plan.kernel) {
    case RowKernel::compiled:
      if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
        TIGON_CHECK(launch(kOp, add_rms_norm_fwd_kernel<T, W, kCols, P>, {dim3(plan.grid), dim3(FwdRowShape<T, kCols, P>::kThreads), kAddRmsFwdSmem<T, kCols, P>, stream}, p));
      }
      break;
    case RowKernel::general_vec:
      TIGON_CHECK(launch(kOp, add_rms_norm_fwd_general_kernel<T, W, kVecElems<T>>, {dim3(plan.grid), dim3(kAddRmsGeneralThreads), 0, stream}, p));
      break;
    case RowKernel::general_scalar:
      TIGON_CHECK(launch(kOp, add_rms_norm_fwd_general_kernel<T, W, 1>, {dim3(plan.grid), dim3(kAddRmsGeneralThreads), 0, stream}, p));
      break;
  }
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_backward(const AddRmsBwdParams<T, W>& p, const RowPlan& plan, W* dweight,
                       bool accumulate, cudaStream_t stream) {
  constexpr const char* kOp = "add_rms_norm_backward";
  if (plan.kernel == RowKernel::compiled) {
    if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
      TIGON_CHECK(launch(kOp, add_rms_norm_bwd_kernel<T, W, kCols, P>, {dim3(plan.grid), dim3(BwdRowShape<T, kCols, P>::kThreads), AddRmsBwdPipe<T, kCols, P>::kSmemBytes, stream}, p));
    }
  } else {
    const bool smem_acc = p.partials != nullptr && p.cols <= kAddRmsGeneralSmemAccCols;
    const std::size_t smem = smem_acc ? static_cast<std::size_t>(p.cols) * sizeof(float) : 0;
    if (plan.kernel == RowKernel::general_vec) {
      TIGON_CHECK(launch(kOp, add_rms_norm_bwd_general_kernel<T, W, kVecElems<T>>, {dim3(plan.grid), dim3(kAddRmsGeneralThreads), smem, stream}, p, smem_acc));
    } else {
      TIGON_CHECK(launch(kOp, add_rms_norm_bwd_general_kernel<T, W, 1>, {dim3(plan.grid), dim3(kAddRmsGeneralThreads), smem, stream}, p, smem_acc));
    }
  }
  if (dweight == nullptr) return Status();
  return column_sum(p.partials, plan.parts, p.cols, dweight, accumulate, stream, kOp);
}

// Forward / backward for one candidate size (0: general only) and one policy (its casting fixed).
template <class T, class W, int kCols, class P>
Status forward_fixed(const AddRmsNormForwardArgs<T, W>& a, cudaStream_t stream) {
  const AddRmsFwdParams<T, W> p = fwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_forward<T, W, kCols, P>(p, dev, plan)));
  return launch_forward<T, W, kCols, P>(p, plan, stream);
}

template <class T, class W, int kCols, class P>
Status backward_workspace_fixed(const AddRmsNormBackwardArgs<T, W>& a, std::size_t& bytes) {
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(bwd_params(a), a.dweight != nullptr, dev, plan)));
  bytes = plan.workspace_bytes;
  return Status();
}

template <class T, class W, int kCols, class P>
Status backward_fixed(const AddRmsNormBackwardArgs<T, W>& a, cudaStream_t stream) {
  constexpr const char* kOp = "add_rms_norm_backward";
  AddRmsBwdParams<T, W> p = bwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(p, a.dweight != nullptr, dev, plan)));
  TIGON_CHECK(check::workspace(a.workspace, a.workspace_bytes, plan.workspace_bytes, kOp));
  if (a.dweight != nullptr) p.partials = static_cast<float*>(a.workspace);
  return launch_backward<T, W, kCols, P>(p, plan, a.dweight, a.accumulate_dweight, stream);
}

// The compiled kernels take the casting mode as a compile-time constant, as RMSNorm's do
// (detail::with_casting_for picks the instance the arguments name).
template <class T, class W, int kCols, class P>
Status forward(const AddRmsNormForwardArgs<T, W>& a, cudaStream_t stream) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return forward_fixed<T, W, kCols, typename decltype(q)::type>(a, stream);
  });
}

template <class T, class W, int kCols, class P>
Status backward_workspace(const AddRmsNormBackwardArgs<T, W>& a, std::size_t& bytes) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return backward_workspace_fixed<T, W, kCols, typename decltype(q)::type>(a, bytes);
  });
}

template <class T, class W, int kCols, class P>
Status backward(const AddRmsNormBackwardArgs<T, W>& a, cudaStream_t stream) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return backward_fixed<T, W, kCols, typename decltype(q)::type>(a, stream);
  });
}

}  // namespace add_rms

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: add_rms_norm_forward(args, stream) picks the compiled instance for the sizes
// in TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do
// not allow 16-byte accesses. Compile-time hidden size: add_rms_norm_forward<bf16, 4096>(args,
// stream) instantiates only that shape (plus the general kernel for misaligned inputs). The policy
// is RMSNorm's (RmsNormPolicy), with the same meaning for every knob.
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status add_rms_norm_forward(const AddRmsNormForwardArgs<T, W>& args,
                                          cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "add_rms_norm_forward"));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) {
        return detail::add_rms::forward<T, W, decltype(n)::value, RmsNormDefaultPolicy>(args, stream);
      },
      [&] { return detail::add_rms::forward<T, W, 0, RmsNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status add_rms_norm_forward(const AddRmsNormForwardArgs<T, W>& args,
                                          cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "add_rms_norm_forward"));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting, "add_rms_norm_forward")));
  return detail::add_rms::forward<T, W, kCols, Policy>(args, stream);
}

// Bytes of workspace add_rms_norm_backward(args) needs: 0 without dweight, else one fp32 row of
// partial sums per row group of the launch the call will make (a function of the device, the shape
// and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status add_rms_norm_backward_workspace_bytes(const AddRmsNormBackwardArgs<T, W>& args,
                                                           std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "add_rms_norm_backward_workspace_bytes", false));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) {
        return detail::add_rms::backward_workspace<T, W, decltype(n)::value, RmsNormDefaultPolicy>(
            args, bytes);
      },
      [&] { return detail::add_rms::backward_workspace<T, W, 0, RmsNormDefaultPolicy>(args, bytes); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status add_rms_norm_backward_workspace_bytes(const AddRmsNormBackwardArgs<T, W>& args,
                                                           std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "add_rms_norm_backward_workspace_bytes", false));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting,
                                                     "add_rms_norm_backward_workspace_bytes")));
  return detail::add_rms::backward_workspace<T, W, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status add_rms_norm_backward(const AddRmsNormBackwardArgs<T, W>& args,
                                           cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "add_rms_norm_backward", true));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) {
        return detail::add_rms::backward<T, W, decltype(n)::value, RmsNormDefaultPolicy>(args, stream);
      },
      [&] { return detail::add_rms::backward<T, W, 0, RmsNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status add_rms_norm_backward(const AddRmsNormBackwardArgs<T, W>& args,
                                           cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "add_rms_norm_backward", true));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting, "add_rms_norm_backward")));
  return detail::add_rms::backward<T, W, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
