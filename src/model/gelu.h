// GPT-2's tanh-approximated GELU, x * 0.5 * (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3),
// written as x * sigmoid(2 z) (the same function) with one exp per element: a fused forward and
// backward kernel for contiguous fp32 CPU tensors, where ATen's tanh-based kernel spends most of its
// time in tanh. Other tensors (CUDA, bf16, fp16, strided) go to at::gelu(x, "tanh"). An AVX2 + FMA
// form and a baseline one, picked per call (device::vector_kernels()); they differ by float rounding.
#pragma once
#include <torch/types.h>

namespace sl::model {

// Differentiable (once: no double backward). Saves x for backward, as at::gelu does (the same
// activation memory).
torch::Tensor gelu_tanh(const torch::Tensor& x);

// True when gelu_tanh takes the fused kernel for `x`.
bool gelu_tanh_fused(const torch::Tensor& x);

// gelu_tanh(x + b) for x (..., H) and a bias b (H), with the bias added inside the kernel and its
// gradient (dx summed over rows) taken in the same pass as dx: the linear before it runs without its
// bias, which spares ATen's addmm the bias broadcast and its backward the separate column sum. Saves x
// and b (x is the same size as the x + b gelu_tanh would save). Fused only: callers check
// gelu_tanh_bias_fused first. The bias gradient sums fixed pieces of rows in a fixed order (its bits
// depend on neither the thread count nor the split).
torch::Tensor gelu_tanh_bias(const torch::Tensor& x, const torch::Tensor& b);

// True when gelu_tanh_bias takes activations computed like `like` (its device and dtype; fp32 CPU,
// outside CPU autocast) with bias b: a model asks before its linear whether the bias goes there or here.
bool gelu_tanh_bias_fused(const torch::Tensor& like, const torch::Tensor& b);

}  // namespace sl::model
