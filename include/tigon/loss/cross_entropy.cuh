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
// denominator; with token scaling the row's loss and gradient are further multiplied by p_t, held
// constant. w are the class weights (1 without), eps the label smoothing, z the z-loss scale.
// Rows whose target is ignore_index contribute nothing; the mean divides by the sum of w_t over
// the other rows, counted on the device (no host synchronisation anywhere).
//
// Layout: this header holds the arguments, the math, the validation, the policy and the
// launchers; detail/cross_entropy_kernels.cuh the kernels and detail/cross_entropy_dispatch.cuh
// which kernel takes a call (docs/cross_entropy.md).
#pragma once

#include <algorithm>
#include <array>
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
  // Token scaling: each row's loss, z term and gradient times p_t = exp(x_t - lse), the row's
  // predicted probability of its target, taken as a constant (no gradient flows through it).
  bool token_scaling = false;
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
  float argmax_value;   // the argmax fields are computed when the statistics pass's args.argmax is set
  std::int64_t argmax;  // global column of the largest logit
  int has_target;       // 1 when the target lies in this shard
  float target_weight;  // w_t when the target lies in this shard (1 without class weights)
};

// ------------------------------------------------------------------------------------------------
// 2. Math
// ------------------------------------------------------------------------------------------------

namespace ce_math {

// tanh(u) as an odd rational function of u (degree 13 over degree 6, u clamped to +-7.905, where
// tanh rounds to +-1 in fp32 within 3e-7): a few ulp everywhere for one division and a dozen FMAs.
// The kernels' softcap, and the host's, so that both compute the same function.
TIGON_HD float tanh_rational(float u) {
  const float uc = u > 7.90531110763549805f ? 7.90531110763549805f : (u < -7.90531110763549805f ? -7.90531110763549805f : u);
  const float u2 = uc * uc;
  float p = -2.76076847742355e-16f;
  p = p * u2 + 2.00018790482477e-13f;
  p = p * u2 + -8.60467152213735e-11f;
  p = p * u2 + 5.12229709037114e-08f;
  p = p * u2 + 1.48572235717979e-05f;
  p = p * u2 + 6.37261928875436e-04f;
  p = p * u2 + 4.89352455891786e-03f;
  p = p * uc;
  float q = 1.19825839466702e-06f;
  q = q * u2 + 1.18534705686654e-04f;
  q = q * u2 + 2.26843463243900e-03f;
  q = q * u2 + 4.89352518554385e-03f;
#if defined(__CUDA_ARCH__)
  return __fdividef(p, q);
#else
  return p / q;
#endif
}
TIGON_HD float softcap(float x, float c) { return c > 0.0f ? c * tanh_rational(x * (1.0f / c)) : x; }
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

inline constexpr int kCeResMaxCluster = 16;

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
  // Columns are counted in int on the element-wise path: at most 2^31 - 1.
  TIGON_CHECK(at_most(a.vocab, (std::int64_t{1} << 31) - 1, op, "vocab"));
  TIGON_CHECK(finite(a.grad_scale, op, "grad_scale"));
  if (!finite_in(a.label_smoothing, 0.0f, 1.0f)) {
    return Status::error(Errc::invalid_value, op, "label_smoothing", "must be in [0, 1]");
  }
  if (!finite_in(a.z_loss_scale, 0.0f)) {
    return Status::error(Errc::invalid_value, op, "z_loss_scale", "must be finite and >= 0");
  }
  if (!finite_in(a.softcap, 0.0f)) {
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

// The loss's six outputs (loss, loss_rows, z_loss, lse, argmax, error_count) over `rows` rows, for
// buffers_disjoint; named "loss.<member>" when `prefixed` (the loss arguments inside another op's).
template <class T, class I>
std::array<check::NamedView, 6> ce_output_views(const CrossEntropyArgs<T, I>& l, std::int64_t rows, bool prefixed) {
  using check::vector_view;
  return {{{vector_view(l.loss, 1, 4), prefixed ? "loss.loss" : "loss"},
           {vector_view(l.loss_rows, rows, 4), prefixed ? "loss.loss_rows" : "loss_rows"},
           {vector_view(l.z_loss, 1, 4), prefixed ? "loss.z_loss" : "z_loss"},
           {vector_view(l.lse, rows, 4), prefixed ? "loss.lse" : "lse"},
           {vector_view(l.argmax, rows, 8), prefixed ? "loss.argmax" : "argmax"},
           {vector_view(l.error_count, 1, 4), prefixed ? "loss.error_count" : "error_count"}}};
}

// Every buffer of a call against every other: an output may share no byte with another output or
// with an input, but dlogits may be the logits themselves (same pointer and stride: in place).
// stats_out / stats_in: the split vocabulary's statistics (written by the statistics pass, read by
// the finalize). The workspace counts the bytes the call uses: workspace_used, or 0 for
// ce_workspace_bytes (an op composed on this one passes the whole of its workspace).
template <class T, class I>
Status validate(const CrossEntropyArgs<T, I>& a, const char* op, const CrossEntropyStats* stats_out = nullptr,
                const CrossEntropyStats* stats_in = nullptr, std::size_t workspace_used = 0) {
  using namespace check;
  TIGON_CHECK(not_null(a.logits, op, "logits"));
  TIGON_CHECK(validate_options(a, op));
  TIGON_CHECK(row_stride(a.logits_stride, a.vocab, op, "logits_stride"));
  TIGON_CHECK(row_stride(a.dlogits_stride, a.vocab, op, "dlogits_stride"));
  const MatrixView x = MatrixView::of(a.logits, a.rows, a.vocab, a.logits_stride);
  TIGON_CHECK(extent(x, op, "logits"));
  const std::int64_t go_len = a.reduction == Reduction::none ? a.rows : 1;
  const int st = static_cast<int>(sizeof(CrossEntropyStats));
  const NamedView in[] = {{x, "logits"},
                          {vector_view(a.targets, a.rows, sizeof(I)), "targets"},
                          {vector_view(a.class_weights, a.vocab, 4), "class_weights"},
                          {vector_view(a.grad_output, go_len, 4), "grad_output"},
                          {vector_view(stats_in, a.rows, st), "merged"}};
  const auto v = ce_output_views(a, a.rows, false);
  const NamedView out[] = {
      {a.dlogits != nullptr ? MatrixView::of(a.dlogits, a.rows, a.vocab, a.dlogits_stride) : MatrixView{}, "dlogits"},
      v[0], v[1], v[2], v[3], v[4], v[5],
      {vector_view(stats_out, a.rows, st), "stats"},
      {vector_view(a.workspace,
                   static_cast<std::int64_t>(workspace_used > 0 ? workspace_used : ce_workspace_bytes(a.rows)), 1),
       "workspace"}};
  TIGON_CHECK(buffers_disjoint(out, in, op, a.logits));
  return Status();
}

// Rows longer than this with a gradient take the row kernel's kRowGradThreads (CrossEntropyPolicy).
inline constexpr std::int64_t kCeGradWideCols = 65536;
// The resident kernels' largest cluster (beyond the portable 8: allowed per kernel on sm_90).
// A resident kernel's shape for a row of nvec 16-byte vectors (row_cluster_shape, at most
// kCeResMaxCluster blocks a row).
constexpr RowClusterShape ce_res_shape(std::int64_t nvec, int threads, int vecs) {
  return row_cluster_shape(nvec, threads, vecs, kCeResMaxCluster);
}
// A block size of a policy: a whole number of warps in [lo, hi].
constexpr bool whole_warps(int threads, int lo, int hi) { return threads % 32 == 0 && threads >= lo && threads <= hi; }

}  // namespace detail

// The cross-entropy kernels' tuning, CUB-style: the members below are the defaults (measured on an
// H200, docs/cross_entropy.md); a trainer derives and overrides what it wants,
//   struct MyPolicy : tigon::CrossEntropyPolicy { static constexpr int kResAhead = 16; };
// and passes it as cross_entropy<MyPolicy>(args, stream).
//
// Which kernel takes a call (detail/cross_entropy_dispatch.cuh), for 16-byte aligned rows: without
// a gradient (the loss alone, the split statistics) the streaming kernel (a block a row, a warp a
// segment, the row read once); with one on sm_90+, a resident kernel (one row per thread-block
// cluster, the row held in registers, so the logits are read once and the gradient written from
// registers): the plain one without options or with the argmax and label smoothing alone, the
// optioned one for class weights, softcap, token scaling and the split finalize. Rows that
// need over 16 blocks, unaligned rows and GPUs before sm_90 (with a gradient) take the row kernel
// (one row per block, a statistics pass and a gradient pass that re-reads the row, from L2 where
// it stayed).
struct CrossEntropyPolicy {
  // Row kernel: block size, and the block size with a gradient on rows over 65536 columns.
  static constexpr int kRowThreads = 256;
  static constexpr int kRowGradThreads = 512;
  // Row kernel: 16-byte vectors each thread has in flight per trip of either pass, and the blocks
  // per SM its registers must allow for the loss alone with options (__launch_bounds__).
  static constexpr int kRowUnroll = 4;
  static constexpr int kRowLossMinBlocks = 4;
  // Plain resident kernel: block size, 16-byte vectors per thread, the blocks per SM its registers
  // must allow (__launch_bounds__), and how many rows ahead each block asks the L2 for its slice
  // (one bulk prefetch; 0: none).
  static constexpr int kResThreads = 256;
  static constexpr int kResVecs = 8;
  static constexpr int kResMinBlocks = 4;
  static constexpr int kResAhead = 32;
  // Optioned resident kernel: the same four.
  static constexpr int kOptThreads = 256;
  static constexpr int kOptVecs = 8;
  static constexpr int kOptMinBlocks = 4;
  static constexpr int kOptAhead = 32;
  // Streaming kernel (no gradient: the loss alone, the split statistics): 16-byte vectors in flight
  // per lane per trip, and the vectors of a row segment (a warp each, at most 16 a row).
  static constexpr int kStreamUnroll = 8;
  static constexpr int kStreamSegVecs = 1024;
  // Rows shorter than this take the row kernel (columns).
  static constexpr std::int64_t kResMinCols = 0;
};
// The name of the default in earlier releases.
using CrossEntropyDefaultPolicy = CrossEntropyPolicy;

namespace detail {
// The static checks of a policy, run by every launcher that takes one.
template <class P>
constexpr bool check_ce_policy() {
  static_assert(whole_warps(P::kRowThreads, 32, 1024) && whole_warps(P::kRowGradThreads, 32, 1024),
                "row kernel: a whole number of warps, at most 1024 threads");
  static_assert(P::kRowUnroll >= 1 && P::kRowUnroll <= 8, "row kernel: 1 to 8 vectors in flight per thread");
  static_assert(P::kRowLossMinBlocks >= 1 && P::kRowLossMinBlocks <= 32, "row kernel: 1 to 32 blocks per SM");
  static_assert(whole_warps(P::kResThreads, 64, 1024) && whole_warps(P::kOptThreads, 64, 1024),
                "resident kernels: a whole number of warps, 64 to 1024 threads");
  static_assert(P::kResVecs >= 1 && P::kResVecs <= 32 && P::kOptVecs >= 1 && P::kOptVecs <= 16,
                "resident kernels: 1 to 32 (plain) / 16 (optioned) vectors per thread");
  static_assert(P::kResMinBlocks >= 1 && P::kResMinBlocks <= 32 && P::kOptMinBlocks >= 1 && P::kOptMinBlocks <= 32,
                "resident kernels: 1 to 32 blocks per SM");
  static_assert(P::kResAhead >= 0 && P::kOptAhead >= 0, "rows ahead: 0 (off) or more");
  static_assert(P::kResMinCols >= 0, "kResMinCols: 0 or more columns");
  static_assert(P::kStreamUnroll >= 1 && P::kStreamUnroll <= 16, "streaming kernel: 1 to 16 vectors in flight per lane");
  static_assert(P::kStreamSegVecs >= 32, "streaming kernel: segments of at least 32 vectors");
  return true;
}
}  // namespace detail

TIGON_NAMESPACE_END

#if defined(__CUDACC__)
#define TIGON_LOSS_CROSS_ENTROPY_API
#include "detail/cross_entropy_kernels.cuh"
#include "detail/cross_entropy_dispatch.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------

// Bytes of workspace cross_entropy(args) (and the split finalize) needs: the mean's denominator
// and 8 bytes of per-row scratch, rounded to 256. Validates args as the launch will.
template <class T, class I>
[[nodiscard]] Status cross_entropy_workspace_bytes(const CrossEntropyArgs<T, I>& args, std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "cross_entropy_workspace_bytes"));
  bytes = detail::ce_workspace_bytes(args.rows);
  return Status();
}

// The rows whose target was neither ignore_index nor in [0, vocab), as counted in `error_count` (the
// device int of CrossEntropyArgs::error_count, linear-cross-entropy's loss.error_count) by every
// launch since the counter was last zeroed: waits for `stream`, returns an invalid_value status
// naming the count, the vocabulary and ignore_index when it is not zero, and zeroes the counter when
// `reset`. A synchronising call, so not one to capture in a CUDA graph: a trainer that captures its
// step calls it after the replay (or every N steps; the count accumulates).
[[nodiscard]] inline Status check_target_errors(int* error_count, std::int64_t vocab, std::int64_t ignore_index,
                                                cudaStream_t stream, bool reset = true,
                                                const char* op = "cross_entropy") {
  TIGON_CHECK(check::not_null(error_count, op, "error_count"));
  int n = 0;
  TIGON_CHECK(Status::from_cuda(cudaMemcpyAsync(&n, error_count, sizeof(int), cudaMemcpyDeviceToHost, stream), op,
                                "cudaMemcpyAsync"));
  TIGON_CHECK(Status::from_cuda(cudaStreamSynchronize(stream), op, "cudaStreamSynchronize"));
  if (n == 0) return Status();
  if (reset) {
    TIGON_CHECK(Status::from_cuda(cudaMemsetAsync(error_count, 0, sizeof(int), stream), op, "cudaMemsetAsync"));
  }
  return Status::error(Errc::invalid_value, op, "targets",
                       std::to_string(n) + " row(s) with a target outside [0, " + std::to_string(vocab) +
                           ") that is not ignore_index (" + std::to_string(ignore_index) +
                           "): their loss is NaN and their gradient zero");
}

#if defined(__CUDACC__)

// Loss (and the gradient when args.dlogits is set) over the whole vocabulary. P: the kernels'
// tuning (CrossEntropyPolicy or a policy derived from it).
template <class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status cross_entropy(const CrossEntropyArgs<T, I>& args, cudaStream_t stream) {
  static_assert(detail::check_ce_policy<P>());
  constexpr const char* kOp = "cross_entropy";
  TIGON_CHECK(detail::validate(args, kOp));
  return detail::ce_impl<P>(args, detail::ce_params(args), stream, kOp);
}

// Split vocabulary, step 1: statistics of this shard ([rows, vocab] holding the columns
// [vocab_offset, vocab_offset + vocab) of a total_vocab-wide vocabulary) into stats[rows]. Targets
// are global column indices; class weights, when given, are this shard's [vocab] slice. The argmax
// is found only when args.argmax is set (nothing is written there): pass the args the finalize
// gets, so that the statistics carry the argmax exactly when the finalize writes it.
template <class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status cross_entropy_shard_stats(const CrossEntropyArgs<T, I>& args,
                                               std::int64_t vocab_offset, std::int64_t total_vocab,
                                               CrossEntropyStats* stats, cudaStream_t stream) {
  static_assert(detail::check_ce_policy<P>());
  constexpr const char* kOp = "cross_entropy_shard_stats";
  TIGON_CHECK(detail::validate(args, kOp, stats));
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
  return detail::run_ce_rows<P>(p, stream, kOp);
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
template <class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status cross_entropy_shard_finalize(const CrossEntropyArgs<T, I>& args,
                                                  std::int64_t vocab_offset, std::int64_t total_vocab,
                                                  const CrossEntropyStats* merged, cudaStream_t stream) {
  static_assert(detail::check_ce_policy<P>());
  constexpr const char* kOp = "cross_entropy_shard_finalize";
  TIGON_CHECK(detail::validate(args, kOp, nullptr, merged));
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
  return detail::ce_impl<P>(args, p, stream, kOp);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
