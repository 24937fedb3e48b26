// model.lora through the trainer (the adapters' numerics against PEFT are tests/test_hf.cpp's, their
// recompute in every checkpointing mode tests/test_recompute.cpp's):
//  - only the adapters train: the frozen weights end bitwise where they began (the merged final weights
//    equal the base plus (alpha / r) B A of the saved adapters), no gradient or optimizer state exists for
//    them, and the training state holds the adapters and their moments only;
//  - DDP, zero1, zero2 and zero3 (the adapters sharded by block, the frozen weights whole on every rank) at
//    world 2, and the host AdamW of offload.optimizer, train the adapters as one
//    process does (tests/runs.h's parity: every step's loss and gradient norm, each adapter tensor in units
//    of AdamW's travel);
//  - a run resumed from its state is bitwise the uninterrupted one; a world-2 zero2 state resumes at
//    world 1 and goes on within the world-size tolerance;
//  - recipes and adapter directories the trainer cannot honour exit 2 or 3 naming the key or file.
#include <filesystem>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "errors.h"
#include "interop/hf.h"
#include "interop/peft.h"
#include "recipes.h"
#include "runs.h"
#include "state/safetensors.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// tests/recipes.h's GPT-2 (T 32, micro-batch 4, 10 steps, final weights saved) with rank-4 adapters on
// every projection and a learning rate that moves them.
const std::string kLora = "--set 'model.lora={rank: 4, alpha: 8, targets: [all-linear]}' --set train.lr=1e-2";

test::Runner& runner() {
  static test::Runner r(test::recipe_gpt2().yaml(), "lora");
  return r;
}

void require_exit(const test::Result& r, int code, const std::string& text) {
  INFO(r.output);
  CHECK(r.code == code);
  CHECK(r.output.find(text) != std::string::npos);
}

}  // namespace

TEST_CASE("LoRA trains the adapters only: frozen weights unchanged and merged as base + (alpha/r) B A, no gradient or "
          "moments for them, the state holds the adapters") {
  const auto run = runner().train(1, kLora + " --set state.at_end=true");
  const auto cfg = config::load((run / "config.json").string(), {"train.global_batch=0"});
  // The base the run drew (no init_from: train.seed, as export draws it again) against the merged weights.
  torch::manual_seed(static_cast<uint64_t>(cfg.train.seed));
  model::GPT base(cfg.model, torch::kCPU);
  const interop::HfCheckpoint merged(run / "model", interop::without_lora(cfg.model));
  const interop::PeftAdapter adapter(run / "adapter", cfg.model);
  const auto adapters = test::load_params(run);
  REQUIRE(adapters.size() == 4 * 4 * 2);  // 4 blocks x 4 projections x A, B
  double moved = 0;
  for (const auto& [name, t] : adapters) moved = std::max(moved, (t - base->named_parameters()[name]).abs().max().item<double>());
  CHECK(moved > 1e-3);  // the adapters trained (B from zero)
  const double scale = 8.0 / 4.0;
  for (const auto& item : base->named_parameters()) {
    if (item.value().requires_grad()) continue;  // adapters
    INFO(item.key());
    auto got = torch::empty({item.value().numel()});
    merged.read(item.key(), 0, got.numel(), got);
    auto want = item.value().detach().reshape({-1}).clone();
    const auto dot = item.key().rfind('.');
    const std::string leaf = item.key().substr(dot + 1);
    if (leaf == "w_qkv" || leaf == "w_proj" || leaf == "w_fc" || leaf == "w_out") {  // base + scale B A
      const std::string block = item.key().substr(0, dot);
      const std::string target = leaf == "w_qkv" ? "c_attn" : leaf == "w_proj" ? "attn_c_proj" : leaf == "w_fc" ? "c_fc"
                                                                                                      : "mlp_c_proj";
      const auto A = adapters.at(block + ".lora_A_" + target), B = adapters.at(block + ".lora_B_" + target);
      want = (item.value().detach() + B.mm(A) * scale).reshape({-1});
      // One product and one add in fp32, in another order than the export's: a few ulps of the weights.
      CHECK((got - want).abs().max().item<double>() <= 1e-6);
    } else {
      CHECK(torch::equal(got, want));  // untouched, bitwise
    }
  }
  // The state: the adapters and their AdamW moments, nothing of the frozen weights.
  const state::SafetensorsFile st(run / "state" / "step-00000010" / "rank-00000.safetensors");
  int64_t params = 0, moments = 0;
  for (const auto& e : st.entries()) {
    if (e.name.rfind("rng/", 0) == 0) continue;
    INFO(e.name);
    CHECK(e.name.find(".lora_") != std::string::npos);
    (e.name.rfind("param/", 0) == 0 ? params : moments) += 1;
  }
  CHECK(params == 32);
  CHECK(moments == 64);
  // The start-up table and summary.json name what trains.
  const auto s = test::summary(run);
  const int64_t trained = s["model"]["trained_params"].get<int64_t>();
  CHECK(trained == 4 * (4 * (64 + 3 * 64) + 4 * (64 + 64) + 4 * (64 + 256) + 4 * (256 + 64)));
  CHECK(trained < s["model"]["params"].get<int64_t>() / 10);
}

TEST_CASE("LoRA at world 2 under DDP, zero1, zero2 and zero3, and offloaded, trains the adapters as one process does",
          "[numerics]") {
  auto& r = runner();
  const auto w1 = r.train(1, kLora + " --set train.micro_batch=8");
  for (const std::string stage : {"none", "zero1", "zero2", "zero3"}) {
    INFO("parallel.sharding " << stage);
    CHECK_PARITY(r.train(2, kLora + " --set parallel.sharding=" + stage), w1);
  }
  {
    INFO("offloaded: the adapters' masters, moments and gradients in host memory (zero2, world 1)");
    CHECK_PARITY(r.train(1, kLora + " --set train.micro_batch=8 --set parallel.sharding=zero2 "
                                    "--set offload.optimizer=true --set offload.gradients=true"), w1);
  }
  // The comparison sees the adapters: half the batch trains them differently by far more than the bound.
  const auto half = test::parity(r.train(1, kLora + " --set train.micro_batch=4"), w1);
  CHECK_FALSE(half.params_hold());
}

TEST_CASE("LoRA: a run resumed from its step-4 state is bitwise the uninterrupted one (adapter dropout on); a world-2 "
          "zero2 state resumes at world 1") {
  test::TempDir dir("lora-resume");
  const auto ok = [](const test::Result& r) {
    INFO(r.output);
    REQUIRE(r.code == 0);
  };
  const std::string args = "--config " + runner().recipe + " --set train.lr=1e-2 --set model.dropout=0.1 "
                           "--set 'model.lora={rank: 4, alpha: 8, dropout: 0.1, targets: [all-linear]}' "
                           "--set state.keep=0";
  const auto whole = dir.path / "whole", resumed = dir.path / "resumed";
  ok(test::trainer(args + " --set state.at_end=false --set logging.dir=" + whole.string()));
  ok(test::trainer(args + " --set state.every=4 --set logging.dir=" + resumed.string()));
  ok(test::trainer(args + " --set state.every=4 --set logging.dir=" + resumed.string() + " --resume " +
                   (resumed / "state" / "step-00000004").string()));
  const auto want = test::trace(whole / "metrics.jsonl");
  REQUIRE(want.steps.size() == 10);
  CHECK(test::trace_diff(test::trace(resumed / "metrics.jsonl"), want) == "");

  // zero2 at world 2 saves each rank's shard of the adapters' moments; one process takes them up and goes
  // on as the uninterrupted world-1 run does (only the order of the sums of steps 1-4 differs).
  const auto w2 = dir.path / "w2", w1 = dir.path / "w1";
  const auto m = test::launch(2, "--config " + runner().recipe + " " + kLora + " --set parallel.sharding=zero2 "
                                 "--set train.micro_batch=2 --set state.every=4 --set state.keep=0 --set logging.dir=" + w2.string());
  INFO(m.outputs[0]);
  REQUIRE(m.codes == std::vector<int>{0, 0});
  ok(test::trainer("--config " + runner().recipe + " " + kLora + " --set logging.dir=" + w1.string() + " --resume " +
                   (w2 / "state" / "step-00000004").string()));
  const auto steps = test::step_records(w1 / "metrics.jsonl");
  const auto reference = test::step_records(runner().train(1, kLora) / "metrics.jsonl");
  REQUIRE(reference.size() == 10);
  const std::vector<test::StepRecord> after(steps.end() - 6, steps.end()), ref_after(reference.begin() + 4, reference.end());
  REQUIRE(after.front().step == 5);
  const auto d = test::max_rel_step_diff(after, ref_after);
  CHECK(d.loss <= test::kReorderedStep);
  CHECK(d.grad_norm <= test::kReorderedStep);
}

TEST_CASE("LoRA recipes and adapter directories the trainer cannot honour exit 2 or 3 naming the key or file") {
  test::TempDir dir("lora-bad");
  const std::string base = "--config configs/tiny.yaml --set train.steps=1 --set logging.dir=" + (dir.path / "run").string();
  require_exit(test::trainer(base + " --set 'model.lora={rank: 4, targets: [q_proj]}'"), kExitConfig,
               "model.lora: target 'q_proj' is not a projection of a gpt2 block");
  require_exit(test::trainer(base + " --set 'model.lora={rank: -1}'"), kExitConfig, "rank must be >= 0");
  require_exit(test::trainer(base + " --set 'model.lora={rank: 4, alpah: 8}'"), kExitConfig,
               "model.lora: unknown key 'alpah'");
  require_exit(test::trainer(base + " --set 'model.lora={rank: 4, base_dtype: bf16}'"), kExitConfig,
               "base_dtype bf16 uses the frozen weights as they are held, in bf16: set precision.compute: bf16");
  CHECK_FALSE(fs::exists(dir.path / "run"));

  // An adapter of another rank than the recipe's: exit 3 naming the file and both values.
  const auto run = runner().train(1, kLora);
  require_exit(test::trainer("--config " + runner().recipe + " --set 'model.lora={rank: 8, alpha: 8, targets: "
                             "[all-linear]}' --set model.init_from=" + (run / "adapter").string() +
                             " --set logging.dir=" + (dir.path / "r8").string()),
               kExitData, "r is 4, model.lora rank 8");
  // export --merged of a run without adapters: exit 2.
  const auto plain = runner().train(1, "");
  require_exit(test::trainer("export --merged --run " + plain.string()), kExitConfig, "trained no adapters");
}

}  // namespace SUBLINEAR_TEST_FILE
