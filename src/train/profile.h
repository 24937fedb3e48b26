// logging.profile_step: one optimizer step recorded by LibTorch's profiler (Kineto: every ATen op on
// the host, and the device's kernels on CUDA), saved as a Chrome trace (chrome://tracing, Perfetto;
// bench/profile_breakdown.py sums it by kind of work).
#pragma once
#include <memory>
#include <string>

#include <torch/types.h>

namespace sl::train {

class StepProfiler {
 public:
  // Starts recording on this thread (and the autograd threads it feeds) when `on`.
  StepProfiler(bool on, torch::Device device);
  ~StepProfiler();  // stops recording if save() was not called
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  bool on() const { return on_; }
  // Stops recording and writes the trace to `path`; returns the number of events recorded. Throws
  // IoError when the file cannot be written.
  int64_t save(const std::string& path);

 private:
  bool on_ = false;
};

}  // namespace sl::train
