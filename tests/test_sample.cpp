// Text in, text out, checked against implementations this project did not write:
//   - the C++ tokenizer (src/text/tokenizer.h) encodes and decodes a multilingual test text exactly as
//     Hugging Face `tokenizers` does, for GPT-2's pre-tokenizer and LLaMA 3's Split + ByteLevel, and
//     refuses unsupported or broken tokenizer.json files with exit codes 2 / 3;
//   - a run trained on scripts/prepare_data.py's shards records their tokenizer; its final weights and
//     `trainer export` carry it, and transformers' AutoTokenizer and AutoModelForCausalLM load the folder;
//   - greedy `trainer sample` is token-for-token transformers' generate(do_sample=False), GPT-2 and
//     LLaMA, with and without the KV cache, from --run and from --weights; seeded sampling repeats;
//   - a tokenizer whose vocabulary is not model.vocab_size stops training with exit 2 naming both;
//   - train.sample_interval logs samples, at world 2 under zero3 too; every eval scores the same windows.
#include <filesystem>
#include <fstream>
#include <string>

#include "catch.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "model/gpt.h"
#include "text/tokenizer.h"
#include "train/trainer.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

namespace fs = std::filesystem;
using namespace sl;
using Json = nlohmann::json;

namespace {

// Contractions, numbers, accents, CJK, an emoji, tabs, runs of spaces and newlines, an added token.
const char* const kTestText =
    "Hello world! It's 2026... They'll say: naïve café, 東京 and Zürich; 1234567 + 89 = 1234656.\n"
    "tabs\t\tand  spaces   here\n\n  end <|endoftext|>next 🙂 done.   \n\n\nI'M LOUD, we've 'quoted'   ";

test::Result reference(const std::string& args) { return test::python("sample_ref.py", args); }

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// A byte-level BPE trained by `tokenizers` on the demo corpus and the test text.
fs::path make_tokenizer(const fs::path& dir, const std::string& style, int vocab = 600) {
  const fs::path text = dir / "extra.txt", out = dir / (style + ".json");
  write(text, kTestText);
  const auto r = reference(fmt::format("tokenizer {} --style {} --vocab {} {}/data/corpus.txt {}", out.string(), style, vocab,
                                 test::kSourceDir, text.string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  return out;
}

Json json_of(const test::Result& r) {
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto line = r.output.substr(r.output.rfind('{'));  // the last line is the JSON object
  return Json::parse(line.substr(0, line.find('\n')));
}

// The demo corpus tokenized by scripts/prepare_data.py with `tokenizer` (tokenizer.json lands beside the shards).
fs::path prepare(const fs::path& dir, const fs::path& tokenizer) {
  const auto r = test::run(fmt::format("{} {}/scripts/prepare_data.py {}/data/corpus.txt --delimiter '\\n' --tokenizer {} "
                                       "--out {} --quiet", test::kPython, test::kSourceDir, test::kSourceDir,
                                       tokenizer.string(), (dir / "data").string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  return dir / "data";
}

// The demo corpus in shards of a `style` tokenizer trained on it, with that tokenizer beside them.
struct Corpus {
  fs::path tokenizer, data;
  int64_t vocab = 0;
};
Corpus tokenized_corpus(const fs::path& dir, const std::string& style) {
  Corpus c;
  c.tokenizer = make_tokenizer(dir, style);
  c.vocab = text::Tokenizer::from_file(c.tokenizer).vocab_size();
  c.data = prepare(dir, c.tokenizer);
  return c;
}

// Trains (from the source directory) and requires exit 0.
void train_ok(const std::string& args) {
  const auto r = test::trainer(args);
  INFO(r.output);
  REQUIRE(r.code == 0);
}

std::string data_sets(const fs::path& data, int64_t vocab) {
  return fmt::format("--set data.path={0}/train.bin --set data.val_path={0}/val.bin --set model.vocab_size={1} ",
                     data.string(), vocab);
}

const char* const kGpt2Sets = "--set model.n_layer=2 --set model.n_embd=64 --set model.max_seq_len=128 ";
const char* const kLlamaSets =
    "--set model.preset= --set model.arch=llama --set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64 "
    "--set model.max_seq_len=128 --set model.mlp_hidden=160 --set model.tie_embeddings=false ";
const char* const kShortRun =
    "--set train.seq_len=64 --set train.micro_batch=8 --set train.grad_accum=1 --set train.steps=40 "
    "--set train.warmup_steps=5 --set train.eval_interval=0 --set logging.save_model=true ";

}  // namespace

TEST_CASE("tokenizer: encodes and decodes the test text as the tokenizers library does", "[tokenizer]") {
  test::TempDir dir("tok");
  write(dir.path / "test.txt", kTestText);
  for (const std::string style : {"gpt2", "llama3"}) {
    INFO(style);
    const auto path = make_tokenizer(dir.path, style);
    const Json want = json_of(reference(fmt::format("encode {} {}", path.string(), (dir.path / "test.txt").string())));
    const auto tok = text::Tokenizer::from_file(path);
    const auto ids = tok.encode(kTestText);
    CHECK(ids == want["ids"].get<std::vector<int64_t>>());
    CHECK(tok.decode(ids) == want["decoded"].get<std::string>());
    CHECK(tok.decode(ids) == kTestText);
    CHECK(tok.end_of_text() == tok.id_of("<|endoftext|>"));
    REQUIRE(tok.end_of_text().has_value());
    CHECK(std::count(ids.begin(), ids.end(), *tok.end_of_text()) == 1);  // the added token, matched verbatim
  }
}

TEST_CASE("tokenizer: long pieces (runs of spaces and digits) encode as the tokenizers library does", "[tokenizer]") {
  test::TempDir dir("toklong");
  const std::string text = "start" + std::string(3000, ' ') + std::string(2000, '7') + " end\n" + std::string(500, '\n') + "x";
  write(dir.path / "long.txt", text);
  for (const std::string style : {"gpt2", "llama3"}) {
    INFO(style);
    const auto path = make_tokenizer(dir.path, style);
    const Json want = json_of(reference(fmt::format("encode {} {}", path.string(), (dir.path / "long.txt").string())));
    const auto ids = text::Tokenizer::from_file(path).encode(text);
    CHECK(ids == want["ids"].get<std::vector<int64_t>>());
  }
}

TEST_CASE("tokenizer: the end-of-text token named beside the file wins (prepare_data.py --eot)", "[tokenizer]") {
  test::TempDir dir("tokeot");
  write(dir.path / "a.txt", "one small document about cats\n");
  write(dir.path / "b.txt", "another small document about dogs\n");
  const auto r = test::run(fmt::format("{} {}/scripts/prepare_data.py {} {} --train-bpe --vocab-size 300 --eot '<|doc|>' "
                                       "--val-fraction 0.5 --min-tokens 1 --out {} --quiet", test::kPython, test::kSourceDir,
                                       (dir.path / "a.txt").string(), (dir.path / "b.txt").string(),
                                       (dir.path / "data").string()));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto path = dir.path / "data" / "tokenizer.json";
  const auto tok = text::Tokenizer::from_file(path);
  REQUIRE(tok.id_of("<|doc|>").has_value());
  CHECK(tok.end_of_text() == tok.id_of("<|doc|>"));
  CHECK(text::inspect_tokenizer_file(path).end_of_text == "<|doc|>");
  fs::create_directories(dir.path / "out");
  text::write_hf_tokenizer(dir.path / "out", path, 64);
  Json config;
  std::ifstream(dir.path / "out" / "tokenizer_config.json") >> config;
  CHECK(config["eos_token"] == "<|doc|>");
  CHECK(text::Tokenizer::from_file(dir.path / "out" / "tokenizer.json").end_of_text() == tok.id_of("<|doc|>"));
}

TEST_CASE("tokenizer: unsupported kinds exit 2, broken files exit 3, vocabularies must match", "[tokenizer]") {
  test::TempDir dir("tokbad");
  const auto good = make_tokenizer(dir.path, "gpt2", 300);
  Json j;
  std::ifstream(good) >> j;
  auto code_of = [&](const Json& variant) {
    const auto p = dir.path / "variant.json";
    write(p, variant.dump());
    try {
      text::Tokenizer::from_file(p);
    } catch (const text::TokenizerError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(p.string()) != std::string::npos);
      return e.code;
    }
    return 0;
  };
  CHECK(code_of(j) == 0);
  Json metaspace = j;  // SentencePiece style (LLaMA 2)
  metaspace["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}};
  CHECK(code_of(metaspace) == kExitConfig);
  Json fallback = j;
  fallback["model"]["byte_fallback"] = true;
  CHECK(code_of(fallback) == kExitConfig);
  Json wordpiece = j;
  wordpiece["model"]["type"] = "WordPiece";
  CHECK(code_of(wordpiece) == kExitConfig);
  Json no_model = j;
  no_model.erase("model");
  CHECK(code_of(no_model) == kExitData);
  write(dir.path / "broken.json", "{\"model\": ");
  CHECK_THROWS_AS(text::Tokenizer::from_file(dir.path / "broken.json"), text::TokenizerError);
  CHECK_THROWS_AS(text::Tokenizer::from_file(dir.path / "missing.json"), text::TokenizerError);

  const auto info = text::inspect_tokenizer_file(good);
  CHECK(info.vocab_size == text::Tokenizer::from_file(good).vocab_size());
  CHECK(info.end_of_text == "<|endoftext|>");
  CHECK_NOTHROW(text::check_vocab_match(50257, 50257, "t"));
  CHECK_NOTHROW(text::check_vocab_match(50257, 50304, "t"));  // llm.c's padding to a multiple of 128
  CHECK_NOTHROW(text::check_vocab_match(300, 320, "t"));      // ... and of 64
  try {
    text::check_vocab_match(300, 512, "t.json");
    FAIL("a larger vocabulary than padding was accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("300") != std::string::npos);
    CHECK(std::string(e.what()).find("512") != std::string::npos);
  }
  CHECK_THROWS_AS(text::check_vocab_match(300, 299, "t"), ConfigError);
}

TEST_CASE("sample: greedy generation is transformers' generate, GPT-2 and LLaMA, with and without the cache", "[sample]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    INFO(arch);
    test::TempDir dir("sample_" + arch);
    const auto [tokenizer, data, vocab] = tokenized_corpus(dir.path, "gpt2");
    const fs::path run = dir.path / "run";
    train_ok(fmt::format("--config configs/tiny.yaml {} {} {} --set logging.dir={}", data_sets(data, vocab),
                         arch == "llama" ? kLlamaSets : kGpt2Sets, kShortRun, run.string()));
    // The run recorded the tokenizer it found beside data.path, and its final weights carry it.
    CHECK(test::read_text(run / "tokenizer.json") == test::read_text(tokenizer));
    CHECK(test::read_text(run / "model" / "tokenizer.json") == test::read_text(tokenizer));
    const fs::path exported = dir.path / "export";
    REQUIRE(test::run(fmt::format("{} export --run {} --out {}", test::kTrainer, run.string(), exported.string())).code == 0);
    CHECK(test::read_text(exported / "tokenizer.json") == test::read_text(tokenizer));

    const std::string prompt = "The old man saw";
    const std::string ask = fmt::format("--prompt '{}' --temperature 0 --max-new-tokens 48 --ignore-eot --json", prompt);
    const Json ours = json_of(test::run(fmt::format("{} sample --weights {} {}", test::kTrainer, exported.string(), ask)));
    const auto ids = ours["ids"].get<std::vector<int64_t>>();
    REQUIRE(ids.size() == 48);
    CHECK(ours["prompt_ids"].get<std::vector<int64_t>>() == text::Tokenizer::from_file(tokenizer).encode(prompt));
    const Json theirs = json_of(reference(fmt::format("generate {} '{}' 48", exported.string(), ours["prompt_ids"].dump())));
    CHECK(theirs["vocab"].get<int64_t>() == vocab);  // AutoTokenizer loaded the exported folder
    CHECK(ids == theirs["ids"].get<std::vector<int64_t>>());
    CHECK(ours["text"].get<std::string>() == theirs["decoded"].get<std::string>());
    // The same weights through --run (the final weights) and without the cache: the same tokens.
    const Json from_run = json_of(test::run(fmt::format("{} sample --run {} {}", test::kTrainer, run.string(), ask)));
    CHECK(from_run["ids"] == ours["ids"]);
    const Json uncached = json_of(test::run(fmt::format("{} sample --run {} {} --no-cache", test::kTrainer, run.string(), ask)));
    CHECK(uncached["ids"] == ours["ids"]);
    CHECK(uncached["kv_cache"] == false);
  }
}

TEST_CASE("sample: seeded sampling repeats; top-k 1 is greedy; bad requests exit 2", "[sample]") {
  test::TempDir dir("sample_seed");
  const auto [tokenizer, data, vocab] = tokenized_corpus(dir.path, "llama3");
  const fs::path run = dir.path / "run";
  train_ok(fmt::format("--config configs/tiny.yaml {} {} {} --set train.steps=10 --set logging.dir={}",
                       data_sets(data, vocab), kGpt2Sets, kShortRun, run.string()));
  auto sample = [&](const std::string& args) {
    return json_of(test::run(fmt::format("{} sample --run {} --max-new-tokens 40 --ignore-eot --json {}", test::kTrainer,
                                         run.string(), args)))["ids"];
  };
  const Json a = sample("--seed 7 --top-k 50"), b = sample("--seed 7 --top-k 50"), c = sample("--seed 8 --top-k 50");
  CHECK(a == b);
  CHECK(a != c);
  CHECK(sample("--seed 7 --top-k 1") == sample("--temperature 0"));
  CHECK(sample("--seed 7 --top-k 1 --no-cache") == sample("--temperature 0"));

  // A prompt of 100 tokens + 40 new ones do not fit the context of 128.
  auto r = test::run(fmt::format("{} sample --run {} --prompt \"$(printf 'the %.0s' $(seq 100))\" --max-new-tokens 40",
                            test::kTrainer, run.string()));
  CHECK(r.code == kExitConfig);
  CHECK(r.output.find("model.max_seq_len") != std::string::npos);
  r = test::run(fmt::format("{} sample --run {} --weights {}", test::kTrainer, run.string(), (run / "model").string()));
  CHECK(r.code == kExitConfig);
  fs::create_directories(dir.path / "other");
  const auto other = make_tokenizer(dir.path / "other", "gpt2", 300);
  r = test::run(fmt::format("{} sample --run {} --tokenizer {}", test::kTrainer, run.string(), other.string()));
  CHECK(r.code == kExitConfig);
  CHECK(r.output.find(std::to_string(vocab)) != std::string::npos);
  r = test::run(fmt::format("{} sample --run {}", test::kTrainer, (dir.path / "nowhere").string()));
  CHECK(r.code == kExitConfig);
  r = test::run(fmt::format("{} sample --run {} --prompt \"$(printf 'ab\\377c')\" --json", test::kTrainer, run.string()));
  CHECK(r.code == kExitConfig);
  CHECK(r.output.find("UTF-8") != std::string::npos);
}

TEST_CASE("train: the data's tokenizer must match model.vocab_size (exit 2 naming both)", "[train]") {
  test::TempDir dir("vocab");
  const auto [tokenizer, data, vocab] = tokenized_corpus(dir.path, "gpt2");
  const fs::path run = dir.path / "run";
  const auto r = test::trainer(fmt::format("--config configs/tiny.yaml {} --set logging.dir={}", data_sets(data, 1024),
                                           run.string()));
  CHECK(r.code == kExitConfig);
  CHECK(r.output.find(std::to_string(vocab)) != std::string::npos);
  CHECK(r.output.find("1024") != std::string::npos);
  CHECK_FALSE(fs::exists(run));
  // A model smaller than the tokenizer: named as the vocabulary mismatch it is, not as a token out of range.
  const auto smaller = test::trainer(fmt::format("--config configs/tiny.yaml {} --set logging.dir={}", data_sets(data, 300),
                                                 run.string()));
  CHECK(smaller.code == kExitConfig);
  CHECK(smaller.output.find(std::to_string(vocab)) != std::string::npos);
  CHECK(smaller.output.find("300") != std::string::npos);
  CHECK_FALSE(fs::exists(run));
  // A training-time prompt that is not UTF-8: exit 2 before anything is made.
  const auto bad_prompt = test::trainer(fmt::format("--config configs/tiny.yaml {} --set train.sample_interval=5 "
                                                    "--set \"train.sample_prompt=$(printf 'ab\\377c')\" --set logging.dir={}",
                                                    data_sets(data, vocab), run.string()));
  CHECK(bad_prompt.code == kExitConfig);
  CHECK(bad_prompt.output.find("train.sample_prompt") != std::string::npos);
  CHECK_FALSE(fs::exists(run));
  // data.tokenizer naming a file that is not there: exit 3.
  const auto missing = test::trainer(fmt::format("--config configs/tiny.yaml {} --set data.tokenizer={} --set logging.dir={}",
                                                 data_sets(data, vocab), (dir.path / "none.json").string(), run.string()));
  CHECK(missing.code == kExitData);
}

TEST_CASE("train: train.sample_interval logs greedy samples; under zero3 at world 2 both ranks run them and finish", "[train]") {
  test::TempDir dir("train_sample");
  const auto [tokenizer, data, vocab] = tokenized_corpus(dir.path, "gpt2");
  const auto tok = text::Tokenizer::from_file(tokenizer);
  const fs::path run = dir.path / "run";
  const auto m = test::launch(2, fmt::format("--config configs/tiny.yaml {} {} {} --set train.steps=6 "
                                             "--set train.sample_interval=3 --set train.sample_tokens=12 "
                                             "--set \"train.sample_prompt=The old man\" --set parallel.sharding=zero3 "
                                             "--set logging.dir={}", data_sets(data, vocab), kGpt2Sets,
                                             kShortRun, run.string()));
  for (int rank = 0; rank < 2; ++rank) {
    INFO(m.outputs[static_cast<size_t>(rank)]);
    REQUIRE(m.codes[static_cast<size_t>(rank)] == 0);
  }
  const auto samples = test::events(run / "metrics.jsonl", "sample");
  REQUIRE(samples.size() == 2);
  CHECK(samples[0]["step"] == 3);
  CHECK(samples[1]["step"] == 6);
  for (const auto& s : samples) {
    const auto ids = s["ids"].get<std::vector<int64_t>>();
    CHECK(ids.size() == 12);
    CHECK(s["text"].get<std::string>() == tok.decode(ids));
    CHECK(m.outputs[0].find("sample: The old man" + s["text"].get<std::string>().substr(0, 8)) != std::string::npos);
  }
}

TEST_CASE("eval: every eval scores the same windows, so the same weights give the same loss", "[eval]") {
  config::ModelConfig mc;
  mc.n_layer = 1;
  mc.n_embd = 32;
  mc.n_head = 2;
  mc.vocab_size = 64;
  mc.max_seq_len = 16;
  torch::manual_seed(0);
  model::GPT model(mc, torch::kCPU);
  std::shared_ptr<data::TokenSource> source = data::make_synthetic(4096, 64, 3);
  data::Loader loader(source, 4, 16, /*seed=*/11);
  const double first = train::evaluate(model, loader, 3, torch::kCPU);
  loader.next();  // the loader moved on (as training's would not, but an eval's own draws do)
  const double second = train::evaluate(model, loader, 3, torch::kCPU);
  CHECK(first == second);
  data::Loader other(source, 4, 16, /*seed=*/12);  // other windows, another loss: the check above can fail
  CHECK(train::evaluate(model, other, 3, torch::kCPU) != first);
}

}  // namespace SUBLINEAR_TEST_FILE
