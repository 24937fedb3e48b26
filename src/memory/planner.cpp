// Memory planner: model states + activation model + batch, largest micro-batch, the plan report.
#include "memory/planner.h"
#include "memory/staging.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "log/metrics.h"
#include "model/gpt.h"
#include "recompute/budget.h"
#include "recompute/policy.h"

namespace sl::memory {
namespace {

using Json = nlohmann::json;

// The modes `trainer plan` compares (the recipe's own first).
std::vector<std::pair<std::string, config::CheckpointingConfig>> plan_modes(const config::RunConfig& cfg) {
  std::vector<std::pair<std::string, config::CheckpointingConfig>> out;
  auto add = [&](const std::string& name, config::CheckpointingConfig c) { out.emplace_back(name, std::move(c)); };
  add("recipe (" + cfg.checkpointing.mode + ")", cfg.checkpointing);
  config::CheckpointingConfig c;
  c.skip_last = cfg.checkpointing.skip_last;
  c.mode = "none";
  add("none", c);
  c.mode = "full";
  add("full", c);
  c.mode = "sqrt";
  add("sqrt", c);
  c.mode = "selective";
  c.recompute = {"attention", "mlp", "norm"};
  add("selective [attention, mlp, norm]", c);
  return out;
}

}  // namespace

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
  if (cfg.parallel.sharding == "zero3") return largest_unit_params(cfg.model);
  return std::min(n, bucket_cap_params(cfg));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t dtype_bytes(const std::string& dtype) { return dtype == "fp32" ? 4 : 2; }

}  // namespace

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

// Everything but the activations.
PeakPrediction predict_states(const config::RunConfig& cfg) {
  PeakPrediction p;
  const int64_t n = total_params(cfg.model);
  const int64_t N = std::max<int64_t>(1, cfg.world_size);
  const auto& sh = cfg.parallel.sharding;
  const int64_t P = 4 * n, G = 4 * n, O = 8 * n;
  // A low-precision compute copy (precision.param_dtype): fp32 masters only in the shard; zero1/2 keep
  // the whole model in the compute dtype, zero3 gathers units in it; zero2/3 reduce in reduce_dtype.
  const int64_t cp = dtype_bytes(cfg.precision.param_dtype), cr = dtype_bytes(cfg.precision.reduce_dtype);
  p.params_bytes = sh == "zero3" ? P / N : cp < 4 ? P / N + cp * n : P;
  p.grads_bytes = sh == "zero2" || sh == "zero3" ? G / N : G;
  p.optimizer_bytes = sh == "none" ? O : O / N;
  if (sh == "zero2") {
    // One bucket's full gradient: it fills while the backward still holds activations. (Its
    // reduce-scatter output slice comes when the bucket is complete, after most of them are freed.)
    p.transient_bytes = std::min(cr * n, cr * bucket_cap_params(cfg));
  } else if (sh == "zero3") {  // the largest unit's gathered parameters and full gradient, and the next
    p.transient_bytes = (2 * cp + cr) * largest_unit_params(cfg.model);  // unit's, prefetched in backward
  }
  p.batch_bytes = 2 * 8 * cfg.train.micro_batch * cfg.train.seq_len;
  if (cfg.model.arch == "llama") p.buffer_bytes = 4 * cfg.model.max_seq_len * (cfg.model.n_embd / cfg.model.n_head);
  // AdamW updates the model's parameters (none) or this rank's shard of each group; the engine's
  // norm reads whole groups (none) or shards. World 1 without sharding has no engine.
  const int64_t group = largest_group_params(cfg, n), shard = ceil_div(group, N);
  p.adamw_temp_bytes = 2 * 4 * (sh == "none" ? largest_param(cfg.model) : shard);
  if (N > 1 || sh != "none") p.grad_norm_temp_bytes = 8 * std::min(kGradNormChunk, sh == "none" ? group : shard);
  p.host_staging_bytes = host_staging_bytes(4 * largest_param(cfg.model));  // fp32 masters and moments
  return p;
}

}  // namespace

PeakPrediction predict_peak(const config::RunConfig& cfg) {
  if (cfg.checkpointing.mode == "budget") return predict_peak(cfg, recompute::plan_for(cfg));
  PeakPrediction p = predict_states(cfg);
  p.activations = estimate_activation_peak(cfg);
  return p;
}

PeakPrediction predict_peak(const config::RunConfig& cfg, const recompute::Plan& plan) {
  PeakPrediction p = predict_states(cfg);
  p.activations = estimate_activation_peak(cfg, plan);
  return p;
}

int64_t activation_budget_bytes(const config::RunConfig& cfg) {
  const auto budget = config::parse_budget(cfg);
  const PeakPrediction p = predict_states(cfg);
  int64_t bytes = budget.bytes;
  if (budget.share > 0) {
    const int64_t room = config::memory_limit_bytes(cfg) - p.model_states_bytes() - p.buffer_bytes - p.batch_bytes;
    bytes = static_cast<int64_t>(budget.share * static_cast<double>(room));
  }
  return bytes - p.transient_bytes;
}

int64_t largest_micro_batch(const config::RunConfig& cfg, int64_t memory_bytes, int64_t cap) {
  auto fits = [&](int64_t b) {
    auto c = cfg;
    c.train.micro_batch = b;
    if (c.checkpointing.mode != "budget") return predict_peak(c).peak_bytes() <= memory_bytes;
    const auto plan = recompute::formula_plan(c);
    return plan && predict_peak(c, *plan).peak_bytes() <= memory_bytes;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = cap;  // fits(lo); find the largest
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

namespace {

// One row of the plan report: a mode's activation and total peak, and with memory_bytes the largest
// micro-batch. A budget mode also writes its schedule (or null: none fits) into the report.
Json mode_row(const std::string& name, const config::RunConfig& c, int64_t memory_bytes, int64_t per_rank, Json& report) {
  std::optional<recompute::Plan> schedule;
  if (c.checkpointing.mode == "budget") {
    schedule = recompute::formula_plan(c);
    report["budget_schedule"] = schedule ? schedule->to_json() : Json(nullptr);
    report["budget_bytes"] = activation_budget_bytes(c);
    if (!schedule) return {{"mode", name}, {"fits_budget", false}};
  }
  const auto p = schedule ? predict_peak(c, *schedule) : predict_peak(c);
  Json row = {{"mode", name}, {"activation_peak_bytes", p.activations.peak_bytes}, {"peak_bytes", p.peak_bytes()}};
  if (memory_bytes > 0) {
    const int64_t mb = largest_micro_batch(c, memory_bytes);
    row["largest_micro_batch"] = mb;
    row["grad_accum_for_global_batch"] = mb > 0 ? Json((per_rank + mb - 1) / mb) : Json(nullptr);
    row["fits_recipe_micro_batch"] = p.peak_bytes() <= memory_bytes;
  }
  return row;
}

}  // namespace

Json plan(const config::RunConfig& recipe, int64_t memory_bytes) {
  auto cfg = recipe;
  const bool auto_batch = cfg.train.micro_batch == 0;  // train.micro_batch: auto
  const int64_t world = std::max<int64_t>(1, cfg.world_size);
  // Sequences each rank contributes to one optimizer step.
  const int64_t per_rank = auto_batch ? (cfg.train.global_batch + world - 1) / world : cfg.train.micro_batch * cfg.train.grad_accum;
  const int64_t global = per_rank * world;
  if (auto_batch) {
    cfg.train.micro_batch = 1;
    cfg.train.micro_batch = std::max<int64_t>(1, memory_bytes > 0 ? largest_micro_batch(cfg, memory_bytes, per_rank) : 1);
    cfg.train.grad_accum = (per_rank + cfg.train.micro_batch - 1) / cfg.train.micro_batch;
  }
  // The breakdown's states, batch and kernels do not depend on the mode (a budget may fit nothing).
  auto base_cfg = cfg;
  if (cfg.checkpointing.mode == "budget") base_cfg.checkpointing = config::CheckpointingConfig{};
  const auto base = predict_peak(base_cfg);
  Json j = {{"recipe", cfg.recipe_name},
            {"params", total_params(cfg.model)},
            {"world_size", cfg.world_size},
            {"sharding", cfg.parallel.sharding},
            {"sharding_transient_bytes", base.transient_bytes},
            {"micro_batch", cfg.train.micro_batch},
            {"micro_batch_auto", auto_batch},
            {"grad_accum", cfg.train.grad_accum},
            {"global_batch", global},
            {"seq_len", cfg.train.seq_len},
            {"memory_bytes", memory_bytes > 0 ? Json(memory_bytes) : Json(nullptr)},
            {"params_bytes", base.params_bytes},
            {"grads_bytes", base.grads_bytes},
            {"optimizer_state_bytes", base.optimizer_bytes},
            {"model_states_bytes", base.model_states_bytes()},
            {"batch_bytes", base.batch_bytes},
            {"logits_and_loss_bytes", static_cast<int64_t>(base.activations.tokens * 4 * 3 * cfg.model.vocab_size)},
            {"buffers_bytes", base.buffer_bytes},
            {"optimizer_step_temp_bytes", base.optimizer_phase_bytes()},
            {"host_staging_bytes", base.host_staging_bytes},
            {"matmul_path", base.activations.matmul_path},
            {"precision", cfg.precision.compute},
            {"param_dtype", cfg.precision.param_dtype},
            {"reduce_dtype", cfg.precision.reduce_dtype},
            {"modes", Json::array()}};
  for (const auto& [name, ck] : plan_modes(cfg)) {
    auto c = cfg;
    c.checkpointing = ck;
    j["modes"].push_back(mode_row(name, c, memory_bytes, per_rank, j));
  }
  return j;
}

namespace {

std::string weights_label(const std::string& param_dtype, const std::string& sharding) {
  if (param_dtype == "fp32") return "weights (fp32)";
  if (sharding == "zero3") return fmt::format("weights (fp32 master shard; gathered in {})", param_dtype);
  return fmt::format("weights (fp32 master shard + {} copy)", param_dtype);
}

}  // namespace

std::string format_plan(const Json& j) {
  auto bytes = [](const Json& v) { return log::format_bytes(v.get<int64_t>()); };
  std::vector<std::pair<std::string, std::string>> rows = {
      {"parameters", fmt::format("{} ({:.3g} B)", j["params"].get<int64_t>(), j["params"].get<double>() / 1e9)},
      {"ranks x sharding", fmt::format("{} x {} (figures below are per rank)", j["world_size"].get<int64_t>(),
                                       j["sharding"].get<std::string>())},
      {weights_label(j.value("param_dtype", "fp32"), j["sharding"].get<std::string>()), bytes(j["params_bytes"])},
      {j.value("reduce_dtype", "fp32") == "fp32" ? std::string("gradients (fp32)")
                                                 : fmt::format("gradients (fp32; reduce-scattered in {})", j.value("reduce_dtype", "fp32")),
       bytes(j["grads_bytes"])},
      {"AdamW moments (fp32)", bytes(j["optimizer_state_bytes"])},
      {"model states", bytes(j["model_states_bytes"])},
      {"gathered parameters / unreduced gradients", bytes(j["sharding_transient_bytes"])},
      {"input batch", bytes(j["batch_bytes"])},
      {"logits and loss buffers (in activations)", bytes(j["logits_and_loss_bytes"])},
      {"optimizer step temporaries (after backward)", bytes(j["optimizer_step_temp_bytes"])},
      {"host staging of a save (GPU runs; host RAM)", bytes(j["host_staging_bytes"])},
      {"matmul kernels (activation model)", j["matmul_path"].get<std::string>()},
      {"micro-batch x seq_len", fmt::format("{} x {} (global batch {})", j["micro_batch"].get<int64_t>(),
                                            j["seq_len"].get<int64_t>(), j["global_batch"].get<int64_t>())},
  };
  std::string out = log::format_table(rows);
  const bool with_memory = !j["memory_bytes"].is_null();
  out += with_memory ? fmt::format("\nPer checkpointing mode, against {}:\n", bytes(j["memory_bytes"]))
                     : std::string("\nPer checkpointing mode (give --memory SIZE for the largest micro-batch):\n");
  std::vector<std::pair<std::string, std::string>> modes;
  for (const auto& m : j["modes"]) {
    if (!m.contains("activation_peak_bytes")) {
      modes.emplace_back(m["mode"].get<std::string>(),
                         fmt::format("no schedule fits checkpointing.budget ({} of activations)", bytes(j["budget_bytes"])));
      continue;
    }
    std::string v = fmt::format("activations {:>10} | peak {:>10}", bytes(m["activation_peak_bytes"]), bytes(m["peak_bytes"]));
    if (with_memory) {
      const int64_t mb = m["largest_micro_batch"].get<int64_t>();
      v += mb > 0 ? fmt::format(" | largest micro-batch {} (grad_accum {})", mb, m["grad_accum_for_global_batch"].get<int64_t>())
                  : std::string(" | does not fit at micro-batch 1");
    }
    modes.emplace_back(m["mode"].get<std::string>(), v);
  }
  out += log::format_table(modes);
  if (j.contains("budget_schedule") && !j["budget_schedule"].is_null()) {
    const auto& b = j["budget_schedule"];
    out += fmt::format("Budget schedule ({} of activations, formula costs: recompute {:.3g} of {:.3g} GFLOP a forward; "
                       "solved in {:.0f} ms):\n",
                       bytes(b["budget"]["budget_bytes"]), b["budget"]["recompute_cost"].get<double>(),
                       b["budget"]["forward_cost"].get<double>(), b["budget"]["solve_ms"].get<double>());
    for (const auto& blk : b["blocks"]) {
      std::string parts;
      for (const auto& p : blk["parts"]) parts += (parts.empty() ? " [" : ", ") + p.get<std::string>();
      const auto& seg = blk["segment"];
      out += fmt::format("  block {:>3}: {}{}{}\n", blk["block"].get<int64_t>(), blk["choice"].get<std::string>(),
                         parts.empty() ? "" : parts + "]",
                         blk["choice"] == "recompute" ? fmt::format(" (segment of blocks {}..{})", seg[0].get<int64_t>(),
                                                                    seg[1].get<int64_t>() - 1)
                                                      : std::string());
    }
  }
  if (with_memory && j["model_states_bytes"].get<int64_t>() > j["memory_bytes"].get<int64_t>())
    out += fmt::format("Model states alone ({}) exceed {}: no checkpointing mode can fit; this needs more ranks "
                       "with parallel.sharding (zero3 divides all three states by the world size) or lower precision.\n",
                       bytes(j["model_states_bytes"]), bytes(j["memory_bytes"]));
  return out;
}

std::string oom_advice(const config::RunConfig& cfg, int64_t limit_bytes) {
  if (limit_bytes <= 0) return "lower train.micro_batch (raise train.grad_accum to keep the global batch) or enable checkpointing.mode: full";
  const int64_t per_rank = cfg.train.micro_batch * cfg.train.grad_accum;  // sequences per rank per step
  std::string out;
  for (const auto& [name, ck] : plan_modes(cfg)) {
    auto c = cfg;
    c.checkpointing = ck;
    const int64_t mb = largest_micro_batch(c, limit_bytes);
    if (mb == 0) continue;
    out += fmt::format("{}{}: micro_batch {} with grad_accum {}", out.empty() ? "" : "; ", name, mb, (per_rank + mb - 1) / mb);
  }
  if (out.empty())
    return fmt::format("the planner predicts nothing fits {} (model states alone: {}); shard or lower precision",
                       log::format_bytes(limit_bytes), log::format_bytes(predict_states(cfg).model_states_bytes()));
  return "the planner predicts these fit " + log::format_bytes(limit_bytes) + ": " + out +
         " (set train.micro_batch / train.grad_accum / checkpointing.mode accordingly)";
}

}  // namespace sl::memory
