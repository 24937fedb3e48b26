// Data: llm.c shards (good and each bad case, uint16 and uint32), headerless token files (nanoGPT's,
// written by numpy as its prepare.py does), text (and its looks-binary warning) and synthetic sources,
// splits, batch sampling, and the trainer's exit code 3 for bad data.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "catch.h"
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "layout/mesh.h"
#include "errors.h"
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
