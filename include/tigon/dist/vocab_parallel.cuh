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
// Linking: NCCL (libnccl and nccl.h, shipped with the CUDA toolkit and with the nvidia-nccl wheels);
// in this project's build tree, the tigon::dist target.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../loss/cross_entropy.cuh"

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

#endif  // __CUDACC__

TIGON_NAMESPACE_END
