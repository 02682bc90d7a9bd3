// RMSNorm forward and backward through tigon/norm/rms_norm.cuh ([rows, cols] matrices), and
// tigon.rms_norm: the two as one operator whose autograd is C++.
#include "norm_common.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <tigon/norm/rms_norm.cuh>

namespace tigon_torch {
namespace {

void rms_norm_fwd(const Tensor& x, const OptTensor& weight, const Tensor& y, const OptTensor& rstd,
                  double eps, double offset, std::int64_t casting) {
  constexpr const char* op = "tigon.rms_norm_fwd";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows Y = rows_of(y, x, x.scalar_type(), op, "y");
  same_shape(X, Y, op, "x", "y");
  if (rstd) vector_of(*rstd, x, at::kFloat, X.rows, op, "rstd");
  const auto mode = casting_of(casting, op);
  dispatch_float_weight(x.scalar_type(), weight_type(weight, x.scalar_type()), op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, x, weight->scalar_type(), X.cols, op, "weight");
    tigon::RmsNormForwardArgs<T, W> a{.x = static_cast<const T*>(X.ptr), .y = static_cast<T*>(Y.ptr),
                                      .weight = ptr<const W>(weight), .rstd = ptr<float>(rstd),
                                      .rows = X.rows, .cols = X.cols, .x_stride = X.stride,
                                      .y_stride = Y.stride, .eps = static_cast<float>(eps),
                                      .offset = static_cast<float>(offset), .casting = mode};
    check_status(tigon::rms_norm_forward(a, current_stream(x)));
  });
}

void rms_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight, const OptTensor& rstd,
                  const Tensor& dx, const OptTensor& dweight, double eps, double offset,
                  std::int64_t casting) {
  constexpr const char* op = "tigon.rms_norm_bwd";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows DY = rows_of(dy, x, x.scalar_type(), op, "dy");
  const Rows DX = rows_of(dx, x, x.scalar_type(), op, "dx");
  same_shape(X, DY, op, "x", "dy");
  same_shape(X, DX, op, "x", "dx");
  if (rstd) vector_of(*rstd, x, at::kFloat, X.rows, op, "rstd");
  const auto mode = casting_of(casting, op);
  dispatch_float_weight(x.scalar_type(), weight_type(weight, x.scalar_type()), op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, x, weight->scalar_type(), X.cols, op, "weight");
    if (dweight) vector_of(*dweight, x, weight_type(weight, x.scalar_type()), X.cols, op, "dweight");
    tigon::RmsNormBackwardArgs<T, W> a{
        .dy = static_cast<const T*>(DY.ptr), .x = static_cast<const T*>(X.ptr),
        .weight = ptr<const W>(weight), .rstd = ptr<const float>(rstd), .dx = static_cast<T*>(DX.ptr),
        .dweight = ptr<W>(dweight), .rows = X.rows, .cols = X.cols, .dy_stride = DY.stride,
        .x_stride = X.stride, .dx_stride = DX.stride, .eps = static_cast<float>(eps),
        .offset = static_cast<float>(offset), .casting = mode};
    std::size_t bytes = 0;
    check_status(tigon::rms_norm_backward_workspace_bytes(a, bytes));
    const Tensor ws = workspace(bytes, x);
    a.workspace = workspace_ptr(ws);
    a.workspace_bytes = bytes;
    check_status(tigon::rms_norm_backward(a, current_stream(x)));
  });
}

// RMSNorm with its autograd in C++: the forward saves x, the weight and rstd; the backward writes dX
// (over dY when in_place and dY is contiguous, as TigonRMSNormFunction does) and dW. x must be
// contiguous (the Python side sends other layouts through TigonRMSNormFunction). Without a weight,
// `weight` is an empty placeholder and has_weight false (an autograd function's tensor arguments must
// be defined).
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        bool has_weight, double eps, double offset, std::int64_t casting, bool in_place) {
    TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "tigon.rms_norm: 'x' must be contiguous with at least one "
                      "dimension, got shape ", x.sizes(), " and strides ", x.strides());
    const std::int64_t cols = x.size(-1);
    const Tensor x2 = x.view({-1, cols});
    Tensor y = at::empty(x.sizes(), x.options());
    const Tensor rstd = at::empty({x2.size(0)}, x.options().dtype(at::kFloat));
    const Tensor w = has_weight ? weight.contiguous() : Tensor();
    if (x2.numel() > 0) {
      dispatched<rms_norm_fwd>("tigon::rms_norm_fwd").call(x2, opt(w), y.view({-1, cols}), rstd, eps, offset, casting);
    }
    ctx->save_for_backward({x2, w, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = casting;
    ctx->saved_data["in_place"] = in_place;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x2 = saved[0];
    const Tensor& w = saved[1];
    const Tensor& rstd = saved[2];
    const Tensor& dy = grads[0];
    const double eps = ctx->saved_data["eps"].toDouble(), offset = ctx->saved_data["offset"].toDouble();
    const std::int64_t casting = ctx->saved_data["casting"].toInt();
    const std::int64_t cols = x2.size(1);
    const Tensor dy2 = rows_view(dy, cols);
    Tensor dx, dx2;
    if (ctx->saved_data["in_place"].toBool() && dy.is_contiguous() && dy.scalar_type() == x2.scalar_type()) {
      dx = dy, dx2 = dy2;  // dX over dY
    } else {
      dx = at::empty(dy.sizes(), x2.options());
      dx2 = dx.view({-1, cols});
    }
    Tensor dw;
    if (w.defined() && ctx->needs_input_grad(1)) dw = at::empty_like(w);
    if (x2.numel() > 0) {
      dispatched<rms_norm_bwd>("tigon::rms_norm_bwd").call(dy2, x2, opt(w), rstd, dx2, opt(dw), eps, offset, casting);
    } else if (dw.defined()) {
      dw.zero_();
    }
    return {dx, dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor rms_norm(const Tensor& x, const OptTensor& weight, double eps, double offset, std::int64_t casting,
                bool in_place) {
  const bool has_weight = weight.has_value();
  return RmsNormFunction::apply(x, has_weight ? *weight : at::empty({0}, x.options()), has_weight, eps, offset,
                                casting, in_place);
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("rms_norm", &rms_norm);
}

TORCH_LIBRARY_IMPL(tigon, Autograd, m) {
  m.impl("rms_norm", &rms_norm);
}

}  // namespace tigon_torch
