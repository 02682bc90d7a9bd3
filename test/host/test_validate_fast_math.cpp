// tigon's scalar argument checks compiled with -ffast-math (test/CMakeLists.txt sets it for this
// file): the compiler may assume no NaN or infinity, so a check written as !(v >= 0) or v - v == 0
// folds away; the checks test the bits and must still reject NaN and infinities.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>

#include <tigon/core/validate.hpp>
#include <tigon/loss/divergence.cuh>
#include <tigon/optim/adamw.cuh>

namespace {
float from_bits(std::uint32_t u) {  // NaN and infinity made from bits the compiler cannot see through
  volatile std::uint32_t v = u;
  const std::uint32_t w = v;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
}  // namespace

TEST_CASE("scalar checks hold under -ffast-math", "[validate][fast-math]") {
#if !defined(__FAST_MATH__)
  WARN("this file is meant to be compiled with -ffast-math");
#endif
  using namespace tigon::check;
  const float nan = from_bits(0x7fc00000u), neg_nan = from_bits(0xffc00001u);
  const float inf = from_bits(0x7f800000u), neg_inf = from_bits(0xff800000u);
  for (float bad : {nan, neg_nan, inf, neg_inf}) {
    CHECK_FALSE(finite_bits(bad));
    CHECK_FALSE(finite(bad, "op", "eps").ok());
    CHECK_FALSE(finite_in(bad, 0.0f));
    CHECK_FALSE(finite_in(bad, 0.0f, 1.0f));
    CHECK_FALSE(finite_in(bad, 0.0f, __builtin_huge_valf(), true));
  }
  CHECK(finite_in(0.0f, 0.0f));
  CHECK_FALSE(finite_in(0.0f, 0.0f, __builtin_huge_valf(), true));
  CHECK(finite_in(1.0f, 0.0f, 1.0f));
  CHECK_FALSE(finite_in(from_bits(0x3f800001u), 0.0f, 1.0f));  // the float after 1
  CHECK_FALSE(finite_in(-from_bits(0x00000001u), 0.0f));       // the negative subnormal nearest 0
  CHECK(finite_bits(from_bits(0x7f7fffffu)));                   // the largest finite float
  CHECK(finite(-3.5f, "op", "grad_scale").ok());
}

TEST_CASE("the AdamW step's constants are checked under -ffast-math", "[validate][fast-math][adamw]") {
  volatile std::uint64_t bits = 0x7ff8000000000000ull;  // a double NaN the compiler cannot see
  const std::uint64_t b = bits;
  double nan;
  std::memcpy(&nan, &b, sizeof(nan));
  static float lr = 1e-3f, step = 0.0f;
  const tigon::AdamWHyper good{.lr = &lr, .step = &step};
  CHECK(tigon::detail::validate_adamw_hyper(good, true, "adamw_step").ok());
  for (int field = 0; field < 4; ++field) {
    tigon::AdamWHyper h = good;
    (field == 0 ? h.beta1 : field == 1 ? h.beta2 : field == 2 ? h.eps : h.weight_decay) = nan;
    INFO("field " << field);
    CHECK(tigon::detail::validate_adamw_hyper(h, true, "adamw_step").code() == tigon::Errc::invalid_value);
  }
}

TEST_CASE("the divergence functors' parameters are checked under -ffast-math", "[validate][fast-math][divergence]") {
  const float nan = from_bits(0x7fc00000u), neg_nan = from_bits(0xffc00001u);
  const float inf = from_bits(0x7f800000u), neg_inf = from_bits(0xff800000u);
  for (float bad : {nan, neg_nan, inf, neg_inf, -from_bits(0x00000001u), from_bits(0x3f800001u), 2.0f}) {
    INFO("beta bits " << std::hex << [&] { std::uint32_t u; std::memcpy(&u, &bad, 4); return u; }());
    CHECK_FALSE(tigon::GeneralizedJSD{bad}.validate("op").ok());
  }
  for (float good : {0.0f, 0.5f, 1.0f}) CHECK(tigon::GeneralizedJSD{good}.validate("op").ok());
  for (float bad : {nan, neg_nan, inf, neg_inf, -from_bits(0x00000001u), -1e-10f}) {
    CHECK_FALSE(tigon::KLDiv{bad}.validate("op").ok());
  }
  for (float good : {0.0f, 1e-10f, from_bits(0x7f7fffffu)}) CHECK(tigon::KLDiv{good}.validate("op").ok());
}
