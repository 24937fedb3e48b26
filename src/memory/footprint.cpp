// A step's memory footprint: parameter counts, model states per sharding stage, a plan's whole peak.
#include "memory/footprint.h"

#include <variant>

#include <torch/torch.h>

#include "device/staging.h"
#include "model/gpt.h"

namespace sl::memory {
namespace {

// Saturating arithmetic for the parameter formulas (kMaxParams caps every count).
int64_t sat_add(int64_t a, int64_t b) { return std::min(kMaxParams, a + b); }  // a, b <= kMaxParams
int64_t sat_mul(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  return a > kMaxParams / b ? kMaxParams : std::min(kMaxParams, a * b);
}

struct Dims {
  int64_t C, H, V, T;  // n_embd, mlp_hidden (of one block), vocab_size, max_seq_len
  bool llama, bias, tied;
};

Dims dims_of(const config::ModelConfig& m, int64_t layer = 0) {
  const bool llama = m.arch == "llama";
  return {m.n_embd, config::mlp_hidden(m, layer), m.vocab_size, m.max_seq_len, llama, m.bias && !llama, m.tie_embeddings};
}

// model/gpt.cpp's parameter set, unit by unit.
int64_t embedding_params(const Dims& d) { return sat_add(sat_mul(d.V, d.C), d.llama ? 0 : sat_mul(d.T, d.C)); }

int64_t block_params(const Dims& d) {
  // ln1_w, ln2_w; w_qkv 3C x C, w_proj C x C; w_fc (H or 2H for SwiGLU) x C, w_out C x H.
  int64_t n = sat_add(2 * d.C, sat_mul(4 * d.C, d.C));
  n = sat_add(n, sat_mul((d.llama ? 3 : 2) * d.H, d.C));
  // ln1_b, ln2_b, b_qkv 3C, b_proj C, b_fc H, b_out C.
  if (d.bias) n = sat_add(n, 7 * d.C + d.H);
  return n;
}

int64_t head_params(const Dims& d) { return sat_add(d.bias ? 2 * d.C : d.C, d.tied ? 0 : sat_mul(d.V, d.C)); }

// The blocks' parameters: n_layer times one block's, or with per-block MLP sizes their sum (O(n_layer)).
int64_t all_block_params(const config::ModelConfig& m) {
  if (config::uniform_blocks(m)) return sat_mul(m.n_layer, block_params(dims_of(m)));
  int64_t n = 0;
  for (int64_t l = 0; l < m.n_layer; ++l) n = sat_add(n, block_params(dims_of(m, l)));
  return n;
}

// The largest MLP inner size of any block.
int64_t widest_mlp(const config::ModelConfig& m) {
  int64_t h = config::mlp_hidden(m);
  if (!config::uniform_blocks(m))
    for (int64_t l = 0; l < m.n_layer; ++l) h = std::max(h, config::mlp_hidden(m, l));
  return h;
}

// The largest flat group the engine forms: a unit under zero3, else a gradient bucket.
int64_t largest_group_params(const config::RunConfig& cfg, int64_t n) {
  if (cfg.parallel.sharding.shards_params()) return largest_unit_params(cfg.model);
  return std::min(n, bucket_cap_params(cfg));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t dtype_bytes(const std::string& dtype) { return dtype == "fp32" ? 4 : 2; }

int64_t total_params(const config::ModelConfig& m) {
  const Dims d = dims_of(m);
  return sat_add(sat_add(embedding_params(d), all_block_params(m)), head_params(d));
}

int64_t largest_unit_params(const config::ModelConfig& m) {
  Dims d = dims_of(m);
  d.H = widest_mlp(m);
  return std::max({embedding_params(d), m.n_layer > 0 ? block_params(d) : 0, head_params(d)});
}

int64_t largest_param(const config::ModelConfig& m) {
  Dims d = dims_of(m);
  d.H = widest_mlp(m);
  return std::max({sat_mul(d.V, d.C), d.llama ? 0 : sat_mul(d.T, d.C), sat_mul(3 * d.C, d.C),
                   sat_mul((d.llama ? 2 : 1) * d.H, d.C)});
}

int64_t bucket_cap_params(const config::RunConfig& cfg) {
  const auto cap = static_cast<int64_t>(cfg.parallel.bucket_mb * 1024 * 1024) / 4;
  return std::max(cap, largest_param(cfg.model));  // a bigger single tensor gets its own bucket
}

std::vector<int64_t> unit_param_counts(const config::ModelConfig& m) {
  torch::NoGradGuard no_grad;
  model::GPT g(m, torch::kMeta);
  std::vector<int64_t> units;
  for (const auto& unit : g->units()) {
    int64_t n = 0;
    for (const auto& p : unit) n += p.tensor.numel();
    units.push_back(n);
  }
  return units;
}

namespace {

// Where the engine's gradients are CPU tensors (the CPU device, or offload.gradients' host shards), its
// norm is one fused float64 pass with no copy (optim::sum_of_squares); on CUDA float64 copies of
// kGradNormChunk elements at a time. (The lazy test device runs at world 1 without sharding: no engine.)
bool engine_grads_on_cpu(const config::RunConfig& cfg) { return cfg.offload.gradients || !runs_on_cuda(cfg); }

// offload.*: the terms the engine keeps on the host instead (parallel/engine.cpp, state_bytes).
void place_offloaded(const config::RunConfig& cfg, PeakPrediction& p) {
  const auto& o = cfg.offload;
  if (!o.optimizer) return;
  const int64_t n = total_params(cfg.model);
  const config::Sharding sh = cfg.parallel.sharding;
  const int64_t N = sh.replicated() ? 1 : std::max<int64_t>(1, cfg.world_size);  // DDP: each rank the whole model
  const int64_t cp = dtype_bytes(cfg.precision.param_dtype);
  p.host_params_bytes = 4 * n / N;
  p.params_bytes = sh.shards_params() ? 0 : cp * n;  // zero1/2: the whole model in the compute dtype for the all-gather
  p.host_optimizer_bytes = p.optimizer_bytes;
  p.optimizer_bytes = 0;
  p.host_grads_bytes = 4 * n / N;  // the shard itself (offload.gradients) or the host AdamW's copy of it
  if (o.gradients) p.grads_bytes = 0;
  // The host AdamW is the fused CPU kernel (optim/optimizer.h): in place, no temporaries; the norm of
  // host gradients (offload.gradients) is a CPU pass without a copy (engine_grads_on_cpu).
  p.adamw_temp_bytes = 0;
}

}  // namespace

PeakPrediction predict_states(const config::RunConfig& cfg) {
  PeakPrediction p;
  const int64_t n = total_params(cfg.model);
  const int64_t N = std::max<int64_t>(1, cfg.world_size);
  const config::Sharding sh = cfg.parallel.sharding;
  const int64_t P = 4 * n, G = 4 * n, O = 8 * n;
  // A low-precision compute copy (precision.param_dtype): fp32 masters only in the shard; zero1/2 keep
  // the whole model in the compute dtype, zero3 gathers units in it; zero2/3 reduce in reduce_dtype.
  const int64_t cp = dtype_bytes(cfg.precision.param_dtype), cr = dtype_bytes(cfg.precision.reduce_dtype);
  p.params_bytes = sh.shards_params() ? P / N : cp < 4 ? P / N + cp * n : P;
  p.grads_bytes = sh.shards_grads() ? G / N : G;
  p.optimizer_bytes = sh.shards_optimizer() ? O / N : O;
  if (sh == config::Sharding::kZero2) {
    // One bucket's full gradient: it fills while the backward still holds activations. (Its
    // reduce-scatter output slice comes when the bucket is complete, after most of them are freed.)
    p.transient_bytes = std::min(cr * n, cr * bucket_cap_params(cfg));
  } else if (sh.shards_params()) {  // the largest unit's gathered parameters and full gradient, and the next
    p.transient_bytes = (2 * cp + cr) * largest_unit_params(cfg.model);  // unit's, prefetched in backward
  }
  p.batch_bytes = 2 * 8 * cfg.train.micro_batch * cfg.train.seq_len;
  if (cfg.model.arch == "llama") p.buffer_bytes = 4 * cfg.model.max_seq_len * (cfg.model.n_embd / cfg.model.n_head);
  // AdamW updates the model's parameters (none) or this rank's shard of each group; the engine's
  // norm reads whole groups (none) or shards. World 1 without sharding has no engine.
  const int64_t group = largest_group_params(cfg, n), shard = ceil_div(group, N);
  p.adamw_temp_bytes = 2 * 4 * (sh.replicated() ? largest_param(cfg.model) : shard);
  if ((N > 1 || !sh.replicated()) && !engine_grads_on_cpu(cfg))
    p.grad_norm_temp_bytes = 8 * std::min(kGradNormChunk, sh.replicated() ? group : shard);
  p.host_staging_bytes = device::host_staging_bytes(4 * largest_param(cfg.model));  // fp32 masters and moments
  if (cfg.state.async && cfg.state.every > 0) p.host_snapshot_bytes = 12 * (sh.replicated() ? n : ceil_div(n, N));
  place_offloaded(cfg, p);
  return p;
}

PeakPrediction predict_peak(const config::RunConfig& cfg, const checkpointing::Plan& plan) {
  PeakPrediction p = predict_states(cfg);
  p.activations = estimate_activation_peak(cfg, plan);
  return p;
}

int64_t activation_budget_bytes(const config::RunConfig& cfg) {
  const config::Budget budget = std::get<config::mode::Budget>(config::choice(cfg.checkpointing));  // mode budget only
  const PeakPrediction p = predict_states(cfg);
  int64_t bytes = budget.bytes;
  if (budget.share > 0) {
    const int64_t room = config::memory_limit_bytes(cfg) - p.model_states_bytes() - p.buffer_bytes - p.batch_bytes;
    bytes = static_cast<int64_t>(budget.share * static_cast<double>(room));
  }
  return bytes - p.transient_bytes;
}

}  // namespace sl::memory
