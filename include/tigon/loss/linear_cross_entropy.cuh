// tigon/loss/linear_cross_entropy.cuh - the LM head's loss, CE(x W^T + b, y), without the
// [tokens x vocabulary] logits: tokens are processed in chunks, and per chunk
//
//   logits = x_c W^T + b        one GEMM into a [chunk, vocab] buffer (the bias added in its epilogue,
//                               before the one rounding to T, as F.linear does)
//   loss kernel                 the cross-entropy kernel overwrites the chunk with dlogits
//   dx_c   = dlogits W          GEMM
//   dW    += dlogits^T x_c      GEMM accumulating (beta = 1 after the first chunk)
//   db    += 1^T dlogits        GEMM against a vector of ones
//
// The weight gradients' type G is the args' third template parameter: float (the default) keeps dW
// and db in fp32 across the chunks; T (bfloat16 / half, the weight's own dtype, as Liger's and
// PyTorch's heads hold it) has each chunk's GEMM add into them and round once, so no fp32 copy of
// [vocab, hidden] exists beside the gradient the optimizer reads (one rounding per chunk).
//
// Every cross-entropy option (ignore_index, smoothing, z-loss, softcap, class weights, reductions,
// upstream gradients, lse, argmax) comes from composing the cross-entropy op's pieces: one
// denominator over all tokens, the cross-entropy kernels per chunk (detail::cross_entropy_chunk),
// one reduction at the end. The GEMM back end is a template parameter (CublasLtGemm by default; a
// back end serves GemmArgs::bias). Extra device memory: one logits chunk (chunk x vocab x
// sizeof(T)), 8 bytes per token, with a bias gradient a ones vector, and with a bias a 16-byte
// aligned copy of it (used when the caller's is not aligned) — what
// linear_cross_entropy_workspace_bytes() returns.
//
// linear_cross_entropy_heads(): K heads W_k (Medusa's extra LM heads, each predicting a token further
// ahead) over the same x in one call: per chunk of tokens every head's logits, loss and gradients in
// turn (the chunk of x read by each head's GEMMs while it is in L2), dx accumulated over the heads.
// loss = sum_k head_weight_k * CE_k, each CE_k reduced over its own targets.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../blas/gemm.cuh"
#include "../core/config.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "cross_entropy.cuh"

TIGON_NAMESPACE_BEGIN

template <class T, class I = std::int64_t, class G = float>
struct LinearCrossEntropyArgs {
  static_assert(head_grad_type_ok<T, G>, "the weight gradients are float or the weight's type");
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
  G* dweight = nullptr;       // [vocab, hidden]
  G* dbias = nullptr;         // [vocab]
  bool accumulate = false;    // dweight / dbias += the gradient instead of =
  std::int64_t chunk = 0;     // tokens per chunk; 0: linear_cross_entropy_default_chunk()
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// K heads over the same x (linear_cross_entropy_heads). The pointer arrays are host arrays of `heads`
// device pointers, read at the call (so a captured graph keeps the pointers of its capture).
inline constexpr int kMaxLceHeads = 32;
template <class T, class I = std::int64_t, class G = float>
struct LinearCrossEntropyHeadsArgs {
  static_assert(head_grad_type_ok<T, G>, "the weight gradients are float or the weight's type");
  const T* x = nullptr;  // [tokens, hidden], row stride x_stride (0: hidden)
  std::int64_t x_stride = 0;
  std::int64_t hidden = 0;
  int heads = 0;                         // 1 to kMaxLceHeads
  const T* const* weights = nullptr;     // [heads] -> [vocab, hidden], contiguous
  const T* const* biases = nullptr;      // [heads] -> [vocab] or null; the array itself may be null
  const float* head_weights = nullptr;   // host [heads]: each head's factor in the loss (null: 1)
  // The options and outputs of every head's loss. loss.targets is [heads][rows] (head k's targets at
  // loss.targets + k * targets_stride); loss.loss and loss.z_loss are the weighted sums over the
  // heads; loss.loss_rows (reduction none or not) is [heads][rows]; loss.lse and loss.argmax are
  // [heads][rows]; grad_output is one value (mean / sum) or [heads][rows] (none); error_count counts
  // every head's bad targets. Its logits, dlogits and workspace stay null.
  CrossEntropyArgs<T, I> loss;
  std::int64_t targets_stride = 0;       // 0: rows
  float* head_losses = nullptr;          // device [heads], each head's reduced loss (unweighted), or null
  // Gradients, each optional.
  T* dx = nullptr;                       // [tokens, hidden], the sum over the heads
  std::int64_t dx_stride = 0;
  G* const* dweights = nullptr;          // [heads] -> [vocab, hidden] (entries may be null)
  G* const* dbiases = nullptr;           // [heads] -> [vocab] (entries may be null)
  bool accumulate = false;               // dweights / dbiases += instead of =
  std::int64_t chunk = 0;                // tokens per chunk; 0: linear_cross_entropy_heads_default_chunk()
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Default chunk: about 1 GiB of logits, a multiple of 128 tokens, at most all of them.
inline std::int64_t linear_cross_entropy_default_chunk(std::int64_t tokens, std::int64_t vocab,
                                                       std::size_t elem_bytes) {
  return rows_per_chunk(tokens, vocab, elem_bytes, std::size_t{1} << 30);
}

// Default chunk of several heads: 512 tokens (at most the single head's default). Every chunk adds its
// product into each head's weight gradient (a GEMM with K = chunk and beta = 1, reading and writing the
// [vocab, hidden] gradient), which does chunk / 2 FLOPs per byte: at 512, about the bf16 balance of
// an H100 or H200, so a smaller chunk makes those GEMMs memory-bound while a larger one only adds
// logits memory beside K weight gradients.
inline constexpr std::int64_t kLceHeadsChunk = 512;
inline std::int64_t linear_cross_entropy_heads_default_chunk(std::int64_t tokens, std::int64_t vocab,
                                                             std::size_t elem_bytes) {
  const std::int64_t c = linear_cross_entropy_default_chunk(tokens, vocab, elem_bytes);
  return c < kLceHeadsChunk ? c : kLceHeadsChunk;
}

namespace detail {

struct LceLayout {
  std::int64_t chunk;
  std::size_t ce_bytes, logits_offset, ones_offset, bias_offset, total;
};

template <class T, class I, class G>
LceLayout lce_layout(const LinearCrossEntropyArgs<T, I, G>& a) {
  LceLayout l{};
  const std::int64_t tokens = a.loss.rows, vocab = a.loss.vocab;
  l.chunk = a.chunk > 0 ? (a.chunk < tokens ? a.chunk : tokens)
                        : linear_cross_entropy_default_chunk(tokens, vocab, sizeof(T));
  l.ce_bytes = ce_workspace_bytes(tokens);
  l.logits_offset = l.ce_bytes;
  l.ones_offset = l.logits_offset + round_up<std::size_t>(static_cast<std::size_t>(l.chunk * vocab) * sizeof(T), 256);
  l.bias_offset = l.ones_offset + (a.dbias != nullptr ? round_up<std::size_t>(l.chunk * sizeof(T), 256) : 0);
  l.total = l.bias_offset + (a.bias != nullptr ? round_up<std::size_t>(vocab * sizeof(T), 256) : 0);
  return l;
}

// workspace_used: the bytes of the workspace the call uses, or 0 for lce_layout(a).total (an op
// composed on this one passes the whole of its workspace).
template <class T, class I, class G>
Status validate(const LinearCrossEntropyArgs<T, I, G>& a, const char* op, std::size_t workspace_used = 0) {
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
  // Every buffer against every other (the workspace: the bytes the call uses).
  const CrossEntropyArgs<T, I>& l = a.loss;
  const std::int64_t rows = l.rows, vocab = l.vocab;
  const NamedView in[] = {{MatrixView::of(a.x, rows, a.hidden, a.x_stride), "x"},
                          {MatrixView::of(a.weight, vocab, a.hidden, 0), "weight"},
                          {vector_view(a.bias, vocab, sizeof(T)), "bias"},
                          {vector_view(l.targets, rows, sizeof(I)), "loss.targets"},
                          {vector_view(l.class_weights, vocab, 4), "loss.class_weights"},
                          {vector_view(l.grad_output, l.reduction == Reduction::none ? rows : 1, 4), "loss.grad_output"}};
  const auto v = ce_output_views(l, rows, true);
  const NamedView out[] = {
      {a.dx != nullptr ? MatrixView::of(a.dx, rows, a.hidden, a.dx_stride) : MatrixView{}, "dx"},
      {a.dweight != nullptr ? MatrixView::of(a.dweight, vocab, a.hidden, 0) : MatrixView{}, "dweight"},
      {vector_view(a.dbias, vocab, sizeof(G)), "dbias"},
      v[0], v[1], v[2], v[3], v[4], v[5],
      {vector_view(a.workspace, static_cast<std::int64_t>(workspace_used > 0 ? workspace_used : lce_layout(a).total), 1),
       "workspace"}};
  return buffers_disjoint(out, in, op);
}

// The heads' layout: every head's cross-entropy scratch, one logits chunk, the ones vector, an
// aligned copy of each head's bias, and each head's reduced loss and z part.
struct LceHeadsLayout {
  std::int64_t chunk;
  std::size_t ce_bytes, logits_offset, ones_offset, bias_offset, heads_offset, total;
};

template <class T, class I, class G>
LceHeadsLayout lce_heads_layout(const LinearCrossEntropyHeadsArgs<T, I, G>& a) {
  LceHeadsLayout l{};
  const std::int64_t tokens = a.loss.rows, vocab = a.loss.vocab;
  l.chunk = a.chunk > 0 ? (a.chunk < tokens ? a.chunk : tokens)
                        : linear_cross_entropy_heads_default_chunk(tokens, vocab, sizeof(T));
  l.ce_bytes = ce_workspace_bytes(tokens);
  l.logits_offset = l.ce_bytes * static_cast<std::size_t>(a.heads);
  l.ones_offset = l.logits_offset + round_up<std::size_t>(static_cast<std::size_t>(l.chunk * vocab) * sizeof(T), 256);
  bool any_bias = false;
  for (int k = 0; a.dbiases != nullptr && k < a.heads; ++k) any_bias = any_bias || a.dbiases[k] != nullptr;
  l.bias_offset = l.ones_offset + (any_bias ? round_up<std::size_t>(l.chunk * sizeof(T), 256) : 0);
  const std::size_t bias_copies = a.biases != nullptr ? static_cast<std::size_t>(a.heads) : 0;
  l.heads_offset = l.bias_offset + bias_copies * round_up<std::size_t>(vocab * sizeof(T), 256);
  l.total = l.heads_offset + round_up<std::size_t>(2 * static_cast<std::size_t>(a.heads) * sizeof(float), 256);
  return l;
}

template <class T, class I, class G>
Status validate(const LinearCrossEntropyHeadsArgs<T, I, G>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(positive(a.hidden, op, "hidden"));
  if (a.heads < 1 || a.heads > kMaxLceHeads) {
    return Status::error(Errc::invalid_size, op, "heads", "must be in [1, " + std::to_string(kMaxLceHeads) + "]");
  }
  TIGON_CHECK(not_null(a.weights, op, "weights"));
  TIGON_CHECK(validate_options(a.loss, op));
  TIGON_CHECK(row_stride(a.x_stride, a.hidden, op, "x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.hidden, op, "dx_stride"));
  TIGON_CHECK(row_stride(a.targets_stride, a.loss.rows, op, "targets_stride"));
  if (a.loss.logits != nullptr || a.loss.dlogits != nullptr || a.loss.workspace != nullptr) {
    return Status::error(Errc::invalid_value, op, "loss.logits",
                         "the loss's logits, dlogits and workspace belong to the op: leave them null");
  }
  if (a.chunk < 0) return Status::error(Errc::invalid_size, op, "chunk", "must be >= 0");
  for (int k = 0; k < a.heads; ++k) {
    TIGON_CHECK(not_null(a.weights[k], op, "weights[k]"));
    if (a.head_weights != nullptr && !finite_bits(a.head_weights[k])) {
      return Status::error(Errc::invalid_value, op, "head_weights", "must be finite");
    }
  }
  // Every buffer against every other (the workspace: the bytes the call uses).
  const CrossEntropyArgs<T, I>& l = a.loss;
  const std::int64_t rows = l.rows, vocab = l.vocab, hr = a.heads * rows;
  const std::int64_t ts = a.targets_stride == 0 ? rows : a.targets_stride;
  std::vector<NamedView> in = {
      {MatrixView::of(a.x, rows, a.hidden, a.x_stride), "x"},
      {MatrixView::of(l.targets, a.heads, rows, ts), "loss.targets"},
      {vector_view(l.class_weights, vocab, 4), "loss.class_weights"},
      {vector_view(l.grad_output, l.reduction == Reduction::none ? hr : 1, 4), "loss.grad_output"}};
  std::vector<NamedView> out = {
      {a.dx != nullptr ? MatrixView::of(a.dx, rows, a.hidden, a.dx_stride) : MatrixView{}, "dx"},
      {vector_view(a.head_losses, a.heads, 4), "head_losses"},
      {vector_view(a.workspace, static_cast<std::int64_t>(lce_heads_layout(a).total), 1), "workspace"}};
  const auto v = ce_output_views(l, hr, true);
  out.insert(out.begin() + 1, v.begin(), v.end());
  for (int k = 0; k < a.heads; ++k) {
    in.push_back({MatrixView::of(a.weights[k], vocab, a.hidden, 0), "weights[k]"});
    if (a.biases != nullptr) in.push_back({vector_view(a.biases[k], vocab, sizeof(T)), "biases[k]"});
    if (a.dweights != nullptr && a.dweights[k] != nullptr) {
      out.push_back({MatrixView::of(a.dweights[k], vocab, a.hidden, 0), "dweights[k]"});
    }
    if (a.dbiases != nullptr) out.push_back({vector_view(a.dbiases[k], vocab, sizeof(G)), "dbiases[k]"});
  }
  return buffers_disjoint(out.data(), out.size(), in.data(), in.size(), op);
}

}  // namespace detail

// Bytes of workspace linear_cross_entropy(args) needs: one logits chunk, the loss's per-token
// scratch, with dbias a vector of ones, and with a bias room for its aligned copy.
template <class T, class I, class G>
[[nodiscard]] Status linear_cross_entropy_workspace_bytes(const LinearCrossEntropyArgs<T, I, G>& args,
                                                          std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "linear_cross_entropy_workspace_bytes"));
  bytes = detail::lce_layout(args).total;
  return Status();
}

// Bytes of workspace linear_cross_entropy_heads(args) needs: every head's per-token scratch (8 bytes a
// token), one logits chunk, a ones vector (with a bias gradient), room for an aligned copy of each
// head's bias (with biases) and 8 bytes a head.
template <class T, class I, class G>
[[nodiscard]] Status linear_cross_entropy_heads_workspace_bytes(const LinearCrossEntropyHeadsArgs<T, I, G>& args,
                                                                std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "linear_cross_entropy_heads_workspace_bytes"));
  bytes = detail::lce_heads_layout(args).total;
  return Status();
}

#if defined(__CUDACC__)

namespace detail {

// The heads' weighted sums of their reduced losses (and z parts): one thread, head order.
struct LceHeadFactors {
  float w[kMaxLceHeads];
};
template <int kDummy = 0>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void lce_heads_combine_kernel(const float* head_loss, const float* head_z, int heads,
                                           LceHeadFactors f, float* loss, float* z_loss) {
  grid_dependency_sync();
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  float l = 0.0f, z = 0.0f;
  for (int k = 0; k < heads; ++k) {
    l = fmaf(f.w[k], head_loss[k], l);
    z = fmaf(f.w[k], head_z[k], z);
  }
  if (loss != nullptr) loss[0] = l;
  if (z_loss != nullptr) z_loss[0] = z;
}

// What lce_chunk runs between its products: the loss over the chunk's logits (the gradient in place),
// and whatever follows dx_c's product (the vocabulary-parallel op reduces it over its ranks there).
// These are the single-device op's: cross_entropy_chunk, then nothing.
struct LceChunkSteps {
  template <class T, class I>
  Status loss(const CrossEntropyArgs<T, I>& ce, T* logits, std::int64_t r0, std::int64_t c, bool grad,
              const CeScratch& scratch, cudaStream_t stream, const char* op) const {
    return cross_entropy_chunk(ce, logits, r0, c, grad, scratch, stream, op);
  }
  template <class T>
  Status after_dx(T*, std::int64_t, cudaStream_t, const char*) const {
    return Status();
  }
};

// One head on one chunk of tokens [r0, r0 + c): logits = x_c W^T + bias into `logits` (bias 16-byte
// aligned, or null), the loss (gradient in place) against the denominator in `scratch`, then dx_c
// (beta dx_beta), dW and db (beta `beta`). kRun false: only asks the back end whether it can run
// each of the chunk's GEMMs (detail::gemm_check), launching nothing. `steps`: the loss and what
// follows dx_c (LceChunkSteps).
template <bool kRun, class Gemm, class T, class I, class G, class Steps = LceChunkSteps>
Status lce_chunk(Gemm& gemm, const CrossEntropyArgs<T, I>& ce, const T* xc, std::int64_t xs, const T* weight,
                 const T* bias, std::int64_t hidden, std::int64_t r0, std::int64_t c, T* logits, const T* ones,
                 const CeScratch& scratch, bool want_grad, T* dxc, std::int64_t dxs, float dx_beta, G* dweight,
                 G* dbias, float beta, cudaStream_t stream, const char* op, const Steps& steps = Steps{}) {
  auto run = [&](const auto& g) { return gemm_run_or_check<kRun>(gemm, g, stream); };
  const std::int64_t vocab = ce.vocab;
  TIGON_CHECK(run(GemmArgs<T>{.a = xc, .b = weight, .d = logits, .bias = bias, .m = c, .n = vocab, .k = hidden,
                              .lda = xs, .op_b = Op::t}));
  if constexpr (kRun) TIGON_CHECK(steps.loss(ce, logits, r0, c, want_grad, scratch, stream, op));
  if (!want_grad) return Status();
  if (dxc != nullptr) {
    TIGON_CHECK(run(GemmArgs<T>{.a = logits, .b = weight, .c = dx_beta != 0.0f ? dxc : nullptr, .d = dxc, .m = c,
                                .n = hidden, .k = vocab, .ldc = dxs, .ldd = dxs, .beta = dx_beta}));
    if constexpr (kRun) TIGON_CHECK(steps.after_dx(dxc, c, stream, op));
  }
  if (dweight != nullptr) {
    TIGON_CHECK(run(GemmArgs<T, G>{.a = logits, .b = xc, .c = dweight, .d = dweight, .m = vocab, .n = hidden,
                                   .k = c, .ldb = xs, .op_a = Op::t, .beta = beta}));
  }
  if (dbias != nullptr) {
    TIGON_CHECK(run(GemmArgs<T, G>{.a = ones, .b = logits, .c = dbias, .d = dbias, .m = 1, .n = vocab, .k = c,
                                   .beta = beta}));
  }
  return Status();
}

}  // namespace detail

// The loss over all tokens, with the gradients asked for, one chunk of tokens at a time.
template <class Gemm = CublasLtGemm, class T, class I, class G>
[[nodiscard]] Status linear_cross_entropy(const LinearCrossEntropyArgs<T, I, G>& args, Gemm& gemm,
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

  T* bias_slot = reinterpret_cast<T*>(base + l.bias_offset);
  const T* bias = detail::epilogue_bias_ptr(args.bias, bias_slot);
  // Every chunk's GEMMs checked (kRun false) before anything is written, then run.
  auto chunks = [&](auto run_c) {
    for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
      const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
      const float beta = (args.accumulate || r0 > 0) ? 1.0f : 0.0f;
      TIGON_CHECK(detail::lce_chunk<decltype(run_c)::value>(
          gemm, ce, args.x + r0 * xs, xs, args.weight, bias, hidden, r0, c, logits, ones, scratch, want_grad,
          args.dx != nullptr ? args.dx + r0 * dxs : nullptr, dxs, 0.0f, args.dweight, args.dbias, beta, stream, kOp));
    }
    return Status();
  };
  TIGON_CHECK(chunks(std::false_type{}));
  if (ce.reduction == Reduction::mean) {
    TIGON_CHECK(detail::ce_denominator(ce.targets, tokens, ce.ignore_index, ce.class_weights, vocab,
                                       scratch.denom, stream, kOp));
  }
  if (args.dbias != nullptr) {
    TIGON_CHECK(detail::fill_ones(ones, l.chunk, stream, kOp));
  }
  TIGON_CHECK(detail::epilogue_bias_copy(args.bias, vocab, bias_slot, stream, kOp));
  TIGON_CHECK(chunks(std::true_type{}));
  if (ce.reduction != Reduction::none) {
    TIGON_CHECK(detail::ce_reduce(ce.loss_rows != nullptr ? ce.loss_rows : scratch.loss_rows, scratch.z_rows,
                                  tokens, scratch.denom, ce.reduction == Reduction::mean, ce.loss, ce.z_loss,
                                  stream, kOp));
  }
  return Status();
}

// K heads over the same x: per chunk of tokens, each head in turn (logits, loss, dx accumulated over the
// heads, dW_k, db_k); then each head's reduction and the weighted sums.
template <class Gemm = CublasLtGemm, class T, class I, class G>
[[nodiscard]] Status linear_cross_entropy_heads(const LinearCrossEntropyHeadsArgs<T, I, G>& args, Gemm& gemm,
                                                cudaStream_t stream) {
  constexpr const char* kOp = "linear_cross_entropy_heads";
  TIGON_CHECK(detail::validate(args, kOp));
  const detail::LceHeadsLayout l = detail::lce_heads_layout(args);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, l.total, kOp));
  const CrossEntropyArgs<T, I>& ce = args.loss;
  const std::int64_t tokens = ce.rows, vocab = ce.vocab, hidden = args.hidden;
  const std::int64_t xs = args.x_stride ? args.x_stride : hidden;
  const std::int64_t dxs = args.dx_stride ? args.dx_stride : hidden;
  const std::int64_t ts = args.targets_stride ? args.targets_stride : tokens;
  const int heads = args.heads;
  auto* base = static_cast<unsigned char*>(args.workspace);
  T* logits = reinterpret_cast<T*>(base + l.logits_offset);
  T* ones = reinterpret_cast<T*>(base + l.ones_offset);
  float* head_loss = args.head_losses != nullptr ? args.head_losses : reinterpret_cast<float*>(base + l.heads_offset);
  float* head_z = reinterpret_cast<float*>(base + l.heads_offset) + heads;
  const bool any_bias = l.bias_offset > l.ones_offset;  // the layout holds a ones vector
  bool want_grad = args.dx != nullptr || any_bias;
  for (int k = 0; k < heads; ++k) want_grad = want_grad || (args.dweights != nullptr && args.dweights[k] != nullptr);
  // Head k's loss: its targets, its per-row outputs, its upstream gradient times its factor.
  auto head = [&](int k) {
    CrossEntropyArgs<T, I> h = ce;
    const std::int64_t off = static_cast<std::int64_t>(k) * tokens;
    h.targets = ce.targets + static_cast<std::int64_t>(k) * ts;
    h.grad_scale = ce.grad_scale * (args.head_weights != nullptr ? args.head_weights[k] : 1.0f);
    if (ce.loss_rows != nullptr) h.loss_rows = ce.loss_rows + off;
    if (ce.lse != nullptr) h.lse = ce.lse + off;
    if (ce.argmax != nullptr) h.argmax = ce.argmax + off;
    if (ce.grad_output != nullptr && ce.reduction == Reduction::none) h.grad_output = ce.grad_output + off;
    return h;
  };
  auto scratch = [&](int k) { return detail::ce_scratch(base + l.ce_bytes * static_cast<std::size_t>(k), tokens); };
  // Head k's bias where the GEMM's epilogue reads it (its aligned copy when the caller's is not).
  auto bias_slot = [&](int k) {
    return reinterpret_cast<T*>(base + l.bias_offset +
                                static_cast<std::size_t>(k) * round_up<std::size_t>(vocab * sizeof(T), 256));
  };
  auto bias_of = [&](int k) -> const T* {
    return args.biases != nullptr ? detail::epilogue_bias_ptr(args.biases[k], bias_slot(k)) : nullptr;
  };
  // Every chunk's GEMMs of every head checked (kRun false) before anything is written, then run.
  auto chunks = [&](auto run_c) {
    for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
      const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
      const float beta = (args.accumulate || r0 > 0) ? 1.0f : 0.0f;
      for (int k = 0; k < heads; ++k) {
        TIGON_CHECK(detail::lce_chunk<decltype(run_c)::value>(
            gemm, head(k), args.x + r0 * xs, xs, args.weights[k], bias_of(k), hidden, r0, c, logits, ones, scratch(k),
            want_grad, args.dx != nullptr ? args.dx + r0 * dxs : nullptr, dxs, k > 0 ? 1.0f : 0.0f,
            args.dweights != nullptr ? args.dweights[k] : static_cast<G*>(nullptr),
            args.dbiases != nullptr ? args.dbiases[k] : static_cast<G*>(nullptr),
            beta, stream, kOp));
      }
    }
    return Status();
  };
  TIGON_CHECK(chunks(std::false_type{}));
  for (int k = 0; k < heads; ++k) {
    if (ce.reduction != Reduction::mean) break;
    const CrossEntropyArgs<T, I> h = head(k);
    TIGON_CHECK(detail::ce_denominator(h.targets, tokens, ce.ignore_index, ce.class_weights, vocab, scratch(k).denom,
                                       stream, kOp));
  }
  if (any_bias) TIGON_CHECK(detail::fill_ones(ones, l.chunk, stream, kOp));
  for (int k = 0; args.biases != nullptr && k < heads; ++k) {
    TIGON_CHECK(detail::epilogue_bias_copy(args.biases[k], vocab, bias_slot(k), stream, kOp));
  }
  TIGON_CHECK(chunks(std::true_type{}));
  if (ce.reduction == Reduction::none) return Status();
  for (int k = 0; k < heads; ++k) {
    const detail::CeScratch sk = scratch(k);
    const CrossEntropyArgs<T, I> h = head(k);
    TIGON_CHECK(detail::ce_reduce(h.loss_rows != nullptr ? h.loss_rows : sk.loss_rows, sk.z_rows, tokens, sk.denom,
                                  ce.reduction == Reduction::mean, head_loss + k, head_z + k, stream, kOp));
  }
  if (ce.loss == nullptr && ce.z_loss == nullptr) return Status();
  detail::LceHeadFactors f{};
  for (int k = 0; k < heads; ++k) f.w[k] = args.head_weights != nullptr ? args.head_weights[k] : 1.0f;
  return detail::launch(kOp, detail::lce_heads_combine_kernel<0>, {dim3(1), dim3(32), 0, stream}, head_loss, head_z,
                        heads, f, ce.loss, ce.z_loss);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
