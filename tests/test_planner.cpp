// Memory limit, out-of-memory handling and the planner: the simulated limit throws what CUDA throws,
// an OOM run exits 4 with its event and summary, `trainer plan` writes plan.json, and predicted peaks
// are within 10% of measured ones for every checkpointing mode and several batch sizes.
#include <filesystem>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "errors.h"
#include "memory/planner.h"
#include "memory/tracker.h"
#include "memory/tracking_allocator.h"
#include "model/gpt.h"
#include "precision/autocast.h"
#include "recompute/policy.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace sl;
using nlohmann::json;

TEST_CASE("sizes parse with binary and decimal units") {
  CHECK(config::parse_bytes("8GiB", "k") == 8LL << 30);
  CHECK(config::parse_bytes("512 MiB", "k") == 512LL << 20);
  CHECK(config::parse_bytes("2GB", "k") == 2'000'000'000LL);
  CHECK(config::parse_bytes("1.5KiB", "k") == 1536);
  CHECK(config::parse_bytes("4096", "k") == 4096);
  CHECK(config::parse_bytes("0", "k") == 0);
  CHECK_THROWS_AS(config::parse_bytes("8 gigs", "memory.limit"), ConfigError);
  CHECK_THROWS_WITH(config::parse_bytes("lots", "memory.limit"), Catch::Contains("memory.limit: 'lots' is not a size"));
}

TEST_CASE("the simulated limit throws c10::OutOfMemoryError and leaves the count intact") {
  memory::TrackingCPUAllocator::install();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const int64_t base = alloc.current_bytes();
  alloc.set_limit(base + (1 << 20));
  auto ok = torch::empty({1 << 17}, torch::kFloat32);  // 512 KiB: fits
  CHECK_THROWS_AS(torch::empty({1 << 18}, torch::kFloat32), c10::OutOfMemoryError);  // 1 MiB more: refused
  CHECK(alloc.last_refused_bytes() == (1 << 20));
  CHECK(alloc.current_bytes() == base + (1 << 19));
  alloc.set_limit(0);
  CHECK_NOTHROW(torch::empty({1 << 18}, torch::kFloat32));
}

namespace {
// Peak of the second optimizer step, measured through the trainer's step with the tracking allocator.
int64_t measured_peak(const config::RunConfig& cfg) {
  memory::TrackingCPUAllocator::install();
  torch::manual_seed(0);
  memory::Tracker tracker(torch::kCPU);
  const int64_t before = tracker.read().allocated_bytes;
  model::GPT m(cfg.model, torch::kCPU);
  recompute::Policy policy(cfg.checkpointing, m);
  auto opt = train::make_optimizer(m, cfg.train);
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(50000, cfg.model.vocab_size, 5);
  data::Loader loader(src, cfg.train.micro_batch, cfg.train.seq_len, 9);
  const train::ForwardFn fwd = [&](const torch::Tensor& idx) { return policy.forward(idx); };
  const train::StepPrecision prec{precision::compute_dtype(cfg.precision.compute), nullptr};
  train::StepResult r;
  for (int i = 0; i < 2; ++i) r = train::train_step(fwd, m, *opt, {loader.next()}, 1.0, torch::kCPU, tracker, prec);
  return r.mem.peak_allocated_bytes - before;
}
}  // namespace

TEST_CASE("predicted peak is within 10% of the measured peak: tiny and 12-layer recipes, every mode") {
  const std::vector<std::vector<std::string>> modes = {
      {"checkpointing.mode=none"},
      {"checkpointing.mode=full"},
      {"checkpointing.mode=full", "checkpointing.skip_last=false"},
      {"checkpointing.mode=interval", "checkpointing.interval=2"},
      {"checkpointing.mode=sqrt"},
      {"checkpointing.mode=selective", "checkpointing.recompute=[attention, mlp, norm]"},
      {"checkpointing.mode=selective", "checkpointing.recompute=[mlp]"},
  };
  struct Recipe {
    std::string name;
    std::vector<std::string> sets;
    std::vector<int64_t> batches;
  };
  const std::vector<Recipe> recipes = {
      {"tiny", {}, {4, 16}},
      {"12-layer", {"model.n_layer=12", "model.n_embd=128", "model.n_head=4", "train.seq_len=128"}, {2, 8}},
      {"tiny bf16", {"precision.compute=bf16"}, {4, 16}},
      {"12-layer bf16", {"model.n_layer=12", "model.n_embd=128", "model.n_head=4", "train.seq_len=128",
                         "precision.compute=bf16"}, {2, 8}},
  };
  double worst = 0.0;
  std::string worst_case;
  for (const auto& rec : recipes)
    for (const auto& mode : modes)
      for (int64_t b : rec.batches) {
        std::vector<std::string> sets = rec.sets;
        sets.insert(sets.end(), mode.begin(), mode.end());
        sets.push_back("train.micro_batch=" + std::to_string(b));
        auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", sets);
        const double measured = static_cast<double>(measured_peak(cfg));
        const double predicted = static_cast<double>(memory::predict_peak(cfg).peak_bytes());
        const double err = std::abs(predicted - measured) / measured;
        const std::string what = fmt::format("{} {} B={}: measured {} predicted {}", rec.name, fmt::join(mode, " "), b,
                                             measured, predicted);
        INFO(what);
        CHECK(err <= 0.10);
        if (err > 0.05) WARN(what);
        if (err > worst) worst = err, worst_case = what;
      }
  WARN(fmt::format("worst planner error {:.1f}% ({})", 100 * worst, worst_case));
}

TEST_CASE("a run past memory.limit exits 4 with an oom event, a summary and advice from the planner") {
  test::TempDir dir("oom");
  const auto run_dir = dir.path / "run";
  // tiny needs ~86 MiB at micro-batch 16; 60 MiB holds the model states but not the activations.
  auto r = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.steps=5 --set logging.dir=" +
                         run_dir.string());
  INFO(r.output);
  CHECK(r.code == kExitOom);
  CHECK(r.output.find("out of memory in forward") != std::string::npos);
  CHECK(r.output.find("the planner predicts these fit 60.0 MiB") != std::string::npos);
  CHECK(r.output.find("full: micro_batch") != std::string::npos);
  auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitOom);
  CHECK(summary["memory_limit_bytes"] == 60LL << 20);
  const auto& oom = summary["oom"];
  CHECK(oom["step"] == 1);
  CHECK(oom["phase"] == "forward");
  CHECK(oom["requested_bytes"].get<int64_t>() > 0);
  CHECK(oom["peak_bytes"].get<int64_t>() <= 60LL << 20);
  CHECK(oom["limit_bytes"] == 60LL << 20);
  const auto metrics = test::read_text(run_dir / "metrics.jsonl");
  CHECK(metrics.find("\"event\":\"oom\"") != std::string::npos);
  for (const auto& e : std::filesystem::directory_iterator(run_dir)) CHECK(e.path().extension() != ".tmp");

  // The planner's advice holds: full checkpointing at the suggested micro-batch runs under the same limit.
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {"checkpointing.mode=full"});
  const int64_t mb = memory::largest_micro_batch(cfg, 60LL << 20);
  REQUIRE(mb > 0);
  auto ok = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.steps=2 "
                          "--set checkpointing.mode=full --set train.micro_batch=" + std::to_string(mb) +
                          " --set logging.dir=" + (dir.path / "ok").string());
  INFO(ok.output);
  CHECK(ok.code == 0);
}

TEST_CASE("trainer plan writes plan.json with the breakdown and the largest micro-batch per mode") {
  test::TempDir dir("plan");
  const auto out = dir.path / "plan.json";
  auto r = test::trainer("plan --config configs/7b_ckpt.yaml --memory 80GiB --out " + out.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("6738415616") != std::string::npos);
  CHECK(r.output.find("Model states alone (100.4 GiB) exceed 80.0 GiB") != std::string::npos);
  auto plan = json::parse(test::read_text(out));
  CHECK(plan["params"] == 6'738'415'616);
  CHECK(plan["optimizer_state_bytes"] == 8 * 6'738'415'616LL);
  for (const auto& m : plan["modes"]) CHECK(m["largest_micro_batch"] == 0);

  auto tiny = test::trainer("plan --config configs/tiny.yaml --memory 100MiB --out " + out.string());
  REQUIRE(tiny.code == 0);
  plan = json::parse(test::read_text(out));
  int64_t none_mb = 0, full_mb = 0;
  for (const auto& m : plan["modes"]) {
    if (m["mode"] == "none") none_mb = m["largest_micro_batch"];
    if (m["mode"] == "full") full_mb = m["largest_micro_batch"];
    CHECK(m.contains("grad_accum_for_global_batch"));
  }
  CHECK(none_mb >= 16);  // the recipe's own batch fits in 100 MiB (measured peak ~85 MiB)
  CHECK(full_mb > none_mb);
  // Bad --memory is a usage error.
  CHECK(test::trainer("plan --config configs/tiny.yaml --memory lots").code == kExitConfig);
}

TEST_CASE("micro_batch: auto finds what a brute-force search finds, keeping the global batch") {
  memory::TrackingCPUAllocator::install();
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml",
                          {"memory.limit=60MiB", "train.micro_batch=auto", "train.global_batch=32"});
  memory::TrackingCPUAllocator::instance().set_limit(60LL << 20);
  int64_t brute = 0;
  for (int64_t b : {1, 2, 4, 8, 16, 32})
    if (train::micro_batch_fits(cfg, b, torch::kCPU)) brute = b;
  memory::TrackingCPUAllocator::instance().set_limit(0);
  REQUIRE(brute > 0);
  REQUIRE(brute < 32);  // the limit binds

  test::TempDir dir("auto");
  auto r = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.micro_batch=auto "
                         "--set train.global_batch=32 --set train.steps=2 --set logging.dir=" + (dir.path / "run").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("micro_batch auto: planner predicted") != std::string::npos);
  auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  const auto& search = summary["micro_batch_search"];
  CHECK(search["micro_batch"] == brute);
  CHECK(search["grad_accum"] == 32 / brute);
  CHECK(search["trials"].size() <= 4);  // bisection from the planner's guess, not a walk
  CHECK(summary["config"]["train"]["micro_batch"] == brute);
  CHECK(summary["tokens"] == 2 * 32 * 128);  // the global batch is kept

  CHECK(test::trainer("--config configs/tiny.yaml --set train.micro_batch=auto --set memory.limit=1GiB").code == kExitConfig);
  CHECK(test::trainer("--config configs/tiny.yaml --set train.micro_batch=auto --set train.global_batch=32").code == kExitConfig);
}

TEST_CASE("per-rank model states follow the ZeRO formulas") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  const auto one = memory::predict_peak(cfg);
  const int64_t n = memory::total_params(cfg.model);
  CHECK(one.params_bytes == 4 * n);
  CHECK(one.model_states_bytes() == 16 * n);
  CHECK(one.transient_bytes == 0);
  const auto units = memory::unit_param_counts(cfg.model);
  REQUIRE(units.size() == static_cast<size_t>(cfg.model.n_layer + 2));
  const int64_t largest = *std::max_element(units.begin(), units.end());
  cfg.world_size = 4;
  const int64_t P = 4 * n, G = 4 * n, O = 8 * n;
  for (const std::string stage : {"none", "zero1", "zero2", "zero3"}) {
    INFO(stage);
    cfg.parallel.sharding = stage;
    const auto p = memory::predict_peak(cfg);
    const int64_t expect = stage == "none"    ? P + G + O
                           : stage == "zero1" ? P + G + O / 4
                           : stage == "zero2" ? P + (G + O) / 4
                                              : (P + G + O) / 4;
    CHECK(std::abs(p.model_states_bytes() - expect) <= 4);  // integer division per state
    CHECK(p.activations.peak_bytes == one.activations.peak_bytes);  // activations are per rank already
    if (stage == "zero3") CHECK(p.transient_bytes == 2 * 4 * largest);
  }
  // trainer plan --world-size reports per rank.
  test::TempDir dir("plan-world");
  auto r = test::trainer("plan --config configs/tiny.yaml --set parallel.sharding=zero3 --world-size 4 --out " +
                         (dir.path / "plan.json").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("4 x zero3") != std::string::npos);
  const auto j = json::parse(test::read_text(dir.path / "plan.json"));
  CHECK(j["world_size"] == 4);
  CHECK(std::abs(j["model_states_bytes"].get<int64_t>() - (P + G + O) / 4) <= 4);
}
