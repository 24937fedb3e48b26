// The thread's phase and allocation label (see alloc_tag.h).
#include "device/alloc_tag.h"

#include <atomic>

namespace sl::device {
namespace {

thread_local PhaseTag t_phase;
thread_local Tag t_label;
thread_local bool t_has_label = false;
std::atomic<bool> g_detailed{false};

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::setup: return "setup";
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::optimizer: return "optimizer";
    case Phase::eval: return "eval";
  }
  return "setup";
}

const char* label_name(Label l) {
  static const char* names[kLabels] = {"other",     "weights",        "gradients",       "optimizer_state", "buffers",
                                       "input",     "activations",    "loss",            "recompute",       "backward",
                                       "optimizer_temp", "gathered_params", "comm",     "offload",         "eval"};
  return names[static_cast<int>(l)];
}

const char* label_meaning(Label l) {
  static const char* meanings[kLabels] = {
      "allocated outside any labelled place, or alive before the step and not a model state",
      "parameters (and the fp32 master copies of a sharded or offloaded run)",
      "parameter gradients (the accumulated .grad, or the rank's gradient shard)",
      "AdamW's first and second moments",
      "the model's buffers (RoPE tables)",
      "the step's token batch (inputs and targets)",
      "made in the unit's forward: what backward keeps, and the forward's transients",
      "the loss and what cross-entropy keeps for backward",
      "made while backward re-runs a checkpointed piece of the unit's forward",
      "the unit's backward: activation gradients and their temporaries",
      "after backward: gradient norm, clipping and AdamW's temporaries",
      "ZeRO-3: the unit's parameters while gathered",
      "communication buffers: gradients in flight to a reduce-scatter or all-reduce",
      "copies to and from host memory (offload.*)",
      "evaluation",
  };
  return meanings[static_cast<int>(l)];
}

PhaseTag current_phase() { return t_phase; }

void set_phase(Phase phase, int32_t unit) { t_phase = {phase, unit}; }

Tag current_tag() {
  if (t_has_label) return t_label;
  switch (t_phase.phase) {
    case Phase::forward: return {Label::activations, t_phase.unit};
    case Phase::backward: return {Label::backward, t_phase.unit};
    case Phase::optimizer: return {Label::optimizer_temp, -1};
    case Phase::eval: return {Label::eval, -1};
    case Phase::setup: break;
  }
  return {Label::other, -1};
}

LabelScope::LabelScope(Label label, int32_t unit) : saved_(t_label), had_(t_has_label) {
  t_label = {label, unit};
  t_has_label = true;
}

LabelScope::~LabelScope() {
  t_label = saved_;
  t_has_label = had_;
}

bool detailed_tags() { return g_detailed.load(std::memory_order_relaxed); }
void set_detailed_tags(bool on) { g_detailed.store(on, std::memory_order_relaxed); }

}  // namespace sl::device
