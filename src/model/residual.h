// The residual add of a bf16 run on the CPU: the fp32 residual stream x plus a block branch's output
// y, which CPU autocast makes bf16 (its last linear). ATen's x + y promotes y to an fp32 tensor of its
// own, then adds (two passes over memory and a transient fp32 copy of y); residual_add does it in one
// pass, y widened exactly as it is loaded. Bit for bit ATen's result: widening a bf16 is exact and
// the fp32 sum rounds once, as ATen's does. The backward is ATen's too: dx = g, dy = g rounded to bf16
// (to nearest even). Other operands (same dtype, CUDA, broadcast shapes, non-contiguous) and every
// call under SUBLINEAR_ATEN_KERNELS=1 (device::fused_kernels()) take x + y.
//
// With the branch linear's bias b (fp32, one per column): x + (y + b), the bias added in fp32 in the
// same pass (y bf16, or an fp32 run's fp32 y), so the linear runs without it (no bias broadcast into
// its output before the GEMM, no separate column sum in its backward). Against autocast's biased linear, whose output
// is bf16(acc + bf16(b)), this rounds acc to bf16 alone and adds the unrounded b in fp32: one bf16 rounding of the
// branch either way, b itself no longer rounded. Backward: dx = g, dy = bf16(g) and db = g summed over rows in fp32
// (ATen's sums bf16(g) and rounds the sum to bf16), in fixed pieces of rows and a fixed order (its bits depend on
// neither the thread count nor the split), all in one pass. In an fp32 run (y fp32) the same, with dy = g. A strided y
// (same sizes) takes this form too (its forward in ATen ops, the same bits, no copy of y), so the gradients do not
// depend on y's layout; other operands take x + (y + b).
//
// On CUDA (a build with the CUDA kernels, model/cuda_fused.h; src/kernels/cuda/residual.cu) the same forms,
// under CUDA autocast where the CPU's ask CPU autocast: the sums bit for bit ATen's, db in fixed pieces
// of rows summed in order (the same bits from run to run).
#pragma once
#include <torch/types.h>

namespace sl::model {

// x + y, or x + (y + b) with b (C) broadcast over the rows of x, y (..., C) (differentiable once, like
// the fused GELU: no double backward through the fused form).
torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b = {});

// True when residual_add takes the fused pass: x fp32 and y bf16, the same sizes, both contiguous CPU
// tensors (or CUDA, in a build with the CUDA kernels) on one device, and the fused kernels on.
bool residual_add_fused(const torch::Tensor& x, const torch::Tensor& y);

// True when the bias b of the linear that makes a block's branch goes into residual_add's fused pass
// for the stream x: asked before that linear, as gelu_tanh_bias_fused is. x an fp32 contiguous CPU
// tensor (or CUDA, in a build with the CUDA kernels), autocast of x's device off (an fp32 branch: dy is g, db its
// column sums; addmm accumulates onto the bias inside its GEMM, so the two differ by fp32 rounding: about half of l12's
// outputs, by 1 ulp) or on in bf16 (a bf16 branch), b an fp32 vector of x.size(-1) on x's device, the fused kernels on.
// Where it says false the bias stays in the linear.
bool residual_bias_fused(const torch::Tensor& x, const torch::Tensor& b);

}  // namespace sl::model
