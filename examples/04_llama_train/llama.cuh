// A LLaMA-3 decoder, forward and backward, written as a C++ trainer writes it with tigon: every
// elementwise and row op a tigon kernel, every product a GEMM through tigon's cuBLASLt back end,
// attention cuDNN's fused SDPA (sdpa.hpp). bfloat16 activations, weights and gradients; fp32 master
// weights and moments in the optimizer. All memory is allocated at construction; a step only enqueues
// work on one stream, so a CUDA graph captures the whole step.
//
// One layer, with x the residual stream entering it (N = batch * seq tokens):
//
//   h1        = RMSNorm(x; w_attn_norm)                               rms_norm_forward
//   qkv       = h1 Wqkv^T            [N, (Hq + 2 Hkv) Dh]             GEMM (q_proj || k_proj || v_proj)
//   q, k      = RoPE(q, k)           in place in qkv                  rope_forward
//   o         = causal SDPA(q, k, v) [N, Hq Dh]                       cuDNN
//   s2, h2    = x + o Wo^T, RMSNorm(s2; w_mlp_norm)                   GEMM, add_rms_norm_forward
//   gu        = h2 Wgu^T             [N, 2I]                          GEMM (gate_proj || up_proj)
//   y         = s2 + SwiGLU(gu) Wdown^T                               swiglu_forward, GEMM (residual in
//                                                                     its epilogue: C = s2, beta = 1)
//
// and the backward in reverse: the residual gradients are summed by add_rms_norm_backward, which
// takes the gradient of the stream from above (dsum) and returns the total. The model: an embedding
// gather, N layers, a final RMSNorm and tigon's linear_cross_entropy (the [N, vocab] logits never
// exist); the step ends with grad_norm_clip and tigon's AdamW.
#pragma once

#include <tigon/blas/gemm.cuh>
#include <tigon/tigon.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sdpa.hpp"

namespace llama {

using tigon::bf16;
using tigon::Status;

struct Config {
  std::int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
  std::int64_t heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int64_t batch = 0, seq = 0;
  float rms_eps = 1e-5f;
  double rope_theta = 500000.0;

  std::int64_t tokens() const { return batch * seq; }
  std::int64_t qkv_cols() const { return (heads_q + 2 * heads_kv) * head_dim; }
  std::int64_t attn_cols() const { return heads_q * head_dim; }
};

// Device allocations freed together; every buffer 256-byte aligned (cudaMalloc).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <class T>
  T* alloc(std::int64_t n) {
    void* p = nullptr;
    const std::size_t bytes = static_cast<std::size_t>(n > 0 ? n : 1) * sizeof(T);
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
      std::exit(1);
    }
    blocks_.push_back(p);
    bytes_ += bytes;
    return static_cast<T*>(p);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::vector<void*> blocks_;
  std::size_t bytes_ = 0;
};

// ------------------------------------------------------------------------------------------------
// Small kernels the model needs that are not tigon ops: embedding rows, casts, the data, the schedule
// ------------------------------------------------------------------------------------------------

__global__ void embedding_forward_kernel(const std::int64_t* tokens, const bf16* table, bf16* out,
                                         std::int64_t n, std::int64_t d) {
  for (std::int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const auto* src = reinterpret_cast<const uint4*>(table + tokens[r] * d);
    auto* dst = reinterpret_cast<uint4*>(out + r * d);
    for (std::int64_t i = threadIdx.x; i < d / 8; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void embedding_backward_kernel(const std::int64_t* tokens, const bf16* dy, float* dtable,
                                          std::int64_t n, std::int64_t d) {
  for (std::int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    float* dst = dtable + tokens[r] * d;
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(dst + i, __bfloat162float(dy[r * d + i]));
  }
}

template <class From, class To>
__global__ void cast_kernel(const From* in, To* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = tigon::from_float<To>(tigon::to_float(in[i]));
  }
}

__host__ __device__ inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The task: a synthetic language in which every token after the second is the image, under a fixed
// permutation of the vocabulary, of the token two places before it (two interleaved chains
// x, perm[x], perm[perm[x]], ...). Every target from position 1 on follows from the context, and only
// through attention to the previous position. The two starting tokens of each sequence depend on the
// seed, the step (the optimizer's device step count, so a captured graph draws a new batch every
// replay) and the sequence. One thread per chain.
__global__ void make_batch_kernel(std::int64_t* tokens, std::int64_t* targets, const std::int32_t* perm,
                                  const float* step, std::uint64_t seed, std::int64_t batch, std::int64_t seq,
                                  std::int64_t vocab) {
  const auto s = static_cast<std::uint64_t>(*step);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < 2 * batch;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t b = i / 2, first = i % 2;
    std::int64_t* tok = tokens + b * seq;
    std::int64_t* tgt = targets + b * seq;
    auto x = static_cast<std::int64_t>(mix64(seed ^ mix64(s * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(i))) %
                                       static_cast<std::uint64_t>(vocab));
    for (std::int64_t t = first; t < seq; t += 2) {
      tok[t] = x;
      if (t >= 1) tgt[t - 1] = t - 1 >= 1 ? x : -100;  // the first target (position 0's) is unknowable
      x = perm[x];
    }
    if (first == (seq - 1) % 2) tgt[seq - 1] = -100;
  }
}

// Linear warm-up to `peak`, then cosine decay to peak / 10 at `total` steps, from the device step count
// (the steps taken before this one).
__global__ void schedule_kernel(const float* step, float* lr, float peak, float warmup, float total) {
  const float s = *step + 1.0f;
  const float w = fminf(1.0f, s / warmup);
  const float progress = fminf(1.0f, fmaxf(0.0f, (s - warmup) / fmaxf(1.0f, total - warmup)));
  *lr = peak * w * (0.1f + 0.45f * (1.0f + cospif(progress)));
}

// losses[step] = *loss, the step read from the device (called before the optimizer advances it).
__global__ void record_loss_kernel(const float* loss, const float* step, float* losses, std::int64_t capacity) {
  const auto s = static_cast<std::int64_t>(*step);
  if (s < capacity) losses[s] = *loss;
}

inline int grid_for(std::int64_t n, int threads = 256) {
  return static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 4096));
}

inline Status cuda(cudaError_t e, const char* what) { return Status::from_cuda(e, "llama", what); }

// HF's rotary tables (LlamaRotaryEmbedding, default rope type): inv_freq_i = 1 / theta^(2i / Dh) and
// freqs = t * inv_freq in fp32, emb = [freqs, freqs], cos / sin of it rounded to bfloat16: [seq, Dh].
inline void rope_tables(const Config& c, std::vector<bf16>& cos_t, std::vector<bf16>& sin_t) {
  const std::int64_t dh = c.head_dim, half = dh / 2;
  cos_t.resize(c.seq * dh);
  sin_t.resize(c.seq * dh);
  for (std::int64_t t = 0; t < c.seq; ++t) {
    for (std::int64_t i = 0; i < half; ++i) {
      const float inv = 1.0f / std::pow(static_cast<float>(c.rope_theta), static_cast<float>(2 * i) / static_cast<float>(dh));
      const float f = static_cast<float>(t) * inv;
      for (std::int64_t j : {i, i + half}) {
        cos_t[t * dh + j] = tigon::from_float<bf16>(static_cast<float>(std::cos(static_cast<double>(f))));
        sin_t[t * dh + j] = tigon::from_float<bf16>(static_cast<float>(std::sin(static_cast<double>(f))));
      }
    }
  }
}

// What every layer shares: the GEMM back end, the attention graphs, the rotary tables, the
// gradient scratch (one layer's backward at a time) and the workspaces.
struct Shared {
  const Config& cfg;
  tigon::CublasLtGemm& gemm;
  CudnnSdpa sdpa;
  bf16 *cos = nullptr, *sin = nullptr;
  bf16 *tmp = nullptr, *dh = nullptr, *ds2 = nullptr, *d_o = nullptr, *dc = nullptr, *dqkv = nullptr;
  void* sdpa_ws = nullptr;
  void* norm_ws = nullptr;
  std::size_t norm_ws_bytes = 0;

  Shared(const Config& c, tigon::CublasLtGemm& g, DeviceMemory& mem)
      : cfg(c), gemm(g), sdpa(SdpaShape{c.batch, c.seq, c.heads_q, c.heads_kv, c.head_dim}) {
    const std::int64_t n = c.tokens();
    std::vector<bf16> ct, st;
    rope_tables(c, ct, st);
    cos = mem.alloc<bf16>(ct.size());
    sin = mem.alloc<bf16>(st.size());
    cudaMemcpy(cos, ct.data(), ct.size() * sizeof(bf16), cudaMemcpyHostToDevice);
    cudaMemcpy(sin, st.data(), st.size() * sizeof(bf16), cudaMemcpyHostToDevice);
    tmp = mem.alloc<bf16>(n * c.hidden);
    dh = mem.alloc<bf16>(n * c.hidden);
    ds2 = mem.alloc<bf16>(n * c.hidden);
    d_o = mem.alloc<bf16>(n * c.attn_cols());
    dc = mem.alloc<bf16>(n * c.intermediate);
    dqkv = mem.alloc<bf16>(n * c.qkv_cols());
    if (sdpa.status().ok()) sdpa_ws = mem.alloc<unsigned char>(static_cast<std::int64_t>(sdpa.workspace_bytes()));
  }

  // The norms' backward workspace: the larger of what the model's two kinds of norm backward ask for
  // (with the residual's gradient, and the final norm's plain one).
  Status size_norm_workspace(const bf16* sum, const bf16* weight, bf16* dweight, DeviceMemory& mem) {
    const std::int64_t n = cfg.tokens();
    tigon::AddRmsNormBackwardArgs<bf16> with_residual{.dy = dh, .dsum = tmp, .sum = sum, .weight = weight,
                                                      .dx = ds2, .dweight = dweight, .rows = n, .cols = cfg.hidden};
    tigon::RmsNormBackwardArgs<bf16> plain{.dy = dh, .x = sum, .weight = weight, .dx = ds2, .dweight = dweight,
                                           .rows = n, .cols = cfg.hidden};
    std::size_t a = 0, b = 0;
    TIGON_CHECK(tigon::add_rms_norm_backward_workspace_bytes(with_residual, a));
    TIGON_CHECK(tigon::rms_norm_backward_workspace_bytes(plain, b));
    norm_ws_bytes = std::max(a, b);
    norm_ws = mem.alloc<unsigned char>(static_cast<std::int64_t>(norm_ws_bytes));
    return Status{};
  }

  tigon::RopeArgs<bf16> rope(bf16* qkv) const {
    const std::int64_t row = cfg.qkv_cols();
    tigon::RopeArgs<bf16> r;
    r.q = {.in = qkv, .out = qkv, .heads = cfg.heads_q, .stride_b = cfg.seq * row, .stride_t = row,
           .stride_h = cfg.head_dim};
    bf16* k = qkv + cfg.heads_q * cfg.head_dim;
    r.k = {.in = k, .out = k, .heads = cfg.heads_kv, .stride_b = cfg.seq * row, .stride_t = row,
           .stride_h = cfg.head_dim};
    r.batch = cfg.batch;
    r.seq = cfg.seq;
    r.head_dim = cfg.head_dim;
    r.cos = cos;
    r.sin = sin;
    r.table_rows = cfg.seq;
    return r;
  }
};

// One decoder layer: its parameters, their gradients (bfloat16, written by each backward) and the
// activations its forward saves for its backward.
struct DecoderLayer {
  // Parameters, in Hugging Face's orientation ([out, in]); q/k/v and gate/up fused along rows.
  bf16 *attn_norm, *wqkv, *wo, *mlp_norm, *wgu, *wdown;
  bf16 *d_attn_norm, *d_wqkv, *d_wo, *d_mlp_norm, *d_wgu, *d_wdown;
  // Saved activations.
  bf16 *h1, *qkv, *o, *s2, *h2, *gu, *c;
  float *stats, *rstd1, *rstd2;

  DecoderLayer(const Config& cfg, DeviceMemory& mem) {
    const std::int64_t d = cfg.hidden, i = cfg.intermediate, n = cfg.tokens();
    for (auto [p, g, size] : {std::tuple{&attn_norm, &d_attn_norm, d}, std::tuple{&wqkv, &d_wqkv, cfg.qkv_cols() * d},
                              std::tuple{&wo, &d_wo, d * cfg.attn_cols()}, std::tuple{&mlp_norm, &d_mlp_norm, d},
                              std::tuple{&wgu, &d_wgu, 2 * i * d}, std::tuple{&wdown, &d_wdown, d * i}}) {
      *p = mem.alloc<bf16>(size);
      *g = mem.alloc<bf16>(size);
    }
    h1 = mem.alloc<bf16>(n * d);
    qkv = mem.alloc<bf16>(n * cfg.qkv_cols());
    o = mem.alloc<bf16>(n * cfg.attn_cols());
    s2 = mem.alloc<bf16>(n * d);
    h2 = mem.alloc<bf16>(n * d);
    gu = mem.alloc<bf16>(n * 2 * i);
    c = mem.alloc<bf16>(n * i);
    stats = mem.alloc<float>(cfg.batch * cfg.heads_q * cfg.seq);
    rstd1 = mem.alloc<float>(n);
    rstd2 = mem.alloc<float>(n);
  }

  // x [N, D] -> y [N, D] (y must not be x: the backward reads x).
  Status forward(Shared& sh, const bf16* x, bf16* y, cudaStream_t s) {
    const Config& cfg = sh.cfg;
    const std::int64_t n = cfg.tokens(), d = cfg.hidden, i = cfg.intermediate;
    TIGON_CHECK(tigon::rms_norm_forward(tigon::RmsNormForwardArgs<bf16>{.x = x, .y = h1, .weight = attn_norm,
                                                                        .rstd = rstd1, .rows = n, .cols = d,
                                                                        .eps = cfg.rms_eps},
                                        s));
    TIGON_CHECK(sh.gemm.gemm(tigon::GemmArgs<bf16>{.a = h1, .b = wqkv, .d = qkv, .m = n, .n = cfg.qkv_cols(), .k = d,
                                                   .op_b = tigon::Op::t},
                             s));
    TIGON_CHECK(tigon::rope_forward(sh.rope(qkv), s));
    TIGON_CHECK(sh.sdpa.forward(qkv, o, stats, sh.sdpa_ws, s));
    TIGON_CHECK(sh.gemm.gemm(tigon::GemmArgs<bf16>{.a = o, .b = wo, .d = sh.tmp, .m = n, .n = d, .k = cfg.attn_cols(),
                                                   .op_b = tigon::Op::t},
                             s));
    TIGON_CHECK(tigon::add_rms_norm_forward(tigon::AddRmsNormForwardArgs<bf16>{.x = sh.tmp, .residual = x, .y = h2,
                                                                               .sum = s2, .weight = mlp_norm,
                                                                               .rstd = rstd2, .rows = n, .cols = d,
                                                                               .eps = cfg.rms_eps},
                                            s));
    TIGON_CHECK(sh.gemm.gemm(tigon::GemmArgs<bf16>{.a = h2, .b = wgu, .d = gu, .m = n, .n = 2 * i, .k = d,
                                                   .op_b = tigon::Op::t},
                             s));
    TIGON_CHECK(tigon::swiglu_forward(tigon::GatedForwardArgs<bf16>{.a = gu, .b = gu + i, .c = c, .rows = n, .cols = i,
                                                                    .a_stride = 2 * i, .b_stride = 2 * i},
                                      s));
    return sh.gemm.gemm(tigon::GemmArgs<bf16>{.a = c, .b = wdown, .c = s2, .d = y, .m = n, .n = d, .k = i,
                                              .op_b = tigon::Op::t, .beta = 1.0f},
                        s);
  }

  // dy (the gradient of y) -> dx (of x); the parameter gradients overwritten. x is the forward's input;
  // dx may be dy itself. gu becomes its gradient.
  Status backward(Shared& sh, const bf16* x, const bf16* dy, bf16* dx, cudaStream_t s) {
    const Config& cfg = sh.cfg;
    const std::int64_t n = cfg.tokens(), d = cfg.hidden, i = cfg.intermediate, a = cfg.attn_cols(),
                       q3 = cfg.qkv_cols();
    using G = tigon::GemmArgs<bf16>;
    TIGON_CHECK(sh.gemm.gemm(G{.a = dy, .b = wdown, .d = sh.dc, .m = n, .n = i, .k = d}, s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = dy, .b = c, .d = d_wdown, .m = d, .n = i, .k = n, .op_a = tigon::Op::t}, s));
    TIGON_CHECK(tigon::swiglu_backward(
        tigon::GatedBackwardArgs<bf16>{.dc = sh.dc, .a = gu, .b = gu + i, .da = gu, .db = gu + i, .rows = n, .cols = i,
                                       .a_stride = 2 * i, .b_stride = 2 * i, .da_stride = 2 * i, .db_stride = 2 * i},
        s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = gu, .b = wgu, .d = sh.dh, .m = n, .n = d, .k = 2 * i}, s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = gu, .b = h2, .d = d_wgu, .m = 2 * i, .n = d, .k = n, .op_a = tigon::Op::t}, s));
    TIGON_CHECK(tigon::add_rms_norm_backward(
        tigon::AddRmsNormBackwardArgs<bf16>{.dy = sh.dh, .dsum = dy, .sum = s2, .weight = mlp_norm, .rstd = rstd2,
                                            .dx = sh.ds2, .dweight = d_mlp_norm, .rows = n, .cols = d,
                                            .workspace = sh.norm_ws, .workspace_bytes = sh.norm_ws_bytes},
        s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = sh.ds2, .b = wo, .d = sh.d_o, .m = n, .n = a, .k = d}, s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = sh.ds2, .b = o, .d = d_wo, .m = d, .n = a, .k = n, .op_a = tigon::Op::t}, s));
    TIGON_CHECK(sh.sdpa.backward(qkv, o, sh.d_o, stats, sh.dqkv, sh.sdpa_ws, s));
    TIGON_CHECK(tigon::rope_backward(sh.rope(sh.dqkv), s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = sh.dqkv, .b = wqkv, .d = sh.dh, .m = n, .n = d, .k = q3}, s));
    TIGON_CHECK(sh.gemm.gemm(G{.a = sh.dqkv, .b = h1, .d = d_wqkv, .m = q3, .n = d, .k = n, .op_a = tigon::Op::t}, s));
    return tigon::add_rms_norm_backward(
        tigon::AddRmsNormBackwardArgs<bf16>{.dy = sh.dh, .dsum = sh.ds2, .sum = x, .weight = attn_norm, .rstd = rstd1,
                                            .dx = dx, .dweight = d_attn_norm, .rows = n, .cols = d,
                                            .workspace = sh.norm_ws, .workspace_bytes = sh.norm_ws_bytes},
        s);
  }

  // (name, parameter, gradient, element count) in Hugging Face's state-dict order; q/k/v and gate/up
  // are the fused tensors "qkv_proj" and "gate_up_proj".
  template <class F>
  void for_each_param(const Config& cfg, const std::string& prefix, F&& f) {
    const std::int64_t d = cfg.hidden, i = cfg.intermediate;
    f(prefix + "input_layernorm.weight", attn_norm, d_attn_norm, d);
    f(prefix + "self_attn.qkv_proj.weight", wqkv, d_wqkv, cfg.qkv_cols() * d);
    f(prefix + "self_attn.o_proj.weight", wo, d_wo, d * cfg.attn_cols());
    f(prefix + "post_attention_layernorm.weight", mlp_norm, d_mlp_norm, d);
    f(prefix + "mlp.gate_up_proj.weight", wgu, d_wgu, 2 * i * d);
    f(prefix + "mlp.down_proj.weight", wdown, d_wdown, d * i);
  }
};

// The whole model and its optimizer.
struct Model {
  struct Optim {
    float peak_lr = 3e-3f, warmup = 20.0f, total = 400.0f, max_grad_norm = 1.0f;
    double beta1 = 0.9, beta2 = 0.95, weight_decay = 0.01;
  };

  const Config cfg;
  DeviceMemory mem;
  tigon::CublasLtGemm& gemm;
  Shared shared;
  std::vector<DecoderLayer> layers;
  bf16 *embed, *final_norm, *lm_head;
  bf16 *d_embed, *d_final_norm, *d_lm_head;
  float* d_embed_f32;
  std::vector<bf16*> hidden;  // hidden[l]: the stream entering layer l; hidden[layers]: the last layer's output
  bf16 *h_final, *g_a, *g_b;
  float *rstd_final, *loss;
  std::int64_t *tokens, *targets;
  // The head writes dW in bf16 (G = bf16: each chunk's GEMM adds into it and rounds once).
  tigon::LinearCrossEntropyArgs<bf16, std::int64_t, bf16> head;
  // The optimizer: fp32 masters and moments, the plan, the device scalars.
  tigon::AdamWPlan plan;
  float *step, *lr, *grad_norm, *clip, *losses;
  void *plan_ws = nullptr, *clip_ws = nullptr;
  std::size_t plan_ws_bytes = 0, clip_ws_bytes = 0;
  std::int64_t loss_capacity = 0;
  std::int32_t* perm = nullptr;  // the task's permutation of the vocabulary
  std::uint64_t seed = 0;
  Optim optim;

  Model(const Config& c, tigon::CublasLtGemm& g, std::int64_t max_steps, std::uint64_t data_seed)
      : cfg(c), gemm(g), shared(cfg, g, mem), loss_capacity(max_steps), seed(data_seed) {
    const std::int64_t n = cfg.tokens(), d = cfg.hidden, v = cfg.vocab;
    layers.reserve(cfg.layers);
    for (std::int64_t l = 0; l < cfg.layers; ++l) layers.emplace_back(cfg, mem);
    embed = mem.alloc<bf16>(v * d);
    final_norm = mem.alloc<bf16>(d);
    lm_head = mem.alloc<bf16>(v * d);
    d_embed = mem.alloc<bf16>(v * d);
    d_final_norm = mem.alloc<bf16>(d);
    d_lm_head = mem.alloc<bf16>(v * d);
    d_embed_f32 = mem.alloc<float>(v * d);
    for (std::int64_t l = 0; l <= cfg.layers; ++l) hidden.push_back(mem.alloc<bf16>(n * d));
    h_final = mem.alloc<bf16>(n * d);
    g_a = mem.alloc<bf16>(n * d);
    g_b = mem.alloc<bf16>(n * d);
    rstd_final = mem.alloc<float>(n);
    loss = mem.alloc<float>(1);
    tokens = mem.alloc<std::int64_t>(n);
    targets = mem.alloc<std::int64_t>(n);
    perm = mem.alloc<std::int32_t>(v);
    {
      std::vector<std::int32_t> host(static_cast<std::size_t>(v));
      for (std::int64_t i = 0; i < v; ++i) host[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
      std::mt19937_64 gen(data_seed);
      std::shuffle(host.begin(), host.end(), gen);
      cudaMemcpy(perm, host.data(), host.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
    }
    step = mem.alloc<float>(1);
    lr = mem.alloc<float>(1);
    grad_norm = mem.alloc<float>(1);
    clip = mem.alloc<float>(1);
    losses = mem.alloc<float>(max_steps);
    head.x = h_final;
    head.weight = lm_head;
    head.hidden = d;
    head.loss.targets = targets;
    head.loss.rows = n;
    head.loss.vocab = v;
    head.loss.loss = loss;  // mean over the targets that are not ignored
    head.dx = g_a;
    head.dweight = d_lm_head;
  }

  template <class F>
  void for_each_param(F&& f) {
    f(std::string("model.embed_tokens.weight"), embed, d_embed, cfg.vocab * cfg.hidden);
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      layers[static_cast<std::size_t>(l)].for_each_param(cfg, "model.layers." + std::to_string(l) + ".", f);
    }
    f(std::string("model.norm.weight"), final_norm, d_final_norm, cfg.hidden);
    f(std::string("lm_head.weight"), lm_head, d_lm_head, cfg.vocab * cfg.hidden);
  }

  // Hugging Face's initialisation: weights N(0, 0.02), norms 1; then the optimizer's plan (fp32
  // masters from the weights, zero moments, step 0). Outside any capture.
  Status init(std::uint64_t init_seed, cudaStream_t s) {
    TIGON_CHECK(shared.sdpa.status());
    TIGON_CHECK(shared.size_norm_workspace(layers[0].s2, layers[0].mlp_norm, layers[0].d_mlp_norm, mem));
    std::mt19937_64 gen(init_seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<tigon::AdamWTensor<bf16, float>> list;
    Status st;
    for_each_param([&](const std::string& name, bf16* p, bf16* grad, std::int64_t numel) {
      std::vector<bf16> host(static_cast<std::size_t>(numel));
      const bool norm = name.find("norm") != std::string::npos;
      for (auto& e : host) e = tigon::from_float<bf16>(norm ? 1.0f : normal(gen));
      cudaMemcpy(p, host.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice);
      tigon::AdamWTensor<bf16, float> t;
      t.param = p;
      t.grad = grad;
      t.exp_avg = mem.alloc<float>(numel);
      t.exp_avg_sq = mem.alloc<float>(numel);
      t.master = mem.alloc<float>(numel);
      cudaMemsetAsync(t.exp_avg, 0, numel * sizeof(float), s);
      cudaMemsetAsync(t.exp_avg_sq, 0, numel * sizeof(float), s);
      cast_kernel<bf16, float><<<grid_for(numel), 256, 0, s>>>(p, t.master, numel);
      t.numel = numel;
      list.push_back(t);
    });
    TIGON_CHECK(cuda(cudaGetLastError(), "init"));
    TIGON_CHECK(cuda(cudaMemsetAsync(step, 0, sizeof(float), s), "cudaMemsetAsync"));
    TIGON_CHECK(cuda(cudaMemsetAsync(losses, 0, loss_capacity * sizeof(float), s), "cudaMemsetAsync"));
    TIGON_CHECK(tigon::adamw_workspace_bytes(list.data(), static_cast<int>(list.size()), plan_ws_bytes));
    plan_ws = mem.alloc<unsigned char>(static_cast<std::int64_t>(plan_ws_bytes));
    TIGON_CHECK(tigon::adamw_plan(list.data(), static_cast<int>(list.size()), plan_ws, plan_ws_bytes, s, plan));
    clip_ws_bytes = tigon::grad_norm_workspace_bytes(plan);
    clip_ws = mem.alloc<unsigned char>(static_cast<std::int64_t>(clip_ws_bytes));
    std::size_t head_ws = 0;
    TIGON_CHECK(tigon::linear_cross_entropy_workspace_bytes(head, head_ws));
    head.workspace = mem.alloc<unsigned char>(static_cast<std::int64_t>(head_ws));
    head.workspace_bytes = head_ws;
    return Status{};
  }

  // The batch of this step, forward, loss, backward: every gradient written (none accumulated).
  Status forward_backward(cudaStream_t s) {
    const std::int64_t n = cfg.tokens(), d = cfg.hidden, v = cfg.vocab;
    make_batch_kernel<<<grid_for(2 * cfg.batch, 64), 64, 0, s>>>(tokens, targets, perm, step, seed, cfg.batch, cfg.seq,
                                                                   v);
    embedding_forward_kernel<<<static_cast<int>(std::min<std::int64_t>(n, 4096)), 128, 0, s>>>(tokens, embed,
                                                                                                 hidden[0], n, d);
    TIGON_CHECK(cuda(cudaGetLastError(), "embedding_forward"));
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      TIGON_CHECK(layers[static_cast<std::size_t>(l)].forward(shared, hidden[l], hidden[l + 1], s));
    }
    TIGON_CHECK(tigon::rms_norm_forward(tigon::RmsNormForwardArgs<bf16>{.x = hidden[cfg.layers], .y = h_final,
                                                                        .weight = final_norm, .rstd = rstd_final,
                                                                        .rows = n, .cols = d, .eps = cfg.rms_eps},
                                        s));
    TIGON_CHECK(tigon::linear_cross_entropy(head, gemm, s));  // loss, dh_final into g_a, dW_head
    tigon::RmsNormBackwardArgs<bf16> nb{.dy = g_a, .x = hidden[cfg.layers], .weight = final_norm, .rstd = rstd_final,
                                        .dx = g_b, .dweight = d_final_norm, .rows = n, .cols = d};
    nb.workspace = shared.norm_ws;
    nb.workspace_bytes = shared.norm_ws_bytes;
    TIGON_CHECK(tigon::rms_norm_backward(nb, s));
    bf16 *g = g_b, *other = g_a;
    for (std::int64_t l = cfg.layers - 1; l >= 0; --l) {
      TIGON_CHECK(layers[static_cast<std::size_t>(l)].backward(shared, hidden[l], g, other, s));
      std::swap(g, other);
    }
    TIGON_CHECK(cuda(cudaMemsetAsync(d_embed_f32, 0, v * d * sizeof(float), s), "cudaMemsetAsync"));
    embedding_backward_kernel<<<static_cast<int>(std::min<std::int64_t>(n, 4096)), 128, 0, s>>>(tokens, g, d_embed_f32,
                                                                                                  n, d);
    cast_kernel<float, bf16><<<grid_for(v * d), 256, 0, s>>>(d_embed_f32, d_embed, v * d);
    return cuda(cudaGetLastError(), "embedding_backward");
  }

  // The optimizer's part of the step: the loss recorded, the learning rate of this step, the clip
  // factor, AdamW (which advances the device step count).
  Status update(cudaStream_t s) {
    record_loss_kernel<<<1, 1, 0, s>>>(loss, step, losses, loss_capacity);
    schedule_kernel<<<1, 1, 0, s>>>(step, lr, optim.peak_lr, optim.warmup, optim.total);
    TIGON_CHECK(cuda(cudaGetLastError(), "schedule"));
    TIGON_CHECK((tigon::grad_norm_clip<bf16, float>(plan, optim.max_grad_norm, grad_norm, clip, clip_ws, clip_ws_bytes, s)));
    tigon::AdamWHyper h;
    h.beta1 = optim.beta1;
    h.beta2 = optim.beta2;
    h.weight_decay = optim.weight_decay;
    h.lr = lr;
    h.step = step;
    h.clip_factor = clip;
    return tigon::adamw_step<bf16, float>(plan, h, s);
  }

  Status train_step(cudaStream_t s) {
    TIGON_CHECK(forward_backward(s));
    return update(s);
  }
};

}  // namespace llama
