// The tigon operator library: schemas of every operator (implementations for CUDA are registered
// by the other source files). Outputs are arguments, allocated by the Python side and marked mutable (a!),
// so the operators return nothing and torch.compile can functionalise them; rms_norm, layer_norm,
// add_rms_norm, gated, cross_entropy_loss and linear_cross_entropy_loss, which return their outputs and
// carry their autograd in C++ for eager calls (cross_entropy_loss writes the gradient over the logits
// when in_place), are the exceptions, and target_range, the losses' eager target check, which returns three integers
// (the smallest and largest target, the count of targets that are not ignore_index; it synchronises the host, so
// nothing calls it under torch.compile or CUDA-graph capture).
#include <torch/library.h>

TORCH_LIBRARY(tigon, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, Tensor(a!) y, Tensor(b!)? rstd, float eps, float offset, "
        "int casting) -> ()");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? rstd, Tensor(a!) dx, Tensor(b!)? dweight, "
        "float eps, float offset, int casting) -> ()");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, float offset, int casting, bool in_place) -> Tensor");
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!) y, Tensor(b!) mean, "
        "Tensor(c!) rstd, float eps) -> ()");
  m.def("layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, Tensor(a!) dx, "
        "Tensor(b!)? dweight, Tensor(c!)? dbias) -> ()");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("add_rms_norm_fwd(Tensor x, Tensor residual, Tensor? weight, Tensor(a!) y, Tensor(b!) sum, "
        "Tensor(c!)? rstd, float eps, float offset, int casting) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, int casting, "
        "bool in_place) -> (Tensor, Tensor)");
  m.def("add_rms_norm_bwd(Tensor dy, Tensor? dsum, Tensor sum, Tensor? weight, Tensor? rstd, Tensor(a!) dx, "
        "Tensor(b!)? dweight, float eps, float offset, int casting) -> ()");
  m.def("rope(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor? position_ids, Tensor(a!) q_out, "
        "Tensor(b!)? k_out, bool backward, bool interleaved, int[] sections=[]) -> ()");
  m.def("gated_fwd(Tensor a, Tensor b, Tensor(a!) c, int act, float gate_multiplier, "
        "float down_multiplier) -> ()");
  m.def("gated_bwd(Tensor dc, Tensor a, Tensor b, Tensor(a!) da, Tensor(b!) db, int act, "
        "float gate_multiplier, float down_multiplier) -> ()");
  m.def("gated(Tensor a, Tensor b, int act, float gate_multiplier, float down_multiplier) -> Tensor");
  m.def("relu2_fwd(Tensor a, Tensor(a!) c) -> ()");
  m.def("relu2_bwd(Tensor dc, Tensor a, Tensor(a!) da) -> ()");
  m.def("cross_entropy(Tensor logits, Tensor target, Tensor? class_weights, Tensor? grad_output, "
        "Tensor(a!)? dlogits, Tensor(b!)? loss, Tensor(c!)? loss_rows, Tensor(d!)? z_loss, Tensor(e!)? lse, "
        "Tensor(f!)? argmax, int ignore_index, float label_smoothing, float z_loss_scale, float softcap, "
        "int reduction, float grad_scale) -> ()");
  m.def("cross_entropy_loss(Tensor(a!) logits, Tensor target, Tensor? weight, int ignore_index, "
        "float lse_square_scale, float label_smoothing, int reduction, float softcap, bool in_place, bool fp32, "
        "bool check) -> Tensor");
  m.def("linear_cross_entropy_loss(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? ce_weight, "
        "int ignore_index, float lse_square_scale, float label_smoothing, int reduction, float softcap, "
        "bool accum_fp32, bool token_scaling, int chunk, bool check) -> Tensor");
  m.def("linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weights, "
        "Tensor? grad_output, Tensor(a!)? dx, Tensor(b!)? dweight, Tensor(c!)? dbias, Tensor(d!)? loss, "
        "Tensor(e!)? loss_rows, Tensor(f!)? z_loss, Tensor(g!)? lse, Tensor(h!)? argmax, int ignore_index, "
        "float label_smoothing, float z_loss_scale, float softcap, int reduction, float grad_scale, "
        "bool token_scaling, int chunk) -> ()");
  m.def("linear_cross_entropy_heads(Tensor x, Tensor[] weights, Tensor[] biases, Tensor targets, "
        "Tensor? class_weights, Tensor? grad_output, float[] head_weights, Tensor(a!)? dx, Tensor(b!)[] dweights, "
        "Tensor(c!)[] dbiases, Tensor(d!)? loss, Tensor(e!)? head_losses, Tensor(f!)? loss_rows, Tensor(g!)? z_loss, "
        "int ignore_index, float label_smoothing, float z_loss_scale, float softcap, int reduction, "
        "float grad_scale, int chunk) -> ()");
  m.def("linear_logprob(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor(a!)? logp, "
        "Tensor(b!)? lse, Tensor(c!)? entropy, Tensor(d!)? logit_sum, Tensor(e!)? error_count, int ignore_index, "
        "float temperature, int chunk, Tensor(f!)? kept, Tensor(g!)? is_top1=None) -> ()");
  m.def("linear_logprob_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor? entropy, "
        "Tensor? grad_logp, Tensor? grad_entropy, Tensor(a!)? dx, Tensor(b!)? dweight, Tensor(c!)? dbias, "
        "int ignore_index, float temperature, int chunk, bool accumulate, Tensor(d!)? kept) -> ()");
  m.def("scale_rows(Tensor(a!) x, Tensor scale) -> ()");
  m.def("target_range(Tensor target, int ignore_index) -> int[]");
  m.def("divergence(Tensor student, Tensor teacher, Tensor? labels, Tensor? grad_output, Tensor(a!)? dx, "
        "Tensor(b!)? loss, Tensor(c!)? loss_rows, Tensor(d!)? loss_elems, int kind, int student_input, "
        "int teacher_input, int reduction, int ignore_index, float beta, float eps, float temperature, "
        "float grad_scale) -> ()");
  m.def("adamw_plan(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] masters) -> Tensor");
  m.def("adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] masters, Tensor plan, Tensor? lr, float lr_value, Tensor(e!) step, float beta1, float beta2, "
        "float eps, float weight_decay, bool decoupled, Tensor? grad_scale, Tensor? clip_factor, "
        "Tensor? found_inf, bool stochastic_rounding, int seed) -> ()");
  m.def("adamw_grad_norm(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] masters, Tensor plan, float max_norm, Tensor(a!)? norm, Tensor(b!)? factor, "
        "Tensor? grad_scale) -> ()");
}

#if defined(TIGON_TORCH_PYTHON_MODULE)
// Importing tigon_torch._C loads this library, which registers the operators above.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "tigon operators (torch.ops.tigon)", -1, nullptr,
                               nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
#endif
