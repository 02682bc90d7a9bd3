// Argument validation of the linear divergence launcher and its workspace query; runs without a
// GPU. Every rejection names its argument, and nothing runs: the GEMM back end here counts its
// calls, and the outputs (host memory) keep their sentinel bytes.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include <tigon/loss/linear_divergence.cuh>

#include "alias_matrix.hpp"
#include "gemm_fakes.hpp"

using namespace tigon;
using tigon_test::CountingGemm;
using tigon_test::RejectingGemm;

namespace {
constexpr std::int64_t kTok = 8, kH = 16, kHt = 24, kV = 64;
alignas(256) bf16 x[kTok * kH];
alignas(256) bf16 w[kV * kH];
alignas(256) bf16 tx[kTok * kHt];
alignas(256) bf16 tw[kV * kHt];
alignas(256) std::int64_t labels[kTok];
alignas(256) bf16 dx[kTok * kH];
alignas(256) float dw[kV * kH];
alignas(256) float loss[1];
alignas(256) float loss_rows[kTok];
alignas(256) unsigned char ws[1 << 16];

LinearDivergenceArgs<bf16> good() {
  return {.x = x, .weight = w, .hidden = kH, .teacher_x = tx, .teacher_weight = tw, .teacher_hidden = kHt,
          .tokens = kTok, .vocab = kV, .labels = labels, .loss = loss, .loss_rows = loss_rows, .dx = dx,
          .dweight = dw, .chunk = 4, .workspace = ws, .workspace_bytes = sizeof(ws)};
}

void poison_outputs() {
  std::memset(static_cast<void*>(dx), 0x5a, sizeof(dx));
  std::memset(dw, 0x5a, sizeof(dw));
  std::memset(loss, 0x5a, sizeof(loss));
  std::memset(loss_rows, 0x5a, sizeof(loss_rows));
}

bool untouched(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0x5a) return false;
  return true;
}

template <class D>
void expect(const LinearDivergenceArgs<bf16>& a, const D& div, Errc code, const char* arg) {
  poison_outputs();
  CountingGemm g;
  const Status s = linear_divergence(a, div, g, nullptr);
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(g.calls == 0);
  CHECK(untouched(dx, sizeof(dx)));
  CHECK(untouched(dw, sizeof(dw)));
  CHECK(untouched(loss, sizeof(loss)));
  CHECK(untouched(loss_rows, sizeof(loss_rows)));
}
}  // namespace

TEST_CASE("linear_divergence: the good arguments pass validation", "[ldiv][validation]") {
  const auto a = good();
  CHECK(detail::validate(a, "linear_divergence").ok());
  CHECK(detail::validate_call(a, GeneralizedJSD{0.5f}, "linear_divergence").ok());
  CHECK(detail::validate_call(a, KLDiv{}, "linear_divergence").ok());
  CHECK(detail::validate_call(a, TVD{}, "linear_divergence").ok());
  std::size_t bytes = 0;
  CHECK(linear_divergence_workspace_bytes(a, bytes).ok());
  // The count (loss_rows takes the row sums), then two chunks of 4 x 64 bf16 logits.
  CHECK(bytes == 256 + 2 * 512);
  auto b = a;
  b.labels = nullptr;
  b.loss_rows = nullptr;
  CHECK(linear_divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 256 + 2 * 512);  // the row sums
  b.loss = nullptr;
  CHECK(linear_divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 2 * 512);  // the logits chunks only
  b.chunk = 0;              // the default: all 8 tokens
  CHECK(linear_divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 2 * 1024);
  b.chunk = 100;  // at most all tokens
  CHECK(linear_divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 2 * 1024);
}

TEST_CASE("linear_divergence rejects bad arguments by name and runs nothing", "[ldiv][validation]") {
  const ForwardKL kl;
  auto a = good();
  a.x = nullptr;
  expect(a, kl, Errc::null_pointer, "x");
  a = good();
  a.weight = nullptr;
  expect(a, kl, Errc::null_pointer, "weight");
  a = good();
  a.teacher_x = nullptr;
  expect(a, kl, Errc::null_pointer, "teacher_x");
  a = good();
  a.teacher_weight = nullptr;
  expect(a, kl, Errc::null_pointer, "teacher_weight");
  a = good();
  a.tokens = 0;
  expect(a, kl, Errc::invalid_size, "tokens");
  a = good();
  a.hidden = 0;
  expect(a, kl, Errc::invalid_size, "hidden");
  a = good();
  a.teacher_hidden = -1;
  expect(a, kl, Errc::invalid_size, "teacher_hidden");
  a = good();
  a.vocab = 0;
  expect(a, kl, Errc::invalid_size, "vocab");
  a = good();
  a.teacher_vocab = kV + 1;
  expect(a, kl, Errc::invalid_size, "teacher_vocab");
  a = good();
  a.chunk = -1;
  expect(a, kl, Errc::invalid_size, "chunk");
  a = good();
  a.temperature = 0.0f;
  expect(a, kl, Errc::invalid_value, "temperature");
  a = good();
  a.reduction = static_cast<DivergenceReduction>(9);
  expect(a, kl, Errc::invalid_value, "reduction");
  a = good();
  a.reduction = DivergenceReduction::none;
  expect(a, kl, Errc::invalid_value, "loss");
  a = good();
  a.grad_scale = __builtin_nanf("");
  expect(a, kl, Errc::invalid_value, "grad_scale");
  a = good();
  a.x_stride = kH - 1;
  expect(a, kl, Errc::invalid_stride, "x_stride");
  a = good();
  a.teacher_x_stride = kHt - 1;
  expect(a, kl, Errc::invalid_stride, "teacher_x_stride");
  a = good();
  a.dx_stride = 3;
  expect(a, kl, Errc::invalid_stride, "dx_stride");
  a = good();
  a.workspace_bytes = 1024;
  expect(a, kl, Errc::workspace_too_small, "workspace_bytes");
  a = good();
  a.workspace = nullptr;
  expect(a, kl, Errc::null_pointer, "workspace");
  // The functor's own parameters.
  expect(good(), GeneralizedJSD{1.5f}, Errc::invalid_value, "beta");
  // Outputs overlapping inputs or each other.
  a = good();
  a.dx = const_cast<bf16*>(a.x);
  expect(a, kl, Errc::aliasing, "dx");
  // The workspace's bytes the call uses (the two logits chunks first) over an input or an output.
  a = good();
  a.workspace = const_cast<bf16*>(a.weight);
  a.workspace_bytes = sizeof(ws);
  expect(a, kl, Errc::aliasing, "workspace");
  a = good();
  a.loss_rows = reinterpret_cast<float*>(ws + 512);
  expect(a, kl, Errc::aliasing, "workspace");
  a = good();
  a.workspace = dw;
  expect(a, kl, Errc::aliasing, "workspace");
  a = good();
  a.loss_rows = loss;
  a.tokens = 1;
  expect(a, kl, Errc::aliasing, "loss_rows");
}

TEST_CASE("linear_divergence checks every GEMM with the back end before its first write", "[ldiv][validation]") {
  auto a = good();
  a.chunk = 3;  // chunks of 3, 3 and 2 tokens
  for (bool grad : {true, false}) {
    INFO((grad ? "with gradients" : "loss only"));
    auto b = a;
    if (!grad) b.dx = nullptr, b.dweight = nullptr;
    poison_outputs();
    RejectingGemm g{.reject_m = 2};
    const Status s = linear_divergence(b, ForwardKL{}, g, nullptr);
    INFO(s.message());
    CHECK(s.code() == Errc::unsupported);  // not a CUDA error: nothing was launched before the check
    CHECK(g.calls == 0);
    CHECK(untouched(dx, sizeof(dx)));
    CHECK(untouched(dw, sizeof(dw)));
    CHECK(untouched(loss, sizeof(loss)));
    CHECK(untouched(loss_rows, sizeof(loss_rows)));
  }
}

TEST_CASE("linear_divergence: the generated aliasing matrix", "[ldiv][validation]") {
  // The student's and teacher's hidden states and heads, labels and an upstream gradient in; dx,
  // dweight, the loss, the row sums and the workspace out (a forward KL under batchmean): 4 tokens,
  // student hidden 64, teacher hidden 32, a vocabulary of 24. Nothing may share a byte.
  constexpr std::int64_t kTok = 4, kHidden = 64, kTeacher = 32, kVocab = 24;
  auto place = [](LinearDivergenceArgs<bf16>& a, int k, bf16* p) {
    a.tokens = kTok, a.hidden = kHidden, a.teacher_hidden = kTeacher, a.vocab = kVocab;
    auto* f = reinterpret_cast<float*>(p);
    if (k == 0) a.x = p;
    if (k == 1) a.weight = p;
    if (k == 2) a.teacher_x = p;
    if (k == 3) a.teacher_weight = p;
    if (k == 4) a.labels = reinterpret_cast<const std::int64_t*>(p);
    if (k == 5) a.grad_output = f;
    if (k == 6) a.dx = p;
    if (k == 7) a.dweight = f;
    if (k == 8) a.loss = f;
    if (k == 9) a.loss_rows = f;
    if (k == 10) a.workspace = p;
  };
  LinearDivergenceArgs<bf16> probe;
  alignas(256) static bf16 scratch[11][4096];
  for (int k = 0; k < 11; ++k) place(probe, k, scratch[k]);
  const std::size_t ws_bytes = detail::ldiv_layout(probe).total;
  REQUIRE(ws_bytes > 0);
  tigon_test::alias_matrix<LinearDivergenceArgs<bf16>>(
      {{"x", false, kTok * kHidden * 2},
       {"weight", false, kVocab * kHidden * 2},
       {"teacher_x", false, kTok * kTeacher * 2},
       {"teacher_weight", false, kVocab * kTeacher * 2},
       {"labels", false, kTok * 8},
       {"grad_output", false, 4},
       {"dx", true, kTok * kHidden * 2},
       {"dweight", true, kVocab * kHidden * 4, 2},
       {"loss", true, 4, 2},
       {"loss_rows", true, kTok * 4, 2},
       {"workspace", true, ws_bytes, 8}},
      {},
      [&](LinearDivergenceArgs<bf16>& a, int k, bf16* p) {
        place(a, k, p);
        a.workspace_bytes = ws_bytes;
      },
      [](const LinearDivergenceArgs<bf16>& a) {
        TIGON_CHECK(detail::validate(a, "linear_divergence"));
        return detail::validate_call(a, ForwardKL{}, "linear_divergence");
      });
}
