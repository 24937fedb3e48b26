// The widened linear (see linear.h): compute-dtype operands, fp32 GEMMs a chunk of rows at a time.
#include "model/linear.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include "device/cpu_features.h"

namespace sl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool is_lowp(c10::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The CPU's libraries take dt's matmuls to ATen's fallback GEMM or oneDNN's emulated one, and the
// fused kernels are on.
bool widens(c10::ScalarType dt) {
  if (!is_lowp(dt)) return false;
  return device::cpu_features().linear_path(dt == at::kBFloat16 ? config::Dtype::kBf16 : config::Dtype::kFp16) ==
         device::LowpMatmul::widened;
}

// The GEMMs below take fp32 tensors on purpose: autocast must not cast them back (the linear's
// forward runs inside the model's autocast region).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// Rows of t (2-d, or 1-d as one row) rounded to dt, as autocast's cast rounds them, and written to out
// (fp32, exact), about 64K elements at a time: no dt copy of the whole tensor is made.
void round_rows_into(const at::Tensor& out, const at::Tensor& t, c10::ScalarType dt) {
  if (t.dim() < 2) return void(out.copy_(t.to(dt)));
  const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, t.size(1)));
  for (int64_t r0 = 0; r0 < t.size(0); r0 += rows) {
    const int64_t r = std::min(rows, t.size(0) - r0);
    out.narrow(0, r0, r).copy_(t.narrow(0, r0, r).to(dt));
  }
}

// t rounded to dt and held in fp32: a widened GEMM's operand.
at::Tensor rounded_fp32(const at::Tensor& t, c10::ScalarType dt) {
  if (t.scalar_type() == dt) return t.to(at::kFloat);
  auto out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  round_rows_into(out, t, dt);
  return out;
}

// f(first_row, rows) for each chunk of `chunk` rows of an M-row product, in order.
template <class F>
void for_chunks(int64_t M, int64_t chunk, F&& f) {
  for (int64_t r0 = 0; r0 < M; r0 += chunk) f(r0, std::min(chunk, M - r0));
}

// out (M, N, in dt) = a2 (M, K, in dt) B (K, N, fp32) [+ bias (N, fp32), added before the one rounding].
void rows_times(const at::Tensor& out, const at::Tensor& a2, const at::Tensor& B, const at::Tensor& bias,
                int64_t chunk) {
  const int64_t M = a2.size(0), K = a2.size(1), N = B.size(1);
  const auto f32 = a2.options().dtype(at::kFloat);
  auto af = at::empty({std::min(chunk, M), K}, f32), yf = at::empty({std::min(chunk, M), N}, f32);
  for_chunks(M, chunk, [&](int64_t r0, int64_t r) {
    auto a = af.narrow(0, 0, r), y = yf.narrow(0, 0, r);
    a.copy_(a2.narrow(0, r0, r));
    if (bias.defined()) at::addmm_out(y, bias, a, B);
    else at::mm_out(y, a, B);
    out.narrow(0, r0, r).copy_(y);
  });
}

// A linear's two gradients from one pass over the output gradient gy2 (M, N, in dt), each only where
// wanted: dW = gy2^T a2 (N, K; a2 rounded to dt a chunk at a time), summed in fp32 over the chunks in
// order and rounded once to dt in place (fp32 values that dt represents exactly); dx = gy2 Wr (M, K in
// dt; Wr: W rounded into fp32). A chunk's gy2 rows are widened once for both; dx's rows reuse a2's
// scratch once dW has read it. The same GEMMs on the same chunks as linear_weight_grad and mm
// alone, so either way gives the same bits.
struct LinearGradients {
  at::Tensor dx, dW;
};
LinearGradients widened_gradients(const at::Tensor& gy2, const at::Tensor& a2, const at::Tensor& Wr, int64_t K,
                                  int64_t chunk) {
  const auto dt = gy2.scalar_type();
  const int64_t M = gy2.size(0), N = gy2.size(1);
  const auto f32 = gy2.options().dtype(at::kFloat);
  LinearGradients out;
  if (a2.defined()) out.dW = M == 0 ? at::zeros({N, K}, f32) : at::empty({N, K}, f32);
  if (Wr.defined()) out.dx = at::empty({M, K}, gy2.options());
  auto gf = at::empty({std::min(chunk, M), N}, f32), af = at::empty({std::min(chunk, M), K}, f32);
  for_chunks(M, chunk, [&](int64_t r0, int64_t r) {
    auto g = gf.narrow(0, 0, r), a = af.narrow(0, 0, r);
    g.copy_(gy2.narrow(0, r0, r));
    if (a2.defined()) {
      a.copy_(a2.narrow(0, r0, r).to(dt));
      if (r0 == 0) at::mm_out(out.dW, g.t(), a);
      else out.dW.addmm_(g.t(), a);
    }
    if (Wr.defined()) {
      at::mm_out(a, g, Wr);
      out.dx.narrow(0, r0, r).copy_(a);
    }
  });
  if (a2.defined()) round_rows_into(out.dW, out.dW, dt);
  return out;
}

// The widened forward: x in dt (..., K), W (N, K) and b (N) in any float dtype (rounded to dt). The
// output is allocated in its final shape (a view made here would be one autograd forbids in-place ops on).
at::Tensor widened_forward(const at::Tensor& xc, const at::Tensor& W, const at::Tensor& b) {
  const auto dt = xc.scalar_type();
  const int64_t N = W.size(0), K = W.size(1);
  auto x2 = xc.reshape({-1, K});
  const int64_t M = x2.size(0);
  auto shape = xc.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, xc.options());
  rows_times(y.view({M, N}), x2, rounded_fp32(W, dt).t(), b.defined() ? rounded_fp32(b, dt) : at::Tensor(),
             widened_chunk_rows(M, K, N));
  return y;
}

// One autograd node for the widened linear. Graph inputs: x, W, b (optional), the compute dtype.
struct WidenedLinearFunction : torch::autograd::Function<WidenedLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& W,
                            const std::optional<at::Tensor>& b, int64_t dtype) {
    const NoAutocast no_autocast;
    const auto xc = x.to(static_cast<c10::ScalarType>(dtype));  // what autocast's linear would save
    const at::Tensor bias = b.value_or(at::Tensor());
    // x only where W's gradient needs it (a frozen W under model.lora: its input's gradient needs W alone)
    ctx->save_for_backward({W.requires_grad() ? xc : at::Tensor(), W, bias});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->set_materialize_grads(false);
    return widened_forward(xc, W, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto &xc = saved[0], &W = saved[1], &b = saved[2];
    variable_list result(4);  // x, W, b, dtype
    const auto& gy = grads[0];
    if (!gy.defined()) return result;
    const auto dt = xc.scalar_type();
    const int64_t N = W.size(0), K = W.size(1);
    const auto gy2 = gy.to(dt).reshape({-1, N});
    LinearGradients g;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1))
      g = widened_gradients(gy2, ctx->needs_input_grad(1) ? xc.reshape({-1, K}) : at::Tensor(),
                            ctx->needs_input_grad(0) ? rounded_fp32(W, dt) : at::Tensor(), K,
                            widened_chunk_rows(gy2.size(0), K, N));
    if (g.dW.defined()) result[1] = g.dW.to(W.scalar_type());
    if (b.defined() && ctx->needs_input_grad(2)) result[2] = gy2.sum(0).to(b.scalar_type());
    if (g.dx.defined())
      result[0] = g.dx.view(xc.sizes()).to(static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    return result;
  }
};

}  // namespace

std::optional<c10::ScalarType> widened_dtype(const at::Tensor& x) {
  if (!x.defined() || !x.device().is_cpu()) return std::nullopt;
  if (x.scalar_type() != at::kFloat && !is_lowp(x.scalar_type())) return std::nullopt;  // as autocast: fp64 stays
  const auto dt =
      at::autocast::is_autocast_enabled(at::kCPU) ? at::autocast::get_autocast_dtype(at::kCPU) : x.scalar_type();
  if (!widens(dt)) return std::nullopt;
  return dt;
}

bool widened_path(c10::Device device, c10::ScalarType dt) { return device.is_cpu() && widens(dt); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& W, const at::Tensor& b) {
  const auto bias = b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
  if (const auto dt = widened_dtype(x)) return WidenedLinearFunction::apply(x, W, bias, static_cast<int64_t>(*dt));
  return at::linear(x, W, bias);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  const NoAutocast no_autocast;
  const auto dt = a.scalar_type();
  if (!a.device().is_cpu() || !widens(dt)) return a.mm(b.to(dt));
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  rows_times(out, a, rounded_fp32(b, dt), at::Tensor(), widened_chunk_rows(a.size(0), b.size(0), b.size(1)));
  return out;
}

at::Tensor linear_weight_grad(const at::Tensor& gy2, const at::Tensor& a2) {
  const NoAutocast no_autocast;
  const auto dt = gy2.scalar_type();
  if (!gy2.device().is_cpu() || !widens(dt)) return gy2.t().mm(a2.to(dt));
  return widened_gradients(gy2, a2, at::Tensor(), a2.size(1), widened_chunk_rows(gy2.size(0), a2.size(1), gy2.size(1)))
      .dW;
}

}  // namespace sl::model
