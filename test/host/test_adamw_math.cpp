// The AdamW step's math on the host: the rule against torch.optim.AdamW's formula in double over
// several steps (AdamW and Adam), the coefficients, the stochastic rounding's neighbours and mean,
// the hash's determinism.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>

#include <tigon/optim/adamw.cuh>

using namespace tigon;

namespace {

// torch.optim.AdamW (and Adam with L2 decay) in double, one parameter.
struct Ref {
  double p, m = 0, v = 0;
  void step(double g, double lr, double b1, double b2, double eps, double wd, int t, bool decoupled) {
    if (decoupled) {
      p *= 1 - lr * wd;
    } else {
      g += wd * p;
    }
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
  }
};

}  // namespace

TEST_CASE("adamw math: the rule follows torch's AdamW and Adam over many steps", "[adamw][math]") {
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (bool decoupled : {true, false}) {
    for (double wd : {0.0, 0.1}) {
      INFO((decoupled ? "AdamW" : "Adam") << " weight decay " << wd);
      const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8;
      float p = 0.5f, m = 0.0f, v = 0.0f;
      Ref r{0.5};
      double worst = 0;
      for (int t = 1; t <= 200; ++t) {
        const float g = nd(gen);
        const AdamWCoeffs c = adamw_math::coeffs(lr, b1, b2, eps, wd, static_cast<float>(t), 1.0f, 1.0f, decoupled);
        AdamWRule::apply(p, g, m, v, c);
        r.step(g, lr, b1, b2, eps, wd, t, decoupled);
        worst = std::max(worst, std::abs(p - r.p));
      }
      CHECK(worst < 2e-5);
      CHECK(std::abs(m - r.m) < 1e-5);
      CHECK(std::abs(v - r.v) < 1e-5 * (1 + r.v));
    }
  }
}

TEST_CASE("adamw math: the coefficients and the gradient factor", "[adamw][math]") {
  const AdamWCoeffs c = adamw_math::coeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0f, 4.0f, 0.5f, true);
  CHECK(c.step_size == Approx(1e-3 / 0.1).epsilon(1e-5));
  CHECK(c.bc2_sqrt == Approx(std::sqrt(0.001)).epsilon(1e-4));
  CHECK(adamw_math::gradient(3.0f, c) == 3.0f / 4.0f * 0.5f);
  // The first step moves every parameter by about lr (m / sqrt(v) = sign(g) after bias correction).
  float p = 1.0f, m = 0.0f, v = 0.0f;
  AdamWRule::apply(p, 3.0f, m, v, adamw_math::coeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0f, 1.0f, 1.0f, true));
  CHECK(p == Approx(1.0 - 1e-3).epsilon(1e-6));
  // A zero gradient with zero moments leaves a parameter unchanged (no 0 / 0).
  p = 2.0f, m = 0.0f, v = 0.0f;
  AdamWRule::apply(p, 0.0f, m, v, adamw_math::coeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0f, 1.0f, 1.0f, true));
  CHECK(p == 2.0f);
}

TEST_CASE("adamw math: stochastic rounding to bfloat16", "[adamw][math]") {
  // Representable values stay; others land on one of their two neighbours, up in proportion to
  // the distance from the lower one.
  CHECK(adamw_math::stochastic_bf16(1.5f, 0xffffu) == 1.5f);
  CHECK(std::isinf(adamw_math::stochastic_bf16(INFINITY, 0xffffu)));
  CHECK(std::isnan(adamw_math::stochastic_bf16(NAN, 0u)));
  const float x = 1.0f + 0x1p-10f;  // an eighth of the way from 1 to the next bfloat16, 1 + 2^-7
  const float lo = 1.0f, hi = 1.0f + 0x1p-7f;
  double sum = 0;
  const int n = 200000;
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const float r = adamw_math::stochastic_bf16(x, adamw_math::hash(7, 1, static_cast<std::uint64_t>(i)));
    bad += r != lo && r != hi;
    sum += r;
  }
  CHECK(bad == 0);
  CHECK(std::abs(sum / n - x) < 2e-5);  // unbiased: the mean is x (x - lo is 1/8 of the spacing)
  // Negative values mirror.
  CHECK(adamw_math::stochastic_bf16(-x, 0u) == -lo);
  CHECK(adamw_math::stochastic_bf16(-x, 0xffffu) == -hi);
}

TEST_CASE("adamw math: the hash is a function of seed, step and index", "[adamw][math]") {
  CHECK(adamw_math::hash(1, 2, 3) == adamw_math::hash(1, 2, 3));
  CHECK(adamw_math::hash(1, 2, 3) != adamw_math::hash(1, 2, 4));
  CHECK(adamw_math::hash(1, 2, 3) != adamw_math::hash(1, 3, 3));
  CHECK(adamw_math::hash(1, 2, 3) != adamw_math::hash(2, 2, 3));
}
