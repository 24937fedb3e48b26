// Run directories: the default names (written and read here only), which earlier run --resume auto
// continues, and the lock that lets one process at a time use a run directory.
#pragma once
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <string>

namespace sl::log {

// Where runs go when logging.dir is not given (relative to the working directory).
inline const std::filesystem::path kRunsDir = "runs";

// runs/<recipe>-YYYYMMDD-HHMMSS (local time of `start`), or with -N after it for suffix N >= 2 (runs
// started in the same second). newest_run_with_state reads these names back.
std::filesystem::path default_run_dir(const std::string& recipe, std::time_t start, int64_t suffix = 1);
// The first suffix (1, 2, ...) whose default run directory does not exist yet.
int64_t free_run_suffix(const std::string& recipe, std::time_t start);
// runs/<recipe>-plan.json: where `trainer plan` writes its report without --out.
std::filesystem::path default_plan_path(const std::string& recipe);

// The newest run of recipe `recipe` under `runs` (runs/<recipe>-YYYYMMDD-HHMMSS, or -N after it for
// runs started in the same second, N >= 2) whose `state` directory exists; "" when there is none.
// Names match exactly: recipe "tiny" never picks runs/tiny-long-... (recipe "tiny-long"). Ordered by
// the timestamp, then N as a number (-10 after -9).
std::filesystem::path newest_run_with_state(const std::filesystem::path& runs, const std::string& recipe);

// An advisory lock (flock) on <run dir>/.lock, held for this object's life: a second trainer on the
// same run directory (a double submission, a scheduler's requeue while the first still runs) is refused
// instead of resuming from the same state and writing the same files. The kernel releases the lock
// when its holder exits or is killed (kill -9 never leaves it locked). The holder writes its pid, host
// and start time into the file, which the refusal quotes.
class RunDirLock {
 public:
  // Creates the run directory if needed and takes the lock; ConfigError (exit 2) naming the holder
  // when another process holds it, or when the directory cannot be created (a bad logging.dir, as
  // log::RunLog says it); IoError (exit 7) when the lock file cannot be opened in it.
  explicit RunDirLock(const std::filesystem::path& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace sl::log
