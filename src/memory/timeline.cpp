// The memory timeline of one step: the recorder the tracking allocator feeds, and its JSON (see timeline.h).
#include "memory/timeline.h"

#include <algorithm>
#include <map>
#include <utility>

namespace sl::memory {
namespace {

using Json = nlohmann::json;

uint64_t key(uint8_t kind, int32_t unit) {
  return (static_cast<uint64_t>(kind) << 32) | static_cast<uint32_t>(unit + 1);
}

std::string unit_text(int32_t unit, const std::vector<std::string>& unit_names) {
  if (unit < 0) return "";
  return static_cast<size_t>(unit) < unit_names.size() ? unit_names[static_cast<size_t>(unit)]
                                                       : "unit " + std::to_string(unit);
}

// "activations/block 3", or the label alone when it belongs to no unit.
std::string tag_name(device::Tag t, const std::vector<std::string>& unit_names) {
  const std::string unit = unit_text(t.unit, unit_names);
  return unit.empty() ? device::label_name(t.label) : std::string(device::label_name(t.label)) + "/" + unit;
}

}  // namespace

void KnownTensors::add(const at::Tensor& t, device::Label label, int32_t unit) {
  if (!t.defined() || !t.has_storage()) return;
  const void* ptr = t.storage().data();
  if (ptr != nullptr) tags_.emplace(ptr, device::Tag{label, unit});
}

const device::Tag* KnownTensors::find(const void* ptr) const {
  const auto it = tags_.find(ptr);
  return it == tags_.end() ? nullptr : &it->second;
}

Timeline& Timeline::instance() {
  static Timeline* t = new Timeline();  // never destroyed: the allocator may free blocks after main
  return *t;
}

void Timeline::clear() {
  events_.clear();
  block_label_.clear();
  start_ptr_.clear();
  start_bytes_.clear();
  start_host_pool_.clear();
  end_live_.clear();
  labels_.clear();
  phases_.clear();
  label_ids_.clear();
  phase_ids_.clear();
  start_device_ = start_host_ = end_device_ = end_host_ = allocator_peak_ = 0;
}

void Timeline::arm(int64_t step, KnownTensors known) {
  clear();
  step_ = step;
  known_at_start_ = std::move(known);
  events_.reserve(1 << 16);
  state_ = State::armed;
  device::set_detailed_tags(true);
  on_.store(true);
}

void Timeline::disarm() {
  on_.store(false);
  device::set_detailed_tags(false);
  state_ = State::off;
  clear();
  known_at_start_ = {};
}

uint16_t Timeline::label_id(device::Tag tag) {
  const auto [it, fresh] = label_ids_.emplace(key(static_cast<uint8_t>(tag.label), tag.unit), labels_.size());
  if (fresh) labels_.push_back(tag);
  return it->second;
}

uint16_t Timeline::phase_id(device::PhaseTag p) {
  const auto [it, fresh] = phase_ids_.emplace(key(static_cast<uint8_t>(p.phase), p.unit), phases_.size());
  if (fresh) phases_.push_back(p);
  return it->second;
}

void Timeline::begin(const std::vector<LiveBlock>& live, int64_t device_bytes, int64_t host_bytes) {
  if (state_ != State::armed) return;
  for (const auto& b : live) {
    const device::Tag* known = known_at_start_.find(b.ptr);
    block_label_.push_back(label_id(known ? *known : device::Tag{}));
    start_ptr_.push_back(b.ptr);
    start_bytes_.push_back(b.bytes);
    start_host_pool_.push_back(b.host);
  }
  start_device_ = device_bytes;
  start_host_ = host_bytes;
  t0_ = std::chrono::steady_clock::now();
  state_ = State::recording;
}

uint32_t Timeline::on_alloc(int64_t bytes, bool host) {
  if (state_ != State::recording) return 0;
  const auto id = static_cast<uint32_t>(block_label_.size());
  block_label_.push_back(label_id(device::current_tag()));
  const auto t = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
  events_.push_back({t, bytes, id, phase_id(device::current_phase()), host});
  return id;
}

void Timeline::on_free(uint32_t id, int64_t bytes, bool host) {
  if (state_ != State::recording || id >= block_label_.size()) return;
  const auto t = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
  events_.push_back({t, -bytes, id, phase_id(device::current_phase()), host});
}

void Timeline::end(const std::vector<LiveBlock>& live, int64_t device_bytes, int64_t host_bytes, int64_t peak) {
  if (state_ != State::recording) return;
  for (const auto& b : live) end_live_.emplace_back(b.id, b.ptr);
  end_device_ = device_bytes;
  end_host_ = host_bytes;
  allocator_peak_ = peak;
  state_ = State::finished;
  on_.store(false);
  device::set_detailed_tags(false);
}

// Blocks alive at the end that `known` names (gradients and moments made in the step, engine buffers)
// take its label; so do blocks alive at the start that the arm-time set did not know.
void Timeline::relabel(const KnownTensors& known) {
  const uint16_t other = label_id(device::Tag{});
  for (const auto& [id, ptr] : end_live_)
    if (const device::Tag* t = known.find(ptr); t && id < block_label_.size()) block_label_[id] = label_id(*t);
  for (size_t id = 0; id < start_ptr_.size(); ++id)
    if (const device::Tag* t = known.find(start_ptr_[id]); t && block_label_[id] == other)
      block_label_[id] = label_id(*t);
}

Json Timeline::vocabulary(const std::vector<std::string>& unit_names) const {
  Json labels = Json::array(), kinds = Json::array(), phases = Json::array();
  for (const auto& t : labels_)
    labels.push_back({{"name", tag_name(t, unit_names)}, {"kind", device::label_name(t.label)},
                      {"unit", t.unit < 0 ? Json(nullptr) : Json(unit_text(t.unit, unit_names))}});
  for (int k = 0; k < device::kLabels; ++k) {
    const auto l = static_cast<device::Label>(k);
    kinds.push_back({{"kind", device::label_name(l)}, {"meaning", device::label_meaning(l)}});
  }
  for (const auto& p : phases_) {
    const std::string unit = unit_text(p.unit, unit_names);
    phases.push_back({{"name", unit.empty() ? std::string(device::phase_name(p.phase))
                                            : std::string(device::phase_name(p.phase)) + " " + unit},
                      {"kind", device::phase_name(p.phase)},
                      {"unit", unit.empty() ? Json(nullptr) : Json(unit)}});
  }
  return {{"labels", labels}, {"label_kinds", kinds}, {"phases", phases}};
}

// The events as rows, replaying the device pool's running total from the bytes alive at the start;
// `peak` gets its maximum, the event that reached it (-1: the start) and the bytes per label then.
Json Timeline::events_json(Json& peak) const {
  std::vector<int64_t> by_label(labels_.size(), 0);
  for (size_t id = 0; id < start_bytes_.size(); ++id)
    if (!start_host_pool_[id]) by_label[block_label_[id]] += start_bytes_[id];
  int64_t total = start_device_, host = start_host_, host_peak = start_host_;
  int64_t best = total, best_at = -1;
  std::vector<int64_t> at_best = by_label;
  Json rows = Json::array();
  for (size_t i = 0; i < events_.size(); ++i) {
    const Event& e = events_[i];
    const uint16_t label = block_label_[e.block];
    rows.push_back({i, e.t_ns / 1000, e.block, e.bytes, e.host ? "host" : "device", label, e.phase});
    if (e.host) {
      host += e.bytes;
      host_peak = std::max(host_peak, host);
      continue;
    }
    total += e.bytes;
    by_label[label] += e.bytes;
    if (total > best) best = total, best_at = static_cast<int64_t>(i), at_best = by_label;
  }
  Json labels = Json::object();
  for (size_t l = 0; l < labels_.size(); ++l)
    if (at_best[l] != 0) labels[std::to_string(l)] = at_best[l];
  peak = {{"device_bytes", best}, {"event", best_at}, {"by_label", labels}, {"host_bytes", host_peak},
          {"end_device_bytes_replayed", total}, {"end_host_bytes_replayed", host}};
  return rows;
}

Json Timeline::to_json(const KnownTensors& known, const std::vector<std::string>& unit_names) {
  relabel(known);
  Json peak;
  Json events = events_json(peak);
  Json start_blocks = Json::array();
  for (size_t id = 0; id < start_bytes_.size(); ++id)
    start_blocks.push_back({id, start_bytes_[id], start_host_pool_[id] ? "host" : "device", block_label_[id]});
  Json out = vocabulary(unit_names);
  out.update({{"version", 1},
              {"step", step_},
              {"units", unit_names},
              {"start", {{"device_bytes", start_device_}, {"host_bytes", start_host_}}},
              {"end", {{"device_bytes", end_device_}, {"host_bytes", end_host_}}},
              {"peak", peak},
              {"allocator_peak_bytes", allocator_peak_},
              {"live_at_start_fields", {"block", "bytes", "pool", "label"}},
              {"live_at_start", start_blocks},
              {"event_fields", {"seq", "t_us", "block", "bytes", "pool", "label", "phase"}},
              {"events", events}});
  return out;
}

}  // namespace sl::memory
