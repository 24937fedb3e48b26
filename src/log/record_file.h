// Append-only files of whole records (metrics.jsonl's lines, TensorBoard's TFRecords): each record is
// written with checked writes, and a failed one is cut off again so the file still ends with whole records.
#pragma once
#include <cstdint>
#include <string>

namespace sl::log {

// The system's text for errno value `err`.
std::string errno_text(int err);

// Writes all of `bytes` to fd; returns 0 or the errno of the first failure (ENOSPC for a write of 0 bytes).
int write_all(int fd, const std::string& bytes);

// Appends `bytes` to fd as one record. `written` is the size of the whole records before it and grows by
// the record on success. On failure the partial record is cut off again; the result says what failed.
struct AppendFailure {
  int err = 0;       // 0: the record is in the file
  bool cut = true;   // after a failure: the file ends with whole records again
  explicit operator bool() const { return err != 0; }
};
AppendFailure append_record(int fd, int64_t& written, const std::string& bytes);

}  // namespace sl::log
