// The residual add of a bf16 run on the CPU: the fp32 residual stream x plus a block branch's output
// y, which CPU autocast makes bf16 (its last linear). ATen's x + y promotes y to an fp32 tensor of its
// own, then adds (two passes over memory and a transient fp32 copy of y); residual_add does it in one
// pass, y widened exactly as it is loaded. Bit for bit ATen's result: widening a bf16 is exact and
// the fp32 sum rounds once, as ATen's does. The backward is ATen's too: dx = g, dy = g rounded to bf16
// (to nearest even). Other operands (same dtype, CUDA, broadcast shapes, non-contiguous) and every
// call under SUBLINEAR_ATEN_KERNELS=1 (device::fused_kernels()) take x + y.
#pragma once
#include <torch/types.h>

namespace sl::model {

// x + y (differentiable once, like the fused GELU: no double backward through the fused form).
torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y);

// True when residual_add takes the fused pass: x fp32 and y bf16, the same sizes, both contiguous CPU
// tensors, and the fused kernels on.
bool residual_add_fused(const torch::Tensor& x, const torch::Tensor& y);

}  // namespace sl::model
