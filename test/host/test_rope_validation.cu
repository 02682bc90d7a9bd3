// Argument validation of the RoPE launchers; runs without a GPU (bad calls never reach the device).
#include <catch2/catch.hpp>

#include <string>

#include <tigon/rope/rope.cuh>

#include "alias_matrix.hpp"

using namespace tigon;

namespace {
alignas(256) bf16 qbuf[2 * 4 * 4 * 64];
alignas(256) bf16 kbuf[2 * 4 * 2 * 64];
alignas(256) bf16 cbuf[4 * 64];
alignas(256) bf16 sbuf[4 * 64];
alignas(256) bf16 mbuf[3 * 4 * 64];  // M-RoPE's three planes of a shared table

RopeArgs<bf16> good() {
  RopeArgs<bf16> a;
  a.q = {.in = qbuf, .out = qbuf, .heads = 4, .stride_b = 4 * 4 * 64, .stride_t = 4 * 64, .stride_h = 64};
  a.k = {.in = kbuf, .out = kbuf, .heads = 2, .stride_b = 4 * 2 * 64, .stride_t = 2 * 64, .stride_h = 64};
  a.batch = 2;
  a.seq = 4;
  a.head_dim = 64;
  a.cos = cbuf;
  a.sin = sbuf;
  a.table_rows = 4;
  return a;
}

void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
}
}  // namespace

TEST_CASE("rope in place over a fused QKV buffer: disjoint heads pass, shared ones do not", "[rope][validation]") {
  // [B 2, T 4, (4 q + 2 k + 2 v) heads x 64]: q at head 0, k at head 4, both in place.
  alignas(256) static bf16 qkv[2 * 4 * 8 * 64];
  auto a = good();
  a.q = {.in = qkv, .out = qkv, .heads = 4, .stride_b = 4 * 8 * 64, .stride_t = 8 * 64, .stride_h = 64};
  a.k = {.in = qkv + 4 * 64, .out = qkv + 4 * 64, .heads = 2, .stride_b = 4 * 8 * 64, .stride_t = 8 * 64,
         .stride_h = 64};
  CHECK(detail::validate(a, "rope_forward").ok());
  a.k.in = a.k.out = qkv + 3 * 64;  // k's first head is q's last
  expect(rope_forward(a, nullptr), Errc::aliasing, "k.out");
  a.k.in = a.k.out = qkv + 4 * 64;
  a.k.stride_t = a.q.stride_t + 64;  // another token lattice: the heads meet in later tokens
  a.k.out_stride_t = 0;
  expect(rope_forward(a, nullptr), Errc::aliasing, "k.out");
}

TEST_CASE("rope rejects bad arguments by name", "[rope][validation]") {
  CHECK(detail::validate(good(), "rope_forward").ok());
  auto a = good();
  a.q.in = nullptr;
  expect(rope_forward(a, nullptr), Errc::null_pointer, "q.in");
  a = good();
  a.k.out = nullptr;
  expect(rope_backward(a, nullptr), Errc::null_pointer, "k.out");
  a = good();
  a.cos = nullptr;
  expect(rope_forward(a, nullptr), Errc::null_pointer, "cos");
  a = good();
  a.seq = 0;
  expect(rope_forward(a, nullptr), Errc::invalid_size, "seq");
  a = good();
  a.rotary_dim = 1;  // no pair to rotate
  expect(rope_forward(a, nullptr), Errc::invalid_size, "rotary_dim");
  a = good();
  a.rotary_dim = -2;
  expect(rope_forward(a, nullptr), Errc::invalid_size, "rotary_dim");
  a = good();
  a.rotary_dim = 65;  // past head_dim
  expect(rope_forward(a, nullptr), Errc::invalid_size, "rotary_dim");
  a = good();
  a.rotary_dim = 128;
  expect(rope_forward<RopeInterleaved>(a, nullptr), Errc::invalid_size, "rotary_dim");
  a = good();
  a.head_dim = 2048;
  expect(rope_forward(a, nullptr), Errc::unsupported, "head_dim");
  a = good();
  a.table_rows = 3;  // fewer rows than positions, and no position ids
  expect(rope_forward(a, nullptr), Errc::invalid_size, "table_rows");
  a = good();
  a.q.stride_h = 32;  // heads would overlap
  expect(rope_forward(a, nullptr), Errc::invalid_stride, "q.stride");
  a = good();
  a.q.out = qbuf + 1;  // overlaps q.in, not the same tensor
  expect(rope_forward<RopeInterleaved>(a, nullptr), Errc::aliasing, "q.out");
  a = good();
  a.k.out = qbuf;  // k's output over q's data
  a.k.in = qbuf;
  expect(rope_forward(a, nullptr), Errc::aliasing, "k.out");
  a = good();
  static const std::int64_t pos64[8] = {};
  static const std::int32_t pos32[8] = {};
  a.position_ids = pos64;
  a.position_ids_i32 = pos32;
  expect(rope_forward(a, nullptr), Errc::invalid_value, "position_ids");
  a = good();
  a.table_stride_t = 10;
  expect(rope_forward(a, nullptr), Errc::invalid_stride, "table_stride_t");
  a = good();
  a.cos = a.sin = mbuf;
  a.sections[0] = 8;  // M-RoPE sections must cover the 32 pairs
  a.sections[1] = 12;
  a.sections[2] = 8;
  expect(rope_forward(a, nullptr), Errc::invalid_size, "sections");
  a.sections[2] = 12;
  CHECK(detail::validate(a, "rope_forward").ok());
  a.sections[0] = -4;
  a.sections[1] = 24;
  expect(rope_backward(a, nullptr), Errc::invalid_size, "sections");
  a = good();
  a.cos = a.sin = mbuf;
  a.sections[0] = 32;
  a.table_stride_plane = -1;
  expect(rope_forward(a, nullptr), Errc::invalid_stride, "table_stride_plane");
  a.table_stride_plane = 0;
  expect(rope_forward<RopeInterleaved>(a, nullptr), Errc::invalid_value, "sections");  // half split only
  // k is optional.
  a = good();
  a.k = {};
  CHECK(detail::validate(a, "rope_forward").ok());
}

TEST_CASE("rope accepts odd head and rotary dims", "[rope][validation]") {
  // An odd rotary_dim r rotates r / 2 pairs and passes its last channel through; its table row is
  // r + 1 wide by default (Hugging Face's 2 * ceil(r / 2)), and needs r entries.
  auto a = good();
  a.rotary_dim = 63;  // odd partial rotary of head_dim 64
  CHECK(detail::validate(a, "rope_forward").ok());
  CHECK(detail::rope_params(a, false).tst == 64);
  a = good();
  a.head_dim = 41;  // Liger-Kernel's odd head_dim, strides of 64
  a.rotary_dim = 0;
  CHECK(detail::validate(a, "rope_forward").ok());
  CHECK(detail::rope_params(a, false).rotary_dim == 41);
  CHECK(detail::rope_params(a, true).tst == 42);
  a.table_stride_t = 42;
  CHECK(detail::validate(a, "rope_backward").ok());
  a.table_stride_t = 41;  // the entries a row is read at
  CHECK(detail::validate(a, "rope_forward").ok());
  a.table_stride_t = 40;
  expect(rope_forward(a, nullptr), Errc::invalid_stride, "table_stride_t");
  a = good();
  a.head_dim = 3;
  CHECK(detail::validate(a, "rope_forward").ok());
  a.rotary_dim = 2;  // even partial of an odd head_dim
  CHECK(detail::validate(a, "rope_forward").ok());
  CHECK(detail::rope_params(a, false).tst == 2);
  a.rotary_dim = 4;
  expect(rope_forward<RopeInterleaved>(a, nullptr), Errc::invalid_size, "rotary_dim");
  a = good();
  a.head_dim = 1;  // a single channel: no pair
  expect(rope_forward(a, nullptr), Errc::invalid_size, "rotary_dim");
  // An odd size takes the element-wise path.
  a = good();
  a.head_dim = 41;
  CHECK((detail::rope_vec<bf16, bf16, RopeHalfSplit>(detail::rope_params(a, false))) == 1);
  CHECK((detail::rope_vec<bf16, bf16, RopeInterleaved>(detail::rope_params(a, false))) == 1);
  a = good();
  CHECK((detail::rope_vec<bf16, bf16, RopeHalfSplit>(detail::rope_params(a, false))) == kVecElems<bf16>);
}

TEST_CASE("rope: the generated aliasing matrix", "[rope][validation]") {
  // q.in, k.in, cos, sin, position_ids in; q.out, k.out out; each output may be its own input
  // itself (in place), and nothing else: not the other tensor, the tables or the position ids.
  tigon_test::alias_matrix<RopeArgs<bf16>>(
      {{"q.in", false}, {"k.in", false}, {"cos", false}, {"sin", false}, {"position_ids", false}, {"q.out", true},
       {"k.out", true}},
      {{5, 0}, {6, 1}},
      [](RopeArgs<bf16>& a, int k, bf16* p) {
        a.batch = 1, a.seq = 4, a.head_dim = 64, a.table_rows = 4;
        a.q.heads = 2, a.q.stride_b = 4 * 2 * 64, a.q.stride_t = 2 * 64, a.q.stride_h = 64;
        a.k.heads = 1, a.k.stride_b = 4 * 64, a.k.stride_t = 64, a.k.stride_h = 64;
        if (k == 0) a.q.in = p;
        if (k == 1) a.k.in = p;
        if (k == 2) a.cos = p;
        if (k == 3) a.sin = p;
        if (k == 4) a.position_ids = reinterpret_cast<const std::int64_t*>(p);
        if (k == 5) a.q.out = p;
        if (k == 6) a.k.out = p;
      },
      [](const RopeArgs<bf16>& a) { return detail::validate(a, "rope_forward"); });
  // M-RoPE's three planes of per-batch tables: an output over the last plane is rejected too.
  RopeArgs<bf16> a = good();
  alignas(256) static bf16 planes[3 * 2 * 4 * 64];
  a.cos = a.sin = planes;
  a.table_stride_b = 4 * 64;
  a.sections[0] = 16, a.sections[1] = 8, a.sections[2] = 8;
  CHECK(detail::validate(a, "rope_forward").ok());
  a.k.out = planes + 2 * 2 * 4 * 64;  // the third plane
  a.k.out_stride_b = 4 * 2 * 64, a.k.out_stride_t = 2 * 64, a.k.out_stride_h = 64;
  expect(detail::validate(a, "rope_forward"), Errc::aliasing, "k.out");
}
