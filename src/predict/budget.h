// checkpointing.mode: budget: per block, keep its activations, keep them but recompute some selective
// parts, or recompute it inside a checkpointed segment, so that the predicted activation peak stays
// within the budget and the recompute time is least. Solved exactly by dynamic programming over the
// chain of blocks (memory quantized, with the error bound below), costs from a profiling pass of real
// block forwards or from a FLOP formula.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "recompute/runner.h"
#include "config/config.h"
#include "predict/activations.h"
#include "model/gpt.h"

namespace sl::budget {

// The per-block plan's vocabulary (recompute/plan.h): a schedule is one of its plans.
using recompute::kPartAttention;
using recompute::kPartMlp;
using recompute::kPartNorm;
using recompute::kPartSets;
using recompute::Plan;
using recompute::Segment;
using memory::Scenario;

// What re-running a block's pieces costs, in one unit for the whole chain (ms or GFLOP).
struct BlockCost {
  double forward = 0;    // the whole block's forward: a block inside a checkpointed segment
  double output = 0;     // its MLP output projection, which a segment's last block skips
  double attention = 0;  // selective parts: the attention core (SDPA)
  double mlp = 0;        // the MLP activation
  double norm = 0;       // both norms
  // parallel.sequence > 1: the attention's two forward all-to-alls (already in `attention` and
  // `forward`), which a recompute that keeps its exchanges (checkpointing.exchange) does not redo
  double exchange = 0;
  double parts(uint8_t set) const;  // the selective parts in `set` (kPartAttention | ...)
};

// What one block holds, measured on the run's device and precision, in bytes of one micro-batch, in
// memory::ChainModel's terms (without autocast's weight copies, which the model counts apart):
// kept[b] what its forward keeps for backward with selective parts b recomputed (its input included),
// backward[b] the most its backward holds beyond that, forward what a run without saving holds beyond
// its input.
struct BlockBytes {
  std::array<double, kPartSets> kept{}, backward{};
  double forward = 0;
};

// Per-block costs and where they came from: source "profile" (unit ms) or "formula" (unit GFLOP), and
// per block the bytes the profile measured (empty: the activation formula's, memory::chain_model).
struct Costs {
  std::vector<BlockCost> blocks;
  std::string source, unit;
  std::vector<BlockBytes> bytes;
};

struct Schedule {
  bool feasible = false;
  std::vector<Segment> segments;     // kept blocks (one segment each) and checkpointed segments
  std::vector<uint8_t> block_parts;  // selective parts of each kept block
  std::vector<uint8_t> exchange_kept;  // per block, 1 where its recompute keeps its exchanges (empty: none does)
  double cost = 0;                   // recompute cost of the schedule
  double peak_bytes = 0;             // memory::chain_peak of it
  double quantum_bytes = 0;
};

// The schedule as a checkpointing plan (mode budget: its segments, selective parts and kept exchanges).
Plan as_plan(const Schedule& s);

// The least-cost schedule whose activation peak (memory::chain_peak's walk) is at most budget_bytes.
// Dynamic programming over blocks left to right. The state is the memory the blocks so far keep for
// backward, in buckets of budget_bytes / quanta bytes; each bucket keeps its least-cost path (on a tie
// the one holding less) with that path's exact bytes, and every moment is checked with exact bytes, so
// the schedule found never exceeds the budget. Error bound: two paths in one bucket differ by less than
// a quantum, so after i choices the DP holds, for any schedule, a path of no greater cost holding at
// most i quanta more; any schedule whose peak is at most budget_bytes - n_layer * quantum is therefore
// matched or beaten. With autocast's weight copies (bf16/fp16 with fp32 parameters), a kept block's
// copies count in the forward moments too (conservative there). O(L^2 * quanta) time, O(L * quanta)
// memory (28 bytes a state). quanta must be below 2^31.
// With offload_cost >= 0 (offload.activations) a checkpointed segment may also put its input in host
// memory: it then keeps nothing on the device for backward and costs offload_cost more; every backward
// moment is checked with one more segment input on the device (the prefetch, recompute/checkpoint.h).
// Under sequence parallelism (mem.exchange_kept non-zero) `exchange` (checkpointing.exchange) says what a
// recompute does about a block's exchanges: redo (never keep), keep (every block whose attention is
// recomputed keeps), auto (either, per block). A kept block with selective attention that keeps holds
// its Kx (memory::ChainModel::exchange_kept) through its backward and costs BlockCost::exchange less; a
// checkpointed segment that keeps (all its blocks alike) holds its blocks' Kx after its first pass
// (each block's first pass beside the Kx of those before it), makes no exchange buffers in its
// recompute, and costs its blocks' exchanges less.
Schedule solve_budget(const memory::ChainModel& mem, const std::vector<BlockCost>& costs, double budget_bytes,
                      int64_t quanta = 16384, double offload_cost = -1.0,
                      config::Exchange exchange = config::Exchange::kAuto);
// The quanta a recipe's schedule is solved with: 16384, or 16 per block for deeper chains (the error
// bound, n_layer quanta, stays below 1/16 of the budget).
int64_t budget_quanta(int64_t n_layer);

// The cost of any schedule (the same sum the solver minimizes): kept blocks' selective parts, and per
// checkpointed segment its blocks' forwards less the last block's output projection; less the
// exchanges of the blocks whose recompute keeps them (exchange_kept, per block; empty: none).
double schedule_cost(const std::vector<Segment>& segments, const std::vector<uint8_t>& block_parts,
                     const std::vector<BlockCost>& costs, double offload_cost = 0.0,
                     const std::vector<uint8_t>& exchange_kept = {});

// The fourth choice's price (offload.activations), in the costs' unit: a segment input's two transfers
// (to the host in forward, back before its backward) at offload.bandwidth_gbps, the share
// offload.overlap hides behind compute taken off; in ms, or in the GFLOP the device runs meanwhile
// (kModelledMfu of logging.peak_tflops, else kFormulaFlopsCpu / kFormulaFlopsCuda).
inline constexpr double kModelledMfu = 0.5;
inline constexpr double kFormulaFlopsCpu = 1e11, kFormulaFlopsCuda = 1e14;
double offload_cost(const Scenario& sc, const Costs& costs, double input_bytes);

// Costs from the model's FLOPs (GFLOP per micro-batch): matmuls 2 FLOPs per multiply-add, attention
// 4*T*C per token, elementwise parts (norms, activation) as bytes moved times a device balance (a byte
// costs 20 FLOPs on a CPU, 300 on a GPU). Used by `trainer plan` and with checkpointing.profile_costs false.
Costs formula_costs(const Scenario& sc);

// Costs measured (ms): each piece of one block's forward timed at the run's micro-batch, sequence
// length, device and precision (median of 5 after a warm-up), and under parallel.sequence the block's
// two forward exchanges on their own (model->sequence, the same calls on every rank of the group); and, where the
// device's allocations are tracked (CPU with the tracking allocator, CUDA), the block's bytes for every set of
// selective parts (a forward and backward each) and without saving. Blocks differ only by their MLP size
// (model.layer_mlp_hidden): one block of each size is measured and stands for every block of that size.
// The input and the blocks' weights are drawn from a generator seeded with `seed` (train.seed).
Costs profile_costs(const Scenario& sc, model::GPT& model, torch::Device device, int64_t seed);

// The activation model a schedule is solved with: memory::chain_model, its per-block terms replaced by
// the measured ones when costs carry them.
memory::ChainModel solver_model(const Scenario& sc, const Costs& costs);

// The recipe's budget plan from costs: nullopt when no schedule fits the budget.
std::optional<Plan> try_budget_plan(const Scenario& sc, const Costs& costs);
// The same with formula costs (`trainer plan`, the micro-batch searches).
std::optional<Plan> formula_plan(const Scenario& sc);
// The same, throwing ConfigError naming checkpointing.budget when no schedule fits, with the smallest
// activation peak any schedule reaches.
Plan budget_plan(const Scenario& sc, const Costs& costs);

// The plan a recipe runs: make_plan's (with offload.activations every checkpointed input offloaded), or
// for mode budget budget_plan with formula costs.
Plan plan_for(const Scenario& sc);
// The same, nullopt instead of the ConfigError when no budget schedule fits (probes at other
// micro-batches: none fits, neither does the batch).
std::optional<Plan> try_plan_for(const Scenario& sc);

}  // namespace sl::budget
