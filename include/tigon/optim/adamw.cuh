// tigon/optim/adamw.cuh - the optimizer step as one op: a multi-tensor AdamW (or Adam) over a fixed
// list of parameters, in one launch a step, with everything that changes between steps (the
// learning rate, the step count, a gradient scale, a clip factor, the found-inf flag) read from
// device memory, so that one CUDA graph serves every step.
//
// Per element, at step t, in the order of operations and the precision of
// torch.optim.AdamW(fused=True) on CUDA (torch 2.11: the hyper-parameters rounded to fp32, every
// operation in fp32, the multiply-adds fused): AdamW's results are torch's bit for bit (Adam's L2
// term g + p * wd rounds otherwise than torch's in about 1% of the elements):
//
//   g  = grad / grad_scale * clip_factor          (each factor when given)
//   p  = p - (lr * weight_decay) * p              (AdamW: decoupled; Adam: g = g + p * weight_decay)
//   m  = beta1 * m + (g - beta1 * g)
//   v  = beta2 * v + (g*g - beta2 * g*g)
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// p is the parameter (bfloat16, half or float), or its fp32 master copy when one is given (the
// parameter then receives the master rounded to its dtype); m and v are stored in fp32 or in the
// parameter's dtype. The rule is a template parameter (AdamWRule by default): a trainer swaps in its
// own at compile time. Bfloat16 parameters without a master may be rounded stochastically (a hash of
// the seed, the step and the element's index: deterministic for a given seed).
//
// Use: adamw_plan() once for a parameter list (it writes the list into the caller's workspace; run
// it outside any graph capture), then adamw_step() every step (graph-capturable: no allocation, no
// host synchronisation, no copy from the host). A trainer whose buffers move between steps re-plans
// without a synchronisation: adamw_plan_stage() into pinned host memory, its own asynchronous copy
// into the workspace, adamw_plan_view(). grad_norm_clip() before it computes the gradients'
// global L2 norm and the clip factor min(1, max_norm / (norm + 1e-6)) into device memory, which
// the step applies through AdamWHyper::clip_factor: the clip costs one read of the gradients and
// no pass of its own over them. The step count lives in device memory; adamw_step
// adds one to it before the update, as torch does. With found_inf set and nonzero (AMP's
// GradScaler), the step writes nothing and leaves the step count as it was.
//
// The header reads in four layers: arguments, math (host + device), kernels, launchers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>

#include "../core/launch.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------

// One parameter tensor: numel contiguous elements of each buffer. S, the moments' dtype: float or P.
template <class P, class S = float>
struct AdamWTensor {
  P* param = nullptr;             // updated in place
  const P* grad = nullptr;        // the gradient, in the parameter's dtype
  S* exp_avg = nullptr;           // first moment m
  S* exp_avg_sq = nullptr;        // second moment v
  float* master = nullptr;        // fp32 master weights, or null
  std::int64_t numel = 0;
};

// The step's constants and the device scalars it reads.
struct AdamWHyper {
  double beta1 = 0.9;  // in fp64, as torch passes them
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool decoupled = true;  // AdamW; false: Adam with L2 weight decay added to the gradient
  const float* lr = nullptr;           // device scalar: the learning rate; or null and lr_value
  std::optional<double> lr_value = std::nullopt;  // a constant learning rate (the step rounds it to fp32, as torch)
  float* step = nullptr;               // device scalar, required: the steps taken; the launch adds 1
  const float* grad_scale = nullptr;   // device scalar or null: gradients are divided by it
  const float* clip_factor = nullptr;  // device scalar or null: gradients are multiplied by it
  const float* found_inf = nullptr;    // device scalar or null: nonzero skips the step
  bool stochastic_rounding = false;    // bfloat16 parameters without a master: round stochastically
  std::uint64_t seed = 0;              // of the stochastic rounding
};

// What adamw_plan() wrote and adamw_step() reads: the parameter list in device memory.
struct AdamWPlan {
  const void* tensors = nullptr;  // device: AdamWTensor entries with their vector flags
  const void* chunks = nullptr;   // device: one (tensor, first element) entry per chunk
  std::int64_t num_chunks = 0;
  int num_tensors = 0;
  std::int64_t numel = 0;         // the parameters' total element count
  int param_dtype = -1, state_dtype = -1;  // what the plan was made for (dtype_traits ids)
};

// ------------------------------------------------------------------------------------------------
// 2. Math: one element, in fp32, on host and device
// ------------------------------------------------------------------------------------------------

// The per-step coefficients every element shares, in fp32: torch's fused kernel casts its fp64
// hyper-parameters to fp32 (its opmath type) and computes every product in fp32.
struct AdamWCoeffs {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;     // lr / (1 - beta1^t)
  float bc2_sqrt;      // sqrt(1 - beta2^t)
  float grad_scale;    // the gradients are divided by it (1: none)
  float clip_factor;   // then multiplied by it (1: none)
  bool decoupled;
};

namespace adamw_math {

// The coefficients of step t (t >= 1): the hyper-parameters rounded to fp32, 1 - beta^t with
// powf in fp32, lr / bc1 and sqrt(bc2) in fp32.
TIGON_HD AdamWCoeffs coeffs(double lr, double beta1, double beta2, double eps, double weight_decay, float t,
                            float grad_scale, float clip_factor, bool decoupled) {
  const auto lr32 = static_cast<float>(lr), b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2);
  const float bc1 = 1.0f - ::powf(b1, t);
  const float bc2 = 1.0f - ::powf(b2, t);
  return {lr32, b1, b2, static_cast<float>(eps), static_cast<float>(weight_decay), lr32 / bc1, ::sqrtf(bc2),
          grad_scale, clip_factor, decoupled};
}

// The gradient as the rule receives it: divided by the scale, then multiplied by the clip factor
// (each skipped when 1, which leaves it exact).
TIGON_HD float gradient(float g, const AdamWCoeffs& c) {
  if (c.grad_scale != 1.0f) g = g / c.grad_scale;
  if (c.clip_factor != 1.0f) g = g * c.clip_factor;
  return g;
}

}  // namespace adamw_math

// The default rule: AdamW (or Adam) as above, each multiply-add one fused fp32 operation where
// torch's kernel has one. A rule is a struct with
//   static TIGON_HD void apply(float& p, float g, float& m, float& v, const AdamWCoeffs& c);
// g already carries the gradient scale and the clip factor (adamw_math::gradient).
struct AdamWRule {
  static TIGON_HD void apply(float& p, float g, float& m, float& v, const AdamWCoeffs& c) {
    if (c.weight_decay != 0.0f) {
      if (c.decoupled) {
        p = ::fmaf(-(c.lr * c.weight_decay), p, p);  // p - (lr * wd) * p
      } else {
        g = ::fmaf(p, c.weight_decay, g);            // g + p * wd
      }
    }
    m = ::fmaf(c.beta1, m, ::fmaf(-c.beta1, g, g));  // beta1 * m + (g - beta1 * g)
    const float gg = g * g;
    v = ::fmaf(c.beta2, v, ::fmaf(-c.beta2, gg, gg));
    const float denom = ::sqrtf(v) / c.bc2_sqrt + c.eps;
    p = p - c.step_size * m / denom;
  }
};

template <class R>
concept AdamWUpdateRule = requires(float& p, float g, float& m, float& v, const AdamWCoeffs& c) {
  R::apply(p, g, m, v, c);
};

namespace adamw_math {

// A 64-bit mix (splitmix64's finaliser) of the seed, the step and the element's index (the tensor's
// number in the high bits: tensors of one shape draw differently).
TIGON_HD std::uint32_t hash(std::uint64_t seed, std::uint64_t step, std::uint64_t index) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (step + 1) + 0xbf58476d1ce4e5b9ull * index;
  z ^= z >> 29;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint32_t>(z ^ (z >> 31));
}

// v rounded to bfloat16 stochastically: up with probability (v - down) / (up - down), with the 16
// low bits of r as the draw. Infinities and NaN round as to nearest.
TIGON_HD float stochastic_bf16(float v, std::uint32_t r) {
  std::uint32_t b;
  __builtin_memcpy(&b, &v, 4);
  if ((b & 0x7f800000u) == 0x7f800000u) return round_to<bf16>(v);
  b = (b + (r & 0xffffu)) & 0xffff0000u;
  float out;
  __builtin_memcpy(&out, &b, 4);
  return out;
}

}  // namespace adamw_math

// ------------------------------------------------------------------------------------------------
// Validation and the plan's layout (host)
// ------------------------------------------------------------------------------------------------

namespace detail {

// Elements per chunk (one block of 256 threads, 8 elements each per trip, 16 trips).
inline constexpr std::int64_t kAdamWChunk = 32768;

// A tensor as the kernel reads it: the pointers and whether all of them allow 16-byte vectors.
struct AdamWTensorEntry {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float* master;
  std::int64_t numel;
  int vec;
  int pad_;
};

struct AdamWChunkEntry {
  std::int32_t tensor;
  std::int32_t chunk;  // the chunk's index within its tensor
};

inline std::size_t adamw_tensors_bytes(int n) { return round_up<std::size_t>(n * sizeof(AdamWTensorEntry), 256); }

// The plan's bytes: the tensor table, then one entry per chunk.
inline std::size_t adamw_plan_bytes(int tensors, std::int64_t chunks) {
  return adamw_tensors_bytes(tensors) +
         round_up<std::size_t>(static_cast<std::size_t>(chunks) * sizeof(AdamWChunkEntry), 256);
}

template <class P, class S>
Status validate_adamw_tensors(const AdamWTensor<P, S>* t, int n, const char* op, std::int64_t& chunks) {
  static_assert(Element<P>, "parameters are float, half or bfloat16");
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, P>, "moments are fp32 or the parameters' dtype");
  using namespace check;
  chunks = 0;
  TIGON_CHECK(not_null(t, op, "tensors"));
  if (n <= 0 || n > (1 << 30)) return Status::error(Errc::invalid_size, op, "num_tensors", "must be in [1, 2^30]");
  // Every written buffer apart from every other buffer, the gradients included: the byte ranges
  // sorted and swept (n log n; the tensors of a model number in the thousands).
  struct Range {
    std::uintptr_t begin, end;
    bool written;
    int tensor;
    const char* name;
  };
  std::vector<Range> ranges;
  auto add = [&](const void* ptr, std::int64_t elems, std::size_t bytes, bool written, int i, const char* name) {
    if (ptr == nullptr) return;
    const auto b = reinterpret_cast<std::uintptr_t>(ptr);
    ranges.push_back({b, b + static_cast<std::uintptr_t>(elems) * bytes, written, i, name});
  };
  for (int i = 0; i < n; ++i) {
    const AdamWTensor<P, S>& x = t[i];
    TIGON_CHECK(not_null(x.param, op, "tensors[i].param"));
    TIGON_CHECK(not_null(x.grad, op, "tensors[i].grad"));
    TIGON_CHECK(not_null(x.exp_avg, op, "tensors[i].exp_avg"));
    TIGON_CHECK(not_null(x.exp_avg_sq, op, "tensors[i].exp_avg_sq"));
    TIGON_CHECK(positive(x.numel, op, "tensors[i].numel"));
    if (x.numel > (std::int64_t{1} << 46)) {
      return Status::error(Errc::invalid_size, op, "tensors[i].numel", "must be below 2^46");
    }
    chunks += ceil_div<std::int64_t>(x.numel, kAdamWChunk);
    add(x.param, x.numel, sizeof(P), true, i, "tensors[i].param");
    add(x.grad, x.numel, sizeof(P), false, i, "tensors[i].grad");
    add(x.exp_avg, x.numel, sizeof(S), true, i, "tensors[i].exp_avg");
    add(x.exp_avg_sq, x.numel, sizeof(S), true, i, "tensors[i].exp_avg_sq");
    add(x.master, x.numel, 4, true, i, "tensors[i].master");
  }
  if (chunks > (std::int64_t{1} << 31) - 1) {
    return Status::error(Errc::invalid_size, op, "tensors", "more than 2^31 - 1 chunks of 32768 elements in all");
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const Range* last_any = nullptr;      // of the ranges so far, the one reaching furthest
  const Range* last_written = nullptr;  // of the written ones so far, the one reaching furthest
  for (const Range& r : ranges) {
    const Range* hit = (last_written != nullptr && r.begin < last_written->end) ? last_written
                       : (r.written && last_any != nullptr && r.begin < last_any->end) ? last_any
                                                                                        : nullptr;
    if (hit != nullptr) {
      return Status::error(Errc::aliasing, op, r.written ? r.name : hit->name,
                           std::string("tensor ") + std::to_string(r.tensor) + "'s " + (r.name + 11) + " overlaps tensor " +
                               std::to_string(hit->tensor) + "'s " + (hit->name + 11));
    }
    if (last_any == nullptr || r.end > last_any->end) last_any = &r;
    if (r.written && (last_written == nullptr || r.end > last_written->end)) last_written = &r;
  }
  return Status();
}

}  // namespace detail

// Bytes of workspace adamw_plan() needs for a parameter list: the tensor table and one 8-byte
// entry per chunk of 32768 elements (about 250 KB per billion parameters).
template <class P, class S>
[[nodiscard]] Status adamw_workspace_bytes(const AdamWTensor<P, S>* tensors, int num_tensors, std::size_t& bytes) {
  bytes = 0;
  std::int64_t chunks = 0;
  TIGON_CHECK(detail::validate_adamw_tensors(tensors, num_tensors, "adamw_workspace_bytes", chunks));
  bytes = detail::adamw_plan_bytes(num_tensors, chunks);
  return Status();
}

namespace detail {

// A plan adamw_plan() made for parameters P and moments S.
template <class P, class S>
Status check_adamw_plan(const AdamWPlan& plan, const char* op) {
  if (plan.tensors == nullptr || plan.chunks == nullptr || plan.num_chunks <= 0) {
    return Status::error(Errc::invalid_value, op, "plan", "is empty: make it with adamw_plan()");
  }
  if (plan.param_dtype != static_cast<int>(dtype_traits<P>::id) ||
      plan.state_dtype != static_cast<int>(dtype_traits<S>::id)) {
    return Status::error(Errc::invalid_value, op, "plan", "was made for other parameter or moment dtypes");
  }
  return Status();
}

inline Status validate_adamw_hyper(const AdamWHyper& h, bool stochastic_allowed, const char* op) {
  using namespace check;
  if (h.lr == nullptr && !h.lr_value.has_value()) {
    return Status::error(Errc::null_pointer, op, "lr", "give the learning rate: lr (a device scalar) or lr_value");
  }
  if (h.lr != nullptr && h.lr_value.has_value()) {
    return Status::error(Errc::invalid_value, op, "lr_value", "give lr or lr_value, not both");
  }
  if (h.lr_value.has_value() && (!finite_in(static_cast<float>(*h.lr_value), 0.0f, __builtin_huge_valf()) ||
                                 *h.lr_value < 0.0)) {
    return Status::error(Errc::invalid_value, op, "lr_value", "must be finite and >= 0");
  }
  TIGON_CHECK(not_null(h.step, op, "step"));
  // The fp64 values checked through fp32 (bit tests, which hold under -ffast-math); a value that
  // overflows fp32 is out of range anyway.
  auto in = [](double v, float lo, float hi) { return finite_in(static_cast<float>(v), lo, hi); };
  if (!in(h.beta1, 0.0f, 1.0f) || h.beta1 >= 1.0) {
    return Status::error(Errc::invalid_value, op, "beta1", "must be in [0, 1)");
  }
  if (!in(h.beta2, 0.0f, 1.0f) || h.beta2 >= 1.0) {
    return Status::error(Errc::invalid_value, op, "beta2", "must be in [0, 1)");
  }
  if (!in(h.eps, 0.0f, __builtin_huge_valf())) {
    return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
  }
  if (!in(h.weight_decay, 0.0f, __builtin_huge_valf())) {
    return Status::error(Errc::invalid_value, op, "weight_decay", "must be finite and >= 0");
  }
  if (h.stochastic_rounding && !stochastic_allowed) {
    return Status::error(Errc::unsupported, op, "stochastic_rounding", "only for bfloat16 parameters");
  }
  return Status();
}

}  // namespace detail

// Bytes of workspace grad_norm_clip() needs for a plan: one float per chunk.
inline std::size_t grad_norm_workspace_bytes(const AdamWPlan& plan) {
  return round_up<std::size_t>(static_cast<std::size_t>(plan.num_chunks > 0 ? plan.num_chunks : 0) * 4, 256);
}

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

inline constexpr int kAdamWThreads = 256;

struct AdamWStepParams {
  const AdamWTensorEntry* tensors;
  const AdamWChunkEntry* chunks;
  double beta1, beta2, eps, weight_decay;
  bool decoupled, stochastic;
  std::uint64_t seed;
  const float* lr;    // or null: lr_value
  double lr_value;
  const float* step;  // already advanced by adamw_advance_kernel
  const float* grad_scale;
  const float* clip_factor;
  const float* found_inf;
};

// Adds one to the step count unless found_inf is set: the one launch before the update.
template <int kDummy = 0>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void adamw_advance_kernel(float* step, const float* found_inf) {
  grid_dependency_sync();
  if (threadIdx.x == 0 && (found_inf == nullptr || *found_inf == 0.0f)) *step += 1.0f;
}

// Eight elements from / to 16-byte aligned memory with the streaming hint: one 16-byte access for
// 16-bit types, two for fp32.
template <class T>
TIGON_DEVICE void adamw_load8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    to_floats(load_vec_stream<8>(p), f);
  } else {
    float lo[4], hi[4];
    to_floats(load_vec_stream<4>(p), lo);
    to_floats(load_vec_stream<4>(p + 4), hi);
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = lo[k], f[k + 4] = hi[k];
  }
}
template <class T>
TIGON_DEVICE void adamw_store8(T* p, const float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    store_vec_stream(p, from_floats<T, 8>(f));
  } else {
    const float lo[4] = {f[0], f[1], f[2], f[3]}, hi[4] = {f[4], f[5], f[6], f[7]};
    store_vec_stream(p, from_floats<T, 4>(lo));
    store_vec_stream(p + 4, from_floats<T, 4>(hi));
  }
}

template <class P, class S, class Rule, int kV>
TIGON_DEVICE void adamw_elements(const AdamWTensorEntry& t, std::int64_t i0, std::int64_t n, const AdamWCoeffs& c,
                                 bool stochastic, std::uint64_t seed, std::uint64_t step, std::uint64_t tensor) {
  P* param = static_cast<P*>(t.param);
  const P* grad = static_cast<const P*>(t.grad);
  S* m_ptr = static_cast<S*>(t.exp_avg);
  S* v_ptr = static_cast<S*>(t.exp_avg_sq);
  const bool has_master = t.master != nullptr;
  for (std::int64_t i = i0 + static_cast<std::int64_t>(threadIdx.x) * kV; i < i0 + n;
       i += static_cast<std::int64_t>(kAdamWThreads) * kV) {
    float p[kV], g[kV], m[kV], v[kV];
    if constexpr (kV > 1) {
      adamw_load8(grad + i, g);
      adamw_load8(m_ptr + i, m);
      adamw_load8(v_ptr + i, v);
      if (has_master) {
        adamw_load8(t.master + i, p);
      } else {
        adamw_load8(param + i, p);
      }
    } else {
      g[0] = to_float(grad[i]);
      m[0] = to_float(m_ptr[i]);
      v[0] = to_float(v_ptr[i]);
      p[0] = has_master ? t.master[i] : to_float(param[i]);
    }
#pragma unroll
    for (int k = 0; k < kV; ++k) Rule::apply(p[k], adamw_math::gradient(g[k], c), m[k], v[k], c);
    float out[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      out[k] = p[k];
      if constexpr (std::is_same_v<P, bf16>) {
        if (stochastic && !has_master) {
          out[k] = adamw_math::stochastic_bf16(
              p[k], adamw_math::hash(seed, step, (tensor << 46) | static_cast<std::uint64_t>(i + k)));
        }
      }
    }
    if constexpr (kV > 1) {
      adamw_store8(m_ptr + i, m);
      adamw_store8(v_ptr + i, v);
      if (has_master) adamw_store8(t.master + i, p);
      adamw_store8(param + i, out);
    } else {
      m_ptr[i] = from_float<S>(m[0]);
      v_ptr[i] = from_float<S>(v[0]);
      if (has_master) t.master[i] = p[0];
      param[i] = from_float<P>(out[0]);
    }
  }
}

// One block per chunk of kAdamWChunk elements of one tensor; 8 elements per thread per trip
// (16-bit buffers in one 16-byte access, fp32 ones in two), or one where a pointer of the tensor
// is not 16-byte aligned; every element is computed once, in the same way: deterministic.
// Block blockIdx.x's chunk: its tensor, first element and element count.
struct AdamWSpan {
  AdamWTensorEntry t;
  std::int64_t i0, n;
  std::int32_t tensor;
};
TIGON_DEVICE AdamWSpan adamw_span(const AdamWTensorEntry* tensors, const AdamWChunkEntry* chunks) {
  const AdamWChunkEntry ce = chunks[blockIdx.x];
  const AdamWTensorEntry t = tensors[ce.tensor];
  const std::int64_t i0 = static_cast<std::int64_t>(ce.chunk) * kAdamWChunk;
  return {t, i0, t.numel - i0 < kAdamWChunk ? t.numel - i0 : kAdamWChunk, ce.tensor};
}

template <class P, class S, class Rule>
TIGON_KERNEL void __launch_bounds__(kAdamWThreads) adamw_step_kernel(const AdamWStepParams p) {
  grid_dependency_sync();
  if (p.found_inf != nullptr && *p.found_inf != 0.0f) return;
  const AdamWSpan sp = adamw_span(p.tensors, p.chunks);
  const AdamWTensorEntry& t = sp.t;
  const std::int64_t i0 = sp.i0, n = sp.n;
  const float step = *p.step;
  const float scale = p.grad_scale != nullptr ? *p.grad_scale : 1.0f;
  const float clip = p.clip_factor != nullptr ? *p.clip_factor : 1.0f;
  const double lr = p.lr != nullptr ? static_cast<double>(*p.lr) : p.lr_value;
  const AdamWCoeffs c =
      adamw_math::coeffs(lr, p.beta1, p.beta2, p.eps, p.weight_decay, step, scale, clip, p.decoupled);
  const auto step_u = static_cast<std::uint64_t>(step);
  constexpr int kV = 8;
  if (t.vec) {
    const std::int64_t nv = n / kV * kV;
    adamw_elements<P, S, Rule, kV>(t, i0, nv, c, p.stochastic, p.seed, step_u, sp.tensor);
    adamw_elements<P, S, Rule, 1>(t, i0 + nv, n - nv, c, p.stochastic, p.seed, step_u, sp.tensor);
  } else {
    adamw_elements<P, S, Rule, 1>(t, i0, n, c, p.stochastic, p.seed, step_u, sp.tensor);
  }
}

// The sum of the squares of one chunk's gradient elements, in fp32 per thread and a fixed block
// reduction (deterministic), into partials[chunk].
template <class P>
TIGON_KERNEL void __launch_bounds__(kAdamWThreads) grad_sq_sum_kernel(const AdamWTensorEntry* tensors,
                                                                       const AdamWChunkEntry* chunks,
                                                                       float* partials) {
  grid_dependency_sync();
  const AdamWSpan sp = adamw_span(tensors, chunks);
  const AdamWTensorEntry& t = sp.t;
  const std::int64_t n = sp.n;
  const P* g = static_cast<const P*>(t.grad) + sp.i0;
  float s = 0.0f;
  std::int64_t done = 0;
  if (t.vec) {
    done = n / 8 * 8;
    for (std::int64_t i = static_cast<std::int64_t>(threadIdx.x) * 8; i < done; i += kAdamWThreads * 8) {
      float f[8];
      adamw_load8(g + i, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) s = fmaf(f[k], f[k], s);
    }
  }
  for (std::int64_t i = done + threadIdx.x; i < n; i += kAdamWThreads) {
    const float f = to_float(g[i]);
    s = fmaf(f, f, s);
  }
  using Reduce = cub::BlockReduce<float, kAdamWThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const float total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// The chunks' partial sums added in a fixed order (fp64), divided by the gradient scale's square
// when there is one, the norm and the clip factor written (NaN stays NaN, as torch's clamp keeps it).
template <int kThreads>
TIGON_KERNEL void __launch_bounds__(kThreads) grad_norm_finish_kernel(const float* partials, std::int64_t n,
                                                                      const float* grad_scale, float max_norm,
                                                                      float* norm, float* factor) {
  grid_dependency_sync();
  double s = 0.0;
  for (std::int64_t i = threadIdx.x; i < n; i += kThreads) s += partials[i];
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const double total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) {
    double sq = total;
    if (grad_scale != nullptr) sq /= static_cast<double>(*grad_scale) * static_cast<double>(*grad_scale);
    const float nv = static_cast<float>(::sqrt(sq));
    const float f = max_norm / (nv + 1e-6f);
    if (norm != nullptr) *norm = nv;
    if (factor != nullptr) *factor = f < 1.0f ? f : (f >= 1.0f ? 1.0f : f);  // NaN passes
  }
}

}  // namespace detail

#endif  // __CUDACC__

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------

// Writes the plan's bytes for a parameter list (adamw_workspace_bytes() of them) into `staging`,
// host memory: copy them into a device workspace in your stream's order (from pinned memory, with
// the staging buffer kept until the copy is done), then adamw_plan_view() makes the plan. This is
// how a trainer whose gradients move between steps re-plans without a host synchronisation.
template <class P, class S>
[[nodiscard]] Status adamw_plan_stage(const AdamWTensor<P, S>* tensors, int num_tensors, void* staging,
                                      std::size_t staging_bytes) {
  constexpr const char* kOp = "adamw_plan_stage";
  std::size_t need = 0;
  TIGON_CHECK(adamw_workspace_bytes(tensors, num_tensors, need));
  TIGON_CHECK(check::workspace(staging, staging_bytes, need, kOp));
  auto* host = static_cast<unsigned char*>(staging);
  std::memset(host, 0, need);
  const std::size_t tbytes = detail::adamw_tensors_bytes(num_tensors);
  auto* te = reinterpret_cast<detail::AdamWTensorEntry*>(host);
  auto* ch = reinterpret_cast<detail::AdamWChunkEntry*>(host + tbytes);
  std::int64_t k = 0;
  for (int i = 0; i < num_tensors; ++i) {
    const AdamWTensor<P, S>& t = tensors[i];
    const bool vec = is_aligned(t.param, 16) && is_aligned(t.grad, 16) && is_aligned(t.exp_avg, 16) &&
                     is_aligned(t.exp_avg_sq, 16) && is_aligned(t.master, 16);
    te[i] = {t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.master, t.numel, vec ? 1 : 0, 0};
    for (std::int64_t c = 0; c * detail::kAdamWChunk < t.numel; ++c) {
      ch[k++] = {static_cast<std::int32_t>(i), static_cast<std::int32_t>(c)};
    }
  }
  return Status();
}

// The plan of a parameter list whose bytes (adamw_plan_stage()'s) `workspace` holds or will hold
// by the time the stream reaches the step: the list is validated and counted, nothing is read or
// copied. The list must be the one staged (the same pointers, in the same order).
template <class P, class S>
[[nodiscard]] Status adamw_plan_view(const AdamWTensor<P, S>* tensors, int num_tensors, const void* workspace,
                                     std::size_t workspace_bytes, AdamWPlan& plan) {
  constexpr const char* kOp = "adamw_plan_view";
  plan = AdamWPlan{};
  std::int64_t chunks = 0;
  TIGON_CHECK(detail::validate_adamw_tensors(tensors, num_tensors, kOp, chunks));
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, detail::adamw_plan_bytes(num_tensors, chunks), kOp));
  std::int64_t numel = 0;
  for (int i = 0; i < num_tensors; ++i) numel += tensors[i].numel;
  plan.tensors = workspace;
  plan.chunks = static_cast<const unsigned char*>(workspace) + detail::adamw_tensors_bytes(num_tensors);
  plan.num_chunks = chunks;
  plan.num_tensors = num_tensors;
  plan.numel = numel;
  plan.param_dtype = static_cast<int>(dtype_traits<P>::id);
  plan.state_dtype = static_cast<int>(dtype_traits<S>::id);
  return Status();
}

#if defined(__CUDACC__)

// Writes the parameter list into `workspace` (adamw_workspace_bytes() of them, 16-byte aligned) with
// one host-to-device copy on `stream`, and fills `plan`. Run it once per parameter list, outside
// any graph capture; `tensors` need not outlive the call (the copy is made from a staging buffer
// that the call waits for).
template <class P, class S>
[[nodiscard]] Status adamw_plan(const AdamWTensor<P, S>* tensors, int num_tensors, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream, AdamWPlan& plan) {
  constexpr const char* kOp = "adamw_plan";
  plan = AdamWPlan{};
  std::size_t need = 0;
  TIGON_CHECK(adamw_workspace_bytes(tensors, num_tensors, need));
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, need, kOp));
  std::vector<unsigned char> host(need);
  TIGON_CHECK(adamw_plan_stage(tensors, num_tensors, host.data(), need));
  TIGON_CHECK(Status::from_cuda(cudaMemcpyAsync(workspace, host.data(), need, cudaMemcpyHostToDevice, stream), kOp,
                                "cudaMemcpyAsync"));
  // The staging buffer dies with this call: wait for the copy.
  TIGON_CHECK(Status::from_cuda(cudaStreamSynchronize(stream), kOp, "cudaStreamSynchronize"));
  return adamw_plan_view(tensors, num_tensors, workspace, workspace_bytes, plan);
}

// One optimizer step over the plan's parameters: the step count advanced, then every element
// updated with Rule (AdamWRule by default). Two launches; graph-capturable.
template <class P, class S = float, AdamWUpdateRule Rule = AdamWRule>
[[nodiscard]] Status adamw_step(const AdamWPlan& plan, const AdamWHyper& h, cudaStream_t stream) {
  constexpr const char* kOp = "adamw_step";
  TIGON_CHECK((detail::check_adamw_plan<P, S>(plan, kOp)));
  TIGON_CHECK(detail::validate_adamw_hyper(h, std::is_same_v<P, bf16>, kOp));
  TIGON_CHECK(detail::launch(kOp, detail::adamw_advance_kernel<0>, {dim3(1), dim3(32), 0, stream}, h.step,
                             h.found_inf));
  const detail::AdamWStepParams p{static_cast<const detail::AdamWTensorEntry*>(plan.tensors),
                                  static_cast<const detail::AdamWChunkEntry*>(plan.chunks),
                                  h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.stochastic_rounding,
                                  h.seed, h.lr, h.lr_value.value_or(0.0), h.step, h.grad_scale, h.clip_factor,
                                  h.found_inf};
  return detail::launch(kOp, detail::adamw_step_kernel<P, S, Rule>,
                        {dim3(static_cast<unsigned>(plan.num_chunks)), dim3(detail::kAdamWThreads), 0, stream}, p);
}

// The global L2 norm of the plan's gradients into *norm, and the clip factor
// min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s) into *factor (either may be
// null), both device scalars: pass factor to adamw_step as AdamWHyper::clip_factor. With grad_scale
// (a device scalar, the one the step divides the gradients by: AMP's scale) the norm is that of the
// unscaled gradients. Two launches, deterministic (a fixed reduction order), graph-capturable;
// grad_norm_workspace_bytes(plan) of workspace. A non-finite gradient gives a non-finite norm and
// factor (the step then writes non-finite values: check the norm, or use found_inf, to skip it). A
// gradient that two plan entries share counts twice.
template <class P, class S = float>
[[nodiscard]] Status grad_norm_clip(const AdamWPlan& plan, float max_norm, float* norm, float* factor,
                                    void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                                    const float* grad_scale = nullptr) {
  constexpr const char* kOp = "grad_norm_clip";
  TIGON_CHECK((detail::check_adamw_plan<P, S>(plan, kOp)));
  if (!check::finite_in(max_norm, 0.0f, __builtin_huge_valf(), true)) {
    return Status::error(Errc::invalid_value, kOp, "max_norm", "must be finite and > 0");
  }
  if (norm == nullptr && factor == nullptr) {
    return Status::error(Errc::null_pointer, kOp, "norm", "nothing to compute: give norm or factor");
  }
  TIGON_CHECK(check::workspace(workspace, workspace_bytes, grad_norm_workspace_bytes(plan), kOp));
  {  // the norm, the factor and the workspace apart from each other and from the plan's table
    using namespace check;
    const auto table = static_cast<std::int64_t>(detail::adamw_plan_bytes(plan.num_tensors, plan.num_chunks));
    const NamedView outs[] = {{vector_view(workspace, static_cast<std::int64_t>(workspace_bytes), 1), "workspace"},
                              {vector_view(norm, 1, 4), "norm"},
                              {vector_view(factor, 1, 4), "factor"}};
    const NamedView ins[] = {{vector_view(plan.tensors, table, 1), "plan"}};
    TIGON_CHECK(buffers_disjoint(outs, ins, kOp));
  }
  auto* partials = static_cast<float*>(workspace);
  TIGON_CHECK(detail::launch(kOp, detail::grad_sq_sum_kernel<P>,
                             {dim3(static_cast<unsigned>(plan.num_chunks)), dim3(detail::kAdamWThreads), 0, stream},
                             static_cast<const detail::AdamWTensorEntry*>(plan.tensors),
                             static_cast<const detail::AdamWChunkEntry*>(plan.chunks), partials));
  return detail::launch(kOp, detail::grad_norm_finish_kernel<1024>, {dim3(1), dim3(1024), 0, stream},
                        static_cast<const float*>(partials), plan.num_chunks, grad_scale, max_norm, norm, factor);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
