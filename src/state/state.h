// Durable training state: save a run's whole state and resume it bit-exactly, at the same or another
// world size and sharding stage.
//
// Layout (README "Training state"):
//   <state root>/step-00000050/meta.json               rank 0: step, recipe, math hash, world size,
//                                                        sharding, AdamW step, loss scaler, samplers,
//                                                        loop counters, versions, every file's size + CRC-32
//   <state root>/step-00000050/rank-00000.safetensors  each rank: the parameter elements its optimizer
//                                                        updates and their AdamW moments (replicated runs:
//                                                        rank 0 only), its RNG states
//   <state root>/latest                                 "step-00000050", written last
// A state is written into .step-00000050.tmp/ and renamed when every rank's file and meta.json are
// on disk (fsync'd), so a crash leaves either the whole state or none of it. Tensors are named
// "<field>/<param>" (the whole parameter, in its shape) or "<field>/<param>/<begin>:<end>" (elements
// [begin, end) of the flattened parameter), field = param | exp_avg | exp_avg_sq; loading reads any
// element range from whichever files hold it, which is how a state re-shards.
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include "config/config.h"
#include "data/loader.h"
#include "device/host.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/strategy.h"
#include "precision/loss_scaler.h"
#include "state/parts.h"
#include "state/safetensors.h"

namespace sl::state {

// 2: meta.json carries meta_crc32, the CRC-32 of its own content (format 1 states are still read).
inline constexpr int kFormatVersion = 2;

// Where this run's states live: state.dir, else <run dir>/state.
std::filesystem::path state_root(const config::StateConfig& st, const std::filesystem::path& run_dir);
// <root>/step-NNNNNNNN: where the state after `step` steps is saved.
std::filesystem::path step_dir(const std::filesystem::path& root, int64_t step);

// A saved state chosen by --resume and checked on rank 0 (meta.json, every file's size and CRC-32).
struct Found {
  std::filesystem::path dir;  // .../step-00000050; empty when nothing was found (auto: start fresh)
  int64_t step = -1;
  nlohmann::json meta;
  bool found() const { return step >= 0; }
};

// --resume auto: the newest valid state under `root` (invalid ones are skipped with a warning;
// none at all: not found). --resume PATH: that state (a step directory, or a state root or run
// directory whose `latest` names one); a missing or corrupt one is a StateFileError (exit 2).
// Rank 0 looks; every rank returns the same choice.
Found find_state(const std::string& resume, const std::filesystem::path& root, parallel::Comm& comm);
// The same choice in one process, without a collective (trainer export).
Found find_local(const std::string& resume, const std::filesystem::path& root);

// Recipe keys that change the math: a state is only resumed by a recipe that agrees on all of them.
const std::vector<std::string>& math_keys();
// Refuses (ConfigError, exit 2) a recipe whose math keys differ from the saved ones, naming each
// key with its saved and new value. Other keys (steps, logging, eval, state, checkpointing,
// parallel, micro_batch/grad_accum at the same global batch) may change.
void check_recipe(const nlohmann::json& meta, const config::RunConfig& cfg);
// Refuses (StateFileError, exit 2) a state whose parameters have other sizes than the model `m` builds,
// naming the first such parameter, before anything is read: the model keys that change the math are
// check_recipe's, so what is left is model.vocab_multiple, which pads wte and lm_head.
void check_model_shapes(const Found& f, const config::ModelConfig& m);

struct Saved {
  std::filesystem::path dir;
  int64_t bytes = 0;  // all files of the state
  double ms = 0;      // wall time of the save, every rank's files and the pointer
};
// Saves the state after st.steps_done steps (a collective: every rank calls it at the same step).
// IoError on every rank when any rank's write failed; the previous state stays intact.
Saved save(Parts& s, const Counters& st);

// An asynchronous save (state.async): the state after one step, written while the steps go on.
//   begin_save   (collective) rank 0 makes <root>/.step-N.tmp; every rank copies the tensors of its
//                file into host memory (device::HostSnapshot: the host pool, what memory.host_limit
//                caps and host_peak_bytes shows; the snapshot's size is the planner's
//                host_snapshot_bytes) and rank 0 fixes meta.json's content (counters, samplers,
//                scaler, AdamW step); a thread then writes this rank's file from the snapshot. This
//                call is all the loop waits for: on the CPU one copy at memory bandwidth; on CUDA the
//                copies into page-locked memory are queued on the current stream and the writer
//                thread, not the loop, waits for them (one event). Given the previous finished save,
//                its snapshot's buffers are copied into: the snapshot memory is allocated once, at
//                the first save, and held until the run ends.
//   done         (local, no device or collective call) the thread has finished, written or failed.
//   finish       (collective, every rank at the same point) waits for the thread, agrees on every
//                rank's file and publishes as save() does: meta.json, the rename, `latest`; state.keep
//                too when `last` (no save follows), else the next save's thread applies it before
//                writing (removing a large state takes a while). IoError on every rank when any rank's
//                write failed; the previous state stays newest.
// Until finish() returns the newest complete state is the previous one: a crash or kill -9 during
// the write leaves .step-N.tmp behind (removed by the next save), never a `latest` that names it.
// Destroyed unfinished (a failed run): the thread is joined and nothing is published.
class AsyncSave {
 public:
  AsyncSave(Parts& s, const Counters& st, AsyncSave* previous);
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;
  int64_t step() const { return step_; }
  int64_t snapshot_bytes() const { return snapshot_bytes_; }
  double snapshot_ms() const { return snapshot_ms_; }  // the loop's wait in begin_save
  bool done() const;
  Saved finish(Parts& s, bool last);  // Saved::ms: from begin_save to published
  void apply_keep(Parts& s);          // after finish(s, false) when no save follows: state.keep now (rank 0)

 private:
  struct Writer;
  void take_snapshot(Parts& s, const Counters& st, device::HostSnapshot reuse);
  int64_t step_ = 0, snapshot_bytes_ = 0;
  double snapshot_ms_ = 0;
  bool pruned_ = false;  // finish() applied state.keep
  std::unique_ptr<Writer> writer_;
};
std::unique_ptr<AsyncSave> begin_save(Parts& s, const Counters& st, std::unique_ptr<AsyncSave> previous = nullptr);

// Puts the complete state directory `tmp` in place as `dir` (rank 0, in publish). A state already at
// `dir` (the same step saved again) is renamed aside to .<name>.old first and removed, with a log line
// naming it, only after the new one is in place and the directory synced; if the new one cannot be
// put in place the old one goes back. A good state is never removed before its replacement is
// durable. IoError (with what became of the old copy) on failure.
void install_state_dir(const std::filesystem::path& tmp, const std::filesystem::path& dir);
// After a crash inside install_state_dir: a .step-N.old whose step-N is missing goes back; one whose
// step-N is in place is removed (with a log line). Rank 0, before looking for or writing states.
void recover_replaced(const std::filesystem::path& root);
// A run resumed from step S continues a trajectory that the states of this root newer than S (or at
// S but not the resumed one) are not on: they are moved into <root>/abandoned/ (never deleted), each
// with a warning naming it, and `latest` names the resumed state (or is removed when the resumed state
// lies elsewhere), so --resume auto and state.keep only ever see this trajectory. Returns the moved.
std::vector<std::filesystem::path> set_aside_other_trajectories(const std::filesystem::path& root,
                                                                const Found& resumed);

// The step logging.save_model's final weights (<run dir>/model/model.safetensors) were written at, from
// their `sublinear_step` metadata; -1 when the file is missing or records no step. An unreadable file
// throws (StateFileError / DataError).
int64_t final_weights_step(const std::filesystem::path& file);
// The final weights of a trajectory the resumed run abandons (a step past the resumed one, or at it when
// the resumed state is not this run's own): <run dir>/model/ is moved, whole, beside the abandoned states
// to <root>/abandoned/model-step-NNNNNNNN (never deleted; a warning names it), so that `trainer export`
// and `trainer sample --run` read this trajectory's weights and not the abandoned branch's. Returns where
// it went, or "" when nothing was moved.
std::filesystem::path set_aside_final_weights(const std::filesystem::path& run_dir, const std::filesystem::path& root,
                                              const Found& resumed);

// Loads a found state into a built run's parts: parameters (re-sharded to this run's layout), AdamW
// moments and step, loss scaler, RNG states, data samplers, and the loop's counters; then (rank 0)
// set_aside_other_trajectories in this run's state root and set_aside_final_weights of its run directory.
void load(const Found& found, Parts& s, Counters& st);

}  // namespace sl::state
