// Tracking CPU allocator: c10::alloc_cpu/free_cpu plus a size table, current/peak counters and a
// cache of freed blocks by size.
#include "memory/tracking_allocator.h"

#include <cstdlib>
#include <new>
#include <string>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "device/host.h"
#include "memory/timeline.h"

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
  // Page-locked blocks the device layer makes itself (state.async's snapshot on CUDA) join the host pool.
  device::set_external_host_bytes({[](int64_t b) { instance().add_host_external(b); },
                                   [](int64_t b) { instance().remove_host_external(b); },
                                   [](int64_t b) { instance().note_host_refused(b); }});
}

bool TrackingCPUAllocator::installed() { return g_installed.load(); }

void TrackingCPUAllocator::count(std::atomic<int64_t>& current, std::atomic<int64_t>& peak, int64_t bytes) {
  const int64_t now = current.fetch_add(bytes) + bytes;
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

c10::DataPtr TrackingCPUAllocator::allocate(size_t nbytes) {
  if (nbytes == 0) return {nullptr, nullptr, &free_block, c10::Device(c10::DeviceType::CPU)};
  const bool host = device::HostScope::active();
  auto& current = host ? host_current_ : current_;
  const int64_t limit = (host ? host_limit_ : limit_).load();
  if (limit > 0 && current.load() + static_cast<int64_t>(nbytes) > limit) {
    refused_.store(static_cast<int64_t>(nbytes));
    refused_host_.store(host);
    TORCH_CHECK_WITH(OutOfMemoryError, false, host ? "host" : "CPU",
                     " out of memory (simulated limit): tried to allocate ", nbytes, " bytes with ", current.load(),
                     " of the ", limit, "-byte ", host ? "memory.host_limit" : "memory.limit", " in use");
  }
  void* ptr = take_cached(nbytes);
  if (ptr == nullptr) ptr = system_alloc(nbytes, host);
  {
    std::lock_guard<std::mutex> lock(mu_);  // counted inside it: a timeline sees the counters' order
    Block* entry = nullptr;
    try {
      entry = &blocks_[ptr];
    } catch (...) {  // no room for the table's entry: the block goes back rather than leaking
      c10::free_cpu(ptr);
      throw;
    }
    Block& b = *entry;
    b = {nbytes, host, 0};
    count(current, host ? host_peak_ : peak_, static_cast<int64_t>(nbytes));
    count(live_now_, live_peak_, static_cast<int64_t>(nbytes));
    if (auto& timeline = Timeline::instance(); timeline.on())
      b.timeline_id = timeline.on_alloc(static_cast<int64_t>(nbytes), host);
  }
  allocs_.fetch_add(1);
  return {ptr, ptr, &free_block, c10::Device(c10::DeviceType::CPU)};
}

void TrackingCPUAllocator::add_host_external(int64_t bytes) {
  const int64_t limit = host_limit_.load();
  if (limit > 0 && host_current_.load() + bytes > limit) {
    note_host_refused(bytes);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "host out of memory: tried to allocate ", bytes,
                     " bytes of page-locked memory with ", host_current_.load(), " of the ", limit,
                     "-byte memory.host_limit in use");
  }
  std::lock_guard<std::mutex> lock(mu_);  // counted inside it, in the order allocate() counts
  count(host_current_, host_peak_, bytes);
}

void* TrackingCPUAllocator::take_cached(size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = cache_.find(nbytes);
  if (it == cache_.end() || it->second.empty()) return nullptr;  // empty: a keep() that ran out of memory
  void* ptr = it->second.back();
  it->second.pop_back();
  if (it->second.empty()) cache_.erase(it);
  cached_.fetch_sub(static_cast<int64_t>(nbytes));
  return ptr;
}

// c10's allocation (64-byte aligned); when the system refuses, once more after the cache is handed back.
void* TrackingCPUAllocator::system_alloc(size_t nbytes, bool host) {
  try {
    return c10::alloc_cpu(nbytes);
  } catch (const c10::Error&) {
    release_cached();
  }
  try {
    return c10::alloc_cpu(nbytes);
  } catch (const c10::Error& e) {  // the system refused: the same exception as a CUDA OOM (exit 4)
    refused_.store(static_cast<int64_t>(nbytes));
    refused_host_.store(host);
    TORCH_CHECK_WITH(OutOfMemoryError, false, host ? "host" : "CPU", " out of memory: the system refused ", nbytes,
                     " bytes with ", current_.load() + host_current_.load(), " bytes of tensors allocated (",
                     e.what_without_backtrace(), ")");
  }
}

bool TrackingCPUAllocator::keep(void* ptr, size_t nbytes) {
  static const bool off = [] {
    const char* v = std::getenv("SUBLINEAR_NO_CPU_CACHE");
    return v != nullptr && std::string(v) == "1";
  }();
  if (off || cached_.load() + static_cast<int64_t>(nbytes) > live_peak_.load()) return false;
  try {  // called from a deleter, which must not throw: without room for the entry, free the block
    cache_[nbytes].push_back(ptr);
  } catch (const std::bad_alloc&) {
    return false;
  }
  cached_.fetch_add(static_cast<int64_t>(nbytes));
  return true;
}

void TrackingCPUAllocator::release_cached() {
  std::unordered_map<size_t, std::vector<void*>> blocks;  // taken whole: no allocation while memory is short
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(cache_);
    cached_.store(0);
  }
  for (const auto& [bytes, ptrs] : blocks)
    for (void* ptr : ptrs) c10::free_cpu(ptr);
}

void TrackingCPUAllocator::free_block(void* ptr) {
  if (ptr == nullptr) return;
  auto& self = instance();
  bool kept = false;
  {
    std::lock_guard<std::mutex> lock(self.mu_);
    auto it = self.blocks_.find(ptr);
    if (it != self.blocks_.end()) {
      const Block b = it->second;
      self.blocks_.erase(it);
      (b.host ? self.host_current_ : self.current_).fetch_sub(static_cast<int64_t>(b.bytes));
      self.live_now_.fetch_sub(static_cast<int64_t>(b.bytes));
      if (auto& timeline = Timeline::instance(); timeline.on())
        timeline.on_free(b.timeline_id, static_cast<int64_t>(b.bytes), b.host);
      kept = self.keep(ptr, b.bytes);
    }
  }
  if (!kept) c10::free_cpu(ptr);
}

std::vector<LiveBlock> TrackingCPUAllocator::live_blocks() const {
  std::vector<LiveBlock> out;
  out.reserve(blocks_.size());
  for (const auto& [ptr, b] : blocks_) out.push_back({ptr, static_cast<int64_t>(b.bytes), b.host, b.timeline_id});
  return out;
}

void TrackingCPUAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_.store(current_.load());
  auto& timeline = Timeline::instance();
  if (!timeline.on() || timeline.recording()) return;
  timeline.begin(live_blocks(), current_.load(), host_current_.load());  // the i-th block gets id i
  uint32_t id = 0;
  for (auto& entry : blocks_) entry.second.timeline_id = id++;  // the same order: the map is unchanged
}

int64_t TrackingCPUAllocator::peak_bytes_closing_timeline() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t peak = peak_.load();
  if (auto& timeline = Timeline::instance(); timeline.recording())
    timeline.end(live_blocks(), current_.load(), host_current_.load(), peak);
  return peak;
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
