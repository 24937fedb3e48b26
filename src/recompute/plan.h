// The per-block plan of activation checkpointing: which blocks run inside checkpointed segments
// (their activations recomputed in backward), which keep theirs, and which selective parts a kept
// block recomputes. Made from the recipe once (make_plan; mode budget: predict/budget.h), then read by
// the engine (recompute/runner.h), the memory model (predict/activations.h) and the reports.
// Torch-free: the memory formulas and the planner use it without building a model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/config.h"

namespace sl::recompute {

struct Segment {
  int64_t begin = 0, end = 0;  // blocks [begin, end)
  bool checkpointed = false;
  bool offloaded = false;  // checkpointed, its input in host memory until its backward (offload.activations)
};

// Selective parts as bits (a block's set of parts recomputed inside it).
inline constexpr uint8_t kPartAttention = 1, kPartMlp = 2, kPartNorm = 4;
inline constexpr int kPartSets = 8;
std::vector<std::string> part_names(uint8_t parts);  // {"attention", "mlp"}; {} for none
std::string parts_name(uint8_t parts);               // "attention, mlp"; "" for none

// How a budget plan was chosen (predict/budget.h).
struct BudgetInfo {
  int64_t budget_bytes = 0;        // the activation budget the schedule was solved for
  int64_t quantum_bytes = 0;       // the solver's memory step (its error bound is n_layer of them)
  int64_t predicted_peak_bytes = 0;
  double recompute_cost = 0;       // the schedule's recompute time in cost_unit
  double forward_cost = 0;         // one forward of all blocks in cost_unit (for scale)
  std::string cost_source, cost_unit;  // profile / formula; ms / GFLOP
  double solve_ms = 0;
  std::string bytes_source = "formula";  // profile (measured per block) / formula (predict/activations.h)
};

struct Plan {
  config::CheckpointingMode mode = config::CheckpointingMode::kNone;
  int64_t k = 0;  // blocks per segment (full: 1; interval/sqrt: k; none/selective: 0)
  std::vector<Segment> segments;
  bool attention = false, mlp = false, norm = false;  // selective parts
  std::vector<uint8_t> block_parts;  // selective parts of each block (kept blocks only; empty = none)
  // checkpointing.exchange (parallel.sequence > 1): per block, 1 where its recompute (its checkpointed
  // segment's, or its selective attention's) takes the exchanged tensors the first pass kept instead of
  // redoing the all-to-alls; every block of a segment alike. Empty: every recompute redoes them.
  std::vector<uint8_t> exchange_kept;
  BudgetInfo budget;                 // budget: how the schedule was chosen
  uint8_t parts_of(int64_t block) const;  // the selective parts block `block` recomputes
  bool keeps_exchange(int64_t block) const;  // exchange_kept's entry (false when empty)
  // Whether block `block` is recomputed with its attention (a checkpointed segment's, or selective
  // attention): the blocks whose exchanges a recompute redoes or keeps.
  bool recomputes_attention(int64_t block) const;
  int64_t checkpointed_blocks() const;
  std::string describe() const;  // one line for the start-up table
  nlohmann::json to_json() const;
};

// The rule of every mode but budget, in O(1) of the block count L: `count` segments of `size` blocks
// each, the last one of `last` blocks (checkpointed: full 1, interval k or L / segments, sqrt
// round(sqrt(L)); all checkpointed but the last under skip_last); or one kept segment of all L blocks,
// each recomputing the selective `parts` (none: no parts). make_plan lists its segments; the memory
// model counts them without a list (memory::segment_counts).
struct UniformRule {
  bool checkpointed = false;
  int64_t size = 0, count = 1, last = 0;
  bool skip_last = false;
  uint8_t parts = 0;
};
UniformRule uniform_rule(const config::CheckpointingConfig& cfg, int64_t n_layer);
// A selective choice's parts as bits (kPartAttention | ...).
uint8_t parts_of(const config::mode::Selective& s);

// Segments for a config and a block count: uniform_rule's, listed, with checkpointing.exchange: keep
// every recomputed attention's exchange kept. Not for mode budget, whose plan comes from predict/budget.h.
Plan make_plan(const config::CheckpointingConfig& cfg, int64_t n_layer);

}  // namespace sl::recompute
