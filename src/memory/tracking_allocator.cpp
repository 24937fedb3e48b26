// Tracking CPU allocator: c10::alloc_cpu/free_cpu plus a size table and current/peak counters.
#include "memory/tracking_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

namespace sl::memory {

namespace {
std::atomic<bool> g_installed{false};
}

TrackingCPUAllocator& TrackingCPUAllocator::instance() {
  static TrackingCPUAllocator* alloc = new TrackingCPUAllocator();  // never destroyed: tensors may outlive main
  return *alloc;
}

void TrackingCPUAllocator::install() {
  if (g_installed.exchange(true)) return;
  c10::SetCPUAllocator(&instance(), /*priority=*/1);
}

bool TrackingCPUAllocator::installed() { return g_installed.load(); }

c10::DataPtr TrackingCPUAllocator::allocate(size_t nbytes) {
  if (nbytes == 0) return {nullptr, nullptr, &free_block, c10::Device(c10::DeviceType::CPU)};
  const int64_t limit = limit_.load();
  if (limit > 0 && current_.load() + static_cast<int64_t>(nbytes) > limit) {
    refused_.store(static_cast<int64_t>(nbytes));
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory (simulated limit): tried to allocate ", nbytes,
                     " bytes with ", current_.load(), " of the ", limit, "-byte memory.limit in use");
  }
  void* ptr = nullptr;
  try {
    ptr = c10::alloc_cpu(nbytes);
  } catch (const c10::Error& e) {  // the system refused: the same exception as a CUDA OOM (exit 4)
    refused_.store(static_cast<int64_t>(nbytes));
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: the system refused ", nbytes, " bytes with ",
                     current_.load(), " bytes of tensors allocated (", e.what_without_backtrace(), ")");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[ptr] = nbytes;
  }
  int64_t now = current_.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  allocs_.fetch_add(1);
  return {ptr, ptr, &free_block, c10::Device(c10::DeviceType::CPU)};
}

void TrackingCPUAllocator::free_block(void* ptr) {
  if (ptr == nullptr) return;
  auto& self = instance();
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(self.mu_);
    auto it = self.sizes_.find(ptr);
    if (it != self.sizes_.end()) {
      n = it->second;
      self.sizes_.erase(it);
    }
  }
  self.current_.fetch_sub(static_cast<int64_t>(n));
  c10::free_cpu(ptr);
}

c10::DeleterFnPtr TrackingCPUAllocator::raw_deleter() const { return &free_block; }

void TrackingCPUAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

bool is_allocation_failure(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  return what.find("can't allocate memory") != std::string::npos || what.find("out of memory") != std::string::npos;
}

}  // namespace sl::memory
