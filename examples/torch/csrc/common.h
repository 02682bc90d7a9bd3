// Shared helpers of the tigon_torch operators: tensor checks, dtype dispatch, the current stream,
// and tigon::Status turned into a Python exception (ValueError for a bad argument,
// NotImplementedError for an unsupported combination, RuntimeError for a CUDA error).
//
// Every operator takes its outputs as arguments (allocated by the Python side with torch), checks
// dtypes, devices, shapes and strides, enqueues tigon launchers on the current CUDA stream and
// returns without synchronising the host. Scratch memory comes from torch's caching allocator.
#pragma once

#include "hidden_sizes.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include <tigon/core/dtype.hpp>
#include <tigon/core/status.hpp>

namespace tigon_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A tigon status as a Python exception carrying tigon's message.
inline void check_status(const tigon::Status& s) {
  if (s.ok()) return;
  switch (s.code()) {
    case tigon::Errc::cuda_error:
      TORCH_CHECK(false, s.message());
    case tigon::Errc::unsupported:
      TORCH_CHECK_NOT_IMPLEMENTED(false, s.message());
    default:
      TORCH_CHECK_VALUE(false, s.message());
  }
}

inline cudaStream_t current_stream(const Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_cuda(const Tensor& t, const Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), op, ": '", name, "' must be a CUDA tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": '", name, "' is on ", t.device(),
                    ", expected ", ref.device());
}

// A [rows, cols] matrix with unit column stride. Row stride 0 means contiguous (tigon's
// convention); a matrix of one row gets 0 whatever torch reports.
struct Rows {
  void* ptr = nullptr;
  std::int64_t rows = 0, cols = 0, stride = 0;
};

inline Rows rows_of(const Tensor& t, const Tensor& ref, at::ScalarType dtype, const char* op,
                    const char* name) {
  check_cuda(t, ref, op, name);
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": '", name, "' must be 2-D [rows, cols], got ", t.dim(), "-D");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": '", name, "' has dtype ", t.scalar_type(),
                   ", expected ", dtype);
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, op, ": '", name,
                    "' must have unit column stride, got stride ", t.stride(1));
  Rows r{t.data_ptr(), t.size(0), t.size(1), t.size(0) <= 1 ? 0 : t.stride(0)};
  // A multi-row tensor with row stride 0 (expanded rows) would read as contiguous: rejected.
  TORCH_CHECK_VALUE(t.size(0) <= 1 || t.stride(0) != 0, op, ": '", name,
                    "' has row stride 0 (expanded rows); make it contiguous");
  TORCH_CHECK_VALUE(r.stride == 0 || r.stride >= r.cols, op, ": '", name, "' has row stride ",
                    r.stride, " < cols ", r.cols);
  return r;
}

// A contiguous 1-D vector of n elements of the given dtype.
inline void* vector_of(const Tensor& t, const Tensor& ref, at::ScalarType dtype, std::int64_t n,
                       const char* op, const char* name) {
  check_cuda(t, ref, op, name);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, op, ": '", name, "' must be 1-D of size ", n,
                    ", got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": '", name, "' has dtype ", t.scalar_type(),
                   ", expected ", dtype);
  TORCH_CHECK_VALUE(n <= 1 || t.stride(0) == 1, op, ": '", name, "' must be contiguous");
  return t.data_ptr();
}

inline void same_shape(const Rows& a, const Rows& b, const char* op, const char* an, const char* bn) {
  TORCH_CHECK_VALUE(a.rows == b.rows && a.cols == b.cols, op, ": '", an, "' is [", a.rows, ", ",
                    a.cols, "] but '", bn, "' is [", b.rows, ", ", b.cols, "]");
}

// Scratch bytes from torch's caching allocator (at least 256-byte aligned); for 0 bytes an undefined
// tensor (no allocation), whose workspace_ptr() is null.
inline Tensor workspace(std::size_t bytes, const Tensor& ref) {
  return bytes == 0 ? Tensor() : at::empty({static_cast<std::int64_t>(bytes)}, ref.options().dtype(at::kByte));
}

inline void* workspace_ptr(const Tensor& ws) { return ws.defined() ? ws.data_ptr() : nullptr; }

// Calls f(tag<T>) for the tigon type of a float / half / bfloat16 torch dtype.
template <class T>
struct tag {
  using type = T;
};

template <class F>
void dispatch_float(at::ScalarType st, const char* op, const char* name, F&& f) {
  switch (st) {
    case at::kFloat: f(tag<float>{}); return;
    case at::kHalf: f(tag<tigon::half>{}); return;
    case at::kBFloat16: f(tag<tigon::bf16>{}); return;
    default:
      TORCH_CHECK_TYPE(false, op, ": '", name, "' must be float32, float16 or bfloat16, got ", st);
  }
}

// Activation dtype T and weight dtype W: W is T, or float32 with half / bfloat16 activations.
template <class F>
void dispatch_float_weight(at::ScalarType t, at::ScalarType w, const char* op, F&& f) {
  TORCH_CHECK_TYPE(w == t || w == at::kFloat, op, ": the weight dtype (", w,
                   ") must equal the input dtype (", t, ") or be float32");
  dispatch_float(t, op, "x", [&](auto tt) {
    using T = typename decltype(tt)::type;
    if (w == t) {
      f(tag<T>{}, tag<T>{});
    } else if constexpr (!std::is_same_v<T, float>) {
      f(tag<T>{}, tag<float>{});
    }
  });
}

// The dtype of a chunked head's weight gradients: float32 (accumulated in fp32 across the chunks) or the
// input's dtype (each chunk's GEMM adds into them and rounds once). Every given one must have it; none
// given: float32.
inline at::ScalarType head_grad_dtype(const Tensor& x, std::initializer_list<const Tensor*> grads, const char* op) {
  at::ScalarType g = at::kFloat;
  bool first = true;
  for (const Tensor* t : grads) {
    if (t == nullptr) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat || t->scalar_type() == x.scalar_type(), op,
                     ": the weight gradients must be float32 or x's dtype (", x.scalar_type(), "), got ",
                     t->scalar_type());
    TORCH_CHECK_TYPE(first || t->scalar_type() == g, op, ": the weight gradients must share one dtype");
    g = t->scalar_type();
    first = false;
  }
  return g;
}

// Calls f(tag<G>) with G float (g float32) or T.
template <class T, class F>
void dispatch_head_grad(at::ScalarType g, F&& f) {
  if (g == at::kFloat) {
    f(tag<float>{});
  } else if constexpr (!std::is_same_v<T, float>) {
    f(tag<T>{});
  }
}

template <class T>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <class T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? reinterpret_cast<T*>(t->data_ptr()) : nullptr;
}

// t as a [rows, cols] matrix with unit column stride and a row stride >= cols: a view when the
// strides allow it, else a copy (an expanded gradient, say). For the C++ autograd functions; sizes
// as SymInts, as torch's tracers pass them.
inline Tensor rows_view(const Tensor& t, const c10::SymInt& cols) {
  Tensor r = t.reshape_symint({-1, cols});
  if ((cols > 1 && r.sym_stride(1) != 1) || (r.sym_size(0) > 1 && r.sym_stride(0) < cols)) r = r.contiguous();
  return r;
}

// The operator `name` whose CUDA implementation is kImpl, called through the dispatcher (so that a
// fake-tensor mode sees it), typed by kImpl's own signature. For the C++ autograd functions.
template <auto& kImpl>
const auto& dispatched(const char* name) {
  using Signature = std::remove_reference_t<decltype(kImpl)>;
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return op;
}

inline OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

}  // namespace tigon_torch
