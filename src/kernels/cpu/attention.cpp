// The fused causal attention's loops (kernels/cpu/attention.h). Built with -fno-trapping-math, so the
// row loops vectorize (CMakeLists.txt).
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "device/cpu_features.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/small_gemm.h"

namespace sl::kernels::cpu {
namespace {

constexpr int kLanes = 8;          // independent accumulators per reduction, so the loops vectorize

// ---- per-row kernels: one clone per instruction set (AVX2 + FMA, baseline), picked per call ----

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


// Query rows [i0, i0 + m) see keys [0, i0 + m): the block's m x n score matrix, n = i0 + m.
struct Block {
  int64_t i0, m, n;
};

Block block_at(int64_t i0, int64_t T) {
  const int64_t m = std::min(kRowBlock, T - i0);
  return {i0, m, i0 + m};
}

// s = scale q_blk k^T for the block's keys up to each row's diagonal (m x n, row stride n); kt: k^T.
void scores(const Head& x, const HeadShape& sh, const Block& blk, const float* kt, float* s) {
  small_gemm({blk.m, blk.n, sh.hd, Causal::cols_to_diag, blk.i0}, sh.scale, {x.q.row(blk.i0), x.q.ld, 1}, kt, sh.T,
             s, blk.n, /*accumulate=*/false);
}


// s = scale q_blk k^T as scores() does, on bf16 pairs (d.kt packed).
void scores_bf16(const Bf16Rows& q, const HeadShape& sh, const Block& blk, const DotScratch& d, float* s) {
  pack_row_pairs(q.row(blk.i0), q.ld, blk.m, sh.hd, d.a, pairs(sh.hd));
  small_gemm_bf16({blk.m, blk.n, sh.hd, Causal::cols_to_diag, blk.i0}, sh.scale, {d.a, pairs(sh.hd), 1}, d.kt, sh.T, s,
                  blk.n, /*accumulate=*/false);
}

// c (m x hd, ldc) = alpha lhs rhs: `lhs` (m x n fp32, row stride n, zero past each row's diagonal)
// times the packed [pairs(n)][hd] `rhs`, rows summing up to their diagonal.
void rows_times_bf16(const HeadShape& sh, const Block& blk, float alpha, const float* lhs, const uint32_t* rhs,
                     const DotScratch& d, float* c, int64_t ldc) {
  pack_row_pairs(lhs, blk.n, blk.m, blk.n, d.a, pairs(blk.n));
  small_gemm_bf16({blk.m, sh.hd, blk.n, Causal::k_to_diag, blk.i0}, alpha, {d.a, pairs(blk.n), 1}, rhs, sh.hd, c, ldc,
                  false);
}

// c (n x hd) (=|+=) alpha lhs^T rows: `lhs` (m x n as above), `rows` the block's m rows of a bf16
// (T, hd) operand; keys sum from their diagonal on.
void transposed_times_bf16(const HeadShape& sh, const Block& blk, float alpha, const float* lhs, const Bf16Rows& rows,
                           const DotScratch& d, const Rows& c, bool accumulate) {
  pack_column_pairs(lhs, blk.n, blk.m, blk.n, d.a, blk.n);
  pack_column_pairs(rows.row(blk.i0), rows.ld, blk.m, sh.hd, d.b, sh.hd);
  small_gemm_bf16({blk.n, sh.hd, blk.m, Causal::k_from_diag, blk.i0}, alpha, {d.a, 1, blk.n}, d.b, sh.hd, c.p, c.ld,
                  accumulate);
}

}  // namespace

// forward_head on bf16 q, k, v with bf16 products: o (fp32 rows) and lse.
void forward_head_bf16(const Bf16Rows& q, const Bf16Rows& k, const Bf16Rows& v, const Rows& o, float* lse,
                       const HeadShape& sh, float* s, const DotScratch& d) {
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
void forward_head(const Head& x, const HeadShape& sh, float* s, float* kt) {
  transpose_rows(x.k.p, x.k.ld, sh.T, sh.hd, kt);
  for (int64_t i0 = 0; i0 < sh.T; i0 += kRowBlock) {
    const Block blk = block_at(i0, sh.T);
    scores(x, sh, blk, kt, s);
    for (int64_t r = 0; r < blk.m; ++r) x.lse[i0 + r] = softmax_row(s + r * blk.n, i0 + r + 1, blk.n);
    small_gemm({blk.m, sh.hd, blk.n, Causal::k_to_diag, i0}, 1.0f, {s, blk.n, 1}, x.v.p, x.v.ld, x.o.row(i0), x.o.ld,
               false);
  }
}

// The flash backward, block by block from the last (which sees every key, so it initializes dk and dv):
// p from the saved lse; dv += p^T dout; dp = dout v^T; ds = p (dp - rowsum(dout * o));
// dq = scale ds k; dk += scale ds^T q.
void backward_head(const Head& x, const HeadGrad& g, const HeadShape& sh, const BackwardScratch& w) {
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

// ---- bf16 heads: widened into per-thread fp32 scratch, results rounded back (kernels/cpu/bf16.h) ----

// dst[t * hd + c] = src[t * ld + c] widened, for T rows of hd: exact, so both clones give the same bits.
SL_KERNEL_BODY void widen_rows_body(const Bf16* src, int64_t ld, int64_t T, int64_t hd, float* dst) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < hd; ++c) dst[t * hd + c] = widen(src[t * ld + c]);
}
SL_KERNEL_CLONES(void, widen_rows, (const Bf16* src, int64_t ld, int64_t T, int64_t hd, float* dst),
                 (src, ld, T, hd, dst))

// dst[t * ld + c] = src[t * hd + c] rounded to nearest even: both clones give the same bits.
SL_KERNEL_BODY void narrow_rows_body(const float* src, int64_t T, int64_t hd, Bf16* dst, int64_t ld) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < hd; ++c) dst[t * ld + c] = narrow(src[t * hd + c]);
}
SL_KERNEL_CLONES(void, narrow_rows, (const float* src, int64_t T, int64_t hd, Bf16* dst, int64_t ld),
                 (src, T, hd, dst, ld))


// backward_head on bf16 products. w.kt and w.vt take dout and o widened, for the rows' sums of
// dout * o (the same fp32 sums backward_head takes).
void backward_head_bf16(const Bf16Head& x, const Bf16HeadGrad& g, const HeadShape& sh, const BackwardScratch& w,
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

}  // namespace sl::kernels::cpu
