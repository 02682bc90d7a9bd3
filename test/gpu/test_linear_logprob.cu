// Linear log-probs on the GPU: the forward's per-token logp, lse, entropy, logit sums and is_top1, and the
// backward's dx, dW, db from upstream gradients of logp and entropy, against a double-precision
// reference on the logits rounded as the GEMM rounds them (bf16 and fp32, bias, temperature,
// ignored and out-of-range targets, several chunk sizes, vectorised and single-element rows).
#include "gpu_test.cuh"

#include <cmath>

#include <tigon/loss/linear_logprob.cuh>

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

struct Case {
  std::int64_t N = 47, D = 31, V = 128;
  bool bias = false;
  double temperature = 1;
  std::int64_t chunk = 0;
  bool entropy_grad = true;
  bool dbias = false;
  bool keep = false;  // the backward reads the forward's logits from the workspace
  bool bias_unaligned = false;  // the bias one element past a 16-byte boundary (the op copies it)
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

template <class T>
void run_case(const Case& c, CublasLtGemm& blas) {
  INFO("N " << c.N << " D " << c.D << " V " << c.V << (c.bias ? " bias" : "") << " T " << c.temperature << " chunk "
            << c.chunk << (c.entropy_grad ? " entropy-grad" : "") << (c.keep ? " kept" : "") << (c.bias_unaligned ? " unaligned-bias" : "") << " dtype " << dtype_traits<T>::name);
  std::vector<double> xd, wd, bd;
  const auto xh = gpu_test::random_values<T>(c.N * c.D, 0, 1, &xd);
  const auto wh = gpu_test::random_values<T>(c.V * c.D, 0, 2 / std::sqrt(double(c.D)), &wd);
  const auto bh = gpu_test::random_values<T>(c.V, 0, 0.5, &bd);
  std::vector<std::int64_t> t(c.N);
  for (std::int64_t i = 0; i < c.N; ++i) t[i] = i % 9 == 4 ? -100 : (i % 13 == 6 ? c.V + 3 : (i * 7919) % c.V);
  std::vector<float> gl(c.N), ge(c.N);
  for (std::int64_t i = 0; i < c.N; ++i) {
    gl[i] = float(0.5 + 0.01 * (i % 37)) * (i % 2 ? -1.0f : 1.0f);
    ge[i] = float(0.02 * (i % 11) - 0.1);
  }

  // Reference: logits rounded to T once (the GEMM's output, the bias added before the rounding).
  const double inv_t = 1 / c.temperature;
  std::vector<double> logits(c.N * c.V), dlog(c.N * c.V, 0.0);
  std::vector<double> rlogp(c.N, 0), rlse(c.N, 0), rent(c.N, 0), rsum(c.N, 0);
  for (std::int64_t n = 0; n < c.N; ++n) {
    for (std::int64_t v = 0; v < c.V; ++v) {
      double r = 0;
      for (std::int64_t k = 0; k < c.D; ++k) r += xd[n * c.D + k] * wd[v * c.D + k];
      if (c.bias) r += bd[v];
      r = to_float(from_float<T>(float(r)));
      logits[n * c.V + v] = r;
    }
  }
  // is_top1: every fourth valid token's target is its row's first argmax, every eighth the second
  // largest column; a token counts only where the target's logit and the best other column's differ
  // by more than the GEMM's and the reference's roundings may (4 roundings of T).
  std::vector<int> rtop(c.N, 0), top_checked(c.N, 1);
  for (std::int64_t n = 0; n < c.N; ++n) {
    const double* row = &logits[n * c.V];
    std::int64_t best = 0, second = -1;
    for (std::int64_t v = 1; v < c.V; ++v) {
      if (row[v] > row[best]) second = best, best = v;
      else if (second < 0 || row[v] > row[second]) second = v;
    }
    const bool valid = t[n] >= 0 && t[n] < c.V;
    if (valid && n % 4 == 1) t[n] = best;
    if (valid && n % 8 == 3 && second >= 0) t[n] = second;
    if (!(t[n] >= 0 && t[n] < c.V)) continue;
    double other = -INFINITY;
    for (std::int64_t v = 0; v < c.V; ++v) {
      if (v != t[n]) other = std::max(other, row[v]);
    }
    rtop[n] = best == t[n];
    const double ulp = std::is_same_v<T, float> ? 0x1p-20 : std::is_same_v<T, bf16> ? 0x1p-7 : 0x1p-10;
    top_checked[n] = std::abs(row[t[n]] - other) > 4 * ulp * (1 + std::abs(row[t[n]]));
  }
  int bad_targets = 0;
  for (std::int64_t n = 0; n < c.N; ++n) {
    const bool valid = t[n] >= 0 && t[n] < c.V;
    for (std::int64_t v = 0; v < c.V; ++v) rsum[n] += logits[n * c.V + v];  // every token's
    if (!valid) {
      bad_targets += t[n] != -100;
      continue;
    }
    double m = -INFINITY, s = 0, pz = 0;
    for (std::int64_t v = 0; v < c.V; ++v) m = std::max(m, logits[n * c.V + v] * inv_t);
    for (std::int64_t v = 0; v < c.V; ++v) {
      const double z = logits[n * c.V + v] * inv_t, e = std::exp(z - m);
      s += e;
      pz += e * z;
    }
    const double lse = m + std::log(s);
    rlse[n] = lse;
    rlogp[n] = logits[n * c.V + t[n]] * inv_t - lse;
    rent[n] = lse - pz / s;
    const double g = gl[n], h = c.entropy_grad ? ge[n] : 0.0, mz = lse - rent[n];
    for (std::int64_t v = 0; v < c.V; ++v) {
      const double z = logits[n * c.V + v] * inv_t, p = std::exp(z - lse);
      dlog[n * c.V + v] = ((v == t[n] ? g : 0.0) - p * (g + h * (z - mz))) * inv_t;
    }
  }
  // The gradient GEMMs from dlogits rounded to T (as the kernel stores them).
  std::vector<double> dlr(dlog.size());
  for (std::size_t i = 0; i < dlog.size(); ++i) dlr[i] = to_float(from_float<T>(float(dlog[i])));
  std::vector<double> rdx(c.N * c.D, 0), rdw(c.V * c.D, 0), rdb(c.V, 0);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t v = 0; v < c.V; ++v) {
      const double d = dlr[n * c.V + v];
      if (d == 0) continue;
      rdb[v] += d;
      for (std::int64_t k = 0; k < c.D; ++k) {
        rdx[n * c.D + k] += d * wd[v * c.D + k];
        rdw[v * c.D + k] += d * xd[n * c.D + k];
      }
    }

  DeviceBuffer<T> x(xh.size()), w(wh.size()), b(bh.size() + 1), dxb(c.N * c.D);
  DeviceBuffer<std::int64_t> tb(c.N);
  DeviceBuffer<float> lp(c.N), ls(c.N), en(c.N), su(c.N), glb(c.N), geb(c.N), dwb(c.V * c.D), dbb(c.V);
  DeviceBuffer<int> errs(1);
  DeviceBuffer<std::uint8_t> top(c.N);
  x.upload(xh);
  w.upload(wh);
  if (c.bias_unaligned) {
    std::vector<T> bh1(1, from_float<T>(0.0f));
    bh1.insert(bh1.end(), bh.begin(), bh.end());
    b.upload(bh1);
  } else {
    b.upload(bh);
  }
  tb.upload(t);
  glb.upload(gl);
  geb.upload(ge);
  // initcheck does not see the writes of cuBLAS's GEMM kernels (the logits chunks in the workspace,
  // dx, dW, db): the poison makes every byte initialised and a byte the GEMM does not write NaN.
  for (auto* p : {&lp, &ls, &en, &su, &dwb, &dbb}) p->poison();
  dxb.poison();
  CUDA_OK(cudaMemset(top.ptr, 0xff, c.N));
  CUDA_OK(cudaMemset(errs.ptr, 0, sizeof(int)));
  LinearLogProbArgs<T> a{.x = x.ptr, .weight = w.ptr,
                         .bias = c.bias ? b.ptr + (c.bias_unaligned ? 1 : 0) : nullptr, .hidden = c.D,
                         .targets = tb.ptr, .tokens = c.N, .vocab = c.V,
                         .temperature = static_cast<float>(c.temperature), .logp = lp.ptr, .lse = ls.ptr,
                         .entropy = en.ptr, .logit_sum = su.ptr, .is_top1 = top.ptr, .error_count = errs.ptr,
                         .grad_logp = glb.ptr,
                         .grad_entropy = c.entropy_grad ? geb.ptr : nullptr, .dx = dxb.ptr, .dweight = dwb.ptr,
                         .dbias = c.dbias ? dbb.ptr : nullptr, .chunk = c.chunk, .keep_logits = c.keep};
  std::size_t fb = 0, bb = 0;
  TIGON_OK(linear_logprob_workspace_bytes(a, false, fb));
  TIGON_OK(linear_logprob_workspace_bytes(a, true, bb));
  if (c.keep) CHECK(fb == bb);  // one workspace for both
  DeviceBuffer<unsigned char> ws(std::max(fb, bb));
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = ws.count;
  TIGON_OK(linear_logprob_forward(a, blas, nullptr));
  TIGON_OK(linear_logprob_backward(a, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());

  CHECK(errs.download()[0] == bad_targets);
  // Per-token values: absolute in units of the row's scale (the logits' rounding dominates: the
  // GEMM's and the reference's fp32 sums of a logit may round to neighbouring values of T, so a
  // bfloat16 token's values may differ by up to two of its roundings, 2 * 2^-8 relative).
  const auto glp = lp.download(), gls = ls.download(), gen = en.download(), gsu = su.download();
  // log p_t = x_t / T - lse carries the target logit's roundings, so its bound scales with |x_t| / T
  // as well (a token whose target is its argmax has a large x_t and a small |log p_t|); the entropy
  // lse - E_p[z] carries every logit's, so its bound scales with the row's largest |z|.
  // The logit sum adds every logit of the row: each of the (few) logits that the GEMM rounds to the
  // neighbouring value of T moves it by one spacing of T, so its bound allows 12 such logits at the
  // row's largest magnitude (about 2 are expected at V 4096).
  int bad_logp = 0, bad_lse = 0, bad_ent = 0, bad_sum = 0, bad_ignored = 0;
  double worst_sum = 0;
  for (std::int64_t n = 0; n < c.N; ++n) {
    const double e = std::is_same_v<T, float> ? 1e-4 : std::is_same_v<T, bf16> ? 0x1p-7 : 1e-3;
    const bool valid = t[n] >= 0 && t[n] < c.V;
    const double xt = valid ? std::abs(logits[n * c.V + t[n]]) * inv_t : 0.0;
    bad_logp += std::abs(glp[n] - rlogp[n]) > e * (1 + std::abs(rlogp[n]) + xt);
    bad_lse += std::abs(gls[n] - rlse[n]) > e * (1 + std::abs(rlse[n]));
    double row_max = 0;
    for (std::int64_t v = 0; v < c.V; ++v) row_max = std::max(row_max, std::abs(logits[n * c.V + v]));
    bad_ent += std::abs(gen[n] - rent[n]) > e * (1 + std::abs(rent[n]) + row_max * inv_t);
    const double sum_bound = 1e-4 * (1 + std::abs(rsum[n])) + 1e-5 * c.V + 12 * e * row_max;
    worst_sum = std::max(worst_sum, std::abs(gsu[n] - rsum[n]) / sum_bound);
    bad_sum += std::abs(gsu[n] - rsum[n]) > sum_bound;
    if (!valid) bad_ignored += glp[n] != 0 || gls[n] != 0 || gen[n] != 0;
  }
  INFO("tokens out of bounds: logp " << bad_logp << ", lse " << bad_lse << ", entropy " << bad_ent
                                     << ", logit_sum " << bad_sum << " (worst at " << worst_sum
                                     << " of its bound), ignored not 0 " << bad_ignored);
  CHECK(bad_logp + bad_lse + bad_ent + bad_sum + bad_ignored == 0);
  const auto gtop = top.download();
  int top_bad = 0, top_ones = 0, top_seen = 0;
  for (std::int64_t n = 0; n < c.N; ++n) {
    if (!(t[n] >= 0 && t[n] < c.V)) {
      top_bad += gtop[n] != 0;
      continue;
    }
    top_bad += gtop[n] > 1;
    if (!top_checked[n]) continue;
    ++top_seen;
    top_ones += rtop[n];
    top_bad += gtop[n] != rtop[n];
  }
  CHECK(top_bad == 0);
  if (c.N >= 8) CHECK(top_ones > 0);  // the check saw targets that are the argmax
  CHECK(top_seen > c.N / 2);
  CHECK(rel_l2(as_double(dxb.download()), rdx) < tol<T>());
  CHECK(rel_l2(as_double(dwb.download()), rdw) < tol<T>());
  if (c.dbias) CHECK(rel_l2(as_double(dbb.download()), rdb) < tol<T>());
  // Ignored rows take no gradient: their dx rows are exactly 0.
  const auto dxh = dxb.download();
  int nonzero = 0;
  for (std::int64_t n = 0; n < c.N; ++n) {
    if (t[n] >= 0 && t[n] < c.V) continue;
    for (std::int64_t k = 0; k < c.D; ++k) nonzero += to_float(dxh[n * c.D + k]) != 0.0f;
  }
  CHECK(nonzero == 0);
}

}  // namespace

// Sanitizer-sized: chunks of one token over 12 tokens instead of 47, and the 4096-column shapes at 128
// tokens and a hidden size of 64 (3 chunks of at most 50 where the full one has 3 of at most 200):
// every vocabulary stays, so the kernels' vector and single-element instances and a row of one
// vector per thread are still reached.
TEST_CASE("linear_logprob: forward and backward against the double reference", "[llp][gpu]") {
  DeviceBuffer<unsigned char> ws(32u << 20);
  ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(ws.ptr, ws.count);
  TIGON_OK(blas.status());
  const bool small = gpu_test::sanitizer_sized();
  for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}}) {
    const std::int64_t n = small && chunk == 1 ? 12 : 47;  // chunk 1: a chunk (and its GEMMs) a token
    run_case<bf16>({.N = n, .chunk = chunk}, blas);
    run_case<float>({.N = n, .bias = true, .chunk = chunk, .dbias = true}, blas);
  }
  const std::int64_t big_n = small ? 128 : 512, big_d = small ? 64 : 256;
  run_case<bf16>({.V = 127, .bias = true, .temperature = 0.7, .chunk = 16, .dbias = true}, blas);  // single elements
  run_case<bf16>({.temperature = 2.0, .entropy_grad = false}, blas);
  run_case<half>({.N = 300, .D = 64, .V = 1000, .chunk = 128}, blas);
  run_case<bf16>({.N = big_n, .D = big_d, .V = 4096, .bias = true, .temperature = 0.9, .chunk = small ? 50 : 200,
                  .dbias = true},
                 blas);
  // Kept logits: one chunk of every token, the backward without its GEMM.
  run_case<bf16>({.bias = true, .temperature = 0.8, .dbias = true, .keep = true}, blas);
  run_case<bf16>({.bias = true, .chunk = 20, .dbias = true, .bias_unaligned = true}, blas);
  run_case<float>({.bias = true, .temperature = 0.8, .dbias = true, .keep = true, .bias_unaligned = true}, blas);
  run_case<float>({.keep = true}, blas);
  run_case<bf16>({.N = big_n, .D = big_d, .V = 4096, .entropy_grad = false, .keep = true}, blas);
}

TEST_CASE("linear_logprob: every target ignored gives zeros and no gradient", "[llp][gpu]") {
  const std::int64_t N = 16, D = 32, V = 256;
  DeviceBuffer<unsigned char> gws(32u << 20);
  gws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(gws.ptr, gws.count);
  DeviceBuffer<bf16> x(N * D), w(V * D), dx(N * D);
  DeviceBuffer<std::int64_t> tb(N);
  DeviceBuffer<float> lp(N), ls(N), g(N), dw(V * D);
  x.upload(gpu_test::random_values<bf16>(N * D, 0, 1, nullptr));
  w.upload(gpu_test::random_values<bf16>(V * D, 0, 0.1, nullptr));
  tb.upload(std::vector<std::int64_t>(N, -100));
  g.upload(std::vector<float>(N, 1.0f));
  lp.poison();
  ls.poison();
  dx.poison();
  dw.poison();
  LinearLogProbArgs<bf16> a{.x = x.ptr, .weight = w.ptr, .hidden = D, .targets = tb.ptr, .tokens = N, .vocab = V,
                            .logp = lp.ptr, .lse = ls.ptr, .grad_logp = g.ptr, .dx = dx.ptr, .dweight = dw.ptr};
  std::size_t bytes = 0;
  TIGON_OK(linear_logprob_workspace_bytes(a, true, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  ws.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  TIGON_OK(linear_logprob_forward(a, blas, nullptr));
  TIGON_OK(linear_logprob_backward(a, blas, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  for (float v : lp.download()) CHECK(v == 0.0f);
  for (const auto& v : dx.download()) CHECK(to_float(v) == 0.0f);
  for (float v : dw.download()) CHECK(v == 0.0f);
}
