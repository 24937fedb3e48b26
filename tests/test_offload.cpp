// Offload to host memory (the recipe's offload section), on CPU where the device is simulated: the
// tracking allocator counts host-placed tensors in a pool of their own (device/host.h).
//  - every placement (optimizer; + gradients; + parameters; activations; all of them; the optimizer
//    under DDP at world 2) gives the
//    losses and gradient norms of the same recipe without offload, bitwise, in fp32, bf16 and fp16
//    (with the loss scaler), at world 1 and 2, with less device memory and the offloaded bytes in the host pool;
//  - the planner predicts the device and the host peak within 5 % and the bytes moved per step exactly
//    (world 1; within the groups' padding at world 2);
//  - under one memory.limit, a recipe that runs out of memory without offload trains with it, bitwise
//    equal to the run without a limit;
//  - memory.host_limit exceeded is a clean exit 4 that names host memory (before training when the
//    offloaded states cannot fit it, in the step that runs out otherwise), its oom record and
//    host_memory giving the host pool's peak and limit;
//  - memory.host_limit equal to the planner's host peak trains, one byte less does not (exact);
//  - placements a sharding stage cannot carry are refused when the recipe is read.
// (kill -9 and --resume with offload: tests/test_resume.cpp.)
#include <algorithm>
#include <thread>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "predict/budget.h"
#include "recompute/plan.h"
#include "config/config.h"
#include "config/shape.h"
#include "device/device.h"
#include "device/host.h"
#include "errors.h"
#include "predict/footprint.h"
#include "memory/tracking_allocator.h"
#include "predict/planner.h"
#include "recipes.h"
#include "runs.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;
using test::Runner;
using test::summary;

namespace {

// tests/recipes.h's GPT-2 at T 64, micro-batch 4 x accumulation 2, 4 steps, full recompute, 0.05 MiB buckets;
// no state at the end, no final weights.
const std::string kRecipe = test::recipe_gpt2()
                                .set("train.seq_len", "64")
                                .set("train.grad_accum", "2")
                                .set("train.steps", "4")
                                .set("train.warmup_steps", "1")
                                .set("checkpointing.mode", "full")
                                .set("parallel.bucket_mb", "0.05")
                                .set("state.at_end", "false")
                                .erase("logging.save_model")
                                .yaml();

Runner& shared_runner() {
  static Runner runner(kRecipe, "offload");
  return runner;
}

struct Placement {
  std::string name, sharding, sets;
  int min_world = 1;  // DDP offloads at world > 1 only (one process without sharding has no engine)
};
const std::string kOptimizer = " --set offload.optimizer=true";
const std::string kGradients = kOptimizer + " --set offload.gradients=true";
const std::string kParameters = kGradients + " --set offload.parameters=true";
const std::string kActivations = " --set offload.activations=true";
const std::vector<Placement> kPlacements = {
    {"optimizer", "zero1", kOptimizer},
    {"optimizer + gradients", "zero2", kGradients},
    {"optimizer + gradients + parameters", "zero3", kParameters},
    {"activations", "none", kActivations},
    {"everything", "zero3", kParameters + kActivations},
    {"optimizer under DDP", "none", kOptimizer, 2},
};

// fp32, or bf16 / fp16 compute (with a compute copy of the weights in that dtype where a sharding stage
// keeps masters; fp16 with the dynamic loss scaler, which unscales the host-resident gradient shards).
std::string precision_sets(const std::string& precision, const std::string& sharding) {
  if (precision == "fp32") return "";
  return " --set precision.compute=" + precision +
         (sharding == "none" ? std::string() : " --set precision.param_dtype=" + precision);
}
std::string base_sets(const Placement& p, const std::string& precision) {
  return "--set parallel.sharding=" + p.sharding + precision_sets(precision, p.sharding);
}

json last_step(const std::filesystem::path& run_dir) {
  json last;
  for (const auto& r : test::read_jsonl(run_dir / "metrics.jsonl"))
    if (!r.contains("event")) last = r;
  REQUIRE(last.is_object());
  return last;
}

config::RunConfig recipe_config(const std::string& sets, int world) {
  std::vector<std::string> overrides;
  std::istringstream in(sets);
  for (std::string word; in >> word;)
    if (word != "--set") overrides.push_back(word);
  // load() validates against WORLD_SIZE, as torchrun sets it for the ranks.
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  auto cfg = config::load_string(kRecipe, overrides);
  ::unsetenv("WORLD_SIZE");
  REQUIRE(cfg.world_size == world);
  return cfg;
}

}  // namespace

TEST_CASE("every placement trains bitwise like the recipe without offload (fp32, bf16, fp16, world 1 and 2), with "
          "its states in host memory") {
  Runner& run = shared_runner();
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    for (const int world : {1, 2}) {
      for (const auto& p : kPlacements) {
        if (world < p.min_world) continue;
        INFO(p.name << ", " << precision << ", world " << world);
        const std::string base = base_sets(p, precision);
        const auto ref = run.train(world, base);
        const auto got = run.train(world, base + p.sets);
        CHECK(test::bitwise_diff(test::step_records(got / "metrics.jsonl"), test::step_records(ref / "metrics.jsonl")) == "");
        const auto s_ref = summary(ref), s_got = summary(got);
        CHECK(s_ref["host_memory"]["peak_bytes"].get<int64_t>() == 0);
        CHECK(s_got["host_memory"]["peak_bytes"].get<int64_t>() > 0);
        // Every transfer of the offloaded run is the simulated device's (device/host.h's copy counts).
        CHECK(s_got["host_memory"]["copies"]["path"] == "simulated");
        CHECK(s_got["host_memory"]["copies"]["simulated"].get<int64_t>() > 0);
        CHECK(s_got["peak_allocated_bytes"].get<int64_t>() <= s_ref["peak_allocated_bytes"].get<int64_t>());
        if (p.sets != kActivations) {  // model states left the device
          CHECK(s_got["peak_allocated_bytes"].get<int64_t>() < s_ref["peak_allocated_bytes"].get<int64_t>());
          CHECK(s_got["host_memory"]["states_bytes"].get<int64_t>() > 0);
        }
        const auto rec = last_step(got);
        CHECK(rec["offload_to_host_bytes"].get<int64_t>() > 0);
        CHECK(rec["host_peak_bytes"].get<int64_t>() > 0);
      }
    }
  }
}

TEST_CASE("the planner predicts the device and host peaks within 5% and the bytes moved per step", "[numerics]") {
  Runner& run = shared_runner();
  for (const int world : {1, 2}) {
    for (const auto& p : kPlacements) {
      if (world < p.min_world) continue;
      INFO(p.name << ", world " << world);
      const std::string sets = base_sets(p, "fp32") + p.sets;
      const auto dir = run.train(world, sets);
      const auto s = summary(dir);
      const double device = s["peak_allocated_bytes"].get<double>(), device_pred = s["predicted_peak_bytes"].get<double>();
      const double host = s["host_memory"]["peak_bytes"].get<double>();
      const double host_pred = s["host_memory"]["predicted_peak_bytes"].get<double>();
      INFO("device " << device << " predicted " << device_pred << "; host " << host << " predicted " << host_pred);
      if (p.sharding != "zero3") {
        CHECK(std::abs(device_pred - device) <= 0.05 * device);
      } else {
        // At this width (d 64) the activation model over-counts zero3's recompute moment by ~0.4 MB
        // (measured at the peak: the gathered units and gradient buffer are exactly the predicted
        // transient, the activations 1.68 MB against 2.04 MB predicted), which with every state
        // offloaded is 20 % of the device: an upper bound here; the next case checks 5 % at d 256.
        const double transient = s["parallel"]["ranks"][0]["transient_peak_bytes"].get<double>();
        CHECK(device_pred >= 0.95 * device);
        CHECK(device_pred <= 1.05 * device + transient);
      }
      CHECK(std::abs(host_pred - host) <= 0.05 * host);
      // Bytes moved: counted where the copies are made, against the planner's count of them.
      const auto cfg = recipe_config(sets, world);
      const auto traffic = planner::offload_traffic(memory::Scenario::of(cfg), budget::plan_for(memory::Scenario::of(cfg)));
      const auto rec = last_step(dir);
      const double to_host = rec["offload_to_host_bytes"].get<double>(), to_device = rec["offload_to_device_bytes"].get<double>();
      INFO("to host " << to_host << " predicted " << traffic.to_host_bytes << "; to device " << to_device << " predicted "
                      << traffic.to_device_bytes);
      if (world == 1) {
        CHECK(to_host == static_cast<double>(traffic.to_host_bytes));
        CHECK(to_device == static_cast<double>(traffic.to_device_bytes));
      } else {  // groups are padded to a multiple of the world size: a few elements each
        CHECK(std::abs(to_host - static_cast<double>(traffic.to_host_bytes)) <= 0.01 * to_host);
        CHECK(std::abs(to_device - static_cast<double>(traffic.to_device_bytes)) <= 0.01 * std::max(1.0, to_device));
      }
    }
  }
}

TEST_CASE("at width 256 the planner predicts every placement's device and host peak within 5%") {
  // 4 layers of d 256, T 128, micro-batch 2 x 2, one 25 MiB bucket: where activations and states
  // have a realistic balance (measured: every placement within 0.3 % on the device, host to the byte).
  Runner& run = shared_runner();
  const std::string shape = " --set model.n_embd=256 --set model.n_head=4 --set model.max_seq_len=128 --set train.seq_len=128 "
                            "--set train.micro_batch=2 --set train.steps=3 --set parallel.bucket_mb=25";
  for (const auto& p : kPlacements) {
    if (p.min_world > 1) continue;
    INFO(p.name);
    const auto s = summary(run.train(1, base_sets(p, "fp32") + p.sets + shape));
    const double device = s["peak_allocated_bytes"].get<double>(), host = s["host_memory"]["peak_bytes"].get<double>();
    INFO("device " << device << " predicted " << s["predicted_peak_bytes"].get<double>() << "; host " << host
                   << " predicted " << s["host_memory"]["predicted_peak_bytes"].get<double>());
    CHECK(std::abs(s["predicted_peak_bytes"].get<double>() - device) <= 0.05 * device);
    CHECK(std::abs(s["host_memory"]["predicted_peak_bytes"].get<double>() - host) <= 0.05 * host);
  }
}

TEST_CASE("trainer plan --world-size plans DDP's optimizer offload, every rank with the whole model on its host") {
  test::TempDir dir("offload-plan");
  const auto out = dir.path / "plan.json";
  const auto r = test::trainer(fmt::format("plan --config {} --set offload.optimizer=true --world-size 2 --out {}",
                                           shared_runner().recipe, out.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto j = json::parse(test::read_text(out));
  const int64_t n = j["params"].get<int64_t>();
  CHECK(j["world_size"].get<int64_t>() == 2);
  CHECK(j["offload"]["host_params_bytes"].get<int64_t>() == 4 * n);
  CHECK(j["offload"]["host_optimizer_bytes"].get<int64_t>() == 8 * n);
  CHECK(r.output.find("host: AdamW moments") != std::string::npos);
  // The table shows what moves per step and what the transfers cost on the recipe's hardware.
  CHECK(j["offload"]["to_host_bytes_per_step"].get<int64_t>() == 4 * n);
  CHECK(j["offload"]["to_device_bytes_per_step"].get<int64_t>() == 4 * n);
  CHECK(j["offload"]["transfer_s"].get<double>() == Approx(8.0 * static_cast<double>(n) / 25e9));
  CHECK(r.output.find("moved per step") != std::string::npos);
  CHECK(r.output.find("modelled step time") != std::string::npos);
}

TEST_CASE("under one memory.limit the recipe exits 4 without offload and trains with it, bitwise as without a limit") {
  Runner& run = shared_runner();
  const Placement& p = kPlacements[1];  // zero2: optimizer + gradients
  const std::string base = base_sets(p, "fp32");
  const auto plain = run.train(1, base), offloaded = run.train(1, base + p.sets);
  const int64_t plain_peak = summary(plain)["peak_allocated_bytes"].get<int64_t>();
  const int64_t offload_peak = summary(offloaded)["peak_allocated_bytes"].get<int64_t>();
  REQUIRE(offload_peak < plain_peak);
  const int64_t limit = (plain_peak + offload_peak) / 2;
  INFO("peaks " << plain_peak << " / " << offload_peak << ", limit " << limit);
  test::TempDir dir("offload-limit");
  const std::string limited = fmt::format(" --set memory.limit={}", limit);
  const auto refused = test::trainer(fmt::format("--config {} {}{} --set logging.dir={}", run.recipe, base, limited,
                                                 (dir.path / "plain").string()));
  INFO(refused.output);
  CHECK(refused.code == kExitOom);
  const auto fits = dir.path / "offload";
  const auto ok = test::trainer(fmt::format("--config {} {}{}{} --set logging.dir={}", run.recipe, base, p.sets, limited,
                                            fits.string()));
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  CHECK(test::bitwise_diff(test::step_records(fits / "metrics.jsonl"), test::step_records(plain / "metrics.jsonl")) == "");
  CHECK(summary(fits)["peak_allocated_bytes"].get<int64_t>() <= limit);
}

TEST_CASE("memory.host_limit exceeded is a clean exit 4 naming host memory: before training, and in a step") {
  Runner& run = shared_runner();
  const Placement& p = kPlacements[4];  // everything, the checkpointed inputs too
  const std::string sets = base_sets(p, "fp32") + p.sets;
  const auto predicted = planner::predict_peak(memory::Scenario::of(recipe_config(sets, 1)));
  REQUIRE(predicted.activations.host_bytes > 0);
  test::TempDir dir("offload-host-limit");
  const auto train = [&](int64_t limit, const std::filesystem::path& run_dir) {
    return test::trainer(fmt::format("--config {} {} --set memory.host_limit={} --set logging.dir={}", run.recipe, sets,
                                     limit, run_dir.string()));
  };
  {  // Below the offloaded model states: refused before any weight exists, no run directory left.
    const auto run_dir = dir.path / "states";
    const auto r = train(predicted.host_states_bytes() / 2, run_dir);
    INFO(r.output);
    CHECK(r.code == kExitOom);
    CHECK(r.output.find("cannot fit host memory") != std::string::npos);
    CHECK(r.output.find("memory.host_limit") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(run_dir));
  }
  {  // Room for the states, not for the checkpointed inputs: the first forward runs out, exit 4 with summary.json.
    const int64_t limit = predicted.host_states_bytes() + predicted.activations.host_bytes / 2;
    const auto run_dir = dir.path / "step";
    const auto r = train(limit, run_dir);
    INFO(r.output);
    CHECK(r.code == kExitOom);
    CHECK(r.output.find("out of host memory") != std::string::npos);
    CHECK(r.output.find("memory.host_limit") != std::string::npos);
    const auto s = summary(run_dir);
    CHECK(s["exit_status"]["code"].get<int>() == kExitOom);
    CHECK(s["oom"]["memory"] == "host");
    CHECK(s["oom"]["phase"] == "forward");
    CHECK(s["host_memory"]["limit_bytes"].get<int64_t>() == limit);
  }
}

TEST_CASE("offload placements a sharding stage cannot carry are refused when the recipe is read") {
  const auto refused = [](const std::vector<std::string>& sets) -> std::string {
    try {
      config::load_string(kRecipe, sets);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(refused({"offload.optimizer=true"}).find("parallel.sharding: zero1") != std::string::npos);  // none at world 1
  CHECK(refused({"parallel.sharding=zero1", "offload.optimizer=true", "offload.gradients=true"}).find("zero2") != std::string::npos);
  CHECK(refused({"parallel.sharding=zero2", "offload.gradients=true"}).find("offload.optimizer: true") != std::string::npos);
  CHECK(refused({"parallel.sharding=zero2", "offload.optimizer=true", "offload.parameters=true"}).find("zero3") != std::string::npos);
  CHECK(refused({"parallel.sharding=zero3", "offload.optimizer=true"}).find("offload.parameters: true") != std::string::npos);
  CHECK(refused({"checkpointing.mode=none", "offload.activations=true"}).find("offload.activations") != std::string::npos);
  CHECK(refused({"offload.overlap=1.5"}).find("offload.overlap") != std::string::npos);
  CHECK(refused({"memory.host_limit=lots"}).find("memory.host_limit") != std::string::npos);
  CHECK(refused({"parallel.sharding=zero3", "offload.optimizer=true", "offload.parameters=true", "offload.gradients=true",
                 "offload.activations=true"}) == "");
}

TEST_CASE("mode budget takes offload as a fourth choice when transfers are cheap, never when they are slow, and "
          "trains bitwise like mode none") {
  // Budgets from below the full-checkpointing activation peak up to none's: the schedules in between
  // keep, recompute (selectively or wholly) or offload per block. Slow transfers (1 MB/s) are chosen
  // only where nothing else fits; cheap ones (1 PB/s) wherever a kept block is faster than a recompute.
  auto with = [](const std::string& budget, const std::string& bandwidth) {
    return recipe_config("--set checkpointing.mode=budget --set checkpointing.profile_costs=false --set checkpointing.budget=" +
                             budget + " --set offload.activations=true --set offload.bandwidth_gbps=" + bandwidth, 1);
  };
  const auto offloaded_blocks = [](const recompute::Plan& p) {
    int64_t n = 0;
    for (const auto& s : p.segments)
      if (s.offloaded) n += s.end - s.begin;
    return n;
  };
  std::string cheap_budget;
  for (int kib = 256; kib <= 8192; kib += 128) {
    const std::string budget = std::to_string(kib) + "KiB";
    INFO("budget " << budget);
    const auto slow = budget::try_plan_for(memory::Scenario::of(with(budget, "1e-3")));
    const auto cheap = budget::try_plan_for(memory::Scenario::of(with(budget, "1e6")));
    auto without = with(budget, "1e6");
    without.offload.activations = false;
    const auto plain = budget::try_plan_for(memory::Scenario::of(without));
    if (plain) CHECK(slow.has_value());  // offload only adds schedules
    if (slow) CHECK(cheap.has_value());
    // Slow transfers: offload only where no schedule without it fits the budget.
    if (slow && plain) CHECK(offloaded_blocks(*slow) == 0);
    if (cheap && offloaded_blocks(*cheap) > 0 && cheap_budget.empty()) cheap_budget = budget;
    if (cheap && slow) CHECK(cheap->budget.recompute_cost <= slow->budget.recompute_cost + 1e-9);  // the fastest under the budget
  }
  REQUIRE(!cheap_budget.empty());
  Runner& run = shared_runner();
  const auto none = run.train(1, "--set checkpointing.mode=none");
  const auto dir = run.train(1, "--set checkpointing.mode=budget --set checkpointing.profile_costs=false "
                                "--set checkpointing.budget=" + cheap_budget +
                                " --set offload.activations=true --set offload.bandwidth_gbps=1e6");
  CHECK(test::bitwise_diff(test::step_records(dir / "metrics.jsonl"), test::step_records(none / "metrics.jsonl")) == "");
  const auto s = summary(dir);
  int64_t offload_choices = 0;
  for (const auto& b : s["checkpointing"]["blocks"]) offload_choices += (b["choice"] == "offload") ? 1 : 0;
  CHECK(offload_choices > 0);
  CHECK(s["host_memory"]["peak_bytes"].get<int64_t>() > 0);
  CHECK(s["host_memory"]["peak_bytes"].get<int64_t>() == s["host_memory"]["predicted_peak_bytes"].get<int64_t>());
}

TEST_CASE("configs/7b_24gb.yaml: the planner puts a 7B fine-tune under 22 GiB of one 24 GB GPU, and not without offload") {
  auto cfg = config::load(test::kSourceDir + "/configs/7b_24gb.yaml", {});
  REQUIRE(config::Shape(cfg.model).total_params() > 6'700'000'000);
  const auto plan = budget::plan_for(memory::Scenario::of(cfg));
  const auto p = memory::predict_peak(memory::Scenario::of(cfg), plan);
  const int64_t gib = int64_t{1} << 30;
  INFO("device " << p.peak_bytes() << ", host " << p.host_peak_bytes());
  CHECK(p.peak_bytes() <= 22 * gib);
  CHECK(p.host_peak_bytes() >= 100 * gib);  // fp32 masters, gradient shard and moments: 16 bytes a parameter
  const auto t = planner::offload_traffic(memory::Scenario::of(cfg), plan);
  CHECK(t.to_host_bytes > 0);
  CHECK(t.step_s > t.compute_s);
  CHECK(t.compute_s > 0);
  // The tutorial's trio alone (bf16, checkpointing, accumulation) does not fit: the model states exceed the card.
  auto plain = cfg;
  plain.offload = config::OffloadConfig{};
  CHECK(memory::predict_states(memory::Scenario::of(plain)).model_states_bytes() > 24 * gib);
}

// Llama-3-8B's shape (without GQA, 8.84e9 parameters) fine-tuned on one 24 GB GPU two ways: LoRA with the
// frozen base in bf16 (no host memory) and a full fine-tune with the optimizer and gradients offloaded. Both
// fit the 22.4 GiB the planner leaves of 24 GB at the peaks their headers state; each trains at a tiny shape
// on the CPU with its own settings (the twin).
TEST_CASE("configs/llama3_8b_{lora,full}_24gb.yaml fit one 24 GB GPU as their headers say, and their tiny twins train") {
  const int64_t gib = int64_t{1} << 30;
  struct Claim {
    std::string recipe;
    double peak_gib, host_gib;
  };
  for (const Claim& c : {Claim{"llama3_8b_lora_24gb", 20.3, 0.0}, Claim{"llama3_8b_full_24gb", 21.3, 131.7}}) {
    INFO(c.recipe);
    auto cfg = config::load(test::kSourceDir + "/configs/" + c.recipe + ".yaml", {});
    const auto sc = memory::Scenario::of(cfg);
    const auto p = memory::predict_peak(sc, budget::plan_for(sc));
    CHECK(std::abs(static_cast<double>(p.peak_bytes()) / gib - c.peak_gib) < 0.05);
    CHECK(std::abs(static_cast<double>(p.host_peak_bytes()) / gib - c.host_gib) < 0.05);
    CHECK(p.peak_bytes() <= 24'000'000'000LL);  // 24 GB: 22.4 GiB
    test::TempDir dir("twin-" + c.recipe);
    const auto r = test::trainer(
        "--config configs/" + c.recipe + ".yaml --set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64 "
        "--set model.mlp_hidden=160 --set model.vocab_size=256 --set model.max_seq_len=64 --set train.seq_len=32 "
        "--set train.grad_accum=2 --set train.steps=2 --set train.device=cpu --set logging.peak_tflops=0 "
        "--set logging.dir=" + (dir.path / "run").string());
    INFO(r.output);
    CHECK(r.code == 0);
  }
}

// The planner's host peak is every tensor the run makes in host memory, to the byte, on the rank where it
// is largest: the offloaded states of every engine group with its padding to the world size, the host
// AdamW's piece index, and state.async's snapshot with its RNG state. A memory.host_limit equal to it is
// enough for every rank, and one byte less is not: at world 1 the host pool reaches it exactly; at world
// 2 the rank that reaches it may be rank 1 (its range can straddle a group's matrices-then-vectors
// boundary: one more AdamW piece), so rank 0's peak (the one summary.json has) is at most the figure and
// a limit one byte lower stops a rank with exit 4 in host memory.
TEST_CASE("memory.host_limit at exactly the planner's host peak trains and the host pool reaches it to the byte "
          "(zero2 and zero3; world 1 and 2; with and without state.async's snapshot)") {
  Runner& run = shared_runner();
  for (const int world : {1, 2})
    for (const Placement* p : {&kPlacements[1], &kPlacements[2]})  // zero2: optimizer + gradients; zero3: + parameters
      for (const int every : {0, 2}) {                             // 2: snapshots after steps 2 and 4 (state.async)
        const std::string sets = base_sets(*p, "fp32") + p->sets + fmt::format(" --set state.every={}", every);
        const int64_t predicted = planner::predict_peak(memory::Scenario::of(recipe_config(sets, world))).host_peak_bytes();
        INFO(p->name << ", world " << world << ", state.every " << every << ": predicted host peak " << predicted);
        const auto dir = run.train(world, sets + fmt::format(" --set memory.host_limit={}", predicted));  // every rank exits 0
        const auto s = summary(dir);
        CHECK(s["host_memory"]["limit_bytes"].get<int64_t>() == predicted);
        CHECK(s["host_memory"]["predicted_peak_bytes"].get<int64_t>() == predicted);
        if (every > 0) CHECK(s["state"]["snapshot_bytes"].get<int64_t>() > 0);
        if (world == 1) {
          CHECK(s["host_memory"]["peak_bytes"].get<int64_t>() == predicted);
          continue;
        }
        CHECK(s["host_memory"]["peak_bytes"].get<int64_t>() <= predicted);
        test::TempDir below("offload-host-exact");
        const auto m = test::launch(world, fmt::format("--config {} {} --set memory.host_limit={} --set logging.dir={}",
                                                       run.recipe, sets, predicted - 1, (below.path / "run").string()));
        std::string outputs;
        for (const auto& o : m.outputs) outputs += o + "\n----\n";
        INFO(outputs);
        CHECK(std::count(m.codes.begin(), m.codes.end(), kExitOom) >= 1);
        CHECK(outputs.find("out of host memory") != std::string::npos);
      }
}

TEST_CASE("a host out-of-memory in a step reports the host pool: its peak and memory.host_limit in the oom record and "
          "host_memory") {
  Runner& run = shared_runner();
  const Placement& p = kPlacements[4];  // everything offloaded: the checkpointed inputs go to the host in forward
  const std::string sets = base_sets(p, "fp32") + p.sets;
  const auto predicted = planner::predict_peak(memory::Scenario::of(recipe_config(sets, 1)));
  REQUIRE(predicted.activations.host_bytes > 0);
  // Room for the offloaded states, not for all the checkpointed inputs: the first forward runs out.
  const int64_t limit = predicted.host_states_bytes() + predicted.activations.host_bytes / 2;
  test::TempDir dir("offload-host-oom");
  const auto run_dir = dir.path / "run";
  const auto r = test::trainer(fmt::format("--config {} {} --set memory.host_limit={} --set logging.dir={}", run.recipe,
                                           sets, limit, run_dir.string()));
  INFO(r.output);
  REQUIRE(r.code == kExitOom);
  const auto s = summary(run_dir);
  const auto& oom = s["oom"];
  REQUIRE(oom.is_object());
  CHECK(oom["memory"] == "host");
  CHECK(oom["limit_bytes"].get<int64_t>() == limit);
  const int64_t peak = oom["peak_bytes"].get<int64_t>(), requested = oom["requested_bytes"].get<int64_t>();
  // The states were in host memory before the step; the refused request did not fit beside what was live
  // (live <= peak): the allocator refuses when live + requested > limit.
  CHECK(peak >= predicted.host_states_bytes());
  CHECK(peak <= limit);
  CHECK(peak + requested > limit);
  // host_memory's peak is the pool's, the failed step included (no step finished).
  CHECK(s["host_memory"]["peak_bytes"].get<int64_t>() == peak);
  CHECK(s["host_memory"]["limit_bytes"].get<int64_t>() == limit);
  const auto events = test::events(run_dir / "metrics.jsonl", "oom");
  REQUIRE(events.size() == 1);
  CHECK(events[0]["limit_bytes"].get<int64_t>() == limit);
  CHECK(events[0]["peak_bytes"].get<int64_t>() == peak);
}

// On CUDA the engine's gradient hooks run on autograd's device thread, where no caller's HostScope is
// open: a host copy made there (device::host_readable of a reduce-scattered gradient shard under
// offload.gradients) must open its own, or it escapes the host pool and memory.host_limit. The lazy
// device copies to the host as CUDA does; a fresh std::thread has no scope open, as the device thread.
TEST_CASE("a host copy made on a thread without a HostScope (autograd's CUDA thread) counts in the host pool") {
  memory::TrackingCPUAllocator::install();
  config::TrainConfig t;
  t.device = config::DeviceChoice::kLazy;
  const auto dev = device::resolve_device(t);
  const auto on_device = torch::ones({1 << 16}, torch::TensorOptions().device(dev));
  int64_t before = 0, during = 0;
  bool scope_open = true;
  std::thread hook([&] {
    scope_open = device::HostScope::active();
    before = memory::TrackingCPUAllocator::instance().host_current_bytes();
    const auto h = device::host_readable(on_device);
    during = memory::TrackingCPUAllocator::instance().host_current_bytes();
    CHECK(h.device().is_cpu());
  });
  hook.join();
  CHECK_FALSE(scope_open);
  // The copy's 256 KiB (2^16 float32) are host-pool bytes while it lives (the pool may hold more:
  // other live host tensors are not freed in between on this thread).
  CHECK(during - before >= static_cast<int64_t>(on_device.nbytes()));
}

}  // namespace SUBLINEAR_TEST_FILE
