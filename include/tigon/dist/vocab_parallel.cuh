// tigon/dist/vocab_parallel.cuh - cross-entropy over a vocabulary split across the ranks of an NCCL
// communicator (a tensor-parallel LM head): each rank holds the logits of its columns
// [vocab_offset, vocab_offset + vocab) of a total_vocab-wide vocabulary for the same rows and the
// same targets (global column indices). One call per rank, on its own device and stream:
//
//   1. cross_entropy_shard_stats: per row, this shard's max, sum of exp, the target's logit and
//      weight when the target is in the shard, the smoothing sums and (when asked for) the argmax;
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

inline Status comm_shape(ncclComm_t comm, const char* op, int& ranks, int& rank) {
  TIGON_CHECK(check::not_null(comm, op, "comm"));
  TIGON_CHECK(from_nccl(ncclCommCount(comm, &ranks), op, "ncclCommCount"));
  TIGON_CHECK(from_nccl(ncclCommUserRank(comm, &rank), op, "ncclCommUserRank"));
  return Status();
}

// The checks of a shard that need no communicator (`prefixed`: the loss's arguments are named
// loss.*, as in the linear op).
template <class T, class I>
Status check_vocab_shard(const CrossEntropyArgs<T, I>& ce, const VocabShard& shard, bool prefixed, const char* op) {
  if (ce.rows <= 0) return Status::error(Errc::invalid_size, op, prefixed ? "loss.rows" : "rows", "must be positive");
  if (shard.vocab_offset < 0 || ce.vocab <= 0 || shard.vocab_offset + ce.vocab > shard.total_vocab) {
    return Status::error(Errc::invalid_size, op, "shard", "the shard must lie inside total_vocab");
  }
  if (ce.class_weights != nullptr && ce.reduction == Reduction::mean) {
    return Status::error(Errc::unsupported, op, prefixed ? "loss.class_weights" : "class_weights",
                         "the mean over class weights needs the full weight vector: use "
                         "reduction sum and divide by the weight total");
  }
  return Status();
}

// A workspace: the op's own part first (`own` bytes), then the statistics of `rows` rows gathered
// from every rank ([ranks][rows]) and merged ([rows]).
struct VocabParallelLayout {
  std::size_t gathered, merged, total;
};
inline VocabParallelLayout vocab_parallel_layout(std::size_t own, std::int64_t rows, int ranks) {
  const auto row_bytes = static_cast<std::size_t>(rows) * sizeof(CrossEntropyStats);
  VocabParallelLayout l;
  l.gathered = round_up<std::size_t>(own, 256);
  l.merged = l.gathered + round_up<std::size_t>(static_cast<std::size_t>(ranks) * row_bytes, 256);
  l.total = l.merged + round_up<std::size_t>(row_bytes, 256);
  return l;
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
  bytes = detail::vocab_parallel_layout(detail::ce_workspace_bytes(args.rows), args.rows, ranks).total;
  return Status();
}

// Bytes of workspace vocab_parallel_linear_cross_entropy(args, ...) needs on `ranks` ranks.
template <class T, class I, class G>
[[nodiscard]] Status vocab_parallel_linear_cross_entropy_workspace_bytes(const LinearCrossEntropyArgs<T, I, G>& args,
                                                                         int ranks, std::size_t& bytes) {
  constexpr const char* kOp = "vocab_parallel_linear_cross_entropy_workspace_bytes";
  bytes = 0;
  TIGON_CHECK(check::positive(args.loss.rows, kOp, "loss.rows"));
  TIGON_CHECK(check::positive(args.loss.vocab, kOp, "loss.vocab"));
  TIGON_CHECK(check::positive(ranks, kOp, "ranks"));
  const detail::LceLayout l = detail::lce_layout(args);
  bytes = detail::vocab_parallel_layout(l.total, l.chunk, ranks).total;
  return Status();
}

#if defined(__CUDACC__)

// The cross-entropy of this rank's shard, as described above. args: this shard's logits [rows,
// vocab] (and dlogits, the gradient's slice), the targets, the options and the outputs, as for
// cross_entropy; args.workspace is ignored (the call's is `workspace`, 16-byte aligned,
// vocab_parallel_cross_entropy_workspace_bytes() long). Class weights: this shard's slice, under
// reduction sum or none.
template <class P = CrossEntropyPolicy, class T, class I>
[[nodiscard]] Status vocab_parallel_cross_entropy(const CrossEntropyArgs<T, I>& args, const VocabShard& shard,
                                                  ncclComm_t comm, void* workspace, std::size_t workspace_bytes,
                                                  cudaStream_t stream) {
  constexpr const char* kOp = "vocab_parallel_cross_entropy";
  TIGON_CHECK(detail::check_vocab_shard(args, shard, false, kOp));
  int ranks = 0, rank = 0;
  TIGON_CHECK(detail::comm_shape(comm, kOp, ranks, rank));
  const detail::VocabParallelLayout l =
      detail::vocab_parallel_layout(detail::ce_workspace_bytes(args.rows), args.rows, ranks);
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, l.total, kOp));
  auto* base = static_cast<unsigned char*>(workspace);
  auto* gathered = reinterpret_cast<CrossEntropyStats*>(base + l.gathered);
  auto* merged = reinterpret_cast<CrossEntropyStats*>(base + l.merged);
  CrossEntropyArgs<T, I> a = args;
  a.workspace = workspace;  // the finalize's part first; the whole workspace against every buffer
  a.workspace_bytes = workspace_bytes;
  TIGON_CHECK(detail::validate(a, kOp, nullptr, nullptr, l.total));
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

// The linear op's chunk steps (lce_chunk): the chunk's statistics over this shard, their all-gather
// and merge, the finalize; after dx_c's product its all-reduce over the ranks, on comm_stream (after
// dx_ready) when overlapping.
template <class P>
struct VocabParallelChunkSteps {
  VocabShard shard;
  ncclComm_t comm;
  int ranks, rank;
  CrossEntropyStats* gathered;
  CrossEntropyStats* merged;
  std::int64_t hidden;
  cudaStream_t comm_stream;  // null: the all-reduce on the call's stream
  cudaEvent_t dx_ready, reduced;

  template <class T, class I>
  Status loss(const CrossEntropyArgs<T, I>& ce, T* logits, std::int64_t r0, std::int64_t c, bool grad,
              const CeScratch& scratch, cudaStream_t stream, const char* op) const {
    const CeChunkShard stats{shard.vocab_offset, shard.total_vocab, nullptr, gathered + rank * c};
    TIGON_CHECK(cross_entropy_chunk<P>(ce, logits, r0, c, false, scratch, stream, op, &stats));
    const std::size_t row_bytes = static_cast<std::size_t>(c) * sizeof(CrossEntropyStats);
    TIGON_CHECK(from_nccl(ncclAllGather(reinterpret_cast<unsigned char*>(gathered) + rank * row_bytes, gathered,
                                        row_bytes, ncclUint8, comm, stream),
                          op, "ncclAllGather"));
    TIGON_CHECK(cross_entropy_merge_stats(gathered, ranks, c, merged, stream));
    const CeChunkShard fin{shard.vocab_offset, shard.total_vocab, merged, nullptr};
    return cross_entropy_chunk<P>(ce, logits, r0, c, grad, scratch, stream, op, &fin);
  }

  template <class T>
  Status after_dx(T* dxc, std::int64_t c, cudaStream_t stream, const char* op) const {
    cudaStream_t s = stream;
    if (comm_stream != nullptr) {
      TIGON_CHECK(Status::from_cuda(cudaEventRecord(dx_ready, stream), op, "cudaEventRecord"));
      TIGON_CHECK(Status::from_cuda(cudaStreamWaitEvent(comm_stream, dx_ready, 0), op, "cudaStreamWaitEvent"));
      s = comm_stream;
    }
    TIGON_CHECK(from_nccl(ncclAllReduce(dxc, dxc, static_cast<std::size_t>(c * hidden), nccl_type<T>(), ncclSum,
                                        comm, s),
                          op, "ncclAllReduce"));
    if (comm_stream != nullptr) TIGON_CHECK(Status::from_cuda(cudaEventRecord(reduced, comm_stream), op, "cudaEventRecord"));
    return Status();
  }
};

}  // namespace detail

// The linear cross-entropy of a tensor-parallel LM head, as described at the top. args: as for
// linear_cross_entropy, with weight (and bias, dweight, dbias) this rank's rows [vocab, hidden] of the
// head, loss.vocab this rank's columns, loss.targets global columns, dx the whole [tokens, hidden]
// gradient (contiguous rows: the all-reduce reads them as one range), args.workspace ignored (the
// call's is `workspace`). comm_stream: a second stream for dx's all-reduce (null: the call's stream);
// the call's stream waits for it before returning. Class weights: this rank's slice, under reduction
// sum or none. The all-gathers and all-reduces are issued in the same order on every rank.
template <class Gemm = CublasLtGemm, class P = CrossEntropyPolicy, class T, class I, class G>
[[nodiscard]] Status vocab_parallel_linear_cross_entropy(const LinearCrossEntropyArgs<T, I, G>& args,
                                                         const VocabShard& shard, ncclComm_t comm, Gemm& gemm,
                                                         void* workspace, std::size_t workspace_bytes,
                                                         cudaStream_t stream, cudaStream_t comm_stream = nullptr) {
  constexpr const char* kOp = "vocab_parallel_linear_cross_entropy";
  const CrossEntropyArgs<T, I>& ce = args.loss;
  TIGON_CHECK(detail::check_vocab_shard(ce, shard, true, kOp));
  if (args.dx != nullptr && args.dx_stride != 0 && args.dx_stride != args.hidden) {
    return Status::error(Errc::unsupported, kOp, "dx_stride", "dx's rows must be contiguous (the all-reduce)");
  }
  int ranks = 0, rank = 0;
  TIGON_CHECK(detail::comm_shape(comm, kOp, ranks, rank));
  LinearCrossEntropyArgs<T, I, G> a = args;
  a.workspace = workspace;  // linear_cross_entropy's part first; the whole workspace against every buffer
  a.workspace_bytes = workspace_bytes;
  const detail::LceLayout l = detail::lce_layout(a);
  const detail::VocabParallelLayout vl = detail::vocab_parallel_layout(l.total, l.chunk, ranks);
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, vl.total, kOp));
  TIGON_CHECK(detail::validate(a, kOp, vl.total));
  const std::int64_t tokens = ce.rows, vocab = ce.vocab, hidden = a.hidden;
  const std::int64_t xs = a.x_stride ? a.x_stride : hidden;
  const bool want_grad = a.dx != nullptr || a.dweight != nullptr || a.dbias != nullptr;
  auto* base = static_cast<unsigned char*>(workspace);
  const detail::CeScratch scratch = detail::ce_scratch(base, tokens);
  T* logits = reinterpret_cast<T*>(base + l.logits_offset);
  T* ones = reinterpret_cast<T*>(base + l.ones_offset);
  T* bias_slot = reinterpret_cast<T*>(base + l.bias_offset);
  const T* bias = detail::epilogue_bias_ptr(a.bias, bias_slot);
  const bool overlap = comm_stream != nullptr && comm_stream != stream && a.dx != nullptr;
  detail::VocabParallelChunkSteps<P> steps{shard,
                                           comm,
                                           ranks,
                                           rank,
                                           reinterpret_cast<CrossEntropyStats*>(base + vl.gathered),
                                           reinterpret_cast<CrossEntropyStats*>(base + vl.merged),
                                           hidden,
                                           overlap ? comm_stream : nullptr,
                                           nullptr,
                                           nullptr};
  // Every chunk's products checked with the back end (kRun false) before anything is written or
  // communicated, then run.
  auto chunks = [&](auto run_c) {
    for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
      const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
      const float beta = (a.accumulate || r0 > 0) ? 1.0f : 0.0f;
      TIGON_CHECK(detail::lce_chunk<decltype(run_c)::value>(
          gemm, ce, a.x + r0 * xs, xs, a.weight, bias, hidden, r0, c, logits, ones, scratch, want_grad,
          a.dx != nullptr ? a.dx + r0 * hidden : nullptr, hidden, 0.0f, a.dweight, a.dbias, beta, stream, kOp, steps));
    }
    return Status();
  };
  TIGON_CHECK(chunks(std::false_type{}));
  if (overlap) {
    TIGON_CHECK(Status::from_cuda(cudaEventCreateWithFlags(&steps.dx_ready, cudaEventDisableTiming), kOp,
                                  "cudaEventCreate"));
    const Status e =
        Status::from_cuda(cudaEventCreateWithFlags(&steps.reduced, cudaEventDisableTiming), kOp, "cudaEventCreate");
    if (!e.ok()) {
      cudaEventDestroy(steps.dx_ready);
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
    TIGON_CHECK(chunks(std::true_type{}));
    if (overlap) {
      TIGON_CHECK(Status::from_cuda(cudaStreamWaitEvent(stream, steps.reduced, 0), kOp, "cudaStreamWaitEvent"));
    }
    if (ce.reduction != Reduction::none) {
      TIGON_CHECK(detail::ce_reduce(ce.loss_rows != nullptr ? ce.loss_rows : scratch.loss_rows, scratch.z_rows,
                                    tokens, scratch.denom, ce.reduction == Reduction::mean, ce.loss, ce.z_loss,
                                    stream, kOp));
    }
    return Status();
  };
  const Status st = body();
  if (overlap) {
    cudaEventDestroy(steps.dx_ready);
    cudaEventDestroy(steps.reduced);
  }
  return st;
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
