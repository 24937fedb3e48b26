// The one clock of the project's wall-time figures (step_ms, load_ms, save ms, recompute_ms, the
// budget profile's block timings): steady_clock, read in milliseconds as double. Torch-free.
#pragma once
#include <chrono>

namespace sl::log {

using Clock = std::chrono::steady_clock;

// Milliseconds from t0 to now.
inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace sl::log
