// Gradient clipping on the single-process path (parallel/engine.h clips sharded gradients itself), and
// the float64 sum of squares both paths' norms take on CPU gradients.
#pragma once
#include <optional>
#include <vector>

#include <torch/types.h>

namespace sl::optim {

// The global L2 norm of `grads` as a 0-d fp32 tensor on their device (torch::nn::utils::clip_grad_norm_'s
// quantity) and, when clip > 0, every gradient multiplied by min(1, clip / (norm + 1e-6)) in fp32, or
// left alone when the norm is not finite (the step is then skipped or aborted). Nothing is read from a
// GPU: there the coefficient stays on the device. Contiguous fp32 CPU gradients (the CPU path) take two
// passes over all of them on the intra-op threads: squares summed in fp64 (pieces in a fixed order, so
// the bits depend on no thread count), then the scaling, skipped when the coefficient is 1; the ATen
// form would be ~300 ops a step (a norm and a mul_ per tensor, most too small to split over threads).
// Anything else takes the ATen ops (per-tensor norms in fp32, their norm, mul_ by the coefficient).
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double clip);

// The sum of the squares of every element of `grads` in fp64, the CPU path's first pass above (each
// square exact in fp64; pieces of 32 Ki elements summed on the intra-op threads, then in piece order,
// so the bits depend on no thread count), for contiguous fp32 CPU tensors; nullopt for any other.
// parallel::Engine's gradient norm takes it where its gradients live on the CPU.
std::optional<double> sum_of_squares(const std::vector<torch::Tensor>& grads);

}  // namespace sl::optim
