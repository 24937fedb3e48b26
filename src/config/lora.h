// model.lora's targets: the projections a LoRA adapter can sit on, by the Hugging Face module names of
// each arch (the names PEFT's target_modules use), and where each lies in sublinear's fused weights
// (model/gpt.h): projection 0 is w_qkv, 1 w_proj, 2 w_fc, 3 w_out (the order of model::Part), and a
// target covers rows [row0, row0 + rows) of it (LLaMA's q/k/v of w_qkv, gate/up of w_fc).
//
//   gpt2   c_attn (w_qkv), attn.c_proj (w_proj), c_fc (w_fc), mlp.c_proj (w_out); "c_proj" = both c_proj
//   llama  q_proj, k_proj, v_proj (w_qkv), o_proj (w_proj), gate_proj, up_proj (w_fc), down_proj (w_out)
//   "all-linear": every one of the arch; [] = PEFT's default for the arch (gpt2 c_attn, llama q_proj v_proj)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace sl::config {

struct LoraTarget {
  std::string name;    // the Hugging Face module name ("q_proj", "attn.c_proj")
  int projection = 0;  // 0 w_qkv, 1 w_proj, 2 w_fc, 3 w_out
  int64_t row0 = 0, rows = 0;
};

// Every target of `arch` in a block of width C and MLP width H, in the order above.
std::vector<LoraTarget> lora_target_table(Arch arch, int64_t C, int64_t H);
// `lora`'s targets resolved in such a block, in the table's order (each once). Throws ConfigError
// naming model.lora for a name the arch does not have.
std::vector<LoraTarget> lora_targets_of_width(Arch arch, int64_t C, int64_t H, const LoraConfig& lora);
// Parameters of those adapters: rank * (K + rows) per target (K: the projection's input width, H for w_out).
int64_t lora_params_of_width(Arch arch, int64_t C, int64_t H, const LoraConfig& lora);
// (lora_targets of a model's block and lora_target_names, which need its MLP width: config/shape.h)
// The model's parameter name of a target's A or B matrix inside a block: "lora_A_q_proj", "lora_B_attn_c_proj".
std::string lora_param_name(const LoraTarget& t, char matrix);

}  // namespace sl::config
