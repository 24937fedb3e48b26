// The ops a block's forward is written in (BlockImpl::forward_with: norm, attention, residual, norm, MLP,
// residual), and what the math leaves out, kept here:
//  - the selective-recompute hook: a norm (or the MLP's activation, or the attention core) is not run
//    where it is named but by the linear that reads it, through `linear_after` (model/gpt.h's Part and
//    LinearAfter), so that a checkpointing runner can keep only the cheap op's inputs;
//  - the fused kernels' bias routing: a projection's bias goes into the residual add and GPT-2's fc bias
//    into the GELU where those kernels run (model/residual.h, model/gelu.h), else the linear keeps it.
#pragma once
#include <torch/types.h>

#include <vector>

#include "model/gpt.h"

namespace sl::model {

// A norm named but not run yet: the linear after it runs it (selective recompute's pair `part`).
struct PendingNorm {
  Part part;
  CheapFn norm;                        // x -> norm(x), run by the linear
  torch::Tensor x;                     // the stream it normalizes (B, T, C)
  std::vector<torch::Tensor> params;   // the norm's weight and bias, for the recompute's bookkeeping
};

// A branch's output before its residual add: its last linear's output y (B, T, C) and the bias that
// linear left to the add (undefined: the linear kept it).
struct Branch {
  torch::Tensor y, bias;
};

// One block's ops for one forward. Holds references: make it, use it, drop it within forward_with. The
// functions it hands to linear_after capture the block (a module that outlives the step) and values,
// never this object, since a runner may call them again in backward.
class BlockOps {
 public:
  BlockOps(const BlockImpl& block, const Rope& rope, const LinearAfter& linear_after)
      : b_(block), rope_(rope), linear_after_(linear_after) {}

  PendingNorm norm1(const torch::Tensor& x) const;  // ln1 of the stream, run by the QKV linear
  PendingNorm norm2(const torch::Tensor& h) const;  // ln2 of the stream, run by the fc linear
  // proj(attention(qkv(n))): causal self-attention of the normed stream (RoPE for LLaMA).
  Branch attention(const PendingNorm& n) const;
  // fc_out(act(fc(n))): GPT-2's tanh GELU or LLaMA's SwiGLU between two linears.
  Branch mlp(const PendingNorm& n) const;
  // stream + dropout(branch.y) (+ branch.bias, added inside the fused residual add).
  torch::Tensor residual(const torch::Tensor& stream, const Branch& branch) const;

 private:
  // b where the fused residual add onto `stream` takes it (a bf16 branch under bf16 CPU autocast or an
  // fp32 run's fp32 one, no residual dropout active; model/residual.h), else undefined.
  torch::Tensor residual_bias(const torch::Tensor& stream, const torch::Tensor& b) const;
  // The linear (W, b) of a pending norm's output.
  torch::Tensor linear(const PendingNorm& n, const torch::Tensor& W, const torch::Tensor& b) const;

  const BlockImpl& b_;
  const Rope& rope_;
  const LinearAfter& linear_after_;
};

}  // namespace sl::model
