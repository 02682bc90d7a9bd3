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

}  // namespace tigon_torch
