// LayerNorm tuning benchmarks, bf16 at 16384 x 4096 (built with -DTIGON_BUILD_TUNING=ON): the
// default against policies derived from LayerNormPolicy that change its sizing members, and
// the backward without dW and dB (where its time goes). Same timing, rows and copy ceiling as
// bench/bench_layer_norm.cu.
#include "../harness.cuh"

#include <tigon/norm/layer_norm.cuh>

using tigon::bf16;
using tigon::LayerNormPolicy;

namespace policies {

// Policies derived from LayerNormPolicy that change sizing members (outside the anonymous namespace:
// a kernel instantiated with a type of internal linkage cannot have hidden visibility).
struct FwdB128 : LayerNormPolicy { static constexpr int kFwdBlockThreads = 128; };
struct FwdV2 : LayerNormPolicy { static constexpr int kFwdVecPerThread = 2; };
struct FwdWarpPerRow : LayerNormPolicy { static constexpr int kFwdVecPerThread = 16; };  // no named barrier
struct FwdMin5 : LayerNormPolicy { static constexpr int kFwdMinBlocksPerSm = 5; };
struct FwdMin6 : LayerNormPolicy { static constexpr int kFwdMinBlocksPerSm = 6; };
struct BwdS2 : LayerNormPolicy { static constexpr int kBwdStages = 2; };
struct BwdS4 : LayerNormPolicy { static constexpr int kBwdStages = 4; };
struct BwdB256M2 : LayerNormPolicy {
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdMinBlocksPerSm = 2;
};
struct BwdV1B1024 : LayerNormPolicy {
  static constexpr int kBwdVecPerThread = 1;
  static constexpr int kBwdBlockThreads = 1024;
  static constexpr int kBwdStages = 2;
};

}  // namespace policies

using namespace policies;

namespace {

constexpr std::int64_t kRows = 16384, kCols = 4096;

// Rotating input sets of x, y (also dx), dy, mean and rstd; one weight, bias, dW and dB.
struct Data {
  int sets = 1;
  std::vector<bf16*> x, y, dy;
  std::vector<float*> mean, rstd;
  bf16 *w = nullptr, *b = nullptr, *dw = nullptr, *db = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data() {
    const std::size_t n = static_cast<std::size_t>(kRows * kCols);
    sets = bench::rotation(3.0 * n * sizeof(bf16));
    for (int s = 0; s < sets; ++s) {
      for (auto* v : {&x, &y, &dy}) v->push_back(bench::alloc<bf16>(n));
      for (auto* v : {&mean, &rstd}) v->push_back(bench::alloc<float>(kRows));
      bench::fill_random(x.back(), n, 11 + s, 0.5f);
      bench::fill_random(dy.back(), n, 101 + s);
    }
    for (auto** p : {&w, &b, &dw, &db}) *p = bench::alloc<bf16>(kCols);
    bench::fill_random(w, kCols, 5, 1.0f, 0.2f);
    bench::fill_random(b, kCols, 6, 0.0f, 0.2f);
  }
  ~Data() {
    for (int s = 0; s < sets; ++s) {
      for (auto* v : {&x, &y, &dy}) cudaFree((*v)[s]);
      for (auto* v : {&mean, &rstd}) cudaFree((*v)[s]);
    }
    for (bf16* p : {w, b, dw, db}) cudaFree(p);
    cudaFree(ws);
  }
  tigon::LayerNormForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    return {.x = x[s], .y = y[s], .weight = w, .bias = b, .mean = mean[s], .rstd = rstd[s],
            .rows = kRows, .cols = kCols};
  }
  tigon::LayerNormBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    return {.dy = dy[s], .x = x[s], .weight = w, .mean = mean[s], .rstd = rstd[s], .dx = y[s],
            .dweight = dw, .dbias = db, .rows = kRows, .cols = kCols, .workspace = ws,
            .workspace_bytes = ws_bytes};
  }
  static void check(const tigon::Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.message().c_str());
      std::exit(1);
    }
  }
};

const double kFwdBytes = 2.0 * kRows * kCols * 2 + 2.0 * kCols * 2 + 2.0 * kRows * 4;
const double kBwdBytes = 3.0 * kRows * kCols * 2 + 3.0 * kCols * 2 + 2.0 * kRows * 4;

template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d;
  bench::run(st, std::string("  fwd 4096 policy ") + label, kFwdBytes,
             [&](int i) { Data::check(tigon::layer_norm_forward<bf16, kCols, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d;
  auto a = d.bwd(0);
  Data::check(tigon::layer_norm_backward_workspace_bytes<bf16, kCols, P>(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int s = 0; s < d.sets; ++s) Data::check(tigon::layer_norm_forward(d.fwd(s), nullptr));
  bench::run(st, std::string("  bwd 4096 policy ") + label, kBwdBytes,
             [&](int i) { Data::check(tigon::layer_norm_backward<bf16, kCols, P>(d.bwd(i), nullptr)); });
}

// The backward without dW and dB: no partial rows, no column sums.
void BM_backward_dx_only(benchmark::State& st) {
  Data d;
  for (int s = 0; s < d.sets; ++s) Data::check(tigon::layer_norm_forward(d.fwd(s), nullptr));
  bench::run(st, "  bwd 4096 dx only (no dW, dB)", 3.0 * kRows * kCols * 2 + kCols * 2.0 + 2.0 * kRows * 4,
             [&](int i) {
               auto a = d.bwd(i);
               a.dweight = nullptr;
               a.dbias = nullptr;
               a.workspace = nullptr;
               a.workspace_bytes = 0;
               Data::check(tigon::layer_norm_backward(a, nullptr));
             });
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

FWD(default, LayerNormPolicy)
FWD(b128, FwdB128)
FWD(v2, FwdV2)
FWD(v16_warp_per_row, FwdWarpPerRow)
FWD(m5, FwdMin5)
FWD(m6, FwdMin6)
BWD(default, LayerNormPolicy)
BWD(s2, BwdS2)
BWD(s4, BwdS4)
BWD(b256_m2, BwdB256M2)
BWD(v1_b1024_s2, BwdV1B1024)

BENCHMARK(BM_backward_dx_only) TIMED;

BENCH_MAIN
