// Helpers for tests that train whole runs and compare them: final weights read back by parameter
// name, their largest difference, a runner that makes each (world, overrides) run once, summary.json.
#pragma once
#include <algorithm>
#include <cmath>
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
  const auto cfg = config::load((run_dir / "config.json").string(), {"train.global_batch=0", "parallel.sequence=1"});
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

// Parameters of two runs compared element by element over every tensor: the largest difference and
// the median one (the middle of all elements' |a - b|).
struct ParamDiff {
  double max = 0.0, median = 0.0;
};
inline ParamDiff param_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  std::vector<torch::Tensor> diffs;
  for (const auto& [k, t] : a) {
    REQUIRE(b.count(k));
    diffs.push_back((t - b.at(k)).abs().reshape({-1}).to(torch::kFloat64));
  }
  const auto all = torch::cat(diffs);
  return {all.max().item<double>(), all.median().item<double>()};
}

// How far AdamW can move one parameter in a run, before weight decay: sum over steps t of
// lr * R_t, where R_t bounds |m_hat / (sqrt(v_hat) + eps)| whatever the gradients are. With
// m_t = (1-b1) sum_i b1^(t-i) g_i and v_t = (1-b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz gives
// |m_t| <= (1-b1)/sqrt(1-b2) * sqrt(sum_{k<t} (b1^2/b2)^k) * sqrt(v_t); the bias corrections
// multiply that by sqrt(1-b2^t)/(1-b1^t) (R_1 = 1: the first update is lr * sign(g) at most).
// lr is the recipe's peak (warm-up and decay only lower a step's). Decoupled decay shrinks a
// difference between two runs (p <- (1 - lr wd) p - lr u), so two runs' parameters differ by at most
// twice this.
inline double adamw_travel_bound(const nlohmann::json& train) {
  const double lr = train.at("lr").get<double>(), b1 = train.at("beta1").get<double>(), b2 = train.at("beta2").get<double>();
  const int64_t steps = train.at("steps").get<int64_t>();
  double total = 0.0, series = 0.0;
  for (int64_t t = 1; t <= steps; ++t) {
    series += std::pow(b1 * b1 / b2, static_cast<double>(t - 1));
    const double r = (1 - b1) / (1 - std::pow(b1, t)) * std::sqrt((1 - std::pow(b2, t)) / (1 - b2)) * std::sqrt(series);
    total += lr * r;
  }
  return total;
}

// Two runs that saw the same data and whose gradients differ only in the order of fp32 sums (another
// world size, sharding stage, bucket layout or GEMM kernel path) end with the same parameters in this
// sense; the recipe sets the bound B = adamw_travel_bound. The arithmetic:
//  - Every element: |a - b| <= 2 B, whatever the gradients (each run moves a parameter by at most B).
//    AdamW divides by sqrt(v), so an element whose gradient is near zero (inside the rounding of its
//    sum) can take a different direction in each run: this is all a max can promise on every CPU.
//  - The median element: a reordered fp32 sum of n terms differs by about u sqrt(n) sum|terms|
//    (u = 2^-24; rounding errors of random sign), i.e. relatively by rho = u sqrt(n) kappa, kappa =
//    sum|terms| / |g| the element's condition. With n <= 2^12 (positions, or a layer's width) and
//    kappa <= 10^3 at the median (a sum of random-sign terms has kappa ~ sqrt(n) <= 64), rho <= 4e-3;
//    an update direction, homogeneous of degree 0 in the gradients, moves by <= 2 rho R_t, so the
//    median |a - b| <= 8e-3 B: kReordered = 1e-2 B. A bf16 rounding of such a sum changes (by 2^-8
//    relative) only where the fp32 values straddle a bf16 boundary, a fraction ~ rho 2^8 << 1/2 of
//    the elements: the median is not one of them.
//  - Where the runs round their gradients to a 16-bit type differently (a bf16 gradient rounded from
//    a sum of 8 rows instead of two of 4; bf16 reductions; fp16 with another loss scale), each element
//    differs relatively by up to 2^-8 (bf16's spacing; fp16's 2^-11 is finer, its subnormals below
//    6e-5 affect only the smallest gradients, not the median), and a gradient crosses <= 4 such
//    roundings on its way (the compute copy's weights, activations, the backward product, the
//    reduction): rho <= 4 x 2^-8 = 1.6e-2, a direction moves by <= 2 rho, the median by <= 3.2e-2 B:
//    kRounded = 5e-2 B.
// A wrong gradient (a missing rank, a stale shard, half the data) changes the direction of most
// elements by O(1): a median of O(0.1 B) and more, which the tests' controls assert the check sees.
inline constexpr double kReordered = 1e-2;
inline constexpr double kRounded = 5e-2;
struct SameTraining {
  ParamDiff diff;
  double bound = 0.0;           // B
  double median_of_bound = 0.0;  // kReordered or kRounded
  bool holds() const { return diff.max <= 2 * bound && diff.median <= median_of_bound * bound; }
  bool median_differs() const { return diff.median > median_of_bound * bound; }
  std::string why() const {
    return fmt::format("parameters: max |a - b| {:.3g} (at most 2B = {:.3g}), median {:.3g} (at most {:.3g})", diff.max,
                       2 * bound, diff.median, median_of_bound * bound);
  }
};
inline SameTraining same_training(const std::map<std::string, torch::Tensor>& a,
                                  const std::map<std::string, torch::Tensor>& b, const std::filesystem::path& run_dir,
                                  double median_of_bound = kReordered) {
  const auto cfg = nlohmann::json::parse(read_text(run_dir / "config.json"));
  return {param_diff(a, b), adamw_travel_bound(cfg.at("train")), median_of_bound};
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

// The largest relative difference, over two runs' steps, of the loss and of the gradient norm (the runs
// must log the same steps).
struct RelDiff {
  double loss = 0, grad_norm = 0;
};
inline RelDiff max_rel_step_diff(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  const auto rel = [](double x, double y) { return std::abs(x - y) / std::max(std::abs(x), std::abs(y)); };
  RelDiff d;
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].step == b[i].step);
    d.loss = std::max(d.loss, rel(a[i].loss, b[i].loss));
    d.grad_norm = std::max(d.grad_norm, rel(a[i].grad_norm, b[i].grad_norm));
  }
  return d;
}
inline nlohmann::json summary(const std::filesystem::path& run_dir) {
  return nlohmann::json::parse(read_text(run_dir / "summary.json"));
}

}  // namespace sl::test

// CHECK(same_training(a, b, run_dir[, kRounded]).holds()), with both figures and their bounds in the
// report.
#define CHECK_SAME_TRAINING(...)                                         \
  do {                                                                   \
    const auto same_training_ = ::sl::test::same_training(__VA_ARGS__);  \
    INFO(same_training_.why());                                          \
    CHECK(same_training_.holds());                                       \
  } while (0)
