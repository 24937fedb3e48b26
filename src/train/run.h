// A training run in named pieces, so each can be read (and tested) alone:
//   setup()       (setup.cpp) device, rendezvous, data, run directory, --resume's state, the
//                 model-state check, micro-batch search, model, checkpointing runner, data-parallel strategy,
//                 optimizer, run log -> one Session of typed parts; restore() loads the saved state into the
//                 parts a training state is made of (state_parts);
//   train_loop()  (loop.cpp) the optimizer steps from where the run stands, eval, state saves, stop
//                 flags and events; every failure becomes an Outcome;
//   finish()      (report.cpp) final model, per-rank memory, summary.json, the closing console line.
// run() is those calls over the Session's parts; state/state.h saves and loads the parts a training state
// is made of (state_parts) and LoopState.
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "recompute/runner.h"
#include "config/config.h"
#include "data/loader.h"
#include "errors.h"
#include "interop/hf.h"
#include "interop/peft.h"
#include "log/metrics.h"
#include "log/run_dir.h"
#include "predict/activations.h"
#include "memory/tracker.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/strategy.h"
#include "precision/loss_scaler.h"
#include "state/state.h"
#include "text/tokenizer.h"
#include "train/cuda_graph.h"
#include "train/peak_flops.h"
#include "train/trainer.h"

namespace sl::train {

// Who this process is: its place in the launch (torchrun's environment), its device, and its
// communicator (world 1 too: a single process has one), which holds its place in the process mesh.
struct Process {
  parallel::LaunchEnv launch;
  torch::Device device{torch::kCPU};
  std::shared_ptr<parallel::Comm> comm;
  const layout::Mesh& mesh() const { return comm->mesh(); }  // coordinates, groups, the batch arithmetic
  int64_t world() const { return launch.world; }
  bool rank0() const { return launch.rank == 0; }
};

// What trains, as setup() built it: the model under its checkpointing plan (runner, forward), the
// data-parallel strategy (parallel/strategy.h), AdamW over what it updates, and the step's precision.
struct Learner {
  model::GPT model{nullptr};
  std::unique_ptr<recompute::Runner> runner;
  std::unique_ptr<parallel::Strategy> strategy;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<precision::LossScaler> scaler;
  ForwardFn forward;  // logits, for samples
  LossFn loss;        // what steps and evaluations run
  StepPrecision precision;
  std::unique_ptr<StepGraph> graph;  // train.cuda_graphs: the micro-batch's graph, or why it runs eager
};

// The data: token splits, the train and validation loaders, the data's tokenizer.json (data.tokenizer,
// copied into the run directory; "" = none) and, with train.sample_interval, the samples' codec.
struct Inputs {
  data::Splits splits;
  std::unique_ptr<data::Loader> train_loader, val_loader;
  std::filesystem::path tokenizer_path;
  std::optional<text::TextCodec> codec;
};

// Where the run writes: its directory (rank 0 holds its lock from set-up to exit: log/run_dir.h), the
// run log (metrics.jsonl, events, JSON files), and summary.json's config, environment and model blocks.
struct Outputs {
  std::string run_dir;
  std::unique_ptr<log::RunDirLock> run_lock;
  std::unique_ptr<log::RunLog> runlog;
  nlohmann::json resolved, environment, model_info;
};

// What the run measures and predicts about itself: memory (the tracker, memory.limit in bytes, the
// peaks of building and loading, the planner's activation estimate, micro_batch auto's trials) and speed
// (FLOPs per token, the MFU's peak: per device, raised by a step that beats it, train/peak_flops.h).
struct Meter {
  std::unique_ptr<memory::Tracker> tracker;
  int64_t limit = 0;                  // memory.limit in bytes (0 = none)
  // tensor bytes at the peak of building the model and strategy (above what was live before)
  int64_t build_peak_bytes = 0;
  int64_t load_peak_bytes = 0;        // the same while reading weights in: model.init_from, or --resume's state
  nlohmann::json batch_search = nullptr;  // train.micro_batch: auto's trials
  memory::Scenario scenario;  // the memory model's input, made once at set-up (the planner's advice on OOM)
  memory::ActivationEstimate predicted;
  double flops_per_token = 0, recompute_flops_per_token = 0;
  PeakTracker peak;
};

// Where the run starts from: --resume's saved state (found() false: a fresh start) or model.init_from,
// opened and checked (fresh starts only).
struct Start {
  state::Found resume_from;
  std::unique_ptr<interop::HfCheckpoint> init_from;
  std::unique_ptr<interop::PeftAdapter> adapter;  // model.init_from an adapter directory: its adapters
};

struct LoopState;
struct Outcome;

// The parts setup() builds; run() holds them and lends each phase the ones it uses. The end of the run
// is the Session's own: it reports on every part.
struct Session {
  config::RunConfig cfg;  // resolved: train.micro_batch: auto replaced by the chosen value
  Process proc;
  Start start;
  Inputs data;
  Meter meter;
  Learner learn;
  Outputs out;

  // Ends the run (train/report.cpp): the final weights, summary.json, the closing line, every rank
  // leaving with one code. Returns the process exit code: the outcome's, or kExitIo when summary.json
  // cannot be written after an otherwise clean run.
  int finish(const LoopState& st, Outcome outcome);
  // summary.json (docs/logs.md): a report on every part of the run.
  nlohmann::json summary_json(const LoopState& st, const Outcome& o, nlohmann::json parallel,
                              nlohmann::json final_weights) const;
};

// Tokens one optimizer step trains on, over every rank.
inline int64_t tokens_per_step(const config::TrainConfig& t, const layout::Mesh& mesh) {
  return mesh.tokens_per_step(t.micro_batch, t.grad_accum, t.seq_len);
}

// What the step loop accumulates for the summary. Its state::Counters (steps_done, skipped_steps,
// consecutive_skips, last_val) are also part of a saved training state (state/state.h).
struct LoopState : state::Counters {
  int64_t last_saved_step = -1;  // the newest state on disk (-1: none yet)
  int64_t state_bytes = 0;       // size of the newest state
  std::vector<double> save_ms;   // wall time of every save (an asynchronous one: snapshot to published)
  std::vector<double> save_blocking_ms;  // the part of it the step loop waited for (synchronous: all of it)
  std::unique_ptr<state::AsyncSave> pending_save;  // state.async: the save being written, not yet published
  std::unique_ptr<state::AsyncSave> finished_save;  // ... the newest published one: its snapshot's buffers are reused
  int64_t snapshot_bytes() const { return finished_save ? finished_save->snapshot_bytes() : 0; }  // held to the end
  int64_t peak_bytes = 0, transient_peak = 0, rest_bytes = 0, gathers = 0;
  ModelStateBytes states_at_peak;
  int64_t host_peak_bytes = 0;    // offload: the host pool's peak over the steps
  int64_t host_states_bytes = 0;  // offload: model states in host memory after the last step
  double last_loss = NAN;
  double wall_s = 0;  // the loop's wall-clock time
  std::vector<double> step_ms, tok_s, trained_tok_s, samp_s, recompute_ms, act_peaks;  // after logging.skip_first
};

// The parts a training state is made of, lent to state::save / state::load.
state::Parts state_parts(const config::RunConfig& cfg, const Process& proc, Learner& learn, Inputs& data,
                         const std::string& run_dir);

// How the loop ended: the exit code, its message, and the oom record when it ran out of memory.
struct Outcome {
  int code = kExitOk;
  std::string message;
  nlohmann::json oom = nullptr;
};

// Refuses (OomError, exit 4) a recipe whose model states (weights, gradients, AdamW moments per rank,
// from the planner) exceed what the device has: memory.limit, else physical memory (or the cgroup's
// limit) on CPU, the device's memory on CUDA, or host memory beyond host_limit (memory.host_limit, 0 =
// none). `sc`: the recipe's scenario (any micro-batch and mode: the states depend on neither). Runs
// before any weight is made.
void check_model_states_fit(memory::Scenario sc, int64_t host_limit, torch::Device device, int64_t limit);

std::unique_ptr<Session> setup(const config::RunConfig& cfg);
// --resume: loads the state setup() found into the session and the loop's counters; a torchrun restart
// (TORCHELASTIC_RESTART_COUNT > 0) is first logged as a `restart` event, found state or not.
void restore(state::Parts& saves, const Start& start, Meter& meter, log::RunLog& runlog, LoopState& st);
Outcome train_loop(const config::RunConfig& cfg, const Process& proc, Learner& learn, Inputs& data, Meter& meter,
                   Outputs& out, LoopState& st);

}  // namespace sl::train
