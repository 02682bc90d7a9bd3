// tigon/core/math.hpp - small integer and float helpers shared by the math and launch layers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

template <class I>
TIGON_HD constexpr I ceil_div(I a, I b) {
  return (a + b - 1) / b;
}

template <class I>
TIGON_HD constexpr I round_up(I a, I b) {
  return ceil_div(a, b) * b;
}

TIGON_HD constexpr bool is_pow2(long long v) { return v > 0 && (v & (v - 1)) == 0; }

TIGON_HD constexpr int next_pow2(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

// Largest power of two dividing v (v > 0), capped at cap.
TIGON_HD constexpr int pow2_divisor(long long v, int cap) {
  int p = 1;
  while (p < cap && v % (2LL * p) == 0) p *= 2;
  return p;
}

// The shape of a row-per-cluster kernel for a row of nvec vectors: csize blocks of `threads`
// threads, each thread holding up to `vecs` vectors, `slice` vectors per block (a row that fits one
// block takes one, with no messages); csize 0 (the op then takes its row kernel) when the row needs
// more than max_cluster blocks, or has fewer vectors than a block has threads.
struct RowClusterShape {
  int csize = 0;
  int slice = 0;
};
constexpr RowClusterShape row_cluster_shape(std::int64_t nvec, int threads, int vecs, int max_cluster) {
  RowClusterShape s;
  if (nvec <= 0) return s;
  const std::int64_t c = ceil_div<std::int64_t>(nvec, static_cast<std::int64_t>(threads) * vecs);
  if (nvec < threads || c > max_cluster) return s;
  s.csize = static_cast<int>(c);
  s.slice = static_cast<int>(ceil_div<std::int64_t>(nvec, c));
  return s;
}

// Rows per chunk for `budget` bytes of [rows, cols] elements of elem_bytes: a multiple of 128 rows,
// at least 128, at most `rows` (the chunked LM-head ops' default chunks).
inline std::int64_t rows_per_chunk(std::int64_t rows, std::int64_t cols, std::size_t elem_bytes, std::size_t budget) {
  std::int64_t c = static_cast<std::int64_t>(budget / (static_cast<std::size_t>(cols) * elem_bytes));
  c = c / 128 * 128;
  if (c < 128) c = 128;
  return c < rows ? c : rows;
}

// 1/sqrt(x) in fp32: the fast hardware reciprocal square root on the device, its exact twin on
// the host (the host tests compare with a double reference under a tolerance, not bitwise).
TIGON_HD float rsqrt_f32(float x) {
#if TIGON_DEVICE_PASS
  return ::rsqrtf(x);
#else
  return 1.0f / std::sqrt(x);
#endif
}

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x log2(e))
inline constexpr float kLn2 = 0.6931471805599453f;     // ln(2): log(x) = log2(x) ln(2)
inline constexpr float kMinNormal = 1.17549435e-38f;   // 2^-126, float's smallest normal number

// 2^x and log2(x) on the special-function unit, subnormal inputs and results flushed to zero
// (ex2.approx.ftz / lg2.approx.ftz: a single MUFU instruction each; the non-ftz forms add the
// subnormal range's scaling around it). Exact std::exp2 / std::log2 on the host. Under 2^-126 a
// probability is zero in the dtypes the kernels write gradients in.
TIGON_HD float exp2_ftz(float x) {
#if TIGON_DEVICE_PASS
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}
TIGON_HD float log2_ftz(float x) {
#if TIGON_DEVICE_PASS
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

TIGON_NAMESPACE_END
