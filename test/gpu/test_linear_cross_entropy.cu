// Chunked linear cross-entropy on the GPU: against a double-precision reference at small shapes
// (bf16 and fp32, bias on and off, cross-entropy options, several chunk sizes, forward only), and
// against the unfused composition (one logits GEMM, cross-entropy, the gradient GEMMs) at a larger
// shape; bad arguments rejected by name.
#include "gpu_test.cuh"

#include <cmath>
#include <cstring>
#include <deque>

#include <tigon/loss/linear_cross_entropy.cuh>

#include "../reference/cross_entropy_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;

// The value a tensor of dtype T holds for v.
template <class T>
double tigon_ref_round(double v) {
  return tigon::round_to<T>(static_cast<float>(v));
}

namespace {

struct Case {
  std::int64_t N = 47, D = 31, V = 123;
  bool bias = false;
  double eps = 0, z = 0, cap = 0;
  Reduction red = Reduction::mean;
  std::int64_t chunk = 0;
  bool grads = true;
  bool token = false;  // token scaling
  bool bias_unaligned = false;  // the bias one element past a 16-byte boundary (the op copies it)
};

template <class T>
double tol() {
  return std::is_same_v<T, float> ? 2e-3 : 2e-2;  // relative L2 (GEMMs on tensor cores)
}

template <class T>
double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += std::isfinite(got[i]) ? (got[i] - ref[i]) * (got[i] - ref[i]) : INFINITY;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

template <class T>
void run_case(const Case& c, CublasLtGemm& blas) {
  INFO("N " << c.N << " D " << c.D << " V " << c.V << (c.bias ? " bias" : "") << " eps " << c.eps << " z " << c.z
            << " cap " << c.cap << " red " << int(c.red) << " chunk " << c.chunk << (c.grads ? "" : " forward-only")  << (c.token ? " token-scaling" : "")
            << (c.bias_unaligned ? " unaligned-bias" : "") << " T=" << dtype_traits<T>::name);
  std::vector<double> xd, wd, bd;
  const auto xh = gpu_test::random_values<T>(c.N * c.D, 0, 1, &xd);
  const auto wh = gpu_test::random_values<T>(c.V * c.D, 0, 1 / std::sqrt(double(c.D)), &wd);
  const auto bh = gpu_test::random_values<T>(c.V, 0, 0.5, &bd);
  std::vector<std::int64_t> t(c.N);
  for (std::int64_t i = 0; i < c.N; ++i) t[i] = i % 9 == 4 ? -100 : (i * 7919) % c.V;

  // Reference: logits rounded to T once (the GEMM's output, the bias added before the rounding as
  // F.linear's epilogue adds it), loss and dlogits in double, dlogits rounded to T (the buffer the
  // gradient GEMMs read), then the gradient products.
  std::vector<double> logits(c.N * c.V);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t v = 0; v < c.V; ++v) {
      double s = 0;
      for (std::int64_t d = 0; d < c.D; ++d) s += xd[n * c.D + d] * wd[v * c.D + d];
      logits[n * c.V + v] = tigon_ref_round<T>(c.bias ? s + bd[v] : s);
    }
  tigon_ref::CeOptions o;
  o.eps = c.eps;
  o.z = c.z;
  o.cap = c.cap;
  o.reduction = int(c.red);
  o.token_scaling = c.token;
  const auto ref = tigon_ref::cross_entropy(logits, t, c.N, c.V, o, true);
  std::vector<double> g(ref.grad.size());
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = tigon_ref_round<T>(ref.grad[i]);
  std::vector<double> dx(c.N * c.D, 0), dw(c.V * c.D, 0), db(c.V, 0);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t v = 0; v < c.V; ++v) {
      const double gv = g[n * c.V + v];
      if (gv == 0) continue;
      db[v] += gv;
      for (std::int64_t d = 0; d < c.D; ++d) {
        dx[n * c.D + d] += gv * wd[v * c.D + d];
        dw[v * c.D + d] += gv * xd[n * c.D + d];
      }
    }

  DeviceBuffer<T> x(xh.size()), w(wh.size()), b(bh.size() + 1), dxb(xh.size());
  DeviceBuffer<float> dwb(wh.size()), dbb(bh.size()), loss(1), lrows(c.N);
  DeviceBuffer<std::int64_t> tb(c.N);
  x.upload(xh);
  w.upload(wh);
  std::vector<T> bh1(1, from_float<T>(0.0f));
  bh1.insert(bh1.end(), bh.begin(), bh.end());
  if (c.bias_unaligned) {
    b.upload(bh1);
  } else {
    b.upload(bh);
  }
  tb.upload(t);
  // initcheck does not see the writes of cuBLAS's GEMM kernels (the logits chunks in the workspace,
  // dx, dW, db): the poison makes every byte initialised and a byte the GEMM does not write NaN.
  dxb.poison();
  dwb.poison();
  dbb.poison();
  LinearCrossEntropyArgs<T> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.bias = c.bias ? b.ptr + (c.bias_unaligned ? 1 : 0) : nullptr;
  a.hidden = c.D;
  a.loss.targets = tb.ptr;
  a.loss.rows = c.N;
  a.loss.vocab = c.V;
  a.loss.label_smoothing = float(c.eps);
  a.loss.z_loss_scale = float(c.z);
  a.loss.softcap = float(c.cap);
  a.loss.token_scaling = c.token;
  a.loss.reduction = c.red;
  a.loss.loss = c.red == Reduction::none ? nullptr : loss.ptr;
  a.loss.loss_rows = lrows.ptr;
  if (c.grads) {
    a.dx = dxb.ptr;
    a.dweight = dwb.ptr;
    a.dbias = c.bias ? dbb.ptr : nullptr;
  }
  a.chunk = c.chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_workspace_bytes(a, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  TIGON_OK(linear_cross_entropy(a, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());

  const auto lr = lrows.download();
  std::vector<double> lrd(lr.begin(), lr.end());
  CHECK(rel_l2<T>(lrd, ref.loss_rows) < tol<T>());
  if (c.red != Reduction::none) CHECK(std::abs(loss.download()[0] - ref.loss) <= tol<T>() * (1 + std::abs(ref.loss)));
  if (c.grads) {
    auto as_double = [](const auto& v) {
      std::vector<double> o;
      for (const auto& e : v) o.push_back(double(to_float(e)));
      return o;
    };
    CHECK(rel_l2<T>(as_double(dxb.download()), dx) < tol<T>());
    CHECK(rel_l2<T>(as_double(dwb.download()), dw) < tol<T>());
    if (c.bias) CHECK(rel_l2<T>(as_double(dbb.download()), db) < tol<T>());
  } else {
    CHECK(gpu_test::all_bytes_ff(dxb.download().data(), sizeof(T)));  // nothing written
  }
}

// The relative L2 error of bf16 results against fp32 ones.
double rel_l2_bf16(const std::vector<bf16>& got, const std::vector<float>& ref) {
  std::vector<double> g, r(ref.begin(), ref.end());
  for (const bf16 v : got) g.push_back(double(to_float(v)));
  return rel_l2<bf16>(g, r);
}

}  // namespace

// Sanitizer-sized: chunks of one token over 12 tokens instead of 47, and the two larger shapes at
// 256 tokens x 256 hidden (3 chunks of at most 96 where the full one has 4 of 256): the same
// vocabularies, so the same cross-entropy kernels (single elements at 123 columns, the row kernel at
// 128, the resident kernel at 4096, plain in bf16 and optioned in fp32).
TEST_CASE("linear_cross_entropy: small shapes against the double reference", "[lce][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  const bool small = gpu_test::sanitizer_sized();
  for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}}) {
    const std::int64_t n = small && chunk == 1 ? 12 : 47;  // chunk 1: a chunk (and its GEMMs) a token
    run_case<bf16>({.N = n, .chunk = chunk}, blas);
    run_case<float>({.N = n, .bias = true, .chunk = chunk}, blas);
  }
  run_case<bf16>({.bias = true, .eps = 0.1, .z = 1e-4, .cap = 15, .chunk = 20}, blas);
  run_case<bf16>({.red = Reduction::sum, .chunk = 16}, blas);
  run_case<bf16>({.bias = true, .eps = 0.1, .z = 1e-4, .cap = 15, .chunk = 20, .token = true}, blas);
  run_case<float>({.bias = true, .red = Reduction::none, .chunk = 16, .token = true}, blas);
  run_case<bf16>({.red = Reduction::none, .chunk = 16}, blas);
  run_case<bf16>({.grads = false}, blas);
  const std::int64_t big = small ? 256 : 1024;
  run_case<bf16>({.N = big, .D = big, .V = 4096, .bias = true, .chunk = small ? 96 : 256}, blas);
  run_case<bf16>({.V = 128, .bias = true, .chunk = 20, .bias_unaligned = true}, blas);
  run_case<float>({.bias = true, .eps = 0.1, .chunk = 16, .bias_unaligned = true}, blas);
  run_case<float>({.N = big, .D = big, .V = 4096, .eps = 0.1}, blas);
}

// Sanitizer-sized: 512 tokens in chunks of 128 and a hidden size of 128 (2048 tokens in chunks of
// 512, hidden 1024): still four chunks, and 32000 columns still take the resident kernel in clusters
// of 2 blocks.
TEST_CASE("linear_cross_entropy: equals the unfused composition", "[lce][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t N = small ? 512 : 2048, D = small ? 128 : 1024, V = 32000, chunk = small ? 128 : 512;
  DeviceBuffer<unsigned char> gws(32u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(N * D), w(V * D), logits(N * V), dx1(N * D), dx2(N * D);
  DeviceBuffer<float> dw1(V * D), dw2(V * D), l1(1), l2(1);
  DeviceBuffer<std::int64_t> tb(N);
  x.upload(gpu_test::random_values<bf16>(N * D, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(V * D, 0, 0.03, nullptr));
  std::vector<std::int64_t> t(N);
  for (std::int64_t i = 0; i < N; ++i) t[i] = (i * 7919) % V;
  tb.upload(t);
  for (auto* p : {&logits, &dx1, &dx2}) p->poison();
  dw1.poison();
  dw2.poison();
  // Unfused: all the logits, cross-entropy in place, the two gradient GEMMs.
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = x.ptr, .b = w.ptr, .d = logits.ptr, .m = N, .n = V, .k = D, .op_b = Op::t},
                     nullptr));
  DeviceBuffer<unsigned char> cws(tigon::detail::ce_workspace_bytes(N));
  TIGON_OK(cross_entropy(CrossEntropyArgs<bf16>{.logits = logits.ptr, .targets = tb.ptr, .rows = N, .vocab = V,
                                                .dlogits = logits.ptr, .loss = l1.ptr, .workspace = cws.ptr,
                                                .workspace_bytes = cws.count},
                         nullptr));
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = logits.ptr, .b = w.ptr, .d = dx1.ptr, .m = N, .n = D, .k = V}, nullptr));
  TIGON_OK(blas.gemm(GemmArgs<bf16, float>{.a = logits.ptr, .b = x.ptr, .d = dw1.ptr, .m = V, .n = D, .k = N,
                                           .op_a = Op::t},
                     nullptr));
  // Fused, in chunks of `chunk` tokens.
  LinearCrossEntropyArgs<bf16> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.hidden = D;
  a.loss.targets = tb.ptr;
  a.loss.rows = N;
  a.loss.vocab = V;
  a.loss.loss = l2.ptr;
  a.dx = dx2.ptr;
  a.dweight = dw2.ptr;
  a.chunk = chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_workspace_bytes(a, bytes));
  CHECK(bytes < static_cast<std::size_t>(chunk * V * 2) + (4u << 20));  // one logits chunk plus a few MB
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  TIGON_OK(linear_cross_entropy(a, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(std::abs(l1.download()[0] - l2.download()[0]) <= 1e-5f * std::abs(l1.download()[0]));
  // dx: the same products, but cuBLAS may pick another algorithm (split-K) for a chunk than for
  // all the rows, so the bf16 results agree to rounding, not bitwise. dW sums the chunks
  // in another order.
  {
    const auto a1 = dx1.download(), a2 = dx2.download();
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a1.size(); ++i) {
      const double r = to_float(a1[i]), d = r - to_float(a2[i]);
      num += d * d;
      den += r * r;
    }
    CHECK(std::sqrt(num / den) <= 4e-3);
  }
  const auto w1 = dw1.download(), w2 = dw2.download();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < w1.size(); ++i) {
    num += (w1[i] - w2[i]) * (w1[i] - w2[i]);
    den += w1[i] * w1[i];
  }
  CHECK(std::sqrt(num / den) < 1e-5);
}

// K heads in one call against K single-head calls: the weighted loss, each head's loss, dx (the sum of
// the heads' dx) and every head's dW and db.
template <class T>
void check_heads(std::int64_t N, std::int64_t D, std::int64_t V, int K, Reduction red, std::int64_t chunk,
                 CublasLtGemm& blas) {
  INFO("heads " << K << " N " << N << " D " << D << " V " << V << " red " << int(red) << " chunk " << chunk
                << " T=" << dtype_traits<T>::name);
  std::deque<DeviceBuffer<T>> w, b;  // a deque: buffers are neither copied nor moved
  std::deque<DeviceBuffer<float>> dw1, dw2, db1, db2;
  std::vector<const T*> wp, bp;
  std::vector<float*> dwp, dbp;
  std::vector<float> hw;
  DeviceBuffer<T> x(N * D), dx1(N * D), dx_sum(N * D), dx2(N * D);
  x.upload(gpu_test::random_values<T>(N * D, 0, 1, nullptr));
  std::vector<std::int64_t> t(static_cast<std::size_t>(K * N));
  for (int k = 0; k < K; ++k) {
    w.emplace_back(V * D);
    b.emplace_back(V + 1);
    w.back().upload(gpu_test::random_values<T>(V * D, 0, 1 / std::sqrt(double(D)), nullptr));
    b.back().upload(gpu_test::random_values<T>(V + 1, 0, 0.5, nullptr));
    dw1.emplace_back(V * D), dw2.emplace_back(V * D), db1.emplace_back(V), db2.emplace_back(V);
    wp.push_back(w.back().ptr);
    // Head 1's bias one element past a 16-byte boundary (the op copies it), head 2 without one.
    bp.push_back(k == 2 ? nullptr : b.back().ptr + (k == 1 ? 1 : 0));
    dwp.push_back(dw2.back().ptr);
    dbp.push_back(k % 2 == 0 ? db2.back().ptr : nullptr);  // every other head without a bias gradient
    hw.push_back(std::pow(0.8f, float(k)));
    // Medusa: head k predicts token i + k + 1; the last k + 1 positions have none.
    for (std::int64_t i = 0; i < N; ++i) t[k * N + i] = i + k + 1 >= N ? -100 : ((i + k + 1) * 7919) % V;
  }
  DeviceBuffer<std::int64_t> tb(t.size());
  tb.upload(t);
  DeviceBuffer<float> loss1(1), loss2(1), hl(K), rows1(N), rows2(K * N);
  // Single-head calls: loss_k, dx_k (summed on the host in double), dW_k, db_k.
  std::vector<double> dx_ref(N * D, 0.0), loss_rows_ref(K * N);
  double loss_ref = 0;
  std::vector<float> head_ref(K);
  for (int k = 0; k < K; ++k) {
    LinearCrossEntropyArgs<T> a;
    a.x = x.ptr;
    a.weight = wp[k];
    a.bias = bp[k];
    a.hidden = D;
    a.loss.targets = tb.ptr + k * N;
    a.loss.rows = N;
    a.loss.vocab = V;
    a.loss.reduction = red;
    a.loss.grad_scale = hw[k];
    a.loss.loss = red == Reduction::none ? nullptr : loss1.ptr;
    a.loss.loss_rows = rows1.ptr;
    a.dx = dx1.ptr;
    a.dweight = dw1[k].ptr;
    a.dbias = k % 2 == 0 ? db1[k].ptr : nullptr;
    a.chunk = chunk;
    std::size_t bytes = 0;
    TIGON_OK(linear_cross_entropy_workspace_bytes(a, bytes));
    DeviceBuffer<unsigned char> ws(bytes);
    ws.poison();
    dx1.poison();
    dw1[k].poison();
    if (k % 2 == 0) db1[k].poison();
    a.workspace = ws.ptr;
    a.workspace_bytes = bytes;
    TIGON_OK(linear_cross_entropy(a, blas, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    if (red != Reduction::none) {
      head_ref[k] = loss1.download()[0];
      loss_ref += double(hw[k]) * head_ref[k];
    }
    const auto r = rows1.download();
    for (std::int64_t i = 0; i < N; ++i) loss_rows_ref[k * N + i] = r[i];
    const auto d = dx1.download();
    for (std::int64_t i = 0; i < N * D; ++i) dx_ref[i] += to_float(d[i]);
  }
  LinearCrossEntropyHeadsArgs<T> h;
  h.x = x.ptr;
  h.hidden = D;
  h.heads = K;
  h.weights = wp.data();
  h.biases = bp.data();
  h.head_weights = hw.data();
  h.loss.targets = tb.ptr;
  h.loss.rows = N;
  h.loss.vocab = V;
  h.loss.reduction = red;
  h.loss.loss = red == Reduction::none ? nullptr : loss2.ptr;
  h.loss.loss_rows = rows2.ptr;
  h.head_losses = red == Reduction::none ? nullptr : hl.ptr;
  h.dx = dx2.ptr;
  h.dweights = dwp.data();
  h.dbiases = dbp.data();
  h.chunk = chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_heads_workspace_bytes(h, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  h.workspace = ws.ptr;
  h.workspace_bytes = bytes;
  ws.poison();
  dx2.poison();
  for (int k = 0; k < K; ++k) {
    dw2[k].poison();
    if (k % 2 == 0) db2[k].poison();
  }
  TIGON_OK(linear_cross_entropy_heads(h, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  if (red != Reduction::none) {
    CHECK(std::abs(loss2.download()[0] - loss_ref) <= 1e-5 * (1 + std::abs(loss_ref)));
    const auto got = hl.download();
    for (int k = 0; k < K; ++k) CHECK(got[k] == head_ref[k]);  // the same kernels in the same order
  }
  const auto r2 = rows2.download();
  for (int k = 0; k < K; ++k)
    for (std::int64_t i = 0; i < N; ++i) CHECK(r2[k * N + i] == loss_rows_ref[k * N + i]);
  std::vector<double> got_dx;
  for (const auto& e : dx2.download()) got_dx.push_back(to_float(e));
  CHECK(rel_l2<T>(got_dx, dx_ref) < (std::is_same_v<T, float> ? 1e-5 : 1e-2));  // K roundings of the sum
  // Bitwise the single-head calls' dW and db, which are finite: both were poisoned (NaN) before
  // their calls, so equal bytes alone would pass were neither written.
  for (int k = 0; k < K; ++k) {
    const auto a1 = dw1[k].download(), a2 = dw2[k].download();
    CHECK(gpu_test::all_finite(a1));
    CHECK(std::memcmp(a1.data(), a2.data(), a1.size() * sizeof(float)) == 0);
    if (k % 2 == 0) {
      const auto b1 = db1[k].download(), b2 = db2[k].download();
      CHECK(gpu_test::all_finite(b1));
      CHECK(std::memcmp(b1.data(), b2.data(), b1.size() * sizeof(float)) == 0);
    }
  }
}

// Sanitizer-sized: 3 heads instead of 5 in the first call (heads 0 to 2 are the three kinds: an
// aligned bias with its gradient, an unaligned bias without, no bias with a bias gradient) and 2
// chunks instead of 4 in the third; every shape, dtype and reduction stays.
TEST_CASE("linear_cross_entropy_heads: K heads equal K single-head calls", "[lce][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  const bool small = gpu_test::sanitizer_sized();
  check_heads<bf16>(300, 64, 1000, small ? 3 : 5, Reduction::mean, 128, blas);
  check_heads<float>(257, 48, 333, 3, Reduction::sum, 0, blas);
  check_heads<bf16>(200, 64, 512, 2, Reduction::none, small ? 100 : 64, blas);
  check_heads<bf16>(96, 32, 256, 1, Reduction::mean, 0, blas);
}

TEST_CASE("linear_cross_entropy: bad arguments are rejected by name", "[lce][gpu]") {
  DeviceBuffer<unsigned char> gws(1u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(64), w(64);
  DeviceBuffer<std::int64_t> t(8);
  LinearCrossEntropyArgs<bf16> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.hidden = 8;
  a.loss.targets = t.ptr;
  a.loss.rows = 8;
  a.loss.vocab = 8;
  auto bad = a;
  bad.x = nullptr;
  CHECK(std::string(linear_cross_entropy(bad, blas, nullptr).argument()) == "x");
  bad = a;
  bad.loss.logits = x.ptr;
  CHECK(std::string(linear_cross_entropy(bad, blas, nullptr).argument()) == "loss.logits");
  bad = a;
  bad.loss.label_smoothing = 2.0f;
  CHECK(std::string(linear_cross_entropy(bad, blas, nullptr).argument()) == "label_smoothing");
  CHECK(linear_cross_entropy(a, blas, nullptr).code() == Errc::null_pointer);  // no workspace
}

TEST_CASE("linear_cross_entropy: gradients in the weight's dtype", "[lce][gpu]") {
  // G = bf16 against G = float: the loss and dx are the same bytes (G touches only dW and db), dW and
  // db the fp32 ones rounded once per chunk (accumulate on: added to what they held). Sanitizer-sized:
  // 300 tokens in chunks of 128 and a hidden size of 64 (1000 tokens in chunks of 256, hidden 256):
  // still several chunks, and the same vocabulary (the resident kernel, one block a row).
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t N = small ? 300 : 1000, D = small ? 64 : 256, V = 5000, chunk = small ? 128 : 256;
  DeviceBuffer<unsigned char> gws(32u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  TIGON_OK(blas.status());
  DeviceBuffer<bf16> x(N * D), w(V * D), b(V), dx1(N * D), dx2(N * D), dw2(V * D), db2(V);
  DeviceBuffer<float> dw1(V * D), db1(V), l1(1), l2(1);
  DeviceBuffer<std::int64_t> tb(N);
  x.upload(gpu_test::random_values<bf16>(N * D, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(V * D, 0, 0.05, nullptr));
  b.upload(gpu_test::random_values<bf16>(V, 0, 0.1, nullptr));
  std::vector<std::int64_t> t(N);
  for (std::int64_t i = 0; i < N; ++i) t[i] = i % 13 == 0 ? -100 : (i * 7919) % V;
  tb.upload(t);
  for (bool accumulate : {false, true}) {
    const auto start_w = gpu_test::random_values<bf16>(V * D, 0, 0.01, nullptr);
    const auto start_b = gpu_test::random_values<bf16>(V, 0, 0.01, nullptr);
    std::vector<float> start_wf(start_w.size()), start_bf(start_b.size());
    for (std::size_t i = 0; i < start_w.size(); ++i) start_wf[i] = to_float(start_w[i]);
    for (std::size_t i = 0; i < start_b.size(); ++i) start_bf[i] = to_float(start_b[i]);
    dw1.upload(start_wf);
    db1.upload(start_bf);
    dw2.upload(start_w);
    db2.upload(start_b);
    LinearCrossEntropyArgs<bf16> a;
    a.x = x.ptr;
    a.weight = w.ptr;
    a.bias = b.ptr;
    a.hidden = D;
    a.loss.targets = tb.ptr;
    a.loss.rows = N;
    a.loss.vocab = V;
    a.loss.loss = l1.ptr;
    a.dx = dx1.ptr;
    a.dweight = dw1.ptr;
    a.dbias = db1.ptr;
    a.accumulate = accumulate;
    a.chunk = chunk;
    LinearCrossEntropyArgs<bf16, std::int64_t, bf16> a2;
    a2.x = x.ptr;
    a2.weight = w.ptr;
    a2.bias = b.ptr;
    a2.hidden = D;
    a2.loss = a.loss;
    a2.loss.loss = l2.ptr;
    a2.dx = dx2.ptr;
    a2.dweight = dw2.ptr;
    a2.dbias = db2.ptr;
    a2.accumulate = accumulate;
    a2.chunk = chunk;
    std::size_t bytes1 = 0, bytes2 = 0;
    TIGON_OK(linear_cross_entropy_workspace_bytes(a, bytes1));
    TIGON_OK(linear_cross_entropy_workspace_bytes(a2, bytes2));
    CHECK(bytes1 == bytes2);
    DeviceBuffer<unsigned char> ws(bytes1);
    ws.poison();
    dx1.poison();
    dx2.poison();
    a.workspace = a2.workspace = ws.ptr;
    a.workspace_bytes = a2.workspace_bytes = bytes1;
    TIGON_OK(linear_cross_entropy(a, blas, nullptr));
    TIGON_OK(linear_cross_entropy(a2, blas, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(l1.download()[0] == l2.download()[0]);
    const auto d1 = dx1.download(), d2 = dx2.download();
    CHECK(gpu_test::all_finite(d1));  // both were poisoned: equal bytes alone would pass unwritten
    CHECK(std::memcmp(d1.data(), d2.data(), d1.size() * sizeof(bf16)) == 0);
    // At most four chunks: at most four roundings of a bf16 sum (2^-9 each) on top of the fp32 result.
    CHECK(rel_l2_bf16(dw2.download(), dw1.download()) < 8e-3);
    CHECK(rel_l2_bf16(db2.download(), db1.download()) < 8e-3);
  }
}

// Sanitizer-sized: 2 heads over 256 tokens in chunks of 128 with a hidden size of 64 (3 heads, 600
// tokens in chunks of 200, hidden 128): still several heads and chunks, the same vocabulary.
TEST_CASE("linear_cross_entropy_heads: gradients in the weight's dtype", "[lce][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t N = small ? 256 : 600, D = small ? 64 : 128, V = 3000, chunk = small ? 128 : 200;
  const int K = small ? 2 : 3;
  DeviceBuffer<unsigned char> gws(32u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(N * D), dx1(N * D), dx2(N * D);
  DeviceBuffer<std::int64_t> tb(K * N);
  DeviceBuffer<float> l1(1), l2(1);
  x.upload(gpu_test::random_values<bf16>(N * D, 0, 1, nullptr));
  std::vector<std::int64_t> t(K * N);
  for (std::int64_t i = 0; i < K * N; ++i) t[i] = i % 11 == 0 ? -100 : (i * 104729) % V;
  tb.upload(t);
  std::deque<DeviceBuffer<bf16>> w, dwb;  // a deque: buffers are neither copied nor moved
  std::deque<DeviceBuffer<float>> dwf;
  std::vector<const bf16*> wp;
  std::vector<float*> dwfp;
  std::vector<bf16*> dwbp;
  for (int k = 0; k < K; ++k) {
    w.emplace_back(V * D);
    w.back().upload(gpu_test::random_values<bf16>(V * D, 0, 0.05, nullptr));
    dwf.emplace_back(V * D);
    dwb.emplace_back(V * D);
  }
  for (int k = 0; k < K; ++k) {
    wp.push_back(w[k].ptr);
    dwfp.push_back(dwf[k].ptr);
    dwbp.push_back(dwb[k].ptr);
  }
  LinearCrossEntropyHeadsArgs<bf16> h;
  h.x = x.ptr;
  h.hidden = D;
  h.heads = K;
  h.weights = wp.data();
  h.loss.targets = tb.ptr;
  h.loss.rows = N;
  h.loss.vocab = V;
  h.loss.loss = l1.ptr;
  h.dx = dx1.ptr;
  h.dweights = dwfp.data();
  h.chunk = chunk;
  LinearCrossEntropyHeadsArgs<bf16, std::int64_t, bf16> h2;
  h2.x = x.ptr;
  h2.hidden = D;
  h2.heads = K;
  h2.weights = wp.data();
  h2.loss = h.loss;
  h2.loss.loss = l2.ptr;
  h2.dx = dx2.ptr;
  h2.dweights = dwbp.data();
  h2.chunk = chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_heads_workspace_bytes(h, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  dx1.poison();
  dx2.poison();
  for (int k = 0; k < K; ++k) dwf[k].poison(), dwb[k].poison();
  h.workspace = h2.workspace = ws.ptr;
  h.workspace_bytes = h2.workspace_bytes = bytes;
  TIGON_OK(linear_cross_entropy_heads(h, blas, nullptr));
  TIGON_OK(linear_cross_entropy_heads(h2, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(l1.download()[0] == l2.download()[0]);
  const auto d1 = dx1.download(), d2 = dx2.download();
  CHECK(gpu_test::all_finite(d1));  // both were poisoned: equal bytes alone would pass unwritten
  CHECK(std::memcmp(d1.data(), d2.data(), d1.size() * sizeof(bf16)) == 0);
  for (int k = 0; k < K; ++k) CHECK(rel_l2_bf16(dwb[k].download(), dwf[k].download()) < 6e-3);
}
