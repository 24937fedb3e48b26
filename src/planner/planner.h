// The planner: predicts a recipe's peak device memory without making tensors, in the recipe's own
// checkpointing mode (memory/footprint.h's terms; mode budget's schedule solved with formula costs,
// budget/budget.h), finds the largest micro-batch that fits a memory size, and writes the `trainer
// plan` report and the out-of-memory advice. Used by `trainer plan`, the model-state check before any
// weight is made, the out-of-memory message, and train.micro_batch: auto.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "config/config.h"
#include "memory/footprint.h"

namespace sl::planner {

// The recipe's own checkpointing mode and micro-batch, per rank of cfg.world_size. O(1) in n_layer
// (O(n_layer) with model.layer_mlp_hidden)
// (mode budget: its schedule is solved with formula costs, O(n_layer^2)).
memory::PeakPrediction predict_peak(const config::RunConfig& cfg);
// Largest micro-batch (<= cap) whose predicted peak fits `memory_bytes`; 0 when not even 1 fits.
int64_t largest_micro_batch(const config::RunConfig& cfg, int64_t memory_bytes, int64_t cap = 1 << 16);

// The `trainer plan` report: breakdown at the recipe's micro-batch for every checkpointing mode,
// and with memory_bytes > 0 the largest micro-batch per mode and the accumulation that keeps the
// recipe's global batch.
nlohmann::json plan(const config::RunConfig& cfg, int64_t memory_bytes);
std::string format_plan(const nlohmann::json& plan);

// One-line advice for an out-of-memory failure under `limit_bytes`: what the planner predicts fits.
std::string oom_advice(const config::RunConfig& cfg, int64_t limit_bytes);

}  // namespace sl::planner
