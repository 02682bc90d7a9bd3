// RoPE of q and k in one launch, forward and backward, through tigon/rope/rope.cuh.
#include "common.h"

#include <torch/library.h>

#include <tigon/rope/rope.cuh>

namespace tigon_torch {
namespace {

// q / k in the logical layout [batch, seq, heads, head_dim] (any strides, unit last stride).
template <class T>
tigon::RopeTensor<T> rope_tensor(const Tensor& in, const Tensor& out, const Tensor& ref, const char* op,
                                 const char* in_name, const char* out_name) {
  check_cuda(in, ref, op, in_name);
  check_cuda(out, ref, op, out_name);
  TORCH_CHECK_VALUE(in.dim() == 4 && out.dim() == 4, op, ": '", in_name, "' and '", out_name,
                    "' must be 4-D [batch, seq, heads, head_dim]");
  TORCH_CHECK_VALUE(in.sizes() == out.sizes(), op, ": '", out_name, "' has shape ", out.sizes(), ", '",
                    in_name, "' ", in.sizes());
  TORCH_CHECK_TYPE(in.scalar_type() == ref.scalar_type() && out.scalar_type() == ref.scalar_type(), op,
                   ": '", in_name, "' and '", out_name, "' must have dtype ", ref.scalar_type());
  TORCH_CHECK_VALUE(in.stride(3) == 1 && out.stride(3) == 1, op, ": '", in_name, "' and '", out_name,
                    "' need a unit stride in head_dim");
  auto s = [](const Tensor& t, int d) { return t.size(d) <= 1 ? std::int64_t{0} : t.stride(d); };
  tigon::RopeTensor<T> r{.in = ptr<const T>(in), .out = ptr<T>(out), .heads = in.size(2),
                         .stride_b = s(in, 0), .stride_t = s(in, 1), .stride_h = s(in, 2),
                         .out_stride_b = s(out, 0), .out_stride_t = s(out, 1), .out_stride_h = s(out, 2)};
  // tigon reads all-zero output strides as "same as the input": only ambiguous when every dimension
  // of the output has size 1, where the strides do not matter.
  return r;
}

// sections: empty, or M-RoPE's three (temporal, height, width) with cos / sin [3, batch or 1, rows,
// width], the planes read where each pair's section says (rope.cuh).
void rope(const Tensor& q, const OptTensor& k, const Tensor& cos_in, const Tensor& sin_in,
          const OptTensor& position_ids, const Tensor& q_out, const OptTensor& k_out, bool backward,
          bool interleaved, c10::IntArrayRef sections) {
  constexpr const char* op = "tigon.rope";
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK_VALUE(k.has_value() == k_out.has_value(), op, ": give k and k_out together");
  check_cuda(cos_in, q, op, "cos");
  check_cuda(sin_in, q, op, "sin");
  const bool mrope = !sections.empty();
  TORCH_CHECK_VALUE(!mrope || sections.size() == 3, op,
                    ": sections must be empty or three sizes (temporal, height, width), got ", sections);
  TORCH_CHECK_VALUE(cos_in.strides() == sin_in.strides() && cos_in.sizes() == sin_in.sizes(), op,
                    ": cos and sin must have one shape and the same strides, got ", cos_in.sizes(), " and ",
                    sin_in.sizes());
  if (mrope) {
    TORCH_CHECK_VALUE(cos_in.dim() == 4 && cos_in.size(0) == 3 && cos_in.stride(0) > 0, op,
                      ": with sections cos / sin must be [3, batch or 1, rows, width] with distinct planes, got ",
                      cos_in.sizes());
  }
  // Plane 0 (the only one without sections) gives the tables' layout.
  const Tensor cos = mrope ? cos_in.select(0, 0) : cos_in;
  const Tensor sin = mrope ? sin_in.select(0, 0) : sin_in;
  TORCH_CHECK_VALUE(cos.dim() == 3, op, ": cos and sin must be 3-D [batch or 1, rows, width], got ", cos.sizes());
  TORCH_CHECK_TYPE(cos.scalar_type() == sin.scalar_type(), op, ": cos and sin must have one dtype");
  TORCH_CHECK_VALUE(cos.size(2) <= 1 || cos.stride(2) == 1, op, ": cos / sin need a unit last stride");
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must be 4-D [batch, seq, heads, head_dim]");
  const std::int64_t batch = q.size(0), seq = q.size(1);
  TORCH_CHECK_VALUE(cos.size(0) == 1 || cos.size(0) == batch, op, ": cos has batch ", cos.size(0),
                    ", expected 1 or ", batch);
  // The rotated channels: the table's width (Hugging Face's partial rotary), or head_dim for an odd
  // head_dim's table of head_dim + 1 entries (the width Hugging Face's rotary embedding gives it):
  // head_dim / 2 pairs rotated, the last channel passed through, as Liger-Kernel does.
  const std::int64_t head_dim = q.size(3), width = cos.size(2);
  const std::int64_t rotary_dim = width == head_dim + 1 && head_dim % 2 == 1 ? head_dim : width;
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim <= head_dim, op, ": cos / sin width ", width,
                    " must be in [2, head_dim] (head_dim ", head_dim,
                    "), or head_dim + 1 for an odd head_dim");
  if (k) {
    TORCH_CHECK_VALUE(k->dim() == 4 && k->size(0) == batch && k->size(1) == seq && k->size(3) == q.size(3),
                      op, ": k must be [batch, seq, heads_k, head_dim] like q, got ", k->sizes());
  }
  if (position_ids) {
    check_cuda(*position_ids, q, op, "position_ids");
    TORCH_CHECK_VALUE(position_ids->dim() == 2 && position_ids->size(0) == batch &&
                          position_ids->size(1) == seq && position_ids->is_contiguous(),
                      op, ": position_ids must be contiguous [batch, seq], got ", position_ids->sizes());
    TORCH_CHECK_TYPE(position_ids->scalar_type() == at::kLong || position_ids->scalar_type() == at::kInt, op,
                     ": position_ids must be int64 or int32");
  }
  const at::ScalarType ct = cos.scalar_type();
  TORCH_CHECK_TYPE(ct == q.scalar_type() || ct == at::kFloat, op, ": cos / sin dtype (", ct,
                   ") must equal q's (", q.scalar_type(), ") or be float32");
  dispatch_float(q.scalar_type(), op, "q", [&](auto tt) {
    using T = typename decltype(tt)::type;
    auto run = [&](auto tc) {
      using C = typename decltype(tc)::type;
      tigon::RopeArgs<T, C> a;
      a.q = rope_tensor<T>(q, q_out, q, op, "q", "q_out");
      if (k) a.k = rope_tensor<T>(*k, *k_out, q, op, "k", "k_out");
      a.batch = batch;
      a.seq = seq;
      a.head_dim = head_dim;
      a.rotary_dim = rotary_dim;
      a.cos = ptr<const C>(cos);
      a.sin = ptr<const C>(sin);
      a.table_rows = cos.size(1);
      a.table_stride_b = cos.size(0) <= 1 ? 0 : cos.stride(0);
      a.table_stride_t = cos.size(1) <= 1 ? 0 : cos.stride(1);
      if (mrope) {
        a.table_stride_plane = cos_in.stride(0);
        for (int i = 0; i < 3; ++i) a.sections[i] = sections[static_cast<std::size_t>(i)];
      }
      if (position_ids) {
        if (position_ids->scalar_type() == at::kLong) {
          a.position_ids = ptr<const std::int64_t>(*position_ids);
        } else {
          a.position_ids_i32 = ptr<const std::int32_t>(*position_ids);
        }
      }
      const cudaStream_t stream = current_stream(q);
      tigon::Status s;
      if (interleaved) {
        s = backward ? tigon::rope_backward<tigon::RopeInterleaved>(a, stream)
                     : tigon::rope_forward<tigon::RopeInterleaved>(a, stream);
      } else {
        s = backward ? tigon::rope_backward<tigon::RopeHalfSplit>(a, stream)
                     : tigon::rope_forward<tigon::RopeHalfSplit>(a, stream);
      }
      check_status(s);
    };
    if (ct == q.scalar_type()) {
      run(tag<T>{});
    } else if constexpr (!std::is_same_v<T, float>) {
      run(tag<float>{});
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("rope", &rope);
}

}  // namespace tigon_torch
