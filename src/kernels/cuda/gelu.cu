// GPT-2's tanh GELU with an optional bias, forward and backward (cuda_kernels.h; the contract is
// model/gelu.h's, on CUDA). The arithmetic is ATen's CUDA tanh GELU, step for step, in fp32 (tanhf,
// IEEE division and no fast-math: the numerics are the contract's): elementwise grid-stride loops,
// and the bias gradient's column sums per piece of rows (one thread per column of a piece, rows in
// order), then sum_pieces.
#include "kernels/cuda/common.cuh"

namespace sl::kernels {
namespace {

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

__device__ __forceinline__ float gelu(float v) {
  const float inner = kBeta * (v + kKappa * v * v * v);
  return 0.5f * v * (1.0f + tanhf(inner));
}

// g d/dv gelu(v): 0.5 (1 + t) + 0.5 v (1 - t^2) sqrt(2/pi) (1 + 3 kappa v^2), t = tanh(inner).
__device__ __forceinline__ float gelu_grad(float g, float v) {
  const float v2 = v * v;
  const float t = tanhf(kBeta * (v + kKappa * v2 * v));
  const float left = 0.5f * v, right = 1.0f + t;
  const float right_derivative = left * (1.0f - t * t) * (kBeta * (1.0f + 3.0f * kKappa * v2));
  return g * (0.5f * right + right_derivative);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ x, const float* __restrict__ b, T* __restrict__ y, int64_t n, int64_t C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = b ? load(x, i) + b[i % C] : load(x, i);
    store(y, i, gelu(v));
  }
}

// Without a bias gradient: elementwise.
template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ b, T* __restrict__ dx,
                    int64_t n, int64_t C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = b ? load(x, i) + b[i % C] : load(x, i);
    store(dx, i, gelu_grad(load(g, i), v));
  }
}

// With it: one block per piece of rows, thread t summing its columns' fp32 dx over the piece's rows.
template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_bias_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ b,
                         T* __restrict__ dx, float* __restrict__ db_part, int64_t rows, int64_t C) {
  for (int64_t p = blockIdx.x; p < pieces_of(rows); p += gridDim.x) {
    const int64_t r0 = p * kRowsPerPiece, r1 = r0 + kRowsPerPiece < rows ? r0 + kRowsPerPiece : rows;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      float s = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r * C + j;
        const float d = gelu_grad(load(g, i), load(x, i) + b[j]);
        store(dx, i, d);
        s += d;
      }
      db_part[p * C + j] = s;
    }
  }
}

template <class T>
void forward_as(const void* x, const float* b, void* y, int64_t n, int64_t C, Stream stream) {
  forward_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), b, static_cast<T*>(y), n, C);
}

template <class T>
void backward_as(const void* g, const void* x, const float* b, void* dx, float* db_part, int64_t rows, int64_t C,
                 Stream stream) {
  const auto* G = static_cast<const T*>(g);
  const auto* X = static_cast<const T*>(x);
  auto* DX = static_cast<T*>(dx);
  if (db_part)
    backward_bias_kernel<T><<<grid_rows(row_pieces(rows)), kThreads, 0, stream>>>(G, X, b, DX, db_part, rows, C);
  else
    backward_kernel<T><<<grid_for(rows * C), kThreads, 0, stream>>>(G, X, b, DX, rows * C, C);
}

}  // namespace

void gelu_forward(const void* x, bool bf16, const float* b, void* y, int64_t rows, int64_t C, Stream stream) {
  if (rows * C == 0) return;
  if (bf16)
    forward_as<Bf16>(x, b, y, rows * C, C, stream);
  else
    forward_as<float>(x, b, y, rows * C, C, stream);
}

void gelu_backward(const void* g, const void* x, bool bf16, const float* b, void* dx, float* db_part, int64_t rows,
                   int64_t C, Stream stream) {
  if (rows * C == 0) return;
  if (bf16)
    backward_as<Bf16>(g, x, b, dx, db_part, rows, C, stream);
  else
    backward_as<float>(g, x, b, dx, db_part, rows, C, stream);
}

}  // namespace sl::kernels
