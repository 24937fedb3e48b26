// Data parallelism as a strategy, chosen once from the recipe (make_strategy) and applied from outside:
// the step, the saves and the reports call the same interface whether one process trains (Single,
// parallel/single.h) or several do under DDP or ZeRO-1/2/3 (Ddp, Zero1, Zero2, Zero3 over the shared
// Engine: parallel/stages.h, parallel/zero3.h, parallel/engine.h); none of them tests which one it holds.
//
// A strategy owns, for its data-parallel layout:
//   the gradients' path     zero_grad, begin/end_backward around each micro-batch's backward, grads(),
//                           the norm (norm_share + global_norm) and clip, sum_over_ranks for the step's
//                           one reduction;
//   the optimizer's layout  which tensors AdamW updates (the model's parameters or this rank's shards),
//                           built by make_optimizer (the one AdamW builder: optim::make_adamw over them)
//                           and stepped by optimizer_step;
//   its share of saves      writes_model_states, owned_spans (what this rank writes), held_spans (what a
//                           load fills), optimizer_slot (where a span's AdamW moments live), params_loaded;
//   its memory              state_bytes between steps, take_moved (offload's copies), take_transient_peak;
//                           the planner's formula for it is memory::predict_states (predict/footprint.h),
//                           which branches on the sharding stage.
// Each data-parallel stage is its own class; what they share (groups, collectives' order, norm, clip,
// step) is Engine. Offload (the recipe's offload section) is not a strategy: it is a placement of the
// rank's masters, moments and gradient shard (HostPlacement, parallel/host_placement.h) that every stage
// calls.
//
// Adding a parallel dimension (sequence or tensor parallelism) adds a strategy that wraps an Engine (Single's
// norm is the norm itself, clipped before the read, so it does not sum over a group): the step and the
// saves call this interface and need no change (docs/architecture.md, "Parallel strategies").
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "recompute/runner.h"
#include "config/config.h"
#include "model/gpt.h"
#include "parallel/comm.h"

namespace sl::parallel {

// What a data-parallel strategy reads of the recipe, and nothing else: parallel.* (the stage, the bucket
// size), precision.param_dtype and reduce_dtype (the gathered and reduced copies) and offload.* (where the
// masters, moments and gradient shard live).
struct Spec {
  config::ParallelConfig parallel;
  config::PrecisionConfig precision;
  config::OffloadConfig offload;
  static Spec of(const config::RunConfig& cfg) { return {cfg.parallel, cfg.precision, cfg.offload}; }
};

// Bytes of model states this rank holds between steps, by what its buffers are.
// Device-resident bytes (params, grads; optimizer is filled by the caller from AdamW's state) and
// what offload keeps in host memory instead (masters, gradient shard or its host copy).
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t host_params = 0, host_grads = 0;
  bool optimizer_on_host = false;  // AdamW's moments live on the host
  int64_t total() const { return params + grads + optimizer; }
};

// Bytes offload moved since the last take_moved(): host -> device and device -> host.
struct Moved {
  int64_t to_device = 0, to_host = 0;
};

// A run of one parameter's elements, [begin, end) of its flattened values, and the 1-D tensor on this
// rank that holds them (a view: writing it writes the parameter or the rank's shard). Saved training
// states are made of spans, so a state written under one sharding can be read under another.
struct Span {
  std::string param;  // the name in the model ("blocks.0.w_qkv")
  int64_t begin = 0, end = 0;
  torch::Tensor values;
};

// The optimizer tensor whose AdamW state holds a span's moments, and the span's offset in it.
struct OptSlot {
  torch::Tensor param;
  int64_t offset = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual int64_t world() const = 0;
  // The console's "data parallel" row: ranks, backend, sharding.
  virtual std::string describe() const = 0;

  // AdamW over what this rank updates, with train.weight_decay on matrices only: the one place a run's
  // optimizer is built.
  std::unique_ptr<torch::optim::AdamW> make_optimizer(const config::TrainConfig& t);
  // zero3: gathers/frees units around the forward (unit 0 embeddings, 1..L blocks, L+1 head).
  virtual void attach(recompute::Runner& runner) = 0;

  // ---- one step: forward/backward, reduce, clip, step ----
  // Zeroes the gradients, kept allocated (so peak - model states is the activation peak).
  virtual void zero_grad() = 0;
  // Around each micro-batch's backward; `last` marks the micro-batch whose gradients are reduced.
  virtual void begin_backward(bool last) = 0;
  virtual void end_backward() = 0;
  // Re-makes the autograd accumulator nodes the strategy keeps for its gradient hooks on the current
  // stream, and says whether each now is there. Autograd runs a leaf's accumulation (and the hooks after
  // it) on the stream its accumulator node was made on; a node kept from set-up stays on the stream
  // current then. A CUDA graph captured on a side stream (train/cuda_graph.h) calls this on that stream
  // between steps (no autograd graph alive), before its first micro-batch. Single keeps no node: autograd
  // makes one per forward, on the forward's stream.
  virtual bool hooks_to_current_stream() { return true; }
  // The gradients the optimizer will use (this rank's shards under ZeRO).
  virtual std::vector<torch::Tensor> grads() const = 0;
  // This rank's share of the gradient norm, a 0-d device tensor, not read; summed over ranks (the step's
  // one reduction) global_norm() turns the sum into the global L2 norm. max_norm: train.grad_clip (0 = off),
  // for a strategy that clips on the device before the read (Single).
  virtual torch::Tensor norm_share(const std::vector<torch::Tensor>& grads, double max_norm) = 0;
  virtual double global_norm(double summed_shares) const = 0;
  // Clips with the global norm read on the host (a no-op where norm_share clipped already).
  virtual void clip(double max_norm, double norm) = 0;
  // Sums `t` over ranks in place (waits on the device, not the host); check_reduction after the host
  // read throws DistError for a collective that failed meanwhile. No-ops for one process.
  virtual void sum_over_ranks(torch::Tensor& t, const std::string& what) = 0;
  virtual void check_reduction(const std::string& what) = 0;
  // The AdamW step over what this rank updates (and what must follow it: the ZeRO all-gather).
  virtual void optimizer_step(torch::optim::AdamW& opt) = 0;
  // optim.in_backward: every later step updates each parameter in its backward (Single only; the recipe's
  // validation refuses it with more than one process, sharding or offloaded states).
  virtual void step_in_backward(torch::optim::AdamW& opt);

  // ---- memory ----
  virtual StateBytes state_bytes() const = 0;
  virtual Moved take_moved() = 0;
  // Largest transient bytes seen (gathered parameters, not-yet-reduced gradients) since the last call.
  virtual int64_t take_transient_peak() = 0;
  // zero3: group all-gathers since the last zero_grad() (one step: forward, recompute, backward, eval).
  virtual int64_t gathers() const = 0;
  // summary.json's parallel block's layout facts (largest group, groups, launched during backward);
  // null for Single (the block is null then: docs/logs.md).
  virtual nlohmann::json layout() const = 0;

  // ---- saves, loads, final weights ----
  // Whether this rank writes the model states (parameters, moments) of a save: rank 0 where every rank
  // holds the same, every rank where each holds its own shard.
  bool writes_model_states(bool rank0) const;
  // The elements this rank's optimizer updates (one process, DDP: every parameter in full; zero*: the shard).
  virtual std::vector<Span> owned_spans() const = 0;
  // The fp32 parameter elements this rank stores between steps, what a load writes. Call params_loaded() after.
  virtual std::vector<Span> held_spans() const = 0;
  virtual void params_loaded() = 0;
  virtual OptSlot optimizer_slot(torch::optim::AdamW& opt, const Span& span) const = 0;
  // One unit (model::kEmbeddingUnit, block_unit(l), head_unit) readable through param_values(), holding
  // at most one gathered unit (collectives on every rank under ZeRO).
  virtual void gather_unit(int64_t unit) = 0;
  virtual void release_unit(int64_t unit) = 0;
  // A parameter's full fp32 values, flat (between gather_unit and release_unit of its unit).
  virtual torch::Tensor param_values(const std::string& name) const = 0;

 protected:
  // What make_optimizer builds AdamW over: matrices (decayed) and vectors.
  struct Trainables {
    std::vector<torch::Tensor> decay, no_decay;
  };
  virtual Trainables trainables() = 0;
  // Whether each rank holds its own part of the model states (ZeRO), not a replica.
  virtual bool shards_states() const = 0;
};

// The run's strategy: Single for one process without sharding, else make_engine's stage (DDP / ZeRO over `comm`).
std::unique_ptr<Strategy> make_strategy(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm);

}  // namespace sl::parallel
