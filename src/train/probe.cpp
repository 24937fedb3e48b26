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
    const LossFn loss = [&runner](const torch::Tensor& idx, const torch::Tensor& y, const torch::Tensor& p) {
      return runner.loss(idx, y, p);
    };
    const double clip = opts.grad_clip.value_or(cfg.train.grad_clip);
    data::Batch random;
    if (!opts.loader) {
      const int64_t B = opts.micro_batch.value_or(cfg.train.micro_batch), T = cfg.train.seq_len;
      random.x = random.y = torch::randint(0, cfg.model.vocab_size, {B, T}, torch::kInt64);
      // Packed rows hold their mask whatever the examples: one example a row has the same bytes.
      if (cfg.data.packing) random.positions = torch::arange(T, torch::kInt64).expand({B, T}).contiguous();
    }
    for (int i = 0; i < opts.steps; ++i) {
      const data::Batch batch = opts.loader ? opts.loader->next() : random;
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
