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
// device, the step's precision and the number of micro-batches of the step (each loss is divided by it);
// for examples (a masked batch) the factor its loss is multiplied by first (masked_loss_factor, step.cpp).
struct MicroBatchWork {
  const LossFn& loss;
  const data::Batch& batch;
  torch::Device device;
  const StepPrecision& precision;
  double micro_batches = 1.0;
  double loss_factor = 0.0;  // > 0 for a masked batch only
};

// The loss factor as the pass takes it: a 0-d fp32 tensor on the device, undefined for an unmasked batch.
torch::Tensor loss_factor_tensor(const MicroBatchWork& w);

// One micro-batch's forward and backward on device tensors `x`, `y` (what a graph captures): the forward
// under autocast, the backward of loss (times `factor` when defined) / micro_batches (times the loss scale)
// bracketed by the strategy's hooks (`last`: the step's last micro-batch). Returns the loss (times the
// factor), detached, as a 0-d float64 tensor.
torch::Tensor micro_batch_pass(const MicroBatchWork& w, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& factor, parallel::Strategy& strategy, bool last);
// The same with the batch copied to the device first: a micro-batch without a graph.
torch::Tensor eager_micro_batch(const MicroBatchWork& w, parallel::Strategy& strategy, bool last);

}  // namespace sl::train
