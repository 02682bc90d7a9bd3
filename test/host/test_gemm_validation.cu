// The GEMM back end without a GPU: a cuBLAS failure reads by its status name; the bias is checked.
#include <catch2/catch.hpp>

#include <string>

#include <tigon/blas/gemm.cuh>

using namespace tigon;

TEST_CASE("gemm: a cuBLAS status reads by its name and number", "[gemm][validation]") {
  CHECK(detail::from_cublas(CUBLAS_STATUS_SUCCESS, "gemm", "cublasLtMatmul").ok());
  const Status s = detail::from_cublas(CUBLAS_STATUS_NOT_SUPPORTED, "gemm", "cublasLtMatmul");
  CHECK(s.code() == Errc::cuda_error);
  CHECK(s.message() == "tigon::gemm: CUDA error: cublasLtMatmul: cuBLAS status CUBLAS_STATUS_NOT_SUPPORTED (15)");
  CHECK(std::string(detail::cublas_status_name(CUBLAS_STATUS_EXECUTION_FAILED)) == "CUBLAS_STATUS_EXECUTION_FAILED");
}

TEST_CASE("gemm: a bias must be 16-byte aligned and apart from D", "[gemm][validation]") {
  alignas(16) static bf16 a[64], b[64], d[64], bias[16];
  GemmArgs<bf16> g{.a = a, .b = b, .d = d, .bias = bias, .m = 8, .n = 8, .k = 8};
  CHECK(detail::validate(g, "gemm").ok());
  auto bad = g;
  bad.bias = bias + 1;
  const Status s = detail::validate(bad, "gemm");
  CHECK(s.code() == Errc::invalid_value);
  CHECK(std::string(s.argument()) == "bias");
  bad = g;
  bad.bias = d + 8;  // D's second row
  CHECK(detail::validate(bad, "gemm").code() == Errc::aliasing);
}
