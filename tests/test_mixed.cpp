// precision.param_dtype (a low-precision compute copy of the parameters, fp32 masters in the shard) and
// precision.reduce_dtype, on CPU with two Gloo ranks:
//  - zero1/2/3 at world 2 end where world 1 ends with the same micro-batches (the distributed tolerance
//    of test_parallel), and every checkpointing mode is bitwise equal to none;
//  - zero3 on a scaled-down LLaMA (8 layers, d 512): the per-rank step peak stays within
//    (P + G + O)/N + the gathered units + activations, the planner predicts it within 10 %, and
//    autocast's unsharded weight copies are gone (the activation peak drops by at least half of them);
//  - fp16 (with the loss scaler) like bf16: world 2 == world 1, losses close to fp32's;
//  - a saved state resumes bitwise (masters saved, compute copy re-made), bf16 reduction runs and is
//    close, and recipes that cannot work are refused with exit 2 naming the key.
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "config/shape.h"
#include "device/cpu_features.h"
#include "predict/planner.h"
#include "runs.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using test::load_params;
using test::max_abs_diff;
using test::Runner;
using test::summary;

namespace {

const char* kRecipe = R"(
model: {arch: gpt2, n_layer: 4, n_head: 2, n_embd: 64, vocab_size: 256, max_seq_len: 64, dropout: 0.0}
data: {source: synthetic, synthetic_tokens: 20000}
train: {seq_len: 32, micro_batch: 4, grad_accum: 1, steps: 10, lr: 1.0e-3, warmup_steps: 2, grad_clip: 1.0,
        eval_interval: 0, device: cpu, threads: 1, seed: 7}
precision: {compute: bf16, param_dtype: bf16}
parallel: {timeout_s: 60}
logging: {interval: 100, skip_first: 0, peak_tflops: 1.0, progress: false, save_model: true}
)";

// The scaled-down LLaMA of the memory test (issue 13: 8 layers, d 512).
const char* kLlamaRecipe = R"(
model: {arch: llama, n_layer: 8, n_head: 8, n_embd: 512, vocab_size: 4096, max_seq_len: 256, dropout: 0.0,
        tie_embeddings: false}
data: {source: synthetic, synthetic_tokens: 200000}
train: {seq_len: 64, micro_batch: 1, grad_accum: 1, steps: 2, lr: 1.0e-3, warmup_steps: 1, eval_interval: 0,
        device: cpu, threads: 1}
precision: {compute: bf16}
parallel: {sharding: zero3, timeout_s: 60}
logging: {interval: 100, skip_first: 0, peak_tflops: 1.0, progress: false}
)";

std::vector<double> losses(const std::filesystem::path& run_dir) {
  std::vector<double> out;
  std::istringstream in(test::read_text(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto r = nlohmann::json::parse(line);
    if (!r.contains("event")) out.push_back(r["loss"].get<double>());
  }
  return out;
}

}  // namespace

TEST_CASE("bf16 compute copy: zero1/2/3 at world 2 end where world 1 does", "[numerics]") {
  Runner run(kRecipe, "mixed");
  // World 1 (zero1: the masters need a shard, world 1 included), the global batch of 8 as 2 micro-batches
  // of 4: each rank's bf16 gradient is rounded from a 4-row sum, as each micro-batch's is here; only
  // the order of the fp32 sums differs: tests/runs.h's parity (kReordered16: 16-bit roundings after step 1).
  const auto w1 = run.train(1, "--set parallel.sharding=zero1 --set train.grad_accum=2");
  // One micro-batch of 8 rounds a different (8-row) bf16 gradient: parity with kRoundedRuns.
  const auto w1x8 = run.train(1, "--set parallel.sharding=zero1 --set train.micro_batch=8");
  for (const std::string stage : {"zero1", "zero2", "zero3"}) {
    INFO(stage);
    const auto dir = run.train(2, "--set parallel.sharding=" + stage);
    CHECK_PARITY(w1, dir, test::kReordered16);
    CHECK_PARITY(w1x8, dir, test::kRoundedRuns);
    // The final weights are the fp32 masters, not the bf16 copy: some differ from their bf16 rounding.
    bool off_bf16 = false;
    for (const auto& [name, t] : load_params(dir)) off_bf16 |= !torch::equal(t, t.to(torch::kBFloat16).to(torch::kFloat));
    CHECK(off_bf16);
  }
}

TEST_CASE("fp16 compute copy with the loss scaler: zero1/2/3 at world 2 end where world 1 does, close to fp32", "[numerics]") {
  Runner run(kRecipe, "mixed-fp16");
  const std::string fp16 = "--set precision.compute=fp16 --set precision.param_dtype=fp16 ";
  // Unlike bf16, world 1 cannot round the same gradients: its backward carries the loss scale times
  // 1/accumulation (1/2 here), world 2's the scale alone, and fp16's subnormal range (below 6e-5)
  // rounds a halved gradient differently. So: the stages agree with each other as DDP's tolerance
  // asks (parity, kReordered16), and with world 1 as differently rounded gradients do (kRoundedRuns).
  const auto w1 = run.train(1, fp16 + "--set parallel.sharding=zero1 --set train.grad_accum=2");
  const auto fp32 = losses(run.train(1, "--set precision.compute=fp32 --set precision.param_dtype=fp32 "
                                        "--set train.grad_accum=2"));
  const auto w2 = run.train(2, fp16 + "--set parallel.sharding=zero1");
  for (const std::string stage : {"zero1", "zero2", "zero3"}) {
    INFO(stage);
    const auto dir = run.train(2, fp16 + "--set parallel.sharding=" + stage);
    CHECK_PARITY(w2, dir, test::kReordered16);
    CHECK_PARITY(w1, dir, test::kRoundedRuns);
    bool off_fp16 = false;  // the final weights are the fp32 masters
    for (const auto& [name, t] : load_params(dir)) off_fp16 |= !torch::equal(t, t.to(torch::kHalf).to(torch::kFloat));
    CHECK(off_fp16);
    const auto l = losses(dir);
    REQUIRE(l.size() == fp32.size());
    // fp16 against fp32 training, relative per step: fp16's forward rounding (2^-11 per rounding, <= 8
    // in sequence through 4 blocks: <= 4e-3) plus the parameters' drift D, which moves the loss by
    // g . D to first order. The elements that carry the gradient's norm are well conditioned, so their
    // directions move by <= 2 rho (rho = 1.6e-2, tests/runs.h kRounded) and |D_i| <= 3.2e-2 B there;
    // near-zero-gradient elements may move by 2B but add ~0 to g . D. With |g| <= 3 (the logged norm
    // before clipping) and B = adamw_travel_bound ~ 1.1e-2 (lr 1e-3, 10 steps): |g . D| <= 1.1e-3,
    // 2e-4 of a ~5.5-nat loss. So 4.2e-3 at most; we check 1e-2.
    for (size_t i = 0; i < l.size(); ++i) CHECK(std::abs(l[i] - fp32[i]) <= 1e-2 * fp32[i]);
    // The scaler was on: the step records carry its scale, not 1.
    std::istringstream in(test::read_text(dir / "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      const auto r = nlohmann::json::parse(line);
      if (!r.contains("event")) CHECK(r["loss_scale"].get<double>() > 1.0);
    }
  }
}

TEST_CASE("bf16 compute copy: every checkpointing mode is bitwise equal to none (world 2, zero3)") {
  Runner run(kRecipe, "mixed-modes");
  const std::string zero3 = "--set parallel.sharding=zero3 ";
  const auto ref_dir = run.train(2, zero3 + "--set checkpointing.mode=none");
  const auto ref = load_params(ref_dir);
  for (const std::string mode : {"--set checkpointing.mode=full", "--set checkpointing.mode=interval --set checkpointing.interval=2",
                                 "--set checkpointing.mode=sqrt",
                                 "--set checkpointing.mode=selective --set checkpointing.recompute=[attention,mlp,norm]"}) {
    INFO(mode);
    const auto dir = run.train(2, zero3 + mode);
    CHECK(max_abs_diff(ref, load_params(dir)) == 0.0);
    CHECK(losses(dir) == losses(ref_dir));
  }
}

TEST_CASE("bf16 compute copy under zero3: per-rank peak within the ZeRO-3 bound, the planner within 10 %, no weight copies") {
  Runner run(kLlamaRecipe, "mixed-memory");
  const auto fp32 = summary(run.train(2, "--set precision.param_dtype=fp32"));
  const auto bf16 = summary(run.train(2, "--set precision.param_dtype=bf16"));
  const double P = bf16["parallel"]["params_bytes_unsharded"].get<double>(), G = P, O = 2 * P, N = 2;
  const double unit = bf16["parallel"]["largest_group_bytes"].get<double>();  // fp32 bytes of the largest unit
  for (const auto* s : {&fp32, &bf16}) {
    const double predicted = (*s)["predicted_peak_bytes"].get<double>();
    const double activations = (*s)["predicted_activation_peak_bytes"].get<double>();
    for (const auto& r : (*s)["parallel"]["ranks"]) {
      INFO(r.dump());
      const double peak = r["peak_allocated_bytes"].get<double>();
      CHECK(r["model_state_bytes_measured"].get<double>() <= 1.05 * (P + G + O) / N);
      // (P + G + O)/N, the units gathered at once (one unit's parameters and gradient, the next unit's
      // parameters prefetched in backward: three fp32 units at most) and the activations.
      CHECK(peak <= 1.05 * ((P + G + O) / N + 3 * unit + activations));
      CHECK(std::abs(peak - predicted) <= 0.10 * predicted);
    }
  }
  // bf16 gathers half the parameter bytes of fp32 (gradients stay fp32): a unit's parameters, its gradient
  // and the prefetched unit's parameters are 2 + 4 + 2 bytes per element instead of 4 + 4 + 4.
  const double gathered_fp32 = fp32["parallel"]["ranks"][0]["transient_peak_bytes"].get<double>();
  const double gathered_bf16 = bf16["parallel"]["ranks"][0]["transient_peak_bytes"].get<double>();
  CHECK(std::abs(gathered_bf16 / gathered_fp32 - 8.0 / 12.0) < 0.02);
  // Autocast's bf16 copies of every matmul weight (kept unsharded from forward to backward) are gone:
  // 8 blocks x 2(4C^2 + 3CH) + the head's 2VC bytes; the measured activation peak drops by at least half
  // of that. Where the linears widen (a CPU without a bf16 GEMM: model/linear.h) the fp32-parameter run
  // keeps no copies either, and the drop (the bf16 residual stream) stays below half of them.
  const auto cfg = config::load_string(kLlamaRecipe, {});
  const double C = 512, H = static_cast<double>(config::Shape(cfg.model).hidden()), V = 4096;
  const double copies = 8 * 2 * (4 * C * C + 3 * C * H) + 2 * V * C;
  const double act_fp32 = fp32["median_activation_peak_bytes"].get<double>(), act_bf16 = bf16["median_activation_peak_bytes"].get<double>();
  INFO("activation peaks " << act_fp32 << " -> " << act_bf16 << ", weight copies " << copies);
  CHECK(act_bf16 < act_fp32);  // the bf16 residual stream, either way
  if (device::cpu_features().linear_path(config::Dtype::kBf16) == device::LowpMatmul::widened) CHECK(act_fp32 - act_bf16 < 0.5 * copies);
  else CHECK(act_fp32 - act_bf16 >= 0.5 * copies);
}

TEST_CASE("bf16 compute copy: a saved state resumes bitwise (zero1 and zero3 at world 2)") {
  test::TempDir dir("mixed-resume");
  const std::string recipe = dir.file("recipe.yaml", kRecipe);
  // A constant learning rate: the cosine horizon (train.steps) then does not change the first steps.
  const std::string base = fmt::format("--config {} --set train.warmup_steps=0 --set train.min_lr=1e-3 ", recipe);
  for (const std::string stage : {"zero1", "zero3"}) {
    INFO(stage);
    const auto straight = dir.path / ("straight-" + stage), split = dir.path / ("split-" + stage);
    const std::string sets = base + "--set parallel.sharding=" + stage;
    auto a = test::launch(2, sets + " --set train.steps=6 --set logging.dir=" + straight.string());
    REQUIRE(a.codes == std::vector<int>{0, 0});
    auto b1 = test::launch(2, sets + " --set train.steps=3 --set logging.dir=" + split.string());
    REQUIRE(b1.codes == std::vector<int>{0, 0});
    auto b2 = test::launch(2, sets + " --set train.steps=6 --resume auto --set logging.dir=" + split.string());
    INFO(b2.outputs[0]);
    REQUIRE(b2.codes == std::vector<int>{0, 0});
    CHECK(max_abs_diff(load_params(straight), load_params(split)) == 0.0);
  }
}

TEST_CASE("bf16 reduction (precision.reduce_dtype) halves the gradient buffer and stays close to fp32's", "[numerics]") {
  Runner run(kRecipe, "mixed-reduce");
  for (const std::string stage : {"zero2", "zero3"}) {
    INFO(stage);
    const auto exact = run.train(2, "--set parallel.sharding=" + stage);
    const auto lossy = run.train(2, "--set parallel.sharding=" + stage + " --set precision.reduce_dtype=bf16");
    const auto le = losses(exact), ll = losses(lossy);
    REQUIRE(le.size() == ll.size());
    // bf16 reductions round each reduced gradient element to 2^-8 relative: the steps and parameters are
    // parity with kRoundedRuns, and the losses within 1e-2 relative as fp16's against fp32 above
    // (one more rounding per element, 2^-9 on average, moves the loss less than fp16's forward does).
    for (size_t i = 0; i < le.size(); ++i) CHECK(std::abs(le[i] - ll[i]) <= 1e-2 * le[i]);
    CHECK_PARITY(exact, lossy, test::kRoundedRuns);
    CHECK(summary(lossy)["parallel"]["ranks"][0]["transient_peak_bytes"].get<double>() <
          summary(exact)["parallel"]["ranks"][0]["transient_peak_bytes"].get<double>());
  }
}

TEST_CASE("param_dtype and reduce_dtype recipes that cannot work exit 2 naming the key") {
  test::TempDir dir("mixed-bad");
  const std::string recipe = dir.file("recipe.yaml", kRecipe);
  struct Case {
    std::string sets, key, hint;
  };
  for (const Case& c : {Case{"--set parallel.sharding=none", "precision.param_dtype", "zero1"},
                        Case{"--set parallel.sharding=zero1 --set precision.compute=fp32", "precision.param_dtype", "precision.compute"},
                        Case{"--set parallel.sharding=zero1 --set precision.reduce_dtype=bf16", "precision.reduce_dtype", "zero2"},
                        Case{"--set parallel.sharding=zero3 --set precision.reduce_dtype=fp16", "precision.reduce_dtype", "param_dtype"},
                        Case{"--set parallel.sharding=zero3 --set precision.param_dtype=fp8", "precision.param_dtype", "bf16"}}) {
    INFO(c.sets);
    const auto r = test::trainer(fmt::format("--config {} {} --set logging.dir={}", recipe, c.sets, (dir.path / "run").string()));
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find(c.key) != std::string::npos);
    CHECK(r.output.find(c.hint) != std::string::npos);
    CHECK(!std::filesystem::exists(dir.path / "run"));
  }
}

TEST_CASE("zero3 never builds the whole model: world 2's initial parameters are world 1's, build peak <= shard + one unit") {
  Runner run(kRecipe, "mixed-build");
  // A vanishing learning rate leaves the weights where initialization put them: matrices bitwise, the
  // zero-initialized biases within ~5e-31 (that step's update), whose rounding may differ between the
  // sharded and the plain path; an initialization that differed would differ by ~init_std = 0.02.
  const std::string still = "--set precision.compute=fp32 --set precision.param_dtype=fp32 --set train.steps=1 "
                            "--set train.lr=1e-30 --set train.min_lr=0 ";
  for (const std::string arch : {"", "--set model.arch=llama --set model.tie_embeddings=false "}) {
    INFO(arch);
    const auto whole = load_params(run.train(1, still + arch + "--set parallel.sharding=none"));
    // World 1 and 2, and world 2 with the bf16 compute copy (the masters are what the final weights hold).
    for (const auto& [world, bf16] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
      const std::string copy = bf16 ? "--set precision.compute=bf16 --set precision.param_dtype=bf16 " : "";
      const auto dir = run.train(world, still + arch + copy + "--set parallel.sharding=zero3");
      const double diff = max_abs_diff(whole, load_params(dir));
      INFO("world " << world << ": max |difference| " << diff * 1e30 << "e-30");
      CHECK(diff <= 1e-30);
      const auto s = summary(dir);
      const double unit = s["parallel"]["largest_group_bytes"].get<double>();
      for (const auto& r : s["parallel"]["ranks"]) {
        INFO(r.dump());
        // The rank's shard of parameters and gradients, and one unit's fp32 values while they are drawn.
        const double shard = r["params_bytes"].get<double>() + r["grads_bytes"].get<double>();
        // (Building the whole model first, as before, peaks at all of P + the unit: P/2 more at world 2.)
        CHECK(r["build_peak_bytes"].get<double>() <= 1.02 * (shard + unit));
      }
    }
  }
}

TEST_CASE("zero3 reads weights in shard by shard: model.init_from and --resume peak at the optimizer shard + one unit") {
  Runner run(kRecipe, "mixed-load");
  const std::string zero3 = "--set parallel.sharding=zero3 ";
  const auto base = run.train(2, zero3 + "--set train.steps=2");
  const auto hf = run.dir.path / "hf";
  const auto ex = test::trainer("export --run " + base.string() + " --out " + hf.string());
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  const auto from_hf = run.train(2, zero3 + "--set train.steps=1 --set model.init_from=" + hf.string());
  const auto resumed = test::launch(2, fmt::format("--config {} {} --set train.steps=3 --resume auto --set logging.dir={}",
                                                   run.recipe, zero3, base.string()));
  INFO(resumed.outputs[0]);
  REQUIRE(resumed.codes == std::vector<int>{0, 0});
  for (const auto& [what, dir] : {std::pair{"init_from", from_hf}, std::pair{"resume", base}}) {
    const auto s = summary(dir);
    const double unit = s["parallel"]["largest_group_bytes"].get<double>();
    const double whole = s["parallel"]["params_bytes_unsharded"].get<double>();
    REQUIRE(whole >= 4 * unit);  // a whole-model read would stand out
    for (const auto& r : s["parallel"]["ranks"]) {
      INFO(what << ": " << r.dump());
      const double load = r["load_peak_bytes"].get<double>();
      // init_from writes into the shard that exists; a resume also makes the AdamW moments of the shard.
      const double moments = std::string(what) == "resume" ? r["optimizer_state_bytes"].get<double>() : 0.0;
      CHECK(load <= moments + unit);
      if (std::string(what) == "resume") CHECK(load >= moments);  // the measurement sees the load
    }
  }
}

// The bf16 kernels (GELU, causal attention, LayerNorm, the residual adds with the folded
// biases) over a whole training curve. Three runs of the tiny recipe, scaled down so bf16 is quick on
// CPUs without bf16 matmul instructions (2 layers, T 64, micro-batch 4, 30 steps, train.lr 1e-3; the
// same seed and data): fp32 on ATen's model ops (SUBLINEAR_ATEN_KERNELS=1: none of the project's model
// kernels run in it, so a bug the fused fp32 and bf16 paths share, such as the folded bias's
// gradient, shows; AdamW is the project's in all three runs), bf16 with the fused kernels (and, on a
// CPU whose libraries have no bf16 GEMM, the widened linears of model/linear.h), and bf16 with ATen's
// (at::gelu, SDPA and at::linear in bf16; where that GEMM is slow the start-up warning names it).
// ATen's bf16 curve departs from fp32's by bf16 rounding alone: `spread`, this CPU's own measure of
// what bf16 does to this trajectory. The bounds, from the arithmetic:
//  - The fused kernels round where ATen's bf16 ops round (each op's output to bf16, 2^-9 relative)
//    or less often (GELU, the attention and LayerNorm keep fp32 inside): their departure is a sum of
//    no more rounding errors of the same size, a random walk of the same length, whose size differs
//    between two realisations by well under 1.5x (both sums have hundreds of terms).
//  - 0.001 nats: where both departures are smaller than a step's own bf16 rounding of the loss, they
//    are that rounding: each of the 4 x 64 positions' losses moves by <= 2 max|dz| for logit errors
//    dz, ~2 x 2^-9 x |z| <= 0.016 with |z| <= 4, of random sign: their mean moves by ~0.016 /
//    sqrt(256) = 0.001.
// A wrong kernel departs by far more: with the residual adds' bias gradient halved (a mutation run to
// check this test) the fused curve ran 0.035 nats away.
// Why 1e-3 and not the recipe's 3e-3: at 3e-3 this run spikes at step 15 (loss 8.4, gradient norm 50,
// in fp32 too) and is chaotic from step 20 on, where any bit of difference (another CPU's GEMM order:
// AMX on a Xeon) sends two runs apart. There, on a Xeon with AMX, the fused curve ran 0.093 nats from
// fp32's against ATen's 0.017 for this seed, and closer than ATen's for 4 of 8 seeds: a test of the
// trajectory's luck, not of the kernels. At 1e-3 both ran within 3e-4 of fp32 for 6 seeds there.
TEST_CASE("bf16 fused kernels: the tiny recipe's bf16 curve stays within 0.001 nats (+ 1.5x ATen's bf16 departure) of fp32 on ATen's ops", "[numerics]") {
  test::TempDir dir("bf16-curve");
  std::map<std::string, bool> warned;
  const std::string base =
      "--config configs/tiny.yaml --set model.n_layer=2 --set train.seq_len=64 --set train.micro_batch=4 "
      "--set train.grad_accum=1 --set train.steps=30 --set train.lr=1e-3 --set train.eval_interval=0 --set train.threads=1 "
      "--set logging.interval=100 --set logging.progress=false --set state.at_end=false "
      "--set logging.save_model=false --set logging.peak_tflops=1";
  auto run = [&](const std::string& name, const std::string& env, const std::string& sets) {
    const auto run_dir = dir.path / name;
    const auto r = test::run("cd " + test::kSourceDir + " && OMP_NUM_THREADS=1 " + env + " " + test::kTrainer + " " +
                             base + " " + sets + " --set logging.dir=" + run_dir.string());
    INFO(name << ":\n" << r.output);
    REQUIRE(r.code == 0);
    warned[name] = r.output.find("ATen's fallback GEMM") != std::string::npos;
    return run_dir;
  };
  const auto fp32_dir = run("fp32", "SUBLINEAR_ATEN_KERNELS=1", "");  // ATen's model ops: the reference
  CHECK(test::summary(fp32_dir)["environment"]["cpu"]["aten_kernels"] == true);
  const auto fp32 = losses(fp32_dir);
  const auto fused_dir = run("fused", "", "--set precision.compute=bf16");
  const auto aten_dir = run("aten", "SUBLINEAR_ATEN_KERNELS=1", "--set precision.compute=bf16");
  // The widened linears where the libraries have no bf16 GEMM instructions; the warning only where ATen's
  // gemm then runs.
  const bool no_bf16_gemm = device::cpu_features().bf16_matmul == device::LowpMatmul::aten;
  CHECK(test::summary(fused_dir)["environment"]["cpu"]["bf16_linear"] == device::to_string(device::cpu_features().linear_path(config::Dtype::kBf16)));
  CHECK(test::summary(aten_dir)["environment"]["cpu"]["bf16_linear"] == device::to_string(device::cpu_features().bf16_matmul));
  CHECK_FALSE(warned["fp32"]);
  CHECK_FALSE(warned["fused"]);
  CHECK(warned["aten"] == no_bf16_gemm);
  const auto fused = losses(fused_dir), aten = losses(aten_dir);
  REQUIRE(fp32.size() == 30);
  REQUIRE(fused.size() == 30);
  REQUIRE(aten.size() == 30);
  CHECK(test::summary(fused_dir)["environment"]["cpu"]["aten_kernels"] == false);
  CHECK(test::summary(aten_dir)["environment"]["cpu"]["aten_kernels"] == true);
  CHECK(fused != aten);  // the two runs took different kernels

  auto mean_distance = [](const std::vector<double>& a, const std::vector<double>& b) {
    double sum = 0;
    for (size_t i = 0; i < a.size(); ++i) sum += std::abs(a[i] - b[i]);
    return sum / static_cast<double>(a.size());
  };
  auto tail_mean = [](const std::vector<double>& a) {
    double sum = 0;
    for (size_t i = a.size() - 10; i < a.size(); ++i) sum += a[i];
    return sum / 10.0;
  };
  const double spread = mean_distance(aten, fp32), fused_from_fp32 = mean_distance(fused, fp32);
  WARN("mean |loss - fp32 loss| over 30 steps: ATen bf16 " << spread << ", fused bf16 " << fused_from_fp32
                                                            << "; last-10 means: fp32 " << tail_mean(fp32) << ", ATen "
                                                            << tail_mean(aten) << ", fused " << tail_mean(fused));
  CHECK(fused_from_fp32 <= 1.5 * spread + 0.001);
  CHECK(std::abs(tail_mean(fused) - tail_mean(fp32)) <=
        std::max(std::abs(tail_mean(aten) - tail_mean(fp32)), spread) + 0.001);
  CHECK(fused.back() < fused.front() - 1.0);  // it trains
}

}  // namespace SUBLINEAR_TEST_FILE
