// The multi-tensor AdamW step on the GPU against the host rule (AdamWRule applied element by
// element with the same coefficients): bfloat16, half and fp32 parameters, fp32 and 16-bit moments,
// fp32 master weights, tensor sizes around the vector width and the chunk, a misaligned tensor (the
// scalar path), the gradient scale and clip factor, Adam's L2 decay, several steps; found_inf skips
// the step; stochastic rounding lands on a neighbour and repeats for a seed; a captured step
// replays as the eager one does; the gradient-norm clip (with and without the gradient scale).
#include "gpu_test.cuh"

#include <algorithm>
#include <cstring>
#include <deque>
#include <string>

#include <tigon/optim/adamw.cuh>

using namespace tigon;
using gpu_test::DeviceBuffer;

namespace {

template <class P, class S>
struct Model {
  std::vector<std::int64_t> sizes;
  std::deque<DeviceBuffer<P>> p, g;
  std::deque<DeviceBuffer<S>> m, v;
  std::deque<DeviceBuffer<float>> master;
  std::vector<std::vector<float>> hp, hg, hm, hv, hmaster;  // host mirrors (fp32 values)
  // Per element, the largest |param| + |update| over the steps: the size of the terms whose
  // difference the fp32 update rounds (a contraction into an FMA on one side and not the other
  // moves the result by an ulp of that size, not of the result).
  std::vector<std::vector<float>> hscale;
  std::vector<AdamWTensor<P, S>> tensors;
  int misaligned = -1;  // this tensor's buffers start one element in

  Model(std::vector<std::int64_t> n, bool with_master, int misaligned_tensor) : sizes(std::move(n)),
                                                                               misaligned(misaligned_tensor) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::int64_t len = sizes[i], off = static_cast<int>(i) == misaligned ? 1 : 0;
      std::vector<double> pd, gd;
      auto ph = gpu_test::random_values<P>(len + off, 0, 1, &pd);
      auto gh = gpu_test::random_values<P>(len + off, 0, 0.1, &gd);
      p.emplace_back(len + off), g.emplace_back(len + off), m.emplace_back(len + off), v.emplace_back(len + off);
      p.back().upload(ph);
      g.back().upload(gh);
      std::vector<S> zeros(len + off, from_float<S>(0.0f));
      m.back().upload(zeros);
      v.back().upload(zeros);
      hp.emplace_back(pd.begin() + off, pd.end());
      hg.emplace_back(gd.begin() + off, gd.end());
      hm.emplace_back(len, 0.0f);
      hv.emplace_back(len, 0.0f);
      hscale.emplace_back(len, 0.0f);
      AdamWTensor<P, S> t{.param = p.back().ptr + off, .grad = g.back().ptr + off, .exp_avg = m.back().ptr + off,
                          .exp_avg_sq = v.back().ptr + off, .numel = len};
      if (with_master) {
        master.emplace_back(len + off);
        std::vector<float> mh(len + off, 0.0f);
        for (std::int64_t k = 0; k < len; ++k) mh[k + off] = hp.back()[k];
        master.back().upload(mh);
        hmaster.push_back(hp.back());
        t.master = master.back().ptr + off;
      }
      tensors.push_back(t);
    }
  }

  // The host rule over every element, with the same coefficients as the kernel; params rounded to
  // P (from the master when there is one), moments to S.
  void host_step(const AdamWHyper& h, double lr, float t, float scale, float clip) {
    const AdamWCoeffs c =
        adamw_math::coeffs(lr, h.beta1, h.beta2, h.eps, h.weight_decay, t, scale, clip, h.decoupled);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::int64_t k = 0; k < sizes[i]; ++k) {
        float pv = hmaster.empty() ? hp[i][k] : hmaster[i][k];
        const float before = pv;
        float mv = hm[i][k], vv = hv[i][k];
        AdamWRule::apply(pv, adamw_math::gradient(hg[i][k], c), mv, vv, c);
        hscale[i][k] = std::max(hscale[i][k], std::abs(before) + std::abs(pv - before));
        hm[i][k] = round_to<S>(mv);
        hv[i][k] = round_to<S>(vv);
        if (!hmaster.empty()) hmaster[i][k] = pv;
        hp[i][k] = round_to<P>(pv);
      }
    }
  }

  // Elements off the host mirror by more than tol (relative, plus a floor); master weights within
  // 1e-6 of their value. Parameters and master weights also by 2^-22 of their terms' size (hscale).
  // first_bad names the first element off.
  std::string first_bad;
  int compare(double tol) {
    int bad = 0;
    auto check = [&](const char* what, std::size_t i, std::int64_t k, float got, float want, double bound) {
      if (std::abs(got - want) <= bound) return;
      if (bad++ == 0) {
        first_bad = std::string(what) + " of tensor " + std::to_string(i) + " element " + std::to_string(k) +
                    ": " + std::to_string(got) + " against " + std::to_string(want) + " (bound " +
                    std::to_string(bound) + ", terms " + std::to_string(hscale[i][k]) + ")";
      }
    };
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::int64_t off = static_cast<int>(i) == misaligned ? 1 : 0;
      const auto gp = p[i].download();
      const auto gm = m[i].download(), gv = v[i].download();
      for (std::int64_t k = 0; k < sizes[i]; ++k) {
        auto rel = [&](float want) { return tol * (std::abs(want) + 1e-6); };
        check("param", i, k, to_float(gp[k + off]), hp[i][k], rel(hp[i][k]) + 0x1p-22 * hscale[i][k]);
        check("exp_avg", i, k, to_float(gm[k + off]), hm[i][k], rel(hm[i][k]));
        check("exp_avg_sq", i, k, to_float(gv[k + off]), hv[i][k], rel(hv[i][k]));
      }
      if (!hmaster.empty()) {
        const auto gms = master[i].download();
        for (std::int64_t k = 0; k < sizes[i]; ++k) {
          check("master", i, k, gms[k + off], hmaster[i][k],
                1e-6 * (std::abs(hmaster[i][k]) + 1e-6) + 0x1p-22 * hscale[i][k]);
        }
      }
    }
    return bad;
  }
};

template <class P, class S>
void run(bool with_master, bool decoupled, bool scaled, bool lr_const = false) {
  INFO("P=" << dtype_traits<P>::name << " S=" << dtype_traits<S>::name << (with_master ? " master" : "")
            << (decoupled ? " AdamW" : " Adam") << (scaled ? " scale+clip" : "") << (lr_const ? " lr_value" : ""));
  Model<P, S> model({1, 7, 8, 1000, 32768, 40003, 70000}, with_master, 3);
  std::size_t bytes = 0;
  TIGON_OK(adamw_workspace_bytes(model.tensors.data(), static_cast<int>(model.tensors.size()), bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  AdamWPlan plan;
  TIGON_OK(adamw_plan(model.tensors.data(), static_cast<int>(model.tensors.size()), ws.ptr, bytes, nullptr, plan));
  DeviceBuffer<float> scalars(4);  // lr, step, grad scale, clip factor
  scalars.upload(std::vector<float>{1e-2f, 0.0f, 4.0f, 0.5f});
  AdamWHyper h{.weight_decay = 0.05f, .decoupled = decoupled, .lr = scalars.ptr, .step = scalars.ptr + 1};
  if (scaled) {
    h.grad_scale = scalars.ptr + 2;
    h.clip_factor = scalars.ptr + 3;
  }
  if (lr_const) {  // the learning rate as a constant, not a device scalar
    h.lr = nullptr;
    h.lr_value = 1e-2;
  }
  for (int t = 1; t <= 3; ++t) {
    TIGON_OK((adamw_step<P, S>(plan, h, nullptr)));
    model.host_step(h, lr_const ? 1e-2 : static_cast<double>(1e-2f), static_cast<float>(t), scaled ? 4.0f : 1.0f,
                    scaled ? 0.5f : 1.0f);
  }
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(scalars.download()[1] == 3.0f);
  // fp32: the same operations in the same order (sqrt and division are correctly rounded on both
  // sides; powf may differ by an ulp); 16-bit: one rounding of the dtype.
  const double tol = std::is_same_v<P, float> && std::is_same_v<S, float> ? 1e-5 : 1.0 / 128;
  const int bad = model.compare(tol);
  INFO(bad << " elements off; first: " << model.first_bad);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("adamw: the step against the host rule", "[adamw][gpu]") {
  run<bf16, float>(false, true, false);
  run<bf16, float>(false, true, true);
  run<bf16, float>(true, true, false);
  run<bf16, bf16>(false, true, false);
  run<half, float>(false, false, true);
  run<float, float>(false, true, false);
  run<float, float>(false, false, false);
  run<float, float>(false, true, false, true);
  run<bf16, bf16>(false, true, true, true);
}

TEST_CASE("adamw: found_inf skips the step, writes nothing and keeps the count", "[adamw][gpu]") {
  Model<bf16, float> model({1000, 33000}, false, -1);
  std::size_t bytes = 0;
  TIGON_OK(adamw_workspace_bytes(model.tensors.data(), 2, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  AdamWPlan plan;
  TIGON_OK(adamw_plan(model.tensors.data(), 2, ws.ptr, bytes, nullptr, plan));
  DeviceBuffer<float> scalars(3);
  scalars.upload(std::vector<float>{1e-2f, 5.0f, 1.0f});  // lr, step, found_inf
  const auto before = model.p[1].download();
  const AdamWHyper h{.lr = scalars.ptr, .step = scalars.ptr + 1, .found_inf = scalars.ptr + 2};
  TIGON_OK((adamw_step<bf16, float>(plan, h, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  const auto after = model.p[1].download();
  CHECK(std::memcmp(before.data(), after.data(), before.size() * sizeof(bf16)) == 0);
  CHECK(scalars.download()[1] == 5.0f);
  const auto mh = model.m[1].download();
  CHECK(std::all_of(mh.begin(), mh.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("adamw: stochastic rounding lands on a neighbour and repeats for a seed", "[adamw][gpu]") {
  std::vector<bf16> first, p_init, g_init;
  for (int rep = 0; rep < 2; ++rep) {
    Model<bf16, float> model({50000}, false, -1);
    if (rep == 0) {
      p_init = model.p[0].download();
      g_init = model.g[0].download();
    } else {  // the first run's inputs again
      model.p[0].upload(p_init);
      model.g[0].upload(g_init);
      for (std::size_t k = 0; k < p_init.size(); ++k) {
        model.hp[0][k] = to_float(p_init[k]);
        model.hg[0][k] = to_float(g_init[k]);
      }
    }
    std::size_t bytes = 0;
    TIGON_OK(adamw_workspace_bytes(model.tensors.data(), 1, bytes));
    DeviceBuffer<unsigned char> ws(bytes);
    AdamWPlan plan;
    TIGON_OK(adamw_plan(model.tensors.data(), 1, ws.ptr, bytes, nullptr, plan));
    DeviceBuffer<float> scalars(2);
    scalars.upload(std::vector<float>{1e-3f, 0.0f});
    const AdamWHyper h{.lr = scalars.ptr, .step = scalars.ptr + 1, .stochastic_rounding = true, .seed = 42};
    const std::vector<float> p0 = model.hp[0];
    TIGON_OK((adamw_step<bf16, float>(plan, h, nullptr)));
    CUDA_OK(cudaDeviceSynchronize());
    const auto got = model.p[0].download();
    // The fp32 update, then its two bfloat16 neighbours.
    const AdamWCoeffs c = adamw_math::coeffs(1e-3f, h.beta1, h.beta2, h.eps, h.weight_decay, 1.0f, 1.0f, 1.0f, true);
    int bad = 0, up = 0;
    for (std::size_t k = 0; k < got.size(); ++k) {
      float pv = p0[k], mv = 0.0f, vv = 0.0f;
      AdamWRule::apply(pv, model.hg[0][k], mv, vv, c);
      const float lo = adamw_math::stochastic_bf16(pv, 0u), hi = adamw_math::stochastic_bf16(pv, 0xffffu);
      const float g = to_float(got[k]);
      bad += g != lo && g != hi;
      up += g == hi && hi != lo;
    }
    CHECK(bad == 0);
    CHECK(up > 0);  // not plain truncation
    if (rep == 0) {
      first = got;
    } else {
      CHECK(std::memcmp(first.data(), got.data(), got.size() * sizeof(bf16)) == 0);
    }
  }
}

TEST_CASE("adamw: a captured step replays as the eager step", "[adamw][gpu][graph]") {
  Model<bf16, float> eager({1000, 40000}, false, -1), graphed({1000, 40000}, false, -1);
  for (std::size_t i = 0; i < 2; ++i) {  // the same starting values
    graphed.p[i].upload(eager.p[i].download());
    graphed.g[i].upload(eager.g[i].download());
  }
  auto plan_of = [](Model<bf16, float>& m, DeviceBuffer<unsigned char>*& ws, AdamWPlan& plan) {
    std::size_t bytes = 0;
    TIGON_OK(adamw_workspace_bytes(m.tensors.data(), 2, bytes));
    ws = new DeviceBuffer<unsigned char>(bytes);
    TIGON_OK(adamw_plan(m.tensors.data(), 2, ws->ptr, bytes, nullptr, plan));
  };
  DeviceBuffer<unsigned char>*wa = nullptr, *wb = nullptr;
  AdamWPlan pa, pb;
  plan_of(eager, wa, pa);
  plan_of(graphed, wb, pb);
  DeviceBuffer<float> sa(2), sb(2);
  sa.upload(std::vector<float>{1e-2f, 0.0f});
  sb.upload(std::vector<float>{1e-2f, 0.0f});
  const AdamWHyper ha{.lr = sa.ptr, .step = sa.ptr + 1}, hb{.lr = sb.ptr, .step = sb.ptr + 1};
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  TIGON_OK((adamw_step<bf16, float>(pb, hb, s)));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int t = 0; t < 3; ++t) {
    TIGON_OK((adamw_step<bf16, float>(pa, ha, s)));
    CUDA_OK(cudaGraphLaunch(exec, s));
  }
  CUDA_OK(cudaStreamSynchronize(s));
  for (std::size_t i = 0; i < 2; ++i) {
    const auto x = eager.p[i].download(), y = graphed.p[i].download();
    CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(bf16)) == 0);
  }
  CHECK(sb.download()[1] == 3.0f);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  delete wa;
  delete wb;
}

TEST_CASE("adamw: grad_norm_clip's norm, factor and determinism; the clipped step", "[adamw][gpu]") {
  Model<bf16, float> model({5, 1000, 40003, 70000}, false, 1);
  std::size_t bytes = 0;
  TIGON_OK(adamw_workspace_bytes(model.tensors.data(), 4, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  AdamWPlan plan;
  TIGON_OK(adamw_plan(model.tensors.data(), 4, ws.ptr, bytes, nullptr, plan));
  DeviceBuffer<unsigned char> nws(grad_norm_workspace_bytes(plan));
  DeviceBuffer<float> out(4);  // norm, factor, lr, step
  out.upload(std::vector<float>{0.0f, 0.0f, 1e-2f, 0.0f});
  double sq = 0;
  for (const auto& g : model.hg)
    for (float x : g) sq += double(x) * x;
  const double norm = std::sqrt(sq);
  const float max_norm = static_cast<float>(norm / 4);
  TIGON_OK((grad_norm_clip<bf16, float>(plan, max_norm, out.ptr, out.ptr + 1, nws.ptr, nws.count, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  const auto first = out.download();
  CHECK(std::abs(first[0] - norm) <= 1e-5 * norm);
  CHECK(first[1] == Approx(max_norm / (first[0] + 1e-6f)).epsilon(1e-6));
  TIGON_OK((grad_norm_clip<bf16, float>(plan, max_norm, out.ptr, out.ptr + 1, nws.ptr, nws.count, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  const auto second = out.download();
  CHECK(std::memcmp(first.data(), second.data(), 2 * sizeof(float)) == 0);  // deterministic
  // With the step's gradient scale (AMP): the norm of the unscaled gradients.
  DeviceBuffer<float> scale(1);
  scale.upload(std::vector<float>{4.0f});
  TIGON_OK((grad_norm_clip<bf16, float>(plan, max_norm, out.ptr, out.ptr + 1, nws.ptr, nws.count, nullptr,
                                        scale.ptr)));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(std::abs(out.download()[0] - norm / 4) <= 1e-5 * norm / 4);
  // A norm under max_norm: factor 1.
  TIGON_OK((grad_norm_clip<bf16, float>(plan, static_cast<float>(norm * 4), nullptr, out.ptr + 1, nws.ptr, nws.count,
                                        nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(out.download()[1] == 1.0f);
  // The step with the clip factor of the first call.
  out.upload(first);
  const AdamWHyper h{.lr = out.ptr + 2, .step = out.ptr + 3, .clip_factor = out.ptr + 1};
  TIGON_OK((adamw_step<bf16, float>(plan, h, nullptr)));
  model.host_step(h, 1e-2f, 1.0f, 1.0f, first[1]);
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(model.compare(1.0 / 128) == 0);
}
