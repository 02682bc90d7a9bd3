// tigon/core/config.hpp - language checks, the host/device shim, namespaces and visibility.
#pragma once

#if !defined(__cplusplus) || (__cplusplus < 202002L && !defined(_MSVC_LANG)) || \
    (defined(_MSVC_LANG) && _MSVC_LANG < 202002L)
#error "tigon requires C++20 (pass -std=c++20 to nvcc and to the host compiler)"
#endif

#define TIGON_VERSION_MAJOR 0
#define TIGON_VERSION_MINOR 1
#define TIGON_VERSION_PATCH 0

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

// Versioned inline namespace: two tigon versions in one process never share a symbol.
#define TIGON_NAMESPACE_BEGIN \
  namespace tigon {           \
  inline namespace v0_1 {
#define TIGON_NAMESPACE_END \
  }                         \
  }
