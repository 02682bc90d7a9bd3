// Helpers shared by the norm operators.
#pragma once

#include "common.h"

#include <tigon/norm/rms_norm.cuh>

namespace tigon_torch {

inline tigon::RmsNormCasting casting_of(std::int64_t c, const char* op) {
  TORCH_CHECK_VALUE(c >= 0 && c <= 2, op, ": casting must be 0 (llama), 1 (gemma) or 2 (none), got ", c);
  return static_cast<tigon::RmsNormCasting>(c);
}

inline at::ScalarType weight_type(const OptTensor& w, at::ScalarType t) {
  return w.has_value() ? w->scalar_type() : t;
}

// t as a [rows, cols] matrix with unit column stride and a row stride >= cols: a view when the
// strides allow it, else a copy (an expanded gradient, say). For the norms' C++ autograd.
inline Tensor rows_view(const Tensor& t, std::int64_t cols) {
  Tensor r = t.reshape({-1, cols});
  if ((cols > 1 && r.stride(1) != 1) || (r.size(0) > 1 && r.stride(0) < cols)) r = r.contiguous();
  return r;
}

inline OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

}  // namespace tigon_torch
