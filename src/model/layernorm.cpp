#include "model/layernorm.h"

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "kernels/cpu/layernorm.h"
#include "model/cuda_fused.h"
#include "model/intra_op.h"

namespace sl::model {
namespace {

// x seen as (rows, C), row pieces on ATen's intra-op threads (intra_op.h), each row through the row
// kernels (kernels/cpu/layernorm.h).

struct Forward {
  torch::Tensor y, mean, rstd;  // y bf16 (x's sizes), mean and rstd fp32 (rows)
};

Forward forward_fused(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
  RECORD_FUNCTION("sublinear::layer_norm", std::vector<c10::IValue>{});
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) {
    auto c = cuda::layer_norm_forward(x, w, b, eps);
    return {c.y, c.mean, c.rstd};
  }
#endif
  const int64_t C = x.size(-1), rows = x.numel() / C;
  Forward f{torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16)), torch::empty({rows}, x.options()),
            torch::empty({rows}, x.options())};
  const float *X = x.const_data_ptr<float>(), *W = w.const_data_ptr<float>();
  const float* B = b.defined() ? b.const_data_ptr<float>() : nullptr;
  auto* Y = static_cast<kernels::cpu::Bf16*>(f.y.data_ptr());
  float *M = f.mean.data_ptr<float>(), *R = f.rstd.data_ptr<float>();
  const auto e = static_cast<float>(eps);
  for_each_row(rows, [&](int64_t r, int64_t) {
    kernels::cpu::layer_norm_forward_row(X + r * C, W, B, e, C, Y + r * C, M + r, R + r);
  });
  return f;
}

// (dx, dw, db): db undefined when there is no bias.
std::array<torch::Tensor, 3> backward_fused(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w,
                                            const torch::Tensor& mean, const torch::Tensor& rstd, bool with_bias) {
  RECORD_FUNCTION("sublinear::layer_norm_backward", std::vector<c10::IValue>{});
  const auto g = dy.to(torch::kBFloat16).contiguous();
#if defined(SUBLINEAR_CUDA_KERNELS)
  if (x.is_cuda()) return cuda::layer_norm_backward(g, x, w, mean, rstd, with_bias);
#endif
  const int64_t C = x.size(-1), rows = x.numel() / C, pieces = pieces_of(rows);
  auto dx = torch::empty_like(x);
  auto dw_part = torch::zeros({pieces, C}, x.options());
  auto db_part = with_bias ? torch::zeros({pieces, C}, x.options()) : torch::Tensor();
  const auto* G = static_cast<const kernels::cpu::Bf16*>(g.const_data_ptr());
  const float *X = x.const_data_ptr<float>(), *W = w.const_data_ptr<float>();
  const float *M = mean.const_data_ptr<float>(), *R = rstd.const_data_ptr<float>();
  float *DX = dx.data_ptr<float>(), *DW = dw_part.data_ptr<float>();
  float* DB = with_bias ? db_part.data_ptr<float>() : nullptr;
  for_each_row(rows, [&](int64_t r, int64_t c) {
    kernels::cpu::layer_norm_backward_row(G + r * C, X + r * C, W, M[r], R[r], C, DX + r * C, DW + c * C,
                                          DB ? DB + c * C : nullptr);
  });
  return {dx, sum_pieces(dw_part), with_bias ? sum_pieces(db_part) : torch::Tensor()};
}

// The bias, when there is one, comes as a one-element list, and its gradient is returned only then.
struct LayerNormBf16Function : torch::autograd::Function<LayerNormBf16Function> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               at::TensorList b, double eps) {
    auto f = forward_fused(x, w, b.empty() ? torch::Tensor() : b[0], eps);
    ctx->save_for_backward({x, w, f.mean, f.rstd});
    ctx->saved_data["bias"] = !b.empty();
    return f.y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool with_bias = ctx->saved_data["bias"].toBool();
    torch::autograd::variable_list out(with_bias ? 4 : 3);  // x, w, b?, eps
    if (!grads[0].defined()) return out;
    TORCH_CHECK(!torch::GradMode::is_enabled(), "layer_norm_bf16: double backward is not supported");
    auto [dx, dw, db] = backward_fused(grads[0], s[0], s[1], s[2], s[3], with_bias);
    if (ctx->needs_input_grad(0)) out[0] = dx;
    if (ctx->needs_input_grad(1)) out[1] = dw;
    if (with_bias && ctx->needs_input_grad(2)) out[2] = db;
    return out;
  }
};

// A contiguous tensor of `dtype` on a device the fused kernels run on (the CPU; CUDA in a build with them).
bool contiguous_of(const torch::Tensor& t, c10::ScalarType dtype) {
  return t.defined() && fused_kernel_device(t.device()) && t.layout() == torch::kStrided && t.is_contiguous() &&
         t.scalar_type() == dtype;
}

// The stream dtypes the kernels take for x: fp32 anywhere, bf16 (a bf16 compute copy's stream, with
// bf16 w and b) on CUDA only.
bool stream_of_kernels(const torch::Tensor& x) {
  return contiguous_of(x, torch::kFloat32) || (x.is_cuda() && contiguous_of(x, torch::kBFloat16));
}

// A norm parameter for x: a vector of C in x's dtype on x's device.
bool vector_of(const torch::Tensor& v, const torch::Tensor& x) {
  return contiguous_of(v, x.scalar_type()) && v.device() == x.device() && v.dim() == 1 && v.size(0) == x.size(-1);
}

}  // namespace

bool layer_norm_bf16_fused(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  if (!device::fused_kernels() || !x.defined() || !stream_of_kernels(x) || x.dim() < 1 || x.size(-1) == 0) return false;
  const auto autocast = x.device().type();  // CPU autocast for a CPU x, CUDA autocast for a CUDA one
  if (!at::autocast::is_autocast_enabled(autocast) || at::autocast::get_autocast_dtype(autocast) != at::kBFloat16)
    return false;
  return vector_of(w, x) && (!b.defined() || vector_of(b, x));
}

torch::Tensor layer_norm_bf16(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
  TORCH_CHECK(
      x.defined() && stream_of_kernels(x) && x.dim() >= 1 && vector_of(w, x) && (!b.defined() || vector_of(b, x)),
      "layer_norm_bf16: x (..., C) must be a contiguous fp32 CPU (or fp32 or bf16 CUDA) tensor and w, b "
      "vectors of C in its dtype on its device");
  const bool grad = torch::GradMode::is_enabled() &&
                    (x.requires_grad() || w.requires_grad() || (b.defined() && b.requires_grad()));
  if (!grad) return forward_fused(x, w, b, eps).y;
  std::vector<torch::Tensor> bias;
  if (b.defined()) bias.push_back(b);
  return LayerNormBf16Function::apply(x, w, at::TensorList(bias), eps);
}

}  // namespace sl::model
