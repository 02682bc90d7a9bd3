// Argument validation of the fused residual add + RMSNorm launchers. Runs without a GPU: every
// bad call must be rejected before the launcher touches the device (on a machine without one,
// reaching the device would turn these into CUDA errors and fail the test), naming the argument.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include <tigon/norm/add_rms_norm.cuh>

#include "alias_matrix.hpp"

using namespace tigon;
using tigon_test::alias_matrix;

namespace {
alignas(256) bf16 xbuf[8 * 256];
alignas(256) bf16 resbuf[8 * 256];
alignas(256) bf16 ybuf[8 * 256];
alignas(256) bf16 sbuf[8 * 256];
alignas(256) bf16 wbuf[256];
alignas(256) float rbuf[8];
alignas(256) bf16 dwbuf[256];
alignas(256) unsigned char wsbuf[64 * 1024];

AddRmsNormForwardArgs<bf16> good_fwd() {
  return {.x = xbuf, .residual = resbuf, .y = ybuf, .sum = sbuf, .weight = wbuf, .rstd = rbuf,
          .rows = 8, .cols = 256};
}
// dy in ybuf, dsum in resbuf, the saved sum in sbuf, dx over dy.
AddRmsNormBackwardArgs<bf16> good_bwd() {
  return {.dy = ybuf, .dsum = resbuf, .sum = sbuf, .weight = wbuf, .rstd = rbuf, .dx = ybuf,
          .dweight = dwbuf, .rows = 8, .cols = 256, .workspace = wsbuf,
          .workspace_bytes = sizeof(wsbuf)};
}

void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(s.message().find("tigon::add_rms_norm_") == 0);
}
}  // namespace

// A policy derived from RmsNormPolicy that overrides one member: the compile-time launchers take it.
struct OneBlockPerSm : RmsNormPolicy {
  static constexpr int kFwdMinBlocksPerSm = 1;
};

TEST_CASE("add_rms_norm_forward rejects bad arguments by name", "[add_rms_norm][validation]") {
  auto a = good_fwd();
  a.x = nullptr;
  expect(add_rms_norm_forward(a, nullptr), Errc::null_pointer, "x");
  a = good_fwd();
  a.residual = nullptr;
  expect(add_rms_norm_forward(a, nullptr), Errc::null_pointer, "residual");
  a = good_fwd();
  a.y = nullptr;
  expect(add_rms_norm_forward(a, nullptr), Errc::null_pointer, "y");
  a = good_fwd();
  a.sum = nullptr;
  expect(add_rms_norm_forward(a, nullptr), Errc::null_pointer, "sum");
  a = good_fwd();
  a.rows = -2;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_size, "rows");
  a = good_fwd();
  a.cols = 0;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_size, "cols");
  a = good_fwd();
  a.cols = (std::int64_t{1} << 30) + 1;
  expect(add_rms_norm_forward(a, nullptr), Errc::unsupported, "cols");
  a = good_fwd();
  a.x_stride = 255;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_stride, "x_stride");
  a = good_fwd();
  a.residual_stride = 7;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_stride, "residual_stride");
  a = good_fwd();
  a.y_stride = -1;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_stride, "y_stride");
  a = good_fwd();
  a.sum_stride = 128;
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_stride, "sum_stride");
  for (float eps : {-1e-6f, NAN, INFINITY}) {
    a = good_fwd();
    a.eps = eps;
    expect(add_rms_norm_forward(a, nullptr), Errc::invalid_value, "eps");
  }
  a = good_fwd();
  a.casting = static_cast<RmsNormCasting>(9);
  expect(add_rms_norm_forward(a, nullptr), Errc::invalid_value, "casting");
  a = good_fwd();
  a.sum = resbuf + 8;  // over the residual, shifted by a few elements
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "sum");
  a = good_fwd();
  a.sum = xbuf + 1;  // over x, shifted
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "sum");
  a = good_fwd();
  a.y = xbuf + 256;  // over x, one row on
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.y = sbuf;  // y and s are two outputs: never the same memory
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.y = resbuf;
  a.sum = resbuf;  // both over the residual
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.weight = sbuf + 16;  // s over the weight
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "sum");
  a = good_fwd();
  a.rstd = reinterpret_cast<float*>(sbuf);
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "rstd");
  a = good_fwd();
  a.rstd = reinterpret_cast<float*>(resbuf);
  expect(add_rms_norm_forward(a, nullptr), Errc::aliasing, "rstd");
  // The compile-time launcher checks the compiled size, whatever its policy.
  a = good_fwd();
  expect(add_rms_norm_forward<bf16, 2048>(a, nullptr), Errc::invalid_size, "cols");
  a = good_fwd();
  expect(add_rms_norm_forward<bf16, 2048, OneBlockPerSm>(a, nullptr), Errc::invalid_size, "cols");
  a.x = nullptr;
  expect(add_rms_norm_forward<bf16, 256, OneBlockPerSm>(a, nullptr), Errc::null_pointer, "x");
}

TEST_CASE("add_rms_norm rejects a non-finite offset", "[add_rms_norm][validation]") {
  for (const float off : {__builtin_nanf(""), __builtin_huge_valf()}) {
    auto f = good_fwd();
    f.offset = off;
    expect(add_rms_norm_forward(f, nullptr), Errc::invalid_value, "offset");
    auto b = good_bwd();
    b.offset = off;
    expect(add_rms_norm_backward(b, nullptr), Errc::invalid_value, "offset");
  }
}

TEST_CASE("add_rms_norm_backward rejects a workspace over a buffer", "[add_rms_norm][validation]") {
  auto a = good_bwd();
  a.workspace = sbuf;  // the partial dW rows over the saved sum
  a.workspace_bytes = sizeof(sbuf);
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a.workspace = dwbuf;
  a.workspace_bytes = sizeof(wsbuf);
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a = good_bwd();
  a.rstd = reinterpret_cast<float*>(wsbuf + 4096);  // past the partial row every plan writes
  CHECK(detail::validate(a, "add_rms_norm_backward", true).ok());
  expect(detail::validate(a, "add_rms_norm_backward", true, 8192), Errc::aliasing, "workspace");
}

TEST_CASE("add_rms_norm_backward rejects bad arguments by name", "[add_rms_norm][validation]") {
  auto a = good_bwd();
  a.dy = nullptr;
  expect(add_rms_norm_backward(a, nullptr), Errc::null_pointer, "dy");
  a = good_bwd();
  a.sum = nullptr;
  expect(add_rms_norm_backward(a, nullptr), Errc::null_pointer, "sum");
  a = good_bwd();
  a.dx = nullptr;
  expect(add_rms_norm_backward(a, nullptr), Errc::null_pointer, "dx");
  a = good_bwd();
  a.rows = 0;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_size, "rows");
  a = good_bwd();
  a.dy_stride = 200;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_stride, "dy_stride");
  a = good_bwd();
  a.dsum_stride = 200;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_stride, "dsum_stride");
  a = good_bwd();
  a.sum_stride = -3;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_stride, "sum_stride");
  a = good_bwd();
  a.dx_stride = 2;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_stride, "dx_stride");
  a = good_bwd();
  a.rstd = nullptr;  // recomputed from s: eps is read, and checked
  a.eps = NAN;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_value, "eps");
  a = good_bwd();
  a.casting = static_cast<RmsNormCasting>(-1);
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_value, "casting");
  a = good_bwd();
  a.weight = nullptr;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_value, "dweight");
  a = good_bwd();
  a.dx = ybuf + 2;  // over dy, shifted
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dx = resbuf + 256;  // over dsum, a row on
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dx = sbuf + 1;  // over the sum, shifted
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dx = wbuf;
  a.rows = 1;  // over the weight
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dweight = resbuf;  // dW over dsum
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dweight");
  a = good_bwd();
  a.dweight = wbuf;
  expect(add_rms_norm_backward(a, nullptr), Errc::aliasing, "dweight");
  // The workspace, as far as it can be checked without the device.
  a = good_bwd();
  a.workspace = nullptr;
  expect(add_rms_norm_backward(a, nullptr), Errc::null_pointer, "workspace");
  a = good_bwd();
  a.workspace = wsbuf + 8;
  a.workspace_bytes = sizeof(wsbuf) - 8;
  expect(add_rms_norm_backward(a, nullptr), Errc::invalid_value, "workspace");
  a = good_bwd();
  a.workspace_bytes = 100;
  expect(add_rms_norm_backward(a, nullptr), Errc::workspace_too_small, "workspace_bytes");
  a = good_bwd();
  expect(add_rms_norm_backward<bf16, 8192>(a, nullptr), Errc::invalid_size, "cols");
  std::size_t bytes = 7;
  a = good_bwd();
  a.cols = -1;
  expect(add_rms_norm_backward_workspace_bytes(a, bytes), Errc::invalid_size, "cols");
  CHECK(bytes == 0);
}

TEST_CASE("add_rms_norm: in-place and optional arguments are valid", "[add_rms_norm][validation]") {
  auto f = good_fwd();
  f.sum = resbuf;  // s over the residual: the usual pre-norm call
  CHECK(detail::validate(f, "add_rms_norm_forward").ok());
  f.y = xbuf;  // and y over x
  CHECK(detail::validate(f, "add_rms_norm_forward").ok());
  f = good_fwd();
  f.sum = xbuf;
  f.y = resbuf;
  CHECK(detail::validate(f, "add_rms_norm_forward").ok());
  f.weight = nullptr;
  f.rstd = nullptr;
  CHECK(detail::validate(f, "add_rms_norm_forward").ok());
  auto b = good_bwd();
  b.dx = const_cast<bf16*>(b.dsum);  // over dsum
  CHECK(detail::validate(b, "add_rms_norm_backward", true).ok());
  b.dx = sbuf;  // over the saved sum
  CHECK(detail::validate(b, "add_rms_norm_backward", true).ok());
  b = good_bwd();
  b.dsum = nullptr;  // no gradient from the residual stream
  b.dweight = nullptr;
  b.workspace = nullptr;
  b.workspace_bytes = 0;
  CHECK(detail::validate(b, "add_rms_norm_backward", true).ok());
  b = good_bwd();
  b.workspace = nullptr;
  b.workspace_bytes = 0;
  CHECK(detail::validate(b, "add_rms_norm_backward_workspace_bytes", false).ok());
}

TEST_CASE("add_rms_norm: the generated aliasing matrix", "[add_rms_norm][validation]") {
  // Forward: x, residual, weight in; y, sum, rstd out; y and sum may each be x or residual itself.
  alias_matrix<AddRmsNormForwardArgs<bf16, bf16>>(
      {{"x", false}, {"residual", false}, {"weight", false}, {"y", true}, {"sum", true}, {"rstd", true}},
      {{3, 0}, {3, 1}, {4, 0}, {4, 1}},
      [](AddRmsNormForwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.x = p;
        if (k == 1) a.residual = p;
        if (k == 2) a.weight = p;
        if (k == 3) a.y = p;
        if (k == 4) a.sum = p;
        if (k == 5) a.rstd = reinterpret_cast<float*>(p);
      },
      [](const AddRmsNormForwardArgs<bf16, bf16>& a) { return detail::validate(a, "add_rms_norm_forward"); });
  // Backward: dy, dsum, sum, weight, rstd in; dx, dweight out; dx may be dy, dsum or sum itself.
  alias_matrix<AddRmsNormBackwardArgs<bf16, bf16>>(
      {{"dy", false}, {"dsum", false}, {"sum", false}, {"weight", false}, {"rstd", false}, {"dx", true},
       {"dweight", true}},
      {{5, 0}, {5, 1}, {5, 2}},
      [](AddRmsNormBackwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.dy = p;
        if (k == 1) a.dsum = p;
        if (k == 2) a.sum = p;
        if (k == 3) a.weight = p;
        if (k == 4) a.rstd = reinterpret_cast<const float*>(p);
        if (k == 5) a.dx = p;
        if (k == 6) a.dweight = p;
      },
      [](const AddRmsNormBackwardArgs<bf16, bf16>& a) { return detail::validate(a, "add_rms_norm_backward", false); });
}
