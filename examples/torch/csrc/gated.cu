// Gated activations (SwiGLU, GeGLU tanh / erf) and the ungated squared ReLU, forward and backward,
// through tigon/activation/gated.cuh, and tigon.gated: the gated pair as one operator whose autograd
// is C++.
#include "common.h"

#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/autograd.h>
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

// Whether the byte ranges x and y span (from their first to their last element) intersect. Tensors
// without plain data (fake, functional or of symbolic sizes, as torch's tracers pass) count as
// overlapping: the backward then writes fresh buffers, as the Python function does when tracing.
bool overlap(const Tensor& x, const Tensor& y) {
  for (const Tensor* t : {&x, &y}) {
    if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides() || at::isTensorSubclassLike(*t) ||
        !t->has_storage()) {
      return true;
    }
  }
  if (x.numel() == 0 || y.numel() == 0 || !x.storage().is_alias_of(y.storage())) return false;
  auto span = [](const Tensor& t) {
    std::int64_t last = 0;
    for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    return std::pair{lo, lo + static_cast<std::uintptr_t>((last + 1) * t.element_size())};
  };
  const auto [x0, x1] = span(x);
  const auto [y0, y1] = span(y);
  return x0 < y1 && y0 < x1;
}

// A tensor the graph computed (an MLP's projection), not one the caller made nor a view of one.
bool computed(const Tensor& t) {
  return t.grad_fn() != nullptr && (!t.is_view() || t._base().grad_fn() != nullptr);
}

// c = act(gate_multiplier a) b down_multiplier with its autograd in C++, as _gated_forward /
// _gated_backward of the Python side: when a and b are both computed by the graph, the backward
// writes da and db over them (the kernel reads an element's dc, a and b before writing its da and
// db) and bumps their version counters; fresh buffers for tensors the caller made and when a, b and
// dc overlap. a and b must be contiguous and of one shape (the Python side sends other layouts
// through its Functions).
class GatedFunction : public torch::autograd::Function<GatedFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& a, const Tensor& b, std::int64_t act,
                        double gate_multiplier, double down_multiplier) {
    // Sizes as SymInts: torch's tracers (AOT autograd with dynamic shapes) call this with symbolic ones.
    TORCH_CHECK_VALUE(a.dim() >= 1 && a.is_contiguous() && b.is_contiguous(), "tigon.gated: 'a' and 'b' must be "
                      "contiguous with at least one dimension");
    TORCH_CHECK_VALUE(a.sym_sizes() == b.sym_sizes(), "tigon.gated: a and b must have one shape, got ",
                      a.sym_sizes(), " and ", b.sym_sizes());
    const c10::SymInt cols = a.sym_size(-1);
    Tensor c = at::empty_symint(a.sym_sizes(), a.options());
    if (a.sym_numel() != 0) {
      dispatched<gated_fwd>("tigon::gated_fwd")
          .call(a.view_symint({-1, cols}), b.view_symint({-1, cols}), c.view_symint({-1, cols}), act, gate_multiplier,
                down_multiplier);
    }
    ctx->save_for_backward({a, b});
    ctx->saved_data["over"] = computed(a) && computed(b);
    ctx->saved_data["act"] = act;
    ctx->saved_data["gate_multiplier"] = gate_multiplier;
    ctx->saved_data["down_multiplier"] = down_multiplier;
    return c;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& a = saved[0];
    const Tensor& b = saved[1];
    const Tensor& dc = grads[0];
    const c10::SymInt cols = a.sym_size(-1);
    const bool over = ctx->saved_data["over"].toBool() && ctx->needs_input_grad(0) && ctx->needs_input_grad(1) &&
                      !overlap(a, b) && !overlap(dc, a) && !overlap(dc, b);
    const Tensor da = over ? a.detach() : at::empty_symint(a.sym_sizes(), a.options());
    const Tensor db = over ? b.detach() : at::empty_symint(a.sym_sizes(), a.options());
    if (a.sym_numel() != 0) {
      dispatched<gated_bwd>("tigon::gated_bwd")
          .call(rows_view(dc, cols), a.view_symint({-1, cols}), b.view_symint({-1, cols}), da.view_symint({-1, cols}),
                db.view_symint({-1, cols}), ctx->saved_data["act"].toInt(),
                ctx->saved_data["gate_multiplier"].toDouble(), ctx->saved_data["down_multiplier"].toDouble());
    }
    if (over) {
      torch::autograd::impl::bump_version(a);
      torch::autograd::impl::bump_version(b);
    }
    return {da, db, Tensor(), Tensor(), Tensor()};
  }
};

Tensor gated(const Tensor& a, const Tensor& b, std::int64_t act, double gate_multiplier, double down_multiplier) {
  return GatedFunction::apply(a, b, act, gate_multiplier, down_multiplier);
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("gated_fwd", &gated_fwd);
  m.impl("gated_bwd", &gated_bwd);
  m.impl("gated", &gated);
  m.impl("relu2_fwd", &relu2_fwd);
  m.impl("relu2_bwd", &relu2_bwd);
}

TORCH_LIBRARY_IMPL(tigon, Autograd, m) {
  m.impl("gated", &gated);
}

}  // namespace tigon_torch
