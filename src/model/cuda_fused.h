// The fused kernels on CUDA: the wrappers that model/layernorm.cpp, residual.cpp and gelu.cpp call
// for CUDA tensors, in a build with the CUDA kernels (src/kernels/cuda/cuda_kernels.h; CMake defines
// SUBLINEAR_CUDA_KERNELS when it builds them). Each follows the contract of the CPU kernel it stands
// in for (the header named beside it): the same inputs, outputs, dtypes and saved tensors, so the
// autograd functions, the model and the planner's memory model are the same on both devices.
//
// Each wrapper checks its operands (one CUDA device, contiguous, the dtypes below), allocates its
// outputs and scratch with ATen on the operands' device, launches on that device's current CUDA stream
// and returns without synchronizing: the results are ordinary tensors on that stream, like ATen's.
#pragma once
#include <array>
#include <cstdint>
#include <utility>

#include <torch/types.h>

namespace sl::model {

#if defined(SUBLINEAR_CUDA_KERNELS)
inline constexpr bool kCudaKernels = true;
#else
inline constexpr bool kCudaKernels = false;
#endif

// A device the fused kernels run on: the CPU, and CUDA in a build with the CUDA kernels.
inline bool fused_kernel_device(const torch::Device& d) { return d.is_cpu() || (kCudaKernels && d.is_cuda()); }

namespace cuda {

// The wrappers below (a build with the CUDA kernels), for counting: launches(k) is how many times
// wrapper k has queued its kernels in this process (any thread, any device; 0 in a build without them).
// Tests read it before and after an op to assert that the fused path ran, not ATen's fall-back.
enum class Kernel {
  layer_norm_forward,
  layer_norm_backward,
  residual_add,
  residual_add_bias,
  residual_bias_backward,
  gelu_forward,
  gelu_backward,
  count
};
#if defined(SUBLINEAR_CUDA_KERNELS)
int64_t launches(Kernel k);
#else
inline int64_t launches(Kernel /*k*/) { return 0; }  // no wrapper in this build
#endif

}  // namespace cuda

#if defined(SUBLINEAR_CUDA_KERNELS)
namespace cuda {

// model/layernorm.h: x (rows..., C) fp32 with w and b (b may be undefined) fp32 (C), or all three bf16
// (a bf16 stream); y bf16, mean and rstd fp32 (rows).
struct LayerNormForward {
  torch::Tensor y, mean, rstd;
};
LayerNormForward layer_norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps);
// dy bf16 of x's sizes; (dx, dw, db in x's dtype, db undefined without the bias): a bf16 dx rounded
// once from fp32, bf16 dw and db rounded once from their fp32 sums.
std::array<torch::Tensor, 3> layer_norm_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                 const torch::Tensor& w, const torch::Tensor& mean,
                                                 const torch::Tensor& rstd, bool with_bias);

// model/residual.h: x fp32 + y bf16 (same sizes); with the bias b fp32 (C), y bf16 or fp32.
torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y);
torch::Tensor residual_add_bias(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b);
// (dy in `branch`'s dtype: bf16(g), or g itself for fp32; db fp32 (C)) from the fp32 g.
std::pair<torch::Tensor, torch::Tensor> residual_bias_backward(const torch::Tensor& g, int64_t C,
                                                               c10::ScalarType branch);

// model/gelu.h: x fp32 or bf16, b fp32 (C = x.size(-1)) or undefined; y in x's dtype.
torch::Tensor gelu_forward(const torch::Tensor& x, const torch::Tensor& b);
// g in x's dtype; (dx in x's dtype, db fp32 (C) or undefined without b).
std::pair<torch::Tensor, torch::Tensor> gelu_backward(const torch::Tensor& g, const torch::Tensor& x,
                                                      const torch::Tensor& b);

}  // namespace cuda
#endif

}  // namespace sl::model
