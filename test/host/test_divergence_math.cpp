// Host tests of the divergences: the reference's analytic gradient against finite differences of its
// own loss (every divergence, input form and reduction, labels, upstream gradients, temperature),
// the functors' values and gradients against the reference and finite differences element by
// element, GeneralizedJSD's beta limits, the element forms and logsumexp folds, a user functor's
// default traits, the policy check and the workspace plan.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <tigon/loss/divergence.cuh>

#include "../reference/divergence_ref.hpp"

using namespace tigon;
using tigon_ref::Div;
using tigon_ref::Form;
using tigon_ref::Red;

namespace {

const Form kForms[] = {Form::log_probs, Form::probs, Form::logits};

DivergenceInput to_input(Form f) { return static_cast<DivergenceInput>(static_cast<int>(f)); }

// The input forms each divergence takes (tigon's accepts(), restated).
bool takes(Div d, Form s, Form t) {
  switch (d) {
    case Div::forward_kl:
    case Div::reverse_kl:
    case Div::jsd: return s != Form::probs && t != Form::probs;
    case Div::kldiv: return s != Form::probs;
    case Div::tvd: return true;
  }
  return false;
}

const char* div_label(Div d) {
  switch (d) {
    case Div::forward_kl: return "forward_kl";
    case Div::reverse_kl: return "reverse_kl";
    case Div::jsd: return "jsd";
    case Div::kldiv: return "kldiv";
    case Div::tvd: return "tvd";
  }
  return "?";
}

// Values of one side in form f: logits ~ N(0, 2), or the log-softmax / softmax of such logits.
std::vector<double> values(Form f, std::int64_t rows, std::int64_t V, std::mt19937& gen, double sd = 2) {
  std::normal_distribution<double> nd(0, sd);
  std::vector<double> v(static_cast<std::size_t>(rows * V));
  for (auto& e : v) e = nd(gen);
  if (f == Form::logits) return v;
  for (std::int64_t n = 0; n < rows; ++n) {
    std::vector<double> lg, pr;
    tigon_ref::forms(Form::logits, &v[n * V], V, 1.0, lg, pr);
    for (std::int64_t i = 0; i < V; ++i) v[n * V + i] = f == Form::probs ? pr[i] : lg[i];
  }
  return v;
}

}  // namespace

TEST_CASE("divergence reference: analytic gradient = finite differences", "[div][math]") {
  std::mt19937 gen(11);
  const std::int64_t rows = 4, V = 9;
  for (Div d : {Div::forward_kl, Div::reverse_kl, Div::jsd, Div::kldiv, Div::tvd}) {
    for (Form s : kForms) {
      for (Form t : kForms) {
        if (!takes(d, s, t)) continue;
        for (Red red : {Red::none, Red::sum, Red::mean, Red::batchmean}) {
          for (int variant = 0; variant < 2; ++variant) {
            tigon_ref::DivOptions o;
            o.div = d;
            o.beta = 0.3;
            o.student = s;
            o.teacher = t;
            o.reduction = red;
            o.temperature = variant == 0 ? 1.0 : 1.7;
            if (variant == 1) {
              o.labels = {5, -100, 2, 7};
              o.grad_scale = 0.6;
              std::uniform_real_distribution<double> ud(0.5, 2.0);
              const bool elems = red == Red::none && tigon_ref::elementwise_none(d);
              const std::int64_t n_go = red != Red::none ? 1 : (elems ? rows * V : rows);
              for (std::int64_t k = 0; k < n_go; ++k) o.grad_output.push_back(ud(gen));
            }
            const auto x = values(s, rows, V, gen);
            const auto y = values(t, rows, V, gen);
            const auto r = tigon_ref::divergence(x, y, rows, V, o, true);
            // The scalar whose gradient the op returns.
            auto objective = [&](const std::vector<double>& xs) {
              const auto q = tigon_ref::divergence(xs, y, rows, V, o, false);
              double up = o.grad_output.empty() ? 1.0 : o.grad_output[0];
              if (red != Red::none) return o.grad_scale * up * q.loss;
              double sum = 0;
              const bool elems = tigon_ref::elementwise_none(d);
              for (std::int64_t n = 0; n < rows; ++n) {
                if (elems) {
                  for (std::int64_t i = 0; i < V; ++i) {
                    const double w = o.grad_output.empty() ? 1.0 : o.grad_output[n * V + i];
                    sum += w * q.loss_elems[n * V + i];
                  }
                } else {
                  sum += (o.grad_output.empty() ? 1.0 : o.grad_output[n]) * q.loss_rows[n];
                }
              }
              return o.grad_scale * sum;
            };
            for (std::int64_t k = 0; k < rows * V; ++k) {
              const double h = s == Form::probs ? 1e-8 : 1e-6;
              auto xp = x, xm = x;
              xp[k] += h;
              xm[k] -= h;
              const double fd = (objective(xp) - objective(xm)) / (2 * h);
              INFO(div_label(d) << " student " << int(s) << " teacher " << int(t) << " reduction " << int(red)
                                << " variant " << variant << " element " << k);
              CHECK(std::abs(fd - r.grad[k]) < 1e-6 * (1 + std::abs(fd)));
            }
          }
        }
      }
    }
  }
}

namespace {

// Functor D against the reference's element, and the reference element's gradient against finite
// differences, over random elements of the forms (kS, kT).
template <class D, DivergenceInput kS, DivergenceInput kT>
void check_elements(const D& div, const tigon_ref::DivOptions& o, std::mt19937& gen) {
  std::normal_distribution<double> nd(0, 3);
  std::uniform_real_distribution<double> ud(1e-6, 0.9);
  const float inv_temp = 1.0f / static_cast<float>(o.temperature);
  const float lse_x = 2.5f, lse_y = -1.25f;  // arbitrary: only the identity log q = v / T - lse matters
  auto draw = [&](DivergenceInput k) {
    if (k == DivergenceInput::probs) return static_cast<float>(ud(gen));
    if (k == DivergenceInput::log_probs) return static_cast<float>(-std::abs(nd(gen)) - 0.01);
    return static_cast<float>(nd(gen));
  };
  auto ref_forms = [&](DivergenceInput k, double v, double lse, double& lg, double& pr) {
    if (k == DivergenceInput::probs) {
      pr = v;
      lg = std::log(v);
    } else if (k == DivergenceInput::log_probs) {
      lg = v;
      pr = std::exp(v);
    } else {
      lg = v / o.temperature - lse;
      pr = std::exp(lg);
    }
  };
  for (int n = 0; n < 2000; ++n) {
    const float x = draw(kS), y = draw(kT);
    float q = 0;
    const DivergenceValue got = div_math::evaluate<D, kS, kT>(div, x, y, inv_temp, lse_x, lse_y, q);
    double xl, xp, yl, yp;
    ref_forms(kS, x, lse_x, xl, xp);
    ref_forms(kT, y, lse_y, yl, yp);
    tigon_ref::ElemValue want = tigon_ref::element(o, xl, xp, yl, yp);
    const bool tvd = o.div == Div::tvd;
    if (tvd && kS != DivergenceInput::probs) want.grad *= xp;
    INFO(div_label(o.div) << " kS " << int(kS) << " kT " << int(kT) << " x " << x << " y " << y);
    // fp32 rounding of the element's terms (p log p, q log q, ...), which may cancel.
    const double scale = 1 + std::abs(want.loss) + xp * (1 + std::abs(xl)) + yp * (1 + std::abs(yl));
    CHECK(std::abs(got.loss - want.loss) <= 2e-6 * scale);
    if (!(tvd && std::abs(xp - yp) < 1e-6 * (xp + yp))) {
      CHECK(std::abs(got.grad - want.grad) <= 2e-6 * scale);
    }
    CHECK(std::abs(q - xp) <= 1e-6 * (1 + xp));
    // The reference element's gradient against finite differences of its loss in the student's
    // log-probability (probability for TVD), the other side held.
    const double h = 1e-5;
    tigon_ref::ElemValue e = tigon_ref::element(o, xl, xp, yl, yp);
    double fd;
    if (tvd) {
      if (std::abs(xp - yp) < 1e-4) continue;
      fd = (tigon_ref::element(o, std::log(xp + h), xp + h, yl, yp).loss -
            tigon_ref::element(o, std::log(xp - h), xp - h, yl, yp).loss) / (2 * h);
    } else {
      fd = (tigon_ref::element(o, xl + h, std::exp(xl + h), yl, yp).loss -
            tigon_ref::element(o, xl - h, std::exp(xl - h), yl, yp).loss) / (2 * h);
    }
    CHECK(std::abs(fd - e.grad) <= 1e-6 * scale);
  }
}

template <class D>
void check_functor(const D& div, tigon_ref::DivOptions o, std::mt19937& gen) {
  constexpr auto L = DivergenceInput::log_probs, P = DivergenceInput::probs, Z = DivergenceInput::logits;
  auto one = [&](auto sc, auto tc) {
    constexpr DivergenceInput kS = decltype(sc)::value, kT = decltype(tc)::value;
    if constexpr (detail::div_accepts<D>(kS, kT)) {
      o.student = static_cast<Form>(static_cast<int>(kS));
      o.teacher = static_cast<Form>(static_cast<int>(kT));
      check_elements<D, kS, kT>(div, o, gen);
    }
  };
  using LC = std::integral_constant<DivergenceInput, L>;
  using PC = std::integral_constant<DivergenceInput, P>;
  using ZC = std::integral_constant<DivergenceInput, Z>;
  one(LC{}, LC{}), one(LC{}, PC{}), one(LC{}, ZC{});
  one(PC{}, LC{}), one(PC{}, PC{}), one(PC{}, ZC{});
  one(ZC{}, LC{}), one(ZC{}, PC{}), one(ZC{}, ZC{});
}

}  // namespace

TEST_CASE("divergence functors match the reference element by element", "[div][math]") {
  std::mt19937 gen(5);
  tigon_ref::DivOptions o;
  o.temperature = 2.0;
  o.div = Div::forward_kl;
  check_functor(ForwardKL{}, o, gen);
  o.div = Div::reverse_kl;
  check_functor(ReverseKL{}, o, gen);
  o.div = Div::jsd;
  for (double beta : {0.0, 0.1, 0.5, 0.9, 1.0}) {
    o.beta = beta;
    check_functor(GeneralizedJSD{static_cast<float>(beta)}, o, gen);
  }
  o.div = Div::kldiv;
  for (double eps : {1e-10, 1e-3}) {
    o.eps = eps;
    check_functor(KLDiv{static_cast<float>(eps)}, o, gen);
  }
  o.div = Div::tvd;
  check_functor(TVD{}, o, gen);
}

TEST_CASE("divergence functors: zero probabilities, the eps clamp and TVD's sign", "[div][math]") {
  using E = DivergenceElement<DivergenceInput::log_probs, DivergenceInput::log_probs>;
  const float inf = __builtin_huge_valf();
  // A teacher probability of 0 (log-prob -inf) adds nothing to the forward KL, and no NaN.
  const E zero_p{-1.0f, std::exp(-1.0f), -inf, 0.0f};
  CHECK(ForwardKL{}(zero_p).loss == 0.0f);
  CHECK(ForwardKL{}(zero_p).grad == 0.0f);
  const E zero_q{-inf, 0.0f, -1.0f, std::exp(-1.0f)};
  CHECK(ReverseKL{}(zero_q).loss == 0.0f);
  CHECK(ReverseKL{}(zero_q).grad == 0.0f);
  const E both{-inf, 0.0f, -inf, 0.0f};
  CHECK(GeneralizedJSD{0.5f}(both).loss == 0.0f);
  CHECK(GeneralizedJSD{0.5f}(both).grad == 0.0f);
  CHECK(std::isfinite(GeneralizedJSD{0.5f}(zero_q).loss));
  CHECK(GeneralizedJSD{0.5f}(zero_q).grad == 0.0f);
  // KLDiv with a probability target: log max(p, eps); the gradient is -p either way.
  using EP = DivergenceElement<DivergenceInput::log_probs, DivergenceInput::probs>;
  const EP tiny{-2.0f, std::exp(-2.0f), std::log(1e-12f), 1e-12f};
  const KLDiv kl{1e-10f};
  CHECK(std::abs(kl(tiny).loss - 1e-12 * (std::log(1e-10) + 2.0)) < 1e-16);
  CHECK(kl(tiny).grad == -1e-12f);
  const EP zero{-2.0f, std::exp(-2.0f), -inf, 0.0f};
  CHECK(kl(zero).loss == 0.0f);
  // TVD: +1/2 where q > p, -1/2 where q <= p (ties included, as Liger).
  using EPP = DivergenceElement<DivergenceInput::probs, DivergenceInput::probs>;
  CHECK(TVD{}(EPP{0, 0.3f, 0, 0.2f}).grad == 0.5f);
  CHECK(TVD{}(EPP{0, 0.2f, 0, 0.3f}).grad == -0.5f);
  CHECK(TVD{}(EPP{0, 0.25f, 0, 0.25f}).grad == -0.5f);
  CHECK(TVD{}(EPP{0, 0.25f, 0, 0.25f}).loss == 0.0f);
  CHECK(std::abs(TVD{}(EPP{0, 0.2f, 0, 0.3f}).loss - 0.05f) < 1e-7f);
}

TEST_CASE("GeneralizedJSD: beta 0 and 1 are the KLs; the mixture tends to them scaled", "[div][math]") {
  std::mt19937 gen(17);
  std::normal_distribution<float> nd(0, 3);
  // Bitwise the KL functors at the end points.
  for (int n = 0; n < 1000; ++n) {
    const float xl = -std::abs(nd(gen)), yl = -std::abs(nd(gen));
    const DivergenceElement<DivergenceInput::log_probs, DivergenceInput::log_probs> e{xl, std::exp(xl), yl,
                                                                                      std::exp(yl)};
    const DivergenceValue j0 = GeneralizedJSD{0.0f}(e), f = ForwardKL{}(e);
    const DivergenceValue j1 = GeneralizedJSD{1.0f}(e), r = ReverseKL{}(e);
    CHECK(j0.loss == f.loss);
    CHECK(j0.grad == f.grad);
    CHECK(j1.loss == r.loss);
    CHECK(j1.grad == r.grad);
  }
  // Over normalised rows given as logits: JSD(beta) / beta -> KL(p || q) as beta -> 0, and
  // JSD(beta) / (1 - beta) -> KL(q || p) as beta -> 1, losses and logits gradients alike, the
  // distance shrinking with beta (first order: tenfold per tenfold).
  const std::int64_t rows = 3, V = 50;
  const auto x = values(Form::logits, rows, V, gen, 1.0);
  const auto y = values(Form::logits, rows, V, gen, 1.0);
  tigon_ref::DivOptions o;
  o.student = o.teacher = Form::logits;
  o.reduction = Red::sum;
  auto run = [&](Div d, double beta) {
    o.div = d;
    o.beta = beta;
    return tigon_ref::divergence(x, y, rows, V, o, true);
  };
  const auto fkl = run(Div::forward_kl, 0), rkl = run(Div::reverse_kl, 0);
  // The distance of the scaled JSD from the KL at beta = b (low end) or 1 - b (high end): loss
  // and gradient, each relative to the KL's.
  auto distance = [&](double b, bool high) {
    const auto j = run(Div::jsd, high ? 1 - b : b);
    const auto& kl = high ? rkl : fkl;
    double worst = 0, scale = 0;
    for (std::size_t k = 0; k < kl.grad.size(); ++k) {
      worst = std::max(worst, std::abs(j.grad[k] / b - kl.grad[k]));
      scale = std::max(scale, std::abs(kl.grad[k]));
    }
    return std::pair<double, double>{std::abs(j.loss / b - kl.loss) / std::abs(kl.loss), worst / scale};
  };
  for (bool high : {false, true}) {
    INFO((high ? "beta -> 1" : "beta -> 0"));
    const auto d3 = distance(1e-3, high), d4 = distance(1e-4, high), d5 = distance(1e-5, high);
    CHECK(d5.first < 1e-3);
    CHECK(d5.second < 1e-3);
    CHECK(d5.first < 0.2 * d4.first);
    CHECK(d4.first < 0.2 * d3.first);
    CHECK(d5.second < 0.2 * d4.second);
    CHECK(d4.second < 0.2 * d3.second);
  }
  // validate(): beta outside [0, 1] (or NaN) is rejected by name.
  CHECK(GeneralizedJSD{0.0f}.validate("t").ok());
  CHECK(GeneralizedJSD{1.0f}.validate("t").ok());
  for (float bad : {-0.01f, 1.01f, std::nanf("")}) {
    const Status s = GeneralizedJSD{bad}.validate("t");
    CHECK(s.code() == Errc::invalid_value);
    CHECK(std::string(s.argument()) == "beta");
  }
  CHECK(std::string(KLDiv{-1.0f}.validate("t").argument()) == "eps");
}

TEST_CASE("divergence math: element forms and logsumexp folds", "[div][math]") {
  float lg = 0, pr = 0;
  div_math::element_forms<DivergenceInput::log_probs>(-1.5f, 1.0f, 0.0f, lg, pr);
  CHECK(lg == -1.5f);
  CHECK(std::abs(pr - std::exp(-1.5)) < 1e-7);
  div_math::element_forms<DivergenceInput::probs>(0.25f, 1.0f, 0.0f, lg, pr);
  CHECK(pr == 0.25f);
  CHECK(std::abs(lg - std::log(0.25)) < 1e-7);
  div_math::element_forms<DivergenceInput::logits>(3.0f, 0.5f, 2.0f, lg, pr);
  CHECK(std::abs(lg - (1.5 - 2.0)) < 1e-7);
  CHECK(std::abs(pr - std::exp(-0.5)) < 1e-7);
  // A row folded 4 values at a time, in two halves merged, against the direct logsumexp; -inf
  // values (masked logits) add nothing.
  const float ninf = -__builtin_huge_valf();
  const float v[12] = {ninf, ninf, ninf, ninf, 1.0f, -2.0f, 30.0f, 0.5f, ninf, 7.0f, -40.0f, 29.5f};
  double m = -INFINITY;
  for (float e : v) m = std::max(m, double(e));
  double s = 0;
  for (float e : v) s += std::exp(double(e) - m);
  const double want = m + std::log(s);
  float am = ninf, as = 0, bm = ninf, bs = 0;
  for (int c = 0; c < 8; c += 4) {
    const float part[4] = {v[c], v[c + 1], v[c + 2], v[c + 3]};
    div_math::lse_fold(am, as, part);
  }
  const float last[4] = {v[8], v[9], v[10], v[11]};
  div_math::lse_fold(bm, bs, last);
  div_math::lse_merge(am, as, bm, bs);
  CHECK(std::abs(am + std::log(as) - want) < 1e-5);
  float em = ninf, es = 0;
  const float empty[4] = {ninf, ninf, ninf, ninf};
  div_math::lse_fold(em, es, empty);
  CHECK(em == ninf);
  CHECK(es == 0.0f);
  div_math::lse_merge(em, es, ninf, 0.0f);
  CHECK(es == 0.0f);
}

namespace {
// A user divergence with only the call operator: the squared difference of the log-probabilities.
struct SquaredLogs {
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    const float d = e.x_log - e.y_log;
    return {d * d, 2.0f * d};
  }
};
// One that takes the student as probabilities, its gradient against them.
struct ProbsOnly {
  static constexpr DivergenceInput kGradForm = DivergenceInput::probs;
  static constexpr bool kElementwiseNone = true;
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s == DivergenceInput::probs && t == DivergenceInput::probs;
  }
  template <class E>
  TIGON_HD DivergenceValue operator()(const E& e) const {
    return {e.x_prob * e.y_prob, e.y_prob};
  }
};
struct Mine : DivergencePolicy {
  static constexpr int kStreamUnroll = 4;
};
}  // namespace

TEST_CASE("divergence traits: a user functor's defaults, the built-ins' input forms, the policy", "[div][dispatch]") {
  constexpr auto L = DivergenceInput::log_probs, P = DivergenceInput::probs, Z = DivergenceInput::logits;
  STATIC_REQUIRE(detail::div_grad_form<SquaredLogs>() == L);
  STATIC_REQUIRE(!detail::div_elementwise_none<SquaredLogs>());
  STATIC_REQUIRE(detail::div_accepts<SquaredLogs>(L, Z));
  STATIC_REQUIRE(!detail::div_accepts<SquaredLogs>(P, L));
  STATIC_REQUIRE(!detail::div_accepts<SquaredLogs>(L, P));
  CHECK(std::string(detail::div_name<SquaredLogs>()) == "the divergence");
  STATIC_REQUIRE(detail::div_accepts<ProbsOnly>(P, P));
  STATIC_REQUIRE(!detail::div_accepts<ProbsOnly>(L, P));
  STATIC_REQUIRE(detail::div_elementwise_none<ProbsOnly>());
  for (Form s : kForms) {
    for (Form t : kForms) {
      INFO("student " << int(s) << " teacher " << int(t));
      CHECK(detail::div_accepts<ForwardKL>(to_input(s), to_input(t)) == takes(Div::forward_kl, s, t));
      CHECK(detail::div_accepts<ReverseKL>(to_input(s), to_input(t)) == takes(Div::reverse_kl, s, t));
      CHECK(detail::div_accepts<GeneralizedJSD>(to_input(s), to_input(t)) == takes(Div::jsd, s, t));
      CHECK(detail::div_accepts<KLDiv>(to_input(s), to_input(t)) == takes(Div::kldiv, s, t));
      CHECK(detail::div_accepts<TVD>(to_input(s), to_input(t)) == takes(Div::tvd, s, t));
    }
  }
  STATIC_REQUIRE(detail::div_elementwise_none<KLDiv>() && detail::div_elementwise_none<TVD>());
  STATIC_REQUIRE(!detail::div_elementwise_none<GeneralizedJSD>());
  // A user functor through evaluate: student logits, the gradient against the log-probability.
  float q = 0;
  const DivergenceValue v = div_math::evaluate<SquaredLogs, Z, L>(SquaredLogs{}, 2.0f, -1.0f, 0.5f, 1.5f, 0.0f, q);
  CHECK(std::abs(v.loss - 0.25f) < 1e-6f);  // log q = 2 * 0.5 - 1.5 = -0.5
  CHECK(std::abs(v.grad - 1.0f) < 1e-6f);
  CHECK(std::abs(q - std::exp(-0.5f)) < 1e-6f);
  // TVD's gradient against q becomes one against log q for a log-prob student.
  const DivergenceValue t = div_math::evaluate<TVD, L, P>(TVD{}, std::log(0.5f), 0.25f, 1.0f, 0.0f, 0.0f, q);
  CHECK(std::abs(t.grad - 0.25f) < 1e-6f);
  STATIC_REQUIRE(Mine::kStreamUnroll == 4);
  STATIC_REQUIRE(Mine::kRowThreads == DivergencePolicy::kRowThreads);
  STATIC_REQUIRE(detail::check_divergence_policy<Mine>());
  STATIC_REQUIRE(detail::check_divergence_policy<DivergencePolicy>());
}

TEST_CASE("divergence workspace: the count and the partial sums only where needed", "[div][dispatch]") {
  alignas(16) static bf16 x[100 * 20000], y[100 * 20000];
  alignas(16) static std::int64_t lab[100];
  alignas(16) static float loss[1], rows_out[100];
  DivergenceArgs<bf16> a{.student = x, .teacher = y, .rows = 4, .vocab = 16};
  CHECK(detail::div_workspace(a).bytes == 0);  // no labels, no loss outputs
  CHECK(!detail::div_workspace(a).finish);
  a.loss = loss;
  CHECK(detail::div_workspace(a).bytes == 256);  // the rows' sums (one chunk each)
  CHECK(detail::div_workspace(a).partials);
  CHECK(detail::div_workspace(a).finish);
  a.loss_rows = rows_out;
  CHECK(detail::div_workspace(a).bytes == 0);  // loss_rows holds them
  CHECK(detail::div_workspace(a).finish);      // the loss from them
  a.loss = nullptr;
  CHECK(!detail::div_workspace(a).finish);  // the rows write loss_rows themselves
  a.loss = loss;
  a.labels = lab;
  CHECK(detail::div_workspace(a).bytes == 256);  // the count (batchmean)
  CHECK(detail::div_workspace(a).count);
  a.reduction = DivergenceReduction::sum;
  CHECK(detail::div_workspace(a).bytes == 0);
  a.reduction = DivergenceReduction::mean;
  a.loss_rows = nullptr;
  a.rows = 100;
  CHECK(detail::div_workspace(a).bytes == 512);  // 16 + 400 bytes, rounded to 256
  // Rows of 20000 columns take 3 chunks on the streaming kernel: partial sums even with loss_rows,
  // which the finish writes; with logits, one block (and one sum) a row.
  a.vocab = 20000;
  a.loss_rows = rows_out;
  CHECK(detail::div_workspace(a).chunks == 3);
  CHECK(detail::div_workspace(a).bytes == round_up<std::size_t>(16 + 100 * 3 * 4, 256));
  CHECK(detail::div_workspace(a).finish);
  a.loss = nullptr;
  CHECK(detail::div_workspace(a).finish);  // loss_rows from the partial sums
  a.teacher_input = DivergenceInput::logits;
  CHECK(detail::div_workspace(a).chunks == 1);
  CHECK(detail::div_workspace(a).bytes == 256);  // the count alone
  CHECK(!detail::div_workspace(a).finish);
  CHECK(detail::kDivChunkCols == 8192);
  std::size_t bytes = 1;
  a = DivergenceArgs<bf16>{.student = x, .teacher = y, .rows = 4, .vocab = 16, .labels = lab,
                           .reduction = DivergenceReduction::mean, .loss = loss};
  CHECK(divergence_workspace_bytes(a, bytes).ok());
  CHECK(bytes == 256);
  a.student = nullptr;
  CHECK(divergence_workspace_bytes(a, bytes).code() == Errc::null_pointer);
  CHECK(bytes == 0);
}
