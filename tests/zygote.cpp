// zygote.cpp: the zygote of tests/zygote.h: its start, its loop, the run it forks, and the client side.
#include "zygote.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <wordexp.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "cli.h"

extern char** environ;

namespace sl::test::zygote {
namespace {

using Env = std::map<std::string, std::string>;

int g_control = -1;     // the test process's end of the socket to the zygote
std::string g_trainer;  // the path a command must name
Env g_start_env;        // the environment the zygote's libraries loaded under
std::mutex g_send;

constexpr size_t kMaxRequest = 1 << 20;

Env env_of(char** envp) {
  Env out;
  for (char** e = envp; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

bool is_run_time(const std::string& name) {
  for (const auto& v : kRunTimeVariables)
    if (v.back() == '_' ? name.rfind(v, 0) == 0 : name == v) return true;
  return false;
}

// Whether `env` differs from the zygote's environment only in variables a trainer reads while it runs.
bool only_run_time_changes(const Env& env) {
  for (const auto& [k, v] : env) {
    const auto it = g_start_env.find(k);
    if ((it == g_start_env.end() || it->second != v) && !is_run_time(k)) return false;
  }
  for (const auto& [k, v] : g_start_env)
    if (!env.count(k) && !is_run_time(k)) return false;
  return true;
}

// `NAME=VALUE` with NAME a shell variable name.
bool is_assignment(const std::string& w) {
  const auto eq = w.find('=');
  if (eq == std::string::npos || eq == 0) return false;
  for (size_t i = 0; i < eq; ++i) {
    const char c = w[i];
    const bool ok = c == '_' || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

void assign(Env& env, const std::string& w) {
  const auto eq = w.find('=');
  env[w.substr(0, eq)] = w.substr(eq + 1);
}

// ---- the wire: a request is NUL-terminated strings (cwd, the count of env entries, env, argv) with two
// descriptors (the run's output, the reply socket); a reply is the run's pid, then its wait status.

std::string encode(const Command& c) {
  std::string out = c.cwd + '\0' + std::to_string(c.env.size()) + '\0';
  for (const auto& e : c.env) out += e + '\0';
  for (const auto& a : c.argv) out += a + '\0';
  return out;
}

Command decode(const char* p, size_t n) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < n;) {
    const size_t len = ::strnlen(p + i, n - i);
    parts.emplace_back(p + i, len);
    i += len + 1;
  }
  Command c;
  c.cwd = parts.at(0);
  const size_t n_env = std::stoul(parts.at(1));
  c.env.assign(parts.begin() + 2, parts.begin() + 2 + static_cast<std::ptrdiff_t>(n_env));
  c.argv.assign(parts.begin() + 2 + static_cast<std::ptrdiff_t>(n_env), parts.end());
  return c;
}

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r, n -= static_cast<size_t>(r);
  }
  return true;
}

// ---- the zygote's side ----

// The run: what the shell would have set up, then the trainer's main. Never returns.
[[noreturn]] void become_run(const Command& c, int out) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (int s = 1; s < NSIG; ++s) ::signal(s, SIG_DFL);
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (!c.cwd.empty() && ::chdir(c.cwd.c_str()) != 0) {
    ::dprintf(out, "sh: 1: cd: can't cd to %s\n", c.cwd.c_str());
    ::_exit(2);
  }
  ::dup2(out, 1);
  ::dup2(out, 2);
  if (out > 2) ::close(out);
  ::clearenv();
  for (const auto& e : c.env) ::putenv(::strdup(e.c_str()));
  std::vector<char*> argv;
  for (const auto& a : c.argv) argv.push_back(::strdup(a.c_str()));
  argv.push_back(nullptr);
  std::exit(sl::run_cli(static_cast<int>(c.argv.size()), argv.data()));
}

// The waiter: forks the run, sends its pid, waits for it, sends its wait status. Never returns.
[[noreturn]] void wait_for_run(const Command& c, int out, int reply) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::signal(SIGCHLD, SIG_DFL);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(reply);
    become_run(c, out);
  }
  ::close(out);
  const int32_t sent_pid = pid;
  if (!write_all(reply, &sent_pid, sizeof sent_pid) || pid < 0) ::_exit(1);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const int32_t sent_status = status;
  write_all(reply, &sent_status, sizeof sent_status);
  ::_exit(0);
}

// One request: its command and its two descriptors; false when the test process has gone.
bool receive(int control, std::vector<char>& buf, Command& c, int& out, int& reply) {
  alignas(cmsghdr) char ctl[CMSG_SPACE(2 * sizeof(int))];
  iovec iov{buf.data(), buf.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl;
  msg.msg_controllen = sizeof ctl;
  ssize_t n;
  while ((n = ::recvmsg(control, &msg, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (n <= 0) return false;
  const cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  if (cm == nullptr || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len != CMSG_LEN(2 * sizeof(int))) return false;
  int fds[2];
  std::memcpy(fds, CMSG_DATA(cm), sizeof fds);
  out = fds[0], reply = fds[1];
  c = decode(buf.data(), static_cast<size_t>(n));
  return true;
}

[[noreturn]] void serve(int control) {
  ::signal(SIGCHLD, SIG_IGN);  // the waiters are reaped by the kernel
  std::vector<char> buf(kMaxRequest);
  Command c;
  int out = -1, reply = -1;
  while (receive(control, buf, c, out, reply)) {
    if (::fork() == 0) {
      ::close(control);
      wait_for_run(c, out, reply);
    }
    ::close(out);
    ::close(reply);
  }
  ::_exit(0);
}

}  // namespace

void start(const std::string& trainer) {
  const char* exec = std::getenv("SUBLINEAR_TEST_EXEC");
  const char* carried = std::getenv("SUBLINEAR_TRAINER");
  if ((exec != nullptr && std::string(exec) == "1") || (carried != nullptr && *carried != '\0')) return;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return;
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(sv[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(0);
    serve(sv[1]);
  }
  ::close(sv[1]);
  if (pid < 0) {
    ::close(sv[0]);
    return;
  }
  g_control = sv[0];
  g_trainer = trainer;
  g_start_env = env_of(environ);
}

bool running() { return g_control >= 0; }

std::optional<std::vector<std::string>> words(const std::string& s) {
  if (s.find('\n') != std::string::npos) return std::nullopt;
  wordexp_t we{};
  if (::wordexp(s.c_str(), &we, WRDE_NOCMD) != 0) {
    ::wordfree(&we);
    return std::nullopt;
  }
  std::vector<std::string> out(we.we_wordv, we.we_wordv + we.we_wordc);
  ::wordfree(&we);
  return out;
}

std::optional<Command> parse(const std::string& cmd) {
  if (!running()) return std::nullopt;
  Command c;
  std::string rest = cmd;
  if (rest.rfind("cd ", 0) == 0) {
    const auto amp = rest.find(" && ");
    if (amp == std::string::npos) return std::nullopt;
    const auto dir = words(rest.substr(3, amp - 3));
    if (!dir || dir->size() != 1) return std::nullopt;
    c.cwd = dir->front();
    rest.erase(0, amp + 4);
  }
  const auto w = words(rest);
  if (!w) return std::nullopt;
  Env env = env_of(environ);
  size_t i = 0;
  for (; i < w->size() && is_assignment((*w)[i]); ++i) assign(env, (*w)[i]);
  if (i < w->size() && (*w)[i] == "env") {
    for (++i; i < w->size();) {
      if ((*w)[i] == "-u" && i + 1 < w->size()) {
        env.erase((*w)[i + 1]);
        i += 2;
      } else if (is_assignment((*w)[i])) {
        assign(env, (*w)[i++]);
      } else {
        break;
      }
    }
  }
  if (i >= w->size() || (*w)[i] != g_trainer || !only_run_time_changes(env)) return std::nullopt;
  c.argv.assign(w->begin() + static_cast<std::ptrdiff_t>(i), w->end());
  for (const auto& [k, v] : env) c.env.push_back(k + "=" + v);
  return c;
}

std::optional<Run> spawn(const Command& c, int out_fd) {
  if (!running()) return std::nullopt;
  const std::string request = encode(c);
  if (request.size() > kMaxRequest) return std::nullopt;
  int rp[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, rp) != 0) return std::nullopt;
  alignas(cmsghdr) char ctl[CMSG_SPACE(2 * sizeof(int))]{};
  iovec iov{const_cast<char*>(request.data()), request.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl;
  msg.msg_controllen = sizeof ctl;
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
  const int fds[2] = {out_fd, rp[1]};
  std::memcpy(CMSG_DATA(cm), fds, sizeof fds);
  ssize_t sent;
  {
    std::lock_guard<std::mutex> lock(g_send);
    while ((sent = ::sendmsg(g_control, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
  }
  ::close(rp[1]);
  int32_t pid = -1;
  if (sent != static_cast<ssize_t>(request.size()) || !read_all(rp[0], &pid, sizeof pid) || pid <= 0) {
    ::close(rp[0]);
    return std::nullopt;  // nothing started: the zygote is gone or could not fork
  }
  return Run{pid, rp[0]};
}

int wait(Run& run) {
  int32_t status = 0;
  const bool got = read_all(run.reply, &status, sizeof status);
  ::close(run.reply);
  run.reply = -1;
  if (!got) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::optional<Output> run(const std::string& cmd) {
  const auto c = parse(cmd);
  if (!c) return std::nullopt;
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return std::nullopt;
  auto r = spawn(*c, p[1]);
  ::close(p[1]);
  if (!r) {
    ::close(p[0]);
    return std::nullopt;
  }
  Output o{-1, ""};
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    o.text.append(buf, static_cast<size_t>(n));
  }
  ::close(p[0]);
  o.code = wait(*r);
  return o;
}

}  // namespace sl::test::zygote
