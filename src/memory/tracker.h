// Device memory readings (and the host pool's, for offloaded state) with one meaning on CPU and CUDA: current and peak tensor bytes
// (the tracking CPU allocator, or CUDA's caching-allocator stats) and reserved bytes (tensors plus what the allocator holds for reuse).
#pragma once
#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace sl::memory {

struct Snapshot {
  int64_t allocated_bytes = 0;       // tensor bytes live now
  int64_t peak_allocated_bytes = 0;  // highest allocated_bytes since the last reset_peak()
  int64_t reserved_bytes = 0;        // CUDA: held by the caching allocator; CPU: allocated + the freed blocks kept for reuse
  // Host memory of offloaded state (device/host.h), from the tracking allocator's host pool.
  int64_t host_allocated_bytes = 0;
  int64_t host_peak_bytes = 0;  // since the last reset_peak()
};

// What a device can hold at most, and where that number comes from.
struct Capacity {
  int64_t bytes = 0;   // 0 = unknown
  std::string source;  // "physical memory", "cgroup memory limit", "CUDA device memory"
};
// CPU: physical memory, or the cgroup v2 limit (memory.max) when that is lower; CUDA: the device's
// total memory.
Capacity device_capacity(c10::Device device);

class Tracker {
 public:
  explicit Tracker(c10::Device device);
  void reset_peak();
  Snapshot read() const;
  // read() at the end of a step: a recording memory timeline (memory/timeline.h) closes in the same
  // reading of the peak, so the timeline's peak is this snapshot's peak_allocated_bytes.
  Snapshot close_step() const;
  // "cpu_tracking_allocator", "cuda_caching_allocator", or "untracked" (CPU without the allocator).
  std::string source() const;
  // Applies memory.limit: the tracking allocator's limit on CPU, the caching allocator's memory
  // fraction on CUDA. 0 = none.
  void set_limit(int64_t bytes);
  int64_t limit() const { return limit_; }
  // Applies memory.host_limit to the host pool. 0 = none.
  void set_host_limit(int64_t bytes);

 private:
  c10::Device device_;
  int64_t limit_ = 0;
};

}  // namespace sl::memory
