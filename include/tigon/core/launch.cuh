// tigon/core/launch.cuh - how every tigon kernel is launched: programmatic dependent launch (PDL) on
// Hopper and later, so that a kernel's blocks are scheduled while the kernel before it in the
// stream drains its last wave, instead of after it has finished.
//
// The contract, on both sides:
// - device: every kernel launched through `launch` calls `grid_dependency_sync()` before its first
//   global-memory access (read or write). That waits until the grids it depends on have completed
//   and their writes are visible (`griddepcontrol.wait`), then lets the next kernel in the stream
//   begin to launch (`griddepcontrol.launch_dependents`). Launched without the attribute, or before
//   sm_90, both instructions do nothing. Before it a kernel may only compute from its parameters,
//   set up its own shared memory and cluster barriers (the resident cross-entropy kernel's mbarrier
//   and first cluster arrival), and ask the L2 for lines it is about to read
//   (`prefetch_l2_line_of`, `prefetch_l2_bulk`: hints, not accesses).
// - host: `launch` adds the programmatic-stream-serialisation attribute when programmatic launch is
//   enabled (the default; `set_programmatic_launch(false)` turns it off for the process, and
//   defining TIGON_NO_PROGRAMMATIC_LAUNCH compiles it out), the device is sm_90 or later, and the
//   kernel's code was compiled for compute_90 or later (its PTX version, from
//   cudaFuncGetAttributes, cached per kernel and device): a kernel JIT-compiled on an H200 from
//   compute_80 PTX has no griddepcontrol instructions, so it must not be launched early.
//
// Stream order is unchanged for everything else: a kernel launched without the attribute (any
// other library's), a copy or an event still waits for tigon's kernels to complete. Inside a CUDA
// graph capture the attribute becomes a programmatic edge.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "config.hpp"
#include "device.hpp"
#include "status.hpp"

TIGON_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<bool>& programmatic_launch_flag() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace detail

// Process-wide switch for programmatic dependent launch (on by default). Each shared object that
// includes tigon has its own switch (the symbols are hidden).
inline void set_programmatic_launch(bool on) {
  detail::programmatic_launch_flag().store(on, std::memory_order_relaxed);
}
inline bool programmatic_launch() {
#if defined(TIGON_NO_PROGRAMMATIC_LAUNCH)
  return false;
#else
  return detail::programmatic_launch_flag().load(std::memory_order_relaxed);
#endif
}

namespace detail {

// Called by every kernel launched through `launch` before its first global-memory access (see the
// contract above).
TIGON_DEVICE void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Launch geometry; `cluster` > 0 adds a thread-block-cluster dimension (x) to the launch.
struct LaunchShape {
  dim3 grid;
  dim3 block;
  std::size_t smem = 0;
  cudaStream_t stream = nullptr;
  unsigned cluster = 0;
};

inline constexpr int kMaxLaunchAttrs = 2;

// The launch configuration `launch` uses (also what occupancy queries of clustered kernels need).
// `attrs` must outlive the returned configuration.
inline cudaLaunchConfig_t launch_config(const LaunchShape& s, bool programmatic,
                                        cudaLaunchAttribute (&attrs)[kMaxLaunchAttrs]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = s.grid;
  cfg.blockDim = s.block;
  cfg.dynamicSmemBytes = s.smem;
  cfg.stream = s.stream;
  unsigned n = 0;
  if (programmatic) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (s.cluster > 0) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = s.cluster;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cfg;
}

// Whether `kernel`, launched now on the current device, uses programmatic dependent launch: the
// switch is on, the device is sm_90+, and the kernel's code was compiled for compute_90+ (so its
// grid_dependency_sync() holds the wait). The kernel's answer is cached per device.
inline Status programmatic_launch_here(const void* kernel, bool& on) {
  on = false;
  if (!programmatic_launch()) return Status();
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  if (dev.cc_major < 9) return Status();
  static std::mutex mutex;
  static std::unordered_map<std::uintptr_t, bool> compiled_for_90;
  const std::uintptr_t key = reinterpret_cast<std::uintptr_t>(kernel) * kMaxDevices +
                             static_cast<std::uintptr_t>(dev.device);
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = compiled_for_90.find(key);
    if (it != compiled_for_90.end()) {
      on = it->second;
      return Status();
    }
  }
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return Status::from_cuda(e, "launch", "cudaFuncGetAttributes");
  on = attr.ptxVersion >= 90;
  std::lock_guard<std::mutex> lock(mutex);
  compiled_for_90[key] = on;
  return Status();
}

// Launch `kernel` (which calls grid_dependency_sync() first) with `args`; a launch error is
// returned as a Status naming `op`.
template <class... Params, class... Args>
[[nodiscard]] inline Status launch(const char* op, void (*kernel)(Params...), const LaunchShape& shape,
                                   Args&&... args) {
  bool programmatic = false;
  TIGON_CHECK(programmatic_launch_here(reinterpret_cast<const void*>(kernel), programmatic));
  cudaLaunchAttribute attrs[kMaxLaunchAttrs];
  const cudaLaunchConfig_t cfg = launch_config(shape, programmatic, attrs);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // reported here, once
    return Status::from_cuda(e, op, "kernel launch");
  }
  return check_launch(op);
}

// How many clusters of `one.cluster` blocks of `kKernel`, launched with `one`'s block and shared
// memory, the current device holds at once (0: not one; cross-entropy's and the divergences'
// row-per-cluster kernels take their row kernels then). Asked of cudaOccupancyMaxActiveClusters
// once per kernel, device and cluster size (1 to kMaxCluster), so that a call costs no occupancy
// query; clusters beyond the portable 8 blocks are allowed on the kernel first.
template <auto kKernel, int kMaxCluster>
[[nodiscard]] inline Status cluster_residency(const LaunchShape& one, const char* op, int& clusters) {
  clusters = 0;
  static std::atomic<int> known[kMaxDevices][kMaxCluster + 1] = {};  // 0: not asked, -1: none, else the count
  const int csize = static_cast<int>(one.cluster);
  if (csize < 1 || csize > kMaxCluster) return Status();
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  if (dev.device < 0 || dev.device >= kMaxDevices) return Status();
  std::atomic<int>& k = known[dev.device][csize];
  int f = k.load(std::memory_order_relaxed);
  if (f == 0) {
    if (csize > 8) {
      TIGON_CHECK(Status::from_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                                    op, "cudaFuncSetAttribute"));
    }
    cudaLaunchAttribute attrs[kMaxLaunchAttrs];
    const cudaLaunchConfig_t query = launch_config(one, false, attrs);
    int resident = 0;
    TIGON_CHECK(Status::from_cuda(cudaOccupancyMaxActiveClusters(&resident, kKernel, &query), op,
                                  "cudaOccupancyMaxActiveClusters"));
    f = resident >= 1 ? resident : -1;
    k.store(f, std::memory_order_relaxed);
  }
  clusters = f > 0 ? f : 0;
  return Status();
}

}  // namespace detail

TIGON_NAMESPACE_END
