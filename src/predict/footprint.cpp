// A step's memory footprint: parameter counts, model states per sharding stage, a plan's whole peak.
#include "predict/footprint.h"

#include <variant>

#include <torch/torch.h>

#include "device/staging.h"
#include "model/gpt.h"

namespace sl::memory {
namespace {

// The largest flat group the engine forms: a unit under zero3, else a gradient bucket.
int64_t largest_group_params(const Scenario& sc, int64_t n) {
  const auto& d = sc.shape();
  if (sc.placement.sharding.shards_params())
    return std::max({d.trained_embedding_params(), d.n_layer > 0 ? d.trained_widest_block_params() : 0,
                     d.trained_head_params()});
  return std::min(n, bucket_cap_params(sc));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t bucket_cap_params(const Scenario& sc) {
  const auto cap = static_cast<int64_t>(sc.placement.bucket_mb * 1024 * 1024) / 4;
  return std::max(cap, sc.shape().largest_trained_param());  // a bigger single tensor gets its own bucket
}

std::vector<std::vector<model::NamedParam>> engine_group_members(
    const std::vector<std::vector<model::NamedParam>>& units, bool per_unit, int64_t cap_bytes) {
  std::vector<std::vector<model::NamedParam>> groups;
  if (per_unit) {
    for (auto u = units.rbegin(); u != units.rend(); ++u) {
      std::vector<model::NamedParam> trained;  // model.lora: the unit's adapters (none: no group)
      for (const auto& p : *u)
        if (p.tensor.requires_grad()) trained.push_back(p);
      if (!trained.empty()) groups.push_back(std::move(trained));
    }
    return groups;
  }
  int64_t bytes = 0;
  for (auto u = units.rbegin(); u != units.rend(); ++u)
    for (auto it = u->rbegin(); it != u->rend(); ++it) {
      if (!it->tensor.requires_grad()) continue;  // model.lora's frozen weights: held whole, outside the groups
      const auto b = static_cast<int64_t>(it->tensor.nbytes());
      if (groups.empty() || (bytes + b > cap_bytes && bytes > 0)) groups.emplace_back(), bytes = 0;
      groups.back().push_back(*it);
      bytes += b;
    }
  return groups;
}

std::vector<EngineGroup> engine_groups(const Scenario& sc) {
  torch::NoGradGuard no_grad;
  model::GPT g(sc.model, torch::kMeta);  // fp32, as the engine's groups are built
  const auto cap = static_cast<int64_t>(sc.placement.bucket_mb * 1024 * 1024);
  std::vector<EngineGroup> out;
  for (const auto& members : engine_group_members(g->units(), sc.placement.sharding.shards_params(), cap)) {
    EngineGroup& e = out.emplace_back();
    for (const auto& p : members) {
      e.params += p.tensor.numel();
      if (p.tensor.dim() >= 2) e.decay += p.tensor.numel();
    }
  }
  return out;
}

std::vector<int64_t> unit_param_counts(const config::ModelConfig& m) {
  torch::NoGradGuard no_grad;
  model::GPT g(m, torch::kMeta);
  std::vector<int64_t> units;
  for (const auto& unit : g->units()) {
    int64_t n = 0;
    for (const auto& p : unit) n += p.tensor.numel();
    units.push_back(n);
  }
  return units;
}

namespace {

// Where the engine's gradients are CPU tensors (the CPU device, or offload.gradients' host shards), its
// norm is one fused float64 pass with no copy (optim::sum_of_squares); on CUDA float64 copies of
// kGradNormChunk elements at a time. (The lazy test device runs at world 1 without sharding: no engine.)
bool engine_grads_on_cpu(const Scenario& sc) { return sc.placement.offload.gradients || !sc.on_cuda(); }

// One rank's part of the engine's layout (parallel/engine.cpp), in elements, summed over the groups. A
// group of n_g parameters (its d_g matrix elements first, the rest after) is padded to W shards of
// shard_elems(n_g, W). held: a sharded rank's shard, or a replicated rank's whole padded group:
// the fp32 masters and gradient buffers offload.optimizer puts on the host. owned: the real elements of
// it, which the optimizer updates (AdamW's moments) and a state file holds. pieces: the host AdamW's
// work items, kAdamwPiece elements of each tensor it updates (the owned part of [0, d_g) and of [d_g, n_g)).
struct RankPart {
  int64_t held = 0, owned = 0, pieces = 0;
};
RankPart rank_part(const std::vector<EngineGroup>& groups, int64_t W, bool replicated, int64_t rank) {
  RankPart r;
  for (const auto& g : groups) {
    const int64_t padded = shard_elems(g.params, W) * W, shard = replicated ? padded : padded / W;
    const int64_t lo = replicated ? 0 : rank * shard, hi = lo + shard;
    const auto overlap = [&](int64_t a, int64_t b) { return std::max<int64_t>(0, std::min(b, hi) - std::max(a, lo)); };
    const int64_t decay = overlap(0, g.decay), rest = overlap(g.decay, g.params);
    r.held += shard;
    r.owned += decay + rest;
    r.pieces += ceil_div(decay, kAdamwPiece) + ceil_div(rest, kAdamwPiece);
  }
  return r;
}

// Host memory, to the byte: offload.optimizer's states (4 B per held element each of the masters and the
// gradient shard, or the host AdamW's copy of it; 8 B per owned element of the moments) and state.async's
// snapshot (12 B per owned element, or per parameter on a replicated rank, and the RNG states) are held
// from the first step or save on; the host AdamW's index of its pieces (model::for_each_index: one int64
// per piece) lives through the optimizer step. The states and the snapshot are largest on rank 0 (every
// rank holds as much, and rank 0 owns no padding); the index may be one piece larger per group on a rank
// whose range straddles a group's d_g: the optimizer-phase term is the largest rank's excess over rank 0's
// states. Without an engine (world 1, sharding none) the snapshot is the whole model's.
void place_host(const Scenario& sc, PeakPrediction& p) {
  const bool offload = sc.placement.offload.optimizer, snapshot = sc.async_snapshot;
  if (!offload && !snapshot) return;
  const int64_t n = sc.shape().trained_params(), W = std::max<int64_t>(1, sc.placement.world);
  const bool replicated = sc.placement.sharding.replicated();
  const bool need_groups = offload || (!replicated && W > 1);
  const auto groups = need_groups ? engine_groups(sc) : std::vector<EngineGroup>{};
  const auto part = [&](int64_t rank) {
    return need_groups ? rank_part(groups, W, replicated, rank) : RankPart{n, n, 0};
  };
  const auto held_bytes = [&](const RankPart& r) {
    return (offload ? 8 * r.held + 8 * r.owned : 0) +
           (snapshot ? 12 * (replicated ? n : r.owned) + rng_state_bytes(sc.on_cuda()) : 0);
  };
  const RankPart r0 = part(0);
  if (offload) {
    p.host_params_bytes = 4 * r0.held;
    p.host_grads_bytes = 4 * r0.held;
    p.host_optimizer_bytes = 8 * r0.owned;
  }
  if (snapshot) p.host_snapshot_bytes = held_bytes(r0) - p.host_states_bytes();
  if (!offload) return;
  int64_t optimizer_phase = 0;  // max over ranks of held + index, less rank 0's held
  for (int64_t rank = 0; rank < (replicated ? 1 : W); ++rank) {
    const RankPart r = rank == 0 ? r0 : part(rank);
    optimizer_phase = std::max(optimizer_phase, held_bytes(r) + 8 * r.pieces - held_bytes(r0));
  }
  p.host_optimizer_temp_bytes = optimizer_phase;
}

// The AdamW step runs the fused CPU kernel (optim/optimizer.cpp: every tensor a contiguous fp32 CPU
// tensor, updated in place), not LibTorch's AdamW with its temporaries: on the CPU device (the lazy test
// device's tensors are not CPU tensors).
bool fused_cpu_adamw(const Scenario& sc) { return !sc.on_cuda() && sc.device != config::DeviceChoice::kLazy; }

// A checkpointed segment of 3 or more blocks can exist (its recompute's start holds a third block, see
// footprint.h): the recipe's uniform plan has one, or a budget schedule, not known here, may.
bool segment_of_three(const Scenario& sc) {
  const int64_t L = sc.model.n_layer;
  if (sc.checkpointing.mode.solved()) return L >= 3;
  return segment_counts(sc.checkpointing, L).largest_checkpointed >= 3;
}

// The stage's transients beside each phase's activations (footprint.h), from the engine's buffers:
// zero2's bucket gradient, zero3's gathered units (parameters in the compute dtype) and gradient buffer
// (reduce dtype), each group padded to the world size's shards.
void place_transients(const Scenario& sc, PeakPrediction& p) {
  const config::Sharding sh = sc.placement.sharding;
  const int64_t W = std::max<int64_t>(1, sc.placement.world);
  const int64_t cp = sc.precision.param_dtype.bytes(), cr = sc.precision.reduce_dtype.bytes();
  const auto padded = [&](int64_t elems) { return shard_elems(elems, W) * W; };
  if (sh == config::Sharding::kZero2) {
    p.transient_backward_bytes = p.transient_head_bytes =
        cr * padded(std::min(sc.shape().trained_params(), bucket_cap_params(sc)));
  } else if (sh.shards_params()) {
    const config::Shape d(sc.model);
    const int64_t L = d.n_layer;
    // model.lora: only the adapters are gathered (the frozen weights stay whole, in params_bytes)
    const int64_t ue = padded(d.trained_embedding_params()), ub = L > 0 ? padded(d.trained_widest_block_params()) : 0,
                  uh = padded(d.trained_head_params());
    const int64_t ut = uh + (d.tied ? ue : 0), second = L > 1 ? ub : 0;  // the head's gather; a second block
    const int64_t grad = cr * std::max(ub, uh);  // one unit's gradient buffer
    p.transient_forward_bytes = cp * std::max({ue + (L > 0 ? ub : ut), ub + second, ub + ut});
    if (segment_of_three(sc)) p.transient_forward_bytes = std::max(p.transient_forward_bytes, 3 * cp * ub + grad);
    p.transient_forward_end_bytes = cp * ut;
    p.transient_head_bytes = cp * (ut + ub) + cr * uh;
    p.transient_backward_bytes = cp * (ub + second) + grad;
  }
  p.transient_bytes = std::max({p.transient_forward_bytes, p.transient_forward_end_bytes, p.transient_head_bytes,
                                p.transient_backward_bytes});
}

// offload.*: the device terms the engine keeps on the host instead (parallel/host_placement.h; each stage's
// count_group; their host size: place_host).
void place_offloaded(const Scenario& sc, PeakPrediction& p) {
  const auto& o = sc.placement.offload;
  if (!o.optimizer) return;
  const int64_t n = sc.shape().trained_params(), frozen = sc.shape().frozen_bytes();
  const config::Sharding sh = sc.placement.sharding;
  const int64_t cp = sc.precision.param_dtype.bytes();
  // zero1/2: the whole model in the compute dtype for the all-gather
  p.params_bytes = frozen + (sh.shards_params() ? 0 : cp * n);
  p.optimizer_bytes = 0;
  if (o.gradients) p.grads_bytes = 0;
  // The host AdamW is the fused CPU kernel (optim/optimizer.h): in place, no temporaries; the norm of
  // host gradients (offload.gradients) is a CPU pass without a copy (engine_grads_on_cpu).
  p.adamw_temp_bytes = 0;
}

}  // namespace

PeakPrediction predict_states(const Scenario& sc) {
  PeakPrediction p;
  const config::Shape shape(sc.model);
  // model.lora: n the parameters that train (the adapters), held as any model's are; the frozen rest whole
  // in fp32 on every rank, outside the engine's groups (no gradient, no optimizer state).
  const int64_t n = shape.trained_params(), frozen = shape.frozen_bytes();
  const int64_t N = std::max<int64_t>(1, sc.placement.world);
  const config::Sharding sh = sc.placement.sharding;
  const int64_t P = 4 * n, G = 4 * n, O = 8 * n;
  // A low-precision compute copy (precision.param_dtype): fp32 masters only in the shard; zero1/2 keep
  // the whole model in the compute dtype, zero3 gathers units in it (place_transients).
  const int64_t cp = sc.precision.param_dtype.bytes();
  p.params_bytes = frozen + (sh.shards_params() ? P / N : cp < 4 ? P / N + cp * n : P);
  p.grads_bytes = sh.shards_grads() ? G / N : G;
  // optim.in_backward frees each gradient once its parameter is updated, in its backward: none is held.
  // The one in flight is the fresh weight gradient the activation model counts in each backward moment
  // (Wg, predict/activations.h), which here becomes the parameter's gradient instead of being added to it.
  if (sc.in_backward) p.grads_bytes = 0;
  p.optimizer_bytes = sh.shards_optimizer() ? O / N : O;
  place_transients(sc, p);
  p.batch_bytes = 2 * 8 * sc.local_tokens();  // this rank's positions (parallel.sequence)
  if (sc.model.arch == config::Arch::kLlama)
    p.buffer_bytes = 4 * sc.model.max_seq_len * (sc.model.n_embd / sc.model.n_head);
  // AdamW updates the model's parameters (none) or this rank's shard of each group; the engine's
  // norm reads whole groups (none) or shards. World 1 without sharding has no engine.
  const int64_t group = largest_group_params(sc, n), shard = ceil_div(group, N);
  if (!fused_cpu_adamw(sc)) p.adamw_temp_bytes = 2 * 4 * (sh.replicated() ? shape.largest_trained_param() : shard);
  if (sc.placement.uses_engine() && !engine_grads_on_cpu(sc))
    p.grad_norm_temp_bytes = 8 * std::min(kGradNormChunk, sh.replicated() ? group : shard);
  // fp32 masters and moments (model.lora: the adapters', the frozen weights are not saved)
  p.host_staging_bytes = device::host_staging_bytes(4 * shape.largest_trained_param());
  place_offloaded(sc, p);
  place_host(sc, p);
  return p;
}

PeakPrediction predict_peak(const Scenario& sc, const recompute::Plan& plan) {
  PeakPrediction p = predict_states(sc);
  p.activations = estimate_activation_peak(sc, plan);
  return p;
}

int64_t activation_budget_bytes(const Scenario& sc) {
  const config::Budget budget = std::get<config::mode::Budget>(config::choice(sc.checkpointing));  // mode budget only
  const PeakPrediction p = predict_states(sc);
  int64_t bytes = budget.bytes;
  if (budget.share > 0) {
    const int64_t room = sc.memory_limit - p.model_states_bytes() - p.buffer_bytes - p.batch_bytes;
    bytes = static_cast<int64_t>(budget.share * static_cast<double>(room));
  }
  return bytes - p.transient_bytes;
}

}  // namespace sl::memory
