// The checkpointing runner: the model forward under a plan (see runner.h).
#include "recompute/runner.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "log/metrics.h"
#include "model/linear.h"

namespace sl::recompute {
namespace {

// What a unit's forward allocates: its activations; in backward (a checkpointed piece re-run) the
// recompute's transients; in eval, eval.
device::Label unit_label() {
  switch (device::current_phase().phase) {
    case device::Phase::backward: return device::Label::recompute;
    case device::Phase::eval: return device::Label::eval;
    default: return device::Label::activations;
  }
}

// With detailed tags (a memory timeline records), the unit's backward becomes the thread's phase
// when the gradient of its output arrives (CPU autograd runs on the thread that called backward).
// Otherwise nothing is added to the graph.
void mark_backward(int64_t unit, const torch::Tensor& out) {
  if (!device::detailed_tags() || !torch::GradMode::is_enabled() || !out.defined() || !out.requires_grad()) return;
  out.register_hook(
      [u = static_cast<int32_t>(unit)](const torch::Tensor&) { device::set_phase(device::Phase::backward, u); });
}

}  // namespace

model::LinearAfter selective_linear_after(uint8_t parts, int64_t layer, const Options& opts, bool keep_exchange) {
  static const char* kPartNames[] = {"norm1->qkv", "attention->proj", "norm2->fc", "act->out"};
  const std::array<bool, 4> recompute = {(parts & kPartNorm) != 0, (parts & kPartAttention) != 0,
                                         (parts & kPartNorm) != 0, (parts & kPartMlp) != 0};
  return [recompute, layer, keep_exchange, o = &opts](
             model::Part part, const model::CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
             const std::vector<torch::Tensor>& cheap_params, const torch::Tensor& W, const torch::Tensor& b,
             const model::LoraAdapter& lora) {
    const auto i = static_cast<size_t>(part);
    if (!recompute[i]) return lora.linear(cheap(inputs), W, b);
    const auto name = fmt::format("block {} {}", layer, kPartNames[i]);
    if (part != model::Part::attention_proj || !keep_exchange)
      return recompute_then_linear(name, cheap, inputs, cheap_params, W, b, lora, *o);
    Options keeping = *o;  // the attention's piece keeps its exchanges
    keeping.keep_exchange = true;
    return recompute_then_linear(name, cheap, inputs, cheap_params, W, b, lora, keeping);
  };
}

Runner::Runner(const config::CheckpointingConfig& cfg, model::GPT model)
    : Runner(cfg, model, make_plan(cfg, model->cfg.n_layer)) {}

Runner::Runner(const config::CheckpointingConfig& cfg, model::GPT model, Plan plan)
    : cfg_(cfg), model_(std::move(model)), plan_(std::move(plan)) {
  opts_.preserve_rng = cfg.preserve_rng;
  opts_.check_recompute = cfg.check_recompute;
  // offload.activations: the plan's offloaded segments keep their inputs in host memory.
  // (opts_ itself never offloads: selective pieces of kept blocks keep their inputs.)
  if (std::any_of(plan_.segments.begin(), plan_.segments.end(), [](const Segment& s) { return s.offloaded; }))
    offload_ = std::make_shared<ActivationOffload>();
}

Stats Runner::take_stats() {
  settle_device_times(*opts_.stats);
  Stats s = *opts_.stats;
  *opts_.stats = Stats{};
  return s;
}

template <class F>
torch::Tensor Runner::unit(int64_t u, const torch::Tensor& in, bool needs_params_in_backward, F&& f) {
  if (hooks_.before) hooks_.before(u);
  torch::Tensor out;
  {
    device::LabelScope label(unit_label(), static_cast<int32_t>(u));
    out = f();
  }
  mark_backward(u, out);
  if (hooks_.after) hooks_.after(u, in, out, needs_params_in_backward);
  return out;
}

torch::Tensor Runner::block_forward(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                                   bool output_unread) {
  return unit(model::block_unit(block.layer), x, true,
              [&] { return block_forward_unhooked(block, x, rope, output_unread); });
}

torch::Tensor Runner::block_forward_unhooked(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                                             bool output_unread) {
  if (output_unread) {
    auto linear_after = [](model::Part part, const model::CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
                           const std::vector<torch::Tensor>&, const torch::Tensor& W, const torch::Tensor& b,
                           const model::LoraAdapter& lora) {
      const auto a = cheap(inputs);
      if (part == model::Part::act_out) return lora.add_to(linear_without_output(a, W, b), a);
      return lora.linear(a, W, b);
    };
    return block.forward_with(x, rope, linear_after);
  }
  const uint8_t parts = plan_.parts_of(block.layer);
  if (parts == 0) return block.forward(x, rope);
  return block.forward_with(x, rope,
                            selective_linear_after(parts, block.layer, opts_, plan_.keeps_exchange(block.layer)));
}

torch::Tensor Runner::forward(const torch::Tensor& idx) {
  const auto x = trunk(idx);
  auto logits = unit(model::head_unit(model_->cfg), x, true, [&] { return model_->head(x); });
  flush();
  return logits;
}

torch::Tensor Runner::loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& positions) {
  const auto x = trunk(idx, positions);
  const auto u = model::head_unit(model_->cfg);
  auto loss = unit(u, x, true, [&] {
    const auto h = model_->final_norm(x);
    // The training forward's fused head and loss carry the loss's label (eval keeps eval's).
    const device::LabelScope scope(unit_label() == device::Label::activations ? device::Label::loss : unit_label());
    return model_->classifier_loss(h, targets);
  });
  flush();
  return loss;
}

torch::Tensor Runner::trunk(const torch::Tensor& idx, const torch::Tensor& positions) {
  if (offload_) offload_->begin_forward();
  // The embedding backward needs the indices only, not the table: its parameters need no re-gather.
  auto x = unit(model::kEmbeddingUnit, torch::Tensor(), false, [&] { return model_->embed(idx, positions); });
  const auto rope = model_->rope(idx.size(1), positions);
  auto& blocks = *model_->blocks;
  for (size_t si = 0; si < plan_.segments.size(); ++si) {
    const auto seg = plan_.segments[si];
    if (!seg.checkpointed) {
      for (int64_t b = seg.begin; b < seg.end; ++b) x = block_forward(*blocks[b]->as<model::BlockImpl>(), x, rope);
      continue;
    }
    std::vector<torch::Tensor> params;
    for (int64_t b = seg.begin; b < seg.end; ++b)
      for (const auto& p : blocks[b]->parameters()) params.push_back(p);
    auto model = model_;
    auto fn = [this, model, seg, rope](const std::vector<torch::Tensor>& in) {
      // Grad mode is on only in the recompute (a Function's forward runs without it). There the
      // segment's output is a graph root whose values backward never reads (unless compared by
      // check_recompute).
      const bool recompute = torch::GradMode::is_enabled() && !opts_.check_recompute;
      auto h = in[0];
      for (int64_t b = seg.begin; b < seg.end; ++b)
        h = block_forward(*(*model->blocks)[b]->as<model::BlockImpl>(), h, rope, recompute && b == seg.end - 1);
      flush();  // a recompute's last block: its backward starts right after this returns
      return std::vector<torch::Tensor>{h};
    };
    Options opts = opts_;
    if (seg.offloaded) opts.offload = offload_;
    opts.keep_exchange = plan_.keeps_exchange(seg.begin);
    x = checkpoint(fmt::format("segment {} (blocks {}..{})", si, seg.begin, seg.end - 1), fn, {x}, params, opts)[0];
    mark_backward(model::block_unit(seg.end - 1), x);  // the segment's backward starts with its last block's
  }
  return x;
}

double Runner::recompute_flops_per_token(int64_t seq_len) const {
  const auto& c = model_->cfg;
  const double attn_fwd = 4.0 * static_cast<double>(seq_len) * static_cast<double>(c.n_embd);
  auto block = [&](int64_t l) { return (*model_->blocks)[static_cast<size_t>(l)]->as<model::BlockImpl>(); };
  double flops = 0.0;
  for (const auto& seg : plan_.segments) {  // each recomputed block's own matmuls (blocks may differ in MLP size)
    if (!seg.checkpointed) continue;
    for (int64_t l = seg.begin; l < seg.end; ++l) {
      const auto* b = block(l);
      for (const auto* w : {&b->w_qkv, &b->w_proj, &b->w_fc, &b->w_out}) flops += 2.0 * static_cast<double>(w->numel());
      flops += attn_fwd;
    }
    if (!cfg_.check_recompute) flops -= 2.0 * static_cast<double>(block(seg.end - 1)->w_out.numel());
  }
  for (int64_t l = 0; l < c.n_layer; ++l) flops += (plan_.parts_of(l) & kPartAttention) ? attn_fwd : 0.0;
  return flops;
}

}  // namespace sl::recompute
