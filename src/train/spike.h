// Loss spikes (train.on_spike): a step whose loss exceeds train.spike_threshold times the moving
// average of the earlier steps' losses. The average is the mean of the first train.spike_window
// finite losses, then an exponential average of weight 1 / spike_window; every finite loss enters it
// (a spike too, so a lasting change of level stops counting as a spike after a while). No step is a
// spike before the average covers spike_window steps. The average is part of a saved training state
// (state::Counters), so a resumed run flags the same steps.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "config/config.h"
#include "state/state.h"

namespace sl::train {

struct SpikeCheck {
  bool spike = false;
  double average = NAN;  // the moving average the loss was compared with (NaN: none yet)
};

// Is `loss` a spike against the counters' average (before it takes this loss)?
inline SpikeCheck check_spike(const state::Counters& c, double loss, const config::TrainConfig& t) {
  SpikeCheck out;
  out.average = c.loss_average;
  out.spike = t.on_spike != config::OnSpike::kOff && std::isfinite(loss) && c.losses_seen >= t.spike_window &&
              loss > t.spike_threshold * c.loss_average;
  return out;
}

// The average takes `loss` (a non-finite one is left out).
inline void observe_loss(state::Counters& c, double loss, int64_t window) {
  if (!std::isfinite(loss)) return;
  c.losses_seen += 1;
  const double weight = 1.0 / static_cast<double>(std::min(c.losses_seen, window));
  c.loss_average = c.losses_seen == 1 ? loss : c.loss_average + weight * (loss - c.loss_average);
}

}  // namespace sl::train
