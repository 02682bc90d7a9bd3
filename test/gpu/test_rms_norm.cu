// RMSNorm on the GPU against the double-precision reference: every casting mode x dtype x shape,
// strided rows, misaligned pointers, fp32 weights with bf16 activations, in place, without saved
// rstd, accumulation of dW; bitwise determinism; CUDA-graph capture; invalid calls write nothing.
#include "gpu_test.cuh"

#include <tigon/norm/rms_norm.cuh>

#include "../reference/rms_norm_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;
using gpu_test::dense;
using gpu_test::rms;
using gpu_test::strided;
using gpu_test::tol;
using gpu_test::tol_l2;

namespace {

struct Case {
  std::int64_t rows = 1, cols = 1;
  std::int64_t pad = 0;       // row stride = cols + pad
  std::int64_t misalign = 0;  // elements the base pointers are shifted by
  RmsNormCasting mode = RmsNormCasting::llama;
  bool weight = true;
  float offset = 0.0f;
  bool in_place = false;   // y over x (forward), dx over dy (backward)
  bool save_rstd = true;   // false: the backward recomputes rstd from x
  bool accumulate = false; // dW += instead of =
  bool compile_time = false;  // call the <T, kCols> launcher (cols must be 4096)
};

std::string describe(const Case& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.cols) + " pad " + std::to_string(c.pad) +
         " misalign " + std::to_string(c.misalign) + " mode " + casting_name(c.mode) +
         (c.weight ? " weight" : " no-weight") + " offset " + std::to_string(c.offset) +
         (c.in_place ? " in-place" : "") + (c.save_rstd ? "" : " recompute-rstd") +
         (c.accumulate ? " accumulate" : "") + (c.compile_time ? " compile-time" : "");
}

template <class T, class W = T, class Policy = RmsNormPolicy>
void run_case(const Case& c) {
  INFO(describe(c) << " T=" << dtype_traits<T>::name << " W=" << dtype_traits<W>::name);
  const std::int64_t stride = c.cols + c.pad;
  const std::size_t n = static_cast<std::size_t>(c.rows * stride + c.misalign);
  const std::int64_t off = c.misalign;

  std::vector<double> xd_all, dyd_all, wd;
  const auto xh = gpu_test::random_values<T>(n, 0.0, 1.0, &xd_all);
  const auto dyh = gpu_test::random_values<T>(n, 0.0, 1.0, &dyd_all);
  std::vector<W> wh;
  if (c.weight) wh = gpu_test::random_values<W>(static_cast<std::size_t>(c.cols), 1.0, 0.25, &wd);
  const auto xd = dense(xh, off, c.rows, c.cols, stride);
  const auto dyd = dense(dyh, off, c.rows, c.cols, stride);

  DeviceBuffer<T> x(n), y(n), dy(n), dx(n);
  DeviceBuffer<W> w(std::max<std::size_t>(wh.size(), 1)), dw(std::max<std::size_t>(wh.size(), 1));
  DeviceBuffer<float> rstd(static_cast<std::size_t>(c.rows));
  x.upload(xh);
  dy.upload(dyh);
  if (c.weight) w.upload(wh);
  y.poison();
  rstd.poison();

  // ---- forward ----
  RmsNormForwardArgs<T, W> fa{.x = x.ptr + off,
                              .y = (c.in_place ? x.ptr : y.ptr) + off,
                              .weight = c.weight ? w.ptr : nullptr,
                              .rstd = rstd.ptr,
                              .rows = c.rows,
                              .cols = c.cols,
                              .x_stride = stride,
                              .y_stride = stride,
                              .eps = 1e-6f,
                              .offset = c.offset,
                              .casting = c.mode};
  if (c.compile_time) {
    TIGON_OK((rms_norm_forward<T, 4096, Policy>(fa, nullptr)));
  } else {
    TIGON_OK(rms_norm_forward(fa, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  const auto yh = (c.in_place ? x : y).download();
  const auto rh = rstd.download();
  const auto ref = tigon_ref::rms_norm_forward<T>(xd, wd, c.rows, c.cols, 1e-6, c.offset, c.mode);
  std::vector<double> yref(ref.y.size());
  for (std::size_t i = 0; i < yref.size(); ++i) yref[i] = tigon_ref::round_t<T>(ref.y[i]);
  const auto cy = gpu_test::compare(yref.size(), strided(yh, off, c.cols, stride), yref, 1e-6, tol<T>());
  GPU_CHECK_CLOSE(cy, "y", tol_l2<T>());
  const auto cr = gpu_test::compare(
      rh.size(), [&](std::size_t i) { return static_cast<double>(rh[i]); }, ref.rstd, 0.0, 2e-6);
  GPU_CHECK_CLOSE(cr, "rstd", 1e-6);
  // Bytes outside the rows (padding, the misaligned head) are untouched.
  gpu_test::check_outside_rows(yh, c.in_place ? &xh : nullptr, off, c.rows, c.cols, stride);

  // ---- backward ----
  x.upload(xh);  // the in-place forward overwrote it
  RmsNormBackwardArgs<T, W> ba{.dy = dy.ptr + off,
                               .x = x.ptr + off,
                               .weight = c.weight ? w.ptr : nullptr,
                               .rstd = c.save_rstd ? rstd.ptr : nullptr,
                               .dx = (c.in_place ? dy.ptr : dx.ptr) + off,
                               .dweight = c.weight ? dw.ptr : nullptr,
                               .rows = c.rows,
                               .cols = c.cols,
                               .dy_stride = stride,
                               .x_stride = stride,
                               .dx_stride = stride,
                               .eps = 1e-6f,
                               .offset = c.offset,
                               .casting = c.mode,
                               .accumulate_dweight = c.accumulate};
  std::size_t ws_bytes = 0;
  if (c.compile_time) {
    TIGON_OK((rms_norm_backward_workspace_bytes<T, 4096, Policy>(ba, ws_bytes)));
  } else {
    TIGON_OK(rms_norm_backward_workspace_bytes(ba, ws_bytes));
  }
  if (c.weight) CHECK(ws_bytes >= static_cast<std::size_t>(c.cols) * sizeof(float));
  if (!c.weight) CHECK(ws_bytes == 0);
  DeviceBuffer<unsigned char> ws(ws_bytes);
  ba.workspace = ws.ptr;
  ba.workspace_bytes = ws_bytes;

  std::vector<double> dw_init;
  auto run_backward = [&]() -> std::pair<std::vector<T>, std::vector<W>> {
    dy.upload(dyh);
    dx.poison();
    ws.poison();
    if (c.weight) {
      if (c.accumulate) {
        dw.upload(gpu_test::random_values<W>(wh.size(), 0.0, 1.0, nullptr));
      } else {
        dw.poison();
      }
    }
    std::vector<W> dw_before = c.weight ? dw.download() : std::vector<W>{};
    if (c.compile_time) {
      TIGON_OK((rms_norm_backward<T, 4096, Policy>(ba, nullptr)));
    } else {
      TIGON_OK(rms_norm_backward(ba, nullptr));
    }
    CUDA_OK(cudaDeviceSynchronize());
    dw_init.clear();
    for (const W& v : dw_before) dw_init.push_back(c.accumulate ? to_float(v) : 0.0);
    return {(c.in_place ? dy : dx).download(), c.weight ? dw.download() : std::vector<W>{}};
  };
  const auto [dxh, dwh] = run_backward();
  const auto bref = tigon_ref::rms_norm_backward<T>(dyd, xd, wd, c.rows, c.cols, 1e-6, c.offset, c.mode);
  const auto cdx = gpu_test::compare(bref.dx.size(), strided(dxh, off, c.cols, stride), bref.dx,
                                     tol<T>() * rms(bref.dx), tol<T>());
  GPU_CHECK_CLOSE(cdx, "dx", 2 * tol_l2<T>());
  if (c.weight) {
    // Modes llama and none multiply dy by xhat rounded to T.
    const bool rounded = c.mode != RmsNormCasting::gemma;
    const double dw_tol = gpu_test::dweight_tol<T, W>(rounded);
    std::vector<double> dwref(bref.dw.size());
    for (std::size_t i = 0; i < dwref.size(); ++i) dwref[i] = bref.dw[i] + dw_init[i];
    const auto cdw = gpu_test::compare(
        dwref.size(), [&](std::size_t i) { return static_cast<double>(to_float(dwh[i])); }, dwref,
        dw_tol * rms(dwref), dw_tol);
    const double dw_tol_l2 = gpu_test::dweight_tol_l2<T, W>(rounded);
    GPU_CHECK_CLOSE(cdw, "dweight", 2 * dw_tol_l2);
  }
  if (!c.accumulate) {
    // Bitwise determinism: the same inputs give the same dx and dW.
    const auto [dxh2, dwh2] = run_backward();
    CHECK(std::memcmp(dxh.data(), dxh2.data(), dxh.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(dwh.data(), dwh2.data(), dwh.size() * sizeof(W)) == 0);
  }
}

template <class T, class W = T>
void run_modes(Case c) {
  for (auto m : {RmsNormCasting::llama, RmsNormCasting::gemma, RmsNormCasting::none}) {
    c.mode = m;
    run_case<T, W>(c);
  }
}

const std::vector<std::pair<std::int64_t, std::int64_t>> kShapes = {
    {5 * 123, 123},  // odd everything: scalar general path
    {1, 4096},       // one row
    {1, 123},
    {64, 1001},      // not a multiple of the vector width
    {37, 4100},      // ditto, near a compiled size
    {256, 1024}, {3, 1536}, {9, 2048}, {100, 2560}, {5, 3072}, {64, 4096},
    {33, 5120},  {7, 6144}, {16, 7168}, {40, 8192},
    {8, 10000},      // general vector path, dW accumulated in shared memory
    {8, 12288},      // general vector path, dW accumulated in the workspace
    {4, 20000},      // general vector path, dW accumulated in the workspace
    {3, 64},         // small
};

}  // namespace

TEST_CASE("rms_norm: every mode x dtype x shape against the reference", "[rms_norm][gpu]") {
  for (const auto& [rows, cols] : kShapes) {
    Case c{.rows = rows, .cols = cols};
    run_modes<bf16>(c);
    run_modes<half>(c);
    run_modes<float>(c);
  }
}

TEST_CASE("rms_norm: options", "[rms_norm][gpu]") {
  for (auto cols : {std::int64_t{123}, std::int64_t{4096}, std::int64_t{5000}}) {
    const std::int64_t rows = 29;
    SECTION("no weight " + std::to_string(cols)) { run_modes<bf16>({.rows = rows, .cols = cols, .weight = false}); }
    SECTION("gemma offset 1 " + std::to_string(cols)) {
      run_case<bf16>({.rows = rows, .cols = cols, .mode = RmsNormCasting::gemma, .offset = 1.0f});
      run_case<float>({.rows = rows, .cols = cols, .mode = RmsNormCasting::gemma, .offset = 1.0f});
    }
    SECTION("fp32 weight with bf16 x " + std::to_string(cols)) { run_modes<bf16, float>({.rows = rows, .cols = cols}); }
    SECTION("fp32 weight with half x " + std::to_string(cols)) { run_case<half, float>({.rows = rows, .cols = cols}); }
    SECTION("in place " + std::to_string(cols)) {
      run_modes<bf16>({.rows = rows, .cols = cols, .in_place = true});
      run_case<float>({.rows = rows, .cols = cols, .in_place = true});
    }
    SECTION("rstd recomputed " + std::to_string(cols)) {
      run_modes<bf16>({.rows = rows, .cols = cols, .save_rstd = false});
    }
    SECTION("dW accumulated " + std::to_string(cols)) {
      run_case<bf16, float>({.rows = rows, .cols = cols, .accumulate = true});
      run_case<bf16>({.rows = rows, .cols = cols, .accumulate = true});
    }
    SECTION("strided rows, vector-aligned " + std::to_string(cols)) {
      run_modes<bf16>({.rows = rows, .cols = cols, .pad = 64});
      run_case<float>({.rows = rows, .cols = cols, .pad = 8});
    }
    SECTION("strided rows, unaligned stride " + std::to_string(cols)) {
      run_case<bf16>({.rows = rows, .cols = cols, .pad = 3});
      run_case<half>({.rows = rows, .cols = cols, .pad = 1});
    }
    SECTION("misaligned pointers " + std::to_string(cols)) {
      run_modes<bf16>({.rows = rows, .cols = cols, .misalign = 1});
      run_case<float>({.rows = rows, .cols = cols, .misalign = 3});
      run_case<bf16, float>({.rows = rows, .cols = cols, .misalign = 1});
    }
  }
}

TEST_CASE("rms_norm: compile-time hidden size <T, 4096>", "[rms_norm][gpu]") {
  run_case<bf16>({.rows = 300, .cols = 4096, .compile_time = true});
  run_case<bf16, float>({.rows = 300, .cols = 4096, .mode = RmsNormCasting::gemma, .compile_time = true});
  run_case<half>({.rows = 3, .cols = 4096, .misalign = 1, .compile_time = true});  // falls back, correct
}

// A policy is a struct derived from RmsNormPolicy that overrides members (gpu_test.cuh's).
TEST_CASE("rms_norm: derived policies compute the same function", "[rms_norm][gpu]") {
  using P = RmsNormPolicy;
  const Case c{.rows = 300, .cols = 4096, .compile_time = true};
  run_case<bf16, bf16, gpu_test::FwdNarrow<P>>(c);
  run_case<bf16, float, gpu_test::SmallBlocks<P>>(c);
  run_case<half, half, gpu_test::OneStage<P>>(c);
  run_case<bf16, bf16, gpu_test::Capped<P>>(c);
  run_case<bf16, bf16, gpu_test::Wide<P>>(c);
  run_case<float, float, gpu_test::FwdNarrow<P>>({.rows = 77, .cols = 4096, .compile_time = true});  // fp32: 4-wide vectors
  run_case<float, float, gpu_test::SmallBlocks<P>>({.rows = 1, .cols = 4096, .compile_time = true});  // one row
  Case nw = c;
  nw.weight = false;
  run_case<half, half, gpu_test::Wide<P>>(nw);
  Case g = c;
  g.mode = RmsNormCasting::gemma;
  g.offset = 1.0f;
  run_case<half, half, gpu_test::Threads1024<P>>(g);
  // The forward's second-wave L2 prefetch on enough rows for a second wave (a wave is at most a
  // few thousand rows of 4096), with padded rows and with fp32.
  run_case<bf16>({.rows = 6001, .cols = 4096, .compile_time = true});
  run_case<bf16>({.rows = 6001, .cols = 4096, .pad = 8, .compile_time = true});
  run_case<float>({.rows = 6001, .cols = 4096, .compile_time = true});
}

TEST_CASE("rms_norm: large 16384 x 8192 and 16384 x 4096", "[rms_norm][gpu][large]") {
  run_case<bf16>({.rows = 16384, .cols = 8192});
  run_case<bf16, float>({.rows = 16384, .cols = 4096, .mode = RmsNormCasting::gemma, .offset = 1.0f});
}

TEST_CASE("rms_norm: forward + backward captured in a CUDA graph match eager bitwise", "[rms_norm][gpu][graph]") {
  const std::int64_t rows = 1000, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  DeviceBuffer<bf16> x(n), y(n), dy(n), dx(n), w(cols), dw(cols);
  DeviceBuffer<float> rstd(rows);
  x.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  dy.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(cols, 1, 0.2, nullptr));
  RmsNormForwardArgs<bf16> fa{.x = x.ptr, .y = y.ptr, .weight = w.ptr, .rstd = rstd.ptr, .rows = rows, .cols = cols};
  RmsNormBackwardArgs<bf16> ba{.dy = dy.ptr, .x = x.ptr, .weight = w.ptr, .rstd = rstd.ptr, .dx = dx.ptr,
                               .dweight = dw.ptr, .rows = rows, .cols = cols};
  std::size_t bytes = 0;
  TIGON_OK(rms_norm_backward_workspace_bytes(ba, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  ba.workspace = ws.ptr;
  ba.workspace_bytes = bytes;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TIGON_OK(rms_norm_forward(fa, s));
  TIGON_OK(rms_norm_backward(ba, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const auto y1 = y.download(), dx1 = dx.download(), dw1 = dw.download();
  y.poison();
  dx.poison();
  dw.poison();
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  TIGON_OK(rms_norm_forward(fa, s));
  TIGON_OK(rms_norm_backward(ba, s));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(std::memcmp(y1.data(), y.download().data(), n * sizeof(bf16)) == 0);
  CHECK(std::memcmp(dx1.data(), dx.download().data(), n * sizeof(bf16)) == 0);
  CHECK(std::memcmp(dw1.data(), dw.download().data(), cols * sizeof(bf16)) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_CASE("rms_norm: an invalid call launches nothing and writes nothing", "[rms_norm][gpu]") {
  const std::int64_t rows = 64, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  DeviceBuffer<bf16> x(n), y(n), dy(n), dx(n), w(cols), dw(cols);
  DeviceBuffer<float> rstd(rows);
  x.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  dy.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(cols, 1, 0.2, nullptr));
  y.poison();
  rstd.poison();
  dx.poison();
  dw.poison();
  RmsNormForwardArgs<bf16> fa{.x = x.ptr, .y = y.ptr, .weight = w.ptr, .rstd = rstd.ptr, .rows = rows,
                              .cols = cols, .x_stride = cols - 1};
  CHECK(rms_norm_forward(fa, nullptr).code() == Errc::invalid_stride);
  RmsNormBackwardArgs<bf16> ba{.dy = dy.ptr, .x = x.ptr, .weight = w.ptr, .rstd = rstd.ptr, .dx = dx.ptr,
                               .dweight = dw.ptr, .rows = rows, .cols = cols};
  std::size_t bytes = 0;
  TIGON_OK(rms_norm_backward_workspace_bytes(ba, bytes));
  REQUIRE(bytes > 0);
  DeviceBuffer<unsigned char> ws(bytes);
  ba.workspace = ws.ptr;
  ba.workspace_bytes = bytes - 1;
  const Status s = rms_norm_backward(ba, nullptr);
  INFO(s.message());
  CHECK(s.code() == Errc::workspace_too_small);
  ba.workspace = nullptr;
  ba.workspace_bytes = 0;
  CHECK(rms_norm_backward(ba, nullptr).code() == Errc::null_pointer);
  CUDA_OK(cudaDeviceSynchronize());
  const auto yh = y.download(), dxh = dx.download(), dwh = dw.download();
  const auto rh = rstd.download();
  CHECK(gpu_test::all_bytes_ff(yh.data(), n * sizeof(bf16)));
  CHECK(gpu_test::all_bytes_ff(rh.data(), rows * sizeof(float)));
  CHECK(gpu_test::all_bytes_ff(dxh.data(), n * sizeof(bf16)));
  CHECK(gpu_test::all_bytes_ff(dwh.data(), cols * sizeof(bf16)));
}
