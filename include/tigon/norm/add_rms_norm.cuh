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
// The math is rms_norm_math's, the row machinery norm/row_kernel.cuh's, the plan and the launches
// the norms' shared layer (norm/launch.cuh), the policy RmsNormPolicy. The header reads in four
// layers: arguments, math (host + device), kernels, launchers. Arguments, math and validation
// compile under any C++20 compiler; kernels and launchers need nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "launch.cuh"
#include "rms_norm.cuh"
#include "row_kernel.cuh"

#if defined(__CUDACC__)
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

template <class T, class W>
Status validate(const AddRmsNormForwardArgs<T, W>& a, const char* op) {
  TIGON_CHECK(check_not_null({{a.x, "x"}, {a.residual, "residual"}, {a.y, "y"}, {a.sum, "sum"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols,
                         {{a.x_stride, "x_stride"}, {a.residual_stride, "residual_stride"},
                          {a.y_stride, "y_stride"}, {a.sum_stride, "sum_stride"}},
                         op));
  TIGON_CHECK(check_eps_casting(a.eps, true, a.casting, a.offset, op));
  const Named x = matrix(a.x, a.rows, a.cols, a.x_stride, "x");
  const Named res = matrix(a.residual, a.rows, a.cols, a.residual_stride, "residual");
  const Named y = matrix(a.y, a.rows, a.cols, a.y_stride, "y");
  const Named s = matrix(a.sum, a.rows, a.cols, a.sum_stride, "sum");
  const Named w = row_vector(a.weight, a.cols, "weight");
  TIGON_CHECK(check_same_or_disjoint(s, {x, res}, op));
  TIGON_CHECK(check_same_or_disjoint(y, {x, res}, op));
  TIGON_CHECK(check_disjoint(y, {s, w}, op));
  TIGON_CHECK(check_disjoint(s, {w}, op));
  return check_disjoint(row_vector(a.rstd, a.rows, "rstd"), {x, res, y, s, w}, op);
}

// with_workspace: the launcher (true) also checks what it can of the workspace without the device;
// the workspace query passes false.
template <class T, class W>
Status validate(const AddRmsNormBackwardArgs<T, W>& a, const char* op, bool with_workspace, std::size_t used = 0) {
  TIGON_CHECK(check_not_null({{a.dy, "dy"}, {a.sum, "sum"}, {a.dx, "dx"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols,
                         {{a.dy_stride, "dy_stride"}, {a.dsum_stride, "dsum_stride"},
                          {a.sum_stride, "sum_stride"}, {a.dx_stride, "dx_stride"}},
                         op));
  TIGON_CHECK(check_eps_casting(a.eps, a.rstd == nullptr, a.casting, a.offset, op));
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without affine has no dW)");
  }
  const Named dy = matrix(a.dy, a.rows, a.cols, a.dy_stride, "dy");
  const Named ds = matrix(a.dsum, a.rows, a.cols, a.dsum_stride, "dsum");
  const Named s = matrix(a.sum, a.rows, a.cols, a.sum_stride, "sum");
  const Named dx = matrix(a.dx, a.rows, a.cols, a.dx_stride, "dx");
  const Named w = row_vector(a.weight, a.cols, "weight");
  const Named r = row_vector(a.rstd, a.rows, "rstd");
  TIGON_CHECK(check_same_or_disjoint(dx, {dy, ds, s}, op));
  TIGON_CHECK(check_disjoint(dx, {w, r}, op));
  const Named dw = row_vector(a.dweight, a.cols, "dweight");
  TIGON_CHECK(check_disjoint(dw, {dy, ds, s, dx, w, r}, op));
  return check_partials_workspace(with_workspace, a.dweight != nullptr ? 1 : 0, a.workspace,
                                  a.workspace_bytes, a.cols, op, {dy, ds, s, dx, w, r, dw}, used);
}

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

// Fixed hidden size: a row group owns one row; kGroups groups per block, one block per kGroups
// rows. Each thread loads its vectors of x and the residual straight into registers, every load
// in flight before the first add; s is computed, written and kept in registers for the sum of
// squares and the output, so every input is read from DRAM once and s is never read back. Before
// the grid-dependency wait every block asks the L2 for its first row of x and of the residual.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(FwdRowShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    add_rms_norm_fwd_kernel(const AddRmsFwdParams<T, W> p) {
  using S = FwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_w = p.w != nullptr;
  const RmsNormCasting casting = P::kCasting;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  if (first < p.rows) {  // before the wait: a hint (core/launch.cuh)
    prefetch_row_l2<S>(p.x + first * p.xs, t);
    prefetch_row_l2<S>(p.r + first * p.rs, t);
  }
  detail::grid_dependency_sync();
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  int parity = 0;

  // One row from this thread's vectors of x and the residual: s written and kept in registers,
  // the row's sum of squares reduced, y written.
  auto do_row = [&](std::int64_t row, const AlignedVec<T, kV> (&xv)[kVPT],
                    const AlignedVec<T, kV> (&rv)[kVPT]) {
    T* sr = p.s + row * p.ss;
    AlignedVec<T, kV> sv[kVPT];
    float ss[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          sv[v].v[c] = add_rms_norm_math::sum<T>(to_float(xv[v].v[c]), to_float(rv[v].v[c]));
          const float f = to_float(sv[v].v[c]);
          ss[0] += f * f;
        }
        store_vec(sr + i * kV, sv[v]);
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
        store_vec(yr + i * kV, yv);
      }
    }
  };

  for (std::int64_t row = first; row < p.rows; row += step) {
    const T* xg = p.x + row * p.xs;
    const T* rg = p.r + row * p.rs;
    AlignedVec<T, kV> xv[kVPT], rv[kVPT];
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {  // every load in flight before the first use
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        xv[v] = load_vec<kV>(xg + i * kV);
        rv[v] = load_vec<kV>(rg + i * kV);
      }
    }
    do_row(row, xv, rv);
  }
}

// Fixed hidden size backward, on a persistent grid: s, dy and dsum staged through shared memory
// (dsum only when given), the next kStages - 1 rows in flight (pipelined_rows); one group
// reduction per row; s and dy stay in registers from the row sums to dx = dsum + the norm's dx,
// rounded once; each thread keeps its columns' dW in registers across the rows it visits and each
// row group writes one partial dW row at the end. The saved rstd of the next row is loaded while
// the current one is computed.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(BwdRowShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    add_rms_norm_bwd_kernel(const AddRmsBwdParams<T, W> p) {
  detail::grid_dependency_sync();
  using S = BwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = BwdRowPipe<T, kCols, P, 3>::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const bool has_ds = p.ds != nullptr;
  const bool saved = p.rstd != nullptr;
  const RmsNormCasting casting = P::kCasting;
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
    float r[2] = {0.0f, 0.0f};  // sum(dn * s), sum(s^2)
    rms_bwd_row_sums<S>(sr, dyr, wk, t, !saved, sk, dyk, r);
    Reduce::sum(r, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = saved ? saved_rstd : rms_norm_math::rstd(r[1], kCols, p.eps);
    const float mean_dot = rstd * r[0] / static_cast<float>(kCols);
    T* dxr = p.dx + row * p.dxs;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        AlignedVec<T, kV> dsv;
        if (has_ds) dsv = load_vec<kV>(dsr + i * kV);
        float shat[kV], dyf[kV], dsf[kV];
        to_floats(sk[v], shat);
        to_floats(dyk[v], dyf);
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
        store_vec(dxr + i * kV, dxv);
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
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    add_rms_norm_fwd_general_kernel(const AddRmsFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kGeneralThreads;
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

// add_rms_norm_math::dsum_total, for the general backward RMSNorm and add + RMSNorm share.
struct DsumTotal {
  static TIGON_HD float total(float dsum, float dx_norm) {
    return add_rms_norm_math::dsum_total(dsum, dx_norm);
  }
};

// Any hidden size backward: RMSNorm's general backward over s (rms_norm_bwd_general_rows), plus
// dsum. dW is accumulated per block in shared memory when the row fits (kGeneralAccFloats), else
// in the block's partial row of the workspace.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    add_rms_norm_bwd_general_kernel(const AddRmsBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  __shared__ typename BlockAllReduce<kGeneralThreads, 2>::TempStorage tmp;
  extern __shared__ float smem_dw[];
  rms_norm_bwd_general_rows<T, W, kV, DsumTotal>(p, p.s, p.ss, p.ds, p.dss, smem_acc, smem_dw, tmp);
}

// ---- the ops: what the shared launch layer (norm/launch.cuh) needs of each direction -----------

template <class T_, class W>
struct AddRmsFwdOp : RmsCastingInstances {
  using T = T_;
  using Args = AddRmsNormForwardArgs<T, W>;
  using Params = AddRmsFwdParams<T, W>;
  static constexpr const char* kName = "add_rms_norm_forward";
  static Status validate(const Args& a, const char* op) { return detail::validate(a, op); }
  static Params params(const Args& a) {
    auto st = [&](std::int64_t s) { return resolved_stride(s, a.cols); };
    return {a.x,    a.residual, a.y,        a.sum,         a.weight,          a.rstd,
            a.rows, a.cols,     st(a.x_stride), st(a.residual_stride), st(a.y_stride), st(a.sum_stride),
            a.eps,  a.offset,   a.casting};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.r, p.rs, kV) &&
           rows_aligned(p.y, p.ys, kV) && rows_aligned(p.s, p.ss, kV) &&
           (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &add_rms_norm_fwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &add_rms_norm_fwd_general_kernel<T, W, kV>; }
};

template <class T_, class W>
struct AddRmsBwdOp : RmsCastingInstances, DweightPartials {
  using T = T_;
  using Args = AddRmsNormBackwardArgs<T, W>;
  using Params = AddRmsBwdParams<T, W>;
  static constexpr const char* kName = "add_rms_norm_backward";
  static constexpr const char* kWorkspaceName = "add_rms_norm_backward_workspace_bytes";
  static constexpr int kTensors = 3;  // s, dy, dsum
  static Status validate(const Args& a, const char* op, bool ws, std::size_t used = 0) {
    return detail::validate(a, op, ws, used);
  }
  static Params params(const Args& a) {
    auto st = [&](std::int64_t s) { return resolved_stride(s, a.cols); };
    return {a.dy,   a.dsum, a.sum,          a.weight,          a.rstd,         a.dx,
            nullptr, a.rows, a.cols,        st(a.dy_stride),   st(a.dsum_stride), st(a.sum_stride),
            st(a.dx_stride), a.eps, a.offset, a.casting};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) &&
           (p.ds == nullptr || rows_aligned(p.ds, p.dss, kV)) && rows_aligned(p.s, p.ss, kV) &&
           rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &add_rms_norm_bwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &add_rms_norm_bwd_general_kernel<T, W, kV>; }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: add_rms_norm_forward(args, stream) picks the compiled instance for the sizes
// in TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do
// not allow 16-byte accesses. Compile-time hidden size: add_rms_norm_forward<bf16, 4096>(args,
// stream) instantiates only that shape (plus the general kernel for misaligned inputs), with the
// policy given (RMSNorm's, RmsNormPolicy, by default).
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status add_rms_norm_forward(const AddRmsNormForwardArgs<T, W>& args,
                                          cudaStream_t stream) {
  return detail::norm_forward<detail::AddRmsFwdOp<T, W>, detail::kAnyCols, RmsNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status add_rms_norm_forward(const AddRmsNormForwardArgs<T, W>& args,
                                          cudaStream_t stream) {
  return detail::norm_forward<detail::AddRmsFwdOp<T, W>, kCols, Policy>(args, stream);
}

// Bytes of workspace add_rms_norm_backward(args) needs: 0 without dweight, else one fp32 row of
// partial sums per row group of the launch the call will make (a function of the device, the shape
// and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status add_rms_norm_backward_workspace_bytes(const AddRmsNormBackwardArgs<T, W>& args,
                                                           std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::AddRmsBwdOp<T, W>, detail::kAnyCols,
                                               RmsNormPolicy>(args, bytes);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status add_rms_norm_backward_workspace_bytes(const AddRmsNormBackwardArgs<T, W>& args,
                                                           std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::AddRmsBwdOp<T, W>, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status add_rms_norm_backward(const AddRmsNormBackwardArgs<T, W>& args,
                                           cudaStream_t stream) {
  return detail::norm_backward<detail::AddRmsBwdOp<T, W>, detail::kAnyCols, RmsNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status add_rms_norm_backward(const AddRmsNormBackwardArgs<T, W>& args,
                                           cudaStream_t stream) {
  return detail::norm_backward<detail::AddRmsBwdOp<T, W>, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
