// Analytic activation-memory model (see activations.h for the terms).
#include "memory/activations.h"

#include <algorithm>

namespace sl::memory {

ActivationEstimate estimate_activation_peak(const config::RunConfig& cfg, const recompute::Plan& plan) {
  const auto& m = cfg.model;
  const double C = static_cast<double>(m.n_embd), H = static_cast<double>(config::mlp_hidden(m));
  const double V = static_cast<double>(m.vocab_size), nh = static_cast<double>(m.n_head);
  const double L = static_cast<double>(m.n_layer);
  const bool llama = m.arch == "llama";
  // Bytes per element: the residual stream and norm statistics stay fp32 (f); what autocast
  // computes (linear inputs and outputs, attention, activations) takes the compute dtype (c).
  const double f = 4.0, c = cfg.precision.compute == "fp32" ? 4.0 : 2.0;

  ActivationEstimate e;
  e.tokens = cfg.train.micro_batch * cfg.train.seq_len;
  // Per token, in bytes: x and h (f), both norm outputs as the linears keep them, qkv, attention
  // output, [rotated q, k], MLP tensors (c), norm statistics and log-sum-exp (f).
  double S = llama ? f * 2 * C + c * (8 * C + 4 * H) + f * (2 + nh) : f * 2 * C + c * (6 * C + 2 * H) + f * (4 + nh);
  if (plan.norm) S -= c * 2 * C + f * (llama ? 2 : 4);
  if (plan.mlp) S -= c * (llama ? 2 * H : H);
  if (plan.attention) S -= c * C + f * nh;
  e.block_bytes = S;
  e.head_bytes = f * C + 2 * c * C + (2 * f + c) * V;

  int64_t n_ckpt = 0, kept_blocks = 0, k_max = 0;
  for (const auto& s : plan.segments) {
    if (s.checkpointed) {
      ++n_ckpt;
      k_max = std::max(k_max, s.end - s.begin);
    } else {
      kept_blocks += s.end - s.begin;
    }
  }
  e.moment_a = e.head_bytes + f * C * static_cast<double>(n_ckpt) + S * static_cast<double>(kept_blocks);
  if (n_ckpt > 0) e.moment_b = f * C * static_cast<double>(n_ckpt - 1) + S * static_cast<double>(k_max) + f * C + c * (C + H);
  if (plan.mlp) e.moment_c = S * L + f * C + c * (C + 2 * H);
  const double peak = std::max({e.moment_a, e.moment_b, e.moment_c});
  // Under autocast the compute-dtype copies of the matmul weights (cached through the forward, then
  // kept by the linears that saved them) add one copy of those weights.
  if (c < f) e.weight_cast_bytes = static_cast<int64_t>(c * (L * (4 * C * C + (llama ? 3 : 2) * C * H) + V * C));
  e.peak_bytes = static_cast<int64_t>(peak * static_cast<double>(e.tokens)) + e.weight_cast_bytes;
  return e;
}

}  // namespace sl::memory
