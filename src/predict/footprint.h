// A step's memory footprint, predicted without making tensors (parameter counts are closed formulas,
// O(1) in n_layer): model states (fp32 weights, gradients, AdamW's two moments), the activation peak
// of a checkpointing plan (predict/activations.h), the input batch, and the optimizer step's
// temporaries. The planner (predict/planner.h) applies it to a recipe's own plan and searches
// micro-batches with it; the budget solver (predict/budget.h) takes its room for activations from it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/config.h"
#include "predict/activations.h"
#include "predict/scenario.h"

namespace sl::model {
struct NamedParam;
}

namespace sl::memory {

// parallel::Engine::grad_norm_sq_share reduces a gradient that is not on the CPU in float64 this many
// elements at a time: one chunk's float64 copy (8 MiB) is its temporary (on the CPU: none).
inline constexpr int64_t kGradNormChunk = int64_t{1} << 20;
// The fused CPU AdamW (optim/optimizer.cpp, fused_updates) splits every tensor it updates into pieces of
// this many elements and indexes them with an int64 tensor (model::for_each_index), made in host memory
// under offload.optimizer: 8 bytes a piece, through the optimizer step.
inline constexpr int64_t kAdamwPiece = int64_t{1} << 14;
// Every rank's shard of an engine group starts on a 16-byte boundary in each dtype the group is held
// in (fp32 masters and gradients; bf16/fp16 compute copies and reduce buffers): a multiple of 8
// elements. NCCL's collectives and _fused_adamw_ take their vectorized paths only on aligned
// addresses (the flat buffers themselves come 512-byte aligned from the caching allocator).
inline constexpr int64_t kShardAlignElems = 8;
// Elements of one rank's shard of a group of `numel` parameters over `world` ranks: ceil(numel / world)
// rounded up to kShardAlignElems. The group is padded to world x shard elements (zeros that no
// optimizer reads: the padding is counted in what a rank holds, not in what it owns).
inline constexpr int64_t shard_elems(int64_t numel, int64_t world) {
  const int64_t per_rank = (numel + world - 1) / world;
  return (per_rank + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
}

// Per rank, for the scenario's ranks (placement.world) and parallel.sharding (P, G, O = fp32 weights, gradients and
// AdamW's two moments of the whole model; N = world size):
//   none  P + G + O      zero1  P + G + O/N      zero2  P + (G + O)/N      zero3  (P + G + O)/N
// With precision.param_dtype bf16/fp16 parameters count 2 bytes when gathered (the fp32 masters stay
// in the shard), and reduce_dtype sets the gradient buffers' size.
// Beside the activations the stage holds transients (parallel/stages.cpp, zero3.cpp), which differ between the
// moments of predict/activations.h: the forward (F), the start of backward (A: the loss's backward,
// before any parameter gradient or gather), the LM head's backward (H, once the logits' gradient
// exists) and the blocks' backward (D, B). With U_e, U_b, U_h the parameters of the embeddings, the
// largest block and the head (final norm, and the LM head when untied), each group padded to N shards
// (shard_elems), U_t = U_h, plus U_e when the head is tied (its gathers take the embeddings too), p and
// r the bytes of param_dtype and reduce_dtype:
//   zero2  F, A  none
//          H, D, B  one bucket's full gradient, made at its first parameter gradient: r x its padded
//                elements
//   zero3  F     a block's forward: the unit and the next, prefetched, p max(U_e + U_b, 2 U_b, U_b + U_t);
//                a checkpointed segment of 3 or more blocks also holds, at the start of its recompute,
//                its last two blocks (gathered for its backward) and its first beside the gradient
//                buffer of the unit after it, 3 p U_b + r max(U_b, U_h), with the activations of a
//                block's forward beside the segment inputs (a budget schedule may have one);
//                the end of the forward: the head's units, p U_t (the loss comes after their release)
//          A     none
//          H     the head's units, gathered by the hook on the logits' gradient, the last block,
//                prefetched, and the head's gradient buffer: p (U_t + U_b) + r U_h
//          D, B  the block and the one before it (prefetched), and one gradient buffer (the block's,
//                or the unit's after it until the block's first gradient arrives): 2 p U_b + r max(U_b, U_h)
//                (one block fewer in a one-block model)
// A step's peak is the larger of two phases:
//   activations  model states + batch + the largest of each moment's activations plus its transient
//   optimizer    model states + batch + the step's temporaries, after backward freed the activations:
//                on CUDA AdamW's update makes two temporaries the size of its largest tensor (sqrt of
//                the second moment, and that divided by the bias correction), and the sharded engine's
//                gradient norm one float64 chunk (kGradNormChunk elements, or the largest group if
//                smaller); on the CPU the AdamW step is a fused in-place kernel (optim/optimizer.cpp)
//                whose only tensor is its index of pieces (8 bytes per kAdamwPiece elements, left
//                out), and the norms of CPU gradients, clipping's (optim/clip.h) and the engine's,
//                make only scalars.
// Non-parameter buffers (the RoPE tables) count in both.
// Offload (parallel/host_placement.h) moves terms to host memory: offload.optimizer the fp32 master shard
// (zero1/2 keep the whole group on the device in the compute dtype; zero3 nothing), the moments, a
// host copy of the gradient shard (the host AdamW, a fused in-place CPU kernel, makes no temporaries);
// offload.gradients the gradient shard (its norm then a CPU pass without a copy); offload.activations the
// checkpointed inputs (predict/activations.h).
struct PeakPrediction {
  int64_t params_bytes = 0, grads_bytes = 0, optimizer_bytes = 0;  // held by this rank
  // sharding: gathered parameters and unreduced gradients beside the activations of a block's forward
  // and of the forward's end (F), the head's backward (H) and the blocks' backward (D, B) (above), and
  // the largest of them (the room a budget schedule leaves beside its activations)
  int64_t transient_forward_bytes = 0, transient_forward_end_bytes = 0, transient_head_bytes = 0,
          transient_backward_bytes = 0;
  int64_t transient_bytes = 0;
  int64_t batch_bytes = 0;  // the (B, T/N) int64 inputs and targets of one micro-batch (N = parallel.sequence)
  int64_t buffer_bytes = 0;  // the model's non-parameter buffers (RoPE cos/sin tables)
  int64_t adamw_temp_bytes = 0;  // AdamW's two temporaries of its largest tensor
  int64_t grad_norm_temp_bytes = 0;  // the gradient norm's float64 chunk (the engine, off the CPU)
  // Host memory (not in the device peak): a save or the final-weights export on a non-CPU device
  // stages one bounded piece at a time (device/staging.h); CPU runs write from the tensors themselves.
  int64_t host_staging_bytes = 0;
  // state.async with state.every > 0: a save's host snapshot of this rank's state file (state/state.h
  // AsyncSave), allocated at the first save and reused by the later ones until the run ends: the fp32 parameters and
  // both AdamW moments of the elements this rank's optimizer updates (12 B each: every element on rank 0 of a
  // replicated run; under zero1/2/3 rank 0's part of every group, ceil(n_g / N) of its n_g), and the
  // RNG states (rng_state_bytes). It counts in the host peak.
  int64_t host_snapshot_bytes = 0;
  // offload.* (the terms above then count what stays on the device): the rank's shard of the fp32
  // masters, of the gradient (its host copy, or the shard itself with offload.gradients) and of the
  // moments in host memory (the optimizer step makes no temporaries there: a fused in-place AdamW, and
  // the gradient norm a pass without a copy), each group's shard with its padding to a multiple of the
  // world size (engine_groups); the moments only of the real elements. Rank 0's, the largest.
  int64_t host_params_bytes = 0, host_grads_bytes = 0, host_optimizer_bytes = 0;
  // offload.optimizer: the host AdamW's index of its pieces (kAdamwPiece), during the optimizer step,
  // from the rank where it is largest beside the held host memory (that rank's held host memory and
  // index, less rank 0's held host memory; the index may be a piece larger per group on another rank).
  int64_t host_optimizer_temp_bytes = 0;
  ActivationEstimate activations;  // activations.host_bytes: offload.activations' inputs
  int64_t host_states_bytes() const { return host_params_bytes + host_grads_bytes + host_optimizer_bytes; }
  // The host pool's peak on the rank where it is largest, to the byte on CPU: the held states and snapshot
  // plus the larger of the two phases' transients, the checkpointed inputs (forward and backward) and the
  // AdamW index (the optimizer step). These are every tensor a run makes in host memory
  // (tests/test_offload.cpp trains at memory.host_limit equal to it).
  int64_t host_peak_bytes() const {
    return host_states_bytes() + host_snapshot_bytes + std::max(activations.host_bytes, host_optimizer_temp_bytes);
  }
  int64_t model_states_bytes() const { return params_bytes + grads_bytes + optimizer_bytes; }
  // The activations' own peak, and each moment a transient is held beside with it.
  int64_t activation_phase_bytes() const {
    const auto& a = activations;
    const auto beside = [](int64_t transient, int64_t act) { return transient > 0 ? transient + act : 0; };
    return std::max({a.peak_bytes, beside(transient_forward_bytes, a.forward_block_peak_bytes),
                     beside(transient_forward_end_bytes, a.forward_end_peak_bytes),
                     beside(transient_head_bytes, a.head_backward_peak_bytes),
                     beside(transient_backward_bytes, a.backward_peak_bytes)});
  }
  int64_t optimizer_phase_bytes() const { return std::max(adamw_temp_bytes, grad_norm_temp_bytes); }
  int64_t peak_bytes() const {
    return model_states_bytes() + buffer_bytes + batch_bytes +
           std::max(activation_phase_bytes(), optimizer_phase_bytes());
  }
};

// The RNG states a training state holds (state/components.cpp): the CPU generator's, 5056 bytes
// (at::CPUGeneratorImpl::get_state: the legacy THGeneratorState layout; tests/test_memory.cpp checks it
// against LibTorch), and on CUDA the run's GPU's, 16 bytes (Philox seed and offset).
inline constexpr int64_t kCpuRngStateBytes = 5056, kCudaRngStateBytes = 16;
inline int64_t rng_state_bytes(bool cuda) { return kCpuRngStateBytes + (cuda ? kCudaRngStateBytes : 0); }

// Model states, sharding transients, batch, buffers, optimizer temporaries and host staging of the
// scenario, per rank of its placement: every term but the activations. O(1) in n_layer, except the host
// terms at world size > 1 (offload.optimizer, state.async's snapshot under sharding): O(n_layer), from
// engine_groups.
PeakPrediction predict_states(const Scenario& sc);
// The whole prediction for a given plan (planner::predict_peak resolves the recipe's own).
PeakPrediction predict_peak(const Scenario& sc, const recompute::Plan& plan);

// checkpointing.budget as the bytes a budget schedule's activation peak may reach: the size given, or
// the share of what memory.limit leaves after the model states, buffers and batch; less, under
// zero2/zero3, the largest phase's transient (transient_bytes: a bucket's full gradient / the gathered
// units), which the step holds beside the activations. May be <= 0 (nothing fits).
int64_t activation_budget_bytes(const Scenario& sc);  // checkpointing.mode budget only

// Parameter counts are the model's shape's (config::Shape: closed formulas, saturating at
// config::kMaxParams). Parameters in the largest gradient bucket the engine can form: parallel.bucket_mb's worth, or a
// bigger single tensor (which gets a bucket of its own).
int64_t bucket_cap_params(const Scenario& sc);
// Which parameters make which group of parallel::Engine (its plan_groups takes them from here, the host
// terms below count them): with `per_unit` (zero3) one group per unit, the last unit first (backward's
// order); otherwise buckets of at most `cap_bytes`, filled with the parameters from the last to the
// first, a larger tensor in a bucket of its own. Only parameters that train: model.lora's frozen weights
// are in no group (held whole), and a unit without adapters has no zero3 group.
std::vector<std::vector<model::NamedParam>> engine_group_members(
    const std::vector<std::vector<model::NamedParam>>& units, bool per_unit, int64_t cap_bytes);
// The recipe's engine groups (engine_group_members on a meta-device model): params, the group's
// parameter elements; decay, those of its matrices (laid out first: weight decay applies to them).
// O(n_layer).
struct EngineGroup {
  int64_t params = 0, decay = 0;
};
std::vector<EngineGroup> engine_groups(const Scenario& sc);
// Parameters per sharding unit: [0] embeddings (token + position tables), [1..L] the blocks,
// [L+1] the final norm (+ LM head when untied). Counted on a meta-device model: O(n_layer).
std::vector<int64_t> unit_param_counts(const config::ModelConfig& m);

}  // namespace sl::memory
