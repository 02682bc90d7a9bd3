// tigon/loss/detail/cross_entropy_kernels.cuh - the cross-entropy kernels: the row kernel, the
// plain and optioned resident kernels, the streaming kernel, and the denominator, reduction and
// split-statistics merge kernels. Included
// by <tigon/loss/cross_entropy.cuh>; not a header to include on its own.
#pragma once

#ifndef TIGON_LOSS_CROSS_ENTROPY_API
#error "include <tigon/loss/cross_entropy.cuh>"
#endif

TIGON_NAMESPACE_BEGIN

namespace detail {

template <class T, class I>
struct CeParams {
  const T* x;
  const I* targets;
  T* dx;
  std::int64_t rows, vocab, xs, dxs;
  const float* weights;
  std::int64_t ignore_index;
  float eps, z, cap, grad_scale;
  bool token_scaling;  // row factor p_t = exp(x_t - lse) on the loss and the gradient
  const float* grad_output;
  Reduction reduction;
  float* loss_rows;   // caller's or workspace scratch
  float* z_rows;      // workspace scratch
  float* lse;
  std::int64_t* argmax;
  int* error_count;
  const float* denom;  // workspace: the mean's denominator
  // Split vocabulary: this shard's columns are [col0, col0 + vocab) of total_vocab.
  std::int64_t col0, total_vocab;
  const CrossEntropyStats* stats;  // merged statistics (finalize), or null: compute them here
  CrossEntropyStats* stats_out;    // shard statistics (stats pass), or null
};

struct CeAcc {  // one thread's (or a block's) running statistics
  float m, s, sum_wx, sum_w, best;
  std::int64_t best_i;
};

struct CeAccMerge {
  TIGON_DEVICE CeAcc operator()(const CeAcc& a, const CeAcc& b) const {
    CeAcc r = a;
    ce_math::merge(r.m, r.s, b.m, b.s);
    r.sum_wx = a.sum_wx + b.sum_wx;
    r.sum_w = a.sum_w + b.sum_w;
    if (b.best > a.best || (b.best == a.best && b.best_i < a.best_i)) {
      r.best = b.best;
      r.best_i = b.best_i;
    }
    return r;
  }
};

template <int kThreads>
struct CeShared {
  typename cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>::TempStorage reduce;
  CeAcc total;
  float x_t;
};

// The logits of one raw vector (softcap applied) in fp32.
template <class T, int kV>
TIGON_DEVICE void to_x(const AlignedVec<T, kV>& v, float cap, float* x) {
#pragma unroll
  for (int k = 0; k < kV; ++k) x[k] = to_float(v.v[k]);
  if (cap > 0.0f) {  // a branch per vector, not a select per element: the rational tanh costs a dozen FMAs
    const float inv = 1.0f / cap;
#pragma unroll
    for (int k = 0; k < kV; ++k) x[k] = cap * ce_math::tanh_rational(x[k] * inv);
  }
}

// exp2_ftz (core/math.hpp): probabilities under 2^-126 of the row's largest are zero in any dtype
// the gradient is written in.

// Fold kN fp32 logits, columns c0 .. c0 + kN - 1, into a thread's running statistics: one rescale
// per call, exp2 with the log2(e) factor folded into an FMA; the first index wins ties.
template <int kN>
TIGON_DEVICE void ce_accumulate(CeAcc& acc, const float* x, std::int64_t c0, bool want_arg, bool smooth,
                                const float* weights) {
  float vm = x[0];
#pragma unroll
  for (int k = 1; k < kN; ++k) vm = fmaxf(vm, x[k]);
  const float mm = fmaxf(vm, acc.m);
  const float mb = mm * kLog2e;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kN; ++k) s += exp2_ftz(fmaf(x[k], kLog2e, -mb));
  acc.s = acc.s * exp2_ftz(fmaf(acc.m, kLog2e, -mb)) + s;
  acc.m = mm;
  if (want_arg && vm > acc.best) {
    int bk = 0;
#pragma unroll
    for (int k = kN - 1; k >= 0; --k) {
      if (x[k] == vm) bk = k;
    }
    acc.best = vm;
    acc.best_i = c0 + bk;
  }
  if (smooth) {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float w = weights != nullptr ? weights[c0 + k] : 1.0f;
      acc.sum_wx += w * x[k];
      acc.sum_w += w;
    }
  }
}

// ---- The per-row steps the kernels share ----

// A logit from its raw value: softcap applied.
template <class T, class I>
TIGON_DEVICE float ce_logit(const CeParams<T, I>& p, T raw) {
  return ce_math::softcap(to_float(raw), p.cap);
}

// The target's logit, or 0 when the target is not in this shard.
template <class T, class I>
TIGON_DEVICE float ce_target_logit(const CeParams<T, I>& p, const T* xr, std::int64_t t) {
  return (t >= 0 && t < p.vocab) ? ce_logit(p, xr[t]) : 0.0f;
}

// The row's terms from its merged statistics. Merged split-vocabulary statistics carry the target's
// weight from the shard that holds it.
// The target's class weight (0 when skipped, 1 without weights).
template <class T, class I>
TIGON_DEVICE float ce_target_weight(const CeParams<T, I>& p, std::int64_t row, std::int64_t t_raw, bool skip) {
  if (skip) return 0.0f;
  if (p.weights == nullptr) return 1.0f;
  return p.stats != nullptr ? p.stats[row].target_weight : p.weights[t_raw];
}

template <class T, class I>
TIGON_DEVICE ce_math::RowTerms ce_row_terms_w(const CeParams<T, I>& p, const CeAcc& total, float lse, float x_t,
                                              float w_t) {
  ce_math::RowTerms terms{};
  terms.lse = lse;
  terms.x_t = x_t;
  terms.w_t = w_t;
  terms.sum_w = p.weights != nullptr ? total.sum_w : static_cast<float>(p.total_vocab);
  terms.sum_wx = total.sum_wx;
  return terms;
}

template <class T, class I>
TIGON_DEVICE ce_math::RowTerms ce_row_terms(const CeParams<T, I>& p, std::int64_t row, const CeAcc& total,
                                            float lse, float x_t, std::int64_t t_raw, bool skip) {
  return ce_row_terms_w(p, total, lse, x_t, ce_target_weight(p, row, t_raw, skip));
}

// The class weights of columns c0 .. c0 + kV - 1 (c0 a multiple of kV): 16-byte loads when wcol is
// 16-byte aligned (wvec; kV is 4 or 8 for 16-byte logit vectors), else one float at a time. The
// weights are read from L2 by every row, once per pass.
template <int kV>
TIGON_DEVICE void ce_load_weights(const float* wcol, int c0, bool wvec, float (&w)[kV]) {
  if constexpr (kV % 4 == 0) {
    if (wvec) {
#pragma unroll
      for (int k = 0; k < kV; k += 4) {
        const float4 q = __ldg(reinterpret_cast<const float4*>(wcol + c0 + k));
        w[k] = q.x;
        w[k + 1] = q.y;
        w[k + 2] = q.z;
        w[k + 3] = q.w;
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kV; ++k) w[k] = __ldg(wcol + c0 + k);
}

// The row's token-scaling factor: its probability of the target, p_t = exp(x_t - lse), or 1.
template <class T, class I>
TIGON_DEVICE float ce_token_factor(const CeParams<T, I>& p, float lse, float x_t) {
  return p.token_scaling ? expf(x_t - lse) : 1.0f;
}

// The row's outputs (loss, z term, lse, argmax; a bad target counted once), by one thread.
template <class T, class I>
TIGON_DEVICE void ce_write_row(const CeParams<T, I>& p, std::int64_t row, const ce_math::RowTerms& terms,
                               const CeAcc& total, bool ignored, bool bad) {
  float l = 0.0f, zl = 0.0f;
  if (bad) {
    l = __int_as_float(0x7fc00000);
    if (p.error_count != nullptr) atomicAdd(p.error_count, 1);
  } else if (!ignored) {
    const float f = ce_token_factor(p, terms.lse, terms.x_t);
    zl = p.z * terms.lse * terms.lse * f;
    l = ce_math::row_loss(terms, p.eps, p.total_vocab) * f + zl;
  }
  p.loss_rows[row] = l;
  if (p.z_rows != nullptr) p.z_rows[row] = zl;
  if (p.lse != nullptr) p.lse[row] = terms.lse;
  if (p.argmax != nullptr) p.argmax[row] = total.best_i;
}

// Whether the cross-entropy part is off: under the mean with class weights whose non-ignored
// targets weigh 0 in all (denom[0] == 0) that part of the loss is 0 by convention, and so is its
// gradient; the z-loss part (over the row count) remains. The gradient formulas then take the
// z-loss's factor as the row's scale, no target weight and no smoothing.
TIGON_DEVICE bool ce_part_off(bool weights, Reduction reduction, float den0) {
  return weights && reduction == Reduction::mean && den0 == 0.0f;
}
template <class T, class I>
TIGON_DEVICE bool ce_part_off(const CeParams<T, I>& p) {
  return ce_part_off(p.weights != nullptr, p.reduction, p.reduction == Reduction::mean ? p.denom[0] : 1.0f);
}

// The factor of the row's gradient: upstream gradient over the mean's denominator (0 when
// skipped; over the row count when the cross-entropy part is off).
template <class T, class I>
TIGON_DEVICE float ce_grad_scale(const CeParams<T, I>& p, std::int64_t row, bool skip) {
  if (skip) return 0.0f;
  const float up = p.grad_output == nullptr ? 1.0f : p.grad_output[p.reduction == Reduction::none ? row : 0];
  const float den = p.reduction == Reduction::mean ? (ce_part_off(p) ? p.denom[1] : p.denom[0]) : 1.0f;
  return p.grad_scale * up / den;
}

// The z-loss scale as the gradient formulas take it, relative to the row's scale: the mean
// divides the cross-entropy part by the non-ignored targets' weight sum (denom[0]) and the z-loss
// part by their count (denom[1]), so with class weights z is scaled by their ratio (by 1 when the
// cross-entropy part is off and the scale is the z-loss's own).
template <class T, class I>
TIGON_DEVICE float ce_z_grad(const CeParams<T, I>& p) {
  if (p.z == 0.0f || p.weights == nullptr || p.reduction != Reduction::mean || ce_part_off(p)) return p.z;
  return p.z * (p.denom[0] / p.denom[1]);
}

// The gradient of one vector of logits (vector index i), written to dr.
template <class T, class I, int kV>
TIGON_DEVICE void ce_grad_vec(const CeParams<T, I>& p, const AlignedVec<T, kV>& raw, int i, T* dr,
                              std::int64_t t, const ce_math::RowTerms& terms, float scale, float zg,
                              const float* wcol, std::uint64_t policy) {
  const std::int64_t c0 = static_cast<std::int64_t>(i) * kV;
  float x[kV];
  to_x<T, kV>(raw, p.cap, x);
  AlignedVec<T, kV> g;
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    const std::int64_t c = c0 + k;
    float v = 0.0f;
    if (scale != 0.0f) {
      const float pr = exp2_ftz(fmaf(x[k], kLog2e, -terms.lse * kLog2e));
      const float w = wcol != nullptr ? wcol[c] : 1.0f;
      v = ce_math::grad(pr, c == t, w, terms, p.eps, zg, p.total_vocab) * ce_math::softcap_grad(x[k], p.cap) *
          scale;
    }
    g.v[k] = from_float<T>(v);
  }
  store_vec_policy(dr + c0, g, policy);
}

// The plain instances' gradient of a vector that does not hold the target: with no smoothing,
// class weights or softcap, d loss / d x_i = scale (w_t p_i + 2 z lse p_i) = p_i * factor, factor =
// scale (w_t + 2 z lse), p_i = 2^(x_i log2(e) - lse log2(e)). A skipped row (scale 0) gets zeros.
template <class T, int kV>
TIGON_DEVICE void ce_grad_vec_plain(const AlignedVec<T, kV>& raw, int i, T* dr, float neg_lse2, float factor,
                                    std::uint64_t policy) {
  float x[kV];
  to_floats(raw, x);
  if (factor == 0.0f) {
#pragma unroll
    for (int k = 0; k < kV; ++k) x[k] = 0.0f;
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) x[k] = exp2_ftz(fmaf(x[k], kLog2e, neg_lse2)) * factor;
  }
  store_vec_policy(dr + static_cast<std::int64_t>(i) * kV, from_floats<T>(x), policy);
}

// The per-row constants of the plain gradient path, and the vector holding the target (-1: none in
// this shard), which takes the general ce_grad_vec.
struct CePlainRow {
  float neg_lse2, factor;
  int t_vec;
};
template <class T, class I, int kV>
TIGON_DEVICE CePlainRow ce_plain_row(const CeParams<T, I>& p, std::int64_t t, const ce_math::RowTerms& terms,
                                     float scale, float zg) {
  CePlainRow r;
  r.neg_lse2 = -terms.lse * kLog2e;
  r.factor = scale == 0.0f ? 0.0f : scale * (terms.w_t + 2.0f * zg * terms.lse);
  r.t_vec = (t >= 0 && t < p.vocab) ? static_cast<int>(t / kV) : -1;
  return r;
}

// One vector's gradient: the plain path unless it holds the target (or the instance is general).
template <class T, class I, int kV, bool kFast>
TIGON_DEVICE void ce_grad_any(const CeParams<T, I>& p, const AlignedVec<T, kV>& raw, int i, T* dr, std::int64_t t,
                              const ce_math::RowTerms& terms, float scale, float zg, const float* wcol,
                              std::uint64_t policy, const CePlainRow& pr) {
  if constexpr (kFast && kV > 1) {  // the 16-byte vector instances
    if (i != pr.t_vec) {
      ce_grad_vec_plain<T, kV>(raw, i, dr, pr.neg_lse2, pr.factor, policy);
      return;
    }
  }
  ce_grad_vec<T, I, kV>(p, raw, i, dr, t, terms, scale, zg, wcol, policy);
}

// Pass 1 over vectors [lo, hi) of row xr into this thread's statistics: vectors lo + tid,
// lo + tid + kThreads, ..., kU of them in flight per trip (read with L2 policy `keep`).
template <class T, class I, int kV, int kThreads, int kU>
TIGON_DEVICE void ce_stats_range(const CeParams<T, I>& p, const T* xr, int lo, int hi, bool want_arg, bool smooth,
                                 const float* wcol, std::uint64_t keep, CeAcc& acc) {
  int i = lo + static_cast<int>(threadIdx.x);
  for (; i + (kU - 1) * kThreads < hi; i += kU * kThreads) {
    AlignedVec<T, kV> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = load_vec_policy<kV>(xr + (i + u * kThreads) * kV, keep);
    // One vector at a time once all kU are in flight: eight fp32 values live, not kU * 8.
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t c0 = static_cast<std::int64_t>(i + u * kThreads) * kV;
      float x[kV];
      to_x<T, kV>(raw[u], p.cap, x);
      ce_accumulate<kV>(acc, x, c0, want_arg, smooth, wcol);
    }
  }
  for (; i < hi; i += kThreads) {
    const std::int64_t c0 = static_cast<std::int64_t>(i) * kV;
    float x[kV];
    to_x<T, kV>(load_vec_policy<kV>(xr + c0, keep), p.cap, x);
    ce_accumulate<kV>(acc, x, c0, want_arg, smooth, wcol);
  }
}

// Pass 2 over vectors [lo, hi) of row xr: the gradient written to dr, newest lines first (the end
// of the range was read last and is the likeliest still in L2), kU vectors in flight per trip.
// kFast (plain instances): vectors without the target take ce_grad_vec_plain.
template <class T, class I, int kV, int kThreads, int kU, bool kFast = false>
TIGON_DEVICE void ce_grad_range(const CeParams<T, I>& p, const T* xr, T* dr, int lo, int hi, std::int64_t t,
                                const ce_math::RowTerms& terms, float scale, const float* wcol,
                                std::uint64_t drop) {
  const float zg = ce_z_grad(p);
  const CePlainRow pr = ce_plain_row<T, I, kV>(p, t, terms, scale, zg);
  int i = hi - 1 - static_cast<int>(threadIdx.x);
  for (; i - (kU - 1) * kThreads >= lo; i -= kU * kThreads) {
    AlignedVec<T, kV> raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = load_vec_policy<kV>(xr + (i - u * kThreads) * kV, drop);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      ce_grad_any<T, I, kV, kFast>(p, raw[u], i - u * kThreads, dr, t, terms, scale, zg, wcol, drop, pr);
    }
  }
  for (; i >= lo; i -= kThreads) {
    ce_grad_any<T, I, kV, kFast>(p, load_vec_policy<kV>(xr + static_cast<std::int64_t>(i) * kV, drop), i, dr, t,
                                 terms, scale, zg, wcol, drop, pr);
  }
}

// The options a call sets, as a mask of CeOption bits (the dispatch picks kernel instances by it).
enum CeOption : unsigned {
  kCeWeights = 1u,
  kCeSmooth = 2u,
  kCeCap = 4u,
  kCeArgmax = 16u,
  kCeToken = 32u,
  kCeStats = 64u,  // the split vocabulary: statistics in (finalize) or out (statistics pass)
};
template <class T, class I>
TIGON_HD unsigned ce_options(const CeParams<T, I>& p) {
  return (p.weights != nullptr ? kCeWeights : 0u) | (p.eps > 0.0f ? kCeSmooth : 0u) | (p.cap > 0.0f ? kCeCap : 0u) |
         (p.argmax != nullptr ? kCeArgmax : 0u) |
         (p.token_scaling ? kCeToken : 0u) | (p.stats != nullptr || p.stats_out != nullptr ? kCeStats : 0u);
}

// The common case (no class weights, smoothing, softcap, argmax or split-vocabulary
// statistics): those fields as compile-time constants, so their per-element work and registers
// drop out of the instance.
template <class T, class I>
TIGON_HD bool ce_plain(const CeParams<T, I>& p) {
  return ce_options(p) == 0u;
}

template <bool kPlain, class T, class I>
TIGON_DEVICE CeParams<T, I> ce_specialise(CeParams<T, I> p) {
  if constexpr (kPlain) {
    p.weights = nullptr;
    p.eps = 0.0f;
    p.cap = 0.0f;
    p.argmax = nullptr;
    p.token_scaling = false;
    p.stats = nullptr;
    p.stats_out = nullptr;
  }
  return p;
}

// ---- The row kernel ----

// One row per block (grid-stride over rows). Pass 1 (unless merged statistics are given): max,
// sum of exp, smoothing sums and argmax over the row, kU vectors in flight per thread, read
// with the evict-last L2 priority. Then the row's loss, and pass 2 (with a gradient): the row
// again, newest lines first (the likeliest still in L2; at 8 rows of 128K logits per SM most of a
// row comes from DRAM again), and the gradient written in place or to dx. kGrad false: the loss
// and statistics alone (p.dx null), an instance without the gradient pass's registers, which
// with options keeps kLossMinBlocks blocks per SM.
template <class T, class I, int kV, int kThreads, int kU, bool kPlain, bool kGrad, int kLossMinBlocks>
TIGON_KERNEL void __launch_bounds__(kThreads, (kGrad || kPlain)           ? 0
                                              : kLossMinBlocks * kThreads > 2048 ? 2048 / kThreads
                                                                                 : kLossMinBlocks)
    ce_row_kernel(const CeParams<T, I> params) {
  detail::grid_dependency_sync();
  const CeParams<T, I> p = ce_specialise<kPlain>(params);
  using Reduce = cub::BlockReduce<CeAcc, kThreads, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  __shared__ CeShared<kThreads> sh;
  const int nvec = static_cast<int>(p.vocab / kV);
  const bool smooth = p.eps > 0.0f;
  const bool want_arg = p.argmax != nullptr;  // in a statistics pass: the finalize will want it
  const std::uint64_t keep = l2_policy<L2Hint::evict_last>();
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const float* wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = p.x + row * p.xs;
    const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
    const std::int64_t t = t_raw - p.col0;  // target column within this shard
    const bool ignored = t_raw == p.ignore_index;
    const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
    CeAcc total;
    if (p.stats == nullptr) {
      CeAcc acc{-__builtin_huge_valf(), 0.0f, 0.0f, 0.0f, -__builtin_huge_valf(), 0};
      ce_stats_range<T, I, kV, kThreads, kU>(p, xr, 0, nvec, want_arg, smooth, wcol, keep, acc);
      acc.best_i += p.col0;
      const CeAcc r = Reduce(sh.reduce).Reduce(acc, CeAccMerge{});
      if (threadIdx.x == 0) {
        sh.total = r;
        sh.x_t = ce_target_logit(p, xr, t);
      }
      __syncthreads();
      total = sh.total;
      if (p.stats_out != nullptr) {  // shard statistics: pass 1 only
        if (threadIdx.x == 0) {
          CrossEntropyStats st{};
          st.max = total.m;
          st.sumexp = total.s;
          st.has_target = (t >= 0 && t < p.vocab) ? 1 : 0;
          st.target_logit = sh.x_t;
          st.target_weight =
              (st.has_target && p.weights != nullptr) ? p.weights[t_raw] : 1.0f;
          st.sum_wx = total.sum_wx;
          st.sum_w = total.sum_w;
          st.argmax_value = total.best;
          st.argmax = total.best_i;
          p.stats_out[row] = st;
        }
        __syncthreads();
        continue;
      }
    } else {
      const CrossEntropyStats& st = p.stats[row];
      total = {st.max, st.sumexp, st.sum_wx, st.sum_w, st.argmax_value, st.argmax};
      if (threadIdx.x == 0) sh.x_t = st.target_logit;
      __syncthreads();
    }
    const float lse = total.m + logf(total.s);
    const ce_math::RowTerms terms = ce_row_terms(p, row, total, lse, sh.x_t, t_raw, ignored || bad);
    if (threadIdx.x == 0) ce_write_row(p, row, terms, total, ignored, bad);
    if (kGrad && p.dx != nullptr) {
      CeParams<T, I> gp = p;
      ce_math::RowTerms gt = terms;
      if (ce_part_off(p)) {  // the z-loss's gradient alone
        gp.eps = 0.0f;
        gt.w_t = 0.0f;
      }
      ce_grad_range<T, I, kV, kThreads, kU, kPlain>(
          gp, xr, p.dx + row * p.dxs, 0, nvec, t, gt,
          ce_grad_scale(p, row, ignored || bad) * ce_token_factor(p, lse, sh.x_t), wcol, drop);
    }
    __syncthreads();  // sh is reused by the next row
  }
}



// ---- The resident kernels ----

// The plain resident kernel (the common case: ce_plain, 16-byte vectors, sm_90+, with a gradient:
// calls without one take the streaming kernel): one row per cluster of csize blocks and one slice
// per block, no block walks rows. Each
// thread loads its kVecs vectors of the slice at once and keeps them in registers, so the logits
// are read from DRAM once and no second pass reads them again; the gradient is written from the
// registers. A block's statistics (max and sum of exp relative to it; block 0's also carry the
// target's logit) go to every block of the cluster through distributed shared memory, one 16-byte
// asynchronous store per block (lane r of warp 0 to block r), counted on the receiver's barrier;
// every block merges the same messages in the same lane order, so all hold the same totals
// (deterministic). The hardware keeps as many blocks per SM as registers allow, each its own row
// slice in its own phase, so the memory pipe stays busy while a block waits for its cluster's
// messages; `ahead` (kResAhead) rows on, each block's slice is asked of the L2 (docs/cross_entropy.md).
// Compile-time instances for single options of 16-bit logits: kArg (the argmax, by ballot per
// warp) and kSmooth (label smoothing without class weights: the sum of the logits beside the sum
// of exp, a second message), alone or together, and kCap (the softcap alone: the gradient terms
// kept as half in the statistics pass). Every other option takes the optioned kernel.

// (m, s) pairs of lanes [0, n) merged across the warp: the max, then each sum rescaled to it and
// added; every lane ends with the same totals, and every block of a cluster, merging the same
// messages in the same order, with the same (deterministic).
TIGON_DEVICE void ce_merge_lanes(int lane, float pm, float ps, int n, float& om, float& os) {
  float mm[1] = {lane < n ? pm : -__builtin_huge_valf()};
  warp_allreduce<32>(mm, MaxOp{});
  float ss[1] = {(lane < n && pm != -__builtin_huge_valf()) ? ps * exp2_ftz((pm - mm[0]) * kLog2e) : 0.0f};
  warp_allreduce_sum<32>(ss);
  om = mm[0];
  os = ss[0];
}

// The softcap's tanh(u), u = x / cap: kCap 1 the rational tanh (ce_math::tanh_rational, accurate to
// fp32), kCap 2 the special-function unit's tanh.approx.f32 (relative error under 2^-10.9, a
// quarter of a bfloat16 rounding; one instruction instead of a dozen FMAs and a divide).
template <int kCap>
TIGON_DEVICE float ce_tanh(float u) {
  if constexpr (kCap == 2) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(u));
    return y;
  } else {
    return ce_math::tanh_rational(u);
  }
}

// The largest (value, column) pair of lanes [0, n), the first column on ties; every lane ends with
// the same pair.
TIGON_DEVICE void ce_argmax_lanes(int lane, int n, float& v, unsigned& c) {
  if (lane >= n) {
    v = -__builtin_huge_valf();
    c = 0xffffffffu;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const unsigned oc = __shfl_xor_sync(0xffffffffu, c, offset);
    if (ov > v || (ov == v && oc < c)) {
      v = ov;
      c = oc;
    }
  }
}

// The warp's first column holding wmax, its largest raw value (bfloat16 / half vectors of a
// resident kernel; 0xffffffff when wmax is -inf): the first vector index j holding it, by
// ballot (a warp's columns run j-major, lane-minor), each lane testing a vector with packed max and
// one packed compare; the first lane of that ballot finds the element. Every lane gets the column.
template <class T, int kV, int kVecs, int kThreads>
TIGON_DEVICE unsigned ce_warp_argmax(const AlignedVec<T, kV> (&raw)[kVecs], int mine, int first, int lane_id,
                                     float wmax) {
  static_assert(PackedMax<T>::kPacked && kV % 2 == 0);
  if (wmax == -__builtin_huge_valf()) return 0xffffffffu;
  using Pair = typename PackedMax<T>::Pair;
  const T r1 = from_float<T>(wmax);  // exact: the max is one of the T values
  const Pair r2(r1, r1);
  auto pair = [&](int j, int k) {
    Pair q;
    __builtin_memcpy(&q, &raw[j].v[k], sizeof(q));
    return q;
  };
  int wj = 0;
  unsigned wb = 0;
#pragma unroll
  for (int j = kVecs - 1; j >= 0; --j) {
    bool has = false;
    if (j * kThreads < mine) {
      Pair q = pair(j, 0);
#pragma unroll
      for (int k = 2; k < kV; k += 2) q = __hmax2(q, pair(j, k));
      has = __heq2_mask(q, r2) != 0u;
    }
    const unsigned bj = __ballot_sync(0xffffffffu, has);
    if (bj != 0u) {
      wj = j;
      wb = bj;
    }
  }
  if (wb == 0u) return 0xffffffffu;
  const int winner = __ffs(static_cast<int>(wb)) - 1;
  unsigned col = 0xffffffffu;
  if (lane_id == winner) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j == wj) {
        int hit = kV;
#pragma unroll
        for (int k = kV - 2; k >= 0; k -= 2) {
          const unsigned e = __heq2_mask(pair(j, k), r2);
          if (e & 0xffff0000u) hit = k + 1;
          if (e & 0x0000ffffu) hit = k;
        }
        if (hit < kV) col = static_cast<unsigned>((first + j * kThreads) * kV + hit);
      }
    }
  }
  return __shfl_sync(0xffffffffu, col, winner);
}

template <class T, class I, int kV, int kThreads, int kVecs, int kMinBlocks, bool kArg, bool kSmooth, bool kCap>
TIGON_KERNEL void __launch_bounds__(kThreads, kMinBlocks) ce_resident_kernel(const CeParams<T, I> params,
                                                                              std::int64_t row0, int slice,
                                                                              int ahead) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kWarps = kThreads / 32;
  __shared__ std::uint64_t bar;
  constexpr bool kSecond = kArg || kSmooth;  // the second message: the sum of x, the argmax
  constexpr unsigned kNoCol = 0xffffffffu;
  __shared__ float4 slots[(kSecond ? 2 : 1) * kCeResMaxCluster];
  __shared__ float2 part[kWarps];
  __shared__ float2 part_w[kSecond ? kWarps : 1];  // per warp: sum of x, then the max's column
  __shared__ float row_lse, row_xt;
  const unsigned csize = cluster_blocks();
  const unsigned rank = cluster_rank();
  const bool solo = csize == 1;  // a row in one block: no messages
  if (!solo) {
    if (threadIdx.x == 0) mbarrier_init(&bar);  // completes after one arrival and the messages' bytes
    cluster_arrive_relaxed();  // this block's barrier is ready for the cluster's messages (the init's fence releases it)
  }
  detail::grid_dependency_sync();
  CeParams<T, I> p = ce_specialise<true>(params);
  if constexpr (kArg) p.argmax = params.argmax;
  if constexpr (kSmooth) p.eps = params.eps;
  if constexpr (kCap) p.cap = params.cap;
  static_assert(!kCap || (!kArg && !kSmooth && PackedMax<T>::kPacked && kV % 2 == 0),
                "the softcap instance: 16-bit logits, no other option");
  // kCap (16-bit logits, the special-function unit's tanh): the statistics pass keeps each
  // element's gradient term 2^14 e_i (1 - u_i^2) as half in place of its raw values, u_i =
  // tanh(x_i / cap) and e_i = exp(cap u_i - m_w) the exponential the sum takes (m_w the warp's
  // capped max; 2^14 keeps the terms off half's subnormals), so that the gradient is that term
  // times one factor per thread: no special function in the gradient pass.
  const float cap = kCap ? p.cap : 0.0f;
  const float inv_cap = kCap ? 1.0f / p.cap : 0.0f;
  constexpr float kGTermLog2 = 14.0f;
  __half2 tk[kCap ? kVecs : 1][kCap ? kV / 2 : 1];
  const std::int64_t row = row0 + blockIdx.x / csize;
  const int nvec = static_cast<int>(p.vocab / kV);
  const int v0 = min(static_cast<int>(rank) * slice, nvec);
  const int tid = static_cast<int>(threadIdx.x);
  const int first = v0 + tid;                          // this thread's first vector
  const int mine = min(v0 + slice, nvec) - first;      // vector j is this thread's when j * kThreads < mine
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const T* xv = p.x + row * p.xs + static_cast<std::int64_t>(first) * kV;
  // The same slice of the row `ahead` rows on, asked of the L2 now: the block that takes that row
  // then finds its logits there, and DRAM has those bytes in flight without registers holding them.
  if (ahead > 0 && tid == 0 && row + ahead < p.rows && v0 < nvec) {
    prefetch_l2_bulk(p.x + (row + ahead) * p.xs + static_cast<std::int64_t>(v0) * kV,
                     static_cast<unsigned>(min(slice, nvec - v0)) * 16u);
  }
  AlignedVec<T, kV> raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) raw[j] = load_vec_policy<kV>(xv + j * kThreads * kV, drop);
  }
  const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
  const std::int64_t t = t_raw - p.col0;
  const bool in_row = t >= 0 && t < p.vocab;
  // The target's logit, read by one thread of the first block before its message leaves, so
  // before any block of the cluster (all wait for that message) writes its gradient over it.
  float xt = 0.0f;
  if (rank == 0 && tid == 0 && in_row) {
    xt = to_float(p.x[row * p.xs + t]);
    if constexpr (kCap) xt = cap * ce_tanh<2>(xt * inv_cap);
  }
  // The warp's max, then this thread's sum of exp relative to it, summed over the warp.
  PackedMax<T> mx;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) mx.add(raw[j]);
  }
  float m[1] = {mx.value()};
  warp_allreduce<32>(m, MaxOp{});
  const int lane_id = tid & 31;
  unsigned ac = kNoCol;  // the warp's first column of its max (kArg)
  if constexpr (kArg) ac = ce_warp_argmax<T, kV, kVecs, kThreads>(raw, mine, first, lane_id, m[0]);
  // The softcap is monotonic: the warp's capped max from its raw one.
  if constexpr (kCap) {
    if (m[0] != -__builtin_huge_valf()) m[0] = cap * ce_tanh<2>(m[0] * inv_cap);
  }
  // A warp whose elements are all -inf (or that has none) sums nothing: its m stays -inf.
  const float mb = m[0] == -__builtin_huge_valf() ? 0.0f : m[0] * kLog2e;
  float s[2] = {0.0f, 0.0f};  // sum of exp; sum of x (kSmooth)
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) {
      float x[kV];
      to_floats(raw[j], x);
      if constexpr (kCap) {
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          const float u = ce_tanh<2>(x[k] * inv_cap);
          const float e = exp2_ftz(fmaf(u, cap * kLog2e, kGTermLog2 - mb));
          s[0] += e;
          x[k] = e * fmaf(-u, u, 1.0f);
        }
#pragma unroll
        for (int k = 0; k < kV; k += 2) tk[j][k / 2] = __floats2half2_rn(x[k], x[k + 1]);
      } else {
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          s[0] += exp2_ftz(fmaf(x[k], kLog2e, -mb));
          if constexpr (kSmooth) s[1] += x[k];
        }
      }
    }
  }
  if constexpr (kCap) s[0] *= exp2f(-kGTermLog2);  // exact
  if constexpr (kSmooth) {
    warp_allreduce_sum<32>(s);
  } else {
    float s1[1] = {s[0]};
    warp_allreduce_sum<32>(s1);
    s[0] = s1[0];
  }
  if (lane_id == 0) {
    part[tid >> 5] = make_float2(m[0], s[0]);
    if constexpr (kSecond) part_w[tid >> 5] = make_float2(s[1], __uint_as_float(ac));
  }
  __syncthreads();
  if (!solo) cluster_wait();  // every block's barrier is ready (pairs cluster_arrive_relaxed above)
  if (tid < 32) {  // warp 0: the block's statistics, the messages, the row's
    const int lane = tid;
    float bm, bs;
    const float2 mine_part = lane < kWarps ? part[lane] : make_float2(0.0f, 0.0f);
    ce_merge_lanes(lane, mine_part.x, mine_part.y, kWarps, bm, bs);
    // The block's sum of x and argmax (the argmax's value is the block's max when it has one).
    float bsum[1] = {0.0f};
    float bv = -__builtin_huge_valf();
    unsigned bc = kNoCol;
    if constexpr (kSecond) {
      const float2 pw = lane < kWarps ? part_w[lane] : make_float2(0.0f, __uint_as_float(kNoCol));
      if constexpr (kSmooth) {
        bsum[0] = pw.x;
        warp_allreduce_sum<32>(bsum);
      }
      if constexpr (kArg) {
        bc = __float_as_uint(pw.y);
        bv = bc == kNoCol ? -__builtin_huge_valf() : mine_part.x;
        ce_argmax_lanes(lane, kWarps, bv, bc);
      }
    }
    xt = __shfl_sync(0xffffffffu, xt, 0);  // lane 0 (thread 0) read it; every lane's message carries it
    float tm = bm, ts = bs, rsx = bsum[0], rv = bv;
    unsigned rc = bc;
    if (!solo) {
      // The one arrival, announcing the messages' bytes (some may have landed already); then lane r
      // sends this block's statistics to block r.
      constexpr unsigned kPerBlock = (kSecond ? 2u : 1u) * static_cast<unsigned>(sizeof(float4));
      if (lane == 0) mbarrier_arrive_expect_tx(&bar, csize * kPerBlock);
      if (lane < static_cast<int>(csize)) {
        const auto to = static_cast<unsigned>(lane);
        cluster_store_async_f4(cluster_smem_addr(&slots[rank], to), cluster_smem_addr(&bar, to), bm, bs, xt, 0.0f);
        if constexpr (kSecond) {
          cluster_store_async_f4(cluster_smem_addr(&slots[kCeResMaxCluster + rank], to), cluster_smem_addr(&bar, to),
                                 bsum[0], 0.0f, bv, __uint_as_float(bc));
        }
      }
      mbarrier_wait<true>(&bar, 0);  // every block's message has arrived
      const bool from = lane < static_cast<int>(csize);
      const float4 msg = from ? slots[lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      ce_merge_lanes(lane, msg.x, msg.y, static_cast<int>(csize), tm, ts);
      xt = __shfl_sync(0xffffffffu, msg.z, 0);  // block 0's message carries the target's logit
      if constexpr (kSecond) {
        const float4 msg_w = from ? slots[kCeResMaxCluster + lane]
                                  : make_float4(0.0f, 0.0f, -__builtin_huge_valf(), __uint_as_float(kNoCol));
        if constexpr (kSmooth) {
          float rs[1] = {msg_w.x};
          warp_allreduce_sum<32>(rs);
          rsx = rs[0];
        }
        if constexpr (kArg) {
          rv = msg_w.z;
          rc = __float_as_uint(msg_w.w);
          ce_argmax_lanes(lane, static_cast<int>(csize), rv, rc);
        }
      }
    }
    if (lane == 0) {
      row_lse = tm + logf(ts);
      row_xt = xt;
      if (rank == 0) {
        const bool ignored = t_raw == p.ignore_index;
        const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
        const CeAcc total{tm, ts, rsx, static_cast<float>(p.total_vocab), rv, rc == kNoCol ? 0u : rc};
        ce_write_row(p, row, ce_row_terms(p, row, total, row_lse, row_xt, t_raw, ignored || bad), total, ignored,
                     bad);
      }
    }
  }
  __syncthreads();
  const float lse = row_lse;
  const bool ignored = t_raw == p.ignore_index;
  const bool skip = ignored || t_raw < 0 || t_raw >= p.total_vocab;
  const float scale = ce_grad_scale(p, row, skip);
  // d loss / d x_i = p_i * factor - b off the target, factor = scale (1 + 2 z lse) (with smoothing
  // and no class weights (1 - eps) + eps / V * V = 1 as well), b = scale * eps / V (0 without
  // smoothing); for factor > 0 its log2 joins the exponent: p_i * factor = 2^(x_i log2(e) +
  // log2(factor) - lse log2(e)).
  const float factor = scale == 0.0f ? 0.0f : scale * (1.0f + 2.0f * p.z * lse);
  const float nb = kSmooth ? -scale * p.eps / static_cast<float>(p.total_vocab) : 0.0f;
  const float neg_lse2 = -lse * kLog2e;
  T* dv = p.dx + row * p.dxs + static_cast<std::int64_t>(first) * kV;
  if constexpr (kCap) {
    // The kept terms times factor 2^(m_w log2(e) - lse log2(e) - 14): p_i (1 - u_i^2) factor.
    const float gf = factor * exp2f(mb + neg_lse2 - kGTermLog2);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float x[kV];
#pragma unroll
        for (int k = 0; k < kV; k += 2) {
          x[k] = __low2float(tk[j][k / 2]) * gf;
          x[k + 1] = __high2float(tk[j][k / 2]) * gf;
        }
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(x), drop);
      }
    }
  } else if (factor > 0.0f) {
    const float bias = neg_lse2 + __log2f(factor);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float x[kV];
        to_floats(raw[j], x);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          x[k] = exp2_ftz(fmaf(x[k], kLog2e, bias));
          if constexpr (kSmooth) x[k] += nb;
        }
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(x), drop);
      }
    }
  } else {  // a negative upstream gradient, or none (zeros)
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float x[kV];
        to_floats(raw[j], x);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          x[k] = factor == 0.0f ? 0.0f : exp2_ftz(fmaf(x[k], kLog2e, neg_lse2)) * factor;
          if constexpr (kSmooth) x[k] += nb;
        }
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(x), drop);
      }
    }
  }
  // The target's gradient, formed in fp32 from p - 1 as the row kernel forms it, over the value
  // just stored by the thread that stored its vector.
  if (in_row && scale != 0.0f) {
    const int d = static_cast<int>(t / kV) - first;
    if (d >= 0 && d % kThreads == 0 && d / kThreads < kVecs && d < mine) {
      ce_math::RowTerms terms{};
      terms.w_t = 1.0f;
      terms.lse = lse;
      terms.x_t = row_xt;
      terms.sum_w = static_cast<float>(p.total_vocab);
      const float pr = exp2_ftz(fmaf(row_xt, kLog2e, neg_lse2));
      p.dx[row * p.dxs + t] = from_float<T>(ce_math::grad(pr, true, 1.0f, terms, p.eps, p.z, p.total_vocab) *
                                            ce_math::softcap_grad(row_xt, cap) * scale);
    }
  }
#else
  (void)params;
  (void)row0;
  (void)slice;
  (void)ahead;
#endif
}



// The optioned kernel's row outputs from the row's merged statistics (total.best_i: the argmax's
// column within the shard, 0xffffffff for none): the shard statistics, or the loss outputs; w_t
// the target's class weight (0 for a skipped row). By one thread.
template <class T, class I>
TIGON_DEVICE void ce_opt_row_out(const CeParams<T, I>& p, std::int64_t row, CeAcc total, float x_t, float w_t) {
  const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
  const std::int64_t t = t_raw - p.col0;
  const bool in_row = t >= 0 && t < p.vocab;
  total.best_i = (total.best_i == 0xffffffff ? 0 : total.best_i) + p.col0;
  if (p.stats_out != nullptr) {
    CrossEntropyStats st{};
    st.max = total.m;
    st.sumexp = total.s;
    st.has_target = in_row ? 1 : 0;
    st.target_logit = x_t;
    st.target_weight = (in_row && p.weights != nullptr) ? p.weights[t_raw] : 1.0f;
    st.sum_wx = total.sum_wx;
    st.sum_w = total.sum_w;
    st.argmax_value = total.best;
    st.argmax = total.best_i;
    p.stats_out[row] = st;
  } else {
    const bool ignored = t_raw == p.ignore_index;
    const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
    ce_write_row(p, row, ce_row_terms_w(p, total, total.m + logf(total.s), x_t, w_t), total, ignored, bad);
  }
}

// The resident kernel for every option with a gradient (class weights, label smoothing, softcap,
// argmax, token scaling, and the split-vocabulary finalize; the default for them on sm_90+ with
// 16-byte rows, but for the argmax and smoothing alone): the plain kernel's structure and
// registers, the raw 16-byte vectors held, and the logits formed from them (softcap applied) each
// time a pass needs them, in fp32. kCap (0: none, 1: rational tanh for fp32 logits, 2: hardware
// tanh for 16-bit ones) is compile-time, so that a call without the softcap pays nothing;
// smoothing, weights and argmax are uniform branches per thread. A block's
// message is one 16-byte store (max, sum of exp, the target's logit), and a second (sum of w_i x_i,
// sum of w_i, the block's largest logit and its first column) when smoothing or argmax needs it.
// Given merged statistics (finalize), a block writes its slice's gradient with no exchange.
template <class T, class I, int kV, int kThreads, int kVecs, int kMinBlocks, int kCap>
TIGON_KERNEL void __launch_bounds__(kThreads, kMinBlocks) ce_resident_opt_kernel(const CeParams<T, I> p,
                                                                                  std::int64_t row0, int slice,
                                                                                  int ahead) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kWarps = kThreads / 32;
  constexpr unsigned kNoCol = 0xffffffffu;
  constexpr float kNegInf = -__builtin_huge_valf();
  __shared__ std::uint64_t bar;
  __shared__ float4 slots[2 * kCeResMaxCluster];  // [block]: statistics; [kCeResMaxCluster + block]: sums, argmax
  __shared__ float2 part[kWarps];                 // per warp: max, sum of exp
  __shared__ float4 part_w[kWarps];               // per warp: sum of w_i x_i, sum of w_i, largest logit, its column
  __shared__ float row_lse, row_xt, row_swx, row_sw;
  __shared__ float row_mem[4];  // upstream gradient, denominators [0] and [1], the target's weight
  const bool exchange = p.stats == nullptr;  // finalize: the merged statistics are given
  const int nvec = static_cast<int>(p.vocab / kV);
  const unsigned csize = cluster_blocks();
  const unsigned rank = cluster_rank();
  const bool solo = csize == 1;  // no messages
  if (exchange && !solo) {
    if (threadIdx.x == 0) mbarrier_init(&bar);
    cluster_arrive_relaxed();
  }
  detail::grid_dependency_sync();
  const std::int64_t row = row0 + blockIdx.x / csize;
  const int v0 = min(static_cast<int>(rank) * slice, nvec);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane_id = tid & 31;
  const int first = v0 + tid;
  const int mine = min(v0 + slice, nvec) - first;
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const T* xv = p.x + row * p.xs + static_cast<std::int64_t>(first) * kV;
  if (ahead > 0 && tid == 0 && row + ahead < p.rows && v0 < nvec) {
    prefetch_l2_bulk(p.x + (row + ahead) * p.xs + static_cast<std::int64_t>(v0) * kV,
                     static_cast<unsigned>(min(slice, nvec - v0)) * 16u);
  }
  AlignedVec<T, kV> raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j * kThreads < mine) raw[j] = load_vec_policy<kV>(xv + j * kThreads * kV, drop);
  }
  const bool smooth = p.eps > 0.0f;
  const bool want_arg = p.argmax != nullptr;
  const float* wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  const bool wvec = is_aligned(wcol, 16);  // the class weights in 16-byte loads
  const float cap = kCap ? p.cap : 0.0f;
  const float inv_cap = kCap ? 1.0f / p.cap : 0.0f;
  // Vector j's logits over xs: with the softcap the tanh values u = tanh(x / cap), the capped logit being cap * u; the passes fold xs into their
  // constants (l2s = log2(e) * xs) instead of multiplying each element by it.
  const float xs = kCap ? cap : 1.0f;
  const float l2s = kLog2e * xs;
  auto pre = [&](int j, float (&x)[kV]) {
    to_floats(raw[j], x);
    if constexpr (kCap != 0) {
#pragma unroll
      for (int k = 0; k < kV; ++k) x[k] = ce_tanh<kCap>(x[k] * inv_cap);
    }
  };
  // Vector j's logits (softcap applied).
  auto logits = [&](int j, float (&x)[kV]) {
    pre(j, x);
    if constexpr (kCap != 0) {
#pragma unroll
      for (int k = 0; k < kV; ++k) x[k] *= cap;
    }
  };
  // 16-bit logits with the softcap: once the statistics are taken, the registers of raw[j] hold one
  // half per element for the gradient pass (keep), so that it takes no second tanh, the
  // special-function unit being the kernel's limit with the softcap. Without smoothing they hold
  // the element's gradient term g_i = 2^14 e_i (1 - u_i^2), e_i = exp(x_i - m_w) the exponential the
  // statistics already took (m_w the warp's max; 2^14 keeps the terms off half's subnormals), and
  // the gradient is g_i times one per-thread factor: no special function at all in the gradient
  // pass, and the half rounding (2^-11 relative) is the term's only error beyond fp32. With
  // smoothing (the gradient p_i a - b w_i needs p_i and the derivative apart) and in the finalize
  // they hold u_i = tanh(x_i / cap), from which the gradient pass forms the capped logit and the
  // derivative (one exp2 an element). The loss and the statistics use the fp32 values.
  constexpr bool kKeepTanh = kCap == 2 && sizeof(T) == 2 && kV % 2 == 0;
  constexpr float kGTermLog2 = 14.0f;
  // Whether the argmax is found per warp by ballot on the raw values (16-bit; with the softcap its
  // registers spill the tanh values kept across the exchange, so there the lanes holding the warp's
  // max find their columns).
  constexpr bool kWarpArg = kCap == 0 && PackedMax<T>::kPacked && kV % 2 == 0;
  // The kept values go to tk and raw dies: the layout under which ptxas fits each instance in 64
  // registers without spills.
  __half2 tk[kKeepTanh ? kVecs : 1][kV / 2];
  auto keep = [&](int j, const float (&u)[kV]) {  // u: the values kept (tanh values or terms)
    if constexpr (kKeepTanh) {
#pragma unroll
      for (int k = 0; k < kV; k += 2) tk[j][k / 2] = __floats2half2_rn(u[k], u[k + 1]);
    }
  };
  // Element k of vector j's kept tanh values.
  auto kept = [&](int j, int k) -> float {
    if constexpr (kKeepTanh) {
      return (k & 1) ? __high2float(tk[j][k / 2]) : __low2float(tk[j][k / 2]);
    } else {
      return 0.0f;
    }
  };
  const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
  const std::int64_t t = t_raw - p.col0;
  const bool in_row = t >= 0 && t < p.vocab;
  const bool skip = t_raw == p.ignore_index || t_raw < 0 || t_raw >= p.total_vocab;
  // The row's scalars held in memory (the upstream gradient, the mean's denominators, the target's
  // class weight) copied to shared memory by thread 0 while the logits are in flight (no registers
  // held across the pass, no round trip after the exchange); thread 0 waits for them before the
  // barrier that follows the exchange.
  if (exchange && tid == 0) {
    if (p.grad_output != nullptr) {
      __pipeline_memcpy_async(&row_mem[0], p.grad_output + (p.reduction == Reduction::none ? row : 0), 4);
    } else {
      row_mem[0] = 1.0f;
    }
    if (p.reduction == Reduction::mean) {
      __pipeline_memcpy_async(&row_mem[1], p.denom, 4);
      __pipeline_memcpy_async(&row_mem[2], p.denom + 1, 4);
    } else {
      row_mem[1] = row_mem[2] = 1.0f;
    }
    if (p.weights != nullptr && !skip) {
      __pipeline_memcpy_async(&row_mem[3], p.weights + t_raw, 4);
    } else {
      row_mem[3] = skip ? 0.0f : 1.0f;
    }
    __pipeline_commit();
  }
  float lse, x_t, sum_wx, sum_w, w_t;
  float mb_w = 0.0f;  // the warp's max times log2(e), of the kept gradient terms
  if (exchange) {
    float xt = 0.0f;
    if (rank == 0 && tid == 0 && in_row) {
      xt = to_float(p.x[row * p.xs + t]);
      if constexpr (kCap != 0) xt = cap * ce_tanh<kCap>(xt * inv_cap);
    }
    // The thread's largest logit (and, for argmax, its first column). The raw values order the
    // logits (the softcap is monotonic), so the max is taken on them, packed.
    float tmax;
    float wm_all = kNegInf;  // with the argmax: the warp's largest raw value
    float av = kNegInf;
    unsigned ac = kNoCol;
    {
      PackedMax<T> mx;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j * kThreads < mine) mx.add(raw[j]);
      }
      const float rmax = mx.value();
      // The warp's largest raw value, and for the argmax its first column.
      float wm[1] = {rmax};
      if (want_arg) warp_allreduce<32>(wm, MaxOp{});
      wm_all = wm[0];
      tmax = kCap != 0 && rmax != kNegInf ? cap * ce_tanh<kCap>(rmax * inv_cap) : rmax;
      if constexpr (kWarpArg) {
        // bfloat16 / half: the warp's first column of its max by ballot (ce_warp_argmax).
        if (want_arg) ac = ce_warp_argmax<T, kV, kVecs, kThreads>(raw, mine, first, lane_id, wm[0]);
        av = ac == kNoCol ? kNegInf : (kCap != 0 ? cap * ce_tanh<kCap>(wm[0] * inv_cap) : wm[0]);
      } else {
        // The lanes holding the warp's max find their first column holding it (bfloat16 / half:
        // two elements per packed compare).
        if (want_arg && rmax == wm[0] && rmax != kNegInf) {
#pragma unroll
          for (int j = kVecs - 1; j >= 0; --j) {
            if (j * kThreads < mine) {
              const unsigned col0 = static_cast<unsigned>((first + j * kThreads) * kV);
              if constexpr (PackedMax<T>::kPacked && kV % 2 == 0) {
                using Pair = typename PackedMax<T>::Pair;
                const T r1 = from_float<T>(rmax);  // exact: rmax is one of the T values
                const Pair r2(r1, r1);
                int hit = kV;
#pragma unroll
                for (int k = kV - 2; k >= 0; k -= 2) {
                  Pair q;
                  __builtin_memcpy(&q, &raw[j].v[k], sizeof(q));
                  const unsigned e = __heq2_mask(q, r2);
                  if (e & 0xffff0000u) hit = k + 1;
                  if (e & 0x0000ffffu) hit = k;
                }
                if (hit < kV) ac = col0 + static_cast<unsigned>(hit);
              } else {
                float x[kV];
                to_floats(raw[j], x);
#pragma unroll
                for (int k = kV - 1; k >= 0; --k) {
                  if (x[k] == rmax) ac = col0 + static_cast<unsigned>(k);
                }
              }
            }
          }
        }
        av = ac == kNoCol ? kNegInf : tmax;
      }
    }
    float m[1] = {tmax};
    if (kCap != 0 || !want_arg) {
      warp_allreduce<32>(m, MaxOp{});
    } else {
      m[0] = wm_all;  // the argmax's warp max of the raw values, which are the logits here
    }
    const float mb = m[0] == kNegInf ? 0.0f : m[0] * kLog2e;
    mb_w = mb;
    // The sum of exp relative to the warp's max, and the smoothing sums, in one walk of the logits.
    float s[1] = {0.0f};
    float sw2[2] = {0.0f, 0.0f};  // sum of w_i x_i, sum of w_i
    auto walk = [&](auto smooth_c) {
      constexpr bool kSmooth = decltype(smooth_c)::value;
      constexpr bool kTerms = kKeepTanh && !kSmooth;  // keep the gradient terms (scaled by 2^14)
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j * kThreads < mine) {
          float x[kV];
          pre(j, x);
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            const float e = exp2_ftz(fmaf(x[k], l2s, kTerms ? kGTermLog2 - mb : -mb));
            s[0] += e;
            if constexpr (kTerms) x[k] = e * fmaf(-x[k], x[k], 1.0f);
          }
          if constexpr (kKeepTanh) keep(j, x);
          if constexpr (kSmooth) {
            if (wcol != nullptr) {
              float w[kV];
              ce_load_weights<kV>(wcol, (first + j * kThreads) * kV, wvec, w);
#pragma unroll
              for (int k = 0; k < kV; ++k) {
                sw2[0] = fmaf(w[k], x[k], sw2[0]);
                sw2[1] += w[k];
              }
            } else {
#pragma unroll
              for (int k = 0; k < kV; ++k) sw2[0] += x[k];
              sw2[1] += static_cast<float>(kV);
            }
          }
        }
      }
    };
    if (smooth) {
      walk(std::true_type{});
      sw2[0] *= xs;  // the sums were of pre's values
    } else {
      walk(std::false_type{});
      if constexpr (kKeepTanh) s[0] *= exp2f(-kGTermLog2);  // exact
    }
    warp_allreduce_sum<32>(s);
    const bool second = smooth || want_arg;  // the second message
    if (smooth) warp_allreduce_sum<32>(sw2);
    if (want_arg && !kWarpArg) ce_argmax_lanes(lane_id, 32, av, ac);
    if (lane_id == 0) {
      part[tid >> 5] = make_float2(m[0], s[0]);
      part_w[tid >> 5] = make_float4(sw2[0], sw2[1], av, __uint_as_float(ac));
    }
    __syncthreads();
    if (!solo) cluster_wait();
    if (tid < 32) {  // warp 0: the block's statistics, the messages, the row's
      const int lane = tid;
      if (lane == 0) __pipeline_wait_prior(0);  // row_mem
      const float2 pm = lane < kWarps ? part[lane] : make_float2(0.0f, 0.0f);
      float bm, bs;
      ce_merge_lanes(lane, pm.x, pm.y, kWarps, bm, bs);
      const float4 pw = lane < kWarps ? part_w[lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float bsum[2] = {lane < kWarps ? pw.x : 0.0f, lane < kWarps ? pw.y : 0.0f};
      if (smooth) warp_allreduce_sum<32>(bsum);
      float bv = pw.z;
      unsigned bc = __float_as_uint(pw.w);
      if (want_arg) ce_argmax_lanes(lane, kWarps, bv, bc);
      xt = __shfl_sync(0xffffffffu, xt, 0);
      float tm = bm, ts = bs, rsum[2] = {bsum[0], bsum[1]}, rv = bv, row_x = xt;
      unsigned rc = bc;
      if (!solo) {
        const unsigned per_block = (second ? 2u : 1u) * static_cast<unsigned>(sizeof(float4));
        if (lane == 0) mbarrier_arrive_expect_tx(&bar, csize * per_block);
        if (lane < static_cast<int>(csize)) {
          const auto to = static_cast<unsigned>(lane);
          cluster_store_async_f4(cluster_smem_addr(&slots[rank], to), cluster_smem_addr(&bar, to), bm, bs, xt, 0.0f);
          if (second) {
            cluster_store_async_f4(cluster_smem_addr(&slots[kCeResMaxCluster + rank], to),
                                   cluster_smem_addr(&bar, to), bsum[0], bsum[1], bv, __uint_as_float(bc));
          }
        }
        mbarrier_wait<true>(&bar, 0);
        const bool from = lane < static_cast<int>(csize);
        const float4 msg = from ? slots[lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4 msg_w = (from && second) ? slots[kCeResMaxCluster + lane]
                                              : make_float4(0.0f, 0.0f, kNegInf, __uint_as_float(kNoCol));
        ce_merge_lanes(lane, msg.x, msg.y, static_cast<int>(csize), tm, ts);
        rsum[0] = from ? msg_w.x : 0.0f;
        rsum[1] = from ? msg_w.y : 0.0f;
        if (smooth) warp_allreduce_sum<32>(rsum);
        rv = msg_w.z;
        rc = __float_as_uint(msg_w.w);
        if (want_arg) ce_argmax_lanes(lane, static_cast<int>(csize), rv, rc);
        row_x = __shfl_sync(0xffffffffu, msg.z, 0);  // block 0's message carries the target's logit
      }
      if (lane == 0) {
        row_lse = tm + logf(ts);
        row_xt = row_x;
        row_swx = rsum[0];
        row_sw = rsum[1];
        if (rank == 0) ce_opt_row_out(p, row, CeAcc{tm, ts, rsum[0], rsum[1], rv, rc}, row_x, row_mem[3]);
      }
    }
    __syncthreads();
    lse = row_lse;
    x_t = row_xt;
    sum_wx = row_swx;
    sum_w = row_sw;
    w_t = row_mem[3];
  } else {  // finalize: the row's statistics from the merged ones; block 0 writes the row's outputs
    const CrossEntropyStats& st = p.stats[row];
    lse = st.max + logf(st.sumexp);
    x_t = st.target_logit;
    sum_wx = st.sum_wx;
    sum_w = st.sum_w;
    w_t = ce_target_weight(p, row, t_raw, skip);
    if (rank == 0 && tid == 0) {
      const bool ignored = t_raw == p.ignore_index;
      const bool bad = !ignored && (t_raw < 0 || t_raw >= p.total_vocab);
      const CeAcc total{st.max, st.sumexp, st.sum_wx, st.sum_w, st.argmax_value, st.argmax};
      ce_write_row(p, row, ce_row_terms(p, row, total, lse, x_t, t_raw, ignored || bad), total, ignored, bad);
    }
    if constexpr (kKeepTanh) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j * kThreads < mine) {
          float x[kV];
          pre(j, x);
          keep(j, x);
        }
      }
    }
  }
  // The gradient's factor and the z-loss scale (ce_grad_scale, ce_z_grad) from row_mem, or from
  // memory in the finalize.
  float up, den0, den1;
  if (exchange) {
    up = row_mem[0];
    den0 = row_mem[1];
    den1 = row_mem[2];
  } else {
    up = p.grad_output == nullptr ? 1.0f : p.grad_output[p.reduction == Reduction::none ? row : 0];
    den0 = p.reduction == Reduction::mean ? p.denom[0] : 1.0f;
    den1 = p.reduction == Reduction::mean ? p.denom[1] : 1.0f;
  }
  // The cross-entropy part off (ce_part_off): the z-loss's gradient alone, scaled over the count.
  const bool off = ce_part_off(p.weights != nullptr, p.reduction, den0);
  const float scale = skip ? 0.0f : p.grad_scale * up / (off ? den1 : den0) * ce_token_factor(p, lse, x_t);
  const float zg =
      (p.z == 0.0f || p.weights == nullptr || p.reduction != Reduction::mean || off) ? p.z : p.z * (den0 / den1);
  const float eps = off ? 0.0f : p.eps;
  const CeAcc total{0.0f, 0.0f, sum_wx, sum_w, 0.0f, 0};
  const ce_math::RowTerms terms = ce_row_terms_w(p, total, lse, x_t, off ? 0.0f : w_t);
  // d loss / d x_i = (p_i * a - b * w_i) * softcap'(x_i) off the target (ce_math::grad regrouped):
  // a = scale ((1 - eps) w_t + eps / V * sum_w + 2 z lse), b = scale * eps / V.
  const float inv_v = 1.0f / static_cast<float>(p.total_vocab);
  const float a = scale * ((1.0f - eps) * terms.w_t + eps * inv_v * terms.sum_w + 2.0f * zg * lse);
  const float b = scale * eps * inv_v;
  const float neg_lse2 = -lse * kLog2e;
  T* dv = p.dx + row * p.dxs + static_cast<std::int64_t>(first) * kV;
  // The element loop, with smoothing a compile-time switch; without it and for a > 0 (kFold),
  // log2(a) joins the exponent; with it the element's gradient is one FMA from p_i.
  const float nb = -b;
  // kTerms: the kept values are the gradient terms g_i (no smoothing, statistics taken here), and
  // the gradient is g_i a 2^(m_w - lse - 14) (log2 units).
  auto write = [&](auto smooth_c, auto fold_c, auto terms_c) {
    constexpr bool kSmooth = decltype(smooth_c)::value;
    constexpr bool kFold = decltype(fold_c)::value;
    constexpr bool kTerms = kKeepTanh && decltype(terms_c)::value;
    const float e0 = kFold ? neg_lse2 + __log2f(a) : neg_lse2;
    const float gf = kTerms ? a * exp2f(mb_w + neg_lse2 - kGTermLog2) : 0.0f;
    // p_i (times a when folded) to the element's gradient before the softcap's derivative; sh:
    // the smoothing term -b w_i.
    auto term = [&](float v, float sh) {
      if constexpr (kFold) {
        return v;
      } else if constexpr (kSmooth) {
        return fmaf(v, a, sh);
      } else {
        return v * a;
      }
    };
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        const int c0 = (first + j * kThreads) * kV;
        float sh[kV];  // -b w_i (smoothing)
        if constexpr (kSmooth) {
          if (wcol != nullptr) {
            ce_load_weights<kV>(wcol, c0, wvec, sh);
#pragma unroll
            for (int k = 0; k < kV; ++k) sh[k] *= nb;
          } else {
#pragma unroll
            for (int k = 0; k < kV; ++k) sh[k] = nb;
          }
        } else {
#pragma unroll
          for (int k = 0; k < kV; ++k) sh[k] = 0.0f;
        }
        float g[kV];
        if constexpr (kTerms) {
#pragma unroll
          for (int k = 0; k < kV; ++k) g[k] = kept(j, k) * gf;
        } else if constexpr (kKeepTanh) {
          // The logits as cap * u from the kept values, element by element (no second array).
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            const float u = kept(j, k);
            g[k] = term(exp2_ftz(fmaf(u, l2s, e0)), sh[k]) * fmaf(-u, u, 1.0f);
          }
        } else {
          float x[kV];
          pre(j, x);
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            float v = term(exp2_ftz(fmaf(x[k], l2s, e0)), sh[k]);
            if constexpr (kCap != 0) v *= fmaf(-x[k], x[k], 1.0f);
            g[k] = v;
          }
        }
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(g), drop);
      }
    }
  };
  if (scale == 0.0f) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * kThreads < mine) {
        float g[kV];
#pragma unroll
        for (int k = 0; k < kV; ++k) g[k] = 0.0f;
        store_vec_policy(dv + j * kThreads * kV, from_floats<T>(g), drop);
      }
    }
    return;
  }
  constexpr std::false_type kNo{};
  if (smooth) {
    write(std::true_type{}, kNo, kNo);
  } else if (kKeepTanh && exchange) {
    write(kNo, kNo, std::true_type{});
  } else if (a > 0.0f) {
    write(kNo, std::true_type{}, kNo);
  } else {
    write(kNo, kNo, kNo);
  }
  // The target's gradient in fp32 from p - 1, over the value this thread just stored.
  if (in_row) {
    const int d = static_cast<int>(t / kV) - first;
    if (d >= 0 && d % kThreads == 0 && d / kThreads < kVecs && d < mine) {
      const float pr = exp2_ftz(fmaf(x_t, kLog2e, neg_lse2));
      const float w = wcol != nullptr ? wcol[t] : 1.0f;
      p.dx[row * p.dxs + t] = from_float<T>(ce_math::grad(pr, true, w, terms, eps, zg, p.total_vocab) *
                                            ce_math::softcap_grad(x_t, cap) * scale);
    }
  }
#else
  (void)p;
  (void)row0;
  (void)slice;
  (void)ahead;
#endif
}

// ---- The streaming kernel (no gradient) ----

// The calls without a gradient: the loss alone (with or without options) and the split statistics
// pass (16-byte rows). One block a row, one warp a segment of seg_vecs 16-byte vectors (the last
// one shorter; blockDim.x / 32 segments), each streamed once with the evict-first L2 priority, kU
// vectors in flight per lane per trip. Per trip: the trip's largest logit (packed pairs for
// bfloat16 / half; before the softcap, which is monotonic), a rescale of the lane's running sum
// only when it grows, one exp2 an element and the smoothing sums as a compile-time walk; for the
// argmax each lane notes the trip that set its largest value, and after the walk the lanes holding
// the warp's largest read that trip again to find its column. Each warp's lanes merge in a fixed
// butterfly order, then warp 0 merges the segments in order and writes the row's outputs (the
// loss's or its CrossEntropyStats): deterministic, one barrier a row, no workspace. kCap as in the
// optioned resident kernel. Registers: 64 a thread (two 512-thread blocks per SM).
inline constexpr int kCeStreamMaxWarps = 16;
template <class T, class I, int kV, int kU, int kCap>
TIGON_KERNEL void __launch_bounds__(32 * kCeStreamMaxWarps, 2)
    ce_stream_kernel(const CeParams<T, I> p, std::int64_t row0, int seg_vecs) {
  detail::grid_dependency_sync();
  constexpr float kNegInf = -__builtin_huge_valf();
  constexpr unsigned kNoCol = 0xffffffffu;
  __shared__ float4 seg_stats[2 * kCeStreamMaxWarps];  // [2 g]: max, sum of exp; [2 g + 1]: sums, argmax
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int g = static_cast<int>(threadIdx.x >> 5);
  const int segs = static_cast<int>(blockDim.x >> 5);
  const std::int64_t row = row0 + blockIdx.x;
  const int nvec = static_cast<int>(p.vocab / kV);
  const int v0 = min(g * seg_vecs, nvec);
  const int v1 = min(v0 + seg_vecs, nvec);
  const T* xr = p.x + row * p.xs;
  const std::uint64_t drop = l2_policy<L2Hint::evict_first>();
  const bool smooth = p.eps > 0.0f;
  const bool want_arg = p.argmax != nullptr;  // in a statistics pass: the finalize will want it
  const float* wcol = p.weights != nullptr ? p.weights + p.col0 : nullptr;
  const bool wvec = is_aligned(wcol, 16);  // the class weights in 16-byte loads
  const float cap = kCap ? p.cap : 0.0f;
  const float inv_cap = kCap ? 1.0f / p.cap : 0.0f;
  const float xs = kCap ? cap : 1.0f;  // a logit is xs * y, y the value the passes take (tanh with the softcap)
  const float l2s = kLog2e * xs;
  // z: the logit before the softcap; y = ycap(z): what the exponent takes.
  auto ycap = [&](float z) {
    if constexpr (kCap != 0) {
      return ce_tanh<kCap>(z * inv_cap);
    } else {
      return z;
    }
  };
  // The target's logit, by the thread that writes the row's outputs.
  const std::int64_t t_raw = static_cast<std::int64_t>(p.targets[row]);
  const std::int64_t t = t_raw - p.col0;
  float xt = 0.0f;
  if (g == 0 && lane == 0 && t >= 0 && t < p.vocab) {
    xt = to_float(xr[t]);
    if constexpr (kCap != 0) xt = cap * ce_tanh<kCap>(xt * inv_cap);
  }
  float mz = kNegInf;    // the lane's largest z
  float mb = 0.0f;       // ycap(mz) * l2s (0 while mz is -inf): the exponent's offset
  float s = 0.0f;        // sum of exp2(y * l2s - mb)
  float swx = 0.0f, sw = 0.0f;  // smoothing: sum of w_i y_i, sum of w_i (with class weights)
  int bi = -1;           // argmax: the first trip (its first vector) that held the lane's largest z
  // A trip's kN vectors i, i + 32, ..., i + 32 (kN - 1) of the segment: with streamed_c true the walk's evict-first loads, else plain loads (the
  // argmax's second read).
  auto fetch = [&](int i, auto n_c, auto streamed_c, AlignedVec<T, kV>(&raw)[decltype(n_c)::value]) {
    constexpr int kN = decltype(n_c)::value;
    const T* xp = xr + static_cast<std::int64_t>(i) * kV;
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      if constexpr (decltype(streamed_c)::value) {
        raw[u] = load_vec_policy<kV>(xp + u * 32 * kV, drop);
      } else {
        raw[u] = load_vec<kV>(xp + u * 32 * kV);
      }
    }
  };
  // One trip. kSmooth, kWeights: the smoothing sums, with class weights (compile-time: no branch a
  // vector).
  auto trip = [&](int i, auto n_c, auto smooth_c, auto weights_c) {
    constexpr int kN = decltype(n_c)::value;
    constexpr bool kSmooth = decltype(smooth_c)::value;
    constexpr bool kWeights = decltype(weights_c)::value;
    AlignedVec<T, kV> raw[kN];
    fetch(i, n_c, std::true_type{}, raw);
    PackedMax<T> mx;
#pragma unroll
    for (int u = 0; u < kN; ++u) mx.add(raw[u]);
    const float tz = mx.value();
    if (tz > mz) {  // a new largest value: the running sum rescaled to it
      const float nb = ycap(tz) * l2s;
      s = mz == kNegInf ? 0.0f : s * exp2_ftz(mb - nb);
      mz = tz;
      mb = nb;
      bi = i;
    }
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      {
        float y[kV];
        to_floats(raw[u], y);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          y[k] = ycap(y[k]);
          s += exp2_ftz(fmaf(y[k], l2s, -mb));
        }
        if constexpr (kWeights) {
          float w[kV];
          ce_load_weights<kV>(wcol, (i + u * 32) * kV, wvec, w);
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            swx = fmaf(w[k], y[k], swx);
            sw += w[k];
          }
        } else if constexpr (kSmooth) {
#pragma unroll
          for (int k = 0; k < kV; ++k) swx += y[k];
        }
      }
    }
  };
  // With class weights, half the vectors a trip: the weights take the registers of the other half.
  constexpr int kHalf = kU > 1 ? kU / 2 : kU;
  auto walk = [&](auto smooth_c, auto weights_c) {
    constexpr int kN = decltype(weights_c)::value ? kHalf : kU;
    int i = v0 + lane;
    for (; i + (kN - 1) * 32 < v1; i += kN * 32) trip(i, std::integral_constant<int, kN>{}, smooth_c, weights_c);
    for (; i < v1; i += 32) trip(i, std::integral_constant<int, 1>{}, smooth_c, weights_c);
  };
  constexpr std::false_type kNo{};
  constexpr std::true_type kYes{};
  if (!smooth) {
    walk(kNo, kNo);
  } else if (wcol == nullptr) {
    walk(kYes, kNo);
  } else {
    walk(kYes, kYes);
  }
  // The warp's statistics: the max, each lane's sum rescaled to it, the sums, the argmax.
  float wz[1] = {mz};
  warp_allreduce<32>(wz, MaxOp{});
  const float wb = wz[0] == kNegInf ? 0.0f : ycap(wz[0]) * l2s;
  float ws[1] = {mz == kNegInf ? 0.0f : s * exp2_ftz(mb - wb)};
  warp_allreduce_sum<32>(ws);
  const float m = wz[0] == kNegInf ? kNegInf : ycap(wz[0]) * xs;
  float sums[2] = {0.0f, 0.0f};
  if (smooth) {
    sums[0] = swx;
    sums[1] = sw;
    warp_allreduce_sum<32>(sums);
    sums[0] *= xs;
    if (wcol == nullptr) sums[1] = static_cast<float>(v1 - v0) * static_cast<float>(kV);
  }
  float bv = kNegInf;
  unsigned bc = kNoCol;
  if (want_arg) {
    // The lanes holding the warp's largest z read the trip that set theirs again and find its first
    // column (usually one lane; columns rise with u, then k).
    if (bi >= 0 && mz == wz[0]) {
      auto find = [&](auto n_c) {
        constexpr int kN = decltype(n_c)::value;
        AlignedVec<T, kV> raw[kN];
        fetch(bi, n_c, std::false_type{}, raw);
        unsigned c = kNoCol;
#pragma unroll
        for (int u = kN - 1; u >= 0; --u) {
          float z[kV];
          to_floats(raw[u], z);
#pragma unroll
          for (int k = kV - 1; k >= 0; --k) {
            if (z[k] == mz) c = static_cast<unsigned>((bi + u * 32) * kV + k);
          }
        }
        return c;
      };
      // The walk's trip: a full one of kU (kHalf with class weights) vectors, or one of the
      // segment's tail.
      const int n = (smooth && wcol != nullptr) ? kHalf : kU;
      if (bi + (n - 1) * 32 >= v1) {
        bc = find(std::integral_constant<int, 1>{});
      } else if (n == kU) {
        bc = find(std::integral_constant<int, kU>{});
      } else {
        bc = find(std::integral_constant<int, kHalf>{});
      }
    }
    float bz = mz;
    ce_argmax_lanes(lane, 32, bz, bc);
    bv = bc == kNoCol ? kNegInf : ycap(bz) * xs;
  }
  if (lane == 0) {
    seg_stats[2 * g] = make_float4(m, ws[0], 0.0f, 0.0f);
    seg_stats[2 * g + 1] = make_float4(sums[0], sums[1], bv, __uint_as_float(bc));
  }
  __syncthreads();
  if (g != 0) return;
  // Warp 0: the segments merged in order, and the row's outputs.
  const bool from = lane < segs;
  const float4 a = from ? seg_stats[2 * lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4 b = from ? seg_stats[2 * lane + 1] : make_float4(0.0f, 0.0f, kNegInf, __uint_as_float(kNoCol));
  float tm, ts;
  ce_merge_lanes(lane, a.x, a.y, segs, tm, ts);
  float rsum[2] = {b.x, b.y};
  if (smooth) warp_allreduce_sum<32>(rsum);
  float rv = b.z;
  unsigned rc = __float_as_uint(b.w);
  if (want_arg) ce_argmax_lanes(lane, segs, rv, rc);
  if (lane == 0) {
    const bool skip = t_raw == p.ignore_index || t_raw < 0 || t_raw >= p.total_vocab;
    const float w_t = skip ? 0.0f : (p.weights != nullptr && p.stats_out == nullptr ? p.weights[t_raw] : 1.0f);
    ce_opt_row_out(p, row, CeAcc{tm, ts, rsum[0], rsum[1], rv, rc}, xt, w_t);
  }
}

// ---- The loss's small kernels ----

// The mean's denominators: denom[0] the sum over non-ignored rows of w_t (their count without
// weights), denom[1] their count. One block, fixed order.
template <class I>
TIGON_KERNEL void __launch_bounds__(1024)
    ce_denominator_kernel(const I* targets, std::int64_t rows, std::int64_t ignore_index,
                          const float* weights, std::int64_t vocab, float* denom) {
  detail::grid_dependency_sync();
  using Reduce = BlockAllReduce<1024, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  float s[2] = {0.0f, 0.0f};
  // kU rows per thread per trip, their targets and then their weights loaded together (two
  // round trips to memory per trip instead of two per row), summed in row order.
  constexpr int kU = 8;
  auto add = [&](std::int64_t t, float w) {
    if (t == ignore_index) return;
    s[0] += w;
    s[1] += 1.0f;
  };
  auto weight = [&](std::int64_t t) {
    return (weights != nullptr && t != ignore_index && t >= 0 && t < vocab) ? weights[t] : 1.0f;
  };
  std::int64_t r = threadIdx.x;
  for (; r + (kU - 1) * 1024 < rows; r += kU * 1024) {
    std::int64_t t[kU];
    float w[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) t[u] = static_cast<std::int64_t>(targets[r + u * 1024]);
#pragma unroll
    for (int u = 0; u < kU; ++u) w[u] = weight(t[u]);
#pragma unroll
    for (int u = 0; u < kU; ++u) add(t[u], w[u]);
  }
  for (; r < rows; r += 1024) {
    const std::int64_t t = static_cast<std::int64_t>(targets[r]);
    add(t, weight(t));
  }
  Reduce::sum(s, tmp);
  if (threadIdx.x == 0) {
    denom[0] = s[0];
    denom[1] = s[1];
  }
}

// loss = (sum of the rows' cross-entropy parts) / denom[0] + (sum of their z parts) / denom[1]
// under the mean (sums otherwise), z_loss the second term; an all-ignored batch gives 0.
template <int kThreads = 1024>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads)
    ce_reduce_kernel(const float* loss_rows, const float* z_rows, std::int64_t rows,
                     const float* denom, bool mean, float* loss, float* z_loss) {
  detail::grid_dependency_sync();
  using Reduce = BlockAllReduce<kThreads, 2>;
  __shared__ typename Reduce::TempStorage tmp;
  float s[2] = {0.0f, 0.0f};
  for (std::int64_t r = threadIdx.x; r < rows; r += kThreads) {
    s[0] += loss_rows[r];
    s[1] += z_rows[r];
  }
  Reduce::sum(s, tmp);
  if (threadIdx.x == 0) {
    float ce = s[0] - s[1], zl = s[1];
    if (mean) {
      ce = denom[0] == 0.0f ? 0.0f : ce / denom[0];
      zl = denom[1] == 0.0f ? 0.0f : zl / denom[1];
    }
    if (loss != nullptr) loss[0] = ce + zl;
    if (z_loss != nullptr) z_loss[0] = zl;
  }
}

// Merge per-shard statistics [shards][rows] into [rows].
template <int kThreads = 256>  // a template: a header's kernel needs one definition per program
TIGON_KERNEL void __launch_bounds__(kThreads)
    ce_merge_kernel(const CrossEntropyStats* shards, int nshards, std::int64_t rows,
                    CrossEntropyStats* out) {
  detail::grid_dependency_sync();
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    CrossEntropyStats m = shards[r];
    for (int k = 1; k < nshards; ++k) {
      const CrossEntropyStats& o = shards[static_cast<std::int64_t>(k) * rows + r];
      ce_math::merge(m.max, m.sumexp, o.max, o.sumexp);
      m.sum_wx += o.sum_wx;
      m.sum_w += o.sum_w;
      if (o.has_target) {
        m.target_logit = o.target_logit;
        m.target_weight = o.target_weight;
        m.has_target = 1;
      }
      if (o.argmax_value > m.argmax_value ||
          (o.argmax_value == m.argmax_value && o.argmax < m.argmax)) {
        m.argmax_value = o.argmax_value;
        m.argmax = o.argmax;
      }
    }
    out[r] = m;
  }
}

}  // namespace detail

TIGON_NAMESPACE_END
