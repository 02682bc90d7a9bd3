// Double-precision reference for cross-entropy, as PyTorch defines it (F.cross_entropy with
// weight, ignore_index, label_smoothing and reduction), plus a z-loss term (scale * lse^2 per row;
// the mean divides it by the number of non-ignored rows, unweighted, as Liger-Kernel does) and a
// logit softcap (c * tanh(x / c)), and token scaling (Liger-Kernel's use_token_scaling: each row
// times its detached probability of the target). The gradient is the analytic one; the host tests check it
// against finite differences of this same reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tigon_ref {

struct CeOptions {
  std::int64_t ignore_index = -100;
  double eps = 0, z = 0, cap = 0;
  int reduction = 2;  // 0 none, 1 sum, 2 mean
  bool token_scaling = false;  // each row's loss, z term and gradient times its p_t (a constant)
  double grad_scale = 1;
  std::vector<double> grad_output;  // empty: 1; one value (mean / sum) or one per row (none)
  std::vector<double> weights;      // empty: no class weights
};

struct CeOut {
  std::vector<double> loss_rows, z_rows, lse, grad;
  std::vector<std::int64_t> argmax;
  double loss = 0, z_loss = 0, denom = 0, count = 0;  // the mean's weight sum and row count
  int errors = 0;
};

inline CeOut cross_entropy(const std::vector<double>& logits, const std::vector<std::int64_t>& targets,
                           std::int64_t rows, std::int64_t V, const CeOptions& o, bool want_grad) {
  CeOut r;
  r.loss_rows.assign(rows, 0);
  r.z_rows.assign(rows, 0);
  r.lse.assign(rows, 0);
  r.argmax.assign(rows, 0);
  if (want_grad) r.grad.assign(static_cast<std::size_t>(rows * V), 0);
  auto w = [&](std::int64_t i) { return o.weights.empty() ? 1.0 : o.weights[i]; };
  for (std::int64_t n = 0; n < rows; ++n) {
    const std::int64_t t = targets[n];
    if (t == o.ignore_index) continue;
    r.denom += (t >= 0 && t < V) ? w(t) : 1.0;
    r.count += 1;
  }
  std::vector<double> x(V);
  for (std::int64_t n = 0; n < rows; ++n) {
    double m = -INFINITY;
    for (std::int64_t i = 0; i < V; ++i) {
      const double raw = logits[n * V + i];
      x[i] = o.cap > 0 ? o.cap * std::tanh(raw / o.cap) : raw;
      if (x[i] > m) {
        m = x[i];
        r.argmax[n] = i;
      }
    }
    double s = 0, sw = 0, swx = 0;
    for (std::int64_t i = 0; i < V; ++i) {
      s += std::exp(x[i] - m);
      sw += w(i);
      swx += w(i) * x[i];
    }
    const double lse = m + std::log(s);
    r.lse[n] = lse;
    const std::int64_t t = targets[n];
    if (t == o.ignore_index) continue;
    if (t < 0 || t >= V) {
      r.loss_rows[n] = std::numeric_limits<double>::quiet_NaN();
      ++r.errors;
      continue;
    }
    const double f = o.token_scaling ? std::exp(x[t] - lse) : 1.0;
    const double zl = o.z * lse * lse * f;
    r.z_rows[n] = zl;
    r.loss_rows[n] = ((1 - o.eps) * w(t) * (lse - x[t]) + o.eps / V * (lse * sw - swx)) * f + zl;
    if (!want_grad) continue;
    double up = o.grad_output.empty() ? 1.0 : o.grad_output[o.reduction == 0 ? n : 0];
    up *= o.grad_scale * f;
    const double up_z = o.reduction == 2 ? up / r.count : up;
    // A weighted mean over targets of weight 0 in all: the cross-entropy part is 0, as is its gradient.
    if (o.reduction == 2) up = r.denom != 0 ? up / r.denom : 0.0;
    for (std::int64_t i = 0; i < V; ++i) {
      const double p = std::exp(x[i] - lse);
      double g = ((1 - o.eps) * w(t) * (p - (i == t ? 1.0 : 0.0)) + o.eps / V * (p * sw - w(i))) * up +
                 2 * o.z * lse * p * up_z;
      if (o.cap > 0) g *= 1 - (x[i] / o.cap) * (x[i] / o.cap);
      r.grad[n * V + i] = g;
    }
  }
  double sl = 0, sz = 0;
  for (std::int64_t n = 0; n < rows; ++n) {
    sl += r.loss_rows[n];
    sz += r.z_rows[n];
  }
  if (o.reduction == 2) {
    r.z_loss = r.count > 0 ? sz / r.count : 0;
    r.loss = (r.denom > 0 ? (sl - sz) / r.denom : 0) + r.z_loss;
  } else {
    r.loss = sl;
    r.z_loss = sz;
  }
  return r;
}

}  // namespace tigon_ref
