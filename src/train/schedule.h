// Learning-rate schedule: linear warm-up to train.lr, then cosine decay to train.min_lr at the last step.
#pragma once
#include <cstdint>

#include "config/config.h"

namespace sl::train {

// Learning rate for 0-based optimizer step `step`.
double lr_at(const config::TrainConfig& t, int64_t step);

}  // namespace sl::train
