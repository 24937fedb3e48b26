// model.lora's adapters in PEFT's format, and the base with them folded in:
//  - an adapter directory (adapter_config.json + adapter_model.safetensors) that
//    peft.PeftModel.from_pretrained loads over the transformers base, written by write_peft and read
//    back by PeftAdapter (model.init_from names one to continue from: the base is the directory its
//    base_model_name_or_path names);
//  - merged_source: the base's Hugging Face tensors with (alpha / r) B A added to each target's rows,
//    what `trainer export --merged`, the final weights of a LoRA run and `trainer sample` read.
// Names: PEFT saves "base_model.model." + the module's name in the transformers model + ".lora_A.weight"
// (A (r, in_features), B (out_features, r); GPT-2's Conv1D modules too, with fan_in_fan_out: true).
#pragma once
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "config/shape.h"
#include "interop/hf.h"
#include "state/safetensors.h"

namespace sl::interop {

// Elements [begin, end) of this project's parameter `param`, flattened, as fp32 (any device).
using ParamValues = std::function<at::Tensor(const std::string& param, int64_t begin, int64_t end)>;

// PEFT's tensor name of block `layer`'s A ('A') or B ('B') for target t.
std::string peft_name(const config::ModelConfig& m, int64_t layer, const config::LoraTarget& t, char matrix);
// The model's parameter name of the same matrix: "blocks.3.lora_A_q_proj".
std::string lora_param(int64_t layer, const config::LoraTarget& t, char matrix);
// adapter_config.json for model.lora; `base`: base_model_name_or_path ("" = null).
nlohmann::json peft_config(const config::ModelConfig& m, const std::string& base);

// Writes dir/adapter_config.json and dir/adapter_model.safetensors (fp32) with every adapter matrix
// from `values`. Atomic per file; IoError (exit 7) on a failed write.
void write_peft(const std::filesystem::path& dir, const config::ModelConfig& m, const ParamValues& values,
                const std::string& base);

// An adapter directory opened for model.init_from: adapter_config.json checked against the recipe's
// model.lora (peft_type LORA, r, lora_alpha, the target modules, no bias or DoRA or rsLoRA, fan_in_fan_out
// as the arch needs) and every adapter tensor present with its shape; a DataError (exit 3) names the
// file and what differs.
class PeftAdapter {
 public:
  PeftAdapter(const std::filesystem::path& dir, const config::ModelConfig& m);
  ~PeftAdapter();
  // Whether `path` is an adapter directory (holds adapter_config.json).
  static bool is_adapter_dir(const std::filesystem::path& path);
  // The base checkpoint its base_model_name_or_path names: relative to the adapter directory when that
  // exists, else as given; DataError when it names no directory here.
  std::filesystem::path base() const;
  // Copies elements [begin, end) of the adapter parameter `param` ("blocks.3.lora_A_q_proj"), flattened, into
  // dst (fp32, 1-D, end - begin).
  void read(const std::string& param, int64_t begin, int64_t end, at::Tensor dst) const;

 private:
  std::filesystem::path dir_;
  std::string base_name_;  // base_model_name_or_path as written
  std::map<std::string, std::string> names_;  // model parameter -> PEFT tensor name
  std::unique_ptr<state::SafetensorsFile> file_;
};

// The base's tensors (`base`: this project's frozen parameters) with every adapter of `adapters` folded
// into its rows, for write_hf and read_weights. Without model.lora: the base as it is.
WeightsSource merged_source(const config::ModelConfig& m, ParamValues base, ParamValues adapters);

// The base checkpoint of model.init_from: itself, or the base an adapter directory names ("" = none).
std::string base_checkpoint(const config::ModelConfig& m);

// The model section with model.lora off: the shape of merged weights.
config::ModelConfig without_lora(config::ModelConfig m);

}  // namespace sl::interop
