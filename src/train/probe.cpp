// The probe step (train/probe.h): set-up in the trainer's order, then `steps` real train_steps.
#include "train/probe.h"

#include <optional>

#include <torch/torch.h>

#include "recompute/runner.h"
#include "memory/tracker.h"
#include "memory/tracking_allocator.h"
#include "model/gpt.h"
#include "parallel/single.h"
#include "precision/autocast.h"
#include "precision/loss_scaler.h"

namespace sl::train {

ProbeResult probe_step(const config::RunConfig& cfg, const recompute::Plan& plan, const ProbeOptions& opts) {
  ProbeResult out;
  const torch::Device device = opts.device;
  try {
    memory::Tracker tracker(device);
    // Tensors the caller still holds (e.g. another run's gradients) are neither this model's states
    // nor this step's activations.
    out.allocated_before = tracker.read().allocated_bytes;
    torch::manual_seed(opts.seed.value_or(static_cast<uint64_t>(cfg.train.seed)));
    model::GPT m(cfg.model, device);
    recompute::Runner runner(cfg.checkpointing, m, plan);
    parallel::Single single(m);
    auto opt = single.make_optimizer(cfg.train);
    std::optional<precision::LossScaler> scaler;
    if (opts.loss_scaler) scaler.emplace(cfg.precision, device);
    const StepPrecision prec{precision::compute_dtype(cfg.precision.compute), scaler ? &*scaler : nullptr};
    const LossFn loss = [&runner](const torch::Tensor& idx, const torch::Tensor& y) { return runner.loss(idx, y); };
    const double clip = opts.grad_clip.value_or(cfg.train.grad_clip);
    torch::Tensor x;
    if (!opts.loader)
      x = torch::randint(0, cfg.model.vocab_size, {opts.micro_batch.value_or(cfg.train.micro_batch), cfg.train.seq_len},
                         torch::kInt64);
    for (int i = 0; i < opts.steps; ++i) {
      const data::Batch batch = opts.loader ? opts.loader->next() : data::Batch{x, x};
      out.last = train_step({.loss = loss, .strategy = single, .opt = *opt, .tracker = tracker, .device = device,
                             .precision = prec, .grad_clip = clip},
                            {batch});
    }
  } catch (const c10::OutOfMemoryError&) {
    out.oom = true;
  }
  // The probe's model and activations are gone: their freed blocks (sizes of this micro-batch, which
  // the run may never ask for again) go back to the system rather than filling the CPU cache.
  if (memory::TrackingCPUAllocator::installed()) memory::TrackingCPUAllocator::instance().release_cached();
  return out;
}

}  // namespace sl::train
