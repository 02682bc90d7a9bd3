// The divergence benchmarks' shared body (bench/bench_divergence.cu, and the policy sweeps of
// bench/tuning/bench_divergence_tuning.cu): random bf16 inputs of each form in rotating sets,
// batchmean, the gradient in place over the student.
#pragma once

#include <string>
#include <vector>

#include <tigon/loss/divergence.cuh>

#include "harness.cuh"

namespace div_bench {


using tigon::DivergenceInput;
using bench::check;

enum class Which { forward_kl, reverse_kl, jsd, kldiv, tvd };

struct Opt {
  Which which = Which::jsd;
  DivergenceInput student = DivergenceInput::log_probs, teacher = DivergenceInput::log_probs;
  bool grad = true;
  bool labels = false;
};

inline const char* name_of(Which w) {
  switch (w) {
    case Which::forward_kl: return "ForwardKL";
    case Which::reverse_kl: return "ReverseKL";
    case Which::jsd: return "GeneralizedJSD(0.5)";
    case Which::kldiv: return "KLDiv";
    case Which::tvd: return "TVD";
  }
  return "?";
}

inline const char* form_of(DivergenceInput f) {
  return f == DivergenceInput::log_probs ? "log-probs" : (f == DivergenceInput::probs ? "probs" : "logits");
}

// Random values of a form: log-probs around -12, probabilities around 1 / 100000, logits N(0, 2)-like.
inline void fill_form(tigon::bf16* p, std::size_t n, std::uint64_t seed, DivergenceInput f) {
  if (f == DivergenceInput::log_probs) bench::fill_random(p, n, seed, -12.0f, 2.0f);
  if (f == DivergenceInput::probs) bench::fill_random(p, n, seed, 1e-5f, 4e-6f);
  if (f == DivergenceInput::logits) bench::fill_random(p, n, seed, 0.0f, 2.0f);
}

struct Inputs {
  std::int64_t rows, V;
  int sets;
  std::vector<tigon::bf16*> x, y;
  std::int64_t* labels = nullptr;
  float* loss = nullptr;
  void* ws = nullptr;
  std::size_t wsb = 0;
  Inputs(std::int64_t rows_, std::int64_t V_, const Opt& o) : rows(rows_), V(V_) {
    const std::size_t n = static_cast<std::size_t>(rows * V);
    sets = bench::rotation(2.0 * n * sizeof(tigon::bf16));
    for (int s = 0; s < sets; ++s) {
      x.push_back(bench::alloc<tigon::bf16>(n));
      y.push_back(bench::alloc<tigon::bf16>(n));
      fill_form(x.back(), n, 91 + s, o.student);
      fill_form(y.back(), n, 191 + s, o.teacher);
    }
    std::vector<std::int64_t> lh(rows);
    for (std::int64_t r = 0; r < rows; ++r) lh[r] = r % 100 == 0 ? -100 : (r * 7919) % V;  // 1% ignored
    labels = bench::alloc<std::int64_t>(rows);
    BENCH_CUDA(cudaMemcpy(labels, lh.data(), rows * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    loss = bench::alloc<float>(1);
    check(tigon::divergence_workspace_bytes(args(0, o), wsb));
    ws = bench::alloc<unsigned char>(wsb);
  }
  ~Inputs() {
    for (tigon::bf16* p : x) cudaFree(p);
    for (tigon::bf16* p : y) cudaFree(p);
    cudaFree(labels);
    cudaFree(loss);
    cudaFree(ws);
  }
  tigon::DivergenceArgs<tigon::bf16> args(int i, const Opt& o) const {
    tigon::bf16* xi = x[i % sets];
    return {.student = xi, .student_input = o.student, .teacher = y[i % sets], .teacher_input = o.teacher,
            .rows = rows, .vocab = V, .labels = o.labels ? labels : nullptr, .dx = o.grad ? xi : nullptr,
            .loss = loss, .workspace = ws, .workspace_bytes = wsb};
  }
};

template <class P = tigon::DivergencePolicy, class D>
void run_with(benchmark::State& st, const Opt& o, const D& div, const std::string& label = "") {
  const Inputs in(st.range(0), st.range(1), o);
  const double n = static_cast<double>(in.rows * in.V);
  const std::string name = std::string("divergence ") + name_of(o.which) + (o.grad ? " loss+grad " : " loss only ") +
                           form_of(o.student) + (o.labels ? " labels" : "") + " bf16 " + std::to_string(in.rows) + "x" +
                           std::to_string(in.V);
  const double bytes = (o.grad ? 3.0 : 2.0) * n * sizeof(tigon::bf16);
  bench::run(st, label.empty() ? name : name + " " + label, bytes,
             [&](int i) { check(tigon::divergence<P>(in.args(i, o), div, nullptr)); }, 10,
             o.grad ? bench::Ceiling::copy : bench::Ceiling::read);
}

template <class P = tigon::DivergencePolicy>
void run(benchmark::State& st, const Opt& o, const std::string& label = "") {
  switch (o.which) {
    case Which::forward_kl: return run_with<P>(st, o, tigon::ForwardKL{}, label);
    case Which::reverse_kl: return run_with<P>(st, o, tigon::ReverseKL{}, label);
    case Which::jsd: return run_with<P>(st, o, tigon::GeneralizedJSD{0.5f}, label);
    case Which::kldiv: return run_with<P>(st, o, tigon::KLDiv{}, label);
    case Which::tvd: return run_with<P>(st, o, tigon::TVD{}, label);
  }
}


}  // namespace div_bench
