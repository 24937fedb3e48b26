#include "model/gelu.h"

#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "kernels/cpu/gelu.h"
#include "model/cuda_fused.h"
#include "model/intra_op.h"

namespace sl::model {
namespace {

using kernels::cpu::gelu_backward_row;
using kernels::cpu::gelu_forward_row;

// Runs fn(T{}) for x's element type T as the row kernels (kernels/cpu/gelu.h) take it: float, or
// kernels::cpu::Bf16 for bf16 (c10::BFloat16's layout; the kernels take no other).
template <class Fn>
void on_element(const torch::Tensor& x, Fn fn) {
  if (x.scalar_type() == torch::kBFloat16) return fn(kernels::cpu::Bf16{});
  TORCH_INTERNAL_ASSERT(x.scalar_type() == torch::kFloat32);
  fn(float{});
}

void no_double_backward() {
  TORCH_CHECK(!torch::GradMode::is_enabled(), "gelu_tanh: double backward is not supported");
}

torch::Tensor forward_fused(const torch::Tensor& x) {
  RECORD_FUNCTION("sublinear::gelu_tanh", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::gelu_forward(x, torch::Tensor());
#endif
  auto y = torch::empty_like(x);
  on_element(x, [&](auto t) {
    using T = decltype(t);
    for_each_piece({y}, {x}, /*grain=*/1 << 14, [](char** p, int64_t n) {
      gelu_forward_row(reinterpret_cast<const T*>(p[1]), nullptr, reinterpret_cast<T*>(p[0]), n);
    });
  });
  return y;
}

torch::Tensor backward_fused(const torch::Tensor& g, const torch::Tensor& x) {
  RECORD_FUNCTION("sublinear::gelu_tanh_backward", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::gelu_backward(g.to(x.scalar_type()).contiguous(), x, torch::Tensor()).first;
#endif
  auto dx = torch::empty_like(x);
  on_element(x, [&](auto t) {
    using T = decltype(t);
    for_each_piece({dx}, {g.to(x.scalar_type()).contiguous(), x}, /*grain=*/1 << 14, [](char** p, int64_t n) {
      gelu_backward_row(reinterpret_cast<const T*>(p[1]), reinterpret_cast<const T*>(p[2]), nullptr,
                        reinterpret_cast<T*>(p[0]), nullptr, n);
    });
  });
  return dx;
}

// The bias form works on row pieces of x seen as (rows, H) (intra_op.h), with the bias in fp32 (a
// bf16 bias widened: H floats).

torch::Tensor forward_bias_fused(const torch::Tensor& x, const torch::Tensor& b) {
  RECORD_FUNCTION("sublinear::gelu_tanh", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::gelu_forward(x, b.to(torch::kFloat32).contiguous());
#endif
  auto y = torch::empty_like(x);
  const auto b32 = b.to(torch::kFloat32);
  const int64_t H = b.numel(), rows = x.numel() / H;
  const float* Bp = b32.data_ptr<float>();
  on_element(x, [&](auto t) {
    using T = decltype(t);
    const auto* X = static_cast<const T*>(x.const_data_ptr());
    auto* Y = static_cast<T*>(y.data_ptr());
    for_each_row(rows, [&](int64_t r, int64_t) { gelu_forward_row(X + r * H, Bp, Y + r * H, H); });
  });
  return y;
}

// (dx, db): db sums the fp32 dx over rows, each piece into its own row of fp32 partial sums, then the
// pieces in order, so the bits depend on neither the thread count nor the split; db takes b's dtype.
std::tuple<torch::Tensor, torch::Tensor> backward_bias_fused(const torch::Tensor& g, const torch::Tensor& x,
                                                             const torch::Tensor& b) {
  RECORD_FUNCTION("sublinear::gelu_tanh_backward", std::vector<c10::IValue>{});
  const auto gc = g.to(x.scalar_type()).contiguous(), b32 = b.to(torch::kFloat32);
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) {
    auto [dx, db] = cuda::gelu_backward(gc, x, b32.contiguous());
    return {dx, db.to(b.scalar_type())};
  }
#endif
  auto dx = torch::empty_like(x);
  const int64_t H = b.numel(), rows = x.numel() / H;
  auto partial = torch::zeros({pieces_of(rows), H}, b32.options());
  const float* Bp = b32.data_ptr<float>();
  float* P = partial.data_ptr<float>();
  on_element(x, [&](auto t) {
    using T = decltype(t);
    const auto *G = static_cast<const T*>(gc.const_data_ptr()), *X = static_cast<const T*>(x.const_data_ptr());
    auto* DX = static_cast<T*>(dx.data_ptr());
    for_each_row(rows, [&](int64_t r, int64_t c) {
      gelu_backward_row(G + r * H, X + r * H, Bp, DX + r * H, P + c * H, H);
    });
  });
  return {dx, sum_pieces(partial).to(b.scalar_type())};
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
    no_double_backward();
    return {backward_fused(grads[0], x)};
  }
};

struct GeluTanhBiasFunction : torch::autograd::Function<GeluTanhBiasFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& b) {
    ctx->save_for_backward({x, b});
    return forward_bias_fused(x, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    no_double_backward();
    auto [dx, db] = backward_bias_fused(grads[0], s[0], s[1]);
    return {dx, db};
  }
};

// A strided tensor on a device the fused kernels run on (the CPU; CUDA in a build with them).
bool kernel_strided(const torch::Tensor& t) {
  return t.defined() && fused_kernel_device(t.device()) && t.layout() == torch::kStrided;
}

bool kernel_dtype(c10::ScalarType t) { return t == torch::kFloat32 || t == torch::kBFloat16; }

// The bias form takes activations of dtype `act` with the bias b: fp32 with an fp32 b; bf16 with an fp32
// or a bf16 b.
bool bias_kernel_takes(c10::ScalarType act, const torch::Tensor& b) {
  if (!kernel_strided(b) || b.dim() != 1 || b.numel() == 0) return false;
  if (act == torch::kBFloat16) return kernel_dtype(b.scalar_type());
  return act == torch::kFloat32 && b.scalar_type() == torch::kFloat32;
}

// The dtype of what a linear makes from `like` (on the CPU or CUDA): the autocast dtype of like's
// device while its autocast is on (it casts fp32, bf16 and fp16 operands), else like's own.
c10::ScalarType linear_output_dtype(const torch::Tensor& like) {
  const auto t = like.scalar_type();
  const auto device = like.device().type();
  const bool cast = t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kHalf;
  return cast && at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : t;
}

}  // namespace

bool gelu_tanh_fused(const torch::Tensor& x) {
  return device::fused_kernels() && kernel_strided(x) && kernel_dtype(x.scalar_type()) && x.is_contiguous();
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!gelu_tanh_fused(x)) return at::gelu(x, "tanh");
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return forward_fused(x);
  return GeluTanhFunction::apply(x);
}

bool gelu_tanh_bias_fused(const torch::Tensor& like, const torch::Tensor& b) {
  return device::fused_kernels() && kernel_strided(like) && b.defined() && b.device() == like.device() &&
         bias_kernel_takes(linear_output_dtype(like), b);
}

torch::Tensor gelu_tanh_bias(const torch::Tensor& x, const torch::Tensor& b) {
  TORCH_CHECK(kernel_strided(x) && bias_kernel_takes(x.scalar_type(), b) && b.device() == x.device() && x.dim() >= 1 &&
                  x.size(-1) == b.size(0),
              "gelu_tanh_bias: x (..., H) must be an fp32 or bf16 CPU (or CUDA) tensor and b (H) fp32, or bf16 with a "
              "bf16 x, on x's device");
  const auto xc = x.contiguous(), bc = b.contiguous();
  if (!torch::GradMode::is_enabled() || !(x.requires_grad() || b.requires_grad())) return forward_bias_fused(xc, bc);
  return GeluTanhBiasFunction::apply(xc, bc);
}

}  // namespace sl::model
