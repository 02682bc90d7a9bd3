// RoPE tuning sweep, bf16, at the shapes of bench/bench_rope.cu (LLaMA-3-8B: batch 4, sequence
// 4096, 32 query and 8 KV heads of 128, q and k in place in one launch): the RopePolicy variants
// beside the default, back to back and as single calls, the default with programmatic dependent
// launch off, and the default once more last (the spread between it and the first row is the
// noise). Useful bytes as in bench/bench_rope.cu.
#include "harness.cuh"

#include <tigon/rope/rope.cuh>

#include "rope_bench.cuh"

using tigon::bf16;

namespace {



template <class Style, class P = tigon::RopePolicy>
void BM_rope(benchmark::State& st, bool backward, bool bhtd, const char* label,
             rope_bench::Mode mode = rope_bench::Mode::llama) {
  rope_bench::run<Style, P>(st, backward, bhtd, label, mode);
}

void BM_fwd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd bf16 B4 T4096 32/8x128 [B,T,H,D]"); }
void BM_bwd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, true, false, "bwd bf16 B4 T4096 32/8x128 [B,T,H,D]"); }
void BM_fwd_bhtd(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, true, "fwd bf16 B4 T4096 32/8x128 [B,H,T,D]"); }
void BM_fwd_inter(benchmark::State& st) { BM_rope<tigon::RopeInterleaved>(st, false, false, "fwd bf16 B4 T4096 interleaved"); }

// Four heads per thread in the head-group kernel (the default: two).
struct Heads4 : tigon::RopePolicy {
  static constexpr int kHeads = 4;
};
void BM_fwd_heads4(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit, Heads4>(st, false, false, "  policy heads4 fwd [B,T,H,D]"); }
void BM_bwd_heads4(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit, Heads4>(st, true, false, "  policy heads4 bwd [B,T,H,D]"); }
void BM_bhtd_heads4(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit, Heads4>(st, false, true, "  policy heads4 fwd [B,H,T,D]"); }
// Qwen2-VL-7B's heads: M-RoPE with the default and with four heads per thread, and one per-batch
// table without sections (what the planes cost beside the per-batch rows themselves).
void BM_mrope(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd M-RoPE 28/4x128", rope_bench::Mode::mrope); }
void BM_mrope_heads4(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit, Heads4>(st, false, false, "  policy heads4 fwd M-RoPE 28/4x128", rope_bench::Mode::mrope); }
void BM_qwen_tables(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "  fwd 28/4x128 per-batch table, no sections", rope_bench::Mode::batch_tables); }
void BM_qwen_tables4(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit, Heads4>(st, false, false, "  policy heads4 fwd 28/4x128 per-batch table", rope_bench::Mode::batch_tables); }
// The default with programmatic dependent launch off: what the launch overlap is worth.
void BM_fwd_serial(benchmark::State& st) {
  tigon::set_programmatic_launch(false);
  BM_rope<tigon::RopeHalfSplit>(st, false, false, "  fwd [B,T,H,D] serial launch");
  tigon::set_programmatic_launch(true);
}

}  // namespace

#define ROPE_ARGS ->Args({4, 4096})->UseManualTime()->Iterations(100)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_fwd) ROPE_ARGS;
BENCHMARK(BM_bwd) ROPE_ARGS;
BENCHMARK(BM_fwd_bhtd) ROPE_ARGS;
BENCHMARK(BM_fwd_inter) ROPE_ARGS;
BENCHMARK(BM_fwd_heads4) ROPE_ARGS;
BENCHMARK(BM_bwd_heads4) ROPE_ARGS;
BENCHMARK(BM_bhtd_heads4) ROPE_ARGS;
BENCHMARK(BM_fwd_serial) ROPE_ARGS;
BENCHMARK(BM_mrope) ROPE_ARGS;
BENCHMARK(BM_mrope_heads4) ROPE_ARGS;
BENCHMARK(BM_qwen_tables) ROPE_ARGS;
BENCHMARK(BM_qwen_tables4) ROPE_ARGS;
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_fwd>) ROPE_ARGS;
BENCHMARK(bench::single<BM_bwd>) ROPE_ARGS;
BENCHMARK(bench::single<BM_fwd_heads4>) ROPE_ARGS;
// The default once more, last: the spread between this row and the first is the noise.
void BM_fwd_again(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd bf16 B4 T4096 32/8x128 [B,T,H,D] (again)"); }
BENCHMARK(BM_fwd_again) ROPE_ARGS;

BENCH_MAIN
