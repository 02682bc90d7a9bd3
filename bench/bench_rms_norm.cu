// RMSNorm benchmarks, bf16: forward and backward at LLaMA-class shapes, GB/s on useful bytes and
// the fraction of the device-to-device copy rate measured in the same process.
//   forward:  read x, write y (+ read w, write rstd)
//   backward: read x and dy, write dx (+ read w and rstd, write dW); dW's partial sums in the
//             workspace are not counted: they are overhead the kernel pays.
#include "harness.cuh"

#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;

namespace {

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

void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

// Runtime-dispatch launchers: what a trainer gets by default. `serial`: with programmatic
// dependent launch turned off (each kernel's blocks wait for the previous kernel to finish before
// they are scheduled): what the overlap is worth.
void forward_rows(benchmark::State& st, bool serial) {
  tigon::set_programmatic_launch(!serial);
  Data d(st.range(0), st.range(1));
  bench::run(st, serial ? "  rms_norm fwd " + shape(d.rows, d.cols) + " serial launch"
                        : "rms_norm fwd bf16 " + shape(d.rows, d.cols),
             fwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::rms_norm_forward(d.fwd(i), nullptr)); });
  tigon::set_programmatic_launch(true);
}

void backward_rows(benchmark::State& st, bool serial) {
  tigon::set_programmatic_launch(!serial);
  Data d(st.range(0), st.range(1));
  auto a = d.bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) check(tigon::rms_norm_forward(d.fwd(s), nullptr));
  bench::run(st, serial ? "  rms_norm bwd " + shape(d.rows, d.cols) + " serial launch"
                        : "rms_norm bwd bf16 " + shape(d.rows, d.cols) + " (dx + dW)",
             bwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::rms_norm_backward(d.bwd(i), nullptr)); });
  tigon::set_programmatic_launch(true);
}

// Where the backward's time goes: dx alone (no dW: no partial rows, no column sums), and the
// column sums alone over as many partial rows as the default backward writes at this shape.
void BM_backward_dx_only(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  for (int s = 0; s < d.sets; ++s) check(tigon::rms_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "  rms_norm bwd " + shape(d.rows, d.cols) + " dx only (no dW)",
             3.0 * d.rows * d.cols * 2 + d.cols * 2.0 + d.rows * 4.0, [&](int i) {
               auto a = d.bwd(i);
               a.dweight = nullptr;
               a.workspace = nullptr;
               a.workspace_bytes = 0;
               check(tigon::rms_norm_backward(a, nullptr));
             });
}

void BM_backward_column_sums(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  auto a = d.bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  const std::int64_t parts = static_cast<std::int64_t>(d.ws_bytes / (sizeof(float) * d.cols));
  bench::fill_random(static_cast<float*>(d.ws), static_cast<std::size_t>(parts * d.cols), 7);
  bench::run(st, "  rms_norm bwd " + shape(d.rows, d.cols) + " column sums alone (" + std::to_string(parts) + " rows)",
             parts * d.cols * 4.0 + d.cols * 2.0, [&](int) {
               check(tigon::column_sum(static_cast<const float*>(d.ws), parts, d.cols, d.dw, false, nullptr,
                                       "bench"));
             });
}

// What the weight and the saved rstd cost the default forward at 16384 x 4096: the same call
// without either (the bytes counted as with them, so the rows compare by time).
void BM_forward_without(benchmark::State& st) {
  Data d(16384, 4096);
  const bool no_w = st.range(0) & 1, no_rstd = st.range(0) & 2;
  bench::run(st, std::string("  rms_norm fwd 16384x4096 without") + (no_w ? " weight" : "") + (no_rstd ? " rstd" : ""),
             fwd_bytes(d.rows, d.cols), [&](int i) {
               auto a = d.fwd(i);
               if (no_w) a.weight = nullptr;
               if (no_rstd) a.rstd = nullptr;
               check(tigon::rms_norm_forward(a, nullptr));
             });
}

// Placement: the forward at 16384 x 4096 with x and y in one allocation, y starting `y_off` KiB
// after the end of x, and the weight `pad` KiB into a second allocation (rstd 64 KiB after it).
// The same kernel can run a few percent slower on some relative placements of its tensors.
template <class P>
void forward_placement(benchmark::State& st, const char* label) {
  const std::int64_t rows = 16384, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  const std::size_t y_off = static_cast<std::size_t>(st.range(0)) * 1024;
  const std::size_t pad = static_cast<std::size_t>(st.range(1)) * 1024;
  unsigned char* slab = bench::alloc<unsigned char>(2 * n * sizeof(bf16) + y_off);
  unsigned char* small = bench::alloc<unsigned char>(pad + (1 << 20));
  bf16* x = reinterpret_cast<bf16*>(slab);
  bf16* y = reinterpret_cast<bf16*>(slab + n * sizeof(bf16) + y_off);
  bf16* w = reinterpret_cast<bf16*>(small + pad);
  float* rstd = reinterpret_cast<float*>(small + pad + 65536);
  bench::fill_random(x, n, 11);
  bench::fill_random(w, cols, 5, 1.0f, 0.2f);
  const tigon::RmsNormForwardArgs<bf16> a{.x = x, .y = y, .weight = w, .rstd = rstd, .rows = rows, .cols = cols};
  bench::run(st,
             std::string("  fwd 4096 ") + label + " y+" + std::to_string(st.range(0)) + "K w+" +
                 std::to_string(st.range(1)) + "K",
             fwd_bytes(rows, cols), [&](int) { check(tigon::rms_norm_forward<bf16, 4096, P>(a, nullptr)); });
  cudaFree(slab);
  cudaFree(small);
}

void BM_forward(benchmark::State& st) { forward_rows(st, false); }
void BM_backward(benchmark::State& st) { backward_rows(st, false); }
void BM_forward_serial(benchmark::State& st) { forward_rows(st, true); }
void BM_backward_serial(benchmark::State& st) { backward_rows(st, true); }

// Tuning variants of the compiled kernels at 4096 (the policy's parameters are listed below).
template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  bench::run(st, std::string("  fwd 4096 policy ") + label, fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::rms_norm_forward<bf16, 4096, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  auto a = d.bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes<bf16, 4096, P>(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) check(tigon::rms_norm_forward(d.fwd(s), nullptr));
  bench::run(st, std::string("  bwd 4096 policy ") + label, bwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::rms_norm_backward<bf16, 4096, P>(d.bwd(i), nullptr)); });
}

using tigon::RmsNormPolicy;

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
BENCHMARK(BM_forward) SHAPES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward) SHAPES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward_dx_only)->Args({16384, 4096})->Args({32768, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_forward_without)->Arg(1)->Arg(2)->Arg(3)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward_column_sums)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_forward_serial)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_backward_serial)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_forward>)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(bench::single<BM_backward>)->Args({16384, 4096})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);

#define FWD_VARIANT(label, ...)                                                               \
  void BM_fwd_##label(benchmark::State& st) { BM_forward_policy<__VA_ARGS__>(st, #label); }  \
  BENCHMARK(BM_fwd_##label)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
#define BWD_VARIANT(label, ...)                                                               \
  void BM_bwd_##label(benchmark::State& st) { BM_backward_policy<__VA_ARGS__>(st, #label); } \
  BENCHMARK(BM_bwd_##label)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);

// RmsNormPolicy<fwd vec/thread, fwd block, bwd vec/thread, bwd block, bwd min blocks/SM, stages,
//               casting (-1: chosen at run time), persistent forward grid, streaming stores,
//               backward keeps rows in registers, direct forward (default true), direct backward,
//               direct forward's streaming hint (default false), forward min blocks per SM (default
//               0), forward L2 prefetch (default 2)>. Rows that leave the last ones unspelled take
//               the defaults: the direct forward with plain loads.
FWD_VARIANT(v4_b256_staged, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, false>)
FWD_VARIANT(v4_b256_s3_persistent, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, true>)
FWD_VARIANT(v4_b128, RmsNormPolicy<4, 128>)
FWD_VARIANT(v4_b512, RmsNormPolicy<4, 512>)
FWD_VARIANT(v8_b128, RmsNormPolicy<8, 128>)
FWD_VARIANT(v2_b256, RmsNormPolicy<2, 256>)
FWD_VARIANT(v4_b256_cs, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, true>)
FWD_VARIANT(v4_b256_llama_fixed, RmsNormPolicy<4, 256, 2, 512, 1, 3, 0>)
FWD_VARIANT(v4_b256_direct, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, true>)
FWD_VARIANT(v2_b256_direct, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false, false, true, true, false, true>)
FWD_VARIANT(v2_b256_direct_cs, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false, true, true, true, false, true>)
FWD_VARIANT(v4_b256_direct_cs, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, true, true, true, false, true>)
// Direct forwards with plain loads (kFwdDirectStream false) instead of the streaming hint:
FWD_VARIANT(v4_b256_direct_plain, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false>)
// The default forward with a floor of 5 or 6 blocks per SM (registers capped at 48 / 40):
FWD_VARIANT(v4_b256_m5, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false, 5>)
FWD_VARIANT(v4_b256_m6, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false, 6>)
FWD_VARIANT(v2_b256_direct_plain, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false>)
// The forward's L2 prefetch around the grid-dependency wait: none, or every block its own rows
// before the wait (the default, 2: the first wave's blocks only, their rows before the wait and
// the second wave's after it), at the default placement and at eight others.
#define RMS_PREFETCH(mode) RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false, 0, mode>
FWD_VARIANT(prefetch_none, RMS_PREFETCH(0))
FWD_VARIANT(prefetch_every_block, RMS_PREFETCH(1))
#define PLACES ->Args({0, 0})->Args({4, 0})->Args({64, 0})->Args({1024, 0})->Args({2112, 0})->Args({0, 8})->Args({0, 128})->Args({0, 1032})
void BM_place_default(benchmark::State& st) { forward_placement<tigon::RmsNormDefaultPolicy>(st, "placed, default"); }
void BM_place_every_block(benchmark::State& st) { forward_placement<RMS_PREFETCH(1)>(st, "placed, prefetch_every_block"); }
BENCHMARK(BM_place_default) PLACES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_place_every_block) PLACES->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BWD_VARIANT(v2_b512_m1_s3_reread, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, false>)
BWD_VARIANT(v2_b512_m1_s2, RmsNormPolicy<4, 256, 2, 512, 1, 2>)
BWD_VARIANT(v2_b512_m2_s3_reread, RmsNormPolicy<4, 256, 2, 512, 2, 3, -1, false, false, false>)
BWD_VARIANT(v2_b512_m1_s3_default, RmsNormPolicy<4, 256, 2, 512, 1, 3>)
// 1.5 points faster at 4096 on the H200, but at hidden 8192 a row group needs 512 threads and two
// blocks per SM cap them at 64 registers: 50% there (kept off the default).
BWD_VARIANT(v2_b256_m2_s3, RmsNormPolicy<4, 256, 2, 256, 2, 3>)
BWD_VARIANT(v4_b512_m1_s3, RmsNormPolicy<4, 256, 4, 512, 1, 3>)
BWD_VARIANT(v4_b512_m1_s3_reread, RmsNormPolicy<4, 256, 4, 512, 1, 3, -1, false, false, false>)
BWD_VARIANT(v4_b256_m1_s3, RmsNormPolicy<4, 256, 4, 256, 1, 3>)
BWD_VARIANT(v2_b512_direct, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, false, true>)
BWD_VARIANT(v2_b256_m2_direct, RmsNormPolicy<4, 256, 2, 256, 2, 3, -1, false, false, true, false, true>)
// More resident threads per SM (the backward issues 0.61 instructions per scheduler cycle with 4
// warps each): 3 or 4 blocks of 256 threads, or 2 of 512, each with 2 stages (shared memory).
BWD_VARIANT(v2_b256_m3_s2, RmsNormPolicy<4, 256, 2, 256, 3, 2>)
BWD_VARIANT(v2_b256_m4_s2, RmsNormPolicy<4, 256, 2, 256, 4, 2>)
BWD_VARIANT(v2_b256_m4_s2_reread, RmsNormPolicy<4, 256, 2, 256, 4, 2, -1, false, false, false>)
BWD_VARIANT(v2_b512_m2_s2, RmsNormPolicy<4, 256, 2, 512, 2, 2>)

// The forward variants as single calls (bench::single): each call alone, as between a training
// step's GEMMs, where a call's ramp-up and drain are not overlapped by the previous call.
#define SINGLE_FWD(label) \
  BENCHMARK(bench::single<BM_fwd_##label>)->Arg(16384)->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
SINGLE_FWD(v4_b128)
SINGLE_FWD(v4_b512)
SINGLE_FWD(v8_b128)
SINGLE_FWD(v2_b256)
SINGLE_FWD(v4_b256_direct)
SINGLE_FWD(v2_b256_direct)
SINGLE_FWD(v4_b256_s3_persistent)
SINGLE_FWD(v4_b256_direct_plain)
SINGLE_FWD(v4_b256_m5)
SINGLE_FWD(v4_b256_m6)
SINGLE_FWD(v4_b256_staged)
SINGLE_FWD(v2_b256_direct_plain)

BENCH_MAIN
