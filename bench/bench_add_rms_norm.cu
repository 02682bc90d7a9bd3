// Fused residual add + RMSNorm benchmarks, bf16, against the same work done separately (a plain
// elementwise add kernel and tigon::rms_norm_forward / rms_norm_backward), at LLaMA-class shapes.
// GB/s counts the fused op's useful bytes in both cases, so the two rows of a shape compare
// directly (the separate path moves more bytes for the same result):
//   forward:  read x and the residual, write s and y (+ read w, write rstd)
//             separate: add reads x, residual, writes s; RMSNorm reads s, writes y
//   backward: read dy, dsum and s, write dx (+ read w and rstd, write dW)
//             separate: RMSNorm backward reads dy, s, writes dx'; add reads dx', dsum, writes dx
#include "harness.cuh"

#include <tigon/norm/add_rms_norm.cuh>
#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;

namespace {

// The separate add: out = T(a + b), 16-byte vectors, grid-stride over a contiguous tensor, as an
// elementwise framework op does it.
__global__ void add_kernel(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ out,
                           std::size_t n_vec) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n_vec;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 va = a[i], vb = b[i];
    uint4 vo;
    const auto* pa = reinterpret_cast<const __nv_bfloat162*>(&va);
    const auto* pb = reinterpret_cast<const __nv_bfloat162*>(&vb);
    auto* po = reinterpret_cast<__nv_bfloat162*>(&vo);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 fa = __bfloat1622float2(pa[k]), fb = __bfloat1622float2(pb[k]);
      po[k] = __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y);
    }
    out[i] = vo;
  }
}

void add(const bf16* a, const bf16* b, bf16* out, std::size_t n) {
  static const int sms = [] {
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0);
    return v;
  }();
  add_kernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(a), reinterpret_cast<const uint4*>(b),
                               reinterpret_cast<uint4*>(out), n / 8);
}

struct Data {
  int sets = 1;
  std::int64_t rows = 0, cols = 0;
  std::vector<bf16*> x, res, y, s, dy, ds, dx;
  bf16 *w = nullptr, *dw = nullptr;
  std::vector<float*> rstd;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;

  Data(std::int64_t r, std::int64_t c) : rows(r), cols(c) {
    const std::size_t n = static_cast<std::size_t>(r * c);
    sets = bench::rotation(4.0 * n * sizeof(bf16));
    for (int k = 0; k < sets; ++k) {
      for (auto* v : {&x, &res, &y, &s, &dy, &ds, &dx}) v->push_back(bench::alloc<bf16>(n));
      rstd.push_back(bench::alloc<float>(r));
      bench::fill_random(x.back(), n, 11 + k);
      bench::fill_random(res.back(), n, 31 + k, 0.0f, 2.0f);
      bench::fill_random(dy.back(), n, 101 + k);
      bench::fill_random(ds.back(), n, 201 + k, 0.0f, 0.5f);
    }
    w = bench::alloc<bf16>(c);
    dw = bench::alloc<bf16>(c);
    bench::fill_random(w, c, 5, 1.0f, 0.2f);
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
  std::size_t n() const { return static_cast<std::size_t>(rows * cols); }
  tigon::AddRmsNormForwardArgs<bf16> fwd(int i) const {
    const int k = i % sets;
    return {.x = x[k], .residual = res[k], .y = y[k], .sum = s[k], .weight = w, .rstd = rstd[k],
            .rows = rows, .cols = cols};
  }
  tigon::AddRmsNormBackwardArgs<bf16> bwd(int i) const {
    const int k = i % sets;
    return {.dy = dy[k], .dsum = ds[k], .sum = s[k], .weight = w, .rstd = rstd[k], .dx = dx[k],
            .dweight = dw, .rows = rows, .cols = cols, .workspace = ws, .workspace_bytes = ws_bytes};
  }
  // The separate path's RMSNorm calls on the same buffers.
  tigon::RmsNormForwardArgs<bf16> rms_fwd(int i) const {
    const int k = i % sets;
    return {.x = s[k], .y = y[k], .weight = w, .rstd = rstd[k], .rows = rows, .cols = cols};
  }
  tigon::RmsNormBackwardArgs<bf16> rms_bwd(int i) const {
    const int k = i % sets;
    return {.dy = dy[k], .x = s[k], .weight = w, .rstd = rstd[k], .dx = y[k], .dweight = dw,
            .rows = rows, .cols = cols, .workspace = ws, .workspace_bytes = ws_bytes};
  }
};

double fwd_bytes(std::int64_t r, std::int64_t c) { return 4.0 * r * c * 2 + c * 2.0 + r * 4.0; }
double bwd_bytes(std::int64_t r, std::int64_t c) { return 4.0 * r * c * 2 + 2.0 * c * 2 + r * 4.0; }

std::string shape(std::int64_t r, std::int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }

void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

void check_cuda() { BENCH_CUDA(cudaGetLastError()); }

// The workspace for whichever backward is timed (the larger of the two queries).
void alloc_workspace(Data& d) {
  std::size_t fused = 0, separate = 0;
  auto a = d.bwd(0);
  check(tigon::add_rms_norm_backward_workspace_bytes(a, fused));
  auto b = d.rms_bwd(0);
  check(tigon::rms_norm_backward_workspace_bytes(b, separate));
  d.ws_bytes = std::max(fused, separate);
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
}

void BM_forward_fused(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  bench::run(st, "add_rms_norm fwd bf16 " + shape(d.rows, d.cols) + " fused", fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::add_rms_norm_forward(d.fwd(i), nullptr)); });
}

void BM_forward_separate(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  bench::run(st, "add_rms_norm fwd bf16 " + shape(d.rows, d.cols) + " add, then rms_norm",
             fwd_bytes(d.rows, d.cols), [&](int i) {
               const int k = i % d.sets;
               add(d.x[k], d.res[k], d.s[k], d.n());
               check_cuda();
               check(tigon::rms_norm_forward(d.rms_fwd(i), nullptr));
             });
}

void BM_backward_fused(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  alloc_workspace(d);
  for (int k = 0; k < d.sets; ++k) check(tigon::add_rms_norm_forward(d.fwd(k), nullptr));
  bench::run(st, "add_rms_norm bwd bf16 " + shape(d.rows, d.cols) + " fused (dx + dW)",
             bwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::add_rms_norm_backward(d.bwd(i), nullptr)); });
}

void BM_backward_separate(benchmark::State& st) {
  Data d(st.range(0), st.range(1));
  alloc_workspace(d);
  for (int k = 0; k < d.sets; ++k) check(tigon::add_rms_norm_forward(d.fwd(k), nullptr));
  bench::run(st, "add_rms_norm bwd bf16 " + shape(d.rows, d.cols) + " rms_norm bwd, then add",
             bwd_bytes(d.rows, d.cols), [&](int i) {
               const int k = i % d.sets;
               check(tigon::rms_norm_backward(d.rms_bwd(i), nullptr));  // dx' into y
               add(d.y[k], d.ds[k], d.dx[k], d.n());
               check_cuda();
             });
}

// Tuning variants of the compiled kernels at 4096 (RmsNormPolicy, listed below).
template <class P>
void BM_forward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  bench::run(st, std::string("  fwd 4096 policy ") + label, fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::add_rms_norm_forward<bf16, 4096, P>(d.fwd(i), nullptr)); });
}

template <class P>
void BM_backward_policy(benchmark::State& st, const char* label) {
  Data d(st.range(0), 4096);
  auto a = d.bwd(0);
  check(tigon::add_rms_norm_backward_workspace_bytes<bf16, 4096, P>(a, d.ws_bytes));
  BENCH_CUDA(cudaMalloc(&d.ws, d.ws_bytes));
  for (int k = 0; k < d.sets; ++k) check(tigon::add_rms_norm_forward(d.fwd(k), nullptr));
  bench::run(st, std::string("  bwd 4096 policy ") + label, bwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::add_rms_norm_backward<bf16, 4096, P>(d.bwd(i), nullptr)); });
}

using tigon::RmsNormPolicy;

}  // namespace

#define SHAPES ->Args({16384, 4096})->Args({16384, 8192})
#define TIMED ->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_forward_fused) SHAPES TIMED;
BENCHMARK(BM_forward_separate) SHAPES TIMED;
BENCHMARK(BM_backward_fused) SHAPES TIMED;
BENCHMARK(BM_backward_separate) SHAPES TIMED;
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_forward_fused>)->Args({16384, 4096}) TIMED;
BENCHMARK(bench::single<BM_backward_fused>)->Args({16384, 4096}) TIMED;

#define FWD_VARIANT(label, ...)                                                               \
  void BM_fwd_##label(benchmark::State& st) { BM_forward_policy<__VA_ARGS__>(st, #label); }  \
  BENCHMARK(BM_fwd_##label)->Arg(16384) TIMED;
#define BWD_VARIANT(label, ...)                                                               \
  void BM_bwd_##label(benchmark::State& st) { BM_backward_policy<__VA_ARGS__>(st, #label); } \
  BENCHMARK(BM_bwd_##label)->Arg(16384) TIMED;

// RmsNormPolicy<fwd vec/thread, fwd block, bwd vec/thread, bwd block, bwd min blocks/SM, stages,
//               casting (-1: chosen at run time), persistent forward grid, streaming stores,
//               backward keeps rows in registers, direct forward (default true), direct backward,
//               direct forward's streaming hint (default false)>. Rows that leave the last three
//               unspelled take the defaults: the direct forward with plain loads.
// Every knob spelled out (RmsNormPolicy's defaults are RMSNorm's to tune), the default policy first.
FWD_VARIANT(default, tigon::RmsNormDefaultPolicy)
FWD_VARIANT(v4_b256, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false>)
FWD_VARIANT(v4_b256_staged, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, false>)
FWD_VARIANT(v4_b128, RmsNormPolicy<4, 128, 2, 512, 1, 3, -1, false>)
FWD_VARIANT(v2_b256, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false>)
FWD_VARIANT(v8_b256, RmsNormPolicy<8, 256, 2, 512, 1, 3, -1, false>)
FWD_VARIANT(v4_b256_cs, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, true>)
FWD_VARIANT(v4_b256_s2_persistent, RmsNormPolicy<4, 256, 2, 512, 1, 2, -1, true>)
FWD_VARIANT(v4_b256_s3_persistent, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, true>)
// Direct forwards: x and the residual straight into registers (kFwdDirect), with the streaming
// hint or plain loads (kFwdDirectStream false).
FWD_VARIANT(v4_b256_direct, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, true>)
FWD_VARIANT(v2_b256_direct, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false, false, true, true, false, true>)
FWD_VARIANT(v4_b256_direct_plain, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false>)
// The default forward with a floor of 5 or 6 blocks per SM (registers capped at 48 / 40):
FWD_VARIANT(v4_b256_m5, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false, 5>)
FWD_VARIANT(v4_b256_m6, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false, 6>)
FWD_VARIANT(v2_b256_direct_plain, RmsNormPolicy<2, 256, 2, 512, 1, 3, -1, false, false, true, true, false, false>)
BWD_VARIANT(default, tigon::RmsNormDefaultPolicy)
BWD_VARIANT(v2_b512_m1_s3, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, false>)
BWD_VARIANT(v2_b512_m1_s2, RmsNormPolicy<4, 256, 2, 512, 1, 2, -1, false, false, false>)
BWD_VARIANT(v2_b256_m2_s2, RmsNormPolicy<4, 256, 2, 256, 2, 2, -1, false, false, false>)
BWD_VARIANT(v2_b512_m1_s3_keep, RmsNormPolicy<4, 256, 2, 512, 1, 3, -1, false, false, true>)
BWD_VARIANT(v2_b256_m2_s3_keep_cs, RmsNormPolicy<4, 256, 2, 256, 2, 3, -1, false, true, true>)
BWD_VARIANT(v4_b256_m1_s3, RmsNormPolicy<4, 256, 4, 256, 1, 3, -1, false, false, false>)

// The forward variants as single calls (bench::single).
#define SINGLE_FWD(label) BENCHMARK(bench::single<BM_fwd_##label>)->Arg(16384) TIMED;
SINGLE_FWD(v4_b128)
SINGLE_FWD(v2_b256)
SINGLE_FWD(v8_b256)
SINGLE_FWD(v4_b256_s2_persistent)
SINGLE_FWD(v4_b256_direct)
SINGLE_FWD(v2_b256_direct)
SINGLE_FWD(v4_b256_direct_plain)
SINGLE_FWD(v4_b256_m5)
SINGLE_FWD(v4_b256_m6)
SINGLE_FWD(v4_b256_staged)
SINGLE_FWD(v2_b256_direct_plain)

BENCH_MAIN
