// Argument validation of the cross-entropy launchers; runs without a GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/linear_cross_entropy.cuh>

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
  std::size_t need = 0;
  a = good();
  CHECK(cross_entropy_workspace_bytes(a, need).ok());
  CHECK(need <= sizeof(ws));
  a.logits = nullptr;
  expect(cross_entropy_workspace_bytes(a, need), Errc::null_pointer, "logits");
  CHECK(need == 0);
  a = good();
  expect(cross_entropy_shard_stats(a, 10, 70, nullptr, nullptr), Errc::null_pointer, "stats");
  CrossEntropyStats st[8];
  expect(cross_entropy_shard_stats(a, 10, 70, st, nullptr), Errc::invalid_size, "vocab_offset");
  expect(cross_entropy_merge_stats(st, 0, 8, st, nullptr), Errc::invalid_size, "nshards");
}

TEST_CASE("linear_cross_entropy workspace query rejects bad arguments by name", "[lce][validation]") {
  LinearCrossEntropyArgs<bf16> a;
  a.x = logits;
  a.weight = logits + 64;
  a.hidden = 8;
  a.loss.targets = targets;
  a.loss.rows = 8;
  a.loss.vocab = 8;
  std::size_t bytes = 0;
  CHECK(linear_cross_entropy_workspace_bytes(a, bytes).ok());
  // One logits chunk (all 8 tokens x 8 classes) after the loss's per-token scratch.
  CHECK(bytes == detail::ce_workspace_bytes(8) + 256);
  a.chunk = 3;
  a.dbias = loss;
  CHECK(linear_cross_entropy_workspace_bytes(a, bytes).ok());
  CHECK(bytes == detail::ce_workspace_bytes(8) + 256 + 256);
  auto bad = a;
  bad.x = nullptr;
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::null_pointer, "x");
  CHECK(bytes == 0);
  bad = a;
  bad.hidden = 0;
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::invalid_size, "hidden");
  bad = a;
  bad.loss.dlogits = logits;
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::invalid_value, "loss.logits");
  bad = a;
  bad.chunk = -1;
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::invalid_size, "chunk");
  bad = a;
  bad.dx = const_cast<bf16*>(a.x);
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dx");
  CHECK(linear_cross_entropy_default_chunk(100000, 128256, 2) == 4096);
  CHECK(linear_cross_entropy_default_chunk(1000, 128256, 2) == 1000);
}

TEST_CASE("cross_entropy: the segmented kernel's workspace and work order", "[ce][host]") {
  // Workspace: the segmented kernel's share only where it takes the rows (two segments or more).
  const std::size_t base = cross_entropy_workspace_bytes(8192);
  CHECK(cross_entropy_workspace_bytes(8192, 0) == base);
  CHECK(cross_entropy_workspace_bytes(8192, 128256) == base);  // the default policy: the segmented kernel off
  using Seg = CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 8192>;
  CHECK(cross_entropy_workspace_bytes<Seg>(8192, 8192) == base);  // one segment: the row kernel
  CHECK(cross_entropy_workspace_bytes<Seg>(8192, 128256) == base + detail::ce_seg_bytes(8192, 16));
  CHECK(detail::ce_seg_bytes(8192, 16) >= 8192u * 16u * 8u + 8192u * (4u + 16u));
  CHECK(cross_entropy_workspace_bytes<CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 0>>(8192, 128256) ==
        base);
  CHECK(cross_entropy_workspace_bytes<CrossEntropyPolicy<256, 256, 4, 0, 0, 256, 36, false, 512, 2048>>(3, 4097) ==
        cross_entropy_workspace_bytes(3) + detail::ce_seg_bytes(3, 3));
  // Work order: every statistics item and every gradient item exactly once, and each row's
  // gradient items after all of its statistics items (what lets a gradient item wait), for
  // windows from one row's segments to every item.
  for (const std::uint64_t segs : {2u, 3u, 16u}) {
    for (const std::uint64_t rows : {1u, 2u, 7u, 40u}) {
      const std::uint64_t items = rows * segs;
      for (std::uint64_t window = segs; window <= items; window += (window < 2 * segs ? 1 : 13)) {
        INFO("segs " << segs << " rows " << rows << " window " << window);
        std::vector<int> seen(2 * items, 0);
        std::vector<std::uint64_t> stats_done(rows, 0);
        bool order_ok = true;
        for (std::uint64_t tk = 0; tk < 2 * items; ++tk) {
          bool grad = false;
          std::uint64_t j = 0;
          detail::ce_seg_decode(tk, items, window, grad, j);
          REQUIRE(j < items);
          ++seen[(grad ? items : 0) + j];
          const std::uint64_t r = j / segs;
          if (!grad) {
            ++stats_done[r];
          } else if (stats_done[r] != segs) {
            order_ok = false;
          }
        }
        CHECK(order_ok);
        CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<long>(2 * items));
      }
    }
  }
}
