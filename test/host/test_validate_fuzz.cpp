// The validators fuzzed at int64's extremes: sizes and strides drawn from 0, +-1, small values, the
// 2^31 and 2^32 boundaries, 2^40, 2^62 and INT64_MIN / INT64_MAX, on the norms, the gated and ungated
// activations, cross-entropy and the divergence. Built with -fsanitize=undefined (no recovery) where
// the compiler has it, so a signed overflow inside a validator aborts the test. The property: a call
// a validator accepts has every matrix's byte extent, ((rows - 1) * stride + cols) * element bytes,
// representable in int64 and its address range unwrapped (the kernels' 64-bit offsets come from it).
// Second property, on the same ops and the divergence functors: a call a validator accepts has every
// scalar parameter finite. The file is also built with -ffast-math (tigon_validation_fuzz_fast_math),
// where a check written as a float comparison could be folded away; the oracle reads the bits.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include <tigon/activation/gated.cuh>
#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/divergence.cuh>
#include <tigon/norm/add_rms_norm.cuh>
#include <tigon/norm/layer_norm.cuh>
#include <tigon/norm/rms_norm.cuh>

using namespace tigon;

namespace {

__extension__ typedef __int128 i128;  // GCC / Clang: the extents computed without overflow
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

struct Draw {
  std::uint64_t s = 0x9e3779b97f4a7c15ull;
  std::uint64_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 17;
  }
  // A size or a stride: mostly the interesting boundaries, sometimes a small value.
  std::int64_t value() {
    static constexpr std::int64_t kPicks[] = {0,       1,         2,           7,          8,
                                              64,      1000,      4096,        (1ll << 31) - 1,
                                              1ll << 31, (1ll << 32) + 1, 1ll << 40, 1ll << 62,
                                              kMax,    kMax - 1,  -1,          kMin};
    constexpr std::size_t n = sizeof(kPicks) / sizeof(kPicks[0]);
    const std::uint64_t r = next();
    return r % 4 == 0 ? static_cast<std::int64_t>(r % 5000) : kPicks[r % n];
  }
};

alignas(256) unsigned char arena[8][4096];

// Whether [rows, cols] elements `stride` apart, from p, span a byte range int64 and the address
// space hold (computed in 128 bits).
bool representable(const void* p, std::int64_t rows, std::int64_t cols, std::int64_t stride, int elem) {
  if (p == nullptr || rows <= 0 || cols <= 0) return true;
  const std::int64_t rs = stride == 0 ? cols : stride;
  const i128 bytes = (static_cast<i128>(rows - 1) * rs + cols) * elem;
  const i128 end = static_cast<i128>(reinterpret_cast<std::uintptr_t>(p)) + bytes;
  return bytes <= kMax && end <= static_cast<i128>(std::numeric_limits<std::uintptr_t>::max());
}

constexpr int kTrials = 20000;

// A scalar parameter: mostly the values a float check can lose (NaN of either sign, the infinities,
// the subnormals, the largest finite values), sometimes an ordinary one in [-2, 2].
float scalar(Draw& d) {
  static const float kPicks[] = {__builtin_nanf(""), -__builtin_nanf(""), __builtin_huge_valf(),
                                 -__builtin_huge_valf(), 0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 1e-6f,
                                 std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                                 std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
  constexpr std::size_t n = sizeof(kPicks) / sizeof(kPicks[0]);
  const std::uint64_t r = d.next();
  return r % 4 == 0 ? static_cast<float>(static_cast<double>(r % 4001) / 1000.0 - 2.0) : kPicks[r % n];
}

// Finite by the bits (an exponent below all ones), as no -ffast-math build can fold away.
bool finite(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return (b & 0x7f800000u) != 0x7f800000u;
}

}  // namespace

TEST_CASE("validators at int64's extremes: accepted calls have representable extents", "[validation][fuzz]") {
  Draw d;
  int accepted = 0;
  for (int i = 0; i < kTrials; ++i) {
    RmsNormForwardArgs<bf16> a{.x = reinterpret_cast<bf16*>(arena[0]), .y = reinterpret_cast<bf16*>(arena[1]),
                               .weight = reinterpret_cast<bf16*>(arena[2]), .rstd = reinterpret_cast<float*>(arena[3])};
    a.rows = d.value(), a.cols = d.value(), a.x_stride = d.value(), a.y_stride = d.value();
    if (detail::validate(a, "rms_norm_forward").ok()) {
      ++accepted;
      CHECK(representable(a.x, a.rows, a.cols, a.x_stride, 2));
      CHECK(representable(a.y, a.rows, a.cols, a.y_stride, 2));
    }
  }
  for (int i = 0; i < kTrials; ++i) {
    LayerNormBackwardArgs<bf16> a{};
    a.dy = reinterpret_cast<bf16*>(arena[0]), a.x = reinterpret_cast<bf16*>(arena[1]);
    a.mean = reinterpret_cast<float*>(arena[2]), a.rstd = reinterpret_cast<float*>(arena[3]);
    a.dx = reinterpret_cast<bf16*>(arena[4]);
    a.rows = d.value(), a.cols = d.value(), a.dy_stride = d.value(), a.x_stride = d.value(), a.dx_stride = d.value();
    if (detail::validate(a, "layer_norm_backward", false).ok()) {
      ++accepted;
      CHECK(representable(a.dy, a.rows, a.cols, a.dy_stride, 2));
      CHECK(representable(a.x, a.rows, a.cols, a.x_stride, 2));
      CHECK(representable(a.dx, a.rows, a.cols, a.dx_stride, 2));
    }
  }
  for (int i = 0; i < kTrials; ++i) {
    GatedBackwardArgs<half> a{.dc = reinterpret_cast<half*>(arena[0]), .a = reinterpret_cast<half*>(arena[1]),
                              .b = reinterpret_cast<half*>(arena[2]), .da = reinterpret_cast<half*>(arena[3]),
                              .db = reinterpret_cast<half*>(arena[4])};
    a.rows = d.value(), a.cols = d.value(), a.dc_stride = d.value(), a.a_stride = d.value(), a.b_stride = d.value(),
    a.da_stride = d.value(), a.db_stride = d.value();
    if (detail::validate(a, "gated_backward").ok()) {
      ++accepted;
      for (auto [p, s] : {std::pair<const void*, std::int64_t>{a.dc, a.dc_stride}, {a.a, a.a_stride},
                          {a.b, a.b_stride}, {a.da, a.da_stride}, {a.db, a.db_stride}}) {
        CHECK(representable(p, a.rows, a.cols, s, 2));
      }
    }
  }
  for (int i = 0; i < kTrials; ++i) {
    ActivationForwardArgs<float> a{.a = reinterpret_cast<float*>(arena[0]), .c = reinterpret_cast<float*>(arena[1])};
    a.rows = d.value(), a.cols = d.value(), a.a_stride = d.value(), a.c_stride = d.value();
    if (detail::validate(a, "relu2_forward").ok()) {
      ++accepted;
      CHECK(representable(a.a, a.rows, a.cols, a.a_stride, 4));
      CHECK(representable(a.c, a.rows, a.cols, a.c_stride, 4));
    }
  }
  for (int i = 0; i < kTrials; ++i) {
    CrossEntropyArgs<bf16> a{.logits = reinterpret_cast<bf16*>(arena[0]),
                             .targets = reinterpret_cast<std::int64_t*>(arena[1]),
                             .dlogits = reinterpret_cast<bf16*>(arena[2]), .loss = reinterpret_cast<float*>(arena[3]),
                             .loss_rows = reinterpret_cast<float*>(arena[4]), .workspace = arena[5],
                             .workspace_bytes = sizeof(arena[5])};
    a.rows = d.value(), a.vocab = d.value(), a.logits_stride = d.value(), a.dlogits_stride = d.value();
    if (detail::validate(a, "cross_entropy").ok()) {
      ++accepted;
      CHECK(representable(a.logits, a.rows, a.vocab, a.logits_stride, 2));
      CHECK(representable(a.dlogits, a.rows, a.vocab, a.dlogits_stride, 2));
      CHECK(representable(a.loss_rows, 1, a.rows, 0, 4));
      CHECK(representable(a.targets, 1, a.rows, 0, 8));
    }
  }
  for (int i = 0; i < kTrials; ++i) {
    DivergenceArgs<bf16, float> a{.student = reinterpret_cast<bf16*>(arena[0]),
                                  .teacher = reinterpret_cast<float*>(arena[1])};
    a.dx = reinterpret_cast<bf16*>(arena[2]), a.loss = reinterpret_cast<float*>(arena[3]);
    a.rows = d.value(), a.vocab = d.value(), a.student_stride = d.value(), a.teacher_stride = d.value(),
    a.dx_stride = d.value();
    if (detail::validate_divergence_args(a, "divergence").ok()) {
      ++accepted;
      CHECK(representable(a.student, a.rows, a.vocab, a.student_stride, 2));
      CHECK(representable(a.teacher, a.rows, a.vocab, a.teacher_stride, 4));
      CHECK(representable(a.dx, a.rows, a.vocab, a.dx_stride, 2));
    }
  }
  INFO(accepted << " of " << 6 * kTrials << " calls accepted");
  CHECK(accepted > 0);  // the draw reaches valid calls too
}

TEST_CASE("validators at float's edges: accepted calls have finite scalars", "[validation][fuzz]") {
  Draw d;
  // trial() draws one call's scalars and returns {whether the validator accepts it, whether every
  // scalar is finite}; each validator must both accept and reject, so that no property holds
  // vacuously.
  auto fuzz = [&](const char* name, auto trial) {
    int accepted = 0, rejected = 0;
    for (int i = 0; i < kTrials; ++i) {
      const auto [ok, all_finite] = trial();
      ok ? ++accepted : ++rejected;
      if (ok) CHECK(all_finite);
    }
    INFO(name << ": " << accepted << " accepted, " << rejected << " rejected");
    CHECK(accepted > 0);
    CHECK(rejected > 0);
  };
  fuzz("rms_norm_forward", [&] {
    RmsNormForwardArgs<bf16> a{.x = reinterpret_cast<bf16*>(arena[0]), .y = reinterpret_cast<bf16*>(arena[1]),
                               .weight = reinterpret_cast<bf16*>(arena[2]), .rstd = reinterpret_cast<float*>(arena[3]),
                               .rows = 4, .cols = 64};
    a.eps = scalar(d), a.offset = scalar(d);
    return std::pair{detail::validate(a, "rms_norm_forward").ok(), finite(a.eps) && finite(a.offset)};
  });
  fuzz("layer_norm_forward", [&] {
    LayerNormForwardArgs<bf16> a{.x = reinterpret_cast<bf16*>(arena[0]), .y = reinterpret_cast<bf16*>(arena[1]),
                                 .rows = 4, .cols = 64};
    a.eps = scalar(d);
    return std::pair{detail::validate(a, "layer_norm_forward").ok(), finite(a.eps)};
  });
  fuzz("add_rms_norm_forward", [&] {
    AddRmsNormForwardArgs<bf16> a{.x = reinterpret_cast<bf16*>(arena[0]),
                                  .residual = reinterpret_cast<bf16*>(arena[1]),
                                  .y = reinterpret_cast<bf16*>(arena[2]), .sum = reinterpret_cast<bf16*>(arena[3]),
                                  .rows = 4, .cols = 64};
    a.eps = scalar(d), a.offset = scalar(d);
    return std::pair{detail::validate(a, "add_rms_norm_forward").ok(), finite(a.eps) && finite(a.offset)};
  });
  fuzz("swiglu_forward", [&] {
    GatedForwardArgs<bf16> a{.a = reinterpret_cast<bf16*>(arena[0]), .b = reinterpret_cast<bf16*>(arena[1]),
                             .c = reinterpret_cast<bf16*>(arena[2]), .rows = 4, .cols = 64};
    a.gate_multiplier = scalar(d), a.down_multiplier = scalar(d);
    return std::pair{detail::validate(a, "swiglu_forward").ok(), finite(a.gate_multiplier) && finite(a.down_multiplier)};
  });
  fuzz("cross_entropy", [&] {
    CrossEntropyArgs<bf16> a{.logits = reinterpret_cast<bf16*>(arena[0]),
                             .targets = reinterpret_cast<std::int64_t*>(arena[1]), .rows = 4, .vocab = 64,
                             .dlogits = reinterpret_cast<bf16*>(arena[2]), .loss = reinterpret_cast<float*>(arena[3]),
                             .workspace = arena[5], .workspace_bytes = sizeof(arena[5])};
    a.label_smoothing = scalar(d), a.z_loss_scale = scalar(d), a.softcap = scalar(d), a.grad_scale = scalar(d);
    return std::pair{detail::validate(a, "cross_entropy").ok(), finite(a.label_smoothing) && finite(a.z_loss_scale) &&
                                                                    finite(a.softcap) && finite(a.grad_scale)};
  });
  fuzz("divergence", [&] {
    DivergenceArgs<bf16, float> a{.student = reinterpret_cast<bf16*>(arena[0]),
                                  .student_input = DivergenceInput::logits,
                                  .teacher = reinterpret_cast<float*>(arena[1]),
                                  .teacher_input = DivergenceInput::logits, .rows = 4, .vocab = 64};
    a.dx = reinterpret_cast<bf16*>(arena[2]), a.loss = reinterpret_cast<float*>(arena[3]);
    a.temperature = scalar(d), a.grad_scale = scalar(d);
    return std::pair{detail::validate_divergence_args(a, "divergence").ok(),
                     finite(a.temperature) && finite(a.grad_scale)};
  });
  fuzz("GeneralizedJSD", [&] {
    const GeneralizedJSD f{scalar(d)};
    return std::pair{f.validate("divergence").ok(), finite(f.beta)};
  });
  fuzz("KLDiv", [&] {
    const KLDiv f{scalar(d)};
    return std::pair{f.validate("divergence").ok(), finite(f.eps)};
  });
}
