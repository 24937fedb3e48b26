// The engine's gradient path shared by its stages: micro-batch bookkeeping, the collectives' launch
// order, their completion, the average, the norm and the clip (engine.h).
#include <algorithm>

#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/host.h"
#include "predict/footprint.h"
#include "optim/clip.h"
#include "parallel/engine.h"

namespace sl::parallel {

void Engine::zero_grad() {
  release_all();  // a prefetch left behind by a forward that did not finish
  gathers_ = 0;
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) g->accum.zero_();
}

void Engine::begin_backward(bool last) {
  last_micro_ = last;
  in_backward_ = true;
  if (last) launched_from_hooks_ = 0;
  cursor_ = 0;
  for (auto& g : groups_) g->ready = 0;
}

void Engine::launch_ready() {
  while (cursor_ < groups_.size() && groups_[cursor_]->ready == groups_[cursor_]->params.size()) {
    // Counted where a collective launches: at world 1 none does (all_reduce returns, Comm's reduce-scatter
    // is a local copy), and a CUDA graph's replay (train/cuda_graph.h) runs no hook to count.
    if (in_backward_ && last_micro_ && world_ > 1) ++launched_from_hooks_;
    launch_group(cursor_++);
  }
}

void Engine::all_reduce(size_t gi) {
  auto& g = *groups_[gi];
  if (!last_micro_ || world_ == 1) return;
  g.pending = comm_->all_reduce_sum(g.flat_grad, "gradient all-reduce of " + g.name);
  in_flight_.push_back(gi);
}

void Engine::ensure_grad_buffer(Group& g) {
  if (g.flat_grad.defined()) return;
  // The previous group's reduce-scatter overlapped this group's backward until now; finish it before
  // a second full gradient buffer exists.
  finish_in_flight();
  device::LabelScope label(device::Label::comm);  // a memory timeline's label: the gradient in flight
  // On the device whatever the placement: the collective's buffer (NCCL takes no host tensor).
  g.flat_grad = torch::zeros({g.padded}, fp32_options().dtype(reduce_dtype_));
  add_transient(grad_buffer_bytes(g));
}

void Engine::copy_into_buffer(Group& g, size_t i) {
  // No gradient reached this parameter in this backward (e.g. an unused input of a checkpointed
  // piece): it contributes zeros, which the group buffer already holds.
  ensure_grad_buffer(g);
  auto& p = g.params[i];
  if (!p.grad().defined()) return;
  g.flat_grad.narrow(0, g.offsets[i], p.numel()).view(p.sizes()).copy_(p.grad());
  p.mutable_grad().reset();
}

void Engine::reduce_scatter(size_t gi) {
  auto& g = *groups_[gi];
  // NCCL takes device tensors only: a buffer on the host here is this engine's bug, named as one.
  TORCH_INTERNAL_ASSERT(g.flat_grad.device() == device_, "gradient buffer of ", g.name, " on ", g.flat_grad.device(),
                        ", not the run's device ", device_);
  // In place: the output is this rank's slice of the group's gradient buffer.
  g.rs_out = g.flat_grad.narrow(0, rank_ * g.shard, g.shard);
  g.pending = comm_->reduce_scatter_sum(g.rs_out, g.flat_grad, "gradient reduce-scatter of " + g.name);
  in_flight_.push_back(gi);
}

void Engine::finish_in_flight() {
  for (size_t gi : in_flight_) finish(gi);
  in_flight_.clear();
}

void Engine::finish(size_t gi) {
  auto& g = *groups_[gi];
  g.pending.wait();
  if (!g.rs_out.defined()) return;
  torch::NoGradGuard no_grad;
  host_.add_reduced(g.shard_grad, g.rs_out);
  g.rs_out.reset();
  g.flat_grad.reset();
  add_transient(-grad_buffer_bytes(g));
}

void Engine::end_backward() {
  in_backward_ = false;
  for (auto& g : groups_) g->ready = g->params.size();  // parameters that got no gradient count as ready
  launch_ready();
  finish_in_flight();
  if (!last_micro_ || world_ == 1) return;
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / static_cast<double>(world_);
  for (auto& g : groups_) g->accum.mul_(inv);
}

std::vector<torch::Tensor> Engine::grads() const {
  std::vector<torch::Tensor> out;
  for (const auto& g : groups_) out.push_back(g->step_grad);
  return out;
}

torch::Tensor Engine::grad_norm_sq_share() {
  torch::NoGradGuard no_grad;
  const auto gs = grads();
  // Accumulated in float64: the norm (and so the clip factor) must not depend on how the gradient is
  // cut into buckets or shards, or the stages would drift apart by rounding (visible under bf16).
  // Gradients on the CPU (the CPU device, or offload.gradients' host shards): the single-process
  // clipping's fused float64 pass, no copy (was 11 float64 conversions on l12: ~3 ms of a ~0.4 s step,
  // 13.6 ms under the profiler).
  if (const auto sq = optim::sum_of_squares(gs))
    return torch::scalar_tensor(*sq, torch::TensorOptions().dtype(torch::kDouble)).to(device_);
  // Elsewhere chunk by chunk: a float64 norm converts its input first, and a whole group's float64
  // copy is twice the group's gradient (predict/footprint.h counts one chunk's copy).
  const auto scope = host_.gradient_scope();  // the chunks' float64 copies are made where the gradient lives
  std::vector<torch::Tensor> norms;
  for (const auto& t : gs)
    for (int64_t off = 0; off < t.numel(); off += memory::kGradNormChunk)
      norms.push_back(at::linalg_vector_norm(t.narrow(0, off, std::min(memory::kGradNormChunk, t.numel() - off)), 2,
                                             std::nullopt, false, at::kDouble));
  return torch::stack(norms).pow(2).sum().to(device_);  // offload.gradients: summed on the host, read with the loss
}

void Engine::clip(double max_norm, double norm) {
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0)) return;
  torch::NoGradGuard no_grad;
  for (auto& t : grads()) t.mul_(coef);
}

}  // namespace sl::parallel
