// The model's shape: the sizes model.* gives the GPT-2 / LLaMA that model/gpt.h builds, resolved once
// from the recipe's model section, with the arithmetic its readers share (each block's MLP width,
// whether the blocks are alike, the parameters of each sharding unit, the largest tensor). The memory
// model, the budget solver's FLOP costs, the MFU's FLOP count, the Hugging Face mapping and the model
// itself read it; the parser's validation too, which is why it sits in config/, under all of them.
#pragma once
#include <cstdint>
#include <vector>

#include "config/config.h"
#include "config/lora.h"

namespace sl::config {

// Parameter counts saturate here, so that byte counts made from them (x16) cannot overflow.
inline constexpr int64_t kMaxParams = INT64_MAX / 64;

struct Shape {
  int64_t n_layer = 0, n_embd = 0, n_head = 0, max_seq_len = 0;  // L, C, nh, T
  // V: rows of the token table and of an untied LM head, model.vocab_size padded to model.vocab_multiple
  // (ModelConfig::padded_vocab); the parameters, their bytes and the head's matmul count these rows.
  int64_t vocab_rows = 0;
  Arch arch = Arch::kGpt2;
  bool llama = false;  // arch llama: RMSNorm, SwiGLU, RoPE (no position table)
  bool bias = false;   // the linears and norms have biases (model.bias; never under llama)
  bool tied = false;   // model.tie_embeddings: the LM head is the token embedding

  Shape() = default;
  explicit Shape(const ModelConfig& m);

  // MLP inner size: model.mlp_hidden, or when 0 4C (gpt2) / 2/3 of 4C rounded up to 256 (llama).
  int64_t hidden() const { return hidden_; }
  // Block `layer`'s: its model.layer_mlp_hidden entry when that is set and > 0, else hidden().
  int64_t hidden(int64_t layer) const;
  // Every block has the same width (model.layer_mlp_hidden gives none its own).
  bool uniform() const { return uniform_; }
  // The largest MLP inner size of any block.
  int64_t widest_mlp() const { return widest_; }

  // Parameters of model/gpt.cpp's units, closed formulas saturating at kMaxParams: the embeddings
  // (token table, + position table for gpt2), block `layer`, the head (final norm, + LM head when
  // untied), the whole model (O(n_layer) only when the blocks differ).
  int64_t embedding_params() const;
  int64_t block_params(int64_t layer) const { return block_params_of_width(hidden(layer)); }  // adapters included
  // model.lora: the adapters' parameters of block `layer` (config/lora.h), and of the model: what trains
  // (without adapters: total_params()).
  int64_t lora_block_params(int64_t layer) const;
  int64_t trained_params() const;
  // The 1-D parameters (norm weights, biases): of the frozen ones under model.lora, the rest are matrices.
  int64_t vector_params() const;
  // The frozen weights' bytes under model.lora (0 without): 4 a parameter, 2 a matrix element with base_dtype bf16.
  int64_t frozen_bytes() const;
  int64_t head_params() const;
  int64_t total_params() const;
  // Of total_params(), the vocabulary padding's rows (zero, never trained): vocab_rows - model.vocab_size
  // rows of wte, and of lm_head when untied.
  int64_t padding_params() const { return padding_params_; }
  // The widest block's parameters (a block of widest_mlp()), the largest sharding unit, and the
  // largest single parameter tensor.
  int64_t widest_block_params() const { return block_params_of_width(widest_); }
  int64_t largest_unit_params() const;
  int64_t largest_param() const;
  // The largest parameter that trains: largest_param(), or under model.lora the largest adapter matrix.
  int64_t largest_trained_param() const;
  // The parameters that train of the embeddings, the widest block and the head (zero3's units): theirs, or
  // under model.lora 0, the widest block's adapters and 0.
  int64_t trained_embedding_params() const { return lora_.enabled() ? 0 : embedding_params(); }
  int64_t trained_widest_block_params() const;
  int64_t trained_head_params() const { return lora_.enabled() ? 0 : head_params(); }

 private:
  int64_t block_params_of_width(int64_t H) const;
  std::vector<int64_t> layer_hidden_;  // model.layer_mlp_hidden (0 = hidden()); empty = uniform
  LoraConfig lora_;
  int64_t hidden_ = 0, widest_ = 0, padding_params_ = 0;
  bool uniform_ = true;
};

// model.lora.targets resolved for block `layer` (config/lora.h: lora_targets_of_width at its MLP width), in the
// table's order (each once). Throws ConfigError naming model.lora for a name the arch does not have.
std::vector<LoraTarget> lora_targets(const ModelConfig& m, int64_t layer);
// The target names model.lora resolves to, in the table's order (what adapter_config.json lists).
std::vector<std::string> lora_target_names(const ModelConfig& m);

}  // namespace sl::config
