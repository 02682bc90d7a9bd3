// tigon/rope/rope.cuh - rotary position embedding of q and k in one launch, forward and backward.
//
// For each token (b, t) the cos / sin row is cos[b][pos][0 : W] (pos = t, or position_ids[b][t];
// W = 2 * ceil(rotary_dim / 2), Hugging Face's table width); the n = rotary_dim / 2 channel pairs
// (i, j) of every head are rotated:
//   y_i = c_i * x_i - s_i * x_j          (i the first member of its pair)
//   y_j = c_j * x_j + s_j * x_i
// with pairs (d, d + n) and table entries c_i = cos[d], c_j = cos[d + W/2] in the half-split style
// (Hugging Face rotate_half: Llama, Mistral, Qwen, ...), pairs (2d, 2d + 1) and entries cos[2d],
// cos[2d + 1] in the interleaved style (GPT-J). An odd rotary_dim's last channel (2n) and the
// channels from rotary_dim to head_dim pass through unchanged (partial rotary). The multimodal
// rotary of Qwen2-VL / Qwen2.5-VL (M-RoPE, half split) takes each pair's entries from one of three
// tables (temporal, height, width) chosen by the pair's section. The backward
// applies the transposed rotation (by -theta for HF's tables). Layouts are strides, so
// [B, T, H, D] and [B, H, T, D] (or any other with a contiguous last dimension) work for q and k
// independently.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"

#if defined(__CUDACC__)
#include "../core/device.hpp"
#include "../core/async_copy.cuh"
#include "../core/launch.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// Styles: compile-time policies naming each channel's partner.
struct RopeHalfSplit {
  static constexpr const char* name = "half_split";
};
struct RopeInterleaved {
  static constexpr const char* name = "interleaved";
};

// The launch's policy. The half-split style runs the head-group kernel: one 16-byte chunk of
// kHeads heads of a token per thread, the table chunk loaded once for all of them (a thread issues
// the loads of its heads, then rotates and stores them); it applies to 16-byte vectors, in place
// or with rotary_dim == head_dim, and fewer than 2^31 work items. The interleaved style runs the
// token-block kernel: one block per token (batches up to 65535), its threads laid out as
// (chunk, head), each loading its table chunk once and rotating it for two heads per pass; past
// its limits the interleaved style takes the head-group kernel. Calls outside both take the
// one-head kernel (one chunk of one head per thread). Derive to change a knob:
// `struct Mine : tigon::RopePolicy { static constexpr int kHeads = 4; };`.
struct RopePolicy {
  // Heads per thread of the head-group kernel, 1 to 16. Two: 94.5% of the copy rate at B4 T4096
  // 32/8 x 128 half-split on the H200, four 93.3%, the one-head kernel 88.1%.
  static constexpr int kHeads = 2;
};
using RopeDefaultPolicy = RopePolicy;  // the same policy, for source compatibility

namespace detail {

// Every static check of a RopePolicy, in one place (asserted by the launchers).
template <class P>
constexpr bool check_rope_policy() {
  static_assert(P::kHeads >= 1 && P::kHeads <= 16, "RopePolicy::kHeads: 1 to 16 heads per thread");
  return true;
}

}  // namespace detail

// One of q or k: element (b, t, h, d) lives at ptr[b*stride_b + t*stride_t + h*stride_h + d].
template <class T>
struct RopeTensor {
  const T* in = nullptr;
  T* out = nullptr;  // may be `in` itself (in place, same strides)
  std::int64_t heads = 0;
  std::int64_t stride_b = 0, stride_t = 0, stride_h = 0;              // of `in`
  std::int64_t out_stride_b = 0, out_stride_t = 0, out_stride_h = 0;  // of `out`; all 0: as `in`
};

template <class T, class C = T>
struct RopeArgs {
  RopeTensor<T> q;
  RopeTensor<T> k;  // k.in == nullptr: rotate q only
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;  // 0: head_dim; 2 to head_dim, odd included
  // Tables: row r of batch b at cos + b*table_stride_b + r*table_stride_t (table_stride_b 0: one
  // table shared by the batch; table_stride_t 0: 2 * ceil(rotary_dim / 2), i.e. rotary_dim, or
  // rotary_dim + 1 when it is odd, Hugging Face's width). A row needs rotary_dim entries (the last
  // of an odd width's W = rotary_dim + 1 is never read). sin has the same layout.
  const C* cos = nullptr;
  const C* sin = nullptr;
  std::int64_t table_rows = 0;  // rows per batch entry (>= seq without position ids)
  std::int64_t table_stride_b = 0;
  std::int64_t table_stride_t = 0;
  // Optional [batch, seq] row index into the table (packed or shifted sequences); at most one of
  // the two. A position outside [0, table_rows) writes NaN for that token (no out-of-bounds read).
  const std::int64_t* position_ids = nullptr;
  const std::int32_t* position_ids_i32 = nullptr;
  // Multimodal rotary (M-RoPE; the half-split style only): sections {t, h, w}, each >= 0 and
  // t + h + w = rotary_dim / 2, make cos and sin three tables (planes) of the layout above,
  // table_stride_plane elements apart; pair d (channels d and d + rotary_dim / 2) takes its
  // entries from plane 0 for d < t, plane 1 for t <= d < t + h, plane 2 past that: Hugging Face's
  // apply_multimodal_rotary_pos_emb with mrope_section {t, h, w} on cos / sin of shape
  // [3, batch, seq, W]. Position ids, when given, index every plane. All zero: one table.
  std::int64_t sections[3] = {0, 0, 0};
  std::int64_t table_stride_plane = 0;  // 0: planes back to back (batch * table_stride_b, or
                                        // table_rows times the row stride for a shared table)
};

// ------------------------------------------------------------------------------------------------
// 2. Math
// ------------------------------------------------------------------------------------------------

namespace rope_math {

// Rotate one pair (i first, j second). Forward: y = R x; backward: dx = R^T dy.
TIGON_HD void rotate(float xi, float xj, float ci, float cj, float si, float sj, bool backward,
                     float& yi, float& yj) {
  if (!backward) {
    yi = ci * xi - si * xj;
    yj = cj * xj + sj * xi;
  } else {
    yi = ci * xi + sj * xj;
    yj = cj * xj - si * xi;
  }
}

}  // namespace rope_math

// ------------------------------------------------------------------------------------------------
// Validation
// ------------------------------------------------------------------------------------------------

namespace detail {

inline constexpr std::int64_t kRopeMaxHeadDim = 1024;

template <class T>
struct RopeResolved {  // strides with defaults applied
  std::int64_t sb, st, sh, osb, ost, osh;
};

template <class T>
RopeResolved<T> resolve(const RopeTensor<T>& x) {
  const bool out_given = x.out_stride_b != 0 || x.out_stride_t != 0 || x.out_stride_h != 0;
  return {x.stride_b, x.stride_t, x.stride_h,
          out_given ? x.out_stride_b : x.stride_b, out_given ? x.out_stride_t : x.stride_t,
          out_given ? x.out_stride_h : x.stride_h};
}

// Byte range [begin, end) of a strided [B, T, H, D] tensor with non-negative strides.
inline std::pair<std::uintptr_t, std::uintptr_t> rope_range(const void* p, std::int64_t b,
                                                            std::int64_t t, std::int64_t h,
                                                            std::int64_t d, std::int64_t sb,
                                                            std::int64_t st, std::int64_t sh,
                                                            int elem) {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::int64_t last = (b - 1) * sb + (t - 1) * st + (h - 1) * sh + d;
  return {begin, begin + static_cast<std::uintptr_t>(last * elem)};
}

// A strided [B, T, H, D] tensor as a matrix of token rows st elements apart (each row its H heads'
// span), when the batch stride keeps the tokens on that lattice: two tensors of one fused buffer
// (q and k of a fused QKV projection) are then disjoint when their spans within a token's row are.
// The matrix covers every element of the tensor, so disjoint matrices mean disjoint tensors.
inline bool rope_token_rows(const void* p, std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d,
                            std::int64_t sb, std::int64_t st, std::int64_t sh, int elem, MatrixView& v) {
  if (st <= 0 || (b > 1 && sb % st != 0)) return false;
  const std::int64_t cols = (h - 1) * sh + d;
  if (cols > st) return false;
  v = MatrixView{p, (b > 1 ? (b - 1) * (sb / st) : 0) + t, cols, st, elem};
  return true;
}

template <class T, class C>
Status validate_tensor(const RopeArgs<T, C>& a, const RopeTensor<T>& x, const char* op,
                       const char* in_name, const char* out_name, const char* heads_name,
                       const char* stride_name) {
  using namespace check;
  TIGON_CHECK(not_null(x.in, op, in_name));
  TIGON_CHECK(not_null(x.out, op, out_name));
  TIGON_CHECK(positive(x.heads, op, heads_name));
  const RopeResolved<T> r = resolve(x);
  const std::int64_t strides[] = {r.sb, r.st, r.sh, r.osb, r.ost, r.osh};
  for (const std::int64_t s : strides) {
    if (s < 0) return Status::error(Errc::invalid_stride, op, stride_name, "strides must be >= 0");
  }
  if ((x.heads > 1 && std::min(r.sh, r.osh) < a.head_dim) ||
      (a.seq > 1 && std::min(r.st, r.ost) < a.head_dim) ||
      (a.batch > 1 && std::min(r.sb, r.osb) < a.head_dim)) {
    return Status::error(Errc::invalid_stride, op, stride_name,
                         "a stride smaller than head_dim (" + std::to_string(a.head_dim) +
                             ") would overlap heads");
  }
  const auto in = rope_range(x.in, a.batch, a.seq, x.heads, a.head_dim, r.sb, r.st, r.sh, sizeof(T));
  const auto out = rope_range(x.out, a.batch, a.seq, x.heads, a.head_dim, r.osb, r.ost, r.osh, sizeof(T));
  const bool same = x.in == x.out && r.sb == r.osb && r.st == r.ost && r.sh == r.osh;
  if (!same && in.first < out.second && out.first < in.second) {
    return Status::error(Errc::aliasing, op, out_name,
                         std::string("overlaps '") + in_name +
                             "' without being the same tensor (in place needs the same pointer and "
                             "strides)");
  }
  return Status();
}

// Byte range [begin, end) of the cos (or sin) tables a call reads: every plane, batch entry and row
// up to the rotary width.
template <class T, class C>
std::pair<std::uintptr_t, std::uintptr_t> rope_table_range(const RopeArgs<T, C>& a, const C* table) {
  const std::int64_t rd = a.rotary_dim == 0 ? a.head_dim : a.rotary_dim;
  const std::int64_t row = a.table_stride_t != 0 ? a.table_stride_t : rd + (rd & 1);
  std::int64_t last = (a.batch - 1) * a.table_stride_b + (a.table_rows - 1) * row + rd;
  if (a.sections[0] != 0 || a.sections[1] != 0 || a.sections[2] != 0) {
    const std::int64_t plane = a.table_stride_plane != 0 ? a.table_stride_plane
                               : a.table_stride_b != 0   ? a.batch * a.table_stride_b
                                                         : a.table_rows * row;
    last += 2 * plane;
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(table);
  return {begin, begin + static_cast<std::uintptr_t>(last) * sizeof(C)};
}

// An output (q.out or k.out) apart from the tables and the position ids the kernel reads.
template <class T, class C>
Status rope_output_apart(const RopeArgs<T, C>& a, const RopeTensor<T>& x, const char* op, const char* out_name) {
  const RopeResolved<T> r = resolve(x);
  const auto out = rope_range(x.out, a.batch, a.seq, x.heads, a.head_dim, r.osb, r.ost, r.osh, sizeof(T));
  const void* ids = a.position_ids != nullptr ? static_cast<const void*>(a.position_ids)
                                              : static_cast<const void*>(a.position_ids_i32);
  const auto id_begin = reinterpret_cast<std::uintptr_t>(ids);
  const std::uintptr_t id_bytes = a.position_ids != nullptr ? 8 : 4;
  const std::pair<std::uintptr_t, std::uintptr_t> read[] = {
      rope_table_range(a, a.cos), rope_table_range(a, a.sin),
      {id_begin, ids == nullptr ? id_begin : id_begin + static_cast<std::uintptr_t>(a.batch * a.seq) * id_bytes}};
  const char* names[] = {"cos", "sin", "position_ids"};
  for (int i = 0; i < 3; ++i) {
    if (read[i].first < out.second && out.first < read[i].second) {
      return Status::error(Errc::aliasing, op, out_name, std::string("overlaps '") + names[i] + "', which the call reads");
    }
  }
  return Status();
}

template <class T, class C>
Status validate(const RopeArgs<T, C>& a, const char* op) {
  using namespace check;
  TIGON_CHECK(positive(a.batch, op, "batch"));
  TIGON_CHECK(positive(a.seq, op, "seq"));
  TIGON_CHECK(positive(a.head_dim, op, "head_dim"));
  TIGON_CHECK(at_most(a.head_dim, kRopeMaxHeadDim, op, "head_dim"));
  const std::int64_t rd = a.rotary_dim == 0 ? a.head_dim : a.rotary_dim;
  if (rd < 2 || rd > a.head_dim) {
    return Status::error(Errc::invalid_size, op, "rotary_dim",
                         "must be in [2, head_dim (" + std::to_string(a.head_dim) + ")], got " +
                             std::to_string(rd));
  }
  TIGON_CHECK(not_null(a.cos, op, "cos"));
  TIGON_CHECK(not_null(a.sin, op, "sin"));
  TIGON_CHECK(positive(a.table_rows, op, "table_rows"));
  if (a.position_ids == nullptr && a.position_ids_i32 == nullptr && a.table_rows < a.seq) {
    return Status::error(Errc::invalid_size, op, "table_rows",
                         "without position ids the table needs seq (" + std::to_string(a.seq) +
                             ") rows, has " + std::to_string(a.table_rows));
  }
  if (a.position_ids != nullptr && a.position_ids_i32 != nullptr) {
    return Status::error(Errc::invalid_value, op, "position_ids", "give int64 or int32 ids, not both");
  }
  if (a.table_stride_b < 0) {
    return Status::error(Errc::invalid_stride, op, "table_stride_b", "must be >= 0");
  }
  TIGON_CHECK(row_stride(a.table_stride_t, rd, op, "table_stride_t"));
  if (a.sections[0] != 0 || a.sections[1] != 0 || a.sections[2] != 0) {
    if (a.sections[0] < 0 || a.sections[1] < 0 || a.sections[2] < 0 ||
        a.sections[0] + a.sections[1] + a.sections[2] != rd / 2) {
      return Status::error(Errc::invalid_size, op, "sections",
                           "must be >= 0 and sum to rotary_dim / 2 (" + std::to_string(rd / 2) + "), got {" +
                               std::to_string(a.sections[0]) + ", " + std::to_string(a.sections[1]) + ", " +
                               std::to_string(a.sections[2]) + "}");
    }
    if (a.table_stride_plane < 0) {
      return Status::error(Errc::invalid_stride, op, "table_stride_plane", "must be >= 0");
    }
  }
  TIGON_CHECK(validate_tensor(a, a.q, op, "q.in", "q.out", "q.heads", "q.stride"));
  TIGON_CHECK(rope_output_apart(a, a.q, op, "q.out"));
  if (a.k.in != nullptr || a.k.out != nullptr) {
    TIGON_CHECK(validate_tensor(a, a.k, op, "k.in", "k.out", "k.heads", "k.stride"));
    TIGON_CHECK(rope_output_apart(a, a.k, op, "k.out"));
    const RopeResolved<T> rq = resolve(a.q), rk = resolve(a.k);
    const auto qo = rope_range(a.q.out, a.batch, a.seq, a.q.heads, a.head_dim, rq.osb, rq.ost, rq.osh, sizeof(T));
    const auto ko = rope_range(a.k.out, a.batch, a.seq, a.k.heads, a.head_dim, rk.osb, rk.ost, rk.osh, sizeof(T));
    const auto ki = rope_range(a.k.in, a.batch, a.seq, a.k.heads, a.head_dim, rk.sb, rk.st, rk.sh, sizeof(T));
    const auto qi = rope_range(a.q.in, a.batch, a.seq, a.q.heads, a.head_dim, rq.sb, rq.st, rq.sh, sizeof(T));
    // Overlapping byte ranges may still hold disjoint heads (q and k of one fused QKV buffer).
    auto rows = [&](const void* p, std::int64_t h, std::int64_t sb, std::int64_t st, std::int64_t sh, MatrixView& v) {
      return rope_token_rows(p, a.batch, a.seq, h, a.head_dim, sb, st, sh, sizeof(T), v);
    };
    auto overlap = [&](auto x, auto y, const void* px, std::int64_t hx, const RopeResolved<T>& rx, bool x_out,
                       const void* py, std::int64_t hy, const RopeResolved<T>& ry, bool y_out) {
      if (!(x.first < y.second && y.first < x.second)) return false;
      MatrixView vx, vy;
      const bool mx = x_out ? rows(px, hx, rx.osb, rx.ost, rx.osh, vx) : rows(px, hx, rx.sb, rx.st, rx.sh, vx);
      const bool my = y_out ? rows(py, hy, ry.osb, ry.ost, ry.osh, vy) : rows(py, hy, ry.sb, ry.st, ry.sh, vy);
      return !(mx && my && !check::overlap(vx, vy));
    };
    if (overlap(qo, ko, a.q.out, a.q.heads, rq, true, a.k.out, a.k.heads, rk, true) ||
        overlap(qo, ki, a.q.out, a.q.heads, rq, true, a.k.in, a.k.heads, rk, false) ||
        overlap(ko, qi, a.k.out, a.k.heads, rk, true, a.q.in, a.q.heads, rq, false)) {
      return Status::error(Errc::aliasing, op, "k.out", "q and k outputs must not overlap each other's data");
    }
  }
  return Status();
}

}  // namespace detail

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T, class C>
struct RopeParams {
  const T* in[2];
  T* out[2];
  std::int64_t sb[2], st[2], sh[2], osb[2], ost[2], osh[2];
  int heads[2];  // heads[1] == 0: no k
  int seq;
  std::int64_t tokens;
  int head_dim, rotary_dim;
  const C* cos;
  const C* sin;
  std::int64_t table_rows, tsb, tst;
  const std::int64_t* pos64;
  const std::int32_t* pos32;
  std::int64_t tsp;  // M-RoPE: elements between the table's planes; 0: one table
  int sec1, sec2;    // M-RoPE: the first pairs of planes 1 and 2
  bool backward;
};

inline constexpr int kRopeThreads = 256;

// The table row of token (b, t): t, or its position id when ids are given (may lie outside the
// table: the caller writes NaN then).
template <class T, class C>
TIGON_DEVICE std::int64_t rope_position(const RopeParams<T, C>& p, std::int64_t b, std::int64_t t) {
  std::int64_t row = t;
  if (p.pos64 != nullptr) row = p.pos64[b * p.seq + t];
  if (p.pos32 != nullptr) row = p.pos32[b * p.seq + t];
  return row;
}

// M-RoPE: the plane of pair c (0, 1 or 2 by its section).
template <class T, class C>
TIGON_DEVICE int rope_plane(const RopeParams<T, C>& p, int c) {
  return static_cast<int>(c >= p.sec1) + static_cast<int>(c >= p.sec2);
}

// M-RoPE: the planes lo and hi of pairs d and d + kV - 1, and the table rows cr, sr moved to
// plane lo's.
template <int kV, class T, class C>
TIGON_DEVICE void rope_mrope_rows(const RopeParams<T, C>& p, int d, const C*& cr, const C*& sr, int& lo, int& hi) {
  lo = rope_plane(p, d);
  hi = rope_plane(p, d + kV - 1);
  cr += lo * p.tsp;
  sr += lo * p.tsp;
}

// M-RoPE: the table chunks of pairs [d, d + kV) were loaded from plane lo (rows cr, sr of that
// plane; the second members' at offset off); a chunk that straddles a section boundary takes its
// later pairs' entries from their planes, up to hi.
template <int kV, class T, class C>
TIGON_DEVICE void rope_mrope_straddle(const RopeParams<T, C>& p, const C* cr, const C* sr, int d, int off, int lo,
                                      int hi, AlignedVec<C, kV>& c1, AlignedVec<C, kV>& c2, AlignedVec<C, kV>& s1,
                                      AlignedVec<C, kV>& s2) {
  for (int q = lo + 1; q <= hi; ++q) {
    const std::int64_t dq = (q - lo) * p.tsp;
    const AlignedVec<C, kV> a1 = load_vec<kV>(cr + dq + d), a2 = load_vec<kV>(cr + dq + off + d);
    const AlignedVec<C, kV> b1 = load_vec<kV>(sr + dq + d), b2 = load_vec<kV>(sr + dq + off + d);
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      if (rope_plane(p, d + e) == q) {
        c1.v[e] = a1.v[e];
        c2.v[e] = a2.v[e];
        s1.v[e] = b1.v[e];
        s2.v[e] = b2.v[e];
      }
    }
  }
}

// Half-split style: element e of x1 pairs with element e of x2 (channels d and d + rotary/2).
template <class T, class C, int kV>
TIGON_DEVICE void rope_rotate_halves(const AlignedVec<T, kV>& x1, const AlignedVec<T, kV>& x2,
                                     const AlignedVec<C, kV>& c1, const AlignedVec<C, kV>& c2,
                                     const AlignedVec<C, kV>& s1, const AlignedVec<C, kV>& s2, bool backward,
                                     bool bad, AlignedVec<T, kV>& y1, AlignedVec<T, kV>& y2) {
  float fx1[kV], fx2[kV], fc1[kV], fc2[kV], fs1[kV], fs2[kV];
  to_floats(x1, fx1);
  to_floats(x2, fx2);
  to_floats(c1, fc1);
  to_floats(c2, fc2);
  to_floats(s1, fs1);
  to_floats(s2, fs2);
#pragma unroll
  for (int e = 0; e < kV; ++e) {
    float a, c;
    rope_math::rotate(fx1[e], fx2[e], fc1[e], fc2[e], fs1[e], fs2[e], backward, a, c);
    if (bad) a = c = __int_as_float(0x7fc00000);
    y1.v[e] = from_float<T>(a);
    y2.v[e] = from_float<T>(c);
  }
}

// Interleaved style: elements (e, e + 1) of x are a pair.
template <class T, class C, int kV>
TIGON_DEVICE void rope_rotate_pairs(const AlignedVec<T, kV>& x, const AlignedVec<C, kV>& cv,
                                    const AlignedVec<C, kV>& sv, bool backward, bool bad, AlignedVec<T, kV>& y) {
  static_assert(kV % 2 == 0, "interleaved chunks hold whole pairs");
  float fx[kV], fc[kV], fs[kV];
  to_floats(x, fx);
  to_floats(cv, fc);
  to_floats(sv, fs);
#pragma unroll
  for (int e = 0; e < kV; e += 2) {
    float a, c;
    rope_math::rotate(fx[e], fx[e + 1], fc[e], fc[e + 1], fs[e], fs[e + 1], backward, a, c);
    if (bad) a = c = __int_as_float(0x7fc00000);
    y.v[e] = from_float<T>(a);
    y.v[e + 1] = from_float<T>(c);
  }
}

// One work item = one kV-wide chunk of one head of one token: a rotated chunk pair (half split),
// a rotated chunk of pairs (interleaved), or a pass-through chunk (partial rotary, out of place,
// and an odd rotary_dim's last channel).
// kMrope: M-RoPE's planes (the half-split style; a compile-time switch, so that the other calls'
// kernels carry none of it).
template <class T, class C, class Style, int kV, bool kMrope>
TIGON_KERNEL void __launch_bounds__(kRopeThreads) rope_kernel(const RopeParams<T, C> p) {
  detail::grid_dependency_sync();
  constexpr bool kHalf = std::is_same_v<Style, RopeHalfSplit>;
  const int rd = p.rotary_dim;
  const int half = rd / 2;
  // Channels in pairs, and the table offset of the second members (half split). They differ from
  // rd and half only for an odd rotary_dim, which takes the scalar path (kV == 1).
  const int paired = kV == 1 ? 2 * half : rd;
  const int table_half = kV == 1 ? rd - half : half;
  // Interleaved items hold whole pairs: kV elements, or one pair on the scalar path.
  constexpr int kPairW = kV < 2 ? 2 : kV;
  const int rot_chunks = kHalf ? half / kV : rd / kPairW;
  const int pass_chunks = (p.head_dim - paired) / kV;
  const int per_head = rot_chunks + pass_chunks;
  const std::int64_t per_token = static_cast<std::int64_t>(p.heads[0] + p.heads[1]) * per_head;
  const std::int64_t total = p.tokens * per_token;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kRopeThreads + threadIdx.x;
       item < total; item += static_cast<std::int64_t>(gridDim.x) * kRopeThreads) {
    // 32-bit index arithmetic whenever the sizes allow it (64-bit division is a long sequence).
    std::int64_t b, t;
    int rem;
    if (total <= 0x7fffffff) {
      const auto it = static_cast<unsigned>(item), pt = static_cast<unsigned>(per_token);
      const unsigned tk = it / pt;
      rem = static_cast<int>(it - tk * pt);
      const auto sq = static_cast<unsigned>(p.seq);
      const unsigned bb = tk / sq;
      b = bb;
      t = tk - bb * sq;
    } else {
      const std::int64_t token = item / per_token;
      rem = static_cast<int>(item - token * per_token);
      b = token / p.seq;
      t = token - b * p.seq;
    }
    int head = rem / per_head;
    const int chunk = rem - head * per_head;
    const int which = head < p.heads[0] ? 0 : 1;
    if (which == 1) head -= p.heads[0];
    const T* x = p.in[which] + b * p.sb[which] + t * p.st[which] + head * p.sh[which];
    T* y = p.out[which] + b * p.osb[which] + t * p.ost[which] + head * p.osh[which];
    auto load_x = [&](const T* a) { return load_vec<kV>(a); };
    if (chunk >= rot_chunks) {  // partial rotary: channels past the pairs pass through
      const int d = paired + (chunk - rot_chunks) * kV;
      if (x != y) store_vec(y + d, load_x(x + d));
      continue;
    }
    const std::int64_t row = rope_position(p, b, t);
    const bool bad = row < 0 || row >= p.table_rows;
    const C* cr = p.cos + b * p.tsb + (bad ? 0 : row) * p.tst;
    const C* sr = p.sin + b * p.tsb + (bad ? 0 : row) * p.tst;
    if constexpr (kHalf) {
      const int d = chunk * kV;
      const AlignedVec<T, kV> x1 = load_x(x + d), x2 = load_x(x + d + half);
      int lo = 0, hi = 0;
      if constexpr (kMrope) rope_mrope_rows<kV>(p, d, cr, sr, lo, hi);
      AlignedVec<C, kV> c1 = load_vec<kV>(cr + d), c2 = load_vec<kV>(cr + d + table_half);
      AlignedVec<C, kV> s1 = load_vec<kV>(sr + d), s2 = load_vec<kV>(sr + d + table_half);
      if constexpr (kMrope) {
        if (hi != lo) rope_mrope_straddle<kV>(p, cr, sr, d, table_half, lo, hi, c1, c2, s1, s2);
      }
      AlignedVec<T, kV> y1, y2;
      rope_rotate_halves(x1, x2, c1, c2, s1, s2, p.backward, bad, y1, y2);
      store_vec(y + d, y1);
      store_vec(y + d + half, y2);
    } else if constexpr (kV == 1) {  // one pair, element by element (any alignment)
      const int d = chunk * 2;
      float a, c;
      rope_math::rotate(to_float(x[d]), to_float(x[d + 1]), to_float(cr[d]), to_float(cr[d + 1]),
                        to_float(sr[d]), to_float(sr[d + 1]), p.backward, a, c);
      if (bad) a = c = __int_as_float(0x7fc00000);
      y[d] = from_float<T>(a);
      y[d + 1] = from_float<T>(c);
    } else {
      const int d = chunk * kV;
      const AlignedVec<T, kV> xv = load_x(x + d);
      const AlignedVec<C, kV> cv = load_vec<kV>(cr + d), sv = load_vec<kV>(sr + d);
      AlignedVec<T, kV> yv;
      rope_rotate_pairs(xv, cv, sv, p.backward, bad, yv);
      store_vec(y + d, yv);
    }
  }
}

// The head-group kernel (policy kHeads = G): item = (token, group of G heads, chunk), chunk
// fastest, so that the lanes of a warp cover a head's chunks side by side. q's heads come first,
// then k's; a group may hold heads of both. Only rotated chunks: the launch takes this kernel in
// place or without pass-through channels.
template <class T, class C, class Style, int kV, int kG, bool kMrope>
TIGON_KERNEL void __launch_bounds__(kRopeThreads) rope_heads_kernel(const RopeParams<T, C> p) {
  constexpr bool kHalf = std::is_same_v<Style, RopeHalfSplit>;
  const int half = p.rotary_dim / 2;
  const unsigned rot_chunks = static_cast<unsigned>(kHalf ? half / kV : p.rotary_dim / kV);
  const int heads = p.heads[0] + p.heads[1];
  const unsigned groups = static_cast<unsigned>((heads + kG - 1) / kG);
  const unsigned per_token = groups * rot_chunks;
  const unsigned total = static_cast<unsigned>(p.tokens) * per_token;  // < 2^31 (launch)
  const unsigned item = blockIdx.x * kRopeThreads + threadIdx.x;
  if (item >= total) {
    detail::grid_dependency_sync();
    return;
  }
  const unsigned tk = item / per_token;
  const unsigned rem = item - tk * per_token;
  const unsigned group = rem / rot_chunks;
  const int d = static_cast<int>(rem - group * rot_chunks) * kV;
  const unsigned bb = tk / static_cast<unsigned>(p.seq);
  const std::int64_t b = bb, t = tk - bb * static_cast<unsigned>(p.seq);
  // Before the wait, ask the L2 for this thread's lines of its heads (a hint, launch.cuh).
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int h = static_cast<int>(group) * kG + j;
    if (h < heads) {
      const int w = h < p.heads[0] ? 0 : 1;
      const std::int64_t hh = w == 0 ? h : h - p.heads[0];
      const T* x = p.in[w] + b * p.sb[w] + t * p.st[w] + hh * p.sh[w];
      prefetch_l2_line_of(x + d, kV * sizeof(T));
      if constexpr (kHalf) prefetch_l2_line_of(x + d + half, kV * sizeof(T));
    }
  }
  detail::grid_dependency_sync();
  const std::int64_t row = rope_position(p, b, t);
  const bool bad = row < 0 || row >= p.table_rows;
  const C* cr = p.cos + b * p.tsb + (bad ? 0 : row) * p.tst;
  const C* sr = p.sin + b * p.tsb + (bad ? 0 : row) * p.tst;
  // The table chunk, once for the G heads (the second halves only in the half-split style).
  int lo = 0, hi = 0;
  if constexpr (kMrope) rope_mrope_rows<kV>(p, d, cr, sr, lo, hi);
  AlignedVec<C, kV> c1 = load_vec<kV>(cr + d), s1 = load_vec<kV>(sr + d);
  AlignedVec<C, kV> c2{}, s2{};
  if constexpr (kHalf) {
    c2 = load_vec<kV>(cr + d + half);
    s2 = load_vec<kV>(sr + d + half);
  }
  if constexpr (kMrope) {
    if (hi != lo) rope_mrope_straddle<kV>(p, cr, sr, d, half, lo, hi, c1, c2, s1, s2);
  }
  auto offset = [&](int h, bool out) {
    const int w = h < p.heads[0] ? 0 : 1;
    const std::int64_t hh = w == 0 ? h : h - p.heads[0];
    return out ? b * p.osb[w] + t * p.ost[w] + hh * p.osh[w] : b * p.sb[w] + t * p.st[w] + hh * p.sh[w];
  };
  const int h0 = static_cast<int>(group) * kG;
  AlignedVec<T, kV> xa[kG], xb[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int h = h0 + j;
    if (h < heads) {
      const T* x = p.in[h < p.heads[0] ? 0 : 1] + offset(h, false);
      xa[j] = load_vec<kV>(x + d);
      if constexpr (kHalf) xb[j] = load_vec<kV>(x + d + half);
    }
  }
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int h = h0 + j;
    if (h >= heads) continue;
    T* y = p.out[h < p.heads[0] ? 0 : 1] + offset(h, true);
    if constexpr (kHalf) {
      AlignedVec<T, kV> y1, y2;
      rope_rotate_halves(xa[j], xb[j], c1, c2, s1, s2, p.backward, bad, y1, y2);
      store_vec(y + d, y1);
      store_vec(y + d + half, y2);
    } else {
      AlignedVec<T, kV> yv;
      rope_rotate_pairs(xa[j], c1, s1, p.backward, bad, yv);
      store_vec(y + d, yv);
    }
  }
}

// The token-block kernel (the interleaved style): block (blockIdx.x, blockIdx.y) = token (t, b);
// thread (x, y) = chunk x of heads y, y + 2 * blockDim.y, ... and y + blockDim.y, ... (q's heads
// first, then k's). Chunks past the rotated ones pass through (out of place), an odd
// rotary_dim's last channel included.
template <class T, class C, int kV>
TIGON_KERNEL void __launch_bounds__(kRopeThreads) rope_token_kernel(const RopeParams<T, C> p) {
  detail::grid_dependency_sync();
  constexpr int kPairW = kV < 2 ? 2 : kV;
  const int rd = p.rotary_dim;
  const int rot_chunks = rd / kPairW;
  // Channels in pairs: rd but for an odd rotary_dim (the scalar path only).
  const int paired = kV == 1 ? 2 * rot_chunks : rd;
  const int chunk = static_cast<int>(threadIdx.x);
  const bool rotated = chunk < rot_chunks;
  const int heads = p.heads[0] + p.heads[1];
  const int hy = static_cast<int>(blockDim.y);
  const std::int64_t b = blockIdx.y, t = blockIdx.x;
  const std::int64_t row = rope_position(p, b, t);
  const bool bad = row < 0 || row >= p.table_rows;
  const C* cr = p.cos + b * p.tsb + (bad ? 0 : row) * p.tst;
  const C* sr = p.sin + b * p.tsb + (bad ? 0 : row) * p.tst;
  // Element offset of this thread's chunk: rotated (a chunk of pairs), or passed through.
  const int d = rotated ? chunk * kPairW : paired + (chunk - rot_chunks) * kV;
  AlignedVec<C, kV> c1{}, s1{};
  if constexpr (kV > 1) {
    if (rotated) {
      c1 = load_vec<kV>(cr + d);
      s1 = load_vec<kV>(sr + d);
    }
  }
  auto in_ptr = [&](int h) {
    const int w = h < p.heads[0] ? 0 : 1;
    const std::int64_t hh = w == 0 ? h : h - p.heads[0];
    return p.in[w] + b * p.sb[w] + t * p.st[w] + hh * p.sh[w];
  };
  auto out_ptr = [&](int h) {
    const int w = h < p.heads[0] ? 0 : 1;
    const std::int64_t hh = w == 0 ? h : h - p.heads[0];
    return p.out[w] + b * p.osb[w] + t * p.ost[w] + hh * p.osh[w];
  };
  for (int h0 = static_cast<int>(threadIdx.y); h0 < heads; h0 += 2 * hy) {
    const int h1 = h0 + hy;
    const bool two = h1 < heads;
    const T* x0 = in_ptr(h0);
    const T* x1 = two ? in_ptr(h1) : x0;
    T* y0 = out_ptr(h0);
    T* y1 = two ? out_ptr(h1) : y0;
    if (!rotated) {  // partial rotary, out of place: copy the channel chunk (q and k may differ)
      const bool copy0 = x0 != y0, copy1 = two && x1 != y1;
      AlignedVec<T, kV> v0{}, v1{};
      if (copy0) v0 = load_vec<kV>(x0 + d);
      if (copy1) v1 = load_vec<kV>(x1 + d);
      if (copy0) store_vec(y0 + d, v0);
      if (copy1) store_vec(y1 + d, v1);
      continue;
    }
    if constexpr (kV == 1) {  // one pair per chunk, element by element (any alignment)
      const int dd = chunk * 2;
      for (int j = 0; j < (two ? 2 : 1); ++j) {
        const T* x = j == 0 ? x0 : x1;
        T* y = j == 0 ? y0 : y1;
        float a, c;
        rope_math::rotate(to_float(x[dd]), to_float(x[dd + 1]), to_float(cr[dd]), to_float(cr[dd + 1]),
                          to_float(sr[dd]), to_float(sr[dd + 1]), p.backward, a, c);
        if (bad) a = c = __int_as_float(0x7fc00000);
        y[dd] = from_float<T>(a);
        y[dd + 1] = from_float<T>(c);
      }
    } else {
      const AlignedVec<T, kV> a = load_vec<kV>(x0 + d);
      AlignedVec<T, kV> bv{};
      if (two) bv = load_vec<kV>(x1 + d);
      AlignedVec<T, kV> o;
      rope_rotate_pairs(a, c1, s1, p.backward, bad, o);
      store_vec(y0 + d, o);
      if (two) {
        rope_rotate_pairs(bv, c1, s1, p.backward, bad, o);
        store_vec(y1 + d, o);
      }
    }
  }
}

template <class T, class C>
RopeParams<T, C> rope_params(const RopeArgs<T, C>& a, bool backward) {
  RopeParams<T, C> p{};
  const RopeTensor<T>* xs[2] = {&a.q, &a.k};
  for (int i = 0; i < 2; ++i) {
    const bool present = xs[i]->in != nullptr;
    const RopeResolved<T> r = resolve(*xs[i]);
    p.in[i] = xs[i]->in;
    p.out[i] = xs[i]->out;
    p.sb[i] = r.sb; p.st[i] = r.st; p.sh[i] = r.sh;
    p.osb[i] = r.osb; p.ost[i] = r.ost; p.osh[i] = r.osh;
    p.heads[i] = present ? static_cast<int>(xs[i]->heads) : 0;
  }
  p.seq = static_cast<int>(a.seq);
  p.tokens = a.batch * a.seq;
  p.head_dim = static_cast<int>(a.head_dim);
  p.rotary_dim = static_cast<int>(a.rotary_dim == 0 ? a.head_dim : a.rotary_dim);
  p.cos = a.cos;
  p.sin = a.sin;
  p.table_rows = a.table_rows;
  p.tsb = a.table_stride_b;
  p.tst = a.table_stride_t == 0 ? p.rotary_dim + p.rotary_dim % 2 : a.table_stride_t;
  p.pos64 = a.position_ids;
  p.pos32 = a.position_ids_i32;
  const bool mrope = a.sections[0] != 0 || a.sections[1] != 0 || a.sections[2] != 0;
  p.tsp = !mrope ? 0 : a.table_stride_plane != 0 ? a.table_stride_plane
                     : p.tsb != 0                ? a.batch * p.tsb
                                                 : a.table_rows * p.tst;
  p.sec1 = static_cast<int>(a.sections[0]);
  p.sec2 = static_cast<int>(a.sections[0] + a.sections[1]);
  p.backward = backward;
  return p;
}

// Width of the accesses every pointer, stride and size allows (elements of T). An odd rotary_dim
// is never a multiple of kV: it takes the element-wise path.
template <class T, class C, class Style>
int rope_vec(const RopeParams<T, C>& p) {
  constexpr int kV = kVecElems<T>;
  static_assert(kV % 2 == 0, "the vector kernels take whole pairs");
  const bool half = std::is_same_v<Style, RopeHalfSplit>;
  auto ok = [&](std::int64_t v) { return v % kV == 0; };
  bool vec = ok(p.head_dim) && ok(p.rotary_dim) && (!half || ok(p.rotary_dim / 2)) && ok(p.tst) &&
             ok(p.tsb) && ok(p.tsp) && is_aligned(p.cos, kV * sizeof(C)) && is_aligned(p.sin, kV * sizeof(C));
  for (int i = 0; i < 2; ++i) {
    if (p.heads[i] == 0) continue;
    vec = vec && ok(p.sb[i]) && ok(p.st[i]) && ok(p.sh[i]) && ok(p.osb[i]) && ok(p.ost[i]) &&
          ok(p.osh[i]) && is_aligned(p.in[i], kV * sizeof(T)) && is_aligned(p.out[i], kV * sizeof(T));
  }
  return vec ? kV : 1;
}

template <class T, class C, class Style, int kV, bool kMrope>
Status launch_rope(const RopeParams<T, C>& p, cudaStream_t stream, const char* op) {
  const int chunks = std::is_same_v<Style, RopeHalfSplit> ? p.rotary_dim / 2 / kV
                                                          : p.rotary_dim / (kV < 2 ? 2 : kV);
  const int paired = p.rotary_dim / 2 * 2;  // an odd rotary_dim's last channel passes through
  const std::int64_t items =
      p.tokens * (p.heads[0] + p.heads[1]) * (chunks + (p.head_dim - paired) / kV);
  // One item per thread, as many blocks as it takes (a grid-stride loop covers the rest only past
  // 2^31 - 1 blocks): freshly scheduled blocks stream closer to the copy rate than resident ones
  // looping over the tensor (measured on the H200).
  const auto grid = static_cast<unsigned>(
      std::clamp<std::int64_t>(ceil_div<std::int64_t>(items, kRopeThreads), 1, 0x7fffffff));
  return launch(op, rope_kernel<T, C, Style, kV, kMrope>, {dim3(grid), dim3(kRopeThreads), 0, stream}, p);
}

// The head-group kernel's launch, when the call allows it (see RopePolicy); `launched` false: not
// taken (nothing launched). The half-split style's kernel; the interleaved style's where its
// token-block kernel does not apply.
template <class T, class C, class Style, int kV, int kG, bool kMrope>
Status launch_rope_heads(const RopeParams<T, C>& p, cudaStream_t stream, const char* op, bool& launched) {
  launched = false;
  const bool in_place = p.in[0] == p.out[0] && p.sb[0] == p.osb[0] && p.st[0] == p.ost[0] && p.sh[0] == p.osh[0] &&
                        (p.heads[1] == 0 || (p.in[1] == p.out[1] && p.sb[1] == p.osb[1] &&
                                             p.st[1] == p.ost[1] && p.sh[1] == p.osh[1]));
  if (!in_place && p.rotary_dim != p.head_dim) return Status();
  const std::int64_t chunks = std::is_same_v<Style, RopeHalfSplit> ? p.rotary_dim / 2 / kV : p.rotary_dim / kV;
  const std::int64_t groups = ceil_div<std::int64_t>(p.heads[0] + p.heads[1], kG);
  const std::int64_t items = p.tokens * groups * chunks;
  if (items <= 0 || items > 0x7fffffff - kRopeThreads) return Status();
  const auto grid = static_cast<unsigned>(ceil_div<std::int64_t>(items, kRopeThreads));
  TIGON_CHECK(launch(op, rope_heads_kernel<T, C, Style, kV, kG, kMrope>, {dim3(grid), dim3(kRopeThreads), 0, stream}, p));
  launched = true;
  return Status();
}

// The token-block kernel's launch (the interleaved style); `launched` false: not taken (batch >
// 65535, or more chunks per head than threads per block).
// Block: (chunks per head) x (heads per pass), about 256 threads, each thread two heads per pass.
template <class T, class C, int kV>
Status launch_rope_tokens(const RopeParams<T, C>& p, std::int64_t batch, cudaStream_t stream, const char* op,
                          bool& launched) {
  launched = false;
  if (batch > 65535 || p.seq < 1) return Status();
  const int pair_w = kV < 2 ? 2 : kV;
  const int per_head = p.rotary_dim / pair_w + (p.head_dim - p.rotary_dim / 2 * 2) / kV;
  if (per_head < 1 || per_head > kRopeThreads) return Status();
  const int heads = p.heads[0] + p.heads[1];
  const int max_y = std::max(1, kRopeThreads / per_head);
  const int passes = static_cast<int>(ceil_div<std::int64_t>(heads, 2 * max_y));  // two heads per thread
  const int hy = std::min(max_y, static_cast<int>(ceil_div<std::int64_t>(heads, 2 * passes)));
  const dim3 grid(static_cast<unsigned>(p.seq), static_cast<unsigned>(batch));
  const dim3 block(static_cast<unsigned>(per_head), static_cast<unsigned>(std::max(hy, 1)));
  TIGON_CHECK(launch(op, rope_token_kernel<T, C, kV>, {grid, block, 0, stream}, p));
  launched = true;
  return Status();
}

template <class Style, class Policy, class T, class C>
Status rope_impl(const RopeArgs<T, C>& a, bool backward, cudaStream_t stream, const char* op) {
  static_assert(check_rope_policy<Policy>());
  TIGON_CHECK(validate(a, op));
  if (std::is_same_v<Style, RopeInterleaved> && (a.sections[0] != 0 || a.sections[1] != 0 || a.sections[2] != 0)) {
    return Status::error(Errc::invalid_value, op, "sections", "M-RoPE sections need the half-split style");
  }
  const RopeParams<T, C> p = rope_params(a, backward);
  const int v = rope_vec<T, C, Style>(p);
  if constexpr (std::is_same_v<Style, RopeInterleaved>) {
    bool launched = false;
    if (v == kVecElems<T>) {
      TIGON_CHECK((launch_rope_tokens<T, C, kVecElems<T>>(p, a.batch, stream, op, launched)));
    } else {
      TIGON_CHECK((launch_rope_tokens<T, C, 1>(p, a.batch, stream, op, launched)));
    }
    if (launched) return Status();
  }
  auto run = [&](auto mrope_c) -> Status {
    constexpr bool kMrope = decltype(mrope_c)::value;
    if (v == kVecElems<T>) {
      bool launched = false;
      TIGON_CHECK((launch_rope_heads<T, C, Style, kVecElems<T>, Policy::kHeads, kMrope>(p, stream, op, launched)));
      if (launched) return Status();
      return launch_rope<T, C, Style, kVecElems<T>, kMrope>(p, stream, op);
    }
    return launch_rope<T, C, Style, 1, kMrope>(p, stream, op);
  };
  if constexpr (std::is_same_v<Style, RopeHalfSplit>) {
    if (p.tsp != 0) return run(std::true_type{});
  }
  return run(std::false_type{});
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------

// Rotate q and k (k optional) by the table's angles. In place when out == in (same strides).
// Policy: RopePolicy (the launch's tuning).
template <class Style = RopeHalfSplit, class Policy = RopeDefaultPolicy, class T, class C>
[[nodiscard]] Status rope_forward(const RopeArgs<T, C>& args, cudaStream_t stream) {
  return detail::rope_impl<Style, Policy>(args, false, stream, "rope_forward");
}

// Gradient of rope_forward: args.q / args.k hold dq / dk (in) and their gradients (out).
template <class Style = RopeHalfSplit, class Policy = RopeDefaultPolicy, class T, class C>
[[nodiscard]] Status rope_backward(const RopeArgs<T, C>& args, cudaStream_t stream) {
  return detail::rope_impl<Style, Policy>(args, true, stream, "rope_backward");
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
