// ZeRO-3: parameters gathered per unit around its forward, backward and recompute (zero3.h).
#include "parallel/zero3.h"

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/host.h"

namespace sl::parallel {

void Zero3::bind_values(Group& g, torch::Tensor flat) {
  shard_and_bind(g, std::move(flat), false);
  g.gathered = true;
  release_group(g);
}

void Zero3::launch_group(size_t gi) {
  auto& g = *groups_[gi];
  ensure_grad_buffer(g);  // no gradient reached this group (unused parameters): reduce zeros
  release_group(g);       // its backward is over
  reduce_scatter(gi);
}

void Zero3::end_backward() {
  Engine::end_backward();
  pending_out_.reset();
}

// The master shard (on the host with offload.optimizer) and the gradient shard; no resident compute copy.
void Zero3::count_group(StateBytes& s, const Group& g) const {
  host_.count_master(s, g.shard * 4);
  host_.count_grad_shard(s, g.shard * 4);
}

void Zero3::attach(recompute::Runner& runner) {
  recompute::UnitHooks h;
  h.before = [this](int64_t u) { unit_before(u); };
  h.after = [this](int64_t u, const torch::Tensor& in, const torch::Tensor& out, bool needs) {
    unit_after(u, in, out, needs);
  };
  h.flush = [this] { unit_flush(); };
  runner.set_unit_hooks(std::move(h));
}

void Zero3::gather_all() {
  for (auto& g : groups_) gather_group(*g);
}

void Zero3::release_all() {
  for (auto& g : groups_) release_group(*g);
}

void Zero3::start_gather(Group& g) {
  if (g.gathered) return;
  auto* storage = g.flat_param.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(param_buffer_bytes(g));
  device::LabelScope label(device::Label::gathered_params);  // a memory timeline's label
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  g.gathered = true;
  ++gathers_;
  add_transient(param_buffer_bytes(g));
  // On CUDA the shard's copy in (offload: the host master cast to the compute dtype) and the
  // all-gather's issue go on the side stream (device/host.h), after what the current stream queued
  // so far (the buffer above was allocated on it); the current stream waits for them only in
  // gather_group or release_group. A prefetch (unit_before, prefetch_backward) thus copies and
  // gathers the next unit beside this unit's compute. Elsewhere the scope does nothing.
  device::SideStreamScope side(g.flat_param.device());
  g.gathering = comm_->all_gather(g.flat_param, compute_shard(g), "parameter all-gather of " + g.name);
  g.arrived = side.finish();
}

void Zero3::gather_group(Group& g) {
  start_gather(g);
  g.gathering.wait();  // a no-op unless this gather (or its prefetch) is still in flight
  g.arrived.wait();    // the current stream after the side stream's copy in (no host block)
}

void Zero3::release_group(Group& g) {
  if (!g.gathered) return;
  g.gathering.wait();  // never free a buffer a collective is still writing
  g.arrived.wait();    // nor one the side stream is still writing: its reuse comes after, on this stream
  g.arrived = device::Arrival();
  auto* storage = g.flat_param.storage().unsafeGetStorageImpl();
  // The parameters (and any tensor autograd saved from them) keep this storage; only its memory goes.
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, g.flat_param.device()));
  storage->set_nbytes(0);
  g.gathered = false;
  add_transient(-param_buffer_bytes(g));
}

void Zero3::gather(int64_t unit) {
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) gather_group(*groups_[gi]);
}

void Zero3::release(int64_t unit) {
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) release_group(*groups_[gi]);
}

void Zero3::unit_before(int64_t unit) {
  gather(unit);
  // Forward prefetch: start the next unit's all-gather so it overlaps this unit's compute (at most
  // two units' parameters exist). Not in backward: a recompute's next unit is not the one needed.
  if (!in_backward_ && unit + 1 < static_cast<int64_t>(unit_groups_.size()))
    for (size_t gi : unit_groups_[static_cast<size_t>(unit + 1)]) start_gather(*groups_[gi]);
}

void Zero3::unit_after(int64_t unit, const torch::Tensor& in, const torch::Tensor& out, bool needs_params_in_backward) {
  release(unit);
  if (!torch::GradMode::is_enabled()) return;  // eval, or the first pass of a checkpointed segment
  if (pending_out_ && in.defined() && pending_out_->first.is_same(in)) {
    // The previous unit's output is this unit's input: one hook, run when this unit's backward is
    // over, frees this unit and gathers the previous one for its backward.
    const int64_t prev = pending_out_->second;
    pending_out_.reset();
    in.register_hook([this, unit, prev](const torch::Tensor&) {
      release(unit);
      gather(prev);
      prefetch_backward(prev);
    });
  } else {
    unit_flush();
    if (in.defined() && in.requires_grad()) in.register_hook([this, unit](const torch::Tensor&) { release(unit); });
  }
  if (needs_params_in_backward && out.requires_grad()) pending_out_.emplace(out, unit);
}

void Zero3::unit_flush() {
  if (!pending_out_) return;
  auto [t, unit] = *pending_out_;
  pending_out_.reset();
  t.register_hook([this, unit](const torch::Tensor&) {
    gather(unit);
    prefetch_backward(unit);
  });
}

// Backward prefetch: while `unit`'s backward runs, start the all-gather of the block before it, whose
// backward (or recompute) comes next, so the transfer overlaps this unit's compute. The embeddings need
// no parameters in backward and are never prefetched. At most a third unit's parameters exist beside a
// unit's parameters and gradient (predict/footprint.cpp counts it). Hooks run in the same order on every
// rank, so the all-gathers pair up.
void Zero3::prefetch_backward(int64_t unit) {
  const int64_t next = unit - 1;
  if (next < model::block_unit(0)) return;
  for (size_t gi : unit_groups_[static_cast<size_t>(next)]) start_gather(*groups_[gi]);
}

}  // namespace sl::parallel
