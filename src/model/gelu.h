// GPT-2's tanh-approximated GELU, x * 0.5 * (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3),
// written as x * sigmoid(2 z) (the same function) with one exp per element: a fused forward and
// backward kernel for contiguous fp32 and bf16 CPU tensors, where ATen's tanh-based kernel spends most
// of its time in tanh. bf16 is loaded into fp32, computed exactly as fp32 is, and rounded to bf16 (to
// nearest even, as c10::BFloat16) once per stored element; its backward takes bf16 gradients and saved
// x and gives bf16 dx (the bias gradient is summed in fp32). Other tensors (CUDA, fp16, strided) go to
// at::gelu(x, "tanh"), and so does everything under SUBLINEAR_ATEN_KERNELS=1 (device::fused_kernels()).
// An AVX2 + FMA form and a baseline one, picked per call (device::vector_kernels()); they differ by
// float rounding. On AVX-512 the AVX2 form runs on 16 lanes (device::avx512_kernels()), bit for bit
// its 8-lane result.
//
// On CUDA (a build with the CUDA kernels, model/cuda_fused.h; src/kernels/cuda/gelu.cu) the same forms for
// contiguous fp32 and bf16 CUDA tensors, with ATen's CUDA arithmetic (0.5 x (1 + tanh z), tanhf) in fp32
// and one rounding per stored element; the bias gradient in fixed pieces of rows summed in order (the
// same bits from run to run). The predicates ask the autocast of the tensors' device.
#include <torch/types.h>

namespace sl::model {

// Differentiable (once: no double backward). Saves x for backward, as at::gelu does (the same
// activation memory, in x's dtype).
torch::Tensor gelu_tanh(const torch::Tensor& x);

// True when gelu_tanh takes the fused kernel for `x`.
bool gelu_tanh_fused(const torch::Tensor& x);

// gelu_tanh(x + b) for x (..., H) and a bias b (H), with the bias added inside the kernel and its
// gradient (dx summed over rows) taken in the same pass as dx: the linear before it runs without its
// bias, which spares ATen's addmm the bias broadcast and its backward the separate column sum. Saves x
// and b (x is the same size as the x + b gelu_tanh would save). x fp32 with b fp32, or x bf16 with b
// fp32 or bf16 (x + b is taken in fp32, then rounded once with the GELU). Fused only: callers check
// gelu_tanh_bias_fused first. The bias gradient sums the fp32 dx in fixed pieces of rows in a fixed order
// (its bits depend on neither the thread count nor the split), and comes back in b's dtype.
torch::Tensor gelu_tanh_bias(const torch::Tensor& x, const torch::Tensor& b);

// True when gelu_tanh_bias takes the activations a linear makes from `like` with bias b: a model asks
// before its linear whether the bias goes there or here. Those activations are CPU autocast's dtype while
// it is on (the model's bf16 run: an fp32 residual stream `like`, a bf16 fc output), else like's; fp32
// with an fp32 b, or bf16 with an fp32 or bf16 b, on the CPU, and not under SUBLINEAR_ATEN_KERNELS.
bool gelu_tanh_bias_fused(const torch::Tensor& like, const torch::Tensor& b);

}  // namespace sl::model
