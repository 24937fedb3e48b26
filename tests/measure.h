// The trainer's own step, measured: activation_peak_bytes of the second of two optimizer steps (the
// first one creates the optimizer state) of a fresh model under a checkpointing plan, in the recipe's
// compute precision, with the tracking allocator: a probe step (train/probe.h) on the CPU, seed 0,
// grad_clip 1.0, no loss scaler, batches from a synthetic loader, less the micro-batch's tokens. Shared by the
// recompute and budget tests.
#pragma once
#include <memory>

#include "catch.h"

#include "config/config.h"
#include "data/loader.h"
#include "memory/tracking_allocator.h"
#include "recompute/plan.h"
#include "train/probe.h"

namespace sl::test {

inline int64_t measured_activation_peak(const config::RunConfig& cfg, const recompute::Plan& plan) {
  memory::TrackingCPUAllocator::install();
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(20000, cfg.model.vocab_size, 5);
  data::Loader loader(src, cfg.train.micro_batch, cfg.train.seq_len, 9);
  // bf16: no scaler. Tensors the caller still holds from earlier tracked allocations (e.g. another run's
  // gradients) are neither model states nor this step's activations: allocated_before.
  const auto r = train::probe_step(cfg, plan, {.loss_scaler = false, .grad_clip = 1.0, .seed = 0, .loader = &loader});
  REQUIRE_FALSE(r.oom);
  // The step's tokens (inputs and targets, int64) are in the allocator's peak; the planner counts them
  // apart from the activations (its batch_bytes), as the budget leaves them out.
  const int64_t batch = 2 * 8 * cfg.train.micro_batch * cfg.train.seq_len;
  return r.last.activation_peak_bytes() - r.allocated_before - batch;
}

}  // namespace sl::test
