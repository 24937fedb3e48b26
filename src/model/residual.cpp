#include "model/residual.h"

#include <algorithm>
#include <cstdint>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "kernels/cpu/residual.h"
#include "model/cuda_fused.h"
#include "model/intra_op.h"

namespace sl::model {
namespace {

using kernels::cpu::Bf16;

constexpr int64_t kPiece = 16384;  // elements per piece a thread takes (64 KiB of fp32 output)

torch::Tensor forward_fused(const torch::Tensor& x, const torch::Tensor& y) {
  RECORD_FUNCTION("sublinear::residual_add", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::residual_add(x, y);
#endif
  auto out = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  const float* xp = x.const_data_ptr<float>();
  const auto* yp = static_cast<const Bf16*>(y.const_data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel(), pieces = (n + kPiece - 1) / kPiece;
  for_each_index(pieces, [&](int64_t p, int) {
    const int64_t i0 = p * kPiece, len = std::min(kPiece, n - i0);
    kernels::cpu::add_widened(xp + i0, yp + i0, op + i0, len);
  });
  return out;
}

// x + (y + b), y bf16 or fp32. A strided y (the checkpointing's output-free linear hands the last block
// of a recomputed segment an expanded placeholder whose values nobody reads) takes ATen's ops into the
// output itself, (y + b) then + x in place: the same bits (fp32 addition commutes), no copy of y, and
// the same backward, so the gradients do not depend on y's layout.
torch::Tensor forward_bias_fused(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b) {
  if (!y.is_contiguous()) {
    auto out = (y + b).contiguous();  // fp32 (a bf16 y is promoted), x's sizes
    return out.add_(x);
  }
  RECORD_FUNCTION("sublinear::residual_add", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::residual_add_bias(x, y, b);
#endif
  auto out = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  const float* xp = x.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool bf16 = y.scalar_type() == torch::kBFloat16;
  const auto* y16 = bf16 ? static_cast<const Bf16*>(y.const_data_ptr()) : nullptr;
  const float* y32 = bf16 ? nullptr : y.const_data_ptr<float>();
  const int64_t C = b.numel(), rows = x.numel() / C;
  for_each_row(rows, [&](int64_t r, int64_t) {
    if (bf16)
      kernels::cpu::add_widened_bias(xp + r * C, y16 + r * C, bp, op + r * C, C);
    else
      kernels::cpu::add_bias(xp + r * C, y32 + r * C, bp, op + r * C, C);
  });
  return out;
}

// (dy, db) of the bias form for a branch of dtype `branch` (bf16: dy = bf16(g); fp32: dy is g): each
// piece of rows sums into its own row of partial sums, then the pieces are summed in order.
std::pair<torch::Tensor, torch::Tensor> backward_bias_fused(const torch::Tensor& g, int64_t C,
                                                            c10::ScalarType branch) {
  RECORD_FUNCTION("sublinear::residual_add_backward", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (g.is_cuda()) return cuda::residual_bias_backward(g, C, branch);
#endif
  const auto gc = g.contiguous();
  const bool bf16 = branch == torch::kBFloat16;
  auto dy = bf16 ? torch::empty(gc.sizes(), gc.options().dtype(torch::kBFloat16)) : gc;
  const int64_t rows = gc.numel() / C;
  auto partial = torch::zeros({pieces_of(rows), C}, gc.options());
  const float* gp = gc.const_data_ptr<float>();
  auto* dy16 = bf16 ? static_cast<Bf16*>(dy.data_ptr()) : nullptr;
  float* pp = partial.data_ptr<float>();
  for_each_row(rows, [&](int64_t r, int64_t c) {
    if (bf16)
      kernels::cpu::narrow_and_sum(gp + r * C, dy16 + r * C, pp + c * C, C);
    else
      kernels::cpu::sum_rows(gp + r * C, pp + c * C, C);
  });
  return {dy, sum_pieces(partial)};
}

void no_double_backward() {
  TORCH_CHECK(!torch::GradMode::is_enabled(), "residual_add: double backward is not supported by the fused form");
}

struct ResidualAddFunction : torch::autograd::Function<ResidualAddFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, const torch::Tensor& y) {
    return forward_fused(x, y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& g = grads[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor()};
    no_double_backward();
    // ATen's add gives g to both inputs; autograd then rounds y's to y's dtype (bf16, to nearest even).
    const bool dy = ctx->needs_input_grad(1);
    return {ctx->needs_input_grad(0) ? g : torch::Tensor(), dy ? g.to(torch::kBFloat16) : torch::Tensor()};
  }
};

struct ResidualAddBiasFunction : torch::autograd::Function<ResidualAddBiasFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& b) {
    ctx->saved_data["bf16"] = y.scalar_type() == torch::kBFloat16;
    return forward_bias_fused(x, y, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& g = grads[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    no_double_backward();
    const auto branch = ctx->saved_data["bf16"].toBool() ? torch::kBFloat16 : torch::kFloat32;
    auto [dy, db] = backward_bias_fused(g, g.size(-1), branch);
    return {ctx->needs_input_grad(0) ? g : torch::Tensor(), ctx->needs_input_grad(1) ? dy : torch::Tensor(),
            ctx->needs_input_grad(2) ? db : torch::Tensor()};
  }
};

// A contiguous tensor on a device the fused kernels run on (the CPU; CUDA in a build with them).
bool kernel_contiguous(const torch::Tensor& t) {
  return t.defined() && fused_kernel_device(t.device()) && t.layout() == torch::kStrided && t.is_contiguous();
}

// b fits the fused pass's bias for a stream like x: an fp32 vector of x's last size on x's device.
bool bias_fits(const torch::Tensor& x, const torch::Tensor& b) {
  return kernel_contiguous(b) && b.device() == x.device() && b.scalar_type() == torch::kFloat32 && b.dim() == 1 &&
         x.dim() >= 1 && b.size(0) == x.size(-1) && b.numel() > 0;
}

// The bias form takes x, y, b: an fp32 contiguous x, a bf16 or fp32 y of x's sizes on its device
// (strided or not), an fp32 bias of x's width.
bool bias_form_takes(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b) {
  return device::fused_kernels() && kernel_contiguous(x) && x.scalar_type() == torch::kFloat32 && y.defined() &&
         y.device() == x.device() && y.layout() == torch::kStrided &&
         (y.scalar_type() == torch::kBFloat16 || y.scalar_type() == torch::kFloat32) && x.sizes() == y.sizes() &&
         bias_fits(x, b);
}

}  // namespace

bool residual_add_fused(const torch::Tensor& x, const torch::Tensor& y) {
  return device::fused_kernels() && kernel_contiguous(x) && kernel_contiguous(y) && y.device() == x.device() &&
         x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kBFloat16 && x.sizes() == y.sizes();
}

bool residual_bias_fused(const torch::Tensor& x, const torch::Tensor& b) {
  if (!device::fused_kernels() || !kernel_contiguous(x) || x.scalar_type() != torch::kFloat32 || !bias_fits(x, b))
    return false;
  // The branch is bf16 under bf16 autocast of x's device (CPU or CUDA), fp32 without autocast (x fp32);
  // fp16 autocast keeps ATen's.
  const auto device = x.device().type();
  return !at::autocast::is_autocast_enabled(device) || at::autocast::get_autocast_dtype(device) == at::kBFloat16;
}

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b) {
  const bool grad = torch::GradMode::is_enabled() && (x.requires_grad() || y.requires_grad() ||
                                                      (b.defined() && b.requires_grad()));
  if (b.defined()) {
    if (!bias_form_takes(x, y, b)) return x + (y + b);
    return grad ? ResidualAddBiasFunction::apply(x, y, b) : forward_bias_fused(x, y, b);
  }
  if (!residual_add_fused(x, y)) return x + y;
  return grad ? ResidualAddFunction::apply(x, y) : forward_fused(x, y);
}

}  // namespace sl::model
