// Chunked linear divergence on the GPU: against a double-precision reference at small shapes (bf16
// and fp32, each divergence, labels, reductions, temperature, upstream gradients, several chunk
// sizes, forward only), and against the unfused composition (the two logits GEMMs, the divergence
// op in place, the gradient GEMMs) at a larger shape; bad arguments rejected by name.
#include "gpu_test.cuh"

#include <cmath>

#include <tigon/loss/linear_divergence.cuh>

#include "../reference/divergence_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

template <class T>
double round_t(double v) {
  return tigon::round_to<T>(static_cast<float>(v));
}

struct Case {
  std::int64_t N = 47, D = 31, Dt = 45, V = 123;
  tigon_ref::Div div = tigon_ref::Div::forward_kl;
  DivergenceReduction red = DivergenceReduction::batchmean;
  float temperature = 1.0f;
  bool labels = true;
  bool grad_output = false;
  std::int64_t chunk = 0;
  bool grads = true;
};

template <class T>
double tol() {
  return std::is_same_v<T, float> ? 2e-3 : 2e-2;  // relative L2 (GEMMs on tensor cores)
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += std::isfinite(got[i]) ? (got[i] - ref[i]) * (got[i] - ref[i]) : INFINITY;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

template <class V>
std::vector<double> as_double(const V& v) {
  std::vector<double> o;
  for (const auto& e : v) o.push_back(double(to_float(e)));
  return o;
}

template <class F>
Status dispatch(tigon_ref::Div d, F&& f) {
  switch (d) {
    case tigon_ref::Div::forward_kl: return f(ForwardKL{});
    case tigon_ref::Div::reverse_kl: return f(ReverseKL{});
    case tigon_ref::Div::jsd: return f(GeneralizedJSD{0.5f});
    case tigon_ref::Div::kldiv: return f(KLDiv{});
    case tigon_ref::Div::tvd: return f(TVD{});
  }
  return Status();
}

// The logits a [n, k] x [v, k]^T GEMM of dtype T holds: the double product rounded to T.
std::vector<double> logits_of(const std::vector<double>& x, const std::vector<double>& w, std::int64_t n,
                              std::int64_t v, std::int64_t k, double (*round)(double)) {
  std::vector<double> o(n * v);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < v; ++j) {
      double s = 0;
      for (std::int64_t d = 0; d < k; ++d) s += x[i * k + d] * w[j * k + d];
      o[i * v + j] = round(s);
    }
  return o;
}

template <class T>
void run_case(const Case& c, CublasLtGemm& blas) {
  INFO("N " << c.N << " D " << c.D << " Dt " << c.Dt << " V " << c.V << " div " << int(c.div) << " red "
            << int(c.red) << " T " << c.temperature << (c.labels ? " labels" : "") << (c.grad_output ? " go" : "")
            << " chunk " << c.chunk << (c.grads ? "" : " forward-only") << " dtype=" << dtype_traits<T>::name);
  const bool none = c.red == DivergenceReduction::none;
  const bool elems = none && tigon_ref::elementwise_none(c.div);
  std::vector<double> xd, wd, txd, twd;
  const auto xh = gpu_test::random_values<T>(c.N * c.D, 0, 1, &xd);
  const auto wh = gpu_test::random_values<T>(c.V * c.D, 0, 2 / std::sqrt(double(c.D)), &wd);
  const auto txh = gpu_test::random_values<T>(c.N * c.Dt, 0, 1, &txd);
  const auto twh = gpu_test::random_values<T>(c.V * c.Dt, 0, 2 / std::sqrt(double(c.Dt)), &twd);
  std::vector<std::int64_t> lab(c.N);
  for (std::int64_t i = 0; i < c.N; ++i) lab[i] = i % 9 == 4 ? -100 : i;
  std::vector<float> go;
  if (c.grad_output) {
    const std::size_t n = none ? (elems ? c.N * c.V : c.N) : 1;
    for (std::size_t i = 0; i < n; ++i) go.push_back(0.5f + float(i % 7) * 0.25f);
  }

  // Reference: both logits rounded to T (the GEMMs' outputs), the divergence and its gradient in
  // double, the gradient rounded to T (the buffer the gradient GEMMs read), then the products.
  const auto s = logits_of(xd, wd, c.N, c.V, c.D, &round_t<T>);
  const auto t = logits_of(txd, twd, c.N, c.V, c.Dt, &round_t<T>);
  tigon_ref::DivOptions o;
  o.div = c.div;
  o.student = o.teacher = tigon_ref::Form::logits;
  o.temperature = c.temperature;
  o.reduction = tigon_ref::Red(int(c.red));
  if (c.labels) o.labels = lab;
  o.grad_output.assign(go.begin(), go.end());
  const auto ref = tigon_ref::divergence(s, t, c.N, c.V, o, true);
  std::vector<double> dx(c.N * c.D, 0), dw(c.V * c.D, 0);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t v = 0; v < c.V; ++v) {
      const double g = round_t<T>(ref.grad[n * c.V + v]);
      if (g == 0) continue;
      for (std::int64_t d = 0; d < c.D; ++d) {
        dx[n * c.D + d] += g * wd[v * c.D + d];
        dw[v * c.D + d] += g * xd[n * c.D + d];
      }
    }

  DeviceBuffer<T> x(xh.size()), w(wh.size()), tx(txh.size()), tw(twh.size()), dxb(xh.size());
  DeviceBuffer<float> dwb(wh.size()), loss(1), lrows(c.N), lelems(c.N * c.V), gob(go.empty() ? 1 : go.size());
  DeviceBuffer<std::int64_t> lb(c.N);
  x.upload(xh);
  w.upload(wh);
  tx.upload(txh);
  tw.upload(twh);
  lb.upload(lab);
  if (!go.empty()) gob.upload(go);
  // initcheck does not see the writes of cuBLAS's GEMM kernels (the logits chunks in the workspace,
  // dx, dW): the poison makes every byte initialised and a byte the GEMM does not write NaN.
  dxb.poison();
  dwb.poison();
  LinearDivergenceArgs<T> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.hidden = c.D;
  a.teacher_x = tx.ptr;
  a.teacher_weight = tw.ptr;
  a.teacher_hidden = c.Dt;
  a.tokens = c.N;
  a.vocab = c.V;
  a.temperature = c.temperature;
  a.labels = c.labels ? lb.ptr : nullptr;
  a.reduction = c.red;
  a.grad_output = go.empty() ? nullptr : gob.ptr;
  a.loss = none ? nullptr : loss.ptr;
  a.loss_rows = lrows.ptr;
  a.loss_elems = elems ? lelems.ptr : nullptr;
  if (c.grads) {
    a.dx = dxb.ptr;
    a.dweight = dwb.ptr;
  }
  a.chunk = c.chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_divergence_workspace_bytes(a, bytes));
  const std::int64_t chunk = c.chunk > 0 && c.chunk < c.N ? c.chunk : c.N;
  CHECK(bytes <= 2 * ((chunk * c.V * sizeof(T) + 255) / 256 * 256) + (c.N * 4 + 16 + 255) / 256 * 256);
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  TIGON_OK(dispatch(c.div, [&](const auto& d) { return linear_divergence(a, d, blas, nullptr); }));
  CUDA_OK(cudaDeviceSynchronize());

  CHECK(rel_l2(as_double(lrows.download()), ref.loss_rows) < tol<T>());
  if (!none) CHECK(std::abs(loss.download()[0] - ref.loss) <= tol<T>() * (1e-3 + std::abs(ref.loss)));
  if (elems) CHECK(rel_l2(as_double(lelems.download()), ref.loss_elems) < tol<T>());
  if (c.grads) {
    CHECK(rel_l2(as_double(dxb.download()), dx) < tol<T>());
    CHECK(rel_l2(as_double(dwb.download()), dw) < tol<T>());
  } else {
    CHECK(gpu_test::all_bytes_ff(dxb.download().data(), sizeof(T)));  // nothing written
  }
}

}  // namespace

// Sanitizer-sized: chunks of one token (four GEMMs each) over 12 tokens instead of 47 and for
// forward KL alone (the chunks' bookkeeping and the one-row GEMMs do not depend on the divergence;
// every divergence still runs in one chunk and in chunks of 17), and the larger shape at 256 tokens
// with hidden sizes of 128 and 192 (3 chunks of at most 96): the same vocabulary of 4096 columns,
// the resident kernel's, as 123 columns take the row kernel's single elements.
TEST_CASE("linear_divergence: small shapes against the double reference", "[ldiv][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  using tigon_ref::Div;
  const bool small = gpu_test::sanitizer_sized();
  for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}}) {
    const std::int64_t n = small && chunk == 1 ? 12 : 47;
    for (Div d : {Div::forward_kl, Div::reverse_kl, Div::jsd, Div::kldiv, Div::tvd}) {
      if (small && chunk == 1 && d != Div::forward_kl) continue;
      run_case<bf16>({.N = n, .div = d, .chunk = chunk}, blas);
      run_case<float>({.N = n, .div = d, .temperature = 2.0f, .chunk = chunk}, blas);
    }
  }
  run_case<bf16>({.red = DivergenceReduction::mean, .chunk = 16}, blas);
  run_case<bf16>({.red = DivergenceReduction::sum, .labels = false, .grad_output = true, .chunk = 16}, blas);
  run_case<bf16>({.div = Div::jsd, .red = DivergenceReduction::none, .grad_output = true, .chunk = 16}, blas);
  run_case<float>({.div = Div::kldiv, .red = DivergenceReduction::none, .grad_output = true, .chunk = 16}, blas);
  run_case<bf16>({.div = Div::tvd, .red = DivergenceReduction::none, .chunk = 10}, blas);
  run_case<bf16>({.labels = false, .chunk = 20}, blas);
  run_case<bf16>({.grads = false}, blas);
  if (small) {
    run_case<bf16>({.N = 256, .D = 128, .Dt = 192, .V = 4096, .div = Div::jsd, .temperature = 1.5f, .chunk = 96},
                   blas);
  } else {
    run_case<bf16>({.N = 512, .D = 512, .Dt = 768, .V = 4096, .div = Div::jsd, .temperature = 1.5f, .chunk = 128},
                   blas);
  }
}

// Sanitizer-sized: 512 tokens in chunks of 128, hidden sizes of 128 and 192 (2048 tokens in chunks
// of 512, hidden sizes of 1024 and 1536): still four chunks, and 32000 columns still take the
// resident kernel in clusters of 4 blocks.
TEST_CASE("linear_divergence: equals the unfused composition", "[ldiv][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  const std::int64_t N = small ? 512 : 2048, D = small ? 128 : 1024, Dt = small ? 192 : 1536, V = 32000;
  const std::int64_t chunk = small ? 128 : 512;
  DeviceBuffer<unsigned char> gws(32u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(N * D), w(V * D), tx(N * Dt), tw(V * Dt), s(N * V), t(N * V), dx1(N * D), dx2(N * D);
  DeviceBuffer<float> dw1(V * D), dw2(V * D), l1(1), l2(1);
  DeviceBuffer<std::int64_t> lb(N);
  x.upload(gpu_test::random_values<bf16>(N * D, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(V * D, 0, 0.05, nullptr));
  tx.upload(gpu_test::random_values<bf16>(N * Dt, 0, 1, nullptr));
  tw.upload(gpu_test::random_values<bf16>(V * Dt, 0, 0.05, nullptr));
  std::vector<std::int64_t> lab(N);
  for (std::int64_t i = 0; i < N; ++i) lab[i] = i % 5 == 2 ? -100 : i;
  lb.upload(lab);
  for (auto* p : {&s, &t, &dx1, &dx2}) p->poison();
  dw1.poison();
  dw2.poison();
  const GeneralizedJSD jsd{0.3f};
  // Unfused: both logits, the divergence in place over all tokens, the two gradient GEMMs.
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = x.ptr, .b = w.ptr, .d = s.ptr, .m = N, .n = V, .k = D, .op_b = Op::t},
                     nullptr));
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = tx.ptr, .b = tw.ptr, .d = t.ptr, .m = N, .n = V, .k = Dt, .op_b = Op::t},
                     nullptr));
  DivergenceArgs<bf16> da{.student = s.ptr, .student_input = DivergenceInput::logits, .teacher = t.ptr,
                          .teacher_input = DivergenceInput::logits, .rows = N, .vocab = V, .temperature = 2.0f,
                          .labels = lb.ptr, .dx = s.ptr, .loss = l1.ptr};
  std::size_t dbytes = 0;
  TIGON_OK(divergence_workspace_bytes(da, dbytes));
  DeviceBuffer<unsigned char> dws(dbytes > 0 ? dbytes : 1);
  da.workspace = dws.ptr;
  da.workspace_bytes = dbytes;
  TIGON_OK(divergence(da, jsd, nullptr));
  TIGON_OK(blas.gemm(GemmArgs<bf16>{.a = s.ptr, .b = w.ptr, .d = dx1.ptr, .m = N, .n = D, .k = V}, nullptr));
  TIGON_OK(blas.gemm(GemmArgs<bf16, float>{.a = s.ptr, .b = x.ptr, .d = dw1.ptr, .m = V, .n = D, .k = N,
                                           .op_a = Op::t},
                     nullptr));
  // Fused, in chunks of `chunk` tokens.
  LinearDivergenceArgs<bf16> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.hidden = D;
  a.teacher_x = tx.ptr;
  a.teacher_weight = tw.ptr;
  a.teacher_hidden = Dt;
  a.tokens = N;
  a.vocab = V;
  a.temperature = 2.0f;
  a.labels = lb.ptr;
  a.loss = l2.ptr;
  a.dx = dx2.ptr;
  a.dweight = dw2.ptr;
  a.chunk = chunk;
  std::size_t bytes = 0;
  TIGON_OK(linear_divergence_workspace_bytes(a, bytes));
  // Two logits chunks.
  CHECK(bytes <= static_cast<std::size_t>(2 * chunk * V * 2) + 256u + (N * 4u + 16u + 255u) / 256u * 256u);
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  TIGON_OK(linear_divergence(a, jsd, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  // The same row sums in the same order, but the logits GEMMs may take other algorithms for a
  // chunk than for all rows: agreement to rounding, not bitwise.
  CHECK(std::abs(l1.download()[0] - l2.download()[0]) <= 1e-3f * std::abs(l1.download()[0]));
  CHECK(rel_l2(as_double(dx2.download()), as_double(dx1.download())) <= 4e-3);
  CHECK(rel_l2(as_double(dw2.download()), as_double(dw1.download())) < 1e-3);
}

TEST_CASE("linear_divergence: bad arguments are rejected by name", "[ldiv][gpu]") {
  DeviceBuffer<unsigned char> gws(1u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(64), w(64), tx(64), tw(64);
  LinearDivergenceArgs<bf16> a;
  a.x = x.ptr;
  a.weight = w.ptr;
  a.hidden = 8;
  a.teacher_x = tx.ptr;
  a.teacher_weight = tw.ptr;
  a.teacher_hidden = 8;
  a.tokens = 8;
  a.vocab = 8;
  auto bad = a;
  bad.teacher_x = nullptr;
  CHECK(std::string(linear_divergence(bad, ForwardKL{}, blas, nullptr).argument()) == "teacher_x");
  bad = a;
  bad.teacher_vocab = 9;
  CHECK(std::string(linear_divergence(bad, ForwardKL{}, blas, nullptr).argument()) == "teacher_vocab");
  bad = a;
  CHECK(std::string(linear_divergence(bad, ForwardKL{}, blas, nullptr).argument()) == "workspace");
}
