// The fused LayerNorm's rows (kernels/cpu/layernorm.h): one clone per instruction set (AVX2 + FMA,
// baseline; kernels/cpu/clones.h). Built with -fno-trapping-math, so the row sums vectorize (CMakeLists.txt).
#include "kernels/cpu/layernorm.h"

#include <cmath>
#include <cstdint>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/clones.h"

namespace sl::kernels::cpu {
namespace {

constexpr int kLanes = 8;  // independent accumulators per row sum, so the loops vectorize

// The row's sum of f(j), in kLanes lanes, then the lanes in order, then the tail.
template <class F>
SL_KERNEL_BODY float lane_sum(int64_t n, F f) {
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += f(j + l);
  float s = 0.0f;
  for (float v : lane) s += v;
  for (; j < n; ++j) s += f(j);
  return s;
}

}  // namespace

// y = bf16((x - mean) rstd w + b) for one row; returns {mean, rstd} through the pointers. b may be null.
SL_KERNEL_BODY void layer_norm_forward_row_body(const float* x, const float* w, const float* b, float eps, int64_t n,
                                                Bf16* y, float* mean_out, float* rstd_out) {
  const float inv_n = 1.0f / static_cast<float>(n);
  const float mean = lane_sum(n, [&](int64_t j) { return x[j]; }) * inv_n;
  const float var = lane_sum(n, [&](int64_t j) { return (x[j] - mean) * (x[j] - mean); }) * inv_n;
  const float rstd = 1.0f / std::sqrt(var + eps);
  if (b) {
    for (int64_t j = 0; j < n; ++j) y[j] = narrow((x[j] - mean) * rstd * w[j] + b[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] = narrow((x[j] - mean) * rstd * w[j]);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}
SL_KERNEL_CLONES(void, layer_norm_forward_row,
                 (const float* x, const float* w, const float* b, float eps, int64_t n, Bf16* y,
                  float* mean_out, float* rstd_out),
                 (x, w, b, eps, n, y, mean_out, rstd_out))

// dx for one row from its bf16 output gradient dy; adds dy xhat to dw and dy to db (a piece's partial
// sums; db may be null).
SL_KERNEL_BODY void layer_norm_backward_row_body(const Bf16* dy, const float* x, const float* w, float mean,
                                                 float rstd, int64_t n, float* dx, float* dw, float* db) {
  const float inv_n = 1.0f / static_cast<float>(n);
  const float g_mean = lane_sum(n, [&](int64_t j) { return widen(dy[j]) * w[j]; }) * inv_n;
  const float gx_mean =
      lane_sum(n, [&](int64_t j) { return widen(dy[j]) * w[j] * ((x[j] - mean) * rstd); }) * inv_n;
  const auto row = [&](int64_t j) {
    const float d = widen(dy[j]), xhat = (x[j] - mean) * rstd;
    dx[j] = rstd * (d * w[j] - g_mean - xhat * gx_mean);
    dw[j] += d * xhat;
    return d;
  };
  if (db) {
    for (int64_t j = 0; j < n; ++j) db[j] += row(j);
  } else {
    for (int64_t j = 0; j < n; ++j) row(j);
  }
}
SL_KERNEL_CLONES(void, layer_norm_backward_row,
                 (const Bf16* dy, const float* x, const float* w, float mean, float rstd, int64_t n,
                  float* dx, float* dw, float* db),
                 (dy, x, w, mean, rstd, n, dx, dw, db))

}  // namespace sl::kernels::cpu
