// The LM head and the loss in chunks, one autograd node (see fused_loss.h).
#include "model/fused_loss.h"

#include <limits>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include "model/linear.h"

namespace sl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// How the chunk's matmuls run: natively in the compute dtype, or (the CPU's widened path,
// model/linear.h) on fp32 tensors that hold compute-dtype values, each product rounded to it.
struct Matmuls {
  c10::ScalarType dtype;
  bool widened;

  // t rounded to the compute dtype, in the tensor type the products take.
  at::Tensor operand(const at::Tensor& t) const {
    const auto r = t.to(dtype);
    return widened ? r.to(at::kFloat) : r;
  }
  // a b, rounded to the compute dtype (in fp32 on the widened path).
  at::Tensor product(const at::Tensor& a, const at::Tensor& b) const {
    const auto p = a.mm(b);
    return widened ? p.to(dtype).to(at::kFloat) : p;
  }
  // dW += d^T h: in place where the product is fp32 already (fp32 runs, the widened path: no rounding,
  // no transient), else the compute-dtype product added to the fp32 sum.
  void accumulate(at::Tensor& dW, const at::Tensor& d, const at::Tensor& h) const {
    if (d.scalar_type() == at::kFloat) dW.addmm_(d.t(), h);
    else dW.add_(d.t().mm(h));
  }
};

struct ChunkSums {
  at::Tensor loss;    // fp32 sum of the rows' losses
  at::Tensor dh, dW;  // unscaled gradients (fp32), when wanted
};

// One chunk's rows: their loss into s.loss; with gradients, their dh rows and their share of dW. A row
// whose target is kIgnoreTarget adds nothing: no loss and a zero row of d (its row sum is made infinite,
// so z / sum is 0 there, and its one-hot weight is 0). Where no target is ignored the arithmetic is the
// same as without the check, bit for bit (sum and -1 unchanged).
void run_chunk(const Matmuls& mm, const at::Tensor& hc, const at::Tensor& Wc, const at::Tensor& t, int64_t valid,
               int64_t row0, ChunkSums& s) {
  const int64_t m = hc.size(0), V = Wc.size(0);
  auto logits = mm.product(hc, Wc.t());  // (m, V') compute-dtype values
  auto z = logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);
  logits = at::Tensor();
  if (valid < V) z.narrow(1, valid, V - valid).fill_(-std::numeric_limits<float>::infinity());
  const auto ignored = t.eq(kIgnoreTarget).unsqueeze(1);  // (m, 1)
  const auto target = t.unsqueeze(1).masked_fill(ignored, 0);
  // The log-sum-exp in place (at::logsumexp would make an (m, V') temporary): z becomes exp(z - max),
  // then, with gradients, the softmax less the one-hot target.
  at::Tensor sum;  // (m, 1): what the gradient still needs of the rows' vectors
  {
    const auto picked = z.gather(1, target);
    const auto top = std::get<0>(z.max(1, /*keepdim=*/true));
    sum = z.sub_(top).exp_().sum(1, /*keepdim=*/true);
    s.loss.add_((top + sum.log() - picked).masked_fill_(ignored, 0.0).sum());
  }
  if (!s.dh.defined()) return;
  z.div_(sum.masked_fill_(ignored, std::numeric_limits<float>::infinity()));
  z.scatter_add_(1, target, at::full({m, 1}, -1.0, z.options()).masked_fill_(ignored, 0.0));
  const auto d = mm.operand(z);
  z = at::Tensor();
  s.dh.narrow(0, row0, m).copy_(mm.product(d, Wc));
  if (s.dW.defined()) mm.accumulate(s.dW, d, hc);
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& W, const at::Tensor& targets,
                            int64_t chunk_rows, int64_t valid, int64_t dtype, bool widened, bool grads, bool w_grad) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Matmuls mm{static_cast<c10::ScalarType>(dtype), widened};
    const int64_t N = h.size(0);
    const auto hc = mm.operand(h), Wc = mm.operand(W);
    const auto f32 = h.options().dtype(at::kFloat);
    ChunkSums s{at::zeros({}, f32), {}, {}};
    if (grads) s.dh = at::empty({N, h.size(1)}, f32);
    if (grads && w_grad) s.dW = at::zeros({W.size(0), W.size(1)}, f32);  // a frozen W (model.lora): none
    for (int64_t r = 0; r < N; r += chunk_rows) {
      const int64_t m = std::min(chunk_rows, N - r);
      run_chunk(mm, hc.narrow(0, r, m), Wc, targets.narrow(0, r, m), valid, r, s);
    }
    if (grads) {
      ctx->saved_data["dh"] = s.dh, ctx->saved_data["dW"] = s.dW;
      ctx->saved_data["h_dtype"] = static_cast<int64_t>(h.scalar_type());
      ctx->saved_data["W_dtype"] = static_cast<int64_t>(W.scalar_type());
    }
    ctx->saved_data["rows"] = N;
    ctx->set_materialize_grads(false);
    return s.loss.div_(static_cast<double>(N));
  }

  // dL/dh = g/N dh and dL/dW = g/N dW, scaled in place and handed on (so the node keeps nothing after).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(9);
    const auto& g = grads[0];
    if (!g.defined()) return result;
    if (!ctx->saved_data.count("dh"))
      throw std::logic_error("the fused linear + cross-entropy node has no gradients: it ran without grad mode, or "
                             "its backward ran twice (retain_graph is not supported)");
    const auto scale = g.to(at::kFloat) / static_cast<double>(ctx->saved_data["rows"].toInt());
    auto dh = ctx->saved_data["dh"].toTensor(), dW = ctx->saved_data["dW"].toTensor();
    ctx->saved_data.erase("dh"), ctx->saved_data.erase("dW");
    result[0] = dh.mul_(scale).to(static_cast<c10::ScalarType>(ctx->saved_data["h_dtype"].toInt()));
    if (dW.defined()) result[1] = dW.mul_(scale).to(static_cast<c10::ScalarType>(ctx->saved_data["W_dtype"].toInt()));
    return result;
  }
};

// The compute dtype of the head's matmuls: autocast's where it is on for the device, else W's.
c10::ScalarType compute_dtype(const at::Tensor& h, const at::Tensor& W) {
  const auto type = h.device().type();
  const bool autocasts = (type == c10::kCPU || type == c10::kCUDA) && at::autocast::is_autocast_enabled(type);
  return autocasts ? at::autocast::get_autocast_dtype(type) : W.scalar_type();
}

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& h, const at::Tensor& W, const at::Tensor& targets, int64_t chunk_rows,
                                int64_t valid_vocab) {
  if (h.dim() != 2 || W.dim() != 2 || h.size(1) != W.size(1) || targets.dim() != 1 || targets.size(0) != h.size(0))
    throw std::invalid_argument("linear_cross_entropy: h (N, C), W (V, C) and targets (N) do not fit together");
  if (!(valid_vocab > 0 && valid_vocab <= W.size(0)) || chunk_rows <= 0)
    throw std::invalid_argument("linear_cross_entropy: valid_vocab must be in [1, V] and chunk_rows > 0");
  RECORD_FUNCTION("sublinear::linear_cross_entropy", std::vector<c10::IValue>{});  // a profile's name for it
  const auto dtype = compute_dtype(h, W);
  const bool widened = widened_path(h.device(), dtype);
  const bool grads = at::GradMode::is_enabled() && (h.requires_grad() || W.requires_grad());
  return LinearCrossEntropyFunction::apply(h, W, targets, chunk_rows, valid_vocab, static_cast<int64_t>(dtype), widened,
                                           grads, grads && W.requires_grad());
}

}  // namespace sl::model
