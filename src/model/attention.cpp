#include "model/attention.h"
#include "model/bf16.h"
#include "model/clones.h"
#include "model/fast_exp.h"
#include "model/intra_op.h"
#include "model/small_gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <array>
#include <tuple>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

namespace sl::model {
namespace {

constexpr int64_t kRowBlock = 64;  // query rows per block of scores (the scratch holds one)
constexpr int kLanes = 8;          // independent accumulators per reduction, so the loops vectorize

// ---- per-row kernels: one clone per instruction set (AVX2 + FMA, baseline), picked per call (clones.h) ----

// Scores s[0, valid) of one query row (its keys up to the diagonal) become probabilities; s[valid, n)
// are set to 0. Returns the row's log-sum-exp.
// The end of a softmax row once s[0, j) holds its exps and lane[] their sums in kLanes lanes: the lanes
// summed in order, the exps of the tail [j, valid) added one by one, the row normalised, s[valid, n)
// zeroed. Returns the row's log-sum-exp.
SL_KERNEL_BODY float finish_softmax_row(float* s, const float* lane, int64_t j, float mx, int64_t valid, int64_t n) {
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  for (; j < valid; ++j) {
    s[j] = exp_approx(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.0f / sum;
  for (j = 0; j < valid; ++j) s[j] *= inv;
  for (; j < n; ++j) s[j] = 0.0f;
  return mx + std::log(sum);
}

SL_KERNEL_BODY float softmax_row8_body(float* s, int64_t valid, int64_t n) {
  float lane[kLanes];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= valid; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = s[j + l] > lane[l] ? s[j + l] : lane[l];
  float mx = lane[0];
  for (int l = 1; l < kLanes; ++l) mx = std::max(mx, lane[l]);
  for (; j < valid; ++j) mx = std::max(mx, s[j]);

  for (float& l : lane) l = 0.0f;
  j = 0;
  for (; j + kLanes <= valid; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_approx(s[j + l] - mx);
      s[j + l] = e;
      lane[l] += e;
    }
  return finish_softmax_row(s, lane, j, mx, valid, n);
}
SL_KERNEL_CLONES(float, softmax_row8, (float* s, int64_t valid, int64_t n), (s, valid, n))

// Backward's probabilities from the saved log-sum-exp: s[j] = exp(s[j] - lse) up to the diagonal, 0 after.
SL_KERNEL_BODY void probs_row8_body(float* s, float lse, int64_t valid, int64_t n) {
  int64_t j = 0;
  for (; j < valid; ++j) s[j] = exp_approx(s[j] - lse);
  for (; j < n; ++j) s[j] = 0.0f;
}
SL_KERNEL_CLONES(void, probs_row8, (float* s, float lse, int64_t valid, int64_t n), (s, lse, valid, n))

#if defined(__x86_64__)
// The AVX2 clones of softmax_row8 and probs_row8 with their exps on 16 lanes (AVX-512), where
// device::avx512_kernels() says so: the same operations in the same order, so the same bits. The exp is
// exp_approx's steps with the multiply-adds the AVX2 clone contracts (exp_approx16); the row sum keeps
// the 8 lanes of the AVX2 clone, each adding its two elements of a 16-lane block in order; the max is
// exact in any order; the tails are the scalar code the AVX2 clone runs.
#define SL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

SL_AVX512 float softmax_row_avx512(float* s, int64_t valid, int64_t n) {
  __m512 mx16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= valid; j += 16) mx16 = _mm512_max_ps(_mm512_loadu_ps(s + j), mx16);
  float mx = _mm512_reduce_max_ps(mx16);
  for (; j < valid; ++j) mx = std::max(mx, s[j]);

  const __m512 m16 = _mm512_set1_ps(mx);
  __m256 lane = _mm256_setzero_ps();
  j = 0;
  for (; j + 16 <= valid; j += 16) {
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
    _mm512_storeu_ps(s + j, e);
    lane = _mm256_add_ps(_mm256_add_ps(lane, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  if (j + 8 <= valid) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm512_castps512_ps256(m16)));
    _mm256_storeu_ps(s + j, e);
    lane = _mm256_add_ps(lane, e);
    j += 8;
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, lane);
  return finish_softmax_row(s, lanes, j, mx, valid, n);
}

SL_AVX512 void probs_row_avx512(float* s, float lse, int64_t valid, int64_t n) {
  const __m512 l16 = _mm512_set1_ps(lse);
  int64_t j = 0;
  for (; j + 16 <= valid; j += 16) _mm512_storeu_ps(s + j, exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(s + j), l16)));
  for (; j < valid; ++j) s[j] = exp_approx(s[j] - lse);
  for (; j < n; ++j) s[j] = 0.0f;
}
#undef SL_AVX512
#endif

// The form for this call: 16 lanes (bit for bit the AVX2 clone), else the AVX2 or the baseline clone.
float softmax_row(float* s, int64_t valid, int64_t n) {
#if defined(__x86_64__)
  if (device::avx512_kernels()) return softmax_row_avx512(s, valid, n);
#endif
  return softmax_row8(s, valid, n);
}

void probs_row(float* s, float lse, int64_t valid, int64_t n) {
#if defined(__x86_64__)
  if (device::avx512_kernels()) return probs_row_avx512(s, lse, valid, n);
#endif
  probs_row8(s, lse, valid, n);
}

// Gradient of the scores (before the scale), up to the diagonal: dp[j] = p[j] (dp[j] - d), d = the row's
// sum of dO * O; 0 after it (where dp holds, at most up to the next whole vector, masked products).
SL_KERNEL_BODY void dscore_row_body(const float* p, float* dp, float d, int64_t valid, int64_t n) {
  int64_t j = 0;
  for (; j < valid; ++j) dp[j] = p[j] * (dp[j] - d);
  for (; j < n; ++j) dp[j] = 0.0f;
}
SL_KERNEL_CLONES(void, dscore_row, (const float* p, float* dp, float d, int64_t valid, int64_t n), (p, dp, d, valid, n))

// dst[c * rows + r] = src[r * ld + c]: hd x T from T rows of hd, in 8 x 8 blocks (both sides stay in cache).
void transpose_rows(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t kB = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kB)
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * ld + c];
    }
}

SL_KERNEL_BODY float dot_body(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += a[j + l] * b[j + l];
  float sum = 0.0f;
  for (float l : lane) sum += l;
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}
SL_KERNEL_CLONES(float, dot, (const float* a, const float* b, int64_t n), (a, b, n))

// ---- one (batch, head) ----

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

struct Shape {
  int64_t T, hd;
  float scale;
};

// Query rows [i0, i0 + m) see keys [0, i0 + m): the block's m x n score matrix, n = i0 + m.
struct Block {
  int64_t i0, m, n;
};

Block block_at(int64_t i0, int64_t T) {
  const int64_t m = std::min(kRowBlock, T - i0);
  return {i0, m, i0 + m};
}

// s = scale q_blk k^T for the block's keys up to each row's diagonal (m x n, row stride n); kt: k^T.
void scores(const Head& x, const Shape& sh, const Block& blk, const float* kt, float* s) {
  small_gemm({blk.m, blk.n, sh.hd, Causal::cols_to_diag, blk.i0}, sh.scale, {x.q.row(blk.i0), x.q.ld, 1}, kt, sh.T,
             s, blk.n, /*accumulate=*/false);
}

// ---- bf16 products (AVX512-BF16, small_gemm_bf16) for bf16 heads ----
// q, k, v and the output gradient are read as bf16 where they are (no fp32 copy) and packed as bf16
// pairs; the probabilities P and the scores' gradient dS (fp32) are rounded to bf16 as they are packed,
// as ATen's bf16 flash attention rounds them; every sum is fp32. Pairs along a row come from
// pack_row_pairs, pairs down a column from pack_column_pairs; an A operand read down columns takes the
// latter with strides (1, ld).

int64_t pairs(int64_t n) { return (n + 1) / 2; }

// The rows of one (batch, head) of a bf16 (B, nh, T, hd) tensor, read in place.
struct Bf16Rows {
  const c10::BFloat16* p;
  int64_t ld;
  const c10::BFloat16* row(int64_t t) const { return p + t * ld; }
};

// A head's packed operands, and the block's (a: an A operand, b: a B operand). uint32 words in the
// thread's fp32 scratch (the floats are never read as words or the words as floats).
struct DotScratch {
  uint32_t *kt, *v;   // B of q k^T: k's pairs along rows, transposed [pairs(hd)][T]; forward: B of p v:
                      // v's pairs down columns [pairs(T)][hd]
  uint32_t *vt, *k;   // backward: B of dout v^T [pairs(hd)][T]; B of ds k [pairs(T)][hd]
  uint32_t *a, *b;    // kRowBlock * max(pairs(hd), pairs(T)); (kRowBlock / 2) * hd

  static int64_t words(const Shape& sh, bool backward) {
    const int64_t head = pairs(sh.hd) * sh.T + pairs(sh.T) * sh.hd;  // forward: kt, v; backward: kt, vt, k
    const int64_t vt = backward ? pairs(sh.hd) * sh.T : 0;
    return head + vt + kRowBlock * std::max(pairs(sh.hd), pairs(sh.T)) + (kRowBlock / 2) * sh.hd;
  }
  static DotScratch at(float* w, const Shape& sh, bool backward) {
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

// s = scale q_blk k^T as scores() does, on bf16 pairs (d.kt packed).
void scores_bf16(const Bf16Rows& q, const Shape& sh, const Block& blk, const DotScratch& d, float* s) {
  pack_row_pairs(q.row(blk.i0), q.ld, blk.m, sh.hd, d.a, pairs(sh.hd));
  small_gemm_bf16({blk.m, blk.n, sh.hd, Causal::cols_to_diag, blk.i0}, sh.scale, {d.a, pairs(sh.hd), 1}, d.kt, sh.T, s,
                  blk.n, /*accumulate=*/false);
}

// c (m x hd, ldc) = alpha lhs rhs: `lhs` (m x n fp32, row stride n, zero past each row's diagonal)
// times the packed [pairs(n)][hd] `rhs`, rows summing up to their diagonal.
void rows_times_bf16(const Shape& sh, const Block& blk, float alpha, const float* lhs, const uint32_t* rhs,
                     const DotScratch& d, float* c, int64_t ldc) {
  pack_row_pairs(lhs, blk.n, blk.m, blk.n, d.a, pairs(blk.n));
  small_gemm_bf16({blk.m, sh.hd, blk.n, Causal::k_to_diag, blk.i0}, alpha, {d.a, pairs(blk.n), 1}, rhs, sh.hd, c, ldc,
                  false);
}

// c (n x hd) (=|+=) alpha lhs^T rows: `lhs` (m x n as above), `rows` the block's m rows of a bf16
// (T, hd) operand; keys sum from their diagonal on.
void transposed_times_bf16(const Shape& sh, const Block& blk, float alpha, const float* lhs, const Bf16Rows& rows,
                           const DotScratch& d, const Rows& c, bool accumulate) {
  pack_column_pairs(lhs, blk.n, blk.m, blk.n, d.a, blk.n);
  pack_column_pairs(rows.row(blk.i0), rows.ld, blk.m, sh.hd, d.b, sh.hd);
  small_gemm_bf16({blk.n, sh.hd, blk.m, Causal::k_from_diag, blk.i0}, alpha, {d.a, 1, blk.n}, d.b, sh.hd, c.p, c.ld,
                  accumulate);
}

// forward_head on bf16 q, k, v with bf16 products: o (fp32 rows) and lse.
void forward_head_bf16(const Bf16Rows& q, const Bf16Rows& k, const Bf16Rows& v, const Rows& o, float* lse,
                       const Shape& sh, float* s, const DotScratch& d) {
  pack_row_pairs_transposed(k.p, k.ld, sh.T, sh.hd, d.kt, sh.T);
  pack_column_pairs(v.p, v.ld, sh.T, sh.hd, d.v, sh.hd);
  for (int64_t i0 = 0; i0 < sh.T; i0 += kRowBlock) {
    const Block blk = block_at(i0, sh.T);
    scores_bf16(q, sh, blk, d, s);
    for (int64_t r = 0; r < blk.m; ++r) lse[i0 + r] = softmax_row(s + r * blk.n, i0 + r + 1, blk.n);
    rows_times_bf16(sh, blk, 1.0f, s, d.v, d, o.row(i0), o.ld);
  }
}

// o = softmax(scale q k^T + causal mask) v, lse = its rows' log-sum-exp.
// Scratch: s (kRowBlock * T floats), kt (hd * T).
void forward_head(const Head& x, const Shape& sh, float* s, float* kt) {
  transpose_rows(x.k.p, x.k.ld, sh.T, sh.hd, kt);
  for (int64_t i0 = 0; i0 < sh.T; i0 += kRowBlock) {
    const Block blk = block_at(i0, sh.T);
    scores(x, sh, blk, kt, s);
    for (int64_t r = 0; r < blk.m; ++r) x.lse[i0 + r] = softmax_row(s + r * blk.n, i0 + r + 1, blk.n);
    small_gemm({blk.m, sh.hd, blk.n, Causal::k_to_diag, i0}, 1.0f, {s, blk.n, 1}, x.v.p, x.v.ld, x.o.row(i0), x.o.ld,
               false);
  }
}

struct BackwardScratch {
  float *p, *dp;  // kRowBlock * T each
  float *kt, *vt; // hd * T each
  float* d;       // T
};

// The flash backward, block by block from the last (which sees every key, so it initializes dk and dv):
// p from the saved lse; dv += p^T dout; dp = dout v^T; ds = p (dp - rowsum(dout * o));
// dq = scale ds k; dk += scale ds^T q.
void backward_head(const Head& x, const HeadGrad& g, const Shape& sh, const BackwardScratch& w) {
  for (int64_t t = 0; t < sh.T; ++t) w.d[t] = dot(g.dout.row(t), x.o.row(t), sh.hd);
  transpose_rows(x.k.p, x.k.ld, sh.T, sh.hd, w.kt);
  transpose_rows(x.v.p, x.v.ld, sh.T, sh.hd, w.vt);
  const int64_t last = (sh.T - 1) / kRowBlock * kRowBlock;
  for (int64_t i0 = last; i0 >= 0; i0 -= kRowBlock) {
    const Block blk = block_at(i0, sh.T);
    const bool acc = i0 != last;
    scores(x, sh, blk, w.kt, w.p);
    for (int64_t r = 0; r < blk.m; ++r) probs_row(w.p + r * blk.n, x.lse[i0 + r], i0 + r + 1, blk.n);
    const MatA p_t{w.p, 1, blk.n}, ds{w.dp, blk.n, 1}, ds_t{w.dp, 1, blk.n};
    small_gemm({blk.n, sh.hd, blk.m, Causal::k_from_diag, i0}, 1.0f, p_t, g.dout.row(i0), g.dout.ld, g.dv.p, g.dv.ld,
               acc);
    small_gemm({blk.m, blk.n, sh.hd, Causal::cols_to_diag, i0}, 1.0f, {g.dout.row(i0), g.dout.ld, 1}, w.vt, sh.T,
               w.dp, blk.n, false);
    for (int64_t r = 0; r < blk.m; ++r)
      dscore_row(w.p + r * blk.n, w.dp + r * blk.n, w.d[i0 + r], i0 + r + 1, blk.n);
    small_gemm({blk.m, sh.hd, blk.n, Causal::k_to_diag, i0}, sh.scale, ds, x.k.p, x.k.ld, g.dq.row(i0), g.dq.ld,
               false);
    small_gemm({blk.n, sh.hd, blk.m, Causal::k_from_diag, i0}, sh.scale, ds_t, x.q.row(i0), x.q.ld, g.dk.p, g.dk.ld,
               acc);
  }
}

// ---- bf16 heads: widened into per-thread fp32 scratch, results rounded back (model/bf16.h) ----

// dst[t * hd + c] = src[t * ld + c] widened, for T rows of hd: exact, so both clones give the same bits.
SL_KERNEL_BODY void widen_rows_body(const c10::BFloat16* src, int64_t ld, int64_t T, int64_t hd, float* dst) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < hd; ++c) dst[t * hd + c] = widen(src[t * ld + c]);
}
SL_KERNEL_CLONES(void, widen_rows, (const c10::BFloat16* src, int64_t ld, int64_t T, int64_t hd, float* dst),
                 (src, ld, T, hd, dst))

// dst[t * ld + c] = src[t * hd + c] rounded to nearest even: both clones give the same bits.
SL_KERNEL_BODY void narrow_rows_body(const float* src, int64_t T, int64_t hd, c10::BFloat16* dst, int64_t ld) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < hd; ++c) dst[t * ld + c] = narrow(src[t * hd + c]);
}
SL_KERNEL_CLONES(void, narrow_rows, (const float* src, int64_t T, int64_t hd, c10::BFloat16* dst, int64_t ld),
                 (src, T, hd, dst, ld))

// ---- bf16 heads on bf16 products (AVX512-BF16): q, k, v, o and dout read in place ----

struct Bf16Head {
  Bf16Rows q, k, v, o;
  const float* lse;
};

struct Bf16HeadGrad {
  Bf16Rows dout;
  Rows dq, dk, dv;  // fp32 rows, rounded into the gradients when the head is done
};

// backward_head on bf16 products. w.kt and w.vt take dout and o widened, for the rows' sums of
// dout * o (the same fp32 sums backward_head takes).
void backward_head_bf16(const Bf16Head& x, const Bf16HeadGrad& g, const Shape& sh, const BackwardScratch& w,
                        const DotScratch& d) {
  widen_rows(g.dout.p, g.dout.ld, sh.T, sh.hd, w.kt);
  widen_rows(x.o.p, x.o.ld, sh.T, sh.hd, w.vt);
  for (int64_t t = 0; t < sh.T; ++t) w.d[t] = dot(w.kt + t * sh.hd, w.vt + t * sh.hd, sh.hd);
  pack_row_pairs_transposed(x.k.p, x.k.ld, sh.T, sh.hd, d.kt, sh.T);
  pack_row_pairs_transposed(x.v.p, x.v.ld, sh.T, sh.hd, d.vt, sh.T);
  pack_column_pairs(x.k.p, x.k.ld, sh.T, sh.hd, d.k, sh.hd);
  const int64_t last = (sh.T - 1) / kRowBlock * kRowBlock;
  for (int64_t i0 = last; i0 >= 0; i0 -= kRowBlock) {
    const Block blk = block_at(i0, sh.T);
    const bool acc = i0 != last;
    scores_bf16(x.q, sh, blk, d, w.p);
    for (int64_t r = 0; r < blk.m; ++r) probs_row(w.p + r * blk.n, x.lse[i0 + r], i0 + r + 1, blk.n);
    transposed_times_bf16(sh, blk, 1.0f, w.p, g.dout, d, g.dv, acc);  // dv += p^T dout
    // dp = dout v^T
    pack_row_pairs(g.dout.row(i0), g.dout.ld, blk.m, sh.hd, d.a, pairs(sh.hd));
    small_gemm_bf16({blk.m, blk.n, sh.hd, Causal::cols_to_diag, i0}, 1.0f, {d.a, pairs(sh.hd), 1}, d.vt, sh.T, w.dp,
                    blk.n, false);
    for (int64_t r = 0; r < blk.m; ++r)
      dscore_row(w.p + r * blk.n, w.dp + r * blk.n, w.d[i0 + r], i0 + r + 1, blk.n);
    rows_times_bf16(sh, blk, sh.scale, w.dp, d.k, d, g.dq.row(i0), g.dq.ld);  // dq = scale ds k
    transposed_times_bf16(sh, blk, sh.scale, w.dp, x.q, d, g.dk, acc);       // dk += scale ds^T q
  }
}

// ---- whole tensors ----

// A (B, nh, T, hd) tensor, fp32 or bf16, with unit stride along hd, addressed per (batch, head).
struct Strided {
  void* base;
  bool bf16;
  int64_t s_batch, s_head, s_row;  // elements
  int64_t offset(int64_t b, int64_t h) const { return b * s_batch + h * s_head; }
  Rows at(int64_t b, int64_t h) const { return {static_cast<float*>(base) + offset(b, h), s_row}; }  // fp32
  c10::BFloat16* at_bf16(int64_t b, int64_t h) const { return static_cast<c10::BFloat16*>(base) + offset(b, h); }
  Bf16Rows rows_bf16(int64_t b, int64_t h) const { return {at_bf16(b, h), s_row}; }
};

Strided strided(const torch::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 4 && t.stride(3) == 1);
  return {t.data_ptr(), t.scalar_type() == torch::kBFloat16, t.stride(0), t.stride(1), t.stride(2)};
}

// One thread's view of one (batch, head): its fp32 rows. fp32 tensors are read and written in place;
// bf16 ones go through fp32 copies in the thread's staging area (T x hd floats each, taken in order):
// inputs widened when the head is taken, results rounded into the tensor when it is done.
class HeadStage {
 public:
  HeadStage(int64_t b, int64_t h, const Shape& sh, float* staging) : b_(b), h_(h), sh_(sh), next_(staging) {}

  // The head's rows of an input.
  Rows in(const Strided& t) {
    if (!t.bf16) return t.at(b_, h_);
    const Rows r = take();
    widen_rows(t.at_bf16(b_, h_), t.s_row, sh_.T, sh_.hd, r.p);
    return r;
  }
  // Where the head's rows of a result go; done(t, rows) then stores them.
  Rows out(const Strided& t) { return t.bf16 ? take() : t.at(b_, h_); }
  void done(const Strided& t, const Rows& r) const {
    if (t.bf16) narrow_rows(r.p, sh_.T, sh_.hd, t.at_bf16(b_, h_), t.s_row);
  }

 private:
  Rows take() {
    const Rows r{next_, sh_.hd};
    next_ += sh_.T * sh_.hd;
    return r;
  }
  int64_t b_, h_;
  Shape sh_;
  float* next_;
};

// Floats of staging a thread needs for `count` operands of one head when they are bf16 (none for fp32).
int64_t staging_floats(bool bf16, int count, const Shape& sh) { return bf16 ? count * sh.T * sh.hd : 0; }

// A (B, T, nh, hd) buffer seen as (B, nh, T, hd): the layout of the output and of the gradients.
torch::Tensor heads_view(const torch::Tensor& btc, int64_t nh) {
  return btc.view({btc.size(0), btc.size(1), nh, -1}).transpose(1, 2);
}

// Runs fn(b, h, tid) for every (batch, head) on ATen's intra-op threads; tid indexes per-thread scratch.
template <class Fn>
void for_each_head(int64_t B, int64_t nh, int threads, Fn fn) {
  for_each_index(B * nh, [&](int64_t head, int tid) {
    TORCH_INTERNAL_ASSERT(tid < threads);  // scratch rows
    fn(head / nh, head % nh, tid);
  });
}

Shape shape_of(const torch::Tensor& q) {
  const int64_t hd = q.size(3);
  return {q.size(2), hd, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
}

std::atomic<bool>& fp32_products_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}

// bf16 heads multiply on bf16 pairs where the CPU has AVX512-BF16 (and the vector clones run).
bool dot_products(const torch::Tensor& q) {
  return q.scalar_type() == torch::kBFloat16 && bf16_dot_products() && device::vector_kernels() &&
         !fp32_products_forced().load(std::memory_order_relaxed);
}

// fp32 per-thread scratch, threads x per_thread floats.
torch::Tensor thread_scratch(int threads, int64_t per_thread) {
  return torch::empty({threads, per_thread}, torch::kFloat32);
}

// (output (B, T, nh * hd) in q's dtype, lse (B, nh, T) fp32).
// dot: bf16 products (dot_products(q), decided once per node so its backward takes the same path).
std::tuple<torch::Tensor, torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                           const torch::Tensor& v, bool dot) {
  RECORD_FUNCTION("sublinear::causal_attention", std::vector<c10::IValue>{});
  const int64_t B = q.size(0), nh = q.size(1);
  const Shape sh = shape_of(q);
  auto out = torch::empty({B, sh.T, nh * sh.hd}, q.options());
  auto lse = torch::empty({B, nh, sh.T}, q.options().dtype(torch::kFloat32));
  const int threads = at::get_num_threads();
  // bf16 products: no fp32 k^T (packed instead), the output staged only
  const int64_t blocks = (kRowBlock + (dot ? 0 : sh.hd)) * sh.T;
  const int64_t staging = staging_floats(q.scalar_type() == torch::kBFloat16, dot ? 1 : 4, sh);
  const int64_t per_thread = blocks + staging + (dot ? DotScratch::words(sh, /*backward=*/false) : 0);
  auto scratch = thread_scratch(threads, per_thread);
  const Strided Q = strided(q), K = strided(k), V = strided(v), O = strided(heads_view(out, nh));
  float* L = lse.data_ptr<float>();
  float* S = scratch.data_ptr<float>();
  for_each_head(B, nh, threads, [&](int64_t b, int64_t h, int tid) {
    float* w = S + tid * per_thread;
    HeadStage st(b, h, sh, w + blocks);
    float* lse_h = L + (b * nh + h) * sh.T;
    if (dot) {
      const Rows o = st.out(O);
      forward_head_bf16(Q.rows_bf16(b, h), K.rows_bf16(b, h), V.rows_bf16(b, h), o, lse_h, sh, w,
                        DotScratch::at(w + blocks + staging, sh, /*backward=*/false));
      st.done(O, o);
      return;
    }
    const Head x{st.in(Q), st.in(K), st.in(V), st.out(O), lse_h};
    forward_head(x, sh, w, w + kRowBlock * sh.T);
    st.done(O, x.o);
  });
  return {out, lse};
}

// Writes dq, dk, dv: (B, nh, T, hd) views in q's dtype, unit stride along hd (of one (B, T, 3C) buffer
// or of three).
void attention_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& grad,
                        const torch::Tensor& dq, const torch::Tensor& dk, const torch::Tensor& dv, bool dot) {
  RECORD_FUNCTION("sublinear::causal_attention_backward", std::vector<c10::IValue>{});
  const int64_t B = q.size(0), nh = q.size(1);
  const Shape sh = shape_of(q);
  auto dout = heads_view(grad.to(out.scalar_type()).contiguous(), nh);
  const int threads = at::get_num_threads();
  const int64_t block = kRowBlock * sh.T, head = sh.hd * sh.T, blocks = 2 * block + 2 * head + sh.T;
  // bf16 products: the three gradients staged only
  const int64_t staging = staging_floats(q.scalar_type() == torch::kBFloat16, dot ? 3 : 8, sh);
  const int64_t per_thread = blocks + staging + (dot ? DotScratch::words(sh, /*backward=*/true) : 0);
  auto scratch = thread_scratch(threads, per_thread);
  const Strided Q = strided(q), K = strided(k), V = strided(v), O = strided(heads_view(out, nh));
  const Strided dO = strided(dout), dQ = strided(dq), dK = strided(dk), dV = strided(dv);
  float* L = lse.data_ptr<float>();
  float* S = scratch.data_ptr<float>();
  for_each_head(B, nh, threads, [&](int64_t b, int64_t h, int tid) {
    float* w = S + tid * per_thread;
    HeadStage st(b, h, sh, w + blocks);
    const float* lse_h = L + (b * nh + h) * sh.T;
    const BackwardScratch ws{w, w + block, w + 2 * block, w + 2 * block + head, w + 2 * block + 2 * head};
    if (dot) {
      const Bf16Head x{Q.rows_bf16(b, h), K.rows_bf16(b, h), V.rows_bf16(b, h), O.rows_bf16(b, h), lse_h};
      const Bf16HeadGrad g{dO.rows_bf16(b, h), st.out(dQ), st.out(dK), st.out(dV)};
      backward_head_bf16(x, g, sh, ws, DotScratch::at(w + blocks + staging, sh, /*backward=*/true));
      st.done(dQ, g.dq), st.done(dK, g.dk), st.done(dV, g.dv);
      return;
    }
    const Head x{st.in(Q), st.in(K), st.in(V), st.in(O), L + (b * nh + h) * sh.T};
    const HeadGrad g{st.in(dO), st.out(dQ), st.out(dK), st.out(dV)};
    backward_head(x, g, sh, ws);
    st.done(dQ, g.dq), st.done(dK, g.dk), st.done(dV, g.dv);
  });
}

// The three (B, nh, T, hd) heads of a (B, T, 3C) [q | k | v] tensor, read in place.
std::array<torch::Tensor, 3> packed_heads(const torch::Tensor& qkv, int64_t nh) {
  const int64_t C = qkv.size(2) / 3;
  return {heads_view(qkv.narrow(2, 0, C), nh), heads_view(qkv.narrow(2, C, C), nh),
          heads_view(qkv.narrow(2, 2 * C, C), nh)};
}

void no_double_backward() {
  TORCH_CHECK(!torch::GradMode::is_enabled(), "causal_attention: double backward is not supported");
}

struct CausalAttentionFunction : torch::autograd::Function<CausalAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v) {
    const bool dot = dot_products(q);
    auto [out, lse] = attention_forward(q, k, v, dot);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["dot"] = dot;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    no_double_backward();
    const auto s = ctx->get_saved_variables();
    const int64_t nh = s[0].size(1);
    auto grad_buffer = [&] { return heads_view(torch::empty_like(s[3]), nh); };  // (B, T, C) like the output
    auto dq = grad_buffer(), dk = grad_buffer(), dv = grad_buffer();
    attention_backward(s[0], s[1], s[2], s[3], s[4], grads[0], dq, dk, dv, ctx->saved_data["dot"].toBool());
    return {dq, dk, dv};
  }
};

// The same on the QKV projection's output: one input, one gradient (B, T, 3C) written in place of the
// split's backward concatenation.
struct PackedAttentionFunction : torch::autograd::Function<PackedAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& qkv, int64_t nh) {
    auto [q, k, v] = packed_heads(qkv, nh);
    const bool dot = dot_products(q);
    auto [out, lse] = attention_forward(q, k, v, dot);
    ctx->save_for_backward({qkv, out, lse});
    ctx->saved_data["nh"] = nh;
    ctx->saved_data["dot"] = dot;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    no_double_backward();
    const auto s = ctx->get_saved_variables();
    const int64_t nh = ctx->saved_data["nh"].toInt();
    auto [q, k, v] = packed_heads(s[0], nh);
    auto dqkv = torch::empty_like(s[0], at::MemoryFormat::Contiguous);
    auto [dq, dk, dv] = packed_heads(dqkv, nh);
    attention_backward(q, k, v, s[1], s[2], grads[0], dq, dk, dv, ctx->saved_data["dot"].toBool());
    return {dqkv, torch::Tensor()};
  }
};

bool fused_operand(const torch::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.device().is_cpu() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
         t.layout() == torch::kStrided && t.dim() == 4 && t.stride(3) == 1 && t.stride(2) >= t.size(3);
}

// The kernel takes q, k, v (whatever SUBLINEAR_ATEN_KERNELS says): one dtype, one shape.
bool kernel_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return fused_operand(q) && fused_operand(k) && fused_operand(v) && q.scalar_type() == k.scalar_type() &&
         q.scalar_type() == v.scalar_type() && q.sizes() == k.sizes() && q.sizes() == v.sizes();
}

bool packed_kernel_takes(const torch::Tensor& qkv, int64_t n_head) {
  if (qkv.dim() != 3 || qkv.numel() == 0 || n_head <= 0 || qkv.size(2) % (3 * n_head) != 0) return false;
  auto [q, k, v] = packed_heads(qkv, n_head);
  return kernel_takes(q, k, v);
}

// Whether the model should take the kernel for tensors of `dtype` on this CPU. bf16 only where the
// AVX2 + FMA clone runs: the baseline clone's bf16 attention is slower than SDPA's bf16 kernels (311 vs
// 197 ms forward + backward at B 8, nh 4, T 256, hd 64, 2 threads, AVX2 EPYC with the baseline forced),
// and a CPU without bf16 instructions must not get slower than it was with SDPA (docs/precision.md).
bool worth_it(torch::ScalarType dtype) {
  return device::fused_kernels() && (dtype != torch::kBFloat16 || device::vector_kernels());
}

}  // namespace

bool force_fp32_attention_products(bool on) { return fp32_products_forced().exchange(on, std::memory_order_relaxed); }

bool bf16_attention_products() { return bf16_dot_products() && device::vector_kernels() && !fp32_products_forced(); }

bool causal_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return worth_it(q.scalar_type()) && kernel_takes(q, k, v);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(kernel_takes(q, k, v), "causal_attention: q, k, v must be fp32 or bf16 CPU (B, nh, T, hd) tensors "
              "of one dtype, unit stride along hd");
  const bool grad = torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!grad) return std::get<0>(attention_forward(q, k, v, dot_products(q)));
  return CausalAttentionFunction::apply(q, k, v);
}

bool causal_attention_packed_fused(const torch::Tensor& qkv, int64_t n_head) {
  return worth_it(qkv.scalar_type()) && packed_kernel_takes(qkv, n_head);
}

torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t n_head) {
  TORCH_CHECK(packed_kernel_takes(qkv, n_head), "causal_attention_packed: qkv must be an fp32 or bf16 CPU "
              "(B, T, 3 * n_head * hd) tensor, unit stride last");
  if (!torch::GradMode::is_enabled() || !qkv.requires_grad()) {
    auto [q, k, v] = packed_heads(qkv, n_head);
    return std::get<0>(attention_forward(q, k, v, dot_products(q)));
  }
  return PackedAttentionFunction::apply(qkv, n_head);
}

}  // namespace sl::model
