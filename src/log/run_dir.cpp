// Run directories (see run_dir.h).
#include "log/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "errors.h"

namespace sl::log {
namespace fs = std::filesystem;

namespace {

bool digits(const std::string& s, size_t from, size_t n) {
  if (from + n > s.size()) return false;
  for (size_t i = from; i < from + n; ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

// The order of a default run directory's name after "<recipe>-": "YYYYMMDD-HHMMSS" (suffix 1) or
// "YYYYMMDD-HHMMSS-N" (N >= 2); {"", 0} for anything else (not this recipe's default run directory).
std::pair<std::string, long long> run_order(const std::string& rest) {
  const bool stamp = rest.size() >= 15 && digits(rest, 0, 8) && rest[8] == '-' && digits(rest, 9, 6);
  if (!stamp) return {"", 0};
  if (rest.size() == 15) return {rest, 1};
  if (rest[15] != '-' || rest.size() == 16 || rest.size() > 16 + 9 || !digits(rest, 16, rest.size() - 16))
    return {"", 0};
  return {rest.substr(0, 15), std::stoll(rest.substr(16))};
}

}  // namespace

fs::path default_run_dir(const std::string& recipe, std::time_t start, int64_t suffix) {
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&start));
  const std::string name = fmt::format("{}-{}", recipe, text);
  return kRunsDir / (suffix == 1 ? name : fmt::format("{}-{}", name, suffix));
}

int64_t free_run_suffix(const std::string& recipe, std::time_t start) {
  int64_t suffix = 1;
  while (fs::exists(default_run_dir(recipe, start, suffix))) ++suffix;
  return suffix;
}

fs::path default_plan_path(const std::string& recipe) { return kRunsDir / (recipe + "-plan.json"); }

fs::path newest_run_with_state(const fs::path& runs, const std::string& recipe) {
  fs::path best;
  std::pair<std::string, long long> best_order{"", 0};
  std::error_code ec;
  if (!fs::is_directory(runs, ec)) return best;
  const std::string prefix = recipe + "-";
  for (const auto& e : fs::directory_iterator(runs, ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto order = run_order(name.substr(prefix.size()));
    if (order.first.empty() || !fs::is_directory(e.path() / "state", ec)) continue;
    if (best.empty() || order > best_order) best = e.path(), best_order = order;
  }
  return best;
}

RunDirLock::RunDirLock(const fs::path& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec)
    throw ConfigError(fmt::format("logging.dir: cannot create run directory {} ({})", run_dir.string(), ec.message()));
  const fs::path file = run_dir / ".lock";
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(fmt::format("logging.dir: cannot open {} ({})", file.string(), std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw IoError(fmt::format("logging.dir: cannot lock {} ({})", file.string(), std::strerror(err)));
    std::ifstream in(file);
    std::stringstream holder;
    holder << in.rdbuf();
    std::string who = holder.str();
    while (!who.empty() && std::isspace(static_cast<unsigned char>(who.back()))) who.pop_back();
    throw ConfigError(fmt::format(
        "logging.dir: {} is in use by another trainer ({}); two processes must not train, resume or write one run "
        "directory at once. Wait for it to end (its lock goes with it, even on kill -9), or choose another logging.dir",
        run_dir.string(), who.empty() ? "holder unknown" : who));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const std::string me = fmt::format("pid {} on {}, since {}\n", ::getpid(), host, when);
  // Best effort: without the note the lock still holds; a refused process just cannot name this one.
  [[maybe_unused]] const bool noted =
      ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, me.data(), me.size(), 0) == static_cast<ssize_t>(me.size());
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace sl::log
