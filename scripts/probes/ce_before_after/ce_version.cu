// One version of the cross-entropy (loss + gradient in place, mean) behind a C entry point: built
// twice by build.sh, against this tree and against an earlier commit's (its namespace renamed).
#include <tigon/loss/cross_entropy.cuh>
extern "C" int AB_NAME(void* logits, const long* t, long rows, long V, float* loss, void* ws,
                       unsigned long wsb, cudaStream_t s) {
  tigon::CrossEntropyArgs<tigon::bf16, long> a{};
  a.logits = static_cast<tigon::bf16*>(logits);
  a.targets = t;
  a.rows = rows;
  a.vocab = V;
  a.dlogits = static_cast<tigon::bf16*>(logits);
  a.loss = loss;
  a.workspace = ws;
  a.workspace_bytes = wsb;
  tigon::Status st = tigon::cross_entropy(a, s);
  if (!st.ok()) { printf("%s\n", st.message().c_str()); return 1; }
  return 0;
}
