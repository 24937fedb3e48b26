// The per-block plan: the rule from checkpointing.mode to segments, and its descriptions.
#include "recompute/plan.h"

#include <cmath>
#include <stdexcept>
#include <utility>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

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

bool Plan::keeps_exchange(int64_t block) const {
  return !exchange_kept.empty() && exchange_kept.at(static_cast<size_t>(block)) != 0;
}

bool Plan::recomputes_attention(int64_t block) const {
  for (const auto& s : segments)
    if (block >= s.begin && block < s.end) return s.checkpointed || (parts_of(block) & kPartAttention) != 0;
  return false;
}

int64_t Plan::checkpointed_blocks() const {
  int64_t n = 0;
  for (const auto& s : segments)
    if (s.checkpointed) n += s.end - s.begin;
  return n;
}

std::string Plan::describe() const {
  if (mode == config::CheckpointingMode::kNone) return "none";
  const std::string kept_exchange = !exchange_kept.empty() && !mode.solved() ? ", exchanges kept" : "";
  if (mode == config::CheckpointingMode::kSelective)
    return fmt::format("selective [{}] in every block{}", parts_name(parts_of(0)), kept_exchange);
  std::string segs;
  if (mode.solved()) {
    for (const auto& s : segments) {
      if (s.checkpointed) {
        segs += fmt::format("{}[{}..{}) recomputed{}{}", segs.empty() ? "" : ", ", s.begin, s.end,
                            s.offloaded ? ", input offloaded" : "", keeps_exchange(s.begin) ? ", exchange kept" : "");
        continue;
      }
      for (int64_t b = s.begin; b < s.end; ++b) {
        const auto parts = parts_of(b);
        segs += fmt::format("{}{} kept{}{}", segs.empty() ? "" : ", ", b, parts ? " [" + parts_name(parts) + "]" : "",
                            keeps_exchange(b) ? " exchange kept" : "");
      }
    }
    return fmt::format("budget {}: {}", log::format_bytes(budget.budget_bytes), segs);
  }
  for (const auto& s : segments)
    segs += fmt::format("{}[{}..{}){}", segs.empty() ? "" : " ", s.begin, s.end,
                        s.offloaded ? " offloaded" : s.checkpointed ? "" : " kept");
  return fmt::format("{} k={}: {} of {} segments checkpointed: {}{}", mode.name(), k,
                     std::count_if(segments.begin(), segments.end(), [](const Segment& s) { return s.checkpointed; }),
                     segments.size(), segs, kept_exchange);
}

nlohmann::json Plan::to_json() const {
  nlohmann::json segs = nlohmann::json::array();
  for (const auto& s : segments)
    segs.push_back({{"blocks", {s.begin, s.end}}, {"checkpointed", s.checkpointed}, {"offloaded", s.offloaded}});
  nlohmann::json j = {{"mode", mode},
          {"k", k},
          {"segments", segs},
          {"checkpointed_blocks", checkpointed_blocks()},
          {"selective", {{"attention", attention}, {"mlp", mlp}, {"norm", norm}}}};
  int64_t kept_exchanges = 0;
  for (size_t b = 0; b < exchange_kept.size(); ++b) kept_exchanges += exchange_kept[b];
  j["exchange_kept_blocks"] = kept_exchanges;
  if (!mode.solved()) return j;
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& s : segments)
    for (int64_t b = s.begin; b < s.end; ++b) {
      const auto parts = part_names(s.checkpointed ? 0 : parts_of(b));
      const char* choice = s.offloaded      ? "offload"
                           : s.checkpointed ? "recompute"
                           : parts.empty()  ? "keep"
                                            : "selective";
      blocks.push_back({{"block", b}, {"choice", choice}, {"parts", parts}, {"segment", {s.begin, s.end}},
                        {"exchange", keeps_exchange(b) ? "keep" : "redo"}});
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

uint8_t parts_of(const config::mode::Selective& s) {
  return static_cast<uint8_t>((s.attention ? kPartAttention : 0) | (s.mlp ? kPartMlp : 0) | (s.norm ? kPartNorm : 0));
}

namespace {

// std::visit over the alternatives of a checkpointing choice, one lambda each.
template <class... F>
struct Visitor : F... {
  using F::operator()...;
};
template <class... F>
Visitor(F...) -> Visitor<F...>;

}  // namespace

UniformRule uniform_rule(const config::CheckpointingConfig& cfg, int64_t L) {
  namespace mode = config::mode;
  UniformRule r;
  r.skip_last = cfg.skip_last;
  auto split = [&](int64_t k) {  // segments of k blocks, the last one takes what is left
    r.checkpointed = true;
    r.size = k;
    r.count = (L + k - 1) / k;
    r.last = L - (r.count - 1) * k;
  };
  auto kept = [&](uint8_t parts) {  // one segment: every block keeps its activations
    r.size = r.last = L;
    r.parts = parts;
  };
  std::visit(
      Visitor{
          [&](const mode::None&) { kept(0); },
          [&](const mode::Full&) { split(1); },
          [&](const mode::Sqrt&) { split(std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(L))))); },
          [&](const mode::Interval& m) {
            if (m.k > 0) return split(m.k);
            // checkpoint_sequential style: n segments of L / n blocks, the last one takes the remainder
            r.checkpointed = true;
            r.count = m.segments;
            r.size = L / r.count;
            r.last = L - (r.count - 1) * r.size;
          },
          [&](const mode::Selective& m) { kept(parts_of(m)); },
          [&](const mode::Budget&) {
            throw std::logic_error("uniform_rule: a budget plan comes from budget::solve_budget");
          },
      },
      config::choice(cfg));
  return r;
}

namespace {

// The segments of uniform_rule's plan.
void lay_out(const UniformRule& r, int64_t L, Plan& p) {
  if (!r.checkpointed) {
    p.segments.push_back({0, L, false});
    p.attention = (r.parts & kPartAttention) != 0;
    p.mlp = (r.parts & kPartMlp) != 0;
    p.norm = (r.parts & kPartNorm) != 0;
    p.block_parts.assign(static_cast<size_t>(L), r.parts);
    return;
  }
  p.k = r.size;
  for (int64_t i = 0; i < r.count; ++i)
    p.segments.push_back({i * r.size, i == r.count - 1 ? L : (i + 1) * r.size, true});
  if (r.skip_last) p.segments.back().checkpointed = false;
}

}  // namespace

Plan make_plan(const config::CheckpointingConfig& cfg, int64_t L) {
  Plan p;
  p.mode = cfg.mode;
  lay_out(uniform_rule(cfg, L), L, p);
  if (!cfg.exchange.keeps()) return p;
  p.exchange_kept.assign(static_cast<size_t>(L), 0);
  for (int64_t b = 0; b < L; ++b) p.exchange_kept[static_cast<size_t>(b)] = p.recomputes_attention(b) ? 1 : 0;
  return p;
}

}  // namespace sl::recompute
