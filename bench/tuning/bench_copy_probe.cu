// Copy probes: how close different ways of streaming memory get to cudaMemcpy's device-to-device
// rate on this GPU. Every memory-bound op in tigon is measured against that rate; these probes say
// which access technique can reach it (per-thread 16-byte accesses, several loads in flight per
// thread, block-contiguous chunks, cache hints, or the bulk-copy engine through shared memory), what
// a copy in place reaches against one to another buffer, and how much of a buffer read once L2
// still holds for a second read.
// Sizes: 1 GiB (the ceiling's size) and 128 MiB (an op the size of RMSNorm 16384 x 4096 bf16), read
// and written per call; bytes counted = read + written.
#include "harness.cuh"

#include <tigon/core/async_copy.cuh>
#include <tigon/core/vector.cuh>

#include <cstdint>

namespace {

// a. grid-stride, one 16-byte load and store per iteration: the harness's bench::copy_kernel (the
// "plain 16-byte copy kernel" of its ceiling line)

// b. grid-stride, kU independent 16-byte loads in flight per thread, then the stores
template <int kU, bool kHints>
__global__ void copy_unrolled(const int4* __restrict__ s, int4* __restrict__ d, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; base < n;
       base += stride * kU) {
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + u * stride;
      if (i < n) v[u] = kHints ? __ldcs(s + i) : s[i];
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + u * stride;
      if (i < n) {
        if (kHints) {
          __stcs(d + i, v[u]);
        } else {
          d[i] = v[u];
        }
      }
    }
  }
}

// c. each block copies contiguous chunks of kChunk vectors, kU loads in flight per thread
template <int kU>
__global__ void copy_block_chunks(const int4* __restrict__ s, int4* __restrict__ d, std::size_t n) {
  const std::size_t chunk = static_cast<std::size_t>(blockDim.x) * kU;
  for (std::size_t c = blockIdx.x; c * chunk < n; c += gridDim.x) {
    int4 v[kU];
    const std::size_t base = c * chunk + threadIdx.x;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(u) * blockDim.x;
      if (i < n) v[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(u) * blockDim.x;
      if (i < n) d[i] = v[u];
    }
  }
}

// e. no grid stride: one block per contiguous chunk of kU * blockDim vectors, as many blocks as
// chunks (the shape of a one-row-per-block kernel)
template <int kU>
__global__ void copy_oneshot(const int4* __restrict__ s, int4* __restrict__ d, std::size_t n) {
  const std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) * kU + threadIdx.x;
  int4 v[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const std::size_t i = base + static_cast<std::size_t>(u) * blockDim.x;
    if (i < n) v[u] = s[i];
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const std::size_t i = base + static_cast<std::size_t>(u) * blockDim.x;
    if (i < n) d[i] = v[u];
  }
}

// d. the bulk-copy engine: one thread per block streams kChunk-byte pieces global -> shared ->
// global through kStages shared-memory stages (cp.async.bulk with mbarrier completion, through
// tigon's core/async_copy.cuh, then cp.async.bulk stores).
template <int kChunk, int kStages>
__global__ void __launch_bounds__(32) copy_bulk(const char* __restrict__ s, char* __restrict__ d,
                                                std::size_t bytes) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) std::uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  for (int i = 0; i < kStages; ++i) tigon::mbarrier_init(&bar[i]);
  tigon::fence_proxy_async_shared();
  const std::size_t chunks = bytes / kChunk;
  // this block's chunks: blockIdx.x, blockIdx.x + gridDim.x, ...
  auto chunk_of = [&](std::size_t k) { return blockIdx.x + k * gridDim.x; };
  std::size_t mine = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto load = [&](std::size_t k) {
    const int st = static_cast<int>(k % kStages);
    tigon::mbarrier_arrive_expect_tx(&bar[st], kChunk);
    tigon::bulk_copy_g2s(buf + st * kChunk, s + chunk_of(k) * kChunk, kChunk, &bar[st]);
  };
  for (std::size_t k = 0; k < mine && k < kStages; ++k) load(k);
  for (std::size_t k = 0; k < mine; ++k) {
    const int st = static_cast<int>(k % kStages);
    tigon::mbarrier_wait(&bar[st], static_cast<unsigned>((k / kStages) & 1));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + chunk_of(k) * kChunk),
                 "r"(tigon::smem_u32(buf + st * kChunk)), "r"(kChunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // The stage of chunk k - 1 is free once its store has read it; refill it with chunk k-1+S.
    if (k >= 1 && k - 1 + kStages < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(k - 1 + kStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

std::string mib(std::size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, " %zu MiB", bytes >> 20);
  return s;
}

void report(benchmark::State& st, const std::string& name, const std::function<void()>& launch) {
  const std::size_t bytes = static_cast<std::size_t>(st.range(0)) << 20;
  bench::run(st, name + mib(bytes), 2.0 * bytes, [&](int) { launch(); }, 5);
}

// In place: kU 16-byte loads in flight per thread, each written back to where it was read (x ^ flip,
// flip 0 at run time, so that no store can be dropped). What an in-place op (RoPE, the
// cross-entropy gradient) can reach against a copy to another buffer.
template <int kU>
__global__ void copy_in_place(int4* p, std::size_t n, int flip) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; base < n;
       base += stride * kU) {
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + u * stride;
      if (i < n) v[u] = p[i];
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::size_t i = base + u * stride;
      if (i < n) {
        v[u].x ^= flip;
        p[i] = v[u];
      }
    }
  }
}

struct Buffers {
  std::size_t kBytes = 0;
  char* src = nullptr;
  char* dst = nullptr;
  explicit Buffers(const benchmark::State& st) : kBytes(static_cast<std::size_t>(st.range(0)) << 20) {
    src = bench::alloc<char>(kBytes);
    dst = bench::alloc<char>(kBytes);
    bench::fill_random(reinterpret_cast<float*>(src), kBytes / 4, 17);
  }
  ~Buffers() {
    cudaFree(src);
    cudaFree(dst);
  }
};

int sms() {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0);
  return n;
}

void BM_memcpy(benchmark::State& st) {
  Buffers b(st);
  report(st, "probe cudaMemcpyAsync D2D", [&] { cudaMemcpyAsync(b.dst, b.src, b.kBytes, cudaMemcpyDeviceToDevice); });
}
void BM_v1(benchmark::State& st) {
  Buffers b(st);
  const int g = sms() * 8;
  report(st, "probe grid-stride 16 B/thread", [&] {
    bench::copy_kernel<<<g, 256>>>(reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.dst), b.kBytes / 16);
  });
}
template <int kU, bool kHints>
void BM_unrolled(benchmark::State& st) {
  Buffers b(st);
  const int g = sms() * 8;
  report(st, std::string("probe grid-stride ") + std::to_string(kU) + "x16 B/thread" + (kHints ? " .cs hints" : ""), [&] {
    copy_unrolled<kU, kHints><<<g, 256>>>(reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.dst), b.kBytes / 16);
  });
}
template <int kU>
void BM_in_place(benchmark::State& st) {
  Buffers b(st);
  const int g = sms() * 8;
  report(st, std::string("probe in place, grid-stride ") + std::to_string(kU) + "x16 B/thread", [&] {
    copy_in_place<kU><<<g, 256>>>(reinterpret_cast<int4*>(b.src), b.kBytes / 16, 0);
  });
}
template <int kU>
void BM_chunks(benchmark::State& st) {
  Buffers b(st);
  const int g = sms() * 8;
  report(st, std::string("probe block chunks ") + std::to_string(kU) + "x16 B/thread", [&] {
    copy_block_chunks<kU><<<g, 256>>>(reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.dst), b.kBytes / 16);
  });
}
template <int kU, int kThreads>
void BM_oneshot(benchmark::State& st) {
  Buffers b(st);
  const std::size_t n = b.kBytes / 16;
  const auto g = static_cast<unsigned>((n + kThreads * kU - 1) / (kThreads * kU));
  report(st, "probe one block per chunk " + std::to_string(kU) + "x16 B/thread, " + std::to_string(kThreads) +
                 " threads", [&] {
    copy_oneshot<kU><<<g, kThreads>>>(reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.dst), n);
  });
}
template <int kChunk, int kStages, int kPerSm>
void BM_bulk(benchmark::State& st) {
  Buffers b(st);
  const int smem = kChunk * kStages;
  BENCH_CUDA(cudaFuncSetAttribute(copy_bulk<kChunk, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int g = sms() * kPerSm;
  report(st, "probe bulk copy " + std::to_string(kChunk / 1024) + " KB x " + std::to_string(kStages) +
                 " stages, " + std::to_string(kPerSm) + " blocks/SM", [&] {
    copy_bulk<kChunk, kStages><<<g, 32, smem>>>(b.src, b.dst, b.kBytes);
  });
  // The copy must be exact.
  std::vector<char> a(1 << 20), c(1 << 20);
  BENCH_CUDA(cudaMemcpy(a.data(), b.src + (b.kBytes / 2), a.size(), cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(c.data(), b.dst + (b.kBytes / 2), c.size(), cudaMemcpyDeviceToHost));
  if (a != c) st.SkipWithError("bulk copy produced wrong data");
}

// ---- L2 retention: how much of a buffer read once (evict-last) is still in L2 for a second read
// right after it, by the buffer's size (the cross-entropy gradient's question: how many bytes may lie
// between a line's two reads). Each sample: a 512 MiB read to clear L2, then two timed kernels
// over the same W MiB: the first read (evict-last) and the second (evict-first), optionally
// writing its data back in place with the evict-first hint as the in-place gradient does. The
// second read's rate against the first's says where it came from (DRAM: about the same; L2:
// several times faster).
// kMode 0: plain loads (the flush), 1: evict-last, 2: evict-first.
template <int kMode>
__global__ void l2_read(const int4* __restrict__ s, int4* __restrict__ w, std::size_t n, float* sink) {
  const std::uint64_t pol = kMode == 1 ? tigon::l2_policy<tigon::L2Hint::evict_last>()
                                       : tigon::l2_policy<tigon::L2Hint::evict_first>();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  int acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride * 4) {
    tigon::AlignedVec<int, 4> v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (i + u * stride < n) {
        const int* q = reinterpret_cast<const int*>(s + i + u * stride);
        v[u] = kMode == 0 ? tigon::load_vec<4>(q) : tigon::load_vec_policy<4>(q, pol);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (i + u * stride < n) {
        acc ^= v[u].v[0] ^ v[u].v[1] ^ v[u].v[2] ^ v[u].v[3];
        if (w != nullptr) tigon::store_vec_policy(reinterpret_cast<int*>(w + i + u * stride), v[u], pol);
      }
    }
  }
  if (acc == 0x7fffffff) sink[0] = 1.0f;  // keeps the loads
}

void BM_l2_reread(benchmark::State& st) {
  const std::size_t bytes = static_cast<std::size_t>(st.range(0)) << 20;
  const bool write_back = st.range(1) != 0;
  const std::size_t flush_bytes = std::size_t{512} << 20;
  char* buf = bench::alloc<char>(bytes);
  char* flush = bench::alloc<char>(flush_bytes);
  float* sink = bench::alloc<float>(1);
  bench::fill_random(reinterpret_cast<float*>(buf), bytes / 4, 3);
  bench::fill_random(reinterpret_cast<float*>(flush), flush_bytes / 4, 4);
  const int g = sms() * 8;
  const auto* s4 = reinterpret_cast<const int4*>(buf);
  auto* w4 = write_back ? reinterpret_cast<int4*>(buf) : nullptr;
  cudaEvent_t e0, e1, e2;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  BENCH_CUDA(cudaEventCreate(&e2));
  std::vector<double> first, second;
  for (auto _ : st) {
    l2_read<0><<<g, 256>>>(reinterpret_cast<const int4*>(flush), nullptr, flush_bytes / 16, sink);
    BENCH_CUDA(cudaEventRecord(e0));
    l2_read<1><<<g, 256>>>(s4, nullptr, bytes / 16, sink);
    BENCH_CUDA(cudaEventRecord(e1));
    l2_read<2><<<g, 256>>>(s4, w4, bytes / 16, sink);
    BENCH_CUDA(cudaEventRecord(e2));
    BENCH_CUDA(cudaEventSynchronize(e2));
    float a = 0, b = 0;
    BENCH_CUDA(cudaEventElapsedTime(&a, e0, e1));
    BENCH_CUDA(cudaEventElapsedTime(&b, e1, e2));
    first.push_back(a);
    second.push_back(b);
    st.SetIterationTime(b / 1e3);
  }
  BENCH_CUDA(cudaGetLastError());
  const double t1 = bench::median(first), t2 = bench::median(second);
  const double r1 = static_cast<double>(bytes) / (t1 * 1e-3) / 1e9;
  const double r2 = static_cast<double>(bytes) * (write_back ? 2 : 1) / (t2 * 1e-3) / 1e9;
  st.counters["first_read_GBps"] = r1;
  st.counters["second_pass_GBps"] = r2;
  std::printf("probe L2 re-read %4zu MiB%s: first read %.4f ms (%.0f GB/s), second %s %.4f ms (%.0f GB/s)\n",
              bytes >> 20, write_back ? ", written back in place" : "", t1, r1,
              write_back ? "read + write" : "read", t2, r2);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  cudaFree(buf);
  cudaFree(flush);
  cudaFree(sink);
}

}  // namespace

#define PROBE(f) BENCHMARK(f)->Arg(1024)->Arg(128)->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond)
PROBE(BM_memcpy);
PROBE(BM_v1);
PROBE((BM_unrolled<4, false>));
PROBE((BM_unrolled<4, true>));
PROBE((BM_unrolled<8, false>));
PROBE((BM_in_place<4>));
PROBE((BM_in_place<8>));
PROBE((BM_chunks<4>));
PROBE((BM_chunks<8>));
PROBE((BM_oneshot<2, 256>));
PROBE((BM_oneshot<4, 256>));
PROBE((BM_oneshot<8, 128>));
PROBE((BM_bulk<16384, 4, 2>));
PROBE((BM_bulk<32768, 3, 2>));
PROBE((BM_bulk<16384, 8, 1>));
PROBE((BM_bulk<8192, 4, 4>));
BENCHMARK(BM_l2_reread)->ArgsProduct({{8, 16, 24, 32, 40, 48, 64, 96}, {0, 1}})->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);

BENCH_MAIN
