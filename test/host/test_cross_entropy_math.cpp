// Host tests of cross-entropy: the reference's analytic gradient against finite differences of its
// own loss with every option on, and the math layer (ce_math) against the reference.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>

#include "../reference/cross_entropy_ref.hpp"

using namespace tigon;

TEST_CASE("cross_entropy reference: analytic gradient = finite differences, every option", "[ce][math]") {
  std::mt19937 gen(3);
  std::normal_distribution<double> nd(0, 2);
  const std::int64_t rows = 4, V = 11;
  std::vector<double> x(rows * V);
  for (auto& v : x) v = nd(gen);
  const std::vector<std::int64_t> t = {3, -100, 0, 10};
  for (int red : {0, 1, 2}) {
    tigon_ref::CeOptions o;
    o.eps = 0.1;
    o.z = 1e-2;
    o.cap = 5;
    o.reduction = red;
    o.grad_scale = 0.7;
    o.weights.resize(V);
    for (auto& w : o.weights) w = 0.5 + std::abs(nd(gen));
    if (red == 0) {
      o.grad_output = {1.0, 2.0, -0.5, 3.0};
    } else {
      o.grad_output = {1.3};
    }
    const auto r = tigon_ref::cross_entropy(x, t, rows, V, o, true);
    // The scalar whose gradient the op returns: sum_n up_n * loss_n (none) or up * loss.
    auto objective = [&](const std::vector<double>& xs) {
      const auto q = tigon_ref::cross_entropy(xs, t, rows, V, o, false);
      if (red != 0) return o.grad_scale * o.grad_output[0] * q.loss;
      double s = 0;
      for (std::int64_t n = 0; n < rows; ++n) s += o.grad_scale * o.grad_output[n] * q.loss_rows[n];
      return s;
    };
    for (std::int64_t k = 0; k < rows * V; k += 3) {
      auto xp = x, xm = x;
      xp[k] += 1e-6;
      xm[k] -= 1e-6;
      const double fd = (objective(xp) - objective(xm)) / 2e-6;
      INFO("reduction " << red << " element " << k);
      CHECK(std::abs(fd - r.grad[k]) < 1e-6 * (1 + std::abs(fd)));
    }
  }
}

TEST_CASE("cross_entropy reference: token scaling multiplies each row by its constant p_t", "[ce][math]") {
  std::mt19937 gen(5);
  std::normal_distribution<double> nd(0, 2);
  const std::int64_t rows = 3, V = 9;
  std::vector<double> x(rows * V);
  for (auto& v : x) v = nd(gen);
  const std::vector<std::int64_t> t = {2, -100, 8};
  tigon_ref::CeOptions o;
  o.eps = 0.1;
  o.z = 1e-2;
  o.reduction = 0;
  const auto plain = tigon_ref::cross_entropy(x, t, rows, V, o, true);
  o.token_scaling = true;
  const auto scaled = tigon_ref::cross_entropy(x, t, rows, V, o, true);
  for (std::int64_t n = 0; n < rows; ++n) {
    const double f = t[n] < 0 ? 0.0 : std::exp(x[n * V + t[n]] - plain.lse[n]);
    CHECK(std::abs(scaled.loss_rows[n] - f * plain.loss_rows[n]) < 1e-12);
    CHECK(std::abs(scaled.z_rows[n] - f * plain.z_rows[n]) < 1e-12);
    for (std::int64_t i = 0; i < V; ++i) CHECK(std::abs(scaled.grad[n * V + i] - f * plain.grad[n * V + i]) < 1e-12);
  }
}

TEST_CASE("cross_entropy math layer matches the reference", "[ce][math]") {
  const double lse = 3.25, xt = 1.5;
  ce_math::RowTerms terms{.w_t = 2.0f, .sum_w = 10.0f, .sum_wx = 4.0f, .x_t = float(xt), .lse = float(lse)};
  const float l = ce_math::row_loss(terms, 0.1f, 8);
  const double ref = 0.9 * 2.0 * (lse - xt) + 0.1 / 8 * (lse * 10.0 - 4.0);
  CHECK(std::abs(l - ref) < 1e-5);
  const float g = ce_math::grad(0.25f, true, 1.5f, terms, 0.1f, 0.01f, 8);
  const double gref = 0.9 * 2.0 * (0.25 - 1) + 0.1 / 8 * (0.25 * 10 - 1.5) + 2 * 0.01 * lse * 0.25;
  CHECK(std::abs(g - gref) < 1e-6);
  float m = 1.0f, s = 2.0f;
  ce_math::merge(m, s, 3.0f, 1.0f);
  CHECK(m == 3.0f);
  CHECK(std::abs(s - (2.0 * std::exp(-2.0) + 1.0)) < 1e-6);
  CHECK(std::abs(ce_math::softcap(100.0f, 30.0f) - 30.0 * std::tanh(100.0 / 30.0)) < 1e-4);
  CHECK(ce_math::softcap(5.0f, 0.0f) == 5.0f);
}

TEST_CASE("cross_entropy resident kernels' shape: blocks per row and slices", "[ce][dispatch]") {
  using detail::ce_res_shape;
  // The plain kernel's default, 256 threads x 8 vectors: bf16 LLaMA-3 rows in 8 blocks.
  auto s = ce_res_shape(128256 / 8, 256, 8);
  CHECK(s.csize == 8);
  CHECK(s.slice == 2004);
  CHECK(s.slice * s.csize >= 128256 / 8);
  s = ce_res_shape(32000 / 8, 256, 8);  // LLaMA-2: 2 blocks
  CHECK(s.csize == 2);
  CHECK(s.slice == 2000);
  // A row that fits one block takes one block; a row with fewer vectors than threads the row kernel.
  CHECK(ce_res_shape(1000 / 8, 256, 8).csize == 0);
  CHECK(ce_res_shape(16384 / 8, 256, 8).csize == 1);  // one block, no messages
  CHECK(ce_res_shape(2048 / 8, 256, 8).csize == 1);
  CHECK(ce_res_shape(2040 / 8, 256, 8).csize == 0);  // fewer vectors than threads: the row kernel
  CHECK(ce_res_shape(16392 / 8, 256, 8).csize == 2);
  // 512 threads x 4 vectors: the same blocks per row.
  CHECK(ce_res_shape(128256 / 8, 512, 4).csize == 8);
  CHECK(ce_res_shape(256000 / 8, 512, 4).csize == 16);  // Gemma: 16 blocks, the largest cluster
  // Uneven clusters, and rows over 16 blocks (the row kernel).
  s = ce_res_shape(40000 / 8, 128, 8);
  CHECK(s.csize == 5);
  CHECK(s.slice == 1000);
  CHECK(ce_res_shape(262144 / 4, 256, 8).csize == 0);  // fp32: 32 blocks
  CHECK(ce_res_shape(262144 / 8, 256, 8).csize == 16);
  CHECK(ce_res_shape(0, 256, 8).csize == 0);
}

namespace {
struct Mine : CrossEntropyPolicy {
  static constexpr int kResAhead = 16;
};
}  // namespace

TEST_CASE("cross_entropy policy: a derived policy overrides one member", "[ce][dispatch]") {
  STATIC_REQUIRE(Mine::kResAhead == 16);
  STATIC_REQUIRE(Mine::kResThreads == CrossEntropyPolicy::kResThreads);
  STATIC_REQUIRE(detail::check_ce_policy<Mine>());
  STATIC_REQUIRE(std::is_same_v<CrossEntropyDefaultPolicy, CrossEntropyPolicy>);
}

TEST_CASE("cross_entropy softcap: the rational tanh against std::tanh", "[ce][math]") {
  double worst = 0;
  for (int i = -200000; i <= 200000; ++i) {
    const float u = static_cast<float>(i) * 6e-5f;
    worst = std::max(worst, std::abs(double(ce_math::tanh_rational(u)) - std::tanh(double(u))));
  }
  CHECK(worst < 1e-6);
  CHECK(ce_math::tanh_rational(50.0f) == ce_math::tanh_rational(7.90531110763549805f));
  CHECK(ce_math::tanh_rational(-50.0f) == -ce_math::tanh_rational(50.0f));
  CHECK(std::abs(ce_math::tanh_rational(50.0f) - 1.0) < 1e-6);
}
