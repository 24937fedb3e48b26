// Host placement and transfers (see host.h): a thread-local scope flag and plain copies.
#include "device/host.h"

#include <ATen/ATen.h>

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

at::Tensor host_readable(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(c10::kCPU); }

void copy_into(const at::Tensor& dst, const at::Tensor& src) { dst.copy_(src.reshape(dst.sizes())); }

}  // namespace sl::device
