// What programmatic dependent launch (PDL) changes in a call's fixed cost: an empty kernel and the
// RMSNorm forward (bf16, 4096 columns) at 1, 132 (one wave on an H200's 132 SMs) and 16384 rows,
// each launched through tigon::launch with PDL on (the default) and off
// (tigon::set_programmatic_launch), timed as single calls and back to back as in
// bench/bench_launch.cu.
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


const char* pdl_name(bool pdl) { return pdl ? "PDL on" : "PDL off"; }

void empty(benchmark::State& st, bool pdl) {
  tigon::set_programmatic_launch(pdl);
  bench::run(st, std::string("launch empty kernel, 1 block, ") + pdl_name(pdl), 0, [&](int) {
    check(tigon::detail::launch("empty_kernel", empty_kernel, {dim3(1), dim3(32), 0, nullptr}, static_cast<int*>(nullptr)));
  });
  tigon::set_programmatic_launch(true);
}

void rms_fwd(benchmark::State& st, bool pdl) {
  tigon::set_programmatic_launch(pdl);
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
  bench::run(st, "launch rms_norm fwd " + std::to_string(rows) + "x4096, " + pdl_name(pdl),
             2.0 * rows * cols * 2 + cols * 2.0 + rows * 4.0, [&](int i) {
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
  tigon::set_programmatic_launch(true);
}

void BM_empty_pdl(benchmark::State& st) { empty(st, true); }
void BM_empty_serial(benchmark::State& st) { empty(st, false); }
void BM_rms_pdl(benchmark::State& st) { rms_fwd(st, true); }
void BM_rms_serial(benchmark::State& st) { rms_fwd(st, false); }

}  // namespace

#define LAUNCH_ARGS ->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(bench::single<BM_empty_pdl>) LAUNCH_ARGS;
BENCHMARK(bench::single<BM_empty_serial>) LAUNCH_ARGS;
BENCHMARK(bench::single<BM_rms_pdl>)->Arg(1)->Arg(132)->Arg(16384) LAUNCH_ARGS;
BENCHMARK(bench::single<BM_rms_serial>)->Arg(1)->Arg(132)->Arg(16384) LAUNCH_ARGS;
BENCHMARK(BM_empty_pdl) LAUNCH_ARGS;
BENCHMARK(BM_empty_serial) LAUNCH_ARGS;
BENCHMARK(BM_rms_pdl)->Arg(1)->Arg(132)->Arg(16384) LAUNCH_ARGS;
BENCHMARK(BM_rms_serial)->Arg(1)->Arg(132)->Arg(16384) LAUNCH_ARGS;

BENCH_MAIN
