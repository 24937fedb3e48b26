// `trainer export`: a run's weights as a Hugging Face checkpoint (interop/hf.h), from its newest saved
// training state (any world size and sharding) or its final weights, whichever is newer.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "config/config.h"
#include "interop/hf.h"
#include "interop/peft.h"
#include <cstdint>
#include <filesystem>
#include <string>

namespace sl::interop {

struct ExportRequest {
  std::filesystem::path run;  // a run directory (config.json, state/ and/or model/)
  std::filesystem::path out;  // a directory, or a *.safetensors file (config.json goes beside it); "" = <run>/hf-step-N
  config::Dtype dtype = config::Dtype::kFp32;  // fp32 | bf16
  // A model.lora run: false writes its PEFT adapter directory (adapter_config.json, adapter_model.safetensors),
  // true the base with the adapters folded in as plain Hugging Face weights.
  bool merged = false;
};

struct ExportReport {
  std::filesystem::path file;  // the model.safetensors written
  std::string source;          // the state directory or final-weights file read
  int64_t step = 0;            // the optimizer step of those weights
  int64_t bytes = 0;           // size of the file written
  int64_t peak_tensor_bytes = 0;  // tracked CPU tensor memory at its peak while exporting (when tracking)
};

// Throws ConfigError (exit 2) for a missing run directory or bad arguments, StateFileError (2) or
// DataError (3) for unreadable weights, IoError (7) for a failed write (nothing half-written is left).
// The run's tokenizer (<run>/tokenizer.json, recorded when it trained on prepare_data.py's shards) goes
// beside the weights with a tokenizer_config.json, so AutoTokenizer loads the folder too.
ExportReport export_run(const ExportRequest& req);

// A run's newest weights: its final weights or its newest saved training state, whichever is newer.
// A model.lora run's source has the adapters folded in (interop/peft.h; its model is without_lora(cfg.model))
// and `adapters` reads them; the base comes from model.init_from, or is drawn again from train.seed.
struct RunWeights {
  config::RunConfig cfg;  // the run's recipe (config.json)
  WeightsSource source;
  ParamValues adapters;  // model.lora runs only
  std::string description;  // the file or state directory read
  int64_t step = 0;
};
// `who` names the command in messages ("export", "sample"). Errors as export_run's.
RunWeights run_weights(const std::filesystem::path& run, const std::string& who);

// The tokenizer a run recorded (<run>/tokenizer.json); "" when it trained without one.
std::filesystem::path run_tokenizer(const std::filesystem::path& run);

}  // namespace sl::interop
