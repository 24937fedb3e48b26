// train.cuda_graphs (see cuda_graph.h): the eligibility list and the captured micro-batch.
#include "train/cuda_graph.h"

#include <utility>
#include <vector>

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "device/alloc_tag.h"
#include "device/device.h"
#include "parallel/strategy.h"

namespace sl::train {

GraphEligibility graph_eligibility(const config::RunConfig& cfg, int64_t world, torch::Device device) {
  const auto eager = [](std::string why) { return GraphEligibility{false, std::move(why)}; };
  if (!cfg.train.cuda_graphs.wanted()) return eager("train.cuda_graphs: off");
  if (!device.is_cuda())
    return eager(fmt::format("the run is on the {} device: CUDA graphs need CUDA", c10::DeviceTypeName(device.type(), true)));
  if (cfg.parallel.uses_engine(world) && (world > 1 || cfg.parallel.sharding.stage() != config::Sharding::kZero1))
    return eager(fmt::format("{} rank(s) with parallel.sharding {}: the data-parallel engine's gradient hooks launch "
                             "collectives or make and free gradient buffers per micro-batch; one process without "
                             "sharding or with zero1 is captured", world, cfg.parallel.sharding.name()));
  if (cfg.offload.any()) return eager("offload.*: the micro-batch copies between host and device and waits for them");
  if (cfg.precision.compute == config::Dtype::kFp16)
    return eager("precision.compute fp16: the loss scaler scales and checks the gradients between micro-batches");
  if (cfg.memory.limit.bytes > 0)
    return eager("memory.limit: the limit is checked at each allocation, and a replayed graph allocates nothing");
  if (cfg.logging.memory_timeline > 0)
    return eager("logging.memory_timeline: it records each allocation of a step, and a replayed graph allocates nothing");
  if (cfg.model.dropout > 0.0)
    return eager("model.dropout > 0: a recompute restores the CUDA generator's state, which cannot be read under "
                 "capture, and a capture that fails part-way leaves the generator in capture mode");
  if (cfg.checkpointing.check_recompute)
    return eager("checkpointing.check_recompute: it reads each recompute's checksum to the host");
  return {true, ""};
}

// The CUDA side of a StepGraph, made at its first graphed micro-batch.
//
// Streams: every graphed micro-batch (the warm-up, the capture, the replays) runs on `side`, a stream
// from LibTorch's pool (a graph is captured on a stream other than the default one; the warm-up runs
// there so that cuBLAS's workspace and the caching allocator's blocks for that stream exist before the
// capture). Around each micro-batch: `side` waits for the caller's stream (the zeroed gradients, the
// previous micro-batch's reads of the loss output), then the caller's stream waits for `side` (the
// gradients and the loss it reads next). The autograd engine runs each backward op on its forward op's
// stream: `side` too.
// Buffers: `x`, `y` (the graph's inputs) are allocated once, before the capture, and filled (copy_) on
// `side` before each replay; `loss` (the graph's float64 output) lives in the graph's private pool and is
// rewritten by each replay, so it is copied out on the caller's stream before the next replay can start
// (that replay waits for the caller's stream). The activations of a replay reuse the pool's blocks the
// capture left; the gradients are the parameters' own .grad tensors, allocated before the capture.
struct StepGraph::Cuda {
  explicit Cuda(torch::Device device) : side(c10::cuda::getStreamFromPool(false, device.index())) {}
  c10::cuda::CUDAStream side;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  torch::Tensor x, y, loss;
  std::vector<const void*> addresses;  // addresses_of the parameters at the capture, checked before each replay
};

namespace {

// `waiter` waits for the work queued on `producer` so far (an event: the host does not wait).
void stream_waits(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  if (waiter == producer) return;
  at::cuda::CUDAEvent done;
  done.record(producer);
  done.block(waiter);
}

bool same_shape(const torch::Tensor& buffer, const torch::Tensor& host) {
  return buffer.defined() && buffer.sizes() == host.sizes() && buffer.scalar_type() == host.scalar_type();
}

// The parameters' gradients (undefined where there is none yet).
std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

// Whether every gradient is the tensor it was, at the same address (none made, none replaced).
bool grads_kept(const std::vector<torch::Tensor>& before, const std::vector<torch::Tensor>& now) {
  for (size_t i = 0; i < before.size(); ++i) {
    if (before[i].defined() != now[i].defined()) return false;
    if (before[i].defined() && (!before[i].is_same(now[i]) || before[i].data_ptr() != now[i].data_ptr())) return false;
  }
  return true;
}

// Where the graph reads and writes the model: each parameter's and gradient's address (null: no gradient).
std::vector<const void*> addresses_of(const std::vector<torch::Tensor>& params) {
  std::vector<const void*> out;
  out.reserve(2 * params.size());
  for (const auto& p : params) out.push_back(p.data_ptr()), out.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
  return out;
}

// Ends a capture that threw: cudaStreamEndCapture (inside capture_end) takes the stream out of capture
// whether or not the capture was still valid; what it held is discarded with the graph. Its error, and
// the one CUDA keeps for the next call, are dropped: the exception that stopped the capture is the reason.
void end_failed_capture(at::cuda::CUDAGraph& graph) {
  try {
    graph.capture_end();
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the capture's own error is reported
  }
  (void)cudaGetLastError();
}

}  // namespace

StepGraph::StepGraph(GraphEligibility eligibility, config::CudaGraphs mode, std::vector<torch::Tensor> params)
    : eligibility_(std::move(eligibility)), mode_(mode), params_(std::move(params)) {}

StepGraph::~StepGraph() = default;

torch::Tensor StepGraph::run(const MicroBatchWork& w, parallel::Strategy& strategy, bool last) {
  if (!eligibility_.capture || !failure_.empty()) {
    ++eager_;
    return eager_micro_batch(w, strategy, last);
  }
  if (!cuda_ && !start(w.device, strategy)) {
    ++eager_;
    return eager_micro_batch(w, strategy, last);
  }
  const auto caller = c10::cuda::getCurrentCUDAStream(w.device.index());
  stream_waits(cuda_->side, caller);
  torch::Tensor l;
  {
    const c10::cuda::CUDAStreamGuard on_side(cuda_->side);
    l = graphed(w, strategy, last);
  }
  stream_waits(caller, cuda_->side);
  if (!l.defined()) {  // the capture failed (nothing of it ran): this micro-batch eager, on the caller's stream
    ++eager_;
    return eager_micro_batch(w, strategy, last);
  }
  if (cuda_->graph && l.is_same(cuda_->loss)) return cuda_->loss.clone();  // on the caller's stream: the next replay rewrites it
  l.record_stream(caller);  // made on `side`, read and freed on the caller's stream
  return l;
}

// Before the first graphed micro-batch (between steps: no autograd graph alive): the side stream, and
// the strategy's kept accumulator nodes made on it (cuda_graph.h, rule 3), so that the warm-up, the
// capture and the replays accumulate gradients on `side`. False (the run goes on eager) when a node
// stayed on another stream: a capture would reach that stream.
bool StepGraph::start(torch::Device device, parallel::Strategy& strategy) {
  cuda_ = std::make_unique<Cuda>(device);
  const c10::cuda::CUDAStreamGuard on_side(cuda_->side);
  if (strategy.hooks_to_current_stream()) return true;
  give_up("a gradient accumulator node is held by a live autograd graph and stays on another stream than the "
          "capture's");
  return false;
}

// On `side`: warm-up, capture (then its replay), replay, or eager for a batch the graph does not fit.
// Returns an undefined tensor when the capture failed (failure_ says why).
torch::Tensor StepGraph::graphed(const MicroBatchWork& w, parallel::Strategy& strategy, bool last) {
  auto& c = *cuda_;
  if (!c.graph) {
    if (warmed_ < kWarmupMicroBatches) {
      ++warmed_;
      ++eager_;
      return eager_micro_batch(w, strategy, last);
    }
    return capture(w, strategy, last);
  }
  if (!same_shape(c.x, w.batch.x) || !same_shape(c.y, w.batch.y) || w.micro_batches != captured_micro_batches_) {
    ++eager_;  // static shapes only: this batch runs eager (still on `side`, ordered with the replays)
    return eager_micro_batch(w, strategy, last);
  }
  if (addresses_of(params_) != c.addresses) {  // something outside the graph replaced a weight or a gradient
    give_up("a parameter or gradient tensor was replaced after the capture (the graph reads and writes fixed addresses)");
    return {};
  }
  {
    const device::LabelScope input(device::Label::input);
    // As device::to_device copies: from page-locked memory without waiting (the pinned copy is kept by
    // LibTorch's host allocator until the copy on `side` is done).
    c.x.copy_(w.batch.x.pin_memory(), /*non_blocking=*/true);
    c.y.copy_(w.batch.y.pin_memory(), /*non_blocking=*/true);
  }
  c.graph->replay();
  ++replays_;
  return c.loss;
}

// Captures micro_batch_pass on the static inputs, checks that the gradients are the tensors they were,
// then replays the graph once: the capture itself ran nothing, so this micro-batch's work is that replay.
// A capture that throws, or that replaced a gradient, is discarded (the gradients put back) and the run
// goes on eager.
torch::Tensor StepGraph::capture(const MicroBatchWork& w, parallel::Strategy& strategy, bool last) {
  auto& c = *cuda_;
  {
    const device::LabelScope input(device::Label::input);
    c.x = device::to_device(w.batch.x, w.device);  // made and filled before the capture: the graph's inputs
    c.y = device::to_device(w.batch.y, w.device);
  }
  const auto before = grads_of(params_);
  c10::cuda::device_synchronize();  // once: nothing of the warm-up is in flight while the capture starts
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  try {
    graph->capture_begin();
  } catch (const std::exception& e) {
    give_up(fmt::format("capture_begin failed: {}", e.what()));
    return {};
  }
  try {
    c.loss = micro_batch_pass(w, c.x, c.y, strategy, last);
    graph->capture_end();
  } catch (const std::exception& e) {
    end_failed_capture(*graph);
    c.loss = torch::Tensor();
    give_up(fmt::format("the capture failed: {}", e.what()));
    return {};
  }
  if (!grads_kept(before, grads_of(params_))) {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = before[i];
    c.loss = torch::Tensor();
    give_up("the capture replaced a gradient tensor (the graph would accumulate into tensors the optimizer does not read)");
    return {};
  }
  c.graph = std::move(graph);
  captured_micro_batches_ = w.micro_batches;
  c.addresses = addresses_of(params_);
  c.graph->replay();
  ++replays_;
  return c.loss;
}

void StepGraph::give_up(const std::string& why) {
  failure_ = why.substr(0, 2000);
  cuda_->x = torch::Tensor(), cuda_->y = torch::Tensor();
  spdlog::warn("train.cuda_graphs: {}; the run goes on eager", failure_);
}

std::string StepGraph::mode() const { return cuda_ && cuda_->graph && failure_.empty() ? "graph" : "eager"; }

std::string StepGraph::reason() const {
  if (!eligibility_.capture) return eligibility_.reason;
  if (!failure_.empty()) return failure_;
  if (!cuda_ || !cuda_->graph) return fmt::format("no micro-batch after the {} eager warm-up ones yet", kWarmupMicroBatches);
  return "";
}

std::string StepGraph::describe() const {
  if (!eligibility_.capture) return fmt::format("eager: {}", eligibility_.reason);
  return fmt::format("graph after {} eager warm-up micro-batches (train.cuda_graphs: {})", kWarmupMicroBatches,
                     mode_.name());
}

nlohmann::json StepGraph::summary() const {
  return {{"setting", mode_},
          {"mode", mode()},
          {"reason", reason().empty() ? nlohmann::json(nullptr) : nlohmann::json(reason())},
          {"captured", cuda_ && cuda_->graph != nullptr},
          {"replays", replays_},
          {"eager_micro_batches", eager_},
          {"warmup_micro_batches", kWarmupMicroBatches}};
}

}  // namespace sl::train
