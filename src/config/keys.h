// The recipe's key table, shared by the files of src/config (not part of config.h's surface): one
// Field per key, the lookups and the YAML value reader (keys.cpp), and the text values the table reads
// (load.cpp).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "config/config.h"

namespace sl::config {

using Json = nlohmann::json;

// One recipe key: where it lives, what it means, and how to read/write it.
struct Field {
  std::string section, key, type, doc;
  std::function<void(RunConfig&, const YAML::Node&)> set;
  std::function<Json(const RunConfig&)> get;
  std::string name() const { return section + "." + key; }
};

// " (line N)" for a node read from a file; "" for one that stands on no line (a --set value).
std::string where(const YAML::Node& node);

// A node's value as T, or a ConfigError naming `name` and the node's line (keys.cpp, which instantiates
// it for std::string: the loader reads model.preset with it).
template <class T> T convert(const YAML::Node& node, const std::string& name);

// Every key, section by section, in the order --help-config and the reference list them.
const std::vector<Field>& fields();
// The key `section.key`, or nullptr when the table has none.
const Field* find_field(const std::string& section, const std::string& key);
bool is_section(const std::string& s);
// A section's keys, and the sections, comma-separated, for messages.
std::string keys_of(const std::string& section);
std::string section_names();

// checkpointing.budget and precision.loss_scale read from their text (load.cpp, beside parse_bytes).
Budget parse_budget(const std::string& text);
LossScale parse_loss_scale(const std::string& text);

}  // namespace sl::config
