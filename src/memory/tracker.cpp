// Memory readings: CPU from the tracking allocator, CUDA from the caching allocator's stats.
#include "memory/tracker.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>

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

void Tracker::set_limit(int64_t bytes) {
  limit_ = bytes;
  if (device_.is_cuda()) {
    if (bytes <= 0) return;
    c10::cuda::CUDAGuard guard(device_.index());
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total)),
                                                       device_.index());
  } else {
    TrackingCPUAllocator::instance().set_limit(bytes);
  }
}

std::string Tracker::source() const {
  if (device_.is_cuda()) return "cuda_caching_allocator";
  return TrackingCPUAllocator::installed() ? "cpu_tracking_allocator" : "untracked";
}

}  // namespace sl::memory
