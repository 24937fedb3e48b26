// model.lora's targets (see lora.h).
#include "config/lora.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "errors.h"

namespace sl::config {

std::vector<LoraTarget> lora_target_table(Arch arch, int64_t C, int64_t H) {
  if (arch == Arch::kGpt2)
    return {{"c_attn", 0, 0, 3 * C}, {"attn.c_proj", 1, 0, C}, {"c_fc", 2, 0, H}, {"mlp.c_proj", 3, 0, C}};
  return {{"q_proj", 0, 0, C},    {"k_proj", 0, C, C},  {"v_proj", 0, 2 * C, C},   {"o_proj", 1, 0, C},
          {"gate_proj", 2, 0, H}, {"up_proj", 2, H, H}, {"down_proj", 3, 0, C}};
}

namespace {

// Whether `wanted` (a recipe name) selects table entry `name`: equal, "all-linear", or gpt2's bare
// "c_proj", which PEFT matches against both attn.c_proj and mlp.c_proj (a suffix after a dot).
bool selects(const std::string& wanted, const std::string& name) {
  if (wanted == name || wanted == "all-linear") return true;
  return name.size() > wanted.size() && name.compare(name.size() - wanted.size(), wanted.size(), wanted) == 0 &&
         name[name.size() - wanted.size() - 1] == '.';
}

std::vector<std::string> wanted_names(Arch arch, const LoraConfig& lora) {
  if (!lora.targets.empty()) return lora.targets;
  if (arch == Arch::kGpt2) return {"c_attn"};
  return {"q_proj", "v_proj"};
}

}  // namespace

int64_t lora_params_of_width(Arch arch, int64_t C, int64_t H, const LoraConfig& lora) {
  if (!lora.enabled()) return 0;
  int64_t n = 0;
  for (const auto& t : lora_targets_of_width(arch, C, H, lora)) n += lora.rank * ((t.projection == 3 ? H : C) + t.rows);
  return n;
}

std::vector<LoraTarget> lora_targets_of_width(Arch arch, int64_t C, int64_t H, const LoraConfig& lora) {
  const auto table = lora_target_table(arch, C, H);
  const auto wanted = wanted_names(arch, lora);
  for (const auto& w : wanted)
    if (std::none_of(table.begin(), table.end(), [&](const LoraTarget& t) { return selects(w, t.name); })) {
      std::vector<std::string> names;
      for (const auto& t : table) names.push_back(t.name);
      throw ConfigError(fmt::format("model.lora: target '{}' is not a projection of a {} block (targets: {}, "
                                    "all-linear)", w, arch.name(), fmt::join(names, ", ")));
    }
  std::vector<LoraTarget> out;
  for (const auto& t : table)
    if (std::any_of(wanted.begin(), wanted.end(), [&](const std::string& w) { return selects(w, t.name); }))
      out.push_back(t);
  return out;
}

std::string lora_param_name(const LoraTarget& t, char matrix) {
  std::string name = t.name;
  std::replace(name.begin(), name.end(), '.', '_');
  return fmt::format("lora_{}_{}", matrix, name);
}


}  // namespace sl::config
