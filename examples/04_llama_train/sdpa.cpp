// cuDNN's fused attention through cudnn-frontend: see sdpa.hpp.
#include "sdpa.hpp"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace llama {
namespace {

namespace fe = cudnn_frontend;

enum Uid : std::int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

tigon::Status fe_error(fe::error_t e, const char* what) {
  return tigon::Status::error(tigon::Errc::unsupported, "cudnn_sdpa", what, e.get_message());
}

}  // namespace

struct CudnnSdpa::Impl {
  // Declared before the graphs, so destroyed after their execution plans.
  struct Handle {
    cudnnHandle_t h = nullptr;
    ~Handle() {
      if (h != nullptr) cudnnDestroy(h);
    }
  } owner;
  cudnnHandle_t handle = nullptr;
  SdpaShape shape;
  fe::graph::Graph fwd, bwd;
  std::int64_t fwd_ws = 0, bwd_ws = 0;
  tigon::Status status;

  // Element strides of one head's [batch, heads, seq, head_dim] view of a [batch, seq, heads_total,
  // head_dim] buffer.
  std::vector<std::int64_t> strides(std::int64_t heads_total) const {
    const std::int64_t row = heads_total * shape.head_dim;
    return {shape.seq * row, shape.head_dim, row, 1};
  }

  std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                       std::int64_t heads, std::int64_t heads_total) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({shape.batch, heads, shape.seq, shape.head_dim})
                        .set_stride(strides(heads_total)));
  }

  tigon::Status build() {
    if (cudnnCreate(&owner.h) != CUDNN_STATUS_SUCCESS) {
      return tigon::Status::error(tigon::Errc::unsupported, "cudnn_sdpa", "cudnnCreate",
                                  "cuDNN could not be initialised on this device");
    }
    handle = owner.h;
    const std::int64_t hq = shape.heads_q, hkv = shape.heads_kv, total = hq + 2 * hkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    const std::vector<std::int64_t> stats_dim{shape.batch, hq, shape.seq, 1};
    const std::vector<std::int64_t> stats_stride{hq * shape.seq, shape.seq, 1, 1};
    for (fe::graph::Graph* g : {&fwd, &bwd}) {
      g->set_io_data_type(fe::DataType_t::BFLOAT16)
          .set_intermediate_data_type(fe::DataType_t::FLOAT)
          .set_compute_data_type(fe::DataType_t::FLOAT);
    }
    {
      auto q = tensor(fwd, "q", kQ, hq, total), k = tensor(fwd, "k", kK, hkv, total),
           v = tensor(fwd, "v", kV, hkv, total);
      auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_causal_mask(true)
                       .set_attn_scale(scale);
      auto [o, stats] = fwd.sdpa(q, k, v, attrs);
      o->set_output(true).set_uid(kO).set_dim({shape.batch, hq, shape.seq, shape.head_dim}).set_stride(strides(hq));
      stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim)
          .set_stride(stats_stride);
    }
    {
      auto q = tensor(bwd, "q", kQ, hq, total), k = tensor(bwd, "k", kK, hkv, total),
           v = tensor(bwd, "v", kV, hkv, total), o = tensor(bwd, "o", kO, hq, hq),
           d_o = tensor(bwd, "do", kDO, hq, hq);
      auto stats = bwd.tensor(fe::graph::Tensor_attributes()
                                  .set_name("stats")
                                  .set_uid(kStats)
                                  .set_dim(stats_dim)
                                  .set_stride(stats_stride)
                                  .set_data_type(fe::DataType_t::FLOAT));
      auto attrs = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_causal_mask(true)
                       .set_attn_scale(scale);
      auto [dq, dk, dv] = bwd.sdpa_backward(q, k, v, o, d_o, stats, attrs);
      dq->set_output(true).set_uid(kDQ).set_dim({shape.batch, hq, shape.seq, shape.head_dim}).set_stride(strides(total));
      dk->set_output(true).set_uid(kDK).set_dim({shape.batch, hkv, shape.seq, shape.head_dim}).set_stride(strides(total));
      dv->set_output(true).set_uid(kDV).set_dim({shape.batch, hkv, shape.seq, shape.head_dim}).set_stride(strides(total));
    }
    for (auto [g, ws, name] : {std::tuple{&fwd, &fwd_ws, "forward graph"}, std::tuple{&bwd, &bwd_ws, "backward graph"}}) {
      if (auto e = g->build(handle, {fe::HeurMode_t::A}); e.is_bad()) return fe_error(e, name);
      if (auto e = g->get_workspace_size(*ws); e.is_bad()) return fe_error(e, name);
    }
    return tigon::Status{};
  }
};

CudnnSdpa::CudnnSdpa(const SdpaShape& shape) : impl_(std::make_unique<Impl>()) {
  impl_->shape = shape;
  if (shape.batch <= 0 || shape.seq <= 0 || shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0 ||
      shape.head_dim % 8 != 0) {
    impl_->status = tigon::Status::error(tigon::Errc::invalid_size, "cudnn_sdpa", "shape",
                                         "needs positive sizes, heads_q a multiple of heads_kv and head_dim "
                                         "a multiple of 8");
    return;
  }
  try {  // the frontend throws where no SDPA implementation fits (the GPU, the cuDNN version)
    impl_->status = impl_->build();
  } catch (const std::exception& e) {
    impl_->status = tigon::Status::error(tigon::Errc::unsupported, "cudnn_sdpa", "graph", e.what());
  }
}

CudnnSdpa::~CudnnSdpa() = default;

const tigon::Status& CudnnSdpa::status() const { return impl_->status; }

std::size_t CudnnSdpa::workspace_bytes() const {
  return static_cast<std::size_t>(std::max(impl_->fwd_ws, impl_->bwd_ws));
}

tigon::Status CudnnSdpa::forward(const void* qkv, void* o, float* stats, void* workspace, cudaStream_t s) {
  if (!impl_->status.ok()) return impl_->status;
  const auto& sh = impl_->shape;
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  const std::int64_t head_bytes = sh.head_dim * 2;
  std::unordered_map<std::int64_t, void*> pack{{kQ, base},
                                               {kK, base + sh.heads_q * head_bytes},
                                               {kV, base + (sh.heads_q + sh.heads_kv) * head_bytes},
                                               {kO, o},
                                               {kStats, stats}};
  if (cudnnSetStream(impl_->handle, s) != CUDNN_STATUS_SUCCESS) {
    return tigon::Status::error(tigon::Errc::unsupported, "cudnn_sdpa", "cudnnSetStream", "failed");
  }
  if (auto e = impl_->fwd.execute(impl_->handle, pack, workspace); e.is_bad()) return fe_error(e, "forward");
  return tigon::Status{};
}

tigon::Status CudnnSdpa::backward(const void* qkv, const void* o, const void* d_o, const float* stats, void* dqkv,
                                  void* workspace, cudaStream_t s) {
  if (!impl_->status.ok()) return impl_->status;
  const auto& sh = impl_->shape;
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  auto* dbase = static_cast<char*>(dqkv);
  const std::int64_t head_bytes = sh.head_dim * 2, k_off = sh.heads_q * head_bytes,
                     v_off = (sh.heads_q + sh.heads_kv) * head_bytes;
  std::unordered_map<std::int64_t, void*> pack{{kQ, base},
                                               {kK, base + k_off},
                                               {kV, base + v_off},
                                               {kO, const_cast<void*>(o)},
                                               {kDO, const_cast<void*>(d_o)},
                                               {kStats, const_cast<float*>(stats)},
                                               {kDQ, dbase},
                                               {kDK, dbase + k_off},
                                               {kDV, dbase + v_off}};
  if (cudnnSetStream(impl_->handle, s) != CUDNN_STATUS_SUCCESS) {
    return tigon::Status::error(tigon::Errc::unsupported, "cudnn_sdpa", "cudnnSetStream", "failed");
  }
  if (auto e = impl_->bwd.execute(impl_->handle, pack, workspace); e.is_bad()) return fe_error(e, "backward");
  return tigon::Status{};
}

}  // namespace llama
