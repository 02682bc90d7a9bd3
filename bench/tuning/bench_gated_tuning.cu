// Gated-activation tuning sweep, bf16, at the shape of bench/bench_gated.cu (SwiGLU, 16384 x
// 14336): the GatedPolicy variants beside the defaults, back to back and as single calls, the
// default forward with programmatic dependent launch off, the tensors' placement in memory (each
// input set in one allocation, 0 B to 1 MiB between its tensors), and the defaults once more last
// (the spread between them and the first rows is the noise). Useful bytes as in
// bench/bench_gated.cu.
#include "harness.cuh"

#include <tigon/activation/gated.cuh>

using tigon::bf16;

namespace {

using bench::check;

// Placement of the separate tensors: -1, each its own cudaMalloc; k >= 0, one allocation per input
// set holding a, b, c (forward) or dc, a, b, da, db (backward) back to back, each k bytes after the
// previous one ends (k 0: the tensors exactly n * 2 bytes apart, as a caching allocator that rounds
// to 2 MiB places tensors whose size is a multiple of it). On one H200 the forward's time depended
// on where its tensors lay (docs/gated.md), so the benchmark shows more than one placement.
int g_pack_skew = -1;

// One input set per rotation slot, separate tensors a, b, c (forward) or dc, a, b, da, db
// (backward), [rows, cols] each.
struct Data {
  int sets = 1;
  std::vector<bf16*> packs;
  std::int64_t rows = 0, cols = 0;
  std::vector<bf16*> a, b, c, dc, da, db;

  Data(std::int64_t r, std::int64_t k, bool backward) : rows(r), cols(k) {
    const std::size_t n = static_cast<std::size_t>(r * k);
    sets = bench::rotation((backward ? 5.0 : 3.0) * n * sizeof(bf16));
    const bool packed = g_pack_skew >= 0;
    const std::size_t step = n + (packed ? static_cast<std::size_t>(g_pack_skew) / sizeof(bf16) : 0);
    for (int s = 0; s < sets; ++s) {
      // The set's tensors: each its own allocation, or the next slot of the set's pack (which
      // holds dc first).
      bf16* pack = packed ? bench::alloc<bf16>((backward ? 5 : 3) * step) : nullptr;
      if (pack != nullptr) packs.push_back(pack);
      int slot = 0;
      auto take = [&] { return pack != nullptr ? pack + step * slot++ : bench::alloc<bf16>(n); };
      dc.push_back(backward ? take() : nullptr);
      a.push_back(take());
      b.push_back(take());
      c.push_back(backward ? nullptr : take());
      da.push_back(backward ? take() : nullptr);
      db.push_back(backward ? take() : nullptr);
      bench::fill_random(a.back(), n, 11 + s, 0.0f, 2.0f);
      bench::fill_random(b.back(), n, 31 + s);
      if (backward) bench::fill_random(dc.back(), n, 101 + s);
    }
  }
  ~Data() {
    for (bf16* p : packs) cudaFree(p);
    if (!packs.empty()) return;
    for (auto* v : {&a, &b, &c, &dc, &da, &db})
      for (bf16* p : *v) cudaFree(p);
  }
  Data(const Data&) = delete;
  Data& operator=(const Data&) = delete;
  tigon::GatedForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    return {.a = a[s], .b = b[s], .c = c[s], .rows = rows, .cols = cols};
  }
  tigon::GatedBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    return {.dc = dc[s], .a = a[s], .b = b[s], .da = da[s], .db = db[s], .rows = rows, .cols = cols};
  }
};

double fwd_bytes(std::int64_t r, std::int64_t c) { return 3.0 * r * c * sizeof(bf16); }
double bwd_bytes(std::int64_t r, std::int64_t c) { return 5.0 * r * c * sizeof(bf16); }

std::string placement() {
  return g_pack_skew >= 0 ? " packed skew " + std::to_string(g_pack_skew) : std::string();
}

std::string shape(std::int64_t r, std::int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }


template <class Act, class P = tigon::GatedPolicy>
void BM_forward(benchmark::State& st, const std::string& name) {
  Data d(st.range(0), st.range(1), false);
  bench::run(st, name + " fwd bf16 " + shape(d.rows, d.cols) + " separate" + placement(), fwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::gated_forward<Act, P>(d.fwd(i), nullptr)); });
}

template <class Act, class P = tigon::GatedPolicy>
void BM_backward(benchmark::State& st, const std::string& name) {
  Data d(st.range(0), st.range(1), true);
  bench::run(st, name + " bwd bf16 " + shape(d.rows, d.cols) + " separate" + placement(), bwd_bytes(d.rows, d.cols),
             [&](int i) { check(tigon::gated_backward<Act, P>(d.bwd(i), nullptr)); });
}

void BM_swiglu_fwd(benchmark::State& st) { BM_forward<tigon::Silu>(st, "swiglu"); }
void BM_swiglu_bwd(benchmark::State& st) { BM_backward<tigon::Silu>(st, "swiglu"); }

}  // namespace

#define GATED_SHAPES ->Args({16384, 14336})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_swiglu_fwd) GATED_SHAPES;
BENCHMARK(BM_swiglu_bwd) GATED_SHAPES;

// Policy variants (SwiGLU, separate tensors, forward): the flat grid's vectors per thread
// (GatedPolicy::kFlat; the default: 2).
#define GATED_FWD_VARIANT(label, n)                                                                  \
  struct Policy_##label : tigon::GatedPolicy {                                                       \
    static constexpr int kFlat = n;                                                                  \
  };                                                                                                 \
  void BM_fwd_##label(benchmark::State& st) {                                                        \
    BM_forward<tigon::Silu, Policy_##label>(st, "  policy " #label " swiglu");                       \
  }                                                                                                  \
  BENCHMARK(BM_fwd_##label) GATED_SHAPES;

GATED_FWD_VARIANT(flat1, 1)
GATED_FWD_VARIANT(flat4, 4)
GATED_FWD_VARIANT(flat8, 8)
// Single calls (bench::single: each call alone on the device, as between a training step's GEMMs,
// nothing overlapping its start or drain): the defaults and the forward grids above, so that a
// default can be chosen on this timing too.
BENCHMARK(bench::single<BM_swiglu_fwd>) GATED_SHAPES;
BENCHMARK(bench::single<BM_swiglu_bwd>) GATED_SHAPES;
BENCHMARK(bench::single<BM_fwd_flat1>) GATED_SHAPES;
BENCHMARK(bench::single<BM_fwd_flat4>) GATED_SHAPES;
// The default forward with programmatic launch off: whether the launch attribute costs a single
// call anything.
void BM_swiglu_fwd_serial(benchmark::State& st) {
  tigon::set_programmatic_launch(false);
  BM_forward<tigon::Silu>(st, "  serial launch swiglu");
  tigon::set_programmatic_launch(true);
}
BENCHMARK(bench::single<BM_swiglu_fwd_serial>) GATED_SHAPES;

// Placement: each set's tensors in one allocation, exactly n elements apart (skew 0) or 2 KiB,
// 32 KiB, 1 MiB further apart each.
template <void (*BM)(benchmark::State&), int kSkew>
void packed(benchmark::State& st) {
  g_pack_skew = kSkew;
  BM(st);
  g_pack_skew = -1;
}
#define GATED_PACKED(fn)                         \
  BENCHMARK(packed<fn, 0>) GATED_SHAPES;         \
  BENCHMARK(packed<fn, 2048>) GATED_SHAPES;      \
  BENCHMARK(packed<fn, 32768>) GATED_SHAPES;     \
  BENCHMARK(packed<fn, 1048576>) GATED_SHAPES;
GATED_PACKED(BM_swiglu_fwd)
GATED_PACKED(BM_swiglu_bwd)
GATED_PACKED(BM_fwd_flat1)
GATED_PACKED(BM_fwd_flat4)

// The defaults once more, last: the spread between this row and the first ones is the noise.
void BM_swiglu_fwd_again(benchmark::State& st) { BM_forward<tigon::Silu>(st, "swiglu (again)"); }
void BM_swiglu_bwd_again(benchmark::State& st) { BM_backward<tigon::Silu>(st, "swiglu (again)"); }
BENCHMARK(BM_swiglu_fwd_again) GATED_SHAPES;
BENCHMARK(BM_swiglu_bwd_again) GATED_SHAPES;

BENCH_MAIN
