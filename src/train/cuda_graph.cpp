// train.cuda_graphs (see cuda_graph.h): the eligibility list and the captured micro-batch.
#include "train/cuda_graph.h"

#include <cstdlib>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
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

// Rules 1-9 of cuda_graph.h's list, in its order; rule 10 (static shapes) is checked per micro-batch in
// StepGraph::graphed.
GraphEligibility graph_eligibility(const config::RunConfig& cfg, int64_t world, torch::Device device) {
  const auto eager = [](std::string why) { return GraphEligibility{false, std::move(why)}; };
  if (!cfg.train.cuda_graphs.wanted()) return eager("train.cuda_graphs: off");
  if (!device.is_cuda())
    return eager(
        fmt::format("the run is on the {} device: CUDA graphs need CUDA", c10::DeviceTypeName(device.type(), true)));
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
    return eager(
        "logging.memory_timeline: it records each allocation of a step, and a replayed graph allocates nothing");
  if (cfg.model.dropout > 0.0)
    return eager("model.dropout > 0: a recompute restores the CUDA generator's state, which cannot be read under "
                 "capture, and a capture that fails part-way leaves the generator in capture mode");
  if (cfg.optim.in_backward)
    return eager("optim.in_backward: the updates in the backward advance step counts on the host, which a replay "
                 "would not");
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
// A CUDAGraph that tells whether its capture ended (CUDAGraph::reset releases the graph's pool then,
// and only then). Not in an anonymous namespace: StepGraph::Cuda, a member of an exported class, holds
// one (GCC's -Wsubobject-linkage, where a unity build includes this file).
struct CapturedGraph : at::cuda::CUDAGraph {
  bool ended() const { return capture_ended_; }
};

// Memory: the capture allocates into `pool`, a private pool of the caching allocators (device and
// page-locked host) named before the capture (at::cuda::graph_pool_handle), so that a capture that fails
// can end allocation to it and release it here (release_failed_capture): CUDAGraph::capture_end ends it
// only after cudaStreamEndCapture succeeded, and its reset() releases it only after a capture that
// ended. Left on, the allocator would go on believing a capture is under way (no event processing, no
// cache release) and every record_stream'ed block would stay held for the rest of the run.
// Capture mode: thread-local (cudaStreamCaptureModeThreadLocal): only the capturing thread is barred
// from the calls a capture cannot hold (a synchronization, a host read), not the others: state.async's
// writer thread waits on a CUDA event (HostSnapshot::wait) while the step after a save may capture, and
// under the global mode that wait would invalidate the capture. The work a capture records is the
// capturing stream's, whichever thread queues it (autograd's device thread queues the backward).
struct StepGraph::Cuda {
  explicit Cuda(torch::Device device)
      : side(c10::cuda::getStreamFromPool(false, device.index())), pool(at::cuda::graph_pool_handle()) {}
  c10::cuda::CUDAStream side;
  at::cuda::MempoolId_t pool;
  std::unique_ptr<CapturedGraph> graph;
  torch::Tensor x, y, loss;
  torch::Tensor factor;  // a masked batch's loss factor (micro_batch.h), filled before each replay; else undefined
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
  for (const auto& p : params)
    out.push_back(p.data_ptr()), out.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
  return out;
}

// Takes `stream` out of a capture still under way (the capture threw before capture_end, or capture_end
// threw before ending it): cudaStreamEndCapture ends it whether or not it was still valid, and the graph
// it gives (none for an invalidated capture) is destroyed. Errors are dropped, the one CUDA keeps for the
// next call too: the exception that stopped the capture is the reason reported.
void end_stream_capture(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t left = nullptr;
    if (cudaStreamEndCapture(stream.stream(), &left) == cudaSuccess && left != nullptr) (void)cudaGraphDestroy(left);
  }
  (void)cudaGetLastError();
}

// Ends allocation to `pool` in the device's caching allocator and in the page-locked host one, where it
// is still on; false when neither had it on (capture_begin never began it, or capture_end ended it).
bool end_allocating_to(c10::DeviceIndex device, const at::cuda::MempoolId_t& pool) {
  bool was_on = false;
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
    was_on = true;
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): "not currently recording": already ended
  }
  try {
    at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): as above
  }
  return was_on;
}

// After a capture that failed anywhere from capture_begin on: the stream out of capture, allocation to the
// graph's pool ended in both allocators, and the pool released in both (its blocks go back to the device
// and the host once the tensors in them are freed) unless the graph's own reset() will (a capture that
// ended). `begun`: capture_begin returned, so the pool was made (else only an allocation the failed
// capture_begin turned on says so).
void release_failed_capture(const CapturedGraph& graph, const c10::cuda::CUDAStream& stream,
                            const at::cuda::MempoolId_t& pool, bool begun) {
  end_stream_capture(stream);
  const bool was_on = end_allocating_to(stream.device_index(), pool);
  if (graph.ended() || (!begun && !was_on)) return;
  try {
    c10::cuda::CUDACachingAllocator::releasePool(stream.device_index(), pool);
    at::getHostAllocator(at::kCUDA)->release_pool(pool);
  } catch (const std::exception& e) {
    spdlog::warn("train.cuda_graphs: releasing the failed capture's memory pool: {}", e.what());
  }
}

// A test hook (tests/test_train.cpp's [cuda] cases): SUBLINEAR_TEST_CAPTURE in the environment does, inside
// the capture after the micro-batch was queued, what a capture must survive or fail on:
//   host_read    reads the loss on the host (a synchronization: the capture fails, the run goes on eager);
//   writer_wait  another thread waits on a CUDA event recorded before the capture, as state.async's writer
//                does (the thread-local capture mode lets it: the capture succeeds).
// Unset (every real run): nothing.
void test_probe_in_capture(const torch::Tensor& loss, const at::cuda::CUDAEvent& before) {
  static const char* const probe = std::getenv("SUBLINEAR_TEST_CAPTURE");
  if (probe == nullptr) return;
  const std::string_view what(probe);
  if (what == "host_read") (void)loss.item<double>();
  if (what == "writer_wait") std::thread([&before] { before.synchronize(); }).join();
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
    hooks_back(strategy);
    ++eager_;
    return eager_micro_batch(w, strategy, last);
  }
  // on the caller's stream: the next replay rewrites it
  if (cuda_->graph && l.is_same(cuda_->loss)) return cuda_->loss.clone();
  l.record_stream(caller);  // made on `side`, read and freed on the caller's stream
  return l;
}

// Before the first graphed micro-batch (between steps: no autograd graph alive): the side stream, and
// the strategy's kept accumulator nodes made on it (cuda_graph.h, rule 3), so that the warm-up, the
// capture and the replays accumulate gradients on `side`. False (the run goes on eager) when a node
// stayed on another stream: a capture would reach that stream.
bool StepGraph::start(torch::Device device, parallel::Strategy& strategy) {
  cuda_ = std::make_unique<Cuda>(device);
  {
    const c10::cuda::CUDAStreamGuard on_side(cuda_->side);
    if (strategy.hooks_to_current_stream()) return true;
  }
  give_up("a gradient accumulator node is held by a live autograd graph and stays on another stream than the "
          "capture's");
  hooks_back(strategy);
  return false;
}

// After giving up (on the caller's stream): the strategy's accumulator nodes made again on the caller's
// stream, where the eager micro-batches run from now on; left on the side stream, every gradient would
// cross streams (record_stream'ed, its memory reused only after an event).
void StepGraph::hooks_back(parallel::Strategy& strategy) {
  if (!strategy.hooks_to_current_stream())
    spdlog::warn("train.cuda_graphs: a gradient accumulator node stays on the graph's side stream (a live autograd "
                 "graph holds it): gradients cross streams");
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
  if (!same_shape(c.x, w.batch.x) || !same_shape(c.y, w.batch.y) || w.micro_batches != captured_micro_batches_ ||
      c.factor.defined() != (w.loss_factor > 0.0) || w.batch.positions.defined()) {
    ++eager_;  // static shapes only: this batch runs eager (still on `side`, ordered with the replays)
    return eager_micro_batch(w, strategy, last);
  }
  if (addresses_of(params_) != c.addresses) {  // something outside the graph replaced a weight or a gradient
    give_up(
        "a parameter or gradient tensor was replaced after the capture (the graph reads and writes fixed addresses)");
    return {};
  }
  {
    const device::LabelScope input(device::Label::input);
    // As device::to_device copies: from page-locked memory without waiting (the pinned copy is kept by
    // LibTorch's host allocator until the copy on `side` is done).
    c.x.copy_(w.batch.x.pin_memory(), /*non_blocking=*/true);
    c.y.copy_(w.batch.y.pin_memory(), /*non_blocking=*/true);
    if (c.factor.defined()) c.factor.fill_(w.loss_factor);
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
    c.factor = loss_factor_tensor(w);
  }
  const auto before = grads_of(params_);
  c10::cuda::device_synchronize();  // once: nothing of the warm-up is in flight while the capture starts
  at::cuda::CUDAEvent before_capture;
  before_capture.record(c.side);
  auto graph = std::make_unique<CapturedGraph>();
  try {
    graph->capture_begin(c.pool, cudaStreamCaptureModeThreadLocal);
  } catch (const std::exception& e) {
    release_failed_capture(*graph, c.side, c.pool, /*begun=*/false);
    give_up(fmt::format("capture_begin failed: {}", e.what()));
    return {};
  }
  try {
    c.loss = micro_batch_pass(w, c.x, c.y, c.factor, strategy, last);
    test_probe_in_capture(c.loss, before_capture);
    graph->capture_end();
  } catch (const std::exception& e) {
    c.loss = torch::Tensor();  // its block goes back to the pool before the pool is released
    // A backward cut short may have left a .grad made in the pool (never computed): the old ones back.
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = before[i];
    release_failed_capture(*graph, c.side, c.pool, /*begun=*/true);
    give_up(fmt::format("the capture failed: {}", e.what()));
    return {};
  }
  if (!grads_kept(before, grads_of(params_))) {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = before[i];
    c.loss = torch::Tensor();
    give_up(
        "the capture replaced a gradient tensor (the graph would accumulate into tensors the optimizer does not read)");
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
  cuda_->x = torch::Tensor(), cuda_->y = torch::Tensor(), cuda_->factor = torch::Tensor();
  spdlog::warn("train.cuda_graphs: {}; the run goes on eager", failure_);
}

std::string StepGraph::mode() const { return cuda_ && cuda_->graph && failure_.empty() ? "graph" : "eager"; }

std::string StepGraph::reason() const {
  if (!eligibility_.capture) return eligibility_.reason;
  if (!failure_.empty()) return failure_;
  if (!cuda_ || !cuda_->graph)
    return fmt::format("no micro-batch after the {} eager warm-up ones yet", kWarmupMicroBatches);
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
