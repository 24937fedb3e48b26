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

  ActivationEstimate e;
  e.tokens = cfg.train.micro_batch * cfg.train.seq_len;
  double S = llama ? 10 * C + 4 * H + 2 + nh : 8 * C + 2 * H + 4 + nh;
  if (plan.norm) S -= 2 * C + (llama ? 2 : 4);
  if (plan.mlp) S -= llama ? 2 * H : H;
  if (plan.attention) S -= C + nh;
  e.block_elems = S;
  e.head_elems = 3 * C + 3 * V;

  int64_t n_ckpt = 0, kept_blocks = 0, k_max = 0;
  for (const auto& s : plan.segments) {
    if (s.checkpointed) {
      ++n_ckpt;
      k_max = std::max(k_max, s.end - s.begin);
    } else {
      kept_blocks += s.end - s.begin;
    }
  }
  e.moment_a = e.head_elems + C * static_cast<double>(n_ckpt) + S * static_cast<double>(kept_blocks);
  if (n_ckpt > 0) e.moment_b = C * static_cast<double>(n_ckpt - 1) + S * static_cast<double>(k_max) + 2 * C + H;
  if (plan.mlp) e.moment_c = S * L + 2 * C + 2 * H;
  const double peak = std::max({e.moment_a, e.moment_b, e.moment_c});
  e.peak_bytes = static_cast<int64_t>(peak * static_cast<double>(e.tokens) * 4.0);
  return e;
}

}  // namespace sl::memory
