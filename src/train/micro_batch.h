// One micro-batch's forward and backward, as a step runs it eagerly and a CUDA graph captures it
// (train/cuda_graph.h): the one body both paths share, below both.
#pragma once
#include <torch/torch.h>

#include "data/loader.h"
#include "train/trainer.h"

namespace sl::parallel {
class Strategy;
}

namespace sl::train {

// One micro-batch as forward_backward hands it over: the loss function, the batch (host tensors), the
// device, the step's precision and the number of micro-batches of the step (each loss is divided by it).
struct MicroBatchWork {
  const LossFn& loss;
  const data::Batch& batch;
  torch::Device device;
  const StepPrecision& precision;
  double micro_batches = 1.0;
};

// One micro-batch's forward and backward on device tensors `x`, `y` (what a graph captures): the forward
// under autocast, the backward of loss / micro_batches (times the loss scale) bracketed by the strategy's
// hooks (`last`: the step's last micro-batch). Returns the loss, detached, as a 0-d float64 tensor.
torch::Tensor micro_batch_pass(const MicroBatchWork& w, const torch::Tensor& x, const torch::Tensor& y,
                               parallel::Strategy& strategy, bool last);
// The same with the batch copied to the device first: a micro-batch without a graph.
torch::Tensor eager_micro_batch(const MicroBatchWork& w, parallel::Strategy& strategy, bool last);

}  // namespace sl::train
