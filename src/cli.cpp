// cli.cpp: the trainer's command line (CLI11) and the mapping from errors to exit codes. Nothing else.
#include <malloc.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <new>
#include <cstdlib>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli.h"
#include "config/config.h"
#include "device/build_info.h"
#include "errors.h"
#include "interop/export.h"
#include "log/metrics.h"
#include "log/run_dir.h"
#include "predict/scenario.h"
#include "memory/tracking_allocator.h"
#include "predict/planner.h"
#include "interop/sample.h"
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
  int64_t plan_sequence = -1;  // plan --sequence-parallel: a degree, 0 = auto, -1 = the recipe's
  sl::interop::ExportRequest export_req;
  std::string export_dtype = "fp32";  // export --dtype, parsed in dispatch()
  sl::interop::SampleRequest sample_req;
  std::string sample_device = "auto";  // sample --device, parsed in dispatch()
  bool sample_json = false, sample_no_cache = false, sample_ignore_eot = false;
  CLI::App* plan_cmd = nullptr;
  CLI::App* export_cmd = nullptr;
  CLI::App* sample_cmd = nullptr;
};

void add_sample_command(CLI::App& app, Cli& cli) {
  cli.sample_cmd = app.add_subcommand("sample", "generate text from a run's newest weights or a Hugging Face folder, "
                                                "with a KV cache; prints the text and tokens/s");
  auto& r = cli.sample_req;
  auto* cmd = cli.sample_cmd;
  auto* run = cmd->add_option("--run", r.run,
                              "a run directory: its newest weights (final or saved state) and its tokenizer.json");
  auto* weights =
      cmd->add_option("--weights", r.weights, "a Hugging Face folder: config.json, model.safetensors, tokenizer.json");
  run->excludes(weights);
  cmd->add_option("--tokenizer", r.tokenizer, "a tokenizer.json to use instead of the run's or folder's");
  cmd->add_option("--prompt", r.prompt, "the text to continue (default: the end-of-text token alone)");
  cmd->add_option("--max-new-tokens", r.max_new_tokens, "tokens to generate (default 64)");
  cmd->add_option("--temperature", r.temperature, "softmax temperature; 0 = greedy (default 1)");
  cmd->add_option("--top-k", r.top_k, "sample among the k most likely tokens; 0 = all (default)");
  cmd->add_option("--seed", r.seed, "sampling seed: the same seed gives the same text (default 1337)");
  cmd->add_option("--device", cli.sample_device, "auto (default: cuda when available) | cpu | cuda");
  cmd->add_flag("--no-cache", cli.sample_no_cache,
                "recompute the whole sequence for every token (no KV cache; for comparison)");
  cmd->add_flag("--ignore-eot", cli.sample_ignore_eot, "keep going past the end-of-text token");
  cmd->add_flag("--json", cli.sample_json, "print one JSON object (ids, text, timings) instead of the text");
}

// A flag that names a recipe choice (export --dtype, sample --device), read by the recipe's parser;
// `expected` lists the names the command takes (the command refuses the others it parses).
template <class Choice> Choice parse_flag(const std::string& text, const char* flag, const char* expected) {
  if (const auto c = Choice::parse(text)) return *c;
  throw sl::ConfigError(fmt::format("{} {}: expected {}", flag, text, expected));
}

int run_sample(const Cli& cli) {
  auto req = cli.sample_req;
  req.device = parse_flag<sl::config::DeviceChoice>(cli.sample_device, "sample --device", "auto, cpu or cuda");
  req.use_cache = !cli.sample_no_cache;
  req.stop_at_eot = !cli.sample_ignore_eot;
  const auto r = sl::interop::sample(req);
  if (cli.sample_json) {
    const nlohmann::json j = {{"weights", r.weights}, {"tokenizer", r.tokenizer}, {"prompt", r.prompt_text},
                              {"prompt_ids", r.prompt_ids}, {"ids", r.ids}, {"text", r.text},
                              {"prompt_seconds", r.prompt_seconds}, {"seconds", r.seconds},
                              {"tokens_per_s", r.tokens_per_s()}, {"kv_cache", req.use_cache}};
    fmt::print("{}\n", j.dump());
    return sl::kExitOk;
  }
  fmt::print("{}{}\n---\n", r.prompt_text, r.text);
  fmt::print("sample: {} new tokens in {:.2f} s, {:.1f} tokens/s ({}; prompt {} tokens, first token after {:.0f} ms)\n",
             r.ids.size(), r.seconds, r.tokens_per_s(), req.use_cache ? "KV cache" : "no cache", r.prompt_ids.size(),
             1e3 * r.prompt_seconds);
  fmt::print("weights {}; tokenizer {}\n", r.weights, r.tokenizer);
  return sl::kExitOk;
}

// The options of a command that reads a recipe: --config, --set, --no-profile.
void add_run_options(CLI::App* cmd, Cli& cli) {
  cmd->add_option("-c,--config", cli.config_path, "YAML recipe, e.g. configs/tiny.yaml");
  cmd->add_option("-s,--set", cli.overrides, "override a recipe key: --set section.key=value (repeatable)");
  cmd->add_flag("--no-profile", cli.no_profile, "checkpointing.mode budget: solve from the FLOP formula's costs, "
                                                "not a profiling pass (= --set checkpointing.profile_costs=false)");
}

void add_resume(CLI::App* cmd, Cli& cli) {
  cmd->add_option("--resume", cli.resume,
                  "continue from a saved training state: auto (the newest valid one of the run "
                  "directory; none: start fresh) or PATH (a state, state directory or run directory)");
}

// trainer plan: the recipe's options and what to plan for.
void add_plan_command(CLI::App& app, Cli& cli) {
  cli.plan_cmd = app.add_subcommand("plan", "predict memory without making tensors; writes plan.json");
  add_run_options(cli.plan_cmd, cli);
  cli.plan_cmd->add_option("--memory", cli.plan_memory, "device memory to fit, e.g. 80GiB (default: memory.limit)");
  cli.plan_cmd->add_option("--out", cli.plan_out, "where to write plan.json (default: runs/<recipe>-plan.json)");
  cli.plan_cmd
      ->add_option("--world-size", cli.plan_world,
                   "ranks to plan for (per-rank memory under parallel.sharding; "
                   "default: WORLD_SIZE or 1)")
      ->check(CLI::PositiveNumber);
  cli.plan_cmd
      ->add_option("--sequence-parallel", cli.plan_sequence,
                   "auto | N: plan at parallel.sequence N, or (auto) at every degree that divides the world size, "
                   "model.n_head and train.seq_len, choosing the smallest that fits --memory")
      ->transform(CLI::Transformer(std::map<std::string, std::string>{{"auto", "0"}}))
      ->check(CLI::Validator(
          [](const std::string& v) {
            return v.empty() || v.find_first_not_of("0123456789") != std::string::npos
                       ? std::string("must be auto or a degree (a positive integer), e.g. --sequence-parallel 8")
                       : std::string();
          },
          "auto|N"));
}

// trainer export: a run's newest weights as a Hugging Face checkpoint.
void add_export_command(CLI::App& app, Cli& cli) {
  cli.export_cmd = app.add_subcommand("export", "write a run's newest weights as a Hugging Face checkpoint "
                                                "(model.safetensors + config.json)");
  auto& req = cli.export_req;
  cli.export_cmd->add_option("--run", req.run, "the run directory (its config.json, state/ and model/)")->required();
  cli.export_cmd->add_option("--out", req.out, "a directory, or a .safetensors file with config.json beside it "
                                               "(default: <run>/hf-step-NNNNNNNN/)");
  cli.export_cmd->add_option("--dtype", cli.export_dtype, "fp32 (default) or bf16 (for inference tools)");
  cli.export_cmd->add_flag("--merged", req.merged,
                           "a model.lora run: the base with the adapters folded in, as plain Hugging Face weights "
                           "(default for such a run: its PEFT adapter directory, adapter_config.json + "
                           "adapter_model.safetensors)");
}

void add_commands(CLI::App& app, Cli& cli) {
  app.require_subcommand(0, 1);
  app.add_flag("--help-config", cli.help_config, "print every recipe key with its type, default and meaning");
  app.set_version_flag("--version", [] { return sl::device::version_text(sl::device::build_info()); },
                       "print the version, the commit, the LibTorch version, the CUDA and CPU code compiled in and "
                       "what this machine has of them, then exit");
  add_run_options(&app, cli);
  add_resume(&app, cli);
  auto* train_cmd = app.add_subcommand("train", "train (the default when no subcommand is given)");
  add_run_options(train_cmd, cli);
  add_resume(train_cmd, cli);
  add_plan_command(app, cli);
  add_export_command(app, cli);
  add_sample_command(app, cli);
}

int run_export(const Cli& cli) {
  auto req = cli.export_req;
  req.dtype = parse_flag<sl::config::Dtype>(cli.export_dtype, "export --dtype", "fp32 or bf16");
  sl::memory::TrackingCPUAllocator::install();  // to report the export's peak tensor memory
  const auto r = sl::interop::export_run(req);
  fmt::print("exported step {} from {} -> {} ({}; peak tensor memory {}, peak_tensor_bytes={})\n", r.step, r.source,
             r.file.string(), sl::log::format_bytes(r.bytes), sl::log::format_bytes(r.peak_tensor_bytes),
             r.peak_tensor_bytes);
  return sl::kExitOk;
}

// plan --sequence-parallel auto: every degree's peak and step time; the plan below is at the smallest
// degree that fits (the recipe's when none does), with the exchange the search chose there.
nlohmann::json choose_sequence_degree(sl::config::RunConfig& cfg, int64_t memory) {
  const auto sc = sl::memory::Scenario::of(cfg);
  auto search = sl::planner::sequence_search(sc, memory);
  fmt::print("{}\n", sl::planner::format_sequence_search(search, memory));
  if (!search["chosen"].is_null()) cfg.parallel.sequence = search["chosen"].get<int64_t>();
  if (search.value("chosen_exchange", "") == "keep") cfg.checkpointing.exchange = sl::config::Exchange::kKeep;
  return search;
}

int run_plan(sl::config::RunConfig cfg, const Cli& cli) {
  const int64_t memory = cli.plan_memory.empty() ? cfg.memory.limit.bytes
                                                 : sl::config::parse_bytes(cli.plan_memory, "--memory");
  const auto search = cli.plan_sequence == 0 ? choose_sequence_degree(cfg, memory) : nlohmann::json(nullptr);
  auto report = sl::planner::plan(cfg, memory);
  if (!search.is_null()) report["sequence_search"] = search;
  fmt::print("{}", sl::planner::format_plan(report));
  const std::filesystem::path out =
      cli.plan_out.empty() ? sl::log::default_plan_path(cfg.recipe_name) : std::filesystem::path(cli.plan_out);
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  sl::log::write_json_file(out, report);
  fmt::print("wrote {}\n", out.string());
  return sl::kExitOk;
}

// The parsed command: export, sample, plan or train.
int dispatch(const Cli& cli) {
  if (cli.export_cmd->parsed()) return run_export(cli);
  if (cli.sample_cmd->parsed()) return run_sample(cli);
  if (cli.config_path.empty())
    throw sl::ConfigError(
        "--config: no recipe given; try `trainer --config configs/tiny.yaml` (keys: trainer --help-config)");
  auto overrides = cli.overrides;
  if (cli.no_profile) overrides.push_back("checkpointing.profile_costs=false");
  // plan --memory: the memory to fit, also what a share budget (checkpointing.budget: 90%) is a share of;
  // read first, so a size it cannot take is reported as the flag's
  if (cli.plan_cmd->parsed() && !cli.plan_memory.empty()) {
    sl::config::parse_bytes(cli.plan_memory, "--memory");
    overrides.push_back("memory.limit=" + cli.plan_memory);
  }
  // plan --world-size: the recipe is checked for that world size (train.global_batch, DDP offload) as a
  // rank launched at it would check it.
  if (cli.plan_cmd->parsed() && cli.plan_world > 0) ::setenv("WORLD_SIZE", std::to_string(cli.plan_world).c_str(), 1);
  // plan --sequence-parallel N: the recipe checked at that degree (exit 2 naming what it does not divide);
  // auto: loaded at degree 1, every degree tried in run_plan.
  if (cli.plan_cmd->parsed() && cli.plan_sequence >= 0)
    overrides.push_back("parallel.sequence=" + std::to_string(std::max<int64_t>(1, cli.plan_sequence)));
  auto cfg = sl::config::load(cli.config_path, overrides);
  if (cli.plan_cmd->parsed()) return run_plan(cfg, cli);
  cfg.resume = cli.resume;
  // Install before any tensor exists so every CPU tensor is counted.
  if (cfg.memory.track_cpu) sl::memory::TrackingCPUAllocator::install();
  return sl::train::run(cfg);
}

}  // namespace

int sl::run_cli(int argc, char** argv) {
  CLI::App app{"sublinear trainer: trains a GPT-style model from a YAML recipe (see README)"};
  Cli cli;
  add_commands(app, cli);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version: printed, exit 0
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
