// tigon/activation/gated.cuh - gated activations (SwiGLU, GeGLU, any user activation), forward
// and backward, with the multipliers of Falcon-H1:
//
//   c  = down_multiplier * act(gate_multiplier * a) * b
//   da = dc * b * down_multiplier * gate_multiplier * act'(gate_multiplier * a)
//   db = dc * down_multiplier * act(gate_multiplier * a)
//
// a is the gate projection, b the up projection, c the input of the down projection. All math in
// fp32, outputs in the input dtype; with 16-bit inputs act(gate_multiplier * a) (and in the backward
// dc * b) is rounded to the dtype before its product, as a Hugging Face MLP of that dtype computes
// it. The backward recomputes act from a (the forward saves nothing).
//
// The ungated activation of an MLP without a gate (Nemotron's squared ReLU, Phi's GELU) is the same
// op with no b: activation_forward / activation_backward compute
//
//   c  = act(a),   da = dc * act'(a)
//
// each rounded to the dtype once, as that module computes them.
//
// The header reads in four layers: arguments, math (host + device), kernels, launchers. The first
// two compile under any C++20 compiler; kernels and launchers need nvcc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/config.hpp"
#include "../core/dtype.hpp"
#include "../core/math.hpp"
#include "../core/status.hpp"
#include "../core/validate.hpp"
#include "activations.hpp"

#if defined(__CUDACC__)
#include "../core/device.hpp"
#include "../core/launch.cuh"
#include "../core/vector.cuh"
#endif

TIGON_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// 1. Arguments
// ------------------------------------------------------------------------------------------------
//
// Row strides are in elements; 0 means contiguous (the stride equals cols).
//
// Two layouts of the inputs, both through pointers and strides:
//   - separate tensors: a and b each [rows, cols];
//   - fused gate||up buffer [rows, 2 * cols] (one matmul producing both halves): a = buf,
//     b = buf + cols, a_stride = b_stride = 2 * cols. The backward writes the fused gradient
//     buffer the same way: da = dbuf, db = dbuf + cols, da_stride = db_stride = 2 * cols.

template <class T>
struct GatedForwardArgs {
  const T* a = nullptr;  // [rows, cols] gate
  const T* b = nullptr;  // [rows, cols] up
  T* c = nullptr;        // [rows, cols]; may be a or b itself (in place)
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t a_stride = 0;
  std::int64_t b_stride = 0;
  std::int64_t c_stride = 0;
  float gate_multiplier = 1.0f;  // scales a before the activation
  float down_multiplier = 1.0f;  // scales the product
};

template <class T>
struct GatedBackwardArgs {
  const T* dc = nullptr;  // [rows, cols] upstream gradient (of c)
  const T* a = nullptr;   // [rows, cols] the forward's a
  const T* b = nullptr;   // [rows, cols] the forward's b
  T* da = nullptr;        // [rows, cols]; may be a (or dc, or b) itself
  T* db = nullptr;        // [rows, cols]; may be b (or dc, or a) itself; never overlaps da
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dc_stride = 0;
  std::int64_t a_stride = 0;
  std::int64_t b_stride = 0;
  std::int64_t da_stride = 0;
  std::int64_t db_stride = 0;
  float gate_multiplier = 1.0f;
  float down_multiplier = 1.0f;
};

// The ungated activation: c = act(a), da = dc * act'(a). c may be a itself, da may be a or dc.
template <class T>
struct ActivationForwardArgs {
  const T* a = nullptr;  // [rows, cols]
  T* c = nullptr;        // [rows, cols]
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t a_stride = 0;
  std::int64_t c_stride = 0;
};

template <class T>
struct ActivationBackwardArgs {
  const T* dc = nullptr;  // [rows, cols] upstream gradient (of c)
  const T* a = nullptr;   // [rows, cols] the forward's a
  T* da = nullptr;        // [rows, cols]
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dc_stride = 0;
  std::int64_t a_stride = 0;
  std::int64_t da_stride = 0;
};

// ------------------------------------------------------------------------------------------------
// 2. Math: one element at a time, in fp32, on host and device
// ------------------------------------------------------------------------------------------------

namespace gated_math {

// c before its rounding to T from the activation already rounded to T (forward's product, in its
// order; the kernels round the activations two at a time, then call it).
TIGON_HD float product(float act, float b, float down_mult) { return down_mult * act * b; }

// c before its rounding to T. act(gate_mult * a) is rounded to T before the product, as a module of
// dtype T computes it (Hugging Face's MLPs: the activation's output is a tensor of its own, then
// multiplied by up_proj's), so that 16-bit outputs match that module's bit for bit where the fp32
// activations agree; for T = float the roundings are the identity.
template <Activation Act, class T = float>
TIGON_HD float forward(float a, float b, float gate_mult, float down_mult) {
  return product(round_to<T>(Act::value(gate_mult * a)), b, down_mult);
}

// da and db before their rounding to T, with the intermediate roundings of that module's autograd:
// db from act rounded to T, da from the product dc * b rounded to T (the gradient reaching the
// activation is a tensor of dtype T).
template <Activation Act, class T = float>
TIGON_HD void backward(float dc, float a, float b, float gate_mult, float down_mult, float& da,
                       float& db) {
  float v = 0.0f, d = 0.0f;
  activation_value_and_derivative<Act>(gate_mult * a, v, d);
  const float g = dc * down_mult;
  db = g * round_to<T>(v);
  da = round_to<T>(g * b) * gate_mult * d;
}

// The ungated activation (b = 1, no multipliers): c = act(a) and da = dc * act'(a), each rounded
// once (the roundings of the gated formulas at b = 1 are exact).
template <Activation Act>
TIGON_HD float activation_forward(float a) {
  return Act::value(a);
}
template <Activation Act>
TIGON_HD float activation_backward(float dc, float a) {
  if constexpr (requires(float x) { Act::backward(x, x); }) {
    return Act::backward(dc, a);  // the functor's own composition (the squared ReLU's edge cases)
  } else {
    return dc * Act::derivative(a);
  }
}

}  // namespace gated_math

// ------------------------------------------------------------------------------------------------
// Launch shape (host-compilable; tested on the host)
// ------------------------------------------------------------------------------------------------

// The gated kernels' policy; derive to change a knob and pass it as the second template argument
// of gated_forward, e.g. `struct Mine : tigon::GatedPolicy { static constexpr int kFlat = 1; };`
// (gated_backward accepts one too; none of its knobs applies to the backward).
// The forward over dense tensors (rows cols apart, fewer than 2^31 vectors) runs a flat grid: the
// rows x cols / kV vectors in order, one block per run of 256 x kFlat of them, each thread loading
// its kFlat vectors of a and b before computing (no loop: every block is freshly scheduled, the
// shape that streams closest to the copy rate). The forward over strided rows (the fused gate‖up
// buffer) runs the persistent row grid (a grid that fills the device once, each block walking
// several rows); the backward one block per row block. Outputs are stored with the evict-first
// hint (st.global.cs), inputs loaded with it. Measured on one H200 at 16384 x 14336 bf16 in
// docs/gated.md.
struct GatedPolicy {
  // Forward only: 16-byte vectors per thread of the flat grid, 1 to 8. Two: 104.9% of the copy
  // rate, one 101.3%, four 94.3%, eight 50.2% (registers and occupancy).
  static constexpr int kFlat = 2;
};
// The same policy under its former names, for source compatibility.
using GatedForwardDefaultPolicy = GatedPolicy;
using GatedBackwardDefaultPolicy = GatedPolicy;

namespace detail {

// Every static check of a GatedPolicy, in one place (asserted by the launchers).
template <class P>
constexpr bool check_gated_policy() {
  static_assert(P::kFlat >= 1 && P::kFlat <= 8, "GatedPolicy::kFlat: 1 to 8 vectors per thread (flat grid)");
  return true;
}

}  // namespace detail

namespace detail {

inline constexpr int kGatedThreads = 256;  // threads per block (bx * by)
inline constexpr std::int64_t kGatedMaxGridY = 65535;
inline constexpr std::int64_t kGatedMaxGridX = 65535;  // more column slices would not help

// A block is bx threads along a row (column vectors) by `by` rows; the grid is gx column slices by
// gy row blocks, and both dimensions are walked grid-stride (rows: by * gy apart, column vectors:
// bx * gx apart, `unroll` of them per loop trip).
struct GatedShape {
  int bx = 0, by = 0;
  std::int64_t gx = 0, gy = 0;
};

// nvec: vectors per row (cols / vector width); target_blocks: blocks that fill the device once
// (occupancy x SMs); unroll: vectors per thread per loop trip (the kernels take 1). A persistent grid fills the device
// once and is balanced: every row block walks the same number of rows (give or take one), every
// thread the same number of vectors per row (give or take `unroll`). A non-persistent grid has one
// block per row block and column slice, up to the grid's limits.
constexpr GatedShape gated_shape(std::int64_t rows, std::int64_t nvec, std::int64_t target_blocks,
                                 int unroll, bool persistent = true) {
  GatedShape s;
  const std::int64_t per_thread = ceil_div<std::int64_t>(nvec, unroll);
  s.bx = per_thread >= kGatedThreads ? kGatedThreads : next_pow2(static_cast<int>(per_thread));
  s.by = kGatedThreads / s.bx;
  if (target_blocks < 1) target_blocks = 1;
  const std::int64_t row_blocks = ceil_div<std::int64_t>(rows, s.by);
  // Column slices: one unless the rows alone cannot fill the device.
  const std::int64_t max_gx = ceil_div<std::int64_t>(nvec, static_cast<std::int64_t>(s.bx) * unroll);
  if (!persistent) {
    s.gx = std::min(max_gx, kGatedMaxGridX);
    s.gy = std::min(row_blocks, kGatedMaxGridY);
    return s;
  }
  std::int64_t gx = row_blocks >= target_blocks ? 1 : ceil_div(target_blocks, row_blocks);
  gx = std::min(std::min(gx, max_gx), kGatedMaxGridX);
  s.gx = gx < 1 ? 1 : gx;
  // Row blocks: at most enough to fill the device, balanced so each walks the same number of rows.
  const std::int64_t want_gy = std::max<std::int64_t>(1, target_blocks / s.gx);
  const std::int64_t trips = ceil_div(row_blocks, std::min(want_gy, kGatedMaxGridY));
  s.gy = std::min(ceil_div(row_blocks, trips), kGatedMaxGridY);
  return s;
}

// ------------------------------------------------------------------------------------------------
// Validation (host only, before anything touches the device)
// ------------------------------------------------------------------------------------------------

template <class T>
Status validate(const GatedForwardArgs<T>& x, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(x.a, op, "a"));
  TIGON_CHECK(not_null(x.b, op, "b"));
  TIGON_CHECK(not_null(x.c, op, "c"));
  TIGON_CHECK(positive(x.rows, op, "rows"));
  TIGON_CHECK(positive(x.cols, op, "cols"));
  TIGON_CHECK(row_stride(x.a_stride, x.cols, op, "a_stride"));
  TIGON_CHECK(row_stride(x.b_stride, x.cols, op, "b_stride"));
  TIGON_CHECK(row_stride(x.c_stride, x.cols, op, "c_stride"));
  TIGON_CHECK(finite(x.gate_multiplier, op, "gate_multiplier"));
  TIGON_CHECK(finite(x.down_multiplier, op, "down_multiplier"));
  const MatrixView a = MatrixView::of(x.a, x.rows, x.cols, x.a_stride);
  const MatrixView b = MatrixView::of(x.b, x.rows, x.cols, x.b_stride);
  const MatrixView c = MatrixView::of(x.c, x.rows, x.cols, x.c_stride);
  TIGON_CHECK(same_or_disjoint(c, a, op, "c", "a"));
  TIGON_CHECK(same_or_disjoint(c, b, op, "c", "b"));
  return Status();
}

template <class T>
Status validate(const GatedBackwardArgs<T>& x, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(x.dc, op, "dc"));
  TIGON_CHECK(not_null(x.a, op, "a"));
  TIGON_CHECK(not_null(x.b, op, "b"));
  TIGON_CHECK(not_null(x.da, op, "da"));
  TIGON_CHECK(not_null(x.db, op, "db"));
  TIGON_CHECK(positive(x.rows, op, "rows"));
  TIGON_CHECK(positive(x.cols, op, "cols"));
  TIGON_CHECK(row_stride(x.dc_stride, x.cols, op, "dc_stride"));
  TIGON_CHECK(row_stride(x.a_stride, x.cols, op, "a_stride"));
  TIGON_CHECK(row_stride(x.b_stride, x.cols, op, "b_stride"));
  TIGON_CHECK(row_stride(x.da_stride, x.cols, op, "da_stride"));
  TIGON_CHECK(row_stride(x.db_stride, x.cols, op, "db_stride"));
  TIGON_CHECK(finite(x.gate_multiplier, op, "gate_multiplier"));
  TIGON_CHECK(finite(x.down_multiplier, op, "down_multiplier"));
  const MatrixView dc = MatrixView::of(x.dc, x.rows, x.cols, x.dc_stride);
  const MatrixView a = MatrixView::of(x.a, x.rows, x.cols, x.a_stride);
  const MatrixView b = MatrixView::of(x.b, x.rows, x.cols, x.b_stride);
  const MatrixView da = MatrixView::of(x.da, x.rows, x.cols, x.da_stride);
  const MatrixView db = MatrixView::of(x.db, x.rows, x.cols, x.db_stride);
  // Each element's inputs are all read before its outputs are written, so an output may be any
  // input itself; partial overlaps would mix elements, and the two outputs must not share one.
  TIGON_CHECK(disjoint(da, db, op, "da", "db"));
  TIGON_CHECK(same_or_disjoint(da, dc, op, "da", "dc"));
  TIGON_CHECK(same_or_disjoint(da, a, op, "da", "a"));
  TIGON_CHECK(same_or_disjoint(da, b, op, "da", "b"));
  TIGON_CHECK(same_or_disjoint(db, dc, op, "db", "dc"));
  TIGON_CHECK(same_or_disjoint(db, a, op, "db", "a"));
  TIGON_CHECK(same_or_disjoint(db, b, op, "db", "b"));
  return Status();
}

template <class T>
Status validate(const ActivationForwardArgs<T>& x, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(x.a, op, "a"));
  TIGON_CHECK(not_null(x.c, op, "c"));
  TIGON_CHECK(positive(x.rows, op, "rows"));
  TIGON_CHECK(positive(x.cols, op, "cols"));
  TIGON_CHECK(row_stride(x.a_stride, x.cols, op, "a_stride"));
  TIGON_CHECK(row_stride(x.c_stride, x.cols, op, "c_stride"));
  TIGON_CHECK(same_or_disjoint(MatrixView::of(x.c, x.rows, x.cols, x.c_stride),
                               MatrixView::of(x.a, x.rows, x.cols, x.a_stride), op, "c", "a"));
  return Status();
}

template <class T>
Status validate(const ActivationBackwardArgs<T>& x, const char* op) {
  using namespace check;
  TIGON_CHECK(not_null(x.dc, op, "dc"));
  TIGON_CHECK(not_null(x.a, op, "a"));
  TIGON_CHECK(not_null(x.da, op, "da"));
  TIGON_CHECK(positive(x.rows, op, "rows"));
  TIGON_CHECK(positive(x.cols, op, "cols"));
  TIGON_CHECK(row_stride(x.dc_stride, x.cols, op, "dc_stride"));
  TIGON_CHECK(row_stride(x.a_stride, x.cols, op, "a_stride"));
  TIGON_CHECK(row_stride(x.da_stride, x.cols, op, "da_stride"));
  const MatrixView da = MatrixView::of(x.da, x.rows, x.cols, x.da_stride);
  TIGON_CHECK(same_or_disjoint(da, MatrixView::of(x.dc, x.rows, x.cols, x.dc_stride), op, "da", "dc"));
  TIGON_CHECK(same_or_disjoint(da, MatrixView::of(x.a, x.rows, x.cols, x.a_stride), op, "da", "a"));
  return Status();
}

}  // namespace detail

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------
// 3. Kernels
// ------------------------------------------------------------------------------------------------

namespace detail {

template <class T>
struct GatedFwdParams {
  const T* a;
  const T* b;
  T* c;
  std::int64_t rows, cols;
  std::int64_t as, bs, cs;  // row strides in elements (never 0 here)
  float gate_mult, down_mult;
};

template <class T>
struct GatedBwdParams {
  const T* dc;
  const T* a;
  const T* b;
  T* da;
  T* db;
  std::int64_t rows, cols;
  std::int64_t dcs, as, bs, das, dbs;
  float gate_mult, down_mult;
};

// One vector of c = gated_math::forward<Act, T> over a and b, the activations rounded to T two at a
// time (round_pair_to: one paired conversion for bfloat16), the same bits as the scalar form.
template <class T, class Act, int kV>
TIGON_DEVICE AlignedVec<T, kV> gated_fwd_vec(const AlignedVec<T, kV>& av, const AlignedVec<T, kV>& bv, float gate_mult,
                                             float down_mult) {
  AlignedVec<T, kV> cv;
  if constexpr (kV % 2 == 0) {
#pragma unroll
    for (int k = 0; k < kV; k += 2) {
      float v0 = Act::value(gate_mult * to_float(av.v[k]));
      float v1 = Act::value(gate_mult * to_float(av.v[k + 1]));
      round_pair_to<T>(v0, v1);
      cv.v[k] = from_float<T>(gated_math::product(v0, to_float(bv.v[k]), down_mult));
      cv.v[k + 1] = from_float<T>(gated_math::product(v1, to_float(bv.v[k + 1]), down_mult));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      cv.v[k] = from_float<T>(gated_math::forward<Act, T>(to_float(av.v[k]), to_float(bv.v[k]), gate_mult, down_mult));
    }
  }
  return cv;
}

// Elementwise over [rows, cols] in vectors of kV elements (16 bytes, or 1 element when pointers,
// strides or cols do not allow 16-byte accesses). Rows: threadIdx.y + blockDim.y * blockIdx.y,
// then every blockDim.y * gridDim.y; column vectors: threadIdx.x + blockDim.x * blockIdx.x, then
// every blockDim.x * gridDim.x. Each loop trip loads one vector of every input, then computes and
// stores. Offsets are 64-bit. kGated false: the ungated activation (no b; c = act(a)).
template <class T, class Act, int kV, bool kGated = true>
TIGON_KERNEL void __launch_bounds__(kGatedThreads, 1) gated_fwd_kernel(const GatedFwdParams<T> p) {
  detail::grid_dependency_sync();
  const std::int64_t nvec = p.cols / kV;
  const std::int64_t step = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       row < p.rows; row += static_cast<std::int64_t>(blockDim.y) * gridDim.y) {
    const T* ar = p.a + row * p.as;
    const T* br = kGated ? p.b + row * p.bs : nullptr;
    T* cr = p.c + row * p.cs;
    for (std::int64_t i = first; i < nvec; i += step) {
      const AlignedVec<T, kV> av = load_vec_stream<kV>(ar + i * kV);
      AlignedVec<T, kV> bv;
      if constexpr (kGated) bv = load_vec_stream<kV>(br + i * kV);
      AlignedVec<T, kV> cv;
      if constexpr (kGated) {
        cv = gated_fwd_vec<T, Act, kV>(av, bv, p.gate_mult, p.down_mult);
      } else {
#pragma unroll
        for (int k = 0; k < kV; ++k) cv.v[k] = from_float<T>(gated_math::activation_forward<Act>(to_float(av.v[k])));
      }
      store_vec_hinted<true>(cr + i * kV, cv);
    }
  }
}

// The flat forward grid over dense tensors (every row cols apart): vector v (v < 2^31) is handled
// by thread v % 256 of block v / (256 * kN) as its (v / 256) % kN-th vector; each thread issues
// all its loads, then computes and stores.
template <class T, class Act, int kV, int kN, bool kGated = true>
TIGON_KERNEL void __launch_bounds__(kGatedThreads) gated_fwd_flat_kernel(const GatedFwdParams<T> p) {
  detail::grid_dependency_sync();
  const unsigned total = static_cast<unsigned>(p.cols / kV) * static_cast<unsigned>(p.rows);
  const unsigned base = blockIdx.x * (kGatedThreads * kN) + threadIdx.x;
  AlignedVec<T, kV> av[kN], bv[kGated ? kN : 1];
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const unsigned v = base + u * kGatedThreads;
    if (v < total) {
      av[u] = load_vec_stream<kV>(p.a + static_cast<std::int64_t>(v) * kV);
      if constexpr (kGated) bv[u] = load_vec_stream<kV>(p.b + static_cast<std::int64_t>(v) * kV);
    }
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const unsigned v = base + u * kGatedThreads;
    if (v < total) {
      AlignedVec<T, kV> cv;
      if constexpr (kGated) {
        cv = gated_fwd_vec<T, Act, kV>(av[u], bv[u], p.gate_mult, p.down_mult);
      } else {
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          cv.v[k] = from_float<T>(gated_math::activation_forward<Act>(to_float(av[u].v[k])));
        }
      }
      store_vec_hinted<true>(p.c + static_cast<std::int64_t>(v) * kV, cv);
    }
  }
}

template <class T, class Act, int kV, bool kGated = true>
TIGON_KERNEL void __launch_bounds__(kGatedThreads, 1) gated_bwd_kernel(const GatedBwdParams<T> p) {
  detail::grid_dependency_sync();
  const std::int64_t nvec = p.cols / kV;
  const std::int64_t step = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       row < p.rows; row += static_cast<std::int64_t>(blockDim.y) * gridDim.y) {
    const T* dcr = p.dc + row * p.dcs;
    const T* ar = p.a + row * p.as;
    const T* br = kGated ? p.b + row * p.bs : nullptr;
    T* dar = p.da + row * p.das;
    T* dbr = kGated ? p.db + row * p.dbs : nullptr;
    for (std::int64_t i = first; i < nvec; i += step) {
      // Every load of this trip is issued before the first store, and a thread's stores touch only
      // the elements it loaded: in-place outputs (da over a, db over b, ...) are safe.
      const AlignedVec<T, kV> dcv = load_vec_stream<kV>(dcr + i * kV);
      const AlignedVec<T, kV> av = load_vec_stream<kV>(ar + i * kV);
      AlignedVec<T, kV> bv;
      if constexpr (kGated) bv = load_vec_stream<kV>(br + i * kV);
      AlignedVec<T, kV> dav, dbv;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        if constexpr (kGated) {
          float da = 0.0f, db = 0.0f;
          gated_math::backward<Act, T>(to_float(dcv.v[k]), to_float(av.v[k]), to_float(bv.v[k]), p.gate_mult,
                                    p.down_mult, da, db);
          dav.v[k] = from_float<T>(da);
          dbv.v[k] = from_float<T>(db);
        } else {
          dav.v[k] = from_float<T>(gated_math::activation_backward<Act>(to_float(dcv.v[k]), to_float(av.v[k])));
        }
      }
      store_vec_hinted<true>(dar + i * kV, dav);
      if constexpr (kGated) store_vec_hinted<true>(dbr + i * kV, dbv);
    }
  }
}

// ---- launch planning ---------------------------------------------------------------------------

template <class T, int kV>
bool gated_vectorizable(const GatedFwdParams<T>& p) {
  return p.cols % kV == 0 && rows_aligned(p.a, p.as, kV) && rows_aligned(p.b, p.bs, kV) &&
         rows_aligned(p.c, p.cs, kV);
}

template <class T, int kV>
bool gated_vectorizable(const GatedBwdParams<T>& p) {
  return p.cols % kV == 0 && rows_aligned(p.dc, p.dcs, kV) && rows_aligned(p.a, p.as, kV) &&
         rows_aligned(p.b, p.bs, kV) && rows_aligned(p.da, p.das, kV) &&
         rows_aligned(p.db, p.dbs, kV);
}

template <class T>
GatedFwdParams<T> gated_fwd_params(const GatedForwardArgs<T>& x) {
  auto s = [&](std::int64_t v) { return v != 0 ? v : x.cols; };
  return {x.a, x.b, x.c, x.rows, x.cols, s(x.a_stride), s(x.b_stride), s(x.c_stride),
          x.gate_multiplier, x.down_multiplier};
}

template <class T>
GatedBwdParams<T> gated_bwd_params(const GatedBackwardArgs<T>& x) {
  auto s = [&](std::int64_t v) { return v != 0 ? v : x.cols; };
  return {x.dc, x.a, x.b, x.da, x.db, x.rows, x.cols, s(x.dc_stride), s(x.a_stride), s(x.b_stride),
          s(x.da_stride), s(x.db_stride), x.gate_multiplier, x.down_multiplier};
}

// The flat forward grid (dense tensors, fewer than 2^31 vectors): one block per 256 x kN vectors.
template <class T, class Act, int kV, int kN, bool kGated = true>
Status gated_flat_launch(const GatedFwdParams<T>& p, cudaStream_t stream, const char* op) {
  const std::int64_t total = p.rows * (p.cols / kV);
  const auto grid = static_cast<unsigned>(ceil_div<std::int64_t>(total, std::int64_t{kGatedThreads} * kN));
  return launch(op, gated_fwd_flat_kernel<T, Act, kV, kN, kGated>, {dim3(grid), dim3(kGatedThreads), 0, stream},
                p);
}

// Plan (occupancy, cached per device and instance) and launch one row-grid kernel instance:
// persistent (the forward) or one block per row block (the backward).
template <auto Kernel, int kV, bool kPersistent, class Params>
Status gated_launch(const Params& p, cudaStream_t stream, const char* op) {
  DeviceInfo dev;
  TIGON_CHECK(current_device_info(dev));
  int occ = 0;
  TIGON_CHECK((blocks_per_sm<Kernel, kGatedThreads>(dev.device, occ)));
  const GatedShape s = gated_shape(p.rows, p.cols / kV, static_cast<std::int64_t>(occ) * dev.sm_count,
                                   1, kPersistent);
  const dim3 block(static_cast<unsigned>(s.bx), static_cast<unsigned>(s.by));
  const dim3 grid(static_cast<unsigned>(s.gx), static_cast<unsigned>(s.gy));
  return launch(op, Kernel, {grid, block, 0, stream}, p);
}

// The gated forward's plan for either form: the flat grid over dense tensors of fewer than 2^31
// vectors, else the persistent row grid; 16-byte vectors where every pointer and row stride allows.
template <class T, class Act, int kN, bool kGated>
Status gated_forward_run(const GatedFwdParams<T>& p, cudaStream_t stream, const char* op) {
  constexpr int kV = kVecElems<T>;
  const bool vec = gated_vectorizable<T, kV>(p);
  const std::int64_t total = p.rows * (p.cols / (vec ? kV : 1));
  const bool dense = p.as == p.cols && (!kGated || p.bs == p.cols) && p.cs == p.cols;
  if (dense && total < (std::int64_t{1} << 31) - kGatedThreads * kN) {
    return vec ? gated_flat_launch<T, Act, kV, kN, kGated>(p, stream, op)
               : gated_flat_launch<T, Act, 1, kN, kGated>(p, stream, op);
  }
  if (vec) return gated_launch<gated_fwd_kernel<T, Act, kV, kGated>, kV, true>(p, stream, op);
  return gated_launch<gated_fwd_kernel<T, Act, 1, kGated>, 1, true>(p, stream, op);
}

template <class T, class Act, bool kGated>
Status gated_backward_run(const GatedBwdParams<T>& p, cudaStream_t stream, const char* op) {
  constexpr int kV = kVecElems<T>;
  if (gated_vectorizable<T, kV>(p)) {
    return gated_launch<gated_bwd_kernel<T, Act, kV, kGated>, kV, false>(p, stream, op);
  }
  return gated_launch<gated_bwd_kernel<T, Act, 1, kGated>, 1, false>(p, stream, op);
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// 4. Launchers
// ------------------------------------------------------------------------------------------------
//
// gated_forward<Act>(args, stream) and gated_backward<Act>(args, stream) for any activation functor
// (activations.hpp), optionally with a GatedPolicy as second template argument; swiglu_* and
// geglu_* name the common ones; activation_forward / activation_backward (relu2_* for the squared
// ReLU) the ungated form. Each call validates its arguments (an invalid call launches nothing
// and writes nothing), picks the 16-byte vector kernel when every pointer and row stride is aligned
// to 16 bytes and cols is a multiple of the vector width, the scalar kernel otherwise, and enqueues
// one kernel on `stream`. None of them allocates, synchronises or copies to the host: all are
// graph-capturable.

template <Activation Act, class Policy = GatedPolicy, class T>
[[nodiscard]] Status gated_forward(const GatedForwardArgs<T>& args, cudaStream_t stream) {
  static_assert(detail::check_gated_policy<Policy>());
  constexpr const char* kOp = "gated_forward";
  TIGON_CHECK(detail::validate(args, kOp));
  return detail::gated_forward_run<T, Act, Policy::kFlat, true>(detail::gated_fwd_params(args), stream, kOp);
}

template <Activation Act, class Policy = GatedPolicy, class T>
[[nodiscard]] Status gated_backward(const GatedBackwardArgs<T>& args, cudaStream_t stream) {
  static_assert(detail::check_gated_policy<Policy>());
  constexpr const char* kOp = "gated_backward";
  TIGON_CHECK(detail::validate(args, kOp));
  return detail::gated_backward_run<T, Act, true>(detail::gated_bwd_params(args), stream, kOp);
}

// The ungated activation: c = act(a) (activation_forward), da = dc * act'(a) (activation_backward),
// through the gated kernels' instances without b: the same grids, 16-byte vectors where allowed.
template <Activation Act, class Policy = GatedPolicy, class T>
[[nodiscard]] Status activation_forward(const ActivationForwardArgs<T>& args, cudaStream_t stream) {
  static_assert(detail::check_gated_policy<Policy>());
  constexpr const char* kOp = "activation_forward";
  TIGON_CHECK(detail::validate(args, kOp));
  const detail::GatedFwdParams<T> p{args.a, nullptr, args.c, args.rows, args.cols,
                                    args.a_stride != 0 ? args.a_stride : args.cols, args.cols,
                                    args.c_stride != 0 ? args.c_stride : args.cols, 1.0f, 1.0f};
  return detail::gated_forward_run<T, Act, Policy::kFlat, false>(p, stream, kOp);
}

template <Activation Act, class Policy = GatedPolicy, class T>
[[nodiscard]] Status activation_backward(const ActivationBackwardArgs<T>& args, cudaStream_t stream) {
  static_assert(detail::check_gated_policy<Policy>());
  constexpr const char* kOp = "activation_backward";
  TIGON_CHECK(detail::validate(args, kOp));
  auto s = [&](std::int64_t v) { return v != 0 ? v : args.cols; };
  const detail::GatedBwdParams<T> p{args.dc, args.a, nullptr, args.da, nullptr, args.rows, args.cols,
                                    s(args.dc_stride), s(args.a_stride), args.cols, s(args.da_stride), args.cols,
                                    1.0f, 1.0f};
  return detail::gated_backward_run<T, Act, false>(p, stream, kOp);
}

// SwiGLU: c = down * silu(gate * a) * b.
template <class T>
[[nodiscard]] Status swiglu_forward(const GatedForwardArgs<T>& args, cudaStream_t stream) {
  return gated_forward<Silu>(args, stream);
}
template <class T>
[[nodiscard]] Status swiglu_backward(const GatedBackwardArgs<T>& args, cudaStream_t stream) {
  return gated_backward<Silu>(args, stream);
}

// GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh). For the exact (erf)
// GELU, call gated_forward<GeluErf> / gated_backward<GeluErf>.
template <class T>
[[nodiscard]] Status geglu_forward(const GatedForwardArgs<T>& args, cudaStream_t stream) {
  return gated_forward<GeluTanh>(args, stream);
}
template <class T>
[[nodiscard]] Status geglu_backward(const GatedBackwardArgs<T>& args, cudaStream_t stream) {
  return gated_backward<GeluTanh>(args, stream);
}

// Squared ReLU, ungated (Nemotron's MLP): c = relu(a)^2.
template <class T>
[[nodiscard]] Status relu2_forward(const ActivationForwardArgs<T>& args, cudaStream_t stream) {
  return activation_forward<ReluSquared>(args, stream);
}
template <class T>
[[nodiscard]] Status relu2_backward(const ActivationBackwardArgs<T>& args, cudaStream_t stream) {
  return activation_backward<ReluSquared>(args, stream);
}

#endif  // __CUDACC__

TIGON_NAMESPACE_END
