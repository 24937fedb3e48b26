// memory.limit on CUDA: a limit on the bytes in live tensors (the caching allocator's allocated bytes,
// what Tracker::read reports and the planner predicts), the meaning the tracking CPU allocator gives it
// on CPU. The bytes the caching allocator keeps reserved for reuse, the CUDA context and NCCL's buffers
// are outside it, as they are outside the planner's figures.
//
// It is enforced by a CUDA allocator that stands in for LibTorch's (c10::cuda::CUDACachingAllocator::
// allocator, which every CUDA tensor's storage is allocated through: at::detail::empty_cuda asks
// at::cuda::getCUDADeviceAllocator(), which loads that pointer; and c10::GetAllocator(kCUDA)). It forwards
// every call to the allocator it replaced and hands out that allocator's own DataPtrs (their deleter
// is the native one, which recordStream and the frees check), except that an allocation (allocate,
// raw_alloc, raw_alloc_with_stream) on a device with a limit is admitted by AllocatedLimit::admit.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

namespace sl::memory {

// The admission of one allocation against a limit on allocated bytes, apart from CUDA so that it runs
// under test on CPU.
//
// The caching allocator counts a block's size: the request rounded up (to a multiple of 512 bytes, or
// further by PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions) and, when it hands out a cached block
// whole rather than split, larger still. The allocated bytes grow by more than the request, by an
// amount only the allocator's private rules bound, so the exact allocated bytes are read after each
// allocation (one statistics read: a lock and a copy of the device's counters, beside the allocator's
// own lock and search), and an allocation that took them past the limit is given back and refused.
// A request the exact bytes refuse already (a block is at least its request) is refused before it is
// made; that second read is taken only when the bytes after the last admitted allocation (an upper
// bound of the bytes now, from one thread: only frees came since) plus the request pass the limit.
// Refusal: c10::OutOfMemoryError (what CUDA throws when the device is full, and what the trainer turns
// into exit 4 with an `oom` event). Concurrent threads: each allocation is checked against the exact
// bytes after it, so no admitted allocation leaves them past the limit; the allocator's peak may count
// a block that was then given back.
class AllocatedLimit {
 public:
  void set(int64_t bytes) { limit_.store(bytes); }  // 0 = none
  int64_t limit() const { return limit_.load(); }

  // `take()` allocates `n` bytes on CUDA device `device` and returns the handle that owns them,
  // `give_back(handle)` frees it, `allocated()` reads the device's exact allocated bytes. Returns take()'s
  // handle, or throws c10::OutOfMemoryError when the allocation would pass the limit.
  template <class Take, class GiveBack, class Read>
  auto admit(size_t n, c10::DeviceIndex device, Take&& take, GiveBack&& give_back, Read&& allocated) {
    const int64_t limit = limit_.load(std::memory_order_relaxed);
    if (limit <= 0 || n == 0) return take();
    const auto request = static_cast<int64_t>(n);
    if (last_admitted_.load(std::memory_order_relaxed) + request > limit) {
      // A block is at least the request: past the limit before it is made.
      if (const int64_t now = allocated(); now + request > limit) refuse(device, request, now + request, limit);
    }
    auto handle = take();
    const int64_t after = allocated();
    if (after > limit) {
      give_back(handle);
      refuse(device, request, after, limit);
    }
    last_admitted_.store(after, std::memory_order_relaxed);
    return handle;
  }

 private:
  [[noreturn]] static void refuse(c10::DeviceIndex device, int64_t request, int64_t reaching, int64_t limit);
  std::atomic<int64_t> limit_{0};
  std::atomic<int64_t> last_admitted_{0};  // exact allocated bytes after the last admitted allocation
};

// Sets memory.limit for CUDA device `device` (0 = none). The first limit above 0 puts the limiting
// allocator in place of the one LibTorch uses for CUDA (once per process; it stays, and with no limit
// it only forwards). Throws ConfigError (exit 2) when the caching allocator keeps no statistics
// (PYTORCH_NO_CUDA_MEMORY_CACHING=1).
void set_cuda_limit(c10::DeviceIndex device, int64_t bytes);

}  // namespace sl::memory
