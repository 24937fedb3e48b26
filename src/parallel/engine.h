// Data parallelism over a Comm: DDP (parallel.sharding: none) and ZeRO stages 1-3.
//
// Parameters are grouped: for none/zero1/zero2 into buckets of parallel.bucket_mb in reverse
// parameter order (the order gradients arrive in), for zero3 into units (the embeddings, each block,
// the final norm + head). Each group is one flat fp32 buffer of W shards of S elements
// (memory::shard_elems: a multiple of 8, so every shard starts 16-byte aligned in fp32, bf16 and fp16);
// rank r owns elements [r*S, (r+1)*S). Inside a group matrices come first and vectors last, so a
// rank's shard splits into at most one decayed and one undecayed AdamW tensor: LibTorch's own AdamW
// updates the shard and, being elementwise, gives the same numbers as on the whole tensor.
//
//   none   params as built; .grad are views into the group's flat gradient; a group is all-reduced
//          (async) as soon as its last gradient is accumulated, on the last micro-batch only.
//   zero1  params are views into flat buffers; gradients as for none; AdamW over this rank's shard;
//          after the step, parameters are all-gathered.
//   zero2  like zero1, but each gradient is copied into a transient group buffer and freed; a ready
//          group is reduce-scattered (every micro-batch) and only the rank's shard is kept.
//   zero3  like zero2, and a unit's parameters exist only while gathered: before its forward
//          (freed after; the next unit's all-gather is started meanwhile), before its backward (from a
//          hook on its output's gradient, which also starts the previous block's all-gather; freed from
//          a hook on its input's gradient), and before a recompute (the block's forward runs again).
//
// Offload (the recipe's offload section, device/host.h) keeps the rank's shard in host memory (under
// DDP, none, the whole model is each rank's "shard": masters and moments on every rank's host, the
// updated masters copied into the parameters after the step):
//   optimizer   shard_param (the fp32 masters) and AdamW's moments live on the host and the AdamW step
//               runs there, on the same fused kernel; the gradient shard is copied to a host buffer
//               after clipping, and each group's master shard is copied back into its slot of
//               flat_param (cast to the compute dtype) for the all-gather (zero1/2) or each gather (zero3).
//   gradients   zero2/3: shard_grad lives on the host; each group's reduce-scatter result is added into
//               it as the group finishes, so the device holds at most the groups in flight.
//   parameters  zero3 with optimizer: the host masters are the only copy kept between uses; every
//               gather copies the unit's shard in from the host.
// Only bytes move: every value the optimizer reads and writes is the one it reads without offload.
//
// Collectives launch in one fixed group order on every rank, so they pair up across ranks
// whatever order autograd finishes gradients in. Sums are divided by the world size (Gloo has no AVG).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "checkpointing/runner.h"
#include "config/config.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/strategy.h"

namespace sl::parallel {

class Engine final : public Strategy {
 public:
  Engine(model::GPT model, const config::RunConfig& cfg, std::shared_ptr<Comm> comm);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  config::Sharding sharding() const { return sharding_; }
  Comm& comm() { return *comm_; }
  int64_t world() const override { return world_; }
  std::string describe() const override;  // ranks, backend, sharding

  // zero3: gathers/frees units around the forward (unit 0 embeddings, 1..L blocks, L+1 head).
  void attach(checkpointing::Runner& runner) override;

  void zero_grad() override;
  // Around each micro-batch's backward; `last` marks the micro-batch whose gradients are reduced
  // (none/zero1) — zero2/3 reduce-scatter every micro-batch and accumulate the shard.
  void begin_backward(bool last) override;
  void end_backward() override;  // launches what is left, waits; after the last: gradients are averaged
  // The gradients the optimizer will use (this rank's shards for zero*).
  std::vector<torch::Tensor> grads() const override;
  // This rank's share of the squared global L2 norm of the averaged gradient: a float64 0-d device
  // tensor, not read. Summed over ranks it is the squared norm (zero*: each rank holds a disjoint
  // shard; none: every rank holds the whole gradient, so rank 0 gives it and the others 0), which the
  // trainer does in its one all-reduce and host read per step.
  torch::Tensor grad_norm_sq_share();
  // Scales by max_norm / (norm + 1e-6) when that is < 1: a host scalar, nothing waits for the device.
  void clip(double max_norm, double norm) override;
  // The strategy's norm: grad_norm_sq_share(), summed over ranks and square-rooted by global_norm.
  torch::Tensor norm_share(const std::vector<torch::Tensor>&, double) override { return grad_norm_sq_share(); }
  double global_norm(double summed_shares) const override;
  void sum_over_ranks(torch::Tensor& t, const std::string& what) override;
  void check_reduction(const std::string& what) override;
  void after_step();              // zero1/2: all-gather the updated parameters
  // The step itself: AdamW over what this rank updates (on the host with offload.optimizer, its
  // gradients copied there first), then after_step().
  void optimizer_step(torch::optim::AdamW& opt) override;
  // After held_spans() were written (a load): a low-precision compute copy is re-made from the masters.
  void params_loaded() override;
  StateBytes state_bytes() const override;
  // The elements this rank's optimizer updates (none: every parameter in full; zero*: the shard).
  std::vector<Span> owned_spans() const override;
  // The fp32 parameter elements this rank stores between steps, what a load writes (zero3, a
  // low-precision compute copy or offload.optimizer: its master shard; otherwise every parameter).
  // Call params_loaded() after.
  std::vector<Span> held_spans() const override;
  // The shard piece (or, DDP, the parameter) whose storage holds the span.
  OptSlot optimizer_slot(torch::optim::AdamW& opt, const Span& span) const override;
  // zero3: gather every unit (a collective on every rank) so the whole model can be read; release_all
  // frees them again. No-ops for the other stages.
  void gather_all();
  void release_all();
  // One unit (model::kEmbeddingUnit, block_unit(l), head_unit) readable through param_values(), so the
  // model can be read unit by unit (final weights) holding at most one gathered unit: zero3 gathers it;
  // with a low-precision compute copy its groups' fp32 masters are gathered (collectives on every rank).
  void gather_unit(int64_t unit) override;
  void release_unit(int64_t unit) override;
  // A parameter's full fp32 values, flat (between gather_unit and release_unit of its unit).
  torch::Tensor param_values(const std::string& name) const override;
  // Largest transient bytes seen (gathered parameters and not-yet-reduced gradients), and reset.
  int64_t take_transient_peak() override;
  int64_t largest_unit_bytes() const;  // the largest group's parameter bytes
  int64_t groups() const { return static_cast<int64_t>(groups_.size()); }
  // Groups whose reduction the last reducing backward launched from a gradient hook, i.e. while
  // backward was still running (the rest were launched after it returned).
  int64_t launched_from_hooks() const { return launched_from_hooks_; }
  // zero3: group all-gathers since the last zero_grad() (one step: forward, recompute, backward, eval).
  int64_t gathers() const override { return gathers_; }
  Moved take_moved() override;
  // largest_group_bytes, groups, groups_launched_during_backward.
  nlohmann::json layout() const override;

 protected:
  // The model's parameters (DDP without offload) or this rank's shard pieces, each group's matrices and vectors.
  Trainables trainables() override;
  bool shards_states() const override { return !sharding_.replicated(); }

 private:
  struct Group;
  struct Layout {  // which parameters make which group (plan_groups)
    std::vector<std::vector<model::NamedParam>> members;
    std::vector<std::string> names;
    std::vector<int64_t> group_of_unit;
  };
  void build_groups(const config::RunConfig& cfg);
  Layout plan_groups(const config::RunConfig& cfg, const std::vector<std::vector<model::NamedParam>>& units) const;
  std::unique_ptr<Group> make_group(const std::string& name, std::vector<model::NamedParam> named);
  void shard_and_bind(Group& g, torch::Tensor flat);
  void materialize_units(const std::vector<std::vector<model::NamedParam>>& units, const std::vector<int64_t>& group_of_unit);
  void index_units(const std::vector<std::vector<model::NamedParam>>& units, const std::vector<int64_t>& group_of_unit);
  void add_grad_hooks();
  void on_param_grad(size_t group, size_t index);
  void check_same_init();
  torch::TensorOptions fp32_options() const;
  bool low_precision_copy() const;  // precision.param_dtype is not fp32
  torch::Tensor compute_shard(Group& g);
  void gather_master(Group& g);
  int64_t param_buffer_bytes(const Group& g) const;  // flat_param, in the compute dtype
  int64_t grad_buffer_bytes(const Group& g) const;   // zero2/3's transient flat_grad, in the reduce dtype
  void on_grad_ready(size_t group);
  void launch_ready();
  void launch(size_t group);
  void finish(size_t group);
  void finish_in_flight();
  void gather(int64_t unit);
  void release(int64_t unit);
  void start_gather(Group& g);
  void gather_group(Group& g);
  void release_group(Group& g);
  void unit_before(int64_t unit);
  void unit_after(int64_t unit, const torch::Tensor& in, const torch::Tensor& out, bool needs_params_in_backward);
  void unit_flush();
  void prefetch_backward(int64_t unit);
  void add_transient(int64_t bytes);
  void grads_to_host();
  void bind_replicated_masters(Group& g);
  void masters_to_params();
  // The elements of a group this rank's optimizer updates: its shard, or (DDP) the whole group.
  std::pair<int64_t, int64_t> owned_range(const Group& g) const;

  model::GPT model_;
  std::shared_ptr<Comm> comm_;
  config::Sharding sharding_;
  at::ScalarType param_dtype_, reduce_dtype_;
  int64_t rank_, world_;
  c10::Device device_;
  bool offload_optimizer_, offload_grads_;  // the recipe's offload section (offload.parameters is zero3 + optimizer)
  Moved moved_;
  bool deferred_;         // the model came with deferred parameters (zero3 materializes its shards)
  double init_sum_ = 0;   // sum of the initial parameters (checked equal on every rank)
  std::vector<std::unique_ptr<Group>> groups_;  // in launch order
  std::vector<std::vector<size_t>> unit_groups_;  // unit -> groups it needs gathered (zero1/2: holding its parameters)
  std::map<std::string, std::pair<size_t, size_t>> where_;  // parameter name -> (group, index in it)
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<size_t> in_flight_;
  size_t cursor_ = 0;
  bool last_micro_ = true;
  bool in_backward_ = false;
  int64_t launched_from_hooks_ = 0;
  int64_t gathers_ = 0;
  std::optional<std::pair<torch::Tensor, int64_t>> pending_out_;  // zero3: last unit output without a hook yet
  int64_t transient_ = 0, transient_peak_ = 0;
};

}  // namespace sl::parallel
