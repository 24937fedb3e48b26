// Autoregressive generation for `trainer sample` and the training-time samples: a KV cache per block
// (keys and values of every position so far, written in place), so each new token costs one
// position's forward instead of the whole prefix's. Without the cache (use_cache = false) every token
// runs the model's own forward on the whole sequence: the reference the cache must agree with and the
// baseline of bench/sample.py.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "model/gpt.h"

namespace sl::model {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy (argmax, the first of equal maxima)
  int64_t top_k = 0;         // sample among the k most likely; 0 = all
  uint64_t seed = 0;         // the sampling generator's seed: same seed, same tokens
  bool use_cache = true;
  std::optional<int64_t> stop_id;  // stop once this id is generated (it is kept in the output)
  // Without the cache: the forward run on the whole sequence, (1, T) ids -> (1, T, V) logits; unset = the
  // model's own. A training run passes its runner's (ZeRO-3 gathers parameters there, on every rank).
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

struct Generated {
  std::vector<int64_t> ids;  // the new tokens only
  double prompt_seconds = 0.0;  // the prompt's forward (and the first token)
  double seconds = 0.0;         // everything, prompt included
};

// Continues `prompt` (ids < vocab_size, at least one) by up to max_new_tokens; the prompt and the new
// tokens together must fit model.max_seq_len (ConfigError otherwise). Runs under NoGradGuard in eval
// mode (restored after) on the device of the model's weights, in their dtype. on_token, when set, sees
// each new id as it is made.
Generated generate(GPTImpl& model, const std::vector<int64_t>& prompt, const GenerateOptions& options,
                   const std::function<void(int64_t)>& on_token = {});

}  // namespace sl::model
