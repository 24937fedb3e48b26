// The recipe's named choices that decide how a run is built, parsed once where the recipe is read:
// parallel.sharding (Sharding) and checkpointing.mode (CheckpointingMode). Past the parser no code sees
// their names: it asks the value what it does (sharding.shards_params()) or compares values
// (mode == CheckpointingMode::kBudget). Comparing one with a string does not compile, and
// scripts/check_design.py keeps src/ free of string comparisons with these names.
// Torch-free: the planner and the formulas use them too.
#pragma once
#include <array>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace sl::config {

// parallel.sharding: ZeRO's stages, each sharding one more kind of model state over the ranks
// (none = DDP: every rank holds all of them).
class Sharding {
 public:
  enum Stage : uint8_t { kNone, kZero1, kZero2, kZero3 };
  static constexpr std::array<std::string_view, 4> kNames = {"none", "zero1", "zero2", "zero3"};

  constexpr Sharding() = default;
  constexpr Sharding(Stage s) : stage_(s) {}  // NOLINT(google-explicit-constructor): Sharding::kZero3 reads as a value
  static std::optional<Sharding> parse(std::string_view name);

  constexpr Stage stage() const { return stage_; }
  constexpr std::string_view name() const { return kNames[stage_]; }

  constexpr bool replicated() const { return stage_ == kNone; }       // none: DDP, nothing sharded
  constexpr bool shards_optimizer() const { return stage_ != kNone; }  // zero1+: AdamW moments (and fp32 masters)
  constexpr bool shards_grads() const { return stage_ >= kZero2; }     // zero2+: gradients reduce-scattered
  constexpr bool shards_params() const { return stage_ == kZero3; }    // zero3: parameters gathered per unit

  constexpr bool operator==(const Sharding&) const = default;
  bool operator==(std::string_view) const = delete;  // compare stages or ask what it shards, never names

 private:
  Stage stage_ = kNone;
};

// checkpointing.mode: which activations a step keeps and which it recomputes. Its parameters stay in
// their own keys (checkpointing.interval / segments, recompute, budget) and the checkpointing::Plan made
// from them (checkpointing/runner.h, budget/budget.h).
class CheckpointingMode {
 public:
  enum Kind : uint8_t { kNone, kFull, kInterval, kSqrt, kSelective, kBudget };
  static constexpr std::array<std::string_view, 6> kNames = {"none", "full", "interval", "sqrt", "selective", "budget"};

  constexpr CheckpointingMode() = default;
  constexpr CheckpointingMode(Kind k) : kind_(k) {}  // NOLINT(google-explicit-constructor)
  static std::optional<CheckpointingMode> parse(std::string_view name);

  constexpr Kind kind() const { return kind_; }
  constexpr std::string_view name() const { return kNames[kind_]; }

  // budget: the schedule is solved per block under a memory budget (budget/budget.h); the others
  // follow one rule for every block (checkpointing::make_plan).
  constexpr bool solved() const { return kind_ == kBudget; }

  constexpr bool operator==(const CheckpointingMode&) const = default;
  bool operator==(std::string_view) const = delete;

 private:
  Kind kind_ = kNone;
};

// train.micro_batch: sequences per forward/backward, or auto: the largest that fits memory.limit while
// keeping train.global_batch, found at set-up by real probe steps, which then stores the number it
// chose. Past set-up the recipe holds a number. Reads as that number; reading auto as a number is a
// bug (std::logic_error), so no code can take auto for a size.
class MicroBatch {
 public:
  constexpr MicroBatch(int64_t n = 8) : n_(n) {}  // NOLINT(google-explicit-constructor): a number is a micro-batch
  static constexpr MicroBatch automatic() {
    MicroBatch m(0);
    m.auto_ = true;
    return m;
  }
  constexpr bool is_auto() const { return auto_; }
  int64_t value() const;                         // std::logic_error when auto
  operator int64_t() const { return value(); }  // NOLINT(google-explicit-constructor): arithmetic reads the number

 private:
  int64_t n_;
  bool auto_ = false;
};

// "none | zero1 | zero2 | zero3": the names of a choice, for messages and --help-config.
template <class Choice> std::string choice_list() {
  std::string out;
  for (const auto n : Choice::kNames) out += (out.empty() ? "" : " | ") + std::string(n);
  return out;
}

// JSON: the name, as in the recipe (logs, summary.json, state metadata, plan output).
void to_json(nlohmann::json& j, const Sharding& s);
void to_json(nlohmann::json& j, const CheckpointingMode& m);
void to_json(nlohmann::json& j, const MicroBatch& m);  // "auto" or the number
// Streams: the name (test messages; in fmt use .name()).
std::ostream& operator<<(std::ostream& os, const Sharding& s);
std::ostream& operator<<(std::ostream& os, const CheckpointingMode& m);

}  // namespace sl::config
