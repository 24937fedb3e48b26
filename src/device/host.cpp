// Host placement and transfers (see host.h): a thread-local scope flag; on CUDA a pool of page-locked
// blocks and copies on a side stream with events, elsewhere (and on CUDA's synchronous path) plain
// copies; state.async's snapshot, on CUDA into one page-locked block with non-blocking copies and one event.
#include "device/host.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace sl::device {
namespace {
thread_local int t_host_depth = 0;
ExternalHostBytes g_external;  // set once, at the tracking allocator's install, before any copy
}

HostScope::HostScope(bool on) : on_(on) {
  if (on_) ++t_host_depth;
}
HostScope::~HostScope() {
  if (on_) --t_host_depth;
}
bool HostScope::active() { return t_host_depth > 0; }


// ---- CUDA: the switch, the side streams, the page-locked pool (contract in host.h) ----

namespace {
std::atomic<int> g_synchronous{-1};  // -1: not yet read from SUBLINEAR_SYNC_OFFLOAD
std::atomic<int64_t> g_side_copies{0}, g_sync_copies{0}, g_simulated_copies{0};  // copy_counts()

// One copy between `a` and `b` not on the side stream: synchronous on CUDA, else simulated.
void count_plain_copy(const at::Tensor& a, const at::Tensor& b) {
  auto& counter = a.is_cuda() || b.is_cuda() ? g_sync_copies : g_simulated_copies;
  counter.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

CopyCounts copy_counts() {
  return {g_side_copies.load(std::memory_order_relaxed), g_sync_copies.load(std::memory_order_relaxed),
          g_simulated_copies.load(std::memory_order_relaxed)};
}

void set_synchronous_copies(bool on) { g_synchronous.store(on ? 1 : 0); }

bool synchronous_copies() {
  int v = g_synchronous.load();
  if (v < 0) {
    const char* env = std::getenv("SUBLINEAR_SYNC_OFFLOAD");
    v = env != nullptr && std::string(env) != "" && std::string(env) != "0" ? 1 : 0;
    g_synchronous.store(v);
  }
  return v == 1;
}

struct Arrival::Event {
  c10::cuda::CUDAEvent event;  // cudaEventDisableTiming
};

void Arrival::wait() const {
  if (event_) event_->event.block(c10::cuda::getCurrentCUDAStream(event_->event.device_index()));
}

void Arrival::host_wait() const {
  if (event_) event_->event.synchronize();
}

namespace {

// One side stream per device, taken from LibTorch's pool once.
std::mutex g_streams_mu;
std::map<c10::DeviceIndex, c10::cuda::CUDAStream> g_side_streams;  // taken once per device, never dropped

c10::cuda::CUDAStream side_stream(c10::DeviceIndex dev) {
  const std::lock_guard<std::mutex> lock(g_streams_mu);
  auto it = g_side_streams.find(dev);
  if (it == g_side_streams.end())
    it = g_side_streams.emplace(dev, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, dev)).first;
  return it->second;
}

// The side stream, after an event recorded on the current stream: what it runs next reads and writes
// after every kernel queued so far on the current stream.
c10::cuda::CUDAStream side_after_current(c10::DeviceIndex dev) {
  const auto current = c10::cuda::getCurrentCUDAStream(dev);
  const auto side = side_stream(dev);
  if (current != side) {
    c10::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
  }
  return side;
}

std::shared_ptr<Arrival::Event> record_on(const c10::cuda::CUDAStream& stream) {
  auto e = std::make_shared<Arrival::Event>();
  e->event.record(stream);
  return e;
}

// A page-locked block of the pool and the event of its last copy.
struct PinnedBlock {
  void* ptr = nullptr;
  size_t bytes = 0;
  std::shared_ptr<Arrival::Event> last;
};

void free_pinned(PinnedBlock* b) {
  try {
    if (b->last) b->last->event.synchronize();  // no copy may still read or write it
  } catch (const std::exception&) {  // a failed device: freed all the same
  }
  (void)cudaFreeHost(b->ptr);
  (void)cudaGetLastError();
  delete b;
}

// Blocks from cudaHostAlloc kept by exact size (host.h's cuda contract). Handed-out blocks count in
// the host pool; kept ones do not, and stay within the most ever handed out at once.
class PinnedPool {
 public:
  std::shared_ptr<PinnedBlock> take(size_t bytes, c10::DeviceIndex dev);
  std::shared_ptr<PinnedBlock> find(const void* ptr);

 private:
  PinnedBlock* kept(size_t bytes);
  void* system_alloc(size_t bytes, c10::DeviceIndex dev);
  void give_back(PinnedBlock* b) noexcept;
  void release_kept();
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<PinnedBlock*>> kept_;
  std::unordered_map<const void*, std::weak_ptr<PinnedBlock>> out_;
  int64_t kept_bytes_ = 0, out_bytes_ = 0, out_peak_ = 0;
};

PinnedPool& pool() {
  static auto* p = new PinnedPool;  // never destroyed: its blocks may outlive static destruction order
  return *p;
}

// A kept block of `bytes` whose last copy has landed (event query), or null: a block still being
// copied is not waited for (a new one is made), so the host thread runs on beside the copies.
PinnedBlock* PinnedPool::kept(size_t bytes) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = kept_.find(bytes);
  if (it == kept_.end()) return nullptr;
  auto& v = it->second;
  auto done = std::find_if(v.begin(), v.end(), [](PinnedBlock* k) { return !k->last || k->last->event.query(); });
  if (done == v.end()) return nullptr;
  PinnedBlock* b = *done;
  v.erase(done);
  kept_bytes_ -= static_cast<int64_t>(bytes);
  b->last.reset();
  return b;
}

void PinnedPool::release_kept() {
  std::unordered_map<size_t, std::vector<PinnedBlock*>> blocks;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(kept_);
    kept_bytes_ = 0;
  }
  for (auto& [bytes, v] : blocks)
    for (auto* b : v) free_pinned(b);
}

void* PinnedPool::system_alloc(size_t bytes, c10::DeviceIndex dev) {
  const c10::cuda::CUDAGuard guard(dev);  // the run's device: no context made on another
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {  // once more after the kept blocks are handed back
    (void)cudaGetLastError();  // an allocation error is not sticky: clear it for the next call
    release_kept();
    err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (g_external.refused) g_external.refused(static_cast<int64_t>(bytes));
    TORCH_CHECK_WITH(OutOfMemoryError, false, "host out of memory: the CUDA runtime refused ", bytes,
                     " bytes of page-locked memory (", cudaGetErrorString(err), ")");
  }
  return p;
}

std::shared_ptr<PinnedBlock> PinnedPool::take(size_t bytes, c10::DeviceIndex dev) {
  bytes = std::max<size_t>(bytes, 1);
  const auto n = static_cast<int64_t>(bytes);
  if (g_external.add) g_external.add(n);  // memory.host_limit: OutOfMemoryError, nothing taken
  PinnedBlock* b = nullptr;
  try {
    b = kept(bytes);
    if (!b) {
      b = new PinnedBlock;
      b->bytes = bytes;
      try {
        b->ptr = system_alloc(bytes, dev);
      } catch (...) {
        delete b;
        throw;
      }
    }
  } catch (...) {
    if (g_external.remove) g_external.remove(n);
    throw;
  }
  std::shared_ptr<PinnedBlock> handle(b, [this](PinnedBlock* p) { give_back(p); });
  const std::lock_guard<std::mutex> lock(mu_);
  out_[b->ptr] = handle;
  out_bytes_ += n;
  out_peak_ = std::max(out_peak_, out_bytes_);
  return handle;
}

std::shared_ptr<PinnedBlock> PinnedPool::find(const void* ptr) {
  const std::lock_guard<std::mutex> lock(mu_);
  const auto it = out_.find(ptr);
  return it == out_.end() ? nullptr : it->second.lock();
}

void PinnedPool::give_back(PinnedBlock* b) noexcept {
  const auto n = static_cast<int64_t>(b->bytes);
  if (g_external.remove) g_external.remove(n);
  {
    const std::lock_guard<std::mutex> lock(mu_);
    out_.erase(b->ptr);
    out_bytes_ -= n;
    if (kept_bytes_ + n <= out_peak_) {
      try {
        kept_[b->bytes].push_back(b);
        kept_bytes_ += n;
        return;
      } catch (...) {  // no memory to keep it: freed below
      }
    }
  }
  free_pinned(b);
}

// A pooled host tensor like `like` (its sizes, and its strides when dense; contiguous otherwise) of
// `dtype`; the tensor holds the block, which goes back to the pool with the tensor's last view.
at::Tensor pinned_like(const at::Tensor& like, c10::ScalarType dtype, c10::DeviceIndex dev,
                       std::shared_ptr<PinnedBlock>& block) {
  block = pool().take(static_cast<size_t>(like.numel()) * c10::elementSize(dtype), dev);
  const auto opts = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  auto keep = [held = block](void*) {};
  if (like.is_non_overlapping_and_dense()) return at::from_blob(block->ptr, like.sizes(), like.strides(), keep, opts);
  return at::from_blob(block->ptr, like.sizes(), keep, opts);
}

std::shared_ptr<PinnedBlock> pooled_block(const at::Tensor& h) {
  if (!h.defined() || !h.device().is_cpu() || !h.has_storage()) return nullptr;
  return pool().find(h.storage().data_ptr().get());
}

// `dst` from `src` (one on CUDA device `dev`, the other host memory in `block`, the same dtype) on
// the side stream, after the current stream's queued work; the event after it is the Arrival and
// the block's last copy. The device tensor is record_stream'ed on the side stream.
Arrival side_copy(const at::Tensor& dst, const at::Tensor& src, const std::shared_ptr<PinnedBlock>& block,
                  c10::DeviceIndex dev) {
  const auto side = side_after_current(dev);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    dst.copy_(src, /*non_blocking=*/true);
  }
  const auto& on_device = dst.is_cuda() ? dst : src;
  if (on_device.has_storage()) c10::cuda::CUDACachingAllocator::recordStream(on_device.storage().data_ptr(), side);
  auto done = record_on(side);
  block->last = done;
  g_side_copies.fetch_add(1, std::memory_order_relaxed);
  return Arrival(done);
}

// Host `src` into CUDA `dst`: straight from a pooled block of dst's dtype and layout, else through a
// pooled staging copy made on the host thread (the cast ATen's synchronous copy makes there).
void copy_to_cuda(const at::Tensor& dst, const at::Tensor& src, Arrival* deferred) {
  const auto dev = dst.device().index();
  auto block = pooled_block(src);
  at::Tensor from = src;
  const bool direct = block && src.scalar_type() == dst.scalar_type() && src.sizes() == dst.sizes() &&
                      src.strides() == dst.strides();
  if (!direct) {
    if (block && block->last) block->last->event.synchronize();  // the host reads a pooled source after its copy in
    from = pinned_like(dst, dst.scalar_type(), dev, block);
    from.copy_(src);
  }
  const Arrival a = side_copy(dst, from, block, dev);
  if (deferred)
    *deferred = a;
  else
    a.wait();
}

// CUDA `src` into a pooled host `dst` of its dtype, landed when it returns; false (nothing done)
// when `dst` is not pooled or the dtypes differ.
bool copy_to_pooled_host(const at::Tensor& dst, const at::Tensor& src) {
  auto block = pooled_block(dst);
  if (!block || dst.scalar_type() != src.scalar_type()) return false;
  if (block->last) block->last->event.synchronize();  // overwritten only after its last copy
  side_copy(dst, src, block, src.device().index()).host_wait();
  return true;
}

bool async_cuda(const at::Tensor& t) { return t.is_cuda() && !synchronous_copies(); }

// An empty tensor like `like` (sizes, strides when dense) on `device`, in the host pool when `host`.
at::Tensor empty_same_layout(const at::Tensor& like, c10::Device device, bool host) {
  HostScope scope(host);
  const auto opts = like.options().device(device);
  if (like.is_non_overlapping_and_dense()) return at::empty_strided(like.sizes(), like.strides(), opts);
  return at::empty(like.sizes(), opts);
}

}  // namespace

void wait_for_host_copies() {
  std::vector<c10::cuda::CUDAStream> streams;
  {
    const std::lock_guard<std::mutex> lock(g_streams_mu);
    for (const auto& kv : g_side_streams) {
      streams.push_back(kv.second);
      // device::to_device's non-blocking copies of a page-locked tensor run on the current stream
      streams.push_back(c10::cuda::getCurrentCUDAStream(kv.first));
    }
  }
  for (const auto& stream : streams) stream.synchronize();
}

struct SideStreamScope::Guard {
  explicit Guard(const c10::cuda::CUDAStream& s) : side(s), stream(s) {}
  c10::cuda::CUDAStream side;
  c10::cuda::CUDAStreamGuard stream;
};

SideStreamScope::SideStreamScope(c10::Device device) {
  if (!device.is_cuda() || synchronous_copies()) return;
  const auto dev = device.has_index() ? device.index() : c10::cuda::current_device();
  guard_ = std::make_unique<Guard>(side_after_current(dev));
}

SideStreamScope::~SideStreamScope() = default;

Arrival SideStreamScope::finish() {
  if (!guard_) return Arrival();
  auto done = record_on(guard_->side);
  guard_.reset();
  return Arrival(done);
}

// ---- the transfers ----

at::Tensor to_host(const at::Tensor& t, Arrival* pending) {
  if (async_cuda(t)) {
    std::shared_ptr<PinnedBlock> block;
    auto h = pinned_like(t, t.scalar_type(), t.device().index(), block);
    const Arrival a = side_copy(h, t, block, t.device().index());
    if (pending)
      *pending = a;
    else
      a.host_wait();
    return h;
  }
  if (!t.device().is_cpu()) {  // the device's own copy to the CPU (the lazy device cannot copy_ into a CPU tensor)
    HostScope scope;
    count_plain_copy(t, t);
    return t.to(c10::kCPU, /*non_blocking=*/false, /*copy=*/true);
  }
  auto h = empty_same_layout(t, c10::kCPU, /*host=*/true);
  h.copy_(t);
  count_plain_copy(h, t);
  return h;
}

at::Tensor to_host_reusing(const at::Tensor& t, const at::Tensor& reuse) {
  const bool fits = reuse.defined() && reuse.device().is_cpu() && (t.device().is_cpu() || t.device().is_cuda()) &&
                    reuse.scalar_type() == t.scalar_type() && reuse.sizes() == t.sizes() &&
                    reuse.strides() == t.strides();
  if (!fits) return to_host(t);
  if (async_cuda(t) && copy_to_pooled_host(reuse, t)) return reuse;
  reuse.copy_(t);
  count_plain_copy(reuse, t);
  return reuse;
}

at::Tensor to_device_copy(const at::Tensor& h, c10::Device device, Arrival* deferred) {
  auto d = empty_same_layout(h, device, /*host=*/false);
  if (async_cuda(d) && h.device().is_cpu()) {
    copy_to_cuda(d, h, deferred);
    return d;
  }
  d.copy_(h);
  count_plain_copy(d, h);
  return d;
}

at::Tensor host_zeros(int64_t numel, c10::ScalarType dtype) {
  HostScope scope;
  return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(c10::kCPU));
}

at::Tensor host_readable(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  if (async_cuda(t)) return to_host(t);  // page-locked, landed when it returns
  HostScope scope;  // its own: on CUDA this runs in gradient hooks, on autograd's device thread (no outer scope there)
  count_plain_copy(t, t);
  return t.to(c10::kCPU);
}

void copy_into(const at::Tensor& dst, const at::Tensor& src, Arrival* deferred) {
  const auto s = src.reshape(dst.sizes());
  if (async_cuda(dst) && s.device().is_cpu()) return copy_to_cuda(dst, s, deferred);
  if (async_cuda(s) && dst.device().is_cpu() && copy_to_pooled_host(dst, s)) return;
  dst.copy_(s);
  count_plain_copy(dst, s);
}

// ---- state.async's snapshot (contract in host.h) ----

void set_external_host_bytes(const ExternalHostBytes& counter) { g_external = counter; }

// A page-locked block from the CUDA runtime, counted in the host pool, and the event recorded after
// the last copy into it. Destroyed with the last tensor that views it: waits for the copies first.
struct HostSnapshot::Pinned {
  void* ptr = nullptr;
  int64_t bytes = 0;
  c10::DeviceIndex device = 0;
  c10::cuda::CUDAEvent copied;  // recorded on the copies' stream after the last one (cudaEventDisableTiming)

  Pinned(int64_t n, c10::DeviceIndex dev) : bytes(n), device(dev) {
    const c10::cuda::CUDAGuard guard(device);  // the run's device: no context made on another
    if (g_external.add) g_external.add(bytes);  // memory.host_limit: OutOfMemoryError, nothing allocated
    const cudaError_t err = cudaHostAlloc(&ptr, std::max<size_t>(static_cast<size_t>(bytes), 1), cudaHostAllocPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation error is not sticky: clear it for the next call
      if (g_external.remove) g_external.remove(bytes);
      if (g_external.refused) g_external.refused(bytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "host out of memory: the CUDA runtime refused ", bytes,
                       " bytes of page-locked memory (", cudaGetErrorString(err), ")");
    }
  }
  ~Pinned() {
    try {
      copied.synchronize();  // no copy may still be writing into the block
    } catch (const std::exception&) {  // a failed device: freed all the same
    }
    const c10::cuda::CUDAGuard guard(device);
    (void)cudaFreeHost(ptr);
    (void)cudaGetLastError();
    if (g_external.remove) g_external.remove(bytes);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

HostSnapshot::HostSnapshot() = default;
HostSnapshot::~HostSnapshot() = default;
HostSnapshot::HostSnapshot(HostSnapshot&&) noexcept = default;
HostSnapshot& HostSnapshot::operator=(HostSnapshot&&) noexcept = default;

std::vector<int64_t> packed_offsets(const std::vector<at::Tensor>& tensors, int64_t& total) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return tensors[a].element_size() > tensors[b].element_size(); });
  std::vector<int64_t> offsets(tensors.size(), 0);
  total = 0;
  for (const size_t i : order) {
    offsets[i] = total;
    total += static_cast<int64_t>(tensors[i].nbytes());
  }
  return offsets;
}

namespace {

bool same_layout(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].scalar_type() != b[i].scalar_type() || a[i].sizes() != b[i].sizes()) return false;
  return true;
}

// Contiguous host tensors like `src`'s viewing a new block in packed_offsets' layout; each holds the block.
std::vector<at::Tensor> pinned_views(const std::vector<at::Tensor>& src,
                                     const std::shared_ptr<HostSnapshot::Pinned>& block,
                                     const std::vector<int64_t>& offsets) {
  std::vector<at::Tensor> out;
  out.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    void* where = static_cast<char*>(block->ptr) + offsets[i];
    out.push_back(at::from_blob(where, src[i].sizes(), [keep = block](void*) {},
                                at::TensorOptions().dtype(src[i].scalar_type()).device(c10::kCPU)));
  }
  return out;
}

c10::DeviceIndex cuda_index(const std::vector<at::Tensor>& src) {
  for (const auto& t : src)
    if (t.is_cuda()) return t.device().index();
  return -1;
}

}  // namespace

HostSnapshot HostSnapshot::take(const std::vector<at::Tensor>& src, HostSnapshot reuse) {
  HostSnapshot out;
  const bool fits = same_layout(src, reuse.tensors_);
  const c10::DeviceIndex cuda = cuda_index(src);
  if (cuda < 0) {  // cpu, lazy: tensor by tensor, finished here
    out.tensors_.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i)
      out.tensors_.push_back(to_host_reusing(src[i], fits ? reuse.tensors_[i] : at::Tensor()));
    return out;
  }
  if (fits && reuse.pinned_) {
    out = std::move(reuse);
  } else {
    reuse = HostSnapshot();  // its block goes (after its copies) before the new one is counted
    int64_t total = 0;
    const auto offsets = packed_offsets(src, total);
    out.pinned_ = std::make_shared<Pinned>(total, cuda);
    out.tensors_ = pinned_views(src, out.pinned_, offsets);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream(cuda);
  try {
    for (size_t i = 0; i < src.size(); ++i) out.tensors_[i].copy_(src[i], /*non_blocking=*/src[i].is_cuda());
  } catch (...) {
    try {
      out.pinned_->copied.record(stream);  // after the copies made: the block is freed only once they land
    } catch (...) {  // a failed device: the copy's own error is the one to report
    }
    throw;
  }
  out.pinned_->copied.record(stream);
  return out;
}

void HostSnapshot::wait() const {
  if (pinned_) pinned_->copied.synchronize();
}

}  // namespace sl::device
