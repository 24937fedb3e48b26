// safetensors files (write atomically, read through mmap with every offset checked): the storage layer
// of the state files, on log/files.h's atomic files and CRC-32 checksums. Format notes:
// ../shared/design/FORMATS.md (8-byte little-endian header length, JSON header, tensors tiling the
// data area exactly).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "device/staging.h"
#include "errors.h"
#include "log/files.h"

namespace sl::state {

// A state file that is truncated, corrupt or not what it claims: exit code kExitConfig (2).
struct StateFileError : Error {
  explicit StateFileError(const std::string& what) : Error(kExitConfig, what) {}
};

// The file helpers (log/files.h) the state files are written with, under their state:: names.
using log::AtomicFile;
using log::crc32;
using log::crc32_file;
using log::FileDigest;
using log::fsync_dir;
using log::write_file_atomic;

// Host staging: the one place a tensor leaves its device for a file. Every writer of this project
// (training states, final weights, export) goes through for_each_host_chunk, so no caller stages
// by hand and no device tensor can reach a write(2) by mistake. Contract:
//   - a CPU tensor is handed to `sink` from its own memory (contiguous: no copy; strided: one
//     contiguous copy of that tensor);
//   - a tensor on any other device (CUDA, the lazy test device) is made contiguous on its device
//     (strided: one device copy of that tensor), then copied to host piece by piece, each piece at most
//     device::kHostStagingBytes and freed before the next; `sink` sees each piece after its copy finished.
// So the host memory a save adds is host_staging_bytes(largest tensor), never a second copy of a
// rank's states (device/staging.h: the bound, which the planner counts).
void for_each_host_chunk(const at::Tensor& t, const std::function<void(const void*, size_t)>& sink);

// Writes a safetensors file atomically (`path` + ".tmp", checked writes, fsync, close, rename) and
// returns the size and CRC-32 of the whole file, computed while writing. Tensors: dense, on any
// device (staged to host by for_each_host_chunk); F32, F64, BF16, F16, I64, I32, U8, BOOL; laid out
// in the order given. Names must be unique and not "__metadata__";
// a bad argument throws std::invalid_argument before any file is created. `metadata` goes into
// "__metadata__" when non-empty. On a failed write the temporary is removed and IoError is thrown:
// "writing <path> failed: <system error>".
FileDigest write_safetensors(const std::filesystem::path& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {});

// A safetensors file written one tensor at a time, so that only one tensor needs to be in memory:
// the header (names, dtypes, shapes, in file order) is fixed by the constructor, append() writes the
// next tensor's bytes (its dtype and shape must match; any device: staged by for_each_host_chunk),
// commit() publishes the file (fsync, rename).
// Atomic like write_safetensors: destruction before commit(), or any failed write, removes the
// temporary (IoError). Bad specs throw std::invalid_argument before any file is created.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t nbytes() const;
  };
  SafetensorsWriter(const std::filesystem::path& path, std::vector<Spec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void append(const at::Tensor& t);  // the next tensor in header order (std::logic_error if it does not match)
  FileDigest commit();               // after the last append

 private:
  std::vector<Spec> specs_;
  size_t next_ = 0;
  std::unique_ptr<AtomicFile> file_;
};

// A safetensors file opened read-only with mmap. The constructor checks everything a truncated or
// corrupt file can break (sizes, header JSON, dtypes, shapes, offsets: the tensors must tile the data
// area exactly, as the reference reader demands) and throws StateFileError naming the file and what
// is wrong (also when the file cannot be opened). Entries are in order of their begin offset.
class SafetensorsFile {
 public:
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // offsets relative to the data area
  };

  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();  // munmap
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // A CPU tensor over the mapped bytes (no copy; do not write to it; the tensor keeps the mapping
  // alive, so it stays valid even after this object is gone). Exception: a tensor whose bytes are not
  // aligned to its element size (possible after odd-sized tensors) is returned as an aligned copy.
  // Throws StateFileError when the name is absent.
  at::Tensor view(const std::string& name) const;
  uint32_t crc32() const;  // CRC-32 of the whole mapped file
  int64_t size_bytes() const { return size_; }

 private:
  void map_file();
  void parse_header();

  std::filesystem::path path_;
  std::shared_ptr<const uint8_t> map_;  // the whole file; munmap when the last owner goes
  int64_t size_ = 0;
  int64_t data_start_ = 0;  // 8 + header length
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace sl::state
