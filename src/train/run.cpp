// A training run: setup, the step loop, the final report (see run.h).
#include "train/run.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <new>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "memory/cpu_features.h"
#include "memory/planner.h"
#include "memory/tracking_allocator.h"
#include "precision/autocast.h"
#include "train/schedule.h"

namespace sl::train {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

// SIGINT/SIGTERM set a flag the loop reads after each step; the previous handlers come back after.
struct SignalGuard {
  using Handler = void (*)(int);
  Handler old_int, old_term;
  SignalGuard() {
    g_signal.store(0);
    old_int = std::signal(SIGINT, on_signal);
    old_term = std::signal(SIGTERM, on_signal);
  }
  ~SignalGuard() {
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
  }
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// runs/<recipe>-<timestamp>, with -2, -3, ... when a run started in the same second already has it.
std::string default_run_dir(const config::RunConfig& cfg) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", std::localtime(&now));
  const std::string base = fmt::format("runs/{}-{}", cfg.recipe_name, stamp);
  std::string dir = base;
  for (int i = 2; std::filesystem::exists(dir); ++i) dir = fmt::format("{}-{}", base, i);
  return dir;
}

// Rank 0 alone touches the run directory. When its check failed (error non-empty there), every rank
// throws the same ConfigError now instead of waiting in the next collective for parallel.timeout_s.
void fail_together(parallel::Comm& comm, std::string error, const std::string& what) {
  if (comm.world() > 1 && comm.all_reduce_max(error.empty() ? 0.0 : 1.0, what) > 0.0 && error.empty())
    error = fmt::format("rank 0 failed the {} (see its error)", what);
  if (!error.empty()) throw ConfigError(error);
}

// ---- setup ----

void init_process(Session& s) {
  s.launch = parallel::LaunchEnv::from_env();
  s.cfg.world_size = s.launch.world;
  config::validate(s.cfg);  // train.global_batch against the real world size
  s.device = resolve_device(s.cfg.train, s.launch.local_rank);
  if (s.device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(s.device);  // one GPU per local rank
  if (s.cfg.train.threads > 0) at::set_num_threads(static_cast<int>(s.cfg.train.threads));
  // Rendezvous before reading data or building the model: a missing peer fails fast (exit 5).
  s.comm = std::make_shared<parallel::Comm>(s.launch, s.cfg.parallel, s.device);
}

// The run directory is checked before anything expensive; it is created after the model exists.
void check_run_dir_early(Session& s) {
  s.run_dir = s.cfg.logging.dir.empty() ? default_run_dir(s.cfg) : s.cfg.logging.dir;
  std::string error;
  if (s.rank0()) {
    try {
      log::check_run_dir(s.run_dir, s.cfg.logging.overwrite);
    } catch (const ConfigError& e) {
      error = e.what();
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
                               cfg.memory.limit, memory::oom_advice(cfg, s.limit)));
  cfg.train.micro_batch = found.micro_batch;
  cfg.train.grad_accum = found.grad_accum;
  if (s.rank0())
    spdlog::info("micro_batch auto: planner predicted {}, tried {}, chose {} x grad_accum {} per rank (global batch {})",
                 found.predicted, trials.dump(), found.micro_batch, found.grad_accum, cfg.train.global_batch);
}

void build_model(Session& s) {
  const auto& cfg = s.cfg;
  torch::manual_seed(static_cast<uint64_t>(cfg.train.seed));
  try {
    s.model = model::GPT(cfg.model, s.device);
  } catch (const c10::OutOfMemoryError& e) {  // before the run directory exists: nothing to clean up
    throw OomError(fmt::format("out of memory while building the model ({}). To fit, {}",
                               std::string(e.what_without_backtrace()).substr(0, 200), memory::oom_advice(cfg, s.limit)));
  }
  s.model->train();
  s.policy = std::make_unique<recompute::Policy>(cfg.checkpointing, s.model);
  // zero3: autocast's cache of low-precision weight copies (kept until the forward's autocast region
  // ends) would keep every unit's weights alive after the unit's fp32 storage is freed.
  if (cfg.parallel.sharding == "zero3") at::autocast::set_autocast_cache_enabled(false);
  if (s.world() > 1 || cfg.parallel.sharding != "none") {
    s.engine = std::make_unique<parallel::Engine>(s.model, cfg, s.comm);
    s.engine->attach(*s.policy);
  }
  s.opt = s.engine ? s.engine->make_optimizer(cfg.train) : make_optimizer(s.model, cfg.train);
  s.scaler = std::make_unique<precision::LossScaler>(cfg.precision, s.device);
  s.precision = {precision::compute_dtype(cfg.precision.compute), s.scaler.get()};
  s.forward = [policy = s.policy.get()](const torch::Tensor& idx) { return policy->forward(idx); };
}

void open_run_log(Session& s) {
  std::string error;
  try {
    s.runlog = std::make_unique<log::RunLog>(s.run_dir, s.rank0(), s.cfg.logging.overwrite);
  } catch (const ConfigError& e) {
    error = e.what();
  }
  fail_together(*s.comm, error, "run directory creation");
  s.resolved = config::to_json(s.cfg);
  s.runlog->write_json("config.json", s.resolved);
}

void describe(Session& s) {
  const auto& cfg = s.cfg;
  s.flops_per_token = flops_per_token(*s.model, cfg.train.seq_len);
  s.recompute_flops_per_token = s.policy->recompute_flops_per_token(cfg.train.seq_len);
  s.predicted = memory::estimate_activation_peak(cfg, s.policy->plan());
  const bool peak_measured = cfg.logging.peak_tflops <= 0.0;
  s.peak_flops = peak_measured ? measure_gemm_flops(s.device) : cfg.logging.peak_tflops * 1e12;
  s.environment = {{"torch_version", TORCH_VERSION},
                   {"device", s.device.str()},
                   {"cuda_available", torch::cuda::is_available()},
                   {"threads", at::get_num_threads()},
                   {"world_size", s.world()},
                   {"rank", s.launch.rank},
                   {"backend", s.comm->backend()},
                   {"memory_source", s.tracker->source()},
                   {"cpu", memory::cpu_features().to_json()}};  // the CPU paths that change memory and speed
  s.model_info = {{"params", s.model->num_params()},
                  {"matmul_params", s.model->num_matmul_params()},
                  {"flops_per_token", s.flops_per_token},
                  {"recompute_flops_per_token", s.recompute_flops_per_token},
                  {"peak_flops", s.peak_flops},
                  {"peak_flops_source", peak_measured ? "measured_fp32_gemm" : "logging.peak_tflops"}};
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
                                                   cfg.parallel.sharding));
  rows.emplace_back("checkpointing plan", s.policy->plan().describe());
  rows.emplace_back("predicted activation peak",
                    fmt::format("{} per micro-batch", log::format_bytes(s.predicted.peak_bytes)));
  rows.emplace_back("parameters", fmt::format("{} ({:.2f} M)", s.model->num_params(), s.model->num_params() / 1e6));
  rows.emplace_back("train data", s.splits.train->describe());
  rows.emplace_back("val data", s.splits.val->describe());
  rows.emplace_back("peak FLOP/s for MFU",
                    fmt::format("{:.3g} ({})", s.peak_flops, s.model_info["peak_flops_source"].get<std::string>()));
  fmt::print("{}", log::format_table(rows));
  std::fflush(stdout);
}

// ---- the step loop ----

void warn(const Session& s, log::ProgressBar& bar, const std::string& text) {
  if (!s.rank0()) return;
  bar.clear();
  spdlog::warn("{}", text);
}

// A step that did not update the weights, or should stop the run: fp16 overflow skips (diverged
// after precision.max_skipped_steps in a row), a non-finite loss, non-finite gradients
// (train.on_nonfinite). Throws NonFiniteError after writing the event.
void check_step(Session& s, LoopState& st, const StepResult& r, int64_t step, log::ProgressBar& bar) {
  const auto& cfg = s.cfg;
  const int64_t steps = cfg.train.steps;
  if (!r.skipped && !r.nonfinite_grads) {
    st.consecutive_skips = 0;
    if (!std::isfinite(r.loss)) {
      s.runlog->event("non_finite_loss", {{"step", step + 1}, {"loss", r.loss}});
      throw NonFiniteError(fmt::format("step {}: loss is {}; lower train.lr or raise train.warmup_steps", step + 1, r.loss));
    }
    return;
  }
  if (r.nonfinite_grads && cfg.train.on_nonfinite == "abort") {
    s.runlog->event("non_finite_grad", {{"step", step + 1}, {"loss", r.loss}, {"action", "abort"}});
    throw NonFiniteError(fmt::format("step {}: gradients hold NaN/Inf while the loss is finite ({:.4f}); stopped before "
                                     "the optimizer step, weights untouched. Lower train.lr, or set "
                                     "train.on_nonfinite: skip to skip such steps",
                                     step + 1, r.loss));
  }
  ++st.skipped_steps;
  ++st.consecutive_skips;
  if (r.nonfinite_grads) {
    s.runlog->event("skip", {{"step", step + 1}, {"reason", "non_finite_grad"}, {"loss", r.loss}});
    warn(s, bar, fmt::format("step {:>5}/{} | non-finite gradients: step skipped (train.on_nonfinite: skip)", step + 1, steps));
  } else {
    s.runlog->event("skip", {{"step", step + 1}, {"reason", "fp16_overflow"}, {"loss_scale", r.loss_scale},
                             {"new_loss_scale", s.scaler->scale()}});
    warn(s, bar, fmt::format("step {:>5}/{} | non-finite gradients at loss scale {:g}: step skipped, scale now {:g}",
                             step + 1, steps, r.loss_scale, s.scaler->scale()));
  }
  const int64_t limit = cfg.precision.max_skipped_steps;
  if (r.skipped && limit > 0 && st.consecutive_skips >= limit) {
    s.runlog->event("diverged", {{"step", step + 1}, {"consecutive_skips", st.consecutive_skips},
                                 {"loss_scale", s.scaler->scale()}});
    throw NonFiniteError(fmt::format("step {}: {} fp16 steps in a row were skipped (loss scale now {:g}): the run has "
                                     "diverged. Lower train.lr, raise train.warmup_steps, or use precision.compute: bf16 "
                                     "(precision.max_skipped_steps sets this limit)",
                                     step + 1, st.consecutive_skips, s.scaler->scale()));
  }
}

Json step_record(const Session& s, const StepResult& r, int64_t step, double lr, const recompute::Stats& rs) {
  const double world = static_cast<double>(s.world());
  const double tps = static_cast<double>(s.tokens_per_step()) / (r.ms * 1e-3);
  const auto& t = s.cfg.train;
  return {{"step", step + 1},
          {"loss", r.loss},
          {"lr", lr},
          {"grad_norm", std::isfinite(r.grad_norm) ? Json(r.grad_norm) : Json(nullptr)},
          {"loss_scale", r.loss_scale},
          {"skipped", r.skipped || r.nonfinite_grads},
          {"step_ms", r.ms},
          {"tokens", s.tokens_per_step()},
          {"tokens_per_s", tps},
          {"samples_per_s", static_cast<double>(t.micro_batch * t.grad_accum) * world / (r.ms * 1e-3)},
          {"mfu", s.flops_per_token * tps / (s.peak_flops * world)},  // per-device peak
          {"hfu", (s.flops_per_token + s.recompute_flops_per_token) * tps / (s.peak_flops * world)},
          {"recompute_ms", rs.recompute_ms},
          {"peak_allocated_bytes", r.mem.peak_allocated_bytes},
          {"activation_peak_bytes", r.activation_peak_bytes()},
          {"allocated_bytes", r.mem.allocated_bytes},
          {"reserved_bytes", r.mem.reserved_bytes}};
}

void accumulate(Session& s, LoopState& st, const StepResult& r, const Json& rec, int64_t step) {
  if (s.engine) st.transient_peak = std::max(st.transient_peak, s.engine->take_transient_peak()), st.gathers = s.engine->gathers();
  st.rest_bytes = r.mem.allocated_bytes;
  if (r.mem.peak_allocated_bytes >= st.peak_bytes) st.peak_bytes = r.mem.peak_allocated_bytes, st.states_at_peak = r.states;
  st.steps_done = step + 1;
  st.last_loss = r.loss;
  const int64_t skip_first = s.cfg.logging.skip_first;
  if (step >= skip_first || s.cfg.train.steps <= skip_first) {
    st.step_ms.push_back(r.ms);
    st.tok_s.push_back(rec["tokens_per_s"].get<double>());
    st.mfus.push_back(rec["mfu"].get<double>());
    st.samp_s.push_back(rec["samples_per_s"].get<double>());
    st.recompute_ms.push_back(rec["recompute_ms"].get<double>());
    st.act_peaks.push_back(static_cast<double>(r.activation_peak_bytes()));
  }
}

void maybe_evaluate(Session& s, LoopState& st, log::ProgressBar& bar) {
  const auto& t = s.cfg.train;
  if (t.eval_interval <= 0 || (st.steps_done % t.eval_interval != 0 && st.steps_done != t.steps)) return;
  st.last_val = evaluate(s.model, *s.val_loader, t.eval_batches, s.device, s.precision.autocast, s.forward);
  if (s.world() > 1) st.last_val = s.comm->all_reduce_sum(st.last_val, "eval loss average") / static_cast<double>(s.world());
  s.runlog->event("eval", {{"step", st.steps_done}, {"val_loss", st.last_val}});
  if (s.rank0()) {
    bar.clear();
    spdlog::info("step {:>5}/{} | val loss {:.4f}", st.steps_done, t.steps, st.last_val);
  }
}

constexpr int kStopIo = 1000;  // above every signal number

// Why the run stops after this step (0: it goes on): a signal seen by any rank (torchrun forwards it
// to all, not at the same step) or rank 0's failed log write (kStopIo), agreed after each step so
// every rank stops at the same one and the collectives after the loop still pair up.
int agreed_stop(Session& s) {
  int stop = s.runlog->failure().empty() ? g_signal.load() : kStopIo;
  if (s.world() > 1) stop = static_cast<int>(s.comm->all_reduce_max(static_cast<double>(stop), "stop flag"));
  return stop;
}

Outcome stop_outcome(Session& s, const LoopState& st, int stop) {
  if (stop == kStopIo) {
    const std::string& mine = s.runlog->failure();
    return {kExitIo, mine.empty() ? fmt::format("rank 0 could not write its logs after step {}", st.steps_done) : mine,
            nullptr};
  }
  s.runlog->event("interrupted", {{"step", st.steps_done}, {"signal", stop}});
  return {stop == SIGINT ? kExitSigint : kExitSigterm,
          fmt::format("interrupted by signal {} after step {}", stop, st.steps_done), nullptr};
}

// One optimizer step: learning rate, micro-batches, the step, checks, record, console, eval.
// Returns why the run stops after it (0: it goes on; see agreed_stop).
int loop_step(Session& s, LoopState& st, int64_t step, log::ProgressBar& bar) {
  const auto& t = s.cfg.train;
  const double lr = lr_at(t, step);
  for (auto& g : s.opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  std::vector<data::Batch> micro;
  for (int64_t m = 0; m < t.grad_accum; ++m) micro.push_back(s.train_loader->next());
  const StepResult r = train_step(s.forward, s.model, *s.opt, micro, t.grad_clip, s.device, *s.tracker, s.precision,
                                  s.engine.get());
  check_step(s, st, r, step, bar);
  const Json rec = step_record(s, r, step, lr, s.policy->take_stats());
  s.runlog->step(rec);
  accumulate(s, st, r, rec, step);
  bar.update(st.steps_done, r.loss);
  if (s.rank0() && (st.steps_done % s.cfg.logging.interval == 0 || st.steps_done == 1 || st.steps_done == t.steps)) {
    bar.clear();
    spdlog::info("{}", log::format_step_line(rec, t.steps));
  }
  maybe_evaluate(s, st, bar);
  return agreed_stop(s);
}

Outcome oom_outcome(Session& s, const LoopState& st, const std::string& what) {
  Outcome o;
  o.code = kExitOom;
  const memory::Snapshot snap = s.tracker->read();
  const int64_t requested = s.device.is_cpu() ? memory::TrackingCPUAllocator::instance().last_refused_bytes() : -1;
  const char* phase = current_phase();
  o.message = fmt::format("out of memory in {} at step {} ({}). To fit, {}", phase, st.steps_done + 1, what.substr(0, 300),
                          memory::oom_advice(s.cfg, s.limit));
  o.oom = {{"step", st.steps_done + 1},
           {"phase", phase},
           {"requested_bytes", requested >= 0 ? Json(requested) : Json(nullptr)},
           {"peak_bytes", snap.peak_allocated_bytes},
           {"limit_bytes", s.limit > 0 ? Json(s.limit) : Json(nullptr)},
           {"message", o.message}};
  s.runlog->event("oom", o.oom);
  return o;
}

// Anything else thrown inside the loop: a collective that failed inside a gradient hook (autograd
// wraps it) is a distributed failure; the rest is an internal error, reported with an event.
Outcome unexpected_outcome(Session& s, const LoopState& st, const std::string& what) {
  if (!s.comm->failure().empty()) return {kExitDistributed, s.comm->failure(), nullptr};
  Outcome o{kExitInternal, fmt::format("unexpected error at step {}: {}", st.steps_done + 1, what.substr(0, 1000)), nullptr};
  s.runlog->event("error", {{"step", st.steps_done + 1}, {"phase", current_phase()}, {"message", o.message}});
  return o;
}

}  // namespace

void check_model_states_fit(const config::RunConfig& cfg, torch::Device device, int64_t limit) {
  const auto capacity = limit > 0 ? memory::Capacity{limit, "memory.limit"} : memory::device_capacity(device);
  const memory::PeakPrediction p = memory::predict_peak(cfg);
  const int64_t states = p.model_states_bytes();
  if (capacity.bytes <= 0 || states <= capacity.bytes) return;
  const int64_t params = memory::total_params(cfg.model);
  const int64_t ranks_needed = (16 * params + capacity.bytes - 1) / capacity.bytes;
  throw OomError(fmt::format(
      "the model cannot fit: {} parameters need {} of model states per rank (weights {}, gradients {}, AdamW moments "
      "{}; parallel.sharding {} over {} rank(s)) but the {} is {}. Nothing was allocated. To fit: fewer layers or a "
      "smaller model.n_embd, or parallel.sharding: zero3 over at least {} ranks (it divides all three states by the "
      "world size); precision.compute does not shrink these fp32 states",
      params, log::format_bytes(states), log::format_bytes(p.params_bytes), log::format_bytes(p.grads_bytes),
      log::format_bytes(p.optimizer_bytes), cfg.parallel.sharding, std::max<int64_t>(1, cfg.world_size),
      capacity.source, log::format_bytes(capacity.bytes), ranks_needed));
}

std::unique_ptr<Session> setup(const config::RunConfig& recipe) {
  auto s = std::make_unique<Session>();
  s->cfg = recipe;
  init_process(*s);
  // Data first: a bad file fails here, before a run directory or a model exists.
  s->splits = data::open_splits(s->cfg);
  check_run_dir_early(*s);
  s->tracker = std::make_unique<memory::Tracker>(s->device);
  s->limit = config::memory_limit_bytes(s->cfg);
  s->tracker->set_limit(s->limit);  // before the model exists: the limit covers everything, as on a GPU
  check_model_states_fit(s->cfg, s->device, s->limit);
  if (s->cfg.train.micro_batch == 0) choose_micro_batch(*s);
  const auto& t = s->cfg.train;
  const auto seed = static_cast<uint64_t>(t.seed);
  s->train_loader = std::make_unique<data::Loader>(s->splits.train, t.micro_batch, t.seq_len, seed, s->launch.rank, s->world());
  s->val_loader = std::make_unique<data::Loader>(s->splits.val, t.micro_batch, t.seq_len, seed + 1, s->launch.rank, s->world());
  build_model(*s);
  describe(*s);
  open_run_log(*s);
  print_settings(*s);
  return s;
}

Outcome train_loop(Session& s, LoopState& st) {
  SignalGuard signals;
  log::ProgressBar bar(s.cfg.train.steps, s.cfg.logging.progress && s.rank0());
  const auto t0 = Clock::now();
  Outcome o;
  try {
    for (int64_t step = 0; step < s.cfg.train.steps; ++step) {
      if (const int stop = loop_step(s, st, step, bar)) {
        o = stop_outcome(s, st, stop);
        break;
      }
    }
  } catch (const c10::OutOfMemoryError& e) {
    o = oom_outcome(s, st, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    o = oom_outcome(s, st, e.what());
  } catch (const Error& e) {
    o = {e.code, e.what(), nullptr};
    if (e.code != kExitNonFinite && e.code != kExitDistributed)
      s.runlog->event("error", {{"step", st.steps_done + 1}, {"message", o.message}});
  } catch (const c10::Error& e) {
    o = memory::is_allocation_failure(e) ? oom_outcome(s, st, e.what_without_backtrace())
                                 : unexpected_outcome(s, st, e.what_without_backtrace());
  } catch (const std::exception& e) {
    o = unexpected_outcome(s, st, e.what());
  }
  if (o.code == kExitDistributed)
    s.runlog->event("distributed_failure", {{"step", st.steps_done + 1}, {"message", o.message}});
  bar.finish();
  st.wall_s = ms_since(t0) * 1e-3;
  return o;
}

int run(const config::RunConfig& cfg) {
  auto session = setup(cfg);
  LoopState st;
  Outcome outcome = train_loop(*session, st);
  return finish(*session, st, std::move(outcome));
}

}  // namespace sl::train
