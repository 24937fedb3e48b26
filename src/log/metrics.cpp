// Run logs: JSONL step records, atomic JSON files, the settings table, console line, progress bar.
#include "log/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include <cmath>
#include <fstream>

#include <fmt/format.h>

#include "errors.h"
#include "log/record_file.h"

namespace sl::log {


void check_run_dir(const std::filesystem::path& run_dir, bool overwrite) {
  if (overwrite) return;
  for (const char* name : {"metrics.jsonl", "summary.json", "config.json"}) {
    std::error_code ec;
    if (std::filesystem::exists(run_dir / name, ec))
      throw ConfigError(fmt::format("logging.dir: {} already holds a run ({} exists); choose another logging.dir, "
                                    "or set logging.overwrite: true to replace it",
                                    run_dir.string(), name));
  }
}

namespace {

// The records of metrics.jsonl a resumed run keeps: whole lines whose "step" is at most `step`.
std::string records_through(const std::filesystem::path& path, int64_t step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline: a record cut short by a kill
    const auto rec = nlohmann::json::parse(line, nullptr, false);
    if (rec.is_discarded() || !rec.is_object()) continue;
    if (rec.contains("step") && rec["step"].is_number_integer() && rec["step"].get<int64_t>() > step) continue;
    kept += line + "\n";
  }
  return kept;
}

}  // namespace

RunLog::RunLog(const std::filesystem::path& run_dir, bool rank0, bool overwrite, int64_t resume_step, bool tensorboard)
    : dir_(run_dir), rank0_(rank0) {
  if (!rank0_) return;
  if (resume_step < 0) check_run_dir(dir_, overwrite);
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw ConfigError(fmt::format("logging.dir: cannot create run directory {} ({})", dir_.string(), ec.message()));
  auto path = dir_ / "metrics.jsonl";
  if (resume_step >= 0) {  // replaced in one rename: a kill now loses nothing
    const std::string kept = records_through(path, resume_step);
    write_text_file(path, kept);
    written_ = static_cast<int64_t>(kept.size());
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (resume_step >= 0 ? O_APPEND : O_TRUNC), 0644);
  if (fd_ < 0)
    throw ConfigError(fmt::format("logging.dir: cannot write {} ({})", path.string(), errno_text(errno)));
  if (tensorboard) {
    try {
      tensorboard_ = std::make_unique<TensorBoardWriter>(dir_ / "tensorboard", resume_step);
    } catch (const IoError& e) {  // its first records: the run stops after its first step (exit 7)
      failure_ = e.what();
    } catch (const ConfigError&) {  // no event file: refused like metrics.jsonl (exit 2)
      ::close(fd_);
      fd_ = -1;
      throw;
    }
  }
}

RunLog::~RunLog() {
  if (fd_ >= 0) ::close(fd_);
}

void RunLog::step(const nlohmann::json& record) {
  if (fd_ < 0 || !failure_.empty()) return;
  const std::string line = record.dump() + "\n";
  if (const auto f = append_record(fd_, written_, line)) {
    failure_ = fmt::format("writing {} failed: {}; the {} bytes written before {} (free disk space or choose "
                           "another logging.dir)",
                           (dir_ / "metrics.jsonl").string(), errno_text(f.err), written_,
                           f.cut ? "stay valid JSONL" : "may end in a partial record");
    return;
  }
  if (!tensorboard_) return;
  try {
    tensorboard_->write(record);
  } catch (const IoError& e) {
    failure_ = e.what();
  }
}

void RunLog::event(const std::string& kind, nlohmann::json fields) {
  fields["event"] = kind;
  step(fields);
}

void RunLog::write_json(const std::string& name, const nlohmann::json& j) {
  if (rank0_) write_json_file(dir_ / name, j);
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  auto tmp = path;
  tmp += ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("cannot write {}: {}", tmp.string(), errno_text(errno)));
  int err = write_all(fd, text);
  if (!err && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && !err) err = errno;
  std::error_code ec;
  if (!err) {
    std::filesystem::rename(tmp, path, ec);
    if (ec) err = ec.value();
  }
  if (err) {
    std::filesystem::remove(tmp, ec);
    throw IoError(
        fmt::format("writing {} failed: {} (free disk space or check permissions)", path.string(), errno_text(err)));
  }
}

void write_json_file(const std::filesystem::path& path, const nlohmann::json& j) {
  write_text_file(path, j.dump(2) + "\n");
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

namespace {
// The step's rate, and where the loss counts fewer targets than the step processes (examples: prompts and
// padding), the trained tokens' rate beside it.
std::string format_rate(const nlohmann::json& r) {
  std::string rate = fmt::format("{:.0f} tok/s", r.at("tokens_per_s").get<double>());
  if (r.contains("trained_tokens") && r.at("trained_tokens") != r.at("tokens"))
    rate += fmt::format(" ({:.0f} trained)", r.at("trained_tokens_per_s").get<double>());
  return rate;
}
}  // namespace

std::string format_step_line(const nlohmann::json& r, int64_t total_steps) {
  return fmt::format(
      "step {:>5}/{} | loss {:.4f} | gnorm {:.3f} | lr {:.2e} | {:.1f} ms | {} | mfu {:.1f}% | mem {}",
      r.at("step").get<int64_t>(), total_steps, r.at("loss").get<double>(),
      r.at("grad_norm").is_null() ? std::nan("") : r.at("grad_norm").get<double>(), r.at("lr").get<double>(),
      r.at("step_ms").get<double>(), format_rate(r), 100.0 * r.at("mfu").get<double>(),
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
