#include "config/choices.h"

#include <ostream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace sl::config {

std::optional<Sharding> Sharding::parse(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (kNames[i] == name) return Sharding(static_cast<Stage>(i));
  return std::nullopt;
}

std::optional<CheckpointingMode> CheckpointingMode::parse(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (kNames[i] == name) return CheckpointingMode(static_cast<Kind>(i));
  return std::nullopt;
}

void to_json(nlohmann::json& j, const Sharding& s) { j = s.str(); }
void to_json(nlohmann::json& j, const CheckpointingMode& m) { j = m.str(); }
void to_json(nlohmann::json& j, const MicroBatch& m) { j = m.is_auto() ? nlohmann::json("auto") : nlohmann::json(m.value()); }

int64_t MicroBatch::value() const {
  if (auto_) throw std::logic_error("train.micro_batch: auto read as a number before set-up chose one");
  return n_;
}
std::ostream& operator<<(std::ostream& os, const Sharding& s) { return os << s.name(); }
std::ostream& operator<<(std::ostream& os, const CheckpointingMode& m) { return os << m.name(); }

}  // namespace sl::config
