// GEMM back ends for the host validation tests of the composite ops: nothing runs on a device.
#pragma once

#include <cstdint>

#include <tigon/blas/gemm.cuh>

namespace tigon_test {

// Counts the products it is asked to run (and has no check(): a back end as written before
// GemmArgs::bias).
struct CountingGemm {
  int calls = 0;
  template <class A, class B>
  tigon::Status gemm(const tigon::GemmArgs<A, B>&, cudaStream_t) {
    ++calls;
    return tigon::Status();
  }
};

// Cannot run products with m == reject_m: its check() says so; gemm() counts the products it was
// asked to run.
struct RejectingGemm {
  std::int64_t reject_m = 0;
  int calls = 0, checks = 0;
  template <class A, class B>
  tigon::Status check(const tigon::GemmArgs<A, B>& g) {
    ++checks;
    if (g.m == reject_m) {
      return tigon::Status::error(tigon::Errc::unsupported, "gemm", "", "no algorithm for this shape");
    }
    return tigon::Status();
  }
  template <class A, class B>
  tigon::Status gemm(const tigon::GemmArgs<A, B>&, cudaStream_t) {
    ++calls;
    return tigon::Status();
  }
};

}  // namespace tigon_test
