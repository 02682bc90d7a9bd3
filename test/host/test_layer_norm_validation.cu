// Argument validation of the LayerNorm launchers. Runs without a GPU: every bad call must be
// rejected before the launcher touches the device (on a machine without one, reaching the device
// would turn these into CUDA errors and fail the test), naming the argument at fault.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include <tigon/norm/layer_norm.cuh>

#include "alias_matrix.hpp"

using namespace tigon;
using tigon_test::alias_matrix;

namespace {
alignas(256) bf16 xbuf[8 * 256];
alignas(256) bf16 ybuf[8 * 256];
alignas(256) bf16 wbuf[256];
alignas(256) bf16 bbuf[256];
alignas(256) float mbuf[8];
alignas(256) float rbuf[8];
alignas(256) bf16 dwbuf[256];
alignas(256) bf16 dbbuf[256];
alignas(256) unsigned char wsbuf[64 * 1024];

LayerNormForwardArgs<bf16> good_fwd() {
  return {.x = xbuf, .y = ybuf, .weight = wbuf, .bias = bbuf, .mean = mbuf, .rstd = rbuf,
          .rows = 8, .cols = 256};
}
LayerNormBackwardArgs<bf16> good_bwd() {
  return {.dy = ybuf, .x = xbuf, .weight = wbuf, .mean = mbuf, .rstd = rbuf, .dx = ybuf,
          .dweight = dwbuf, .dbias = dbbuf, .rows = 8, .cols = 256, .workspace = wsbuf,
          .workspace_bytes = sizeof(wsbuf)};
}

void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(s.message().find("tigon::layer_norm_") == 0);
}
}  // namespace

// A policy derived from LayerNormPolicy that overrides one member: the compile-time launchers take it.
struct Stages4 : LayerNormPolicy {
  static constexpr int kBwdStages = 4;
};

TEST_CASE("layer_norm_forward rejects bad arguments by name", "[layer_norm][validation]") {
  auto a = good_fwd();
  a.x = nullptr;
  expect(layer_norm_forward(a, nullptr), Errc::null_pointer, "x");
  a = good_fwd();
  a.y = nullptr;
  expect(layer_norm_forward(a, nullptr), Errc::null_pointer, "y");
  a = good_fwd();
  a.rows = 0;
  expect(layer_norm_forward(a, nullptr), Errc::invalid_size, "rows");
  a = good_fwd();
  a.cols = -5;
  expect(layer_norm_forward(a, nullptr), Errc::invalid_size, "cols");
  a = good_fwd();
  a.cols = (std::int64_t{1} << 30) + 1;
  expect(layer_norm_forward(a, nullptr), Errc::unsupported, "cols");
  a = good_fwd();
  a.x_stride = 100;
  expect(layer_norm_forward(a, nullptr), Errc::invalid_stride, "x_stride");
  a = good_fwd();
  a.y_stride = -256;
  expect(layer_norm_forward(a, nullptr), Errc::invalid_stride, "y_stride");
  for (float eps : {-1.0f, NAN, INFINITY}) {
    a = good_fwd();
    a.eps = eps;
    expect(layer_norm_forward(a, nullptr), Errc::invalid_value, "eps");
  }
  a = good_fwd();
  a.y = xbuf + 3;  // overlaps x, not the same matrix
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.y = xbuf;
  a.y_stride = 512;  // same pointer, another stride: not in place
  a.x_stride = 256;
  a.rows = 4;
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.bias = ybuf + 10;  // y over the bias
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.weight = ybuf;
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "y");
  a = good_fwd();
  a.mean = reinterpret_cast<float*>(ybuf);
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "mean");
  a = good_fwd();
  a.rstd = reinterpret_cast<float*>(xbuf) + 4;
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "rstd");
  a = good_fwd();
  a.rstd = mbuf + 2;  // overlaps mean
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "rstd");
  a = good_fwd();
  a.mean = reinterpret_cast<float*>(wbuf);
  expect(layer_norm_forward(a, nullptr), Errc::aliasing, "mean");
  // The compile-time launcher checks the compiled size too.
  a = good_fwd();
  expect(layer_norm_forward<bf16, 4096>(a, nullptr), Errc::invalid_size, "cols");
}

TEST_CASE("layer_norm_backward rejects a workspace over a buffer", "[layer_norm][validation]") {
  auto a = good_bwd();
  a.workspace = xbuf;  // the partial dW and dB rows over x
  a.workspace_bytes = sizeof(xbuf);
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a.workspace = dbbuf;
  a.workspace_bytes = sizeof(wsbuf);
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "workspace");
  a = good_bwd();
  a.mean = reinterpret_cast<float*>(wsbuf + 8192);  // past the partial rows every plan writes
  CHECK(detail::validate(a, "layer_norm_backward", true).ok());
  expect(detail::validate(a, "layer_norm_backward", true, 16384), Errc::aliasing, "workspace");
}

TEST_CASE("layer_norm_backward rejects bad arguments by name", "[layer_norm][validation]") {
  auto a = good_bwd();
  a.dy = nullptr;
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "dy");
  a = good_bwd();
  a.x = nullptr;
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "x");
  a = good_bwd();
  a.mean = nullptr;  // the backward needs the saved statistics
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "mean");
  a = good_bwd();
  a.rstd = nullptr;
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "rstd");
  a = good_bwd();
  a.dx = nullptr;
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "dx");
  a = good_bwd();
  a.cols = 0;
  expect(layer_norm_backward(a, nullptr), Errc::invalid_size, "cols");
  a = good_bwd();
  a.dy_stride = 255;
  expect(layer_norm_backward(a, nullptr), Errc::invalid_stride, "dy_stride");
  a = good_bwd();
  a.x_stride = 1;
  expect(layer_norm_backward(a, nullptr), Errc::invalid_stride, "x_stride");
  a = good_bwd();
  a.dx_stride = 3;
  expect(layer_norm_backward(a, nullptr), Errc::invalid_stride, "dx_stride");
  a = good_bwd();
  a.weight = nullptr;  // dW without a weight
  expect(layer_norm_backward(a, nullptr), Errc::invalid_value, "dweight");
  a = good_bwd();
  a.dx = ybuf + 8;  // overlaps dy, shifted
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dx = xbuf + 1;  // overlaps x, shifted
  a.dy = ybuf;
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dx = reinterpret_cast<bf16*>(rbuf);
  a.rows = 2;
  a.cols = 8;  // dx over rstd
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dx");
  a = good_bwd();
  a.dweight = wbuf;  // dW over the weight it differentiates
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dweight");
  a = good_bwd();
  a.dbias = dwbuf + 5;  // dB over dW
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dbias");
  a = good_bwd();
  a.dbias = xbuf;  // dB over x
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dbias");
  a = good_bwd();
  a.dbias = reinterpret_cast<bf16*>(mbuf);
  expect(layer_norm_backward(a, nullptr), Errc::aliasing, "dbias");
  // The workspace, as far as it can be checked without the device.
  a = good_bwd();
  a.workspace = nullptr;
  expect(layer_norm_backward(a, nullptr), Errc::null_pointer, "workspace");
  a = good_bwd();
  a.workspace = wsbuf + 4;  // not 16-byte aligned
  a.workspace_bytes = sizeof(wsbuf) - 4;
  expect(layer_norm_backward(a, nullptr), Errc::invalid_value, "workspace");
  a = good_bwd();
  a.workspace_bytes = 2 * 256 * 4 - 1;  // less than one partial row for each of dW and dB
  expect(layer_norm_backward(a, nullptr), Errc::workspace_too_small, "workspace_bytes");
  a = good_bwd();
  a.dweight = nullptr;
  a.workspace_bytes = 256 * 4 - 1;  // dB alone: less than one partial row
  expect(layer_norm_backward(a, nullptr), Errc::workspace_too_small, "workspace_bytes");
  // The compile-time launcher checks the compiled size too, whatever its policy.
  a = good_bwd();
  expect(layer_norm_backward<bf16, 1024>(a, nullptr), Errc::invalid_size, "cols");
  expect(layer_norm_backward<bf16, 1024, Stages4>(a, nullptr), Errc::invalid_size, "cols");
  a.dy = nullptr;
  expect(layer_norm_backward<bf16, 256, Stages4>(a, nullptr), Errc::null_pointer, "dy");
  // The query validates the arguments, not the workspace (it has none yet).
  std::size_t bytes = 123;
  a = good_bwd();
  a.rows = -1;
  expect(layer_norm_backward_workspace_bytes(a, bytes), Errc::invalid_size, "rows");
  CHECK(bytes == 0);
  a = good_bwd();
  a.workspace = nullptr;
  a.workspace_bytes = 0;
  CHECK(detail::validate(a, "layer_norm_backward_workspace_bytes", false).ok());
  CHECK(!detail::validate(a, "layer_norm_backward", true).ok());
}

TEST_CASE("layer_norm: in-place and optional arguments are valid", "[layer_norm][validation]") {
  // Same pointer and stride: allowed. Validation alone is checked here (no device needed).
  auto f = good_fwd();
  f.y = xbuf;
  CHECK(detail::validate(f, "layer_norm_forward").ok());
  f = good_fwd();
  f.weight = nullptr;
  f.bias = nullptr;
  f.mean = nullptr;
  f.rstd = nullptr;
  CHECK(detail::validate(f, "layer_norm_forward").ok());
  auto b = good_bwd();
  b.dx = const_cast<bf16*>(b.dy);
  CHECK(detail::validate(b, "layer_norm_backward", true).ok());
  b.dx = xbuf;
  CHECK(detail::validate(b, "layer_norm_backward", true).ok());
  // Neither dW nor dB: no workspace needed.
  b = good_bwd();
  b.dweight = nullptr;
  b.dbias = nullptr;
  b.workspace = nullptr;
  b.workspace_bytes = 0;
  CHECK(detail::validate(b, "layer_norm_backward", true).ok());
  // dB without a weight is fine (sum of dy).
  b = good_bwd();
  b.weight = nullptr;
  b.dweight = nullptr;
  CHECK(detail::validate(b, "layer_norm_backward", true).ok());
}

TEST_CASE("layer_norm: the generated aliasing matrix", "[layer_norm][validation]") {
  // Forward: x, weight, bias in; y, mean, rstd out; y may be x itself.
  alias_matrix<LayerNormForwardArgs<bf16, bf16>>(
      {{"x", false}, {"weight", false}, {"bias", false}, {"y", true}, {"mean", true}, {"rstd", true}}, {{3, 0}},
      [](LayerNormForwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.x = p;
        if (k == 1) a.weight = p;
        if (k == 2) a.bias = p;
        if (k == 3) a.y = p;
        if (k == 4) a.mean = reinterpret_cast<float*>(p);
        if (k == 5) a.rstd = reinterpret_cast<float*>(p);
      },
      [](const LayerNormForwardArgs<bf16, bf16>& a) { return detail::validate(a, "layer_norm_forward"); });
  // Backward: dy, x, weight, mean, rstd in; dx, dweight, dbias out; dx may be dy or x itself.
  alias_matrix<LayerNormBackwardArgs<bf16, bf16>>(
      {{"dy", false}, {"x", false}, {"weight", false}, {"mean", false}, {"rstd", false}, {"dx", true},
       {"dweight", true}, {"dbias", true}},
      {{5, 0}, {5, 1}},
      [](LayerNormBackwardArgs<bf16, bf16>& a, int k, bf16* p) {
        a.rows = 4, a.cols = 1000;
        if (k == 0) a.dy = p;
        if (k == 1) a.x = p;
        if (k == 2) a.weight = p;
        if (k == 3) a.mean = reinterpret_cast<const float*>(p);
        if (k == 4) a.rstd = reinterpret_cast<const float*>(p);
        if (k == 5) a.dx = p;
        if (k == 6) a.dweight = p;
        if (k == 7) a.dbias = p;
      },
      [](const LayerNormBackwardArgs<bf16, bf16>& a) { return detail::validate(a, "layer_norm_backward", false); });
}
