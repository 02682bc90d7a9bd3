// Cross-entropy on the GPU against the double-precision reference: every option alone and
// combined, the issue's shapes (the 8192 x 128256 case with fewer rows: the kernel's path depends
// on the vocabulary, not the row count), every dtype, int32 / int64 targets, upstream gradients,
// in place and out of place, determinism, graph capture, all-ignored batches, bad targets, and the
// split-vocabulary path against the unsplit op.
#include "gpu_test.cuh"

#include <algorithm>
#include <cmath>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>

#include "../reference/cross_entropy_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

struct Case {
  std::int64_t rows = 4, V = 7;
  double eps = 0, z = 0, cap = 0;
  bool weights = false;
  Reduction red = Reduction::mean;
  float grad_scale = 1.0f;
  bool grad_output = false;
  bool in_place = true;
  bool grad = true;
  double ignore_frac = 0.1;
  std::int64_t pad = 0;  // row stride = V + pad
  bool argmax = true;    // request the argmax output (without it and the other options: the plain path)
  bool token = false;    // token scaling
  bool unaligned_weights = false;  // class weights one float past a 16-byte boundary (one float a load)
  bool zero_target_weights = false;  // every target's class weight 0: the mean's cross-entropy part is off
};

std::string describe(const Case& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.V) + " eps " + std::to_string(c.eps) +
         " z " + std::to_string(c.z) + " cap " + std::to_string(c.cap) + (c.weights ? " weights" : "") +
         " red " + std::to_string(int(c.red)) + " scale " + std::to_string(c.grad_scale) +
         (c.grad_output ? " grad_output" : "") + (c.in_place ? " in-place" : " out-of-place") +
         (c.grad ? "" : " loss-only") + " pad " + std::to_string(c.pad) + (c.argmax ? "" : " no-argmax") + (c.token ? " token-scaling" : "") +
         (c.unaligned_weights ? " unaligned-weights" : "") + (c.zero_target_weights ? " zero-target-weights" : "");
}

template <class T>
double tol() {
  if constexpr (std::is_same_v<T, float>) return 1e-4;
  if constexpr (std::is_same_v<T, half>) return 0x1p-9;
  return 0x1p-6;
}

// Policies derived from the default, CUB-style: the row kernel alone (no row is long enough for
// the resident kernels' kResMinCols), with other block sizes and vectors in flight; the resident
// kernels with other shapes, the loss alone taking them too.
struct RowsOnly : tigon::CrossEntropyPolicy {
  static constexpr std::int64_t kResMinCols = std::int64_t{1} << 40;
};
struct RowsWide : RowsOnly {
  static constexpr int kRowThreads = 1024;
  static constexpr int kRowUnroll = 8;
  static constexpr int kRowGradThreads = 128;
};
struct RowsNarrow : RowsOnly {
  static constexpr int kRowThreads = 64;
  static constexpr int kRowUnroll = 1;
};
template <int kThreads, int kVecs, int kMinBlocks, int kAhead = 0>
struct ResPolicy : tigon::CrossEntropyPolicy {
  static constexpr int kResThreads = kThreads;
  static constexpr int kResVecs = kVecs;
  static constexpr int kResMinBlocks = kMinBlocks;
  static constexpr int kResAhead = kAhead;
  static constexpr int kOptThreads = kThreads;
  static constexpr int kOptVecs = kVecs > 16 ? 16 : kVecs;
  static constexpr int kOptMinBlocks = kMinBlocks;
  static constexpr int kOptAhead = kAhead;
};

// The streaming kernel (no gradient) with short segments (many a row, up to its 16; uneven tails)
// and 3 vectors in flight.
struct StreamSmall : tigon::CrossEntropyPolicy {
  static constexpr int kStreamUnroll = 3;
  static constexpr int kStreamSegVecs = 64;
};

// The loss's workspace for `rows` rows.
std::size_t ws_bytes(std::int64_t rows) { return tigon::detail::ce_workspace_bytes(rows); }

template <class T, class I = std::int64_t, class P = tigon::CrossEntropyPolicy>
void run_case(const Case& c) {
  INFO(describe(c) << " T=" << dtype_traits<T>::name << " I=" << sizeof(I) * 8);
  if (c.V * static_cast<std::int64_t>(sizeof(T)) % 16 == 0) {  // the resident kernels' clusters
    const std::int64_t nvec = c.V * static_cast<std::int64_t>(sizeof(T)) / 16;
    const int blocks = std::max(tigon::detail::ce_res_shape(nvec, P::kResThreads, P::kResVecs).csize,
                                tigon::detail::ce_res_shape(nvec, P::kOptThreads, P::kOptVecs).csize);
    if (gpu_test::synccheck_skips_cluster(blocks)) return;
  }
  const std::int64_t ld = c.V + c.pad;
  std::vector<double> xd_all;
  const auto xh = gpu_test::random_values<T>(static_cast<std::size_t>(c.rows * ld), 0.0, 2.0, &xd_all);
  std::vector<double> xd(static_cast<std::size_t>(c.rows * c.V));
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t i = 0; i < c.V; ++i) xd[r * c.V + i] = xd_all[r * ld + i];
  std::vector<std::int64_t> t(c.rows);
  std::uniform_int_distribution<std::int64_t> td(0, c.V - 1);
  std::uniform_real_distribution<double> ud(0, 1);
  for (auto& v : t) v = ud(gpu_test::rng()) < c.ignore_frac ? -100 : td(gpu_test::rng());
  std::vector<I> ti(t.begin(), t.end());

  tigon_ref::CeOptions o;
  o.eps = c.eps;
  o.z = c.z;
  o.cap = c.cap;
  o.reduction = int(c.red);
  o.grad_scale = c.grad_scale;
  o.token_scaling = c.token;
  std::vector<float> wh, goh;
  if (c.weights) {
    for (std::int64_t i = 0; i < c.V; ++i) wh.push_back(0.25f + float(ud(gpu_test::rng())));
    if (c.zero_target_weights) {
      for (const std::int64_t tt : t) {
        if (tt >= 0 && tt < c.V) wh[tt] = 0.0f;
      }
    }
    o.weights.assign(wh.begin(), wh.end());
  }
  if (c.grad_output) {
    for (std::int64_t i = 0; i < (c.red == Reduction::none ? c.rows : 1); ++i) goh.push_back(float(1 + ud(gpu_test::rng())));
    o.grad_output.assign(goh.begin(), goh.end());
  }
  const auto ref = tigon_ref::cross_entropy(xd, t, c.rows, c.V, o, c.grad);

  DeviceBuffer<T> x(xh.size()), dx(xh.size());
  DeviceBuffer<I> tb(ti.size());
  const std::size_t w_off = c.unaligned_weights ? 1 : 0;
  DeviceBuffer<float> w(std::max<std::size_t>(wh.size() + w_off, 1)), go(std::max<std::size_t>(goh.size(), 1));
  DeviceBuffer<float> loss(1), zl(1), rows(c.rows), lse(c.rows);
  DeviceBuffer<std::int64_t> am(c.rows);
  DeviceBuffer<int> errs(1);
  DeviceBuffer<unsigned char> ws(ws_bytes(c.rows));
  x.upload(xh);
  tb.upload(ti);
  if (c.weights) {
    std::vector<float> padded(w_off, 1.0f);
    padded.insert(padded.end(), wh.begin(), wh.end());
    w.upload(padded);
  }
  if (c.grad_output) go.upload(goh);
  dx.poison();
  loss.poison();
  zl.poison();
  rows.poison();
  lse.poison();
  CUDA_OK(cudaMemset(errs.ptr, 0, sizeof(int)));

  CrossEntropyArgs<T, I> a{.logits = x.ptr, .targets = tb.ptr, .rows = c.rows, .vocab = c.V,
                           .logits_stride = ld,
                           .dlogits = c.grad ? (c.in_place ? x.ptr : dx.ptr) : nullptr,
                           .dlogits_stride = ld,
                           .class_weights = c.weights ? w.ptr + w_off : nullptr,
                           .label_smoothing = float(c.eps), .z_loss_scale = float(c.z),
                           .softcap = float(c.cap), .token_scaling = c.token, .reduction = c.red,
                           .grad_scale = c.grad_scale,
                           .grad_output = c.grad_output ? go.ptr : nullptr,
                           .loss = c.red == Reduction::none ? nullptr : loss.ptr,
                           .loss_rows = rows.ptr,
                           .z_loss = c.red == Reduction::none ? nullptr : zl.ptr,
                           .lse = lse.ptr, .argmax = c.argmax ? am.ptr : nullptr, .error_count = errs.ptr,
                           .workspace = ws.ptr, .workspace_bytes = ws.count};
  TIGON_OK(cross_entropy<P>(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());

  const auto lr = rows.download(), lh = lse.download();
  const auto ah = c.argmax ? am.download() : std::vector<std::int64_t>{};  // written only when asked for
  const auto cl = gpu_test::compare(lr.size(), [&](std::size_t i) { return double(lr[i]); }, ref.loss_rows, 1e-4, 1e-4);
  INFO("loss_rows: " << cl.bad << " bad, worst #" << cl.worst);
  CHECK(cl.ok(1e-4));
  const auto cs = gpu_test::compare(lh.size(), [&](std::size_t i) { return double(lh[i]); }, ref.lse, 1e-4, 1e-5);
  CHECK(cs.ok(1e-5));
  int am_bad = 0;  // ties in low precision may pick another index holding the same value
  for (std::int64_t r = 0; c.argmax && r < c.rows; ++r)
    if (ah[r] != ref.argmax[r] && xd[r * c.V + ah[r]] != xd[r * c.V + ref.argmax[r]]) ++am_bad;
  CHECK(am_bad == 0);
  if (c.red != Reduction::none) {
    const float l = loss.download()[0], z = zl.download()[0];
    CHECK(std::abs(l - ref.loss) <= 1e-4 * (1 + std::abs(ref.loss)));
    CHECK(std::abs(z - ref.z_loss) <= 1e-4 * (1 + std::abs(ref.z_loss)));
  }
  CHECK(errs.download()[0] == 0);
  if (c.grad) {
    const auto gh = (c.in_place ? x : dx).download();
    double scale = 0;
    for (double v : ref.grad) scale = std::max(scale, std::abs(v));
    // Token scaling multiplies a row's gradient by its p_t (about 1 / V on random logits): in half the
    // entries fall among the subnormals, so the reference is rounded to half as the stored gradient is.
    std::vector<double> want = ref.grad;
    if (c.token && std::is_same_v<T, half>) {
      for (double& v : want) v = to_float(from_float<T>(float(v)));
    }
    const auto cg = gpu_test::compare(
        want.size(),
        [&](std::size_t i) { return double(to_float(gh[(i / c.V) * ld + i % c.V])); }, want,
        1e-3 * scale + 1e-7, tol<T>());
    INFO("grad: " << cg.bad << " of " << cg.n << " bad, worst #" << cg.worst << " score " << cg.worst_err
                  << " rel L2 " << cg.rel_l2);
    // In half, within one subnormal spacing (2^-24) per element on top of the relative bound.
    const double quantum = std::is_same_v<T, half> ? 0x1p-24 : 0.0;
    CHECK(cg.bad == 0);
    CHECK(cg.l2_within(2 * tol<T>(), quantum));
    // The target's gradient, usually the row's largest, held to the dtype's relative bound on its
    // own. With smoothing on a short row its terms can cancel: then to 1% of that bound times the
    // largest gradient, or, where larger, to what fp32 arithmetic leaves of it: p_t = exp(x_t - lse)
    // carries an absolute error of a few ulps of |lse| (8 x 2^-24 x (1 + |lse|), times the largest
    // gradient).
    int target_bad = 0;
    double target_worst = 0, target_got = 0, target_want = 0;
    for (std::int64_t r = 0; r < c.rows; ++r) {
      if (t[r] < 0) continue;
      const double want = ref.grad[r * c.V + t[r]];
      const double got = to_float(gh[r * ld + t[r]]);
      const double floor = std::max(1e-2 * tol<T>(), 8 * 0x1p-24 * (1 + std::abs(ref.lse[r]))) * scale;
      const double bound = 2 * tol<T>() * std::abs(want) + floor + 1e-7;
      if (!(std::abs(got - want) <= bound)) ++target_bad;
      if (std::abs(got - want) / bound > target_worst) {
        target_worst = std::abs(got - want) / bound, target_got = got, target_want = want;
      }
    }
    INFO("target gradients off: " << target_bad << ", worst " << target_got << " for " << target_want << " ("
                                  << target_worst << " of its bound)");
    CHECK(target_bad == 0);
    // Padding between rows is untouched.
    if (c.pad > 0 && !c.in_place) {
      for (std::int64_t r = 0; r < c.rows; ++r)
        CHECK(gpu_test::all_bytes_ff(&gh[r * ld + c.V], c.pad * sizeof(T)));
    }
    // Bitwise determinism.
    x.upload(xh);
    TIGON_OK(cross_entropy<P>(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto gh2 = (c.in_place ? x : dx).download();
    CHECK(std::memcmp(gh.data(), gh2.data(), gh.size() * sizeof(T)) == 0);
  }
}

// The policy test cases' options at one shape, in order: defaults; every option with an upstream
// gradient; the same with token scaling; out of place with padded rows; every option, loss alone;
// the plain path (no option); smoothing alone; smoothing and the argmax; the softcap alone, in place
// and out of place (with the z-loss, reduction none); with_plain_sep: the plain path out of place, reduction none, an
// upstream gradient per row; the loss alone on the plain path.
std::vector<Case> option_cases(std::int64_t rows, std::int64_t V, bool with_plain_sep) {
  const Case base{.rows = rows, .V = V};
  Case all{.rows = rows, .V = V, .eps = 0.1, .z = 1e-4, .cap = 30, .weights = true, .grad_scale = 0.5f,
           .grad_output = true};
  Case sep = base;
  sep.in_place = false;
  sep.pad = 8;
  Case loss_only = all;
  loss_only.grad = false;
  Case plain = base;
  plain.argmax = false;
  Case plain_sep = sep;
  plain_sep.argmax = false;
  plain_sep.red = Reduction::none;
  plain_sep.grad_output = true;
  Case plain_loss = plain;
  plain_loss.grad = false;
  Case token = all;
  token.token = true;
  // The argmax and smoothing as the only options (the plain resident kernel's instances for them):
  // smoothing alone with the z-loss, both with an upstream gradient, out of place.
  Case smooth = plain;
  smooth.eps = 0.1;
  smooth.z = 1e-4;
  Case smooth_arg = sep;
  smooth_arg.eps = 0.1;
  smooth_arg.grad_output = true;
  // The softcap alone (its plain resident instance for 16-bit logits), with the z-loss and an
  // upstream gradient out of place.
  Case cap = plain;
  cap.cap = 30;
  Case cap_sep = plain_sep;
  cap_sep.cap = 30;
  cap_sep.z = 1e-4;
  std::vector<Case> cases{base, all, token, sep, loss_only, plain, smooth, smooth_arg, cap, cap_sep};
  if (with_plain_sep) cases.push_back(plain_sep);
  cases.push_back(plain_loss);
  return cases;
}

}  // namespace

// 7 columns take the row kernel's single elements, 1000 its vectors, 32000 the resident kernels
// (clusters of 2 blocks; 4 in fp32). Sanitizer-sized: the same vocabularies over 100 and 32 rows
// (300 and 64).
TEST_CASE("cross_entropy: each option alone and all combined, every dtype", "[ce][gpu]") {
  const bool small = gpu_test::sanitizer_sized();
  for (std::int64_t V : {std::int64_t{7}, std::int64_t{1000}, std::int64_t{32000}}) {
    const std::int64_t rows = V == 32000 ? (small ? 32 : 64) : (small ? 100 : 300);
    const Case base{.rows = rows, .V = V};
    std::vector<Case> cases = {base};
    cases.push_back(Case{base}), cases.back().eps = 0.1;
    cases.push_back(Case{base}), cases.back().z = 1e-4;
    cases.push_back(Case{base}), cases.back().cap = 30;
    cases.push_back(Case{base}), cases.back().weights = true;
    // z-loss with class weights: the mean divides the z part by the token count, unweighted.
    cases.push_back(Case{base}), cases.back().weights = true, cases.back().z = 1e-2;
    cases.push_back(Case{base}), cases.back().red = Reduction::sum;
    cases.push_back(Case{base}), cases.back().red = Reduction::none, cases.back().grad_output = true;
    cases.push_back(Case{base}), cases.back().grad_scale = 0.25f, cases.back().grad_output = true;
    cases.push_back(Case{base}), cases.back().in_place = false, cases.back().pad = 8;
    cases.push_back(Case{base}), cases.back().grad = false;
    cases.push_back(Case{base}), cases.back().token = true;
    Case all{.rows = rows, .V = V, .eps = 0.1, .z = 1e-4, .cap = 30, .weights = true, .grad_scale = 0.5f,
             .grad_output = true};
    cases.push_back(all);
    all.red = Reduction::none;
    cases.push_back(all);
    all.token = true;  // token scaling with every option, reduction none
    cases.push_back(all);
    all.red = Reduction::mean;
    cases.push_back(all);
    // Smoothing with class weights, the weights read 16 bytes at a time and, off a 16-byte
    // boundary, one float at a time; with a gradient and for the loss alone.
    for (const bool unaligned : {false, true}) {
      for (const bool grad : {true, false}) {
        Case sw{.rows = rows, .V = V, .eps = 0.1, .weights = true, .grad = grad};
        sw.unaligned_weights = unaligned;
        cases.push_back(sw);
      }
      all.unaligned_weights = unaligned;
      cases.push_back(all);
    }
    all.unaligned_weights = false;
    // Every target weighing 0 under the mean: the cross-entropy part and its gradient are 0, the
    // z-loss's remain (with smoothing, the softcap and token scaling too).
    for (const double z : {0.0, 1e-2}) {
      Case zw{.rows = rows, .V = V, .eps = 0.1, .z = z, .weights = true};
      zw.zero_target_weights = true;
      cases.push_back(zw);
      Case zall = all;
      zall.z = z;
      zall.zero_target_weights = true;
      cases.push_back(zall);
    }
    for (Case c : cases) {
      // At 32000 columns also without the argmax: the cases without other options then take the
      // row kernel's plain instance.
      for (const bool arg : {true, false}) {
        if (!arg && V != 32000) continue;
        c.argmax = arg;
        run_case<bf16>(c);
        run_case<float>(c);
        run_case<half, std::int32_t>(c);
      }
    }
  }
}

TEST_CASE("cross_entropy: every policy computes the same function", "[ce][gpu]") {
  for (std::int64_t V : {std::int64_t{1000}, std::int64_t{32000}, std::int64_t{128256}}) {
    const std::int64_t rows = V == 128256 ? 16 : 100;
    for (const Case& c : option_cases(rows, V, true)) {
      run_case<bf16, std::int64_t, tigon::CrossEntropyPolicy>(c);
      run_case<bf16, std::int64_t, RowsOnly>(c);  // 512-thread gradient blocks at 128256 columns
      run_case<bf16, std::int64_t, RowsWide>(c);
      run_case<half, std::int32_t, RowsNarrow>(c);
      run_case<float, std::int64_t, RowsOnly>(c);
      if (!c.grad) {
        run_case<bf16, std::int64_t, StreamSmall>(c);
        run_case<half, std::int32_t, StreamSmall>(c);
        run_case<float, std::int64_t, StreamSmall>(c);
      }
    }
  }
}

// The resident kernels (plain and optioned) on their own, so that the sanitizers can take them
// alone: the policy case's options at rows that fit one block (1000 and 8192 columns: the row
// kernel), rows held in 2 (20000 and 32000), 5 (40000, 128 threads x 8 vectors: uneven cluster),
// 8 (128256) and 16 (262144: beyond the portable cluster size) blocks, and 262144 fp32 logits with
// 256 x 8 (32 blocks: over the cluster limit, the row kernel). Sanitizer-sized: 1000, 8192, 40000
// and 262144 columns, which keep the row kernel, one block a row, clusters of 3 to 5 blocks (uneven
// with 128 threads) and of 16, and fp32's row kernel past the cluster limit (with its wide gradient
// blocks); 20000 and 32000 (clusters of 2 to 4) and 128256 (8; 16 in fp32) are left out.
TEST_CASE("cross_entropy: the resident kernels compute the same function", "[ce][gpu]") {
  const auto vocabs = gpu_test::sanitizer_sized()
                          ? std::vector<std::int64_t>{1000, 8192, 40000, 262144}
                          : std::vector<std::int64_t>{1000, 8192, 20000, 32000, 40000, 128256, 262144};
  for (const std::int64_t V : vocabs) {
    const std::int64_t rows = V >= 128256 ? 12 : 40;
    for (const Case& c : option_cases(rows, V, true)) {
      run_case<bf16, std::int64_t, ResPolicy<256, 8, 1>>(c);
      run_case<half, std::int32_t, ResPolicy<128, 16, 4>>(c);
      run_case<float, std::int64_t, ResPolicy<256, 8, 4, 3>>(c);  // slices of the row 3 on prefetched
      if (V == 40000) run_case<bf16, std::int32_t, ResPolicy<128, 8, 1>>(c);
    }
  }
}

TEST_CASE("cross_entropy: the issue's shapes", "[ce][gpu][large]") {
  run_case<bf16>({.rows = 8192, .V = 32000, .argmax = false});
  run_case<bf16>({.rows = 8192, .V = 32000});
  run_case<bf16, std::int32_t>({.rows = 1269, .V = 32000, .eps = 0.1});
  run_case<bf16>({.rows = 256, .V = 128256, .z = 1e-4, .argmax = false});
  run_case<bf16>({.rows = 2, .V = 262144, .cap = 30});
  run_case<bf16>({.rows = 256, .V = 128256, .cap = 30, .argmax = false});
  run_case<half, std::int32_t>({.rows = 64, .V = 256000, .cap = 30, .argmax = false});
  run_case<float>({.rows = 64, .V = 128256, .weights = true});
  run_case<bf16>({.rows = 512, .V = 128256, .eps = 0.1, .weights = true});
  run_case<bf16>({.rows = 512, .V = 256000, .cap = 30});
}

namespace {

template <class P>
void check_ignored_and_bad(std::int64_t V) {
  INFO("V " << V);
  const std::int64_t rows = 16;
  DeviceBuffer<bf16> x(rows * V);
  x.upload(gpu_test::random_values<bf16>(rows * V, 0, 1, nullptr));
  std::vector<std::int64_t> t(rows, -100);
  DeviceBuffer<std::int64_t> tb(rows);
  tb.upload(t);
  DeviceBuffer<float> loss(1), lr(rows);
  DeviceBuffer<int> errs(1);
  DeviceBuffer<unsigned char> ws(ws_bytes(rows));
  CUDA_OK(cudaMemset(errs.ptr, 0, sizeof(int)));
  CrossEntropyArgs<bf16> a{.logits = x.ptr, .targets = tb.ptr, .rows = rows, .vocab = V, .dlogits = x.ptr,
                           .loss = loss.ptr, .loss_rows = lr.ptr, .error_count = errs.ptr,
                           .workspace = ws.ptr, .workspace_bytes = ws.count};
  TIGON_OK(cross_entropy<P>(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(loss.download()[0] == 0.0f);
  const auto g0 = x.download();
  CHECK(std::count_if(g0.begin(), g0.end(), [](bf16 g) { return to_float(g) != 0.0f; }) == 0);
  // Two bad targets: counted, their rows' loss NaN, no out-of-bounds access (compute-sanitizer).
  x.upload(gpu_test::random_values<bf16>(rows * V, 0, 1, nullptr));
  t.assign(rows, 5);
  t[3] = V;
  t[7] = -7;
  tb.upload(t);
  TIGON_OK(cross_entropy<P>(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(errs.download()[0] == 2);
  const auto l = lr.download();
  CHECK(std::isnan(l[3]));
  CHECK(std::isnan(l[7]));
  CHECK(std::isfinite(l[0]));
  CHECK(std::isnan(loss.download()[0]));
  // The host-side check of the counter: an error naming the count, the vocabulary and
  // ignore_index, and the counter zeroed; then a clean call passes it.
  const Status st = check_target_errors(errs.ptr, V, -100, nullptr);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::invalid_value);
  CHECK(st.message().find("2 row(s)") != std::string::npos);
  CHECK(st.message().find("[0, " + std::to_string(V) + ")") != std::string::npos);
  CHECK(st.message().find("-100") != std::string::npos);
  CHECK(errs.download()[0] == 0);
  t.assign(rows, 5);
  tb.upload(t);
  TIGON_OK(cross_entropy<P>(a, nullptr));
  TIGON_OK(check_target_errors(errs.ptr, V, -100, nullptr));
}

}  // namespace

TEST_CASE("cross_entropy: all ignored gives 0 and a zero gradient; bad targets are counted", "[ce][gpu]") {
  // V 100 and 20000 on the row kernel and the default's resident kernel; V 40000 on a resident
  // kernel of 5 blocks per row
  check_ignored_and_bad<RowsOnly>(100);
  check_ignored_and_bad<RowsOnly>(20000);
  check_ignored_and_bad<tigon::CrossEntropyPolicy>(20000);
  check_ignored_and_bad<ResPolicy<128, 8, 1>>(40000);
}

namespace {

template <class P>
void check_graph(float eps) {
  INFO("eps " << eps);
  const std::int64_t rows = 512, V = 32000;
  DeviceBuffer<bf16> x(rows * V), x0(rows * V);
  const auto xh = gpu_test::random_values<bf16>(rows * V, 0, 2, nullptr);
  std::vector<std::int64_t> t(rows);
  for (std::int64_t r = 0; r < rows; ++r) t[r] = (r * 7919) % V;
  DeviceBuffer<std::int64_t> tb(rows);
  tb.upload(t);
  DeviceBuffer<float> loss(1);
  DeviceBuffer<unsigned char> ws(ws_bytes(rows));
  CrossEntropyArgs<bf16> a{.logits = x.ptr, .targets = tb.ptr, .rows = rows, .vocab = V, .dlogits = x.ptr,
                           .label_smoothing = eps, .loss = loss.ptr, .workspace = ws.ptr,
                           .workspace_bytes = ws.count};
  x.upload(xh);
  TIGON_OK(cross_entropy<P>(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto g1 = x.download();
  const float l1 = loss.download()[0];
  x.upload(xh);
  loss.poison();
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  TIGON_OK(cross_entropy<P>(a, s));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    x.upload(xh);
    loss.poison();
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CHECK(std::memcmp(g1.data(), x.download().data(), g1.size() * sizeof(bf16)) == 0);
    CHECK(loss.download()[0] == l1);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace

TEST_CASE("cross_entropy: graph capture matches eager bitwise", "[ce][gpu][graph]") {
  // the row kernel, and the default's plain and optioned resident kernels (clusters), with and
  // without label smoothing, each replayed twice
  check_graph<RowsOnly>(0.1f);
  check_graph<RowsOnly>(0.0f);
  check_graph<tigon::CrossEntropyPolicy>(0.0f);
  check_graph<tigon::CrossEntropyPolicy>(0.1f);
}

namespace {

// The split path over the shards [cuts[k], cuts[k + 1]) against the unsplit op.
template <class T>
void check_split(std::int64_t rows, std::int64_t V, const std::vector<std::int64_t>& cuts, float eps, float cap,
                 double grad_tol) {
  INFO("V " << V << " shards " << cuts.size() - 1 << " eps " << eps << " cap " << cap);
  const int shards = static_cast<int>(cuts.size()) - 1;
  const auto xh = gpu_test::random_values<T>(rows * V, 0, 2, nullptr);
  std::vector<std::int64_t> t(rows);
  for (std::int64_t r = 0; r < rows; ++r) t[r] = r % 11 == 0 ? -100 : (r * 7919) % V;
  t[5] = cuts[1];  // the second shard's first column
  DeviceBuffer<T> x(rows * V), xs(rows * V);
  DeviceBuffer<float> loss(1), loss_split(1), lr(rows), lr_split(rows);
  DeviceBuffer<std::int64_t> tb(rows), am(rows), am_split(rows);
  DeviceBuffer<unsigned char> ws(ws_bytes(rows));
  DeviceBuffer<CrossEntropyStats> stats(shards * rows), merged(rows);
  x.upload(xh);
  xs.upload(xh);
  tb.upload(t);
  CrossEntropyArgs<T> a{.logits = x.ptr, .targets = tb.ptr, .rows = rows, .vocab = V, .dlogits = x.ptr,
                            .label_smoothing = eps, .z_loss_scale = 1e-4f, .softcap = cap, .loss = loss.ptr,
                            .loss_rows = lr.ptr, .argmax = am.ptr, .workspace = ws.ptr,
                            .workspace_bytes = ws.count};
  TIGON_OK(cross_entropy(a, nullptr));
  for (int k = 0; k < shards; ++k) {
    CrossEntropyArgs<T> sa = a;
    sa.logits = xs.ptr + cuts[k];
    sa.dlogits = nullptr;
    sa.vocab = cuts[k + 1] - cuts[k];
    sa.logits_stride = V;
    TIGON_OK(cross_entropy_shard_stats(sa, cuts[k], V, stats.ptr + k * rows, nullptr));
  }
  TIGON_OK(cross_entropy_merge_stats(stats.ptr, shards, rows, merged.ptr, nullptr));
  for (int k = 0; k < shards; ++k) {
    CrossEntropyArgs<T> sa = a;
    sa.logits = xs.ptr + cuts[k];
    sa.dlogits = xs.ptr + cuts[k];
    sa.vocab = cuts[k + 1] - cuts[k];
    sa.logits_stride = sa.dlogits_stride = V;
    sa.loss = loss_split.ptr;
    sa.loss_rows = lr_split.ptr;
    sa.argmax = am_split.ptr;
    TIGON_OK(cross_entropy_shard_finalize(sa, cuts[k], V, merged.ptr, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  const float l = loss.download()[0], ls = loss_split.download()[0];
  CHECK(std::abs(l - ls) <= 1e-5f * (1 + std::abs(l)));
  const auto r1 = lr.download(), r2 = lr_split.download();
  for (std::int64_t r = 0; r < rows; ++r) CHECK(std::abs(r1[r] - r2[r]) <= 1e-5f * (1 + std::abs(r1[r])));
  CHECK(am.download() == am_split.download());
  const auto g1 = x.download(), g2 = xs.download();
  double worst = 0;
  for (std::size_t i = 0; i < g1.size(); ++i) {
    worst = std::max(worst, std::abs(double(to_float(g1[i])) - double(to_float(g2[i]))));
  }
  CHECK(worst < grad_tol);
}

}  // namespace

TEST_CASE("cross_entropy: split vocabulary equals the unsplit op", "[ce][gpu]") {
  // three uneven shards, one of width 1 (the row kernel), the others 16-byte aligned (resident)
  check_split<float>(300, 10000, {0, 3000, 3001, 10000}, 0.05f, 0.0f, 1e-7);
  check_split<float>(300, 10000, {0, 4000, 10000}, 0.0f, 30.0f, 1e-7);
  // LLaMA-3's vocabulary over two shards of 64128 columns
  check_split<bf16>(64, 128256, {0, 64128, 128256}, 0.1f, 0.0f, 1e-4);
  // LLaMA-2's over two shards with smoothing and Gemma's softcap (half: its hardware tanh)
  check_split<bf16>(64, 32000, {0, 16000, 32000}, 0.1f, 30.0f, 1e-4);
  check_split<half>(64, 32000, {0, 16000, 32000}, 0.1f, 30.0f, 1e-4);
}
