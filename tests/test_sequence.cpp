// Sequence parallelism (parallel.sequence, Ulysses) over Gloo on the CPU: degree 2 and 4 against
// degree 1 at every step, in every checkpointing mode and ZeRO stage, for GPT-2 and LLaMA; bitwise
// repeats at a fixed topology; a state saved at degree 2 resumed at degree 1 and 4; per-rank activation
// memory falling with the degree, and a memory.limit that degree 1 cannot train under and degree 4 can;
// the degree's constraints refused before anything is built.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "recipes.h"
#include "runs.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using test::Runner;

namespace {

// tests/recipes.h's GPT-2 (test_parallel.cpp's recipe) with 4 heads (degree 4 leaves each rank one), T 32
// (8 positions per rank at degree 4), 6 steps, no state at the end.
const std::string kRecipe =
    test::recipe_gpt2().set("model.n_head", "4").set("train.steps", "6").set("state.at_end", "false").yaml();

const std::string kLlama = " --set model.arch=llama --set model.bias=false";

// "The same training": tests/runs.h's parity, every step's loss and grad_norm and each parameter tensor.
// fp32: the runs see the same sequences with the same parameters at step 1; what differs is the order of
// fp32 sums: each rank's loss is the mean over its T/N positions and the ranks' means are averaged, and
// each weight gradient is N GEMMs over T/N rows summed across ranks instead of one over T rows.
// Attention itself computes the same per-head sums in the same order (each rank runs whole heads over the
// whole sequence), and the all-to-alls move values without arithmetic: kReorderedRuns (kMetricTol on every
// step). A wrong exchange (a head or a position misplaced), a wrong global position, or a loss averaged
// over the wrong set changes the loss at step 1 by far more (the controls below; tests/faults/'s
// sequence_wrong_heads patch). bf16 and fp16 compute: the GEMMs over T/N rows may block differently and a
// rounded value land on the neighbouring 16-bit number: kRoundedRuns (kRoundedTol on every step).
constexpr double kMetricTol = test::kReorderedStep;
constexpr double kRoundedTol = test::kRoundedStep;


std::vector<test::StepRecord> steps_of(const std::filesystem::path& run_dir) {
  return test::step_records(run_dir / "metrics.jsonl");
}

// Every step and each parameter tensor (tests/runs.h parity): kReorderedRuns, or kRoundedRuns for 16-bit compute.
void same_steps(const std::string& what, const std::filesystem::path& got, const std::filesystem::path& want,
                double tol = kMetricTol) {
  INFO(what);
  CHECK_PARITY(want, got, tol == kMetricTol ? test::kReorderedRuns : test::kRoundedRuns);
}

Runner& shared_runner() {
  static Runner runner(kRecipe, "sequence");
  return runner;
}

std::string degree(int n) { return fmt::format(" --set parallel.sequence={}", n); }

// Every checkpointing mode, each paired with a ZeRO stage so that every stage meets the exchange too.
struct Case {
  std::string mode, sharding;
};
const std::vector<Case> kCases = {
    {"--set checkpointing.mode=none", "none"},
    {"--set checkpointing.mode=full", "zero1"},
    {"--set checkpointing.mode=interval --set checkpointing.interval=2", "zero2"},
    {"--set checkpointing.mode=sqrt", "zero3"},
    {"--set checkpointing.mode=selective --set checkpointing.recompute=[attention,mlp,norm]", "none"},
    {"--set checkpointing.mode=budget --set checkpointing.budget=3MiB", "zero1"},
};

}  // namespace

TEST_CASE("parallel.sequence 2 and 4 have degree 1's loss and grad_norm at every step, in every checkpointing mode and "
          "ZeRO stage",
          "[numerics]") {
  Runner& run = shared_runner();
  const auto w1 = run.train(1, "");
  REQUIRE(steps_of(w1).size() == 6);
  for (const auto& c : kCases) {
    for (int n : {2, 4}) {
      const std::string sets = " " + c.mode + " --set parallel.sharding=" + c.sharding + degree(n);
      same_steps(fmt::format("degree {} at world {}:{}", n, n, sets), run.train(n, sets), w1);
    }
  }
  // Data x sequence: two data-parallel ranks of two sequence ranks each, half the micro-batch per data rank.
  same_steps("world 4 = 2 data x 2 sequence, zero2", run.train(4, " --set train.micro_batch=2 --set parallel.sharding=zero2" + degree(2)), w1);
  const auto s = test::summary(run.train(4, " --set train.micro_batch=2 --set parallel.sharding=zero2" + degree(2)));
  CHECK(s.at("parallel").at("sequence_parallel") == 2);
  CHECK(s.at("parallel").at("data_parallel") == 2);
  // tokens count each sequence once: 4 x 32 per step whatever the degree.
  CHECK(test::read_jsonl(run.train(2, " --set checkpointing.mode=none --set parallel.sharding=none" + degree(2)) / "metrics.jsonl")
            .front()
            .at("tokens") == 4 * 32);

  // Control: the comparison sees the data: half the batch is far outside the tolerance.
  const auto other = test::max_rel_step_diff(steps_of(run.train(1, " --set train.micro_batch=2")), steps_of(w1));
  CHECK(other.grad_norm > 100 * kMetricTol);
  // Control near the tolerance: degree 2 against the same training in bf16 (a difference the size of 16-bit
  // rounding, ~2^-8 relative: what a half-wrong head or a dropped bias would also leave) fails it.
  const auto rounded = test::parity(run.train(1, " --set precision.compute=bf16"),
                                    run.train(2, " --set checkpointing.mode=none --set parallel.sharding=none" + degree(2)));
  INFO(rounded.why());
  CHECK_FALSE(rounded.steps_hold());
}

TEST_CASE("LLaMA (RoPE at global positions, rotated q and k exchanged) at degree 2 and 4 has degree 1's losses", "[numerics]") {
  Runner& run = shared_runner();
  const auto l1 = run.train(1, kLlama);
  same_steps("llama degree 2", run.train(2, kLlama + degree(2)), l1);
  same_steps("llama degree 4, full recompute, zero3",
             run.train(4, kLlama + " --set checkpointing.mode=full --set parallel.sharding=zero3" + degree(4)), l1);
  same_steps("llama degree 2, selective, zero1",
             run.train(2, kLlama + " --set checkpointing.mode=selective --set checkpointing.recompute=[attention,norm] "
                                   "--set parallel.sharding=zero1" + degree(2)),
             l1);
}

TEST_CASE("bf16 and fp16 compute at degree 2 have degree 1's losses within their rounding", "[numerics]") {
  Runner& run = shared_runner();
  // fp16's spacing (2^-11) is finer than bf16's: kRoundedTol's derivation bounds it too (its loss scale
  // only multiplies by powers of two, exact while nothing overflows, and the runs skip the same steps).
  for (const std::string dtype : {"bf16", "fp16"}) {
    const std::string sets = " --set precision.compute=" + dtype;
    same_steps(dtype + " degree 2", run.train(2, sets + degree(2)), run.train(1, sets), kRoundedTol);
  }
}

TEST_CASE("offloaded checkpointed inputs at degree 2 have degree 1's losses (offload moves bytes only)", "[numerics]") {
  Runner& run = shared_runner();
  same_steps("degree 2, full recompute, offload.activations",
             run.train(2, " --set checkpointing.mode=full --set offload.activations=true" + degree(2)), run.train(1, ""));
}

namespace {

// Every step's loss and gradient norm equal, and the saved weights equal, bit for bit.
void bitwise_same(const std::string& what, const std::filesystem::path& got, const std::filesystem::path& want) {
  INFO(what);
  const auto a = steps_of(got), b = steps_of(want);
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].loss == b[i].loss);
    CHECK(a[i].grad_norm == b[i].grad_norm);
  }
  CHECK(test::max_abs_diff(test::load_params(got), test::load_params(want)) == 0.0);
}

int64_t sent_bytes(const std::filesystem::path& run_dir) {
  return test::summary(run_dir).at("parallel").at("all_to_all_bytes_sent").get<int64_t>();
}

}  // namespace

// checkpointing.exchange keep: a recompute takes the tensors the first pass's all-to-alls received instead
// of exchanging again. An all-to-all moves values without arithmetic, so the recompute computes on the
// same bits either way: keep trains exactly as redo (losses, gradient norms, weights bitwise). What it
// saves is communication: per recomputed block and micro-batch one forward exchange pair, of which each
// rank sends (N-1)/N of tok (3C xq + C xo) bytes (tok = B T / N local tokens; xq, xo the exchanged q, k, v's
// and attention output's element sizes, 4 in fp32). Measured by the exchange's own byte count
// (summary.parallel.all_to_all_bytes_sent), which must also equal steps x the planner's prediction.
TEST_CASE("checkpointing.exchange keep trains bitwise as redo and sends one forward exchange less per recomputed block",
          "[numerics][exchange]") {
  Runner& run = shared_runner();
  constexpr int64_t N = 2, B = 4, T = 32, C = 64, steps = 6, fp32 = 4;
  constexpr int64_t pair_bytes = (N - 1) * (B * T / N) * (3 * C * fp32 + C * fp32) / N;  // 32768
  struct KeepCase {
    std::string sets;
    int64_t recomputed;  // blocks whose attention a recompute re-runs (of 4)
  };
  const std::vector<KeepCase> cases = {
      {"--set checkpointing.mode=full --set parallel.sharding=zero1", 3},  // skip_last: the last block kept
      {"--set checkpointing.mode=interval --set checkpointing.interval=2 --set checkpointing.skip_last=false", 4},
      {"--set checkpointing.mode=selective --set checkpointing.recompute=[attention,mlp]", 4},
      {"--set checkpointing.mode=full --set offload.activations=true", 3},
      {kLlama + " --set checkpointing.mode=full --set parallel.sharding=zero3", 3},
  };
  for (const auto& c : cases) {
    const auto redo = run.train(2, " " + c.sets + " --set checkpointing.exchange=redo" + degree(2));
    const auto keep = run.train(2, " " + c.sets + " --set checkpointing.exchange=keep" + degree(2));
    bitwise_same("keep vs redo: " + c.sets, keep, redo);
    INFO(c.sets);
    CHECK(sent_bytes(redo) - sent_bytes(keep) == steps * c.recomputed * pair_bytes);
    for (const auto& dir : {redo, keep}) {
      const auto p = test::summary(dir).at("parallel");
      CHECK(p.at("all_to_all_bytes_sent").get<int64_t>() == steps * p.at("predicted_all_to_all_bytes_per_micro_batch").get<int64_t>());
    }
    const auto plan = test::summary(keep).at("checkpointing");
    CHECK(plan.at("exchange_kept_blocks") == c.recomputed);
  }
  // Control: the byte count sees the recompute: full recompute sends more than no recompute.
  CHECK(sent_bytes(run.train(2, " --set checkpointing.mode=full --set parallel.sharding=zero1 --set checkpointing.exchange=redo" +
                                    degree(2))) >
        sent_bytes(run.train(2, " --set checkpointing.mode=none --set parallel.sharding=none" + degree(2))));
}

TEST_CASE("a fixed topology repeats bitwise: losses, gradient norms and weights") {
  test::TempDir dir("sequence-repeat");
  const auto recipe = dir.file("recipe.yaml", kRecipe);
  const std::string args = "--config " + recipe + " --set parallel.sharding=zero2 --set checkpointing.mode=full" + degree(2);
  std::vector<std::filesystem::path> runs;
  for (int i = 0; i < 2; ++i) {
    runs.push_back(dir.path / fmt::format("run{}", i));
    const auto m = test::launch(2, args + " --set logging.dir=" + runs.back().string());
    for (int r = 0; r < 2; ++r) {
      INFO(m.outputs[static_cast<size_t>(r)]);
      REQUIRE(m.codes[static_cast<size_t>(r)] == 0);
    }
  }
  const auto a = steps_of(runs[0]), b = steps_of(runs[1]);
  REQUIRE(a.size() == 6);
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].loss == b[i].loss);
    CHECK(a[i].grad_norm == b[i].grad_norm);
  }
  CHECK(test::max_abs_diff(test::load_params(runs[0]), test::load_params(runs[1])) == 0.0);
}

TEST_CASE("a state saved at degree 2 resumes at degree 1 and at degree 4 (world 4, zero2) with the uninterrupted run's steps") {
  test::TempDir dir("sequence-resume");
  const auto recipe = dir.file("recipe.yaml", kRecipe);
  const std::string base = "--config " + recipe;
  const auto ok = [](const test::MultiResult& m) {
    for (size_t r = 0; r < m.codes.size(); ++r) {
      INFO("rank " << r << ":\n" << m.outputs[r]);
      REQUIRE(m.codes[r] == 0);
    }
  };
  const auto whole = dir.path / "whole", saved = dir.path / "saved";
  const auto w = test::trainer(base + " --set logging.dir=" + whole.string());
  INFO(w.output);
  REQUIRE(w.code == 0);
  ok(test::launch(2, base + degree(2) + " --set train.steps=3 --set state.at_end=true --set logging.dir=" + saved.string()));
  const auto state = saved / "state" / "step-00000003";
  REQUIRE(std::filesystem::exists(state));
  const auto want = steps_of(whole);
  const auto tail = [](std::vector<test::StepRecord> v) { return std::vector<test::StepRecord>(v.end() - 3, v.end()); };

  const auto at1 = dir.path / "at1";
  const auto r1 = test::trainer(base + " --resume " + state.string() + " --set logging.dir=" + at1.string());
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  const auto at4 = dir.path / "at4";
  ok(test::launch(4, base + degree(4) + " --set parallel.sharding=zero2 --resume " + state.string() +
                         " --set logging.dir=" + at4.string()));
  for (const auto& [name, got] : {std::pair{"degree 1", at1}, std::pair{"degree 4", at4}}) {
    INFO("resumed at " << name);
    const auto d = test::max_rel_step_diff(tail(steps_of(got)), tail(want));
    INFO("loss " << d.loss << ", grad_norm " << d.grad_norm);
    CHECK(d.loss <= kMetricTol);
    CHECK(d.grad_norm <= kMetricTol);
  }
}

// Per-rank activation memory: every position-wise tensor (the residual stream, norms, linears, MLP, the
// loss's chunks) holds T/N positions, and attention holds the whole sequence for n_head/N heads, as
// many elements again. So each rank's activation peak at degree 2N is below its peak at degree N.
// The exactness of the prediction is tests/test_planner.cpp's; this asserts what a user sees.
TEST_CASE("per-rank activation memory falls with the degree; a memory.limit degree 1 exits 4 under trains at degree 4") {
  test::TempDir dir("sequence-memory");
  const auto recipe = dir.file("recipe.yaml", kRecipe);
  const std::string base = "--config " + recipe + " --set train.seq_len=64 --set train.steps=2 --set logging.save_model=false";
  const auto activation_peak = [](const std::filesystem::path& run_dir) {
    int64_t peak = 0;
    for (const auto& r : test::read_jsonl(run_dir / "metrics.jsonl"))
      if (!r.contains("event")) peak = std::max(peak, r.at("activation_peak_bytes").get<int64_t>());
    return peak;
  };
  const auto peak_allocated = [](const std::filesystem::path& run_dir) {
    return test::summary(run_dir).at("peak_allocated_bytes").get<int64_t>();  // rank 0's
  };
  std::vector<int64_t> act, peak;
  for (int n : {1, 2, 4}) {
    const auto run_dir = dir.path / fmt::format("d{}", n);
    const std::string args = base + degree(n) + " --set logging.dir=" + run_dir.string();
    if (n == 1) {
      const auto r = test::trainer(args);
      INFO(r.output);
      REQUIRE(r.code == 0);
    } else {
      const auto m = test::launch(n, args);
      for (int r = 0; r < n; ++r) {
        INFO(m.outputs[static_cast<size_t>(r)]);
        REQUIRE(m.codes[static_cast<size_t>(r)] == 0);
      }
    }
    act.push_back(activation_peak(run_dir));
    peak.push_back(peak_allocated(run_dir));
  }
  INFO("activation peaks at degree 1, 2, 4: " << act[0] << ", " << act[1] << ", " << act[2]);
  CHECK(act[1] < act[0]);
  CHECK(act[2] < act[1]);
  // DDP keeps the whole model state on every rank, so the peaks differ by the activations alone: a limit
  // halfway between degree 4's and degree 1's peaks (both measured here) is under degree 1's and above 4's.
  REQUIRE(peak[2] < peak[0]);
  const int64_t limit = (peak[0] + peak[2]) / 2;
  const std::string limited = base + fmt::format(" --set memory.limit={}B", limit);
  const auto r1 = test::trainer(limited + " --set logging.dir=" + (dir.path / "limited1").string());
  INFO(r1.output);
  CHECK(r1.code == 4);
  const auto m4 = test::launch(4, limited + degree(4) + " --set logging.dir=" + (dir.path / "limited4").string());
  for (int r = 0; r < 4; ++r) {
    INFO(m4.outputs[static_cast<size_t>(r)]);
    CHECK(m4.codes[static_cast<size_t>(r)] == 0);
  }
}

TEST_CASE("a degree that does not divide n_head, seq_len or WORLD_SIZE exits 2 naming each, before anything is built") {
  test::TempDir dir("sequence-config");
  const auto recipe = dir.file("recipe.yaml", kRecipe);
  const auto r = test::trainer("--config " + recipe + " --set parallel.sequence=3 --set logging.dir=" + (dir.path / "r").string());
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(r.output.find("parallel.sequence") != std::string::npos);
  CHECK(r.output.find("model.n_head = 4") != std::string::npos);
  CHECK(r.output.find("train.seq_len = 32") != std::string::npos);
  CHECK(r.output.find("WORLD_SIZE = 1") != std::string::npos);
  CHECK(!std::filesystem::exists(dir.path / "r"));
  // As rank 0 of 2 (the recipe is checked against WORLD_SIZE before any rendezvous).
  const auto a = test::run("cd " + test::kSourceDir + " && WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 " +
                           test::kTrainer + " --config " + recipe + " --set parallel.sequence=2 --set train.micro_batch=auto " +
                           "--set train.global_batch=8 --set memory.limit=64MiB");
  INFO(a.output);
  CHECK(a.code == 2);
  CHECK(a.output.find("train.micro_batch") != std::string::npos);
}

}  // namespace SUBLINEAR_TEST_FILE
