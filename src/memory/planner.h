// Memory planner: predicts a recipe's peak device memory without making tensors (the model is built
// on the meta device to count parameters): model states (fp32 weights, gradients, AdamW's two
// moments), the activation peak of the checkpointing plan (memory/activations.h), and the input
// batch; finds the largest micro-batch that fits a memory size. Used by `trainer plan`, by the
// out-of-memory message, and by train.micro_batch: auto.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/config.h"
#include "memory/activations.h"

namespace sl::memory {

// Per rank, for cfg.world_size ranks and parallel.sharding (P, G, O = fp32 weights, gradients and
// AdamW's two moments of the whole model; N = world size):
//   none  P + G + O      zero1  P + G + O/N      zero2  P + (G + O)/N      zero3  (P + G + O)/N
// plus what the stage holds transiently at the step's peak: zero2 one bucket's full gradient; zero3
// the largest unit's gathered parameters and its full gradient.
struct PeakPrediction {
  int64_t params_bytes = 0, grads_bytes = 0, optimizer_bytes = 0;  // held by this rank
  int64_t transient_bytes = 0;  // sharding: gathered parameters / unreduced gradients at the peak
  int64_t batch_bytes = 0;  // the (B, T) int64 inputs and targets of one micro-batch
  ActivationEstimate activations;
  int64_t model_states_bytes() const { return params_bytes + grads_bytes + optimizer_bytes; }
  int64_t peak_bytes() const { return model_states_bytes() + transient_bytes + batch_bytes + activations.peak_bytes; }
};

// The recipe's own checkpointing mode and micro-batch, per rank of cfg.world_size.
PeakPrediction predict_peak(const config::RunConfig& cfg);

// Parameters per sharding unit: [0] embeddings (token + position tables), [1..L] the blocks,
// [L+1] the final norm (+ LM head when untied). Counted on the meta device.
std::vector<int64_t> unit_param_counts(const config::ModelConfig& m);
int64_t total_params(const config::ModelConfig& m);

// Largest micro-batch (<= cap) whose predicted peak fits `memory_bytes`; 0 when not even 1 fits.
int64_t largest_micro_batch(const config::RunConfig& cfg, int64_t memory_bytes, int64_t cap = 1 << 16);

// The `trainer plan` report: breakdown at the recipe's micro-batch for every checkpointing mode,
// and with memory_bytes > 0 the largest micro-batch per mode and the accumulation that keeps the
// recipe's global batch.
nlohmann::json plan(const config::RunConfig& cfg, int64_t memory_bytes);
std::string format_plan(const nlohmann::json& plan);

// One-line advice for an out-of-memory failure under `limit_bytes`: what the planner predicts fits.
std::string oom_advice(const config::RunConfig& cfg, int64_t limit_bytes);

}  // namespace sl::memory
