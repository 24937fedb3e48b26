// One process without sharding (see single.h).
#include "parallel/single.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "optim/clip.h"
#include "optim/optimizer.h"

namespace sl::parallel {

// As Optimizer::zero_grad(set_to_none = false) does it: every parameter's gradient detached and zeroed.
void Single::zero_grad() {
  norm_sq_host_ = 0.0, norm_sq_ = torch::Tensor();
  for (auto& p : model_->parameters()) {
    auto& g = p.mutable_grad();
    if (!g.defined()) continue;
    g.detach_();
    g.zero_();
  }
}

std::vector<torch::Tensor> Single::grads() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : model_->parameters())
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}

torch::Tensor Single::norm_share(const std::vector<torch::Tensor>& grads, double max_norm) {
  if (!in_backward_) return optim::clip_grad_norm(grads, max_norm);
  const auto device = model_->wte.device();
  auto sq = torch::scalar_tensor(norm_sq_host_, torch::TensorOptions().dtype(torch::kDouble)).to(device);
  if (norm_sq_.defined()) sq = sq + norm_sq_;
  return sq.sqrt();
}

void Single::optimizer_step(torch::optim::AdamW& opt) {
  if (!in_backward_) optim::adamw_step(opt);
}

namespace {
struct UpdateInBackward final : torch::autograd::PostAccumulateGradHook {
  explicit UpdateInBackward(Single* s) : single(s) {}
  void operator()(const torch::autograd::Variable& p) override { single->update_in_backward(p); }
  Single* single;
};
}  // namespace

void Single::step_in_backward(torch::optim::AdamW& opt) {
  in_backward_ = &opt;
  for (const auto& p : model_->trained_parameters())
    torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<UpdateInBackward>(this));
}

void Single::update_in_backward(const torch::Tensor& p) {
  torch::NoGradGuard no_grad;
  torch::Tensor param = p;  // the same tensor: its gradient is the parameter's
  auto& g = param.mutable_grad();
  if (const auto sq = optim::sum_of_squares({g})) {
    norm_sq_host_ += *sq;
  } else {
    const auto s = at::linalg_vector_norm(g, 2).to(torch::kDouble).square();
    norm_sq_ = norm_sq_.defined() ? norm_sq_ + s : s;
  }
  optim::adamw_step(*in_backward_);  // this parameter alone: the only one with a gradient now
  g = torch::Tensor();
}

StateBytes Single::state_bytes() const {
  StateBytes s;
  for (const auto& p : model_->parameters()) {
    s.params += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) s.grads += static_cast<int64_t>(p.grad().nbytes());
  }
  return s;
}

std::vector<Span> Single::model_spans() const {
  std::vector<Span> out;
  for (const auto& item : model_->named_parameters())
    if (item.value().requires_grad())  // model.lora's frozen weights are not part of the training state
      out.push_back({item.key(), 0, item.value().numel(), item.value().detach().view({-1})});
  return out;
}

OptSlot Single::optimizer_slot(torch::optim::AdamW&, const Span& span) const {
  return {model_->named_parameters()[span.param], 0};
}

torch::Tensor Single::param_values(const std::string& name) const {
  return model_->named_parameters()[name].detach().view({-1});
}

Strategy::Trainables Single::trainables() {
  Trainables t;
  for (const auto& p : model_->trained_parameters()) (p.dim() >= 2 ? t.decay : t.no_decay).push_back(p);
  return t;
}

}  // namespace sl::parallel
