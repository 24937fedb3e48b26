#include "model/gelu.h"
#include "model/fast_exp.h"

#include <array>
#include <cstdint>

#include <ATen/TensorIterator.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

namespace sl::model {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

// sigmoid(2 z(x)) = 0.5 (1 + tanh z(x)).
inline float gate(float x) {
  const float z = kSqrt2OverPi * (x + kCubic * x * x * x);
  return 1.0f / (1.0f + exp_approx(-2.0f * z));
}

// One clone per instruction set, picked when the library loads (GCC function multi-versioning):
// AVX2 + FMA (x86-64-v3) where the CPU has them, baseline x86-64 elsewhere.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void forward_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * gate(x[i]);
}

// d/dx [x s] with s = sigmoid(2 z): s + x s (1 - s) 2 z', z' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
__attribute__((target_clones("arch=x86-64-v3", "default"))) void backward_kernel(const float* g, const float* x,
                                                                                   float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i], s = gate(v);
    const float dz = kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = g[i] * (s + v * s * (1.0f - s) * 2.0f * dz);
  }
}

// Runs kernel(out, in...) over contiguous fp32 tensors through a TensorIterator: its for_each
// splits the elements over ATen's intra-op threads (inside libtorch, whose OpenMP this file need not
// be built with). Each element is computed on its own, so the split and thread count change nothing.
template <class Kernel>
void elementwise(const torch::Tensor& out, std::initializer_list<torch::Tensor> in, Kernel kernel) {
  at::TensorIteratorConfig config;
  config.add_output(out);
  for (const auto& t : in) config.add_const_input(t);
  auto iter = config.check_all_same_dtype(true).build();
  const int nt = iter.ntensors();
  iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    for (int64_t j = 0; j < size1; ++j) {
      std::array<char*, 3> ptrs{};
      for (int k = 0; k < nt; ++k) ptrs[k] = data[k] + j * strides[nt + k];
      kernel(ptrs, size0);  // the operands are contiguous: inner strides of sizeof(float)
    }
  }, /*grain_size=*/1 << 14);
}

torch::Tensor forward_fused(const torch::Tensor& x) {
  RECORD_FUNCTION("sublinear::gelu_tanh", std::vector<c10::IValue>{});
  auto y = torch::empty_like(x);
  elementwise(y, {x}, [](const std::array<char*, 3>& p, int64_t n) {
    forward_kernel(reinterpret_cast<const float*>(p[1]), reinterpret_cast<float*>(p[0]), n);
  });
  return y;
}

torch::Tensor backward_fused(const torch::Tensor& g, const torch::Tensor& x) {
  RECORD_FUNCTION("sublinear::gelu_tanh_backward", std::vector<c10::IValue>{});
  auto dx = torch::empty_like(x);
  elementwise(dx, {g.contiguous(), x}, [](const std::array<char*, 3>& p, int64_t n) {
    backward_kernel(reinterpret_cast<const float*>(p[1]), reinterpret_cast<const float*>(p[2]),
                    reinterpret_cast<float*>(p[0]), n);
  });
  return dx;
}

struct GeluTanhFunction : torch::autograd::Function<GeluTanhFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->save_for_backward({x});
    return forward_fused(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {torch::Tensor()};
    return {backward_fused(grads[0], x)};
  }
};

}  // namespace

bool gelu_tanh_fused(const torch::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.layout() == torch::kStrided;
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!gelu_tanh_fused(x)) return at::gelu(x, "tanh");
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return forward_fused(x);
  return GeluTanhFunction::apply(x);
}

}  // namespace sl::model
