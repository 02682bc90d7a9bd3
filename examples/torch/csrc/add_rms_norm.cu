// Fused residual add + RMSNorm forward and backward through tigon/norm/add_rms_norm.cuh, and
// tigon.add_rms_norm: the two as one operator whose autograd is C++.
#include "norm_common.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <tigon/norm/add_rms_norm.cuh>

namespace tigon_torch {
namespace {

void add_rms_norm_fwd(const Tensor& x, const Tensor& residual, const OptTensor& weight, const Tensor& y,
                      const Tensor& sum, const OptTensor& rstd, double eps, double offset,
                      std::int64_t casting) {
  constexpr const char* op = "tigon.add_rms_norm_fwd";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows R = rows_of(residual, x, x.scalar_type(), op, "residual");
  const Rows Y = rows_of(y, x, x.scalar_type(), op, "y");
  const Rows S = rows_of(sum, x, x.scalar_type(), op, "sum");
  same_shape(X, R, op, "x", "residual");
  same_shape(X, Y, op, "x", "y");
  same_shape(X, S, op, "x", "sum");
  if (rstd) vector_of(*rstd, x, at::kFloat, X.rows, op, "rstd");
  const auto mode = casting_of(casting, op);
  dispatch_float_weight(x.scalar_type(), weight_type(weight, x.scalar_type()), op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, x, weight->scalar_type(), X.cols, op, "weight");
    tigon::AddRmsNormForwardArgs<T, W> a{
        .x = static_cast<const T*>(X.ptr), .residual = static_cast<const T*>(R.ptr),
        .y = static_cast<T*>(Y.ptr), .sum = static_cast<T*>(S.ptr), .weight = ptr<const W>(weight),
        .rstd = ptr<float>(rstd), .rows = X.rows, .cols = X.cols, .x_stride = X.stride,
        .residual_stride = R.stride, .y_stride = Y.stride, .sum_stride = S.stride,
        .eps = static_cast<float>(eps), .offset = static_cast<float>(offset), .casting = mode};
    check_status(tigon::add_rms_norm_forward(a, current_stream(x)));
  });
}

void add_rms_norm_bwd(const Tensor& dy, const OptTensor& dsum, const Tensor& sum, const OptTensor& weight,
                      const OptTensor& rstd, const Tensor& dx, const OptTensor& dweight, double eps,
                      double offset, std::int64_t casting) {
  constexpr const char* op = "tigon.add_rms_norm_bwd";
  const c10::cuda::CUDAGuard guard(sum.device());
  const Rows S = rows_of(sum, sum, sum.scalar_type(), op, "sum");
  const Rows DY = rows_of(dy, sum, sum.scalar_type(), op, "dy");
  const Rows DX = rows_of(dx, sum, sum.scalar_type(), op, "dx");
  Rows DS;
  if (dsum) {
    DS = rows_of(*dsum, sum, sum.scalar_type(), op, "dsum");
    same_shape(S, DS, op, "sum", "dsum");
  }
  same_shape(S, DY, op, "sum", "dy");
  same_shape(S, DX, op, "sum", "dx");
  if (rstd) vector_of(*rstd, sum, at::kFloat, S.rows, op, "rstd");
  const auto mode = casting_of(casting, op);
  dispatch_float_weight(sum.scalar_type(), weight_type(weight, sum.scalar_type()), op, [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (weight) vector_of(*weight, sum, weight->scalar_type(), S.cols, op, "weight");
    if (dweight) vector_of(*dweight, sum, weight_type(weight, sum.scalar_type()), S.cols, op, "dweight");
    tigon::AddRmsNormBackwardArgs<T, W> a{
        .dy = static_cast<const T*>(DY.ptr), .dsum = static_cast<const T*>(DS.ptr),
        .sum = static_cast<const T*>(S.ptr), .weight = ptr<const W>(weight),
        .rstd = ptr<const float>(rstd), .dx = static_cast<T*>(DX.ptr), .dweight = ptr<W>(dweight),
        .rows = S.rows, .cols = S.cols, .dy_stride = DY.stride, .dsum_stride = DS.stride,
        .sum_stride = S.stride, .dx_stride = DX.stride, .eps = static_cast<float>(eps),
        .offset = static_cast<float>(offset), .casting = mode};
    std::size_t bytes = 0;
    check_status(tigon::add_rms_norm_backward_workspace_bytes(a, bytes));
    const Tensor ws = workspace(bytes, sum);
    a.workspace = workspace_ptr(ws);
    a.workspace_bytes = bytes;
    check_status(tigon::add_rms_norm_backward(a, current_stream(sum)));
  });
}

// S = X + R and Y = RMSNorm(S) with the autograd in C++, as TigonFusedAddRMSNormFunction: the forward
// saves S, the weight and rstd; the backward returns one tensor for dX and dR (over dY when in_place
// and dY is contiguous) and dW. x and residual must be contiguous. Without a weight, `weight` is an
// empty placeholder and has_weight false.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& residual, const Tensor& weight, bool has_weight,
                                                double eps, double offset, std::int64_t casting, bool in_place) {
    TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous() && residual.is_contiguous(),
                      "tigon.add_rms_norm: 'x' and 'residual' must be contiguous with at least one dimension");
    TORCH_CHECK_VALUE(x.sizes() == residual.sizes(), "tigon.add_rms_norm: x ", x.sizes(), " and residual ",
                      residual.sizes(), " must have one shape");
    const std::int64_t cols = x.size(-1);
    const Tensor x2 = x.view({-1, cols});
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor s = at::empty(x.sizes(), x.options());
    const Tensor rstd = at::empty({x2.size(0)}, x.options().dtype(at::kFloat));
    const Tensor w = has_weight ? weight.contiguous() : Tensor();
    if (x2.numel() > 0) {
      dispatched<add_rms_norm_fwd>("tigon::add_rms_norm_fwd")
          .call(x2, residual.view({-1, cols}), opt(w), y.view({-1, cols}), s.view({-1, cols}), rstd, eps, offset,
                casting);
    }
    // S itself is saved (an output; a view of it made here, under no_grad, may not outlive the forward).
    ctx->save_for_backward({s, w, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = casting;
    ctx->saved_data["in_place"] = in_place;
    return {y, s};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& w = saved[1];
    const Tensor& rstd = saved[2];
    const std::int64_t cols = saved[0].size(-1);
    const Tensor s2 = saved[0].view({-1, cols});
    std::vector<std::int64_t> shape = grads[0].defined() ? grads[0].sizes().vec() : grads[1].sizes().vec();
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros(shape, s2.options());
    const Tensor dy2 = rows_view(dy, cols);
    const OptTensor ds2 = grads[1].defined() ? OptTensor(rows_view(grads[1], cols)) : std::nullopt;
    Tensor dx, dx2;
    if (ctx->saved_data["in_place"].toBool() && dy.is_contiguous() && dy.scalar_type() == s2.scalar_type()) {
      dx = dy, dx2 = dy2;  // dX over dY
    } else {
      dx = at::empty(shape, s2.options());
      dx2 = dx.view({-1, cols});
    }
    Tensor dw;
    if (w.defined() && ctx->needs_input_grad(2)) dw = at::empty_like(w);
    if (s2.numel() > 0) {
      dispatched<add_rms_norm_bwd>("tigon::add_rms_norm_bwd")
          .call(dy2, ds2, s2, opt(w), rstd, dx2, opt(dw), ctx->saved_data["eps"].toDouble(),
                ctx->saved_data["offset"].toDouble(), ctx->saved_data["casting"].toInt());
    } else if (dw.defined()) {
      dw.zero_();
    }
    return {dx, dx, dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const OptTensor& weight, double eps,
                                        double offset, std::int64_t casting, bool in_place) {
  const bool has_weight = weight.has_value();
  auto out = AddRmsNormFunction::apply(x, residual, has_weight ? *weight : at::empty({0}, x.options()), has_weight,
                                       eps, offset, casting, in_place);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd);
  m.impl("add_rms_norm", &add_rms_norm);
}

TORCH_LIBRARY_IMPL(tigon, Autograd, m) {
  m.impl("add_rms_norm", &add_rms_norm);
}

}  // namespace tigon_torch
