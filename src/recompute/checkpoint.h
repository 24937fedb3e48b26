// The checkpoint engine: autograd Functions that run a piece of the forward without keeping its
// internals, keep only its inputs (plus the RNG and autocast state of that moment), and recompute it
// in backward with grad enabled. Two shapes:
//  - checkpoint(): a segment (any callable over tensors, e.g. k consecutive blocks);
//  - recompute_then_linear(): a cheap op feeding a linear layer (norm -> linear, activation ->
//    linear, attention core -> projection): only the cheap op is re-run; the linear's backward is
//    computed directly from the recomputed value, so the matmul is not repeated.
// Gradients equal the non-checkpointed ones bitwise on CPU fp32, dropout included.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "model/lora.h"

namespace c10 {
struct Event;
}

namespace sl::recompute {

using SegmentFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using CheapFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// A recompute on CUDA: events recorded on the current stream before and after it.
struct DeviceSpan {
  std::shared_ptr<c10::Event> start, end;
};

// Accumulated by every recompute of a run (reset by the trainer per step).
struct Stats {
  double recompute_ms = 0.0;  // time spent re-running forwards inside backward (CPU: wall clock)
  int64_t recomputes = 0;     // how many pieces were recomputed
  // CUDA: the recomputes whose device time is not in recompute_ms yet (settle_device_times).
  std::vector<DeviceSpan> device_spans;
  // offload.activations: bytes of checkpointed inputs copied to the host in forward and back in backward.
  int64_t offload_to_host = 0, offload_to_device = 0;
};

// offload.activations (device/host.h): a checkpointed piece's inputs that carry gradient (the
// activations, not constant tables) are copied to host memory in its forward instead of being kept
// on the device, and copied back when its backward starts; that backward also brings back the inputs
// of the piece whose backward comes next (the previous piece of the forward), so on a GPU the copy
// can overlap this piece's recompute. The device then holds at most two pieces' inputs. Only bytes
// move: the restored tensor has the original's values, sizes and strides.
class ActivationOffload {
 public:
  struct Slot;
  void begin_forward();  // a new forward: a new chain of pieces
  std::shared_ptr<Slot> offload(const std::vector<at::Tensor>& inputs, Stats& stats);
  // The inputs of `slot`'s piece on the device (restored now unless prefetched), and the previous
  // piece's restored ahead of its backward.
  std::vector<at::Tensor> restore(Slot& slot, Stats& stats);

 private:
  std::vector<std::weak_ptr<Slot>> chain_;  // this forward's slots, in forward order
};

// Adds the device spans' elapsed times to recompute_ms and clears them. Reading an event pair does
// not wait once the device is past its end event: the trainer settles after its one host read per
// step (Runner::take_stats), when every recompute of the step's backward is done. Called earlier, it
// waits for the last span's end event.
void settle_device_times(Stats& stats);

// Shared by all pieces that one runner checkpoints.
struct Options {
  bool preserve_rng = true;     // replay the forward's RNG state (exact dropout)
  bool check_recompute = false; // compare recomputed outputs' shapes, dtypes and value checksums
  std::function<void(const std::string& name)> pre_recompute_hook;  // runs before each recompute
  std::shared_ptr<Stats> stats = std::make_shared<Stats>();
  // checkpointing.exchange keep (parallel.sequence > 1): the piece's first pass keeps what its sequence
  // exchanges received (model::ExchangeMemo, owned by the piece's node) and its recompute takes them
  // instead of exchanging again. Set per piece (recompute/runner.cpp); false: the recompute redoes them.
  bool keep_exchange = false;
  // offload.activations: set only on the Options of an offloaded segment (recompute/runner.cpp),
  // never on those of pieces nested in a segment or a kept block; null = inputs stay on the device.
  std::shared_ptr<ActivationOffload> offload;
};

// Runs fn(inputs) and returns its outputs. With grad mode on, only `inputs` (and RNG/autocast state)
// are kept; backward re-runs fn and back-propagates into `inputs` and `params` (the parameters fn
// uses: passing them keeps the graph alive when no input requires grad). With grad mode off it
// simply calls fn. `name` identifies the piece in errors and hooks (e.g. "segment 2 (blocks 4..5)").
std::vector<at::Tensor> checkpoint(const std::string& name, const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params, const Options& opts);

// linear(cheap(inputs), W, b) keeping only `inputs`: backward recomputes cheap(inputs) and derives
// the linear's gradients from it. `cheap_params` are parameters the cheap op uses (norm weights).
// The inputs to the linear must be contiguous after cheap(), as they are for every Part.
// linear(a, W, b) in a recompute whose output's values nobody reads (the last linear of a recomputed
// segment: the segment's backward starts from the gradient arriving at the output, and the linear's
// backward needs only its input a and W): returns a placeholder of the output's shape and dtype (no
// matmul); backward gives da, dW, db with the kernels recompute_then_linear uses, which are autograd's.
at::Tensor linear_without_output(const at::Tensor& a, const at::Tensor& W, const at::Tensor& b);

// `lora`: the projection's adapter (model/lora.h; empty: none), added to the linear's output; its
// backward runs delta() again from the recomputed input, inside the piece's RNG replay (its dropout
// mask is the forward's), and its input gradient joins the linear's.
at::Tensor recompute_then_linear(const std::string& name, const CheapFn& cheap, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& cheap_params, const at::Tensor& W, const at::Tensor& b,
                                 const model::LoraAdapter& lora, const Options& opts);

}  // namespace sl::recompute
