// Recompute policies: segment plans and the model forward under them.
#include "recompute/policy.h"

#include <array>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "log/metrics.h"

namespace sl::recompute {

std::vector<std::string> part_names(uint8_t parts) {
  std::vector<std::string> out;
  for (auto [bit, name] : {std::pair{kPartAttention, "attention"}, {kPartMlp, "mlp"}, {kPartNorm, "norm"}})
    if (parts & bit) out.emplace_back(name);
  return out;
}

std::string parts_name(uint8_t parts) { return fmt::format("{}", fmt::join(part_names(parts), ", ")); }

uint8_t Plan::parts_of(int64_t block) const {
  return block_parts.empty() ? 0 : block_parts.at(static_cast<size_t>(block));
}

int64_t Plan::checkpointed_blocks() const {
  int64_t n = 0;
  for (const auto& s : segments)
    if (s.checkpointed) n += s.end - s.begin;
  return n;
}

std::string Plan::describe() const {
  if (mode == "none") return "none";
  if (mode == "selective") return fmt::format("selective [{}] in every block", parts_name(parts_of(0)));
  std::string segs;
  if (mode == "budget") {
    for (const auto& s : segments) {
      if (s.checkpointed) {
        segs += fmt::format("{}[{}..{}) recomputed", segs.empty() ? "" : ", ", s.begin, s.end);
        continue;
      }
      for (int64_t b = s.begin; b < s.end; ++b) {
        const auto parts = parts_of(b);
        segs += fmt::format("{}{} kept{}", segs.empty() ? "" : ", ", b, parts ? " [" + parts_name(parts) + "]" : "");
      }
    }
    return fmt::format("budget {}: {}", log::format_bytes(budget.budget_bytes), segs);
  }
  for (const auto& s : segments)
    segs += fmt::format("{}[{}..{}){}", segs.empty() ? "" : " ", s.begin, s.end, s.checkpointed ? "" : " kept");
  return fmt::format("{} k={}: {} of {} segments checkpointed: {}", mode, k,
                     std::count_if(segments.begin(), segments.end(), [](const Segment& s) { return s.checkpointed; }),
                     segments.size(), segs);
}

nlohmann::json Plan::to_json() const {
  nlohmann::json segs = nlohmann::json::array();
  for (const auto& s : segments) segs.push_back({{"blocks", {s.begin, s.end}}, {"checkpointed", s.checkpointed}});
  nlohmann::json j = {{"mode", mode},
          {"k", k},
          {"segments", segs},
          {"checkpointed_blocks", checkpointed_blocks()},
          {"selective", {{"attention", attention}, {"mlp", mlp}, {"norm", norm}}}};
  if (mode != "budget") return j;
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& s : segments)
    for (int64_t b = s.begin; b < s.end; ++b) {
      const auto parts = part_names(s.checkpointed ? 0 : parts_of(b));
      blocks.push_back({{"block", b}, {"choice", s.checkpointed ? "recompute" : parts.empty() ? "keep" : "selective"},
                        {"parts", parts}, {"segment", {s.begin, s.end}}});
    }
  j["blocks"] = blocks;
  j["budget"] = {{"budget_bytes", budget.budget_bytes},
                 {"quantum_bytes", budget.quantum_bytes},
                 {"predicted_activation_peak_bytes", budget.predicted_peak_bytes},
                 {"recompute_cost", budget.recompute_cost},
                 {"forward_cost", budget.forward_cost},
                 {"cost_source", budget.cost_source},
                 {"cost_unit", budget.cost_unit},
                 {"bytes_source", budget.bytes_source},
                 {"solve_ms", budget.solve_ms}};
  return j;
}

Plan make_plan(const config::CheckpointingConfig& cfg, int64_t L) {
  if (cfg.mode == "budget") throw std::logic_error("make_plan: a budget plan comes from recompute::solve_budget");
  Plan p;
  p.mode = cfg.mode;
  auto split = [&](int64_t k) {
    p.k = k;
    for (int64_t b = 0; b < L; b += k) p.segments.push_back({b, std::min(b + k, L), true});
  };
  if (cfg.mode == "full") {
    split(1);
  } else if (cfg.mode == "sqrt") {
    split(std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(L)))));
  } else if (cfg.mode == "interval" && cfg.interval > 0) {
    split(cfg.interval);
  } else if (cfg.mode == "interval") {
    // checkpoint_sequential style: n segments of L / n blocks, the last one takes the remainder.
    const int64_t n = cfg.segments, size = L / n;
    p.k = size;
    for (int64_t i = 0; i < n; ++i) p.segments.push_back({i * size, i == n - 1 ? L : (i + 1) * size, true});
  } else {
    p.segments.push_back({0, L, false});
    p.attention = p.mlp = p.norm = false;  // selective (none: all false)
    for (const auto& part : cfg.recompute) {
      p.attention |= part == "attention";
      p.mlp |= part == "mlp";
      p.norm |= part == "norm";
    }
    const auto parts = static_cast<uint8_t>((p.attention ? kPartAttention : 0) | (p.mlp ? kPartMlp : 0) | (p.norm ? kPartNorm : 0));
    p.block_parts.assign(static_cast<size_t>(L), parts);
    return p;
  }
  if (cfg.skip_last) p.segments.back().checkpointed = false;
  return p;
}

model::LinearAfter selective_linear_after(uint8_t parts, int64_t layer, const Options& opts) {
  static const char* kPartNames[] = {"norm1->qkv", "attention->proj", "norm2->fc", "act->out"};
  const std::array<bool, 4> recompute = {(parts & kPartNorm) != 0, (parts & kPartAttention) != 0,
                                         (parts & kPartNorm) != 0, (parts & kPartMlp) != 0};
  return [recompute, layer, o = &opts](model::Part part, const model::CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
                                       const std::vector<torch::Tensor>& cheap_params, const torch::Tensor& W,
                                       const torch::Tensor& b) {
    const auto i = static_cast<size_t>(part);
    if (!recompute[i]) return at::linear(cheap(inputs), W, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
    return recompute_then_linear(fmt::format("block {} {}", layer, kPartNames[i]), cheap, inputs, cheap_params, W, b, *o);
  };
}

Policy::Policy(const config::CheckpointingConfig& cfg, model::GPT model)
    : Policy(cfg, model, make_plan(cfg, model->cfg.n_layer)) {}

Policy::Policy(const config::CheckpointingConfig& cfg, model::GPT model, Plan plan)
    : cfg_(cfg), model_(std::move(model)), plan_(std::move(plan)) {
  opts_.preserve_rng = cfg.preserve_rng;
  opts_.check_recompute = cfg.check_recompute;
}

Stats Policy::take_stats() {
  settle_device_times(*opts_.stats);
  Stats s = *opts_.stats;
  *opts_.stats = Stats{};
  return s;
}

template <class F>
torch::Tensor Policy::unit(int64_t u, const torch::Tensor& in, bool needs_params_in_backward, F&& f) {
  if (hooks_.before) hooks_.before(u);
  torch::Tensor out = f();
  if (hooks_.after) hooks_.after(u, in, out, needs_params_in_backward);
  return out;
}

torch::Tensor Policy::block_forward(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                                   bool output_unread) {
  return unit(model::block_unit(block.layer), x, true,
              [&] { return block_forward_unhooked(block, x, rope, output_unread); });
}

torch::Tensor Policy::block_forward_unhooked(model::BlockImpl& block, const torch::Tensor& x, const model::Rope& rope,
                                             bool output_unread) {
  if (output_unread) {
    auto linear_after = [](model::Part part, const model::CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
                           const std::vector<torch::Tensor>&, const torch::Tensor& W, const torch::Tensor& b) {
      if (part == model::Part::act_out) return linear_without_output(cheap(inputs), W, b);
      return at::linear(cheap(inputs), W, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
    };
    return block.forward_with(x, rope, linear_after);
  }
  const uint8_t parts = plan_.parts_of(block.layer);
  if (parts == 0) return block.forward(x, rope);
  return block.forward_with(x, rope, selective_linear_after(parts, block.layer, opts_));
}

torch::Tensor Policy::forward(const torch::Tensor& idx) {
  // The embedding backward needs the indices only, not the table: its parameters need no re-gather.
  auto x = unit(model::kEmbeddingUnit, torch::Tensor(), false, [&] { return model_->embed(idx); });
  const auto rope = model_->rope(idx.size(1));
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
    x = checkpoint(fmt::format("segment {} (blocks {}..{})", si, seg.begin, seg.end - 1), fn, {x}, params, opts_)[0];
  }
  auto logits = unit(model::head_unit(model_->cfg), x, true, [&] { return model_->head(x); });
  flush();
  return logits;
}

double Policy::recompute_flops_per_token(int64_t seq_len) const {
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
