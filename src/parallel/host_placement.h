// Offload as a placement the data-parallel stages share (the recipe's offload section, device/host.h):
// where the optimizer's fp32 masters, AdamW's moments and the gradient shard live, and the copies
// between host and device that follow from it, counted for take_moved(). Each stage asks it to place a
// buffer or make a copy; only it reads the offload flags.
//   optimizer   the fp32 masters (the rank's shard; under DDP, the whole model) and AdamW's moments live
//               on the host and the AdamW step runs there; the host AdamW reads a host copy of the
//               clipped gradient unless the gradient shard is already there; the masters are copied
//               (cast to the compute dtype) into the device's parameters for every all-gather or gather.
//   gradients   zero2/3: the gradient shard lives on the host; each reduced group is added into it.
//   parameters  zero3 with optimizer: the host masters are the only copy kept between uses.
// Only bytes move: every value the optimizer reads and writes is the one it reads without offload.
#pragma once
#include <cstdint>

#include <torch/torch.h>

#include "config/config.h"
#include "device/host.h"
#include "parallel/group.h"
#include "parallel/strategy.h"

namespace sl::parallel {

class HostPlacement {
 public:
  explicit HostPlacement(const config::OffloadConfig& o) : optimizer_(o.optimizer), gradients_(o.gradients) {}

  bool masters_on_host() const { return optimizer_; }
  // A rank's fp32 master shard from a view of the group's fp32 values: on the host, or a buffer of its
  // own (own_buffer), or the view itself.
  torch::Tensor master(const torch::Tensor& view, bool own_buffer) const;
  // DDP: the whole group's fp32 masters and the host AdamW's gradient copy (none without offload.optimizer).
  void bind_replicated_masters(Group& g, const torch::TensorOptions& fp32) const;
  // zero2/3: the rank's gradient shard, on the host or beside the parameters.
  torch::Tensor grad_shard(int64_t numel, const torch::TensorOptions& fp32) const;
  // zero*: the host AdamW's copy of a gradient shard kept on the device (undefined where none is needed).
  torch::Tensor optimizer_grad_copy(int64_t numel) const;
  // A reduce-scatter's result added into the gradient shard wherever it lives.
  void add_reduced(torch::Tensor& shard_grad, const torch::Tensor& reduced);
  // Before the AdamW step: the clipped gradients into the host AdamW's copies.
  void grads_to_host(std::vector<std::unique_ptr<Group>>& groups);
  // After a DDP host AdamW step: the updated masters into the parameters (no-op without masters).
  void masters_to_params(std::vector<std::unique_ptr<Group>>& groups);
  // The master shard, cast to the compute dtype, into the rank's slot of flat_param.
  void master_to_slot(const torch::Tensor& slot, const torch::Tensor& master);
  // The master shard where a collective takes it (the device).
  torch::Tensor master_for_collective(const torch::Tensor& master, c10::Device device) const;
  // Where tensors made meanwhile belong: AdamW's moments on its first step; the norm's float64 chunks.
  device::HostScope optimizer_scope() const { return device::HostScope(optimizer_); }
  device::HostScope gradient_scope() const { return device::HostScope(gradients_); }
  // A master's or a gradient shard's bytes, counted where they live.
  void count_master(StateBytes& s, int64_t bytes) const { (optimizer_ ? s.host_params : s.params) += bytes; }
  void count_grad_shard(StateBytes& s, int64_t bytes) const { (gradients_ ? s.host_grads : s.grads) += bytes; }
  Moved take_moved();

 private:
  bool optimizer_, gradients_;
  Moved moved_;
};

}  // namespace sl::parallel
