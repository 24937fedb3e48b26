// What the allocations this thread makes are for: the step's phase (forward, backward of a unit,
// optimizer, ...) and a label (weights, a block's activations, a recompute's transients, ...). The
// memory timeline (memory/timeline.h, logging.memory_timeline) stamps every allocation with them; the
// phase is also what an out-of-memory report names. Both are thread-local and cost a store to set.
// They live here, under the model and the checkpointing runner that set them, as HostScope does for
// the pool an allocation belongs to (device/host.h).
#pragma once
#include <cstdint>

namespace sl::device {

// What the step is doing.
enum class Phase : uint8_t { setup, forward, backward, optimizer, eval };
inline constexpr int kPhases = 5;

// What an allocation is for. `unit` (model/gpt.h: 0 the embeddings, 1..L the blocks, L+1 the head;
// -1 none) says whose, for the labels that belong to a unit.
enum class Label : uint8_t {
  other,            // nothing more specific is known
  weights,          // parameters (and fp32 masters)
  gradients,        // parameters' gradients (the accumulated .grad or the rank's gradient shard)
  optimizer_state,  // AdamW's moments
  buffers,          // the model's buffers (RoPE tables)
  input,            // the step's token batch
  activations,      // made in a unit's forward: what backward keeps, and the forward's transients
  loss,             // the fused head and loss (model/fused_loss.h): a chunk's logits, the gradients it keeps
  recompute,        // made while backward re-runs a checkpointed piece of a unit's forward
  backward,         // a unit's backward: gradients of activations and their temporaries
  optimizer_temp,   // after backward: gradient norm, clipping, AdamW's temporaries
  gathered_params,  // ZeRO-3: a unit's parameters while gathered
  comm,             // communication buffers: gradients in flight to a reduce-scatter / all-reduce
  offload,          // copies to and from host memory (offload.*)
  eval,             // evaluation
};
inline constexpr int kLabels = 15;

const char* phase_name(Phase p);    // "forward", "backward", ...
const char* label_name(Label l);    // "weights", "activations", ...
const char* label_meaning(Label l);  // one line, for the timeline's vocabulary

struct PhaseTag {
  Phase phase = Phase::setup;
  int32_t unit = -1;
};
struct Tag {
  Label label = Label::other;
  int32_t unit = -1;
};

PhaseTag current_phase();
void set_phase(Phase phase, int32_t unit = -1);

// The label of an allocation made now: the innermost open LabelScope's, else the phase's own
// (forward: activations, backward: backward of the phase's unit, optimizer: optimizer_temp, eval:
// eval, setup: other).
Tag current_tag();

// Labels what this thread allocates while it is open. Nestable.
class LabelScope {
 public:
  explicit LabelScope(Label label, int32_t unit = -1);
  ~LabelScope();
  LabelScope(const LabelScope&) = delete;
  LabelScope& operator=(const LabelScope&) = delete;

 private:
  Tag saved_;
  bool had_;
};

// Whether anyone reads the tags in detail (a memory timeline is armed or recording): the checkpointing
// runner then marks each unit's backward with a gradient hook; otherwise it adds nothing to the graph.
bool detailed_tags();
void set_detailed_tags(bool on);

}  // namespace sl::device
