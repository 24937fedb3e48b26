// The memory model's input: exactly what the activation model (predict/activations.h), the footprint
// (predict/footprint.h), the budget solver (predict/budget.h) and the planner (predict/planner.h) read
// of a recipe, typed and resolved once. A "what if" (another micro-batch, checkpointing mode or
// placement) is a copy of a Scenario with one field changed, never a copy of the recipe.
#pragma once
#include <cstdint>

#include "config/config.h"
#include "config/shape.h"

namespace sl::memory {

// Where the model states live and how they move: the ranks, their sharding stage and gradient buckets,
// and what offload.* keeps in host memory with its transfer model (bandwidth, overlap, host rate).
struct Placement {
  int64_t world = 1;                                   // ranks (the recipe's world_size)
  config::Sharding sharding = config::Sharding::kNone;  // parallel.sharding
  double bucket_mb = 25.0;                             // parallel.bucket_mb
  config::OffloadConfig offload;                       // offload.*
  // A data-parallel engine runs (config::ParallelConfig::uses_engine).
  bool uses_engine() const { return world > 1 || !sharding.replicated(); }
};

struct Scenario {
  config::ModelConfig model;                 // model.* (the meta-device model of the engine's groups, a profiled block)
  int64_t micro_batch = 1;                   // train.micro_batch, resolved (a number, never auto)
  int64_t seq_len = 1;                       // train.seq_len
  int64_t grad_accum = 1;                    // train.grad_accum
  int64_t sequence = 1;                      // parallel.sequence: each rank holds seq_len / sequence positions
  bool packing = false;                      // data.packing: packed rows, an attention mask per micro-batch
  bool in_backward = false;                  // optim.in_backward: one parameter's gradient at a time
  config::CheckpointingConfig checkpointing;  // checkpointing.* (mode, its parameters, the budget)
  Placement placement;
  config::PrecisionConfig precision;         // compute, param_dtype, reduce_dtype
  // train.device, resolved where the Scenario is made (auto: cuda where a GPU is present, else cpu): the
  // model reads the device from here and asks nothing of the machine.
  config::DeviceChoice device = config::DeviceChoice::kCpu;
  int64_t memory_limit = 0;                  // memory.limit in bytes (0: none); a budget's share is of it
  bool async_snapshot = false;               // state.async with state.every > 0: a host snapshot per save
  // logging.peak_tflops: the device's rate, against which offload's transfers are priced (the budget
  // solver's fourth choice, the planner's modelled step time); 0 = unknown.
  double peak_tflops = 0.0;
  double all_to_all_gbps = 100.0;  // parallel.all_to_all_gbps: the sequence group's exchange rate per rank

  // Tokens of one micro-batch on one rank: micro_batch x seq_len / sequence.
  int64_t local_tokens() const { return micro_batch * seq_len / sequence; }

  // The model's shape (parameter counts, MLP widths) of `model`.
  config::Shape shape() const { return config::Shape(model); }

  // Whether the recipe runs on CUDA (train.device cuda, or auto with a GPU present).
  bool on_cuda() const { return device == config::DeviceChoice::kCuda; }

  // The recipe's scenario, made once and explicitly: its micro-batch (train.micro_batch: auto before
  // set-up has its number: 1, where the model states and a micro-batch search start), mode, placement
  // at cfg.world_size ranks, precision and resolved device.
  static Scenario of(const config::RunConfig& cfg);
  // The same at another micro-batch (a search's probe, the number an auto micro-batch resolved to).
  Scenario at(int64_t micro_batch) const {
    Scenario s = *this;
    s.micro_batch = micro_batch;
    return s;
  }
};

}  // namespace sl::memory
