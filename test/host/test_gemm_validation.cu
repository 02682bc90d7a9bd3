// The GEMM back end's statuses, without a GPU: a cuBLAS failure reads by its status name.
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
