// The training step (micro-batch accumulation normalized to one big batch, global-norm clipping, the
// AdamW step through the data-parallel strategy), eval, the micro-batch search, FLOP counts, and run().
#pragma once
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <torch/optim/adamw.h>

#include "config/config.h"
#include "data/loader.h"
#include "memory/tracker.h"
#include "model/gpt.h"
#include "precision/loss_scaler.h"

namespace sl::parallel {
class Strategy;
}

namespace sl::train {

class StepGraph;  // train/cuda_graph.h

// What the current thread's step is doing: "forward", "backward", "optimizer", "eval" or "setup"
// (reported with an out-of-memory failure; the thread's phase of device/alloc_tag.h, which a memory
// timeline also records).
const char* current_phase();

// idx (B, T) -> logits (B, T, V): the model's forward, or a checkpointing runner's (samples).
using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;
// idx (B, T), targets (B, T), positions (packed rows: data::Batch::positions on the device; else undefined)
// -> the mean loss, 0-d fp32: the model's fused head and loss (GPTImpl::loss), or a checkpointing runner's
// (Runner::loss). What training and evaluation run: no logits of the whole batch.
using LossFn = std::function<torch::Tensor(const torch::Tensor& idx, const torch::Tensor& targets,
                                           const torch::Tensor& positions)>;

// How a step computes: the forward's autocast dtype (nullopt = fp32) and, for fp16, the loss scaler.
struct StepPrecision {
  std::optional<c10::ScalarType> autocast;
  precision::LossScaler* scaler = nullptr;
};

// Forward + backward over the micro-batches of one optimizer step. Each micro-batch's mean loss is
// divided by the number of micro-batches, so the accumulated gradient equals the gradient of the
// mean loss over all of them (one big batch); for examples, the mean over the step's trained targets
// on every rank (masked_loss_factor). Returns that mean loss as a 0-d float64 tensor on the
// device, not read (train_step reads it with the step's other numbers, once per step).
// The forward runs under autocast; each micro-batch's loss is multiplied by the loss scale before its
// backward (the same scale for every micro-batch of the step).
// The strategy brackets each backward (begin_backward / end_backward): data parallelism reduces gradients
// across ranks during the backward of the last micro-batch (zero2/3: of every micro-batch); the returned
// loss is still this rank's.
// Each micro-batch runs through `graph` (train.cuda_graphs, train/cuda_graph.h): captured and replayed
// where the run is eligible, eager elsewhere; without one, through an eager StepGraph (the same path).
torch::Tensor forward_backward(const LossFn& loss, const std::vector<data::Batch>& micro, torch::Device device,
                               parallel::Strategy& strategy, const StepPrecision& precision = {},
                               StepGraph* graph = nullptr);

// Mean loss over the first `batches` batches of `loader` (rewound first, so every eval scores the same
// windows), in eval mode without autograd, through `loss`
// (default: the model's own; ZeRO-3 needs the runner's, which gathers parameters). For examples this
// rank's share of the mean over the batches' trained targets on `world` ranks (as a step's loss is made,
// masked_loss_factor): the average over ranks is that mean.
double evaluate(model::GPT& model, data::Loader& loader, int64_t batches, torch::Device device,
                std::optional<c10::ScalarType> autocast = std::nullopt, const LossFn& loss = {}, int64_t world = 1);

// A step's trained targets over every rank (the masked batches' trained_everywhere; 0 for token windows).
int64_t step_trained_targets(const std::vector<data::Batch>& micro);
// The factor a masked batch's loss is multiplied by in a step of `micro_batches` with `step_trained`
// trained targets on `world` ranks (step.cpp says why); 0 for an unmasked batch.
double masked_loss_factor(const data::Batch& b, int64_t step_trained, int64_t world, size_t micro_batches);

struct ModelStateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};
int64_t optimizer_state_bytes(const torch::optim::AdamW& opt);  // AdamW's moments, as allocated

// Why a rank wants the run to stop after the current step: 0 (go on), a signal number (SIGINT,
// SIGTERM) or kStopIo (rank 0 could not write its logs). Ranks agree on the largest.
constexpr int kStopIo = 1000;  // above every signal number
constexpr int kStopSpike = 1001;  // a loss spike under train.on_spike: stop (every rank sees the same loss)
// What a rank's loop tells the others at each step's read (world > 1): its stop reason, and whether
// its asynchronous save (state.async) is still being written. Made from a bare stop reason too (no save).
struct LocalPoll {
  int stop = 0;
  bool save_writing = false;
  // NOLINT(google-explicit-constructor)
  LocalPoll(int stop_reason = 0, bool writing = false) : stop(stop_reason), save_writing(writing) {}
};
using StopPoll = std::function<LocalPoll()>;

struct StepResult {
  double loss = 0.0, grad_norm = 0.0, ms = 0.0;
  int64_t trained_targets = 0;  // examples: the step's trained targets over every rank; 0 for token windows
  int stop = 0;  // the stop reason agreed over ranks at this step's read (0 without a StopPoll)
  bool save_writing = false;  // with a StopPoll: some rank's asynchronous save was still being written at it
  double loss_scale = 1.0;  // the scale this step's backward used (1 without a scaler)
  bool skipped = false;     // non-finite gradients under fp16: no optimizer step, the scale backed off
  bool nonfinite_grads = false;  // fp32/bf16: the loss is finite but the gradient norm is not; no optimizer step
  bool held = false;        // the caller's `hold` kept the weights (a loss spike, train.on_spike: skip | stop)
  memory::Snapshot mem;    // readings over this step (peak reset at its start)
  ModelStateBytes states;  // after the optimizer step, on the device
  int64_t host_states = 0;  // offloaded model states in host memory (masters, gradient shard, moments)
  int64_t moved_to_device = 0, moved_to_host = 0;  // bytes offload copied this step (states and activations)
  // Peak minus model states: what activations (and temporaries) took at the step's peak.
  int64_t activation_peak_bytes() const { return std::max<int64_t>(0, mem.peak_allocated_bytes - states.total()); }
};

// One optimizer step: zero the (kept) gradients, forward/backward over the micro-batches, unscale
// and check the gradients (fp16), clip (grad_clip 0 = off, norm still measured), AdamW step. The
// caller sets the learning rate. Without a scaler a non-finite loss returns early, before the
// optimizer step; with one, non-finite gradients skip the step (skipped = true) and back off the scale.
// Without one, a non-finite gradient norm (finite loss) leaves gradients and weights untouched and
// sets nonfinite_grads; the caller aborts or skips (train.on_nonfinite).
// The strategy (parallel/strategy.h) takes the data-parallel part: across ranks gradients are averaged,
// the norm is global, the optimizer updates this rank's shard and the parameters are gathered after;
// the loss is the mean over ranks. One path for every strategy: forward/backward, reduce, clip, step.
// One host synchronization per call: the loss, the gradient norm, the fp16 found-inf flag and the new
// loss scale are summed over ranks in one small device tensor and read to the host once, after
// backward ("sublinear::host_read" in a profiler trace); the skip/abort decisions and the clip
// coefficient are made on the host from that read, and nothing after it (clipping, AdamW, the ZeRO
// all-gather) waits for the device. With a `stop` poll (the loop, at world > 1), each rank's stop
// reason and whether its asynchronous save is still being written, polled just before the read,
// travel in the same reduction: StepResult::stop is the agreed reason and save_writing whether any
// rank's save was still being written, so the loop needs no collective of its own to stop every rank
// after the same step or to publish a save.
// `hold`, when set, sees the step's loss (the mean over ranks, so every rank decides alike) after the
// read and before the optimizer step; true keeps gradients and weights as they are (held = true).
using HoldFn = std::function<bool(double loss)>;
// What a step uses, lent by its caller (the loop, the micro-batch probe): grad_clip is train.grad_clip
// (0 = off, the norm still measured).
struct StepParts {
  const LossFn& loss;
  parallel::Strategy& strategy;
  torch::optim::AdamW& opt;
  memory::Tracker& tracker;
  torch::Device device;
  StepPrecision precision;
  double grad_clip = 0.0;
  StepGraph* graph = nullptr;  // train.cuda_graphs (train/cuda_graph.h); null: eager
};
StepResult train_step(const StepParts& parts, const std::vector<data::Batch>& micro, const StopPoll& stop = {},
                      const HoldFn& hold = {});

// Does one micro-batch of `micro_batch` sequences train (two real optimizer steps of a fresh model,
// random tokens) without running out of memory? Everything it allocates is freed on return.
bool micro_batch_fits(const config::RunConfig& cfg, int64_t micro_batch, torch::Device device);

// train.micro_batch: auto. Among the divisors of `global` (one rank's share of train.global_batch, so the
// global batch is kept exactly, grad_accum = global / micro), the largest that fits, found by bisection
// with real steps, starting from the planner's prediction. micro_batch 0 in the result: not even 1 fits.
struct BatchSearch {
  int64_t micro_batch = 0, grad_accum = 0, predicted = 0;
  std::vector<std::pair<int64_t, bool>> trials;  // (micro_batch, fits) in the order tried
};
BatchSearch find_micro_batch(const config::RunConfig& cfg, int64_t global, torch::Device device);

// Model FLOPs per trained token: 6 N (N = matmul parameters) + 12 L T d (attention scores and
// weighted sum, forward + backward, PaLM's convention). Recompute FLOPs are not included.
double flops_per_token(const model::GPTImpl& model, int64_t seq_len);

// Runs a whole training job as configured (train/run.h: setup, train_loop, finish). Returns the
// process exit code (0, or the code of the failure after summary.json was written). Throws for
// failures before the run directory exists.
int run(const config::RunConfig& cfg);

}  // namespace sl::train
