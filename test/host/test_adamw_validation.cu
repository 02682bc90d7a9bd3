// Argument validation of the AdamW step, its plan and its workspace query; runs without a GPU.
// Every rejection names its argument and happens before anything touches the device.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include <tigon/optim/adamw.cuh>

#include "alias_matrix.hpp"

using namespace tigon;

namespace {
alignas(256) bf16 param[3][1000];
alignas(256) bf16 grad[3][1000];
alignas(256) float m[3][1000];
alignas(256) float v[3][1000];
alignas(256) float master[3][1000];

AdamWTensor<bf16> tensor(int i, std::int64_t n = 1000) {
  return {.param = param[i], .grad = grad[i], .exp_avg = m[i], .exp_avg_sq = v[i], .numel = n};
}

void expect(const Status& s, Errc code, const char* arg) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(std::string(s.argument()) == arg);
}
}  // namespace

TEST_CASE("adamw: the workspace of a parameter list", "[adamw][validation]") {
  alignas(256) static bf16 bp[40000], bg[40000];
  alignas(256) static float bm[40000], bv[40000];
  AdamWTensor<bf16> t[3] = {tensor(0), tensor(1),
                            {.param = bp, .grad = bg, .exp_avg = bm, .exp_avg_sq = bv, .numel = 40000}};
  std::size_t bytes = 0;
  REQUIRE(adamw_workspace_bytes(t, 2, bytes).ok());
  // Two tensor entries (256 bytes rounded) and two chunks of 8 bytes (256 rounded).
  CHECK(bytes == 256 + 256);
  REQUIRE(adamw_workspace_bytes(t, 3, bytes).ok());
  CHECK(bytes == 256 + 256);  // 40000 elements: two chunks of 32768; four chunks in all
}

TEST_CASE("adamw: the staged plan and its view", "[adamw][validation]") {
  alignas(256) static bf16 bp[40000], bg[40000];
  alignas(256) static float bm[40000], bv[40000];
  AdamWTensor<bf16> t[2] = {tensor(0), {.param = bp, .grad = bg + 1, .exp_avg = bm, .exp_avg_sq = bv, .numel = 39999}};
  std::size_t bytes = 0;
  REQUIRE(adamw_workspace_bytes(t, 2, bytes).ok());
  alignas(256) static unsigned char staging[1024], device_ws[1024];
  std::memset(staging, 0xff, sizeof staging);
  REQUIRE(adamw_plan_stage(t, 2, staging, bytes).ok());
  // The table: each tensor's pointers and whether all of them allow 16-byte vectors (the second's
  // gradient is one element in), then one (tensor, chunk) entry per chunk: 1 + 2 chunks.
  const auto* te = reinterpret_cast<const detail::AdamWTensorEntry*>(staging);
  CHECK(te[0].param == param[0]);
  CHECK(te[0].numel == 1000);
  CHECK(te[0].vec == 1);
  CHECK(te[1].grad == bg + 1);
  CHECK(te[1].vec == 0);
  const auto* ch = reinterpret_cast<const detail::AdamWChunkEntry*>(staging + detail::adamw_tensors_bytes(2));
  CHECK((ch[0].tensor == 0 && ch[0].chunk == 0 && ch[1].tensor == 1 && ch[1].chunk == 0 && ch[2].tensor == 1 &&
         ch[2].chunk == 1));
  expect(adamw_plan_stage(t, 2, staging, bytes - 1), Errc::workspace_too_small, "workspace_bytes");
  AdamWPlan plan;
  REQUIRE(adamw_plan_view(t, 2, device_ws, bytes, plan).ok());
  CHECK(plan.tensors == device_ws);
  CHECK(plan.chunks == device_ws + detail::adamw_tensors_bytes(2));
  CHECK(plan.num_chunks == 3);
  CHECK(plan.num_tensors == 2);
  CHECK(plan.numel == 40999);
  CHECK(plan.param_dtype == static_cast<int>(dtype_traits<bf16>::id));
  CHECK(plan.state_dtype == static_cast<int>(dtype_traits<float>::id));
  expect(adamw_plan_view(t, 2, device_ws, bytes - 1, plan), Errc::workspace_too_small, "workspace_bytes");
  CHECK(plan.tensors == nullptr);  // a rejected view leaves the plan empty
  t[1].exp_avg = bv;               // over the second moment
  CHECK(adamw_plan_view(t, 2, device_ws, bytes, plan).code() == Errc::aliasing);
}

TEST_CASE("adamw: a parameter list is rejected by name", "[adamw][validation]") {
  std::size_t bytes = 0;
  AdamWTensor<bf16> t[2] = {tensor(0), tensor(1)};
  expect(adamw_workspace_bytes(t, 0, bytes), Errc::invalid_size, "num_tensors");
  expect(adamw_workspace_bytes<bf16, float>(nullptr, 1, bytes), Errc::null_pointer, "tensors");
  auto bad = t[1];
  bad.grad = nullptr;
  AdamWTensor<bf16> u[2] = {t[0], bad};
  expect(adamw_workspace_bytes(u, 2, bytes), Errc::null_pointer, "tensors[i].grad");
  bad = t[1];
  bad.numel = 0;
  u[1] = bad;
  expect(adamw_workspace_bytes(u, 2, bytes), Errc::invalid_size, "tensors[i].numel");
  // Tensor 1's parameter inside tensor 0's first moment.
  bad = t[1];
  bad.param = reinterpret_cast<bf16*>(m[0] + 10);
  u[1] = bad;
  expect(adamw_workspace_bytes(u, 2, bytes), Errc::aliasing, "tensors[i].param");
  // A moment over a gradient (read only, but the step writes the moment).
  bad = t[1];
  bad.exp_avg_sq = reinterpret_cast<float*>(grad[0]);
  u[1] = bad;
  expect(adamw_workspace_bytes(u, 2, bytes), Errc::aliasing, "tensors[i].exp_avg_sq");
  // The master copy over the second moment of the same tensor.
  bad = t[1];
  bad.master = v[1] + 500;
  u[1] = bad;
  expect(adamw_workspace_bytes(u, 2, bytes), Errc::aliasing, "tensors[i].master");
  // Two tensors sharing one gradient is fine (nothing writes it); masters of their own are fine.
  bad = t[1];
  bad.grad = grad[0];
  bad.master = master[1];
  u[1] = bad;
  CHECK(adamw_workspace_bytes(u, 2, bytes).ok());
  // The plan wants its workspace.
  AdamWPlan plan;
  expect(adamw_plan(t, 2, nullptr, 0, nullptr, plan), Errc::null_pointer, "workspace");
  alignas(16) static unsigned char ws[256];
  expect(adamw_plan(t, 2, ws, sizeof(ws), nullptr, plan), Errc::workspace_too_small, "workspace_bytes");
  CHECK(plan.num_chunks == 0);
}

TEST_CASE("adamw: the step's constants and device scalars are rejected by name", "[adamw][validation]") {
  alignas(16) static float lr = 1e-3f, step = 0.0f;
  AdamWHyper h{.lr = &lr, .step = &step};
  CHECK(detail::validate_adamw_hyper(h, true, "adamw_step").ok());
  auto bad = h;
  bad.lr = nullptr;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::null_pointer, "lr");
  bad.lr_value = 1e-2;  // a constant learning rate instead of the device scalar
  CHECK(detail::validate_adamw_hyper(bad, true, "adamw_step").ok());
  bad.lr_value = -1e-2;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "lr_value");
  bad.lr_value = __builtin_nan("");
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "lr_value");
  bad = h;
  bad.lr_value = 1e-2;  // both
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "lr_value");
  bad = h;
  bad.step = nullptr;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::null_pointer, "step");
  bad = h;
  bad.beta1 = 1.0f;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "beta1");
  bad = h;
  bad.beta2 = -0.5f;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "beta2");
  bad = h;
  bad.eps = __builtin_nan("");
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "eps");
  bad = h;
  bad.weight_decay = -1.0f;
  expect(detail::validate_adamw_hyper(bad, true, "adamw_step"), Errc::invalid_value, "weight_decay");
  bad = h;
  bad.stochastic_rounding = true;
  expect(detail::validate_adamw_hyper(bad, false, "adamw_step"), Errc::unsupported, "stochastic_rounding");
  // A step on an empty plan, or on a plan made for other dtypes, is rejected before any launch.
  expect(adamw_step<bf16>(AdamWPlan{}, h, nullptr), Errc::invalid_value, "plan");
  AdamWPlan other{.tensors = m, .chunks = v, .num_chunks = 1, .num_tensors = 1, .numel = 1,
                  .param_dtype = static_cast<int>(DType::f32), .state_dtype = static_cast<int>(DType::f32)};
  expect(adamw_step<bf16>(other, h, nullptr), Errc::invalid_value, "plan");
}

TEST_CASE("grad_norm_clip: bad arguments are rejected by name", "[adamw][validation]") {
  alignas(256) static unsigned char table[1024];
  alignas(256) static unsigned char ws[1024];
  alignas(16) static float out[2];
  const AdamWPlan plan{.tensors = table, .chunks = table + 256, .num_chunks = 3, .num_tensors = 1, .numel = 70000,
                       .param_dtype = static_cast<int>(DType::bf16), .state_dtype = static_cast<int>(DType::f32)};
  CHECK(grad_norm_workspace_bytes(plan) == 256);
  expect(grad_norm_clip<bf16>(AdamWPlan{}, 1.0f, out, out + 1, ws, sizeof(ws), nullptr), Errc::invalid_value, "plan");
  expect(grad_norm_clip<float>(plan, 1.0f, out, out + 1, ws, sizeof(ws), nullptr), Errc::invalid_value, "plan");
  expect(grad_norm_clip<bf16>(plan, 0.0f, out, out + 1, ws, sizeof(ws), nullptr), Errc::invalid_value, "max_norm");
  expect(grad_norm_clip<bf16>(plan, __builtin_nanf(""), out, out + 1, ws, sizeof(ws), nullptr), Errc::invalid_value,
         "max_norm");
  expect(grad_norm_clip<bf16>(plan, 1.0f, nullptr, nullptr, ws, sizeof(ws), nullptr), Errc::null_pointer, "norm");
  expect(grad_norm_clip<bf16>(plan, 1.0f, out, out + 1, ws, 16, nullptr), Errc::workspace_too_small,
         "workspace_bytes");
  expect(grad_norm_clip<bf16>(plan, 1.0f, out, out + 1, table + 256, 256, nullptr), Errc::aliasing, "workspace");
  expect(grad_norm_clip<bf16>(plan, 1.0f, out, out, ws, sizeof(ws), nullptr), Errc::aliasing, "factor");
}

TEST_CASE("adamw: the generated aliasing matrix of a two-tensor list", "[adamw][validation]") {
  // Each tensor's parameter, gradient, moments and master over 500 elements: every written buffer
  // apart from every other buffer (the gradients are only read: two tensors may share one).
  struct List {
    AdamWTensor<bf16> t[2];
  };
  tigon_test::alias_matrix<List>(
      {{"param0", true, 1000, 1}, {"grad0", false, 1000}, {"exp_avg0", true, 2000, 2}, {"exp_avg_sq0", true, 2000, 2},
       {"master0", true, 2000, 2}, {"param1", true, 1000, 1}, {"grad1", false, 1000}, {"exp_avg1", true, 2000, 2},
       {"exp_avg_sq1", true, 2000, 2}, {"master1", true, 2000, 2}},
      {},
      [](List& l, int k, bf16* p) {
        AdamWTensor<bf16>& t = l.t[k / 5];
        t.numel = 500;
        auto* f = reinterpret_cast<float*>(p);
        switch (k % 5) {
          case 0: t.param = p; break;
          case 1: t.grad = p; break;
          case 2: t.exp_avg = f; break;
          case 3: t.exp_avg_sq = f; break;
          case 4: t.master = f; break;
        }
      },
      [](const List& l) {
        std::size_t bytes = 0;
        return adamw_workspace_bytes(l.t, 2, bytes);
      });
}
