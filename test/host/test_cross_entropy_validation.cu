// Argument validation of the cross-entropy launchers; runs without a GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/linear_cross_entropy.cuh>

#include "alias_matrix.hpp"
#include "gemm_fakes.hpp"

using namespace tigon;
using tigon_test::CountingGemm;
using tigon_test::RejectingGemm;

namespace {
alignas(256) bf16 logits[8 * 64];
alignas(256) std::int64_t targets[8];
alignas(256) float loss[1];
alignas(256) unsigned char ws[8192];
alignas(256) float dbias8[8];
alignas(256) std::int64_t targets2x8[16];  // two heads' targets

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
  a.vocab = std::int64_t{1} << 31;  // one past the element-wise path's int column count
  a.logits_stride = a.vocab;
  expect(cross_entropy(a, nullptr), Errc::unsupported, "vocab");
  a = good();
  a.rows = std::int64_t{1} << 40;  // rows x stride x 2 bytes past 2^63: rejected, not wrapped
  a.logits_stride = std::int64_t{1} << 40;
  expect(cross_entropy(a, nullptr), Errc::invalid_size, "logits");
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
  for (const float g : {__builtin_nanf(""), -__builtin_nanf(""), __builtin_huge_valf(), -__builtin_huge_valf()}) {
    a = good();
    a.grad_scale = g;  // checked by its bits, so the check stands under -ffast-math too
    expect(cross_entropy(a, nullptr), Errc::invalid_value, "grad_scale");
  }
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
  // Without a gradient (the loss alone) the workspace is the same; the statistics pass takes none
  // (a null workspace is accepted there), the loss alone still needs one.
  a = good();
  a.dlogits = nullptr;
  CHECK(cross_entropy_workspace_bytes(a, need).ok());
  CHECK(need == detail::ce_workspace_bytes(8));
  a.workspace_bytes = need - 1;
  expect(cross_entropy(a, nullptr), Errc::workspace_too_small, "workspace_bytes");
}

TEST_CASE("cross_entropy rejects every output that shares bytes with another buffer", "[ce][validation]") {
  // One arena carved by hand, so that what overlaps does not depend on where the linker puts arrays.
  alignas(256) static unsigned char arena[1 << 16];
  auto at = [](std::size_t off) { return static_cast<void*>(arena + off); };
  bf16* x = static_cast<bf16*>(at(0));                       // 8 x 64 bf16: [0, 1024)
  auto* t = static_cast<std::int64_t*>(at(1024));             // [1024, 1088)
  auto base = [&] {
    CrossEntropyArgs<bf16> a{.logits = x, .targets = t, .rows = 8, .vocab = 64, .dlogits = x,
                             .loss = static_cast<float*>(at(2048)), .workspace = at(4096), .workspace_bytes = 4096};
    return a;
  };
  std::size_t need = 0;
  CHECK(cross_entropy_workspace_bytes(base(), need).ok());
  CHECK(need <= 4096);
  auto a = base();
  a.lse = static_cast<float*>(at(512));  // inside the gradient
  expect(cross_entropy(a, nullptr), Errc::aliasing, "lse");
  a = base();
  a.argmax = static_cast<std::int64_t*>(at(1056));  // over the targets
  expect(cross_entropy(a, nullptr), Errc::aliasing, "argmax");
  a = base();
  a.loss_rows = static_cast<float*>(at(4096 + 64));  // inside the workspace
  expect(cross_entropy(a, nullptr), Errc::aliasing, "workspace");
  a = base();
  a.class_weights = static_cast<const float*>(at(256));  // read while the gradient is written
  expect(cross_entropy(a, nullptr), Errc::aliasing, "dlogits");
  a = base();
  a.z_loss = a.loss;  // two outputs, one float
  expect(cross_entropy(a, nullptr), Errc::aliasing, "z_loss");
  a = base();
  a.error_count = static_cast<int*>(at(2048));  // over the loss
  expect(cross_entropy(a, nullptr), Errc::aliasing, "error_count");
  a = base();
  a.reduction = Reduction::none;
  a.loss = nullptr;
  a.loss_rows = static_cast<float*>(at(2048));
  a.grad_output = static_cast<const float*>(at(2048 + 28));  // the last row's upstream gradient
  expect(cross_entropy(a, nullptr), Errc::aliasing, "loss_rows");
  a = base();
  a.workspace = at(1000);  // over the logits' last bytes and the targets
  expect(cross_entropy(a, nullptr), Errc::aliasing, "workspace");
  a = base();
  a.dlogits = nullptr;
  auto* stats = static_cast<CrossEntropyStats*>(at(0));  // the statistics over the logits
  expect(cross_entropy_shard_stats(a, 0, 64, stats, nullptr), Errc::aliasing, "stats");
  a = base();
  expect(cross_entropy_shard_finalize(a, 0, 64, static_cast<const CrossEntropyStats*>(at(4096)), nullptr),
         Errc::aliasing, "workspace");  // the merged statistics inside the workspace
  // Disjoint buffers and the gradient in place pass.
  a = base();
  a.lse = static_cast<float*>(at(8192));
  a.argmax = static_cast<std::int64_t*>(at(8192 + 64));
  a.error_count = static_cast<int*>(at(8192 + 128));
  a.class_weights = static_cast<const float*>(at(8192 + 256));
  CHECK(detail::validate(a, "cross_entropy").ok());
}

TEST_CASE("cross_entropy: the generated aliasing matrix", "[ce][validation]") {
  // Every input and output of a loss + gradient call with every option's buffer, 4 rows of 1000
  // columns; dlogits may be the logits themselves (in place), nothing else may share a byte.
  constexpr std::int64_t kRows = 4, kVocab = 1000;
  const std::size_t ws_bytes = detail::ce_workspace_bytes(kRows);
  tigon_test::alias_matrix<CrossEntropyArgs<bf16>>(
      {{"logits", false, kRows * kVocab * 2},
       {"targets", false, kRows * 8},
       {"class_weights", false, kVocab * 4},
       {"grad_output", false, 4},
       {"dlogits", true, kRows * kVocab * 2},
       {"loss", true, 4},
       {"loss_rows", true, kRows * 4},
       {"z_loss", true, 4},
       {"lse", true, kRows * 4},
       {"argmax", true, kRows * 8, 4},
       {"error_count", true, 4, 2},
       {"workspace", true, ws_bytes, 8}},
      {{4, 0}},
      [&](CrossEntropyArgs<bf16>& a, int k, bf16* p) {
        a.rows = kRows, a.vocab = kVocab, a.z_loss_scale = 1e-4f, a.workspace_bytes = ws_bytes;
        if (k == 0) a.logits = p;
        if (k == 1) a.targets = reinterpret_cast<const std::int64_t*>(p);
        if (k == 2) a.class_weights = reinterpret_cast<const float*>(p);
        if (k == 3) a.grad_output = reinterpret_cast<const float*>(p);
        if (k == 4) a.dlogits = p;
        if (k == 5) a.loss = reinterpret_cast<float*>(p);
        if (k == 6) a.loss_rows = reinterpret_cast<float*>(p);
        if (k == 7) a.z_loss = reinterpret_cast<float*>(p);
        if (k == 8) a.lse = reinterpret_cast<float*>(p);
        if (k == 9) a.argmax = reinterpret_cast<std::int64_t*>(p);
        if (k == 10) a.error_count = reinterpret_cast<int*>(p);
        if (k == 11) a.workspace = p;
      },
      [](const CrossEntropyArgs<bf16>& a) { return detail::validate(a, "cross_entropy"); });
}

TEST_CASE("linear_cross_entropy: the generated aliasing matrix", "[lce][validation]") {
  // Every input and output of a call with every gradient and loss output, 4 tokens of 64 hidden
  // over a vocabulary of 32: nothing may share a byte with another buffer (no pair is in place).
  constexpr std::int64_t kRows = 4, kHidden = 64, kVocab = 32;
  auto place = [](LinearCrossEntropyArgs<bf16>& a, int k, bf16* p) {
    a.hidden = kHidden, a.loss.rows = kRows, a.loss.vocab = kVocab, a.loss.z_loss_scale = 1e-4f;
    auto* f = reinterpret_cast<float*>(p);
    switch (k) {
      case 0: a.x = p; break;
      case 1: a.weight = p; break;
      case 2: a.bias = p; break;
      case 3: a.loss.targets = reinterpret_cast<const std::int64_t*>(p); break;
      case 4: a.loss.class_weights = f; break;
      case 5: a.loss.grad_output = f; break;
      case 6: a.dx = p; break;
      case 7: a.dweight = f; break;
      case 8: a.dbias = f; break;
      case 9: a.loss.loss = f; break;
      case 10: a.loss.loss_rows = f; break;
      case 11: a.loss.z_loss = f; break;
      case 12: a.loss.lse = f; break;
      case 13: a.loss.argmax = reinterpret_cast<std::int64_t*>(p); break;
      case 14: a.loss.error_count = reinterpret_cast<int*>(p); break;
      case 15: a.workspace = p; break;
    }
  };
  LinearCrossEntropyArgs<bf16> probe;
  alignas(256) static bf16 scratch[16][4096];
  for (int k = 0; k < 16; ++k) place(probe, k, scratch[k]);
  const std::size_t ws_bytes = detail::lce_layout(probe).total;
  REQUIRE(ws_bytes <= sizeof(scratch[0]));
  tigon_test::alias_matrix<LinearCrossEntropyArgs<bf16>>(
      {{"x", false, kRows * kHidden * 2},
       {"weight", false, kVocab * kHidden * 2},
       {"bias", false, kVocab * 2},
       {"loss.targets", false, kRows * 8},
       {"loss.class_weights", false, kVocab * 4},
       {"loss.grad_output", false, 4},
       {"dx", true, kRows * kHidden * 2},
       {"dweight", true, kVocab * kHidden * 4, 2},
       {"dbias", true, kVocab * 4, 2},
       {"loss.loss", true, 4, 2},
       {"loss.loss_rows", true, kRows * 4, 2},
       {"loss.z_loss", true, 4, 2},
       {"loss.lse", true, kRows * 4, 2},
       {"loss.argmax", true, kRows * 8, 4},
       {"loss.error_count", true, 4, 2},
       {"workspace", true, ws_bytes, 8}},
      {},
      [&](LinearCrossEntropyArgs<bf16>& a, int k, bf16* p) {
        place(a, k, p);
        a.workspace_bytes = ws_bytes;
      },
      [](const LinearCrossEntropyArgs<bf16>& a) { return detail::validate(a, "linear_cross_entropy"); });
}

TEST_CASE("linear_cross_entropy_heads: the generated aliasing matrix", "[lce][validation]") {
  // Two heads over 4 tokens of 64 hidden, a vocabulary of 32: x, the targets, class weights, the
  // upstream gradient and each head's weight and bias in; dx, the head losses, the loss, each head's
  // dweight and dbias and the workspace out. Nothing may share a byte with another buffer.
  constexpr std::int64_t kRows = 4, kHidden = 64, kVocab = 32;
  static const bf16* weights[2];
  static const bf16* biases[2];
  static float* dweights[2];
  static float* dbiases[2];
  auto place = [](LinearCrossEntropyHeadsArgs<bf16>& a, int k, bf16* p) {
    a.hidden = kHidden, a.heads = 2, a.loss.rows = kRows, a.loss.vocab = kVocab;
    a.weights = weights, a.biases = biases, a.dweights = dweights, a.dbiases = dbiases;
    auto* f = reinterpret_cast<float*>(p);
    switch (k) {
      case 0: a.x = p; break;
      case 1: a.loss.targets = reinterpret_cast<const std::int64_t*>(p); break;
      case 2: a.loss.class_weights = f; break;
      case 3: a.loss.grad_output = f; break;
      case 4: weights[0] = p; break;
      case 5: weights[1] = p; break;
      case 6: biases[0] = p; break;
      case 7: biases[1] = p; break;
      case 8: a.dx = p; break;
      case 9: a.head_losses = f; break;
      case 10: a.loss.loss = f; break;
      case 11: dweights[0] = f; break;
      case 12: dweights[1] = f; break;
      case 13: dbiases[0] = f; break;
      case 14: dbiases[1] = f; break;
      case 15: a.workspace = p; break;
    }
  };
  LinearCrossEntropyHeadsArgs<bf16> probe;
  alignas(256) static bf16 scratch[16][4096];
  for (int k = 0; k < 16; ++k) place(probe, k, scratch[k]);
  const std::size_t ws_bytes = detail::lce_heads_layout(probe).total;
  REQUIRE(ws_bytes <= sizeof(scratch[0]));
  tigon_test::alias_matrix<LinearCrossEntropyHeadsArgs<bf16>>(
      {{"x", false, kRows * kHidden * 2},
       {"loss.targets", false, 2 * kRows * 8},
       {"loss.class_weights", false, kVocab * 4},
       {"loss.grad_output", false, 4},
       {"weights[0]", false, kVocab * kHidden * 2},
       {"weights[1]", false, kVocab * kHidden * 2},
       {"biases[0]", false, kVocab * 2},
       {"biases[1]", false, kVocab * 2},
       {"dx", true, kRows * kHidden * 2},
       {"head_losses", true, 2 * 4, 2},
       {"loss.loss", true, 4, 2},
       {"dweights[0]", true, kVocab * kHidden * 4, 2},
       {"dweights[1]", true, kVocab * kHidden * 4, 2},
       {"dbiases[0]", true, kVocab * 4, 2},
       {"dbiases[1]", true, kVocab * 4, 2},
       {"workspace", true, ws_bytes, 8}},
      {},
      [&](LinearCrossEntropyHeadsArgs<bf16>& a, int k, bf16* p) {
        place(a, k, p);
        a.workspace_bytes = ws_bytes;
      },
      [](const LinearCrossEntropyHeadsArgs<bf16>& a) { return detail::validate(a, "linear_cross_entropy_heads"); });
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
  a.dbias = dbias8;
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
  // Every output against every other buffer, on one hand-carved arena.
  alignas(256) static unsigned char arena[1 << 16];
  auto at = [](std::size_t off) { return static_cast<void*>(arena + off); };
  LinearCrossEntropyArgs<bf16> c;
  c.x = static_cast<const bf16*>(at(0));        // 8 x 8 bf16: [0, 128)
  c.weight = static_cast<const bf16*>(at(256));  // 8 x 8 bf16: [256, 384)
  c.hidden = 8;
  c.loss.targets = static_cast<const std::int64_t*>(at(512));  // [512, 576)
  c.loss.rows = 8;
  c.loss.vocab = 8;
  c.dx = static_cast<bf16*>(at(1024));
  c.dweight = static_cast<float*>(at(2048));  // 8 x 8 fp32: [2048, 2304)
  c.dbias = static_cast<float*>(at(4096));
  c.loss.loss = static_cast<float*>(at(4608));
  c.workspace = at(8192);
  c.workspace_bytes = 8192;
  CHECK(linear_cross_entropy_workspace_bytes(c, bytes).ok());
  bad = c;
  bad.dbias = static_cast<float*>(at(2048 + 128));  // inside dweight
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dbias");
  bad = c;
  bad.dx = static_cast<bf16*>(at(2200));  // dx inside dweight
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dweight");
  bad = c;
  bad.loss.loss_rows = static_cast<float*>(at(8192 + 512));  // inside the workspace
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "workspace");
  bad = c;
  bad.loss.argmax = static_cast<std::int64_t*>(at(512));  // over the targets
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "loss.argmax");
  bad = c;
  bad.bias = static_cast<const bf16*>(at(4096));  // read where dbias is written
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dbias");
  CHECK(linear_cross_entropy_default_chunk(100000, 128256, 2) == 4096);
  CHECK(linear_cross_entropy_default_chunk(1000, 128256, 2) == 1000);
  CHECK(linear_cross_entropy_heads_default_chunk(100000, 128256, 2) == 512);
  CHECK(linear_cross_entropy_heads_default_chunk(300, 128256, 2) == 300);
  CHECK(linear_cross_entropy_heads_default_chunk(100000, std::int64_t{1} << 21, 2) == 256);  // 1 GiB caps it
}

TEST_CASE("linear_cross_entropy with gradients in the weight's dtype: their extents in that dtype",
          "[lce][validation]") {
  // G = bf16: dW and db are [vocab, hidden] and [vocab] bf16, so a buffer right after them is apart
  // and one a bf16 element into them overlaps (an fp32 extent would claim twice the bytes).
  alignas(256) static unsigned char arena[1 << 16];
  auto at = [](std::size_t off) { return static_cast<void*>(arena + off); };
  LinearCrossEntropyArgs<bf16, std::int64_t, bf16> c;
  c.x = static_cast<const bf16*>(at(0));        // 8 x 8 bf16: [0, 128)
  c.weight = static_cast<const bf16*>(at(256));  // 8 x 8 bf16: [256, 384)
  c.hidden = 8;
  c.loss.targets = static_cast<const std::int64_t*>(at(512));
  c.loss.rows = 8;
  c.loss.vocab = 8;
  c.dweight = static_cast<bf16*>(at(2048));  // 8 x 8 bf16: [2048, 2176)
  c.dbias = static_cast<bf16*>(at(2176));    // 8 bf16 right after dW: [2176, 2192)
  c.dx = static_cast<bf16*>(at(2192));       // right after db
  c.loss.loss = static_cast<float*>(at(4608));
  c.workspace = at(8192);
  c.workspace_bytes = 8192;
  std::size_t bytes = 0;
  CHECK(linear_cross_entropy_workspace_bytes(c, bytes).ok());
  auto bad = c;
  bad.dbias = static_cast<bf16*>(at(2176 - 2));  // one element into dW
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dbias");
  bad = c;
  bad.dx = static_cast<bf16*>(at(2192 - 2));  // one element into db
  expect(linear_cross_entropy_workspace_bytes(bad, bytes), Errc::aliasing, "dbias");

  const bf16* ws[2] = {static_cast<const bf16*>(at(256)), static_cast<const bf16*>(at(384))};
  bf16* dws[2] = {static_cast<bf16*>(at(2048)), static_cast<bf16*>(at(2176))};  // back to back, apart
  LinearCrossEntropyHeadsArgs<bf16, std::int64_t, bf16> h;
  h.x = static_cast<const bf16*>(at(0));
  h.hidden = 8;
  h.heads = 2;
  h.weights = ws;
  h.loss.targets = static_cast<const std::int64_t*>(at(512));  // 2 x 8 int64: [512, 640)
  h.loss.rows = 8;
  h.loss.vocab = 8;
  h.dweights = dws;
  h.loss.loss = static_cast<float*>(at(4608));
  h.workspace = at(8192);
  h.workspace_bytes = 8192;
  CHECK(linear_cross_entropy_heads_workspace_bytes(h, bytes).ok());
  bf16* overlapping[2] = {static_cast<bf16*>(at(2048)), static_cast<bf16*>(at(2176 - 2))};
  h.dweights = overlapping;
  expect(linear_cross_entropy_heads_workspace_bytes(h, bytes), Errc::aliasing, "dweights[k]");
}

TEST_CASE("linear_cross_entropy_heads workspace query rejects bad arguments by name", "[lce][validation]") {
  const bf16* ws[2] = {logits + 64, logits + 128};
  float hw[2] = {1.0f, 0.5f};
  LinearCrossEntropyHeadsArgs<bf16> a;
  a.x = logits;
  a.hidden = 8;
  a.heads = 2;
  a.weights = ws;
  a.head_weights = hw;
  a.loss.targets = targets2x8;
  a.loss.rows = 8;
  a.loss.vocab = 8;
  std::size_t bytes = 0;
  CHECK(linear_cross_entropy_heads_workspace_bytes(a, bytes).ok());
  // Each head's per-token scratch, one logits chunk, 8 bytes a head.
  CHECK(bytes == 2 * detail::ce_workspace_bytes(8) + 256 + 256);
  auto bad = a;
  bad.heads = 0;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::invalid_size, "heads");
  CHECK(bytes == 0);
  bad.heads = kMaxLceHeads + 1;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::invalid_size, "heads");
  bad = a;
  bad.weights = nullptr;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::null_pointer, "weights");
  const bf16* holes[2] = {logits + 64, nullptr};
  bad.weights = holes;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::null_pointer, "weights[k]");
  bad = a;
  float inf_w[2] = {1.0f, __builtin_huge_valf()};
  bad.head_weights = inf_w;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::invalid_value, "head_weights");
  bad = a;
  bad.targets_stride = 4;  // shorter than a head's targets
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::invalid_stride, "targets_stride");
  bad = a;
  bad.dx = const_cast<bf16*>(ws[1]);
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::aliasing, "dx");
  bad = a;
  bad.loss.workspace = loss;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::invalid_value, "loss.logits");
  // Every output against every other buffer, on one hand-carved arena.
  alignas(256) static unsigned char arena[1 << 16];
  auto at = [](std::size_t off) { return static_cast<void*>(arena + off); };
  const bf16* hws[2] = {static_cast<const bf16*>(at(256)), static_cast<const bf16*>(at(512))};
  float* dws[2] = {static_cast<float*>(at(2048)), static_cast<float*>(at(4096))};  // 8 x 8 fp32 each
  auto c = a;
  c.x = static_cast<const bf16*>(at(0));
  c.weights = hws;
  c.loss.targets = static_cast<const std::int64_t*>(at(1024));  // [2][8]: [1024, 1152)
  c.dweights = dws;
  c.loss.loss_rows = static_cast<float*>(at(6144));  // [2][8]: [6144, 6208)
  c.head_losses = static_cast<float*>(at(6400));
  c.workspace = at(8192);
  c.workspace_bytes = 8192;
  CHECK(linear_cross_entropy_heads_workspace_bytes(c, bytes).ok());
  bad = c;
  float* shared[2] = {dws[0], dws[0]};  // two heads' dW in one buffer
  bad.dweights = shared;
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::aliasing, "dweights[k]");
  bad = c;
  bad.head_losses = static_cast<float*>(at(6144 + 40));  // inside the second head's loss rows
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::aliasing, "head_losses");
  bad = c;
  bad.loss.lse = static_cast<float*>(at(1024 + 64));  // over the second head's targets
  expect(linear_cross_entropy_heads_workspace_bytes(bad, bytes), Errc::aliasing, "loss.lse");
}


TEST_CASE("cross_entropy's streaming kernel cuts rows into whole-warp segments", "[ce][dispatch]") {
  // Every row length from one vector to 2^24 vectors (a 2^27-column bf16 row), and the policy's
  // segment targets: at most kCeStreamMaxWarps segments (the warps of a row's block), each a
  // multiple of 32 vectors, the last one non-empty, and together exactly the row.
  for (const int target : {32, 64, 1024, 4096}) {
    for (std::int64_t nvec = 1; nvec <= (std::int64_t{1} << 24); nvec = nvec * 3 / 2 + 1) {
      INFO("nvec " << nvec << " target " << target);
      const detail::CeStreamShape sh = detail::ce_stream_shape(nvec, target);
      REQUIRE(sh.segs >= 1);
      CHECK(sh.segs <= detail::kCeStreamMaxWarps);
      CHECK(sh.seg_vecs % 32 == 0);
      CHECK(static_cast<std::int64_t>(sh.segs - 1) * sh.seg_vecs < nvec);
      CHECK(static_cast<std::int64_t>(sh.segs) * sh.seg_vecs >= nvec);
      // Segments near the target: no more of them than needed at the target's length.
      CHECK(sh.segs <= std::max<std::int64_t>(1, (nvec + target - 1) / target));
    }
  }
}

TEST_CASE("linear_cross_entropy checks every GEMM with the back end before its first write", "[lce][validation]") {
  alignas(256) static unsigned char arena[1 << 16];
  auto at = [](std::size_t off) { return static_cast<void*>(arena + off); };
  LinearCrossEntropyArgs<bf16> c;
  c.x = static_cast<const bf16*>(at(0));
  c.weight = static_cast<const bf16*>(at(256));
  c.hidden = 8;
  c.loss.targets = static_cast<const std::int64_t*>(at(512));
  c.loss.rows = 8;
  c.loss.vocab = 8;
  c.loss.loss = static_cast<float*>(at(4608));
  c.dx = static_cast<bf16*>(at(1024));
  c.dweight = static_cast<float*>(at(2048));
  c.dbias = static_cast<float*>(at(4096));
  c.bias = static_cast<const bf16*>(at(4352 + 2));  // not 16-byte aligned: the op would copy it
  c.chunk = 3;  // chunks of 3, 3 and 2 tokens
  c.accumulate = true;
  std::size_t bytes = 0;
  REQUIRE(linear_cross_entropy_workspace_bytes(c, bytes).ok());
  REQUIRE(bytes <= 16384);
  c.workspace = at(32768);
  c.workspace_bytes = bytes;
  for (std::int64_t m : {std::int64_t{2}, std::int64_t{1}}) {  // the last chunk's logits / dx GEMM, db's GEMM
    std::fill(arena + 1024, arena + 4352, static_cast<unsigned char>(0x5a));
    RejectingGemm g{.reject_m = m};
    const Status s = linear_cross_entropy(c, g, nullptr);
    INFO(s.message());
    CHECK(s.code() == Errc::unsupported);  // not a CUDA error: nothing was launched before the check
    CHECK(g.calls == 0);
    CHECK(std::all_of(arena + 1024, arena + 4352, [](unsigned char b) { return b == 0x5a; }));
  }
  // The heads: two heads over the same x, head 1's last chunk rejected.
  LinearCrossEntropyHeadsArgs<bf16> h;
  const bf16* weights[2] = {static_cast<const bf16*>(at(256)), static_cast<const bf16*>(at(384))};
  float* dweights[2] = {static_cast<float*>(at(2048)), static_cast<float*>(at(2304))};
  h.x = c.x;
  h.hidden = 8;
  h.heads = 2;
  h.weights = weights;
  h.dweights = dweights;
  h.dx = c.dx;
  h.loss.targets = static_cast<const std::int64_t*>(at(512));
  h.loss.rows = 8;
  h.loss.vocab = 8;
  h.loss.loss = c.loss.loss;
  h.chunk = 3;
  REQUIRE(linear_cross_entropy_heads_workspace_bytes(h, bytes).ok());
  h.workspace = at(32768);
  h.workspace_bytes = bytes;
  std::fill(arena + 1024, arena + 4352, static_cast<unsigned char>(0x5a));
  RejectingGemm g{.reject_m = 2};
  const Status s = linear_cross_entropy_heads(h, g, nullptr);
  INFO(s.message());
  CHECK(s.code() == Errc::unsupported);
  CHECK(g.calls == 0);
  CHECK(std::all_of(arena + 1024, arena + 4352, [](unsigned char b) { return b == 0x5a; }));
}
