// Analytic activation-memory model for this GPT under a recompute plan (dropout 0: the SDPA flash
// path). It predicts what the trainer reports as activation_peak_bytes (peak allocated bytes minus
// parameters, gradients and optimizer states) for one micro-batch.
//
// Written below in fp32 elements (4 bytes). Under bf16/fp16 autocast the residual stream (x, h) and
// the norm statistics stay fp32 while every other tensor kept for backward (linear inputs and
// outputs, attention, MLP activations) takes 2 bytes; the code counts bytes per element that way.
//
// Per token, in elements, one block keeps (its input included):
//   gpt2:  S = 8C + 2H + 4 + nh   (x, norm1 out, qkv 3C, attention out, h, norm2 out, u H, act H,
//                                  4 norm statistics, nh log-sum-exp values)
//   llama: S = 10C + 4H + 2 + nh  (adds rotated q, k: 2C; SwiGLU keeps u 2H, silu H, product H)
// Selective recompute removes: norm: both norm outputs (2C + stats); mlp: the activation output
//   (gpt2 H, llama 2H); attention: the attention output and log-sum-exp (C + nh).
// Around the blocks, at the start of backward: E = 3C + 3V (last block output, final norm output,
// log-softmax output and the logits' gradients).
// The peak is the largest of three moments:
//   A  start of backward:        E + C * (checkpointed segments) + S * (blocks not checkpointed)
//   B  recomputing the largest checkpointed segment (k blocks):
//                                C * (checkpointed segments - 1) + S * k + (2C + H)
//   Cm backward of the last block when the MLP activation is recomputed:
//                                S * L + 2C + 2H (the recomputed activation's two gradients)
// Times B*T tokens; under autocast plus one compute-dtype copy of the matmul weights
// (4C^2 + 2CH per gpt2 block, 4C^2 + 3CH per llama block, and the LM head V*C).
// Measured against it: README "Activation memory".
#pragma once
#include <cstdint>

#include "config/config.h"
#include "recompute/policy.h"

namespace sl::memory {

struct ActivationEstimate {
  int64_t tokens = 0;                // B * T
  double block_bytes = 0;            // S per token, after selective savings
  double head_bytes = 0;             // E per token
  double moment_a = 0, moment_b = 0, moment_c = 0;  // per token, in bytes
  int64_t weight_cast_bytes = 0;     // autocast's low-precision copies of the matmul weights
  int64_t peak_bytes = 0;            // max(A, B, Cm) * tokens + weight_cast_bytes
};

ActivationEstimate estimate_activation_peak(const config::RunConfig& cfg, const recompute::Plan& plan);

}  // namespace sl::memory
