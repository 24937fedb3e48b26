// Memory readings: CPU from the tracking allocator, CUDA from the caching allocator's stats.
#include "memory/tracker.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include "memory/tracking_allocator.h"

namespace sl::memory {

Tracker::Tracker(c10::Device device) : device_(device) {}

void Tracker::reset_peak() {
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
  } else if (TrackingCPUAllocator::installed()) {
    auto& a = TrackingCPUAllocator::instance();
    s.allocated_bytes = a.current_bytes();
    s.peak_allocated_bytes = a.peak_bytes();
    s.reserved_bytes = s.allocated_bytes;
  }
  return s;
}

std::string Tracker::source() const {
  if (device_.is_cuda()) return "cuda_caching_allocator";
  return TrackingCPUAllocator::installed() ? "cpu_tracking_allocator" : "untracked";
}

}  // namespace sl::memory
