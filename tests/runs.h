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
#include "interop/peft.h"
#include "model/gpt.h"
#include "train/schedule.h"
#include "test_util.h"

namespace sl::test {

// A run's final weights (<run>/model/, Hugging Face layout), read back under this project's parameter names;
// of a model.lora run, what it trained: its adapters (<run>/adapter/, PEFT's layout).
inline std::map<std::string, torch::Tensor> load_params(const std::filesystem::path& run_dir) {
  const auto cfg = config::load((run_dir / "config.json").string(), {"train.global_batch=0", "parallel.sequence=1"});
  if (cfg.model.lora.enabled()) {
    const interop::PeftAdapter adapter(run_dir / "adapter", cfg.model);
    model::GPT shapes(cfg.model, torch::kMeta);
    std::map<std::string, torch::Tensor> out;
    for (const auto& item : shapes->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      auto t = torch::empty(item.value().sizes());
      adapter.read(item.key(), 0, t.numel(), t.view({-1}));
      out[item.key()] = t;
    }
    return out;
  }
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

// How far AdamW can move one parameter in a run, before weight decay: sum over steps t of
// lr_t * R_t, lr_t the schedule's rate at step t (train::lr_at: warm-up and decay included), R_t a
// bound on |m_hat / (sqrt(v_hat) + eps)| whatever the gradients are. With m_t = (1-b1) sum_i b1^(t-i) g_i
// and v_t = (1-b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz gives
// |m_t| <= (1-b1)/sqrt(1-b2) * sqrt(sum_{k<t} (b1^2/b2)^k) * sqrt(v_t); the bias corrections
// multiply that by sqrt(1-b2^t)/(1-b1^t) (R_1 = 1: the first update is lr * sign(g) at most).
// Decoupled decay shrinks a difference between two runs (p <- (1 - lr wd) p - lr u), so two runs'
// parameters differ by at most twice this, whatever their gradients: a max over elements says nothing.
inline double adamw_travel_bound(const config::TrainConfig& train) {
  const double b1 = train.beta1, b2 = train.beta2;
  double total = 0.0, series = 0.0;
  for (int64_t t = 1; t <= train.steps; ++t) {
    series += std::pow(b1 * b1 / b2, static_cast<double>(t - 1));
    const double r = (1 - b1) / (1 - std::pow(b1, t)) * std::sqrt((1 - std::pow(b2, t)) / (1 - b2)) * std::sqrt(series);
    total += train::lr_at(train, t - 1) * r;
  }
  return total;
}
// The same for a run's resolved recipe (<run>/config.json).
inline double adamw_travel_bound(const std::filesystem::path& run_dir) {
  return adamw_travel_bound(config::load((run_dir / "config.json").string(), {"train.global_batch=0", "parallel.sequence=1"}).train);
}

// ---- Parity: two runs that must train the same model (another layout, precision path or kernel path) ----
//
// Compared at every step (loss and pre-clip gradient norm, relative) and at the end tensor by tensor (each
// parameter tensor's median, 90th percentile and row medians of |a - b|, against B = adamw_travel_bound).
//
// Steps. At step 1 both runs hold the same parameters, so a gradient that is wrong anywhere (one block,
// one shard, one rank's share) shows in that step's norm before any divergence; later steps add drift.
//  - kReorderedStep = 1e-5: the runs' arithmetic differs only in the order of fp32 sums (per-rank means
//    averaged instead of one batch's, another bucket or GEMM blocking). Loss: each position's loss moves
//    by at most 2 max|dz| for logit errors dz (the cross-entropy's gradient in the logits has 1-norm
//    <= 2); the logits (|z| <= ~1 at the tests' scale) carry rounding of dot products of <= 256 terms
//    through 4 blocks, ~u sqrt(256) per product (u = 2^-24), < 1e-5 absolute with room for 10^2 such
//    products in sequence: relative to a loss of ~ln 256 = 5.5, < 4e-6. grad_norm: dominated by the large
//    gradient elements, whose sums are well conditioned (kappa ~ sqrt(n)): relative error ~u sqrt(n)
//    kappa ~ 6e-8 x 16 x 16 = 1.5e-5 per element at worst, and the norm, summed in float64 over
//    thousands of elements with independent errors, averages them down by their count's square root
//    (> 30x). Later steps add the parameter drift bounded below, which moves the loss only to second
//    order (the elements AdamW amplifies are those whose gradient is ~0). A missing division by the
//    world size doubles the gradient: a relative grad_norm difference of 0.5.
//  - kRoundedStep = 2e-2: the runs round to bf16 or fp16 in different places, or the same places with
//    reordered sums underneath (a rounded value landing on the neighbouring 16-bit number: up to 2^-8
//    relative). The loss averages B*T positions each moved through 4 blocks x 2 sub-layers of such
//    roundings: at most 8 x 2^-8 = 3e-2 in the logits' error, 2 max|dz| <= 6e-2 absolute on a loss of
//    5.5: 1e-2 relative. grad_norm: each element moved by at most 4 such roundings on its way (compute
//    copy, activations, backward product, reduction): 4 x 2^-8 = 1.6e-2 relative. 2e-2 bounds both.
//    Where the two runs' step 1 is the same arithmetic up to reordered fp32 sums (a sharded and an
//    unsharded 16-bit run: each rank computes the same micro-batch with the same weights bit for bit;
//    only the reduction differs), step 1 keeps kReorderedStep (kReordered16).
//
// Parameters, each tensor on its own, so that one block's or one tensor's wrong update fails by name:
//  - kReordered = 1e-2 (x B): a reordered fp32 sum of n terms differs by about u sqrt(n) sum|terms|
//    (rounding errors of random sign), i.e. relatively by rho = u sqrt(n) kappa, kappa = sum|terms| / |g|
//    the element's condition. A sum of n random-sign terms has kappa ~ sqrt(n) / |Z| (Z standard normal):
//    above K for a fraction P(|Z| < sqrt(n)/K) ~ 0.8 sqrt(n)/K of the elements. With n <= 2^12 (positions,
//    or a layer's width), 95 % of the elements have kappa <= 16 sqrt(n) = 1024, so rho <= 2^-24 x 64 x
//    1024 = 3.9e-3 for them; an update direction, homogeneous of degree 0 in the gradients, moves by
//    <= 2 rho R_t, so |a - b| <= 7.8e-3 B for 95 % of the elements: the median and the 90th percentile of
//    a tensor are below 1e-2 B. The 90th percentile is taken where a tensor has >= kQuantileNumel = 256
//    elements: then more than 10 % of them above the population's 95th percentile has probability 5.4e-4
//    at 256 (the binomial tail: 12.8 expected, 26 needed), 1.5e-6 at 512 and less above; smaller tensors
//    (biases, norms) are held to the median. Each row of a matrix (its elements along the last dims, one
//    output neuron's or one token's) of >= kRowNumel = 64 elements is held to the median too, so that
//    one wrong row (a shift at a shard boundary) fails by its index: a row's median is above the bound
//    only if half of its elements lie above the population's 95th percentile, probability below 1e-20
//    for 32 of 64 (the binomial tail); a row's sums are over the same positions with another input
//    column each, so their cancellations are as independent as any two elements'.
//  - kRounded = 5e-2 (x B): where the runs round their gradients to a 16-bit type differently (a bf16
//    gradient rounded from a sum of 8 rows instead of two of 4; bf16 reductions; fp16 with another loss
//    scale), each element differs relatively by up to 2^-8 and a gradient crosses <= 4 such roundings:
//    rho <= 1.6e-2, a direction moves by <= 2 rho, |a - b| <= 3.2e-2 B, at every element the rounding
//    reaches, the median and the 90th percentile included.
// A wrong gradient (a missing rank, a stale shard, half the data) changes the direction of most of the
// tensors it touches by O(1): their median is O(0.1 B) and more; the step-1 norm moves by the share of
// the gradient it touches. tests/test_parallel.cpp's controls show each kind of fault failing.
inline constexpr double kReorderedStep = 1e-5;
inline constexpr double kRoundedStep = 2e-2;
inline constexpr double kReordered = 1e-2;
inline constexpr double kRounded = 5e-2;
inline constexpr int64_t kQuantileNumel = 256;
inline constexpr int64_t kRowNumel = 64;

struct ParityBounds {
  double first_step = kReorderedStep;   // relative, step 1's loss and grad_norm
  double later_steps = kReorderedStep;  // relative, every later step's
  double params = kReordered;           // x B, each tensor's median and 90th percentile
};
inline constexpr ParityBounds kReorderedRuns{kReorderedStep, kReorderedStep, kReordered};
inline constexpr ParityBounds kRoundedRuns{kRoundedStep, kRoundedStep, kRounded};
// 16-bit compute on both sides whose arithmetic differs only in the order of fp32 sums (a sharded and an
// unsharded run, reduced in another order): step 1 as fp32 runs, later steps within 16-bit roundings of
// the drifted weights' activations, the parameters (fp32 masters) as fp32 runs.
inline constexpr ParityBounds kReordered16{kReorderedStep, kRoundedStep, kReordered};
// ATen's kernels against the fused CPU ones (the lazy device's path against the CPU's): per-op differences of
// a few ulp through chains of <= 1e3 terms, 1e3 u = 6e-5 relative per step (tests/test_device.cpp's top).
inline constexpr ParityBounds kKernelPathRuns{6e-5, 6e-5, kReordered};

// One parameter tensor's |a - b|: its median, 90th percentile (0 under kQuantileNumel elements: not
// checked), its largest row median and that row (0 and -1 for a vector or rows under kRowNumel elements),
// and its max (reported only).
struct TensorDiff {
  std::string name;
  int64_t numel = 0;
  double median = 0.0, q90 = 0.0, row_median = 0.0, max = 0.0;
  int64_t row = -1;
};
inline std::vector<TensorDiff> tensor_diffs(const std::map<std::string, torch::Tensor>& a,
                                            const std::map<std::string, torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  std::vector<TensorDiff> out;
  for (const auto& [name, t] : a) {
    REQUIRE(b.count(name));
    REQUIRE(b.at(name).sizes() == t.sizes());
    const auto d = (t.to(torch::kFloat64) - b.at(name).to(torch::kFloat64)).abs().reshape({-1});
    const auto sorted = std::get<0>(d.sort());
    const int64_t n = d.numel();
    const auto at = [&](double q) { return sorted[static_cast<int64_t>(std::ceil(q * static_cast<double>(n))) - 1].item<double>(); };
    TensorDiff diff{name, n, at(0.5), n >= kQuantileNumel ? at(0.9) : 0.0, 0.0, sorted[n - 1].item<double>(), -1};
    if (t.dim() >= 2 && n / t.size(0) >= kRowNumel) {
      const auto row_medians = std::get<0>(d.reshape({t.size(0), -1}).median(1));
      const auto worst = row_medians.argmax().item<int64_t>();
      diff.row = worst, diff.row_median = row_medians[worst].item<double>();
    }
    out.push_back(diff);
  }
  return out;
}

// The largest relative difference, over two runs' steps, of the loss and of the gradient norm (the runs
// must log the same steps; a step skipped in one and not the other (no norm) differs by 1 or more).
struct RelDiff {
  double loss = 0, grad_norm = 0;
};
inline double rel_diff(double x, double y) {
  const double scale = std::max(std::abs(x), std::abs(y));
  return scale == 0.0 ? 0.0 : std::abs(x - y) / scale;
}
inline RelDiff max_rel_step_diff(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  RelDiff d;
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].step == b[i].step);
    d.loss = std::max(d.loss, rel_diff(a[i].loss, b[i].loss));
    d.grad_norm = std::max(d.grad_norm, rel_diff(a[i].grad_norm, b[i].grad_norm));
  }
  return d;
}

// What a run leaves to compare: every step's loss and gradient norm, and the final parameters.
struct RunOutput {
  std::vector<StepRecord> steps;
  std::map<std::string, torch::Tensor> params;
};
inline RunOutput run_output(const std::filesystem::path& run_dir) {
  return {step_records(run_dir / "metrics.jsonl"), load_params(run_dir)};
}

struct Parity {
  RelDiff first, later;  // step 1; steps 2.. (0 for a one-step run)
  std::vector<TensorDiff> tensors;
  double travel = 0.0;  // B
  ParityBounds bounds;

  // What breaks the bounds, named: "step 1 grad_norm ...", "h.2.w_fc median ...".
  std::vector<std::string> failures() const {
    std::vector<std::string> out;
    const auto step = [&](const char* which, const RelDiff& d, double tol) {
      if (!(d.loss <= tol)) out.push_back(fmt::format("{} loss: relative {:.3g} > {:.3g}", which, d.loss, tol));
      if (!(d.grad_norm <= tol)) out.push_back(fmt::format("{} grad_norm: relative {:.3g} > {:.3g}", which, d.grad_norm, tol));
    };
    step("step 1", first, bounds.first_step);
    step("steps 2..", later, bounds.later_steps);
    const double limit = bounds.params * travel;
    for (const auto& t : tensors) {
      if (!(t.median <= limit)) out.push_back(fmt::format("{} median |a - b| {:.3g} > {:.3g}", t.name, t.median, limit));
      if (!(t.q90 <= limit)) out.push_back(fmt::format("{} 90th percentile |a - b| {:.3g} > {:.3g}", t.name, t.q90, limit));
      if (!(t.row_median <= limit))
        out.push_back(fmt::format("{} row {} median |a - b| {:.3g} > {:.3g}", t.name, t.row, t.row_median, limit));
    }
    return out;
  }
  bool holds() const { return failures().empty(); }
  bool params_hold() const {
    const double limit = bounds.params * travel;
    return std::all_of(tensors.begin(), tensors.end(), [&](const TensorDiff& t) {
      return t.median <= limit && t.q90 <= limit && t.row_median <= limit;
    });
  }
  bool steps_hold() const {
    return first.loss <= bounds.first_step && first.grad_norm <= bounds.first_step && later.loss <= bounds.later_steps &&
           later.grad_norm <= bounds.later_steps;
  }
  // The report: the failures, else the largest figures against their bounds.
  std::string why() const {
    std::string text;
    for (const auto& f : failures()) text += f + "\n";
    double median = 0.0, q90 = 0.0, row = 0.0, max = 0.0;
    for (const auto& t : tensors)
      median = std::max(median, t.median), q90 = std::max(q90, t.q90), row = std::max(row, t.row_median),
      max = std::max(max, t.max);
    return text + fmt::format("steps: step 1 loss {:.3g}, grad_norm {:.3g} (at most {:.3g}); later loss {:.3g}, grad_norm "
                              "{:.3g} (at most {:.3g}); tensors: largest median {:.3g}, 90th percentile {:.3g}, row median "
                              "{:.3g} (at most {:.3g} = {:.3g} B), max {:.3g} (2B = {:.3g})",
                              first.loss, first.grad_norm, bounds.first_step, later.loss, later.grad_norm,
                              bounds.later_steps, median, q90, row, bounds.params * travel, bounds.params, max, 2 * travel);
  }
};

inline Parity parity(const RunOutput& a, const RunOutput& b, double travel, ParityBounds bounds) {
  REQUIRE(a.steps.size() == b.steps.size());
  REQUIRE(!a.steps.empty());
  Parity p;
  p.first = max_rel_step_diff({a.steps.front()}, {b.steps.front()});
  if (a.steps.size() > 1)
    p.later = max_rel_step_diff({a.steps.begin() + 1, a.steps.end()}, {b.steps.begin() + 1, b.steps.end()});
  p.tensors = tensor_diffs(a.params, b.params);
  p.travel = travel;
  p.bounds = bounds;
  return p;
}
// Two run directories; B from `b`'s recipe.
inline Parity parity(const std::filesystem::path& a, const std::filesystem::path& b, ParityBounds bounds = kReorderedRuns) {
  return parity(run_output(a), run_output(b), adamw_travel_bound(b), bounds);
}

struct Runner {
  Runner(const std::string& recipe_text, const std::string& tag)
      : dir(tag), recipe(dir.file("recipe.yaml", recipe_text)) {}
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

// CHECK(parity(a, b[, bounds]).holds()), with the failures and the figures in the report.
#define CHECK_PARITY(...)                                \
  do {                                                   \
    const auto parity_ = ::sl::test::parity(__VA_ARGS__); \
    INFO(parity_.why());                                 \
    CHECK(parity_.holds());                              \
  } while (0)
