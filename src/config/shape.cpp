// The model's shape and its parameter arithmetic (shape.h).
#include "config/shape.h"

#include <algorithm>

namespace sl::config {
namespace {

// Saturating arithmetic for the parameter formulas (kMaxParams caps every count).
int64_t sat_add(int64_t a, int64_t b) { return std::min(kMaxParams, a + b); }  // a, b <= kMaxParams
int64_t sat_mul(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  return a > kMaxParams / b ? kMaxParams : std::min(kMaxParams, a * b);
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

Shape::Shape(const ModelConfig& m)
    : n_layer(m.n_layer),
      n_embd(m.n_embd),
      n_head(m.n_head),
      max_seq_len(m.max_seq_len),
      vocab_rows(m.padded_vocab()),
      arch(m.arch),
      llama(m.arch == Arch::kLlama),
      bias(m.bias && m.arch != Arch::kLlama),
      tied(m.tie_embeddings),
      layer_hidden_(m.layer_mlp_hidden),
      lora_(m.lora) {
  padding_params_ = sat_mul(sat_mul(tied ? 1 : 2, vocab_rows - m.vocab_size), n_embd);
  hidden_ = m.mlp_hidden > 0 ? m.mlp_hidden : llama ? round_up(2 * 4 * m.n_embd / 3, 256) : 4 * m.n_embd;
  for (int64_t l = 1; l < static_cast<int64_t>(layer_hidden_.size()); ++l)
    uniform_ = uniform_ && hidden(l) == hidden(0);
  widest_ = hidden(0);
  if (!uniform_)
    for (int64_t l = 1; l < n_layer; ++l) widest_ = std::max(widest_, hidden(l));
}

int64_t Shape::hidden(int64_t layer) const {
  const auto i = static_cast<size_t>(layer);
  return i < layer_hidden_.size() && layer_hidden_[i] > 0 ? layer_hidden_[i] : hidden_;
}

int64_t Shape::embedding_params() const {
  return sat_add(sat_mul(vocab_rows, n_embd), llama ? 0 : sat_mul(max_seq_len, n_embd));
}

int64_t Shape::block_params_of_width(int64_t H) const {
  const int64_t C = n_embd;
  // ln1_w, ln2_w; w_qkv 3C x C, w_proj C x C; w_fc (H or 2H for SwiGLU) x C, w_out C x H.
  int64_t n = sat_add(2 * C, sat_mul(4 * C, C));
  n = sat_add(n, sat_mul((llama ? 3 : 2) * H, C));
  // ln1_b, ln2_b, b_qkv 3C, b_proj C, b_fc H, b_out C.
  if (bias) n = sat_add(n, 7 * C + H);
  return sat_add(n, lora_params_of_width(arch, C, H, lora_));
}

int64_t Shape::lora_block_params(int64_t layer) const {
  return lora_params_of_width(arch, n_embd, hidden(layer), lora_);
}

int64_t Shape::largest_trained_param() const {
  if (!lora_.enabled()) return largest_param();
  int64_t n = 0;
  for (const auto& t : lora_targets_of_width(arch, n_embd, widest_, lora_))
    n = std::max(n, lora_.rank * std::max(t.rows, t.projection == 3 ? widest_ : n_embd));
  return n;
}

int64_t Shape::trained_widest_block_params() const {
  return lora_.enabled() ? lora_params_of_width(arch, n_embd, widest_, lora_) : widest_block_params();
}

int64_t Shape::vector_params() const {
  const int64_t C = n_embd;
  int64_t n = bias ? 2 * C : C;  // lnf_w, lnf_b
  for (int64_t l = 0; l < n_layer; ++l) {
    n = sat_add(n, 2 * C + (bias ? 7 * C + hidden(l) : 0));  // ln1_w, ln2_w; the biases
    if (uniform_) return sat_add(n, sat_mul(n_layer - 1, 2 * C + (bias ? 7 * C + hidden_ : 0)));
  }
  return n;
}

int64_t Shape::frozen_bytes() const {
  if (!lora_.enabled()) return 0;
  const int64_t frozen = total_params() - trained_params();
  if (lora_.base_dtype != Dtype::kBf16) return 4 * frozen;  // frozen <= kMaxParams: no overflow
  const int64_t vectors = vector_params();
  return 4 * vectors + 2 * (frozen - vectors);
}

int64_t Shape::trained_params() const {
  if (!lora_.enabled()) return total_params();
  if (uniform_) return sat_mul(n_layer, lora_block_params(0));
  int64_t n = 0;
  for (int64_t l = 0; l < n_layer; ++l) n = sat_add(n, lora_block_params(l));
  return n;
}

int64_t Shape::head_params() const {
  return sat_add(bias ? 2 * n_embd : n_embd, tied ? 0 : sat_mul(vocab_rows, n_embd));
}

int64_t Shape::total_params() const {
  int64_t blocks = 0;  // n_layer times one block's, or with per-block widths their sum
  if (uniform_) {
    blocks = sat_mul(n_layer, block_params(0));
  } else {
    for (int64_t l = 0; l < n_layer; ++l) blocks = sat_add(blocks, block_params(l));
  }
  return sat_add(sat_add(embedding_params(), blocks), head_params());
}

int64_t Shape::largest_unit_params() const {
  return std::max({embedding_params(), n_layer > 0 ? widest_block_params() : 0, head_params()});
}

int64_t Shape::largest_param() const {
  const int64_t C = n_embd;
  return std::max({sat_mul(vocab_rows, C), llama ? 0 : sat_mul(max_seq_len, C), sat_mul(3 * C, C),
                   sat_mul((llama ? 2 : 1) * widest_, C)});
}

std::vector<LoraTarget> lora_targets(const ModelConfig& m, int64_t layer) {
  return lora_targets_of_width(m.arch, m.n_embd, Shape(m).hidden(layer), m.lora);
}

std::vector<std::string> lora_target_names(const ModelConfig& m) {
  std::vector<std::string> names;
  for (const auto& t : lora_targets(m, 0)) names.push_back(t.name);
  return names;
}

}  // namespace sl::config
