// The planner: a recipe's predicted peak in its own checkpointing mode (a budget schedule solved with
// formula costs), the largest micro-batch that fits, the `trainer plan` report, the OOM advice.
#include "predict/planner.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "predict/budget.h"
#include "recompute/plan.h"
#include "log/metrics.h"

namespace sl::planner {
namespace {

using Json = nlohmann::json;
using memory::PeakPrediction;
using memory::Scenario;
using budget::kModelledMfu;

// The modes `trainer plan` compares (the recipe's own first).
std::vector<std::pair<std::string, config::CheckpointingConfig>> plan_modes(const config::CheckpointingConfig& recipe) {
  std::vector<std::pair<std::string, config::CheckpointingConfig>> out;
  auto add = [&](const std::string& name, config::CheckpointingConfig c) { out.emplace_back(name, std::move(c)); };
  add(fmt::format("recipe ({})", recipe.mode.name()), recipe);
  config::CheckpointingConfig c;
  c.skip_last = recipe.skip_last;
  c.mode = config::CheckpointingMode::kNone;
  add("none", c);
  c.mode = config::CheckpointingMode::kFull;
  add("full", c);
  c.mode = config::CheckpointingMode::kSqrt;
  add("sqrt", c);
  c.mode = config::CheckpointingMode::kSelective;
  c.recompute = {"attention", "mlp", "norm"};
  add("selective [attention, mlp, norm]", c);
  return out;
}

// Sequences each data-parallel rank (with its sequence group) contributes to one optimizer step:
// micro_batch x grad_accum, or with train.micro_batch: auto its share of train.global_batch.
int64_t sequences_per_rank(const config::TrainConfig& train, const layout::Mesh& mesh) {
  if (train.micro_batch.is_auto()) return mesh.sequences_per_rank(train.global_batch);
  return train.micro_batch * train.grad_accum;
}

}  // namespace

PeakPrediction predict_peak(const Scenario& sc) {
  if (sc.checkpointing.mode.solved()) return memory::predict_peak(sc, budget::plan_for(sc));
  PeakPrediction p = memory::predict_states(sc);
  p.activations = memory::estimate_activation_peak(sc);
  return p;
}

namespace {

// Parameters of the blocks a plan recomputes (each runs its forward once more in backward).
int64_t recomputed_params(const std::vector<int64_t>& units, const recompute::Plan& plan) {
  int64_t n = 0;
  for (const auto& seg : plan.segments)
    if (seg.checkpointed)
      for (int64_t b = seg.begin; b < seg.end; ++b) n += units[static_cast<size_t>(b + 1)];
  return n;
}

// Bytes zero3 gathers per micro-batch (before dividing by the world size): see OffloadTraffic.
int64_t gathered_params(const config::ModelConfig& m, const std::vector<int64_t>& units, int64_t recomputed) {
  int64_t n = 0;
  for (int64_t u : units) n += u;
  const int64_t emb = units.front();
  return 2 * n - emb + (m.tie_embeddings ? 2 * emb : 0) + recomputed;
}

// The model FLOPs of one optimizer step on this rank: 6 N + 12 L T d per token of its B T / N tokens
// (parallel.sequence: its attention covers the whole sequence for n_head / N heads, the same FLOPs per
// local token as unsharded), plus the recomputed blocks' forward (2 per parameter and token).
double step_flops(const Scenario& sc, const recompute::Plan& plan) {
  const auto& m = sc.model;
  const int64_t n = sc.shape().total_params();
  const int64_t recomputed = recomputed_params(memory::unit_param_counts(m), plan);
  const double tokens = static_cast<double>(sc.local_tokens() * sc.grad_accum);
  return tokens * (6.0 * static_cast<double>(n) + 2.0 * static_cast<double>(recomputed) +
                   12.0 * static_cast<double>(m.n_layer * sc.seq_len * m.n_embd));
}

}  // namespace

StepTime modelled_step(const Scenario& sc, const recompute::Plan& plan) {
  StepTime t;
  if (sc.peak_tflops > 0) t.compute_s = step_flops(sc, plan) / (sc.peak_tflops * 1e12 * kModelledMfu);
  const auto a = memory::estimate_activation_peak(sc, plan);
  t.all_to_all_bytes = a.all_to_all_bytes * sc.grad_accum;
  t.all_to_all_s = static_cast<double>(t.all_to_all_bytes) / (sc.all_to_all_gbps * 1e9);
  t.step_s = t.compute_s + t.all_to_all_s;
  return t;
}

OffloadTraffic offload_traffic(const Scenario& sc, const recompute::Plan& plan) {
  OffloadTraffic t;
  const auto& o = sc.placement.offload;
  if (!o.any()) return t;
  // DDP: the whole model
  const auto N = sc.placement.sharding.replicated() ? 1 : std::max<int64_t>(1, sc.placement.world);
  const int64_t micro = sc.grad_accum, n = sc.shape().total_params();
  const int64_t cp = sc.precision.param_dtype.bytes(), cr = sc.precision.reduce_dtype.bytes();
  const auto units = memory::unit_param_counts(sc.model);
  const int64_t recomputed = recomputed_params(units, plan);
  int64_t boundary = 0;
  if (o.optimizer && !o.gradients) t.to_host_bytes += 4 * n / N, boundary += 4 * n / N;
  if (o.gradients) t.streamed_to_host_bytes += micro * cr * n / N;
  if (o.parameters) t.streamed_to_device_bytes += micro * cp * gathered_params(sc.model, units, recomputed) / N;
  else if (o.optimizer) t.to_device_bytes += cp * n / N, boundary += cp * n / N;
  if (o.activations) {
    const int64_t inputs = micro * memory::estimate_activation_peak(sc, plan).host_bytes;
    t.streamed_to_host_bytes += inputs, t.streamed_to_device_bytes += inputs;
  }
  t.to_host_bytes += t.streamed_to_host_bytes;
  t.to_device_bytes += t.streamed_to_device_bytes;
  const double bw = o.bandwidth_gbps * 1e9;
  t.streamed_s = static_cast<double>(std::max(t.streamed_to_host_bytes, t.streamed_to_device_bytes)) / bw;
  t.boundary_s = static_cast<double>(boundary) / bw;
  if (o.optimizer) t.host_adam_s = 28.0 * static_cast<double>(n) / static_cast<double>(N) / (o.host_gbps * 1e9);
  if (sc.peak_tflops > 0) t.compute_s = step_flops(sc, plan) / (sc.peak_tflops * 1e12 * kModelledMfu);
  t.exposed_s = t.boundary_s + t.streamed_s - std::min(o.overlap * t.streamed_s, t.compute_s);
  t.step_s = t.compute_s + t.exposed_s + t.host_adam_s;
  return t;
}

int64_t largest_micro_batch(const Scenario& sc, int64_t memory_bytes, int64_t cap) {
  auto fits = [&](int64_t b) {
    Scenario c = sc;
    c.micro_batch = b;
    if (!c.checkpointing.mode.solved()) return predict_peak(c).peak_bytes() <= memory_bytes;
    const auto plan = budget::formula_plan(c);
    return plan && memory::predict_peak(c, *plan).peak_bytes() <= memory_bytes;
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
Json mode_row(const std::string& name, const Scenario& c, int64_t memory_bytes, int64_t per_rank, Json& report) {
  std::optional<recompute::Plan> schedule;
  if (c.checkpointing.mode.solved()) {
    schedule = budget::formula_plan(c);
    report["budget_schedule"] = schedule ? schedule->to_json() : Json(nullptr);
    report["budget_bytes"] = memory::activation_budget_bytes(c);
    if (!schedule) return {{"mode", name}, {"fits_budget", false}};
  }
  const auto p = schedule ? memory::predict_peak(c, *schedule) : predict_peak(c);
  Json row = {{"mode", name}, {"activation_peak_bytes", p.activations.peak_bytes}, {"peak_bytes", p.peak_bytes()}};
  // parallel.sequence: what this rank sends in its sequence group's all-to-alls per optimizer step.
  row["all_to_all_bytes_per_step"] = p.activations.all_to_all_bytes * c.grad_accum;
  if (schedule || !c.checkpointing.mode.solved()) {
    const auto t = modelled_step(c, schedule ? *schedule : budget::plan_for(c));
    row["all_to_all_s"] = t.all_to_all_s;
    row["step_s"] = c.peak_tflops > 0 ? Json(t.step_s) : Json(nullptr);
  }
  if (memory_bytes > 0) {
    const int64_t mb = largest_micro_batch(c, memory_bytes);
    row["largest_micro_batch"] = mb;
    row["grad_accum_for_global_batch"] = mb > 0 ? Json((per_rank + mb - 1) / mb) : Json(nullptr);
    row["fits_recipe_micro_batch"] = p.peak_bytes() <= memory_bytes;
  }
  return row;
}

}  // namespace

namespace {

// The recipe's placement: device and host peaks in its own checkpointing mode, what moves per step,
// and the modelled step time (null when its budget fits no schedule).
Json offload_report(const Scenario& sc) {
  const auto& o = sc.placement.offload;
  const auto plan = budget::try_plan_for(sc);
  if (!plan) return nullptr;
  const PeakPrediction p = memory::predict_peak(sc, *plan);
  const OffloadTraffic t = offload_traffic(sc, *plan);
  return {{"optimizer", o.optimizer},
          {"gradients", o.gradients},
          {"parameters", o.parameters},
          {"activations", o.activations},
          {"device_peak_bytes", p.peak_bytes()},
          {"host_params_bytes", p.host_params_bytes},
          {"host_grads_bytes", p.host_grads_bytes},
          {"host_optimizer_bytes", p.host_optimizer_bytes},
          {"host_activation_bytes", p.activations.host_bytes},
          {"host_optimizer_temp_bytes", p.host_optimizer_temp_bytes},
          {"host_snapshot_bytes", p.host_snapshot_bytes},
          {"host_peak_bytes", p.host_peak_bytes()},
          {"to_host_bytes_per_step", t.to_host_bytes},
          {"to_device_bytes_per_step", t.to_device_bytes},
          {"bandwidth_gbps", o.bandwidth_gbps},
          {"overlap", o.overlap},
          {"transfer_s", t.streamed_s + t.boundary_s},
          {"exposed_transfer_s", t.exposed_s},
          {"host_adamw_s", t.host_adam_s},
          {"compute_s", sc.peak_tflops > 0 ? Json(t.compute_s) : Json(nullptr)},
          {"step_s", t.step_s},
          {"peak_tflops", sc.peak_tflops},
          {"modelled_mfu", kModelledMfu}};
}

}  // namespace

Json plan(const config::RunConfig& recipe, int64_t memory_bytes) {
  const bool auto_batch = recipe.train.micro_batch.is_auto();
  const int64_t per_rank = sequences_per_rank(recipe.train, recipe.mesh());
  const int64_t global = recipe.mesh().global_batch(per_rank, 1);
  Scenario sc = Scenario::of(recipe);
  if (auto_batch) {
    sc.micro_batch = std::max<int64_t>(1, memory_bytes > 0 ? largest_micro_batch(sc, memory_bytes, per_rank) : 1);
    sc.grad_accum = (per_rank + sc.micro_batch - 1) / sc.micro_batch;
  }
  // The breakdown's states, batch and kernels do not depend on the mode (a budget may fit nothing).
  Scenario base_sc = sc;
  if (sc.checkpointing.mode.solved()) base_sc.checkpointing = config::CheckpointingConfig{};
  const auto base = predict_peak(base_sc);
  Json j = {{"recipe", recipe.recipe_name},
            {"params", sc.shape().total_params()},
            {"padding_params", sc.shape().padding_params()},
            {"trained_params", sc.shape().trained_params()},
            {"lora_base_dtype", sc.model.lora.enabled() ? Json(sc.model.lora.base_dtype) : Json(nullptr)},
            {"world_size", recipe.world_size},
            {"sharding", sc.placement.sharding},
            {"sharding_transient_bytes", base.transient_bytes},
            {"micro_batch", sc.micro_batch},
            {"micro_batch_auto", auto_batch},
            {"grad_accum", sc.grad_accum},
            {"global_batch", global},
            {"seq_len", sc.seq_len},
            {"sequence_parallel", sc.sequence},
            {"memory_bytes", memory_bytes > 0 ? Json(memory_bytes) : Json(nullptr)},
            {"params_bytes", base.params_bytes},
            {"grads_bytes", base.grads_bytes},
            {"optimizer_in_backward", sc.in_backward},
            {"packing_bytes", base.activations.packing_bytes},
            {"optimizer_state_bytes", base.optimizer_bytes},
            {"model_states_bytes", base.model_states_bytes()},
            {"batch_bytes", base.batch_bytes},
            {"loss_bytes", base.activations.loss_bytes},
            {"buffers_bytes", base.buffer_bytes},
            {"optimizer_step_temp_bytes", base.optimizer_phase_bytes()},
            {"host_staging_bytes", base.host_staging_bytes},
            {"host_snapshot_bytes", base.host_snapshot_bytes},
            {"matmul_path", base.activations.matmul_path},
            {"precision", sc.precision.compute},
            {"param_dtype", sc.precision.param_dtype},
            {"reduce_dtype", sc.precision.reduce_dtype},
            {"modes", Json::array()}};
  for (const auto& [name, ck] : plan_modes(sc.checkpointing)) {
    Scenario c = sc;
    c.checkpointing = ck;
    j["modes"].push_back(mode_row(name, c, memory_bytes, per_rank, j));
  }
  if (sc.placement.offload.any()) j["offload"] = offload_report(sc);
  return j;
}

namespace {

// A dtype plan.json records (precision.param_dtype, reduce_dtype); fp32 where it has none.
config::Dtype dtype_in(const Json& j, const char* key) {
  return config::Dtype::parse(j.value(key, std::string())).value_or(config::Dtype::kFp32);
}

std::string weights_label(config::Dtype param_dtype, const std::string& sharding, bool masters_on_host,
                          const Json& lora_base) {
  const auto fp32 = config::Dtype::kFp32;
  if (!lora_base.is_null())  // model.lora: the frozen base whole, the adapters as any model's weights
    return fmt::format("weights (frozen base in {}; fp32 adapters)", lora_base.get<std::string>());
  if (masters_on_host)
    return param_dtype == fp32 ? "weights (fp32 copy; masters on the host)"
                               : fmt::format("weights ({} copy; fp32 masters on the host)", param_dtype.name());
  if (param_dtype == fp32) return "weights (fp32)";
  if (config::Sharding::parse(sharding).value_or(config::Sharding::kNone).shards_params())
    return fmt::format("weights (fp32 master shard; gathered in {})", param_dtype.name());
  return fmt::format("weights (fp32 master shard + {} copy)", param_dtype.name());
}

}  // namespace

namespace {

std::string bytes(const Json& v) { return log::format_bytes(v.get<int64_t>()); }

// "N (x B)", and the vocabulary padding's share of them when the model has one (model.vocab_multiple).
std::string parameters_text(const Json& j) {
  const auto n = j["params"].get<int64_t>(), padding = j.value("padding_params", int64_t{0});
  std::string all = fmt::format("{} ({:.3g} B)", n, static_cast<double>(n) / 1e9);
  const auto trained = j.value("trained_params", n);
  if (trained < n) all += fmt::format(", {} of them trained (model.lora's adapters)", trained);
  return padding == 0 ? all : fmt::format("{}, {} of them the vocabulary padding's zero rows", all, padding);
}

// parallel.sequence > 1: the degree and the positions each rank holds (no row at degree 1).
void add_sequence_row(const Json& j, std::vector<std::pair<std::string, std::string>>& rows) {
  const auto n = j.value("sequence_parallel", int64_t{1});
  if (n <= 1) return;
  rows.emplace_back("sequence parallel (parallel.sequence)",
                    fmt::format("{} ({} positions per rank; attention over all of them for n_head / {} heads)", n,
                                j["seq_len"].get<int64_t>() / n, n));
}

// The breakdown of the model states, batch and buffers (the same for every mode).
// The gradients' row: fp32, reduce-scattered in reduce_dtype, or none held (optim.in_backward).
std::string gradients_label(const Json& j) {
  if (j["optimizer_in_backward"].get<bool>()) return "gradients (none held: optim.in_backward)";
  if (!j.value("lora_base_dtype", Json()).is_null()) return "gradients (fp32; the adapters' only)";
  if (dtype_in(j, "reduce_dtype") == config::Dtype::kFp32) return "gradients (fp32)";
  return fmt::format("gradients (fp32; reduce-scattered in {})", dtype_in(j, "reduce_dtype").name());
}

std::string breakdown_table(const Json& j) {
  std::vector<std::pair<std::string, std::string>> rows = {
      {"parameters", parameters_text(j)},
      {"ranks x sharding", fmt::format("{} x {} (figures below are per rank)", j["world_size"].get<int64_t>(),
                                       j["sharding"].get<std::string>())},
      {weights_label(dtype_in(j, "param_dtype"), j["sharding"].get<std::string>(),
                     j.contains("offload") && !j["offload"].is_null() && j["offload"]["optimizer"].get<bool>(),
                     j.value("lora_base_dtype", Json())),
       bytes(j["params_bytes"])},
      {gradients_label(j), bytes(j["grads_bytes"])},
      {j.value("lora_base_dtype", Json()).is_null() ? "AdamW moments (fp32)"
                                                    : "AdamW moments (fp32; the adapters' only)",
       bytes(j["optimizer_state_bytes"])},
      {j.contains("offload") ? "model states on the device (host part below)" : "model states",
       bytes(j["model_states_bytes"])},
      {"gathered parameters / unreduced gradients", bytes(j["sharding_transient_bytes"])},
      {"input batch", bytes(j["batch_bytes"])},
      {"packed rows' attention mask and positions (in activations)", bytes(j["packing_bytes"])},
      {"fused LM head and loss, at its peak (in activations)", bytes(j["loss_bytes"])},
      {"optimizer step temporaries (after backward)", bytes(j["optimizer_step_temp_bytes"])},
      {"host staging of a save (GPU runs; host RAM)", bytes(j["host_staging_bytes"])},
      {"host snapshot of an asynchronous save (state.async; host RAM)", bytes(j["host_snapshot_bytes"])},
      {"matmul kernels (activation model)", j["matmul_path"].get<std::string>()},
      {"micro-batch x seq_len", fmt::format("{} x {} (global batch {})", j["micro_batch"].get<int64_t>(),
                                            j["seq_len"].get<int64_t>(), j["global_batch"].get<int64_t>())},
  };
  add_sequence_row(j, rows);
  return log::format_table(rows);
}

// One row per mode: activation and total peak, and against --memory the largest micro-batch.
std::string modes_table(const Json& j, bool with_memory) {
  std::vector<std::pair<std::string, std::string>> modes;
  for (const auto& m : j["modes"]) {
    if (!m.contains("activation_peak_bytes")) {
      modes.emplace_back(
          m["mode"].get<std::string>(),
          fmt::format("no schedule fits checkpointing.budget ({} of activations)", bytes(j["budget_bytes"])));
      continue;
    }
    std::string v =
        fmt::format("activations {:>10} | peak {:>10}", bytes(m["activation_peak_bytes"]), bytes(m["peak_bytes"]));
    if (j.value("sequence_parallel", int64_t{1}) > 1)
      v += fmt::format(" | all-to-all {:>10} sent a step", bytes(m["all_to_all_bytes_per_step"]));
    if (with_memory) {
      const int64_t mb = m["largest_micro_batch"].get<int64_t>();
      v += mb > 0 ? fmt::format(" | largest micro-batch {} (grad_accum {})", mb,
                                m["grad_accum_for_global_batch"].get<int64_t>())
                  : std::string(" | does not fit at micro-batch 1");
    }
    modes.emplace_back(m["mode"].get<std::string>(), v);
  }
  return log::format_table(modes);
}

// Mode budget's schedule, block by block ("" when the recipe is not budget mode or nothing fits).
std::string budget_schedule_text(const Json& j) {
  if (!j.contains("budget_schedule") || j["budget_schedule"].is_null()) return "";
  std::string out;
  const auto& b = j["budget_schedule"];
  out += fmt::format("Budget schedule ({} of activations, formula costs: recompute {:.3g} of {:.3g} GFLOP a forward; "
                     "solved in {:.0f} ms):\n",
                     bytes(b["budget"]["budget_bytes"]), b["budget"]["recompute_cost"].get<double>(),
                     b["budget"]["forward_cost"].get<double>(), b["budget"]["solve_ms"].get<double>());
  for (const auto& blk : b["blocks"]) {
    std::string parts;
    for (const auto& p : blk["parts"]) parts += (parts.empty() ? " [" : ", ") + p.get<std::string>();
    const auto& seg = blk["segment"];
    out += fmt::format("  block {:>3}: {}{}{}{}\n", blk["block"].get<int64_t>(), blk["choice"].get<std::string>(),
                       parts.empty() ? "" : parts + "]",
                       blk["choice"] == "recompute" ? fmt::format(" (segment of blocks {}..{})", seg[0].get<int64_t>(),
                                                                  seg[1].get<int64_t>() - 1)
                                                    : std::string(),
                       blk.value("exchange", "redo") == "keep" ? ", exchange kept" : "");
  }
  return out;
}

}  // namespace

namespace {

// offload.*: where the recipe's states live, what moves, and what it costs.
std::string offload_table(const Json& j) {
  if (!j.contains("offload")) return "";
  const auto& o = j["offload"];
  if (o.is_null()) return "\nOffload: no budget schedule fits, so nothing to place.\n";
  std::string placed;
  for (const char* k : {"optimizer", "gradients", "parameters", "activations"})
    if (o[k].get<bool>()) placed += (placed.empty() ? "" : ", ") + std::string(k);
  const double gib = 1024.0 * 1024 * 1024;
  auto secs = [](const Json& v) {
    return v.is_null() ? std::string("unknown (set logging.peak_tflops)") : fmt::format("{:.3f} s", v.get<double>());
  };
  std::vector<std::pair<std::string, std::string>> rows = {
      {"offloaded to host memory", placed},
      {"device peak (recipe's mode)", bytes(o["device_peak_bytes"])},
      {"host: fp32 masters", bytes(o["host_params_bytes"])},
      {"host: gradients", bytes(o["host_grads_bytes"])},
      {"host: AdamW moments", bytes(o["host_optimizer_bytes"])},
      {"host: checkpointed inputs", bytes(o["host_activation_bytes"])},
      {"host: AdamW's piece index (optimizer step)", bytes(o["host_optimizer_temp_bytes"])},
      {"host: snapshot of an asynchronous save", bytes(o["host_snapshot_bytes"])},
      {"host peak", bytes(o["host_peak_bytes"])},
      {"moved per step",
       fmt::format("{:.2f} GiB to host, {:.2f} GiB to device", o["to_host_bytes_per_step"].get<double>() / gib,
                   o["to_device_bytes_per_step"].get<double>() / gib)},
      {"transfer time", fmt::format("{:.3f} s at {:g} GB/s, {:.3f} s not hidden (overlap {:g})",
                                    o["transfer_s"].get<double>(), o["bandwidth_gbps"].get<double>(),
                                    o["exposed_transfer_s"].get<double>(), o["overlap"].get<double>())},
      {"host AdamW step", fmt::format("{:.3f} s", o["host_adamw_s"].get<double>())},
      {"compute", fmt::format("{} ({:g} TFLOP/s peak at {:.0f}% MFU)", secs(o["compute_s"]),
                              o["peak_tflops"].get<double>(), 100 * o["modelled_mfu"].get<double>())},
      {"modelled step time", fmt::format("{:.3f} s", o["step_s"].get<double>())},
  };
  return "\nOffload (offload.*, per rank, the recipe's checkpointing mode):\n" + log::format_table(rows);
}

}  // namespace

std::string format_plan(const Json& j) {
  std::string out = breakdown_table(j);
  const bool with_memory = !j["memory_bytes"].is_null();
  out += with_memory ? fmt::format("\nPer checkpointing mode, against {}:\n", bytes(j["memory_bytes"]))
                     : std::string("\nPer checkpointing mode (give --memory SIZE for the largest micro-batch):\n");
  out += modes_table(j, with_memory);
  out += budget_schedule_text(j);
  out += offload_table(j);
  if (with_memory && j["model_states_bytes"].get<int64_t>() > j["memory_bytes"].get<int64_t>())
    out += fmt::format(
        "Model states alone ({}) exceed {}: no checkpointing mode can fit; this needs more ranks "
        "with parallel.sharding (zero3 divides all three states by the world size), lower precision, "
        "or host memory for them: offload.optimizer (+ gradients with zero2/3, + parameters with zero3).\n",
        bytes(j["model_states_bytes"]), bytes(j["memory_bytes"]));
  return out;
}

namespace {

// The degrees a scenario can take: those dividing its ranks, model.n_head and train.seq_len.
std::vector<int64_t> sequence_degrees(const Scenario& sc) {
  std::vector<int64_t> out;
  const int64_t world = std::max<int64_t>(1, sc.placement.world);
  for (int64_t n = 1; n <= world; ++n)
    if (world % n == 0 && sc.model.n_head % n == 0 && sc.seq_len % n == 0) out.push_back(n);
  return out;
}

// The scenario at degree n: its own mode's per-rank peak and step time (mode budget: with how many
// blocks its schedule keeps their exchanges, at n > 1).
Json degree_row(const Scenario& recipe, int64_t n, int64_t memory_bytes) {
  Scenario sc = recipe;
  sc.sequence = n;
  const auto schedule = budget::try_plan_for(sc);
  if (!schedule) return {{"degree", n}, {"fits", false}, {"peak_bytes", nullptr}, {"step_s", nullptr}};
  const auto p = memory::predict_peak(sc, *schedule);
  const auto t = modelled_step(sc, *schedule);
  // Every data-parallel rank of the mesh at degree n trains its own sequences: the step's tokens.
  const auto mesh = layout::Mesh(std::max<int64_t>(1, sc.placement.world), 0, {.sequence = n});
  const int64_t tokens = mesh.tokens_per_step(sc.micro_batch, sc.grad_accum, sc.seq_len);
  Json row = {{"degree", n},
              {"tokens_per_step", tokens},
              {"tokens_per_s", sc.peak_tflops > 0 ? Json(static_cast<double>(tokens) / t.step_s) : Json(nullptr)},
              {"peak_bytes", p.peak_bytes()},
              {"activation_peak_bytes", p.activations.peak_bytes},
              {"all_to_all_bytes_per_step", t.all_to_all_bytes},
              {"all_to_all_s", t.all_to_all_s},
              {"step_s", sc.peak_tflops > 0 ? Json(t.step_s) : Json(nullptr)},
              {"fits", memory_bytes <= 0 || p.peak_bytes() <= memory_bytes}};
  if (n > 1 && sc.checkpointing.mode.solved())
    row["exchange_kept_blocks"] = schedule->to_json()["exchange_kept_blocks"];
  return row;
}

// Whether the search chooses checkpointing.exchange at degree n: a mode other than budget (which
// chooses per block) whose exchange is auto and whose plan recomputes some attention, at n > 1.
bool exchange_to_choose(const Scenario& sc, int64_t n) {
  if (n <= 1 || sc.checkpointing.mode.solved() || !sc.checkpointing.exchange.chosen()) return false;
  const auto seg = memory::segment_counts(sc.checkpointing, sc.model.n_layer);
  return seg.checkpointed > 0 || seg.attention;
}

// Degree n's row with the exchange chosen: its own numbers stay the recipe's (auto: redo), and
// "exchanges" holds redo's and keep's rows (less their degree and tokens per step); "exchange" is keep
// where keep fits, else redo, and the degree fits where either does.
Json exchange_row(const Scenario& sc, int64_t n, int64_t memory_bytes) {
  Json row = degree_row(sc, n, memory_bytes);
  Json both = Json::object();
  for (const auto exchange : {config::Exchange::kRedo, config::Exchange::kKeep}) {
    Scenario c = sc;
    c.checkpointing.exchange = exchange;
    Json r = degree_row(c, n, memory_bytes);
    r.erase("degree");
    r.erase("tokens_per_step");
    both[std::string(config::Exchange(exchange).name())] = r;
  }
  const bool keep = both["keep"]["fits"].get<bool>();
  row["exchange"] = keep ? "keep" : "redo";
  row["fits"] = keep || both["redo"]["fits"].get<bool>();
  row["exchanges"] = both;
  return row;
}

}  // namespace

Json sequence_search(const Scenario& sc, int64_t memory_bytes) {
  Json degrees = Json::array(), chosen = nullptr, chosen_exchange = nullptr;
  for (int64_t n : sequence_degrees(sc)) {
    degrees.push_back(exchange_to_choose(sc, n) ? exchange_row(sc, n, memory_bytes) : degree_row(sc, n, memory_bytes));
    if (!chosen.is_null() || !degrees.back()["fits"].get<bool>()) continue;
    chosen = n;
    if (degrees.back().contains("exchange")) chosen_exchange = degrees.back()["exchange"];
  }
  Json out = {{"degrees", degrees},
              {"chosen", chosen},
              {"memory_bytes", memory_bytes > 0 ? Json(memory_bytes) : Json(nullptr)}};
  if (!chosen_exchange.is_null()) out["chosen_exchange"] = chosen_exchange;
  return out;
}

namespace {

// A degree's two exchange choices on one line: each one's peak, all-to-all time and fit, and the pick.
std::string format_exchanges(const Json& d) {
  std::string out;
  for (const char* name : {"redo", "keep"}) {
    const auto& r = d["exchanges"][name];
    out += r["peak_bytes"].is_null()
               ? fmt::format("{}exchange {}: no schedule", out.empty() ? "" : " | ", name)
               : fmt::format("{}exchange {}: peak {} (all-to-all {:.2f} s) {}", out.empty() ? "" : " | ", name,
                             bytes(r["peak_bytes"]), r["all_to_all_s"].get<double>(),
                             r["fits"].get<bool>() ? "fits" : "does not fit");
  }
  return out + fmt::format(" -> {}", d["exchange"].get<std::string>());
}

}  // namespace

std::string format_sequence_search(const Json& search, int64_t memory_bytes) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& d : search["degrees"]) {
    const auto step = d["step_s"].is_null()
                          ? std::string("unknown (set logging.peak_tflops)")
                          : fmt::format("{:.1f} s for {} tokens, {:.0f} tokens/s", d["step_s"].get<double>(),
                                        d["tokens_per_step"].get<int64_t>(), d["tokens_per_s"].get<double>());
    rows.emplace_back(
        fmt::format("parallel.sequence {}", d["degree"].get<int64_t>()),
        d["peak_bytes"].is_null()
            ? std::string("no budget schedule fits")
            : fmt::format("peak {:>10} | step {} (all-to-all {:.2f} s) | {}", bytes(d["peak_bytes"]), step,
                          d["all_to_all_s"].get<double>(), d["fits"].get<bool>() ? "fits" : "does not fit"));
    if (d.contains("exchanges")) rows.emplace_back("", format_exchanges(d));
  }
  std::string out = fmt::format("Sequence-parallel degrees (per rank, the recipe's checkpointing mode{}):\n",
                                memory_bytes > 0 ? ", against " + log::format_bytes(memory_bytes) : std::string());
  out += log::format_table(rows);
  const std::string exchange = search.contains("chosen_exchange")
                                   ? ", checkpointing.exchange: " + search["chosen_exchange"].get<std::string>()
                                   : "";
  out +=
      search["chosen"].is_null()
          ? std::string(
                "No degree fits: shard further (parallel.sharding: zero3, more ranks), checkpoint more, or offload.\n")
          : fmt::format("Smallest degree that fits: parallel.sequence: {}{}\n", search["chosen"].get<int64_t>(),
                        exchange);
  return out;
}

std::string oom_advice(const Scenario& sc, int64_t limit_bytes) {
  if (limit_bytes <= 0)
    return "lower train.micro_batch (raise train.grad_accum to keep the global batch) or enable checkpointing.mode: "
           "full";
  const int64_t per_rank = sc.micro_batch * sc.grad_accum;
  std::string out;
  for (const auto& [name, ck] : plan_modes(sc.checkpointing)) {
    Scenario c = sc;
    c.checkpointing = ck;
    const int64_t mb = largest_micro_batch(c, limit_bytes);
    if (mb == 0) continue;
    out += fmt::format("{}{}: micro_batch {} with grad_accum {}", out.empty() ? "" : "; ", name, mb,
                       (per_rank + mb - 1) / mb);
  }
  if (out.empty())
    return fmt::format("the planner predicts nothing fits {} (model states alone: {}); shard or lower precision",
                       log::format_bytes(limit_bytes),
                       log::format_bytes(memory::predict_states(sc).model_states_bytes()));
  return "the planner predicts these fit " + log::format_bytes(limit_bytes) + ": " + out +
         " (set train.micro_batch / train.grad_accum / checkpointing.mode accordingly)";
}

}  // namespace sl::planner
