// Offload's placement of masters, moments and gradient shards, and its copies (host_placement.h).
#include "parallel/host_placement.h"

#include "device/device.h"

namespace sl::parallel {

torch::Tensor HostPlacement::master(const torch::Tensor& view, bool own_buffer) const {
  if (optimizer_) return device::to_host(view);
  return own_buffer ? view.clone() : view;
}

void HostPlacement::bind_replicated_masters(Group& g, const torch::TensorOptions& fp32) const {
  if (!optimizer_) return;
  auto flat = torch::zeros({g.padded}, fp32);
  for (size_t i = 0; i < g.params.size(); ++i)
    flat.narrow(0, g.offsets[i], g.params[i].numel()).copy_(g.params[i].reshape({-1}));
  g.shard_param = device::to_host(flat);
  g.host_grad = device::host_zeros(g.padded, torch::kFloat);
}

torch::Tensor HostPlacement::grad_shard(int64_t numel, const torch::TensorOptions& fp32) const {
  return gradients_ ? device::host_zeros(numel, torch::kFloat) : torch::zeros({numel}, fp32);
}

torch::Tensor HostPlacement::optimizer_grad_copy(int64_t numel) const {
  return optimizer_ && !gradients_ ? device::host_zeros(numel, torch::kFloat) : torch::Tensor();
}

void HostPlacement::add_reduced(torch::Tensor& shard_grad, const torch::Tensor& reduced) {
  if (gradients_) moved_.to_host += static_cast<int64_t>(reduced.nbytes());
  shard_grad.add_(gradients_ ? device::host_readable(reduced) : reduced);
}

// The host AdamW reads a copy made after clipping (the values it would read on the device).
// On CUDA the parameters' copies in may still read the masters (device/host.h): the host AdamW writes
// them only after those copies landed.
void HostPlacement::grads_to_host(std::vector<std::unique_ptr<Group>>& groups) {
  torch::NoGradGuard no_grad;
  if (optimizer_) device::wait_for_host_copies();
  for (auto& g : groups) {
    if (!g->host_grad.defined()) continue;
    device::copy_into(g->host_grad, g->step_grad);
    moved_.to_host += static_cast<int64_t>(g->host_grad.nbytes());
  }
}

// Every rank made the same update, so every rank copies its masters into its own parameters.
void HostPlacement::masters_to_params(std::vector<std::unique_ptr<Group>>& groups) {
  if (!optimizer_) return;
  torch::NoGradGuard no_grad;
  for (auto& g : groups)
    for (size_t i = 0; i < g->params.size(); ++i) {
      device::copy_into(g->params[i], g->shard_param.narrow(0, g->offsets[i], g->params[i].numel()));
      moved_.to_device += static_cast<int64_t>(g->params[i].nbytes());
    }
}

void HostPlacement::master_to_slot(const torch::Tensor& slot, const torch::Tensor& master) {
  device::copy_into(slot, master);  // a low-precision copy: rounded to nearest even
  if (optimizer_) moved_.to_device += static_cast<int64_t>(slot.nbytes());
}

torch::Tensor HostPlacement::master_for_collective(const torch::Tensor& master, c10::Device device) const {
  return optimizer_ ? device::to_device(master, device) : master;
}

Moved HostPlacement::take_moved() {
  const Moved m = moved_;
  moved_ = {};
  return m;
}

}  // namespace sl::parallel
