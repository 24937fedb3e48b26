// memory.limit on CUDA: the limiting allocator that stands in for LibTorch's CUDA allocator.
#include "memory/cuda_limit.h"

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/env.h>
#include <fmt/format.h>

#include "errors.h"

namespace sl::memory {

void AllocatedLimit::refuse(c10::DeviceIndex device, int64_t request, int64_t reaching, int64_t limit) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA device ", static_cast<int>(device),
                   " out of memory (memory.limit): allocating ", request,
                   " bytes would take the bytes in live tensors to at least ", reaching, ", past the ", limit,
                   "-byte memory.limit");
}

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;

// The allocator LibTorch's CUDA tensors are allocated through while a limit may be set: every call
// goes to `native_` (the allocator it replaced); allocate, raw_alloc and raw_alloc_with_stream are
// admitted by the current device's AllocatedLimit first. Made once, never destroyed (storages keep
// a pointer to the allocator that made them).
class LimitingAllocator final : public cca::CUDAAllocator {
 public:
  explicit LimitingAllocator(cca::CUDAAllocator* native) : native_(native) {}

  void set_limit(DeviceIndex device, int64_t bytes) { limits_.at(static_cast<size_t>(device)).set(bytes); }

  // ---- the admitted allocations ----
  c10::DataPtr allocate(size_t n) override {
    const DeviceIndex device = c10::cuda::current_device();
    return limits_[static_cast<size_t>(device)].admit(
        n, device, [&] { return native_->allocate(n); }, [](c10::DataPtr& p) { p.clear(); },
        [&] { return allocated(device); });
  }
  void* raw_alloc(size_t n) override {
    return admit_raw(n, [&] { return native_->raw_alloc(n); });
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    return admit_raw(n, [&] { return native_->raw_alloc_with_stream(n, stream); });
  }

  // ---- c10::Allocator and c10::DeviceAllocator: forwarded ----
  bool is_simple_data_ptr(const c10::DataPtr& p) const override { return native_->is_simple_data_ptr(p); }
  c10::DeleterFnPtr raw_deleter() const override { return native_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    native_->copy_data(dest, src, count);
  }
  bool initialized() override { return native_->initialized(); }
  void emptyCache(MempoolId_t id = {0, 0}) override { native_->emptyCache(id); }
  void recordStream(const c10::DataPtr& p, c10::Stream stream) override { native_->recordStream(p, stream); }
  cca::DeviceStats getDeviceStats(DeviceIndex d) override { return native_->getDeviceStats(d); }
  void resetAccumulatedStats(DeviceIndex d) override { native_->resetAccumulatedStats(d); }
  void resetPeakStats(DeviceIndex d) override { native_->resetPeakStats(d); }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex d) override { return native_->getMemoryInfo(d); }

  // ---- CUDAAllocator: forwarded ----
  void raw_delete(void* ptr) override { native_->raw_delete(ptr); }
  void init(int device_count) override { native_->init(device_count); }
  double getMemoryFraction(DeviceIndex d) override { return native_->getMemoryFraction(d); }
  void setMemoryFraction(double fraction, DeviceIndex d) override { native_->setMemoryFraction(fraction, d); }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex d) override {
    return native_->getExpandableSegmentSizes(d);
  }
  void enable(bool value) override { native_->enable(value); }
  bool isEnabled() const override { return native_->isEnabled(); }
  void cacheInfo(DeviceIndex d, size_t* largest) override { native_->cacheInfo(d, largest); }
  void* getBaseAllocation(void* ptr, size_t* size) override { return native_->getBaseAllocation(ptr, size); }
  void recordStream(const c10::DataPtr& p, c10::cuda::CUDAStream stream) override { native_->recordStream(p, stream); }
  cca::SnapshotInfo snapshot(MempoolId_t id = {0, 0}, bool include_traces = true) override {
    return native_->snapshot(id, include_traces);
  }
  void beginAllocateToPool(DeviceIndex d, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
    native_->beginAllocateToPool(d, id, std::move(filter));
  }
  void endAllocateToPool(DeviceIndex d, MempoolId_t id) override { native_->endAllocateToPool(d, id); }
  void releasePool(DeviceIndex d, MempoolId_t id) override { native_->releasePool(d, id); }
  int getPoolUseCount(DeviceIndex d, MempoolId_t id) override { return native_->getPoolUseCount(d, id); }
  void createOrIncrefPool(DeviceIndex d, MempoolId_t id, std::shared_ptr<cca::CUDAAllocator> a = nullptr) override {
    native_->createOrIncrefPool(d, id, std::move(a));
  }
  void setUseOnOOM(DeviceIndex d, MempoolId_t id, bool use_on_oom) override { native_->setUseOnOOM(d, id, use_on_oom); }
  void setNoSplit(DeviceIndex d, MempoolId_t id) override { native_->setNoSplit(d, id); }
  bool checkPoolLiveAllocations(DeviceIndex d, MempoolId_t id, const std::unordered_set<void*>& live) override {
    return native_->checkPoolLiveAllocations(d, id, live);
  }
  cca::ShareableHandle shareIpcHandle(void* ptr) override { return native_->shareIpcHandle(ptr); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return native_->getIpcDevPtr(std::move(handle)); }
  bool isHistoryEnabled() override { return native_->isHistoryEnabled(); }
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                     bool clear, const std::vector<std::string>& skip_actions) override {
    native_->recordHistory(enabled, recorder, max_entries, when, clear, skip_actions);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    native_->recordAnnotation(md);
  }
  void pushCompileContext(std::string& md) override { native_->pushCompileContext(md); }
  void popCompileContext() override { native_->popCompileContext(); }
  void setUserMetadata(const std::string& md) override { native_->setUserMetadata(md); }
  std::string getUserMetadata() override { return native_->getUserMetadata(); }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    native_->attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    native_->attachAllocatorTraceTracker(std::move(tracker));
  }
  void enablePeerAccess(DeviceIndex dev, DeviceIndex to) override { native_->enablePeerAccess(dev, to); }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count, cudaStream_t stream,
                          bool p2p_enabled) override {
    return native_->memcpyAsync(dst, dst_device, src, src_device, count, stream, p2p_enabled);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex d, MempoolId_t id) override {
    return native_->getCheckpointState(d, id);
  }
  cca::CheckpointDelta setCheckpointPoolState(DeviceIndex d, std::shared_ptr<cca::AllocatorState> pps) override {
    return native_->setCheckpointPoolState(d, std::move(pps));
  }
  std::string name() override { return native_->name(); }  // code that asks for "native" still finds it

 private:
  int64_t allocated(DeviceIndex d) {
    return native_->getDeviceStats(d)
        .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .current;
  }

  // raw_alloc's pointer is owned (given back on refusal, or if the reading throws) until admitted.
  template <class Take>
  void* admit_raw(size_t n, Take&& take) {
    const DeviceIndex device = c10::cuda::current_device();
    auto give = [this](void* p) { native_->raw_delete(p); };
    using Owned = std::unique_ptr<void, decltype(give)>;
    Owned owned = limits_[static_cast<size_t>(device)].admit(
        n, device, [&] { return Owned(take(), give); }, [](Owned& p) { p.reset(); },
        [&] { return allocated(device); });
    return owned.release();
  }

  cca::CUDAAllocator* native_;
  std::array<AllocatedLimit, C10_COMPILE_TIME_MAX_GPUS> limits_;
};

// The limiting allocator, put in place of LibTorch's at the first call (from then on every new CUDA
// storage is allocated through it; storages made before keep LibTorch's allocator for a resize).
LimitingAllocator& limiting_allocator() {
  static LimitingAllocator* instance = [] {
    auto* limiting = new LimitingAllocator(cca::get());  // never destroyed, as LibTorch's own is static
    cca::allocator.store(limiting);  // what at::cuda::getCUDADeviceAllocator() and cca::get() return
    c10::SetAllocator(c10::DeviceType::CUDA, limiting, /*priority=*/1);  // c10::GetAllocator(kCUDA): LibTorch's has 0
    return limiting;
  }();
  return *instance;
}

std::atomic<bool> g_made{false};

}  // namespace

void set_cuda_limit(c10::DeviceIndex device, int64_t bytes) {
  if (bytes <= 0 && !g_made.load()) return;  // no limit, and none to lift: LibTorch's allocator stays alone
  if (device < 0 || device >= C10_COMPILE_TIME_MAX_GPUS)
    throw ConfigError(fmt::format("memory.limit: CUDA device {} is outside the {} devices LibTorch supports", device,
                                  C10_COMPILE_TIME_MAX_GPUS));
  if (bytes > 0 && c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") == true)
    throw ConfigError("memory.limit on CUDA limits the caching allocator's allocated bytes, which "
                      "PYTORCH_NO_CUDA_MEMORY_CACHING=1 turns off (it allocates with cudaMalloc and counts nothing): "
                      "unset PYTORCH_NO_CUDA_MEMORY_CACHING, or set memory.limit: 0");
  limiting_allocator().set_limit(device, bytes);
  g_made.store(true);
}

}  // namespace sl::memory
