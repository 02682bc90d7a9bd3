// LayerNorm forward and backward through tigon/norm/layer_norm.cuh ([rows, cols] matrices), and
// tigon.layer_norm: the two as one operator whose autograd is C++.
#include "norm_common.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <tigon/norm/layer_norm.cuh>

namespace tigon_torch {
namespace {

at::ScalarType ln_weight_type(const OptTensor& w, const OptTensor& b, at::ScalarType t) {
  if (w) return w->scalar_type();
  if (b) return b->scalar_type();
  return t;
}

void layer_norm_fwd(const Tensor& x, const OptTensor& weight, const OptTensor& bias, const Tensor& y,
                    const Tensor& mean, const Tensor& rstd, double eps) {
  constexpr const char* op = "tigon.layer_norm_fwd";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows Y = rows_of(y, x, x.scalar_type(), op, "y");
  same_shape(X, Y, op, "x", "y");
  vector_of(mean, x, at::kFloat, X.rows, op, "mean");
  vector_of(rstd, x, at::kFloat, X.rows, op, "rstd");
  const at::ScalarType wt = ln_weight_type(weight, bias, x.scalar_type());
  dispatch_float_weight(x.scalar_type(), wt, op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, x, wt, X.cols, op, "weight");
    if (bias) vector_of(*bias, x, wt, X.cols, op, "bias");
    tigon::LayerNormForwardArgs<T, W> a{
        .x = static_cast<const T*>(X.ptr), .y = static_cast<T*>(Y.ptr), .weight = ptr<const W>(weight),
        .bias = ptr<const W>(bias), .mean = ptr<float>(mean), .rstd = ptr<float>(rstd), .rows = X.rows,
        .cols = X.cols, .x_stride = X.stride, .y_stride = Y.stride, .eps = static_cast<float>(eps)};
    check_status(tigon::layer_norm_forward(a, current_stream(x)));
  });
}

void layer_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight, const Tensor& mean,
                    const Tensor& rstd, const Tensor& dx, const OptTensor& dweight,
                    const OptTensor& dbias) {
  constexpr const char* op = "tigon.layer_norm_bwd";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows DY = rows_of(dy, x, x.scalar_type(), op, "dy");
  const Rows DX = rows_of(dx, x, x.scalar_type(), op, "dx");
  same_shape(X, DY, op, "x", "dy");
  same_shape(X, DX, op, "x", "dx");
  vector_of(mean, x, at::kFloat, X.rows, op, "mean");
  vector_of(rstd, x, at::kFloat, X.rows, op, "rstd");
  const at::ScalarType wt = ln_weight_type(weight, dbias, x.scalar_type());
  dispatch_float_weight(x.scalar_type(), wt, op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, x, wt, X.cols, op, "weight");
    if (dweight) vector_of(*dweight, x, wt, X.cols, op, "dweight");
    if (dbias) vector_of(*dbias, x, wt, X.cols, op, "dbias");
    tigon::LayerNormBackwardArgs<T, W> a{
        .dy = static_cast<const T*>(DY.ptr), .x = static_cast<const T*>(X.ptr),
        .weight = ptr<const W>(weight), .mean = ptr<const float>(mean), .rstd = ptr<const float>(rstd),
        .dx = static_cast<T*>(DX.ptr), .dweight = ptr<W>(dweight), .dbias = ptr<W>(dbias),
        .rows = X.rows, .cols = X.cols, .dy_stride = DY.stride, .x_stride = X.stride,
        .dx_stride = DX.stride};
    std::size_t bytes = 0;
    check_status(tigon::layer_norm_backward_workspace_bytes(a, bytes));
    const Tensor ws = workspace(bytes, x);
    a.workspace = workspace_ptr(ws);
    a.workspace_bytes = bytes;
    check_status(tigon::layer_norm_backward(a, current_stream(x)));
  });
}

// LayerNorm with its autograd in C++, as TigonLayerNormFunction: the forward saves x, the weight,
// mean and rstd; the backward writes dX, dW and dB (each only when asked for). x must be
// contiguous (the Python side sends other layouts through TigonLayerNormFunction). A missing weight
// or bias is an empty placeholder with has_weight / has_bias false (an autograd function's tensor
// arguments must be defined).
class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        bool has_weight, const Tensor& bias, bool has_bias, double eps) {
    TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "tigon.layer_norm: 'x' must be contiguous with at least "
                      "one dimension, got shape ", x.sizes(), " and strides ", x.strides());
    const std::int64_t cols = x.size(-1);
    const Tensor x2 = x.view({-1, cols});
    Tensor y = at::empty(x.sizes(), x.options());
    const Tensor mean = at::empty({x2.size(0)}, x.options().dtype(at::kFloat));
    const Tensor rstd = at::empty({x2.size(0)}, x.options().dtype(at::kFloat));
    const Tensor w = has_weight ? weight.contiguous() : Tensor();
    const Tensor b = has_bias ? bias.contiguous() : Tensor();
    if (x2.numel() > 0) {
      dispatched<layer_norm_fwd>("tigon::layer_norm_fwd").call(x2, opt(w), opt(b), y.view({-1, cols}), mean, rstd, eps);
    }
    ctx->save_for_backward({x2, w, mean, rstd});
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) {  // dB's shape and dtype
      ctx->saved_data["bias_shape"] = b.sizes().vec();
      ctx->saved_data["bias_dtype"] = static_cast<std::int64_t>(b.scalar_type());
    }
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x2 = saved[0];
    const Tensor& w = saved[1];
    const Tensor& mean = saved[2];
    const Tensor& rstd = saved[3];
    const Tensor& dy = grads[0];
    const std::int64_t cols = x2.size(1);
    const Tensor dy2 = rows_view(dy, cols);
    Tensor dx = at::empty(dy.sizes(), x2.options());
    Tensor dw, db;
    if (w.defined() && ctx->needs_input_grad(1)) dw = at::empty_like(w);
    // needs_input_grad counts the tensor arguments only: x 0, weight 1, bias 2.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
      db = at::empty(ctx->saved_data["bias_shape"].toIntVector(), x2.options().dtype(dtype));
    }
    if (x2.numel() > 0) {
      dispatched<layer_norm_bwd>("tigon::layer_norm_bwd")
          .call(dy2, x2, opt(w), mean, rstd, dx.view({-1, cols}), opt(dw), opt(db));
    } else {
      if (dw.defined()) dw.zero_();
      if (db.defined()) db.zero_();
    }
    return {dx, dw, Tensor(), db, Tensor(), Tensor()};
  }
};

Tensor layer_norm(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
  const bool has_weight = weight.has_value(), has_bias = bias.has_value();
  const Tensor none = at::empty({0}, x.options());
  return LayerNormFunction::apply(x, has_weight ? *weight : none, has_weight, has_bias ? *bias : none, has_bias,
                                  eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("layer_norm", &layer_norm);
}

TORCH_LIBRARY_IMPL(tigon, Autograd, m) {
  m.impl("layer_norm", &layer_norm);
}

}  // namespace tigon_torch
