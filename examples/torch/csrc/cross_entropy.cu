// Cross-entropy loss and its gradient through tigon/loss/cross_entropy.cuh.
#include "loss_common.h"

#include <torch/library.h>

#include <tigon/loss/cross_entropy.cuh>

namespace tigon_torch {
namespace {

void cross_entropy(const Tensor& logits, const Tensor& target, const OptTensor& class_weights,
                   const OptTensor& grad_output, const OptTensor& dlogits, const OptTensor& loss,
                   const OptTensor& loss_rows, const OptTensor& z_loss, const OptTensor& lse,
                   const OptTensor& argmax, std::int64_t ignore_index, double label_smoothing,
                   double z_loss_scale, double softcap, std::int64_t reduction, double grad_scale) {
  constexpr const char* op = "tigon.cross_entropy";
  const c10::cuda::CUDAGuard guard(logits.device());
  const Rows X = rows_of(logits, logits, logits.scalar_type(), op, "logits");
  Rows D;
  if (dlogits) {
    D = rows_of(*dlogits, logits, logits.scalar_type(), op, "dlogits");
    same_shape(X, D, op, "logits", "dlogits");
  }
  dispatch_float(logits.scalar_type(), op, "logits", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_index(target.scalar_type(), op, [&](auto ti) {
      using I = typename decltype(ti)::type;
      tigon::CrossEntropyArgs<T, I> a;
      fill_loss(a, logits, X.rows, X.cols, target, class_weights, grad_output, loss, loss_rows, z_loss, lse,
                argmax, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, grad_scale, op);
      a.logits = static_cast<const T*>(X.ptr);
      a.logits_stride = X.stride;
      a.dlogits = static_cast<T*>(D.ptr);
      a.dlogits_stride = D.stride;
      const std::size_t bytes = tigon::cross_entropy_workspace_bytes(X.rows);
      const Tensor ws = workspace(bytes, logits);
      a.workspace = ws.data_ptr();
      a.workspace_bytes = bytes;
      check_status(tigon::cross_entropy(a, current_stream(logits)));
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("cross_entropy", &cross_entropy);
}

}  // namespace tigon_torch
