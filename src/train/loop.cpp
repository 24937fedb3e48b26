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
#include "planner/planner.h"
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
  if (r.nonfinite_grads && cfg.train.on_nonfinite == config::OnNonfinite::kAbort) {
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

// The step's hardware FLOP/s per device (the model's and recompute's) against the MFU's peak: a step
// that beats the peak raises it (a `peak_raised` event; a warning at the first raise), so the step's
// mfu and hfu, and every later step's, are at most 1.
void observe_peak(Session& s, const StepResult& r, int64_t step, log::ProgressBar& bar) {
  const double tps = static_cast<double>(s.tokens_per_step()) / (r.ms * 1e-3);
  const double achieved = (s.flops_per_token + s.recompute_flops_per_token) * tps / static_cast<double>(s.world());
  const double previous = s.peak.flops();
  if (!s.peak.observe(achieved, step + 1)) return;
  s.runlog->event("peak_raised", {{"step", step + 1}, {"peak_flops", s.peak.flops()}, {"previous_peak_flops", previous},
                                  {"source", s.peak.source()}});
  if (s.peak.raises() == 1) warn(s, bar, peak_raised_message(s.peak, previous));
}

Json step_record(const Session& s, const StepResult& r, int64_t step, double lr, const checkpointing::Stats& rs) {
  const double world = static_cast<double>(s.world());
  const double tps = static_cast<double>(s.tokens_per_step()) / (r.ms * 1e-3);
  const auto& t = s.cfg.train;
  return {{"step", step + 1},
          {"loss", r.loss},
          {"lr", lr},
          {"grad_norm", std::isfinite(r.grad_norm) ? Json(r.grad_norm) : Json(nullptr)},
          {"loss_scale", r.loss_scale},
          {"skipped", r.skipped || r.nonfinite_grads || r.held},
          {"step_ms", r.ms},
          {"tokens", s.tokens_per_step()},
          {"tokens_per_s", tps},
          {"samples_per_s", static_cast<double>(t.micro_batch * t.grad_accum) * world / (r.ms * 1e-3)},
          {"mfu", s.peak.utilisation(s.flops_per_token * tps / world)},  // per-device peak
          {"hfu", s.peak.utilisation((s.flops_per_token + s.recompute_flops_per_token) * tps / world)},
          {"recompute_ms", rs.recompute_ms},
          {"peak_allocated_bytes", r.mem.peak_allocated_bytes},
          {"activation_peak_bytes", r.activation_peak_bytes()},
          {"allocated_bytes", r.mem.allocated_bytes},
          {"reserved_bytes", r.mem.reserved_bytes},
          {"peak_reserved_bytes", r.mem.peak_reserved_bytes ? Json(*r.mem.peak_reserved_bytes) : Json(nullptr)},  // CUDA
          {"host_peak_bytes", r.mem.host_peak_bytes},
          {"host_allocated_bytes", r.mem.host_allocated_bytes},
          {"offload_to_host_bytes", r.moved_to_host + rs.offload_to_host},
          {"offload_to_device_bytes", r.moved_to_device + rs.offload_to_device}};
}

void accumulate(Session& s, LoopState& st, const StepResult& r, const Json& rec, int64_t step) {
  if (s.engine) st.transient_peak = std::max(st.transient_peak, s.engine->take_transient_peak()), st.gathers = s.engine->gathers();
  st.rest_bytes = r.mem.allocated_bytes;
  if (r.mem.peak_allocated_bytes >= st.peak_bytes) st.peak_bytes = r.mem.peak_allocated_bytes, st.states_at_peak = r.states;
  st.host_peak_bytes = std::max(st.host_peak_bytes, r.mem.host_peak_bytes);
  st.host_states_bytes = r.host_states;
  st.steps_done = step + 1;
  st.last_loss = r.loss;
  const int64_t skip_first = s.cfg.logging.skip_first;
  if (step >= skip_first || s.cfg.train.steps <= skip_first) {
    st.step_ms.push_back(r.ms);
    st.tok_s.push_back(rec["tokens_per_s"].get<double>());
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

// train.sample_interval: a greedy continuation of train.sample_prompt through the run's own forward (no
// KV cache: under ZeRO-3 every rank gathers the units with it, so every rank runs it, for a fixed number
// of tokens), printed and logged as a `sample` event.
void maybe_sample(Session& s, const LoopState& st, log::ProgressBar& bar) {
  const auto& t = s.cfg.train;
  if (t.sample_interval <= 0 || (st.steps_done % t.sample_interval != 0 && st.steps_done != t.steps)) return;
  auto prompt = s.codec->prompt(t.sample_prompt);
  const auto room = static_cast<size_t>(t.seq_len - t.sample_tokens);  // the context the model was trained on
  if (prompt.size() > room) prompt.erase(prompt.begin(), prompt.end() - static_cast<std::ptrdiff_t>(room));
  model::GenerateOptions o;
  o.max_new_tokens = t.sample_tokens;
  o.temperature = 0.0;
  o.use_cache = false;
  o.forward = [&s](const torch::Tensor& ids) {
    precision::AutocastGuard guard(s.device.type(), s.precision.autocast);
    return s.forward(ids);
  };
  const auto g = model::generate(*s.model, prompt, o);
  const std::string text = s.codec->decode(g.ids);
  s.runlog->event("sample", {{"step", st.steps_done}, {"prompt", t.sample_prompt}, {"ids", g.ids}, {"text", text},
                             {"seconds", g.seconds}});
  if (s.rank0()) {
    bar.clear();
    std::string line = text;
    for (size_t i = 0; (i = line.find('\n', i)) != std::string::npos; i += 2) line.replace(i, 1, "\\n");
    spdlog::info("step {:>5}/{} | sample: {}{}", st.steps_done, t.steps, t.sample_prompt, line);
  }
}

// train.on_spike after the step's record, given the step's check (made in train_step's hold, before the
// optimizer step; skip and stop kept the weights there): the `spike` event and warning, the skipped step
// counted, and the moving average takes the loss (steps the optimizer skipped for other reasons, where
// the hold was not asked, are left out). Returns kStopSpike under stop.
int handle_spike(Session& s, LoopState& st, const StepResult& r, const SpikeCheck& c, int64_t step, log::ProgressBar& bar) {
  const auto& t = s.cfg.train;
  if (r.skipped || r.nonfinite_grads) return 0;
  observe_loss(st, r.loss, t.spike_window);
  if (!c.spike) return 0;
  s.runlog->event("spike", {{"step", step + 1}, {"loss", r.loss}, {"average", c.average},
                            {"threshold", t.spike_threshold}, {"action", t.on_spike}});
  if (r.held) ++st.skipped_steps;
  const char* what = t.on_spike == config::OnSpike::kWarn   ? "the step is kept"
                     : t.on_spike == config::OnSpike::kSkip ? "weights untouched"
                                                            : "weights untouched; stopping";
  warn(s, bar, fmt::format("step {:>5}/{} | loss spike: {:.4f} is {:.2f}x the moving average {:.4f} "
                           "(train.on_spike: {}): {}", step + 1, t.steps, r.loss, r.loss / c.average, c.average,
                           t.on_spike.name(), what));
  return t.on_spike == config::OnSpike::kStop ? kStopSpike : 0;
}

// This rank's reason to stop after the current step (see StopPoll): a signal (torchrun forwards it
// to every rank, not at the same step) or, on rank 0, a failed log write.
int local_stop(Session& s) { return s.runlog->failure().empty() ? g_signal.load() : kStopIo; }

// The stop reason every rank agrees on, so all stop after the same step and the collectives after the
// loop still pair up. At world > 1 a step carries it in its one reduction (train_step's StopPoll), so
// a signal that lands after that read stops the run one step later; this separate all-reduce runs
// once, after the last step, so a late signal or log failure is still reported as at world 1.
int agreed_stop(Session& s) {
  int stop = local_stop(s);
  if (s.world() > 1) stop = static_cast<int>(s.comm->all_reduce_max(static_cast<double>(stop), "stop flag"));
  return stop;
}

Outcome stop_outcome(Session& s, const LoopState& st, int stop) {
  if (stop == kStopSpike)
    return {kExitNonFinite,
            fmt::format("step {}: a loss spike (train.on_spike: stop); the weights are those before it, saved in the "
                        "state of step {}. Resume with --resume auto (the next batch follows), lower train.lr, or set "
                        "train.on_spike: skip", st.steps_done, st.steps_done),
            nullptr};
  if (stop == kStopIo) {
    const std::string& mine = s.runlog->failure();
    return {kExitIo, mine.empty() ? fmt::format("rank 0 could not write its logs after step {}", st.steps_done) : mine,
            nullptr};
  }
  s.runlog->event("interrupted", {{"step", st.steps_done}, {"signal", stop}});
  return {stop == SIGINT ? kExitSigint : kExitSigterm,
          fmt::format("interrupted by signal {} after step {}", stop, st.steps_done), nullptr};
}

// Writes logging.profile_step's trace to <run dir>/profile.json (rank 0) and records a `profile` event.
void save_profile(Session& s, const LoopState& st, StepProfiler& profiler, log::ProgressBar& bar) {
  const std::string path = (std::filesystem::path(s.run_dir) / "profile.json").string();
  const int64_t events = profiler.save(path);
  s.runlog->event("profile", {{"step", st.steps_done}, {"path", path}, {"events", events}});
  bar.clear();
  spdlog::info("step {:>5}/{} | profile of this step ({} events) -> {}", st.steps_done, s.cfg.train.steps, events, path);
}

// The tensors a memory timeline labels by their storage: weights (and an engine's masters), buffers,
// gradients, AdamW's moments, the step's batch. The first label given to a storage stays.
memory::KnownTensors known_tensors(const Session& s, const std::vector<data::Batch>& micro) {
  using device::Label;
  memory::KnownTensors known;
  for (const auto& p : s.model->parameters()) known.add(p, Label::weights);
  for (const auto& g : s.opt->param_groups())
    for (const auto& p : g.params()) known.add(p, Label::weights), known.add(p.grad(), Label::gradients);
  for (const auto& b : s.model->buffers()) known.add(b, Label::buffers);
  for (const auto& p : s.model->parameters()) known.add(p.grad(), Label::gradients);
  if (s.engine)
    for (const auto& g : s.engine->grads()) known.add(g, Label::gradients);
  for (const auto& [key, state] : s.opt->state()) {
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
  TimelineArm(bool want, int64_t step, const Session& s, const std::vector<data::Batch>& micro) : on(want) {
    if (!on) return;
    auto known = known_tensors(s, micro);
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
void save_timeline(Session& s, const LoopState& st, const std::vector<data::Batch>& micro, log::ProgressBar& bar) {
  auto& timeline = memory::Timeline::instance();
  if (!timeline.finished()) return;
  std::vector<std::string> units;
  for (int64_t u = 0; u < model::unit_count(s.cfg.model); ++u) units.push_back(model::unit_name(s.cfg.model, u));
  nlohmann::json j = timeline.to_json(known_tensors(s, micro), units);
  j["rank"] = s.launch.rank;
  j["checkpointing"] = s.runner->plan().describe();
  const std::string path = (std::filesystem::path(s.run_dir) / "memory_timeline.json").string();
  try {  // rank 0 alone writes it: a failure is a warning, not a stop the other ranks would wait for
    log::write_text_file(path, j.dump());
  } catch (const Error& e) {
    bar.clear();
    spdlog::warn("memory timeline of step {} not written: {}", st.steps_done, e.what());
    return;
  }
  const int64_t peak = j["peak"]["device_bytes"].get<int64_t>();
  s.runlog->event("memory_timeline", {{"step", st.steps_done}, {"path", path}, {"peak_bytes", peak},
                                      {"events", j["events"].size()}});
  bar.clear();
  spdlog::info("step {:>5}/{} | memory timeline of this step ({} events, peak {}) -> {}", st.steps_done,
               s.cfg.train.steps, j["events"].size(), log::format_bytes(peak), path);
}

bool save_writing(const LoopState& st);
void poll_pending_save(Session& s, LoopState& st, log::ProgressBar& bar, const StepResult& r);

// One optimizer step: learning rate, micro-batches, the step, checks, record, console, the publication
// of an asynchronous save its writers have finished (poll_pending_save), eval; with
// logging.profile_step, the step up to that publication recorded by the profiler; with
// logging.memory_timeline, its allocations from train_step's start to its peak reading.
// Returns why the run stops after it (0: it goes on; agreed over ranks, see agreed_stop).
int loop_step(Session& s, LoopState& st, int64_t step, log::ProgressBar& bar) {
  const auto& t = s.cfg.train;
  StepProfiler profiler(s.rank0() && s.cfg.logging.profile_step == step + 1, s.device);
  const double lr = lr_at(t, step);
  for (auto& g : s.opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  std::vector<data::Batch> micro;
  for (int64_t m = 0; m < t.grad_accum; ++m) micro.push_back(s.train_loader->next());
  const StopPoll poll = s.world() > 1 ? StopPoll([&] { return LocalPoll(local_stop(s), save_writing(st)); }) : StopPoll();
  SpikeCheck spike;  // the loss against the moving average, made once, where the weights can still be kept
  const HoldFn hold = [&](double loss) {
    spike = check_spike(st, loss, t);
    return spike.spike && t.on_spike.holds();  // every rank sees the same (mean) loss
  };
  TimelineArm timeline(s.rank0() && s.cfg.logging.memory_timeline == step + 1, step + 1, s, micro);
  const StepResult r = train_step(s.forward, s.model, *s.opt, micro, t.grad_clip, s.device, *s.tracker, s.precision,
                                  s.engine.get(), poll, hold);
  check_step(s, st, r, step, bar);
  {
    RECORD_FUNCTION("sublinear::log_step", std::vector<c10::IValue>{});
    observe_peak(s, r, step, bar);
    const Json rec = step_record(s, r, step, lr, s.runner->take_stats());
    s.runlog->step(rec);
    accumulate(s, st, r, rec, step);
    bar.update(st.steps_done, r.loss);
    if (s.rank0() && (st.steps_done % s.cfg.logging.interval == 0 || st.steps_done == 1 || st.steps_done == t.steps)) {
      bar.clear();
      spdlog::info("{}", log::format_step_line(rec, t.steps));
    }
  }
  poll_pending_save(s, st, bar, r);
  if (profiler.on()) save_profile(s, st, profiler, bar);
  if (timeline.on) save_timeline(s, st, micro, bar);
  if (const int stop = handle_spike(s, st, r, spike, step, bar)) return stop;
  maybe_evaluate(s, st, bar);
  maybe_sample(s, st, bar);
  return s.world() > 1 ? r.stop : local_stop(s);
}

// The `oom` record (event and summary.json) of a refusal in host memory (memory.host_limit, offloaded
// state and snapshots) or device memory: that pool's peak and limit, and the bytes this rank's tracking
// allocator refused there (null when another rank refused, or off the tracking allocator).
Json oom_record(Session& s, int64_t step, const char* phase, bool host, const std::string& message) {
  const memory::Snapshot snap = s.tracker->read();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const bool refused_here = memory::TrackingCPUAllocator::installed() && alloc.last_refused_bytes() > 0 &&
                            alloc.last_refused_host() == host;
  const int64_t limit = host ? s.cfg.memory.host_limit.bytes : s.limit;
  Json rec = {{"step", step},
              {"phase", phase},
              {"requested_bytes", refused_here ? Json(alloc.last_refused_bytes()) : Json(nullptr)},
              {"peak_bytes", host ? snap.host_peak_bytes : snap.peak_allocated_bytes},
              {"limit_bytes", limit > 0 ? Json(limit) : Json(nullptr)},
              {"memory", host ? "host" : "device"},
              {"message", message}};
  s.runlog->event("oom", rec);
  return rec;
}

Outcome oom_outcome(Session& s, const LoopState& st, const std::string& what) {
  Outcome o;
  o.code = kExitOom;
  const char* phase = current_phase();
  // The tracking allocator records whether its last refusal was in the host pool (offloaded state).
  const bool host = memory::TrackingCPUAllocator::installed() && memory::TrackingCPUAllocator::instance().last_refused_host();
  o.message = host ? fmt::format("out of host memory in {} at step {} ({}). To fit, raise memory.host_limit (the planner "
                                 "predicts {} of host memory for this recipe: trainer plan) or offload less (offload.*)",
                                 phase, st.steps_done + 1, what.substr(0, 300),
                                 log::format_bytes(memory::predict_peak(s.cfg, s.runner->plan()).host_peak_bytes()))
                   : fmt::format("out of memory in {} at step {} ({}). To fit, {}", phase, st.steps_done + 1,
                                 what.substr(0, 300), planner::oom_advice(s.cfg, s.limit));
  o.oom = oom_record(s, st.steps_done + 1, phase, host, o.message);
  return o;
}

// An OomError inside the loop: state.async's host snapshot of the state after step st.steps_done, refused
// on this rank or another (agreed over ranks; the message names the rank), the only code there that
// throws one. Recorded as an out-of-memory in host memory, phase state_snapshot.
Outcome snapshot_oom_outcome(Session& s, const LoopState& st, const std::string& message) {
  return {kExitOom, message, oom_record(s, st.steps_done, "state_snapshot", /*host=*/true, message)};
}

// Anything else thrown inside the loop: a collective that failed inside a gradient hook (autograd
// wraps it) is a distributed failure; the rest is an internal error, reported with an event.
Outcome unexpected_outcome(Session& s, const LoopState& st, const std::string& what) {
  if (!s.comm->failure().empty()) return {kExitDistributed, s.comm->failure(), nullptr};
  Outcome o{kExitInternal, fmt::format("unexpected error at step {}: {}", st.steps_done + 1, what.substr(0, 1000)), nullptr};
  s.runlog->event("error", {{"step", st.steps_done + 1}, {"phase", current_phase()}, {"message", o.message}});
  return o;
}

// What a failed save of `step` leaves to resume from, for its message: said only after looking at the disk.
std::string earlier_state_note(const Session& s, const LoopState& st, int64_t step) {
  if (st.last_saved_step < 0) return "No earlier state exists";
  if (st.last_saved_step == step) return "";  // the same step: the error says where its earlier save is
  const auto dir = state::step_dir(state::state_root(s.cfg, s.run_dir), st.last_saved_step);
  std::error_code ec;
  if (!std::filesystem::exists(dir / "meta.json", ec))
    return fmt::format("The state of step {} is no longer at {}; check the state directory", st.last_saved_step, dir.string());
  return fmt::format("The state of step {} is intact at {}; resume from it with --resume auto once there is space",
                     st.last_saved_step, dir.string());
}

// Runs a save (or its last part) of the state after `step`; a failed one is an IoError (exit 7) naming
// the state that stays.
template <class F>
state::Saved saving(const Session& s, const LoopState& st, int64_t step, F&& fn) {
  try {
    return fn();
  } catch (const IoError& e) {
    throw IoError(fmt::format("saving the training state after step {} failed: {}. {}", step, e.what(),
                              earlier_state_note(s, st, step)));
  }
}

// A published state: the newest on disk, its `state_saved` event and console line.
void record_saved(Session& s, LoopState& st, log::ProgressBar& bar, const state::Saved& saved, int64_t step,
                  const char* why, double blocking_ms, bool async) {
  st.last_saved_step = step;
  st.state_bytes = saved.bytes;
  st.save_ms.push_back(saved.ms);
  st.save_blocking_ms.push_back(blocking_ms);
  s.runlog->event("state_saved", {{"step", step}, {"reason", why}, {"dir", saved.dir.string()}, {"bytes", saved.bytes},
                                  {"save_ms", saved.ms}, {"blocking_ms", blocking_ms}, {"async", async}});
  if (s.rank0()) {
    bar.clear();
    spdlog::info("step {:>5}/{} | state saved ({}): {} in {:.0f} ms{} -> {}", step, s.cfg.train.steps, why,
                 log::format_bytes(saved.bytes), saved.ms,
                 async ? fmt::format(" (the steps waited {:.0f} ms)", blocking_ms) : std::string(), saved.dir.string());
  }
}

// state.async: publishes the save in flight (a collective: every rank calls it at the same point) after
// waiting for its writer. The loop waits for the agreement and rank 0's meta.json and renames, plus
// whatever of the write is left. `last`: no save follows, so state.keep is applied now (else by the next
// save's writer).
void finish_pending_save(Session& s, LoopState& st, log::ProgressBar& bar, bool last) {
  if (!st.pending_save) {
    if (last && st.finished_save) {  // published by a poll, its state.keep left to a save that will not come
      auto parts = state_parts(s);
      st.finished_save->apply_keep(parts);
    }
    return;
  }
  auto pending = std::move(st.pending_save);
  const auto t0 = Clock::now();
  auto parts = state_parts(s);
  const state::Saved saved = saving(s, st, pending->step(), [&] { return pending->finish(parts, last); });
  record_saved(s, st, bar, saved, pending->step(), "every", pending->snapshot_ms() + ms_since(t0), true);
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
void poll_pending_save(Session& s, LoopState& st, log::ProgressBar& bar, const StepResult& r) {
  if (!st.pending_save) return;
  const bool writing = s.world() > 1 ? r.save_writing : save_writing(st);
  if (!writing) finish_pending_save(s, st, bar, /*last=*/false);
}

// state.async: the host snapshot of the state after this step and its writer started; published by a
// later poll_pending_save or finish_pending_save. Logs a `state_snapshot` event.
void begin_async_save(Session& s, LoopState& st, log::ProgressBar& bar) {
  auto parts = state_parts(s);
  st.pending_save = state::begin_save(parts, st, std::move(st.finished_save));
  const int64_t bytes = st.pending_save->snapshot_bytes();
  s.runlog->event("state_snapshot", {{"step", st.steps_done}, {"snapshot_bytes", bytes},
                                     {"snapshot_ms", st.pending_save->snapshot_ms()}});
  if (s.rank0()) {
    bar.clear();
    spdlog::info("step {:>5}/{} | state snapshot: {} in host memory in {:.0f} ms, written in the background",
                 st.steps_done, s.cfg.train.steps, log::format_bytes(bytes), st.pending_save->snapshot_ms());
  }
}

// Saves the training state after this step (state/state.h) and records it; a failed save is an
// IoError (exit 7) naming the state that stays. A save in flight is published first. With state.async
// a save that need not complete before the run goes on (`every`) is written in the background;
// the others (end, signal, spike) are written before this returns.
void save_state(Session& s, LoopState& st, log::ProgressBar& bar, const char* why) {
  const bool background = s.cfg.state.async && std::string(why) == "every";
  finish_pending_save(s, st, bar, /*last=*/!background);
  if (background) return begin_async_save(s, st, bar);
  auto parts = state_parts(s);
  const state::Saved saved = saving(s, st, st.steps_done, [&] { return state::save(parts, st); });
  record_saved(s, st, bar, saved, st.steps_done, why, saved.ms, false);
}

// After a failure in the loop, the save in flight: at world 1 published (its snapshot predates the
// failure), at world > 1 given up (the other ranks may not reach the agreement), leaving the previous
// state newest. Either way its writer is joined before the run exits, and state.keep is applied to what
// is published (rank 0's own files: no collective).
void settle_pending_save(Session& s, LoopState& st, log::ProgressBar& bar) {
  if (st.pending_save && s.world() == 1) {
    try {
      return finish_pending_save(s, st, bar, /*last=*/true);
    } catch (const std::exception& e) {
      spdlog::warn("{}", e.what());
      return;
    }
  }
  if (st.pending_save) {
    const int64_t step = st.pending_save->step();
    st.pending_save.reset();
    if (s.rank0())
      spdlog::warn("the run failed while the state of step {} was being written: not published; {}", step,
                   st.last_saved_step >= 0 ? fmt::format("the state of step {} stays the newest", st.last_saved_step)
                                           : std::string("no state was saved"));
  }
  if (st.finished_save) {
    auto parts = state_parts(s);
    st.finished_save->apply_keep(parts);
  }
}

// Stops the run after this step for `stop` (agreed): saves the state on a signal (state.on_signal).
Outcome stop_run(Session& s, LoopState& st, log::ProgressBar& bar, int stop) {
  finish_pending_save(s, st, bar, /*last=*/true);
  // At world > 1 a stop can be agreed after the last step's `every` save (run_steps): not saved twice.
  const bool save = stop == kStopSpike || (stop != kStopIo && s.cfg.state.on_signal);
  if (save && st.last_saved_step != st.steps_done) save_state(s, st, bar, stop == kStopSpike ? "spike" : "signal");
  return stop_outcome(s, st, stop);
}

// The steps from where the run stands (0, or the resumed step) to train.steps, with the saves that
// state.every, state.on_signal and state.at_end ask for. Returns how the steps ended.
Outcome run_steps(Session& s, LoopState& st, log::ProgressBar& bar) {
  const auto& c = s.cfg;
  for (int64_t step = st.steps_done; step < c.train.steps; ++step) {
    if (const int stop = loop_step(s, st, step, bar)) return stop_run(s, st, bar, stop);
    if (c.state.every > 0 && st.steps_done % c.state.every == 0) save_state(s, st, bar, "every");
  }
  if (s.world() > 1 && st.steps_done > 0) {  // what landed after the last step's read (see agreed_stop)
    if (const int stop = agreed_stop(s)) return stop_run(s, st, bar, stop);
  }
  finish_pending_save(s, st, bar, /*last=*/true);
  if (c.state.at_end && st.last_saved_step != st.steps_done) save_state(s, st, bar, "end");
  return {};
}

}  // namespace

Outcome train_loop(Session& s, LoopState& st) {
  SignalGuard signals;
  log::ProgressBar bar(s.cfg.train.steps, s.cfg.logging.progress && s.rank0());
  const auto t0 = Clock::now();
  Outcome o;
  try {
    o = run_steps(s, st, bar);
  } catch (const c10::OutOfMemoryError& e) {
    o = oom_outcome(s, st, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    o = oom_outcome(s, st, e.what());
  } catch (const OomError& e) {
    o = snapshot_oom_outcome(s, st, e.what());
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
  settle_pending_save(s, st, bar);
  // The host pool's peak where no step record saw it: a step that failed, a snapshot after the last step.
  st.host_peak_bytes = std::max(st.host_peak_bytes, s.tracker->read().host_peak_bytes);
  if (o.code == kExitDistributed)
    s.runlog->event("distributed_failure", {{"step", st.steps_done + 1}, {"message", o.message}});
  bar.finish();
  st.wall_s = ms_since(t0) * 1e-3;
  return o;
}

int run(const config::RunConfig& cfg) {
  auto session = setup(cfg);
  LoopState st;
  restore(*session, st);
  Outcome outcome = train_loop(*session, st);
  return finish(*session, st, std::move(outcome));
}

}  // namespace sl::train
