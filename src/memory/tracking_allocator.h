// Tracking CPU allocator: replaces LibTorch's CPU allocator so that current and peak tensor bytes
// on CPU are exact, the way CUDA's caching-allocator stats are on a GPU.
// Two pools: what is allocated while a device::HostScope is open (device/host.h: offloaded state)
// is host memory, counted and limited (memory.host_limit) apart; everything else is the simulated
// device memory that memory.limit caps.
// Freed blocks are kept for reuse by exact size (a training step frees and asks again for the same
// sizes; for the large ones glibc's malloc searched and consolidated its bins and the kernel faulted
// their pages in again, step after step). They count in neither pool (the counters and the limits are
// tensor bytes); the cache holds at most the largest number of tensor bytes of both pools ever live
// at once, so it never makes the process hold more than twice its peak. An allocation the system
// refuses empties the cache and tries again. SUBLINEAR_NO_CPU_CACHE=1 (read once, at the first free)
// turns it off, for memory checkers that want every free to reach malloc.
// It cannot see memory that bypasses c10's CPU allocator: oneDNN/BLAS scratch buffers, tensors made
// with from_blob, pinned host memory, communication buffers, and tensors allocated before install();
// page-locked memory that the project allocates itself is added to the host pool (add_host_external).
// While a memory timeline records (memory/timeline.h), every allocation and free of both pools is
// also told to it, inside the same lock that orders the counters; otherwise its cost is one relaxed load.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>

namespace sl::memory {

struct LiveBlock;

class TrackingCPUAllocator final : public c10::Allocator {
 public:
  // The process-wide instance (static lifetime, as c10 requires).
  static TrackingCPUAllocator& instance();
  // Makes it LibTorch's CPU allocator (priority 1 beats the default), and the counter of the page-locked
  // memory the device layer allocates itself (device::set_external_host_bytes). Idempotent.
  static void install();
  static bool installed();

  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // The device pool (what memory.limit caps).
  int64_t current_bytes() const { return current_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  int64_t num_allocs() const { return allocs_.load(); }
  // Bytes of freed blocks kept for reuse, and handing them all back to the system.
  int64_t cached_bytes() const { return cached_.load(); }
  void release_cached();
  // The device pool's peak restarts from its current bytes; an armed memory timeline starts here.
  void reset_peak();
  // The device pool's peak since reset_peak(); a recording memory timeline ends here, in the same
  // lock, so its replayed peak is this value.
  int64_t peak_bytes_closing_timeline();
  // Runs `f` inside the lock every allocation and free takes: arming and disarming a memory timeline
  // (memory/timeline.h) there, no other thread is recording into it at the same time.
  template <class F>
  void locked(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    f();
  }
  // A simulated device-memory limit: an allocation that would take current bytes past it throws
  // c10::OutOfMemoryError, as CUDA does. 0 = none.
  void set_limit(int64_t bytes) { limit_.store(bytes); }
  int64_t limit() const { return limit_.load(); }
  int64_t last_refused_bytes() const { return refused_.load(); }  // size of the last refused request
  bool last_refused_host() const { return refused_host_.load(); }   // ... and whether it was a host one
  void clear_refusal() { refused_.store(0), refused_host_.store(false); }  // a new step: no refusal yet

  // The host pool, and its limit (memory.host_limit; 0 = none).
  int64_t host_current_bytes() const { return host_current_.load(); }
  int64_t host_peak_bytes() const { return host_peak_.load(); }
  void reset_host_peak() { host_peak_.store(host_current_.load()); }
  void set_host_limit(int64_t bytes) { host_limit_.store(bytes); }
  // Host memory that c10's CPU allocator does not make (state.async's page-locked snapshot on CUDA,
  // device/host.h), counted in the host pool all the same: add_host_external refuses bytes that would
  // take the pool past memory.host_limit as allocate() does (c10::OutOfMemoryError, recorded as the
  // last refusal, in the host pool), else counts them (current and peak); remove_host_external gives
  // them back. note_host_refused records a refusal the system made. A memory timeline does not see
  // these bytes (it records CPU runs, which make none).
  void add_host_external(int64_t bytes);
  void remove_host_external(int64_t bytes) { host_current_.fetch_sub(bytes); }
  void note_host_refused(int64_t bytes) { refused_.store(bytes), refused_host_.store(true); }

 private:
  static void free_block(void* ptr);
  struct Block {
    size_t bytes = 0;
    bool host = false;
    uint32_t timeline_id = 0;  // the block's id in a recording memory timeline
  };
  std::vector<LiveBlock> live_blocks() const;  // call under mu_
  static void count(std::atomic<int64_t>& current, std::atomic<int64_t>& peak, int64_t bytes);
  void* take_cached(size_t nbytes);      // a kept block of exactly nbytes, or null
  bool keep(void* ptr, size_t nbytes);   // call under mu_: whether the block went into the cache
  void* system_alloc(size_t nbytes, bool host);
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::unordered_map<size_t, std::vector<void*>> cache_;  // freed blocks by size, the last freed last
  std::atomic<int64_t> cached_{0}, live_now_{0}, live_peak_{0};  // live: both pools' tensor bytes
  std::atomic<int64_t> current_{0}, peak_{0}, allocs_{0}, limit_{0}, refused_{0};
  std::atomic<int64_t> host_current_{0}, host_peak_{0}, host_limit_{0};
  std::atomic<bool> refused_host_{false};
};

// Whether a c10::Error is an allocation the system refused (LibTorch's default CPU allocator reports it
// as a plain c10::Error, "can't allocate memory", when the tracking allocator is not installed).
bool is_allocation_failure(const c10::Error& e);

}  // namespace sl::memory
