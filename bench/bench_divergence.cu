// Divergence benchmarks, bf16 student and teacher, batchmean, the default policy: loss + gradient
// written in place over the student for each divergence (useful bytes: the student read, the
// teacher read, the gradient written; against the copy rate measured in the same process), on
// log-probs (probs for TVD and KLDiv's probability target); the generalised JSD also with labels
// (1% of the rows ignored, counted as if read), as a single call, on logits (the resident kernel)
// and for the loss alone (student and teacher read; against the read-only rate).
#include "harness.cuh"

#include <tigon/loss/divergence.cuh>

#include "div_bench.cuh"

namespace {

using div_bench::Opt;
using div_bench::Which;
using div_bench::run;
using tigon::DivergenceInput;

constexpr auto kP = DivergenceInput::probs, kZ = DivergenceInput::logits;

void BM_forward_kl(benchmark::State& st) { run(st, {.which = Which::forward_kl}); }
void BM_reverse_kl(benchmark::State& st) { run(st, {.which = Which::reverse_kl}); }
void BM_jsd(benchmark::State& st) { run(st, {.which = Which::jsd}); }
void BM_kldiv(benchmark::State& st) { run(st, {.which = Which::kldiv}); }  // log_target=True
void BM_kldiv_probs(benchmark::State& st) { run(st, {.which = Which::kldiv, .teacher = kP}); }
void BM_tvd(benchmark::State& st) { run(st, {.which = Which::tvd, .student = kP, .teacher = kP}); }
void BM_jsd_labels(benchmark::State& st) { run(st, {.which = Which::jsd, .labels = true}); }
void BM_jsd_logits(benchmark::State& st) { run(st, {.which = Which::jsd, .student = kZ, .teacher = kZ}); }
void BM_jsd_loss(benchmark::State& st) { run(st, {.which = Which::jsd, .grad = false}); }
void BM_forward_kl_logits_loss(benchmark::State& st) {
  run(st, {.which = Which::forward_kl, .student = kZ, .teacher = kZ, .grad = false});
}

}  // namespace

#define DIV_BENCH(f) BENCHMARK(f)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)
// Each divergence at LLaMA-3's vocabulary (and LLaMA-2's).
DIV_BENCH(BM_forward_kl)->Args({8192, 128256})->Args({8192, 32000});
DIV_BENCH(BM_reverse_kl)->Args({8192, 128256});
DIV_BENCH(BM_jsd)->Args({8192, 128256})->Args({8192, 32000});
DIV_BENCH(BM_kldiv)->Args({8192, 128256});
DIV_BENCH(BM_kldiv_probs)->Args({8192, 128256});
DIV_BENCH(BM_tvd)->Args({8192, 128256});
// Labels (the count of non-ignored rows first), a single call alone on the device, logits (the
// resident kernel), the loss alone.
DIV_BENCH(BM_jsd_labels)->Args({8192, 128256});
DIV_BENCH(bench::single<BM_jsd>)->Args({8192, 128256});
DIV_BENCH(BM_jsd_logits)->Args({8192, 128256})->Args({8192, 32000});
DIV_BENCH(BM_jsd_loss)->Args({8192, 128256});
DIV_BENCH(BM_forward_kl_logits_loss)->Args({8192, 128256});

BENCH_MAIN
