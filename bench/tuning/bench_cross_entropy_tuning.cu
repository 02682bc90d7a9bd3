// Cross-entropy policy sweeps around the default (built with -DTIGON_BUILD_TUNING=ON): the row
// kernel alone against the resident and streaming kernels, and the streaming kernel's segment
// length and vectors in flight. Same body and counting as bench/bench_cross_entropy.cu.
#include "../harness.cuh"

#include <tigon/loss/cross_entropy.cuh>

#include "../ce_bench.cuh"

namespace {

using ce_bench::Opt;
using tigon::CrossEntropyPolicy;

// The row kernel alone (no row reaches kResMinCols).
struct RowsOnly : CrossEntropyPolicy {
  static constexpr std::int64_t kResMinCols = std::int64_t{1} << 40;
};
// The streaming kernel with other segment lengths and vectors in flight.
struct StreamSeg512 : CrossEntropyPolicy {
  static constexpr int kStreamSegVecs = 512;
};
struct StreamSeg2048 : CrossEntropyPolicy {
  static constexpr int kStreamSegVecs = 2048;
};
struct StreamSeg4096 : CrossEntropyPolicy {
  static constexpr int kStreamSegVecs = 4096;
};
struct StreamU4 : CrossEntropyPolicy {
  static constexpr int kStreamUnroll = 4;
};

const Opt kCap{.cap = 30.0f};
const Opt kSmooth{.eps = 0.1f};
const Opt kW{.weights = true};
const Opt kArg{.argmax = true};
const Opt kSmoothArg{.eps = 0.1f, .argmax = true};
const Opt kTok{.token = true};
const Opt kAll{.eps = 0.1f, .cap = 30.0f, .weights = true, .argmax = true};
const Opt kAllUnaligned{.eps = 0.1f, .cap = 30.0f, .weights = true, .argmax = true, .unaligned_weights = true};
const Opt kSmoothW{.eps = 0.1f, .weights = true};
const Opt kSmoothWUnaligned{.eps = 0.1f, .weights = true, .unaligned_weights = true};

}  // namespace

#define CE_TUNE(label, P, grad, opt)                                                                \
  void BM_##label(benchmark::State& st) { ce_bench::run<P>(st, grad, opt, #label); }              \
  BENCHMARK(BM_##label)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)
#define TWO ->Args({8192, 32000})->Args({8192, 128256})

#define CE_TUNE_SPLIT(label, P, finalize)                                                         \
  void BM_##label(benchmark::State& st) { ce_bench::run_split<P>(st, finalize, #label); }          \
  BENCHMARK(BM_##label)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)

CE_TUNE(rows_plain_grad, RowsOnly, true, Opt{}) TWO->Args({8192, 8192})->Args({8192, 16384});
CE_TUNE(default_plain_grad_small, CrossEntropyPolicy, true, Opt{})->Args({8192, 8192})->Args({8192, 16384});
CE_TUNE(rows_softcap_grad, RowsOnly, true, kCap) TWO;
CE_TUNE(rows_all_grad, RowsOnly, true, kAll) TWO;
CE_TUNE(opt_b256_v8_m4_softcap, CrossEntropyPolicy, true, kCap) TWO;
CE_TUNE(res_smooth, CrossEntropyPolicy, true, kSmooth) TWO;
CE_TUNE(res_smooth_argmax, CrossEntropyPolicy, true, kSmoothArg) TWO;
CE_TUNE(opt_b256_v8_m4_weights, CrossEntropyPolicy, true, kW) TWO;
CE_TUNE(res_argmax, CrossEntropyPolicy, true, kArg) TWO;
CE_TUNE(opt_b256_v8_m4_token, CrossEntropyPolicy, true, kTok) TWO;
CE_TUNE(opt_b256_v8_m4_all, CrossEntropyPolicy, true, kAll) TWO;
CE_TUNE(opt_all_unaligned_weights, CrossEntropyPolicy, true, kAllUnaligned) TWO;
CE_TUNE(opt_smooth_weights, CrossEntropyPolicy, true, kSmoothW) TWO;
CE_TUNE(opt_smooth_weights_unaligned, CrossEntropyPolicy, true, kSmoothWUnaligned) TWO;
CE_TUNE(default_loss_smooth_weights, CrossEntropyPolicy, false, kSmoothW) TWO;
CE_TUNE(default_loss_smooth_weights_unaligned, CrossEntropyPolicy, false, kSmoothWUnaligned) TWO;
CE_TUNE(default_loss_plain, CrossEntropyPolicy, false, Opt{}) TWO;
CE_TUNE(rows_loss_plain, RowsOnly, false, Opt{}) TWO;
CE_TUNE(seg512_loss_plain, StreamSeg512, false, Opt{}) TWO;
CE_TUNE(seg2048_loss_plain, StreamSeg2048, false, Opt{}) TWO;
CE_TUNE(default_loss_softcap, CrossEntropyPolicy, false, kCap) TWO;
CE_TUNE(seg2048_loss_softcap, StreamSeg2048, false, kCap) TWO;
CE_TUNE(u4_loss_softcap, StreamU4, false, kCap) TWO;
CE_TUNE(default_loss_argmax, CrossEntropyPolicy, false, kArg) TWO;
CE_TUNE(default_loss_all, CrossEntropyPolicy, false, kAll) TWO;
CE_TUNE_SPLIT(default_shard_stats, CrossEntropyPolicy, false) TWO;
CE_TUNE_SPLIT(rows_shard_stats, RowsOnly, false) TWO;
CE_TUNE_SPLIT(seg512_shard_stats, StreamSeg512, false) TWO;
CE_TUNE_SPLIT(seg2048_shard_stats, StreamSeg2048, false) TWO;
CE_TUNE_SPLIT(seg4096_shard_stats, StreamSeg4096, false) TWO;
CE_TUNE_SPLIT(u4_shard_stats, StreamU4, false) TWO;
CE_TUNE_SPLIT(rows_shard_finalize, RowsOnly, true) TWO;

BENCH_MAIN
