// tigon/loss/linear_divergence.cuh - the distillation loss between a student's and a teacher's LM
// heads, D(softmax(x Ws^T / T), softmax(xt Wt^T / T)), without either [tokens x vocabulary] logits
// matrix: tokens are processed in chunks, and per chunk
//
//   s      = x_c Ws^T           GEMM into a [chunk, vocab] buffer (student hidden size)
//   t      = xt_c Wt^T          GEMM into a second [chunk, vocab] buffer (teacher hidden size)
//   divergence kernel           the divergence op's row kernel overwrites s with dlogits
//   dx_c   = dlogits Ws         GEMM
//   dWs   += dlogits^T x_c      GEMM accumulating (beta = 1 after the first chunk), in fp32 or in T
//                               (the args' G, as linear_cross_entropy.cuh has it)
//
// Every divergence option (the functor, temperature, labels / ignore_index, reductions, upstream
// gradients, per-row and per-element losses) comes from composing the divergence op's pieces: one
// count of the non-ignored tokens over all of them, the row kernel per chunk, one finish at the
// end, so batchmean and mean divide by the denominator of all tokens. The teacher takes no
// gradient. The GEMM back end is a template parameter (CublasLtGemm by default). Extra device
// memory: two logits chunks (2 x chunk x vocab x sizeof(T)) and 4 bytes per token plus 16 (the
// row sums and the count) — what linear_divergence_workspace_bytes() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../blas/gemm.cuh"
#include "../core/config.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "divergence.cuh"

TIGON_NAMESPACE_BEGIN

template <class T, class I = std::int64_t, class G = float>
struct LinearDivergenceArgs {
  static_assert(head_grad_type_ok<T, G>, "the weight gradient is float or the weight's type");
  // Student: hidden states [tokens, hidden] (row stride x_stride, 0: hidden) and head [vocab, hidden].
  const T* x = nullptr;
  std::int64_t x_stride = 0;
  const T* weight = nullptr;  // contiguous
  std::int64_t hidden = 0;
  // Teacher: hidden states [tokens, teacher_hidden] (row stride teacher_x_stride, 0: teacher_hidden)
  // and head [teacher_vocab, teacher_hidden]; its hidden size may differ from the student's.
  const T* teacher_x = nullptr;
  std::int64_t teacher_x_stride = 0;
  const T* teacher_weight = nullptr;  // contiguous
  std::int64_t teacher_hidden = 0;
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
  std::int64_t teacher_vocab = 0;  // 0: vocab; otherwise it must equal vocab
  float temperature = 1.0f;        // both heads' logits are divided by it (> 0)
  // Labels [tokens] (optional): a token whose label is ignore_index contributes nothing.
  const I* labels = nullptr;
  std::int64_t ignore_index = -100;
  DivergenceReduction reduction = DivergenceReduction::batchmean;
  // Upstream gradient, as DivergenceArgs has it: grad_scale times, when given, grad_output (one
  // value; under none [tokens] for the JSD family, [tokens, vocab] with row stride
  // grad_output_stride for KLDiv and TVD).
  float grad_scale = 1.0f;
  const float* grad_output = nullptr;
  std::int64_t grad_output_stride = 0;
  // Outputs, each optional.
  float* loss = nullptr;        // [1]: the reduced loss (not under none)
  float* loss_rows = nullptr;   // [tokens]: each token's loss (0 for ignored tokens)
  float* loss_elems = nullptr;  // [tokens, vocab], row stride loss_elems_stride (KLDiv / TVD under none)
  std::int64_t loss_elems_stride = 0;
  // The student's gradients, each optional (both null: forward only).
  T* dx = nullptr;  // [tokens, hidden], row stride dx_stride (0: hidden)
  std::int64_t dx_stride = 0;
  G* dweight = nullptr;       // [vocab, hidden]
  bool accumulate = false;   // dweight += the gradient instead of =
  std::int64_t chunk = 0;    // tokens per chunk; 0: linear_divergence_default_chunk()
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Default chunk: about 1 GiB for the two logits buffers together, a multiple of 128 tokens, at
// most all of them.
inline std::int64_t linear_divergence_default_chunk(std::int64_t tokens, std::int64_t vocab, std::size_t elem_bytes) {
  return rows_per_chunk(tokens, vocab, elem_bytes, std::size_t{1} << 29);
}

namespace detail {

struct LdivLayout {
  std::int64_t chunk;
  bool count, partials, finish;
  std::size_t student_offset, teacher_offset, total;
};

// The plan: [count (16 bytes) | row sums, 4 bytes a token] (when needed, a 256-byte multiple), the
// student's logits chunk, the teacher's logits chunk.
template <class T, class I, class G>
LdivLayout ldiv_layout(const LinearDivergenceArgs<T, I, G>& a) {
  LdivLayout l{};
  const std::int64_t tokens = a.tokens, vocab = a.vocab;
  l.chunk = a.chunk > 0 ? (a.chunk < tokens ? a.chunk : tokens)
                        : linear_divergence_default_chunk(tokens, vocab, sizeof(T));
  l.count = a.labels != nullptr &&
            (a.reduction == DivergenceReduction::batchmean || a.reduction == DivergenceReduction::mean);
  const bool sums = a.loss != nullptr || a.loss_rows != nullptr;
  l.partials = sums && a.loss_rows == nullptr;
  l.finish = a.loss != nullptr;
  std::size_t head = 0;
  if (l.count || l.partials) {
    head = round_up<std::size_t>(16 + (l.partials ? static_cast<std::size_t>(tokens) * 4u : 0u), 256u);
  }
  const std::size_t chunk_bytes = round_up<std::size_t>(static_cast<std::size_t>(l.chunk * vocab) * sizeof(T), 256);
  l.student_offset = head;
  l.teacher_offset = head + chunk_bytes;
  l.total = head + 2 * chunk_bytes;
  return l;
}

template <class T, class I, class G>
Status validate(const LinearDivergenceArgs<T, I, G>& a, const char* op) {
  using namespace check;
  static_assert(Element<T>, "x and the heads are float, half or bfloat16");
  static_assert(std::is_same_v<I, std::int64_t> || std::is_same_v<I, std::int32_t>, "labels are int32 or int64");
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.weight, op, "weight"));
  TIGON_CHECK(not_null(a.teacher_x, op, "teacher_x"));
  TIGON_CHECK(not_null(a.teacher_weight, op, "teacher_weight"));
  TIGON_CHECK(positive(a.tokens, op, "tokens"));
  TIGON_CHECK(positive(a.hidden, op, "hidden"));
  TIGON_CHECK(positive(a.teacher_hidden, op, "teacher_hidden"));
  TIGON_CHECK(positive(a.vocab, op, "vocab"));
  TIGON_CHECK(at_most(a.vocab, kDivMaxVocab, op, "vocab"));
  if (a.teacher_vocab != 0 && a.teacher_vocab != a.vocab) {
    return Status::error(Errc::invalid_size, op, "teacher_vocab",
                         "the teacher's vocabulary (" + std::to_string(a.teacher_vocab) +
                             ") differs from the student's (" + std::to_string(a.vocab) + ")");
  }
  if (a.chunk < 0) return Status::error(Errc::invalid_size, op, "chunk", "must be >= 0");
  TIGON_CHECK(validate_divergence_options(a.temperature, a.reduction, a.loss, a.grad_scale, op));
  TIGON_CHECK(row_stride(a.x_stride, a.hidden, op, "x_stride"));
  TIGON_CHECK(row_stride(a.teacher_x_stride, a.teacher_hidden, op, "teacher_x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.hidden, op, "dx_stride"));
  TIGON_CHECK(row_stride(a.loss_elems_stride, a.vocab, op, "loss_elems_stride"));
  TIGON_CHECK(row_stride(a.grad_output_stride, a.vocab, op, "grad_output_stride"));
  // Aliasing: no output may overlap an input or another output.
  const MatrixView ins[] = {MatrixView::of(a.x, a.tokens, a.hidden, a.x_stride),
                            MatrixView::of(a.weight, a.vocab, a.hidden, 0),
                            MatrixView::of(a.teacher_x, a.tokens, a.teacher_hidden, a.teacher_x_stride),
                            MatrixView::of(a.teacher_weight, a.vocab, a.teacher_hidden, 0),
                            a.labels != nullptr ? MatrixView::of(a.labels, 1, a.tokens, 0) : MatrixView{}};
  const char* in_names[] = {"x", "weight", "teacher_x", "teacher_weight", "labels"};
  // The workspace: the bytes the call uses (the two logits chunks, the count, the row sums).
  const std::size_t ws_bytes = a.workspace != nullptr ? ldiv_layout(a).total : 0;
  const MatrixView outs[] = {
      a.dx != nullptr ? MatrixView::of(a.dx, a.tokens, a.hidden, a.dx_stride) : MatrixView{},
      a.dweight != nullptr ? MatrixView::of(a.dweight, a.vocab, a.hidden, 0) : MatrixView{},
      a.loss != nullptr ? MatrixView::of(a.loss, 1, 1, 0) : MatrixView{},
      a.loss_rows != nullptr ? MatrixView::of(a.loss_rows, 1, a.tokens, 0) : MatrixView{},
      a.loss_elems != nullptr ? MatrixView::of(a.loss_elems, a.tokens, a.vocab, a.loss_elems_stride) : MatrixView{},
      check::vector_view(a.workspace, static_cast<std::int64_t>(ws_bytes), 1)};
  const char* out_names[] = {"dx", "dweight", "loss", "loss_rows", "loss_elems", "workspace"};
  for (int i = 0; i < 6; ++i) {
    if (outs[i].ptr == nullptr) continue;
    for (int j = 0; j < 5; ++j) {
      if (ins[j].ptr != nullptr) TIGON_CHECK(disjoint(outs[i], ins[j], op, out_names[i], in_names[j]));
    }
    for (int j = 0; j < i; ++j) {
      if (outs[j].ptr != nullptr) TIGON_CHECK(disjoint(outs[i], outs[j], op, out_names[i], out_names[j]));
    }
  }
  return Status();
}

// What depends on the functor: it must take logits on both sides, its own parameters must be
// valid, and grad_output (whose extent the functor decides under none) must not overlap an output.
template <class D, class T, class I, class G>
Status validate_call(const LinearDivergenceArgs<T, I, G>& a, const D& div, const char* op) {
  using namespace check;
  if constexpr (!div_accepts<D>(DivergenceInput::logits, DivergenceInput::logits)) {
    return Status::error(Errc::unsupported, op, "div",
                         std::string(div_name<D>()) + " does not take logits on both sides");
  }
  if constexpr (requires { { div.validate(op) } -> std::convertible_to<Status>; }) {
    TIGON_CHECK(div.validate(op));
  }
  if (a.grad_output == nullptr) return Status();
  MatrixView go = MatrixView::of(a.grad_output, 1, 1, 0);
  if (a.reduction == DivergenceReduction::none) {
    go = div_elementwise_none<D>() ? MatrixView::of(a.grad_output, a.tokens, a.vocab, a.grad_output_stride)
                                   : MatrixView::of(a.grad_output, 1, a.tokens, 0);
  }
  if (a.dx != nullptr) TIGON_CHECK(disjoint(MatrixView::of(a.dx, a.tokens, a.hidden, a.dx_stride), go, op, "dx", "grad_output"));
  if (a.dweight != nullptr) TIGON_CHECK(disjoint(MatrixView::of(a.dweight, a.vocab, a.hidden, 0), go, op, "dweight", "grad_output"));
  if (a.loss != nullptr) TIGON_CHECK(disjoint(MatrixView::of(a.loss, 1, 1, 0), go, op, "loss", "grad_output"));
  if (a.loss_rows != nullptr) TIGON_CHECK(disjoint(MatrixView::of(a.loss_rows, 1, a.tokens, 0), go, op, "loss_rows", "grad_output"));
  if (a.loss_elems != nullptr) {
    TIGON_CHECK(disjoint(MatrixView::of(a.loss_elems, a.tokens, a.vocab, a.loss_elems_stride), go, op,
                         "loss_elems", "grad_output"));
  }
  if (a.workspace != nullptr) {  // the logits chunks are written while grad_output is still read
    const auto ws_bytes = static_cast<std::int64_t>(ldiv_layout(a).total);
    TIGON_CHECK(disjoint(vector_view(a.workspace, ws_bytes, 1), go, op, "workspace", "grad_output"));
  }
  return Status();
}

}  // namespace detail

// Bytes of workspace linear_divergence(args, div) needs: the two logits chunks, and the count of
// non-ignored tokens (labels under batchmean / mean) and the tokens' row sums (the loss without
// loss_rows) when needed. Validates what does not depend on the functor as the launch will.
template <class T, class I, class G>
[[nodiscard]] Status linear_divergence_workspace_bytes(const LinearDivergenceArgs<T, I, G>& args, std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate(args, "linear_divergence_workspace_bytes"));
  bytes = detail::ldiv_layout(args).total;
  return Status();
}

#if defined(__CUDACC__)

// The divergence `div` (ForwardKL, ReverseKL, GeneralizedJSD{beta}, KLDiv{eps}, TVD, or a user
// functor taking logits on both sides) between the student's and the teacher's heads over all
// tokens, with the student's gradients asked for, one chunk of tokens at a time. P: the divergence
// kernels' tuning (DivergencePolicy; the row kernel's members apply).
template <class Gemm = CublasLtGemm, class P = DivergencePolicy, class D, class T, class I, class G>
[[nodiscard]] Status linear_divergence(const LinearDivergenceArgs<T, I, G>& args, const D& div, Gemm& gemm,
                                       cudaStream_t stream) {
  static_assert(detail::check_divergence_policy<P>());
  constexpr const char* kOp = "linear_divergence";
  TIGON_CHECK(detail::validate(args, kOp));
  TIGON_CHECK(detail::validate_call(args, div, kOp));
  const detail::LdivLayout l = detail::ldiv_layout(args);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, l.total, kOp));
  const std::int64_t tokens = args.tokens, vocab = args.vocab;
  const std::int64_t xs = args.x_stride ? args.x_stride : args.hidden;
  const std::int64_t txs = args.teacher_x_stride ? args.teacher_x_stride : args.teacher_hidden;
  const std::int64_t dxs = args.dx_stride ? args.dx_stride : args.hidden;
  const bool want_grad = args.dx != nullptr || args.dweight != nullptr;
  auto* base = static_cast<unsigned char*>(args.workspace);
  float* const count = reinterpret_cast<float*>(base);
  float* const partials = reinterpret_cast<float*>(base + 16);
  T* const s = reinterpret_cast<T*>(base + l.student_offset);
  T* const t = reinterpret_cast<T*>(base + l.teacher_offset);
  constexpr bool kElems = detail::div_elementwise_none<D>();
  const bool none = args.reduction == DivergenceReduction::none;

  // The parameters every chunk shares; the rows' pointers move per chunk.
  detail::DivParams<T, T, I> p{};
  p.vocab = vocab;
  p.xs = vocab;
  p.ys = vocab;
  p.dxs = vocab;
  p.ignore_index = args.ignore_index;
  p.inv_temp = 1.0f / args.temperature;
  p.grad_scale = args.grad_scale;
  const std::int64_t gos = args.grad_output_stride != 0 ? args.grad_output_stride : vocab;
  const std::int64_t les = args.loss_elems_stride != 0 ? args.loss_elems_stride : vocab;
  p.gos = gos;
  p.les = les;
  p.go_per_row = none ? 1 : 0;
  p.count = l.count ? count : nullptr;
  const double dt = static_cast<double>(tokens), dv = static_cast<double>(vocab);
  switch (args.reduction) {
    case DivergenceReduction::batchmean: p.den = l.count ? 1.0f : static_cast<float>(dt); break;
    case DivergenceReduction::mean: p.den = static_cast<float>(l.count ? dv : dt * dv); break;
    default: p.den = 1.0f; break;
  }
  p.chunks = 1;
  float* const row_sums = l.partials ? partials : args.loss_rows;

  // One chunk's GEMMs, the two logits products (grad false) or the student's gradients (grad
  // true); kRun false only asks the back end whether it can run each.
  auto chunk_gemms = [&](auto run_c, std::int64_t r0, std::int64_t c, bool grad) -> Status {
    auto run = [&](const auto& g) { return detail::gemm_run_or_check<decltype(run_c)::value>(gemm, g, stream); };
    const T* xc = args.x + r0 * xs;
    if (!grad) {
      TIGON_CHECK(run(GemmArgs<T>{.a = xc, .b = args.weight, .d = s, .m = c, .n = vocab, .k = args.hidden, .lda = xs,
                                  .op_b = Op::t}));
      return run(GemmArgs<T>{.a = args.teacher_x + r0 * txs, .b = args.teacher_weight, .d = t, .m = c, .n = vocab,
                             .k = args.teacher_hidden, .lda = txs, .op_b = Op::t});
    }
    if (args.dx != nullptr) {
      TIGON_CHECK(run(GemmArgs<T>{.a = s, .b = args.weight, .d = args.dx + r0 * dxs, .m = c, .n = args.hidden,
                                  .k = vocab, .ldd = dxs}));
    }
    if (args.dweight != nullptr) {
      const float beta = (args.accumulate || r0 > 0) ? 1.0f : 0.0f;
      TIGON_CHECK(run(GemmArgs<T, G>{.a = s, .b = xc, .c = args.dweight, .d = args.dweight, .m = vocab,
                                     .n = args.hidden, .k = c, .ldb = xs, .op_a = Op::t, .beta = beta}));
    }
    return Status();
  };
  // Every GEMM of the call checked before anything is written.
  for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
    const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
    TIGON_CHECK(chunk_gemms(std::false_type{}, r0, c, false));
    if (want_grad) TIGON_CHECK(chunk_gemms(std::false_type{}, r0, c, true));
  }

  if (l.count) {
    TIGON_CHECK(detail::launch(kOp, detail::div_count_kernel<I>, {dim3(1), dim3(1024), 0, stream}, args.labels,
                               tokens, args.ignore_index, count));
  }
  for (std::int64_t r0 = 0; r0 < tokens; r0 += l.chunk) {
    const std::int64_t c = tokens - r0 < l.chunk ? tokens - r0 : l.chunk;
    TIGON_CHECK(chunk_gemms(std::true_type{}, r0, c, false));
    // The divergence over this chunk (the student's gradient in place), against the denominator
    // of all tokens; the row sums go to their place among all tokens'.
    p.x = s;
    p.y = t;
    p.dx = want_grad ? s : nullptr;
    p.rows = c;
    p.labels = args.labels != nullptr ? args.labels + r0 : nullptr;
    p.go = nullptr;
    p.go_elems = nullptr;
    if (args.grad_output != nullptr) {
      if (none && kElems) {
        p.go_elems = args.grad_output + r0 * gos;
      } else {
        p.go = args.grad_output + (none ? r0 : 0);
      }
    }
    p.partials = row_sums != nullptr ? row_sums + r0 : nullptr;
    p.loss_elems = args.loss_elems != nullptr ? args.loss_elems + r0 * les : nullptr;
    TIGON_CHECK((detail::div_rows<P>(p, div, DivergenceInput::logits, DivergenceInput::logits, stream, kOp)));
    if (want_grad) TIGON_CHECK(chunk_gemms(std::true_type{}, r0, c, true));
  }
  if (l.finish) {
    TIGON_CHECK(detail::launch(kOp, detail::div_finish_kernel<1024>, {dim3(1), dim3(1024), 0, stream},
                               static_cast<const float*>(row_sums), tokens, std::int64_t{1}, args.loss_rows,
                               static_cast<const float*>(p.count), p.den, args.loss));
  }
  return Status();
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
