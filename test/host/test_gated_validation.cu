// Argument validation of the gated-activation launchers. Runs without a GPU: every bad call must be
// rejected before the launcher touches the device (on a machine without one, reaching the device
// would turn these into CUDA errors and fail the test), naming the argument at fault.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <tigon/activation/gated.cuh>

#include "alias_matrix.hpp"

using namespace tigon;
using tigon_test::alias_matrix;

// A user activation. At namespace scope with external linkage, not in an anonymous namespace: a
// kernel instantiated on an internal-linkage type cannot carry tigon's hidden visibility (nvcc
// warns, #1407).
namespace gated_validation {
struct UserAct {
  static __host__ __device__ float value(float a) { return a * a; }
  static __host__ __device__ float derivative(float a) { return 2.0f * a; }
};
// A policy other than the default, derived from it.
struct Flat4 : GatedPolicy {
  static constexpr int kFlat = 4;
};
}  // namespace gated_validation
using gated_validation::Flat4;
using gated_validation::UserAct;

namespace {
constexpr std::int64_t kRows = 8, kCols = 256;
// Every buffer is a slot of one arena, each slot four matrices long: a matrix placed past its
// buffer's end (the partial-overlap cases) lands in its own slot's padding, so which buffers a case
// overlaps does not depend on where the linker puts arrays.
constexpr std::int64_t kSlot = 4 * kRows * kCols;
alignas(256) bf16 arena[8 * kSlot];
bf16* const abuf = arena + 0 * kSlot;
bf16* const bbuf = arena + 1 * kSlot;
bf16* const cbuf = arena + 2 * kSlot;
bf16* const dcbuf = arena + 3 * kSlot;
bf16* const dabuf = arena + 4 * kSlot;
bf16* const dbbuf = arena + 5 * kSlot;
bf16* const fused = arena + 6 * kSlot;   // gate || up, kRows x 2 kCols
bf16* const dfused = arena + 7 * kSlot;  // d gate || d up

GatedForwardArgs<bf16> good_fwd() {
  return {.a = abuf, .b = bbuf, .c = cbuf, .rows = kRows, .cols = kCols};
}
GatedBackwardArgs<bf16> good_bwd() {
  return {.dc = dcbuf, .a = abuf, .b = bbuf, .da = dabuf, .db = dbbuf, .rows = kRows, .cols = kCols};
}

void expect(const Status& s, Errc code, const char* arg, const char* op) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(std::string(s.op()) == op);
}

// Every public forward launcher rejects `a` the same way.
void expect_fwd(const GatedForwardArgs<bf16>& a, Errc code, const char* arg) {
  expect(swiglu_forward(a, nullptr), code, arg, "gated_forward");
  expect(geglu_forward(a, nullptr), code, arg, "gated_forward");
  expect(gated_forward<GeluErf>(a, nullptr), code, arg, "gated_forward");
  expect(gated_forward<UserAct>(a, nullptr), code, arg, "gated_forward");
  expect(gated_forward<Silu, Flat4>(a, nullptr), code, arg, "gated_forward");
}
void expect_bwd(const GatedBackwardArgs<bf16>& a, Errc code, const char* arg) {
  expect(swiglu_backward(a, nullptr), code, arg, "gated_backward");
  expect(geglu_backward(a, nullptr), code, arg, "gated_backward");
  expect(gated_backward<GeluErf>(a, nullptr), code, arg, "gated_backward");
  expect(gated_backward<UserAct>(a, nullptr), code, arg, "gated_backward");
  expect(gated_backward<GeluTanh, Flat4>(a, nullptr), code, arg, "gated_backward");
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
}  // namespace

TEST_CASE("gated_forward rejects bad arguments by name", "[gated][validation]") {
  auto a = good_fwd();
  a.a = nullptr;
  expect_fwd(a, Errc::null_pointer, "a");
  a = good_fwd();
  a.b = nullptr;
  expect_fwd(a, Errc::null_pointer, "b");
  a = good_fwd();
  a.c = nullptr;
  expect_fwd(a, Errc::null_pointer, "c");
  a = good_fwd();
  a.rows = 0;
  expect_fwd(a, Errc::invalid_size, "rows");
  a = good_fwd();
  a.rows = -3;
  expect_fwd(a, Errc::invalid_size, "rows");
  a = good_fwd();
  a.cols = 0;
  expect_fwd(a, Errc::invalid_size, "cols");
  a = good_fwd();
  a.cols = -5;
  expect_fwd(a, Errc::invalid_size, "cols");
  a = good_fwd();
  a.a_stride = 100;
  expect_fwd(a, Errc::invalid_stride, "a_stride");
  a = good_fwd();
  a.b_stride = kCols - 1;
  expect_fwd(a, Errc::invalid_stride, "b_stride");
  a = good_fwd();
  a.c_stride = -kCols;
  expect_fwd(a, Errc::invalid_stride, "c_stride");
  a = good_fwd();
  a.gate_multiplier = kNaN;
  expect_fwd(a, Errc::invalid_value, "gate_multiplier");
  a = good_fwd();
  a.gate_multiplier = -kInf;
  expect_fwd(a, Errc::invalid_value, "gate_multiplier");
  a = good_fwd();
  a.down_multiplier = kInf;
  expect_fwd(a, Errc::invalid_value, "down_multiplier");
  a = good_fwd();
  a.down_multiplier = kNaN;
  expect_fwd(a, Errc::invalid_value, "down_multiplier");
  // c overlapping a or b without being the same matrix.
  a = good_fwd();
  a.c = abuf + 3;
  expect_fwd(a, Errc::aliasing, "c");
  a = good_fwd();
  a.c = bbuf + kCols;  // one row down
  expect_fwd(a, Errc::aliasing, "c");
  a = good_fwd();
  a.c = abuf;  // same pointer, different stride
  a.rows = 4;
  a.c_stride = 2 * kCols;
  expect_fwd(a, Errc::aliasing, "c");
  // Fused layout with halves that share an element: c over the gate half overlaps the up half.
  a = {.a = fused, .b = fused + kCols - 1, .c = fused, .rows = kRows, .cols = kCols,
       .a_stride = 2 * kCols, .b_stride = 2 * kCols, .c_stride = 2 * kCols};
  expect_fwd(a, Errc::aliasing, "c");
}

TEST_CASE("gated_backward rejects bad arguments by name", "[gated][validation]") {
  auto a = good_bwd();
  a.dc = nullptr;
  expect_bwd(a, Errc::null_pointer, "dc");
  a = good_bwd();
  a.a = nullptr;
  expect_bwd(a, Errc::null_pointer, "a");
  a = good_bwd();
  a.b = nullptr;
  expect_bwd(a, Errc::null_pointer, "b");
  a = good_bwd();
  a.da = nullptr;
  expect_bwd(a, Errc::null_pointer, "da");
  a = good_bwd();
  a.db = nullptr;
  expect_bwd(a, Errc::null_pointer, "db");
  a = good_bwd();
  a.rows = 0;
  expect_bwd(a, Errc::invalid_size, "rows");
  a = good_bwd();
  a.cols = -1;
  expect_bwd(a, Errc::invalid_size, "cols");
  a = good_bwd();
  a.dc_stride = 1;
  expect_bwd(a, Errc::invalid_stride, "dc_stride");
  a = good_bwd();
  a.a_stride = -1;
  expect_bwd(a, Errc::invalid_stride, "a_stride");
  a = good_bwd();
  a.b_stride = 17;
  expect_bwd(a, Errc::invalid_stride, "b_stride");
  a = good_bwd();
  a.da_stride = kCols - 1;
  expect_bwd(a, Errc::invalid_stride, "da_stride");
  a = good_bwd();
  a.db_stride = 2;
  expect_bwd(a, Errc::invalid_stride, "db_stride");
  a = good_bwd();
  a.gate_multiplier = kInf;
  expect_bwd(a, Errc::invalid_value, "gate_multiplier");
  a = good_bwd();
  a.down_multiplier = kNaN;
  expect_bwd(a, Errc::invalid_value, "down_multiplier");
  // The two outputs: never the same, never overlapping.
  a = good_bwd();
  a.db = dabuf;
  expect_bwd(a, Errc::aliasing, "da");
  a = good_bwd();
  a.db = dabuf + 5;
  expect_bwd(a, Errc::aliasing, "da");
  a = good_bwd();  // in place over the same input is still two outputs on one matrix
  a.da = abuf;
  a.db = abuf;
  expect_bwd(a, Errc::aliasing, "da");
  // An output partially overlapping an input.
  a = good_bwd();
  a.da = const_cast<bf16*>(a.dc) + 1;
  expect_bwd(a, Errc::aliasing, "da");
  a = good_bwd();
  a.da = abuf + kCols;
  expect_bwd(a, Errc::aliasing, "da");
  a = good_bwd();
  a.da = bbuf + 8;
  expect_bwd(a, Errc::aliasing, "da");
  a = good_bwd();
  a.db = dcbuf + 8;
  expect_bwd(a, Errc::aliasing, "db");
  a = good_bwd();
  a.db = abuf + 1;
  expect_bwd(a, Errc::aliasing, "db");
  a = good_bwd();
  a.db = bbuf + 2 * kCols;
  expect_bwd(a, Errc::aliasing, "db");
  // Fused gradient buffer whose halves share an element.
  a = good_bwd();
  a.da = dfused;
  a.db = dfused + kCols - 8;
  a.da_stride = a.db_stride = 2 * kCols;
  expect_bwd(a, Errc::aliasing, "da");
}

TEST_CASE("in-place and fused layouts are valid arguments", "[gated][validation]") {
  // Validation alone is checked here (no device needed).
  const char* f = "gated_forward";
  const char* b = "gated_backward";
  auto fa = good_fwd();
  fa.c = abuf;  // c over a
  CHECK(detail::validate(fa, f).ok());
  fa.c = bbuf;  // c over b
  CHECK(detail::validate(fa, f).ok());
  fa = good_fwd();
  fa.b = abuf;  // a and b may be the same input
  CHECK(detail::validate(fa, f).ok());
  // Fused gate || up: a = buf, b = buf + cols, stride 2 * cols; c separate, or over the gate half.
  fa = {.a = fused, .b = fused + kCols, .c = cbuf, .rows = kRows, .cols = kCols,
        .a_stride = 2 * kCols, .b_stride = 2 * kCols};
  CHECK(detail::validate(fa, f).ok());
  fa.c = fused;
  fa.c_stride = 2 * kCols;
  CHECK(detail::validate(fa, f).ok());
  // Fused with padded rows.
  fa = {.a = fused, .b = fused + 100, .c = cbuf, .rows = 4, .cols = 100, .a_stride = 256,
        .b_stride = 256};
  CHECK(detail::validate(fa, f).ok());
  fa.c = fused + 200;  // c interleaved after b, inside the padding: disjoint from both
  fa.c_stride = 256;
  fa.cols = 50;
  CHECK(detail::validate(fa, f).ok());

  auto ba = good_bwd();
  ba.da = abuf;  // da over a, db over b
  ba.db = bbuf;
  CHECK(detail::validate(ba, b).ok());
  ba.da = dcbuf;  // da over dc
  CHECK(detail::validate(ba, b).ok());
  ba.da = bbuf;  // swapped: da over b, db over a
  ba.db = abuf;
  CHECK(detail::validate(ba, b).ok());
  // Fused forward input, fused gradient output.
  ba = {.dc = dcbuf, .a = fused, .b = fused + kCols, .da = dfused, .db = dfused + kCols,
        .rows = kRows, .cols = kCols, .a_stride = 2 * kCols, .b_stride = 2 * kCols,
        .da_stride = 2 * kCols, .db_stride = 2 * kCols};
  CHECK(detail::validate(ba, b).ok());
  // ... and in place over the fused input.
  ba.da = fused;
  ba.db = fused + kCols;
  CHECK(detail::validate(ba, b).ok());
}

TEST_CASE("gated: interleaved matrices and the vector path", "[gated][validation]") {
  const auto view = [](const bf16* p, std::int64_t rows, std::int64_t cols, std::int64_t stride) {
    return MatrixView::of(p, rows, cols, stride);
  };
  // Interleaved halves of a fused buffer share no element, although their byte ranges intersect.
  CHECK(check::interleaved_disjoint(view(fused, 8, 256, 512), view(fused + 256, 8, 256, 512)));
  CHECK_FALSE(check::overlap(view(fused, 8, 256, 512), view(fused + 256, 8, 256, 512)));
  CHECK_FALSE(check::interleaved_disjoint(view(fused, 8, 256, 512), view(fused + 255, 8, 256, 512)));
  CHECK_FALSE(check::interleaved_disjoint(view(fused, 8, 256, 512), view(fused + 257, 8, 256, 512)));
  CHECK_FALSE(check::interleaved_disjoint(view(fused, 8, 256, 512), view(fused, 8, 256, 512)));
  CHECK_FALSE(check::interleaved_disjoint(view(fused, 4, 256, 512), view(fused + 256, 4, 256, 256)));
  // Offsets of whole periods (rows further down) still interleave.
  CHECK(check::interleaved_disjoint(view(fused + 512, 4, 256, 512), view(fused + 256, 4, 256, 512)));

  using P = detail::GatedFwdParams<bf16>;
  const P aligned{abuf, bbuf, cbuf, kRows, kCols, kCols, kCols, kCols, 1.0f, 1.0f};
  CHECK(detail::gated_vectorizable<bf16, 8>(aligned));
  P p = aligned;
  p.b = bbuf + 1;  // misaligned pointer
  CHECK_FALSE(detail::gated_vectorizable<bf16, 8>(p));
  p = aligned;
  p.cs = 260;  // stride not a multiple of the vector
  CHECK_FALSE(detail::gated_vectorizable<bf16, 8>(p));
  p = aligned;
  p.cols = 123;  // cols not a multiple of the vector
  CHECK_FALSE(detail::gated_vectorizable<bf16, 8>(p));
  // Fused layout: vectors when cols is a multiple of 8 bf16.
  const P fused_p{fused, fused + kCols, cbuf, kRows, kCols, 2 * kCols, 2 * kCols, kCols, 1.0f, 1.0f};
  CHECK(detail::gated_vectorizable<bf16, 8>(fused_p));
  using B = detail::GatedBwdParams<bf16>;
  const B bwd{dcbuf, abuf, bbuf, dabuf, dbbuf, kRows, kCols, kCols, kCols, kCols, kCols, kCols, 1.0f, 1.0f};
  CHECK(detail::gated_vectorizable<bf16, 8>(bwd));
  B q = bwd;
  q.db = dbbuf + 4;
  CHECK_FALSE(detail::gated_vectorizable<bf16, 8>(q));
  // Params fill zero strides with cols.
  const auto params = detail::gated_fwd_params(good_fwd());
  CHECK(params.as == kCols);
  CHECK(params.bs == kCols);
  CHECK(params.cs == kCols);
}

TEST_CASE("activation_forward / activation_backward reject bad arguments by name", "[gated][validation]") {
  alignas(16) static bf16 a[64], c[64], dc[64], da[64];
  ActivationForwardArgs<bf16> f{.a = a, .c = c, .rows = 4, .cols = 16};
  CHECK(detail::validate(f, "activation_forward").ok());
  auto bad = f;
  bad.a = nullptr;
  CHECK(std::string(detail::validate(bad, "activation_forward").argument()) == "a");
  bad = f;
  bad.c = nullptr;
  CHECK(std::string(detail::validate(bad, "activation_forward").argument()) == "c");
  bad = f;
  bad.cols = 0;
  CHECK(detail::validate(bad, "activation_forward").code() == Errc::invalid_size);
  bad = f;
  bad.a_stride = 8;
  CHECK(detail::validate(bad, "activation_forward").code() == Errc::invalid_stride);
  bad = f;
  bad.c = a + 1;  // overlaps a, shifted by one element
  CHECK(detail::validate(bad, "activation_forward").code() == Errc::aliasing);
  bad = f;
  bad.c = a;  // in place
  CHECK(detail::validate(bad, "activation_forward").ok());

  ActivationBackwardArgs<bf16> b{.dc = dc, .a = a, .da = da, .rows = 4, .cols = 16};
  CHECK(detail::validate(b, "activation_backward").ok());
  auto badb = b;
  badb.dc = nullptr;
  CHECK(std::string(detail::validate(badb, "activation_backward").argument()) == "dc");
  badb = b;
  badb.da = nullptr;
  CHECK(std::string(detail::validate(badb, "activation_backward").argument()) == "da");
  badb = b;
  badb.da = dc;  // over the upstream gradient
  CHECK(detail::validate(badb, "activation_backward").ok());
  badb = b;
  badb.da = a;  // over the input
  CHECK(detail::validate(badb, "activation_backward").ok());
  badb = b;
  badb.da = a + 8;  // half a row off
  CHECK(detail::validate(badb, "activation_backward").code() == Errc::aliasing);
  badb = b;
  badb.da_stride = 4;
  CHECK(detail::validate(badb, "activation_backward").code() == Errc::invalid_stride);
}

TEST_CASE("gated and ungated ops: the generated aliasing matrix", "[gated][validation]") {
  // gated_backward: dc, a, b in; da, db out; each output may be any input itself, never the other.
  alias_matrix<GatedBackwardArgs<bf16>>(
      {{"dc", false}, {"a", false}, {"b", false}, {"da", true}, {"db", true}},
      {{3, 0}, {3, 1}, {3, 2}, {4, 0}, {4, 1}, {4, 2}},
      [](GatedBackwardArgs<bf16>& g, int k, bf16* p) {
        g.rows = 4, g.cols = 1000;
        if (k == 0) g.dc = p;
        if (k == 1) g.a = p;
        if (k == 2) g.b = p;
        if (k == 3) g.da = p;
        if (k == 4) g.db = p;
      },
      [](const GatedBackwardArgs<bf16>& g) { return detail::validate(g, "gated_backward"); });
  // gated_forward: c may be a or b itself.
  alias_matrix<GatedForwardArgs<bf16>>(
      {{"a", false}, {"b", false}, {"c", true}}, {{2, 0}, {2, 1}},
      [](GatedForwardArgs<bf16>& g, int k, bf16* p) {
        g.rows = 4, g.cols = 1000;
        if (k == 0) g.a = p;
        if (k == 1) g.b = p;
        if (k == 2) g.c = p;
      },
      [](const GatedForwardArgs<bf16>& g) { return detail::validate(g, "gated_forward"); });
  // activation_backward: da may be dc or a itself; activation_forward: c may be a.
  alias_matrix<ActivationBackwardArgs<bf16>>(
      {{"dc", false}, {"a", false}, {"da", true}}, {{2, 0}, {2, 1}},
      [](ActivationBackwardArgs<bf16>& g, int k, bf16* p) {
        g.rows = 4, g.cols = 1000;
        if (k == 0) g.dc = p;
        if (k == 1) g.a = p;
        if (k == 2) g.da = p;
      },
      [](const ActivationBackwardArgs<bf16>& g) { return detail::validate(g, "activation_backward"); });
  alias_matrix<ActivationForwardArgs<bf16>>(
      {{"a", false}, {"c", true}}, {{1, 0}},
      [](ActivationForwardArgs<bf16>& g, int k, bf16* p) {
        g.rows = 4, g.cols = 1000;
        if (k == 0) g.a = p;
        if (k == 1) g.c = p;
      },
      [](const ActivationForwardArgs<bf16>& g) { return detail::validate(g, "activation_forward"); });
}
