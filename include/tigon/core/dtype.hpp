// tigon/core/dtype.hpp - the three element types every op supports (float, __half,
// __nv_bfloat16), their traits, and conversions usable on host and device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

using half = __half;
using bf16 = __nv_bfloat16;

// Runtime tag for the element types, for messages and for runtime->compile-time dispatch.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

template <class T>
struct dtype_traits;  // only the three supported types are defined

template <>
struct dtype_traits<float> {
  static constexpr DType id = DType::f32;
  static constexpr const char* name = "float";
};
template <>
struct dtype_traits<__half> {
  static constexpr DType id = DType::f16;
  static constexpr const char* name = "half";
};
template <>
struct dtype_traits<__nv_bfloat16> {
  static constexpr DType id = DType::bf16;
  static constexpr const char* name = "bfloat16";
};

template <class T>
concept Element =
    std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

constexpr const char* dtype_name(DType d) noexcept {
  switch (d) {
    case DType::f32: return "float";
    case DType::f16: return "half";
    case DType::bf16: return "bfloat16";
  }
  return "unknown";
}

constexpr int dtype_size(DType d) noexcept { return d == DType::f32 ? 4 : 2; }

// Conversions. Rounding to half / bfloat16 is round-to-nearest-even, on host and device.
template <Element T>
TIGON_HD float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    return __bfloat162float(v);
  }
}

template <Element T>
TIGON_HD T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

// Round a float to T's precision and back: the value a tensor of dtype T would hold.
template <Element T>
TIGON_HD float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The widest single access a thread makes, and the elements of T it holds (8 for half / bfloat16,
// 4 for float).
inline constexpr int kMaxAccessBytes = 16;
template <class T>
inline constexpr int kVecElems = kMaxAccessBytes / static_cast<int>(sizeof(T));

TIGON_NAMESPACE_END
