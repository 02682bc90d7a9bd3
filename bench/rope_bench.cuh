// The RoPE benchmarks' shared body (bench/bench_rope.cu, and the policy sweeps of
// bench/tuning/bench_rope_tuning.cu): bf16, batch B, sequence T, 32 query and 8 KV heads of 128,
// q and k rotated in place in one launch over rotating input sets, [B, T, H, D] or [B, H, T, D];
// with Mode::mrope, Qwen2-VL-7B's attention (28 query and 4 KV heads of 128, M-RoPE sections 16 / 24 /
// 24 over per-batch tables [3, B, T, 128]); Mode::batch_tables the same heads with one per-batch
// table [B, T, 128] (the rotation transformers 5 runs on its composed M-RoPE table). Useful bytes: read q and k once, write them once, read
// the cos / sin entries once (one plane's per channel under M-RoPE).
#pragma once

#include <string>
#include <vector>

#include <tigon/rope/rope.cuh>

#include "harness.cuh"

namespace rope_bench {

using bench::check;

enum class Mode { llama, mrope, batch_tables };

template <class Style, class P = tigon::RopePolicy>
void run(benchmark::State& st, bool backward, bool bhtd, const char* label, Mode mode = Mode::llama) {
  const bool qwen = mode != Mode::llama, mrope = mode == Mode::mrope;
  const std::int64_t B = st.range(0), T = st.range(1), Hq = qwen ? 28 : 32, Hk = qwen ? 4 : 8, D = 128;
  const std::size_t nq = static_cast<std::size_t>(B * T * Hq * D), nk = static_cast<std::size_t>(B * T * Hk * D);
  const std::int64_t table = (mrope ? 3 : 1) * (qwen ? B : 1) * T * D;  // elements of cos (and of sin)
  const double bytes = 2.0 * (nq + nk) * sizeof(tigon::bf16) + 2.0 * (qwen ? B : 1) * T * D * sizeof(tigon::bf16);
  const int sets = bench::rotation(2.0 * (nq + nk) * sizeof(tigon::bf16));
  std::vector<tigon::bf16*> q, k;
  for (int s = 0; s < sets; ++s) {
    q.push_back(bench::alloc<tigon::bf16>(nq));
    k.push_back(bench::alloc<tigon::bf16>(nk));
    bench::fill_random(q.back(), nq, 21 + s);
    bench::fill_random(k.back(), nk, 41 + s);
  }
  tigon::bf16* cs = bench::alloc<tigon::bf16>(table);
  tigon::bf16* sn = bench::alloc<tigon::bf16>(table);
  bench::fill_random(cs, table, 3);
  bench::fill_random(sn, table, 4);
  auto args = [&](int i) {
    const int s = i % sets;
    tigon::RopeArgs<tigon::bf16> a;
    if (bhtd) {
      a.q = {.in = q[s], .out = q[s], .heads = Hq, .stride_b = Hq * T * D, .stride_t = D, .stride_h = T * D};
      a.k = {.in = k[s], .out = k[s], .heads = Hk, .stride_b = Hk * T * D, .stride_t = D, .stride_h = T * D};
    } else {
      a.q = {.in = q[s], .out = q[s], .heads = Hq, .stride_b = T * Hq * D, .stride_t = Hq * D, .stride_h = D};
      a.k = {.in = k[s], .out = k[s], .heads = Hk, .stride_b = T * Hk * D, .stride_t = Hk * D, .stride_h = D};
    }
    a.batch = B;
    a.seq = T;
    a.head_dim = D;
    a.cos = cs;
    a.sin = sn;
    a.table_rows = T;
    if (qwen) a.table_stride_b = T * D;
    if (mrope) {
      a.sections[0] = 16;
      a.sections[1] = 24;
      a.sections[2] = 24;
    }
    return a;
  };
  bench::run(st, std::string("rope ") + label, bytes, [&](int i) {
    check(backward ? tigon::rope_backward<Style, P>(args(i), nullptr)
                   : tigon::rope_forward<Style, P>(args(i), nullptr));
  });
  for (int s = 0; s < sets; ++s) {
    cudaFree(q[s]);
    cudaFree(k[s]);
  }
  cudaFree(cs);
  cudaFree(sn);
}

}  // namespace rope_bench
