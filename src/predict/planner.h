// The planner: predicts a recipe's peak device memory without making tensors, in the recipe's own
// checkpointing mode (predict/footprint.h's terms; mode budget's schedule solved with formula costs,
// predict/budget.h), finds the largest micro-batch that fits a memory size, and writes the `trainer
// plan` report and the out-of-memory advice. Used by `trainer plan`, the model-state check before any
// weight is made, the out-of-memory message, and train.micro_batch: auto.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "recompute/plan.h"
#include "config/config.h"
#include "predict/footprint.h"

namespace sl::planner {

// The scenario's peak in its own checkpointing mode and micro-batch, per rank of its placement. O(1)
// in n_layer (O(n_layer) with model.layer_mlp_hidden)
// (mode budget: its schedule is solved with formula costs, O(n_layer^2)).
memory::PeakPrediction predict_peak(const memory::Scenario& sc);
// Largest micro-batch (<= cap) whose predicted peak fits `memory_bytes`; 0 when not even 1 fits. Each
// probe is the scenario with only its micro_batch changed.
int64_t largest_micro_batch(const memory::Scenario& sc, int64_t memory_bytes, int64_t cap = 1 << 16);

// The `trainer plan` report: breakdown at the recipe's micro-batch for every checkpointing mode,
// and with memory_bytes > 0 the largest micro-batch per mode and the accumulation that keeps the
// recipe's global batch. It reads the whole recipe (its name, train.micro_batch: auto and
// train.global_batch beside the memory model's memory::Scenario), and asks each "what if" of a
// Scenario with one field changed (the micro-batch, the checkpointing mode).
nlohmann::json plan(const config::RunConfig& cfg, int64_t memory_bytes);
std::string format_plan(const nlohmann::json& plan);

// What offload (the recipe's offload section) moves per optimizer step on this rank, and the step
// time that costs on the recipe's hardware (offload.bandwidth_gbps, offload.overlap,
// offload.host_gbps, logging.peak_tflops). Bytes, counted as parallel/host_placement.cpp and
// recompute/checkpoint.cpp move them:
//   optimizer    to host: the gradient shard after clipping (4 B/param/N; not with offload.gradients);
//                to device: the master shard, cast to the compute dtype, into the all-gather
//                (zero1/2: once a step; zero3: at every gather, below)
//   gradients    to host: each micro-batch's reduced shard (reduce dtype, per param / N)
//   parameters   to device: each gathered unit's shard, per micro-batch: every unit in forward and
//                backward (the embeddings not in backward; a tied head gathers them again both
//                times), and each recomputed block once more
//   activations  both ways: each checkpointed segment's input, per micro-batch
// Time: streamed bytes (gradients, parameters, activations; the larger direction, the link being full
// duplex) overlap compute by offload.overlap; the step-boundary copies (optimizer) do not; the host
// AdamW reads and writes 28 bytes per parameter of the shard at offload.host_gbps; compute is the
// step's FLOPs (6 N + 12 L T d per token of this rank, B T / N of each sequence with parallel.sequence,
// plus the recomputed blocks' forward) at kModelledMfu of
// logging.peak_tflops (budget::kModelledMfu; 0 TFLOP/s: compute time unknown, and the step time is
// the offload's own cost).
struct OffloadTraffic {
  int64_t to_host_bytes = 0, to_device_bytes = 0;
  int64_t streamed_to_host_bytes = 0, streamed_to_device_bytes = 0;  // during forward and backward
  double compute_s = 0, streamed_s = 0, boundary_s = 0, host_adam_s = 0;
  double exposed_s = 0;  // the transfer time compute does not hide
  double step_s = 0;     // compute + exposed + host AdamW
};
OffloadTraffic offload_traffic(const memory::Scenario& sc, const recompute::Plan& plan);

// The modelled time of one optimizer step on this rank: compute as in OffloadTraffic (the step's FLOPs
// at kModelledMfu of logging.peak_tflops; 0 when that is 0) plus the sequence group's all-to-alls
// (memory::ActivationEstimate::all_to_all_bytes per micro-batch, at parallel.all_to_all_gbps, not
// hidden: each exchange feeds the attention or projection right after it).
struct StepTime {
  double compute_s = 0, all_to_all_s = 0, step_s = 0;
  int64_t all_to_all_bytes = 0;  // sent by this rank per step
};
StepTime modelled_step(const memory::Scenario& sc, const recompute::Plan& plan);

// `trainer plan --sequence-parallel auto`: the recipe's scenario (its checkpointing mode, micro-batch, placement)
// at every degree N that divides WORLD_SIZE, model.n_head and train.seq_len, smallest first: each one's
// per-rank peak, modelled step time and whether it fits memory_bytes. {"degrees": [{degree, peak_bytes,
// activation_peak_bytes, all_to_all_bytes_per_step, step_s, tokens_per_step, tokens_per_s, fits}], "chosen": the
// smallest that fits, or null}. A budget mode that fits no schedule at a degree does not fit there; at a degree above 1
// its row also has exchange_kept_blocks (the blocks whose recompute its schedule lets keep their exchanges).
// checkpointing.exchange auto in a mode that recomputes attention (not budget): at each degree above 1
// the row's own numbers are the recipe's (redo), "exchanges": {"redo": {...}, "keep": {...}} holds both
// choices' rows (the same keys less degree and tokens_per_step), "exchange" is "keep" where keep fits
// (its smaller step time: no exchange redone) else "redo", and the degree fits where either does; the
// search then has "chosen_exchange", the chosen degree's exchange.
nlohmann::json sequence_search(const memory::Scenario& sc, int64_t memory_bytes);
std::string format_sequence_search(const nlohmann::json& search, int64_t memory_bytes);

// One-line advice for an out-of-memory failure under `limit_bytes`: what the planner predicts fits,
// per checkpointing mode, with the grad_accum that keeps the batch per rank (sc.micro_batch x
// sc.grad_accum: before train.micro_batch: auto has its number, micro-batch 1 x the per-rank batch).
std::string oom_advice(const memory::Scenario& sc, int64_t limit_bytes);

}  // namespace sl::planner
