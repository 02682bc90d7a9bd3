// Launchers captured first in their process. ctest runs one process per op family and capture mode
// (TIGON_CAPTURE_MODE: global, thread_local or relaxed; the case's tag names the family), so each
// launcher meets its caches cold inside the capture: the device's attributes, the programmatic-launch
// answer, the cluster occupancy of the row-per-cluster kernels, the norms' row plans, cuBLASLt's
// plans. The captured graph, launched, must give the same bytes as the same calls made eagerly
// afterwards. What a call needs before it (buffers, workspace sizes, a cuBLASLt handle, AdamW's plan,
// whose upload synchronises) is made before the capture; inputs are generated on the device.
#include "gpu_test.cuh"

#include <cstdlib>
#include <deque>
#include <functional>
#include <utility>

#include <tigon/activation/gated.cuh>
#include <tigon/blas/gemm.cuh>
#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/divergence.cuh>
#include <tigon/loss/linear_cross_entropy.cuh>
#include <tigon/norm/rms_norm.cuh>
#include <tigon/optim/adamw.cuh>
#include <tigon/rope/rope.cuh>

using namespace tigon;
using namespace gpu_test;

namespace {

cudaStreamCaptureMode capture_mode() {
  const char* m = std::getenv("TIGON_CAPTURE_MODE");
  const std::string s = m != nullptr ? m : "global";
  if (s == "thread_local") return cudaStreamCaptureModeThreadLocal;
  if (s == "relaxed") return cudaStreamCaptureModeRelaxed;
  return cudaStreamCaptureModeGlobal;
}

template <class T>
void fill(T* p, std::int64_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  fill_hash(p, n, seed, lo, hi);
}

struct Out {
  void* p;
  std::size_t bytes;
};

// reset(): fresh inputs and poisoned outputs (default stream, synchronised); calls(s): the launches.
// The calls captured (cold), the graph launched; then reset again and the calls made eagerly: every
// output the same bytes.
void captured_equals_eager(const std::function<void()>& reset, const std::function<Status(cudaStream_t)>& calls,
                           const std::vector<Out>& outs) {
  const cudaStreamCaptureMode mode = capture_mode();
  INFO("capture mode " << (mode == cudaStreamCaptureModeGlobal ? "global"
                                   : mode == cudaStreamCaptureModeThreadLocal ? "thread_local" : "relaxed"));
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  reset();
  CUDA_OK(cudaStreamBeginCapture(s, mode));
  const Status st = calls(s);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  INFO("status: " << st.message() << "; end of capture: " << cudaGetErrorString(end));
  REQUIRE(st.ok());
  REQUIRE(end == cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<std::vector<unsigned char>> got;
  for (const Out& o : outs) {
    got.emplace_back(o.bytes);
    CUDA_OK(cudaMemcpy(got.back().data(), o.p, o.bytes, cudaMemcpyDeviceToHost));
  }
  reset();
  TIGON_OK(calls(s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (std::size_t i = 0; i < outs.size(); ++i) {
    std::vector<unsigned char> want(outs[i].bytes);
    CUDA_OK(cudaMemcpy(want.data(), outs[i].p, outs[i].bytes, cudaMemcpyDeviceToHost));
    INFO("output " << i);
    CHECK(std::memcmp(got[i].data(), want.data(), want.size()) == 0);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

template <class T>
void poison(DeviceBuffer<T>& b) {
  REQUIRE(cudaMemset(b.ptr, 0xFF, b.bytes()) == cudaSuccess);
}

void settle() { REQUIRE(cudaDeviceSynchronize() == cudaSuccess); }

}  // namespace

TEST_CASE("cold capture: RMSNorm forward and backward", "[.cold][rms_norm]") {
  const std::int64_t R = 1000, D = 4096, n = R * D;
  DeviceBuffer<bf16> x(n), y(n), dy(n), dx(n), w(D), dw(D);
  DeviceBuffer<float> rstd(R);
  RmsNormForwardArgs<bf16> f{.x = x.ptr, .y = y.ptr, .weight = w.ptr, .rstd = rstd.ptr, .rows = R, .cols = D};
  RmsNormBackwardArgs<bf16> b{.dy = dy.ptr, .x = x.ptr, .weight = w.ptr, .rstd = rstd.ptr, .dx = dx.ptr,
                              .dweight = dw.ptr, .rows = R, .cols = D};
  std::size_t bytes = 0;
  TIGON_OK(rms_norm_backward_workspace_bytes(b, bytes));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
  b.workspace = ws.ptr;
  b.workspace_bytes = bytes;
  captured_equals_eager(
      [&] {
        fill(x.ptr, n, 1), fill(dy.ptr, n, 2), fill(w.ptr, D, 3, 0.5f, 1.5f);
        poison(y), poison(dx), poison(dw), poison(rstd);
        settle();
      },
      [&](cudaStream_t s) {
        TIGON_CHECK(rms_norm_forward(f, s));
        return rms_norm_backward(b, s);
      },
      {{y.ptr, y.bytes()}, {rstd.ptr, rstd.bytes()}, {dx.ptr, dx.bytes()}, {dw.ptr, dw.bytes()}});
}

TEST_CASE("cold capture: RoPE forward and backward", "[.cold][rope]") {
  const std::int64_t B = 2, T = 512, Hq = 32, Hk = 8, Dh = 128;
  DeviceBuffer<bf16> q(B * T * Hq * Dh), k(B * T * Hk * Dh), qo(q.count), ko(k.count), cs(T * Dh), sn(T * Dh);
  RopeArgs<bf16> r;
  r.q = {.in = q.ptr, .out = qo.ptr, .heads = Hq, .stride_b = T * Hq * Dh, .stride_t = Hq * Dh, .stride_h = Dh};
  r.k = {.in = k.ptr, .out = ko.ptr, .heads = Hk, .stride_b = T * Hk * Dh, .stride_t = Hk * Dh, .stride_h = Dh};
  r.batch = B;
  r.seq = T;
  r.head_dim = Dh;
  r.cos = cs.ptr;
  r.sin = sn.ptr;
  r.table_rows = T;
  auto back = r;  // the backward rotates the outputs' gradients back, in place
  back.q.in = back.q.out = qo.ptr;
  back.k.in = back.k.out = ko.ptr;
  captured_equals_eager(
      [&] {
        fill(q.ptr, q.count, 4), fill(k.ptr, k.count, 5), fill(cs.ptr, cs.count, 6), fill(sn.ptr, sn.count, 7);
        poison(qo), poison(ko);
        settle();
      },
      [&](cudaStream_t s) {
        TIGON_CHECK(rope_forward(r, s));
        return rope_backward(back, s);
      },
      {{qo.ptr, qo.bytes()}, {ko.ptr, ko.bytes()}});
}

TEST_CASE("cold capture: SwiGLU forward and backward", "[.cold][gated]") {
  const std::int64_t R = 512, C = 14336, n = R * C;
  DeviceBuffer<bf16> a(n), b(n), c(n), dc(n), da(n), db(n);
  GatedForwardArgs<bf16> f{.a = a.ptr, .b = b.ptr, .c = c.ptr, .rows = R, .cols = C};
  GatedBackwardArgs<bf16> g{.dc = dc.ptr, .a = a.ptr, .b = b.ptr, .da = da.ptr, .db = db.ptr, .rows = R, .cols = C};
  captured_equals_eager(
      [&] {
        fill(a.ptr, n, 8), fill(b.ptr, n, 9), fill(dc.ptr, n, 10);
        poison(c), poison(da), poison(db);
        settle();
      },
      [&](cudaStream_t s) {
        TIGON_CHECK(swiglu_forward(f, s));
        return swiglu_backward(g, s);
      },
      {{c.ptr, c.bytes()}, {da.ptr, da.bytes()}, {db.ptr, db.bytes()}});
}

TEST_CASE("cold capture: cross-entropy", "[.cold][cross_entropy]") {
  const std::int64_t R = 256, V = 128256, n = R * V;
  DeviceBuffer<bf16> x(n), dx(n);
  DeviceBuffer<std::int64_t> t(R);
  std::vector<std::int64_t> th(R);
  for (std::int64_t i = 0; i < R; ++i) th[i] = (i * 7919) % V;
  DeviceBuffer<float> loss(1), rows(R);
  CrossEntropyArgs<bf16> a{.logits = x.ptr, .targets = t.ptr, .rows = R, .vocab = V, .dlogits = dx.ptr,
                           .loss = loss.ptr, .loss_rows = rows.ptr};
  std::size_t bytes = 0;
  TIGON_OK(cross_entropy_workspace_bytes(a, bytes));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  captured_equals_eager(
      [&] {
        fill(x.ptr, n, 11, -8.0f, 8.0f);
        t.upload(th);
        poison(dx), poison(loss), poison(rows);
        settle();
      },
      [&](cudaStream_t s) { return cross_entropy(a, s); },
      {{dx.ptr, dx.bytes()}, {loss.ptr, loss.bytes()}, {rows.ptr, rows.bytes()}});
}

// The split-vocabulary path (each shard's statistics, their merge, each shard's loss and gradient),
// in a process of its own: its kernels' caches are cold too.
TEST_CASE("cold capture: cross-entropy over a split vocabulary", "[.cold][cross_entropy_split]") {
  const std::int64_t R = 256, V = 128256, n = R * V, cut = 64128;
  DeviceBuffer<bf16> x(n), dx(n);
  DeviceBuffer<std::int64_t> t(R), am(R);
  std::vector<std::int64_t> th(R);
  for (std::int64_t i = 0; i < R; ++i) th[i] = i % 13 == 0 ? -100 : (i * 7919) % V;
  DeviceBuffer<float> loss(1), rows(R);
  DeviceBuffer<CrossEntropyStats> stats(2 * R), merged(R);
  CrossEntropyArgs<bf16> a{.logits = x.ptr, .targets = t.ptr, .rows = R, .vocab = V, .dlogits = dx.ptr,
                           .label_smoothing = 0.1f, .loss = loss.ptr, .loss_rows = rows.ptr, .argmax = am.ptr};
  std::size_t bytes = 0;
  TIGON_OK(cross_entropy_workspace_bytes(a, bytes));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes;
  const std::int64_t cuts[3] = {0, cut, V};
  auto shard = [&](int k) {
    CrossEntropyArgs<bf16> sa = a;
    sa.logits = x.ptr + cuts[k];
    sa.dlogits = dx.ptr + cuts[k];
    sa.vocab = cuts[k + 1] - cuts[k];
    sa.logits_stride = sa.dlogits_stride = V;
    return sa;
  };
  captured_equals_eager(
      [&] {
        fill(x.ptr, n, 13, -8.0f, 8.0f);
        t.upload(th);
        poison(dx), poison(loss), poison(rows), poison(am), poison(stats), poison(merged);
        settle();
      },
      [&](cudaStream_t s) {
        for (int k = 0; k < 2; ++k) {
          CrossEntropyArgs<bf16> sa = shard(k);
          sa.dlogits = nullptr;
          if (const Status st = cross_entropy_shard_stats(sa, cuts[k], V, stats.ptr + k * R, s); !st.ok()) return st;
        }
        if (const Status st = cross_entropy_merge_stats(stats.ptr, 2, R, merged.ptr, s); !st.ok()) return st;
        for (int k = 0; k < 2; ++k) {
          if (const Status st = cross_entropy_shard_finalize(shard(k), cuts[k], V, merged.ptr, s); !st.ok()) return st;
        }
        return Status();
      },
      {{dx.ptr, dx.bytes()}, {loss.ptr, loss.bytes()}, {rows.ptr, rows.bytes()}, {am.ptr, am.bytes()}});
}

TEST_CASE("cold capture: the generalised JSD on logits", "[.cold][divergence]") {
  const std::int64_t R = 128, V = 128256, n = R * V;
  DeviceBuffer<bf16> xs(n), xt(n), dx(n);
  DeviceBuffer<float> loss(1);
  DivergenceArgs<bf16> a{.student = xs.ptr, .student_input = DivergenceInput::logits, .teacher = xt.ptr,
                         .teacher_input = DivergenceInput::logits, .rows = R, .vocab = V, .dx = dx.ptr,
                         .loss = loss.ptr};
  std::size_t bytes = 0;
  TIGON_OK(divergence_workspace_bytes(a, bytes));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
  a.workspace = bytes > 0 ? ws.ptr : nullptr;
  a.workspace_bytes = bytes;
  captured_equals_eager(
      [&] {
        fill(xs.ptr, n, 12, -6.0f, 6.0f), fill(xt.ptr, n, 13, -6.0f, 6.0f);
        poison(dx), poison(loss);
        settle();
      },
      [&](cudaStream_t s) { return divergence(a, GeneralizedJSD{0.5f}, s); },
      {{dx.ptr, dx.bytes()}, {loss.ptr, loss.bytes()}});
}

TEST_CASE("cold capture: GEMM and linear cross-entropy on cuBLASLt", "[.cold][blas]") {
  const std::int64_t N = 1024, D = 1024, V = 32000;
  DeviceBuffer<unsigned char> blas_ws(std::size_t{32} << 20);
  blas_ws.poison();  // cuBLASLt's scratch (see DeviceBuffer::poison)
  CublasLtGemm blas(blas_ws.ptr, blas_ws.bytes());  // the handle: before the capture
  DeviceBuffer<bf16> x(N * D), w(V * D), dx(N * D), g(N * N);
  DeviceBuffer<float> dw(V * D), loss(1);
  DeviceBuffer<std::int64_t> t(N);
  std::vector<std::int64_t> th(N);
  for (std::int64_t i = 0; i < N; ++i) th[i] = (i * 104729) % V;
  LinearCrossEntropyArgs<bf16> c;
  c.x = x.ptr;
  c.weight = w.ptr;
  c.hidden = D;
  c.loss.targets = t.ptr;
  c.loss.rows = N;
  c.loss.vocab = V;
  c.loss.loss = loss.ptr;
  c.dx = dx.ptr;
  c.dweight = dw.ptr;
  c.chunk = 384;  // chunks of 384, 384 and 256 tokens: three shapes planned inside the capture
  std::size_t bytes = 0;
  TIGON_OK(linear_cross_entropy_workspace_bytes(c, bytes));
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(bytes, 1));
  c.workspace = ws.ptr;
  c.workspace_bytes = bytes;
  const GemmArgs<bf16> gm{.a = x.ptr, .b = x.ptr, .d = g.ptr, .m = N, .n = N, .k = D, .op_b = Op::t};
  captured_equals_eager(
      [&] {
        fill(x.ptr, N * D, 14), fill(w.ptr, V * D, 15, -0.05f, 0.05f);
        t.upload(th);
        poison(dx), poison(dw), poison(loss), poison(g);
        settle();
      },
      [&](cudaStream_t s) {
        TIGON_CHECK(blas.gemm(gm, s));
        return linear_cross_entropy(c, blas, s);
      },
      {{g.ptr, g.bytes()}, {dx.ptr, dx.bytes()}, {dw.ptr, dw.bytes()}, {loss.ptr, loss.bytes()}});
}

TEST_CASE("cold capture: the gradient clip and the AdamW step", "[.cold][adamw]") {
  const std::int64_t sizes[3] = {1000, 40003, 4096 * 16};
  std::deque<DeviceBuffer<bf16>> p, g;  // not movable: a deque keeps them in place
  std::deque<DeviceBuffer<float>> m, v;
  std::vector<AdamWTensor<bf16, float>> list;
  for (std::int64_t n : sizes) {
    p.emplace_back(n), g.emplace_back(n), m.emplace_back(n), v.emplace_back(n);
  }
  for (std::size_t i = 0; i < 3; ++i) {
    list.push_back({.param = p[i].ptr, .grad = g[i].ptr, .exp_avg = m[i].ptr, .exp_avg_sq = v[i].ptr, .numel = sizes[i]});
  }
  std::size_t bytes = 0;
  TIGON_OK(adamw_workspace_bytes(list.data(), 3, bytes));
  DeviceBuffer<unsigned char> ws(bytes);
  AdamWPlan plan;
  TIGON_OK(adamw_plan(list.data(), 3, ws.ptr, bytes, nullptr, plan));  // uploads and synchronises: before
  DeviceBuffer<unsigned char> nws(std::max<std::size_t>(grad_norm_workspace_bytes(plan), 1));
  DeviceBuffer<float> scalars(4);  // lr, step, norm, factor
  const AdamWHyper h{.weight_decay = 0.1, .lr = scalars.ptr, .step = scalars.ptr + 1, .clip_factor = scalars.ptr + 3};
  captured_equals_eager(
      [&] {
        for (std::size_t i = 0; i < 3; ++i) {
          fill(p[i].ptr, sizes[i], 20 + i), fill(g[i].ptr, sizes[i], 30 + i, -0.1f, 0.1f);
          fill(m[i].ptr, sizes[i], 40 + i, -0.01f, 0.01f), fill(v[i].ptr, sizes[i], 50 + i, 0.0f, 1e-4f);
        }
        scalars.upload({1e-3f, 5.0f, 0.0f, 0.0f});
        settle();
      },
      [&](cudaStream_t s) {
        TIGON_CHECK((grad_norm_clip<bf16, float>(plan, 1.0f, scalars.ptr + 2, scalars.ptr + 3, nws.ptr, nws.count, s)));
        return adamw_step<bf16, float>(plan, h, s);
      },
      {{p[0].ptr, p[0].bytes()}, {p[1].ptr, p[1].bytes()}, {p[2].ptr, p[2].bytes()}, {m[2].ptr, m[2].bytes()},
       {v[2].ptr, v[2].bytes()}, {scalars.ptr, scalars.bytes()}});
}
