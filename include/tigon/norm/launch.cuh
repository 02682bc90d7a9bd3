// tigon/norm/launch.cuh - the host side the row-wise norms share (RMSNorm, LayerNorm, fused
// residual add + RMSNorm): their policy, the argument checks they have in common, the launch plan
// (which kernel, what grid, how much workspace) and the launches.
//
// A norm describes each direction of itself to this layer with a small struct, its "op":
//
//   T, Args, Params        the row dtype, the launcher's arguments, its kernels' parameters
//   kName                  the launcher's name (errors)
//   validate(args, op)     the argument checks (a backward's take a third argument, true when the
//                          launcher, not the workspace query, asks: it also checks the workspace)
//   params(args)           the kernels' parameters (zero strides resolved)
//   vectorizable<kV>(p)    whether every row pointer, stride and vector allows kV-element accesses
//   compiled<kCols, P>()   its fixed-hidden-size kernel; general<kV>() its any-size kernel
//   with_variant<kCols, P>(args, f)
//                          calls f(std::type_identity<Q>{}), Q the policy its compiled kernel is
//                          instantiated with (RMSNorm's adds the casting mode; SingleInstance: P)
//
// and a backward also kWorkspaceName (the query's name), kTensors (the inputs its compiled kernel
// stages), kAccRows (the fp32 gradient rows its general kernel accumulates), grads(args) (the
// gradients reduced through the workspace), set_workspace(p, args, ws, parts) and
// sum_partials(p, args, parts, stream, op).
//
// The policy and the argument checks compile under any C++20 compiler; the plan and the launches
// need nvcc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/config.hpp"
#include "../core/dispatch.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "row_kernel.cuh"

#if defined(__CUDACC__)
#include <algorithm>

#include "../core/device.hpp"
#include "../core/launch.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// The policy: tuning parameters of the compiled (fixed hidden size) kernels
// ------------------------------------------------------------------------------------------------

// The members every norm policy has, with the defaults of RmsNormPolicy (also add + RMSNorm's) and
// LayerNormPolicy, which derive from it. To tune, derive from the op's policy and override a
// member, then pass it to a compile-time launcher:
//
//   struct TwoStages : tigon::RmsNormPolicy { static constexpr int kBwdStages = 2; };
//   tigon::rms_norm_backward<bf16, 4096, TwoStages>(args, stream);
struct NormPolicy {
  // Forward: 16-byte vectors each thread handles per row (this sets the row group's width: at 4096
  // bf16, 512 vectors over 128 threads), and the target threads per block (a block holds
  // kFwdBlockThreads / row-group-width rows side by side).
  static constexpr int kFwdVecPerThread = 4;
  static constexpr int kFwdBlockThreads = 256;
  // Forward: the second __launch_bounds__ argument, a floor on the resident blocks per SM that caps
  // registers (0: none).
  static constexpr int kFwdMinBlocksPerSm = 0;
  // Backward: as the forward's; its grid is persistent, one partial gradient row per row group.
  static constexpr int kBwdVecPerThread = 2;
  static constexpr int kBwdBlockThreads = 512;
  static constexpr int kBwdMinBlocksPerSm = 1;
  // Backward: rows each row group keeps in flight through shared memory (cp.async), lowered
  // automatically when they do not fit in a block's shared memory.
  static constexpr int kBwdStages = 3;
};

namespace detail {

// The static checks of a policy, in one place; every launcher asserts them.
template <class P>
constexpr bool check_policy() {
  static_assert(P::kFwdVecPerThread >= 1 && P::kFwdVecPerThread <= 32,
                "kFwdVecPerThread: 1 to 32 vectors per thread");
  static_assert(P::kBwdVecPerThread >= 1 && P::kBwdVecPerThread <= 32,
                "kBwdVecPerThread: 1 to 32 vectors per thread");
  static_assert(P::kFwdBlockThreads >= 1 && P::kFwdBlockThreads <= 1024,
                "kFwdBlockThreads: 1 to 1024 threads");
  static_assert(P::kBwdBlockThreads >= 1 && P::kBwdBlockThreads <= 1024,
                "kBwdBlockThreads: 1 to 1024 threads");
  static_assert(P::kFwdMinBlocksPerSm >= 0 && P::kFwdMinBlocksPerSm <= 32,
                "kFwdMinBlocksPerSm: 0 (no bound) to 32 blocks per SM");
  static_assert(P::kBwdMinBlocksPerSm >= 0 && P::kBwdMinBlocksPerSm <= 32,
                "kBwdMinBlocksPerSm: 0 (no bound) to 32 blocks per SM");
  static_assert(P::kBwdStages >= 1, "kBwdStages: at least one stage");
  return true;
}

// ------------------------------------------------------------------------------------------------
// Argument checks (host only, before anything touches the device)
// ------------------------------------------------------------------------------------------------

// Row lengths are indexed with 32-bit integers inside a row.
inline constexpr std::int64_t kRowMaxCols = std::int64_t{1} << 30;

// A matrix (or a vector: one row) and its argument name, for the aliasing checks.
struct Named {
  MatrixView m;
  const char* name;
};
template <class T>
Named matrix(const T* p, std::int64_t rows, std::int64_t cols, std::int64_t stride, const char* name) {
  return {MatrixView::of(p, rows, cols, stride), name};
}
template <class T>
Named row_vector(const T* p, std::int64_t n, const char* name) {
  return {MatrixView::of(p, 1, n, 0), name};
}

// Each pointer non-null, in order.
inline Status check_not_null(std::initializer_list<std::pair<const void*, const char*>> ptrs,
                             const char* op) {
  for (const auto& [p, name] : ptrs) TIGON_CHECK(check::not_null(p, op, name));
  return Status();
}

// rows and cols positive, cols at most kRowMaxCols, each row stride 0 (contiguous) or >= cols.
inline Status check_rows(std::int64_t rows, std::int64_t cols,
                         std::initializer_list<std::pair<std::int64_t, const char*>> strides,
                         const char* op) {
  TIGON_CHECK(check::positive(rows, op, "rows"));
  TIGON_CHECK(check::positive(cols, op, "cols"));
  TIGON_CHECK(check::at_most(cols, kRowMaxCols, op, "cols"));
  for (const auto& [stride, name] : strides) TIGON_CHECK(check::row_stride(stride, cols, op, name));
  return Status();
}

inline Status check_eps(float eps, const char* op) {
  if (check::finite_in(eps, 0.0f)) return Status();
  return Status::error(Errc::invalid_value, op, "eps", "must be finite and >= 0");
}

// `out` is the very same matrix as each of `ins` (in place) or disjoint from it.
inline Status check_same_or_disjoint(const Named& out, std::initializer_list<Named> ins, const char* op) {
  for (const Named& in : ins) TIGON_CHECK(check::same_or_disjoint(out.m, in.m, op, out.name, in.name));
  return Status();
}

// `out` overlaps none of `others` (nothing to check when either is null).
inline Status check_disjoint(const Named& out, std::initializer_list<Named> others, const char* op) {
  for (const Named& o : others) TIGON_CHECK(check::disjoint(out.m, o.m, op, out.name, o.name));
  return Status();
}

// Workspace of `parts` fp32 partial rows of `cols` columns, 256-byte aligned.
constexpr std::size_t partial_rows_bytes(std::int64_t parts, std::int64_t cols) {
  return round_up<std::size_t>(static_cast<std::size_t>(parts) * static_cast<std::size_t>(cols) * 4u,
                               256u);
}

// What a backward launcher checks of its workspace (with_workspace: the launcher, not the
// workspace query): present, aligned and at least one partial row per gradient, and the bytes the
// call uses disjoint from every buffer of the call: the partial rows every plan writes before the
// device is asked for its plan, all `used` bytes of the plan after.
inline Status check_partials_workspace(bool with_workspace, int grads, const void* ws, std::size_t bytes,
                                       std::int64_t cols, const char* op, std::initializer_list<Named> buffers,
                                       std::size_t used = 0) {
  if (!with_workspace || grads == 0) return Status();
  const std::size_t need = partial_rows_bytes(grads, cols);
  TIGON_CHECK(check::workspace(ws, bytes, need, op));
  const auto n = static_cast<std::int64_t>(used > need ? used : need);
  return check_disjoint({MatrixView::of(static_cast<const unsigned char*>(ws), 1, n), "workspace"}, buffers, op);
}

// ------------------------------------------------------------------------------------------------
// Launch plan (host + device constants)
// ------------------------------------------------------------------------------------------------

// Which kernel a launch uses: the compiled instance of its hidden size, or the general (any size)
// kernel with 16-byte vectors or with single elements.
enum class RowKernel { compiled, general_vec, general_scalar };

struct RowPlan {
  RowKernel kernel = RowKernel::general_scalar;
  int grid = 0;
  int parts = 0;  // partial gradient rows the kernel writes per gradient (backward)
  std::int64_t resident = 0;  // compiled kernel: blocks resident at once (one wave)
  std::size_t workspace_bytes = 0;
};

// The general (any hidden size) kernels: one block of kGeneralThreads per row at a time over a
// grid of resident blocks (kGeneralBwdBlocksPerSm per SM in the backward); the backward
// accumulates its fp32 gradient rows in shared memory while they total at most kGeneralAccFloats
// floats (44 KB, under the 48 KB default), in its partial rows of the workspace beyond.
inline constexpr int kGeneralThreads = 256;
inline constexpr int kGeneralBwdBlocksPerSm = 2;
inline constexpr std::int64_t kGeneralAccFloats = 11264;

// The kCols of the runtime-dispatch launchers: the compiled instance is the one of TIGON_HIDDEN_SIZES
// that args.cols names, if any.
inline constexpr int kAnyCols = -1;

// The zero stride of an argument struct (contiguous rows) resolved to the row length.
constexpr std::int64_t resolved_stride(std::int64_t stride, std::int64_t cols) {
  return stride != 0 ? stride : cols;
}

// with_variant of an op whose compiled kernel is instantiated with the policy itself.
struct SingleInstance {
  template <int kCols, class P, class A, class F>
  static Status with_variant(const A&, F&& f) {
    return f(std::type_identity<P>{});
  }
};

// The hidden size of a compile-time launcher must be the arguments'.
inline Status check_compiled_cols(int compiled, std::int64_t cols, const char* op) {
  if (cols == compiled) return Status();
  return Status::error(Errc::invalid_size, op, "cols",
                       std::to_string(cols) + " does not match the compiled hidden size " +
                           std::to_string(compiled));
}

}  // namespace detail

#if defined(__CUDACC__)

namespace detail {

// Plan of a compiled row kernel with `groups` row groups per block: a persistent grid (the blocks
// resident at once, at most one per `groups` rows) or one block per `groups` rows. parts: the row
// groups of a persistent launch, each writing one partial gradient row (backward kernels run
// persistent, so that this stays a few hundred rows); 0 for a non-persistent one.
template <auto Kernel, int kThreads, int kSmem>
Status plan_compiled_rows(std::int64_t rows, int groups, bool persistent, const DeviceInfo& dev,
                          RowPlan& plan) {
  int occ = 0;
  TIGON_CHECK((blocks_per_sm<Kernel, kThreads, kSmem>(dev.device, occ)));
  const std::int64_t blocks = ceil_div<std::int64_t>(rows, groups);
  const std::int64_t resident = static_cast<std::int64_t>(occ) * dev.sm_count;
  plan.kernel = RowKernel::compiled;
  plan.grid = static_cast<int>(std::min<std::int64_t>(blocks, persistent ? resident : 0x7fffffff));
  plan.resident = resident;
  plan.parts = persistent ? plan.grid * groups : 0;
  return Status();
}

// Forward (kCols == 0: the general kernels only): the compiled kernel, one block per row-group set,
// when the pointers allow its vector accesses; else the general kernel over the resident blocks.
template <class Op, int kCols, class P>
Status plan_forward(const typename Op::Params& p, const DeviceInfo& dev, RowPlan& plan) {
  using T = typename Op::T;
  plan = RowPlan{};
  if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
    using S = FwdRowShape<T, kCols, P>;
    if (Op::template vectorizable<S::kVec>(p)) {
      return plan_compiled_rows<Op::template compiled<kCols, P>(), S::kThreads, 0>(
          p.rows, S::kGroups, false, dev, plan);
    }
  }
  int occ = 0;
  if (Op::template vectorizable<kVecElems<T>>(p)) {
    plan.kernel = RowKernel::general_vec;
    TIGON_CHECK((blocks_per_sm<Op::template general<kVecElems<T>>(), kGeneralThreads>(dev.device, occ)));
  } else {
    plan.kernel = RowKernel::general_scalar;
    TIGON_CHECK((blocks_per_sm<Op::template general<1>(), kGeneralThreads>(dev.device, occ)));
  }
  plan.grid = static_cast<int>(
      std::min<std::int64_t>(p.rows, static_cast<std::int64_t>(occ) * dev.sm_count));
  return Status();
}

// Backward: the compiled kernel on a persistent grid when the pointers allow its vector accesses
// and its pipeline fits this device's shared memory, else the general kernel; the workspace holds
// `parts` partial rows for each of the `grads` gradients.
template <class Op, int kCols, class P>
Status plan_backward(const typename Op::Params& p, int grads, const DeviceInfo& dev, RowPlan& plan) {
  using T = typename Op::T;
  plan = RowPlan{};
  bool compiled = false;
  if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
    using S = BwdRowShape<T, kCols, P>;
    constexpr int kSmem = BwdRowPipe<T, kCols, P, Op::kTensors>::kSmemBytes;
    if (Op::template vectorizable<S::kVec>(p) && kSmem + 1024 <= dev.smem_per_block_optin) {
      TIGON_CHECK((plan_compiled_rows<Op::template compiled<kCols, P>(), S::kThreads, kSmem>(
          p.rows, S::kGroups, true, dev, plan)));
      compiled = true;
    }
  }
  if (!compiled) {
    plan.kernel = Op::template vectorizable<kVecElems<T>>(p) ? RowKernel::general_vec
                                                              : RowKernel::general_scalar;
    plan.grid = static_cast<int>(std::min<std::int64_t>(
        p.rows, static_cast<std::int64_t>(kGeneralBwdBlocksPerSm) * dev.sm_count));
    plan.parts = plan.grid;
  }
  plan.workspace_bytes =
      grads == 0 ? 0 : partial_rows_bytes(static_cast<std::int64_t>(plan.parts) * grads, p.cols);
  return Status();
}

template <class Op, int kCols, class P>
Status launch_forward(const typename Op::Params& p, const RowPlan& plan, cudaStream_t stream) {
  using T = typename Op::T;
  const dim3 grid(static_cast<unsigned>(plan.grid));
  if (plan.kernel == RowKernel::compiled) {
    if constexpr (compiled_available<FwdRowShape, T, kCols, P>()) {
      typename Op::Params q = p;
      if constexpr (requires { q.wave_blocks; }) q.wave_blocks = plan.resident;  // the prefetch's waves
      return launch(Op::kName, Op::template compiled<kCols, P>(),
                    {grid, dim3(FwdRowShape<T, kCols, P>::kThreads), 0, stream}, q);
    }
    return Status();
  }
  const auto kernel = plan.kernel == RowKernel::general_vec ? Op::template general<kVecElems<T>>()
                                                            : Op::template general<1>();
  return launch(Op::kName, kernel, {grid, dim3(kGeneralThreads), 0, stream}, p);
}

// The row kernel, then the fixed-order column sums of the partial gradient rows.
template <class Op, int kCols, class P>
Status launch_backward(const typename Op::Params& p, const typename Op::Args& a, const RowPlan& plan,
                       cudaStream_t stream) {
  using T = typename Op::T;
  const dim3 grid(static_cast<unsigned>(plan.grid));
  if (plan.kernel == RowKernel::compiled) {
    if constexpr (compiled_available<BwdRowShape, T, kCols, P>()) {
      TIGON_CHECK(launch(Op::kName, Op::template compiled<kCols, P>(),
                         {grid, dim3(BwdRowShape<T, kCols, P>::kThreads),
                          BwdRowPipe<T, kCols, P, Op::kTensors>::kSmemBytes, stream},
                         p));
    }
  } else {
    const bool smem_acc = Op::grads(a) > 0 && p.cols * Op::kAccRows <= kGeneralAccFloats;
    const std::size_t smem =
        smem_acc ? static_cast<std::size_t>(Op::kAccRows * p.cols) * sizeof(float) : 0;
    const auto kernel = plan.kernel == RowKernel::general_vec ? Op::template general<kVecElems<T>>()
                                                              : Op::template general<1>();
    TIGON_CHECK(launch(Op::kName, kernel, {grid, dim3(kGeneralThreads), smem, stream}, p, smem_acc));
  }
  return Op::sum_partials(p, a, plan.parts, stream, Op::kName);
}

// One compiled size (0: the general kernels only) and one instance policy.
template <class Op, int kCols, class P>
Status forward_fixed(const typename Op::Args& a, cudaStream_t stream) {
  const typename Op::Params p = Op::params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_forward<Op, kCols, P>(p, dev, plan)));
  return launch_forward<Op, kCols, P>(p, plan, stream);
}

template <class Op, int kCols, class P>
Status backward_fixed(const typename Op::Args& a, cudaStream_t stream, std::size_t* query) {
  typename Op::Params p = Op::params(a);
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  RowPlan plan;
  TIGON_CHECK((plan_backward<Op, kCols, P>(p, Op::grads(a), dev, plan)));
  if (query != nullptr) {  // the workspace query: the same plan, nothing launched
    *query = plan.workspace_bytes;
    return Status();
  }
  TIGON_CHECK(check::workspace(a.workspace, a.workspace_bytes, plan.workspace_bytes, Op::kName));
  TIGON_CHECK(Op::validate(a, Op::kName, true, plan.workspace_bytes));  // all the bytes the plan uses
  Op::set_workspace(p, a, static_cast<float*>(a.workspace), plan.parts);
  return launch_backward<Op, kCols, P>(p, a, plan, stream);
}

// Calls f(IntC<N>{}, std::type_identity<Q>{}): N the compiled hidden size the call uses (0: the
// general kernels only), Q the policy of its compiled instance. kCols == kAnyCols: N is args.cols
// when TIGON_HIDDEN_SIZES lists it; else N is kCols, which args.cols must equal.
template <class Op, int kCols, class P, class F>
Status with_instance(const typename Op::Args& a, const char* op, F&& f) {
  static_assert(check_policy<P>());
  auto sized = [&](auto n) {
    return Op::template with_variant<decltype(n)::value, P>(a, [&](auto q) { return f(n, q); });
  };
  if constexpr (kCols == kAnyCols) {
    return dispatch_int(HiddenSizes{}, a.cols, sized, [&] { return sized(IntC<0>{}); });
  } else {
    static_assert(kCols > 0, "the compiled hidden size must be positive");
    TIGON_CHECK(check_compiled_cols(kCols, a.cols, op));
    return sized(IntC<kCols>{});
  }
}

// The launchers of every norm: validate, pick the instance, plan, launch.
template <class Op, int kCols, class P>
Status norm_forward(const typename Op::Args& a, cudaStream_t stream) {
  TIGON_CHECK(Op::validate(a, Op::kName));
  return with_instance<Op, kCols, P>(a, Op::kName, [&](auto n, auto q) {
    return forward_fixed<Op, decltype(n)::value, typename decltype(q)::type>(a, stream);
  });
}

template <class Op, int kCols, class P>
Status norm_backward_workspace_bytes(const typename Op::Args& a, std::size_t& bytes) {
  bytes = 0;
  TIGON_CHECK(Op::validate(a, Op::kWorkspaceName, false));
  return with_instance<Op, kCols, P>(a, Op::kWorkspaceName, [&](auto n, auto q) {
    return backward_fixed<Op, decltype(n)::value, typename decltype(q)::type>(a, nullptr, &bytes);
  });
}

template <class Op, int kCols, class P>
Status norm_backward(const typename Op::Args& a, cudaStream_t stream) {
  TIGON_CHECK(Op::validate(a, Op::kName, true));
  return with_instance<Op, kCols, P>(a, Op::kName, [&](auto n, auto q) {
    return backward_fixed<Op, decltype(n)::value, typename decltype(q)::type>(a, stream, nullptr);
  });
}

}  // namespace detail

#endif  // __CUDACC__

TIGON_NAMESPACE_END
