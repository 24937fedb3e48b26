// Shared test helpers: run the trainer binary, temp directories, reading JSON files.
#pragma once
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "zygote.h"

namespace sl::test {

// The source tree and the trainer binary: the build's (compiled in), unless the environment names
// others in SUBLINEAR_SOURCE_DIR / SUBLINEAR_TRAINER (bench/gpu.sh runs the test binaries on another
// machine, against a copy of the tree and a carried trainer). SUBLINEAR_PYTHON likewise, below.
inline std::string env_or(const char* name, const char* built) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(built);
}
inline const std::string kSourceDir = env_or("SUBLINEAR_SOURCE_DIR", SUBLINEAR_SOURCE_DIR);
inline const std::string kTrainer = env_or("SUBLINEAR_TRAINER", SUBLINEAR_TRAINER);

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line through /bin/sh, returns its exit code and combined output.
inline Result shell(const std::string& cmd) {
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

// Runs a shell command line, returns its exit code and combined output: a plain trainer run is forked
// from the zygote (tests/zygote.h: the same code and exit status, no process start), the rest is shell().
inline Result run(const std::string& cmd) {
  if (auto z = zygote::run(cmd)) return {z->code, std::move(z->text)};
  return shell(cmd);
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
// The ranks forked from the zygote (tests/zygote.h), each with its output in logs/rank<r>.log; nullopt
// when the zygote cannot take the command (nothing started then).
inline std::optional<MultiResult> launch_forked(int world, const std::string& args, const TempDir& logs, int port) {
  std::vector<zygote::Command> commands;
  for (int r = 0; r < world; ++r) {
    auto c = zygote::parse("cd " + kSourceDir + " && " + rank_env(r, world, port) + " " + kTrainer + " " + args);
    if (!c) return std::nullopt;
    commands.push_back(std::move(*c));
  }
  std::vector<zygote::Run> runs;
  for (int r = 0; r < world; ++r) {
    const auto log = logs.path / ("rank" + std::to_string(r) + ".log");
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    auto run = fd >= 0 ? zygote::spawn(commands[r], fd) : std::nullopt;
    if (fd >= 0) ::close(fd);
    if (!run) {  // the zygote failed midway: end the ranks it started, then the shell starts them all
      for (auto& started : runs) ::kill(started.pid, SIGKILL), zygote::wait(started);
      return std::nullopt;
    }
    runs.push_back(*run);
  }
  MultiResult m;
  for (int r = 0; r < world; ++r) {
    m.codes.push_back(zygote::wait(runs[r]));
    m.outputs.push_back(read_text(logs.path / ("rank" + std::to_string(r) + ".log")));
  }
  return m;
}

inline MultiResult launch(int world, const std::string& args) {
  TempDir logs("launch");
  const int port = free_port();
  if (auto m = launch_forked(world, args, logs, port)) return std::move(*m);
  // `cd DIR || exit 1;` (not `cd DIR && (rank 0) & (rank 1) &`, where the cd binds to rank 0's
  // subshell only): every rank starts in the source directory.
  std::string script = "cd " + kSourceDir + " || exit 1; ";
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

// A process started in the background, a child of this test process, so a test can signal it at a
// moment of its choosing and wait for it: `sh -c 'cd DIR && exec ENV... CMD > LOG 2>&1'` (exec: the
// pid is the command's own). The destructor SIGKILLs and reaps it if the test did not wait.
struct Background {
  pid_t pid = -1;
  std::filesystem::path log;  // stdout and stderr together
  int status = 0;             // waitpid status, after wait()

  Background(const std::string& env, const std::string& cmd, std::filesystem::path log_file) : log(std::move(log_file)) {
    const std::string line = "cd " + kSourceDir + " && exec env " + env + " " + cmd + " > " + log.string() + " 2>&1";
    const char* argv[] = {"/bin/sh", "-c", line.c_str(), nullptr};
    if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), environ) != 0) pid = -1;
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  ~Background() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      wait();
    }
  }
  bool running() const { return pid > 0; }
  bool signal(int sig) const { return pid > 0 && ::kill(pid, sig) == 0; }
  // Waits for the exit; returns the exit code, or 128 + the signal that killed it (as a shell says).
  int wait() {
    if (pid > 0) {
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      pid = -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
  }
  // Whether it has exited yet (reaps it if so).
  bool exited() {
    if (pid <= 0) return true;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      pid = -1;
      return true;
    }
    return false;
  }
  bool killed_by(int sig) const { return WIFSIGNALED(status) && WTERMSIG(status) == sig; }
  std::string output() const { return read_text(log); }
};

// The trainer in the background from the source directory, on one thread (see trainer()).
inline std::unique_ptr<Background> trainer_background(const std::string& args, const std::filesystem::path& log) {
  return std::make_unique<Background>("OMP_NUM_THREADS=1", kTrainer + " " + args, log);
}

// `world` ranks of the trainer in the background (rank r's output in <log_prefix>.rank<r>.log).
inline std::vector<std::unique_ptr<Background>> launch_background(int world, const std::string& args,
                                                                  const std::filesystem::path& log_prefix) {
  const int port = free_port();
  std::vector<std::unique_ptr<Background>> out;
  for (int r = 0; r < world; ++r)
    out.push_back(std::make_unique<Background>(rank_env(r, world, port), kTrainer + " " + args,
                                               log_prefix.string() + ".rank" + std::to_string(r) + ".log"));
  return out;
}

// Polls `pred` every `every` until it holds (true) or `timeout` passes (false).
template <class Pred>
bool poll_until(Pred&& pred, std::chrono::milliseconds timeout, std::chrono::milliseconds every = std::chrono::milliseconds(2)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(every);
  }
  return pred();
}

// ---- training states (tests/test_resume.cpp, tests/test_state.cpp) ----

inline const std::string kPython = env_or("SUBLINEAR_PYTHON", SUBLINEAR_PYTHON);

// The records of a JSONL file. strict: every line must parse (a final line without its newline
// too); otherwise lines that do not parse (a record being written right now) are left out.
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p, bool strict = true) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/strict);  // not strict: skip a line being written
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

// One optimizer step's record of metrics.jsonl (events left out).
struct StepRecord {
  int64_t step;
  double loss, grad_norm;
};
inline std::vector<StepRecord> step_records(const std::filesystem::path& metrics) {
  std::vector<StepRecord> out;
  for (const auto& r : read_jsonl(metrics))
    if (!r.contains("event"))
      out.push_back({r.at("step").get<int64_t>(), r.at("loss").get<double>(),
                     r.at("grad_norm").is_number() ? r.at("grad_norm").get<double>() : -1.0});
  return out;
}
// Step records written so far by a running trainer (a line being written is not counted).
inline size_t step_records_now(const std::filesystem::path& metrics) {
  size_t n = 0;
  for (const auto& r : read_jsonl(metrics, false))
    if (r.is_object() && !r.contains("event") && r.contains("step")) ++n;
  return n;
}
// The events of one kind in metrics.jsonl.
inline std::vector<nlohmann::json> events(const std::filesystem::path& metrics, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& r : read_jsonl(metrics))
    if (r.value("event", "") == kind) out.push_back(r);
  return out;
}

// "" when `got` is steps 1..N, each once, with (loss, grad_norm) bitwise equal (as the doubles the
// JSON numbers parse to) to `want`; otherwise what differs first.
inline std::string bitwise_diff(const std::vector<StepRecord>& got, const std::vector<StepRecord>& want) {
  std::ostringstream why;
  why.precision(17);
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i].step != static_cast<int64_t>(i) + 1) {
      why << "record " << i << " is step " << got[i].step << ", expected step " << i + 1 << " (duplicated or missing)";
      return why.str();
    }
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i)
    if (got[i].loss != want[i].loss || got[i].grad_norm != want[i].grad_norm) {
      why << "step " << got[i].step << ": loss " << got[i].loss << " vs " << want[i].loss << ", grad_norm "
          << got[i].grad_norm << " vs " << want[i].grad_norm;
      return why.str();
    }
  if (got.size() != want.size()) {
    why << got.size() << " step records, expected " << want.size();
    return why.str();
  }
  return "";
}

// The eval events (step, val_loss) of metrics.jsonl; "" when `got` equals `want` bitwise, else the
// first difference.
inline std::vector<std::pair<int64_t, double>> eval_records(const std::filesystem::path& metrics) {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& e : events(metrics, "eval")) out.emplace_back(e.at("step").get<int64_t>(), e.at("val_loss").get<double>());
  return out;
}
inline std::string eval_diff(const std::vector<std::pair<int64_t, double>>& got,
                             const std::vector<std::pair<int64_t, double>>& want) {
  std::ostringstream why;
  why.precision(17);
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i)
    if (got[i] != want[i]) {
      why << "eval " << i << ": step " << got[i].first << " val_loss " << got[i].second << " vs step " << want[i].first
          << " val_loss " << want[i].second;
      return why.str();
    }
  if (got.size() != want.size()) why << got.size() << " evals, expected " << want.size();
  return why.str();
}

// What a resumed run must reproduce bitwise: every step's (loss, grad_norm) and every eval's val_loss.
struct RunTrace {
  std::vector<StepRecord> steps;
  std::vector<std::pair<int64_t, double>> evals;
};
inline RunTrace trace(const std::filesystem::path& metrics) { return {step_records(metrics), eval_records(metrics)}; }
inline std::string trace_diff(const RunTrace& got, const RunTrace& want) {
  const std::string d = bitwise_diff(got.steps, want.steps);
  return d.empty() ? eval_diff(got.evals, want.evals) : d;
}

// ---- the Python references (tests/*.py) ----

// One Python interpreter for the test process (tests/py_worker.py), started at the first call: each
// call runs a script in it as `python SCRIPT ARGS` would, without importing torch (and transformers)
// again. Its pipe ends are close-on-exec, so the trainers and shells the tests start do not hold them
// and the worker sees the end of its input when this process ends.
class PythonWorker {
 public:
  static PythonWorker& get() {
    static PythonWorker worker;
    return worker;
  }
  PythonWorker(const PythonWorker&) = delete;
  PythonWorker& operator=(const PythonWorker&) = delete;
  ~PythonWorker() { stop(); }

  // The script's exit status and output (stdout and stderr together); code -1 when the worker died.
  Result call(const std::vector<std::string>& argv) {
    if (pid_ < 0 && !start()) return {-1, "could not start " + kPython + " tests/py_worker.py"};
    const std::string request = nlohmann::json{{"argv", argv}}.dump() + "\n";
    std::string line;
    if (!write_all(request) || !read_line(line)) {
      stop();
      return {-1, "tests/py_worker.py ended while running: " + nlohmann::json(argv).dump()};
    }
    const auto reply = nlohmann::json::parse(line);
    return {reply.at("code").get<int>(), reply.at("output").get<std::string>()};
  }

 private:
  PythonWorker() = default;

  bool start() {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0) return false;
    if (::pipe2(out, O_CLOEXEC) != 0) {
      ::close(in[0]);
      ::close(in[1]);
      return false;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    const std::string script = kSourceDir + "/tests/py_worker.py";
    char* const args[] = {const_cast<char*>(kPython.c_str()), const_cast<char*>(script.c_str()), nullptr};
    const int rc = ::posix_spawn(&pid_, kPython.c_str(), &actions, nullptr, args, environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    ::close(out[1]);
    if (rc != 0) {
      ::close(in[1]);
      ::close(out[0]);
      pid_ = -1;
      return false;
    }
    to_ = in[1];
    from_ = out[0];
    return true;
  }

  void stop() {
    if (pid_ < 0) return;
    ::close(to_);
    ::close(from_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    buffered_.clear();
  }

  bool write_all(const std::string& s) {
    for (size_t done = 0; done < s.size();) {
      const ssize_t n = ::write(to_, s.data() + done, s.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  bool read_line(std::string& line) {
    std::array<char, 65536> buf{};
    for (;;) {
      if (const auto nl = buffered_.find('\n'); nl != std::string::npos) {
        line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return true;
      }
      const ssize_t n = ::read(from_, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buffered_.append(buf.data(), static_cast<size_t>(n));
    }
  }

  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string buffered_;
};

// tests/<script> with `args` split and unquoted as the shell would (`'{"a": 1}'` is one argument), run by
// the worker above; arguments the shell would do more with (`$(...)`, a pipe) go to a fresh interpreter.
inline Result python(const std::string& script, const std::string& args) {
  const std::string path = kSourceDir + "/tests/" + script;
  auto argv = zygote::words(args);
  if (!argv) return run(kPython + " " + path + " " + args);
  argv->insert(argv->begin(), path);
  return PythonWorker::get().call(*argv);
}

// tests/state_compare.py (the reference safetensors package): `check DIR` or `compare A B`.
inline Result state_compare(const std::string& args) { return python("state_compare.py", args); }

// A tmpfs of `size` bytes ("1m", "25000000") mounted on `dir` for a disk-full test, unmounted on
// destruction. mount(2) needs root (or CAP_SYS_ADMIN): when it fails, `mounted` is false and `error`
// says why, and the test skips that case.
struct TmpfsMount {
  std::filesystem::path dir;
  bool mounted = false;
  std::string error;
  TmpfsMount(std::filesystem::path d, const std::string& size) : dir(std::move(d)) {
    std::filesystem::create_directories(dir);
    mounted = ::mount("tmpfs", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, ("size=" + size).c_str()) == 0;
    if (!mounted) error = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted && ::umount2(dir.c_str(), 0) != 0) ::umount2(dir.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
};

}  // namespace sl::test
