// A run's set-up: device, rendezvous, run directory, --resume's state, micro-batch search, model,
// runner, engine, optimizer, run log (see run.h), and restoring a saved state into it.

#include <chrono>
#include <ctime>
#include <filesystem>
#include <functional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "budget/budget.h"
#include "device/cpu_features.h"
#include "device/device.h"
#include "log/clock.h"
#include "log/run_dir.h"
#include "memory/activations.h"
#include "planner/planner.h"
#include "precision/autocast.h"
#include "train/peak_flops.h"
#include "train/run.h"

namespace sl::train {
namespace {

using log::Clock;
using log::ms_since;
using Json = nlohmann::json;

// log::default_run_dir. Rank 0 picks the time and the suffix, so every rank names the same directory.
std::string default_run_dir(const Session& s) {
  double stamp = s.rank0() ? static_cast<double>(std::time(nullptr)) : 0.0;
  if (s.world() > 1) stamp = s.comm->all_reduce_max(stamp, "run directory name");
  const auto start = static_cast<std::time_t>(stamp);
  double suffix = s.rank0() ? static_cast<double>(log::free_run_suffix(s.cfg.recipe_name, start)) : 0.0;
  if (s.world() > 1) suffix = s.comm->all_reduce_max(suffix, "run directory name");
  return log::default_run_dir(s.cfg.recipe_name, start, static_cast<int64_t>(suffix)).string();
}

// Rank 0 alone touches the run directory. When its check failed (error non-empty there), every rank
// throws the same ConfigError now, with rank 0's message, instead of waiting in the next collective.
void fail_together(parallel::Comm& comm, const std::string& error, const std::string& what) {
  comm.fail_together(error.empty() ? kExitOk : kExitConfig, error, what);
}

// ---- setup ----

void init_process(Session& s) {
  s.launch = parallel::LaunchEnv::from_env();
  s.cfg.world_size = s.launch.world;
  config::validate(s.cfg);  // train.global_batch against the real world size
  s.device = device::resolve_device(s.cfg.train, s.launch.local_rank);
  config::validate_resolved_device(s.cfg, s.device.is_cuda());  // train.device: auto, now resolved
  if (s.device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(s.device);  // one GPU per local rank
  if (s.cfg.train.threads > 0) at::set_num_threads(static_cast<int>(s.cfg.train.threads));
  // Rendezvous before reading data or building the model: a missing peer fails fast (exit 5).
  s.comm = std::make_shared<parallel::Comm>(s.launch, s.cfg.parallel, s.device);
}

// The run directory: logging.dir, or (--resume auto) the newest earlier run of this recipe with
// saved states, or a new runs/<recipe>-<timestamp> (log/run_dir.h).
void choose_run_dir(Session& s) {
  const auto& cfg = s.cfg;
  if (!cfg.logging.dir.empty()) s.run_dir = cfg.logging.dir;
  else if (cfg.resume == config::kResumeNewest && cfg.state.dir.empty()) s.run_dir = log::newest_run_with_state(log::kRunsDir, cfg.recipe_name).string();
  if (s.run_dir.empty()) s.run_dir = default_run_dir(s);
}

// Rank 0 locks the run directory (log::RunDirLock) before anything reads or writes in it: an existing
// one (a resumed or reused run) at once, before --resume looks at its states; a new one when it is
// created (open_run_log), so a failed start leaves no empty directory behind. A refusal is every rank's.
void lock_run_dir(Session& s, bool create) {
  int code = kExitOk;
  std::string error;
  if (s.rank0() && !s.run_lock) {
    std::error_code ec;
    try {
      if (create || std::filesystem::is_directory(s.run_dir, ec)) s.run_lock = std::make_unique<log::RunDirLock>(s.run_dir);
    } catch (const Error& e) {
      code = e.code, error = e.what();
    }
  }
  s.comm->fail_together(code, error, "run directory lock");
}

// --resume: find the state (rank 0 checks its files) and refuse a recipe that changes its math.
void find_resume_point(Session& s) {
  if (s.cfg.resume.empty()) return;
  s.resume_from = state::find_state(s.cfg.resume, state::state_root(s.cfg, s.run_dir), *s.comm);
  if (!s.resume_from.found()) {  // auto, and no state at all: the run starts over (its logs are replaced)
    s.cfg.logging.overwrite = true;
    if (s.rank0()) spdlog::warn("--resume auto: no saved state under {}; starting from step 0 in {}",
                                state::state_root(s.cfg, s.run_dir).string(), s.run_dir);
    return;
  }
  state::check_recipe(s.resume_from.meta, s.cfg);
  if (s.rank0())
    spdlog::info("resuming from {} (step {}, saved at world size {} with sharding {})", s.resume_from.dir.string(),
                 s.resume_from.step, s.resume_from.meta.at("world_size").get<int64_t>(),
                 s.resume_from.meta.at("sharding").get<std::string>());
}

// model.init_from: open and check the checkpoint before a run directory or a weight exists (a resumed
// run takes its weights from the state instead).
void open_init_from(Session& s) {
  if (s.cfg.model.init_from.empty() || s.resume_from.found()) return;
  s.init_from = std::make_unique<interop::HfCheckpoint>(s.cfg.model.init_from, s.cfg.model);
}

// Tensor bytes at the peak of `load` above what was live before it (the tracker's peak is reset:
// every step resets it again).
int64_t peak_during(memory::Tracker& tracker, const std::function<void()>& load) {
  tracker.reset_peak();
  const int64_t before = tracker.read().allocated_bytes;
  load();
  return tracker.read().peak_allocated_bytes - before;
}

// Copies the checkpoint into the parameter elements this rank holds (zero3: its shard only).
void load_init_from(Session& s) {
  if (!s.init_from) return;
  const auto t0 = Clock::now();
  torch::NoGradGuard no_grad;
  if (s.engine) {
    for (const auto& sp : s.engine->held_spans()) s.init_from->read(sp.param, sp.begin, sp.end, sp.values);
    s.engine->params_loaded();
  } else {
    for (const auto& item : s.model->named_parameters())
      s.init_from->read(item.key(), 0, item.value().numel(), item.value().detach().view({-1}));
  }
  if (s.rank0()) spdlog::info("weights from {} in {:.0f} ms", s.init_from->describe(), ms_since(t0));
  s.init_from.reset();  // unmaps the files
}

// A torchrun restart (`--max-restarts`): TORCHELASTIC_RESTART_COUNT > 0, the attempt this process belongs to.
bool elastic_restart(const Session& s) { return s.launch.restart_count > 0; }

// The run directory is checked before anything expensive; it is created after the model exists.
// A resumed run continues the logs there.
void check_run_dir_early(Session& s) {
  std::string error;
  if (s.rank0()) {
    try {
      log::check_run_dir(s.run_dir, s.cfg.logging.overwrite || s.resume_from.found());
    } catch (const ConfigError& e) {
      error = e.what();
      if (elastic_restart(s) && s.cfg.resume.empty())  // a restart that cannot continue its own run
        error += fmt::format(" (this is torchrun restart {}: add --resume auto so that a restart continues the run)",
                             s.launch.restart_count);
    }
  }
  fail_together(*s.comm, error, "run directory check");
}

void choose_micro_batch(Session& s) {
  auto& cfg = s.cfg;
  const int64_t world = s.world();
  auto per_rank = cfg;  // each rank holds global_batch / world of every step
  per_rank.train.global_batch /= world;
  BatchSearch found = find_micro_batch(per_rank, s.device);
  if (world > 1) {  // every rank must train the same micro-batch: take the smallest that fits everywhere
    const auto agreed =
        static_cast<int64_t>(-s.comm->all_reduce_max(-static_cast<double>(found.micro_batch), "micro_batch auto"));
    if (agreed != found.micro_batch && agreed > 0)
      found.micro_batch = agreed, found.grad_accum = per_rank.train.global_batch / agreed;
    if (agreed == 0) found.micro_batch = 0;
  }
  Json trials = Json::array();
  for (const auto& [b, ok] : found.trials) trials.push_back({{"micro_batch", b}, {"fits", ok}});
  s.batch_search = {{"planner_prediction", found.predicted}, {"trials", trials}, {"micro_batch", found.micro_batch},
                    {"grad_accum", found.grad_accum}, {"global_batch", cfg.train.global_batch}};
  if (found.micro_batch == 0)
    throw OomError(fmt::format("train.micro_batch: auto: not even micro-batch 1 fits memory.limit {}; {}",
                               cfg.memory.limit.text, planner::oom_advice(cfg, s.limit)));
  cfg.train.micro_batch = found.micro_batch;
  cfg.train.grad_accum = found.grad_accum;
  if (s.rank0())
    spdlog::info("micro_batch auto: planner predicted {}, tried {}, chose {} x grad_accum {} per rank (global batch {})",
                 found.predicted, trials.dump(), found.micro_batch, found.grad_accum, cfg.train.global_batch);
}

// Every rank solves with rank 0's profiled costs: timing noise must not give ranks different schedules
// (under zero3 the parameter all-gathers follow the schedule).
budget::Costs rank0_costs(parallel::Comm& comm, budget::Costs mine) {
  std::vector<double> flat;
  for (const auto& c : mine.blocks) flat.insert(flat.end(), {c.forward, c.output, c.attention, c.mlp, c.norm});
  for (const auto& b : mine.bytes) {
    flat.insert(flat.end(), b.kept.begin(), b.kept.end());
    flat.insert(flat.end(), b.backward.begin(), b.backward.end());
    flat.push_back(b.forward);
  }
  const auto all = comm.all_gather(flat, "profiled block costs");  // rank 0's come first
  auto next = all.begin();
  for (auto& c : mine.blocks) c = {next[0], next[1], next[2], next[3], next[4]}, next += 5;
  for (auto& b : mine.bytes) {
    std::copy(next, next + checkpointing::kPartSets, b.kept.begin()), next += checkpointing::kPartSets;
    std::copy(next, next + checkpointing::kPartSets, b.backward.begin()), next += checkpointing::kPartSets;
    b.forward = *next++;
  }
  return mine;
}

// The run's checkpointing plan: the one setup() resolved from the recipe (make_plan's rule, or mode
// budget's schedule from formula costs), or with checkpointing.profile_costs the schedule solved from
// the block costs profiled on this model, device and precision (the formula schedule was the check,
// before any weight existed, that some schedule fits).
checkpointing::Plan run_plan(const Session& s, checkpointing::Plan resolved) {
  const auto& cfg = s.cfg;
  if (!cfg.checkpointing.mode.solved() || !cfg.checkpointing.profile_costs) return resolved;
  auto model = s.model;
  const auto costs = rank0_costs(*s.comm, budget::profile_costs(cfg, model, s.device));
  return budget::budget_plan(cfg, costs);
}

void build_model(Session& s, checkpointing::Plan resolved) {
  const auto& cfg = s.cfg;
  torch::manual_seed(static_cast<uint64_t>(cfg.train.seed));
  // zero3: no rank ever holds the whole model; the engine draws each unit's values in turn and keeps its shard.
  const bool deferred = cfg.parallel.sharding.shards_params();
  s.tracker->reset_peak();
  const int64_t before_build = s.tracker->read().allocated_bytes;
  try {
    s.model = model::GPT(cfg.model, s.device, deferred);
  } catch (const c10::OutOfMemoryError& e) {  // before the run directory exists: nothing to clean up
    throw OomError(fmt::format("out of memory while building the model ({}). To fit, {}",
                               std::string(e.what_without_backtrace()).substr(0, 200), planner::oom_advice(cfg, s.limit)));
  }
  s.model->train();
  const int64_t model_peak = s.tracker->read().peak_allocated_bytes;
  auto plan = run_plan(s, std::move(resolved));  // the budget profile resets the peak to measure its own
  s.tracker->reset_peak();
  s.runner = std::make_unique<checkpointing::Runner>(cfg.checkpointing, s.model, std::move(plan));
  // zero3: autocast's cache of low-precision weight copies (kept until the forward's autocast region
  // ends) would keep every unit's weights alive after the unit's fp32 storage is freed.
  if (cfg.parallel.sharding.shards_params()) at::autocast::set_autocast_cache_enabled(false);
  if (s.world() > 1 || !cfg.parallel.sharding.replicated()) {
    s.engine = std::make_unique<parallel::Engine>(s.model, cfg, s.comm);
    s.engine->attach(*s.runner);
  }
  s.build_peak_bytes = std::max(model_peak, s.tracker->read().peak_allocated_bytes) - before_build;
  s.opt = s.engine ? s.engine->make_optimizer(cfg.train) : make_optimizer(s.model, cfg.train);
  s.scaler = std::make_unique<precision::LossScaler>(cfg.precision, s.device);
  s.precision = {precision::compute_dtype(cfg.precision.compute), s.scaler.get()};
  s.forward = [runner = s.runner.get()](const torch::Tensor& idx) { return runner->forward(idx); };
}

// data.tokenizer (or the tokenizer.json beside data.path): its vocabulary checked against model.vocab_size
// (exit 2 naming both), and opened for train.sample_interval (bytes for a 256-token model without one).
void open_tokenizer(Session& s) {
  s.tokenizer_path = data::tokenizer_path(s.cfg.data);
  if (!s.tokenizer_path.empty())
    text::check_vocab_match(text::inspect_tokenizer_file(s.tokenizer_path).vocab_size, s.cfg.model.vocab_size,
                            "data.tokenizer " + s.tokenizer_path.string());
  if (s.cfg.train.sample_interval > 0) {
    s.codec = text::TextCodec::open(s.tokenizer_path, s.cfg.model.vocab_size);
    s.codec->prompt(s.cfg.train.sample_prompt);  // a prompt it cannot start from fails now, not at the first sample
  }
}

// The run keeps the tokenizer it trained with (<run dir>/tokenizer.json, and tokenizer_config.json naming
// its end-of-text token): `trainer export` and logging.save_model put them beside the weights, `trainer
// sample --run` reads them.
void record_tokenizer(const Session& s) {
  if (s.tokenizer_path.empty() || !s.rank0()) return;
  text::write_hf_tokenizer(s.run_dir, s.tokenizer_path, s.cfg.model.max_seq_len);
}

// The step through which metrics.jsonl keeps its records (RunLog's resume_step): the resumed state's; 0
// for a torchrun restart of --resume that found no state yet (its steps start over, and the earlier
// attempts' `restart` events stay); -1 for a new run (the file is replaced).
int64_t records_kept_through(const Session& s) {
  if (s.resume_from.found()) return s.resume_from.step;
  return elastic_restart(s) && !s.cfg.resume.empty() ? 0 : -1;
}

void open_run_log(Session& s) {
  lock_run_dir(s, /*create=*/true);
  int code = kExitOk;
  std::string error;
  try {  // rank 0's writes; a failure there stops every rank with its exit code
    s.runlog = std::make_unique<log::RunLog>(s.run_dir, s.rank0(), s.cfg.logging.overwrite, records_kept_through(s),
                                             s.cfg.logging.tensorboard);
    s.resolved = config::to_json(s.cfg);
    s.runlog->write_json("config.json", s.resolved);
    record_tokenizer(s);
  } catch (const Error& e) {
    code = e.code;
    error = e.what();
  }
  s.comm->fail_together(code, error, "run directory creation");
}

void describe(Session& s) {
  const auto& cfg = s.cfg;
  s.flops_per_token = flops_per_token(*s.model, cfg.train.seq_len);
  s.recompute_flops_per_token = s.runner->recompute_flops_per_token(cfg.train.seq_len);
  s.predicted = memory::estimate_activation_peak(cfg, s.runner->plan());
  // A budget schedule solved with profiled bytes: its peak by those bytes, the model it was solved with.
  if (s.runner->plan().budget.bytes_source == "profile") s.predicted.peak_bytes = s.runner->plan().budget.predicted_peak_bytes;
  // The probe runs the model's own GEMM shapes (a micro-batch's rows) beside square ones.
  const auto shapes = model_gemm_shapes(cfg.model, cfg.train.micro_batch * cfg.train.seq_len);
  s.peak = PeakTracker(peak_flops(s.device, cfg.precision.compute, cfg.logging.peak_tflops, shapes));
  s.environment = {{"torch_version", TORCH_VERSION},
                   {"device", s.device.str()},
                   {"cuda_available", torch::cuda::is_available()},
                   {"threads", at::get_num_threads()},
                   {"world_size", s.world()},
                   {"rank", s.launch.rank},
                   {"backend", s.comm->backend()},
                   {"memory_source", s.tracker->source()},
                   {"cpu", device::cpu_features().to_json()}};  // the CPU paths that change memory and speed
  s.model_info = {{"params", s.model->num_params()},
                  {"matmul_params", s.model->num_matmul_params()},
                  {"flops_per_token", s.flops_per_token},
                  {"recompute_flops_per_token", s.recompute_flops_per_token},
                  {"peak_flops", s.peak.flops()},
                  {"peak_flops_source", s.peak.source()},
                  {"peak_flops_dtype", s.peak.initial().dtype}};
}

// A bf16/fp16 run on a CPU where matmuls in that dtype take ATen's fallback GEMM (no oneDNN kernel for
// it: AVX2 only, or oneDNN capped below AVX-512) and SUBLINEAR_ATEN_KERNELS=1 turned the widened
// linears off (model/linear.h) trains far slower than fp32 would (docs/precision.md).
void warn_fallback_matmuls(const Session& s) {
  if (!s.device.is_cpu() || !precision::compute_dtype(s.cfg.precision.compute)) return;
  if (memory::lowp_matmul_path(s.cfg) != device::LowpMatmul::aten) return;
  spdlog::warn("precision.compute {}: this CPU has no oneDNN matmul kernel for it (no AVX-512, or ONEDNN_MAX_CPU_ISA below it), so its matmuls take "
               "ATen's fallback GEMM, far slower than fp32 (0.8 against 104 GFLOP/s on an AVX2 AMD EPYC), and SUBLINEAR_ATEN_KERNELS "
               "turned off the widened linears that avoid it: unset it, or train in precision.compute: fp32 (docs/precision.md)",
               s.cfg.precision.compute.name());
}

void print_settings(const Session& s) {
  if (!s.rank0()) return;
  const auto& cfg = s.cfg;
  auto rows = config::to_rows(cfg);
  rows.emplace_back("run directory", s.run_dir);
  rows.emplace_back("device", s.device.str());
  rows.emplace_back("threads", std::to_string(at::get_num_threads()));
  if (s.engine)
    rows.emplace_back("data parallel", fmt::format("{} rank(s), backend {}, sharding {}", s.world(), s.comm->backend(),
                                                   cfg.parallel.sharding.name()));
  rows.emplace_back("checkpointing plan", s.runner->plan().describe());
  rows.emplace_back("predicted activation peak",
                    fmt::format("{} per micro-batch", log::format_bytes(s.predicted.peak_bytes)));
  rows.emplace_back("parameters", fmt::format("{} ({:.2f} M)", s.model->num_params(), s.model->num_params() / 1e6));
  rows.emplace_back("train data", s.splits.train->describe());
  rows.emplace_back("val data", s.splits.val->describe());
  rows.emplace_back("peak FLOP/s for MFU",
                    fmt::format("{:.3g} ({})", s.peak.flops(), s.peak.source()));
  fmt::print("{}", log::format_table(rows));
  std::fflush(stdout);
  warn_fallback_matmuls(s);
}

}  // namespace

namespace {

// offload.*: the model states placed in host memory against memory.host_limit (when set).
void check_host_states_fit(const config::RunConfig& cfg, const memory::PeakPrediction& p) {
  const int64_t host_limit = cfg.memory.host_limit.bytes;
  if (host_limit <= 0 || p.host_states_bytes() <= host_limit) return;
  throw OomError(fmt::format(
      "the offloaded model states cannot fit host memory: {} per rank (fp32 masters {}, gradients {}, AdamW moments {}) "
      "but memory.host_limit is {}. Nothing was allocated. To fit: raise memory.host_limit, offload less (offload.*), "
      "or shard over more ranks (each rank offloads its shard)",
      log::format_bytes(p.host_states_bytes()), log::format_bytes(p.host_params_bytes), log::format_bytes(p.host_grads_bytes),
      log::format_bytes(p.host_optimizer_bytes), log::format_bytes(host_limit)));
}

}  // namespace

void check_model_states_fit(const config::RunConfig& cfg, torch::Device device, int64_t limit) {
  const auto capacity = limit > 0 ? memory::Capacity{limit, "memory.limit"} : memory::device_capacity(device);
  auto states_cfg = cfg;  // model states do not depend on the checkpointing mode (a budget is checked below)
  states_cfg.checkpointing = config::CheckpointingConfig{};
  if (states_cfg.train.micro_batch.is_auto()) states_cfg.train.micro_batch = 1;  // the states do not depend on it
  const memory::PeakPrediction p = planner::predict_peak(states_cfg);
  check_host_states_fit(cfg, p);
  const int64_t states = p.model_states_bytes();
  if (capacity.bytes <= 0 || states <= capacity.bytes) return;
  const int64_t params = memory::total_params(cfg.model);
  const int64_t ranks_needed = (16 * params + capacity.bytes - 1) / capacity.bytes;
  throw OomError(fmt::format(
      "the model cannot fit: {} parameters need {} of model states per rank (weights {}, gradients {}, AdamW moments "
      "{}; parallel.sharding {} over {} rank(s)) but the {} is {}. Nothing was allocated. To fit: fewer layers or a "
      "smaller model.n_embd, parallel.sharding: zero3 over at least {} ranks (it divides all three states by the "
      "world size), or host memory for them (offload.optimizer, + gradients, + parameters); precision.compute does not "
      "shrink these fp32 states",
      params, log::format_bytes(states), log::format_bytes(p.params_bytes), log::format_bytes(p.grads_bytes),
      log::format_bytes(p.optimizer_bytes), cfg.parallel.sharding.name(), std::max<int64_t>(1, cfg.world_size),
      capacity.source, log::format_bytes(capacity.bytes), ranks_needed));
}

std::unique_ptr<Session> setup(const config::RunConfig& recipe) {
  auto s = std::make_unique<Session>();
  s->cfg = recipe;
  init_process(*s);
  // Data first: a bad file or tokenizer fails here, before a run directory or a model exists.
  open_tokenizer(*s);  // before the tokens: a vocabulary mismatch is named as one (exit 2), not as a token out of range
  s->splits = data::open_splits(s->cfg);
  choose_run_dir(*s);
  lock_run_dir(*s, /*create=*/false);
  find_resume_point(*s);
  open_init_from(*s);
  check_run_dir_early(*s);
  s->tracker = std::make_unique<memory::Tracker>(s->device);
  s->limit = s->cfg.memory.limit.bytes;
  s->tracker->set_limit(s->limit);  // before the model exists: the limit covers everything, as on a GPU
  s->tracker->set_host_limit(s->cfg.memory.host_limit.bytes);
  check_model_states_fit(s->cfg, s->device, s->limit);
  if (s->cfg.train.micro_batch.is_auto()) choose_micro_batch(*s);
  // The plan, resolved once before a model exists; a budget no schedule fits stops here (exit 2),
  // before a model or a run directory exists.
  auto plan = budget::plan_for(s->cfg);
  const auto& t = s->cfg.train;
  const auto seed = static_cast<uint64_t>(t.seed);
  s->train_loader = std::make_unique<data::Loader>(s->splits.train, t.micro_batch, t.seq_len, seed, s->launch.rank, s->world());
  s->val_loader = std::make_unique<data::Loader>(s->splits.val, t.micro_batch, t.seq_len, seed + 1, s->launch.rank, s->world());
  build_model(*s, std::move(plan));
  s->load_peak_bytes = peak_during(*s->tracker, [&] { load_init_from(*s); });
  describe(*s);
  open_run_log(*s);
  print_settings(*s);
  return s;
}

state::Parts state_parts(Session& s) {
  return {.cfg = s.cfg,
          .launch = s.launch,
          .comm = s.comm.get(),
          .device = s.device,
          .model = s.model,
          .engine = s.engine.get(),
          .opt = s.opt.get(),
          .scaler = s.scaler.get(),
          .train_loader = s.train_loader.get(),
          .val_loader = s.val_loader.get(),
          .run_dir = s.run_dir};
}

namespace {

// A torchrun restart is recorded at its start, before anything trains: a `restart` event with the
// attempt (TORCHELASTIC_RESTART_COUNT) and the step it continues from (0, state null: nothing was saved
// before the failure, the steps start over).
void record_restart(Session& s) {
  if (!elastic_restart(s)) return;
  const bool found = s.resume_from.found();
  const int64_t step = found ? s.resume_from.step : 0;
  s.runlog->event("restart", {{"step", step}, {"restart", s.launch.restart_count},
                              {"state", found ? Json(s.resume_from.dir.string()) : Json(nullptr)}});
  if (s.rank0())
    spdlog::warn("torchrun restart {}: {}", s.launch.restart_count,
                 found ? fmt::format("continuing from the state of step {}", step)
                       : std::string("no state was saved before the failure; starting again from step 0"));
}

void load_state(Session& s, LoopState& st) {
  const auto t0 = Clock::now();
  auto parts = state_parts(s);
  s.load_peak_bytes = peak_during(*s.tracker, [&] { state::load(s.resume_from, parts, st); });
  const double load_ms = ms_since(t0);
  // Already on disk where this run saves (a resume into another state.dir saves its own copy at the end).
  std::error_code ec;
  if (std::filesystem::equivalent(s.resume_from.dir.parent_path(), state::state_root(s.cfg, s.run_dir), ec))
    st.last_saved_step = st.steps_done;
  s.runlog->event("resume", {{"step", st.steps_done}, {"state", s.resume_from.dir.string()},
                             {"saved_world_size", s.resume_from.meta.at("world_size")},
                             {"saved_sharding", s.resume_from.meta.at("sharding")}, {"load_ms", load_ms},
                             {"restart", s.launch.restart_count}});
  if (s.rank0()) spdlog::info("state of step {} loaded in {:.0f} ms", st.steps_done, load_ms);
}

}  // namespace

void restore(Session& s, LoopState& st) {
  record_restart(s);
  if (s.resume_from.found()) load_state(s, st);
}

}  // namespace sl::train
