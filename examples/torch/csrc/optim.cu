// The multi-tensor AdamW / Adam step and the gradients' global norm, through tigon/optim/adamw.cuh.
//
// The learning rate is a device scalar (a Tensor lr: read at every step, graph replays included) or a
// constant passed in fp64 (a float lr, as torch's fused AdamW takes it).
//
// adamw_plan stages a parameter list's table into pinned host memory and copies it into a new device
// workspace in the stream's order (no host synchronisation; torch's pinned-memory allocator keeps the
// staging buffer until the copy is done) and returns that workspace: the plan. adamw_step and
// adamw_grad_norm take the same lists with their plan; the lists are validated on every call and must
// be the ones planned (same tensors, same order).
#include "common.h"

#include <torch/library.h>

#include <vector>

#include <tigon/optim/adamw.cuh>

namespace tigon_torch {
namespace {

using TensorList = std::vector<Tensor>;

// tigon_torch/optim.py's plan_bytes() (the fake kernel's output size) mirrors the plan's layout.
static_assert(sizeof(tigon::detail::AdamWTensorEntry) == 56 && tigon::detail::kAdamWChunk == 32768,
              "tigon_torch/optim.py: _TENSOR_ENTRY_BYTES and _CHUNK");

// The lists as tigon's parameter list of P parameters and S moments. Each tensor contiguous on the
// parameters' device; gradients in the parameters' dtype; masters (none, or one per parameter) fp32.
template <class P, class S>
std::vector<tigon::AdamWTensor<P, S>> tensor_list(const TensorList& params, const TensorList& grads,
                                                   const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                                                   const TensorList& masters, const char* op) {
  const std::size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n, op,
                    ": params, grads, exp_avgs and exp_avg_sqs must have one entry each per parameter (",
                    n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ")");
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n, op, ": masters must be empty or one per parameter, got ",
                    masters.size(), " for ", n);
  const at::ScalarType pt = params[0].scalar_type(), st = exp_avgs[0].scalar_type();
  auto check = [&](const Tensor& t, const Tensor& p, at::ScalarType dt, const char* name, std::size_t i) {
    TORCH_CHECK_VALUE(t.device() == params[0].device(), op, ": ", name, "[", i, "] is on ", t.device(), ", expected ",
                      params[0].device());
    TORCH_CHECK_TYPE(t.scalar_type() == dt, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(), ", expected ", dt);
    TORCH_CHECK_VALUE(t.numel() == p.numel(), op, ": ", name, "[", i, "] has ", t.numel(), " elements, its parameter ",
                      p.numel());
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(!t.is_sparse(), op, ": ", name, "[", i, "] is sparse; the step takes dense tensors");
  };
  std::vector<tigon::AdamWTensor<P, S>> list(n);
  for (std::size_t i = 0; i < n; ++i) {
    const Tensor& p = params[i];
    check_cuda(p, params[0], op, "params[i]");
    check(p, p, pt, "params", i);
    check(grads[i], p, pt, "grads", i);
    check(exp_avgs[i], p, st, "exp_avgs", i);
    check(exp_avg_sqs[i], p, st, "exp_avg_sqs", i);
    if (!masters.empty()) check(masters[i], p, at::kFloat, "masters", i);
    list[i] = {.param = ptr<P>(p), .grad = ptr<P>(grads[i]), .exp_avg = ptr<S>(exp_avgs[i]),
               .exp_avg_sq = ptr<S>(exp_avg_sqs[i]), .master = masters.empty() ? nullptr : ptr<float>(masters[i]),
               .numel = p.numel()};
  }
  return list;
}

// Calls f(tag<P>, tag<S>) for the parameters' dtype and the moments' (fp32 or the parameters').
template <class F>
void dispatch_ps(const TensorList& params, const TensorList& exp_avgs, const char* op, F&& f) {
  TORCH_CHECK_VALUE(!params.empty(), op, ": the parameter list is empty");
  TORCH_CHECK_VALUE(!exp_avgs.empty(), op, ": exp_avgs is empty");
  const at::ScalarType pt = params[0].scalar_type(), st = exp_avgs[0].scalar_type();
  TORCH_CHECK_TYPE(st == pt || st == at::kFloat, op, ": the moments' dtype (", st,
                   ") must be float32 or the parameters' (", pt, ")");
  dispatch_float(pt, op, "params", [&](auto tp) {
    using P = typename decltype(tp)::type;
    if (st == pt) {
      f(tag<P>{}, tag<P>{});
    } else if constexpr (!std::is_same_v<P, float>) {
      f(tag<P>{}, tag<float>{});
    }
  });
}

// A 0-d or one-element fp32 tensor on the parameters' device (lr, step, grad_scale, clip_factor,
// found_inf), or null.
float* scalar_of(const OptTensor& t, const Tensor& ref, const char* op, const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, ref, op, name);
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": '", name, "' must hold one value, got ", t->numel());
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": '", name, "' has dtype ", t->scalar_type(),
                   ", expected float32");
  return t->data_ptr<float>();
}

template <class P, class S>
tigon::AdamWPlan plan_view(const std::vector<tigon::AdamWTensor<P, S>>& list, const Tensor& plan, const Tensor& ref,
                           const char* op) {
  check_cuda(plan, ref, op, "plan");
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kByte && plan.dim() == 1 && plan.is_contiguous(), op,
                   ": 'plan' must be the contiguous uint8 tensor adamw_plan returned");
  tigon::AdamWPlan view;
  check_status(tigon::adamw_plan_view(list.data(), static_cast<int>(list.size()), plan.data_ptr(),
                                      static_cast<std::size_t>(plan.numel()), view));
  return view;
}

Tensor adamw_plan(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                  const TensorList& exp_avg_sqs, const TensorList& masters) {
  constexpr const char* op = "tigon.adamw_plan";
  Tensor out;
  dispatch_ps(params, exp_avgs, op, [&](auto tp, auto ts) {
    using P = typename decltype(tp)::type;
    using S = typename decltype(ts)::type;
    const c10::cuda::CUDAGuard guard(params[0].device());
    const auto list = tensor_list<P, S>(params, grads, exp_avgs, exp_avg_sqs, masters, op);
    std::size_t bytes = 0;
    check_status(tigon::adamw_workspace_bytes(list.data(), static_cast<int>(list.size()), bytes));
    const auto n = static_cast<std::int64_t>(bytes);
    Tensor staging = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    check_status(tigon::adamw_plan_stage(list.data(), static_cast<int>(list.size()), staging.data_ptr(), bytes));
    out = at::empty({n}, params[0].options().dtype(at::kByte));
    out.copy_(staging, /*non_blocking=*/true);
  });
  return out;
}

// Calls f(tag<P>, tag<S>, the plan's view, the first parameter) for the validated lists and their plan,
// under the parameters' device guard.
template <class F>
void with_plan(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& masters, const Tensor& plan, const char* op, F&& f) {
  dispatch_ps(params, exp_avgs, op, [&](auto tp, auto ts) {
    using P = typename decltype(tp)::type;
    using S = typename decltype(ts)::type;
    const Tensor& ref = params[0];
    const c10::cuda::CUDAGuard guard(ref.device());
    const auto list = tensor_list<P, S>(params, grads, exp_avgs, exp_avg_sqs, masters, op);
    f(tp, ts, plan_view(list, plan, ref, op), ref);
  });
}

void adamw_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& masters, const Tensor& plan, const OptTensor& lr,
                double lr_value, const Tensor& step, double beta1, double beta2, double eps, double weight_decay,
                bool decoupled, const OptTensor& grad_scale, const OptTensor& clip_factor, const OptTensor& found_inf,
                bool stochastic_rounding, std::int64_t seed) {
  constexpr const char* op = "tigon.adamw_step";
  with_plan(params, grads, exp_avgs, exp_avg_sqs, masters, plan, op,
            [&](auto tp, auto ts, const tigon::AdamWPlan& view, const Tensor& ref) {
              using P = typename decltype(tp)::type;
              using S = typename decltype(ts)::type;
              tigon::AdamWHyper h{.beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                                  .decoupled = decoupled, .lr = scalar_of(lr, ref, op, "lr"),
                                  .lr_value = lr.has_value() ? std::nullopt : std::optional<double>(lr_value),
                                  .step = scalar_of(step, ref, op, "step"),
                                  .grad_scale = scalar_of(grad_scale, ref, op, "grad_scale"),
                                  .clip_factor = scalar_of(clip_factor, ref, op, "clip_factor"),
                                  .found_inf = scalar_of(found_inf, ref, op, "found_inf"),
                                  .stochastic_rounding = stochastic_rounding,
                                  .seed = static_cast<std::uint64_t>(seed)};
              check_status(tigon::adamw_step<P, S>(view, h, current_stream(ref)));
            });
}

void adamw_grad_norm(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                     const TensorList& exp_avg_sqs, const TensorList& masters, const Tensor& plan, double max_norm,
                     const OptTensor& norm, const OptTensor& factor, const OptTensor& grad_scale) {
  constexpr const char* op = "tigon.adamw_grad_norm";
  with_plan(params, grads, exp_avgs, exp_avg_sqs, masters, plan, op,
            [&](auto tp, auto ts, const tigon::AdamWPlan& view, const Tensor& ref) {
              using P = typename decltype(tp)::type;
              using S = typename decltype(ts)::type;
              const std::size_t bytes = tigon::grad_norm_workspace_bytes(view);
              const Tensor ws = workspace(bytes, ref);
              check_status(tigon::grad_norm_clip<P, S>(view, static_cast<float>(max_norm),
                                                       scalar_of(norm, ref, op, "norm"),
                                                       scalar_of(factor, ref, op, "factor"), workspace_ptr(ws), bytes,
                                                       current_stream(ref),
                                                       scalar_of(grad_scale, ref, op, "grad_scale")));
            });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("adamw_plan", &adamw_plan);
  m.impl("adamw_step", &adamw_step);
  m.impl("adamw_grad_norm", &adamw_grad_norm);
}

}  // namespace tigon_torch
