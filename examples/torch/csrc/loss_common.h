// Helpers shared by the loss operators: the cross-entropy options and outputs.
#pragma once

#include "common.h"

#include <tigon/loss/cross_entropy.cuh>

namespace tigon_torch {


inline tigon::Reduction reduction_of(std::int64_t r, const char* op) {
  TORCH_CHECK_VALUE(r >= 0 && r <= 2, op, ": reduction must be 0 (none), 1 (sum) or 2 (mean), got ", r);
  return static_cast<tigon::Reduction>(r);
}

// The loss options and outputs shared by both ops (everything but the logits / the linear layer).
template <class T, class I>
inline void fill_loss(tigon::CrossEntropyArgs<T, I>& a, const Tensor& ref, std::int64_t rows, std::int64_t vocab,
               const Tensor& target, const OptTensor& class_weights, const OptTensor& grad_output,
               const OptTensor& loss, const OptTensor& loss_rows, const OptTensor& z_loss,
               const OptTensor& lse, const OptTensor& argmax, std::int64_t ignore_index,
               double label_smoothing, double z_loss_scale, double softcap, std::int64_t reduction,
               double grad_scale, const char* op) {
  a.targets = static_cast<const I*>(vector_of(target, ref, target.scalar_type(), rows, op, "target"));
  a.rows = rows;
  a.vocab = vocab;
  if (class_weights) a.class_weights = static_cast<const float*>(vector_of(*class_weights, ref, at::kFloat, vocab, op, "class_weights"));
  a.ignore_index = ignore_index;
  a.label_smoothing = static_cast<float>(label_smoothing);
  a.z_loss_scale = static_cast<float>(z_loss_scale);
  a.softcap = static_cast<float>(softcap);
  a.reduction = reduction_of(reduction, op);
  a.grad_scale = static_cast<float>(grad_scale);
  if (grad_output) {
    const std::int64_t n = a.reduction == tigon::Reduction::none ? rows : 1;
    if (n == 1 && grad_output->dim() == 0) {
      check_cuda(*grad_output, ref, op, "grad_output");
      TORCH_CHECK_TYPE(grad_output->scalar_type() == at::kFloat, op, ": 'grad_output' must be float32");
      a.grad_output = ptr<const float>(*grad_output);
    } else {
      a.grad_output = static_cast<const float*>(vector_of(*grad_output, ref, at::kFloat, n, op, "grad_output"));
    }
  }
  auto scalar_out = [&](const OptTensor& t, const char* name) -> float* {
    if (!t) return nullptr;
    check_cuda(*t, ref, op, name);
    TORCH_CHECK_VALUE(t->numel() == 1, op, ": '", name, "' must hold one element");
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": '", name, "' must be float32");
    return ptr<float>(*t);
  };
  a.loss = scalar_out(loss, "loss");
  a.z_loss = scalar_out(z_loss, "z_loss");
  if (loss_rows) a.loss_rows = static_cast<float*>(vector_of(*loss_rows, ref, at::kFloat, rows, op, "loss_rows"));
  if (lse) a.lse = static_cast<float*>(vector_of(*lse, ref, at::kFloat, rows, op, "lse"));
  if (argmax) a.argmax = static_cast<std::int64_t*>(vector_of(*argmax, ref, at::kLong, rows, op, "argmax"));
}

template <class F>
inline void dispatch_index(at::ScalarType st, const char* op, F&& f) {
  if (st == at::kLong) {
    f(tag<std::int64_t>{});
  } else if (st == at::kInt) {
    f(tag<std::int32_t>{});
  } else {
    TORCH_CHECK_TYPE(false, op, ": 'target' must be int64 or int32, got ", st);
  }
}

}  // namespace tigon_torch
