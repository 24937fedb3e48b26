// The pieces a block's forward is written with, shared by the block (model/gpt.h) and its ops
// (model/block_ops.h): the RoPE tables, the four cheap-op -> linear pairs selective recompute works on
// (Part), and the hook that runs each pair (LinearAfter).
#pragma once
#include <torch/types.h>

#include <functional>
#include <vector>

#include "model/lora.h"

namespace sl::model {

// What a block needs of the positions: RoPE rotation tables, (T, head_dim / 2) each, or for packed rows
// (B, 1, T, head_dim / 2), each row's own positions; undefined for learned positions. And for packed rows
// the attention mask, (B, 1, T', T') bool over the whole row (T' = T times the sequence degree), true
// where a query may attend a key: its own example's positions up to itself; undefined: plainly causal.
struct Rope {
  torch::Tensor cos, sin;
  torch::Tensor mask;
};

// The four places in a block where a cheap op feeds a linear layer. Selective recompute works on
// exactly these pairs: the cheap op's output is saved by nobody but the linear, so not keeping it
// (and recomputing it in backward) is what saves memory.
enum class Part { norm1_qkv, attention_proj, norm2_fc, act_out };

// cheap(inputs) followed by linear(W, b) and the projection's LoRA adapter (lora.add_to; empty: none). The
// block calls it once per Part; the default runs them plainly, a checkpointing runner passes one that keeps
// only the cheap op's inputs.
using CheapFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
using LinearAfter = std::function<torch::Tensor(
    Part part, const CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
    const std::vector<torch::Tensor>& cheap_params, const torch::Tensor& W, const torch::Tensor& b,
    const LoraAdapter& lora)>;

}  // namespace sl::model
