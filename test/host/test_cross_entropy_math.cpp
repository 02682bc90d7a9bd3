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

TEST_CASE("cross_entropy on-chip kernel shape: blocks per row and slices", "[ce][dispatch]") {
  using detail::ce_cluster_shape;
  constexpr std::int64_t kSmem = 227 * 1024 - 4096;  // an H200 block's shared memory, less static
  constexpr std::int64_t k72 = 72 * 1024;
  // Automatic: the fewest of 1, 2, 4, 8 blocks whose slices fit 72 KiB.
  auto s = ce_cluster_shape(128256 / 8, 16, -1, k72, kSmem);  // bf16 LLaMA-3: 250.5 KiB a row
  CHECK(s.blocks == 4);
  CHECK(s.slice == 4008);
  CHECK(s.slice * 4 >= 128256 / 8);
  s = ce_cluster_shape(32000 / 8, 16, -1, k72, kSmem);  // 62.5 KiB: one block
  CHECK(s.blocks == 1);
  CHECK(s.slice == 4000);
  s = ce_cluster_shape(262144 / 8, 16, -1, k72, kSmem);  // 512 KiB: eight 64 KiB slices
  CHECK(s.blocks == 8);
  CHECK(s.slice == 4096);
  s = ce_cluster_shape(128256 / 4, 16, -1, k72, kSmem);  // fp32: 501 KiB
  CHECK(s.blocks == 8);
  // Over eight blocks' budget, the slices grow up to a block's shared memory, then the row kernel.
  s = ce_cluster_shape(1000000 / 8, 16, -1, k72, kSmem);  // 1.9 MiB: eight 244 KiB slices do not fit
  CHECK(s.blocks == 0);
  s = ce_cluster_shape(800000 / 8, 16, -1, k72, kSmem);  // 195 KiB slices fit
  CHECK(s.blocks == 8);
  // Forced sizes, uneven slices, off.
  s = ce_cluster_shape(128256 / 8, 16, 3, k72, kSmem);
  CHECK(s.blocks == 3);
  CHECK(s.slice == 5344);
  CHECK(ce_cluster_shape(128256 / 8, 16, 1, k72, kSmem).blocks == 0);  // 250.5 KiB in one block
  CHECK(ce_cluster_shape(128256 / 8, 16, 0, k72, kSmem).blocks == 0);
  CHECK(ce_cluster_shape(0, 16, -1, k72, kSmem).blocks == 0);
}
