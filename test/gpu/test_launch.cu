// GPU tests of how tigon launches its kernels: programmatic dependent launch (each kernel's blocks
// may be scheduled while the previous kernel in the stream drains) must keep stream order. A long
// chain of dependent calls — each reading what the previous call wrote and overwriting what it read
// (RMSNorm forward and backward with its dW column sum, RoPE in place, cross-entropy's gradient in
// place with its denominator and reduction kernels) — gives bitwise the same results with
// programmatic launch on and off, eagerly and replayed from a CUDA graph.
#include <tigon/loss/cross_entropy.cuh>
#include <tigon/norm/rms_norm.cuh>
#include <tigon/rope/rope.cuh>

#include <cstring>

#include "gpu_test.cuh"

using namespace gpu_test;
using tigon::bf16;

namespace {

constexpr std::int64_t kRows = 4096;   // tokens
constexpr std::int64_t kCols = 4096;   // hidden = 32 heads x 128
constexpr std::int64_t kHeads = 32;
constexpr std::int64_t kHeadDim = 128;
constexpr std::int64_t kVocab = 1024;  // cross-entropy over a [kRows * 4, kVocab] view of x
// Steps of the chain: 24; sanitizer-sized 2, which still meets every kernel of a step and every
// boundary between two of them (the cross-entropy's last kernel before the next step's norm
// included). The shape stays: 4096 tokens give the norm's forward a second wave of blocks and each
// row group of its persistent backward more rows than its pipeline has stages.
int steps() { return gpu_test::sanitizer_sized() ? 2 : 24; }

struct Chain {
  DeviceBuffer<bf16> x{kRows * kCols}, y{kRows * kCols}, w{kCols}, dw{kCols};
  DeviceBuffer<bf16> cos{kRows * kHeadDim}, sin{kRows * kHeadDim};
  DeviceBuffer<float> rstd{kRows}, loss{1};
  DeviceBuffer<std::int32_t> targets{kRows * 4};
  DeviceBuffer<unsigned char> ws_norm{1 << 24}, ws_ce{1 << 20};

  Chain() {
    x.upload(random_values<bf16>(x.count, 0.0, 1.0, nullptr));
    w.upload(random_values<bf16>(w.count, 1.0, 0.1, nullptr));
    std::vector<bf16> c(cos.count), s(sin.count);
    for (std::int64_t t = 0; t < kRows; ++t)
      for (std::int64_t d = 0; d < kHeadDim; ++d) {
        const double a = t * std::pow(10000.0, -2.0 * (d % (kHeadDim / 2)) / kHeadDim);
        c[t * kHeadDim + d] = tigon::from_float<bf16>(static_cast<float>(std::cos(a)));
        s[t * kHeadDim + d] = tigon::from_float<bf16>(static_cast<float>(std::sin(a)));
      }
    cos.upload(c);
    sin.upload(s);
    std::vector<std::int32_t> tg(targets.count);
    std::uniform_int_distribution<std::int32_t> pick(0, kVocab - 1);
    for (auto& v : tg) v = pick(rng());
    targets.upload(tg);
  }

  // One step: y = RMSNorm(x); rotate y in place; x = dRMSNorm(dy = y) (dW too); cross-entropy over
  // x viewed as [kRows * 4, kVocab] logits, its gradient written over x.
  tigon::Status step(cudaStream_t s) {
    tigon::RmsNormForwardArgs<bf16> f;
    f.x = x.ptr;
    f.y = y.ptr;
    f.weight = w.ptr;
    f.rstd = rstd.ptr;
    f.rows = kRows;
    f.cols = kCols;
    TIGON_CHECK(tigon::rms_norm_forward(f, s));

    tigon::RopeArgs<bf16> r;
    r.q = {y.ptr, y.ptr, kHeads, kRows * kCols, kCols, kHeadDim};
    r.batch = 1;
    r.seq = kRows;
    r.head_dim = kHeadDim;
    r.cos = cos.ptr;
    r.sin = sin.ptr;
    r.table_rows = kRows;
    TIGON_CHECK(tigon::rope_forward(r, s));

    tigon::RmsNormBackwardArgs<bf16> b;
    b.dy = y.ptr;
    b.x = x.ptr;
    b.weight = w.ptr;
    b.rstd = rstd.ptr;
    b.dx = x.ptr;  // over the forward's input, which the previous kernels read
    b.dweight = dw.ptr;
    b.rows = kRows;
    b.cols = kCols;
    b.workspace = ws_norm.ptr;
    b.workspace_bytes = ws_norm.bytes();
    TIGON_CHECK(tigon::rms_norm_backward(b, s));

    tigon::CrossEntropyArgs<bf16, std::int32_t> c;
    c.logits = x.ptr;
    c.dlogits = x.ptr;
    c.targets = targets.ptr;
    c.rows = kRows * 4;
    c.vocab = kVocab;
    c.loss = loss.ptr;
    c.grad_scale = static_cast<float>(kRows * 4);  // undoes the mean: x stays O(1e-3..1)
    c.workspace = ws_ce.ptr;
    c.workspace_bytes = ws_ce.bytes();
    return tigon::cross_entropy(c, s);
  }

  struct Result {
    std::vector<bf16> x, y, dw;
    std::vector<float> loss;
  };
  Result result() const { return {x.download(), y.download(), dw.download(), loss.download()}; }
};

bool same_bits(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

void require_same(const Chain::Result& a, const Chain::Result& b) {
  REQUIRE(std::isfinite(a.loss[0]));
  CHECK(same_bits(a.x.data(), b.x.data(), a.x.size() * sizeof(bf16)));
  CHECK(same_bits(a.y.data(), b.y.data(), a.y.size() * sizeof(bf16)));
  CHECK(same_bits(a.dw.data(), b.dw.data(), a.dw.size() * sizeof(bf16)));
  CHECK(same_bits(a.loss.data(), b.loss.data(), sizeof(float)));
}

}  // namespace

TEST_CASE("launch: programmatic dependent launch keeps stream order (eager and graph)", "[launch][gpu]") {
  REQUIRE(tigon::programmatic_launch());  // on by default
  const std::uint64_t seed = rng()();
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto run_eager = [&](bool programmatic) {
    tigon::set_programmatic_launch(programmatic);
    rng().seed(seed);  // the same inputs for every run
    Chain c;
    for (int i = 0; i < steps(); ++i) TIGON_OK(c.step(s));
    CUDA_OK(cudaStreamSynchronize(s));
    return c.result();
  };
  const Chain::Result serial = run_eager(false);
  const Chain::Result overlapped = run_eager(true);
  require_same(serial, overlapped);

  SECTION("the same chain captured in a CUDA graph, replayed") {
    tigon::set_programmatic_launch(true);
    rng().seed(seed);
    Chain c;
    CUDA_OK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < steps(); ++i) TIGON_OK(c.step(s));
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    require_same(serial, c.result());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  tigon::set_programmatic_launch(true);
  cudaStreamDestroy(s);
}

TEST_CASE("launch: the programmatic-launch switch is process-wide and on by default", "[launch][gpu]") {
  // A kernel of this binary (built for sm_90: its PTX version is 90 or more), asked about on this
  // device: programmatic launch exactly when the switch is on and the device is sm_90 or later.
  const void* kernel = reinterpret_cast<const void*>(tigon::detail::column_sum_kernel<float>);
  REQUIRE(tigon::programmatic_launch());
  tigon::set_programmatic_launch(false);
  CHECK_FALSE(tigon::programmatic_launch());
  bool here = true;
  TIGON_OK(tigon::detail::programmatic_launch_here(kernel, here));
  CHECK_FALSE(here);
  tigon::set_programmatic_launch(true);
  TIGON_OK(tigon::detail::programmatic_launch_here(kernel, here));
  int dev = 0, major = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaFuncAttributes attr{};
  CUDA_OK(cudaFuncGetAttributes(&attr, kernel));
  INFO("ptxVersion " << attr.ptxVersion << ", binaryVersion " << attr.binaryVersion);
  // The project builds its tests for sm_90 (CMAKE_CUDA_ARCHITECTURES 90): on sm_90+ the kernel's
  // PTX version must say so, or programmatic launch would be off without notice.
  if (major >= 9) CHECK(attr.ptxVersion >= 90);
  CHECK(here == (major >= 9 && attr.ptxVersion >= 90));
  // Asked again: the cached answer.
  bool again = !here;
  TIGON_OK(tigon::detail::programmatic_launch_here(kernel, again));
  CHECK(again == here);
}
