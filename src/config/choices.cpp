#include "config/choices.h"

#include <ostream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace sl::config {

namespace {

// The choice whose name is `name` (its index in Choice::kNames), nullopt for any other text.
template <class Choice, class Value>
std::optional<Choice> by_name(std::string_view name) {
  for (size_t i = 0; i < Choice::kNames.size(); ++i)
    if (Choice::kNames[i] == name) return Choice(static_cast<Value>(i));
  return std::nullopt;
}

}  // namespace

std::optional<Sharding> Sharding::parse(std::string_view name) { return by_name<Sharding, Stage>(name); }
std::optional<CheckpointingMode> CheckpointingMode::parse(std::string_view name) { return by_name<CheckpointingMode, Kind>(name); }

void to_json(nlohmann::json& j, const Sharding& s) { j = std::string(s.name()); }
void to_json(nlohmann::json& j, const CheckpointingMode& m) { j = std::string(m.name()); }
void to_json(nlohmann::json& j, const MicroBatch& m) { j = m.is_auto() ? nlohmann::json("auto") : nlohmann::json(m.value()); }

int64_t MicroBatch::value() const {
  if (auto_) throw std::logic_error("train.micro_batch: auto read as a number before set-up chose one");
  return n_;
}
std::ostream& operator<<(std::ostream& os, const Sharding& s) { return os << s.name(); }
std::ostream& operator<<(std::ostream& os, const CheckpointingMode& m) { return os << m.name(); }

}  // namespace sl::config
