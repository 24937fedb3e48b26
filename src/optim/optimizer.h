// AdamW as every training path builds it: matrices (dim >= 2) decay with train.weight_decay, vectors
// do not. The tensors are the model's parameters, or a rank's shards of them under ZeRO. Every path
// steps it with adamw_step.
#pragma once
#include <memory>
#include <vector>

#include <torch/optim/adamw.h>

#include "config/config.h"

namespace sl::optim {

inline std::unique_ptr<torch::optim::AdamW> make_adamw(std::vector<torch::Tensor> decay,
                                                       std::vector<torch::Tensor> no_decay,
                                                       const config::TrainConfig& t) {
  auto opts = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(1e-8).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(decay), opts(t.weight_decay));
  groups.emplace_back(std::move(no_decay), opts(0.0));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(t.lr));
}

// One AdamW step, the update torch::optim::AdamW::step makes (decoupled weight decay, bias-corrected
// moments), on its own state objects (so saving and loading see no difference). The step counts stay
// on the host (AdamWParamState::step) on every path. fp32 CPU parameters take one fused pass per
// tensor over parameter, gradient and both moments (the kernel below). CUDA parameters take
// adamw_step_grouped: one at::_fused_adamw_ per parameter group (one kernel launch chain over every
// tensor of the group) in place of AdamW::step's ~10 elementwise kernels per parameter. Anything else
// (amsgrad, the lazy test device, a dtype the op does not take) takes AdamW::step itself. Parameters without a gradient
// are skipped, as AdamW::step skips them. The fused pass gives the same bits on every x86-64 CPU: its
// AVX2 + FMA and baseline clones agree bitwise (device/cpu_features.h), so data-parallel replicas on
// different CPU kinds step their weights identically.
void adamw_step(torch::optim::AdamW& opt);

// The CUDA path, callable on any device the ATen op has a kernel for (CUDA, CPU: the tests compare it
// with AdamW::step on the CPU): when every parameter, gradient and moment of each group is contiguous
// and shares its parameter's device and dtype (fp32, bf16 or fp16) and no group uses amsgrad, makes the
// missing moments (zeros, as AdamW::step does), advances the host step counts, and calls
// at::_fused_adamw_ once per group (once per device and dtype within a group, were they mixed), with
// the step counts as fp32 scalars on the device. Returns false, changing nothing, otherwise. Its
// arithmetic is the same update in another order: equal to AdamW::step to float rounding.
bool adamw_step_grouped(torch::optim::AdamW& opt);

}  // namespace sl::optim
