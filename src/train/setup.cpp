// A run's set-up: each part of the Session built by a function that returns it (run.h): the process
// (device, rendezvous), the inputs, the run directory and --resume's state, the meter (micro-batch
// search), the learner (model, runner, data-parallel strategy, optimizer), the run log; and restoring a
// saved state into the parts a training state is made of.

#include <chrono>
#include <ctime>
#include <filesystem>
#include <functional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "config/shape.h"
#include "predict/budget.h"
#include "device/cpu_features.h"
#include "device/device.h"
#include "log/clock.h"
#include "log/run_dir.h"
#include "predict/activations.h"
#include "parallel/sequence.h"
#include "predict/planner.h"
#include "precision/autocast.h"
#include "train/peak_flops.h"
#include "train/run.h"

namespace sl::train {
namespace {

using log::Clock;
using log::ms_since;
using Json = nlohmann::json;

// log::default_run_dir. Rank 0 picks the time and the suffix, so every rank names the same directory.
std::string default_run_dir(const Process& proc, const std::string& recipe_name) {
  double stamp = proc.rank0() ? static_cast<double>(std::time(nullptr)) : 0.0;
  if (proc.world() > 1) stamp = proc.comm->all_reduce_max(stamp, "run directory name");
  const auto start = static_cast<std::time_t>(stamp);
  double suffix = proc.rank0() ? static_cast<double>(log::free_run_suffix(recipe_name, start)) : 0.0;
  if (proc.world() > 1) suffix = proc.comm->all_reduce_max(suffix, "run directory name");
  return log::default_run_dir(recipe_name, start, static_cast<int64_t>(suffix)).string();
}

// Rank 0 alone touches the run directory. When its check failed (error non-empty there), every rank
// throws the same ConfigError now, with rank 0's message, instead of waiting in the next collective.
void fail_together(parallel::Comm& comm, const std::string& error, const std::string& what) {
  comm.fail_together(error.empty() ? kExitOk : kExitConfig, error, what);
}

// ---- setup ----

// torchrun's environment, the recipe checked against the real world size and the resolved device, the
// rank's GPU and threads, then the rendezvous (before data or the model: a missing peer fails fast, exit 5).
Process init_process(config::RunConfig& cfg) {
  Process p;
  p.launch = parallel::LaunchEnv::from_env();
  cfg.world_size = p.launch.world;
  config::validate(cfg);  // train.global_batch against the real world size
  p.device = device::resolve_device(cfg.train, p.launch.local_rank);
  config::validate_resolved_device(cfg, p.device.is_cuda());  // train.device: auto, now resolved
  if (p.device.is_cuda()) {
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(p.device);  // one GPU per local rank
    device::set_tf32(cfg.precision.tf32.enabled(/*on_cuda=*/true));    // before the first matmul (the MFU probe's)
  }
  if (cfg.train.threads > 0) at::set_num_threads(static_cast<int>(cfg.train.threads));
  p.comm = std::make_shared<parallel::Comm>(p.launch, cfg.parallel, p.device);
  return p;
}

// The run directory: logging.dir, or (--resume auto) the newest earlier run of this recipe with
// saved states, or a new runs/<recipe>-<timestamp> (log/run_dir.h).
std::string choose_run_dir(const config::LoggingConfig& lg, const config::StateConfig& st, const std::string& resume,
                           const std::string& recipe_name, const Process& proc) {
  if (!lg.dir.empty()) return lg.dir;
  std::string dir;
  if (resume == config::kResumeNewest && st.dir.empty())
    dir = log::newest_run_with_state(log::kRunsDir, recipe_name).string();
  return dir.empty() ? default_run_dir(proc, recipe_name) : dir;
}

// Rank 0 locks the run directory (log::RunDirLock) before anything reads or writes in it: an existing
// one (a resumed or reused run) at once, before --resume looks at its states; a new one when it is
// created (open_run_log), so a failed start leaves no empty directory behind. A refusal is every rank's.
void lock_run_dir(const Process& proc, Outputs& out, bool create) {
  int code = kExitOk;
  std::string error;
  if (proc.rank0() && !out.run_lock) {
    std::error_code ec;
    try {
      if (create || std::filesystem::is_directory(out.run_dir, ec))
        out.run_lock = std::make_unique<log::RunDirLock>(out.run_dir);
    } catch (const Error& e) {
      code = e.code, error = e.what();
    }
  }
  proc.comm->fail_together(code, error, "run directory lock");
}

// --resume: find the state (rank 0 checks its files) and refuse a recipe that changes its math. Without
// a state at all (auto), the run starts over and its logs are replaced (logging.overwrite set).
state::Found find_resume_point(config::RunConfig& cfg, const Process& proc, const std::string& run_dir) {
  if (cfg.resume.empty()) return {};
  const auto root = state::state_root(cfg.state, run_dir);
  state::Found found = state::find_state(cfg.resume, root, *proc.comm);
  if (!found.found()) {
    cfg.logging.overwrite = true;
    if (proc.rank0())
      spdlog::warn("--resume auto: no saved state under {}; starting from step 0 in {}", root.string(), run_dir);
    return found;
  }
  state::check_recipe(found.meta, cfg);
  state::check_model_shapes(found, cfg.model);
  if (proc.rank0())
    spdlog::info("resuming from {} (step {}, saved at world size {} with sharding {})", found.dir.string(), found.step,
                 found.meta.at("world_size").get<int64_t>(), found.meta.at("sharding").get<std::string>());
  return found;
}

// model.init_from: open and check the checkpoint before a run directory or a weight exists (a resumed
// run takes its weights from the state instead; with model.lora only the adapters, the frozen weights
// still come from here).
// A PEFT adapter directory (model.lora) brings its adapters and names the base they were trained on.
void open_init_from(const config::ModelConfig& m, Start& start) {
  if (m.init_from.empty() || (start.resume_from.found() && !m.lora.enabled())) return;
  if (m.lora.enabled() && interop::PeftAdapter::is_adapter_dir(m.init_from)) {
    start.adapter = std::make_unique<interop::PeftAdapter>(m.init_from, m);
    start.init_from = std::make_unique<interop::HfCheckpoint>(start.adapter->base(), interop::without_lora(m));
    return;
  }
  start.init_from = std::make_unique<interop::HfCheckpoint>(m.init_from, interop::without_lora(m));
}

// Tensor bytes at the peak of `load` above what was live before it (the tracker's peak is reset:
// every step resets it again).
int64_t peak_during(memory::Tracker& tracker, const std::function<void()>& load) {
  tracker.reset_peak();
  const int64_t before = tracker.read().allocated_bytes;
  load();
  return tracker.read().peak_allocated_bytes - before;
}

// Copies the checkpoint into the parameter elements this rank holds (zero3: its shard only). With
// model.lora into the frozen weights only, whole on every rank: the adapters start as model/lora.h says.
void load_init_from(const Process& proc, Start& start, const Learner& learn) {
  if (!start.init_from) return;
  const auto t0 = Clock::now();
  torch::NoGradGuard no_grad;
  if (learn.model->cfg.lora.enabled()) {  // the frozen weights whole; the adapters (held_spans) from an adapter dir
    for (const auto& item : learn.model->named_parameters())
      if (!item.value().requires_grad())
        start.init_from->read(item.key(), 0, item.value().numel(), item.value().detach().view({-1}));
    if (start.adapter)
      for (const auto& sp : learn.strategy->held_spans()) start.adapter->read(sp.param, sp.begin, sp.end, sp.values);
  } else {
    for (const auto& sp : learn.strategy->held_spans()) start.init_from->read(sp.param, sp.begin, sp.end, sp.values);
  }
  learn.strategy->params_loaded();
  if (proc.rank0()) spdlog::info("weights from {} in {:.0f} ms", start.init_from->describe(), ms_since(t0));
  start.init_from.reset();  // unmaps the files
  start.adapter.reset();
}

// A torchrun restart (`--max-restarts`): TORCHELASTIC_RESTART_COUNT > 0, the attempt this process belongs to.
bool elastic_restart(const Process& proc) { return proc.launch.restart_count > 0; }

// The run directory is checked before anything expensive; it is created after the model exists.
// A resumed run continues the logs there. `resume_asked`: --resume was given.
void check_run_dir_early(const Process& proc, const std::string& run_dir, bool reuse, bool resume_asked) {
  std::string error;
  if (proc.rank0()) {
    try {
      log::check_run_dir(run_dir, reuse);
    } catch (const ConfigError& e) {
      error = e.what();
      if (elastic_restart(proc) && !resume_asked)  // a restart that cannot continue its own run
        error += fmt::format(" (this is torchrun restart {}: add --resume auto so that a restart continues the run)",
                             proc.launch.restart_count);
    }
  }
  fail_together(*proc.comm, error, "run directory check");
}

// train.micro_batch: auto: the micro-batch every rank fits (find_micro_batch per rank, the smallest over
// ranks), written into the recipe with its grad_accum; the trials for summary.json.
nlohmann::json choose_micro_batch(config::RunConfig& cfg, const memory::Scenario& sc, const Process& proc,
                                  int64_t limit) {
  const int64_t world = proc.world();
  // each data-parallel rank (with its sequence group) holds its share of every step's global batch
  const int64_t per_rank = proc.mesh().sequences_per_rank(cfg.train.global_batch);
  BatchSearch found = find_micro_batch(cfg, per_rank, proc.device);
  if (world > 1) {  // every rank must train the same micro-batch: take the smallest that fits everywhere
    const auto agreed =
        static_cast<int64_t>(-proc.comm->all_reduce_max(-static_cast<double>(found.micro_batch), "micro_batch auto"));
    if (agreed != found.micro_batch && agreed > 0)
      found.micro_batch = agreed, found.grad_accum = per_rank / agreed;
    if (agreed == 0) found.micro_batch = 0;
  }
  Json trials = Json::array();
  for (const auto& [b, ok] : found.trials) trials.push_back({{"micro_batch", b}, {"fits", ok}});
  if (found.micro_batch == 0) {
    memory::Scenario whole = sc.at(1);  // the per-rank batch as micro-batch 1 x accumulation
    whole.grad_accum = per_rank;
    throw OomError(fmt::format("train.micro_batch: auto: not even micro-batch 1 fits memory.limit {}; {}",
                               cfg.memory.limit.text, planner::oom_advice(whole, limit)));
  }
  cfg.train.micro_batch = found.micro_batch;
  cfg.train.grad_accum = found.grad_accum;
  if (proc.rank0())
    spdlog::info(
        "micro_batch auto: planner predicted {}, tried {}, chose {} x grad_accum {} per rank (global batch {})",
        found.predicted, trials.dump(), found.micro_batch, found.grad_accum, cfg.train.global_batch);
  return {{"planner_prediction", found.predicted}, {"trials", trials}, {"micro_batch", found.micro_batch},
          {"grad_accum", found.grad_accum}, {"global_batch", cfg.train.global_batch}};
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
    std::copy(next, next + recompute::kPartSets, b.kept.begin()), next += recompute::kPartSets;
    std::copy(next, next + recompute::kPartSets, b.backward.begin()), next += recompute::kPartSets;
    b.forward = *next++;
  }
  return mine;
}

// The run's checkpointing plan: the one setup() resolved from the recipe (make_plan's rule, or mode
// budget's schedule from formula costs), or with checkpointing.profile_costs the schedule solved from
// the block costs profiled on this model, device and precision (the formula schedule was the check,
// before any weight existed, that some schedule fits).
recompute::Plan run_plan(const memory::Scenario& sc, int64_t seed, const Process& proc, model::GPT model,
                             recompute::Plan resolved) {
  if (!sc.checkpointing.mode.solved() || !sc.checkpointing.profile_costs) return resolved;
  const auto costs = rank0_costs(*proc.comm, budget::profile_costs(sc, model, proc.device, seed));
  return budget::budget_plan(sc, costs);
}

// The model on the run's device (zero3: deferred, the strategy draws each unit's values in turn and keeps
// its shard); out of memory here is an OomError with the planner's advice.
model::GPT make_model(const memory::Scenario& sc, int64_t seed, torch::Device device, int64_t limit) {
  torch::manual_seed(static_cast<uint64_t>(seed));
  try {
    model::GPT m(sc.model, device, /*deferred=*/sc.placement.sharding.shards_params());
    m->train();
    return m;
  } catch (const c10::OutOfMemoryError& e) {  // before the run directory exists: nothing to clean up
    throw OomError(fmt::format("out of memory while building the model ({}). To fit, {}",
                               std::string(e.what_without_backtrace()).substr(0, 200),
                               planner::oom_advice(sc, limit)));
  }
}

// What trains: the model, its runner under the run's plan, the data-parallel strategy, AdamW and the
// step's precision. meter.build_peak_bytes: the tensor bytes at the peak of building them.
Learner build_learner(const config::RunConfig& cfg, const memory::Scenario& sc, const Process& proc, Meter& meter,
                      recompute::Plan resolved) {
  Learner l;
  meter.tracker->reset_peak();
  const int64_t before_build = meter.tracker->read().allocated_bytes;
  l.model = make_model(sc, cfg.train.seed, proc.device, meter.limit);
  // parallel.sequence > 1: this rank's positions
  l.model->shard_sequence(parallel::sequence_exchange(proc.comm.get()));
  const int64_t model_peak = meter.tracker->read().peak_allocated_bytes;
  // the budget profile resets the peak to measure its own
  auto plan = run_plan(sc, cfg.train.seed, proc, l.model, std::move(resolved));
  meter.tracker->reset_peak();
  l.runner = std::make_unique<recompute::Runner>(cfg.checkpointing, l.model, std::move(plan));
  // zero3: autocast's cache of low-precision weight copies (kept until the forward's autocast region
  // ends) would keep every unit's weights alive after the unit's fp32 storage is freed.
  if (cfg.parallel.sharding.shards_params()) at::autocast::set_autocast_cache_enabled(false);
  l.strategy = parallel::make_strategy(l.model, parallel::Spec::of(cfg), proc.comm);
  l.strategy->attach(*l.runner);
  meter.build_peak_bytes = std::max(model_peak, meter.tracker->read().peak_allocated_bytes) - before_build;
  l.opt = l.strategy->make_optimizer(cfg.train);
  if (cfg.optim.in_backward) l.strategy->step_in_backward(*l.opt);
  l.scaler = std::make_unique<precision::LossScaler>(cfg.precision, proc.device);
  l.precision = {precision::compute_dtype(cfg.precision.compute), l.scaler.get()};
  l.forward = [runner = l.runner.get()](const torch::Tensor& idx) { return runner->forward(idx); };
  l.loss = [runner = l.runner.get()](const torch::Tensor& idx, const torch::Tensor& y, const torch::Tensor& p) {
    return runner->loss(idx, y, p);
  };
  l.graph = std::make_unique<StepGraph>(graph_eligibility(cfg, proc.world(), proc.device), cfg.train.cuda_graphs,
                                        l.model->parameters());
  return l;
}

// data.tokenizer (or the tokenizer.json beside data.path): its vocabulary checked against model.vocab_size
// (exit 2 naming both), and opened for train.sample_interval (bytes for a 256-token model without one).
// Then the token splits: a bad file fails here, before a run directory or a model exists.
Inputs open_inputs(const config::DataConfig& d, const config::TrainConfig& t, int64_t vocab_size) {
  Inputs in;
  in.tokenizer_path = data::tokenizer_path(d);
  if (!in.tokenizer_path.empty())
    text::check_vocab_match(text::inspect_tokenizer_file(in.tokenizer_path).vocab_size, vocab_size,
                            "data.tokenizer " + in.tokenizer_path.string());
  if (t.sample_interval > 0) {
    in.codec = text::TextCodec::open(in.tokenizer_path, vocab_size);
    in.codec->prompt(t.sample_prompt);  // a prompt it cannot start from fails now, not at the first sample
  }
  // after the tokenizer: a vocabulary mismatch is named as one, not as a token out of range
  in.splits = data::open_splits(d, vocab_size, t.seq_len, t.seed);
  return in;
}

// The train and validation loaders, once the micro-batch is known: each data-parallel rank its own
// sequences, each rank of a sequence group its piece of their positions.
void open_loaders(const config::TrainConfig& t, const Process& proc, Inputs& in) {
  const auto seed = static_cast<uint64_t>(t.seed);
  const auto& sp = in.splits;
  const auto loader = [&](const std::shared_ptr<data::TokenSource>& windows,
                          const std::shared_ptr<data::ExampleSource>& examples, uint64_t s) {
    if (windows) return std::make_unique<data::Loader>(windows, t.micro_batch, t.seq_len, s, proc.mesh());
    return std::make_unique<data::Loader>(examples, t.micro_batch, t.seq_len, s, proc.mesh(), sp.packing);
  };
  in.train_loader = loader(sp.train, sp.train_examples, seed);
  in.val_loader = loader(sp.val, sp.val_examples, seed + 1);
}

// The step through which metrics.jsonl keeps its records (RunLog's resume_step): the resumed state's; 0
// for a torchrun restart of --resume that found no state yet (its steps start over, and the earlier
// attempts' `restart` events stay); -1 for a new run (the file is replaced).
int64_t records_kept_through(const Process& proc, const Start& start, bool resume_asked) {
  if (start.resume_from.found()) return start.resume_from.step;
  return elastic_restart(proc) && resume_asked ? 0 : -1;
}

// Creates (rank 0) the run directory and its run log, writes config.json and keeps the run's tokenizer
// (<run dir>/tokenizer.json with a tokenizer_config.json: `trainer export`, logging.save_model and
// `trainer sample --run` read them). A failure on rank 0 stops every rank with its exit code.
void open_run_log(const config::RunConfig& cfg, const Process& proc, const Start& start, const Inputs& in,
                  Outputs& out) {
  lock_run_dir(proc, out, /*create=*/true);
  int code = kExitOk;
  std::string error;
  try {  // rank 0's writes; a failure there stops every rank with its exit code
    out.runlog =
        std::make_unique<log::RunLog>(out.run_dir, proc.rank0(), cfg.logging.overwrite,
                                      records_kept_through(proc, start, !cfg.resume.empty()), cfg.logging.tensorboard);
    out.resolved = config::to_json(cfg);
    out.runlog->write_json("config.json", out.resolved);
    if (!in.tokenizer_path.empty() && proc.rank0())
      text::write_hf_tokenizer(out.run_dir, in.tokenizer_path, cfg.model.max_seq_len);
  } catch (const Error& e) {
    code = e.code;
    error = e.what();
  }
  proc.comm->fail_together(code, error, "run directory creation");
}

// What the run predicts and measures about itself before its first step: FLOPs per token, the planner's
// activation estimate, the MFU's peak (the probe runs the model's own GEMM shapes beside square ones).
void measure(const memory::Scenario& sc, const Process& proc, const Learner& learn, Meter& meter) {
  meter.flops_per_token = flops_per_token(*learn.model, sc.seq_len);
  meter.recompute_flops_per_token = learn.runner->recompute_flops_per_token(sc.seq_len);
  const auto& plan = learn.runner->plan();
  meter.predicted = memory::estimate_activation_peak(sc, plan);
  // A budget schedule solved with profiled bytes: its peak by those bytes, the model it was solved with.
  if (plan.budget.bytes_source == "profile") meter.predicted.peak_bytes = plan.budget.predicted_peak_bytes;
  const auto shapes = model_gemm_shapes(sc.model, sc.local_tokens());  // this rank's rows (parallel.sequence: B*T/N)
  meter.peak =
      PeakTracker(peak_flops(proc.device, sc.precision.compute, sc.peak_tflops, shapes, device::tf32_matmuls()));
}

// summary.json's environment and model blocks.
void describe(const Process& proc, const Learner& learn, const Meter& meter, Outputs& out) {
  out.environment = {{"torch_version", TORCH_VERSION},
                     {"device", proc.device.str()},
                     {"cuda_available", torch::cuda::is_available()},
                     {"tf32", proc.device.is_cuda() && device::tf32_matmuls()},  // precision.tf32, as set
                     {"threads", at::get_num_threads()},
                     {"world_size", proc.world()},
                     {"rank", proc.launch.rank},
                     {"backend", proc.comm->backend()},
                     {"memory_source", meter.tracker->source()},
                     {"cpu", device::cpu_features().to_json()}};  // the CPU paths that change memory and speed
  out.model_info = {{"params", learn.model->num_params()},
                    {"padding_params", learn.model->num_padding_params()},
                    {"matmul_params", learn.model->num_matmul_params()},
                    {"trained_params", learn.model->num_trained_params()},
                    {"flops_per_token", meter.flops_per_token},
                    {"recompute_flops_per_token", meter.recompute_flops_per_token},
                    {"peak_flops", meter.peak.flops()},
                    {"peak_flops_source", meter.peak.source()},
                    {"peak_flops_dtype", meter.peak.initial().dtype}};
}

// A bf16/fp16 run on a CPU where matmuls in that dtype take ATen's fallback GEMM (no oneDNN kernel for
// it: AVX2 only, or oneDNN capped below AVX-512) and SUBLINEAR_ATEN_KERNELS=1 turned the widened
// linears off (model/linear.h) trains far slower than fp32 would (docs/precision.md).
void warn_fallback_matmuls(const memory::Scenario& sc, const Process& proc) {
  if (!proc.device.is_cpu() || !precision::compute_dtype(sc.precision.compute)) return;
  if (memory::lowp_matmul_path(sc) != device::LowpMatmul::aten) return;
  spdlog::warn(
      "precision.compute {}: this CPU has no oneDNN matmul kernel for it (no AVX-512, or ONEDNN_MAX_CPU_ISA below it), "
      "so its matmuls take "
      "ATen's fallback GEMM, far slower than fp32 (0.8 against 104 GFLOP/s on an AVX2 AMD EPYC), and "
      "SUBLINEAR_ATEN_KERNELS "
      "turned off the widened linears that avoid it: unset it, or train in precision.compute: fp32 (docs/precision.md)",
      sc.precision.compute.name());
}

// The start-up table (rank 0): the recipe's rows (config::to_rows), then each part's own.
void print_settings(std::vector<std::pair<std::string, std::string>> rows, const Process& proc,
                    const Learner& learn, const Inputs& in, const Meter& meter, const std::string& run_dir) {
  if (!proc.rank0()) return;
  rows.emplace_back("run directory", run_dir);
  rows.emplace_back("device", proc.device.str());
  rows.emplace_back("threads", std::to_string(at::get_num_threads()));
  rows.emplace_back("fp32 matmuls",
                    proc.device.is_cuda() && device::tf32_matmuls() ? "TF32 (precision.tf32)" : "IEEE fp32");
  rows.emplace_back("cuda graphs", learn.graph->describe());  // train.cuda_graphs, as this run will use it
  rows.emplace_back("data parallel", learn.strategy->describe());
  rows.emplace_back("checkpointing plan", learn.runner->plan().describe());
  rows.emplace_back("predicted activation peak",
                    fmt::format("{} per micro-batch", log::format_bytes(meter.predicted.peak_bytes)));
  const auto params = learn.model->num_params();
  const auto padding = learn.model->num_padding_params();
  rows.emplace_back("parameters",
                    padding == 0 ? fmt::format("{} ({:.2f} M)", params, static_cast<double>(params) / 1e6)
                                 : fmt::format("{} ({:.2f} M), of which {} the vocabulary padding's zero rows "
                                               "(model.vocab_multiple; {} without them)",
                                               params, static_cast<double>(params) / 1e6, padding, params - padding));
  if (learn.model->cfg.lora.enabled()) {
    const auto trained = learn.model->num_trained_params();
    rows.emplace_back("trained parameters",
                      fmt::format("{} ({:.2f}% of them: model.lora's adapters on {}; the rest frozen)", trained,
                                  100.0 * static_cast<double>(trained) / static_cast<double>(params),
                                  fmt::join(config::lora_target_names(learn.model->cfg), ", ")));
  }
  rows.emplace_back("train data", in.splits.describe_train());
  rows.emplace_back("val data", in.splits.describe_val());
  rows.emplace_back("peak FLOP/s for MFU", fmt::format("{:.3g} ({})", meter.peak.flops(), meter.peak.source()));
  fmt::print("{}", log::format_table(rows));
  std::fflush(stdout);
}

// train.cuda_graphs: on in a run that is not eligible (rank 0, after the table): it runs eager, and why.
void warn_eager_graphs(config::CudaGraphs wanted, const StepGraph& graph, const Process& proc) {
  if (proc.rank0() && wanted == config::CudaGraphs::kOn && !graph.eligible())
    spdlog::warn("train.cuda_graphs: on, but this run is not eligible and runs eager: {}", graph.reason());
}

}  // namespace

namespace {

// offload.*: the model states placed in host memory against memory.host_limit (when set).
void check_host_states_fit(int64_t host_limit, const memory::PeakPrediction& p) {
  if (host_limit <= 0 || p.host_states_bytes() <= host_limit) return;
  throw OomError(fmt::format(
      "the offloaded model states cannot fit host memory: {} per rank (fp32 masters {}, gradients {}, AdamW moments "
      "{}) "
      "but memory.host_limit is {}. Nothing was allocated. To fit: raise memory.host_limit, offload less (offload.*), "
      "or shard over more ranks (each rank offloads its shard)",
      log::format_bytes(p.host_states_bytes()), log::format_bytes(p.host_params_bytes),
      log::format_bytes(p.host_grads_bytes), log::format_bytes(p.host_optimizer_bytes), log::format_bytes(host_limit)));
}

}  // namespace

void check_model_states_fit(memory::Scenario sc, int64_t host_limit, torch::Device device, int64_t limit) {
  const auto capacity = limit > 0 ? memory::Capacity{limit, "memory.limit"} : memory::device_capacity(device);
  // The states do not depend on the checkpointing mode (a budget is checked with the plan).
  sc.checkpointing = config::CheckpointingConfig{};
  const memory::PeakPrediction p = planner::predict_peak(sc);
  check_host_states_fit(host_limit, p);
  const int64_t states = p.model_states_bytes();
  if (capacity.bytes <= 0 || states <= capacity.bytes) return;
  const int64_t params = sc.shape().total_params();
  const int64_t ranks_needed = (16 * params + capacity.bytes - 1) / capacity.bytes;
  throw OomError(fmt::format(
      "the model cannot fit: {} parameters need {} of model states per rank (weights {}, gradients {}, AdamW moments "
      "{}; parallel.sharding {} over {} rank(s)) but the {} is {}. Nothing was allocated. To fit: fewer layers or a "
      "smaller model.n_embd, parallel.sharding: zero3 over at least {} ranks (it divides all three states by the "
      "world size), or host memory for them (offload.optimizer, + gradients, + parameters); precision.compute does not "
      "shrink these fp32 states",
      params, log::format_bytes(states), log::format_bytes(p.params_bytes), log::format_bytes(p.grads_bytes),
      log::format_bytes(p.optimizer_bytes), sc.placement.sharding.name(), std::max<int64_t>(1, sc.placement.world),
      capacity.source, log::format_bytes(capacity.bytes), ranks_needed));
}

std::unique_ptr<Session> setup(const config::RunConfig& recipe) {
  auto s = std::make_unique<Session>();
  auto& cfg = s->cfg;
  cfg = recipe;
  s->proc = init_process(cfg);
  // data first: a bad file or tokenizer fails before a run directory or a model exists
  s->data = open_inputs(cfg.data, cfg.train, cfg.model.vocab_size);
  s->out.run_dir = choose_run_dir(cfg.logging, cfg.state, cfg.resume, cfg.recipe_name, s->proc);
  lock_run_dir(s->proc, s->out, /*create=*/false);
  s->start.resume_from = find_resume_point(cfg, s->proc, s->out.run_dir);
  open_init_from(cfg.model, s->start);
  check_run_dir_early(s->proc, s->out.run_dir, cfg.logging.overwrite || s->start.resume_from.found(),
                      !cfg.resume.empty());
  auto& meter = s->meter;
  meter.tracker = std::make_unique<memory::Tracker>(s->proc.device);
  meter.limit = cfg.memory.limit.bytes;
  meter.tracker->set_limit(meter.limit);  // before the model exists: the limit covers everything, as on a GPU
  meter.tracker->set_host_limit(cfg.memory.host_limit.bytes);
  // The memory model's input, made once; the states do not depend on the micro-batch (1 while auto).
  memory::Scenario& sc = meter.scenario;
  sc = memory::Scenario::of(cfg);
  check_model_states_fit(sc, cfg.memory.host_limit.bytes, s->proc.device, meter.limit);
  if (cfg.train.micro_batch.is_auto()) {
    meter.batch_search = choose_micro_batch(cfg, sc, s->proc, meter.limit);
    sc.micro_batch = cfg.train.micro_batch, sc.grad_accum = cfg.train.grad_accum;  // the numbers it chose
  }
  // The plan, resolved once before a model exists; a budget no schedule fits stops here (exit 2),
  // before a model or a run directory exists.
  auto plan = budget::plan_for(sc);
  open_loaders(cfg.train, s->proc, s->data);
  s->learn = build_learner(cfg, sc, s->proc, meter, std::move(plan));
  meter.load_peak_bytes = peak_during(*meter.tracker, [&] { load_init_from(s->proc, s->start, s->learn); });
  measure(sc, s->proc, s->learn, meter);
  describe(s->proc, s->learn, meter, s->out);
  open_run_log(cfg, s->proc, s->start, s->data, s->out);
  print_settings(config::to_rows(cfg), s->proc, s->learn, s->data, meter, s->out.run_dir);
  warn_eager_graphs(cfg.train.cuda_graphs, *s->learn.graph, s->proc);
  warn_fallback_matmuls(sc, s->proc);
  return s;
}

state::Parts state_parts(const config::RunConfig& cfg, const Process& proc, Learner& learn, Inputs& data,
                         const std::string& run_dir) {
  return {.cfg = cfg,
          .launch = proc.launch,
          .comm = proc.comm.get(),
          .device = proc.device,
          .strategy = *learn.strategy,
          .opt = learn.opt.get(),
          .scaler = learn.scaler.get(),
          .train_loader = data.train_loader.get(),
          .val_loader = data.val_loader.get(),
          .run_dir = run_dir};
}

namespace {

// A torchrun restart is recorded at its start, before anything trains: a `restart` event with the
// attempt (TORCHELASTIC_RESTART_COUNT) and the step it continues from (0, state null: nothing was saved
// before the failure, the steps start over).
void record_restart(const state::Parts& saves, const Start& start, log::RunLog& runlog) {
  const int64_t attempt = saves.launch.restart_count;
  if (attempt == 0) return;
  const bool found = start.resume_from.found();
  const int64_t step = found ? start.resume_from.step : 0;
  runlog.event("restart", {{"step", step}, {"restart", attempt},
                           {"state", found ? Json(start.resume_from.dir.string()) : Json(nullptr)}});
  if (saves.rank0())
    spdlog::warn("torchrun restart {}: {}", attempt,
                 found ? fmt::format("continuing from the state of step {}", step)
                       : std::string("no state was saved before the failure; starting again from step 0"));
}

void load_state(state::Parts& saves, const Start& start, Meter& meter, log::RunLog& runlog, LoopState& st) {
  const auto t0 = Clock::now();
  const auto& from = start.resume_from;
  meter.load_peak_bytes = peak_during(*meter.tracker, [&] { state::load(from, saves, st); });
  const double load_ms = ms_since(t0);
  // Already on disk where this run saves (a resume into another state.dir saves its own copy at the end).
  std::error_code ec;
  if (std::filesystem::equivalent(from.dir.parent_path(), state::state_root(saves.cfg.state, saves.run_dir), ec))
    st.last_saved_step = st.steps_done;
  runlog.event("resume", {{"step", st.steps_done},
                          {"state", from.dir.string()},
                          {"saved_world_size", from.meta.at("world_size")},
                          {"saved_sharding", from.meta.at("sharding")},
                          {"load_ms", load_ms},
                          {"restart", saves.launch.restart_count}});
  if (saves.rank0()) spdlog::info("state of step {} loaded in {:.0f} ms", st.steps_done, load_ms);
}

}  // namespace

void restore(state::Parts& saves, const Start& start, Meter& meter, log::RunLog& runlog, LoopState& st) {
  record_restart(saves, start, runlog);
  if (start.resume_from.found()) load_state(saves, start, meter, runlog, st);
}

}  // namespace sl::train
