// tigon/core/validate.hpp - the argument checks every launcher shares. Each returns a Status that
// names the operation, the argument and the reason; the launcher returns it before touching the
// device, so an invalid call launches nothing and writes nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "config.hpp"
#include "status.hpp"

TIGON_NAMESPACE_BEGIN

// Rows x cols of elem_bytes-sized elements, rows `stride` elements apart (stride 0: contiguous).
struct MatrixView {
  const void* ptr = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t stride = 0;
  int elem_bytes = 0;

  template <class T>
  static MatrixView of(const T* p, std::int64_t rows, std::int64_t cols, std::int64_t stride = 0) {
    return MatrixView{p, rows, cols, stride, static_cast<int>(sizeof(T))};
  }

  std::int64_t row_stride() const { return stride == 0 ? cols : stride; }
  // Byte range [begin, end) the matrix touches.
  std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(ptr); }
  std::uintptr_t end() const {
    return begin() + static_cast<std::uintptr_t>(((rows - 1) * row_stride() + cols) * elem_bytes);
  }
};

namespace check {

inline Status not_null(const void* p, const char* op, const char* arg) {
  if (p != nullptr) return Status();
  return Status::error(Errc::null_pointer, op, arg, "must not be null");
}

inline Status positive(std::int64_t v, const char* op, const char* arg) {
  if (v > 0) return Status();
  return Status::error(Errc::invalid_size, op, arg, "must be positive, got " + std::to_string(v));
}

inline Status at_most(std::int64_t v, std::int64_t limit, const char* op, const char* arg) {
  if (v <= limit) return Status();
  return Status::error(Errc::unsupported, op, arg,
                       std::to_string(v) + " exceeds the supported maximum " + std::to_string(limit));
}

// stride 0 means contiguous; otherwise it must be at least the row length.
inline Status row_stride(std::int64_t stride, std::int64_t cols, const char* op, const char* arg) {
  if (stride == 0 || stride >= cols) return Status();
  if (stride < 0) {
    return Status::error(Errc::invalid_stride, op, arg,
                         "row stride " + std::to_string(stride) + " is negative");
  }
  return Status::error(Errc::invalid_stride, op, arg,
                       "row stride " + std::to_string(stride) + " is smaller than the row (" +
                           std::to_string(cols) + ")");
}

// A matrix's byte extent, ((rows - 1) * row stride + cols) * element bytes, fits in int64 and its
// address range does not wrap (the kernels' 64-bit offsets are computed from it). Null pointers
// and sizes that positive() / row_stride() reject pass here: those checks name them.
inline Status extent(const MatrixView& m, const char* op, const char* arg) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::int64_t rs = m.row_stride();
  if (m.ptr == nullptr || m.rows <= 0 || m.cols <= 0 || rs < m.cols || m.elem_bytes <= 0) return Status();
  const bool fits = (m.rows == 1 || rs <= (kMax - m.cols) / (m.rows - 1)) &&
                    (m.rows - 1) * rs + m.cols <= kMax / m.elem_bytes &&
                    static_cast<std::uint64_t>(((m.rows - 1) * rs + m.cols) * m.elem_bytes) <=
                        std::numeric_limits<std::uintptr_t>::max() - m.begin();
  if (fits) return Status();
  return Status::error(Errc::invalid_size, op, arg,
                       std::to_string(m.rows) + " rows of " + std::to_string(m.cols) + " elements, " +
                           std::to_string(rs) + " apart, span more bytes than a 64-bit offset or the "
                           "address space holds");
}

// True when two matrices of the same element size and row stride interleave without sharing an
// element: within every period of one row stride their rows occupy disjoint byte ranges (e.g. the
// fused gate||up layout: a = buf, b = buf + cols, both with stride 2 * cols).
inline bool interleaved_disjoint(const MatrixView& x, const MatrixView& y) {
  if (x.ptr == nullptr || y.ptr == nullptr || x.elem_bytes != y.elem_bytes ||
      x.row_stride() != y.row_stride()) {
    return false;
  }
  const MatrixView& lo = x.begin() <= y.begin() ? x : y;
  const MatrixView& hi = x.begin() <= y.begin() ? y : x;
  const std::uintptr_t period = static_cast<std::uintptr_t>(lo.row_stride()) * lo.elem_bytes;
  const std::uintptr_t lo_len = static_cast<std::uintptr_t>(lo.cols) * lo.elem_bytes;
  const std::uintptr_t hi_len = static_cast<std::uintptr_t>(hi.cols) * hi.elem_bytes;
  const std::uintptr_t r = (hi.begin() - lo.begin()) % period;
  return r >= lo_len && r + hi_len <= period;
}

// Whether two matrices share a byte.
inline bool overlap(const MatrixView& a, const MatrixView& b) {
  return a.begin() < b.end() && b.begin() < a.end() && !interleaved_disjoint(a, b);
}

// An output may be the very same matrix as an input (same pointer, same row stride: the op works
// in place element by element) or disjoint from it; any other overlap is an error.
inline Status same_or_disjoint(const MatrixView& out, const MatrixView& in, const char* op,
                               const char* out_name, const char* in_name) {
  TIGON_CHECK(extent(out, op, out_name));
  TIGON_CHECK(extent(in, op, in_name));
  if (in.ptr == nullptr || !overlap(out, in)) return Status();
  if (out.ptr == in.ptr && out.row_stride() == in.row_stride() && out.elem_bytes == in.elem_bytes) {
    return Status();
  }
  return Status::error(Errc::aliasing, op, out_name,
                       std::string("overlaps '") + in_name +
                           "' without being the same matrix (in place needs the same pointer and "
                           "row stride)");
}

// An output that may not overlap an input at all.
inline Status disjoint(const MatrixView& out, const MatrixView& in, const char* op,
                       const char* out_name, const char* in_name) {
  TIGON_CHECK(extent(out, op, out_name));
  TIGON_CHECK(extent(in, op, in_name));
  if (in.ptr == nullptr || out.ptr == nullptr || !overlap(out, in)) return Status();
  return Status::error(Errc::aliasing, op, out_name,
                       std::string("must not overlap '") + in_name + "'");
}

// A buffer of a call, by name (a null pointer: not given).
struct NamedView {
  MatrixView v;
  const char* name;
};
// n elements of `bytes` bytes at p.
inline MatrixView vector_view(const void* p, std::int64_t n, int bytes) { return MatrixView{p, 1, n, 0, bytes}; }

// Every output against every input and every other output: no shared byte, except that the first
// output may be the input at `in_place` itself when it points there (same pointer and stride: the
// op works in place element by element).
inline Status buffers_disjoint(const NamedView* outs, std::size_t no, const NamedView* ins, std::size_t ni,
                               const char* op, const void* in_place = nullptr) {
  for (std::size_t i = 0; i < no; ++i) {
    if (outs[i].v.ptr == nullptr) continue;
    for (std::size_t k = 0; k < ni; ++k) {
      const NamedView& r = ins[k];
      if (i == 0 && in_place != nullptr && outs[0].v.ptr == in_place && r.v.ptr == in_place) {
        TIGON_CHECK(same_or_disjoint(outs[i].v, r.v, op, outs[i].name, r.name));
      } else {
        TIGON_CHECK(disjoint(outs[i].v, r.v, op, outs[i].name, r.name));
      }
    }
    for (std::size_t j = 0; j < i; ++j) TIGON_CHECK(disjoint(outs[i].v, outs[j].v, op, outs[i].name, outs[j].name));
  }
  return Status();
}
template <std::size_t NO, std::size_t NI>
Status buffers_disjoint(const NamedView (&outs)[NO], const NamedView (&ins)[NI], const char* op,
                        const void* in_place = nullptr) {
  return buffers_disjoint(outs, NO, ins, NI, op, in_place);
}

// Whether v is finite, from its bits: -ffast-math lets a compiler assume no NaN or infinity and fold
// tests such as v - v == 0 or !(v >= 0) away; a test of the exponent bits holds under it.
inline bool finite_bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x7f800000u) != 0x7f800000u;
}

inline Status finite(float v, const char* op, const char* arg) {
  if (finite_bits(v)) return Status();
  return Status::error(Errc::invalid_value, op, arg, "must be finite");
}

// v finite and at least lo (strict: above lo), and at most hi.
inline bool finite_in(float v, float lo, float hi = __builtin_huge_valf(), bool strict = false) {
  return finite_bits(v) && (strict ? v > lo : v >= lo) && v <= hi;
}

inline Status workspace(const void* ws, std::size_t have, std::size_t need, const char* op) {
  if (need == 0) return Status();
  if (ws == nullptr) {
    return Status::error(Errc::null_pointer, op, "workspace",
                         "must not be null: " + std::to_string(need) + " bytes are needed");
  }
  if (have < need) {
    return Status::error(Errc::workspace_too_small, op, "workspace_bytes",
                         std::to_string(have) + " bytes given, " + std::to_string(need) +
                             " needed (ask *_workspace_bytes())");
  }
  if (reinterpret_cast<std::uintptr_t>(ws) % 16 != 0) {
    return Status::error(Errc::invalid_value, op, "workspace", "must be 16-byte aligned");
  }
  return Status();
}

}  // namespace check

TIGON_NAMESPACE_END
