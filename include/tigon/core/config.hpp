// tigon/core/config.hpp - language checks, the host/device shim, namespaces and visibility.
#pragma once

#if !defined(__cplusplus) || (__cplusplus < 202002L && !defined(_MSVC_LANG)) || \
    (defined(_MSVC_LANG) && _MSVC_LANG < 202002L)
#error "tigon requires C++20 (pass -std=c++20 to nvcc and to the host compiler)"
#endif

// tigon's version, for C++ and Python alike: CMakeLists.txt and examples/torch read these lines.
#define TIGON_VERSION_MAJOR 0
#define TIGON_VERSION_MINOR 1
#define TIGON_VERSION_PATCH 0

// The kernels use sm_80 instructions (cp.async, bf16 arithmetic): stop at the first line of an
// older device pass (nvcc's default architecture is sm_75 on CUDA 13) instead of in ptxas.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "tigon needs a GPU architecture of sm_80 or later: compile with -arch=sm_80 or later (CMake: CMAKE_CUDA_ARCHITECTURES=native, 90 or another value >= 80)"
#endif

// Host/device shim: the math layer of every op is written once and compiles under nvcc (for the
// kernels) and under a plain host compiler (for the host unit tests and for trainers' .cpp files).
#if defined(__CUDACC__)
#define TIGON_HD __host__ __device__ __forceinline__
#define TIGON_DEVICE __device__ __forceinline__
#else
#define TIGON_HD inline
#define TIGON_DEVICE inline
#endif

// True while compiling device code (the device pass of nvcc).
#if defined(__CUDA_ARCH__)
#define TIGON_DEVICE_PASS 1
#else
#define TIGON_DEVICE_PASS 0
#endif

// Kernels of a header-only library are instantiated in many translation units and shared
// objects: keep their symbols out of each other's way.
#if defined(__GNUC__) || defined(__clang__)
#define TIGON_HIDDEN __attribute__((visibility("hidden")))
#else
#define TIGON_HIDDEN
#endif
#define TIGON_KERNEL __global__ TIGON_HIDDEN

// Versioned inline namespace, v<major>_<minor> (v0_1): two tigon versions in one process never
// share a symbol.
#define TIGON_PP_CAT4_(a, b, c, d) a##b##c##d
#define TIGON_PP_CAT4(a, b, c, d) TIGON_PP_CAT4_(a, b, c, d)
#define TIGON_ABI_NAMESPACE TIGON_PP_CAT4(v, TIGON_VERSION_MAJOR, _, TIGON_VERSION_MINOR)
#define TIGON_NAMESPACE_BEGIN \
  namespace tigon {           \
  inline namespace TIGON_ABI_NAMESPACE {
#define TIGON_NAMESPACE_END \
  }                         \
  }
