// LayerNorm of an fp32 or a bf16 stream into bf16, forward and backward (cuda_kernels.h; the contract
// is model/layernorm.h's, on CUDA). The kernels are templates on T, the dtype of x, w, b and dx (float
// or Bf16, read through load/store: widened exactly, rounded once); all arithmetic is fp32 either way.
// One block of kThreads threads per row; each thread takes the columns j = threadIdx.x + k kThreads in
// order (for fp32, four at a time from 16-byte-aligned rows whose C is a multiple of 4), so the sums
// and their bits depend on C alone.
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace sl::kernels {
namespace {

// The sum over a row of f(j), this thread's share of the columns in order, then block_sum.
template <class F>
__device__ __forceinline__ float row_sum(int64_t C, float* red, F f) {
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += f(j);
  return block_sum(s, red);
}

// The sum over the row xr of f(x): the vector form takes 4 columns per float4 (fp32 only: C a multiple
// of 4, xr 16-byte aligned), the scalar form one.
template <bool kVec, class T, class F>
__device__ __forceinline__ float row_sum_of_x(const T* xr, int64_t C, float* red, F f) {
  if constexpr (!kVec) {
    return row_sum(C, red, [&](int64_t j) { return f(load(xr, j)); });
  } else {
    float s = 0.0f;
    for (int64_t q = threadIdx.x; q < C / 4; q += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(xr)[q];
      s += (f(v.x) + f(v.y)) + (f(v.z) + f(v.w));
    }
    return block_sum(s, red);
  }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, float eps,
                   int64_t rows, int64_t C, Bf16* __restrict__ y, float* __restrict__ mean_out,
                   float* __restrict__ rstd_out) {
  __shared__ float red[32];
  const float inv_n = 1.0f / static_cast<float>(C);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * C;
    Bf16* yr = y + r * C;
    const float mean = row_sum_of_x<kVec>(xr, C, red, [](float v) { return v; }) * inv_n;
    const float var = row_sum_of_x<kVec>(xr, C, red, [mean](float v) { return (v - mean) * (v - mean); }) * inv_n;
    const float rstd = 1.0f / sqrtf(var + eps);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float n = (load(xr, j) - mean) * rstd * load(w, j);
      yr[j] = narrow(b ? n + load(b, j) : n);
    }
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}

// One block per piece of kRowsPerPiece rows: dx row by row; thread t keeps the piece's partial column
// sums of its columns in dw_part / db_part (written at the piece's first row, added to after), in
// fp32 whatever T is.
template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const Bf16* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                    const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows, int64_t C,
                    T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part) {
  __shared__ float red[32];
  const float inv_n = 1.0f / static_cast<float>(C);
  for (int64_t p = blockIdx.x; p < pieces_of(rows); p += gridDim.x) {
    const int64_t r0 = p * kRowsPerPiece, r1 = r0 + kRowsPerPiece < rows ? r0 + kRowsPerPiece : rows;
    float* dw = dw_part + p * C;
    float* db = db_part ? db_part + p * C : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const Bf16* g = dy + r * C;
      const T* xr = x + r * C;
      const float m = mean[r], s = rstd[r];
      const float g_mean = row_sum(C, red, [&](int64_t j) { return widen(g[j]) * load(w, j); }) * inv_n;
      const float gx_mean =
          row_sum(C, red, [&](int64_t j) { return widen(g[j]) * load(w, j) * ((load(xr, j) - m) * s); }) * inv_n;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
        const float d = widen(g[j]), xhat = (load(xr, j) - m) * s;
        store(dx, r * C + j, s * (d * load(w, j) - g_mean - xhat * gx_mean));
        dw[j] = (r == r0 ? 0.0f : dw[j]) + d * xhat;
        if (db) db[j] = (r == r0 ? 0.0f : db[j]) + d;
      }
    }
  }
}

// The launches of both dtypes: the float4 form for fp32 rows that allow it.
template <class T>
void forward(const T* x, const T* w, const T* b, float eps, int64_t rows, int64_t C, Bf16* y, float* mean, float* rstd,
             Stream stream) {
  if (rows == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    if (C % 4 == 0 && aligned(x, 16)) {
      forward_kernel<T, true><<<grid_rows(rows), kThreads, 0, stream>>>(x, w, b, eps, rows, C, y, mean, rstd);
      return;
    }
  }
  forward_kernel<T, false><<<grid_rows(rows), kThreads, 0, stream>>>(x, w, b, eps, rows, C, y, mean, rstd);
}

template <class T>
void backward(const Bf16* dy, const T* x, const T* w, const float* mean, const float* rstd, int64_t rows, int64_t C,
              T* dx, float* dw_part, float* db_part, Stream stream) {
  if (rows == 0) return;
  backward_kernel<T><<<grid_rows(row_pieces(rows)), kThreads, 0, stream>>>(dy, x, w, mean, rstd, rows, C, dx, dw_part,
                                                                            db_part);
}

}  // namespace

void layer_norm_forward(const float* x, const float* w, const float* b, float eps, int64_t rows, int64_t C, Bf16* y,
                        float* mean, float* rstd, Stream stream) {
  forward(x, w, b, eps, rows, C, y, mean, rstd, stream);
}

void layer_norm_forward(const Bf16* x, const Bf16* w, const Bf16* b, float eps, int64_t rows, int64_t C, Bf16* y,
                        float* mean, float* rstd, Stream stream) {
  forward(x, w, b, eps, rows, C, y, mean, rstd, stream);
}

void layer_norm_backward(const Bf16* dy, const float* x, const float* w, const float* mean, const float* rstd,
                         int64_t rows, int64_t C, float* dx, float* dw_part, float* db_part, Stream stream) {
  backward(dy, x, w, mean, rstd, rows, C, dx, dw_part, db_part, stream);
}

void layer_norm_backward(const Bf16* dy, const Bf16* x, const Bf16* w, const float* mean, const float* rstd,
                         int64_t rows, int64_t C, Bf16* dx, float* dw_part, float* db_part, Stream stream) {
  backward(dy, x, w, mean, rstd, rows, C, dx, dw_part, db_part, stream);
}

}  // namespace sl::kernels
