// The fused kernels' CUDA wrappers (model/cuda_fused.h; kernels: src/kernels/cuda/cuda_kernels.h). Built
// only with SUBLINEAR_CUDA_KERNELS.
//
// Streams and buffers: every launch goes to the current CUDA stream of the operands' device (a
// CUDAGuard makes that device current for the call). Outputs and the (pieces, C) partial sums are ATen
// allocations made on this thread before the launches, so the caching allocator ties them to that
// stream: a scratch tensor freed when the wrapper returns is reused only by work queued after these
// kernels on the same stream, and by another stream only after the allocator's own event waits.
// Nothing here synchronizes with the host. The callers name the ops for the profiler (RECORD_FUNCTION).
#include "model/cuda_fused.h"

#include <atomic>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include "kernels/cuda/cuda_kernels.h"

namespace sl::model::cuda {
namespace {

std::array<std::atomic<int64_t>, static_cast<size_t>(Kernel::count)> g_launches{};

// One more call of wrapper k (after its checks passed).
void counted(Kernel k) { g_launches[static_cast<size_t>(k)].fetch_add(1, std::memory_order_relaxed); }

kernels::Stream stream_of(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// `t` is a contiguous CUDA tensor of dtype `dtype` on `device`.
void require(const torch::Tensor& t, const torch::Device& device, c10::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == device && t.is_contiguous() && t.scalar_type() == dtype,
              "fused CUDA kernel: ", what, " must be a contiguous ", c10::toString(dtype), " tensor on ", device);
}

// A (C) vector of `dtype` on `device`.
void require_vector(const torch::Tensor& v, const torch::Device& device, int64_t C, c10::ScalarType dtype,
                    const char* what) {
  require(v, device, dtype, what);
  TORCH_CHECK(v.dim() == 1 && v.size(0) == C, "fused CUDA kernel: ", what, " must have ", C, " elements");
}
void require_vector(const torch::Tensor& v, const torch::Device& device, int64_t C, const char* what) {
  require_vector(v, device, C, torch::kFloat32, what);
}

const kernels::Bf16* bf16_in(const torch::Tensor& t) {
  return reinterpret_cast<const kernels::Bf16*>(t.const_data_ptr<c10::BFloat16>());
}
kernels::Bf16* bf16_out(torch::Tensor& t) { return reinterpret_cast<kernels::Bf16*>(t.data_ptr<c10::BFloat16>()); }

// The (C) column sums of a (pieces, C) partial-sums tensor, pieces in order.
torch::Tensor sum_pieces(const torch::Tensor& part, kernels::Stream stream) {
  auto out = torch::empty({part.size(1)}, part.options());
  kernels::sum_pieces(part.const_data_ptr<float>(), part.size(0), part.size(1), out.data_ptr<float>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The norm's stream dtype: x a contiguous fp32 or bf16 CUDA tensor (its w and b of the same dtype).
c10::ScalarType stream_dtype(const torch::Tensor& x) {
  const auto dtype = x.scalar_type() == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
  require(x, x.device(), dtype, "the norm's input");
  return dtype;
}

// The kernels' raw pointer to an fp32 or bf16 tensor's data.
const void* data_in(const torch::Tensor& t) { return t.const_data_ptr(); }

}  // namespace

int64_t launches(Kernel k) { return g_launches[static_cast<size_t>(k)].load(std::memory_order_relaxed); }

LayerNormForward layer_norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                    double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dtype = stream_dtype(x);
  const int64_t C = x.size(-1), rows = x.numel() / C;
  require_vector(w, x.device(), C, dtype, "the norm's weight");
  if (b.defined()) require_vector(b, x.device(), C, dtype, "the norm's bias");
  const auto fp32 = x.options().dtype(torch::kFloat32);
  LayerNormForward f{torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16)), torch::empty({rows}, fp32),
                     torch::empty({rows}, fp32)};
  const float e = static_cast<float>(eps);
  if (dtype == torch::kBFloat16)
    kernels::layer_norm_forward(bf16_in(x), bf16_in(w), b.defined() ? bf16_in(b) : nullptr, e, rows, C, bf16_out(f.y),
                                f.mean.data_ptr<float>(), f.rstd.data_ptr<float>(), stream_of(x));
  else
    kernels::layer_norm_forward(x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                                b.defined() ? b.const_data_ptr<float>() : nullptr, e, rows, C, bf16_out(f.y),
                                f.mean.data_ptr<float>(), f.rstd.data_ptr<float>(), stream_of(x));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::layer_norm_forward);
  return f;
}

std::array<torch::Tensor, 3> layer_norm_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                 const torch::Tensor& w, const torch::Tensor& mean,
                                                 const torch::Tensor& rstd, bool with_bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dtype = stream_dtype(x);
  require(dy, x.device(), torch::kBFloat16, "the norm's output gradient");
  const int64_t C = x.size(-1), rows = x.numel() / C, pieces = kernels::row_pieces(rows);
  require_vector(w, x.device(), C, dtype, "the norm's weight");
  require(mean, x.device(), torch::kFloat32, "the norm's saved mean");
  require(rstd, x.device(), torch::kFloat32, "the norm's saved rstd");
  const auto stream = stream_of(x);
  const auto fp32 = x.options().dtype(torch::kFloat32);
  auto dx = torch::empty_like(x);
  auto dw_part = torch::empty({pieces, C}, fp32);
  auto db_part = with_bias ? torch::empty({pieces, C}, fp32) : torch::Tensor();
  float* db = with_bias ? db_part.data_ptr<float>() : nullptr;
  if (dtype == torch::kBFloat16)
    kernels::layer_norm_backward(bf16_in(dy), bf16_in(x), bf16_in(w), mean.const_data_ptr<float>(),
                                 rstd.const_data_ptr<float>(), rows, C, bf16_out(dx), dw_part.data_ptr<float>(), db,
                                 stream);
  else
    kernels::layer_norm_backward(bf16_in(dy), x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                                 mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(), rows, C,
                                 dx.data_ptr<float>(), dw_part.data_ptr<float>(), db, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::layer_norm_backward);
  // dw, db: the fp32 sums of the pieces, rounded once into the weights' dtype (a no-op for fp32).
  auto dw = sum_pieces(dw_part, stream).to(dtype);
  auto db_sum = with_bias ? sum_pieces(db_part, stream).to(dtype) : torch::Tensor();
  return {dx, dw, db_sum};
}

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  require(x, x.device(), torch::kFloat32, "the residual stream");
  require(y, x.device(), torch::kBFloat16, "the residual branch");
  TORCH_CHECK(x.sizes() == y.sizes(), "fused CUDA residual add: the stream and the branch differ in size");
  auto out = torch::empty_like(x);
  kernels::residual_add(x.const_data_ptr<float>(), bf16_in(y), out.data_ptr<float>(), x.numel(), stream_of(x));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::residual_add);
  return out;
}

torch::Tensor residual_add_bias(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& b) {
  const c10::cuda::CUDAGuard guard(x.device());
  require(x, x.device(), torch::kFloat32, "the residual stream");
  const bool bf16 = y.scalar_type() == torch::kBFloat16;
  require(y, x.device(), bf16 ? torch::kBFloat16 : torch::kFloat32, "the residual branch");
  TORCH_CHECK(x.sizes() == y.sizes(), "fused CUDA residual add: the stream and the branch differ in size");
  const int64_t C = x.size(-1), rows = x.numel() / C;
  require_vector(b, x.device(), C, "the branch's bias");
  auto out = torch::empty_like(x);
  kernels::residual_add_bias(x.const_data_ptr<float>(), bf16 ? bf16_in(y) : nullptr,
                             bf16 ? nullptr : y.const_data_ptr<float>(), b.const_data_ptr<float>(),
                             out.data_ptr<float>(), rows, C, stream_of(x));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::residual_add_bias);
  return out;
}

std::pair<torch::Tensor, torch::Tensor> residual_bias_backward(const torch::Tensor& g, int64_t C,
                                                               c10::ScalarType branch) {
  const c10::cuda::CUDAGuard guard(g.device());
  const auto gc = g.contiguous();
  require(gc, gc.device(), torch::kFloat32, "the residual gradient");
  const bool bf16 = branch == torch::kBFloat16;
  const int64_t rows = gc.numel() / C;
  const auto stream = stream_of(gc);
  auto dy = bf16 ? torch::empty(gc.sizes(), gc.options().dtype(torch::kBFloat16)) : gc;
  auto part = torch::empty({kernels::row_pieces(rows), C}, gc.options());
  kernels::residual_bias_backward(gc.const_data_ptr<float>(), bf16 ? bf16_out(dy) : nullptr, part.data_ptr<float>(),
                                  rows, C, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::residual_bias_backward);
  return {dy, sum_pieces(part, stream)};
}

torch::Tensor gelu_forward(const torch::Tensor& x, const torch::Tensor& b) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  require(x, x.device(), bf16 ? torch::kBFloat16 : torch::kFloat32, "the GELU's input");
  const int64_t C = x.dim() == 0 ? 1 : x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
  if (b.defined()) require_vector(b, x.device(), C, "the GELU's bias");
  auto y = torch::empty_like(x);
  kernels::gelu_forward(data_in(x), bf16, b.defined() ? b.const_data_ptr<float>() : nullptr, y.data_ptr(), rows, C,
                        stream_of(x));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::gelu_forward);
  return y;
}

std::pair<torch::Tensor, torch::Tensor> gelu_backward(const torch::Tensor& g, const torch::Tensor& x,
                                                      const torch::Tensor& b) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  require(x, x.device(), bf16 ? torch::kBFloat16 : torch::kFloat32, "the GELU's input");
  require(g, x.device(), x.scalar_type(), "the GELU's output gradient");
  TORCH_CHECK(g.sizes() == x.sizes(), "fused CUDA GELU: the gradient and the input differ in size");
  const int64_t C = x.dim() == 0 ? 1 : x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
  const auto stream = stream_of(x);
  auto dx = torch::empty_like(x);
  torch::Tensor part;
  if (b.defined()) {
    require_vector(b, x.device(), C, "the GELU's bias");
    part = torch::empty({kernels::row_pieces(rows), C}, x.options().dtype(torch::kFloat32));
  }
  kernels::gelu_backward(data_in(g), data_in(x), bf16, b.defined() ? b.const_data_ptr<float>() : nullptr, dx.data_ptr(),
                         b.defined() ? part.data_ptr<float>() : nullptr, rows, C, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  counted(Kernel::gelu_backward);
  return {dx, b.defined() ? sum_pieces(part, stream) : torch::Tensor()};
}

}  // namespace sl::model::cuda
