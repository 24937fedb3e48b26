// One process without sharding (see single.h).
#include "parallel/single.h"

#include <torch/torch.h>

#include "optim/clip.h"
#include "optim/optimizer.h"

namespace sl::parallel {

// As Optimizer::zero_grad(set_to_none = false) does it: every parameter's gradient detached and zeroed.
void Single::zero_grad() {
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
  return optim::clip_grad_norm(grads, max_norm);
}

void Single::optimizer_step(torch::optim::AdamW& opt) { optim::adamw_step(opt); }

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
  for (const auto& p : model_->parameters()) (p.dim() >= 2 ? t.decay : t.no_decay).push_back(p);
  return t;
}

}  // namespace sl::parallel
