// train.cuda_graphs: one micro-batch's forward and backward (the loss included) captured into a CUDA graph
// (at::cuda::CUDAGraph) and replayed for every later micro-batch, where the run is eligible; eager
// elsewhere, with the reason in the settings table and summary.json.
//
// Eligibility is decided by construction, from the recipe and the device, before the first step
// (graph_eligibility, in this order; the first that fails is the reason). The rules are stated here
// only: docs/recipes.md#cuda-graphs, where the key's help points, names them in recipe terms and links here.
//   1. train.cuda_graphs is on or auto;
//   2. the device is CUDA;
//   3. one process: without sharding (parallel::Single), or parallel.sharding zero1 (the data-parallel
//      engine, parallel::Zero1, as configs/gpt2_124m.yaml runs it). Zero1 at world 1 keeps one fp32 flat
//      gradient per bucket for the whole run (zero_grad zeroes it in place); its gradient hooks, run by
//      autograd after each parameter's accumulation, only queue device work on it: with
//      precision.param_dtype fp32 the parameters' .grad are views of it (accumulated in place), with a
//      bf16 compute copy each .grad (made by the backward, in the graph's pool) is added into its slice
//      and dropped; the bucket's all-reduce and the average are skipped at world 1 (nothing launched,
//      nothing waited for); the rest of a hook is host bookkeeping that decides nothing at world 1. The
//      engine keeps each parameter's autograd accumulator node from set-up, and autograd accumulates on
//      the stream that node was made on: the graph re-makes them on its side stream before its first
//      micro-batch (Strategy::hooks_to_current_stream), else the capture would reach the default stream.
//      Eager: any engine at world > 1 (collectives), zero2 (a transient gradient buffer made and freed
//      per micro-batch and counted on the host: the transient peak a replay would not count), zero3
//      (units gathered and released per micro-batch, with host counts of gathers);
//   4. no offload.* (host copies and host synchronizations inside the micro-batch);
//   5. precision.compute is not fp16 (the loss scaler's scale and checks);
//   6. no memory.limit: it is checked at each allocation, and a replay allocates nothing;
//   7. no logging.memory_timeline: it records each allocation of a step;
//   8. model.dropout 0: a recompute restores the CUDA generator's state, which cannot be read under
//      capture, and a capture that fails part-way would leave the generator in capture mode;
//   9. no checkpointing.check_recompute (it reads checksums to the host);
//  10. static shapes: train.micro_batch is resolved to a number before the first step (auto's search runs
//      at set-up) and the loader's batches are micro_batch x seq_len; a batch of another shape, or a step
//      of another number of micro-batches, runs eager.
// At run time (StepGraph):
//   - gradients exist before capture: the first kWarmupMicroBatches micro-batches run eager (they create
//     .grad and let cuBLAS and the caching allocator set up on the side stream); the strategy zeroes the
//     gradients in place (Single::zero_grad, Engine::zero_grad), so their addresses stay; the capture
//     accumulates into them (zero1 with a bf16 compute copy: into the flat gradient, the .grad undefined
//     between micro-batches).
//     A capture after which a gradient is not the same tensor is discarded (the old gradients put back);
//   - the loss is the graph's static float64 output, copied out after each replay; the step reads it with
//     its one host read, as without graphs;
//   - a capture that throws (an op that synchronizes, a kernel that cannot be captured) is ended, its
//     graph discarded, its memory pool ended and released in the device and host caching allocators
//     (the capture allocates into a pool named before it: cuda_graph.cpp), the strategy's accumulator
//     nodes made again on the caller's stream, the micro-batch run eager, and every later one eager: the
//     summary names the error;
//   - the capture is thread-local (cudaStreamCaptureModeThreadLocal): another thread may synchronize
//     meanwhile (state.async's writer waits on a CUDA event while the step after a save captures).
// Test hook: SUBLINEAR_TEST_CAPTURE=host_read | writer_wait (cuda_graph.cpp, test_probe_in_capture).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "train/micro_batch.h"
#include "train/trainer.h"

namespace sl::parallel {
class Strategy;
}

namespace sl::train {

// Whether a run captures (train.cuda_graphs wanted and every condition above met), and why not.
struct GraphEligibility {
  bool capture = false;
  std::string reason;  // why the run is eager; "" when it captures
};

// The eligibility list above, a pure function of the recipe, the world size and the resolved device.
GraphEligibility graph_eligibility(const config::RunConfig& cfg, int64_t world, torch::Device device);

// A run's CUDA graph of one micro-batch (see the top of this file). Made at set-up for every run whose
// recipe wants graphs; a run that is not eligible keeps it to report why, and runs eager through it.
class StepGraph {
 public:
  static constexpr int64_t kWarmupMicroBatches = 3;

  // `params`: the model's parameters, whose .grad tensors a capture must keep.
  StepGraph(GraphEligibility eligibility, config::CudaGraphs mode, std::vector<torch::Tensor> params);
  // Every micro-batch eager: the runner of a caller that has no graph (the micro-batch probe, tests).
  StepGraph() : StepGraph({false, "train.cuda_graphs: off"}, config::CudaGraphs::kOff, {}) {}
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs one micro-batch: eager (not eligible, warming up, after a failed capture, a batch of another
  // shape), captured then replayed (the first after the warm-up), or replayed. Returns its loss as
  // eager_micro_batch does (a tensor of its own, not the graph's output).
  torch::Tensor run(const MicroBatchWork& w, parallel::Strategy& strategy, bool last);

  // Whether the run is eligible (graph_eligibility): it captures after the warm-up.
  bool eligible() const { return eligibility_.capture; }
  // "graph" once a capture succeeded and no failure followed, else "eager".
  std::string mode() const;
  // Why the run is eager ("" while it captures or replays).
  std::string reason() const;
  // The settings table's row: "graph (...)" or "eager: <reason>".
  std::string describe() const;
  // summary.json's cuda_graphs block: mode, reason, whether a graph was captured, micro-batches replayed
  // and run eager.
  nlohmann::json summary() const;

 private:
  struct Cuda;  // the graph, its side stream and static buffers (cuda_graph.cpp)
  bool start(torch::Device device, parallel::Strategy& strategy);
  torch::Tensor graphed(const MicroBatchWork& w, parallel::Strategy& strategy, bool last);
  torch::Tensor capture(const MicroBatchWork& w, parallel::Strategy& strategy, bool last);
  void give_up(const std::string& why);
  void hooks_back(parallel::Strategy& strategy);

  GraphEligibility eligibility_;
  config::CudaGraphs mode_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<Cuda> cuda_;
  std::string failure_;  // a capture's error: eager from then on
  int64_t warmed_ = 0, replays_ = 0, eager_ = 0;
  double captured_micro_batches_ = 0.0;  // the step's micro-batch count the graph divides by
};

}  // namespace sl::train
