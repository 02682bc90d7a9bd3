// tigon/loss/linear_cross_entropy.cuh - the LM head's loss, CE(x W^T + b, y), without the
// [tokens x vocabulary] logits: tokens are processed in chunks, and per chunk
//
//   logits = x_c W^T            one GEMM into a [chunk, vocab] buffer (bias added by the loss kernel)
//   loss kernel                 the cross-entropy kernel overwrites the chunk with dlogits
//   dx_c   = dlogits W          GEMM
//   dW    += dlogits^T x_c      GEMM accumulating in fp32 (beta = 1 after the first chunk)
//   db    += 1^T dlogits        GEMM against a vector of ones, fp32
//
// Every cross-entropy option (ignore_index, smoothing, z-loss, softcap, class weights, reductions,
// upstream gradients, lse, argmax) comes from composing the cross-entropy op's pieces: one
// denominator over all tokens, the cross-entropy kernels per chunk (detail::cross_entropy_chunk),
// one reduction at the end. The GEMM back end
// is a template parameter (CublasLtGemm by default). Extra device memory: one logits chunk
// (chunk x vocab x sizeof(T)), a ones vector, and 8 bytes per token — what
// linear_cross_entropy_workspace_bytes() returns.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../blas/gemm.cuh"
#include "../core/config.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "cross_entropy.cuh"

TIGON_NAMESPACE_BEGIN

template <class T, class I = std::int64_t>
struct LinearCrossEntropyArgs {
  const T* x = nullptr;       // [tokens, hidden], row stride x_stride (0: hidden)
  std::int64_t x_stride = 0;
  const T* weight = nullptr;  // [vocab, hidden], contiguous
  const T* bias = nullptr;    // [vocab], or null
  std::int64_t hidden = 0;
  // The loss: targets, rows (= tokens), vocab, every option and every output of cross-entropy.
  // Its logits, dlogits and workspace belong to this op and must stay null.
  CrossEntropyArgs<T, I> loss;
  // Gradients, each optional (all null: forward only).
  T* dx = nullptr;  // [tokens, hidden], row stride dx_stride (0: hidden)
  std::int64_t dx_stride = 0;
  float* dweight = nullptr;  // [vocab, hidden] fp32
  float* dbias = nullptr;    // [vocab] fp32
  bool accumulate = false;   // dweight / dbias += the gradient instead of =
  std::int64_t chunk = 0;    // tokens per chunk; 0: linear_cross_entropy_default_chunk()
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Default chunk: about 1 GiB of logits, a multiple of 128 tokens, at most all of them.
inline std::int64_t linear_cross_entropy_default_chunk(std::int64_t tokens, std::int64_t vocab,
                                                       std::size_t elem_bytes) {
  return rows_per_chunk(tokens, vocab, elem_bytes, std::size_t{1} << 30);
}

namespace detail {

struct LceLayout {
  std::int64_t chunk;
  std::size_t ce_bytes, logits_offset, ones_offset, total;
};

template <class T, class I>
LceLayout lce_layout(const LinearCrossEntropyArgs<T, I>& a) {
  LceLayout l{};
  const std::int64_t tokens = a.loss.rows, vocab = a.loss.vocab;
  l.chunk = a.chunk > 0 ? (a.chunk < tokens ? a.chunk : tokens)
                        : linear_cross_entropy_default_chunk(tokens, vocab, sizeof(T));
  l.ce_bytes = ce_workspace_bytes(tokens);
  l.logits_offset = l.ce_bytes;
  l.ones_offset = l.logits_offset + round_up<std::size_t>(static_cast<std::size_t>(l.chunk * vocab) * sizeof(T), 256);
  l.total = l.ones_offset + (a.dbias != nullptr ? round_up<std::size_t>(l.chunk * sizeof(T), 256) : 0);
  return l;
}

template <class T, class I>
Status validate(const LinearCrossEntropyArgs<T, I>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.weight, op, "weight"));
  TIGON_CHECK(positive(a.hidden, op, "hidden"));
  TIGON_CHECK(validate_options(a.loss, op));
  TIGON_CHECK(row_stride(a.x_stride, a.hidden, op, "x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.hidden, op, "dx_stride"));
  if (a.loss.logits != nullptr || a.loss.dlogits != nullptr || a.loss.workspace != nullptr) {
    return Status::error(Errc::invalid_value, op, "loss.logits",
                         "the loss's logits, dlogits and workspace belong to the op: leave them null");
  }
  if (a.chunk < 0) return Status::error(Errc::invalid_size, op, "chunk", "must be >= 0");
  const MatrixView x = MatrixView::of(a.x, a.loss.rows, a.hidden, a.x_stride);
  const MatrixView w = MatrixView::of(a.weight, a.loss.vocab, a.hidden, 0);
  if (a.dx != nullptr) {
    const MatrixView dx = MatrixView::of(a.dx, a.loss.rows, a.hidden, a.dx_stride);
    TIGON_CHECK(disjoint(dx, x, op, "dx", "x"));
    TIGON_CHECK(disjoint(dx, w, op, "dx", "weight"));
  }
  if (a.dweight != nullptr) {
    const MatrixView dw = MatrixView::of(a.dweight, a.loss.vocab, a.hidden, 0);
    TIGON_CHECK(disjoint(dw, x, op, "dweight", "x"));
    TIGON_CHECK(disjoint(dw, w, op, "dweight", "weight"));
  }
  return Status();
}

}  // namespace detail

// Bytes of workspace linear_cross_entropy(args) needs: one logits chunk, the loss's per-token
// scratch, and (with dbias) a vector of ones.
template <class T, class I>
[[nodiscard]] Status linear_cross_entropy_workspace_bytes(const LinearCrossEntropyArgs<T, I>& args,
                                                          std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "linear_cross_entropy_workspace_bytes"));
  bytes = detail::lce_layout(args).total;
  return Status();
}

#if defined(__CUDACC__)

// The loss over all tokens, with the gradients asked for, one chunk of tokens at a time.
template <class Gemm = CublasLtGemm, class T, class I>
[[nodiscard]] Status linear_cross_entropy(const LinearCrossEntropyArgs<T, I>& args, Gemm& gemm,
                                          cudaStream_t stream) {
  constexpr const char* kOp = "linear_cross_entropy";
  TIGON_CHECK(detail::validate(args, kOp));
  const detail::LceLayout l = detail::lce_layout(args);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, l.total, kOp));
  const CrossEntropyArgs<T, I>& ce = args.loss;
  const std::int64_t tokens = ce.rows, vocab = ce.vocab, hidden = args.hidden;
  const std::int64_t xs = args.x_stride ? args.x_stride : hidden;
  const std::int64_t dxs = args.dx_stride ? args.dx_stride : hidden;
  const bool want_grad = args.dx != nullptr || args.dweight != nullptr || args.dbias != nullptr;
  auto* base = static_cast<unsigned char*>(args.workspace);
  const detail::CeScratch scratch = detail::ce_scratch(base, tokens);
  T* logits = reinterpret_cast<T*>(base + l.logits_offset);
  T* ones = reinterpret_cast<T*>(base + l.ones_offset);

  if (ce.reduction == Reduction::mean) {
    TIGON_CHECK(detail::ce_denominator(ce.targets, tokens, ce.ignore_index, ce.class_weights, vocab,
                                       scratch.denom, stream, kOp));
  }
  if (args.dbias != nullptr) {
    TIGON_CHECK(detail::fill_ones(ones, l.chunk, stream, kOp));
  }
  for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
    const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
    const T* xc = args.x + r0 * xs;
    TIGON_CHECK(gemm.gemm(GemmArgs<T>{.a = xc, .b = args.weight, .d = logits, .m = c, .n = vocab,
                                      .k = hidden, .lda = xs, .op_b = Op::t},
                          stream));
    // The loss over this chunk (gradient in place), against the denominator of all tokens.
    TIGON_CHECK(detail::cross_entropy_chunk(ce, logits, args.bias, r0, c, want_grad, scratch, stream, kOp));
    if (!want_grad) continue;
    const float beta = (args.accumulate || r0 > 0) ? 1.0f : 0.0f;
    if (args.dx != nullptr) {
      TIGON_CHECK(gemm.gemm(GemmArgs<T>{.a = logits, .b = args.weight, .d = args.dx + r0 * dxs, .m = c,
                                        .n = hidden, .k = vocab, .ldd = dxs},
                            stream));
    }
    if (args.dweight != nullptr) {
      TIGON_CHECK(gemm.gemm(GemmArgs<T, float>{.a = logits, .b = xc, .c = args.dweight, .d = args.dweight,
                                               .m = vocab, .n = hidden, .k = c, .ldb = xs,
                                               .op_a = Op::t, .beta = beta},
                            stream));
    }
    if (args.dbias != nullptr) {
      TIGON_CHECK(gemm.gemm(GemmArgs<T, float>{.a = ones, .b = logits, .c = args.dbias, .d = args.dbias,
                                               .m = 1, .n = vocab, .k = c, .beta = beta},
                            stream));
    }
  }
  if (ce.reduction != Reduction::none) {
    TIGON_CHECK(detail::ce_reduce(ce.loss_rows != nullptr ? ce.loss_rows : scratch.loss_rows, scratch.z_rows,
                                  tokens, scratch.denom, ce.reduction == Reduction::mean, ce.loss, ce.z_loss,
                                  stream, kOp));
  }
  return Status();
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
