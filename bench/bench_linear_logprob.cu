// Linear log-probs, bf16: the forward (per-token logp, lse, entropy) and the backward (dx, dW fp32
// from upstream gradients of logp and entropy, the logits recomputed) for LM-head shapes, each
// against the cuBLAS GEMMs it cannot avoid (forward: the logits; backward: the logits, dx, dW) timed
// alone in the same process, alternately. Reports time, TFLOP/s (2 N D V forward, 6 N D V backward),
// the ratio to the GEMMs, and the extra device memory (the workspace).
#include "harness.cuh"

#include <tigon/loss/linear_logprob.cuh>

using tigon::bf16;

namespace {

using bench::check;

void BM_llp(benchmark::State& st) {
  const std::int64_t N = st.range(0), D = st.range(1), V = st.range(2);
  const bool backward = st.range(3) != 0;
  const std::size_t gws_bytes = 32u << 20;
  void* gws = bench::alloc<unsigned char>(gws_bytes);
  tigon::CublasLtGemm blas(gws, gws_bytes);
  check(blas.status());
  bf16* x = bench::alloc<bf16>(N * D);
  bf16* w = bench::alloc<bf16>(V * D);
  bf16* dx = bench::alloc<bf16>(N * D);
  float* dw = bench::alloc<float>(V * D);
  float* rows = bench::alloc<float>(4 * N);  // logp, lse, entropy, grad
  std::int64_t* t = bench::alloc<std::int64_t>(N);
  bench::fill_random(x, N * D, 1);
  bench::fill_random(w, V * D, 2, 0.0f, 0.02f);
  std::vector<std::int64_t> th(N);
  for (std::int64_t i = 0; i < N; ++i) th[i] = (i * 7919) % V;
  BENCH_CUDA(cudaMemcpy(t, th.data(), N * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  bench::fill_random(rows + 3 * N, N, 3);
  tigon::LinearLogProbArgs<bf16> a{.x = x, .weight = w, .hidden = D, .targets = t, .tokens = N, .vocab = V,
                                   .logp = rows, .lse = rows + N, .entropy = rows + 2 * N,
                                   .grad_logp = rows + 3 * N, .grad_entropy = rows + 3 * N, .dx = dx,
                                   .dweight = dw};
  std::size_t bytes = 0;
  check(tigon::linear_logprob_workspace_bytes(a, backward, bytes));
  a.workspace = bench::alloc<unsigned char>(bytes);
  a.workspace_bytes = bytes;
  const std::int64_t chunk = tigon::linear_logprob_default_chunk(N, V, sizeof(bf16));
  bf16* logits = static_cast<bf16*>(a.workspace);
  auto gemms = [&] {
    for (std::int64_t r0 = 0; r0 < N; r0 += chunk) {
      const std::int64_t c = std::min(chunk, N - r0);
      check(blas.gemm(tigon::GemmArgs<bf16>{.a = x + r0 * D, .b = w, .d = logits, .m = c, .n = V, .k = D,
                                            .op_b = tigon::Op::t}, nullptr));
      if (!backward) continue;
      check(blas.gemm(tigon::GemmArgs<bf16>{.a = logits, .b = w, .d = dx + r0 * D, .m = c, .n = D, .k = V},
                      nullptr));
      check(blas.gemm(tigon::GemmArgs<bf16, float>{.a = logits, .b = x + r0 * D, .c = dw, .d = dw, .m = V,
                                                   .n = D, .k = c, .op_a = tigon::Op::t,
                                                   .beta = r0 > 0 ? 1.0f : 0.0f}, nullptr));
    }
  };
  check(tigon::linear_logprob_forward(a, blas, nullptr));  // lse and entropy for the backward
  auto op = [&] {
    if (backward) {
      check(tigon::linear_logprob_backward(a, blas, nullptr));
    } else {
      check(tigon::linear_logprob_forward(a, blas, nullptr));
    }
  };
  for (int i = 0; i < 2; ++i) {
    gemms();
    op();
  }
  std::vector<double> g_ms, o_ms;
  for (int i = 0; i < 9; ++i) {
    g_ms.push_back(bench::time_calls([&](int) { gemms(); }, 0, 1)[0]);
    o_ms.push_back(bench::time_calls([&](int) { op(); }, 0, 1)[0]);
  }
  const double g_med = bench::median(g_ms), o_med = bench::median(o_ms);
  const double flop = (backward ? 6.0 : 2.0) * N * D * V;
  const std::string name = std::string("linear_logprob ") + (backward ? "backward" : "forward") + " N" +
                           std::to_string(N) + " D" + std::to_string(D) + " V" + std::to_string(V);
  // bytes = FLOP here: the summary's "GB/s" column then reads as GFLOP/s.
  bench::run(st, name, flop, [&](int) { op(); }, 1);
  const double med = st.counters["median_ms"];
  st.counters["TFLOP/s"] = flop / (med * 1e-3) / 1e12;
  st.counters["gemms_ms"] = g_med;
  st.counters["ratio_to_gemms"] = o_med / g_med;
  st.counters["workspace_MB"] = bytes / 1e6;
  std::printf("%s: %.3f ms, %.0f TFLOP/s (median of %d); alternating with the GEMMs alone, 9 each: %.3f ms "
              "against %.3f ms (%.0f TFLOP/s), ratio %.3f; chunk %lld tokens, extra memory %.1f MB\n",
              name.c_str(), med, flop / (med * 1e-3) / 1e12, static_cast<int>(st.iterations()), o_med, g_med,
              flop / (g_med * 1e-3) / 1e12, o_med / g_med, static_cast<long long>(chunk), bytes / 1e6);
  for (void* p : {(void*)x, (void*)w, (void*)dx, (void*)dw, (void*)rows, (void*)t, a.workspace, gws}) cudaFree(p);
}

}  // namespace

BENCHMARK(BM_llp)
    ->Args({16384, 4096, 128256, 0})
    ->Args({16384, 4096, 128256, 1})
    ->Args({8192, 4096, 128256, 0})
    ->Args({8192, 4096, 128256, 1})
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

BENCH_MAIN
