// Device memory readings (and the host pool's, for offloaded state) with one meaning on CPU and CUDA: current and peak
// tensor bytes (the tracking CPU allocator, or CUDA's caching-allocator stats) and reserved bytes (tensors plus what
// the allocator holds for reuse).
#pragma once
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace sl::memory {

struct Snapshot {
  int64_t allocated_bytes = 0;       // tensor bytes live now
  int64_t peak_allocated_bytes = 0;  // highest allocated_bytes since the last reset_peak()
  // CUDA: held by the caching allocator; CPU: allocated + the freed blocks kept for reuse
  int64_t reserved_bytes = 0;
  // CUDA: the highest reserved_bytes since the last reset_peak() (the headroom a real card needs above
  // the allocated peak); none on CPU, where the tracking allocator does not follow it.
  std::optional<int64_t> peak_reserved_bytes;
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
  // The highest peak_reserved_bytes of the steps closed so far (CUDA; none on CPU or before a step).
  std::optional<int64_t> steps_peak_reserved_bytes() const;
  // "cpu_tracking_allocator", "cuda_caching_allocator", or "untracked" (CPU without the allocator).
  std::string source() const;
  // Applies memory.limit, a limit on the bytes in live tensors (allocated bytes) on both devices: the
  // tracking allocator's limit on CPU, the limiting CUDA allocator's (memory/cuda_limit.h) on CUDA, which
  // leaves the bytes the caching allocator keeps reserved for reuse free to pass it. 0 = none. Throws
  // ConfigError where CUDA keeps no statistics to limit (PYTORCH_NO_CUDA_MEMORY_CACHING=1).
  void set_limit(int64_t bytes);
  int64_t limit() const { return limit_; }
  // Applies memory.host_limit to the host pool. 0 = none.
  void set_host_limit(int64_t bytes);

 private:
  c10::Device device_;
  int64_t limit_ = 0;
  mutable std::atomic<int64_t> steps_peak_reserved_{-1};  // -1: no step closed on CUDA yet
};

}  // namespace sl::memory
