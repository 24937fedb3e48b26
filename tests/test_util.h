// Shared test helpers: run the trainer binary, temp directories, reading JSON files.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

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

// A TCP port that nothing listens on right now (bound to port 0, then released).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// The environment torchrun gives rank `rank` of `world` on one machine (the agent store off: rank 0
// hosts the TCPStore), as a shell prefix.
inline std::string rank_env(int rank, int world, int port) {
  return "RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_RANK=" +
         std::to_string(rank) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " OMP_NUM_THREADS=1";
}

inline std::string read_text(const std::filesystem::path& p);

// Runs `world` trainer processes (ranks 0..world-1, one thread each) with the same arguments, waits
// for all, and returns each rank's exit code and output.
struct MultiResult {
  std::vector<int> codes;
  std::vector<std::string> outputs;
};
inline MultiResult launch(int world, const std::string& args) {
  TempDir logs("launch");
  const int port = free_port();
  std::string script = "cd " + kSourceDir + " && ";
  for (int r = 0; r < world; ++r) {
    const auto log = (logs.path / ("rank" + std::to_string(r))).string();
    script += "( " + rank_env(r, world, port) + " " + kTrainer + " " + args + " > " + log + ".log 2>&1; echo $? > " +
              log + ".code ) & ";
  }
  script += "wait";
  run(script);
  MultiResult m;
  for (int r = 0; r < world; ++r) {
    const auto base = logs.path / ("rank" + std::to_string(r));
    std::string code = read_text(base.string() + ".code");
    m.codes.push_back(code.empty() ? -1 : std::stoi(code));
    m.outputs.push_back(read_text(base.string() + ".log"));
  }
  return m;
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace sl::test
