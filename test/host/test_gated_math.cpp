// Host tests of the gated activations' math layer (the functors and the per-element functions the
// kernels call) against the double reference, the reference against finite differences, a
// user-defined activation, and the launch shape covering every element exactly once.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <tigon/activation/activations.hpp>
#include <tigon/activation/gated.cuh>

#include "../reference/gated_ref.hpp"

using namespace tigon;
using tigon_ref::GatedAct;

namespace {

// A user activation with only the two required functions: squared ReLU (Primer).
struct SquaredRelu {
  static TIGON_HD float value(float a) { return a > 0.0f ? a * a : 0.0f; }
  static TIGON_HD float derivative(float a) { return a > 0.0f ? 2.0f * a : 0.0f; }
};

static_assert(Activation<Silu> && Activation<GeluTanh> && Activation<GeluErf>);
static_assert(Activation<SquaredRelu>);
static_assert(!Activation<int>);

template <class Act>
constexpr GatedAct kind() {
  if constexpr (std::is_same_v<Act, Silu>) return GatedAct::silu;
  if constexpr (std::is_same_v<Act, GeluTanh>) return GatedAct::gelu_tanh;
  return GatedAct::gelu_erf;
}

template <class Act>
const char* name() {
  if constexpr (std::is_same_v<Act, Silu>) return "Silu";
  if constexpr (std::is_same_v<Act, GeluTanh>) return "GeluTanh";
  return "GeluErf";
}

// Points across the activations' interesting range, plus random ones.
std::vector<float> sample_points() {
  std::vector<float> xs;
  for (float x = -12.0f; x <= 12.0f; x += 0.0625f) xs.push_back(x);
  for (float x : {-80.0f, -30.0f, -1e-3f, -1e-20f, 0.0f, 1e-20f, 1e-3f, 30.0f, 80.0f}) xs.push_back(x);
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int i = 0; i < 2000; ++i) xs.push_back(nd(gen));
  return xs;
}

// fp32 error of the formulas: a few ulp of the result, plus the cancellation of 1 + tanh(u) (or
// 1 + erf) for negative x, which costs an absolute error of a few ulp of 1 times |x|.
bool close(double got, double ref, double x) {
  return std::isfinite(got) &&
         std::abs(got - ref) <= 4e-6 * std::abs(ref) + 6e-7 * std::max(1.0, std::abs(x));
}

template <class Act>
void check_functor() {
  INFO(name<Act>());
  int bad_v = 0, bad_d = 0, bad_vd = 0;
  for (float x : sample_points()) {
    const double rv = tigon_ref::act_value(kind<Act>(), x);
    const double rd = tigon_ref::act_derivative(kind<Act>(), x);
    const float v = Act::value(x), d = Act::derivative(x);
    if (!close(v, rv, x)) {
      ++bad_v;
      UNSCOPED_INFO("value(" << x << ") = " << v << ", reference " << rv);
    }
    if (!close(d, rd, x)) {
      ++bad_d;
      UNSCOPED_INFO("derivative(" << x << ") = " << d << ", reference " << rd);
    }
    float v2 = 0, d2 = 0;
    activation_value_and_derivative<Act>(x, v2, d2);
    if (!(std::abs(v2 - v) <= 1e-6f * std::abs(v)) || !(std::abs(d2 - d) <= 1e-6f * std::abs(d))) ++bad_vd;
  }
  CHECK(bad_v == 0);
  CHECK(bad_d == 0);
  CHECK(bad_vd == 0);
}

}  // namespace

TEST_CASE("gated math: activation functors match the double formulas", "[gated][math]") {
  check_functor<Silu>();
  check_functor<GeluTanh>();
  check_functor<GeluErf>();
  // Known values: silu(1) = 1 / (1 + e^-1); gelu(1) = 0.8413447 (erf), 0.8411920 (tanh).
  CHECK(Silu::value(1.0f) == Approx(0.7310585786).epsilon(1e-6));
  CHECK(GeluErf::value(1.0f) == Approx(0.8413447461).epsilon(1e-6));
  CHECK(GeluTanh::value(1.0f) == Approx(0.8411919906).epsilon(1e-6));
  CHECK(Silu::derivative(0.0f) == 0.5f);
  CHECK(GeluErf::derivative(0.0f) == 0.5f);
  CHECK(GeluTanh::derivative(0.0f) == 0.5f);
}

TEST_CASE("gated math: derivatives match finite differences", "[gated][math]") {
  // Central differences of the double reference, against the reference derivative and the fp32
  // functors.
  const double h = 1e-5;
  for (auto k : {GatedAct::silu, GatedAct::gelu_tanh, GatedAct::gelu_erf}) {
    for (double x = -8.0; x <= 8.0; x += 0.37) {
      INFO("activation " << static_cast<int>(k) << " x " << x);
      const double fd = (tigon_ref::act_value(k, x + h) - tigon_ref::act_value(k, x - h)) / (2 * h);
      CHECK(std::abs(fd - tigon_ref::act_derivative(k, x)) < 1e-8);
      const float xf = static_cast<float>(x);
      const double fdf = (tigon_ref::act_value(k, xf + h) - tigon_ref::act_value(k, xf - h)) / (2 * h);
      const float d = k == GatedAct::silu        ? Silu::derivative(xf)
                      : k == GatedAct::gelu_tanh ? GeluTanh::derivative(xf)
                                                 : GeluErf::derivative(xf);
      CHECK(std::abs(d - fdf) < 2e-6 * std::max(1.0, std::abs(x)));
    }
  }
}

TEST_CASE("gated math: special values", "[gated][math]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(Silu::value(nan)));
  CHECK(std::isnan(GeluTanh::value(nan)));
  CHECK(std::isnan(GeluErf::value(nan)));
  CHECK(std::isnan(Silu::derivative(nan)));
  CHECK(std::isnan(GeluTanh::derivative(nan)));
  CHECK(std::isnan(GeluErf::derivative(nan)));
  // Huge inputs saturate instead of producing 0 * inf.
  for (float x : {1e20f, 3e38f}) {
    INFO("x " << x);
    CHECK(Silu::value(x) == x);
    CHECK(GeluTanh::value(x) == x);
    CHECK(GeluErf::value(x) == x);
    CHECK(Silu::derivative(x) == 1.0f);
    CHECK(GeluTanh::derivative(x) == 1.0f);
    CHECK(GeluErf::derivative(x) == 1.0f);
    CHECK(Silu::value(-x) == 0.0f);
    CHECK(GeluTanh::value(-x) == 0.0f);
    CHECK(GeluErf::value(-x) == 0.0f);
    CHECK(Silu::derivative(-x) == 0.0f);
    CHECK(GeluTanh::derivative(-x) == 0.0f);
    CHECK(GeluErf::derivative(-x) == 0.0f);
  }
}

TEST_CASE("gated math: forward and backward with multipliers match the reference", "[gated][math]") {
  std::mt19937 gen(42);
  std::normal_distribution<double> nd(0.0, 1.5);
  const int n = 500;
  std::vector<double> a(n), b(n), dc(n);
  for (int i = 0; i < n; ++i) {
    a[i] = static_cast<float>(nd(gen));
    b[i] = static_cast<float>(nd(gen));
    dc[i] = static_cast<float>(nd(gen));
  }
  for (auto [gate, down] : {std::pair{1.0f, 1.0f}, std::pair{0.75f, 1.5f}, std::pair{-2.0f, 0.125f}}) {
    INFO("gate " << gate << " down " << down);
    auto run = [&](auto act, GatedAct k) {
      using Act = decltype(act);
      const auto c = tigon_ref::gated_forward(a, b, 1, n, gate, down, k);
      const auto g = tigon_ref::gated_backward(dc, a, b, 1, n, gate, down, k);
      int bad = 0;
      for (int i = 0; i < n; ++i) {
        const float af = static_cast<float>(a[i]), bf = static_cast<float>(b[i]);
        const float cf = gated_math::forward<Act>(af, bf, gate, down);
        float da = 0, db = 0;
        gated_math::backward<Act>(static_cast<float>(dc[i]), af, bf, gate, down, da, db);
        const double scale = std::abs(down) * std::max(1.0, std::abs(gate * a[i])) *
                             std::max(1.0, std::abs(b[i])) * std::max(1.0, std::abs(dc[i]));
        if (!(std::abs(cf - c[i]) <= 4e-6 * scale)) ++bad;
        if (!(std::abs(da - g.da[i]) <= 4e-6 * scale * std::max(1.0f, std::abs(gate)))) ++bad;
        if (!(std::abs(db - g.db[i]) <= 4e-6 * scale)) ++bad;
      }
      CHECK(bad == 0);
    };
    run(Silu{}, GatedAct::silu);
    run(GeluTanh{}, GatedAct::gelu_tanh);
    run(GeluErf{}, GatedAct::gelu_erf);
  }
}

TEST_CASE("gated math: the reference backward is the gradient of the reference forward", "[gated][math]") {
  // loss = sum(dc * c): d loss / d a_j and d loss / d b_j by central differences.
  std::mt19937 gen(3);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int n = 16;
  std::vector<double> a(n), b(n), dc(n);
  for (int i = 0; i < n; ++i) {
    a[i] = 2 * nd(gen);
    b[i] = nd(gen);
    dc[i] = nd(gen);
  }
  const double gate = 0.7, down = 1.3, h = 1e-6;
  for (auto k : {GatedAct::silu, GatedAct::gelu_tanh, GatedAct::gelu_erf}) {
    const auto g = tigon_ref::gated_backward(dc, a, b, 1, n, gate, down, k);
    auto loss = [&](const std::vector<double>& as, const std::vector<double>& bs) {
      const auto c = tigon_ref::gated_forward(as, bs, 1, n, gate, down, k);
      double l = 0;
      for (int i = 0; i < n; ++i) l += dc[i] * c[i];
      return l;
    };
    for (int j : {0, 5, 15}) {
      auto ap = a, am = a, bp = b, bm = b;
      ap[j] += h;
      am[j] -= h;
      bp[j] += h;
      bm[j] -= h;
      CHECK(std::abs((loss(ap, b) - loss(am, b)) / (2 * h) - g.da[j]) < 1e-6);
      CHECK(std::abs((loss(a, bp) - loss(a, bm)) / (2 * h) - g.db[j]) < 1e-6);
    }
  }
}

TEST_CASE("gated math: a user-defined activation", "[gated][math]") {
  // No value_and_derivative: the two functions are called.
  float v = 0, d = 0;
  activation_value_and_derivative<SquaredRelu>(3.0f, v, d);
  CHECK(v == 9.0f);
  CHECK(d == 6.0f);
  activation_value_and_derivative<SquaredRelu>(-3.0f, v, d);
  CHECK(v == 0.0f);
  CHECK(d == 0.0f);
  // c = 2 * relu(0.5 * 3)^2 * 4 = 18; da = dc * b * down * gate * 2 * relu(1.5) = 1 * 4 * 2 * 0.5 * 3.
  CHECK(gated_math::forward<SquaredRelu>(3.0f, 4.0f, 0.5f, 2.0f) == 18.0f);
  float da = 0, db = 0;
  gated_math::backward<SquaredRelu>(1.0f, 3.0f, 4.0f, 0.5f, 2.0f, da, db);
  CHECK(da == 12.0f);
  CHECK(db == 4.5f);
}

namespace {

// Every (row, column vector) visited exactly once by the kernels' loops, as the kernels walk them.
bool covers_once(std::int64_t rows, std::int64_t nvec, const detail::GatedShape& s, int unroll) {
  std::vector<int> seen(static_cast<std::size_t>(rows * nvec), 0);
  for (std::int64_t by = 0; by < s.gy; ++by)
    for (std::int64_t bx = 0; bx < s.gx; ++bx)
      for (int ty = 0; ty < s.by; ++ty)
        for (int tx = 0; tx < s.bx; ++tx) {
          const std::int64_t step = static_cast<std::int64_t>(s.bx) * s.gx;
          for (std::int64_t row = by * s.by + ty; row < rows; row += static_cast<std::int64_t>(s.by) * s.gy)
            for (std::int64_t i0 = bx * s.bx + tx; i0 < nvec; i0 += unroll * step)
              for (int u = 0; u < unroll; ++u) {
                const std::int64_t i = i0 + u * step;
                if (i < nvec) ++seen[static_cast<std::size_t>(row * nvec + i)];
              }
        }
  for (int v : seen)
    if (v != 1) return false;
  return true;
}

}  // namespace

TEST_CASE("gated launch shape: every element once, limits, balance", "[gated][shape]") {
  const std::int64_t targets[] = {1, 7, 132 * 4};
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {1, 1}, {1, 123}, {7, 1}, {5, 3}, {37, 513}, {64, 125}, {3, 1792}, {2, 3584}, {300, 16}, {1, 5000}};
  for (const bool persistent : {true, false}) {
    for (const int unroll : {1, 2, 4}) {
      for (const auto target : targets) {
        for (const auto& [rows, nvec] : shapes) {
          const auto s = detail::gated_shape(rows, nvec, target, unroll, persistent);
          INFO(rows << " rows x " << nvec << " vectors, target " << target << ", unroll " << unroll
                    << (persistent ? ", persistent" : "") << ": block " << s.bx << "x" << s.by
                    << ", grid " << s.gx << "x" << s.gy);
          CHECK(s.bx * s.by == detail::kGatedThreads);
          CHECK(is_pow2(s.bx));
          CHECK(s.gx >= 1);
          CHECK(s.gy >= 1);
          CHECK(s.gy <= detail::kGatedMaxGridY);
          CHECK(covers_once(rows, nvec, s, unroll));
        }
      }
    }
  }
  constexpr int kU = 1;                       // the row-grid kernels' vectors per loop trip
  STATIC_REQUIRE(GatedPolicy::kFlat == 2);     // dense tensors: the flat grid
  // SwiGLU at 16384 x 14336 bf16 (1792 vectors a row) on an H200-sized device (132 SMs x 4
  // blocks): one column slice, 256 threads of 7 vectors each per row, every row block walking
  // exactly 32 rows.
  const auto s = detail::gated_shape(16384, 14336 / 8, 132 * 4, kU);
  CHECK(s.bx == 256);
  CHECK(s.by == 1);
  CHECK(s.gx == 1);
  CHECK(s.gy == 512);
  CHECK(16384 % (s.gy * s.by) == 0);
  // One row of 28672 bf16: split into column slices instead of leaving the device idle.
  const auto one = detail::gated_shape(1, 28672 / 8, 132 * 4, kU);
  CHECK(one.gx == ceil_div(3584, 256 * kU));
  CHECK(one.gy == 1);
  // Non-persistent: one block per row.
  const auto np = detail::gated_shape(16384, 14336 / 8, 132 * 4, kU, false);
  CHECK(np.gy == 16384);
  CHECK(np.gx == ceil_div(1792, 256 * kU));
  // Short rows: several rows per block. Many rows: the grid never exceeds its limits.
  const auto big = detail::gated_shape(std::int64_t{1} << 40, 8, 132 * 4, kU);
  CHECK(big.gy <= detail::kGatedMaxGridY);
  CHECK(big.bx * kU >= 8);
  CHECK(big.by == detail::kGatedThreads / big.bx);
}

TEST_CASE("gated math: the squared ReLU and the ungated activation", "[gated][math]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(ReluSquared::value(3.0f) == 9.0f);
  CHECK(ReluSquared::derivative(3.0f) == 6.0f);
  CHECK(ReluSquared::value(-3.0f) == 0.0f);
  CHECK(ReluSquared::derivative(-3.0f) == 0.0f);
  CHECK(ReluSquared::value(0.0f) == 0.0f);
  CHECK(ReluSquared::derivative(0.0f) == 0.0f);
  CHECK(ReluSquared::value(-0.0f) == 0.0f);
  CHECK(!std::signbit(ReluSquared::value(-0.0f)));
  // As PyTorch's relu then square: a NaN propagates forward and backward (relu's backward passes
  // the gradient where its output is not <= 0); a dead unit passes nothing, even an infinite dc.
  CHECK(std::isnan(ReluSquared::value(nan)));
  CHECK(std::isnan(gated_math::activation_backward<ReluSquared>(1.0f, nan)));
  CHECK(gated_math::activation_backward<ReluSquared>(INFINITY, -1.0f) == 0.0f);
  CHECK(gated_math::activation_backward<ReluSquared>(INFINITY, 0.0f) == 0.0f);
  CHECK(gated_math::activation_backward<ReluSquared>(-INFINITY, 2.0f) == -INFINITY);
  CHECK(std::isinf(ReluSquared::value(3e38f)));
  float v = 0, d = 0;
  activation_value_and_derivative<ReluSquared>(1.5f, v, d);
  CHECK(v == 2.25f);
  CHECK(d == 3.0f);
  // Finite differences away from the kink.
  for (double x = -4.0; x <= 4.0; x += 0.37) {
    if (std::abs(x) < 1e-3) continue;
    const float xf = static_cast<float>(x);
    const double h = 1e-3;
    auto f = [](double t) { return t > 0 ? t * t : 0.0; };
    CHECK(std::abs(ReluSquared::derivative(xf) - (f(xf + h) - f(xf - h)) / (2 * h)) < 1e-5);
  }
  // The ungated op's math: c = act(a), da = dc * act'(a); in bfloat16 each rounds once, the value
  // relu then square gives in bfloat16 (relu exact, the square rounded once).
  CHECK(gated_math::activation_forward<ReluSquared>(-2.0f) == 0.0f);
  CHECK(gated_math::activation_forward<ReluSquared>(2.0f) == 4.0f);
  CHECK(gated_math::activation_backward<ReluSquared>(0.5f, 3.0f) == 3.0f);
  CHECK(gated_math::activation_backward<Silu>(2.0f, 1.0f) == 2.0f * Silu::derivative(1.0f));
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  int mismatches = 0;
  for (int i = 0; i < 10000; ++i) {
    const float a = round_to<bf16>(dist(gen)), dc = round_to<bf16>(dist(gen));
    const float r = a > 0.0f ? a : 0.0f;
    mismatches += round_to<bf16>(gated_math::activation_forward<ReluSquared>(a)) != round_to<bf16>(r * r);
    // autograd: square's backward dc * (2 r) (2 r exact), rounded once; relu's passes it where r > 0
    mismatches += round_to<bf16>(gated_math::activation_backward<ReluSquared>(dc, a)) != round_to<bf16>(dc * (2.0f * r));
  }
  CHECK(mismatches == 0);
}
