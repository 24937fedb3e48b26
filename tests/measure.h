// The trainer's own step, measured: activation_peak_bytes of the second of two optimizer steps (the
// first one creates the optimizer state) of a fresh model under a checkpointing plan, in the recipe's
// compute precision, with the tracking allocator. Shared by the recompute and budget tests.
#pragma once
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "memory/tracker.h"
#include "memory/tracking_allocator.h"
#include "model/gpt.h"
#include "precision/autocast.h"
#include "recompute/policy.h"
#include "train/trainer.h"

namespace sl::test {

inline int64_t measured_activation_peak(const config::RunConfig& cfg, const recompute::Plan& plan) {
  memory::TrackingCPUAllocator::install();
  // Tensors the caller still holds from earlier tracked allocations (e.g. another run's gradients) are
  // neither model states nor this step's activations.
  const int64_t held_outside = memory::TrackingCPUAllocator::instance().current_bytes();
  torch::manual_seed(0);
  model::GPT m(cfg.model, torch::kCPU);
  recompute::Policy policy(cfg.checkpointing, m, plan);
  auto opt = train::make_optimizer(m, cfg.train);
  memory::Tracker tracker(torch::kCPU);
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(20000, cfg.model.vocab_size, 5);
  data::Loader loader(src, cfg.train.micro_batch, cfg.train.seq_len, 9);
  const train::ForwardFn fwd = [&](const torch::Tensor& idx) { return policy.forward(idx); };
  train::StepResult r;
  const train::StepPrecision precision{precision::compute_dtype(cfg.precision.compute), nullptr};  // bf16: no scaler
  for (int i = 0; i < 2; ++i) r = train::train_step(fwd, m, *opt, {loader.next()}, 1.0, torch::kCPU, tracker, precision);
  return r.activation_peak_bytes() - held_outside;
}

}  // namespace sl::test
