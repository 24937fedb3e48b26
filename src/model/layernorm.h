// LayerNorm of a bf16 run's fp32 residual stream straight into bf16, for the linear that reads it. Under
// CPU autocast ATen's layer_norm gives an fp32 output, which the linear's autocast cast then rounds to
// bf16 in a pass of its own (and backward widens the bf16 input gradient back to fp32 before
// layer_norm's backward): layer_norm_bf16 writes the rounded output itself and its backward reads the
// bf16 gradient as it is, two passes over memory and two ops fewer per norm.
//
// Numerics: mean and variance in fp32 (two passes over the row, so the variance is a sum of squares of
// centred values, as ATen's Welford moments are; the sums in 8 lanes), y = (x - mean) rstd w + b in fp32,
// rounded once to bf16 (to nearest even), rstd = 1 / sqrt(var + eps). The backward in fp32 on the widened
// gradient: dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w and xhat = (x - mean) rstd; dw and
// db sum dy xhat and dy over rows in fixed pieces of rows, then the pieces in order (their bits depend on
// neither the thread count nor the split). So the output is ATen's fp32 layer_norm rounded to bf16 up to
// fp32 rounding before that (an output can land one bf16 ulp apart where ATen's fp32 value sits at a
// rounding boundary), and the gradients are ATen's to fp32 rounding. Saves x, w and the per-row mean
// and rstd, as ATen's layer_norm does (not its output). Differentiable once (no double backward).
//
// On CUDA (a build with the CUDA kernels, model/cuda_fused.h) the same contract under CUDA autocast, one
// block per row (src/kernels/cuda/layernorm.cu): the row sums in another fixed order (so other fp32 bits), dw
// and db in fixed pieces of rows summed in order, bit for bit the same from run to run. On CUDA the
// stream may also be bf16 with bf16 w and b (bf16 compute copies, precision.param_dtype bf16): the same
// fp32 arithmetic on the exactly widened values, the same bf16 y and fp32 saved mean and rstd (and the
// saved x, now bf16); dx is rounded once to bf16 from fp32, dw and db once from their fp32 sums. Under
// CUDA autocast ATen's layer_norm would compute that norm in fp32 and return fp32.
#pragma once
#include <torch/types.h>

namespace sl::model {

// layer_norm(x, (C), w, b, eps) rounded to bf16, for x (..., C) fp32 and w, b (C) fp32 (b may be
// undefined), or on CUDA all three bf16. Callers ask layer_norm_bf16_fused first.
torch::Tensor layer_norm_bf16(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps);

// True when a norm of x whose output feeds a linear takes layer_norm_bf16: autocast of x's device on in
// bf16 (the linear would round the output to bf16 anyway), x an fp32 contiguous CPU tensor (or an fp32 or
// bf16 CUDA one, in a build with the CUDA kernels), w (and b, if defined) contiguous vectors of x.size(-1)
// in x's dtype on x's device, and the fused kernels on (device::fused_kernels()). False for a CPU bf16 x.
bool layer_norm_bf16_fused(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

}  // namespace sl::model
