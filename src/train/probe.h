// A probe step: the trainer's own step, run on a fresh model to see what it takes. It builds a
// model::GPT on the device (seeded), a recompute::Runner over it with the given plan, AdamW
// (make_optimizer), a memory::Tracker and the recipe's compute precision (with a LossScaler unless told
// not to), then runs train_step `steps` times (the first creates the optimizer state) on one
// micro-batch each and returns the last step's StepResult, or oom = true when c10::OutOfMemoryError was
// thrown. Everything it allocates is freed on return. Used by train.micro_batch: auto
// (micro_batch_fits) and by the tests that measure a step's peak (tests/measure.h, test_planner).
#pragma once
#include <cstdint>
#include <optional>

#include <c10/core/Device.h>

#include "recompute/plan.h"
#include "config/config.h"
#include "data/loader.h"
#include "train/trainer.h"

namespace sl::train {

struct ProbeOptions {
  c10::Device device{c10::kCPU};
  bool loss_scaler = true;          // a precision::LossScaler for the recipe (it scales only under fp16)
  std::optional<double> grad_clip = std::nullopt;  // nullopt: the recipe's train.grad_clip
  // torch::manual_seed just before the model is built; nullopt: train.seed
  std::optional<uint64_t> seed = std::nullopt;
  int steps = 2;
  // Where the micro-batches come from: one next() per step, just before it; null: random tokens,
  // (train.micro_batch, train.seq_len), drawn once after the set-up and used as inputs and targets.
  data::Loader* loader = nullptr;
  std::optional<int64_t> micro_batch = std::nullopt;  // the random tokens' batch; nullopt: train.micro_batch
};

struct ProbeResult {
  bool oom = false;
  int64_t allocated_before = 0;  // the tracker's allocated bytes before the model was built
  StepResult last;               // the last step's (meaningless when oom)
};

ProbeResult probe_step(const config::RunConfig& cfg, const recompute::Plan& plan, const ProbeOptions& opts = {});

}  // namespace sl::train
