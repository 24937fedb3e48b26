// PEFT adapter directories and merged weights (see peft.h).
#include "interop/peft.h"

#include <algorithm>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "errors.h"
#include "config/shape.h"
#include "state/safetensors.h"

namespace sl::interop {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The transformers module path of a target in block `layer`.
std::string module_path(const config::ModelConfig& m, int64_t layer, const config::LoraTarget& t) {
  if (m.arch == config::Arch::kGpt2) {
    const std::string where = t.name == "c_attn" ? "attn.c_attn" : t.name == "c_fc" ? "mlp.c_fc" : t.name;
    return fmt::format("transformer.h.{}.{}", layer, where);
  }
  const bool attention = t.projection <= 1;
  return fmt::format("model.layers.{}.{}.{}", layer, attention ? "self_attn" : "mlp", t.name);
}

// Block and projection of "blocks.<l>.w_qkv" (w_qkv 0, w_proj 1, w_fc 2, w_out 3); {-1, -1} for others.
std::pair<int64_t, int> projection_of(const std::string& param) {
  static const std::vector<std::string> kNames = {"w_qkv", "w_proj", "w_fc", "w_out"};
  if (param.rfind("blocks.", 0) != 0) return {-1, -1};
  const auto dot = param.find('.', 7);
  const auto leaf = param.substr(dot + 1);
  for (size_t p = 0; p < kNames.size(); ++p)
    if (leaf == kNames[p]) return {std::stoll(param.substr(7, dot - 7)), static_cast<int>(p)};
  return {-1, -1};
}

// The input width K of a projection (w_out's is the block's MLP width).
int64_t in_features(const config::ModelConfig& m, int64_t layer, int projection) {
  return projection == 3 ? config::Shape(m).hidden(layer) : m.n_embd;
}

}  // namespace

std::string peft_name(const config::ModelConfig& m, int64_t layer, const config::LoraTarget& t, char matrix) {
  return fmt::format("base_model.model.{}.lora_{}.weight", module_path(m, layer, t), matrix);
}

std::string lora_param(int64_t layer, const config::LoraTarget& t, char matrix) {
  return fmt::format("blocks.{}.{}", layer, config::lora_param_name(t, matrix));
}

Json peft_config(const config::ModelConfig& m, const std::string& base) {
  const auto& l = m.lora;
  return Json{{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"base_model_name_or_path", base.empty() ? Json(nullptr) : Json(base)},
              {"r", l.rank},
              {"lora_alpha", l.alpha},
              {"lora_dropout", l.dropout},
              {"target_modules", config::lora_target_names(m)},
              {"bias", "none"},
              {"fan_in_fan_out", m.arch == config::Arch::kGpt2},
              {"use_rslora", false},
              {"use_dora", false},
              {"inference_mode", true},
              {"modules_to_save", nullptr},
              {"init_lora_weights", true}};
}

void write_peft(const fs::path& dir, const config::ModelConfig& m, const ParamValues& values, const std::string& base) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}; choose a writable directory", dir.string(), ec.message()));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int64_t l = 0; l < m.n_layer; ++l)
    for (const auto& t : config::lora_targets(m, l)) {
      const int64_t r = m.lora.rank, K = in_features(m, l, t.projection);
      const auto host = [&](char matrix, int64_t n) {
        return values(lora_param(l, t, matrix), 0, n).to(torch::kCPU, torch::kFloat);
      };
      tensors.emplace_back(peft_name(m, l, t, 'A'), host('A', r * K).view({r, K}));
      tensors.emplace_back(peft_name(m, l, t, 'B'), host('B', t.rows * r).view({t.rows, r}));
    }
  state::write_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  state::write_file_atomic(dir / "adapter_config.json", peft_config(m, base).dump(2) + "\n");
  state::fsync_dir(dir);
}

// ---- reading ----

bool PeftAdapter::is_adapter_dir(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(path / "adapter_config.json", ec);
}

namespace {

Json read_adapter_config(const fs::path& file) {
  std::ifstream in(file);
  const Json c = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (c.is_discarded() || !c.is_object())
    throw DataError(fmt::format("model.init_from: {} is not a JSON object; re-save the adapter", file.string()));
  return c;
}

// What adapter_config.json says differently from the recipe's model.lora, each with the key to set.
std::vector<std::string> config_differences(const Json& c, const config::ModelConfig& m) {
  std::vector<std::string> d;
  const auto& l = m.lora;
  const auto shown = [&](const char* key) { return c.value(key, Json()).dump(); };
  if (c.value("peft_type", "") != "LORA") d.push_back(fmt::format("peft_type is {} (only LORA)", shown("peft_type")));
  if (c.value("r", int64_t{-1}) != l.rank) d.push_back(fmt::format("r is {}, model.lora rank {}", shown("r"), l.rank));
  if (c.value("lora_alpha", -1.0) != l.alpha)
    d.push_back(fmt::format("lora_alpha is {}, model.lora alpha {}", shown("lora_alpha"), l.alpha));
  std::set<std::string> theirs, ours;
  if (c.contains("target_modules") && c["target_modules"].is_array())
    for (const auto& t : c["target_modules"]) theirs.insert(t.get<std::string>());
  for (const auto& t : config::lora_target_names(m)) ours.insert(t);
  if (theirs != ours)
    d.push_back(fmt::format("target_modules are [{}], model.lora targets resolve to [{}]", fmt::join(theirs, ", "),
                            fmt::join(ours, ", ")));
  static const Json kNoBias = "none";  // PEFT's bias: none | all | lora_only
  if (c.value("bias", kNoBias) != kNoBias)
    d.push_back("bias is not \"none\" (trained biases are not supported)");
  if (c.value("use_dora", false)) d.push_back("use_dora is true (DoRA is not supported)");
  if (c.value("use_rslora", false)) d.push_back("use_rslora is true (rsLoRA's alpha / sqrt(r) is not supported)");
  if (c.contains("modules_to_save") && !c["modules_to_save"].is_null() && !c["modules_to_save"].empty())
    d.push_back("modules_to_save is set (fully trained modules are not supported)");
  return d;
}

}  // namespace

PeftAdapter::PeftAdapter(const fs::path& dir, const config::ModelConfig& m) : dir_(dir) {
  const auto config_file = dir / "adapter_config.json";
  Json c;
  try {
    c = read_adapter_config(config_file);
    const auto diffs = config_differences(c, m);
    if (!diffs.empty())
      throw DataError(fmt::format("model.init_from: the adapter {} differs from the recipe: {}. Make model.lora "
                                  "match it", config_file.string(), fmt::join(diffs, "; ")));
  } catch (const Json::exception& e) {
    throw DataError(fmt::format("model.init_from: {}: a key has the wrong type ({})", config_file.string(), e.what()));
  }
  const auto base = c.value("base_model_name_or_path", Json());
  base_name_ = base.is_string() ? base.get<std::string>() : "";
  file_ = std::make_unique<state::SafetensorsFile>(dir / "adapter_model.safetensors");
  for (int64_t l = 0; l < m.n_layer; ++l)
    for (const auto& t : config::lora_targets(m, l))
      for (const char matrix : {'A', 'B'}) {
        const auto name = peft_name(m, l, t, matrix);
        const auto* e = file_->find(name);
        const std::vector<int64_t> want =
            matrix == 'A' ? std::vector<int64_t>{m.lora.rank, in_features(m, l, t.projection)}
                          : std::vector<int64_t>{t.rows, m.lora.rank};
        if (!e || e->shape != want)
          throw DataError(fmt::format("model.init_from: {} {} {} (expected shape [{}]); is it an adapter of this "
                                      "model?",
                                      file_->path().string(), e ? "has" : "lacks", name, fmt::join(want, ", ")));
        names_[lora_param(l, t, matrix)] = name;
      }
}

PeftAdapter::~PeftAdapter() = default;

fs::path PeftAdapter::base() const {
  std::error_code ec;
  const bool relative = !base_name_.empty() && fs::is_directory(dir_ / base_name_, ec);
  const fs::path base = relative ? dir_ / base_name_ : fs::path(base_name_);
  if (base_name_.empty() || !fs::is_directory(base, ec))
    throw DataError(fmt::format("model.init_from: the adapter {} names its base as {}, which is no directory here; set "
                                "base_model_name_or_path in adapter_config.json to the base checkpoint's directory",
                                (dir_ / "adapter_config.json").string(),
                                base_name_.empty() ? "nothing" : "'" + base_name_ + "'"));
  return base;
}

void PeftAdapter::read(const std::string& param, int64_t begin, int64_t end, at::Tensor dst) const {
  dst.copy_(file_->view(names_.at(param)).reshape({-1}).narrow(0, begin, end - begin).to(torch::kFloat));
}

// ---- merged weights ----

std::string base_checkpoint(const config::ModelConfig& m) {
  if (m.init_from.empty() || !PeftAdapter::is_adapter_dir(m.init_from)) return m.init_from;
  return PeftAdapter(m.init_from, m).base().string();
}

config::ModelConfig without_lora(config::ModelConfig m) {
  m.lora = {};
  return m;
}

WeightsSource merged_source(const config::ModelConfig& m, ParamValues base, ParamValues adapters) {
  WeightsSource s;
  s.values = [m, base, adapters](const HfTensor& t) {
    auto v = base(t.param, t.begin(), t.end()).to(torch::kCPU, torch::kFloat).clone();
    const auto [layer, projection] = projection_of(t.param);
    if (!m.lora.enabled() || layer < 0) return v;
    const int64_t K = t.row_length(), r = m.lora.rank;
    auto rows = v.view({t.row_end - t.row_begin, K});
    for (const auto& target : config::lora_targets(m, layer)) {
      const int64_t lo = std::max(t.row_begin, target.row0), hi = std::min(t.row_end, target.row0 + target.rows);
      if (target.projection != projection || lo >= hi) continue;
      const auto host = [&](char matrix, int64_t n) {
        return adapters(lora_param(layer, target, matrix), 0, n).to(torch::kCPU, torch::kFloat);
      };
      const auto A = host('A', r * K).view({r, K}), B = host('B', target.rows * r).view({target.rows, r});
      rows.narrow(0, lo - t.row_begin, hi - lo).add_(B.narrow(0, lo - target.row0, hi - lo).mm(A) * (m.lora.alpha / r));
    }
    return v;
  };
  return s;
}

}  // namespace sl::interop
