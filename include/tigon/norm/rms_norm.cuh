// tigon/norm/rms_norm.cuh - RMSNorm forward and backward.
//
//   rstd = 1 / sqrt(mean(x^2) + eps)          (fp32, one per row, saved for the backward)
//   y    = x * rstd * (offset + w)            (casting as Hugging Face defines it, below)
//
// The header reads in four layers: arguments, math (host + device), kernels, launchers; the plan
// and the launches are the norms' shared layer (norm/launch.cuh), the kernels' row machinery
// norm/row_kernel.cuh. Arguments, math, validation and the policy compile under any C++20
// compiler; kernels and launchers need nvcc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "launch.cuh"
#include "row_kernel.cuh"

#if defined(__CUDACC__)
#include "../core/async_copy.cuh"
#include "../core/colsum.cuh"
#include "../core/reduce.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// Where the roundings to the input dtype T happen, exactly as Hugging Face's modules do it.
enum class RmsNormCasting : int {
  // LlamaRMSNorm (Llama, Mistral, Qwen, Phi-3 ...): statistics in fp32, the normalised x rounded
  // to T, then multiplied by (offset + w): y = T(T(x * rstd) * (offset + w)).
  llama = 0,
  // GemmaRMSNorm: everything in fp32, one rounding at the end: y = T(x * rstd * (offset + w)).
  gemma = 1,
  // The input dtype throughout: rstd, the normalised x and (offset + w) each rounded to T.
  none = 2,
};

constexpr const char* casting_name(RmsNormCasting c) noexcept {
  switch (c) {
    case RmsNormCasting::llama: return "llama";
    case RmsNormCasting::gemma: return "gemma";
    case RmsNormCasting::none: return "none";
  }
  return "unknown";
}

// Row strides are in elements; 0 means contiguous (the stride equals cols).
template <class T, class W = T>
struct RmsNormForwardArgs {
  const T* x = nullptr;       // [rows, cols]
  T* y = nullptr;             // [rows, cols]; may be x itself (in place)
  const W* weight = nullptr;  // [cols], or null: no affine transform
  float* rstd = nullptr;      // [rows] fp32, or null: not saved
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t x_stride = 0;
  std::int64_t y_stride = 0;
  float eps = 1e-6f;
  float offset = 0.0f;  // y = xhat * (offset + w); Gemma uses 1
  RmsNormCasting casting = RmsNormCasting::llama;
};

template <class T, class W = T>
struct RmsNormBackwardArgs {
  const T* dy = nullptr;      // [rows, cols] upstream gradient
  const T* x = nullptr;       // [rows, cols] the forward's input
  const W* weight = nullptr;  // [cols], or null if the forward had none
  const float* rstd = nullptr;  // [rows] saved by the forward, or null: recomputed from x and eps
  T* dx = nullptr;            // [rows, cols]; may be dy or x itself (in place)
  W* dweight = nullptr;       // [cols], or null: not computed. Needs weight and the workspace.
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dy_stride = 0;
  std::int64_t x_stride = 0;
  std::int64_t dx_stride = 0;
  float eps = 1e-6f;  // used only when rstd is null
  float offset = 0.0f;
  RmsNormCasting casting = RmsNormCasting::llama;
  bool accumulate_dweight = false;  // dweight += gradient (gradient accumulation) instead of =
  void* workspace = nullptr;        // rms_norm_backward_workspace_bytes() bytes, 16-byte aligned
  std::size_t workspace_bytes = 0;
};

// ------------------------------------------------------------------------------------------------
// 2. Math: one row element at a time, in fp32, on host and device
// ------------------------------------------------------------------------------------------------

namespace rms_norm_math {

// 1 / sqrt(sum_sq / cols + eps): the statistic the forward saves.
TIGON_HD float rstd(float sum_sq, std::int64_t cols, float eps) {
  return rsqrt_f32(sum_sq / static_cast<float>(cols) + eps);
}

// The rstd a mode multiplies by (rounded to T in mode `none`).
template <class T>
TIGON_HD float effective_rstd(float rstd, RmsNormCasting c) {
  return c == RmsNormCasting::none ? round_to<T>(rstd) : rstd;
}

// (offset + w) as the mode sees it, or 1 without a weight.
template <class T>
TIGON_HD float scale(float w, bool has_weight, float offset, RmsNormCasting c) {
  if (!has_weight) return 1.0f;
  const float f = offset + w;
  return c == RmsNormCasting::none ? round_to<T>(f) : f;
}

// y before its final rounding to T. `r` is effective_rstd(), `s` is scale().
template <class T>
TIGON_HD float forward(float x, float r, float s, RmsNormCasting c) {
  float n = x * r;
  if (c != RmsNormCasting::gemma) n = round_to<T>(n);
  return n * s;
}

// Backward, all in fp32 (the roundings of the forward pass the gradient through unchanged):
//   xhat = x * rstd, dn = dy * (offset + w), dx = rstd * (dn - xhat * mean(dn * xhat)),
//   dw   = sum over rows of dy * xhat  (xhat rounded to T first in modes llama and none,
//                                       because that rounded value is what multiplied w).
TIGON_HD float dx(float dn, float xhat, float rstd, float mean_dn_xhat) {
  return rstd * (dn - xhat * mean_dn_xhat);
}

template <class T>
TIGON_HD float dweight_term(float dy, float xhat, RmsNormCasting c) {
  return dy * (c == RmsNormCasting::gemma ? xhat : round_to<T>(xhat));
}

}  // namespace rms_norm_math

// ------------------------------------------------------------------------------------------------
// Validation (host only, before anything touches the device)
// ------------------------------------------------------------------------------------------------

namespace detail {

inline Status check_eps_casting(float eps, bool check_eps_too, RmsNormCasting casting, float offset,
                                const char* op) {
  if (check_eps_too) TIGON_CHECK(check_eps(eps, op));
  TIGON_CHECK(check::finite(offset, op, "offset"));
  if (casting != RmsNormCasting::llama && casting != RmsNormCasting::gemma &&
      casting != RmsNormCasting::none) {
    return Status::error(Errc::invalid_value, op, "casting", "unknown casting mode");
  }
  return Status();
}

template <class T, class W>
Status validate(const RmsNormForwardArgs<T, W>& a, const char* op) {
  TIGON_CHECK(check_not_null({{a.x, "x"}, {a.y, "y"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols, {{a.x_stride, "x_stride"}, {a.y_stride, "y_stride"}}, op));
  TIGON_CHECK(check_eps_casting(a.eps, true, a.casting, a.offset, op));
  const Named x = matrix(a.x, a.rows, a.cols, a.x_stride, "x");
  const Named y = matrix(a.y, a.rows, a.cols, a.y_stride, "y");
  const Named w = row_vector(a.weight, a.cols, "weight");
  TIGON_CHECK(check_same_or_disjoint(y, {x}, op));
  TIGON_CHECK(check_disjoint(y, {w}, op));
  return check_disjoint(row_vector(a.rstd, a.rows, "rstd"), {x, y, w}, op);
}

// with_workspace: the launcher (true) also checks what it can of the workspace without the device;
// the workspace query passes false.
template <class T, class W>
Status validate(const RmsNormBackwardArgs<T, W>& a, const char* op, bool with_workspace, std::size_t used = 0) {
  TIGON_CHECK(check_not_null({{a.dy, "dy"}, {a.x, "x"}, {a.dx, "dx"}}, op));
  TIGON_CHECK(check_rows(a.rows, a.cols,
                         {{a.dy_stride, "dy_stride"}, {a.x_stride, "x_stride"}, {a.dx_stride, "dx_stride"}},
                         op));
  TIGON_CHECK(check_eps_casting(a.eps, a.rstd == nullptr, a.casting, a.offset, op));
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without affine has no dW)");
  }
  const Named dy = matrix(a.dy, a.rows, a.cols, a.dy_stride, "dy");
  const Named x = matrix(a.x, a.rows, a.cols, a.x_stride, "x");
  const Named dx = matrix(a.dx, a.rows, a.cols, a.dx_stride, "dx");
  const Named w = row_vector(a.weight, a.cols, "weight");
  const Named r = row_vector(a.rstd, a.rows, "rstd");
  TIGON_CHECK(check_same_or_disjoint(dx, {dy, x}, op));
  TIGON_CHECK(check_disjoint(dx, {w, r}, op));
  const Named dw = row_vector(a.dweight, a.cols, "dweight");
  TIGON_CHECK(check_disjoint(dw, {dy, x, dx, w, r}, op));
  return check_partials_workspace(with_workspace, a.dweight != nullptr ? 1 : 0, a.workspace,
                                  a.workspace_bytes, a.cols, op, {dy, x, dx, w, r, dw}, used);
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Policy
// ------------------------------------------------------------------------------------------------

// The tuning parameters of the compiled kernels of RMSNorm and of add + RMSNorm (NormPolicy's
// members and defaults, norm/launch.cuh). Derive and override a member to tune:
//   struct Narrow : tigon::RmsNormPolicy { static constexpr int kFwdVecPerThread = 2; };
struct RmsNormPolicy : NormPolicy {};
using RmsNormDefaultPolicy = RmsNormPolicy;  // the former name of the default

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class W>
struct RmsFwdParams {
  const T* x;
  T* y;
  const W* w;
  float* rstd;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t xs, ys;
  float eps, offset;
  RmsNormCasting casting;
  std::int64_t wave_blocks = 0;  // compiled kernel: blocks resident at once (set at launch)
};

template <class T, class W>
struct RmsBwdParams {
  const T* dy;
  const T* x;
  const W* w;
  const float* rstd;
  T* dx;
  float* partials;  // [partial rows, cols] (RowPlan::parts), or null when dW is not wanted
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t dys, xs, dxs;
  float eps, offset;
  RmsNormCasting casting;
};

// The policy a compiled kernel is instantiated with: the caller's, plus the casting mode as a
// compile-time constant (a runtime select per element measurably slowed the backward).
template <class P, RmsNormCasting kMode>
struct WithCasting : P {
  static constexpr RmsNormCasting kCasting = kMode;
};

// acc += rms_norm_math::dweight_term<T>(dy, xhat, casting) for one vector of columns; xhat is
// rounded in place (to T, two at a time, except in mode gemma). Shared by the RMSNorm and add +
// RMSNorm backwards.
template <class T, int kV>
TIGON_DEVICE void add_dweight_terms(const float (&dy)[kV], float (&xhat)[kV], RmsNormCasting casting,
                                    float (&acc)[kV]) {
  if (casting != RmsNormCasting::gemma) {
#pragma unroll
    for (int c = 0; c + 1 < kV; c += 2) round_pair_to<T>(xhat[c], xhat[c + 1]);
    if constexpr (kV % 2 == 1) xhat[kV - 1] = round_to<T>(xhat[kV - 1]);
  }
#pragma unroll
  for (int c = 0; c < kV; ++c) acc[c] += dy[c] * xhat[c];
}

// The compiled RMSNorm and add + RMSNorm backwards' row sums over a staged row: this thread's
// vectors of x (add + RMSNorm: s) and dy loaded from shared memory into xk and dyk, sums[0] =
// sum(dn * x) and, when the rstd was not saved (`recompute`), sums[1] = sum(x^2) (the branch is
// taken once per row, outside the element loop). wk is (offset + w) of this thread's columns.
template <class S, class T>
TIGON_DEVICE void rms_bwd_row_sums(const T* xr, const T* dyr, const float (&wk)[S::kVecPerThread][S::kVec],
                                   int t, bool recompute, AlignedVec<T, S::kVec> (&xk)[S::kVecPerThread],
                                   AlignedVec<T, S::kVec> (&dyk)[S::kVecPerThread], float (&sums)[2]) {
  constexpr int kV = S::kVec;
  auto row_sums = [&](auto with_sq) {
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        xk[v] = load_vec<kV>(xr + i * kV);
        dyk[v] = load_vec<kV>(dyr + i * kV);
        float xf[kV], dyf[kV];
        to_floats(xk[v], xf);
        to_floats(dyk[v], dyf);
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          sums[0] += dyf[c] * wk[v][c] * xf[c];
          if constexpr (decltype(with_sq)::value) sums[1] += xf[c] * xf[c];
        }
      }
    }
  };
  if (recompute) {
    row_sums(std::true_type{});
  } else {
    row_sums(std::false_type{});
  }
}

// Fixed hidden size: a row group of kGroupThreads threads owns one row; kGroups groups per block,
// one block per kGroups rows. Each thread loads its vectors of the row straight into registers,
// every load in flight before the sum of squares. Before the grid-dependency wait the first
// wave's blocks ask the L2 for their rows, and after it for the second wave's.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(FwdRowShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    rms_norm_fwd_kernel(const RmsFwdParams<T, W> p) {
  using S = FwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const bool first_wave = blockIdx.x < p.wave_blocks;
  prefetch_first_row<S>(p.x, p.xs, first, p.rows, first_wave, t);
  detail::grid_dependency_sync();
  prefetch_second_wave_row<S>(p.x, p.xs, first + p.wave_blocks * S::kGroups, p.rows, first_wave, t);
  const bool has_w = p.w != nullptr;
  const RmsNormCasting casting = P::kCasting;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;

  int parity = 0;
  for (std::int64_t row = first; row < p.rows; row += step) {
    const T* xr = p.x + row * p.xs;
    AlignedVec<T, kV> xv[S::kVecPerThread];
    float ss[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) xv[v] = load_vec<kV>(xr + i * kV);
    }
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float f = to_float(xv[v].v[c]);
          ss[0] += f * f;
        }
      }
    }
    Reduce::sum(ss, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = rms_norm_math::rstd(ss[0], kCols, p.eps);
    if (t == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
    const float r = rms_norm_math::effective_rstd<T>(rstd, casting);
    T* yr = p.y + row * p.ys;
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        AlignedVec<W, kV> wv;
        if (has_w) wv = load_vec<kV>(p.w + i * kV);
        AlignedVec<T, kV> yv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          const float s = rms_norm_math::scale<T>(has_w ? to_float(wv.v[c]) : 0.0f, has_w, p.offset,
                                                  casting);
          yv.v[c] = from_float<T>(rms_norm_math::forward<T>(to_float(xv[v].v[c]), r, s, casting));
        }
        store_vec(yr + i * kV, yv);
      }
    }
  }
}

// Fixed hidden size backward, on a persistent grid: each row group keeps the next kStages - 1 rows
// of x and dy in flight through shared memory (cp.async), reads its row into registers once for
// both the row sums and dx, keeps its columns' dW in registers across all the rows it visits, and
// writes one partial dW row to the workspace at the end (summed in a fixed order by column_sum).
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(BwdRowShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    rms_norm_bwd_kernel(const RmsBwdParams<T, W> p) {
  using S = BwdRowShape<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = BwdRowPipe<T, kCols, P, 2>::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  detail::grid_dependency_sync();
  const RmsNormCasting casting = P::kCasting;
  const bool want_dw = p.partials != nullptr;
  // [group][stage][x | dy][kCols]
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * 2 * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  auto issue = [&](std::int64_t r, int stage) {
    stage_row<S>(stages + (stage * 2) * kCols, p.x + r * p.xs, t, r < p.rows);
    stage_row<S>(stages + (stage * 2 + 1) * kCols, p.dy + r * p.dys, t, r < p.rows);
    cp_async_commit();
  };

  // dW accumulators, and (offset + w) of this thread's columns, read once.
  float acc[kVPT][kV] = {};
  float wk[kVPT][kV];
  load_row_weights<S, true>(p.w, p.offset, t, wk);
  const bool saved_rstd = p.rstd != nullptr;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(first + s * step, s);

  int parity = 0;
  int k = 0;
  for (std::int64_t row = first; row < p.rows; row += step, ++k) {
    AlignedVec<T, kV> xk[kVPT], dyk[kVPT];
    issue(row + (kStages - 1) * step, (k + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();
    const T* xr = stages + ((k % kStages) * 2) * kCols;
    const T* dyr = xr + kCols;
    const float saved = saved_rstd ? p.rstd[row] : 0.0f;
    float s[2] = {0.0f, 0.0f};  // sum(dn * x), sum(x^2)
    rms_bwd_row_sums<S>(xr, dyr, wk, t, !saved_rstd, xk, dyk, s);
    Reduce::sum(s, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = saved_rstd ? saved : rms_norm_math::rstd(s[1], kCols, p.eps);
    const float mean_dot = rstd * s[0] / static_cast<float>(kCols);
    T* dxr = p.dx + row * p.dxs;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        float xhat[kV], dyf[kV];
        to_floats(xk[v], xhat);
        to_floats(dyk[v], dyf);
        AlignedVec<T, kV> dxv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          xhat[c] *= rstd;
          dxv.v[c] = from_float<T>(rms_norm_math::dx(dyf[c] * wk[v][c], xhat[c], rstd, mean_dot));
        }
        if (want_dw) add_dweight_terms<T>(dyf, xhat, casting, acc[v]);
        store_vec(dxr + i * kV, dxv);
      }
    }
  }
  cp_async_wait<0>();

  if (!want_dw) return;
  // One partial row per row group: no cross-group combine, so no block-wide barrier here and no
  // shared memory written by one group and read by another.
  store_partial_row<S>(p.partials + (static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g) * kCols, acc, t);
}

// The general (any hidden size) backward of RMSNorm and add + RMSNorm, one row per block at a time:
// the rows of x (add + RMSNorm: of s, rows `xs` apart) and dy; with a Dsum (add + RMSNorm's), dx
// is Dsum::total(dsum, the norm's dx) where `ds` (rows `dss` apart) is not null. dW is accumulated
// per block in shared memory (smem_dw) when smem_acc, else directly in the block's partial row of
// the workspace; each column belongs to one thread, so either way the sums are race-free and in a
// fixed order.
template <class T, class W, int kV, class Dsum, class Params, class TempStorage>
TIGON_DEVICE void rms_norm_bwd_general_rows(const Params& p, const T* x, std::int64_t xs, const T* ds,
                                            std::int64_t dss, bool smem_acc, float* smem_dw,
                                            TempStorage& tmp) {
  constexpr int kThreads = kGeneralThreads;
  constexpr bool kDsum = !std::is_void_v<Dsum>;
  using Reduce = BlockAllReduce<kThreads, 2>;
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  const bool has_ds = kDsum && ds != nullptr;
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
    const T* xr = x + row * xs;
    const T* dsr = kDsum ? ds + (has_ds ? row * dss : 0) : nullptr;
    float s[2] = {0.0f, 0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float xf = to_float(xv.v[k]);
        const float dn = to_float(dyv.v[k]) * (has_w ? p.offset + to_float(wv.v[k]) : 1.0f);
        s[0] += dn * xf;
        s[1] += xf * xf;
      }
    }
    Reduce::sum(s, tmp);
    const float rstd = p.rstd != nullptr ? p.rstd[row] : rms_norm_math::rstd(s[1], p.cols, p.eps);
    const float mean_dot = rstd * s[0] / static_cast<float>(p.cols);
    T* dxr = p.dx + row * p.dxs;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> dyv = load_vec<kV>(dyr + c);
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<T, kV> dsv;
      if (has_ds) dsv = load_vec<kV>(dsr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> dxv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float xhat = to_float(xv.v[k]) * rstd;
        const float dyf = to_float(dyv.v[k]);
        const float dn = dyf * (has_w ? p.offset + to_float(wv.v[k]) : 1.0f);
        float d = rms_norm_math::dx(dn, xhat, rstd, mean_dot);
        if constexpr (kDsum) {
          if (has_ds) d = Dsum::total(to_float(dsv.v[k]), d);
        }
        dxv.v[k] = from_float<T>(d);
        if (want_dw) acc[c + k] += rms_norm_math::dweight_term<T>(dyf, xhat, p.casting);
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

// Any hidden size: one row per block at a time, two passes over the row (the second is served
// from L1/L2), kV = 16-byte vectors when pointers and strides allow it, else single elements.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    rms_norm_fwd_general_kernel(const RmsFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = p.x + row * p.xs;
    float ss[1] = {0.0f};
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + static_cast<std::int64_t>(i) * kV);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float f = to_float(xv.v[k]);
        ss[0] += f * f;
      }
    }
    Reduce::sum(ss, tmp);
    const float rstd = rms_norm_math::rstd(ss[0], p.cols, p.eps);
    if (threadIdx.x == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
    const float r = rms_norm_math::effective_rstd<T>(rstd, p.casting);
    T* yr = p.y + row * p.ys;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      const std::int64_t c = static_cast<std::int64_t>(i) * kV;
      const AlignedVec<T, kV> xv = load_vec<kV>(xr + c);
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> yv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float s = rms_norm_math::scale<T>(has_w ? to_float(wv.v[k]) : 0.0f, has_w, p.offset,
                                                p.casting);
        yv.v[k] = from_float<T>(rms_norm_math::forward<T>(to_float(xv.v[k]), r, s, p.casting));
      }
      store_vec(yr + c, yv);
    }
  }
}

// Any hidden size backward (rms_norm_bwd_general_rows). dW is accumulated per block in shared
// memory when the row fits (kGeneralAccFloats), else in the block's partial row of the workspace.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kGeneralThreads)
    rms_norm_bwd_general_kernel(const RmsBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  __shared__ typename BlockAllReduce<kGeneralThreads, 2>::TempStorage tmp;
  extern __shared__ float smem_dw[];
  rms_norm_bwd_general_rows<T, W, kV, void>(p, p.x, p.xs, nullptr, 0, smem_acc, smem_dw, tmp);
}

// ---- the ops: what the shared launch layer (norm/launch.cuh) needs of each direction -----------

// with_variant of the RMSNorm and add + RMSNorm ops: one compiled instance per casting mode, the
// one args.casting names (kCols == 0, the general kernels: the policy itself).
struct RmsCastingInstances {
  template <int kCols, class P, class A, class F>
  static Status with_variant(const A& a, F&& f) {
    if constexpr (kCols == 0) {
      return f(std::type_identity<P>{});
    } else {
      switch (a.casting) {
        case RmsNormCasting::llama: return f(std::type_identity<WithCasting<P, RmsNormCasting::llama>>{});
        case RmsNormCasting::gemma: return f(std::type_identity<WithCasting<P, RmsNormCasting::gemma>>{});
        case RmsNormCasting::none: return f(std::type_identity<WithCasting<P, RmsNormCasting::none>>{});
      }
      return Status::error(Errc::invalid_value, "rms_norm", "casting", "unknown casting mode");
    }
  }
};

// The RMSNorm and add + RMSNorm backwards' one gradient, dW: one partial row per row group (per
// block in the general kernel) in the workspace, summed by column_sum.
struct DweightPartials {
  static constexpr int kAccRows = 1;
  template <class A>
  static int grads(const A& a) {
    return a.dweight != nullptr ? 1 : 0;
  }
  template <class Params, class A>
  static void set_workspace(Params& p, const A& a, float* ws, int) {
    if (a.dweight != nullptr) p.partials = ws;
  }
  template <class Params, class A>
  static Status sum_partials(const Params& p, const A& a, int parts, cudaStream_t stream,
                             const char* op) {
    if (a.dweight == nullptr) return Status();
    return column_sum(p.partials, parts, p.cols, a.dweight, a.accumulate_dweight, stream, op);
  }
};

template <class T_, class W>
struct RmsFwdOp : RmsCastingInstances {
  using T = T_;
  using Args = RmsNormForwardArgs<T, W>;
  using Params = RmsFwdParams<T, W>;
  static constexpr const char* kName = "rms_norm_forward";
  static Status validate(const Args& a, const char* op) { return detail::validate(a, op); }
  static Params params(const Args& a) {
    return {a.x,    a.y,    a.weight,
            a.rstd, a.rows, a.cols,
            resolved_stride(a.x_stride, a.cols), resolved_stride(a.y_stride, a.cols),
            a.eps,  a.offset, a.casting};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.y, p.ys, kV) &&
           (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &rms_norm_fwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &rms_norm_fwd_general_kernel<T, W, kV>; }
};

template <class T_, class W>
struct RmsBwdOp : RmsCastingInstances, DweightPartials {
  using T = T_;
  using Args = RmsNormBackwardArgs<T, W>;
  using Params = RmsBwdParams<T, W>;
  static constexpr const char* kName = "rms_norm_backward";
  static constexpr const char* kWorkspaceName = "rms_norm_backward_workspace_bytes";
  static constexpr int kTensors = 2;  // x, dy
  static Status validate(const Args& a, const char* op, bool ws, std::size_t used = 0) {
    return detail::validate(a, op, ws, used);
  }
  static Params params(const Args& a) {
    return {a.dy,   a.x,    a.weight, a.rstd, a.dx, nullptr, a.rows, a.cols,
            resolved_stride(a.dy_stride, a.cols), resolved_stride(a.x_stride, a.cols),
            resolved_stride(a.dx_stride, a.cols), a.eps, a.offset, a.casting};
  }
  template <int kV>
  static bool vectorizable(const Params& p) {
    return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) && rows_aligned(p.x, p.xs, kV) &&
           rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
  }
  template <int kCols, class P>
  static constexpr auto compiled() { return &rms_norm_bwd_kernel<T, W, kCols, P>; }
  template <int kV>
  static constexpr auto general() { return &rms_norm_bwd_general_kernel<T, W, kV>; }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: rms_norm_forward(args, stream) picks the compiled instance for the sizes in
// TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do not
// allow 16-byte accesses. Compile-time hidden size: rms_norm_forward<bf16, 4096>(args, stream)
// instantiates only that shape (plus the general kernel for misaligned inputs), with the policy
// given (RmsNormPolicy by default).
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status rms_norm_forward(const RmsNormForwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_forward<detail::RmsFwdOp<T, W>, detail::kAnyCols, RmsNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status rms_norm_forward(const RmsNormForwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_forward<detail::RmsFwdOp<T, W>, kCols, Policy>(args, stream);
}

// Bytes of workspace rms_norm_backward(args) needs: 0 without dweight, else one fp32 row of
// partial sums per row group of the launch the call will make (a function of the device, the shape
// and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status rms_norm_backward_workspace_bytes(const RmsNormBackwardArgs<T, W>& args,
                                                       std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::RmsBwdOp<T, W>, detail::kAnyCols, RmsNormPolicy>(
      args, bytes);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status rms_norm_backward_workspace_bytes(const RmsNormBackwardArgs<T, W>& args,
                                                       std::size_t& bytes) {
  return detail::norm_backward_workspace_bytes<detail::RmsBwdOp<T, W>, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status rms_norm_backward(const RmsNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_backward<detail::RmsBwdOp<T, W>, detail::kAnyCols, RmsNormPolicy>(args, stream);
}

template <class T, int kCols, class Policy = RmsNormPolicy, class W>
[[nodiscard]] Status rms_norm_backward(const RmsNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  return detail::norm_backward<detail::RmsBwdOp<T, W>, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
