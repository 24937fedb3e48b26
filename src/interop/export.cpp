// trainer export: choose the newest weights of a run, stream them out in Hugging Face layout.
#include "interop/export.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "config/config.h"
#include "errors.h"
#include "interop/hf.h"
#include "memory/tracking_allocator.h"
#include "model/gpt.h"
#include "precision/autocast.h"
#include "state/state.h"
#include "text/tokenizer.h"

namespace sl::interop {
namespace {

namespace fs = std::filesystem;

// The run's recipe (its config.json) for the model's shape and state.dir. train.global_batch is
// re-derived and parallel.sequence taken as 1: both were checked against the run's world size, not
// this process's (one process reads the whole model).
config::RunConfig run_recipe(const fs::path& run, const std::string& who) {
  std::error_code ec;
  if (!fs::exists(run / "config.json", ec))
    throw ConfigError(fmt::format("{} --run {}: not a run directory (no config.json); give the directory a "
                                  "training run wrote (logging.dir, or runs/<recipe>-<time>)", who, run.string()));
  return config::load((run / "config.json").string(), {"train.global_batch=0", "parallel.sequence=1"});
}

// The step the run's final weights were written at; -1 when there are none, or they are unreadable (warned:
// a valid saved state can still be exported).
int64_t final_step(const fs::path& file) {
  try {
    return state::final_weights_step(file);  // -1 without a recorded step: the saved states decide
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

// Reads a saved training state's parameters, whichever ranks' files hold them.
ParamValues state_values(std::shared_ptr<state::Reader> reader) {
  return [reader](const std::string& param, int64_t begin, int64_t end) {
    auto v = torch::empty({end - begin});
    reader->read("param", {param, begin, end, v}, v);
    return v;
  };
}

WeightsSource plain_source(ParamValues values) {
  WeightsSource src;
  src.values = [values](const HfTensor& t) { return values(t.param, t.begin(), t.end()); };
  return src;
}

// A model.lora run's frozen weights: its base checkpoint's, or (none) drawn again from train.seed as the
// run drew them (model::init_parameter: the same numbers on every device).
ParamValues base_values(const config::ModelConfig& m, int64_t seed) {
  const auto base = base_checkpoint(m);
  if (!base.empty()) {
    auto ckpt = std::make_shared<HfCheckpoint>(base, without_lora(m));
    return [ckpt](const std::string& param, int64_t begin, int64_t end) {
      auto v = torch::empty({end - begin});
      ckpt->read(param, begin, end, v);
      return v;
    };
  }
  torch::manual_seed(static_cast<uint64_t>(seed));
  auto model = std::make_shared<model::GPT>(m, torch::kCPU);
  return [model](const std::string& param, int64_t begin, int64_t end) {
    return (*model)->named_parameters()[param].detach().view({-1}).narrow(0, begin, end - begin);
  };
}

// The final adapters a model.lora run wrote beside its final weights (<run>/adapter).
ParamValues final_adapters(const fs::path& run, const config::ModelConfig& m) {
  auto adapter = std::make_shared<PeftAdapter>(run / "adapter", m);
  return [adapter](const std::string& param, int64_t begin, int64_t end) {
    auto v = torch::empty({end - begin});
    adapter->read(param, begin, end, v);
    return v;
  };
}

fs::path output_file(const ExportRequest& req, int64_t step) {
  if (req.out.empty()) return req.run / fmt::format("hf-step-{:08d}", step) / "model.safetensors";
  if (req.out.extension() == ".safetensors") return req.out;
  return req.out / "model.safetensors";
}

}  // namespace

RunWeights run_weights(const fs::path& run, const std::string& who) {
  RunWeights w{run_recipe(run, who), {}, {}, "", 0};
  const fs::path final_file = run / "model" / "model.safetensors";
  const int64_t final = final_step(final_file);
  const fs::path root = state::state_root(w.cfg.state, run);
  const state::Found found = newest_state(root, final);
  if (!found.found() && final < 0)
    throw ConfigError(fmt::format("{} --run {}: the run has neither a saved training state ({}) nor final weights "
                                  "({}); train with state.at_end: true or logging.save_model: true",
                                  who, run.string(), root.string(), final_file.string()));
  const auto& m = w.cfg.model;
  if (final >= found.step) {  // the final weights are at least as new: no re-assembly needed (merged already)
    w.source = HfCheckpoint::source(std::make_shared<HfCheckpoint>(final_file, without_lora(m)));
    if (m.lora.enabled()) w.adapters = final_adapters(run, m);
    w.description = final_file.string();
    w.step = final;
  } else {
    const auto saved = state_values(std::make_shared<state::Reader>(found.dir, found.meta));
    w.source = m.lora.enabled() ? merged_source(m, base_values(m, w.cfg.train.seed), saved) : plain_source(saved);
    if (m.lora.enabled()) w.adapters = saved;
    w.description = found.dir.string();
    w.step = found.step;
  }
  return w;
}

fs::path run_tokenizer(const fs::path& run) {
  std::error_code ec;
  return fs::exists(run / "tokenizer.json", ec) ? run / "tokenizer.json" : fs::path();
}

ExportReport export_run(const ExportRequest& req) {
  if (req.dtype != config::Dtype::kFp32 && req.dtype != config::Dtype::kBf16)
    throw ConfigError(fmt::format("export --dtype {}: expected fp32 or bf16", req.dtype.name()));
  const RunWeights w = run_weights(req.run, "export");
  const fs::path tokenizer = run_tokenizer(req.run);
  const auto eos = tokenizer.empty() ? std::nullopt : text::inspect_tokenizer_file(tokenizer).end_of_text_id;
  ExportReport report;
  report.source = w.description;
  report.step = w.step;
  report.file = output_file(req, report.step);
  auto& tracker = memory::TrackingCPUAllocator::instance();
  tracker.reset_peak();
  const int64_t before = tracker.current_bytes();
  if (req.merged && !w.cfg.model.lora.enabled())
    throw ConfigError(fmt::format("export --merged: the run {} trained no adapters (model.lora rank 0); its export is "
                                  "plain Hugging Face weights already, drop --merged", req.run.string()));
  if (w.cfg.model.lora.enabled() && !req.merged) {  // PEFT's adapter directory
    const auto dir = report.file.parent_path();
    write_peft(dir, w.cfg.model, w.adapters, base_checkpoint(w.cfg.model));
    report.file = dir / "adapter_model.safetensors";
    report.bytes = static_cast<int64_t>(fs::file_size(report.file));
    report.peak_tensor_bytes = tracker.peak_bytes() - before;
    return report;
  }
  const auto written = write_hf(report.file, without_lora(w.cfg.model), precision::scalar_type(req.dtype), w.source,
                                true, {{"format", "pt"}, {"sublinear_step", std::to_string(report.step)},
                                       {"sublinear_source", report.source}}, eos);
  if (!tokenizer.empty()) text::write_hf_tokenizer(report.file.parent_path(), tokenizer, w.cfg.model.max_seq_len);
  report.bytes = written.digest.bytes;
  report.peak_tensor_bytes = tracker.peak_bytes() - before;
  return report;
}

}  // namespace sl::interop
