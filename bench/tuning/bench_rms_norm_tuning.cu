// RMSNorm tuning benchmarks, bf16 at 16384 x 4096 (built with -DTIGON_BUILD_TUNING=ON): the default
// against policies derived from RmsNormPolicy that change its sizing members, and probes of
// where the default's time goes (programmatic dependent launch off, the backward without dW, the
// dW column sums alone, the forward without weight or rstd, the forward's tensors at other
// placements). Same timing, rows and copy ceiling as bench/bench_rms_norm.cu.
#include "../harness.cuh"

#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;
using tigon::RmsNormPolicy;

namespace policies {

// Policies derived from RmsNormPolicy that change sizing members (outside the anonymous namespace:
// a kernel instantiated with a type of internal linkage cannot have hidden visibility).
struct FwdV2 : RmsNormPolicy { static constexpr int kFwdVecPerThread = 2; };
struct FwdV8 : RmsNormPolicy { static constexpr int kFwdVecPerThread = 8; };
struct FwdB128 : RmsNormPolicy { static constexpr int kFwdBlockThreads = 128; };
struct FwdB512 : RmsNormPolicy { static constexpr int kFwdBlockThreads = 512; };
struct FwdMin5 : RmsNormPolicy { static constexpr int kFwdMinBlocksPerSm = 5; };  // 48 registers
struct FwdMin6 : RmsNormPolicy { static constexpr int kFwdMinBlocksPerSm = 6; };  // 40, spilling
struct BwdS2 : RmsNormPolicy { static constexpr int kBwdStages = 2; };
struct BwdV4 : RmsNormPolicy { static constexpr int kBwdVecPerThread = 4; };
struct BwdB256M2 : RmsNormPolicy {  // at 8192 its 512-thread row groups are capped at 64 registers
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdMinBlocksPerSm = 2;
};
struct BwdB256M4S2 : RmsNormPolicy {  // more resident threads per SM
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdMinBlocksPerSm = 4;
  static constexpr int kBwdStages = 2;
};

}  // namespace policies

using namespace policies;

namespace {

constexpr std::int64_t kRows = 16384, kCols = 4096;

// Rotating input sets of x, y (also dx), dy and rstd; one weight and dW.
struct Data {
  int sets = 1;
  std::vector<bf16*> x, y, dy;
  std::vector<float*> rstd;
  bf16 *w = nullptr, *dw = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data() {
    const std::size_t n = static_cast<std::size_t>(kRows * kCols);
    sets = bench::rotation(3.0 * n * sizeof(bf16));
    for (int s = 0; s < sets; ++s) {
      for (auto* v : {&x, &y, &dy}) v->push_back(bench::alloc<bf16>(n));
      rstd.push_back(bench::alloc<float>(kRows));
      bench::fill_random(x.back(), n, 11 + s);
      bench::fill_random(dy.back(), n, 101 + s);
    }
    w = bench::alloc<bf16>(kCols);
    dw = bench::alloc<bf16>(kCols);
    bench::fill_random(w, kCols, 5, 1.0f, 0.2f);
  }
  ~Data() {
    for (int s = 0; s < sets; ++s) {
      for (auto* v : {&x, &y, &dy}) cudaFree((*v)[s]);
      cudaFree(rstd[s]);
    }
    cudaFree(w);
    cudaFree(dw);
    cudaFree(ws);
  }
  tigon::RmsNormForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    return {.x = x[s], .y = y[s], .weight = w, .rstd = rstd[s], .rows = kRows, .cols = kCols};
  }
  tigon::RmsNormBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    return {.dy = dy[s], .x = x[s], .weight = w, .rstd = rstd[s], .dx = y[s], .dweight = dw,
            .rows = kRows, .cols = kCols, .workspace = ws, .workspace_bytes = ws_bytes};
  }
  // The workspace of the backward with policy P, and every set's rstd from a forward.
  template <class P>
  void prepare_backward() {
    auto a = bwd(0);
    check(tigon::rms_norm_backward_workspace_bytes<bf16, kCols, P>(a, ws_bytes));
    BENCH_CUDA(cudaMalloc(&ws, ws_bytes));
    for (int s = 0; s < sets; ++s) check(tigon::rms_norm_forward(fwd(s), nullptr));
  }
  static void check(const tigon::Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.message().c_str());
      std::exit(1);
    }
  }
};

const double kFwdBytes = 2.0 * kRows * kCols * 2 + kCols * 2.0 + kRows * 4.0;
const double kBwdBytes = 3.0 * kRows * kCols * 2 + 2.0 * kCols * 2 + kRows * 4.0;

template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d;
  bench::run(st, std::string("  fwd 4096 policy ") + label, kFwdBytes,
             [&](int i) { Data::check(tigon::rms_norm_forward<bf16, kCols, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d;
  d.prepare_backward<P>();
  bench::run(st, std::string("  bwd 4096 policy ") + label, kBwdBytes,
             [&](int i) { Data::check(tigon::rms_norm_backward<bf16, kCols, P>(d.bwd(i), nullptr)); });
}


// Probes of the default.
void BM_forward_serial(benchmark::State& st) {  // programmatic dependent launch off
  tigon::set_programmatic_launch(false);
  BM_forward_policy<RmsNormPolicy>(st, "default, serial launch");
  tigon::set_programmatic_launch(true);
}

void BM_backward_serial(benchmark::State& st) {
  tigon::set_programmatic_launch(false);
  BM_backward_policy<RmsNormPolicy>(st, "default, serial launch");
  tigon::set_programmatic_launch(true);
}

// The backward without dW: no partial rows, no column sums (the bytes counted without dW).
void BM_backward_dx_only(benchmark::State& st) {
  Data d;
  for (int s = 0; s < d.sets; ++s) Data::check(tigon::rms_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "  bwd 4096 dx only (no dW)", 3.0 * kRows * kCols * 2 + kCols * 2.0 + kRows * 4.0,
             [&](int i) {
               auto a = d.bwd(i);
               a.dweight = nullptr;
               a.workspace = nullptr;
               a.workspace_bytes = 0;
               Data::check(tigon::rms_norm_backward(a, nullptr));
             });
}

// The dW column sums alone, over as many partial rows as the default backward writes.
void BM_backward_column_sums(benchmark::State& st) {
  Data d;
  d.prepare_backward<RmsNormPolicy>();
  const std::int64_t parts = static_cast<std::int64_t>(d.ws_bytes / (sizeof(float) * kCols));
  bench::fill_random(static_cast<float*>(d.ws), static_cast<std::size_t>(parts * kCols), 7);
  bench::run(st, "  bwd 4096 column sums alone (" + std::to_string(parts) + " rows)",
             parts * kCols * 4.0 + kCols * 2.0, [&](int) {
               Data::check(tigon::column_sum(static_cast<const float*>(d.ws), parts, kCols, d.dw, false,
                                             nullptr, "bench"));
             });
}

// The forward without the weight and / or the saved rstd (bytes counted as with them).
void BM_forward_without(benchmark::State& st) {
  Data d;
  const bool no_w = st.range(0) & 1, no_rstd = st.range(0) & 2;
  bench::run(st, std::string("  fwd 4096 without") + (no_w ? " weight" : "") + (no_rstd ? " rstd" : ""),
             kFwdBytes, [&](int i) {
               auto a = d.fwd(i);
               if (no_w) a.weight = nullptr;
               if (no_rstd) a.rstd = nullptr;
               Data::check(tigon::rms_norm_forward(a, nullptr));
             });
}

// The forward with x and y in one allocation, y starting range(0) KiB after the end of x, and the
// weight range(1) KiB into a second allocation (rstd 64 KiB after it): the same kernel can run a
// few percent slower at some relative placements of its tensors.
void BM_forward_placement(benchmark::State& st) {
  const std::size_t n = static_cast<std::size_t>(kRows * kCols);
  const std::size_t y_off = static_cast<std::size_t>(st.range(0)) * 1024;
  const std::size_t pad = static_cast<std::size_t>(st.range(1)) * 1024;
  unsigned char* slab = bench::alloc<unsigned char>(2 * n * sizeof(bf16) + y_off);
  unsigned char* small = bench::alloc<unsigned char>(pad + (1 << 20));
  bf16* x = reinterpret_cast<bf16*>(slab);
  bf16* y = reinterpret_cast<bf16*>(slab + n * sizeof(bf16) + y_off);
  bf16* w = reinterpret_cast<bf16*>(small + pad);
  float* rstd = reinterpret_cast<float*>(small + pad + 65536);
  bench::fill_random(x, n, 11);
  bench::fill_random(w, kCols, 5, 1.0f, 0.2f);
  const tigon::RmsNormForwardArgs<bf16> a{.x = x, .y = y, .weight = w, .rstd = rstd, .rows = kRows, .cols = kCols};
  bench::run(st,
             "  fwd 4096 placed y+" + std::to_string(st.range(0)) + "K w+" + std::to_string(st.range(1)) + "K",
             kFwdBytes, [&](int) { Data::check(tigon::rms_norm_forward<bf16, kCols>(a, nullptr)); });
  cudaFree(slab);
  cudaFree(small);
}

}  // namespace

#define TIMED ->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
#define FWD(label, P)                                                                        \
  void BM_fwd_##label(benchmark::State& st) { BM_forward_policy<P>(st, #label); }          \
  BENCHMARK(BM_fwd_##label) TIMED;                                                           \
  BENCHMARK(bench::single<BM_fwd_##label>) TIMED;
#define BWD(label, P)                                                                        \
  void BM_bwd_##label(benchmark::State& st) { BM_backward_policy<P>(st, #label); }         \
  BENCHMARK(BM_bwd_##label) TIMED;

FWD(default, RmsNormPolicy)
FWD(v2, FwdV2)
FWD(v8, FwdV8)
FWD(b128, FwdB128)
FWD(b512, FwdB512)
FWD(m5, FwdMin5)
FWD(m6, FwdMin6)
BWD(default, RmsNormPolicy)
BWD(s2, BwdS2)
BWD(v4, BwdV4)
BWD(b256_m2, BwdB256M2)
BWD(b256_m4_s2, BwdB256M4S2)

BENCHMARK(BM_forward_serial) TIMED;
BENCHMARK(BM_backward_serial) TIMED;
BENCHMARK(BM_backward_dx_only) TIMED;
BENCHMARK(BM_backward_column_sums) TIMED;
BENCHMARK(BM_forward_without)->Arg(1)->Arg(2)->Arg(3) TIMED;
BENCHMARK(BM_forward_placement)
    ->Args({0, 0})->Args({4, 0})->Args({64, 0})->Args({1024, 0})->Args({2112, 0})->Args({0, 8})
    ->Args({0, 128})->Args({0, 1032}) TIMED;

BENCH_MAIN
