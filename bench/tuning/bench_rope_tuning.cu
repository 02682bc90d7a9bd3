// RoPE tuning sweep, bf16, at the shapes of bench/bench_rope.cu (LLaMA-3-8B: batch 4, sequence
// 4096, 32 query and 8 KV heads of 128, q and k in place in one launch): the RopePolicy variants
// beside the default, back to back and as single calls, the default with programmatic dependent
// launch off, and the default once more last (the spread between it and the first row is the
// noise). Useful bytes as in bench/bench_rope.cu.
#include "harness.cuh"

#include <tigon/rope/rope.cuh>

using tigon::bf16;

namespace {

void check(const tigon::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

template <class Style, class P = tigon::RopeDefaultPolicy>
void BM_rope(benchmark::State& st, bool backward, bool bhtd, const char* label) {
  const std::int64_t B = st.range(0), T = st.range(1), Hq = 32, Hk = 8, D = 128;
  const std::size_t nq = static_cast<std::size_t>(B * T * Hq * D), nk = static_cast<std::size_t>(B * T * Hk * D);
  const double bytes = 2.0 * (nq + nk) * sizeof(bf16) + 2.0 * T * D * sizeof(bf16);
  const int sets = bench::rotation(2.0 * (nq + nk) * sizeof(bf16));
  std::vector<bf16*> q, k;
  for (int s = 0; s < sets; ++s) {
    q.push_back(bench::alloc<bf16>(nq));
    k.push_back(bench::alloc<bf16>(nk));
    bench::fill_random(q.back(), nq, 21 + s);
    bench::fill_random(k.back(), nk, 41 + s);
  }
  bf16* cs = bench::alloc<bf16>(T * D);
  bf16* sn = bench::alloc<bf16>(T * D);
  bench::fill_random(cs, T * D, 3);
  bench::fill_random(sn, T * D, 4);
  auto args = [&](int i) {
    const int s = i % sets;
    tigon::RopeArgs<bf16> a;
    if (bhtd) {
      a.q = {.in = q[s], .out = q[s], .heads = Hq, .stride_b = Hq * T * D, .stride_t = D, .stride_h = T * D};
      a.k = {.in = k[s], .out = k[s], .heads = Hk, .stride_b = Hk * T * D, .stride_t = D, .stride_h = T * D};
    } else {
      a.q = {.in = q[s], .out = q[s], .heads = Hq, .stride_b = T * Hq * D, .stride_t = Hq * D, .stride_h = D};
      a.k = {.in = k[s], .out = k[s], .heads = Hk, .stride_b = T * Hk * D, .stride_t = Hk * D, .stride_h = D};
    }
    a.batch = B;
    a.seq = T;
    a.head_dim = D;
    a.cos = cs;
    a.sin = sn;
    a.table_rows = T;
    return a;
  };
  bench::run(st, std::string("rope ") + label, bytes, [&](int i) {
    check(backward ? tigon::rope_backward<Style, P>(args(i), nullptr)
                   : tigon::rope_forward<Style, P>(args(i), nullptr));
  });
  for (int s = 0; s < sets; ++s) {
    cudaFree(q[s]);
    cudaFree(k[s]);
  }
  cudaFree(cs);
  cudaFree(sn);
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
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_fwd>) ROPE_ARGS;
BENCHMARK(bench::single<BM_bwd>) ROPE_ARGS;
BENCHMARK(bench::single<BM_fwd_heads4>) ROPE_ARGS;
// The default once more, last: the spread between this row and the first is the noise.
void BM_fwd_again(benchmark::State& st) { BM_rope<tigon::RopeHalfSplit>(st, false, false, "fwd bf16 B4 T4096 32/8x128 [B,T,H,D] (again)"); }
BENCHMARK(BM_fwd_again) ROPE_ARGS;

BENCH_MAIN
