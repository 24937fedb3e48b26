// Recipe loading: a table of every key (type, doc, accessors), YAML walking with line numbers,
// presets, --set overrides, validation and JSON output.
#include "config/config.h"

#include <cmath>
#include <concepts>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "config/shape.h"
#include "errors.h"

namespace sl::config {
namespace {

using Json = nlohmann::json;

// One recipe key: where it lives, what it means, and how to read/write it.
struct Field {
  std::string section, key, type, doc;
  std::function<void(RunConfig&, const YAML::Node&)> set;
  std::function<Json(const RunConfig&)> get;
  std::string name() const { return section + "." + key; }
};

std::string where(const YAML::Node& node) {
  if (node.Mark().is_null()) return "";
  return fmt::format(" (line {})", node.Mark().line + 1);
}

// A named choice (choices.h): read from a string, written as it.
template <class T> concept Choice = requires(std::string_view name) {
  { T::parse(name) } -> std::same_as<std::optional<T>>;
};

// A recipe value written as text and parsed where it is read: a size, the budget, the loss scale.
template <class T> concept ParsedText = std::is_same_v<T, Bytes> || std::is_same_v<T, Budget> || std::is_same_v<T, LossScale>;

Bytes parse_size(const std::string& text, const std::string& key) { return {parse_bytes(text, key), text}; }
Budget parse_budget(const std::string& text);
LossScale parse_loss_scale(const std::string& text);

template <class T> const char* type_name() {
  if constexpr (Choice<T> || ParsedText<T>) return "string";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else if constexpr (std::is_same_v<T, std::string>) return "string";
  else return "list";
}

template <class T> T convert(const YAML::Node& node, const std::string& name) {
  auto fail = [&]() -> T {
    std::string got = node.IsScalar() ? "'" + node.Scalar() + "'"
                      : node.IsSequence() ? "a list"
                      : node.IsMap()      ? "a map"
                                          : "nothing";
    throw ConfigError(fmt::format("{}: expected {}, got {}{}", name, type_name<T>(), got, where(node)));
  };
  if constexpr (std::is_same_v<T, std::vector<std::string>> || std::is_same_v<T, std::vector<int64_t>>) {
    if (!node.IsSequence()) return fail();
    T out;
    for (const auto& item : node) {
      if (!item.IsScalar()) return fail();
      try {
        out.push_back(item.as<typename T::value_type>());
      } catch (const YAML::Exception&) {
        return fail();
      }
    }
    return out;
  } else if constexpr (Choice<T>) {
    // Checked here, where the recipe is read: past the parser a choice is a value, never a name.
    const auto text = convert<std::string>(node, name);
    if (const auto v = T::parse(text)) return *v;
    throw ConfigError(fmt::format("{}: '{}' is not one of {}{}", name, text, choice_list<T>(), where(node)));
  } else if constexpr (ParsedText<T>) {
    const auto text = convert<std::string>(node, name);
    try {
      if constexpr (std::is_same_v<T, Bytes>) return parse_size(text, name);
      else if constexpr (std::is_same_v<T, Budget>) return parse_budget(text);
      else return parse_loss_scale(text);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string(e.what()) + where(node));
    }
  } else {
    if (!node.IsScalar()) return fail();
    try {
      return node.as<T>();
    } catch (const YAML::Exception&) {
      return fail();
    }
  }
}

template <class S, class T>
Field field(S RunConfig::*sec, T S::*mem, const char* section, const char* key, const char* doc) {
  Field f{section, key, type_name<T>(), doc, {}, {}};
  std::string name = f.name();
  f.set = [sec, mem, name](RunConfig& c, const YAML::Node& n) { (c.*sec).*mem = convert<T>(n, name); };
  f.get = [sec, mem](const RunConfig& c) { return Json((c.*sec).*mem); };
  return f;
}

// train.micro_batch is an integer or "auto": the largest that fits memory.limit (MicroBatch).
Field micro_batch_field() {
  Field f{"train", "micro_batch", "integer|auto",
          "sequences per forward/backward B; auto = the largest that fits memory.limit, keeping train.global_batch",
          {}, {}};
  f.set = [](RunConfig& c, const YAML::Node& n) {
    c.train.micro_batch = n.IsScalar() && n.Scalar() == "auto" ? MicroBatch::automatic() : MicroBatch(convert<int64_t>(n, "train.micro_batch"));
  };
  f.get = [](const RunConfig& c) { return Json(c.train.micro_batch); };
  return f;
}

namespace {

// The model section's keys, in the order --help-config and the reference list them.
std::vector<Field> model_fields() {
  using R = RunConfig;
  using M = ModelConfig;
  return {
      field(&R::model, &M::preset, "model", "preset", "named shape: tiny | gpt2-124m | gpt2-350m | 1.3b | 7b (\"\" = none); keys given next to it override it"),
      field(&R::model, &M::arch, "model", "arch", "gpt2 (LayerNorm, GELU, learned positions) | llama (RMSNorm, SwiGLU, RoPE)"),
      field(&R::model, &M::n_layer, "model", "n_layer", "transformer blocks L"),
      field(&R::model, &M::n_head, "model", "n_head", "attention heads; n_embd must divide by it"),
      field(&R::model, &M::n_embd, "model", "n_embd", "hidden size d"),
      field(&R::model, &M::vocab_size, "model", "vocab_size", "vocabulary size; every token id must be below it"),
      field(&R::model, &M::vocab_multiple, "model", "vocab_multiple", "the token embedding (and an untied LM head) get vocab_size rounded up to a multiple of it rows, for faster matmul shapes (128: GPT-2's 50257 -> 50304); the extra rows stay zero, never enter the loss or the sampled logits, and export leaves them out; 1 = no padding"),
      field(&R::model, &M::max_seq_len, "model", "max_seq_len", "context length (position table / RoPE table)"),
      field(&R::model, &M::mlp_hidden, "model", "mlp_hidden", "MLP inner size; 0 = 4d (gpt2) or 2/3*4d rounded up to 256 (llama)"),
      field(&R::model, &M::layer_mlp_hidden, "model", "layer_mlp_hidden", "per-block MLP inner sizes, n_layer entries (0 = model.mlp_hidden's), for models whose blocks differ; [] = every block model.mlp_hidden"),
      field(&R::model, &M::dropout, "model", "dropout", "dropout on embeddings, attention probabilities and residual branches"),
      field(&R::model, &M::bias, "model", "bias", "biases in linear layers and LayerNorm"),
      field(&R::model, &M::tie_embeddings, "model", "tie_embeddings", "LM head shares the token embedding matrix"),
      field(&R::model, &M::norm_eps, "model", "norm_eps", "epsilon of LayerNorm / RMSNorm"),
      field(&R::model, &M::rope_theta, "model", "rope_theta", "RoPE base frequency (llama)"),
      field(&R::model, &M::init_std, "model", "init_std", "init std of weights; residual projections use init_std/sqrt(2L)"),
      field(&R::model, &M::init_from, "model", "init_from", "start from Hugging Face weights: a model.safetensors (GPT2LMHeadModel / LlamaForCausalLM names) or a directory holding one; its config.json, when beside it, is checked against the recipe; \"\" = random init"),
      field(&R::model, &M::loss_chunk, "model", "loss_chunk", "positions per chunk of the LM head and loss, which run fused so the logits of the whole micro-batch never exist; 0 = auto (a chunk's fp32 logits <= 64 MiB); not part of the model: saved states and exports ignore it"),
  };
}

// The data section's keys, in the order --help-config and the reference list them.
std::vector<Field> data_fields() {
  using R = RunConfig;
  using D = DataConfig;
  return {
      field(&R::data, &D::source, "data", "source", "llmc (llm.c token shard: header + uint16/uint32 tokens; `bin` is its old name) | raw (headerless tokens, nanoGPT's prepare.py output; width from raw_dtype) | text (UTF-8, one token per byte) | synthetic"),
      field(&R::data, &D::raw_dtype, "data", "raw_dtype", "token width of source: raw files: uint16 (nanoGPT) | uint32"),
      field(&R::data, &D::path, "data", "path", "training file (llmc, raw or text), relative to the working directory"),
      field(&R::data, &D::val_path, "data", "val_path", "held-out file of the same kind; \"\" = hold out the last val_fraction of path"),
      field(&R::data, &D::val_fraction, "data", "val_fraction", "share of path held out for eval when val_path is \"\""),
      field(&R::data, &D::synthetic_tokens, "data", "synthetic_tokens", "corpus length in tokens for source: synthetic"),
      field(&R::data, &D::tokenizer, "data", "tokenizer", "the tokenizer.json the shards were made with (scripts/prepare_data.py writes it beside them); its vocabulary must match model.vocab_size; the run keeps a copy and its exported weights carry it; \"\" = tokenizer.json beside data.path when there is one"),
  };
}

// The train section's keys, in the order --help-config and the reference list them.
std::vector<Field> train_fields() {
  using R = RunConfig;
  using T = TrainConfig;
  return {
      field(&R::train, &T::seq_len, "train", "seq_len", "tokens per sequence T (<= model.max_seq_len)"),
      micro_batch_field(),
      field(&R::train, &T::global_batch, "train", "global_batch", "sequences per optimizer step over all ranks (micro_batch * grad_accum * WORLD_SIZE), kept by micro_batch: auto; 0 = derived"),
      field(&R::train, &T::grad_accum, "train", "grad_accum", "micro-batches per optimizer step (loss is normalized so one step equals one big batch)"),
      field(&R::train, &T::steps, "train", "steps", "optimizer steps"),
      field(&R::train, &T::lr, "train", "lr", "peak learning rate"),
      field(&R::train, &T::min_lr, "train", "min_lr", "learning rate at the end of the cosine decay"),
      field(&R::train, &T::warmup_steps, "train", "warmup_steps", "linear learning-rate warm-up steps"),
      field(&R::train, &T::weight_decay, "train", "weight_decay", "AdamW weight decay, applied to matrices (dim >= 2) only"),
      field(&R::train, &T::beta1, "train", "beta1", "AdamW beta1"),
      field(&R::train, &T::beta2, "train", "beta2", "AdamW beta2"),
      field(&R::train, &T::grad_clip, "train", "grad_clip", "global gradient-norm clip; 0 = off"),
      field(&R::train, &T::eval_interval, "train", "eval_interval", "eval loss on the held-out split every N steps and at the end; 0 = never"),
      field(&R::train, &T::eval_batches, "train", "eval_batches", "micro-batches per eval"),
      field(&R::train, &T::seed, "train", "seed", "seeds initialization, dropout and batch sampling"),
      field(&R::train, &T::device, "train", "device", "auto | cpu | cuda (auto = cuda when available) | lazy (a TEST device: LibTorch's lazy-tensor TorchScript backend, not the CPU but running on it; world 1, fp32, no sharding, no memory.limit, no budget mode)"),
      field(&R::train, &T::threads, "train", "threads", "CPU intra-op threads; 0 = all cores"),
      field(&R::train, &T::on_nonfinite, "train", "on_nonfinite", "fp32/bf16 gradients with NaN/Inf (finite loss): abort (exit 6 before the optimizer step) | skip (weights untouched, a skip event)"),
      field(&R::train, &T::on_spike, "train", "on_spike", "a loss spike (loss > spike_threshold x the moving average of earlier steps' losses): off | warn (a spike event and a console warning; the step counts) | skip (weights untouched; the step counts as skipped) | stop (weights untouched, the state saved, exit 6); each spike is a spike event"),
      field(&R::train, &T::spike_threshold, "train", "spike_threshold", "train.on_spike: a step is a spike when its loss exceeds this multiple of the moving average (> 1)"),
      field(&R::train, &T::spike_window, "train", "spike_window", "train.on_spike: the moving average's horizon in steps (the mean of the first N losses, then an exponential average of weight 1/N); no step is a spike before N steps"),
      field(&R::train, &T::sample_interval, "train", "sample_interval", "print (and log as a sample event) a greedy continuation every N steps and at the end; needs a tokenizer (data.tokenizer); 0 = never"),
      field(&R::train, &T::sample_tokens, "train", "sample_tokens", "new tokens per training-time sample"),
      field(&R::train, &T::sample_prompt, "train", "sample_prompt", "prompt of the training-time sample; \"\" = the tokenizer's end-of-text token"),
      field(&R::train, &T::cuda_graphs, "train", "cuda_graphs", "off | on | auto: a micro-batch's forward and backward captured into a CUDA graph after 3 eager warm-up micro-batches and replayed for every later one; auto = where the run is eligible (one process without sharding or with zero1, CUDA, no offload, no fp16, no memory.limit, no memory timeline, model.dropout 0), eager elsewhere with the reason in the settings and summary.json; on = as auto, warning when not eligible; off = eager (the default: the graph's memory pool stays reserved for the run)"),
  };
}

// The checkpointing section's keys, in the order --help-config and the reference list them.
std::vector<Field> checkpointing_fields() {
  using R = RunConfig;
  using C = CheckpointingConfig;
  return {
      field(&R::checkpointing, &C::mode, "checkpointing", "mode", "none | full | interval | sqrt | selective | budget (per block keep / selective parts / recompute, the least recompute time under checkpointing.budget)"),
      field(&R::checkpointing, &C::interval, "checkpointing", "interval", "interval mode: k consecutive blocks per segment"),
      field(&R::checkpointing, &C::segments, "checkpointing", "segments", "interval mode alternative: number of segments (give interval or segments, not both)"),
      field(&R::checkpointing, &C::recompute, "checkpointing", "recompute", "selective mode: parts to recompute, any of [attention, mlp, norm]"),
      field(&R::checkpointing, &C::skip_last, "checkpointing", "skip_last", "keep the last segment's activations (recomputing them saves nothing at peak)"),
      field(&R::checkpointing, &C::budget, "checkpointing", "budget", "budget mode: activation memory per step (under zero3 the gathered units count too): a size such as 6GiB, or a share such as 90% of what memory.limit leaves after model states, batch and buffers; \"\" = 100% of that"),
      field(&R::checkpointing, &C::profile_costs, "checkpointing", "profile_costs", "budget mode: time each kind of block's parts in a short pass of real forwards at the run's shape and precision; false (or `trainer --no-profile`) = the FLOP formula"),
      field(&R::checkpointing, &C::exchange, "checkpointing", "exchange", "auto | redo | keep: under parallel.sequence > 1, what a recompute does about the attention's two all-to-alls: redo them, or keep what the first pass received (the gathered q, k, v and the attention output: 4 x n_embd values per local token per recomputed block) and communicate nothing more; auto = mode budget chooses per block by its cost model, the other modes redo"),
      field(&R::checkpointing, &C::preserve_rng, "checkpointing", "preserve_rng", "replay the forward's RNG state during recompute (exact dropout)"),
      field(&R::checkpointing, &C::check_recompute, "checkpointing", "check_recompute", "verify recomputed outputs match the forward's shapes and dtypes"),
  };
}

// The precision section's keys, in the order --help-config and the reference list them.
std::vector<Field> precision_fields() {
  using R = RunConfig;
  return {
      field(&R::precision, &PrecisionConfig::compute, "precision", "compute", "fp32 | bf16 | fp16: autocast's compute dtype on the run's device; weights and optimizer states stay fp32"),
      field(&R::precision, &PrecisionConfig::param_dtype, "precision", "param_dtype", "fp32 | bf16 | fp16: dtype of the parameters the forward and backward use; not fp32 needs parallel.sharding zero1/2/3 (fp32 master weights and AdamW states stay in the rank's shard; the all-gather moves this dtype) and precision.compute of the same dtype"),
      field(&R::precision, &PrecisionConfig::reduce_dtype, "precision", "reduce_dtype", "fp32 | bf16 | fp16: dtype gradients are reduce-scattered in (zero2/3); not fp32 halves the traffic but rounds every rank's gradient before the sum (lossy)"),
      field(&R::precision, &PrecisionConfig::tf32, "precision", "tf32", "auto | true | false: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (inputs rounded to 10 mantissa bits, fp32 sums), as nanoGPT and llm.c train; auto = on for a CUDA run, off elsewhere; true needs CUDA. bf16/fp16 matmuls are not concerned"),
      field(&R::precision, &PrecisionConfig::loss_scale, "precision", "loss_scale", "fp16 only: dynamic, or a fixed number to multiply the loss by"),
      field(&R::precision, &PrecisionConfig::init_scale, "precision", "init_scale", "fp16 dynamic scaling: starting scale"),
      field(&R::precision, &PrecisionConfig::growth_factor, "precision", "growth_factor", "fp16 dynamic scaling: scale multiplier after growth_interval clean steps"),
      field(&R::precision, &PrecisionConfig::backoff_factor, "precision", "backoff_factor", "fp16 dynamic scaling: scale multiplier after a step with non-finite gradients"),
      field(&R::precision, &PrecisionConfig::growth_interval, "precision", "growth_interval", "fp16 dynamic scaling: clean steps between growths"),
      field(&R::precision, &PrecisionConfig::max_skipped_steps, "precision", "max_skipped_steps", "fp16: this many skipped steps in a row mean the run diverged (exit 6); 0 = never give up"),
  };
}

// The parallel section's keys, in the order --help-config and the reference list them.
std::vector<Field> parallel_fields() {
  using R = RunConfig;
  return {
      field(&R::parallel, &ParallelConfig::backend, "parallel", "backend", "auto | gloo | nccl (auto: NCCL on CUDA, Gloo on CPU); used when WORLD_SIZE > 1"),
      field(&R::parallel, &ParallelConfig::sharding, "parallel", "sharding", "none (DDP) | zero1 (optimizer states) | zero2 (+ gradients) | zero3 (+ parameters, per block)"),
      field(&R::parallel, &ParallelConfig::bucket_mb, "parallel", "bucket_mb", "sharding none: gradient all-reduce bucket size in MiB (buckets launch from gradient hooks during backward)"),
      field(&R::parallel, &ParallelConfig::sequence, "parallel", "sequence", "sequence-parallel degree N (Ulysses): each group of N consecutive ranks trains the same sequences, every rank holding seq_len / N positions of every activation, attention exchanging positions for heads with an all-to-all; WORLD_SIZE = data-parallel ranks x N. N must divide model.n_head, train.seq_len and WORLD_SIZE"),
      field(&R::parallel, &ParallelConfig::all_to_all_gbps, "parallel", "all_to_all_gbps", "parallel.sequence > 1: what a rank sends per second in its group's all-to-all (GB/s), for the planner's modelled step time and budget mode's price of a recomputed exchange (100: a conservative share of NVLink inside a node; measure with nccl-tests' alltoall_perf)"),
      field(&R::parallel, &ParallelConfig::timeout_s, "parallel", "timeout_s", "rendezvous and collective timeout in seconds: a dead or hung rank makes the others exit 5 within it"),
  };
}

// The memory section's keys, in the order --help-config and the reference list them.
std::vector<Field> memory_fields() {
  using R = RunConfig;
  return {
      field(&R::memory, &MemoryConfig::track_cpu, "memory", "track_cpu", "install the tracking CPU allocator so CPU peak bytes are exact"),
      field(&R::memory, &MemoryConfig::limit, "memory", "limit", "device-memory limit on the bytes in live tensors (allocated bytes, on CPU and CUDA), e.g. 8GiB (units B, KiB, MiB, GiB, KB, MB, GB); 0 = none. Past it: out of memory (exit 4). On CUDA the caching allocator's cache (reserved bytes) may pass it"),
      field(&R::memory, &MemoryConfig::host_limit, "memory", "host_limit", "host-memory limit for offloaded state (offload.*), a size like memory.limit; 0 = none. Past it: exit 4 naming host memory"),
  };
}

// The offload section's keys, in the order --help-config and the reference list them.
std::vector<Field> offload_fields() {
  using R = RunConfig;
  using O = OffloadConfig;
  return {
      field(&R::offload, &O::optimizer, "offload", "optimizer", "fp32 master weights and AdamW moments in host memory; the AdamW step runs on the host (parallel.sharding zero1/2/3 at any world size, or none (DDP) at world size > 1)"),
      field(&R::offload, &O::gradients, "offload", "gradients", "the gradient shard accumulated in host memory: each group's gradient leaves the device as soon as it is reduced (needs zero2/zero3 and offload.optimizer)"),
      field(&R::offload, &O::parameters, "offload", "parameters", "no device copy of the weights between uses: each unit is gathered from the host masters before its forward, backward and recompute (needs zero3 and offload.optimizer)"),
      field(&R::offload, &O::activations, "offload", "activations", "checkpointed blocks' inputs go to host memory in forward and come back one block ahead of their backward (needs a checkpointing mode that checkpoints blocks)"),
      field(&R::offload, &O::bandwidth_gbps, "offload", "bandwidth_gbps", "host <-> device copy rate per direction in GB/s, for the planner's transfer time (25 = PCIe 4.0 x16 with pinned memory)"),
      field(&R::offload, &O::overlap, "offload", "overlap", "share of the streamed transfers (gradients, parameters, activations) hidden behind compute in the planner's step time, in [0, 1]"),
      field(&R::offload, &O::host_gbps, "offload", "host_gbps", "host memory rate in GB/s for the planner's host AdamW time (28 bytes read and written per parameter)"),
  };
}

// The logging section's keys, in the order --help-config and the reference list them.
std::vector<Field> logging_fields() {
  using R = RunConfig;
  return {
      field(&R::logging, &LoggingConfig::dir, "logging", "dir", "run directory; \"\" = runs/<recipe name>-<timestamp>"),
      field(&R::logging, &LoggingConfig::interval, "logging", "interval", "console line every N steps"),
      field(&R::logging, &LoggingConfig::skip_first, "logging", "skip_first", "warm-up steps excluded from the medians in summary.json"),
      field(&R::logging, &LoggingConfig::peak_tflops, "logging", "peak_tflops", "device peak TFLOP/s for MFU in the compute dtype; 0 = a datasheet peak for known CUDA devices, else the best GEMM rate in precision.compute over 0.5 s (512^3, 1024^3, the model's shapes) measured at start. A step faster than the peak raises it (MFU <= 1)"),
      field(&R::logging, &LoggingConfig::progress, "logging", "progress", "progress bar when stdout is a terminal"),
      field(&R::logging, &LoggingConfig::save_model, "logging", "save_model", "write the final weights to <run dir>/model/{model.safetensors, config.json} in Hugging Face layout, fp32 (zero3 streams them unit by unit)"),
      field(&R::logging, &LoggingConfig::profile_step, "logging", "profile_step", "record this optimizer step (1-based; rank 0) with LibTorch's profiler into <run dir>/profile.json (Chrome trace); 0 = off"),
      field(&R::logging, &LoggingConfig::memory_timeline, "logging", "memory_timeline", "record every allocation and free of this optimizer step (1-based; rank 0; train.device: cpu), labelled weights / gradients / optimizer state / activations and recompute per block / ..., into <run dir>/memory_timeline.json (scripts/plot_timeline.py draws it); 0 = off"),
      field(&R::logging, &LoggingConfig::overwrite, "logging", "overwrite", "allow a run directory that already holds a run's logs (they are replaced); false = refuse with exit 2"),
      field(&R::logging, &LoggingConfig::tensorboard, "logging", "tensorboard", "also write the step metrics, eval loss and memory as a TensorBoard event file in <run dir>/tensorboard/ (rank 0)"),
  };
}

// The state section's keys, in the order --help-config and the reference list them.
std::vector<Field> state_fields() {
  using R = RunConfig;
  return {
      field(&R::state, &StateConfig::every, "state", "every", "save the training state every N optimizer steps; 0 = only at the end and on SIGTERM/SIGINT"),
      field(&R::state, &StateConfig::keep, "state", "keep", "newest saved states kept (older ones are deleted after a newer one is complete); 0 = all"),
      field(&R::state, &StateConfig::dir, "state", "dir", "where states are written; \"\" = <run dir>/state"),
      field(&R::state, &StateConfig::at_end, "state", "at_end", "save after the last step"),
      field(&R::state, &StateConfig::on_signal, "state", "on_signal", "on SIGTERM/SIGINT: finish the step, save, then exit 143/130"),
      field(&R::state, &StateConfig::async, "state", "async", "state.every saves are written by a background thread from a host snapshot of this rank's state while training goes on; published (meta.json, latest) once every rank's file is on disk; a new save waits for the previous one; saves at the end, on a signal or a spike complete before the run exits"),
  };
}

}  // namespace

const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> all;
    for (auto section : {model_fields, data_fields, train_fields, checkpointing_fields, precision_fields, parallel_fields, memory_fields, offload_fields, logging_fields, state_fields})
      for (auto& f : section()) all.push_back(std::move(f));
    return all;
  }();
  return table;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const auto& f : fields())
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::string& s) {
  for (const auto& f : fields())
    if (f.section == s) return true;
  return false;
}

std::string keys_of(const std::string& section) {
  std::string out;
  for (const auto& f : fields())
    if (f.section == section) out += (out.empty() ? "" : ", ") + f.key;
  return out;
}

std::string section_names() {
  std::string out;
  for (const auto& f : fields())
    if (out.find(f.section) == std::string::npos) out += (out.empty() ? "" : ", ") + f.section;
  return out;
}

struct Override {
  std::string section, key;
  YAML::Node value;
};

Override parse_override(const std::string& text) {
  auto eq = text.find('=');
  auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq)
    throw ConfigError(fmt::format("--set '{}': expected section.key=value, e.g. --set train.steps=50", text));
  Override o{text.substr(0, dot), text.substr(dot + 1, eq - dot - 1), {}};
  if (!is_section(o.section))
    throw ConfigError(fmt::format("--set {}.{}: unknown section '{}' (sections: {})", o.section, o.key,
                                  o.section, section_names()));
  if (!find_field(o.section, o.key))
    throw ConfigError(fmt::format("--set {}.{}: unknown key '{}' in section {} (keys: {})", o.section,
                                  o.key, o.key, o.section, keys_of(o.section)));
  std::string value = text.substr(eq + 1);
  try {
    o.value.reset(value.empty() ? YAML::Node(std::string()) : YAML::Load(value));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("--set {}.{}: cannot parse value '{}': {}", o.section, o.key, value, e.msg));
  }
  if (o.value.IsNull()) o.value.reset(YAML::Node(std::string()));
  // A value from --set stands on no line of a file: a fresh scalar node carries no parser mark, so a
  // message about it names the key alone.
  else if (o.value.IsScalar()) o.value.reset(YAML::Node(o.value.Scalar()));
  return o;
}

// A mapping key as text. Keys are plain names; a list or map as a key is refused here (yaml-cpp's
// as<std::string>() would throw a raw BadConversion).
std::string key_text(const YAML::Node& key, const std::string& origin) {
  if (!key.IsScalar())
    throw ConfigError(fmt::format("{}: a key{} is not a plain name (a list, map or null used as a key)", origin,
                                  where(key)));
  return key.Scalar();
}

// "lines 2 and 3", or "line 1, columns 9 and 19" for a flow mapping written on one line.
std::string both_places(const YAML::Mark& a, const YAML::Mark& b) {
  if (a.line != b.line) return fmt::format("lines {} and {}", a.line + 1, b.line + 1);
  return fmt::format("line {}, columns {} and {}", a.line + 1, a.column + 1, b.column + 1);
}

// yaml-cpp (0.7 and 0.8) keeps every pair of a mapping, a repeated key included: iterating yields
// both pairs (each key node with its own Mark), while operator[] finds only the first. So a key given
// twice would be half-applied silently; refuse it, naming both places. `kind` is "section" or "key",
// `prefix` the section ("train.") for keys.
void check_unique_keys(const YAML::Node& map, const std::string& origin, const char* kind,
                       const std::string& prefix) {
  std::map<std::string, YAML::Mark> first;
  for (const auto& kv : map) {
    auto [it, fresh] = first.emplace(key_text(kv.first, origin), kv.first.Mark());
    if (!fresh)
      throw ConfigError(fmt::format("{}: {} '{}{}' is given twice ({}); keep one", origin, kind, prefix, it->first,
                                    both_places(it->second, kv.first.Mark())));
  }
}

// What a YAML node is, for messages about the document's shape.
std::string describe(const YAML::Node& node) {
  if (node.IsSequence()) return "a list";
  if (node.IsScalar()) return fmt::format("the single value '{}'", node.Scalar());
  return "empty";
}

// One top-level section: a known name whose body is a map of known, distinct keys (or empty).
void check_section(const YAML::Node& name, const YAML::Node& body, const std::string& origin) {
  std::string s = key_text(name, origin);
  if (!is_section(s))
    throw ConfigError(fmt::format("{}: unknown section '{}'{} (sections: {})", origin, s, where(name),
                                  section_names()));
  if (body.IsNull()) return;
  if (!body.IsMap())
    throw ConfigError(fmt::format("{}: section '{}'{} must be a map of key: value", origin, s, where(name)));
  for (const auto& kv : body) {
    std::string k = key_text(kv.first, origin);
    if (!find_field(s, k))
      throw ConfigError(fmt::format("{}: unknown key '{}.{}'{} (keys of {}: {})", origin, s, k,
                                    where(kv.first), s, keys_of(s)));
  }
  check_unique_keys(body, origin, "key", s + ".");
}

// Checks the YAML tree's shape (a map of known sections, known keys, none twice) before anything is
// applied.
void check_tree(const YAML::Node& root, const std::string& origin) {
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}: the recipe must be a map of sections ({}), not {}{}", origin,
                                  section_names(), describe(root), where(root)));
  for (const auto& sec : root) check_section(sec.first, sec.second, origin);
  check_unique_keys(root, origin, "section", "");
}

// Parses one YAML document (Null when there is nothing but comments). yaml-cpp's Load() would read
// the first of several `---` documents and drop the rest silently, so a second one is refused.
YAML::Node parse_document(const std::string& text, const std::string& origin) {
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: YAML syntax error at line {}: {}", origin, e.mark.line + 1, e.msg));
  }
  while (docs.size() > 1 && docs.back().IsNull()) docs.pop_back();  // a trailing `---` and nothing after
  if (docs.size() > 1)
    throw ConfigError(fmt::format("{}: {} YAML documents (separated by ---); a recipe is one document, the second "
                                  "would be ignored{}", origin, docs.size(), where(docs[1])));
  return docs.empty() ? YAML::Node() : docs.front();
}

}  // namespace

std::vector<std::string> preset_names() { return {"tiny", "gpt2-124m", "gpt2-350m", "1.3b", "7b"}; }

void apply_preset(ModelConfig& m, const std::string& name) {
  auto gpt2 = [&](int64_t L, int64_t h, int64_t d, int64_t ctx) {
    m.arch = Arch::kGpt2, m.n_layer = L, m.n_head = h, m.n_embd = d, m.vocab_size = 50257, m.max_seq_len = ctx;
    m.mlp_hidden = 0, m.bias = true, m.tie_embeddings = true;
  };
  if (name.empty()) return;
  if (name == "tiny") {
    m.arch = Arch::kGpt2, m.n_layer = 4, m.n_head = 4, m.n_embd = 128, m.vocab_size = 256, m.max_seq_len = 256;
    m.mlp_hidden = 0, m.bias = true, m.tie_embeddings = true;
  } else if (name == "gpt2-124m") {
    gpt2(12, 12, 768, 1024);
  } else if (name == "gpt2-350m") {
    gpt2(24, 16, 1024, 1024);
  } else if (name == "1.3b") {
    gpt2(24, 16, 2048, 2048);  // GPT-3 XL shape
  } else if (name == "7b") {
    m.arch = Arch::kLlama, m.n_layer = 32, m.n_head = 32, m.n_embd = 4096, m.vocab_size = 32000;
    m.max_seq_len = 4096, m.mlp_hidden = 11008, m.bias = false, m.tie_embeddings = false;
    m.norm_eps = 1e-6;
  } else {
    std::string names;
    for (auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError(fmt::format("model.preset: unknown preset '{}' (presets: {})", name, names));
  }
}

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

int64_t parse_bytes(const std::string& text, const std::string& key) {
  static const std::pair<const char*, double> units[] = {
      {"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"TB", 1e12},
      {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"kB", 1e3}, {"B", 1.0}};
  const auto not_a_size = [&] {
    return ConfigError(fmt::format("{}: '{}' is not a size; write e.g. 8GiB, 512MiB or 2GB (units B, KiB, MiB, GiB, TiB, "
                                   "KB, MB, GB, TB)", key, text));
  };
  // strtod: a number beyond a double's range reads as +-inf, one below its smallest as (nearly) 0.
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) throw not_a_size();
  std::string unit = text.substr(static_cast<size_t>(end - text.c_str()));
  unit.erase(0, unit.find_first_not_of(' '));
  double scale = unit.empty() ? 1.0 : 0.0;
  for (const auto& [name, factor] : units)
    if (unit == name) scale = factor;
  if (scale == 0.0 || std::isnan(value)) throw not_a_size();
  if (value < 0.0) throw ConfigError(fmt::format("{}: '{}' is negative; a size is 0 or more bytes", key, text));
  // 2^63 bytes (8 EiB) is the first that int64_t cannot hold; doubles hold it exactly, and every double
  // below it converts to int64_t without overflow.
  const double bytes = value * scale;
  if (!(bytes < 9223372036854775808.0))
    throw ConfigError(fmt::format("{}: '{}' is {:.3g} bytes, more than the largest size, 2^63 - 1 bytes (8 EiB); "
                                  "write a size below it", key, text, bytes));
  return static_cast<int64_t>(bytes);
}

void to_json(nlohmann::json& j, const Bytes& b) { j = b.text; }
void to_json(nlohmann::json& j, const Budget& b) { j = b.text; }
void to_json(nlohmann::json& j, const LossScale& s) { j = s.text; }

CheckpointingChoice choice(const CheckpointingConfig& ck) {
  using Mode = CheckpointingMode;
  switch (ck.mode.kind()) {
    case Mode::kNone: return mode::None{};
    case Mode::kFull: return mode::Full{};
    case Mode::kInterval: return mode::Interval{ck.interval, ck.segments};
    case Mode::kSqrt: return mode::Sqrt{};
    case Mode::kSelective: {
      mode::Selective s;
      for (const auto& part : ck.recompute) {
        s.attention |= part == "attention";
        s.mlp |= part == "mlp";
        s.norm |= part == "norm";
      }
      return s;
    }
    case Mode::kBudget: return ck.budget;
  }
  throw std::logic_error("choice: a checkpointing mode without an alternative");
}

namespace {

Budget parse_budget(const std::string& text) {
  if (text.empty()) return {0, 1.0, text};
  if (text.back() == '%') {
    double pct = 0;
    try {
      size_t used = 0;
      pct = std::stod(text.substr(0, text.size() - 1), &used);
      if (used != text.size() - 1) pct = -1;
    } catch (const std::exception&) {
      pct = -1;
    }
    if (!(pct > 0 && pct <= 100))
      throw ConfigError(fmt::format("checkpointing.budget: '{}' is not a share in (0%, 100%], e.g. 90%", text));
    return {0, pct / 100.0, text};
  }
  const int64_t bytes = parse_bytes(text, "checkpointing.budget");
  if (bytes <= 0) throw ConfigError("checkpointing.budget: must be a positive size such as 6GiB, or a share such as 90%");
  return {bytes, 0.0, text};
}

LossScale parse_loss_scale(const std::string& text) {
  if (text == "dynamic") return {0.0, text};
  double fixed = 0.0;
  try {
    fixed = std::stod(text);
  } catch (const std::exception&) {
    throw ConfigError(fmt::format("precision.loss_scale: '{}' is neither dynamic nor a number", text));
  }
  if (!(fixed > 0.0)) throw ConfigError("precision.loss_scale: a fixed scale must be > 0");
  return {fixed, text};
}

}  // namespace

namespace {

// The whole text of a recipe file; a directory or an unreadable file is refused.
std::string read_recipe(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("--config {}: is a directory, not a recipe file (e.g. --config configs/tiny.yaml)", path));
  std::ifstream in(path);
  if (!in)
    throw ConfigError(fmt::format("--config {}: cannot open the recipe file (check the path; recipes live in configs/)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw ConfigError(fmt::format("--config {}: cannot read the recipe file", path));
  return ss.str();
}

// Applies a checked tree: preset, the tree's keys, then --set; validates the result.
RunConfig resolve(const YAML::Node& root, const std::vector<std::string>& overrides, const std::string& origin) {
  check_tree(root, origin);

  std::vector<Override> sets;
  for (const auto& o : overrides) sets.push_back(parse_override(o));

  RunConfig cfg;
  // Preset first (from --set if given, else from the file), then the file's keys, then --set.
  std::string preset;
  // yaml-cpp's operator= on a Node aliases, and non-const operator[] inserts: look up through a
  // const reference and rebind with reset().
  const YAML::Node& croot = root;
  YAML::Node preset_node;
  if (croot["model"] && croot["model"].IsMap() && croot["model"]["preset"]) preset_node.reset(croot["model"]["preset"]);
  for (const auto& o : sets)
    if (o.section == "model" && o.key == "preset") preset_node.reset(o.value);
  if (preset_node.IsDefined() && !preset_node.IsNull()) preset = convert<std::string>(preset_node, "model.preset");
  try {
    apply_preset(cfg.model, preset);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + where(preset_node));
  }
  for (const auto& sec : root) {
    if (sec.second.IsNull()) continue;
    std::string s = sec.first.as<std::string>();
    for (const auto& kv : sec.second) find_field(s, kv.first.as<std::string>())->set(cfg, kv.second);
  }
  for (const auto& o : sets) {
    if (o.value.IsScalar() && o.value.Scalar().empty() && find_field(o.section, o.key)->type != "string")
      throw ConfigError(fmt::format("--set {}.{}: missing value", o.section, o.key));
    find_field(o.section, o.key)->set(cfg, o.value);
  }
  cfg.model.preset = preset;
  cfg.world_size = world_size_from_env();
  validate(cfg);
  return cfg;
}

}  // namespace

// Text with no document (empty, or only comments) stands for the defaults here; a recipe *file*
// must say something (see load()).
RunConfig load_string(const std::string& text, const std::vector<std::string>& overrides,
                      const std::string& origin) {
  YAML::Node root = parse_document(text, origin);
  if (root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));
  return resolve(root, overrides, origin);
}

RunConfig load(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) {
    RunConfig cfg = load_string("", overrides, "<defaults>");
    cfg.recipe_name = "run";
    return cfg;
  }
  YAML::Node root = parse_document(read_recipe(path), path);
  if (root.IsNull())
    throw ConfigError(fmt::format("{}: the recipe is empty (no sections, only comments or nothing); "
                                  "give at least one section, e.g. `model: {{preset: tiny}}`", path));
  RunConfig cfg = resolve(root, overrides, path);
  cfg.recipe_name = std::filesystem::path(path).stem().string();
  return cfg;
}

int64_t world_size_from_env() {
  const char* w = std::getenv("WORLD_SIZE");
  if (!w) return 1;
  char* end = nullptr;
  const long long v = std::strtoll(w, &end, 10);
  return end != w && *end == '\0' && v > 0 ? v : 1;  // a malformed value is reported by the launch code
}

// train.global_batch counts sequences per optimizer step over all ranks.
static void check_global_batch(const RunConfig& c) {
  auto fail = [](const std::string& key, const std::string& msg) { throw ConfigError(fmt::format("{}: {}", key, msg)); };
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

[[noreturn]] void fail(const std::string& key, const std::string& msg) { throw ConfigError(fmt::format("{}: {}", key, msg)); }

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
    if (w[i] < 0) fail("model.layer_mlp_hidden", fmt::format("entry {} (block {}) is {}; sizes must be >= 0", i, i, w[i]));
}

void validate_model(const RunConfig& c) {
  const auto& m = c.model;
  positive("model.n_layer", m.n_layer);
  positive("model.n_head", m.n_head);
  positive("model.n_embd", m.n_embd);
  positive("model.vocab_size", m.vocab_size);
  if (m.vocab_multiple < 1)
    fail("model.vocab_multiple", fmt::format("must be >= 1, got {}; 1 = no padding, 128 pads the vocabulary to a multiple of 128",
                                             m.vocab_multiple));
  if (m.vocab_size > 0 && m.vocab_multiple > INT64_MAX - m.vocab_size)
    fail("model.vocab_multiple", fmt::format("{} with model.vocab_size {} overflows the padded size; use a small multiple such as 128",
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
  if (!(m.dropout >= 0.0 && m.dropout < 1.0)) fail("model.dropout", fmt::format("must be in [0, 1), got {}", m.dropout));
  if (!(m.norm_eps > 0.0)) fail("model.norm_eps", "must be > 0");
  if (!(m.init_std > 0.0)) fail("model.init_std", "must be > 0");
  if (!(m.rope_theta > 0.0)) fail("model.rope_theta", "must be > 0");
}

void validate_data(const RunConfig& c) {
  const auto& m = c.model;
  const auto& d = c.data;
  if (d.source != DataSource::kSynthetic && d.path.empty()) fail("data.path", "is empty; give a token file or a text file");
  if (!(d.val_fraction > 0.0 && d.val_fraction < 1.0))
    fail("data.val_fraction", fmt::format("must be in (0, 1), got {}", d.val_fraction));
  positive("data.synthetic_tokens", d.synthetic_tokens);
  if (d.source == DataSource::kText && m.vocab_size < 256)
    fail("model.vocab_size", fmt::format("text data uses one token per byte, so it must be >= 256, got {}", m.vocab_size));
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
    fail("train.seq_len", fmt::format("{} is longer than the model's context model.max_seq_len = {}", t.seq_len, m.max_seq_len));
  if (!(t.lr > 0.0)) fail("train.lr", fmt::format("must be > 0, got {}", t.lr));
  if (!(t.min_lr >= 0.0 && t.min_lr <= t.lr)) fail("train.min_lr", fmt::format("must be in [0, train.lr = {}], got {}", t.lr, t.min_lr));
  if (t.warmup_steps < 0) fail("train.warmup_steps", "must be >= 0");
  if (!(t.weight_decay >= 0.0)) fail("train.weight_decay", "must be >= 0");
  if (!(t.beta1 >= 0.0 && t.beta1 < 1.0)) fail("train.beta1", "must be in [0, 1)");
  if (!(t.beta2 >= 0.0 && t.beta2 < 1.0)) fail("train.beta2", "must be in [0, 1)");
  if (!(t.grad_clip >= 0.0)) fail("train.grad_clip", "must be >= 0 (0 = off)");
  if (t.eval_interval < 0) fail("train.eval_interval", "must be >= 0 (0 = never)");
  positive("train.eval_batches", t.eval_batches);
  if (t.threads < 0) fail("train.threads", "must be >= 0 (0 = all cores)");
  if (!(t.spike_threshold > 1.0)) fail("train.spike_threshold", fmt::format("must be > 1 (a multiple of the moving average), got {}", t.spike_threshold));
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
    fail("checkpointing.budget", fmt::format("is only used with checkpointing.mode: budget (mode is '{}')", k.mode.name()));
  }
  if (k.interval < 0) fail("checkpointing.interval", "must be >= 0");
  if (k.segments < 0) fail("checkpointing.segments", "must be >= 0");
  if (k.mode == CheckpointingMode::kInterval) {
    if ((k.interval > 0) == (k.segments > 0))
      fail("checkpointing.interval", "interval mode needs exactly one of checkpointing.interval or checkpointing.segments");
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
    fail("checkpointing.recompute", fmt::format("is only used with checkpointing.mode: selective (mode is '{}')", k.mode.name()));
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
    fail("precision.param_dtype", fmt::format("{} keeps fp32 master weights in the optimizer's shard: set parallel.sharding "
                                              "to zero1, zero2 or zero3 (any world size, 1 included)", pr.param_dtype.name()));
  if (pr.reduce_dtype != fp32 && pr.reduce_dtype != pr.param_dtype)
    fail("precision.reduce_dtype", fmt::format("{} needs precision.param_dtype: {} (it is '{}')", pr.reduce_dtype.name(),
                                               pr.reduce_dtype.name(), pr.param_dtype.name()));
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
  if (c.train.micro_batch.is_auto()) why("train.micro_batch", "auto needs memory statistics, which train.device: lazy has not");
  if (c.checkpointing.mode == CheckpointingMode::kBudget) why("checkpointing.mode", "budget profiles device memory, which train.device: lazy has not");
  const auto m = c.checkpointing.mode;
  if (m == CheckpointingMode::kFull || m == CheckpointingMode::kInterval || m == CheckpointingMode::kSqrt)
    why("checkpointing.mode", fmt::format("{} recomputes whole segments, whose replay restores the autocast state of the "
                                          "input's device type, which LibTorch has none of for lazy tensors: use none or "
                                          "selective", m.name()));
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
  if (t.device != DeviceChoice::kAuto) validate_resolved_device(c, t.device == DeviceChoice::kCuda);  // auto: in the trainer's set-up, once resolved
  if (!(c.logging.peak_tflops >= 0.0)) fail("logging.peak_tflops", "must be >= 0 (0 = measure)");
}

}  // namespace

void validate_resolved_device(const RunConfig& c, bool on_cuda) {
  if (c.precision.tf32 == Tf32::kOn && !on_cuda)
    fail("precision.tf32", fmt::format("true needs a CUDA device (TF32 is a format of NVIDIA tensor cores), but train.device: "
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
    fail("offload.optimizer", "places the optimizer's fp32 masters and moments in host memory, which the sharding engine "
                              "holds: at world size 1 set parallel.sharding: zero1 (the same numbers as none), or run "
                              "DDP at world size > 1");
  if ((o.gradients || o.parameters) && !o.optimizer)
    fail(o.gradients ? "offload.gradients" : "offload.parameters",
         "the host AdamW step reads the gradients and writes the masters there: set offload.optimizer: true too");
  if (o.gradients && !sh.shards_grads())
    fail("offload.gradients", fmt::format("streams each reduced gradient group to the host, which parallel.sharding zero2 "
                                          "or zero3 does (sharding is '{}')", sh.name()));
  if (o.parameters && !sh.shards_params())
    fail("offload.parameters", fmt::format("gathers each unit from the host as zero3 gathers it: set parallel.sharding: "
                                           "zero3 (sharding is '{}')", sh.name()));
  if (o.optimizer && sh.shards_params() && !o.parameters)
    fail("offload.parameters", "under zero3 the fp32 masters are the only copy of the weights kept between uses, so "
                               "offloading the optimizer offloads the parameters: set offload.parameters: true");
  const auto mode = c.checkpointing.mode;
  if (o.activations && (mode == CheckpointingMode::kNone || mode == CheckpointingMode::kSelective))
    fail("offload.activations", fmt::format("offloads the inputs of checkpointed blocks, and mode '{}' checkpoints none: "
                                            "use full, interval, sqrt or budget", mode.name()));
  if (!(o.bandwidth_gbps > 0.0)) fail("offload.bandwidth_gbps", "must be > 0");
  if (!(o.overlap >= 0.0 && o.overlap <= 1.0)) fail("offload.overlap", fmt::format("must be in [0, 1], got {}", o.overlap));
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
  if (c.model.n_head % n != 0) add(fmt::format("model.n_head = {} (each rank attends with n_head / N heads)", c.model.n_head));
  if (c.train.seq_len % n != 0) add(fmt::format("train.seq_len = {} (each rank holds seq_len / N positions)", c.train.seq_len));
  const int64_t world = std::max<int64_t>(1, c.world_size);
  if (world % n != 0) add(fmt::format("WORLD_SIZE = {} (data-parallel ranks x N)", world));
  if (!broken.empty()) fail("parallel.sequence", fmt::format("{} does not divide {}: pick a degree that divides each", n, broken));
  if (c.train.device == DeviceChoice::kLazy)
    fail("parallel.sequence", "must be 1 with train.device: lazy (a test device that runs one process)");
  if (c.train.micro_batch.is_auto())
    fail("train.micro_batch", fmt::format("auto probes micro-batches in one process, which cannot exchange a sequence "
                                          "group's attention (parallel.sequence = {}): set a number (`trainer plan` "
                                          "predicts each one's memory)", n));
}

void validate_state(const RunConfig& c) {
  const auto& st = c.state;
  if (st.every < 0) fail("state.every", fmt::format("must be >= 0 (0 = only at the end and on a signal), got {}", st.every));
  if (st.keep < 0) fail("state.keep", fmt::format("must be >= 0 (0 = keep every state), got {}", st.keep));
}

}  // namespace

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
}

nlohmann::json to_json(const RunConfig& cfg) {
  Json j = Json::object();
  for (const auto& f : fields()) j[f.section][f.key] = f.get(cfg);
  return j;
}

std::vector<std::pair<std::string, std::string>> to_rows(const RunConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& f : fields()) {
    Json v = f.get(cfg);
    rows.emplace_back(f.name(), v.is_string() ? v.get<std::string>() : v.dump());
  }
  return rows;
}

std::string help_text() {
  RunConfig defaults;
  std::string out = "Recipe keys (YAML section: key, or --set section.key=value). Precedence: --set > YAML > model.preset > defaults.\n";
  std::string section;
  for (const auto& f : fields()) {
    if (f.section != section) out += fmt::format("\n{}:\n", section = f.section);
    out += fmt::format("  {:<18} {:<8} default {:<22} {}\n", f.key, f.type, f.get(defaults).dump(), f.doc);
  }
  return out;
}

}  // namespace sl::config
