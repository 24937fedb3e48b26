// One optimizer step: forward/backward over the micro-batches, gradient checks, clipping, AdamW;
// evaluation; model-state bytes; FLOP counts.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "errors.h"
#include "parallel/comm.h"
#include "parallel/engine.h"
#include "precision/autocast.h"
#include "train/optimizer.h"

namespace sl::train {
namespace {

using Clock = std::chrono::steady_clock;

thread_local const char* t_phase = "setup";

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void sync(torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// The global L2 norm of `grads` and, when it is finite and clip > 0, the gradients scaled by
// min(1, clip / (norm + 1e-6)): the same arithmetic as torch::nn::utils::clip_grad_norm_, but the
// gradients are left alone when the norm is not finite (the step is then skipped or aborted).
double measure_and_clip(const std::vector<torch::Tensor>& grads, double clip) {
  if (grads.empty()) return 0.0;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.norm());
  const torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm();
  const double norm = total.item<double>();
  if (clip > 0.0 && std::isfinite(norm)) {
    const auto coef = torch::clamp(clip / (total + 1e-6), std::nullopt, 1.0);
    for (const auto& g : grads) g.mul_(coef);
  }
  return norm;
}

// Zeroes the gradients (kept allocated, so peak - model states is the activation peak).
void zero_grads(torch::optim::AdamW& opt, parallel::Engine* engine) {
  if (engine)
    engine->zero_grad();
  else
    opt.zero_grad(/*set_to_none=*/false);
}

std::vector<torch::Tensor> local_grads(model::GPT& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters())
    if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
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
                        const StepPrecision& precision, parallel::Engine* engine) {
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
                      memory::Tracker& tracker, const StepPrecision& precision, parallel::Engine* engine) {
  StepResult r;
  auto* scaler = precision.scaler && precision.scaler->enabled() ? precision.scaler : nullptr;
  sync(device);
  tracker.reset_peak();
  const auto t0 = Clock::now();
  zero_grads(opt, engine);
  r.loss_scale = scaler ? scaler->scale() : 1.0;
  r.loss = forward_backward(forward, micro, device, precision, engine);
  const int64_t world = engine ? engine->comm().world() : 1;
  if (world > 1) r.loss = engine->comm().all_reduce_sum(r.loss, "loss average") / static_cast<double>(world);
  if (!std::isfinite(r.loss) && !scaler) return r;
  t_phase = "optimizer";
  const std::vector<torch::Tensor> grads = engine ? engine->grads() : local_grads(model);
  std::function<double(double)> agree;
  if (engine && world > 1 && engine->sharding() != "none")
    agree = [engine](double v) { return engine->comm().all_reduce_max(v, "fp16 found-inf flag"); };
  r.skipped = scaler && !scaler->unscale(grads, agree);  // unscale before clipping
  if (r.skipped) {
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else if (engine) {
    r.grad_norm = engine->grad_norm();  // global over ranks: every rank takes the same branch below
    if (grad_clip > 0.0 && std::isfinite(r.grad_norm)) engine->clip(grad_clip, r.grad_norm);
  } else {
    r.grad_norm = measure_and_clip(grads, grad_clip);
  }
  r.nonfinite_grads = !r.skipped && !std::isfinite(r.grad_norm);
  if (!r.skipped && !r.nonfinite_grads) {
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

}  // namespace sl::train
