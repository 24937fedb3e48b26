#include "kernels/cpu/small_gemm.h"
#include "kernels/cpu/clones.h"

#include <algorithm>
#include <cstring>

namespace sl::kernels::cpu {
namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats: one AVX register, two SSE ones

constexpr int kRows = 6;  // rows of a C tile: 6 x 2 vector accumulators, 12 of the 16 AVX registers
constexpr int kCols = 16;

__attribute__((always_inline)) inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// The tiles' arithmetic, in every form: each k's product added to the sum with one multiply-add in the
// vector forms (GCC fuses `acc += x * b` in the AVX2 clone: the product has no other use), a multiply
// then an add in the baseline; then alpha times the sum, rounded, then the add to C, rounded. The
// barrier keeps alpha's product rounded on its own: GCC would fuse it into the add to C where it sees
// the two alone (it does in some tiles, not in others, by how it splits the accumulate branch).
__attribute__((always_inline)) inline v8 rounded(v8 v) {
  asm("" : "+m"(v));
  return v;
}

// C[R x 8 NV] (=|+=) alpha sum_{k in [k0, k1)} A(r, k) B[k, :]. Inlined into each clone below.
template <int R, int NV>
__attribute__((always_inline)) inline void tile(const MatA& a, const float* b, int64_t ldb, int64_t k0, int64_t k1,
                                                float* c, int64_t ldc, float alpha, bool accumulate) {
  v8 acc[R][NV] = {};
  for (int64_t k = k0; k < k1; ++k) {
    v8 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load8(b + k * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float x = a.p[r * a.rs + k * a.ks];
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      float* out = c + r * ldc + 8 * v;
      const v8 x = rounded(alpha * acc[r][v]);
      store8(out, accumulate ? load8(out) + x : x);
    }
}

// The same for a column range narrower than 8 (W columns): B's and C's columns through a zero-padded
// vector, so each element takes tile's arithmetic (a scalar loop's would be GCC's choice: it multiplies
// some k in vectors and adds them one by one, without the multiply-add the vector forms use).
template <int R>
__attribute__((always_inline)) inline void tile_narrow(int W, const MatA& a, const float* b, int64_t ldb, int64_t k0,
                                                       int64_t k1, float* c, int64_t ldc, float alpha,
                                                       bool accumulate) {
  const size_t bytes = static_cast<size_t>(W) * sizeof(float);
  v8 acc[R] = {};
  for (int64_t k = k0; k < k1; ++k) {
    v8 bv = {};
    std::memcpy(&bv, b + k * ldb, bytes);
    for (int r = 0; r < R; ++r) acc[r] += a.p[r * a.rs + k * a.ks] * bv;
  }
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    v8 x = rounded(alpha * acc[r]);
    if (accumulate) {
      v8 old = {};
      std::memcpy(&old, out, bytes);
      x = old + x;
    }
    std::memcpy(out, &x, bytes);
  }
}

template <int R>
__attribute__((always_inline)) inline void row_tile(const MatA& a, const float* b, int64_t ldb, int64_t k0,
                                                    int64_t k1, float* c, int64_t ldc, int64_t n_end, float alpha,
                                                    bool accumulate) {
  int64_t col = 0;
  for (; col + kCols <= n_end; col += kCols) tile<R, 2>(a, b + col, ldb, k0, k1, c + col, ldc, alpha, accumulate);
  if (col + 8 <= n_end) {
    tile<R, 1>(a, b + col, ldb, k0, k1, c + col, ldc, alpha, accumulate);
    col += 8;
  }
  if (col < n_end)
    tile_narrow<R>(static_cast<int>(n_end - col), a, b + col, ldb, k0, k1, c + col, ldc, alpha, accumulate);
}

// What a row tile [r0, last] of C needs under s.causal (the contract in small_gemm.h): columns up to
// n_end (up to the diagonal, rounded up to whole vectors of `vec` columns: a few extra columns cost
// less than a narrow edge) and k in [k0, k1). Shared by every form (the fp32 ones with vec 8).
struct TileBounds {
  int64_t n_end, k0, k1;
};
__attribute__((always_inline)) inline TileBounds tile_bounds(const GemmShape& s, int64_t r0, int64_t last,
                                                             int64_t vec) {
  TileBounds t{s.N, 0, s.K};
  if (s.causal == Causal::cols_to_diag) t.n_end = std::clamp<int64_t>((last + s.diag + vec) / vec * vec, 0, s.N);
  if (s.causal == Causal::k_to_diag) t.k1 = std::clamp<int64_t>(last + s.diag + 1, 0, s.K);
  if (s.causal == Causal::k_from_diag) t.k0 = std::clamp<int64_t>(r0 - s.diag, 0, s.K);
  return t;
}

SL_KERNEL_BODY void small_gemm_8_body(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c,
                                    int64_t ldc, bool accumulate) {
  for (int64_t r0 = 0; r0 < s.M; r0 += kRows) {
    const int R = static_cast<int>(std::min<int64_t>(kRows, s.M - r0));
    const auto [n_end, k0, k1] = tile_bounds(s, r0, r0 + R - 1, 8);
    const MatA at{a.p + r0 * a.rs, a.rs, a.ks};
    float* ct = c + r0 * ldc;
    switch (R) {
      case 6: row_tile<6>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 5: row_tile<5>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 4: row_tile<4>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 3: row_tile<3>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 2: row_tile<2>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      default: row_tile<1>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
    }
  }
}

// The 8-lane forms (small_gemm_8_avx2, small_gemm_8_baseline) and the pick between them.
SL_KERNEL_CLONES(void, small_gemm_8,
                 (const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c, int64_t ldc,
                  bool accumulate),
                 (s, alpha, a, b, ldb, c, ldc, accumulate))

}  // namespace
}  // namespace sl::kernels::cpu

// ---- bf16 products (AVX512-BF16) ----
#if defined(__x86_64__)
#include <immintrin.h>

#include "device/cpu_features.h"
#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {
namespace {

#define SL_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

constexpr int kRowsBf16 = 8;  // rows of a C tile: 8 x 2 accumulators of 16 floats, half the 32 registers

inline uint32_t pair(float lo, float hi) {
  return static_cast<uint32_t>(narrow(lo).x) | static_cast<uint32_t>(narrow(hi).x) << 16;
}
inline uint32_t pair(Bf16 lo, Bf16 hi) {
  return static_cast<uint32_t>(lo.x) | static_cast<uint32_t>(hi.x) << 16;
}

template <class T>
SL_BF16_DOT inline void row_pairs(const T* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld) {
  const int64_t whole = cols / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    uint32_t* d = dst + r * ld;
    for (int64_t cp = 0; cp < whole; ++cp) d[cp] = pair(xr[2 * cp], xr[2 * cp + 1]);
    if (cols % 2) d[whole] = pair(xr[cols - 1], T(0.0f));
  }
}

template <class T>
SL_BF16_DOT inline void column_pairs(const T* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld) {
  for (int64_t rp = 0; rp < (rows + 1) / 2; ++rp) {
    const T* lo = x + 2 * rp * ldx;
    uint32_t* d = dst + rp * ld;
    if (2 * rp + 1 < rows)
      for (int64_t c = 0; c < cols; ++c) d[c] = pair(lo[c], lo[c + ldx]);
    else
      for (int64_t c = 0; c < cols; ++c) d[c] = pair(lo[c], T(0.0f));
  }
}

#define SL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// The 16-lane tiles' end (bf16 and fp32 products): C[R x up to 16 NV] (=|+=) alpha acc, alpha's product
// rounded on its own before the add to C (the barrier keeps GCC from fusing the two, as rounded() does
// for the 8-lane forms); the last vector's columns are `mask`'s.
template <int R, int NV>
SL_AVX512 inline void store_tile(const __m512 (&acc)[R][NV], float* c, int64_t ldc, float alpha, bool accumulate,
                                 __mmask16 mask) {
  const __m512 scale = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? mask : __mmask16(0xFFFF);
      float* out = c + r * ldc + 16 * v;
      __m512 x = _mm512_mul_ps(scale, acc[r][v]);
      asm("" : "+v"(x));
      if (accumulate) x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), x);
      _mm512_mask_storeu_ps(out, m, x);
    }
}

// C[R x up to 16 NV] (=|+=) alpha sum_{kp in [kp0, kp1)} A(r, kp) . B(kp, :); the last vector's columns
// are `mask`'s.
template <int R, int NV>
SL_BF16_DOT inline void tile_bf16(const WordsA& a, const uint32_t* b, int64_t ldb, int64_t kp0, int64_t kp1, float* c,
                                  int64_t ldc, float alpha, bool accumulate, __mmask16 mask) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    __m512i bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      bv[v] = _mm512_maskz_loadu_epi32(v == NV - 1 ? mask : __mmask16(0xFFFF), b + kp * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a.p[r * a.rs + kp * a.ks]));
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
    }
  }
  store_tile<R, NV>(acc, c, ldc, alpha, accumulate, mask);
}

template <int R>
SL_BF16_DOT inline void row_tile_bf16(const WordsA& a, const uint32_t* b, int64_t ldb, int64_t kp0, int64_t kp1,
                                      float* c, int64_t ldc, int64_t n_end, float alpha, bool accumulate) {
  for (int64_t col = 0; col < n_end; col += 32) {
    const int64_t width = std::min<int64_t>(32, n_end - col);
    const int last = static_cast<int>(width > 16 ? width - 16 : width);
    const auto mask = static_cast<__mmask16>((1u << last) - 1u);
    if (width > 16) tile_bf16<R, 2>(a, b + col, ldb, kp0, kp1, c + col, ldc, alpha, accumulate, mask);
    else tile_bf16<R, 1>(a, b + col, ldb, kp0, kp1, c + col, ldc, alpha, accumulate, mask);
  }
}

// ---- fp32 products on 16 lanes (AVX-512 F), where device::avx512_kernels() says so ----
// The AVX2 clone's arithmetic element for element: the same 6-row tiles (so the same causal bounds), one
// multiply-add per k in k's order from 0, then alpha times the sum, then the add to C, each rounded on its
// own; only the lanes per instruction differ (16 columns, up to 64 per tile), so the bits are the AVX2
// clone's (test: "small_gemm: the 16-lane form gives the AVX2 clone's bits").

// C[R x up to 16 NV] (=|+=) alpha sum_{k in [k0, k1)} A(r, k) B[k, :]; the last vector's columns are
// `mask`'s (the others whole).
template <int R, int NV>
SL_AVX512 inline void tile16(const MatA& a, const float* b, int64_t ldb, int64_t k0, int64_t k1, float* c, int64_t ldc,
                             float alpha, bool accumulate, __mmask16 mask) {
  __m512 acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? mask : __mmask16(0xFFFF), b + k * ldb + 16 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a.p[r * a.rs + k * a.ks]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
    }
  }
  store_tile<R, NV>(acc, c, ldc, alpha, accumulate, mask);
}

// Columns [0, n_end) of an R-row tile, 64 at a time.
template <int R>
SL_AVX512 inline void row_tile16(const MatA& a, const float* b, int64_t ldb, int64_t k0, int64_t k1, float* c,
                                 int64_t ldc, int64_t n_end, float alpha, bool accumulate) {
  for (int64_t col = 0; col < n_end; col += 64) {
    const int width = static_cast<int>(std::min<int64_t>(64, n_end - col));
    const int nv = (width + 15) / 16;
    const auto mask = static_cast<__mmask16>((1u << (width - 16 * (nv - 1))) - 1u);
    const float* bc = b + col;
    float* cc = c + col;
    switch (nv) {
      case 4: tile16<R, 4>(a, bc, ldb, k0, k1, cc, ldc, alpha, accumulate, mask); break;
      case 3: tile16<R, 3>(a, bc, ldb, k0, k1, cc, ldc, alpha, accumulate, mask); break;
      case 2: tile16<R, 2>(a, bc, ldb, k0, k1, cc, ldc, alpha, accumulate, mask); break;
      default: tile16<R, 1>(a, bc, ldb, k0, k1, cc, ldc, alpha, accumulate, mask); break;
    }
  }
}

SL_AVX512 void small_gemm_16(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c,
                             int64_t ldc, bool accumulate) {
  for (int64_t r0 = 0; r0 < s.M; r0 += kRows) {
    const int R = static_cast<int>(std::min<int64_t>(kRows, s.M - r0));
    const auto [n_end, k0, k1] = tile_bounds(s, r0, r0 + R - 1, 8);  // the AVX2 clone's bounds
    const MatA at{a.p + r0 * a.rs, a.rs, a.ks};
    float* ct = c + r0 * ldc;
    switch (R) {
      case 6: row_tile16<6>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 5: row_tile16<5>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 4: row_tile16<4>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 3: row_tile16<3>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      case 2: row_tile16<2>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
      default: row_tile16<1>(at, b, ldb, k0, k1, ct, ldc, n_end, alpha, accumulate); break;
    }
  }
}

}  // namespace

void small_gemm(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c, int64_t ldc,
                bool accumulate) {
  if (device::avx512_kernels()) return small_gemm_16(s, alpha, a, b, ldb, c, ldc, accumulate);
  small_gemm_8(s, alpha, a, b, ldb, c, ldc, accumulate);
}

bool bf16_dot_products() { return device::cpu_features().bf16_dot; }

SL_BF16_DOT void pack_row_pairs(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld) {
  row_pairs(x, ldx, rows, cols, dst, ld);
}
SL_BF16_DOT void pack_column_pairs(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld) {
  column_pairs(x, ldx, rows, cols, dst, ld);
}

// From bf16 rows the pairs are the rows' own 32-bit words (element 2 cp low, 2 cp + 1 high, as x86
// stores them), so the three packings below move words: copies, one 16-bit interleave, a transpose.
SL_BF16_DOT void pack_row_pairs(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst,
                                int64_t ld) {
  if (cols % 2) return row_pairs(x, ldx, rows, cols, dst, ld);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ld, x + r * ldx, cols * sizeof(Bf16));
}

// 16 bf16 of row lo and 16 of row hi (lanes below `mask`) as 16 pairs.
SL_BF16_DOT static inline __m512i interleave16(const Bf16* lo, const Bf16* hi, __mmask16 mask) {
  const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo));
  const __m512i h = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, hi)) : _mm512_setzero_si512();
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

SL_BF16_DOT void pack_column_pairs(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols, uint32_t* dst,
                                   int64_t ld) {
  for (int64_t rp = 0; rp < (rows + 1) / 2; ++rp) {
    const Bf16* lo = x + 2 * rp * ldx;
    const Bf16* hi = 2 * rp + 1 < rows ? lo + ldx : nullptr;  // none: pairs with 0
    uint32_t* d = dst + rp * ld;
    for (int64_t c = 0; c < cols; c += 16) {
      const auto mask = static_cast<__mmask16>(cols - c >= 16 ? 0xFFFFu : (1u << (cols - c)) - 1u);
      _mm512_mask_storeu_epi32(d + c, mask, interleave16(lo + c, hi ? hi + c : nullptr, mask));
    }
  }
}

// v[i] holds row i's 16 words; afterwards v[j] holds column j's 16 (row i in lane i).
SL_BF16_DOT static inline void transpose16x16(__m512i (&v)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: (row 2i, row 2i + 1) of columns 4L, 4L + 1 | 4L + 2, 4L + 3
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + k], lane L: rows 4g..4g+3 of column 4L + k
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
    v[k] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
    v[4 + k] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
    v[8 + k] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + k] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

static inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }

// The rows' whole pairs as a word matrix, transposed 16 x 16 at a time; an odd last column pairs with 0.
SL_BF16_DOT void pack_row_pairs_transposed(const Bf16* x, int64_t ldx, int64_t rows, int64_t cols,
                                           uint32_t* dst, int64_t ld) {
  const int64_t whole = cols / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    for (int64_t c0 = 0; c0 < whole; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, whole - c0);
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = i < nr ? _mm512_maskz_loadu_epi32(first_lanes(nc), x + (r0 + i) * ldx + 2 * c0) : _mm512_setzero_si512();
      transpose16x16(v);
      for (int j = 0; j < nc; ++j) _mm512_mask_storeu_epi32(dst + (c0 + j) * ld + r0, first_lanes(nr), v[j]);
    }
    if (cols % 2)
      for (int64_t r = r0; r < r0 + nr; ++r) dst[whole * ld + r] = pair(x[r * ldx + cols - 1], Bf16{0});
  }
}

SL_BF16_DOT void small_gemm_bf16(const GemmShape& s, float alpha, WordsA a, const uint32_t* b, int64_t ldb, float* c,
                                 int64_t ldc, bool accumulate) {
  for (int64_t r0 = 0; r0 < s.M; r0 += kRowsBf16) {
    const int R = static_cast<int>(std::min<int64_t>(kRowsBf16, s.M - r0));
    const auto [n_end, k0, k1] = tile_bounds(s, r0, r0 + R - 1, 16);
    // Whole pairs: the extra element of a pair is one the mask zeroes in A (or a 0 pad).
    const int64_t kp0 = k0 / 2, kp1 = (k1 + 1) / 2;
    const WordsA at{a.p + r0 * a.rs, a.rs, a.ks};
    float* ct = c + r0 * ldc;
    switch (R) {
      case 8: row_tile_bf16<8>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 7: row_tile_bf16<7>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 6: row_tile_bf16<6>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 5: row_tile_bf16<5>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 4: row_tile_bf16<4>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 3: row_tile_bf16<3>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      case 2: row_tile_bf16<2>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
      default: row_tile_bf16<1>(at, b, ldb, kp0, kp1, ct, ldc, n_end, alpha, accumulate); break;
    }
  }
}

}  // namespace sl::kernels::cpu

#else  // not x86-64: no AVX512-BF16
#include <cstdlib>

namespace sl::kernels::cpu {
void small_gemm(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c, int64_t ldc,
                bool accumulate) {
  small_gemm_8(s, alpha, a, b, ldb, c, ldc, accumulate);
}
bool bf16_dot_products() { return false; }
void pack_row_pairs(const float*, int64_t, int64_t, int64_t, uint32_t*, int64_t) { std::abort(); }
void pack_column_pairs(const float*, int64_t, int64_t, int64_t, uint32_t*, int64_t) { std::abort(); }
void pack_row_pairs(const Bf16*, int64_t, int64_t, int64_t, uint32_t*, int64_t) {
  std::abort();  // callers check bf16_dot_products() first
}
void pack_column_pairs(const Bf16*, int64_t, int64_t, int64_t, uint32_t*, int64_t) {
  std::abort();  // callers check bf16_dot_products() first
}
void pack_row_pairs_transposed(const Bf16*, int64_t, int64_t, int64_t, uint32_t*, int64_t) {
  std::abort();  // callers check bf16_dot_products() first
}
void small_gemm_bf16(const GemmShape&, float, WordsA, const uint32_t*, int64_t, float*, int64_t, bool) {
  std::abort();  // callers check bf16_dot_products() first
}
}  // namespace sl::kernels::cpu
#endif
