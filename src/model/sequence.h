// Sequence parallelism (Ulysses) as the model sees it: the N ranks of a sequence group hold one
// sequence's positions in N equal consecutive pieces; attention exchanges positions for heads with an
// all-to-all before it (every rank then holds the whole sequence for n_head / N heads) and heads for
// positions after it. Everything else in the model is position-wise and runs on the local piece.
//
// The model owns no communication: whoever runs it (parallel/sequence.h) gives it a SequenceExchange,
// the group's all-to-all. With none (one rank per sequence) the model is exactly the unsharded one.
#pragma once
#include <cstdint>
#include <memory>

#include <torch/types.h>

namespace sl::model {

class SequenceExchange {
 public:
  virtual ~SequenceExchange() = default;
  virtual int64_t degree() const = 0;  // N
  virtual int64_t rank() const = 0;    // this rank's piece: positions [rank * T/N, (rank + 1) * T/N)
  // out <- all-to-all of `in` over the group: `in` (contiguous) is N equal chunks along dim 0, chunk j
  // goes to the group's rank j; out (same shape, contiguous) gets rank j's chunk for this rank at j.
  // Every rank of the group calls it at the same point with the same shape.
  virtual void all_to_all(const torch::Tensor& out, const torch::Tensor& in) = 0;
};

// x: (B, T/N, G, nh, hd), G groups of nh heads for this rank's positions (qkv: G = 3) -> (B, T, G, nh/N,
// hd), contiguous: the whole sequence for this rank's heads [rank * nh/N, (rank + 1) * nh/N) of every group.
// Differentiable: the gradient takes the inverse exchange. Saves nothing for backward.
torch::Tensor positions_to_heads(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& x);
// The inverse: y (B, T, G, nh/N, hd) -> (B, T/N, G, nh, hd), contiguous. Differentiable likewise.
torch::Tensor heads_to_positions(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& y);

}  // namespace sl::model
