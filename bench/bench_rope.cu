// RoPE benchmarks, bf16, LLaMA-3-8B attention shapes: batch 4, sequence 4096, 32 query and 8 KV
// heads of 128, q and k rotated in place in one launch (as a trainer calls it), forward and
// backward, through the default launchers (rope_forward / rope_backward); and Qwen2-VL-7B's M-RoPE
// (28 / 4 heads of 128, sections 16 / 24 / 24, per-batch tables). Useful bytes: read q and
// k once, write them once, read the cos / sin tables once. The policy variants are in
// bench/tuning/bench_rope_tuning.cu.
#include "harness.cuh"

#include <tigon/rope/rope.cuh>

#include "rope_bench.cuh"

using tigon::bf16;

namespace {



template <class Style>
void BM_rope(benchmark::State& st, bool backward, bool bhtd, const char* label,
             rope_bench::Mode mode = rope_bench::Mode::llama) {
  rope_bench::run<Style>(st, backward, bhtd, label, mode);
}

void BM_fwd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd bf16 B4 T4096 32/8x128 [B,T,H,D]"); }
void BM_bwd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, true, false, "bwd bf16 B4 T4096 32/8x128 [B,T,H,D]"); }
void BM_fwd_bhtd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, true, "fwd bf16 B4 T4096 32/8x128 [B,H,T,D]"); }
void BM_fwd_mrope(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd bf16 B4 T4096 M-RoPE 28/4x128 [B,T,H,D]", rope_bench::Mode::mrope); }
void BM_bwd_mrope(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, true, false, "bwd bf16 B4 T4096 M-RoPE 28/4x128 [B,T,H,D]", rope_bench::Mode::mrope); }
void BM_fwd_inter(benchmark::State& st) { BM_rope<tigon::RopeInterleaved>(st, false, false, "fwd bf16 B4 T4096 interleaved"); }

}  // namespace

#define ROPE_ARGS ->Args({4, 4096})->UseManualTime()->Iterations(100)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_fwd) ROPE_ARGS;
BENCHMARK(BM_bwd) ROPE_ARGS;
BENCHMARK(BM_fwd_bhtd) ROPE_ARGS;
BENCHMARK(BM_fwd_inter) ROPE_ARGS;
BENCHMARK(BM_fwd_mrope) ROPE_ARGS;
BENCHMARK(BM_bwd_mrope) ROPE_ARGS;
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_fwd>) ROPE_ARGS;
BENCHMARK(bench::single<BM_bwd>) ROPE_ARGS;

BENCH_MAIN
