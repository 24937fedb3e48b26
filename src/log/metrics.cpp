// Run logs: JSONL step records, atomic JSON files, the settings table, console line, progress bar.
#include "log/metrics.h"

#include <unistd.h>

#include <cmath>

#include <fmt/format.h>

#include "errors.h"

namespace sl::log {

RunLog::RunLog(const std::filesystem::path& run_dir, bool rank0) : dir_(run_dir), rank0_(rank0) {
  if (!rank0_) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw ConfigError(fmt::format("logging.dir: cannot create run directory {} ({})", dir_.string(), ec.message()));
  auto path = dir_ / "metrics.jsonl";
  metrics_ = std::fopen(path.c_str(), "w");
  if (!metrics_)
    throw ConfigError(fmt::format("logging.dir: cannot write {} (check permissions / disk space)", path.string()));
}

RunLog::~RunLog() {
  if (metrics_) std::fclose(metrics_);
}

void RunLog::step(const nlohmann::json& record) {
  if (!metrics_) return;
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), metrics_);
  std::fflush(metrics_);
}

void RunLog::event(const std::string& kind, nlohmann::json fields) {
  fields["event"] = kind;
  step(fields);
}

void RunLog::write_json(const std::string& name, const nlohmann::json& j) {
  if (rank0_) write_json_file(dir_ / name, j);
}

void write_json_file(const std::filesystem::path& path, const nlohmann::json& j) {
  auto tmp = path;
  tmp += ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw ConfigError(fmt::format("cannot write {} (check the directory and permissions)", tmp.string()));
  std::string text = j.dump(2) + "\n";
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::filesystem::remove(tmp);
    throw ConfigError(fmt::format("writing {} failed (disk full?)", path.string()));
  }
  std::filesystem::rename(tmp, path);
}

std::string format_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t kw = 0, vw = 0;
  for (const auto& [k, v] : rows) kw = std::max(kw, k.size()), vw = std::max(vw, v.size());
  std::string rule = fmt::format("+{:-<{}}+{:-<{}}+\n", "", kw + 2, "", vw + 2);
  std::string out = rule;
  for (const auto& [k, v] : rows) out += fmt::format("| {:<{}} | {:<{}} |\n", k, kw, v, vw);
  return out + rule;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  return fmt::format("{:.1f} {}", v, units[u]);
}

std::string format_step_line(const nlohmann::json& r, int64_t total_steps) {
  return fmt::format("step {:>5}/{} | loss {:.4f} | gnorm {:.3f} | lr {:.2e} | {:.1f} ms | {:.0f} tok/s | mfu {:.1f}% | mem {}",
                     r.at("step").get<int64_t>(), total_steps, r.at("loss").get<double>(),
                     r.at("grad_norm").is_null() ? std::nan("") : r.at("grad_norm").get<double>(), r.at("lr").get<double>(), r.at("step_ms").get<double>(),
                     r.at("tokens_per_s").get<double>(), 100.0 * r.at("mfu").get<double>(),
                     format_bytes(r.at("peak_allocated_bytes").get<int64_t>()));
}

ProgressBar::ProgressBar(int64_t total, bool enabled) : total_(total), enabled_(enabled && ::isatty(STDOUT_FILENO)) {}

void ProgressBar::update(int64_t done, double loss) {
  if (!enabled_) return;
  const int width = 30;
  int filled = static_cast<int>(width * done / std::max<int64_t>(total_, 1));
  fmt::print("\r[{:#<{}}{:.<{}}] {}/{} loss {:.4f}", "", filled, "", width - filled, done, total_, loss);
  std::fflush(stdout);
  drawn_ = true;
}

void ProgressBar::clear() {
  if (!drawn_) return;
  fmt::print("\r{:<72}\r", "");
  drawn_ = false;
}

void ProgressBar::finish() { clear(); }

}  // namespace sl::log
