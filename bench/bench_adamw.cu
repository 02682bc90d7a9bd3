// The AdamW step over LLaMA-3-8B's parameter list (embedding, L decoder layers: q, k, v, o, gate,
// up, down and two norms each, the final norm, the LM head), bf16 parameters and gradients, fp32 or
// bf16 moments, one adamw_step a call (two launches), against the device-to-device copy rate
// measured in the same process. Useful bytes per element: read p, g, m, v and write p, m, v (22 with
// fp32 moments, 14 with bf16 ones). The first argument is the number of decoder layers (32 in the
// model; 8 here keeps the fp32-moment run at 36 GB). grad_norm_clip over the same list reads the
// gradients once (2 bytes an element, against the read-only stream).
#include "harness.cuh"

#include <tigon/optim/adamw.cuh>

using tigon::bf16;

namespace {

using bench::check;

std::vector<std::int64_t> llama3_8b(int layers) {
  const std::int64_t d = 4096, kv = 1024, ffn = 14336, vocab = 128256;
  std::vector<std::int64_t> n{vocab * d};
  for (int l = 0; l < layers; ++l) {
    for (std::int64_t s : {d * d, kv * d, kv * d, d * d, ffn * d, ffn * d, d * ffn, d, d}) n.push_back(s);
  }
  n.push_back(d);
  n.push_back(vocab * d);
  return n;
}

template <class S>
void BM_adamw(benchmark::State& st) {
  const auto sizes = llama3_8b(static_cast<int>(st.range(0)));
  std::vector<tigon::AdamWTensor<bf16, S>> tensors;
  std::vector<void*> owned;
  std::int64_t total = 0;
  for (std::int64_t n : sizes) {
    auto* p = bench::alloc<bf16>(n);
    auto* g = bench::alloc<bf16>(n);
    auto* m = bench::alloc<S>(n);
    auto* v = bench::alloc<S>(n);
    bench::fill_random(p, n, 1, 0.0f, 0.02f);
    bench::fill_random(g, n, 2, 0.0f, 1e-3f);
    BENCH_CUDA(cudaMemset(m, 0, n * sizeof(S)));
    BENCH_CUDA(cudaMemset(v, 0, n * sizeof(S)));
    tensors.push_back({.param = p, .grad = g, .exp_avg = m, .exp_avg_sq = v, .numel = n});
    owned.insert(owned.end(), {p, g, m, v});
    total += n;
  }
  std::size_t bytes = 0;
  check(tigon::adamw_workspace_bytes(tensors.data(), static_cast<int>(tensors.size()), bytes));
  void* ws = bench::alloc<unsigned char>(bytes);
  tigon::AdamWPlan plan;
  check(tigon::adamw_plan(tensors.data(), static_cast<int>(tensors.size()), ws, bytes, nullptr, plan));
  float* scalars = bench::alloc<float>(2);
  const float init[2] = {1e-4f, 0.0f};
  BENCH_CUDA(cudaMemcpy(scalars, init, sizeof(init), cudaMemcpyHostToDevice));
  const tigon::AdamWHyper h{.lr = scalars, .step = scalars + 1};
  // p, g read and p written (bf16); m, v read and written (S): 22 bytes with fp32 moments, 14 with bf16.
  const double per_elem = 3.0 * sizeof(bf16) + 4.0 * sizeof(S);
  const std::string name = std::string("adamw step, bf16 params, ") + (sizeof(S) == 4 ? "fp32" : "bf16") +
                           " moments, LLaMA-3-8B with " + std::to_string(st.range(0)) + " layers (" +
                           std::to_string(total / 1000000) + " M params)";
  bench::run(st, name, per_elem * static_cast<double>(total),
             [&](int) { check(tigon::adamw_step<bf16, S>(plan, h, nullptr)); }, 3);
  st.counters["params_M"] = total / 1e6;
  if (st.range(1) != 0) {  // the clip over the same gradients, in the same process
    const std::size_t nbytes = tigon::grad_norm_workspace_bytes(plan);
    void* nws = bench::alloc<unsigned char>(nbytes);
    float* out = bench::alloc<float>(2);
    const std::string nname = "grad_norm_clip, bf16 gradients, LLaMA-3-8B with " + std::to_string(st.range(0)) +
                              " layers";
    std::vector<double> ms = bench::time_calls(
        [&](int) { check(tigon::grad_norm_clip<bf16, S>(plan, 1.0f, out, out + 1, nws, nbytes, nullptr)); }, 3, 20);
    const double med = bench::median(ms);
    const double gbs = 2.0 * static_cast<double>(total) / (med * 1e-3) / 1e9;
    std::printf("%s: %.3f ms, %.0f GB/s of gradient read (median of 20 single calls; compare the read-only "
                "stream in the ceiling line)\n",
                nname.c_str(), med, gbs);
    st.counters["clip_ms"] = med;
    st.counters["clip_GBps"] = gbs;
    cudaFree(nws);
    cudaFree(out);
  }
  for (void* q : owned) cudaFree(q);
  cudaFree(ws);
  cudaFree(scalars);
}

}  // namespace

BENCHMARK(BM_adamw<float>)->Args({8, 1})->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_adamw<bf16>)->Args({8, 0})->Args({32, 1})->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);

BENCH_MAIN
