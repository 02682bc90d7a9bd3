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
  const std::size_t wsb = tigon::cross_entropy_workspace_bytes<P>(rows, V);
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
// (0: the wide block); segmented kernel: columns per segment (0: off), block size, window in % of
// the blocks in flight>. Rows<wide block, vectors in flight, rows per SM>: the row kernel with the
// gradient on the wide block; Chip<...>: the on-chip / split-row kernels; Seg<...>: the segmented one.
#define CE_VARIANT(label, ...)                                                                   \
  void BM_grad_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, true, #label); }           \
  void BM_loss_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, false, #label); }          \
  BENCHMARK(BM_grad_##label)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond); \
  BENCHMARK(BM_loss_##label)->Args({8192, 128256})->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
using tigon::CrossEntropyPolicy;
template <int kW, int kU, int kR>
using Rows = CrossEntropyPolicy<kW, 256, kU, kR, 0, 256, 36, false, 0, 0>;
template <int kBlocks, int kThreads, bool kSplit>
using Chip = CrossEntropyPolicy<256, 256, 4, 0, kBlocks, kThreads, 36, kSplit, 512, 0>;
template <int kCols, int kThreads, int kWindowPct>
using Seg = CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, kCols, kThreads, kWindowPct>;
CE_VARIANT(rows_b512_u4, Rows<512, 4, 0>)
CE_VARIANT(rows_b256_u4, Rows<256, 4, 0>)
CE_VARIANT(chip_auto36_b256, Chip<-1, 256, false>)
CE_VARIANT(split4_b256, Chip<4, 256, true>)
// The pipelined split-row kernel (the next row's first pass while the statistics travel):
// Pipe<blocks per row, block size, blocks per SM (0: as many as fit)>; at 128256 columns the bytes
// between a slice's two reads are about 2 x (blocks per SM x 132 / blocks per row) x 256 KB: 8.4 MB
// for 8 blocks per row and one per SM, 17 MB for 4 (the L2 keeps about 16 MB). Split<...>: the
// split-row kernel with the same shape, unpipelined.
template <int kBlocks, int kThreads, int kPerSm>
using Pipe = CrossEntropyPolicy<256, 256, 4, kPerSm, kBlocks, kThreads, 36, true, 512, 0, 256, 100, true>;
template <int kBlocks, int kThreads, int kPerSm>
using Split = CrossEntropyPolicy<256, 256, 4, kPerSm, kBlocks, kThreads, 36, true, 512, 0, 256, 100, false>;
CE_VARIANT(pipe8_b512_s1, Pipe<8, 512, 1>)
CE_VARIANT(pipe8_b1024_s1, Pipe<8, 1024, 1>)
CE_VARIANT(pipe8_b256_s2, Pipe<8, 256, 2>)
CE_VARIANT(pipe4_b512_s1, Pipe<4, 512, 1>)
CE_VARIANT(pipe4_b1024_s1, Pipe<4, 1024, 1>)
CE_VARIANT(pipe2_b1024_s1, Pipe<2, 1024, 1>)
CE_VARIANT(split8_b512_s1, Split<8, 512, 1>)

// The resident kernel (one row per cluster, each thread's vectors of the row held in registers):
// Res<block size, 16-byte vectors per thread, blocks per SM its registers must allow>; blocks per
// row at 128256 columns: 8 (256 x 8), 11 (192 x 8) or 16 (128 x 8).
template <int kThreads, int kVecs, int kMinBlocks, int kAhead = 0>
using Res = CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 0, 256, 100, false, kThreads, kVecs, true,
                               kMinBlocks, kAhead>;
CE_VARIANT(res_b256_v8_m4, Res<256, 8, 4>)
CE_VARIANT(res_b256_v8_m5, Res<256, 8, 5>)
CE_VARIANT(res_b192_v8_m5, Res<192, 8, 5>)
CE_VARIANT(res_b128_v8_m8, Res<128, 8, 8>)
// with each block's slice of the row kResAhead rows on asked of the L2 (a bulk prefetch)
CE_VARIANT(res_b256_v8_m4_a16, Res<256, 8, 4, 16>)
CE_VARIANT(res_b256_v8_m4_a32, Res<256, 8, 4, 32>)
CE_VARIANT(res_b256_v8_m4_a64, Res<256, 8, 4, 64>)
CE_VARIANT(res_b256_v8_m5_a32, Res<256, 8, 5, 32>)
CE_VARIANT(res_b128_v8_m8_a32, Res<128, 8, 8, 32>)

// Loss + gradient only, at the given shapes (SHAPES or ONE_SHAPE).
#define CE_GRAD_ROW(label, shapes, ...)                                                          \
  void BM_grad_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, true, #label); }           \
  BENCHMARK(BM_grad_##label) shapes->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
#define ONE_SHAPE ->Args({8192, 128256})
// The row kernel as the previous default ran it (512-thread blocks for gradients over 65536
// columns, 256 otherwise), and with 256 threads everywhere, at every shape:
CE_GRAD_ROW(rowkernel_all, SHAPES, CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 0>)
CE_GRAD_ROW(rows_b256_u4_all, SHAPES, Rows<256, 4, 0>)
// The loss alone with the row kernel spelled out, at every shape.
#define CE_LOSS_ROW(label, shapes, ...)                                                          \
  void BM_loss_##label(benchmark::State& st) { BM_ce<__VA_ARGS__>(st, false, #label); }          \
  BENCHMARK(BM_loss_##label) shapes->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
CE_LOSS_ROW(rowkernel_all, SHAPES, CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 0>)
// The resident kernel at every shape (262144 columns: 16 blocks per row with 256 x 8).
CE_GRAD_ROW(res_b256_v8_m4_a32_all, SHAPES, Res<256, 8, 4, 32>)
CE_LOSS_ROW(res_b256_v8_m4_a32_all, SHAPES, Res<256, 8, 4, 32>)
// The segmented kernel (opt-in; docs/cross_entropy.md): 8192 columns per segment, 256 threads,
// window 100% of the blocks in flight, with and without a gradient; then segment length, block
// size and window around it, with a gradient.
CE_VARIANT(seg_c8192_b256_w100, Seg<8192, 256, 100>)
CE_GRAD_ROW(seg_c4096_b128_w100, ONE_SHAPE, Seg<4096, 128, 100>)
CE_GRAD_ROW(seg_c8192_b256_w200, ONE_SHAPE, Seg<8192, 256, 200>)
CE_GRAD_ROW(seg_c16384_b512_w100, ONE_SHAPE, Seg<16384, 512, 100>)
CE_GRAD_ROW(seg_c8192_b128_w100, ONE_SHAPE, Seg<8192, 128, 100>)

BENCH_MAIN
