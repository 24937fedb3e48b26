// One class per data-parallel stage (parallel.sharding), each over the shared Engine (engine.h):
//
//   class   gradients' path                      optimizer's layout          after the step
//   Ddp     (none) .grad are views into each      every parameter in full     offload.optimizer: the host
//           group's flat gradient; a group is     (the model's parameters,    masters into the parameters
//           all-reduced (async) as soon as its    or the host masters)
//           last gradient is accumulated, on the
//           last micro-batch only
//   Zero1   as Ddp                                 this rank's shard of fp32   all-gather the parameters
//                                                  masters; params are views   (views into flat buffers)
//                                                  into flat buffers
//   Zero2   each gradient copied into a           as Zero1                    as Zero1
//           transient group buffer and freed; a
//           ready group is reduce-scattered
//           (every micro-batch) and only the
//           rank's shard is kept
//   Zero3   as Zero2 (parallel/zero3.h)            as Zero1; a unit's          nothing: parameters exist
//                                                  parameters exist only       only while gathered
//                                                  while gathered
//
// Offload is not a branch here: every stage places its masters and gradient shards through the
// Engine's HostPlacement (parallel/host_placement.h). Under DDP the whole model is each rank's "shard":
// with offload.optimizer the masters and moments are on every rank's host.
#pragma once
#include "parallel/engine.h"

namespace sl::parallel {

class Ddp final : public Engine {
 public:
  Ddp(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm)
      : Engine(std::move(model), spec, std::move(comm)) {}
  // Every rank holds the same averaged gradient: rank 0 gives its norm, the others 0.
  torch::Tensor grad_norm_sq_share() override;
  // Every parameter in full (the host masters with offload.optimizer).
  std::vector<Span> owned_spans() const override;
  std::vector<Span> held_spans() const override { return owned_spans(); }

 protected:
  void bind_group(Group& g) override;
  void take_grad(Group&, size_t) override {}  // .grad are views of the flat gradient
  void launch_group(size_t gi) override { all_reduce(gi); }
  void after_step() override { host_.masters_to_params(groups_); }
  void count_group(StateBytes& s, const Group& g) const override;
  std::pair<int64_t, int64_t> owned_range(const Group& g) const override { return {0, g.padded}; }
  bool shards_states() const override { return false; }

 private:
  Trainables trainables() override;
};

// What ZeRO-1/2/3 share: the rank's fp32 master shard is what AdamW updates and a save holds.
class Sharded : public Engine {
 public:
  std::vector<Span> owned_spans() const override { return shard_spans(); }
  // Its master shard where the masters are buffers apart (a low-precision copy or offload.optimizer),
  // else every parameter.
  std::vector<Span> held_spans() const override;

 protected:
  using Engine::Engine;
  void bind_group(Group& g) override;
  virtual void bind_grads(Group& g) = 0;  // flat_grad / shard_grad, accum and step_grad
  void bind_values(Group& g, torch::Tensor flat) override { shard_and_bind(g, std::move(flat), true); }
  void after_step() override { all_gather_params(); }
  // The compute copy of the whole group (flat_param) and the master shard where it is apart.
  void count_resident_params(StateBytes& s, const Group& g) const;
  bool masters_apart() const { return low_precision_copy() || host_.masters_on_host(); }
  bool shards_states() const override { return true; }
};

class Zero1 final : public Sharded {
 public:
  Zero1(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm)
      : Sharded(std::move(model), spec, std::move(comm)) {}

 protected:
  void bind_grads(Group& g) override;  // a persistent flat gradient; the shard is a view of it
  void take_grad(Group& g, size_t i) override;
  void launch_group(size_t gi) override { all_reduce(gi); }
  void count_group(StateBytes& s, const Group& g) const override;
};

class Zero2 : public Sharded {
 public:
  Zero2(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm)
      : Sharded(std::move(model), spec, std::move(comm)) {}

 protected:
  void bind_grads(Group& g) override;  // the shard only; the flat gradient is transient
  void take_grad(Group& g, size_t i) override { copy_into_buffer(g, i); }
  void launch_group(size_t gi) override;
  void count_group(StateBytes& s, const Group& g) const override;
};

}  // namespace sl::parallel
