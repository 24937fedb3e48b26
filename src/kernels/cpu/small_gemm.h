// Small row-major fp32 GEMMs for the fused attention (kernels/cpu/attention.cpp): C (=|+=) alpha A B with A read
// through any row and column strides (so A or A^T), B row-major, and the causal structure of a
// block of attention used to skip what the mask zeroes. Register-tiled (6 rows x 16 columns of C),
// no packing: the operands of one (batch, head) sit in L1/L2. AVX2 + FMA and baseline clones, picked
// per call (kernels/cpu/clones.h), and a 16-lane AVX-512 form where device::avx512_kernels() says so (tiles
// up to 6 x 64) with the AVX2 clone's arithmetic, so its bits. A fixed summation order per element and
// no threads: the bits depend only on the operands and whether the baseline runs (it differs from the
// vector forms by rounding: they fuse each multiply-add).
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {

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


// ---- bf16 products on CPUs with AVX512-BF16 (vdpbf16ps): the bf16 attention's GEMMs ----
// Operands are bf16 pairs along k packed into 32-bit words (element 2k in the low half, 2k + 1 in the
// high half); each instruction multiplies two pairs exactly and adds both products to an fp32
// accumulator (ATen's and oneDNN's bf16 GEMMs accumulate in fp32 the same way); vdpbf16ps flushes
// denormal inputs and results to zero (below 1.2e-38: no effect on attention's values). A missing last element
// of a pair is 0. Called only where bf16_dot_products() says so.

// A's pair (r, kp) = p[r * rs + kp * ks]: a broadcast per pair, so any strides cost the same.
struct WordsA {
  const uint32_t* p;
  int64_t rs, ks;
};

// The CPU runs AVX512-BF16 (with AVX-512 F/BW/VL) and oneDNN's cap (ONEDNN_MAX_CPU_ISA) allows
// avx512_core_bf16: a cap below it stands for a CPU without the instructions, for this kernel as for
// the libraries (device/cpu_features.h).
bool bf16_dot_products();

// dst[r * ld + cp] = (x[r][2 cp], x[r][2 cp + 1]) rounded to bf16 (to nearest even: exact for values
// widened from bf16), for `rows` rows of `cols` fp32 at stride ldx: pairs along a row.
void pack_row_pairs(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld);
// dst[rp * ld + c] = (x[2 rp][c], x[2 rp + 1][c]) rounded the same way: pairs down a column.
void pack_column_pairs(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld);
// The same from bf16 rows (the bits as they are), and pairs along a row stored transposed:
// pack_row_pairs_transposed's dst[cp * ld + r] = (x[r][2 cp], x[r][2 cp + 1]) (the B of q k^T from k).
void pack_row_pairs(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld);
void pack_column_pairs(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld);
void pack_row_pairs_transposed(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst,
                               int64_t ld);

// small_gemm's contract (the causal kinds included; cols_to_diag may write up to a whole 16-column
// vector past a row's diagonal) on packed operands: A as WordsA, B's pair (kp, n) = b[kp * ldb + n];
// K counts elements (ceil(K / 2) pairs). A fixed summation order per element, no threads.
void small_gemm_bf16(const GemmShape& s, float alpha, WordsA a, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                     bool accumulate);

}  // namespace sl::kernels::cpu
