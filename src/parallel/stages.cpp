// DDP, ZeRO-1 and ZeRO-2 over the shared Engine (stages.h).
#include "parallel/stages.h"

namespace sl::parallel {

// ---- Ddp ----

void Ddp::bind_group(Group& g) {
  bind_flat_grad(g);
  g.accum = g.step_grad = g.flat_grad;
  host_.bind_replicated_masters(g, fp32_options());
}

torch::Tensor Ddp::grad_norm_sq_share() {
  // One copy of the (same on every rank) averaged gradient's norm goes into the sum.
  if (rank_ != 0) return torch::zeros({}, groups_.front()->step_grad.options().dtype(torch::kDouble));
  return Engine::grad_norm_sq_share();
}

Strategy::Trainables Ddp::trainables() {
  if (host_.masters_on_host()) return shard_pieces();
  Trainables t;
  for (const auto& p : model_->trained_parameters()) (p.dim() >= 2 ? t.decay : t.no_decay).push_back(p);
  return t;
}

std::vector<Span> Ddp::owned_spans() const { return host_.masters_on_host() ? shard_spans() : param_spans(); }

void Ddp::count_group(StateBytes& s, const Group& g) const {
  for (const auto& p : g.params) s.params += static_cast<int64_t>(p.nbytes());
  if (g.shard_param.defined()) host_.count_master(s, g.padded * 4);
  s.grads += g.padded * 4;
}

// ---- Sharded ----

void Sharded::bind_group(Group& g) {
  bind_grads(g);
  g.host_grad = host_.optimizer_grad_copy(g.shard);
  if (!deferred_) bind_values(g, full_values(g));
}

std::vector<Span> Sharded::held_spans() const { return masters_apart() ? shard_spans() : param_spans(); }

void Sharded::count_resident_params(StateBytes& s, const Group& g) const {
  s.params += g.padded * static_cast<int64_t>(c10::elementSize(param_dtype_));
  if (masters_apart()) host_.count_master(s, g.shard * 4);
}

// ---- Zero1 ----

void Zero1::bind_grads(Group& g) {
  bind_flat_grad(g);
  g.shard_grad = g.flat_grad.narrow(0, rank_ * g.shard, g.shard);
  g.accum = g.flat_grad;
  g.step_grad = g.shard_grad;
}

void Zero1::take_grad(Group& g, size_t i) {
  auto& p = g.params[i];
  if (!low_precision_copy() || !p.grad().defined()) return;  // else .grad is a view of the flat gradient
  g.flat_grad.narrow(0, g.offsets[i], p.numel()).view(p.sizes()).add_(p.grad());  // accumulated in fp32
  p.mutable_grad().reset();
}

void Zero1::count_group(StateBytes& s, const Group& g) const {
  count_resident_params(s, g);
  s.grads += g.padded * 4;
}

// ---- Zero2 ----

void Zero2::bind_grads(Group& g) {
  g.shard_grad = host_.grad_shard(g.shard, fp32_options());
  g.accum = g.step_grad = g.shard_grad;
}

void Zero2::launch_group(size_t gi) {
  ensure_grad_buffer(*groups_[gi]);  // no gradient reached this group (unused parameters): reduce zeros
  reduce_scatter(gi);
}

void Zero2::count_group(StateBytes& s, const Group& g) const {
  count_resident_params(s, g);
  host_.count_grad_shard(s, g.shard * 4);
}

}  // namespace sl::parallel
