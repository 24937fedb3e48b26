// Device memory readings with one meaning on CPU and CUDA: current and peak tensor bytes
// (the tracking CPU allocator, or CUDA's caching-allocator stats) and reserved bytes (CUDA only).
#pragma once
#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace sl::memory {

struct Snapshot {
  int64_t allocated_bytes = 0;       // tensor bytes live now
  int64_t peak_allocated_bytes = 0;  // highest allocated_bytes since the last reset_peak()
  int64_t reserved_bytes = 0;        // CUDA: held by the caching allocator; CPU: equal to allocated
};

class Tracker {
 public:
  explicit Tracker(c10::Device device);
  void reset_peak();
  Snapshot read() const;
  // "cpu_tracking_allocator", "cuda_caching_allocator", or "untracked" (CPU without the allocator).
  std::string source() const;

 private:
  c10::Device device_;
};

}  // namespace sl::memory
