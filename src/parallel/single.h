// One process without sharding: the strategy of a run with nothing to reduce or shard. The model's own
// parameters and gradients are what AdamW updates; the norm is computed and the gradients clipped on the
// device before the step's read (optim::clip_grad_norm), so nothing waits for the host in between.
//
// optim.in_backward (step_in_backward): each parameter gets a post-accumulate-grad hook. When its
// gradient is complete (autograd sums every use of a leaf before it accumulates, so once a backward) the
// hook adds the gradient's squared norm to the step's, runs AdamW on that parameter alone (optim::adamw_step
// steps the parameters that have a gradient, and only this one has) and frees the gradient. So at most the
// gradients autograd is accumulating at that moment exist, never the model's; optimizer_step does nothing
// and norm_share gives the norm of the gradients as they passed (no clipping: the recipe refuses it). The
// update is the ordinary step's arithmetic on the same gradient: the weights are bitwise the ordinary
// step's (tests/test_train.cpp); the norm sums the same squares in another order.
#pragma once
#include "parallel/strategy.h"

namespace sl::parallel {

class Single final : public Strategy {
 public:
  explicit Single(model::GPT model) : model_(std::move(model)) {}

  int64_t world() const override { return 1; }
  std::string describe() const override { return "1 rank: one process, nothing reduced or sharded"; }
  void attach(recompute::Runner&) override {}

  void zero_grad() override;
  void begin_backward(bool) override {}
  void end_backward() override {}
  std::vector<torch::Tensor> grads() const override;
  // The global norm itself (one rank): clip_grad_norm's, with the gradients clipped on the device.
  torch::Tensor norm_share(const std::vector<torch::Tensor>& grads, double max_norm) override;
  double global_norm(double summed_shares) const override { return summed_shares; }
  void clip(double, double) override {}  // done in norm_share
  void sum_over_ranks(torch::Tensor&, const std::string&) override {}
  void check_reduction(const std::string&) override {}
  void optimizer_step(torch::optim::AdamW& opt) override;
  void step_in_backward(torch::optim::AdamW& opt) override;
  // The hook's work for parameter p (step_in_backward).
  void update_in_backward(const torch::Tensor& p);

  StateBytes state_bytes() const override;
  Moved take_moved() override { return {}; }
  int64_t take_transient_peak() override { return 0; }
  int64_t gathers() const override { return 0; }
  nlohmann::json layout() const override { return nullptr; }

  std::vector<Span> owned_spans() const override { return model_spans(); }
  std::vector<Span> held_spans() const override { return model_spans(); }
  void params_loaded() override {}
  // The model's parameter itself, found by name (a tensor on a device without storage, such as the lazy
  // test device, has no storage to compare).
  OptSlot optimizer_slot(torch::optim::AdamW&, const Span& span) const override;
  void gather_unit(int64_t) override {}
  void release_unit(int64_t) override {}
  torch::Tensor param_values(const std::string& name) const override;

 protected:
  Trainables trainables() override;
  bool shards_states() const override { return false; }

 private:
  std::vector<Span> model_spans() const;
  model::GPT model_;
  torch::optim::AdamW* in_backward_ = nullptr;  // step_in_backward's optimizer
  double norm_sq_host_ = 0.0;  // the step's squared gradient norm so far: CPU gradients (fp64 sums) ...
  torch::Tensor norm_sq_;      // ... and the others' (float64, 0-d, on their device; undefined: none)
};

}  // namespace sl::parallel
