// logging.tensorboard: TensorBoard event files beside metrics.jsonl.
//   - CRC-32C against the standard check values, the TFRecord framing, the tag table;
//   - a failed write (a file-size limit) throws IoError and leaves only whole records; an event file
//     that cannot be created refuses the run (exit 2);
//   - a tiny run's event file read by TensorBoard's own readers (tests/tensorboard_check.py) holds every
//     scalar of metrics.jsonl at its step, as float32, with independently checked CRCs; a new run
//     with logging.overwrite replaces the earlier event file;
//   - a run rolled back to an earlier state writes a second file (SessionLog START at the resumed
//     step + 1), and the readers then show each step once, with the resumed run's values.
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "errors.h"
#include "log/tensorboard.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

namespace fs = std::filesystem;
using namespace sl;
using Json = nlohmann::json;

namespace {

// A quick run of the tiny recipe: 1 layer, 4 x 32 tokens a step.
const std::string kQuick =
    "--config configs/tiny.yaml --set model.n_layer=1 --set train.seq_len=32 --set train.micro_batch=4 "
    "--set train.grad_accum=1 --set train.warmup_steps=2 --set train.eval_interval=3 --set train.eval_batches=1 "
    "--set logging.tensorboard=true ";

test::Result check(const fs::path& run_dir, const std::string& extra = "") {
  return test::python("tensorboard_check.py", run_dir.string() + " " + extra);
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// Walks the TFRecords of an event file by their lengths; returns how many whole ones it holds, or -1
// when the file does not end at a record boundary.
int64_t whole_records(const fs::path& p) {
  const std::string bytes = test::read_text(p);
  size_t pos = 0;
  int64_t n = 0;
  while (pos + 12 <= bytes.size()) {
    uint64_t len = 0;
    std::memcpy(&len, bytes.data() + pos, 8);  // little-endian host
    if (pos + 16 + len > bytes.size()) return -1;
    pos += 16 + len, ++n;
  }
  return pos == bytes.size() ? n : -1;
}

}  // namespace

TEST_CASE("crc32c: the standard check values; masking and TFRecord framing") {
  CHECK(log::crc32c("123456789") == 0xE3069283u);
  CHECK(log::crc32c("") == 0u);
  CHECK(log::crc32c(std::string(32, '\0')) == 0x8A9136AAu);  // RFC 3720, B.4
  CHECK(log::crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  // Continuing a CRC over a second piece equals the CRC of the whole.
  CHECK(log::crc32c("6789", 4, log::crc32c("12345")) == 0xE3069283u);
  const uint32_t c = 0xE3069283u;
  CHECK(log::masked_crc32c("123456789", 9) == ((c >> 15) | (c << 17)) + 0xa282ead8u);

  const std::string rec = log::tfrecord("abc");
  REQUIRE(rec.size() == 8 + 4 + 3 + 4);
  CHECK(rec.substr(0, 8) == std::string("\x03\0\0\0\0\0\0\0", 8));
  uint32_t hcrc = 0, dcrc = 0;
  std::memcpy(&hcrc, rec.data() + 8, 4);
  std::memcpy(&dcrc, rec.data() + 15, 4);
  CHECK(hcrc == log::masked_crc32c(rec.data(), 8));
  CHECK(rec.substr(12, 3) == "abc");
  CHECK(dcrc == log::masked_crc32c("abc", 3));
}

TEST_CASE("tensorboard_scalars: the tag table of docs/logs.md") {
  const Json step = {{"step", 7},          {"loss", 2.5},          {"lr", 1e-3},          {"grad_norm", nullptr},
                     {"loss_scale", 1.0},  {"skipped", true},      {"step_ms", 12.0},     {"tokens", 128},
                     {"tokens_per_s", 9e3}, {"samples_per_s", 70.0}, {"mfu", 0.01},        {"hfu", 0.02},
                     {"recompute_ms", 0.0}, {"peak_allocated_bytes", 1000}, {"activation_peak_bytes", 400},
                     {"allocated_bytes", 600}, {"reserved_bytes", 600}, {"host_peak_bytes", 0}};
  std::vector<std::string> tags;
  for (const auto& s : log::tensorboard_scalars(step)) tags.push_back(s.tag);
  // grad_norm is null on a skipped step: no point; host_peak_bytes is 0 without offload: no point.
  CHECK(tags == std::vector<std::string>{"train/loss", "train/lr", "train/loss_scale", "train/step_ms",
                                         "train/tokens_per_s", "train/mfu", "memory/peak_allocated_bytes",
                                         "memory/allocated_bytes", "memory/activation_peak_bytes"});
  Json offload = step;
  offload["grad_norm"] = 0.5;
  offload["host_peak_bytes"] = 4096;
  const auto s2 = log::tensorboard_scalars(offload);
  REQUIRE(s2.size() == tags.size() + 2);
  CHECK(s2[2].tag == "train/grad_norm");
  CHECK(s2.back().tag == "memory/host_peak_bytes");
  CHECK(s2.back().value == 4096.0);

  const auto eval = log::tensorboard_scalars({{"event", "eval"}, {"step", 9}, {"val_loss", 1.25}});
  REQUIRE(eval.size() == 1);
  CHECK(eval[0].tag == "val/loss");
  CHECK(eval[0].value == 1.25);
  CHECK(log::tensorboard_scalars({{"event", "state_saved"}, {"step", 9}, {"bytes", 5}}).empty());
}

TEST_CASE("TensorBoardWriter: a failed write throws IoError naming the file, and the file keeps whole records") {
  test::TempDir dir("tb-fail");
  log::TensorBoardWriter w(dir.path / "tb", /*resume_step=*/-1);
  const fs::path path = w.path();
  CHECK(path.parent_path() == dir.path / "tb");
  w.write_scalars(1, {{"train/loss", 1.0}});
  const auto before = fs::file_size(path);
  // A file-size limit a few bytes past the file's end: the next record is cut and write() fails with EFBIG.
  struct rlimit old {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = before + 10;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
  std::string message;
  try {
    w.write_scalars(2, {{"train/loss", 0.5}, {"train/lr", 0.1}});
  } catch (const IoError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  INFO(message);
  CHECK(message.find(path.string()) != std::string::npos);
  CHECK(message.find("stay whole records") != std::string::npos);
  CHECK(fs::file_size(path) == before);
  CHECK(whole_records(path) == 3);  // file_version, SessionLog START, step 1
}

TEST_CASE("a run with logging.tensorboard: TensorBoard's reader holds every scalar of metrics.jsonl") {
  test::TempDir dir("tb-run");
  const fs::path run = dir.path / "run";
  const auto r = test::trainer(kQuick + fmt::format("--set train.steps=5 --set logging.dir={}", run.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(event_files(run / "tensorboard").size() == 1);
  const auto c = check(run);
  INFO(c.output);
  CHECK(c.code == 0);

  // The same directory again with logging.overwrite: the earlier event file is replaced, not read on.
  const auto again = test::trainer(kQuick + fmt::format("--set train.steps=4 --set logging.dir={} --set logging.overwrite=true", run.string()));
  INFO(again.output);
  REQUIRE(again.code == 0);
  const auto c2 = check(run);
  INFO(c2.output);
  CHECK(c2.code == 0);
}

TEST_CASE("a run rolled back to an earlier state: SessionLog START purges the replayed steps in TensorBoard's reader") {
  test::TempDir dir("tb-resume");
  const fs::path run = dir.path / "run";
  const std::string args = kQuick + fmt::format("--set train.steps=6 --set state.every=3 --set logging.dir={}", run.string());
  const auto first = test::trainer(args);
  INFO(first.output);
  REQUIRE(first.code == 0);
  // Back to step 3: the run replays steps 4..6 (the same losses, other times and rates).
  const auto second = test::trainer(args + " --resume " + (run / "state" / "step-00000003").string());
  INFO(second.output);
  REQUIRE(second.code == 0);
  REQUIRE(event_files(run / "tensorboard").size() == 2);
  const auto c = check(run, "--resumed 3");
  INFO(c.output);
  CHECK(c.code == 0);
}

TEST_CASE("an event file that cannot be created refuses the run like metrics.jsonl: exit 2 naming the path") {
  test::TempDir dir("tb-refused");
  const fs::path run = dir.path / "run";
  fs::create_directories(run);
  dir.file("run/tensorboard", "");  // a plain file where the tensorboard/ directory goes
  const auto r = test::trainer(kQuick + fmt::format("--set train.steps=2 --set logging.dir={}", run.string()));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(r.output.find("logging.tensorboard: cannot create " + (run / "tensorboard").string()) != std::string::npos);
}

}  // namespace SUBLINEAR_TEST_FILE
