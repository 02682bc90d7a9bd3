// A transformer MLP block, forward and backward, as a C++ trainer writes it with tigon:
//
//   h  = RMSNorm(x; w_norm)               [N, D]
//   gu = h * W_gu^T                        [N, 2I]   one GEMM for the gate and up projections
//   c  = SiLU(gu[:, :I]) * gu[:, I:]       [N, I]    SwiGLU on the fused gate||up buffer
//   y  = c * W_down^T                      [N, D]
//
//   dc      = dy * W_down                  [N, I]
//   dW_down = dy^T * c                     [D, I]    fp32
//   dgu     = SwiGLU backward, written in place over gu (fused layout)
//   dh      = dgu * W_gu                   [N, D]
//   dW_gu   = dgu^T * h                    [2I, D]   fp32
//   dx, dw_norm = RMSNorm backward(dh)
//
// It checks the block against a double-precision reference at a small shape, then times forward
// and backward at LLaMA-3-8B's MLP shape (D 4096, I 14336) for 4096 tokens. Without a GPU it says
// so and exits 77 (ctest: skipped); a mismatch against the reference exits 1.
#include <tigon/blas/gemm.cuh>
#include <tigon/tigon.cuh>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using tigon::bf16;

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                      \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
#define CHECK_TIGON(expr)                                       \
  do {                                                          \
    const tigon::Status s_ = (expr);                            \
    if (!s_.ok()) {                                             \
      std::fprintf(stderr, "%s\n", s_.message().c_str());       \
      std::exit(1);                                             \
    }                                                           \
  } while (0)

template <class T>
T* device_alloc(std::size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

// Parameters, activations saved for the backward, gradients, and the scratch the ops need.
struct MlpBlock {
  std::int64_t N, D, I;
  bf16 *w_norm, *w_gu, *w_down;            // parameters
  bf16 *h, *gu, *c;                        // saved activations (gu becomes dgu in the backward)
  float* rstd;
  bf16 *dc, *dh;                           // gradient scratch
  float *dw_gu, *dw_down;                  // fp32 weight gradients
  bf16* dw_norm;
  void* norm_ws = nullptr;
  std::size_t norm_ws_bytes = 0;

  MlpBlock(std::int64_t n, std::int64_t d, std::int64_t i) : N(n), D(d), I(i) {
    w_norm = device_alloc<bf16>(D);
    w_gu = device_alloc<bf16>(2 * I * D);
    w_down = device_alloc<bf16>(D * I);
    h = device_alloc<bf16>(N * D);
    gu = device_alloc<bf16>(N * 2 * I);
    c = device_alloc<bf16>(N * I);
    rstd = device_alloc<float>(N);
    dc = device_alloc<bf16>(N * I);
    dh = device_alloc<bf16>(N * D);
    dw_gu = device_alloc<float>(2 * I * D);
    dw_down = device_alloc<float>(D * I);
    dw_norm = device_alloc<bf16>(D);
  }
  ~MlpBlock() {
    for (void* p : {(void*)w_norm, (void*)w_gu, (void*)w_down, (void*)h, (void*)gu, (void*)c,
                    (void*)rstd, (void*)dc, (void*)dh, (void*)dw_gu, (void*)dw_down, (void*)dw_norm,
                    norm_ws})
      cudaFree(p);
  }

  void forward(tigon::CublasLtGemm& blas, const bf16* x, bf16* y, cudaStream_t s) {
    CHECK_TIGON(tigon::rms_norm_forward(
        tigon::RmsNormForwardArgs<bf16>{.x = x, .y = h, .weight = w_norm, .rstd = rstd, .rows = N,
                                        .cols = D, .eps = 1e-5f},
        s));
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16>{.a = h, .b = w_gu, .d = gu, .m = N, .n = 2 * I, .k = D,
                                                .op_b = tigon::Op::t},
                          s));
    CHECK_TIGON(tigon::swiglu_forward(
        tigon::GatedForwardArgs<bf16>{.a = gu, .b = gu + I, .c = c, .rows = N, .cols = I,
                                      .a_stride = 2 * I, .b_stride = 2 * I},
        s));
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16>{.a = c, .b = w_down, .d = y, .m = N, .n = D, .k = I,
                                                .op_b = tigon::Op::t},
                          s));
  }

  // dy -> dx; weight gradients into dw_* (overwritten).
  void backward(tigon::CublasLtGemm& blas, const bf16* x, const bf16* dy, bf16* dx, cudaStream_t s) {
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16>{.a = dy, .b = w_down, .d = dc, .m = N, .n = I, .k = D}, s));
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16, float>{.a = dy, .b = c, .d = dw_down, .m = D, .n = I,
                                                       .k = N, .op_a = tigon::Op::t},
                          s));
    CHECK_TIGON(tigon::swiglu_backward(
        tigon::GatedBackwardArgs<bf16>{.dc = dc, .a = gu, .b = gu + I, .da = gu, .db = gu + I, .rows = N,
                                       .cols = I, .a_stride = 2 * I, .b_stride = 2 * I,
                                       .da_stride = 2 * I, .db_stride = 2 * I},
        s));
    const bf16* dgu = gu;
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16>{.a = dgu, .b = w_gu, .d = dh, .m = N, .n = D, .k = 2 * I}, s));
    CHECK_TIGON(blas.gemm(tigon::GemmArgs<bf16, float>{.a = dgu, .b = h, .d = dw_gu, .m = 2 * I, .n = D,
                                                       .k = N, .op_a = tigon::Op::t},
                          s));
    tigon::RmsNormBackwardArgs<bf16> nb{.dy = dh, .x = x, .weight = w_norm, .rstd = rstd, .dx = dx,
                                        .dweight = dw_norm, .rows = N, .cols = D};
    if (norm_ws == nullptr) {  // sized once, outside any capture
      CHECK_TIGON(tigon::rms_norm_backward_workspace_bytes(nb, norm_ws_bytes));
      norm_ws = device_alloc<unsigned char>(norm_ws_bytes);
    }
    nb.workspace = norm_ws;
    nb.workspace_bytes = norm_ws_bytes;
    CHECK_TIGON(tigon::rms_norm_backward(nb, s));
  }
};

double round_bf16(double v) { return tigon::round_to<bf16>(static_cast<float>(v)); }
double silu(double v) { return v / (1 + std::exp(-v)); }

// The same block in double precision, rounding to bf16 where the GPU stores a bf16 tensor.
struct Reference {
  std::vector<double> y, dx, dw_gu, dw_down, dw_norm;
};
Reference reference(std::int64_t N, std::int64_t D, std::int64_t I, const std::vector<double>& x,
                    const std::vector<double>& wn, const std::vector<double>& wgu,
                    const std::vector<double>& wd, const std::vector<double>& dy) {
  Reference r;
  std::vector<double> h(N * D), rs(N), gu(N * 2 * I), c(N * I);
  for (std::int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (std::int64_t d = 0; d < D; ++d) ss += x[n * D + d] * x[n * D + d];
    rs[n] = 1 / std::sqrt(ss / D + 1e-5);
    for (std::int64_t d = 0; d < D; ++d) h[n * D + d] = round_bf16(round_bf16(x[n * D + d] * rs[n]) * wn[d]);
  }
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t j = 0; j < 2 * I; ++j) {
      double s = 0;
      for (std::int64_t d = 0; d < D; ++d) s += h[n * D + d] * wgu[j * D + d];
      gu[n * 2 * I + j] = round_bf16(s);
    }
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < I; ++i) c[n * I + i] = round_bf16(silu(gu[n * 2 * I + i]) * gu[n * 2 * I + I + i]);
  r.y.assign(N * D, 0);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t d = 0; d < D; ++d) {
      double s = 0;
      for (std::int64_t i = 0; i < I; ++i) s += c[n * I + i] * wd[d * I + i];
      r.y[n * D + d] = s;
    }
  std::vector<double> dc(N * I), dgu(N * 2 * I), dh(N * D);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < I; ++i) {
      double s = 0;
      for (std::int64_t d = 0; d < D; ++d) s += dy[n * D + d] * wd[d * I + i];
      dc[n * I + i] = round_bf16(s);
    }
  r.dw_down.assign(D * I, 0);
  for (std::int64_t d = 0; d < D; ++d)
    for (std::int64_t i = 0; i < I; ++i)
      for (std::int64_t n = 0; n < N; ++n) r.dw_down[d * I + i] += dy[n * D + d] * c[n * I + i];
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < I; ++i) {
      const double a = gu[n * 2 * I + i], b = gu[n * 2 * I + I + i], g = dc[n * I + i];
      const double sg = 1 / (1 + std::exp(-a));
      dgu[n * 2 * I + i] = round_bf16(g * b * (sg * (1 + a * (1 - sg))));
      dgu[n * 2 * I + I + i] = round_bf16(g * silu(a));
    }
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t d = 0; d < D; ++d) {
      double s = 0;
      for (std::int64_t j = 0; j < 2 * I; ++j) s += dgu[n * 2 * I + j] * wgu[j * D + d];
      dh[n * D + d] = round_bf16(s);
    }
  r.dw_gu.assign(2 * I * D, 0);
  for (std::int64_t j = 0; j < 2 * I; ++j)
    for (std::int64_t d = 0; d < D; ++d)
      for (std::int64_t n = 0; n < N; ++n) r.dw_gu[j * D + d] += dgu[n * 2 * I + j] * h[n * D + d];
  r.dx.assign(N * D, 0);
  r.dw_norm.assign(D, 0);
  for (std::int64_t n = 0; n < N; ++n) {
    double dot = 0;
    for (std::int64_t d = 0; d < D; ++d) dot += dh[n * D + d] * wn[d] * x[n * D + d] * rs[n];
    for (std::int64_t d = 0; d < D; ++d) {
      const double xh = x[n * D + d] * rs[n];
      r.dx[n * D + d] = rs[n] * (dh[n * D + d] * wn[d] - xh * dot / D);
      r.dw_norm[d] += dh[n * D + d] * round_bf16(xh);
    }
  }
  return r;
}

template <class T>
double rel_l2(const std::vector<T>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = static_cast<double>(tigon::to_float(got[i]));
    num += std::isfinite(g) ? (g - ref[i]) * (g - ref[i]) : INFINITY;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

template <class T>
std::vector<T> download(const T* p, std::size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <class T>
std::vector<T> upload_random(T*& dst, std::size_t n, double mean, double sd, std::vector<double>& as_double,
                             std::mt19937& gen) {
  std::normal_distribution<float> nd(static_cast<float>(mean), static_cast<float>(sd));
  std::vector<T> h(n);
  as_double.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    h[i] = tigon::from_float<T>(nd(gen));
    as_double[i] = tigon::to_float(h[i]);
  }
  CHECK_CUDA(cudaMemcpy(dst, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return h;
}

bool check_small(tigon::CublasLtGemm& blas) {
  const std::int64_t N = 64, D = 128, I = 256;
  std::mt19937 gen(7);
  MlpBlock m(N, D, I);
  bf16* x = device_alloc<bf16>(N * D);
  bf16* dy = device_alloc<bf16>(N * D);
  bf16* y = device_alloc<bf16>(N * D);
  bf16* dx = device_alloc<bf16>(N * D);
  std::vector<double> xd, wnd, wgud, wdd, dyd;
  upload_random(x, N * D, 0, 1, xd, gen);
  upload_random(m.w_norm, D, 1, 0.1, wnd, gen);
  upload_random(m.w_gu, 2 * I * D, 0, 1 / std::sqrt(double(D)), wgud, gen);
  upload_random(m.w_down, D * I, 0, 1 / std::sqrt(double(I)), wdd, gen);
  upload_random(dy, N * D, 0, 1, dyd, gen);
  m.forward(blas, x, y, nullptr);
  m.backward(blas, x, dy, dx, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  const Reference r = reference(N, D, I, xd, wnd, wgud, wdd, dyd);
  const double e[] = {rel_l2(download(y, N * D), r.y), rel_l2(download(dx, N * D), r.dx),
                      rel_l2(download(m.dw_gu, 2 * I * D), r.dw_gu),
                      rel_l2(download(m.dw_down, D * I), r.dw_down), rel_l2(download(m.dw_norm, D), r.dw_norm)};
  const char* names[] = {"y", "dx", "dW_gu", "dW_down", "dw_norm"};
  bool ok = true;
  for (int i = 0; i < 5; ++i) {
    std::printf("  %-8s relative L2 error vs the double reference: %.2e\n", names[i], e[i]);
    ok = ok && e[i] < 2e-2;
  }
  for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx}) cudaFree(p);
  return ok;
}

__global__ void fill(bf16* p, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 29;
    p[i] = __float2bfloat16_rn(scale * (static_cast<float>(z & 0xFFFFFF) / 16777216.0f - 0.5f) * 3.46f);
  }
}

void time_large(tigon::CublasLtGemm& blas) {
  const std::int64_t N = 4096, D = 4096, I = 14336;
  MlpBlock m(N, D, I);
  bf16* x = device_alloc<bf16>(N * D);
  bf16* dy = device_alloc<bf16>(N * D);
  bf16* y = device_alloc<bf16>(N * D);
  bf16* dx = device_alloc<bf16>(N * D);
  fill<<<1024, 256>>>(x, N * D, 1, 1.0f);
  fill<<<1024, 256>>>(dy, N * D, 2, 1.0f);
  fill<<<1024, 256>>>(m.w_norm, D, 3, 0.1f);
  fill<<<1024, 256>>>(m.w_gu, 2 * I * D, 4, 0.02f);
  fill<<<1024, 256>>>(m.w_down, D * I, 5, 0.01f);
  cudaEvent_t a, b, c;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventCreate(&c);
  for (int i = 0; i < 2; ++i) {  // warm-up: algorithm selection, workspace sizing
    m.forward(blas, x, y, nullptr);
    m.backward(blas, x, dy, dx, nullptr);
  }
  std::vector<float> f, bw;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(a);
    m.forward(blas, x, y, nullptr);
    cudaEventRecord(b);
    m.backward(blas, x, dy, dx, nullptr);
    cudaEventRecord(c);
    cudaEventSynchronize(c);
    float t1 = 0, t2 = 0;
    cudaEventElapsedTime(&t1, a, b);
    cudaEventElapsedTime(&t2, b, c);
    f.push_back(t1);
    bw.push_back(t2);
  }
  std::sort(f.begin(), f.end());
  std::sort(bw.begin(), bw.end());
  const double fm = 0.5 * (f[4] + f[5]), bm = 0.5 * (bw[4] + bw[5]);
  const double flop_fwd = 6.0 * N * D * I, flop_bwd = 12.0 * N * D * I;
  std::printf("MLP block N %lld, D %lld, I %lld, bf16 (median of 10): forward %.3f ms (%.0f TFLOP/s of "
              "GEMM work), backward %.3f ms (%.0f TFLOP/s)\n",
              static_cast<long long>(N), static_cast<long long>(D), static_cast<long long>(I), fm,
              flop_fwd / (fm * 1e-3) / 1e12, bm, flop_bwd / (bm * 1e-3) / 1e12);
  for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx}) cudaFree(p);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA GPU here: built, not run\n");
    return 77;
  }
  const std::size_t ws_bytes = 32u << 20;  // cuBLASLt workspace
  void* ws = device_alloc<unsigned char>(ws_bytes);
  int rc = 0;
  {
    tigon::CublasLtGemm blas(ws, ws_bytes);
    CHECK_TIGON(blas.status());
    std::printf("MLP block 64 x 128 x 256 against a double-precision reference:\n");
    if (!check_small(blas)) {
      std::printf("FAILED: error above 2e-2\n");
      rc = 1;
    } else {
      time_large(blas);
    }
  }
  cudaFree(ws);
  return rc;
}
