// train.micro_batch: auto: probe micro-batches with real steps of a fresh model, bisecting over the
// divisors of the per-rank batch from the planner's guess.

#include <torch/torch.h>

#include "predict/budget.h"
#include "predict/planner.h"
#include "train/probe.h"
#include "train/trainer.h"

namespace sl::train {

bool micro_batch_fits(const config::RunConfig& cfg, int64_t micro_batch, torch::Device device) {
  // budget: this micro-batch's schedule (formula costs)
  const auto plan = budget::try_plan_for(memory::Scenario::of(cfg).at(micro_batch));
  if (!plan) return false;
  // train.seed, train.grad_clip, a loss scaler
  return !probe_step(cfg, *plan, {.device = device, .micro_batch = micro_batch}).oom;
}

BatchSearch find_micro_batch(const config::RunConfig& cfg, int64_t global, torch::Device device) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= global; ++d)
    if (global % d == 0) divisors.push_back(d);
  BatchSearch r;
  const int64_t limit = cfg.memory.limit.bytes;
  r.predicted = limit > 0 ? planner::largest_micro_batch(memory::Scenario::of(cfg).at(1), limit, global) : global;
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

}  // namespace sl::train
