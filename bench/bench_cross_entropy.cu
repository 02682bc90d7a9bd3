// Cross-entropy benchmarks, bf16, int64 targets, mean reduction: loss + gradient written in place
// (useful bytes: read the logits once, write the gradient once; against the copy rate) and loss
// only (read once; against the read-only rate measured in the same process).
#include "harness.cuh"

#include <tigon/loss/cross_entropy.cuh>

using tigon::bf16;

namespace {

void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

template <class P = tigon::CrossEntropyDefaultPolicy>
void BM_ce(benchmark::State& st, bool grad, const std::string& label = "") {
  const std::int64_t rows = st.range(0), V = st.range(1);
  const std::size_t n = static_cast<std::size_t>(rows * V);
  const int sets = bench::rotation(2.0 * n * sizeof(bf16));
  std::vector<bf16*> x;
  for (int s = 0; s < sets; ++s) {
    x.push_back(bench::alloc<bf16>(n));
    bench::fill_random(x.back(), n, 77 + s, 0.0f, 2.0f);
  }
  std::vector<std::int64_t> th(rows);
  for (std::int64_t r = 0; r < rows; ++r) th[r] = (r * 7919) % V;
  std::int64_t* t = bench::alloc<std::int64_t>(rows);
  BENCH_CUDA(cudaMemcpy(t, th.data(), rows * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  float* loss = bench::alloc<float>(1);
  const std::size_t wsb = tigon::cross_entropy_workspace_bytes(rows);
  void* ws = bench::alloc<unsigned char>(wsb);
  const double bytes = (grad ? 2.0 : 1.0) * n * sizeof(bf16);
  const std::string name = (label.empty() ? std::string("cross_entropy ") : "  policy " + label + " ") +
                           (grad ? "loss+grad" : "loss only") + " bf16 " + std::to_string(rows) + "x" +
                           std::to_string(V);
  bench::run(st, name, bytes, [&](int i) {
    tigon::CrossEntropyArgs<bf16> a{.logits = x[i % sets], .targets = t, .rows = rows, .vocab = V,
                                    .dlogits = grad ? x[i % sets] : nullptr, .loss = loss,
                                    .workspace = ws, .workspace_bytes = wsb};
    check(tigon::cross_entropy<P>(a, nullptr));
  }, 10, grad ? bench::Ceiling::copy : bench::Ceiling::read);
  for (bf16* p : x) cudaFree(p);
  cudaFree(t);
  cudaFree(loss);
  cudaFree(ws);
}

void BM_grad(benchmark::State& st) { BM_ce(st, true); }
void BM_loss(benchmark::State& st) { BM_ce(st, false); }

}  // namespace

#define SHAPES ->Args({8192, 32000})->Args({8192, 128256})->Args({8192, 262144})->Args({16384, 32000})
BENCHMARK(BM_grad) SHAPES->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_loss) SHAPES->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_grad>)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
BENCHMARK(bench::single<BM_loss>)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);

// Policy variants at 8192 x 128256: CrossEntropyPolicy<row kernel: wide block, narrow block,
// vectors in flight per thread, rows per SM (0: as many as fit); on-chip kernel: blocks per row
// (-1: automatic, with a gradient; 0: off), its block size, its slice per buffer in KiB, split rows
// (the split-row kernel instead of the on-chip one); row kernel: gradient block over 65536 columns
// (0: the wide block)>. Rows<wide block, vectors in flight, rows per SM>: the row kernel with the
// gradient on the wide block.
#define CE_VARIANT(label, ...)                                                                   \
  void BM_grad_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, true, #label); }           \
  void BM_loss_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, false, #label); }          \
  BENCHMARK(BM_grad_##label)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond); \
  BENCHMARK(BM_loss_##label)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
using tigon::CrossEntropyPolicy;
template <int kW, int kU, int kR>
using Rows = CrossEntropyPolicy<kW, 256, kU, kR, 0, 256, 36, false, 0>;
CE_VARIANT(rows_b1024_u4, Rows<1024, 4, 0>)
CE_VARIANT(rows_b512_u4, Rows<512, 4, 0>)
CE_VARIANT(rows_b256_u4, Rows<256, 4, 0>)
CE_VARIANT(rows_b256_u2, Rows<256, 2, 0>)
CE_VARIANT(rows_b128_u4, Rows<128, 4, 0>)
CE_VARIANT(chip8_b128, CrossEntropyPolicy<256, 256, 4, 0, 8, 128>)
CE_VARIANT(chip8_b256, CrossEntropyPolicy<256, 256, 4, 0, 8, 256>)
CE_VARIANT(chip_auto36_b256, CrossEntropyPolicy<256, 256, 4, 0, -1, 256, 36>)
CE_VARIANT(split2_b512, CrossEntropyPolicy<256, 256, 4, 0, 2, 512, 36, true>)
CE_VARIANT(split4_b256, CrossEntropyPolicy<256, 256, 4, 0, 4, 256, 36, true>)
CE_VARIANT(split4_b512, CrossEntropyPolicy<256, 256, 4, 0, 4, 512, 36, true>)
CE_VARIANT(split8_b256, CrossEntropyPolicy<256, 256, 4, 0, 8, 256, 36, true>)
CE_VARIANT(split8_b512, CrossEntropyPolicy<256, 256, 4, 0, 8, 512, 36, true>)
CE_VARIANT(split8_b1024, CrossEntropyPolicy<256, 256, 4, 0, 8, 1024, 36, true>)
// The row kernel with fewer rows in flight per SM (so that the re-read rows can stay in L2).
CE_VARIANT(rows_b1024_r1, Rows<1024, 4, 1>)
CE_VARIANT(rows_b512_r2, Rows<512, 4, 2>)
CE_VARIANT(rows_b256_r2, Rows<256, 4, 2>)
CE_VARIANT(rows_b256_r3, Rows<256, 4, 3>)

// Loss + gradient only, at the given shapes (SHAPES or ONE_SHAPE).
#define CE_GRAD_ROW(label, shapes, ...)                                                          \
  void BM_grad_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, true, #label); }           \
  BENCHMARK(BM_grad_##label) shapes->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
#define ONE_SHAPE ->Args({8192, 128256})
// The default takes 512-thread blocks for the gradient (kGradThreads) and 256 for the loss alone,
// which is slower with 512 (rows_b512_u4 above); the gradient with 256 threads at every shape:
CE_GRAD_ROW(rows_b256_u4_all, SHAPES, Rows<256, 4, 0>)
// Around the best measured so far (512 threads, 2 rows per SM: 71.6% with the plain gradient path):
// rows per SM and vectors in flight, at 8192 x 128256.
CE_GRAD_ROW(rows_b512_r3, ONE_SHAPE, Rows<512, 4, 3>)
CE_GRAD_ROW(rows_b512_u8_r2, ONE_SHAPE, Rows<512, 8, 2>)
CE_GRAD_ROW(rows_b512_u2_r2, ONE_SHAPE, Rows<512, 2, 2>)
CE_GRAD_ROW(rows_b768_r2, ONE_SHAPE, Rows<768, 4, 2>)
CE_GRAD_ROW(rows_b384_r3, ONE_SHAPE, Rows<384, 4, 3>)
CE_GRAD_ROW(rows_b256_r4, ONE_SHAPE, Rows<256, 4, 4>)

BENCH_MAIN
