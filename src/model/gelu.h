// GPT-2's tanh-approximated GELU, x * 0.5 * (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3),
// written as x * sigmoid(2 z) (the same function) with one exp per element: a fused forward and
// backward kernel for contiguous fp32 CPU tensors, where ATen's tanh-based kernel spends most of its
// time in tanh. Other tensors (CUDA, bf16, fp16, strided) go to at::gelu(x, "tanh").
#pragma once
#include <torch/types.h>

namespace sl::model {

// Differentiable. Saves x for backward, as at::gelu does (the same activation memory).
torch::Tensor gelu_tanh(const torch::Tensor& x);

// True when gelu_tanh takes the fused kernel for `x`.
bool gelu_tanh_fused(const torch::Tensor& x);

}  // namespace sl::model
