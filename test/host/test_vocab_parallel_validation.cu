// Argument validation of the vocabulary-parallel cross-entropy that needs no communicator: the
// workspace size, and the bad shard, rows and class-weight reduction rejected before the
// communicator is asked anything (the call reaches no device).
#include <catch2/catch.hpp>

#include <string>

#include <tigon/dist/vocab_parallel.cuh>

#include "gemm_fakes.hpp"

using namespace tigon;

namespace {
alignas(256) bf16 logits[8 * 64];
alignas(256) std::int64_t targets[8];
alignas(256) float loss[1];
alignas(256) float weights[64];

CrossEntropyArgs<bf16> good() {
  return {.logits = logits, .targets = targets, .rows = 8, .vocab = 64, .dlogits = logits, .loss = loss};
}
void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
}
}  // namespace

TEST_CASE("vocab_parallel_cross_entropy: workspace and the checks before the communicator", "[dist][validation]") {
  std::size_t one = 0, four = 0;
  REQUIRE(vocab_parallel_cross_entropy_workspace_bytes(good(), 1, one).ok());
  REQUIRE(vocab_parallel_cross_entropy_workspace_bytes(good(), 4, four).ok());
  CHECK(four > one);  // the gathered statistics grow with the ranks
  CHECK(one >= 2 * 8 * sizeof(CrossEntropyStats));
  expect(vocab_parallel_cross_entropy_workspace_bytes(good(), 0, one), Errc::invalid_size, "ranks");
  alignas(256) static unsigned char ws[1 << 16];
  expect(vocab_parallel_cross_entropy(good(), VocabShard{1, 64}, nullptr, ws, sizeof(ws), nullptr),
         Errc::invalid_size, "shard");
  expect(vocab_parallel_cross_entropy(good(), VocabShard{-1, 128}, nullptr, ws, sizeof(ws), nullptr),
         Errc::invalid_size, "shard");
  auto a = good();
  a.rows = 0;
  expect(vocab_parallel_cross_entropy(a, VocabShard{0, 128}, nullptr, ws, sizeof(ws), nullptr), Errc::invalid_size,
         "rows");
  a = good();
  a.class_weights = weights;
  expect(vocab_parallel_cross_entropy(a, VocabShard{0, 128}, nullptr, ws, sizeof(ws), nullptr), Errc::unsupported,
         "class_weights");
  expect(vocab_parallel_cross_entropy(good(), VocabShard{64, 128}, nullptr, ws, sizeof(ws), nullptr),
         Errc::null_pointer, "comm");
  // The linear op: its workspace, and a strided dx (the all-reduce reads contiguous rows).
  LinearCrossEntropyArgs<bf16> l;
  alignas(256) static bf16 x[8 * 16], w[64 * 16], dx[8 * 32];
  l.x = x;
  l.weight = w;
  l.hidden = 16;
  l.loss.targets = targets;
  l.loss.rows = 8;
  l.loss.vocab = 64;
  l.loss.loss = loss;
  REQUIRE(vocab_parallel_linear_cross_entropy_workspace_bytes(l, 2, one).ok());
  CHECK(one >= 3 * 8 * sizeof(CrossEntropyStats));
  l.dx = dx;
  l.dx_stride = 32;
  tigon_test::CountingGemm g;
  expect(vocab_parallel_linear_cross_entropy(l, VocabShard{0, 128}, nullptr, g, ws, sizeof(ws), nullptr),
         Errc::unsupported, "dx_stride");
  CHECK(g.calls == 0);
}
