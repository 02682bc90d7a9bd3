// RMSNorm benchmarks, bf16: the default forward and backward at LLaMA-class shapes, back to back
// and as single calls, GB/s on useful bytes and the fraction of the device-to-device copy rate
// measured in the same process. Policy sweeps and probes: bench/tuning/bench_rms_norm_tuning.cu.
//   forward:  read x, write y (+ read w, write rstd)
//   backward: read x and dy, write dx (+ read w and rstd, write dW); dW's partial sums in the
//             workspace are not counted: they are overhead the kernel pays.
#include "harness.cuh"

#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;

namespace {

using bench::check;

struct Data {
  int sets = 1;
  std::int64_t rows = 0, cols = 0;
  std::vector<bf16*> x, y, dy;
  bf16 *w = nullptr, *dw = nullptr;
  std::vector<float*> rstd;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data(std::int64_t r, std::int64_t c) : rows(r), cols(c) {
    const std::size_t n = static_cast<std::size_t>(r * c);
    sets = bench::rotation(3.0 * n * sizeof(bf16));
    for (int s = 0; s < sets; ++s) {
      x.push_back(bench::alloc<bf16>(n));
      y.push_back(bench::alloc<bf16>(n));
      dy.push_back(bench::alloc<bf16>(n));
      rstd.push_back(bench::alloc<float>(r));
      bench::fill_random(x.back(), n, 11 + s);
      bench::fill_random(dy.back(), n, 101 + s);
    }
    w = bench::alloc<bf16>(c);
    dw = bench::alloc<bf16>(c);
    bench::fill_random(w, c, 5, 1.0f, 0.2f);
  }
  ~Data() {
    for (int s = 0; s < sets; ++s) {
      cudaFree(x[s]);
      cudaFree(y[s]);
      cudaFree(dy[s]);
      cudaFree(rstd[s]);
    }
    cudaFree(w);
    cudaFree(dw);
    cudaFree(ws);
  }
  tigon::RmsNormForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    return {.x = x[s], .y = y[s], .weight = w, .rstd = rstd[s], .rows = rows, .cols = cols};
  }
  tigon::RmsNormBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    return {.dy = dy[s], .x = x[s], .weight = w, .rstd = rstd[s], .dx = y[s], .dweight = dw,
            .rows = rows, .cols = cols, .workspace = ws, .workspace_bytes = ws_bytes};
  }
};

double fwd_bytes(std::int64_t r, std::int64_t c) { return 2.0 * r * c * 2 + c * 2.0 + r * 4.0; }
double bwd_bytes(std::int64_t r, std::int64_t c) { return 3.0 * r * c * 2 + 2.0 * c * 2 + r * 4.0; }

std::string shape(std::int64_t r, std::int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }


// The runtime-dispatch launchers with the default policy: what a trainer gets.
void BM_forward(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  bench::run(st, "rms_norm fwd bf16 " + shape(d.rows, d.cols), fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::rms_norm_forward(d.fwd(i), nullptr)); });
}

void BM_backward(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  auto a = d.bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) check(tigon::rms_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "rms_norm bwd bf16 " + shape(d.rows, d.cols) + " (dx + dW)", bwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::rms_norm_backward(d.bwd(i), nullptr)); });
}

// What a launcher costs the host (validation, dispatch, launch): 1 x 4096, 2000 calls.
void BM_host_overhead(benchmark::State& st) {
  Data d(1, 4096);
  auto a = d.bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  double fwd_us = 0, bwd_us = 0;
  for (auto _ : st) {
    fwd_us = bench::host_us_per_call([&] { check(tigon::rms_norm_forward(d.fwd(0), nullptr)); }, 2000);
    bwd_us = bench::host_us_per_call([&] { check(tigon::rms_norm_backward(d.bwd(0), nullptr)); }, 2000);
  }
  st.counters["fwd_host_us"] = fwd_us;
  st.counters["bwd_host_us"] = bwd_us;
  std::printf("host cost per call: rms_norm_forward %.2f us, rms_norm_backward %.2f us (two launches)\n",
              fwd_us, bwd_us);
}

}  // namespace

BENCHMARK(BM_host_overhead)->Iterations(1);

#define SHAPES ->Args({16384, 2048})->Args({16384, 4096})->Args({16384, 8192})->Args({32768, 4096})
#define TIMED ->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_forward) SHAPES TIMED;
BENCHMARK(BM_backward) SHAPES TIMED;
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_forward>)->Args({16384, 4096}) TIMED;
BENCHMARK(bench::single<BM_backward>)->Args({16384, 4096}) TIMED;

BENCH_MAIN
