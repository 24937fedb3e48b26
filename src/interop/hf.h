// Hugging Face checkpoints in and out: this project's parameters under the names and layouts of
// transformers' GPT2LMHeadModel (arch gpt2) and LlamaForCausalLM (arch llama), as safetensors with a
// config.json (../shared/design/FORMATS.md). One table, hf_layout(), says where every Hugging Face
// tensor lives in the model; export (write_hf) and import (HfCheckpoint) both read it.
//
//   gpt2   transformer.wte/wpe, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//          mlp.c_proj}, transformer.ln_f, lm_head (untied only). Conv1D weights are (in, out): the
//          transpose of ours. model.bias: false writes zero biases (GPT2LMHeadModel always has them).
//   llama  model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//          post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head (untied only).
//          q/k/v are row blocks of w_qkv, gate/up of w_fc; both RoPEs rotate (x[i], x[i + hd/2]).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "state/safetensors.h"

namespace sl::model {
struct GPTImpl;
}

namespace sl::interop {

// One tensor of a Hugging Face checkpoint and where its values are in this project's model: rows
// [row_begin, row_end) of dim 0 of `param` (1-D parameters: elements), transposed for Conv1D.
struct HfTensor {
  std::string name;            // "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // as Hugging Face stores it
  std::string param;           // "blocks.0.w_qkv"; "" = not in the model (a zero bias under bias: false)
  int64_t row_begin = 0, row_end = 0;
  bool transposed = false;
  int64_t unit = 0;  // the model unit (model::kEmbeddingUnit, block_unit(l), head_unit) holding `param`

  int64_t row_length() const;  // elements per row of `param` (1 for 1-D parameters)
  std::vector<int64_t> param_shape() const;  // the rows' shape in the model (shape, or its transpose)
  int64_t begin() const { return row_begin * row_length(); }  // the elements of `param` it holds
  int64_t end() const { return row_end * row_length(); }
};

// Every tensor of the checkpoint, in file order (unit by unit). The embeddings and an untied lm_head are
// rows [0, vocab_size) of wte / lm_head: export leaves the vocabulary padding (model.vocab_multiple) out.
std::vector<HfTensor> hf_layout(const config::ModelConfig& m);

// config.json for the checkpoint (GPT2Config / LlamaConfig keys), dtype "float32" or "bfloat16".
// eos_id: the tokenizer's end-of-text id (bos_token_id and eos_token_id, so generate() stops there);
// none: GPT-2's 50256 for a vocabulary that has it, else null.
nlohmann::json hf_config(const config::ModelConfig& m, at::ScalarType dtype,
                         std::optional<int64_t> eos_id = std::nullopt);

// The model a Hugging Face config.json describes (GPT2Config or LlamaConfig keys; absent keys take
// transformers' defaults), for running a downloaded or exported folder without a recipe. Whatever this
// project's model cannot express (grouped-query attention, RoPE scaling, another activation) is refused
// with a DataError (exit 3) naming the key, as check_hf_config does.
config::ModelConfig model_config_from_hf(const nlohmann::json& hf, const std::string& where);

// Refuses (DataError, exit 3) a Hugging Face config.json that describes another model than the recipe:
// every differing key is named with both values and the recipe key to set. `where` names the file.
void check_hf_config(const nlohmann::json& hf, const config::ModelConfig& m, const std::string& where);

// Where export reads the model: values(t) returns the elements [t.begin(), t.end()) of t.param as fp32
// (any shape with that many elements), called between enter(t.unit) and leave(t.unit) (zero3 gathers
// the unit there).
struct WeightsSource {
  std::function<void(int64_t unit)> enter = [](int64_t) {};
  std::function<void(int64_t unit)> leave = [](int64_t) {};
  std::function<at::Tensor(const HfTensor& t)> values;
};

struct Written {
  std::filesystem::path file;
  state::FileDigest digest;
  int64_t tensors = 0;
};

// Writes the safetensors `file` (tensors in `dtype`: kFloat or kBFloat16, rounded to nearest even) and
// config.json beside it, streaming tensor by tensor: only the tensor being written is held beyond what
// the source holds. With write = false (the other ranks of a zero3 run) only enter/leave are called,
// so the gathers pair up across ranks. Atomic per file; IoError (exit 7) on a failed write.
Written write_hf(const std::filesystem::path& file, const config::ModelConfig& m, at::ScalarType dtype,
                 const WeightsSource& source, bool write, const std::map<std::string, std::string>& metadata,
                 std::optional<int64_t> eos_id = std::nullopt);

// Copies every weight of `source` into the model's parameters (same model config; unit by unit).
void read_weights(model::GPTImpl& model, const WeightsSource& source);

// A Hugging Face checkpoint opened for model.init_from: model.safetensors, a directory holding it, or
// a directory with model.safetensors.index.json and its shards (mmap'd, nothing read up front). The
// constructor checks everything before any weight is touched: config.json beside the file (when there)
// against the recipe, every expected tensor present with its shape and a float dtype (F32, BF16, F16;
// converted exactly to fp32), no unknown extra tensor (the causal-mask buffers attn.bias /
// attn.masked_bias and rotary inv_freq are ignored), zero biases for a bias-free recipe, a present
// lm_head equal to the embeddings for a tied recipe. Any failure is a DataError (exit 3) naming the
// file and the tensor. Names without the "transformer." / "model." prefix (base-model files) are read too.
class HfCheckpoint {
 public:
  HfCheckpoint(const std::filesystem::path& path, const config::ModelConfig& m);
  ~HfCheckpoint();
  HfCheckpoint(const HfCheckpoint&) = delete;
  HfCheckpoint& operator=(const HfCheckpoint&) = delete;

  // Copies elements [begin, end) of this project's parameter `param` (flattened) into `dst` (fp32,
  // 1-D, end - begin). Reads only the rows that hold them, so a ZeRO-3 rank reads just its shard. The
  // vocabulary padding's rows of wte and lm_head (model.vocab_multiple), which no tensor holds, read as zero.
  void read(const std::string& param, int64_t begin, int64_t end, at::Tensor dst) const;
  const std::filesystem::path& path() const { return path_; }
  std::string describe() const;
  // The checkpoint as a WeightsSource (fp32 values), for write_hf and read_weights.
  static WeightsSource source(std::shared_ptr<HfCheckpoint> ckpt);  // "path (N tensors, dtype BF16)"

 private:
  struct Source;
  at::Tensor view(const std::string& hf_name) const;  // the tensor as stored, no copy
  void open_files();
  void check_tensors();
  void check_extras() const;

  std::filesystem::path path_;
  config::ModelConfig model_;
  std::vector<HfTensor> layout_;
  std::vector<std::unique_ptr<state::SafetensorsFile>> files_;
  std::map<std::string, std::pair<size_t, std::string>> where_;  // Hugging Face name -> (file, name in it)
};

}  // namespace sl::interop
