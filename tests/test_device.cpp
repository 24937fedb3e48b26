// The device-generic code on a device that is not the CPU: train.device: lazy (LibTorch's lazy-tensor
// TorchScript backend; it runs on the CPU, but is_cpu() is false, data_ptr() is null, and a tensor
// reaches the host only through a copy, as on CUDA). The tiny recipe at world 1 goes through
// state.every saves, a kill -9, --resume auto, the final weights and trainer export on it, and its
// losses follow the CPU run's.
//
// The same scenario runs on CUDA where there is a GPU (the [cuda] cases, their own ctest entry
// device_cuda, skipped elsewhere), with the planner against the caching allocator and memory.limit,
// and offload's copies (device/host.h): page-locked host blocks counted in the host pool, the side
// stream's copies giving the synchronous path's bytes.
//
// Tolerances: the lazy device takes the ATen path (the fused AVX2 attention, GELU and AdamW are
// CPU-only), so its float32 sums are ordered differently from the CPU run's: per-op differences of a
// few ulp (u = 2^-24 ~ 6e-8 relative each).
// - Losses (and evals) are not amplified: a loss is a mean over the batch of quantities each a chain of
//   reductions of at most a few hundred terms (d 128, the MLP's 512, the vocabulary's 256), ~1e3 u
//   = 6e-5 relative of ~5.5 nats worst case per step before the parameters differ; the parameters'
//   differences below move a loss by far less (|dL/dp| |dp| over the non-chaotic elements, ~1e-6 of
//   the update). kLossTol = 1e-4 nats is that worst case's order (1.8e-5 relative); a device bug (a
//   wrong tensor saved, restored or exported, a lost moment, a stale parameter, a step replayed) moves
//   the losses by the size of an update's effect, ~1e-2 nats.
// - Final weights: where AdamW normalises a gradient at rounding noise they are chaotic, so they are
//   compared as tests/runs.h's parity does for any two runs whose sums differ only in order (each
//   tensor's median and 90th-percentile element within 1e-2 of AdamW's travel in the run, derived
//   there), with every step's loss and gradient norm within 1e3 u = 6e-5 relative (the losses' worst
//   case above; the norm's reordered sums are within it too, tests/runs.h kReorderedStep's argument with
//   this 1e3 u per element): tests/runs.h kKernelPathRuns; a stale or wrong tensor, a lost moment or a replayed step
//   moves a tensor's median by O(1) of the travel.
#include <atomic>
#include <csignal>
#include <filesystem>
#include <functional>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "config/config.h"
#include "device/host.h"
#include "state/safetensors.h"
#include "runs.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 12;
constexpr double kLossTol = 1e-4;
const std::string kArgs = fmt::format(
    "--config configs/tiny.yaml --set model.n_layer=2 --set train.seq_len=64 --set train.micro_batch=4 "
    "--set train.grad_accum=2 --set train.steps={} --set train.eval_interval=5 --set train.eval_batches=2 "
    "--set model.dropout=0.0 --set logging.progress=false --set train.threads=1 --set logging.peak_tflops=1 "
    "--set logging.interval=100 --set state.every=3 --set logging.save_model=true",
    kSteps);

std::string dir_arg(const fs::path& run_dir) { return " --set logging.dir=" + run_dir.string(); }

double max_abs_diff(const fs::path& a, const fs::path& b) {
  const state::SafetensorsFile fa(a), fb(b);
  REQUIRE(fa.entries().size() == fb.entries().size());
  double worst = 0;
  for (const auto& e : fa.entries()) {
    const auto other = fb.view(e.name);
    REQUIRE(other.sizes() == fa.view(e.name).sizes());
    worst = std::max(worst, (fa.view(e.name) - other).abs().max().item<double>());
  }
  return worst;
}

// Largest |loss difference| over the steps and evals of two runs, which must have the same steps.
double largest_loss_difference(const test::RunTrace& got, const test::RunTrace& want) {
  REQUIRE(got.steps.size() == want.steps.size());
  REQUIRE(got.evals.size() == want.evals.size());
  double worst = 0;
  for (size_t i = 0; i < got.steps.size(); ++i) {
    CHECK(got.steps[i].step == want.steps[i].step);
    worst = std::max(worst, std::abs(got.steps[i].loss - want.steps[i].loss));
  }
  for (size_t i = 0; i < got.evals.size(); ++i) worst = std::max(worst, std::abs(got.evals[i].second - want.evals[i].second));
  return worst;
}

// Whether metrics.jsonl holds a `state_saved` event of step `step` (a save is logged when published: an
// asynchronous one after a later step's record).
bool saved_now(const fs::path& metrics, int64_t step) {
  for (const auto& r : test::read_jsonl(metrics, false))
    if (r.is_object() && r.value("event", "") == "state_saved" && r.value("step", int64_t{-1}) == step) return true;
  return false;
}

// Starts the device run, SIGKILLs it once metrics.jsonl holds `k` step records and the state of step
// `saved` is published, and returns the records then.
size_t kill_after(const std::string& args, const fs::path& run_dir, size_t k, int64_t saved) {
  auto proc = test::trainer_background(args, run_dir.string() + ".killed.log");
  REQUIRE(proc->running());
  const auto metrics = run_dir / "metrics.jsonl";
  const bool reached = test::poll_until(
      [&] { return (test::step_records_now(metrics) >= k && saved_now(metrics, saved)) || proc->exited(); },
      std::chrono::seconds(240));
  proc->signal(SIGKILL);
  proc->wait();
  INFO("device run before the kill:\n" << proc->output());
  REQUIRE(reached);
  REQUIRE(proc->killed_by(SIGKILL));  // killed mid-run, not finished or failed before it
  return test::step_records_now(metrics);
}

}  // namespace

namespace {

// The tiny recipe on `device` against the same run on the CPU: saves every 3 steps, a kill -9 after
// step 7, --resume auto, the final weights, trainer export, and the device's last state resumed on
// the CPU.
void device_run_follows_cpu(const std::string& device) {
  test::TempDir dir("device-" + device);
  const auto cpu_dir = dir.path / "cpu", dev_dir = dir.path / device;

  const auto cpu = test::trainer(kArgs + " --set train.device=cpu" + dir_arg(cpu_dir));
  INFO(cpu.output);
  REQUIRE(cpu.code == 0);
  const auto want = test::trace(cpu_dir / "metrics.jsonl");
  REQUIRE(want.steps.size() == static_cast<size_t>(kSteps));

  // On CUDA, matmuls in IEEE fp32 (precision.tf32: false), as the tolerances above assume.
  const std::string ieee = device == "cuda" ? " --set precision.tf32=false" : "";
  const std::string dev_args = kArgs + " --set train.device=" + device + ieee + dir_arg(dev_dir);
  const size_t at_kill = kill_after(dev_args, dev_dir, 7, 6);  // after the saves of steps 3 and 6
  INFO("killed with " << at_kill << " step records");
  const auto resumed = test::trainer(dev_args + " --resume auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);

  // Resumed from a state the dev run saved (exit 7 before host staging: the writer refused device tensors).
  const auto resumes = test::events(dev_dir / "metrics.jsonl", "resume");
  REQUIRE(resumes.size() == 1);
  const int64_t from = resumes[0].at("step").get<int64_t>();
  CHECK(from >= 6);
  CHECK(from % 3 == 0);
  const auto summary = nlohmann::json::parse(test::read_text(dev_dir / "summary.json"));
  // "lazy", or "cuda:<local rank>"
  CHECK(summary.at("environment").at("device").get<std::string>().rfind(device, 0) == 0);

  // Every step once, each loss (and eval) within kLossTol of the CPU run's.
  const double worst = largest_loss_difference(test::trace(dev_dir / "metrics.jsonl"), want);
  WARN("largest |loss difference| " << device << " vs CPU over " << kSteps << " steps and the evals: " << worst);
  CHECK(worst <= kLossTol);

  // The final weights, staged to host by the writer, are the CPU run's as parity has it (see the top).
  const auto dev_model = dev_dir / "model" / "model.safetensors";
  REQUIRE(fs::exists(dev_model));
  CHECK_PARITY(dev_dir, cpu_dir, test::kKernelPathRuns);

  // trainer export of the dev run: the same weights as its final weights, bit for bit.
  const auto out = dir.path / "exported";
  const auto ex = test::trainer("export --run " + dev_dir.string() + " --out " + out.string());
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  CHECK(max_abs_diff(out / "model.safetensors", dev_model) == 0.0);

  // The state files do not depend on the device: the dev run's last state resumes on the CPU, and
  // its parameters are the dev run's final weights (a run of 0 further steps exports them).
  const auto cpu_again = dir.path / "cpu-from-dev";
  const auto r = test::trainer(kArgs + " --set train.device=cpu" + dir_arg(cpu_again) + " --resume " +
                               (dev_dir / "state").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(max_abs_diff(cpu_again / "model" / "model.safetensors", dev_model) == 0.0);
}

}  // namespace

TEST_CASE("train.device lazy (not the CPU): saves, kill -9, --resume auto, final weights and export; losses follow the CPU run") {
  device_run_follows_cpu("lazy");
}

// The same on a GPU, where there is one (its own ctest entry, device_cuda: skipped without CUDA). The
// tolerances are the lazy device's: cuBLAS and cuDNN sum in other orders than the CPU's kernels, per-op
// differences of a few ulp as on the lazy device (matmuls in full fp32: the run sets precision.tf32: false).
TEST_CASE("train.device cuda: saves, kill -9, --resume auto, final weights and export; losses follow the CPU run", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  device_run_follows_cpu("cuda");
}

// The planner on a GPU: `trainer plan`'s prediction (summary.json's predicted_peak_bytes) against the
// CUDA caching allocator's peak (allocated bytes, not reserved), on the GPT-2 124M shape at
// micro-batch 4 (T 1024), where activations are most of the peak. kBound is the planner's promise on
// CPU (tests/test_planner.cpp). Then memory.limit on CUDA, a limit on allocated bytes as on CPU
// (memory/cuda_limit.h): a run past it exits 4 with an oom event; the planner's advice runs under it,
// its allocated peak at most the limit; and a limit between the first run's allocated and reserved
// peaks lets that run train again, its reserved bytes (the caching allocator's cache) above the limit.
TEST_CASE("train.device cuda: predicted peaks within 5 % of the caching allocator's; memory.limit limits allocated bytes", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  constexpr double kBound = 0.05;
  test::TempDir dir("device-cuda-memory");
  // The recipe's shape and batch with autocast's precision (fp32 parameters, one process): the variants
  // below set precision.compute.
  const std::string base = "--config configs/gpt2_124m.yaml --set train.device=cuda --set train.micro_batch=4 "
                           "--set precision.compute=fp32 --set precision.param_dtype=fp32 --set parallel.sharding=none "
                           "--set train.grad_accum=1 --set train.steps=3 --set train.eval_interval=0 "
                           "--set state.at_end=false --set logging.save_model=false --set logging.progress=false";
  auto summary_of = [](const fs::path& run_dir) { return nlohmann::json::parse(test::read_text(run_dir / "summary.json")); };
  int n = 0;
  int64_t first_allocated = 0, first_reserved = 0;  // the first run's (checkpointing none, fp32) peaks
  for (const std::string sets : {"--set checkpointing.mode=none", "--set checkpointing.mode=full",
                                 "--set checkpointing.mode=sqrt", "--set precision.compute=bf16",
                                 "--set precision.compute=bf16 --set checkpointing.mode=full"}) {
    const bool first = n == 0;
    const auto run_dir = dir.path / std::to_string(n++);
    const auto r = test::trainer(base + " " + sets + dir_arg(run_dir));
    INFO(sets << "\n" << r.output);
    REQUIRE(r.code == 0);
    const auto s = summary_of(run_dir);
    CHECK(s.at("environment").at("memory_source") == "cuda_caching_allocator");
    const double predicted = s.at("predicted_peak_bytes").get<double>(), measured = s.at("peak_allocated_bytes").get<double>();
    WARN(sets << ": measured " << measured / (1 << 20) << " MiB, predicted " << predicted / (1 << 20) << " MiB");
    CHECK(std::abs(predicted - measured) <= kBound * measured);
    REQUIRE(s.at("peak_reserved_bytes").is_number());  // beside the allocated peak on CUDA
    CHECK(s.at("peak_reserved_bytes").get<double>() >= measured);
    if (first) first_allocated = s.at("peak_allocated_bytes").get<int64_t>(), first_reserved = s.at("peak_reserved_bytes").get<int64_t>();
  }

  constexpr int64_t kLimit = 3LL << 30;
  const auto oom_dir = dir.path / "oom";
  const auto oom = test::trainer(base + " --set memory.limit=3GiB" + dir_arg(oom_dir));
  INFO(oom.output);
  CHECK(oom.code == 4);
  CHECK(oom.output.find("out of memory (memory.limit)") != std::string::npos);
  const auto summary = summary_of(oom_dir);
  CHECK(summary.at("exit_status").at("code") == 4);
  CHECK(summary.at("memory_limit_bytes") == kLimit);
  CHECK(test::events(oom_dir / "metrics.jsonl", "oom").size() == 1);
  const auto advice = oom.output.find("full: micro_batch ");
  REQUIRE(advice != std::string::npos);
  const int mb = std::stoi(oom.output.substr(advice + std::string("full: micro_batch ").size()));
  REQUIRE(mb > 0);
  const auto ok = test::trainer(base + " --set memory.limit=3GiB --set checkpointing.mode=full --set train.micro_batch=" +
                                std::to_string(mb) + dir_arg(dir.path / "ok"));
  INFO(ok.output);
  CHECK(ok.code == 0);
  if (ok.code == 0) CHECK(summary_of(dir.path / "ok").at("peak_allocated_bytes").get<int64_t>() <= kLimit);

  // The first run again under a limit halfway between its allocated and reserved peaks: the same
  // allocations (the limit changes none), so the same allocated peak, under the limit; the caching
  // allocator's reserved bytes pass it, which a cap on reserved bytes (setMemoryFraction) forbids.
  REQUIRE(first_reserved > first_allocated);  // the caching allocator keeps freed blocks and rounds blocks up
  const int64_t between = first_allocated + (first_reserved - first_allocated) / 2;
  const auto again_dir = dir.path / "between";
  const auto again = test::trainer(base + " --set checkpointing.mode=none --set memory.limit=" + std::to_string(between) +
                                   dir_arg(again_dir));
  INFO(again.output);
  REQUIRE(again.code == 0);
  const auto s = summary_of(again_dir);
  CHECK(s.at("peak_allocated_bytes").get<int64_t>() <= between);
  CHECK(s.at("peak_reserved_bytes").get<int64_t>() > between);
}

// ---- offload's copies on CUDA (device/host.h's cuda contract) ----

namespace {

// The host pool as the tracking allocator sees page-locked blocks (device::ExternalHostBytes).
std::atomic<int64_t> g_pinned_counted{0};

bool page_locked(const at::Tensor& h) { return at::detail::getCUDAHooks().isPinnedPtr(h.data_ptr()); }

// Restores the asynchronous path and the host pool's counter when a case ends.
struct CopyPathGuard {
  CopyPathGuard() {
    device::set_synchronous_copies(false);
    g_pinned_counted = 0;
    device::set_external_host_bytes({[](int64_t b) { g_pinned_counted += b; }, [](int64_t b) { g_pinned_counted -= b; },
                                     [](int64_t) {}});
  }
  ~CopyPathGuard() {
    device::set_synchronous_copies(false);
    device::set_external_host_bytes({});
  }
};

}  // namespace

TEST_CASE("CUDA offload copies: host copies page-locked and counted in the host pool while they live; a freed block is reused", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  CopyPathGuard path;
  const auto t = torch::randn({1000, 37}, torch::device(torch::kCUDA)).t();  // a dense, transposed layout
  const auto expected = t.cpu();
  const auto bytes = static_cast<int64_t>(t.nbytes());
  void* first = nullptr;
  {
    const auto h = device::to_host(t);
    CHECK(page_locked(h));
    CHECK(h.strides() == t.strides());
    CHECK(torch::equal(h, expected));
    CHECK(g_pinned_counted == bytes);  // exactly its bytes
    first = h.data_ptr();
  }
  CHECK(g_pinned_counted == 0);  // a kept block does not count
  const auto again = device::to_host(t);
  CHECK(again.data_ptr() == first);  // the pool's block of that size, its last copy landed
  CHECK(g_pinned_counted == bytes);
  const auto readable = device::host_readable(t);
  CHECK(page_locked(readable));
  CHECK(torch::equal(readable, expected));
  CHECK(g_pinned_counted == 2 * bytes);

  device::set_synchronous_copies(true);  // the plain path: pageable, not counted as a page-locked block
  const auto plain = device::to_host(t);
  CHECK_FALSE(page_locked(plain));
  CHECK(torch::equal(plain, expected));
  CHECK(g_pinned_counted == 2 * bytes);
}

TEST_CASE("CUDA offload copies: the side stream's copies give the synchronous path's bytes, deferred or waited", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  CopyPathGuard path;
  const c10::Device cuda(c10::kCUDA, 0);
  const auto master = torch::randn({4099}) * 3.0;  // host fp32 masters (pageable: staged, then sent)
  const auto t = torch::randn({64, 129}, torch::device(cuda));

  auto both_paths = [&](const std::function<at::Tensor()>& f) {
    device::set_synchronous_copies(false);
    const auto async = f().cpu();
    device::set_synchronous_copies(true);
    const auto sync = f().cpu();
    device::set_synchronous_copies(false);
    return std::make_pair(async, sync);
  };
  // A master into a bf16 slot of a larger device buffer: the host cast, as the synchronous copy makes it.
  auto [slot_a, slot_s] = both_paths([&] {
    auto flat = torch::full({2 * 4099}, 7.0, torch::dtype(torch::kBFloat16).device(cuda));
    device::copy_into(flat.narrow(0, 4099, 4099), master);
    return flat;
  });
  CHECK(torch::equal(slot_a, slot_s));
  // Down and back, waited before returning and with the consumer's wait deferred.
  auto [back_a, back_s] = both_paths([&] { return device::to_device_copy(device::to_host(t), cuda); });
  CHECK(torch::equal(back_a, back_s));
  CHECK(torch::equal(back_a, t.cpu()));
  device::Arrival sent, arrived;
  const auto h = device::to_host(t, &sent);
  CHECK(sent.pending());
  const auto d = device::to_device_copy(h, cuda, &arrived);  // on the side stream after the copy down
  CHECK(arrived.pending());
  arrived.wait();  // the current stream after the copy back: .cpu() below reads what it wrote
  CHECK(torch::equal(d.cpu(), t.cpu()));
  sent.host_wait();
  CHECK(torch::equal(h, t.cpu()));
  // A host copy reused in place (to_host_reusing) is overwritten only after its last copy: the new bytes.
  const auto t2 = t * 2;
  const auto reused = device::to_host_reusing(t2, h);
  CHECK(reused.data_ptr() == h.data_ptr());
  CHECK(torch::equal(reused, t2.cpu()));
  // A copy into a page-locked host tensor of the pool lands before copy_into returns.
  device::copy_into(reused, t);
  CHECK(torch::equal(reused, t.cpu()));
}

}  // namespace SUBLINEAR_TEST_FILE
