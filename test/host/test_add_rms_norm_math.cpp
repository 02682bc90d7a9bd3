// Host tests of the fused residual add + RMSNorm's math layer (add_rms_norm_math plus the
// rms_norm_math functions the kernels call) against the double reference, of the reference itself
// (finite differences), and of the compiled launch shapes.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include <tigon/norm/add_rms_norm.cuh>

#include "../reference/add_rms_norm_ref.hpp"

using namespace tigon;

TEST_CASE("add_rms_norm math: the sum is rounded to T once, as the framework's add", "[add_rms_norm][math]") {
  // bfloat16 keeps 8 significant bits: at 1 its spacing is 2^-7.
  CHECK(to_float(add_rms_norm_math::sum<bf16>(1.0f, 0x1p-9f)) == 1.0f);             // 1/4 ulp: down
  CHECK(to_float(add_rms_norm_math::sum<bf16>(1.0f, 3 * 0x1p-9f)) == 1.0f + 0x1p-7f);  // 3/4 ulp: up
  CHECK(to_float(add_rms_norm_math::sum<bf16>(1.0f, 0x1p-8f)) == 1.0f);             // tie: to even
  CHECK(to_float(add_rms_norm_math::sum<bf16>(1.0f + 0x1p-7f, 0x1p-8f)) == 1.0f + 0x1p-6f);  // tie: to even
  // half: spacing 2^-10 at 1.
  CHECK(to_float(add_rms_norm_math::sum<half>(1.0f, 0x1p-12f)) == 1.0f);
  CHECK(to_float(add_rms_norm_math::sum<half>(1.0f, 3 * 0x1p-12f)) == 1.0f + 0x1p-10f);
  // float: the fp32 add.
  CHECK(add_rms_norm_math::sum<float>(1.0f, 0x1p-30f) == 1.0f + 0x1p-30f);
  CHECK(add_rms_norm_math::sum<float>(0.1f, 0.2f) == 0.1f + 0.2f);
  // The reference rounds the same way.
  CHECK(tigon_ref::round_t<bf16>(1.0 + 3 * 0x1p-9) == 1.0 + 0x1p-7);
  CHECK(add_rms_norm_math::dsum_total(0.25f, 0.5f) == 0.75f);
}

namespace {

template <class T>
void check_forward(RmsNormCasting mode, bool weight, float offset, double tol) {
  std::mt19937 gen(2024);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int cols = 300;
  std::vector<float> x(cols), res(cols), w(weight ? cols : 0);
  for (auto& v : x) v = round_to<T>(nd(gen));
  for (auto& v : res) v = round_to<T>(2.0f * nd(gen));
  for (auto& v : w) v = round_to<T>(1.0f + 0.2f * nd(gen));
  // Through the math layers as the kernels do it.
  std::vector<float> s(cols);
  float ss = 0;
  for (int i = 0; i < cols; ++i) {
    s[i] = to_float(add_rms_norm_math::sum<T>(x[i], res[i]));
    ss += s[i] * s[i];
  }
  const float rstd = rms_norm_math::rstd(ss, cols, 1e-6f);
  const float r = rms_norm_math::effective_rstd<T>(rstd, mode);
  const std::vector<double> xd(x.begin(), x.end()), rd(res.begin(), res.end()), wd(w.begin(), w.end());
  const auto ref = tigon_ref::add_rms_norm_forward<T>(xd, rd, wd, 1, cols, 1e-6, offset, mode);
  CHECK(std::abs(rstd - ref.norm.rstd[0]) <= 1e-6 * ref.norm.rstd[0]);
  int bad_sum = 0, bad_y = 0;
  for (int i = 0; i < cols; ++i) {
    if (static_cast<double>(s[i]) != ref.sum[i]) ++bad_sum;  // the sum is exact: bitwise
    const float sc = rms_norm_math::scale<T>(weight ? w[i] : 0.0f, weight, offset, mode);
    const float y = round_to<T>(rms_norm_math::forward<T>(s[i], r, sc, mode));
    const double yr = tigon_ref::round_t<T>(ref.norm.y[i]);
    if (!(std::abs(y - yr) <= tol * (std::abs(yr) + 1e-3))) ++bad_y;
  }
  CHECK(bad_sum == 0);
  CHECK(bad_y == 0);
}

}  // namespace

TEST_CASE("add_rms_norm math: forward matches the double reference in every mode", "[add_rms_norm][math]") {
  for (auto c : {RmsNormCasting::llama, RmsNormCasting::gemma, RmsNormCasting::none}) {
    INFO("casting " << casting_name(c));
    check_forward<float>(c, true, 0.0f, 1e-5);
    check_forward<float>(c, false, 0.0f, 1e-5);
    check_forward<bf16>(c, true, 0.0f, 0x1p-7);
    check_forward<bf16>(c, true, 1.0f, 0x1p-7);
    check_forward<half>(c, true, 0.0f, 0x1p-10);
  }
}

TEST_CASE("add_rms_norm math: backward is dsum plus RMSNorm's dx, checked by finite differences", "[add_rms_norm][math]") {
  std::mt19937 gen(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int cols = 48;
  std::vector<double> x(cols), res(cols), dy(cols), dsum(cols), w(cols);
  for (int i = 0; i < cols; ++i) {
    x[i] = nd(gen);
    res[i] = nd(gen);
    dy[i] = nd(gen);
    dsum[i] = nd(gen);
    w[i] = 1.0 + 0.1 * nd(gen);
  }
  const double eps = 1e-6, offset = 0.5;
  const auto mode = RmsNormCasting::gemma;  // no intermediate rounding: differentiable exactly
  std::vector<double> s(cols);
  for (int i = 0; i < cols; ++i) s[i] = x[i] + res[i];
  const auto ref = tigon_ref::add_rms_norm_backward<float>(dy, dsum, s, w, 1, cols, eps, offset, mode);
  const auto no_dsum = tigon_ref::add_rms_norm_backward<float>(dy, {}, s, w, 1, cols, eps, offset, mode);
  // L(x, residual) = sum(dy * y(s)) + sum(dsum * s) with s = x + residual: dL/dx = dL/dresidual.
  auto loss = [&](const std::vector<double>& xs, const std::vector<double>& rs) {
    std::vector<double> ss(cols);
    for (int i = 0; i < cols; ++i) ss[i] = xs[i] + rs[i];
    const auto f = tigon_ref::rms_norm_forward<float>(ss, w, 1, cols, eps, offset, mode);
    double l = 0;
    for (int i = 0; i < cols; ++i) l += dy[i] * f.y[i] + dsum[i] * ss[i];
    return l;
  };
  const double h = 1e-6;
  for (int j : {0, 20, 47}) {
    auto xp = x, xm = x, rp = res, rm = res;
    xp[j] += h;
    xm[j] -= h;
    rp[j] += h;
    rm[j] -= h;
    CHECK(std::abs((loss(xp, res) - loss(xm, res)) / (2 * h) - ref.dx[j]) < 1e-6);
    CHECK(std::abs((loss(x, rp) - loss(x, rm)) / (2 * h) - ref.dx[j]) < 1e-6);
    CHECK(std::abs(ref.dx[j] - no_dsum.dx[j] - dsum[j]) < 1e-12);
  }
  // The math layer as the kernels use it: the norm's dx plus dsum, in fp32.
  float ss = 0, dot = 0;
  for (int i = 0; i < cols; ++i) ss += static_cast<float>(s[i] * s[i]);
  const float rstd = rms_norm_math::rstd(ss, cols, static_cast<float>(eps));
  for (int i = 0; i < cols; ++i) dot += static_cast<float>(dy[i] * (offset + w[i])) * static_cast<float>(s[i]);
  const float mean_dot = rstd * dot / cols;
  for (int i = 0; i < cols; ++i) {
    const float shat = static_cast<float>(s[i]) * rstd;
    const float dn = static_cast<float>(dy[i] * (offset + w[i]));
    const float d = add_rms_norm_math::dsum_total(static_cast<float>(dsum[i]),
                                                  rms_norm_math::dx(dn, shat, rstd, mean_dot));
    CHECK(std::abs(d - ref.dx[i]) <= 1e-5 * (std::abs(ref.dx[i]) + 1.0));
    CHECK(ref.dw[i] == no_dsum.dw[i]);  // dW does not see dsum
  }
}

TEST_CASE("add_rms_norm shapes: the staged inputs fit", "[add_rms_norm][shape]") {
  using P = RmsNormPolicy;
  // The backward stages s, dy and dsum (the forward stages nothing: its rows go to registers).
  using B = detail::BwdRowPipe<float, 8192, P, 3>;
  STATIC_REQUIRE(B::kPerStage == detail::BwdRowShape<float, 8192, P>::kGroups * 3 * 8192 * 4);
  STATIC_REQUIRE(B::kSmemBytes <= detail::kMaxSmemPerBlock);
  STATIC_REQUIRE(B::kStages >= 1);
  // Every default hidden size in every dtype has a pipeline within the limit.
  auto fits = []<class T, int... Ns>(IntList<Ns...>) {
    return ((detail::BwdRowPipe<T, Ns, P, 3>::kSmemBytes <= detail::kMaxSmemPerBlock) && ...);
  };
  CHECK(fits.template operator()<bf16>(HiddenSizes{}));
  CHECK(fits.template operator()<float>(HiddenSizes{}));
}
