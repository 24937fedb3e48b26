// The end of a run: the final model (Hugging Face layout), per-rank memory gathered to rank 0, summary.json, the
// closing console line.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "device/build_info.h"
#include "device/host.h"
#include "interop/hf.h"
#include "interop/peft.h"
#include "predict/planner.h"
#include "train/run.h"

namespace sl::train {
namespace {

using Json = nlohmann::json;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Every rank left the loop at the same step: a clean end, an agreed stop (signal, rank 0's log
// failure), or a non-finite loss or gradient norm (averaged over ranks, so all ranks see it). After
// an OOM or another rank-local error the others are stuck in a step's collective instead.
bool ranks_aligned(int code) {
  return code == kExitOk || code == kExitSigint || code == kExitSigterm || code == kExitNonFinite || code == kExitIo;
}

// The final weights as a Hugging Face checkpoint, <run dir>/model/{model.safetensors, config.json} (and the
// run's tokenizer.json with a tokenizer_config.json when it has one):
// streamed tensor by tensor; under zero3 every rank gathers one unit at a time and rank 0 writes it.
// Returns summary.json's final_weights block (null when none were written). Called with logging.save_model on.
Json save_final_model(const config::ModelConfig& m, const Process& proc, parallel::Strategy& strategy,
                      const std::filesystem::path& tokenizer_path, log::RunLog& runlog, const LoopState& st,
                      Outcome& o) {
  if (!ranks_aligned(o.code) || o.code == kExitNonFinite || o.code == kExitIo) return nullptr;
  const interop::ParamValues values = [&](const std::string& param, int64_t begin, int64_t end) {
    return strategy.param_values(param).narrow(0, begin, end - begin);  // fp32: the masters of a compute copy
  };
  // model.lora: the weights with the adapters folded in (what sample reads), the adapters beside them (PEFT's).
  // The merged walk reads every adapter while its unit is gathered (zero3); a host copy of each is kept for
  // the adapter file, written after the walk.
  auto kept = std::make_shared<std::map<std::string, torch::Tensor>>();
  const interop::ParamValues adapters = [&, kept](const std::string& param, int64_t begin, int64_t end) {
    auto& t = (*kept)[param];
    if (!t.defined()) t = strategy.param_values(param).to(torch::kCPU, torch::kFloat).clone();
    return t.narrow(0, begin, end - begin);
  };
  interop::WeightsSource source =
      m.lora.enabled() ? interop::merged_source(m, values, adapters) : interop::WeightsSource{};
  source.enter = [&](int64_t unit) { strategy.gather_unit(unit); };
  source.leave = [&](int64_t unit) { strategy.release_unit(unit); };
  strategy.take_transient_peak();  // from here on: what the export gathers
  if (!m.lora.enabled())
    source.values = [&](const interop::HfTensor& t) { return values(t.param, t.begin(), t.end()); };  // on the device
  try {
    // The run's copy of its tokenizer (record_tokenizer) beside the weights, so AutoTokenizer loads the folder too.
    const auto tokenizer = tokenizer_path.empty() ? std::filesystem::path() : runlog.dir() / "tokenizer.json";
    const auto eos =
        tokenizer.empty() || !proc.rank0() ? std::nullopt : text::inspect_tokenizer_file(tokenizer).end_of_text_id;
    const auto w = interop::write_hf(runlog.dir() / "model" / "model.safetensors", interop::without_lora(m),
                                     torch::kFloat, source, proc.rank0(),
                                     {{"format", "pt"}, {"sublinear_step", std::to_string(st.steps_done)}}, eos);
    if (proc.rank0() && m.lora.enabled())
      interop::write_peft(runlog.dir() / "adapter", m, adapters, interop::base_checkpoint(m));
    if (proc.rank0() && !tokenizer.empty()) text::write_hf_tokenizer(runlog.dir() / "model", tokenizer, m.max_seq_len);
    return {{"path", w.file.string()}, {"step", st.steps_done}, {"bytes", w.digest.bytes}, {"tensors", w.tensors},
            {"gathered_peak_bytes", strategy.take_transient_peak()}};
  } catch (const Error& e) {  // a failed write on rank 0 must not strand the others
    o.code = e.code;
    o.message = e.what();
  } catch (const std::filesystem::filesystem_error& e) {
    o.code = kExitIo;
    o.message = fmt::format("writing the final weights: {}", e.what());
  } catch (const std::exception& e) {
    o.code = kExitInternal;
    o.message = fmt::format("writing the final weights: {}", e.what());
  }
  return nullptr;
}

// A stretch some ranks may have failed alone, entered with exit code `entry_code` on every rank: the
// first rank whose outcome changed in it (Comm::agree_on_failure) gives every rank its exit code and
// message (another rank's named). Unchanged when none changed. A collective that fails here is a
// distributed failure. Returns whether every rank met in it (the agreement's collective went through).
bool agree_outcome(const Process& proc, Outcome& o, int entry_code, const std::string& what) {
  try {
    const auto f = proc.comm->agree_on_failure(o.code != entry_code ? o.code : kExitOk, o.message, what);
    if (f.code == kExitOk || f.rank == proc.launch.rank) return true;
    o.code = f.code;
    o.message = fmt::format("rank {}: {} failed: {}", f.rank, what, f.message);
    return true;
  } catch (const Error& e) {
    o.code = e.code;
    o.message = e.what();
    return false;
  }
}

// Per-rank memory, gathered to rank 0 (skipped when a peer failed: the collective could not pair).
Json parallel_report(config::Sharding sharding, const Process& proc, const Learner& learn, const Meter& meter,
                     const LoopState& st, Outcome& o) {
  Json layout = learn.strategy->layout();
  if (layout.is_null()) return nullptr;  // one process: no parallel block (docs/logs.md)
  const auto sb = learn.strategy->state_bytes();
  const int64_t opt_bytes = optimizer_state_bytes(*learn.opt);
  const std::vector<double> mine{static_cast<double>(proc.launch.rank), static_cast<double>(st.rest_bytes),
                                 static_cast<double>(sb.params),     static_cast<double>(sb.grads),
                                 static_cast<double>(opt_bytes),     static_cast<double>(st.transient_peak),
                                 static_cast<double>(st.peak_bytes), static_cast<double>(meter.build_peak_bytes),
                                 static_cast<double>(meter.load_peak_bytes)};
  std::vector<double> all = mine;
  if (ranks_aligned(o.code) && proc.world() > 1) {
    try {
      all = proc.comm->all_gather(mine, "per-rank memory report");
    } catch (const parallel::DistError& e) {
      o = {kExitDistributed, e.what(), nullptr};
    }
  }
  Json ranks = Json::array();
  for (size_t i = 0; i + mine.size() <= all.size(); i += mine.size()) {
    auto at = [&](size_t k) { return static_cast<int64_t>(all[i + k]); };
    ranks.push_back({{"rank", at(0)},
                     {"model_state_bytes_measured", at(1)},
                     {"params_bytes", at(2)},
                     {"grads_bytes", at(3)},
                     {"optimizer_state_bytes", at(4)},
                     {"model_state_bytes", at(2) + at(3) + at(4)},
                     {"transient_peak_bytes", at(5)},
                     {"peak_allocated_bytes", at(6)},
                     {"build_peak_bytes", at(7)},
                     {"load_peak_bytes", at(8)}});
  }
  const auto& exchange = learn.model->sequence;  // parallel.sequence > 1: this rank's all-to-alls
  layout.update({{"world_size", proc.world()},
                 {"sequence_parallel", proc.mesh().sequence()},
                 {"all_to_all_bytes_sent", exchange ? exchange->sent_bytes() : 0},
                 {"predicted_all_to_all_bytes_per_micro_batch", meter.predicted.all_to_all_bytes},
                 {"data_parallel", proc.mesh().data()},
                 {"backend", proc.comm->backend()},
                 {"sharding", sharding},
                 {"params_bytes_unsharded", 4 * learn.model->num_params()},
                 {"gathers_last_step", st.gathers},
                 {"ranks", ranks}});
  return layout;
}

// Saved training states: where this run resumed from (and in which torchrun restart), and what it saved.
Json state_report(const config::StateConfig& c, const Process& proc, const Start& start, const LoopState& st) {
  return {{"resumed_from", start.resume_from.found() ? Json(start.resume_from.dir.string()) : Json(nullptr)},
          {"resumed_at_step", start.resume_from.found() ? Json(start.resume_from.step) : Json(nullptr)},
          {"restart", proc.launch.restart_count},  // torchrun's TORCHELASTIC_RESTART_COUNT: 0 on the first attempt
          {"saves", st.save_ms.size()},
          {"last_saved_step", st.last_saved_step >= 0 ? Json(st.last_saved_step) : Json(nullptr)},
          {"state_bytes", st.state_bytes},
          {"async", c.async},
          {"snapshot_bytes", st.snapshot_bytes()},
          {"median_save_ms", median(st.save_ms)},
          {"median_save_blocking_ms", median(st.save_blocking_ms)}};
}

// The transfers between device and host by the path they took (device/host.h, CopyCounts), and that
// path in one word: the one every copy took, "mixed", or "none" without a copy.
Json copies_report(const device::CopyCounts& c) {
  const int paths = (c.side_stream > 0) + (c.synchronous > 0) + (c.simulated > 0);
  const char* path = paths == 0   ? "none"
                     : paths > 1  ? "mixed"
                     : c.side_stream > 0 ? "side_stream"
                     : c.synchronous > 0 ? "synchronous"
                                         : "simulated";
  return {{"path", path}, {"side_stream", c.side_stream}, {"synchronous", c.synchronous}, {"simulated", c.simulated}};
}

// Offloaded state in host memory (offload.*): measured and predicted, and the limit.
Json host_report(int64_t host_limit, const memory::PeakPrediction& predicted, const LoopState& st) {
  return {{"peak_bytes", st.host_peak_bytes},
          {"states_bytes", st.host_states_bytes},
          {"predicted_peak_bytes", predicted.host_peak_bytes()},
          {"predicted_states_bytes", predicted.host_states_bytes()},
          {"predicted_activation_bytes", predicted.activations.host_bytes},
          {"limit_bytes", host_limit > 0 ? Json(host_limit) : Json(nullptr)},
          {"copies", copies_report(device::copy_counts())}};
}

// summary.json's model block: setup's, with the MFU's peak as the run ends (raised by a step that beat
// it: train/peak_flops.h), what it started from and how it was measured.
Json model_report(const Json& model_info, const PeakTracker& peak) {
  Json m = model_info;
  const auto& first = peak.initial();
  m["peak_flops"] = peak.flops();
  m["peak_flops_source"] = peak.source();
  m["peak_flops_initial"] = first.flops;
  m["peak_flops_raised_at_step"] = peak.raised_at() ? Json(*peak.raised_at()) : Json(nullptr);
  m["peak_flops_probe"] = first.probe ? first.probe->to_json() : Json(nullptr);
  return m;
}

// The median step's model FLOP/s per device over the final peak (the median commutes with the
// positive factor flops_per_token / world), so it is at most 1 as every step's rate is.
double median_mfu(const Meter& meter, int64_t world, const LoopState& st) {
  return meter.peak.utilisation(meter.flops_per_token * median(st.tok_s) / static_cast<double>(world));
}

// Writes summary.json; a failure is the run's exit status only when nothing failed before it.
void write_summary(log::RunLog& runlog, const Json& summary, Outcome& o) {
  try {
    runlog.write_json("summary.json", summary);
  } catch (const IoError& e) {
    if (o.code == kExitOk) o = {kExitIo, e.what(), nullptr};
    else spdlog::error("{}", e.what());
  }
}

void print_closing_line(const Process& proc, const log::RunLog& runlog, const LoopState& st, const Outcome& o) {
  if (!proc.rank0() && o.code != kExitOk) spdlog::error("rank {}: {}", proc.launch.rank, o.message);
  if (!proc.rank0()) return;
  const auto summary_path = (runlog.dir() / "summary.json").string();
  if (o.code == kExitOk)
    spdlog::info("done: {} steps, median {:.1f} ms/step, {:.0f} tok/s, peak {} -> {}", st.steps_done,
                 median(st.step_ms), median(st.tok_s), log::format_bytes(st.peak_bytes), summary_path);
  else
    spdlog::error("{} (summary: {})", o.message, summary_path);
}

}  // namespace

Json Session::summary_json(const LoopState& st, const Outcome& o, Json parallel, Json final_weights) const {
  const Session& s = *this;
  auto finite = [](double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); };
  const auto predicted = memory::predict_peak(s.meter.scenario, s.learn.runner->plan());  // per rank, from the planner
  const auto reserved_peak = s.meter.tracker->steps_peak_reserved_bytes();
  const int64_t tokens = st.steps_done * tokens_per_step(s.cfg.train, s.proc.mesh());
  return {{"config", s.out.resolved},
          {"build", device::build_info()},  // what `trainer --version` prints
          {"environment", s.out.environment},
          {"model", model_report(s.out.model_info, s.meter.peak)},
          {"checkpointing", s.learn.runner->plan().to_json()},
          {"run_dir", s.out.run_dir},
          {"steps", st.steps_done},
          {"skipped_steps", st.skipped_steps},
          {"tokens", tokens},
          {"trained_tokens", s.cfg.data.source.examples() ? st.trained_tokens : tokens},
          {"final_loss", finite(st.last_loss)},
          {"final_val_loss", finite(st.last_val)},
          {"warmup_steps_excluded", std::min<int64_t>(s.cfg.logging.skip_first, st.steps_done)},
          {"median_step_ms", median(st.step_ms)},
          {"median_tokens_per_s", median(st.tok_s)},
          {"median_trained_tokens_per_s", median(st.trained_tok_s)},
          {"median_samples_per_s", median(st.samp_s)},
          {"median_mfu", median_mfu(s.meter, s.proc.world(), st)},
          {"median_recompute_ms", median(st.recompute_ms)},
          {"median_activation_peak_bytes", static_cast<int64_t>(median(st.act_peaks))},
          {"predicted_activation_peak_bytes", s.meter.predicted.peak_bytes},
          {"predicted_peak_bytes", predicted.peak_bytes()},
          {"wall_s", st.wall_s},
          {"peak_allocated_bytes", st.peak_bytes},
          // CUDA: beside the allocated peak
          {"peak_reserved_bytes", reserved_peak ? Json(*reserved_peak) : Json(nullptr)},
          {"memory_breakdown",
           {{"params_bytes", st.states_at_peak.params},
            {"grads_bytes", st.states_at_peak.grads},
            {"optimizer_state_bytes", st.states_at_peak.optimizer},
            {"activations_and_other_bytes", std::max<int64_t>(0, st.peak_bytes - st.states_at_peak.total())}}},
          {"memory_limit_bytes", s.meter.limit > 0 ? Json(s.meter.limit) : Json(nullptr)},
          {"host_memory", host_report(s.cfg.memory.host_limit.bytes, predicted, st)},
          {"micro_batch_search", s.meter.batch_search},
          {"state", state_report(s.cfg.state, s.proc, s.start, st)},
          {"final_weights", std::move(final_weights)},
          {"parallel", std::move(parallel)},
          {"cuda_graphs", s.learn.graph ? s.learn.graph->summary() : Json(nullptr)},
          {"oom", o.oom},
          {"exit_status", {{"code", o.code}, {"name", exit_code_name(o.code)}, {"message", o.message}}}};
}

int Session::finish(const LoopState& st, Outcome o) {
  Session& s = *this;
  // Ranks that left the loop together stay together: what one rank alone fails at from here on (rank 0
  // writing the final weights or the summary) becomes every rank's outcome before the next collective
  // or the exit, so no rank waits in a collective another never joins and all exit with one code.
  const bool together = ranks_aligned(o.code) && s.proc.world() > 1;
  int entry = o.code;
  Json final_weights = s.cfg.logging.save_model ? save_final_model(s.cfg.model, s.proc, *s.learn.strategy,
                                                                   s.data.tokenizer_path, *s.out.runlog, st, o)
                                                : Json(nullptr);
  if (together) agree_outcome(s.proc, o, entry, "writing the final weights");
  entry = o.code;
  Json parallel = parallel_report(s.cfg.parallel.sharding, s.proc, s.learn, s.meter, st, o);
  write_summary(*s.out.runlog, summary_json(st, o, std::move(parallel), std::move(final_weights)), o);
  // Met here, every rank exits from this point (with one code): NCCL's group may be shut down cleanly.
  if (together && ranks_aligned(entry) && agree_outcome(s.proc, o, entry, "writing summary.json"))
    s.proc.comm->ranks_leave_together();
  print_closing_line(s.proc, *s.out.runlog, st, o);
  return o.code;
}

}  // namespace sl::train
