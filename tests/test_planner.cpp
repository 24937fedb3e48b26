// Memory limit, out-of-memory handling and the planner: the simulated limit throws what CUDA throws,
// an OOM run exits 4 with its event and summary, `trainer plan` writes plan.json, and predicted peaks
// are within 5% of measured ones for both architectures, fp32 and bf16, every checkpointing mode and
// several batch sizes, on every CPU path bf16 can take (device/cpu_features.h: this CPU's in process,
// the others in a child process with oneDNN capped), and for a weight-heavy shape at world 1 and 2;
// and every data-parallel strategy's per-rank peak within 2 % ([strategies], its own ctest entry).
//
// The byte bounds (kBound, 5 %) are not floating-point tolerances and not one machine's figure: a
// peak is a count of bytes the tracking allocator saw, fixed by the recipe's shapes and the kernel
// path (the same bytes on every CPU that takes that path; MKL's and oneDNN's own scratch never goes
// through it), and the planner computes the same count from formulas. 5 % is the planner's documented
// promise (docs/memory.md) for what its formulas leave out (small per-step tensors of a few KiB,
// allocator rounding), which the smallest recipes here make largest in relative terms.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <limits>
#include <set>
#include <sstream>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "config/shape.h"
#include "data/loader.h"
#include "errors.h"
#include "examples_data.h"
#include "device/cpu_features.h"
#include "predict/budget.h"
#include "predict/scenario.h"
#include "predict/planner.h"
#include "predict/footprint.h"
#include "memory/tracking_allocator.h"
#include "model/gpt.h"
#include "recompute/plan.h"
#include "test_util.h"
#include "train/probe.h"
#include "train/trainer.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;

TEST_CASE("sizes parse with binary and decimal units") {
  CHECK(config::parse_bytes("8GiB", "k") == 8LL << 30);
  CHECK(config::parse_bytes("512 MiB", "k") == 512LL << 20);
  CHECK(config::parse_bytes("2GB", "k") == 2'000'000'000LL);
  CHECK(config::parse_bytes("1.5KiB", "k") == 1536);
  CHECK(config::parse_bytes("4096", "k") == 4096);
  CHECK(config::parse_bytes("0", "k") == 0);
  CHECK_THROWS_AS(config::parse_bytes("8 gigs", "memory.limit"), ConfigError);
  CHECK_THROWS_WITH(config::parse_bytes("lots", "memory.limit"), Catch::Contains("memory.limit: 'lots' is not a size"));
}

TEST_CASE("the simulated limit throws c10::OutOfMemoryError and leaves the count intact") {
  memory::TrackingCPUAllocator::install();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const int64_t base = alloc.current_bytes();
  alloc.set_limit(base + (1 << 20));
  auto ok = torch::empty({1 << 17}, torch::kFloat32);  // 512 KiB: fits
  CHECK_THROWS_AS(torch::empty({1 << 18}, torch::kFloat32), c10::OutOfMemoryError);  // 1 MiB more: refused
  CHECK(alloc.last_refused_bytes() == (1 << 20));
  CHECK(alloc.current_bytes() == base + (1 << 19));
  alloc.set_limit(0);
  CHECK_NOTHROW(torch::empty({1 << 18}, torch::kFloat32));
}

namespace {
// Peak of the second optimizer step, measured through the trainer's step with the tracking allocator:
// a probe step (train/probe.h) on the CPU, seed 0, grad_clip 1.0, no loss scaler, a synthetic loader.
int64_t measured_peak(const config::RunConfig& cfg) {
  memory::TrackingCPUAllocator::install();
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(50000, cfg.model.vocab_size, 5);
  data::Loader loader(src, cfg.train.micro_batch, cfg.train.seq_len, 9);
  const auto r = train::probe_step(cfg, recompute::make_plan(cfg.checkpointing, cfg.model.n_layer),
                                   {.loss_scaler = false, .grad_clip = 1.0, .seed = 0, .loader = &loader});
  REQUIRE_FALSE(r.oom);
  return r.last.mem.peak_allocated_bytes - r.allocated_before;
}
}  // namespace

namespace {

constexpr double kBound = 0.05;  // the planner's promise, measured against predicted peak bytes

struct Recipe {
  std::string name;
  std::vector<std::string> sets;
  std::vector<int64_t> batches;
};

const std::vector<std::vector<std::string>> kModes = {
    {"checkpointing.mode=none"},
    {"checkpointing.mode=full"},
    {"checkpointing.mode=full", "checkpointing.skip_last=false"},
    {"checkpointing.mode=interval", "checkpointing.interval=2"},
    {"checkpointing.mode=sqrt"},
    {"checkpointing.mode=selective", "checkpointing.recompute=[attention, mlp, norm]"},
    {"checkpointing.mode=selective", "checkpointing.recompute=[mlp]"},
};

// Activation-heavy recipes of both architectures. The CPU path changes only bf16 kernels: `Set::lowp`
// keeps the bf16 recipes of both architectures, `Set::lowp_quick` their smallest batch (ATen's own
// bf16 gemm, the AVX2 path, is ~10x slower than oneDNN's).
enum class Set { all, lowp, lowp_quick };
std::vector<Recipe> activation_recipes(Set set) {
  const std::vector<std::string> twelve = {"model.n_layer=12", "model.n_embd=128", "model.n_head=4", "train.seq_len=128"};
  const std::vector<std::string> llama = {"model.arch=llama", "model.n_layer=6"};
  auto with = [](std::vector<std::string> v, const std::string& s) { return v.push_back(s), v; };
  std::vector<Recipe> all = {  // bf16 first
      {"tiny bf16", {"precision.compute=bf16"}, {4, 16}},
      {"llama bf16", with(llama, "precision.compute=bf16"), {4, 16}},
      {"12-layer bf16", with(twelve, "precision.compute=bf16"), {8}},
  };
  if (set == Set::lowp_quick) return {{all[0].name, all[0].sets, {4}}, {all[1].name, all[1].sets, {4}}};
  if (set == Set::lowp) return {all[0], all[1]};
  all.push_back({"tiny", {}, {4, 16}});
  all.push_back({"llama", llama, {4, 16}});
  all.push_back({"12-layer", twelve, {8}});
  return all;
}

// Measures every mode of every recipe against the planner; CHECKs each within kBound and reports
// the worst case per recipe.
void check_recipes(const std::vector<Recipe>& recipes) {
  for (const auto& rec : recipes) {
    double worst = 0.0;
    std::string worst_case;
    for (const auto& mode : kModes)
      for (int64_t b : rec.batches) {
        std::vector<std::string> sets = rec.sets;
        sets.insert(sets.end(), mode.begin(), mode.end());
        sets.push_back("train.micro_batch=" + std::to_string(b));
        auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", sets);
        const double measured = static_cast<double>(measured_peak(cfg));
        const double predicted = static_cast<double>(planner::predict_peak(memory::Scenario::of(cfg)).peak_bytes());
        const double err = (predicted - measured) / measured;
        const std::string what = fmt::format("{} {} B={}: measured {} predicted {} ({:+.1f}%)", rec.name,
                                             fmt::join(mode, " "), b, measured, predicted, 100 * err);
        INFO(what);
        CHECK(std::abs(err) <= kBound);
        if (std::abs(err) >= std::abs(worst)) worst = err, worst_case = what;
      }
    fmt::print("planner [{}] worst: {}\n", device::to_string(device::cpu_features().linear_path(config::Dtype::kBf16)), worst_case);
  }
}

}  // namespace

TEST_CASE("predicted peak is within 5% of the measured peak: gpt2 and llama, fp32 and bf16, every mode") {
  // On ATen's fallback GEMM (an AVX2-only CPU under SUBLINEAR_ATEN_KERNELS=1) bf16 matmuls are ~50x
  // slower: its smallest batches only (the larger ones were measured within 3% when the model was made).
  const bool slow_bf16 = device::cpu_features().linear_path(config::Dtype::kBf16) == device::LowpMatmul::aten;
  auto recipes = activation_recipes(Set::all);
  if (slow_bf16) {
    recipes.erase(recipes.begin(), recipes.begin() + 3);  // the bf16 ones
    for (auto& r : activation_recipes(Set::lowp_quick)) recipes.push_back(r);
  }
  check_recipes(recipes);
}

// Run by the next test in a child process whose environment caps the libraries (hidden otherwise).
TEST_CASE("bf16 recipes on this process's CPU path", "[.cpu-path]") {
  fmt::print("CPU_FEATURES {}\n", device::cpu_features().to_json().dump());
  std::fflush(stdout);
  check_recipes(activation_recipes(Set::lowp));
}

TEST_CASE("bf16 recipes on this process's CPU path, smallest batch", "[.cpu-path-quick]") {
  fmt::print("CPU_FEATURES {}\n", device::cpu_features().to_json().dump());
  std::fflush(stdout);
  check_recipes(activation_recipes(Set::lowp_quick));
}

namespace {

// The bf16 recipes in a child process of this executable whose oneDNN is capped at `onednn_cap`
// (AVX512_CORE_VNNI: an AVX-512 CPU without bf16 instructions, a Cascade Lake Xeon: gemm:jit:bf16;
// AVX2: an AVX2-only CPU, no oneDNN bf16: ATen's gemm); `tag` picks the hidden case the child runs.
// `env`: more of the child's environment; `linear`: the path the model's linears must report.
void check_capped_cpu_path(const std::string& onednn_cap, const std::string& expect, const std::string& tag,
                           const std::string& env = "", const std::string& linear = "") {
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto r = test::run(fmt::format("ONEDNN_MAX_CPU_ISA={} {} OMP_NUM_THREADS=1 {} '{}'", onednn_cap, env, self, tag));
  INFO("ONEDNN_MAX_CPU_ISA=" << onednn_cap << " " << env << ":\n" << r.output);
  CHECK(r.code == 0);
  const auto at = r.output.find("CPU_FEATURES ");
  REQUIRE(at != std::string::npos);
  const auto f = json::parse(r.output.substr(at + 13, r.output.find('\n', at) - at - 13));
  CHECK(f["onednn_max_cpu_isa"] == onednn_cap);
  CHECK(f["native_bf16"] == false);
  CHECK(f["bf16_dot"] == false);  // the cap stands for a CPU without bf16 instructions, for the attention too
  CHECK(f["bf16_matmul"] == expect);
  CHECK(f["bf16_linear"] == (linear.empty() ? expect : linear));
  for (const auto& line : {std::string("worst: tiny bf16"), std::string("worst: llama bf16")})
    CHECK(r.output.find(line) != std::string::npos);
}

}  // namespace

// An AVX2-only CPU: the model's linears widen (model/linear.h), or under SUBLINEAR_ATEN_KERNELS=1 take
// ATen's gemm (its smallest batches only: that gemm is ~50x slower).
TEST_CASE("the bf16 model holds on the AVX2 path") {
  // Where this process already takes that path (an AVX2-only CPU, no oneDNN bf16 kernel: the linears
  // widen), the case above measured the same bf16 recipes on it in process: the capped child would
  // repeat it exactly.
  const auto& f = device::cpu_features();
  const bool on_the_path = f.bf16_matmul == device::LowpMatmul::aten && !f.avx512 &&
                           f.linear_path(config::Dtype::kBf16) == device::LowpMatmul::widened;
  if (!on_the_path) check_capped_cpu_path("AVX2", "aten", "[.cpu-path]", "", "widened");
  check_capped_cpu_path("AVX2", "aten", "[.cpu-path-quick]", "SUBLINEAR_ATEN_KERNELS=1", "aten");
}

// Its own ctest entry (planner_avx512): reported as skipped on a CPU without AVX-512. The model's
// linears widen there too (oneDNN's gemm:jit:bf16 makes a step twice fp32's); under
// SUBLINEAR_ATEN_KERNELS=1 they take that gemm, whose fp32 accumulator the emulated model counts.
TEST_CASE("the bf16 model holds on AVX-512 without bf16 instructions", "[avx512]") {
  if (!device::cpu_features().avx512)
    SUBLINEAR_SKIP("this CPU has no AVX-512: the emulated oneDNN bf16 path (AVX512_CORE_VNNI) cannot be reached here");
  check_capped_cpu_path("AVX512_CORE_VNNI", "onednn_emulated", "[.cpu-path]", "", "widened");
  check_capped_cpu_path("AVX512_CORE_VNNI", "onednn_emulated", "[.cpu-path-quick]", "SUBLINEAR_ATEN_KERNELS=1",
                        "onednn_emulated");
}

namespace {
// The CPU's feature flags as the kernel lists them (/proc/cpuinfo's first "flags" line): a source
// apart from the cpuinfo library ATen asks, for checks that must not restate cpu_features.cpp.
std::set<std::string> proc_cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::set<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) out.insert(w);
    break;
  }
  return out;
}
}  // namespace

TEST_CASE("the CPU features follow the libraries' caps and name the CPU") {
  const auto& f = device::cpu_features();
  const auto j = f.to_json();
  for (const char* key : {"cpu_model", "aten_cpu_capability", "onednn_max_cpu_isa", "avx512_bf16", "amx_bf16",
                          "native_bf16", "bf16_matmul", "bf16_dot"})
    CHECK(j.contains(key));
  CHECK(!f.aten_capability.empty());
  // What the kernel's flag list and oneDNN's cap (onednn_isa_allows: its table is checked case by case
  // below) say, apart from the library answers cpu_features reads: the bf16 instructions oneDNN may
  // use, and whether the fused attention's AVX512-BF16 products may run.
  const auto flags = proc_cpu_flags();
  REQUIRE(flags.count("avx2"));  // every CPU the suite supports; an empty list would make the rest vacuous
  auto has = [&](const char* flag) { return flags.count(flag) > 0; };
  const std::string& cap = f.onednn_max_isa;
  const bool avx512 = has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq");
  const bool bf16_instructions =
      (has("avx512_bf16") && device::onednn_isa_allows(cap, "avx512_core_bf16")) ||
      (has("amx_bf16") && has("amx_tile") && device::onednn_isa_allows(cap, "avx512_core_amx")) ||
      (has("avx_ne_convert") && device::onednn_isa_allows(cap, "avx2_vnni_2"));
  fmt::print("CPU flags: avx512 {}, avx512_bf16 {}, amx_bf16 {}, avx_ne_convert {}; oneDNN cap '{}'\n", avx512,
             has("avx512_bf16"), has("amx_bf16"), has("avx_ne_convert"), cap);
  CHECK(f.avx512 == avx512);
  CHECK(f.native_bf16 == bf16_instructions);
  // The path: ATen's gemm where oneDNN takes no bf16 matmul (the library's own answer); else oneDNN's
  // kernels with the instructions (native) or without them (emulated).
  const auto want_path = !f.onednn_bf16       ? device::LowpMatmul::aten
                         : bf16_instructions  ? device::LowpMatmul::native
                                              : device::LowpMatmul::emulated;
  CHECK(f.bf16_matmul == want_path);
  // oneDNN takes bf16 matmuls only on AVX-512 (or with AVX-NE-CONVERT), and not under a cap below
  // avx512_core: an AVX2-only CPU, or one capped at AVX2, is on ATen's gemm.
  if (!avx512 && !has("avx_ne_convert")) CHECK(f.bf16_matmul == device::LowpMatmul::aten);
  // The fused attention's bf16 products: AVX-512 with AVX512-BF16, and a cap that allows them.
  CHECK(f.bf16_dot == (avx512 && has("avx512_bf16") && device::onednn_isa_allows(cap, "avx512_core_bf16")));
  CHECK(device::onednn_isa_allows("", "avx512_core_bf16"));
  CHECK(device::onednn_isa_allows("AVX512_CORE_VNNI", "avx512_core"));
  CHECK_FALSE(device::onednn_isa_allows("AVX512_CORE_VNNI", "avx512_core_bf16"));
  CHECK_FALSE(device::onednn_isa_allows("avx512_core_vnni", "avx2_vnni_2"));
  CHECK(device::onednn_isa_allows("AVX512_CORE_AMX", "avx512_core_bf16"));
  CHECK_FALSE(device::onednn_isa_allows("AVX2", "avx512_core"));
  // ATen's own cap changes its answer too (every CPU the suite supports has AVX2).
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const std::string cap : {"avx2", "default"}) {
    const auto r = test::run(fmt::format("ATEN_CPU_CAPABILITY={} {} '[.cpu-features]'", cap, self));
    INFO(r.output);
    const auto at = r.output.find("CPU_FEATURES ");
    REQUIRE(at != std::string::npos);
    const auto child = json::parse(r.output.substr(at + 13, r.output.find('\n', at) - at - 13));
    std::string upper = cap;
    for (auto& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    CHECK(child["aten_cpu_capability"] == upper);
  }
}

TEST_CASE("print the CPU features", "[.cpu-features]") {
  fmt::print("CPU_FEATURES {}\n", device::cpu_features().to_json().dump());
}

TEST_CASE("a run past memory.limit exits 4 with an oom event, a summary and advice from the planner") {
  test::TempDir dir("oom");
  const auto run_dir = dir.path / "run";
  // tiny needs ~86 MiB at micro-batch 16; 60 MiB holds the model states but not the activations.
  auto r = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.steps=5 --set logging.dir=" +
                         run_dir.string());
  INFO(r.output);
  CHECK(r.code == kExitOom);
  CHECK(r.output.find("out of memory in forward") != std::string::npos);
  CHECK(r.output.find("the planner predicts these fit 60.0 MiB") != std::string::npos);
  CHECK(r.output.find("full: micro_batch") != std::string::npos);
  auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitOom);
  CHECK(summary["memory_limit_bytes"] == 60LL << 20);
  const auto& oom = summary["oom"];
  CHECK(oom["step"] == 1);
  CHECK(oom["phase"] == "forward");
  CHECK(oom["requested_bytes"].get<int64_t>() > 0);
  CHECK(oom["peak_bytes"].get<int64_t>() <= 60LL << 20);
  CHECK(oom["limit_bytes"] == 60LL << 20);
  const auto metrics = test::read_text(run_dir / "metrics.jsonl");
  CHECK(metrics.find("\"event\":\"oom\"") != std::string::npos);
  for (const auto& e : std::filesystem::directory_iterator(run_dir)) CHECK(e.path().extension() != ".tmp");

  // The planner's advice holds: full checkpointing at the suggested micro-batch runs under the same limit.
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {"checkpointing.mode=full"});
  const int64_t mb = planner::largest_micro_batch(memory::Scenario::of(cfg), 60LL << 20);
  REQUIRE(mb > 0);
  auto ok = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.steps=2 "
                          "--set checkpointing.mode=full --set train.micro_batch=" + std::to_string(mb) +
                          " --set logging.dir=" + (dir.path / "ok").string());
  INFO(ok.output);
  CHECK(ok.code == 0);
}

TEST_CASE("trainer plan writes plan.json with the breakdown and the largest micro-batch per mode") {
  test::TempDir dir("plan");
  const auto out = dir.path / "plan.json";
  auto r = test::trainer("plan --config configs/7b_ckpt.yaml --memory 80GiB --out " + out.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("6738415616") != std::string::npos);
  CHECK(r.output.find("Model states alone (100.4 GiB) exceed 80.0 GiB") != std::string::npos);
  auto plan = json::parse(test::read_text(out));
  CHECK(plan["params"] == 6'738'415'616);
  CHECK(plan["optimizer_state_bytes"] == 8 * 6'738'415'616LL);
  // A save on a GPU stages one bounded piece in host RAM: 64 MiB here (the 7B's largest tensor, the
  // 32000 x 4096 embedding, is 500 MiB in fp32), printed in the report.
  CHECK(plan["host_staging_bytes"] == int64_t{64} << 20);
  CHECK(r.output.find("host staging of a save") != std::string::npos);
  // One row per mode the plan compares: the recipe's own, none, full, sqrt and selective (all parts).
  std::vector<std::string> mode_names;
  for (const auto& m : plan["modes"]) mode_names.push_back(m["mode"].get<std::string>());
  CHECK(mode_names == std::vector<std::string>{"recipe (full)", "none", "full", "sqrt",
                                               "selective [attention, mlp, norm]"});
  for (const auto& m : plan["modes"]) CHECK(m["largest_micro_batch"] == 0);

  auto tiny = test::trainer("plan --config configs/tiny.yaml --memory 100MiB --out " + out.string());
  REQUIRE(tiny.code == 0);
  plan = json::parse(test::read_text(out));
  int64_t none_mb = 0, full_mb = 0;
  for (const auto& m : plan["modes"]) {
    if (m["mode"] == "none") none_mb = m["largest_micro_batch"];
    if (m["mode"] == "full") full_mb = m["largest_micro_batch"];
    CHECK(m.contains("grad_accum_for_global_batch"));
  }
  CHECK(none_mb >= 16);  // the recipe's own batch fits in 100 MiB (measured peak ~85 MiB)
  // A model whose largest tensor is under the staging bound stages that tensor at most (fp32 bytes).
  const auto tiny_cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  CHECK(plan["host_staging_bytes"] == 4 * config::Shape(tiny_cfg.model).largest_param());
  CHECK(plan["host_staging_bytes"].get<int64_t>() < int64_t{64} << 20);
  CHECK(full_mb > none_mb);
  // Bad --memory is a usage error.
  CHECK(test::trainer("plan --config configs/tiny.yaml --memory lots").code == kExitConfig);
}

TEST_CASE("micro_batch: auto finds what a brute-force search finds, keeping the global batch") {
  memory::TrackingCPUAllocator::install();
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml",
                          {"memory.limit=60MiB", "train.micro_batch=auto", "train.global_batch=32"});
  memory::TrackingCPUAllocator::instance().set_limit(60LL << 20);
  int64_t brute = 0;
  for (int64_t b : {1, 2, 4, 8, 16, 32})
    if (train::micro_batch_fits(cfg, b, torch::kCPU)) brute = b;
  memory::TrackingCPUAllocator::instance().set_limit(0);
  REQUIRE(brute > 0);
  REQUIRE(brute < 32);  // the limit binds

  test::TempDir dir("auto");
  auto r = test::trainer("--config configs/tiny.yaml --set memory.limit=60MiB --set train.micro_batch=auto "
                         "--set train.global_batch=32 --set train.steps=2 --set logging.dir=" + (dir.path / "run").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("micro_batch auto: planner predicted") != std::string::npos);
  auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  const auto& search = summary["micro_batch_search"];
  CHECK(search["micro_batch"] == brute);
  CHECK(search["grad_accum"] == 32 / brute);
  CHECK(search["trials"].size() <= 4);  // bisection from the planner's guess, not a walk
  CHECK(summary["config"]["train"]["micro_batch"] == brute);
  CHECK(summary["tokens"] == 2 * 32 * 128);  // the global batch is kept

  CHECK(test::trainer("--config configs/tiny.yaml --set train.micro_batch=auto --set memory.limit=1GiB").code == kExitConfig);
  CHECK(test::trainer("--config configs/tiny.yaml --set train.micro_batch=auto --set train.global_batch=32").code == kExitConfig);
}

TEST_CASE("per-rank model states follow the ZeRO formulas") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  const auto one = planner::predict_peak(memory::Scenario::of(cfg));
  const int64_t n = config::Shape(cfg.model).total_params();
  CHECK(one.params_bytes == 4 * n);
  CHECK(one.model_states_bytes() == 16 * n);
  CHECK(one.transient_bytes == 0);
  const auto units = memory::unit_param_counts(cfg.model);
  REQUIRE(units.size() == static_cast<size_t>(cfg.model.n_layer + 2));
  const int64_t largest = *std::max_element(units.begin(), units.end());
  cfg.world_size = 4;
  const int64_t P = 4 * n, G = 4 * n, O = 8 * n;
  using config::Sharding;
  for (const Sharding stage : {Sharding::kNone, Sharding::kZero1, Sharding::kZero2, Sharding::kZero3}) {
    INFO(stage);
    cfg.parallel.sharding = stage;
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    const int64_t expect = stage == Sharding::kNone    ? P + G + O
                           : stage == Sharding::kZero1 ? P + G + O / 4
                           : stage == Sharding::kZero2 ? P + (G + O) / 4
                                                       : (P + G + O) / 4;
    CHECK(std::abs(p.model_states_bytes() - expect) <= 4);  // integer division per state
    CHECK(p.activations.peak_bytes == one.activations.peak_bytes);  // activations are per rank already
    if (stage == Sharding::kZero3) CHECK(p.transient_bytes == 3 * 4 * largest);  // parameters, gradient, prefetched parameters
  }
  // trainer plan --world-size reports per rank.
  test::TempDir dir("plan-world");
  auto r = test::trainer("plan --config configs/tiny.yaml --set parallel.sharding=zero3 --world-size 4 --out " +
                         (dir.path / "plan.json").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("4 x zero3") != std::string::npos);
  const auto j = json::parse(test::read_text(dir.path / "plan.json"));
  CHECK(j["world_size"] == 4);
  CHECK(std::abs(j["model_states_bytes"].get<int64_t>() - (P + G + O) / 4) <= 4);
}

namespace {
// Weight-heavy: model states are ~95% of the peak, so the optimizer step's temporaries decide it.
const std::vector<std::string> kWeightHeavy = {"model.n_layer=8", "model.n_embd=256", "train.micro_batch=1",
                                               "train.seq_len=32", "checkpointing.mode=none"};
const std::vector<std::vector<std::string>> kWeightHeavyVariants = {
    {}, {"precision.compute=bf16"}, {"model.arch=llama"}, {"model.arch=llama", "precision.compute=bf16"}};
}  // namespace

TEST_CASE("weight-heavy shape, world 1: predicted peak within 5%, gpt2 and llama, fp32 and bf16") {
  for (const auto& variant : kWeightHeavyVariants) {
    auto sets = kWeightHeavy;
    sets.insert(sets.end(), variant.begin(), variant.end());
    auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", sets);
    const double measured = static_cast<double>(measured_peak(cfg));
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    INFO(fmt::format("{}", fmt::join(variant, " ")) << ": measured " << measured << " predicted " << p.peak_bytes());
    CHECK(std::abs(static_cast<double>(p.peak_bytes()) - measured) <= kBound * measured);
    CHECK(p.model_states_bytes() > 0.85 * measured);
  }
}

// Its own ctest entry (planner_widened): skipped on a CPU with a bf16 GEMM.
// Head-heavy: a vocabulary of 16384 over d 256 and 64 tokens, where the widened LM head's fp32
// transients (its weight gradient and rounded weight, 8VC) outweigh the activations. Only where the
// linears widen: elsewhere the model leaves out the head's weight gradient at its backward (4VC; fp32
// under-predicts this shape by 11.7 %), a known gap (docs/memory.md).
TEST_CASE("head-heavy shape, widened bf16 linears: predicted peak within 5%, gpt2 and llama", "[widened]") {
  if (device::cpu_features().linear_path(config::Dtype::kBf16) != device::LowpMatmul::widened)
    SUBLINEAR_SKIP("this CPU has a bf16 GEMM: its linears do not widen");
  for (const auto& variant : {kWeightHeavyVariants[1], kWeightHeavyVariants[3]}) {
    auto sets = std::vector<std::string>{"model.n_layer=2", "model.n_embd=256", "model.vocab_size=16384", "train.micro_batch=1",
                                         "train.seq_len=64", "checkpointing.mode=none"};
    sets.insert(sets.end(), variant.begin(), variant.end());
    auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", sets);
    const double measured = static_cast<double>(measured_peak(cfg));
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    INFO(fmt::format("{}: measured {} predicted {} ({:+.1f}%)", fmt::join(variant, " "), measured, p.peak_bytes(),
                     100 * (static_cast<double>(p.peak_bytes()) - measured) / measured));
    CHECK(std::abs(static_cast<double>(p.peak_bytes()) - measured) <= kBound * measured);
  }
}

TEST_CASE("weight-heavy shape, world 2 DDP: every rank's peak within 5% of the prediction") {
  test::TempDir dir("planner-ddp");
  int n = 0;
  for (const auto& variant : {kWeightHeavyVariants[0], kWeightHeavyVariants[3]}) {
    auto sets = kWeightHeavy;
    sets.insert(sets.end(), variant.begin(), variant.end());
    // Absolute paths and synthetic data: test::launch starts only rank 0 in the source directory.
    std::string args = "--config " + test::kSourceDir + "/configs/tiny.yaml --set data.source=synthetic "
                       "--set train.steps=3 --set train.eval_interval=0 "
                       "--set parallel.timeout_s=60 --set logging.peak_tflops=1 --set logging.dir=" +
                       (dir.path / std::to_string(n++)).string();
    for (const auto& kv : sets) args += " --set " + kv;
    const auto m = test::launch(2, args);
    INFO("rank 0:\n" << m.outputs[0] << "\nrank 1:\n" << m.outputs[1]);
    REQUIRE(m.codes == std::vector<int>{0, 0});
    const auto s = json::parse(test::read_text(dir.path / std::to_string(n - 1) / "summary.json"));
    const double predicted = s["predicted_peak_bytes"].get<double>();
    REQUIRE(s["parallel"]["ranks"].size() == 2);
    for (const auto& rank : s["parallel"]["ranks"]) {
      const double measured = rank["peak_allocated_bytes"].get<double>();
      INFO(fmt::format("{}", fmt::join(variant, " ")) << " rank " << rank["rank"] << ": measured " << measured << " predicted " << predicted);
      CHECK(std::abs(predicted - measured) <= kBound * measured);
    }
  }
}

namespace {
// Every data-parallel strategy's per-rank peak against the planner's (issue 52): a run of the trainer
// (2 steps: the second holds the AdamW moments) per shape, its summary's predicted_peak_bytes against
// every rank's tracked peak. The shapes: the 6-layer LLaMA and the 4-layer GPT-2 (tied head) of the
// activation-heavy recipes above, micro-batch 4 x 128 tokens, with full checkpointing and with none.
//
// The bound, predicted / measured in [0.98, 1.02], is the issue's requirement: an under-prediction
// becomes an out-of-memory on a tight budget, so the planner may not be more than 2 % under. It is
// also what the planner's arithmetic allows. It counts exactly, to the byte, the model states per rank,
// the batch, the RoPE tables and the engine's buffers at each phase of the step (a unit's parameters,
// its prefetched neighbour, a gradient buffer; each group padded to the world size's shards):
// tensors whose sizes are fixed by the shapes. It approximates only the activations
// (predict/activations.h): their per-token terms, which leave out tensors of a few KiB a step (the
// CPU generator's state each checkpointed segment keeps for its recompute, 5056 bytes; the loss's
// scalars; the fused AdamW's piece index: < 0.1 % of these peaks) and count some a moment early
// (LLaMA's fp32 block backward: +0.4 %), and it adds each moment's activations to the largest
// transient of its kind even where the two do not meet. Measured: -0.5 % to +0.6 % on every shape and
// strategy here, the same bytes on every run and rank. So 2 % fails on a buffer the planner leaves out
// (one zero3 unit is 3-5 % of these peaks) and holds the model's approximations.
constexpr double kStrategyBound = 0.02;

struct StrategyShape {
  std::string name;
  std::vector<std::string> sets;
};
const std::vector<StrategyShape> kStrategyShapes = {
    {"llama 6 layers, full", {"model.arch=llama", "model.n_layer=6", "checkpointing.mode=full"}},
    {"llama 6 layers, none", {"model.arch=llama", "model.n_layer=6", "checkpointing.mode=none"}},
    {"gpt2 4 layers, full", {"checkpointing.mode=full"}},
    {"gpt2 4 layers, none", {"checkpointing.mode=none"}},
};

// Trains every shape at `world` ranks with the strategy's overrides and checks each rank's peak.
void check_strategy(int world, const std::vector<std::string>& strategy) {
  test::TempDir dir("planner-strategy");
  for (size_t i = 0; i < kStrategyShapes.size(); ++i) {
    const auto& shape = kStrategyShapes[i];
    const auto run_dir = dir.path / std::to_string(i);
    // Absolute paths and synthetic data: test::launch starts the ranks in the source directory.
    std::string args = "--config " + test::kSourceDir + "/configs/tiny.yaml --set data.source=synthetic "
                       "--set train.steps=2 --set train.micro_batch=4 --set train.grad_accum=1 --set train.eval_interval=0 "
                       "--set parallel.timeout_s=60 --set logging.peak_tflops=1 --set logging.dir=" + run_dir.string();
    for (const auto& kv : shape.sets) args += " --set " + kv;
    for (const auto& kv : strategy) args += " --set " + kv;
    test::MultiResult m;
    if (world > 1) {
      m = test::launch(world, args);
    } else {
      const auto r = test::trainer(args);
      m = {{r.code}, {r.output}};
    }
    INFO(shape.name << "\nrank 0:\n" << m.outputs[0] << (world > 1 ? "\nrank 1:\n" + m.outputs[1] : std::string()));
    REQUIRE(m.codes == std::vector<int>(static_cast<size_t>(world), 0));
    const auto s = json::parse(test::read_text(run_dir / "summary.json"));
    const double predicted = s["predicted_peak_bytes"].get<double>();
    std::vector<double> measured = {s["peak_allocated_bytes"].get<double>()};  // rank 0's
    if (s["parallel"].is_object())
      for (const auto& rank : s["parallel"]["ranks"]) measured.push_back(rank["peak_allocated_bytes"].get<double>());
    for (const double peak : measured) {
      const double ratio = predicted / peak;
      INFO(fmt::format("{} {}: predicted {:.0f}, measured {:.0f} (predicted / measured {:.4f})", shape.name,
                       fmt::join(strategy, " "), predicted, peak, ratio));
      CHECK(ratio >= 1 - kStrategyBound);
      CHECK(ratio <= 1 + kStrategyBound);
    }
    fmt::print("planner strategy [{}] {}: predicted / measured {:.4f}\n", fmt::join(strategy, " "), shape.name,
               predicted / *std::max_element(measured.begin(), measured.end()));
  }
}
}  // namespace

TEST_CASE("one process: predicted peak within 2% of the measured one, llama and gpt2, full and none", "[strategies]") {
  check_strategy(1, {});
}

TEST_CASE("zero1 and zero2 at world 1: predicted peak within 2%, llama and gpt2, full and none", "[strategies]") {
  for (const std::string stage : {"zero1", "zero2"}) {
    INFO(stage);
    check_strategy(1, {"parallel.sharding=" + stage});
  }
}

TEST_CASE("DDP at world 2: every rank's peak within 2% of the prediction, llama and gpt2, full and none", "[strategies]") {
  check_strategy(2, {"parallel.sharding=none"});
}

TEST_CASE("zero1 at world 2: every rank's peak within 2% of the prediction, llama and gpt2, full and none", "[strategies]") {
  check_strategy(2, {"parallel.sharding=zero1"});
}

TEST_CASE("zero2 at world 2: every rank's peak within 2% of the prediction, llama and gpt2, full and none", "[strategies]") {
  check_strategy(2, {"parallel.sharding=zero2"});
}

TEST_CASE("zero3 at world 2: every rank's peak within 2% of the prediction, llama and gpt2, full and none", "[strategies]") {
  check_strategy(2, {"parallel.sharding=zero3"});
}

TEST_CASE("zero3 with offload.optimizer and offload.parameters at world 2: every rank's device peak within 2%",
          "[strategies]") {
  check_strategy(2, {"parallel.sharding=zero3", "offload.optimizer=true", "offload.parameters=true"});
}

namespace {
// A trainer run of `args` into run_dir: its summary's predicted peak against its measured one, within
// kStrategyBound (tests/test_planner.cpp's strategies bound). Returns the summary.
json check_run_peak(const std::string& args, const std::filesystem::path& run_dir) {
  const auto r = test::trainer(args + " --set logging.dir=" + run_dir.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto s = json::parse(test::read_text(run_dir / "summary.json"));
  const double ratio = s["predicted_peak_bytes"].get<double>() / s["peak_allocated_bytes"].get<double>();
  INFO("predicted / measured " << ratio);
  CHECK(ratio >= 1 - kStrategyBound);
  CHECK(ratio <= 1 + kStrategyBound);
  return s;
}
}  // namespace

// Packed rows at a length where their mask is a fifth of the activations (2 rows of 512 positions, 2 blocks
// of width 64): a planner that left it out would be ~20 % under, past kStrategyBound.
TEST_CASE("packed rows (data.packing): the mask and positions are counted; peak within 2%, gpt2 and llama, "
          "full and none, fp32 (and bf16 gpt2)") {
  test::TempDir dir("planner-packing");
  const auto train = test::write_examples(dir.path, "train", test::varied_examples(12, 513, 256));
  const auto val = test::write_examples(dir.path, "val", test::varied_examples(2, 200, 256, 2));
  const std::vector<std::pair<std::string, std::string>> shapes = {
      {"gpt2 none", "--set checkpointing.mode=none"},
      {"gpt2 full", "--set checkpointing.mode=full"},
      {"llama none", "--set model.preset= --set model.arch=llama --set model.n_head=4"},
      {"llama full", "--set model.preset= --set model.arch=llama --set model.n_head=4 --set checkpointing.mode=full"},
      {"gpt2 full bf16", "--set checkpointing.mode=full --set precision.compute=bf16"},
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, sets] = shapes[i];
    INFO(name);
    const auto run_dir = dir.path / std::to_string(i);
    const auto s = check_run_peak(
        fmt::format("--config configs/tiny.yaml --set model.n_layer=2 --set model.n_embd=64 --set model.max_seq_len=512 "
                    "--set data.source=examples --set data.path={} --set data.val_path={} --set data.packing=true "
                    "--set train.seq_len=512 --set train.micro_batch=2 --set train.grad_accum=1 --set train.steps=2 "
                    "--set train.eval_interval=0 {}", train, val, sets), run_dir);
    // The term itself: the (2, 1, 512, 512) mask in the compute dtype, the (2, 512) positions, LLaMA's tables.
    auto cfg = config::load((run_dir / "config.json").string(), {});
    const auto e = memory::estimate_activation_peak(memory::Scenario::of(cfg),
                                                    recompute::make_plan(cfg.checkpointing, cfg.model.n_layer));
    const int64_t c = cfg.precision.compute == config::Dtype::kBf16 ? 2 : 4;
    const int64_t tables = cfg.model.arch == config::Arch::kLlama ? 2 * 2 * 512 * (64 / 4 / 2) * 4 : 0;
    CHECK(e.packing_bytes == 2 * 512 * 512 * c + 8 * 2 * 512 + tables);
    CHECK(s["predicted_peak_bytes"].get<int64_t>() > e.packing_bytes);
    CHECK(e.packing_bytes > s["peak_allocated_bytes"].get<double>() * 0.05);
  }
}

// optim.in_backward holds no gradient: the planner's grads term is 0 (the one in flight is the backward's
// weight-gradient transient the activation model counts). 2 % as kStrategyBound; leaving the gradients
// in would put it 7-12 % over on these shapes (4 bytes a parameter beside peaks of 25-65 MiB).
TEST_CASE("optim.in_backward: no gradient counted; peak within 2%, gpt2 and llama, none, full and selective, fp32 "
          "and bf16") {
  test::TempDir dir("planner-in-backward");
  const std::vector<std::pair<std::string, std::string>> shapes = {
      {"gpt2 none", ""},
      {"gpt2 selective bf16", "--set checkpointing.mode=selective --set checkpointing.recompute=[mlp] "
                              "--set precision.compute=bf16"},
      {"llama none", "--set model.preset= --set model.arch=llama --set model.n_layer=6"},
      {"llama full", "--set model.preset= --set model.arch=llama --set model.n_layer=6 --set checkpointing.mode=full"},
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, sets] = shapes[i];
    INFO(name);
    const auto run_dir = dir.path / std::to_string(i);
    check_run_peak(fmt::format("--config configs/tiny.yaml --set optim.in_backward=true --set train.grad_clip=0 "
                               "--set train.grad_accum=1 --set train.micro_batch=4 --set train.steps=2 "
                               "--set train.eval_interval=0 {}", sets), run_dir);
    const auto cfg = config::load((run_dir / "config.json").string(), {});
    CHECK(planner::predict_peak(memory::Scenario::of(cfg)).grads_bytes == 0);
  }
  // trainer plan says so: the gradients' row and plan.json.
  const auto out = dir.path / "plan.json";
  const auto r = test::trainer("plan --config configs/tiny.yaml --set optim.in_backward=true --set train.grad_clip=0 "
                               "--set train.grad_accum=1 --out " + out.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("gradients (none held: optim.in_backward)") != std::string::npos);
  const auto plan = json::parse(test::read_text(out));
  CHECK(plan["optimizer_in_backward"] == true);
  CHECK(plan["grads_bytes"] == 0);
}

// model.lora: the frozen weights hold no gradient or optimizer state, their linears keep no input, the fused
// loss makes no dW, and the adapters keep theirs (predict/activations.h, "LoRA"). 2 % as kStrategyBound on
// shapes whose full-training prediction holds it (this tiny LLaMA's bf16 and recomputed-MLP moments are 2-4 %
// under without adapters too: a gap of the base model, not of the adapters); leaving the frozen weights'
// gradients and moments in would put these 15-40 % over, and the linears' inputs 10-25 %.
TEST_CASE("model.lora: frozen weights without gradients or moments, adapters' activations counted; peak within 2%, "
          "gpt2 (none, full, selective; fp32 and bf16) and llama (none, full; fp32)") {
  test::TempDir dir("planner-lora");
  const std::string all = "--set 'model.lora={rank: 8, targets: [all-linear]}'";
  const std::string llama = " --set model.preset= --set model.arch=llama --set model.n_head=4";
  const std::vector<std::pair<std::string, std::string>> shapes = {
      {"gpt2 all-linear none", all},
      {"gpt2 all-linear none bf16", all + " --set precision.compute=bf16"},
      {"gpt2 all-linear full", all + " --set checkpointing.mode=full"},
      {"gpt2 all-linear selective mlp", all + " --set checkpointing.mode=selective --set checkpointing.recompute=[mlp]"},
      {"gpt2 all-linear selective attention norm bf16",
       all + " --set checkpointing.mode=selective --set checkpointing.recompute=[attention,norm] --set precision.compute=bf16"},
      {"gpt2 c_attn none", "--set 'model.lora={rank: 8}'"},
      {"gpt2 all-linear full zero3 (world 1)", all + " --set checkpointing.mode=full --set parallel.sharding=zero3"},
      {"gpt2 all-linear budget 30 MiB", all + " --set checkpointing.mode=budget --set checkpointing.budget=30MiB "
                                              "--set memory.limit=80MiB"},
      {"gpt2 all-linear none, frozen weights in bf16",
       "--set 'model.lora={rank: 8, targets: [all-linear], base_dtype: bf16}' --set precision.compute=bf16"},
      {"gpt2 c_attn full, frozen weights in bf16",
       "--set 'model.lora={rank: 8, base_dtype: bf16}' --set precision.compute=bf16 --set checkpointing.mode=full"},
      {"gpt2 c_attn full bf16", "--set 'model.lora={rank: 8}' --set checkpointing.mode=full --set precision.compute=bf16"},
      {"llama all-linear none", all + llama},
      {"llama all-linear full", all + llama + " --set checkpointing.mode=full"},
      {"llama q v none", "--set 'model.lora={rank: 8}'" + llama},
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, sets] = shapes[i];
    INFO(name);
    const auto run_dir = dir.path / std::to_string(i);
    const auto s = check_run_peak(
        "--config configs/tiny.yaml --set train.steps=2 --set train.eval_interval=0 " + sets, run_dir);
    const auto cfg = config::load((run_dir / "config.json").string(), {});
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    const int64_t trained = config::Shape(cfg.model).trained_params();
    CHECK(p.grads_bytes == 4 * trained);
    CHECK(p.optimizer_bytes == 8 * trained);
    if (!cfg.parallel.sharding.shards_params())
      CHECK(p.params_bytes == 4 * trained + config::Shape(cfg.model).frozen_bytes());
    CHECK(s["model"]["trained_params"] == trained);
  }
}

TEST_CASE("parameter counts are closed formulas equal to the model's, gpt2 and llama, tied and untied") {
  const std::vector<std::vector<std::string>> shapes = {
      {},
      {"model.tie_embeddings=false", "model.bias=false"},
      {"model.tie_embeddings=false", "model.mlp_hidden=300"},
      {"model.arch=llama", "model.n_layer=3"},
      {"model.arch=llama", "model.tie_embeddings=false", "model.n_embd=96", "model.n_head=3"},
      {"model.arch=llama", "model.mlp_hidden=200", "model.bias=false"},
      {"model.lora={rank: 4, targets: [all-linear]}", "model.mlp_hidden=300"},
      {"model.arch=llama", "model.lora={rank: 3, targets: [q_proj, v_proj, down_proj]}", "model.n_layer=3"},
  };
  for (const auto& sets : shapes) {
    INFO(fmt::format("{}", fmt::join(sets, " ")));
    const auto m = config::load(test::kSourceDir + "/configs/tiny.yaml", sets).model;
    torch::NoGradGuard no_grad;
    model::GPT meta(m, torch::kMeta);
    int64_t largest = 0;
    for (const auto& p : meta->parameters()) largest = std::max(largest, p.numel());
    const auto units = memory::unit_param_counts(m);
    CHECK(config::Shape(m).total_params() == meta->num_params());
    CHECK(config::Shape(m).total_params() == std::accumulate(units.begin(), units.end(), int64_t{0}));
    CHECK(config::Shape(m).largest_unit_params() == *std::max_element(units.begin(), units.end()));
    CHECK(config::Shape(m).largest_param() == largest);
    CHECK(config::Shape(m).trained_params() == meta->num_trained_params());
  }
  // The shipped 7B recipe, without building it.
  const auto seven = config::load(test::kSourceDir + "/configs/7b_ckpt.yaml", {}).model;
  CHECK(config::Shape(seven).total_params() == 6'738'415'616);
}

TEST_CASE("the planner does O(1) work in n_layer: a billion layers are predicted at once") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {"model.n_layer=1000000000"});
  using config::CheckpointingMode;
  for (const CheckpointingMode mode : {CheckpointingMode::kNone, CheckpointingMode::kFull, CheckpointingMode::kSqrt, CheckpointingMode::kSelective}) {
    cfg.checkpointing.mode = mode;
    // Finishing at all is the check: a per-layer loop (or a meta-device model) over 1e9 layers takes
    // minutes and gigabytes. No timing is asserted here (timings belong in bench/).
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    INFO(mode);
    CHECK(p.params_bytes == 4 * config::Shape(cfg.model).total_params());
    CHECK(p.peak_bytes() > p.model_states_bytes());
  }
  const auto small = config::load(test::kSourceDir + "/configs/tiny.yaml", {}).model;
  auto big = small;
  big.n_layer = 1'000'000'000;
  const int64_t block = memory::unit_param_counts(small)[1];
  CHECK(config::Shape(big).total_params() - config::Shape(small).total_params() == (big.n_layer - small.n_layer) * block);
  // Past int64 byte counts the formulas saturate instead of wrapping.
  big.n_embd = 1 << 20;
  CHECK(config::Shape(big).total_params() == config::kMaxParams);
}

TEST_CASE("the O(1) segment counts equal the plan's for every mode") {
  std::vector<config::CheckpointingConfig> cks;
  for (bool skip : {true, false}) {
    config::CheckpointingConfig c;
    c.skip_last = skip;
    for (const config::CheckpointingMode mode : {config::CheckpointingMode::kNone, config::CheckpointingMode::kFull, config::CheckpointingMode::kSqrt})
      c.mode = mode, cks.push_back(c);
    c.mode = config::CheckpointingMode::kInterval;
    for (int64_t k : {1, 2, 3, 5}) c.interval = k, c.segments = 0, cks.push_back(c);
    for (int64_t n : {1, 2, 3}) c.interval = 0, c.segments = n, cks.push_back(c);
    c.mode = config::CheckpointingMode::kSelective;
    c.recompute = {"attention", "norm"};
    cks.push_back(c);
  }
  for (const auto& c : cks)
    for (int64_t L : {3, 4, 5, 7, 12, 13}) {
      if (c.mode == config::CheckpointingMode::kInterval && c.segments > L) continue;
      INFO(c.mode << " interval " << c.interval << " segments " << c.segments << " skip_last " << c.skip_last << " L " << L);
      const auto fast = memory::segment_counts(c, L), slow = memory::segment_counts(recompute::make_plan(c, L));
      CHECK(fast.checkpointed == slow.checkpointed);
      CHECK(fast.kept_blocks == slow.kept_blocks);
      CHECK(fast.largest_checkpointed == slow.largest_checkpointed);
      CHECK((fast.attention == slow.attention && fast.mlp == slow.mlp && fast.norm == slow.norm));
    }
}

TEST_CASE("the shipped GPU recipes fit what their headers say, at the world size they are written for") {
  struct Claim {
    std::string recipe;
    int64_t world, memory;
    double peak_gib;  // the header's per-rank peak
    int64_t largest_micro_batch, tokens_per_step;
  };
  for (const Claim& c : {Claim{"7b_ckpt", 8, 80LL << 30, 28.9, 35, 4'194'304}, Claim{"7b_nockpt", 8, 80LL << 30, 58.2, 2, 4'194'304},
                         Claim{"1b_24gb", 1, 24'000'000'000LL, 17.7, 18, 524'288}}) {
    INFO(c.recipe);
    auto cfg = config::load(test::kSourceDir + "/configs/" + c.recipe + ".yaml", {});
    cfg.world_size = c.world;
    const auto p = planner::predict_peak(memory::Scenario::of(cfg));
    CHECK(p.peak_bytes() <= c.memory);
    CHECK(std::abs(static_cast<double>(p.peak_bytes()) / (1 << 30) - c.peak_gib) < 0.05);
    CHECK(planner::largest_micro_batch(memory::Scenario::of(cfg), c.memory) == c.largest_micro_batch);
    CHECK(cfg.train.micro_batch * cfg.train.grad_accum * c.world * cfg.train.seq_len == c.tokens_per_step);
  }
}

TEST_CASE("the fused head and loss: GPT-2 124M's full-checkpointing activations on CUDA stay below 1.5 GiB") {
  // 8 x 1024 tokens over a 50,304-row head: the fp32 logits alone would be 1.6 GB, written and read
  // several times (4.6 GiB of "logits and loss buffers" in the planner's model of the unfused loss).
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{"train.device=cuda", "checkpointing.mode=full", "precision.compute=fp32",
                                 "precision.param_dtype=fp32", "parallel.sharding=none"},
        std::vector<std::string>{"train.device=cuda", "checkpointing.mode=full"}}) {
    const auto cfg = config::load(test::kSourceDir + "/configs/gpt2_124m.yaml", sets);
    const auto e = memory::estimate_activation_peak(memory::Scenario::of(cfg));
    INFO(cfg.precision.compute.name() << ": activations " << e.peak_bytes << ", loss " << e.loss_bytes);
    CHECK(e.peak_bytes < (int64_t{3} << 29));  // 1.5 GiB
    CHECK(e.loss_bytes < (int64_t{1} << 29));  // the loss at its peak, under 0.5 GiB
  }
}

namespace {
// One micro-batch's estimate of `cfg` at sequence-parallel degree n (the Scenario's field: a recipe
// at degree n needs WORLD_SIZE divisible by n to load).
memory::ActivationEstimate at_degree(const config::RunConfig& cfg, int64_t n) {
  memory::Scenario sc(memory::Scenario::of(cfg));
  sc.sequence = n;
  return memory::estimate_activation_peak(sc);
}
}  // namespace

TEST_CASE("sequence parallelism: per-token terms and all-to-all bytes equal the hand-derived ones, gpt2 and llama") {
  // fp32 (f = c = xq = xo = 4), tiny: C 128, nh 4, L 4, micro-batch 4 x 128 tokens.
  const std::vector<std::string> base = {"train.micro_batch=4", "train.grad_accum=1", "checkpointing.mode=none"};
  auto gpt2 = config::load(test::kSourceDir + "/configs/tiny.yaml", base);
  auto llama_sets = base;
  llama_sets.push_back("model.arch=llama");
  auto llama = config::load(test::kSourceDir + "/configs/tiny.yaml", llama_sets);
  for (const auto* cfg : {&gpt2, &llama}) {
    const bool is_llama = cfg->model.arch == config::Arch::kLlama;
    INFO((is_llama ? "llama" : "gpt2"));
    const double C = 128, nh = 4, H = static_cast<double>(config::Shape(cfg->model).hidden(0));
    REQUIRE(cfg->model.n_embd == 128);
    REQUIRE(cfg->model.n_head == 4);
    const auto one = at_degree(*cfg, 1), two = at_degree(*cfg, 2), four = at_degree(*cfg, 4);
    CHECK(one.tokens == 512);
    CHECK(two.tokens == 256);
    CHECK(four.tokens == 128);
    // S per local token: x, h, norm statistics, log-sum-exp (fp32) and norm1 out, the gathered q, k, v
    // (3C), the attention's output (C), the exchanged-back output (C), norm2 out, the MLP's tensors.
    const double S2 = is_llama ? 4 * (2 * C + 2 + nh) + 4 * (7 * C + 4 * H) : 4 * (2 * C + 4 + nh) + 4 * (7 * C + 2 * H);
    // The unsharded S (fused CPU attention): qkv 3C, llama's rotated q, k 2C, one output C.
    const double S1 = is_llama ? 4 * (2 * C + 2 + nh) + 4 * (8 * C + 4 * H) : 4 * (2 * C + 4 + nh) + 4 * (6 * C + 2 * H);
    CHECK(one.block_bytes == S1);
    CHECK(two.block_bytes == S2);
    CHECK(four.block_bytes == S2);
    // A block run without saving: its MLP term (h, and u, GELU / u 2H, silu, product) or its
    // exchanges: qkv 3C held, llama's rotated q, k and their stack (5C), and two 3C buffers.
    const double mlp = 4 * C + 4 * (is_llama ? 4 * H : 2 * H);
    const double exchanges = 4 * 3 * C + (is_llama ? 4 * 5 * C : 0.0) + 4 * 2 * 3 * C;
    CHECK(two.forward_bytes == std::max(mlp, exchanges));
    // Sent per micro-batch: (N-1)/N tok (3C + C) 4 bytes per exchange pair, 2 per block (no recompute).
    CHECK(one.all_to_all_bytes == 0);
    CHECK(two.all_to_all_bytes == static_cast<int64_t>(0.5 * 256 * 16 * C * 2 * 4));
    CHECK(four.all_to_all_bytes == static_cast<int64_t>(0.75 * 128 * 16 * C * 2 * 4));
    // The activations fall with the degree.
    CHECK(four.peak_bytes < two.peak_bytes);
    CHECK(two.peak_bytes < one.peak_bytes);
  }
}

TEST_CASE("sequence parallelism: recomputes add a forward exchange, and a recomputed attention keeps the unsharded S") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {"train.micro_batch=4", "checkpointing.mode=full"});
  const double pair = 0.5 * 256 * 16 * 128;  // one block's forward (or backward) exchanges at N = 2: (N-1)/N tok 4C fp32
  // full with skip_last: blocks 0-2 recomputed, the last kept: 2 x 4 + 3 pairs.
  CHECK(at_degree(cfg, 2).all_to_all_bytes == static_cast<int64_t>(11 * pair));
  cfg.checkpointing.skip_last = false;
  CHECK(at_degree(cfg, 2).all_to_all_bytes == static_cast<int64_t>(12 * pair));
  cfg.checkpointing.mode = config::CheckpointingMode::kSelective;
  cfg.checkpointing.recompute = {"mlp"};
  CHECK(at_degree(cfg, 2).all_to_all_bytes == static_cast<int64_t>(8 * pair));
  cfg.checkpointing.recompute = {"attention"};
  const auto one = at_degree(cfg, 1), two = at_degree(cfg, 2);
  CHECK(two.all_to_all_bytes == static_cast<int64_t>(12 * pair));
  CHECK(two.block_bytes == one.block_bytes);  // it keeps its input qkv, as unsharded
  // plan.json reports the bytes per step (grad_accum micro-batches) for every mode.
  cfg.checkpointing.mode = config::CheckpointingMode::kNone;
  cfg.parallel.sequence = 2;
  cfg.world_size = 2;
  cfg.train.grad_accum = 3;
  cfg.train.global_batch = 0;
  const auto j = planner::plan(cfg, 0);
  CHECK(j["sequence_parallel"] == 2);
  CHECK(j["batch_bytes"] == 2 * 8 * 4 * 64);
  REQUIRE(j["modes"][0]["mode"].get<std::string>().find("none") != std::string::npos);
  CHECK(j["modes"][0]["all_to_all_bytes_per_step"] == static_cast<int64_t>(3 * 8 * pair));
  const auto text = planner::format_plan(j);
  CHECK(text.find("all-to-all") != std::string::npos);
  CHECK(text.find("64 positions per rank") != std::string::npos);
}

namespace {
// One shape trained at sequence-parallel degree n on n ranks (2 steps, as check_strategy): each rank's
// tracked peak and its model states, and the planner's predicted peak.
struct SequenceRun {
  double predicted = 0;
  std::vector<double> peaks, states;
};
SequenceRun run_sequence_parallel(int n, const StrategyShape& shape, const std::filesystem::path& run_dir) {
  std::string args = "--config " + test::kSourceDir + "/configs/tiny.yaml --set data.source=synthetic "
                     "--set train.steps=2 --set train.micro_batch=4 --set train.grad_accum=1 --set train.eval_interval=0 "
                     "--set parallel.timeout_s=60 --set logging.peak_tflops=1 --set parallel.sequence=" + std::to_string(n) +
                     " --set logging.dir=" + run_dir.string();
  for (const auto& kv : shape.sets) args += " --set " + kv;
  const auto m = test::launch(n, args);
  INFO(shape.name << " at degree " << n << "\nrank 0:\n" << m.outputs[0] << "\nrank 1:\n" << m.outputs[1]);
  REQUIRE(m.codes == std::vector<int>(static_cast<size_t>(n), 0));
  const auto s = json::parse(test::read_text(run_dir / "summary.json"));
  REQUIRE(s["parallel"]["sequence_parallel"] == n);
  SequenceRun r;
  r.predicted = s["predicted_peak_bytes"].get<double>();
  for (const auto& rank : s["parallel"]["ranks"]) {
    r.peaks.push_back(rank["peak_allocated_bytes"].get<double>());
    r.states.push_back(rank["model_state_bytes"].get<double>());
  }
  REQUIRE(r.peaks.size() == static_cast<size_t>(n));
  return r;
}
}  // namespace

// Measured against the planner at degree 2 and 4 (CPU, Gloo's all-to-all): the shapes of [strategies]
// in each checkpointing kind. Each rank's peak within kStrategyBound (2 %) of the prediction, as every
// strategy's, and the part above the model states (activations, the batch, the RoPE tables: what the
// sequence degree divides) within kBound (5 %), the activation model's promise. Measured: every rank
// of a run the same bytes; above the states gpt2 none exact at both degrees, llama full -0.45 % / -0.84 %,
// gpt2 selective -1.6 % / -2.7 % (at one process -0.9 %: the same bytes the model leaves out, a larger
// share of activations halved and quartered). Per-rank activations fall with the degree.
TEST_CASE("sequence parallelism at degree 2 and 4: every rank's peak within 2% of the prediction, activations fall with N",
          "[strategies]") {
  const std::vector<StrategyShape> shapes = {
      {"gpt2 4 layers, none", {"checkpointing.mode=none"}},
      {"llama 6 layers, full", {"model.arch=llama", "model.n_layer=6", "checkpointing.mode=full"}},
      {"gpt2 4 layers, selective", {"checkpointing.mode=selective", "checkpointing.recompute=[attention,mlp,norm]"}},
      // checkpointing.exchange keep: each recomputed block's exchanged tensors held from its first pass
      {"gpt2 4 layers, full, exchange keep", {"checkpointing.mode=full", "checkpointing.exchange=keep"}},
      {"gpt2 4 layers, selective attention, exchange keep",
       {"checkpointing.mode=selective", "checkpointing.recompute=[attention]", "checkpointing.exchange=keep"}},
  };
  test::TempDir dir("planner-sequence");
  int k = 0;
  for (const auto& shape : shapes) {
    std::map<int, double> worst_activations;  // degree -> the largest rank's measured peak above its states
    for (const int n : {2, 4}) {
      const auto r = run_sequence_parallel(n, shape, dir.path / std::to_string(k++));
      for (size_t i = 0; i < r.peaks.size(); ++i) {
        const double activations = r.peaks[i] - r.states[i], predicted = r.predicted - r.states[i];
        INFO(fmt::format("{} degree {} rank {}: peak predicted {:.0f} measured {:.0f}; above the states predicted {:.0f} "
                         "measured {:.0f}", shape.name, n, i, r.predicted, r.peaks[i], predicted, activations));
        CHECK(std::abs(r.predicted - r.peaks[i]) <= kStrategyBound * r.peaks[i]);
        CHECK(std::abs(predicted - activations) <= kBound * activations);
        worst_activations[n] = std::max(worst_activations[n], activations);
      }
      fmt::print("planner sequence {} degree {}: predicted / measured {:.4f}\n", shape.name, n,
                 r.predicted / *std::max_element(r.peaks.begin(), r.peaks.end()));
    }
    INFO(shape.name);
    CHECK(worst_activations[4] < worst_activations[2]);
  }
}

TEST_CASE("sequence parallelism: a recompute's exchange sets moment B where the MLP is narrow, in the formula and the walk") {
  // gpt2 tiny, fp32, H = 16, full checkpointing (3 one-block segments and the last block kept), N = 2:
  // tok = 256. Per token: S = 4 (2C + 4 + nh) + 4 (7C + 2H) = 4768 and T = 4C + 4H = 576, so the
  // backward's S + T = 5344 falls below the recompute's exchange Rx = x 4C + norm1 out 4C + its
  // statistics 8 + qkv 4 x 3C + the two buffers 4 x 6C = 5640 (C = 128).
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml",
                          {"train.micro_batch=4", "checkpointing.mode=full", "model.mlp_hidden=16"});
  REQUIRE(config::Shape(cfg.model).hidden(0) == 16);
  memory::Scenario sc(memory::Scenario::of(cfg));
  sc.sequence = 2;
  const auto e = memory::estimate_activation_peak(sc);
  const double tied = static_cast<double>(e.tied_grad_bytes);
  CHECK(e.block_bytes == 4768);
  CHECK(e.backward_bytes == 576);
  CHECK(e.moment_b == tied + 256.0 * (4 * 128 * 3 + 5640));  // the three segment inputs and Rx; integers, exact in double
  CHECK(e.peak_bytes >= static_cast<int64_t>(e.moment_b));
  // The walk block by block gives the same backward moment.
  memory::PhasePeaks phases;
  memory::chain_peak(memory::chain_model(sc, memory::lowp_matmul_path(sc)),
                     recompute::make_plan(cfg.checkpointing, cfg.model.n_layer), nullptr, &phases);
  CHECK(phases.backward == e.moment_b);
}

// configs/8b_128k.yaml (LLaMA-3-8B's shape at 131072 tokens, ZeRO-3 over 8 ranks of 80 GiB): without
// sequence parallelism the checkpointed block inputs alone, 32 x 131072 x 4096 fp32 = 64 GiB, leave no
// room beside 16.5 GiB of model states; at degree 8 each rank holds an eighth of them.
TEST_CASE("trainer plan --sequence-parallel: 8b_128k fits 80 GiB at degree 8 and not at 1; auto picks the smallest degree "
          "that fits") {
  test::TempDir dir("plan-sequence");
  const auto plan_at = [&](const std::string& degree) {
    const auto out = dir.path / ("plan-" + degree + ".json");
    const auto r = test::trainer("plan --config configs/8b_128k.yaml --world-size 8 --sequence-parallel " + degree +
                                 " --out " + out.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    return std::make_pair(json::parse(test::read_text(out)), r.output);
  };
  const int64_t gib80 = int64_t{80} << 30;
  const auto recipe_peak = [](const json& plan) { return plan["modes"][0]["peak_bytes"].get<int64_t>(); };
  const auto [p1, out1] = plan_at("1");
  const auto [p8, out8] = plan_at("8");
  CHECK(p1["sequence_parallel"] == 1);
  CHECK(p8["sequence_parallel"] == 8);
  CHECK(recipe_peak(p1) > gib80);
  CHECK(recipe_peak(p8) <= gib80);
  CHECK(p1["modes"][0]["all_to_all_bytes_per_step"] == 0);
  CHECK(p8["modes"][0]["all_to_all_bytes_per_step"].get<int64_t>() > 0);
  // The modelled step time counts the exchanges (logging.peak_tflops is set): step = compute + all-to-all.
  CHECK(p8["modes"][0]["all_to_all_s"].get<double>() > 0.0);
  CHECK(p8["modes"][0]["step_s"].get<double>() > p8["modes"][0]["all_to_all_s"].get<double>());

  const auto [pa, outa] = plan_at("auto");
  const auto& search = pa["sequence_search"];
  std::vector<int64_t> degrees;
  for (const auto& d : search["degrees"]) degrees.push_back(d["degree"].get<int64_t>());
  CHECK(degrees == std::vector<int64_t>{1, 2, 4, 8});  // those dividing 8 ranks, 32 heads and 131072 positions
  int64_t smallest = 0, previous = std::numeric_limits<int64_t>::max();
  for (const auto& d : search["degrees"]) {
    const int64_t peak = d["peak_bytes"].get<int64_t>();
    CHECK(peak < previous);  // per-rank memory falls with the degree
    previous = peak;
    CHECK(d["fits"].get<bool>() == (peak <= gib80));
    if (smallest == 0 && d["fits"].get<bool>()) smallest = d["degree"].get<int64_t>();
  }
  REQUIRE(smallest > 1);
  CHECK(search["chosen"] == smallest);
  CHECK(pa["sequence_parallel"] == smallest);  // the plan below the search is at the chosen degree
  CHECK(search["degrees"][0]["peak_bytes"] == recipe_peak(p1));
  CHECK(search["degrees"][3]["peak_bytes"] == recipe_peak(p8));
  CHECK(outa.find(fmt::format("Smallest degree that fits: parallel.sequence: {}", smallest)) != std::string::npos);

  // A degree the recipe cannot take is refused before anything is planned, naming what it does not divide.
  const auto bad = test::trainer("plan --config configs/8b_128k.yaml --world-size 8 --sequence-parallel 3");
  INFO(bad.output);
  CHECK(bad.code == kExitConfig);
  CHECK(bad.output.find("model.n_head = 32") != std::string::npos);
  CHECK(bad.output.find("WORLD_SIZE = 8") != std::string::npos);
  CHECK(test::trainer("plan --config configs/8b_128k.yaml --world-size 8 --sequence-parallel some").code == kExitConfig);
}

// Full checkpointing of tiny's 4 blocks (skip_last false) at degree 2, fp32 (f = c = xq = xo = 4):
// tok = 4 x 128 / 2 = 256 local tokens, Kx = tok (3C + C) 4 = 256 x 16 x 128 bytes per block. With the
// walk's terms (memory::chain_model: in = tok fC, S, T, Fb, Rx, the head's E and H), per the keep
// paragraph of predict/activations.h, nothing else changing:
//   F, first pass of segment i:  redo  i in + in + Fb              keep  i (in + Kx) + in + Fb   (max at i = 3)
//   F, end of the forward:       redo  4 in + H                    keep  4 (in + Kx) + H
//   A, start of backward:        redo  4 in + E                    keep  4 (in + Kx) + E
//   B, the last segment (the largest moment of its kind: the others hold less before them):
//                                redo  G + 4 in + max(S + T, Rx)   keep  G + 3 (in + Kx) + in + S + T
// (fp32: no weight copies; no dropout mask; G the tied embedding's gradient.) So keep - redo is 4 Kx at
// F's end and A, and 3 Kx + (S + T - max(S + T, Rx)) at B. All terms are whole numbers far below 2^53:
// exact in doubles.
TEST_CASE("checkpointing.exchange keep at degree 2: the peak grows by the held Kx and the all-to-all bytes drop by the "
          "recomputes' exchanges, exactly") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml",
                          {"train.micro_batch=4", "checkpointing.mode=full", "checkpointing.skip_last=false"});
  memory::Scenario redo(memory::Scenario::of(cfg)), keep(memory::Scenario::of(cfg));
  redo.sequence = keep.sequence = 2;
  redo.checkpointing.exchange = config::Exchange::kRedo;
  keep.checkpointing.exchange = config::Exchange::kKeep;
  const auto m = memory::chain_model(keep, memory::lowp_matmul_path(keep));
  const double C = 128, tok = 256, Kx = tok * (3 * C + C) * 4;
  REQUIRE(m.exchange_kept.size() == 4);
  for (double kx : m.exchange_kept) CHECK(kx == Kx);
  REQUIRE(m.held == 0);
  const double in = m.input, S = m.kept[0][0], T = m.backward[0][0], Fb = m.forward[0], Rx = m.recompute_exchange[0];
  const double G = m.tied_grad;
  const double redo_b = G + 4 * in + std::max(S + T, Rx), keep_b = G + 3 * (in + Kx) + in + S + T;
  const double redo_peak = std::max({4 * in + Fb, 4 * in + m.head_forward, 4 * in + m.head, redo_b});
  const double keep_peak = std::max({3 * (in + Kx) + in + Fb, 4 * (in + Kx) + m.head_forward, 4 * (in + Kx) + m.head, keep_b});
  const auto r = memory::estimate_activation_peak(redo), k = memory::estimate_activation_peak(keep);
  CHECK(r.peak_bytes == static_cast<int64_t>(redo_peak));
  CHECK(k.peak_bytes == static_cast<int64_t>(keep_peak));
  CHECK(k.forward_end_peak_bytes - r.forward_end_peak_bytes == static_cast<int64_t>(4 * Kx));
  CHECK(k.start_peak_bytes - r.start_peak_bytes == static_cast<int64_t>(4 * Kx));
  CHECK(k.backward_peak_bytes == static_cast<int64_t>(keep_b));
  CHECK(r.backward_peak_bytes == static_cast<int64_t>(redo_b));
  // For tiny, B sets both peaks and the recompute's exchange buffers stay below S + T: keep - redo = 3 Kx.
  REQUIRE(S + T >= Rx);
  REQUIRE(redo_peak == redo_b);
  REQUIRE(keep_peak == keep_b);
  CHECK(k.peak_bytes - r.peak_bytes == static_cast<int64_t>(3 * Kx));
  // Sent per micro-batch: 2 exchange pairs per block, and redo one more per recomputed block (all 4);
  // a pair is (N-1)/N tok (3C + C) 4 bytes.
  const double pair = 0.5 * tok * 16 * C;
  CHECK(r.all_to_all_bytes == static_cast<int64_t>(12 * pair));
  CHECK(k.all_to_all_bytes == static_cast<int64_t>(8 * pair));
  CHECK(r.all_to_all_bytes - k.all_to_all_bytes == static_cast<int64_t>(4 * pair));
  // At degree 1 keep changes nothing.
  redo.sequence = keep.sequence = 1;
  CHECK(memory::estimate_activation_peak(keep).peak_bytes == memory::estimate_activation_peak(redo).peak_bytes);
}

// tiny with full checkpointing on 2 ranks: degree 1 holds more than degree 2 with every exchange kept,
// which holds more than degree 2 redoing them. Between the two degree-2 peaks only redo fits; at keep's
// peak keep fits and is chosen (fewer all-to-all bytes: the smaller step time).
TEST_CASE("trainer plan --sequence-parallel auto: keep where it fits, redo where only redo fits") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml",
                          {"train.micro_batch=4", "checkpointing.mode=full", "checkpointing.skip_last=false"});
  cfg.world_size = 2;
  const auto search = planner::sequence_search(memory::Scenario::of(cfg).at(4), 0);
  REQUIRE(search["degrees"].size() == 2);
  const auto& one = search["degrees"][0];
  const auto& two = search["degrees"][1];
  CHECK_FALSE(one.contains("exchanges"));  // nothing to choose at degree 1
  REQUIRE(two.contains("exchanges"));
  const int64_t p1 = one["peak_bytes"].get<int64_t>();
  const int64_t redo = two["exchanges"]["redo"]["peak_bytes"].get<int64_t>();
  const int64_t keep = two["exchanges"]["keep"]["peak_bytes"].get<int64_t>();
  CHECK(two["peak_bytes"] == redo);  // the row's own numbers: the recipe's exchange (auto: redo)
  REQUIRE(redo < keep);
  REQUIRE(keep < p1);
  CHECK(two["exchanges"]["keep"]["all_to_all_bytes_per_step"].get<int64_t>() <
        two["exchanges"]["redo"]["all_to_all_bytes_per_step"].get<int64_t>());
  CHECK(two["exchanges"]["keep"]["all_to_all_s"].get<double>() < two["exchanges"]["redo"]["all_to_all_s"].get<double>());

  test::TempDir dir("plan-exchange");
  const auto plan_with = [&](int64_t memory) {
    const auto out = dir.path / fmt::format("plan-{}.json", memory);
    const auto r = test::trainer(fmt::format("plan --config configs/tiny.yaml --set train.micro_batch=4 --set "
                                             "checkpointing.mode=full --set checkpointing.skip_last=false --world-size 2 "
                                             "--sequence-parallel auto --memory {}B --out {}",
                                             memory, out.string()));
    INFO(r.output);
    REQUIRE(r.code == 0);
    return std::make_pair(json::parse(test::read_text(out)), r.output);
  };
  const auto [between, between_text] = plan_with((redo + keep) / 2);
  CHECK(between["sequence_search"]["chosen"] == 2);
  CHECK(between["sequence_search"]["chosen_exchange"] == "redo");
  CHECK(between["sequence_search"]["degrees"][1]["exchange"] == "redo");
  CHECK(between_text.find("parallel.sequence: 2, checkpointing.exchange: redo") != std::string::npos);
  CHECK(between["modes"][0]["peak_bytes"] == redo);  // the plan below the search: degree 2, redo
  const auto [at_keep, keep_text] = plan_with(keep);
  CHECK(at_keep["sequence_search"]["chosen"] == 2);
  CHECK(at_keep["sequence_search"]["chosen_exchange"] == "keep");
  CHECK(keep_text.find("parallel.sequence: 2, checkpointing.exchange: keep") != std::string::npos);
  CHECK(at_keep["modes"][0]["peak_bytes"] == keep);  // the plan below the search: degree 2, keep
}

// Budget mode's formula prices a recomputed attention's two forward all-to-alls: at degree N the
// attention's cost is its FLOPs for the rank's B T / N tokens plus the exchange's bytes, (N - 1) / N x
// B T / N x 4 C x c, at parallel.all_to_all_gbps, in the GFLOP the device runs meanwhile.
TEST_CASE("budget's formula costs price the sequence group's all-to-all") {
  auto cfg = config::load((std::filesystem::path(test::kSourceDir) / "configs/8b_128k.yaml").string(),
                          {"parallel.sequence=1"});
  cfg.world_size = 8;
  const auto at = [&](int64_t n, double gbps) {
    auto c = cfg;
    c.parallel.sequence = n;
    c.parallel.all_to_all_gbps = gbps;
    return budget::formula_costs(memory::Scenario::of(c)).blocks.front();
  };
  const double C = 4096, T = 131072, c = 2, tok8 = T / 8;
  const double flops = 0.5 * 989e12;  // kModelledMfu of the recipe's logging.peak_tflops
  const auto b8 = at(8, 100.0), b8_fast = at(8, 200.0), b1 = at(1, 100.0);
  const double exchange = 7.0 / 8.0 * tok8 * 4 * C * c / 100e9 * flops / 1e9;  // GFLOP at 100 GB/s
  // Relative bounds of double rounding only (a handful of operations on values below 1e16).
  CHECK(b8.attention == Approx(4 * tok8 * T * C / 1e9 + exchange).epsilon(1e-12));
  CHECK(b8.attention - b8_fast.attention == Approx(exchange / 2).epsilon(1e-9));
  CHECK(b1.attention == Approx(4 * T * T * C / 1e9).epsilon(1e-12));
}

TEST_CASE("the memory model's input is made once from the recipe: auto's micro-batch is 1, the device resolved") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {"train.micro_batch=auto", "train.global_batch=8", "memory.limit=1GiB"});
  const auto sc = memory::Scenario::of(cfg);
  CHECK(sc.micro_batch == 1);  // where the states check and the micro-batch search start
  CHECK(sc.seq_len == cfg.train.seq_len);
  // train.device auto: resolved here, so the formulas never ask the machine.
  CHECK(sc.device != config::DeviceChoice::kAuto);
  CHECK(sc.on_cuda() == torch::cuda::is_available());
  cfg.train.device = config::DeviceChoice::kCuda;
  CHECK(memory::Scenario::of(cfg).on_cuda());
  cfg.train.device = config::DeviceChoice::kLazy;
  CHECK(memory::Scenario::of(cfg).device == config::DeviceChoice::kLazy);
  CHECK_FALSE(memory::Scenario::of(cfg).on_cuda());
  // at(b) is the same scenario at another micro-batch, nothing else changed.
  const auto at4 = sc.at(4);
  CHECK(at4.micro_batch == 4);
  CHECK(at4.grad_accum == sc.grad_accum);
  CHECK(at4.device == sc.device);
  CHECK(memory::predict_states(at4).model_states_bytes() == memory::predict_states(sc).model_states_bytes());
}

TEST_CASE("the out-of-memory advice keeps the batch per rank: micro_batch x grad_accum, however it is split") {
  const auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  const int64_t limit = 60LL << 20;  // holds the model states, not micro-batch 16's activations
  auto split = [&](int64_t micro, int64_t accum) {
    auto sc = memory::Scenario::of(cfg).at(micro);
    sc.grad_accum = accum;
    return planner::oom_advice(sc, limit);
  };
  // A per-rank batch of 64, above what any mode fits at this limit, so that each split's grad_accum shows.
  const std::string whole = split(1, 64);  // auto before it has its number: the per-rank batch as 1 x 64
  INFO(whole);
  CHECK(whole == split(4, 16));
  CHECK(whole == split(64, 1));
  // Every mode's grad_accum is the per-rank batch over its micro-batch, rounded up.
  const std::regex entry(R"((\w+): micro_batch (\d+) with grad_accum (\d+))");
  int entries = 0;
  for (std::sregex_iterator it(whole.begin(), whole.end(), entry), end; it != end; ++it, ++entries) {
    const int64_t mb = std::stoll((*it)[2]), accum = std::stoll((*it)[3]);
    CHECK(mb < 64);
    CHECK(accum == (64 + mb - 1) / mb);
  }
  CHECK(entries > 0);
  CHECK(split(1, 128) != whole);  // another per-rank batch, other accumulations
}

}  // namespace SUBLINEAR_TEST_FILE
