// Shared pieces of the GPU tests: device buffers, fresh random inputs, the sanitizer-sized switch,
// poisoned outputs, tolerance checks where NaN never passes, the tolerances of outputs rounded to a
// dtype, and dense / strided views of host matrices. Every suite links gpu_test_main.cu's main.
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
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

// The compute-sanitizer tool the process runs under, as scripts/sanitize-cases.sh exports it in
// TIGON_TEST_SANITIZER ("memcheck", "racecheck", "initcheck", "synccheck"; read once), or "" when the
// variable is unset or "0".
inline const std::string& sanitizer_tool() {
  static const std::string tool = [] {
    const char* s = std::getenv("TIGON_TEST_SANITIZER");
    return std::string(s != nullptr && std::strcmp(s, "0") != 0 ? s : "");
  }();
  return tool;
}

// Whether the suites run sanitizer-sized (TIGON_TEST_SANITIZER set and not "0"): under
// compute-sanitizer (memcheck, racecheck, initcheck, synccheck) every kernel launch and memory access
// costs many times its plain time, so the slowest cases run a reduced set of shapes that still
// reaches every kernel and option (each kernel family, each dispatch branch, each dtype, each
// option), with fewer repetitions, rows, chunks or hidden columns, so that each case finishes in
// minutes. Unset, every case runs its full set.
inline bool sanitizer_sized() { return !sanitizer_tool().empty(); }

// Under synccheck, whether a launch with clusters of `blocks` blocks is left out. compute-sanitizer's
// synccheck (CUDA 13.0, sm_90) stops launches with 16-block clusters (a non-portable size) that
// exchange messages with an illegal-address error, also those of scripts/probes/cluster_synccheck.cu:
// a minimal kernel with the resident kernels' message pattern, right without the tool, and right
// under it at 2 and 8 blocks (the probe's 16-block launches with 1 KiB of dynamic shared memory and
// no messages run right under it).
// So under synccheck the non-portable sizes (over 8) are left out; the other tools run them.
inline bool synccheck_skips_cluster(int blocks) {
  if (blocks <= 8 || sanitizer_tool() != "synccheck") return false;
  std::printf("synccheck: a launch with %d-block clusters left out (non-portable cluster sizes)\n", blocks);
  return true;
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
  // Every byte 0xFF: NaN in float, half and bfloat16. A buffer a cuBLASLt GEMM writes is poisoned
  // before the call, and so is the scratch handed to CublasLtGemm (its split-K reduction reads the
  // partial sums its GEMM kernel stored there): initcheck does not see the stores of cuBLAS's GEMM
  // kernels, so without the poison their output reads as uninitialised.
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

// Uniform values in [lo, hi) from a hash of (seed, index), generated on the device: inputs of
// gigabytes without a host copy (the same seed gives the same values).
template <class T>
__global__ void fill_hash_kernel(T* p, std::int64_t n, std::uint64_t seed, float lo, float hi) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;
    p[i] = ::tigon::from_float<T>(lo + (hi - lo) * u);
  }
}
template <class T>
void fill_hash(T* p, std::int64_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  fill_hash_kernel<<<1056, 256>>>(p, n, seed, lo, hi);
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

inline bool all_bytes_ff(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0xFF) return false;
  return true;
}

// Whether every element of a downloaded output is finite: an output poisoned (NaN) before the call
// and never written fails. For checks that compare two such outputs byte for byte, which would
// pass if neither were written.
template <class T>
bool all_finite(const std::vector<T>& v) {
  for (const T& e : v)
    if (!std::isfinite(tigon::to_float(e))) return false;
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
  // The L2 error within max_rel_l2 of the reference's L2 norm plus `quantum` per element: for
  // outputs among a format's subnormals (float16 holds multiples of 2^-24 there), where one
  // spacing is a large relative error.
  double l2_err = 0, l2_ref = 0;
  bool l2_within(double max_rel_l2, double quantum) const {
    return l2_err <= max_rel_l2 * l2_ref + quantum * std::sqrt(static_cast<double>(n));
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
  c.l2_err = std::sqrt(num);
  c.l2_ref = std::sqrt(den);
  return c;
}

// Reports a Compare's worst element and CHECKs it against max_rel_l2 (what: the output's name).
#define GPU_CHECK_CLOSE(cmp, what, l2)                                                           \
  do {                                                                                           \
    INFO(what << ": " << (cmp).bad << " of " << (cmp).n << " elements out of tolerance, worst #" \
              << (cmp).worst << " (score " << (cmp).worst_err << "), rel L2 " << (cmp).rel_l2);  \
    CHECK((cmp).ok(l2));                                                                         \
  } while (0)

// Tolerances of an output rounded once to T from fp32 arithmetic: per element (relative) and for
// the relative L2 error of a whole output.
template <class T>
double tol() {
  if constexpr (std::is_same_v<T, float>) return 1e-4;
  if constexpr (std::is_same_v<T, tigon::half>) return 0x1p-9;
  return 0x1p-6;
}
template <class T>
double tol_l2() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, tigon::half>) return 1e-3;
  return 8e-3;
}

// Tolerances of a weight gradient in W summed over rows of dy * xhat, where `rounded_xhat`: xhat was
// rounded to T before the product (RMSNorm's modes llama and none): a term on a rounding boundary
// may round the other way in fp32 than in the reference, so T's precision bounds it too, and such
// flips (about one term in 10^4 to 10^5 for bf16, each worth one ulp of T) bound the L2 error.
template <class T, class W>
double dweight_tol(bool rounded_xhat) {
  return rounded_xhat ? std::max(tol<W>(), tol<T>()) : tol<W>();
}
template <class T, class W>
double dweight_tol_l2(bool rounded_xhat) {
  return rounded_xhat ? std::max(tol_l2<W>(), 0.1 * tol_l2<T>()) : tol_l2<W>();
}

inline double rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Dense [rows, cols] doubles of a host matrix whose rows are `stride` elements apart, `off` in.
template <class T>
std::vector<double> dense(const std::vector<T>& h, std::int64_t off, std::int64_t rows,
                          std::int64_t cols, std::int64_t stride) {
  std::vector<double> d(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) d[r * cols + c] = tigon::to_float(h[off + r * stride + c]);
  return d;
}

// Element i of the dense [rows, cols] view of such a matrix, as a double (for compare()).
template <class T>
auto strided(const std::vector<T>& h, std::int64_t off, std::int64_t cols, std::int64_t stride) {
  return [&h, off, cols, stride](std::size_t i) {
    const std::int64_t k = static_cast<std::int64_t>(i);
    return static_cast<double>(tigon::to_float(h[off + (k / cols) * stride + k % cols]));
  };
}

// The bytes of such a matrix outside its rows (each row's padding, and the `off` elements before it
// unless it overwrote `input`) hold what they held: `input`'s bytes where the output was written
// over that input, else the poison (0xFF).
template <class T>
void check_outside_rows(const std::vector<T>& got, const std::vector<T>* input, std::int64_t off,
                        std::int64_t rows, std::int64_t cols, std::int64_t stride) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t p = cols; p < stride; ++p) {
      const std::size_t i = static_cast<std::size_t>(off + r * stride + p);
      if (input) {
        REQUIRE(std::memcmp(&got[i], &(*input)[i], sizeof(T)) == 0);
      } else {
        REQUIRE(all_bytes_ff(&got[i], sizeof(T)));
      }
    }
  }
  if (!input && off > 0) REQUIRE(all_bytes_ff(got.data(), static_cast<std::size_t>(off) * sizeof(T)));
}

// Norm policies derived from a norm's default P (tigon::RmsNormPolicy, tigon::LayerNormPolicy), each
// overriding some members and inheriting the rest, as a caller tunes one; at 4096 columns each
// gives another row-group layout, stage count or register bound.
template <class P>
struct SmallBlocks : P {  // 128-thread forward blocks; 256-thread backward blocks, 2 per SM, 2 stages
  static constexpr int kFwdBlockThreads = 128;
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdMinBlocksPerSm = 2;
  static constexpr int kBwdStages = 2;
};
template <class P>
struct OneStage : P {
  static constexpr int kBwdStages = 1;
};
template <class P>
struct Capped : P {  // the forward's registers capped for 6 blocks per SM
  static constexpr int kFwdMinBlocksPerSm = 6;
};
template <class P>
struct Wide : P {  // 8 / 4 vectors per thread, 4 stages
  static constexpr int kFwdVecPerThread = 8;
  static constexpr int kBwdVecPerThread = 4;
  static constexpr int kBwdBlockThreads = 256;
  static constexpr int kBwdStages = 4;
};
template <class P>
struct FwdNarrow : P {  // 2 vectors per thread, 128-thread forward blocks
  static constexpr int kFwdVecPerThread = 2;
  static constexpr int kFwdBlockThreads = 128;
};
template <class P>
struct Threads1024 : P {  // a 512-thread forward block, 1024-thread backward blocks
  static constexpr int kFwdVecPerThread = 2;
  static constexpr int kFwdBlockThreads = 512;
  static constexpr int kBwdVecPerThread = 1;
  static constexpr int kBwdBlockThreads = 1024;
};
template <class P>
struct WarpPerRow : P {  // 4096 bf16 / half: the forward's 512 vectors over one warp
  static constexpr int kFwdVecPerThread = 16;
  static constexpr int kBwdVecPerThread = 8;
  static constexpr int kBwdBlockThreads = 256;
};

}  // namespace gpu_test
