// tigon/norm/rms_norm.cuh - RMSNorm forward and backward.
//
//   rstd = 1 / sqrt(mean(x^2) + eps)          (fp32, one per row, saved for the backward)
//   y    = x * rstd * (offset + w)            (casting as Hugging Face defines it, below)
//
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
#include "row_kernel.cuh"

#if defined(__CUDACC__)
#include "../core/async_copy.cuh"
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

// Row lengths are indexed with 32-bit integers inside a row.
inline constexpr std::int64_t kRmsNormMaxCols = std::int64_t{1} << 30;

template <class T, class W>
Status validate(const RmsNormForwardArgs<T, W>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.y, op, "y"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRmsNormMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.x_stride, a.cols, op, "x_stride"));
  TIGON_CHECK(row_stride(a.y_stride, a.cols, op, "y_stride"));
  if (!(a.eps >= 0.0f) || a.eps == __builtin_inff()) {
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  if (a.casting != RmsNormCasting::llama && a.casting != RmsNormCasting::gemma &&
      a.casting != RmsNormCasting::none) {
    return Status::error(Errc::invalid_value, op, "casting", "unknown casting mode");
  }
  const MatrixView x = MatrixView::of(a.x, a.rows, a.cols, a.x_stride);
  const MatrixView y = MatrixView::of(a.y, a.rows, a.cols, a.y_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  TIGON_CHECK(same_or_disjoint(y, x, op, "y", "x"));
  TIGON_CHECK(disjoint(y, w, op, "y", "weight"));
  if (a.rstd != nullptr) {
    TIGON_CHECK(disjoint(r, x, op, "rstd", "x"));
    TIGON_CHECK(disjoint(r, y, op, "rstd", "y"));
    TIGON_CHECK(disjoint(r, w, op, "rstd", "weight"));
  }
  return Status();
}

template <class T, class W>
Status validate(const RmsNormBackwardArgs<T, W>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.dy, op, "dy"));
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.dx, op, "dx"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.cols, op, "cols"));
  TIGON_CHECK(at_most(a.cols, kRmsNormMaxCols, op, "cols"));
  TIGON_CHECK(row_stride(a.dy_stride, a.cols, op, "dy_stride"));
  TIGON_CHECK(row_stride(a.x_stride, a.cols, op, "x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.cols, op, "dx_stride"));
  if (a.rstd == nullptr && (!(a.eps >= 0.0f) || a.eps == __builtin_inff())) {
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  if (a.casting != RmsNormCasting::llama && a.casting != RmsNormCasting::gemma &&
      a.casting != RmsNormCasting::none) {
    return Status::error(Errc::invalid_value, op, "casting", "unknown casting mode");
  }
  if (a.dweight != nullptr && a.weight == nullptr) {
    return Status::error(Errc::invalid_value, op, "dweight",
                         "requested without a weight (a forward without affine has no dW)");
  }
  const MatrixView dy = MatrixView::of(a.dy, a.rows, a.cols, a.dy_stride);
  const MatrixView x = MatrixView::of(a.x, a.rows, a.cols, a.x_stride);
  const MatrixView dx = MatrixView::of(a.dx, a.rows, a.cols, a.dx_stride);
  const MatrixView w = MatrixView::of(a.weight, 1, a.cols, 0);
  const MatrixView dw = MatrixView::of(a.dweight, 1, a.cols, 0);
  const MatrixView r = MatrixView::of(a.rstd, 1, a.rows, 0);
  TIGON_CHECK(same_or_disjoint(dx, dy, op, "dx", "dy"));
  TIGON_CHECK(same_or_disjoint(dx, x, op, "dx", "x"));
  TIGON_CHECK(disjoint(dx, w, op, "dx", "weight"));
  TIGON_CHECK(disjoint(dx, r, op, "dx", "rstd"));
  if (a.dweight != nullptr) {
    TIGON_CHECK(disjoint(dw, dy, op, "dweight", "dy"));
    TIGON_CHECK(disjoint(dw, x, op, "dweight", "x"));
    TIGON_CHECK(disjoint(dw, dx, op, "dweight", "dx"));
    TIGON_CHECK(disjoint(dw, w, op, "dweight", "weight"));
    TIGON_CHECK(disjoint(dw, r, op, "dweight", "rstd"));
  }
  return Status();
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Launch shapes (host + device constants; tested on the host)
// ------------------------------------------------------------------------------------------------

// Tuning knobs of the compiled (fixed hidden size) kernels. A trainer may pass its own policy.
template <int kFwdVecPerThread_ = 4, int kFwdBlockThreads_ = 256, int kBwdVecPerThread_ = 2,
          int kBwdBlockThreads_ = 512, int kBwdMinBlocksPerSm_ = 1, int kStages_ = 3,
          int kCasting_ = -1, bool kFwdPersistent_ = false, bool kStreamingStores_ = false,
          bool kBwdKeepRows_ = true, bool kFwdDirect_ = true, bool kBwdDirect_ = false,
          bool kFwdDirectStream_ = false, int kFwdMinBlocksPerSm_ = 0, int kFwdPrefetch_ = 2>
struct RmsNormPolicy {
  static_assert(kFwdMinBlocksPerSm_ >= 0 && kFwdMinBlocksPerSm_ <= 32, "0 (no bound) to 32 blocks per SM");
  static_assert(kFwdPrefetch_ >= 0 && kFwdPrefetch_ <= 2, "forward prefetch: 0, 1 or 2");
  // RMSNorm forward: what its blocks ask the L2 for around the grid-dependency wait (programmatic
  // dependent launch), as hints. 0: nothing. 1: every block its own rows, before the wait. 2 (the
  // default): only the first wave's blocks (those resident at once) ask, for their own rows before
  // the wait and, right after it, for the rows of the blocks that take their places in the second
  // wave; later blocks ask nothing. On one H200, 2 was the fastest variant measured and the least
  // sensitive to where the tensors lie (docs/rms_norm.md). The add + RMSNorm forward ignores the
  // knob: every block asks for its rows of x and the residual before the wait (with two inputs,
  // 2 measured slower there: docs/add_rms_norm.md).
  static constexpr int kFwdPrefetch = kFwdPrefetch_;
  // Forward (RMSNorm and add + RMSNorm): the second __launch_bounds__ argument, a floor on the
  // blocks per SM that caps registers (0, the default: none; ptxas then gives the default
  // 4-vector, 256-thread RMSNorm forward 56 registers, 4 blocks per SM; a floor of 5 gives 48
  // registers without spilling, 6 gives 40 with 44 bytes spilled; sm_90, CUDA 13.0).
  static constexpr int kFwdMinBlocksPerSm = kFwdMinBlocksPerSm_;
  // Direct forward (RMSNorm and add + RMSNorm): the row's loads carry the streaming (evict-first)
  // hint (true), or are plain loads (false: the default; on one H200 at 16384 x 4096 bf16 plain
  // loads measured 96.7% of the copy rate for RMSNorm and 97.1% for add + RMSNorm, the streaming
  // hint 92.6% / 93.8%, docs/rms_norm.md).
  static constexpr bool kFwdDirectStream = kFwdDirectStream_;
  // Backward: each thread loads its vectors of the next row's x and dy straight into registers
  // while it works on this row (true), or the rows are staged through shared memory with
  // cp.async, kStages deep (false: the default until measured against it).
  static constexpr bool kBwdDirect = kBwdDirect_;
  // Non-persistent forward (RMSNorm and add + RMSNorm): each thread loads its vectors of the row
  // straight into registers (true: the default, with plain loads 1-2 points ahead of staging on
  // one H200), or stages the row through shared memory with cp.async (false).
  static constexpr bool kFwdDirect = kFwdDirect_;
  // Backward: keep the row's x and dy in registers between the row sums and dx (true: the
  // default, 1-2% faster on the H200), or read them again from shared memory (false: fewer
  // registers).
  static constexpr bool kBwdKeepRows = kBwdKeepRows_;
  // Forward grid: resident blocks walking all rows (true), or one block per kGroups rows (false:
  // the default; freshly scheduled blocks stream closer to the copy rate on the H200).
  static constexpr bool kFwdPersistent = kFwdPersistent_;
  // Store y / dx with the streaming (evict-first) cache hint.
  static constexpr bool kStreamingStores = kStreamingStores_;
  // -1: one instance per casting mode, chosen from the arguments at run time; 0, 1, 2: only the
  // llama, gemma or none instance (arguments with another mode are rejected).
  static constexpr int kCasting = kCasting_;
  static constexpr int kFwdVecPerThread = kFwdVecPerThread_;  // 16-byte vectors per thread per row
  static constexpr int kFwdBlockThreads = kFwdBlockThreads_;  // target block size (rows side by side)
  static constexpr int kBwdVecPerThread = kBwdVecPerThread_;
  static constexpr int kBwdBlockThreads = kBwdBlockThreads_;
  static constexpr int kBwdMinBlocksPerSm = kBwdMinBlocksPerSm_;  // caps registers for occupancy
  // Rows each row group keeps in flight through shared memory (cp.async), lowered automatically
  // when the rows do not fit. The non-persistent forward needs one.
  static constexpr int kStages = kStages_;
};
using RmsNormDefaultPolicy = RmsNormPolicy<>;

namespace detail {

template <class T, int kCols, class P>
using RmsFwdShape = RowShape<T, kCols, P::kFwdVecPerThread, P::kFwdBlockThreads>;
template <class T, int kCols, class P>
using RmsBwdShape = RowShape<T, kCols, P::kBwdVecPerThread, P::kBwdBlockThreads>;

template <class T, int kCols, class P>
using RmsFwdPipe = RowPipeline<RmsFwdShape<T, kCols, P>, T, kCols, 1, P::kFwdPersistent ? P::kStages : 1>;
template <class T, int kCols, class P>
using RmsBwdPipe = RowPipeline<RmsBwdShape<T, kCols, P>, T, kCols, 2, P::kStages>;
// The forward loads straight into registers (no shared memory) when non-persistent and direct.
template <class P>
inline constexpr bool kRmsFwdDirect = P::kFwdDirect && !P::kFwdPersistent;
template <class T, int kCols, class P>
inline constexpr int kRmsFwdSmem = kRmsFwdDirect<P> ? 0 : RmsFwdPipe<T, kCols, P>::kSmemBytes;
template <class T, int kCols, class P>
inline constexpr int kRmsBwdSmem = P::kBwdDirect ? 0 : RmsBwdPipe<T, kCols, P>::kSmemBytes;

inline constexpr int kRmsGeneralThreads = 256;     // block of the general (any size) kernels
inline constexpr int kRmsGeneralBwdBlocksPerSm = 2;
// The general backward accumulates dW in shared memory up to this row length (44 KB, under the
// 48 KB default), in the workspace beyond it.
inline constexpr std::int64_t kRmsGeneralSmemAccCols = 11264;

// Workspace of the backward: one fp32 partial dW row per block (per row group in the compiled
// kernels), 256-byte aligned.
constexpr std::size_t rms_norm_partials_bytes(std::int64_t blocks, std::int64_t cols) {
  return partial_rows_bytes(blocks, cols);
}

}  // namespace detail

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
  float* partials;  // [partial rows, cols] (RmsPlan::parts), or null when dW is not wanted
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t dys, xs, dxs;
  float eps, offset;
  RmsNormCasting casting;
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

// Fixed hidden size: a row group of kGroupThreads threads owns one row at a time and keeps the
// next kStages-1 rows of its sequence in flight through shared memory; kGroups groups per block;
// a persistent grid walks all rows. Each thread reads back only the chunks it copied itself.
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(RmsFwdShape<T, kCols, P>::kThreads, P::kFwdMinBlocksPerSm)
    rms_norm_fwd_kernel(const RmsFwdParams<T, W> p) {
  using S = RmsFwdShape<T, kCols, P>;
  using Pipe = RmsFwdPipe<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kStages = Pipe::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  // L2 prefetches around the wait (policy kFwdPrefetch): hints, not accesses.
  const bool first_wave = blockIdx.x < p.wave_blocks;
  prefetch_first_row<P::kFwdPrefetch, S>(p.x, p.xs, first, p.rows, first_wave, t);
  detail::grid_dependency_sync();
  prefetch_second_wave_row<P::kFwdPrefetch, S>(p.x, p.xs, first + p.wave_blocks * S::kGroups, p.rows,
                                               first_wave, t);
  const bool has_w = p.w != nullptr;
  const RmsNormCasting casting =
      P::kCasting < 0 ? p.casting : static_cast<RmsNormCasting>(P::kCasting);
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * kCols;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;

  constexpr bool kDirect = kRmsFwdDirect<P>;
  if constexpr (!kDirect) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      const std::int64_t r = first + s * step;
      stage_row<S>(stages + s * kCols, p.x + r * p.xs, t, r < p.rows);
      cp_async_commit();
    }
  }

  int parity = 0;
  int k = 0;
  for (std::int64_t row = first; row < p.rows; row += step, ++k) {
    const T* xr = p.x + row * p.xs;  // direct: global memory; staged: this row's stage
    if constexpr (!kDirect) {
      const std::int64_t ahead = row + (kStages - 1) * step;
      stage_row<S>(stages + ((k + kStages - 1) % kStages) * kCols, p.x + ahead * p.xs, t, ahead < p.rows);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      xr = stages + (k % kStages) * kCols;
    }
    AlignedVec<T, kV> xv[S::kVecPerThread];
    float ss[1] = {0.0f};
    if constexpr (kDirect) {  // every load in flight before the first use
#pragma unroll
      for (int v = 0; v < S::kVecPerThread; ++v) {
        const int i = v * S::kGroupThreads + t;
        if (S::kExact || i < S::kNumVec) {
          xv[v] = load_vec_hinted<P::kFwdDirectStream, kV>(xr + i * kV);
        }
      }
    }
#pragma unroll
    for (int v = 0; v < S::kVecPerThread; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        if constexpr (!kDirect) xv[v] = load_vec<kV>(xr + i * kV);
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
        store_vec_hinted<P::kStreamingStores>(yr + i * kV, yv);
      }
    }
  }
  if constexpr (!kDirect) cp_async_wait<0>();
}

// Fixed hidden size backward: the same pipeline over x and dy; each thread keeps its columns' dW
// in registers across all the rows it visits, and each row group writes one partial dW row to the
// workspace at the end (summed in a fixed order by column_sum).
template <class T, class W, int kCols, class P>
TIGON_KERNEL void __launch_bounds__(RmsBwdShape<T, kCols, P>::kThreads, P::kBwdMinBlocksPerSm)
    rms_norm_bwd_kernel(const RmsBwdParams<T, W> p) {
  using S = RmsBwdShape<T, kCols, P>;
  using Pipe = RmsBwdPipe<T, kCols, P>;
  constexpr int kV = S::kVec;
  constexpr int kVPT = S::kVecPerThread;
  constexpr int kStages = Pipe::kStages;
  using Reduce = GroupAllReduce<S::kGroupThreads, S::kGroups, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int t = threadIdx.x % S::kGroupThreads;
  const int g = threadIdx.x / S::kGroupThreads;
  detail::grid_dependency_sync();
  const RmsNormCasting casting =
      P::kCasting < 0 ? p.casting : static_cast<RmsNormCasting>(P::kCasting);
  const bool want_dw = p.partials != nullptr;
  // [group][stage][x | dy][kCols]
  T* stages = reinterpret_cast<T*>(smem_raw) + static_cast<std::size_t>(g) * kStages * 2 * kCols;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * S::kGroups;
  constexpr bool kDirect = P::kBwdDirect;
  auto issue = [&](std::int64_t r, int stage) {
    stage_row<S>(stages + (stage * 2) * kCols, p.x + r * p.xs, t, r < p.rows);
    stage_row<S>(stages + (stage * 2 + 1) * kCols, p.dy + r * p.dys, t, r < p.rows);
    cp_async_commit();
  };
  // Direct: this thread's vectors of row r of x and dy, straight into registers.
  AlignedVec<T, kV> xn[kVPT], dyn[kVPT];
  auto fetch = [&](std::int64_t r) {
    if (r >= p.rows) return;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        xn[v] = load_vec_stream<kV>(p.x + r * p.xs + i * kV);
        dyn[v] = load_vec_stream<kV>(p.dy + r * p.dys + i * kV);
      }
    }
  };

  // dW accumulators, and (offset + w) of this thread's columns, read once.
  float acc[kVPT][kV] = {};
  float wk[kVPT][kV];
  load_row_weights<S, true>(p.w, p.offset, t, wk);
  const bool saved_rstd = p.rstd != nullptr;
  if constexpr (kDirect) {
    fetch(first);
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(first + s * step, s);
  }

  int parity = 0;
  int k = 0;
  for (std::int64_t row = first; row < p.rows; row += step, ++k) {
    const T* xr = nullptr;
    const T* dyr = nullptr;
    AlignedVec<T, kV> xk[kVPT], dyk[kVPT];
    if constexpr (kDirect) {
#pragma unroll
      for (int v = 0; v < kVPT; ++v) {
        xk[v] = xn[v];
        dyk[v] = dyn[v];
      }
      fetch(row + step);  // the next row is in flight while this one is reduced and written
    } else {
      issue(row + (kStages - 1) * step, (k + kStages - 1) % kStages);
      cp_async_wait<kStages - 1>();
      xr = stages + ((k % kStages) * 2) * kCols;
      dyr = xr + kCols;
    }
    const float saved = saved_rstd ? p.rstd[row] : 0.0f;
    // s[0] = sum(dn * x), s[1] = sum(x^2) (only for the rstd when it was not saved: the branch is
    // taken once per row, outside the element loop)
    float s[2] = {0.0f, 0.0f};
    auto row_sums = [&](auto with_sq) {
#pragma unroll
      for (int v = 0; v < kVPT; ++v) {
        const int i = v * S::kGroupThreads + t;
        if (S::kExact || i < S::kNumVec) {
          if constexpr (!kDirect) {
            xk[v] = load_vec<kV>(xr + i * kV);
            dyk[v] = load_vec<kV>(dyr + i * kV);
          }
          float xf[kV], dyf[kV];
          to_floats(xk[v], xf);
          to_floats(dyk[v], dyf);
#pragma unroll
          for (int c = 0; c < kV; ++c) {
            s[0] += dyf[c] * wk[v][c] * xf[c];
            if constexpr (decltype(with_sq)::value) s[1] += xf[c] * xf[c];
          }
        }
      }
    };
    if (saved_rstd) {
      row_sums(std::false_type{});
    } else {
      row_sums(std::true_type{});
    }
    Reduce::sum(s, tmp, g, t, parity);
    parity ^= 1;
    const float rstd = saved_rstd ? saved : rms_norm_math::rstd(s[1], kCols, p.eps);
    const float mean_dot = rstd * s[0] / static_cast<float>(kCols);
    T* dxr = p.dx + row * p.dxs;
#pragma unroll
    for (int v = 0; v < kVPT; ++v) {
      const int i = v * S::kGroupThreads + t;
      if (S::kExact || i < S::kNumVec) {
        // The row again: from the registers of the first loop, or re-read from shared memory.
        AlignedVec<T, kV> xv, dyv;
        if constexpr (P::kBwdKeepRows || kDirect) {
          xv = xk[v];
          dyv = dyk[v];
        } else {
          xv = load_vec<kV>(xr + i * kV);
          dyv = load_vec<kV>(dyr + i * kV);
        }
        float xhat[kV], dyf[kV];
        to_floats(xv, xhat);
        to_floats(dyv, dyf);
        AlignedVec<T, kV> dxv;
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          xhat[c] *= rstd;
          dxv.v[c] = from_float<T>(rms_norm_math::dx(dyf[c] * wk[v][c], xhat[c], rstd, mean_dot));
        }
        if (want_dw) add_dweight_terms<T>(dyf, xhat, casting, acc[v]);
        store_vec_hinted<P::kStreamingStores>(dxr + i * kV, dxv);
      }
    }
  }
  if constexpr (!kDirect) cp_async_wait<0>();

  if (!want_dw) return;
  // One partial row per row group: no cross-group combine, so no block-wide barrier here and no
  // shared memory written by one group and read by another.
  store_partial_row<S>(p.partials + (static_cast<std::int64_t>(blockIdx.x) * S::kGroups + g) * kCols, acc, t);
}

// Any hidden size: one row per block at a time, two passes over the row (the second is served
// from L1/L2), kV = 16-byte vectors when pointers and strides allow it, else single elements.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kRmsGeneralThreads)
    rms_norm_fwd_general_kernel(const RmsFwdParams<T, W> p) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kRmsGeneralThreads;
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

// Any hidden size backward. dW is accumulated per block in shared memory when the row fits
// (kRmsGeneralSmemAccCols), else directly in the block's partial row of the workspace; each
// column belongs to one thread, so either way the sums are race-free and in a fixed order.
template <class T, class W, int kV>
TIGON_KERNEL void __launch_bounds__(kRmsGeneralThreads)
    rms_norm_bwd_general_kernel(const RmsBwdParams<T, W> p, bool smem_acc) {
  detail::grid_dependency_sync();
  constexpr int kThreads = kRmsGeneralThreads;
  using Reduce = BlockAllReduce<kThreads, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  extern __shared__ float smem_dw[];
  const int nvec = static_cast<int>(p.cols / kV);
  const bool has_w = p.w != nullptr;
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
    const T* xr = p.x + row * p.xs;
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
      AlignedVec<W, kV> wv;
      if (has_w) wv = load_vec<kV>(p.w + c);
      AlignedVec<T, kV> dxv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float xhat = to_float(xv.v[k]) * rstd;
        const float dyf = to_float(dyv.v[k]);
        const float dn = dyf * (has_w ? p.offset + to_float(wv.v[k]) : 1.0f);
        dxv.v[k] = from_float<T>(rms_norm_math::dx(dn, xhat, rstd, mean_dot));
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

// ---- launch planning: which kernel, what grid, how much workspace -----------------------------

using RmsKernel = RowKernel;  // norm/row_kernel.cuh
using RmsPlan = RowPlan;

template <class T, class W, int kV>
bool fwd_vectorizable(const RmsFwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.x, p.xs, kV) && rows_aligned(p.y, p.ys, kV) &&
         (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
}

template <class T, class W, int kV>
bool bwd_vectorizable(const RmsBwdParams<T, W>& p) {
  return p.cols % kV == 0 && rows_aligned(p.dy, p.dys, kV) && rows_aligned(p.x, p.xs, kV) &&
         rows_aligned(p.dx, p.dxs, kV) && (p.w == nullptr || is_aligned(p.w, kV * sizeof(W)));
}

template <class T, class W>
RmsFwdParams<T, W> fwd_params(const RmsNormForwardArgs<T, W>& a) {
  return {a.x,    a.y,    a.weight,
          a.rstd, a.rows, a.cols,
          a.x_stride ? a.x_stride : a.cols, a.y_stride ? a.y_stride : a.cols,
          a.eps,  a.offset, a.casting};
}

template <class T, class W>
RmsBwdParams<T, W> bwd_params(const RmsNormBackwardArgs<T, W>& a) {
  return {a.dy,   a.x,    a.weight, a.rstd, a.dx, nullptr, a.rows, a.cols,
          a.dy_stride ? a.dy_stride : a.cols, a.x_stride ? a.x_stride : a.cols,
          a.dx_stride ? a.dx_stride : a.cols, a.eps, a.offset, a.casting};
}

// kCols == 0: only the general kernels are candidates.
template <class T, class W, int kCols, class P>
Status plan_forward(const RmsFwdParams<T, W>& p, const DeviceInfo& dev, RmsPlan& plan) {
  if constexpr (compiled_available<RmsFwdShape, T, kCols, P>()) {
    using S = RmsFwdShape<T, kCols, P>;
    // The compiled kernel's shared-memory pipeline must fit this device's per-block limit.
    if (fwd_vectorizable<T, W, S::kVec>(p) &&
        kRmsFwdSmem<T, kCols, P> + 1024 <= dev.smem_per_block_optin) {
      return plan_compiled_rows<rms_norm_fwd_kernel<T, W, kCols, P>, S::kThreads, kRmsFwdSmem<T, kCols, P>>(
          p.rows, S::kGroups, P::kFwdPersistent, dev, plan);
    }
  }
  plan.kernel = fwd_vectorizable<T, W, kVecElems<T>>(p) ? RmsKernel::general_vec
                                                        : RmsKernel::general_scalar;
  int occ = 0;
  if (plan.kernel == RmsKernel::general_vec) {
    TIGON_CHECK((blocks_per_sm<rms_norm_fwd_general_kernel<T, W, kVecElems<T>>, kRmsGeneralThreads>(
        dev.device, occ)));
  } else {
    TIGON_CHECK((blocks_per_sm<rms_norm_fwd_general_kernel<T, W, 1>, kRmsGeneralThreads>(dev.device, occ)));
  }
  plan.grid = static_cast<int>(
      std::min<std::int64_t>(p.rows, static_cast<std::int64_t>(occ) * dev.sm_count));
  return Status();
}

template <class T, class W, int kCols, class P>
Status plan_backward(const RmsBwdParams<T, W>& p, bool want_dw, const DeviceInfo& dev,
                     RmsPlan& plan) {
  plan = RmsPlan{};
  bool compiled = false;
  if constexpr (compiled_available<RmsBwdShape, T, kCols, P>()) {
    using S = RmsBwdShape<T, kCols, P>;
    if (bwd_vectorizable<T, W, S::kVec>(p) &&
        kRmsBwdSmem<T, kCols, P> + 1024 <= dev.smem_per_block_optin) {
      // Persistent: each row group writes one partial dW row.
      TIGON_CHECK((plan_compiled_rows<rms_norm_bwd_kernel<T, W, kCols, P>, S::kThreads, kRmsBwdSmem<T, kCols, P>>(
          p.rows, S::kGroups, true, dev, plan)));
      compiled = true;
    }
  }
  if (!compiled) {
    plan.kernel = bwd_vectorizable<T, W, kVecElems<T>>(p) ? RmsKernel::general_vec
                                                          : RmsKernel::general_scalar;
    plan.grid = static_cast<int>(std::min<std::int64_t>(
        p.rows, static_cast<std::int64_t>(kRmsGeneralBwdBlocksPerSm) * dev.sm_count));
    plan.parts = plan.grid;
  }
  plan.workspace_bytes = want_dw ? rms_norm_partials_bytes(plan.parts, p.cols) : 0;
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_forward(const RmsFwdParams<T, W>& p, const RmsPlan& plan, cudaStream_t stream) {
  constexpr const char* kOp = "rms_norm_forward";
  const dim3 grid(static_cast<unsigned>(plan.grid));
  switch (plan.kernel) {
    case RmsKernel::compiled:
      if constexpr (compiled_available<RmsFwdShape, T, kCols, P>()) {
        using S = RmsFwdShape<T, kCols, P>;
        RmsFwdParams<T, W> q = p;
        q.wave_blocks = plan.resident;
        return launch(kOp, rms_norm_fwd_kernel<T, W, kCols, P>,
                      {grid, dim3(S::kThreads), kRmsFwdSmem<T, kCols, P>, stream}, q);
      }
      break;
    case RmsKernel::general_vec:
      return launch(kOp, rms_norm_fwd_general_kernel<T, W, kVecElems<T>>,
                    {grid, dim3(kRmsGeneralThreads), 0, stream}, p);
    case RmsKernel::general_scalar:
      return launch(kOp, rms_norm_fwd_general_kernel<T, W, 1>, {grid, dim3(kRmsGeneralThreads), 0, stream}, p);
  }
  return Status();
}

template <class T, class W, int kCols, class P>
Status launch_backward(const RmsBwdParams<T, W>& p, const RmsPlan& plan, W* dweight,
                       bool accumulate, cudaStream_t stream) {
  constexpr const char* kOp = "rms_norm_backward";
  const dim3 grid(static_cast<unsigned>(plan.grid));
  if (plan.kernel == RmsKernel::compiled) {
    if constexpr (compiled_available<RmsBwdShape, T, kCols, P>()) {
      using S = RmsBwdShape<T, kCols, P>;
      TIGON_CHECK(launch(kOp, rms_norm_bwd_kernel<T, W, kCols, P>,
                         {grid, dim3(S::kThreads), kRmsBwdSmem<T, kCols, P>, stream}, p));
    }
  } else {
    const bool smem_acc = p.partials != nullptr && p.cols <= kRmsGeneralSmemAccCols;
    const std::size_t smem = smem_acc ? static_cast<std::size_t>(p.cols) * sizeof(float) : 0;
    if (plan.kernel == RmsKernel::general_vec) {
      TIGON_CHECK(launch(kOp, rms_norm_bwd_general_kernel<T, W, kVecElems<T>>,
                         {grid, dim3(kRmsGeneralThreads), smem, stream}, p, smem_acc));
    } else {
      TIGON_CHECK(launch(kOp, rms_norm_bwd_general_kernel<T, W, 1>, {grid, dim3(kRmsGeneralThreads), smem, stream},
                         p, smem_acc));
    }
  }
  if (dweight == nullptr) return Status();
  return column_sum(p.partials, plan.parts, p.cols, dweight, accumulate, stream, kOp);
}

// The compiled kernels take the casting mode as a compile-time constant (a runtime select per
// element measurably slowed the backward); a policy that leaves it open (-1) is specialised here
// for the mode in the arguments.
template <class P, int kMode>
struct WithCasting : P {
  static constexpr int kCasting = kMode;
};

template <class P, class F>
Status with_casting(RmsNormCasting c, F&& f) {
  if constexpr (P::kCasting >= 0) {
    return f(std::type_identity<P>{});
  } else {
    switch (c) {
      case RmsNormCasting::llama: return f(std::type_identity<WithCasting<P, 0>>{});
      case RmsNormCasting::gemma: return f(std::type_identity<WithCasting<P, 1>>{});
      case RmsNormCasting::none: return f(std::type_identity<WithCasting<P, 2>>{});
    }
    return Status::error(Errc::invalid_value, "rms_norm", "casting", "unknown casting mode");
  }
}

// with_casting for a compiled size; kCols == 0 (the general kernels, no casting instance) calls f
// with P itself.
template <int kCols, class P, class F>
Status with_casting_for(RmsNormCasting c, F&& f) {
  if constexpr (kCols == 0) {
    return f(std::type_identity<P>{});
  } else {
    return with_casting<P>(c, f);
  }
}

// Forward for one candidate size (0: general only).
template <class T, class W, int kCols, class P>
Status forward_fixed(const RmsNormForwardArgs<T, W>& a, cudaStream_t stream) {
  const RmsFwdParams<T, W> p = fwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RmsPlan plan;
  TIGON_CHECK((plan_forward<T, W, kCols, P>(p, dev, plan)));
  return launch_forward<T, W, kCols, P>(p, plan, stream);
}

template <class T, class W, int kCols, class P>
Status backward_workspace_fixed(const RmsNormBackwardArgs<T, W>& a, std::size_t& bytes) {
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RmsPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(bwd_params(a), a.dweight != nullptr, dev, plan)));
  bytes = plan.workspace_bytes;
  return Status();
}

template <class T, class W, int kCols, class P>
Status backward_fixed(const RmsNormBackwardArgs<T, W>& a, cudaStream_t stream) {
  constexpr const char* kOp = "rms_norm_backward";
  RmsBwdParams<T, W> p = bwd_params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RmsPlan plan;
  TIGON_CHECK((plan_backward<T, W, kCols, P>(p, a.dweight != nullptr, dev, plan)));
  TIGON_CHECK(check::workspace(a.workspace, a.workspace_bytes, plan.workspace_bytes, kOp));
  if (a.dweight != nullptr) p.partials = static_cast<float*>(a.workspace);
  return launch_backward<T, W, kCols, P>(p, plan, a.dweight, a.accumulate_dweight, stream);
}

template <class T, class W, int kCols, class P>
Status forward_impl(const RmsNormForwardArgs<T, W>& a, cudaStream_t stream) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return forward_fixed<T, W, kCols, typename decltype(q)::type>(a, stream);
  });
}

template <class T, class W, int kCols, class P>
Status backward_workspace_impl(const RmsNormBackwardArgs<T, W>& a, std::size_t& bytes) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return backward_workspace_fixed<T, W, kCols, typename decltype(q)::type>(a, bytes);
  });
}

template <class T, class W, int kCols, class P>
Status backward_impl(const RmsNormBackwardArgs<T, W>& a, cudaStream_t stream) {
  return with_casting_for<kCols, P>(a.casting, [&](auto q) {
    return backward_fixed<T, W, kCols, typename decltype(q)::type>(a, stream);
  });
}

template <int kCols, class P>
Status check_compiled(std::int64_t cols, RmsNormCasting casting, const char* op) {
  if (cols != kCols) {
    return Status::error(Errc::invalid_size, op, "cols",
                         std::to_string(cols) + " does not match the compiled hidden size " +
                             std::to_string(kCols));
  }
  if (P::kCasting >= 0 && static_cast<int>(casting) != P::kCasting) {
    return Status::error(Errc::invalid_value, op, "casting",
                         std::string(casting_name(casting)) + " given, the policy fixes " +
                             casting_name(static_cast<RmsNormCasting>(P::kCasting)));
  }
  return Status();
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// Runtime hidden size: rms_norm_forward(args, stream) picks the compiled instance for the sizes in
// TIGON_HIDDEN_SIZES and the general kernel for any other size, or when pointers / strides do not
// allow 16-byte accesses. Compile-time hidden size: rms_norm_forward<bf16, 4096>(args, stream)
// instantiates only that shape (plus the general kernel for misaligned inputs).
//
// None of them allocates, synchronises or copies to the host: all are graph-capturable.

template <class T, class W>
[[nodiscard]] Status rms_norm_forward(const RmsNormForwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "rms_norm_forward"));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) { return detail::forward_impl<T, W, decltype(n)::value, RmsNormDefaultPolicy>(args, stream); },
      [&] { return detail::forward_impl<T, W, 0, RmsNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status rms_norm_forward(const RmsNormForwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "rms_norm_forward"));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting, "rms_norm_forward")));
  return detail::forward_impl<T, W, kCols, Policy>(args, stream);
}

// Bytes of workspace rms_norm_backward(args) needs: 0 without dweight, else one fp32 row of
// partial sums per row group of the launch the call will make (a function of the device, the shape
// and the pointers' alignment; the same arguments always give the same answer).
template <class T, class W>
[[nodiscard]] Status rms_norm_backward_workspace_bytes(const RmsNormBackwardArgs<T, W>& args,
                                                       std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "rms_norm_backward_workspace_bytes"));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) {
        return detail::backward_workspace_impl<T, W, decltype(n)::value, RmsNormDefaultPolicy>(args, bytes);
      },
      [&] { return detail::backward_workspace_impl<T, W, 0, RmsNormDefaultPolicy>(args, bytes); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status rms_norm_backward_workspace_bytes(const RmsNormBackwardArgs<T, W>& args,
                                                       std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "rms_norm_backward_workspace_bytes"));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting, "rms_norm_backward_workspace_bytes")));
  return detail::backward_workspace_impl<T, W, kCols, Policy>(args, bytes);
}

template <class T, class W>
[[nodiscard]] Status rms_norm_backward(const RmsNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "rms_norm_backward"));
  return dispatch_int(
      HiddenSizes{}, args.cols,
      [&](auto n) { return detail::backward_impl<T, W, decltype(n)::value, RmsNormDefaultPolicy>(args, stream); },
      [&] { return detail::backward_impl<T, W, 0, RmsNormDefaultPolicy>(args, stream); });
}

template <class T, int kCols, class Policy = RmsNormDefaultPolicy, class W>
[[nodiscard]] Status rms_norm_backward(const RmsNormBackwardArgs<T, W>& args, cudaStream_t stream) {
  TIGON_CHECK(detail::validate(args, "rms_norm_backward"));
  TIGON_CHECK((detail::check_compiled<kCols, Policy>(args.cols, args.casting, "rms_norm_backward")));
  return detail::backward_impl<T, W, kCols, Policy>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
