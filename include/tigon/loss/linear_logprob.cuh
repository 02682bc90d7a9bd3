// tigon/loss/linear_logprob.cuh - per-token log-probabilities of the LM head without the
// [tokens x vocabulary] logits: the building block of the sequence-level post-training losses
// (DPO, ORPO, CPO, SimPO, KTO: sums of log p(target) over a completion; GRPO and its variants:
// per-token log p weighted by advantages, with the entropy as a bonus or a metric).
//
// Per token n with target t_n (fp32 math; z = logits / temperature):
//   logits_n  = x_n W^T (+ b)            the GEMM's output in T (the bias added in its epilogue, one
//                                        rounding, as F.linear does)
//   lse_n     = log sum_v exp(z_v)
//   logp_n    = z_t - lse_n              log softmax(z)_t
//   entropy_n = lse_n - sum_v p_v z_v    -sum_v p_v log p_v,   p = softmax(z)
//   logit_sum_n = sum_v logits_v         (before the temperature: Liger's chosen / rejected logits means)
//   is_top1_n = [t is the first column holding the largest logit]   (token accuracy; no gradient)
// Tokens whose target is ignore_index give 0 (logit_sum: their sum all the same) and take no gradient.
//
// Backward, from the upstream gradients g_n = dL/dlogp_n and h_n = dL/dentropy_n:
//   dL/dz_v = g (1[v == t] - p_v) - h p_v (z_v - (lse - entropy))
//   dL/dlogits = dL/dz / temperature,   dx = dlogits W,   dW += dlogits^T x,   db += 1^T dlogits
//
// Tokens are processed in chunks through the GEMM back end (CublasLtGemm by default), as in
// linear_cross_entropy.cuh. linear_logprob_forward: per chunk one GEMM and the statistics kernel.
// linear_logprob_backward: per chunk the GEMM again (unless keep_logits: then the forward's), the gradient
// kernel (dlogits over the chunk, in place), and the GEMMs of dx, dW (accumulated across chunks, in
// fp32 or in T: the args' G) and db. Both pass through the same arguments: the backward reads the forward's lse (and
// entropy, when h is given). No host synchronisation. Extra device memory: one logits chunk, with
// dbias a ones vector, with a bias room for its 16-byte aligned copy (used when the caller's is not
// aligned) — what linear_logprob_workspace_bytes() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../blas/gemm.cuh"
#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>

#include "../core/device.hpp"
#include "../core/launch.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// G, the weight gradients' type: float (accumulated in fp32 across chunks) or T (each chunk's GEMM adds
// into them in T and rounds once: no fp32 [vocab, hidden] beside the gradient; see
// linear_cross_entropy.cuh).
template <class T, class I = std::int64_t, class G = float>
struct LinearLogProbArgs {
  static_assert(head_grad_type_ok<T, G>, "the weight gradients are float or the weight's type");
  const T* x = nullptr;  // [tokens, hidden], row stride x_stride (0: hidden)
  std::int64_t x_stride = 0;
  const T* weight = nullptr;  // [vocab, hidden], contiguous
  const T* bias = nullptr;    // [vocab], or null
  std::int64_t hidden = 0;
  const I* targets = nullptr;  // [tokens], int32 or int64
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
  std::int64_t ignore_index = -100;
  float temperature = 1.0f;  // the logits are divided by it (finite, > 0)
  // Forward outputs, each optional (at least one): [tokens] fp32. The backward reads lse (and
  // entropy when grad_entropy is given) as the forward wrote them.
  float* logp = nullptr;
  float* lse = nullptr;
  float* entropy = nullptr;
  float* logit_sum = nullptr;  // every token's, ignored ones included
  // 1 where the target holds the token's largest logit and no earlier column holds as large a one
  // (the first argmax is the target: the token-accuracy statistic), else 0 (ignored tokens: 0).
  std::uint8_t* is_top1 = nullptr;
  int* error_count = nullptr;  // incremented once per token whose target is outside [0, vocab) (forward)
  // Backward: upstream gradients [tokens] fp32 (at least one), and the gradients asked for.
  const float* grad_logp = nullptr;
  const float* grad_entropy = nullptr;
  T* dx = nullptr;  // [tokens, hidden], row stride dx_stride (0: hidden)
  std::int64_t dx_stride = 0;
  G* dweight = nullptr;       // [vocab, hidden]
  G* dbias = nullptr;         // [vocab]
  bool accumulate = false;    // dweight / dbias += the gradient instead of =
  std::int64_t chunk = 0;     // tokens per chunk; 0: linear_logprob_default_chunk()
  // Kept logits: the forward leaves x W^T of every token in the workspace (one chunk of all the
  // tokens), and a backward given the same workspace, untouched since, reads them there instead of
  // recomputing them: 6 N D V FLOPs for forward and backward instead of 8, for the memory of all the
  // tokens' logits. For losses whose upstream gradient is known one batch of tokens at a time.
  bool keep_logits = false;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Default chunk: about 1 GiB of logits, a multiple of 128 tokens, at most all of them.
inline std::int64_t linear_logprob_default_chunk(std::int64_t tokens, std::int64_t vocab, std::size_t elem_bytes) {
  return rows_per_chunk(tokens, vocab, elem_bytes, std::size_t{1} << 30);
}

// ------------------------------------------------------------------------------------------------
// 2. Math (host and device: the kernels and the tests' references share it)
// ------------------------------------------------------------------------------------------------

namespace llp_math {

// A running (max, sum of exp(z - max), sum of exp(z - max) z) over some of a row's z, and the sum
// of the raw logits.
struct RowAcc {
  float m;
  float s;
  float t;
  float sum;
};

TIGON_HD RowAcc empty() { return {-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f}; }

TIGON_HD float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);  // the hardware exp: 2 + floor(|1.173 x|) ulp, far below T's rounding of the gradient
#else
  return ::expf(x);
#endif
}

TIGON_HD RowAcc merge(const RowAcc& a, const RowAcc& b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -__builtin_huge_valf()) return {m, 0.0f, 0.0f, a.sum + b.sum};
  const float fa = a.s > 0.0f ? exp_f(a.m - m) : 0.0f, fb = b.s > 0.0f ? exp_f(b.m - m) : 0.0f;
  return {m, a.s * fa + b.s * fb, a.t * fa + b.t * fb, a.sum + b.sum};
}

// lse, and entropy = lse - sum p z, from a whole row's accumulator.
TIGON_HD float lse_of(const RowAcc& a) { return a.m + ::logf(a.s); }
TIGON_HD float entropy_of(const RowAcc& a) { return ::logf(a.s) - (a.t / a.s - a.m); }

// dL/dz for one element: g (1[target] - p) - h p (z - mean_z), mean_z = lse - entropy.
TIGON_HD float dz(float z, float lse, float mean_z, float g, float h, bool is_target) {
  const float p = exp_f(z - lse);
  return (is_target ? g : 0.0f) - p * (g + h * (z - mean_z));
}

}  // namespace llp_math

// ------------------------------------------------------------------------------------------------
// 3. Validation and workspace
// ------------------------------------------------------------------------------------------------

namespace detail {

struct LlpLayout {
  std::int64_t chunk;
  std::size_t bias_offset, ones_offset, total;
};

template <class T, class I, class G>
LlpLayout llp_layout(const LinearLogProbArgs<T, I, G>& a, bool backward) {
  LlpLayout l{};
  l.chunk = a.keep_logits ? a.tokens
                          : (a.chunk > 0 ? (a.chunk < a.tokens ? a.chunk : a.tokens)
                                         : linear_logprob_default_chunk(a.tokens, a.vocab, sizeof(T)));
  l.bias_offset = round_up<std::size_t>(static_cast<std::size_t>(l.chunk * a.vocab) * sizeof(T), 256);
  l.ones_offset = l.bias_offset + (a.bias != nullptr ? round_up<std::size_t>(a.vocab * sizeof(T), 256) : 0);
  // Kept logits: the ones vector too, so that the forward's and the backward's workspace is one.
  const bool ones = a.keep_logits || (backward && a.dbias != nullptr);
  l.total = l.ones_offset + (ones ? round_up<std::size_t>(l.chunk * sizeof(T), 256) : 0);
  return l;
}

template <class T, class I, class G>
Status llp_validate(const LinearLogProbArgs<T, I, G>& a, bool backward, const char* op) {
  using namespace check;
  static_assert(Element<T>, "x and the head are float, half or bfloat16");
  static_assert(std::is_same_v<I, std::int64_t> || std::is_same_v<I, std::int32_t>, "targets are int32 or int64");
  TIGON_CHECK(not_null(a.x, op, "x"));
  TIGON_CHECK(not_null(a.weight, op, "weight"));
  TIGON_CHECK(not_null(a.targets, op, "targets"));
  TIGON_CHECK(positive(a.hidden, op, "hidden"));
  TIGON_CHECK(positive(a.tokens, op, "tokens"));
  TIGON_CHECK(positive(a.vocab, op, "vocab"));
  TIGON_CHECK(at_most(a.vocab, std::int64_t{1} << 30, op, "vocab"));
  TIGON_CHECK(row_stride(a.x_stride, a.hidden, op, "x_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.hidden, op, "dx_stride"));
  if (!check::finite_in(a.temperature, 0.0f, __builtin_huge_valf(), true)) {
    return Status::error(Errc::invalid_value, op, "temperature",
                         "must be finite and > 0, got " + std::to_string(a.temperature));
  }
  if (a.chunk < 0) return Status::error(Errc::invalid_size, op, "chunk", "must be >= 0");
  if (a.keep_logits && a.chunk > 0 && a.chunk < a.tokens) {
    return Status::error(Errc::invalid_size, op, "chunk", "kept logits are one chunk of all the tokens: chunk 0");
  }
  // Aliasing: every output (the workspace's bytes the call uses included) against every input and
  // every other output of the direction.
  const std::size_t ws_bytes = a.workspace != nullptr ? llp_layout(a, backward).total : 0;
  const NamedView ws{vector_view(a.workspace, static_cast<std::int64_t>(ws_bytes), 1), "workspace"};
  const NamedView x{MatrixView::of(a.x, a.tokens, a.hidden, a.x_stride), "x"};
  const NamedView w{MatrixView::of(a.weight, a.vocab, a.hidden, 0), "weight"};
  const NamedView b{vector_view(a.bias, a.vocab, sizeof(T)), "bias"};
  const NamedView t{vector_view(a.targets, a.tokens, sizeof(I)), "targets"};
  if (!backward) {
    if (a.logp == nullptr && a.lse == nullptr && a.entropy == nullptr && a.logit_sum == nullptr &&
        a.is_top1 == nullptr) {
      return Status::error(Errc::null_pointer, op, "logp", "no output: set logp, lse, entropy, logit_sum or is_top1");
    }
    const NamedView outs[] = {{vector_view(a.logp, a.tokens, 4), "logp"},
                              {vector_view(a.lse, a.tokens, 4), "lse"},
                              {vector_view(a.entropy, a.tokens, 4), "entropy"},
                              {vector_view(a.logit_sum, a.tokens, 4), "logit_sum"},
                              {vector_view(a.is_top1, a.tokens, 1), "is_top1"},
                              {vector_view(a.error_count, 1, sizeof(int)), "error_count"},
                              ws};
    const NamedView ins[] = {x, w, b, t};
    return buffers_disjoint(outs, ins, op);
  }
  if (a.grad_logp == nullptr && a.grad_entropy == nullptr) {
    return Status::error(Errc::null_pointer, op, "grad_logp", "no upstream gradient: set grad_logp or grad_entropy");
  }
  TIGON_CHECK(not_null(a.lse, op, "lse"));
  if (a.grad_entropy != nullptr) TIGON_CHECK(not_null(a.entropy, op, "entropy"));
  if (a.dx == nullptr && a.dweight == nullptr && a.dbias == nullptr) {
    return Status::error(Errc::null_pointer, op, "dx", "no gradient asked for: set dx, dweight or dbias");
  }
  const NamedView outs[] = {{a.dx != nullptr ? MatrixView::of(a.dx, a.tokens, a.hidden, a.dx_stride) : MatrixView{},
                             "dx"},
                            {a.dweight != nullptr ? MatrixView::of(a.dweight, a.vocab, a.hidden, 0) : MatrixView{},
                             "dweight"},
                            {vector_view(a.dbias, a.vocab, sizeof(G)), "dbias"},
                            ws};
  const NamedView ins[] = {x,
                           w,
                           b,
                           t,
                           {vector_view(a.lse, a.tokens, 4), "lse"},
                           {vector_view(a.grad_entropy != nullptr ? a.entropy : nullptr, a.tokens, 4), "entropy"},
                           {vector_view(a.grad_logp, a.tokens, 4), "grad_logp"},
                           {vector_view(a.grad_entropy, a.tokens, 4), "grad_entropy"}};
  return buffers_disjoint(outs, ins, op);
}

}  // namespace detail

// Bytes of workspace linear_logprob_forward (backward false) or linear_logprob_backward (true)
// needs: one logits chunk, with a bias room for its aligned copy, and for the backward with dbias a
// ones vector (with keep_logits: all the tokens' logits and the ones vector, the same for both).
template <class T, class I, class G>
[[nodiscard]] Status linear_logprob_workspace_bytes(const LinearLogProbArgs<T, I, G>& args, bool backward,
                                                    std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::llp_validate(args, backward, "linear_logprob_workspace_bytes"));
  bytes = detail::llp_layout(args, backward).total;
  return Status();
}

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 4. Kernels: one block per token of the chunk, 16-byte vectors where the row allows them
// ------------------------------------------------------------------------------------------------

namespace detail {

inline constexpr int kLlpThreads = 512;

template <class T, class I>
struct LlpParams {
  const T* logits;  // [rows, vocab], contiguous: the chunk
  T* dlogits;       // = logits (backward) or null
  const I* targets;  // the chunk's first target
  std::int64_t rows, vocab, ignore_index;
  float inv_temp;
  // Forward outputs (the chunk's first token), or null.
  float *logp, *lse, *entropy, *logit_sum;
  std::uint8_t* is_top1;
  int* error_count;
  // Backward inputs.
  const float *lse_in, *entropy_in, *grad_logp, *grad_entropy;
};

struct LlpMerge {
  TIGON_DEVICE llp_math::RowAcc operator()(const llp_math::RowAcc& a, const llp_math::RowAcc& b) const {
    return llp_math::merge(a, b);
  }
};

// Logits of kN consecutive columns from c, in fp32.
template <int kN, class T>
TIGON_DEVICE void llp_raw(const T* row, std::int64_t c, float (&v)[kN]) {
  if constexpr (kN > 1) {
    to_floats(load_vec<kN>(row + c), v);
  } else {
    v[0] = to_float(row[c]);
  }
}

template <class T, class I, int kN>
TIGON_KERNEL void __launch_bounds__(kLlpThreads) llp_forward_kernel(const LlpParams<T, I> p) {
  grid_dependency_sync();
  using Reduce = cub::BlockReduce<llp_math::RowAcc, kLlpThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const std::int64_t r = blockIdx.x;
  const T* row = p.logits + r * p.vocab;
  const std::int64_t t = static_cast<std::int64_t>(p.targets[r]);
  const bool ignored = t == p.ignore_index;
  const bool skip = ignored || t < 0 || t >= p.vocab;  // uniform over the block
  if (skip && threadIdx.x == 0) {
    if (!ignored && p.error_count != nullptr) atomicAdd(p.error_count, 1);
    if (p.logp) p.logp[r] = 0.0f;
    if (p.lse) p.lse[r] = 0.0f;
    if (p.entropy) p.entropy[r] = 0.0f;
    if (p.is_top1) p.is_top1[r] = 0;
  }
  if (skip && p.logit_sum == nullptr) return;  // the logit sum covers every token
  // is_top1: whether a column beats the target's raw logit (larger, or as large and earlier); the
  // raw logits order the logits (the temperature is positive).
  const bool top1 = p.is_top1 != nullptr && !skip;  // uniform over the block
  float xt = 0.0f;
  if (top1) {
    float v1[1];
    llp_raw<1>(row, t, v1);
    xt = v1[0];
  }
  bool beaten = false;
  llp_math::RowAcc acc = llp_math::empty();
  const std::int64_t nvec = p.vocab / kN;
  for (std::int64_t i = threadIdx.x; i < nvec; i += kLlpThreads) {
    float v[kN];
    llp_raw<kN>(row, i * kN, v);
    if (top1) {
#pragma unroll
      for (int k = 0; k < kN; ++k) beaten = beaten || v[k] > xt || (v[k] == xt && i * kN + k < t);
    }
    float vm = v[0] * p.inv_temp;
#pragma unroll
    for (int k = 1; k < kN; ++k) vm = fmaxf(vm, v[k] * p.inv_temp);
    const float m = fmaxf(acc.m, vm);
    const float f = acc.s > 0.0f ? llp_math::exp_f(acc.m - m) : 0.0f;
    float s = 0.0f, tz = 0.0f, sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float z = v[k] * p.inv_temp;
      const float e = llp_math::exp_f(z - m);
      s += e;
      tz = fmaf(e, z, tz);
      sum += v[k];
    }
    acc = {m, fmaf(acc.s, f, s), fmaf(acc.t, f, tz), acc.sum + sum};
  }
  const llp_math::RowAcc total = Reduce(tmp).Reduce(acc, LlpMerge{});
  if (top1) {
    const bool any = __syncthreads_or(beaten ? 1 : 0) != 0;
    if (threadIdx.x == 0) p.is_top1[r] = any ? 0 : 1;
  }
  if (threadIdx.x == 0 && skip) p.logit_sum[r] = total.sum;
  if (threadIdx.x == 0 && !skip) {
    const float lse = llp_math::lse_of(total);
    float zt[1];
    llp_raw<1>(row, t, zt);
    if (p.logp) p.logp[r] = zt[0] * p.inv_temp - lse;
    if (p.lse) p.lse[r] = lse;
    if (p.entropy) p.entropy[r] = llp_math::entropy_of(total);
    if (p.logit_sum) p.logit_sum[r] = total.sum;
  }
}

template <class T, class I, int kN>
TIGON_KERNEL void __launch_bounds__(kLlpThreads) llp_backward_kernel(const LlpParams<T, I> p) {
  grid_dependency_sync();
  const std::int64_t r = blockIdx.x;
  const T* row = p.logits + r * p.vocab;
  T* drow = p.dlogits + r * p.vocab;
  const std::int64_t t = static_cast<std::int64_t>(p.targets[r]);
  const std::int64_t nvec = p.vocab / kN;
  if (t == p.ignore_index || t < 0 || t >= p.vocab) {
    float zero[kN] = {};
    for (std::int64_t i = threadIdx.x; i < nvec; i += kLlpThreads) {
      if constexpr (kN > 1) {
        store_vec<kN>(drow + i * kN, from_floats<T, kN>(zero));
      } else {
        drow[i] = from_float<T>(0.0f);
      }
    }
    return;
  }
  const float g = p.grad_logp != nullptr ? p.grad_logp[r] : 0.0f;
  const float h = p.grad_entropy != nullptr ? p.grad_entropy[r] : 0.0f;
  const float lse = p.lse_in[r];
  const float mean_z = h != 0.0f ? lse - p.entropy_in[r] : 0.0f;
  for (std::int64_t i = threadIdx.x; i < nvec; i += kLlpThreads) {
    float v[kN];
    llp_raw<kN>(row, i * kN, v);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      v[k] = llp_math::dz(v[k] * p.inv_temp, lse, mean_z, g, h, i * kN + k == t) * p.inv_temp;
    }
    if constexpr (kN > 1) {
      store_vec<kN>(drow + i * kN, from_floats<T, kN>(v));
    } else {
      drow[i] = from_float<T>(v[0]);
    }
  }
}

template <class T, class I>
Status llp_launch(const LlpParams<T, I>& p, bool backward, cudaStream_t stream, const char* op) {
  constexpr int kN = kVecElems<T>;
  const bool vec = p.vocab % kN == 0 && is_aligned(p.logits, 16);
  const LaunchShape shape{dim3(static_cast<unsigned>(p.rows)), dim3(kLlpThreads), 0, stream};
  if (backward) {
    if (vec) return launch(op, llp_backward_kernel<T, I, kN>, shape, p);
    return launch(op, llp_backward_kernel<T, I, 1>, shape, p);
  }
  if (vec) return launch(op, llp_forward_kernel<T, I, kN>, shape, p);
  return launch(op, llp_forward_kernel<T, I, 1>, shape, p);
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 5. Launchers
// ------------------------------------------------------------------------------------------------

// Per-token logp, lse, entropy, logit sums and is_top1 (those asked for), one chunk of tokens at a time.
// Every chunk's GEMM is checked with the back end (detail::gemm_check) before anything is written.
template <class Gemm = CublasLtGemm, class T, class I, class G>
[[nodiscard]] Status linear_logprob_forward(const LinearLogProbArgs<T, I, G>& args, Gemm& gemm, cudaStream_t stream) {
  constexpr const char* kOp = "linear_logprob_forward";
  TIGON_CHECK(detail::llp_validate(args, false, kOp));
  const detail::LlpLayout l = detail::llp_layout(args, false);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, l.total, kOp));
  auto* base = static_cast<unsigned char*>(args.workspace);
  T* logits = reinterpret_cast<T*>(base);
  T* bias_slot = reinterpret_cast<T*>(base + l.bias_offset);
  const T* bias = detail::epilogue_bias_ptr(args.bias, bias_slot);
  const std::int64_t xs = args.x_stride ? args.x_stride : args.hidden;
  auto logits_gemm = [&](std::int64_t r0, std::int64_t c) {
    return GemmArgs<T>{.a = args.x + r0 * xs, .b = args.weight, .d = logits, .bias = bias, .m = c, .n = args.vocab,
                       .k = args.hidden, .lda = xs, .op_b = Op::t};
  };
  for (std::int64_t r0 = 0; r0 < args.tokens; r0 += l.chunk) {
    TIGON_CHECK(detail::gemm_check(gemm, logits_gemm(r0, args.tokens - r0 < l.chunk ? args.tokens - r0 : l.chunk)));
  }
  TIGON_CHECK(detail::epilogue_bias_copy(args.bias, args.vocab, bias_slot, stream, kOp));
  for (std::int64_t r0 = 0; r0 < args.tokens; r0 += l.chunk) {
    const std::int64_t c = args.tokens - r0 < l.chunk ? args.tokens - r0 : l.chunk;
    TIGON_CHECK(gemm.gemm(logits_gemm(r0, c), stream));
    auto at = [&](auto* q) { return q != nullptr ? q + r0 : nullptr; };
    const detail::LlpParams<T, I> p{.logits = logits, .dlogits = nullptr,
                                    .targets = args.targets + r0, .rows = c, .vocab = args.vocab,
                                    .ignore_index = args.ignore_index, .inv_temp = 1.0f / args.temperature,
                                    .logp = at(args.logp), .lse = at(args.lse), .entropy = at(args.entropy),
                                    .logit_sum = at(args.logit_sum), .is_top1 = at(args.is_top1),
                                    .error_count = args.error_count,
                                    .lse_in = nullptr, .entropy_in = nullptr, .grad_logp = nullptr,
                                    .grad_entropy = nullptr};
    TIGON_CHECK(detail::llp_launch(p, false, stream, kOp));
  }
  return Status();
}

// dx, dW and db (in G) from grad_logp / grad_entropy, the logits recomputed chunk by chunk
// (kept: read from the workspace the forward left them in, and overwritten with their gradient).
// Every chunk's GEMMs are checked with the back end before anything is written.
template <class Gemm = CublasLtGemm, class T, class I, class G>
[[nodiscard]] Status linear_logprob_backward(const LinearLogProbArgs<T, I, G>& args, Gemm& gemm, cudaStream_t stream) {
  constexpr const char* kOp = "linear_logprob_backward";
  TIGON_CHECK(detail::llp_validate(args, true, kOp));
  const detail::LlpLayout l = detail::llp_layout(args, true);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, l.total, kOp));
  auto* base = static_cast<unsigned char*>(args.workspace);
  T* logits = reinterpret_cast<T*>(base);
  T* ones = reinterpret_cast<T*>(base + l.ones_offset);
  T* bias_slot = reinterpret_cast<T*>(base + l.bias_offset);
  const T* bias = args.keep_logits ? nullptr : detail::epilogue_bias_ptr(args.bias, bias_slot);
  const std::int64_t xs = args.x_stride ? args.x_stride : args.hidden;
  const std::int64_t dxs = args.dx_stride ? args.dx_stride : args.hidden;
  // One chunk's GEMMs: kRun false only asks the back end whether it can run each.
  auto chunk_gemms = [&](auto run_c, std::int64_t r0, std::int64_t c, bool logits_gemm) -> Status {
    auto run = [&](const auto& g) { return detail::gemm_run_or_check<decltype(run_c)::value>(gemm, g, stream); };
    const T* xc = args.x + r0 * xs;
    if (logits_gemm) {
      return run(GemmArgs<T>{.a = xc, .b = args.weight, .d = logits, .bias = bias, .m = c, .n = args.vocab,
                             .k = args.hidden, .lda = xs, .op_b = Op::t});
    }
    const float beta = (args.accumulate || r0 > 0) ? 1.0f : 0.0f;
    if (args.dx != nullptr) {
      TIGON_CHECK(run(GemmArgs<T>{.a = logits, .b = args.weight, .d = args.dx + r0 * dxs, .m = c, .n = args.hidden,
                                  .k = args.vocab, .ldd = dxs}));
    }
    if (args.dweight != nullptr) {
      TIGON_CHECK(run(GemmArgs<T, G>{.a = logits, .b = xc, .c = args.dweight, .d = args.dweight, .m = args.vocab,
                                     .n = args.hidden, .k = c, .ldb = xs, .op_a = Op::t, .beta = beta}));
    }
    if (args.dbias != nullptr) {
      TIGON_CHECK(run(GemmArgs<T, G>{.a = ones, .b = logits, .c = args.dbias, .d = args.dbias, .m = 1,
                                     .n = args.vocab, .k = c, .beta = beta}));
    }
    return Status();
  };
  for (std::int64_t r0 = 0; r0 < args.tokens; r0 += l.chunk) {
    const std::int64_t c = args.tokens - r0 < l.chunk ? args.tokens - r0 : l.chunk;
    if (!args.keep_logits) TIGON_CHECK(chunk_gemms(std::false_type{}, r0, c, true));
    TIGON_CHECK(chunk_gemms(std::false_type{}, r0, c, false));
  }
  if (args.dbias != nullptr) {
    TIGON_CHECK(detail::fill_ones(ones, l.chunk, stream, kOp));
  }
  if (!args.keep_logits) TIGON_CHECK(detail::epilogue_bias_copy(args.bias, args.vocab, bias_slot, stream, kOp));
  for (std::int64_t r0 = 0; r0 < args.tokens; r0 += l.chunk) {
    const std::int64_t c = args.tokens - r0 < l.chunk ? args.tokens - r0 : l.chunk;
    if (!args.keep_logits) {  // kept: the forward's logits are in the workspace
      TIGON_CHECK(chunk_gemms(std::true_type{}, r0, c, true));
    }
    auto at = [&](const float* q) { return q != nullptr ? q + r0 : nullptr; };
    const detail::LlpParams<T, I> p{.logits = logits, .dlogits = logits,
                                    .targets = args.targets + r0, .rows = c, .vocab = args.vocab,
                                    .ignore_index = args.ignore_index, .inv_temp = 1.0f / args.temperature,
                                    .logp = nullptr, .lse = nullptr, .entropy = nullptr, .logit_sum = nullptr,
                                    .is_top1 = nullptr, .error_count = nullptr, .lse_in = at(args.lse),
                                    .entropy_in = at(args.entropy), .grad_logp = at(args.grad_logp),
                                    .grad_entropy = at(args.grad_entropy)};
    TIGON_CHECK(detail::llp_launch(p, true, stream, kOp));
    TIGON_CHECK(chunk_gemms(std::true_type{}, r0, c, false));
  }
  return Status();
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
