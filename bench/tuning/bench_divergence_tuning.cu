// Divergence policy sweeps around the default (built with -DTIGON_BUILD_TUNING=ON): the streaming
// kernel's L2 prefetch distance (kStreamAhead) and vectors in flight (kStreamUnroll) for the
// generalised JSD and the forward KL. Same body and counting as bench/bench_divergence.cu.
#include "../harness.cuh"

#include <tigon/loss/divergence.cuh>

#include "../div_bench.cuh"

namespace {

using div_bench::Opt;
using div_bench::Which;

template <int kAhead, int kUnroll = 2>
struct Stream : tigon::DivergencePolicy {
  static constexpr int kStreamAhead = kAhead;
  static constexpr int kStreamUnroll = kUnroll;
};

using Ahead256Unroll1 = Stream<256, 1>;
using Ahead0Unroll4 = Stream<0, 4>;

}  // namespace

#define DIV_TUNE(label, P, opt)                                                                     \
  void BM_##label(benchmark::State& st) { div_bench::run<P>(st, opt, #label); }                   \
  BENCHMARK(BM_##label)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)->Args({8192, 128256})

DIV_TUNE(jsd_ahead0, Stream<0>, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead128, Stream<128>, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead256, Stream<256>, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead512, Stream<512>, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead1024, Stream<1024>, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead256_u1, Ahead256Unroll1, Opt{.which = Which::jsd});
DIV_TUNE(jsd_ahead0_u4, Ahead0Unroll4, Opt{.which = Which::jsd});
DIV_TUNE(fkl_ahead0, Stream<0>, Opt{.which = Which::forward_kl});
DIV_TUNE(fkl_ahead256, Stream<256>, Opt{.which = Which::forward_kl});
DIV_TUNE(tvd_ahead0, Stream<0>, (Opt{.which = Which::tvd, .student = tigon::DivergenceInput::probs, .teacher = tigon::DivergenceInput::probs}));
DIV_TUNE(tvd_ahead256, Stream<256>, (Opt{.which = Which::tvd, .student = tigon::DivergenceInput::probs, .teacher = tigon::DivergenceInput::probs}));

BENCH_MAIN
