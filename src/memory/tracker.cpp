// Memory readings: CPU from the tracking allocator, CUDA from the caching allocator's stats; memory.limit.
#include "memory/tracker.h"
#include <ATen/Context.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <fstream>
#include <string>

#include "memory/cuda_limit.h"
#include "memory/tracking_allocator.h"

namespace sl::memory {
namespace {

// cgroup v2's memory.max for this process's group ("max" or absent: 0 = no limit).
int64_t cgroup_limit_bytes() {
  std::ifstream in("/sys/fs/cgroup/memory.max");
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

Capacity device_capacity(c10::Device device) {
  if (device.is_cuda()) {
    size_t free = 0, total = 0;
    c10::cuda::CUDAGuard guard(device.index());
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return {static_cast<int64_t>(total), "CUDA device memory"};
  }
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  const int64_t cgroup = cgroup_limit_bytes();
  if (cgroup > 0 && cgroup < physical) return {cgroup, "cgroup memory limit"};
  return {physical, "physical memory"};
}

// CUDA: the caching allocator is made on the first CUDA tensor; its statistics refuse ("Allocator not
// initialized") before that, so the tracker initializes the device first.
Tracker::Tracker(c10::Device device) : device_(device) {
  if (device_.is_cuda()) at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
}

void Tracker::reset_peak() {
  if (TrackingCPUAllocator::installed()) {
    TrackingCPUAllocator::instance().reset_host_peak();
    TrackingCPUAllocator::instance().clear_refusal();  // what an out-of-memory report reads is this step's
  }
  if (device_.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
  } else {
    TrackingCPUAllocator::instance().reset_peak();
  }
}

Snapshot Tracker::read() const {
  Snapshot s;
  if (device_.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    s.allocated_bytes = stats.allocated_bytes[all].current;
    s.peak_allocated_bytes = stats.allocated_bytes[all].peak;
    s.reserved_bytes = stats.reserved_bytes[all].current;
    s.peak_reserved_bytes = stats.reserved_bytes[all].peak;
  } else if (TrackingCPUAllocator::installed()) {
    auto& a = TrackingCPUAllocator::instance();
    s.allocated_bytes = a.current_bytes();
    s.peak_allocated_bytes = a.peak_bytes();
    s.reserved_bytes = s.allocated_bytes + a.cached_bytes();  // and the freed blocks kept for reuse
  }
  if (TrackingCPUAllocator::installed()) {
    auto& a = TrackingCPUAllocator::instance();
    s.host_allocated_bytes = a.host_current_bytes();
    s.host_peak_bytes = a.host_peak_bytes();
  }
  return s;
}

Snapshot Tracker::close_step() const {
  Snapshot s = read();
  if (!device_.is_cuda() && TrackingCPUAllocator::installed())
    s.peak_allocated_bytes = TrackingCPUAllocator::instance().peak_bytes_closing_timeline();
  if (s.peak_reserved_bytes) {
    int64_t seen = steps_peak_reserved_.load();
    while (*s.peak_reserved_bytes > seen && !steps_peak_reserved_.compare_exchange_weak(seen, *s.peak_reserved_bytes)) {
    }
  }
  return s;
}

std::optional<int64_t> Tracker::steps_peak_reserved_bytes() const {
  const int64_t peak = steps_peak_reserved_.load();
  return peak >= 0 ? std::optional<int64_t>(peak) : std::nullopt;
}

void Tracker::set_limit(int64_t bytes) {
  if (device_.is_cuda()) {
    set_cuda_limit(device_.index(), bytes);
  } else {
    TrackingCPUAllocator::instance().set_limit(bytes);
  }
  limit_ = bytes;
}

void Tracker::set_host_limit(int64_t bytes) { TrackingCPUAllocator::instance().set_host_limit(bytes); }

std::string Tracker::source() const {
  if (device_.is_cuda()) return "cuda_caching_allocator";
  return TrackingCPUAllocator::installed() ? "cpu_tracking_allocator" : "untracked";
}

}  // namespace sl::memory
