// Host tests of RoPE's math layer (the pair rotation the kernel calls) against the Hugging Face
// formula in double precision, forward and backward.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include <tigon/rope/rope.cuh>

#include "../reference/rope_ref.hpp"

using namespace tigon;

namespace {
// Apply rope_math::rotate to a whole head the way the kernel pairs channels.
std::vector<double> via_math(const std::vector<double>& x, const std::vector<double>& c,
                             const std::vector<double>& s, int rd, bool interleaved, bool backward) {
  std::vector<double> y(x);
  const int h = rd / 2;
  for (int p = 0; p < h; ++p) {
    const int i = interleaved ? 2 * p : p, j = interleaved ? 2 * p + 1 : p + h;
    float yi, yj;
    rope_math::rotate(float(x[i]), float(x[j]), float(c[i]), float(c[j]), float(s[i]), float(s[j]),
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
    for (int rd : {64, 32}) {  // full and partial rotary (head_dim 64)
      const int hd = 64;
      std::vector<double> x(hd), dy(hd), c(rd), s(rd);
      for (auto& v : x) v = float(nd(gen));
      for (auto& v : dy) v = float(nd(gen));
      for (int d = 0; d < rd; ++d) {  // arbitrary (not HF-symmetric) tables: the transpose must hold
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
