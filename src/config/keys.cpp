// The recipe's key table: every key's section, type, doc and accessors, and what is made from it:
// the lookups, the YAML value reader, JSON output, the start-up table rows and --help-config.
#include "config/keys.h"

#include <concepts>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "errors.h"

namespace sl::config {
namespace {

// A named choice (choices.h): read from a string, written as it.
template <class T> concept Choice = requires(std::string_view name) {
  { T::parse(name) } -> std::same_as<std::optional<T>>;
};

// A recipe value written as text and parsed where it is read: a size, the budget, the loss scale.
template <class T>
concept ParsedText = std::is_same_v<T, Bytes> || std::is_same_v<T, Budget> || std::is_same_v<T, LossScale>;

Bytes parse_size(const std::string& text, const std::string& key) { return {parse_bytes(text, key), text}; }

template <class T> const char* type_name() {
  if constexpr (Choice<T> || ParsedText<T>) return "string";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else if constexpr (std::is_same_v<T, std::string>) return "string";
  else return "list";
}

}  // namespace

std::string where(const YAML::Node& node) {
  if (node.Mark().is_null()) return "";
  return fmt::format(" (line {})", node.Mark().line + 1);
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

template std::string convert<std::string>(const YAML::Node& node, const std::string& name);

namespace {

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
    c.train.micro_batch = n.IsScalar() && n.Scalar() == "auto" ? MicroBatch::automatic()
                                                               : MicroBatch(convert<int64_t>(n, "train.micro_batch"));
  };
  f.get = [](const RunConfig& c) { return Json(c.train.micro_batch); };
  return f;
}

// model.lora is one key holding a map (rank, alpha, dropout, targets), as PEFT's LoraConfig groups them: a
// map given in YAML or by --set 'model.lora={rank: 8}' replaces the keys it names and keeps the others.
Field lora_field() {
  Field f{"model", "lora", "map",
          "LoRA adapters {rank, alpha, dropout, targets, base_dtype}: rank 0 = none; else every other parameter is "
          "frozen (no gradient, no optimizer state, not in saved states) and each target projection learns "
          "(alpha / rank) B A; targets are Hugging Face module names (gpt2: c_attn, attn.c_proj, c_fc, mlp.c_proj; "
          "llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; all-linear; [] = PEFT's default: "
          "c_attn / q_proj, v_proj); dropout is one mask per projection; base_dtype fp32 | bf16: the frozen "
          "matrices' dtype (bf16 needs precision.compute: bf16)",
          {}, {}};
  f.set = [](RunConfig& c, const YAML::Node& n) {
    if (!n.IsMap()) throw ConfigError("model.lora: expected a map {rank, alpha, dropout, targets}" + where(n));
    auto& l = c.model.lora;
    for (const auto& kv : n) {
      const auto key = kv.first.as<std::string>();
      const auto name = "model.lora." + key;
      if (key == "rank") l.rank = convert<int64_t>(kv.second, name);
      else if (key == "alpha") l.alpha = convert<double>(kv.second, name);
      else if (key == "dropout") l.dropout = convert<double>(kv.second, name);
      else if (key == "targets") l.targets = convert<std::vector<std::string>>(kv.second, name);
      else if (key == "base_dtype") l.base_dtype = convert<Dtype>(kv.second, name);
      else throw ConfigError(fmt::format("model.lora: unknown key '{}'{} (keys: rank, alpha, dropout, targets, "
                                         "base_dtype)", key, where(kv.first)));
    }
  };
  f.get = [](const RunConfig& c) {
    const auto& l = c.model.lora;
    return Json{{"rank", l.rank},
                {"alpha", l.alpha},
                {"dropout", l.dropout},
                {"targets", l.targets},
                {"base_dtype", l.base_dtype.name()}};
  };
  return f;
}

// The model section's keys, in the order --help-config and the reference list them.
std::vector<Field> model_fields() {
  using R = RunConfig;
  using M = ModelConfig;
  return {
      field(&R::model, &M::preset, "model", "preset",
            "named shape: tiny | gpt2-124m | gpt2-350m | 1.3b | 7b (\"\" = none); keys given next to it override it"),
      field(&R::model, &M::arch, "model", "arch",
            "gpt2 (LayerNorm, GELU, learned positions) | llama (RMSNorm, SwiGLU, RoPE)"),
      field(&R::model, &M::n_layer, "model", "n_layer", "transformer blocks L"),
      field(&R::model, &M::n_head, "model", "n_head", "attention heads; n_embd must divide by it"),
      field(&R::model, &M::n_embd, "model", "n_embd", "hidden size d"),
      field(&R::model, &M::vocab_size, "model", "vocab_size", "vocabulary size; every token id must be below it"),
      field(&R::model, &M::vocab_multiple, "model", "vocab_multiple",
            "the token embedding (and an untied LM head) get vocab_size rounded up to a multiple of it rows, for "
            "faster matmul shapes (128: GPT-2's 50257 -> 50304); the extra rows stay zero, never enter the loss or the "
            "sampled logits, and export leaves them out; 1 = no padding"),
      field(&R::model, &M::max_seq_len, "model", "max_seq_len", "context length (position table / RoPE table)"),
      field(&R::model, &M::mlp_hidden, "model", "mlp_hidden",
            "MLP inner size; 0 = 4d (gpt2) or 2/3*4d rounded up to 256 (llama)"),
      field(&R::model, &M::layer_mlp_hidden, "model", "layer_mlp_hidden",
            "per-block MLP inner sizes, n_layer entries (0 = model.mlp_hidden's), for models whose blocks differ; [] = "
            "every block model.mlp_hidden"),
      field(&R::model, &M::dropout, "model", "dropout",
            "dropout on embeddings, attention probabilities and residual branches"),
      field(&R::model, &M::bias, "model", "bias", "biases in linear layers and LayerNorm"),
      field(&R::model, &M::tie_embeddings, "model", "tie_embeddings", "LM head shares the token embedding matrix"),
      field(&R::model, &M::norm_eps, "model", "norm_eps", "epsilon of LayerNorm / RMSNorm"),
      field(&R::model, &M::rope_theta, "model", "rope_theta", "RoPE base frequency (llama)"),
      field(&R::model, &M::init_std, "model", "init_std",
            "init std of weights; residual projections use init_std/sqrt(2L)"),
      field(
          &R::model, &M::init_from, "model", "init_from",
          "start from Hugging Face weights: a model.safetensors (GPT2LMHeadModel / LlamaForCausalLM names) or a "
          "directory holding one; its config.json, when beside it, is checked against the recipe; \"\" = random init"),
      field(&R::model, &M::loss_chunk, "model", "loss_chunk",
            "positions per chunk of the LM head and loss, which run fused so the logits of the whole micro-batch never "
            "exist; 0 = auto (a chunk's fp32 logits <= 64 MiB); not part of the model: saved states and exports ignore "
            "it"),
      lora_field(),
  };
}

// The data section's keys, in the order --help-config and the reference list them.
std::vector<Field> data_fields() {
  using R = RunConfig;
  using D = DataConfig;
  return {
      field(&R::data, &D::source, "data", "source",
            "llmc (llm.c token shard: header + uint16/uint32 tokens; `bin` is its old name) | raw (headerless tokens, "
            "nanoGPT's prepare.py output; width from raw_dtype) | text (UTF-8, one token per byte) | synthetic | "
            "examples "
            "(scripts/prepare_chat.py's shards with their .mask.bin and .examples.bin: one example a row, padded; the "
            "loss counts the masked-in tokens only, averaged over the optimizer step's)"),
      field(&R::data, &D::raw_dtype, "data", "raw_dtype",
            "token width of source: raw files: uint16 (nanoGPT) | uint32"),
      field(&R::data, &D::path, "data", "path", "training file (llmc, raw or text), relative to the working directory"),
      field(&R::data, &D::val_path, "data", "val_path",
            "held-out file of the same kind; \"\" = hold out the last val_fraction of path"),
      field(&R::data, &D::val_fraction, "data", "val_fraction",
            "share of path held out for eval when val_path is \"\""),
      field(&R::data, &D::synthetic_tokens, "data", "synthetic_tokens",
            "corpus length in tokens for source: synthetic"),
      field(&R::data, &D::packing, "data", "packing",
            "source: examples: fill each train.seq_len row with whole examples (in the epoch's order) instead of one "
            "padded example a row; attention stays within each example and positions restart at each"),
      field(&R::data, &D::tokenizer, "data", "tokenizer",
            "the tokenizer.json the shards were made with (scripts/prepare_data.py writes it beside them); its "
            "vocabulary must match model.vocab_size; the run keeps a copy and its exported weights carry it; \"\" = "
            "tokenizer.json beside data.path when there is one"),
  };
}

// The train section's keys, in the order --help-config and the reference list them.
std::vector<Field> train_fields() {
  using R = RunConfig;
  using T = TrainConfig;
  return {
      field(&R::train, &T::seq_len, "train", "seq_len", "tokens per sequence T (<= model.max_seq_len)"),
      micro_batch_field(),
      field(&R::train, &T::global_batch, "train", "global_batch",
            "sequences per optimizer step over all ranks (micro_batch * grad_accum * WORLD_SIZE), kept by micro_batch: "
            "auto; 0 = derived"),
      field(&R::train, &T::grad_accum, "train", "grad_accum",
            "micro-batches per optimizer step (loss is normalized so one step equals one big batch)"),
      field(&R::train, &T::steps, "train", "steps", "optimizer steps"),
      field(&R::train, &T::lr, "train", "lr", "peak learning rate"),
      field(&R::train, &T::min_lr, "train", "min_lr", "learning rate at the end of the cosine decay"),
      field(&R::train, &T::warmup_steps, "train", "warmup_steps", "linear learning-rate warm-up steps"),
      field(&R::train, &T::weight_decay, "train", "weight_decay",
            "AdamW weight decay, applied to matrices (dim >= 2) only"),
      field(&R::train, &T::beta1, "train", "beta1", "AdamW beta1"),
      field(&R::train, &T::beta2, "train", "beta2", "AdamW beta2"),
      field(&R::train, &T::grad_clip, "train", "grad_clip", "global gradient-norm clip; 0 = off"),
      field(&R::train, &T::eval_interval, "train", "eval_interval",
            "eval loss on the held-out split every N steps and at the end; 0 = never"),
      field(&R::train, &T::eval_batches, "train", "eval_batches", "micro-batches per eval"),
      field(&R::train, &T::seed, "train", "seed", "seeds initialization, dropout and batch sampling"),
      field(&R::train, &T::device, "train", "device",
            "auto | cpu | cuda (auto = cuda when available) | lazy (a TEST device: LibTorch's lazy-tensor TorchScript "
            "backend, not the CPU but running on it; world 1, fp32, no sharding, no memory.limit, no budget mode)"),
      field(&R::train, &T::threads, "train", "threads", "CPU intra-op threads; 0 = all cores"),
      field(&R::train, &T::on_nonfinite, "train", "on_nonfinite",
            "fp32/bf16 gradients with NaN/Inf (finite loss): abort (exit 6 before the optimizer step) | skip (weights "
            "untouched, a skip event)"),
      field(&R::train, &T::on_spike, "train", "on_spike",
            "a loss spike (loss > spike_threshold x the moving average of earlier steps' losses): off | warn (a spike "
            "event and a console warning; the step counts) | skip (weights untouched; the step counts as skipped) | "
            "stop (weights untouched, the state saved, exit 6); each spike is a spike event"),
      field(&R::train, &T::spike_threshold, "train", "spike_threshold",
            "train.on_spike: a step is a spike when its loss exceeds this multiple of the moving average (> 1)"),
      field(&R::train, &T::spike_window, "train", "spike_window",
            "train.on_spike: the moving average's horizon in steps (the mean of the first N losses, then an "
            "exponential average of weight 1/N); no step is a spike before N steps"),
      field(&R::train, &T::sample_interval, "train", "sample_interval",
            "print (and log as a sample event) a greedy continuation every N steps and at the end; needs a tokenizer "
            "(data.tokenizer); 0 = never"),
      field(&R::train, &T::sample_tokens, "train", "sample_tokens", "new tokens per training-time sample"),
      field(&R::train, &T::sample_prompt, "train", "sample_prompt",
            "prompt of the training-time sample; \"\" = the tokenizer's end-of-text token"),
      field(&R::train, &T::cuda_graphs, "train", "cuda_graphs",
            "off | on | auto: a micro-batch's forward and backward captured into a CUDA graph after 3 eager warm-up "
            "micro-batches and replayed for every later one, where the run is eligible (CUDA, one process, "
            "model.dropout 0, ...: see docs/recipes.md#cuda-graphs); auto = eager elsewhere, the reason in the "
            "settings and summary.json; on = as auto, warning when not eligible; off = eager (the default)"),
  };
}

// The checkpointing section's keys, in the order --help-config and the reference list them.
std::vector<Field> checkpointing_fields() {
  using R = RunConfig;
  using C = CheckpointingConfig;
  return {
      field(&R::checkpointing, &C::mode, "checkpointing", "mode",
            "none | full | interval | sqrt | selective | budget (per block keep / selective parts / recompute, the "
            "least recompute time under checkpointing.budget)"),
      field(&R::checkpointing, &C::interval, "checkpointing", "interval",
            "interval mode: k consecutive blocks per segment"),
      field(&R::checkpointing, &C::segments, "checkpointing", "segments",
            "interval mode alternative: number of segments (give interval or segments, not both)"),
      field(&R::checkpointing, &C::recompute, "checkpointing", "recompute",
            "selective mode: parts to recompute, any of [attention, mlp, norm]"),
      field(&R::checkpointing, &C::skip_last, "checkpointing", "skip_last",
            "keep the last segment's activations (recomputing them saves nothing at peak)"),
      field(
          &R::checkpointing, &C::budget, "checkpointing", "budget",
          "budget mode: activation memory per step (under zero3 the gathered units count too): a size such as 6GiB, or "
          "a share such as 90% of what memory.limit leaves after model states, batch and buffers; \"\" = 100% of that"),
      field(&R::checkpointing, &C::profile_costs, "checkpointing", "profile_costs",
            "budget mode: time each kind of block's parts in a short pass of real forwards at the run's shape and "
            "precision; false (or `trainer --no-profile`) = the FLOP formula"),
      field(&R::checkpointing, &C::exchange, "checkpointing", "exchange",
            "auto | redo | keep: under parallel.sequence > 1, what a recompute does about the attention's two "
            "all-to-alls: redo them, or keep what the first pass received (the gathered q, k, v and the attention "
            "output: 4 x n_embd values per local token per recomputed block) and communicate nothing more; auto = mode "
            "budget chooses per block by its cost model, the other modes redo"),
      field(&R::checkpointing, &C::preserve_rng, "checkpointing", "preserve_rng",
            "replay the forward's RNG state during recompute (exact dropout)"),
      field(&R::checkpointing, &C::check_recompute, "checkpointing", "check_recompute",
            "verify recomputed outputs match the forward's shapes and dtypes"),
  };
}

// The precision section's keys, in the order --help-config and the reference list them.
std::vector<Field> precision_fields() {
  using R = RunConfig;
  return {
      field(&R::precision, &PrecisionConfig::compute, "precision", "compute",
            "fp32 | bf16 | fp16: autocast's compute dtype on the run's device; weights and optimizer states stay fp32"),
      field(&R::precision, &PrecisionConfig::param_dtype, "precision", "param_dtype",
            "fp32 | bf16 | fp16: dtype of the parameters the forward and backward use; not fp32 needs "
            "parallel.sharding zero1/2/3 (fp32 master weights and AdamW states stay in the rank's shard; the "
            "all-gather moves this dtype) and precision.compute of the same dtype"),
      field(&R::precision, &PrecisionConfig::reduce_dtype, "precision", "reduce_dtype",
            "fp32 | bf16 | fp16: dtype gradients are reduce-scattered in (zero2/3); not fp32 halves the traffic but "
            "rounds every rank's gradient before the sum (lossy)"),
      field(&R::precision, &PrecisionConfig::tf32, "precision", "tf32",
            "auto | true | false: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (inputs rounded to 10 "
            "mantissa bits, fp32 sums), as nanoGPT and llm.c train; auto = on for a CUDA run, off elsewhere; true "
            "needs CUDA. bf16/fp16 matmuls are not concerned"),
      field(&R::precision, &PrecisionConfig::loss_scale, "precision", "loss_scale",
            "fp16 only: dynamic, or a fixed number to multiply the loss by"),
      field(&R::precision, &PrecisionConfig::init_scale, "precision", "init_scale",
            "fp16 dynamic scaling: starting scale"),
      field(&R::precision, &PrecisionConfig::growth_factor, "precision", "growth_factor",
            "fp16 dynamic scaling: scale multiplier after growth_interval clean steps"),
      field(&R::precision, &PrecisionConfig::backoff_factor, "precision", "backoff_factor",
            "fp16 dynamic scaling: scale multiplier after a step with non-finite gradients"),
      field(&R::precision, &PrecisionConfig::growth_interval, "precision", "growth_interval",
            "fp16 dynamic scaling: clean steps between growths"),
      field(&R::precision, &PrecisionConfig::max_skipped_steps, "precision", "max_skipped_steps",
            "fp16: this many skipped steps in a row mean the run diverged (exit 6); 0 = never give up"),
  };
}

// The parallel section's keys, in the order --help-config and the reference list them.
std::vector<Field> parallel_fields() {
  using R = RunConfig;
  return {
      field(&R::parallel, &ParallelConfig::backend, "parallel", "backend",
            "auto | gloo | nccl (auto: NCCL on CUDA, Gloo on CPU); used when WORLD_SIZE > 1"),
      field(&R::parallel, &ParallelConfig::sharding, "parallel", "sharding",
            "none (DDP) | zero1 (optimizer states) | zero2 (+ gradients) | zero3 (+ parameters, per block)"),
      field(
          &R::parallel, &ParallelConfig::bucket_mb, "parallel", "bucket_mb",
          "sharding none: gradient all-reduce bucket size in MiB (buckets launch from gradient hooks during backward)"),
      field(
          &R::parallel, &ParallelConfig::sequence, "parallel", "sequence",
          "sequence-parallel degree N (Ulysses): each group of N consecutive ranks trains the same sequences, every "
          "rank holding seq_len / N positions of every activation, attention exchanging positions for heads with an "
          "all-to-all; WORLD_SIZE = data-parallel ranks x N. N must divide model.n_head, train.seq_len and WORLD_SIZE"),
      field(&R::parallel, &ParallelConfig::all_to_all_gbps, "parallel", "all_to_all_gbps",
            "parallel.sequence > 1: what a rank sends per second in its group's all-to-all (GB/s), for the planner's "
            "modelled step time and budget mode's price of a recomputed exchange (100: a conservative share of NVLink "
            "inside a node; measure with nccl-tests' alltoall_perf)"),
      field(&R::parallel, &ParallelConfig::timeout_s, "parallel", "timeout_s",
            "rendezvous and collective timeout in seconds: a dead or hung rank makes the others exit 5 within it"),
  };
}

// The memory section's keys, in the order --help-config and the reference list them.
std::vector<Field> memory_fields() {
  using R = RunConfig;
  return {
      field(&R::memory, &MemoryConfig::track_cpu, "memory", "track_cpu",
            "install the tracking CPU allocator so CPU peak bytes are exact"),
      field(&R::memory, &MemoryConfig::limit, "memory", "limit",
            "device-memory limit on the bytes in live tensors (allocated bytes, on CPU and CUDA), e.g. 8GiB (units B, "
            "KiB, MiB, GiB, KB, MB, GB); 0 = none. Past it: out of memory (exit 4). On CUDA the caching allocator's "
            "cache (reserved bytes) may pass it"),
      field(&R::memory, &MemoryConfig::host_limit, "memory", "host_limit",
            "host-memory limit for offloaded state (offload.*), a size like memory.limit; 0 = none. Past it: exit 4 "
            "naming host memory"),
  };
}

// The offload section's keys, in the order --help-config and the reference list them.
std::vector<Field> offload_fields() {
  using R = RunConfig;
  using O = OffloadConfig;
  return {
      field(&R::offload, &O::optimizer, "offload", "optimizer",
            "fp32 master weights and AdamW moments in host memory; the AdamW step runs on the host (parallel.sharding "
            "zero1/2/3 at any world size, or none (DDP) at world size > 1)"),
      field(&R::offload, &O::gradients, "offload", "gradients",
            "the gradient shard accumulated in host memory: each group's gradient leaves the device as soon as it is "
            "reduced (needs zero2/zero3 and offload.optimizer)"),
      field(&R::offload, &O::parameters, "offload", "parameters",
            "no device copy of the weights between uses: each unit is gathered from the host masters before its "
            "forward, backward and recompute (needs zero3 and offload.optimizer)"),
      field(&R::offload, &O::activations, "offload", "activations",
            "checkpointed blocks' inputs go to host memory in forward and come back one block ahead of their backward "
            "(needs a checkpointing mode that checkpoints blocks)"),
      field(&R::offload, &O::bandwidth_gbps, "offload", "bandwidth_gbps",
            "host <-> device copy rate per direction in GB/s, for the planner's transfer time (25 = PCIe 4.0 x16 with "
            "pinned memory)"),
      field(&R::offload, &O::overlap, "offload", "overlap",
            "share of the streamed transfers (gradients, parameters, activations) hidden behind compute in the "
            "planner's step time, in [0, 1]"),
      field(&R::offload, &O::host_gbps, "offload", "host_gbps",
            "host memory rate in GB/s for the planner's host AdamW time (28 bytes read and written per parameter)"),
  };
}

// The logging section's keys, in the order --help-config and the reference list them.
std::vector<Field> optim_fields() {
  using R = RunConfig;
  return {
      field(&R::optim, &OptimConfig::in_backward, "optim", "in_backward",
            "run each parameter's AdamW update as soon as its gradient is complete during backward and free the "
            "gradient then: the whole model's gradients never exist at once. Needs one process without sharding or "
            "offload, train.grad_accum 1, train.grad_clip 0 (a global norm needs every gradient first), no fp16 "
            "loss scaling, train.on_spike off or warn, train.on_nonfinite abort, train.cuda_graphs off or auto"),
  };
}

std::vector<Field> logging_fields() {
  using R = RunConfig;
  return {
      field(&R::logging, &LoggingConfig::dir, "logging", "dir", "run directory; \"\" = runs/<recipe name>-<timestamp>"),
      field(&R::logging, &LoggingConfig::interval, "logging", "interval", "console line every N steps"),
      field(&R::logging, &LoggingConfig::skip_first, "logging", "skip_first",
            "warm-up steps excluded from the medians in summary.json"),
      field(&R::logging, &LoggingConfig::peak_tflops, "logging", "peak_tflops",
            "device peak TFLOP/s for MFU in the compute dtype; 0 = a datasheet peak for known CUDA devices, else the "
            "best GEMM rate in precision.compute over 0.5 s (512^3, 1024^3, the model's shapes) measured at start. A "
            "step faster than the peak raises it (MFU <= 1)"),
      field(&R::logging, &LoggingConfig::progress, "logging", "progress", "progress bar when stdout is a terminal"),
      field(&R::logging, &LoggingConfig::save_model, "logging", "save_model",
            "write the final weights to <run dir>/model/{model.safetensors, config.json} in Hugging Face layout, fp32 "
            "(zero3 streams them unit by unit)"),
      field(&R::logging, &LoggingConfig::profile_step, "logging", "profile_step",
            "record this optimizer step (1-based; rank 0) with LibTorch's profiler into <run dir>/profile.json (Chrome "
            "trace); 0 = off"),
      field(&R::logging, &LoggingConfig::memory_timeline, "logging", "memory_timeline",
            "record every allocation and free of this optimizer step (1-based; rank 0; train.device: cpu), labelled "
            "weights / gradients / optimizer state / activations and recompute per block / ..., into <run "
            "dir>/memory_timeline.json (scripts/plot_timeline.py draws it); 0 = off"),
      field(&R::logging, &LoggingConfig::overwrite, "logging", "overwrite",
            "allow a run directory that already holds a run's logs (they are replaced); false = refuse with exit 2"),
      field(&R::logging, &LoggingConfig::tensorboard, "logging", "tensorboard",
            "also write the step metrics, eval loss and memory as a TensorBoard event file in <run dir>/tensorboard/ "
            "(rank 0)"),
  };
}

// The state section's keys, in the order --help-config and the reference list them.
std::vector<Field> state_fields() {
  using R = RunConfig;
  return {
      field(&R::state, &StateConfig::every, "state", "every",
            "save the training state every N optimizer steps; 0 = only at the end and on SIGTERM/SIGINT"),
      field(&R::state, &StateConfig::keep, "state", "keep",
            "newest saved states kept (older ones are deleted after a newer one is complete); 0 = all"),
      field(&R::state, &StateConfig::dir, "state", "dir", "where states are written; \"\" = <run dir>/state"),
      field(&R::state, &StateConfig::at_end, "state", "at_end", "save after the last step"),
      field(&R::state, &StateConfig::on_signal, "state", "on_signal",
            "on SIGTERM/SIGINT: finish the step, save, then exit 143/130"),
      field(&R::state, &StateConfig::async, "state", "async",
            "state.every saves are written by a background thread from a host snapshot of this rank's state while "
            "training goes on; published (meta.json, latest) once every rank's file is on disk; a new save waits for "
            "the previous one; saves at the end, on a signal or a spike complete before the run exits"),
  };
}

}  // namespace

const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> all;
    for (auto section : {model_fields, data_fields, train_fields, checkpointing_fields, precision_fields,
                         parallel_fields, memory_fields, offload_fields, optim_fields, logging_fields, state_fields})
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

void to_json(nlohmann::json& j, const Bytes& b) { j = b.text; }
void to_json(nlohmann::json& j, const Budget& b) { j = b.text; }
void to_json(nlohmann::json& j, const LossScale& s) { j = s.text; }

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
  std::string out =
      "Recipe keys (YAML section: key, or --set section.key=value). Precedence: --set > YAML > model.preset > "
      "defaults.\n";
  std::string section;
  for (const auto& f : fields()) {
    if (f.section != section) out += fmt::format("\n{}:\n", section = f.section);
    out += fmt::format("  {:<18} {:<8} default {:<22} {}\n", f.key, f.type, f.get(defaults).dump(), f.doc);
  }
  return out;
}

}  // namespace sl::config
