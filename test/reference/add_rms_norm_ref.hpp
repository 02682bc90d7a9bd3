// Double-precision reference for the fused residual add + RMSNorm: the sum rounded to T as the
// framework's add stores it, then RMSNorm's reference (rms_norm_ref.hpp) on that sum. The backward
// adds the incoming gradient of the sum to RMSNorm's dx, exactly (one rounding, by the caller).
#pragma once

#include <cstdint>
#include <vector>

#include "rms_norm_ref.hpp"

namespace tigon_ref {

struct AddRmsNormFwdOut {
  std::vector<double> sum;  // s = T(x + residual): already a value of T
  RmsNormFwdOut norm;       // y (before its rounding to T) and rstd, of s
};

// x, residual: rows x cols values (as stored in T). For half and bfloat16 the double sum of two
// stored values is exact, so rounding it to T via float is the framework's fp32 add rounded to T;
// for float, rounding the exact sum to float is the fp32 add.
template <class T>
AddRmsNormFwdOut add_rms_norm_forward(const std::vector<double>& x, const std::vector<double>& residual,
                                      const std::vector<double>& w, std::int64_t rows,
                                      std::int64_t cols, double eps, double offset,
                                      tigon::RmsNormCasting mode) {
  AddRmsNormFwdOut out;
  out.sum.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out.sum[i] = round_t<T>(x[i] + residual[i]);
  out.norm = rms_norm_forward<T>(out.sum, w, rows, cols, eps, offset, mode);
  return out;
}

// dsum: the gradient of s from its other uses (empty: zero). dx is the total gradient of s, which
// is the gradient of x and of the residual alike.
template <class T>
RmsNormBwdOut add_rms_norm_backward(const std::vector<double>& dy, const std::vector<double>& dsum,
                                    const std::vector<double>& sum, const std::vector<double>& w,
                                    std::int64_t rows, std::int64_t cols, double eps, double offset,
                                    tigon::RmsNormCasting mode) {
  RmsNormBwdOut out = rms_norm_backward<T>(dy, sum, w, rows, cols, eps, offset, mode);
  if (!dsum.empty()) {
    for (std::size_t i = 0; i < out.dx.size(); ++i) out.dx[i] += dsum[i];
  }
  return out;
}

}  // namespace tigon_ref
