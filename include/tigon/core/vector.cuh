// tigon/core/vector.cuh - aligned vectors for 16-byte loads and stores, and the alignment tests
// that decide between the vector path and the scalar fallback.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "config.hpp"
#include "dtype.hpp"

TIGON_NAMESPACE_BEGIN


// N elements of T stored together and aligned to their size, so that one load or store moves them
// (two when N * sizeof(T) is 32, e.g. fp32 weights beside bf16 activations).
template <class T, int N>
struct alignas(sizeof(T) * N) AlignedVec {
  static_assert(N > 0 && (N & (N - 1)) == 0, "vector length must be a power of two");
  T v[N];
};

template <int N, class T>
TIGON_HD AlignedVec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const AlignedVec<T, N>*>(p);
}

template <int N, class T>
TIGON_HD void store_vec(T* p, const AlignedVec<T, N>& v) {
  *reinterpret_cast<AlignedVec<T, N>*>(p) = v;
}

// All N elements as floats. bfloat16 pairs are widened with one integer instruction each (the
// low element shifted up, the high one masked), where converting element by element costs an
// extra extract per high element; the values are identical (a bfloat16 is the top half of its
// float).
template <class T, int N>
TIGON_DEVICE void to_floats(const AlignedVec<T, N>& v, float (&f)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    std::uint32_t u[N / 2];
    __builtin_memcpy(u, &v, sizeof(u));
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const std::uint32_t lo = u[k] << 16, hi = u[k] & 0xffff0000u;
      __builtin_memcpy(&f[2 * k], &lo, 4);
      __builtin_memcpy(&f[2 * k + 1], &hi, 4);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_float(v.v[k]);
  }
}

// The inverse of to_floats: N floats rounded to T (to nearest even), bfloat16 and half two at a
// time (one paired conversion instead of two).
template <class T, int N>
TIGON_DEVICE AlignedVec<T, N> from_floats(const float (&f)[N]) {
  AlignedVec<T, N> v;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __nv_bfloat162 r = __floats2bfloat162_rn(f[k], f[k + 1]);  // .x = f[k], .y = f[k + 1]
      __builtin_memcpy(&v.v[k], &r, 4);
    }
  } else if constexpr (std::is_same_v<T, __half> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __half2 r = __floats2half2_rn(f[k], f[k + 1]);
      __builtin_memcpy(&v.v[k], &r, 4);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v.v[k] = from_float<T>(f[k]);
  }
  return v;
}

// a and b rounded to T's precision and back (round_to<T> of each), two at a time for bfloat16 (one
// paired conversion instead of two).
template <class T>
TIGON_DEVICE void round_pair_to(float& a, float& b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);  // .x = a, .y = b
    std::uint32_t u;
    __builtin_memcpy(&u, &r, 4);
    const std::uint32_t lo = u << 16, hi = u & 0xffff0000u;
    __builtin_memcpy(&a, &lo, 4);
    __builtin_memcpy(&b, &hi, 4);
    return;
  }
#endif
  a = round_to<T>(a);
  b = round_to<T>(b);
}

// Streaming variants: the data is used once by this kernel, so do not keep it in L1.
#if defined(__CUDACC__)
template <int N, class T>
TIGON_DEVICE AlignedVec<T, N> load_vec_stream(const T* p) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  AlignedVec<T, N> out;
  if constexpr (kBytes == 16) {
    const int4 r = __ldcs(reinterpret_cast<const int4*>(p));
    out = *reinterpret_cast<const AlignedVec<T, N>*>(&r);
  } else {
    out = load_vec<N>(p);
  }
  return out;
}

// Store with the streaming hint (evict first): for outputs this kernel will not read again.
template <class T, int N>
TIGON_DEVICE void store_vec_stream(T* p, const AlignedVec<T, N>& v) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  if constexpr (kBytes == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
  } else {
    store_vec(p, v);
  }
}

// A load whose cache hint is a compile-time choice (a policy's streaming-loads knob).
template <bool kStreaming, int N, class T>
TIGON_DEVICE AlignedVec<T, N> load_vec_hinted(const T* p) {
  if constexpr (kStreaming) {
    return load_vec_stream<N>(p);
  } else {
    return load_vec<N>(p);
  }
}

// A store whose cache hint is a compile-time choice (a policy's "streaming stores" knob).
template <bool kStreaming, class T, int N>
TIGON_DEVICE void store_vec_hinted(T* p, const AlignedVec<T, N>& v) {
  if constexpr (kStreaming) {
    store_vec_stream(p, v);
  } else {
    store_vec(p, v);
  }
}

// L2 eviction priorities (sm_80+): a kernel that reads data twice marks the first read
// evict-last so the second finds it in L2, and the second read (and the store over it)
// evict-first so the lines make room once done. Other widths and older targets: plain accesses.
enum class L2Hint { evict_last, evict_first };

// Inline PTX (here and in the two accesses below): cuda::ptx in CUDA 13.0 has no createpolicy
// (cuda::access_property is a precomputed descriptor, not this instruction), and its cache-hinted
// 16-byte ld / st (.b128, memory-clobbering) change the SASS of every cross-entropy kernel (up to
// 64 more instructions).
template <L2Hint kHint>
TIGON_DEVICE std::uint64_t l2_policy() {
  std::uint64_t pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kHint == L2Hint::evict_last) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  }
#endif
  return pol;
}

template <int N, class T>
TIGON_DEVICE AlignedVec<T, N> load_vec_policy(const T* p, std::uint64_t pol) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBytes == 16) {
    unsigned r[4];
    asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(p), "l"(pol));
    AlignedVec<T, N> out;
    static_assert(sizeof(out) == sizeof(r));
    __builtin_memcpy(&out, r, sizeof(r));
    return out;
  }
#endif
  (void)pol;
  return load_vec<N>(p);
}

template <class T, int N>
TIGON_DEVICE void store_vec_policy(T* p, const AlignedVec<T, N>& v, std::uint64_t pol) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBytes == 16) {
    unsigned r[4];
    __builtin_memcpy(r, &v, sizeof(r));
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(pol)
                 : "memory");
    return;
  }
#endif
  (void)pol;
  store_vec(p, v);
}

// The largest element of a vector, running across calls: bfloat16 and half pairs compared two at a
// time (packed), the pair folded once at the end (value()).
template <class T>
struct PackedMax {
  static constexpr bool kPacked = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  Pair pair;
  float scalar;
  TIGON_DEVICE PackedMax() {
    if constexpr (kPacked) {
      const T lo = from_float<T>(-__builtin_huge_valf());
      pair = Pair(lo, lo);
    }
    scalar = -__builtin_huge_valf();
  }
  template <int kV>
  TIGON_DEVICE void add(const AlignedVec<T, kV>& v) {
    if constexpr (kPacked && kV % 2 == 0) {
#pragma unroll
      for (int k = 0; k < kV; k += 2) {
        Pair q;
        __builtin_memcpy(&q, &v.v[k], sizeof(q));
        pair = __hmax2(pair, q);
      }
    } else {
      float x[kV];
      to_floats(v, x);
#pragma unroll
      for (int k = 0; k < kV; ++k) scalar = fmaxf(scalar, x[k]);
    }
  }
  TIGON_DEVICE float value() const {
    if constexpr (kPacked) return fmaxf(scalar, fmaxf(to_float(pair.x), to_float(pair.y)));
    return scalar;
  }
};

#endif

// True when p is aligned for an access of `bytes` bytes.
TIGON_HD bool is_aligned(const void* p, std::size_t bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

// True when every row of a strided matrix starts aligned for vec-element accesses.
template <class T>
inline bool rows_aligned(const T* p, std::int64_t stride, int vec) {
  return is_aligned(p, static_cast<std::size_t>(vec) * sizeof(T)) && stride % vec == 0;
}

TIGON_NAMESPACE_END
