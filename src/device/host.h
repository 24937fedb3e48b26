// Host memory for offloaded state (the recipe's offload section): where a tensor placed on the host
// lives, and the copies between it and the device. Every offload transfer goes through these
// functions; they are the only device-specific code of offloading.
//
//   cpu   the device is simulated (the tested path). Device and host are the same RAM, so a
//         host-placed tensor is an ordinary CPU tensor allocated while a HostScope is open, which the
//         tracking allocator (memory/tracking_allocator.h) counts in its host pool, apart from device
//         memory and memory.limit, under memory.host_limit. A move is a real copy into a new buffer
//         (the same bytes), so the CPU runs the GPU's code path and its memory picture.
//   cuda  host tensors made from a CUDA tensor (to_host, host_readable, and copy_into's and
//         to_device_copy's staging) are page-locked blocks of exactly their bytes from a pool of
//         cudaHostAlloc blocks kept by size (a freed block is kept for the next tensor of its size
//         while the kept bytes stay within the most the pool ever handed out, as the tracking
//         allocator keeps CPU blocks). A handed-out block counts in the host pool (ExternalHostBytes
//         below: memory.host_limit refuses it with c10::OutOfMemoryError, host_peak_bytes shows it);
//         a kept one does not. Host tensors made otherwise (host_zeros, the host AdamW's own) are
//         pageable CPU tensors made under a HostScope, as on the CPU. The copies:
//           stream    every copy runs on one side stream per device (c10::cuda::getStreamFromPool,
//                     taken once), non-blocking. Before it, the side stream waits on an event
//                     recorded on the current stream: the copy reads and writes after every kernel
//                     queued before the call (the producer of a device source; the last user of a
//                     device destination the caching allocator handed out on the current stream).
//                     After it, an event is recorded on the side stream: the copy's Arrival.
//           consumer  the current stream waits on that event (cudaStreamWaitEvent: no host block)
//                     before the call returns, or, where the caller takes the Arrival, before the
//                     caller's first use (Arrival::wait). A CPU reader of a host result waits on the
//                     host (Arrival::host_wait): to_host without an Arrival, host_readable and a
//                     copy into a host tensor do that before they return.
//           lifetime  a device tensor the side stream reads or writes is record_stream'ed on it, so
//                     the caching allocator reuses its memory only after the copy; a pooled host
//                     block carries the event of its last copy and is handed out again only after
//                     that event completed (query; a new block is made while none of the size has),
//                     or overwritten by to_host_reusing or copy_into after synchronizing on it; a
//                     CPU writer of a pooled block first calls wait_for_host_copies.
//           staging   a host source that is not a pooled block of the destination's dtype and
//                     layout is first copied (cast to the destination's dtype, rounded to nearest
//                     even as ATen's CPU cast rounds) into one on the host thread, then sent.
//         set_synchronous_copies(true), or SUBLINEAR_SYNC_OFFLOAD=1 in the environment, gives the
//         plain path: pageable host tensors made under a HostScope, every copy synchronous on the
//         current stream (the same bytes: a copy moves bytes, and the host cast is the one ATen's
//         copy makes). (state.async's snapshot, HostSnapshot below, is its own: one page-locked
//         block, non-blocking copies on the current stream, one event.)
//   lazy  the test device: copies go through at::Tensor::to like any other device.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

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

// Where a copy's consumer waits (device/host.h's cuda contract). Empty (the copy has landed) on the
// CPU, the lazy device and the synchronous path.
class Arrival {
 public:
  // The current stream waits for the copy (no host block); empty: nothing.
  void wait() const;
  // The calling thread blocks until the copy has landed; empty: nothing.
  void host_wait() const;
  bool pending() const { return event_ != nullptr; }

  struct Event;  // a CUDA event (host.cpp)
  explicit Arrival(std::shared_ptr<Event> e = nullptr) : event_(std::move(e)) {}

 private:
  std::shared_ptr<Event> event_;
};

// A host-placed copy of `t` (same dtype, values, sizes and strides when they are dense; contiguous
// otherwise; from another device, the layout its copy to the CPU gives), and the way back: a copy of host tensor `h` in
// `device`'s memory with its layout. A restored tensor meets the kernels the original met (a stride change could change
// their bits). From CUDA, with `pending`: the copy may still be in flight when to_host returns and *pending is where it
// lands; the host tensor may then be read only by copies back to the device (the same side stream, after it) or after
// pending->host_wait(). Without: landed when it returns.
at::Tensor to_host(const at::Tensor& t, Arrival* pending = nullptr);
// to_host(t) into `reuse` when it is a host copy of the same dtype, sizes and strides (copied in place:
// no new allocation, no page faults); otherwise (undefined, another layout, the lazy device, which
// cannot copy into a CPU tensor) a new to_host(t).
at::Tensor to_host_reusing(const at::Tensor& t, const at::Tensor& reuse);
// To CUDA with `deferred`: the current stream does not wait; *deferred is where the consumer waits
// before the first use. Without: the current stream waits before it returns.
at::Tensor to_device_copy(const at::Tensor& h, c10::Device device, Arrival* deferred = nullptr);
// Zeros of `numel` elements on the host.
at::Tensor host_zeros(int64_t numel, c10::ScalarType dtype);
// `t` as host arithmetic can read it: on the CPU `t` itself (no copy: device and host are one RAM,
// and a copy would only add a transient), elsewhere a copy on the CPU, in the host pool.
// Every function here that makes a host tensor opens its own HostScope: on CUDA, the gradient hooks
// and recomputes that call them run on autograd's device thread, where a caller's scope does not hold.
at::Tensor host_readable(const at::Tensor& t);
// Copies `src` into `dst` (the same number of elements), one on the host and the other on the device.
// Host to CUDA with `deferred`: as to_device_copy's. Into a host tensor: landed when it returns.
void copy_into(const at::Tensor& dst, const at::Tensor& src, Arrival* deferred = nullptr);

// Blocks until every copy the side streams and the current streams of their devices were given has
// landed (cudaStreamSynchronize on each; nothing elsewhere). A copy to the device may read a
// page-locked host tensor after the call that issued it returned (device::to_device's too, on the
// current stream): a CPU writer of such a tensor (the host AdamW writing the masters the parameters
// are copied from) calls this first.
void wait_for_host_copies();

// How the transfers of these functions went in this process (summary.json's host_memory.copies): each
// copy between a device tensor and a host one counted once, by the path it took.
//   side_stream  CUDA, the asynchronous path: a non-blocking copy on the side stream (side_copy);
//   synchronous  CUDA, a copy on the current stream (the synchronous path, or a destination the
//                asynchronous path cannot take: a host tensor outside the page-locked pool);
//   simulated    the cpu and lazy devices (device and host are one RAM; a copy into a new buffer).
struct CopyCounts {
  int64_t side_stream = 0, synchronous = 0, simulated = 0;
};
CopyCounts copy_counts();

// The CUDA path's switch (initially on unless SUBLINEAR_SYNC_OFFLOAD=1 is in the environment):
// true gives the synchronous pageable path. For comparing the two; set it before any copy.
void set_synchronous_copies(bool on);
bool synchronous_copies();

// While one is open (on a CUDA device, asynchronous path), the current stream of `device` is the
// side stream, which first waits on an event recorded on the stream current before it: copies and
// collectives issued inside run after everything queued before, beside whatever is queued on the
// previous stream after. finish() records the event the consumer waits on (the Arrival) and restores
// the previous stream. Elsewhere it does nothing and finish() gives an empty Arrival. Allocations made
// inside belong to the side stream: allocate before opening it.
class SideStreamScope {
 public:
  explicit SideStreamScope(c10::Device device);
  ~SideStreamScope();
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;
  Arrival finish();

  struct Guard;  // the stream guard (host.cpp)

 private:
  std::unique_ptr<Guard> guard_;
};

// ---- state.async: a snapshot taken on the loop's thread, read by the save's writer thread ----
//
// HostSnapshot::take(src, reuse) copies every tensor of `src` (contiguous) to host memory:
//   cpu, lazy  tensor by tensor with to_host_reusing (host-pool CPU tensors): done when take() returns.
//   cuda       (any tensor of `src` on CUDA) ONE page-locked block from the CUDA runtime (cudaHostAlloc
//              on the tensors' device; not LibTorch's caching host allocator, which rounds a block up to
//              a power of two), the tensors back to back in it as packed_offsets lays them out: exactly
//              their bytes. The block counts in the host pool (ExternalHostBytes below:
//              memory.host_limit refuses it with c10::OutOfMemoryError as it refuses a host tensor,
//              host_peak_bytes shows it, the planner's host_snapshot_bytes is its size); a block the CUDA
//              runtime refuses is the same error. Device tensors are copied in with non-blocking copies
//              on the current stream (take() waits for none of them), host tensors (the RNG states,
//              offloaded states) with plain copies, and one event is recorded on that stream after the
//              last copy. Stream order makes the copies read each tensor after every kernel queued
//              before take() and before any queued after it (the next step's optimizer), and a device
//              temporary freed after take() (a .contiguous() copy) is reused by the caching allocator
//              only on that stream, after the copies. The block is freed, after its event, with the last
//              tensor that views it (cudaFreeHost: once, when the run ends or the layout changes).
// `reuse` (the previous snapshot, no longer read) lends its buffers when it holds the same number of
// tensors with the same dtypes and sizes; otherwise new buffers are made and its own are freed.
// wait() (any thread) returns once every copy has landed: on CUDA it blocks on the event, elsewhere
// it returns at once. Read tensors() only after it.
class HostSnapshot {
 public:
  HostSnapshot();
  ~HostSnapshot();
  HostSnapshot(HostSnapshot&&) noexcept;
  HostSnapshot& operator=(HostSnapshot&&) noexcept;
  static HostSnapshot take(const std::vector<at::Tensor>& src, HostSnapshot reuse);
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  void wait() const;

  struct Pinned;  // the CUDA block and its event (host.cpp)

 private:
  std::vector<at::Tensor> tensors_;
  std::shared_ptr<Pinned> pinned_;
};

// How the host pool counts memory that c10's CPU allocator does not make (a CUDA snapshot's block):
// the tracking allocator sets it when it is installed (memory/tracking_allocator.h; this layer is
// below it); unset, such blocks count nowhere, as there is no host pool. `add` throws
// c10::OutOfMemoryError when the bytes would pass memory.host_limit (nothing counted then);
// `refused` records a block the system refused. Set before any snapshot is taken.
struct ExternalHostBytes {
  void (*add)(int64_t bytes) = nullptr;
  void (*remove)(int64_t bytes) = nullptr;
  void (*refused)(int64_t bytes) = nullptr;
};
void set_external_host_bytes(const ExternalHostBytes& counter);

// Where each tensor of `tensors` starts in a CUDA snapshot's block (bytes), and the block's size in
// `total`: back to back, the largest element size first (8, 4, 2, 1 bytes; in their order within a
// size), so every tensor starts aligned to its element size with no padding (total = their bytes).
std::vector<int64_t> packed_offsets(const std::vector<at::Tensor>& tensors, int64_t& total);

}  // namespace sl::device
