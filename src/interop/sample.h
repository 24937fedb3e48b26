// `trainer sample`: load a model (a run's newest weights, or a Hugging Face folder), encode the prompt
// with its tokenizer, generate (model/generate.h), decode.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "config/choices.h"

namespace sl::interop {

struct SampleRequest {
  std::filesystem::path run;        // a run directory (its newest weights and recorded tokenizer), or
  std::filesystem::path weights;    // a Hugging Face folder (config.json, model.safetensors, tokenizer.json)
  std::filesystem::path tokenizer;  // "" = the run's or the folder's tokenizer.json
  std::string prompt;               // "" = the end-of-text token alone
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 0;
  uint64_t seed = 1337;
  bool use_cache = true;
  bool stop_at_eot = true;   // stop once the end-of-text token is generated
  config::DeviceChoice device = config::DeviceChoice::kAuto;  // auto | cpu | cuda
};

struct SampleReport {
  std::string weights;    // what was loaded
  std::string tokenizer;  // the tokenizer.json used, or "bytes" (a 256-token byte-level model without one)
  std::vector<int64_t> prompt_ids, ids;
  std::string prompt_text, text;  // text: the continuation alone, decoded
  double prompt_seconds = 0.0, seconds = 0.0;
  double tokens_per_s() const { return seconds > 0.0 ? static_cast<double>(ids.size()) / seconds : 0.0; }
};

// Throws ConfigError (exit 2: arguments, a prompt that does not fit the context, an unsupported tokenizer,
// a tokenizer whose vocabulary is not the model's), DataError (3: unreadable weights or tokenizer).
SampleReport sample(const SampleRequest& req);

}  // namespace sl::interop
