// The fused CUDA kernels (src/kernels/cuda/*.cu): plain CUDA C++, no torch headers, built into
// sublinear_cuda_kernels only where CMake finds a CUDA compiler and torch is a CUDA build (then
// SUBLINEAR_CUDA_KERNELS is defined for sublinear_core). Their callers are the wrappers of
// src/model/cuda_fused.cpp, which check the operands, allocate every output and scratch buffer with
// ATen (so the caching allocator and the memory tracking count them) and pass raw pointers.
//
// Contracts, the same for every launch function here:
//  - Streams: each function enqueues its kernels on `stream` (the caller's current CUDA stream) and
//    returns without waiting; nothing here synchronizes, allocates or touches another stream, so the
//    launches are legal inside a CUDA graph capture. Inputs must stay alive and unchanged until the
//    stream has run the kernels, which ATen's caching allocator guarantees for tensors used on it.
//  - Launch errors are left to cudaGetLastError (the wrapper checks it after each call).
//  - Layout: every array is contiguous; a (rows, C) array is row-major. bf16 values are their bits
//    (uint16_t): widened exactly (the high half of a float), rounded to nearest even (NaN: 0x7FC0),
//    bit for bit c10::BFloat16's conversions.
//  - Determinism: no float atomics. Row sums are block reductions of a fixed shape (kThreads threads,
//    a fixed order per thread, a butterfly over lanes and warps); column sums over rows go into one row
//    of partial sums per piece of kRowsPerPiece rows (each column of a piece summed by one thread, rows
//    in order), then sum_pieces adds the pieces in order. The bits depend on the inputs and C alone.
//  - Scratch: a `*_part` argument is a (row_pieces(rows), C) fp32 array the kernel overwrites (no
//    zeroing needed); it may be reused as soon as sum_pieces, enqueued after it, has run.
#pragma once
#include <cstdint>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace sl::kernels {

using Stream = CUstream_st*;
using Bf16 = uint16_t;

// Threads per block of the row kernels, and rows per piece of the column sums.
inline constexpr int kThreads = 256;
inline constexpr int64_t kRowsPerPiece = 32;

inline int64_t row_pieces(int64_t rows) { return (rows + kRowsPerPiece - 1) / kRowsPerPiece; }

// out[j] = sum over p in order of part[p * C + j], from 0 (fp32).
void sum_pieces(const float* part, int64_t pieces, int64_t C, float* out, Stream stream);

// ---- LayerNorm of an fp32 stream into bf16 (model/layernorm.h) ----

// y = bf16((x - mean) rstd w + b) per row of x (rows, C); mean = sum(x) / C, var = sum((x - mean)^2) / C
// (two passes), rstd = 1 / sqrt(var + eps), all fp32; b may be null. mean and rstd: (rows) fp32.
void layer_norm_forward(const float* x, const float* w, const float* b, float eps, int64_t rows, int64_t C, Bf16* y,
                        float* mean, float* rstd, Stream stream);

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - mean) rstd, per row (fp32, from
// the widened bf16 dy); dw_part, db_part (db_part may be null): per piece of rows, the sums of dy xhat
// and dy over its rows.
void layer_norm_backward(const Bf16* dy, const float* x, const float* w, const float* mean, const float* rstd,
                         int64_t rows, int64_t C, float* dx, float* dw_part, float* db_part, Stream stream);

// ---- LayerNorm of a bf16 stream (bf16 compute copies: x, w, b bf16) into bf16 ----

// The same as the fp32 stream's, x, w, b widened exactly: every sum and product in fp32, y rounded once.
void layer_norm_forward(const Bf16* x, const Bf16* w, const Bf16* b, float eps, int64_t rows, int64_t C, Bf16* y,
                        float* mean, float* rstd, Stream stream);

// The same as the fp32 stream's: dx computed in fp32 and rounded once to bf16; dw_part, db_part fp32.
void layer_norm_backward(const Bf16* dy, const Bf16* x, const Bf16* w, const float* mean, const float* rstd,
                         int64_t rows, int64_t C, Bf16* dx, float* dw_part, float* db_part, Stream stream);

// ---- the residual add (model/residual.h) ----

// out = x + widen(y), n elements.
void residual_add(const float* x, const Bf16* y, float* out, int64_t n, Stream stream);

// out = x + (y + b[column]) for x, y (rows, C): y bf16 (y16) or fp32 (y32), exactly one of them non-null.
void residual_add_bias(const float* x, const Bf16* y16, const float* y32, const float* b, float* out, int64_t rows,
                       int64_t C, Stream stream);

// The bias form's backward: dy = bf16(g) where dy is non-null (a bf16 branch), and per piece of rows
// the column sums of g into db_part.
void residual_bias_backward(const float* g, Bf16* dy, float* db_part, int64_t rows, int64_t C, Stream stream);

// ---- GPT-2's tanh GELU (model/gelu.h) ----

// y = gelu(x (+ b[column])) for x (rows, C), fp32 (bf16 = false) or bf16 arrays x, y; b fp32 or null.
// gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), in fp32, rounded once into y's dtype.
void gelu_forward(const void* x, bool bf16, const float* b, void* y, int64_t rows, int64_t C, Stream stream);

// dx = g gelu'(x (+ b)) in fp32, stored in x's dtype; g and dx of x's dtype. Where db_part is non-null
// (then b is too), per piece of rows the column sums of the unrounded fp32 dx.
void gelu_backward(const void* g, const void* x, bool bf16, const float* b, void* dx, float* db_part, int64_t rows,
                   int64_t C, Stream stream);

}  // namespace sl::kernels
