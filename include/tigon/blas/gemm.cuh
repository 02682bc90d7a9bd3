// tigon/blas/gemm.cuh - the GEMM the composite ops (linear cross-entropy, the MLP example) are
// built on, in row-major terms, with cuBLASLt as the default back end:
//
//   D[M, N] = alpha * op_a(A) * op_b(B) + beta * C + bias   (fp32 accumulation, one rounding to D's type)
//
// A and B are float / half / bfloat16; C and D share a dtype that may be fp32 (so a weight
// gradient can accumulate in fp32 across chunks with beta = 1). A back end is any type with
// `Status gemm(const GemmArgs<TAB, TD>&, cudaStream_t)`; templates that compose GEMMs take it as a
// parameter so a trainer can plug in its own. A back end may also have
// `Status check(const GemmArgs<TAB, TD>&)`: whether it can run that product (arguments, an
// algorithm for the shape, the bias epilogue when GemmArgs::bias is set) without running it. The
// composite ops check every GEMM of a call that way before their first write, so that a product
// the back end cannot run fails the call while every output is still untouched; a back end without
// check() is trusted to run what it is given, but for products with a bias, which it is not known
// to support.
//
// Link CUDA::cublasLt (the CMake target tigon::blas does).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#if defined(__CUDACC__)
#include "../core/launch.cuh"
#include "../core/math.hpp"
#endif

TIGON_NAMESPACE_BEGIN

enum class Op : int { n = 0, t = 1 };  // op(X) = X or X^T

// Row-major operands: A is [M, K] (op_a n) or [K, M] (op_a t), rows lda elements apart; B is
// [K, N] (op_b n) or [N, K] (op_b t); C and D are [M, N]. Leading dimensions 0 mean contiguous.
// C may be D itself (accumulation), or null when beta is 0. `bias` (optional, [N], D's dtype,
// 16-byte aligned) is added to every row of D in cuBLASLt's epilogue, before D is rounded: the value
// F.linear(x, W, b) produces.
template <class TAB, class TD = TAB>
struct GemmArgs {
  const TAB* a = nullptr;
  const TAB* b = nullptr;
  const TD* c = nullptr;
  TD* d = nullptr;
  const TD* bias = nullptr;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0;
  Op op_a = Op::n;
  Op op_b = Op::n;
  float alpha = 1.0f;
  float beta = 0.0f;
};

// The weight gradients' type G of the chunked heads (linear cross-entropy, its heads, linear log-probs,
// linear divergences), which accumulate them through GemmArgs<T, G>: float (fp32 across the chunks) or
// the weight's own type T (each chunk's product adds into it and rounds once).
template <class T, class G>
inline constexpr bool head_grad_type_ok = std::is_same_v<G, float> || std::is_same_v<G, T>;

namespace detail {

template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>) {
    return CUDA_R_32F;
  } else if constexpr (std::is_same_v<T, __half>) {
    return CUDA_R_16F;
  } else {
    return CUDA_R_16BF;
  }
}

// cuBLAS's name of a status (cublasGetStatusName lives in libcublas, which tigon::blas does not link).
constexpr const char* cublas_status_name(cublasStatus_t s) noexcept {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "an unknown cuBLAS status";
  }
}

// A cuBLAS(Lt) status as a Status: cuda_error with the status's name and number ("cuBLAS status
// CUBLAS_STATUS_NOT_SUPPORTED (15)"), no CUDA runtime error attached.
inline Status from_cublas(cublasStatus_t s, const char* op, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status();
  return Status::error(Errc::cuda_error, op, "",
                       std::string(what) + ": cuBLAS status " + cublas_status_name(s) + " (" +
                           std::to_string(static_cast<int>(s)) + ")");
}

// Stored (row-major) shape of an operand: rows x cols with leading dimension ld.
struct Stored {
  std::int64_t rows, cols, ld;
};

template <class TAB, class TD>
Status validate(const GemmArgs<TAB, TD>& g, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(g.a, op, "a"));
  TIGON_CHECK(not_null(g.b, op, "b"));
  TIGON_CHECK(not_null(g.d, op, "d"));
  TIGON_CHECK(positive(g.m, op, "m"));
  TIGON_CHECK(positive(g.n, op, "n"));
  TIGON_CHECK(positive(g.k, op, "k"));
  if (g.beta != 0.0f && g.c == nullptr) {
    return Status::error(Errc::null_pointer, op, "c", "beta is not 0 but there is no C");
  }
  const std::int64_t a_cols = g.op_a == Op::n ? g.k : g.m;
  const std::int64_t b_cols = g.op_b == Op::n ? g.n : g.k;
  TIGON_CHECK(row_stride(g.lda, a_cols, op, "lda"));
  TIGON_CHECK(row_stride(g.ldb, b_cols, op, "ldb"));
  TIGON_CHECK(row_stride(g.ldc, g.n, op, "ldc"));
  TIGON_CHECK(row_stride(g.ldd, g.n, op, "ldd"));
  const MatrixView d = MatrixView::of(g.d, g.m, g.n, g.ldd);
  TIGON_CHECK(disjoint(d, MatrixView::of(g.a, g.op_a == Op::n ? g.m : g.k, a_cols, g.lda), op, "d", "a"));
  TIGON_CHECK(disjoint(d, MatrixView::of(g.b, g.op_b == Op::n ? g.k : g.n, b_cols, g.ldb), op, "d", "b"));
  if (g.c != nullptr) TIGON_CHECK(same_or_disjoint(d, MatrixView::of(g.c, g.m, g.n, g.ldc), op, "d", "c"));
  if (g.bias != nullptr) {
    if (reinterpret_cast<std::uintptr_t>(g.bias) % 16 != 0) {
      return Status::error(Errc::invalid_value, op, "bias", "must be 16-byte aligned (cuBLASLt's bias epilogue)");
    }
    TIGON_CHECK(disjoint(d, vector_view(g.bias, g.n, sizeof(TD)), op, "d", "bias"));
  }
  return Status();
}

// Whether the back end can run g, without running it: its check() where it has one (CublasLtGemm
// does), else the arguments' validation. A back end without check() is not known to add
// GemmArgs::bias (a back end written before the field would drop it silently): a product with a
// bias is refused there.
template <class Gemm, class TAB, class TD>
Status gemm_check(Gemm& gemm, const GemmArgs<TAB, TD>& g) {
  if constexpr (requires { gemm.check(g); }) {
    return gemm.check(g);
  } else {
    if (g.bias != nullptr) {
      return Status::error(Errc::unsupported, "gemm", "bias",
                           "the GEMM back end has no check(): give it one, which declares that its gemm() adds "
                           "GemmArgs::bias");
    }
    return validate(g, "gemm");
  }
}

// g run on the back end (kRun) or only checked (gemm_check): the composite ops walk their GEMMs
// twice, checking every one, then running them.
template <bool kRun, class Gemm, class TAB, class TD>
Status gemm_run_or_check(Gemm& gemm, const GemmArgs<TAB, TD>& g, cudaStream_t stream) {
  if constexpr (kRun) {
    return gemm.gemm(g, stream);
  } else {
    return gemm_check(gemm, g);
  }
}

// The aligned bias pointer the epilogue reads: `bias` itself when 16-byte aligned, else `slot`
// (which epilogue_bias_copy fills).
template <class T>
const T* epilogue_bias_ptr(const T* bias, T* slot) {
  return bias == nullptr || reinterpret_cast<std::uintptr_t>(bias) % 16 == 0 ? bias : slot;
}

}  // namespace detail

// The default back end: cuBLASLt with fp32 accumulation. Owns a cuBLASLt handle and borrows the
// caller's workspace (a few MB; 32 MB is what cuBLAS recommends on Hopper). The algorithm chosen
// for each shape is cached, so after the first call of a shape a call only enqueues the product:
// no allocation, no synchronisation, graph-capturable. Construct it once per device, outside any
// capture (creating the handle may allocate). One instance may be used by one thread at a time.
class CublasLtGemm {
 public:
  CublasLtGemm(void* workspace, std::size_t workspace_bytes)
      : workspace_(workspace), workspace_bytes_(workspace_bytes) {
    status_ = detail::from_cublas(cublasLtCreate(&handle_), "CublasLtGemm", "cublasLtCreate");
  }
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;
  ~CublasLtGemm() {
    for (auto& [key, plan] : plans_) plan.destroy();
    if (handle_ != nullptr) cublasLtDestroy(handle_);
  }

  // The handle's creation status: check it once after construction.
  const Status& status() const { return status_; }

  // Hands the back end another workspace of the constructed size, for callers whose workspace moves
  // between calls (a caching allocator's block taken per call, so that inside a CUDA-graph capture it
  // comes from the graph's memory pool and is released with the call). The cached algorithms stay.
  void set_workspace(void* workspace) { workspace_ = workspace; }

  // Whether gemm(g, ...) can run: the arguments are valid and cuBLASLt has an algorithm for the
  // shape (found once and cached, as gemm() finds it). Enqueues nothing.
  template <class TAB, class TD>
  [[nodiscard]] Status check(const GemmArgs<TAB, TD>& g) {
    constexpr const char* kOp = "gemm";
    TIGON_CHECK(status_);
    TIGON_CHECK(detail::validate(g, kOp));
    Plan* plan = nullptr;
    return find_plan<TAB, TD>(key_of(g), g, plan);
  }

  template <class TAB, class TD>
  [[nodiscard]] Status gemm(const GemmArgs<TAB, TD>& g, cudaStream_t stream) {
    constexpr const char* kOp = "gemm";
    TIGON_CHECK(status_);
    TIGON_CHECK(detail::validate(g, kOp));
    Plan* plan = nullptr;
    TIGON_CHECK((find_plan<TAB, TD>(key_of(g), g, plan)));
    if (g.bias != nullptr) {
      const void* bias = g.bias;
      TIGON_CHECK(detail::from_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                     &bias, sizeof(bias)),
                                      kOp, "cublasLtMatmulDescSetAttribute"));
    }
    return matmul(*plan, plan->algo, g, stream);
  }

 private:
  // The dtypes, the shape, the leading dimensions, the ops, accumulation, the bias, and the
  // alignment of each operand's pointer (cuBLASLt picks algorithms for the alignment it is told).
  using Key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, int, int, bool, bool, std::array<std::uint32_t, 4>>;

  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t first = nullptr, second = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    void destroy() {
      if (desc) cublasLtMatmulDescDestroy(desc);
      for (auto l : {first, second, c, d})
        if (l) cublasLtMatrixLayoutDestroy(l);
    }
  };

  // Row-major D = op_a(A) op_b(B) is column-major D^T = op_b(B)^T op_a(A)^T: cuBLASLt's first
  // operand is B (stored column-major as B^T) with op_b, its second is A with op_a.
  template <class TAB, class TD>
  static Key key_of(const GemmArgs<TAB, TD>& g) {
    const std::int64_t a_cols = g.op_a == Op::n ? g.k : g.m;
    const std::int64_t b_cols = g.op_b == Op::n ? g.n : g.k;
    const std::int64_t lda = g.lda ? g.lda : a_cols, ldb = g.ldb ? g.ldb : b_cols;
    const std::int64_t ldc = g.ldc ? g.ldc : g.n, ldd = g.ldd ? g.ldd : g.n;
    const void* c = g.c != nullptr ? static_cast<const void*>(g.c) : static_cast<const void*>(g.d);
    return Key{static_cast<int>(detail::cuda_type<TAB>()), static_cast<int>(detail::cuda_type<TD>()),
               g.m, g.n, g.k, lda, ldb, ldc, ldd, static_cast<int>(g.op_a), static_cast<int>(g.op_b),
               g.beta != 0.0f, g.bias != nullptr,
               std::array<std::uint32_t, 4>{alignment(g.b), alignment(g.a), alignment(c), alignment(g.d)}};
  }

  // The largest power of two up to 256 (cuBLASLt's default assumption) that divides the address.
  static std::uint32_t alignment(const void* p) {
    const auto v = reinterpret_cast<std::uintptr_t>(p);
    std::uint32_t a = 256;
    while (a > 1 && v % a != 0) a /= 2;
    return a;
  }

  template <class TAB, class TD>
  Status find_plan(const Key& key, const GemmArgs<TAB, TD>& g, Plan*& out) {
    const auto it = plans_.find(key);
    if (it != plans_.end()) {
      out = &it->second;
      return Status();
    }
    constexpr const char* kOp = "gemm";
    const auto [tab, td, m, n, k, lda, ldb, ldc, ldd, opa, opb, acc, has_bias, align] = key;
    (void)tab, (void)td, (void)acc;
    Plan p;
    auto fail = [&](cublasStatus_t s, const char* what) {
      p.destroy();
      return detail::from_cublas(s, kOp, what);
    };
    cublasStatus_t s = cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatmulDescCreate");
    const cublasOperation_t t_first = opb == 1 ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t t_second = opa == 1 ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t_first, sizeof(t_first));
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &t_second, sizeof(t_second));
    if (has_bias) {
      // Column-major D^T is [n, m]: the bias runs along its rows, i.e. along D's columns.
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = detail::cuda_type<TD>();
      s = cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
      if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatmulDescSetAttribute");
      s = cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
      if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatmulDescSetAttribute");
    }
    // Column-major views: B^T is [b_cols, b_rows], A^T is [a_cols, a_rows], D^T is [n, m].
    const std::uint64_t b_rows = opb == 0 ? k : n, b_cols = opb == 0 ? n : k;
    const std::uint64_t a_rows = opa == 0 ? m : k, a_cols = opa == 0 ? k : m;
    s = cublasLtMatrixLayoutCreate(&p.first, detail::cuda_type<TAB>(), b_cols, b_rows, ldb);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatrixLayoutCreate");
    s = cublasLtMatrixLayoutCreate(&p.second, detail::cuda_type<TAB>(), a_cols, a_rows, lda);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatrixLayoutCreate");
    s = cublasLtMatrixLayoutCreate(&p.c, detail::cuda_type<TD>(), n, m, ldc);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatrixLayoutCreate");
    s = cublasLtMatrixLayoutCreate(&p.d, detail::cuda_type<TD>(), n, m, ldd);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatrixLayoutCreate");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    s = heuristic(p, align, result, found);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(s, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      p.destroy();
      return Status::error(Errc::unsupported, kOp, "", "cuBLASLt has no algorithm for this GEMM");
    }
    p.algo = result.algo;
    out = &plans_.emplace(key, p).first->second;
    (void)g;
    return Status();
  }

  // cuBLASLt's first algorithm for plan p's product within the workspace, for operands of the given
  // alignments (cuBLASLt's A is the first operand, our B; its B the second, our A).
  cublasStatus_t heuristic(const Plan& p, const std::array<std::uint32_t, 4>& align,
                           cublasLtMatmulHeuristicResult_t& result, int& found) {
    cublasLtMatmulPreference_t pref = nullptr;
    cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    const std::size_t ws = workspace_bytes_;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    const cublasLtMatmulPreferenceAttributes_t align_attr[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i]));
    }
    s = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.first, p.second, p.c, p.d, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    return s;
  }

  template <class TAB, class TD>
  Status matmul(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const GemmArgs<TAB, TD>& g,
                cudaStream_t stream) {
    const float alpha = g.alpha, beta = g.beta;
    const void* c = g.c != nullptr ? static_cast<const void*>(g.c) : static_cast<const void*>(g.d);
    return detail::from_cublas(cublasLtMatmul(handle_, plan.desc, &alpha, g.b, plan.first, g.a, plan.second, &beta,
                                              c, plan.c, g.d, plan.d, &algo, workspace_, workspace_bytes_, stream),
                               "gemm", "cublasLtMatmul");
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  Status status_;
  std::map<Key, Plan> plans_;
};

#if defined(__CUDACC__)
namespace detail {

template <class T>
TIGON_KERNEL void __launch_bounds__(256) fill_ones_kernel(T* p, std::int64_t n) {
  grid_dependency_sync();
  for (std::int64_t i = blockIdx.x * 256ll + threadIdx.x; i < n; i += gridDim.x * 256ll) p[i] = from_float<T>(1.0f);
}

// p[0, n) = 1 in T: the ones vector a GEMM sums rows against (the chunked heads' bias gradient,
// db += 1^T dlogits).
template <class T>
Status fill_ones(T* p, std::int64_t n, cudaStream_t stream, const char* op) {
  return launch(op, fill_ones_kernel<T>, {dim3(static_cast<unsigned>(ceil_div<std::int64_t>(n, 256))), dim3(256), 0, stream},
                p, n);
}

// Copies `bias` [n] into `slot` (n elements, 16-byte aligned) on `stream` when epilogue_bias_ptr
// chose the slot: a bias that is not 16-byte aligned, which cuBLASLt's bias epilogue cannot read.
template <class T>
Status epilogue_bias_copy(const T* bias, std::int64_t n, T* slot, cudaStream_t stream, const char* op) {
  if (epilogue_bias_ptr(bias, slot) != slot) return Status();
  return Status::from_cuda(cudaMemcpyAsync(slot, bias, static_cast<std::size_t>(n) * sizeof(T),
                                           cudaMemcpyDeviceToDevice, stream),
                           op, "cudaMemcpyAsync");
}

}  // namespace detail
#endif  // __CUDACC__

TIGON_NAMESPACE_END
