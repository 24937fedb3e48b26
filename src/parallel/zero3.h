// ZeRO-3 (parallel.sharding: zero3): Zero2's gradient path and optimizer layout, with a group per unit
// (the embeddings, each block, the final norm + head) whose parameters exist only while gathered:
// before its forward (freed after; the next unit's all-gather is started meanwhile), before its
// backward (from a hook on its output's gradient, which also starts the previous block's all-gather;
// freed from a hook on its input's gradient), and before a recompute (the block's forward runs again).
// With offload.parameters the host masters are the only copy kept between uses: every gather copies
// the unit's shard in from the host (compute_shard, through the HostPlacement).
#pragma once
#include <optional>
#include <utility>

#include "parallel/stages.h"

namespace sl::parallel {

class Zero3 final : public Zero2 {
 public:
  Zero3(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm)
      : Zero2(std::move(model), spec, std::move(comm)) {}

  // Gathers/frees units around the forward (unit 0 embeddings, 1..L blocks, L+1 head).
  void attach(recompute::Runner& runner) override;
  void end_backward() override;
  void gather_all() override;
  void release_all() override;
  std::vector<Span> held_spans() const override { return shard_spans(); }  // the masters are its own buffers

 protected:
  bool groups_per_unit() const override { return true; }
  // The compute copy is not resident: only flat_param's storage is kept until the unit is gathered.
  void bind_values(Group& g, torch::Tensor flat) override;
  void launch_group(size_t gi) override;
  void after_step() override {}  // the next gather reads the updated masters
  void count_group(StateBytes& s, const Group& g) const override;
  void gather_params(int64_t unit) override { gather(unit); }
  void release_params(int64_t unit) override { release(unit); }

 private:
  void gather(int64_t unit);
  void release(int64_t unit);
  void start_gather(Group& g);
  void gather_group(Group& g);
  void release_group(Group& g);
  void unit_before(int64_t unit);
  void unit_after(int64_t unit, const torch::Tensor& in, const torch::Tensor& out, bool needs_params_in_backward);
  void unit_flush();
  void prefetch_backward(int64_t unit);

  std::optional<std::pair<torch::Tensor, int64_t>> pending_out_;  // last unit output without a hook yet
};

}  // namespace sl::parallel
