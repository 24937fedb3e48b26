// trainer: command line (CLI11) and the mapping from errors to exit codes. Nothing else.
#include <malloc.h>

#include <cstdio>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "config/config.h"
#include "errors.h"
#include "interop/export.h"
#include "log/metrics.h"
#include "memory/planner.h"
#include "memory/tracking_allocator.h"
#include "train/trainer.h"

namespace {

int run_export(const sl::interop::ExportRequest& req) {
  sl::memory::TrackingCPUAllocator::install();  // to report the export's peak tensor memory
  const auto r = sl::interop::export_run(req);
  fmt::print("exported step {} from {} -> {} ({}; peak tensor memory {}, peak_tensor_bytes={})\n", r.step, r.source,
             r.file.string(), sl::log::format_bytes(r.bytes), sl::log::format_bytes(r.peak_tensor_bytes),
             r.peak_tensor_bytes);
  return sl::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sublinear trainer: trains a GPT-style model from a YAML recipe (see README)"};
  app.require_subcommand(0, 1);
  std::string config_path;
  std::vector<std::string> overrides;
  std::string resume;
  bool help_config = false;
  app.add_flag("--help-config", help_config, "print every recipe key with its type, default and meaning");
  auto add_run_options = [&](CLI::App* cmd) {
    cmd->add_option("-c,--config", config_path, "YAML recipe, e.g. configs/tiny.yaml");
    cmd->add_option("-s,--set", overrides, "override a recipe key: --set section.key=value (repeatable)");
  };
  auto add_resume = [&](CLI::App* cmd) {
    cmd->add_option("--resume", resume, "continue from a saved training state: auto (the newest valid one of the run "
                                        "directory; none: start fresh) or PATH (a state, state directory or run directory)");
  };
  add_run_options(&app);
  add_resume(&app);
  auto* train_cmd = app.add_subcommand("train", "train (the default when no subcommand is given)");
  add_run_options(train_cmd);
  add_resume(train_cmd);
  auto* plan_cmd = app.add_subcommand("plan", "predict memory without making tensors; writes plan.json");
  add_run_options(plan_cmd);
  std::string plan_memory, plan_out;
  plan_cmd->add_option("--memory", plan_memory, "device memory to fit, e.g. 80GiB (default: memory.limit)");
  plan_cmd->add_option("--out", plan_out, "where to write plan.json (default: runs/<recipe>-plan.json)");
  int64_t plan_world = 0;
  plan_cmd->add_option("--world-size", plan_world, "ranks to plan for (per-rank memory under parallel.sharding; "
                                                   "default: WORLD_SIZE or 1)")->check(CLI::PositiveNumber);

  auto* export_cmd = app.add_subcommand("export", "write a run's newest weights as a Hugging Face checkpoint "
                                                  "(model.safetensors + config.json)");
  sl::interop::ExportRequest export_req;
  export_cmd->add_option("--run", export_req.run, "the run directory (its config.json, state/ and model/)")->required();
  export_cmd->add_option("--out", export_req.out, "a directory, or a .safetensors file with config.json beside it "
                                                  "(default: <run>/hf-step-NNNNNNNN/)");
  export_cmd->add_option("--dtype", export_req.dtype, "fp32 (default) or bf16 (for inference tools)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return sl::kExitConfig;
  }
  if (help_config) {
    fmt::print("{}", sl::config::help_text());
    return sl::kExitOk;
  }

  spdlog::set_pattern("[%H:%M:%S] %v");
  // Keep freed tensor memory in the heap instead of returning it to the OS: every step allocates and
  // frees the same large buffers, and fresh pages cost a page fault each (~10% of a CPU step here).
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  try {
    if (export_cmd->parsed()) return run_export(export_req);
    if (config_path.empty())
      throw sl::ConfigError("--config: no recipe given; try `trainer --config configs/tiny.yaml` (keys: trainer --help-config)");
    auto cfg = sl::config::load(config_path, overrides);
    if (plan_cmd->parsed()) {
      if (plan_world > 0) {  // default: WORLD_SIZE, read by config::load
        cfg.world_size = plan_world;
        sl::config::validate(cfg);  // train.global_batch against this world size
      }
      const int64_t memory = plan_memory.empty() ? sl::config::memory_limit_bytes(cfg)
                                                 : sl::config::parse_bytes(plan_memory, "--memory");
      const auto report = sl::memory::plan(cfg, memory);
      fmt::print("{}", sl::memory::format_plan(report));
      const std::filesystem::path out = plan_out.empty() ? "runs/" + cfg.recipe_name + "-plan.json" : plan_out;
      if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
      sl::log::write_json_file(out, report);
      fmt::print("wrote {}\n", out.string());
      return sl::kExitOk;
    }
    cfg.resume = resume;
    // Install before any tensor exists so every CPU tensor is counted.
    if (cfg.memory.track_cpu) sl::memory::TrackingCPUAllocator::install();
    return sl::train::run(cfg);
  } catch (const sl::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return e.code;
  } catch (const c10::OutOfMemoryError& e) {
    fmt::print(stderr, "error: out of memory before training started: {}\n", e.what_without_backtrace());
    return sl::kExitOom;
  } catch (const std::bad_alloc& e) {
    fmt::print(stderr, "error: out of memory before training started: {}\n", e.what());
    return sl::kExitOom;
  } catch (const c10::Error& e) {
    const bool oom = sl::memory::is_allocation_failure(e);
    fmt::print(stderr, "error: {}{}\n", oom ? "out of memory before training started: " : "LibTorch: ",
               e.what_without_backtrace());
    return oom ? sl::kExitOom : sl::kExitInternal;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
