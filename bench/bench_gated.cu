// Gated-activation benchmarks, bf16, at a LLaMA-3-8B-class MLP (16384 tokens x intermediate 14336),
// through the default launchers (gated_forward / gated_backward): GB/s on useful bytes and the
// fraction of the device-to-device copy rate measured in the same process.
//   forward:  read a and b, write c                  (3 x rows x cols elements)
//   backward: read dc, a and b, write da and db      (5 x rows x cols elements)
// Each with a and b as separate tensors, and as the two halves of one fused gate||up buffer
// [rows, 2 cols] (da and db then into a fused gradient buffer the same way). The ungated squared
// ReLU (Nemotron's MLP, activation_forward / activation_backward) at Nemotron-4-15B's MLP (16384
// tokens x 24576): forward reads a, writes c (2 x rows x cols); backward reads dc and a, writes da
// (3 x rows x cols). The policy variants and tensor placements are in
// bench/tuning/bench_gated_tuning.cu.
#include "harness.cuh"

#include <tigon/activation/gated.cuh>

using tigon::bf16;

namespace {

using bench::check;

// Input sets, each tensor its own cudaMalloc. separate: a, b, da, db are [rows, cols]; fused: a
// holds gate||up and da d(gate||up), [rows, 2 cols], and b, db are unused.
struct Data {
  int sets = 1;
  bool fused = false;
  std::int64_t rows = 0, cols = 0;
  std::vector<bf16*> a, b, c, dc, da, db;

  Data(std::int64_t r, std::int64_t k, bool f, bool backward) : fused(f), rows(r), cols(k) {
    const std::size_t n = static_cast<std::size_t>(r * k);
    sets = bench::rotation((backward ? 5.0 : 3.0) * n * sizeof(bf16));
    const std::size_t wide = fused ? 2 * n : n;
    for (int s = 0; s < sets; ++s) {
      a.push_back(bench::alloc<bf16>(wide));
      b.push_back(fused ? nullptr : bench::alloc<bf16>(n));
      c.push_back(backward ? nullptr : bench::alloc<bf16>(n));
      dc.push_back(backward ? bench::alloc<bf16>(n) : nullptr);
      da.push_back(backward ? bench::alloc<bf16>(wide) : nullptr);
      db.push_back(backward && !fused ? bench::alloc<bf16>(n) : nullptr);
      bench::fill_random(a.back(), wide, 11 + s, 0.0f, 2.0f);
      if (!fused) bench::fill_random(b.back(), n, 31 + s);
      if (backward) bench::fill_random(dc.back(), n, 101 + s);
    }
  }
  ~Data() {
    for (auto* v : {&a, &b, &c, &dc, &da, &db})
      for (bf16* p : *v) cudaFree(p);
  }
  Data(const Data&) = delete;
  Data& operator=(const Data&) = delete;
  tigon::GatedForwardArgs<bf16> fwd(int i) const {
    const int s = i % sets;
    if (fused) {
      return {.a = a[s], .b = a[s] + cols, .c = c[s], .rows = rows, .cols = cols,
              .a_stride = 2 * cols, .b_stride = 2 * cols};
    }
    return {.a = a[s], .b = b[s], .c = c[s], .rows = rows, .cols = cols};
  }
  tigon::GatedBackwardArgs<bf16> bwd(int i) const {
    const int s = i % sets;
    if (fused) {
      return {.dc = dc[s], .a = a[s], .b = a[s] + cols, .da = da[s], .db = da[s] + cols,
              .rows = rows, .cols = cols, .a_stride = 2 * cols, .b_stride = 2 * cols,
              .da_stride = 2 * cols, .db_stride = 2 * cols};
    }
    return {.dc = dc[s], .a = a[s], .b = b[s], .da = da[s], .db = db[s], .rows = rows, .cols = cols};
  }
};

double fwd_bytes(std::int64_t r, std::int64_t c) { return 3.0 * r * c * sizeof(bf16); }
double bwd_bytes(std::int64_t r, std::int64_t c) { return 5.0 * r * c * sizeof(bf16); }

std::string shape(std::int64_t r, std::int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }


template <class Act>
void BM_forward(benchmark::State& st, const std::string& name, bool fused) {
  Data d(st.range(0), st.range(1), fused, false);
  bench::run(st, name + " fwd bf16 " + shape(d.rows, d.cols) + (fused ? " fused" : " separate"),
             fwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::gated_forward<Act>(d.fwd(i), nullptr)); });
}

template <class Act>
void BM_backward(benchmark::State& st, const std::string& name, bool fused) {
  Data d(st.range(0), st.range(1), fused, true);
  bench::run(st, name + " bwd bf16 " + shape(d.rows, d.cols) + (fused ? " fused" : " separate"),
             bwd_bytes(d.rows, d.cols), [&](int i) { check(tigon::gated_backward<Act>(d.bwd(i), nullptr)); });
}

void BM_swiglu_fwd(benchmark::State& st) { BM_forward<tigon::Silu>(st, "swiglu", false); }
void BM_swiglu_fwd_fused(benchmark::State& st) { BM_forward<tigon::Silu>(st, "swiglu", true); }
void BM_swiglu_bwd(benchmark::State& st) { BM_backward<tigon::Silu>(st, "swiglu", false); }
void BM_swiglu_bwd_fused(benchmark::State& st) { BM_backward<tigon::Silu>(st, "swiglu", true); }
// GeGLU (tanh GELU, the costlier activation): whether the arithmetic shows at all.
void BM_geglu_fwd_fused(benchmark::State& st) { BM_forward<tigon::GeluTanh>(st, "geglu", true); }
void BM_geglu_bwd_fused(benchmark::State& st) { BM_backward<tigon::GeluTanh>(st, "geglu", true); }

// The ungated squared ReLU: separate tensors, the same rotation of input sets.
void BM_relu2_fwd(benchmark::State& st) {
  Data d(st.range(0), st.range(1), false, false);
  bench::run(st, "relu2 (ungated) fwd bf16 " + shape(d.rows, d.cols), 2.0 * d.rows * d.cols * sizeof(bf16), [&](int i) {
    const int s = i % d.sets;
    check(tigon::relu2_forward(tigon::ActivationForwardArgs<bf16>{.a = d.a[s], .c = d.c[s], .rows = d.rows,
                                                                  .cols = d.cols},
                               nullptr));
  });
}
void BM_relu2_bwd(benchmark::State& st) {
  Data d(st.range(0), st.range(1), false, true);
  bench::run(st, "relu2 (ungated) bwd bf16 " + shape(d.rows, d.cols), 3.0 * d.rows * d.cols * sizeof(bf16), [&](int i) {
    const int s = i % d.sets;
    check(tigon::relu2_backward(tigon::ActivationBackwardArgs<bf16>{.dc = d.dc[s], .a = d.a[s], .da = d.da[s],
                                                                    .rows = d.rows, .cols = d.cols},
                                nullptr));
  });
}

// What a launcher costs the host (validation, plan, launch): 1 x 14336, 2000 calls.
void BM_host_overhead(benchmark::State& st) {
  Data f(1, 14336, false, false), b(1, 14336, false, true);
  double fwd_us = 0, bwd_us = 0;
  for (auto _ : st) {
    fwd_us = bench::host_us_per_call([&] { check(tigon::swiglu_forward(f.fwd(0), nullptr)); }, 2000);
    bwd_us = bench::host_us_per_call([&] { check(tigon::swiglu_backward(b.bwd(0), nullptr)); }, 2000);
  }
  st.counters["fwd_host_us"] = fwd_us;
  st.counters["bwd_host_us"] = bwd_us;
  std::printf("host cost per call: swiglu_forward %.2f us, swiglu_backward %.2f us\n", fwd_us, bwd_us);
}

}  // namespace

BENCHMARK(BM_host_overhead)->Iterations(1);

#define GATED_SHAPES ->Args({16384, 14336})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_swiglu_fwd) GATED_SHAPES;
BENCHMARK(BM_swiglu_fwd_fused) GATED_SHAPES;
BENCHMARK(BM_swiglu_bwd) GATED_SHAPES;
BENCHMARK(BM_swiglu_bwd_fused) GATED_SHAPES;
BENCHMARK(BM_geglu_fwd_fused) GATED_SHAPES;
BENCHMARK(BM_geglu_bwd_fused) GATED_SHAPES;
BENCHMARK(BM_relu2_fwd)->Args({16384, 24576})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_relu2_bwd)->Args({16384, 24576})->UseManualTime()->Iterations(200)->Unit(benchmark::kMicrosecond);
// Single calls (bench::single): each alone on the device, as between a training step's GEMMs.
BENCHMARK(bench::single<BM_swiglu_fwd>) GATED_SHAPES;
BENCHMARK(bench::single<BM_swiglu_bwd>) GATED_SHAPES;

BENCH_MAIN
