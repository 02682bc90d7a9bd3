// What a single call costs beyond its bytes: an empty kernel launched through tigon::launch and
// the RMSNorm forward (bf16, 4096 columns) at 1 and 16384 rows, with the default launch
// (programmatic dependent launch on), timed as single calls (a GPU spin, then events around one
// call: nothing of the same op before or after it) and back to back. At 1 row a call's time is
// almost all fixed cost (launch, first loads, drain); at 16384 rows the fixed cost is what
// separates a call from the copy rate. Programmatic dependent launch off and a one-wave call are
// in bench/tuning/bench_launch_tuning.cu.
#include "harness.cuh"

#include <tigon/core/launch.cuh>
#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;

namespace {

using bench::check;

__global__ void empty_kernel(int* sink) {
  tigon::detail::grid_dependency_sync();
  if (sink != nullptr && threadIdx.x == 1024) *sink = 1;  // never true: keeps the parameter
}


void BM_empty(benchmark::State& st) {
  bench::run(st, "launch empty kernel, 1 block", 0, [&](int) {
    check(tigon::detail::launch("empty_kernel", empty_kernel, {dim3(1), dim3(32), 0, nullptr}, static_cast<int*>(nullptr)));
  });
}

void BM_rms_fwd(benchmark::State& st) {
  const std::int64_t rows = st.range(0), cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  const int sets = bench::rotation(2.0 * n * sizeof(bf16));
  std::vector<bf16*> x, y;
  std::vector<float*> rstd;
  for (int s = 0; s < sets; ++s) {
    x.push_back(bench::alloc<bf16>(n));
    y.push_back(bench::alloc<bf16>(n));
    rstd.push_back(bench::alloc<float>(rows));
    bench::fill_random(x.back(), n, 21 + s);
  }
  bf16* w = bench::alloc<bf16>(cols);
  bench::fill_random(w, cols, 5, 1.0f, 0.2f);
  bench::run(st, "launch rms_norm fwd " + std::to_string(rows) + "x4096", 2.0 * rows * cols * 2 + cols * 2.0 + rows * 4.0,
             [&](int i) {
               const int s = i % sets;
               tigon::RmsNormForwardArgs<bf16> a{.x = x[s], .y = y[s], .weight = w, .rstd = rstd[s],
                                                 .rows = rows, .cols = cols};
               check(tigon::rms_norm_forward<bf16, 4096>(a, nullptr));
             });
  for (int s = 0; s < sets; ++s) {
    cudaFree(x[s]);
    cudaFree(y[s]);
    cudaFree(rstd[s]);
  }
  cudaFree(w);
}

}  // namespace

#define LAUNCH_ARGS ->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(bench::single<BM_empty>) LAUNCH_ARGS;
BENCHMARK(bench::single<BM_rms_fwd>)->Arg(1)->Arg(16384) LAUNCH_ARGS;
BENCHMARK(BM_empty) LAUNCH_ARGS;
BENCHMARK(BM_rms_fwd)->Arg(1)->Arg(16384) LAUNCH_ARGS;

BENCH_MAIN
