// Cross-entropy benchmarks, bf16, int64 targets, mean reduction, the default policy: loss +
// gradient written in place (useful bytes: read the logits once, write the gradient once; against
// the copy rate) and the loss alone (read once; against the read-only rate measured in the same
// process), plain and with each option (Gemma 2's softcap at its 256000-column vocabulary, label
// smoothing, class weights, smoothing with class weights, the argmax, token scaling, all four of
// softcap, smoothing, weights and argmax), and the split vocabulary's passes over two shards
// (statistics: read once; finalize: read and write once). A linear layer's bias is added in the
// GEMM's epilogue (bench_linear_cross_entropy.cu), so the loss kernels never see one.
#include "harness.cuh"

#include <tigon/loss/cross_entropy.cuh>

#include "ce_bench.cuh"

namespace {

using ce_bench::Opt;

void BM_grad(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{}); }
void BM_loss(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, false, Opt{}); }
void BM_softcap(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.cap = 30.0f}); }
void BM_smooth(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.eps = 0.1f}); }
void BM_weights(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.weights = true}); }
void BM_argmax(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.argmax = true}); }
void BM_token(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.token = true}); }
void BM_smooth_weights(benchmark::State& st) {
  ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.eps = 0.1f, .weights = true});
}
void BM_all(benchmark::State& st) {
  ce_bench::run<tigon::CrossEntropyPolicy>(st, true, Opt{.eps = 0.1f, .cap = 30.0f, .weights = true, .argmax = true});
}
void BM_loss_softcap(benchmark::State& st) { ce_bench::run<tigon::CrossEntropyPolicy>(st, false, Opt{.cap = 30.0f}); }
void BM_shard_stats(benchmark::State& st) { ce_bench::run_split<tigon::CrossEntropyPolicy>(st, false); }
void BM_shard_finalize(benchmark::State& st) { ce_bench::run_split<tigon::CrossEntropyPolicy>(st, true); }

}  // namespace

#define CE_BENCH(f) BENCHMARK(f)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)
#define SHAPES ->Args({8192, 32000})->Args({8192, 128256})->Args({8192, 262144})->Args({16384, 32000})
CE_BENCH(BM_grad) SHAPES;
CE_BENCH(BM_loss) SHAPES;
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
CE_BENCH(bench::single<BM_grad>)->Args({8192, 128256});
CE_BENCH(bench::single<BM_loss>)->Args({8192, 128256});
// Each option, with a gradient: Gemma 2 / 3's softcap at their vocabulary, the others at
// LLaMA-2's and LLaMA-3's.
CE_BENCH(BM_softcap)->Args({8192, 256000})->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_smooth)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_weights)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_argmax)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_token)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_smooth_weights)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_all)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_loss_softcap)->Args({8192, 256000})->Args({8192, 128256})->Args({8192, 32000});
// The split vocabulary: two shards of the vocabulary (the statistics pass and the finalize; the
// merge of 2 x 8192 statistics rows is a few microseconds and not timed).
CE_BENCH(BM_shard_stats)->Args({8192, 128256})->Args({8192, 32000});
CE_BENCH(BM_shard_finalize)->Args({8192, 128256})->Args({8192, 32000});

BENCH_MAIN
