// Host memory for offloaded state (the recipe's offload section): where a tensor placed on the host
// lives, and the copies between it and the device. Every offload transfer goes through these
// functions; they are the only device-specific code of offloading.
//
//   cpu   the device is simulated (the tested path). Device and host are the same RAM, so a
//         host-placed tensor is an ordinary CPU tensor allocated while a HostScope is open, which the
//         tracking allocator (memory/tracking_allocator.h) counts in its host pool, apart from device
//         memory and memory.limit, under memory.host_limit. A move is a real copy into a new buffer
//         (the same bytes), so the CPU runs the GPU's code path and its memory picture.
//   cuda  host tensors are CPU tensors made under a HostScope (tracked and limited the same way),
//         pageable, and every copy is synchronous on the current stream: correct by construction, no
//         transfer overlaps compute. Contract for the faster version (not built, no GPU to test it):
//         page-locked buffers, copies on a side stream with an event recorded after each, and the
//         consumer's stream waiting on that event before the first use; a host buffer is reused only
//         after its copy's event has completed.
//   lazy  the test device: copies go through at::Tensor::to like any other device.
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace sl::device {

// While one is open on this thread, tensors the CPU allocator makes belong to the host pool.
// Nestable; HostScope(false) opens nothing (for code that decides at run time).
class HostScope {
 public:
  explicit HostScope(bool on = true);
  ~HostScope();
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;
  static bool active();

 private:
  bool on_;
};

// A host-placed copy of `t` (same dtype, values, sizes and strides when they are dense; contiguous
// otherwise; from another device, the layout its copy to the CPU gives), and the way back: a copy of host tensor `h` in `device`'s memory with its layout. A
// restored tensor meets the kernels the original met (a stride change could change their bits).
at::Tensor to_host(const at::Tensor& t);
// to_host(t) into `reuse` when it is a host copy of the same dtype, sizes and strides (copied in place:
// no new allocation, no page faults); otherwise (undefined, another layout, the lazy device, which
// cannot copy into a CPU tensor) a new to_host(t).
at::Tensor to_host_reusing(const at::Tensor& t, const at::Tensor& reuse);
at::Tensor to_device_copy(const at::Tensor& h, c10::Device device);
// Zeros of `numel` elements on the host.
at::Tensor host_zeros(int64_t numel, c10::ScalarType dtype);
// `t` as host arithmetic can read it: on the CPU `t` itself (no copy: device and host are one RAM,
// and a copy would only add a transient), elsewhere a copy on the CPU.
at::Tensor host_readable(const at::Tensor& t);
// Copies `src` into `dst` (the same number of elements), one on the host and the other on the device.
void copy_into(const at::Tensor& dst, const at::Tensor& src);

}  // namespace sl::device
