// tigon.cross_entropy_loss and tigon.linear_cross_entropy_loss: the losses of TigonCrossEntropyFunction
// and TigonFusedLinearCrossEntropyFunction (their calls without token accuracy, predicted tokens or a
// separate z-loss, which is how Hugging Face, Liger's modules and the patches call them) as operators
// whose autograd is C++: the eager target check, the kernel calls and the backward's scaling run with no
// Python in their path. The kernels and every result are those of the Python Functions (functions.py
// documents the semantics); the operators they call go through the dispatcher, so the test suite's CPU
// reference mode runs them over its reference kernels. Host code only.
#include "common.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

namespace tigon_torch {
namespace {

using CrossEntropySig = void(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                             const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                             std::int64_t, double, double, double, std::int64_t, double);

const auto& cross_entropy_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tigon::cross_entropy", "").typed<CrossEntropySig>();
  return op;
}

const auto& scale_rows_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tigon::scale_rows", "").typed<void(const Tensor&, const Tensor&)>();
  return op;
}

const auto& target_range_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tigon::target_range", "")
                             .typed<std::vector<std::int64_t>(const Tensor&, std::int64_t)>();
  return op;
}

// The prefix of the out-of-range message, which the Python side turns into TargetOutOfRangeError.
constexpr const char* kOutOfRange = "tigon_torch: target ";

// target as a contiguous 1-D tensor (itself when it is one).
Tensor flat(const Tensor& target) {
  return target.dim() == 1 && target.is_contiguous() ? target : target.reshape({-1}).contiguous();
}

// check_targets of functions.py: one tigon.target_range call (a launch and a host synchronisation);
// returns the number of targets that are not ignore_index.
std::int64_t check_targets(const Tensor& target, std::int64_t vocab, std::int64_t ignore_index) {
  if (target.numel() == 0 || vocab < 1) return 0;
  const std::vector<std::int64_t> r = target_range_op().call(target, ignore_index);
  if (r[0] >= 0 && r[1] < vocab) return r[2];
  TORCH_CHECK_VALUE(false, kOutOfRange, r[0] < 0 ? r[0] : r[1],
                    " is out of bounds: every target must be ignore_index (", ignore_index,
                    ") or a class in [0, ", vocab, ") (vocabulary size ", vocab, ")");
}

// _kept_rows of functions.py: the rows whose target is not ignore_index, when at least 1 / kSkipShare of
// the rows are ignored (count: check_targets' count); else undefined.
constexpr std::int64_t kSkipShare = 32;

Tensor kept_rows(const Tensor& target, std::int64_t count, std::int64_t ignore_index) {
  const std::int64_t rows = target.numel();
  if (count <= 0 || (rows - count) * kSkipShare < rows) return Tensor();
  return at::nonzero_static(target.ne(ignore_index), count).reshape({-1});
}

// _class_weights of functions.py: float32, contiguous, on the logits' device.
Tensor class_weights(const std::optional<Tensor>& w, std::int64_t vocab, const Tensor& logits) {
  if (!w) return Tensor();
  TORCH_CHECK_VALUE(at::isFloatingType(w->scalar_type()),
                    "tigon_torch: class weights must be a floating-point tensor, got ", w->scalar_type());
  TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == vocab, "tigon_torch: class weights must have shape [", vocab,
                    "], got ", w->sizes());
  return w->to(logits.device(), at::kFloat).contiguous();
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  // logits [rows, V] contiguous; target [rows] (any shape of rows elements); returns the loss ([] or
  // [rows] for reduction none) in out_dtype. needs_grad: grad mode is on and the logits require a
  // gradient (the forward runs with grad mode off).
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& logits, const Tensor& target,
                        const std::optional<Tensor>& weight, std::int64_t ignore_index, double z_scale,
                        double smoothing, std::int64_t reduction, double softcap, bool in_place,
                        at::ScalarType out_dtype, bool check, bool needs_grad) {
    const std::int64_t rows = logits.size(0), vocab = logits.size(1);
    const Tensor t = flat(target);
    if (check) check_targets(t, vocab, ignore_index);  // before the kernel, which may write the gradient
    const Tensor cw = class_weights(weight, vocab, logits);
    const auto f32 = logits.options().dtype(at::kFloat);
    const Tensor loss = reduction != 0 ? at::empty({}, f32) : Tensor();
    const Tensor loss_rows = reduction == 0 ? at::empty({rows}, f32) : Tensor();
    // The gradient for an upstream gradient of 1 in the forward's pass (over the logits when in_place,
    // else into a buffer of its own), scaled by the backward; float16 logits take the two-pass form.
    const bool one_pass = logits.scalar_type() != at::kHalf;
    in_place = in_place && logits.requires_grad() && one_pass;
    const bool early = !in_place && needs_grad && one_pass && rows > 0;
    const Tensor grad = early ? at::empty_like(logits, at::MemoryFormat::Contiguous) : Tensor();
    if (rows > 0) {
      cross_entropy_op().call(logits, t, opt(cw), std::nullopt, in_place ? OptTensor(logits) : opt(grad), opt(loss),
                              opt(loss_rows), std::nullopt, std::nullopt, std::nullopt, ignore_index, smoothing,
                              z_scale, softcap, reduction, 1.0);
      // The operator wrote the logits without bumping their version counter: a node that saved them
      // (a softcap's tanh, say) raises at its backward instead of reading the gradient.
      if (in_place) torch::autograd::impl::bump_version(logits);
    } else {
      (reduction != 0 ? loss : loss_rows).zero_();
    }
    ctx->saved_data["in_place"] = in_place;
    ctx->saved_data["consumed"] = false;
    if (in_place) {
      ctx->save_for_backward({logits.detach()});  // the gradient, over the logits' memory
    } else if (logits.requires_grad()) {
      ctx->save_for_backward({logits, t, cw});
      if (early) ctx->saved_data["early"] = grad;
      ctx->saved_data["ignore_index"] = ignore_index;
      ctx->saved_data["reduction"] = reduction;
      ctx->saved_data["smoothing"] = smoothing;
      ctx->saved_data["z_scale"] = z_scale;
      ctx->saved_data["softcap"] = softcap;
    }
    const Tensor& out = reduction == 0 ? loss_rows : loss;
    return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(12);
    const Tensor& go_in = grads[0];
    if (!go_in.defined() || !ctx->needs_input_grad(0)) return out;
    const auto saved = ctx->get_saved_variables();
    if (ctx->saved_data["in_place"].toBool()) {
      TORCH_CHECK(!ctx->saved_data["consumed"].toBool(),
                  "tigon_torch: the in-place cross-entropy's gradient (written over the logits in the forward) was "
                  "already scaled by a first backward; a second backward through the same graph "
                  "(retain_graph=True) needs in_place=False");
      ctx->saved_data["consumed"] = true;
      const Tensor& dx = saved[0];
      if (dx.size(0) > 0) scale_rows_op().call(dx, go_in.to(at::kFloat).reshape({-1}).contiguous());
      out[0] = dx;
      return out;
    }
    const Tensor& logits = saved[0];
    const Tensor& t = saved[1];
    const Tensor& cw = saved[2];
    const std::int64_t reduction = ctx->saved_data["reduction"].toInt();
    Tensor go = go_in.to(at::kFloat);
    go = reduction != 0 ? go.reshape({}) : go.reshape({-1}).contiguous();
    auto early = ctx->saved_data.find("early");
    if (early != ctx->saved_data.end() && early->second.isTensor()) {
      // Handed out once (autograd may keep it as the logits' .grad): a second backward recomputes.
      Tensor dx = early->second.toTensor();
      early->second = c10::IValue();
      scale_rows_op().call(dx, go);
      out[0] = dx;
      return out;
    }
    Tensor dx = at::empty_like(logits, at::MemoryFormat::Contiguous);
    if (logits.size(0) > 0) {
      cross_entropy_op().call(logits, t, opt(cw), go, dx, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                              std::nullopt, ctx->saved_data["ignore_index"].toInt(),
                              ctx->saved_data["smoothing"].toDouble(), ctx->saved_data["z_scale"].toDouble(),
                              ctx->saved_data["softcap"].toDouble(), reduction, 1.0);
    }
    out[0] = dx;
    return out;
  }
};

// reduction: 0 none, 1 sum, 2 mean; softcap 0: none; fp32: the loss in float32 (else in the logits'
// dtype); check: run the eager target check (the caller decides when it may synchronise).
Tensor cross_entropy_loss(const Tensor& logits, const Tensor& target, const std::optional<Tensor>& weight,
                          std::int64_t ignore_index, double lse_square_scale, double label_smoothing,
                          std::int64_t reduction, double softcap, bool in_place, bool fp32, bool check) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "tigon_torch: _input must be [BT, V], got shape ", logits.sizes());
  TORCH_CHECK_VALUE(logits.is_contiguous(), "tigon.cross_entropy_loss: 'logits' must be contiguous");
  TORCH_CHECK_VALUE(target.device() == logits.device(), "tigon.cross_entropy_loss: 'target' is on ", target.device(),
                    ", expected ", logits.device());
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2,
                    "tigon.cross_entropy_loss: reduction must be 0 (none), 1 (sum) or 2 (mean), got ", reduction);
  const bool needs_grad = at::GradMode::is_enabled() && logits.requires_grad();
  return CrossEntropyFunction::apply(logits, target, weight, ignore_index, lse_square_scale, label_smoothing,
                                     reduction, softcap, in_place, fp32 ? at::kFloat : logits.scalar_type(), check,
                                     needs_grad);
}

// ------------------------------------------------------------------------------------------------
// tigon.linear_cross_entropy_loss: TigonFusedLinearCrossEntropyFunction's loss for reductions mean and
// sum (the gradients computed in the forward, scaled by the upstream gradient in the backward).
// ------------------------------------------------------------------------------------------------

using LinearCrossEntropySig = void(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                   const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                   const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                   const OptTensor&, std::int64_t, double, double, double, std::int64_t, double,
                                   bool, std::int64_t);

const auto& linear_cross_entropy_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tigon::linear_cross_entropy", "")
                             .typed<LinearCrossEntropySig>();
  return op;
}

// A gradient computed for an upstream gradient of 1 as the forward keeps it (_saved_grad of
// functions.py): in dtype, except for float16, which stays float32 until the upstream scale.
Tensor saved_grad(const Tensor& t, at::ScalarType dtype) {
  return !t.defined() || dtype == at::kHalf || t.scalar_type() == dtype ? t : t.to(dtype);
}

// _scaled_grad of functions.py: t times the upstream scalar go, in dtype; in place through scale_rows
// (which leaves t untouched when go is exactly 1) unless the graph is kept for another backward.
Tensor scaled_grad(const Tensor& t, const Tensor& go, at::ScalarType dtype) {
  if (!t.defined()) return t;
  Tensor r;
  if (torch::autograd::get_current_graph_task_keep_graph()) {
    r = t * go.to(t.scalar_type());
  } else if (t.is_contiguous() && t.numel() > 0) {
    const std::int64_t n = t.dim() > 1 ? t.size(-1) : (t.numel() % 1024 == 0 ? 1024 : t.numel());
    scale_rows_op().call(t.view({-1, n}), go.to(at::kFloat).reshape({1}).contiguous());
    r = t;
  } else {
    r = t.mul_(go.to(t.scalar_type()));
  }
  return r.scalar_type() == dtype ? r : r.to(dtype);
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  // x [..., H], weight [V, H], bias [V] or none, target [rows]; returns the float32 loss. want_*: grad
  // mode is on and that input requires a gradient.
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x_in, const Tensor& w_in,
                        const std::optional<Tensor>& b_in, const Tensor& target, const std::optional<Tensor>& ce_weight,
                        std::int64_t ignore_index, double z_scale, double smoothing, std::int64_t reduction,
                        double softcap, bool accum_fp32, bool token_scaling, std::int64_t chunk, bool check,
                        bool want_dx, bool want_dw, bool want_db) {
    const at::ScalarType in_dtype = x_in.scalar_type(), w_dtype = w_in.scalar_type();
    const at::ScalarType b_dtype = b_in ? b_in->scalar_type() : w_dtype;
    // _head_operands: under CUDA autocast the operands in the autocast dtype, as the unfused head's
    // matmul would have them; otherwise one dtype.
    Tensor x = x_in, w = w_in, b = b_in ? *b_in : Tensor();
    if (at::autocast::is_autocast_enabled(at::kCUDA)) {
      const at::ScalarType dt = at::autocast::get_autocast_dtype(at::kCUDA);
      x = x.to(dt), w = w.to(dt);
      if (b.defined()) b = b.to(dt);
    }
    TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type() && (!b.defined() || b.scalar_type() == x.scalar_type()),
                     "tigon_torch: _input (", x.scalar_type(), "), weight (", w.scalar_type(),
                     ") and bias must have one dtype (or run under autocast)");
    const std::int64_t hidden = x.size(-1);
    const Tensor x2 = rows_view(x, hidden);
    w = w.contiguous();
    if (b.defined()) b = b.contiguous();
    Tensor t = flat(target);
    const std::int64_t rows = x2.size(0), vocab = w.size(0);
    TORCH_CHECK_VALUE(t.size(0) == rows, "tigon_torch: target has ", t.size(0), " tokens, _input ", rows);
    // The target check before any gradient is computed; the rows the op runs on: every row, or those
    // whose target is not ignored (kept_rows).
    const Tensor keep = check ? kept_rows(t, check_targets(t, vocab, ignore_index), ignore_index) : Tensor();
    const Tensor xk = keep.defined() ? x2.index_select(0, keep) : x2;
    if (keep.defined()) t = t.index_select(0, keep);
    const Tensor cw = class_weights(ce_weight, vocab, x2);
    // _head_grad_dtype: the weight's dtype, or float32 when asked for, for float32 / float16 weights and
    // for a weight that autocast casts to another dtype.
    const bool fp32_grads = accum_fp32 || w_dtype == at::kFloat || w_dtype == at::kHalf || w.scalar_type() != w_dtype;
    const at::ScalarType gdt = fp32_grads ? at::kFloat : w_dtype;
    want_db = want_db && b.defined();
    const auto dev = x2.options();
    Tensor dx = want_dx ? at::empty_like(xk, at::MemoryFormat::Contiguous) : Tensor();
    const Tensor dw = want_dw ? at::empty(w.sizes(), dev.dtype(gdt)) : Tensor();
    const Tensor db = want_db ? at::empty({vocab}, dev.dtype(gdt)) : Tensor();
    const Tensor loss = at::empty({}, dev.dtype(at::kFloat));
    if (rows > 0) {
      linear_cross_entropy_op().call(xk, w, opt(b), t, opt(cw), std::nullopt, opt(dx), opt(dw), opt(db), loss,
                                     std::nullopt, std::nullopt, std::nullopt, std::nullopt, ignore_index, smoothing,
                                     z_scale, softcap, reduction, 1.0, token_scaling, chunk);
    } else {
      loss.zero_();
      if (dw.defined()) dw.zero_();
      if (db.defined()) db.zero_();
    }
    if (dx.defined() && keep.defined()) dx = at::zeros_like(x2, at::MemoryFormat::Contiguous).index_copy_(0, keep, dx);
    ctx->save_for_backward({saved_grad(dx, in_dtype), saved_grad(dw, w_dtype), saved_grad(db, b_dtype)});
    ctx->saved_data["dtypes"] = std::vector<std::int64_t>{static_cast<std::int64_t>(in_dtype),
                                                          static_cast<std::int64_t>(w_dtype),
                                                          static_cast<std::int64_t>(b_dtype)};
    ctx->saved_data["shape"] = x_in.sizes();
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(17);
    const Tensor& go_in = grads[0];
    if (!go_in.defined() || !(ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2))) {
      return out;
    }
    const auto saved = ctx->get_saved_variables();
    const std::vector<std::int64_t> dtypes = ctx->saved_data["dtypes"].toIntVector();
    const Tensor go = go_in.reshape({});
    for (int i = 0; i < 3; ++i) out[i] = scaled_grad(saved[i], go, static_cast<at::ScalarType>(dtypes[i]));
    if (out[0].defined()) out[0] = out[0].view(ctx->saved_data["shape"].toIntVector());
    return out;
  }
};

// reduction: 1 sum or 2 mean (reduction none takes TigonFusedLinearCrossEntropyFunction); accum_fp32:
// Liger's accum_dtype=torch.float32; chunk: tokens per chunk (0: tigon's default); check: run the eager
// target check.
Tensor linear_cross_entropy_loss(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                 const Tensor& target, const std::optional<Tensor>& ce_weight, std::int64_t ignore_index,
                                 double lse_square_scale, double label_smoothing, std::int64_t reduction,
                                 double softcap, bool accum_fp32, bool token_scaling, std::int64_t chunk, bool check) {
  constexpr const char* op = "tigon.linear_cross_entropy_loss";
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 2, op, ": x must be [..., H] and weight [V, H], got ", x.sizes(),
                    " and ", weight.sizes());
  TORCH_CHECK_VALUE(reduction == 1 || reduction == 2, op, ": reduction must be 1 (sum) or 2 (mean), got ", reduction);
  for (const Tensor* t : {&weight, &target}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), op, ": every tensor must be on ", x.device(), ", got one on ",
                      t->device());
  }
  const bool grad = at::GradMode::is_enabled();
  return LinearCrossEntropyFunction::apply(x, weight, bias, target, ce_weight, ignore_index, lse_square_scale,
                                           label_smoothing, reduction, softcap, accum_fp32, token_scaling, chunk,
                                           check, grad && x.requires_grad(), grad && weight.requires_grad(),
                                           grad && bias && bias->requires_grad());
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("cross_entropy_loss", &cross_entropy_loss);
  m.impl("linear_cross_entropy_loss", &linear_cross_entropy_loss);
}

TORCH_LIBRARY_IMPL(tigon, Autograd, m) {
  m.impl("cross_entropy_loss", &cross_entropy_loss);
  m.impl("linear_cross_entropy_loss", &linear_cross_entropy_loss);
}

}  // namespace tigon_torch
