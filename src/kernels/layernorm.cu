// LayerNorm of an fp32 stream into bf16, forward and backward (cuda_kernels.h; the contract is
// model/layernorm.h's, on CUDA). One block of kThreads threads per row; each thread takes the columns
// j = threadIdx.x + k kThreads in order (four at a time from 16-byte-aligned rows whose C is a
// multiple of 4), so the sums and their bits depend on C alone.
#include "kernels/common.cuh"

namespace sl::kernels {
namespace {

// The sum over a row of f(j), this thread's share of the columns in order, then block_sum.
template <class F>
__device__ __forceinline__ float row_sum(int64_t C, float* red, F f) {
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += f(j);
  return block_sum(s, red);
}

// The sum over the row xr of f(x): the vector form takes 4 columns per float4 (C a multiple of 4, xr
// 16-byte aligned), the scalar form one.
template <bool kVec, class F>
__device__ __forceinline__ float row_sum_of_x(const float* xr, int64_t C, float* red, F f) {
  if constexpr (!kVec) {
    return row_sum(C, red, [&](int64_t j) { return f(xr[j]); });
  } else {
    float s = 0.0f;
    for (int64_t q = threadIdx.x; q < C / 4; q += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(xr)[q];
      s += (f(v.x) + f(v.y)) + (f(v.z) + f(v.w));
    }
    return block_sum(s, red);
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b, float eps,
                   int64_t rows, int64_t C, Bf16* __restrict__ y, float* __restrict__ mean_out,
                   float* __restrict__ rstd_out) {
  __shared__ float red[32];
  const float inv_n = 1.0f / static_cast<float>(C);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * C;
    Bf16* yr = y + r * C;
    const float mean = row_sum_of_x<kVec>(xr, C, red, [](float v) { return v; }) * inv_n;
    const float var = row_sum_of_x<kVec>(xr, C, red, [mean](float v) { return (v - mean) * (v - mean); }) * inv_n;
    const float rstd = 1.0f / sqrtf(var + eps);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float n = (xr[j] - mean) * rstd * w[j];
      yr[j] = narrow(b ? n + b[j] : n);
    }
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}

// One block per piece of kRowsPerPiece rows: dx row by row; thread t keeps the piece's partial column
// sums of its columns in dw_part / db_part (written at the piece's first row, added to after).
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const Bf16* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
                    const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows, int64_t C,
                    float* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part) {
  __shared__ float red[32];
  const float inv_n = 1.0f / static_cast<float>(C);
  for (int64_t p = blockIdx.x; p < pieces_of(rows); p += gridDim.x) {
    const int64_t r0 = p * kRowsPerPiece, r1 = r0 + kRowsPerPiece < rows ? r0 + kRowsPerPiece : rows;
    float* dw = dw_part + p * C;
    float* db = db_part ? db_part + p * C : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const Bf16* g = dy + r * C;
      const float* xr = x + r * C;
      const float m = mean[r], s = rstd[r];
      const float g_mean = row_sum(C, red, [&](int64_t j) { return widen(g[j]) * w[j]; }) * inv_n;
      const float gx_mean =
          row_sum(C, red, [&](int64_t j) { return widen(g[j]) * w[j] * ((xr[j] - m) * s); }) * inv_n;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
        const float d = widen(g[j]), xhat = (xr[j] - m) * s;
        dx[r * C + j] = s * (d * w[j] - g_mean - xhat * gx_mean);
        dw[j] = (r == r0 ? 0.0f : dw[j]) + d * xhat;
        if (db) db[j] = (r == r0 ? 0.0f : db[j]) + d;
      }
    }
  }
}

}  // namespace

void layer_norm_forward(const float* x, const float* w, const float* b, float eps, int64_t rows, int64_t C, Bf16* y,
                        float* mean, float* rstd, Stream stream) {
  if (rows == 0) return;
  const bool vec = C % 4 == 0 && aligned(x, 16);
  if (vec)
    forward_kernel<true><<<grid_rows(rows), kThreads, 0, stream>>>(x, w, b, eps, rows, C, y, mean, rstd);
  else
    forward_kernel<false><<<grid_rows(rows), kThreads, 0, stream>>>(x, w, b, eps, rows, C, y, mean, rstd);
}

void layer_norm_backward(const Bf16* dy, const float* x, const float* w, const float* mean, const float* rstd,
                         int64_t rows, int64_t C, float* dx, float* dw_part, float* db_part, Stream stream) {
  if (rows == 0) return;
  backward_kernel<<<grid_rows(row_pieces(rows)), kThreads, 0, stream>>>(dy, x, w, mean, rstd, rows, C, dx, dw_part,
                                                                         db_part);
}

}  // namespace sl::kernels
