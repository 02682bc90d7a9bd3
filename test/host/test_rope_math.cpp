// Host tests of RoPE's math layer (the pair rotation the kernel calls) against the Hugging Face
// formula in double precision, forward and backward; odd rotary dims against Liger-Kernel's rule.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include <tigon/rope/rope.cuh>

#include "../reference/rope_ref.hpp"

using namespace tigon;

namespace {
// Apply rope_math::rotate to a whole head the way the kernel pairs channels and reads the table
// (the second members at the second half of the 2 * ceil(rd / 2) wide row, half split).
std::vector<double> via_math(const std::vector<double>& x, const std::vector<double>& c,
                             const std::vector<double>& s, int rd, bool interleaved, bool backward) {
  std::vector<double> y(x);
  const int h = rd / 2, table_half = rd - h;
  for (int p = 0; p < h; ++p) {
    const int i = interleaved ? 2 * p : p, j = interleaved ? 2 * p + 1 : p + h;
    const int ti = i, tj = interleaved ? j : p + table_half;
    float yi, yj;
    rope_math::rotate(float(x[i]), float(x[j]), float(c[ti]), float(c[tj]), float(s[ti]), float(s[tj]),
                      backward, yi, yj);
    y[i] = yi;
    y[j] = yj;
  }
  return y;
}
}  // namespace

TEST_CASE("rope math: forward and backward match the HF formula and its transpose", "[rope][math]") {
  std::mt19937 gen(5);
  std::normal_distribution<double> nd;
  for (bool interleaved : {false, true}) {
    // Full and partial rotary, even and odd: (head_dim, rotary_dim).
    const std::pair<int, int> dims[] = {{64, 64}, {64, 32}, {41, 41}, {3, 3}, {127, 127}, {64, 33}, {41, 40}};
    for (const auto& [hd, rd] : dims) {
      INFO("head_dim " << hd << " rotary_dim " << rd << (interleaved ? " interleaved" : " half-split"));
      const int w = rd + rd % 2;  // the table row: 2 * ceil(rd / 2)
      std::vector<double> x(hd), dy(hd), c(w), s(w);
      for (auto& v : x) v = float(nd(gen));
      for (auto& v : dy) v = float(nd(gen));
      for (int d = 0; d < w; ++d) {  // arbitrary (not HF-symmetric) tables: the transpose must hold
        c[d] = float(nd(gen));
        s[d] = float(nd(gen));
      }
      const auto ref = tigon_ref::rope_head(x.data(), c.data(), s.data(), hd, rd, interleaved);
      const auto got = via_math(x, c, s, rd, interleaved, false);
      for (int d = 0; d < hd; ++d) CHECK(std::abs(got[d] - ref[d]) < 1e-5 * (1 + std::abs(ref[d])));
      const auto bref = tigon_ref::rope_head_backward(dy.data(), c.data(), s.data(), hd, rd, interleaved);
      const auto bgot = via_math(dy, c, s, rd, interleaved, true);
      for (int d = 0; d < hd; ++d) CHECK(std::abs(bgot[d] - bref[d]) < 1e-5 * (1 + std::abs(bref[d])));
      // <R x, dy> == <x, R^T dy>: the reference backward is the transpose of the forward.
      double l = 0, r = 0;
      for (int d = 0; d < hd; ++d) {
        l += ref[d] * dy[d];
        r += x[d] * bref[d];
      }
      CHECK(std::abs(l - r) < 1e-9 * (1 + std::abs(l)));
    }
  }
}

TEST_CASE("rope math: an odd head_dim is Liger-Kernel's rotation on Hugging Face's tables", "[rope][math]") {
  // head_dim D = 2n + 1 with the table Hugging Face's rotary embedding builds for it:
  // inv_freq = base^(-arange(0, D, 2) / D) (n + 1 angles), cos = cat(freqs, freqs) (2n + 2 wide).
  // Liger rotates (d, d + n) for d < n with cos[d] / sin[d] for both members and passes channel 2n
  // through; Hugging Face's apply_rotary_pos_emb raises on these shapes (D against 2n + 2).
  std::mt19937 gen(11);
  std::normal_distribution<double> nd;
  for (int hd : {41, 3, 127}) {
    INFO("head_dim " << hd);
    const int n = hd / 2, w = 2 * (n + 1);
    for (int pos : {0, 1, 7, 4095}) {
      std::vector<double> c(w), s(w), x(hd), dy(hd);
      for (int d = 0; d < w; ++d) {
        const int i = d % (n + 1);
        const double ang = pos * std::pow(10000.0, -2.0 * i / hd);
        c[d] = std::cos(ang);
        s[d] = std::sin(ang);
      }
      for (auto& v : x) v = nd(gen);
      for (auto& v : dy) v = nd(gen);
      std::vector<double> liger(x), liger_b(dy);
      for (int d = 0; d < n; ++d) {
        liger[d] = x[d] * c[d] - x[d + n] * s[d];
        liger[d + n] = x[d + n] * c[d] + x[d] * s[d];
        liger_b[d] = dy[d] * c[d] + dy[d + n] * s[d];
        liger_b[d + n] = dy[d + n] * c[d] - dy[d] * s[d];
      }
      const auto ref = tigon_ref::rope_head(x.data(), c.data(), s.data(), hd, hd, false);
      const auto bref = tigon_ref::rope_head_backward(dy.data(), c.data(), s.data(), hd, hd, false);
      const auto got = via_math(x, c, s, hd, false, false);
      const auto bgot = via_math(dy, c, s, hd, false, true);
      for (int d = 0; d < hd; ++d) {
        CHECK(std::abs(ref[d] - liger[d]) < 1e-12 * (1 + std::abs(liger[d])));
        CHECK(std::abs(bref[d] - liger_b[d]) < 1e-12 * (1 + std::abs(liger_b[d])));
        CHECK(std::abs(got[d] - liger[d]) < 1e-5 * (1 + std::abs(liger[d])));
        CHECK(std::abs(bgot[d] - liger_b[d]) < 1e-5 * (1 + std::abs(liger_b[d])));
      }
      CHECK(ref[hd - 1] == x[hd - 1]);  // the last channel passes through
      CHECK(bref[hd - 1] == dy[hd - 1]);
    }
  }
}
