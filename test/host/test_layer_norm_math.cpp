// Host tests of LayerNorm's math layer (the same functions the kernels call) against the double
// reference, of the reference itself (finite differences), and of the compiled launch shapes.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include <tigon/norm/layer_norm.cuh>

#include "../reference/layer_norm_ref.hpp"
#include "../reference/rms_norm_ref.hpp"

using namespace tigon;

namespace {

// One row through the math layer exactly as a kernel does it: fp32 sums, two passes (mean, then
// the centred sum of squares), one rounding of y to T.
template <class T>
std::vector<float> forward_row(const std::vector<float>& x, const std::vector<float>& w,
                               const std::vector<float>& b, float eps, float& mean_out,
                               float& rstd_out) {
  const auto cols = static_cast<std::int64_t>(x.size());
  float s = 0;
  for (float v : x) s += v;
  const float mean = layer_norm_math::mean(s, cols);
  float sq = 0;
  for (float v : x) sq += (v - mean) * (v - mean);
  const float rstd = layer_norm_math::rstd(sq, cols, eps);
  mean_out = mean;
  rstd_out = rstd;
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    y[i] = round_to<T>(layer_norm_math::forward(x[i], mean, rstd, w.empty() ? 1.0f : w[i],
                                                b.empty() ? 0.0f : b[i]));
  }
  return y;
}

template <class T>
void check_forward(bool weight, bool bias, float x_mean, double tol) {
  std::mt19937 gen(4321);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const int cols = 257;
  std::vector<float> x(cols), w(weight ? cols : 0), b(bias ? cols : 0);
  for (auto& v : x) v = round_to<T>(x_mean + nd(gen));
  for (auto& v : w) v = round_to<T>(1.0f + 0.2f * nd(gen));
  for (auto& v : b) v = round_to<T>(0.5f * nd(gen));
  float mean = 0, rstd = 0;
  const auto y = forward_row<T>(x, w, b, 1e-5f, mean, rstd);
  const std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end());
  const auto ref = tigon_ref::layer_norm_forward(xd, wd, bd, 1, cols, 1e-5);
  CHECK(std::abs(mean - ref.mean[0]) <= 1e-6 * (std::abs(ref.mean[0]) + 1.0));
  CHECK(std::abs(rstd - ref.rstd[0]) <= 1e-5 * ref.rstd[0]);
  int bad = 0;
  for (int i = 0; i < cols; ++i) {
    const double r = tigon_ref::round_t<T>(ref.y[i]);
    if (!(std::abs(y[i] - r) <= tol * (std::abs(r) + 1.0))) ++bad;  // y is O(1): errors scale with the row
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("layer_norm math: forward matches the double reference", "[layer_norm][math]") {
  for (float x_mean : {0.0f, 3.0f}) {  // a mean away from 0 exercises the centring
    INFO("x mean " << x_mean);
    for (bool w : {true, false}) {
      for (bool b : {true, false}) {
        INFO("weight " << w << " bias " << b);
        check_forward<float>(w, b, x_mean, 1e-5);
        check_forward<bf16>(w, b, x_mean, 0x1p-7);
        check_forward<half>(w, b, x_mean, 0x1p-10);
      }
    }
  }
}

TEST_CASE("layer_norm math: biased variance, eps inside the root", "[layer_norm][math]") {
  // x = (1, 3): mean 2, biased variance 1 (the unbiased one would be 2).
  const float mean = layer_norm_math::mean(4.0f, 2);
  CHECK(mean == 2.0f);
  const float sq = (1.0f - mean) * (1.0f - mean) + (3.0f - mean) * (3.0f - mean);
  CHECK(layer_norm_math::rstd(sq, 2, 0.0f) == 1.0f);
  CHECK(std::abs(layer_norm_math::rstd(sq, 2, 0.25f) - 1.0f / std::sqrt(1.25f)) < 1e-7f);
  CHECK(layer_norm_math::forward(3.0f, 2.0f, 1.0f, 2.0f, 0.5f) == 2.5f);  // xhat 1, * 2, + 0.5
}

TEST_CASE("layer_norm math: backward formula matches the double reference", "[layer_norm][math]") {
  std::mt19937 gen(77);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int cols = 64;
  std::vector<double> x(cols), dy(cols), w(cols), b(cols);
  for (int i = 0; i < cols; ++i) {
    x[i] = 0.5 + nd(gen);
    dy[i] = nd(gen);
    w[i] = 1.0 + 0.1 * nd(gen);
    b[i] = 0.1 * nd(gen);
  }
  const double eps = 1e-5;
  const auto ref = tigon_ref::layer_norm_backward(dy, x, w, 1, cols, eps);
  // The math layer as the kernels use it: fp32 sums of g and g * (x - mean), then dx per element.
  float s = 0;
  for (int i = 0; i < cols; ++i) s += static_cast<float>(x[i]);
  const float mean = layer_norm_math::mean(s, cols);
  float sq = 0;
  for (int i = 0; i < cols; ++i) sq += (static_cast<float>(x[i]) - mean) * (static_cast<float>(x[i]) - mean);
  const float rstd = layer_norm_math::rstd(sq, cols, static_cast<float>(eps));
  float sum_g = 0, sum_gx = 0;
  for (int i = 0; i < cols; ++i) {
    const float g = static_cast<float>(dy[i] * w[i]);
    sum_g += g;
    sum_gx += g * (static_cast<float>(x[i]) - mean);
  }
  const float mean_g = sum_g / cols, mean_g_xhat = rstd * sum_gx / cols;
  for (int i = 0; i < cols; ++i) {
    const float xhat = (static_cast<float>(x[i]) - mean) * rstd;
    const float dx = layer_norm_math::dx(static_cast<float>(dy[i] * w[i]), xhat, rstd, mean_g, mean_g_xhat);
    CHECK(std::abs(dx - ref.dx[i]) <= 1e-5 * (std::abs(ref.dx[i]) + 1.0));
    const float dw = layer_norm_math::dweight_term(static_cast<float>(dy[i]), xhat);
    CHECK(std::abs(dw - ref.dw[i]) <= 1e-5 * (std::abs(ref.dw[i]) + 1.0));
    CHECK(ref.db[i] == dy[i]);
  }
  // Finite differences of the reference itself: d/dx_j, d/dw_j, d/db_j of sum(dy * y).
  auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws, const std::vector<double>& bs) {
    const auto f = tigon_ref::layer_norm_forward(xs, ws, bs, 1, cols, eps);
    double l = 0;
    for (int i = 0; i < cols; ++i) l += dy[i] * f.y[i];
    return l;
  };
  const double h = 1e-6;
  for (int j : {0, 31, 63}) {
    auto xp = x, xm = x;
    xp[j] += h;
    xm[j] -= h;
    CHECK(std::abs((loss(xp, w, b) - loss(xm, w, b)) / (2 * h) - ref.dx[j]) < 1e-6);
    auto wp = w, wm = w;
    wp[j] += h;
    wm[j] -= h;
    CHECK(std::abs((loss(x, wp, b) - loss(x, wm, b)) / (2 * h) - ref.dw[j]) < 1e-6);
    auto bp = b, bm = b;
    bp[j] += h;
    bm[j] -= h;
    CHECK(std::abs((loss(x, w, bp) - loss(x, w, bm)) / (2 * h) - ref.db[j]) < 1e-6);
  }
  // Without a weight g = dy.
  const auto nw = tigon_ref::layer_norm_backward(dy, x, {}, 1, cols, eps);
  for (int j : {3, 40}) {
    auto xp = x, xm = x;
    xp[j] += h;
    xm[j] -= h;
    CHECK(std::abs((loss(xp, {}, {}) - loss(xm, {}, {})) / (2 * h) - nw.dx[j]) < 1e-6);
  }
}

// A derived policy: more stages than fit at 8192 fp32 with 1024-thread backward blocks.
struct Deep : LayerNormPolicy {
  static constexpr int kBwdBlockThreads = 1024;
  static constexpr int kBwdStages = 8;
};

TEST_CASE("layer_norm shapes: compiled row layouts and the workspace", "[layer_norm][shape]") {
  using P = LayerNormPolicy;
  STATIC_REQUIRE(std::is_same_v<LayerNormDefaultPolicy, LayerNormPolicy>);
  STATIC_REQUIRE(detail::check_policy<P>());
  using F4096 = detail::FwdRowShape<bf16, 4096, P>;
  STATIC_REQUIRE(F4096::kVec == 8);
  STATIC_REQUIRE(F4096::kGroupThreads == 128);
  STATIC_REQUIRE(F4096::kExact);
  using B8192 = detail::BwdRowShape<bf16, 8192, P>;
  STATIC_REQUIRE(B8192::kThreads <= 1024);
  STATIC_REQUIRE(B8192::kGroupThreads * B8192::kVecPerThread * B8192::kVec == 8192);
  // The backward stages x and dy: 2 row buffers per stage per group, within the 227 KB limit.
  using Pipe = detail::BwdRowPipe<float, 8192, P, 2>;
  STATIC_REQUIRE(Pipe::kSmemBytes <= detail::kMaxSmemPerBlock);
  STATIC_REQUIRE(Pipe::kPerStage == detail::BwdRowShape<float, 8192, P>::kGroups * 2 * 8192 * 4);
  STATIC_REQUIRE(Pipe::kStages == P::kBwdStages);
  // A derived policy asking for more stages than fit is lowered, never over the limit.
  STATIC_REQUIRE(detail::check_policy<Deep>());
  STATIC_REQUIRE(Deep::kFwdVecPerThread == P::kFwdVecPerThread);  // the rest inherited
  STATIC_REQUIRE(detail::BwdRowPipe<float, 8192, Deep, 2>::kSmemBytes <= detail::kMaxSmemPerBlock);
  STATIC_REQUIRE(detail::BwdRowPipe<float, 8192, Deep, 2>::kStages < 8);
  // Every default hidden size in every dtype gives a valid shape covering the row.
  auto covers = []<class T, int... Ns>(IntList<Ns...>) {
    return ((detail::BwdRowShape<T, Ns, P>::kGroupThreads * detail::BwdRowShape<T, Ns, P>::kVecPerThread *
                 detail::BwdRowShape<T, Ns, P>::kVec >= Ns) && ...);
  };
  CHECK(covers.template operator()<bf16>(HiddenSizes{}));
  CHECK(covers.template operator()<float>(HiddenSizes{}));
  // Workspace: one fp32 partial row per row group per requested gradient, 256-byte aligned.
  CHECK(detail::partial_rows_bytes(264 * 2, 4096) == 2u * 264u * 4096u * 4u);
  CHECK(detail::partial_rows_bytes(3 * 2, 5) % 256 == 0);
  CHECK(detail::partial_rows_bytes(3 * 2, 5) >= 2u * 3u * 5u * 4u);
}
