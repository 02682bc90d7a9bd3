// Causal scaled-dot-product attention, forward and backward, through cuDNN's fused SDPA (built with
// NVIDIA's cudnn-frontend graph API), on the layouts a LLaMA layer produces without a copy:
//
//   qkv   [batch, seq, heads_q + 2 * heads_kv, head_dim]  the QKV GEMM's output: q heads, k heads, v heads
//   o     [batch, seq, heads_q, head_dim]                 the O GEMM's input
//   stats [batch, heads_q, seq] fp32                      the softmax statistics the backward reads
//   dqkv  like qkv                                        dq, dk, dv, ready for the QKV GEMMs' backward
//
// heads_q a multiple of heads_kv (grouped-query attention), bfloat16, scale 1 / sqrt(head_dim), the
// causal mask aligned top-left (query t sees keys 0..t). Both graphs are built once, at construction
// (outside any capture); forward() and backward() only enqueue work on the stream, with the caller's
// workspace, so a CUDA graph can capture them. This file is the only one that includes the frontend,
// and it compiles as host C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include <tigon/core/status.hpp>

namespace llama {

struct SdpaShape {
  std::int64_t batch = 0, seq = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
};

class CudnnSdpa {
 public:
  explicit CudnnSdpa(const SdpaShape& shape);  // builds both graphs; status() says whether it could
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  const tigon::Status& status() const;
  std::size_t workspace_bytes() const;  // the larger of the two graphs' needs (16-byte aligned memory)

  [[nodiscard]] tigon::Status forward(const void* qkv, void* o, float* stats, void* workspace, cudaStream_t s);
  [[nodiscard]] tigon::Status backward(const void* qkv, const void* o, const void* d_o, const float* stats,
                                       void* dqkv, void* workspace, cudaStream_t s);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace llama
