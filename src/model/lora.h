// LoRA (Hu et al. 2021) on a block's projection y = x W^T + b, W (N, K): each targeted row range
// [row0, row0 + rows) of W (config/lora.h) gets a trainable low-rank update, and
//   y = x W^T + b + scale * B (A dropout(x)),   A (r, K), B (rows, r), scale = alpha / r,
// added to the output columns of its range (zero elsewhere). A starts as PEFT's (kaiming-uniform,
// U(-1/sqrt(K), 1/sqrt(K))), B as zero, so the adapted model starts as the base.
//
// One autograd shape in every mode, so that recomputing it gives the same bits (recompute/checkpoint.cpp
// runs delta() again in a selective piece's backward): x is read once (one dropout mask per projection,
// shared by its pieces, where PEFT draws one per module; the expectation is the same), the pieces' A
// are stacked into one (sum r, K) matrix and multiplied once, each piece's B takes its r columns of
// that, and delta() is one (.., N) tensor: the projection's input then has exactly two consumers (W
// and the adapter), whose gradients sum in either order to the same bits.
#pragma once
#include <torch/nn/module.h>
#include <torch/types.h>

#include <vector>

namespace sl::model {

struct LoraPiece {
  int64_t row0 = 0, rows = 0;
  torch::Tensor A, B;  // the block's parameters (handles)
};

struct LoraAdapter {
  std::vector<LoraPiece> pieces;  // by row0; empty: the projection has no adapter
  int64_t out_features = 0;       // N
  double scale = 1.0, dropout = 0.0;
  const torch::nn::Module* owner = nullptr;  // the block: its is_training() turns the dropout on
  bool empty() const { return pieces.empty(); }
  // The parameters, A and B of each piece in turn.
  std::vector<torch::Tensor> params() const;
  // scale * B (A dropout(x)) on each piece's columns, zero elsewhere: (.., N) in the linear's compute dtype.
  torch::Tensor delta(const torch::Tensor& x) const;
  // y + delta(x), or y itself without pieces.
  torch::Tensor add_to(const torch::Tensor& y, const torch::Tensor& x) const { return empty() ? y : y + delta(x); }
  // The adapted projection of x: model::linear(x, W, b) + delta(x).
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) const;
  // scale * B A of each piece, in W's rows: (N, K) fp32 on the host, zero outside the pieces (merging).
  torch::Tensor weight_delta(int64_t in_features) const;
};

}  // namespace sl::model
