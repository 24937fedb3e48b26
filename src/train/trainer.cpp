// Training step and loop.
#include "train/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <limits>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "dist/comm.h"
#include "dist/engine.h"
#include "errors.h"
#include "log/metrics.h"
#include "memory/activations.h"
#include "memory/planner.h"
#include "memory/tracker.h"
#include "memory/tracking_allocator.h"
#include "precision/autocast.h"
#include "recompute/policy.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace sl::train {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

std::atomic<int> g_signal{0};
thread_local const char* t_phase = "setup";
extern "C" void on_signal(int sig) { g_signal.store(sig); }

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void sync(torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string default_run_dir(const config::RunConfig& cfg) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", std::localtime(&now));
  return fmt::format("runs/{}-{}", cfg.recipe_name, stamp);
}

}  // namespace

const char* current_phase() { return t_phase; }

torch::Device resolve_device(const config::TrainConfig& t, int64_t local_rank) {
  const bool has_cuda = torch::cuda::is_available();
  if (t.device == "cuda" && !has_cuda)
    throw ConfigError("train.device: 'cuda' was asked for but no CUDA device is available; use cpu or auto");
  if (t.device == "cuda" || (t.device == "auto" && has_cuda))
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  return torch::Device(torch::kCPU);
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(model::GPT& model, const config::TrainConfig& t) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  return make_adamw(std::move(decay), std::move(no_decay), t);
}

double forward_backward(const ForwardFn& forward, const std::vector<data::Batch>& micro, torch::Device device,
                        const StepPrecision& precision, dist::Engine* engine) {
  const double n = static_cast<double>(micro.size());
  double total = 0.0;
  for (const auto& b : micro) {
    auto x = b.x.to(device), y = b.y.to(device);
    t_phase = "forward";
    torch::Tensor loss;
    {
      precision::AutocastGuard autocast(device.type(), precision.autocast);
      loss = model::GPTImpl::loss(forward(x), y);
    }
    t_phase = "backward";
    if (engine) engine->begin_backward(&b == &micro.back());
    ((precision.scaler ? precision.scaler->scale_loss(loss) : loss) / n).backward();
    if (engine) engine->end_backward();
    total += loss.item<double>();
  }
  return total / n;
}

double evaluate(model::GPT& model, data::Loader& loader, int64_t batches, torch::Device device,
                std::optional<c10::ScalarType> autocast, const ForwardFn& forward) {
  torch::NoGradGuard no_grad;
  t_phase = "eval";
  model->eval();
  double total = 0.0;
  for (int64_t i = 0; i < batches; ++i) {
    auto b = loader.next();
    precision::AutocastGuard guard(device.type(), autocast);
    auto x = b.x.to(device);
    total += model::GPTImpl::loss(forward ? forward(x) : model->forward(x), b.y.to(device)).item<double>();
  }
  model->train();
  return total / static_cast<double>(batches);
}

ModelStateBytes model_state_bytes(model::GPT& model, const torch::optim::AdamW& opt) {
  ModelStateBytes s;
  for (const auto& p : model->parameters()) {
    s.params += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) s.grads += static_cast<int64_t>(p.grad().nbytes());
  }
  s.optimizer = optimizer_state_bytes(opt);
  return s;
}

int64_t optimizer_state_bytes(const torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*state);
    for (const auto* t : {&st.exp_avg(), &st.exp_avg_sq(), &st.max_exp_avg_sq()})
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

double flops_per_token(const model::GPTImpl& model, int64_t seq_len) {
  const auto& c = model.cfg;
  return 6.0 * static_cast<double>(model.num_matmul_params()) +
         12.0 * static_cast<double>(c.n_layer) * static_cast<double>(seq_len) * static_cast<double>(c.n_embd);
}

double measure_gemm_flops(torch::Device device) {
  torch::NoGradGuard no_grad;
  const int64_t n = 1024;
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device));
  auto c = torch::mm(a, b);  // warm-up
  sync(device);
  double best_ms = 1e30;
  for (int i = 0; i < 5; ++i) {
    auto t0 = Clock::now();
    c = torch::mm(a, b);
    sync(device);
    best_ms = std::min(best_ms, ms_since(t0));
  }
  return 2.0 * static_cast<double>(n * n * n) / (best_ms * 1e-3);
}

StepResult train_step(const ForwardFn& forward, model::GPT& model, torch::optim::AdamW& opt,
                      const std::vector<data::Batch>& micro, double grad_clip, torch::Device device,
                      memory::Tracker& tracker, const StepPrecision& precision, dist::Engine* engine) {
  StepResult r;
  auto* scaler = precision.scaler && precision.scaler->enabled() ? precision.scaler : nullptr;
  sync(device);
  tracker.reset_peak();
  const auto t0 = Clock::now();
  // Gradients stay allocated (zeroed, not freed) so that peak - model states is the activation peak.
  if (engine)
    engine->zero_grad();
  else
    opt.zero_grad(/*set_to_none=*/false);
  r.loss_scale = scaler ? scaler->scale() : 1.0;
  r.loss = forward_backward(forward, micro, device, precision, engine);
  const int64_t world = engine ? engine->comm().world() : 1;
  if (world > 1) r.loss = engine->comm().all_reduce_sum(r.loss, "loss average") / static_cast<double>(world);
  if (!std::isfinite(r.loss) && !scaler) return r;
  t_phase = "optimizer";
  std::vector<torch::Tensor> grads;
  if (engine) {
    grads = engine->grads();
  } else {
    for (const auto& p : model->parameters())
      if (p.grad().defined()) grads.push_back(p.grad());
  }
  std::function<double(double)> agree;
  if (engine && world > 1 && engine->sharding() != "none")
    agree = [engine](double v) { return engine->comm().all_reduce_max(v, "fp16 found-inf flag"); };
  r.skipped = scaler && !scaler->unscale(grads, agree);  // unscale before clipping
  if (r.skipped) {
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else if (engine) {
    r.grad_norm = engine->grad_norm();
    if (grad_clip > 0.0) engine->clip(grad_clip, r.grad_norm);
  } else if (grad_clip > 0.0) {
    r.grad_norm = torch::nn::utils::clip_grad_norm_(model->parameters(), grad_clip);
  } else {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> norms;
    for (const auto& g : grads) norms.push_back(g.norm());
    r.grad_norm = torch::stack(norms).norm().item<double>();
  }
  if (!r.skipped) {
    opt.step();
    if (engine) engine->after_step();
  }
  if (scaler) scaler->update();
  sync(device);
  r.ms = ms_since(t0);
  r.mem = tracker.read();
  if (engine) {
    const auto sb = engine->state_bytes();
    r.states = {sb.params, sb.grads, optimizer_state_bytes(opt)};
  } else {
    r.states = model_state_bytes(model, opt);
  }
  return r;
}

bool micro_batch_fits(const config::RunConfig& cfg, int64_t micro_batch, torch::Device device) {
  auto c = cfg;
  c.train.micro_batch = micro_batch;
  try {
    torch::manual_seed(static_cast<uint64_t>(c.train.seed));
    model::GPT m(c.model, device);
    recompute::Policy policy(c.checkpointing, m);
    auto opt = make_optimizer(m, c.train);
    memory::Tracker tracker(device);
    precision::LossScaler scaler(c.precision, device);
    const StepPrecision prec{precision::compute_dtype(c.precision.compute), &scaler};
    const ForwardFn fwd = [&policy](const torch::Tensor& idx) { return policy.forward(idx); };
    auto x = torch::randint(0, c.model.vocab_size, {micro_batch, c.train.seq_len}, torch::kInt64);
    for (int i = 0; i < 2; ++i) train_step(fwd, m, *opt, {{x, x}}, c.train.grad_clip, device, tracker, prec);
    return true;
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
}

BatchSearch find_micro_batch(const config::RunConfig& cfg, torch::Device device) {
  const int64_t global = cfg.train.global_batch;
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= global; ++d)
    if (global % d == 0) divisors.push_back(d);
  BatchSearch r;
  const int64_t limit = config::memory_limit_bytes(cfg);
  auto planned = cfg;
  planned.train.micro_batch = 1;
  r.predicted = limit > 0 ? memory::largest_micro_batch(planned, limit, global) : global;
  auto fits = [&](size_t i) {
    const bool ok = micro_batch_fits(cfg, divisors[i], device);
    r.trials.emplace_back(divisors[i], ok);
    return ok;
  };
  // Bisection over the divisors: lo fits (-1: none known), hi does not (n: none known). The first
  // probe is the largest divisor at or below the planner's prediction.
  int64_t lo = -1, hi = static_cast<int64_t>(divisors.size());
  int64_t guess = 0;
  while (guess + 1 < hi && divisors[guess + 1] <= r.predicted) ++guess;
  (fits(guess) ? lo : hi) = guess;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;  // truncates toward zero: with lo = -1 it probes the lower half
    (fits(mid) ? lo : hi) = mid;
  }
  if (lo >= 0) r.micro_batch = divisors[lo], r.grad_accum = global / r.micro_batch;
  return r;
}

void save_model(model::GPT& model, const std::filesystem::path& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& item : model->named_parameters()) archive.write(item.key(), item.value().detach().cpu());
  auto tmp = path;
  tmp += ".tmp";
  try {
    archive.save_to(tmp.string());
  } catch (const c10::Error& e) {
    std::filesystem::remove(tmp);
    throw ConfigError(fmt::format("writing {} failed ({}); check the run directory and free disk space", path.string(),
                                  std::string(e.what_without_backtrace()).substr(0, 200)));
  }
  std::filesystem::rename(tmp, path);
}

int run(const config::RunConfig& recipe) {
  config::RunConfig cfg = recipe;  // train.micro_batch: auto is resolved below
  const auto& t = cfg.train;
  const dist::LaunchEnv launch = dist::LaunchEnv::from_env();
  const int64_t world = launch.world, rank = launch.rank;
  cfg.world_size = world;
  const bool rank0 = rank == 0;
  const torch::Device device = resolve_device(t, launch.local_rank);
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);  // one GPU per local rank
  if (t.threads > 0) at::set_num_threads(static_cast<int>(t.threads));
  if (world > 1 && cfg.train.micro_batch == 0 && cfg.train.global_batch % world != 0)
    throw ConfigError(fmt::format("train.global_batch {} is not divisible by WORLD_SIZE {}: micro_batch: auto keeps the "
                                  "global batch exactly; pick a multiple of the world size",
                                  cfg.train.global_batch, world));
  // Rendezvous before reading data or building the model: a missing peer fails fast (exit 5).
  auto comm = std::make_shared<dist::Comm>(launch, cfg.parallel, device);
  const bool use_engine = world > 1 || cfg.parallel.sharding != "none";

  // Data first: a bad file fails here, before a run directory or a model exists.
  data::Splits splits = data::open_splits(cfg);

  memory::Tracker tracker(device);
  const int64_t limit = config::memory_limit_bytes(cfg);
  tracker.set_limit(limit);  // before the model exists: the limit covers everything, as on a GPU
  Json batch_search = nullptr;
  if (cfg.train.micro_batch == 0) {
    auto per_rank = cfg;  // each rank holds global_batch / world of every step
    per_rank.train.global_batch /= world;
    BatchSearch found = find_micro_batch(per_rank, device);
    if (world > 1) {  // every rank must train the same micro-batch: take the smallest that fits everywhere
      const auto agreed = static_cast<int64_t>(-comm->all_reduce_max(-static_cast<double>(found.micro_batch), "micro_batch auto"));
      if (agreed != found.micro_batch && agreed > 0) found.micro_batch = agreed, found.grad_accum = per_rank.train.global_batch / agreed;
      if (agreed == 0) found.micro_batch = 0;
    }
    Json trials = Json::array();
    for (const auto& [b, ok] : found.trials) trials.push_back({{"micro_batch", b}, {"fits", ok}});
    batch_search = {{"planner_prediction", found.predicted}, {"trials", trials}, {"micro_batch", found.micro_batch},
                    {"grad_accum", found.grad_accum}, {"global_batch", cfg.train.global_batch}};
    if (found.micro_batch == 0)
      throw Error(kExitOom, fmt::format("train.micro_batch: auto: not even micro-batch 1 fits memory.limit {}; {}",
                                        cfg.memory.limit, memory::oom_advice(cfg, limit)));
    cfg.train.micro_batch = found.micro_batch;
    cfg.train.grad_accum = found.grad_accum;
    if (rank0)
      spdlog::info("micro_batch auto: planner predicted {}, tried {}, chose {} x grad_accum {} (global batch {})",
                   found.predicted, trials.dump(), found.micro_batch, found.grad_accum, cfg.train.global_batch);
  }
  data::Loader train_loader(splits.train, t.micro_batch, t.seq_len, static_cast<uint64_t>(t.seed), rank, world);
  data::Loader val_loader(splits.val, t.micro_batch, t.seq_len, static_cast<uint64_t>(t.seed) + 1, rank, world);

  torch::manual_seed(static_cast<uint64_t>(t.seed));
  model::GPT model = [&] {
    try {
      return model::GPT(cfg.model, device);
    } catch (const c10::OutOfMemoryError& e) {  // before the run directory exists: nothing to clean up
      throw Error(kExitOom, fmt::format("out of memory while building the model ({}). To fit, {}",
                                        std::string(e.what_without_backtrace()).substr(0, 200), memory::oom_advice(cfg, limit)));
    }
  }();
  model->train();
  recompute::Policy policy(cfg.checkpointing, model);
  std::unique_ptr<dist::Engine> engine;
  // zero3: autocast's cache of low-precision weight copies (kept until the forward's autocast region
  // ends) would keep every unit's weights alive after the unit's fp32 storage is freed.
  if (cfg.parallel.sharding == "zero3") at::autocast::set_autocast_cache_enabled(false);
  if (use_engine) {
    engine = std::make_unique<dist::Engine>(model, cfg, comm);
    engine->attach(policy);
  }
  auto opt = engine ? engine->make_optimizer(t) : make_optimizer(model, t);
  precision::LossScaler scaler(cfg.precision, device);
  const StepPrecision step_precision{precision::compute_dtype(cfg.precision.compute), &scaler};
  const ForwardFn forward = [&policy](const torch::Tensor& idx) { return policy.forward(idx); };
  const double fpt = flops_per_token(*model, t.seq_len);
  const double recompute_fpt = policy.recompute_flops_per_token(t.seq_len);
  const auto predicted = memory::estimate_activation_peak(cfg, policy.plan());
  const bool peak_measured = cfg.logging.peak_tflops <= 0.0;
  const double peak_flops = peak_measured ? measure_gemm_flops(device) : cfg.logging.peak_tflops * 1e12;

  const std::string run_dir = cfg.logging.dir.empty() ? default_run_dir(cfg) : cfg.logging.dir;
  // Rank 0 alone creates the run directory; if it cannot, every rank stops with exit 2 now rather
  // than waiting in the first collective for parallel.timeout_s.
  std::unique_ptr<log::RunLog> runlog_owner;
  std::string runlog_error;
  try {
    runlog_owner = std::make_unique<log::RunLog>(run_dir, rank0);
  } catch (const ConfigError& e) {
    runlog_error = e.what();
  }
  if (world > 1 && comm->all_reduce_max(runlog_error.empty() ? 0.0 : 1.0, "run directory check") > 0.0 &&
      runlog_error.empty())
    runlog_error = fmt::format("rank 0 could not create the run directory {} (see its error)", run_dir);
  if (!runlog_error.empty()) throw ConfigError(runlog_error);
  log::RunLog& runlog = *runlog_owner;
  Json resolved = config::to_json(cfg);
  runlog.write_json("config.json", resolved);

  Json env = {{"torch_version", TORCH_VERSION},
              {"device", device.str()},
              {"cuda_available", torch::cuda::is_available()},
              {"threads", at::get_num_threads()},
              {"world_size", world},
              {"rank", rank},
              {"backend", comm->backend()},
              {"memory_source", tracker.source()}};
  Json model_info = {{"params", model->num_params()},
                     {"matmul_params", model->num_matmul_params()},
                     {"flops_per_token", fpt},
                     {"recompute_flops_per_token", recompute_fpt},
                     {"peak_flops", peak_flops},
                     {"peak_flops_source", peak_measured ? "measured_fp32_gemm" : "logging.peak_tflops"}};
  if (rank0) {
    auto rows = config::to_rows(cfg);
    rows.emplace_back("run directory", run_dir);
    rows.emplace_back("device", device.str());
    rows.emplace_back("threads", std::to_string(at::get_num_threads()));
    if (use_engine)
      rows.emplace_back("data parallel", fmt::format("{} rank(s), backend {}, sharding {}", world, comm->backend(),
                                                     cfg.parallel.sharding));
    rows.emplace_back("checkpointing plan", policy.plan().describe());
    rows.emplace_back("predicted activation peak", fmt::format("{} per micro-batch (fp32 flash-path model)",
                                                               log::format_bytes(predicted.peak_bytes)));
    rows.emplace_back("parameters", fmt::format("{} ({:.2f} M)", model->num_params(), model->num_params() / 1e6));
    rows.emplace_back("train data", splits.train->describe());
    rows.emplace_back("val data", splits.val->describe());
    rows.emplace_back("peak FLOP/s for MFU", fmt::format("{:.3g} ({})", peak_flops, model_info["peak_flops_source"].get<std::string>()));
    fmt::print("{}", log::format_table(rows));
    std::fflush(stdout);
  }

  g_signal.store(0);
  auto old_int = std::signal(SIGINT, on_signal);
  auto old_term = std::signal(SIGTERM, on_signal);

  const int64_t tokens_per_step = t.micro_batch * t.grad_accum * t.seq_len * world;
  std::vector<double> step_ms, tok_s, samp_s, mfus, recompute_ms, act_peaks;
  int64_t peak_bytes = 0, steps_done = 0, skipped_steps = 0, transient_peak = 0, rest_bytes = 0, gathers = 0;
  ModelStateBytes states_at_peak;
  double last_loss = NAN, last_val = NAN;
  int exit_code = kExitOk;
  std::string exit_message;
  Json oom = nullptr;
  log::ProgressBar bar(t.steps, cfg.logging.progress && rank0);
  const auto run_t0 = Clock::now();

  try {
    for (int64_t step = 0; step < t.steps; ++step) {
      const double lr = lr_at(t, step);
      for (auto& g : opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
      std::vector<data::Batch> micro;
      for (int64_t m = 0; m < t.grad_accum; ++m) micro.push_back(train_loader.next());

      const StepResult r =
          train_step(forward, model, *opt, micro, t.grad_clip, device, tracker, step_precision, engine.get());
      if (engine) transient_peak = std::max(transient_peak, engine->take_transient_peak()), gathers = engine->gathers();
      rest_bytes = r.mem.allocated_bytes;
      if (r.skipped) {
        ++skipped_steps;
        runlog.event("skip", {{"step", step + 1}, {"loss_scale", r.loss_scale}, {"new_loss_scale", scaler.scale()}});
        if (rank0) {
          bar.clear();
          spdlog::warn("step {:>5}/{} | non-finite gradients at loss scale {:g}: step skipped, scale now {:g}", step + 1,
                       t.steps, r.loss_scale, scaler.scale());
        }
      } else if (!std::isfinite(r.loss)) {
        runlog.event("non_finite_loss", {{"step", step + 1}, {"loss", r.loss}});
        throw NonFiniteError(fmt::format("step {}: loss is {}; lower train.lr or raise train.warmup_steps", step + 1, r.loss));
      }
      const double loss = r.loss, grad_norm = r.grad_norm, ms = r.ms;
      const memory::Snapshot& mem = r.mem;
      const ModelStateBytes& states = r.states;
      if (mem.peak_allocated_bytes >= peak_bytes) peak_bytes = mem.peak_allocated_bytes, states_at_peak = states;

      const double tps = static_cast<double>(tokens_per_step) / (ms * 1e-3);
      const double mfu = fpt * tps / (peak_flops * static_cast<double>(world));  // per-device peak
      const recompute::Stats rs = policy.take_stats();
      Json rec = {{"step", step + 1},
                  {"loss", loss},
                  {"lr", lr},
                  {"grad_norm", std::isfinite(grad_norm) ? Json(grad_norm) : Json(nullptr)},
                  {"loss_scale", r.loss_scale},
                  {"skipped", r.skipped},
                  {"step_ms", ms},
                  {"tokens", tokens_per_step},
                  {"tokens_per_s", tps},
                  {"samples_per_s", static_cast<double>(t.micro_batch * t.grad_accum * world) / (ms * 1e-3)},
                  {"mfu", mfu},
                  {"hfu", (fpt + recompute_fpt) * tps / (peak_flops * static_cast<double>(world))},
                  {"recompute_ms", rs.recompute_ms},
                  {"peak_allocated_bytes", mem.peak_allocated_bytes},
                  {"activation_peak_bytes", r.activation_peak_bytes()},
                  {"allocated_bytes", mem.allocated_bytes},
                  {"reserved_bytes", mem.reserved_bytes}};
      runlog.step(rec);
      steps_done = step + 1;
      last_loss = loss;
      if (step >= cfg.logging.skip_first || t.steps <= cfg.logging.skip_first) {
        step_ms.push_back(ms), tok_s.push_back(tps), mfus.push_back(mfu);
        samp_s.push_back(rec["samples_per_s"].get<double>());
        recompute_ms.push_back(rs.recompute_ms);
        act_peaks.push_back(static_cast<double>(rec["activation_peak_bytes"].get<int64_t>()));
      }
      bar.update(steps_done, loss);
      if (rank0 && (steps_done % cfg.logging.interval == 0 || steps_done == 1 || steps_done == t.steps)) {
        bar.clear();
        spdlog::info("{}", log::format_step_line(rec, t.steps));
      }
      if (t.eval_interval > 0 && (steps_done % t.eval_interval == 0 || steps_done == t.steps)) {
        last_val = evaluate(model, val_loader, t.eval_batches, device, step_precision.autocast, forward);
        if (world > 1) last_val = comm->all_reduce_sum(last_val, "eval loss average") / static_cast<double>(world);
        runlog.event("eval", {{"step", steps_done}, {"val_loss", last_val}});
        if (rank0) {
          bar.clear();
          spdlog::info("step {:>5}/{} | val loss {:.4f}", steps_done, t.steps, last_val);
        }
      }
      int sig = g_signal.load();
      // Ranks stop together: a signal seen by any rank (torchrun forwards it to all, not at the same
      // step) stops every rank after this step, so the collectives after the loop still pair up.
      if (world > 1) sig = static_cast<int>(comm->all_reduce_max(static_cast<double>(sig), "stop flag"));
      if (sig) {
        exit_code = sig == SIGINT ? kExitSigint : kExitSigterm;
        exit_message = fmt::format("interrupted by signal {} after step {}", sig, steps_done);
        runlog.event("interrupted", {{"step", steps_done}, {"signal", sig}});
        break;
      }
    }
  } catch (const c10::OutOfMemoryError& e) {
    exit_code = kExitOom;
    const memory::Snapshot snap = tracker.read();
    const int64_t requested = device.is_cpu() ? memory::TrackingCPUAllocator::instance().last_refused_bytes() : -1;
    exit_message = fmt::format("out of memory in {} at step {} ({}). To fit, {}", current_phase(), steps_done + 1,
                               std::string(e.what_without_backtrace()).substr(0, 300), memory::oom_advice(cfg, limit));
    oom = {{"step", steps_done + 1},
           {"phase", current_phase()},
           {"requested_bytes", requested >= 0 ? Json(requested) : Json(nullptr)},
           {"peak_bytes", snap.peak_allocated_bytes},
           {"limit_bytes", limit > 0 ? Json(limit) : Json(nullptr)},
           {"message", exit_message}};
    runlog.event("oom", oom);
  } catch (const Error& e) {
    exit_code = e.code;
    exit_message = e.what();
  } catch (const std::exception& e) {
    // A collective that failed inside a gradient hook surfaces here wrapped by autograd.
    if (comm->failure().empty()) throw;
    exit_code = kExitDistributed;
    exit_message = comm->failure();
  }
  if (exit_code == kExitDistributed) runlog.event("distributed_failure", {{"step", steps_done + 1}, {"message", exit_message}});
  bar.finish();
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);

  // Collectives after the loop only where every rank is known to have left it at the same step: a
  // clean end, an agreed stop, or a non-finite loss (averaged over ranks, so all ranks see it).
  // After an OOM or another rank-local error the others are stuck in a step's collective instead.
  const bool ranks_aligned =
      exit_code == kExitOk || exit_code == kExitSigint || exit_code == kExitSigterm || exit_code == kExitNonFinite;
  if (cfg.logging.save_model && ranks_aligned && exit_code != kExitNonFinite) {
    try {
      if (engine) engine->gather_all();
      if (rank0) save_model(model, runlog.dir() / "model.pt");
      if (engine) engine->release_all();
    } catch (const Error& e) {  // a failed write on rank 0 (exit 2) must not strand the others
      exit_code = e.code;
      exit_message = e.what();
    }
  }
  // Per-rank memory, gathered to rank 0 (skipped when a peer failed: the collective could not pair).
  Json parallel = nullptr;
  if (use_engine) {
    const auto sb = engine->state_bytes();
    const int64_t opt_bytes = optimizer_state_bytes(*opt);
    std::vector<double> mine{static_cast<double>(rank),       static_cast<double>(rest_bytes),
                             static_cast<double>(sb.params), static_cast<double>(sb.grads),
                             static_cast<double>(opt_bytes), static_cast<double>(transient_peak),
                             static_cast<double>(peak_bytes)};
    std::vector<double> all = mine;
    if (ranks_aligned && world > 1) {
      try {
        all = comm->all_gather(mine, "per-rank memory report");
      } catch (const dist::DistError& e) {
        exit_code = kExitDistributed;
        exit_message = e.what();
      }
    }
    Json ranks = Json::array();
    for (size_t i = 0; i + mine.size() <= all.size(); i += mine.size()) {
      auto at = [&](size_t k) { return static_cast<int64_t>(all[i + k]); };
      ranks.push_back({{"rank", at(0)},
                       {"model_state_bytes_measured", at(1)},
                       {"params_bytes", at(2)},
                       {"grads_bytes", at(3)},
                       {"optimizer_state_bytes", at(4)},
                       {"model_state_bytes", at(2) + at(3) + at(4)},
                       {"transient_peak_bytes", at(5)},
                       {"peak_allocated_bytes", at(6)}});
    }
    parallel = {{"world_size", world},
                {"backend", comm->backend()},
                {"sharding", cfg.parallel.sharding},
                {"params_bytes_unsharded", 4 * model->num_params()},
                {"largest_group_bytes", engine->largest_unit_bytes()},
                {"groups", engine->groups()},
                {"groups_launched_during_backward", engine->launched_from_hooks()},
                {"gathers_last_step", gathers},
                {"ranks", ranks}};
  }
  Json summary = {
      {"config", resolved},
      {"environment", env},
      {"model", model_info},
      {"checkpointing", policy.plan().to_json()},
      {"run_dir", run_dir},
      {"steps", steps_done},
      {"skipped_steps", skipped_steps},
      {"tokens", steps_done * tokens_per_step},
      {"final_loss", std::isfinite(last_loss) ? Json(last_loss) : Json(nullptr)},
      {"final_val_loss", std::isfinite(last_val) ? Json(last_val) : Json(nullptr)},
      {"warmup_steps_excluded", std::min<int64_t>(cfg.logging.skip_first, steps_done)},
      {"median_step_ms", median(step_ms)},
      {"median_tokens_per_s", median(tok_s)},
      {"median_samples_per_s", median(samp_s)},
      {"median_mfu", median(mfus)},
      {"median_recompute_ms", median(recompute_ms)},
      {"median_activation_peak_bytes", static_cast<int64_t>(median(act_peaks))},
      {"predicted_activation_peak_bytes", predicted.peak_bytes},
      {"predicted_peak_bytes", memory::predict_peak(cfg).peak_bytes()},  // per rank, from the planner
      {"wall_s", ms_since(run_t0) * 1e-3},
      {"peak_allocated_bytes", peak_bytes},
      {"memory_breakdown",
       {{"params_bytes", states_at_peak.params},
        {"grads_bytes", states_at_peak.grads},
        {"optimizer_state_bytes", states_at_peak.optimizer},
        {"activations_and_other_bytes", std::max<int64_t>(0, peak_bytes - states_at_peak.total())}}},
      {"memory_limit_bytes", limit > 0 ? Json(limit) : Json(nullptr)},
      {"micro_batch_search", batch_search},
      {"parallel", parallel},
      {"oom", oom},
      {"exit_status", {{"code", exit_code}, {"name", exit_code_name(exit_code)}, {"message", exit_message}}}};
  runlog.write_json("summary.json", summary);
  if (!rank0 && exit_code != kExitOk) spdlog::error("rank {}: {}", rank, exit_message);
  if (rank0) {
    if (exit_code == kExitOk)
      spdlog::info("done: {} steps, median {:.1f} ms/step, {:.0f} tok/s, peak {} -> {}", steps_done, median(step_ms),
                   median(tok_s), log::format_bytes(peak_bytes), (runlog.dir() / "summary.json").string());
    else
      spdlog::error("{} (summary: {})", exit_message, (runlog.dir() / "summary.json").string());
  }
  return exit_code;
}

}  // namespace sl::train
