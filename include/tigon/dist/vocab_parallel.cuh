// tigon/dist/vocab_parallel.cuh - cross-entropy over a vocabulary split across the ranks of an NCCL
// communicator (a tensor-parallel LM head): each rank holds the logits of its columns
// [vocab_offset, vocab_offset + vocab) of a total_vocab-wide vocabulary for the same rows and the
// same targets (global column indices). One call per rank, on its own device and stream:
//
//   1. cross_entropy_shard_stats: per row, this shard's max, sum of exp, the target's logit and
//      weight when the target is in the shard, the smoothing sums and the argmax;
//   2. ncclAllGather of those rows into [ranks][rows] (in place in the workspace);
//   3. cross_entropy_merge_stats in rank order: every rank holds the same merged statistics, so the
//      loss outputs are the same bytes on every rank;
//   4. cross_entropy_shard_finalize: the loss outputs and this shard's slice of the gradient.
//
// Every option of cross_entropy carries over (smoothing, z-loss, softcap, class weights as this
// shard's slice under reduction sum / none, token scaling, lse, argmax, the gradient in place), with
// cross_entropy's numerics. The communication is one all-gather of rows x 40 bytes a rank; no
// host synchronisation; capturable in a CUDA graph (NCCL 2.9+). The arguments are checked before
// anything is launched or communicated; ranks must agree on rows, total_vocab and the targets (the
// call cannot check another rank's arguments: a rank whose call is rejected must not leave the others
// waiting in the all-gather).
//
// vocab_parallel_linear_cross_entropy does the same for a tensor-parallel LM head, chunk by chunk of
// tokens as linear_cross_entropy does: each rank holds the whole x [tokens, hidden] and its rows of
// the head's weight, computes its logits' columns per chunk (x_c W_r^T), the statistics' all-gather,
// merge and finalize per chunk, its slice of dW (and db) from its gradient columns, and its part of
// dx_c = dlogits_c W_r, summed over the ranks with ncclAllReduce on a second stream when one is given
// (overlapped with the dW product) or on the call's stream. Every rank ends with the same loss outputs
// and the whole dx.
//
// Linking: NCCL (libnccl and nccl.h, shipped with the CUDA toolkit and with the nvidia-nccl wheels);
// in this project's build tree, the tigon::dist target; the linear op also cuBLASLt (tigon::blas).
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../loss/cross_entropy.cuh"
#include "../loss/linear_cross_entropy.cuh"

TIGON_NAMESPACE_BEGIN

// Where this rank's shard lies in the vocabulary.
struct VocabShard {
  std::int64_t vocab_offset = 0;  // this rank's first column
  std::int64_t total_vocab = 0;   // the whole vocabulary
};

namespace detail {

inline Status from_nccl(ncclResult_t r, const char* op, const char* what) {
  if (r == ncclSuccess) return Status();
  return Status::error(Errc::cuda_error, op, "comm",
                       std::string(what) + ": NCCL " + ncclGetErrorString(r) + " (" +
                           std::to_string(static_cast<int>(r)) + ")");
}

// The workspace: the gathered statistics [ranks][rows], then the merged ones [rows], then what
// cross_entropy's finalize needs (the mean's denominator).
struct VocabParallelLayout {
  std::size_t gathered = 0, merged = 0, finalize = 0, total = 0;
};

template <class T, class I>
VocabParallelLayout vocab_parallel_layout(const CrossEntropyArgs<T, I>& a, int ranks) {
  VocabParallelLayout l;
  const auto row_bytes = static_cast<std::size_t>(a.rows) * sizeof(CrossEntropyStats);
  l.gathered = 0;
  l.merged = round_up<std::size_t>(static_cast<std::size_t>(ranks) * row_bytes, 256);
  l.finalize = l.merged + round_up<std::size_t>(row_bytes, 256);
  l.total = l.finalize + round_up<std::size_t>(ce_workspace_bytes(a.rows), 256);
  return l;
}

inline Status comm_shape(ncclComm_t comm, const char* op, int& ranks, int& rank) {
  TIGON_CHECK(check::not_null(comm, op, "comm"));
  TIGON_CHECK(from_nccl(ncclCommCount(comm, &ranks), op, "ncclCommCount"));
  TIGON_CHECK(from_nccl(ncclCommUserRank(comm, &rank), op, "ncclCommUserRank"));
  return Status();
}

}  // namespace detail

// Bytes of workspace vocab_parallel_cross_entropy(args, shard, comm, ...) needs on a communicator
// of `ranks` ranks (args.workspace is not used: this workspace serves the whole call).
template <class T, class I>
[[nodiscard]] Status vocab_parallel_cross_entropy_workspace_bytes(const CrossEntropyArgs<T, I>& args, int ranks,
                                                                  std::size_t& bytes) {
  constexpr const char* kOp = "vocab_parallel_cross_entropy_workspace_bytes";
  bytes = 0;
  TIGON_CHECK(check::positive(args.rows, kOp, "rows"));
  TIGON_CHECK(check::positive(ranks, kOp, "ranks"));
  bytes = detail::vocab_parallel_layout(args, ranks).total;
  return Status();
}

#if defined(__CUDACC__)

// The cross-entropy of this rank's shard, as described above. args: this shard's logits [rows,
// vocab] (and dlogits, the gradient's slice), the targets, the options and the outputs, as for
// cross_entropy; args.workspace is ignored (the call's workspace is `workspace`, 16-byte aligned,
// vocab_parallel_cross_entropy_workspace_bytes() long). Class weights: this shard's slice, under
// reduction sum or none.
template <class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status vocab_parallel_cross_entropy(const CrossEntropyArgs<T, I>& args, const VocabShard& shard,
                                                  ncclComm_t comm, void* workspace, std::size_t workspace_bytes,
                                                  cudaStream_t stream) {
  constexpr const char* kOp = "vocab_parallel_cross_entropy";
  if (args.rows <= 0) return Status::error(Errc::invalid_size, kOp, "rows", "must be positive");
  if (shard.vocab_offset < 0 || args.vocab <= 0 || shard.vocab_offset + args.vocab > shard.total_vocab) {
    return Status::error(Errc::invalid_size, kOp, "shard", "the shard must lie inside total_vocab");
  }
  if (args.class_weights != nullptr && args.reduction == Reduction::mean) {
    return Status::error(Errc::unsupported, kOp, "class_weights",
                         "the mean over class weights needs the full weight vector: use "
                         "reduction sum and divide by the weight total");
  }
  int ranks = 0, rank = 0;
  TIGON_CHECK(detail::comm_shape(comm, kOp, ranks, rank));
  const detail::VocabParallelLayout l = detail::vocab_parallel_layout(args, ranks);
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, l.total, kOp));
  auto* base = static_cast<unsigned char*>(workspace);
  auto* gathered = reinterpret_cast<CrossEntropyStats*>(base + l.gathered);
  auto* merged = reinterpret_cast<CrossEntropyStats*>(base + l.merged);
  CrossEntropyArgs<T, I> a = args;
  a.workspace = base + l.finalize;
  a.workspace_bytes = workspace_bytes - l.finalize;
  // Every check before the first launch: the finalize's (its workspace part against every buffer,
  // the outputs against each other and the inputs), and the statistics' region of the workspace
  // (written by the statistics pass, the all-gather and the merge) against every buffer of the call.
  TIGON_CHECK(detail::validate(a, kOp, nullptr, merged));
  {
    using check::vector_view;
    const auto v = detail::ce_output_views(a, a.rows, false);
    const check::NamedView stats[] = {{vector_view(workspace, static_cast<std::int64_t>(l.finalize), 1), "workspace"}};
    const check::NamedView all[] = {
        {MatrixView::of(a.logits, a.rows, a.vocab, a.logits_stride), "logits"},
        {vector_view(a.targets, a.rows, sizeof(I)), "targets"},
        {vector_view(a.class_weights, a.vocab, 4), "class_weights"},
        {vector_view(a.grad_output, a.reduction == Reduction::none ? a.rows : 1, 4), "grad_output"},
        {a.dlogits != nullptr ? MatrixView::of(a.dlogits, a.rows, a.vocab, a.dlogits_stride) : MatrixView{},
         "dlogits"},
        v[0], v[1], v[2], v[3], v[4], v[5]};
    TIGON_CHECK(check::buffers_disjoint(stats, all, kOp));
  }
  TIGON_CHECK((cross_entropy_shard_stats<P>(a, shard.vocab_offset, shard.total_vocab,
                                            gathered + static_cast<std::int64_t>(rank) * a.rows, stream)));
  const std::size_t row_bytes = static_cast<std::size_t>(a.rows) * sizeof(CrossEntropyStats);
  TIGON_CHECK(detail::from_nccl(ncclAllGather(base + l.gathered + static_cast<std::size_t>(rank) * row_bytes,
                                              base + l.gathered, row_bytes, ncclUint8, comm, stream),
                                kOp, "ncclAllGather"));
  TIGON_CHECK(cross_entropy_merge_stats(gathered, ranks, a.rows, merged, stream));
  return cross_entropy_shard_finalize<P>(a, shard.vocab_offset, shard.total_vocab, merged, stream);
}

namespace detail {

template <class T>
constexpr ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) {
    return ncclFloat32;
  } else if constexpr (std::is_same_v<T, __half>) {
    return ncclFloat16;
  } else {
    return ncclBfloat16;
  }
}

// The linear op's workspace: the statistics of one chunk ([ranks][chunk], then [chunk] merged), then
// linear_cross_entropy's layout for this rank's shard.
struct VocabParallelLinearLayout {
  std::size_t stats, lce, total;
};
template <class T, class I>
VocabParallelLinearLayout vocab_parallel_linear_layout(const LinearCrossEntropyArgs<T, I>& a, int ranks) {
  const LceLayout l = lce_layout(a);
  const auto chunk_bytes = static_cast<std::size_t>(l.chunk) * sizeof(CrossEntropyStats);
  VocabParallelLinearLayout v;
  v.stats = round_up<std::size_t>(static_cast<std::size_t>(ranks) * chunk_bytes, 256) + round_up<std::size_t>(chunk_bytes, 256);
  v.lce = v.stats;
  v.total = v.lce + l.total;
  return v;
}

}  // namespace detail

// Bytes of workspace vocab_parallel_linear_cross_entropy(args, ...) needs on `ranks` ranks.
template <class T, class I>
[[nodiscard]] Status vocab_parallel_linear_cross_entropy_workspace_bytes(const LinearCrossEntropyArgs<T, I>& args,
                                                                         int ranks, std::size_t& bytes) {
  constexpr const char* kOp = "vocab_parallel_linear_cross_entropy_workspace_bytes";
  bytes = 0;
  TIGON_CHECK(check::positive(args.loss.rows, kOp, "loss.rows"));
  TIGON_CHECK(check::positive(args.loss.vocab, kOp, "loss.vocab"));
  TIGON_CHECK(check::positive(ranks, kOp, "ranks"));
  bytes = detail::vocab_parallel_linear_layout(args, ranks).total;
  return Status();
}

// The linear cross-entropy of a tensor-parallel LM head, as described at the top. args: as for
// linear_cross_entropy, with weight (and bias, dweight, dbias) this rank's rows [vocab, hidden] of the
// head, loss.vocab this rank's columns, loss.targets global columns, dx the whole [tokens, hidden]
// gradient (contiguous rows: the all-reduce reads them as one range), args.workspace ignored (the
// call's is `workspace`). comm_stream: a second stream for dx's all-reduce (null: the call's stream);
// the call's stream waits for it before returning. Class weights: this rank's slice, under reduction
// sum or none.
template <class Gemm = CublasLtGemm, class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status vocab_parallel_linear_cross_entropy(const LinearCrossEntropyArgs<T, I>& args,
                                                         const VocabShard& shard, ncclComm_t comm, Gemm& gemm,
                                                         void* workspace, std::size_t workspace_bytes,
                                                         cudaStream_t stream, cudaStream_t comm_stream = nullptr) {
  constexpr const char* kOp = "vocab_parallel_linear_cross_entropy";
  const CrossEntropyArgs<T, I>& ce = args.loss;
  if (ce.rows <= 0) return Status::error(Errc::invalid_size, kOp, "loss.rows", "must be positive");
  if (shard.vocab_offset < 0 || ce.vocab <= 0 || shard.vocab_offset + ce.vocab > shard.total_vocab) {
    return Status::error(Errc::invalid_size, kOp, "shard", "the shard must lie inside total_vocab");
  }
  if (ce.class_weights != nullptr && ce.reduction == Reduction::mean) {
    return Status::error(Errc::unsupported, kOp, "loss.class_weights",
                         "the mean over class weights needs the full weight vector: use "
                         "reduction sum and divide by the weight total");
  }
  if (args.dx != nullptr && args.dx_stride != 0 && args.dx_stride != args.hidden) {
    return Status::error(Errc::unsupported, kOp, "dx_stride", "dx's rows must be contiguous (the all-reduce)");
  }
  int ranks = 0, rank = 0;
  TIGON_CHECK(detail::comm_shape(comm, kOp, ranks, rank));
  const detail::VocabParallelLinearLayout vl = detail::vocab_parallel_linear_layout(args, ranks);
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, vl.total, kOp));
  auto* base = static_cast<unsigned char*>(workspace);
  LinearCrossEntropyArgs<T, I> a = args;
  a.workspace = base + vl.lce;
  a.workspace_bytes = workspace_bytes - vl.lce;
  TIGON_CHECK(detail::validate(a, kOp));
  {  // the statistics' region against every buffer of the call
    using check::vector_view;
    const auto v = detail::ce_output_views(ce, ce.rows, true);
    const check::NamedView stats[] = {{vector_view(workspace, static_cast<std::int64_t>(vl.stats), 1), "workspace"}};
    const check::NamedView all[] = {
        {MatrixView::of(a.x, ce.rows, a.hidden, a.x_stride), "x"},
        {MatrixView::of(a.weight, ce.vocab, a.hidden, 0), "weight"},
        {vector_view(a.bias, ce.vocab, sizeof(T)), "bias"},
        {vector_view(ce.targets, ce.rows, sizeof(I)), "loss.targets"},
        {vector_view(ce.class_weights, ce.vocab, 4), "loss.class_weights"},
        {vector_view(ce.grad_output, ce.reduction == Reduction::none ? ce.rows : 1, 4), "loss.grad_output"},
        {a.dx != nullptr ? MatrixView::of(a.dx, ce.rows, a.hidden, a.dx_stride) : MatrixView{}, "dx"},
        {a.dweight != nullptr ? MatrixView::of(a.dweight, ce.vocab, a.hidden, 0) : MatrixView{}, "dweight"},
        {vector_view(a.dbias, ce.vocab, 4), "dbias"},
        v[0], v[1], v[2], v[3], v[4], v[5]};
    TIGON_CHECK(check::buffers_disjoint(stats, all, kOp));
  }
  const detail::LceLayout l = detail::lce_layout(a);
  const std::int64_t tokens = ce.rows, vocab = ce.vocab, hidden = a.hidden;
  const std::int64_t xs = a.x_stride ? a.x_stride : hidden;
  const bool want_grad = a.dx != nullptr || a.dweight != nullptr || a.dbias != nullptr;
  auto* lbase = static_cast<unsigned char*>(a.workspace);
  const detail::CeScratch scratch = detail::ce_scratch(lbase, tokens);
  T* logits = reinterpret_cast<T*>(lbase + l.logits_offset);
  T* ones = reinterpret_cast<T*>(lbase + l.ones_offset);
  T* bias_slot = reinterpret_cast<T*>(lbase + l.bias_offset);
  const T* bias = detail::epilogue_bias_ptr(a.bias, bias_slot);
  auto* gathered = reinterpret_cast<CrossEntropyStats*>(base);
  auto* merged = reinterpret_cast<CrossEntropyStats*>(
      base + round_up<std::size_t>(static_cast<std::size_t>(ranks) * l.chunk * sizeof(CrossEntropyStats), 256));
  // Every chunk's products checked with the back end before anything is written or communicated.
  for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
    const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
    TIGON_CHECK(detail::lce_chunk<false>(gemm, ce, a.x + r0 * xs, xs, a.weight, bias, hidden, r0, c, logits, ones,
                                         scratch, want_grad, a.dx != nullptr ? a.dx + r0 * hidden : nullptr, hidden,
                                         0.0f, a.dweight, a.dbias, 1.0f, stream, kOp));
  }
  cudaEvent_t dx_ready = nullptr, reduced = nullptr;
  const bool overlap = comm_stream != nullptr && comm_stream != stream && a.dx != nullptr;
  if (overlap) {
    TIGON_CHECK(Status::from_cuda(cudaEventCreateWithFlags(&dx_ready, cudaEventDisableTiming), kOp, "cudaEventCreate"));
    const Status e = Status::from_cuda(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming), kOp, "cudaEventCreate");
    if (!e.ok()) {
      cudaEventDestroy(dx_ready);
      return e;
    }
  }
  auto body = [&]() -> Status {
    if (ce.reduction == Reduction::mean) {
      TIGON_CHECK(detail::ce_denominator(ce.targets, tokens, ce.ignore_index, static_cast<const float*>(nullptr),
                                         shard.total_vocab, scratch.denom, stream, kOp));
    }
    if (a.dbias != nullptr) TIGON_CHECK(detail::fill_ones(ones, l.chunk, stream, kOp));
    TIGON_CHECK(detail::epilogue_bias_copy(a.bias, vocab, bias_slot, stream, kOp));
    for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
      const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
      const T* xc = a.x + r0 * xs;
      auto run = [&](const auto& g) { return detail::gemm_run_or_check<true>(gemm, g, stream); };
      TIGON_CHECK(run(GemmArgs<T>{.a = xc, .b = a.weight, .d = logits, .bias = bias, .m = c, .n = vocab, .k = hidden,
                                  .lda = xs, .op_b = Op::t}));
      // This shard's statistics of the chunk's rows, gathered from every rank, merged in rank order.
      auto p = detail::ce_params(ce);
      p.x = logits;
      p.xs = vocab;
      p.rows = c;
      p.targets = ce.targets + r0;
      p.col0 = shard.vocab_offset;
      p.total_vocab = shard.total_vocab;
      p.weights = ce.class_weights != nullptr ? ce.class_weights - shard.vocab_offset : nullptr;
      auto ps = p;
      ps.dx = nullptr;
      ps.stats_out = gathered + static_cast<std::int64_t>(rank) * c;
      ps.loss_rows = nullptr;
      ps.lse = nullptr;
      ps.argmax = nullptr;
      TIGON_CHECK(detail::run_ce_rows<P>(ps, stream, kOp));
      const std::size_t row_bytes = static_cast<std::size_t>(c) * sizeof(CrossEntropyStats);
      TIGON_CHECK(detail::from_nccl(ncclAllGather(reinterpret_cast<unsigned char*>(gathered) + rank * row_bytes,
                                                  gathered, row_bytes, ncclUint8, comm, stream),
                                    kOp, "ncclAllGather"));
      TIGON_CHECK(cross_entropy_merge_stats(gathered, ranks, c, merged, stream));
      // The loss outputs of the chunk's rows (the same on every rank) and this shard's gradient
      // columns, in place over the logits.
      auto pf = p;
      pf.dx = want_grad ? logits : nullptr;
      pf.dxs = vocab;
      pf.stats = merged;
      pf.denom = scratch.denom;
      pf.loss_rows = (ce.loss_rows != nullptr ? ce.loss_rows : scratch.loss_rows) + r0;
      pf.z_rows = scratch.z_rows + r0;
      if (ce.lse != nullptr) pf.lse = ce.lse + r0;
      if (ce.argmax != nullptr) pf.argmax = ce.argmax + r0;
      if (ce.grad_output != nullptr && ce.reduction == Reduction::none) pf.grad_output = ce.grad_output + r0;
      TIGON_CHECK(detail::run_ce_rows<P>(pf, stream, kOp));
      if (!want_grad) continue;
      const float beta = (a.accumulate || r0 > 0) ? 1.0f : 0.0f;
      if (a.dx != nullptr) {
        T* dxc = a.dx + r0 * hidden;
        TIGON_CHECK(run(GemmArgs<T>{.a = logits, .b = a.weight, .d = dxc, .m = c, .n = hidden, .k = vocab}));
        cudaStream_t cs = stream;
        if (overlap) {
          TIGON_CHECK(Status::from_cuda(cudaEventRecord(dx_ready, stream), kOp, "cudaEventRecord"));
          TIGON_CHECK(Status::from_cuda(cudaStreamWaitEvent(comm_stream, dx_ready, 0), kOp, "cudaStreamWaitEvent"));
          cs = comm_stream;
        }
        TIGON_CHECK(detail::from_nccl(ncclAllReduce(dxc, dxc, static_cast<std::size_t>(c * hidden),
                                                    detail::nccl_type<T>(), ncclSum, comm, cs),
                                      kOp, "ncclAllReduce"));
        if (overlap) TIGON_CHECK(Status::from_cuda(cudaEventRecord(reduced, comm_stream), kOp, "cudaEventRecord"));
      }
      if (a.dweight != nullptr) {
        TIGON_CHECK(run(GemmArgs<T, float>{.a = logits, .b = xc, .c = a.dweight, .d = a.dweight, .m = vocab,
                                           .n = hidden, .k = c, .ldb = xs, .op_a = Op::t, .beta = beta}));
      }
      if (a.dbias != nullptr) {
        TIGON_CHECK(run(GemmArgs<T, float>{.a = ones, .b = logits, .c = a.dbias, .d = a.dbias, .m = 1, .n = vocab,
                                           .k = c, .beta = beta}));
      }
      // The next chunk's logits overwrite the gradient columns the products above read: stream order.
    }
    if (overlap) TIGON_CHECK(Status::from_cuda(cudaStreamWaitEvent(stream, reduced, 0), kOp, "cudaStreamWaitEvent"));
    if (ce.reduction != Reduction::none) {
      TIGON_CHECK(detail::ce_reduce(ce.loss_rows != nullptr ? ce.loss_rows : scratch.loss_rows, scratch.z_rows,
                                    tokens, scratch.denom, ce.reduction == Reduction::mean, ce.loss, ce.z_loss,
                                    stream, kOp));
    }
    return Status();
  };
  const Status st = body();
  if (overlap) {
    cudaEventDestroy(dx_ready);
    cudaEventDestroy(reduced);
  }
  return st;
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
