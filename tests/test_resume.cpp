// Durable training state, end to end: a run killed with SIGKILL at a random step and restarted with
// `--resume auto` logs the same (step, loss, grad_norm) sequence, bit for bit, as a run that was never
// interrupted (every checkpointing mode at world 1; DDP and zero3 at world 2), with every step once;
// and a state re-shards: saved at world 2 / zero3 and loaded at world 1, or saved at world 1 and loaded
// at world 2 under zero1 / zero2 / zero3, the loaded parameters and AdamW moments are exactly the saved
// ones (saved again at the new layout and compared by tests/state_compare.py through the reference
// `safetensors` package), and training goes on within the world-size tolerance of tests/test_parallel.cpp;
// at odd world sizes too: zero1/2/3 states saved at world 3 go to world 2, from there back to world 3,
// and to world 1, exactly. Under torchrun's elastic restarts (scripts/launch.sh --max-restarts, world 2)
// a rank killed with SIGKILL (after a save, before the first one, or inside one) is restarted by torchrun
// alone and the run ends bitwise as the uninterrupted one, each step logged once, the restart recorded.
//
// Kill points come from a std::mt19937 whose seed is printed on failure (INFO "seed"); set
// SUBLINEAR_TEST_SEED to replay one.
#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "log/run_dir.h"
#include "recipes.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 12;
// tests/recipes.h's tiny state recipe (fp32, dropout 0.1, accumulation 2, an eval every 5 steps), every
// collective bounded by a 60 s timeout.
const std::string kCommon =
    "--config configs/tiny.yaml " + test::recipe_tiny_state(kSteps).set("parallel.timeout_s", "60").sets();

uint32_t test_seed() {
  static const uint32_t seed = [] {
    if (const char* s = std::getenv("SUBLINEAR_TEST_SEED")) return static_cast<uint32_t>(std::stoul(s));
    return std::random_device{}();
  }();
  return seed;
}
std::mt19937& rng() {
  static std::mt19937 g(test_seed());
  return g;
}
int random_in(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }

std::string dir_arg(const fs::path& run_dir) { return " --set logging.dir=" + run_dir.string(); }

// Runs `world` ranks (1: the plain trainer) to the end; asserts every rank exited 0.
void run_ok(int world, const std::string& args) {
  if (world == 1) {
    const auto r = test::trainer(args);
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    return;
  }
  const auto m = test::launch(world, args);
  for (int r = 0; r < world; ++r) {
    INFO(args << "\nrank " << r << ":\n" << m.outputs[static_cast<size_t>(r)]);
    REQUIRE(m.codes[static_cast<size_t>(r)] == 0);
  }
}

// The step records and evals of an uninterrupted run of `args` at `world` ranks.
test::RunTrace uninterrupted(int world, const std::string& args, const fs::path& run_dir) {
  run_ok(world, args + dir_arg(run_dir));
  auto t = test::trace(run_dir / "metrics.jsonl");
  REQUIRE(t.steps.size() == static_cast<size_t>(kSteps));
  REQUIRE(t.evals.size() == 3);  // steps 5, 10 and the end
  return t;
}

struct Resumed {
  size_t records_at_kill = 0;  // step records in metrics.jsonl when SIGKILL was sent
  int64_t resumed_step = -1;   // the step the restart resumed from (its `resume` event)
};

// Starts `world` ranks of `args` in the background, waits until metrics.jsonl holds at least `k` step
// records and the first state is published (`latest` exists: an asynchronous save is published a step
// or more after its own), SIGKILLs every rank, then restarts them with `--resume auto` and the same
// arguments.
Resumed kill_and_resume(int world, const std::string& args, const fs::path& run_dir, size_t k) {
  const auto metrics = run_dir / "metrics.jsonl";
  const std::string full = args + dir_arg(run_dir);
  Resumed out;
  {
    auto procs = world == 1 ? [&] {
      std::vector<std::unique_ptr<test::Background>> v;
      v.push_back(test::trainer_background(full, run_dir.string() + ".killed.log"));
      return v;
    }()
                            : test::launch_background(world, full, run_dir.string() + ".killed");
    for (auto& p : procs) REQUIRE(p->running());
    const bool reached = test::poll_until(
        [&] {
          if (test::step_records_now(metrics) >= k && fs::exists(run_dir / "state" / "latest")) return true;
          for (auto& p : procs)
            if (p->exited()) return true;  // died on its own: reported below
          return false;
        },
        std::chrono::seconds(150));
    for (auto& p : procs) p->signal(SIGKILL);
    for (auto& p : procs) p->wait();
    out.records_at_kill = test::step_records_now(metrics);
    INFO("rank 0 before the kill:\n" << procs[0]->output());
    REQUIRE(reached);
    // Killed by the SIGKILL, not finished or failed before it: the restart really starts mid-run.
    REQUIRE(procs[0]->killed_by(SIGKILL));
  }
  INFO("killed with " << out.records_at_kill << " step records in metrics.jsonl (waited for " << k << ")");
  // A save cut short leaves a .step-*.tmp directory: --resume auto ignores it, the next save removes it.
  const auto leftover = run_dir / "state" / ".step-00000099.tmp";
  fs::create_directories(leftover);
  std::ofstream(leftover / "rank-00000.safetensors") << "partial";
  run_ok(world, full + " --resume auto");
  const auto resumes = test::events(metrics, "resume");
  REQUIRE(resumes.size() == 1);
  out.resumed_step = resumes[0].at("step").get<int64_t>();
  CHECK(out.resumed_step > 0);
  CHECK(out.resumed_step <= static_cast<int64_t>(out.records_at_kill));
  CHECK(resumes[0].at("saved_world_size").get<int64_t>() == world);
  if (out.resumed_step < kSteps) CHECK_FALSE(fs::exists(leftover));
  // The log was cut back to the resumed step: events of the killed run after it are gone too.
  int64_t last_saved = 0;
  for (const auto& e : test::events(metrics, "state_saved")) {
    CHECK(e.at("step").get<int64_t>() > last_saved);
    last_saved = e.at("step").get<int64_t>();
  }
  return out;
}

struct Mode {
  std::string name, sets;
  int every;  // state.every
};

}  // namespace

TEST_CASE("kill -9 at a random step and --resume auto: bitwise the uninterrupted run, every checkpointing mode") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  const std::vector<Mode> modes = {
      {"none", "--set model.n_layer=2", 2},
      {"full", "--set model.n_layer=4 --set checkpointing.mode=full", 3},
      {"interval", "--set model.n_layer=4 --set checkpointing.mode=interval --set checkpointing.interval=1", 2},
      {"sqrt", "--set model.n_layer=4 --set checkpointing.mode=sqrt", 3},
      {"selective",
       "--set model.n_layer=4 --set checkpointing.mode=selective --set 'checkpointing.recompute=[attention,mlp,norm]'", 2},
  };
  test::TempDir dir("resume-modes");
  for (const auto& mode : modes) {
    INFO("checkpointing mode " << mode.name);
    const std::string args = kCommon + " " + mode.sets + fmt::format(" --set state.every={}", mode.every);
    const auto want = uninterrupted(1, args, dir.path / (mode.name + "-ref"));
    // Two kill points for mode none, one for the others, each after the first save (kill_and_resume
    // waits for it; a kill before any save: tests/test_state.cpp).
    const int points = mode.name == "none" ? 2 : 1;
    for (int i = 0; i < points; ++i) {
      const int k = random_in(mode.every + 1, kSteps - 2);
      INFO("kill point " << i << ": after " << k << " step records");
      const auto run_dir = dir.path / fmt::format("{}-kill{}", mode.name, i);
      const Resumed res = kill_and_resume(1, args, run_dir, static_cast<size_t>(k));
      INFO("resumed from step " << res.resumed_step << " (killed with " << res.records_at_kill << " records)");
      CHECK(test::trace_diff(test::trace(run_dir / "metrics.jsonl"), want) == "");
      if (mode.name != "none") {  // the mode really recomputed in the resumed steps
        const auto recs = test::read_jsonl(run_dir / "metrics.jsonl");
        double recompute_ms = 0;
        for (const auto& r : recs)
          if (!r.contains("event") && r.at("step").get<int64_t>() > res.resumed_step) recompute_ms += r.value("recompute_ms", 0.0);
        CHECK(recompute_ms > 0);
      }
    }
  }
}

TEST_CASE("kill -9 of both ranks and --resume auto at world 2: bitwise the uninterrupted run, DDP and zero3") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  test::TempDir dir("resume-w2");
  for (const std::string stage : {"none", "zero3"}) {
    INFO("parallel.sharding " << stage);
    // World 2 x micro 2 x accum 2: the global batch of the world-1 recipe.
    const std::string args = kCommon + " --set model.n_layer=2 --set train.micro_batch=2 --set state.every=2 "
                                       "--set parallel.sharding=" + stage;
    const auto want = uninterrupted(2, args, dir.path / (stage + "-ref"));
    const int k = random_in(3, kSteps - 2);
    INFO("kill after " << k << " step records");
    const auto run_dir = dir.path / (stage + "-kill");
    const Resumed res = kill_and_resume(2, args, run_dir, static_cast<size_t>(k));
    INFO("resumed from step " << res.resumed_step);
    CHECK(test::trace_diff(test::trace(run_dir / "metrics.jsonl"), want) == "");
  }
}

TEST_CASE("kill -9 and --resume auto with offload: bitwise the uninterrupted run; the state resumes with or without offload") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  test::TempDir dir("resume-offload");
  // zero3 at world 1 with every kind of state in host memory and the checkpointed inputs too.
  const std::string plain = kCommon + " --set model.n_layer=3 --set state.every=2 --set parallel.sharding=zero3 "
                                      "--set checkpointing.mode=full";
  const std::string offload = plain + " --set offload.optimizer=true --set offload.gradients=true "
                                      "--set offload.parameters=true --set offload.activations=true";
  const auto want = uninterrupted(1, offload, dir.path / "ref");
  // Offload moves bytes only: the run without it is the same run.
  CHECK(test::trace_diff(uninterrupted(1, plain, dir.path / "plain"), want) == "");
  const int k = random_in(3, kSteps - 2);
  INFO("kill after " << k << " step records");
  const auto run_dir = dir.path / "kill";
  const Resumed res = kill_and_resume(1, offload, run_dir, static_cast<size_t>(k));
  INFO("resumed from step " << res.resumed_step);
  CHECK(test::trace_diff(test::trace(run_dir / "metrics.jsonl"), want) == "");
  // The state files do not record where the states lived: a state saved with offload resumes without it.
  // (A first run of 6 steps: inside tiny.yaml's 20 warm-up steps the learning rate does not depend on
  // train.steps; its end-of-run eval at step 6 is the one record the 12-step run has not.)
  const auto other = dir.path / "offloaded-then-not";
  run_ok(1, offload + " --set train.steps=6" + dir_arg(other));
  run_ok(1, plain + dir_arg(other) + " --resume auto");
  CHECK(test::bitwise_diff(test::step_records(other / "metrics.jsonl"), want.steps) == "");
}

namespace {

// Tolerance of tests/test_parallel.cpp for the same steps at another world size, derived there (its
// kMetricTol): relative difference of loss and grad_norm <= 1e-5 at every step, where only the order
// of fp32 sums differs (a rounding bound, not a figure of one CPU); a lost moment, a stale shard or a
// missing rank moves them by 1e-2 or more.
constexpr double kMetricTol = 1e-5;

// Step records after `after`, as (loss, grad_norm).
std::vector<test::StepRecord> records_after(const fs::path& metrics, int64_t after) {
  std::vector<test::StepRecord> out;
  for (const auto& r : test::step_records(metrics))
    if (r.step > after) out.push_back(r);
  return out;
}

void check_within_tolerance(const std::vector<test::StepRecord>& got, const std::vector<test::StepRecord>& want) {
  REQUIRE(got.size() == want.size());
  REQUIRE(!got.empty());
  const auto rel = [](double x, double y) { return std::abs(x - y) / std::max(std::abs(x), std::abs(y)); };
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << got[i].step << ": loss " << got[i].loss << " vs " << want[i].loss << ", grad_norm "
                 << got[i].grad_norm << " vs " << want[i].grad_norm);
    CHECK(got[i].step == want[i].step);
    CHECK(rel(got[i].loss, want[i].loss) <= kMetricTol);
    CHECK(rel(got[i].grad_norm, want[i].grad_norm) <= kMetricTol);
  }
}

json state_summary(const std::string& output) {
  const auto at = output.find('{');
  REQUIRE(at != std::string::npos);
  return json::parse(output.substr(at, output.find('\n', at) - at));
}

// `state_compare.py compare A B`: the same parameters and moments, bitwise. Returns its summary.
json require_same_state(const fs::path& a, const fs::path& b) {
  const auto r = test::state_compare("compare " + a.string() + " " + b.string());
  INFO("state_compare.py compare " << a << " " << b << ":\n" << r.output);
  REQUIRE(r.code == 0);
  const json s = state_summary(r.output);
  CHECK(s.at("equal") == true);
  CHECK(s.at("elements_compared").get<int64_t>() > 0);
  return s;
}

constexpr int kSaved = 6;      // the re-sharded state's step
constexpr int kContinue = 10;  // steps of the runs that go on from it
// Dropout 0: the dropout masks of one rank x 4 rows and two ranks x 2 rows differ; the rest is the
// same math at world 1 and 2.
const std::string kReshard = kCommon + " --set model.n_layer=2 --set model.dropout=0.0" +
                             fmt::format(" --set train.steps={} --set state.every={}", kContinue, kSaved);
const std::string kWorld1 = " --set train.micro_batch=4 --set train.grad_accum=2";
const std::string kWorld2 = " --set train.micro_batch=2 --set train.grad_accum=2";
const std::string kSavedDir = fmt::format("state/step-{:08d}", kSaved);

}  // namespace

TEST_CASE("re-sharding: a world 2 / zero3 state resumed at world 1 holds the saved parameters exactly") {
  test::TempDir dir("reshard-2to1");
  // World 2 / zero3 to 10 steps, saving at 6 and 10: the saved state and the uninterrupted run.
  const auto src = dir.path / "w2-zero3";
  run_ok(2, kReshard + kWorld2 + " --set parallel.sharding=zero3" + dir_arg(src));
  const auto saved = src / kSavedDir;
  REQUIRE(fs::exists(saved / "rank-00001.safetensors"));

  // Resumed at world 1 with train.steps = the saved step: nothing trains, and the state is saved again
  // at world 1 (state.at_end) into another state.dir.
  const auto again = dir.path / "w1-resaved";
  run_ok(1, kReshard + kWorld1 + fmt::format(" --set train.steps={}", kSaved) + dir_arg(dir.path / "w1-load") +
                " --set state.dir=" + again.string() + " --resume " + saved.string());
  const auto resaved = again / fmt::format("step-{:08d}", kSaved);
  const json s = require_same_state(saved, resaved);
  CHECK(s["a"]["world_size"] == 2);
  CHECK(s["a"]["ranged_tensors"].get<int64_t>() > 0);  // zero3: each rank wrote flat ranges
  CHECK(s["b"]["world_size"] == 1);
  CHECK(s["b"]["ranged_tensors"] == 0);

  // Training continues from it at world 1 within the world-size tolerance of the world-2 run.
  const auto cont = dir.path / "w1-continue";
  run_ok(1, kReshard + kWorld1 + dir_arg(cont) + " --resume " + saved.string());
  const auto got = records_after(cont / "metrics.jsonl", kSaved);
  CHECK(got.size() == static_cast<size_t>(kContinue - kSaved));
  CHECK(test::step_records(cont / "metrics.jsonl").size() == got.size());  // a fresh run dir: only the new steps
  check_within_tolerance(got, records_after(src / "metrics.jsonl", kSaved));
}

TEST_CASE("re-sharding: a world 1 state resumed at world 2 under zero1, zero2, zero3 holds the saved parameters exactly", "[numerics]") {
  test::TempDir dir("reshard-1to2");
  const auto src = dir.path / "w1";
  run_ok(1, kReshard + kWorld1 + dir_arg(src));
  const auto saved = src / kSavedDir;
  const auto want = records_after(src / "metrics.jsonl", kSaved);
  for (const std::string stage : {"zero1", "zero2", "zero3"}) {
    INFO("parallel.sharding " << stage);
    const std::string w2 = kReshard + kWorld2 + " --set parallel.sharding=" + stage;
    const auto again = dir.path / (stage + "-resaved");
    run_ok(2, w2 + fmt::format(" --set train.steps={}", kSaved) + dir_arg(dir.path / (stage + "-load")) +
                  " --set state.dir=" + again.string() + " --resume " + saved.string());
    const json s = require_same_state(saved, again / fmt::format("step-{:08d}", kSaved));
    CHECK(s["a"]["world_size"] == 1);
    CHECK(s["b"]["world_size"] == 2);
    CHECK(s["b"]["sharding"] == stage);
    CHECK(s["b"]["ranged_tensors"].get<int64_t>() > 0);  // each rank wrote its own shard

    const auto cont = dir.path / (stage + "-continue");
    run_ok(2, w2 + dir_arg(cont) + " --resume " + saved.string());
    check_within_tolerance(records_after(cont / "metrics.jsonl", kSaved), want);
  }
}

namespace {

// Odd world sizes: a global batch of 12 is 3 ranks x 4 = 2 x 6 = 1 x 12, one micro-batch each. With
// 0.05 MiB buckets (zero1/2) as with zero3's units, most groups are not a multiple of 2 or 3 elements:
// shards end inside parameters and the last rank's shard ends in padding, differently at each world.
const std::string kOdd = kReshard + " --set train.grad_accum=1 --set parallel.bucket_mb=0.05";
std::string micro_batch_at(int world) { return fmt::format(" --set train.micro_batch={}", 12 / world); }

// `state_compare.py compare A B...`: each B holds A's parameters and moments, bitwise. Their summaries.
std::vector<json> require_same_states(const fs::path& a, const std::vector<fs::path>& bs) {
  std::string args = fmt::format("compare {}", a.string());  // (GCC 12's -Wstringop-overflow misfires on "..." + string)
  for (const auto& b : bs) args += fmt::format(" {}", b.string());
  const auto r = test::state_compare(args);
  INFO("state_compare.py " << args << ":\n" << r.output);
  REQUIRE(r.code == 0);
  std::vector<json> out;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') out.push_back(json::parse(line));
  REQUIRE(out.size() == bs.size());
  for (const auto& s : out) {
    CHECK(s.at("equal") == true);
    CHECK(s.at("elements_compared").get<int64_t>() > 0);
  }
  return out;
}

}  // namespace

TEST_CASE("re-sharding at odd world sizes: zero1/2/3 states go 3 -> 2 -> 3 and 3 -> 1 with the saved parameters and moments exactly") {
  test::TempDir dir("reshard-odd");
  for (const std::string stage : {"zero1", "zero2", "zero3"}) {
    INFO("parallel.sharding " << stage);
    const std::string sets = kOdd + " --set parallel.sharding=" + stage;
    // World 3 to 10 steps, saving at 6 and 10: the saved state and the uninterrupted run.
    const auto src = dir.path / (stage + "-w3");
    run_ok(3, sets + micro_batch_at(3) + dir_arg(src));
    const auto saved = src / kSavedDir;
    REQUIRE(fs::exists(saved / "rank-00002.safetensors"));
    // The state `from` loaded at `world` with train.steps = the saved step (nothing trains) and saved
    // again at that world (state.at_end) under <dir>/<stage>-<name>.
    const auto resave = [&](int world, const fs::path& from, const std::string& name) {
      const auto into = dir.path / (stage + "-" + name);
      run_ok(world, sets + micro_batch_at(world) + fmt::format(" --set train.steps={}", kSaved) +
                        dir_arg(into.string() + "-run") + " --set state.dir=" + into.string() + " --resume " + from.string());
      return into / fmt::format("step-{:08d}", kSaved);
    };
    const auto w2 = resave(2, saved, "3to2");
    const auto w3 = resave(3, w2, "3to2to3");  // a world-2 state of this stage back at world 3
    const auto w1 = resave(1, saved, "3to1");
    const auto s = require_same_states(saved, {w2, w3, w1});
    CHECK(s[0]["a"]["world_size"] == 3);
    CHECK(s[0]["a"]["ranged_tensors"].get<int64_t>() > 0);  // each rank wrote its own shard
    const int worlds[] = {2, 3, 1};
    for (size_t i = 0; i < s.size(); ++i) {
      INFO("state " << i << ": " << s[i].dump());
      CHECK(s[i]["b"]["world_size"] == worlds[i]);
      CHECK(s[i]["b"]["sharding"] == stage);
    }
    CHECK(s[0]["b"]["ranged_tensors"].get<int64_t>() > 0);
    CHECK(s[1]["b"]["ranged_tensors"] == s[0]["a"]["ranged_tensors"]);  // the world-3 layout again
    CHECK(s[2]["b"]["ranged_tensors"] == 0);

    // Training continues from the world-3 state at world 1 (no engine: sharding none) within the
    // world-size tolerance of the world-3 run.
    const auto cont = dir.path / (stage + "-3to1-continue");
    run_ok(1, kOdd + micro_batch_at(1) + dir_arg(cont) + " --resume " + saved.string());
    check_within_tolerance(records_after(cont / "metrics.jsonl", kSaved), records_after(src / "metrics.jsonl", kSaved));
  }
}

TEST_CASE("the default directories: --resume auto picks this recipe's newest run, exact name, numeric order") {
  test::TempDir dir("newest-run");
  const auto runs = dir.path / "runs";
  auto make = [&](const std::string& name, bool with_state) {
    fs::create_directories(runs / name);
    if (with_state) fs::create_directories(runs / name / "state");
  };
  make("tiny-20260101-120000", true);
  make("tiny-20260101-120000-9", true);
  make("tiny-20260101-120000-10", true);   // after -9 (as text it sorts before)
  make("tiny-long-20270101-000000", true);  // recipe tiny-long, newer: never tiny's
  make("tiny-20280101-000000", false);      // newer, but no state to resume
  make("tiny-20260101-120000-x", true);     // not a default name
  make("tinyish-20290101-000000", true);
  CHECK(log::newest_run_with_state(runs, "tiny") == runs / "tiny-20260101-120000-10");
  CHECK(log::newest_run_with_state(runs, "tiny-long") == runs / "tiny-long-20270101-000000");
  CHECK(log::newest_run_with_state(runs, "tin").empty());
  CHECK(log::newest_run_with_state(dir.path / "nowhere", "tiny").empty());
  make("tiny-20260102-000000", true);  // a later second wins over any suffix
  CHECK(log::newest_run_with_state(runs, "tiny") == runs / "tiny-20260102-000000");
}

TEST_CASE("a run directory is held by one process: a second --resume auto on it exits 2 naming the holder; "
          "the lock goes with a kill -9") {
  test::TempDir dir("run-lock");
  const auto run_dir = dir.path / "run";
  const std::string args = kCommon + " --set train.steps=100000 --set state.every=2" + dir_arg(run_dir) + " --resume auto";
  auto first = test::trainer_background(args, dir.path / "first.log");
  REQUIRE(first->running());
  const pid_t holder = first->pid;
  const bool saved = test::poll_until([&] { return fs::exists(run_dir / "state" / "latest") || first->exited(); },
                                      std::chrono::seconds(120));
  INFO("first:\n" << first->output());
  REQUIRE(saved);
  REQUIRE_FALSE(first->exited());
  const auto second = test::trainer(args);
  INFO("second:\n" << second.output);
  CHECK(second.code == 2);
  CHECK(second.output.find("is in use by another trainer") != std::string::npos);
  CHECK(second.output.find(fmt::format("pid {} ", holder)) != std::string::npos);
  first->signal(SIGKILL);
  first->wait();
  REQUIRE(first->killed_by(SIGKILL));
  const auto steps = test::step_records_now(run_dir / "metrics.jsonl");
  // After the kill the lock is free: the same command resumes.
  const auto third = test::trainer(kCommon + " --set train.steps=" + std::to_string(steps + 1) + dir_arg(run_dir) + " --resume auto");
  INFO("third:\n" << third.output);
  CHECK(third.code == 0);
  CHECK(test::events(run_dir / "metrics.jsonl", "resume").size() == 1);
}

// ---- torchrun's elastic restarts: scripts/launch.sh --max-restarts, one rank killed -9 ----

namespace {

// World 2 x micro-batch 2 x accumulation 2 (the global batch of kCommon), 2 layers.
const std::string kElastic = kCommon + " --set model.n_layer=2 --set train.micro_batch=2";

// The step records and events metrics.jsonl holds right now (a line being written is left out).
std::vector<json> records_now(const fs::path& metrics) { return test::read_jsonl(metrics, /*strict=*/false); }

// Steps of the events of one kind in `records`.
std::vector<int64_t> event_steps(const std::vector<json>& records, const std::string& kind) {
  std::vector<int64_t> out;
  for (const auto& r : records)
    if (r.is_object() && r.value("event", "") == kind) out.push_back(r.at("step").get<int64_t>());
  return out;
}

// Step records (not events) in `records`.
size_t step_count(const std::vector<json>& records) {
  return static_cast<size_t>(
      std::count_if(records.begin(), records.end(), [](const json& r) { return r.is_object() && !r.contains("event"); }));
}

// The contents of /proc/<pid>/<name> ("" when the process is gone).
std::string proc_file(pid_t pid, const std::string& name) { return test::read_text(fmt::format("/proc/{}/{}", pid, name)); }

// The parent of a process, from /proc/<pid>/stat (-1 when it is gone). The command name in
// parentheses may hold spaces: the fields after its closing parenthesis are " state ppid ...".
pid_t parent_of(pid_t pid) {
  const std::string stat = proc_file(pid, "stat");
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 1));
  std::string state;
  pid_t ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

// Every process below `root` (children, their children...).
std::vector<pid_t> descendants_of(pid_t root) {
  std::vector<std::pair<pid_t, pid_t>> all;  // (pid, parent)
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    const auto pid = static_cast<pid_t>(std::stol(name));
    all.emplace_back(pid, parent_of(pid));
  }
  std::vector<pid_t> out{root};
  for (size_t i = 0; i < out.size(); ++i)
    for (const auto& [pid, parent] : all)
      if (parent == out[i]) out.push_back(pid);
  out.erase(out.begin());
  return out;
}

// Whether /proc/<pid>/environ (NUL-separated) holds `assignment` ("RANK=1").
bool has_env(pid_t pid, const std::string& assignment) {
  const std::string env = proc_file(pid, "environ");
  std::istringstream vars(env);
  for (std::string var; std::getline(vars, var, '\0');)
    if (var == assignment) return true;
  return false;
}

// The trainer process of worker `rank` in torchrun attempt `restart` under `agent` (launch.sh execs
// torchrun, whose agent starts the workers); -1 when there is none (yet).
pid_t worker_pid(pid_t agent, int rank, int restart) {
  std::error_code ec;
  const auto trainer = fs::canonical(test::kTrainer, ec);
  for (const pid_t pid : descendants_of(agent)) {
    if (fs::read_symlink(fmt::format("/proc/{}/exe", pid), ec) != trainer || ec) continue;
    if (has_env(pid, fmt::format("RANK={}", rank)) && has_env(pid, fmt::format("TORCHELASTIC_RESTART_COUNT={}", restart)))
      return pid;
  }
  return -1;
}

// scripts/launch.sh with two ranks in the background: `torchrun_opts` before `--`, the trainer's
// arguments after it, `env` added to the environment (the build's trainer, one thread per rank).
// Ended with SIGTERM (torchrun stops its workers) when the test leaves before it exits.
struct ElasticLaunch {
  std::unique_ptr<test::Background> agent;
  ElasticLaunch(const std::string& env, const std::string& torchrun_opts, const std::string& args, const fs::path& log)
      : agent(std::make_unique<test::Background>(
            fmt::format("TRAINER={} OMP_NUM_THREADS=1 {}", test::kTrainer, env),
            fmt::format("scripts/launch.sh -n 2 {} -- {}", torchrun_opts, args), log)) {}
  ~ElasticLaunch() {
    if (agent->exited()) return;
    agent->signal(SIGTERM);
    test::poll_until([&] { return agent->exited(); }, std::chrono::seconds(40), std::chrono::milliseconds(50));
  }
  // Waits for the exit (at most `limit`); its exit code, or -1 when it still runs.
  int wait(std::chrono::seconds limit) {
    if (!test::poll_until([&] { return agent->exited(); }, limit, std::chrono::milliseconds(20))) return -1;
    return agent->wait();
  }
};

// The step the state root's `latest` names (-1: none).
int64_t latest_step(const fs::path& root) {
  const std::string latest = test::read_text(root / "latest");
  return latest.rfind("step-", 0) == 0 ? std::stoll(latest.substr(5)) : -1;
}

// Whether a process has ended (gone, or a zombie not yet reaped).
bool ended(pid_t pid) {
  const std::string stat = proc_file(pid, "stat");
  const auto close = stat.rfind(')');
  return close == std::string::npos || stat.compare(close, 3, ") Z") == 0;
}

// What metrics.jsonl held when rank 1 was killed, and the newest complete state the first attempt left.
struct Killed {
  std::vector<json> records;
  int64_t latest = -1;  // the step `latest` named once both ranks of the first attempt had ended
};

// Waits until `ready(records)` holds for metrics.jsonl, then at once SIGKILLs rank 1 of torchrun's first
// attempt (REQUIREs that the moment came and the kill landed), and waits for its rank 0 to end too.
template <class Ready>
Killed kill_rank1_when(ElasticLaunch& launch, const fs::path& run_dir, Ready&& ready) {
  Killed out;
  pid_t ranks[2] = {-1, -1};
  bool killed = false;
  const bool reached = test::poll_until(
      [&] {
        if (launch.agent->exited()) return true;  // finished or failed before the kill: reported below
        for (int r = 0; r < 2; ++r)
          if (ranks[r] < 0) ranks[r] = worker_pid(launch.agent->pid, r, /*restart=*/0);
        out.records = records_now(run_dir / "metrics.jsonl");
        if (ranks[0] < 0 || ranks[1] < 0 || !ready(out.records)) return false;
        killed = ::kill(ranks[1], SIGKILL) == 0;
        return true;
      },
      std::chrono::seconds(150), std::chrono::milliseconds(5));
  INFO("launch.sh so far:\n" << launch.agent->output());
  REQUIRE(reached);
  REQUIRE(killed);
  // Rank 0 fails on the dead peer (or torchrun stops it): whatever it published is on disk now, and the
  // restarted ranks have not saved anything yet.
  REQUIRE(test::poll_until([&] { return ended(ranks[0]); }, std::chrono::seconds(60), std::chrono::milliseconds(5)));
  out.latest = latest_step(run_dir / "state");
  return out;
}

// The restart's records in metrics.jsonl: one `restart` event (attempt 1) and, when it found a state,
// one `resume` event at the same step. Returns the step it continued from.
int64_t require_one_restart(const fs::path& metrics) {
  const auto restarts = test::events(metrics, "restart");
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0].at("restart") == 1);
  const int64_t step = restarts[0].at("step").get<int64_t>();
  const auto resumes = test::events(metrics, "resume");
  if (restarts[0].at("state").is_null()) {
    CHECK(step == 0);
    CHECK(resumes.empty());
    return step;
  }
  REQUIRE(resumes.size() == 1);
  CHECK(resumes[0].at("restart") == 1);
  CHECK(resumes[0].at("step") == step);
  CHECK(resumes[0].at("state") == restarts[0].at("state"));
  return step;
}

// Events of `kind` in metrics.jsonl are at increasing steps: none of the killed attempt's after the
// resumed step is left beside the restart's own.
void check_events_once(const fs::path& metrics, const std::string& kind) {
  int64_t last = -1;
  for (const int64_t step : event_steps(test::read_jsonl(metrics), kind)) {
    INFO(kind << " event at step " << step << " after one at step " << last);
    CHECK(step > last);
    last = step;
  }
}

// The run ended well after one restart: launch.sh exited 0, summary.json records the restart.
void require_finished_after_restart(ElasticLaunch& launch, const fs::path& run_dir) {
  const int code = launch.wait(std::chrono::seconds(180));
  INFO("launch.sh:\n" << launch.agent->output());
  REQUIRE(code == 0);
  const auto s = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(s["exit_status"]["code"] == 0);
  CHECK(s["state"]["restart"] == 1);
  CHECK(s["steps"] == kSteps);
}

}  // namespace

TEST_CASE("torchrun --max-restarts through launch.sh: a rank killed -9 is restarted, resumes from the newest state, "
          "bitwise the uninterrupted run, every step logged once") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  test::TempDir dir("elastic");
  const std::string args = kElastic + " --set state.every=3";
  const auto want = uninterrupted(2, args, dir.path / "ref");

  // Killed after the first save (step 3) and at least one step past it.
  const int k = random_in(4, kSteps - 2);
  INFO("kill rank 1 after " << k << " step records");
  const auto run_dir = dir.path / "elastic";
  const auto metrics = run_dir / "metrics.jsonl";
  ElasticLaunch launch("", "--max-restarts 2", args + dir_arg(run_dir) + " --resume auto", dir.path / "launch.log");
  const Killed killed = kill_rank1_when(launch, run_dir, [&](const std::vector<json>& records) {
    return step_count(records) >= static_cast<size_t>(k) && !event_steps(records, "state_saved").empty();
  });
  require_finished_after_restart(launch, run_dir);

  const int64_t resumed = require_one_restart(metrics);
  INFO("resumed from step " << resumed << "; killed with " << step_count(killed.records) << " step records, latest "
                            << killed.latest);
  CHECK(resumed > 0);
  CHECK(resumed == killed.latest);  // the newest complete state
  CHECK(resumed <= static_cast<int64_t>(step_count(killed.records)));
  CHECK(test::trace_diff(test::trace(metrics), want) == "");
  check_events_once(metrics, "state_saved");
}

TEST_CASE("torchrun --max-restarts: a rank killed -9 before the first save restarts the run from step 0, "
          "the restart recorded") {
  test::TempDir dir("elastic-nostate");
  const std::string args = kElastic + " --set state.every=100";
  const auto want = uninterrupted(2, args, dir.path / "ref");
  const auto run_dir = dir.path / "elastic";
  const auto metrics = run_dir / "metrics.jsonl";
  ElasticLaunch launch("", "--max-restarts=2", args + dir_arg(run_dir) + " --resume auto", dir.path / "launch.log");
  const Killed killed = kill_rank1_when(launch, run_dir, [](const std::vector<json>& records) { return step_count(records) >= 2; });
  REQUIRE(killed.latest == -1);
  require_finished_after_restart(launch, run_dir);
  CHECK(require_one_restart(metrics) == 0);  // state null, no resume event
  CHECK(test::trace_diff(test::trace(metrics), want) == "");
}

namespace {

// The state root after a run: `latest` names a step directory that is there, every step directory is
// whole (tests/state_compare.py check: sizes, CRC-32s, every tensor readable and tiled exactly), and no
// temporary or half-replaced directory is left. Returns the step `latest` names.
int64_t check_state_root(const fs::path& root) {
  const int64_t latest = latest_step(root);
  INFO("latest: '" << test::read_text(root / "latest") << "'");
  REQUIRE(latest >= 0);
  REQUIRE(fs::exists(root / fmt::format("step-{:08d}", latest) / "meta.json"));
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    INFO("state root entry " << name);
    CHECK(name.front() != '.');  // .step-*.tmp, .step-*.old
    if (name.rfind("step-", 0) != 0) continue;
    const auto r = test::state_compare("check " + e.path().string());
    INFO(r.output);
    CHECK(r.code == 0);
  }
  return latest;
}

}  // namespace

// The window is held open by the test hook SUBLINEAR_STATE_WRITE_DELAY_MS (each rank's background save
// waits that long after writing its file before it counts as written); `state_snapshot` says a save began.
TEST_CASE("torchrun --max-restarts: a rank killed -9 during a save resumes from the state before it; the state root "
          "and metrics.jsonl stay consistent") {
  test::TempDir dir("elastic-save");
  const std::string args = kElastic + " --set state.every=4 --set state.async=true";
  const auto want = uninterrupted(2, args, dir.path / "ref");
  const auto run_dir = dir.path / "elastic";
  const auto metrics = run_dir / "metrics.jsonl";
  // Each save stays unfinished for 3 s: the kill lands inside the second one (step 8), the first published.
  ElasticLaunch launch("SUBLINEAR_STATE_WRITE_DELAY_MS=3000", "--max-restarts 2",
                       args + dir_arg(run_dir) + " --resume auto", dir.path / "launch.log");
  int64_t interrupted = -1;
  const Killed killed = kill_rank1_when(launch, run_dir, [&](const std::vector<json>& records) {
    const auto saved = event_steps(records, "state_saved");
    for (const int64_t step : event_steps(records, "state_snapshot"))
      if (!saved.empty() && step > saved.back()) return interrupted = step, true;
    return false;
  });
  const int64_t complete = event_steps(killed.records, "state_saved").back();
  INFO("killed during the save of step " << interrupted << "; the newest complete state was step " << complete);
  CHECK(killed.latest == complete);  // the interrupted save was not published: its writers were still held
  CHECK_FALSE(fs::exists(run_dir / "state" / fmt::format("step-{:08d}", interrupted) / "meta.json"));
  require_finished_after_restart(launch, run_dir);

  CHECK(require_one_restart(metrics) == complete);  // the previous complete state, not the interrupted one
  CHECK(test::trace_diff(test::trace(metrics), want) == "");
  check_events_once(metrics, "state_saved");
  check_events_once(metrics, "state_snapshot");
  CHECK(check_state_root(run_dir / "state") == kSteps);  // the end's save, after the interrupted step was saved again
}

}  // namespace SUBLINEAR_TEST_FILE
