// A read-only memory map of a whole file (data/loader.cpp's token files, data/examples.cpp's masks and
// offsets). Opening throws DataError naming the file.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "errors.h"

namespace sl::data {

// A read-only memory map of a whole file; unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0)
      throw DataError(fmt::format("{}: cannot open ({}); check data.path / data.val_path, or run "
                                  "scripts/make_corpus.py to rebuild the shipped corpus", path, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw DataError(fmt::format("{}: cannot stat ({})", path, std::strerror(errno)));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw DataError(fmt::format("{}: mmap failed ({})", path, std::strerror(errno)));
      }
      data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace sl::data
