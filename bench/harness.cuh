// Benchmark harness: CUDA-event timing of every iteration, medians, random device data, rotating
// input sets larger than L2, and the ceilings (device-to-device copy) measured in the same process.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <tigon/core/dtype.hpp>
#include <tigon/core/status.hpp>

namespace bench {

#define BENCH_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// A launcher's status: on error, its message and exit 1 (a benchmark of a failed call means nothing).
inline void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

struct Ceilings {
  double copy_gbs = 0;         // device-to-device copy, bytes read + written per second / 1e9
  double kernel_copy_gbs = 0;  // the same through a plain 16-byte-vector copy kernel (reported only)
  double read_gbs = 0;         // a read-only stream (sum of 2 GiB), bytes read per second / 1e9
};

// Which ceiling a benchmark's bytes are compared with.
enum class Ceiling { copy, read };

inline Ceilings& ceilings() {
  static Ceilings c;
  return c;
}

// One row of the summary printed after all benchmarks.
struct Row {
  std::string name;
  double ms = 0, gbs = 0, pct = 0;
  double pct_same = 0;  // % of a device-to-device copy moving the same bytes (0: not measured)
};
inline std::vector<Row>& summary() {
  static std::vector<Row> rows;
  return rows;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// Times fn() with events around each call; returns milliseconds per call.
inline std::vector<double> time_calls(const std::function<void(int)>& fn, int warmup, int iters) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn(i);
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(a));
    fn(i);
    BENCH_CUDA(cudaEventRecord(b));
    BENCH_CUDA(cudaEventSynchronize(b));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

inline int rotation(double bytes_per_set);

// Keeps the device busy for about `ns` nanoseconds (the global timer), so that the host has
// enqueued what follows before the device reaches it.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// One sample of a single call: a 200 us spin kernel, then events around one call. Nothing of the
// same op precedes or follows the call on the device, so its start and drain overlap nothing (as in
// a training step, where an op's neighbours are GEMMs), and the spin lets the host enqueue it
// first, so its launch cost is not timed; `late` counts samples where the spin had already ended
// when the call was enqueued (then part of the host's cost is in the sample). Milliseconds.
inline double time_single(const std::function<void()>& call, int* late = nullptr) {
  static cudaEvent_t a = nullptr, b = nullptr;
  if (a == nullptr) {
    BENCH_CUDA(cudaEventCreate(&a));
    BENCH_CUDA(cudaEventCreate(&b));
  }
  spin_kernel<<<1, 1>>>(200'000);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaEventRecord(a));
  call();
  if (late != nullptr && cudaEventQuery(a) == cudaSuccess) ++*late;
  BENCH_CUDA(cudaEventRecord(b));
  BENCH_CUDA(cudaEventSynchronize(b));
  float t = 0;
  BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
  return t;
}

// The device-to-device copy rate (bytes read + written per second / 1e9) when the copy moves
// `bytes` in all, timed as run() times an op, rotating buffer pairs past the L2: batches of 20
// back-to-back calls, median of 15 batches; or (single) one cudaMemcpyAsync at a time as
// time_single times it, median of 30. Smaller moves pay the ramp-up and drain of each call that a
// 2 GiB copy hides; an op is compared with both. Cached per size and timing.
inline double copy_gbs_at(double bytes, bool single = false) {
  static std::map<std::pair<std::size_t, bool>, double> cache;
  const std::size_t half = (static_cast<std::size_t>(bytes / 2) + 255) / 256 * 256;
  if (const auto it = cache.find({half, single}); it != cache.end()) return it->second;
  const int sets = std::min(8, rotation(2.0 * half));
  std::vector<void*> src(sets), dst(sets);
  for (int i = 0; i < sets; ++i) {
    BENCH_CUDA(cudaMalloc(&src[i], half));
    BENCH_CUDA(cudaMalloc(&dst[i], half));
    BENCH_CUDA(cudaMemset(src[i], 0x5a, half));
  }
  const auto copy = [&](int k) {
    BENCH_CUDA(cudaMemcpyAsync(dst[k % sets], src[k % sets], half, cudaMemcpyDeviceToDevice));
  };
  std::vector<double> ms;
  if (single) {
    for (int rep = 0; rep < 33; ++rep) {
      const double t = time_single([&] { copy(rep); });
      if (rep >= 3) ms.push_back(t);
    }
  } else {
    int k = 0;
    for (const double t : time_calls([&](int) { for (int c = 0; c < 20; ++c) copy(k++); }, 3, 15)) ms.push_back(t / 20);
  }
  for (int i = 0; i < sets; ++i) {
    cudaFree(src[i]);
    cudaFree(dst[i]);
  }
  const double gbs = 2.0 * static_cast<double>(half) / (median(ms) * 1e-3) / 1e9;
  cache[{half, single}] = gbs;
  return gbs;
}

// While a SingleCalls object lives, run() times single calls instead of batches; bench::single<F>
// is benchmark F run so.
inline bool& single_calls_flag() {
  static bool on = false;
  return on;
}
struct SingleCalls {
  SingleCalls() : was(single_calls_flag()) { single_calls_flag() = true; }
  ~SingleCalls() { single_calls_flag() = was; }
  bool was;
  SingleCalls(const SingleCalls&) = delete;
  SingleCalls& operator=(const SingleCalls&) = delete;
};
template <void (*F)(benchmark::State&)>
void single(benchmark::State& state) {
  SingleCalls on;
  F(state);
}

// Google Benchmark loop with manual (event) time. Each sample times a batch of `batch` calls
// enqueued back to back (as a training step enqueues them), so the host's launch cost overlaps
// the device work and the number is the device time per call; the median sample is reported as
// counters and in the summary. fn(i) runs one call on input set i. Under SingleCalls each sample
// is one call alone (time_single), reported as `name` + " single call", its "% same B" against
// one cudaMemcpyAsync of the same bytes timed the same way.
inline void run(benchmark::State& state, const std::string& name, double bytes,
                const std::function<void(int)>& fn, int batch = 20, Ceiling ceiling = Ceiling::copy) {
  const bool single = single_calls_flag();
  for (int i = 0; i < 3; ++i) fn(i);
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms;
  int i = 0;
  if (single) {
    int late = 0;
    for (auto _ : state) {
      const double t = time_single([&] { fn(i++); }, &late);
      state.SetIterationTime(t / 1e3);
      ms.push_back(t);
    }
    state.counters["late_samples"] = late;
    if (late > 0) {
      std::printf("%s single call: %d of %zu samples enqueued after the spin ended\n", name.c_str(), late,
                  ms.size());
    }
  } else {
    cudaEvent_t a, b;
    BENCH_CUDA(cudaEventCreate(&a));
    BENCH_CUDA(cudaEventCreate(&b));
    for (auto _ : state) {
      BENCH_CUDA(cudaEventRecord(a));
      for (int k = 0; k < batch; ++k) fn(i++);
      BENCH_CUDA(cudaEventRecord(b));
      BENCH_CUDA(cudaEventSynchronize(b));
      float t = 0;
      BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
      state.SetIterationTime(t / 1e3 / batch);
      ms.push_back(t / batch);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  BENCH_CUDA(cudaGetLastError());
  const double med = median(ms);
  const double gbs = bytes / (med * 1e-3) / 1e9;
  const double ceil_gbs = ceiling == Ceiling::copy ? ceilings().copy_gbs : ceilings().read_gbs;
  const double pct = 100.0 * gbs / ceil_gbs;
  state.counters["median_ms"] = med;
  state.counters["GB/s"] = gbs;
  state.counters[ceiling == Ceiling::copy ? "pct_of_copy" : "pct_of_read"] = pct;
  state.counters["bytes"] = bytes;
  double pct_same = 0;
  if (ceiling == Ceiling::copy && bytes > 0 && bytes <= 16e9) {  // byte-moving ops (not FLOP counts)
    pct_same = 100.0 * gbs / copy_gbs_at(bytes, single);
    state.counters[single ? "pct_of_same_size_single_copy" : "pct_of_same_size_copy"] = pct_same;
  }
  summary().push_back({name + (single ? " single call" : "") + (ceiling == Ceiling::read ? " [% of read]" : ""),
                       med, gbs, pct, pct_same});
}

// Host cost of one launcher call: `calls` calls of a tiny problem, timed on the host.
inline double host_us_per_call(const std::function<void()>& fn, int calls) {
  fn();
  BENCH_CUDA(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  const auto t1 = std::chrono::steady_clock::now();
  BENCH_CUDA(cudaDeviceSynchronize());
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
}

// ---- device data ----

__global__ void fill_random_kernel(void* p, int kind, std::size_t n, std::uint64_t seed, float mean,
                                   float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // sum of four uniforms: roughly normal, mean 0, variance 1/3 * 4 / 4
    float s = 0;
    for (int k = 0; k < 4; ++k) s += static_cast<float>((z >> (16 * k)) & 0xFFFF) / 65535.0f - 0.5f;
    const float v = mean + scale * s * 1.7320508f;
    if (kind == 0) static_cast<float*>(p)[i] = v;
    if (kind == 1) static_cast<__half*>(p)[i] = __float2half_rn(v);
    if (kind == 2) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
}

template <class T>
void fill_random(T* p, std::size_t n, std::uint64_t seed, float mean = 0.0f, float scale = 1.0f) {
  const int kind = static_cast<int>(tigon::dtype_traits<T>::id);
  fill_random_kernel<<<1024, 256>>>(p, kind, n, seed, mean, scale);
  BENCH_CUDA(cudaGetLastError());
}

template <class T>
T* alloc(std::size_t n) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// Number of input sets to rotate through so that one pass over them is >= 4x the L2.
inline int rotation(double bytes_per_set) {
  int dev = 0, l2 = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
  return std::max(1, static_cast<int>((4.0 * l2 + bytes_per_set - 1) / bytes_per_set));
}

// ---- ceilings ----

__global__ void copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

inline double measure_kernel_copy_gbs() {
  const std::size_t bytes = std::size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  fill_random(static_cast<float*>(src), bytes / 4, 9);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const auto ms = time_calls(
      [&](int) {
        copy_kernel<<<sms * 8, 256>>>(static_cast<const int4*>(src), static_cast<int4*>(dst), bytes / 16);
      },
      3, 30);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9;
}

__global__ void read_kernel(const int4* __restrict__ s, std::size_t n, int* out) {
  int acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int4 v = __ldcs(s + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678) *out = acc;  // keeps the loads; practically never taken
}

inline double measure_read_gbs() {
  const std::size_t bytes = std::size_t{2} << 30;
  void* src = nullptr;
  int* out = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&out, sizeof(int)));
  fill_random(static_cast<float*>(src), bytes / 4, 13);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const auto ms = time_calls(
      [&](int) { read_kernel<<<sms * 8, 512>>>(static_cast<const int4*>(src), bytes / 16, out); }, 3, 30);
  cudaFree(src);
  cudaFree(out);
  return static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9;
}

inline double measure_copy_gbs() {
  const std::size_t bytes = std::size_t{1} << 30;  // 1 GiB read + 1 GiB written
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  fill_random(static_cast<float*>(src), bytes / 4, 7);
  const auto ms = time_calls(
      [&](int) { BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 3, 30);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9;
}

inline int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA GPU on this machine; the benchmarks need one and did not run.\n");
    return 77;  // ctest: skipped
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  ceilings().copy_gbs = measure_copy_gbs();
  ceilings().kernel_copy_gbs = measure_kernel_copy_gbs();
  ceilings().read_gbs = measure_read_gbs();
  std::printf("GPU: %s, %d SMs, L2 %d MB\nceiling: device-to-device copy %.0f GB/s (read + write, "
              "2 GiB moved, median of 30); a plain 16-byte copy kernel: %.0f GB/s; read-only stream "
              "%.0f GB/s\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, ceilings().copy_gbs,
              ceilings().kernel_copy_gbs, ceilings().read_gbs);
  benchmark::AddCustomContext("gpu", prop.name);
  benchmark::AddCustomContext("copy_ceiling_GBps", std::to_string(ceilings().copy_gbs));
  benchmark::AddCustomContext("kernel_copy_GBps", std::to_string(ceilings().kernel_copy_gbs));
  benchmark::AddCustomContext("read_GBps", std::to_string(ceilings().read_gbs));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("\n%-58s %10s %10s %8s %10s\n", "benchmark (median of event timings)", "ms", "GB/s", "% ceil",
              "% same-B");
  for (const Row& r : summary()) {
    if (r.pct_same > 0) {
      std::printf("%-58s %10.4f %10.0f %7.1f%% %9.1f%%\n", r.name.c_str(), r.ms, r.gbs, r.pct, r.pct_same);
    } else {
      std::printf("%-58s %10.4f %10.0f %7.1f%%\n", r.name.c_str(), r.ms, r.gbs, r.pct);
    }
  }
  std::printf("%% ceil: of the 2 GiB device-to-device copy; %% same-B: of a device-to-device copy moving "
              "the same bytes (read + written), timed the same way\n");
  return 0;
}

}  // namespace bench

#define BENCH_MAIN \
  int main(int argc, char** argv) { return bench::main(argc, argv); }
