#include "config/choices.h"

#include <ostream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace sl::config {

namespace {

template <class Choice> void name_to_json(nlohmann::json& j, const Choice& c) { j = std::string(c.name()); }

}  // namespace

void to_json(nlohmann::json& j, const Sharding& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const CheckpointingMode& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const Arch& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const Dtype& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const Tf32& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const Backend& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const DeviceChoice& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const OnNonfinite& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const OnSpike& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const CudaGraphs& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const Exchange& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const DataSource& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const RawDtype& c) { name_to_json(j, c); }
void to_json(nlohmann::json& j, const MicroBatch& m) {
  j = m.is_auto() ? nlohmann::json("auto") : nlohmann::json(m.value());
}

int64_t MicroBatch::value() const {
  if (auto_) throw std::logic_error("train.micro_batch: auto read as a number before set-up chose one");
  return n_;
}

std::ostream& operator<<(std::ostream& os, const Sharding& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const CheckpointingMode& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const Arch& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const Dtype& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const Tf32& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const Backend& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const DeviceChoice& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const OnNonfinite& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const OnSpike& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const CudaGraphs& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const Exchange& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const DataSource& c) { return os << c.name(); }
std::ostream& operator<<(std::ostream& os, const RawDtype& c) { return os << c.name(); }

}  // namespace sl::config
