// Shared pieces of the GPU tests: a main that reports "skipped" (exit 77) without a GPU, device
// buffers, fresh random inputs, poisoned outputs and tolerance checks where NaN never passes.
#pragma once

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <tigon/core/dtype.hpp>

namespace gpu_test {

inline constexpr int kSkipExitCode = 77;

#define CUDA_OK(expr)                                                                   \
  do {                                                                                  \
    const cudaError_t e_ = (expr);                                                      \
    INFO(#expr << ": " << cudaGetErrorString(e_));                                      \
    REQUIRE(e_ == cudaSuccess);                                                         \
  } while (0)

#define TIGON_OK(expr)                 \
  do {                                 \
    const ::tigon::Status s_ = (expr); \
    INFO(s_.message());                \
    REQUIRE(s_.ok());                  \
  } while (0)

// The seed of this run's random inputs: fresh each run (printed, and settable with
// TIGON_TEST_SEED to replay a failure).
inline std::uint64_t run_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("TIGON_TEST_SEED")) return static_cast<std::uint64_t>(std::strtoull(s, nullptr, 10));
    return (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ static_cast<std::uint64_t>(std::random_device{}());
  }();
  return seed;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 gen(run_seed());
  return gen;
}

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t count = 0;
  explicit DeviceBuffer(std::size_t n) : count(n) {
    if (cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      ptr = nullptr;
      FAIL("cudaMalloc of " << n * sizeof(T) << " bytes failed");
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  std::size_t bytes() const { return count * sizeof(T); }
  // Every byte 0xFF: NaN in float, half and bfloat16.
  // The memset runs on the legacy default stream, which does not order work on the non-blocking
  // streams some tests use: synchronise so that no later kernel races with the poison.
  void poison() {
    REQUIRE(cudaMemset(ptr, 0xFF, bytes()) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() <= count);
    REQUIRE(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    // From pageable memory the copy may return before its DMA has landed, and the non-blocking
    // streams some tests launch on do not wait for the legacy stream: synchronise.
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    REQUIRE(cudaMemcpy(h.data(), ptr, bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

// Random values of T (normal, sd `scale`, around `mean`), stored as T; `as_double` gets the exact
// stored values for the reference.
template <class T>
std::vector<T> random_values(std::size_t n, double mean, double scale, std::vector<double>* as_double) {
  std::normal_distribution<float> nd(static_cast<float>(mean), static_cast<float>(scale));
  std::vector<T> v(n);
  if (as_double) as_double->resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = tigon::from_float<T>(nd(rng()));
    if (as_double) (*as_double)[i] = tigon::to_float(v[i]);
  }
  return v;
}

inline bool all_bytes_ff(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0xFF) return false;
  return true;
}

// Compare `out` with `ref` element by element: |out - ref| <= atol + rtol * |ref|, NaN and Inf
// failing; also the relative L2 error. Reports the worst element.
struct Compare {
  std::size_t n = 0, bad = 0, worst = 0;
  double worst_err = 0, rel_l2 = 0;
  // min_l2_elems: outputs with fewer elements are held to the per-element bound alone (their
  // relative L2 error is one or a few elements' relative error).
  bool ok(double max_rel_l2, std::size_t min_l2_elems = 0) const {
    return bad == 0 && (n < min_l2_elems || rel_l2 <= max_rel_l2);
  }
};

template <class Get>
Compare compare(std::size_t n, Get&& get_out, const std::vector<double>& ref, double atol, double rtol) {
  Compare c;
  c.n = n;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double o = get_out(i), r = ref[i];
    const double err = std::abs(o - r);
    const bool good = std::isfinite(o) && err <= atol + rtol * std::abs(r);
    if (!good) ++c.bad;
    const double score = std::isfinite(o) ? err / (atol + rtol * std::abs(r)) : INFINITY;
    if (score > c.worst_err || (!good && c.bad == 1)) {
      c.worst_err = score;
      c.worst = i;
    }
    num += std::isfinite(o) ? err * err : INFINITY;
    den += r * r;
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

inline int run_main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA GPU on this machine; the GPU tests did not run.\n");
    return kSkipExitCode;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("GPU: %s (sm_%d%d), random seed %llu (replay with TIGON_TEST_SEED)\n", prop.name,
              prop.major, prop.minor, static_cast<unsigned long long>(run_seed()));
  return Catch::Session().run(argc, argv);
}

}  // namespace gpu_test

#define GPU_TEST_MAIN \
  int main(int argc, char** argv) { return gpu_test::run_main(argc, argv); }
