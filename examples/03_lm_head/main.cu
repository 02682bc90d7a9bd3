// The LM head of a training step as a C++ trainer writes it: the final hidden states go through
// the vocabulary projection and the cross-entropy loss in one call, in chunks of tokens, so the
// [tokens x vocabulary] logits never exist; the call returns the loss and the gradients of the
// hidden states (for the backward through the model) and of the head's weight (fp32, for the
// optimizer). Shape: LLaMA-3-8B's head (hidden 4096, vocabulary 128256), 8192 tokens.
// Without a GPU it says so and exits 77 (ctest: skipped).
#include <tigon/loss/linear_cross_entropy.cuh>

#include <cstdio>
#include <vector>

#define CHECK_CUDA(expr)                                                        \
  do {                                                                          \
    const cudaError_t e_ = (expr);                                              \
    if (e_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));          \
      return 1;                                                                 \
    }                                                                           \
  } while (0)
#define CHECK_TIGON(expr)                                     \
  do {                                                        \
    const tigon::Status s_ = (expr);                          \
    if (!s_.ok()) {                                           \
      std::fprintf(stderr, "%s\n", s_.message().c_str());     \
      return 1;                                               \
    }                                                         \
  } while (0)

__global__ void fill(tigon::bf16* p, std::size_t n, unsigned seed, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned z = static_cast<unsigned>(i) * 2654435761u ^ seed;
    z ^= z >> 15;
    z *= 2246822519u;
    z ^= z >> 13;
    p[i] = __float2bfloat16_rn(scale * (static_cast<float>(z & 0xFFFF) / 65536.0f - 0.5f));
  }
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA GPU here: built, not run\n");
    return 77;
  }
  using tigon::bf16;
  const std::int64_t tokens = 8192, hidden = 4096, vocab = 128256;

  bf16 *h, *w, *dh;
  float *dw, *loss;
  std::int64_t* labels;
  CHECK_CUDA(cudaMalloc(&h, tokens * hidden * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&w, vocab * hidden * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&dh, tokens * hidden * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&dw, vocab * hidden * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&loss, sizeof(float)));
  CHECK_CUDA(cudaMalloc(&labels, tokens * sizeof(std::int64_t)));
  fill<<<1024, 256>>>(h, tokens * hidden, 1, 4.0f);
  fill<<<1024, 256>>>(w, vocab * hidden, 2, 0.05f);
  std::vector<std::int64_t> y(tokens);
  for (std::int64_t i = 0; i < tokens; ++i) y[i] = i % 50 == 0 ? -100 : (i * 7919) % vocab;  // some padding
  CHECK_CUDA(cudaMemcpy(labels, y.data(), tokens * sizeof(std::int64_t), cudaMemcpyHostToDevice));

  // The GEMM back end: created once, reused by every step.
  void* gemm_ws = nullptr;
  CHECK_CUDA(cudaMalloc(&gemm_ws, 32u << 20));
  tigon::CublasLtGemm blas(gemm_ws, 32u << 20);
  CHECK_TIGON(blas.status());

  tigon::LinearCrossEntropyArgs<bf16> head;
  head.x = h;
  head.weight = w;
  head.hidden = hidden;
  head.loss.targets = labels;
  head.loss.rows = tokens;
  head.loss.vocab = vocab;
  head.loss.loss = loss;  // mean over the non-padding tokens
  head.dx = dh;           // into the backward of the last decoder layer
  head.dweight = dw;      // fp32, for the optimizer
  std::size_t bytes = 0;
  CHECK_TIGON(tigon::linear_cross_entropy_workspace_bytes(head, bytes));
  CHECK_CUDA(cudaMalloc(&head.workspace, bytes));
  head.workspace_bytes = bytes;

  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  CHECK_TIGON(tigon::linear_cross_entropy(head, blas, nullptr));  // warm-up: algorithm selection
  cudaEventRecord(a);
  CHECK_TIGON(tigon::linear_cross_entropy(head, blas, nullptr));
  cudaEventRecord(b);
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  float l = 0;
  CHECK_CUDA(cudaMemcpy(&l, loss, sizeof(float), cudaMemcpyDeviceToHost));
  const double flop = 6.0 * tokens * hidden * vocab;
  std::printf("LM head, %lld tokens, hidden %lld, vocabulary %lld: loss %.4f, forward + backward %.2f ms "
              "(%.0f TFLOP/s), extra memory %.0f MB instead of %.0f MB of fp32 logits\n",
              static_cast<long long>(tokens), static_cast<long long>(hidden), static_cast<long long>(vocab), l,
              ms, flop / (ms * 1e-3) / 1e12, bytes / 1e6, tokens * vocab * 4.0 / 1e6);
  const bool ok = l == l && l > 0;  // finite and positive
  for (void* p : {(void*)h, (void*)w, (void*)dh, (void*)dw, (void*)loss, (void*)labels, gemm_ws, head.workspace})
    cudaFree(p);
  return ok ? 0 : 1;
}
