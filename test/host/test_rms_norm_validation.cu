// Argument validation of the RMSNorm launchers. Runs without a GPU: every bad call must be
// rejected before the launcher touches the device (on a machine without one, reaching the device
// would turn these into CUDA errors and fail the test), naming the argument at fault.
#include <catch2/catch.hpp>

#include <string>

#include <tigon/norm/rms_norm.cuh>

#include "alias_matrix.hpp"

using namespace tigon;
using tigon_test::alias_matrix;

namespace {
alignas(256) bf16 xbuf[8 * 256];
alignas(256) bf16 ybuf[8 * 256];
alignas(256) bf16 wbuf[256];
alignas(256) float rbuf[8];
alignas(256) bf16 dwbuf[256];
alignas(256) unsigned char wsbuf[64 * 1024];

RmsNormForwardArgs<bf16> good_fwd() {
  return {.x = xbuf, .y = ybuf, .weight = wbuf, .rstd = rbuf, .rows = 8, .cols = 256};
}
RmsNormBackwardArgs<bf16> good_bwd() {
  return {.dy = ybuf, .x = xbuf, .weight = wbuf, .rstd = rbuf, .dx = ybuf, .rows = 8, .cols = 256};
}

void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
}
}  // namespace

TEST_CASE("rms_norm_forward rejects bad arguments by name", "[rms_norm][validation]") {
  auto a = good_fwd();
  a.x = nullptr;
  expect(rms_norm_forward(a, nullptr), Errc::null_pointer, "x");
  a = good_fwd();
  a.y = nullptr;
  expect(rms_norm_forward(a, nullptr), Errc::null_pointer, "y");
  a = good_fwd();
  a.rows = 0;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_size, "rows");
  a = good_fwd();
  a.cols = 0;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_size, "cols");
  a = good_fwd();
  a.cols = -5;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_size, "cols");
  a = good_fwd();
  a.x_stride = 100;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_stride, "x_stride");
  a = good_fwd();
  a.y_stride = 255;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_stride, "y_stride");
  a = good_fwd();
  a.eps = -1.0f;
  expect(rms_norm_forward(a, nullptr), Errc::invalid_value, "eps");
  a = good_fwd();
  a.casting = static_cast<RmsNormCasting>(7);
  expect(rms_norm_forward(a, nullptr), Errc::invalid_value, "casting");
  // A non-finite offset (checked by its bits, so that -ffast-math keeps the check).
  for (const float off : {__builtin_nanf(""), __builtin_huge_valf(), -__builtin_huge_valf()}) {
    a = good_fwd();
    a.offset = off;
    expect(rms_norm_forward(a, nullptr), Errc::invalid_value, "offset");
    auto b = good_bwd();
    b.offset = off;
    expect(rms_norm_backward(b, nullptr), Errc::invalid_value, "offset");
  }
  a = good_fwd();
  a.y = xbuf + 3;  // overlaps x, not the same matrix
  expect(rms_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.rstd = reinterpret_cast<float*>(ybuf);
  expect(rms_norm_forward(a, nullptr), Errc::aliasing, "rstd");
  a = good_fwd();
  a.cols = (std::int64_t{1} << 30) + 1;
  a.x_stride = a.y_stride = 0;
  expect(rms_norm_forward(a, nullptr), Errc::unsupported, "cols");
  // The compile-time launcher checks the compiled size too.
  a = good_fwd();
  expect(rms_norm_forward<bf16, 4096>(a, nullptr), Errc::invalid_size, "cols");
}

// A policy derived from RmsNormPolicy that overrides one member: the compile-time launchers take
// it (instantiating every kernel with it) and validate before touching the device.
struct TwoStages : RmsNormPolicy {
  static constexpr int kBwdStages = 2;
};

TEST_CASE("rms_norm launchers take a derived policy", "[rms_norm][validation]") {
  auto f = good_fwd();
  expect(rms_norm_forward<bf16, 4096, TwoStages>(f, nullptr), Errc::invalid_size, "cols");
  f.x = nullptr;
  expect(rms_norm_forward<bf16, 256, TwoStages>(f, nullptr), Errc::null_pointer, "x");
  auto b = good_bwd();
  b.dx_stride = 1;
  expect(rms_norm_backward<bf16, 256, TwoStages>(b, nullptr), Errc::invalid_stride, "dx_stride");
  std::size_t bytes = 123;
  b = good_bwd();
  b.cols = 0;
  expect(rms_norm_backward_workspace_bytes<bf16, 256, TwoStages>(b, bytes), Errc::invalid_size, "cols");
  CHECK(bytes == 0);
}

TEST_CASE("rms_norm_backward rejects bad arguments by name", "[rms_norm][validation]") {
  auto a = good_bwd();
  a.dy = nullptr;
  expect(rms_norm_backward(a, nullptr), Errc::null_pointer, "dy");
  a = good_bwd();
  a.x = nullptr;
  expect(rms_norm_backward(a, nullptr), Errc::null_pointer, "x");
  a = good_bwd();
  a.dx = nullptr;
  expect(rms_norm_backward(a, nullptr), Errc::null_pointer, "dx");
  a = good_bwd();
  a.dx_stride = 1;
  expect(rms_norm_backward(a, nullptr), Errc::invalid_stride, "dx_stride");
  a = good_bwd();
  a.dx = ybuf + 8;  // overlaps dy, shifted
  expect(rms_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.weight = nullptr;
  a.dweight = dwbuf;
  expect(rms_norm_backward(a, nullptr), Errc::invalid_value, "dweight");
  a = good_bwd();
  a.dweight = wbuf;  // dW over the weight it differentiates
  expect(rms_norm_backward(a, nullptr), Errc::aliasing, "dweight");
  a = good_bwd();
  a.rstd = nullptr;
  a.eps = -0.5f;
  expect(rms_norm_backward(a, nullptr), Errc::invalid_value, "eps");
  std::size_t bytes = 123;
  a = good_bwd();
  a.rows = -1;
  expect(rms_norm_backward_workspace_bytes(a, bytes), Errc::invalid_size, "rows");
  CHECK(bytes == 0);
  // The workspace (the partial dW rows) over an input or an output.
  a = good_bwd();
  a.dweight = dwbuf;
  a.workspace = xbuf;
  a.workspace_bytes = sizeof(xbuf);
  expect(rms_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a.workspace = dwbuf;
  a.workspace_bytes = sizeof(wsbuf);
  expect(rms_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a.workspace = wsbuf;
  CHECK(detail::validate(a, "rms_norm_backward", true).ok());
  // Beyond the partial rows every plan writes, a plan's larger workspace over a buffer.
  a.dx = reinterpret_cast<bf16*>(wsbuf + 4096);
  CHECK(detail::validate(a, "rms_norm_backward", true).ok());
  expect(detail::validate(a, "rms_norm_backward", true, 8192), Errc::aliasing, "workspace");
}

TEST_CASE("in-place calls are valid arguments", "[rms_norm][validation]") {
  // Same pointer and stride: allowed. Validation alone is checked here (no device needed).
  auto f = good_fwd();
  f.y = xbuf;
  CHECK(detail::validate(f, "rms_norm_forward").ok());
  auto b = good_bwd();
  b.dx = const_cast<bf16*>(b.dy);
  CHECK(detail::validate(b, "rms_norm_backward", true).ok());
  b.dx = xbuf;
  CHECK(detail::validate(b, "rms_norm_backward", true).ok());
}

TEST_CASE("rms_norm: the generated aliasing matrix", "[rms_norm][validation]") {
  // Forward: x, weight in; y, rstd out; y may be x itself.
  alias_matrix<RmsNormForwardArgs<bf16, bf16>>(
      {{"x", false}, {"weight", false}, {"y", true}, {"rstd", true}}, {{2, 0}},
      [](RmsNormForwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.x = p;
        if (k == 1) a.weight = p;
        if (k == 2) a.y = p;
        if (k == 3) a.rstd = reinterpret_cast<float*>(p);
      },
      [](const RmsNormForwardArgs<bf16, bf16>& a) { return detail::validate(a, "rms_norm_forward"); });
  // Backward: dy, x, weight, rstd in; dx, dweight out; dx may be dy or x itself.
  alias_matrix<RmsNormBackwardArgs<bf16, bf16>>(
      {{"dy", false}, {"x", false}, {"weight", false}, {"rstd", false}, {"dx", true}, {"dweight", true}},
      {{4, 0}, {4, 1}},
      [](RmsNormBackwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.dy = p;
        if (k == 1) a.x = p;
        if (k == 2) a.weight = p;
        if (k == 3) a.rstd = reinterpret_cast<const float*>(p);
        if (k == 4) a.dx = p;
        if (k == 5) a.dweight = p;
      },
      [](const RmsNormBackwardArgs<bf16, bf16>& a) { return detail::validate(a, "rms_norm_backward", false); });
}
