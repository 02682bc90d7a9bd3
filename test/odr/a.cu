// Two translation units that include every header, linked into one program: a header that defines
// a non-template, non-inline function or kernel breaks the link (one definition per program).
#include <tigon/tigon.cuh>
#include <tigon/blas/gemm.cuh>

int tigon_odr_other();

int main() { return tigon_odr_other(); }
