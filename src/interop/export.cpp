// trainer export: choose the newest weights of a run, stream them out in Hugging Face layout.
#include "interop/export.h"

#include <charconv>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "config/config.h"
#include "errors.h"
#include "interop/hf.h"
#include "memory/tracking_allocator.h"
#include "state/state.h"

namespace sl::interop {
namespace {

namespace fs = std::filesystem;

// The run's recipe (its config.json) for the model's shape and state.dir. train.global_batch is
// re-derived: it was checked against the run's world size, not this process's.
config::RunConfig run_recipe(const fs::path& run) {
  std::error_code ec;
  if (!fs::exists(run / "config.json", ec))
    throw ConfigError(fmt::format("export --run {}: not a run directory (no config.json); give the directory a "
                                  "training run wrote (logging.dir, or runs/<recipe>-<time>)", run.string()));
  return config::load((run / "config.json").string(), {"train.global_batch=0"});
}

// The step the run's final weights were written at; -1 when there are none, or they are unreadable (warned:
// a valid saved state can still be exported).
int64_t final_step(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return -1;
  try {
    const state::SafetensorsFile f(file);
    const auto it = f.metadata().find("sublinear_step");
    if (it == f.metadata().end()) return -1;  // not written by a trainer (or by an older one): the saved states decide
    const char* end = it->second.data() + it->second.size();
    int64_t step = -1;
    const auto [ptr, err] = std::from_chars(it->second.data(), end, step);
    return err == std::errc() && ptr == end && step >= 0 ? step : -1;
  } catch (const Error& e) {
    spdlog::warn("export: ignoring the final weights: {}", e.what());
    return -1;
  }
}

// The run's newest usable saved state; when none is usable but the final weights are, those are exported
// (with a warning) instead of refusing.
state::Found newest_state(const fs::path& root, int64_t final) {
  try {
    return state::find_local("auto", root);
  } catch (const state::StateFileError& e) {
    if (final < 0) throw;
    spdlog::warn("export: no saved state is usable ({}); exporting the final weights", e.what());
    return {};
  }
}

// Reads the final weights (a file this project wrote in Hugging Face layout) back through HfCheckpoint.
WeightsSource final_weights_source(std::shared_ptr<HfCheckpoint> ckpt) {
  WeightsSource src;
  src.values = [ckpt](const HfTensor& t) {
    auto v = torch::empty({t.end() - t.begin()});
    ckpt->read(t.param, t.begin(), t.end(), v);
    return v;
  };
  return src;
}

// Reads a saved training state's parameters, whichever ranks' files hold them.
WeightsSource state_source(std::shared_ptr<state::Reader> reader) {
  WeightsSource src;
  src.values = [reader](const HfTensor& t) {
    auto v = torch::empty({t.end() - t.begin()});
    reader->read("param", {t.param, t.begin(), t.end(), v}, v);
    return v;
  };
  return src;
}

fs::path output_file(const ExportRequest& req, int64_t step) {
  if (req.out.empty()) return req.run / fmt::format("hf-step-{:08d}", step) / "model.safetensors";
  if (req.out.extension() == ".safetensors") return req.out;
  return req.out / "model.safetensors";
}

}  // namespace

ExportReport export_run(const ExportRequest& req) {
  if (req.dtype != "fp32" && req.dtype != "bf16")
    throw ConfigError(fmt::format("export --dtype {}: expected fp32 or bf16", req.dtype));
  const config::RunConfig cfg = run_recipe(req.run);
  const fs::path final_file = req.run / "model" / "model.safetensors";
  const int64_t final = final_step(final_file);
  const state::Found found = newest_state(state::state_root(cfg, req.run), final);
  if (!found.found() && final < 0)
    throw ConfigError(fmt::format("export --run {}: the run has neither a saved training state ({}) nor final weights "
                                  "({}); train with state.at_end: true or logging.save_model: true",
                                  req.run.string(), state::state_root(cfg, req.run).string(), final_file.string()));
  ExportReport report;
  WeightsSource source;
  if (final >= found.step) {  // the final weights are at least as new: no re-assembly needed
    source = final_weights_source(std::make_shared<HfCheckpoint>(final_file, cfg.model));
    report.source = final_file.string();
    report.step = final;
  } else {
    source = state_source(std::make_shared<state::Reader>(found.dir, found.meta));
    report.source = found.dir.string();
    report.step = found.step;
  }
  report.file = output_file(req, report.step);
  auto& tracker = memory::TrackingCPUAllocator::instance();
  tracker.reset_peak();
  const int64_t before = tracker.current_bytes();
  const auto written = write_hf(report.file, cfg.model, req.dtype == "bf16" ? at::kBFloat16 : at::kFloat, source, true,
                                {{"format", "pt"}, {"sublinear_step", std::to_string(report.step)},
                                 {"sublinear_source", report.source}});
  report.bytes = written.digest.bytes;
  report.peak_tensor_bytes = tracker.peak_bytes() - before;
  return report;
}

}  // namespace sl::interop
