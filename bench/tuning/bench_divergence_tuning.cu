// Divergence policy sweeps around the default (built with -DTIGON_BUILD_TUNING=ON): the streaming
// kernel's L2 prefetch distance (kStreamAhead) and vectors in flight (kStreamUnroll) for the
// generalised JSD and the forward KL; the resident kernel's elements per thread, blocks per SM and
// rows asked of the L2 ahead (kResElems, kResMinBlocks, kResAhead) for the JSD on logits. Same
// body and counting as bench/bench_divergence.cu.
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

template <int kElems, int kMinBlocks, int kAhead>
struct Res : tigon::DivergencePolicy {
  static constexpr int kResElems = kElems;
  static constexpr int kResMinBlocks = kMinBlocks;
  static constexpr int kResAhead = kAhead;
};
using Res32x2a0 = Res<32, 2, 0>;
using Res32x2a16 = Res<32, 2, 16>;
using Res32x2a32 = Res<32, 2, 32>;
using Res16x4a16 = Res<16, 4, 16>;
using Res64x1a16 = Res<64, 1, 16>;
constexpr auto kZ = tigon::DivergenceInput::logits;

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

DIV_TUNE(jsd_logits_res32x2a0, Res32x2a0, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(jsd_logits_res32x2a16, Res32x2a16, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}))->Args({8192, 32000});
DIV_TUNE(jsd_logits_res32x2a32, Res32x2a32, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(jsd_logits_res16x4a16, Res16x4a16, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(jsd_logits_res64x1a16, Res64x1a16, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(fkl_logits_res32x2a16, Res32x2a16, (Opt{.which = Which::forward_kl, .student = kZ, .teacher = kZ}));

BENCH_MAIN
