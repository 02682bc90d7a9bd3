// Host tests of RMSNorm's math layer (the same functions the kernels call) against the double
// reference, and of the compiled launch shapes.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include <tigon/norm/rms_norm.cuh>

#include "../reference/rms_norm_ref.hpp"

using namespace tigon;

namespace {

// One row through the math layer exactly as a kernel does it (fp32, the mode's roundings).
template <class T>
std::vector<float> forward_row(const std::vector<float>& x, const std::vector<float>& w, float eps,
                               float offset, RmsNormCasting c, float& rstd_out) {
  float ss = 0;
  for (float v : x) ss += v * v;
  const float rstd = rms_norm_math::rstd(ss, static_cast<std::int64_t>(x.size()), eps);
  rstd_out = rstd;
  const float r = rms_norm_math::effective_rstd<T>(rstd, c);
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float s = rms_norm_math::scale<T>(w.empty() ? 0.0f : w[i], !w.empty(), offset, c);
    y[i] = round_to<T>(rms_norm_math::forward<T>(x[i], r, s, c));
  }
  return y;
}

template <class T>
void check_forward(RmsNormCasting c, bool weight, float offset, double tol) {
  std::mt19937 gen(1234);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const int cols = 257;
  std::vector<float> x(cols), w(weight ? cols : 0);
  for (auto& v : x) v = round_to<T>(nd(gen));
  for (auto& v : w) v = round_to<T>(1.0f + 0.2f * nd(gen));
  float rstd = 0;
  const auto y = forward_row<T>(x, w, 1e-6f, offset, c, rstd);
  const std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
  const auto ref = tigon_ref::rms_norm_forward<T>(xd, wd, 1, cols, 1e-6, offset, c);
  CHECK(std::abs(rstd - ref.rstd[0]) <= 1e-6 * ref.rstd[0]);
  int bad = 0;
  for (int i = 0; i < cols; ++i) {
    const double r = tigon_ref::round_t<T>(ref.y[i]);
    if (!(std::abs(y[i] - r) <= tol * (std::abs(r) + 1e-3))) ++bad;
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("rms_norm math: forward matches the double reference in every mode", "[rms_norm][math]") {
  for (auto c : {RmsNormCasting::llama, RmsNormCasting::gemma, RmsNormCasting::none}) {
    INFO("casting " << casting_name(c));
    check_forward<float>(c, true, 0.0f, 1e-5);
    check_forward<float>(c, false, 0.0f, 1e-5);
    check_forward<bf16>(c, true, 0.0f, 0x1p-7);
    check_forward<bf16>(c, true, 1.0f, 0x1p-7);
    check_forward<half>(c, true, 0.0f, 0x1p-10);
  }
}

TEST_CASE("rms_norm math: casting modes round where Hugging Face rounds", "[rms_norm][math]") {
  // x * rstd = 1 + 2^-8 + 2^-10 (not representable in bf16), w = 3.
  const float n = 1.0f + 0x1p-8f + 0x1p-10f;
  const float llama = rms_norm_math::forward<bf16>(n, 1.0f, 3.0f, RmsNormCasting::llama);
  const float gemma = rms_norm_math::forward<bf16>(n, 1.0f, 3.0f, RmsNormCasting::gemma);
  CHECK(llama == round_to<bf16>(n) * 3.0f);  // normalised x rounded first
  CHECK(gemma == n * 3.0f);                   // one rounding, at the end (by the caller)
  CHECK(rms_norm_math::scale<bf16>(0x1p-9f, true, 1.0f, RmsNormCasting::none) == 1.0f);
  CHECK(rms_norm_math::scale<bf16>(0x1p-9f, true, 1.0f, RmsNormCasting::gemma) == 1.0f + 0x1p-9f);
  CHECK(rms_norm_math::scale<bf16>(5.0f, false, 1.0f, RmsNormCasting::gemma) == 1.0f);
}

TEST_CASE("rms_norm math: backward formula matches the double reference", "[rms_norm][math]") {
  std::mt19937 gen(99);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int cols = 64;
  std::vector<double> x(cols), dy(cols), w(cols);
  for (int i = 0; i < cols; ++i) {
    x[i] = nd(gen);
    dy[i] = nd(gen);
    w[i] = 1.0 + 0.1 * nd(gen);
  }
  const auto ref = tigon_ref::rms_norm_backward<float>(dy, x, w, 1, cols, 1e-6, 0.0,
                                                       RmsNormCasting::gemma);
  float ss = 0, dot = 0;
  for (int i = 0; i < cols; ++i) ss += static_cast<float>(x[i] * x[i]);
  const float rstd = rms_norm_math::rstd(ss, cols, 1e-6f);
  for (int i = 0; i < cols; ++i) dot += static_cast<float>(dy[i] * w[i] * x[i]) * rstd;
  const float mean = dot / cols;
  for (int i = 0; i < cols; ++i) {
    const float xhat = static_cast<float>(x[i]) * rstd;
    const float dx = rms_norm_math::dx(static_cast<float>(dy[i] * w[i]), xhat, rstd, mean);
    CHECK(std::abs(dx - ref.dx[i]) <= 1e-5 * (std::abs(ref.dx[i]) + 1.0));
    const float dw = rms_norm_math::dweight_term<float>(static_cast<float>(dy[i]), xhat,
                                                        RmsNormCasting::gemma);
    CHECK(std::abs(dw - ref.dw[i]) <= 1e-5 * (std::abs(ref.dw[i]) + 1.0));
  }
  // A finite-difference check of the reference itself: d/dx_j of sum(dy * y).
  const double h = 1e-6;
  for (int j : {0, 17, 63}) {
    auto loss = [&](const std::vector<double>& xs) {
      const auto f = tigon_ref::rms_norm_forward<float>(xs, w, 1, cols, 1e-6, 0.0,
                                                        RmsNormCasting::gemma);
      double l = 0;
      for (int i = 0; i < cols; ++i) l += dy[i] * f.y[i];
      return l;
    };
    auto xp = x, xm = x;
    xp[j] += h;
    xm[j] -= h;
    CHECK(std::abs((loss(xp) - loss(xm)) / (2 * h) - ref.dx[j]) < 1e-6);
  }
}

TEST_CASE("rms_norm shapes: compiled row layouts cover the row exactly once", "[rms_norm][shape]") {
  using P = RmsNormPolicy;
  using S4096 = detail::FwdRowShape<bf16, 4096, P>;
  STATIC_REQUIRE(S4096::kVec == 8);
  STATIC_REQUIRE(S4096::kGroupThreads == 128);
  STATIC_REQUIRE(S4096::kVecPerThread == 4);
  STATIC_REQUIRE(S4096::kExact);
  using S2560 = detail::FwdRowShape<bf16, 2560, P>;  // 320 vectors over 96 threads: last partial
  STATIC_REQUIRE(S2560::kGroupThreads * S2560::kVecPerThread >= S2560::kNumVec);
  STATIC_REQUIRE(!S2560::kExact);
  using S123 = detail::FwdRowShape<float, 123, P>;  // odd: scalar accesses
  STATIC_REQUIRE(S123::kVec == 1);
  STATIC_REQUIRE(S123::kGroupThreads * S123::kVecPerThread >= 123);
  using B1024 = detail::BwdRowShape<half, 1024, P>;
  STATIC_REQUIRE(B1024::kThreads <= 1024);
  STATIC_REQUIRE(B1024::kGroupThreads % 32 == 0);
  // The backward stages x and dy within the shared-memory limit.
  STATIC_REQUIRE(detail::BwdRowPipe<float, 8192, P, 2>::kSmemBytes <= detail::kMaxSmemPerBlock);
  // Every default hidden size in every dtype gives a valid shape.
  auto covers = []<class T, int... Ns>(IntList<Ns...>) {
    return ((detail::FwdRowShape<T, Ns, P>::kGroupThreads * detail::FwdRowShape<T, Ns, P>::kVecPerThread *
                 detail::FwdRowShape<T, Ns, P>::kVec >= Ns) && ...);
  };
  CHECK(covers.template operator()<bf16>(HiddenSizes{}));
  CHECK(covers.template operator()<float>(HiddenSizes{}));
  // Workspace: one fp32 partial dW row per row group, 256-byte aligned.
  CHECK(detail::partial_rows_bytes(264, 4096) == 264u * 4096u * 4u);
  CHECK(detail::partial_rows_bytes(3, 5) % 256 == 0);
}

// A policy is a struct derived from RmsNormPolicy that overrides some members.
struct Narrow : RmsNormPolicy {
  static constexpr int kFwdVecPerThread = 2;
};

TEST_CASE("rms_norm policy: a derived policy overrides one member and inherits the rest",
          "[rms_norm][shape]") {
  STATIC_REQUIRE(std::is_same_v<RmsNormDefaultPolicy, RmsNormPolicy>);
  STATIC_REQUIRE(detail::check_policy<RmsNormPolicy>());
  STATIC_REQUIRE(detail::check_policy<Narrow>());
  STATIC_REQUIRE(Narrow::kFwdVecPerThread == 2);
  STATIC_REQUIRE(Narrow::kFwdBlockThreads == RmsNormPolicy::kFwdBlockThreads);
  STATIC_REQUIRE(Narrow::kBwdStages == RmsNormPolicy::kBwdStages);
  // At 4096 bf16: 512 vectors over 256 threads, one row group per 256-thread block.
  STATIC_REQUIRE(detail::FwdRowShape<bf16, 4096, Narrow>::kGroupThreads == 256);
  STATIC_REQUIRE(detail::FwdRowShape<bf16, 4096, Narrow>::kGroups == 1);
  STATIC_REQUIRE(std::is_same_v<detail::BwdRowShape<bf16, 4096, Narrow>,
                                detail::BwdRowShape<bf16, 4096, RmsNormPolicy>>);
}
