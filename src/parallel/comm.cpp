// c10d rendezvous and process group (Gloo on CPU, NCCL on CUDA when the build has it).
#include "parallel/comm.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>
// SUBLINEAR_NCCL (CMakeLists.txt): nccl.h of LibTorch's NCCL version was found. Not USE_C10D_NCCL,
// which the torch wheel's CMake target defines for every file of a CUDA build, nccl.h or not.
#ifdef SUBLINEAR_NCCL
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace sl::parallel {
namespace {

std::string env_str(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*end != '\0')
    throw ConfigError(fmt::format("environment variable {}='{}' is not an integer (set by the launcher; unset it for "
                                  "one process)", name, v));
  return x;
}

std::string short_what(const std::exception& e) {
  std::string s = e.what();
  if (auto nl = s.find("\nException raised from"); nl != std::string::npos) s.resize(nl);
  if (s.size() > 400) s.resize(400);
  return s;
}

}  // namespace

LaunchEnv LaunchEnv::from_env() {
  LaunchEnv e;
  e.world = env_int("WORLD_SIZE", 1);
  e.rank = env_int("RANK", 0);
  e.local_rank = env_int("LOCAL_RANK", e.rank);
  e.local_world = env_int("LOCAL_WORLD_SIZE", e.world);
  e.master_addr = env_str("MASTER_ADDR", "127.0.0.1");
  e.master_port = env_int("MASTER_PORT", 29500);
  e.agent_store = env_str("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  e.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  if (e.world < 1) throw ConfigError(fmt::format("WORLD_SIZE={} must be >= 1", e.world));
  if (e.rank < 0 || e.rank >= e.world)
    throw ConfigError(fmt::format("RANK={} is outside [0, WORLD_SIZE={})", e.rank, e.world));
  if (e.local_rank < 0 || e.local_rank >= e.local_world)
    throw ConfigError(fmt::format("LOCAL_RANK={} is outside [0, LOCAL_WORLD_SIZE={})", e.local_rank, e.local_world));
  if (e.master_port <= 0 || e.master_port > 65535)
    throw ConfigError(fmt::format("MASTER_PORT={} is not a TCP port", e.master_port));
  return e;
}

config::Backend resolve_backend(config::Backend backend, c10::Device device) {
  using B = config::Backend;
  const B b = backend == B::kAuto ? (device.is_cuda() ? B::kNccl : B::kGloo) : backend;
  if (b == B::kNccl && !device.is_cuda())
    throw ConfigError("parallel.backend: nccl needs CUDA tensors; this run is on CPU: use gloo or auto");
  if (b == B::kNccl && !nccl_built())
    throw ConfigError("parallel.backend: nccl: this build has no NCCL backend (CMake found no nccl.h of the NCCL "
                      "version LibTorch was built with: see the `sublinear: NCCL` line of its output); use gloo, or "
                      "install the nvidia-nccl wheel torch requires and reconfigure");
  return b;
}

bool nccl_built() {
#ifdef SUBLINEAR_NCCL
  return true;
#else
  return false;
#endif
}

// ProcessGroupNCCL's failure handling is set by variables it reads when a process group is created
// (torch 2.11: names in ProcessGroupNCCL.hpp, defaults and uses in ProcessGroupNCCL.cpp). A collective
// fails when NCCL reports an error or it has not finished parallel.timeout_s after its launch. The
// watchdog thread, which polls every collective each 100 ms, then marks it failed, logs it, posts a
// "dump" flag to the store (a TCPStore set: sent, no reply awaited), sleeps 4 x
// TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (the flight recorder's time to dump) and acts as
// TORCH_NCCL_ASYNC_ERROR_HANDLING says. Seeing the flag, process group 0's heartbeat monitor
// (TORCH_NCCL_DUMP_ON_TIMEOUT) dumps the flight recorder, sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC,
// then SIGABRTs the process unless the group was shut down or aborted meanwhile; the group's
// destructor joins that thread, sleep included. With the defaults a failing rank dies by SIGABRT with
// no summary, or is held ~8 minutes at its exit. Set here, each only when neither it nor its alias is
// already in the environment (the user's setting wins):
//  - TORCH_NCCL_ASYNC_ERROR_HANDLING: default 3 (SkipCleanUp: the watchdog rethrows on its own thread,
//    std::terminate, SIGABRT, no summary). Set to 2 (CleanUpOnly): the watchdog aborts this rank's
//    communicators (ncclCommAbort: the kernels waiting on the peer stop, so the stream, and the host
//    read waiting on it, move on) and leaves the process alive; Comm::check() after that read (or
//    Pending::wait, or the next launch on an aborted communicator) throws DistError: exit 5, summary.
//  - TORCH_NCCL_DUMP_ON_TIMEOUT: default 1. Set to 0: the heartbeat monitor ignores a failed
//    collective (no dump, no sleep, no SIGABRT). It still SIGABRTs a watchdog that makes no progress
//    for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (default 480 s; TORCH_NCCL_ENABLE_MONITORING default 1):
//    both left as they are, since a watchdog stuck in a CUDA or NCCL call leaves nothing else that can
//    end the rank, and 480 s is far above any stall of a working watchdog.
//  - TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: default 15000, i.e. a 60 s sleep before the abort, and
//    again for each further failed collective in the watchdog's list (the destructor's join waits them
//    out). Set to 0, unless the user turned dumps on (TORCH_NCCL_DUMP_ON_TIMEOUT true), who then wants
//    the time for them.
// Left at their defaults: TORCH_NCCL_BLOCKING_WAIT (0: a wait never blocks the host, Pending::wait) and
// TORCH_NCCL_PROPAGATE_ERROR (0). In 2.11 a propagated error only sets the other ranks' process-group
// error to REMOTE_ERROR and aborts nothing, so a rank blocked on the failed peer still ends at its own
// timeout; and it makes every watchdog ask the store each 100 ms with a blocking round trip: with the
// store's host (rank 0) hung, each ask waits out the store's timeout (parallel.timeout_s) while the
// watchdog cannot time the collective out; with it dead, each ask logs a warning, ten a second.
// The bound: a rank whose collective failed (a peer that died or hung) exits 5 with its summary within
// parallel.timeout_s of that collective's launch + 0.1 s (the watchdog's poll) + ncclCommAbort's own
// time (local: it stops this rank's kernels and frees the communicator, waiting for no peer) + the
// run's wrap-up (summary.json); Comm::close() then aborts again (a no-op on aborted communicators) and
// joins the watchdog, which drains its list without sleeping.
std::vector<std::pair<std::string, std::string>> nccl_env_defaults(const std::map<std::string, std::string>& set) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!set.contains("TORCH_NCCL_ASYNC_ERROR_HANDLING") && !set.contains("NCCL_ASYNC_ERROR_HANDLING"))
    out.emplace_back("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2");
  const auto dump = set.find("TORCH_NCCL_DUMP_ON_TIMEOUT");
  if (dump == set.end()) out.emplace_back("TORCH_NCCL_DUMP_ON_TIMEOUT", "0");
  // ProcessGroupNCCL's getCvarBool: y, yes, 1, t, true (any case) are true.
  std::string v = dump == set.end() ? "" : dump->second;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const bool dumping = v == "y" || v == "yes" || v == "1" || v == "t" || v == "true";
  if (!dumping && !set.contains("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"))
    out.emplace_back("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "0");
  return out;
}

std::map<std::string, std::string> nccl_env_now() {
  std::map<std::string, std::string> now;
  for (const char* name : {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                           "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"})
    if (const char* v = std::getenv(name)) now[name] = v;
  return now;
}

Pending::Pending(Comm* comm, c10::intrusive_ptr<c10d::Work> work, std::string what)
    : comm_(comm), work_(std::move(work)), what_(std::move(what)) {}
Pending::Pending(Pending&&) noexcept = default;
Pending& Pending::operator=(Pending&& other) noexcept {
  if (this == &other) return *this;
  abandon();
  comm_ = other.comm_;
  work_ = std::move(other.work_);
  what_ = std::move(other.what_);
  then_ = std::move(other.then_);
  return *this;
}
Pending::~Pending() { abandon(); }

// A collective dropped before its wait (an exception between launch and wait): whether it finished is
// unknown here, so the process group is aborted, not shut down, at the end (Comm::close).
void Pending::abandon() noexcept {
  if (work_ && comm_) comm_->abandoned_.fetch_add(1);
  work_.reset();
}

void Pending::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  try {
    // Gloo: blocks the host until the collective is done, and enforces the process group's timeout
    // itself (a dead peer fails at once). NCCL: orders the current CUDA stream after the collective
    // and returns without waiting for it; a failure is found by ProcessGroupNCCL's watchdog (see the
    // Comm constructor), already here if it has found it, else by Comm::check().
    work->wait();
    if (work->exception()) std::rethrow_exception(work->exception());
  } catch (const std::exception& e) {
    comm_->fail(what_, short_what(e));
  }
  if (then_) {
    auto then = std::move(then_);
    then_ = nullptr;
    then();
  }
  if (comm_->backend_ == config::Backend::kGloo) await_release(work);
}

// Gloo's worker thread drops its reference to a finished work (and with it the tensors the work
// holds) a moment after wait() returns; under load, many milliseconds later. Let that happen first,
// so a buffer we drop next is freed here, now, and not at a moment that depends on thread scheduling
// (e.g. inside the next step's memory peak). At most 100 ms. Not for NCCL: its wait() returns before
// the collective ran, and the CUDA caching allocator already keeps a buffer a stream still uses.
void Pending::await_release(const c10::intrusive_ptr<c10d::Work>& work) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
}

c10::intrusive_ptr<c10d::Backend> Comm::make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                   int64_t size, std::chrono::milliseconds timeout) const {
  if (backend_ == config::Backend::kGloo) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    const std::string iface = env_str("GLOO_SOCKET_IFNAME", "");
    if (!iface.empty())
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
    else if (env_.master_addr == "127.0.0.1" || env_.master_addr == "localhost")
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 2;
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), opts);
  }
#ifdef SUBLINEAR_NCCL
  // Non-blocking waits (ProcessGroupNCCL's default): Work::wait() only orders the CUDA stream, so
  // a step's collectives never stall the host; its one read waits for them with everything else.
  // Errors are found by ProcessGroupNCCL's watchdog thread, which then aborts the communicators
  // and leaves the process alive, as the variables set here make it (nccl_env_defaults above).
  for (const auto& [name, value] : nccl_env_defaults(nccl_env_now()))
    ::setenv(name.c_str(), value.c_str(), /*overwrite=*/0);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), opts);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  return {};
#endif
}

std::vector<c10d::Backend*> Comm::backends() const {
  std::vector<c10d::Backend*> out;
  if (pg_) out.push_back(pg_.get());
  if (seq_pg_) out.push_back(seq_pg_.get());
  return out;
}

Comm::Comm(const LaunchEnv& env, const config::ParallelConfig& cfg, c10::Device device)
    : env_(env), device_(device), timeout_s_(cfg.timeout_s), mesh_(cfg.mesh(env.world, env.rank)) {
  if (env_.world == 1) return;
  backend_ = resolve_backend(cfg.backend, device);
  const auto timeout = std::chrono::milliseconds(cfg.timeout_s * 1000);
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env_.master_port);
    o.timeout = timeout;
    if (env_.agent_store) {
      // torchrun's agent already hosts the store; every rank is a client under the attempt's prefix.
      o.isServer = false;
      o.waitWorkers = false;
      auto tcp = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, o);
      store_ = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env_.restart_count), tcp);
    } else {
      o.isServer = env_.rank == 0;
      o.numWorkers = static_cast<size_t>(env_.world);
      o.waitWorkers = true;
      store_ = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, o);
    }
    store_ = c10::make_intrusive<c10d::PrefixStore>("sublinear", store_);
    pg_ = make_backend(store_, env_.rank, env_.world, timeout);
    if (mesh_.sequence() > 1) {
      // Every rank makes its own group's process group, on a store prefix of that group alone.
      const auto group_store =
          c10::make_intrusive<c10d::PrefixStore>(fmt::format("sequence_group_{}", mesh_.data_rank()), store_);
      seq_pg_ = make_backend(group_store, mesh_.sequence_rank(), mesh_.sequence(), timeout);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DistError(
        fmt::format("rendezvous at {}:{} as rank {} of {} failed within parallel.timeout_s={} s: {}. Check "
                    "that every rank was started with the same MASTER_ADDR/MASTER_PORT/WORLD_SIZE and that "
                    "the port is free",
                    env_.master_addr, env_.master_port, env_.rank, env_.world, cfg.timeout_s, short_what(e)));
  }
  try {
    barrier("start-up barrier");
  } catch (...) {
    close();  // no destructor runs for a constructor that throws: abort the group here
    throw;
  }
}

Comm::~Comm() { close(); }

void Comm::close() noexcept {
  if (!pg_) return;
  bool clean = false;
  try {
    // Gloo's shutdown() does nothing (torch 2.11): only NCCL's needs every rank at the same exit.
    const bool together = backend_ != config::Backend::kNccl || leave_together_;
    clean = together && failure_.empty() && abandoned_.load() == 0 && collectives_done();
    if (clean)
      for (auto* pg : backends()) pg->shutdown();
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: shutting the {} process group down failed, aborting it: {}", env_.rank, backend(),
                 short_what(e));
    clean = false;
  } catch (...) {
    clean = false;
  }
  try {
    if (!clean)
      for (auto* pg : backends()) pg->abort();
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: aborting the {} process group: {}", env_.rank, backend(), short_what(e));
  } catch (...) {
  }
  seq_pg_.reset();
  pg_.reset();  // after shutdown() or abort(): ProcessGroupNCCL's destructor only joins its threads
}

// Whether every collective this rank waited for has finished (a collective never waited for is
// counted by abandoned_ instead). NCCL: each wait ordered the current stream after its collective,
// and the trainer waits on the device's default stream only (the one stream it computes on, also
// autograd's in backward), so an event recorded on it now completes once they have all finished; a
// collective still running is given parallel.timeout_s, by when the watchdog has failed it (or,
// sooner, reported an error). Gloo: every wait returned after its collective ended. This is what makes
// shutdown() safe: its ncclCommFinalize synchronizes the communicator's streams while holding the
// communicator's lock, so with a collective hung on a dead peer it would never return, and the
// watchdog, waiting for the same lock to abort it, could not help.
bool Comm::collectives_done() {
#ifdef SUBLINEAR_NCCL
  if (backend_ != config::Backend::kNccl) return true;
  c10::cuda::CUDAEvent passed;
  passed.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s_);
  const auto healthy = [&] {
    for (auto* pg : backends())
      if (pg->getError() != c10d::ErrorType::SUCCESS) return false;
    return true;
  };
  while (!passed.query()) {
    if (!healthy() || std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return healthy();
#else
  return true;
#endif
}

void Comm::check(const std::string& what) {
#ifdef SUBLINEAR_NCCL
  if (backend_ != config::Backend::kNccl) return;
  auto error = c10d::ErrorType::SUCCESS;  // a flag the watchdog set: no device or network wait
  for (auto* pg : backends())
    if (error == c10d::ErrorType::SUCCESS) error = pg->getError();
  if (error == c10d::ErrorType::SUCCESS) return;
  const char* kind = error == c10d::ErrorType::TIMEOUT        ? "a collective timed out"
                     : error == c10d::ErrorType::REMOTE_ERROR ? "a peer reported an NCCL error"
                                                              : "an NCCL error";
  fail(what, fmt::format("ProcessGroupNCCL's watchdog found {} and aborted the communicators", kind));
#else
  (void)what;
#endif
}

void Comm::fail(const std::string& what, const std::string& detail) {
  if (failure_.empty())
    failure_ =
        fmt::format("rank {} of {}: {} failed (a peer died, hung past parallel.timeout_s={} s, or disagrees): {}",
                    env_.rank, env_.world, what, timeout_s_, detail);
  throw DistError(failure_);
}

// Starts a collective; a failure to even start it (a broken connection) is a distributed failure.
Pending Comm::start(const std::string& what, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch) {
  try {
    return Pending(this, launch(), what);
  } catch (const std::exception& e) {
    fail(what, short_what(e));
  }
}

Pending Comm::all_reduce_sum(const at::Tensor& t, const std::string& what, bool max) {
  if (!distributed()) return {};
  return start(what, [&] {
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    return pg_->allreduce(ts, opts);
  });
}

Pending Comm::all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) {
  if (!distributed()) {
    if (!out.is_same(in)) out.copy_(in);
    return {};
  }
  if (backend_ == config::Backend::kGloo) {
    // Gloo's all-gather receives into a flat output of its own, the size of `out`, made on its worker
    // thread and copied into `out` when the collective ends: a second buffer whose lifetime depends on
    // that thread (a ZeRO-3 prefetch holds it through a unit's compute, so a step's peak would move by
    // a unit from run to run). Summing `out` over ranks in place, every slot but this rank's zeroed,
    // gives the same values in no memory beyond `out` (x + 0 is x exactly, except that -0 becomes +0),
    // at twice the traffic of an all-gather.
    const int64_t n = in.numel(), lo = env_.rank * n, total = out.numel();
    auto mine = out.narrow(0, lo, n);
    if (lo > 0) out.narrow(0, 0, lo).zero_();
    if (lo + n < total) out.narrow(0, lo + n, total - lo - n).zero_();
    if (!(mine.is_alias_of(in) && mine.data_ptr() == in.data_ptr())) mine.copy_(in);
    return all_reduce_sum(out, what);
  }
  return start(what, [&] {
    auto o = out, i = in;
    return pg_->_allgather_base(o, i);
  });
}

Pending Comm::reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in, const std::string& what) {
  if (!distributed()) {
    out.copy_(in);
    return {};
  }
  if (backend_ == config::Backend::kGloo) {
    // Gloo's reduce-scatter is an all-reduce of a copy of the input anyway; all-reducing the input
    // in place does the same traffic without the hidden copy (whose allocation time would depend on
    // Gloo's thread). `out` is then this rank's slice of it (often a view of exactly that slice).
    auto p = all_reduce_sum(in, what);
    const int64_t n = out.numel();
    p.then([out, in, n, rank = env_.rank] {
      auto mine = in.narrow(0, rank * n, n);
      if (!(out.is_alias_of(mine) && out.data_ptr() == mine.data_ptr())) out.copy_(mine);
    });
    return p;
  }
  return start(what, [&] {
    auto o = out, i = in;
    return pg_->_reduce_scatter_base(o, i);
  });
}

Pending Comm::all_to_all(const at::Tensor& out, const at::Tensor& in, const std::string& what) {
  if (!seq_pg_) {
    if (!out.is_same(in)) out.copy_(in);
    return {};
  }
  return start(what, [&] {
    auto o = out, i = in;
    std::vector<int64_t> even;  // empty split sizes: N equal chunks along dim 0
    return seq_pg_->alltoall_base(o, i, even, even);
  });
}

double Comm::all_reduce_sum(double v, const std::string& what) {
  if (!distributed()) return v;
  auto t = torch::tensor({v}, torch::TensorOptions().dtype(torch::kFloat64)).to(device_);
  all_reduce_sum(t, what).wait();
  const double out = t.item<double>();
  check(what);  // NCCL: the read returned; was the collective aborted?
  return out;
}

double Comm::all_reduce_max(double v, const std::string& what) {
  if (!distributed()) return v;
  auto t = torch::tensor({v}, torch::TensorOptions().dtype(torch::kFloat64)).to(device_);
  all_reduce_sum(t, what, /*max=*/true).wait();
  const double out = t.item<double>();
  check(what);  // NCCL: the read returned; was the collective aborted?
  return out;
}

std::vector<double> Comm::all_gather(const std::vector<double>& v, const std::string& what) {
  if (!distributed()) return v;
  const auto n = static_cast<int64_t>(v.size());
  auto in = torch::tensor(v, torch::TensorOptions().dtype(torch::kFloat64)).to(device_);
  auto out = torch::empty({n * env_.world}, in.options());
  all_gather(out, in, what).wait();
  out = out.cpu();
  check(what);
  return {out.data_ptr<double>(), out.data_ptr<double>() + n * env_.world};
}

Comm::Failure Comm::agree_on_failure(int code, const std::string& message, const std::string& what) {
  if (!distributed()) return code == 0 ? Failure{} : Failure{code, 0, message};
  const std::string key = fmt::format("failure/{}/", agreements_++);
  try {
    if (code != 0) store_->set(key + std::to_string(env_.rank), std::vector<uint8_t>(message.begin(), message.end()));
  } catch (const std::exception& e) {
    fail(what, fmt::format("posting this rank's error to the store: {}", e.what()));
  }
  const auto codes = all_gather(std::vector<double>{static_cast<double>(code)}, what);
  for (int64_t r = 0; r < env_.world; ++r) {
    const int c = static_cast<int>(codes[static_cast<size_t>(r)]);
    if (c == 0) continue;
    if (r == env_.rank) return {c, r, message};
    std::vector<uint8_t> text;
    try {
      text = store_->get(key + std::to_string(r));
    } catch (const std::exception& e) {
      fail(what, fmt::format("rank {} failed (exit {}) and its message could not be read: {}", r, c, e.what()));
    }
    return {c, r, std::string(text.begin(), text.end())};
  }
  return {};
}

void Comm::fail_together(int code, const std::string& message, const std::string& what) {
  const Failure f = agree_on_failure(code, message, what);
  if (f.code == 0) return;
  if (f.rank == env_.rank) throw_as(f.code, f.message);
  throw_as(f.code, fmt::format("rank {}: {} failed: {}", f.rank, what, f.message));
}

void Comm::barrier(const std::string& what) {
  if (!distributed()) return;
  // A one-element all-reduce: a barrier that goes through the same transport and timeout as the data.
  all_reduce_sum(0.0, what);
}

}  // namespace sl::parallel
