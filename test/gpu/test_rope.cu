// RoPE on the GPU against the Hugging Face formula in double precision: shapes with GQA / MQA and
// odd sizes, both layouts for q and k independently, half-split and interleaved, partial rotary,
// position ids (int64 / int32), per-batch tables, tables in another dtype, in place and out of
// place, forward and backward; odd head and rotary dims (Liger-Kernel's rule on Hugging Face's
// tables); out-of-range positions give NaN without out-of-bounds reads.
#include "gpu_test.cuh"

#include <cmath>

#include <tigon/rope/rope.cuh>

#include "../reference/rope_ref.hpp"

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

struct Case {
  std::int64_t B = 1, T = 1, Hq = 1, Hk = 1, D = 64, rd = 0;
  bool interleaved = false;
  bool q_bhtd = false, k_bhtd = false;  // layouts: [B, T, H, D] (false) or [B, H, T, D]
  int pos_ids = 0;                      // 0: none, 64: int64 ids, 32: int32 ids
  bool batch_tables = false;            // [B, rows, W] tables instead of one shared table
  std::int64_t table_pad = 0;           // table rows W + pad apart (0: table_stride_t = 0, W)
  bool in_place = true;
  bool k_out_of_place = false;  // with in_place: q in place, k written to another buffer
  bool backward = false;
  bool with_k = true;
  std::int64_t sec[3] = {0, 0, 0};  // M-RoPE sections (half split): three table planes
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " Hq" + std::to_string(c.Hq) +
         " Hk" + std::to_string(c.Hk) + " D" + std::to_string(c.D) + " rd" + std::to_string(c.rd) +
         (c.interleaved ? " interleaved" : " half-split") + (c.q_bhtd ? " q:BHTD" : " q:BTHD") +
         (c.k_bhtd ? " k:BHTD" : " k:BTHD") + " pos" + std::to_string(c.pos_ids) +
         (c.batch_tables ? " batch-tables" : "") +
         (c.table_pad ? " table-pad" + std::to_string(c.table_pad) : "") + (c.in_place ? " in-place" : " out-of-place") +
         (c.in_place && c.k_out_of_place ? " (k out of place)" : "") +
         (c.backward ? " backward" : " forward") + (c.with_k ? "" : " q-only") +
         (c.sec[0] + c.sec[1] + c.sec[2] ? " mrope " + std::to_string(c.sec[0]) + "/" + std::to_string(c.sec[1]) +
                                                "/" + std::to_string(c.sec[2])
                                          : "");
}

template <class T>
double tol() {
  if constexpr (std::is_same_v<T, float>) return 2e-6;
  if constexpr (std::is_same_v<T, half>) return 0x1p-10;
  return 0x1p-7;
}

struct Layout {
  std::int64_t sb, st, sh;
};
Layout layout(const Case& c, std::int64_t H, bool bhtd) {
  return bhtd ? Layout{H * c.T * c.D, c.D, c.T * c.D} : Layout{c.T * H * c.D, H * c.D, c.D};
}

template <class T, class C = T, class P = RopeDefaultPolicy>
void run_case(const Case& c) {
  INFO(describe(c) << " T=" << dtype_traits<T>::name << " C=" << dtype_traits<C>::name);
  const std::int64_t rd = c.rd == 0 ? c.D : c.rd;
  const std::int64_t rows = c.pos_ids ? c.T + 17 : c.T;
  const std::int64_t tables = c.batch_tables ? c.B : 1;
  // HF tables: inv_freq_i = 10000^(-2i/rd) for i < ceil(rd/2), cos = cos(pos * inv_freq) duplicated
  // per the style: W = 2 * ceil(rd / 2) wide (rd + 1 for an odd rd), rows ts = W + pad apart.
  // M-RoPE: three planes of tables back to back, plane l's angles those of position r + 7 l.
  const bool mrope = c.sec[0] + c.sec[1] + c.sec[2] != 0;
  const std::int64_t planes = mrope ? 3 : 1;
  const std::int64_t w = rd + rd % 2, ts = w + c.table_pad;
  const std::int64_t plane_size = tables * rows * ts;
  std::vector<C> cos_h(static_cast<std::size_t>(planes * plane_size)), sin_h(cos_h.size());
  std::vector<double> cos_d(cos_h.size()), sin_d(cos_h.size());
  for (std::int64_t l = 0; l < planes; ++l)
  for (std::int64_t b = 0; b < tables; ++b)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t d = 0; d < ts; ++d) {
        const std::int64_t i = c.interleaved ? d / 2 : d % (w / 2);
        const double inv = std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(rd));
        const double ang = d < w ? static_cast<double>(r + 3 * b + 7 * l) * inv : 1e4;  // pad: never read
        const std::size_t k = static_cast<std::size_t>(l * plane_size + (b * rows + r) * ts + d);
        cos_h[k] = from_float<C>(static_cast<float>(std::cos(ang)));
        sin_h[k] = from_float<C>(static_cast<float>(std::sin(ang)));
        cos_d[k] = to_float(cos_h[k]);
        sin_d[k] = to_float(sin_h[k]);
      }
  std::vector<std::int64_t> pos(static_cast<std::size_t>(c.B * c.T));
  std::uniform_int_distribution<std::int64_t> pd(0, rows - 1);
  for (auto& p : pos) p = c.pos_ids ? pd(gpu_test::rng()) : 0;
  std::vector<std::int32_t> pos32(pos.begin(), pos.end());

  const std::int64_t nq = c.B * c.T * c.Hq * c.D, nk = c.with_k ? c.B * c.T * c.Hk * c.D : 0;
  std::vector<double> qd, kd;
  const auto qh = gpu_test::random_values<T>(static_cast<std::size_t>(nq), 0, 1, &qd);
  const auto kh = gpu_test::random_values<T>(static_cast<std::size_t>(std::max<std::int64_t>(nk, 1)), 0, 1, &kd);
  DeviceBuffer<T> q(nq), k(std::max<std::int64_t>(nk, 1)), qo(nq), ko(std::max<std::int64_t>(nk, 1));
  DeviceBuffer<C> cosb(cos_h.size()), sinb(sin_h.size());
  DeviceBuffer<std::int64_t> posb(pos.size());
  DeviceBuffer<std::int32_t> pos32b(pos32.size());
  q.upload(qh);
  k.upload(kh);
  qo.poison();
  ko.poison();
  cosb.upload(cos_h);
  sinb.upload(sin_h);
  posb.upload(pos);
  pos32b.upload(pos32);

  const Layout lq = layout(c, c.Hq, c.q_bhtd), lk = layout(c, c.Hk, c.k_bhtd);
  RopeArgs<T, C> a;
  a.q = {.in = q.ptr, .out = c.in_place ? q.ptr : qo.ptr, .heads = c.Hq,
         .stride_b = lq.sb, .stride_t = lq.st, .stride_h = lq.sh};
  if (c.with_k) {
    a.k = {.in = k.ptr, .out = c.in_place && !c.k_out_of_place ? k.ptr : ko.ptr, .heads = c.Hk,
           .stride_b = lk.sb, .stride_t = lk.st, .stride_h = lk.sh};
  }
  a.batch = c.B;
  a.seq = c.T;
  a.head_dim = c.D;
  a.rotary_dim = c.rd;
  a.cos = cosb.ptr;
  a.sin = sinb.ptr;
  a.table_rows = rows;
  a.table_stride_b = c.batch_tables ? rows * ts : 0;
  a.table_stride_t = c.table_pad ? ts : 0;
  if (c.pos_ids == 64) a.position_ids = posb.ptr;
  if (c.pos_ids == 32) a.position_ids_i32 = pos32b.ptr;
  for (int i = 0; i < 3; ++i) a.sections[i] = c.sec[i];

  Status s;
  if (c.interleaved) {
    s = c.backward ? rope_backward<RopeInterleaved, P>(a, nullptr) : rope_forward<RopeInterleaved, P>(a, nullptr);
  } else {
    s = c.backward ? rope_backward<RopeHalfSplit, P>(a, nullptr) : rope_forward<RopeHalfSplit, P>(a, nullptr);
  }
  INFO(s.message());
  REQUIRE(s.ok());
  CUDA_OK(cudaDeviceSynchronize());

  auto check_tensor = [&](const std::vector<T>& got, const std::vector<double>& in, std::int64_t H,
                          const Layout& l, const char* what) {
    std::vector<double> ref(static_cast<std::size_t>(c.B * c.T * H * c.D));
    std::vector<std::size_t> where(ref.size());
    std::size_t n = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t base = b * l.sb + t * l.st + h * l.sh;
          const std::int64_t row = c.pos_ids ? pos[static_cast<std::size_t>(b * c.T + t)] : t;
          const std::size_t tb = static_cast<std::size_t>(((c.batch_tables ? b : 0) * rows + row) * ts);
          // The row Hugging Face's apply_multimodal_rotary_pos_emb composes: table column j from
          // the plane of pair j mod (W / 2)'s section.
          std::vector<double> crow(&cos_d[tb], &cos_d[tb] + ts), srow(&sin_d[tb], &sin_d[tb] + ts);
          if (mrope) {
            for (std::int64_t j = 0; j < w; ++j) {
              const std::int64_t pr = j % (w / 2);
              const std::int64_t l = pr < c.sec[0] ? 0 : pr < c.sec[0] + c.sec[1] ? 1 : 2;
              crow[static_cast<std::size_t>(j)] = cos_d[tb + static_cast<std::size_t>(l * plane_size + j)];
              srow[static_cast<std::size_t>(j)] = sin_d[tb + static_cast<std::size_t>(l * plane_size + j)];
            }
          }
          const auto y = c.backward
                             ? tigon_ref::rope_head_backward(&in[base], crow.data(), srow.data(),
                                                             int(c.D), int(rd), c.interleaved)
                             : tigon_ref::rope_head(&in[base], crow.data(), srow.data(), int(c.D),
                                                    int(rd), c.interleaved);
          for (std::int64_t d = 0; d < c.D; ++d) {
            ref[n] = y[d];
            where[n++] = static_cast<std::size_t>(base + d);
          }
        }
    double rms = 0;
    for (double v : ref) rms += v * v;
    rms = std::sqrt(rms / static_cast<double>(ref.size()));
    const auto cmp = gpu_test::compare(
        ref.size(), [&](std::size_t i) { return static_cast<double>(to_float(got[where[i]])); }, ref,
        tol<T>() * rms, tol<T>());
    INFO(what << ": " << cmp.bad << " of " << cmp.n << " out of tolerance, worst #" << cmp.worst
              << " score " << cmp.worst_err << ", rel L2 " << cmp.rel_l2);
    CHECK(cmp.ok(tol<T>()));
  };
  check_tensor((c.in_place ? q : qo).download(), qd, c.Hq, lq, "q");
  if (c.with_k) check_tensor((c.in_place && !c.k_out_of_place ? k : ko).download(), kd, c.Hk, lk, "k");
  if (!c.with_k) CHECK(gpu_test::all_bytes_ff(ko.download().data(), sizeof(T)));  // k untouched
}

template <class T, class C = T, class P = RopeDefaultPolicy>
void both_directions(Case c) {
  c.backward = false;
  run_case<T, C, P>(c);
  c.backward = true;
  run_case<T, C, P>(c);
}

}  // namespace

TEST_CASE("rope: the issue's shapes, every dtype, both styles", "[rope][gpu]") {
  const Case shapes[] = {
      {.B = 1, .T = 128, .Hq = 32, .Hk = 32, .D = 64},
      {.B = 2, .T = 128, .Hq = 32, .Hk = 8, .D = 64},
      {.B = 3, .T = 423, .Hq = 73, .Hk = 213, .D = 92},  // odd: scalar path
      {.B = 1, .T = 8192, .Hq = 32, .Hk = 8, .D = 128},
      {.B = 2, .T = 33, .Hq = 4, .Hk = 1, .D = 256},     // MQA, largest common head_dim
      {.B = 1, .T = 7, .Hq = 3, .Hk = 2, .D = 80},
  };
  for (Case c : shapes) {
    for (bool inter : {false, true}) {
      c.interleaved = inter;
      both_directions<bf16>(c);
      if (c.T * (c.Hq + c.Hk) <= 128 * 64) {
        both_directions<half>(c);
        both_directions<float>(c);
      }
    }
  }
}

TEST_CASE("rope: layouts, partial rotary, position ids, tables, out of place", "[rope][gpu]") {
  const Case base{.B = 2, .T = 50, .Hq = 8, .Hk = 2, .D = 128};
  for (bool inter : {false, true}) {
    Case c = base;
    c.interleaved = inter;
    SECTION(std::string("q BHTD, k BTHD ") + (inter ? "interleaved" : "half")) {
      c.q_bhtd = true;
      both_directions<bf16>(c);
      c.k_bhtd = true;
      both_directions<float>(c);
    }
    SECTION(std::string("partial rotary ") + (inter ? "interleaved" : "half")) {
      c.rd = 64;
      both_directions<bf16>(c);
      c.in_place = false;  // the pass-through channels are copied
      both_directions<bf16>(c);
      c.rd = 32;
      c.D = 80;  // Phi-style: rotary 32 of 80
      both_directions<half>(c);
      c.rd = 24;  // half-split chunks not a multiple of the vector width: scalar path
      both_directions<bf16>(c);
    }
    SECTION(std::string("position ids ") + (inter ? "interleaved" : "half")) {
      c.pos_ids = 64;
      both_directions<bf16>(c);
      c.pos_ids = 32;
      c.batch_tables = true;
      both_directions<bf16>(c);
    }
    SECTION(std::string("fp32 tables with bf16 q, k ") + (inter ? "interleaved" : "half")) {
      both_directions<bf16, float>(c);
      c.in_place = false;
      both_directions<half, float>(c);
    }
    SECTION(std::string("out of place, q only ") + (inter ? "interleaved" : "half")) {
      c.in_place = false;
      both_directions<bf16>(c);
      c.with_k = false;
      both_directions<float>(c);
    }
  }
}

// Head-group policies: kHeads heads of a token per thread (the default: 2).
struct G3 : RopePolicy {
  static constexpr int kHeads = 3;
};
struct G4 : RopePolicy {
  static constexpr int kHeads = 4;
};
struct G8 : RopePolicy {
  static constexpr int kHeads = 8;
};

TEST_CASE("rope: the head-group kernel computes the same function", "[rope][gpu]") {
  // The half-split style's kernel, with kHeads = G heads of a token per thread, the table chunk
  // loaded once. Groups that do not divide the heads (3 of 40, 8 of 10), groups spanning q and k,
  // q only; calls it does not take (out of place with pass-through channels, the scalar path) fall
  // back to the one-head kernel.
  Case c{.B = 2, .T = 50, .Hq = 32, .Hk = 8, .D = 128};
  both_directions<bf16, bf16, G3>(c);
  both_directions<bf16, bf16, G4>(c);
  both_directions<half, half, G8>(c);
  both_directions<float, float, G4>(c);
  Case q = c;
  q.q_bhtd = true;
  q.pos_ids = 64;
  both_directions<bf16, bf16, G4>(q);
  q.batch_tables = true;
  q.pos_ids = 32;
  both_directions<bf16, float, G8>(q);
  Case o = c;
  o.in_place = false;
  both_directions<bf16, bf16, G4>(o);
  o.with_k = false;
  both_directions<bf16, bf16, G3>(o);
  Case r{.B = 1, .T = 33, .Hq = 8, .Hk = 2, .D = 128, .rd = 64};
  both_directions<bf16, bf16, G4>(r);  // partial rotary in place: the head-group kernel
  r.in_place = false;
  both_directions<bf16, bf16, G4>(r);  // out of place: the one-head kernel copies the rest
  Case odd{.B = 1, .T = 9, .Hq = 5, .Hk = 3, .D = 92};
  both_directions<bf16, bf16, G4>(odd);  // scalar path
  Case big{.B = 1, .T = 8192, .Hq = 32, .Hk = 8, .D = 128};
  both_directions<bf16, bf16, G4>(big);
}

TEST_CASE("rope: the interleaved style past the token-block kernel's batch limit", "[rope][gpu]") {
  // Batches over 65535: the head-group kernel (in place, or every channel rotated), else the
  // one-head kernel (out of place with pass-through channels), else the scalar one-head kernel.
  Case c{.B = 65537, .T = 1, .Hq = 2, .Hk = 1, .D = 16, .interleaved = true};
  both_directions<bf16>(c);
  both_directions<bf16, bf16, G3>(c);
  c.pos_ids = 32;
  both_directions<half, float>(c);
  c.pos_ids = 0;
  c.in_place = false;
  both_directions<bf16>(c);
  c.rd = 8;
  both_directions<bf16>(c);  // the one-head kernel copies the pass-through channels
  c.D = 6;
  c.rd = 4;
  both_directions<bf16>(c);  // scalar path
}

TEST_CASE("rope: the token-block kernel (interleaved style)", "[rope][gpu]") {
  // One block per token, each thread one chunk of up to two heads per pass.
  // Head counts that leave a thread one head (41, 5 + 3), many heads (several passes), q only,
  // both layouts, position ids and per-batch tables, partial rotary in and out of place (pass-
  // through chunks), the scalar path (head_dim 92), long sequences.
  Case c{.B = 2, .T = 50, .Hq = 32, .Hk = 8, .D = 128, .interleaved = true};
  both_directions<bf16>(c);
  both_directions<half>(c);
  both_directions<float>(c);
  Case q = c;
  q.q_bhtd = true;
  q.pos_ids = 64;
  both_directions<bf16>(q);
  q.batch_tables = true;
  q.pos_ids = 32;
  both_directions<bf16, float>(q);
  Case o = c;
  o.in_place = false;
  o.Hq = 33;
  both_directions<bf16>(o);
  o.with_k = false;
  both_directions<bf16>(o);
  Case many{.B = 1, .T = 7, .Hq = 73, .Hk = 213, .D = 64, .interleaved = true};
  both_directions<bf16>(many);
  Case r{.B = 1, .T = 33, .Hq = 8, .Hk = 2, .D = 128, .rd = 64, .interleaved = true};
  both_directions<bf16>(r);
  Case mixed = r;  // q in place, k out of place: a pass may hold a q head and a k head
  mixed.k_out_of_place = true;
  both_directions<bf16>(mixed);
  mixed.interleaved = false;  // the half-split style's kernels on the same call
  both_directions<bf16>(mixed);
  mixed.interleaved = true;
  mixed.Hq = 1;
  mixed.Hk = 1;
  both_directions<half>(mixed);
  r.in_place = false;
  both_directions<bf16>(r);
  Case odd{.B = 1, .T = 9, .Hq = 5, .Hk = 3, .D = 92, .interleaved = true};
  both_directions<bf16>(odd);  // scalar path
  odd.rd = 46;
  odd.in_place = false;
  both_directions<bf16>(odd);  // scalar path, pass-through channels
  Case big{.B = 1, .T = 8192, .Hq = 32, .Hk = 8, .D = 128, .interleaved = true};
  both_directions<bf16>(big);
}

TEST_CASE("rope: odd head and rotary dims, every dtype, both styles", "[rope][gpu]") {
  // An odd rotary_dim 2n + 1 rotates n pairs ((d, d + n) half split, (2d, 2d + 1) interleaved) and
  // passes channel 2n through, with Hugging Face's 2n + 2 wide tables: Liger-Kernel's results for
  // an odd head_dim. Every odd size takes the element-wise kernels (the one-head kernel, and the
  // token-block kernel in the interleaved style).
  const Case shapes[] = {
      {.B = 9, .T = 7, .Hq = 41, .Hk = 41, .D = 41, .q_bhtd = true, .k_bhtd = true},  // Liger's test
      {.B = 2, .T = 33, .Hq = 8, .Hk = 2, .D = 41},
      {.B = 3, .T = 5, .Hq = 3, .Hk = 1, .D = 3},  // one pair and the odd channel
      {.B = 2, .T = 19, .Hq = 4, .Hk = 2, .D = 127},
      {.B = 1, .T = 3, .Hq = 2, .Hk = 1, .D = 1023},  // past the token-block kernel's 256 threads
  };
  for (Case c : shapes) {
    for (bool inter : {false, true}) {
      c.interleaved = inter;
      both_directions<bf16>(c);
      both_directions<half>(c);
      both_directions<float>(c);
      Case o = c;
      o.in_place = false;
      both_directions<bf16>(o);
      o.with_k = false;
      both_directions<float>(o);
      Case m = c;
      m.k_out_of_place = true;
      m.q_bhtd = !c.q_bhtd;
      both_directions<bf16, float>(m);
    }
  }
  // The interleaved style past the token-block kernel's batch limit: the one-head kernel.
  Case big{.B = 65537, .T = 1, .Hq = 2, .Hk = 1, .D = 3, .interleaved = true};
  both_directions<bf16>(big);
  big.in_place = false;
  big.D = 5;
  both_directions<half, float>(big);
}

TEST_CASE("rope: odd dims with position ids, tables, partial rotary, policies", "[rope][gpu]") {
  for (bool inter : {false, true}) {
    Case c{.B = 2, .T = 50, .Hq = 8, .Hk = 2, .D = 41, .interleaved = inter};
    SECTION(std::string("odd, position ids and tables ") + (inter ? "interleaved" : "half")) {
      c.pos_ids = 64;
      both_directions<bf16>(c);
      c.pos_ids = 32;
      c.batch_tables = true;
      both_directions<half, float>(c);
      c.table_pad = 3;  // explicit table_stride_t
      both_directions<bf16>(c);
      c.pos_ids = 0;
      c.batch_tables = false;
      c.table_pad = 1;
      both_directions<float>(c);
    }
    SECTION(std::string("odd partial rotary ") + (inter ? "interleaved" : "half")) {
      c.D = 64;
      c.rd = 33;
      both_directions<bf16>(c);
      c.in_place = false;  // the odd channel and the rest copied
      both_directions<bf16>(c);
      c.D = 128;
      c.rd = 127;
      both_directions<half>(c);
      c.in_place = true;
      c.k_out_of_place = true;
      both_directions<float>(c);
      c.D = 41;  // even partial of an odd head_dim
      c.rd = 40;
      both_directions<bf16>(c);
      c.in_place = false;
      c.rd = 3;
      both_directions<bf16, float>(c);
    }
    SECTION(std::string("odd, head-group policies ") + (inter ? "interleaved" : "half")) {
      both_directions<bf16, bf16, G4>(c);  // the element-wise path whatever the policy
      both_directions<half, half, G3>(c);
    }
  }
}

TEST_CASE("rope: an out-of-range position with an odd head_dim", "[rope][gpu]") {
  // The token's rotated channels are NaN; the odd channel passes through like the unrotated ones.
  const std::int64_t B = 1, T = 4, H = 2, D = 41, W = 42;
  const auto qh = gpu_test::random_values<bf16>(B * T * H * D, 0, 1, nullptr);
  for (bool inter : {false, true}) {
    INFO((inter ? "interleaved" : "half-split"));
    DeviceBuffer<bf16> q(B * T * H * D), cs(T * W), sn(T * W);
    q.upload(qh);
    cs.upload(gpu_test::random_values<bf16>(T * W, 0, 1, nullptr));
    sn.upload(gpu_test::random_values<bf16>(T * W, 0, 1, nullptr));
    const std::vector<std::int64_t> pos = {0, -1, 2, 3};
    DeviceBuffer<std::int64_t> pb(4);
    pb.upload(pos);
    RopeArgs<bf16> a;
    a.q = {.in = q.ptr, .out = q.ptr, .heads = H, .stride_b = T * H * D, .stride_t = H * D, .stride_h = D};
    a.batch = B;
    a.seq = T;
    a.head_dim = D;
    a.cos = cs.ptr;
    a.sin = sn.ptr;
    a.table_rows = T;
    a.position_ids = pb.ptr;
    TIGON_OK(inter ? rope_forward<RopeInterleaved>(a, nullptr) : rope_forward(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto out = q.download();
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t i = (t * H + h) * D + d;
          const float v = to_float(out[i]);
          if (d == D - 1) {
            CHECK(v == to_float(qh[i]));
          } else if (t == 1) {
            CHECK(std::isnan(v));
          } else {
            CHECK(std::isfinite(v));
          }
        }
  }
}

TEST_CASE("rope: an out-of-range position gives NaN for its token only", "[rope][gpu]") {
  const std::int64_t B = 1, T = 4, H = 2, D = 64;
  DeviceBuffer<bf16> q(B * T * H * D), cs(T * D), sn(T * D);
  q.upload(gpu_test::random_values<bf16>(B * T * H * D, 0, 1, nullptr));
  cs.upload(gpu_test::random_values<bf16>(T * D, 0, 1, nullptr));
  sn.upload(gpu_test::random_values<bf16>(T * D, 0, 1, nullptr));
  const std::vector<std::int64_t> pos = {0, 1, 99, 3};
  DeviceBuffer<std::int64_t> pb(4);
  pb.upload(pos);
  RopeArgs<bf16> a;
  a.q = {.in = q.ptr, .out = q.ptr, .heads = H, .stride_b = T * H * D, .stride_t = H * D, .stride_h = D};
  a.batch = B;
  a.seq = T;
  a.head_dim = D;
  a.cos = cs.ptr;
  a.sin = sn.ptr;
  a.table_rows = T;
  a.position_ids = pb.ptr;
  TIGON_OK(rope_forward(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = q.download();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < H * D; ++i) {
      const float v = to_float(out[t * H * D + i]);
      if (t == 2) {
        CHECK(std::isnan(v));
      } else {
        CHECK(std::isfinite(v));
      }
    }
}


TEST_CASE("rope: M-RoPE sections (Qwen2-VL), every dtype, both kernels", "[rope][gpu]") {
  // Liger-Kernel's M-RoPE shapes, sections on and off the 16-byte chunks (8 / 12 / 12 straddles),
  // an odd head_dim (scalar path), position ids, per-batch tables, partial rotary, out of place.
  struct M {
    Case c;
    std::int64_t s0, s1, s2;
  };
  const M shapes[] = {
      {{.B = 2, .T = 131, .Hq = 28, .Hk = 4, .D = 128}, 16, 24, 24},
      {{.B = 1, .T = 128, .Hq = 12, .Hk = 2, .D = 96}, 16, 16, 16},
      {{.B = 2, .T = 37, .Hq = 64, .Hk = 8, .D = 64}, 8, 12, 12},
      {{.B = 1, .T = 2, .Hq = 2, .Hk = 2, .D = 8}, 2, 1, 1},
      {{.B = 2, .T = 9, .Hq = 3, .Hk = 1, .D = 65}, 10, 11, 11},  // odd: scalar path
      {{.B = 1, .T = 16, .Hq = 4, .Hk = 2, .D = 64}, 0, 32, 0},   // one plane in use
  };
  for (M m : shapes) {
    Case c = m.c;
    c.sec[0] = m.s0;
    c.sec[1] = m.s1;
    c.sec[2] = m.s2;
    both_directions<bf16>(c);
    both_directions<half>(c);
    both_directions<float>(c);
  }
  Case c{.B = 2, .T = 40, .Hq = 8, .Hk = 2, .D = 128};
  c.sec[0] = 16;
  c.sec[1] = 24;
  c.sec[2] = 24;
  SECTION("position ids, per-batch tables, padded rows, out of place") {
    c.pos_ids = 64;
    c.batch_tables = true;
    c.table_pad = 8;
    c.in_place = false;
    c.q_bhtd = true;
    both_directions<bf16>(c);
    c.pos_ids = 32;
    both_directions<float>(c);
  }
  SECTION("fp32 tables with bf16 q, k; groups of three heads") {
    both_directions<bf16, float>(c);
    both_directions<bf16, bf16, G3>(c);
  }
  SECTION("partial rotary, out of place (the one-head kernel)") {
    c.rd = 64;
    c.sec[0] = 8;
    c.sec[1] = 12;
    c.sec[2] = 12;
    c.in_place = false;
    both_directions<bf16>(c);
  }
}
