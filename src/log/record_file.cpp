// Checked writes and whole-record appends for the run's log files (record_file.h).
#include "log/record_file.h"

#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace sl::log {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

int write_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : ENOSPC;
    done += static_cast<size_t>(n);
  }
  return 0;
}

AppendFailure append_record(int fd, int64_t& written, const std::string& bytes) {
  AppendFailure f;
  f.err = write_all(fd, bytes);
  if (f.err) {
    f.cut = ::ftruncate(fd, written) == 0 && ::lseek(fd, written, SEEK_SET) == written;
    return f;
  }
  written += static_cast<int64_t>(bytes.size());
  return f;
}

}  // namespace sl::log
