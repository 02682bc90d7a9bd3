// Double-precision reference for LayerNorm: plain loops, no cleverness. Statistics, normalisation
// and gradients are exact to double precision; the output's one rounding to T is applied by the
// caller (tigon_ref::round_t), as torch.nn.functional.layer_norm rounds once.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tigon_ref {

struct LayerNormFwdOut {
  std::vector<double> y;     // before the rounding to T
  std::vector<double> mean;  // per row
  std::vector<double> rstd;  // per row: 1 / sqrt(biased variance + eps)
};

inline void layer_norm_stats(const std::vector<double>& x, std::int64_t r, std::int64_t cols,
                             double eps, double& mean, double& rstd) {
  double s = 0;
  for (std::int64_t c = 0; c < cols; ++c) s += x[r * cols + c];
  mean = s / static_cast<double>(cols);
  double sq = 0;
  for (std::int64_t c = 0; c < cols; ++c) {
    const double d = x[r * cols + c] - mean;
    sq += d * d;
  }
  rstd = 1.0 / std::sqrt(sq / static_cast<double>(cols) + eps);
}

// x: rows x cols values (as stored in T); w, b: cols values (as stored in W) or empty.
inline LayerNormFwdOut layer_norm_forward(const std::vector<double>& x, const std::vector<double>& w,
                                          const std::vector<double>& b, std::int64_t rows,
                                          std::int64_t cols, double eps) {
  LayerNormFwdOut out;
  out.y.resize(static_cast<std::size_t>(rows * cols));
  out.mean.resize(static_cast<std::size_t>(rows));
  out.rstd.resize(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, rstd = 0;
    layer_norm_stats(x, r, cols, eps, mean, rstd);
    out.mean[r] = mean;
    out.rstd[r] = rstd;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double xhat = (x[r * cols + c] - mean) * rstd;
      out.y[r * cols + c] = xhat * (w.empty() ? 1.0 : w[c]) + (b.empty() ? 0.0 : b[c]);
    }
  }
  return out;
}

struct LayerNormBwdOut {
  std::vector<double> dx;
  std::vector<double> dw;  // sum over rows of dy * xhat
  std::vector<double> db;  // sum over rows of dy
};

// The gradient of sum(dy * y) with respect to x, w and b.
inline LayerNormBwdOut layer_norm_backward(const std::vector<double>& dy, const std::vector<double>& x,
                                           const std::vector<double>& w, std::int64_t rows,
                                           std::int64_t cols, double eps) {
  LayerNormBwdOut out;
  out.dx.resize(static_cast<std::size_t>(rows * cols));
  out.dw.assign(static_cast<std::size_t>(cols), 0.0);
  out.db.assign(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, rstd = 0;
    layer_norm_stats(x, r, cols, eps, mean, rstd);
    double sum_g = 0, sum_g_xhat = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double g = dy[r * cols + c] * (w.empty() ? 1.0 : w[c]);
      sum_g += g;
      sum_g_xhat += g * (x[r * cols + c] - mean) * rstd;
    }
    const double mean_g = sum_g / static_cast<double>(cols);
    const double mean_g_xhat = sum_g_xhat / static_cast<double>(cols);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double xhat = (x[r * cols + c] - mean) * rstd;
      const double g = dy[r * cols + c] * (w.empty() ? 1.0 : w[c]);
      out.dx[r * cols + c] = rstd * (g - mean_g - xhat * mean_g_xhat);
      out.dw[c] += dy[r * cols + c] * xhat;
      out.db[c] += dy[r * cols + c];
    }
  }
  return out;
}

}  // namespace tigon_ref
