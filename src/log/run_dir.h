// Run directories: which earlier run --resume auto continues (default directories), and the lock that
// lets one process at a time use a run directory.
#pragma once
#include <filesystem>
#include <string>

namespace sl::log {

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
