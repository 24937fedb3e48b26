// Durable training state, the rules around resuming (the exactness under kill -9 and re-sharding is
// tests/test_resume.cpp):
//  - a recipe that changes the math is refused (exit 2) naming every changed key with its saved and
//    new value, and leaves the run directory alone; keys that do not change the math may change;
//  - a corrupt or truncated newest state is skipped by --resume auto (with a warning) and the run is
//    still bitwise the uninterrupted one; --resume PATH of a corrupt state exits 2 naming the file;
//    without `latest` the newest valid state is found;
//  - a disk that fills up during a save (synchronous, or asynchronous: found after a later step) stops
//    the run with exit 7, names the system error and the intact earlier state, leaves no temporary
//    directory, and that earlier state still loads;
//  - state.async: the background saves are byte for byte the synchronous ones, logged with their
//    snapshot; a kill -9 while one is written leaves the previous state newest and resumes bitwise;
//    a snapshot past memory.host_limit on one rank stops every rank with exit 4, leaving nothing behind;
//  - SIGTERM / SIGINT finish the step, save (reason "signal") and exit 143 / 130; resuming is bitwise;
//  - --resume auto on a fresh directory starts at step 0; on a finished run it trains nothing;
//  - the files are plain safetensors: the reference package reads every tensor, meta.json's CRC-32 is
//    zlib.crc32 of each file, and param/wte is bitwise the final weights' (model/model.safetensors);
//  - a same-step save replaces the old one only once it is in place (a failure puts the old back, a
//    crash mid-replacement is finished by recover_replaced);
//  - meta.json's own CRC-32 catches a changed value (--resume PATH exits 2 naming it, auto skips it),
//    format-1 states without it still load; pieces that hold the same elements twice are refused;
//  - --resume PATH from an earlier state moves the later ones into <root>/abandoned/, naming each, and the
//    abandoned trajectory's final weights (model/ of a later step) with them; trainer export and sample
//    then read the resumed trajectory's newest state and name its step;
//  - a snapshot past memory.host_limit is summary.json's oom (host memory, phase state_snapshot).
#include <sys/mount.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <torch/cuda.h>

#include "device/host.h"
#include "memory/tracking_allocator.h"
#include "examples_data.h"
#include "recipes.h"
#include "state/safetensors.h"
#include "state/state.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 12;
// tests/recipes.h's tiny state recipe at 2 layers (fp32, dropout 0.1, accumulation 2).
const std::string kArgs = "--config configs/tiny.yaml --set model.n_layer=2 " + test::recipe_tiny_state(kSteps).sets();

std::string dir_arg(const fs::path& run_dir) { return " --set logging.dir=" + run_dir.string(); }
std::string step_name(int step) { return fmt::format("step-{:08d}", step); }
bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

test::Result run_ok(const std::string& args) {
  auto r = test::trainer(args);
  INFO(args << "\n" << r.output);
  REQUIRE(r.code == 0);
  return r;
}

uint32_t test_seed() {
  static const uint32_t seed = [] {
    if (const char* s = std::getenv("SUBLINEAR_TEST_SEED")) return static_cast<uint32_t>(std::stoul(s));
    return std::random_device{}();
  }();
  return seed;
}
int random_in(int lo, int hi) {
  static std::mt19937 g(test_seed());
  return std::uniform_int_distribution<int>(lo, hi)(g);
}

// The uninterrupted run of kArgs that never saves a state (made once per test executable).
// Its step records and evals.
const test::RunTrace& reference() {
  static test::TempDir dir("state-ref");
  static const test::RunTrace t = [] {
    run_ok(kArgs + " --set state.every=0 --set state.at_end=false" + dir_arg(dir.path / "run"));
    CHECK_FALSE(fs::exists(dir.path / "run" / "state"));
    return test::trace(dir.path / "run" / "metrics.jsonl");
  }();
  REQUIRE(t.steps.size() == static_cast<size_t>(kSteps));
  REQUIRE(t.evals.size() == 3);  // steps 5, 10 and the end
  return t;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Offset of the first tensor byte of a safetensors file (8-byte header length, then the header).
uint64_t data_offset(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char b[8] = {};
  in.read(reinterpret_cast<char*>(b), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return 8 + n;
}

void flip_byte(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x01));
}

}  // namespace

TEST_CASE("--resume refuses a recipe that changes the math, naming each key; other keys may change") {
  test::TempDir dir("state-recipe");
  const auto run = dir.path / "run";
  run_ok(kArgs + dir_arg(run));  // saves at the end (step 12)
  const auto saved = run / "state" / step_name(kSteps);
  REQUIRE(fs::exists(saved / "meta.json"));
  const std::string metrics_before = test::read_text(run / "metrics.jsonl");
  const auto state_before = names_in(run / "state");

  struct Refusal {
    std::string sets;
    std::vector<std::string> named;  // "key (saved X, now Y)", values as JSON
  };
  const std::vector<Refusal> refusals = {
      {"--set model.n_embd=64", {"model.n_embd (saved 128, now 64)"}},
      {"--set train.seq_len=32", {"train.seq_len (saved 64, now 32)"}},
      {"--set train.seed=7", {"train.seed (saved 1337, now 7)"}},
      {"--set precision.compute=bf16", {"precision.compute (saved \"fp32\", now \"bf16\")"}},
      {"--set train.micro_batch=8", {"train.global_batch (saved 8, now 16)"}},  // 8 x 2 x 1 rank
      {"--set model.dropout=0.0", {"model.dropout (saved 0.1, now 0.0)"}},
      // Several keys at once: every one is named.
      {"--set train.seed=7 --set train.lr=0.01 --set model.n_layer=3",
       {"train.seed (saved 1337, now 7)", "train.lr (saved 0.003, now 0.01)", "model.n_layer (saved 2, now 3)"}},
  };
  for (const auto& ref : refusals) {
    for (const std::string& resume : {std::string("auto"), saved.string()}) {
      const auto r = test::trainer(kArgs + " " + ref.sets + dir_arg(run) + " --resume " + resume);
      INFO(ref.sets << " --resume " << resume << "\n" << r.output);
      CHECK(r.code == 2);
      for (const auto& n : ref.named) CHECK(has(r.output, n));
      if (resume != "auto") break;  // PATH once is enough (the same check)
    }
  }
  // A refused resume leaves the run directory alone.
  CHECK(test::read_text(run / "metrics.jsonl") == metrics_before);
  CHECK(names_in(run / "state") == state_before);

  // Keys that do not change the math: each resumes (into its own run directory).
  const std::vector<std::string> allowed = {
      "--set train.steps=14",  // extends the run by two steps
      "--set logging.interval=3",
      "--set train.eval_interval=4",
      "--set state.every=1",
      "--set state.keep=5",
      "--set train.micro_batch=2 --set train.grad_accum=4",  // the same global batch
      "--set checkpointing.mode=full",
  };
  int n = 0;
  for (const auto& sets : allowed) {
    const auto to = dir.path / fmt::format("allowed{}", n++);
    const auto r = test::trainer(kArgs + " " + sets + dir_arg(to) + " --resume " + saved.string());
    INFO(sets << "\n" << r.output);
    CHECK(r.code == 0);
    const auto resumes = test::events(to / "metrics.jsonl", "resume");
    REQUIRE(resumes.size() == 1);
    CHECK(resumes[0]["step"] == kSteps);
    const auto recs = test::step_records(to / "metrics.jsonl");
    if (has(sets, "train.steps=14")) {
      REQUIRE(recs.size() == 2);
      CHECK(recs[0].step == 13);
      CHECK(recs[1].step == 14);
    } else {
      CHECK(recs.empty());
    }
  }
}

TEST_CASE("--resume with another model.vocab_multiple (other table sizes) exits 2 naming the parameter and the key, "
          "either way round") {
  test::TempDir dir("state-vocab");
  using Pair = std::pair<std::string, std::string>;  // (saved with, resumed with) model.vocab_multiple
  for (const auto& [saved_with, resumed_with] : {Pair{"1", "384"}, Pair{"384", "1"}}) {
    const auto run = dir.path / ("saved" + saved_with);
    run_ok(kArgs + " --set train.steps=2 --set model.vocab_multiple=" + saved_with + dir_arg(run));
    const std::string metrics_before = test::read_text(run / "metrics.jsonl");
    const auto r = test::trainer(kArgs + " --set train.steps=3 --set model.vocab_multiple=" + resumed_with + dir_arg(run) +
                                 " --resume auto");
    INFO(r.output);
    CHECK(r.code == 2);
    // wte: 256 x 128 elements unpadded, 384 x 128 padded (vocabulary 256 to a multiple of 384).
    const std::string saved_n = saved_with == "1" ? "32768" : "49152", now_n = saved_with == "1" ? "49152" : "32768";
    CHECK(has(r.output, "parameter wte has " + saved_n + " elements in the saved state but " + now_n));
    CHECK(has(r.output, "model.vocab_multiple"));
    CHECK(test::read_text(run / "metrics.jsonl") == metrics_before);  // nothing trained
  }
}

TEST_CASE("a corrupt or truncated newest state is skipped by --resume auto; --resume PATH of it exits 2") {
  const auto& want = reference();
  test::TempDir dir("state-corrupt");
  const auto run = dir.path / "run";
  const std::string args = kArgs + " --set state.every=4" + dir_arg(run);  // keeps steps 8 and 12
  const auto first = run_ok(args);
  const auto root = run / "state";
  CHECK(names_in(root) == std::vector<std::string>{"latest", step_name(8), step_name(12)});
  // Nothing is deleted without a log line naming it: state.keep 2 removed step 4.
  CHECK(has(first.output, "state.keep 2: removing the older state " + (root / step_name(4)).string()));
  CHECK(test::read_text(root / "latest") == step_name(12) + "\n");
  // The saves did not perturb the run: bitwise the run that never saved.
  CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
  const auto newest = root / step_name(12) / "rank-00000.safetensors";
  const auto size = fs::file_size(newest);

  // Resumes with --resume auto from step 8 (the newest is unusable): warns, retrains 9..12 bitwise.
  auto resume_auto_from_8 = [&](const std::string& why) {
    const auto r = run_ok(args + " --resume auto");
    INFO(r.output);
    CHECK(has(r.output, "skipping state " + (root / step_name(12)).string()));
    CHECK(has(r.output, why));
    const auto resumes = test::events(run / "metrics.jsonl", "resume");
    REQUIRE(!resumes.empty());
    CHECK(resumes.back()["step"] == 8);
    CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
    // Step 12 was saved again, whole.
    CHECK(fs::file_size(newest) == size);
    CHECK(test::read_text(root / "latest") == step_name(12) + "\n");
  };
  // --resume PATH of the broken state (a step directory or the state root whose `latest` names it).
  auto resume_path_fails = [&](const fs::path& path, const std::string& why) {
    const auto r = test::trainer(args + " --resume " + path.string());
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, newest.string()));
    CHECK(has(r.output, why));
  };

  SECTION("one flipped byte in the tensor data") {
    flip_byte(newest, data_offset(newest) + 1000);
    resume_path_fails(root / step_name(12), "CRC-32");
    resume_path_fails(root, "CRC-32");
    resume_path_fails(run, "CRC-32");
    resume_auto_from_8("CRC-32");
  }
  SECTION("a truncated rank file") {
    fs::resize_file(newest, size / 2);
    resume_path_fails(root / step_name(12), "truncated");
    resume_auto_from_8("truncated");
  }
  SECTION("a missing rank file") {
    fs::remove(newest);
    resume_path_fails(root / step_name(12), "missing");
    resume_auto_from_8("missing");
  }
  SECTION("no `latest`: --resume auto still takes the newest valid state") {
    fs::remove(root / "latest");
    const auto r = run_ok(args + " --resume auto");
    const auto resumes = test::events(run / "metrics.jsonl", "resume");
    REQUIRE(resumes.size() == 1);
    CHECK(resumes[0]["step"] == 12);
    CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
    // And with the newest corrupt as well: step 8, bitwise.
    fs::remove(root / "latest");
    flip_byte(newest, data_offset(newest) + 4);
    resume_auto_from_8("CRC-32");
  }
  SECTION("every state unusable: --resume auto refuses (exit 2) instead of starting over") {
    const std::string before = test::read_text(run / "metrics.jsonl");
    flip_byte(newest, data_offset(newest) + 1000);
    fs::remove(root / step_name(8) / "meta.json");
    const auto r = test::trainer(args + " --resume auto");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "none of the 2 states under " + root.string() + " is usable"));
    CHECK(test::read_text(run / "metrics.jsonl") == before);  // the logs are untouched
  }
}

TEST_CASE("a disk that fills up during a save: exit 7, the earlier state intact and loadable, no temporary left", "[diskfull]") {
  test::TempDir dir("state-full");
  // The size of one state of this recipe.
  const auto probe = dir.path / "probe";
  run_ok(kArgs + " --set train.steps=1" + dir_arg(probe));
  const auto saved = test::events(probe / "metrics.jsonl", "state_saved");
  REQUIRE(saved.size() == 1);
  const int64_t bytes = saved[0]["bytes"].get<int64_t>();
  REQUIRE(bytes > 1000000);
  // Room for two states and a half: the saves of steps 2 and 4 fit; at step 6 the states of 2 and 4
  // are still there (state.keep 2 prunes after a save completes) and the third cannot be written.
  for (const bool async : {false, true}) {
    INFO("state.async " << async);
    const std::string tag = async ? "async" : "sync";
    test::TmpfsMount mnt(dir.path / ("mnt-" + tag), std::to_string(2 * bytes + bytes / 2 + (64 << 10)));
    if (!mnt.mounted) {
      const std::string why = "cannot mount a tmpfs (" + mnt.error + "; needs root with CAP_SYS_ADMIN): disk-full case not run";
      SUBLINEAR_SKIP(why);
    }
    const auto run = dir.path / ("run-" + tag);
    const std::string args = kArgs + " --set state.every=2 --set state.dir=" + mnt.dir.string() +
                             " --set state.async=" + (async ? "true" : "false");
    const auto r = test::trainer(args + dir_arg(run));
    INFO(r.output);
    CHECK(r.code == 7);
    CHECK(has(r.output, "saving the training state after step 6 failed"));
    CHECK(has(r.output, "No space left on device"));
    CHECK(has(r.output, "The state of step 4 is intact"));
    // No temporary directory left; the earlier states and `latest` as they were.
    CHECK(names_in(mnt.dir) == std::vector<std::string>{"latest", step_name(2), step_name(4)});
    CHECK(test::read_text(mnt.dir / "latest") == step_name(4) + "\n");
    const auto summary = json::parse(test::read_text(run / "summary.json"));
    CHECK(summary["exit_status"]["code"] == 7);
    // The log stops at step 6 (synchronous), or where the background write's failure was found: after
    // a later step, before the next save; the failed save is not recorded as saved.
    const auto recs = test::step_records(run / "metrics.jsonl");
    REQUIRE(!recs.empty());
    if (async) {
      CHECK(recs.back().step >= 6);
      CHECK(recs.back().step <= 8);
    } else {
      CHECK(recs.back().step == 6);
    }
    for (const auto& e : test::events(run / "metrics.jsonl", "state_saved")) CHECK(e["step"].get<int64_t>() <= 4);

    // The intact state loads (its checks pass and the model takes it) with train.steps = its step.
    const auto step4 = mnt.dir / step_name(4);
    const auto again = test::trainer(kArgs + " --set train.steps=4" + dir_arg(dir.path / ("reload-" + tag)) + " --resume " +
                                     step4.string());
    INFO(again.output);
    CHECK(again.code == 0);
    const auto resumes = test::events(dir.path / ("reload-" + tag) / "metrics.jsonl", "resume");
    REQUIRE(resumes.size() == 1);
    CHECK(resumes[0]["step"] == 4);
    // And the reference reader agrees it is whole.
    const auto check = test::state_compare("check " + step4.string());
    INFO(check.output);
    CHECK(check.code == 0);
  }
}

TEST_CASE("SIGTERM and SIGINT: the step finishes, the state is saved, exit 143 / 130; resuming is bitwise") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  const auto& want = reference();
  test::TempDir dir("state-signal");
  for (const auto& [sig, code] : {std::pair{SIGTERM, 143}, std::pair{SIGINT, 130}}) {
    INFO("signal " << sig);
    const auto run = dir.path / fmt::format("run{}", sig);
    const std::string args = kArgs + dir_arg(run);  // state.every 0: a state only on the signal (or at the end)
    const int k = random_in(2, kSteps - 2);
    INFO("signal after " << k << " step records");
    {
      auto p = test::trainer_background(args, dir.path / fmt::format("run{}.log", sig));
      REQUIRE(p->running());
      REQUIRE(test::poll_until([&] { return test::step_records_now(run / "metrics.jsonl") >= static_cast<size_t>(k) || p->exited(); },
                               std::chrono::seconds(120)));
      p->signal(sig);
      const int rc = p->wait();
      INFO(p->output());
      CHECK(rc == code);
      CHECK(has(p->output(), "state saved (signal)"));
    }
    const auto recs = test::step_records(run / "metrics.jsonl");
    REQUIRE(!recs.empty());
    CHECK(recs.size() < static_cast<size_t>(kSteps));  // stopped early
    const auto saved = test::events(run / "metrics.jsonl", "state_saved");
    REQUIRE(saved.size() == 1);
    CHECK(saved[0]["reason"] == "signal");
    CHECK(saved[0]["step"] == recs.back().step);  // the last finished step
    CHECK(json::parse(test::read_text(run / "summary.json"))["exit_status"]["code"] == code);

    run_ok(args + " --resume auto");
    const auto resumes = test::events(run / "metrics.jsonl", "resume");
    REQUIRE(resumes.size() == 1);
    CHECK(resumes[0]["step"] == recs.back().step);
    CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
  }
}

TEST_CASE("--resume auto: a fresh directory starts at step 0, a finished run trains nothing") {
  const auto& want = reference();
  test::TempDir dir("state-fresh");
  const auto run = dir.path / "run";
  const auto first = run_ok(kArgs + dir_arg(run) + " --resume auto");
  CHECK(has(first.output, "no saved state"));
  CHECK(test::events(run / "metrics.jsonl", "resume").empty());
  CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
  const auto saves = test::events(run / "metrics.jsonl", "state_saved");
  REQUIRE(saves.size() == 1);
  CHECK(saves[0]["reason"] == "end");
  CHECK(saves[0]["step"] == kSteps);

  const auto again = run_ok(kArgs + dir_arg(run) + " --resume auto");
  const auto resumes = test::events(run / "metrics.jsonl", "resume");
  REQUIRE(resumes.size() == 1);
  CHECK(resumes[0]["step"] == kSteps);
  CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");  // no new step records
  CHECK(test::events(run / "metrics.jsonl", "state_saved").size() == 1);            // nothing saved again
  CHECK(names_in(run / "state") == std::vector<std::string>{"latest", step_name(kSteps)});
}

// README: "No state at all: the run starts at step 0, so the same command line serves the first launch
// and every restart." A run killed before its first save leaves metrics.jsonl but no state.
TEST_CASE("--resume auto after a kill before the first save starts again at step 0") {
  INFO("seed " << test_seed() << " (SUBLINEAR_TEST_SEED replays it)");
  const auto& want = reference();
  test::TempDir dir("state-early-kill");
  const auto run = dir.path / "run";
  const std::string args = kArgs + dir_arg(run);  // state.every 0: the only save would be at the end
  const int k = random_in(2, kSteps - 2);
  {
    auto p = test::trainer_background(args, dir.path / "killed.log");
    REQUIRE(test::poll_until([&] { return test::step_records_now(run / "metrics.jsonl") >= static_cast<size_t>(k) || p->exited(); },
                             std::chrono::seconds(120)));
    p->signal(SIGKILL);
    p->wait();
    REQUIRE(p->killed_by(SIGKILL));
  }
  REQUIRE_FALSE(fs::exists(run / "state" / "latest"));
  const auto r = test::trainer(args + " --resume auto");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
}

TEST_CASE("the state files are plain safetensors: the reference package reads them, CRC-32 is zlib's") {
  test::TempDir dir("state-interop");
  const auto run = dir.path / "run";
  run_ok(kArgs + " --set logging.save_model=true" + dir_arg(run));
  const auto state = run / "state" / step_name(kSteps);
  const auto meta = json::parse(test::read_text(state / "meta.json"));
  CHECK(meta["step"] == kSteps);
  CHECK(meta["world_size"] == 1);
  CHECK(meta["sharding"] == "none");
  CHECK(meta["math_hash"].get<std::string>().size() == 8);
  CHECK(meta["recipe"]["model"]["n_layer"] == 2);
  CHECK(meta["math"]["train.global_batch"] == 8);

  const auto r = test::state_compare("check " + state.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto summary = json::parse(r.output.substr(r.output.find('{')));
  // meta.json's bytes and crc32 are the file's size and zlib.crc32 (the script computed them).
  REQUIRE(summary["files"].size() == 1);
  CHECK(summary["files"][0]["name"] == "rank-00000.safetensors");
  CHECK(summary["files"][0]["crc32"] == meta["files"][0]["crc32"]);
  CHECK(summary["files"][0]["bytes"] == meta["files"][0]["bytes"]);
  CHECK(summary["files"][0]["bytes"].get<int64_t>() == static_cast<int64_t>(fs::file_size(state / "rank-00000.safetensors")));
  // Every parameter whole, with both moments, and the RNG.
  const size_t params = summary["params"].size();
  CHECK(params == 28);  // 2 blocks x 12 + wte, wpe, lnf_w, lnf_b
  CHECK(summary["whole_tensors"] == 3 * params);
  CHECK(summary["ranged_tensors"] == 0);
  CHECK(summary["tensors"] == 3 * params + 1);
  CHECK(summary["rng"] == json::array({"rank-00000.safetensors:rng/cpu"}));

  // param/wte, read by the reference package, is bitwise the final parameter in model/model.safetensors.
  const auto raw = dir.path / "wte.f32";
  const auto d = test::state_compare("dump " + state.string() + " param/wte " + raw.string());
  INFO(d.output);
  REQUIRE(d.code == 0);
  const state::SafetensorsFile final_weights(run / "model" / "model.safetensors");
  const torch::Tensor wte = final_weights.view("transformer.wte.weight").contiguous();
  const std::string bytes = test::read_text(raw);
  REQUIRE(bytes.size() == static_cast<size_t>(wte.numel()) * 4);
  CHECK(std::memcmp(bytes.data(), wte.data_ptr<float>(), bytes.size()) == 0);
}

// ---- replacing, checking and setting aside whole states ----

namespace {

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

}  // namespace

TEST_CASE("install_state_dir replaces a same-step save only once the new one is in place; recover_replaced finishes a cut-short replacement") {
  test::TempDir dir("state-install");
  const auto root = dir.path / "state";
  const auto step5 = root / step_name(5);
  write_text(step5 / "a", "old");

  SECTION("a new save of the same step replaces the old; nothing is left beside it") {
    write_text(root / ".new.tmp" / "a", "new");
    state::install_state_dir(root / ".new.tmp", step5);
    CHECK(test::read_text(step5 / "a") == "new");
    CHECK(names_in(root) == std::vector<std::string>{step_name(5)});
  }
  SECTION("a replacement that cannot be put in place leaves the old save where it was, and says so") {
    try {
      state::install_state_dir(root / ".missing.tmp", step5);
      FAIL("install_state_dir of a missing directory returned");
    } catch (const IoError& e) {
      INFO(e.what());
      CHECK(has(e.what(), (root / ".missing.tmp").string()));
      CHECK(has(e.what(), "is back in place"));
    }
    CHECK(test::read_text(step5 / "a") == "old");
    CHECK(names_in(root) == std::vector<std::string>{step_name(5)});
  }
  SECTION("after a crash between moving the old aside and putting the new in place, the old goes back") {
    fs::rename(step5, root / ("." + step_name(5) + ".old"));
    state::recover_replaced(root);
    CHECK(test::read_text(step5 / "a") == "old");
    CHECK(names_in(root) == std::vector<std::string>{step_name(5)});
  }
  SECTION("after a crash once the new one was in place, the old copy is removed and the new kept") {
    write_text(root / ("." + step_name(5) + ".old") / "a", "older");
    state::recover_replaced(root);
    CHECK(test::read_text(step5 / "a") == "old");
    CHECK(names_in(root) == std::vector<std::string>{step_name(5)});
  }
}

TEST_CASE("meta.json carries its own CRC-32: a changed value is refused by --resume PATH and skipped by --resume auto") {
  const auto& want = reference();
  test::TempDir dir("state-meta");
  const auto run = dir.path / "run";
  const std::string args = kArgs + " --set state.every=4" + dir_arg(run);  // keeps steps 8 and 12
  run_ok(args);
  const auto root = run / "state";
  const auto meta_path = root / step_name(12) / "meta.json";
  json meta = json::parse(test::read_text(meta_path));
  REQUIRE(meta.at("format_version") == state::kFormatVersion);
  REQUIRE(meta.contains("meta_crc32"));

  SECTION("AdamW's step count changed by one: exit 2 naming meta.json; auto resumes from step 8, bitwise") {
    meta["optimizer"]["adamw_step"] = meta["optimizer"]["adamw_step"].get<int64_t>() + 1;
    std::ofstream(meta_path) << meta.dump(2);
    const auto r = test::trainer(args + " --resume " + (root / step_name(12)).string());
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, meta_path.string()));
    CHECK(has(r.output, "meta_crc32"));
    const auto a = run_ok(args + " --resume auto");
    INFO(a.output);
    CHECK(has(a.output, "skipping state " + (root / step_name(12)).string()));
    const auto resumes = test::events(run / "metrics.jsonl", "resume");
    REQUIRE(!resumes.empty());
    CHECK(resumes.back()["step"] == 8);
    CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");
  }
  SECTION("a format-1 meta.json (written before the checksum existed) is still read") {
    meta["format_version"] = 1;
    meta.erase("meta_crc32");
    std::ofstream(meta_path) << meta.dump(2);
    const auto r = run_ok(args + " --resume " + (root / step_name(12)).string());
    const auto resumes = test::events(run / "metrics.jsonl", "resume");
    REQUIRE(!resumes.empty());
    CHECK(resumes.back()["step"] == 12);
  }
}

TEST_CASE("a state whose files hold the same elements twice is refused, naming the overlap") {
  test::TempDir dir("state-overlap");
  const auto a = torch::arange(0, 6, torch::kFloat32), b = torch::arange(100, 106, torch::kFloat32);
  state::write_safetensors(dir.path / "rank-00000.safetensors", {{"param/w/0:6", a}});
  state::write_safetensors(dir.path / "rank-00001.safetensors", {{"param/w/4:10", b}});
  const json meta = {{"files", {{{"name", "rank-00000.safetensors"}}, {{"name", "rank-00001.safetensors"}}}}};
  const state::Reader reader(dir.path, meta);
  torch::Tensor dst = torch::zeros({10});
  // Either half alone reads fine: the overlap is only a problem for a range that spans it.
  reader.read("param", {"w", 0, 4, {}}, dst.narrow(0, 0, 4));
  CHECK(torch::equal(dst.narrow(0, 0, 4), a.narrow(0, 0, 4)));
  try {
    reader.read("param", {"w", 0, 10, {}}, dst);
    FAIL("an overlapping read returned");
  } catch (const state::StateFileError& e) {
    INFO(e.what());
    CHECK(has(e.what(), "more than once"));
    CHECK(has(e.what(), "[4, 6)"));
  }
}

TEST_CASE("--resume PATH from an earlier state sets the later states aside in abandoned/; --resume auto then follows the new run") {
  const auto& want = reference();
  test::TempDir dir("state-abandon");
  const auto run = dir.path / "run";
  const std::string args = kArgs + " --set state.every=3 --set state.keep=0" + dir_arg(run);  // 3, 6, 9, 12
  run_ok(args);
  const auto root = run / "state";
  const std::vector<std::string> all = {"latest", step_name(3), step_name(6), step_name(9), step_name(12)};
  REQUIRE(names_in(root) == all);

  const auto r = run_ok(args + " --resume " + (root / step_name(3)).string());
  INFO(r.output);
  for (const int step : {6, 9, 12}) {
    CHECK(has(r.output, (root / step_name(step)).string() + " is from a trajectory this run abandons"));
    CHECK(fs::exists(root / "abandoned" / step_name(step) / "meta.json"));
  }
  CHECK(names_in(root / "abandoned") == std::vector<std::string>{step_name(6), step_name(9), step_name(12)});
  // The new trajectory's states are in place and `latest` names its newest; the run is bitwise the
  // uninterrupted one (the abandoned trajectory was the same math, so this checks the resume too).
  std::vector<std::string> now = all;
  now.insert(now.begin(), "abandoned");
  CHECK(names_in(root) == now);
  CHECK(test::read_text(root / "latest") == step_name(12) + "\n");
  CHECK(test::trace_diff(test::trace(run / "metrics.jsonl"), want) == "");

  // --resume auto sees only the new trajectory: it resumes from the new step 12 and moves nothing.
  const auto a = run_ok(args + " --resume auto");
  INFO(a.output);
  CHECK_FALSE(has(a.output, "abandons"));
  const auto resumes = test::events(run / "metrics.jsonl", "resume");
  REQUIRE(!resumes.empty());
  CHECK(resumes.back()["step"] == 12);
  CHECK(names_in(root / "abandoned").size() == 3);
}

TEST_CASE("examples: a run resumed from its step-3 state is bitwise the uninterrupted one (the epoch's order and "
          "position, the trained-token count)") {
  test::TempDir dir("state-examples");
  // 13 examples, 4 rows a step: the epochs end mid-step (rows 13 and 26), and step 3 starts in the first.
  const auto train = test::write_examples(dir.path, "train", test::varied_examples(13, 65, 256));
  const auto val = test::write_examples(dir.path, "val", test::varied_examples(3, 40, 256, 2));
  const std::string args = fmt::format(
      "--config configs/tiny.yaml --set model.n_layer=2 --set model.dropout=0.1 --set data.source=examples "
      "--set data.path={} --set data.val_path={} --set train.seq_len=64 --set train.micro_batch=2 "
      "--set train.grad_accum=2 --set train.steps=7 --set train.eval_interval=3 --set train.eval_batches=2 "
      "--set state.keep=0", train, val);
  const auto whole = dir.path / "whole", resumed = dir.path / "resumed";
  run_ok(args + " --set state.every=0 --set state.at_end=false" + dir_arg(whole));
  run_ok(args + " --set state.every=3" + dir_arg(resumed));
  run_ok(args + " --set state.every=3 --resume " + (resumed / "state" / step_name(3)).string() + dir_arg(resumed));
  const auto want = test::trace(whole / "metrics.jsonl");
  REQUIRE(want.steps.size() == 7);
  CHECK(test::trace_diff(test::trace(resumed / "metrics.jsonl"), want) == "");
  const auto summary = [](const fs::path& run) { return json::parse(test::read_text(run / "summary.json")); };
  CHECK(summary(resumed)["trained_tokens"] == summary(whole)["trained_tokens"]);
  CHECK(summary(whole)["trained_tokens"].get<int64_t>() < summary(whole)["tokens"].get<int64_t>());
}

namespace {

// meta.json without what differs between two runs' saves of the same state: its checksum and the
// recipe's state.async and logging.dir.
json meta_without_async(const fs::path& dir) {
  json m = json::parse(test::read_text(dir / "meta.json"));
  m.erase("meta_crc32");
  m["recipe"]["state"].erase("async");
  m["recipe"]["logging"].erase("dir");
  return m;
}

}  // namespace

TEST_CASE("state.async: the background saves are the synchronous ones byte for byte; the loop waits for the snapshot only") {
  const auto& want = reference();
  test::TempDir dir("state-async");
  const std::string every = " --set state.every=3 --set state.keep=0";
  const auto async_run = dir.path / "async", sync_run = dir.path / "sync";
  run_ok(kArgs + every + " --set state.async=true" + dir_arg(async_run));
  run_ok(kArgs + every + " --set state.async=false" + dir_arg(sync_run));
  CHECK(test::trace_diff(test::trace(async_run / "metrics.jsonl"), want) == "");

  // Steps 3, 6, 9 and 12 in the background (a snapshot each); the last one is published before the
  // exit, and state.at_end finds step 12 saved.
  const auto snapshots = test::events(async_run / "metrics.jsonl", "state_snapshot");
  REQUIRE(snapshots.size() == 4);
  const auto saved = test::events(async_run / "metrics.jsonl", "state_saved");
  REQUIRE(saved.size() == 4);
  for (size_t i = 0; i < saved.size(); ++i) {
    INFO(saved[i].dump());
    CHECK(saved[i]["step"] == 3 * static_cast<int64_t>(i + 1));
    CHECK(saved[i]["reason"] == "every");
    CHECK(saved[i]["async"] == true);
    CHECK(saved[i]["blocking_ms"].get<double>() <= saved[i]["save_ms"].get<double>());
    CHECK(snapshots[i]["step"] == saved[i]["step"]);
    // The snapshot holds every tensor of the rank file: the file is the snapshot plus its header.
    CHECK(snapshots[i]["snapshot_bytes"].get<int64_t>() < saved[i]["bytes"].get<int64_t>());
    CHECK(snapshots[i]["snapshot_bytes"].get<int64_t>() > saved[i]["bytes"].get<int64_t>() * 99 / 100);
  }
  // One save in flight at a time: each snapshot comes after the previous save's publication.
  int64_t in_flight = -1;
  for (const auto& r : test::read_jsonl(async_run / "metrics.jsonl")) {
    if (r.value("event", "") == "state_snapshot") {
      CHECK(in_flight == -1);
      in_flight = r["step"].get<int64_t>();
    } else if (r.value("event", "") == "state_saved") {
      CHECK(r["step"] == in_flight);
      in_flight = -1;
    }
  }
  CHECK(in_flight == -1);
  for (const auto& e : test::events(sync_run / "metrics.jsonl", "state_saved")) CHECK(e["async"] == false);
  CHECK(test::events(sync_run / "metrics.jsonl", "state_snapshot").empty());

  // The same states: rank files byte for byte, meta.json but for the recipe's state.async.
  CHECK(names_in(async_run / "state") == names_in(sync_run / "state"));
  for (const int step : {3, 6, 9, 12}) {
    INFO("step " << step);
    const auto a = async_run / "state" / step_name(step), b = sync_run / "state" / step_name(step);
    CHECK(test::read_text(a / "rank-00000.safetensors") == test::read_text(b / "rank-00000.safetensors"));
    CHECK(meta_without_async(a) == meta_without_async(b));
  }
  const auto summary = json::parse(test::read_text(async_run / "summary.json"));
  CHECK(summary["state"]["async"] == true);
  CHECK(summary["state"]["saves"] == 4);
  CHECK(summary["state"]["snapshot_bytes"] == snapshots.back()["snapshot_bytes"]);

  // state.keep with background saves: the next save's writer removes the older states, and when no save
  // follows (no state.at_end, the last step not a multiple of state.every) the end of the run does.
  const auto kept_run = dir.path / "kept";
  run_ok(kArgs + " --set state.every=3 --set state.keep=1 --set state.at_end=false --set train.steps=11" + dir_arg(kept_run));
  CHECK(names_in(kept_run / "state") == std::vector<std::string>{"latest", step_name(9)});

  // The planner's host snapshot: 12 bytes per parameter (fp32 weights and two moments) and the RNG
  // states, to the byte.
  const auto plan_file = dir.path / "plan.json";
  const auto plan = test::trainer("plan " + kArgs + every + " --out " + plan_file.string());
  INFO(plan.output);
  REQUIRE(plan.code == 0);
  const int64_t predicted = json::parse(test::read_text(plan_file))["host_snapshot_bytes"].get<int64_t>();
  const int64_t measured = snapshots.back()["snapshot_bytes"].get<int64_t>();
  CHECK(predicted == measured);
  // Without asynchronous saves there is no snapshot to plan for.
  REQUIRE(test::trainer("plan " + kArgs + every + " --set state.async=false --out " + plan_file.string()).code == 0);
  CHECK(json::parse(test::read_text(plan_file))["host_snapshot_bytes"] == 0);
}

// SUBLINEAR_STATE_WRITE_DELAY_MS (state/state.cpp) holds each background save after its rank file is
// written and before it is published, so the kill lands inside a save.
TEST_CASE("state.async: kill -9 while a save is being written leaves the previous state newest; --resume auto is bitwise") {
  const auto& want = reference();
  test::TempDir dir("state-async-kill");
  const auto run = dir.path / "run";
  const std::string args = kArgs + " --set state.every=2 --set state.async=true" + dir_arg(run);
  const auto metrics = run / "metrics.jsonl";
  auto has_event = [&](const std::string& kind, int step) {
    for (const auto& r : test::read_jsonl(metrics, false))
      if (r.is_object() && r.value("event", "") == kind && r.value("step", -1) == step) return true;
    return false;
  };
  {
    auto p = std::make_unique<test::Background>("OMP_NUM_THREADS=1 SUBLINEAR_STATE_WRITE_DELAY_MS=4000",
                                                test::kTrainer + " " + args, dir.path / "killed.log");
    REQUIRE(p->running());
    // Step 2's save published (after its 4 s hold), step 4's file written and held: step 4 is in flight.
    const auto in_flight = run / "state" / ("." + step_name(4) + ".tmp") / "rank-00000.safetensors";
    REQUIRE(test::poll_until([&] { return (has_event("state_saved", 2) && fs::exists(in_flight)) || p->exited(); },
                             std::chrono::seconds(120)));
    CHECK(has_event("state_snapshot", 4));
    REQUIRE(p->running());
    p->signal(SIGKILL);
    p->wait();
    INFO(p->output());
    REQUIRE(p->killed_by(SIGKILL));
  }
  const auto root = run / "state";
  CHECK(test::read_text(root / "latest") == step_name(2) + "\n");
  CHECK_FALSE(fs::exists(root / step_name(4)));
  // The save in flight: its rank file complete, no meta.json.
  CHECK(fs::exists(root / ("." + step_name(4) + ".tmp") / "rank-00000.safetensors"));
  CHECK_FALSE(fs::exists(root / ("." + step_name(4) + ".tmp") / "meta.json"));
  const auto check = test::state_compare("check " + (root / step_name(2)).string());
  INFO(check.output);
  CHECK(check.code == 0);

  run_ok(args + " --resume auto");
  const auto resumes = test::events(metrics, "resume");
  REQUIRE(resumes.size() == 1);
  CHECK(resumes[0]["step"] == 2);
  CHECK(test::trace_diff(test::trace(metrics), want) == "");
  // The resumed run's first save cleared the cut-short one.
  CHECK_FALSE(fs::exists(root / ("." + step_name(4) + ".tmp")));
  CHECK(test::read_text(root / "latest") == step_name(kSteps) + "\n");
  CHECK(names_in(root) == std::vector<std::string>{"latest", step_name(kSteps - 2), step_name(kSteps)});  // state.keep 2
}

TEST_CASE("state.async: a snapshot past memory.host_limit stops every rank with exit 4 naming it; no temporary left") {
  test::TempDir dir("state-async-oom");
  const auto run = dir.path / "run";
  // DDP at world 2: rank 0's file holds the whole state (5.5 MB), rank 1's only its RNG, so only rank 0's
  // snapshot is refused, and rank 1 must not wait for it.
  const auto m = test::launch(2, kArgs + " --set state.every=2 --set memory.host_limit=1MiB" + dir_arg(run));
  INFO(m.outputs[0] << "\n---- rank 1:\n" << m.outputs[1]);
  CHECK(m.codes == std::vector<int>{4, 4});
  CHECK(has(m.outputs[0], "out of host memory for the asynchronous save's snapshot of step 2"));
  CHECK(has(m.outputs[0], "memory.host_limit"));
  CHECK(has(m.outputs[1], "rank 0: state snapshot failed"));
  CHECK(names_in(run / "state").empty());
  CHECK(json::parse(test::read_text(run / "summary.json"))["exit_status"]["code"] == 4);
}

TEST_CASE("state.async: a snapshot past memory.host_limit is an out-of-memory in host memory in summary.json's oom") {
  test::TempDir dir("state-async-oom-record");
  const auto run = dir.path / "run";
  const int64_t limit = int64_t{1} << 20;  // 1 MiB: the model states alone are ~5.5 MB
  const auto r = test::trainer(kArgs + fmt::format(" --set state.every=2 --set memory.host_limit={}", limit) + dir_arg(run));
  INFO(r.output);
  REQUIRE(r.code == 4);
  const json s = json::parse(test::read_text(run / "summary.json"));
  const json& oom = s["oom"];
  REQUIRE(oom.is_object());
  CHECK(oom["memory"] == "host");
  CHECK(oom["phase"] == "state_snapshot");
  CHECK(oom["step"] == 2);  // the snapshot of the state after step 2
  CHECK(oom["limit_bytes"].get<int64_t>() == limit);
  // What was refused did not fit beside what was live (<= the peak): the allocator's rule.
  CHECK(oom["peak_bytes"].get<int64_t>() + oom["requested_bytes"].get<int64_t>() > limit);
  CHECK(has(oom["message"].get<std::string>(), "snapshot of step 2"));
  CHECK(s["exit_status"]["name"] == "out_of_memory");
  CHECK(s["steps"] == 2);
  CHECK(test::events(run / "metrics.jsonl", "oom").size() == 1);
  CHECK(test::events(run / "metrics.jsonl", "error").empty());
}

namespace {

// <dir>/model/model.safetensors as logging.save_model writes it (one tensor; the step in its metadata,
// none when step < 0).
void write_final_weights(const fs::path& run, int64_t step) {
  fs::create_directories(run / "model");
  std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (step >= 0) meta["sublinear_step"] = std::to_string(step);
  state::write_safetensors(run / "model" / "model.safetensors", {{"w", torch::zeros({4})}}, meta);
}

}  // namespace

TEST_CASE("a rollback sets aside final weights past the resumed step (or at it from another state root) and no others") {
  test::TempDir dir("state-aside-weights");
  const auto run = dir.path / "run", root = run / "state", elsewhere = dir.path / "other" / "state";
  const state::Found here{root / step_name(10), 10, nullptr}, other{elsewhere / step_name(10), 10, nullptr};
  fs::create_directories(here.dir);
  fs::create_directories(other.dir);
  struct Case {
    int64_t weights_step;
    const state::Found* resumed;
    bool moved;
  };
  for (const Case& c : {Case{12, &here, true}, Case{10, &here, false}, Case{8, &here, false}, Case{-1, &here, false},
                        Case{10, &other, true}, Case{8, &other, false}}) {
    INFO("final weights of step " << c.weights_step << ", resumed from " << c.resumed->dir);
    fs::remove_all(root / "abandoned");
    fs::remove_all(run / "model");
    write_final_weights(run, c.weights_step);
    CHECK(state::final_weights_step(run / "model" / "model.safetensors") == c.weights_step);
    const fs::path to = state::set_aside_final_weights(run, root, *c.resumed);
    CHECK(fs::exists(run / "model") == !c.moved);
    if (c.moved) {
      CHECK(to == root / "abandoned" / fmt::format("model-{}", step_name(static_cast<int>(c.weights_step))));
      CHECK(state::final_weights_step(to / "model.safetensors") == c.weights_step);
    } else {
      CHECK(to.empty());
    }
  }
  // A second set-aside of the same step keeps the first (numbered, as abandoned states are).
  const auto first = root / "abandoned" / fmt::format("model-{}", step_name(12));
  for (const auto& want : {first, root / "abandoned" / fmt::format("model-{}-2", step_name(12))}) {
    write_final_weights(run, 12);
    CHECK(state::set_aside_final_weights(run, root, here) == want);
  }
  CHECK(fs::exists(first / "model.safetensors"));
}

TEST_CASE("after a rollback trainer export and sample read the resumed trajectory's weights and name their step; the "
          "abandoned final weights are set aside with the abandoned states") {
  test::TempDir dir("state-rollback-export");
  const auto run = dir.path / "run", root = run / "state";
  const std::string args = kArgs + " --set state.every=4 --set state.keep=0" + dir_arg(run);  // states 4, 8, 12
  run_ok(args + " --set logging.save_model=true");
  REQUIRE(state::final_weights_step(run / "model" / "model.safetensors") == kSteps);

  // Roll back to step 4 and end at step 10 without final weights: states 8 and 10 of the new trajectory.
  const auto r = run_ok(args + " --set train.steps=10 --resume " + (root / step_name(4)).string());
  INFO(r.output);
  const auto aside = root / "abandoned" / fmt::format("model-{}", step_name(kSteps));
  CHECK(has(r.output, (run / "model").string() + " (step 12) are from a trajectory this run abandons; moved to " + aside.string()));
  CHECK_FALSE(fs::exists(run / "model"));
  CHECK(state::final_weights_step(aside / "model.safetensors") == kSteps);
  CHECK(fs::exists(root / "abandoned" / step_name(kSteps) / "meta.json"));
  const json s = json::parse(test::read_text(run / "summary.json"));
  CHECK(s["steps"] == 10);
  CHECK(s["final_weights"].is_null());
  CHECK(test::read_text(root / "latest") == step_name(10) + "\n");

  // export: the newest state of the resumed trajectory, named with its step; its weights are that state's.
  const auto out = dir.path / "hf";
  const auto e = test::trainer("export --run " + run.string() + " --out " + out.string());
  INFO(e.output);
  REQUIRE(e.code == 0);
  CHECK(has(e.output, "exported step 10 from " + (root / step_name(10)).string()));
  const state::SafetensorsFile exported(out / "model.safetensors");
  CHECK(exported.metadata().at("sublinear_step") == "10");
  const state::SafetensorsFile saved(root / step_name(10) / "rank-00000.safetensors");
  CHECK(torch::equal(exported.view("transformer.wte.weight"), saved.view("param/wte")));

  // sample: the same weights, named with their step.
  const auto g = test::trainer("sample --run " + run.string() + " --prompt the --max-new-tokens 4 --temperature 0 --json");
  INFO(g.output);
  REQUIRE(g.code == 0);
  const std::string out_text = g.output.substr(0, g.output.find_last_not_of('\n') + 1);
  const auto at = out_text.rfind('\n');  // --json: one object on the last line
  const json printed = json::parse(at == std::string::npos ? out_text : out_text.substr(at + 1));
  CHECK(printed["weights"] == (root / step_name(10)).string() + " (step 10)");
}

// ---- state.async: host reads while a save is written, and the CUDA snapshot ----

namespace {

// An environment variable set for a scope (children started in it inherit it).
struct ScopedEnv {
  std::string name;
  ScopedEnv(std::string n, const std::string& value) : name(std::move(n)) { ::setenv(name.c_str(), value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name.c_str()); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

// The host synchronizations and collectives in logging.profile_step's Chrome trace, by name: every
// .item() (aten::_local_scalar_dense), the step's declared read (sublinear::host_read), every
// collective (the process group's own record, gloo:* or nccl:*, and any c10d::* op), and on CUDA every
// runtime call that blocks the host on the device (cuda*Synchronize, the synchronous cudaMemcpy), as
// CUPTI records them.
std::map<std::string, int64_t> profiled_syncs(const fs::path& profile) {
  const json trace = json::parse(test::read_text(profile));
  std::map<std::string, int64_t> seen;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    const std::string name = e.value("name", "");
    const bool cuda_sync = name.rfind("cuda", 0) == 0 && (name.find("Synchronize") != std::string::npos || name == "cudaMemcpy");
    const bool collective = name.rfind("gloo:", 0) == 0 || name.rfind("nccl:", 0) == 0 || name.rfind("c10d::", 0) == 0;
    if (name == "aten::_local_scalar_dense" || name == "sublinear::host_read" || collective || cuda_sync)
      ++seen[name];
  }
  return seen;
}

std::string describe(const std::map<std::string, int64_t>& counts) {
  std::string out;
  for (const auto& [name, n] : counts) out += fmt::format("{}{} x{}", out.empty() ? "" : ", ", name, n);
  return out.empty() ? "none" : out;
}

// The position of the first record of `kind` at `step` in metrics.jsonl (events and step records in
// the order written); -1 when there is none.
int64_t position(const std::vector<json>& records, const std::string& kind, int64_t step) {
  for (size_t i = 0; i < records.size(); ++i)
    if (records[i].value("event", "") == kind && records[i].value("step", int64_t{-1}) == step) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace

// The loop learns that every rank's writer is done from the step's own reduction and read (a count
// beside the stop flags), not from a collective and an .item() of its own each step. Step 3 runs while
// the save of step 2 is held in flight (SUBLINEAR_STATE_WRITE_DELAY_MS: 3 s, against ~0.1 s a step);
// its profile is compared with step 3 of the same run without saves.
TEST_CASE("state.async at world 2 (Gloo): a step while a save is written makes the host reads and collectives of a "
          "step without one") {
  test::TempDir dir("state-async-syncs");
  const std::string args = kArgs + " --set train.steps=3 --set logging.profile_step=3 --set state.at_end=false";
  const auto saving = dir.path / "saving", plain = dir.path / "plain";
  {
    const ScopedEnv hold("SUBLINEAR_STATE_WRITE_DELAY_MS", "3000");
    const auto m = test::launch(2, args + " --set state.every=2 --set state.async=true" + dir_arg(saving));
    INFO(m.outputs[0] << "\n---- rank 1:\n" << m.outputs[1]);
    REQUIRE(m.codes == std::vector<int>{0, 0});
  }
  const auto m = test::launch(2, args + " --set state.every=0" + dir_arg(plain));
  INFO(m.outputs[0] << "\n---- rank 1:\n" << m.outputs[1]);
  REQUIRE(m.codes == std::vector<int>{0, 0});

  // Step 3 was inside the save: after the snapshot of step 2, before its publication.
  const auto records = test::read_jsonl(saving / "metrics.jsonl");
  const int64_t snapshot = position(records, "state_snapshot", 2), profiled = position(records, "profile", 3),
                published = position(records, "state_saved", 2);
  INFO("metrics.jsonl positions: snapshot " << snapshot << ", profile of step 3 " << profiled << ", published " << published);
  REQUIRE(snapshot >= 0);
  REQUIRE(profiled > snapshot);
  REQUIRE(published > profiled);

  const auto with_save = profiled_syncs(saving / "profile.json"), without = profiled_syncs(plain / "profile.json");
  INFO("step 3 during the save: " << describe(with_save) << "\nstep 3 without saves: " << describe(without));
  CHECK(with_save.count("sublinear::host_read") == 1);
  CHECK(with_save.at("sublinear::host_read") == 1);
  CHECK(with_save == without);
}

TEST_CASE("the CUDA snapshot's block: every tensor aligned to its element size, back to back, no padding") {
  // A byte tensor first and odd sizes: laid out in order of element size, 8, 4, 2, 1 bytes.
  const std::vector<at::Tensor> ts = {torch::zeros({3}, torch::kUInt8), torch::zeros({5}, torch::kFloat),
                                      torch::zeros({7}, torch::kBFloat16), torch::zeros({2}, torch::kDouble),
                                      torch::zeros({1}, torch::kUInt8), torch::zeros({4}, torch::kFloat)};
  int64_t total = -1;
  const auto at = device::packed_offsets(ts, total);
  REQUIRE(at.size() == ts.size());
  // doubles [0, 16), floats [16, 36) and [36, 52), bf16 [52, 66), bytes [66, 69) and [69, 70).
  CHECK(at == std::vector<int64_t>{66, 16, 52, 0, 69, 36});
  CHECK(total == 70);  // 3 + 20 + 14 + 16 + 1 + 16 bytes: exactly the tensors'
  for (size_t i = 0; i < ts.size(); ++i) CHECK(at[i] % ts[i].element_size() == 0);
}

TEST_CASE("page-locked bytes count in the host pool, and memory.host_limit refuses them as it refuses a host tensor") {
  auto& pool = memory::TrackingCPUAllocator::instance();
  const int64_t before = pool.host_current_bytes();
  pool.reset_host_peak();
  pool.set_host_limit(before + 1000);
  pool.clear_refusal();
  pool.add_host_external(600);
  CHECK(pool.host_current_bytes() == before + 600);
  CHECK(pool.host_peak_bytes() == before + 600);
  // 600 + 500 > 1000: refused, nothing counted, the refusal recorded as the host pool's.
  CHECK_THROWS_AS(pool.add_host_external(500), c10::OutOfMemoryError);
  CHECK(pool.host_current_bytes() == before + 600);
  CHECK(pool.last_refused_bytes() == 500);
  CHECK(pool.last_refused_host());
  pool.remove_host_external(600);
  CHECK(pool.host_current_bytes() == before);
  CHECK(pool.host_peak_bytes() == before + 600);  // the peak stays
  pool.set_host_limit(0);
  pool.clear_refusal();
}

// On a GPU (its own ctest entry, state_cuda; skipped elsewhere) the snapshot is one page-locked block
// with non-blocking copies and one event. The asynchronous run must be the synchronous one bitwise (its
// losses, and its files byte for byte: a copy that read a tensor after the next step's optimizer had
// written it would show there), resume bitwise from a state it wrote mid-run, count the block in the
// host pool, and a step during a save must make the host synchronizations of a step without one; a
// memory.host_limit below the block refuses it as it refuses a host tensor.
namespace {

const std::string kCudaArgs =
    kArgs + " --set train.device=cuda --set state.every=4 --set state.keep=0 --set logging.profile_step=6";

// The block past memory.host_limit: exit 4, an out-of-memory in host memory at the snapshot, the
// whole block (`block_bytes`) refused at once, nothing of that save left behind.
void pinned_block_refused(const fs::path& run, int64_t block_bytes) {
  const auto r = test::trainer(kCudaArgs + " --set memory.host_limit=1MiB" + dir_arg(run));
  INFO(r.output);
  REQUIRE(r.code == 4);
  const json oom = json::parse(test::read_text(run / "summary.json"))["oom"];
  CHECK(oom["memory"] == "host");
  CHECK(oom["phase"] == "state_snapshot");
  CHECK(oom["step"] == 4);
  CHECK(oom["requested_bytes"] == block_bytes);
  CHECK(has(oom["message"].get<std::string>(), "snapshot of step 4"));
  CHECK(names_in(run / "state").empty());
}

}  // namespace

TEST_CASE("state.async on CUDA: the snapshot's files are the synchronous save's, a resume from one is bitwise, and a "
          "step during a save makes no extra host synchronization", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  test::TempDir dir("state-async-cuda");
  const auto sync_run = dir.path / "sync", async_run = dir.path / "async";
  run_ok(kCudaArgs + " --set state.async=false" + dir_arg(sync_run));
  const auto want = test::trace(sync_run / "metrics.jsonl");
  REQUIRE(want.steps.size() == static_cast<size_t>(kSteps));
  {
    const ScopedEnv hold("SUBLINEAR_STATE_WRITE_DELAY_MS", "2000");  // steps 5.. run while step 4's save is held
    run_ok(kCudaArgs + " --set state.async=true" + dir_arg(async_run));
  }
  CHECK(test::trace_diff(test::trace(async_run / "metrics.jsonl"), want) == "");
  for (const int step : {4, 8, 12}) {
    INFO("step " << step);
    const auto a = async_run / "state" / step_name(step), b = sync_run / "state" / step_name(step);
    CHECK(test::read_text(a / "rank-00000.safetensors") == test::read_text(b / "rank-00000.safetensors"));
    CHECK(meta_without_async(a) == meta_without_async(b));
  }
  // The block in the host pool from the save of step 4 on: without offload it is all the pool holds.
  const auto snapshots = test::events(async_run / "metrics.jsonl", "state_snapshot");
  REQUIRE_FALSE(snapshots.empty());
  const int64_t block = snapshots[0]["snapshot_bytes"].get<int64_t>();
  for (const auto& r : test::read_jsonl(async_run / "metrics.jsonl"))
    if (!r.contains("event") && r["step"].get<int64_t>() == 5) CHECK(r["host_peak_bytes"].get<int64_t>() == block);

  // Step 6: during the save of step 4 in the asynchronous run (published after it), no save in the other.
  const auto records = test::read_jsonl(async_run / "metrics.jsonl");
  CHECK(position(records, "state_saved", 4) > position(records, "profile", 6));
  const auto during = profiled_syncs(async_run / "profile.json"), plain = profiled_syncs(sync_run / "profile.json");
  WARN("host synchronizations of step 6 during an asynchronous save: " << describe(during) << "; without a save: " << describe(plain));
  CHECK(during.count("sublinear::host_read") == 1);
  CHECK(during == plain);

  // --resume from the asynchronous run's state of step 4 (the later ones set aside): steps 5..12 again,
  // bitwise the uninterrupted run.
  run_ok(kCudaArgs + " --set state.async=true --resume " + (async_run / "state" / step_name(4)).string() + dir_arg(async_run));
  CHECK(test::trace_diff(test::trace(async_run / "metrics.jsonl"), want) == "");

  pinned_block_refused(dir.path / "limited", block);
}

}  // namespace SUBLINEAR_TEST_FILE
