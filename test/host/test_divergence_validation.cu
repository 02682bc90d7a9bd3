// Argument validation of the divergence launcher and its workspace query; runs without a GPU.
// Every rejection names its argument, and nothing is written: the outputs (host memory here, which
// a launch could not write anyway) keep their sentinel bytes, and no launch is attempted (a valid
// call would reach the device and fail with a CUDA error instead).
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include <tigon/loss/divergence.cuh>

#include "alias_matrix.hpp"

using namespace tigon;

namespace {
constexpr std::int64_t kRows = 8, kV = 64;
alignas(256) bf16 student[kRows * kV];
alignas(256) float teacher[kRows * kV];
alignas(256) bf16 dx[kRows * kV];
alignas(256) std::int64_t labels[kRows];
alignas(256) float loss[1];
alignas(256) float loss_rows[kRows];
alignas(256) float loss_elems[kRows * kV];
alignas(256) float grad_output[kRows * kV];
alignas(256) unsigned char ws[4096];

DivergenceArgs<bf16, float> good() {
  return {.student = student, .teacher = teacher, .rows = kRows, .vocab = kV, .labels = labels, .dx = dx,
          .loss = loss, .loss_rows = loss_rows, .workspace = ws, .workspace_bytes = sizeof(ws)};
}

void poison_outputs() {
  std::memset(static_cast<void*>(dx), 0x5a, sizeof(dx));
  std::memset(loss, 0x5a, sizeof(loss));
  std::memset(loss_rows, 0x5a, sizeof(loss_rows));
  std::memset(loss_elems, 0x5a, sizeof(loss_elems));
}

bool untouched(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0x5a) return false;
  return true;
}

template <class D, class T, class TT>
void expect(const DivergenceArgs<T, TT>& a, const D& div, Errc code, const char* arg) {
  poison_outputs();
  const Status s = divergence(a, div, nullptr);
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
  CHECK(s.message().find(std::string("'") + arg + "'") != std::string::npos);
  CHECK(untouched(dx, sizeof(dx)));
  CHECK(untouched(loss, sizeof(loss)));
  CHECK(untouched(loss_rows, sizeof(loss_rows)));
  CHECK(untouched(loss_elems, sizeof(loss_elems)));
}
}  // namespace

TEST_CASE("divergence: the good arguments pass validation", "[div][validation]") {
  const auto a = good();
  CHECK(detail::validate_divergence_args(a, "divergence").ok());
  CHECK(detail::validate_divergence_call(a, GeneralizedJSD{0.5f}, "divergence").ok());
  CHECK(detail::validate_divergence_call(a, KLDiv{}, "divergence").ok());
  CHECK(detail::validate_divergence_call(a, TVD{}, "divergence").ok());
  std::size_t bytes = 0;
  CHECK(divergence_workspace_bytes(a, bytes).ok());
  CHECK(bytes == 256);  // labels under batchmean: the count
  auto b = a;
  b.labels = nullptr;
  CHECK(divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 0);  // the row sums go to loss_rows
  b.loss_rows = nullptr;
  CHECK(divergence_workspace_bytes(b, bytes).ok());
  CHECK(bytes == 256);  // the row sums
}

TEST_CASE("divergence rejects bad arguments by name and writes nothing", "[div][validation]") {
  const GeneralizedJSD jsd{0.5f};
  auto a = good();
  a.student = nullptr;
  expect(a, jsd, Errc::null_pointer, "student");
  a = good();
  a.teacher = nullptr;
  expect(a, jsd, Errc::null_pointer, "teacher");
  a = good();
  a.rows = 0;
  expect(a, jsd, Errc::invalid_size, "rows");
  a = good();
  a.vocab = -3;
  expect(a, jsd, Errc::invalid_size, "vocab");
  a = good();
  a.vocab = (std::int64_t{1} << 30) + 1;
  a.rows = 1;
  expect(a, jsd, Errc::unsupported, "vocab");
  // Teacher and student vocabularies that differ.
  a = good();
  a.teacher_vocab = kV + 1;
  expect(a, jsd, Errc::invalid_size, "teacher_vocab");
  a = good();
  a.teacher_vocab = kV;  // the same: fine
  CHECK(detail::validate_divergence_args(a, "divergence").ok());
  // Strides.
  a = good();
  a.rows = 4;
  a.student_stride = kV - 1;
  expect(a, jsd, Errc::invalid_stride, "student_stride");
  a = good();
  a.rows = 4;
  a.teacher_stride = -kV;
  expect(a, jsd, Errc::invalid_stride, "teacher_stride");
  a = good();
  a.rows = 4;
  a.dx_stride = 1;
  expect(a, jsd, Errc::invalid_stride, "dx_stride");
  a = good();
  a.rows = 4;
  a.loss_elems = loss_elems;
  a.loss_elems_stride = 2;
  expect(a, jsd, Errc::invalid_stride, "loss_elems_stride");
  a = good();
  a.rows = 4;
  a.grad_output_stride = 3;
  expect(a, jsd, Errc::invalid_stride, "grad_output_stride");
  // Scalars.
  for (float t : {0.0f, -1.0f, __builtin_huge_valf(), __builtin_nanf("")}) {
    a = good();
    a.temperature = t;
    expect(a, jsd, Errc::invalid_value, "temperature");
  }
  a = good();
  a.grad_scale = __builtin_nanf("");
  expect(a, jsd, Errc::invalid_value, "grad_scale");
  for (float b : {-0.5f, 1.5f, __builtin_nanf("")}) expect(good(), GeneralizedJSD{b}, Errc::invalid_value, "beta");
  expect(good(), KLDiv{-1e-3f}, Errc::invalid_value, "eps");
  a = good();
  a.reduction = static_cast<DivergenceReduction>(7);
  expect(a, jsd, Errc::invalid_value, "reduction");
  a = good();
  a.reduction = DivergenceReduction::none;  // with a reduced-loss output
  expect(a, jsd, Errc::invalid_value, "loss");
  a = good();
  a.student_input = static_cast<DivergenceInput>(9);
  expect(a, jsd, Errc::invalid_value, "student_input");
  a = good();
  a.teacher_input = static_cast<DivergenceInput>(-1);
  expect(a, jsd, Errc::invalid_value, "teacher_input");
}

TEST_CASE("divergence rejects input forms its functor does not take", "[div][validation]") {
  auto a = good();
  // The JSD family: log-probs or logits on each side.
  a.student_input = DivergenceInput::probs;
  expect(a, ForwardKL{}, Errc::unsupported, "student_input");
  expect(a, ReverseKL{}, Errc::unsupported, "student_input");
  expect(a, GeneralizedJSD{0.5f}, Errc::unsupported, "student_input");
  // KLDiv: the student as log-probs or logits (its input is log-space), any target.
  expect(a, KLDiv{}, Errc::unsupported, "student_input");
  a = good();
  a.teacher_input = DivergenceInput::probs;
  expect(a, ForwardKL{}, Errc::unsupported, "teacher_input");
  expect(a, GeneralizedJSD{0.25f}, Errc::unsupported, "teacher_input");
  CHECK(detail::validate_divergence_call(a, KLDiv{}, "divergence").ok());
  CHECK(detail::validate_divergence_call(a, TVD{}, "divergence").ok());
  a.student_input = DivergenceInput::probs;
  CHECK(detail::validate_divergence_call(a, TVD{}, "divergence").ok());
  const Status s = divergence(a, KLDiv{}, nullptr);
  CHECK(s.message().find("KLDiv") != std::string::npos);
  CHECK(s.message().find("probs") != std::string::npos);
}

TEST_CASE("divergence rejects overlapping outputs and a short workspace", "[div][validation]") {
  const ForwardKL fkl;
  auto a = good();
  // In place over the student is allowed; partly over it is not; over the teacher never.
  auto in_place = good();
  in_place.dx = student;
  CHECK(detail::validate_divergence_args(in_place, "divergence").ok());
  a = good();
  a.dx = student + 1;
  expect(a, fkl, Errc::aliasing, "dx");
  a = good();
  a.dx = student;
  a.dx_stride = kV + 8;
  a.student_stride = kV;
  a.rows = 4;
  expect(a, fkl, Errc::aliasing, "dx");
  a = good();
  a.dx = reinterpret_cast<bf16*>(teacher);
  expect(a, fkl, Errc::aliasing, "dx");
  a = good();
  a.dx = reinterpret_cast<bf16*>(labels);
  a.rows = 1;
  expect(a, fkl, Errc::aliasing, "dx");
  a = good();
  a.loss = reinterpret_cast<float*>(student);
  expect(a, fkl, Errc::aliasing, "loss");
  a = good();
  a.loss_rows = teacher + 3;
  expect(a, fkl, Errc::aliasing, "loss_rows");
  a = good();
  a.loss_elems = reinterpret_cast<float*>(dx);
  expect(a, fkl, Errc::aliasing, "loss_elems");
  a = good();
  a.loss_rows = loss;  // loss_rows over loss
  a.rows = 1;
  expect(a, fkl, Errc::aliasing, "loss_rows");
  // grad_output's extent follows the reduction and the functor: under none, per element for TVD.
  a = good();
  a.reduction = DivergenceReduction::none;
  a.loss = nullptr;
  a.rows = 4;
  a.grad_output = grad_output;
  a.loss_elems = grad_output + kV * 2;  // beyond [rows] values, inside [rows, vocab]
  CHECK(detail::validate_divergence_call(a, fkl, "divergence").ok());
  CHECK(detail::validate_divergence_args(a, "divergence").ok());
  a.student_input = DivergenceInput::probs;
  expect(a, TVD{}, Errc::aliasing, "loss_elems");
  a = good();
  a.grad_output = reinterpret_cast<const float*>(dx);
  expect(a, fkl, Errc::aliasing, "dx");
  // Workspace.
  a = good();
  a.loss_rows = nullptr;
  a.workspace_bytes = 16;
  expect(a, fkl, Errc::workspace_too_small, "workspace_bytes");
  a.workspace = nullptr;
  a.workspace_bytes = 0;
  expect(a, fkl, Errc::null_pointer, "workspace");
  a.workspace = ws + 4;
  a.workspace_bytes = 1024;
  expect(a, fkl, Errc::invalid_value, "workspace");
  // The bytes the call uses (the count and each row's partial sum: 256 bytes here) over a buffer
  // of the call; memory no argument names is fine.
  a = good();
  a.loss_rows = nullptr;
  a.workspace = loss_elems;
  a.workspace_bytes = sizeof(loss_elems);
  CHECK(detail::div_workspace(a).bytes == 256);
  CHECK(detail::validate_divergence_args(a, "divergence").ok());
  a = good();
  a.loss_rows = nullptr;
  a.workspace = const_cast<float*>(teacher) + kV;
  a.workspace_bytes = 1024;
  expect(a, fkl, Errc::aliasing, "workspace");
  a.workspace = reinterpret_cast<unsigned char*>(dx) + 256;
  expect(a, fkl, Errc::aliasing, "workspace");
  a.workspace = labels;
  expect(a, fkl, Errc::aliasing, "workspace");
  // The query validates as the launch does.
  std::size_t bytes = 7;
  a = good();
  a.temperature = 0.0f;
  const Status s = divergence_workspace_bytes(a, bytes);
  CHECK(std::string(s.argument()) == "temperature");
  CHECK(bytes == 0);
}

TEST_CASE("divergence: the generated aliasing matrix", "[divergence][validation]") {
  // The loss, row sums and gradient of a forward KL under batchmean with labels and an upstream
  // gradient, 4 rows of 1000 columns: dx may be the student itself (in place), nothing else may
  // share a byte with another buffer.
  constexpr std::int64_t kR = 4, kCols = 1000;
  auto place = [](DivergenceArgs<bf16, bf16>& a, int k, bf16* p) {
    a.rows = kR, a.vocab = kCols;
    if (k == 0) a.student = p;
    if (k == 1) a.teacher = p;
    if (k == 2) a.labels = reinterpret_cast<const std::int64_t*>(p);
    if (k == 3) a.grad_output = reinterpret_cast<const float*>(p);
    if (k == 4) a.dx = p;
    if (k == 5) a.loss = reinterpret_cast<float*>(p);
    if (k == 6) a.loss_rows = reinterpret_cast<float*>(p);
    if (k == 7) a.workspace = p;
  };
  DivergenceArgs<bf16, bf16> probe;
  alignas(256) static bf16 scratch[8][4096];
  for (int k = 0; k < 8; ++k) place(probe, k, scratch[k]);
  std::size_t ws_bytes = 0;
  REQUIRE(divergence_workspace_bytes(probe, ws_bytes).ok());
  REQUIRE(ws_bytes > 0);
  tigon_test::alias_matrix<DivergenceArgs<bf16, bf16>>(
      {{"student", false, kR * kCols * 2},
       {"teacher", false, kR * kCols * 2},
       {"labels", false, kR * 8},
       {"grad_output", false, 4},
       {"dx", true, kR * kCols * 2},
       {"loss", true, 4},
       {"loss_rows", true, kR * 4},
       {"workspace", true, ws_bytes, 8}},
      {{4, 0}},
      [&](DivergenceArgs<bf16, bf16>& a, int k, bf16* p) {
        place(a, k, p);
        a.workspace_bytes = ws_bytes;
      },
      [](const DivergenceArgs<bf16, bf16>& a) {
        TIGON_CHECK(detail::validate_divergence_args(a, "divergence"));
        return detail::validate_divergence_call(a, ForwardKL{}, "divergence");
      });
}
