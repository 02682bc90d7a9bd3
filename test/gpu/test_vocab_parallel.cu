// The vocabulary-parallel cross-entropy over NCCL. One rank (one GPU): the op against the split
// pieces run by hand (bitwise) and against cross_entropy on the whole vocabulary (within a rounding).
// Two ranks (two GPUs, one thread each; the [two_ranks] case, run by its own ctest entry, which
// reports skipped on a machine with fewer GPUs): every rank's loss outputs the same bytes, and each
// rank's slice of the gradient and the loss outputs bitwise those of the split pieces run on one GPU.
#include "gpu_test.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <thread>

#include <tigon/dist/vocab_parallel.cuh>

using namespace tigon;
using namespace gpu_test;

namespace {

template <class T>
std::vector<T> fetch(const T* p, std::int64_t n) {
  std::vector<T> h(static_cast<std::size_t>(n));
  REQUIRE(cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct Case {
  std::int64_t rows, vocab;
  float smoothing = 0.0f, z = 0.0f, softcap = 0.0f;
  Reduction reduction = Reduction::mean;
};

// The loss outputs of one call.
struct LossOut {
  std::vector<float> loss, rows, lse;
  std::vector<std::int64_t> argmax;
};

// One shard's buffers on the current device.
struct Shard {
  std::int64_t rows, cols;
  DeviceBuffer<bf16> x, dx;
  DeviceBuffer<std::int64_t> t;
  DeviceBuffer<float> loss, lrows, lse;
  DeviceBuffer<std::int64_t> am;
  Shard(std::int64_t r, std::int64_t c)
      : rows(r), cols(c), x(r * c), dx(r * c), t(r), loss(1), lrows(r), lse(r), am(r) {}
  CrossEntropyArgs<bf16> args(const Case& c) {
    return {.logits = x.ptr, .targets = t.ptr, .rows = rows, .vocab = cols, .dlogits = dx.ptr,
            .label_smoothing = c.smoothing, .z_loss_scale = c.z, .softcap = c.softcap, .reduction = c.reduction,
            .loss = loss.ptr, .loss_rows = lrows.ptr, .lse = lse.ptr, .argmax = am.ptr};
  }
  LossOut outputs() { return {fetch(loss.ptr, 1), fetch(lrows.ptr, rows), fetch(lse.ptr, rows), fetch(am.ptr, rows)}; }
};

// The whole [rows, vocab] logits and targets of a case (host), and a shard's columns of them.
struct Inputs {
  std::vector<bf16> x;
  std::vector<std::int64_t> t;
};
Inputs make_inputs(const Case& c) {
  Inputs in{random_values<bf16>(static_cast<std::size_t>(c.rows * c.vocab), 0, 4, nullptr),
            std::vector<std::int64_t>(static_cast<std::size_t>(c.rows))};
  std::uniform_int_distribution<std::int64_t> pick(0, c.vocab - 1);
  for (auto& t : in.t) t = pick(rng());
  in.t[1] = -100;  // an ignored row
  return in;
}
void load_shard(Shard& s, const Inputs& in, std::int64_t vocab, std::int64_t c0) {
  std::vector<bf16> cols(static_cast<std::size_t>(s.rows * s.cols));
  for (std::int64_t r = 0; r < s.rows; ++r) {
    std::copy_n(in.x.begin() + r * vocab + c0, s.cols, cols.begin() + r * s.cols);
  }
  s.x.upload(cols);
  s.t.upload(in.t);
  s.dx.poison(), s.loss.poison(), s.lrows.poison(), s.lse.poison(), s.am.poison();
}

std::size_t ce_ws(const CrossEntropyArgs<bf16>& a) {
  std::size_t b = 0;
  REQUIRE(cross_entropy_workspace_bytes(a, b).ok());
  return b;
}

// The split pieces on the current device for `n` equal shards: each shard's gradient slice and the
// loss outputs (the same from every shard's finalize; the first shard's kept).
void split_reference(const Case& c, const Inputs& in, int n, std::vector<std::vector<bf16>>& grads, LossOut& out) {
  const std::int64_t w = c.vocab / n;
  std::vector<std::unique_ptr<Shard>> sh;
  DeviceBuffer<CrossEntropyStats> stats(static_cast<std::size_t>(n * c.rows)), merged(c.rows);
  for (int i = 0; i < n; ++i) {
    sh.push_back(std::make_unique<Shard>(c.rows, w));
    load_shard(*sh.back(), in, c.vocab, i * w);
    TIGON_OK(cross_entropy_shard_stats(sh.back()->args(c), i * w, c.vocab, stats.ptr + i * c.rows, nullptr));
  }
  TIGON_OK(cross_entropy_merge_stats(stats.ptr, n, c.rows, merged.ptr, nullptr));
  grads.clear();
  for (int i = 0; i < n; ++i) {
    auto a = sh[i]->args(c);
    DeviceBuffer<unsigned char> ws(std::max<std::size_t>(ce_ws(a), 1));
    a.workspace = ws.ptr;
    a.workspace_bytes = ws.count;
    TIGON_OK(cross_entropy_shard_finalize(a, i * w, c.vocab, merged.ptr, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    grads.push_back(fetch(sh[i]->dx.ptr, c.rows * w));
    if (i == 0) out = sh[i]->outputs();
  }
}

// One rank's call of the op on its shard (buffers on the device current when it is made): made and
// read on the test's thread, run on any (the run uses no test macro: Catch's are not thread-safe).
struct RankCall {
  Shard s;
  DeviceBuffer<unsigned char> ws;
  CrossEntropyArgs<bf16> a;
  VocabShard shard;
  Status st;
  RankCall(const Case& c, const Inputs& in, int rank, int ranks)
      : s(c.rows, c.vocab / ranks), ws(bytes_for(c, ranks)), a{}, shard{rank * (c.vocab / ranks), c.vocab} {
    load_shard(s, in, c.vocab, shard.vocab_offset);
    a = s.args(c);
  }
  static std::size_t bytes_for(const Case& c, int ranks) {
    CrossEntropyArgs<bf16> probe{.rows = c.rows, .vocab = c.vocab / ranks};
    std::size_t b = 0;
    (void)vocab_parallel_cross_entropy_workspace_bytes(probe, ranks, b);
    return std::max<std::size_t>(b, 1);
  }
  void run(ncclComm_t comm) {
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      st = Status::error(Errc::cuda_error, "test", "", "cudaStreamCreate");
      return;
    }
    st = vocab_parallel_cross_entropy(a, shard, comm, ws.ptr, ws.count, stream);
    const cudaError_t e = cudaStreamSynchronize(stream);
    if (st.ok() && e != cudaSuccess) st = Status::from_cuda(e, "test", "cudaStreamSynchronize");
    cudaStreamDestroy(stream);
  }
};

// The largest cluster the default policy's resident kernels take for one bf16 row of `vocab` columns.
int resident_cluster(std::int64_t vocab) {
  using P = tigon::CrossEntropyPolicy;
  const std::int64_t nvec = vocab * 2 / 16;
  return std::max(tigon::detail::ce_res_shape(nvec, P::kResThreads, P::kResVecs).csize,
                  tigon::detail::ce_res_shape(nvec, P::kOptThreads, P::kOptVecs).csize);
}

const Case kCases[] = {
    {.rows = 33, .vocab = 32000},
    {.rows = 16, .vocab = 128256, .smoothing = 0.1f, .z = 1e-4f},
    {.rows = 9, .vocab = 256000, .softcap = 30.0f, .reduction = Reduction::sum},
};

}  // namespace

TEST_CASE("vocab_parallel_cross_entropy: one rank, the split pieces and the whole op", "[vocab_parallel][gpu]") {
  ncclComm_t comm = nullptr;
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  REQUIRE(ncclCommInitAll(&comm, 1, &dev) == ncclSuccess);
  for (const Case& c : kCases) {
    INFO("rows " << c.rows << " vocab " << c.vocab << " smoothing " << c.smoothing << " z " << c.z << " softcap "
                 << c.softcap);
    if (gpu_test::synccheck_skips_cluster(resident_cluster(c.vocab))) continue;
    const Inputs in = make_inputs(c);
    std::vector<std::vector<bf16>> ref_g;
    LossOut ref;
    split_reference(c, in, 1, ref_g, ref);
    RankCall call(c, in, 0, 1);
    call.run(comm);
    INFO(call.st.message());
    REQUIRE(call.st.ok());
    const std::vector<bf16> g = fetch(call.s.dx.ptr, c.rows * c.vocab);
    const LossOut got = call.s.outputs();
    CHECK(same_bytes(g, ref_g[0]));
    CHECK(same_bytes(got.loss, ref.loss));
    CHECK(same_bytes(got.rows, ref.rows));
    CHECK(same_bytes(got.lse, ref.lse));
    CHECK(same_bytes(got.argmax, ref.argmax));
    // cross_entropy on the whole vocabulary: the same loss within fp32 rounding, the same gradient
    // within one bf16 unit in the last place (two roundings of values equal to fp32 rounding can land
    // one unit apart: 2^-7 of the value at most). With the softcap the whole op takes the special-
    // function unit's tanh on 16-bit logits (relative error under 2^-10.9) where the shard pieces take
    // the rational one: each capped logit moves by at most cap 2^-10.9, so p_i = exp(z_i - lse) by a
    // factor within exp(2 cap 2^-10.9), and the factor 1 - u_i^2 by 2 u_i^2 2^-10.9 / (1 - u_i^2).
    Shard whole(c.rows, c.vocab);
    load_shard(whole, in, c.vocab, 0);
    auto a = whole.args(c);
    DeviceBuffer<unsigned char> ws(std::max<std::size_t>(ce_ws(a), 1));
    a.workspace = ws.ptr;
    a.workspace_bytes = ws.count;
    TIGON_OK(cross_entropy(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const LossOut w = whole.outputs();
    CHECK(std::abs(w.loss[0] - got.loss[0]) <= 2e-6f * std::abs(w.loss[0]) + 1e-7f);
    CHECK(same_bytes(w.argmax, got.argmax));
    const auto wg = fetch(whole.dx.ptr, c.rows * c.vocab);
    const double eps_tanh = std::exp2(-10.9);
    int off = 0;
    double worst = 0;
    for (std::size_t i = 0; i < wg.size(); ++i) {
      const double x = to_float(wg[i]), y = to_float(g[i]);
      double rel = 0x1p-7;
      if (c.softcap > 0) {
        const double u = std::tanh(double(to_float(in.x[i])) / c.softcap);
        rel += std::expm1(2 * c.softcap * eps_tanh) + 2 * u * u * eps_tanh / (1 - u * u);
      }
      const double bound = rel * std::abs(y) + 1e-12;
      worst = std::max(worst, std::abs(x - y) / bound);
      off += !(std::abs(x - y) <= bound);
    }
    INFO("gradient elements off the whole op's: " << off << ", worst at " << worst << " of its bound");
    CHECK(off == 0);
  }
  // A rejected call communicates and writes nothing: a workspace too small.
  Shard s(8, 32000);
  std::size_t bytes = 0;
  const auto a = s.args(Case{.rows = 8, .vocab = 32000});
  REQUIRE(vocab_parallel_cross_entropy_workspace_bytes(a, 1, bytes).ok());
  DeviceBuffer<unsigned char> ws(bytes);
  CHECK(vocab_parallel_cross_entropy(a, VocabShard{0, 32000}, comm, ws.ptr, bytes - 1, nullptr).code() ==
        Errc::workspace_too_small);
  CHECK(vocab_parallel_cross_entropy(a, VocabShard{16, 32000}, comm, ws.ptr, bytes, nullptr).code() ==
        Errc::invalid_size);
  CHECK(vocab_parallel_cross_entropy(a, VocabShard{0, 32000}, nullptr, ws.ptr, bytes, nullptr).code() ==
        Errc::null_pointer);
  ncclCommDestroy(comm);
}

// Sanitizer-sized: 150 tokens in chunks of 64 (64, 64 and 22), a hidden size of 64 and 20000 columns
// (300 tokens in chunks of 128, hidden 256, 32000 columns): still a short last chunk, and the
// statistics pass on the streaming kernel, the finalize on the optioned resident kernel and
// linear_cross_entropy on the plain one, in clusters of 2 blocks as at 32000.
TEST_CASE("vocab_parallel_linear_cross_entropy: one rank against linear_cross_entropy", "[vocab_parallel][gpu]") {
  ncclComm_t comm = nullptr;
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  REQUIRE(ncclCommInitAll(&comm, 1, &dev) == ncclSuccess);
  DeviceBuffer<unsigned char> blas_ws(std::size_t{32} << 20);
  blas_ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(blas_ws.ptr, blas_ws.bytes());
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t N = small ? 150 : 300, D = small ? 64 : 256, V = small ? 20000 : 32000;
  const std::int64_t chunk = small ? 64 : 128;
  DeviceBuffer<bf16> x(N * D), w(V * D), dx_ref(N * D), dx(N * D);
  DeviceBuffer<float> dw_ref(V * D), dw(V * D), loss(2);
  DeviceBuffer<std::int64_t> t(N);
  x.upload(random_values<bf16>(N * D, 0, 1, nullptr));
  w.upload(random_values<bf16>(V * D, 0, 0.05, nullptr));
  std::vector<std::int64_t> th(N);
  std::uniform_int_distribution<std::int64_t> pick(0, V - 1);
  for (auto& v : th) v = pick(rng());
  th[3] = -100;
  t.upload(th);
  // initcheck does not see the writes of cuBLAS's GEMM kernels (the logits chunks in the workspaces,
  // dx, dW): the poison makes every byte initialised and a byte the GEMM does not write NaN.
  dx_ref.poison(), dx.poison(), dw_ref.poison(), dw.poison();
  auto make = [&](bf16* dxp, float* dwp, float* lp) {
    LinearCrossEntropyArgs<bf16> a;
    a.x = x.ptr;
    a.weight = w.ptr;
    a.hidden = D;
    a.loss.targets = t.ptr;
    a.loss.rows = N;
    a.loss.vocab = V;
    a.loss.loss = lp;
    a.dx = dxp;
    a.dweight = dwp;
    a.chunk = chunk;  // chunks of 128, 128 and 44 tokens (sanitizer-sized 64, 64 and 22)
    return a;
  };
  auto ref = make(dx_ref.ptr, dw_ref.ptr, loss.ptr);
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_workspace_bytes(ref, bytes));
  DeviceBuffer<unsigned char> ws_ref(bytes);
  ws_ref.poison();
  ref.workspace = ws_ref.ptr;
  ref.workspace_bytes = bytes;
  TIGON_OK(linear_cross_entropy(ref, blas, nullptr));
  auto a = make(dx.ptr, dw.ptr, loss.ptr + 1);
  TIGON_OK(vocab_parallel_linear_cross_entropy_workspace_bytes(a, 1, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  cudaStream_t comm_stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
  TIGON_OK(vocab_parallel_linear_cross_entropy(a, VocabShard{0, V}, comm, blas, ws.ptr, bytes, nullptr, comm_stream));
  CUDA_OK(cudaDeviceSynchronize());
  const auto l = fetch(loss.ptr, 2);
  INFO("loss " << l[0] << " against " << l[1]);
  CHECK(std::abs(l[0] - l[1]) <= 2e-6f * std::abs(l[0]));
  // The split statistics path against the fused one: the gradient within a rounding of bf16 on
  // dlogits, carried through the products.
  const auto g0 = fetch(dx_ref.ptr, N * D), g1 = fetch(dx.ptr, N * D);
  const auto w0 = fetch(dw_ref.ptr, V * D), w1 = fetch(dw.ptr, V * D);
  double e_dx = 0, n_dx = 0, e_dw = 0, n_dw = 0;
  for (std::size_t i = 0; i < g0.size(); ++i) {
    const double d = to_float(g0[i]) - to_float(g1[i]);
    e_dx += d * d, n_dx += static_cast<double>(to_float(g0[i])) * to_float(g0[i]);
  }
  for (std::size_t i = 0; i < w0.size(); ++i) {
    const double d = static_cast<double>(w0[i]) - w1[i];
    e_dw += d * d, n_dw += static_cast<double>(w0[i]) * w0[i];
  }
  CHECK(std::sqrt(e_dx / n_dx) < 4e-3);  // relative RMS: bf16 roundings only
  CHECK(std::sqrt(e_dw / n_dw) < 4e-3);
  CUDA_OK(cudaStreamDestroy(comm_stream));
  ncclCommDestroy(comm);
}

TEST_CASE("vocab_parallel_cross_entropy: two ranks on two GPUs", "[.two_ranks][vocab_parallel][gpu]") {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  REQUIRE(devices >= 2);
  int devs[2] = {0, 1};
  ncclComm_t comms[2];
  REQUIRE(ncclCommInitAll(comms, 2, devs) == ncclSuccess);
  for (const Case& c : kCases) {
    INFO("rows " << c.rows << " vocab " << c.vocab);
    const Inputs in = make_inputs(c);
    std::vector<std::vector<bf16>> ref_g;
    LossOut ref;
    CUDA_OK(cudaSetDevice(0));
    split_reference(c, in, 2, ref_g, ref);
    std::unique_ptr<RankCall> calls[2];
    for (int r = 0; r < 2; ++r) {
      CUDA_OK(cudaSetDevice(r));
      calls[r] = std::make_unique<RankCall>(c, in, r, 2);
    }
    std::thread workers[2];
    for (int r = 0; r < 2; ++r) {
      workers[r] = std::thread([&, r] {
        cudaSetDevice(r);
        calls[r]->run(comms[r]);
      });
    }
    for (auto& t : workers) t.join();
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << ": " << calls[r]->st.message());
      REQUIRE(calls[r]->st.ok());
      CUDA_OK(cudaSetDevice(r));
      const LossOut got = calls[r]->s.outputs();
      CHECK(same_bytes(fetch(calls[r]->s.dx.ptr, c.rows * (c.vocab / 2)), ref_g[r]));
      CHECK(same_bytes(got.loss, ref.loss));
      CHECK(same_bytes(got.rows, ref.rows));
      CHECK(same_bytes(got.lse, ref.lse));
      CHECK(same_bytes(got.argmax, ref.argmax));
    }
    for (int r = 0; r < 2; ++r) {
      CUDA_OK(cudaSetDevice(r));
      calls[r].reset();
    }
    CUDA_OK(cudaSetDevice(0));
  }
  ncclCommDestroy(comms[0]);
  ncclCommDestroy(comms[1]);
}
