// tigon/loss/cross_entropy.cuh - cross-entropy loss over logits [rows, vocab] with the gradient
// written in place over the logits (or into its own buffer), and the split-vocabulary pieces a
// tensor-parallel trainer combines with its own collective.
//
// Per row with target t (all in fp32):
//   x_i    = logit_i, or c * tanh(logit_i / c) with a softcap c
//   lse    = log(sum_i exp(x_i))
//   loss   = (1 - eps) * w_t * (lse - x_t) + eps / V * sum_i w_i * (lse - x_i) + z * lse^2
//   dloss/dx_i = (1 - eps) * w_t * (p_i - [i == t]) + eps / V * (p_i * sum_j w_j - w_i)
//                + 2 z lse p_i,       p_i = exp(x_i - lse)
// times (1 - (x_i / c)^2) through the softcap, times the upstream gradient, divided by the mean's
// denominator. w are the class weights (1 without), eps the label smoothing, z the z-loss scale.
// Rows whose target is ignore_index contribute nothing; the mean divides by the sum of w_t over
// the other rows, counted on the device (no host synchronisation anywhere).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"

#if defined(__CUDACC__)
#include <cooperative_groups.h>

#include "../core/device.hpp"
#include "../core/launch.cuh"
#include "../core/async_copy.cuh"
#include "../core/reduce.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

enum class Reduction : int { none = 0, sum = 1, mean = 2 };

template <class T, class I = std::int64_t>
struct CrossEntropyArgs {
  const T* logits = nullptr;  // [rows, vocab], row stride logits_stride (0: vocab)
  const I* targets = nullptr; // [rows], int32 or int64
  std::int64_t rows = 0;
  std::int64_t vocab = 0;
  std::int64_t logits_stride = 0;
  // Gradient: null computes the loss only; may be `logits` itself (in place, same stride).
  T* dlogits = nullptr;
  std::int64_t dlogits_stride = 0;
  const float* class_weights = nullptr;  // [vocab], or null
  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float z_loss_scale = 0.0f;  // adds z_loss_scale * lse^2 per (non-ignored) row
  float softcap = 0.0f;       // > 0: logits pass through softcap * tanh(x / softcap)
  Reduction reduction = Reduction::mean;
  // Upstream gradient: grad_scale (a host scalar folded into the gradient) times, when given,
  // grad_output on the device: one value for mean / sum, [rows] values for reduction none.
  float grad_scale = 1.0f;
  const float* grad_output = nullptr;
  // Outputs, each optional.
  float* loss = nullptr;        // [1]: the reduced loss (mean / sum); z-loss included
  float* loss_rows = nullptr;   // [rows]: each row's loss (z-loss included), before reduction
  float* z_loss = nullptr;      // [1]: the z-loss part of `loss`, reduced the same way
  float* lse = nullptr;         // [rows]: logsumexp of the (softcapped) logits
  std::int64_t* argmax = nullptr;  // [rows]: index of the largest logit (first one on ties)
  int* error_count = nullptr;   // incremented once per row whose target is outside [0, vocab)
  void* workspace = nullptr;    // cross_entropy_workspace_bytes(), 16-byte aligned
  std::size_t workspace_bytes = 0;
};

// Per-row statistics of one vocabulary shard (or of the whole vocabulary, once merged).
struct CrossEntropyStats {
  float max;           // max_i x_i
  float sumexp;        // sum_i exp(x_i - max)
  float target_logit;  // x_t when the target lies in this shard
  float sum_wx;        // sum_i w_i x_i (label smoothing)
  float sum_w;         // sum_i w_i
  float argmax_value;
  std::int64_t argmax;  // global column of the largest logit
  int has_target;       // 1 when the target lies in this shard
  float target_weight;  // w_t when the target lies in this shard (1 without class weights)
};

// ------------------------------------------------------------------------------------------------
// 2. Math
// ------------------------------------------------------------------------------------------------

namespace ce_math {

TIGON_HD float softcap(float x, float c) { return c > 0.0f ? c * tanhf(x / c) : x; }
// d softcap / d x expressed through the capped value y.
TIGON_HD float softcap_grad(float y, float c) { return c > 0.0f ? 1.0f - (y / c) * (y / c) : 1.0f; }

// Merge two (max, sum of exp relative to max) pairs.
TIGON_HD void merge(float& m, float& s, float m2, float s2) {
  const float mm = m > m2 ? m : m2;
  if (mm == -__builtin_huge_valf()) return;  // both empty
  s = s * expf(m - mm) + s2 * expf(m2 - mm);
  m = mm;
}

struct RowTerms {
  float w_t;      // weight of the target
  float sum_w;    // sum of all weights (vocab without weights)
  float sum_wx;   // sum of w_i x_i
  float x_t;
  float lse;
};

// Row loss without the z term, and the z term.
TIGON_HD float row_loss(const RowTerms& r, float eps, std::int64_t vocab) {
  const float nll = r.lse - r.x_t;
  const float smooth = (r.lse * r.sum_w - r.sum_wx) / static_cast<float>(vocab);
  return (1.0f - eps) * r.w_t * nll + eps * smooth;
}

// d loss / d x_i before the softcap, upstream and mean factors.
TIGON_HD float grad(float p, bool is_target, float w_i, const RowTerms& r, float eps, float z,
                    std::int64_t vocab) {
  return (1.0f - eps) * r.w_t * (p - (is_target ? 1.0f : 0.0f)) +
         eps / static_cast<float>(vocab) * (p * r.sum_w - w_i) + 2.0f * z * r.lse * p;
}

}  // namespace ce_math

// ------------------------------------------------------------------------------------------------
// Validation and workspace
// ------------------------------------------------------------------------------------------------

namespace detail {

// Workspace: the mean's denominator, the reduced sums, and per-row loss / z scratch.
inline std::size_t ce_workspace_bytes(std::int64_t rows) {
  return round_up<std::size_t>(16 + static_cast<std::size_t>(rows) * 8u, 256u);
}

// The loss options and sizes (everything but the logits and their gradient): shared with the ops
// that compose cross-entropy.
template <class T, class I>
Status validate_options(const CrossEntropyArgs<T, I>& a, const char* op) {
  using namespace check;
  static_assert(std::is_same_v<I, std::int64_t> || std::is_same_v<I, std::int32_t>,
                "targets are int32 or int64");
  TIGON_CHECK(not_null(a.targets, op, "targets"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.vocab, op, "vocab"));
  TIGON_CHECK(at_most(a.vocab, std::int64_t{1} << 31, op, "vocab"));
  if (!(a.label_smoothing >= 0.0f && a.label_smoothing <= 1.0f)) {
    return Status::error(Errc::invalid_value, op, "label_smoothing", "must be in [0, 1]");
  }
  if (!(a.z_loss_scale >= 0.0f) || a.z_loss_scale == __builtin_inff()) {
    return Status::error(Errc::invalid_value, op, "z_loss_scale", "must be finite and >= 0");
  }
  if (!(a.softcap >= 0.0f) || a.softcap == __builtin_inff()) {
    return Status::error(Errc::invalid_value, op, "softcap", "must be finite and >= 0 (0: off)");
  }
  if (a.reduction != Reduction::none && a.reduction != Reduction::sum && a.reduction != Reduction::mean) {
    return Status::error(Errc::invalid_value, op, "reduction", "unknown reduction");
  }
  if (a.reduction == Reduction::none && (a.loss != nullptr || a.z_loss != nullptr)) {
    return Status::error(Errc::invalid_value, op, "loss",
                         "reduction none has no reduced loss: use loss_rows");
  }
  return Status();
}

template <class T, class I>
Status validate(const CrossEntropyArgs<T, I>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.logits, op, "logits"));
  TIGON_CHECK(validate_options(a, op));
  TIGON_CHECK(row_stride(a.logits_stride, a.vocab, op, "logits_stride"));
  TIGON_CHECK(row_stride(a.dlogits_stride, a.vocab, op, "dlogits_stride"));
  const MatrixView x = MatrixView::of(a.logits, a.rows, a.vocab, a.logits_stride);
  if (a.dlogits != nullptr) {
    const MatrixView d = MatrixView::of(a.dlogits, a.rows, a.vocab, a.dlogits_stride);
    TIGON_CHECK(same_or_disjoint(d, x, op, "dlogits", "logits"));
    const MatrixView t = MatrixView::of(a.targets, 1, a.rows, 0);
    TIGON_CHECK(disjoint(d, t, op, "dlogits", "targets"));
  }
  float* const outs[] = {a.loss, a.loss_rows, a.z_loss, a.lse};
  const std::int64_t lens[] = {1, a.rows, 1, a.rows};
  const char* names[] = {"loss", "loss_rows", "z_loss", "lse"};
  for (int i = 0; i < 4; ++i) {
    if (outs[i] == nullptr) continue;
    const MatrixView o{outs[i], 1, lens[i], 0, 4};
    TIGON_CHECK(disjoint(o, x, op, names[i], "logits"));
  }
  return Status();
}

// The on-chip kernel's shape: blocks per row (a cluster) and vectors per block, or blocks 0 when
// the row kernel takes the call. want: the policy's kCluster (-1: the fewest of 1, 2, 4, 8 blocks
// whose slices fit slice_bytes); max_smem: the shared memory a block may have.
inline constexpr int kCeMaxCluster = 8;
// A block size of a policy: a whole number of warps in [lo, hi].
constexpr bool whole_warps(int threads, int lo, int hi) { return threads % 32 == 0 && threads >= lo && threads <= hi; }
// Rows longer than this with a gradient take the policy's kGradThreads (CrossEntropyPolicy).
inline constexpr std::int64_t kCeGradWideCols = 65536;
struct CeClusterShape {
  int blocks = 0;
  std::int64_t slice = 0;  // vectors per block
};
constexpr CeClusterShape ce_cluster_shape(std::int64_t nvec, std::int64_t vec_bytes, int want,
                                          std::int64_t slice_bytes, std::int64_t max_smem) {
  CeClusterShape s;
  if (want == 0 || want > kCeMaxCluster || nvec <= 0 || vec_bytes <= 0) return s;
  int c = want;
  if (want < 0) {
    c = 1;
    while (c < kCeMaxCluster && ceil_div<std::int64_t>(nvec, c) * vec_bytes > slice_bytes) c *= 2;
  }
  const std::int64_t slice = ceil_div<std::int64_t>(nvec, c);
  if (slice * vec_bytes > max_smem) return s;
  s.blocks = c;
  s.slice = slice;
  return s;
}

}  // namespace detail

#if defined(__CUDACC__)

// Tuning knobs of the cross-entropy kernels. A trainer may pass its own policy to cross_entropy<P>().
//   kWideThreads:   row kernel: block size for rows longer than 16384 columns (one row per block
//                   at a time);
//   kNarrowThreads: row kernel: block size for shorter rows;
//   kUnroll:        row kernel: 16-byte vectors each thread has in flight per trip of either pass;
//   kRowsPerSm:     row kernel: 0: as many blocks per SM as fit; n > 0: n (at most what fits); the
//                   split-row kernels: blocks per SM likewise (each a slice of a row), which sets
//                   the rows in flight at once (n x SMs / kCluster);
//   kCluster:       the on-chip kernel (sm_90+, 16-byte vectors, a whole vocabulary): each row is
//                   read once into the shared memory of a thread-block cluster of blocks (two
//                   buffers per block: the next row streams in during this one's math), and the
//                   gradient written from there. 0 (the default): never; on one H200 it measured
//                   below the row kernel (docs/cross_entropy.md). -1: with a gradient, the fewest
//                   blocks (1, 2, 4 or 8) whose slices fit kSliceKB each; the loss alone takes the
//                   row kernel (one read either way). 1..8: exactly this many blocks per row, with
//                   or without a gradient, wherever two slices fit a block's shared memory;
//   kClusterThreads: the on-chip kernel's block size;
//   kSliceKB:       the on-chip kernel's slice (one buffer; a block holds two) that the -1 rule
//                   aims at, KiB: small enough for several blocks per SM;
//   kSplitRows:     with kCluster > 0, the split-row kernel instead of the on-chip one: the row's
//                   kCluster blocks (on as many SMs) each stream their slice from global memory
//                   twice (statistics, then the gradient), so that the rows in flight at once stay
//                   few enough for the second read to find them in L2; no shared-memory buffers,
//                   so as many blocks per SM as registers allow; the statistics are exchanged
//                   through distributed shared memory. Measured below the row kernel on one H200
//                   (docs/cross_entropy.md);
//   kSplitPipelined: with kSplitRows, the pipelined split-row kernel: each block streams the next
//                   row's slice while the cluster's statistics for the row before travel, so no
//                   block waits on the exchange with its memory pipe idle (the split-row kernel's
//                   cost on the H200); two rows per cluster in flight. Measured on one H200: it
//                   reads the logits from DRAM once, but each cluster's rows stay latency-bound on
//                   the exchange, 20-44% of the copy rate at 8192 x 128256 (docs/cross_entropy.md);
//   kGradThreads:   row kernel: block size for rows longer than kCeGradWideCols (65536) columns
//                   when a gradient is written (0: kWideThreads). On one H200 512 (the default)
//                   measured 71.2% of the copy rate at 8192 x 128256 and 67.5% at 262144 columns
//                   against 65.8% / 64.4% with 256, while at 32000 columns 256 led (74.6% against
//                   67.9%); the loss alone measured 86.2% of the read rate with 512 against 95.0%
//                   with 256 at 128256, so it keeps kWideThreads (docs/cross_entropy.md).
//   kSegCols:       the segmented kernel (with or without a gradient, in the common case: no class weights,
//                   smoothing, softcap, bias, argmax or split statistics; 16-byte vectors; rows
//                   longer than kSegCols; a workspace sized with the vocabulary): each row is cut
//                   into segments of kSegCols columns, worked in an order that keeps every
//                   segment's second read close behind its first: the statistics of segments
//                   j < window first, then those of segment window + i alternating with the
//                   gradient of segment i; block b of a cooperative (all-resident) grid of G takes
//                   items b, b + G, ... A segment's gradient waits (rarely, with a window of at
//                   least the blocks in flight) until the last statistics item of its row has
//                   merged the row's partials, in a fixed order (deterministic). The bytes read
//                   between a segment's two reads stay near window x kSegCols x dtype size, a
//                   fraction of the L2, whatever the row length. 0 (the default): off. Its first
//                   version, which handed items out from one device counter, measured 45% of the
//                   copy rate at 8192 x 128256 with a gradient and 45% of the read rate for the
//                   loss alone on one H200, against 71% / 94% for the row kernel; this one,
//                   with its static order, 26% / 27% (docs/cross_entropy.md);
//   kSegThreads:    the segmented kernel's block size (kSegCols must be a multiple of kSegThreads
//                   x 8 columns: each thread loads its 16-byte vectors of a segment at once);
//   kSegWindowPct:  the window in percent of the blocks in flight (at least one row's segments);
//   kResThreads:    the resident kernel (sm_90+, 16-byte vectors, the common case: no class
//                   weights, smoothing, softcap, bias, argmax or split statistics; rows over
//                   16384 columns): one row per thread-block cluster of csize blocks of
//                   kResThreads threads, each thread holding kResVecs 16-byte vectors of the row in
//                   registers, so the logits are read once and the gradient written from
//                   registers; csize = the fewest blocks whose registers hold the row, at most 16
//                   (longer rows take the row kernel), the on-chip and split-row kernels'
//                   policies excepted. 0 (CrossEntropyPolicy's default): off; 256 in
//                   CrossEntropyDefaultPolicy;
//   kResVecs:       the resident kernel's 16-byte vectors per thread;
//   kResLoss:       whether the loss alone (no gradient) takes the resident kernel too;
//   kResMinBlocks:  the resident kernel's blocks per SM that its registers must allow
//                   (__launch_bounds__'s second argument);
//   kResAhead:      the resident kernel: each block asks the L2 (one bulk prefetch) for its slice of
//                   the row this many rows on, so that DRAM has more bytes in flight than the
//                   blocks' registers hold (0: off).
// Rows the chosen kernel cannot take (narrow vectors, older GPUs, the split-vocabulary passes, a
// row over 8 blocks' shared memory) take the row kernel: a first pass for the statistics and a
// second that re-reads the row (from L2 where it is still there) for the gradient.
template <int kWideThreads_ = 256, int kNarrowThreads_ = 256, int kUnroll_ = 4, int kRowsPerSm_ = 0,
          int kCluster_ = 0, int kClusterThreads_ = 256, int kSliceKB_ = 36, bool kSplitRows_ = false,
          int kGradThreads_ = 512, int kSegCols_ = 0, int kSegThreads_ = 256, int kSegWindowPct_ = 100,
          bool kSplitPipelined_ = false, int kResThreads_ = 0, int kResVecs_ = 8, bool kResLoss_ = false,
          int kResMinBlocks_ = 1, int kResAhead_ = 0>
struct CrossEntropyPolicy {
  static_assert(kSegCols_ == 0 || (detail::whole_warps(kSegThreads_, 64, 1024) &&
                                   kSegCols_ % (kSegThreads_ * 8) == 0 && kSegCols_ / (kSegThreads_ * 4) <= 16),
                "kSegCols: 0 (off) or a multiple of kSegThreads x 8 columns, at most 16 fp32 vectors per thread");
  static_assert(kSegWindowPct_ >= 10 && kSegWindowPct_ <= 1000, "window: 10% to 1000% of the blocks in flight");
  static constexpr int kSegCols = kSegCols_;
  static constexpr int kSegThreads = kSegThreads_;
  static constexpr int kSegWindowPct = kSegWindowPct_;
  static_assert(kUnroll_ >= 1 && kUnroll_ <= 8, "1 to 8 vectors in flight per thread");
  static_assert(kCluster_ >= -1 && kCluster_ <= 8, "-1 (automatic), 0 (off) or 1 to 8 blocks per row");
  static_assert(detail::whole_warps(kClusterThreads_, 64, 1024), "a whole number of warps, 64 to 1024 threads");
  static_assert(kSliceKB_ >= 4 && kSliceKB_ <= 113, "4 to 113 KiB per buffer (two per block)");
  static_assert(kGradThreads_ == 0 || detail::whole_warps(kGradThreads_, 32, 1024),
                "0 (kWideThreads) or a whole number of warps, at most 1024 threads");
  static constexpr int kWideThreads = kWideThreads_;
  static constexpr int kNarrowThreads = kNarrowThreads_;
  static constexpr int kUnroll = kUnroll_;
  static constexpr int kRowsPerSm = kRowsPerSm_;
  static constexpr int kCluster = kCluster_;
  static constexpr int kClusterThreads = kClusterThreads_;
  static constexpr int kSliceKB = kSliceKB_;
  static constexpr bool kSplitRows = kSplitRows_;
  static constexpr int kGradThreads = kGradThreads_ > 0 ? kGradThreads_ : kWideThreads_;
  static_assert(!kSplitRows_ || kCluster_ > 0, "the split-row kernel takes an explicit cluster size");
  static_assert(!kSplitPipelined_ || kSplitRows_, "the pipelined split-row kernel is a split-row kernel (kSplitRows)");
  static constexpr bool kSplitPipelined = kSplitPipelined_;
  static_assert(kResThreads_ == 0 || detail::whole_warps(kResThreads_, 64, 1024),
                "kResThreads: 0 (off) or a whole number of warps, 64 to 1024 threads");
  static_assert(kResVecs_ >= 1 && kResVecs_ <= 32, "1 to 32 vectors per thread");
  static constexpr int kResThreads = kResThreads_;
  static constexpr int kResVecs = kResVecs_;
  static constexpr bool kResLoss = kResLoss_;
  static_assert(kResMinBlocks_ >= 1 && kResMinBlocks_ <= 32, "1 to 32 blocks per SM");
  static constexpr int kResMinBlocks = kResMinBlocks_;
  static_assert(kResAhead_ >= 0, "rows ahead: 0 (off) or more");
  static constexpr int kResAhead = kResAhead_;
};
// The default: the row kernel's settings above, and the resident kernel for gradients over 16384
// columns (256 threads x 8 vectors, 4 blocks per SM, slices 32 rows ahead asked of the L2);
// CrossEntropyPolicy<> alone leaves the resident kernel off (docs/cross_entropy.md).
using CrossEntropyDefaultPolicy =
    CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 0, 256, 100, false, 256, 8, false, 4, 32>;

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class I>
struct CeParams {
  const T* x;
  const I* targets;
  T* dx;
  std::int64_t rows, vocab, xs, dxs;
  const float* weights;
  std::int64_t ignore_index;
  float eps, z, cap, grad_scale;
  const float* grad_output;
  Reduction reduction;
  float* loss_rows;   // caller's or workspace scratch
  float* z_rows;      // workspace scratch
  float* lse;
  std::int64_t* argmax;
  int* error_count;
  const float* denom;  // workspace: the mean's denominator
  // Split vocabulary: this shard's columns are [col0, col0 + vocab) of total_vocab.
  std::int64_t col0, total_vocab;
  const CrossEntropyStats* stats;  // merged statistics (finalize), or null: compute them here
  CrossEntropyStats* stats_out;    // shard statistics (stats pass), or null
  const T* bias;                   // [vocab] added to the logits before the softcap, or null
};

struct CeAcc {  // one thread's (or a block's) running statistics
  float m, s, sum_wx, sum_w, best;
  std::int64_t best_i;
};

struct CeAccMerge {
  TIGON_DEVICE CeAcc operator()(const CeAcc& a, const CeAcc& b) const {
    CeAcc r = a;
    ce_math::merge(r.m, r.s, b.m, b.s);
    r.sum_wx = a.sum_wx + b.sum_wx;
    r.sum_w = a.sum_w + b.sum_w;
    if (b.best > a.best || (b.best == a.best && b.best_i < a.best_i)) {
      r.best = b.best;
      r.best_i = b.best_i;
    }
    return r;
  }
};

template <int kThreads>
struct CeShared {
  typename cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>::TempStorage reduce;
  CeAcc total;
  float x_t;
};

// The logits of one raw vector (with bias and softcap) in fp32.
template <class T, int kV>
TIGON_DEVICE void to_x(const AlignedVec<T, kV>& v, const T* bias, std::int64_t c, float cap, float* x) {
  AlignedVec<T, kV> b;
  if (bias != nullptr) b = load_vec<kV>(bias + c);
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    x[k] = ce_math::softcap(to_float(v.v[k]) + (bias != nullptr ? to_float(b.v[k]) : 0.0f), cap);
  }
}

inline constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit, subnormal results flushed to zero (probabilities under 2^-126
// of the row's largest are zero in any dtype the gradient is written in).
TIGON_DEVICE float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Fold kN fp32 logits, columns c0 .. c0 + kN - 1, into a thread's running statistics: one rescale
// per call, exp2 with the log2(e) factor folded into an FMA; the first index wins ties.
template <int kN>
TIGON_DEVICE void ce_accumulate(CeAcc& acc, const float* x, std::int64_t c0, bool want_arg, bool smooth,
                                const float* weights) {
  float vm = x[0];
#pragma unroll
  for (int k = 1; k < kN; ++k) vm = fmaxf(vm, x[k]);
  const float mm = fmaxf(vm, acc.m);
  const float mb = mm * kLog2e;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kN; ++k) s += exp2_ftz(fmaf(x[k], kLog2e, -mb));
  acc.s = acc.s * exp2_ftz(fmaf(acc.m, kLog2e, -mb)) + s;
  acc.m = mm;
  if (want_arg && vm > acc.best) {
    int bk = 0;
#pragma unroll
    for (int k = kN - 1; k >= 0; --k) {
      if (x[k] == vm) bk = k;
    }
    acc.best = vm;
    acc.best_i = c0 + bk;
  }
  if (smooth) {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float w = weights != nullptr ? weights[c0 + k] : 1.0f;
      acc.sum_wx += w * x[k];
      acc.sum_w += w;
    }
  }
}

// One row per block (grid-stride over rows). Pass 1 (unless merged statistics are given): max,
// sum of exp, smoothing sums and argmax over the row, kU vectors in flight per thread, read
// with the evict-last L2 priority. Then the row's loss, and pass 2 (with a gradient): the row
// again, newest lines first (the likeliest still in L2; at 8 rows of 128K logits per SM most of a
// row comes from DRAM again), and the gradient written in place or to dx.
// ---- The per-row steps both kernels share ----

// Column c's logit from its raw value: bias and softcap applied.
template <class T, class I>
TIGON_DEVICE float ce_logit(const CeParams<T, I>& p, T raw, std::int64_t c) {
  return ce_math::softcap(to_float(raw) + (p.bias != nullptr ? to_float(p.bias[c]) : 0.0f), p.cap);
}

// The target's logit, or 0 when the target is not in this shard.
template <class T, class I>
TIGON_DEVICE float ce_target_logit(const CeParams<T, I>& p, const T* xr, std::int64_t t) {
  return (t >= 0 && t < p.vocab) ? ce_logit(p, xr[t], t) : 0.0f;
}

// The row's terms from its merged statistics. Merged split-vocabulary statistics carry the target's
// weight from the shard that holds it.
template <class T, class I>
TIGON_DEVICE ce_math::RowTerms ce_row_terms(const CeParams<T, I>& p, std::int64_t row, const CeAcc& total,
                                            float lse, float x_t, std::int64_t t_raw, bool skip) {
  ce_math::RowTerms terms{};
  terms.lse = lse;
  terms.x_t = x_t;
  if (skip) {
    terms.w_t = 0.0f;
  } else if (p.weights == nullptr) {
    terms.w_t = 1.0f;
  } else {
    terms.w_t = p.stats != nullptr ? p.stats[row].target_weight : p.weights[t_raw];
  }
  terms.sum_w = p.weights != nullptr ? total.sum_w : static_cast<float>(p.total_vocab);
  terms.sum_wx = total.sum_wx;
  return terms;
}

// The row's outputs (loss, z term, lse, argmax; a bad target counted once), by one thread.
template <class T, class I>
TIGON_DEVICE void ce_write_row(const CeParams<T, I>& p, std::int64_t row, const ce_math::RowTerms& terms,
                               const CeAcc& total, bool ignored, bool bad) {
  float l = 0.0f, zl = 0.0f;
  if (bad) {
    l = __int_as_float(0x7fc00000);
    if (p.error_count != nullptr) atomicAdd(p.error_count, 1);
  } else if (!ignored) {
    zl = p.z * terms.lse * terms.lse;
    l = ce_math::row_loss(terms, p.eps, p.total_vocab) + zl;
  }
  p.loss_rows[row] = l;
  if (p.z_rows != nullptr) p.z_rows[row] = zl;
  if (p.lse != nullptr) p.lse[row] = terms.lse;
  if (p.argmax != nullptr) p.argmax[row] = total.best_i;
}

// The factor of the row's gradient: upstream gradient over the mean's denominator (0 when skipped).
template <class T, class I>
TIGON_DEVICE float ce_grad_scale(const CeParams<T, I>& p, std::int64_t row, bool skip) {
  if (skip) return 0.0f;
  const float up = p.grad_output == nullptr ? 1.0f : p.grad_output[p.reduction == Reduction::none ? row : 0];
  const float den = p.reduction == Reduction::mean ? *p.denom : 1.0f;
  return p.grad_scale * up / den;
}

// The gradient of one vector of logits (vector index i), written to dr.
template <class T, class I, int kV>
TIGON_DEVICE void ce_grad_vec(const CeParams<T, I>& p, const AlignedVec<T, kV>& raw, int i, T* dr,
                              std::int64_t t, const ce_math::RowTerms& terms, float scale, const float* wcol,
                              std::uint64_t policy) {
  const std::int64_t c0 = static_cast<std::int64_t>(i) * kV;
  float x[kV];
  to_x<T, kV>(raw, p.bias, c0, p.cap, x);
  AlignedVec<T, kV> g;
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    const std::int64_t c = c0 + k;
    float v = 0.0f;
    if (scale != 0.0f) {
      const float pr = exp2_ftz(fmaf(x[k], kLog2e, -terms.lse * kLog2e));
      const float w = wcol != nullptr ? wcol[c] : 1.0f;
      v = ce_math::grad(pr, c == t, w, terms, p.eps, p.z, p.total_vocab) * ce_math::softcap_grad(x[k], p.cap) *
          scale;
    }
    g.v[k] = from_float<T>(v);
  }
  store_vec_policy(dr + c0, g, policy);
}

// The plain instances' gradient of a vector that does not hold the target: with no smoothing,
// class weights or softcap, d loss / d x_i = scale (w_t p_i + 2 z lse p_i) = p_i * factor, factor =
// scale (w_t + 2 z lse), p_i = 2^(x_i log2(e) - lse log2(e)). A skipped row (scale 0) gets zeros.
template <class T, int kV>
TIGON_DEVICE void ce_grad_vec_plain(const AlignedVec<T, kV>& raw, int i, T* dr, float neg_lse2, float factor,
                                    std::uint64_t policy) {
  float x[kV];
  to_floats(raw, x);
  if (factor == 0.0f) {
#pragma unroll
    for (int k = 0; k < kV; ++k) x[k] = 0.0f;
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) x[k] = exp2_ftz(fmaf(x[k], kLog2e, neg_lse2)) * factor;
  }
  store_vec_policy(dr + static_cast<std::int64_t>(i) * kV, from_floats<T>(x), policy);
}

// The per-row constants of the plain gradient path, and the vector holding the target (-1: none in
// this shard), which takes the general ce_grad_vec.
struct CePlainRow {
  float neg_lse2, factor;
  int t_vec;
};
template <class T, class I, int kV>
TIGON_DEVICE CePlainRow ce_plain_row(const CeParams<T, I>& p, std::int64_t t, const ce_math::RowTerms& terms,
                                     float scale) {
  CePlainRow r;
  r.neg_lse2 = -terms.lse * kLog2e;
  r.factor = scale == 0.0f ? 0.0f : scale * (terms.w_t + 2.0f * p.z * terms.lse);
  r.t_vec = (t >= 0 && t < p.vocab) ? static_cast<int>(t / kV) : -1;
  return r;
}

// One vector's gradient: the plain path unless it holds the target (or the instance is general).
template <class T, class I, int kV, bool kFast>
TIGON_DEVICE void ce_grad_any(const CeParams<T, I>& p, const AlignedVec<T, kV>& raw, int i, T* dr, std::int64_t t,
                              const ce_math::RowTerms& terms, float scale, const float* wcol, std::uint64_t policy,
                              const CePlainRow& pr) {
  if constexpr (kFast && kV > 1) {  // the 16-byte vector instances
    if (i != pr.t_vec) {
      ce_grad_vec_plain<T, kV>(raw, i, dr, pr.neg_lse2, pr.factor, policy);
      return;
    }
  }
  ce_grad_vec<T, I, kV>(p, raw, i, dr, t, terms, scale, wcol, policy);
}

// Pass 1 over vectors [lo, hi) of row xr into this thread's statistics: vectors lo + tid,
// lo + tid + kThreads, ..., kU of them in flight per trip (read with L2 policy `keep`).
template <class T, class I, int kV, int kThreads, int kU>
TIGON_DEVICE void ce_stats_range(const CeParams<T, I>& p, const T* xr, int lo, int hi, bool want_arg, bool smooth,
                                 const float* wcol, std::uint64_t keep, CeAcc& acc) {
  int i = lo + static_cast<int>(threadIdx.x);
  for (; i + (kU - 1) * kThreads < hi; i += kU * kThreads) {
    AlignedVec<T, kV> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = load_vec_policy<kV>(xr + (i + u * kThreads) * kV, keep);
    // One vector at a time once all kU are in flight: eight fp32 values live, not kU * 8.
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t c0 = static_cast<std::int64_t>(i + u * kThreads) * kV;
      float x[kV];
      to_x<T, kV>(raw[u], p.bias, c0, p.cap, x);
      ce_accumulate<kV>(acc, x, c0, want_arg, smooth, wcol);
    }
  }
  for (; i < hi; i += kThreads) {
    const std::int64_t c0 = static_cast<std::int64_t>(i) * kV;
    float x[kV];
    to_x<T, kV>(load_vec_policy<kV>(xr + c0, keep), p.bias, c0, p.cap, x);
    ce_accumulate<kV>(acc, x, c0, want_arg, smooth, wcol);
  }
}

// Pass 2 over vectors [lo, hi) of row xr: the gradient written to dr, newest lines first (the end
// of the range was read last and is the likeliest still in L2), kU vectors in flight per trip.
// kFast (plain instances): vectors without the target take ce_grad_vec_plain.
template <class T, class I, int kV, int kThreads, int kU, bool kFast = false>
TIGON_DEVICE void ce_grad_range(const CeParams<T, I>& p, const T* xr, T* dr, int lo, int hi, std::int64_t t,
                                const ce_math::RowTerms& terms, float scale, const float* wcol,
                                std::uint64_t drop) {
  const CePlainRow pr = ce_plain_row<T, I, kV>(p, t, terms, scale);
  int i = hi - 1 - static_cast<int>(threadIdx.x);
  for (; i - (kU - 1) * kThreads >= lo; i -= kU * kThreads) {
    AlignedVec<T, kV> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = load_vec_policy<kV>(xr + (i - u * kThreads) * kV, drop);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      ce_grad_any<T, I, kV, kFast>(p, raw[u], i - u * kThreads, dr, t, terms, scale, wcol, drop, pr);
    }
  }
  for (; i >= lo; i -= kThreads) {
    ce_grad_any<T, I, kV, kFast>(p, load_vec_policy<kV>(xr + static_cast<std::int64_t>(i) * kV, drop), i, dr, t,
                                 terms, scale, wcol, drop, pr);
  }
}

// The common case (no class weights, smoothing, softcap, bias, argmax or split-vocabulary
// statistics): those fields as compile-time constants, so their per-element work and registers
// drop out of the instance.
template <class T, class I>
TIGON_HD bool ce_plain(const CeParams<T, I>& p) {
  return p.weights == nullptr && p.eps == 0.0f && p.cap == 0.0f && p.bias == nullptr && p.argmax == nullptr &&
         p.stats == nullptr && p.stats_out == nullptr;
}

template <bool kPlain, class T, class I>
TIGON_DEVICE CeParams<T, I> ce_specialise(CeParams<T, I> p) {
  if constexpr (kPlain) {
    p.weights = nullptr;
    p.eps = 0.0f;
    p.cap = 0.0f;
    p.bias = nullptr;
    p.argmax = nullptr;
    p.stats = nullptr;
    p.stats_out = nullptr;
  }
  return p;
}

template <class T, class I, int kV, int kThreads, int kU, bool kPlain>
TIGON_KERNEL void __launch_bounds__(kThreads) ce_row_kernel(const CeParams<T, I> params) {
  detail::grid_dependency_sync();
  const CeParams<T, I> p = ce_specialise<kPlain>(params);
  using Reduce = cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  __shared__ CeShared<kThreads> sh;
  const int nvec = static_cast<int>(p.vocab / kV);
  const bool smooth = p.eps > 0.0f;
  const bool want_arg = p.argmax != nullptr || p.stats_out != nullptr;
  const std::uint64_t keep = l2_policy<L2Hint::evict_last>();
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const float* wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = p.x + row * p.xs;
    const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
    const std::int64_t t = t_raw - p.col0;  // target column within this shard
    const bool ignored = t_raw == p.ignore_index;
    const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
    CeAcc total;
    if (p.stats == nullptr) {
      CeAcc acc{-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
      ce_stats_range<T, I, kV, kThreads, kU>(p, xr, 0, nvec, want_arg, smooth, wcol, keep, acc);
      acc.best_i += p.col0;
      const CeAcc r = Reduce(sh.reduce).Reduce(acc, CeAccMerge{});
      if (threadIdx.x == 0) {
        sh.total = r;
        sh.x_t = ce_target_logit(p, xr, t);
      }
      __syncthreads();
      total = sh.total;
      if (p.stats_out != nullptr) {  // shard statistics: pass 1 only
        if (threadIdx.x == 0) {
          CrossEntropyStats st{};
          st.max = total.m;
          st.sumexp = total.s;
          st.has_target = (t >= 0 && t < p.vocab) ? 1 : 0;
          st.target_logit = sh.x_t;
          st.target_weight =
              (st.has_target && p.weights != nullptr) ? p.weights[t_raw] : 1.0f;
          st.sum_wx = total.sum_wx;
          st.sum_w = total.sum_w;
          st.argmax_value = total.best;
          st.argmax = total.best_i;
          p.stats_out[row] = st;
        }
        __syncthreads();
        continue;
      }
    } else {
      const CrossEntropyStats& st = p.stats[row];
      total = {st.max, st.sumexp, st.sum_wx, st.sum_w, st.argmax_value, st.argmax};
      if (threadIdx.x == 0) sh.x_t = st.target_logit;
      __syncthreads();
    }
    const float lse = total.m + logf(total.s);
    const ce_math::RowTerms terms = ce_row_terms(p, row, total, lse, sh.x_t, t_raw, ignored || bad);
    if (threadIdx.x == 0) ce_write_row(p, row, terms, total, ignored, bad);
    if (p.dx != nullptr) {
      ce_grad_range<T, I, kV, kThreads, kU, kPlain>(p, xr, p.dx + row * p.dxs, 0, nvec, t, terms,
                                            ce_grad_scale(p, row, ignored || bad), wcol, drop);
    }
    __syncthreads();  // sh is reused by the next row
  }
}

// ---- The segmented kernel (CrossEntropyPolicy::kSegCols) ----

// A row's constants for its gradient items, published by the row's last statistics item.
struct CeSegRow {
  ce_math::RowTerms terms;
  float scale;
};

// The segmented kernel's share of the workspace (after the loss scratch): one progress count per
// row (segments whose statistics are in; segs + 1 once the row is published), the rows'
// constants, and each segment's (max, sum of exp).
struct CeSegWork {
  int* count;
  CeSegRow* row;
  float2* part;
};
inline std::size_t ce_seg_bytes(std::int64_t rows, std::int64_t segs) {
  const auto r = static_cast<std::size_t>(rows);
  return round_up<std::size_t>(r * 4u, 256u) + round_up<std::size_t>(r * sizeof(CeSegRow), 256u) +
         round_up<std::size_t>(r * static_cast<std::size_t>(segs) * sizeof(float2), 256u);
}
inline CeSegWork ce_seg_work(void* base, std::int64_t rows) {
  auto* b = static_cast<unsigned char*>(base);
  const auto r = static_cast<std::size_t>(rows);
  CeSegWork w;
  w.count = reinterpret_cast<int*>(b);
  b += round_up<std::size_t>(r * 4u, 256u);
  w.row = reinterpret_cast<CeSegRow*>(b);
  b += round_up<std::size_t>(r * sizeof(CeSegRow), 256u);
  w.part = reinterpret_cast<float2*>(b);
  return w;
}

// The row counts start at zero in every call (the workspace is the caller's scratch, shared with
// other work between calls).
template <int kThreads = 1024>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads) ce_seg_reset_kernel(CeSegWork w, std::int64_t rows) {
  detail::grid_dependency_sync();
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (std::int64_t i = i0; i < rows; i += static_cast<std::int64_t>(gridDim.x) * kThreads) w.count[i] = 0;
}

TIGON_DEVICE int ld_acquire(const int* p) {
  int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  v = *reinterpret_cast<const volatile int*>(p);
  __threadfence();
#endif
  return v;
}

// Merge (m, s) pairs across a warp, in a fixed butterfly order.
TIGON_DEVICE void ce_warp_merge(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    ce_math::merge(m, s, m2, s2);
  }
}

// Work item `tk` of 2 * items (items = rows x segs): the statistics (false) or the gradient (true)
// of segment j. The first `window` tickets take statistics 0 .. window - 1; then statistics
// window + i and gradient i alternate; the last window tickets take the remaining gradients.
TIGON_HD void ce_seg_decode(std::uint64_t tk, std::uint64_t items, std::uint64_t window, bool& grad,
                            std::uint64_t& j) {
  if (tk < window) {
    grad = false;
    j = tk;
    return;
  }
  const std::uint64_t u = tk - window;
  const std::uint64_t mid = 2 * (items - window);
  if (u < mid) {
    grad = (u & 1u) != 0;
    j = grad ? (u >> 1) : window + (u >> 1);
  } else {
    grad = true;
    j = items - window + (u - mid);
  }
}

// The plain instance (ce_plain), with a gradient or without (the loss alone: statistics items
// only, window = items); kSeg = kThreads * kU vectors per segment, each thread's kU vectors of a
// segment loaded at once. A statistics item: the segment's (max, sum of exp) to part[j], then the
// row's count; the item that completes the count merges the row's partials in a fixed order
// (warp 0: a strided pass, then a butterfly), writes the row's loss outputs and its CeSegRow, and
// bumps the count to segs + 1. A gradient item: its loads first, then (one thread) the wait for
// segs + 1, then the gradient written in place or to dx. One block barrier per item. Block b
// takes tickets b, b + G, b + 2G, ... (G blocks, launched cooperatively: all resident), in
// increasing order; a ticket waits only on lower tickets, so every wait ends.
template <class T, class I, int kV, int kThreads, int kU>
TIGON_KERNEL void __launch_bounds__(kThreads)
    ce_seg_kernel(const CeParams<T, I> params, CeSegWork w, int segs, std::uint64_t window) {
  detail::grid_dependency_sync();
  const CeParams<T, I> p = ce_specialise<true>(params);
  constexpr int kWarps = kThreads / 32;
  constexpr int kSeg = kThreads * kU;
  __shared__ float2 red[2][kWarps];
  __shared__ CeSegRow row_sh[2];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nvec = static_cast<int>(p.vocab / kV);
  const auto items = static_cast<std::uint64_t>(p.rows) * static_cast<std::uint64_t>(segs);
  const std::uint64_t total = p.dx != nullptr ? 2 * items : items;
  const std::uint64_t keep = l2_policy<L2Hint::evict_last>();
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const std::uint64_t first = p.dx != nullptr ? keep : drop;  // the statistics' read: kept for the gradient's
  int par = 0;
  for (std::uint64_t tk = blockIdx.x; tk < total; tk += gridDim.x, par ^= 1) {
    bool grad;
    std::uint64_t j;
    ce_seg_decode(tk, items, window, grad, j);
    const auto row = static_cast<std::int64_t>(j / static_cast<std::uint64_t>(segs));
    const int seg = static_cast<int>(j - static_cast<std::uint64_t>(row) * static_cast<std::uint64_t>(segs));
    const T* xr = p.x + row * p.xs;
    const int v0 = seg * kSeg + tid;
    AlignedVec<T, kV> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * kThreads;
      if (i < nvec) raw[u] = load_vec_policy<kV>(xr + static_cast<std::int64_t>(i) * kV, grad ? drop : first);
    }
    if (!grad) {
      CeAcc acc{-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (v0 + u * kThreads < nvec) {
          float x[kV];
          to_floats(raw[u], x);
          ce_accumulate<kV>(acc, x, 0, false, false, nullptr);
        }
      }
      ce_warp_merge(acc.m, acc.s);
      if (lane == 0) red[par][warp] = make_float2(acc.m, acc.s);
      __syncthreads();
      if (warp == 0) {
        int last = 0;
        if (lane == 0) {
          float m = red[par][0].x, s = red[par][0].y;
#pragma unroll
          for (int k = 1; k < kWarps; ++k) ce_math::merge(m, s, red[par][k].x, red[par][k].y);
          w.part[j] = make_float2(m, s);
          __threadfence();  // the partial before the count
          last = atomicAdd(&w.count[row], 1) == segs - 1;
          __threadfence();  // the other partials (counted before this) before the reads below
        }
        if (__shfl_sync(0xffffffffu, last, 0) != 0) {  // the row's last segment: warp 0 publishes the row
          __syncwarp();
          // The partials merged by the warp in a fixed order: lane k takes k, k + 32, ...; then a
          // butterfly (deterministic).
          const float2* pr = w.part + static_cast<std::uint64_t>(row) * static_cast<std::uint64_t>(segs);
          float m = -__builtin_huge_valf(), s = 0.0f;
          for (int k = lane; k < segs; k += 32) {
            const float2 b = __ldcg(pr + k);
            ce_math::merge(m, s, b.x, b.y);
          }
          ce_warp_merge(m, s);
          if (lane == 0) {
            const std::int64_t t = static_cast<std::int64_t>(p.targets[row]);
            const bool ignored = t == p.ignore_index;
            const bool bad = !ignored && (t < 0 || t >= p.total_vocab);
            const CeAcc tot{m, s, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
            const float lse = m + logf(s);
            const ce_math::RowTerms terms =
                ce_row_terms(p, row, tot, lse, ce_target_logit(p, xr, t), t, ignored || bad);
            ce_write_row(p, row, terms, tot, ignored, bad);
            w.row[row] = CeSegRow{terms, ce_grad_scale(p, row, ignored || bad)};
            __threadfence();
            atomicAdd(&w.count[row], 1);
          }
        }
      }
    } else {
      if (tid == 0) {
        while (ld_acquire(&w.count[row]) <= segs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
          __nanosleep(64);
#endif
        }
        const CeSegRow* rp = w.row + row;  // L2 reads: the row was published by another block
        CeSegRow r;
        r.terms.w_t = __ldcg(&rp->terms.w_t);
        r.terms.sum_w = __ldcg(&rp->terms.sum_w);
        r.terms.sum_wx = __ldcg(&rp->terms.sum_wx);
        r.terms.x_t = __ldcg(&rp->terms.x_t);
        r.terms.lse = __ldcg(&rp->terms.lse);
        r.scale = __ldcg(&rp->scale);
        row_sh[par] = r;
      }
      __syncthreads();
      const CeSegRow r = row_sh[par];
      const ce_math::RowTerms& terms = r.terms;
      const std::int64_t t = static_cast<std::int64_t>(p.targets[row]);
      const CePlainRow pr = ce_plain_row<T, I, kV>(p, t, terms, r.scale);
      T* dr = p.dx + row * p.dxs;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * kThreads;
        if (i < nvec) ce_grad_any<T, I, kV, true>(p, raw[u], i, dr, t, terms, r.scale, nullptr, drop, pr);
      }
    }
  }
}

// Rows kept on chip: a row split across a thread-block cluster of `cluster.num_blocks()` blocks
// (sm_90+; one block when the row fits one). Cluster c walks rows c, c + clusters, ...; block
// `rank` owns the vectors [rank * slice, (rank + 1) * slice) of each row, which one thread moves
// into the block's shared memory with the bulk-copy engine, two buffers deep: the next row's slice
// streams in while this one's is reduced and its gradient written. The row is read from DRAM once
// and never re-read, and no registers hold it. Each block's statistics (and the target's logit,
// from the block that holds it) go to every block of the cluster through distributed shared
// memory, double-buffered by row parity (one cluster barrier per row); every block merges them in
// rank order, so all hold the same totals, deterministically. Then each block writes the gradient
// of its slice from shared memory.
template <class T, class I, int kV, int kThreads, bool kPlain>
TIGON_KERNEL void __launch_bounds__(kThreads) ce_cluster_kernel(const CeParams<T, I> params, int slice) {
  detail::grid_dependency_sync();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using Vec = AlignedVec<T, kV>;
  const CeParams<T, I> p = ce_specialise<kPlain>(params);
  using Reduce = cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  extern __shared__ __align__(128) unsigned char ce_row_smem[];
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ CeAcc slots[2][kCeMaxCluster];
  __shared__ float slot_xt[2];
  __shared__ __align__(8) std::uint64_t bar[2];
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const std::int64_t clusters = gridDim.x / csize;
  const int nvec = static_cast<int>(p.vocab / kV);
  const int v0 = min(rank * slice, nvec);
  const int n = min(v0 + slice, nvec) - v0;
  const unsigned bytes = static_cast<unsigned>(n) * static_cast<unsigned>(sizeof(Vec));
  const std::int64_t col_lo = static_cast<std::int64_t>(v0) * kV;
  const std::int64_t col_hi = col_lo + static_cast<std::int64_t>(n) * kV;
  const bool smooth = p.eps > 0.0f;
  const bool want_arg = p.argmax != nullptr;
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const float* wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  auto buffer = [&](int b) { return ce_row_smem + static_cast<std::size_t>(b) * slice * sizeof(Vec); };
  // Thread 0 starts the copy of `row`'s slice into buffer b.
  auto fetch = [&](std::int64_t row, int b) {
    if (threadIdx.x != 0 || bytes == 0 || row >= p.rows) return;
    fence_proxy_async_shared();  // every thread's earlier reads of the buffer (block barrier) first
    mbarrier_arrive_expect_tx(&bar[b], bytes);
    constexpr unsigned kPiece = 16384;
    const char* src = reinterpret_cast<const char*>(p.x + row * p.xs + col_lo);
    for (unsigned off = 0; off < bytes; off += kPiece) {
      bulk_copy_g2s(buffer(b) + off, src + off, bytes - off < kPiece ? bytes - off : kPiece, &bar[b]);
    }
  };
  if (threadIdx.x == 0) {
    mbarrier_init(&bar[0]);
    mbarrier_init(&bar[1]);
  }
  // Every block of the cluster has started (its shared memory may be written from now on) and
  // this block's barriers are initialised.
  cluster.sync();
  const std::int64_t first = blockIdx.x / csize;
  fetch(first, 0);
  unsigned phases = 0;  // bit b: the parity of buffer b's next phase
  int parity = 0;
  for (std::int64_t row = first; row < p.rows; row += clusters, parity ^= 1) {
    fetch(row + clusters, parity ^ 1);  // the next row streams in meanwhile
    const Vec* buf = reinterpret_cast<const Vec*>(buffer(parity));
    const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
    const std::int64_t t = t_raw - p.col0;
    const bool ignored = t_raw == p.ignore_index;
    const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
    CeAcc acc{-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
    if (bytes > 0) {
      mbarrier_wait(&bar[parity], (phases >> parity) & 1u);
      phases ^= 1u << parity;
      for (int j = static_cast<int>(threadIdx.x); j < n; j += kThreads) {
        const std::int64_t c0 = col_lo + static_cast<std::int64_t>(j) * kV;
        float x[kV];
        to_x<T, kV>(buf[j], p.bias, c0, p.cap, x);
        ce_accumulate<kV>(acc, x, c0, want_arg, smooth, wcol);
      }
    }
    acc.best_i += p.col0;
    const CeAcc mine = Reduce(reduce).Reduce(acc, CeAccMerge{});
    if (threadIdx.x == 0) {
      for (int r = 0; r < csize; ++r) *cluster.map_shared_rank(&slots[parity][rank], r) = mine;
      if (t >= col_lo && t < col_hi) {  // this block holds the target's logit
        const float xt = ce_logit(p, reinterpret_cast<const T*>(buf)[t - col_lo], t);
        for (int r = 0; r < csize; ++r) *cluster.map_shared_rank(&slot_xt[parity], r) = xt;
      }
    }
    cluster.sync();  // every block's statistics have arrived; also a block barrier for `reduce`
    CeAcc total = slots[parity][0];
    for (int r = 1; r < csize; ++r) total = CeAccMerge{}(total, slots[parity][r]);
    const float x_t = (t >= 0 && t < p.vocab) ? slot_xt[parity] : 0.0f;
    const float lse = total.m + logf(total.s);
    const ce_math::RowTerms terms = ce_row_terms(p, row, total, lse, x_t, t_raw, ignored || bad);
    if (rank == 0 && threadIdx.x == 0) ce_write_row(p, row, terms, total, ignored, bad);
    if (p.dx != nullptr && n > 0) {
      T* dr = p.dx + row * p.dxs;
      const float scale = ce_grad_scale(p, row, ignored || bad);
      for (int j = static_cast<int>(threadIdx.x); j < n; j += kThreads) {
        ce_grad_vec<T, I, kV>(p, buf[j], v0 + j, dr, t, terms, scale, wcol, drop);
      }
    }
    __syncthreads();  // this buffer is refilled two rows on
  }
  cluster.sync();  // no block may exit while another still writes into its shared memory
#else
  (void)params;
  (void)slice;
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One block's share of a row in the split-row kernels (sm_90+): the block of rank `rank` in a
// cluster of csize owns vectors [v0, v1) = [rank * slice, (rank + 1) * slice) of every row its
// cluster visits, and takes four steps per row — its slice's statistics (pass 1), sending them to
// every block of the cluster, merging the cluster's in rank order (the same totals everywhere,
// deterministic), and the row's loss and its slice's gradient (pass 2). The kernels differ only in
// the order of these steps and the barriers between them.
template <class T, class I, int kV, int kThreads, int kU, bool kPlain>
struct CeSplitBlock {
  using Reduce = cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  const CeParams<T, I> p;
  cooperative_groups::cluster_group cluster;
  int csize, rank;
  std::int64_t clusters;  // rows walked at once (a cluster takes rows first, first + clusters, ...)
  int v0, v1;
  bool smooth, want_arg;
  std::uint64_t keep, drop;
  const float* wcol;

  TIGON_DEVICE CeSplitBlock(const CeParams<T, I>& params, int slice)
      : p(ce_specialise<kPlain>(params)), cluster(cooperative_groups::this_cluster()) {
    csize = static_cast<int>(cluster.num_blocks());
    rank = static_cast<int>(cluster.block_rank());
    clusters = gridDim.x / csize;
    const int nvec = static_cast<int>(p.vocab / kV);
    v0 = min(rank * slice, nvec);
    v1 = min(v0 + slice, nvec);
    smooth = p.eps > 0.0f;
    want_arg = p.argmax != nullptr;
    keep = l2_policy<L2Hint::evict_last>();
    drop = l2_policy<L2Hint::evict_first>();
    wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  }

  TIGON_DEVICE std::int64_t first_row() const { return blockIdx.x / csize; }

  // Pass 1 of `row` over the slice (evict-last): the block's statistics, valid in thread 0 (the
  // reduction's scratch needs a block barrier before its next use), and the target's logit x_t,
  // read here, before any block may write the row's gradient over it.
  TIGON_DEVICE CeAcc stats(std::int64_t row, float& x_t, typename Reduce::TempStorage& reduce) const {
    const T* xr = p.x + row * p.xs;
    CeAcc acc{-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
    ce_stats_range<T, I, kV, kThreads, kU>(p, xr, v0, v1, want_arg, smooth, wcol, keep, acc);
    acc.best_i += p.col0;
    x_t = ce_target_logit(p, xr, static_cast<std::int64_t>(p.targets[row]) - p.col0);
    return Reduce(reduce).Reduce(acc, CeAccMerge{});
  }

  // Thread 0 sends the block's statistics to its slot (`slot`: one parity's row of slots) in every
  // block of the cluster, through distributed shared memory.
  TIGON_DEVICE void send(const CeAcc& mine, CeAcc* slot) const {
    if (threadIdx.x == 0) {
      for (int r = 0; r < csize; ++r) *cluster.map_shared_rank(slot + rank, r) = mine;
    }
  }

  // The cluster's statistics of a row, merged in rank order.
  TIGON_DEVICE CeAcc merge(const CeAcc* slot) const {
    CeAcc total = slot[0];
    for (int r = 1; r < csize; ++r) total = CeAccMerge{}(total, slot[r]);
    return total;
  }

  // The row's loss terms (written once, by rank 0) and, with a gradient, pass 2 over the slice
  // (newest lines first, evict-first).
  TIGON_DEVICE void finish(std::int64_t row, const CeAcc& total, float x_t) const {
    const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
    const bool ignored = t_raw == p.ignore_index;
    const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
    const float lse = total.m + logf(total.s);
    const ce_math::RowTerms terms = ce_row_terms(p, row, total, lse, x_t, t_raw, ignored || bad);
    if (rank == 0 && threadIdx.x == 0) ce_write_row(p, row, terms, total, ignored, bad);
    if (p.dx != nullptr) {
      ce_grad_range<T, I, kV, kThreads, kU, kPlain>(p, p.x + row * p.xs, p.dx + row * p.dxs, v0, v1,
                                                    t_raw - p.col0, terms, ce_grad_scale(p, row, ignored || bad),
                                                    wcol, drop);
    }
  }
};
#endif

// The split-row kernel (policy kSplitRows): a cluster of csize blocks per row, each on its own SM,
// block `rank` owning vectors [rank * slice, (rank + 1) * slice) of every row its cluster visits.
// Pass 1 streams the slice (evict-last) into this block's statistics; they go to every block of the
// cluster through distributed shared memory, double-buffered by row parity (one cluster barrier per
// row), and every block merges them in rank order, so all hold the same totals, deterministically.
// Pass 2 streams the slice again, newest lines first (evict-first), and writes its gradient. With
// csize blocks per row, the rows in flight are csize times fewer than the row kernel's, so the
// second read can find the slice still in L2.
template <class T, class I, int kV, int kThreads, int kU, bool kPlain>
TIGON_KERNEL void __launch_bounds__(kThreads) ce_split_kernel(const CeParams<T, I> params, int slice) {
  detail::grid_dependency_sync();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using B = CeSplitBlock<T, I, kV, kThreads, kU, kPlain>;
  __shared__ typename B::Reduce::TempStorage reduce;
  __shared__ CeAcc slots[2][kCeMaxCluster];
  const B b(params, slice);
  // Every block of the cluster has started (its shared memory may be written from now on).
  b.cluster.sync();
  int parity = 0;
  for (std::int64_t row = b.first_row(); row < b.p.rows; row += b.clusters, parity ^= 1) {
    float x_t = 0.0f;
    b.send(b.stats(row, x_t, reduce), slots[parity]);
    b.cluster.sync();  // every block's statistics have arrived; also a block barrier for `reduce`
    b.finish(row, b.merge(slots[parity]), x_t);
  }
  b.cluster.sync();  // no block may exit while another still writes into its shared memory
#else
  (void)params;
  (void)slice;
#endif
}

// The pipelined split-row kernel (policy kSplitRows with kSplitPipelined): the split-row kernel's
// two passes over each block's slice, with the cluster's statistics exchange taken off the memory
// pipe's path. A block streams the next row's slice (its pass 1) while the statistics of the row
// before travel, and only then waits for them from every block, merges them and writes that row's
// gradient (its pass 2). Each cluster has two rows in flight, so the bytes read between a slice's
// two reads stay near twice the rows in flight times a row's bytes: the H200's L2 keeps about 16
// MB between two reads (docs/cross_entropy.md). Statistics travel through distributed shared
// memory, double-buffered by row parity, and every block merges them in rank order (the same totals
// everywhere, deterministic).
//
// Order, per block, for its k-th row r_k: pass 1 of r_{k+1}; wait (for r_k); merge the slots of
// r_k; send r_{k+1}'s statistics; arrive (for r_{k+1}); pass 2 of r_k. The wait for r_k returns
// once every block has sent r_k's statistics and finished merging r_{k-1}'s (the slots r_{k+1}'s
// statistics then overwrite), and once every block has read r_k's logits for pass 1 (its target
// logit included), so no gradient overwrites them early. The calls that arrive and wait must stay
// uniform across each warp (.aligned) and the same in number for every block of the cluster.
template <class T, class I, int kV, int kThreads, int kU, bool kPlain>
TIGON_KERNEL void __launch_bounds__(kThreads) ce_split_pipe_kernel(const CeParams<T, I> params, int slice) {
  detail::grid_dependency_sync();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using B = CeSplitBlock<T, I, kV, kThreads, kU, kPlain>;
  __shared__ typename B::Reduce::TempStorage reduce;
  __shared__ CeAcc slots[2][kCeMaxCluster];
  const B b(params, slice);
  // Pass 1 with the block barrier the reduction's scratch needs before its next use (the split
  // cluster barrier below does not hold every thread back).
  auto stats = [&](std::int64_t row, float& x_t) {
    const CeAcc mine = b.stats(row, x_t, reduce);
    __syncthreads();
    return mine;
  };
  // Every block of the cluster has started (its shared memory may be written from now on).
  b.cluster.sync();
  const std::int64_t first = b.first_row();
  const std::int64_t rows = b.p.rows;
  float x_t = 0.0f;
  if (first < rows) b.send(stats(first, x_t), slots[0]);
  cluster_arrive();  // for row `first` (also without a row: every arrival is paired with a wait)
  int parity = 0;
  for (std::int64_t row = first; row < rows; row += b.clusters, parity ^= 1) {
    const std::int64_t next = row + b.clusters;
    float x_t_next = 0.0f;
    CeAcc mine_next{};
    if (next < rows) mine_next = stats(next, x_t_next);  // while `row`'s statistics travel
    cluster_wait();  // every block has sent `row`'s statistics
    const CeAcc total = b.merge(slots[parity]);
    if (next < rows) b.send(mine_next, slots[parity ^ 1]);
    cluster_arrive();
    b.finish(row, total, x_t);
    x_t = x_t_next;
  }
  cluster_wait();  // pairs the last arrival: no block exits while another may still write into its shared memory
#else
  (void)params;
  (void)slice;
#endif
}

// The resident kernel (policy kResThreads > 0; the common case only: ce_plain, 16-byte vectors,
// sm_90+): one row per cluster of csize blocks and one slice per block, no block walks rows. Each
// thread loads its kVecs vectors of the slice at once and keeps them in registers, so the logits
// are read from DRAM once and no second pass reads them again; the gradient is written from the
// registers. A block's statistics (max and sum of exp relative to it; block 0's also carry the
// target's logit) go to every block of the cluster through distributed shared memory, one 16-byte
// asynchronous store per block (lane r of warp 0 to block r), counted on the receiver's barrier;
// every block merges the same messages in the same lane order, so all hold the same totals
// (deterministic). The hardware keeps as many blocks per SM as registers allow, each its own row
// slice in its own phase, so the memory pipe stays busy while a block waits for its cluster's
// messages; `ahead` (kResAhead) rows on, each block's slice is asked of the L2 (docs/cross_entropy.md).
inline constexpr int kCeResMaxCluster = 16;
// The largest element of a vector, running across calls: bfloat16 and half pairs compared two at a
// time (packed), the pair folded once at the end (value()).
template <class T>
struct CePackedMax {
  static constexpr bool kPacked = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  Pair pair;
  float scalar;
  TIGON_DEVICE CePackedMax() {
    if constexpr (kPacked) {
      const T lo = from_float<T>(-__builtin_huge_valf());
      pair = Pair(lo, lo);
    }
    scalar = -__builtin_huge_valf();
  }
  template <int kV>
  TIGON_DEVICE void add(const AlignedVec<T, kV>& v) {
    if constexpr (kPacked && kV % 2 == 0) {
#pragma unroll
      for (int k = 0; k < kV; k += 2) {
        Pair q;
        __builtin_memcpy(&q, &v.v[k], sizeof(q));
        pair = __hmax2(pair, q);
      }
    } else {
      float x[kV];
      to_floats(v, x);
#pragma unroll
      for (int k = 0; k < kV; ++k) scalar = fmaxf(scalar, x[k]);
    }
  }
  TIGON_DEVICE float value() const {
    if constexpr (kPacked) return fmaxf(scalar, fmaxf(to_float(pair.x), to_float(pair.y)));
    return scalar;
  }
};

template <class T, class I, int kV, int kThreads, int kVecs, int kMinBlocks>
TIGON_KERNEL void __launch_bounds__(kThreads, kMinBlocks) ce_resident_kernel(const CeParams<T, I> params,
                                                                              std::int64_t row0, int slice,
                                                                              int ahead) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kWarps = kThreads / 32;
  __shared__ std::uint64_t bar;
  __shared__ float4 slots[kCeResMaxCluster];
  __shared__ float2 part[kWarps];
  __shared__ float row_lse, row_xt;
  const unsigned csize = cluster_blocks();
  const unsigned rank = cluster_rank();
  if (threadIdx.x == 0) mbarrier_init(&bar);  // completes after one arrival and the messages' bytes
  cluster_arrive_relaxed();  // this block's barrier is ready for the cluster's messages (the init's fence releases it)
  detail::grid_dependency_sync();
  const CeParams<T, I> p = ce_specialise<true>(params);
  const std::int64_t row = row0 + blockIdx.x / csize;
  const int nvec = static_cast<int>(p.vocab / kV);
  const int v0 = min(static_cast<int>(rank) * slice, nvec);
  const int tid = static_cast<int>(threadIdx.x);
  const int first = v0 + tid;                          // this thread's first vector
  const int mine = min(v0 + slice, nvec) - first;      // vector j is this thread's when j * kThreads < mine
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const T* xv = p.x + row * p.xs + static_cast<std::int64_t>(first) * kV;
  // The same slice of the row `ahead` rows on, asked of the L2 now: the block that takes that row
  // then finds its logits there, and DRAM has those bytes in flight without registers holding them.
  if (ahead > 0 && tid == 0 && row + ahead < p.rows && v0 < nvec) {
    prefetch_l2_bulk(p.x + (row + ahead) * p.xs + static_cast<std::int64_t>(v0) * kV,
                     static_cast<unsigned>(min(slice, nvec - v0)) * 16u);
  }
  AlignedVec<T, kV> raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) raw[j] = load_vec_policy<kV>(xv + j * kThreads * kV, drop);
  }
  const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
  const std::int64_t t = t_raw - p.col0;
  const bool in_row = t >= 0 && t < p.vocab;
  // The target's logit, read by one thread of the first block before its message leaves, so
  // before any block of the cluster (all wait for that message) writes its gradient over it.
  float xt = 0.0f;
  if (rank == 0 && tid == 0 && in_row) xt = to_float(p.x[row * p.xs + t]);
  // The warp's max, then this thread's sum of exp relative to it, summed over the warp.
  CePackedMax<T> mx;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) mx.add(raw[j]);
  }
  float m[1] = {mx.value()};
  warp_allreduce<32>(m, MaxOp{});
  // A warp whose elements are all -inf (or that has none) sums nothing: its m stays -inf.
  const float mb = m[0] == -__builtin_huge_valf() ? 0.0f : m[0] * kLog2e;
  float s[1] = {0.0f};
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) {
      float x[kV];
      to_floats(raw[j], x);
#pragma unroll
      for (int k = 0; k < kV; ++k) s[0] += exp2_ftz(fmaf(x[k], kLog2e, -mb));
    }
  }
  warp_allreduce_sum<32>(s);
  if ((tid & 31) == 0) part[tid >> 5] = make_float2(m[0], s[0]);
  __syncthreads();
  cluster_wait();  // every block's barrier is ready (pairs cluster_arrive_relaxed above)
  if (tid < 32) {  // warp 0: the block's statistics, the messages, the row's
    const int lane = tid;
    // (m, s) pairs of lanes [0, n) merged across the warp: the max, then each sum rescaled to it
    // and added; every lane ends with the same totals, and every block of the cluster, merging the
    // same messages in the same order, with the same.
    auto merge_lanes = [lane](float pm, float ps, int n, float& om, float& os) {
      float mm[1] = {lane < n ? pm : -__builtin_huge_valf()};
      warp_allreduce<32>(mm, MaxOp{});
      float ss[1] = {(lane < n && pm != -__builtin_huge_valf()) ? ps * exp2_ftz((pm - mm[0]) * kLog2e) : 0.0f};
      warp_allreduce_sum<32>(ss);
      om = mm[0];
      os = ss[0];
    };
    float bm, bs;
    const float2 mine_part = lane < kWarps ? part[lane] : make_float2(0.0f, 0.0f);
    merge_lanes(mine_part.x, mine_part.y, kWarps, bm, bs);
    // The one arrival, announcing the messages' bytes (some may have landed already); then lane r
    // sends this block's statistics to block r.
    if (lane == 0) mbarrier_arrive_expect_tx(&bar, csize * static_cast<unsigned>(sizeof(float4)));
    xt = __shfl_sync(0xffffffffu, xt, 0);  // lane 0 (thread 0) read it; every lane's message carries it
    if (lane < static_cast<int>(csize)) {
      cluster_store_async_f4(cluster_smem_addr(&slots[rank], static_cast<unsigned>(lane)),
                             cluster_smem_addr(&bar, static_cast<unsigned>(lane)), bm, bs, xt, 0.0f);
    }
    mbarrier_wait<true>(&bar, 0);  // every block's message has arrived
    const float4 msg = lane < static_cast<int>(csize) ? slots[lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float tm, ts;
    merge_lanes(msg.x, msg.y, static_cast<int>(csize), tm, ts);
    if (lane == 0) {
      row_lse = tm + logf(ts);
      row_xt = msg.z;  // block 0's message carries the target's logit
      if (rank == 0) {
        const bool ignored = t_raw == p.ignore_index;
        const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
        const CeAcc total{tm, ts, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
        ce_write_row(p, row, ce_row_terms(p, row, total, row_lse, row_xt, t_raw, ignored || bad), total, ignored,
                     bad);
      }
    }
  }
  if (p.dx == nullptr) return;
  __syncthreads();
  const float lse = row_lse;
  const bool ignored = t_raw == p.ignore_index;
  const bool skip = ignored || t_raw < 0 || t_raw >= p.total_vocab;
  const float scale = ce_grad_scale(p, row, skip);
  // d loss / d x_i = p_i * factor off the target, factor = scale (1 + 2 z lse); for factor > 0
  // its log2 joins the exponent: p_i * factor = 2^(x_i log2(e) + log2(factor) - lse log2(e)).
  const float factor = scale == 0.0f ? 0.0f : scale * (1.0f + 2.0f * p.z * lse);
  const float neg_lse2 = -lse * kLog2e;
  T* dv = p.dx + row * p.dxs + static_cast<std::int64_t>(first) * kV;
  if (factor > 0.0f) {
    const float bias = neg_lse2 + __log2f(factor);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float x[kV];
        to_floats(raw[j], x);
#pragma unroll
        for (int k = 0; k < kV; ++k) x[k] = exp2_ftz(fmaf(x[k], kLog2e, bias));
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(x), drop);
      }
    }
  } else {  // a negative upstream gradient, or none (zeros)
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float x[kV];
        to_floats(raw[j], x);
#pragma unroll
        for (int k = 0; k < kV; ++k) x[k] = factor == 0.0f ? 0.0f : exp2_ftz(fmaf(x[k], kLog2e, neg_lse2)) * factor;
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(x), drop);
      }
    }
  }
  // The target's gradient, formed in fp32 from p - 1 as the row kernel forms it, over the value
  // just stored by the thread that stored its vector.
  if (in_row && scale != 0.0f) {
    const int d = static_cast<int>(t / kV) - first;
    if (d >= 0 && d % kThreads == 0 && d / kThreads < kVecs && d < mine) {
      ce_math::RowTerms terms{};
      terms.w_t = 1.0f;
      terms.lse = lse;
      terms.x_t = row_xt;
      const float pr = exp2_ftz(fmaf(row_xt, kLog2e, neg_lse2));
      p.dx[row * p.dxs + t] = from_float<T>(ce_math::grad(pr, true, 1.0f, terms, 0.0f, p.z, p.total_vocab) * scale);
    }
  }
#else
  (void)params;
  (void)row0;
  (void)slice;
  (void)ahead;
#endif
}

// The mean's denominator: sum over non-ignored rows of w_t (1 without weights). One block, fixed
// order. Also clears nothing else: the reduce kernel overwrites its outputs.
template <class I>
TIGON_KERNEL void __launch_bounds__(1024)
    ce_denominator_kernel(const I* targets, std::int64_t rows, std::int64_t ignore_index,
                          const float* weights, std::int64_t vocab, float* denom) {
  detail::grid_dependency_sync();
  using Reduce = BlockAllReduce<1024, 1>;
  __shared__ typename Reduce::TempStorage tmp;
  float s[1] = {0.0f};
  for (std::int64_t r = threadIdx.x; r < rows; r += 1024) {
    const std::int64_t t = static_cast<std::int64_t>(targets[r]);
    if (t == ignore_index) continue;
    s[0] += (weights != nullptr && t >= 0 && t < vocab) ? weights[t] : 1.0f;
  }
  Reduce::sum(s, tmp);
  if (threadIdx.x == 0) *denom = s[0];
}

// loss = sum(loss_rows) (/ denominator), z_loss likewise; an all-ignored batch gives 0.
template <int kThreads = 1024>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads)
    ce_reduce_kernel(const float* loss_rows, const float* z_rows, std::int64_t rows,
                     const float* denom, bool mean, float* loss, float* z_loss) {
  detail::grid_dependency_sync();
  using Reduce = BlockAllReduce<kThreads, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  float s[2] = {0.0f, 0.0f};
  for (std::int64_t r = threadIdx.x; r < rows; r += kThreads) {
    s[0] += loss_rows[r];
    s[1] += z_rows[r];
  }
  Reduce::sum(s, tmp);
  if (threadIdx.x == 0) {
    const float d = mean ? *denom : 1.0f;
    const float f = (mean && d == 0.0f) ? 0.0f : 1.0f / d;
    if (loss != nullptr) loss[0] = (mean && d == 0.0f) ? 0.0f : s[0] * f;
    if (z_loss != nullptr) z_loss[0] = (mean && d == 0.0f) ? 0.0f : s[1] * f;
  }
}

// Merge per-shard statistics [shards][rows] into [rows].
template <int kThreads = 256>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads)
    ce_merge_kernel(const CrossEntropyStats* shards, int nshards, std::int64_t rows,
                    CrossEntropyStats* out) {
  detail::grid_dependency_sync();
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    CrossEntropyStats m = shards[r];
    for (int k = 1; k < nshards; ++k) {
      const CrossEntropyStats& o = shards[static_cast<std::int64_t>(k) * rows + r];
      ce_math::merge(m.max, m.sumexp, o.max, o.sumexp);
      m.sum_wx += o.sum_wx;
      m.sum_w += o.sum_w;
      if (o.has_target) {
        m.target_logit = o.target_logit;
        m.target_weight = o.target_weight;
        m.has_target = 1;
      }
      if (o.argmax_value > m.argmax_value ||
          (o.argmax_value == m.argmax_value && o.argmax < m.argmax)) {
        m.argmax_value = o.argmax_value;
        m.argmax = o.argmax;
      }
    }
    out[r] = m;
  }
}

template <class T, class I>
CeParams<T, I> ce_params(const CrossEntropyArgs<T, I>& a) {
  CeParams<T, I> p{};
  p.x = a.logits;
  p.targets = a.targets;
  p.dx = a.dlogits;
  p.rows = a.rows;
  p.vocab = a.vocab;
  p.xs = a.logits_stride ? a.logits_stride : a.vocab;
  p.dxs = a.dlogits_stride ? a.dlogits_stride : a.vocab;
  p.weights = a.class_weights;
  p.ignore_index = a.ignore_index;
  p.eps = a.label_smoothing;
  p.z = a.z_loss_scale;
  p.cap = a.softcap;
  p.grad_scale = a.grad_scale;
  p.grad_output = a.grad_output;
  p.reduction = a.reduction;
  p.lse = a.lse;
  p.argmax = a.argmax;
  p.error_count = a.error_count;
  p.col0 = 0;
  p.total_vocab = a.vocab;
  return p;
}

template <class T, class I>
bool ce_vectorizable(const CeParams<T, I>& p) {
  constexpr int kV = kVecElems<T>;
  return p.vocab % kV == 0 && rows_aligned(p.x, p.xs, kV) &&
         (p.dx == nullptr || rows_aligned(p.dx, p.dxs, kV)) &&
         (p.bias == nullptr || is_aligned(p.bias, 16));
}

template <class T, class I, int kV, int kThreads, class P, bool kPlain>
Status launch_ce_rows_as(const CeParams<T, I>& p, cudaStream_t stream, const char* op);

template <class T, class I, int kV, int kThreads, class P>
Status launch_ce_rows(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  if (ce_plain(p)) return launch_ce_rows_as<T, I, kV, kThreads, P, true>(p, stream, op);
  return launch_ce_rows_as<T, I, kV, kThreads, P, false>(p, stream, op);
}

template <class T, class I, int kV, int kThreads, class P, bool kPlain>
Status launch_ce_rows_as(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  // One row per resident block (a gradient pass re-reads its row: from L2 where it stayed there).
  constexpr auto kernel = ce_row_kernel<T, I, kV, kThreads, P::kUnroll, kPlain>;
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  int occ = 0;
  TIGON_CHECK((blocks_per_sm<kernel, kThreads>(dev.device, occ)));
  std::int64_t per_sm = occ;
  if constexpr (P::kRowsPerSm > 0) per_sm = std::min<std::int64_t>(P::kRowsPerSm, occ);
  const auto grid = static_cast<unsigned>(
      std::clamp<std::int64_t>(per_sm * dev.sm_count, 1, std::max<std::int64_t>(p.rows, 1)));
  return launch(op, kernel, {dim3(grid), dim3(kThreads), 0, stream}, p);
}

// A clustered row kernel (`one` describes one cluster: its blocks, threads, shared memory): as many
// clusters as can be resident at once, at most one per row (each walks rows). Sets `launched`
// false (and launches nothing) when no cluster of this shape fits the device.
// `max_clusters` > 0 caps the clusters launched.
template <class T, class I, class... Params, class... Args>
Status launch_ce_clusters(void (*kernel)(Params...), LaunchShape one, std::int64_t rows, std::int64_t max_clusters,
                          const char* op, bool& launched, Args&&... args) {
  launched = false;
  cudaLaunchAttribute attrs[kMaxLaunchAttrs];
  const cudaLaunchConfig_t query = launch_config(one, false, attrs);
  int resident = 0;
  TIGON_CHECK(Status::from_cuda(cudaOccupancyMaxActiveClusters(&resident, kernel, &query), op,
                                "cudaOccupancyMaxActiveClusters"));
  if (resident < 1) return Status();
  std::int64_t clusters = std::min<std::int64_t>(resident, std::max<std::int64_t>(rows, 1));
  if (max_clusters > 0) clusters = std::min(clusters, max_clusters);
  one.grid = dim3(static_cast<unsigned>(clusters * one.cluster));
  TIGON_CHECK(launch(op, kernel, one, std::forward<Args>(args)...));
  launched = true;
  return Status();
}

// The on-chip kernel, shared memory opted in per call.
template <class T, class I, int kV, int kThreads, bool kPlain>
Status launch_ce_cluster(const CeParams<T, I>& p, const CeClusterShape& shape, cudaStream_t stream,
                         const char* op, bool& launched) {
  constexpr auto kernel = ce_cluster_kernel<T, I, kV, kThreads, kPlain>;
  launched = false;
  const int smem = static_cast<int>(2 * shape.slice * static_cast<std::int64_t>(sizeof(AlignedVec<T, kV>)));
  TIGON_CHECK(Status::from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                                op, "cudaFuncSetAttribute"));
  const auto blocks = static_cast<unsigned>(shape.blocks);
  return launch_ce_clusters<T, I>(kernel, {dim3(blocks), dim3(kThreads), static_cast<std::size_t>(smem), stream, blocks},
                                  p.rows, 0, op, launched, p, static_cast<int>(shape.slice));
}

// The split-row kernel (kPipe: its pipelined form), `blocks` blocks per row; `per_sm` > 0 caps
// the blocks per SM (the clusters launched: per_sm x SMs / blocks, at least one).
template <class T, class I, int kV, int kThreads, int kU, bool kPlain, bool kPipe>
Status launch_ce_split(const CeParams<T, I>& p, int blocks, int per_sm, cudaStream_t stream, const char* op,
                       bool& launched) {
  const auto slice = static_cast<int>(ceil_div<std::int64_t>(p.vocab / kV, blocks));
  const auto b = static_cast<unsigned>(blocks);
  constexpr auto kernel = kPipe ? ce_split_pipe_kernel<T, I, kV, kThreads, kU, kPlain>
                                : ce_split_kernel<T, I, kV, kThreads, kU, kPlain>;
  std::int64_t max_clusters = 0;
  std::size_t smem = 0;
  if (per_sm > 0) {
    DeviceInfo dev;
    TIGON_CHECK(current_device_info(dev));
    max_clusters = std::max<std::int64_t>(1, static_cast<std::int64_t>(per_sm) * dev.sm_count / blocks);
    // Shared memory the kernel does not use, reserved so that at most per_sm of its blocks fit an
    // SM: otherwise the hardware may stack several of the capped launch's blocks on one SM and
    // leave others idle. Each block also holds the kernel's static shared memory and the system's
    // share per block; a block's total may not pass the opt-in limit. (The limit set here is the
    // kernel instance's, process-wide: host threads launching one instance with different caps
    // at once could race on it.)
    cudaFuncAttributes fa{};
    TIGON_CHECK(Status::from_cuda(cudaFuncGetAttributes(&fa, kernel), op, "cudaFuncGetAttributes"));
    int system = 0;
    TIGON_CHECK(Status::from_cuda(
        cudaDeviceGetAttribute(&system, cudaDevAttrReservedSharedMemoryPerBlock, dev.device), op,
        "cudaDeviceGetAttribute"));
    const int fixed = static_cast<int>(fa.sharedSizeBytes) + system;
    const int reserve = std::min(dev.smem_per_sm / per_sm - fixed, dev.smem_per_block_optin - static_cast<int>(fa.sharedSizeBytes)) / 128 * 128;
    if (reserve > 0) {
      smem = static_cast<std::size_t>(reserve);
      TIGON_CHECK(Status::from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, reserve),
                                    op, "cudaFuncSetAttribute"));
    }
  }
  return launch_ce_clusters<T, I>(kernel, {dim3(b), dim3(kThreads), smem, stream, b}, p.rows, max_clusters, op,
                                  launched, p, slice);
}

// The resident kernel, when the row fits kCeResMaxCluster blocks and such a cluster fits the
// device; `launched` false (nothing launched) otherwise.
template <class T, class I, int kThreads, int kVecs, int kMinBlocks, int kAhead>
Status launch_ce_resident(const CeParams<T, I>& p, cudaStream_t stream, const char* op, bool& launched) {
  constexpr int kV = kVecElems<T>;
  launched = false;
  const std::int64_t nvec = p.vocab / kV;
  const std::int64_t csize = ceil_div<std::int64_t>(nvec, static_cast<std::int64_t>(kThreads) * kVecs);
  if (csize > kCeResMaxCluster) return Status();
  const auto slice = static_cast<int>(ceil_div<std::int64_t>(nvec, csize));
  constexpr auto kernel = ce_resident_kernel<T, I, kV, kThreads, kVecs, kMinBlocks>;
  const auto c = static_cast<unsigned>(csize);
  LaunchShape one{dim3(c), dim3(kThreads), 0, stream, c};
  // Whether a cluster of csize blocks fits the device: asked once per device and cluster size
  // (0: not asked yet, 1: fits, -1: does not), so that a call costs no occupancy query.
  static std::atomic<int> fits[kMaxDevices][kCeResMaxCluster + 1] = {};
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  if (dev.device < 0 || dev.device >= kMaxDevices) return Status();
  std::atomic<int>& known = fits[dev.device][csize];
  int f = known.load(std::memory_order_relaxed);
  if (f == 0) {
    if (csize > 8) {  // beyond the portable cluster size
      TIGON_CHECK(Status::from_cuda(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), op,
          "cudaFuncSetAttribute"));
    }
    cudaLaunchAttribute attrs[kMaxLaunchAttrs];
    const cudaLaunchConfig_t query = launch_config(one, false, attrs);
    int resident = 0;
    TIGON_CHECK(Status::from_cuda(cudaOccupancyMaxActiveClusters(&resident, kernel, &query), op,
                                  "cudaOccupancyMaxActiveClusters"));
    f = resident >= 1 ? 1 : -1;
    known.store(f, std::memory_order_relaxed);
  }
  if (f < 0) return Status();
  // One cluster per row; grids over 2^31 - 1 blocks go in several launches.
  const std::int64_t max_rows = (std::int64_t{1} << 31) / csize - 1;
  for (std::int64_t r0 = 0; r0 < p.rows; r0 += max_rows) {
    const std::int64_t n = std::min(max_rows, p.rows - r0);
    one.grid = dim3(static_cast<unsigned>(n * csize));
    TIGON_CHECK(launch(op, kernel, one, p, r0, slice, kAhead));
  }
  launched = true;
  return Status();
}

// The row kernel in kThreads-thread blocks, on 16-byte vectors when the call allows them (vec).
template <class T, class I, int kThreads, class P>
Status launch_ce_rows_sized(const CeParams<T, I>& p, bool vec, cudaStream_t stream, const char* op) {
  return vec ? launch_ce_rows<T, I, kVecElems<T>, kThreads, P>(p, stream, op)
             : launch_ce_rows<T, I, 1, kThreads, P>(p, stream, op);
}

template <class P = CrossEntropyDefaultPolicy, class T, class I>
Status run_ce_rows(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  constexpr int kV = kVecElems<T>;
  const bool vec = ce_vectorizable(p);
  if constexpr (P::kResThreads > 0 && P::kCluster == 0 && !P::kSplitRows && kV > 1) {
    if (vec && p.vocab > 16384 && (p.dx != nullptr || P::kResLoss) && ce_plain(p)) {
      DeviceInfo dev;
      TIGON_CHECK(current_device_info(dev));
      if (dev.cc_major >= 9) {
        bool launched = false;
        TIGON_CHECK((launch_ce_resident<T, I, P::kResThreads, P::kResVecs, P::kResMinBlocks, P::kResAhead>(p, stream, op, launched)));
        if (launched) return Status();
      }
    }
  }
  if constexpr (P::kSplitRows && kV > 1) {
    DeviceInfo dev;
    TIGON_CHECK(current_device_info(dev));
    if (vec && dev.cc_major >= 9 && p.stats == nullptr && p.stats_out == nullptr) {
      bool launched = false;
      constexpr bool kPipe = P::kSplitPipelined;
      TIGON_CHECK((ce_plain(p) ? launch_ce_split<T, I, kV, P::kClusterThreads, P::kUnroll, true, kPipe>(
                                     p, P::kCluster, P::kRowsPerSm, stream, op, launched)
                               : launch_ce_split<T, I, kV, P::kClusterThreads, P::kUnroll, false, kPipe>(
                                     p, P::kCluster, P::kRowsPerSm, stream, op, launched)));
      if (launched) return Status();
    }
  } else if constexpr (P::kCluster != 0 && kV > 1) {
    const bool wanted = P::kCluster > 0 || p.dx != nullptr;
    if (wanted && vec && p.stats == nullptr && p.stats_out == nullptr) {
      DeviceInfo dev;
      TIGON_CHECK(current_device_info(dev));
      // Two slices per block; the kernel's static shared memory (reduction scratch, slots,
      // barriers) stays out of them.
      constexpr std::int64_t kStatic = 4096;
      const CeClusterShape shape =
          dev.cc_major >= 9
              ? ce_cluster_shape(p.vocab / kV, static_cast<std::int64_t>(sizeof(AlignedVec<T, kV>)), P::kCluster,
                                 static_cast<std::int64_t>(P::kSliceKB) * 1024, (dev.smem_per_block_optin - kStatic) / 2)
              : CeClusterShape{};
      if (shape.blocks > 0) {
        bool launched = false;
        TIGON_CHECK((ce_plain(p) ? launch_ce_cluster<T, I, kV, P::kClusterThreads, true>(p, shape, stream, op, launched)
                                 : launch_ce_cluster<T, I, kV, P::kClusterThreads, false>(p, shape, stream, op, launched)));
        if (launched) return Status();
      }
    }
  }
  if (p.vocab > 16384) {
    if constexpr (P::kGradThreads != P::kWideThreads) {
      if (p.dx != nullptr && p.vocab > kCeGradWideCols) {
        return launch_ce_rows_sized<T, I, P::kGradThreads, P>(p, vec, stream, op);
      }
    }
    return launch_ce_rows_sized<T, I, P::kWideThreads, P>(p, vec, stream, op);
  }
  return launch_ce_rows_sized<T, I, P::kNarrowThreads, P>(p, vec, stream, op);
}

// The segmented kernel's segments per row (0: the kernel does not take rows this short).
template <class P>
constexpr std::int64_t ce_seg_count(std::int64_t vocab) {
  return (P::kSegCols > 0 && vocab > P::kSegCols) ? ceil_div<std::int64_t>(vocab, P::kSegCols) : 0;
}

// The segmented kernel, when the call is one it takes and the workspace holds its share (sized by
// cross_entropy_workspace_bytes with the vocabulary); `launched` false otherwise.
template <class P, class T, class I>
Status run_ce_segmented(const CeParams<T, I>& p, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                        const char* op, bool& launched) {
  launched = false;
  constexpr int kV = kVecElems<T>;
  if constexpr (P::kSegCols > 0 && kV > 1) {
    const std::int64_t segs = ce_seg_count<P>(p.vocab);
    if (segs < 2 || !ce_plain(p) || !ce_vectorizable(p)) return Status();
    const std::size_t base = ce_workspace_bytes(p.rows);
    if (workspace_bytes < base + ce_seg_bytes(p.rows, segs)) return Status();
    DeviceInfo dev;
    TIGON_CHECK(current_device_info(dev));
    if (dev.cc_major < 7) return Status();
    constexpr int kThreads = P::kSegThreads;
    constexpr int kU = P::kSegCols / (kThreads * kV);
    constexpr auto kernel = ce_seg_kernel<T, I, kV, kThreads, kU>;
    int occ = 0;
    TIGON_CHECK((blocks_per_sm<kernel, kThreads>(dev.device, occ)));
    const std::int64_t items = p.rows * segs;
    const std::int64_t resident = std::max<std::int64_t>(1, static_cast<std::int64_t>(occ) * dev.sm_count);
    const auto grid = static_cast<unsigned>(std::min<std::int64_t>(resident, items));
    const std::int64_t window =
        p.dx == nullptr ? items : std::min(items, std::max(segs, resident * P::kSegWindowPct / 100));
    const CeSegWork w = ce_seg_work(static_cast<unsigned char*>(workspace) + base, p.rows);
    const auto rgrid = static_cast<unsigned>(std::min<std::int64_t>(ceil_div<std::int64_t>(p.rows, 1024), 1024));
    TIGON_CHECK(launch(op, ce_seg_reset_kernel<1024>, {dim3(rgrid), dim3(1024), 0, stream}, w, p.rows));
    LaunchShape shape{dim3(grid), dim3(kThreads), 0, stream};
    shape.cooperative = true;  // blocks wait on one another's items: all of them resident
    const Status st = launch(op, kernel, shape, p, w, static_cast<int>(segs), static_cast<std::uint64_t>(window));
    // A device that cannot hold the whole grid at once (fewer SMs under MPS, say) takes the row
    // kernel; the counts the reset kernel zeroed are then unused.
    if (st.code() == Errc::cuda_error && st.cuda() == cudaErrorCooperativeLaunchTooLarge) return Status();
    TIGON_CHECK(st);
    launched = true;
  }
  return Status();
}

// The three launches of a loss, usable one by one by ops that compose cross-entropy (the chunked
// linear cross-entropy runs the row kernel once per chunk between one denominator and one reduce).
template <class I>
Status ce_denominator(const I* targets, std::int64_t rows, std::int64_t ignore_index,
                      const float* weights, std::int64_t vocab, float* denom, cudaStream_t stream,
                      const char* op) {
  return launch(op, ce_denominator_kernel<I>, {dim3(1), dim3(1024), 0, stream}, targets, rows, ignore_index,
                weights, vocab, denom);
}

inline Status ce_reduce(const float* loss_rows, const float* z_rows, std::int64_t rows, const float* denom,
                        bool mean, float* loss, float* z_loss, cudaStream_t stream, const char* op) {
  if (loss == nullptr && z_loss == nullptr) return Status();
  return launch(op, ce_reduce_kernel<1024>, {dim3(1), dim3(1024), 0, stream}, loss_rows, z_rows, rows, denom,
                mean, loss, z_loss);
}

// Workspace layout of a loss: [denominator | 3 spare floats | loss rows | z rows].
struct CeScratch {
  float* denom;
  float* loss_rows;
  float* z_rows;
};
inline CeScratch ce_scratch(void* ws, std::int64_t rows) {
  float* f = static_cast<float*>(ws);
  return {f, f + 4, f + 4 + rows};
}

template <class P = CrossEntropyDefaultPolicy, class T, class I>
Status ce_impl(const CrossEntropyArgs<T, I>& a, CeParams<T, I> p, cudaStream_t stream, const char* op) {
  TIGON_CHECK(check::workspace(a.workspace, a.workspace_bytes, ce_workspace_bytes(a.rows), op));
  const CeScratch ws = ce_scratch(a.workspace, a.rows);
  p.denom = ws.denom;
  p.loss_rows = a.loss_rows != nullptr ? a.loss_rows : ws.loss_rows;
  p.z_rows = ws.z_rows;
  if (a.reduction == Reduction::mean) {
    TIGON_CHECK(ce_denominator(a.targets, a.rows, a.ignore_index, a.class_weights, p.total_vocab,
                               ws.denom, stream, op));
  }
  bool segmented = false;
  TIGON_CHECK(run_ce_segmented<P>(p, a.workspace, a.workspace_bytes, stream, op, segmented));
  if (!segmented) TIGON_CHECK(run_ce_rows<P>(p, stream, op));
  if (p.stats_out == nullptr && a.reduction != Reduction::none) {
    TIGON_CHECK(ce_reduce(p.loss_rows, p.z_rows, a.rows, ws.denom, a.reduction == Reduction::mean, a.loss,
                          a.z_loss, stream, op));
  }
  return Status();
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------

// Bytes of workspace a cross-entropy call needs: with the vocabulary (and the policy the call will
// use), what that policy's kernels need for it (more only with the opt-in segmented kernel);
// without (vocab 0), the least any call needs — then every call takes the row kernel
// (docs/cross_entropy.md).
template <class P = CrossEntropyDefaultPolicy>
inline std::size_t cross_entropy_workspace_bytes(std::int64_t rows, std::int64_t vocab = 0) {
  const std::int64_t segs = detail::ce_seg_count<P>(vocab);
  return detail::ce_workspace_bytes(rows) + (segs >= 2 ? detail::ce_seg_bytes(rows, segs) : 0);
}

// Loss (and the gradient when args.dlogits is set) over the whole vocabulary. P: the row
// kernel's tuning (CrossEntropyPolicy); the default suits the H200.
template <class P = CrossEntropyDefaultPolicy, class T, class I>
[[nodiscard]] Status cross_entropy(const CrossEntropyArgs<T, I>& args, cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy";
  TIGON_CHECK(detail::validate(args, kOp));
  return detail::ce_impl<P>(args, detail::ce_params(args), stream, kOp);
}

// Split vocabulary, step 1: statistics of this shard ([rows, vocab] holding the columns
// [vocab_offset, vocab_offset + vocab) of a total_vocab-wide vocabulary) into stats[rows]. Targets
// are global column indices; class weights, when given, are this shard's [vocab] slice.
template <class T, class I>
[[nodiscard]] Status cross_entropy_shard_stats(const CrossEntropyArgs<T, I>& args,
                                               std::int64_t vocab_offset, std::int64_t total_vocab,
                                               CrossEntropyStats* stats, cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy_shard_stats";
  TIGON_CHECK(detail::validate(args, kOp));
  TIGON_CHECK(check::not_null(stats, kOp, "stats"));
  if (vocab_offset < 0 || vocab_offset + args.vocab > total_vocab) {
    return Status::error(Errc::invalid_size, kOp, "vocab_offset", "the shard must lie inside total_vocab");
  }
  auto p = detail::ce_params(args);
  p.dx = nullptr;
  p.col0 = vocab_offset;
  p.total_vocab = total_vocab;
  p.weights = args.class_weights != nullptr ? args.class_weights - vocab_offset : nullptr;
  p.stats_out = stats;
  p.loss_rows = nullptr;
  return detail::run_ce_rows(p, stream, kOp);
}

// Split vocabulary, step 2: merge the statistics of `shards` shards, laid out [shards][rows]
// (after the trainer's all-gather), into merged[rows].
[[nodiscard]] inline Status cross_entropy_merge_stats(const CrossEntropyStats* shards, int nshards,
                                                      std::int64_t rows, CrossEntropyStats* merged,
                                                      cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy_merge_stats";
  TIGON_CHECK(check::not_null(shards, kOp, "shards"));
  TIGON_CHECK(check::not_null(merged, kOp, "merged"));
  TIGON_CHECK(check::positive(nshards, kOp, "nshards"));
  TIGON_CHECK(check::positive(rows, kOp, "rows"));
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(ceil_div<std::int64_t>(rows, 256), 4096));
  return detail::launch(kOp, detail::ce_merge_kernel<256>, {dim3(grid), dim3(256), 0, stream}, shards, nshards,
                        rows, merged);
}

// Split vocabulary, step 3: with the merged statistics, this shard's loss outputs (every shard
// computes the same loss) and its slice of the gradient. Class weights: the shard's slice.
template <class T, class I>
[[nodiscard]] Status cross_entropy_shard_finalize(const CrossEntropyArgs<T, I>& args,
                                                  std::int64_t vocab_offset, std::int64_t total_vocab,
                                                  const CrossEntropyStats* merged, cudaStream_t stream) {
  constexpr const char* kOp = "cross_entropy_shard_finalize";
  TIGON_CHECK(detail::validate(args, kOp));
  TIGON_CHECK(check::not_null(merged, kOp, "merged"));
  if (vocab_offset < 0 || vocab_offset + args.vocab > total_vocab) {
    return Status::error(Errc::invalid_size, kOp, "vocab_offset", "the shard must lie inside total_vocab");
  }
  if (args.class_weights != nullptr && args.reduction == Reduction::mean) {
    return Status::error(Errc::unsupported, kOp, "class_weights",
                         "the mean over class weights needs the full weight vector: use "
                         "reduction sum and divide by the weight total");
  }
  auto p = detail::ce_params(args);
  p.col0 = vocab_offset;
  p.total_vocab = total_vocab;
  p.weights = args.class_weights != nullptr ? args.class_weights - vocab_offset : nullptr;
  p.stats = merged;
  return detail::ce_impl(args, p, stream, kOp);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
