// The main of every GPU suite, with Catch2's runner, compiled once and linked into each suite: it
// reports "skipped" (exit 77, which ctest counts as skipped) on a machine without a CUDA GPU, or with
// fewer GPUs than TIGON_NEEDS_GPUS asks for (the two-rank entries), and otherwise prints the GPU and
// the run's random seed before the cases run.
#define CATCH_CONFIG_RUNNER
#include "gpu_test.cuh"

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices == 0) {
    std::printf("SKIPPED: no CUDA GPU on this machine; the GPU tests did not run.\n");
    return gpu_test::kSkipExitCode;
  }
  if (const char* need = std::getenv("TIGON_NEEDS_GPUS"); need != nullptr && devices < std::atoi(need)) {
    std::printf("SKIPPED: %s GPUs needed, %d here.\n", need, devices);
    return gpu_test::kSkipExitCode;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("GPU: %s (sm_%d%d), random seed %llu (replay with TIGON_TEST_SEED)\n", prop.name, prop.major,
              prop.minor, static_cast<unsigned long long>(gpu_test::run_seed()));
  return Catch::Session().run(argc, argv);
}
