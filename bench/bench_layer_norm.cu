// LayerNorm benchmarks, bf16: forward and backward at LLaMA-class shapes, GB/s on useful bytes and
// the fraction of the device-to-device copy rate measured in the same process.
//   forward:  read x, write y (+ read w and b, write mean and rstd)
//   backward: read x and dy, write dx (+ read w, mean and rstd, write dW and dB); the partial sums
//             of dW and dB in the workspace are not counted: they are overhead the kernel pays.
#include "harness.cuh"

#include <tigon/norm/layer_norm.cuh>

using tigon::bf16;

namespace {

struct Data {
  int sets = 1;
  std::int64_t rows = 0, cols = 0;
  std::vector<bf16*> x, y, dy;
  bf16 *w = nullptr, *b = nullptr, *dw = nullptr, *db = nullptr;
  std::vector<float*> mean, rstd;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data(std::int64_t r, std::int64_t c) : rows(r), cols(c) {
    const std::size_t n = static_cast<std::size_t>(r * c);
    sets = bench::rotation(3.0 * n * sizeof(bf16));
    for (int s = 0; s < sets; ++s) {
      x.push_back(bench::alloc<bf16>(n));
      y.push_back(bench::alloc<bf16>(n));
      dy.push_back(bench::alloc<bf16>(n));
      mean.push_back(bench::alloc<float>(r));
      rstd.push_back(bench::alloc<float>(r));
      bench::fill_random(x.back(), n, 11 + s, 0.5f);
      bench::fill_random(dy.back(), n, 101 + s);
    }
    w = bench::alloc<bf16>(c);
    b = bench::alloc<bf16>(c);
    dw = bench::alloc<bf16>(c);
    db = bench::alloc<bf16>(c);
    bench::fill_random(w, c, 5, 1.0f, 0.2f);
    bench::fill_random(b, c, 6, 0.0f, 0.2f);
  }
  ~Data() {
    for (int s = 0; s < sets; ++s) {
      cudaFree(x[s]);
      cudaFree(y[s]);
      cudaFree(dy[s]);
      cudaFree(mean[s]);
      cudaFree(rstd[s]);
    }
    cudaFree(w);
    cudaFree(b);
    cudaFree(dw);
    cudaFree(db);
    cudaFree(ws);
  }
  tigon::LayerNormForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    return {.x = x[s], .y = y[s], .weight = w, .bias = b, .mean = mean[s], .rstd = rstd[s],
            .rows = rows, .cols = cols};
  }
  tigon::LayerNormBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    return {.dy = dy[s], .x = x[s], .weight = w, .mean = mean[s], .rstd = rstd[s], .dx = y[s],
            .dweight = dw, .dbias = db, .rows = rows, .cols = cols, .workspace = ws,
            .workspace_bytes = ws_bytes};
  }
};

double fwd_bytes(std::int64_t r, std::int64_t c) { return 2.0 * r * c * 2 + 2.0 * c * 2 + 2.0 * r * 4; }
double bwd_bytes(std::int64_t r, std::int64_t c) { return 3.0 * r * c * 2 + 3.0 * c * 2 + 2.0 * r * 4; }

std::string shape(std::int64_t r, std::int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }

void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

// Runtime-dispatch launchers: what a trainer gets by default.
void BM_forward(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  bench::run(st, "layer_norm fwd bf16 " + shape(d.rows, d.cols), fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::layer_norm_forward(d.fwd(i), nullptr)); });
}

void BM_backward(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  auto a = d.bwd(0);
  check(tigon::layer_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) check(tigon::layer_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "layer_norm bwd bf16 " + shape(d.rows, d.cols) + " (dx + dW + dB)",
             bwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::layer_norm_backward(d.bwd(i), nullptr)); });
}

// The backward without dW and dB (no partial rows, no column sums): where its time goes.
void BM_backward_dx_only(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  for (int s = 0; s < d.sets; ++s) check(tigon::layer_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "  layer_norm bwd " + shape(d.rows, d.cols) + " dx only (no dW, dB)",
             3.0 * d.rows * d.cols * 2 + d.cols * 2.0 + 2.0 * d.rows * 4, [&](int i) {
               auto a = d.bwd(i);
               a.dweight = nullptr;
               a.dbias = nullptr;
               a.workspace = nullptr;
               a.workspace_bytes = 0;
               check(tigon::layer_norm_backward(a, nullptr));
             });
}

// Tuning variants of the compiled kernels at 4096 (the policy's parameters are listed below).
template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  bench::run(st, std::string("  fwd 4096 policy ") + label, fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::layer_norm_forward<bf16, 4096, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  auto a = d.bwd(0);
  check(tigon::layer_norm_backward_workspace_bytes<bf16, 4096, P>(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) check(tigon::layer_norm_forward(d.fwd(s), nullptr));
  bench::run(st, std::string("  bwd 4096 policy ") + label, bwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::layer_norm_backward<bf16, 4096, P>(d.bwd(i), nullptr)); });
}

using tigon::LayerNormPolicy;

// What a launcher costs the host (validation, dispatch, launch): 1 x 4096, 2000 calls.
void BM_host_overhead(benchmark::State& st) {
  Data d(1, 4096);
  auto a = d.bwd(0);
  check(tigon::layer_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  double fwd_us = 0, bwd_us = 0;
  for (auto _ : st) {
    fwd_us = bench::host_us_per_call([&] { check(tigon::layer_norm_forward(d.fwd(0), nullptr)); }, 2000);
    bwd_us = bench::host_us_per_call([&] { check(tigon::layer_norm_backward(d.bwd(0), nullptr)); }, 2000);
  }
  st.counters["fwd_host_us"] = fwd_us;
  st.counters["bwd_host_us"] = bwd_us;
  std::printf("host cost per call: layer_norm_forward %.2f us, layer_norm_backward %.2f us (two launches)\n",
              fwd_us, bwd_us);
}

}  // namespace

BENCHMARK(BM_host_overhead)->Iterations(1);

#define SHAPES ->Args({16384, 4096})->Args({16384, 8192})->Args({32768, 4096})
BENCHMARK(BM_forward) SHAPES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward) SHAPES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward_dx_only)->Args({16384, 4096})->Args({32768, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_forward>)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(bench::single<BM_backward>)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);

#define FWD_VARIANT(label, ...)                                                               \
  void BM_fwd_##label(benchmark::State& st) { BM_forward_policy<__VA_ARGS__>(st, #label); }  \
  BENCHMARK(BM_fwd_##label)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
#define BWD_VARIANT(label, ...)                                                               \
  void BM_bwd_##label(benchmark::State& st) { BM_backward_policy<__VA_ARGS__>(st, #label); } \
  BENCHMARK(BM_bwd_##label)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);

// LayerNormPolicy<fwd vec/thread, fwd block, bwd vec/thread, bwd block, bwd min blocks/SM, stages,
//                 persistent forward grid, streaming stores, backward keeps rows in registers,
//                 direct forward>
// Non-persistent forwards staged through shared memory (one stage, whatever the policy says):
FWD_VARIANT(v4_b256_staged, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, true, false>)
FWD_VARIANT(v4_b128_staged, LayerNormPolicy<4, 128, 2, 512, 1, 3, false, false, true, false>)
FWD_VARIANT(v4_b256_staged_cs, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, true, true, false>)
// Direct forwards (the default): each thread's vectors straight into registers, no shared memory:
FWD_VARIANT(v4_b256_direct_default, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, true, true>)
// The L2 prefetch around the grid-dependency wait: none, every block its own rows before the wait
// (the ninth session's default before it was measured), the first and second waves (default).
FWD_VARIANT(prefetch_none, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false, true, 0, 0>)
FWD_VARIANT(prefetch_every_block, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false, true, 0, 1>)
FWD_VARIANT(prefetch_two_waves, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false, true, 0, 2>)
FWD_VARIANT(v4_b128_direct, LayerNormPolicy<4, 128, 2, 512, 1, 3, false, false, true, true>)
// The default forward with a floor of 5 or 6 blocks per SM (capped registers):
FWD_VARIANT(v4_b256_m5, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false, true, 5>)
FWD_VARIANT(v4_b256_m6, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false, true, 6>)
FWD_VARIANT(v2_b256_direct, LayerNormPolicy<2, 256, 2, 512, 1, 3, false, false, true, true>)
FWD_VARIANT(v2_b256_direct_cs, LayerNormPolicy<2, 256, 2, 512, 1, 3, false, true, true, true>)
FWD_VARIANT(v16_b256_direct_warp_per_row, LayerNormPolicy<16, 256, 2, 512, 1, 3, false, false, true, true>)
// Persistent forwards, rows in flight through kStages stages:
FWD_VARIANT(v4_b256_s2_persistent, LayerNormPolicy<4, 256, 2, 512, 1, 2, true>)
FWD_VARIANT(v4_b256_s3_persistent, LayerNormPolicy<4, 256, 2, 512, 1, 3, true>)
FWD_VARIANT(v4_b256_s4_persistent, LayerNormPolicy<4, 256, 2, 512, 1, 4, true>)
FWD_VARIANT(v16_b256_s2_persistent_warp_per_row, LayerNormPolicy<16, 256, 2, 512, 1, 2, true>)
// Backwards re-read the row from shared memory for dx unless marked "keep" (in registers).
BWD_VARIANT(v2_b512_m1_s3_keep, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, true>)
BWD_VARIANT(v2_b512_m1_s3_reread_default, LayerNormPolicy<4, 256, 2, 512, 1, 3, false, false, false>)
BWD_VARIANT(v2_b512_m1_s2, LayerNormPolicy<4, 256, 2, 512, 1, 2>)
BWD_VARIANT(v2_b512_m1_s4, LayerNormPolicy<4, 256, 2, 512, 1, 4>)
BWD_VARIANT(v2_b256_m2_s3_keep, LayerNormPolicy<4, 256, 2, 256, 2, 3, false, false, true>)
BWD_VARIANT(v2_b256_m2_s3_reread, LayerNormPolicy<4, 256, 2, 256, 2, 3, false, false, false>)
BWD_VARIANT(v2_b256_m2_s3_cs, LayerNormPolicy<4, 256, 2, 256, 2, 3, false, true>)
BWD_VARIANT(v4_b256_m1_s3_reread, LayerNormPolicy<4, 256, 4, 256, 1, 3, false, false, false>)
BWD_VARIANT(v1_b1024_m1_s2, LayerNormPolicy<4, 256, 1, 1024, 1, 2>)
// More resident threads per SM: 3 or 4 blocks of 256 threads, or 2 of 512, each with 2 stages.
BWD_VARIANT(v2_b256_m3_s2_reread, LayerNormPolicy<4, 256, 2, 256, 3, 2, false, false, false>)
BWD_VARIANT(v2_b256_m4_s2_reread, LayerNormPolicy<4, 256, 2, 256, 4, 2, false, false, false>)
BWD_VARIANT(v2_b512_m2_s2_reread, LayerNormPolicy<4, 256, 2, 512, 2, 2, false, false, false>)

// The forward variants as single calls (bench::single).
#define SINGLE_FWD(label) \
  BENCHMARK(bench::single<BM_fwd_##label>)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
SINGLE_FWD(v4_b128_direct)
SINGLE_FWD(v4_b256_m5)
SINGLE_FWD(v4_b256_m6)
SINGLE_FWD(v2_b256_direct)
SINGLE_FWD(v4_b256_staged)
SINGLE_FWD(v4_b256_s3_persistent)

BENCH_MAIN
