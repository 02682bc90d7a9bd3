// Fused residual add + RMSNorm benchmarks, bf16, against the same work done separately (a plain
// elementwise add kernel and tigon::rms_norm_forward / rms_norm_backward), at LLaMA-class shapes.
// GB/s counts the fused op's useful bytes in both cases, so the two rows of a shape compare
// directly (the separate path moves more bytes for the same result):
//   forward:  read x and the residual, write s and y (+ read w, write rstd)
//             separate: add reads x, residual, writes s; RMSNorm reads s, writes y
//   backward: read dy, dsum and s, write dx (+ read w and rstd, write dW)
//             separate: RMSNorm backward reads dy, s, writes dx'; add reads dx', dsum, writes dx
// Back to back and as single calls, against the device-to-device copy rate measured in the same
// process. Policy sweeps: bench/tuning/bench_add_rms_norm_tuning.cu.
#include "harness.cuh"

#include <tigon/norm/add_rms_norm.cuh>
#include <tigon/norm/rms_norm.cuh>

using tigon::bf16;

namespace {

using bench::check;

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

BENCH_MAIN
