// A LLaMA-3 model trained from C++ with tigon (llama.cuh): the whole step (batch, forward, loss,
// backward, clip, AdamW) captured once in a CUDA graph and replayed.
//
//   example_llama_train [--steps S] [--dump DIR [--first-step-only]]
//                                                  train a small model on a synthetic language
//   example_llama_train --bench-layer              one decoder layer at LLaMA-3-8B's shapes
//
// Training: 4 layers, hidden 256, 8 query / 2 key-value heads of 64, vocabulary 512, 8 sequences of
// 256 tokens of a synthetic language in which each token is a fixed permutation's image of the token
// two places before it (llama.cuh's make_batch_kernel), so predicting it takes attention to the
// previous position; AdamW (peak learning rate 3e-3, warm-up 20 steps, cosine decay), 400 steps by
// default. The run passes when the mean loss of the last 20 steps is below a quarter of the first
// step's. --dump DIR writes the first step's weights, batch, loss and gradients for reference.py,
// which runs Hugging Face's LlamaForCausalLM on the same weights (--first-step-only: then stops).
//
// --bench-layer: forward and backward of one layer (hidden 4096, 32 / 8 heads of 128, intermediate
// 14336; batch 1, sequence 4096), eager and replayed from a graph, medians of 20 timed with events.
//
// Without a GPU it says so and exits 77 (ctest: skipped).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "llama.cuh"

namespace {

using llama::bf16;

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                      \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
#define CHECK_TIGON(expr)                                       \
  do {                                                          \
    const tigon::Status s_ = (expr);                            \
    if (!s_.ok()) {                                             \
      std::fprintf(stderr, "%s\n", s_.message().c_str());       \
      std::exit(1);                                             \
    }                                                           \
  } while (0)

template <class T>
void write_file(const std::filesystem::path& path, const T* device, std::int64_t n) {
  std::vector<T> host(static_cast<std::size_t>(n));
  CHECK_CUDA(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(host.data()), static_cast<std::streamsize>(host.size() * sizeof(T)));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

void write_config(const std::filesystem::path& dir, const llama::Config& c, float loss) {
  std::ofstream f(dir / "config.json");
  f.precision(9);
  f << "{\n"
    << "  \"vocab_size\": " << c.vocab << ",\n"
    << "  \"hidden_size\": " << c.hidden << ",\n"
    << "  \"intermediate_size\": " << c.intermediate << ",\n"
    << "  \"num_hidden_layers\": " << c.layers << ",\n"
    << "  \"num_attention_heads\": " << c.heads_q << ",\n"
    << "  \"num_key_value_heads\": " << c.heads_kv << ",\n"
    << "  \"head_dim\": " << c.head_dim << ",\n"
    << "  \"rms_norm_eps\": " << c.rms_eps << ",\n"
    << "  \"rope_theta\": " << c.rope_theta << ",\n"
    << "  \"batch\": " << c.batch << ",\n"
    << "  \"seq\": " << c.seq << ",\n"
    << "  \"loss\": " << loss << "\n"
    << "}\n";
}

// Weights (as they were when the step began), the batch, the loss and the gradients the optimizer
// is handed, as raw little-endian files named after Hugging Face's parameters.
void dump_first_step(const std::filesystem::path& dir, llama::Model& m, const std::vector<std::vector<bf16>>& weights) {
  std::filesystem::create_directories(dir / "grad");
  std::size_t i = 0;
  m.for_each_param([&](const std::string& name, bf16*, bf16* grad, std::int64_t numel) {
    std::ofstream f(dir / (name + ".bin"), std::ios::binary);
    f.write(reinterpret_cast<const char*>(weights[i++].data()), static_cast<std::streamsize>(numel * sizeof(bf16)));
    write_file(dir / "grad" / (name + ".bin"), grad, numel);
  });
  write_file(dir / "tokens.bin", m.tokens, m.cfg.tokens());
  write_file(dir / "targets.bin", m.targets, m.cfg.tokens());
  float loss = 0;
  CHECK_CUDA(cudaMemcpy(&loss, m.loss, sizeof(float), cudaMemcpyDeviceToHost));
  write_config(dir, m.cfg, loss);
}

int train(int steps, const char* dump_dir, bool first_step_only, tigon::CublasLtGemm& gemm, cudaStream_t s) {
  llama::Config cfg;
  cfg.vocab = 512;
  cfg.hidden = 256;
  cfg.intermediate = 768;
  cfg.layers = 4;
  cfg.heads_q = 8;
  cfg.heads_kv = 2;
  cfg.head_dim = 64;
  cfg.batch = 8;
  cfg.seq = 256;
  cfg.rope_theta = 10000.0;
  llama::Model m(cfg, gemm, steps, /*data_seed=*/0x5eed);
  m.optim.total = static_cast<float>(steps);
  CHECK_TIGON(m.init(/*init_seed=*/1234, s));
  std::printf("model: %lld layers, hidden %lld, heads %lld / %lld x %lld, vocabulary %lld; %lld tokens a step; "
              "%.1f MB of device memory\n",
              static_cast<long long>(cfg.layers), static_cast<long long>(cfg.hidden),
              static_cast<long long>(cfg.heads_q), static_cast<long long>(cfg.heads_kv),
              static_cast<long long>(cfg.head_dim), static_cast<long long>(cfg.vocab),
              static_cast<long long>(cfg.tokens()), m.mem.bytes() / 1e6);

  // Step 1, eager (it also selects the GEMM algorithms); its gradients dumped before the update.
  std::vector<std::vector<bf16>> weights;
  if (dump_dir != nullptr) {
    m.for_each_param([&](const std::string&, bf16* p, bf16*, std::int64_t numel) {
      weights.emplace_back(static_cast<std::size_t>(numel));
      CHECK_CUDA(cudaMemcpy(weights.back().data(), p, numel * sizeof(bf16), cudaMemcpyDeviceToHost));
    });
  }
  CHECK_TIGON(m.forward_backward(s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  if (dump_dir != nullptr) {
    dump_first_step(dump_dir, m, weights);
    std::printf("first step written to %s\n", dump_dir);
    if (first_step_only) return 0;
  }
  CHECK_TIGON(m.update(s));

  // Steps 2..S: one graph of the whole step, replayed.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const tigon::Status captured = m.train_step(s);
  CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  CHECK_TIGON(captured);
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a, s));
  for (int i = 1; i < steps; ++i) CHECK_CUDA(cudaGraphLaunch(exec, s));
  CHECK_CUDA(cudaEventRecord(b, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));

  std::vector<float> losses(static_cast<std::size_t>(steps));
  CHECK_CUDA(cudaMemcpy(losses.data(), m.losses, losses.size() * sizeof(float), cudaMemcpyDeviceToHost));
  float norm = 0;
  CHECK_CUDA(cudaMemcpy(&norm, m.grad_norm, sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < steps; i += std::max(1, steps / 12)) std::printf("  step %4d  loss %.4f\n", i + 1, losses[i]);
  const int tail = std::min(20, steps);
  double last = 0;
  for (int i = steps - tail; i < steps; ++i) last += losses[static_cast<std::size_t>(i)];
  last /= tail;
  const bool finite = std::all_of(losses.begin(), losses.end(), [](float v) { return std::isfinite(v); });
  std::printf("loss: first step %.4f, mean of the last %d steps %.4f; last gradient norm %.3f; %d graph replays "
              "in %.1f ms (%.3f ms a step)\n",
              losses[0], tail, last, norm, steps - 1, ms, ms / std::max(1, steps - 1));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  if (!finite || !(last < 0.25 * losses[0])) {
    std::printf("FAILED: the loss did not fall below a quarter of its first value\n");
    return 1;
  }
  std::printf("PASSED\n");
  return 0;
}

__global__ void fill_kernel(bf16* p, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t z = llama::mix64(seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(i));
    p[i] = __float2bfloat16_rn(scale * ((static_cast<float>(z >> 40) / 16777216.0f) - 0.5f) * 3.4641f);
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5f * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

int bench_layer(tigon::CublasLtGemm& gemm, cudaStream_t s) {
  llama::Config cfg;
  cfg.hidden = 4096;
  cfg.intermediate = 14336;
  cfg.layers = 1;
  cfg.heads_q = 32;
  cfg.heads_kv = 8;
  cfg.head_dim = 128;
  cfg.batch = 1;
  cfg.seq = 4096;
  llama::DeviceMemory mem;
  llama::Shared sh(cfg, gemm, mem);
  CHECK_TIGON(sh.sdpa.status());
  llama::DecoderLayer layer(cfg, mem);
  CHECK_TIGON(sh.size_norm_workspace(layer.s2, layer.mlp_norm, layer.d_mlp_norm, mem));
  const std::int64_t n = cfg.tokens(), d = cfg.hidden;
  bf16* x = mem.alloc<bf16>(n * d);
  bf16* y = mem.alloc<bf16>(n * d);
  bf16* dy = mem.alloc<bf16>(n * d);
  bf16* dx = mem.alloc<bf16>(n * d);
  std::uint64_t seed = 1;
  layer.for_each_param(cfg, "", [&](const std::string& name, bf16* p, bf16*, std::int64_t numel) {
    const bool norm = name.find("norm") != std::string::npos;
    fill_kernel<<<1024, 256, 0, s>>>(p, numel, seed++, norm ? 0.1f : 0.02f);
  });
  fill_kernel<<<1024, 256, 0, s>>>(x, n * d, 101, 1.0f);
  fill_kernel<<<1024, 256, 0, s>>>(dy, n * d, 102, 1.0f);
  CHECK_CUDA(cudaGetLastError());
  for (int i = 0; i < 3; ++i) {  // warm-up: cuBLASLt plans, cuDNN graphs
    CHECK_TIGON(layer.forward(sh, x, y, s));
    CHECK_TIGON(layer.backward(sh, x, dy, dx, s));
  }
  cudaEvent_t e0, e1, e2;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventCreate(&e2));
  std::vector<float> fwd, bwd, graph_ms;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, s));
    CHECK_TIGON(layer.forward(sh, x, y, s));
    CHECK_CUDA(cudaEventRecord(e1, s));
    CHECK_TIGON(layer.backward(sh, x, dy, dx, s));
    CHECK_CUDA(cudaEventRecord(e2, s));
    CHECK_CUDA(cudaEventSynchronize(e2));
    float f = 0, b = 0;
    CHECK_CUDA(cudaEventElapsedTime(&f, e0, e1));
    CHECK_CUDA(cudaEventElapsedTime(&b, e1, e2));
    fwd.push_back(f);
    bwd.push_back(b);
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const tigon::Status f_st = layer.forward(sh, x, y, s);
  const tigon::Status b_st = f_st.ok() ? layer.backward(sh, x, dy, dx, s) : f_st;
  CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  CHECK_TIGON(b_st);
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, s));
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, s));
    CHECK_CUDA(cudaGraphLaunch(exec, s));
    CHECK_CUDA(cudaEventRecord(e1, s));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    graph_ms.push_back(t);
  }
  const double nd = static_cast<double>(n);
  const double gemm_fwd = 2.0 * nd * d * (cfg.qkv_cols() + cfg.attn_cols() + 3.0 * cfg.intermediate);
  // Causal attention: half of the 4 * b * h * t^2 * dh of QK^T and PV forward; the backward's 2.5x.
  const double attn_fwd = 2.0 * cfg.batch * cfg.heads_q * static_cast<double>(cfg.seq) * cfg.seq * cfg.head_dim;
  const double f = median(fwd), b = median(bwd), g = median(graph_ms);
  std::printf("decoder layer, hidden %lld, heads %lld / %lld x %lld, intermediate %lld, batch %lld x seq %lld, "
              "bf16 (medians of 20):\n",
              static_cast<long long>(d), static_cast<long long>(cfg.heads_q), static_cast<long long>(cfg.heads_kv),
              static_cast<long long>(cfg.head_dim), static_cast<long long>(cfg.intermediate),
              static_cast<long long>(cfg.batch), static_cast<long long>(cfg.seq));
  std::printf("  forward  %.3f ms (%.0f TFLOP/s)\n", f, (gemm_fwd + attn_fwd) / (f * 1e-3) / 1e12);
  std::printf("  backward %.3f ms (%.0f TFLOP/s)\n", b, (2 * gemm_fwd + 2.5 * attn_fwd) / (b * 1e-3) / 1e12);
  std::printf("  forward + backward %.3f ms eager, %.3f ms as one graph; %.0f MB of device memory\n", f + b, g,
              mem.bytes() / 1e6);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 400;
  const char* dump_dir = nullptr;
  bool bench = false, first_step_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--dump") && i + 1 < argc) {
      dump_dir = argv[++i];
    } else if (!std::strcmp(argv[i], "--first-step-only")) {
      first_step_only = true;
    } else if (!std::strcmp(argv[i], "--bench-layer")) {
      bench = true;
    } else {
      std::fprintf(stderr, "usage: %s [--steps S] [--dump DIR [--first-step-only]] | --bench-layer\n", argv[0]);
      return 2;
    }
  }
  if (steps < 2) {
    std::fprintf(stderr, "--steps must be at least 2\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA GPU here: built, not run\n");
    return 77;
  }
  cudaStream_t s;
  // A blocking stream: the set-up's synchronous cudaMemcpy calls (legacy stream) are ordered before its work.
  CHECK_CUDA(cudaStreamCreate(&s));
  const std::size_t ws_bytes = 64u << 20;  // cuBLASLt's workspace
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  int rc = 0;
  {
    tigon::CublasLtGemm gemm(ws, ws_bytes);
    CHECK_TIGON(gemm.status());
    rc = bench ? bench_layer(gemm, s) : train(steps, dump_dir, first_step_only, gemm, s);
  }
  cudaFree(ws);
  cudaStreamDestroy(s);
  return rc;
}
