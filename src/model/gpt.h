// GPT-style decoder: token embedding, learned positions (gpt2) or RoPE (llama), pre-norm Blocks
// (norm -> attention -> norm -> MLP) in a ModuleList, final norm, LM head (tied or not).
// The model holds the model and nothing else: no loss scaling, no loop, no checkpointing runner.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/block_parts.h"
#include "model/sequence.h"

namespace sl::model {

// One pre-norm transformer block: h = x + attention(norm1(x)); out = h + mlp(norm2(h)), with
//   attention(n) = drop(proj(attention_core(attention_inputs(qkv(n)))))  and  mlp(n) = drop(fc_out(act(fc(n)))).
// forward_with writes it in the ops of model/block_ops.h, which run the four cheap-op -> linear pairs above
// through linear_after; the parts below are those ops' pieces (and generate.cpp's cached step's).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const config::ModelConfig& cfg, int64_t layer, torch::Device device, bool defer_params = false);

  torch::Tensor forward(const torch::Tensor& x, const Rope& rope);  // (B, T, C) -> (B, T, C)
  torch::Tensor forward_with(const torch::Tensor& x, const Rope& rope, const LinearAfter& linear_after);

  torch::Tensor norm1(const torch::Tensor& x) const;
  torch::Tensor norm2(const torch::Tensor& x) const;
  // (B, T, 3C') qkv projection of nh heads (C' = nh * hd) -> q, k, v as (B, nh, T, hd) views.
  std::array<torch::Tensor, 3> heads(const torch::Tensor& qkv, int64_t nh) const;
  // What attention_core reads: GPT-2 the (B, T, 3C) projection itself (the fused kernel reads its heads in
  // place and returns one gradient for it); LLaMA q and k rotated by RoPE, and v.
  std::vector<torch::Tensor> attention_inputs(const torch::Tensor& qkv, const Rope& rope) const;
  // attention_inputs -> (B, T, C): local_attention, or with a sequence group (T = this rank's positions)
  // sequence_attention.
  // `mask`: Rope::mask (packed rows), undefined for causal attention.
  torch::Tensor attention_core(const std::vector<torch::Tensor>& in, const torch::Tensor& mask) const;
  // attention_inputs of nh heads -> (B, T, nh * hd): the fused causal kernel (fp32 CPU, no attention
  // dropout) or SDPA.
  // With a mask (packed rows): SDPA with it.
  torch::Tensor local_attention(const std::vector<torch::Tensor>& in, int64_t nh, const torch::Tensor& mask) const;
  // Ulysses (model/sequence.h): this rank's positions of every head -> the whole sequence of n_head / N
  // heads (one all-to-all of q, k, v together), local_attention on those, and the output back to this
  // rank's positions of every head (a second all-to-all). LLaMA's rotated q, k and v are stacked into
  // one (B, T/N, 3, nh, hd) tensor first; GPT-2's packed qkv is that layout already.
  torch::Tensor sequence_attention(const std::vector<torch::Tensor>& in, const torch::Tensor& mask) const;
  // (B, T, H) GELU of u + fc_bias (fc_bias: the fc's bias when the fused GELU adds it, else undefined),
  // or (B, T, 2H) -> (B, T, H) SwiGLU.
  torch::Tensor mlp_act(const torch::Tensor& u, const torch::Tensor& fc_bias) const;
  torch::Tensor residual_dropout(const torch::Tensor& y) const;

  int64_t layer, n_head, n_embd, hidden;
  bool llama;
  double dropout, eps;
  torch::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // (C) each; biases only for gpt2 with bias
  torch::Tensor w_qkv, b_qkv;                // (3C, C), (3C)
  torch::Tensor w_proj, b_proj;              // (C, C), (C)
  torch::Tensor w_fc, b_fc;                  // (H, C) or (2H, C) [gate; up] for SwiGLU, (H)
  torch::Tensor w_out, b_out;                // (C, H), (C)
  // model.lora's adapters of w_qkv, w_proj, w_fc and w_out (the order of Part), their A and B registered
  // after the block's other parameters as lora_A_<target> / lora_B_<target> (config/lora.h).
  std::array<LoraAdapter, 4> lora;
  std::shared_ptr<SequenceExchange> sequence;  // the sequence group's exchange; null: every position here

 private:
  void add_adapters(const config::ModelConfig& cfg, const torch::TensorOptions& opts, bool defer_params);
};
TORCH_MODULE(Block);

// The model's units, the one place their layout is defined: unit 0 the embeddings (wte, wpe), units
// 1..L the blocks, unit L+1 the final norm and the untied head. ZeRO-3 shards, gathers and frees by
// unit (parallel/engine.cpp), the checkpointing runner runs the forward unit by unit (recompute/runner.cpp),
// the planner sizes them (predict/footprint.cpp) and saved states name parameters as units() does.
inline constexpr int64_t kEmbeddingUnit = 0;
inline int64_t block_unit(int64_t layer) { return layer + 1; }
inline int64_t head_unit(const config::ModelConfig& m) { return m.n_layer + 1; }
inline int64_t unit_count(const config::ModelConfig& m) { return m.n_layer + 2; }
std::string unit_name(const config::ModelConfig& m, int64_t unit);  // "embeddings", "block 3", "head"

// Initializes parameter `name` ("wte", "blocks.3.w_proj", ...) in place, as the constructor does: normal
// (init_std; w_proj and w_out init_std / sqrt(2 n_layer)), norm weights 1, biases 0; the vocabulary
// padding's rows of wte and lm_head 0, their first vocab_size rows drawn as an unpadded table's. Draws from the
// CPU's default generator whatever t's device (a tensor on CUDA or the lazy device is drawn on the
// host, one tensor at a time, and copied), so the order of calls decides the values and the same seed
// gives the same weights on every device.
void init_parameter(const config::ModelConfig& cfg, const std::string& name, torch::Tensor t);
// A parameter built with defer_params that has not been given memory yet.
inline bool is_deferred(const torch::Tensor& p) { return p.numel() > 0 && p.storage().data() == nullptr; }

// A parameter and its name in the model ("wte", "blocks.3.w_qkv", ...), as named_parameters() says.
struct NamedParam {
  std::string name;
  torch::Tensor tensor;
};

struct GPTImpl : torch::nn::Module {
  // Builds the model on `device` (use torch::kMeta to count parameters without memory). With
  // defer_params the parameters have shapes but no memory (is_deferred) and draw nothing from the
  // generator; buffers are made as usual. Whoever materializes them calls init_parameter unit by unit,
  // in units() order, which draws the same numbers as building them here would (parallel::Engine, zero3).
  GPTImpl(const config::ModelConfig& cfg, torch::Device device, bool defer_params = false);

  // (B, T) int64 -> (B, T, C); packed rows take their learned positions from `positions` (Batch::positions:
  // (B, T') of the whole row, each position's index within its example; undefined: 0, 1, ...).
  torch::Tensor embed(const torch::Tensor& idx, const torch::Tensor& positions = {});
  // (B, T, C) -> (B, T, V) logits after final norm: the product with the whole (padded_vocab-row) table,
  // narrowed to vocab_size columns (a view; none of the vocabulary padding's logits).
  torch::Tensor head(const torch::Tensor& x);
  // Tables for this rank's T positions: the first T, or in a sequence group those from first_position(T);
  // for packed rows (`positions` as embed's) each row's own, and the attention mask of the whole rows.
  Rope rope(int64_t T, const torch::Tensor& positions = {}) const;
  // The global position of this rank's first one when it holds T of a sequence: 0, or in a sequence
  // group rank * T (model/sequence.h).
  int64_t first_position(int64_t T) const;
  // Runs this model as one rank of a sequence group (null: unsharded): embed() and rope() take the
  // rank's global positions and every block's attention exchanges through `ex`.
  void shard_sequence(std::shared_ptr<SequenceExchange> ex);
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& positions = {});  // (B, T) -> (B, T, V)
  // The training and evaluation loss: the final norm of x (B, T, C), then the LM head and the mean
  // cross-entropy against targets (B, T) fused, model.loss_chunk positions at a time (model/fused_loss.h):
  // the (B, T, V) logits never exist.
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets);
  torch::Tensor final_norm(const torch::Tensor& x) const;  // (B, T, C) -> (B*T, C)
  // The fused LM head and loss of the final norm's output h (B*T, C) against targets (B, T).
  torch::Tensor classifier_loss(const torch::Tensor& h, const torch::Tensor& targets) const;
  // head_loss of the blocks' output (`positions`: packed rows, as embed's)
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& positions = {});
  // ATen's composition on whole logits (B, T, V): the mean cross-entropy against targets (B, T), the
  // reference the fused loss is checked against.
  static torch::Tensor loss_of_logits(const torch::Tensor& logits, const torch::Tensor& targets);

  // model.lora: every parameter but the adapters' stops requiring a gradient (the constructor does it).
  void freeze_base();
  // The parameters that train (requires_grad): all of them, or model.lora's adapters; what the optimizer
  // updates and the strategies reduce.
  std::vector<torch::Tensor> trained_parameters() const;
  // Parameters by unit (see kEmbeddingUnit): unit_count(cfg) lists, each in registration order.
  std::vector<std::vector<NamedParam>> units() const;

  int64_t num_params() const;  // every parameter counted once (tied weights once), the vocabulary padding's rows too
  // Of num_params(), those that train (with model.lora the adapters only; the padding rows count, as above).
  int64_t num_trained_params() const;
  // Of num_params(), the vocabulary padding's rows (model.vocab_multiple): zero, and never trained.
  int64_t num_padding_params() const;
  // Parameters that the matmuls touch per token (excludes the position table and, when untied,
  // the input embedding lookup): N in the 6N FLOPs-per-token rule. The LM head's padding rows count:
  // the head's product computes their logits before they are dropped.
  int64_t num_matmul_params() const;

  config::ModelConfig cfg;
  torch::Tensor wte;                 // (padded_vocab, C); rows past vocab_size zero
  torch::Tensor wpe;                 // (max_seq_len, C), gpt2 only
  torch::Tensor lnf_w, lnf_b;        // (C)
  torch::Tensor lm_head;             // (padded_vocab, C), only when untied; rows past vocab_size zero
  torch::Tensor rope_cos, rope_sin;  // (max_seq_len, hd/2) buffers, llama only
  torch::nn::ModuleList blocks;
  std::shared_ptr<SequenceExchange> sequence;  // shard_sequence's; null: every position here
};
TORCH_MODULE(GPT);

}  // namespace sl::model
