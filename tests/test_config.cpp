// Recipe loading: good recipes, precedence, and bad recipes each failing with exit code 2 and a
// message that names the key (and the YAML line where there is one).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <variant>

#include "catch.h"
#include <yaml-cpp/yaml.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "layout/mesh.h"
#include "errors.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;

TEST_CASE("every shipped recipe loads and validates") {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::kSourceDir + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    INFO(entry.path().string());
    // A recipe with sequence parallelism runs on at least parallel.sequence ranks: it is checked at that
    // world size (as torchrun's WORLD_SIZE gives it), every other recipe at 1.
    const auto node = YAML::LoadFile(entry.path().string())["parallel"];
    const auto degree = node && node["sequence"] ? node["sequence"].as<int64_t>() : int64_t{1};
    if (degree > 1) ::setenv("WORLD_SIZE", std::to_string(degree).c_str(), 1);
    std::optional<config::RunConfig> cfg;
    try {
      cfg = config::load(entry.path().string(), {});
    } catch (...) {
      ::unsetenv("WORLD_SIZE");
      throw;
    }
    ::unsetenv("WORLD_SIZE");
    CHECK(cfg->recipe_name == entry.path().stem().string());
    CHECK(cfg->parallel.sequence == degree);
    ++n;
  }
  CHECK(n >= 3);
}

TEST_CASE("tiny recipe resolves to the tiny preset") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  CHECK(cfg.model.preset == "tiny");
  CHECK(cfg.model.n_layer == 4);
  CHECK(cfg.model.vocab_size == 256);
  CHECK(cfg.data.source == config::DataSource::kLlmc);
}

TEST_CASE("precedence: --set beats YAML beats preset beats defaults") {
  const std::string yaml = "model:\n  preset: gpt2-124m\n  n_layer: 2\n";
  auto from_yaml = config::load_string(yaml, {});
  CHECK(from_yaml.model.n_layer == 2);             // YAML over preset
  CHECK(from_yaml.model.n_embd == 768);            // preset over defaults
  CHECK(from_yaml.train.lr == config::TrainConfig{}.lr);  // defaults where nobody spoke
  auto from_set = config::load_string(yaml, {"model.n_layer=3", "train.lr=0.01"});
  CHECK(from_set.model.n_layer == 3);
  CHECK(from_set.train.lr == 0.01);
  // A preset given by --set replaces the file's preset, but the file's explicit keys still win.
  auto preset_set = config::load_string(yaml, {"model.preset=gpt2-350m"});
  CHECK(preset_set.model.preset == "gpt2-350m");
  CHECK(preset_set.model.n_embd == 1024);
  CHECK(preset_set.model.n_layer == 2);
}

TEST_CASE("lists and booleans parse from YAML and --set") {
  auto cfg = config::load_string("checkpointing:\n  mode: selective\n  recompute: [attention, norm]\n",
                                 {"checkpointing.skip_last=false"});
  CHECK(cfg.checkpointing.recompute == std::vector<std::string>{"attention", "norm"});
  CHECK_FALSE(cfg.checkpointing.skip_last);
}

TEST_CASE("resolved config serializes every section and key") {
  auto j = config::to_json(config::load_string("", {}));
  for (const char* s : {"model", "data", "train", "checkpointing", "precision", "parallel", "memory", "logging"})
    CHECK(j.contains(s));
  CHECK(j["model"]["n_layer"] == 4);
  CHECK(j["checkpointing"]["mode"] == "none");
  // The JSON form loads back to the same config.
  std::string yaml;
  for (auto& [sec, keys] : j.items()) {
    yaml += sec + ":\n";
    for (auto& [k, v] : keys.items()) yaml += "  " + k + ": " + v.dump() + "\n";
  }
  CHECK(config::to_json(config::load_string(yaml, {})) == j);
}

// The recipe's choices, sizes, budget and loss scale are read once, at load, into typed values; the
// recipe's text is what config.json and the start-up table print, and it loads back to the same values.
TEST_CASE("typed recipe values are parsed at load and printed as the recipe wrote them") {
  const auto cfg = config::load_string(
      "model:\n  arch: llama\n  bias: false\n  tie_embeddings: false\n"
      "data:\n  source: bin\n  raw_dtype: uint32\n"
      "train:\n  device: cpu\n  on_nonfinite: skip\n  on_spike: stop\n"
      "checkpointing:\n  mode: budget\n  budget: 90%\n"
      "precision:\n  compute: bf16\n  param_dtype: bf16\n  reduce_dtype: bf16\n  loss_scale: 1024\n"
      "parallel:\n  backend: gloo\n  sharding: zero2\n"
      "memory:\n  limit: 8GiB\n  host_limit: 512 MiB\n",
      {});
  CHECK(cfg.model.arch == config::Arch::kLlama);
  CHECK(cfg.data.source == config::DataSource::kBin);
  CHECK(cfg.data.source.llmc());  // bin is llmc's old name
  CHECK(cfg.data.raw_dtype.bytes() == 4);
  CHECK(cfg.train.device == config::DeviceChoice::kCpu);
  CHECK(cfg.train.on_nonfinite == config::OnNonfinite::kSkip);
  CHECK(cfg.train.on_spike == config::OnSpike::kStop);
  CHECK(cfg.train.on_spike.holds());
  CHECK(cfg.precision.compute == config::Dtype::kBf16);
  CHECK(cfg.precision.param_dtype.bytes() == 2);
  CHECK(cfg.precision.reduce_dtype == config::Dtype::kBf16);
  CHECK_FALSE(cfg.precision.loss_scale.dynamic());
  CHECK(cfg.precision.loss_scale.fixed == 1024.0);
  CHECK(cfg.parallel.backend == config::Backend::kGloo);
  CHECK(cfg.memory.limit.bytes == int64_t{8} << 30);
  CHECK(cfg.memory.host_limit.bytes == int64_t{512} << 20);
  CHECK(cfg.checkpointing.budget.bytes == 0);
  CHECK(cfg.checkpointing.budget.share == 0.9);  // 90 / 100, correctly rounded: the double nearest 0.9
  const auto j = config::to_json(cfg);
  CHECK(j["model"]["arch"] == "llama");
  CHECK(j["data"]["source"] == "bin");
  CHECK(j["train"]["on_spike"] == "stop");
  CHECK(j["precision"]["param_dtype"] == "bf16");
  CHECK(j["precision"]["loss_scale"] == "1024");
  CHECK(j["parallel"]["backend"] == "gloo");
  CHECK(j["memory"]["limit"] == "8GiB");
  CHECK(j["memory"]["host_limit"] == "512 MiB");
  CHECK(j["checkpointing"]["budget"] == "90%");
  const auto rows = config::to_rows(cfg);
  const auto row = [&](const std::string& key) {
    for (const auto& [k, v] : rows)
      if (k == key) return v;
    return std::string("(no row)");
  };
  CHECK(row("memory.host_limit") == "512 MiB");
  CHECK(row("precision.compute") == "bf16");
  std::string yaml;
  for (auto& [sec, keys] : j.items()) {
    yaml += sec + ":\n";
    for (auto& [k, v] : keys.items()) yaml += "  " + k + ": " + v.dump() + "\n";
  }
  CHECK(config::to_json(config::load_string(yaml, {})) == j);
}

TEST_CASE("a bad value of a typed key is refused at load naming the key, with its line from YAML, alone from --set") {
  const std::vector<std::pair<std::string, std::string>> names = {
      {"model.arch", "gpt3"},        {"precision.compute", "fp8"},   {"precision.param_dtype", "fp8"},
      {"precision.reduce_dtype", "fp8"}, {"parallel.backend", "mpi"}, {"train.device", "gpu"},
      {"data.source", "csv"},        {"data.raw_dtype", "int8"},     {"train.on_nonfinite", "ignore"},
      {"train.on_spike", "maybe"},   {"train.cuda_graphs", "always"}};
  for (const auto& [key, value] : names) {
    INFO(key);
    const auto dot = key.find('.');
    const std::string yaml = key.substr(0, dot) + ":\n  " + key.substr(dot + 1) + ": " + value + "\n";
    const std::string said = key + ": '" + value + "' is not one of ";
    CHECK_THROWS_WITH(config::load_string(yaml, {}), Catch::Contains(said) && Catch::Contains("(line 2)"));
    CHECK_THROWS_WITH(config::load_string("", {key + "=" + value}), Catch::Contains(said) && !Catch::Contains("line"));
  }
  CHECK_THROWS_WITH(config::load_string("memory:\n  host_limit: lots\n", {}),
                    Catch::Contains("memory.host_limit: 'lots' is not a size") && Catch::Contains("(line 2)"));
  CHECK_THROWS_WITH(config::load_string("", {"memory.limit=lots"}),
                    Catch::Contains("memory.limit: 'lots' is not a size") && !Catch::Contains("line"));
  CHECK_THROWS_WITH(config::load_string("checkpointing:\n  mode: budget\n  budget: 0%\n", {}),
                    Catch::Contains("checkpointing.budget: '0%' is not a share") && Catch::Contains("(line 3)"));
  CHECK_THROWS_WITH(config::load_string("", {"precision.loss_scale=-2"}),
                    Catch::Contains("precision.loss_scale: a fixed scale must be > 0") && !Catch::Contains("line"));
}

TEST_CASE("--help-config lists every key with its doc") {
  auto r = test::trainer("--help-config");
  CHECK(r.code == 0);
  for (const char* key : {"preset", "n_layer", "max_seq_len", "micro_batch", "grad_accum", "seed", "interval",
                          "skip_last", "dir", "peak_tflops"})
    CHECK(r.output.find(key) != std::string::npos);
  CHECK(r.output.find("transformer blocks L") != std::string::npos);
}

namespace {
struct BadCase {
  const char* name;
  const char* yaml;  // nullptr: no --config file given through yaml
  const char* extra;
  std::vector<const char*> expect;  // substrings of the message
};
// A valid recipe for cases about --set (an empty recipe file is an error of its own).
constexpr const char* kAnyRecipe = "train: {}\n";
}  // namespace

TEST_CASE("bad recipes exit 2 with a message naming the key, before any output is written") {
  const std::vector<BadCase> cases = {
      {"unknown section", "modle:\n  n_layer: 2\n", "", {"unknown section 'modle'", "line 1"}},
      {"unknown key", "model:\n  n_layers: 2\n", "", {"unknown key 'model.n_layers'", "line 2", "n_layer"}},
      {"string for integer", "train:\n  steps: ten\n", "", {"train.steps: expected integer, got 'ten'", "line 2"}},
      {"float for integer", "train:\n  micro_batch: 2.5\n", "", {"train.micro_batch: expected integer"}},
      {"zero micro-batch (auto is spelled auto)", "train:\n  micro_batch: 0\n", "", {"train.micro_batch: must be > 0 or auto, got 0"}},
      {"unknown sharding stage", "parallel:\n  sharding: zero4\n", "", {"parallel.sharding: 'zero4' is not one of none | zero1 | zero2 | zero3", "line 2"}},
      {"bad bool", "model:\n  bias: maybe\n", "", {"model.bias: expected bool, got 'maybe'"}},
      {"list for number", "train:\n  lr: [1, 2]\n", "", {"train.lr: expected number, got a list"}},
      {"heads do not divide width", "model:\n  n_embd: 130\n  n_head: 4\n", "", {"model.n_embd", "not divisible by model.n_head"}},
      {"sequence longer than context", "train:\n  seq_len: 512\n", "", {"train.seq_len", "model.max_seq_len = 256"}},
      {"non-positive steps", "train:\n  steps: -1\n", "", {"train.steps: must be > 0"}},
      {"dropout out of range", "model:\n  dropout: 1.5\n", "", {"model.dropout: must be in [0, 1)"}},
      {"unknown preset", "model:\n  preset: gpt5\n", "", {"model.preset: unknown preset 'gpt5'", "line 2"}},
      {"bad enum", "checkpointing:\n  mode: everything\n", "", {"checkpointing.mode: 'everything' is not one of"}},
      {"interval mode without k", "checkpointing:\n  mode: interval\n", "", {"checkpointing.interval", "exactly one of"}},
      {"interval and segments", "checkpointing:\n  mode: interval\n  interval: 2\n  segments: 2\n", "", {"exactly one of"}},
      {"interval longer than the model", "checkpointing:\n  mode: interval\n  interval: 9\n", "", {"checkpointing.interval", "model.n_layer = 4"}},
      {"bad selective part", "checkpointing:\n  mode: selective\n  recompute: [softmax]\n", "", {"checkpointing.recompute: 'softmax'"}},
      {"recompute list outside selective", "checkpointing:\n  recompute: [mlp]\n", "", {"checkpointing.recompute", "only used with"}},
      {"YAML syntax error", "model: [1, 2\n", "", {"YAML syntax error at line"}},
      {"section is not a map", "train: 5\n", "", {"section 'train'", "must be a map"}},
      {"min_lr above lr", "train:\n  lr: 0.001\n  min_lr: 0.01\n", "", {"train.min_lr"}},
      {"unknown device", "train:\n  device: gpu\n", "", {"train.device: 'gpu' is not one of"}},
      {"text data with a small vocab", "data:\n  source: text\n  path: data/corpus.txt\nmodel:\n  vocab_size: 100\n", "", {"model.vocab_size", ">= 256"}},
      {"zero vocab multiple", "model:\n  vocab_multiple: 0\n", "", {"model.vocab_multiple: must be >= 1, got 0", "1 = no padding"}},
      {"negative vocab multiple", kAnyRecipe, "--set model.vocab_multiple=-128", {"model.vocab_multiple: must be >= 1, got -128"}},
      {"vocab multiple that overflows", kAnyRecipe, "--set model.vocab_multiple=9223372036854775807",
       {"model.vocab_multiple", "overflows the padded size"}},
      {"unsupported precision", "precision:\n  compute: fp8\n", "", {"precision.compute: 'fp8'"}},
      {"bad loss scale", "precision:\n  compute: fp16\n  loss_scale: huge\n", "", {"precision.loss_scale: 'huge'"}},
      {"bad tf32 value", "precision:\n  tf32: yes\n", "", {"precision.tf32: 'yes' is not one of auto | true | false", "line 2"}},
      {"tf32 on the CPU", kAnyRecipe, "--set train.device=cpu --set precision.tf32=true",
       {"precision.tf32: true needs a CUDA device", "on the CPU", "set precision.tf32: auto"}},
      {"--set unknown key", kAnyRecipe, "--set train.stepz=3", {"unknown key 'stepz'", "steps"}},
      {"--set unknown section", kAnyRecipe, "--set trian.steps=3", {"unknown section 'trian'"}},
      {"--set without =", kAnyRecipe, "--set train.steps", {"expected section.key=value"}},
      {"--set wrong type", kAnyRecipe, "--set train.lr=abc", {"train.lr: expected number, got 'abc'"}},
      {"bad memory size", kAnyRecipe, "--set memory.limit=lots", {"memory.limit: 'lots' is not a size"}},
      {"global batch disagrees", kAnyRecipe, "--set train.global_batch=7", {"train.global_batch: 7 is not"}},
      {"--set missing value", kAnyRecipe, "--set train.steps=", {"train.steps", "missing value"}},
      {"missing recipe file", nullptr, "--config /nonexistent/recipe.yaml", {"cannot open the recipe file"}},
      {"recipe is a directory", nullptr, "--config configs", {"--config configs: is a directory"}},
      {"empty recipe file", "# nothing but a comment\n", "", {"bad.yaml: the recipe is empty"}},
      {"key given twice", "train:\n  steps: 2\n  steps: 3\n", "", {"bad.yaml: key 'train.steps' is given twice (lines 2 and 3)"}},
      {"negative save cadence", kAnyRecipe, "--set state.every=-1", {"state.every: must be >= 0"}},
      {"segment recompute on the lazy test device", kAnyRecipe, "--set train.device=lazy --set checkpointing.mode=full",
       {"checkpointing.mode: full recomputes whole segments", "use none or selective"}},
      {"optimizer offload in one process without sharding", kAnyRecipe, "--set offload.optimizer=true",
       {"offload.optimizer", "at world size 1 set parallel.sharding: zero1"}},
      {"bad host memory size", kAnyRecipe, "--set memory.host_limit=lots", {"memory.host_limit: 'lots' is not a size"}},
      {"negative states kept", kAnyRecipe, "--set state.keep=-2", {"state.keep: must be >= 0"}},
      {"--resume of a missing state", nullptr, "--config configs/tiny.yaml --resume /nonexistent/state",
       {"--resume /nonexistent/state: no saved state there"}},
      {"no recipe at all", nullptr, "", {"--config: no recipe given"}},
      {"unknown flag", nullptr, "--config configs/tiny.yaml --bogus", {"bogus"}},
  };
  REQUIRE(cases.size() >= 15);
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.name) {
      test::TempDir dir("badcfg");
      const auto run_dir = dir.path / "run";
      std::string args;
      if (c.yaml) args = "--config " + dir.file("bad.yaml", c.yaml) + " ";
      args += std::string(c.extra) + " --set logging.dir=" + run_dir.string();
      auto r = test::trainer(args);
      INFO(r.output);
      CHECK(r.code == kExitConfig);
      for (const char* e : c.expect) CHECK(r.output.find(e) != std::string::npos);
      CHECK_FALSE(std::filesystem::exists(run_dir));
    }
  }
}

TEST_CASE("model.vocab_multiple: the tables' rows are vocab_size rounded up to it (1, the default, pads nothing)") {
  auto padded = [](int64_t vocab, int64_t multiple) {
    config::ModelConfig m;
    m.vocab_size = vocab, m.vocab_multiple = multiple;
    return m.padded_vocab();
  };
  CHECK(config::ModelConfig{}.vocab_multiple == 1);
  CHECK(padded(50257, 1) == 50257);
  CHECK(padded(50257, 128) == 50304);  // GPT-2's, as llm.c and nanoGPT pad it
  CHECK(padded(32000, 128) == 32000);  // LLaMA-2's is a multiple already
  CHECK(padded(128256, 128) == 128256);
  CHECK(padded(250, 128) == 256);
  CHECK(padded(300, 128) == 384);
  const auto gpt2 = config::load(test::kSourceDir + "/configs/gpt2_124m.yaml", {});
  CHECK(gpt2.model.vocab_multiple == 128);
  CHECK(gpt2.model.padded_vocab() == 50304);
  CHECK(config::load_string("model: {vocab_multiple: 64}\n", {}).model.padded_vocab() == 256);
}

TEST_CASE("the recipe reference (docs/recipes.md) names every key") {
  const std::string readme = test::read_text(test::kSourceDir + "/docs/recipes.md");
  auto j = config::to_json(config::load_string("", {}));
  for (auto& [sec, keys] : j.items())
    for (auto& [k, v] : keys.items()) {
      INFO(sec + "." + k);
      CHECK(readme.find("`" + sec + "." + k + "`") != std::string::npos);
    }
}

namespace {
// The message of the ConfigError that config::load(path) throws; "" when it loads.
std::string load_error(const std::string& path) {
  try {
    config::load(path, {});
  } catch (const ConfigError& e) {
    CHECK(e.code == kExitConfig);
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("recipe files that say nothing, or say a key twice, are refused naming the file and lines") {
  test::TempDir dir("recipefile");
  const std::vector<std::pair<const char*, std::vector<const char*>>> cases = {
      {"", {"the recipe is empty"}},
      {"# only a comment\n\n   # and another\n", {"the recipe is empty"}},
      {"---\n", {"the recipe is empty"}},
      {"~\n", {"the recipe is empty"}},
      {"train:\n  steps: 2\n  lr: 0.01\n  steps: 3\n", {"key 'train.steps' is given twice (lines 2 and 4)"}},
      {"train:\n  steps: 2\n  \"steps\": 3\n", {"key 'train.steps' is given twice (lines 2 and 3)"}},
      {"train: {steps: 2, steps: 3}\n", {"key 'train.steps' is given twice (line 1, columns 9 and 19)"}},
      {"train:\n  steps: 2\nmodel:\n  n_layer: 2\ntrain:\n  lr: 0.1\n", {"section 'train' is given twice (lines 1 and 5)"}},
      {"model:\n  preset: tiny\n---\ntrain:\n  steps: 2\n", {"2 YAML documents", "the second would be ignored (line 4)"}},
      {"- model\n- train\n", {"the recipe must be a map of sections", "not a list"}},
      {"tiny\n", {"the recipe must be a map of sections", "not the single value 'tiny'"}},
      {"train:\n  [steps]: 2\n", {"not a plain name", "line 2"}},
  };
  for (const auto& [yaml, expect] : cases) {
    INFO(yaml);
    const std::string path = dir.file("r.yaml", yaml);
    const std::string msg = load_error(path);
    CHECK(msg.find(path) != std::string::npos);
    for (const char* e : expect) CHECK(msg.find(e) != std::string::npos);
  }
  CHECK(load_error(dir.path.string()).find(dir.path.string() + ": is a directory") != std::string::npos);
}

TEST_CASE("document markers, a trailing ---, and comment-only text (in memory) still load") {
  test::TempDir dir("recipefile-ok");
  auto cfg = config::load(dir.file("ok.yaml", "# a recipe\n---\ntrain:\n  steps: 3\nmodel:\n  n_layer: 2\n---\n"), {});
  CHECK(cfg.train.steps == 3);
  CHECK(cfg.model.n_layer == 2);
  CHECK(cfg.recipe_name == "ok");
  // In-memory text without a document stands for the defaults (the tests and --set-only runs use it).
  CHECK(config::to_json(config::load_string("# nothing\n", {})) == config::to_json(config::load_string("", {})));
}

TEST_CASE("config::choice puts each mode together with the parameters it uses, from any key order") {
  namespace mode = config::mode;
  auto ck = [](std::vector<std::string> sets) { return config::load_string("", sets).checkpointing; };
  CHECK(std::holds_alternative<mode::None>(config::choice(ck({}))));
  CHECK(std::holds_alternative<mode::Full>(config::choice(ck({"checkpointing.mode=full"}))));
  CHECK(std::holds_alternative<mode::Sqrt>(config::choice(ck({"checkpointing.mode=sqrt"}))));
  // The parameter given before the mode, or after it: the same alternative.
  for (const auto& sets : {std::vector<std::string>{"checkpointing.interval=3", "checkpointing.mode=interval"},
                           std::vector<std::string>{"checkpointing.mode=interval", "checkpointing.interval=3"}}) {
    const auto c = config::choice(ck(sets));
    REQUIRE(std::holds_alternative<mode::Interval>(c));
    CHECK(std::get<mode::Interval>(c).k == 3);
    CHECK(std::get<mode::Interval>(c).segments == 0);
  }
  const auto seg = config::choice(ck({"checkpointing.mode=interval", "checkpointing.segments=2"}));
  REQUIRE(std::holds_alternative<mode::Interval>(seg));
  CHECK(std::get<mode::Interval>(seg).k == 0);
  CHECK(std::get<mode::Interval>(seg).segments == 2);
  const auto sel = config::choice(ck({"checkpointing.mode=selective", "checkpointing.recompute=[mlp, norm]"}));
  REQUIRE(std::holds_alternative<mode::Selective>(sel));
  CHECK_FALSE(std::get<mode::Selective>(sel).attention);
  CHECK(std::get<mode::Selective>(sel).mlp);
  CHECK(std::get<mode::Selective>(sel).norm);
  const auto bytes = config::choice(ck({"checkpointing.mode=budget", "checkpointing.budget=6GiB", "memory.limit=8GiB"}));
  REQUIRE(std::holds_alternative<mode::Budget>(bytes));
  CHECK(std::get<mode::Budget>(bytes).bytes == (int64_t{6} << 30));
  CHECK(std::get<mode::Budget>(bytes).share == 0.0);
  const auto share = config::choice(ck({"checkpointing.mode=budget", "checkpointing.budget=90%", "memory.limit=8GiB"}));
  REQUIRE(std::holds_alternative<mode::Budget>(share));
  CHECK(std::get<mode::Budget>(share).share == 0.9);
}

TEST_CASE("sizes beyond 64 bits, infinite, NaN or negative exit 2 naming the key: recipe keys and plan --memory") {
  // 2^63 bytes is the first size int64_t cannot hold: 8388608 TiB = 2^23 x 2^40 is refused, one TiB
  // less (2^63 - 2^40, exact in a double) is the largest TiB count taken.
  CHECK(config::parse_bytes("8388607TiB", "k") == (int64_t{8388607} << 40));
  CHECK_THROWS_WITH(config::parse_bytes("8388608TiB", "memory.limit"),
                    Catch::Contains("memory.limit: '8388608TiB' is 9.22e+18 bytes, more than the largest size"));
  CHECK_THROWS_WITH(config::parse_bytes("1e30GiB", "memory.limit"), Catch::Contains("memory.limit: '1e30GiB' is 1.07e+39 bytes"));
  CHECK_THROWS_WITH(config::parse_bytes("1e400", "memory.host_limit"), Catch::Contains("memory.host_limit: '1e400' is inf bytes"));
  CHECK_THROWS_WITH(config::parse_bytes("inf", "memory.limit"), Catch::Contains("memory.limit: 'inf' is inf bytes"));
  CHECK_THROWS_WITH(config::parse_bytes("nan", "memory.limit"), Catch::Contains("memory.limit: 'nan' is not a size"));
  CHECK_THROWS_WITH(config::parse_bytes("-1GiB", "memory.limit"), Catch::Contains("memory.limit: '-1GiB' is negative"));
  CHECK(config::parse_bytes("1e-400GiB", "k") == 0);  // below a double's smallest: 0 bytes
  struct Case {
    const char* args;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"--set memory.limit=1e30GiB", "memory.limit: '1e30GiB' is 1.07e+39 bytes"},
      {"--set memory.host_limit=inf", "memory.host_limit: 'inf' is inf bytes"},
      {"--set checkpointing.mode=budget --set checkpointing.budget=1e30GiB", "checkpointing.budget: '1e30GiB'"},
      {"--set memory.limit=-2GiB", "memory.limit: '-2GiB' is negative"},
      {"plan --memory 1e30GiB", "--memory: '1e30GiB' is 1.07e+39 bytes"},
      {"plan --memory nan", "--memory: 'nan' is not a size"},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.args) {
      test::TempDir dir("bigsize");
      const auto out = dir.path / "out";
      const std::string args(c.args);
      const bool plan = args.starts_with("plan");
      const auto r = test::trainer((plan ? args + " --config configs/tiny.yaml --out " + (out / "plan.json").string()
                                         : "--config configs/tiny.yaml " + args) +
                                   " --set logging.dir=" + out.string());
      INFO(r.output);
      CHECK(r.code == kExitConfig);
      CHECK_THAT(r.output, Catch::Contains(c.expect));
      CHECK_FALSE(std::filesystem::exists(out));  // no run directory, no plan.json
    }
  }
}

// logging.memory_timeline records the tracking CPU allocator, so it needs the run on the CPU; with
// train.device: auto only the resolved device says (the trainer's set-up asks after resolving it).
TEST_CASE("logging.memory_timeline: auto is accepted by the recipe and refused once it resolves to CUDA") {
  const auto cfg = config::load_string("logging:\n  memory_timeline: 2\ntrain:\n  device: auto\n", {});
  CHECK_NOTHROW(config::validate_resolved_device(cfg, /*on_cuda=*/false));  // auto on a machine without CUDA
  CHECK_THROWS_AS(config::validate_resolved_device(cfg, /*on_cuda=*/true), ConfigError);
  CHECK_THROWS_WITH(config::validate_resolved_device(cfg, /*on_cuda=*/true),
                    Catch::Contains("logging.memory_timeline") && Catch::Contains("train.device: auto puts this run on CUDA"));
  auto off = cfg;
  off.logging.memory_timeline = 0;
  CHECK_NOTHROW(config::validate_resolved_device(off, /*on_cuda=*/true));
  CHECK_THROWS_WITH(config::load_string("logging:\n  memory_timeline: 2\ntrain:\n  device: cuda\n", {}),
                    Catch::Contains("logging.memory_timeline") && Catch::Contains("train.device: cuda"));
}

// train.micro_batch: auto sizes the micro-batch to what has to fit: the GPU's memory on CUDA, memory.limit
// on the CPU. With train.device: auto the recipe cannot tell which, so the resolved device decides.
TEST_CASE("train.micro_batch auto without memory.limit: accepted with device auto, refused once it resolves to the CPU") {
  const auto recipe = [](const char* device) {
    return fmt::format("train:\n  device: {}\n  micro_batch: auto\n  global_batch: 8\n", device);
  };
  const auto cfg = config::load_string(recipe("auto"), {});
  CHECK_NOTHROW(config::validate_resolved_device(cfg, /*on_cuda=*/true));
  CHECK_THROWS_WITH(config::validate_resolved_device(cfg, /*on_cuda=*/false),
                    Catch::Contains("train.micro_batch") && Catch::Contains("memory.limit") &&
                        Catch::Contains("train.device: auto puts this run on the CPU"));
  auto limited = cfg;
  limited.memory.limit = {int64_t{1} << 30, "1GiB"};
  CHECK_NOTHROW(config::validate_resolved_device(limited, /*on_cuda=*/false));
  CHECK_THROWS_WITH(config::load_string(recipe("cpu"), {}),
                    Catch::Contains("train.micro_batch") && Catch::Contains("memory.limit"));
}

// memory.limit on the CPU is the tracking allocator's: with train.device: auto the recipe cannot tell
// whether the run will be on the CPU, so the resolved device decides whether memory.track_cpu: false
// leaves the limit unenforced (refused) or does not matter (CUDA).
TEST_CASE("memory.limit with memory.track_cpu false: accepted with device auto, refused once it resolves to the CPU") {
  const auto cfg = config::load_string("train:\n  device: auto\nmemory:\n  limit: 1GiB\n  track_cpu: false\n", {});
  CHECK_NOTHROW(config::validate_resolved_device(cfg, /*on_cuda=*/true));
  CHECK_THROWS_WITH(config::validate_resolved_device(cfg, /*on_cuda=*/false),
                    Catch::Contains("memory.limit") && Catch::Contains("memory.track_cpu") &&
                        Catch::Contains("train.device: auto puts this run on the CPU"));
  CHECK_THROWS_WITH(config::load_string("train:\n  device: cpu\nmemory:\n  limit: 1GiB\n  track_cpu: false\n", {}),
                    Catch::Contains("memory.limit") && Catch::Contains("memory.track_cpu"));
}

TEST_CASE("precision.tf32: auto (on for a CUDA run only), true (CUDA only, refused once the device resolves to "
          "another), false") {
  const auto dflt = config::load_string("", {});
  CHECK(dflt.precision.tf32 == config::Tf32::kAuto);
  CHECK(dflt.precision.tf32.enabled(/*on_cuda=*/true));
  CHECK_FALSE(dflt.precision.tf32.enabled(/*on_cuda=*/false));
  const auto off = config::load_string("", {"precision.tf32=false", "train.device=cpu"});
  CHECK(off.precision.tf32 == config::Tf32::kOff);
  CHECK_FALSE(off.precision.tf32.enabled(true));
  CHECK(config::to_json(off)["precision"]["tf32"] == "false");
  // true with device auto: accepted at load, checked once set-up resolves the device.
  const auto on = config::load_string("", {"precision.tf32=true"});
  CHECK(on.precision.tf32 == config::Tf32::kOn);
  CHECK(on.precision.tf32.enabled(true));
  CHECK_FALSE(on.precision.tf32.enabled(false));  // no TF32 off CUDA, whatever the recipe says
  CHECK(config::to_json(on)["precision"]["tf32"] == "true");
  CHECK_NOTHROW(config::validate_resolved_device(on, /*on_cuda=*/true));
  try {
    config::validate_resolved_device(on, /*on_cuda=*/false);
    FAIL("precision.tf32: true accepted on the CPU");
  } catch (const ConfigError& e) {
    CHECK(e.code == kExitConfig);
    CHECK_THAT(std::string(e.what()), Catch::Contains("precision.tf32: true needs a CUDA device") && Catch::Contains("train.device: auto"));
  }
  CHECK_THROWS_WITH(config::load_string("", {"precision.tf32=true", "train.device=lazy"}),
                    Catch::Contains("precision.tf32: true needs a CUDA device") && Catch::Contains("lazy test device"));
  CHECK_NOTHROW(config::load_string("", {"precision.tf32=true", "train.device=cuda"}));
  CHECK_THROWS_WITH(config::load_string("", {"precision.tf32=on"}),
                    Catch::Contains("precision.tf32: 'on' is not one of auto | true | false"));
}

TEST_CASE("the GPU recipes compute in bf16 on a bf16 compute copy of the weights, under a ZeRO stage") {
  // No casts per micro-batch; the ZeRO stage keeps the fp32 masters (the one-process strategy refuses
  // param_dtype).
  for (const char* recipe : {"gpt2_124m", "1b_24gb", "7b_24gb", "7b_ckpt", "7b_nockpt"}) {
    INFO(recipe);
    const auto c = config::load(test::kSourceDir + "/configs/" + recipe + ".yaml", {});
    CHECK(c.precision.compute == config::Dtype::kBf16);
    CHECK(c.precision.param_dtype == config::Dtype::kBf16);
    CHECK_FALSE(c.parallel.sharding.replicated());
  }
}

// ---- the process mesh (layout/mesh.h) ----

TEST_CASE("the process mesh gives every rank one place, sequence groups consecutive, data groups strided") {
  struct Layout { int64_t world, sequence; };
  for (const auto [world, sequence] : {Layout{1, 1}, Layout{4, 1}, Layout{4, 2}, Layout{4, 4}, Layout{8, 2},
                                       Layout{6, 3}, Layout{12, 4}}) {
    INFO("world " << world << ", sequence " << sequence);
    const layout::Mesh mesh(world, 0, {.sequence = sequence});
    CHECK(mesh.data() * mesh.sequence() == world);
    std::set<std::pair<int64_t, int64_t>> places;
    for (int64_t r = 0; r < world; ++r) {
      const auto m = mesh.at(r);
      CHECK(m.rank() == r);
      CHECK(m.data_rank() == r / sequence);  // written out here, the one other place: what the mesh must give
      CHECK(m.sequence_rank() == r % sequence);
      CHECK(m.rank_of(m.data_rank(), m.sequence_rank()) == r);
      places.insert({m.data_rank(), m.sequence_rank()});
      std::vector<int64_t> seq_group, data_group;
      for (int64_t s = 0; s < sequence; ++s) seq_group.push_back(r - r % sequence + s);
      for (int64_t d = 0; d < world / sequence; ++d) data_group.push_back(d * sequence + r % sequence);
      CHECK(m.sequence_group() == seq_group);
      CHECK(m.data_group() == data_group);
    }
    CHECK(static_cast<int64_t>(places.size()) == world);  // no two ranks share a place
  }
  // One example by hand: rank 5 of 8 at sequence degree 2.
  const layout::Mesh m(8, 5, {.sequence = 2});
  CHECK(m.data_rank() == 2);
  CHECK(m.sequence_rank() == 1);
  CHECK(m.sequence_group() == std::vector<int64_t>{4, 5});
  CHECK(m.data_group() == std::vector<int64_t>{1, 3, 5, 7});
}

TEST_CASE("the process mesh's batch arithmetic counts the data ranks only") {
  const layout::Mesh m(8, 3, {.sequence = 2});  // 4 data ranks
  CHECK(m.global_batch(3, 2) == 24);
  CHECK(m.tokens_per_step(3, 2, 64) == 24 * 64);
  CHECK(m.sequences_per_rank(24) == 6);
  CHECK(m.sequences_per_rank(25) == 7);  // rounded up
  CHECK(m.local_positions(64) == 32);
  const layout::Mesh one;
  CHECK(one.world() == 1);
  CHECK(one.global_batch(3, 2) == 6);
  CHECK(one.local_positions(64) == 64);
}

TEST_CASE("a mesh whose degrees do not fit the world is a recipe error naming them") {
  CHECK_FALSE(layout::Mesh::fits(4, {.sequence = 3}));
  CHECK(layout::Mesh::fits(6, {.sequence = 3}));
  const auto message = [](auto make) {
    try {
      make();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([] { (void)layout::Mesh(4, 0, {.sequence = 3}); }) ==
        "parallel.sequence: 3 does not divide WORLD_SIZE = 4: pick a degree that divides it");
  CHECK(message([] { (void)layout::Mesh(4, 4, {}); }).find("RANK: 4 is not in [0, WORLD_SIZE = 4)") == 0);
  CHECK(message([] { (void)layout::Mesh(2, 0, {.sequence = 0}); }).find("parallel.sequence: must be >= 1") == 0);
  // The recipe's mesh: world_size ranks with parallel.sequence.
  config::RunConfig cfg;
  cfg.parallel.sequence = 2;
  cfg.world_size = 4;
  CHECK(cfg.mesh(3) == layout::Mesh(4, 3, {.sequence = 2}));
}


// ---- the test executable's zygote (tests/zygote.h): trainer runs forked, not started ----

// The command's words as the zygote took them; {"not taken"} when it left the command to the shell.
std::vector<std::string> taken(const std::string& cmd) {
  const auto c = test::zygote::parse(cmd);
  if (!c) return {"not taken"};
  std::vector<std::string> out{"cwd=" + c->cwd};
  out.insert(out.end(), c->argv.begin(), c->argv.end());
  return out;
}

bool env_has(const test::zygote::Command& c, const std::string& entry) {
  return std::find(c.env.begin(), c.env.end(), entry) != c.env.end();
}

TEST_CASE("the zygote takes plain trainer runs and leaves every other command to the shell") {
  if (!test::zygote::running()) SUBLINEAR_SKIP("no zygote in this process (SUBLINEAR_TEST_EXEC=1 or SUBLINEAR_TRAINER)");
  const std::string t = test::kTrainer;
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string same_omp = omp != nullptr ? std::string("OMP_NUM_THREADS=") + omp + " " : "";
  CHECK(taken("cd /tmp && " + same_omp + t + " --config 'a b.yaml' --set \"x=1 2\"") ==
        std::vector<std::string>{"cwd=/tmp", t, "--config", "a b.yaml", "--set", "x=1 2"});
  const auto c = test::zygote::parse("RANK=1 env -u SUBLINEAR_NO_CPU_CACHE SUBLINEAR_X=2 " + t + " --help");
  REQUIRE(c);
  CHECK(env_has(*c, "RANK=1"));
  CHECK(env_has(*c, "SUBLINEAR_X=2"));
  CHECK(c->argv == std::vector<std::string>{t, "--help"});
  // Shell syntax, another program, command substitution: the shell's.
  for (const auto& cmd : std::vector<std::string>{t + " --help | head -1", t + " --help > /dev/null", "(" + t + " --help)",
                                t + " --prompt \"$(printf x)\"", t + " --prompt `true`", "cd /tmp && " + t + " && true",
                                "python3 " + t, "env " + t + "x --help", t + " --help\n" + t})
    CHECK(taken(cmd) == std::vector<std::string>{"not taken"});
  // A variable the libraries read while they load (after the zygote loaded them): the shell's.
  const char* cbwr = std::getenv("MKL_CBWR");
  const std::string other_cbwr = cbwr != nullptr && std::string(cbwr) == "AVX" ? "COMPATIBLE" : "AVX";
  CHECK(taken("MKL_CBWR=" + other_cbwr + " " + t + " --help") == std::vector<std::string>{"not taken"});
  CHECK(taken("env -u PATH " + t + " --help") == std::vector<std::string>{"not taken"});
  CHECK(taken("OMP_NUM_THREADS=7" + std::string(omp != nullptr && std::string(omp) == "7" ? "1" : "") + " " + t +
              " --help") == std::vector<std::string>{"not taken"});
}

TEST_CASE("a run forked by the zygote gives what the trainer binary gives") {
  if (!test::zygote::running()) SUBLINEAR_SKIP("no zygote in this process (SUBLINEAR_TEST_EXEC=1 or SUBLINEAR_TRAINER)");
  test::TempDir dir("zygote");
  const std::string in_src = "cd " + test::kSourceDir + " && " + test::kTrainer;
  // Exit codes and every byte of output: help, usage errors, recipe errors, the environment read by the run.
  for (const auto& args : std::vector<std::string>{" --help", " --help-config", " --frobnicate", " --config nowhere.yaml",
                                 " --config configs/tiny.yaml --set train.steps=oops", " export --run " + dir.path.string() + "/none"}) {
    INFO(args);
    REQUIRE(test::zygote::parse(in_src + args));
    const auto forked = test::zygote::run(in_src + args);
    REQUIRE(forked);
    const auto started = test::shell(in_src + args);
    CHECK(forked->code == started.code);
    CHECK(forked->text == started.output);
  }
  const auto env_run = "cd " + test::kSourceDir + " && RANK=0 WORLD_SIZE=two " + test::kTrainer + " --config configs/tiny.yaml";
  const auto forked_env = test::zygote::run(env_run);
  REQUIRE(forked_env);
  CHECK(forked_env->code == 2);
  CHECK(forked_env->text == test::shell(env_run).output);
  // Training: the same steps bitwise and the same final weights, byte for byte.
  const auto train = [&](const std::string& name) {
    return in_src + " --config configs/tiny.yaml --set train.steps=3 --set train.eval_interval=0 --set logging.dir=" +
           (dir.path / name).string();
  };
  const auto forked = test::zygote::run(train("forked"));
  REQUIRE(forked);
  REQUIRE(forked->code == 0);
  REQUIRE(test::shell(train("started")).code == 0);
  const auto a = test::step_records(dir.path / "forked" / "metrics.jsonl");
  CHECK(a.size() == 3);
  CHECK(test::bitwise_diff(a, test::step_records(dir.path / "started" / "metrics.jsonl")).empty());
  CHECK(test::read_text(dir.path / "forked" / "model" / "model.safetensors") ==
        test::read_text(dir.path / "started" / "model" / "model.safetensors"));
}

TEST_CASE("a run forked by the zygote is a process of its own: a signal ends it as it ends a trainer") {
  if (!test::zygote::running()) SUBLINEAR_SKIP("no zygote in this process (SUBLINEAR_TEST_EXEC=1 or SUBLINEAR_TRAINER)");
  test::TempDir dir("zygote-kill");
  const auto c = test::zygote::parse("cd " + test::kSourceDir + " && " + test::kTrainer +
                                     " --config configs/tiny.yaml --set train.steps=100000 --set logging.dir=" +
                                     (dir.path / "run").string());
  REQUIRE(c);
  const int out = ::open((dir.path / "out.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(out >= 0);
  auto run = test::zygote::spawn(*c, out);
  ::close(out);
  REQUIRE(run);
  CHECK(run->pid != ::getpid());
  CHECK(::kill(run->pid, 0) == 0);
  // Once it trains (a step record written), SIGKILL: the shell's status for it, 128 + 9.
  for (int i = 0; i < 600 && test::step_records_now(dir.path / "run" / "metrics.jsonl") == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(test::step_records_now(dir.path / "run" / "metrics.jsonl") > 0);
  REQUIRE(::kill(run->pid, SIGKILL) == 0);
  CHECK(test::zygote::wait(*run) == 137);
}

}  // namespace SUBLINEAR_TEST_FILE
