// logging.memory_timeline: the trainer on configs/tiny.yaml records one step's allocations and frees
// (modes none, full, sqrt; a second step, and a first step whose gradients and moments are made inside
// it). Each memory_timeline.json is consistent (every allocation freed or alive at the end, the running
// total never negative, start and end totals the live bytes), carries the labels of every category
// that step has (per-block activations, recompute per block under checkpointing), and its peak is the
// step's peak_allocated_bytes in metrics.jsonl (and summary.json's, at the peak step). Full
// checkpointing holds fewer activation bytes at its peak than none. scripts/plot_timeline.py draws them.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;

namespace {

// A 3-step tiny run in `mode` recording step `step`; returns its run directory.
std::filesystem::path run_mode(const test::TempDir& dir, const std::string& mode, int step) {
  const auto run_dir = dir.path / fmt::format("{}_{}", mode, step);
  auto r = test::trainer(fmt::format("--config configs/tiny.yaml --set train.steps=3 --set train.eval_interval=0 "
                                     "--set checkpointing.mode={} --set logging.memory_timeline={} --set logging.dir={}",
                                     mode, step, run_dir.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("memory timeline of this step") != std::string::npos);
  return run_dir;
}

// Every block is allocated once (at the start or by an event) and freed at most once; the running
// totals never go negative and end at the file's end totals, which the blocks alive then add up to.
void check_consistent(const json& t) {
  std::map<int64_t, std::pair<int64_t, bool>> live;  // block -> (bytes, host)
  int64_t start_device = 0, start_host = 0;
  for (const auto& b : t["live_at_start"]) {
    const bool host = b[2] == "host";
    REQUIRE(live.emplace(b[0].get<int64_t>(), std::make_pair(b[1].get<int64_t>(), host)).second);
    (host ? start_host : start_device) += b[1].get<int64_t>();
  }
  CHECK(start_device == t["start"]["device_bytes"].get<int64_t>());
  CHECK(start_host == t["start"]["host_bytes"].get<int64_t>());
  int64_t device = start_device, host = start_host, seq = 0, frees = 0;
  const auto col = [&](const std::string& name) {
    const auto& f = t["event_fields"];
    return static_cast<size_t>(std::find(f.begin(), f.end(), name) - f.begin());
  };
  const size_t c_seq = col("seq"), c_block = col("block"), c_bytes = col("bytes"), c_pool = col("pool");
  for (const auto& e : t["events"]) {
    REQUIRE(e[c_seq].get<int64_t>() == seq++);
    const int64_t block = e[c_block].get<int64_t>(), bytes = e[c_bytes].get<int64_t>();
    const bool in_host = e[c_pool] == "host";
    if (bytes > 0) {
      REQUIRE(live.emplace(block, std::make_pair(bytes, in_host)).second);  // a new block, allocated once
    } else {
      const auto it = live.find(block);
      REQUIRE(it != live.end());  // freed once, after its allocation
      REQUIRE(it->second == std::make_pair(-bytes, in_host));
      live.erase(it);
      ++frees;
    }
    (in_host ? host : device) += bytes;
    REQUIRE(device >= 0);
    REQUIRE(host >= 0);
  }
  CHECK(frees > 0);
  int64_t end_device = 0, end_host = 0;
  for (const auto& [block, b] : live) (b.second ? end_host : end_device) += b.first;
  CHECK(device == t["end"]["device_bytes"].get<int64_t>());
  CHECK(end_device == device);
  CHECK(host == t["end"]["host_bytes"].get<int64_t>());
  CHECK(end_host == host);
}

std::set<std::string> label_names(const json& t) {
  std::set<std::string> out;
  for (const auto& l : t["labels"]) out.insert(l["name"].get<std::string>());
  return out;
}

// Device bytes at the peak held by labels of `kind`.
int64_t at_peak(const json& t, const std::string& kind) {
  int64_t bytes = 0;
  for (const auto& [id, b] : t["peak"]["by_label"].items())
    if (t["labels"][static_cast<size_t>(std::stoi(id))]["kind"] == kind) bytes += b.get<int64_t>();
  return bytes;
}

// Bytes alive at the start with labels of `kind`.
int64_t at_start(const json& t, const std::string& kind) {
  int64_t bytes = 0;
  for (const auto& b : t["live_at_start"])
    if (t["labels"][b[3].get<size_t>()]["kind"] == kind) bytes += b[1].get<int64_t>();
  return bytes;
}

// The recorded step's metrics.jsonl record, the memory_timeline event, and summary.json agree with it.
void check_peak(const std::filesystem::path& run_dir, const json& t) {
  const int64_t peak = t["peak"]["device_bytes"].get<int64_t>();
  CHECK(peak == t["allocator_peak_bytes"].get<int64_t>());
  int64_t step_peak = -1, max_peak = 0;
  bool event = false;
  for (const auto& rec : test::read_jsonl(run_dir / "metrics.jsonl")) {
    if (rec.contains("event")) {
      if (rec["event"] == "memory_timeline") {
        event = true;
        CHECK(rec["peak_bytes"].get<int64_t>() == peak);
        CHECK(rec["path"].get<std::string>() == (run_dir / "memory_timeline.json").string());
      }
      continue;
    }
    max_peak = std::max(max_peak, rec["peak_allocated_bytes"].get<int64_t>());
    if (rec["step"] == t["step"]) step_peak = rec["peak_allocated_bytes"].get<int64_t>();
  }
  CHECK(event);
  CHECK(step_peak == peak);
  const json summary = json::parse(test::read_text(run_dir / "summary.json"));
  // After step 1 (which creates AdamW's moments) every step allocates alike: the recorded step's peak is
  // the run's, summary.json's.
  if (t["step"].get<int>() > 1) {
    CHECK(step_peak == max_peak);
    CHECK(summary["peak_allocated_bytes"].get<int64_t>() == peak);
  }
}

}  // namespace

TEST_CASE("memory_timeline.json of none, full and sqrt: consistent, labelled, its peak the step's") {
  test::TempDir dir("timeline");
  std::map<std::string, json> timelines;
  std::vector<std::string> paths;
  for (const auto& [mode, step] : std::vector<std::pair<std::string, int>>{{"none", 2}, {"full", 2}, {"sqrt", 1}}) {
    INFO(mode << " step " << step);
    const auto run_dir = run_mode(dir, mode, step);
    const json t = json::parse(test::read_text(run_dir / "memory_timeline.json"));
    REQUIRE(t["version"] == 1);
    REQUIRE(t["step"] == step);
    check_consistent(t);
    check_peak(run_dir, t);

    const auto names = label_names(t);
    for (const char* want : {"weights", "gradients", "optimizer_state", "input", "loss", "activations/embeddings",
                             "activations/block 0", "activations/block 3", "activations/head", "backward/block 0"})
      CHECK(names.count(want) == 1);
    if (mode != "none")
      for (const char* want : {"recompute/block 0", "recompute/block 1"}) CHECK(names.count(want) == 1);  // the last is kept
    for (const auto& k : t["label_kinds"]) CHECK(!k["meaning"].get<std::string>().empty());
    std::set<std::string> phase_names;
    for (const auto& p : t["phases"]) phase_names.insert(p["name"].get<std::string>());
    for (const char* want : {"forward", "backward block 3", "backward block 0", "optimizer"}) CHECK(phase_names.count(want) == 1);

    // Model states are known by their storage, at the start (step 2) or the end (step 1: made in it).
    const int64_t weights = at_start(t, "weights");
    CHECK(weights > 0);
    if (step > 1) {
      CHECK(at_start(t, "gradients") == weights);
      CHECK(at_start(t, "optimizer_state") == 2 * weights);
      CHECK(at_start(t, "other") < weights / 10);  // little alive before the step is not a model state
    }
    CHECK(at_peak(t, "gradients") == weights);
    CHECK(at_peak(t, "optimizer_state") == (step > 1 ? 2 * weights : 0));  // step 1: the moments come after the peak
    timelines[mode] = t;
    paths.push_back((run_dir / "memory_timeline.json").string());
  }
  // Full keeps one input per block; none keeps every block's internals.
  CHECK(at_peak(timelines["full"], "activations") < at_peak(timelines["none"], "activations"));
  CHECK(timelines["full"]["peak"]["device_bytes"].get<int64_t>() < timelines["none"]["peak"]["device_bytes"].get<int64_t>());

  const auto png = dir.path / "timeline.png";
  auto r = test::run(fmt::format("{} {}/scripts/plot_timeline.py {} {} {} -o {} 2>&1", test::kPython, test::kSourceDir,
                                 paths[0], paths[1], paths[2], png.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(std::filesystem::exists(png));
  CHECK(test::read_text(png).substr(1, 3) == "PNG");
}

TEST_CASE("logging.memory_timeline is refused below 0 and off the CPU") {
  test::TempDir dir("timeline_bad");
  auto r = test::trainer("--config configs/tiny.yaml --set logging.memory_timeline=-1 --set logging.dir=" +
                         (dir.path / "a").string());
  CHECK(r.code == 2);
  CHECK(r.output.find("logging.memory_timeline") != std::string::npos);
  r = test::trainer("--config configs/tiny.yaml --set logging.memory_timeline=1 --set memory.track_cpu=false "
                    "--set logging.dir=" + (dir.path / "b").string());
  CHECK(r.code == 2);
  CHECK(r.output.find("logging.memory_timeline") != std::string::npos);
}

}  // namespace SUBLINEAR_TEST_FILE
