// Beyond 2^31 elements: cross-entropy over 16385 x 131072 bf16 logits and RMSNorm over 262145 x 8192
// bf16 elements, each against the same op run on row chunks of under 2^31 elements (the rows are
// independent, so every per-row output must be bitwise the same; the summed loss agrees to fp32
// rounding). Inputs are generated on the device; outputs compared on the device. About 13 GB of
// device memory; tagged [large].
#include "gpu_test.cuh"

#include <tigon/loss/cross_entropy.cuh>
#include <tigon/norm/rms_norm.cuh>

using namespace tigon;
using namespace gpu_test;

namespace {

constexpr std::int64_t kTwo31 = std::int64_t{1} << 31;

// Elements (as raw bytes of `width`) where a and b differ, counted on the device.
template <class W>
__global__ void count_diff(const W* a, const W* b, std::int64_t n, unsigned long long* out) {
  unsigned long long c = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    c += a[i] != b[i];
  }
  if (c != 0) atomicAdd(out, c);
}

template <class T>
unsigned long long differ(const T* a, const T* b, std::int64_t n) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8);
  using W = std::conditional_t<sizeof(T) == 2, unsigned short, std::conditional_t<sizeof(T) == 4, unsigned, unsigned long long>>;
  DeviceBuffer<unsigned long long> out(1);
  REQUIRE(cudaMemset(out.ptr, 0, sizeof(unsigned long long)) == cudaSuccess);
  count_diff<<<1056, 256>>>(reinterpret_cast<const W*>(a), reinterpret_cast<const W*>(b), n, out.ptr);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  return out.download()[0];
}

void fill(bf16* p, std::int64_t n, std::uint64_t seed, float scale) { fill_hash(p, n, seed, -scale, scale); }

}  // namespace

TEST_CASE("cross_entropy over 2^31 logits equals its row chunks", "[ce][gpu][large]") {
  const std::int64_t R = 16385, V = 131072, n = R * V;
  REQUIRE(n > kTwo31);
  DeviceBuffer<bf16> x(n), g_full(n), g_chunk(n);
  fill(x.ptr, n, run_seed(), 8.0f);
  std::vector<std::int64_t> th(R);
  std::uniform_int_distribution<std::int64_t> pick(0, V - 1);
  for (auto& t : th) t = pick(rng());
  th[7] = -100;  // one ignored row
  DeviceBuffer<std::int64_t> t(R);
  t.upload(th);
  DeviceBuffer<float> loss(2), rows_full(R), rows_chunk(R), lse_full(R), lse_chunk(R);
  DeviceBuffer<std::int64_t> am_full(R), am_chunk(R);
  auto args = [&](std::int64_t r0, std::int64_t rows, bf16* g, float* lr, float* lse, std::int64_t* am, float* l) {
    CrossEntropyArgs<bf16> a{.logits = x.ptr + r0 * V, .targets = t.ptr + r0, .rows = rows, .vocab = V,
                             .dlogits = g + r0 * V, .reduction = Reduction::sum, .loss = l, .loss_rows = lr + r0,
                             .lse = lse + r0, .argmax = am + r0};
    return a;
  };
  auto run = [&](CrossEntropyArgs<bf16> a) {
    std::size_t bytes = 0;
    TIGON_OK(cross_entropy_workspace_bytes(a, bytes));
    DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
    a.workspace = ws.ptr;
    a.workspace_bytes = bytes;
    TIGON_OK(cross_entropy(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
  };
  run(args(0, R, g_full.ptr, rows_full.ptr, lse_full.ptr, am_full.ptr, loss.ptr));
  double chunk_sum = 0;
  const std::int64_t step = 4096;  // 4096 x 131072 = 2^29 elements a call
  for (std::int64_t r0 = 0; r0 < R; r0 += step) {
    run(args(r0, std::min(step, R - r0), g_chunk.ptr, rows_chunk.ptr, lse_chunk.ptr, am_chunk.ptr, loss.ptr + 1));
    chunk_sum += loss.download()[1];
  }
  CHECK(differ(g_full.ptr, g_chunk.ptr, n) == 0);
  CHECK(differ(rows_full.ptr, rows_chunk.ptr, R) == 0);
  CHECK(differ(lse_full.ptr, lse_chunk.ptr, R) == 0);
  CHECK(differ(am_full.ptr, am_chunk.ptr, R) == 0);
  const double full = loss.download()[0];
  INFO("loss " << full << " against the chunks' " << chunk_sum);
  CHECK(std::abs(full - chunk_sum) <= 1e-5 * std::abs(chunk_sum));
  // The ignored row: zero loss and gradient; the last row (past 2^31 elements) a finite loss.
  const auto lr = rows_full.download();
  CHECK(lr[7] == 0.0f);
  CHECK(std::isfinite(lr[R - 1]));
  CHECK(lr[R - 1] > 0.0f);
}

TEST_CASE("rms_norm over 2^31 elements equals its row chunks", "[rms_norm][gpu][large]") {
  const std::int64_t R = 262145, D = 8192, n = R * D;
  REQUIRE(n > kTwo31);
  DeviceBuffer<bf16> x(n), y_full(n), y_chunk(n), w(D);
  fill(x.ptr, n, run_seed() + 1, 3.0f);
  fill(w.ptr, D, run_seed() + 2, 1.0f);
  DeviceBuffer<float> r_full(R), r_chunk(R);
  RmsNormForwardArgs<bf16> a{.x = x.ptr, .y = y_full.ptr, .weight = w.ptr, .rstd = r_full.ptr, .rows = R, .cols = D};
  TIGON_OK(rms_norm_forward(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::int64_t step = 65536;  // 2^29 elements a call
  for (std::int64_t r0 = 0; r0 < R; r0 += step) {
    RmsNormForwardArgs<bf16> c{.x = x.ptr + r0 * D, .y = y_chunk.ptr + r0 * D, .weight = w.ptr,
                               .rstd = r_chunk.ptr + r0, .rows = std::min(step, R - r0), .cols = D};
    TIGON_OK(rms_norm_forward(c, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(differ(y_full.ptr, y_chunk.ptr, n) == 0);
  CHECK(differ(r_full.ptr, r_chunk.ptr, R) == 0);
  const auto rs = r_full.download();
  CHECK(std::isfinite(rs[R - 1]));
  CHECK(rs[R - 1] > 0.0f);
}
