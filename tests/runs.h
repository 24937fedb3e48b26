// Helpers for tests that train whole runs and compare them: final weights read back by parameter
// name, their largest difference, a runner that makes each (world, overrides) run once, summary.json.
#pragma once
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "interop/hf.h"
#include "model/gpt.h"
#include "test_util.h"

namespace sl::test {

// A run's final weights (<run>/model/, Hugging Face layout), read back under this project's parameter names.
inline std::map<std::string, torch::Tensor> load_params(const std::filesystem::path& run_dir) {
  const auto cfg = config::load((run_dir / "config.json").string(), {"train.global_batch=0"});
  const interop::HfCheckpoint ckpt(run_dir / "model", cfg.model);
  model::GPT shapes(cfg.model, torch::kMeta);
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : shapes->named_parameters()) {
    auto t = torch::empty(item.value().sizes());
    ckpt.read(item.key(), 0, t.numel(), t.view({-1}));
    out[item.key()] = t;
  }
  return out;
}

inline double max_abs_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  double d = 0.0;
  for (const auto& [k, t] : a) {
    REQUIRE(b.count(k));
    d = std::max(d, (t - b.at(k)).abs().max().item<double>());
  }
  return d;
}

struct Runner {
  Runner(const char* recipe_text, const std::string& tag) : dir(tag), recipe(dir.file("recipe.yaml", recipe_text)) {}
  TempDir dir;
  std::string recipe;
  int n = 0;
  std::map<std::pair<int, std::string>, std::filesystem::path> made;
  // Runs `world` ranks with the overrides; returns the run directory (asserts every rank exited 0).
  // Runs are deterministic: the same world and overrides asked again return the first run's directory.
  std::filesystem::path train(int world, const std::string& sets) {
    if (const auto it = made.find({world, sets}); it != made.end()) return it->second;
    const auto run_dir = dir.path / fmt::format("run{}", n++);
    const std::string args = fmt::format("--config {} {} --set logging.dir={}", recipe, sets, run_dir.string());
    if (world == 1) {
      auto r = trainer(args);
      INFO(r.output);
      REQUIRE(r.code == 0);
    } else {
      auto m = launch(world, args);
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r << ":\n" << m.outputs[static_cast<size_t>(r)]);
        REQUIRE(m.codes[static_cast<size_t>(r)] == 0);
      }
    }
    made[{world, sets}] = run_dir;
    return run_dir;
  }
};

inline nlohmann::json summary(const std::filesystem::path& run_dir) {
  return nlohmann::json::parse(read_text(run_dir / "summary.json"));
}

}  // namespace sl::test
