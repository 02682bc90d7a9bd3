// tigon/activation/activations.hpp - activation functors of the gated ops (SwiGLU, GeGLU) and of
// the ungated activation op (squared ReLU, GELU), usable on host and device.
//
// An activation is a struct with two static functions of one fp32 value:
//
//   struct MyAct {
//     static TIGON_HD float value(float a);       // act(a)
//     static TIGON_HD float derivative(float a);  // d act / da
//   };
//
// (in a .cu file, `__host__ __device__` in place of TIGON_HD). Any such struct works as the
// template argument of gated_forward / gated_backward. A functor may also provide
//
//     static TIGON_HD void value_and_derivative(float a, float& v, float& d);
//
// which the backward then calls instead of the two functions, to share their common part (the
// built-in functors do: the sigmoid of SiLU, the tanh or erf of GELU), and
//
//     static TIGON_HD float backward(float dc, float a);   // dc * act'(a), as autograd composes it
//
// which the ungated backward (activation_backward) then calls instead of dc * derivative(a).
//
// The built-ins use the precise single-precision functions (expf, tanhf, erff), never the fast
// intrinsics, so that results do not depend on -use_fast_math.
#pragma once

#include <cmath>
#include <concepts>

#include "../core/config.hpp"

TIGON_NAMESPACE_BEGIN

// What gated_forward / gated_backward require of an activation.
template <class A>
concept Activation = requires(float x) {
  { A::value(x) } -> std::convertible_to<float>;
  { A::derivative(x) } -> std::convertible_to<float>;
};

// SiLU (swish): a * sigmoid(a). SwiGLU's activation (Llama, Mistral, Qwen, Falcon-H1 ...).
//   d/da = s * (1 + a * (1 - s)),  s = sigmoid(a)
struct Silu {
  static TIGON_HD float sigmoid(float a) { return 1.0f / (1.0f + ::expf(-a)); }
  static TIGON_HD float value(float a) { return a * sigmoid(a); }
  static TIGON_HD float derivative(float a) {
    const float s = sigmoid(a);
    return s * (1.0f + a * (1.0f - s));
  }
  static TIGON_HD void value_and_derivative(float a, float& v, float& d) {
    const float s = sigmoid(a);
    v = a * s;
    d = s * (1.0f + a * (1.0f - s));
  }
};

// GELU, tanh approximation, as PyTorch's gelu(approximate='tanh') (GeGLU of Gemma):
//   act(a) = 0.5 a (1 + tanh(u)),  u = sqrt(2/pi) (a + 0.044715 a^3)
//   d/da   = 0.5 (1 + tanh(u)) + 0.5 a (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 a^2)
// The a^2 of the derivative is capped at 1e4: beyond |a| = 100, tanh(u) is exactly +-1 in fp32, the
// second term is exactly 0, and the cap keeps 0 * inf from turning it into NaN for huge |a|.
struct GeluTanh {
  static constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
  // Each expression in PyTorch's order of operations (its CUDA gelu kernels), so that the fp32
  // values, and the bf16 / fp16 values rounded from them, are the ones PyTorch computes.
  static TIGON_HD float inner_tanh(float a) {
    const float a3 = a * a * a;
    return ::tanhf(kBeta * (a + kKappa * a3));
  }
  static TIGON_HD float derivative_from(float a, float t) {
    const float a2 = ::fminf(a * a, 1e4f);  // past |a| = 100 the tanh factor is 0: no inf * 0
    const float left = 0.5f * a;
    const float left_derivative = 0.5f * (1.0f + t);
    const float tanh_derivative = 1.0f - t * t;
    const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * a2);
    return left_derivative + left * tanh_derivative * inner_derivative;
  }
  static TIGON_HD float value(float a) { return 0.5f * a * (1.0f + inner_tanh(a)); }
  static TIGON_HD float derivative(float a) { return derivative_from(a, inner_tanh(a)); }
  static TIGON_HD void value_and_derivative(float a, float& v, float& d) {
    const float t = inner_tanh(a);
    v = 0.5f * a * (1.0f + t);
    d = derivative_from(a, t);
  }
};

// GELU, exact (erf), as PyTorch's gelu(approximate='none'):
//   act(a) = 0.5 a (1 + erf(a / sqrt(2))),   d/da = 0.5 (1 + erf(a / sqrt(2))) + a phi(a),
//   phi(a) = exp(-a^2 / 2) / sqrt(2 pi)
struct GeluErf {
  static constexpr float kSqrtHalf = 0.7071067811865476f;    // 1 / sqrt(2)
  static constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)
  static TIGON_HD float cdf(float a) { return 0.5f * (1.0f + ::erff(a * kSqrtHalf)); }
  static TIGON_HD float pdf(float a) { return kInvSqrt2Pi * ::expf(-0.5f * a * a); }
  static TIGON_HD float value(float a) { return a * cdf(a); }
  static TIGON_HD float derivative(float a) { return cdf(a) + a * pdf(a); }
  static TIGON_HD void value_and_derivative(float a, float& v, float& d) {
    const float c = cdf(a);
    v = a * c;
    d = c + a * pdf(a);
  }
};

// Squared ReLU, as Nemotron's MLP (transformers' ReLUSquaredActivation: relu, then square):
//   act(a) = max(a, 0)^2,   d/da = 2 max(a, 0)
// Both are exact in fp32 up to the square's one rounding, so a 16-bit result rounded from them is
// the module's bit for bit (2 max(a, 0) is exact, so dc * act'(a) rounds once, as autograd's does).
// backward() is that gradient as autograd composes it, edge cases included: relu's backward passes
// dc * 2r only where r = relu(a) > 0 or is NaN (a NaN input gives a NaN gradient, a dead unit a zero
// one even for an infinite dc); the ungated op uses it.
struct ReluSquared {
  static TIGON_HD float value(float a) {
    const float r = a < 0.0f ? 0.0f : a;  // relu; NaN stays NaN
    return r * r;
  }
  static TIGON_HD float derivative(float a) { return a > 0.0f ? 2.0f * a : 0.0f; }
  static TIGON_HD void value_and_derivative(float a, float& v, float& d) {
    v = value(a);
    d = derivative(a);
  }
  static TIGON_HD float backward(float dc, float a) {
    const float r = a < 0.0f ? 0.0f : a;
    return r <= 0.0f ? 0.0f : dc * (2.0f * r);
  }
};

// act(a) and act'(a) together: the functor's value_and_derivative when it has one, else the two
// functions.
template <Activation Act>
TIGON_HD void activation_value_and_derivative(float a, float& v, float& d) {
  if constexpr (requires(float x, float& r) { Act::value_and_derivative(x, r, r); }) {
    Act::value_and_derivative(a, v, d);
  } else {
    v = Act::value(a);
    d = Act::derivative(a);
  }
}

TIGON_NAMESPACE_END
