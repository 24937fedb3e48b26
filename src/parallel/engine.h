// Data parallelism over a Comm: the base of the stage classes (parallel/stages.h: Ddp for
// parallel.sharding none, Zero1, Zero2, Zero3), chosen once by make_engine.
//
// Parameters are grouped: for none/zero1/zero2 into buckets of parallel.bucket_mb in reverse
// parameter order (the order gradients arrive in), for zero3 into units (the embeddings, each block,
// the final norm + head). Each group (parallel/group.h) is one flat fp32 buffer of W shards of S
// elements (memory::shard_elems: a multiple of 8, so every shard starts 16-byte aligned in fp32, bf16
// and fp16); rank r owns elements [r*S, (r+1)*S). Inside a group matrices come first and vectors last,
// so a rank's shard splits into at most one decayed and one undecayed AdamW tensor: LibTorch's own
// AdamW updates the shard and, being elementwise, gives the same numbers as on the whole tensor.
//
// Engine holds what every stage shares: the groups and their layout, the gradient hooks and the order
// collectives launch in, the averaging, norm, clip and step, the transient-memory count and the spans
// a save reads. A stage class binds each group's buffers (bind_group), takes each parameter's
// gradient (take_grad), launches a ready group's reduction (launch_group) and says what follows the
// step (after_step), what it holds (state bytes, spans) and how a unit is gathered. Offload is the
// HostPlacement member (parallel/host_placement.h) every stage calls to place masters and gradient
// shards and to copy them.
//
// Collectives launch in one fixed group order on every rank, so they pair up across ranks
// whatever order autograd finishes gradients in. Sums are divided by the world size (Gloo has no AVG).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "recompute/runner.h"
#include "config/config.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/group.h"
#include "parallel/host_placement.h"
#include "parallel/strategy.h"

namespace sl::parallel {

class Engine : public Strategy {
 public:
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Comm& comm() { return *comm_; }
  int64_t world() const override { return world_; }
  std::string describe() const override;  // ranks, backend, sharding

  void attach(recompute::Runner&) override {}
  void zero_grad() override;
  // Around each micro-batch's backward; `last` marks the micro-batch whose gradients are reduced
  // (none/zero1) — zero2/3 reduce-scatter every micro-batch and accumulate the shard.
  void begin_backward(bool last) override;
  void end_backward() override;  // launches what is left, waits; after the last: gradients are averaged
  // Every parameter's accumulator node and its gradient-ready hook made again on the current stream
  // (false: some node was still held by a live autograd graph and kept its stream).
  bool hooks_to_current_stream() override;
  // The gradients the optimizer will use (this rank's shards for zero*).
  std::vector<torch::Tensor> grads() const override;
  // This rank's share of the squared global L2 norm of the averaged gradient: a float64 0-d device
  // tensor, not read. Summed over ranks it is the squared norm (zero*: each rank holds a disjoint
  // shard; none: every rank holds the whole gradient, so rank 0 gives it and the others 0), which the
  // trainer does in its one all-reduce and host read per step.
  virtual torch::Tensor grad_norm_sq_share();
  // Scales by max_norm / (norm + 1e-6) when that is < 1: a host scalar, nothing waits for the device.
  void clip(double max_norm, double norm) override;
  // The strategy's norm: grad_norm_sq_share(), summed over ranks and square-rooted by global_norm.
  torch::Tensor norm_share(const std::vector<torch::Tensor>&, double) override { return grad_norm_sq_share(); }
  double global_norm(double summed_shares) const override;
  void sum_over_ranks(torch::Tensor& t, const std::string& what) override;
  void check_reduction(const std::string& what) override;
  // The step itself: AdamW over what this rank updates (on the host with offload.optimizer, its
  // gradients copied there first), then after_step().
  void optimizer_step(torch::optim::AdamW& opt) override;
  // After held_spans() were written (a load): a low-precision compute copy is re-made from the masters.
  void params_loaded() override { after_step(); }
  StateBytes state_bytes() const override;
  // The shard piece (or, DDP, the parameter) whose storage holds the span.
  OptSlot optimizer_slot(torch::optim::AdamW& opt, const Span& span) const override;
  // zero3: gather every unit (a collective on every rank) so the whole model can be read; release_all
  // frees them again. No-ops for the other stages.
  virtual void gather_all() {}
  virtual void release_all() {}
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
  Moved take_moved() override { return host_.take_moved(); }
  // largest_group_bytes, groups, groups_launched_during_backward.
  nlohmann::json layout() const override;

 protected:
  Engine(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm);
  // Makes the groups (a stage's bind_group gives them buffers) and checks every rank built the same
  // model: called once, by make_engine, after the stage class is constructed.
  void init(const Spec& spec);
  friend std::unique_ptr<Engine> make_engine(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm);

  // ---- what a stage decides ----
  virtual bool groups_per_unit() const { return false; }  // zero3: a group per unit, else buckets
  // A new group's buffers: gradients (flat_grad, shard_grad, accum, step_grad) and masters.
  virtual void bind_group(Group& g) = 0;
  // Parameter i of g has this backward's gradient in its .grad.
  virtual void take_grad(Group& g, size_t i) = 0;
  virtual void launch_group(size_t gi) = 0;  // every gradient of the group is in
  virtual void after_step() = 0;             // after the AdamW step (and a load)
  virtual void count_group(StateBytes& s, const Group& g) const = 0;  // state_bytes' share of one group
  // A group's full fp32 values drawn by a deferred model (zero3): the rank keeps its master shard.
  virtual void bind_values(Group& g, torch::Tensor flat);
  virtual void gather_params(int64_t) {}   // gather_unit without a low-precision copy (zero3 gathers)
  virtual void release_params(int64_t) {}
  // The elements of a group this rank's optimizer updates: its shard, or (DDP) the whole group.
  virtual std::pair<int64_t, int64_t> owned_range(const Group& g) const;

  // ---- what the stages share ----
  std::vector<Span> shard_spans() const;     // the owned_range of every parameter, on the masters
  std::vector<Span> param_spans() const;     // every parameter in full
  Trainables shard_pieces();                 // the masters' owned ranges, matrices and vectors apart
  void bind_flat_grad(Group& g);             // a persistent fp32 flat gradient, .grad views of it
  // The fp32 master shard from the group's full fp32 values; the parameters become views of
  // flat_param, in the compute dtype. `resident`: the compute copy is kept between uses (not zero3).
  void shard_and_bind(Group& g, torch::Tensor flat, bool resident);
  torch::Tensor full_values(const Group& g) const;  // a group's parameters, copied into one fp32 buffer
  torch::Tensor compute_shard(Group& g);     // the rank's masters in the compute dtype, in its slot
  void all_reduce(size_t gi);                // the last micro-batch's gradient all-reduce (none, zero1)
  void ensure_grad_buffer(Group& g);         // zero2/3: the transient flat gradient, zeros if none came
  void copy_into_buffer(Group& g, size_t i);  // zero2/3: parameter i's .grad into it, then freed
  void reduce_scatter(size_t gi);
  void finish_in_flight();
  void all_gather_params();                  // zero1/2: every group's parameters from the shards
  void add_transient(int64_t bytes);
  torch::TensorOptions fp32_options() const;
  bool low_precision_copy() const;  // precision.param_dtype is not fp32
  int64_t param_buffer_bytes(const Group& g) const;  // flat_param, in the compute dtype
  int64_t grad_buffer_bytes(const Group& g) const;   // zero2/3's transient flat_grad, in the reduce dtype

  model::GPT model_;
  std::shared_ptr<Comm> comm_;
  std::string stage_name_;
  at::ScalarType param_dtype_, reduce_dtype_;
  int64_t rank_, world_;
  c10::Device device_;
  HostPlacement host_;    // the recipe's offload section
  bool deferred_;         // the model came with deferred parameters (zero3 materializes its shards)
  double init_sum_ = 0;   // sum of the initial parameters (checked equal on every rank)
  std::vector<std::unique_ptr<Group>> groups_;  // in launch order
  std::vector<std::vector<size_t>> unit_groups_;  // unit -> groups it needs gathered (zero1/2: holding its parameters)
  bool last_micro_ = true;
  bool in_backward_ = false;
  int64_t gathers_ = 0;

 private:
  struct Layout {  // which parameters make which group (plan_groups)
    std::vector<std::vector<model::NamedParam>> members;
    std::vector<std::string> names;
    std::vector<int64_t> group_of_unit;  // -1: a unit with no group (model.lora: nothing of it trains)
  };
  void build_groups(int64_t bucket_bytes);  // parallel.bucket_mb in bytes (buckets only)
  Layout plan_groups(int64_t bucket_bytes, const std::vector<std::vector<model::NamedParam>>& units) const;
  std::unique_ptr<Group> make_group(const std::string& name, std::vector<model::NamedParam> named);
  void materialize_units(const std::vector<std::vector<model::NamedParam>>& units,
                         const std::vector<int64_t>& group_of_unit);
  void materialize_frozen(const model::NamedParam& np);
  void index_units(const std::vector<std::vector<model::NamedParam>>& units, const std::vector<int64_t>& group_of_unit);
  void add_grad_hooks();
  void on_param_grad(size_t group, size_t index);
  void check_same_init();
  void gather_master(Group& g);
  void launch_ready();
  void finish(size_t group);

  Trainables trainables() override { return shard_pieces(); }
  std::map<std::string, std::pair<size_t, size_t>> where_;  // parameter name -> (group, index in it)
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<size_t> in_flight_;
  size_t cursor_ = 0;
  int64_t launched_from_hooks_ = 0;
  int64_t transient_ = 0, transient_peak_ = 0;
};

// The data-parallel engine for spec.parallel.sharding: Ddp, Zero1, Zero2 or Zero3 (parallel/stages.h).
std::unique_ptr<Engine> make_engine(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm);

}  // namespace sl::parallel
