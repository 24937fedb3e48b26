// Validation of the merged recipe: ranges and combinations of keys, checked once after merging; every
// failure is a ConfigError naming the key.
#include "config/config.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "config/lora.h"
#include "config/shape.h"
#include "errors.h"

namespace sl::config {

bool valid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned c = *p;
    int more = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the allowed range of the second byte (Unicode Table 3-7)
    if (c < 0x80) more = 0;
    else if (c >= 0xC2 && c <= 0xDF) more = 1;
    else if (c >= 0xE0 && c <= 0xEF) more = 2, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) more = 3, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return false;
    if (end - p <= more) return more == 0 && end - p == 1;
    for (int k = 1; k <= more; ++k) {
      const unsigned b = p[k];
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
    }
    p += more + 1;
  }
  return true;
}

// train.global_batch counts sequences per optimizer step over all ranks.
static void check_global_batch(const RunConfig& c) {
  auto fail = [](const std::string& key, const std::string& msg) {
    throw ConfigError(fmt::format("{}: {}", key, msg));
  };
  const auto& t = c.train;
  // Sequence parallelism: the N ranks of a sequence group train the same sequences, so the ranks that
  // draw their own are WORLD_SIZE / parallel.sequence.
  // (A degree that does not divide the world: validate_sequence names it; count every rank until then.)
  const auto mesh = layout::Mesh::fits(std::max<int64_t>(1, c.world_size), {c.parallel.sequence})
                        ? c.mesh()
                        : ParallelConfig{}.mesh(std::max<int64_t>(1, c.world_size));
  const int64_t world = mesh.data();
  const std::string ranks = c.parallel.sequence > 1 ? "WORLD_SIZE / parallel.sequence" : "WORLD_SIZE";
  if (t.micro_batch.is_auto()) {
    if (t.global_batch % world != 0)
      fail("train.global_batch", fmt::format("{} is not divisible by {} {}: micro_batch: auto gives every rank "
                                             "global_batch / {} sequences per step; pick a multiple of it",
                                             t.global_batch, ranks, world, ranks));
  } else if (t.global_batch > 0 && t.global_batch != mesh.global_batch(t.micro_batch, t.grad_accum)) {
    fail("train.global_batch", fmt::format("{} is not train.micro_batch * train.grad_accum * {} = {} * {} * {} = {}; "
                                           "drop one of them (global_batch counts sequences per step over all ranks)",
                                           t.global_batch, ranks, t.micro_batch, t.grad_accum, world,
                                           mesh.global_batch(t.micro_batch, t.grad_accum)));
  }
}

namespace {

[[noreturn]] void fail(const std::string& key, const std::string& msg) {
  throw ConfigError(fmt::format("{}: {}", key, msg));
}

void positive(const std::string& key, int64_t v) {
  if (v <= 0) fail(key, fmt::format("must be > 0, got {}", v));
}

// model.layer_mlp_hidden: empty, or one entry per block, each 0 (model.mlp_hidden's) or positive.
void validate_layer_widths(const ModelConfig& m) {
  const auto& w = m.layer_mlp_hidden;
  if (!w.empty() && static_cast<int64_t>(w.size()) != m.n_layer)
    fail("model.layer_mlp_hidden", fmt::format("has {} entries but model.n_layer is {}: give one MLP size per block "
                                               "(0 = model.mlp_hidden's), or [] for the same size in every block",
                                               w.size(), m.n_layer));
  for (size_t i = 0; i < w.size(); ++i)
    if (w[i] < 0)
      fail("model.layer_mlp_hidden", fmt::format("entry {} (block {}) is {}; sizes must be >= 0", i, i, w[i]));
}

// model.lora: the adapter's numbers and names, and the layouts whose frozen weights it cannot keep apart yet.
void validate_lora(const RunConfig& c) {
  const auto& l = c.model.lora;
  if (l.rank < 0) fail("model.lora", fmt::format("rank must be >= 0 (0 = no adapters), got {}", l.rank));
  if (!l.enabled()) return;
  if (!(l.alpha > 0.0)) fail("model.lora", fmt::format("alpha must be > 0, got {}", l.alpha));
  if (!(l.dropout >= 0.0 && l.dropout < 1.0))
    fail("model.lora", fmt::format("dropout must be in [0, 1), got {}", l.dropout));
  lora_targets(c.model, 0);  // names the arch lacks
  if (l.base_dtype != Dtype::kFp32 && l.base_dtype != Dtype::kBf16)
    fail("model.lora", fmt::format("base_dtype must be fp32 or bf16, got '{}'", l.base_dtype.name()));
  if (l.base_dtype == Dtype::kBf16 && c.precision.compute != Dtype::kBf16)
    fail("model.lora", fmt::format("base_dtype bf16 uses the frozen weights as they are held, in bf16: set "
                                   "precision.compute: bf16 (it is '{}') or base_dtype: fp32",
                                   c.precision.compute.name()));
  if (c.precision.param_dtype != Dtype::kFp32)
    fail("precision.param_dtype", "with model.lora only the adapters have fp32 masters and a compute copy: set "
                                  "model.lora's base_dtype: bf16 to hold the frozen weights in bf16 instead");
}

void validate_model(const RunConfig& c) {
  const auto& m = c.model;
  positive("model.n_layer", m.n_layer);
  positive("model.n_head", m.n_head);
  positive("model.n_embd", m.n_embd);
  positive("model.vocab_size", m.vocab_size);
  if (m.vocab_multiple < 1)
    fail("model.vocab_multiple",
         fmt::format("must be >= 1, got {}; 1 = no padding, 128 pads the vocabulary to a multiple of 128",
                     m.vocab_multiple));
  if (m.vocab_size > 0 && m.vocab_multiple > INT64_MAX - m.vocab_size)
    fail("model.vocab_multiple",
         fmt::format("{} with model.vocab_size {} overflows the padded size; use a small multiple such as 128",
                     m.vocab_multiple, m.vocab_size));
  positive("model.max_seq_len", m.max_seq_len);
  if (m.mlp_hidden < 0) fail("model.mlp_hidden", fmt::format("must be >= 0, got {}", m.mlp_hidden));
  if (m.loss_chunk < 0) fail("model.loss_chunk", fmt::format("must be >= 0 (0 = auto), got {}", m.loss_chunk));
  validate_layer_widths(m);
  if (!Shape(m).uniform() && (c.logging.save_model || !m.init_from.empty()))
    fail(c.logging.save_model ? "logging.save_model" : "model.init_from",
         "Hugging Face's GPT-2 and LLaMA classes give every block one MLP size, so a model with per-block sizes "
         "(model.layer_mlp_hidden) cannot be written as or read from their checkpoints; set logging.save_model: false "
         "and model.init_from: \"\" (training states, state.*, save and resume it)");
  if (m.n_embd % m.n_head != 0)
    fail("model.n_embd", fmt::format("{} is not divisible by model.n_head = {}", m.n_embd, m.n_head));
  if (m.arch == Arch::kLlama && (m.n_embd / m.n_head) % 2 != 0)
    fail("model.n_head", "RoPE needs an even head size (n_embd / n_head)");
  if (!(m.dropout >= 0.0 && m.dropout < 1.0))
    fail("model.dropout", fmt::format("must be in [0, 1), got {}", m.dropout));
  if (!(m.norm_eps > 0.0)) fail("model.norm_eps", "must be > 0");
  if (!(m.init_std > 0.0)) fail("model.init_std", "must be > 0");
  if (!(m.rope_theta > 0.0)) fail("model.rope_theta", "must be > 0");
  validate_lora(c);
}

void validate_data(const RunConfig& c) {
  const auto& m = c.model;
  const auto& d = c.data;
  if (d.source != DataSource::kSynthetic && d.path.empty())
    fail("data.path", "is empty; give a token file or a text file");
  if (!(d.val_fraction > 0.0 && d.val_fraction < 1.0))
    fail("data.val_fraction", fmt::format("must be in (0, 1), got {}", d.val_fraction));
  positive("data.synthetic_tokens", d.synthetic_tokens);
  if (d.packing && !d.source.examples())
    fail("data.packing",
         fmt::format("packs examples into rows; it needs data.source: examples, not {}", d.source.name()));
  if (d.source == DataSource::kText && m.vocab_size < 256)
    fail("model.vocab_size",
         fmt::format("text data uses one token per byte, so it must be >= 256, got {}", m.vocab_size));
}

void validate_train(const RunConfig& c) {
  const auto& m = c.model;
  const auto& t = c.train;
  positive("train.seq_len", t.seq_len);
  if (!t.micro_batch.is_auto() && t.micro_batch <= 0)
    fail("train.micro_batch", fmt::format("must be > 0 or auto, got {}", t.micro_batch.value()));
  positive("train.grad_accum", t.grad_accum);
  if (t.global_batch < 0) fail("train.global_batch", "must be >= 0 (0 = micro_batch * grad_accum * WORLD_SIZE)");
  if (t.micro_batch.is_auto()) {
    if (t.global_batch == 0)
      fail("train.micro_batch", "auto needs train.global_batch: the sequences per optimizer step to keep");
  }
  check_global_batch(c);
  positive("train.steps", t.steps);
  if (t.seq_len > m.max_seq_len)
    fail("train.seq_len",
         fmt::format("{} is longer than the model's context model.max_seq_len = {}", t.seq_len, m.max_seq_len));
  if (!(t.lr > 0.0)) fail("train.lr", fmt::format("must be > 0, got {}", t.lr));
  if (!(t.min_lr >= 0.0 && t.min_lr <= t.lr))
    fail("train.min_lr", fmt::format("must be in [0, train.lr = {}], got {}", t.lr, t.min_lr));
  if (t.warmup_steps < 0) fail("train.warmup_steps", "must be >= 0");
  if (!(t.weight_decay >= 0.0)) fail("train.weight_decay", "must be >= 0");
  if (!(t.beta1 >= 0.0 && t.beta1 < 1.0)) fail("train.beta1", "must be in [0, 1)");
  if (!(t.beta2 >= 0.0 && t.beta2 < 1.0)) fail("train.beta2", "must be in [0, 1)");
  if (!(t.grad_clip >= 0.0)) fail("train.grad_clip", "must be >= 0 (0 = off)");
  if (t.eval_interval < 0) fail("train.eval_interval", "must be >= 0 (0 = never)");
  positive("train.eval_batches", t.eval_batches);
  if (t.threads < 0) fail("train.threads", "must be >= 0 (0 = all cores)");
  if (!(t.spike_threshold > 1.0))
    fail("train.spike_threshold",
         fmt::format("must be > 1 (a multiple of the moving average), got {}", t.spike_threshold));
  positive("train.spike_window", t.spike_window);
  if (t.sample_interval < 0) fail("train.sample_interval", "must be >= 0 (0 = never)");
  positive("train.sample_tokens", t.sample_tokens);
  if (!valid_utf8(t.sample_prompt)) fail("train.sample_prompt", "is not valid UTF-8; give the prompt as UTF-8 text");
  if (t.sample_interval > 0 && t.sample_tokens >= t.seq_len)
    fail("train.sample_tokens", fmt::format("{} leaves no room for the prompt in train.seq_len = {}; ask for fewer",
                                            t.sample_tokens, t.seq_len));
}

void validate_checkpointing(const RunConfig& c) {
  const auto& m = c.model;
  const auto& k = c.checkpointing;
  const bool budget = k.mode == CheckpointingMode::kBudget;
  if (budget) {
    if (k.budget.share > 0 && c.memory.limit.bytes == 0)
      fail("checkpointing.budget", fmt::format("{} is a share of memory.limit, which is not set: give memory.limit "
                                               "(e.g. 80GiB) or a size such as checkpointing.budget: 6GiB",
                                               k.budget.text.empty() ? std::string("\"\" (100%)") : k.budget.text));
  } else if (!k.budget.text.empty()) {
    fail("checkpointing.budget",
         fmt::format("is only used with checkpointing.mode: budget (mode is '{}')", k.mode.name()));
  }
  if (k.interval < 0) fail("checkpointing.interval", "must be >= 0");
  if (k.segments < 0) fail("checkpointing.segments", "must be >= 0");
  if (k.mode == CheckpointingMode::kInterval) {
    if ((k.interval > 0) == (k.segments > 0))
      fail("checkpointing.interval",
           "interval mode needs exactly one of checkpointing.interval or checkpointing.segments");
    if (k.interval > m.n_layer)
      fail("checkpointing.interval", fmt::format("{} is more than model.n_layer = {}", k.interval, m.n_layer));
    if (k.segments > m.n_layer)
      fail("checkpointing.segments", fmt::format("{} is more than model.n_layer = {}", k.segments, m.n_layer));
  } else if (k.interval > 0 || k.segments > 0) {
    fail(k.interval > 0 ? "checkpointing.interval" : "checkpointing.segments",
         fmt::format("is only used with checkpointing.mode: interval (mode is '{}')", k.mode.name()));
  }
  for (const auto& part : k.recompute)
    if (part != "attention" && part != "mlp" && part != "norm")
      fail("checkpointing.recompute", fmt::format("'{}' is not one of attention | mlp | norm", part));
  if (k.mode == CheckpointingMode::kSelective && k.recompute.empty())
    fail("checkpointing.recompute", "selective mode needs a list, e.g. [attention, mlp, norm]");
  if (k.mode != CheckpointingMode::kSelective && !k.recompute.empty())
    fail("checkpointing.recompute",
         fmt::format("is only used with checkpointing.mode: selective (mode is '{}')", k.mode.name()));
}

// precision.param_dtype / reduce_dtype: a low-precision compute copy of the parameters needs fp32 masters
// somewhere, and the engine keeps them in the optimizer's shard (zero1/2/3, also at world size 1).
void validate_param_dtypes(const RunConfig& c) {
  const auto& pr = c.precision;
  const Sharding sh = c.parallel.sharding;
  const auto fp32 = Dtype::kFp32;
  if (pr.param_dtype != fp32 && pr.param_dtype != pr.compute)
    fail("precision.param_dtype", fmt::format("{} needs precision.compute: {} (it is '{}')", pr.param_dtype.name(),
                                              pr.param_dtype.name(), pr.compute.name()));
  if (pr.param_dtype != fp32 && sh.replicated())
    fail("precision.param_dtype",
         fmt::format("{} keeps fp32 master weights in the optimizer's shard: set parallel.sharding "
                     "to zero1, zero2 or zero3 (any world size, 1 included)",
                     pr.param_dtype.name()));
  if (pr.reduce_dtype != fp32 && pr.reduce_dtype != pr.param_dtype)
    fail("precision.reduce_dtype", fmt::format("{} needs precision.param_dtype: {} (it is '{}')",
                                               pr.reduce_dtype.name(), pr.reduce_dtype.name(), pr.param_dtype.name()));
  if (pr.reduce_dtype != fp32 && !sh.shards_grads())
    fail("precision.reduce_dtype", fmt::format("{} applies to the reduce-scatter of parallel.sharding zero2 or zero3 "
                                               "(sharding is '{}'); use fp32", pr.reduce_dtype.name(), sh.name()));
}

void validate_precision(const RunConfig& c) {
  const auto& pr = c.precision;
  validate_param_dtypes(c);
  if (!(pr.init_scale > 0.0)) fail("precision.init_scale", "must be > 0");
  if (!(pr.growth_factor > 1.0)) fail("precision.growth_factor", "must be > 1");
  if (!(pr.backoff_factor > 0.0 && pr.backoff_factor < 1.0)) fail("precision.backoff_factor", "must be in (0, 1)");
  positive("precision.growth_interval", pr.growth_interval);
  if (pr.max_skipped_steps < 0) fail("precision.max_skipped_steps", "must be >= 0 (0 = never give up)");
}

// train.device: lazy exists to run the device-generic code on a device that is not the CPU (tests):
// one process, fp32, no sharding, and nothing that reads device memory statistics.
void validate_lazy_device(const RunConfig& c) {
  if (c.train.device != DeviceChoice::kLazy) return;
  const auto why = [&](const std::string& key, const std::string& what) {
    fail(key, fmt::format("{}; train.device: lazy is a test device that runs one process in fp32", what));
  };
  if (c.world_size > 1) why("train.device", fmt::format("lazy runs at world size 1, not {}", c.world_size));
  if (!c.parallel.sharding.replicated()) why("parallel.sharding", "must be none with train.device: lazy");
  if (c.precision.compute != Dtype::kFp32 || c.precision.param_dtype != Dtype::kFp32)
    why("precision.compute", "must be fp32 (and precision.param_dtype fp32) with train.device: lazy");
  if (c.memory.limit.bytes > 0) why("memory.limit", "must be 0 with train.device: lazy (no memory statistics)");
  if (c.train.micro_batch.is_auto())
    why("train.micro_batch", "auto needs memory statistics, which train.device: lazy has not");
  if (c.checkpointing.mode == CheckpointingMode::kBudget)
    why("checkpointing.mode", "budget profiles device memory, which train.device: lazy has not");
  const auto m = c.checkpointing.mode;
  if (m == CheckpointingMode::kFull || m == CheckpointingMode::kInterval || m == CheckpointingMode::kSqrt)
    why("checkpointing.mode",
        fmt::format("{} recomputes whole segments, whose replay restores the autocast state of the "
                    "input's device type, which LibTorch has none of for lazy tensors: use none or "
                    "selective",
                    m.name()));
}

void validate_devices_and_logging(const RunConfig& c) {
  const auto& t = c.train;
  if (!(c.parallel.bucket_mb > 0.0)) fail("parallel.bucket_mb", "must be > 0");
  if (c.parallel.backend == Backend::kNccl && t.device == DeviceChoice::kCpu)
    fail("parallel.backend", "nccl needs CUDA tensors; use gloo (or auto) with train.device: cpu");
  positive("parallel.timeout_s", c.parallel.timeout_s);

  validate_lazy_device(c);
  positive("logging.interval", c.logging.interval);
  if (c.logging.skip_first < 0) fail("logging.skip_first", "must be >= 0");
  if (c.logging.profile_step < 0) fail("logging.profile_step", "must be >= 0 (0 = off)");
  if (c.logging.memory_timeline < 0) fail("logging.memory_timeline", "must be >= 0 (0 = off)");
  if (c.logging.memory_timeline > 0 && (t.device == DeviceChoice::kLazy || !c.memory.track_cpu))
    fail("logging.memory_timeline", "records the tracking CPU allocator: it needs train.device: cpu (or auto on a "
                                    "machine without CUDA) and memory.track_cpu: true");
  if (t.device != DeviceChoice::kAuto)
    validate_resolved_device(c, t.device == DeviceChoice::kCuda);  // auto: in the trainer's set-up, once resolved
  if (!(c.logging.peak_tflops >= 0.0)) fail("logging.peak_tflops", "must be >= 0 (0 = measure)");
}

}  // namespace

void validate_resolved_device(const RunConfig& c, bool on_cuda) {
  if (c.precision.tf32 == Tf32::kOn && !on_cuda)
    fail("precision.tf32",
         fmt::format("true needs a CUDA device (TF32 is a format of NVIDIA tensor cores), but train.device: "
                     "{} puts this run on the {}: set precision.tf32: auto (on where there is CUDA) or false",
                     c.train.device.name(), c.train.device == DeviceChoice::kLazy ? "lazy test device" : "CPU"));
  if (!on_cuda && c.memory.limit.bytes > 0 && !c.memory.track_cpu)
    fail("memory.limit", fmt::format("on CPU the limit is enforced by the tracking allocator: keep memory.track_cpu: "
                                     "true (train.device: {} puts this run on the CPU)", c.train.device.name()));
  if (c.train.micro_batch.is_auto() && !on_cuda && c.memory.limit.bytes == 0)
    fail("train.micro_batch", fmt::format("auto needs memory.limit on CPU (what has to fit), e.g. memory.limit: 4GiB; "
                                          "train.device: {} puts this run on the CPU", c.train.device.name()));
  if (c.logging.memory_timeline > 0 && on_cuda)
    fail("logging.memory_timeline",
         fmt::format("records the tracking CPU allocator, but train.device: {} puts this run on CUDA: set "
                     "train.device: cpu to record a step's timeline, or logging.memory_timeline: 0 to train on CUDA",
                     c.train.device.name()));
}

namespace {

// offload.*: host placement follows the engine's shard (the masters, moments and gradient shard it
// keeps per rank; under DDP the whole model), so state offload needs the engine; each kind needs the
// stage that makes it a per-rank buffer of its own.
void validate_offload(const RunConfig& c) {
  const auto& o = c.offload;
  const Sharding sh = c.parallel.sharding;
  // DDP (none) keeps the whole model on every rank: at world > 1 each rank offloads it whole; one
  // process without sharding has no engine to hold the masters, and zero1 there is the same math.
  if (o.optimizer && !c.parallel.uses_engine(c.world_size))
    fail("offload.optimizer",
         "places the optimizer's fp32 masters and moments in host memory, which the sharding engine "
         "holds: at world size 1 set parallel.sharding: zero1 (the same numbers as none), or run "
         "DDP at world size > 1");
  if ((o.gradients || o.parameters) && !o.optimizer)
    fail(o.gradients ? "offload.gradients" : "offload.parameters",
         "the host AdamW step reads the gradients and writes the masters there: set offload.optimizer: true too");
  if (o.gradients && !sh.shards_grads())
    fail("offload.gradients",
         fmt::format("streams each reduced gradient group to the host, which parallel.sharding zero2 "
                     "or zero3 does (sharding is '{}')",
                     sh.name()));
  if (o.parameters && !sh.shards_params())
    fail("offload.parameters",
         fmt::format("gathers each unit from the host as zero3 gathers it: set parallel.sharding: "
                     "zero3 (sharding is '{}')",
                     sh.name()));
  if (o.optimizer && sh.shards_params() && !o.parameters)
    fail("offload.parameters", "under zero3 the fp32 masters are the only copy of the weights kept between uses, so "
                               "offloading the optimizer offloads the parameters: set offload.parameters: true");
  const auto mode = c.checkpointing.mode;
  if (o.activations && (mode == CheckpointingMode::kNone || mode == CheckpointingMode::kSelective))
    fail("offload.activations",
         fmt::format("offloads the inputs of checkpointed blocks, and mode '{}' checkpoints none: "
                     "use full, interval, sqrt or budget",
                     mode.name()));
  if (!(o.bandwidth_gbps > 0.0)) fail("offload.bandwidth_gbps", "must be > 0");
  if (!(o.overlap >= 0.0 && o.overlap <= 1.0))
    fail("offload.overlap", fmt::format("must be in [0, 1], got {}", o.overlap));
  if (!(o.host_gbps > 0.0)) fail("offload.host_gbps", "must be > 0");
}

// parallel.sequence: the degree splits the world, each sequence's positions and the heads evenly.
void validate_sequence(const RunConfig& c) {
  const int64_t n = c.parallel.sequence;
  positive("parallel.sequence", n);
  if (!(c.parallel.all_to_all_gbps > 0.0)) fail("parallel.all_to_all_gbps", "must be > 0");
  if (n == 1) return;
  // Every value the degree does not divide, in one message.
  std::string broken;
  const auto add = [&broken](const std::string& what) { broken += (broken.empty() ? "" : ", ") + what; };
  if (c.model.n_head % n != 0)
    add(fmt::format("model.n_head = {} (each rank attends with n_head / N heads)", c.model.n_head));
  if (c.train.seq_len % n != 0)
    add(fmt::format("train.seq_len = {} (each rank holds seq_len / N positions)", c.train.seq_len));
  const int64_t world = std::max<int64_t>(1, c.world_size);
  if (world % n != 0) add(fmt::format("WORLD_SIZE = {} (data-parallel ranks x N)", world));
  if (!broken.empty())
    fail("parallel.sequence", fmt::format("{} does not divide {}: pick a degree that divides each", n, broken));
  if (c.train.device == DeviceChoice::kLazy)
    fail("parallel.sequence", "must be 1 with train.device: lazy (a test device that runs one process)");
  if (c.train.micro_batch.is_auto())
    fail("train.micro_batch", fmt::format("auto probes micro-batches in one process, which cannot exchange a sequence "
                                          "group's attention (parallel.sequence = {}): set a number (`trainer plan` "
                                          "predicts each one's memory)", n));
}

void validate_state(const RunConfig& c) {
  const auto& st = c.state;
  if (st.every < 0)
    fail("state.every", fmt::format("must be >= 0 (0 = only at the end and on a signal), got {}", st.every));
  if (st.keep < 0) fail("state.keep", fmt::format("must be >= 0 (0 = keep every state), got {}", st.keep));
}

}  // namespace

// optim.in_backward: what needs every gradient before any update, or more than one process, is refused.
void validate_optim(const RunConfig& c) {
  if (!c.optim.in_backward) return;
  const auto refuse = [](const std::string& key, const std::string& why) {
    fail(key, "cannot run with optim.in_backward: " + why);
  };
  const auto& t = c.train;
  if (t.grad_accum != 1)
    refuse("train.grad_accum", fmt::format("{} micro-batches would need each gradient kept until the last; set 1",
                                           t.grad_accum));
  if (t.grad_clip > 0.0)
    refuse("train.grad_clip", fmt::format("{}: clipping scales by the global norm, known only once every gradient "
                                          "is; set 0 (the norm is still logged)", t.grad_clip));
  if (c.precision.compute == Dtype::kFp16)
    refuse("precision.compute", "fp16's loss scaler skips a step whose gradients overflow, after the updates ran; "
                                "use bf16 or fp32");
  if (c.world_size > 1 || c.parallel.sequence > 1 || !c.parallel.sharding.replicated())
    refuse("parallel.sharding", fmt::format("it runs in one process without sharding (world size {}, sharding {}, "
                                            "sequence degree {})", c.world_size, c.parallel.sharding.name(),
                                            c.parallel.sequence));
  if (c.offload.any_state())
    refuse("offload.optimizer", "offloaded model states are stepped by the data-parallel engine, after the backward");
  if (t.on_spike == OnSpike::kSkip || t.on_spike == OnSpike::kStop)
    refuse("train.on_spike", fmt::format("{} keeps the weights of a spiking step, which the backward has already "
                                         "updated; use warn or off", t.on_spike.name()));
  if (t.on_nonfinite == OnNonfinite::kSkip)
    refuse("train.on_nonfinite", "skip keeps the weights of a step with a non-finite gradient, which the backward "
                                 "has already updated; use abort");
  if (t.cuda_graphs == CudaGraphs::kOn)
    refuse("train.cuda_graphs", "a graph replays the updates with the step counts of its capture; use off or auto");
}

void validate(const RunConfig& c) {
  validate_model(c);
  validate_data(c);
  validate_train(c);
  validate_checkpointing(c);
  validate_precision(c);
  validate_devices_and_logging(c);
  validate_offload(c);
  validate_sequence(c);
  validate_state(c);
  validate_optim(c);
}

}  // namespace sl::config
