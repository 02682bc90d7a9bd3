// Double-precision reference for the distillation divergences, from their definitions (Liger-Kernel
// 0.8.2's JSD, KLDiv and TVD, and PyTorch's F.kl_div): per element in double, each side taken
// from the form it is given in (log-probs, probs, or logits through a log-softmax of v / T), the
// rows' sums, the reduction, and the analytic gradient with respect to the student's values (through
// the softmax for logits). An element whose weighting probability is 0 contributes 0. The host
// tests check the gradient against finite differences of this same reference's loss.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tigon_ref {

enum class Div { forward_kl, reverse_kl, jsd, kldiv, tvd };
enum class Form { log_probs = 0, probs = 1, logits = 2 };  // tigon::DivergenceInput's order
// tigon::DivergenceReduction's order.
enum class Red { none = 0, sum = 1, mean = 2, batchmean = 3 };

struct DivOptions {
  Div div = Div::forward_kl;
  double beta = 0.5;   // jsd
  double eps = 1e-10;  // kldiv with a probability target
  Form student = Form::log_probs, teacher = Form::log_probs;
  double temperature = 1;
  Red reduction = Red::batchmean;
  std::vector<std::int64_t> labels;  // empty: no labels
  std::int64_t ignore_index = -100;
  double grad_scale = 1;
  // empty: 1; else one value (batchmean / sum / mean), or under none one per row (forward_kl,
  // reverse_kl, jsd) or one per element [rows, V] (kldiv, tvd).
  std::vector<double> grad_output;
};

inline bool elementwise_none(Div d) { return d == Div::kldiv || d == Div::tvd; }

struct DivOut {
  double loss = 0, denom = 0;
  std::vector<double> loss_rows, loss_elems, grad;  // [rows], [rows, V], [rows, V]
  // The fp32 rounding scale of each element's loss (q (1 + |log q|) + p (1 + |log p|): its terms
  // may cancel), and each row's sum of them.
  std::vector<double> elem_scale, scale_rows;
  std::vector<char> near_tie;     // tvd: elements whose q and p agree to 1e-5 (their sign is ambiguous in fp32)
  std::vector<double> tie_gap;    // tvd: |q - p| / (|q| + |p|) of each element
  // tvd, student logits: how far each gradient element may move when the near ties of its row take
  // the other sign: a tie i flips g_i = q_i s_i by q_i, so the row sum S moves by up to the ties'
  // mass A, and element j by |f| / T (q_j A, plus q_j itself where j is a tie).
  std::vector<double> tie_slack;
};

struct ElemValue {
  double loss, grad;  // grad: d loss / d log q, or d loss / d q for tvd
};

// One element from q's and p's log and probability.
inline ElemValue element(const DivOptions& o, double xl, double xp, double yl, double yp) {
  switch (o.div) {
    case Div::forward_kl:
      return {yp != 0 ? yp * (yl - xl) : 0.0, -yp};
    case Div::reverse_kl:
      if (xp == 0) return {0, 0};
      return {xp * (xl - yl), xp * (xl - yl) + xp};
    case Div::jsd: {
      if (o.beta == 0) return {yp != 0 ? yp * (yl - xl) : 0.0, -yp};
      if (o.beta == 1) return xp == 0 ? ElemValue{0, 0} : ElemValue{xp * (xl - yl), xp * (xl - yl) + xp};
      const double bp = o.beta * yp, bq = (1 - o.beta) * xp, m = bp + bq;
      if (m == 0) return {0, 0};
      const double lm = std::log(m);
      return {(bp != 0 ? bp * yl : 0.0) + (bq != 0 ? bq * xl : 0.0) - m * lm, bq != 0 ? bq * (xl - lm) : 0.0};
    }
    case Div::kldiv:
      if (o.teacher == Form::probs) return {yp != 0 ? yp * (std::log(std::max(yp, o.eps)) - xl) : 0.0, -yp};
      return {yp != 0 ? yp * (yl - xl) : 0.0, -yp};
    case Div::tvd:
      return {0.5 * std::abs(xp - yp), xp > yp ? 0.5 : -0.5};
  }
  return {0, 0};
}

// A row's log-probabilities and probabilities from its values in form f.
inline void forms(Form f, const double* v, std::int64_t V, double T, std::vector<double>& lg, std::vector<double>& pr) {
  lg.resize(V);
  pr.resize(V);
  if (f == Form::logits) {
    double m = -INFINITY;
    for (std::int64_t i = 0; i < V; ++i) m = std::max(m, v[i] / T);
    double s = 0;
    for (std::int64_t i = 0; i < V; ++i) s += std::exp(v[i] / T - m);
    const double lse = m + std::log(s);
    for (std::int64_t i = 0; i < V; ++i) {
      lg[i] = v[i] / T - lse;
      pr[i] = std::exp(lg[i]);
    }
  } else if (f == Form::log_probs) {
    for (std::int64_t i = 0; i < V; ++i) {
      lg[i] = v[i];
      pr[i] = std::exp(v[i]);
    }
  } else {
    for (std::int64_t i = 0; i < V; ++i) {
      pr[i] = v[i];
      lg[i] = std::log(v[i]);
    }
  }
}

// x: the student's values [rows, V], y: the teacher's, both dense.
inline DivOut divergence(const std::vector<double>& x, const std::vector<double>& y, std::int64_t rows,
                         std::int64_t V, const DivOptions& o, bool want_grad) {
  DivOut r;
  r.loss_rows.assign(rows, 0);
  r.scale_rows.assign(rows, 0);
  r.elem_scale.assign(static_cast<std::size_t>(rows * V), 0);
  r.loss_elems.assign(static_cast<std::size_t>(rows * V), 0);
  r.near_tie.assign(static_cast<std::size_t>(rows * V), 0);
  r.tie_gap.assign(static_cast<std::size_t>(rows * V), 1.0);
  r.tie_slack.assign(static_cast<std::size_t>(rows * V), 0.0);
  if (want_grad) r.grad.assign(static_cast<std::size_t>(rows * V), 0);
  auto ignored = [&](std::int64_t n) { return !o.labels.empty() && o.labels[n] == o.ignore_index; };
  double count = 0;
  for (std::int64_t n = 0; n < rows; ++n) count += ignored(n) ? 0 : 1;
  switch (o.reduction) {
    case Red::batchmean: r.denom = count; break;
    case Red::mean: r.denom = count * static_cast<double>(V); break;
    default: r.denom = 1; break;
  }
  const bool none = o.reduction == Red::none;
  const bool elems_go = none && elementwise_none(o.div) && !o.grad_output.empty();
  std::vector<double> xl, xp, yl, yp, g(V);
  for (std::int64_t n = 0; n < rows; ++n) {
    if (ignored(n)) continue;
    forms(o.student, &x[n * V], V, o.temperature, xl, xp);
    forms(o.teacher, &y[n * V], V, o.temperature, yl, yp);
    double row = 0, scale_row = 0;
    for (std::int64_t i = 0; i < V; ++i) {
      ElemValue e = element(o, xl[i], xp[i], yl[i], yp[i]);
      if (o.div == Div::tvd) {
        if (o.student != Form::probs) e.grad *= xp[i];  // d / d log q
        r.tie_gap[n * V + i] = std::abs(xp[i] - yp[i]) / std::max(std::abs(xp[i]) + std::abs(yp[i]), 1e-300);
        r.near_tie[n * V + i] = r.tie_gap[n * V + i] <= 1e-5;
      }
      r.loss_elems[n * V + i] = e.loss;
      row += e.loss;
      auto term = [](double lg, double pr) { return pr == 0 ? 0.0 : pr * (1 + std::abs(lg)); };
      r.elem_scale[n * V + i] = term(xl[i], xp[i]) + term(yl[i], yp[i]) + std::abs(e.loss);
      scale_row += r.elem_scale[n * V + i];
      g[i] = e.grad;
    }
    r.loss_rows[n] = row;
    r.scale_rows[n] = scale_row;
    if (!want_grad || r.denom == 0) continue;
    double up = 1;
    if (!o.grad_output.empty() && !elems_go) up = o.grad_output[none ? n : 0];
    const double f = o.grad_scale * up / r.denom;
    auto w = [&](std::int64_t i) { return elems_go ? o.grad_output[n * V + i] : 1.0; };
    if (o.student == Form::logits) {
      double s = 0;
      for (std::int64_t i = 0; i < V; ++i) s += w(i) * g[i];
      for (std::int64_t i = 0; i < V; ++i) r.grad[n * V + i] = f / o.temperature * (w(i) * g[i] - xp[i] * s);
      if (o.div == Div::tvd) {
        double tied = 0;
        for (std::int64_t i = 0; i < V; ++i) tied += r.near_tie[n * V + i] ? w(i) * xp[i] : 0.0;
        for (std::int64_t i = 0; i < V; ++i) {
          const double own = r.near_tie[n * V + i] ? w(i) * xp[i] : 0.0;
          r.tie_slack[n * V + i] = std::abs(f) / o.temperature * (xp[i] * tied + own);
        }
      }
    } else {
      for (std::int64_t i = 0; i < V; ++i) r.grad[n * V + i] = f * w(i) * g[i];
    }
  }
  double total = 0;
  for (double v : r.loss_rows) total += v;
  r.loss = r.denom == 0 ? 0 : total / r.denom;
  return r;
}

}  // namespace tigon_ref
