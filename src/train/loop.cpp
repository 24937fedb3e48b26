// The step loop (see run.h): optimizer steps from where the run stands, eval, saves, stop flags,
// events; every failure becomes an Outcome.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <new>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "log/clock.h"
#include "memory/timeline.h"
#include "memory/tracking_allocator.h"
#include "model/generate.h"
#include "predict/planner.h"
#include "precision/autocast.h"
#include "train/profile.h"
#include "train/run.h"
#include "train/schedule.h"
#include "train/spike.h"

namespace sl::train {
namespace {

using log::Clock;
using log::ms_since;
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

// ---- the step loop ----

// What the loop reports through: events into the run log (every rank calls it; rank 0 writes), and
// lines on rank 0's console, the progress bar cleared first.
struct Voice {
  log::RunLog& runlog;
  log::ProgressBar& bar;
  bool rank0;
  int64_t steps;  // train.steps, for "step N/steps"
  void event(const std::string& name, const Json& fields) const { runlog.event(name, fields); }
  void warn(const std::string& text) const {
    if (!rank0) return;
    bar.clear();
    spdlog::warn("{}", text);
  }
  void info(const std::string& text) const {
    if (!rank0) return;
    bar.clear();
    spdlog::info("{}", text);
  }
};

// A step that did not update the weights, or should stop the run: fp16 overflow skips (diverged
// after precision.max_skipped_steps in a row), a non-finite loss, non-finite gradients
// (train.on_nonfinite). Throws NonFiniteError after writing the event.
void check_step(const config::TrainConfig& t, int64_t max_skipped_steps, const precision::LossScaler& scaler,
                const Voice& v, LoopState& st, const StepResult& r, int64_t step) {
  const int64_t steps = t.steps;
  if (!r.skipped && !r.nonfinite_grads) {
    st.consecutive_skips = 0;
    if (!std::isfinite(r.loss)) {
      v.event("non_finite_loss", {{"step", step + 1}, {"loss", r.loss}});
      throw NonFiniteError(
          fmt::format("step {}: loss is {}; lower train.lr or raise train.warmup_steps", step + 1, r.loss));
    }
    return;
  }
  if (r.nonfinite_grads && t.on_nonfinite == config::OnNonfinite::kAbort) {
    v.event("non_finite_grad", {{"step", step + 1}, {"loss", r.loss}, {"action", "abort"}});
    throw NonFiniteError(
        fmt::format("step {}: gradients hold NaN/Inf while the loss is finite ({:.4f}); stopped before "
                    "the optimizer step, weights untouched. Lower train.lr, or set "
                    "train.on_nonfinite: skip to skip such steps",
                    step + 1, r.loss));
  }
  ++st.skipped_steps;
  ++st.consecutive_skips;
  if (r.nonfinite_grads) {
    v.event("skip", {{"step", step + 1}, {"reason", "non_finite_grad"}, {"loss", r.loss}});
    v.warn(
        fmt::format("step {:>5}/{} | non-finite gradients: step skipped (train.on_nonfinite: skip)", step + 1, steps));
  } else {
    v.event("skip", {{"step", step + 1}, {"reason", "fp16_overflow"}, {"loss_scale", r.loss_scale},
                             {"new_loss_scale", scaler.scale()}});
    v.warn(fmt::format("step {:>5}/{} | non-finite gradients at loss scale {:g}: step skipped, scale now {:g}",
                             step + 1, steps, r.loss_scale, scaler.scale()));
  }
  const int64_t limit = max_skipped_steps;
  if (r.skipped && limit > 0 && st.consecutive_skips >= limit) {
    v.event("diverged", {{"step", step + 1}, {"consecutive_skips", st.consecutive_skips},
                                 {"loss_scale", scaler.scale()}});
    throw NonFiniteError(
        fmt::format("step {}: {} fp16 steps in a row were skipped (loss scale now {:g}): the run has "
                    "diverged. Lower train.lr, raise train.warmup_steps, or use precision.compute: bf16 "
                    "(precision.max_skipped_steps sets this limit)",
                    step + 1, st.consecutive_skips, scaler.scale()));
  }
}

// The step's hardware FLOP/s per device (the model's and recompute's) against the MFU's peak: a step
// that beats the peak raises it (a `peak_raised` event; a warning at the first raise), so the step's
// mfu and hfu, and every later step's, are at most 1.
void observe_peak(Meter& meter, const Voice& v, double tokens_per_s, int64_t world, int64_t step) {
  const double achieved =
      (meter.flops_per_token + meter.recompute_flops_per_token) * tokens_per_s / static_cast<double>(world);
  const double previous = meter.peak.flops();
  if (!meter.peak.observe(achieved, step + 1)) return;
  v.event("peak_raised", {{"step", step + 1}, {"peak_flops", meter.peak.flops()}, {"previous_peak_flops", previous},
                          {"source", meter.peak.source()}});
  if (meter.peak.raises() == 1) v.warn(peak_raised_message(meter.peak, previous));
}

// mesh: the devices the step ran on (rates per device divide by its world) and the ranks that drew
// their own sequences (tokens and samples count those).
Json step_record(const config::TrainConfig& t, const Meter& meter, const layout::Mesh& mesh, const StepResult& r,
                 int64_t step, double lr, const recompute::Stats& rs) {
  const double world = static_cast<double>(mesh.world());
  const double tps = static_cast<double>(tokens_per_step(t, mesh)) / (r.ms * 1e-3);
  // Examples: the targets the loss counted (the rest is prompt, masked out, or padding); token windows: all.
  const int64_t trained = r.trained_targets > 0 ? r.trained_targets : tokens_per_step(t, mesh);
  return {{"step", step + 1},
          {"loss", r.loss},
          {"lr", lr},
          {"grad_norm", std::isfinite(r.grad_norm) ? Json(r.grad_norm) : Json(nullptr)},
          {"loss_scale", r.loss_scale},
          {"skipped", r.skipped || r.nonfinite_grads || r.held},
          {"step_ms", r.ms},
          {"tokens", tokens_per_step(t, mesh)},
          {"tokens_per_s", tps},
          {"trained_tokens", trained},
          {"trained_tokens_per_s", static_cast<double>(trained) / (r.ms * 1e-3)},
          {"samples_per_s", static_cast<double>(mesh.global_batch(t.micro_batch, t.grad_accum)) / (r.ms * 1e-3)},
          {"mfu", meter.peak.utilisation(meter.flops_per_token * tps / world)},  // per-device peak
          {"hfu", meter.peak.utilisation((meter.flops_per_token + meter.recompute_flops_per_token) * tps / world)},
          {"recompute_ms", rs.recompute_ms},
          {"peak_allocated_bytes", r.mem.peak_allocated_bytes},
          {"activation_peak_bytes", r.activation_peak_bytes()},
          {"allocated_bytes", r.mem.allocated_bytes},
          {"reserved_bytes", r.mem.reserved_bytes},
          // CUDA
          {"peak_reserved_bytes", r.mem.peak_reserved_bytes ? Json(*r.mem.peak_reserved_bytes) : Json(nullptr)},
          {"host_peak_bytes", r.mem.host_peak_bytes},
          {"host_allocated_bytes", r.mem.host_allocated_bytes},
          {"offload_to_host_bytes", r.moved_to_host + rs.offload_to_host},
          {"offload_to_device_bytes", r.moved_to_device + rs.offload_to_device}};
}

void accumulate(const config::LoggingConfig& logging, int64_t steps, parallel::Strategy& strategy, LoopState& st,
                const StepResult& r, const Json& rec, int64_t step) {
  st.transient_peak = std::max(st.transient_peak, strategy.take_transient_peak()), st.gathers = strategy.gathers();
  st.rest_bytes = r.mem.allocated_bytes;
  if (r.mem.peak_allocated_bytes >= st.peak_bytes)
    st.peak_bytes = r.mem.peak_allocated_bytes, st.states_at_peak = r.states;
  st.host_peak_bytes = std::max(st.host_peak_bytes, r.mem.host_peak_bytes);
  st.host_states_bytes = r.host_states;
  st.steps_done = step + 1;
  st.last_loss = r.loss;
  st.trained_tokens += r.trained_targets;
  const int64_t skip_first = logging.skip_first;
  if (step >= skip_first || steps <= skip_first) {
    st.step_ms.push_back(r.ms);
    st.tok_s.push_back(rec["tokens_per_s"].get<double>());
    st.trained_tok_s.push_back(rec["trained_tokens_per_s"].get<double>());
    st.samp_s.push_back(rec["samples_per_s"].get<double>());
    st.recompute_ms.push_back(rec["recompute_ms"].get<double>());
    st.act_peaks.push_back(static_cast<double>(r.activation_peak_bytes()));
  }
}

void maybe_evaluate(const config::TrainConfig& t, const Process& proc, Learner& learn, data::Loader& val,
                    const Voice& v, LoopState& st) {
  if (t.eval_interval <= 0 || (st.steps_done % t.eval_interval != 0 && st.steps_done != t.steps)) return;
  st.last_val =
      evaluate(learn.model, val, t.eval_batches, proc.device, learn.precision.autocast, learn.loss, proc.world());
  if (proc.world() > 1)
    st.last_val = proc.comm->all_reduce_sum(st.last_val, "eval loss average") / static_cast<double>(proc.world());
  v.event("eval", {{"step", st.steps_done}, {"val_loss", st.last_val}});
  v.info(fmt::format("step {:>5}/{} | val loss {:.4f}", st.steps_done, t.steps, st.last_val));
}

// train.sample_interval: a greedy continuation of train.sample_prompt through the run's own forward (no
// KV cache: under ZeRO-3 every rank gathers the units with it, so every rank runs it, for a fixed number
// of tokens), printed and logged as a `sample` event.
void maybe_sample(const config::TrainConfig& t, const Process& proc, Learner& learn, const text::TextCodec& codec,
                  const Voice& v, const LoopState& st) {
  if (t.sample_interval <= 0 || (st.steps_done % t.sample_interval != 0 && st.steps_done != t.steps)) return;
  auto prompt = codec.prompt(t.sample_prompt);
  const auto room = static_cast<size_t>(t.seq_len - t.sample_tokens);  // the context the model was trained on
  if (prompt.size() > room) prompt.erase(prompt.begin(), prompt.end() - static_cast<std::ptrdiff_t>(room));
  model::GenerateOptions o;
  o.max_new_tokens = t.sample_tokens;
  o.temperature = 0.0;
  o.use_cache = false;
  o.forward = [&](const torch::Tensor& ids) {
    precision::AutocastGuard guard(proc.device.type(), learn.precision.autocast);
    return learn.forward(ids);
  };
  const auto g = model::generate(*learn.model, prompt, o);
  const std::string text = codec.decode(g.ids);
  v.event("sample", {{"step", st.steps_done}, {"prompt", t.sample_prompt}, {"ids", g.ids}, {"text", text},
                             {"seconds", g.seconds}});
  std::string line = text;
  for (size_t i = 0; (i = line.find('\n', i)) != std::string::npos; i += 2) line.replace(i, 1, "\\n");
  v.info(fmt::format("step {:>5}/{} | sample: {}{}", st.steps_done, t.steps, t.sample_prompt, line));
}

// train.on_spike after the step's record, given the step's check (made in train_step's hold, before the
// optimizer step; skip and stop kept the weights there): the `spike` event and warning, the skipped step
// counted, and the moving average takes the loss (steps the optimizer skipped for other reasons, where
// the hold was not asked, are left out). Returns kStopSpike under stop.
int handle_spike(const config::TrainConfig& t, const Voice& v, LoopState& st, const StepResult& r, const SpikeCheck& c,
                 int64_t step) {
  if (r.skipped || r.nonfinite_grads) return 0;
  observe_loss(st, r.loss, t.spike_window);
  if (!c.spike) return 0;
  v.event("spike", {{"step", step + 1}, {"loss", r.loss}, {"average", c.average},
                            {"threshold", t.spike_threshold}, {"action", t.on_spike}});
  if (r.held) ++st.skipped_steps;
  const char* what = t.on_spike == config::OnSpike::kWarn   ? "the step is kept"
                     : t.on_spike == config::OnSpike::kSkip ? "weights untouched"
                                                            : "weights untouched; stopping";
  v.warn(fmt::format("step {:>5}/{} | loss spike: {:.4f} is {:.2f}x the moving average {:.4f} "
                           "(train.on_spike: {}): {}", step + 1, t.steps, r.loss, r.loss / c.average, c.average,
                           t.on_spike.name(), what));
  return t.on_spike == config::OnSpike::kStop ? kStopSpike : 0;
}

// This rank's reason to stop after the current step (see StopPoll): a signal (torchrun forwards it
// to every rank, not at the same step) or, on rank 0, a failed log write.
int local_stop(const log::RunLog& runlog) { return runlog.failure().empty() ? g_signal.load() : kStopIo; }

// The stop reason every rank agrees on, so all stop after the same step and the collectives after the
// loop still pair up. At world > 1 a step carries it in its one reduction (train_step's StopPoll), so
// a signal that lands after that read stops the run one step later; this separate all-reduce runs
// once, after the last step, so a late signal or log failure is still reported as at world 1.
int agreed_stop(const Process& proc, const log::RunLog& runlog) {
  int stop = local_stop(runlog);
  if (proc.world() > 1) stop = static_cast<int>(proc.comm->all_reduce_max(static_cast<double>(stop), "stop flag"));
  return stop;
}

Outcome stop_outcome(const Voice& v, const LoopState& st, int stop) {
  if (stop == kStopSpike)
    return {kExitNonFinite,
            fmt::format("step {}: a loss spike (train.on_spike: stop); the weights are those before it, saved in the "
                        "state of step {}. Resume with --resume auto (the next batch follows), lower train.lr, or set "
                        "train.on_spike: skip", st.steps_done, st.steps_done),
            nullptr};
  if (stop == kStopIo) {
    const std::string& mine = v.runlog.failure();
    return {kExitIo, mine.empty() ? fmt::format("rank 0 could not write its logs after step {}", st.steps_done) : mine,
            nullptr};
  }
  v.event("interrupted", {{"step", st.steps_done}, {"signal", stop}});
  return {stop == SIGINT ? kExitSigint : kExitSigterm,
          fmt::format("interrupted by signal {} after step {}", stop, st.steps_done), nullptr};
}

// Writes logging.profile_step's trace to <run dir>/profile.json (rank 0) and records a `profile` event.
void save_profile(const std::string& run_dir, const Voice& v, const LoopState& st, StepProfiler& profiler) {
  const std::string path = (std::filesystem::path(run_dir) / "profile.json").string();
  const int64_t events = profiler.save(path);
  v.event("profile", {{"step", st.steps_done}, {"path", path}, {"events", events}});
  v.bar.clear();
  spdlog::info("step {:>5}/{} | profile of this step ({} events) -> {}", st.steps_done, v.steps, events, path);
}

// The tensors a memory timeline labels by their storage: weights (and an engine's masters), buffers,
// gradients, AdamW's moments, the step's batch. The first label given to a storage stays.
memory::KnownTensors known_tensors(const Learner& learn, const std::vector<data::Batch>& micro) {
  using device::Label;
  memory::KnownTensors known;
  for (const auto& p : learn.model->parameters()) known.add(p, Label::weights);
  for (const auto& g : learn.opt->param_groups())
    for (const auto& p : g.params()) known.add(p, Label::weights), known.add(p.grad(), Label::gradients);
  for (const auto& b : learn.model->buffers()) known.add(b, Label::buffers);
  for (const auto& p : learn.model->parameters()) known.add(p.grad(), Label::gradients);
  for (const auto& g : learn.strategy->grads()) known.add(g, Label::gradients);
  for (const auto& [key, state] : learn.opt->state()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*state);
    for (const auto* t : {&st.exp_avg(), &st.exp_avg_sq(), &st.max_exp_avg_sq()}) known.add(*t, Label::optimizer_state);
  }
  for (const auto& b : micro) known.add(b.x, Label::input), known.add(b.y, Label::input);
  return known;
}

// logging.memory_timeline on rank 0: the step's allocations are recorded from train_step's peak reset
// to its peak reading (memory/timeline.h); dropped on destruction, so a step that fails writes none.
struct TimelineArm {
  bool on;
  TimelineArm(bool want, int64_t step, const Learner& learn, const std::vector<data::Batch>& micro) : on(want) {
    if (!on) return;
    auto known = known_tensors(learn, micro);
    memory::TrackingCPUAllocator::instance().locked([&] { memory::Timeline::instance().arm(step, std::move(known)); });
  }
  ~TimelineArm() {
    if (on) memory::TrackingCPUAllocator::instance().locked([] { memory::Timeline::instance().disarm(); });
  }
  TimelineArm(const TimelineArm&) = delete;
  TimelineArm& operator=(const TimelineArm&) = delete;
};

// Writes the recorded step to <run dir>/memory_timeline.json (docs/logs.md) and records a
// `memory_timeline` event with its path and peak (equal to the step's peak_allocated_bytes).
void save_timeline(const config::ModelConfig& m, const Process& proc, const Learner& learn, const std::string& run_dir,
                   const Voice& v, const LoopState& st, const std::vector<data::Batch>& micro) {
  auto& timeline = memory::Timeline::instance();
  if (!timeline.finished()) return;
  std::vector<std::string> units;
  for (int64_t u = 0; u < model::unit_count(m); ++u) units.push_back(model::unit_name(m, u));
  nlohmann::json j = timeline.to_json(known_tensors(learn, micro), units);
  j["rank"] = proc.launch.rank;
  j["checkpointing"] = learn.runner->plan().describe();
  const std::string path = (std::filesystem::path(run_dir) / "memory_timeline.json").string();
  try {  // rank 0 alone writes it: a failure is a warning, not a stop the other ranks would wait for
    log::write_text_file(path, j.dump());
  } catch (const Error& e) {
    v.bar.clear();
    spdlog::warn("memory timeline of step {} not written: {}", st.steps_done, e.what());
    return;
  }
  const int64_t peak = j["peak"]["device_bytes"].get<int64_t>();
  v.event("memory_timeline", {{"step", st.steps_done}, {"path", path}, {"peak_bytes", peak},
                                      {"events", j["events"].size()}});
  v.bar.clear();
  spdlog::info("step {:>5}/{} | memory timeline of this step ({} events, peak {}) -> {}", st.steps_done, v.steps,
               j["events"].size(), log::format_bytes(peak), path);
}

bool save_writing(const LoopState& st);

// What the loop works with, lent by train_loop for its duration: the recipe, the process, what trains,
// the data, the meter, the run directory, the voice, and the parts a training state is saved from.
struct Loop {
  const config::RunConfig& cfg;
  const Process& proc;
  Learner& learn;
  Inputs& data;
  Meter& meter;
  const std::string& run_dir;
  const Voice& v;
  state::Parts& saves;
};

void poll_pending_save(state::Parts& saves, const Voice& v, LoopState& st, const StepResult& r);

// The step's record: metrics.jsonl's line, the peak FLOP/s it may raise, the loop's sums, the bar and
// (every logging.interval steps) the console line.
void log_step(Loop& l, LoopState& st, const StepResult& r, int64_t step, double lr) {
  RECORD_FUNCTION("sublinear::log_step", std::vector<c10::IValue>{});
  const auto& t = l.cfg.train;
  const auto& mesh = l.proc.mesh();
  observe_peak(l.meter, l.v, static_cast<double>(tokens_per_step(t, mesh)) / (r.ms * 1e-3), mesh.world(), step);
  const Json rec = step_record(t, l.meter, mesh, r, step, lr, l.learn.runner->take_stats());
  l.v.runlog.step(rec);
  accumulate(l.cfg.logging, t.steps, *l.learn.strategy, st, r, rec, step);
  l.v.bar.update(st.steps_done, r.loss);
  if (st.steps_done % l.cfg.logging.interval == 0 || st.steps_done == 1 || st.steps_done == t.steps)
    l.v.info(log::format_step_line(rec, t.steps));
}

// One optimizer step: learning rate, micro-batches, the step, checks, record, console, the publication
// of an asynchronous save its writers have finished (poll_pending_save), eval; with
// logging.profile_step, the step up to that publication recorded by the profiler; with
// logging.memory_timeline, its allocations from train_step's start to its peak reading.
// Returns why the run stops after it (0: it goes on; agreed over ranks, see agreed_stop).
int loop_step(Loop& l, LoopState& st, int64_t step) {
  const auto& t = l.cfg.train;
  auto& learn = l.learn;
  StepProfiler profiler(l.proc.rank0() && l.cfg.logging.profile_step == step + 1, l.proc.device);
  const double lr = lr_at(t, step);
  for (auto& g : learn.opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  std::vector<data::Batch> micro;
  for (int64_t m = 0; m < t.grad_accum; ++m) micro.push_back(l.data.train_loader->next());
  const StopPoll poll =
      l.proc.world() > 1 ? StopPoll([&] { return LocalPoll(local_stop(l.v.runlog), save_writing(st)); }) : StopPoll();
  SpikeCheck spike;  // the loss against the moving average, made once, where the weights can still be kept
  const HoldFn hold = [&](double loss) {
    spike = check_spike(st, loss, t);
    return spike.spike && t.on_spike.holds();  // every rank sees the same (mean) loss
  };
  TimelineArm timeline(l.proc.rank0() && l.cfg.logging.memory_timeline == step + 1, step + 1, learn, micro);
  const StepResult r = train_step({.loss = learn.loss, .strategy = *learn.strategy, .opt = *learn.opt,
                                   .tracker = *l.meter.tracker, .device = l.proc.device, .precision = learn.precision,
                                   .grad_clip = t.grad_clip, .graph = learn.graph.get()},
                                  micro, poll, hold);
  check_step(t, l.cfg.precision.max_skipped_steps, *learn.scaler, l.v, st, r, step);
  log_step(l, st, r, step, lr);
  poll_pending_save(l.saves, l.v, st, r);
  if (profiler.on()) save_profile(l.run_dir, l.v, st, profiler);
  if (timeline.on) save_timeline(l.cfg.model, l.proc, learn, l.run_dir, l.v, st, micro);
  if (const int stop = handle_spike(t, l.v, st, r, spike, step)) return stop;
  maybe_evaluate(t, l.proc, learn, *l.data.val_loader, l.v, st);
  if (l.data.codec) maybe_sample(t, l.proc, learn, *l.data.codec, l.v, st);
  return l.proc.world() > 1 ? r.stop : local_stop(l.v.runlog);
}

// The `oom` record (event and summary.json) of a refusal in host memory (memory.host_limit, offloaded
// state and snapshots) or device memory: that pool's peak and limit, and the bytes this rank's tracking
// allocator refused there (null when another rank refused, or off the tracking allocator).
Json oom_record(const memory::Tracker& tracker, int64_t limit, const Voice& v, int64_t step, const char* phase,
                bool host, const std::string& message) {
  const memory::Snapshot snap = tracker.read();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const bool refused_here = memory::TrackingCPUAllocator::installed() && alloc.last_refused_bytes() > 0 &&
                            alloc.last_refused_host() == host;
  Json rec = {{"step", step},
              {"phase", phase},
              {"requested_bytes", refused_here ? Json(alloc.last_refused_bytes()) : Json(nullptr)},
              {"peak_bytes", host ? snap.host_peak_bytes : snap.peak_allocated_bytes},
              {"limit_bytes", limit > 0 ? Json(limit) : Json(nullptr)},
              {"memory", host ? "host" : "device"},
              {"message", message}};
  v.event("oom", rec);
  return rec;
}

Outcome oom_outcome(const Loop& l, const LoopState& st, const std::string& what) {
  Outcome o;
  o.code = kExitOom;
  const char* phase = current_phase();
  // The tracking allocator records whether its last refusal was in the host pool (offloaded state).
  const bool host =
      memory::TrackingCPUAllocator::installed() && memory::TrackingCPUAllocator::instance().last_refused_host();
  const auto predicted = [&] { return memory::predict_peak(l.meter.scenario, l.learn.runner->plan()); };
  o.message = host ? fmt::format(
                         "out of host memory in {} at step {} ({}). To fit, raise memory.host_limit (the planner "
                         "predicts {} of host memory for this recipe: trainer plan) or offload less (offload.*)",
                         phase, st.steps_done + 1, what.substr(0, 300),
                         log::format_bytes(predicted().host_peak_bytes()))
                   : fmt::format("out of memory in {} at step {} ({}). To fit, {}", phase, st.steps_done + 1,
                                 what.substr(0, 300), planner::oom_advice(l.meter.scenario, l.meter.limit));
  o.oom = oom_record(*l.meter.tracker, host ? l.cfg.memory.host_limit.bytes : l.meter.limit, l.v, st.steps_done + 1,
                     phase, host, o.message);
  return o;
}

// An OomError inside the loop: state.async's host snapshot of the state after step st.steps_done, refused
// on this rank or another (agreed over ranks; the message names the rank), the only code there that
// throws one. Recorded as an out-of-memory in host memory, phase state_snapshot.
Outcome snapshot_oom_outcome(const Loop& l, const LoopState& st, const std::string& message) {
  return {kExitOom, message,
          oom_record(*l.meter.tracker, l.cfg.memory.host_limit.bytes, l.v, st.steps_done, "state_snapshot",
                     /*host=*/true, message)};
}

// Anything else thrown inside the loop: a collective that failed inside a gradient hook (autograd
// wraps it) is a distributed failure; the rest is an internal error, reported with an event.
Outcome unexpected_outcome(const parallel::Comm& comm, const Voice& v, const LoopState& st, const std::string& what) {
  if (!comm.failure().empty()) return {kExitDistributed, comm.failure(), nullptr};
  Outcome o{kExitInternal, fmt::format("unexpected error at step {}: {}", st.steps_done + 1, what.substr(0, 1000)),
            nullptr};
  v.event("error", {{"step", st.steps_done + 1}, {"phase", current_phase()}, {"message", o.message}});
  return o;
}

// What a failed save of `step` leaves to resume from, for its message: said only after looking at the disk.
std::string earlier_state_note(state::Parts& saves, const LoopState& st, int64_t step) {
  if (st.last_saved_step < 0) return "No earlier state exists";
  if (st.last_saved_step == step) return "";  // the same step: the error says where its earlier save is
  const auto dir = state::step_dir(state::state_root(saves.cfg.state, saves.run_dir), st.last_saved_step);
  std::error_code ec;
  if (!std::filesystem::exists(dir / "meta.json", ec))
    return fmt::format("The state of step {} is no longer at {}; check the state directory", st.last_saved_step,
                       dir.string());
  return fmt::format("The state of step {} is intact at {}; resume from it with --resume auto once there is space",
                     st.last_saved_step, dir.string());
}

// Runs a save (or its last part) of the state after `step`; a failed one is an IoError (exit 7) naming
// the state that stays.
template <class F>
state::Saved saving(state::Parts& saves, const LoopState& st, int64_t step, F&& fn) {
  try {
    return fn();
  } catch (const IoError& e) {
    throw IoError(fmt::format("saving the training state after step {} failed: {}. {}", step, e.what(),
                              earlier_state_note(saves, st, step)));
  }
}

// A published state: the newest on disk, its `state_saved` event and console line.
void record_saved(const Voice& v, LoopState& st, const state::Saved& saved, int64_t step, const char* why,
                  double blocking_ms, bool async) {
  st.last_saved_step = step;
  st.state_bytes = saved.bytes;
  st.save_ms.push_back(saved.ms);
  st.save_blocking_ms.push_back(blocking_ms);
  v.event("state_saved", {{"step", step}, {"reason", why}, {"dir", saved.dir.string()}, {"bytes", saved.bytes},
                          {"save_ms", saved.ms}, {"blocking_ms", blocking_ms}, {"async", async}});
  v.info(fmt::format(
      "step {:>5}/{} | state saved ({}): {} in {:.0f} ms{} -> {}", step, v.steps, why, log::format_bytes(saved.bytes),
      saved.ms, async ? fmt::format(" (the steps waited {:.0f} ms)", blocking_ms) : std::string(), saved.dir.string()));
}

// state.async: publishes the save in flight (a collective: every rank calls it at the same point) after
// waiting for its writer. The loop waits for the agreement and rank 0's meta.json and renames, plus
// whatever of the write is left. `last`: no save follows, so state.keep is applied now (else by the next
// save's writer).
void finish_pending_save(state::Parts& saves, const Voice& v, LoopState& st, bool last) {
  if (!st.pending_save) {
    // published by a poll, its state.keep left to a save that will not come
    if (last && st.finished_save) st.finished_save->apply_keep(saves);
    return;
  }
  auto pending = std::move(st.pending_save);
  const auto t0 = Clock::now();
  const state::Saved saved = saving(saves, st, pending->step(), [&] { return pending->finish(saves, last); });
  record_saved(v, st, saved, pending->step(), "every", pending->snapshot_ms() + ms_since(t0), true);
  st.finished_save = std::move(pending);
}

// Whether this rank's save in flight is still being written (a flag its writer thread sets: no device
// or collective call).
bool save_writing(const LoopState& st) { return st.pending_save && !st.pending_save->done(); }

// After step `r`'s record: publishes the save in flight once every rank's writer is done. At world 1
// that is this rank's own flag; at world > 1 it is r.save_writing, every rank's flag summed in the
// step's own reduction and read with its one host read (loop_step's StopPoll), so a step during a save
// costs no collective and no host read of its own. A writer that finishes after a step's poll is seen
// at the next step's: the save is published after the first step whose read begins once every rank's
// writer has finished, at most one step after the last of them (or earlier, at the next save or the
// end of the run, which wait for it).
void poll_pending_save(state::Parts& saves, const Voice& v, LoopState& st, const StepResult& r) {
  if (!st.pending_save) return;
  const bool writing = saves.world() > 1 ? r.save_writing : save_writing(st);
  if (!writing) finish_pending_save(saves, v, st, /*last=*/false);
}

// state.async: the host snapshot of the state after this step and its writer started; published by a
// later poll_pending_save or finish_pending_save. Logs a `state_snapshot` event.
void begin_async_save(state::Parts& saves, const Voice& v, LoopState& st) {
  st.pending_save = state::begin_save(saves, st, std::move(st.finished_save));
  const int64_t bytes = st.pending_save->snapshot_bytes();
  v.event("state_snapshot",
          {{"step", st.steps_done}, {"snapshot_bytes", bytes}, {"snapshot_ms", st.pending_save->snapshot_ms()}});
  v.info(fmt::format("step {:>5}/{} | state snapshot: {} in host memory in {:.0f} ms, written in the background",
                     st.steps_done, v.steps, log::format_bytes(bytes), st.pending_save->snapshot_ms()));
}

// Saves the training state after this step (state/state.h) and records it; a failed save is an
// IoError (exit 7) naming the state that stays. A save in flight is published first. With state.async
// a save that need not complete before the run goes on (`every`) is written in the background;
// the others (end, signal, spike) are written before this returns.
void save_state(state::Parts& saves, const Voice& v, LoopState& st, const char* why) {
  const bool background = saves.cfg.state.async && std::string(why) == "every";
  finish_pending_save(saves, v, st, /*last=*/!background);
  if (background) return begin_async_save(saves, v, st);
  const state::Saved saved = saving(saves, st, st.steps_done, [&] { return state::save(saves, st); });
  record_saved(v, st, saved, st.steps_done, why, saved.ms, false);
}

// After a failure in the loop, the save in flight: at world 1 published (its snapshot predates the
// failure), at world > 1 given up (the other ranks may not reach the agreement), leaving the previous
// state newest. Either way its writer is joined before the run exits, and state.keep is applied to what
// is published (rank 0's own files: no collective).
void settle_pending_save(state::Parts& saves, const Voice& v, LoopState& st) {
  if (st.pending_save && saves.world() == 1) {
    try {
      return finish_pending_save(saves, v, st, /*last=*/true);
    } catch (const std::exception& e) {
      spdlog::warn("{}", e.what());
      return;
    }
  }
  if (st.pending_save) {
    const int64_t step = st.pending_save->step();
    st.pending_save.reset();
    if (saves.rank0())
      spdlog::warn("the run failed while the state of step {} was being written: not published; {}", step,
                   st.last_saved_step >= 0 ? fmt::format("the state of step {} stays the newest", st.last_saved_step)
                                           : std::string("no state was saved"));
  }
  if (st.finished_save) st.finished_save->apply_keep(saves);
}

// Stops the run after this step for `stop` (agreed): saves the state on a signal (state.on_signal).
Outcome stop_run(const Loop& l, LoopState& st, int stop) {
  finish_pending_save(l.saves, l.v, st, /*last=*/true);
  // At world > 1 a stop can be agreed after the last step's `every` save (run_steps): not saved twice.
  const bool save = stop == kStopSpike || (stop != kStopIo && l.cfg.state.on_signal);
  if (save && st.last_saved_step != st.steps_done)
    save_state(l.saves, l.v, st, stop == kStopSpike ? "spike" : "signal");
  return stop_outcome(l.v, st, stop);
}

// The steps from where the run stands (0, or the resumed step) to train.steps, with the saves that
// state.every, state.on_signal and state.at_end ask for. Returns how the steps ended.
Outcome run_steps(Loop& l, LoopState& st) {
  const auto& c = l.cfg;
  for (int64_t step = st.steps_done; step < c.train.steps; ++step) {
    if (const int stop = loop_step(l, st, step)) return stop_run(l, st, stop);
    if (c.state.every > 0 && st.steps_done % c.state.every == 0) save_state(l.saves, l.v, st, "every");
  }
  if (l.proc.world() > 1 && st.steps_done > 0) {  // what landed after the last step's read (see agreed_stop)
    if (const int stop = agreed_stop(l.proc, l.v.runlog)) return stop_run(l, st, stop);
  }
  finish_pending_save(l.saves, l.v, st, /*last=*/true);
  if (c.state.at_end && st.last_saved_step != st.steps_done) save_state(l.saves, l.v, st, "end");
  return {};
}

// run_steps with every failure mapped to an Outcome (the exit code, its message, the oom record).
Outcome guarded_steps(Loop& l, LoopState& st) {
  try {
    return run_steps(l, st);
  } catch (const c10::OutOfMemoryError& e) {
    return oom_outcome(l, st, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    return oom_outcome(l, st, e.what());
  } catch (const OomError& e) {
    return snapshot_oom_outcome(l, st, e.what());
  } catch (const Error& e) {
    if (e.code != kExitNonFinite && e.code != kExitDistributed)
      l.v.event("error", {{"step", st.steps_done + 1}, {"message", e.what()}});
    return {e.code, e.what(), nullptr};
  } catch (const c10::Error& e) {
    return memory::is_allocation_failure(e) ? oom_outcome(l, st, e.what_without_backtrace())
                                            : unexpected_outcome(*l.proc.comm, l.v, st, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return unexpected_outcome(*l.proc.comm, l.v, st, e.what());
  }
}

}  // namespace

Outcome train_loop(const config::RunConfig& cfg, const Process& proc, Learner& learn, Inputs& data, Meter& meter,
                   Outputs& out, LoopState& st) {
  SignalGuard signals;
  log::ProgressBar bar(cfg.train.steps, cfg.logging.progress && proc.rank0());
  const Voice v{*out.runlog, bar, proc.rank0(), cfg.train.steps};
  state::Parts saves = state_parts(cfg, proc, learn, data, out.run_dir);
  Loop l{cfg, proc, learn, data, meter, out.run_dir, v, saves};
  const auto t0 = Clock::now();
  Outcome o = guarded_steps(l, st);
  settle_pending_save(saves, v, st);
  // The host pool's peak where no step record saw it: a step that failed, a snapshot after the last step.
  st.host_peak_bytes = std::max(st.host_peak_bytes, meter.tracker->read().host_peak_bytes);
  if (o.code == kExitDistributed) v.event("distributed_failure", {{"step", st.steps_done + 1}, {"message", o.message}});
  bar.finish();
  st.wall_s = ms_since(t0) * 1e-3;
  return o;
}

int run(const config::RunConfig& cfg) {
  auto s = setup(cfg);
  LoopState st;
  state::Parts saves = state_parts(s->cfg, s->proc, s->learn, s->data, s->out.run_dir);
  restore(saves, s->start, s->meter, *s->out.runlog, st);
  Outcome outcome = train_loop(s->cfg, s->proc, s->learn, s->data, s->meter, s->out, st);
  return s->finish(st, std::move(outcome));
}

}  // namespace sl::train
