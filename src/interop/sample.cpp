// trainer sample: the model and its tokenizer from a run or a Hugging Face folder, then generate.
#include "interop/sample.h"

#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "device/device.h"
#include "errors.h"
#include "interop/export.h"
#include "interop/hf.h"
#include "model/generate.h"
#include "text/tokenizer.h"

namespace sl::interop {
namespace {

namespace fs = std::filesystem;

// The model: its config and weights from the run (newest weights) or the folder (config.json).
struct Loaded {
  config::ModelConfig model;
  WeightsSource source;
  std::string description;
  fs::path tokenizer;  // the run's or folder's tokenizer.json ("" = none)
};

Loaded load_folder(const fs::path& folder) {
  std::error_code ec;
  const fs::path config = folder / "config.json";
  std::ifstream in(config);
  if (!in)
    throw ConfigError(fmt::format("sample --weights {}: no config.json there; give a folder that `trainer export`, "
                                  "logging.save_model or save_pretrained() wrote", folder.string()));
  nlohmann::json hf;
  try {
    hf = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: not valid JSON ({})", config.string(), e.what()));
  }
  Loaded l;
  l.model = model_config_from_hf(hf, config.string());
  auto ckpt = std::make_shared<HfCheckpoint>(folder, l.model);
  l.description = ckpt->describe();
  l.source = HfCheckpoint::source(ckpt);
  if (fs::exists(folder / "tokenizer.json", ec)) l.tokenizer = folder / "tokenizer.json";
  return l;
}

Loaded load_run(const fs::path& run) {
  auto w = run_weights(run, "sample");
  // A model.lora run's weights come with the adapters folded in (RunWeights): the model without them.
  Loaded l{without_lora(w.cfg.model), std::move(w.source), fmt::format("{} (step {})", w.description, w.step),
           run_tokenizer(run)};
  l.model.dropout = 0.0;
  return l;
}

void check_request(const SampleRequest& r) {
  if (r.run.empty() == r.weights.empty())
    throw ConfigError("sample: give exactly one of --run DIR and --weights FOLDER");
  if (r.max_new_tokens < 1)
    throw ConfigError(fmt::format("sample --max-new-tokens: must be >= 1, got {}", r.max_new_tokens));
  if (!config::valid_utf8(r.prompt))
    throw ConfigError("sample --prompt: not valid UTF-8; give the prompt as UTF-8 text");
  if (r.device == config::DeviceChoice::kLazy)
    throw ConfigError(fmt::format("sample --device {}: expected auto, cpu or cuda", r.device.name()));
}

}  // namespace

SampleReport sample(const SampleRequest& req) {
  check_request(req);
  const Loaded l = req.run.empty() ? load_folder(req.weights) : load_run(req.run);
  const auto codec = text::TextCodec::open(req.tokenizer.empty() ? l.tokenizer : req.tokenizer, l.model.vocab_size);
  SampleReport r;
  r.weights = l.description;
  r.tokenizer = codec.name();
  r.prompt_text = req.prompt;
  r.prompt_ids = codec.prompt(req.prompt);
  config::TrainConfig where;
  where.device = req.device;
  const torch::Device device = device::resolve_device(where);
  model::GPT gpt(l.model, device, /*defer_params=*/true);  // no random init: every weight is read next
  for (auto& p : gpt->parameters()) p.set_data(torch::empty(p.sizes(), p.options()));
  read_weights(*gpt, l.source);

  model::GenerateOptions o;
  o.max_new_tokens = req.max_new_tokens;
  o.temperature = req.temperature;
  o.top_k = req.top_k;
  o.seed = req.seed;
  o.use_cache = req.use_cache;
  if (req.stop_at_eot) o.stop_id = codec.end_of_text();
  const auto g = model::generate(*gpt, r.prompt_ids, o);
  r.ids = g.ids;
  r.text = codec.decode(g.ids);
  r.prompt_seconds = g.prompt_seconds;
  r.seconds = g.seconds;
  return r;
}

}  // namespace sl::interop
