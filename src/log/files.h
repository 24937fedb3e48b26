// Files written whole or not at all, and their checksums: atomic files (a temporary renamed over the
// target after fsync), fsync of a directory, CRC-32 of bytes and of files. Every file this project
// writes that must survive a crash (training states, exported weights, tokenizer files) goes through
// them. Torch-free.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace sl::log {

// Content checksum: CRC-32 (zlib's crc32, the same as Python's zlib.crc32) of a byte range / a whole
// file. crc32_file throws IoError naming the path when the file cannot be read.
uint32_t crc32(const void* data, size_t n, uint32_t seed = 0);
uint32_t crc32_file(const std::filesystem::path& path);

struct FileDigest {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

// A file written as <path>.tmp and renamed over <path> by commit(). Every failure removes the
// temporary and throws IoError naming <path>; so does destruction before commit() (without throwing).
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Writes all n bytes (in chunks), updating the digest with the bytes actually written.
  void write(const void* data, size_t n);
  // fsync, close, rename over the target; drops the written pages from the page cache.
  FileDigest commit();

 private:
  void discard() noexcept;
  [[noreturn]] void fail(int err);

  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  FileDigest digest_;
};

// fsync a directory (after renames inside it). Throws IoError on failure.
void fsync_dir(const std::filesystem::path& dir);

// Writes `text` to `path` atomically (tmp, checked writes, fsync, rename); returns the digest of the
// bytes written. IoError on failure, temporary removed.
FileDigest write_file_atomic(const std::filesystem::path& path, const std::string& text);

}  // namespace sl::log
