// Argument validation of the linear log-prob launchers and their workspace query; runs without a
// GPU. Every rejection names its argument, and nothing runs: the GEMM back end here counts its
// calls, and the outputs (host memory) keep their sentinel bytes.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include <tigon/loss/linear_logprob.cuh>

#include "alias_matrix.hpp"
#include "gemm_fakes.hpp"

using namespace tigon;
using tigon_test::CountingGemm;
using tigon_test::RejectingGemm;

namespace {
constexpr std::int64_t kTok = 8, kH = 16, kV = 64;
alignas(256) bf16 x[kTok * kH];
alignas(256) bf16 w[kV * kH];
alignas(256) std::int64_t targets[kTok];
alignas(256) float logp[kTok];
alignas(256) float lse[kTok];
alignas(256) float ent[kTok];
alignas(256) float glogp[kTok];
alignas(256) bf16 dx[kTok * kH];
alignas(256) float dw[kV * kH];
alignas(256) float db[kV];
alignas(256) unsigned char ws[1 << 16];

LinearLogProbArgs<bf16> good() {
  return {.x = x, .weight = w, .hidden = kH, .targets = targets, .tokens = kTok, .vocab = kV, .logp = logp,
          .lse = lse, .entropy = ent, .grad_logp = glogp, .dx = dx, .dweight = dw, .chunk = 4, .workspace = ws,
          .workspace_bytes = sizeof(ws)};
}

void poison_outputs() {
  std::memset(static_cast<void*>(dx), 0x5a, sizeof(dx));
  std::memset(dw, 0x5a, sizeof(dw));
  std::memset(logp, 0x5a, sizeof(logp));
}

bool untouched(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0x5a) return false;
  return true;
}

void expect(const LinearLogProbArgs<bf16>& a, bool backward, Errc code, const char* arg) {
  poison_outputs();
  CountingGemm g;
  const Status s = backward ? linear_logprob_backward(a, g, nullptr) : linear_logprob_forward(a, g, nullptr);
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(g.calls == 0);
  CHECK(untouched(dx, sizeof(dx)));
  CHECK(untouched(dw, sizeof(dw)));
  CHECK(untouched(logp, sizeof(logp)));
}
}  // namespace

TEST_CASE("linear_logprob: the good arguments pass validation; the workspace", "[llp][validation]") {
  const auto a = good();
  CHECK(detail::llp_validate(a, false, "f").ok());
  CHECK(detail::llp_validate(a, true, "f").ok());
  std::size_t bytes = 0;
  CHECK(linear_logprob_workspace_bytes(a, false, bytes).ok());
  CHECK(bytes == 512);  // one chunk of 4 x 64 bf16 logits
  auto b = a;
  b.dbias = db;
  CHECK(linear_logprob_workspace_bytes(b, true, bytes).ok());
  CHECK(bytes == 512 + 256);  // and the ones vector
  CHECK(linear_logprob_workspace_bytes(b, false, bytes).ok());
  CHECK(bytes == 512);  // the forward needs no ones
  b.chunk = 0;  // the default: all 8 tokens
  CHECK(linear_logprob_workspace_bytes(b, false, bytes).ok());
  CHECK(bytes == 1024);
  CHECK(linear_logprob_default_chunk(100000, 128256, 2) == 4096);
  CHECK(linear_logprob_default_chunk(100, 128256, 2) == 100);
  // Kept logits: all 8 tokens in one chunk and the ones vector, forward and backward alike.
  auto k = a;
  k.chunk = 0;
  k.keep_logits = true;
  CHECK(linear_logprob_workspace_bytes(k, false, bytes).ok());
  CHECK(bytes == 1024 + 256);
  CHECK(linear_logprob_workspace_bytes(k, true, bytes).ok());
  CHECK(bytes == 1024 + 256);
  k.chunk = 4;  // fewer tokens a chunk than the call has: not a kept call
  CHECK(linear_logprob_workspace_bytes(k, false, bytes).code() == Errc::invalid_size);
}

TEST_CASE("linear_logprob rejects bad arguments by name and runs nothing", "[llp][validation]") {
  for (bool backward : {false, true}) {
    auto a = good();
    a.x = nullptr;
    expect(a, backward, Errc::null_pointer, "x");
    a = good();
    a.weight = nullptr;
    expect(a, backward, Errc::null_pointer, "weight");
    a = good();
    a.targets = nullptr;
    expect(a, backward, Errc::null_pointer, "targets");
    a = good();
    a.hidden = 0;
    expect(a, backward, Errc::invalid_size, "hidden");
    a = good();
    a.tokens = -1;
    expect(a, backward, Errc::invalid_size, "tokens");
    a = good();
    a.vocab = 0;
    expect(a, backward, Errc::invalid_size, "vocab");
    a = good();
    a.x_stride = kH - 1;
    expect(a, backward, Errc::invalid_stride, "x_stride");
    a = good();
    a.chunk = -1;
    expect(a, backward, Errc::invalid_size, "chunk");
    for (float t : {0.0f, -1.0f, __builtin_inff(), __builtin_nanf("")}) {
      a = good();
      a.temperature = t;
      expect(a, backward, Errc::invalid_value, "temperature");
    }
    a = good();
    a.workspace_bytes = 100;
    expect(a, backward, Errc::workspace_too_small, "workspace_bytes");
  }
  // Forward: some output; outputs that overlap.
  auto a = good();
  a.logp = a.lse = a.entropy = nullptr;
  expect(a, false, Errc::null_pointer, "logp");
  a = good();
  a.lse = logp + 2;
  expect(a, false, Errc::aliasing, "lse");
  // Backward: an upstream gradient, the forward's lse (and entropy with grad_entropy), a gradient.
  a = good();
  a.grad_logp = nullptr;
  expect(a, true, Errc::null_pointer, "grad_logp");
  a = good();
  a.lse = nullptr;
  expect(a, true, Errc::null_pointer, "lse");
  a = good();
  a.grad_entropy = glogp;
  a.entropy = nullptr;
  expect(a, true, Errc::null_pointer, "entropy");
  a = good();
  a.dx = nullptr;
  a.dweight = nullptr;
  expect(a, true, Errc::null_pointer, "dx");
  a = good();
  a.dx = const_cast<bf16*>(x) + 1;
  expect(a, true, Errc::aliasing, "dx");
  // Every output against every input and every other output, the workspace's bytes included.
  a = good();
  a.logp = reinterpret_cast<float*>(targets);
  expect(a, false, Errc::aliasing, "logp");
  a = good();
  a.error_count = reinterpret_cast<int*>(ent);
  expect(a, false, Errc::aliasing, "error_count");
  a = good();
  a.workspace = w;  // the logits chunk over the head
  expect(a, false, Errc::aliasing, "workspace");
  a = good();
  a.workspace = ws;
  a.workspace_bytes = sizeof(ws);
  a.lse = reinterpret_cast<float*>(ws + 256);  // inside the chunk of logits the call writes
  expect(a, false, Errc::aliasing, "workspace");
  a = good();
  a.dweight = reinterpret_cast<float*>(dx);  // dW over dx
  expect(a, true, Errc::aliasing, "dweight");
  a = good();
  a.dx = reinterpret_cast<bf16*>(glogp);  // dx over an upstream gradient
  a.tokens = 1;
  expect(a, true, Errc::aliasing, "dx");
  a = good();
  a.dbias = lse;  // dbias over the forward's lse
  expect(a, true, Errc::aliasing, "dbias");
  a = good();
  a.workspace = dw;  // the backward's logits chunk over dW
  a.workspace_bytes = sizeof(dw);
  expect(a, true, Errc::aliasing, "workspace");
}

TEST_CASE("linear_logprob checks every GEMM with the back end before its first write", "[llp][validation]") {
  // 10 tokens in chunks of 4: the last chunk (2 tokens) has a shape the back end cannot run.
  for (bool backward : {false, true}) {
    for (bool keep : {false, true}) {
      INFO((backward ? "backward" : "forward") << (keep ? " kept" : ""));
      auto a = good();
      a.tokens = 8;
      a.chunk = keep ? 0 : 3;  // chunks 3, 3, 2 (kept: one chunk of 8)
      a.keep_logits = keep;
      poison_outputs();
      RejectingGemm g{.reject_m = keep ? 8 : 2};
      const Status s = backward ? linear_logprob_backward(a, g, nullptr) : linear_logprob_forward(a, g, nullptr);
      INFO(s.message());
      CHECK(s.code() == Errc::unsupported);  // not a CUDA error: nothing was launched before the check
      CHECK(g.calls == 0);
      CHECK(g.checks > 0);
      CHECK(untouched(dx, sizeof(dx)));
      CHECK(untouched(dw, sizeof(dw)));
      CHECK(untouched(logp, sizeof(logp)));
    }
  }
}

TEST_CASE("a GEMM back end without check() is refused products with a bias", "[llp][validation]") {
  // CountingGemm predates GemmArgs::bias: it would run the logits GEMM without adding the bias.
  alignas(256) static bf16 bias[kV];
  auto a = good();
  a.bias = bias;
  poison_outputs();
  CountingGemm g;
  const Status s = linear_logprob_forward(a, g, nullptr);
  INFO(s.message());
  CHECK(s.code() == Errc::unsupported);
  CHECK(std::string(s.argument()) == "bias");
  CHECK(g.calls == 0);
  CHECK(untouched(logp, sizeof(logp)));
}

TEST_CASE("linear_logprob: the generated aliasing matrices, forward and backward", "[llp][validation]") {
  // 4 tokens of 64 hidden over a vocabulary of 32, every output of each direction: nothing may share
  // a byte with another buffer of the call (no pair is in place).
  constexpr std::int64_t kTok = 4, kHidden = 64, kVocab = 32;
  auto base = [](LinearLogProbArgs<bf16>& a) { a.tokens = kTok, a.hidden = kHidden, a.vocab = kVocab; };
  auto ins = [](LinearLogProbArgs<bf16>& a, int k, bf16* p) {
    if (k == 0) a.x = p;
    if (k == 1) a.weight = p;
    if (k == 2) a.bias = p;
    if (k == 3) a.targets = reinterpret_cast<const std::int64_t*>(p);
  };
  const std::vector<tigon_test::Slot> in_slots = {
      {"x", false, kTok * kHidden * 2}, {"weight", false, kVocab * kHidden * 2}, {"bias", false, kVocab * 2},
      {"targets", false, kTok * 8}};
  alignas(256) static bf16 scratch[16][4096];
  // Forward.
  auto place_fwd = [&](LinearLogProbArgs<bf16>& a, int k, bf16* p) {
    base(a);
    ins(a, k, p);
    auto* f = reinterpret_cast<float*>(p);
    if (k == 4) a.logp = f;
    if (k == 5) a.lse = f;
    if (k == 6) a.entropy = f;
    if (k == 7) a.logit_sum = f;
    if (k == 8) a.is_top1 = reinterpret_cast<std::uint8_t*>(p);
    if (k == 9) a.error_count = reinterpret_cast<int*>(p);
    if (k == 10) a.workspace = p;
  };
  LinearLogProbArgs<bf16> probe;
  for (int k = 0; k < 11; ++k) place_fwd(probe, k, scratch[k]);
  std::size_t fwd_bytes = 0;
  REQUIRE(linear_logprob_workspace_bytes(probe, false, fwd_bytes).ok());
  auto fwd_slots = in_slots;
  for (const tigon_test::Slot& o : std::vector<tigon_test::Slot>{{"logp", true, kTok * 4},
                                                                  {"lse", true, kTok * 4},
                                                                  {"entropy", true, kTok * 4},
                                                                  {"logit_sum", true, kTok * 4},
                                                                  {"is_top1", true, kTok},
                                                                  {"error_count", true, 4},
                                                                  {"workspace", true, fwd_bytes, 8}}) {
    fwd_slots.push_back(o);
  }
  tigon_test::alias_matrix<LinearLogProbArgs<bf16>>(
      fwd_slots, {},
      [&](LinearLogProbArgs<bf16>& a, int k, bf16* p) {
        place_fwd(a, k, p);
        a.workspace_bytes = fwd_bytes;
      },
      [](const LinearLogProbArgs<bf16>& a) { return detail::llp_validate(a, false, "linear_logprob_forward"); });
  // Backward.
  auto place_bwd = [&](LinearLogProbArgs<bf16>& a, int k, bf16* p) {
    base(a);
    ins(a, k, p);
    auto* f = reinterpret_cast<float*>(p);
    if (k == 4) a.lse = f;
    if (k == 5) a.entropy = f;
    if (k == 6) a.grad_logp = f;
    if (k == 7) a.grad_entropy = f;
    if (k == 8) a.dx = p;
    if (k == 9) a.dweight = f;
    if (k == 10) a.dbias = f;
    if (k == 11) a.workspace = p;
  };
  probe = {};
  for (int k = 0; k < 12; ++k) place_bwd(probe, k, scratch[k]);
  std::size_t bwd_bytes = 0;
  REQUIRE(linear_logprob_workspace_bytes(probe, true, bwd_bytes).ok());
  auto bwd_slots = in_slots;
  for (const tigon_test::Slot& o : std::vector<tigon_test::Slot>{{"lse", false, kTok * 4},
                                                                  {"entropy", false, kTok * 4},
                                                                  {"grad_logp", false, kTok * 4},
                                                                  {"grad_entropy", false, kTok * 4},
                                                                  {"dx", true, kTok * kHidden * 2},
                                                                  {"dweight", true, kVocab * kHidden * 4, 2},
                                                                  {"dbias", true, kVocab * 4, 2},
                                                                  {"workspace", true, bwd_bytes, 8}}) {
    bwd_slots.push_back(o);
  }
  tigon_test::alias_matrix<LinearLogProbArgs<bf16>>(
      bwd_slots, {},
      [&](LinearLogProbArgs<bf16>& a, int k, bf16* p) {
        place_bwd(a, k, p);
        a.workspace_bytes = bwd_bytes;
      },
      [](const LinearLogProbArgs<bf16>& a) { return detail::llp_validate(a, true, "linear_logprob_backward"); });
}
