// Reading a recipe: the YAML document's shape (known sections and keys, none twice, one document),
// --set overrides, presets, the values written as text (sizes, checkpointing.budget,
// precision.loss_scale), and load() / load_string(), which apply them in order of precedence and validate.
#include "config/config.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "config/keys.h"
#include "errors.h"

namespace sl::config {
namespace {

struct Override {
  std::string section, key;
  YAML::Node value;
};

Override parse_override(const std::string& text) {
  auto eq = text.find('=');
  auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq)
    throw ConfigError(fmt::format("--set '{}': expected section.key=value, e.g. --set train.steps=50", text));
  Override o{text.substr(0, dot), text.substr(dot + 1, eq - dot - 1), {}};
  if (!is_section(o.section))
    throw ConfigError(fmt::format("--set {}.{}: unknown section '{}' (sections: {})", o.section, o.key,
                                  o.section, section_names()));
  if (!find_field(o.section, o.key))
    throw ConfigError(fmt::format("--set {}.{}: unknown key '{}' in section {} (keys: {})", o.section,
                                  o.key, o.key, o.section, keys_of(o.section)));
  std::string value = text.substr(eq + 1);
  try {
    o.value.reset(value.empty() ? YAML::Node(std::string()) : YAML::Load(value));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("--set {}.{}: cannot parse value '{}': {}", o.section, o.key, value, e.msg));
  }
  if (o.value.IsNull()) o.value.reset(YAML::Node(std::string()));
  // A value from --set stands on no line of a file: a fresh scalar node carries no parser mark, so a
  // message about it names the key alone.
  else if (o.value.IsScalar()) o.value.reset(YAML::Node(o.value.Scalar()));
  return o;
}

// A mapping key as text. Keys are plain names; a list or map as a key is refused here (yaml-cpp's
// as<std::string>() would throw a raw BadConversion).
std::string key_text(const YAML::Node& key, const std::string& origin) {
  if (!key.IsScalar())
    throw ConfigError(fmt::format("{}: a key{} is not a plain name (a list, map or null used as a key)", origin,
                                  where(key)));
  return key.Scalar();
}

// "lines 2 and 3", or "line 1, columns 9 and 19" for a flow mapping written on one line.
std::string both_places(const YAML::Mark& a, const YAML::Mark& b) {
  if (a.line != b.line) return fmt::format("lines {} and {}", a.line + 1, b.line + 1);
  return fmt::format("line {}, columns {} and {}", a.line + 1, a.column + 1, b.column + 1);
}

// yaml-cpp (0.7 and 0.8) keeps every pair of a mapping, a repeated key included: iterating yields
// both pairs (each key node with its own Mark), while operator[] finds only the first. So a key given
// twice would be half-applied silently; refuse it, naming both places. `kind` is "section" or "key",
// `prefix` the section ("train.") for keys.
void check_unique_keys(const YAML::Node& map, const std::string& origin, const char* kind,
                       const std::string& prefix) {
  std::map<std::string, YAML::Mark> first;
  for (const auto& kv : map) {
    auto [it, fresh] = first.emplace(key_text(kv.first, origin), kv.first.Mark());
    if (!fresh)
      throw ConfigError(fmt::format("{}: {} '{}{}' is given twice ({}); keep one", origin, kind, prefix, it->first,
                                    both_places(it->second, kv.first.Mark())));
  }
}

// What a YAML node is, for messages about the document's shape.
std::string describe(const YAML::Node& node) {
  if (node.IsSequence()) return "a list";
  if (node.IsScalar()) return fmt::format("the single value '{}'", node.Scalar());
  return "empty";
}

// One top-level section: a known name whose body is a map of known, distinct keys (or empty).
void check_section(const YAML::Node& name, const YAML::Node& body, const std::string& origin) {
  std::string s = key_text(name, origin);
  if (!is_section(s))
    throw ConfigError(fmt::format("{}: unknown section '{}'{} (sections: {})", origin, s, where(name),
                                  section_names()));
  if (body.IsNull()) return;
  if (!body.IsMap())
    throw ConfigError(fmt::format("{}: section '{}'{} must be a map of key: value", origin, s, where(name)));
  for (const auto& kv : body) {
    std::string k = key_text(kv.first, origin);
    if (!find_field(s, k))
      throw ConfigError(fmt::format("{}: unknown key '{}.{}'{} (keys of {}: {})", origin, s, k,
                                    where(kv.first), s, keys_of(s)));
  }
  check_unique_keys(body, origin, "key", s + ".");
}

// Checks the YAML tree's shape (a map of known sections, known keys, none twice) before anything is
// applied.
void check_tree(const YAML::Node& root, const std::string& origin) {
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}: the recipe must be a map of sections ({}), not {}{}", origin,
                                  section_names(), describe(root), where(root)));
  for (const auto& sec : root) check_section(sec.first, sec.second, origin);
  check_unique_keys(root, origin, "section", "");
}

// Parses one YAML document (Null when there is nothing but comments). yaml-cpp's Load() would read
// the first of several `---` documents and drop the rest silently, so a second one is refused.
YAML::Node parse_document(const std::string& text, const std::string& origin) {
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: YAML syntax error at line {}: {}", origin, e.mark.line + 1, e.msg));
  }
  while (docs.size() > 1 && docs.back().IsNull()) docs.pop_back();  // a trailing `---` and nothing after
  if (docs.size() > 1)
    throw ConfigError(fmt::format("{}: {} YAML documents (separated by ---); a recipe is one document, the second "
                                  "would be ignored{}", origin, docs.size(), where(docs[1])));
  return docs.empty() ? YAML::Node() : docs.front();
}

}  // namespace

std::vector<std::string> preset_names() { return {"tiny", "gpt2-124m", "gpt2-350m", "1.3b", "7b"}; }

void apply_preset(ModelConfig& m, const std::string& name) {
  auto gpt2 = [&](int64_t L, int64_t h, int64_t d, int64_t ctx) {
    m.arch = Arch::kGpt2, m.n_layer = L, m.n_head = h, m.n_embd = d, m.vocab_size = 50257, m.max_seq_len = ctx;
    m.mlp_hidden = 0, m.bias = true, m.tie_embeddings = true;
  };
  if (name.empty()) return;
  if (name == "tiny") {
    m.arch = Arch::kGpt2, m.n_layer = 4, m.n_head = 4, m.n_embd = 128, m.vocab_size = 256, m.max_seq_len = 256;
    m.mlp_hidden = 0, m.bias = true, m.tie_embeddings = true;
  } else if (name == "gpt2-124m") {
    gpt2(12, 12, 768, 1024);
  } else if (name == "gpt2-350m") {
    gpt2(24, 16, 1024, 1024);
  } else if (name == "1.3b") {
    gpt2(24, 16, 2048, 2048);  // GPT-3 XL shape
  } else if (name == "7b") {
    m.arch = Arch::kLlama, m.n_layer = 32, m.n_head = 32, m.n_embd = 4096, m.vocab_size = 32000;
    m.max_seq_len = 4096, m.mlp_hidden = 11008, m.bias = false, m.tie_embeddings = false;
    m.norm_eps = 1e-6;
  } else {
    std::string names;
    for (auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError(fmt::format("model.preset: unknown preset '{}' (presets: {})", name, names));
  }
}

int64_t parse_bytes(const std::string& text, const std::string& key) {
  static const std::pair<const char*, double> units[] = {
      {"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"TB", 1e12},
      {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"kB", 1e3}, {"B", 1.0}};
  const auto not_a_size = [&] {
    return ConfigError(
        fmt::format("{}: '{}' is not a size; write e.g. 8GiB, 512MiB or 2GB (units B, KiB, MiB, GiB, TiB, "
                    "KB, MB, GB, TB)",
                    key, text));
  };
  // strtod: a number beyond a double's range reads as +-inf, one below its smallest as (nearly) 0.
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) throw not_a_size();
  std::string unit = text.substr(static_cast<size_t>(end - text.c_str()));
  unit.erase(0, unit.find_first_not_of(' '));
  double scale = unit.empty() ? 1.0 : 0.0;
  for (const auto& [name, factor] : units)
    if (unit == name) scale = factor;
  if (scale == 0.0 || std::isnan(value)) throw not_a_size();
  if (value < 0.0) throw ConfigError(fmt::format("{}: '{}' is negative; a size is 0 or more bytes", key, text));
  // 2^63 bytes (8 EiB) is the first that int64_t cannot hold; doubles hold it exactly, and every double
  // below it converts to int64_t without overflow.
  const double bytes = value * scale;
  if (!(bytes < 9223372036854775808.0))
    throw ConfigError(fmt::format("{}: '{}' is {:.3g} bytes, more than the largest size, 2^63 - 1 bytes (8 EiB); "
                                  "write a size below it", key, text, bytes));
  return static_cast<int64_t>(bytes);
}

CheckpointingChoice choice(const CheckpointingConfig& ck) {
  using Mode = CheckpointingMode;
  switch (ck.mode.kind()) {
    case Mode::kNone: return mode::None{};
    case Mode::kFull: return mode::Full{};
    case Mode::kInterval: return mode::Interval{ck.interval, ck.segments};
    case Mode::kSqrt: return mode::Sqrt{};
    case Mode::kSelective: {
      mode::Selective s;
      for (const auto& part : ck.recompute) {
        s.attention |= part == "attention";
        s.mlp |= part == "mlp";
        s.norm |= part == "norm";
      }
      return s;
    }
    case Mode::kBudget: return ck.budget;
  }
  throw std::logic_error("choice: a checkpointing mode without an alternative");
}

Budget parse_budget(const std::string& text) {
  if (text.empty()) return {0, 1.0, text};
  if (text.back() == '%') {
    double pct = 0;
    try {
      size_t used = 0;
      pct = std::stod(text.substr(0, text.size() - 1), &used);
      if (used != text.size() - 1) pct = -1;
    } catch (const std::exception&) {
      pct = -1;
    }
    if (!(pct > 0 && pct <= 100))
      throw ConfigError(fmt::format("checkpointing.budget: '{}' is not a share in (0%, 100%], e.g. 90%", text));
    return {0, pct / 100.0, text};
  }
  const int64_t bytes = parse_bytes(text, "checkpointing.budget");
  if (bytes <= 0)
    throw ConfigError("checkpointing.budget: must be a positive size such as 6GiB, or a share such as 90%");
  return {bytes, 0.0, text};
}

LossScale parse_loss_scale(const std::string& text) {
  if (text == "dynamic") return {0.0, text};
  double fixed = 0.0;
  try {
    fixed = std::stod(text);
  } catch (const std::exception&) {
    throw ConfigError(fmt::format("precision.loss_scale: '{}' is neither dynamic nor a number", text));
  }
  if (!(fixed > 0.0)) throw ConfigError("precision.loss_scale: a fixed scale must be > 0");
  return {fixed, text};
}

namespace {

// The whole text of a recipe file; a directory or an unreadable file is refused.
std::string read_recipe(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(
        fmt::format("--config {}: is a directory, not a recipe file (e.g. --config configs/tiny.yaml)", path));
  std::ifstream in(path);
  if (!in)
    throw ConfigError(
        fmt::format("--config {}: cannot open the recipe file (check the path; recipes live in configs/)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw ConfigError(fmt::format("--config {}: cannot read the recipe file", path));
  return ss.str();
}

// Applies a checked tree: preset, the tree's keys, then --set; validates the result.
RunConfig resolve(const YAML::Node& root, const std::vector<std::string>& overrides, const std::string& origin) {
  check_tree(root, origin);

  std::vector<Override> sets;
  for (const auto& o : overrides) sets.push_back(parse_override(o));

  RunConfig cfg;
  // Preset first (from --set if given, else from the file), then the file's keys, then --set.
  std::string preset;
  // yaml-cpp's operator= on a Node aliases, and non-const operator[] inserts: look up through a
  // const reference and rebind with reset().
  const YAML::Node& croot = root;
  YAML::Node preset_node;
  if (croot["model"] && croot["model"].IsMap() && croot["model"]["preset"]) preset_node.reset(croot["model"]["preset"]);
  for (const auto& o : sets)
    if (o.section == "model" && o.key == "preset") preset_node.reset(o.value);
  if (preset_node.IsDefined() && !preset_node.IsNull()) preset = convert<std::string>(preset_node, "model.preset");
  try {
    apply_preset(cfg.model, preset);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + where(preset_node));
  }
  for (const auto& sec : root) {
    if (sec.second.IsNull()) continue;
    std::string s = sec.first.as<std::string>();
    for (const auto& kv : sec.second) find_field(s, kv.first.as<std::string>())->set(cfg, kv.second);
  }
  for (const auto& o : sets) {
    if (o.value.IsScalar() && o.value.Scalar().empty() && find_field(o.section, o.key)->type != "string")
      throw ConfigError(fmt::format("--set {}.{}: missing value", o.section, o.key));
    find_field(o.section, o.key)->set(cfg, o.value);
  }
  cfg.model.preset = preset;
  cfg.world_size = world_size_from_env();
  validate(cfg);
  return cfg;
}

}  // namespace

// Text with no document (empty, or only comments) stands for the defaults here; a recipe *file*
// must say something (see load()).
RunConfig load_string(const std::string& text, const std::vector<std::string>& overrides,
                      const std::string& origin) {
  YAML::Node root = parse_document(text, origin);
  if (root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));
  return resolve(root, overrides, origin);
}

RunConfig load(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) {
    RunConfig cfg = load_string("", overrides, "<defaults>");
    cfg.recipe_name = "run";
    return cfg;
  }
  YAML::Node root = parse_document(read_recipe(path), path);
  if (root.IsNull())
    throw ConfigError(fmt::format("{}: the recipe is empty (no sections, only comments or nothing); "
                                  "give at least one section, e.g. `model: {{preset: tiny}}`", path));
  RunConfig cfg = resolve(root, overrides, path);
  cfg.recipe_name = std::filesystem::path(path).stem().string();
  return cfg;
}

int64_t world_size_from_env() {
  const char* w = std::getenv("WORLD_SIZE");
  if (!w) return 1;
  char* end = nullptr;
  const long long v = std::strtoll(w, &end, 10);
  return end != w && *end == '\0' && v > 0 ? v : 1;  // a malformed value is reported by the launch code
}

}  // namespace sl::config
