// End to end: the trainer binary on configs/tiny.yaml lowers the loss and writes metrics.jsonl and
// summary.json with every documented field; a diverging run exits 6 and a SIGTERM'd run exits 143,
// each with its summary written. Faults end cleanly: a model too big for the device is refused before
// any weight exists (4), a real allocation failure in the loop is an oom (4), a second run into the
// same directory is refused (2), a failed write stops the run with 7 and leaves valid JSONL, and fp16
// that keeps skipping is diverged (6).
#include <algorithm>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "errors.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;

namespace {
std::vector<json> read_jsonl(const std::filesystem::path& p) {
  std::vector<json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

// This test process's virtual size (it maps the same LibTorch libraries as the trainer).
int64_t own_virtual_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7));
  return 0;
}

std::vector<std::string> files_in(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}
}  // namespace

TEST_CASE("tiny recipe trains, lowers the loss and writes both JSON logs") {
  test::TempDir dir("e2e");
  const auto run_dir = dir.path / "run";
  auto r = test::trainer("--config configs/tiny.yaml --set train.steps=40 --set train.eval_interval=20 "
                         "--set logging.interval=10 --set logging.dir=" + run_dir.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("| model.n_layer") != std::string::npos);  // the resolved-settings table
  CHECK(r.output.find("step    40/40") != std::string::npos);     // console line

  auto records = read_jsonl(run_dir / "metrics.jsonl");
  std::vector<json> steps, evals;
  for (auto& rec : records) {
    if (!rec.contains("event")) steps.push_back(rec);
    else if (rec["event"] == "eval") evals.push_back(rec);
  }
  REQUIRE(steps.size() == 40);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "step_ms", "tokens", "tokens_per_s", "samples_per_s",
                          "mfu", "peak_allocated_bytes", "allocated_bytes", "reserved_bytes"})
    for (auto& s : steps) REQUIRE(s.contains(key));
  CHECK(steps.front()["step"] == 1);
  CHECK(steps.back()["step"] == 40);
  CHECK(steps.back()["tokens"] == 16 * 2 * 128);
  CHECK(steps.back()["peak_allocated_bytes"].get<int64_t>() > 0);
  CHECK(steps.back()["mfu"].get<double>() > 0.0);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += steps[i]["loss"].get<double>(), last += steps[35 + i]["loss"].get<double>();
  CHECK(last / 5 < first / 5 - 1.0);  // at least one nat lower
  REQUIRE(evals.size() == 2);
  CHECK(evals[0]["event"] == "eval");
  CHECK(evals[1]["val_loss"].get<double>() < evals[0]["val_loss"].get<double>() + 0.5);

  auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  for (const char* key : {"config", "environment", "model", "steps", "tokens", "final_loss", "final_val_loss",
                          "median_step_ms", "median_tokens_per_s", "median_samples_per_s", "median_mfu",
                          "peak_allocated_bytes", "memory_breakdown", "exit_status", "wall_s"})
    CHECK(summary.contains(key));
  for (const char* key : {"torch_version", "device", "threads", "world_size", "memory_source"})
    CHECK(summary["environment"].contains(key));
  CHECK(summary["environment"]["memory_source"] == "cpu_tracking_allocator");
  // The CPU and the capabilities that change memory or speed (device/cpu_features.h).
  for (const char* key : {"cpu_model", "aten_cpu_capability", "avx512_bf16", "amx_bf16", "bf16_matmul", "fp16_matmul"})
    CHECK(summary["environment"]["cpu"].contains(key));
  CHECK_FALSE(summary["environment"]["cpu"]["cpu_model"].get<std::string>().empty());
  CHECK(summary["config"]["train"]["steps"] == 40);
  CHECK(summary["steps"] == 40);
  CHECK(summary["exit_status"]["code"] == 0);
  const auto& mb = summary["memory_breakdown"];
  const int64_t params = mb["params_bytes"];
  CHECK(params == summary["model"]["params"].get<int64_t>() * 4);
  CHECK(mb["grads_bytes"] == params);
  CHECK(mb["optimizer_state_bytes"] == 2 * params);
  CHECK(mb["activations_and_other_bytes"].get<int64_t>() > 0);
  CHECK(mb["params_bytes"].get<int64_t>() + mb["grads_bytes"].get<int64_t>() + mb["optimizer_state_bytes"].get<int64_t>() +
            mb["activations_and_other_bytes"].get<int64_t>() == summary["peak_allocated_bytes"].get<int64_t>());
  CHECK(std::filesystem::exists(run_dir / "config.json"));
}

TEST_CASE("a diverging run stops with exit code 6 and says so in summary.json") {
  test::TempDir dir("nan");
  const auto run_dir = dir.path / "run";
  auto r = test::trainer("--config configs/tiny.yaml --set train.steps=30 --set train.lr=1e30 --set train.min_lr=0 "
                         "--set train.warmup_steps=0 --set train.grad_clip=0 --set logging.dir=" + run_dir.string());
  INFO(r.output);
  CHECK(r.code == kExitNonFinite);
  auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitNonFinite);
  CHECK(summary["exit_status"]["name"] == "non_finite");
  const std::string log = test::read_text(run_dir / "metrics.jsonl");
  CHECK((log.find("\"event\":\"non_finite_loss\"") != std::string::npos ||
         log.find("\"event\":\"non_finite_grad\"") != std::string::npos));
}

TEST_CASE("SIGTERM stops after the current step with exit code 143 and a summary") {
  test::TempDir dir("term");
  const auto run_dir = dir.path / "run";
  const std::string cmd =
      "cd " + test::kSourceDir + " && (OMP_NUM_THREADS=1 " + test::kTrainer +
      " --config configs/tiny.yaml --set train.steps=100000 --set logging.dir=" + run_dir.string() +
      " > /dev/null & pid=$!; for i in $(seq 600); do [ -s " + (run_dir / "metrics.jsonl").string() +
      " ] && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo rc=$?)";
  auto r = test::run(cmd);
  INFO(r.output);
  CHECK(r.output.find("rc=143") != std::string::npos);
  auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(summary["exit_status"]["code"] == 143);
  CHECK(summary["steps"].get<int64_t>() >= 1);
}

TEST_CASE("every checkpointing mode trains the same 20-step loss sequence and logs its recompute") {
  const std::string common =
      "--config configs/tiny.yaml --set train.steps=20 --set train.micro_batch=4 --set train.seq_len=64 "
      "--set train.grad_accum=2 --set model.dropout=0.1 --set train.eval_interval=0 --set logging.skip_first=0 ";
  auto losses_of = [&](const std::string& mode, json* summary, std::vector<json>* steps) {
    test::TempDir dir("modes");
    auto r = test::trainer(common + mode + " --set logging.dir=" + (dir.path / "run").string());
    INFO(mode << "\n" << r.output);
    REQUIRE(r.code == 0);
    std::vector<double> losses;
    for (auto& rec : read_jsonl(dir.path / "run" / "metrics.jsonl")) {
      if (rec.contains("event")) continue;  // state_saved at the end
      losses.push_back(rec["loss"].get<double>());
      steps->push_back(rec);
    }
    *summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
    return losses;
  };
  json none_summary;
  std::vector<json> none_steps;
  const auto reference = losses_of("", &none_summary, &none_steps);
  REQUIRE(reference.size() == 20);
  CHECK(none_summary["checkpointing"]["checkpointed_blocks"] == 0);
  for (auto& s : none_steps) CHECK(s["recompute_ms"] == 0.0);

  const std::vector<std::string> modes = {
      "--set checkpointing.mode=full",
      "--set checkpointing.mode=interval --set checkpointing.interval=3",
      "--set checkpointing.mode=sqrt --set checkpointing.skip_last=false",
      "--set checkpointing.mode=selective --set checkpointing.recompute=[attention,mlp,norm]"};
  for (const auto& mode : modes) {
    DYNAMIC_SECTION(mode) {
      json summary;
      std::vector<json> steps;
      CHECK(losses_of(mode, &summary, &steps) == reference);
      for (auto& s : steps) {
        CHECK(s["recompute_ms"].get<double>() > 0.0);
        CHECK(s["hfu"].get<double>() > s["mfu"].get<double>());
        CHECK(s["activation_peak_bytes"].get<int64_t>() > 0);
      }
      CHECK(summary["median_activation_peak_bytes"].get<int64_t>() <
            none_summary["median_activation_peak_bytes"].get<int64_t>());
      CHECK(summary["checkpointing"].contains("segments"));
      CHECK(summary.contains("predicted_activation_peak_bytes"));
    }
  }
  // The plan in summary.json says which segments were checkpointed.
  json summary;
  std::vector<json> steps;
  losses_of("--set checkpointing.mode=interval --set checkpointing.interval=3", &summary, &steps);
  const auto& segs = summary["checkpointing"]["segments"];
  REQUIRE(segs.size() == 2);  // tiny has 4 blocks: [0,3) checkpointed, [3,4) kept (skip_last)
  CHECK(segs[0]["blocks"] == json::array({0, 3}));
  CHECK(segs[0]["checkpointed"] == true);
  CHECK(segs[1]["checkpointed"] == false);
  CHECK(summary["checkpointing"]["k"] == 3);
}

TEST_CASE("bf16 autocast trains the tiny recipe like fp32; fp16 logs its loss scale and skipped steps", "[numerics]") {
  auto last5 = [](const std::vector<json>& steps) {
    double s = 0;
    for (size_t i = steps.size() - 5; i < steps.size(); ++i) s += steps[i]["loss"].get<double>();
    return s / 5;
  };
  auto run = [&](const std::string& compute, json* summary) {
    test::TempDir dir("prec");
    // 20 steps: a CPU without bf16/fp16 matmul instructions (AVX2 only) runs these ~8x slower than fp32.
    auto r = test::trainer("--config configs/tiny.yaml --set train.steps=20 --set train.micro_batch=8 "
                           "--set train.eval_interval=0 --set precision.compute=" + compute +
                           " --set logging.dir=" + (dir.path / "run").string());
    INFO(compute << "\n" << r.output);
    REQUIRE(r.code == 0);
    std::vector<json> steps;
    int64_t skip_events = 0;
    for (auto& rec : read_jsonl(dir.path / "run" / "metrics.jsonl")) {
      if (rec.contains("event")) {
        skip_events += rec["event"] == "skip";
        continue;
      }
      CHECK(rec.contains("loss_scale"));
      CHECK(rec.contains("skipped"));
      steps.push_back(rec);
    }
    *summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
    CHECK((*summary)["skipped_steps"] == skip_events);
    return steps;
  };
  json s32, s16b, s16;
  const auto fp32 = run("fp32", &s32), bf16 = run("bf16", &s16b), fp16 = run("fp16", &s16);
  // The mean of the last 5 losses within 0.05 nats of fp32's (both fall ~2.7 nats from 5.56 in 20
  // steps). From the arithmetic: a step's loss carries bf16's rounding of the logits, each position's
  // loss moving by <= 2 max|dz| ~ 2 x 2^-9 x |z| <= 0.03 with |z| <= 8; and the parameters' drift D,
  // which moves the loss by g . D: the gradient's norm sits on well-conditioned elements, whose
  // directions move by <= 2 x 1.6e-2 (tests/runs.h kRounded), so |g . D| <= |g| x 3.2e-2 x B with
  // |g| <= 3 and B = adamw_travel_bound <= 0.07 (lr 3e-3, 20 steps): <= 7e-3. Together < 0.04.
  CHECK(std::abs(last5(bf16) - last5(fp32)) < 0.05);
  // The same bound holds at every step (the rounding and the drift above bound each step's loss, the last
  // five's mean only averages them): the curve, not only its end.
  REQUIRE(bf16.size() == fp32.size());
  for (size_t i = 0; i < bf16.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(std::abs(bf16[i]["loss"].get<double>() - fp32[i]["loss"].get<double>()) < 0.05);
  }
  CHECK(last5(bf16) < bf16.front()["loss"].get<double>() - 2.0);
  CHECK(s16b["skipped_steps"] == 0);
  CHECK(bf16.front()["loss_scale"] == 1.0);
  CHECK(fp16.front()["loss_scale"] == 65536.0);
  // fp16 rounds finer (2^-12): bf16's bound holds, plus the steps its loss scaler skipped (no update
  // while the scale comes down), each leaving its curve one step behind fp32's: worth fp32's own
  // slope over its last 5 steps per skipped step.
  // The skips are the scaler's halvings: 20 steps are far from growth_interval (2000), so the scale only
  // comes down, by half per skipped step, from 2^16: skipped = log2(65536 / the last scale). And they are
  // capped: at scale 1 an fp16 backward that overflows could not train at all, so at most 16 halvings; a
  // scaler that skipped every step (the curve flat, ~2.7 nats above fp32's) fails the loss check below.
  const auto skipped = s16["skipped_steps"].get<int64_t>();
  CHECK(skipped <= 16);
  const double last_scale = fp16.back()["loss_scale"].get<double>() * (fp16.back()["skipped"].get<bool>() ? 0.5 : 1.0);
  CHECK(std::ldexp(last_scale, static_cast<int>(skipped)) == 65536.0);  // a record's scale is the one its step used
  const double late_slope = std::max(0.0, (fp32[fp32.size() - 6]["loss"].get<double>() - fp32.back()["loss"].get<double>()) / 5);
  CHECK(std::abs(last5(fp16) - last5(fp32)) < 0.05 + static_cast<double>(skipped) * late_slope);
  // bf16 keeps activations in half the bytes where autocast computes in it.
  CHECK(s16b["median_activation_peak_bytes"].get<int64_t>() < 0.8 * s32["median_activation_peak_bytes"].get<int64_t>());
}

TEST_CASE("a model whose states exceed the device is refused before any weight exists, exit 4") {
  test::TempDir dir("toobig");
  for (const std::string set : {"model.n_layer=1000000000", "model.n_embd=65536"}) {
    auto r = test::trainer("--config configs/tiny.yaml --set " + set + " --set logging.dir=" + (dir.path / "run").string());
    INFO(set << "\n" << r.output);
    CHECK(r.code == kExitOom);
    CHECK(r.output.find("cannot fit") != std::string::npos);
    CHECK(r.output.find("physical memory") != std::string::npos);  // no memory.limit: the machine's memory
    CHECK(r.output.find("zero3 over at least") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir.path / "run"));
  }
  // Under memory.limit the limit is the capacity: 8 layers of d=512 (25 M parameters, 400 MB of states).
  auto r = test::trainer("--config configs/tiny.yaml --set model.n_layer=8 --set model.n_embd=512 --set memory.limit=256MiB "
                         "--set logging.dir=" + (dir.path / "run").string());
  INFO(r.output);
  CHECK(r.code == kExitOom);
  CHECK(r.output.find("the memory.limit is 256.0 MiB") != std::string::npos);
}

TEST_CASE("an allocation the system refuses inside the loop is an oom: exit 4, event and summary") {
  // The address-space limit lets the libraries load and the model build, then refuses the
  // activations of a 2048 x 128 micro-batch (several GiB). With and without the tracking allocator.
  const int64_t limit_kib = own_virtual_kib() + (1 << 20) + (1 << 19);  // + 1.5 GiB
  for (const std::string track : {"true", "false"}) {
    test::TempDir dir("as");
    const auto run_dir = dir.path / "run";
    auto r = test::run(fmt::format("cd {} && ulimit -v {} && OMP_NUM_THREADS=1 {} --config configs/tiny.yaml "
                                   "--set train.micro_batch=2048 --set train.steps=2 --set logging.peak_tflops=1 "
                                   "--set memory.track_cpu={} --set logging.dir={}",
                                   test::kSourceDir, limit_kib, test::kTrainer, track, run_dir.string()));
    INFO("track_cpu " << track << "\n" << r.output);
    CHECK(r.code == kExitOom);
    REQUIRE(std::filesystem::exists(run_dir / "summary.json"));
    const auto summary = json::parse(test::read_text(run_dir / "summary.json"));
    CHECK(summary["exit_status"]["code"] == kExitOom);
    CHECK(summary["oom"]["phase"] == "forward");
    const auto recs = read_jsonl(run_dir / "metrics.jsonl");
    REQUIRE_FALSE(recs.empty());
    CHECK(recs.back()["event"] == "oom");
  }
}

TEST_CASE("a second run into the same logging.dir is refused unless logging.overwrite is set") {
  test::TempDir dir("again");
  const auto run_dir = dir.path / "run";
  const std::string args = "--config configs/tiny.yaml --set train.steps=3 --set train.eval_interval=0 "
                           "--set logging.peak_tflops=1 --set logging.dir=" + run_dir.string();
  REQUIRE(test::trainer(args).code == 0);
  const std::string first = test::read_text(run_dir / "metrics.jsonl");
  auto again = test::trainer(args + " --set train.steps=2");
  INFO(again.output);
  CHECK(again.code == kExitConfig);
  CHECK(again.output.find(run_dir.string() + " already holds a run") != std::string::npos);
  CHECK(again.output.find("logging.overwrite") != std::string::npos);
  CHECK(test::read_text(run_dir / "metrics.jsonl") == first);  // untouched
  auto forced = test::trainer(args + " --set train.steps=2 --set logging.overwrite=true");
  CHECK(forced.code == 0);
  const auto records = read_jsonl(run_dir / "metrics.jsonl");
  CHECK(std::count_if(records.begin(), records.end(), [](const json& r) { return !r.contains("event"); }) == 2);
}

TEST_CASE("a write that fails stops the run with exit 7; metrics.jsonl keeps whole records") {
  // RLIMIT_FSIZE (SIGXFSZ ignored) makes writes past the size fail with EFBIG, the first of them
  // part-way through a record, like a file system that fills up. `ulimit -f` counts 512-byte blocks
  // under /bin/sh (dash): 16 blocks (8 KiB): metrics.jsonl fills after ~20 records, summary.json
  // (~5 KiB) still fits; 6 blocks (3 KiB): config.json (~2.1 KiB) fits, summary.json does not.
  for (const int blocks : {16, 6}) {
    test::TempDir dir("full");
    const auto run_dir = dir.path / "run";
    auto r = test::run(fmt::format("cd {} && trap '' XFSZ && ulimit -f {} && OMP_NUM_THREADS=1 {} --config configs/tiny.yaml "
                                   "--set train.steps=200 --set train.micro_batch=1 --set train.seq_len=16 "
                                   "--set train.eval_interval=0 --set logging.peak_tflops=1 --set logging.dir={}",
                                   test::kSourceDir, blocks, test::kTrainer, run_dir.string()));
    INFO(blocks << " blocks of 512 bytes\n" << r.output);
    CHECK(r.code == kExitIo);
    CHECK(r.output.find((run_dir / "metrics.jsonl").string()) != std::string::npos);
    CHECK(r.output.find("File too large") != std::string::npos);
    const std::string text = test::read_text(run_dir / "metrics.jsonl");
    REQUIRE_FALSE(text.empty());
    CHECK(text.back() == '\n');
    const auto recs = read_jsonl(run_dir / "metrics.jsonl");  // throws on a partial record
    CHECK(recs.size() < 200);
    for (const auto& f : files_in(run_dir)) CHECK(f.find(".tmp") == std::string::npos);
    if (blocks == 16) {
      const auto summary = json::parse(test::read_text(run_dir / "summary.json"));
      CHECK(summary["exit_status"]["code"] == kExitIo);
      CHECK(summary["exit_status"]["name"] == "io_error");
      // The step whose record could not be written was trained: it counts, its record is missing.
      CHECK(summary["steps"].get<int64_t>() == static_cast<int64_t>(recs.size()) + 1);
    } else {
      CHECK(r.output.find("summary.json") != std::string::npos);
    }
  }
}

TEST_CASE("fp16 that keeps skipping steps is diverged: exit 6 with a diverged event") {
  test::TempDir dir("fp16div");
  const auto run_dir = dir.path / "run";
  auto r = test::trainer("--config configs/tiny.yaml --set precision.compute=fp16 --set train.lr=1e4 "
                         "--set train.warmup_steps=0 --set train.steps=40 --set train.eval_interval=0 --set train.micro_batch=2 "
                         "--set train.seq_len=32 "
                         "--set precision.max_skipped_steps=4 --set logging.peak_tflops=1 --set logging.dir=" +
                         run_dir.string());
  INFO(r.output);
  CHECK(r.code == kExitNonFinite);
  const auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitNonFinite);
  CHECK(summary["skipped_steps"].get<int64_t>() >= 4);
  CHECK(summary["steps"].get<int64_t>() < 40);
  const auto recs = read_jsonl(run_dir / "metrics.jsonl");
  REQUIRE_FALSE(recs.empty());
  CHECK(recs.back()["event"] == "diverged");
  CHECK(recs.back()["consecutive_skips"] == 4);
}

}  // namespace SUBLINEAR_TEST_FILE
