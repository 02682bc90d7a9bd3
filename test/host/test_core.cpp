// Host tests of the core: status messages, dtype conversions, integer helpers, the dispatch table.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include <tigon/core/dispatch.hpp>
#include <tigon/core/dtype.hpp>
#include <tigon/core/math.hpp>
#include <tigon/core/status.hpp>
#include <tigon/core/validate.hpp>

using namespace tigon;

TEST_CASE("status: success and readable errors", "[core][status]") {
  const Status ok;
  CHECK(ok.ok());
  CHECK(static_cast<bool>(ok));
  CHECK(ok.message() == "success");

  const Status e = Status::error(Errc::invalid_stride, "rms_norm_forward", "x_stride",
                                 "row stride 100 is smaller than the row (4096)");
  CHECK_FALSE(e.ok());
  CHECK(e.code() == Errc::invalid_stride);
  CHECK(std::string(e.argument()) == "x_stride");
  CHECK(e.message() ==
        "tigon::rms_norm_forward: invalid stride: argument 'x_stride': row stride 100 is smaller "
        "than the row (4096)");

  const Status c = Status::from_cuda(cudaErrorInvalidValue, "rms_norm_forward", "kernel launch");
  CHECK(c.code() == Errc::cuda_error);
  CHECK(c.cuda() == cudaErrorInvalidValue);
  CHECK(c.message().find("cudaErrorInvalidValue") != std::string::npos);
  CHECK(Status::from_cuda(cudaSuccess, "x", "y").ok());

  // A library's own failure (cuBLAS) is a cuda_error without a CUDA runtime error: the message
  // does not append the runtime's "cudaSuccess (no error)".
  const Status lib = Status::error(Errc::cuda_error, "gemm", "", "cublasLtMatmul: cuBLAS status 15");
  CHECK(lib.message() == "tigon::gemm: CUDA error: cublasLtMatmul: cuBLAS status 15");
}

TEST_CASE("dtype: names, sizes, round-to-nearest-even conversions", "[core][dtype]") {
  CHECK(std::string(dtype_traits<bf16>::name) == "bfloat16");
  CHECK(dtype_traits<half>::id == DType::f16);
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(std::string(dtype_name(DType::bf16)) == "bfloat16");
  CHECK(std::string(errc_name(Errc::aliasing)) == "aliasing");
  CHECK(kVecElems<bf16> == 8);
  CHECK(kVecElems<float> == 4);
  // bf16 has 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> even (1).
  CHECK(round_to<bf16>(1.0f + 0x1p-8f) == 1.0f);
  CHECK(round_to<bf16>(1.0f + 0x1p-8f + 0x1p-12f) == 1.0f + 0x1p-7f);
  // half has 11: 1 + 2^-11 ties to 1; 1 + 3*2^-11 ties to 1 + 2^-9 (even).
  CHECK(round_to<half>(1.0f + 0x1p-11f) == 1.0f);
  CHECK(round_to<half>(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);
  CHECK(round_to<float>(1.0f + 0x1p-20f) == 1.0f + 0x1p-20f);
  CHECK(std::isnan(to_float(from_float<bf16>(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(round_to<half>(1e6f)));
}

TEST_CASE("math helpers", "[core][math]") {
  STATIC_REQUIRE(ceil_div(10, 4) == 3);
  STATIC_REQUIRE(round_up(10, 4) == 12);
  STATIC_REQUIRE(next_pow2(33) == 64);
  STATIC_REQUIRE(pow2_divisor(4096, 8) == 8);
  STATIC_REQUIRE(pow2_divisor(4100, 8) == 4);
  STATIC_REQUIRE(pow2_divisor(123, 8) == 1);
  CHECK(std::abs(rsqrt_f32(4.0f) - 0.5f) < 1e-7f);
}

TEST_CASE("dispatch: listed sizes reach their instance, others the fallback", "[core][dispatch]") {
  using L = IntList<1024, 4096>;
  auto f = [](std::int64_t n) {
    return dispatch_int(L{}, n, [](auto k) { return static_cast<int>(decltype(k)::value); },
                        [] { return -1; });
  };
  CHECK(f(1024) == 1024);
  CHECK(f(4096) == 4096);
  CHECK(f(4095) == -1);
  CHECK(f(0) == -1);
  CHECK(dispatch_int(IntList<>{}, 7, [](auto) { return 1; }, [] { return 2; }) == 2);
  // The default list holds the hidden sizes the issue names.
  for (int n : {1024, 2048, 2560, 3072, 4096, 5120, 7168, 8192}) CHECK(HiddenSizes::contains(n));
  CHECK_FALSE(HiddenSizes::contains(4095));
}

TEST_CASE("validate: strides, aliasing, workspace", "[core][validate]") {
  CHECK(check::row_stride(0, 10, "op", "s").ok());
  CHECK(check::row_stride(10, 10, "op", "s").ok());
  CHECK(check::row_stride(9, 10, "op", "s").code() == Errc::invalid_stride);
  CHECK(check::row_stride(-1, 10, "op", "s").code() == Errc::invalid_stride);
  alignas(16) static char buf[4096];
  const MatrixView a{buf, 4, 16, 0, 2};
  const MatrixView same{buf, 4, 16, 0, 2};
  const MatrixView shifted{buf + 2, 4, 16, 0, 2};
  const MatrixView after{buf + 128, 4, 16, 0, 2};
  const MatrixView strided{buf, 4, 16, 32, 2};
  CHECK(check::same_or_disjoint(a, same, "op", "y", "x").ok());
  CHECK(check::same_or_disjoint(a, after, "op", "y", "x").ok());
  CHECK(check::same_or_disjoint(a, shifted, "op", "y", "x").code() == Errc::aliasing);
  CHECK(check::same_or_disjoint(a, strided, "op", "y", "x").code() == Errc::aliasing);
  CHECK(check::disjoint(a, same, "op", "y", "x").code() == Errc::aliasing);
  // Interleaved halves of one buffer (a fused gate||up layout) share no element.
  const MatrixView gate{buf, 4, 16, 32, 2}, up{buf + 32, 4, 16, 32, 2}, up_shift{buf + 30, 4, 16, 32, 2};
  CHECK(check::interleaved_disjoint(gate, up));
  CHECK_FALSE(check::overlap(gate, up));
  CHECK(check::disjoint(gate, up, "op", "a", "b").ok());
  CHECK(check::overlap(gate, up_shift));
  CHECK(check::disjoint(gate, up_shift, "op", "a", "b").code() == Errc::aliasing);
  CHECK(MatrixView::of(reinterpret_cast<const float*>(buf), 2, 3).elem_bytes == 4);
  // Extents past a 64-bit byte offset or the end of the address space are rejected, never wrapped.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  CHECK(check::extent(a, "op", "x").ok());
  CHECK(check::extent(MatrixView{buf, std::int64_t{1} << 31, std::int64_t{1} << 30, 0, 2}, "op", "x").ok());
  CHECK(check::extent(MatrixView{buf, std::int64_t{1} << 31, std::int64_t{1} << 31, 0, 2}, "op", "x").code() ==
        Errc::invalid_size);  // 2^63 bytes
  CHECK(check::extent(MatrixView{buf, std::int64_t{1} << 32, 16, std::int64_t{1} << 32, 2}, "op", "x").code() ==
        Errc::invalid_size);  // 2^64 elements
  CHECK(check::extent(MatrixView{buf, 2, 16, kMax - 8, 2}, "op", "x").code() == Errc::invalid_size);
  CHECK(check::extent(MatrixView{buf, 1, kMax / 2 + 1, 0, 2}, "op", "x").code() == Errc::invalid_size);
  const auto* top = reinterpret_cast<const char*>(std::numeric_limits<std::uintptr_t>::max() - 255);
  CHECK(check::extent(MatrixView{top, 1, 127, 0, 2}, "op", "x").ok());  // its end still an address
  CHECK(check::extent(MatrixView{top, 1, 128, 0, 2}, "op", "x").code() == Errc::invalid_size);
  CHECK(check::disjoint(MatrixView{buf, 2, 16, kMax - 8, 2}, a, "op", "y", "x").code() == Errc::invalid_size);
  CHECK(check::same_or_disjoint(a, MatrixView{buf, 2, 16, kMax - 8, 2}, "op", "y", "x").code() == Errc::invalid_size);
  CHECK(check::finite(1.0f, "op", "v").ok());
  CHECK(check::finite(std::numeric_limits<float>::infinity(), "op", "v").code() == Errc::invalid_value);
  CHECK(check::finite(std::numeric_limits<float>::quiet_NaN(), "op", "v").code() == Errc::invalid_value);
  CHECK(check::workspace(nullptr, 0, 0, "op").ok());
  CHECK(check::workspace(nullptr, 0, 16, "op").code() == Errc::null_pointer);
  CHECK(check::workspace(buf, 8, 16, "op").code() == Errc::workspace_too_small);
  CHECK(check::workspace(buf + 4, 64, 16, "op").code() == Errc::invalid_value);
  CHECK(check::workspace(buf, 16, 16, "op").ok());
}
