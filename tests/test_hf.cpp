// Hugging Face interop, checked against transformers itself (tests/hf_parity.py builds the models):
//   - GPT2LMHeadModel and LlamaForCausalLM with random weights, loaded by model.init_from's reader,
//     give this project's model the same logits and loss (fp32, kLogitTol), and the model exported
//     back (write_hf) gives transformers the same logits; every exported tensor is bitwise the original;
//   - a sharded checkpoint (index + shards) loads;
//   - the trainer starts from a checkpoint (world 1 and world 2 zero3, each rank reading its shard),
//     writes its final weights in the same layout, and `trainer export` reads a world-2 zero3 state,
//     streaming (peak tensor memory a few tensors), in fp32 and bf16; transformers loads the export;
//   - bad checkpoints and recipes that do not match exit 3 naming the tensor or key, before a run
//     directory exists.
#include <cfloat>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <torch/torch.h>

#include "config/config.h"
#include "interop/hf.h"
#include "interop/peft.h"
#include "model/gpt.h"
#include "state/safetensors.h"
#include "examples_data.h"
#include "runs.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

namespace fs = std::filesystem;
using namespace sl;

namespace {

// The recipes of the models tests/hf_parity.py builds.
const char* const kGpt2Recipe = R"(
model: {preset: tiny, dropout: 0.0}
)";
const char* const kLlamaRecipe = R"(
model: {arch: llama, n_layer: 2, n_head: 4, n_embd: 64, vocab_size: 256, max_seq_len: 64, mlp_hidden: 160,
        tie_embeddings: false, rope_theta: 1000.0, norm_eps: 1.0e-5, dropout: 0.0}
train: {seq_len: 32}
)";
// The same, as trainer flags on top of configs/tiny.yaml.
const char* const kLlamaSets =
    "--set model.preset= --set model.arch=llama --set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64 "
    "--set model.max_seq_len=64 --set model.mlp_hidden=160 --set model.tie_embeddings=false --set model.rope_theta=1000 "
    "--set train.seq_len=32";

test::Result parity(const std::string& args) {
  return test::python("hf_parity.py", args);
}

fs::path make_hf(const std::string& arch, const fs::path& dir, const std::string& extra = "") {
  const auto r = parity(fmt::format("make {} {} {}", arch, dir.string(), extra));
  INFO(r.output);
  REQUIRE(r.code == 0);
  return dir;
}

model::GPT load_model(const config::ModelConfig& m, const interop::HfCheckpoint& ckpt) {
  model::GPT model(m, torch::kCPU);
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters())
    ckpt.read(item.key(), 0, item.value().numel(), item.value().view({-1}));
  model->eval();
  return model;
}

struct Logits {
  torch::Tensor logits;
  double loss;
};

Logits run_model(model::GPT& model, const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  auto logits = model->forward(tokens);
  const int64_t T = tokens.size(1);
  const auto loss = model::GPTImpl::loss_of_logits(logits.narrow(1, 0, T - 1), tokens.narrow(1, 1, T - 1));
  return {logits, loss.item<double>()};
}

double max_abs(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Largest logit difference between two fp32 implementations of the same model (this project's kernels
// and transformers', or two CPUs' GEMM blockings). Each of the <= 30 operations a position's logits
// pass through (4 blocks of norms, products, attention and MLP; the head) rounds its result to about
// u sqrt(n) relative, u = 2^-24 and n <= 512 summands (1.4e-6; rounding errors of random sign); the
// norms rescale to unit variance, so errors add as a random walk over the operations: ~7.5e-6 of the
// activations' scale, whose largest values here (random weights of std <= 0.07, unit-variance norms)
// are <= ~4: 3e-5. kLogitTol leaves 3x for worse-aligned blockings. A layout error (a transposed,
// swapped or misnamed tensor, rotary halves interleaved) moves logits by O(0.1).
constexpr double kLogitTol = 1e-4;
// The loss is a mean of cross-entropies, each moving by at most 2 max|dz| (its gradient in the logits
// has 1-norm <= 2).
constexpr double kLossTol = 2 * kLogitTol;

// Every tensor of `got` is bitwise the same-named tensor of `want` (which may hold more: a tied lm_head).
void check_bitwise(const fs::path& got, const fs::path& want) {
  const state::SafetensorsFile g(got), w(want);
  REQUIRE(!g.entries().empty());
  for (const auto& e : g.entries()) {
    INFO(e.name);
    REQUIRE(w.find(e.name) != nullptr);
    CHECK(torch::equal(g.view(e.name), w.view(e.name)));
  }
}

interop::WeightsSource model_source(model::GPT& model) {
  interop::WeightsSource src;
  src.values = [params = model->named_parameters()](const interop::HfTensor& t) {
    return params[t.param].detach().view({-1}).narrow(0, t.begin(), t.end() - t.begin());
  };
  return src;
}

// transformers' logits and loss for the reference tokens, from the checkpoint in `dir`.
state::SafetensorsFile hf_logits(const fs::path& dir, const fs::path& ref, const fs::path& out) {
  const auto r = parity(fmt::format("logits {} {} {}", dir.string(), ref.string(), out.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  return state::SafetensorsFile(out);
}

}  // namespace

TEST_CASE("transformers' GPT-2 and LLaMA give the same logits and loss here, and take the export back", "[numerics]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    INFO(arch);
    test::TempDir dir("hf-" + arch);
    const fs::path hf = make_hf(arch, dir.path / "hf");
    const auto cfg = config::load_string(arch == "gpt2" ? kGpt2Recipe : kLlamaRecipe, {});
    const interop::HfCheckpoint ckpt(hf, cfg.model);
    auto model = load_model(cfg.model, ckpt);
    const state::SafetensorsFile ref(hf / "ref.safetensors");
    const auto ours = run_model(model, ref.view("tokens"));
    CHECK(max_abs(ours.logits, ref.view("logits")) <= kLogitTol);
    CHECK(std::abs(ours.loss - ref.view("loss").item<double>()) <= kLossTol);

    // Back out: the export is the original checkpoint, tensor for tensor, and transformers agrees.
    const fs::path out = dir.path / "export" / "model.safetensors";
    interop::write_hf(out, cfg.model, torch::kFloat, model_source(model), true, {{"format", "pt"}});
    check_bitwise(out, hf / "model.safetensors");
    const auto back = hf_logits(out.parent_path(), hf / "ref.safetensors", dir.path / "back.safetensors");
    CHECK(max_abs(back.view("logits"), ref.view("logits")) <= kLogitTol);
    CHECK(max_abs(back.view("logits"), ours.logits) <= kLogitTol);
  }
}

TEST_CASE("model.vocab_multiple: a padded model reads transformers' checkpoint with zero padding rows, gives its "
          "logits, and exports vocab_size rows that transformers takes back", "[numerics]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    INFO(arch);
    test::TempDir dir("hf-pad-" + arch);
    const fs::path hf = make_hf(arch, dir.path / "hf");
    // Vocabulary 256 padded to a multiple of 384: 128 zero rows in wte (and in lm_head, untied under llama).
    const auto cfg = config::load_string(arch == "gpt2" ? kGpt2Recipe : kLlamaRecipe, {"model.vocab_multiple=384"});
    REQUIRE(cfg.model.padded_vocab() == 384);
    const interop::HfCheckpoint ckpt(hf, cfg.model);
    auto model = load_model(cfg.model, ckpt);
    const state::SafetensorsFile in(hf / "model.safetensors");
    for (const char* param : {"wte", "lm_head"}) {
      const auto params = model->named_parameters();
      if (!params.contains(param)) continue;
      const auto& w = params[param];
      REQUIRE(w.size(0) == 384);
      CHECK(torch::equal(w.narrow(0, 256, 128), torch::zeros({128, w.size(1)})));
      const std::string hf_name = std::string(param) == "lm_head" ? "lm_head.weight"
                                  : arch == "gpt2"                ? "transformer.wte.weight"
                                                                  : "model.embed_tokens.weight";
      CHECK(torch::equal(w.narrow(0, 0, 256), in.view(hf_name).to(torch::kFloat)));
    }
    // The same tolerances as the unpadded model's (kLogitTol): the padding adds zero rows, whose logits the
    // model drops, to the head's product; the logits have vocab_size columns as transformers' do.
    const state::SafetensorsFile ref(hf / "ref.safetensors");
    const auto ours = run_model(model, ref.view("tokens"));
    REQUIRE(ours.logits.sizes() == ref.view("logits").sizes());
    CHECK(max_abs(ours.logits, ref.view("logits")) <= kLogitTol);
    CHECK(std::abs(ours.loss - ref.view("loss").item<double>()) <= kLossTol);

    const fs::path out = dir.path / "export" / "model.safetensors";
    interop::write_hf(out, cfg.model, torch::kFloat, model_source(model), true, {{"format", "pt"}});
    const state::SafetensorsFile exported(out);
    for (const auto& e : exported.entries())
      if (e.name.find("wte") != std::string::npos || e.name.find("embed_tokens") != std::string::npos ||
          e.name.find("lm_head") != std::string::npos)
        CHECK(e.shape[0] == 256);  // trimmed to model.vocab_size
    check_bitwise(out, hf / "model.safetensors");
    const auto back = hf_logits(out.parent_path(), hf / "ref.safetensors", dir.path / "back.safetensors");
    CHECK(max_abs(back.view("logits"), ref.view("logits")) <= kLogitTol);
  }
}

TEST_CASE("a sharded checkpoint (model.safetensors.index.json + shards) loads tensor by tensor") {
  test::TempDir dir("hf-shards");
  const fs::path hf = make_hf("llama", dir.path / "hf", "--shard-size 20KB");
  REQUIRE(fs::exists(hf / "model.safetensors.index.json"));
  REQUIRE(!fs::exists(hf / "model.safetensors"));
  const auto cfg = config::load_string(kLlamaRecipe, {});
  const interop::HfCheckpoint ckpt(hf, cfg.model);
  CHECK(ckpt.describe().find("file(s)") != std::string::npos);
  CHECK(ckpt.describe().find(" 1 file(s)") == std::string::npos);
  auto model = load_model(cfg.model, ckpt);
  const state::SafetensorsFile ref(hf / "ref.safetensors");
  CHECK(max_abs(run_model(model, ref.view("tokens")).logits, ref.view("logits")) <= kLogitTol);
}

TEST_CASE("the trainer starts from a checkpoint at world 1 and 2 (zero3), and export reads its sharded state") {
  test::TempDir dir("hf-train");
  const fs::path hf = make_hf("gpt2", dir.path / "hf");
  const std::string common = fmt::format(
      "--config configs/tiny.yaml --set model.init_from={} --set train.steps=3 --set train.micro_batch=4 "
      "--set train.grad_accum=1 --set train.eval_interval=0 --set logging.save_model=true --set logging.progress=false",
      hf.string());

  // A vanishing learning rate leaves every weight bitwise where the checkpoint put it (the update is
  // below half an ulp): the final weights are then the checkpoint itself.
  const fs::path still = dir.path / "still";
  const auto r0 = test::trainer(common + " --set train.lr=1e-30 --set train.min_lr=0 --set logging.dir=" + still.string());
  INFO(r0.output);
  REQUIRE(r0.code == 0);
  CHECK(r0.output.find("weights from " + (hf / "model.safetensors").string()) != std::string::npos);
  check_bitwise(still / "model" / "model.safetensors", hf / "model.safetensors");

  // Training from it at world 1 and at world 2 under zero3 (each rank reads only its shard) agrees.
  const fs::path w1 = dir.path / "w1", w2 = dir.path / "w2";
  const auto r1 = test::trainer(common + " --set logging.dir=" + w1.string());
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  const auto r2 = test::launch(2, common + " --set train.micro_batch=2 --set parallel.sharding=zero3 --set logging.dir=" +
                                      w2.string());
  INFO(r2.outputs[0]);
  REQUIRE(r2.codes == std::vector<int>{0, 0});
  const state::SafetensorsFile f1(w1 / "model" / "model.safetensors"),
      orig(hf / "model.safetensors");
  double moved = 0;
  for (const auto& e : f1.entries()) moved = std::max(moved, max_abs(f1.view(e.name), orig.view(e.name)));
  // Only the order of fp32 sums differs between the two: tests/runs.h's parity, every step and every tensor
  // (B from the schedule's own rates, warm-up included).
  CHECK_PARITY(w1, w2);
  // Training moved the weights (AdamW's first step alone moves every element whose gradient is well
  // above eps by ~lr = 3e-3): the comparison above could fail.
  CHECK(moved > 1e-4);
  // zero3 wrote them unit by unit: at most one unit (for the tied head, with the embeddings) gathered.
  const auto summary = nlohmann::json::parse(test::read_text(w2 / "summary.json"));
  const auto gathered = summary["final_weights"]["gathered_peak_bytes"].get<int64_t>();
  CHECK(gathered > 0);
  CHECK(gathered <= 2 * summary["parallel"]["largest_group_bytes"].get<int64_t>());
  CHECK(gathered < summary["parallel"]["params_bytes_unsharded"].get<int64_t>() / 2);
  CHECK(summary["final_weights"]["step"] == 3);

  // export reads the world-2 zero3 state (both ranks' files) once the final weights are gone.
  fs::rename(w2 / "model", dir.path / "w2-final");
  const auto ex = test::trainer("export --run " + w2.string());
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  const fs::path exported = w2 / "hf-step-00000003" / "model.safetensors";
  CHECK(ex.output.find((w2 / "state" / "step-00000003").string()) != std::string::npos);
  check_bitwise(exported, dir.path / "w2-final" / "model.safetensors");
  check_bitwise(dir.path / "w2-final" / "model.safetensors", exported);

  // Streaming: the export's tracked tensor memory peaks at a few tensors, far below the model.
  std::smatch m;
  REQUIRE(std::regex_search(ex.output, m, std::regex("peak_tensor_bytes=([0-9]+)")));
  const int64_t peak = std::stoll(m[1]);
  const int64_t largest = 512 * 128 * 4, model_bytes = 858880 * 4;  // an MLP matrix; the tiny preset's parameters
  CHECK(peak > 0);
  CHECK(peak <= 3 * largest);
  CHECK(peak < model_bytes / 4);

  // bf16 export: every tensor is the fp32 one rounded to nearest even; transformers loads it.
  const fs::path bf16 = dir.path / "bf16" / "weights.safetensors";
  const auto eb = test::trainer("export --run " + w2.string() + " --dtype bf16 --out " + bf16.string());
  INFO(eb.output);
  REQUIRE(eb.code == 0);
  const state::SafetensorsFile fp(exported), bf(bf16);
  for (const auto& e : bf.entries()) {
    INFO(e.name);
    CHECK(e.dtype == torch::kBFloat16);
    CHECK(torch::equal(bf.view(e.name), fp.view(e.name).to(torch::kBFloat16)));
  }
  CHECK(fs::exists(bf16.parent_path() / "config.json"));

  // transformers computes the same logits from the export as this project does from it.
  const auto cfg = config::load_string(kGpt2Recipe, {});
  auto trained = load_model(cfg.model, interop::HfCheckpoint(exported.parent_path(), cfg.model));
  const state::SafetensorsFile ref(hf / "ref.safetensors");
  const auto back = hf_logits(exported.parent_path(), hf / "ref.safetensors", dir.path / "trained.safetensors");
  CHECK(max_abs(back.view("logits"), run_model(trained, ref.view("tokens")).logits) <= kLogitTol);
}

TEST_CASE("init_from: LLaMA from transformers goes through the trainer to its final weights unchanged") {
  test::TempDir dir("hf-llama-train");
  const fs::path hf = make_hf("llama", dir.path / "hf");
  // lr 1e-30: the updates are below half an ulp, so the weights stay bitwise the checkpoint's.
  const auto r = test::trainer(fmt::format("--config configs/tiny.yaml {} --set model.init_from={} --set train.steps=2 "
                                           "--set train.lr=1e-30 --set train.min_lr=0 --set train.eval_interval=0 "
                                           "--set logging.save_model=true --set logging.dir={}",
                                           kLlamaSets, hf.string(), (dir.path / "run").string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  check_bitwise(dir.path / "run" / "model" / "model.safetensors", hf / "model.safetensors");
  check_bitwise(hf / "model.safetensors", dir.path / "run" / "model" / "model.safetensors");
}

namespace {

// A model.lora model as the trainer runs it: the frozen weights from the base checkpoint, the adapters
// (unmerged: x W^T + (alpha / r) B A x) from a PEFT adapter directory.
model::GPT load_adapted(const config::ModelConfig& m, const fs::path& base, const fs::path& adapter) {
  model::GPT model(m, torch::kCPU);
  const interop::HfCheckpoint ckpt(base, interop::without_lora(m));
  const interop::PeftAdapter peft(adapter, m);
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    const auto v = item.value().view({-1});
    if (item.value().requires_grad()) peft.read(item.key(), 0, v.numel(), v);
    else ckpt.read(item.key(), 0, v.numel(), v);
  }
  model->eval();
  return model;
}

}  // namespace

// model.lora end to end against PEFT: the trainer's adapters, exported as PEFT's directory, give over
// transformers' base the logits the trainer's own model gives (kLogitTol: the adapters add two small
// products per projection to the operations its derivation counts, well inside its 3x margin); the merged
// export is PEFT's merge_and_unload; a run started from the adapter directory holds its adapters exactly.
TEST_CASE("LoRA: PEFT loads the exported adapter over transformers' base with the trainer's logits, --merged is "
          "merge_and_unload's, and model.init_from continues from the adapter", "[numerics]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    DYNAMIC_SECTION(arch) {
      test::TempDir dir("hf-lora-" + arch);
      const fs::path hf = make_hf(arch, dir.path / "hf");
      const std::string lora = "--set 'model.lora={rank: 4, alpha: 8, targets: [all-linear]}'";
      const std::string common = fmt::format(
          "--config configs/tiny.yaml {} {} --set model.init_from={} --set train.micro_batch=4 --set train.grad_accum=1 "
          "--set train.eval_interval=0 --set train.warmup_steps=1 --set logging.progress=false",
          arch == "llama" ? kLlamaSets : "", lora, hf.string());
      const fs::path run = dir.path / "run";
      const auto r = test::trainer(common + " --set train.steps=4 --set train.lr=1e-2 --set logging.save_model=true "
                                   "--set logging.dir=" + run.string());
      INFO(r.output);
      REQUIRE(r.code == 0);
      const auto ex = test::trainer("export --run " + run.string() + " --out " + (dir.path / "peft").string());
      INFO(ex.output);
      REQUIRE(ex.code == 0);
      const auto mx = test::trainer("export --merged --run " + run.string() + " --out " + (dir.path / "merged").string());
      INFO(mx.output);
      REQUIRE(mx.code == 0);

      const auto cfg = config::load_string(arch == "llama" ? kLlamaRecipe : kGpt2Recipe,
                                           {"model.lora={rank: 4, alpha: 8, targets: [all-linear]}"});
      auto ours = load_adapted(cfg.model, hf, dir.path / "peft");
      const state::SafetensorsFile ref(hf / "ref.safetensors");
      const auto mine = run_model(ours, ref.view("tokens")).logits;
      // The adapters moved: the adapted model's logits are not the base's.
      CHECK(max_abs(mine, ref.view("logits")) > 100 * kLogitTol);
      const auto pr = parity(fmt::format("peft {} {} {} {}", hf.string(), (dir.path / "peft").string(),
                                         (hf / "ref.safetensors").string(), (dir.path / "peft.safetensors").string()));
      INFO(pr.output);
      REQUIRE(pr.code == 0);
      const state::SafetensorsFile theirs(dir.path / "peft.safetensors");
      CHECK(max_abs(theirs.view("logits"), mine) <= kLogitTol);
      CHECK(max_abs(theirs.view("merged_logits"), mine) <= kLogitTol);
      // The merged export (from the state: the base from model.init_from) is the run's final merged weights,
      // bitwise, and transformers runs it with the same logits.
      check_bitwise(dir.path / "merged" / "model.safetensors", run / "model" / "model.safetensors");
      const auto back = hf_logits(dir.path / "merged", hf / "ref.safetensors", dir.path / "back.safetensors");
      CHECK(max_abs(back.view("logits"), mine) <= kLogitTol);
      // The state holds the adapters (and their moments) only, not the frozen weights.
      for (const auto& e : state::SafetensorsFile(run / "state" / "step-00000004" / "rank-00000.safetensors").entries())
        if (e.name.rfind("param/", 0) == 0) CHECK(e.name.find(".lora_") != std::string::npos);

      // Continuing from the adapter directory (its base_model_name_or_path is the base): a vanishing learning
      // rate leaves the adapters bitwise the exported ones.
      const fs::path again = dir.path / "again";
      const auto r2 = test::trainer(fmt::format("{} --set model.init_from={} --set train.steps=1 --set train.lr=1e-30 "
                                                "--set train.min_lr=0 --set logging.save_model=true --set logging.dir={}",
                                                common, (dir.path / "peft").string(), again.string()));
      INFO(r2.output);
      REQUIRE(r2.code == 0);
      check_bitwise(again / "adapter" / "adapter_model.safetensors", dir.path / "peft" / "adapter_model.safetensors");
    }
  }
}

// Fine-tuning's loss (data.source: examples): eight examples of 3 to 65 tokens, about a third of each a prompt
// (not trained), one optimizer step's worth (every step sees all eight, in its own order).
TEST_CASE("examples: micro-batch 1 x accumulation 8, 8 x 1, 2 ranks x 4 and sequence degree 2 train alike, and step "
          "1's loss is transformers' with labels -100 where the mask is 0", "[numerics]") {
  test::TempDir dir("hf-masked");
  const fs::path hf = make_hf("llama", dir.path / "hf");
  const auto examples = test::varied_examples(8, 65, 256);
  const auto train = test::write_examples(dir.path, "train", examples);
  int64_t trained = 0;  // a step's trained targets: every example's
  for (const auto& e : examples) trained += static_cast<int64_t>(e.tokens.size() - e.prompt);
  const auto val = test::write_examples(dir.path, "val", test::varied_examples(4, 40, 256, 2));
  const auto r = parity(fmt::format("masked {} {} {}", hf.string(), train, (dir.path / "ref.safetensors").string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const state::SafetensorsFile ref(dir.path / "ref.safetensors");
  const double want = ref.view("loss").item<double>(), mean_of_means = ref.view("mean_of_means").item<double>();

  const std::string common = fmt::format(
      "--config configs/tiny.yaml {} --set train.seq_len=64 --set model.init_from={} --set data.source=examples "
      "--set data.path={} --set data.val_path={} --set train.steps=3 --set train.eval_interval=3 --set train.eval_batches=8 "
      "--set logging.save_model=true --set logging.progress=false", kLlamaSets, hf.string(), train, val);
  const auto dir_of = [&](const char* name) { return (dir.path / name).string(); };
  const auto one = test::trainer(common + " --set train.micro_batch=1 --set train.grad_accum=8 --set logging.dir=" +
                                 dir_of("1x8"));
  INFO(one.output);
  REQUIRE(one.code == 0);
  const auto eight = test::trainer(common + " --set train.micro_batch=8 --set train.grad_accum=1 --set logging.dir=" +
                                   dir_of("8x1"));
  INFO(eight.output);
  REQUIRE(eight.code == 0);
  const auto two = test::launch(2, common + " --set train.micro_batch=4 --set train.grad_accum=1 --set logging.dir=" +
                                       dir_of("2x4"));
  INFO(two.outputs[0]);
  REQUIRE(two.codes == std::vector<int>{0, 0});
  // Sequence parallelism: each rank holds half of every row's positions, and so of its trained targets.
  const auto seq = test::launch(2, common + " --set train.micro_batch=8 --set train.grad_accum=1 "
                                       "--set parallel.sequence=2 --set logging.dir=" + dir_of("seq2"));
  INFO(seq.outputs[0]);
  REQUIRE(seq.codes == std::vector<int>{0, 0});

  // Step 1 runs the checkpoint's weights over all eight examples: its loss is the mean over their trained
  // tokens, transformers' within kLossTol (each token's loss within 2 max|dz|, and so their mean).
  for (const char* run : {"1x8", "8x1", "2x4", "seq2"}) {
    INFO(run);
    const auto steps = test::step_records(dir.path / run / "metrics.jsonl");
    REQUIRE(steps.size() == 3);
    CHECK(std::abs(steps[0].loss - want) <= kLossTol);
    // Tokens processed (8 rows of 64) and trained, apart, in the summary and in every step's record.
    const auto s = nlohmann::json::parse(test::read_text(dir.path / run / "summary.json"));
    CHECK(s["tokens"] == 3 * 8 * 64);
    CHECK(s["trained_tokens"] == 3 * trained);
    std::ifstream metrics(dir.path / run / "metrics.jsonl");
    int64_t records = 0;
    for (std::string line; std::getline(metrics, line);) {
      const auto rec = nlohmann::json::parse(line);
      if (!rec.contains("trained_tokens")) continue;
      ++records;
      CHECK(rec["trained_tokens"] == trained);
      CHECK(rec["tokens"] == 8 * 64);
      // Both are a count over the same step time: one rounding each, and two in the product here.
      const double rate = rec["tokens_per_s"].get<double>() * static_cast<double>(trained) / (8 * 64);
      CHECK(std::abs(rec["trained_tokens_per_s"].get<double>() - rate) <= 4 * DBL_EPSILON * rate);
    }
    CHECK(records == 3);
  }
  // The mean of the examples' own means (micro-batch 1 averaged per micro-batch) is another number: the
  // comparison above tells the two apart.
  CHECK(std::abs(mean_of_means - want) > 10 * kLossTol);
  // The eval after step 3 scores whole epochs of the four val examples (8 batches of 1, 4 or 8 rows, on one
  // or two ranks): the mean over their trained tokens, transformers' on the run's final weights.
  for (const char* run : {"1x8", "2x4", "seq2"}) {
    INFO(run);
    const auto out = dir.path / run / "val_ref.safetensors";
    const auto v = parity(fmt::format("masked {} {} {}", (dir.path / run / "model").string(), val, out.string()));
    INFO(v.output);
    REQUIRE(v.code == 0);
    const auto s = nlohmann::json::parse(test::read_text(dir.path / run / "summary.json"));
    CHECK(std::abs(s["final_val_loss"].get<double>() - state::SafetensorsFile(out).view("loss").item<double>()) <=
          kLossTol);
  }
  // Every step's loss and gradient norm, and the final weights: only the order of fp32 sums differs.
  CHECK_PARITY(dir.path / "1x8", dir.path / "8x1");
  CHECK_PARITY(dir.path / "8x1", dir.path / "2x4");
  CHECK_PARITY(dir.path / "8x1", dir.path / "seq2");

  // Packed (data.packing): the eight examples fill three rows of 64 (191 inputs); micro-batch 4 x 1, 2 ranks
  // x 2 and sequence degree 2 (each rank half of every row, the mask over the whole rows) train alike.
  const std::string packed = common + " --set data.packing=true --set train.grad_accum=1";
  const auto p1 = test::trainer(packed + " --set train.micro_batch=4 --set logging.dir=" + dir_of("packed"));
  INFO(p1.output);
  REQUIRE(p1.code == 0);
  const auto p2 = test::launch(2, packed + " --set train.micro_batch=2 --set logging.dir=" + dir_of("packed2x2"));
  INFO(p2.outputs[0]);
  REQUIRE(p2.codes == std::vector<int>{0, 0});
  const auto ps = test::launch(2, packed + " --set train.micro_batch=4 --set parallel.sequence=2 --set logging.dir=" +
                                      dir_of("packed_seq2"));
  INFO(ps.outputs[0]);
  REQUIRE(ps.codes == std::vector<int>{0, 0});
  CHECK_PARITY(dir.path / "packed", dir.path / "packed2x2");
  CHECK_PARITY(dir.path / "packed", dir.path / "packed_seq2");
  // Four rows of 64 hold every example and more: a step trains more tokens than the padded 8 x 64 did.
  const auto packed_summary = nlohmann::json::parse(test::read_text(dir.path / "packed" / "summary.json"));
  CHECK(packed_summary["tokens"] == 3 * 4 * 64);
  CHECK(packed_summary["trained_tokens"].get<int64_t>() > 3 * trained);
}

TEST_CASE("bad checkpoints and mismatched recipes exit 3 naming the tensor or key; nothing is trained") {
  test::TempDir dir("hf-bad");
  const fs::path hf = make_hf("gpt2", dir.path / "hf");
  const fs::path run = dir.path / "run";
  auto train_from = [&](const fs::path& file, const std::string& sets = "") {
    return test::trainer(fmt::format("--config configs/tiny.yaml --set model.init_from={} --set train.steps=1 "
                                     "--set logging.dir={} {}",
                                     file.string(), run.string(), sets));
  };
  struct Case {
    std::string kind, names;
  };
  for (const Case& c : {Case{"missing", "transformer.h.0.attn.c_attn.weight"}, Case{"extra", "transformer.h.0.mlp.c_gate.weight"},
                        Case{"shape", "transformer.h.0.ln_1.weight"}, Case{"dtype", "transformer.h.0.ln_1.weight"},
                        Case{"header", "header"}}) {
    INFO(c.kind);
    const fs::path bad = dir.path / (c.kind + ".safetensors");
    const auto b = parity(fmt::format("bad {} {} {}", c.kind, (hf / "model.safetensors").string(), bad.string()));
    REQUIRE(b.code == 0);
    const auto r = train_from(bad);
    INFO(r.output);
    CHECK(r.code == 3);
    CHECK(r.output.find(c.names) != std::string::npos);
    CHECK(r.output.find(bad.string()) != std::string::npos);
    CHECK(!fs::exists(run));
  }
  // The right file for another model: the shapes say which tensors (no config.json beside this copy).
  const fs::path alone = dir.path / "alone.safetensors";
  fs::copy_file(hf / "model.safetensors", alone);
  const auto wide = train_from(alone, "--set model.n_embd=64");
  INFO(wide.output);
  CHECK(wide.code == 3);
  CHECK(wide.output.find("transformer.wte.weight has shape [256, 128] but the recipe's model needs [256, 64]") !=
        std::string::npos);
  CHECK(!fs::exists(run));
  // A config.json with a key of the wrong type is a data error too, not a crash.
  const fs::path typed = dir.path / "typed";
  fs::create_directories(typed);
  fs::copy_file(hf / "model.safetensors", typed / "model.safetensors");
  std::ofstream(typed / "config.json") << R"({"model_type": "gpt2", "n_inner": "four"})";
  const auto wrong_type = train_from(typed);
  INFO(wrong_type.output);
  CHECK(wrong_type.code == 3);
  CHECK(wrong_type.output.find("wrong type") != std::string::npos);
  CHECK(!fs::exists(run));
  // Beside the file, config.json catches what shapes cannot: here the norm epsilon.
  const auto eps = train_from(hf, "--set model.norm_eps=1e-6");
  INFO(eps.output);
  CHECK(eps.code == 3);
  CHECK(eps.output.find("layer_norm_epsilon") != std::string::npos);
  CHECK(eps.output.find("model.norm_eps") != std::string::npos);
  CHECK(!fs::exists(run));
}

TEST_CASE("export takes the other source when one is damaged; unwritable outputs exit 7 and keep the walk going") {
  test::TempDir dir("hf-export");
  const fs::path run = dir.path / "run";
  const auto t = test::trainer("--config configs/tiny.yaml --set train.steps=2 --set train.eval_interval=0 "
                               "--set logging.save_model=true --set logging.progress=false --set logging.dir=" +
                               run.string());
  INFO(t.output);
  REQUIRE(t.code == 0);
  const fs::path final_file = run / "model" / "model.safetensors", state_dir = run / "state" / "step-00000002";
  REQUIRE(fs::exists(final_file));
  REQUIRE(fs::exists(state_dir));
  const fs::path kept = dir.path / "final.safetensors";
  fs::copy_file(final_file, kept);

  // Final weights truncated: the saved state (same step) is exported, bitwise the same weights.
  fs::resize_file(final_file, 100);
  const auto from_state = test::trainer("export --run " + run.string() + " --out " + (dir.path / "a").string());
  INFO(from_state.output);
  REQUIRE(from_state.code == 0);
  CHECK(from_state.output.find("ignoring the final weights") != std::string::npos);
  CHECK(from_state.output.find(state_dir.string()) != std::string::npos);
  check_bitwise(dir.path / "a" / "model.safetensors", kept);

  // Every state unusable, final weights intact: those are exported, with a warning.
  fs::copy_file(kept, final_file, fs::copy_options::overwrite_existing);
  for (const auto& e : fs::directory_iterator(state_dir))
    if (e.path().extension() == ".safetensors") fs::resize_file(e.path(), 64);
  const auto from_final = test::trainer("export --run " + run.string() + " --out " + (dir.path / "b").string());
  INFO(from_final.output);
  REQUIRE(from_final.code == 0);
  CHECK(from_final.output.find("no saved state is usable") != std::string::npos);
  check_bitwise(dir.path / "b" / "model.safetensors", kept);

  // --out below a regular file: exit 7 naming the directory, nothing written.
  const fs::path blocker = dir.path / "blocker";
  std::ofstream(blocker) << "a file, not a directory";
  const auto blocked = test::trainer("export --run " + run.string() + " --out " + (blocker / "hf").string());
  INFO(blocked.output);
  CHECK(blocked.code == 7);
  CHECK(blocked.output.find((blocker / "hf").string()) != std::string::npos);

  // write_hf itself: a writer that cannot open still walks every unit (under zero3 each is a collective).
  const auto cfg = config::load_string(kGpt2Recipe, {});
  model::GPT model(cfg.model, torch::kCPU);
  auto source = model_source(model);
  int64_t entered = 0, left = 0;
  source.enter = [&](int64_t) { ++entered; };
  source.leave = [&](int64_t) { ++left; };
  CHECK_THROWS_AS(interop::write_hf(blocker / "hf" / "model.safetensors", cfg.model, torch::kFloat, source, true, {}),
                  IoError);
  CHECK(entered == model::unit_count(cfg.model));
  CHECK(left == entered);
}

}  // namespace SUBLINEAR_TEST_FILE
