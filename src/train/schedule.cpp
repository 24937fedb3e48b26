// Warm-up + cosine learning-rate schedule.
#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace sl::train {

double lr_at(const config::TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  const int64_t decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  const double progress =
      std::clamp(static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps - 1), 0.0, 1.0);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace sl::train
