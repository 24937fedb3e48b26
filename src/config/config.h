// The recipe: typed config sections with defaults and docs, presets, YAML + --set merging, validation.
// Precedence: --set section.key=value > YAML > model.preset > defaults. Everything is validated once,
// after merging, before any tensor exists; every failure is a ConfigError naming the key.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/choices.h"
#include "layout/mesh.h"

namespace sl::config {

// A size in bytes read from the recipe ("8GiB", "512 MiB", "1048576"; parse_bytes), with the text it was
// written as, which to_json and the start-up table print.
struct Bytes {
  int64_t bytes = 0;
  std::string text = "0";
};

// checkpointing.budget: a size in bytes, or a share in (0, 1] of what memory.limit leaves after the
// model states, batch and buffers (share > 0 only for "N%" and ""), with the recipe's text.
struct Budget {
  int64_t bytes = 0;
  double share = 1.0;
  std::string text;  // "" = 100%
};

// precision.loss_scale: dynamic (grown and backed off by the scaler), or a fixed scale > 0, with the
// recipe's text.
struct LossScale {
  double fixed = 0.0;  // 0: dynamic
  std::string text = "dynamic";
  bool dynamic() const { return fixed == 0.0; }
};

// model.lora: low-rank adapters on the blocks' projections (model/lora.h); rank 0 = none. With adapters the
// model's other parameters are frozen: no gradient, no optimizer state, not in the saved training state.
struct LoraConfig {
  int64_t rank = 0;
  double alpha = 16.0;    // the update is (alpha / rank) B A
  double dropout = 0.0;   // on the adapters' input, one mask per projection
  // Hugging Face module names of model.arch (model/lora.h: lora_target_names); [] = PEFT's default for it
  std::vector<std::string> targets = {};
  // The frozen matrices' dtype: fp32, or bf16 (half the bytes; needs precision.compute bf16)
  Dtype base_dtype = Dtype::kFp32;
  bool enabled() const { return rank > 0; }
};

// Field docs live in the key table in keys.cpp (printed by `trainer --help-config`).
struct ModelConfig {
  std::string preset = "";
  Arch arch = Arch::kGpt2;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t vocab_size = 256;
  int64_t vocab_multiple = 1;  // the token table's rows rounded up to a multiple of it (padded_vocab)
  int64_t max_seq_len = 256;
  int64_t mlp_hidden = 0;
  std::vector<int64_t> layer_mlp_hidden = {};  // per block (n_layer entries, 0 = mlp_hidden's); empty = uniform
  double dropout = 0.0;
  bool bias = true;
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double init_std = 0.02;
  std::string init_from = "";  // Hugging Face safetensors weights to start from (src/interop/hf.h)
  int64_t loss_chunk = 0;  // positions per chunk of the fused LM head + loss (model/fused_loss.h); 0 = auto
  LoraConfig lora = {};

  // Rows of the token embedding and of an untied LM head: vocab_size rounded up to a multiple of
  // vocab_multiple. The rows past vocab_size are zero and stay zero (no token selects them, no loss
  // reads their logits); the logits the model returns and the exported weights have vocab_size.
  int64_t padded_vocab() const {
    const int64_t k = vocab_multiple > 0 ? vocab_multiple : 1;
    return (vocab_size + k - 1) / k * k;
  }
};

struct DataConfig {
  DataSource source = DataSource::kLlmc;
  RawDtype raw_dtype = RawDtype::kUint16;
  std::string path = "data/corpus_train.bin";
  std::string val_path = "data/corpus_val.bin";
  double val_fraction = 0.1;
  int64_t synthetic_tokens = 1 << 20;
  std::string tokenizer = "";  // tokenizer.json of the shards; "" = the one beside data.path, if any
  bool packing = false;  // examples: whole examples fill each row, attention within each (data/loader.h)
};

struct TrainConfig {
  int64_t seq_len = 128;
  MicroBatch micro_batch = 8;  // a number, or auto (choices.h)
  int64_t grad_accum = 1;
  int64_t global_batch = 0;
  int64_t steps = 100;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;
  int64_t eval_interval = 50;
  int64_t eval_batches = 8;
  int64_t seed = 1337;
  DeviceChoice device = DeviceChoice::kAuto;
  int64_t threads = 0;
  OnNonfinite on_nonfinite = OnNonfinite::kAbort;  // abort | skip
  OnSpike on_spike = OnSpike::kWarn;  // off | warn | skip | stop (train/spike.h)
  CudaGraphs cuda_graphs = CudaGraphs::kOff;  // off | on | auto (train/cuda_graph.h)
  double spike_threshold = 1.5;     // a spike: loss > spike_threshold x the moving average of earlier losses
  int64_t spike_window = 50;        // the moving average's horizon in steps; checked once it covers this many
  int64_t sample_interval = 0;      // print a generated sample every N steps (needs a tokenizer); 0 = never
  int64_t sample_tokens = 32;       // new tokens per training-time sample
  std::string sample_prompt = "";   // its prompt; "" = the tokenizer's end-of-text token
};

struct CheckpointingConfig {
  CheckpointingMode mode = CheckpointingMode::kNone;
  int64_t interval = 0;
  int64_t segments = 0;
  std::vector<std::string> recompute = {};
  bool skip_last = true;
  // budget mode: the activation memory a step may use, a size ("6GiB") or a share of what memory.limit
  // leaves after the model states, batch and buffers ("90%"); "" = 100% (needs memory.limit).
  Budget budget = {};
  // parallel.sequence > 1: a recompute redoes the attention's all-to-alls or keeps their outputs (auto:
  // budget mode chooses per block, the other modes redo).
  Exchange exchange = Exchange::kAuto;
  bool profile_costs = true;  // budget mode: time the block's parts in a short pass (false: FLOP formula)
  bool preserve_rng = true;
  bool check_recompute = false;
};

struct PrecisionConfig {
  Dtype compute = Dtype::kFp32;
  Dtype param_dtype = Dtype::kFp32;   // dtype of the parameters' compute copy (zero*: masters stay fp32 in the shard)
  Dtype reduce_dtype = Dtype::kFp32;  // dtype gradients are reduce-scattered in (zero2/3)
  Tf32 tf32 = Tf32::kAuto;            // fp32 matmuls and cuDNN convolutions on TF32 tensor cores (CUDA)
  LossScale loss_scale = {};
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t max_skipped_steps = 20;  // consecutive fp16 skips that mean the run has diverged
};

struct ParallelConfig {
  Backend backend = Backend::kAuto;  // auto | gloo | nccl
  Sharding sharding = Sharding::kNone;  // none (DDP) | zero1 | zero2 | zero3
  double bucket_mb = 25.0;        // DDP gradient bucket size (MiB)
  int64_t timeout_s = 600;
  // Sequence-parallel degree N (Ulysses): each group of N consecutive ranks trains the same sequences,
  // every rank holding seq_len / N of their positions; attention exchanges positions for heads with an
  // all-to-all inside the group. The world is data-parallel x N.
  int64_t sequence = 1;
  // The process mesh of `world` ranks (layout/mesh.h) with this section's degrees, seen from `rank`.
  // Throws ConfigError when a degree does not divide the world (validate() names it first for a recipe).
  layout::Mesh mesh(int64_t world, int64_t rank = 0) const { return layout::Mesh(world, rank, {sequence}); }
  // What one rank sends per second in its sequence group's all-to-all (GB/s), for the planner's step
  // time and budget mode's price of a recomputed exchange. 100: a conservative share of an H100's
  // NVLink 4 (450 GB/s each way) for NCCL's all-to-all inside a node of 8; measure yours with
  // nccl-tests' alltoall_perf and set it.
  double all_to_all_gbps = 100.0;
  // Whether a run of `world` processes takes the data-parallel engine (parallel::make_strategy) rather
  // than the one-process strategy: more than one rank, or any ZeRO stage (which shards even at world 1).
  bool uses_engine(int64_t world) const { return world > 1 || !sharding.replicated(); }
};

struct MemoryConfig {
  bool track_cpu = true;
  Bytes limit = {};       // device memory; 0 = none
  Bytes host_limit = {};  // host memory for offloaded state (offload.*); 0 = none
};

// Where each kind of state lives (device/host.h): on the device (false) or in host memory (true), and
// the transfer model the planner prices the moves with.
struct OffloadConfig {
  bool optimizer = false;    // fp32 masters + AdamW moments on the host; the AdamW step runs there
  bool gradients = false;    // the gradient shard accumulated on the host, each group streamed out when reduced
  bool parameters = false;   // zero3: no device copy between uses; each unit gathered from the host masters
  bool activations = false;  // checkpointed blocks' inputs on the host between forward and backward
  double bandwidth_gbps = 25.0;  // host <-> device copy rate per direction (PCIe 4.0 x16, pinned)
  double overlap = 0.5;          // share of streamed transfers hidden behind compute (not the optimizer's)
  double host_gbps = 20.0;       // host memory rate of the host AdamW step (28 bytes per parameter)
  bool any_state() const { return optimizer || gradients || parameters; }
  bool any() const { return any_state() || activations; }
};

struct LoggingConfig {
  std::string dir = "";
  int64_t interval = 10;
  int64_t skip_first = 3;
  double peak_tflops = 0.0;
  bool progress = true;
  bool save_model = false;
  bool overwrite = false;
  int64_t profile_step = 0;  // record this optimizer step (1-based) with the profiler; 0 = off
  int64_t memory_timeline = 0;  // record every allocation and free of this step (1-based, rank 0); 0 = off
  bool tensorboard = false;  // TensorBoard event file in <run dir>/tensorboard/ beside metrics.jsonl
};

// How the optimizer runs (parallel/single.h).
struct OptimConfig {
  // Each parameter's AdamW update as soon as its gradient is complete, the gradient freed right after:
  // gradients never exist for the whole model at once. One process, accumulation 1, no clipping, no fp16.
  bool in_backward = false;
};

// Durable training state (src/state/): what is saved, how often, where.
struct StateConfig {
  int64_t every = 0;      // save every N optimizer steps; 0 = only at the end and on a signal
  int64_t keep = 2;       // newest states kept; 0 = all
  std::string dir = "";   // "" = <run dir>/state
  bool at_end = true;     // save when the last step is done
  bool on_signal = true;  // SIGTERM/SIGINT: finish the step, save, exit 143/130
  bool async = true;      // `every` saves: written from a host snapshot while the steps go on (state/state.h)
};

struct RunConfig {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  CheckpointingConfig checkpointing;
  PrecisionConfig precision;
  ParallelConfig parallel;
  MemoryConfig memory;
  OffloadConfig offload;
  OptimConfig optim;
  LoggingConfig logging;
  StateConfig state;
  std::string recipe_name = "run";
  // Not a recipe key: the number of ranks the run has (WORLD_SIZE, or `trainer plan --world-size`).
  // train.global_batch is checked against it.
  // The planner predicts per-rank memory with it.
  int64_t world_size = 1;
  // The recipe's process mesh: world_size ranks (at least 1) with parallel.*'s degrees, seen from `rank`.
  layout::Mesh mesh(int64_t rank = 0) const { return parallel.mesh(world_size > 1 ? world_size : 1, rank); }
  // Not a recipe key: `trainer --resume auto|PATH` ("" = start fresh; kResumeNewest = auto).
  std::string resume;
};

// `--resume auto`: the newest valid state of the run directory.
inline constexpr std::string_view kResumeNewest = "auto";

// Loads a YAML recipe (path may be empty: defaults only), applies overrides ("section.key=value"),
// validates. Throws ConfigError naming the key (and the YAML line when it came from the file).
RunConfig load(const std::string& path, const std::vector<std::string>& overrides);

// Same, from YAML text (tests use this).
RunConfig load_string(const std::string& yaml_text, const std::vector<std::string>& overrides,
                      const std::string& origin = "<string>");

// Checks ranges and combinations (train.global_batch against cfg.world_size); throws ConfigError
// naming the key.
void validate(const RunConfig& cfg);

// The checks that need the device train.device resolved to (auto: CUDA when available), which
// validate() cannot know: logging.memory_timeline records the tracking CPU allocator, so a run that
// resolved to CUDA refuses it. Throws ConfigError naming logging.memory_timeline and train.device.
void validate_resolved_device(const RunConfig& cfg, bool on_cuda);

// WORLD_SIZE from the environment (torchrun sets it); 1 when unset or malformed. load() stores it in
// RunConfig::world_size before validating.
int64_t world_size_from_env();

// Applies a named preset to the model section; throws ConfigError for an unknown name.
void apply_preset(ModelConfig& model, const std::string& name);
std::vector<std::string> preset_names();

// Parses a size such as "8GiB", "512 MiB", "2GB", "1048576" (bytes); throws ConfigError naming `key`.
int64_t parse_bytes(const std::string& text, const std::string& key);

// True when `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF):
// what a prompt must be before it is tokenized or written into JSON.
bool valid_utf8(std::string_view text);

// JSON: the recipe's text.
void to_json(nlohmann::json& j, const Bytes& b);
void to_json(nlohmann::json& j, const Budget& b);
void to_json(nlohmann::json& j, const LossScale& s);

// checkpointing.mode with the parameters that mode uses, one alternative per mode. The recipe keeps
// the parameters in keys of their own (checkpointing.interval / segments, recompute, budget), so a
// mode and its parameters can come from different lines or --set flags; choice() puts them together
// once they are all read, and past it code visits the alternative instead of reading the keys.
namespace mode {
struct None {};
struct Full {};
struct Interval {
  int64_t k = 0;         // blocks per segment (0: `segments` is given instead)
  int64_t segments = 0;  // number of segments, checkpoint_sequential style (0: `k` is given)
};
struct Sqrt {};
struct Selective {
  bool attention = false, mlp = false, norm = false;  // the parts each block recomputes
};
using Budget = config::Budget;  // the activation memory a step may use
}  // namespace mode
using CheckpointingChoice =
    std::variant<mode::None, mode::Full, mode::Interval, mode::Sqrt, mode::Selective, mode::Budget>;
CheckpointingChoice choice(const CheckpointingConfig& ck);


nlohmann::json to_json(const RunConfig& cfg);
// Rows "section.key | value" for the start-up table.
std::vector<std::pair<std::string, std::string>> to_rows(const RunConfig& cfg);
// Every key with type, default and doc, for `trainer --help-config`.
std::string help_text();

}  // namespace sl::config
