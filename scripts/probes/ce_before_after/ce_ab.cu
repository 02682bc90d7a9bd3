// Same-process A/B of two builds of the cross-entropy (same buffers, same launch order): medians of
// event-timed calls, alternating A and B per round, and the copy rate of the same buffers. Up to four
// variant builds (ce_v1 .. ce_v4, weak: linked only when build.sh is given their include folders)
// are timed in the same rounds, each against the earlier build's mean before and after them.
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdint>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(2); } } while (0)
extern "C" int ce_head(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
extern "C" int ce_before(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
using CeFn = int (*)(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
extern "C" __attribute__((weak)) int ce_v1(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
extern "C" __attribute__((weak)) int ce_v2(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
extern "C" __attribute__((weak)) int ce_v3(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
extern "C" __attribute__((weak)) int ce_v4(void*, const long*, long, long, float*, void*, unsigned long, cudaStream_t);
__global__ void fill(uint16_t* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    float f = (h & 0xffffff) / float(0x1000000) * 2.0f;  // [0, 2)
    unsigned b; memcpy(&b, &f, 4); x[i] = (uint16_t)(b >> 16);
  }
}
__global__ void copyk(const int4* a, int4* b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}
int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  const long shapes[][2] = {{8192, 32000}, {16384, 32000}, {8192, 128256}};
  cudaStream_t s; cudaStreamCreate(&s);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  printf("device %s\n", prop.name);
  for (auto& sh : shapes) {
    long rows = sh[0], V = sh[1];
    size_t n = (size_t)rows * V;
    const int sets = 3;
    std::vector<void*> x(sets);
    for (int i = 0; i < sets; ++i) { CK(cudaMalloc(&x[i], n * 2)); fill<<<1024, 256>>>((uint16_t*)x[i], n, 77 + i); CK(cudaGetLastError()); }
    long* t; CK(cudaMalloc(&t, rows * 8));
    std::vector<long> th(rows); for (long r = 0; r < rows; ++r) th[r] = (r * 7919) % V;
    CK(cudaMemcpy(t, th.data(), rows * 8, cudaMemcpyHostToDevice));
    float* loss; CK(cudaMalloc(&loss, 4));
    unsigned long wsb = 1 << 20; void* ws; CK(cudaMalloc(&ws, wsb));
    void* cp; CK(cudaMalloc(&cp, n * 2));
    CK(cudaDeviceSynchronize());
    auto time = [&](auto f) {
      std::vector<float> ms;
      for (int it = 0; it < 30; ++it) {
        cudaEventRecord(e0, s); f(it); cudaEventRecord(e1, s); cudaEventSynchronize(e1);
        float m; cudaEventElapsedTime(&m, e0, e1); ms.push_back(m);
      }
      std::sort(ms.begin(), ms.end()); return ms[ms.size() / 2];
    };
    for (int r = 0; r < rounds; ++r) {
      float c = time([&](int it) { copyk<<<prop.multiProcessorCount * 8, 512, 0, s>>>((const int4*)x[it % sets], (int4*)cp, n * 2 / 16); });
      float a = time([&](int it) { if (ce_head(x[it % sets], t, rows, V, loss, ws, wsb, s)) exit(1); });
      float b = time([&](int it) { if (ce_before(x[it % sets], t, rows, V, loss, ws, wsb, s)) exit(1); });
      float a2 = time([&](int it) { if (ce_head(x[it % sets], t, rows, V, loss, ws, wsb, s)) exit(1); });
      printf("%ld x %ld round %d: copy %.4f ms (%.0f GB/s)  head %.4f / %.4f  before %.4f  head/before %.4f", rows, V, r, c,
             2.0 * n * 2 / c / 1e6, a, a2, b, 0.5 * (a + a2) / b);
      // The variants run after head's second timing; the earlier build is timed again after them,
      // so that each variant is compared with the mean of the earlier build around it.
      const CeFn variants[] = {ce_v1, ce_v2, ce_v3, ce_v4};
      float v[4] = {};
      bool any = false;
      for (int k = 0; k < 4; ++k) {
        if (variants[k] == nullptr) continue;
        any = true;
        v[k] = time([&](int it) { if (variants[k](x[it % sets], t, rows, V, loss, ws, wsb, s)) exit(1); });
      }
      if (any) {
        const float b2 = time([&](int it) { if (ce_before(x[it % sets], t, rows, V, loss, ws, wsb, s)) exit(1); });
        printf("  before again %.4f", b2);
        for (int k = 0; k < 4; ++k) {
          if (variants[k] != nullptr) printf("  v%d %.4f (v%d/before %.4f)", k + 1, v[k], k + 1, v[k] / (0.5f * (b + b2)));
        }
      }
      printf("\n");
    }
    for (int i = 0; i < sets; ++i) cudaFree(x[i]);
    cudaFree(t); cudaFree(loss); cudaFree(ws); cudaFree(cp);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
