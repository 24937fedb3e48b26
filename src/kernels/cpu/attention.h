// The fused causal attention's loops (model/attention.h holds its contract, its autograd nodes and the
// split over (batch, head) pairs), on one (batch, head) at a time: flash-style blocks of kRowBlock query
// rows, the scores of a block on small_gemm tiles (kernels/cpu/small_gemm.h) up to the causal diagonal,
// softmax rows with the exps of kernels/cpu/fast_exp.h, the log-sum-exp of each row saved for backward,
// which recomputes the probabilities from it. fp32 heads in place (strided rows), or bf16 heads on bf16
// products where the CPU has AVX512-BF16 (small_gemm_bf16; the caller decides, bf16_dot_products()).
// The row kernels have AVX2 + FMA and baseline clones picked per call (kernels/cpu/clones.h), the softmax
// rows a 16-lane AVX-512 form with the AVX2 clone's bits (device::avx512_kernels()). One thread per head,
// a fixed order of every sum: the bits depend on the operands and the clone alone.
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {

constexpr int64_t kRowBlock = 64;  // query rows per block of scores (the scratch holds one)

// The rows of one (batch, head) of a (B, nh, T, hd) tensor: row t at p + t * ld.
struct Rows {
  float* p;
  int64_t ld;
  float* row(int64_t t) const { return p + t * ld; }
};

struct Head {
  Rows q, k, v, o;
  float* lse;  // (T)
};

struct HeadGrad {
  Rows dout, dq, dk, dv;
};

struct HeadShape {
  int64_t T, hd;
  float scale;
};

// A thread's fp32 scratch for backward_head (and backward_head_bf16).
struct BackwardScratch {
  float *p, *dp;  // kRowBlock * T each
  float *kt, *vt; // hd * T each
  float* d;       // T
};


// o = softmax(scale q k^T + causal mask) v, lse = its rows' log-sum-exp.
// Scratch: s (kRowBlock * T floats), kt (hd * T).
void forward_head(const Head& x, const HeadShape& sh, float* s, float* kt);

// The flash backward, block by block from the last (which sees every key, so it initializes dk and dv):
// p from the saved lse; dv += p^T dout; dp = dout v^T; ds = p (dp - rowsum(dout * o));
// dq = scale ds k; dk += scale ds^T q.
void backward_head(const Head& x, const HeadGrad& g, const HeadShape& sh, const BackwardScratch& w);

// ---- bf16 heads through fp32: widened into a thread's fp32 scratch, results rounded back ----

// dst[t * hd + c] = src[t * ld + c] widened, for T rows of hd: exact, so both clones give the same bits.
void widen_rows(const Bf16* src, int64_t ld, int64_t T, int64_t hd, float* dst);
// dst[t * ld + c] = src[t * hd + c] rounded to nearest even: both clones give the same bits.
void narrow_rows(const float* src, int64_t T, int64_t hd, Bf16* dst, int64_t ld);

// ---- bf16 heads on bf16 products (AVX512-BF16, small_gemm_bf16) ----
// q, k, v and the output gradient are read as bf16 where they are (no fp32 copy) and packed as bf16
// pairs; the probabilities P and the scores' gradient dS (fp32) are rounded to bf16 as they are packed,
// as ATen's bf16 flash attention rounds them; every sum is fp32. Pairs along a row come from
// pack_row_pairs, pairs down a column from pack_column_pairs; an A operand read down columns takes the
// latter with strides (1, ld).

// Pairs of n elements (an odd last one pairs with 0).
inline int64_t pairs(int64_t n) { return (n + 1) / 2; }

// The rows of one (batch, head) of a bf16 (B, nh, T, hd) tensor, read in place.
struct Bf16Rows {
  const Bf16* p;
  int64_t ld;
  const Bf16* row(int64_t t) const { return p + t * ld; }
};

// A head's packed operands, and the block's (a: an A operand, b: a B operand). uint32 words in the
// thread's fp32 scratch (the floats are never read as words or the words as floats).
struct DotScratch {
  uint32_t *kt, *v;   // B of q k^T: k's pairs along rows, transposed [pairs(hd)][T]; forward: B of p v:
                      // v's pairs down columns [pairs(T)][hd]
  uint32_t *vt, *k;   // backward: B of dout v^T [pairs(hd)][T]; B of ds k [pairs(T)][hd]
  uint32_t *a, *b;    // kRowBlock * max(pairs(hd), pairs(T)); (kRowBlock / 2) * hd

  static int64_t words(const HeadShape& sh, bool backward) {
    const int64_t head = pairs(sh.hd) * sh.T + pairs(sh.T) * sh.hd;  // forward: kt, v; backward: kt, vt, k
    const int64_t vt = backward ? pairs(sh.hd) * sh.T : 0;
    return head + vt + kRowBlock * std::max(pairs(sh.hd), pairs(sh.T)) + (kRowBlock / 2) * sh.hd;
  }
  static DotScratch at(float* w, const HeadShape& sh, bool backward) {
    auto* p = reinterpret_cast<uint32_t*>(w);
    DotScratch d{};
    const int64_t kt = pairs(sh.hd) * sh.T, rows = pairs(sh.T) * sh.hd;
    d.kt = p, p += kt;
    if (backward) d.vt = p, p += kt, d.k = p, p += rows;
    else d.v = p, p += rows;
    d.a = p, p += kRowBlock * std::max(pairs(sh.hd), pairs(sh.T));
    d.b = p;
    return d;
  }
};

// A bf16 head on bf16 products: q, k, v, o and dout read in place.
struct Bf16Head {
  Bf16Rows q, k, v, o;
  const float* lse;
};

struct Bf16HeadGrad {
  Bf16Rows dout;
  Rows dq, dk, dv;  // fp32 rows, rounded into the gradients when the head is done
};
// forward_head on bf16 q, k, v with bf16 products: o (fp32 rows) and lse.
void forward_head_bf16(const Bf16Rows& q, const Bf16Rows& k, const Bf16Rows& v, const Rows& o, float* lse,
                       const HeadShape& sh, float* s, const DotScratch& d);

// backward_head on bf16 products. w.kt and w.vt take dout and o widened, for the rows' sums of
// dout * o (the same fp32 sums backward_head takes).
void backward_head_bf16(const Bf16Head& x, const Bf16HeadGrad& g, const HeadShape& sh, const BackwardScratch& w,
                        const DotScratch& d);

}  // namespace sl::kernels::cpu
