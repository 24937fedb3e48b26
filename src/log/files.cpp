// Atomic files, directory fsync and CRC-32 (files.h).
#include "log/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "errors.h"

namespace sl::log {

namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

}  // namespace

constexpr size_t kIoChunk = size_t{64} << 20;  // bytes per write(2) call

AtomicFile::AtomicFile(std::filesystem::path path) : path_(std::move(path)), tmp_(path_) {
  tmp_ += ".tmp";
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(errno);
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::write(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, std::min(n, kIoChunk));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(w < 0 ? errno : ENOSPC);
    digest_.crc32 = crc32(p, static_cast<size_t>(w), digest_.crc32);
    digest_.bytes += w;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

FileDigest AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail(errno);
  // The bytes are on disk: drop them from the page cache, so a multi-GiB state does not push the
  // training process's memory out (the steps after a save would pay for it). Advice only.
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(errno);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail(errno);
  committed_ = true;
  return digest_;
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(int err) {
  discard();
  throw IoError(fmt::format("writing {} failed: {}", path_.string(), errno_text(err)));
}

uint32_t crc32(const void* data, size_t n, uint32_t seed) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong crc = seed;
  while (n > 0) {
    const auto chunk = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

uint32_t crc32_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("reading {} failed: {}", path.string(), errno_text(errno)));
  std::vector<uint8_t> buf(size_t{1} << 20);
  uint32_t crc = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("reading {} failed: {}", path.string(), errno_text(err)));
    }
    if (n == 0) break;
    crc = crc32(buf.data(), static_cast<size_t>(n), crc);
  }
  ::close(fd);
  return crc;
}

void fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0 && ::fsync(fd) != 0) err = errno;
  if (fd >= 0) ::close(fd);
  if (err) throw IoError(fmt::format("syncing directory {} failed: {}", dir.string(), errno_text(err)));
}

FileDigest write_file_atomic(const std::filesystem::path& path, const std::string& text) {
  AtomicFile out(path);
  out.write(text.data(), text.size());
  return out.commit();
}

}  // namespace sl::log
