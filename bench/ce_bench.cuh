// The cross-entropy benchmarks' shared body (bench/bench_cross_entropy.cu, and the policy sweeps
// of bench/tuning/bench_cross_entropy_tuning.cu): random bf16 logits in rotating sets, int64
// targets, the mean reduction.
#pragma once

#include <string>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>

#include "harness.cuh"

namespace ce_bench {

using bench::check;

struct Opt {
  float eps = 0.0f;
  float cap = 0.0f;
  bool weights = false;
  bool argmax = false;
  bool token = false;  // token scaling
  bool unaligned_weights = false;  // class weights 4 bytes off a 16-byte boundary (one float a load)
};


inline std::string describe(const Opt& o) {
  std::string s;
  if (o.cap > 0) s += " softcap";
  if (o.eps > 0) s += " smoothing";
  if (o.weights) s += " weights";
  if (o.argmax) s += " argmax";
  if (o.token) s += " token-scaling";
  if (o.unaligned_weights) s += " (unaligned)";
  return s;
}

// The inputs of one shape: `sets` rotating logits buffers, targets, weights, outputs, workspace.
struct Inputs {
  std::int64_t rows, V;
  int sets;
  std::vector<tigon::bf16*> x;
  std::int64_t* t = nullptr;
  float* w = nullptr;
  float* loss = nullptr;
  std::int64_t* am = nullptr;
  void* ws = nullptr;
  std::size_t wsb = 0;
  Inputs(std::int64_t rows_, std::int64_t V_) : rows(rows_), V(V_) {
    const std::size_t n = static_cast<std::size_t>(rows * V);
    sets = bench::rotation(2.0 * n * sizeof(tigon::bf16));
    for (int s = 0; s < sets; ++s) {
      x.push_back(bench::alloc<tigon::bf16>(n));
      bench::fill_random(x.back(), n, 77 + s, 0.0f, 2.0f);
    }
    std::vector<std::int64_t> th(rows);
    for (std::int64_t r = 0; r < rows; ++r) th[r] = (r * 7919) % V;
    t = bench::alloc<std::int64_t>(rows);
    BENCH_CUDA(cudaMemcpy(t, th.data(), rows * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    w = bench::alloc<float>(V + 4);
    bench::fill_random(w, V + 4, 5, 0.5f, 1.5f);
    loss = bench::alloc<float>(1);
    am = bench::alloc<std::int64_t>(rows);
    wsb = tigon::detail::ce_workspace_bytes(rows);
    ws = bench::alloc<unsigned char>(wsb);
  }
  ~Inputs() {
    for (tigon::bf16* p : x) cudaFree(p);
    cudaFree(t);
    cudaFree(w);
    cudaFree(loss);
    cudaFree(am);
    cudaFree(ws);
  }
  tigon::CrossEntropyArgs<tigon::bf16> args(int i, bool grad, const Opt& o) const {
    tigon::bf16* xi = x[i % sets];
    return {.logits = xi, .targets = t, .rows = rows, .vocab = V, .dlogits = grad ? xi : nullptr,
            .class_weights = o.weights ? w + (o.unaligned_weights ? 1 : 0) : nullptr, .label_smoothing = o.eps, .softcap = o.cap,
            .token_scaling = o.token, .loss = loss, .argmax = o.argmax ? am : nullptr, .workspace = ws, .workspace_bytes = wsb};
  }
};

template <class P>
void run(benchmark::State& st, bool grad, const Opt& o, const std::string& label = "") {
  const Inputs in(st.range(0), st.range(1));
  const double n = static_cast<double>(in.rows * in.V);
  const std::string name = (label.empty() ? std::string("cross_entropy ") : "  policy " + label + " ") +
                           (grad ? "loss+grad" : "loss only") + describe(o) + " bf16 " +
                           std::to_string(in.rows) + "x" + std::to_string(in.V);
  bench::run(st, name, (grad ? 2.0 : 1.0) * n * sizeof(tigon::bf16),
             [&](int i) { check(tigon::cross_entropy<P>(in.args(i, grad, o), nullptr)); }, 10,
             grad ? bench::Ceiling::copy : bench::Ceiling::read);
}

// The split vocabulary over two equal shards, as two ranks would run them one after the other:
// the statistics pass (read once), or the finalize from merged statistics (read and write once).
template <class P>
void run_split(benchmark::State& st, bool finalize, const std::string& label = "") {
  const Inputs in(st.range(0), st.range(1));
  const std::int64_t half = in.V / 2;
  tigon::CrossEntropyStats* stats = bench::alloc<tigon::CrossEntropyStats>(2 * in.rows);
  tigon::CrossEntropyStats* merged = bench::alloc<tigon::CrossEntropyStats>(in.rows);
  auto shard = [&](int i, int k, bool grad) {
    tigon::CrossEntropyArgs<tigon::bf16> a = in.args(i, grad, Opt{.eps = 0.1f});
    a.logits += k * half;
    if (grad) a.dlogits += k * half;
    a.vocab = k == 0 ? half : in.V - half;
    a.logits_stride = a.dlogits_stride = in.V;
    return a;
  };
  for (int k = 0; k < 2; ++k) {
    check(tigon::cross_entropy_shard_stats<P>(shard(0, k, false), k * half, in.V, stats + k * in.rows, nullptr));
  }
  check(tigon::cross_entropy_merge_stats(stats, 2, in.rows, merged, nullptr));
  const double n = static_cast<double>(in.rows * in.V);
  const std::string name = (label.empty() ? std::string("cross_entropy ") : "  policy " + label + " ") +
                           (finalize ? "shard finalize" : "shard stats") + " smoothing bf16 " +
                           std::to_string(in.rows) + "x" + std::to_string(in.V) + " (2 shards)";
  bench::run(st, name, (finalize ? 2.0 : 1.0) * n * sizeof(tigon::bf16), [&](int i) {
    for (int k = 0; k < 2; ++k) {
      if (finalize) {
        check(tigon::cross_entropy_shard_finalize<P>(shard(i, k, true), k * half, in.V, merged, nullptr));
      } else {
        check(tigon::cross_entropy_shard_stats<P>(shard(i, k, false), k * half, in.V, stats + k * in.rows, nullptr));
      }
    }
  }, 10, finalize ? bench::Ceiling::copy : bench::Ceiling::read);
  cudaFree(stats);
  cudaFree(merged);
}

}  // namespace ce_bench
