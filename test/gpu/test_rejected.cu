// Rejected calls on a GPU: every bad call returns its error, launches nothing and writes nothing.
// Each case places all of its buffers, workspaces included, in one poisoned device arena; the call is
// made once under a stream capture (the captured graph must hold no node: no kernel, copy or memset
// was enqueued, and the capture stays valid: no call that a capture forbids) and once eagerly (after
// a synchronisation, every byte of the arena must be as poisoned). The composite ops run their GEMMs
// on cuBLASLt through a back end that cannot run one shape, the last chunk's: each must refuse the
// whole call before its first write, dW accumulated in place included.
#include "gpu_test.cuh"

#include <tigon/activation/gated.cuh>
#include <tigon/blas/gemm.cuh>
#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/divergence.cuh>
#include <tigon/loss/linear_cross_entropy.cuh>
#include <tigon/loss/linear_divergence.cuh>
#include <tigon/loss/linear_logprob.cuh>
#include <tigon/norm/layer_norm.cuh>
#include <tigon/norm/rms_norm.cuh>
#include <tigon/optim/adamw.cuh>
#include <tigon/rope/rope.cuh>

using namespace tigon;
using namespace gpu_test;

namespace {

constexpr unsigned char kPoison = 0x5a;

// One device arena for every buffer of a case; offsets are multiples of 256.
struct Arena {
  static constexpr std::size_t kBytes = std::size_t{1} << 20;
  DeviceBuffer<unsigned char> buf{kBytes};
  template <class T>
  T* at(std::size_t off) {
    return reinterpret_cast<T*>(buf.ptr + off);
  }
  void poison() {
    REQUIRE(cudaMemset(buf.ptr, kPoison, kBytes) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  // Bytes that are no longer the poison, and the first of them.
  std::size_t changed(std::size_t& first) {
    std::vector<unsigned char> h(kBytes);
    REQUIRE(cudaMemcpy(h.data(), buf.ptr, kBytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    std::size_t n = 0;
    first = kBytes;
    for (std::size_t i = 0; i < kBytes; ++i) {
      if (h[i] != kPoison) {
        if (n++ == 0) first = i;
      }
    }
    return n;
  }
};

Arena& arena() {
  static Arena a;
  return a;
}

// The call under a capture (no node, a valid capture, the expected error), then eagerly (the
// expected error, no CUDA error, the arena unchanged). `arg` null: the argument is not checked
// (a back end's refusal names none).
template <class F>
void expect_rejected(const char* what, Errc code, const char* arg, F&& call) {
  INFO(what);
  Arena& ar = arena();
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ar.poison();
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const Status captured = call(s);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  INFO("capture: " << cudaGetErrorString(end) << "; status: " << captured.message());
  CHECK(end == cudaSuccess);
  std::size_t nodes = 0;
  if (graph != nullptr) {
    CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  CHECK(nodes == 0);
  CHECK(captured.code() == code);
  if (arg != nullptr) CHECK(std::string(captured.argument()) == arg);
  const Status eager = call(s);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaGetLastError());
  INFO("eager: " << eager.message());
  CHECK(eager.code() == code);
  std::size_t first = 0;
  const std::size_t n = ar.changed(first);
  INFO(n << " bytes written, the first at offset " << first);
  CHECK(n == 0);
  CUDA_OK(cudaStreamDestroy(s));
}

// cuBLASLt for every product but those with m == reject_m, which its check() refuses.
struct RejectOneShape {
  CublasLtGemm& inner;
  std::int64_t reject_m;
  template <class A, class B>
  Status check(const GemmArgs<A, B>& g) {
    if (g.m == reject_m) return Status::error(Errc::unsupported, "gemm", "", "no algorithm for this shape (test)");
    return inner.check(g);
  }
  template <class A, class B>
  Status gemm(const GemmArgs<A, B>& g, cudaStream_t stream) {
    return inner.gemm(g, stream);
  }
};

struct Blas {
  DeviceBuffer<unsigned char> ws{std::size_t{4} << 20};
  CublasLtGemm gemm{ws.ptr, ws.bytes()};
};

}  // namespace

TEST_CASE("rejected: the norms", "[rejected][gpu]") {
  Arena& a = arena();
  RmsNormForwardArgs<bf16> f{.x = a.at<bf16>(0), .y = a.at<bf16>(8192), .weight = a.at<bf16>(16384),
                             .rstd = a.at<float>(17408), .rows = 8, .cols = 256};
  auto bad = f;
  bad.y = a.at<bf16>(0) + 3;  // over x, not the same matrix
  expect_rejected("rms_norm y over x", Errc::aliasing, "y", [&](cudaStream_t s) { return rms_norm_forward(bad, s); });
  bad = f;
  bad.eps = __builtin_nanf("");
  expect_rejected("rms_norm eps NaN", Errc::invalid_value, "eps", [&](cudaStream_t s) { return rms_norm_forward(bad, s); });
  LayerNormBackwardArgs<bf16> b{.dy = a.at<bf16>(0), .x = a.at<bf16>(8192), .weight = a.at<bf16>(16384),
                                .mean = a.at<float>(17408), .rstd = a.at<float>(17664), .dx = a.at<bf16>(0),
                                .dweight = a.at<bf16>(18432), .dbias = a.at<bf16>(19456), .rows = 8, .cols = 256,
                                .workspace = a.at<void>(8192), .workspace_bytes = 65536};  // the workspace over x
  expect_rejected("layer_norm_backward workspace over x", Errc::aliasing, "workspace",
                  [&](cudaStream_t s) { return layer_norm_backward(b, s); });
}

TEST_CASE("rejected: rope, gated", "[rejected][gpu]") {
  Arena& a = arena();
  RopeArgs<bf16> r;
  bf16* q = a.at<bf16>(0);
  bf16* k = a.at<bf16>(16384);
  r.q = {.in = q, .out = q, .heads = 4, .stride_b = 4 * 4 * 64, .stride_t = 4 * 64, .stride_h = 64};
  r.k = {.in = k, .out = k, .heads = 2, .stride_b = 4 * 2 * 64, .stride_t = 2 * 64, .stride_h = 64};
  r.batch = 2;
  r.seq = 4;
  r.head_dim = 64;
  r.cos = a.at<bf16>(32768);
  r.sin = a.at<bf16>(33792);
  r.table_rows = 4;
  auto bad = r;
  bad.k.in = bad.k.out = const_cast<bf16*>(r.cos);  // the rotated k written over the cos table
  expect_rejected("rope k over the cos table", Errc::aliasing, "k.out", [&](cudaStream_t s) { return rope_forward(bad, s); });
  GatedForwardArgs<bf16> g{.a = a.at<bf16>(0), .b = a.at<bf16>(65536), .c = a.at<bf16>(131072), .rows = 8, .cols = 256};
  auto gb = g;
  gb.c = a.at<bf16>(0) + 3;  // over a, not the same matrix
  expect_rejected("swiglu c over a", Errc::aliasing, "c", [&](cudaStream_t s) { return swiglu_forward(gb, s); });
}

TEST_CASE("rejected: cross-entropy and the divergences", "[rejected][gpu]") {
  Arena& a = arena();
  CrossEntropyArgs<bf16> c{.logits = a.at<bf16>(0), .targets = a.at<std::int64_t>(1024), .rows = 8, .vocab = 64,
                           .dlogits = a.at<bf16>(0), .loss = a.at<float>(2048), .workspace = a.at<void>(4096),
                           .workspace_bytes = 4096};
  auto bad = c;
  bad.loss_rows = a.at<float>(4096 + 64);  // inside the workspace
  expect_rejected("cross_entropy loss_rows in the workspace", Errc::aliasing, "workspace",
                  [&](cudaStream_t s) { return cross_entropy(bad, s); });
  bad = c;
  bad.label_smoothing = __builtin_nanf("");
  expect_rejected("cross_entropy smoothing NaN", Errc::invalid_value, "label_smoothing",
                  [&](cudaStream_t s) { return cross_entropy(bad, s); });
  DivergenceArgs<bf16, float> d{.student = a.at<bf16>(0), .teacher = a.at<float>(8192), .rows = 8, .vocab = 64,
                                .labels = a.at<std::int64_t>(12288), .dx = a.at<bf16>(16384),
                                .loss = a.at<float>(20480), .loss_rows = a.at<float>(20736),
                                .workspace = a.at<void>(24576), .workspace_bytes = 4096};
  expect_rejected("divergence beta 1.5", Errc::invalid_value, "beta",
                  [&](cudaStream_t s) { return divergence(d, GeneralizedJSD{1.5f}, s); });
  auto dt = d;
  dt.temperature = 0.0f;
  dt.student_input = DivergenceInput::logits;
  expect_rejected("divergence temperature 0", Errc::invalid_value, "temperature",
                  [&](cudaStream_t s) { return divergence(dt, GeneralizedJSD{0.5f}, s); });
}

TEST_CASE("rejected: a GEMM refused inside the composite ops writes nothing", "[rejected][gpu]") {
  Arena& a = arena();
  Blas blas;
  // Linear cross-entropy: 8 tokens in chunks of 3, 3 and 2; the last chunk's products refused;
  // dW and dbias accumulated in place.
  LinearCrossEntropyArgs<bf16> c;
  c.x = a.at<const bf16>(0);         // 8 x 64
  c.weight = a.at<const bf16>(1024);  // 64 x 64
  c.hidden = 64;
  c.loss.targets = a.at<const std::int64_t>(16384);
  c.loss.rows = 8;
  c.loss.vocab = 64;
  c.loss.loss = a.at<float>(17408);
  c.dx = a.at<bf16>(18432);
  c.dweight = a.at<float>(20480);  // 64 x 64 fp32
  c.dbias = a.at<float>(40960);
  c.chunk = 3;
  c.accumulate = true;
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_workspace_bytes(c, bytes));
  REQUIRE(bytes <= 256 * 1024);
  c.workspace = a.at<void>(65536);
  c.workspace_bytes = bytes;
  RejectOneShape last{blas.gemm, 2};
  expect_rejected("linear_cross_entropy, the last chunk's GEMM refused", Errc::unsupported, nullptr,
                  [&](cudaStream_t s) { return linear_cross_entropy(c, last, s); });
  // Linear divergence (student hidden 16, teacher hidden 24, vocab 64), chunks of 3, 3 and 2.
  LinearDivergenceArgs<bf16> ld{.x = a.at<const bf16>(0), .weight = a.at<const bf16>(1024), .hidden = 16,
                                .teacher_x = a.at<const bf16>(4096), .teacher_weight = a.at<const bf16>(8192),
                                .teacher_hidden = 24, .tokens = 8, .vocab = 64,
                                .labels = a.at<const std::int64_t>(16384), .loss = a.at<float>(17408),
                                .loss_rows = a.at<float>(17664), .dx = a.at<bf16>(18432),
                                .dweight = a.at<float>(20480), .chunk = 3};
  TIGON_OK(linear_divergence_workspace_bytes(ld, bytes));
  REQUIRE(bytes <= 256 * 1024);
  ld.workspace = a.at<void>(65536);
  ld.workspace_bytes = bytes;
  expect_rejected("linear_divergence, the last chunk's GEMM refused", Errc::unsupported, nullptr,
                  [&](cudaStream_t s) { return linear_divergence(ld, ForwardKL{}, last, s); });
  // Linear log-probs, forward and backward.
  LinearLogProbArgs<bf16> lp{.x = a.at<const bf16>(0), .weight = a.at<const bf16>(1024), .hidden = 64,
                             .targets = a.at<const std::int64_t>(16384), .tokens = 8, .vocab = 64,
                             .logp = a.at<float>(17408), .lse = a.at<float>(17664), .entropy = a.at<float>(17920),
                             .grad_logp = a.at<const float>(18176), .dx = a.at<bf16>(18432),
                             .dweight = a.at<float>(20480), .chunk = 3};
  TIGON_OK(linear_logprob_workspace_bytes(lp, true, bytes));
  REQUIRE(bytes <= 256 * 1024);
  lp.workspace = a.at<void>(65536);
  lp.workspace_bytes = bytes;
  expect_rejected("linear_logprob_forward, the last chunk's GEMM refused", Errc::unsupported, nullptr,
                  [&](cudaStream_t s) { return linear_logprob_forward(lp, last, s); });
  expect_rejected("linear_logprob_backward, the last chunk's GEMM refused", Errc::unsupported, nullptr,
                  [&](cudaStream_t s) { return linear_logprob_backward(lp, last, s); });
}

TEST_CASE("rejected: the optimizer step", "[rejected][gpu]") {
  Arena& a = arena();
  // A moment over another tensor's gradient: the plan refuses the list.
  AdamWTensor<bf16, float> t[2] = {
      {.param = a.at<bf16>(0), .grad = a.at<const bf16>(4096), .exp_avg = a.at<float>(8192),
       .exp_avg_sq = a.at<float>(16384), .numel = 1000},
      {.param = a.at<bf16>(24576), .grad = a.at<const bf16>(28672), .exp_avg = a.at<float>(4096),
       .exp_avg_sq = a.at<float>(32768), .numel = 1000}};
  AdamWPlan plan;
  expect_rejected("adamw_plan, a moment over a gradient", Errc::aliasing, nullptr,
                  [&](cudaStream_t s) { return adamw_plan(t, 2, a.at<void>(65536), 65536, s, plan); });
  // A step on a plan made for no list.
  const AdamWHyper h{.lr = a.at<const float>(131072), .step = a.at<float>(131328)};
  expect_rejected("adamw_step, an empty plan", Errc::invalid_value, "plan",
                  [&](cudaStream_t s) { return adamw_step<bf16, float>(AdamWPlan{}, h, s); });
}
