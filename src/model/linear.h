// The project's linear layer, y = x W^T + b, and the matmuls of its backward.
//
// On a CPU with no oneDNN GEMM for bf16/fp16 (AVX2 only, or oneDNN capped below AVX-512: the
// libraries' path device::LowpMatmul::aten), ATen runs low-precision matmuls on its fallback GEMM,
// 10-100x slower than the fp32 one; on AVX-512 without bf16 instructions (a Cascade Lake Xeon:
// LowpMatmul::emulated) oneDNN's gemm:jit:bf16 makes a bf16 step twice as slow as fp32's
// (docs/precision.md). There a linear in the compute dtype is *widened*: its operands, rounded to the compute dtype as
// autocast rounds them, are converted exactly to fp32 a chunk of rows at a time, multiplied by the fp32 GEMM (MKL /
// oneDNN), and the result is rounded once back to the compute dtype.
//
// Numerics: the same roundings as autocast's ATen linear: the input, weight and bias rounded to the
// compute dtype, the output, the input gradient, the weight gradient and the bias gradient rounded to
// it (then cast to the parameter's dtype, as autocast's cast node does), with fp32 accumulation as
// ATen's bf16 GEMMs have; only the order of the fp32 sums differs. A recomputed linear gives the
// same bits (the chunking depends on the shapes only). fp16 overflows to inf where a native fp16
// GEMM would.
//
// Memory: nothing in the compute dtype is cached or kept for the weight (the linear saves the
// parameter itself and rounds it again in backward, where autocast keeps a compute-dtype copy per
// weight through the whole forward). Transients of one call: the rounded weight in fp32 (4 N K bytes;
// rounded 64K elements at a time), in backward the fp32 weight gradient (4 N K, rounded in place and
// returned as W's gradient when W is fp32) beside it, and fp32 scratch of widened_scratch_bytes.
// The planner's model is in predict/activations.cpp ("widened").
//
// Everywhere else (CUDA, fp32, a CPU with bf16 instructions, SUBLINEAR_ATEN_KERNELS=1) it is at::linear and
// at::mm, exactly as before.
#pragma once
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace sl::model {

// The compute dtype a linear on `x` takes the widened path in, now; nullopt: at::linear. x on the CPU,
// the dtype autocast's (while CPU autocast is on) else x's own, bf16 or fp16, the CPU's path for it
// device::LowpMatmul::aten or emulated, and the fused kernels not turned off (device::fused_kernels()).
std::optional<c10::ScalarType> widened_dtype(const at::Tensor& x);

// Whether a matmul in dt on `device` takes the widened path (widened_dtype's rule for a dtype already chosen).
bool widened_path(c10::Device device, c10::ScalarType dt);

// x (..., K) W^T (N, K) + b (N, or undefined) under the current autocast state: at::linear, or the
// widened linear (one autograd node; saves x in the compute dtype and W itself).
at::Tensor linear(const at::Tensor& x, const at::Tensor& W, const at::Tensor& b = {});

// a (M, K) b (K, N) in a's dtype, b rounded to it: widened where a's dtype is widened (the rule of
// widened_dtype, on a's own dtype: autocast plays no part), else at::mm. A linear's input gradient is mm(gy2, W); the
// MFU's peak is measured with it.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b);
// A linear's weight gradient for autograd nodes that take it themselves (recompute/checkpoint.cpp):
// gy2^T (N, M) a2 (M, K) rounded to gy2's dtype (the compute dtype; a2 rounded to it too): widened
// where mm would be, then in an fp32 tensor (rounded in place; its values are the compute dtype's),
// else at::mm in gy2's dtype. Callers cast it to the weight's dtype.
at::Tensor linear_weight_grad(const at::Tensor& gy2, const at::Tensor& a2);

// The rows of one widened chunk of a linear with input (M, K) and output (M, N), the same for its
// forward and both gradients: as many as keep a chunk's fp32 scratch (a row of the input or input
// gradient, K, and one of the output or output gradient, N) within kWidenScratchBytes, but at least
// kWidenMinRows (a wide linear, an LM head over a large vocabulary: each chunk streams the whole weight
// and, in backward, its fp32 gradient, so fewer rows would make the pass memory-bound), at most M.
constexpr int64_t kWidenScratchBytes = int64_t{4} << 20;
constexpr int64_t kWidenMinRows = 256;
constexpr int64_t widened_chunk_rows(int64_t M, int64_t K, int64_t N) {
  const int64_t fit = kWidenScratchBytes / (4 * (N + K));
  const int64_t rows = fit < kWidenMinRows ? kWidenMinRows : fit;
  return rows < M ? rows : M;
}
// The fp32 scratch one widened call holds: 4 (N + K) bytes per chunk row.
constexpr int64_t widened_scratch_bytes(int64_t M, int64_t K, int64_t N) {
  return 4 * widened_chunk_rows(M, K, N) * (N + K);
}

}  // namespace sl::model
