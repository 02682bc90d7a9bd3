// Clusters under compute-sanitizer's synccheck: kernels launched with clusters of 2, 8 and 16 blocks (16
// is a non-portable size), each launch's result checked, in three modes: 0, a kernel that does nothing
// with its cluster; 1, the cluster barrier only; 2, the resident cross-entropy and divergence kernels'
// message pattern (mbarrier + st.async from every block to every block). Exit status 0: all right.
//   nvcc -std=c++20 -O2 -arch=sm_90a -Iinclude scripts/probes/cluster_synccheck.cu -o /tmp/cluster_synccheck
//   /tmp/cluster_synccheck 2; compute-sanitizer --tool synccheck /tmp/cluster_synccheck 0
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include <tigon/core/async_copy.cuh>
using namespace tigon;

__global__ void __launch_bounds__(256) probe(float* out, int big_smem) {
  __shared__ std::uint64_t bar;
  __shared__ float4 slots[16];
  extern __shared__ float pad[];
  const unsigned csize = cluster_blocks(), rank = cluster_rank();
  if (threadIdx.x == 0) mbarrier_init(&bar);
  cluster_arrive_relaxed();
  if (big_smem) pad[threadIdx.x] = float(threadIdx.x);
  cluster_wait();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (lane == 0) mbarrier_arrive_expect_tx(&bar, csize * 16u);
    if (lane < int(csize)) {
      cluster_store_async_f4(cluster_smem_addr(&slots[rank], lane), cluster_smem_addr(&bar, lane), float(rank),
                             float(blockIdx.x), 1.0f, 0.0f);
    }
    mbarrier_wait<true>(&bar, 0);
    float s = lane < int(csize) ? slots[lane].x + slots[lane].z : 0.0f;
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[blockIdx.x] = s;  // sum of ranks + csize
  }
}

// No messages: mode 0 touches nothing of the cluster; mode 1 only the cluster barrier.
__global__ void __launch_bounds__(256) bare(float* out, int mode) {
  if (mode == 1) {
    cluster_arrive_relaxed();
    cluster_wait();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = float(cluster_blocks() * (cluster_blocks() - 1) / 2 + cluster_blocks());
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? argv[1][0] - '0' : 2;  // 0 bare, 1 barrier only, 2 messages
  float* out;
  cudaMalloc(&out, 4096 * sizeof(float));
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(bare, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  cudaFuncSetAttribute(bare, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  int bad_total = 0;
  for (int smem : {0, 1}) {
    for (unsigned cs : {2u, 8u, 16u}) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(cs * 64);
      cfg.blockDim = dim3(256);
      cfg.dynamicSmemBytes = smem ? 100 * 1024 : 1024;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = cs;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      cudaMemset(out, 0, 4096 * sizeof(float));
      cudaError_t e = mode == 2 ? cudaLaunchKernelEx(&cfg, probe, out, smem) : cudaLaunchKernelEx(&cfg, bare, out, mode);
      cudaError_t s = cudaDeviceSynchronize();
      float h[4096];
      cudaMemcpy(h, out, cs * 64 * sizeof(float), cudaMemcpyDeviceToHost);
      int bad = 0;
      const float want = float(cs * (cs - 1) / 2 + cs);
      for (unsigned i = 0; i < cs * 64; ++i) bad += h[i] != want;
      bad_total += bad;
      std::printf("mode %d (%s) cluster %2u dyn smem %6u: launch %s, sync %s, %d of %u blocks wrong\n", mode, mode == 0 ? "no cluster op" : mode == 1 ? "barrier only" : "messages",
                  cs, cfg.dynamicSmemBytes, cudaGetErrorString(e), cudaGetErrorString(s), bad, cs * 64);
      if (s != cudaSuccess) return 2;
    }
  }
  return bad_total ? 1 : 0;
}
