// Chunked linear cross-entropy, bf16: loss + dx + dW (fp32) for LM-head shapes, against the three
// cuBLAS GEMMs it cannot avoid (logits, dx, dW) timed alone in the same process; with a bias
// (fourth argument 1) also db, and the GEMMs alone then add the bias in the logits GEMM's epilogue
// and sum db against a ones vector, as the op does. Reports time, TFLOP/s on 6 N D V, the GEMMs'
// time, the ratio, and the extra device memory (the workspace).
#include "harness.cuh"

#include <tigon/loss/linear_cross_entropy.cuh>

using tigon::bf16;

namespace {

using bench::check;


void BM_lce(benchmark::State& st) {
  const std::int64_t N = st.range(0), D = st.range(1), V = st.range(2);
  const bool with_bias = st.range(3) != 0;
  const std::size_t gws_bytes = 32u << 20;
  void* gws = bench::alloc<unsigned char>(gws_bytes);
  tigon::CublasLtGemm blas(gws, gws_bytes);
  check(blas.status());
  bf16* x = bench::alloc<bf16>(N * D);
  bf16* w = bench::alloc<bf16>(V * D);
  bf16* dx = bench::alloc<bf16>(N * D);
  float* dw = bench::alloc<float>(V * D);
  float* loss = bench::alloc<float>(1);
  bf16* bias = with_bias ? bench::alloc<bf16>(V) : nullptr;
  float* db = with_bias ? bench::alloc<float>(V) : nullptr;
  if (with_bias) bench::fill_random(bias, V, 3, 0.0f, 1.0f);
  std::int64_t* t = bench::alloc<std::int64_t>(N);
  bench::fill_random(x, N * D, 1);
  bench::fill_random(w, V * D, 2, 0.0f, 0.02f);
  std::vector<std::int64_t> th(N);
  for (std::int64_t i = 0; i < N; ++i) th[i] = (i * 7919) % V;
  BENCH_CUDA(cudaMemcpy(t, th.data(), N * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  tigon::LinearCrossEntropyArgs<bf16> a;
  a.x = x;
  a.weight = w;
  a.hidden = D;
  a.loss.targets = t;
  a.loss.rows = N;
  a.loss.vocab = V;
  a.loss.loss = loss;
  a.dx = dx;
  a.dweight = dw;
  a.bias = bias;
  a.dbias = db;
  std::size_t bytes = 0;
  check(tigon::linear_cross_entropy_workspace_bytes(a, bytes));
  a.workspace = bench::alloc<unsigned char>(bytes);
  a.workspace_bytes = bytes;
  const std::int64_t chunk = tigon::linear_cross_entropy_default_chunk(N, V, sizeof(bf16));
  // The three GEMMs alone, at the same chunking, on the same buffers.
  bf16* logits = static_cast<bf16*>(a.workspace) + tigon::detail::ce_workspace_bytes(N) / sizeof(bf16);
  const tigon::detail::LceLayout layout = tigon::detail::lce_layout(a);
  bf16* ones = reinterpret_cast<bf16*>(static_cast<unsigned char*>(a.workspace) + layout.ones_offset);
  if (with_bias) check(tigon::detail::fill_ones(ones, chunk, nullptr, "bench"));
  auto gemms = [&] {
    for (std::int64_t r0 = 0; r0 < N; r0 += chunk) {
      const std::int64_t c = std::min(chunk, N - r0);
      check(blas.gemm(tigon::GemmArgs<bf16>{.a = x + r0 * D, .b = w, .d = logits, .bias = bias, .m = c, .n = V,
                                            .k = D, .op_b = tigon::Op::t}, nullptr));
      check(blas.gemm(tigon::GemmArgs<bf16>{.a = logits, .b = w, .d = dx + r0 * D, .m = c, .n = D, .k = V},
                      nullptr));
      check(blas.gemm(tigon::GemmArgs<bf16, float>{.a = logits, .b = x + r0 * D, .c = dw, .d = dw, .m = V,
                                                   .n = D, .k = c, .op_a = tigon::Op::t,
                                                   .beta = r0 > 0 ? 1.0f : 0.0f}, nullptr));
      if (with_bias) {
        check(blas.gemm(tigon::GemmArgs<bf16, float>{.a = ones, .b = logits, .c = db, .d = db, .m = 1, .n = V,
                                                     .k = c, .beta = r0 > 0 ? 1.0f : 0.0f}, nullptr));
      }
    }
  };
  auto lce = [&] { check(tigon::linear_cross_entropy(a, blas, nullptr)); };
  for (int i = 0; i < 2; ++i) {
    gemms();
    lce();
  }
  // The GEMMs alone and the fused op, alternately, so that both see the same clocks and
  // temperature; the ratio is of the two medians.
  std::vector<double> g_ms, l_ms;
  for (int i = 0; i < 9; ++i) {
    g_ms.push_back(bench::time_calls([&](int) { gemms(); }, 0, 1)[0]);
    l_ms.push_back(bench::time_calls([&](int) { lce(); }, 0, 1)[0]);
  }
  const double g_med = bench::median(g_ms);
  const double l_med = bench::median(l_ms);
  const double flop = 6.0 * N * D * V;
  const std::string name = "linear_cross_entropy N" + std::to_string(N) + " D" + std::to_string(D) + " V" +
                           std::to_string(V) + (with_bias ? " bias" : "");
  // bytes = FLOP here: the summary's "GB/s" column then reads as GFLOP/s.
  bench::run(st, name, flop, [&](int) { lce(); }, 1);
  const double med = st.counters["median_ms"];
  st.counters["TFLOP/s"] = flop / (med * 1e-3) / 1e12;
  st.counters["gemms_ms"] = g_med;
  st.counters["lce_alternating_ms"] = l_med;
  st.counters["ratio_to_gemms"] = l_med / g_med;
  st.counters["workspace_MB"] = bytes / 1e6;
  std::printf("%s: %.3f ms, %.0f TFLOP/s (median of %d); alternating with the three GEMMs alone, 9 "
              "each: %.3f ms against %.3f ms (%.0f TFLOP/s), ratio %.3f; chunk %lld tokens, extra memory "
              "%.1f MB\n",
              name.c_str(), med, flop / (med * 1e-3) / 1e12, static_cast<int>(st.iterations()), l_med, g_med,
              flop / (g_med * 1e-3) / 1e12, l_med / g_med, static_cast<long long>(chunk), bytes / 1e6);
  for (void* p : {(void*)x, (void*)w, (void*)dx, (void*)dw, (void*)loss, (void*)t, (void*)bias, (void*)db,
                  a.workspace, gws}) {
    cudaFree(p);
  }
}

}  // namespace

BENCHMARK(BM_lce)
    ->Args({4096, 4096, 128256, 0})
    ->Args({8192, 4096, 128256, 0})
    ->Args({16384, 4096, 128256, 0})
    ->Args({8192, 2304, 256000, 0})
    ->Args({8192, 4096, 128256, 1})
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

BENCH_MAIN
