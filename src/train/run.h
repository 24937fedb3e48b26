// A training run in named pieces, so each can be read (and tested) alone:
//   setup()       (setup.cpp) device, rendezvous, data, run directory, --resume's state, the
//                 model-state check, micro-batch search, model, checkpointing runner, sharding engine,
//                 optimizer, run log -> one Session; restore() loads the saved state into it;
//   train_loop()  (loop.cpp) the optimizer steps from where the run stands, eval, state saves, stop
//                 flags and events; every failure becomes an Outcome;
//   finish()      (report.cpp) final model, per-rank memory, summary.json, the closing console line.
// run() is those calls; state/state.h saves and loads the Session and LoopState.
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

#include "checkpointing/runner.h"
#include "config/config.h"
#include "data/loader.h"
#include "errors.h"
#include "interop/hf.h"
#include "log/metrics.h"
#include "log/run_dir.h"
#include "memory/activations.h"
#include "memory/tracker.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/engine.h"
#include "precision/loss_scaler.h"
#include "state/state.h"
#include "text/tokenizer.h"
#include "train/peak_flops.h"
#include "train/trainer.h"

namespace sl::train {

// Everything a run is made of, built once by setup().
struct Session {
  config::RunConfig cfg;  // resolved: train.micro_batch: auto replaced by the chosen value
  parallel::LaunchEnv launch;
  torch::Device device{torch::kCPU};
  std::shared_ptr<parallel::Comm> comm;
  data::Splits splits;
  std::unique_ptr<memory::Tracker> tracker;
  int64_t limit = 0;                  // memory.limit in bytes (0 = none)
  int64_t build_peak_bytes = 0;       // tensor bytes at the peak of building the model and engine (above what was live before)
  int64_t load_peak_bytes = 0;        // the same while reading weights in: model.init_from, or --resume's state
  nlohmann::json batch_search = nullptr;  // train.micro_batch: auto's trials
  std::unique_ptr<data::Loader> train_loader, val_loader;
  model::GPT model{nullptr};
  std::unique_ptr<checkpointing::Runner> runner;
  std::unique_ptr<parallel::Engine> engine;  // world > 1 or sharding: DDP / ZeRO
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<precision::LossScaler> scaler;
  ForwardFn forward;
  StepPrecision precision;
  std::unique_ptr<log::RunLog> runlog;
  std::string run_dir;
  std::unique_ptr<log::RunDirLock> run_lock;  // rank 0: held from set-up to exit (log/run_dir.h)
  double flops_per_token = 0, recompute_flops_per_token = 0;
  PeakTracker peak;  // the MFU denominator: per device, raised by a step that beats it (train/peak_flops.h)
  memory::ActivationEstimate predicted;
  nlohmann::json resolved, environment, model_info;  // summary.json's config, environment, model
  state::Found resume_from;  // --resume: the saved state this run continues (found() false: a fresh start)
  std::unique_ptr<interop::HfCheckpoint> init_from;  // model.init_from, opened and checked (fresh starts only)
  std::filesystem::path tokenizer_path;  // the data's tokenizer.json (data.tokenizer), copied into the run directory; "" = none
  std::optional<text::TextCodec> codec;  // train.sample_interval: the samples' tokenizer (or bytes)

  int64_t world() const { return launch.world; }
  bool rank0() const { return launch.rank == 0; }
  int64_t tokens_per_step() const { return cfg.train.micro_batch * cfg.train.grad_accum * cfg.train.seq_len * world(); }
};

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
  std::vector<double> step_ms, tok_s, samp_s, recompute_ms, act_peaks;  // after logging.skip_first
};

// The session's parts a training state is made of, lent to state::save / state::load.
state::Parts state_parts(Session& s);

// How the loop ended: the exit code, its message, and the oom record when it ran out of memory.
struct Outcome {
  int code = kExitOk;
  std::string message;
  nlohmann::json oom = nullptr;
};

// Refuses (OomError, exit 4) a recipe whose model states (weights, gradients, AdamW moments per rank,
// from the planner) exceed what the device has: memory.limit, else physical memory (or the cgroup's
// limit) on CPU, the device's memory on CUDA. Runs before any weight is made.
void check_model_states_fit(const config::RunConfig& cfg, torch::Device device, int64_t limit);

std::unique_ptr<Session> setup(const config::RunConfig& cfg);
// --resume: loads the state setup() found into the session and the loop's counters; a torchrun restart
// (TORCHELASTIC_RESTART_COUNT > 0) is first logged as a `restart` event, found state or not.
void restore(Session& s, LoopState& st);
Outcome train_loop(Session& s, LoopState& st);
// Returns the process exit code: the outcome's, or kExitIo when summary.json cannot be written
// after an otherwise clean run.
int finish(Session& s, const LoopState& st, Outcome outcome);

}  // namespace sl::train
