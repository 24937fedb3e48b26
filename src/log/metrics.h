// Run logs: <run_dir>/metrics.jsonl (one JSON object per optimizer step, plus "event" records),
// <run_dir>/summary.json (written atomically at the end), the start-up table and the console line.
// Only rank 0 writes; on other ranks every call is a no-op.
#pragma once
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "log/tensorboard.h"

namespace sl::log {

// Every write is checked. The first failed record is cut off again (metrics.jsonl ends with its last
// whole record, so it stays valid JSONL), remembered in failure() (naming the file and the system
// error), and later records are dropped: the loop stops the run at that step with exit 7 (all ranks
// together). summary.json and config.json are written atomically and throw IoError on failure.
// With `tensorboard` (logging.tensorboard) every record's scalars also go to a TensorBoard event file
// in <run_dir>/tensorboard/ (TensorBoardWriter), under the same policy: its first failed write is the
// run's failure() (exit 7), and later records go to neither file.
class RunLog {
 public:
  // Creates run_dir (and parents) and opens metrics.jsonl for writing (truncating it). A directory
  // that already holds a run (metrics.jsonl, summary.json or config.json) is refused with a
  // ConfigError unless `overwrite`; see check_run_dir. A resumed run (resume_step >= 0) keeps the
  // records of steps <= resume_step (and records without a step) and appends after them, so no step
  // appears twice; a partial last line left by a killed process is dropped. `tensorboard` opens a new
  // event file (see TensorBoardWriter: a resumed run's marks the steps after resume_step replayed).
  RunLog(const std::filesystem::path& run_dir, bool rank0, bool overwrite = false, int64_t resume_step = -1,
         bool tensorboard = false);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  void step(const nlohmann::json& record);                         // one whole line (and event), written through
  void event(const std::string& kind, nlohmann::json fields);      // {"event": kind, ...}
  void write_json(const std::string& name, const nlohmann::json& j);  // tmp + fsync + rename
  const std::filesystem::path& dir() const { return dir_; }
  const std::string& failure() const { return failure_; }  // the first failed write ("" = none)

 private:
  std::filesystem::path dir_;
  bool rank0_;
  int fd_ = -1;
  int64_t written_ = 0;  // bytes of whole records in metrics.jsonl
  std::string failure_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // null unless logging.tensorboard (rank 0)
};

// Throws ConfigError when run_dir already holds another run's logs and !overwrite (exit 2: pick
// another logging.dir or set logging.overwrite: true). A missing or empty directory is fine.
void check_run_dir(const std::filesystem::path& run_dir, bool overwrite);

// Writes JSON to path atomically (tmp, fsync, rename); throws IoError naming the path on failure and
// leaves no temporary behind.
void write_json_file(const std::filesystem::path& path, const nlohmann::json& j);
// The same for any text.
void write_text_file(const std::filesystem::path& path, const std::string& text);

// "| key | value |" table in the llm.c style.
std::string format_table(const std::vector<std::pair<std::string, std::string>>& rows);
// One fixed-format console line from a step record.
std::string format_step_line(const nlohmann::json& record, int64_t total_steps);
// "1.23 GiB" style.
std::string format_bytes(int64_t bytes);

// A one-line progress bar redrawn with '\r' when stdout is a terminal; silent otherwise.
class ProgressBar {
 public:
  ProgressBar(int64_t total, bool enabled);
  void update(int64_t done, double loss);
  void clear();  // erase the bar before a normal console line
  void finish();

 private:
  int64_t total_;
  bool enabled_;
  bool drawn_ = false;
};

}  // namespace sl::log
