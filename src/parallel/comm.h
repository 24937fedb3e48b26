// Multi-process communication on PyTorch's own c10d: the launch environment torchrun (or any launcher
// that sets the same variables) gives a process, the rendezvous over c10d::TCPStore, and one process
// group (ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA) behind a narrow interface: sum-all-reduce,
// all-gather and reduce-scatter of flat tensors, each returning a handle to wait on. Every wait checks
// the collective's result (Gloo: it blocks until done; NCCL: it only orders the CUDA stream, and
// check() after the step's host read asks for what the watchdog found); a failure (peer died,
// timeout) throws DistError (exit 5) and is remembered, so an error that surfaces through autograd
// (collectives launched from gradient hooks) is still reported as a distributed failure. The process
// group is closed when the Comm goes: shut down cleanly after a run whose collectives all finished,
// aborted (never waiting on a peer) after a failure.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "config/config.h"
#include "errors.h"
#include "layout/mesh.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace sl::parallel {

struct DistError : Error {
  explicit DistError(const std::string& what) : Error(kExitDistributed, what) {}
};

// What the launcher says about this process (torchrun's variables; all optional for one process).
struct LaunchEnv {
  int64_t rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  bool agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store
  int64_t restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  // Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the agent-store
  // variables. Throws ConfigError for malformed or inconsistent values (e.g. RANK >= WORLD_SIZE).
  static LaunchEnv from_env();
};

// The backend parallel.backend resolves to for a device (gloo or nccl). Throws ConfigError when
// nccl is asked for on CPU or the build has no NCCL.
config::Backend resolve_backend(config::Backend backend, c10::Device device);

// Whether this build has the NCCL backend (CMake found the nccl.h of LibTorch's NCCL version).
bool nccl_built();

// The ProcessGroupNCCL variables the trainer sets before creating the process group, given those of
// them already in the environment (`set`: name -> value, as nccl_env_now() reads them): each
// (name, value) to set. A variable already set, under its name or its deprecated alias, is the
// user's and is left alone. comm.cpp says why each is set and what bound on a failing rank's exit
// they give.
std::vector<std::pair<std::string, std::string>> nccl_env_defaults(const std::map<std::string, std::string>& set);
// The variables nccl_env_defaults() looks at, as this process's environment has them.
std::map<std::string, std::string> nccl_env_now();

// A pending collective. wait() blocks until it finished and throws DistError when it failed.
class Comm;
class Pending {
 public:
  Pending() = default;
  Pending(Comm* comm, c10::intrusive_ptr<c10d::Work> work, std::string what);
  Pending(Pending&&) noexcept;
  Pending& operator=(Pending&&) noexcept;
  ~Pending();  // a collective never waited for counts as abandoned (~Comm then aborts)
  void wait();
  // Runs after a successful wait() (e.g. copying this rank's slice out of an all-reduced buffer).
  // Gloo: wait() returns once the backend has also released the work, so the tensors it held are free.
  // NCCL: wait() returns at once, the current stream ordered after the collective.
  void then(std::function<void()> fn) { then_ = std::move(fn); }

 private:
  static void await_release(const c10::intrusive_ptr<c10d::Work>& work);
  void abandon() noexcept;
  Comm* comm_ = nullptr;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  std::function<void()> then_;
};

class Comm {
 public:
  // world 1: no process group, every collective is the identity. Otherwise rendezvous (rank 0 hosts
  // the TCPStore at MASTER_ADDR:MASTER_PORT, or every rank joins torchrun's agent store) and create
  // the process group. Throws DistError when the rendezvous fails within parallel.timeout_s.
  Comm(const LaunchEnv& env, const config::ParallelConfig& cfg, c10::Device device);
  // Ends the process group; never throws. After a run whose every collective was waited for and
  // finished (NCCL: this rank's stream passed them; one still running is given at most
  // parallel.timeout_s, by when the watchdog has failed it) and no failure: Backend::shutdown() (NCCL:
  // flushes and destroys the communicators, so no "destroy_process_group() was not called" warning;
  // Gloo has none to call). Otherwise (a DistError, a collective abandoned or unfinished, a watchdog
  // error): Backend::abort() (NCCL: ncclCommAbort, which stops this rank's kernels and waits for no
  // peer). Then the process group is released. A failed start-up barrier does the same.
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int64_t rank() const { return env_.rank; }
  int64_t world() const { return env_.world; }
  const LaunchEnv& env() const { return env_; }
  // gloo, nccl, or none for one process
  std::string_view backend() const { return backend_ ? backend_->name() : "none"; }
  bool distributed() const { return env_.world > 1; }
  c10::Device device() const { return device_; }  // this rank's device (cuda:LOCAL_RANK or cpu)

  // In-place sum (max: maximum) over ranks of `t` (contiguous).
  Pending all_reduce_sum(const at::Tensor& t, const std::string& what, bool max = false);
  // out (world * n elements) <- concatenation of every rank's `in` (n elements), in rank order.
  Pending all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what);
  // out (n elements) <- this rank's n-element slice of the sum over ranks of `in` (world * n).
  Pending reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in, const std::string& what);
  // The sequence group (parallel.sequence = N > 1): the mesh's sequence group of this rank (N consecutive
  // ranks), a process group of their own. out <- the all-to-all of `in` over it: `in` is N equal contiguous chunks
  // along dim 0, chunk j goes to the group's rank j, and out's chunk j is what rank j sent this rank.
  // One rank in its group (N = 1): out <- in.
  Pending all_to_all(const at::Tensor& out, const at::Tensor& in, const std::string& what);
  // This rank's place in the process mesh (the launch's world and rank, parallel.*'s degrees).
  const layout::Mesh& mesh() const { return mesh_; }

  // Blocking conveniences.
  double all_reduce_sum(double v, const std::string& what);
  double all_reduce_max(double v, const std::string& what);
  std::vector<double> all_gather(const std::vector<double>& v, const std::string& what);
  void barrier(const std::string& what);

  // Every rank learns the first failure of a stretch some ranks may have failed alone (rank 0 writing
  // a file, checking a state): each passes its own outcome (code 0 = it went well, else its exit code
  // and message) and gets back the lowest failing rank's, the same on every rank (code 0 when none
  // failed). A failing rank posts its message to the store before the one collective (an all-gather of
  // codes), so the others read it after without waiting. Every rank must call it at the same point.
  struct Failure {
    int code = 0;        // 0: no rank failed
    int64_t rank = -1;   // the lowest failing rank
    std::string message;  // its message, as it gave it
  };
  Failure agree_on_failure(int code, const std::string& message, const std::string& what);
  // agree_on_failure, then every rank throws the agreed failure (throw_as: the failing rank's exit
  // code; its message, which the other ranks prefix with "rank R: ... failed: "). Returns when none failed.
  void fail_together(int code, const std::string& message, const std::string& what);

  // NCCL: throws DistError when ProcessGroupNCCL's watchdog found a failed or timed-out collective
  // (waits do not block the host, so errors surface here; call it after a host read). A host-side
  // flag check, no wait. Gloo (whose waits throw themselves) and one process: nothing.
  void check(const std::string& what);
  // The first collective failure seen (empty when none).
  const std::string& failure() const { return failure_; }
  // Every rank has met at the run's last agreement and leaves from there: the one exit at which NCCL's
  // shutdown() is safe (it finalizes the communicators, which waits for every rank to do the same; a
  // rank leaving alone while its peers are mid-step would hang there). Without it ~Comm aborts.
  void ranks_leave_together() { leave_together_ = true; }
  [[noreturn]] void fail(const std::string& what, const std::string& detail);

 private:
  friend class Pending;
  Pending start(const std::string& what, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch);
  // A process group of `size` ranks on `store` (Gloo or NCCL as backend_), this process its rank `rank`.
  c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                 int64_t size, std::chrono::milliseconds timeout) const;
  // The process groups this rank belongs to: the world's, then its sequence group's (when N > 1).
  std::vector<c10d::Backend*> backends() const;
  void close() noexcept;  // ~Comm's work
  bool collectives_done();
  LaunchEnv env_;
  std::optional<config::Backend> backend_;  // gloo or nccl; none for one process
  c10::Device device_;
  int64_t timeout_s_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> pg_;
  layout::Mesh mesh_;                         // the launch's world and rank with parallel.*'s degrees
  c10::intrusive_ptr<c10d::Backend> seq_pg_;  // the sequence group's (mesh_.sequence() > 1)
  std::string failure_;
  int64_t agreements_ = 0;  // agree_on_failure calls so far: each posts under its own store keys
  std::atomic<int64_t> abandoned_{0};  // collectives launched and never waited for (Pending::abandon)
  bool leave_together_ = false;         // ranks_leave_together()
};

}  // namespace sl::parallel
