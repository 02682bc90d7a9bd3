// tigon/loss/detail/cross_entropy_dispatch.cuh - which cross-entropy kernel takes a call, the
// launches, and the pieces the ops composed on cross-entropy call (the chunked linear
// cross-entropy). Included by <tigon/loss/cross_entropy.cuh>; not a header to include on its own.
#pragma once

#ifndef TIGON_LOSS_CROSS_ENTROPY_API
#error "include <tigon/loss/cross_entropy.cuh>"
#endif

TIGON_NAMESPACE_BEGIN

namespace detail {

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
  p.token_scaling = a.token_scaling;
  p.grad_output = a.grad_output;
  p.reduction = a.reduction;
  p.lse = a.lse;
  p.argmax = a.argmax;
  p.error_count = a.error_count;
  p.col0 = 0;
  p.total_vocab = a.vocab;
  return p;
}

// Whether every row allows 16-byte vectors.
template <class T, class I>
bool ce_vectorizable(const CeParams<T, I>& p) {
  constexpr int kV = kVecElems<T>;
  return p.vocab % kV == 0 && rows_aligned(p.x, p.xs, kV) &&
         (p.dx == nullptr || rows_aligned(p.dx, p.dxs, kV));
}

// The row kernel: one row per resident block at a time (a gradient pass re-reads its row, from L2
// where it stayed), kThreads threads, kV elements per vector.
template <class T, class I, int kV, int kThreads, class P, bool kPlain, bool kGrad>
Status launch_ce_rows_as(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  constexpr auto kernel =
      ce_row_kernel<T, I, kV, kThreads, P::kRowUnroll, kPlain, kGrad, P::kRowLossMinBlocks>;
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  int occ = 0;
  TIGON_CHECK((blocks_per_sm<kernel, kThreads>(dev.device, occ)));
  const auto grid = static_cast<unsigned>(
      std::clamp<std::int64_t>(static_cast<std::int64_t>(occ) * dev.sm_count, 1, std::max<std::int64_t>(p.rows, 1)));
  return launch(op, kernel, {dim3(grid), dim3(kThreads), 0, stream}, p);
}

template <class T, class I, int kThreads, class P>
Status launch_ce_rows(const CeParams<T, I>& p, bool vec, cudaStream_t stream, const char* op) {
  const bool plain = ce_plain(p);
  const bool grad = p.dx != nullptr;
  auto as = [&](auto v_c, auto plain_c, auto grad_c) {
    return launch_ce_rows_as<T, I, decltype(v_c)::value, kThreads, P, decltype(plain_c)::value,
                             decltype(grad_c)::value>(p, stream, op);
  };
  auto by_grad = [&](auto v_c, auto plain_c) {
    return grad ? as(v_c, plain_c, std::true_type{}) : as(v_c, plain_c, std::false_type{});
  };
  auto by_plain = [&](auto v_c) {
    return plain ? by_grad(v_c, std::true_type{}) : by_grad(v_c, std::false_type{});
  };
  if constexpr (kVecElems<T> > 1) {
    if (vec) return by_plain(std::integral_constant<int, kVecElems<T>>{});
  }
  return by_plain(std::integral_constant<int, 1>{});
}

// A resident kernel (plain or optioned), when the row fits kCeResMaxCluster blocks and such a
// cluster fits the device; `launched` false (nothing launched) otherwise.
template <auto kKernel, int kThreads, int kVecs, int kAhead, class T, class I>
Status launch_ce_resident(const CeParams<T, I>& p, cudaStream_t stream, const char* op, bool& launched) {
  constexpr int kV = kVecElems<T>;
  launched = false;
  const RowClusterShape shape = ce_res_shape(p.vocab / kV, kThreads, kVecs);
  if (shape.csize == 0) return Status();
  const auto c = static_cast<unsigned>(shape.csize);
  LaunchShape one{dim3(c), dim3(kThreads), 0, stream, c};
  int resident = 0;
  TIGON_CHECK((cluster_residency<kKernel, kCeResMaxCluster>(one, op, resident)));
  if (resident == 0) return Status();
  // One cluster per row; grids over 2^31 - 1 blocks go in several launches.
  const std::int64_t max_rows = (std::int64_t{1} << 31) / shape.csize - 1;
  for (std::int64_t r0 = 0; r0 < p.rows; r0 += max_rows) {
    const std::int64_t n = std::min(max_rows, p.rows - r0);
    one.grid = dim3(static_cast<unsigned>(n * shape.csize));
    TIGON_CHECK(launch(op, kKernel, one, p, r0, shape.slice, kAhead));
  }
  launched = true;
  return Status();
}

// The optioned resident kernel with the softcap (0: none, 1: rational tanh, 2: hardware tanh) as a
// compile-time switch.
template <class P, int kCap, class T, class I>
Status launch_ce_opt(const CeParams<T, I>& p, cudaStream_t stream, const char* op, bool& launched) {
  constexpr auto kernel =
      ce_resident_opt_kernel<T, I, kVecElems<T>, P::kOptThreads, P::kOptVecs, P::kOptMinBlocks, kCap>;
  return launch_ce_resident<kernel, P::kOptThreads, P::kOptVecs, P::kOptAhead>(p, stream, op, launched);
}

// The streaming kernel's shape for rows of nvec 16-byte vectors: segments (warps of its block) of
// about seg_target vectors, a multiple of 32, at most kCeStreamMaxWarps a row.
struct CeStreamShape {
  int segs;
  int seg_vecs;
};
inline CeStreamShape ce_stream_shape(std::int64_t nvec, int seg_target) {
  const std::int64_t segs = std::clamp<std::int64_t>(ceil_div<std::int64_t>(nvec, seg_target), 1, kCeStreamMaxWarps);
  const std::int64_t seg_vecs = round_up<std::int64_t>(ceil_div<std::int64_t>(nvec, segs), 32);
  return {static_cast<int>(ceil_div<std::int64_t>(nvec, seg_vecs)), static_cast<int>(seg_vecs)};
}

// The streaming kernel: a block a row, in launches of at most 2^31 - 1 rows.
template <class P, int kCap, class T, class I>
Status launch_ce_stream(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  constexpr int kV = kVecElems<T>;
  constexpr auto kernel = ce_stream_kernel<T, I, kV, P::kStreamUnroll, kCap>;
  const CeStreamShape sh = ce_stream_shape(p.vocab / kV, P::kStreamSegVecs);
  constexpr std::int64_t kMaxRows = (std::int64_t{1} << 31) - 1;
  for (std::int64_t r0 = 0; r0 < p.rows; r0 += kMaxRows) {
    const auto n = static_cast<unsigned>(std::min(kMaxRows, p.rows - r0));
    TIGON_CHECK(launch(op, kernel, {dim3(n), dim3(32 * static_cast<unsigned>(sh.segs)), 0, stream}, p, r0, sh.seg_vecs));
  }
  return Status();
}

// The argmax and label smoothing, one or both, as the only options: the plain resident kernel's
// instances for them take 16-bit logits.
template <class T, class I>
bool ce_arg_smooth(const CeParams<T, I>& p) {
  const unsigned o = ce_options(p);
  return o != 0u && (o & ~(kCeArgmax | kCeSmooth)) == 0u;
}

// The softcap as the only option: the plain resident kernel's instance for it takes 16-bit logits.
template <class T, class I>
bool ce_cap_only(const CeParams<T, I>& p) {
  return ce_options(p) == kCeCap;
}

// Which kernel takes a call (16-byte rows of at least kResMinCols columns): without a gradient
// the streaming kernel; with one on sm_90+, a resident kernel when the row fits a cluster of
// kCeResMaxCluster blocks (the plain one without options, with the argmax and smoothing alone or
// with the softcap alone (16-bit logits), else the optioned one). Everything else takes the row kernel.
template <class P = CrossEntropyPolicy, class T, class I>
Status run_ce_rows(const CeParams<T, I>& p, cudaStream_t stream, const char* op) {
  constexpr int kV = kVecElems<T>;
  const bool vec = ce_vectorizable(p);
  if constexpr (kV > 1) {
    const bool plain = ce_plain(p);
    if (vec && p.dx == nullptr && p.stats == nullptr && p.vocab >= P::kResMinCols) {
      if (p.cap > 0.0f) return launch_ce_stream<P, sizeof(T) == 2 ? 2 : 1>(p, stream, op);
      return launch_ce_stream<P, 0>(p, stream, op);
    }
    if (vec && p.dx != nullptr && p.vocab >= P::kResMinCols) {
      DeviceInfo dev;
      TIGON_CHECK(current_device_info(dev));
      if (dev.cc_major >= 9) {
        bool launched = false;
        auto res = [&](auto arg_c, auto smooth_c, auto cap_c) {
          constexpr auto kernel = ce_resident_kernel<T, I, kV, P::kResThreads, P::kResVecs, P::kResMinBlocks,
                                                     decltype(arg_c)::value, decltype(smooth_c)::value,
                                                     decltype(cap_c)::value>;
          return launch_ce_resident<kernel, P::kResThreads, P::kResVecs, P::kResAhead>(p, stream, op, launched);
        };
        constexpr std::true_type kYes{};
        constexpr std::false_type kNo{};
        if (plain) {
          TIGON_CHECK(res(kNo, kNo, kNo));
        } else if (PackedMax<T>::kPacked && ce_arg_smooth(p)) {
          if constexpr (PackedMax<T>::kPacked) {  // the argmax by packed compares
            TIGON_CHECK(p.argmax != nullptr ? (p.eps > 0.0f ? res(kYes, kYes, kNo) : res(kYes, kNo, kNo))
                                        : res(kNo, kYes, kNo));
          }
        } else if (PackedMax<T>::kPacked && ce_cap_only(p)) {
          if constexpr (PackedMax<T>::kPacked) TIGON_CHECK(res(kNo, kNo, kYes));
        } else if (p.cap > 0.0f) {
          TIGON_CHECK((launch_ce_opt<P, sizeof(T) == 2 ? 2 : 1>(p, stream, op, launched)));
        } else {
          TIGON_CHECK((launch_ce_opt<P, 0>(p, stream, op, launched)));
        }
        if (launched) return Status();
      }
    }
  }
  if (p.dx != nullptr && p.vocab > kCeGradWideCols) return launch_ce_rows<T, I, P::kRowGradThreads, P>(p, vec, stream, op);
  return launch_ce_rows<T, I, P::kRowThreads, P>(p, vec, stream, op);
}

// The mean's denominator and the reduction: one launch each, before and after the rows.
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

// Workspace layout of a loss: [denominator | 3 spare floats | loss rows | z rows], rounded to 256
// bytes (ce_workspace_bytes).
struct CeScratch {
  float* denom;
  float* loss_rows;
  float* z_rows;
};
inline CeScratch ce_scratch(void* ws, std::int64_t rows) {
  float* f = static_cast<float*>(ws);
  return {f, f + 4, f + 4 + rows};
}

template <class P = CrossEntropyPolicy, class T, class I>
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
  TIGON_CHECK(run_ce_rows<P>(p, stream, op));
  if (p.stats_out == nullptr && a.reduction != Reduction::none) {
    TIGON_CHECK(ce_reduce(p.loss_rows, p.z_rows, a.rows, ws.denom, a.reduction == Reduction::mean, a.loss,
                          a.z_loss, stream, op));
  }
  return Status();
}

// A chunk's logits as one shard of a split vocabulary: columns [col0, col0 + vocab) of total_vocab;
// with stats_out the statistics pass (the rows' statistics only), with stats the finalize against
// the merged statistics.
struct CeChunkShard {
  std::int64_t col0 = 0, total_vocab = 0;
  const CrossEntropyStats* stats = nullptr;
  CrossEntropyStats* stats_out = nullptr;
};

// One chunk of a loss whose denominator and reduction the caller launches (the chunked linear
// cross-entropy): rows [r0, r0 + rows) of `loss`, their logits [rows, loss.vocab] contiguous in
// `logits`, the gradient written over them when `grad`; per-row outputs and the per-row scratch
// offset to the chunk. `shard`: the chunk's logits are a shard of a split vocabulary (class weights
// then this shard's slice).
template <class P = CrossEntropyPolicy, class T, class I>
Status cross_entropy_chunk(const CrossEntropyArgs<T, I>& loss, T* logits, std::int64_t r0,
                           std::int64_t rows, bool grad, const CeScratch& scratch, cudaStream_t stream,
                           const char* op, const CeChunkShard* shard = nullptr) {
  CeParams<T, I> p = ce_params(loss);
  p.x = logits;
  p.xs = loss.vocab;
  p.dx = grad ? logits : nullptr;
  p.dxs = loss.vocab;
  p.rows = rows;
  p.targets = loss.targets + r0;
  p.denom = scratch.denom;
  p.loss_rows = (loss.loss_rows != nullptr ? loss.loss_rows : scratch.loss_rows) + r0;
  p.z_rows = scratch.z_rows + r0;
  if (loss.lse != nullptr) p.lse = loss.lse + r0;
  if (loss.argmax != nullptr) p.argmax = loss.argmax + r0;
  if (loss.grad_output != nullptr && loss.reduction == Reduction::none) p.grad_output = loss.grad_output + r0;
  if (shard != nullptr) {
    p.col0 = shard->col0;
    p.total_vocab = shard->total_vocab;
    p.weights = loss.class_weights != nullptr ? loss.class_weights - shard->col0 : nullptr;
    p.stats = shard->stats;
    if (shard->stats_out != nullptr) {
      p.stats_out = shard->stats_out;
      p.dx = nullptr;
      p.loss_rows = p.z_rows = nullptr;
      p.lse = nullptr;  // p.argmax stays: the statistics carry the argmax when the finalize writes one
    }
  }
  return run_ce_rows<P>(p, stream, op);
}

}  // namespace detail

TIGON_NAMESPACE_END
