// Double-precision reference for RMSNorm: plain loops, no cleverness. The roundings that a casting
// mode makes to the input dtype T are applied to the double values (via float), as Hugging Face's
// modules make them; everything else is exact to double precision.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <tigon/core/dtype.hpp>
#include <tigon/norm/rms_norm.cuh>

namespace tigon_ref {

template <class T>
double round_t(double v) {
  return static_cast<double>(tigon::round_to<T>(static_cast<float>(v)));
}

struct RmsNormFwdOut {
  std::vector<double> y;     // before the final rounding to T
  std::vector<double> rstd;  // per row
};

// x: rows x cols values (as stored in T); w: cols values (as stored in W) or empty.
template <class T>
RmsNormFwdOut rms_norm_forward(const std::vector<double>& x, const std::vector<double>& w,
                               std::int64_t rows, std::int64_t cols, double eps, double offset,
                               tigon::RmsNormCasting mode) {
  RmsNormFwdOut out;
  out.y.resize(static_cast<std::size_t>(rows * cols));
  out.rstd.resize(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(cols) + eps);
    out.rstd[r] = rstd;
    const double re = mode == tigon::RmsNormCasting::none ? round_t<T>(rstd) : rstd;
    for (std::int64_t c = 0; c < cols; ++c) {
      double n = x[r * cols + c] * re;
      if (mode != tigon::RmsNormCasting::gemma) n = round_t<T>(n);
      double s = 1.0;
      if (!w.empty()) {
        s = offset + w[c];
        if (mode == tigon::RmsNormCasting::none) s = round_t<T>(s);
      }
      out.y[r * cols + c] = n * s;
    }
  }
  return out;
}

struct RmsNormBwdOut {
  std::vector<double> dx;
  std::vector<double> dw;  // empty without a weight
};

template <class T>
RmsNormBwdOut rms_norm_backward(const std::vector<double>& dy, const std::vector<double>& x,
                                const std::vector<double>& w, std::int64_t rows, std::int64_t cols,
                                double eps, double offset, tigon::RmsNormCasting mode) {
  RmsNormBwdOut out;
  out.dx.resize(static_cast<std::size_t>(rows * cols));
  if (!w.empty()) out.dw.assign(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(cols) + eps);
    double dot = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double dn = dy[r * cols + c] * (w.empty() ? 1.0 : offset + w[c]);
      dot += dn * x[r * cols + c] * rstd;
    }
    const double mean = dot / static_cast<double>(cols);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double xhat = x[r * cols + c] * rstd;
      const double dn = dy[r * cols + c] * (w.empty() ? 1.0 : offset + w[c]);
      out.dx[r * cols + c] = rstd * (dn - xhat * mean);
      if (!w.empty()) {
        const double n = mode == tigon::RmsNormCasting::gemma ? xhat : round_t<T>(xhat);
        out.dw[c] += dy[r * cols + c] * n;
      }
    }
  }
  return out;
}

}  // namespace tigon_ref
