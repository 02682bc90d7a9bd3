// Divergence policy sweeps around the default (built with -DTIGON_BUILD_TUNING=ON): the streaming
// kernel's L2 prefetch distance (kStreamAhead) and vectors in flight (kStreamUnroll) for the
// generalised JSD and the forward KL; the resident kernel's block size, elements per thread, blocks
// per SM and its cluster's rows asked of the L2 ahead (kResThreads, kResElems, kResMinBlocks,
// kResAhead) for the JSD on logits; the JSD through a functor that tests beta's limits per element (what
// GeneralizedJSD::Mixture leaves out) on logits and on log-probs. Same body and counting as
// bench/bench_divergence.cu.
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

template <int kElems, int kMinBlocks, int kAhead, int kThreads = 256>
struct Res : tigon::DivergencePolicy {
  static constexpr int kResThreads = kThreads;
  static constexpr int kResElems = kElems;
  static constexpr int kResMinBlocks = kMinBlocks;
  static constexpr int kResAhead = kAhead;
};
using Res32x2a0 = Res<32, 2, 0>;
using Res32x2a1 = Res<32, 2, 1>;
using Res32x2a3 = Res<32, 2, 3>;
// Half the elements a thread, twice the threads a block (a 128256-column row in 16 blocks of 512).
using Res16x2a2t512 = Res<16, 2, 2, 512>;
constexpr auto kZ = tigon::DivergenceInput::logits;

// GeneralizedJSD's operator() behind a functor not derived from it: divergence() does not substitute
// the Mixture, so the tests of beta's two limits stay inside the kernels' element loops.
struct LimitTestsJSD {
  static constexpr const char* kName = "LimitTestsJSD";
  float beta = 0.5f;
  static constexpr bool accepts(tigon::DivergenceInput s, tigon::DivergenceInput t) {
    return s == t && s != tigon::DivergenceInput::probs;
  }
  template <class E>
  TIGON_HD tigon::DivergenceValue operator()(const E& e) const {
    return tigon::GeneralizedJSD{beta}(e);
  }
};
void BM_jsd_limit_tests(benchmark::State& st) {
  div_bench::run_with(st, Opt{.which = Which::jsd}, LimitTestsJSD{0.5f}, "limit tests per element");
}
void BM_jsd_logits_limit_tests(benchmark::State& st) {
  div_bench::run_with(st, Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}, LimitTestsJSD{0.5f},
                      "limit tests per element");
}

}  // namespace

BENCHMARK(BM_jsd_limit_tests)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)->Args({8192, 128256});
BENCHMARK(BM_jsd_logits_limit_tests)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)->Args({8192, 128256})->Args({8192, 32000});

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
DIV_TUNE(jsd_logits_res32x2a1, Res32x2a1, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(jsd_logits_res32x2a3, Res32x2a3, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(jsd_logits_res16x2a2_t512, Res16x2a2t512, (Opt{.which = Which::jsd, .student = kZ, .teacher = kZ}));
DIV_TUNE(fkl_logits_res32x2a1, Res32x2a1, (Opt{.which = Which::forward_kl, .student = kZ, .teacher = kZ}));

BENCH_MAIN
