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

#include "model/block_parts.h"
#include "model/gelu.h"
#include "model/residual.h"

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
// never this object, since a runner may call them again in backward. A template on the block's type
// (model::BlockImpl; its members named below), so the block's file includes its ops and not back.
template <class Block>
class BlockOps {
 public:
  BlockOps(const Block& block, const Rope& rope, const LinearAfter& linear_after)
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

  const Block& b_;
  const Rope& rope_;
  const LinearAfter& linear_after_;
};

// ---- the ops' bodies ----


template <class Block>
PendingNorm BlockOps<Block>::norm1(const torch::Tensor& x) const {
  return {Part::norm1_qkv, [block = &b_](const auto& in) { return block->norm1(in[0]); }, x, {b_.ln1_w, b_.ln1_b}};
}

template <class Block>
PendingNorm BlockOps<Block>::norm2(const torch::Tensor& h) const {
  return {Part::norm2_fc, [block = &b_](const auto& in) { return block->norm2(in[0]); }, h, {b_.ln2_w, b_.ln2_b}};
}

template <class Block>
torch::Tensor BlockOps<Block>::linear(const PendingNorm& n, const torch::Tensor& W, const torch::Tensor& b) const {
  return linear_after_(n.part, n.norm, {n.x}, n.params, W, b, b_.lora[static_cast<size_t>(n.part)]);
}

template <class Block>
Branch BlockOps<Block>::attention(const PendingNorm& n) const {
  const auto qkv = linear(n, b_.w_qkv, b_.b_qkv);  // (B, T, 3C)
  const auto bias = residual_bias(n.x, b_.b_proj);  // the stream the branch is added to is the norm's input
  const auto core = [block = &b_, mask = rope_.mask](const auto& in) { return block->attention_core(in, mask); };
  const auto y = linear_after_(Part::attention_proj, core, b_.attention_inputs(qkv, rope_), {}, b_.w_proj,
                               bias.defined() ? torch::Tensor() : b_.b_proj, b_.lora[1]);
  return {y, bias};
}

template <class Block>
Branch BlockOps<Block>::mlp(const PendingNorm& n) const {
  // GPT-2's fc bias goes into the fused GELU where it runs on the fc's output.
  const auto act_bias = !b_.llama && gelu_tanh_bias_fused(n.x, b_.b_fc) ? b_.b_fc : torch::Tensor();
  const auto u = linear(n, b_.w_fc, act_bias.defined() ? torch::Tensor() : b_.b_fc);  // (B, T, H) or (B, T, 2H)
  const auto bias = residual_bias(n.x, b_.b_out);
  const auto act = [block = &b_, act_bias](const auto& in) { return block->mlp_act(in[0], act_bias); };  // (B, T, H)
  const auto y = linear_after_(Part::act_out, act, {u}, {act_bias}, b_.w_out,
                               bias.defined() ? torch::Tensor() : b_.b_out, b_.lora[3]);
  return {y, bias};
}

template <class Block>
torch::Tensor BlockOps<Block>::residual(const torch::Tensor& stream, const Branch& branch) const {
  return residual_add(stream, b_.residual_dropout(branch.y), branch.bias);
}

template <class Block>
torch::Tensor BlockOps<Block>::residual_bias(const torch::Tensor& stream, const torch::Tensor& b) const {
  const bool dropout_active = b_.is_training() && b_.dropout > 0.0;  // the bias goes in before the dropout
  return !dropout_active && residual_bias_fused(stream, b) ? b : torch::Tensor();
}

}  // namespace sl::model
