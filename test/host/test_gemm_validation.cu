// The GEMM back end without a GPU: a cuBLAS failure reads by its status name; the bias is checked.
#include <catch2/catch.hpp>

#include <string>

#include <tigon/blas/gemm.cuh>

#include "alias_matrix.hpp"

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

TEST_CASE("gemm: the generated aliasing matrix", "[gemm][validation]") {
  // D = A B^T + C + bias, 16 x 24 over k 32, bf16: D may be C itself (accumulation in place) and
  // overlap nothing else.
  tigon_test::alias_matrix<GemmArgs<bf16>>(
      {{"a", false, 16 * 32 * 2}, {"b", false, 24 * 32 * 2}, {"c", false, 16 * 24 * 2}, {"bias", false, 24 * 2},
       {"d", true, 16 * 24 * 2}},
      {{4, 2}},
      [](GemmArgs<bf16>& g, int k, bf16* p) {
        g.m = 16, g.n = 24, g.k = 32, g.op_b = Op::t, g.beta = 1.0f;
        if (k == 0) g.a = p;
        if (k == 1) g.b = p;
        if (k == 2) g.c = p;
        if (k == 3) g.bias = p;
        if (k == 4) g.d = p;
      },
      [](const GemmArgs<bf16>& g) { return detail::validate(g, "gemm"); });
}
