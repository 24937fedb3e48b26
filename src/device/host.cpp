// Host placement and transfers (see host.h): a thread-local scope flag and plain copies; state.async's
// snapshot, on CUDA into one page-locked block with non-blocking copies and one event.
#include "device/host.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace sl::device {
namespace {
thread_local int t_host_depth = 0;
}

HostScope::HostScope(bool on) : on_(on) {
  if (on_) ++t_host_depth;
}
HostScope::~HostScope() {
  if (on_) --t_host_depth;
}
bool HostScope::active() { return t_host_depth > 0; }

namespace {
// An empty tensor like `like` (sizes, strides when dense) on `device`, in the host pool when `host`.
at::Tensor empty_same_layout(const at::Tensor& like, c10::Device device, bool host) {
  HostScope scope(host);
  const auto opts = like.options().device(device);
  if (like.is_non_overlapping_and_dense()) return at::empty_strided(like.sizes(), like.strides(), opts);
  return at::empty(like.sizes(), opts);
}
}  // namespace

at::Tensor to_host(const at::Tensor& t) {
  if (!t.device().is_cpu()) {  // the device's own copy to the CPU (the lazy device cannot copy_ into a CPU tensor)
    HostScope scope;
    return t.to(c10::kCPU, /*non_blocking=*/false, /*copy=*/true);
  }
  auto h = empty_same_layout(t, c10::kCPU, /*host=*/true);
  h.copy_(t);
  return h;
}

at::Tensor to_host_reusing(const at::Tensor& t, const at::Tensor& reuse) {
  const bool fits = reuse.defined() && reuse.device().is_cpu() && (t.device().is_cpu() || t.device().is_cuda()) &&
                    reuse.scalar_type() == t.scalar_type() && reuse.sizes() == t.sizes() && reuse.strides() == t.strides();
  if (!fits) return to_host(t);
  reuse.copy_(t);
  return reuse;
}

at::Tensor to_device_copy(const at::Tensor& h, c10::Device device) {
  auto d = empty_same_layout(h, device, /*host=*/false);
  d.copy_(h);
  return d;
}

at::Tensor host_zeros(int64_t numel, c10::ScalarType dtype) {
  HostScope scope;
  return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(c10::kCPU));
}

at::Tensor host_readable(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  HostScope scope;  // its own: on CUDA this runs in gradient hooks, on autograd's device thread (no outer scope there)
  return t.to(c10::kCPU);
}

void copy_into(const at::Tensor& dst, const at::Tensor& src) { dst.copy_(src.reshape(dst.sizes())); }

// ---- state.async's snapshot (contract in host.h) ----

namespace {
ExternalHostBytes g_external;  // set once, at the tracking allocator's install, before any snapshot
}

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
std::vector<at::Tensor> pinned_views(const std::vector<at::Tensor>& src, const std::shared_ptr<HostSnapshot::Pinned>& block,
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
    for (size_t i = 0; i < src.size(); ++i) out.tensors_.push_back(to_host_reusing(src[i], fits ? reuse.tensors_[i] : at::Tensor()));
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
