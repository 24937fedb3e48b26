// Data: llm.c shards (good and each bad case, uint16 and uint32), headerless token files (nanoGPT's,
// written by numpy as its prepare.py does), text (and its looks-binary warning) and synthetic sources,
// splits, batch sampling, and the trainer's exit code 3 for bad data.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "catch.h"
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "layout/mesh.h"
#include "errors.h"
#include "examples_data.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;

namespace {
// Writes a shard with an arbitrary header and token payload, for the bad cases.
std::string write_raw(const test::TempDir& dir, const std::string& name, int32_t magic, int32_t version,
                      int32_t count, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(data::kShardHeaderWords, 0);
  header[0] = magic, header[1] = version, header[2] = count;
  auto p = (dir.path / name).string();
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return p;
}

std::string data_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "<no DataError>";
}
}  // namespace

TEST_CASE("llm.c shard round trip") {
  test::TempDir dir("bin");
  std::vector<int64_t> tokens = {0, 1, 65535, 42, 7};
  auto path = (dir.path / "a.bin").string();
  data::write_llmc(path, tokens);
  CHECK(std::filesystem::file_size(path) == 1024 + 2 * tokens.size());
  auto src = data::open_llmc(path, 65536);
  REQUIRE(src->size() == 5);
  std::vector<int64_t> out(5);
  src->read(0, 5, out.data());
  CHECK(out == tokens);
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST_CASE("the shipped corpus is a valid shard") {
  auto src = data::open_llmc(test::kSourceDir + "/data/corpus_train.bin", 256);
  CHECK(src->size() > 100000);
  auto val = data::open_llmc(test::kSourceDir + "/data/corpus_val.bin", 256);
  CHECK(val->size() > 1000);
}

TEST_CASE("bad shards throw DataError naming the file and the problem") {
  test::TempDir dir("badbin");
  const std::vector<uint16_t> ok(100, 3);
  SECTION("wrong magic") {
    auto p = write_raw(dir, "m.bin", 12345, 1, 100, ok);
    auto msg = data_error([&] { data::open_llmc(p, 256); });
    CHECK(msg.find(p) != std::string::npos);
    CHECK(msg.find("no llm.c shard header (first int32 word 12345") != std::string::npos);
    // It says what to run, with this file's path.
    CHECK(msg.find("data.source: raw") != std::string::npos);
    CHECK(msg.find("python3 scripts/tokens.py to-llmc " + p + " ") != std::string::npos);
  }
  SECTION("wrong version") {
    auto p = write_raw(dir, "v.bin", data::kShardMagic, 3, 100, ok);
    CHECK(data_error([&] { data::open_llmc(p, 256); }).find("unsupported llm.c shard version 3") != std::string::npos);
  }
  SECTION("truncated payload") {
    auto p = write_raw(dir, "t.bin", data::kShardMagic, 1, 200, ok);
    auto msg = data_error([&] { data::open_llmc(p, 256); });
    CHECK(msg.find("truncated") != std::string::npos);
    CHECK(msg.find("200 tokens") != std::string::npos);
  }
  SECTION("truncated header") {
    auto p = write_raw(dir, "h.bin", data::kShardMagic, 1, 0, {});
    std::filesystem::resize_file(p, 100);  // the magic, then the header stops
    CHECK(data_error([&] { data::open_llmc(p, 256); }).find("shorter than the 1024-byte llm.c shard header") != std::string::npos);
  }
  SECTION("trailing bytes") {
    auto p = write_raw(dir, "x.bin", data::kShardMagic, 1, 50, ok);
    CHECK(data_error([&] { data::open_llmc(p, 256); }).find("trailing bytes") != std::string::npos);
  }
  SECTION("token >= vocab") {
    std::vector<uint16_t> bad = ok;
    bad[17] = 300;
    auto p = write_raw(dir, "big.bin", data::kShardMagic, 1, 100, bad);
    auto msg = data_error([&] { data::open_llmc(p, 256); });
    CHECK(msg.find("token 300 at position 17") != std::string::npos);
    CHECK(msg.find("model.vocab_size = 256") != std::string::npos);
  }
  SECTION("missing file") {
    auto p = (dir.path / "nope.bin").string();
    auto msg = data_error([&] { data::open_llmc(p, 256); });
    CHECK(msg.find(p) != std::string::npos);
    CHECK(msg.find("cannot open") != std::string::npos);
  }
  SECTION("corpus shorter than one sequence") {
    auto p = write_raw(dir, "s.bin", data::kShardMagic, 1, 100, ok);
    auto cfg = config::load_string("", {"data.path=" + p, "data.val_path=" + p, "train.seq_len=128"});
    auto msg = data_error([&] { data::open_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed); });
    CHECK(msg.find("only 100 tokens, fewer than one sequence") != std::string::npos);
  }
}

TEST_CASE("text source: one token per byte") {
  test::TempDir dir("text");
  auto p = dir.file("a.txt", "h\xc3\xa9llo");
  auto src = data::open_text(p, 256);
  REQUIRE(src->size() == 6);
  std::vector<int64_t> out(6);
  src->read(0, 6, out.data());
  CHECK(out == std::vector<int64_t>{'h', 0xc3, 0xa9, 'l', 'l', 'o'});
}

TEST_CASE("synthetic source is deterministic, in range and repetitive") {
  auto a = data::make_synthetic(5000, 100, 7), b = data::make_synthetic(5000, 100, 7);
  std::vector<int64_t> x(5000), y(5000);
  a->read(0, 5000, x.data());
  b->read(0, 5000, y.data());
  CHECK(x == y);
  for (auto t : x) REQUIRE((t >= 0 && t < 100));
}

TEST_CASE("loader: targets are inputs shifted by one, deterministic per seed, disjoint per rank") {
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(10000, 256, 1);
  data::Loader a(src, 4, 32, 99), b(src, 4, 32, 99);
  auto ba = a.next(), bb = b.next();
  CHECK(ba.x.sizes() == torch::IntArrayRef({4, 32}));
  CHECK(torch::equal(ba.x, bb.x));
  CHECK(torch::equal(ba.x.narrow(1, 1, 31), ba.y.narrow(1, 0, 31)));
  // Two ranks draw the same global offsets and keep different rows: together they equal world=1 with 2B.
  data::Loader r0(src, 4, 32, 5, layout::Mesh(2, 0, {})), r1(src, 4, 32, 5, layout::Mesh(2, 1, {})), whole(src, 8, 32, 5);
  auto x0 = r0.next().x, x1 = r1.next().x, xw = whole.next().x;
  CHECK(torch::equal(torch::cat({x0, x1}), xw));
}

TEST_CASE("loader: a mesh's sequence ranks hold consecutive pieces of their data rank's windows") {
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(10000, 256, 1);
  // 4 ranks at sequence degree 2: data ranks 0 (ranks 0, 1) and 1 (ranks 2, 3), each window in two halves.
  std::vector<data::Batch> b;
  for (int64_t r = 0; r < 4; ++r) b.push_back(data::Loader(src, 3, 32, 7, layout::Mesh(4, r, {.sequence = 2})).next());
  for (const auto& piece : b) CHECK(piece.x.sizes() == torch::IntArrayRef({3, 16}));
  // The data ranks' rows, each row's halves side by side, are one process's 2 x 3 windows of 32.
  const auto whole = data::Loader(src, 6, 32, 7).next();
  CHECK(torch::equal(torch::cat({torch::cat({b[0].x, b[1].x}, 1), torch::cat({b[2].x, b[3].x}, 1)}), whole.x));
  CHECK(torch::equal(torch::cat({torch::cat({b[0].y, b[1].y}, 1), torch::cat({b[2].y, b[3].y}, 1)}), whole.y));
}

namespace {
std::vector<int64_t> row(const torch::Tensor& t, int64_t r) {
  const auto c = t[r].contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}
}  // namespace

TEST_CASE("examples: one example a row, targets masked and padded with -100, each example once an epoch") {
  test::TempDir dir("examples");
  const auto ex = test::varied_examples(5, 17, 256);  // lengths 3, 3, 7, 12, 17
  const auto src = data::ExampleSource::open(test::write_examples(dir.path, "train", ex), 256, 16);
  REQUIRE(src->count() == 5);
  CHECK(src->describe().find("examples 0..5 of 5") != std::string::npos);
  // Example k alone: inputs its tokens but the last, then 0; targets its tokens but the first where trained.
  for (int64_t k = 0; k < 5; ++k) {
    std::vector<int64_t> x(16), y(16);
    const auto& e = ex[static_cast<size_t>(k)];
    const int64_t L = static_cast<int64_t>(e.tokens.size()), trained = src->fill_row(k, 16, x.data(), y.data());
    CHECK(trained == L - static_cast<int64_t>(e.prompt));
    for (int64_t j = 0; j < 16; ++j) {
      INFO("example " << k << " position " << j);
      CHECK(x[j] == (j < L - 1 ? e.tokens[j] : 0));
      const bool target = j + 1 < L && j + 1 >= static_cast<int64_t>(e.prompt);
      CHECK(y[j] == (target ? e.tokens[j + 1] : data::kIgnoreTarget));
    }
  }
  // Batches of 2 over 3 epochs (15 rows): each epoch holds every example once, in its own order.
  data::Loader loader(src, 2, 16, 3);
  std::vector<std::vector<int64_t>> rows;
  for (int i = 0; i < 8; ++i) {
    const auto b = loader.next();
    int64_t trained = 0;
    for (int64_t r = 0; r < 2; ++r) {
      rows.push_back(row(b.x, r));
      trained += (b.y[r] != data::kIgnoreTarget).sum().item<int64_t>();
    }
    CHECK(b.trained_everywhere == trained);
    CHECK(b.masked());
  }
  const auto lengths_in_epoch = [&](size_t from) {
    std::multiset<int64_t> lengths;
    for (size_t i = from; i < from + 5; ++i) lengths.insert(16 - std::count(rows[i].begin() + 1, rows[i].end(), 0));
    return lengths;
  };
  CHECK(lengths_in_epoch(0) == lengths_in_epoch(5));
  CHECK(lengths_in_epoch(5) == lengths_in_epoch(10));
  CHECK(rows.front() != rows[5]);  // the order is reshuffled (the seed's epochs 0 and 1 start elsewhere)
  // A restored position goes on where it was; rewind starts over.
  data::Loader again(src, 2, 16, 3);
  again.restore(6);
  CHECK(torch::equal(again.next().x, [&] { data::Loader l(src, 2, 16, 3); for (int i = 0; i < 3; ++i) l.next(); return l.next().x; }()));
  loader.rewind();
  CHECK(row(loader.next().x, 0) == rows[0]);
}

TEST_CASE("examples: data ranks take consecutive rows, sequence ranks their pieces, every rank the mesh's count") {
  test::TempDir dir("examples-mesh");
  const auto src = data::ExampleSource::open(test::write_examples(dir.path, "train", test::varied_examples(7, 33, 256)),
                                             256, 32);
  const auto whole = data::Loader(src, 6, 32, 9).next();
  std::vector<data::Batch> b;
  for (int64_t r = 0; r < 4; ++r) b.push_back(data::Loader(src, 3, 32, 9, layout::Mesh(4, r, {.sequence = 2})).next());
  for (const auto& piece : b) {
    CHECK(piece.x.sizes() == torch::IntArrayRef({3, 16}));
    CHECK(piece.trained_everywhere == whole.trained_everywhere);
  }
  CHECK(torch::equal(torch::cat({torch::cat({b[0].x, b[1].x}, 1), torch::cat({b[2].x, b[3].x}, 1)}), whole.x));
  CHECK(torch::equal(torch::cat({torch::cat({b[0].y, b[1].y}, 1), torch::cat({b[2].y, b[3].y}, 1)}), whole.y));
}

TEST_CASE("bad examples data throws DataError naming the file, the example and what to run") {
  test::TempDir dir("badexamples");
  const auto shard = test::write_examples(dir.path, "d", test::varied_examples(3, 9, 256));  // lengths 3, 4, 9
  const auto open = [&](int64_t seq_len = 8) { return data_error([&] { data::ExampleSource::open(shard, 256, seq_len); }); };
  CHECK(open() == "<no DataError>");
  // Too long for the recipe's seq_len: names the example and prepare_chat's --seq-len.
  CHECK(open(7).find("example 2 (tokens 7..16) has 9 tokens, more than train.seq_len + 1 = 8") != std::string::npos);
  CHECK(open(7).find("--seq-len 7") != std::string::npos);
  const auto mask = dir.path / "d.mask.bin", offsets = dir.path / "d.examples.bin";
  std::vector<uint8_t> m(16, 0);
  m[2] = 1, m[5] = 1, m[10] = 1;
  const auto with_mask = [&](const std::vector<uint8_t>& bytes) {
    test::write_bytes(mask, bytes.data(), bytes.size());
    return open();
  };
  CHECK(with_mask(m) == "<no DataError>");
  CHECK(with_mask(std::vector<uint8_t>(15, 0)).find("15 bytes for the 16 tokens") != std::string::npos);
  auto two = m;
  two[3] = 2;
  CHECK(with_mask(two).find("byte 2 at token 3 is neither 0") != std::string::npos);
  auto first = m;
  first[3] = 1;  // example 1 starts at token 3
  CHECK(with_mask(first).find("example 1 (tokens 3..7): its first token is marked trained") != std::string::npos);
  auto none = m;
  none[5] = 0;
  CHECK(with_mask(none).find("example 1 (tokens 3..7) has no trained token") != std::string::npos);
  with_mask(m);
  const auto with_offsets = [&](const std::vector<uint64_t>& o) {
    test::write_bytes(offsets, o.data(), o.size() * 8);
    return open();
  };
  CHECK(with_offsets({0, 3, 7, 15}).find("not from 0 to the 16 tokens") != std::string::npos);
  CHECK(with_offsets({0, 3, 3, 16}).find("example 1 is empty") != std::string::npos);
  CHECK(with_offsets({0, 1, 7, 16}).find("example 0 (tokens 0..1) has one token") != std::string::npos);
  CHECK(with_offsets({0}).find("two or more little-endian uint64 offsets") != std::string::npos);
  std::filesystem::remove(offsets);
  const auto missing = open();
  CHECK(missing.find("no example offsets " + offsets.string()) != std::string::npos);
  CHECK(missing.find("data.source: llmc") != std::string::npos);
  // The trainer: exit 3 naming the file, no run directory.
  const auto run_dir = dir.path / "run";
  const auto r = test::trainer("--config configs/tiny.yaml --set data.source=examples --set data.path=" + shard +
                               " --set data.val_path= --set logging.dir=" + run_dir.string());
  INFO(r.output);
  CHECK(r.code == kExitData);
  CHECK(r.output.find(offsets.string()) != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(run_dir));
}

TEST_CASE("val_path empty holds out the tail of the training file") {
  auto cfg = config::load_string("", {"data.path=" + test::kSourceDir + "/data/corpus_train.bin", "data.val_path=",
                                      "data.val_fraction=0.25"});
  auto s = data::open_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed);
  const auto total = data::open_llmc(cfg.data.path, 256)->size();
  CHECK(s.val->size() == static_cast<int64_t>(total * 0.25));
  CHECK(s.train->size() + s.val->size() == total);
}

TEST_CASE("trainer exits 3 on bad data and leaves no run directory") {
  test::TempDir dir("e2edata");
  const auto run_dir = (dir.path / "run").string();
  auto bad = write_raw(dir, "bad.bin", 1, 1, 0, {});
  for (const std::string& path : {bad, (dir.path / "missing.bin").string()}) {
    auto r = test::trainer("--config configs/tiny.yaml --set data.path=" + path + " --set logging.dir=" + run_dir);
    INFO(r.output);
    CHECK(r.code == kExitData);
    CHECK(r.output.find(path) != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(run_dir));
  }
}

namespace {
// Writes `tokens` as a headerless little-endian file the way nanoGPT's prepare.py does:
// np.array(tokens, dtype=np.uint16 | np.uint32).tofile(path), with the venv's numpy.
std::string numpy_tofile(const test::TempDir& dir, const std::string& name, const std::vector<int64_t>& tokens,
                         const std::string& dtype) {
  std::string list;
  for (auto t : tokens) list += std::to_string(t) + ",";
  const auto p = (dir.path / name).string();
  const auto r = test::run(test::kPython + " -c \"import numpy as np; np.array([" + list + "], dtype=np." + dtype +
                           ").tofile('" + p + "')\"");
  INFO(r.output);
  REQUIRE(r.code == 0);
  return p;
}

std::vector<int64_t> read_all(const data::TokenSource& src) {
  std::vector<int64_t> out(static_cast<size_t>(src.size()));
  src.read(0, src.size(), out.data());
  return out;
}

// Runs f with spdlog's default logger writing into a string; returns what was logged.
std::string captured_log(const std::function<void()>& f) {
  std::ostringstream text;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(text)));
  f();
  spdlog::set_default_logger(previous);
  return text.str();
}
}  // namespace

TEST_CASE("headerless token files (nanoGPT's prepare.py output) read as data.source: raw") {
  test::TempDir dir("raw");
  const std::vector<int64_t> tokens = {0, 1, 50256, 42, 7, 65535};
  auto u16 = data::open_raw(numpy_tofile(dir, "train.bin", tokens, "uint16"), 65536, 2);
  CHECK(read_all(*u16) == tokens);
  const std::vector<int64_t> wide = {0, 128255, 70000, 3};  // a LLaMA-3-sized vocabulary needs uint32
  auto u32 = data::open_raw(numpy_tofile(dir, "wide.bin", wide, "uint32"), 128256, 4);
  CHECK(read_all(*u32) == wide);
  CHECK(u32->describe().find("raw uint32, 4 tokens") != std::string::npos);

  SECTION("a token >= vocab is named with its position") {
    auto p = numpy_tofile(dir, "big.bin", {5, 6, 300, 7}, "uint16");
    const auto msg = data_error([&] { data::open_raw(p, 256, 2); });
    CHECK(msg.find("token 300 at position 2") != std::string::npos);
  }
  SECTION("a size that is not whole tokens") {
    auto p = dir.file("odd.bin", "abc");
    CHECK(data_error([&] { data::open_raw(p, 256, 2); }).find("3 bytes is not a whole number of 2-byte tokens") !=
          std::string::npos);
  }
  SECTION("an llm.c shard given as raw") {
    auto p = (dir.path / "shard.bin").string();
    data::write_llmc(p, {1, 2, 3});
    CHECK(data_error([&] { data::open_raw(p, 256, 2); }).find("use data.source: llmc") != std::string::npos);
  }
}

TEST_CASE("llm.c version 2 shards hold uint32 tokens") {
  test::TempDir dir("llmc2");
  std::vector<int32_t> header(data::kShardHeaderWords, 0);
  header[0] = data::kShardMagic, header[1] = 2, header[2] = 3;
  const std::vector<uint32_t> tokens = {100000, 5, 128000};
  const auto p = (dir.path / "v2.bin").string();
  {
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4);
  }
  auto src = data::open_llmc(p, 128256);
  CHECK(read_all(*src) == std::vector<int64_t>{100000, 5, 128000});
  CHECK(data_error([&] { data::open_llmc(p, 65536); }).find("token 100000 at position 0") != std::string::npos);
}

TEST_CASE("data.source: text warns when the file looks binary") {
  test::TempDir dir("textbin");
  const auto tokens = numpy_tofile(dir, "tokens.bin", {72, 101, 108, 108, 111, 300, 2000}, "uint16");
  const auto warned = captured_log([&] { data::open_text(tokens, 256); });
  CHECK(warned.find(tokens) != std::string::npos);
  CHECK(warned.find("looks binary (5 NUL bytes") != std::string::npos);
  CHECK(warned.find("data.source: raw") != std::string::npos);
  const auto latin1 = dir.file("latin1.txt", "caf\xe9 au lait");
  CHECK(captured_log([&] { data::open_text(latin1, 256); }).find("is not UTF-8") != std::string::npos);
  const auto overlong = dir.file("overlong.txt", "a\xc0\xaf" "b");  // "/" encoded in two bytes
  CHECK(captured_log([&] { data::open_text(overlong, 256); }).find("byte 0xc0 at offset 1 is not UTF-8") !=
        std::string::npos);
  const auto cut = dir.file("cut.txt", "ends mid-character \xe4\xb8");
  CHECK(captured_log([&] { data::open_text(cut, 256); }).find("ends inside a 3-byte UTF-8 character") != std::string::npos);
  // Real UTF-8 text, with multi-byte characters: no warning.
  const auto text = dir.file("ok.txt", "Grüße, 世界! plain text\n");
  CHECK(captured_log([&] { data::open_text(text, 256); }).empty());
  // Nor when the 64 KiB window cuts a character that the file goes on to finish.
  std::string long_text(65535, 'x');
  long_text += "世界\n";  // "世" is bytes 65535..65537
  const auto straddle = dir.file("straddle.txt", long_text);
  CHECK(captured_log([&] { data::open_text(straddle, 256); }).empty());
}

TEST_CASE("the trainer trains on nanoGPT's headerless files with data.source: raw") {
  test::TempDir dir("rawtrain");
  std::vector<int64_t> tokens;
  for (int i = 0; i < 4000; ++i) tokens.push_back((i * 7 + i / 13) % 256);
  const auto train = numpy_tofile(dir, "train.bin", tokens, "uint16");
  const auto val = numpy_tofile(dir, "val.bin", std::vector<int64_t>(tokens.begin(), tokens.begin() + 1000), "uint16");
  const auto run_dir = (dir.path / "run").string();
  const std::string base = "--config configs/tiny.yaml --set train.steps=2 --set train.eval_interval=0 --set data.path=" +
                           train + " --set data.val_path=" + val + " --set logging.dir=" + run_dir;
  // As llm.c shards (the default source) they are refused with the command that converts them.
  auto refused = test::trainer(base);
  INFO(refused.output);
  CHECK(refused.code == kExitData);
  CHECK(refused.output.find("scripts/tokens.py to-llmc " + train) != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(run_dir));
  auto r = test::trainer(base + " --set data.source=raw");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("raw uint16, 4000 tokens") != std::string::npos);
}

}  // namespace SUBLINEAR_TEST_FILE
