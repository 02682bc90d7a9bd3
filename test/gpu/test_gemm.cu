// The cuBLASLt back end against a double-precision reference: every op_a / op_b combination in
// row-major terms, leading dimensions larger than the rows, fp32 output accumulating with beta = 1,
// alpha scaling, bf16 / half / float operands, the bias epilogue (one rounding of the product plus
// the bias), and bad arguments rejected by name.
#include "gpu_test.cuh"

#include <tigon/blas/gemm.cuh>

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

template <class TAB, class TD>
void run(std::int64_t M, std::int64_t N, std::int64_t K, Op op_a, Op op_b, std::int64_t pad, float alpha,
         float beta, CublasLtGemm& blas, bool with_bias = false, std::int64_t offset = 0) {
  INFO("M " << M << " N " << N << " K " << K << " op_a " << int(op_a) << " op_b " << int(op_b) << " pad " << pad
            << " alpha " << alpha << " beta " << beta << " AB " << dtype_traits<TAB>::name << " D "
            << dtype_traits<TD>::name << (with_bias ? " bias" : "") << " offset " << offset);
  const std::int64_t a_rows = op_a == Op::n ? M : K, a_cols = op_a == Op::n ? K : M;
  const std::int64_t b_rows = op_b == Op::n ? K : N, b_cols = op_b == Op::n ? N : K;
  const std::int64_t lda = a_cols + pad, ldb = b_cols + pad, ldd = N + pad;
  std::vector<double> ad, bd, cd;
  const auto ah = gpu_test::random_values<TAB>(a_rows * lda, 0, 1, &ad);
  const auto bh = gpu_test::random_values<TAB>(b_rows * ldb, 0, 1, &bd);
  const auto ch = gpu_test::random_values<TD>(M * ldd, 0, 1, &cd);
  std::vector<double> biasd(N, 0.0);
  const auto biash = gpu_test::random_values<TD>(N, 0, 1, &biasd);
  if (!with_bias) std::fill(biasd.begin(), biasd.end(), 0.0);
  // offset: A, B and D start that many elements into their buffers (less aligned than the
  // allocations' 256 bytes).
  DeviceBuffer<TAB> a0(ah.size() + offset), b0(bh.size() + offset);
  DeviceBuffer<TD> d0(ch.size() + offset), bias(N);
  CUDA_OK(cudaMemcpy(a0.ptr + offset, ah.data(), ah.size() * sizeof(TAB), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b0.ptr + offset, bh.data(), bh.size() * sizeof(TAB), cudaMemcpyHostToDevice));
  if (beta == 0) {
    // D is not an input: its padding must stay untouched. initcheck does not see the writes of
    // cuBLAS's GEMM kernels: the poison makes every byte initialised and a byte the GEMM does not write NaN.
    d0.poison();
  } else {
    CUDA_OK(cudaMemcpy(d0.ptr + offset, ch.data(), ch.size() * sizeof(TD), cudaMemcpyHostToDevice));  // D starts as C
  }
  bias.upload(biash);
  TAB* const ap = a0.ptr + offset;
  TAB* const bp = b0.ptr + offset;
  TD* const dp = d0.ptr + offset;
  GemmArgs<TAB, TD> g{.a = ap, .b = bp, .c = beta != 0 ? dp : nullptr, .d = dp,
                      .bias = with_bias ? bias.ptr : nullptr, .m = M, .n = N, .k = K, .lda = lda, .ldb = ldb,
                      .ldc = ldd, .ldd = ldd, .op_a = op_a, .op_b = op_b, .alpha = alpha, .beta = beta};
  TIGON_OK(blas.gemm(g, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<TD> out(ch.size());
  CUDA_OK(cudaMemcpy(out.data(), dp, ch.size() * sizeof(TD), cudaMemcpyDeviceToHost));
  std::vector<double> ref(M * N);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double av = op_a == Op::n ? ad[i * lda + k] : ad[k * lda + i];
        const double bv = op_b == Op::n ? bd[k * ldb + j] : bd[j * ldb + k];
        s += av * bv;
      }
      ref[i * N + j] = alpha * s + beta * cd[i * ldd + j] + biasd[j];
    }
  const double tol = std::is_same_v<TD, float> && std::is_same_v<TAB, float> ? 1e-3 : 1e-2;
  const auto cmp = gpu_test::compare(
      ref.size(), [&](std::size_t i) { return double(to_float(out[(i / N) * ldd + i % N])); }, ref,
      tol * std::sqrt(double(K)), tol);
  INFO(cmp.bad << " of " << cmp.n << " bad, worst #" << cmp.worst << ", rel L2 " << cmp.rel_l2);
  CHECK(cmp.ok(tol));
  // Padding of D untouched (poisoned) when D was not an input.
  if (beta == 0 && pad > 0) CHECK(gpu_test::all_bytes_ff(&out[N], pad * sizeof(TD)));
}

}  // namespace

TEST_CASE("gemm: row-major products through cuBLASLt", "[gemm][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  for (Op oa : {Op::n, Op::t})
    for (Op ob : {Op::n, Op::t}) {
      run<bf16, bf16>(96, 80, 64, oa, ob, 0, 1.0f, 0.0f, blas);
      run<bf16, float>(64, 48, 200, oa, ob, 8, 1.0f, 1.0f, blas);  // fp32 accumulation
      run<half, half>(33 * 8, 17 * 8, 40, oa, ob, 16, 0.5f, 0.0f, blas);
      run<float, float>(40, 24, 56, oa, ob, 4, 2.0f, 0.5f, blas);
    }
  run<bf16, bf16>(1024, 2048, 4096, Op::n, Op::t, 0, 1.0f, 0.0f, blas);  // the linear layer's shape
}

TEST_CASE("gemm: a shape planned for aligned pointers runs on less aligned ones", "[gemm][gpu]") {
  // The plan cache keys on each operand's alignment: the same shape with pointers 16 bytes (and
  // 2 bytes) past a 256-byte boundary gets an algorithm for that alignment, or a clean refusal.
  // Sanitizer-sized: 64 x 128 x 256 instead of 256 x 512 x 1024 (the alignments, not the shape,
  // pick the plans; a 2-byte aligned product may take a kernel without tensor cores).
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t M = small ? 64 : 256, N = small ? 128 : 512, K = small ? 256 : 1024;
  run<bf16, bf16>(M, N, K, Op::n, Op::t, 0, 1.0f, 0.0f, blas);
  run<bf16, bf16>(M, N, K, Op::n, Op::t, 0, 1.0f, 0.0f, blas, false, 8);
  run<bf16, float>(M, N, K, Op::t, Op::n, 0, 1.0f, 1.0f, blas, false, 8);
  GemmArgs<bf16, bf16> g{.m = M, .n = N, .k = K, .op_a = Op::n, .op_b = Op::t};
  DeviceBuffer<bf16> a(M * K + 1), b(N * K + 1), d(M * N + 1);
  // Zero inputs (the product is not checked here, but initcheck reports reads of unset bytes).
  CUDA_OK(cudaMemset(a.ptr, 0, a.bytes()));
  CUDA_OK(cudaMemset(b.ptr, 0, b.bytes()));
  d.poison();
  g.a = a.ptr + 1, g.b = b.ptr + 1, g.d = d.ptr + 1;  // 2-byte aligned
  const Status s = blas.gemm(g, nullptr);
  INFO(s.message());
  CHECK((s.ok() || s.code() == Errc::unsupported));
  CUDA_OK(cudaDeviceSynchronize());
  if (s.ok()) run<bf16, bf16>(M, N, K, Op::n, Op::t, 0, 1.0f, 0.0f, blas, false, 1);
}

TEST_CASE("gemm: a product captured in a CUDA graph replays as the eager call computes it", "[gemm][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  // The shape is met first inside the capture: its plan is made there (no synchronisation) and the
  // graph's replay computes the product.
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const std::int64_t M = 128, N = 256, K = 512;
  const auto ah = gpu_test::random_values<bf16>(M * K, 0, 1, nullptr);
  const auto bh = gpu_test::random_values<bf16>(N * K, 0, 1, nullptr);
  DeviceBuffer<bf16> a(M * K), b(N * K), d1(M * N), d2(M * N);
  a.upload(ah), b.upload(bh);
  d1.poison(), d2.poison();
  GemmArgs<bf16, bf16> g{.a = a.ptr, .b = b.ptr, .d = d1.ptr, .m = M, .n = N, .k = K, .op_a = Op::n, .op_b = Op::t};
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  const Status cs = blas.gemm(g, st);
  CUDA_OK(cudaStreamEndCapture(st, &graph));
  INFO(cs.message());
  REQUIRE(cs.ok());
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, st));
  CUDA_OK(cudaStreamSynchronize(st));
  // The same product outside the capture, on the cached plan, agrees with the captured one within one
  // bf16 unit.
  g.d = d2.ptr;
  TIGON_OK(blas.gemm(g, st));
  CUDA_OK(cudaStreamSynchronize(st));
  const auto o1 = d1.download(), o2 = d2.download();
  int off = 0;
  for (std::size_t i = 0; i < o1.size(); ++i) {
    const float x = to_float(o1[i]), y = to_float(o2[i]);
    off += !(std::abs(x - y) <= 0x1p-7f * std::abs(x) + 1e-2f);
  }
  CHECK(off == 0);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(st));
}

TEST_CASE("gemm: the bias epilogue adds a bias to every row", "[gemm][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  run<bf16, bf16>(96, 80, 64, Op::n, Op::t, 0, 1.0f, 0.0f, blas, true);      // the LM head's layout
  run<bf16, bf16>(47, 123, 31, Op::n, Op::t, 0, 1.0f, 0.0f, blas, true);     // odd sizes
  run<half, half>(64, 128, 40, Op::n, Op::n, 8, 1.0f, 0.0f, blas, true);
  run<float, float>(40, 24, 56, Op::n, Op::t, 4, 2.0f, 0.5f, blas, true);    // with alpha, beta and C
  run<bf16, bf16>(1024, 2048, 4096, Op::n, Op::t, 0, 1.0f, 0.0f, blas, true);
  // A bias reused after a call without one, and the other way round (plans cached per epilogue).
  run<bf16, bf16>(96, 80, 64, Op::n, Op::t, 0, 1.0f, 0.0f, blas, false);
  run<bf16, bf16>(96, 80, 64, Op::n, Op::t, 0, 1.0f, 0.0f, blas, true);
}

// Operands on a coarse grid (multiples of 1/8 in [-2, 2]) make every fp32 product and sum exact, so
// the product plus a bfloat16 bias is exact in fp32 too: D must be that value rounded to bfloat16
// once (F.linear's rounding), element for element, not the product rounded and the sum rounded again.
TEST_CASE("gemm: the bias epilogue rounds the product plus the bias once", "[gemm][gpu]") {
  const std::int64_t M = 64, N = 256, K = 64;
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  std::vector<bf16> ah(M * K), bh(N * K), biash(N);
  std::vector<float> af(M * K), bf(N * K), biasf(N);
  std::uint32_t state = 12345;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  auto grid = [&](std::vector<bf16>& h, std::vector<float>& f) {
    for (std::size_t i = 0; i < h.size(); ++i) {
      f[i] = (static_cast<int>(next() % 33) - 16) / 8.0f;
      h[i] = from_float<bf16>(f[i]);
    }
  };
  grid(ah, af);
  grid(bh, bf);
  for (std::int64_t j = 0; j < N; ++j) {  // bfloat16 values with 8 significant bits, in [-1, 1]
    biash[j] = from_float<bf16>((static_cast<int>(next() % 4096) - 2048) / 2048.0f);
    biasf[j] = to_float(biash[j]);
  }
  DeviceBuffer<bf16> a(ah.size()), b(bh.size()), d(M * N), bias(N);
  a.upload(ah);
  b.upload(bh);
  bias.upload(biash);
  d.poison();
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = a.ptr, .b = b.ptr, .d = d.ptr, .bias = bias.ptr, .m = M, .n = N, .k = K,
                                    .op_b = Op::t},
                     nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = d.download();
  int once = 0, twice = 0, differ = 0;
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      float acc = 0.0f;  // exact: every partial sum is a multiple of 1/64 below 2^8
      for (std::int64_t k = 0; k < K; ++k) acc += af[i * K + k] * bf[j * K + k];
      const float single = to_float(from_float<bf16>(acc + biasf[j]));
      const float dbl = to_float(from_float<bf16>(to_float(from_float<bf16>(acc)) + biasf[j]));
      const float got = to_float(out[i * N + j]);
      once += got == single;
      twice += got == dbl;
      differ += single != dbl;
    }
  INFO(once << " of " << M * N << " equal the single rounding, " << twice << " the double; the two differ in "
            << differ);
  CHECK(differ > 0);  // the case tells the two apart
  CHECK(once == M * N);
}

TEST_CASE("gemm: bad arguments are rejected by name", "[gemm][gpu]") {
  DeviceBuffer<unsigned char> ws(1u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  DeviceBuffer<bf16> a(64), b(64), d(64);
  GemmArgs<bf16> g{.a = a.ptr, .b = b.ptr, .d = d.ptr, .m = 8, .n = 8, .k = 8};
  auto bad = g;
  bad.a = nullptr;
  CHECK(std::string(blas.gemm(bad, nullptr).argument()) == "a");
  bad = g;
  bad.k = 0;
  CHECK(std::string(blas.gemm(bad, nullptr).argument()) == "k");
  bad = g;
  bad.beta = 1.0f;
  CHECK(std::string(blas.gemm(bad, nullptr).argument()) == "c");
  bad = g;
  bad.lda = 4;
  CHECK(blas.gemm(bad, nullptr).code() == Errc::invalid_stride);
  bad = g;
  bad.d = a.ptr;  // D over A
  CHECK(blas.gemm(bad, nullptr).code() == Errc::aliasing);
  DeviceBuffer<bf16> bias(16);
  bad = g;
  bad.bias = bias.ptr + 1;  // not 16-byte aligned
  CHECK(blas.gemm(bad, nullptr).code() == Errc::invalid_value);
  CHECK(std::string(blas.gemm(bad, nullptr).argument()) == "bias");
  bad = g;
  bad.bias = d.ptr;  // over D
  CHECK(blas.gemm(bad, nullptr).code() == Errc::aliasing);
}
