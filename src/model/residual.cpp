#include "model/residual.h"

#include <algorithm>
#include <cstdint>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "model/bf16.h"
#include "model/clones.h"
#include "model/intra_op.h"

namespace sl::model {
namespace {

constexpr int64_t kPiece = 16384;  // elements per piece a thread takes (64 KiB of fp32 output)

// out[i] = x[i] + widen(y[i]): the AVX2 clone's loop vectorizes (widening is a shift).
SL_KERNEL_BODY void add_widened_body(const float* x, const c10::BFloat16* y, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + widen(y[i]);
}
SL_KERNEL_CLONES(void, add_widened, (const float* x, const c10::BFloat16* y, float* out, int64_t n), (x, y, out, n))

torch::Tensor forward_fused(const torch::Tensor& x, const torch::Tensor& y) {
  RECORD_FUNCTION("sublinear::residual_add", std::vector<c10::IValue>{});
  auto out = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  const float* xp = x.const_data_ptr<float>();
  const auto* yp = y.const_data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel(), pieces = (n + kPiece - 1) / kPiece;
  for_each_index(pieces, [&](int64_t p, int) {
    const int64_t i0 = p * kPiece, len = std::min(kPiece, n - i0);
    add_widened(xp + i0, yp + i0, op + i0, len);
  });
  return out;
}

struct ResidualAddFunction : torch::autograd::Function<ResidualAddFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, const torch::Tensor& y) {
    return forward_fused(x, y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& g = grads[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor()};
    TORCH_CHECK(!torch::GradMode::is_enabled(), "residual_add: double backward is not supported by the fused form");
    // ATen's add gives g to both inputs; autograd then rounds y's to y's dtype (bf16, to nearest even).
    const bool dy = ctx->needs_input_grad(1);
    return {ctx->needs_input_grad(0) ? g : torch::Tensor(), dy ? g.to(torch::kBFloat16) : torch::Tensor()};
  }
};

bool cpu_contiguous(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == torch::kStrided && t.is_contiguous();
}

}  // namespace

bool residual_add_fused(const torch::Tensor& x, const torch::Tensor& y) {
  return device::fused_kernels() && cpu_contiguous(x) && cpu_contiguous(y) && x.scalar_type() == torch::kFloat32 &&
         y.scalar_type() == torch::kBFloat16 && x.sizes() == y.sizes();
}

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y) {
  if (!residual_add_fused(x, y)) return x + y;
  if (!torch::GradMode::is_enabled() || !(x.requires_grad() || y.requires_grad())) return forward_fused(x, y);
  return ResidualAddFunction::apply(x, y);
}

}  // namespace sl::model
