// The recipe's named choices, parsed once where the recipe is read: parallel.sharding (Sharding),
// checkpointing.mode (CheckpointingMode), model.arch (Arch), the precision dtypes (Dtype),
// precision.tf32 (Tf32), parallel.backend (Backend), train.device (DeviceChoice), train.on_nonfinite
// (OnNonfinite), train.on_spike (OnSpike), train.cuda_graphs (CudaGraphs), checkpointing.exchange (Exchange),
// data.source (DataSource) and data.raw_dtype (RawDtype). Past the parser no code sees their names: it asks the value
// what it does (sharding.shards_params(), dtype.bytes()) or compares values (mode == CheckpointingMode::kBudget).
// Comparing one with a string does not compile, and scripts/check_design.py keeps src/ free of string comparisons with
// these names. Torch-free: the planner and the formulas use them too.
#pragma once
#include <array>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace sl::config {

// What every named choice shares: it is one of Self::kNames, held as that name's index (a Self::Kind),
// read by parse() and written back by name(). Self declares `enum Kind` and `kNames` in the same order.
template <class Self>
class NamedChoice {
 public:
  // The choice named `name`; nullopt for any other text.
  static std::optional<Self> parse(std::string_view name) {
    for (size_t i = 0; i < Self::kNames.size(); ++i)
      if (Self::kNames[i] == name) return Self(static_cast<typename Self::Kind>(i));
    return std::nullopt;
  }
  constexpr auto kind() const { return static_cast<typename Self::Kind>(index_); }
  constexpr std::string_view name() const { return Self::kNames[index_]; }

  friend constexpr bool operator==(const Self& a, const Self& b) { return a.kind() == b.kind(); }
  bool operator==(std::string_view) const = delete;  // compare values or ask what it does, never names

 protected:
  constexpr explicit NamedChoice(uint8_t index) : index_(index) {}

 private:
  uint8_t index_;
};

// parallel.sharding: ZeRO's stages, each sharding one more kind of model state over the ranks
// (none = DDP: every rank holds all of them).
class Sharding : public NamedChoice<Sharding> {
 public:
  enum Kind : uint8_t { kNone, kZero1, kZero2, kZero3 };
  using Stage = Kind;
  static constexpr std::array<std::string_view, 4> kNames = {"none", "zero1", "zero2", "zero3"};

  constexpr Sharding() : Sharding(kNone) {}
  // NOLINT(google-explicit-constructor): Sharding::kZero3 reads as a value
  constexpr Sharding(Stage s) : NamedChoice(s) {}

  constexpr Stage stage() const { return kind(); }

  constexpr bool replicated() const { return kind() == kNone; }       // none: DDP, nothing sharded
  constexpr bool shards_optimizer() const { return kind() != kNone; }  // zero1+: AdamW moments (and fp32 masters)
  constexpr bool shards_grads() const { return kind() >= kZero2; }     // zero2+: gradients reduce-scattered
  constexpr bool shards_params() const { return kind() == kZero3; }    // zero3: parameters gathered per unit
};

// checkpointing.mode: which activations a step keeps and which it recomputes. Its parameters stay in
// their own keys (checkpointing.interval / segments, recompute, budget) and the recompute::Plan made
// from them (recompute/runner.h, predict/budget.h).
class CheckpointingMode : public NamedChoice<CheckpointingMode> {
 public:
  enum Kind : uint8_t { kNone, kFull, kInterval, kSqrt, kSelective, kBudget };
  static constexpr std::array<std::string_view, 6> kNames = {"none", "full", "interval", "sqrt", "selective", "budget"};

  constexpr CheckpointingMode() : CheckpointingMode(kNone) {}
  constexpr CheckpointingMode(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  // budget: the schedule is solved per block under a memory budget (predict/budget.h); the others
  // follow one rule for every block (recompute::make_plan).
  constexpr bool solved() const { return kind() == kBudget; }
};

// model.arch: gpt2 (LayerNorm, GELU, learned positions) or llama (RMSNorm, SwiGLU, RoPE).
class Arch : public NamedChoice<Arch> {
 public:
  enum Kind : uint8_t { kGpt2, kLlama };
  static constexpr std::array<std::string_view, 2> kNames = {"gpt2", "llama"};

  constexpr Arch() : Arch(kGpt2) {}
  constexpr Arch(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)
};

// precision.compute, precision.param_dtype, precision.reduce_dtype (and `trainer export --dtype`): a
// floating-point type.
class Dtype : public NamedChoice<Dtype> {
 public:
  enum Kind : uint8_t { kFp32, kBf16, kFp16 };
  static constexpr std::array<std::string_view, 3> kNames = {"fp32", "bf16", "fp16"};

  constexpr Dtype() : Dtype(kFp32) {}
  constexpr Dtype(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  constexpr int64_t bytes() const { return kind() == kFp32 ? 4 : 2; }  // bytes per element
};

// precision.tf32: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (inputs rounded to 10
// mantissa bits, products summed in fp32), as nanoGPT and llm.c train; auto = on for a CUDA run, off
// elsewhere (no other device has TF32). Set once at a run's set-up (device::set_tf32).
class Tf32 : public NamedChoice<Tf32> {
 public:
  enum Kind : uint8_t { kAuto, kOn, kOff };
  static constexpr std::array<std::string_view, 3> kNames = {"auto", "true", "false"};

  constexpr Tf32() : Tf32(kAuto) {}
  constexpr Tf32(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  // Whether a run on CUDA (`on_cuda`) or elsewhere computes its fp32 matmuls in TF32.
  constexpr bool enabled(bool on_cuda) const { return on_cuda && kind() != kOff; }
};

// parallel.backend: the collectives' library; auto = NCCL on CUDA, Gloo on CPU (parallel/comm.h).
class Backend : public NamedChoice<Backend> {
 public:
  enum Kind : uint8_t { kAuto, kGloo, kNccl };
  static constexpr std::array<std::string_view, 3> kNames = {"auto", "gloo", "nccl"};

  constexpr Backend() : Backend(kAuto) {}
  constexpr Backend(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)
};

// train.device (and `trainer sample --device`): auto = CUDA when available; lazy is LibTorch's
// lazy-tensor test device (device/device.h).
class DeviceChoice : public NamedChoice<DeviceChoice> {
 public:
  enum Kind : uint8_t { kAuto, kCpu, kCuda, kLazy };
  static constexpr std::array<std::string_view, 4> kNames = {"auto", "cpu", "cuda", "lazy"};

  constexpr DeviceChoice() : DeviceChoice(kAuto) {}
  constexpr DeviceChoice(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)
};

// train.on_nonfinite: what a step with NaN/Inf gradients (and a finite loss) does outside fp16.
class OnNonfinite : public NamedChoice<OnNonfinite> {
 public:
  enum Kind : uint8_t { kAbort, kSkip };
  static constexpr std::array<std::string_view, 2> kNames = {"abort", "skip"};

  constexpr OnNonfinite() : OnNonfinite(kAbort) {}
  constexpr OnNonfinite(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)
};

// train.on_spike: what a loss spike does (train/spike.h).
class OnSpike : public NamedChoice<OnSpike> {
 public:
  enum Kind : uint8_t { kOff, kWarn, kSkip, kStop };
  static constexpr std::array<std::string_view, 4> kNames = {"off", "warn", "skip", "stop"};

  constexpr OnSpike() : OnSpike(kWarn) {}
  constexpr OnSpike(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  // the spike's step leaves the weights untouched
  constexpr bool holds() const { return kind() == kSkip || kind() == kStop; }
};

// train.cuda_graphs: whether a micro-batch's forward and backward are captured into a CUDA graph and
// replayed (train/cuda_graph.h). off: eager always (the default: a graph's memory pool stays reserved for
// the run, outside the per-step peaks the planner and memory.limit count); auto: captured where the run
// is eligible (train::graph_eligibility), eager elsewhere, the reason in the settings and summary.json;
// on: as auto, with a warning at start when the run is not eligible.
class CudaGraphs : public NamedChoice<CudaGraphs> {
 public:
  enum Kind : uint8_t { kOff, kOn, kAuto };
  static constexpr std::array<std::string_view, 3> kNames = {"off", "on", "auto"};

  constexpr CudaGraphs() : CudaGraphs(kOff) {}
  constexpr CudaGraphs(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  constexpr bool wanted() const { return kind() != kOff; }  // on or auto: captured where eligible
};

// checkpointing.exchange: what a recompute does about the all-to-alls of sequence parallelism
// (parallel.sequence > 1, model/sequence.h) in the blocks it re-runs (a checkpointed segment, or a
// selective attention). redo: exchanges again (no memory kept from the first pass); keep: the first
// pass keeps what its exchanges received (the gathered q, k, v and the attention output, 3C + C per local
// token per block) and the recompute takes them instead of communicating; auto: mode budget chooses per
// block (predict/budget.h), every other mode redoes. Nothing to choose at parallel.sequence 1.
class Exchange : public NamedChoice<Exchange> {
 public:
  enum Kind : uint8_t { kAuto, kRedo, kKeep };
  static constexpr std::array<std::string_view, 3> kNames = {"auto", "redo", "keep"};

  constexpr Exchange() : Exchange(kAuto) {}
  constexpr Exchange(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  constexpr bool keeps() const { return kind() == kKeep; }     // every recompute keeps
  constexpr bool chosen() const { return kind() == kAuto; }    // budget mode's solver decides per block
};

// data.source: where the tokens come from (data/loader.h, data/examples.h); bin is llmc's old name; examples
// are llm.c shards with a loss mask and example boundaries beside them (scripts/prepare_chat.py).
class DataSource : public NamedChoice<DataSource> {
 public:
  enum Kind : uint8_t { kLlmc, kBin, kRaw, kText, kSynthetic, kExamples };
  static constexpr std::array<std::string_view, 6> kNames = {"llmc", "bin", "raw", "text", "synthetic", "examples"};

  constexpr DataSource() : DataSource(kLlmc) {}
  constexpr DataSource(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  constexpr bool llmc() const { return kind() == kLlmc || kind() == kBin; }  // llm.c's shard format (either name)
  constexpr bool examples() const { return kind() == kExamples; }  // one example a row, a loss mask (data/examples.h)
  // token ids a tokenizer wrote (data.path)
  constexpr bool token_file() const { return llmc() || kind() == kRaw || examples(); }
};

// data.raw_dtype: the width of a raw (headerless) token file's ids.
class RawDtype : public NamedChoice<RawDtype> {
 public:
  enum Kind : uint8_t { kUint16, kUint32 };
  static constexpr std::array<std::string_view, 2> kNames = {"uint16", "uint32"};

  constexpr RawDtype() : RawDtype(kUint16) {}
  constexpr RawDtype(Kind k) : NamedChoice(k) {}  // NOLINT(google-explicit-constructor)

  constexpr int64_t bytes() const { return kind() == kUint32 ? 4 : 2; }  // bytes per token
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
void to_json(nlohmann::json& j, const Sharding& c);
void to_json(nlohmann::json& j, const CheckpointingMode& c);
void to_json(nlohmann::json& j, const Arch& c);
void to_json(nlohmann::json& j, const Dtype& c);
void to_json(nlohmann::json& j, const Tf32& c);
void to_json(nlohmann::json& j, const Backend& c);
void to_json(nlohmann::json& j, const DeviceChoice& c);
void to_json(nlohmann::json& j, const OnNonfinite& c);
void to_json(nlohmann::json& j, const OnSpike& c);
void to_json(nlohmann::json& j, const CudaGraphs& c);
void to_json(nlohmann::json& j, const Exchange& c);
void to_json(nlohmann::json& j, const DataSource& c);
void to_json(nlohmann::json& j, const RawDtype& c);
void to_json(nlohmann::json& j, const MicroBatch& m);  // "auto" or the number
// Streams: the name (test messages; in fmt use .name()).
std::ostream& operator<<(std::ostream& os, const Sharding& c);
std::ostream& operator<<(std::ostream& os, const CheckpointingMode& c);
std::ostream& operator<<(std::ostream& os, const Arch& c);
std::ostream& operator<<(std::ostream& os, const Dtype& c);
std::ostream& operator<<(std::ostream& os, const Tf32& c);
std::ostream& operator<<(std::ostream& os, const Backend& c);
std::ostream& operator<<(std::ostream& os, const DeviceChoice& c);
std::ostream& operator<<(std::ostream& os, const OnNonfinite& c);
std::ostream& operator<<(std::ostream& os, const OnSpike& c);
std::ostream& operator<<(std::ostream& os, const CudaGraphs& c);
std::ostream& operator<<(std::ostream& os, const Exchange& c);
std::ostream& operator<<(std::ostream& os, const DataSource& c);
std::ostream& operator<<(std::ostream& os, const RawDtype& c);

}  // namespace sl::config
