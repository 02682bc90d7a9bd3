// Double-precision reference for the gated activations: plain loops, no cleverness. The activations
// are written out in double from their definitions (not through tigon's functors):
//   c  = down * act(gate * a) * b
//   da = dc * b * down * gate * act'(gate * a),   db = dc * down * act(gate * a)
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tigon_ref {

// The built-in activations in double, named as in tigon/activation/activations.hpp.
enum class GatedAct { silu, gelu_tanh, gelu_erf };

inline constexpr double kPi = 3.14159265358979323846;

inline double act_value(GatedAct k, double x) {
  switch (k) {
    case GatedAct::silu: return x / (1.0 + std::exp(-x));
    case GatedAct::gelu_tanh: {
      const double beta = std::sqrt(2.0 / kPi);
      return 0.5 * x * (1.0 + std::tanh(beta * (x + 0.044715 * x * x * x)));
    }
    case GatedAct::gelu_erf: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  }
  return NAN;
}

inline double act_derivative(GatedAct k, double x) {
  switch (k) {
    case GatedAct::silu: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      return s + x * s * (1.0 - s);
    }
    case GatedAct::gelu_tanh: {
      const double beta = std::sqrt(2.0 / kPi);
      const double t = std::tanh(beta * (x + 0.044715 * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * beta * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case GatedAct::gelu_erf:
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) +
             x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi);
  }
  return NAN;
}

// Dense [rows, cols] inputs (the values as stored in T); outputs before their rounding to T.
// `value(x)` and `derivative(x)` are any callables in double (a user activation's definition);
// `round(x)` the rounding of an intermediate to the module's dtype (act(gate * a) in the forward,
// and it and dc * down * b in the backward), the identity for fp32.
inline double no_round(double x) { return x; }

template <class Value, class Round = double (*)(double)>
std::vector<double> gated_forward(const std::vector<double>& a, const std::vector<double>& b,
                                  std::int64_t rows, std::int64_t cols, double gate, double down,
                                  Value&& value, Round&& round = no_round) {
  std::vector<double> c(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows * cols; ++i) c[i] = down * round(value(gate * a[i])) * b[i];
  return c;
}

struct GatedBwdOut {
  std::vector<double> da, db;
};

template <class Value, class Derivative, class Round = double (*)(double)>
GatedBwdOut gated_backward(const std::vector<double>& dc, const std::vector<double>& a,
                           const std::vector<double>& b, std::int64_t rows, std::int64_t cols,
                           double gate, double down, Value&& value, Derivative&& derivative,
                           Round&& round = no_round) {
  GatedBwdOut out;
  out.da.resize(static_cast<std::size_t>(rows * cols));
  out.db.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const double x = gate * a[i];
    out.da[i] = round(dc[i] * down * b[i]) * gate * derivative(x);
    out.db[i] = dc[i] * down * round(value(x));
  }
  return out;
}

inline std::vector<double> gated_forward(const std::vector<double>& a, const std::vector<double>& b,
                                         std::int64_t rows, std::int64_t cols, double gate,
                                         double down, GatedAct k) {
  return gated_forward(a, b, rows, cols, gate, down, [k](double x) { return act_value(k, x); });
}

inline GatedBwdOut gated_backward(const std::vector<double>& dc, const std::vector<double>& a,
                                  const std::vector<double>& b, std::int64_t rows,
                                  std::int64_t cols, double gate, double down, GatedAct k) {
  return gated_backward(dc, a, b, rows, cols, gate, down,
                        [k](double x) { return act_value(k, x); },
                        [k](double x) { return act_derivative(k, x); });
}

}  // namespace tigon_ref
