// The divergences on the GPU against the double-precision reference: every divergence x input form
// x reduction x dtype (a teacher dtype other than the student's included), labels with some and
// all rows ignored, int32 / int64 labels, upstream gradients of every shape, grad_scale,
// temperature, in place and out of place, padded rows, unaligned rows (the scalar path), masked
// teacher entries (probability 0), KLDiv's eps clamp, TVD's ties, policies other than the default,
// a user functor, bitwise determinism, graph capture, and LLaMA-3's vocabulary.
// GCC 12 reports a false -Wrestrict in Catch2's session code (a std::string copy in
// applyFilenamesAsTags) as inlined into this translation unit.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
#include "gpu_test.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <tigon/loss/divergence.cuh>

#include "../reference/divergence_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;
using tigon_ref::Div;
using tigon_ref::Form;
using tigon_ref::Red;

namespace {

// Policies derived from the default: small blocks with one vector in flight, and wide ones.
struct SmallBlocks : DivergencePolicy {
  static constexpr int kStreamThreads = 64;
  static constexpr int kStreamUnroll = 1;
  static constexpr int kRowThreads = 96;
  static constexpr int kRowUnroll = 1;
};
struct WideBlocks : DivergencePolicy {
  static constexpr int kStreamThreads = 1024;
  static constexpr int kStreamUnroll = 8;
  static constexpr int kRowThreads = 1024;
  static constexpr int kRowUnroll = 4;
};
// Resident kernels of other shapes: small slices (LLaMA-2's rows in clusters of 16 blocks) and one
// block of 512 threads holding 64 elements of each input per thread (a row of up to 32768 in one block).
struct ResSmall : DivergencePolicy {
  static constexpr int kResThreads = 128;
  static constexpr int kResElems = 16;
  static constexpr int kResMinBlocks = 4;
  static constexpr int kResAhead = 0;
};
struct ResWide : DivergencePolicy {
  static constexpr int kResThreads = 512;
  static constexpr int kResElems = 64;
  static constexpr int kResMinBlocks = 1;
  static constexpr int kResAhead = 3;
};

struct Case {
  std::int64_t rows = 6, V = 1000;
  Form s = Form::log_probs, t = Form::log_probs;
  Red red = Red::batchmean;
  double temperature = 1;
  int labels = 0;  // 0: none; 1: some rows ignored; 2: every row ignored
  float grad_scale = 1.0f;
  bool grad_output = false;
  bool grad = true;
  bool in_place = true;
  std::int64_t pad = 0;     // row strides: student V + pad, teacher V + 2 pad, dx V + pad (3 pad out of place)
  std::int64_t offset = 0;  // the student's (and dx's) first element in its buffer: 1 takes the scalar path
  bool loss_elems = true;
  bool loss_rows = true;
  bool loss = true;     // the reduced loss (not under none)
  bool masked = false;  // some teacher entries with probability 0 (-inf log-probs / logits, 0 probs)
  bool tiny = false;    // some teacher probabilities below KLDiv's eps
  bool ties = false;    // some teacher values equal to the student's (TVD's sign convention)
};

const char* form_name(Form f) {
  return f == Form::log_probs ? "log_probs" : (f == Form::probs ? "probs" : "logits");
}

std::string describe(const Case& c) {
  static const char* reds[] = {"none", "sum", "mean", "batchmean"};
  return std::to_string(c.rows) + "x" + std::to_string(c.V) + " student " + form_name(c.s) + " teacher " +
         form_name(c.t) + " red " + reds[int(c.red)] + " T " + std::to_string(c.temperature) + " labels " +
         std::to_string(c.labels) + " scale " + std::to_string(c.grad_scale) +
         (c.grad_output ? " grad_output" : "") + (c.grad ? (c.in_place ? " in-place" : " out-of-place") : " loss-only") +
         " pad " + std::to_string(c.pad) + " offset " + std::to_string(c.offset) + (c.loss ? "" : " no-loss") +
         (c.loss_rows ? "" : " no-loss_rows") + (c.loss_elems ? "" : " no-loss_elems") + (c.masked ? " masked" : "") +
         (c.tiny ? " tiny" : "") + (c.ties ? " ties" : "");
}

// Gradient tolerances (the output rounded once to T from fp32): per element, relative; absolute as
// a fraction of the largest gradient; relative L2.
template <class T>
double grad_rtol() {
  return gpu_test::tol<T>();
}
template <class T>
double grad_atol_frac() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-3;
}

// One side's values in form f as X, rows `ld` apart from element `off` of the buffer (padding
// filled with values that must not be read); `dense` gets the stored values as doubles.
template <class X>
std::vector<X> make_side(Form f, std::int64_t rows, std::int64_t V, std::int64_t ld, std::int64_t off,
                         std::vector<double>& dense) {
  std::normal_distribution<double> nd(0.0, 2.0);
  std::vector<X> h(static_cast<std::size_t>(off + rows * ld), from_float<X>(1e30f));
  dense.assign(static_cast<std::size_t>(rows * V), 0);
  std::vector<double> z(V), lg, pr;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (auto& v : z) v = nd(gpu_test::rng());
    if (f != Form::logits) tigon_ref::forms(Form::logits, z.data(), V, 1.0, lg, pr);
    for (std::int64_t i = 0; i < V; ++i) {
      const double v = f == Form::logits ? z[i] : (f == Form::probs ? pr[i] : lg[i]);
      const X x = from_float<X>(static_cast<float>(v));
      h[off + r * ld + i] = x;
      dense[r * V + i] = to_float(x);
    }
  }
  return h;
}

template <class X>
void set_value(std::vector<X>& h, std::vector<double>& dense, std::int64_t at, std::int64_t di, double v) {
  h[at] = from_float<X>(static_cast<float>(v));
  dense[di] = to_float(h[at]);
}

template <class D>
tigon_ref::DivOptions options_of(const D&);
template <>
tigon_ref::DivOptions options_of(const ForwardKL&) {
  tigon_ref::DivOptions o;
  o.div = Div::forward_kl;
  return o;
}
template <>
tigon_ref::DivOptions options_of(const ReverseKL&) {
  tigon_ref::DivOptions o;
  o.div = Div::reverse_kl;
  return o;
}
template <>
tigon_ref::DivOptions options_of(const GeneralizedJSD& d) {
  tigon_ref::DivOptions o;
  o.div = Div::jsd;
  o.beta = d.beta;
  return o;
}
template <>
tigon_ref::DivOptions options_of(const KLDiv& d) {
  tigon_ref::DivOptions o;
  o.div = Div::kldiv;
  o.eps = d.eps;
  return o;
}
template <>
tigon_ref::DivOptions options_of(const TVD&) {
  tigon_ref::DivOptions o;
  o.div = Div::tvd;
  return o;
}

DivergenceInput input_of(Form f) { return static_cast<DivergenceInput>(static_cast<int>(f)); }
DivergenceReduction reduction_of(Red r) { return static_cast<DivergenceReduction>(static_cast<int>(r)); }

template <class D, class T, class TT, class I = std::int64_t, class P = DivergencePolicy>
void run_case(const D& div, const Case& c) {
  INFO(detail::div_name<D>() << " " << describe(c) << " T=" << dtype_traits<T>::name << " TT="
                             << dtype_traits<TT>::name << " I=" << sizeof(I) * 8);
  tigon_ref::DivOptions o = options_of(div);
  const std::int64_t V = c.V, rows = c.rows;
  const std::int64_t xld = V + c.pad, yld = V + 2 * c.pad, dld = c.in_place ? xld : V + 3 * c.pad;
  const std::int64_t eld = V + c.pad, gld = V + 2 * c.pad;
  std::vector<double> xd, yd;
  const auto xh = make_side<T>(c.s, rows, V, xld, c.offset, xd);
  auto yh = make_side<TT>(c.t, rows, V, yld, 0, yd);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < V; ++i) {
      const std::int64_t at = r * yld + i, di = r * V + i;
      if (c.masked && i % 13 == 5) {
        set_value(yh, yd, at, di, c.t == Form::probs ? 0.0 : -INFINITY);
      } else if (c.tiny && i % 17 == 3) {
        set_value(yh, yd, at, di, c.t == Form::probs ? 1e-12 : std::log(1e-12));
      } else if (c.ties && i % 7 == 2) {
        // The student's value in the teacher's form: exact when both forms and dtypes agree, a near
        // tie (allowed for TVD's sign) otherwise.
        double v = xd[di];
        if (c.s != c.t && c.s == Form::log_probs && c.t == Form::probs) v = std::exp(v);
        if (c.s != c.t && c.s == Form::probs && c.t == Form::log_probs) v = std::log(v);
        if (c.s != c.t && (c.s == Form::logits || c.t == Form::logits)) continue;  // no element-wise tie
        set_value(yh, yd, at, di, v);
      }
    }
  }
  std::vector<std::int64_t> lab;
  if (c.labels > 0) {
    lab.resize(rows);
    for (std::int64_t r = 0; r < rows; ++r) lab[r] = (c.labels == 2 || r % 3 == 1) ? -100 : (r * 7) % V;
  }
  std::vector<I> labi(lab.begin(), lab.end());
  const bool none = c.red == Red::none;
  const bool elems_go = none && tigon_ref::elementwise_none(o.div);
  std::vector<float> goh;
  if (c.grad_output) {
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    if (elems_go) {
      goh.assign(static_cast<std::size_t>(rows * gld), 1e30f);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t i = 0; i < V; ++i) goh[r * gld + i] = ud(gpu_test::rng());
    } else {
      goh.resize(none ? rows : 1);
      for (auto& g : goh) g = ud(gpu_test::rng());
    }
  }
  o.student = c.s;
  o.teacher = c.t;
  o.temperature = c.temperature;
  o.reduction = c.red;
  o.labels = lab;
  o.grad_scale = c.grad_scale;
  if (elems_go && c.grad_output) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < V; ++i) o.grad_output.push_back(goh[r * gld + i]);
  } else {
    o.grad_output.assign(goh.begin(), goh.end());
  }
  const auto ref = tigon_ref::divergence(xd, yd, rows, V, o, c.grad);

  DeviceBuffer<T> x(xh.size()), dx(static_cast<std::size_t>(c.offset + rows * dld));
  DeviceBuffer<TT> y(yh.size());
  DeviceBuffer<I> lb(std::max<std::size_t>(labi.size(), 1));
  DeviceBuffer<float> go(std::max<std::size_t>(goh.size(), 1));
  DeviceBuffer<float> loss(1), lrows(rows), lelems(static_cast<std::size_t>(rows * eld));
  x.upload(xh);
  y.upload(yh);
  if (!labi.empty()) lb.upload(labi);
  if (!goh.empty()) go.upload(goh);
  dx.poison();
  loss.poison();
  lrows.poison();
  lelems.poison();

  DivergenceArgs<T, TT, I> a{.student = x.ptr + c.offset, .student_input = input_of(c.s), .student_stride = xld,
                             .teacher = y.ptr, .teacher_input = input_of(c.t), .teacher_stride = yld,
                             .rows = rows, .vocab = V, .teacher_vocab = V,
                             .temperature = static_cast<float>(c.temperature),
                             .labels = c.labels > 0 ? lb.ptr : nullptr, .reduction = reduction_of(c.red),
                             .dx = c.grad ? (c.in_place ? x.ptr + c.offset : dx.ptr + c.offset) : nullptr,
                             .dx_stride = dld, .grad_scale = c.grad_scale,
                             .grad_output = c.grad_output ? go.ptr : nullptr, .grad_output_stride = gld,
                             .loss = (none || !c.loss) ? nullptr : loss.ptr,
                             .loss_rows = c.loss_rows ? lrows.ptr : nullptr,
                             .loss_elems = c.loss_elems ? lelems.ptr : nullptr, .loss_elems_stride = eld};
  std::size_t wsb = 0;
  TIGON_OK(divergence_workspace_bytes(a, wsb));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(wsb, 1));
  ws.poison();
  a.workspace = wsb > 0 ? ws.ptr : nullptr;
  a.workspace_bytes = wsb;
  TIGON_OK(divergence<P>(a, div, nullptr));
  CUDA_OK(cudaDeviceSynchronize());

  auto ignored = [&](std::int64_t r) { return !lab.empty() && lab[r] == -100; };
  double total_scale = 0;
  for (double v : ref.scale_rows) total_scale += v;
  // The reduced loss.
  if (!none && c.loss) {
    const double got = loss.download()[0];
    const double den = ref.denom == 0 ? 1 : ref.denom;
    INFO("loss " << got << " reference " << ref.loss);
    CHECK(std::abs(got - ref.loss) <= 4e-6 * total_scale / den + 1e-4 * std::abs(ref.loss) + 1e-9);
    if (ref.denom == 0) CHECK(got == 0.0);
  }
  // Per-row sums.
  if (c.loss_rows) {
    const auto lr = lrows.download();
    int bad = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const double want = ref.loss_rows[r];
      if (!(std::abs(lr[r] - want) <= 4e-6 * ref.scale_rows[r] + 1e-4 * std::abs(want) + 1e-9)) ++bad;
      if (ignored(r) && lr[r] != 0.0f) ++bad;
    }
    INFO("loss_rows off: " << bad);
    CHECK(bad == 0);
  }
  // Per-element losses, and the padding beside them untouched.
  if (c.loss_elems) {
    const auto le = lelems.download();
    int bad = 0;
    std::int64_t worst = -1;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t i = 0; i < V; ++i) {
        const double want = ref.loss_elems[r * V + i], got = le[r * eld + i];
        const bool ok = std::isfinite(got) && std::abs(got - want) <= 4e-6 * ref.elem_scale[r * V + i] + 1e-4 * std::abs(want) + 1e-12;
        if (!ok && worst < 0) worst = r * V + i;
        bad += ok ? 0 : 1;
      }
    }
    INFO("loss_elems off: " << bad << ", first #" << worst);
    CHECK(bad == 0);
    gpu_test::check_outside_rows<float>(le, nullptr, 0, rows, V, eld);
  }
  if (c.grad) {
    const auto gh = (c.in_place ? x : dx).download();
    double scale = 0;
    for (double v : ref.grad) scale = std::max(scale, std::abs(v));
    // TVD's sign is ambiguous in fp32 where q and p agree to 1e-5 and either is not given as a
    // probability (exp / softmax rounding): such elements may take the other sign.
    std::size_t allowed = 0;
    if (o.div == Div::tvd && !(c.s == Form::probs && c.t == Form::probs)) {
      allowed = static_cast<std::size_t>(std::count(ref.near_tie.begin(), ref.near_tie.end(), 1));
    }
    // Against the reference rounded to T, within T's spacing at 0 too: a float16 gradient under
    // "mean" (divided by rows x V) is mostly subnormal, where float16 holds multiples of 2^-24.
    std::vector<double> want(ref.grad.size());
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = to_float(from_float<T>(static_cast<float>(ref.grad[i])));
    // TVD on student logits: a tie's other sign moves its whole row (through S), by up to
    // ref.tie_slack an element: the reference moves toward the kernel's value by at most that much,
    // and the usual tolerance applies to the rest.
    const auto got = gpu_test::strided(gh, c.offset, V, dld);
    if (o.div == Div::tvd && c.s == Form::logits) {
      for (std::size_t i = 0; i < want.size(); ++i) {
        want[i] += std::clamp(got(i) - want[i], -ref.tie_slack[i], ref.tie_slack[i]);
      }
    }
    const double quantum = std::is_same_v<T, half> ? 0x1p-24 : 0.0;
    const auto cg = gpu_test::compare(want.size(), got, want, grad_atol_frac<T>() * scale + quantum + 1e-30,
                                      grad_rtol<T>());
    INFO("grad: " << cg.bad << " of " << cg.n << " out of tolerance (" << allowed << " near ties allowed), worst #"
                  << cg.worst << " score " << cg.worst_err << " (got " << got(cg.worst) << ", want "
                  << want[cg.worst] << ", q-p gap " << (o.div == Div::tvd ? ref.tie_gap[cg.worst] : 0.0)
                  << "), rel L2 " << cg.rel_l2);
    CHECK(cg.bad <= allowed);
    CHECK((allowed > 0 || cg.l2_within(2 * gpu_test::tol_l2<T>() + 1e-6, quantum)));
    // Ignored rows: exactly zero.
    int nonzero = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!ignored(r)) continue;
      for (std::int64_t i = 0; i < V; ++i) nonzero += to_float(gh[c.offset + r * dld + i]) != 0.0f ? 1 : 0;
    }
    CHECK(nonzero == 0);
    // Padding (and the elements before the first row) keep the input's bytes in place, the poison otherwise.
    gpu_test::check_outside_rows<T>(gh, c.in_place ? &xh : nullptr, c.offset, rows, V, dld);
    // The teacher is not written.
    CHECK(std::memcmp(y.download().data(), yh.data(), yh.size() * sizeof(TT)) == 0);
    // Bitwise determinism: the same call again.
    const auto lr1 = lrows.download();
    const float l1 = loss.download()[0];
    if (c.in_place) x.upload(xh);
    TIGON_OK(divergence<P>(a, div, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto gh2 = (c.in_place ? x : dx).download();
    CHECK(std::memcmp(gh.data(), gh2.data(), gh.size() * sizeof(T)) == 0);
    const auto lr2 = lrows.download();
    CHECK(std::memcmp(lr1.data(), lr2.data(), lr1.size() * sizeof(float)) == 0);
    const float l2 = loss.download()[0];
    CHECK(std::memcmp(&l1, &l2, sizeof(float)) == 0);
  } else {
    CHECK(gpu_test::all_bytes_ff(dx.download().data(), dx.bytes()));
    CHECK(std::memcmp(x.download().data(), xh.data(), xh.size() * sizeof(T)) == 0);  // the student is not written
  }
}

// The forms a divergence takes.
template <class D>
std::vector<std::pair<Form, Form>> forms_of() {
  std::vector<std::pair<Form, Form>> v;
  for (Form s : {Form::log_probs, Form::probs, Form::logits})
    for (Form t : {Form::log_probs, Form::probs, Form::logits})
      if (detail::div_accepts<D>(input_of(s), input_of(t))) v.push_back({s, t});
  return v;
}

// Every form and reduction of D at one shape, with and without labels, with upstream gradients.
// The sanitizer-sized sweep (`small`) runs the call without options under batchmean alone (the one
// with labels, an upstream gradient, grad_scale and a temperature still takes every reduction);
// logits_only: only the forms with logits on a side (the others take the streaming kernel, one
// chunk a row below 8192 columns, as at a shorter row).
template <class D, class T, class TT, class I = std::int64_t>
void sweep(const D& div, std::int64_t rows, std::int64_t V, bool small = false, bool logits_only = false) {
  for (const auto& [s, t] : forms_of<D>()) {
    if (logits_only && s != Form::logits && t != Form::logits) continue;
    for (Red red : {Red::none, Red::sum, Red::mean, Red::batchmean}) {
      Case c{.rows = rows, .V = V, .s = s, .t = t, .red = red};
      if (!small || red == Red::batchmean) run_case<D, T, TT, I>(div, c);
      c.labels = 1;
      c.grad_output = true;
      c.grad_scale = 0.75f;
      c.temperature = 2.0;
      run_case<D, T, TT, I>(div, c);
    }
  }
}

}  // namespace

// 8 and 1000 columns take the streaming kernel and, with logits, the row kernel (fewer vectors than
// the resident kernel's block has threads); 4104 the resident kernel (one block a row) with logits.
// Sanitizer-sized: 1000 and 4104 (the latter with logits on a side only: see sweep()), and the fp32
// JSD at beta 0.3 alone (beta 0 and 1, the functor's ForwardKL and ReverseKL branches, stay in bf16).
TEST_CASE("divergence: every divergence, input form and reduction, bf16 / fp32 / fp16", "[div][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  const auto vocabs = small ? std::vector<std::int64_t>{1000, 4104} : std::vector<std::int64_t>{8, 1000, 4104};
  for (const std::int64_t V : vocabs) {
    const std::int64_t rows = V == 8 ? 5 : 9;
    const bool lo = small && V == 4104;  // logits only
    for (float beta : {0.0f, 0.3f, 1.0f}) {
      sweep<GeneralizedJSD, bf16, bf16>(GeneralizedJSD{beta}, rows, V, small, lo);
      if (!small || beta == 0.3f) sweep<GeneralizedJSD, float, float>(GeneralizedJSD{beta}, rows, V, small, lo);
    }
    sweep<ForwardKL, bf16, bf16>(ForwardKL{}, rows, V, small, lo);
    sweep<ReverseKL, float, float>(ReverseKL{}, rows, V, small, lo);
    sweep<KLDiv, bf16, bf16>(KLDiv{}, rows, V, small, lo);
    sweep<KLDiv, float, float>(KLDiv{}, rows, V, small, lo);
    sweep<TVD, bf16, bf16>(TVD{}, rows, V, small, lo);
    sweep<TVD, float, float>(TVD{}, rows, V, small, lo);
    sweep<GeneralizedJSD, half, half, std::int32_t>(GeneralizedJSD{0.5f}, rows, V, small, lo);
    sweep<ForwardKL, half, half, std::int32_t>(ForwardKL{}, rows, V, small, lo);
    sweep<ReverseKL, half, half, std::int32_t>(ReverseKL{}, rows, V, small, lo);
    sweep<KLDiv, half, half, std::int32_t>(KLDiv{}, rows, V, small, lo);
    sweep<TVD, half, half, std::int32_t>(TVD{}, rows, V, small, lo);
  }
}

TEST_CASE("divergence: a teacher dtype other than the student's", "[div][gpu]") {
  for (std::int64_t V : {std::int64_t{1000}, std::int64_t{4104}}) {
    sweep<GeneralizedJSD, bf16, float>(GeneralizedJSD{0.5f}, 7, V);
    sweep<GeneralizedJSD, float, bf16>(GeneralizedJSD{0.1f}, 7, V);
    sweep<KLDiv, bf16, float>(KLDiv{}, 7, V);
    sweep<KLDiv, half, bf16, std::int32_t>(KLDiv{}, 7, V);
    sweep<TVD, bf16, float>(TVD{}, 7, V);
    sweep<TVD, float, bf16>(TVD{}, 7, V);
  }
}

TEST_CASE("divergence: ignored rows, in place and out of place, strides, the scalar path", "[div][gpu]") {
  for (const auto& [s, t] : forms_of<GeneralizedJSD>()) {
    for (std::int64_t V : {std::int64_t{1000}, std::int64_t{1001}}) {  // 1001: single elements
      const Case base{.rows = 12, .V = V, .s = s, .t = t, .labels = 1};
      std::vector<Case> cases;
      cases.push_back(base);
      cases.push_back(base), cases.back().labels = 2;  // every row ignored: loss 0, zero gradient
      cases.push_back(base), cases.back().labels = 2, cases.back().red = Red::mean;
      cases.push_back(base), cases.back().in_place = false, cases.back().pad = 8;
      cases.push_back(base), cases.back().pad = 5;        // strides that are no multiple of a vector
      cases.push_back(base), cases.back().offset = 1;     // unaligned rows
      cases.push_back(base), cases.back().offset = 1, cases.back().in_place = false, cases.back().pad = 3;
      cases.push_back(base), cases.back().grad = false;   // the loss alone
      cases.push_back(base), cases.back().loss_rows = false, cases.back().loss_elems = false;  // loss into the workspace
      cases.push_back(base), cases.back().grad_scale = -0.5f, cases.back().grad_output = true;
      cases.push_back(base), cases.back().red = Red::none, cases.back().grad_output = true;
      cases.push_back(base), cases.back().masked = true;  // teacher probabilities of 0
      for (const Case& c : cases) {
        run_case<GeneralizedJSD, bf16, bf16>(GeneralizedJSD{0.5f}, c);
        run_case<GeneralizedJSD, float, bf16>(GeneralizedJSD{0.5f}, c);
        run_case<ForwardKL, bf16, bf16>(ForwardKL{}, c);
      }
    }
  }
  // KLDiv and TVD: per-element none outputs and upstream gradients, padded; masked and tiny targets
  // (KLDiv's eps clamp); TVD's ties.
  for (const auto& [s, t] : forms_of<TVD>()) {
    Case c{.rows = 10, .V = 1000, .s = s, .t = t, .red = Red::none, .labels = 1, .grad_output = true,
           .in_place = false, .pad = 8, .masked = true};
    if (detail::div_accepts<KLDiv>(input_of(s), input_of(t))) {
      run_case<KLDiv, bf16, bf16>(KLDiv{}, c);
      Case k = c;
      k.tiny = true;
      k.red = Red::batchmean;
      run_case<KLDiv, float, float>(KLDiv{}, k);
      run_case<KLDiv, bf16, float>(KLDiv{1e-3f}, k);
    }
    run_case<TVD, bf16, bf16>(TVD{}, c);
    Case tie = c;
    tie.masked = false;
    tie.ties = true;
    run_case<TVD, bf16, bf16>(TVD{}, tie);
    run_case<TVD, float, float>(TVD{}, tie);
    run_case<TVD, bf16, float>(TVD{}, tie);
  }
}

// Rows of several 8192-column chunks on the streaming kernel (each chunk a block, the partial sums
// added by the finish kernel): exact multiples, a last chunk of one element (single elements) or
// of part of a chunk, with every combination of the loss and row-sum outputs, ignored rows among them.
TEST_CASE("divergence: rows of several chunks, every loss output", "[div][gpu]") {
  for (std::int64_t V : {std::int64_t{8192}, std::int64_t{8193}, std::int64_t{16384}, std::int64_t{20000}}) {
    for (int outputs = 0; outputs < 4; ++outputs) {
      Case c{.rows = 11, .V = V, .labels = 1, .grad_output = true};
      c.loss = (outputs & 1) != 0;
      c.loss_rows = (outputs & 2) != 0;
      c.loss_elems = outputs == 0;
      run_case<ForwardKL, bf16, bf16>(ForwardKL{}, c);
      run_case<GeneralizedJSD, float, bf16>(GeneralizedJSD{0.7f}, c);
      Case t = c;
      t.s = t.t = Form::probs;
      t.red = Red::sum;
      run_case<TVD, half, half, std::int32_t>(TVD{}, t);
      t.red = Red::none;
      run_case<TVD, bf16, float>(TVD{}, t);
      Case z = c;  // logits: one block a row, whatever its length
      z.s = Form::logits;
      run_case<ForwardKL, bf16, bf16>(ForwardKL{}, z);
    }
  }
}

TEST_CASE("divergence: other policies compute the same function", "[div][gpu]") {
  for (std::int64_t V : {std::int64_t{1000}, std::int64_t{1001}, std::int64_t{32000}}) {
    for (const auto& [s, t] : forms_of<TVD>()) {
      for (Red red : {Red::none, Red::batchmean}) {
        const Case c{.rows = 7, .V = V, .s = s, .t = t, .red = red, .labels = 1, .grad_output = true};
        run_case<TVD, bf16, bf16, std::int64_t, SmallBlocks>(TVD{}, c);
        run_case<TVD, bf16, bf16, std::int64_t, WideBlocks>(TVD{}, c);
        if (detail::div_accepts<GeneralizedJSD>(input_of(s), input_of(t))) {
          run_case<GeneralizedJSD, bf16, bf16, std::int64_t, SmallBlocks>(GeneralizedJSD{0.5f}, c);
          run_case<GeneralizedJSD, bf16, bf16, std::int64_t, WideBlocks>(GeneralizedJSD{0.5f}, c);
        }
      }
    }
  }
}

// Logits rows of 4096 to 131072 columns (the row kernel: three passes over each row): logits on
// either side or both, masked teacher logits, per-element losses and upstream gradients (KLDiv and
// TVD under none), ignored rows and all-ignored batches, the loss alone, fp32, half and mixed dtypes.
// Sanitizer-sized: 4096, 20008 and 131072 columns, 5 rows each (two ignored). The resident kernel's
// shapes stay: one block a row (4096; ResWide's at 4096 and 20008), clusters of 2 (ResSmall at 4096),
// 3 with an uneven last slice (20008) and 10 (ResSmall at 20008) blocks, and 16 (131072); 16384
// (clusters of 2 and 8 blocks) is left out.
TEST_CASE("divergence: logits rows of LM-head widths", "[div][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  const auto vocabs = small ? std::vector<std::int64_t>{4096, 20008, 131072}
                            : std::vector<std::int64_t>{4096, 16384, 20008, 131072};
  for (const std::int64_t V : vocabs) {
    const std::int64_t rows = small || V > 65536 ? 5 : 9;
    for (const auto& [s, t] : std::vector<std::pair<Form, Form>>{
             {Form::logits, Form::logits}, {Form::logits, Form::log_probs}, {Form::log_probs, Form::logits}}) {
      const Case base{.rows = rows, .V = V, .s = s, .t = t, .temperature = 1.5, .labels = 1, .grad_output = true};
      std::vector<Case> cases{base};
      cases.push_back(base), cases.back().masked = true;  // teacher probabilities of 0
      cases.push_back(base), cases.back().grad = false;
      cases.push_back(base), cases.back().labels = 2;
      cases.push_back(base), cases.back().loss = false, cases.back().loss_rows = false;
      cases.push_back(base), cases.back().red = Red::none;
      for (const Case& c : cases) {
        run_case<GeneralizedJSD, bf16, bf16>(GeneralizedJSD{0.5f}, c);
        if (V > 20008) continue;
        run_case<GeneralizedJSD, bf16, bf16, std::int64_t, ResSmall>(GeneralizedJSD{0.5f}, c);
        run_case<GeneralizedJSD, bf16, bf16, std::int64_t, ResWide>(GeneralizedJSD{0.5f}, c);
        run_case<GeneralizedJSD, float, float>(GeneralizedJSD{0.25f}, c);
        run_case<GeneralizedJSD, bf16, float, std::int32_t>(GeneralizedJSD{0.75f}, c);
        run_case<ForwardKL, half, half>(ForwardKL{}, c);
        if (!c.masked) run_case<ReverseKL, bf16, bf16>(ReverseKL{}, c);  // KL(q || p) is infinite where p is 0
      }
      if (s == Form::logits) {
        Case k = base;
        k.red = Red::none;
        k.t = Form::probs;
        run_case<KLDiv, bf16, bf16>(KLDiv{}, k);
        run_case<TVD, bf16, bf16>(TVD{}, k);
        k.t = t;
        run_case<KLDiv, float, float>(KLDiv{}, k);
      }
    }
  }
}

// The resident kernel's grid holds as many clusters as the device does at once, each walking rows
// c, c + n, ...: more rows than clusters (a 65536-column row takes 8 blocks, 131072 16, 20008
// three), with every third row ignored, so that the clusters' barriers turn over many phases and
// skip rows with the next row's loads in flight. Sanitizer-sized: 65536 columns (clusters of 8
// blocks, which synccheck runs).
TEST_CASE("divergence: resident clusters walking many rows", "[div][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes{{72, 65536}};
  if (!small) shapes.insert(shapes.end(), {{40, 131072}, {300, 20008}});
  for (const auto& [rows, V] : shapes) {
    const Case c{.rows = rows, .V = V, .s = Form::logits, .t = Form::logits, .temperature = 1.5, .labels = 1,
                 .grad_output = true};
    run_case<GeneralizedJSD, bf16, bf16>(GeneralizedJSD{0.5f}, c);
    Case lp = c;
    lp.t = Form::log_probs;
    lp.red = Red::sum;
    run_case<ForwardKL, half, half>(ForwardKL{}, lp);
    if (small) continue;
    Case k = c;
    k.red = Red::none;
    k.t = Form::probs;
    run_case<KLDiv, bf16, bf16>(KLDiv{}, k);
    run_case<GeneralizedJSD, float, float>(GeneralizedJSD{0.25f}, c);
  }
}

TEST_CASE("divergence: LLaMA-3's vocabulary, every divergence", "[div][gpu][large]") {
  const std::int64_t V = 128256, rows = 24;
  for (Form f : {Form::log_probs, Form::logits}) {
    const Case c{.rows = rows, .V = V, .s = f, .t = f, .labels = 1};
    run_case<ForwardKL, bf16, bf16>(ForwardKL{}, c);
    run_case<ReverseKL, bf16, bf16>(ReverseKL{}, c);
    run_case<GeneralizedJSD, bf16, bf16>(GeneralizedJSD{0.5f}, c);
    run_case<KLDiv, bf16, bf16>(KLDiv{}, c);
    Case p = c;
    if (f == Form::log_probs) p.s = p.t = Form::probs;
    run_case<TVD, bf16, bf16>(TVD{}, p);
    Case k = c;
    k.t = Form::probs;
    run_case<KLDiv, bf16, bf16>(KLDiv{}, k);
  }
  run_case<GeneralizedJSD, bf16, float>(GeneralizedJSD{0.5f}, {.rows = 8, .V = V, .s = Form::logits, .t = Form::logits,
                                                               .temperature = 2.0});
  run_case<ForwardKL, bf16, bf16>(ForwardKL{}, {.rows = 600, .V = 32000});
}

// A user divergence with only the call operator (default traits: log-probs or logits, per-row
// none): the squared difference of the log-probabilities, d / d log q = 2 (log q - log p). Outside
// an anonymous namespace: a kernel instantiated on it must have external linkage.
namespace div_test {
struct SquaredLogs {
  template <class E>
  __host__ __device__ DivergenceValue operator()(const E& e) const {
    const float d = e.x_log - e.y_log;
    return {d * d, 2.0f * d};
  }
};
}  // namespace div_test
using div_test::SquaredLogs;

TEST_CASE("divergence: a user functor", "[div][gpu]") {
  for (Form s : {Form::log_probs, Form::logits}) {
    INFO("student " << form_name(s));
    const std::int64_t rows = 5, V = 2048;
    std::vector<double> xd, yd;
    const auto xh = make_side<bf16>(s, rows, V, V, 0, xd);
    const auto yh = make_side<float>(Form::log_probs, rows, V, V, 0, yd);
    // The reference, through the forms of the double reference.
    std::vector<double> want(rows * V), lg, pr, ylg, ypr;
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      tigon_ref::forms(s, &xd[r * V], V, 1.0, lg, pr);
      tigon_ref::forms(Form::log_probs, &yd[r * V], V, 1.0, ylg, ypr);
      double sum_g = 0;
      for (std::int64_t i = 0; i < V; ++i) {
        const double d = lg[i] - ylg[i];
        total += d * d;
        want[r * V + i] = 2 * d / rows;  // batchmean over rows without labels
        sum_g += want[r * V + i];
      }
      if (s == Form::logits) {
        for (std::int64_t i = 0; i < V; ++i) want[r * V + i] -= pr[i] * sum_g;
      }
    }
    DeviceBuffer<bf16> x(xh.size());
    DeviceBuffer<float> y(yh.size()), loss(1), lr(rows);
    x.upload(xh);
    y.upload(yh);
    DivergenceArgs<bf16, float> a{.student = x.ptr, .student_input = input_of(s), .teacher = y.ptr, .rows = rows,
                                  .vocab = V, .dx = x.ptr, .loss = loss.ptr, .loss_rows = lr.ptr};
    TIGON_OK(divergence(a, SquaredLogs{}, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const double got = loss.download()[0];
    CHECK(std::abs(got - total / rows) <= 1e-4 * total / rows);
    const auto gh = x.download();
    double scale = 0;
    for (double v : want) scale = std::max(scale, std::abs(v));
    const auto cg = gpu_test::compare(want.size(), gpu_test::strided(gh, 0, V, V), want, 1e-3 * scale, gpu_test::tol<bf16>());
    GPU_CHECK_CLOSE(cg, "grad", 2 * gpu_test::tol_l2<bf16>());
  }
}

TEST_CASE("divergence: graph capture matches eager bitwise", "[div][gpu][graph]") {
  // Labels under batchmean (the count, the rows, the reduction), on the streaming and the row kernels.
  for (Form f : {Form::log_probs, Form::logits}) {
    INFO("form " << form_name(f));
    const std::int64_t rows = 256, V = 32000;
    std::vector<double> xd, yd;
    const auto xh = make_side<bf16>(f, rows, V, V, 0, xd);
    const auto yh = make_side<bf16>(f, rows, V, V, 0, yd);
    std::vector<std::int64_t> lab(rows);
    for (std::int64_t r = 0; r < rows; ++r) lab[r] = r % 5 == 0 ? -100 : r;
    DeviceBuffer<bf16> x(xh.size()), y(yh.size());
    DeviceBuffer<std::int64_t> lb(rows);
    DeviceBuffer<float> loss(1);
    y.upload(yh);
    lb.upload(lab);
    DivergenceArgs<bf16> a{.student = x.ptr, .student_input = input_of(f), .teacher = y.ptr,
                           .teacher_input = input_of(f), .rows = rows, .vocab = V, .labels = lb.ptr,
                           .dx = x.ptr, .loss = loss.ptr};
    std::size_t wsb = 0;
    TIGON_OK(divergence_workspace_bytes(a, wsb));
    DeviceBuffer<unsigned char> ws(wsb);
    a.workspace = ws.ptr;
    a.workspace_bytes = wsb;
    const GeneralizedJSD div{0.5f};
    x.upload(xh);
    TIGON_OK(divergence(a, div, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto g1 = x.download();
    const float l1 = loss.download()[0];
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    TIGON_OK(divergence(a, div, s));
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      x.upload(xh);
      loss.poison();
      CUDA_OK(cudaGraphLaunch(exec, s));
      CUDA_OK(cudaStreamSynchronize(s));
      CHECK(std::memcmp(g1.data(), x.download().data(), g1.size() * sizeof(bf16)) == 0);
      const float l2 = loss.download()[0];
      CHECK(std::memcmp(&l1, &l2, sizeof(float)) == 0);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}
