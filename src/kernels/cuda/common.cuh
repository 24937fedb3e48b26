// Device helpers of the fused CUDA kernels (cuda_kernels.h has the contracts).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_kernels.h"

namespace sl::kernels {

__device__ __forceinline__ float widen(Bf16 h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even; every NaN becomes 0x7FC0 (c10::BFloat16's rule).
__device__ __forceinline__ Bf16 narrow(float f) {
  const uint32_t u = __float_as_uint(f);
  if (f != f) return static_cast<Bf16>(0x7FC0u);
  return static_cast<Bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const Bf16* p, int64_t i) { return widen(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(Bf16* p, int64_t i, float v) { p[i] = narrow(v); }

// row_pieces, in device code.
__device__ __forceinline__ int64_t pieces_of(int64_t rows) { return (rows + kRowsPerPiece - 1) / kRowsPerPiece; }

// The sum over the block of each thread's v, the same bits in every thread: a butterfly over the 32
// lanes (lane i and lane i ^ o add the same two values, so every lane ends with the same sum), each
// warp's sum into `red` (32 floats of shared memory), then every warp sums them by the same butterfly.
// blockDim.x is a multiple of 32, at most 1024. Every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // red may be written again by the next call
  return v;
}

// Blocks for a grid-stride loop over `work` items of kThreads threads each (at most 2^16 blocks).
inline unsigned grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// Blocks for one block per row (or piece), with a loop for more rows than a grid holds.
inline unsigned grid_rows(int64_t rows) {
  return static_cast<unsigned>(rows < 1 ? 1 : (rows > 0x7fffffff ? 0x7fffffff : rows));
}

// Whether p is aligned for a vector of `bytes`.
inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace sl::kernels
