// The tests' recipes, built from one base each: a Recipe is an ordered list of "section.key" -> value text
// (the words `--set` takes), with keys set or erased, written out as YAML (a Runner's recipe.yaml) or as
// `--set` overrides. recipe_gpt2() is the multi-rank tests' small GPT-2 (test_parallel, test_sequence,
// test_offload); recipe_tiny_state(steps) the tiny recipe's overrides of the state tests (test_resume,
// test_state).
#pragma once
#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace sl::test {

// The order a recipe's sections are written in (as the tests' recipes have always been written).
inline constexpr std::array<std::string_view, 10> kRecipeSections = {
    "model", "data", "train", "checkpointing", "precision", "parallel", "memory", "offload", "state", "logging"};

class Recipe {
 public:
  using Key = std::pair<std::string, std::string>;  // "section.key", value text as written ("1.0e-3")
  Recipe() = default;
  explicit Recipe(std::vector<Key> keys) : keys_(std::move(keys)) {}

  // The key's value replaced where it stands, or the key appended.
  Recipe& set(const std::string& key, const std::string& value) {
    if (const auto it = find(key); it != keys_.end())
      it->second = value;
    else
      keys_.emplace_back(key, value);
    return *this;
  }
  Recipe& erase(const std::string& key) {
    const auto it = find(key);
    if (it == keys_.end()) throw std::invalid_argument("Recipe::erase: no key " + key);
    keys_.erase(it);
    return *this;
  }

  // The recipe file: after a blank line, each section of kRecipeSections in that order, its keys in
  // the order they were set ("train:\n  steps: 10\n").
  std::string yaml() const {
    for (const auto& [key, value] : keys_)
      if (std::find(kRecipeSections.begin(), kRecipeSections.end(), section(key)) == kRecipeSections.end())
        throw std::invalid_argument("Recipe::yaml: no section for " + key);
    std::string out = "\n";
    for (const auto s : kRecipeSections) {
      bool opened = false;
      for (const auto& [key, value] : keys_) {
        if (section(key) != s) continue;
        if (!opened) out += fmt::format("{}:\n", s), opened = true;
        out += fmt::format("  {}: {}\n", key.substr(s.size() + 1), value);
      }
    }
    return out;
  }
  // The overrides, in the order they were set: "--set train.steps=12 --set model.dropout=0.1".
  std::string sets() const {
    std::string out;
    for (const auto& [key, value] : keys_) out += fmt::format("{}--set {}={}", out.empty() ? "" : " ", key, value);
    return out;
  }

 private:
  static std::string_view section(std::string_view key) { return key.substr(0, key.find('.')); }
  std::vector<Key>::iterator find(const std::string& key) {
    return std::find_if(keys_.begin(), keys_.end(), [&](const Key& k) { return k.first == key; });
  }
  std::vector<Key> keys_;
};

// GPT-2 of 4 blocks, d 64, 2 heads, vocabulary 256, on 20000 synthetic tokens; T 32, micro-batch 4, 10
// steps, fp32 on one CPU thread, seed 7; the final weights saved (logging.save_model) for parity.
inline Recipe recipe_gpt2() {
  return Recipe({
      {"model.arch", "gpt2"},
      {"model.n_layer", "4"},
      {"model.n_head", "2"},
      {"model.n_embd", "64"},
      {"model.vocab_size", "256"},
      {"model.max_seq_len", "64"},
      {"model.dropout", "0.0"},
      {"data.source", "synthetic"},
      {"data.synthetic_tokens", "20000"},
      {"train.seq_len", "32"},
      {"train.micro_batch", "4"},
      {"train.grad_accum", "1"},
      {"train.steps", "10"},
      {"train.lr", "1.0e-3"},
      {"train.warmup_steps", "2"},
      {"train.grad_clip", "1.0"},
      {"train.eval_interval", "0"},
      {"train.device", "cpu"},
      {"train.threads", "1"},
      {"train.seed", "7"},
      {"parallel.timeout_s", "60"},
      {"logging.interval", "100"},
      {"logging.skip_first", "0"},
      {"logging.peak_tflops", "1.0"},
      {"logging.progress", "false"},
      {"logging.save_model", "true"},
  });
}

// configs/tiny.yaml's overrides for the state tests (~0.1 s a step at 2 layers on one thread): fp32,
// dropout 0.1 (so the RNG state must come back exactly), gradient accumulation 2, an eval every 5 steps
// (the val sampler must come back), `steps` steps.
inline Recipe recipe_tiny_state(int steps) {
  return Recipe({
      {"train.seq_len", "64"},
      {"train.micro_batch", "4"},
      {"train.grad_accum", "2"},
      {"train.steps", std::to_string(steps)},
      {"train.eval_interval", "5"},
      {"train.eval_batches", "2"},
      {"model.dropout", "0.1"},
      {"logging.progress", "false"},
      {"train.threads", "1"},
      {"logging.peak_tflops", "1"},
      {"logging.interval", "100"},
  });
}

}  // namespace sl::test
