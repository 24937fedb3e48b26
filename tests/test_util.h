// Shared test helpers: run the trainer binary, temp directories, reading JSON files.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace sl::test {

inline const std::string kSourceDir = SUBLINEAR_SOURCE_DIR;
inline const std::string kTrainer = SUBLINEAR_TRAINER;

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, returns its exit code and combined output.
inline Result run(const std::string& cmd) {
  Result r{-1, ""};
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Runs the trainer from the source directory (so configs/ and data/ resolve) with arguments
// appended verbatim, on one intra-op thread so parallel ctest jobs do not oversubscribe the cores.
inline Result trainer(const std::string& args) {
  return run("cd " + kSourceDir + " && OMP_NUM_THREADS=1 " + kTrainer + " " + args);
}

// A fresh, empty directory under the system temp dir, removed on destruction.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() /
           ("sublinear-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name, const std::string& text) const {
    auto p = path / name;
    std::ofstream(p) << text;
    return p.string();
  }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace sl::test
