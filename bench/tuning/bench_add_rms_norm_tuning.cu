// Fused residual add + RMSNorm tuning benchmarks, bf16 at 16384 x 4096 (built with
// -DTIGON_BUILD_TUNING=ON): the default against policies derived from RmsNormPolicy (the op's
// policy) that change its sizing members. Same timing, rows and copy ceiling as
// bench/bench_add_rms_norm.cu.
#include "../harness.cuh"

#include <tigon/norm/add_rms_norm.cuh>

using tigon::bf16;
using tigon::RmsNormPolicy;

namespace policies {

// Policies derived from RmsNormPolicy that change sizing members (outside the anonymous namespace:
// a kernel instantiated with a type of internal linkage cannot have hidden visibility).
struct FwdV2 : RmsNormPolicy { static constexpr int kFwdVecPerThread = 2; };
struct FwdV8 : RmsNormPolicy { static constexpr int kFwdVecPerThread = 8; };
struct FwdB128 : RmsNormPolicy { static constexpr int kFwdBlockThreads = 128; };
struct FwdMin5 : RmsNormPolicy { static constexpr int kFwdMinBlocksPerSm = 5; };
struct FwdMin6 : RmsNormPolicy { static constexpr int kFwdMinBlocksPerSm = 6; };
struct BwdS2 : RmsNormPolicy { static constexpr int kBwdStages = 2; };
struct BwdV4B256 : RmsNormPolicy {
  static constexpr int kBwdVecPerThread = 4;
  static constexpr int kBwdBlockThreads = 256;
};
struct BwdB256M2S2 : RmsNormPolicy {
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdMinBlocksPerSm = 2;
  static constexpr int kBwdStages = 2;
};

}  // namespace policies

using namespace policies;

namespace {

constexpr std::int64_t kRows = 16384, kCols = 4096;

// Rotating input sets of x, the residual, y, s, dy, dsum, dx and rstd; one weight and dW.
struct Data {
  int sets = 1;
  std::vector<bf16*> x, res, y, s, dy, ds, dx;
  std::vector<float*> rstd;
  bf16 *w = nullptr, *dw = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data() {
    const std::size_t n = static_cast<std::size_t>(kRows * kCols);
    sets = bench::rotation(4.0 * n * sizeof(bf16));
    for (int k = 0; k < sets; ++k) {
      for (auto* v : {&x, &res, &y, &s, &dy, &ds, &dx}) v->push_back(bench::alloc<bf16>(n));
      rstd.push_back(bench::alloc<float>(kRows));
      bench::fill_random(x.back(), n, 11 + k);
      bench::fill_random(res.back(), n, 31 + k, 0.0f, 2.0f);
      bench::fill_random(dy.back(), n, 101 + k);
      bench::fill_random(ds.back(), n, 201 + k, 0.0f, 0.5f);
    }
    w = bench::alloc<bf16>(kCols);
    dw = bench::alloc<bf16>(kCols);
    bench::fill_random(w, kCols, 5, 1.0f, 0.2f);
  }
  ~Data() {
    for (int k = 0; k < sets; ++k) {
      for (auto* v : {&x, &res, &y, &s, &dy, &ds, &dx}) cudaFree((*v)[k]);
      cudaFree(rstd[k]);
    }
    cudaFree(w);
    cudaFree(dw);
    cudaFree(ws);
  }
  tigon::AddRmsNormForwardArgs<bf16> fwd(int i) const {
    const int k = i % sets;
    return {.x = x[k], .residual = res[k], .y = y[k], .sum = s[k], .weight = w, .rstd = rstd[k],
            .rows = kRows, .cols = kCols};
  }
  tigon::AddRmsNormBackwardArgs<bf16> bwd(int i) const {
    const int k = i % sets;
    return {.dy = dy[k], .dsum = ds[k], .sum = s[k], .weight = w, .rstd = rstd[k], .dx = dx[k],
            .dweight = dw, .rows = kRows, .cols = kCols, .workspace = ws, .workspace_bytes = ws_bytes};
  }
  static void check(const tigon::Status& st) {
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.message().c_str());
      std::exit(1);
    }
  }
};

const double kFwdBytes = 4.0 * kRows * kCols * 2 + kCols * 2.0 + kRows * 4.0;
const double kBwdBytes = 4.0 * kRows * kCols * 2 + 2.0 * kCols * 2 + kRows * 4.0;

template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d;
  bench::run(st, std::string("  fwd 4096 policy ") + label, kFwdBytes,
             [&](int i) { Data::check(tigon::add_rms_norm_forward<bf16, kCols, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d;
  auto a = d.bwd(0);
  Data::check(tigon::add_rms_norm_backward_workspace_bytes<bf16, kCols, P>(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int k = 0; k < d.sets; ++k) Data::check(tigon::add_rms_norm_forward(d.fwd(k), nullptr));
  bench::run(st, std::string("  bwd 4096 policy ") + label, kBwdBytes,
             [&](int i) { Data::check(tigon::add_rms_norm_backward<bf16, kCols, P>(d.bwd(i), nullptr)); });
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
FWD(m5, FwdMin5)
FWD(m6, FwdMin6)
BWD(default, RmsNormPolicy)
BWD(s2, BwdS2)
BWD(v4_b256, BwdV4B256)
BWD(b256_m2_s2, BwdB256M2S2)

BENCH_MAIN
