// Run logs: <run_dir>/metrics.jsonl (one JSON object per optimizer step, plus "event" records),
// <run_dir>/summary.json (written atomically at the end), the start-up table and the console line.
// Only rank 0 writes; on other ranks every call is a no-op.
#pragma once
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace sl::log {

class RunLog {
 public:
  // Creates run_dir (and parents) and opens metrics.jsonl for writing (truncating it).
  RunLog(const std::filesystem::path& run_dir, bool rank0);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  void step(const nlohmann::json& record);                         // one line, flushed
  void event(const std::string& kind, nlohmann::json fields);      // {"event": kind, ...}
  void write_json(const std::string& name, const nlohmann::json& j);  // tmp + rename
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  bool rank0_;
  std::FILE* metrics_ = nullptr;
};

// Writes JSON to path atomically (tmp + rename); throws ConfigError naming the path on failure.
void write_json_file(const std::filesystem::path& path, const nlohmann::json& j);

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
