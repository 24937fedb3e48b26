// One optimizer step: forward/backward over the micro-batches, gradient checks, clipping, AdamW;
// evaluation; model-state bytes; FLOP counts.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <limits>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/device.h"
#include "errors.h"
#include "log/clock.h"
#include "parallel/comm.h"
#include "parallel/strategy.h"
#include "precision/autocast.h"
#include "train/cuda_graph.h"
#include "train/micro_batch.h"
#include "train/trainer.h"

namespace sl::train {
namespace {

using log::Clock;
using log::ms_since;
using device::Label;
using device::LabelScope;
using device::Phase;
using device::set_phase;

// Copies `t` (a few float64 values on the device) to the host: the one host synchronization of an
// optimizer step (on CUDA it waits for everything queued before it). Recorded as
// "sublinear::host_read" for profilers and tests (tests/test_train.cpp counts them).
std::vector<double> read_to_host(const torch::Tensor& t) {
  RECORD_FUNCTION("sublinear::host_read", std::vector<c10::IValue>{});
  const auto h = t.to(torch::kCPU).contiguous();
  return {h.data_ptr<double>(), h.data_ptr<double>() + h.numel()};
}

// What a step decides on, read from the device at once.
struct StepReading {
  double loss = 0.0;       // mean over micro-batches and ranks
  double grad_norm = 0.0;  // global
  bool found_inf = false;  // fp16: some rank's gradients are not finite
  int stop = 0;            // the agreed stop reason (see StopPoll)
  bool save_writing = false;  // some rank's asynchronous save is still being written (see StopPoll)
};

// A rank's poll as four counts on the device, [log write failed, SIGTERM, SIGINT, save being written]
// (a fill with a host scalar: no copy, no wait): summed over ranks they say which reasons any rank had,
// and stop_from_counts takes the largest, as an all-reduce max would; the last is how many ranks are
// still writing.
torch::Tensor poll_counts(const LocalPoll& p, const torch::TensorOptions& options) {
  auto counts = torch::zeros({4}, options);
  const int slot = p.stop == kStopIo ? 0 : p.stop == SIGTERM ? 1 : p.stop == SIGINT ? 2 : -1;
  if (slot >= 0) counts[slot].fill_(1.0);
  if (p.save_writing) counts[3].fill_(1.0);
  return counts;
}
int stop_from_counts(const double* c) {
  return c[0] > 0.0 ? kStopIo : c[1] > 0.0 ? SIGTERM : c[2] > 0.0 ? SIGINT : 0;
}

// Packs [this rank's mean loss, its share of the gradient norm, its found-inf flag, with a poll its counts],
// sums it over ranks (the strategy's one all-reduce of a device tensor; none for one process), moves the
// loss scale on (fp16, on the device, from the agreed flag), then reads all of it, with the new scale, in
// one host read.
StepReading read_step(const torch::Tensor& loss, const torch::Tensor& norm, const torch::Tensor& found_inf,
                      precision::LossScaler* scaler, parallel::Strategy& strategy, const StopPoll& poll) {
  torch::NoGradGuard no_grad;
  const auto f64 = [&](const torch::Tensor& t) {
    return t.defined() ? t.reshape({1}).to(torch::kDouble) : torch::zeros({1}, loss.options());  // loss: float64
  };
  std::vector<torch::Tensor> parts{f64(loss), f64(norm), f64(found_inf)};
  if (poll) parts.push_back(poll_counts(poll(), loss.options()));  // [3, 7): only where a loop polls
  auto packed = torch::cat(parts);
  const std::string what = "loss, gradient norm and found-inf reduction";
  strategy.sum_over_ranks(packed, what);
  const auto scale_at = static_cast<size_t>(packed.size(0));
  if (scaler) {
    scaler->update(packed[2]);
    packed = torch::cat({packed, scaler->scale_tensor().to(torch::kDouble)});
  }
  const std::vector<double> v = read_to_host(packed);
  strategy.check_reduction(what);
  if (scaler) scaler->observe(v[scale_at]);
  const auto world = static_cast<double>(strategy.world());
  return {v[0] / world, strategy.global_norm(v[1]), v[2] > 0.0,
          poll ? stop_from_counts(&v[3]) : 0, poll && v[6] > 0.0};
}

}  // namespace

const char* current_phase() { return device::phase_name(device::current_phase().phase); }

int64_t step_trained_targets(const std::vector<data::Batch>& micro) {
  int64_t n = 0;
  for (const auto& b : micro) n += b.trained_everywhere;
  return n;
}

// A masked batch's loss factor. The fused loss returns a micro-batch's summed loss over its R rows
// (model/fused_loss.h: the sum over trained targets, divided by every row); times R world n / N, N the
// trained targets of the step over every micro-batch and rank, it becomes the share that forward_backward
// (/ n, over the micro-batches) and read_step (summed over ranks, / world) turn into sum / N, the mean over
// the step's trained targets. The gradients go the same way (the strategy averages them over the world):
// the step's gradient is that of sum / N, whatever the micro-batch, accumulation and rank count, and not a
// mean of per-micro-batch means (which weights a short example's tokens up). 0 for an unmasked batch.
double masked_loss_factor(const data::Batch& b, int64_t step_trained, int64_t world, size_t micro_batches) {
  if (!b.masked()) return 0.0;
  return static_cast<double>(b.y.numel()) * static_cast<double>(world) * static_cast<double>(micro_batches) /
         static_cast<double>(step_trained);
}

torch::Tensor forward_backward(const LossFn& loss_of, const std::vector<data::Batch>& micro, torch::Device device,
                               parallel::Strategy& strategy, const StepPrecision& precision, StepGraph* graph) {
  const double n = static_cast<double>(micro.size());
  const int64_t trained = step_trained_targets(micro);
  StepGraph eager;  // one path, graphs on or off: every micro-batch goes through a StepGraph's run
  StepGraph& runner = graph ? *graph : eager;
  torch::Tensor total;  // float64 on the device: the same sum the host made of each loss's value
  for (const auto& b : micro) {
    const MicroBatchWork w{loss_of, b, device, precision, n,
                           masked_loss_factor(b, trained, strategy.world(), micro.size())};
    const bool last = &b == &micro.back();
    const auto l = runner.run(w, strategy, last);
    total = total.defined() ? total + l : l;
  }
  return total / n;
}

double evaluate(model::GPT& model, data::Loader& loader, int64_t batches, torch::Device device,
                std::optional<c10::ScalarType> autocast, const LossFn& loss_of, int64_t world) {
  torch::NoGradGuard no_grad;
  set_phase(Phase::eval);
  loader.rewind();  // the same windows every eval: two evals of the same weights give the same loss
  model->eval();
  std::vector<data::Batch> all;
  for (int64_t i = 0; i < batches; ++i) all.push_back(loader.next());
  const int64_t trained = step_trained_targets(all);
  torch::Tensor total;  // float64 on the device, read once
  for (const auto& b : all) {
    precision::AutocastGuard guard(device.type(), autocast);
    auto x = device::to_device(b.x, device);
    const auto y = device::to_device(b.y, device);
    const auto p = b.positions.defined() ? device::to_device(b.positions, device) : torch::Tensor();
    auto l = (loss_of ? loss_of(x, y, p) : model->loss(x, y, p)).to(torch::kDouble);
    if (const double f = masked_loss_factor(b, trained, world, all.size()); f > 0.0) l = l * f;
    total = total.defined() ? total + l : l;
  }
  model->train();
  return total.defined() ? total.item<double>() / static_cast<double>(batches) : 0.0;
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
  // model.lora: a frozen weight's gradient is never computed, 4 FLOPs per weight (forward and the input's
  // gradient) where a trained one takes 6; the adapters (num_trained_params) take 6.
  const double trained = static_cast<double>(model.num_trained_params());
  const double matmul = static_cast<double>(model.num_matmul_params());
  const double weights = c.lora.enabled() ? 4.0 * (matmul - trained) + 6.0 * trained : 6.0 * matmul;
  return weights + 12.0 * static_cast<double>(c.n_layer) * static_cast<double>(seq_len) * static_cast<double>(c.n_embd);
}

namespace {

// Model states after the step, by place: the strategy's buffers, AdamW's moments on the device or (offload)
// the host, and the bytes offload copied during the step.
void record_states(const StepParts& p, StepResult& r) {
  const auto sb = p.strategy.state_bytes();
  const int64_t moments = optimizer_state_bytes(p.opt);
  r.states = {sb.params, sb.grads, sb.optimizer_on_host ? 0 : moments};
  r.host_states = sb.host_params + sb.host_grads + (sb.optimizer_on_host ? moments : 0);
  const auto moved = p.strategy.take_moved();
  r.moved_to_device = moved.to_device, r.moved_to_host = moved.to_host;
}

}  // namespace

// One host synchronization: read_step's read, after backward (see trainer.h). The step time is wall
// clock from here to the return. On CUDA nothing waits for the device at either end: the kernels the
// step queues after its read (clipping, AdamW, the ZeRO all-gather) finish during the next step and
// count in its time, so step times still add up to the run's wall time and show its throughput.
StepResult train_step(const StepParts& p, const std::vector<data::Batch>& micro, const StopPoll& stop,
                      const HoldFn& hold) {
  StepResult r;
  auto* scaler = p.precision.scaler && p.precision.scaler->enabled() ? p.precision.scaler : nullptr;
  p.tracker.reset_peak();
  const auto t0 = Clock::now();
  p.strategy.take_moved();  // this step's transfers only (not an eval's gathers)
  p.strategy.zero_grad();
  r.loss_scale = scaler ? scaler->scale() : 1.0;
  r.trained_targets = step_trained_targets(micro);
  const torch::Tensor loss = forward_backward(p.loss, micro, p.device, p.strategy, p.precision, p.graph);
  set_phase(Phase::optimizer);
  const std::vector<torch::Tensor> grads = p.strategy.grads();
  const torch::Tensor found_inf = scaler ? scaler->unscale(grads) : torch::Tensor();  // unscale before clipping
  const torch::Tensor norm = p.strategy.norm_share(grads, p.grad_clip);
  const StepReading got = read_step(loss, norm, found_inf, scaler, p.strategy, stop);
  r.loss = got.loss;
  r.stop = got.stop;
  r.save_writing = got.save_writing;
  if (!std::isfinite(r.loss) && !scaler) return r;
  r.skipped = scaler && got.found_inf;
  // global: every rank branches alike
  r.grad_norm = r.skipped ? std::numeric_limits<double>::quiet_NaN() : got.grad_norm;
  if (!r.skipped && p.grad_clip > 0.0 && std::isfinite(r.grad_norm)) p.strategy.clip(p.grad_clip, r.grad_norm);
  r.nonfinite_grads = !r.skipped && !std::isfinite(r.grad_norm);
  r.held = !r.skipped && !r.nonfinite_grads && hold && hold(r.loss);
  if (!r.skipped && !r.nonfinite_grads && !r.held) {
    RECORD_FUNCTION("sublinear::optimizer_step", std::vector<c10::IValue>{});
    p.strategy.optimizer_step(p.opt);
  }
  device::end_step(p.device);
  r.ms = ms_since(t0);
  r.mem = p.tracker.close_step();  // a memory timeline of this step ends here (memory/timeline.h)
  record_states(p, r);
  return r;
}

}  // namespace sl::train
