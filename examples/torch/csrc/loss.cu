// The losses: cross-entropy (tigon/loss/cross_entropy.cuh) and the chunked linear cross-entropy
// (tigon/loss/linear_cross_entropy.cuh, the LM head's loss without the logits) on tigon's cuBLASLt
// GEMM back end.
//
// One translation unit for both: the linear cross-entropy instantiates the cross-entropy row kernel
// too, so one file compiles those instances once.
#include "loss_common.h"

#include <torch/library.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <tigon/loss/cross_entropy.cuh>
#include <tigon/loss/linear_cross_entropy.cuh>
#include <tigon/loss/linear_logprob.cuh>

namespace tigon_torch {
namespace {

void cross_entropy(const Tensor& logits, const Tensor& target, const OptTensor& class_weights,
                   const OptTensor& grad_output, const OptTensor& dlogits, const OptTensor& loss,
                   const OptTensor& loss_rows, const OptTensor& z_loss, const OptTensor& lse,
                   const OptTensor& argmax, std::int64_t ignore_index, double label_smoothing,
                   double z_loss_scale, double softcap, std::int64_t reduction, double grad_scale) {
  constexpr const char* op = "tigon.cross_entropy";
  const c10::cuda::CUDAGuard guard(logits.device());
  const Rows X = rows_of(logits, logits, logits.scalar_type(), op, "logits");
  Rows D;
  if (dlogits) {
    D = rows_of(*dlogits, logits, logits.scalar_type(), op, "dlogits");
    same_shape(X, D, op, "logits", "dlogits");
  }
  dispatch_float(logits.scalar_type(), op, "logits", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_index(target.scalar_type(), op, [&](auto ti) {
      using I = typename decltype(ti)::type;
      tigon::CrossEntropyArgs<T, I> a;
      fill_loss(a, logits, X.rows, X.cols, target, class_weights, grad_output, loss, loss_rows, z_loss, lse,
                argmax, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, grad_scale, op);
      a.logits = static_cast<const T*>(X.ptr);
      a.logits_stride = X.stride;
      a.dlogits = static_cast<T*>(D.ptr);
      a.dlogits_stride = D.stride;
      std::size_t bytes = 0;
      check_status(tigon::cross_entropy_workspace_bytes(a, bytes));
      const Tensor ws = workspace(bytes, logits);
      a.workspace = workspace_ptr(ws);
      a.workspace_bytes = bytes;
      check_status(tigon::cross_entropy(a, current_stream(logits)));
    });
  });
}

// x[r, :] *= scale[r] (scale: one fp32 value for every row, or one per row), skipping the rows whose
// scale is exactly 1 without touching them: the upstream gradient of a loss whose gradient was written
// in the forward, applied with no host synchronisation (the usual scalar 1 costs one launch whose
// blocks read one float each and return). One block a row at a time, kV elements (16 bytes when the
// rows allow it) per access, four accesses in flight per thread.
template <class T, int kV>
__global__ void __launch_bounds__(256) scale_rows_kernel(T* x, std::int64_t rows, std::int64_t cols,
                                                         std::int64_t stride, const float* scale, bool per_row) {
  if (!per_row && scale[0] == 1.0f) return;
  constexpr int kU = 4;
  const std::int64_t vecs = cols / kV;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float s = per_row ? scale[r] : scale[0];
    if (s == 1.0f) continue;
    T* row = x + r * stride;
    std::int64_t v = threadIdx.x;
    for (; v + (kU - 1) * 256 < vecs; v += kU * 256) {
      tigon::AlignedVec<T, kV> a[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) a[u] = tigon::load_vec<kV>(row + (v + u * 256) * kV);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int e = 0; e < kV; ++e) a[u].v[e] = static_cast<T>(static_cast<float>(a[u].v[e]) * s);
        tigon::store_vec(row + (v + u * 256) * kV, a[u]);
      }
    }
    for (; v < vecs; v += 256) {
      tigon::AlignedVec<T, kV> a = tigon::load_vec<kV>(row + v * kV);
#pragma unroll
      for (int e = 0; e < kV; ++e) a.v[e] = static_cast<T>(static_cast<float>(a.v[e]) * s);
      tigon::store_vec(row + v * kV, a);
    }
  }
}

void scale_rows(const Tensor& x, const Tensor& scale) {
  constexpr const char* op = "tigon.scale_rows";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  check_cuda(scale, x, op, "scale");
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, op, ": 'scale' must be float32");
  TORCH_CHECK_VALUE(scale.is_contiguous(), op, ": 'scale' must be contiguous");
  const bool per_row = scale.numel() != 1;
  TORCH_CHECK_VALUE(!per_row || scale.numel() == X.rows, op, ": 'scale' must hold 1 or ", X.rows,
                    " values, has ", scale.numel());
  if (X.rows == 0 || X.cols == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(X.rows, std::int64_t{sms} * 8));
  const std::int64_t stride = X.stride == 0 ? X.cols : X.stride;
  dispatch_float(x.scalar_type(), op, "x", [&](auto tt) {
    using T = typename decltype(tt)::type;
    constexpr int kV = 16 / sizeof(T);
    T* p = static_cast<T*>(X.ptr);
    const cudaStream_t stream = current_stream(x);
    if (X.cols % kV == 0 && tigon::rows_aligned(p, stride, kV)) {
      scale_rows_kernel<T, kV><<<blocks, 256, 0, stream>>>(p, X.rows, X.cols, stride, scale.data_ptr<float>(), per_row);
    } else {
      scale_rows_kernel<T, 1><<<blocks, 256, 0, stream>>>(p, X.rows, X.cols, stride, scale.data_ptr<float>(), per_row);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The smallest and largest target that is not ignore_index (an ignored target counts as 0, a valid
// class of any vocabulary) and the number of targets that are not ignore_index, for the losses' eager
// target check: one launch whose blocks each write their (min, max, count) straight into mapped
// pinned host memory, then one synchronisation of the current stream, with no device allocation and
// no copy (check_targets reports the synchronisation when CUDA's sync debug mode is "warn"). The host
// buffers (one per device, kRangeBlocks triples) are allocated on first use and kept for the life of
// the process; a mutex per device holds one across its launch and synchronisation.
constexpr int kRangeThreads = 256;
constexpr int kRangeBlocks = 32;

template <class I>
__global__ void __launch_bounds__(kRangeThreads) target_range_kernel(const I* target, std::int64_t n,
                                                                     std::int64_t ignore_index, long long* out) {
  long long lo = 0, hi = 0, count = 0;
  for (std::int64_t i = blockIdx.x * std::int64_t{kRangeThreads} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * kRangeThreads) {
    long long v = static_cast<long long>(target[i]);
    const bool ignored = v == ignore_index;
    v = ignored ? 0 : v;
    count += ignored ? 0 : 1;
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  using Reduce = cub::BlockReduce<long long, kRangeThreads>;
  __shared__ typename Reduce::TempStorage tmp[3];
  lo = Reduce(tmp[0]).Reduce(lo, cuda::minimum<long long>{});
  hi = Reduce(tmp[1]).Reduce(hi, cuda::maximum<long long>{});
  count = Reduce(tmp[2]).Sum(count);
  if (threadIdx.x == 0) {
    volatile long long* o = out + 3 * blockIdx.x;
    o[0] = lo;
    o[1] = hi;
    o[2] = count;
  }
}

std::vector<std::int64_t> target_range(const Tensor& target, std::int64_t ignore_index) {
  constexpr const char* op = "tigon.target_range";
  TORCH_CHECK_VALUE(target.is_cuda(), op, ": 'target' must be a CUDA tensor, got ", target.device());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.is_contiguous(), op, ": 'target' must be 1-D and contiguous, got shape ",
                    target.sizes(), " and strides ", target.strides());
  const std::int64_t n = target.numel();
  if (n == 0) return {0, 0, 0};
  const c10::cuda::CUDAGuard guard(target.device());
  const int device = target.get_device();
  TORCH_CHECK_VALUE(device >= 0 && device < tigon::detail::kMaxDevices, op, ": device ordinal ", device, " is out of range");
  struct Slot {
    std::once_flag once;
    std::mutex mutex;
    long long* host = nullptr;
    long long* dev = nullptr;
  };
  static Slot slots[tigon::detail::kMaxDevices];
  Slot& s = slots[device];
  std::call_once(s.once, [&] {
    void* h = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&h, sizeof(long long) * 3 * kRangeBlocks, cudaHostAllocMapped | cudaHostAllocPortable));
    void* d = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&d, h, 0));
    s.host = static_cast<long long*>(h);
    s.dev = static_cast<long long*>(d);
  });
  const auto blocks = static_cast<int>(std::min<std::int64_t>(kRangeBlocks, (n + 8 * kRangeThreads - 1) / (8 * kRangeThreads)));
  const cudaStream_t stream = current_stream(target);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TORCH_CHECK_VALUE(capture == cudaStreamCaptureStatusNone, op,
                    ": the target check synchronises the host, which a stream being captured into a CUDA graph "
                    "does not allow (count_invalid_targets counts bad targets without synchronising)");
  const std::lock_guard<std::mutex> lock(s.mutex);
  dispatch_index(target.scalar_type(), op, [&](auto ti) {
    using I = typename decltype(ti)::type;
    target_range_kernel<I><<<blocks, kRangeThreads, 0, stream>>>(static_cast<const I*>(target.data_ptr()), n,
                                                                 ignore_index, s.dev);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  long long lo = 0, hi = 0, count = 0;
  for (int b = 0; b < blocks; ++b) {
    const volatile long long* o = s.host + 3 * b;
    const long long block_lo = o[0], block_hi = o[1], block_count = o[2];
    lo = std::min(lo, block_lo);
    hi = std::max(hi, block_hi);
    count += block_count;
  }
  return {static_cast<std::int64_t>(lo), static_cast<std::int64_t>(hi), static_cast<std::int64_t>(count)};
}

// One cuBLASLt back end per (device, stream): cuBLASLt plans are cached per shape inside it. Kept for
// the life of the process (never destroyed, so nothing runs at exit after CUDA has gone). Its 32 MiB
// workspace is taken from torch's caching allocator for each call and released with it: a workspace
// held across calls would, if first taken inside a CUDA-graph capture (torch.compile's
// "reduce-overhead" warm-up, torch.cuda.graph), stay alive in that graph's memory pool, which
// CUDA-graph trees reject; taken per call it costs one cached block.
constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

std::mutex& gemm_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

tigon::CublasLtGemm& gemm_for(const Tensor& ref, cudaStream_t stream) {
  static auto* slots = new std::map<std::pair<int, cudaStream_t>, tigon::CublasLtGemm*>;
  const std::pair<int, cudaStream_t> key{ref.device().index(), stream};
  auto it = slots->find(key);
  if (it == slots->end()) {
    // A stream's first call may come inside a CUDA-graph capture (torch.cuda.graph captures on a
    // stream of its own; torch.compile's "reduce-overhead" warm-up): the handle is made under the
    // relaxed capture mode, in which the calls of cuBLASLt's set-up that a capture forbids (it may
    // allocate) run instead of invalidating the capture. Outside a capture the mode changes nothing.
    std::unique_ptr<tigon::CublasLtGemm> gemm;
    {
      const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      gemm = std::make_unique<tigon::CublasLtGemm>(nullptr, kGemmWorkspaceBytes);
    }
    check_status(gemm->status());
    it = slots->emplace(key, gemm.release()).first;
  }
  return *it->second;
}

// A chunked head's call: its workspace from the caching allocator (bytes as `query` returns them), or
// the caller's `given` byte tensor, then `run(args, gemm, stream)` with the stream's cuBLASLt back end,
// under the back ends' lock.
template <class A, class Query, class Run>
void run_on_gemm(const Tensor& x, A& a, Query&& query, Run&& run, const OptTensor& given = OptTensor()) {
  std::size_t bytes = 0;
  check_status(query(a, bytes));
  Tensor ws;
  if (given) {
    check_cuda(*given, x, "tigon", "kept");
    TORCH_CHECK_VALUE(given->scalar_type() == at::kByte && given->is_contiguous() &&
                          static_cast<std::size_t>(given->numel()) >= bytes,
                      "tigon: 'kept' must be a contiguous uint8 tensor of at least ", bytes, " bytes, got ",
                      given->numel(), " (", given->scalar_type(), ")");
    ws = *given;
  } else {
    ws = workspace(bytes, x);
  }
  a.workspace = workspace_ptr(ws);
  a.workspace_bytes = bytes;
  const Tensor gemm_ws = workspace(kGemmWorkspaceBytes, x);
  const cudaStream_t stream = current_stream(x);
  const std::lock_guard<std::mutex> lock(gemm_mutex());
  tigon::CublasLtGemm& gemm = gemm_for(x, stream);
  gemm.set_workspace(gemm_ws.data_ptr());
  check_status(run(a, gemm, stream));
}

void linear_cross_entropy(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& target,
                          const OptTensor& class_weights, const OptTensor& grad_output, const OptTensor& dx,
                          const OptTensor& dweight, const OptTensor& dbias, const OptTensor& loss,
                          const OptTensor& loss_rows, const OptTensor& z_loss, const OptTensor& lse,
                          const OptTensor& argmax, std::int64_t ignore_index, double label_smoothing,
                          double z_loss_scale, double softcap, std::int64_t reduction, double grad_scale,
                          bool token_scaling, std::int64_t chunk) {
  constexpr const char* op = "tigon.linear_cross_entropy";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows Wm = rows_of(weight, x, x.scalar_type(), op, "weight");
  TORCH_CHECK_VALUE(Wm.cols == X.cols, op, ": weight is [", Wm.rows, ", ", Wm.cols, "], x has ", X.cols,
                    " columns");
  TORCH_CHECK_VALUE(Wm.stride == 0 || Wm.stride == Wm.cols, op, ": weight must be contiguous");
  if (bias) vector_of(*bias, x, x.scalar_type(), Wm.rows, op, "bias");
  Rows DX;
  if (dx) {
    DX = rows_of(*dx, x, x.scalar_type(), op, "dx");
    same_shape(X, DX, op, "x", "dx");
  }
  const at::ScalarType gt = head_grad_dtype(x, {dweight ? &*dweight : nullptr, dbias ? &*dbias : nullptr}, op);
  if (dweight) {
    const Rows DW = rows_of(*dweight, x, gt, op, "dweight");
    same_shape(Wm, DW, op, "weight", "dweight");
    TORCH_CHECK_VALUE(DW.stride == 0 || DW.stride == DW.cols, op, ": dweight must be contiguous");
  }
  if (dbias) vector_of(*dbias, x, gt, Wm.rows, op, "dbias");
  TORCH_CHECK_VALUE(chunk >= 0, op, ": chunk must be >= 0");
  dispatch_float(x.scalar_type(), op, "x", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_index(target.scalar_type(), op, [&](auto ti) {
      using I = typename decltype(ti)::type;
      dispatch_head_grad<T>(gt, [&](auto tg) {
        using G = typename decltype(tg)::type;
        tigon::LinearCrossEntropyArgs<T, I, G> a;
        fill_loss(a.loss, x, X.rows, Wm.rows, target, class_weights, grad_output, loss, loss_rows, z_loss, lse,
                  argmax, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, grad_scale, op);
        a.loss.token_scaling = token_scaling;
        a.x = static_cast<const T*>(X.ptr);
        a.x_stride = X.stride;
        a.weight = static_cast<const T*>(Wm.ptr);
        a.bias = ptr<const T>(bias);
        a.hidden = X.cols;
        a.dx = static_cast<T*>(DX.ptr);
        a.dx_stride = DX.stride;
        a.dweight = ptr<G>(dweight);
        a.dbias = ptr<G>(dbias);
        a.chunk = chunk;
        run_on_gemm(
            x, a, [](const auto& q, std::size_t& b) { return tigon::linear_cross_entropy_workspace_bytes(q, b); },
            [](const auto& q, auto& g, cudaStream_t st) { return tigon::linear_cross_entropy(q, g, st); });
      });
    });
  });
}

// K heads over the same x (tigon/loss/linear_cross_entropy.cuh's linear_cross_entropy_heads): weights,
// biases (empty or one per head), dweights and dbiases (empty or one per head) as lists; targets
// [K, rows]; loss_rows [K, rows] and grad_output (one value, or [K, rows] for reduction none).
void linear_cross_entropy_heads(const Tensor& x, at::TensorList weights, at::TensorList biases, const Tensor& targets,
                                const OptTensor& class_weights, const OptTensor& grad_output,
                                at::ArrayRef<double> head_weights, const OptTensor& dx, at::TensorList dweights,
                                at::TensorList dbiases, const OptTensor& loss, const OptTensor& head_losses,
                                const OptTensor& loss_rows, const OptTensor& z_loss, std::int64_t ignore_index,
                                double label_smoothing, double z_loss_scale, double softcap, std::int64_t reduction,
                                double grad_scale, std::int64_t chunk) {
  constexpr const char* op = "tigon.linear_cross_entropy_heads";
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const auto heads = static_cast<std::int64_t>(weights.size());
  TORCH_CHECK_VALUE(heads >= 1 && heads <= tigon::kMaxLceHeads, op, ": 1 to ", tigon::kMaxLceHeads,
                    " heads, got ", heads);
  TORCH_CHECK_VALUE(biases.empty() || static_cast<std::int64_t>(biases.size()) == heads, op, ": ", biases.size(),
                    " biases for ", heads, " heads");
  TORCH_CHECK_VALUE(dweights.empty() || static_cast<std::int64_t>(dweights.size()) == heads, op, ": ",
                    dweights.size(), " dweights for ", heads, " heads");
  TORCH_CHECK_VALUE(dbiases.empty() || static_cast<std::int64_t>(dbiases.size()) == heads, op, ": ", dbiases.size(),
                    " dbiases for ", heads, " heads");
  TORCH_CHECK_VALUE(dbiases.empty() || !biases.empty(), op, ": dbiases without biases");
  TORCH_CHECK_VALUE(static_cast<std::int64_t>(head_weights.size()) == heads, op, ": ", head_weights.size(),
                    " head_weights for ", heads, " heads");
  const Rows W0 = rows_of(weights[0], x, x.scalar_type(), op, "weights[0]");
  const std::int64_t vocab = W0.rows;
  const at::ScalarType gt = head_grad_dtype(
      x, {dweights.empty() ? nullptr : &dweights[0], dbiases.empty() ? nullptr : &dbiases[0]}, op);
  for (std::int64_t k = 0; k < heads; ++k) {
    const Rows Wk = rows_of(weights[k], x, x.scalar_type(), op, "weights[k]");
    TORCH_CHECK_VALUE(Wk.rows == vocab && Wk.cols == X.cols, op, ": weights[", k, "] is [", Wk.rows, ", ", Wk.cols,
                      "], expected [", vocab, ", ", X.cols, "]");
    TORCH_CHECK_VALUE(Wk.stride == 0 || Wk.stride == Wk.cols, op, ": weights[", k, "] must be contiguous");
    if (!biases.empty()) vector_of(biases[k], x, x.scalar_type(), vocab, op, "biases[k]");
    if (!dweights.empty()) {
      const Rows DW = rows_of(dweights[k], x, gt, op, "dweights[k]");
      same_shape(Wk, DW, op, "weights[k]", "dweights[k]");
      TORCH_CHECK_VALUE(DW.stride == 0 || DW.stride == DW.cols, op, ": dweights[", k, "] must be contiguous");
    }
    if (!dbiases.empty()) vector_of(dbiases[k], x, gt, vocab, op, "dbiases[k]");
  }
  check_cuda(targets, x, op, "targets");
  TORCH_CHECK_VALUE(targets.dim() == 2 && targets.size(0) == heads && targets.size(1) == X.rows &&
                        targets.is_contiguous(),
                    op, ": targets must be a contiguous [", heads, ", ", X.rows, "], got ", targets.sizes());
  Rows DX;
  if (dx) {
    DX = rows_of(*dx, x, x.scalar_type(), op, "dx");
    same_shape(X, DX, op, "x", "dx");
  }
  const bool none = reduction_of(reduction, op) == tigon::Reduction::none;
  auto per_head_rows = [&](const OptTensor& t, const char* name) -> float* {
    if (!t) return nullptr;
    check_cuda(*t, x, op, name);
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": '", name, "' must be float32");
    TORCH_CHECK_VALUE(t->is_contiguous() && t->numel() == heads * X.rows, op, ": '", name, "' must be a contiguous [",
                      heads, ", ", X.rows, "]");
    return t->data_ptr<float>();
  };
  if (head_losses) vector_of(*head_losses, x, at::kFloat, heads, op, "head_losses");
  TORCH_CHECK_VALUE(chunk >= 0, op, ": chunk must be >= 0");
  std::vector<float> hw(head_weights.begin(), head_weights.end());
  dispatch_float(x.scalar_type(), op, "x", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_index(targets.scalar_type(), op, [&](auto ti) {
      using I = typename decltype(ti)::type;
      dispatch_head_grad<T>(gt, [&](auto tg) {
        using G = typename decltype(tg)::type;
        std::vector<const T*> wp, bp;
        std::vector<G*> dwp, dbp;
        for (std::int64_t k = 0; k < heads; ++k) {
          wp.push_back(static_cast<const T*>(weights[k].data_ptr()));
          if (!biases.empty()) bp.push_back(static_cast<const T*>(biases[k].data_ptr()));
          if (!dweights.empty()) dwp.push_back(ptr<G>(dweights[k]));
          if (!dbiases.empty()) dbp.push_back(ptr<G>(dbiases[k]));
        }
        tigon::LinearCrossEntropyHeadsArgs<T, I, G> a;
        fill_loss(a.loss, x, X.rows, vocab, targets[0], class_weights, none ? OptTensor() : grad_output, loss,
                  OptTensor(), z_loss, OptTensor(), OptTensor(), ignore_index, label_smoothing, z_loss_scale, softcap,
                  reduction, grad_scale, op);
        if (none && grad_output) a.loss.grad_output = per_head_rows(grad_output, "grad_output");
        a.loss.loss_rows = per_head_rows(loss_rows, "loss_rows");
        a.targets_stride = X.rows;
        a.x = static_cast<const T*>(X.ptr);
        a.x_stride = X.stride;
        a.hidden = X.cols;
        a.heads = static_cast<int>(heads);
        a.weights = wp.data();
        a.biases = bp.empty() ? nullptr : bp.data();
        a.head_weights = hw.data();
        a.head_losses = ptr<float>(head_losses);
        a.dx = static_cast<T*>(DX.ptr);
        a.dx_stride = DX.stride;
        a.dweights = dwp.empty() ? nullptr : dwp.data();
        a.dbiases = dbp.empty() ? nullptr : dbp.data();
        a.chunk = chunk;
        run_on_gemm(
            x, a, [](const auto& q, std::size_t& b) { return tigon::linear_cross_entropy_heads_workspace_bytes(q, b); },
            [](const auto& q, auto& g, cudaStream_t st) { return tigon::linear_cross_entropy_heads(q, g, st); });
      });
    });
  });
}

// The per-token statistics (forward) or the gradients from their upstream gradients (backward) of
// tigon.linear_logprob; the two share the layout checks.
template <class F>
void with_logprob_args(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                       const Tensor& target, std::int64_t ignore_index, double temperature, std::int64_t chunk,
                       F&& f, at::ScalarType grad_dtype = at::kFloat) {
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows X = rows_of(x, x, x.scalar_type(), op, "x");
  const Rows Wm = rows_of(weight, x, x.scalar_type(), op, "weight");
  TORCH_CHECK_VALUE(Wm.cols == X.cols, op, ": weight is [", Wm.rows, ", ", Wm.cols, "], x has ", X.cols,
                    " columns");
  TORCH_CHECK_VALUE(Wm.stride == 0 || Wm.stride == Wm.cols, op, ": weight must be contiguous");
  if (bias) vector_of(*bias, x, x.scalar_type(), Wm.rows, op, "bias");
  TORCH_CHECK_VALUE(chunk >= 0, op, ": chunk must be >= 0");
  dispatch_float(x.scalar_type(), op, "x", [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_index(target.scalar_type(), op, [&](auto ti) {
      using I = typename decltype(ti)::type;
      dispatch_head_grad<T>(grad_dtype, [&](auto tg) {
        using G = typename decltype(tg)::type;
        tigon::LinearLogProbArgs<T, I, G> a;
        a.x = static_cast<const T*>(X.ptr);
        a.x_stride = X.stride;
        a.weight = static_cast<const T*>(Wm.ptr);
        a.bias = ptr<const T>(bias);
        a.hidden = X.cols;
        a.targets = static_cast<const I*>(vector_of(target, x, target.scalar_type(), X.rows, op, "target"));
        a.tokens = X.rows;
        a.vocab = Wm.rows;
        a.ignore_index = ignore_index;
        a.temperature = static_cast<float>(temperature);
        a.chunk = chunk;
        f(a, X);
      });
    });
  });
}

float* row_values(const OptTensor& t, const Tensor& x, std::int64_t n, const char* op, const char* name) {
  return t ? static_cast<float*>(vector_of(*t, x, at::kFloat, n, op, name)) : nullptr;
}

void linear_logprob(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& target,
                    const OptTensor& logp, const OptTensor& lse, const OptTensor& entropy, const OptTensor& logit_sum,
                    const OptTensor& error_count, std::int64_t ignore_index, double temperature, std::int64_t chunk,
                    const OptTensor& kept, const OptTensor& is_top1) {
  constexpr const char* op = "tigon.linear_logprob";
  with_logprob_args(op, x, weight, bias, target, ignore_index, temperature, chunk, [&](auto& a, const Rows& X) {
    a.logp = row_values(logp, x, X.rows, op, "logp");
    a.lse = row_values(lse, x, X.rows, op, "lse");
    a.entropy = row_values(entropy, x, X.rows, op, "entropy");
    a.logit_sum = row_values(logit_sum, x, X.rows, op, "logit_sum");
    if (error_count) a.error_count = static_cast<int*>(vector_of(*error_count, x, at::kInt, 1, op, "error_count"));
    if (is_top1) a.is_top1 = static_cast<std::uint8_t*>(vector_of(*is_top1, x, at::kBool, X.rows, op, "is_top1"));
    a.keep_logits = kept.has_value();
    run_on_gemm(
        x, a, [](const auto& q, std::size_t& b) { return tigon::linear_logprob_workspace_bytes(q, false, b); },
        [](const auto& q, auto& g, cudaStream_t st) { return tigon::linear_logprob_forward(q, g, st); }, kept);
  });
}

void linear_logprob_bwd(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& target,
                        const Tensor& lse, const OptTensor& entropy, const OptTensor& grad_logp,
                        const OptTensor& grad_entropy, const OptTensor& dx, const OptTensor& dweight,
                        const OptTensor& dbias, std::int64_t ignore_index, double temperature, std::int64_t chunk,
                        bool accumulate, const OptTensor& kept) {
  constexpr const char* op = "tigon.linear_logprob_bwd";
  const at::ScalarType gt = head_grad_dtype(x, {dweight ? &*dweight : nullptr, dbias ? &*dbias : nullptr}, op);
  with_logprob_args(op, x, weight, bias, target, ignore_index, temperature, chunk, [&](auto& a, const Rows& X) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(a.x)>>;
    using G = std::remove_pointer_t<decltype(a.dweight)>;
    a.lse = static_cast<float*>(vector_of(lse, x, at::kFloat, X.rows, op, "lse"));
    a.entropy = row_values(entropy, x, X.rows, op, "entropy");
    a.grad_logp = row_values(grad_logp, x, X.rows, op, "grad_logp");
    a.grad_entropy = row_values(grad_entropy, x, X.rows, op, "grad_entropy");
    if (dx) {
      const Rows DX = rows_of(*dx, x, x.scalar_type(), op, "dx");
      same_shape(X, DX, op, "x", "dx");
      a.dx = static_cast<T*>(DX.ptr);
      a.dx_stride = DX.stride;
    }
    if (dweight) {
      const Rows Wm = rows_of(weight, x, x.scalar_type(), op, "weight");
      const Rows DW = rows_of(*dweight, x, gt, op, "dweight");
      same_shape(Wm, DW, op, "weight", "dweight");
      TORCH_CHECK_VALUE(DW.stride == 0 || DW.stride == DW.cols, op, ": dweight must be contiguous");
      a.dweight = static_cast<G*>(DW.ptr);
    }
    if (dbias) a.dbias = static_cast<G*>(vector_of(*dbias, x, gt, a.vocab, op, "dbias"));
    a.accumulate = accumulate;
    a.keep_logits = kept.has_value();
    run_on_gemm(
        x, a, [](const auto& q, std::size_t& b) { return tigon::linear_logprob_workspace_bytes(q, true, b); },
        [](const auto& q, auto& g, cudaStream_t st) { return tigon::linear_logprob_backward(q, g, st); }, kept);
  }, gt);
}

}  // namespace

TORCH_LIBRARY_IMPL(tigon, CUDA, m) {
  m.impl("cross_entropy", &cross_entropy);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_heads", &linear_cross_entropy_heads);
  m.impl("linear_logprob", &linear_logprob);
  m.impl("linear_logprob_bwd", &linear_logprob_bwd);
  m.impl("scale_rows", &scale_rows);
  m.impl("target_range", &target_range);
}

}  // namespace tigon_torch
