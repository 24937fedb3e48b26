// Small row-major fp32 GEMMs for the fused attention (attention.cpp): C (=|+=) alpha A B with A read
// through any row and column strides (so A or A^T), B row-major, and the causal structure of a
// block of attention used to skip what the mask zeroes. Register-tiled (6 rows x 16 columns of C),
// no packing: the operands of one (batch, head) sit in L1/L2. AVX2 + FMA and baseline clones, picked
// per call (model/clones.h). A fixed summation order per element and no threads: with one clone the
// bits depend only on the operands (the two clones differ by rounding: the AVX2 one fuses multiply-adds).
#pragma once
#include <cstdint>

namespace sl::model {

// A(r, k) = p[r * rs + k * ks].
struct MatA {
  const float* p;
  int64_t rs, ks;
};

// Which part of the product a causal block needs. Rows and columns of C, and k, are indices local to
// the operands; `diag` is the index offset that puts the diagonal at r + diag:
//   all         every element, every k;
//   cols_to_diag   row r needs columns c <= r + diag only (scores: query row r, key c); a few more
//                  may be written (whole vectors);
//   k_to_diag      row r sums k <= r + diag only (A(r, k) is 0 beyond: probabilities times values);
//   k_from_diag    row r sums k >= r - diag only (A = P^T, zero above: keys' gradients).
enum class Causal { all, cols_to_diag, k_to_diag, k_from_diag };

struct GemmShape {
  int64_t M, N, K;
  Causal causal = Causal::all;
  int64_t diag = 0;
};

// C[M x N] = alpha A B (accumulate: C += alpha A B), B: K x N row-major (ldb), C row-major (ldc).
// cols_to_diag leaves the elements right of a row's diagonal, past the last whole vector, as they
// were; the k-bounded kinds write every element.
void small_gemm(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c, int64_t ldc,
                bool accumulate);

}  // namespace sl::model
