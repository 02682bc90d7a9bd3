// Gated activations on the GPU against the double-precision reference: every activation (the three
// built-ins and a user-defined functor) x dtype x shape, multipliers, strided rows, the fused
// gate||up layout, misaligned pointers, in place; outputs poisoned first and every element outside
// the outputs checked untouched; CUDA-graph capture; invalid calls write nothing; the ungated
// activation (squared ReLU, SiLU, GELU) forward and backward.
#include "gpu_test.cuh"

#include <algorithm>
#include <limits>
#include <map>
#include <type_traits>

#include <tigon/activation/gated.cuh>

#include "../reference/gated_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;
using tigon_ref::GatedAct;

// A user activation with only the two required functions: squared ReLU (Primer). At namespace
// scope with external linkage (a kernel instantiated on a type of an anonymous namespace cannot
// carry tigon's hidden visibility; nvcc warns, #1407).
namespace gated_test {
struct SquaredRelu {
  static __host__ __device__ float value(float a) { return a > 0.0f ? a * a : 0.0f; }
  static __host__ __device__ float derivative(float a) { return a > 0.0f ? 2.0f * a : 0.0f; }
};
}  // namespace gated_test
using gated_test::SquaredRelu;

namespace {

// The reference of each activation, in double.
template <class Act>
struct Ref {
  static constexpr GatedAct kind = std::is_same_v<Act, Silu>       ? GatedAct::silu
                                   : std::is_same_v<Act, GeluTanh> ? GatedAct::gelu_tanh
                                                                   : GatedAct::gelu_erf;
  static double value(double x) { return tigon_ref::act_value(kind, x); }
  static double derivative(double x) { return tigon_ref::act_derivative(kind, x); }
  static const char* name() {
    return kind == GatedAct::silu ? "silu (swiglu_*)" : kind == GatedAct::gelu_tanh ? "gelu tanh (geglu_*)" : "gelu erf";
  }
};
template <>
struct Ref<SquaredRelu> {
  static double value(double x) { return x > 0 ? x * x : 0.0; }
  static double derivative(double x) { return x > 0 ? 2 * x : 0.0; }
  static const char* name() { return "user: squared relu"; }
};

// Each activation through its public name: swiglu_* for Silu, geglu_* for GeluTanh, the templates
// for the others; a policy other than DefaultPolicies through the templates.
struct DefaultPolicies {};
template <class Act, class P, class T>
Status call_forward(const GatedForwardArgs<T>& a, cudaStream_t s) {
  if constexpr (!std::is_same_v<P, DefaultPolicies>) return gated_forward<Act, P>(a, s);
  else if constexpr (std::is_same_v<Act, Silu>) return swiglu_forward(a, s);
  else if constexpr (std::is_same_v<Act, GeluTanh>) return geglu_forward(a, s);
  else return gated_forward<Act>(a, s);
}
template <class Act, class P, class T>
Status call_backward(const GatedBackwardArgs<T>& a, cudaStream_t s) {
  if constexpr (!std::is_same_v<P, DefaultPolicies>) return gated_backward<Act, P>(a, s);
  else if constexpr (std::is_same_v<Act, Silu>) return swiglu_backward(a, s);
  else if constexpr (std::is_same_v<Act, GeluTanh>) return geglu_backward(a, s);
  else return gated_backward<Act>(a, s);
}

struct Case {
  std::int64_t rows = 1, cols = 1;
  std::int64_t pad = 0;       // extra elements at the end of every row (row stride = width + pad)
  std::int64_t misalign = 0;  // elements every base pointer is shifted by
  bool fused = false;         // a, b halves of one [rows, 2 cols] buffer; da, db likewise
  bool in_place = false;      // forward: c over a (or b); backward: da over a, db over b
  bool c_over_b = false;      // with in_place: the forward writes c over b
  float gate = 1.0f, down = 1.0f;
  int expect_vec = -1;        // 1: the 16-byte kernel must be chosen, 0: the scalar one, -1: either
};

std::string describe(const Case& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.cols) + " pad " + std::to_string(c.pad) +
         " misalign " + std::to_string(c.misalign) + (c.fused ? " fused" : " separate") +
         (c.in_place ? (c.c_over_b ? " in-place (c over b)" : " in-place") : "") + " gate " +
         std::to_string(c.gate) + " down " + std::to_string(c.down);
}

// Per element, |out - ref| <= rtol * |ref| + kAbs * scale + floor:
//  - rtol: the rounding to T (half an ulp, with a margin for an fp32 error that flips it), twice
//    for 16-bit types: an fp32 error can also flip the intermediate's rounding (act(gate * a), or
//    dc * b), which the reference rounds too;
//  - kAbs * scale: the activation's fp32 error, absolute in the size of its terms (1 + tanh and
//    1 + erf cancel for negative inputs), scaled by the factors that multiply it;
//  - floor: half's subnormal spacing.
template <class T>
double rtol() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, half>) return 0x1p-9;
  return 0x1p-6;
}
template <class T>
double floor_abs() {
  return std::is_same_v<T, half> ? 0x1p-24 : 1e-37;
}
template <class T>
double tol_l2() {
  if constexpr (std::is_same_v<T, float>) return 4e-6;  // erff / tanhf / expf: a few ulp
  if constexpr (std::is_same_v<T, half>) return 5e-4;
  return 4e-3;
}
constexpr double kAbs = 2e-6;

// gpu_test::compare with a per-element absolute bound; NaN and Inf never pass.
template <class Get>
gpu_test::Compare compare_scaled(std::size_t n, Get&& get_out, const std::vector<double>& ref,
                                 const std::vector<double>& scale, double rtol, double floor) {
  gpu_test::Compare c;
  c.n = n;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double o = get_out(i), r = ref[i];
    const double err = std::abs(o - r);
    const double bound = rtol * std::abs(r) + kAbs * scale[i] + floor;
    const bool good = std::isfinite(o) && err <= bound;
    if (!good) ++c.bad;
    const double score = std::isfinite(o) ? err / bound : INFINITY;
    if (score > c.worst_err || (!good && c.bad == 1)) {
      c.worst_err = score;
      c.worst = i;
    }
    num += std::isfinite(o) ? err * err : INFINITY;
    den += r * r;
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

// One [rows, cols] matrix inside a device buffer.
template <class T>
struct Mat {
  DeviceBuffer<T>* buf = nullptr;
  std::int64_t off = 0, stride = 0;
  T* ptr() const { return buf->ptr + off; }
  std::size_t at(std::size_t i, std::int64_t cols) const {
    return static_cast<std::size_t>(off + static_cast<std::int64_t>(i) / cols * stride +
                                    static_cast<std::int64_t>(i) % cols);
  }
};

template <class T>
std::vector<double> dense(const std::vector<T>& h, const Mat<T>& m, std::int64_t rows, std::int64_t cols) {
  std::vector<double> d(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = to_float(h[m.at(i, cols)]);
  return d;
}

// The per-element bound (relative plus an absolute term on the inputs' scale) always applies; the
// relative L2 bound from kMinL2Elems elements on. Below that the L2 error is one or a few elements'
// relative error, which near the activations' tails carries float cancellation the per-element
// bound allows: a 1x1 float GELU (erf) output of 2.41e-3 came out with relative error 1.3e-5 against
// the 4e-6 L2 bound while inside its element bound (score 0.002), from fresh random inputs.
constexpr std::size_t kMinL2Elems = 64;

#define CHECK_CLOSE(cmp, what, l2, ref)                                                          \
  do {                                                                                           \
    INFO(what << ": " << (cmp).bad << " of " << (cmp).n << " elements out of tolerance, worst #" \
              << (cmp).worst << " (score " << (cmp).worst_err << ", reference "                 \
              << (ref)[(cmp).worst] << "), rel L2 " << (cmp).rel_l2);                            \
    CHECK((cmp).ok(l2, kMinL2Elems));                                                            \
  } while (0)

// The buffers a call writes, downloaded before and after: the outputs are compared with the
// reference, every other element must be bitwise unchanged (padding, the misaligned head, the other
// half of a fused buffer).
template <class T>
struct Written {
  std::map<DeviceBuffer<T>*, std::vector<T>> before, after;
  void snapshot_before(std::initializer_list<Mat<T>> outs) {
    for (const auto& m : outs) before[m.buf] = m.buf->download();
  }
  void snapshot_after() {
    for (auto& [buf, v] : before) after[buf] = buf->download();
  }
  const std::vector<T>& of(const Mat<T>& m) { return after.at(m.buf); }
  void check_untouched(std::initializer_list<Mat<T>> outs, std::int64_t rows, std::int64_t cols) {
    for (auto& [buf, b] : before) {
      std::vector<char> mask(b.size(), 0);
      for (const auto& m : outs)
        if (m.buf == buf)
          for (std::size_t i = 0; i < static_cast<std::size_t>(rows * cols); ++i) mask[m.at(i, cols)] = 1;
      const auto& a = after.at(buf);
      std::size_t changed = 0, first = 0;
      for (std::size_t i = 0; i < b.size(); ++i) {
        if (!mask[i] && std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && changed++ == 0) first = i;
      }
      INFO(changed << " elements outside the outputs changed, first at " << first);
      CHECK(changed == 0);
    }
  }
};

template <class P>
std::string policy_name() {
  if constexpr (std::is_same_v<P, DefaultPolicies>) {
    return "default policies";
  } else {
    return "policy: flat grid of " + std::to_string(P::kFlat) + " vectors per thread";
  }
}

template <class T, class Act, class P = DefaultPolicies>
void run_case(const Case& c) {
  INFO(Ref<Act>::name() << " T=" << dtype_traits<T>::name << " " << describe(c) << " "
                        << policy_name<P>());
  const std::int64_t rows = c.rows, cols = c.cols, off = c.misalign;
  const std::int64_t ld = cols + c.pad;       // separate tensors (and dc, c)
  const std::int64_t fld = 2 * cols + c.pad;  // fused buffers
  const std::size_t n_sep = static_cast<std::size_t>(rows * ld + off);
  const std::size_t n_fused = static_cast<std::size_t>(rows * fld + off);

  DeviceBuffer<T> A(c.fused ? 1 : n_sep), B(c.fused ? 1 : n_sep), G(c.fused ? n_fused : 1);
  DeviceBuffer<T> DC(n_sep), C(n_sep), DA(c.fused ? 1 : n_sep), DB(c.fused ? 1 : n_sep),
      DG(c.fused ? n_fused : 1);
  const Mat<T> a = c.fused ? Mat<T>{&G, off, fld} : Mat<T>{&A, off, ld};
  const Mat<T> b = c.fused ? Mat<T>{&G, off + cols, fld} : Mat<T>{&B, off, ld};
  const Mat<T> dc{&DC, off, ld};
  const Mat<T> out_c = c.in_place ? (c.c_over_b ? b : a) : Mat<T>{&C, off, ld};
  const Mat<T> da = c.in_place ? a : (c.fused ? Mat<T>{&DG, off, fld} : Mat<T>{&DA, off, ld});
  const Mat<T> db = c.in_place ? b : (c.fused ? Mat<T>{&DG, off + cols, fld} : Mat<T>{&DB, off, ld});

  // Fresh random inputs (gate inputs spread over the activations' curved range).
  std::vector<T> ah, bh, gh;
  if (c.fused) {
    gh = gpu_test::random_values<T>(n_fused, 0.0, 2.0, nullptr);
  } else {
    ah = gpu_test::random_values<T>(n_sep, 0.0, 2.0, nullptr);
    bh = gpu_test::random_values<T>(n_sep, 0.0, 1.0, nullptr);
  }
  const auto dch = gpu_test::random_values<T>(n_sep, 0.0, 1.0, nullptr);
  auto upload_inputs = [&] {
    if (c.fused) {
      G.upload(gh);
    } else {
      A.upload(ah);
      B.upload(bh);
    }
    DC.upload(dch);
  };
  const auto ad = dense(c.fused ? gh : ah, a, rows, cols);
  const auto bd = dense(c.fused ? gh : bh, b, rows, cols);
  const auto dcd = dense(dch, dc, rows, cols);

  // ---- forward ----
  upload_inputs();
  C.poison();
  const GatedForwardArgs<T> fa{.a = a.ptr(), .b = b.ptr(), .c = out_c.ptr(), .rows = rows, .cols = cols,
                               .a_stride = a.stride, .b_stride = b.stride, .c_stride = out_c.stride,
                               .gate_multiplier = c.gate, .down_multiplier = c.down};
  const bool fvec = detail::gated_vectorizable<T, kVecElems<T>>(detail::gated_fwd_params(fa));
  INFO("forward kernel: " << (fvec ? "16-byte vectors" : "scalar"));
  if (c.expect_vec >= 0) CHECK(fvec == (c.expect_vec == 1));
  Written<T> wf;
  wf.snapshot_before({out_c});
  TIGON_OK((call_forward<Act, P>(fa, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  wf.snapshot_after();
  // The intermediates rounded to T as the kernels (and a Hugging Face module of dtype T) round them.
  const auto round_t = [](double v) { return static_cast<double>(round_to<T>(static_cast<float>(v))); };
  const auto cref = tigon_ref::gated_forward(ad, bd, rows, cols, c.gate, c.down, Ref<Act>::value, round_t);
  // Sizes of the terms that multiply the activation's fp32 error.
  std::vector<double> s_value(cref.size()), s_da(cref.size()), s_db(cref.size());
  for (std::size_t i = 0; i < cref.size(); ++i) {
    const double x = std::abs(static_cast<double>(c.gate) * ad[i]);
    s_value[i] = std::abs(c.down * bd[i]) * std::max(1.0, x);
    s_da[i] = std::abs(dcd[i] * bd[i] * c.down * c.gate) * std::max(1.0, x * x);
    s_db[i] = std::abs(dcd[i] * c.down) * std::max(1.0, x);
  }
  {
    const auto& h = wf.of(out_c);
    const auto cmp = compare_scaled(
        cref.size(), [&](std::size_t i) { return static_cast<double>(to_float(h[out_c.at(i, cols)])); },
        cref, s_value, rtol<T>(), floor_abs<T>());
    CHECK_CLOSE(cmp, "c", tol_l2<T>(), cref);
  }
  wf.check_untouched({out_c}, rows, cols);

  // ---- backward ----
  upload_inputs();  // an in-place forward overwrote a or b
  DA.poison();
  DB.poison();
  DG.poison();
  const GatedBackwardArgs<T> ba{.dc = dc.ptr(), .a = a.ptr(), .b = b.ptr(), .da = da.ptr(), .db = db.ptr(),
                                .rows = rows, .cols = cols, .dc_stride = dc.stride, .a_stride = a.stride,
                                .b_stride = b.stride, .da_stride = da.stride, .db_stride = db.stride,
                                .gate_multiplier = c.gate, .down_multiplier = c.down};
  const bool bvec = detail::gated_vectorizable<T, kVecElems<T>>(detail::gated_bwd_params(ba));
  INFO("backward kernel: " << (bvec ? "16-byte vectors" : "scalar"));
  if (c.expect_vec >= 0) CHECK(bvec == (c.expect_vec == 1));
  Written<T> wb;
  wb.snapshot_before({da, db});
  TIGON_OK((call_backward<Act, P>(ba, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  wb.snapshot_after();
  const auto g = tigon_ref::gated_backward(dcd, ad, bd, rows, cols, c.gate, c.down, Ref<Act>::value,
                                           Ref<Act>::derivative, round_t);
  {
    const auto& h = wb.of(da);
    const auto cmp = compare_scaled(
        g.da.size(), [&](std::size_t i) { return static_cast<double>(to_float(h[da.at(i, cols)])); },
        g.da, s_da, rtol<T>(), floor_abs<T>());
    CHECK_CLOSE(cmp, "da", tol_l2<T>(), g.da);
  }
  {
    const auto& h = wb.of(db);
    const auto cmp = compare_scaled(
        g.db.size(), [&](std::size_t i) { return static_cast<double>(to_float(h[db.at(i, cols)])); },
        g.db, s_db, rtol<T>(), floor_abs<T>());
    CHECK_CLOSE(cmp, "db", tol_l2<T>(), g.db);
  }
  wb.check_untouched({da, db}, rows, cols);
}

template <class T>
void run_acts(const Case& c) {
  run_case<T, Silu>(c);
  run_case<T, GeluTanh>(c);
  run_case<T, GeluErf>(c);
  run_case<T, SquaredRelu>(c);
}

template <class Act>
void run_dtypes(const Case& c) {
  run_case<bf16, Act>(c);
  run_case<half, Act>(c);
  run_case<float, Act>(c);
}

const std::vector<std::pair<std::int64_t, std::int64_t>> kShapes = {
    {1, 1},     {7, 1},     {3, 2},                 // tiny
    {1, 123},   {65, 123},  {64, 1001}, {37, 4100},  // not a multiple of the vector width
    {3, 64},    {256, 1024}, {33, 4096},             // multiples: the vector kernel
    {1, 14336}, {9, 14336}, {4, 28672},              // LLM intermediate sizes, one row and a few
};

}  // namespace

TEST_CASE("gated: every activation x dtype x shape against the reference", "[gated][gpu]") {
  for (const auto& [rows, cols] : kShapes) {
    const Case c{.rows = rows, .cols = cols};
    run_acts<bf16>(c);
    run_acts<half>(c);
    run_acts<float>(c);
  }
}

TEST_CASE("gated: options", "[gated][gpu]") {
  SECTION("multipliers") {
    for (auto cols : {std::int64_t{123}, std::int64_t{4096}}) {
      run_acts<bf16>({.rows = 19, .cols = cols, .gate = 0.5f, .down = 2.0f});
      run_acts<float>({.rows = 19, .cols = cols, .gate = -1.25f, .down = 0.75f});
      run_dtypes<Silu>({.rows = 19, .cols = cols, .gate = 0.3f, .down = 1.7f});
    }
  }
  SECTION("strided rows, vector-aligned stride") {
    run_acts<bf16>({.rows = 29, .cols = 4096, .pad = 64, .expect_vec = 1});
    run_case<float, Silu>({.rows = 29, .cols = 4096, .pad = 4, .expect_vec = 1});
    run_case<half, GeluTanh>({.rows = 29, .cols = 1024, .pad = 8, .expect_vec = 1});
  }
  SECTION("strided rows, unaligned stride") {
    run_acts<bf16>({.rows = 29, .cols = 4096, .pad = 3, .expect_vec = 0});
    run_case<half, Silu>({.rows = 29, .cols = 1001, .pad = 1, .expect_vec = 0});
    run_case<float, GeluErf>({.rows = 29, .cols = 4096, .pad = 2, .expect_vec = 0});
  }
  SECTION("misaligned pointers") {
    run_acts<bf16>({.rows = 29, .cols = 4096, .misalign = 1, .expect_vec = 0});
    run_case<float, Silu>({.rows = 29, .cols = 4096, .misalign = 3, .expect_vec = 0});
    run_case<half, GeluTanh>({.rows = 29, .cols = 123, .misalign = 1, .expect_vec = 0});
    // 16 bytes of shift keep every pointer 16-byte aligned: still the vector kernel.
    run_case<bf16, Silu>({.rows = 29, .cols = 4096, .misalign = 8, .expect_vec = 1});
  }
  SECTION("fused gate||up layout") {
    run_acts<bf16>({.rows = 31, .cols = 4096, .fused = true, .expect_vec = 1});
    run_acts<bf16>({.rows = 31, .cols = 1001, .fused = true, .expect_vec = 0});
    run_dtypes<Silu>({.rows = 7, .cols = 14336, .fused = true});
    run_case<float, GeluTanh>({.rows = 31, .cols = 4096, .pad = 64, .fused = true, .expect_vec = 1});
    run_case<bf16, Silu>({.rows = 31, .cols = 4096, .misalign = 1, .fused = true, .expect_vec = 0});
    run_case<bf16, GeluErf>({.rows = 31, .cols = 4096, .fused = true, .gate = 0.5f, .down = 2.0f});
  }
  SECTION("in place") {
    run_acts<bf16>({.rows = 23, .cols = 4096, .in_place = true, .expect_vec = 1});
    run_acts<bf16>({.rows = 23, .cols = 123, .in_place = true, .expect_vec = 0});
    run_case<float, Silu>({.rows = 23, .cols = 4096, .in_place = true, .c_over_b = true});
    run_case<half, GeluTanh>({.rows = 23, .cols = 1001, .in_place = true, .c_over_b = true});
    // In place over the fused buffer: c over the gate half; da, db over the two halves.
    run_dtypes<Silu>({.rows = 23, .cols = 14336, .fused = true, .in_place = true});
    run_case<bf16, GeluTanh>({.rows = 23, .cols = 1001, .fused = true, .in_place = true, .gate = 0.5f});
    run_case<bf16, SquaredRelu>({.rows = 23, .cols = 4096, .pad = 8, .fused = true, .in_place = true,
                                 .c_over_b = true});
  }
}

// Flat-grid sizes other than the default's two vectors per thread (forward only; strided rows
// and the backward take the row grid whatever the policy).
struct Flat1 : GatedPolicy {
  static constexpr int kFlat = 1;
};
struct Flat4 : GatedPolicy {
  static constexpr int kFlat = 4;
};
struct Flat8 : GatedPolicy {
  static constexpr int kFlat = 8;
};

TEST_CASE("gated: other policies", "[gated][gpu]") {
  for (auto cols : {std::int64_t{123}, std::int64_t{4096}, std::int64_t{14336}}) {
    run_case<bf16, Silu, Flat1>({.rows = 17, .cols = cols});
    run_case<bf16, Silu, Flat1>({.rows = 17, .cols = cols, .pad = 8});  // strided: the row grid
    run_case<bf16, GeluTanh, Flat1>({.rows = 17, .cols = cols, .fused = true});
    run_case<float, GeluTanh, Flat4>({.rows = 17, .cols = cols, .fused = true, .in_place = true});
    run_case<half, Silu, Flat4>({.rows = 17, .cols = cols});
    run_case<half, GeluTanh, Flat4>({.rows = 17, .cols = cols, .in_place = true});
    run_case<float, GeluErf, Flat8>({.rows = 17, .cols = cols, .gate = 0.5f});
    run_case<bf16, SquaredRelu, Flat8>({.rows = 17, .cols = cols, .fused = true, .in_place = true});
  }
  run_case<bf16, Silu>({.rows = 3000, .cols = 8, .expect_vec = 1});  // backward: a row per thread
  run_case<bf16, Silu>({.rows = 3000, .cols = 8, .pad = 8});         // forward too (strided rows)
}

TEST_CASE("gated: large rows 14336 and 28672", "[gated][gpu][large]") {
  run_case<bf16, Silu>({.rows = 512, .cols = 14336, .expect_vec = 1});
  run_case<bf16, Silu>({.rows = 512, .cols = 14336, .fused = true, .expect_vec = 1});
  run_case<bf16, GeluTanh>({.rows = 256, .cols = 28672, .fused = true, .in_place = true});
  run_case<half, GeluErf>({.rows = 256, .cols = 28672, .gate = 0.5f, .down = 2.0f});
  run_case<float, Silu>({.rows = 128, .cols = 14336});
}

TEST_CASE("gated: forward + backward captured in a CUDA graph match eager bitwise", "[gated][gpu][graph]") {
  const std::int64_t rows = 1000, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  DeviceBuffer<bf16> gu(2 * n), c(n), dc(n), dgu(2 * n);
  gu.upload(gpu_test::random_values<bf16>(2 * n, 0, 2, nullptr));
  dc.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  const GatedForwardArgs<bf16> fa{.a = gu.ptr, .b = gu.ptr + cols, .c = c.ptr, .rows = rows, .cols = cols,
                                  .a_stride = 2 * cols, .b_stride = 2 * cols};
  const GatedBackwardArgs<bf16> ba{.dc = dc.ptr, .a = gu.ptr, .b = gu.ptr + cols, .da = dgu.ptr,
                                   .db = dgu.ptr + cols, .rows = rows, .cols = cols,
                                   .a_stride = 2 * cols, .b_stride = 2 * cols,
                                   .da_stride = 2 * cols, .db_stride = 2 * cols};
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TIGON_OK(swiglu_forward(fa, s));
  TIGON_OK(swiglu_backward(ba, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const auto c1 = c.download(), d1 = dgu.download();
  c.poison();
  dgu.poison();
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  TIGON_OK(swiglu_forward(fa, s));
  TIGON_OK(swiglu_backward(ba, s));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(std::memcmp(c1.data(), c.download().data(), n * sizeof(bf16)) == 0);
  CHECK(std::memcmp(d1.data(), dgu.download().data(), 2 * n * sizeof(bf16)) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_CASE("gated: an invalid call launches nothing and writes nothing", "[gated][gpu]") {
  const std::int64_t rows = 64, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  DeviceBuffer<bf16> a(n), b(n), c(n), dc(n), da(n), db(n);
  a.upload(gpu_test::random_values<bf16>(n, 0, 2, nullptr));
  b.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  dc.upload(gpu_test::random_values<bf16>(n, 0, 1, nullptr));
  c.poison();
  da.poison();
  db.poison();
  GatedForwardArgs<bf16> fa{.a = a.ptr, .b = b.ptr, .c = c.ptr, .rows = rows, .cols = cols,
                            .c_stride = cols - 1};
  CHECK(swiglu_forward(fa, nullptr).code() == Errc::invalid_stride);
  fa.c_stride = 0;
  fa.gate_multiplier = std::numeric_limits<float>::infinity();
  CHECK(geglu_forward(fa, nullptr).code() == Errc::invalid_value);
  GatedBackwardArgs<bf16> ba{.dc = dc.ptr, .a = a.ptr, .b = b.ptr, .da = da.ptr, .db = da.ptr + 8,
                             .rows = rows, .cols = cols};
  CHECK(swiglu_backward(ba, nullptr).code() == Errc::aliasing);
  ba.db = db.ptr;
  ba.down_multiplier = std::numeric_limits<float>::quiet_NaN();
  CHECK(gated_backward<GeluErf>(ba, nullptr).code() == Errc::invalid_value);
  CUDA_OK(cudaDeviceSynchronize());
  const auto ch = c.download(), dah = da.download(), dbh = db.download();
  CHECK(gpu_test::all_bytes_ff(ch.data(), n * sizeof(bf16)));
  CHECK(gpu_test::all_bytes_ff(dah.data(), n * sizeof(bf16)));
  CHECK(gpu_test::all_bytes_ff(dbh.data(), n * sizeof(bf16)));
}

namespace {

// The ungated activation (activation_forward / activation_backward) over [rows, cols] with row
// strides cols + pad and base pointers shifted by misalign elements, optionally in place (c over a,
// da over dc): every element against the host functor rounded to T (bitwise for the squared ReLU,
// whose fp32 math is exact up to its rounding; for the others the gated tests' per-element bound:
// the rounding to T plus kAbs of the terms' size, |a| for the value and |dc| (1 + |a|) for the
// gradient, since device and host expf / tanhf / erff differ by ulps and 1 + tanh, 1 + erf and the
// sigmoid's derivative cancel), the padding untouched.
template <class Act, class T>
void run_ungated(std::int64_t rows, std::int64_t cols, std::int64_t pad, std::int64_t misalign, bool in_place) {
  INFO("ungated " << rows << " x " << cols << " pad " << pad << " misalign " << misalign
                  << (in_place ? " in place" : "") << " T=" << dtype_traits<T>::name);
  const std::int64_t ld = cols + pad;
  const std::size_t n = static_cast<std::size_t>(rows * ld + misalign);
  const auto ah = gpu_test::random_values<T>(n, 0, 2, nullptr);
  const auto dch = gpu_test::random_values<T>(n, 0, 1, nullptr);
  DeviceBuffer<T> a(n), c(n), dc(n), da(n);
  a.upload(ah);
  dc.upload(dch);
  c.poison();
  da.poison();
  T* cp = in_place ? a.ptr + misalign : c.ptr + misalign;
  TIGON_OK(activation_forward<Act>(ActivationForwardArgs<T>{.a = a.ptr + misalign, .c = cp, .rows = rows,
                                                            .cols = cols, .a_stride = ld, .c_stride = ld},
                                   nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto ch = in_place ? a.download() : c.download();
  a.upload(ah);  // the backward reads the forward's input
  T* dap = in_place ? dc.ptr + misalign : da.ptr + misalign;
  TIGON_OK(activation_backward<Act>(ActivationBackwardArgs<T>{.dc = dc.ptr + misalign, .a = a.ptr + misalign,
                                                              .da = dap, .rows = rows, .cols = cols,
                                                              .dc_stride = ld, .a_stride = ld, .da_stride = ld},
                                    nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto dah = in_place ? dc.download() : da.download();
  const bool exact = std::is_same_v<Act, ReluSquared>;
  int bad_c = 0, bad_da = 0, bad_pad = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < ld; ++j) {
      const std::size_t i = static_cast<std::size_t>(misalign + r * ld + j);
      if (j >= cols) {  // padding: untouched (the poison, or the input for in-place buffers)
        if (!in_place) bad_pad += !gpu_test::all_bytes_ff(&ch[i], sizeof(T)) || !gpu_test::all_bytes_ff(&dah[i], sizeof(T));
        continue;
      }
      const float x = to_float(ah[i]);
      const float rc = round_to<T>(Act::value(x));
      const float rd = round_to<T>(gated_math::activation_backward<Act>(to_float(dch[i]), x));
      const float gc = to_float(ch[i]), gd = to_float(dah[i]);
      auto off = [&](float g, float want, double scale) {
        if (exact) return !(g == want || (std::isnan(g) && std::isnan(want)));
        return !(std::abs(g - want) <= rtol<T>() * std::abs(want) + kAbs * scale + floor_abs<T>());
      };
      const double dcv = std::abs(to_float(dch[i]));
      bad_c += off(gc, rc, std::abs(x));
      bad_da += off(gd, rd, dcv * (1 + std::abs(x)));
    }
  }
  INFO("bad c " << bad_c << ", bad da " << bad_da << ", padding written " << bad_pad);
  CHECK(bad_c == 0);
  CHECK(bad_da == 0);
  CHECK(bad_pad == 0);
}

template <class Act>
void ungated_shapes() {
  run_ungated<Act, bf16>(64, 4096, 0, 0, false);    // flat grid, 16-byte vectors
  run_ungated<Act, bf16>(33, 1000, 8, 0, false);    // row grid (strided)
  run_ungated<Act, bf16>(17, 200, 3, 1, false);     // scalar kernel (misaligned)
  run_ungated<Act, bf16>(64, 4096, 0, 0, true);     // in place
  run_ungated<Act, half>(40, 512, 0, 0, false);
  run_ungated<Act, float>(40, 515, 5, 0, false);
  run_ungated<Act, float>(8, 1024, 0, 0, true);
}

}  // namespace

TEST_CASE("activation: the ungated forward and backward (squared ReLU, SiLU, GELU)", "[gated][gpu]") {
  ungated_shapes<ReluSquared>();
  ungated_shapes<Silu>();
  ungated_shapes<GeluTanh>();
  // relu2_* name the squared ReLU.
  const std::int64_t rows = 4, cols = 64;
  DeviceBuffer<bf16> a(rows * cols), c(rows * cols), c2(rows * cols);
  a.upload(gpu_test::random_values<bf16>(rows * cols, 0, 2, nullptr));
  TIGON_OK(relu2_forward(ActivationForwardArgs<bf16>{.a = a.ptr, .c = c.ptr, .rows = rows, .cols = cols}, nullptr));
  TIGON_OK(activation_forward<ReluSquared>(
      ActivationForwardArgs<bf16>{.a = a.ptr, .c = c2.ptr, .rows = rows, .cols = cols}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto h1 = c.download(), h2 = c2.download();
  CHECK(std::memcmp(h1.data(), h2.data(), h1.size() * sizeof(bf16)) == 0);
  // An invalid call writes nothing.
  c.poison();
  CHECK(relu2_forward(ActivationForwardArgs<bf16>{.a = a.ptr, .c = a.ptr + 1, .rows = rows, .cols = cols}, nullptr)
            .code() == Errc::aliasing);
  CUDA_OK(cudaDeviceSynchronize());
  const auto h3 = c.download();
  CHECK(gpu_test::all_bytes_ff(h3.data(), h3.size() * sizeof(bf16)));
}
