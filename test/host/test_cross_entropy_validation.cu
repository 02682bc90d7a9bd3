// Argument validation of the cross-entropy launchers; runs without a GPU.
#include <catch2/catch.hpp>

#include <string>

#include <tigon/loss/cross_entropy.cuh>

using namespace tigon;

namespace {
alignas(256) bf16 logits[8 * 64];
alignas(256) std::int64_t targets[8];
alignas(256) float loss[1];
alignas(256) unsigned char ws[4096];

CrossEntropyArgs<bf16> good() {
  return {.logits = logits, .targets = targets, .rows = 8, .vocab = 64, .dlogits = logits,
          .loss = loss, .workspace = ws, .workspace_bytes = sizeof(ws)};
}
void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
}
}  // namespace

TEST_CASE("cross_entropy rejects bad arguments by name", "[ce][validation]") {
  CHECK(detail::validate(good(), "cross_entropy").ok());
  auto a = good();
  a.logits = nullptr;
  expect(cross_entropy(a, nullptr), Errc::null_pointer, "logits");
  a = good();
  a.targets = nullptr;
  expect(cross_entropy(a, nullptr), Errc::null_pointer, "targets");
  a = good();
  a.vocab = 0;
  expect(cross_entropy(a, nullptr), Errc::invalid_size, "vocab");
  a = good();
  a.logits_stride = 63;
  expect(cross_entropy(a, nullptr), Errc::invalid_stride, "logits_stride");
  a = good();
  a.label_smoothing = 1.5f;
  expect(cross_entropy(a, nullptr), Errc::invalid_value, "label_smoothing");
  a = good();
  a.z_loss_scale = -1.0f;
  expect(cross_entropy(a, nullptr), Errc::invalid_value, "z_loss_scale");
  a = good();
  a.softcap = -3.0f;
  expect(cross_entropy(a, nullptr), Errc::invalid_value, "softcap");
  a = good();
  a.reduction = Reduction::none;  // with a reduced-loss output
  expect(cross_entropy(a, nullptr), Errc::invalid_value, "loss");
  a = good();
  a.dlogits = logits + 1;  // overlapping, not the same matrix
  expect(cross_entropy(a, nullptr), Errc::aliasing, "dlogits");
  a = good();
  a.loss = reinterpret_cast<float*>(logits);
  expect(cross_entropy(a, nullptr), Errc::aliasing, "loss");
  a = good();
  a.workspace_bytes = 8;
  expect(cross_entropy(a, nullptr), Errc::workspace_too_small, "workspace_bytes");
  CHECK(cross_entropy_workspace_bytes(8) <= sizeof(ws));
  a = good();
  expect(cross_entropy_shard_stats(a, 10, 70, nullptr, nullptr), Errc::null_pointer, "stats");
  CrossEntropyStats st[8];
  expect(cross_entropy_shard_stats(a, 10, 70, st, nullptr), Errc::invalid_size, "vocab_offset");
  expect(cross_entropy_merge_stats(st, 0, 8, st, nullptr), Errc::invalid_size, "nshards");
}
