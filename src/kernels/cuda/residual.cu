// The residual add, forward and backward (cuda_kernels.h; the contract is model/residual.h's, on
// CUDA): elementwise grid-stride loops (four elements per thread and step where every array is aligned
// for it), and the bias form's column sums per piece of rows, each column of a piece summed by one
// thread, rows in order, then sum_pieces.
#include "kernels/cuda/common.cuh"

namespace sl::kernels {
namespace {

// out = x + widen(y); the vector form on n / 4 groups of 4 (x, out 16-byte, y 8-byte aligned).
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    add_kernel(const float* __restrict__ x, const Bf16* __restrict__ y, float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    for (int64_t q = first; q < n / 4; q += stride) {
      const float4 a = reinterpret_cast<const float4*>(x)[q];
      const uint2 h = reinterpret_cast<const uint2*>(y)[q];  // 4 bf16, little-endian: low half first
      const float4 s = {a.x + widen(static_cast<Bf16>(h.x & 0xFFFFu)), a.y + widen(static_cast<Bf16>(h.x >> 16)),
                        a.z + widen(static_cast<Bf16>(h.y & 0xFFFFu)), a.w + widen(static_cast<Bf16>(h.y >> 16))};
      reinterpret_cast<float4*>(out)[q] = s;
    }
  } else {
    for (int64_t i = first; i < n; i += stride) out[i] = x[i] + widen(y[i]);
  }
}

// out = x + (y + b[i % C]) for a bf16 or an fp32 y.
template <class T>
__global__ void __launch_bounds__(kThreads)
    add_bias_kernel(const float* __restrict__ x, const T* __restrict__ y, const float* __restrict__ b,
                    float* __restrict__ out, int64_t n, int64_t C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = x[i] + (load(y, i) + b[i % C]);
}

// One block per piece of rows; thread t sums its columns over the piece's rows in order into
// db_part's row of the piece, and writes dy = bf16(g) where dy is non-null.
__global__ void __launch_bounds__(kThreads)
    bias_backward_kernel(const float* __restrict__ g, Bf16* __restrict__ dy, float* __restrict__ db_part,
                         int64_t rows, int64_t C) {
  for (int64_t p = blockIdx.x; p < pieces_of(rows); p += gridDim.x) {
    const int64_t r0 = p * kRowsPerPiece, r1 = r0 + kRowsPerPiece < rows ? r0 + kRowsPerPiece : rows;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      float s = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        const float v = g[r * C + j];
        if (dy) dy[r * C + j] = narrow(v);
        s += v;
      }
      db_part[p * C + j] = s;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    sum_pieces_kernel(const float* __restrict__ part, int64_t pieces, int64_t C, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < C; j += stride) {
    float s = 0.0f;
    for (int64_t p = 0; p < pieces; ++p) s += part[p * C + j];
    out[j] = s;
  }
}

}  // namespace

void sum_pieces(const float* part, int64_t pieces, int64_t C, float* out, Stream stream) {
  if (C == 0) return;
  sum_pieces_kernel<<<grid_for(C), kThreads, 0, stream>>>(part, pieces, C, out);
}

void residual_add(const float* x, const Bf16* y, float* out, int64_t n, Stream stream) {
  if (n == 0) return;
  if (n % 4 == 0 && aligned(x, 16) && aligned(y, 8) && aligned(out, 16))
    add_kernel<true><<<grid_for(n / 4), kThreads, 0, stream>>>(x, y, out, n);
  else
    add_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(x, y, out, n);
}

void residual_add_bias(const float* x, const Bf16* y16, const float* y32, const float* b, float* out, int64_t rows,
                       int64_t C, Stream stream) {
  const int64_t n = rows * C;
  if (n == 0) return;
  if (y16)
    add_bias_kernel<Bf16><<<grid_for(n), kThreads, 0, stream>>>(x, y16, b, out, n, C);
  else
    add_bias_kernel<float><<<grid_for(n), kThreads, 0, stream>>>(x, y32, b, out, n, C);
}

void residual_bias_backward(const float* g, Bf16* dy, float* db_part, int64_t rows, int64_t C, Stream stream) {
  if (rows == 0 || C == 0) return;
  bias_backward_kernel<<<grid_rows(row_pieces(rows)), kThreads, 0, stream>>>(g, dy, db_part, rows, C);
}

}  // namespace sl::kernels
