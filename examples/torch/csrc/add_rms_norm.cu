// Fused residual add + RMSNorm forward and backward through tigon/norm/add_rms_norm.cuh.
#include "norm_common.h"

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
    a.workspace = bytes ? ws.data_ptr() : nullptr;
    a.workspace_bytes = bytes;
    check_status(tigon::add_rms_norm_backward(a, current_stream(sum)));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd);
}

}  // namespace tigon_torch
