// One micro-batch's forward and backward (micro_batch.h).
#include "train/micro_batch.h"

#include "device/alloc_tag.h"
#include "device/device.h"
#include "parallel/strategy.h"
#include "precision/autocast.h"

namespace sl::train {

using device::Label;
using device::LabelScope;
using device::Phase;
using device::set_phase;

torch::Tensor loss_factor_tensor(const MicroBatchWork& w) {
  if (w.loss_factor <= 0.0) return {};
  return torch::full({}, w.loss_factor, torch::TensorOptions().dtype(torch::kFloat).device(w.device));
}

torch::Tensor micro_batch_pass(const MicroBatchWork& w, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& factor, parallel::Strategy& strategy, bool last) {
  set_phase(Phase::forward);
  torch::Tensor loss;
  {
    precision::AutocastGuard autocast(w.device.type(), w.precision.autocast);
    // Packed rows (which a CUDA graph leaves to this eager path) bring their positions.
    const auto& p = w.batch.positions;
    loss = w.loss(x, y, p.defined() ? device::to_device(p, w.device) : torch::Tensor());
  }
  if (factor.defined()) loss = loss * factor;
  set_phase(Phase::backward);
  strategy.begin_backward(last);
  // Divided by a 0-d tensor, not a double: the same float division on CPU and CUDA, and the form the
  // lazy test device differentiates (a double scalar there reaches nll_loss_backward as float64).
  auto* scaler = w.precision.scaler;
  ((scaler ? scaler->scale_loss(loss) : loss) / torch::scalar_tensor(w.micro_batches, loss.options())).backward();
  strategy.end_backward();
  return loss.detach().to(torch::kDouble);
}

torch::Tensor eager_micro_batch(const MicroBatchWork& w, parallel::Strategy& strategy, bool last) {
  set_phase(Phase::forward);
  torch::Tensor x, y;
  {
    LabelScope input(Label::input);
    x = device::to_device(w.batch.x, w.device), y = device::to_device(w.batch.y, w.device);
  }
  return micro_batch_pass(w, x, y, loss_factor_tensor(w), strategy, last);
}

}  // namespace sl::train
