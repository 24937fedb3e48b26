// trainer: command line (CLI11) and the mapping from errors to exit codes. Nothing else.
#include <malloc.h>

#include <cstdio>
#include <filesystem>
#include <new>
#include <cstdlib>
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
#include "log/run_dir.h"
#include "memory/tracking_allocator.h"
#include "planner/planner.h"
#include "train/trainer.h"

namespace {

// Every option of every command, filled by CLI11.
struct Cli {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string resume;
  bool help_config = false;
  bool no_profile = false;
  std::string plan_memory, plan_out;
  int64_t plan_world = 0;
  sl::interop::ExportRequest export_req;
  CLI::App* plan_cmd = nullptr;
  CLI::App* export_cmd = nullptr;
};

void add_commands(CLI::App& app, Cli& cli) {
  app.require_subcommand(0, 1);
  app.add_flag("--help-config", cli.help_config, "print every recipe key with its type, default and meaning");
  auto add_run_options = [&](CLI::App* cmd) {
    cmd->add_option("-c,--config", cli.config_path, "YAML recipe, e.g. configs/tiny.yaml");
    cmd->add_option("-s,--set", cli.overrides, "override a recipe key: --set section.key=value (repeatable)");
    cmd->add_flag("--no-profile", cli.no_profile, "checkpointing.mode budget: solve from the FLOP formula's costs, "
                                                  "not a profiling pass (= --set checkpointing.profile_costs=false)");
  };
  auto add_resume = [&](CLI::App* cmd) {
    cmd->add_option("--resume", cli.resume, "continue from a saved training state: auto (the newest valid one of the run "
                                            "directory; none: start fresh) or PATH (a state, state directory or run directory)");
  };
  add_run_options(&app);
  add_resume(&app);
  auto* train_cmd = app.add_subcommand("train", "train (the default when no subcommand is given)");
  add_run_options(train_cmd);
  add_resume(train_cmd);

  cli.plan_cmd = app.add_subcommand("plan", "predict memory without making tensors; writes plan.json");
  add_run_options(cli.plan_cmd);
  cli.plan_cmd->add_option("--memory", cli.plan_memory, "device memory to fit, e.g. 80GiB (default: memory.limit)");
  cli.plan_cmd->add_option("--out", cli.plan_out, "where to write plan.json (default: runs/<recipe>-plan.json)");
  cli.plan_cmd->add_option("--world-size", cli.plan_world, "ranks to plan for (per-rank memory under parallel.sharding; "
                                                           "default: WORLD_SIZE or 1)")->check(CLI::PositiveNumber);

  cli.export_cmd = app.add_subcommand("export", "write a run's newest weights as a Hugging Face checkpoint "
                                                "(model.safetensors + config.json)");
  auto& req = cli.export_req;
  cli.export_cmd->add_option("--run", req.run, "the run directory (its config.json, state/ and model/)")->required();
  cli.export_cmd->add_option("--out", req.out, "a directory, or a .safetensors file with config.json beside it "
                                               "(default: <run>/hf-step-NNNNNNNN/)");
  cli.export_cmd->add_option("--dtype", req.dtype, "fp32 (default) or bf16 (for inference tools)");
}

int run_export(const sl::interop::ExportRequest& req) {
  sl::memory::TrackingCPUAllocator::install();  // to report the export's peak tensor memory
  const auto r = sl::interop::export_run(req);
  fmt::print("exported step {} from {} -> {} ({}; peak tensor memory {}, peak_tensor_bytes={})\n", r.step, r.source,
             r.file.string(), sl::log::format_bytes(r.bytes), sl::log::format_bytes(r.peak_tensor_bytes),
             r.peak_tensor_bytes);
  return sl::kExitOk;
}

int run_plan(const sl::config::RunConfig& cfg, const Cli& cli) {
  const int64_t memory = cli.plan_memory.empty() ? sl::config::memory_limit_bytes(cfg)
                                                 : sl::config::parse_bytes(cli.plan_memory, "--memory");
  const auto report = sl::planner::plan(cfg, memory);
  fmt::print("{}", sl::planner::format_plan(report));
  const std::filesystem::path out = cli.plan_out.empty() ? sl::log::default_plan_path(cfg.recipe_name) : std::filesystem::path(cli.plan_out);
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  sl::log::write_json_file(out, report);
  fmt::print("wrote {}\n", out.string());
  return sl::kExitOk;
}

// The parsed command: export, plan or train.
int dispatch(const Cli& cli) {
  if (cli.export_cmd->parsed()) return run_export(cli.export_req);
  if (cli.config_path.empty())
    throw sl::ConfigError("--config: no recipe given; try `trainer --config configs/tiny.yaml` (keys: trainer --help-config)");
  auto overrides = cli.overrides;
  if (cli.no_profile) overrides.push_back("checkpointing.profile_costs=false");
  // plan --memory: the memory to fit, also what a share budget (checkpointing.budget: 90%) is a share of
  if (cli.plan_cmd->parsed() && !cli.plan_memory.empty()) overrides.push_back("memory.limit=" + cli.plan_memory);
  // plan --world-size: the recipe is checked for that world size (train.global_batch, DDP offload) as a
  // rank launched at it would check it.
  if (cli.plan_cmd->parsed() && cli.plan_world > 0) ::setenv("WORLD_SIZE", std::to_string(cli.plan_world).c_str(), 1);
  auto cfg = sl::config::load(cli.config_path, overrides);
  if (cli.plan_cmd->parsed()) return run_plan(cfg, cli);
  cfg.resume = cli.resume;
  // Install before any tensor exists so every CPU tensor is counted.
  if (cfg.memory.track_cpu) sl::memory::TrackingCPUAllocator::install();
  return sl::train::run(cfg);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sublinear trainer: trains a GPT-style model from a YAML recipe (see README)"};
  Cli cli;
  add_commands(app, cli);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return sl::kExitConfig;
  }
  if (cli.help_config) {
    fmt::print("{}", sl::config::help_text());
    return sl::kExitOk;
  }

  spdlog::set_pattern("[%H:%M:%S] %v");
  // Keep freed tensor memory in the heap instead of returning it to the OS: every step allocates and
  // frees the same large buffers, and fresh pages cost a page fault each (~10% of a CPU step here).
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  try {
    return dispatch(cli);
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
