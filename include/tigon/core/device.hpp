// tigon/core/device.hpp - device properties that launch sizing needs, read once per device and
// cached, and the occupancy of each kernel instance, cached per device. No call here synchronises
// or allocates, so launchers stay capturable in CUDA graphs.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "config.hpp"
#include "status.hpp"

TIGON_NAMESPACE_BEGIN

struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int max_threads_per_sm = 0;
  int max_blocks_per_sm = 0;
  int smem_per_block_optin = 0;  // bytes a block may use after opting in
  int smem_per_sm = 0;
  int l2_bytes = 0;
  int cc_major = 0;
  int cc_minor = 0;
};

namespace detail {

inline constexpr int kMaxDevices = 64;

inline Status query_device_info(int device, DeviceInfo& info) {
  struct Attr {
    cudaDeviceAttr attr;
    int* out;
  };
  const Attr attrs[] = {
      {cudaDevAttrMultiProcessorCount, &info.sm_count},
      {cudaDevAttrMaxThreadsPerMultiProcessor, &info.max_threads_per_sm},
      {cudaDevAttrMaxBlocksPerMultiprocessor, &info.max_blocks_per_sm},
      {cudaDevAttrMaxSharedMemoryPerBlockOptin, &info.smem_per_block_optin},
      {cudaDevAttrMaxSharedMemoryPerMultiprocessor, &info.smem_per_sm},
      {cudaDevAttrL2CacheSize, &info.l2_bytes},
      {cudaDevAttrComputeCapabilityMajor, &info.cc_major},
      {cudaDevAttrComputeCapabilityMinor, &info.cc_minor},
  };
  info.device = device;
  for (const Attr& a : attrs) {
    const cudaError_t e = cudaDeviceGetAttribute(a.out, a.attr, device);
    if (e != cudaSuccess) return Status::from_cuda(e, "device_info", "cudaDeviceGetAttribute");
  }
  return Status();
}

}  // namespace detail

// Properties of `device`, read on first use and cached for the life of the process.
inline Status device_info(int device, DeviceInfo& out) {
  if (device < 0 || device >= detail::kMaxDevices) {
    return Status::error(Errc::unsupported, "device_info", "device",
                         "device ordinal " + std::to_string(device) + " is out of range");
  }
  struct Slot {
    std::once_flag once;
    DeviceInfo info;
    Status status;
  };
  static Slot slots[detail::kMaxDevices];
  Slot& s = slots[device];
  std::call_once(s.once, [&] { s.status = detail::query_device_info(device, s.info); });
  out = s.info;
  return s.status;
}

// Properties of the current device (the one kernels launched now run on).
inline Status current_device_info(DeviceInfo& out) {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return Status::from_cuda(e, "device_info", "cudaGetDevice");
  return device_info(device, out);
}

// Resident blocks per multiprocessor of one kernel instance at a fixed block size and dynamic
// shared memory, cached per device. A kernel that needs more than the default 48 KB of dynamic
// shared memory (static + dynamic) gets its limit raised here, once per device, before it is first queried or launched.
template <auto Kernel, int kThreads, int kSmem = 0>
inline Status blocks_per_sm(int device, int& out) {
  static std::atomic<int> cache[detail::kMaxDevices] = {};
  if (device < 0 || device >= detail::kMaxDevices) {
    return Status::error(Errc::unsupported, "blocks_per_sm", "device", "device ordinal out of range");
  }
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    if constexpr (kSmem > 0) {  // static shared memory counts against the same 48 KB default
      const cudaError_t e =
          cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      if (e != cudaSuccess) return Status::from_cuda(e, "blocks_per_sm", "cudaFuncSetAttribute");
    }
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, kThreads, kSmem);
    if (e != cudaSuccess) return Status::from_cuda(e, "blocks_per_sm", "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (v < 1) {
      return Status::error(Errc::unsupported, "blocks_per_sm", "",
                           "kernel cannot be resident with " + std::to_string(kThreads) + " threads");
    }
    cache[device].store(v, std::memory_order_relaxed);
  }
  out = v;
  return Status();
}

// Grid of a persistent kernel on the current device: `wanted` blocks, capped at the blocks that
// are resident at once (occupancy x multiprocessors).
template <auto Kernel, int kThreads, int kSmem = 0>
inline Status resident_grid(std::int64_t wanted, unsigned& grid) {
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  int occ = 0;
  TIGON_CHECK((blocks_per_sm<Kernel, kThreads, kSmem>(dev.device, occ)));
  const std::int64_t resident = static_cast<std::int64_t>(occ) * dev.sm_count;
  grid = static_cast<unsigned>(wanted < resident ? (wanted < 1 ? 1 : wanted) : resident);
  return Status();
}

// Check the launch that was just made; a launch error also leaves the runtime's last error set,
// which this clears so that it is reported once, here.
inline Status check_launch(const char* op) {
  const cudaError_t e = cudaGetLastError();
  return Status::from_cuda(e, op, "kernel launch");
}

TIGON_NAMESPACE_END
