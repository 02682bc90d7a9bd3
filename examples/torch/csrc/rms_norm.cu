// RMSNorm forward and backward through tigon/norm/rms_norm.cuh ([rows, cols] matrices).
#include "norm_common.h"

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
    a.workspace = bytes ? ws.data_ptr() : nullptr;
    a.workspace_bytes = bytes;
    check_status(tigon::rms_norm_backward(a, current_stream(x)));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
}

}  // namespace tigon_torch
