// The memory timeline of one step (logging.memory_timeline): every allocation and free the tracking
// allocator sees while it records, each with a sequence number, a time, its signed bytes, its pool
// (device or host), the label of its allocation and the phase current when it happened
// (device/alloc_tag.h). It starts where the step's peak is reset and ends where the step's peak is
// read, both inside the allocator's lock, so its running device total replays exactly the counter
// whose maximum is the step's peak_allocated_bytes: the timeline's peak is that number by construction.
// Blocks alive at the start (weights, gradients, moments, buffers, the batch) and blocks alive at the
// end are labelled by their storage pointers (KnownTensors), which the step's owner supplies.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "device/alloc_tag.h"

namespace sl::memory {

// Storage pointers of tensors whose label is known. The first label given to a pointer stays.
class KnownTensors {
 public:
  void add(const at::Tensor& t, device::Label label, int32_t unit = -1);
  const device::Tag* find(const void* ptr) const;

 private:
  std::unordered_map<const void*, device::Tag> tags_;
};

// A block the allocator holds, as the timeline is told about it.
struct LiveBlock {
  const void* ptr = nullptr;
  int64_t bytes = 0;
  bool host = false;
  uint32_t id = 0;  // the timeline's block id (assigned at begin() for the blocks alive then)
};

class Timeline {
 public:
  static Timeline& instance();

  // Records the next window the allocator opens (TrackingCPUAllocator::reset_peak, at the start of
  // a step) until it is closed (TrackingCPUAllocator::close_timeline, where the step's peak is read).
  // `known` labels the blocks alive at the start. Clears an earlier recording.
  void arm(int64_t step, KnownTensors known);
  // Stops recording and drops everything (also what a finished window holds).
  void disarm();
  // Armed or recording: the allocator's one relaxed load per allocation and free.
  bool on() const { return on_.load(std::memory_order_relaxed); }
  bool recording() const { return state_ == State::recording; }
  bool finished() const { return state_ == State::finished; }

  // --- called by the allocator, under its lock ---
  // Opens the window: `live` are the allocator's blocks now; the i-th gets block id i.
  void begin(const std::vector<LiveBlock>& live, int64_t device_bytes, int64_t host_bytes);
  uint32_t on_alloc(int64_t bytes, bool host);  // returns the new block's id
  void on_free(uint32_t id, int64_t bytes, bool host);
  // Closes the window: `live` are the blocks alive now, `peak` the allocator's peak of the window.
  void end(const std::vector<LiveBlock>& live, int64_t device_bytes, int64_t host_bytes, int64_t peak);

  // After end(): the JSON of docs/logs.md ("memory_timeline.json"). `known` relabels the blocks alive
  // at the end (gradients and moments made during the step) and those alive at the start that the
  // arm-time set did not know; `unit_names` names units 0..L+1.
  nlohmann::json to_json(const KnownTensors& known, const std::vector<std::string>& unit_names);
  int64_t step() const { return step_; }

 private:
  enum class State { off, armed, recording, finished };
  struct Event {
    int64_t t_ns;
    int64_t bytes;  // + allocation, - free
    uint32_t block;
    uint16_t phase;
    bool host;
  };
  uint16_t label_id(device::Tag tag);
  uint16_t phase_id(device::PhaseTag p);
  void relabel(const KnownTensors& known);
  nlohmann::json vocabulary(const std::vector<std::string>& unit_names) const;
  nlohmann::json events_json(nlohmann::json& peak) const;
  void clear();

  std::atomic<bool> on_{false};
  State state_ = State::off;
  int64_t step_ = 0;
  KnownTensors known_at_start_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Event> events_;
  std::vector<uint16_t> block_label_;  // per block id
  std::vector<const void*> start_ptr_;  // blocks alive at the start (ids 0..n-1): their pointers
  std::vector<int64_t> start_bytes_;    // ... and sizes
  std::vector<bool> start_host_pool_;   // ... and pools
  std::vector<std::pair<uint32_t, const void*>> end_live_;  // blocks alive at the end
  std::vector<device::Tag> labels_;
  std::vector<device::PhaseTag> phases_;
  std::unordered_map<uint64_t, uint16_t> label_ids_, phase_ids_;
  int64_t start_device_ = 0, start_host_ = 0, end_device_ = 0, end_host_ = 0, allocator_peak_ = 0;
};

}  // namespace sl::memory
