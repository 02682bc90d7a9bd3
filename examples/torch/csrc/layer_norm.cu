// LayerNorm forward and backward through tigon/norm/layer_norm.cuh ([rows, cols] matrices).
#include "common.h"

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
    a.workspace = bytes ? ws.data_ptr() : nullptr;
    a.workspace_bytes = bytes;
    check_status(tigon::layer_norm_backward(a, current_stream(x)));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
}

}  // namespace tigon_torch
