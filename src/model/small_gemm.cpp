#include "model/small_gemm.h"
#include "model/clones.h"

#include <algorithm>
#include <cstring>

namespace sl::model {
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
      const v8 x = alpha * acc[r][v];
      store8(out, accumulate ? load8(out) + x : x);
    }
}

// The same for a column range narrower than 8.
__attribute__((always_inline)) inline void tile_scalar(int R, int W, const MatA& a, const float* b, int64_t ldb,
                                                       int64_t k0, int64_t k1, float* c, int64_t ldc, float alpha,
                                                       bool accumulate) {
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k1; ++k) acc += a.p[r * a.rs + k * a.ks] * b[k * ldb + w];
      float& out = c[r * ldc + w];
      out = accumulate ? out + alpha * acc : alpha * acc;
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
  if (col < n_end) tile_scalar(R, static_cast<int>(n_end - col), a, b + col, ldb, k0, k1, c + col, ldc, alpha, accumulate);
}

SL_KERNEL_BODY void small_gemm_body(const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c,
                                    int64_t ldc, bool accumulate) {
  for (int64_t r0 = 0; r0 < s.M; r0 += kRows) {
    const int R = static_cast<int>(std::min<int64_t>(kRows, s.M - r0));
    const int64_t last = r0 + R - 1;  // the tile's last row
    int64_t n_end = s.N, k0 = 0, k1 = s.K;
    // Up to the diagonal, rounded up to whole vectors: a few extra columns cost less than a scalar edge.
    if (s.causal == Causal::cols_to_diag) n_end = std::clamp<int64_t>((last + s.diag + 8) / 8 * 8, 0, s.N);
    if (s.causal == Causal::k_to_diag) k1 = std::clamp<int64_t>(last + s.diag + 1, 0, s.K);
    if (s.causal == Causal::k_from_diag) k0 = std::clamp<int64_t>(r0 - s.diag, 0, s.K);
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

}  // namespace

SL_KERNEL_CLONES(void, small_gemm,
                 (const GemmShape& s, float alpha, MatA a, const float* b, int64_t ldb, float* c, int64_t ldc,
                  bool accumulate),
                 (s, alpha, a, b, ldb, c, ldc, accumulate))

}  // namespace sl::model
