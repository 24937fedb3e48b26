// The checkpointing runner: runs a GPT's forward under a plan (recompute/plan.h): none, full
// (every block a segment), interval (k blocks per segment, or n segments), sqrt (k = round(sqrt(L))),
// selective (inside every block, recompute only the named cheap parts: attention core, MLP
// activation, norms), or budget's per-block schedule. The plan says which segments are checkpointed;
// Runner::forward runs the model under it with the checkpoint engine (recompute/checkpoint.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "recompute/checkpoint.h"
#include "recompute/plan.h"
#include "config/config.h"
#include "model/gpt.h"

namespace sl::recompute {

// The LinearAfter that runs block `layer` with its selective `parts` recomputed: recompute_then_linear
// on the chosen cheap-op -> linear pairs, plain linears on the others. What Runner runs in a kept block,
// and what the budget profile measures; `opts` must outlive the forward it is used in. keep_exchange: the
// recomputed attention keeps its sequence exchanges (Options::keep_exchange).
model::LinearAfter selective_linear_after(uint8_t parts, int64_t layer, const Options& opts,
                                          bool keep_exchange = false);

// Called around each unit of the forward (unit 0 the embeddings, 1..L the blocks, L+1 the final
// norm and head), in the first forward and again when a block is recomputed. ZeRO-3 gathers a unit's
// parameters in `before` and frees them in `after`; `in` is the unit's input (undefined for the
// embeddings), `out` its output. `flush` ends a chain of units (end of a forward or of a recompute).
struct UnitHooks {
  std::function<void(int64_t unit)> before;
  std::function<void(int64_t unit, const torch::Tensor& in, const torch::Tensor& out, bool needs_params_in_backward)>
      after;
  std::function<void()> flush;
};

class Runner {
 public:
  Runner(const config::CheckpointingConfig& cfg, model::GPT model);  // make_plan's plan
  Runner(const config::CheckpointingConfig& cfg, model::GPT model, Plan plan);

  torch::Tensor forward(const torch::Tensor& idx);  // (B, T) -> logits (B, T, V)
  // (B, T) inputs and targets -> the mean loss, the head and loss fused (GPTImpl::head_loss): what training
  // and evaluation run.
  // `positions`: packed rows' (data::Batch::positions), undefined otherwise.
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& positions = {});
  const Plan& plan() const { return plan_; }
  // Runs before each recompute with the piece's name (sharding re-gathers parameters here).
  void set_pre_recompute_hook(std::function<void(const std::string&)> hook) {
    opts_.pre_recompute_hook = std::move(hook);
  }
  void set_unit_hooks(UnitHooks hooks) { hooks_ = std::move(hooks); }
  Stats take_stats();  // since the last call
  // Forward FLOPs per token that backward re-runs (for HFU): each checkpointed block's
  // 2*P_block + 4*T*d, less 2*P_out for the last block of each checkpointed segment (its output
  // projection is not re-run), plus 4*T*d per block when the attention core is recomputed.
  double recompute_flops_per_token(int64_t seq_len) const;

 private:
  // output_unread: the block ends a recomputed segment, so nobody reads its output's values and its
  // last linear (the MLP's output projection) runs without output (linear_without_output).
  torch::Tensor block_forward(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                              bool output_unread = false);
  torch::Tensor block_forward_unhooked(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                                       bool output_unread);
  // the embeddings and blocks under the plan: (B, T, C)
  torch::Tensor trunk(const torch::Tensor& idx, const torch::Tensor& positions = {});
  config::CheckpointingConfig cfg_;
  model::GPT model_;
  template <class F>
  torch::Tensor unit(int64_t u, const torch::Tensor& in, bool needs_params_in_backward, F&& f);
  void flush() {
    if (hooks_.flush) hooks_.flush();
  }
  Plan plan_;
  Options opts_;
  std::shared_ptr<ActivationOffload> offload_;  // the plan offloads some segments' inputs
  UnitHooks hooks_;
};

}  // namespace sl::recompute
