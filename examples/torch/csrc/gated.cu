// Gated activations (SwiGLU, GeGLU tanh / erf) and the ungated squared ReLU, forward and backward,
// through tigon/activation/gated.cuh.
#include "common.h"

#include <torch/library.h>

#include <tigon/activation/gated.cuh>

namespace tigon_torch {
namespace {

// 0: SiLU (SwiGLU), 1: GELU tanh approximation (GeGLU), 2: exact GELU (erf).
template <class F>
void dispatch_act(std::int64_t act, const char* op, F&& f) {
  switch (act) {
    case 0: f(tag<tigon::Silu>{}); return;
    case 1: f(tag<tigon::GeluTanh>{}); return;
    case 2: f(tag<tigon::GeluErf>{}); return;
    default: TORCH_CHECK_VALUE(false, op, ": activation must be 0 (silu), 1 (gelu tanh) or 2 (gelu erf), got ", act);
  }
}

void gated_fwd(const Tensor& a, const Tensor& b, const Tensor& c, std::int64_t act, double gate_multiplier,
               double down_multiplier) {
  constexpr const char* op = "tigon.gated_fwd";
  const c10::cuda::CUDAGuard guard(a.device());
  const Rows A = rows_of(a, a, a.scalar_type(), op, "a");
  const Rows B = rows_of(b, a, a.scalar_type(), op, "b");
  const Rows Cm = rows_of(c, a, a.scalar_type(), op, "c");
  same_shape(A, B, op, "a", "b");
  same_shape(A, Cm, op, "a", "c");
  dispatch_float(a.scalar_type(), op, "a", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_act(act, op, [&](auto ta) {
      using Act = typename decltype(ta)::type;
      tigon::GatedForwardArgs<T> args{.a = static_cast<const T*>(A.ptr), .b = static_cast<const T*>(B.ptr),
                                      .c = static_cast<T*>(Cm.ptr), .rows = A.rows, .cols = A.cols,
                                      .a_stride = A.stride, .b_stride = B.stride, .c_stride = Cm.stride,
                                      .gate_multiplier = static_cast<float>(gate_multiplier),
                                      .down_multiplier = static_cast<float>(down_multiplier)};
      check_status(tigon::gated_forward<Act>(args, current_stream(a)));
    });
  });
}

void gated_bwd(const Tensor& dc, const Tensor& a, const Tensor& b, const Tensor& da, const Tensor& db,
               std::int64_t act, double gate_multiplier, double down_multiplier) {
  constexpr const char* op = "tigon.gated_bwd";
  const c10::cuda::CUDAGuard guard(a.device());
  const Rows DC = rows_of(dc, a, a.scalar_type(), op, "dc");
  const Rows A = rows_of(a, a, a.scalar_type(), op, "a");
  const Rows B = rows_of(b, a, a.scalar_type(), op, "b");
  const Rows DA = rows_of(da, a, a.scalar_type(), op, "da");
  const Rows DB = rows_of(db, a, a.scalar_type(), op, "db");
  same_shape(A, B, op, "a", "b");
  same_shape(A, DC, op, "a", "dc");
  same_shape(A, DA, op, "a", "da");
  same_shape(A, DB, op, "a", "db");
  dispatch_float(a.scalar_type(), op, "a", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_act(act, op, [&](auto ta) {
      using Act = typename decltype(ta)::type;
      tigon::GatedBackwardArgs<T> args{
          .dc = static_cast<const T*>(DC.ptr), .a = static_cast<const T*>(A.ptr),
          .b = static_cast<const T*>(B.ptr), .da = static_cast<T*>(DA.ptr), .db = static_cast<T*>(DB.ptr),
          .rows = A.rows, .cols = A.cols, .dc_stride = DC.stride, .a_stride = A.stride,
          .b_stride = B.stride, .da_stride = DA.stride, .db_stride = DB.stride,
          .gate_multiplier = static_cast<float>(gate_multiplier),
          .down_multiplier = static_cast<float>(down_multiplier)};
      check_status(tigon::gated_backward<Act>(args, current_stream(a)));
    });
  });
}

// c = relu(a)^2 (Nemotron's MLP activation).
void relu2_fwd(const Tensor& a, const Tensor& c) {
  constexpr const char* op = "tigon.relu2_fwd";
  const c10::cuda::CUDAGuard guard(a.device());
  const Rows A = rows_of(a, a, a.scalar_type(), op, "a");
  const Rows Cm = rows_of(c, a, a.scalar_type(), op, "c");
  same_shape(A, Cm, op, "a", "c");
  dispatch_float(a.scalar_type(), op, "a", [&](auto tt) {
    using T = typename decltype(tt)::type;
    tigon::ActivationForwardArgs<T> args{.a = static_cast<const T*>(A.ptr), .c = static_cast<T*>(Cm.ptr),
                                         .rows = A.rows, .cols = A.cols, .a_stride = A.stride,
                                         .c_stride = Cm.stride};
    check_status(tigon::relu2_forward(args, current_stream(a)));
  });
}

// da = dc * 2 relu(a).
void relu2_bwd(const Tensor& dc, const Tensor& a, const Tensor& da) {
  constexpr const char* op = "tigon.relu2_bwd";
  const c10::cuda::CUDAGuard guard(a.device());
  const Rows DC = rows_of(dc, a, a.scalar_type(), op, "dc");
  const Rows A = rows_of(a, a, a.scalar_type(), op, "a");
  const Rows DA = rows_of(da, a, a.scalar_type(), op, "da");
  same_shape(A, DC, op, "a", "dc");
  same_shape(A, DA, op, "a", "da");
  dispatch_float(a.scalar_type(), op, "a", [&](auto tt) {
    using T = typename decltype(tt)::type;
    tigon::ActivationBackwardArgs<T> args{.dc = static_cast<const T*>(DC.ptr), .a = static_cast<const T*>(A.ptr),
                                          .da = static_cast<T*>(DA.ptr), .rows = A.rows, .cols = A.cols,
                                          .dc_stride = DC.stride, .a_stride = A.stride, .da_stride = DA.stride};
    check_status(tigon::relu2_backward(args, current_stream(a)));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("gated_fwd", &gated_fwd);
  m.impl("gated_bwd", &gated_bwd);
  m.impl("relu2_fwd", &relu2_fwd);
  m.impl("relu2_bwd", &relu2_bwd);
}

}  // namespace tigon_torch
