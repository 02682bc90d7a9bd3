// tigon/loss/divergence.cuh - distillation divergences between a student's and a teacher's
// distributions over a vocabulary ([rows, vocab] each): forward and reverse KL, the generalised
// Jensen-Shannon divergence, PyTorch's KL-divergence loss and the total variation distance, the
// loss reduced on the device and the student's gradient written in place over its input (or into
// a buffer of its own). Liger-Kernel 0.8.2's JSD, KLDiv and TVD ops are the reference semantics.
//
// Per element i of a row, with q the student's distribution and p the teacher's (fp32):
//   ForwardKL       p_i (log p_i - log q_i)                   d / d log q_i = -p_i
//   ReverseKL       q_i (log q_i - log p_i)                   d / d log q_i = q_i (log q_i - log p_i + 1)
//   GeneralizedJSD  b p_i log p_i + (1 - b) q_i log q_i - m_i log m_i,   m_i = b p_i + (1 - b) q_i
//                                                             d / d log q_i = (1 - b) q_i (log q_i - log m_i)
//                   (b = 0 and b = 1 are ForwardKL and ReverseKL exactly)
//   KLDiv           p_i (log max(p_i, eps) - log q_i) for a probability target, else p_i (log p_i - log q_i)
//                                                             d / d log q_i = -p_i
//   TVD             |q_i - p_i| / 2                           d / d q_i = +1/2 where q_i > p_i, else -1/2
// An element whose weighting probability is 0 contributes 0 (0 log 0 = 0). The student and the
// teacher each come as log-probabilities, probabilities or logits (then softmax(v / temperature)
// is taken inside, and the gradient goes through it back to the logits, times 1 / temperature).
// Rows whose label is ignore_index contribute 0 to the loss and get a zero gradient.
//
// Layout: arguments, the math (element forms and the divergence functors), validation, workspace
// and policy; then the kernels and the launchers (docs/divergence.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
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
#include "../core/async_copy.cuh"
#include "../core/launch.cuh"
#include "../core/reduce.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// The form of one side's values: log-probabilities (Liger's JSD and KLDiv(log_target=True)),
// probabilities (TVD, KLDiv's default target), or logits (softmax(v / temperature) inside).
enum class DivergenceInput : int { log_probs = 0, probs = 1, logits = 2 };

// batchmean: the sum over the non-ignored rows' elements divided by their count (all rows without
// labels); sum; mean: the sum divided by that count times vocab; none: no reduced loss (the
// per-element losses of KLDiv / TVD in loss_elems, the per-row losses of the JSD family in loss_rows).
enum class DivergenceReduction : int { none = 0, sum = 1, mean = 2, batchmean = 3 };

// T: the student's dtype (and its gradient's); TT: the teacher's, which may differ; I: the labels'.
template <class T, class TT = T, class I = std::int64_t>
struct DivergenceArgs {
  // Student (the input whose gradient is taken): [rows, vocab], row stride student_stride (0: vocab).
  const T* student = nullptr;
  DivergenceInput student_input = DivergenceInput::log_probs;
  std::int64_t student_stride = 0;
  // Teacher: [rows, teacher_vocab], row stride teacher_stride (0: its vocabulary).
  const TT* teacher = nullptr;
  DivergenceInput teacher_input = DivergenceInput::log_probs;
  std::int64_t teacher_stride = 0;
  std::int64_t rows = 0;
  std::int64_t vocab = 0;
  std::int64_t teacher_vocab = 0;  // 0: vocab; otherwise it must equal vocab
  float temperature = 1.0f;        // divides the logits of a side given as logits (> 0)
  // Labels [rows] (optional): a row whose label is ignore_index contributes nothing.
  const I* labels = nullptr;
  std::int64_t ignore_index = -100;
  DivergenceReduction reduction = DivergenceReduction::batchmean;
  // Gradient with respect to the student's values, in their form (log-probs, probs, or logits):
  // null computes the loss only; may be `student` itself (in place, same stride).
  T* dx = nullptr;
  std::int64_t dx_stride = 0;
  // Upstream gradient: grad_scale (a host scalar) times, when given, grad_output on the device: one
  // value under batchmean / sum / mean; under none [rows] values for the JSD family, [rows, vocab]
  // (row stride grad_output_stride, 0: vocab) for KLDiv and TVD.
  float grad_scale = 1.0f;
  const float* grad_output = nullptr;
  std::int64_t grad_output_stride = 0;
  // Outputs, each optional.
  float* loss = nullptr;        // [1]: the reduced loss (not under none)
  float* loss_rows = nullptr;   // [rows]: each row's sum of element losses (0 for ignored rows)
  float* loss_elems = nullptr;  // [rows, vocab], row stride loss_elems_stride: each element's loss
  std::int64_t loss_elems_stride = 0;
  void* workspace = nullptr;    // divergence_workspace_bytes(), 16-byte aligned
  std::size_t workspace_bytes = 0;
};

// ------------------------------------------------------------------------------------------------
// 2. Math
// ------------------------------------------------------------------------------------------------

// One element of a row as a divergence functor sees it: each side's log-probability and
// probability (both derived from the form the side was given in; the forms a functor does not read
// are never computed in the kernels), the two input forms as compile-time constants, and whether
// the kernel computes exp and log with the hardware approximations (fast_math: a 16-bit student,
// whose gradient's rounding is 500x coarser than their error; div_math::log_of<E> follows it).
template <DivergenceInput kStudent, DivergenceInput kTeacher, bool kFastMath = false>
struct DivergenceElement {
  static constexpr DivergenceInput student_input = kStudent;
  static constexpr DivergenceInput teacher_input = kTeacher;
  static constexpr bool fast_math = kFastMath;
  float x_log, x_prob;  // student: log q_i, q_i
  float y_log, y_prob;  // teacher: log p_i, p_i
};

// A functor's answer for one element: its loss and the derivative of that loss with respect to the
// student's log-probability (kGradForm log_probs) or probability (kGradForm probs).
struct DivergenceValue {
  float loss;
  float grad;
};

namespace div_math {

inline constexpr float kNegInf = -__builtin_huge_valf();
// -2^126: a floor for a log-probability, so that a side whose probability is 0 (log -inf) gives
// 0 * finite = 0 in a p log p term.
inline constexpr float kLogFloor = -8.50705917e37f;

// exp and log in fp32. Accurate (kFast false): CUDA's expf / logf, a couple of ulp, for fp32
// students. Fast: the hardware approximations __expf (2 + floor(|1.173 x|) ulp) and __logf
// (absolute error 2^-21.41 on [0.5, 2]), for 16-bit students, whose gradients round to 2^-8 or
// 2^-11 relative; with accurate logf the generalised JSD is bound by the FP32 pipe at half the
// copy rate, with the intrinsics it streams at the copy rate.
template <bool kFast = false>
TIGON_HD float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast) return exp2_ftz(x * kLog2e);  // __expf, subnormals flushed
#endif
  return ::expf(x);
}
template <bool kFast = false>
TIGON_HD float log_f32(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast) return log2_ftz(x) * kLn2;  // __logf, subnormals flushed
#endif
  return ::logf(x);
}
// log in the precision of element E's kernel: what a functor calls.
template <class E>
TIGON_HD float log_of(float x) {
  return log_f32<E::fast_math>(x);
}

// One side's log-probability and probability from its value v in form K (lse: the logsumexp of the
// row's v / temperature, for logits).
template <DivergenceInput K, bool kFast = false>
TIGON_HD void element_forms(float v, float inv_temp, float lse, float& lg, float& pr) {
  if constexpr (K == DivergenceInput::log_probs) {
    lg = v;
    pr = exp_f32<kFast>(v);
  } else if constexpr (K == DivergenceInput::probs) {
    pr = v;
    lg = log_f32<kFast>(v);
  } else {
    lg = v * inv_temp - lse;
    pr = exp_f32<kFast>(lg);
  }
}

// Fold kN values into a running (max, sum of exp relative to the max); -inf values add nothing.
template <int kN, bool kFast = false>
TIGON_HD void lse_fold(float& m, float& s, const float (&v)[kN]) {
  float vm = v[0];
  for (int k = 1; k < kN; ++k) vm = fmaxf(vm, v[k]);
  const float mm = fmaxf(m, vm);
  if (mm == kNegInf) return;
  float t = 0.0f;
  for (int k = 0; k < kN; ++k) t += exp_f32<kFast>(v[k] - mm);
  s = s * exp_f32<kFast>(m - mm) + t;
  m = mm;
}

// Merge two (max, sum of exp relative to the max) pairs.
TIGON_HD void lse_merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == kNegInf) return;
  s = s * exp_f32(m - mm) + s2 * exp_f32(m2 - mm);
  m = mm;
}

}  // namespace div_math

// ---- The divergence functors ----
//
// A divergence is a struct with
//
//   template <class E> TIGON_HD DivergenceValue operator()(const E& e) const;
//
// where E is a DivergenceElement<kStudent, kTeacher> (fp32; read e.x_log, e.x_prob, e.y_log,
// e.y_prob, and E::student_input / E::teacher_input where the formula depends on the form), and
// optionally (defaults in brackets):
//
//   static constexpr DivergenceInput kGradForm;   // grad is d / d log q (log_probs) or d / d q (probs) [log_probs]
//   static constexpr bool kElementwiseNone;       // reduction none: per-element losses and grad_output [false: per row]
//   static constexpr bool accepts(DivergenceInput student, DivergenceInput teacher);
//                                                 // the input forms it takes [log-probs or logits, each side]
//   Status validate(const char* op) const;        // its runtime parameters [none]
//   static constexpr const char* kName;           // for messages ["the divergence"]
//
// Its members (beta, eps, ...) are runtime values passed to the kernel by value. Any such struct
// works as the functor of divergence().

// KL(teacher || student) = sum_i p_i (log p_i - log q_i): Liger's JSD with beta = 0.
struct ForwardKL {
  static constexpr const char* kName = "ForwardKL";
  static constexpr DivergenceInput kGradForm = DivergenceInput::log_probs;
  static constexpr bool kElementwiseNone = false;
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s != DivergenceInput::probs && t != DivergenceInput::probs;
  }
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    return {e.y_prob != 0.0f ? e.y_prob * (e.y_log - e.x_log) : 0.0f, -e.y_prob};
  }
};

// KL(student || teacher) = sum_i q_i (log q_i - log p_i): Liger's JSD with beta = 1.
struct ReverseKL {
  static constexpr const char* kName = "ReverseKL";
  static constexpr DivergenceInput kGradForm = DivergenceInput::log_probs;
  static constexpr bool kElementwiseNone = false;
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s != DivergenceInput::probs && t != DivergenceInput::probs;
  }
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    if (e.x_prob == 0.0f) return {0.0f, 0.0f};
    const float l = e.x_prob * (e.x_log - e.y_log);
    return {l, l + e.x_prob};
  }
};

// Liger's generalised JSD: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q, with
// beta in [0, 1]; beta 0 and 1 are ForwardKL and ReverseKL (as Liger special-cases them: the
// mixture's own limits vanish, though JSD(beta) / beta and JSD(beta) / (1 - beta) tend to them).
struct GeneralizedJSD {
  static constexpr const char* kName = "GeneralizedJSD";
  static constexpr DivergenceInput kGradForm = DivergenceInput::log_probs;
  static constexpr bool kElementwiseNone = false;
  float beta = 0.5f;
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s != DivergenceInput::probs && t != DivergenceInput::probs;
  }
  Status validate(const char* op) const {
    if (check::finite_in(beta, 0.0f, 1.0f)) return Status();  // by its bits: holds under -ffast-math
    return Status::error(Errc::invalid_value, op, "beta", "must be in [0, 1], got " + std::to_string(beta));
  }
  // The divergence for beta strictly inside (0, 1), without the two limits' branches: the functor
  // the kernels take for such a beta (divergence() substitutes it; tests of a runtime beta inside
  // the kernels' unrolled element loops cost every element all three formulas).
  struct Mixture {
    static constexpr const char* kName = "GeneralizedJSD";
    static constexpr DivergenceInput kGradForm = DivergenceInput::log_probs;
    static constexpr bool kElementwiseNone = false;
    float beta = 0.5f;
    // l = bp log p + bq log q - m log m = bp (log p - log m) + bq (log q - log m), m = bp + bq: no
    // cancellation, and no branches: m is floored at 2^-126 (a smaller m adds nothing and its
    // log would be -inf), each log-probability at -2^126 (so that a side whose probability is 0,
    // log -inf, gives 0 * finite = 0).
    template <class E>
    TIGON_HD DivergenceValue operator()(const E& e) const {
      using div_math::kLogFloor;
      const float bp = beta * e.y_prob;
      const float bq = (1.0f - beta) * e.x_prob;
      const float log_m = div_math::log_of<E>(fmaxf(bp + bq, kMinNormal));
      const float gq = bq * (fmaxf(e.x_log, kLogFloor) - log_m);
      return {fmaf(bp, fmaxf(e.y_log, kLogFloor) - log_m, gq), gq};
    }
  };
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    if (beta == 0.0f) return ForwardKL{}(e);
    if (beta == 1.0f) return ReverseKL{}(e);
    return Mixture{beta}(e);
  }
};

// PyTorch's F.kl_div(input = student log-probs, target = teacher) as Liger computes it: a
// probability target (log_target=False) is clamped to eps inside the log, a log-probability (or
// logits) target is used as is (log_target=True). Reduction none gives per-element losses.
struct KLDiv {
  static constexpr const char* kName = "KLDiv";
  static constexpr DivergenceInput kGradForm = DivergenceInput::log_probs;
  static constexpr bool kElementwiseNone = true;
  float eps = 1e-10f;
  static constexpr bool accepts(DivergenceInput s, DivergenceInput) { return s != DivergenceInput::probs; }
  Status validate(const char* op) const {
    if (check::finite_in(eps, 0.0f)) return Status();  // by its bits: holds under -ffast-math
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    const float t = e.y_prob;
    if constexpr (E::teacher_input == DivergenceInput::probs) {
      // Under fast math the logarithm flushes a subnormal t to 0: such a t adds nothing.
      const bool live = E::fast_math ? t >= kMinNormal : t != 0.0f;
      return {live ? t * (div_math::log_of<E>(fmaxf(t, eps)) - e.x_log) : 0.0f, -t};
    } else {
      return {t != 0.0f ? t * (e.y_log - e.x_log) : 0.0f, -t};
    }
  }
};

// Total variation distance |q - p| / 2 per element, its gradient +-1/2 with respect to the
// student's probability (Liger's convention: -1/2 where they are equal). Reduction none gives
// per-element losses.
struct TVD {
  static constexpr const char* kName = "TVD";
  static constexpr DivergenceInput kGradForm = DivergenceInput::probs;
  static constexpr bool kElementwiseNone = true;
  static constexpr bool accepts(DivergenceInput, DivergenceInput) { return true; }
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    const float d = e.x_prob - e.y_prob;
    return {0.5f * fabsf(d), d > 0.0f ? 0.5f : -0.5f};
  }
};

// ---- A functor's traits, with the defaults of the members it may leave out ----

namespace detail {

template <class D>
TIGON_HD constexpr DivergenceInput div_grad_form() {
  if constexpr (requires { D::kGradForm; }) {
    return D::kGradForm;
  } else {
    return DivergenceInput::log_probs;
  }
}

template <class D>
TIGON_HD constexpr bool div_elementwise_none() {
  if constexpr (requires { D::kElementwiseNone; }) {
    return D::kElementwiseNone;
  } else {
    return false;
  }
}

template <class D>
constexpr const char* div_name() {
  if constexpr (requires { D::kName; }) {
    return D::kName;
  } else {
    return "the divergence";
  }
}

// Whether D takes a student given in form s and a teacher in form t. A gradient taken against
// log-probabilities cannot be turned into one against a probability input.
template <class D>
constexpr bool div_accepts(DivergenceInput s, DivergenceInput t) {
  if (s == DivergenceInput::probs && div_grad_form<D>() == DivergenceInput::log_probs) return false;
  if constexpr (requires { D::accepts(DivergenceInput{}, DivergenceInput{}); }) {
    return D::accepts(s, t);
  } else {
    return s != DivergenceInput::probs && t != DivergenceInput::probs;
  }
}

}  // namespace detail

namespace div_math {

// One element: the functor's loss, and its gradient with respect to the student's value in form
// kS (with respect to the log-probability when the student is given as logits); x_prob: q_i.
template <class D, DivergenceInput kS, DivergenceInput kT, bool kFast = false>
TIGON_HD DivergenceValue evaluate(const D& div, float x, float y, float inv_temp, float lse_x, float lse_y,
                                  float& x_prob) {
  DivergenceElement<kS, kT, kFast> e;
  element_forms<kS, kFast>(x, inv_temp, lse_x, e.x_log, e.x_prob);
  element_forms<kT, kFast>(y, inv_temp, lse_y, e.y_log, e.y_prob);
  DivergenceValue v = div(e);
  if constexpr (detail::div_grad_form<D>() == DivergenceInput::probs && kS != DivergenceInput::probs) {
    v.grad *= e.x_prob;  // d / d log q = q d / d q
  }
  x_prob = e.x_prob;
  return v;
}

// The same with each logits side's probability given (px, py: exp(v / T - lse), formed by the
// caller from an exponential it already took); the other forms as in evaluate.
template <class D, DivergenceInput kS, DivergenceInput kT, bool kFast = false>
TIGON_HD DivergenceValue evaluate_given(const D& div, float x, float y, float inv_temp, float lse_x, float lse_y,
                                        float px, float py, float& x_prob) {
  DivergenceElement<kS, kT, kFast> e;
  if constexpr (kS == DivergenceInput::logits) {
    e.x_log = fmaf(x, inv_temp, -lse_x);
    e.x_prob = px;
  } else {
    element_forms<kS, kFast>(x, inv_temp, lse_x, e.x_log, e.x_prob);
  }
  if constexpr (kT == DivergenceInput::logits) {
    e.y_log = fmaf(y, inv_temp, -lse_y);
    e.y_prob = py;
  } else {
    element_forms<kT, kFast>(y, inv_temp, lse_y, e.y_log, e.y_prob);
  }
  DivergenceValue v = div(e);
  if constexpr (detail::div_grad_form<D>() == DivergenceInput::probs && kS != DivergenceInput::probs) {
    v.grad *= e.x_prob;
  }
  x_prob = e.x_prob;
  return v;
}

}  // namespace div_math

// ------------------------------------------------------------------------------------------------
// 3. Validation, workspace and policy
// ------------------------------------------------------------------------------------------------

namespace detail {

inline const char* div_input_name(DivergenceInput k) {
  switch (k) {
    case DivergenceInput::log_probs: return "log-probs";
    case DivergenceInput::probs: return "probs";
    case DivergenceInput::logits: return "logits";
  }
  return "unknown";
}

inline bool div_input_valid(DivergenceInput k) {
  return k == DivergenceInput::log_probs || k == DivergenceInput::probs || k == DivergenceInput::logits;
}

// Rows of this many columns at most (indices within a row are 32-bit).
inline constexpr std::int64_t kDivMaxVocab = std::int64_t{1} << 30;

// The streaming kernel's chunk: each block takes this many columns of one row (a row of more
// columns takes several blocks, whose partial loss sums the finish kernel adds).
inline constexpr std::int64_t kDivChunkCols = 8192;

// The kernels compute exp and log with the hardware approximations for a 16-bit student
// (div_math::exp_f32), accurately for an fp32 one.
template <class T>
inline constexpr bool kDivFastMath = sizeof(T) < 4;

// Whether the call takes the streaming kernel (neither side given as logits), and the blocks (chunks)
// a row takes: ceil(vocab / kDivChunkCols) on the streaming kernel, 1 on the row kernel.
template <class T, class TT, class I>
bool div_streaming(const DivergenceArgs<T, TT, I>& a) {
  return a.student_input != DivergenceInput::logits && a.teacher_input != DivergenceInput::logits;
}
template <class T, class TT, class I>
std::int64_t div_chunks(const DivergenceArgs<T, TT, I>& a) {
  return div_streaming(a) ? ceil_div(a.vocab, kDivChunkCols) : 1;
}

// The workspace plan: the device count of non-ignored rows (labels under batchmean / mean: 16
// bytes at byte 0), then the per-chunk partial loss sums [rows, chunks] (at byte 16) when the loss
// or the row sums are asked for, unless the row sums go straight to loss_rows (one chunk a row); a
// 256-byte multiple. `finish`: the finish kernel forms loss_rows and the loss from the partials.
struct DivWorkspace {
  bool count = false;
  bool partials = false;
  bool finish = false;
  std::int64_t chunks = 1;
  std::size_t bytes = 0;
};
template <class T, class TT, class I>
DivWorkspace div_workspace(const DivergenceArgs<T, TT, I>& a) {
  DivWorkspace w;
  w.count = a.labels != nullptr &&
            (a.reduction == DivergenceReduction::batchmean || a.reduction == DivergenceReduction::mean);
  w.chunks = div_chunks(a);
  const bool sums = a.loss != nullptr || a.loss_rows != nullptr;
  w.partials = sums && (w.chunks > 1 || a.loss_rows == nullptr);
  w.finish = a.loss != nullptr || (sums && w.partials);
  if (w.count || w.partials) {
    const std::size_t n = w.partials ? static_cast<std::size_t>(a.rows * w.chunks) : 0u;
    w.bytes = round_up<std::size_t>(16 + n * 4u, 256u);
  }
  return w;
}

// Everything the functor does not decide: pointers, sizes, strides, scalars, aliasing.
// The options every divergence op takes (the element-wise op and linear_divergence): temperature,
// reduction, the reduced loss's absence under none, grad_scale.
inline Status validate_divergence_options(float temperature, DivergenceReduction reduction, const float* loss,
                                          float grad_scale, const char* op) {
  if (!check::finite_in(temperature, 0.0f, __builtin_huge_valf(), true)) {
    return Status::error(Errc::invalid_value, op, "temperature", "must be finite and > 0, got " + std::to_string(temperature));
  }
  if (reduction != DivergenceReduction::none && reduction != DivergenceReduction::sum &&
      reduction != DivergenceReduction::mean && reduction != DivergenceReduction::batchmean) {
    return Status::error(Errc::invalid_value, op, "reduction", "unknown reduction");
  }
  if (reduction == DivergenceReduction::none && loss != nullptr) {
    return Status::error(Errc::invalid_value, op, "loss",
                         "reduction none has no reduced loss: use loss_rows or loss_elems");
  }
  return check::finite(grad_scale, op, "grad_scale");
}

template <class T, class TT, class I>
Status validate_divergence_args(const DivergenceArgs<T, TT, I>& a, const char* op) {
  using namespace check;
  static_assert(Element<T> && Element<TT>, "student and teacher are float, half or bfloat16");
  static_assert(std::is_same_v<I, std::int64_t> || std::is_same_v<I, std::int32_t>, "labels are int32 or int64");
  TIGON_CHECK(not_null(a.student, op, "student"));
  TIGON_CHECK(not_null(a.teacher, op, "teacher"));
  TIGON_CHECK(positive(a.rows, op, "rows"));
  TIGON_CHECK(positive(a.vocab, op, "vocab"));
  TIGON_CHECK(at_most(a.vocab, kDivMaxVocab, op, "vocab"));
  if (a.teacher_vocab != 0 && a.teacher_vocab != a.vocab) {
    return Status::error(Errc::invalid_size, op, "teacher_vocab",
                         "the teacher's vocabulary (" + std::to_string(a.teacher_vocab) +
                             ") differs from the student's (" + std::to_string(a.vocab) + ")");
  }
  if (!div_input_valid(a.student_input)) {
    return Status::error(Errc::invalid_value, op, "student_input", "unknown input form");
  }
  if (!div_input_valid(a.teacher_input)) {
    return Status::error(Errc::invalid_value, op, "teacher_input", "unknown input form");
  }
  TIGON_CHECK(validate_divergence_options(a.temperature, a.reduction, a.loss, a.grad_scale, op));
  TIGON_CHECK(row_stride(a.student_stride, a.vocab, op, "student_stride"));
  TIGON_CHECK(row_stride(a.teacher_stride, a.vocab, op, "teacher_stride"));
  TIGON_CHECK(row_stride(a.dx_stride, a.vocab, op, "dx_stride"));
  TIGON_CHECK(row_stride(a.loss_elems_stride, a.vocab, op, "loss_elems_stride"));
  TIGON_CHECK(row_stride(a.grad_output_stride, a.vocab, op, "grad_output_stride"));
  // Aliasing: the gradient may be the student itself; nothing else (the bytes of the workspace the
  // call uses among the outputs) may overlap an input or another output.
  const std::size_t ws_bytes = a.workspace != nullptr ? div_workspace(a).bytes : 0;
  const NamedView outs[] = {
      {a.dx != nullptr ? MatrixView::of(a.dx, a.rows, a.vocab, a.dx_stride) : MatrixView{}, "dx"},
      {a.loss != nullptr ? MatrixView::of(a.loss, 1, 1, 0) : MatrixView{}, "loss"},
      {a.loss_rows != nullptr ? MatrixView::of(a.loss_rows, 1, a.rows, 0) : MatrixView{}, "loss_rows"},
      {a.loss_elems != nullptr ? MatrixView::of(a.loss_elems, a.rows, a.vocab, a.loss_elems_stride) : MatrixView{},
       "loss_elems"},
      {vector_view(a.workspace, static_cast<std::int64_t>(ws_bytes), 1), "workspace"}};
  const NamedView ins[] = {
      {MatrixView::of(a.student, a.rows, a.vocab, a.student_stride), "student"},
      {MatrixView::of(a.teacher, a.rows, a.vocab, a.teacher_stride), "teacher"},
      {a.labels != nullptr ? MatrixView::of(a.labels, 1, a.rows, 0) : MatrixView{}, "labels"}};
  return buffers_disjoint(outs, ins, op, a.student);
}

// grad_output's extent: one value, one per row, or one per element (reduction none).
template <class D, class T, class TT, class I>
MatrixView div_grad_output_view(const DivergenceArgs<T, TT, I>& a) {
  if (a.grad_output == nullptr) return MatrixView{};
  if (a.reduction != DivergenceReduction::none) return MatrixView::of(a.grad_output, 1, 1, 0);
  if (div_elementwise_none<D>()) return MatrixView::of(a.grad_output, a.rows, a.vocab, a.grad_output_stride);
  return MatrixView::of(a.grad_output, 1, a.rows, 0);
}

// What depends on the functor: the input forms it takes, its own parameters, grad_output's extent.
template <class D, class T, class TT, class I>
Status validate_divergence_call(const DivergenceArgs<T, TT, I>& a, const D& div, const char* op) {
  using namespace check;
  if (!div_accepts<D>(a.student_input, a.teacher_input)) {
    bool student_ok = false;
    for (DivergenceInput t : {DivergenceInput::log_probs, DivergenceInput::probs, DivergenceInput::logits}) {
      student_ok = student_ok || div_accepts<D>(a.student_input, t);
    }
    return Status::error(Errc::unsupported, op, student_ok ? "teacher_input" : "student_input",
                         std::string(div_name<D>()) + " does not take a student given as " +
                             div_input_name(a.student_input) + " with a teacher given as " +
                             div_input_name(a.teacher_input));
  }
  if constexpr (requires { { div.validate(op) } -> std::convertible_to<Status>; }) {
    TIGON_CHECK(div.validate(op));
  }
  const MatrixView go = div_grad_output_view<D>(a);
  if (go.ptr != nullptr) {
    if (a.dx != nullptr) TIGON_CHECK(disjoint(MatrixView::of(a.dx, a.rows, a.vocab, a.dx_stride), go, op, "dx", "grad_output"));
    const std::size_t ws_bytes = a.workspace != nullptr ? div_workspace(a).bytes : 0;
    const void* const outs[] = {a.loss, a.loss_rows, a.loss_elems, ws_bytes != 0 ? a.workspace : nullptr};
    const MatrixView views[] = {MatrixView::of(a.loss, 1, 1, 0), MatrixView::of(a.loss_rows, 1, a.rows, 0),
                                MatrixView::of(a.loss_elems, a.rows, a.vocab, a.loss_elems_stride),
                                vector_view(a.workspace, static_cast<std::int64_t>(ws_bytes), 1)};
    const char* names[] = {"loss", "loss_rows", "loss_elems", "workspace"};
    for (int i = 0; i < 4; ++i) {
      if (outs[i] != nullptr) TIGON_CHECK(disjoint(views[i], go, op, names[i], "grad_output"));
    }
  }
  return Status();
}

}  // namespace detail

// The divergence kernels' tuning, CUB-style: the members are the defaults; derive and override,
//   struct MyPolicy : tigon::DivergencePolicy { static constexpr int kStreamUnroll = 4; };
// and pass it as divergence<MyPolicy>(args, div, stream).
//
// Which kernel takes a call: with neither side given as logits, the streaming kernel (one block
// per 8192-column chunk of a row, every element read once and its gradient written from
// registers, a block reduction of the chunk's loss); with logits on either side, the row kernel
// (one block per row: the logsumexp of each logits side, then a pass for the loss and the
// gradient's row sum, then, for student logits with a gradient, a pass that writes the gradient;
// the later passes re-read the row, from L2 where it stayed). 16-byte vectors where the pointers,
// strides and vocabulary allow; single elements otherwise.
struct DivergencePolicy {
  // Streaming kernel: block size, and 16-byte vectors of each input each thread has in flight.
  static constexpr int kStreamThreads = 256;
  static constexpr int kStreamUnroll = 2;
  // Streaming kernel: each block asks the L2 for the chunk of the block this many blocks on (one
  // bulk prefetch per input; 0: none), so that DRAM has those bytes in flight while the block
  // computes, with no registers holding them.
  static constexpr int kStreamAhead = 0;
  // Resident kernel (logits on either side, sm_90+, rows of 16-byte units that fit a cluster of
  // 16 blocks): block size, elements of each input a thread holds, blocks per SM the registers
  // are sized for, and how many of its cluster's rows ahead each block asks the L2 for its slices
  // of (0: none).
  static constexpr int kResThreads = 256;
  static constexpr int kResElems = 32;
  static constexpr int kResMinBlocks = 2;
  static constexpr int kResAhead = 2;
  // Row kernel (logits on other GPUs, unaligned rows, rows over 16 blocks of the resident
  // kernel): block size, and vectors of each input in flight per thread in each pass.
  static constexpr int kRowThreads = 512;
  static constexpr int kRowUnroll = 2;
};

namespace detail {
// The static checks of a policy, run by the launcher.
template <class P>
constexpr bool check_divergence_policy() {
  static_assert(P::kStreamThreads % 32 == 0 && P::kStreamThreads >= 32 && P::kStreamThreads <= 1024,
                "streaming kernel: a whole number of warps, at most 1024 threads");
  static_assert(P::kRowThreads % 32 == 0 && P::kRowThreads >= 32 && P::kRowThreads <= 1024,
                "row kernel: a whole number of warps, at most 1024 threads");
  static_assert(P::kStreamUnroll >= 1 && P::kStreamUnroll <= 8 && P::kRowUnroll >= 1 && P::kRowUnroll <= 8,
                "1 to 8 vectors of each input in flight per thread");
  static_assert(P::kStreamAhead >= 0, "kStreamAhead: 0 (off) or more blocks");
  static_assert(P::kResThreads % 32 == 0 && P::kResThreads >= 32 && P::kResThreads <= 1024,
                "resident kernel: a whole number of warps, at most 1024 threads");
  static_assert(P::kResElems >= 8 && P::kResElems <= 64 && P::kResElems % 8 == 0,
                "resident kernel: 8 to 64 elements of each input per thread, a multiple of 8");
  static_assert(P::kResMinBlocks >= 1 && P::kResMinBlocks <= 8, "resident kernel: 1 to 8 blocks per SM");
  static_assert(P::kResAhead >= 0, "kResAhead: 0 (off) or more of the cluster's rows");
  return true;
}
}  // namespace detail

// Bytes of workspace divergence(args, div) needs (0 when none): the count of non-ignored rows when
// labels are given under batchmean / mean, and the partial loss sums of each row's chunks (4 bytes
// per row and chunk of 8192 columns; one chunk a row with logits) when the loss or the row sums are
// asked for, unless the row sums go straight to `loss_rows`. Validates what does not depend on the
// functor as the launch will.
template <class T, class TT, class I>
[[nodiscard]] Status divergence_workspace_bytes(const DivergenceArgs<T, TT, I>& args, std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(detail::validate_divergence_args(args, "divergence_workspace_bytes"));
  bytes = detail::div_workspace(args).bytes;
  return Status();
}

TIGON_NAMESPACE_END

// ------------------------------------------------------------------------------------------------
// 4. Kernels
// ------------------------------------------------------------------------------------------------

#if defined(__CUDACC__)

#include <cub/block/block_reduce.cuh>

TIGON_NAMESPACE_BEGIN

namespace detail {

template <class T, class TT, class I>
struct DivParams {
  const T* x;   // student
  const TT* y;  // teacher
  T* dx;        // gradient, or null
  std::int64_t rows, vocab, xs, ys, dxs;
  const I* labels;
  std::int64_t ignore_index;
  float inv_temp;
  float grad_scale;
  const float* go;        // one upstream gradient value (go_per_row 0) or one per row, or null
  int go_per_row;
  const float* go_elems;  // per-element upstream gradient [rows, vocab] (row stride gos), or null
  std::int64_t gos;
  const float* count;     // the device count of non-ignored rows, or null
  float den;              // the denominator: count[0] * den with a count, else den
  float* partials;        // the loss sums [rows, chunks] (a chunk: kDivChunkCols columns), or null
  std::int64_t chunks;    // chunks a row: ceil(vocab / kDivChunkCols) (streaming kernel), 1 (row kernel)
  float* loss_elems;      // per-element losses (row stride les), or null
  std::int64_t les;
};

// kN elements of X as 16-byte vectors (fewer when kN is smaller than one vector).
template <class X, int kN>
struct DivVecs {
  static constexpr int kV = kN < kVecElems<X> ? kN : kVecElems<X>;
  static constexpr int kCount = kN / kV;
  AlignedVec<X, kV> v[kCount];
};

template <int kN, class X>
TIGON_DEVICE DivVecs<X, kN> div_load(const X* p, std::uint64_t pol) {
  using V = DivVecs<X, kN>;
  V r;
#pragma unroll
  for (int a = 0; a < V::kCount; ++a) r.v[a] = load_vec_policy<V::kV>(p + a * V::kV, pol);
  return r;
}

template <int kN, class X>
TIGON_DEVICE void div_floats(const DivVecs<X, kN>& r, float (&f)[kN]) {
  using V = DivVecs<X, kN>;
#pragma unroll
  for (int a = 0; a < V::kCount; ++a) {
    float t[V::kV];
    to_floats(r.v[a], t);
#pragma unroll
    for (int k = 0; k < V::kV; ++k) f[a * V::kV + k] = t[k];
  }
}

template <int kN, class X>
TIGON_DEVICE void div_store(X* p, const float (&f)[kN], std::uint64_t pol) {
  using V = DivVecs<X, kN>;
#pragma unroll
  for (int a = 0; a < V::kCount; ++a) {
    float t[V::kV];
#pragma unroll
    for (int k = 0; k < V::kV; ++k) t[k] = f[a * V::kV + k];
    store_vec_policy(p + a * V::kV, from_floats<X>(t), pol);
  }
}

template <class T, class TT, class I>
TIGON_DEVICE bool div_ignored(const DivParams<T, TT, I>& p, std::int64_t row) {
  return p.labels != nullptr && static_cast<std::int64_t>(p.labels[row]) == p.ignore_index;
}

// The row's gradient factor: grad_scale times the upstream value over the reduction's
// denominator (0 when the denominator is: every row is ignored).
template <class T, class TT, class I>
TIGON_DEVICE float div_row_factor(const DivParams<T, TT, I>& p, std::int64_t row) {
  const float den = p.count != nullptr ? p.count[0] * p.den : p.den;
  if (den == 0.0f) return 0.0f;
  const float up = p.go != nullptr ? p.go[p.go_per_row ? row : 0] : 1.0f;
  return p.grad_scale * up / den;
}

// Vectors [v0, v1) of an ignored row: zero gradient and element losses; its inputs are not read.
template <int kN, int kThreads, class T, class TT, class I>
TIGON_DEVICE void div_zero(const DivParams<T, TT, I>& p, std::int64_t row, int v0, int v1, std::uint64_t pol) {
  float z[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) z[k] = 0.0f;
  T* dr = p.dx != nullptr ? p.dx + row * p.dxs : nullptr;
  float* lr = p.loss_elems != nullptr ? p.loss_elems + row * p.les : nullptr;
  for (int i = v0 + static_cast<int>(threadIdx.x); i < v1; i += kThreads) {
    const std::int64_t c0 = static_cast<std::int64_t>(i) * kN;
    if (dr != nullptr) div_store<kN>(dr + c0, z, pol);
    if (lr != nullptr) div_store<kN>(lr + c0, z, pol);
  }
}

// ---- The streaming kernel (neither side given as logits) ----

// One block per chunk of kDivChunkCols columns of one row (the grid walks the chunks when it holds
// fewer blocks), so every block streams about the same bytes and the grid drains evenly. Each
// thread takes the chunk's vectors tid, tid + kThreads, ..., kU of each input in flight per trip
// (read with the evict-first L2 priority: used once), computes each element's loss and gradient,
// writes the gradient (and the element losses) from registers, and adds the losses in a fixed
// order; one CUB block reduction gives the chunk's partial sum.
template <class D, DivergenceInput kS, DivergenceInput kT, class T, class TT, class I, int kN, int kThreads, int kU,
          int kAhead>
TIGON_KERNEL void __launch_bounds__(kThreads) div_stream_kernel(const DivParams<T, TT, I> p, const D div) {
  detail::grid_dependency_sync();
  using Reduce = cub::BlockReduce<float, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  __shared__ typename Reduce::TempStorage tmp;
  constexpr int kChunkVecs = static_cast<int>(kDivChunkCols / kN);
  const int nvec = static_cast<int>(p.vocab / kN);
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const std::int64_t blocks = p.rows * p.chunks;
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::int64_t row = b / p.chunks;
    const int v0 = static_cast<int>(b - row * p.chunks) * kChunkVecs;
    const int v1 = min(v0 + kChunkVecs, nvec);
    // The chunk kAhead blocks on, asked of the L2 (16-byte vectors only: their rows are aligned).
    if constexpr (kAhead > 0 && kN > 1) {
      const std::int64_t nb = b + kAhead;
      if (tid == 0 && nb < blocks) {
        const std::int64_t nrow = nb / p.chunks;
        const int n0 = static_cast<int>(nb - nrow * p.chunks) * kChunkVecs;
        const int n1 = min(n0 + kChunkVecs, nvec);
        if (n1 > n0 && !div_ignored(p, nrow)) {
          prefetch_l2_bulk(p.x + nrow * p.xs + static_cast<std::int64_t>(n0) * kN,
                           static_cast<unsigned>((n1 - n0) * kN * sizeof(T)));
          prefetch_l2_bulk(p.y + nrow * p.ys + static_cast<std::int64_t>(n0) * kN,
                           static_cast<unsigned>((n1 - n0) * kN * sizeof(TT)));
        }
      }
    }
    if (div_ignored(p, row)) {
      div_zero<kN, kThreads>(p, row, v0, v1, drop);
      if (tid == 0 && p.partials != nullptr) p.partials[b] = 0.0f;
      continue;
    }
    const T* xr = p.x + row * p.xs;
    const TT* yr = p.y + row * p.ys;
    T* dr = p.dx != nullptr ? p.dx + row * p.dxs : nullptr;
    float* lr = p.loss_elems != nullptr ? p.loss_elems + row * p.les : nullptr;
    // A per-element upstream gradient scales the gradient only: not read for the loss alone.
    const float* wr = (p.go_elems != nullptr && dr != nullptr) ? p.go_elems + row * p.gos : nullptr;
    const float f = div_row_factor(p, row);
    float acc = 0.0f;
    for (int i = v0 + tid; i < v1; i += kU * kThreads) {
      DivVecs<T, kN> xv[kU];
      DivVecs<TT, kN> yv[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = i + u * kThreads;
        if (j < v1) {
          xv[u] = div_load<kN>(xr + static_cast<std::int64_t>(j) * kN, drop);
          yv[u] = div_load<kN>(yr + static_cast<std::int64_t>(j) * kN, drop);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = i + u * kThreads;
        if (j >= v1) break;
        const std::int64_t c0 = static_cast<std::int64_t>(j) * kN;
        float xf[kN], yf[kN], l[kN], g[kN];
        div_floats(xv[u], xf);
        div_floats(yv[u], yf);
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          float q;
          const DivergenceValue v = div_math::evaluate<D, kS, kT, kDivFastMath<T>>(div, xf[k], yf[k], 1.0f, 0.0f, 0.0f, q);
          acc += v.loss;
          l[k] = v.loss;
          g[k] = v.grad * f;
        }
        if (wr != nullptr) {
          float w[kN];
          div_floats(div_load<kN>(wr + c0, drop), w);
#pragma unroll
          for (int k = 0; k < kN; ++k) g[k] *= w[k];
        }
        if (dr != nullptr) div_store<kN>(dr + c0, g, drop);
        if (lr != nullptr) div_store<kN>(lr + c0, l, drop);
      }
    }
    const float sum = Reduce(tmp).Sum(acc);
    if (tid == 0 && p.partials != nullptr) p.partials[b] = sum;
    __syncthreads();  // tmp is reused by the next chunk
  }
}

// ---- The row kernel (logits on either side) ----

struct DivLse {  // running (max, sum of exp relative to it) of the student's and the teacher's v / T
  float mx, sx, my, sy;
};
struct DivLseMerge {
  TIGON_DEVICE DivLse operator()(const DivLse& a, const DivLse& b) const {
    DivLse r = a;
    div_math::lse_merge(r.mx, r.sx, b.mx, b.sx);
    div_math::lse_merge(r.my, r.sy, b.my, b.sy);
    return r;
  }
};

template <int kThreads>
struct DivRowShared {
  typename cub::BlockReduce<DivLse, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>::TempStorage lse;
  typename BlockAllReduce<kThreads, 2>::TempStorage sums;
  DivLse total;
};

// One block per row. Pass 1 (logits sides): the logsumexp of each logits side's v / temperature,
// read with the evict-last L2 priority. Pass 2: every element's loss (and element losses), summed
// in a fixed order with, for student logits, the row's sum of the gradients with respect to the
// log-probabilities, S = sum_i w_i g_i (w: a per-element upstream gradient, else 1); the gradient
// written here when the student is not logits. Pass 3 (student logits with a gradient): the
// elements again and d loss / d z_j = f / T (w_j g_j - q_j S), newest reads marked evict-first.
template <class D, DivergenceInput kS, DivergenceInput kT, class T, class TT, class I, int kN, int kThreads, int kU>
TIGON_KERNEL void __launch_bounds__(kThreads) div_row_kernel(const DivParams<T, TT, I> p, const D div) {
  detail::grid_dependency_sync();
  constexpr bool kSL = kS == DivergenceInput::logits;
  constexpr bool kTL = kT == DivergenceInput::logits;
  using LseReduce = cub::BlockReduce<DivLse, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  using Sums = BlockAllReduce<kThreads, 2>;
  __shared__ DivRowShared<kThreads> sh;
  const int nvec = static_cast<int>(p.vocab / kN);
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint64_t keep = l2_policy<L2Hint::evict_last>();
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    if (div_ignored(p, row)) {
      div_zero<kN, kThreads>(p, row, 0, nvec, drop);
      if (tid == 0 && p.partials != nullptr) p.partials[row] = 0.0f;
      continue;
    }
    const T* xr = p.x + row * p.xs;
    const TT* yr = p.y + row * p.ys;
    T* dr = p.dx != nullptr ? p.dx + row * p.dxs : nullptr;
    float* lr = p.loss_elems != nullptr ? p.loss_elems + row * p.les : nullptr;
    // A per-element upstream gradient scales the gradient only: not read for the loss alone.
    const float* wr = (p.go_elems != nullptr && dr != nullptr) ? p.go_elems + row * p.gos : nullptr;
    const bool third = kSL && dr != nullptr;  // pass 3 follows
    const std::uint64_t mid = third ? keep : drop;
    // Pass 1.
    DivLse a{div_math::kNegInf, 0.0f, div_math::kNegInf, 0.0f};
    {
      auto fold = [&](std::int64_t c0) {
        if constexpr (kSL) {
          float v[kN];
          div_floats(div_load<kN>(xr + c0, keep), v);
#pragma unroll
          for (int k = 0; k < kN; ++k) v[k] *= p.inv_temp;
          div_math::lse_fold<kN, kDivFastMath<T>>(a.mx, a.sx, v);
        }
        if constexpr (kTL) {
          float v[kN];
          div_floats(div_load<kN>(yr + c0, keep), v);
#pragma unroll
          for (int k = 0; k < kN; ++k) v[k] *= p.inv_temp;
          div_math::lse_fold<kN, kDivFastMath<T>>(a.my, a.sy, v);
        }
      };
      int i = tid;
      for (; i + (kU - 1) * kThreads < nvec; i += kU * kThreads) {
#pragma unroll
        for (int u = 0; u < kU; ++u) fold(static_cast<std::int64_t>(i + u * kThreads) * kN);
      }
      for (; i < nvec; i += kThreads) fold(static_cast<std::int64_t>(i) * kN);
    }
    const DivLse r = LseReduce(sh.lse).Reduce(a, DivLseMerge{});
    if (tid == 0) sh.total = r;
    __syncthreads();
    const float lse_x = kSL ? sh.total.mx + div_math::log_f32(sh.total.sx) : 0.0f;
    const float lse_y = kTL ? sh.total.my + div_math::log_f32(sh.total.sy) : 0.0f;
    const float f = div_row_factor(p, row);
    // Pass 2.
    float sums[2] = {0.0f, 0.0f};  // the row's loss, S
    {
      auto step = [&](std::int64_t c0, std::uint64_t pol) {
        float xf[kN], yf[kN], l[kN], g[kN], w[kN];
        div_floats(div_load<kN>(xr + c0, pol), xf);
        div_floats(div_load<kN>(yr + c0, pol), yf);
        if (wr != nullptr) {
          div_floats(div_load<kN>(wr + c0, pol), w);
        } else {
#pragma unroll
          for (int k = 0; k < kN; ++k) w[k] = 1.0f;
        }
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          float q;
          const DivergenceValue v = div_math::evaluate<D, kS, kT, kDivFastMath<T>>(div, xf[k], yf[k], p.inv_temp, lse_x, lse_y, q);
          sums[0] += v.loss;
          l[k] = v.loss;
          if constexpr (kSL) {
            sums[1] += w[k] * v.grad;
          } else {
            g[k] = v.grad * f * w[k];
          }
        }
        if constexpr (!kSL) {
          if (dr != nullptr) div_store<kN>(dr + c0, g, drop);
        }
        if (lr != nullptr) div_store<kN>(lr + c0, l, drop);
      };
      int i = tid;
      for (; i + (kU - 1) * kThreads < nvec; i += kU * kThreads) {
#pragma unroll
        for (int u = 0; u < kU; ++u) step(static_cast<std::int64_t>(i + u * kThreads) * kN, mid);
      }
      for (; i < nvec; i += kThreads) step(static_cast<std::int64_t>(i) * kN, mid);
    }
    Sums::sum(sums, sh.sums);  // every thread gets the totals; ends with a barrier
    if (tid == 0 && p.partials != nullptr) p.partials[row] = sums[0];
    // Pass 3.
    if constexpr (kSL) {
      if (third) {
        const float fs = f * p.inv_temp;
        const float s_total = sums[1];
        auto step = [&](std::int64_t c0) {
          float xf[kN], yf[kN], g[kN], w[kN];
          div_floats(div_load<kN>(xr + c0, drop), xf);
          div_floats(div_load<kN>(yr + c0, drop), yf);
          if (wr != nullptr) {
            div_floats(div_load<kN>(wr + c0, drop), w);
          } else {
#pragma unroll
            for (int k = 0; k < kN; ++k) w[k] = 1.0f;
          }
#pragma unroll
          for (int k = 0; k < kN; ++k) {
            float q;
            const DivergenceValue v =
                div_math::evaluate<D, kS, kT, kDivFastMath<T>>(div, xf[k], yf[k], p.inv_temp, lse_x, lse_y, q);
            g[k] = fs * (w[k] * v.grad - q * s_total);
          }
          div_store<kN>(dr + c0, g, drop);
        };
        int i = tid;
        for (; i + (kU - 1) * kThreads < nvec; i += kU * kThreads) {
#pragma unroll
          for (int u = 0; u < kU; ++u) step(static_cast<std::int64_t>(i + u * kThreads) * kN);
        }
        for (; i < nvec; i += kThreads) step(static_cast<std::int64_t>(i) * kN);
      }
    }
    // The next row's first shared-memory write (sh.total, after its pass 1) follows Sums' barrier.
  }
}

// ---- The resident kernel (logits on either side, sm_90+) ----

// (m, s) pairs of lanes [0, n) merged across groups of kW lanes (n <= kW): the max, then each sum
// rescaled to it and added; every lane of the first group ends with the same totals, and every
// block of a cluster, merging the same messages in the same order, with the same (deterministic).
// Lanes past n hold the identities, so a group of 16 gives the bits of a group of 32 with one
// shuffle round fewer on each reduction.
template <int kW = 32>
TIGON_DEVICE void div_merge_lanes(int lane, int n, float pm, float ps, float& om, float& os) {
  float mm[1] = {lane < n ? pm : div_math::kNegInf};
  warp_allreduce<kW>(mm, MaxOp{});
  float ss[1] = {(lane < n && pm != div_math::kNegInf) ? ps * div_math::exp_f32(pm - mm[0]) : 0.0f};
  warp_allreduce_sum<kW>(ss);
  om = mm[0];
  os = ss[0];
}

// The sum of kN values as a balanced tree (independent adds instead of one chain).
template <int kN>
TIGON_DEVICE float div_tree_sum(const float (&v)[kN]) {
  static_assert((kN & (kN - 1)) == 0, "a power of two");
  float t[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) t[k] = v[k];
#pragma unroll
  for (int w = kN / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int k = 0; k < w; ++k) t[k] += t[k + w];
  }
  return t[0];
}

// The resident kernel's unit: kN elements of X held as 32-bit words (16-bit elements two to a
// word, the lower element in the low half), so that a unit is loaded, selected and unpacked as
// whole registers.
template <class X, int kN>
struct DivWords {
  static constexpr int kWords = static_cast<int>(kN * sizeof(X) / 4);
  static_assert(kWords % 4 == 0, "whole 16-byte vectors");
  unsigned w[kWords];
};

// -inf in each element of a word of X.
template <class X>
inline constexpr unsigned kDivNegInfWord =
    sizeof(X) == 4 ? 0xff800000u : (std::is_same_v<X, __half> ? 0xfc00fc00u : 0xff80ff80u);

// A unit's elements from p when `own`, else -inf in each (what a thread holds in place of the units
// of a slice that are not its own: the max ignores them, their exponentials are 0): the load lands
// in registers that hold -inf before it.
template <int kN, class X>
TIGON_DEVICE DivWords<X, kN> div_load_own(const X* p, bool own, std::uint64_t pol) {
  using U = DivWords<X, kN>;
  constexpr int kV = 16 / static_cast<int>(sizeof(X));
  U r;
#pragma unroll
  for (int i = 0; i < U::kWords; ++i) r.w[i] = kDivNegInfWord<X>;
  if (own) {
#pragma unroll
    for (int a = 0; a < U::kWords / 4; ++a) {
      const AlignedVec<X, kV> v = load_vec_policy<kV>(p + a * kV, pol);
      __builtin_memcpy(&r.w[4 * a], &v, 16);
    }
  }
  return r;
}

// A unit's elements as floats. This and div_units_max work on the words themselves: the same
// through core's to_floats and PackedMax (each 16-byte vector copied out of the words first) ran the
// JSD on logits 1.3-1.5% slower (one H100, 2026-12-07).
template <int kN, class X>
TIGON_DEVICE void div_floats(const DivWords<X, kN>& u, float (&f)[kN]) {
#pragma unroll
  for (int i = 0; i < DivWords<X, kN>::kWords; ++i) {
    if constexpr (sizeof(X) == 4) {
      f[i] = __uint_as_float(u.w[i]);
    } else if constexpr (std::is_same_v<X, __half>) {
      __half2 h;
      __builtin_memcpy(&h, &u.w[i], 4);
      const float2 t = __half22float2(h);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    } else {
      f[2 * i] = __uint_as_float(u.w[i] << 16);
      f[2 * i + 1] = __uint_as_float(u.w[i] & 0xffff0000u);
    }
  }
}

// The largest element of kVecs units (bfloat16 / half pairs compared two at a time).
template <int kN, int kVecs, class X>
TIGON_DEVICE float div_units_max(const DivWords<X, kN> (&u)[kVecs]) {
  if constexpr (sizeof(X) == 4) {
    float m = div_math::kNegInf;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
#pragma unroll
      for (int i = 0; i < DivWords<X, kN>::kWords; ++i) m = fmaxf(m, __uint_as_float(u[j].w[i]));
    }
    return m;
  } else {
    using Pair = std::conditional_t<std::is_same_v<X, __half>, __half2, __nv_bfloat162>;
    unsigned m = kDivNegInfWord<X>;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
#pragma unroll
      for (int i = 0; i < DivWords<X, kN>::kWords; ++i) {
        Pair a, b;
        __builtin_memcpy(&a, &m, 4);
        __builtin_memcpy(&b, &u[j].w[i], 4);
        a = __hmax2(a, b);
        __builtin_memcpy(&m, &a, 4);
      }
    }
    float f[2];
    if constexpr (std::is_same_v<X, __half>) {
      __half2 h;
      __builtin_memcpy(&h, &m, 4);
      const float2 g = __half22float2(h);
      f[0] = g.x, f[1] = g.y;
    } else {
      f[0] = __uint_as_float(m << 16), f[1] = __uint_as_float(m & 0xffff0000u);
    }
    return fmaxf(f[0], f[1]);
  }
}

// This thread's max of v / T over its units, then the warp's; then this thread's sum of exp
// relative to the warp's max, summed over the warp (-inf, 0 for a warp with no finite element).
// kKeep: each element's exp(v / T - m) kept in e, so that pass 2 forms the probability with one
// multiply instead of a second exponential. Units that are not the thread's hold -inf (exp 0).
template <int kN, int kVecs, bool kFast, bool kKeep = false, class X>
TIGON_DEVICE void div_warp_lse(const DivWords<X, kN> (&raw)[kVecs], float inv_temp, float& m, float& s,
                               float (*e)[kN] = nullptr) {
  float mx[1] = {div_units_max(raw)};
  warp_allreduce<32>(mx, MaxOp{});
  m = mx[0] * inv_temp;  // inv_temp > 0: the max of v / T
  // exp(v / T - m): with the hardware exp2, log2(e) folded into the FMA's constants.
  const float scale = kFast ? inv_temp * kLog2e : inv_temp;
  const float shift = kFast ? -m * kLog2e : -m;
  float part[kVecs];
  if (m != div_math::kNegInf) {  // the same in the whole warp
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      float v[kN], x[kN];
      div_floats(raw[j], v);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float u = fmaf(v[k], scale, shift);
        x[k] = kFast ? exp2_ftz(u) : div_math::exp_f32<false>(u);
        if constexpr (kKeep) e[j][k] = x[k];
      }
      part[j] = div_tree_sum(x);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      part[j] = 0.0f;
      if constexpr (kKeep) {
#pragma unroll
        for (int k = 0; k < kN; ++k) e[j][k] = 0.0f;
      }
    }
  }
  float sm[1] = {div_tree_sum(part)};
  warp_allreduce_sum<32>(sm);
  s = sm[0];
}

// The resident kernel's largest cluster (beyond the portable 8: allowed per kernel on sm_90).
inline constexpr int kDivResMaxCluster = 16;

// One slice of a row per block and one row per cluster at a time: the grid holds as many clusters
// as the device does at once (at most one a row), and cluster c of the grid's n takes rows c,
// c + n, c + 2n, .... Each thread holds
// its kVecs units (kN elements of each side) of the slice in registers, so each input is read from
// DRAM once; a thread's units beyond the slice hold -inf, so that every pass runs whole vectors
// without branches and masks only their sums and stores. Exchange 1: the block's (max, sum of exp)
// of each logits side's v / T, one 16-byte asynchronous store to every block of the cluster (lane
// r of warp 0 to block r), counted on the receiver's first barrier; every block merges the
// messages in rank order, so all hold the same log-sum-exps. Pass 2 from the registers: each
// element's loss and gradient with respect to its log-probability. A student given as logits keeps
// its elements' w_i g_i and q_i (fp32) in the registers the raw values leave; the cluster's next
// row is then loaded into the raw registers, in flight through exchange 2 (the block's loss and
// S = sum w_i g_i, on the second barrier, which gives the row's S) and the writing of the gradient
// f / T (w_i g_i - q_i S) from the registers. A student in another form has its gradient written
// in pass 2. Each block asks the L2 for its slices of both inputs `ahead` of the cluster's rows on.
// The barriers' phases alternate row by row: a block sends a row's first message only after every
// block's second message of the row before (which each sends after reading the first slots), and
// its second message only after every block's first message of the row (sent after the slots of
// the second were read).
template <class D, DivergenceInput kS, DivergenceInput kT, class T, class TT, class I, int kN, int kThreads,
          int kVecs, int kMinBlocks, bool kKeepExp>
TIGON_KERNEL void __launch_bounds__(kThreads, kMinBlocks)
    div_resident_kernel(const DivParams<T, TT, I> p, const D div, int slice, int ahead) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kSL = kS == DivergenceInput::logits;
  constexpr bool kTL = kT == DivergenceInput::logits;
  constexpr bool kKeepX = kKeepExp && kSL;  // the student's exponentials kept from pass 1 (in qq)
  constexpr bool kKeepY = kKeepExp && kTL;  // the teacher's (in ey)
  constexpr bool kFast = kDivFastMath<T>;
  // A per-element upstream gradient exists only for a functor whose reduction none is per element.
  constexpr bool kElems = div_elementwise_none<D>();
  // The generalised JSD inside (0, 1) on two 16-bit logits sides: pass 2 in log2 units with beta and
  // 1 - beta folded into the probabilities' factors.
  constexpr bool kMix2 = std::is_same_v<D, GeneralizedJSD::Mixture> && kKeepX && kKeepY && kFast;
  constexpr int kWarps = kThreads / 32;
  // Warp 0's merges over the block's warps run on groups of 16 lanes when the warps fit (the
  // cluster's senders, one lane a block, are at most 16 too): one shuffle round fewer each.
  constexpr int kBlockLanes = kWarps <= kDivResMaxCluster ? kDivResMaxCluster : 32;
  __shared__ std::uint64_t bar[2];
  __shared__ float4 slots[2][kDivResMaxCluster];
  __shared__ float4 part[kWarps];
  __shared__ float4 row_stats;  // lse_x, lse_y, the row's loss, S
  const unsigned csize = cluster_blocks();
  const unsigned rank = cluster_rank();
  const bool solo = csize == 1;  // a row in one block: no messages
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  if (!solo) {
    if (tid == 0) {
      mbarrier_init(&bar[0]);  // each phase completes after one arrival and its messages' bytes
      mbarrier_init(&bar[1]);
    }
    cluster_arrive_relaxed();  // the barriers are ready (the init's fence releases them)
  }
  detail::grid_dependency_sync();
  const std::int64_t ncl = gridDim.x / csize;
  const int nvec = static_cast<int>(p.vocab / kN);
  const int v0 = min(static_cast<int>(rank) * slice, nvec);
  const int v1 = min(v0 + slice, nvec);
  const int first = v0 + tid;  // this thread's first unit
  const int mine = v1 - first;  // unit j is this thread's when j * kThreads < mine
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  // kMix2: beta and 1 / (1 - beta) (0 at beta 1, where (1 - beta) q_i, the gradient, is 0).
  float beta = 0.0f, inv_1mb = 0.0f;
  if constexpr (kMix2) {
    beta = div.beta;
    inv_1mb = beta < 1.0f ? 1.0f / (1.0f - beta) : 0.0f;
  }
  DivWords<T, kN> xv[kVecs];
  DivWords<TT, kN> yv[kVecs];
  // Unit j of this thread is column off + j * kThreads * kN of the row (constant offsets).
  const std::int64_t off = static_cast<std::int64_t>(first) * kN;
  const auto load_row = [&](std::int64_t r) {
    const T* xr = p.x + r * p.xs + off;
    const TT* yr = p.y + r * p.ys + off;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      xv[j] = div_load_own<kN>(xr + j * kThreads * kN, j * kThreads < mine, drop);
      yv[j] = div_load_own<kN>(yr + j * kThreads * kN, j * kThreads < mine, drop);
    }
  };
  std::int64_t row = blockIdx.x / csize;
  if (row < p.rows && !div_ignored(p, row)) load_row(row);
  bool waited = solo;  // the cluster barrier that pairs cluster_arrive_relaxed above
  unsigned phase = 0;
  for (; row < p.rows; row += ncl) {
    const std::int64_t next = row + ncl;
    const std::int64_t na = row + static_cast<std::int64_t>(ahead) * ncl;
    if (ahead > 0 && tid == 0 && na < p.rows && v1 > v0) {
      prefetch_l2_bulk(p.x + na * p.xs + static_cast<std::int64_t>(v0) * kN,
                       static_cast<unsigned>((v1 - v0) * kN * sizeof(T)));
      prefetch_l2_bulk(p.y + na * p.ys + static_cast<std::int64_t>(v0) * kN,
                       static_cast<unsigned>((v1 - v0) * kN * sizeof(TT)));
    }
    if (div_ignored(p, row)) {  // the same in every block of the cluster: zeros, no messages
      div_zero<kN, kThreads>(p, row, v0, v1, drop);
      if (rank == 0 && tid == 0 && p.partials != nullptr) p.partials[row] = 0.0f;
      if (next < p.rows && !div_ignored(p, next)) load_row(next);
      continue;
    }
    T* dr = p.dx != nullptr ? p.dx + row * p.dxs + off : nullptr;
    float* lr = p.loss_elems != nullptr ? p.loss_elems + row * p.les + off : nullptr;
    const float* wr = (kElems && p.go_elems != nullptr && dr != nullptr) ? p.go_elems + row * p.gos + off : nullptr;
    const float f = div_row_factor(p, row);
    float gq[kSL ? kVecs : 1][kSL ? kN : 1];      // w_i g_i (student logits)
    float qq[kSL ? kVecs : 1][kSL ? kN : 1];      // q_i (student logits); before pass 2, exp(x_i / T - m_w)
    float ey[kKeepY ? kVecs : 1][kKeepY ? kN : 1];  // exp(y_i / T - m_w) (kKeepY)
    // Pass 1 and exchange 1: the log-sum-exps.
    float4 st = make_float4(div_math::kNegInf, 0.0f, div_math::kNegInf, 0.0f);
    if constexpr (kKeepX) {
      div_warp_lse<kN, kVecs, kFast, true>(xv, p.inv_temp, st.x, st.y, qq);
    } else if constexpr (kSL) {
      div_warp_lse<kN, kVecs, kFast>(xv, p.inv_temp, st.x, st.y);
    }
    if constexpr (kKeepY) {
      div_warp_lse<kN, kVecs, kFast, true>(yv, p.inv_temp, st.z, st.w, ey);
    } else if constexpr (kTL) {
      div_warp_lse<kN, kVecs, kFast>(yv, p.inv_temp, st.z, st.w);
    }
    const float mwx = st.x, mwy = st.z;  // the warp's maxima of v / T
    if (lane == 0) part[tid >> 5] = st;
    __syncthreads();
    if (!waited) {
      cluster_wait();  // every block's barriers are ready
      waited = true;
    }
    if (tid < 32) {
      const float4 w = lane < kWarps ? part[lane] : make_float4(div_math::kNegInf, 0.0f, div_math::kNegInf, 0.0f);
      float4 b;
      div_merge_lanes<kBlockLanes>(lane, kWarps, w.x, w.y, b.x, b.y);
      div_merge_lanes<kBlockLanes>(lane, kWarps, w.z, w.w, b.z, b.w);
      if (!solo) {
        if (lane == 0) mbarrier_arrive_expect_tx(&bar[0], csize * static_cast<unsigned>(sizeof(float4)));
        if (lane < static_cast<int>(csize)) {
          const auto to = static_cast<unsigned>(lane);
          cluster_store_async_f4(cluster_smem_addr(&slots[0][rank], to), cluster_smem_addr(&bar[0], to), b.x, b.y,
                                 b.z, b.w);
        }
        mbarrier_wait<true>(&bar[0], phase);
        const bool from = lane < static_cast<int>(csize);
        const float4 msg = from ? slots[0][lane] : make_float4(div_math::kNegInf, 0.0f, div_math::kNegInf, 0.0f);
        div_merge_lanes<kDivResMaxCluster>(lane, static_cast<int>(csize), msg.x, msg.y, b.x, b.y);
        div_merge_lanes<kDivResMaxCluster>(lane, static_cast<int>(csize), msg.z, msg.w, b.z, b.w);
      }
      if (lane == 0) {
        row_stats.x = kSL ? b.x + div_math::log_f32(b.y) : 0.0f;
        row_stats.y = kTL ? b.z + div_math::log_f32(b.w) : 0.0f;
      }
    }
    __syncthreads();
    const float lse_x = row_stats.x, lse_y = row_stats.y;
    // Pass 2. A kept exponential becomes the probability with one multiply: exp(v / T - lse) =
    // exp(v / T - m_w) exp(m_w - lse). Each unit's sums are masked whole (a unit that is not the
    // thread's computes on -inf).
    const float cx = kKeepX ? div_math::exp_f32<kFast>(mwx - lse_x) * (kMix2 ? 1.0f - beta : 1.0f) : 0.0f;
    const float cy = kKeepY ? div_math::exp_f32<kFast>(mwy - lse_y) * (kMix2 ? beta : 1.0f) : 0.0f;
    const float it2 = p.inv_temp * kLog2e;  // (kMix2) the log-probabilities' scale and shifts
    const float cxm = -lse_x * kLog2e, cym = -lse_y * kLog2e;
    float sums[2] = {0.0f, 0.0f};  // the thread's loss, S
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const bool own = j * kThreads < mine;
      const int c0 = j * kThreads * kN;
      float xf[kN], yf[kN], l[kN], w[kN], g[kN];
      div_floats(xv[j], xf);
      div_floats(yv[j], yf);
#pragma unroll
      for (int k = 0; k < kN; ++k) w[k] = 1.0f;
      if constexpr (kElems) {
        if (wr != nullptr && own) div_floats(div_load<kN>(wr + c0, drop), w);
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if constexpr (kMix2) {
          // bq = (1 - beta) q_i, bp = beta p_i (beta and 1 - beta folded into the kept exponentials'
          // factors); a = log2 q_i, b = log2 p_i. In bits: gq holds bq (log2 q_i - log2 m_i), l the
          // element's loss; the row's gradient and losses take the factor ln 2
          // (f ln2 / T (gq - bq S / (1 - beta)), S = sum gq).
          const float bq = qq[j][k] * cx, bp = ey[j][k] * cy;
          const float a = fmaf(xf[k], it2, cxm), b = fmaf(yf[k], it2, cym);
          const float lm = log2_ftz(fmaxf(bp + bq, kMinNormal));
          const float g2 = bq * fmaxf(a - lm, div_math::kLogFloor);
          l[k] = fmaf(bp, fmaxf(b - lm, div_math::kLogFloor), g2);
          gq[j][k] = g2;
          qq[j][k] = bq;
        } else {
          float q;
          DivergenceValue v;
          if constexpr (kKeepExp) {
            const float px = kKeepX ? qq[j][k] * cx : 0.0f;
            const float py = kKeepY ? ey[j][k] * cy : 0.0f;
            v = div_math::evaluate_given<D, kS, kT, kFast>(div, xf[k], yf[k], p.inv_temp, lse_x, lse_y, px, py, q);
          } else {
            v = div_math::evaluate<D, kS, kT, kFast>(div, xf[k], yf[k], p.inv_temp, lse_x, lse_y, q);
          }
          l[k] = v.loss;
          if constexpr (kSL) {
            gq[j][k] = kElems ? w[k] * v.grad : v.grad;
            qq[j][k] = q;
          } else {
            g[k] = kElems ? v.grad * f * w[k] : v.grad * f;
          }
        }
      }
      const float lj = div_tree_sum(l);
      sums[0] += own ? lj : 0.0f;
      if constexpr (kSL) {
        const float sj = div_tree_sum(gq[j]);
        sums[1] += own ? sj : 0.0f;
      } else {
        if (dr != nullptr && own) div_store<kN>(dr + c0, g, drop);
      }
      if (lr != nullptr && own) {
        if constexpr (kMix2) {
#pragma unroll
          for (int k = 0; k < kN; ++k) l[k] *= kLn2;  // bits to nats (lj above is in bits)
        }
        div_store<kN>(lr + c0, l, drop);
      }
    }
    // The cluster's next row, in flight through exchange 2 and the gradient's stores.
    if (next < p.rows && !div_ignored(p, next)) load_row(next);
    // Exchange 2: the row's loss and S (the loss alone needs no S, the student's gradient in another
    // form none; the messages are the same size).
    warp_allreduce_sum<32>(sums);
    if (lane == 0) part[tid >> 5] = make_float4(sums[0], sums[1], 0.0f, 0.0f);
    __syncthreads();
    if (tid < 32) {
      float bs[2] = {0.0f, 0.0f};
      if (lane < kWarps) {
        bs[0] = part[lane].x;
        bs[1] = part[lane].y;
      }
      warp_allreduce_sum<kBlockLanes>(bs);
      if (!solo) {
        if (lane == 0) mbarrier_arrive_expect_tx(&bar[1], csize * static_cast<unsigned>(sizeof(float4)));
        if (lane < static_cast<int>(csize)) {
          const auto to = static_cast<unsigned>(lane);
          cluster_store_async_f4(cluster_smem_addr(&slots[1][rank], to), cluster_smem_addr(&bar[1], to), bs[0], bs[1],
                                 0.0f, 0.0f);
        }
        mbarrier_wait<true>(&bar[1], phase);
        const float4 msg = lane < static_cast<int>(csize) ? slots[1][lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        bs[0] = msg.x;
        bs[1] = msg.y;
        warp_allreduce_sum<kDivResMaxCluster>(bs);
      }
      if (lane == 0) {
        row_stats.z = bs[0];
        row_stats.w = bs[1];
        if (rank == 0 && p.partials != nullptr) p.partials[row] = kMix2 ? kLn2 * bs[0] : bs[0];
      }
    }
    // Every warp is past its reads of part and the first slots before the next row writes them.
    __syncthreads();
    // Pass 3: the student's gradient from the registers.
    if constexpr (kSL) {
      if (dr != nullptr) {
        const float s_total = kMix2 ? row_stats.w * inv_1mb : row_stats.w;
        const float fs = kMix2 ? f * p.inv_temp * kLn2 : f * p.inv_temp;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          if (j * kThreads < mine) {
            float g[kN];
#pragma unroll
            for (int k = 0; k < kN; ++k) g[k] = fs * fmaf(-qq[j][k], s_total, gq[j][k]);
            div_store<kN>(dr + j * kThreads * kN, g, drop);
          }
        }
      }
    }
    phase ^= 1u;
  }
  if (!waited) cluster_wait();
#endif
}

// ---- The small kernels ----

// The count of rows whose label is not ignore_index, as a float. One block, fixed order.
template <class I>
TIGON_KERNEL void __launch_bounds__(1024)
    div_count_kernel(const I* labels, std::int64_t rows, std::int64_t ignore_index, float* count) {
  detail::grid_dependency_sync();
  using Reduce = cub::BlockReduce<long long, 1024>;
  __shared__ typename Reduce::TempStorage tmp;
  long long n = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += 1024) n += static_cast<std::int64_t>(labels[r]) != ignore_index ? 1 : 0;
  const long long total = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) count[0] = static_cast<float>(total);
}

// From the partial sums [rows, chunks]: each row's sum (in chunk order) into loss_rows (unless
// the partials are loss_rows), and loss = (sum of the rows) / denominator (0 when the denominator
// is 0: every row ignored), when loss is set. One block, fixed order.
template <int kThreads = 1024>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads)
    div_finish_kernel(const float* partials, std::int64_t rows, std::int64_t chunks, float* loss_rows,
                      const float* count, float den, float* loss) {
  detail::grid_dependency_sync();
  using Reduce = cub::BlockReduce<float, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  __shared__ typename Reduce::TempStorage tmp;
  float s = 0.0f;
  for (std::int64_t r = threadIdx.x; r < rows; r += kThreads) {
    float rs = 0.0f;
    for (std::int64_t c = 0; c < chunks; ++c) rs += partials[r * chunks + c];
    if (loss_rows != nullptr && loss_rows != partials) loss_rows[r] = rs;
    s += rs;
  }
  if (loss == nullptr) return;
  const float total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) {
    const float d = count != nullptr ? count[0] * den : den;
    loss[0] = d == 0.0f ? 0.0f : total / d;
  }
}

// ---- Dispatch ----

template <class F>
Status div_with_input(DivergenceInput k, F&& f) {
  switch (k) {
    case DivergenceInput::log_probs:
      return f(std::integral_constant<DivergenceInput, DivergenceInput::log_probs>{});
    case DivergenceInput::probs:
      return f(std::integral_constant<DivergenceInput, DivergenceInput::probs>{});
    case DivergenceInput::logits:
      return f(std::integral_constant<DivergenceInput, DivergenceInput::logits>{});
  }
  return Status::error(Errc::invalid_value, "divergence", "student_input", "unknown input form");
}

// Whether every row allows kN-element (16-byte) vectors.
template <int kN, class T, class TT, class I>
bool div_vectorizable(const DivParams<T, TT, I>& p) {
  return p.vocab % kN == 0 && rows_aligned(p.x, p.xs, kVecElems<T>) && rows_aligned(p.y, p.ys, kVecElems<TT>) &&
         (p.dx == nullptr || rows_aligned(p.dx, p.dxs, kVecElems<T>)) &&
         (p.loss_elems == nullptr || rows_aligned(p.loss_elems, p.les, kVecElems<float>)) &&
         (p.go_elems == nullptr || rows_aligned(p.go_elems, p.gos, kVecElems<float>));
}

// The resident kernel, on sm_90+ when the row (16-byte units) fits a cluster of kDivResMaxCluster
// blocks and such a cluster fits the device; `launched` false (nothing launched) otherwise.
template <class P, class D, DivergenceInput kS, DivergenceInput kT, int kN, class T, class TT, class I>
Status div_launch_resident(const DivParams<T, TT, I>& p, const D& div, cudaStream_t stream, const char* op,
                           bool& launched) {
  constexpr int kThreads = P::kResThreads;
  constexpr int kVecs = P::kResElems / kN > 0 ? P::kResElems / kN : 1;
  // 16-bit inputs: pass 1's exponentials kept in registers for pass 2's probabilities.
  constexpr bool kKeep = sizeof(T) == 2 && sizeof(TT) == 2;
  constexpr auto kernel = div_resident_kernel<D, kS, kT, T, TT, I, kN, kThreads, kVecs, P::kResMinBlocks, kKeep>;
  launched = false;
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  if (dev.cc_major < 9) return Status();
  const RowClusterShape shape = row_cluster_shape(p.vocab / kN, kThreads, kVecs, kDivResMaxCluster);
  if (shape.csize == 0) return Status();
  const auto c = static_cast<unsigned>(shape.csize);
  LaunchShape one{dim3(c), dim3(kThreads), 0, stream, c};
  int resident = 0;
  TIGON_CHECK((cluster_residency<kernel, kDivResMaxCluster>(one, op, resident)));
  if (resident == 0) return Status();
  // As many clusters as the device holds at once, each walking its rows (at most one a row, and a
  // grid under 2^31 blocks).
  const std::int64_t max_clusters = ((std::int64_t{1} << 31) - 1) / shape.csize;
  const std::int64_t n = std::min({p.rows, static_cast<std::int64_t>(resident), max_clusters});
  one.grid = dim3(static_cast<unsigned>(n * shape.csize));
  TIGON_CHECK(launch(op, kernel, one, p, div, shape.slice, P::kResAhead));
  launched = true;
  return Status();
}

template <class P, class D, DivergenceInput kS, DivergenceInput kT, class T, class TT, class I>
Status div_launch(const DivParams<T, TT, I>& p, const D& div, cudaStream_t stream, const char* op) {
  // The generalised JSD (or a functor derived from it) with beta inside (0, 1) runs as its Mixture:
  // the same formula without the tests of the two limits, which inside the kernels' unrolled
  // element loops cost every element all three formulas.
  if constexpr (std::is_base_of_v<GeneralizedJSD, D>) {
    if (div.beta > 0.0f && div.beta < 1.0f) {
      return div_launch<P, GeneralizedJSD::Mixture, kS, kT>(p, GeneralizedJSD::Mixture{div.beta}, stream, op);
    }
  }
  constexpr int kN = kVecElems<T> > kVecElems<TT> ? kVecElems<T> : kVecElems<TT>;
  const bool vec = div_vectorizable<kN>(p);
  const unsigned grid =
      static_cast<unsigned>(std::min<std::int64_t>(p.rows * p.chunks, (std::int64_t{1} << 31) - 1));
  if constexpr (kS == DivergenceInput::logits || kT == DivergenceInput::logits) {
    if (vec) {
      bool launched = false;
      TIGON_CHECK((div_launch_resident<P, D, kS, kT, kN>(p, div, stream, op, launched)));
      if (launched) return Status();
    }
    constexpr int kThreads = P::kRowThreads;
    const LaunchShape shape{dim3(grid), dim3(kThreads), 0, stream};
    if (vec) return launch(op, div_row_kernel<D, kS, kT, T, TT, I, kN, kThreads, P::kRowUnroll>, shape, p, div);
    return launch(op, div_row_kernel<D, kS, kT, T, TT, I, 1, kThreads, P::kRowUnroll>, shape, p, div);
  } else {
    constexpr int kThreads = P::kStreamThreads;
    const LaunchShape shape{dim3(grid), dim3(kThreads), 0, stream};
    if (vec) {
      return launch(op, div_stream_kernel<D, kS, kT, T, TT, I, kN, kThreads, P::kStreamUnroll, P::kStreamAhead>, shape,
                    p, div);
    }
    return launch(op, div_stream_kernel<D, kS, kT, T, TT, I, 1, kThreads, P::kStreamUnroll, 0>, shape, p, div);
  }
}

// The kernel instance for the call's input forms (only those the functor accepts are compiled).
template <class P, class D, class T, class TT, class I>
Status div_rows(const DivParams<T, TT, I>& p, const D& div, DivergenceInput s, DivergenceInput t,
                cudaStream_t stream, const char* op) {
  return div_with_input(s, [&](auto sc) {
    return div_with_input(t, [&](auto tc) {
      constexpr DivergenceInput kS = decltype(sc)::value;
      constexpr DivergenceInput kT = decltype(tc)::value;
      if constexpr (div_accepts<D>(kS, kT)) {
        return div_launch<P, D, kS, kT>(p, div, stream, op);
      } else {
        return Status::error(Errc::unsupported, op, "student_input", "input forms the divergence does not take");
      }
    });
  });
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 5. Launchers
// ------------------------------------------------------------------------------------------------

// The divergence `div` (ForwardKL, ReverseKL, GeneralizedJSD{beta}, KLDiv{eps}, TVD, or a user
// functor) between args.student and args.teacher: the reduced loss and per-row / per-element
// losses where asked for, and the student's gradient when args.dx is set. P: the kernels' tuning
// (DivergencePolicy or a policy derived from it). Launches, in order: the count of non-ignored
// rows (labels under batchmean / mean), the rows, and the finish (the row sums from the chunks'
// partial sums, and the reduced loss) when the loss or row sums need it.
template <class P = DivergencePolicy, class D, class T, class TT, class I>
[[nodiscard]] Status divergence(const DivergenceArgs<T, TT, I>& args, const D& div, cudaStream_t stream) {
  static_assert(detail::check_divergence_policy<P>());
  constexpr const char* kOp = "divergence";
  TIGON_CHECK(detail::validate_divergence_args(args, kOp));
  TIGON_CHECK(detail::validate_divergence_call(args, div, kOp));
  const detail::DivWorkspace ws = detail::div_workspace(args);
  TIGON_CHECK(check::workspace(args.workspace, args.workspace_bytes, ws.bytes, kOp));
  float* const base = static_cast<float*>(args.workspace);
  constexpr bool kElems = detail::div_elementwise_none<D>();
  const bool none = args.reduction == DivergenceReduction::none;

  detail::DivParams<T, TT, I> p{};
  p.x = args.student;
  p.y = args.teacher;
  p.dx = args.dx;
  p.rows = args.rows;
  p.vocab = args.vocab;
  p.xs = args.student_stride != 0 ? args.student_stride : args.vocab;
  p.ys = args.teacher_stride != 0 ? args.teacher_stride : args.vocab;
  p.dxs = args.dx_stride != 0 ? args.dx_stride : args.vocab;
  p.labels = args.labels;
  p.ignore_index = args.ignore_index;
  p.inv_temp = 1.0f / args.temperature;
  p.grad_scale = args.grad_scale;
  if (args.grad_output != nullptr) {
    if (none && kElems) {
      p.go_elems = args.grad_output;
      p.gos = args.grad_output_stride != 0 ? args.grad_output_stride : args.vocab;
    } else {
      p.go = args.grad_output;
      p.go_per_row = none ? 1 : 0;
    }
  }
  p.count = ws.count ? base : nullptr;
  const double rows = static_cast<double>(args.rows), vocab = static_cast<double>(args.vocab);
  switch (args.reduction) {
    case DivergenceReduction::batchmean: p.den = ws.count ? 1.0f : static_cast<float>(rows); break;
    case DivergenceReduction::mean: p.den = static_cast<float>(ws.count ? vocab : rows * vocab); break;
    default: p.den = 1.0f; break;
  }
  p.chunks = ws.chunks;
  p.partials = ws.partials ? base + 4 : args.loss_rows;
  p.loss_elems = args.loss_elems;
  p.les = args.loss_elems_stride != 0 ? args.loss_elems_stride : args.vocab;

  if (ws.count) {
    TIGON_CHECK(detail::launch(kOp, detail::div_count_kernel<I>, {dim3(1), dim3(1024), 0, stream}, args.labels,
                               args.rows, args.ignore_index, base));
  }
  TIGON_CHECK((detail::div_rows<P>(p, div, args.student_input, args.teacher_input, stream, kOp)));
  if (ws.finish) {
    TIGON_CHECK(detail::launch(kOp, detail::div_finish_kernel<1024>, {dim3(1), dim3(1024), 0, stream},
                               static_cast<const float*>(p.partials), args.rows, p.chunks, args.loss_rows, p.count,
                               p.den, args.loss));
  }
  return Status();
}

TIGON_NAMESPACE_END

#endif  // __CUDACC__
