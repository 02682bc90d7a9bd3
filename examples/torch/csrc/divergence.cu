// The distillation divergences (tigon/loss/divergence.cuh): the generalised Jensen-Shannon
// divergence (beta 0 and 1: forward and reverse KL), PyTorch's KL-divergence loss and the total
// variation distance between a student's and a teacher's [rows, vocab] distributions, with
// optional labels (ignore_index), the four reductions, an upstream gradient on the device, and the
// student's gradient written into dx (which may be the student itself: in place).
//
// tigon.divergence(student, teacher, labels, grad_output, dx, loss, loss_rows, loss_elems, kind,
//                  student_input, teacher_input, reduction, ignore_index, beta, eps, temperature,
//                  grad_scale)
//   kind           0: GeneralizedJSD{beta}, 1: KLDiv{eps}, 2: TVD
//   *_input        0: log-probs, 1: probs, 2: logits (softmax(v / temperature) taken inside)
//   reduction      0: none, 1: sum, 2: mean, 3: batchmean (tigon::DivergenceReduction)
//   grad_output    fp32: one value (0-d or [1]) under sum / mean / batchmean; under none [rows]
//                  for kind 0 and [rows, vocab] (unit column stride) for kinds 1 and 2
//   loss           fp32, one element (not under none); loss_rows fp32 [rows] (each row's sum of
//                  element losses); loss_elems fp32 [rows, vocab] (each element's loss)
//
// The input forms compiled are the ones tigon_torch passes: kind 0 log-probs / log-probs (Liger's
// JSD) and logits / logits (the fused linear JSD's chunks), kind 1 log-probs / probs and log-probs /
// log-probs (KLDiv's log_target False / True), kind 2 probs / probs (TVD); another combination
// raises NotImplementedError. Dtypes: the student float32, float16 or bfloat16; the teacher the
// student's dtype or float32 (the Python side casts other teachers to float32). Labels int64 or
// int32 (int32 labels are widened to int64 on the device first).
#include "common.h"

#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include <tigon/loss/divergence.cuh>

namespace tigon_torch {

using tigon::DivergenceInput;

// tigon's functors, each taking only the input forms tigon_torch passes, so that only those kernel
// instances are compiled (divergence() compiles one per form combination its functor accepts).
// Outside the anonymous namespace: the kernels instantiated on them keep external linkage.
struct JsdOp : tigon::GeneralizedJSD {
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s == t && (s == DivergenceInput::log_probs || s == DivergenceInput::logits);
  }
};

struct KlDivOp : tigon::KLDiv {
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s == DivergenceInput::log_probs && (t == DivergenceInput::probs || t == DivergenceInput::log_probs);
  }
};

struct TvdOp : tigon::TVD {
  static constexpr bool accepts(DivergenceInput s, DivergenceInput t) {
    return s == DivergenceInput::probs && t == DivergenceInput::probs;
  }
};

namespace {

enum Kind : std::int64_t { kJsd = 0, kKlDiv = 1, kTvd = 2 };

// Calls f(tag<T>, tag<TT>) for the student's dtype T and the teacher's TT (T, or float32).
template <class F>
void dispatch_student_teacher(at::ScalarType s, at::ScalarType t, const char* op, F&& f) {
  TORCH_CHECK_TYPE(t == s || t == at::kFloat, op, ": the teacher's dtype (", t,
                   ") must be the student's (", s, ") or float32");
  dispatch_float(s, op, "student", [&](auto ts) {
    using T = typename decltype(ts)::type;
    if (t == s) {
      f(tag<T>{}, tag<T>{});
    } else if constexpr (!std::is_same_v<T, float>) {
      f(tag<T>{}, tag<float>{});
    }
  });
}

void divergence(const Tensor& student, const Tensor& teacher, const OptTensor& labels, const OptTensor& grad_output,
                const OptTensor& dx, const OptTensor& loss, const OptTensor& loss_rows,
                const OptTensor& loss_elems, std::int64_t kind, std::int64_t student_input,
                std::int64_t teacher_input, std::int64_t reduction, std::int64_t ignore_index, double beta,
                double eps, double temperature, double grad_scale) {
  constexpr const char* op = "tigon.divergence";
  const c10::cuda::CUDAGuard guard(student.device());
  TORCH_CHECK_VALUE(kind == kJsd || kind == kKlDiv || kind == kTvd, op,
                    ": kind must be 0 (generalised JSD), 1 (KL divergence) or 2 (TVD), got ", kind);
  const Rows X = rows_of(student, student, student.scalar_type(), op, "student");
  const Rows Y = rows_of(teacher, student, teacher.scalar_type(), op, "teacher");
  TORCH_CHECK_VALUE(Y.rows == X.rows, op, ": the student has ", X.rows, " rows, the teacher ", Y.rows);
  Rows D;
  if (dx) {
    D = rows_of(*dx, student, student.scalar_type(), op, "dx");
    same_shape(X, D, op, "student", "dx");
  }
  Tensor lab;
  if (labels) {
    check_cuda(*labels, student, op, "labels");
    const at::ScalarType lt = labels->scalar_type();
    TORCH_CHECK_TYPE(lt == at::kLong || lt == at::kInt, op, ": 'labels' must be int64 or int32, got ", lt);
    lab = lt == at::kLong ? *labels : labels->to(at::kLong);
    vector_of(lab, student, at::kLong, X.rows, op, "labels");
  }
  const bool none = reduction == static_cast<std::int64_t>(tigon::DivergenceReduction::none);
  const float* go = nullptr;
  std::int64_t go_stride = 0;
  if (grad_output) {
    const Tensor& g = *grad_output;
    check_cuda(g, student, op, "grad_output");
    TORCH_CHECK_TYPE(g.scalar_type() == at::kFloat, op, ": 'grad_output' must be float32, got ", g.scalar_type());
    if (!none) {
      TORCH_CHECK_VALUE(g.numel() == 1, op, ": 'grad_output' must hold one value under a reduction, has ",
                        g.numel());
      go = ptr<const float>(g);
    } else if (kind == kJsd) {
      go = static_cast<const float*>(vector_of(g, student, at::kFloat, X.rows, op, "grad_output"));
    } else {
      const Rows G = rows_of(g, student, at::kFloat, op, "grad_output");
      same_shape(X, G, op, "student", "grad_output");
      go = static_cast<const float*>(G.ptr);
      go_stride = G.stride;
    }
  }
  float* loss_p = nullptr;
  if (loss) {
    check_cuda(*loss, student, op, "loss");
    TORCH_CHECK_VALUE(loss->numel() == 1, op, ": 'loss' must hold one element");
    TORCH_CHECK_TYPE(loss->scalar_type() == at::kFloat, op, ": 'loss' must be float32");
    loss_p = ptr<float>(*loss);
  }
  float* rows_p = nullptr;
  if (loss_rows) rows_p = static_cast<float*>(vector_of(*loss_rows, student, at::kFloat, X.rows, op, "loss_rows"));
  Rows E;
  if (loss_elems) {
    E = rows_of(*loss_elems, student, at::kFloat, op, "loss_elems");
    same_shape(X, E, op, "student", "loss_elems");
  }
  if (X.rows == 0) {  // tigon takes at least one row: an empty batch's loss is 0
    if (loss) loss->zero_();
    return;
  }
  dispatch_student_teacher(student.scalar_type(), teacher.scalar_type(), op, [&](auto ts, auto tt) {
    using T = typename decltype(ts)::type;
    using TT = typename decltype(tt)::type;
    tigon::DivergenceArgs<T, TT, std::int64_t> a;
    a.student = static_cast<const T*>(X.ptr);
    a.student_input = static_cast<DivergenceInput>(student_input);
    a.student_stride = X.stride;
    a.teacher = static_cast<const TT*>(Y.ptr);
    a.teacher_input = static_cast<DivergenceInput>(teacher_input);
    a.teacher_stride = Y.stride;
    a.rows = X.rows;
    a.vocab = X.cols;
    a.teacher_vocab = Y.cols;
    a.temperature = static_cast<float>(temperature);
    a.labels = labels ? lab.data_ptr<std::int64_t>() : nullptr;
    a.ignore_index = ignore_index;
    a.reduction = static_cast<tigon::DivergenceReduction>(reduction);
    a.dx = static_cast<T*>(D.ptr);
    a.dx_stride = D.stride;
    a.grad_scale = static_cast<float>(grad_scale);
    a.grad_output = go;
    a.grad_output_stride = go_stride;
    a.loss = loss_p;
    a.loss_rows = rows_p;
    a.loss_elems = static_cast<float*>(E.ptr);
    a.loss_elems_stride = E.stride;
    auto run = [&](const auto& div) {
      std::size_t bytes = 0;
      check_status(tigon::divergence_workspace_bytes(a, bytes));
      Tensor ws;
      if (bytes > 0) {
        ws = workspace(bytes, student);
        a.workspace = ws.data_ptr();
        a.workspace_bytes = bytes;
      }
      check_status(tigon::divergence(a, div, current_stream(student)));
    };
    if (kind == kJsd) {
      JsdOp d;
      d.beta = static_cast<float>(beta);
      run(d);
    } else if (kind == kKlDiv) {
      KlDivOp d;
      d.eps = static_cast<float>(eps);
      run(d);
    } else {
      run(TvdOp{});
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) { m.impl("divergence", &divergence); }

}  // namespace tigon_torch
