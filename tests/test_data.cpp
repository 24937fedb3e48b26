// Data: .bin shards (good and each bad case), text and synthetic sources, splits, batch sampling,
// and the trainer's exit code 3 for bad data.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include <torch/torch.h>

#include "config/config.h"
#include "data/loader.h"
#include "errors.h"
#include "test_util.h"

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

TEST_CASE("bin shard round trip") {
  test::TempDir dir("bin");
  std::vector<int64_t> tokens = {0, 1, 65535, 42, 7};
  auto path = (dir.path / "a.bin").string();
  data::write_bin(path, tokens);
  CHECK(std::filesystem::file_size(path) == 1024 + 2 * tokens.size());
  auto src = data::open_bin(path, 65536);
  REQUIRE(src->size() == 5);
  std::vector<int64_t> out(5);
  src->read(0, 5, out.data());
  CHECK(out == tokens);
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST_CASE("the shipped corpus is a valid shard") {
  auto src = data::open_bin(test::kSourceDir + "/data/corpus_train.bin", 256);
  CHECK(src->size() > 100000);
  auto val = data::open_bin(test::kSourceDir + "/data/corpus_val.bin", 256);
  CHECK(val->size() > 1000);
}

TEST_CASE("bad shards throw DataError naming the file and the problem") {
  test::TempDir dir("badbin");
  const std::vector<uint16_t> ok(100, 3);
  SECTION("wrong magic") {
    auto p = write_raw(dir, "m.bin", 12345, 1, 100, ok);
    auto msg = data_error([&] { data::open_bin(p, 256); });
    CHECK(msg.find(p) != std::string::npos);
    CHECK(msg.find("wrong magic number 12345") != std::string::npos);
  }
  SECTION("wrong version") {
    auto p = write_raw(dir, "v.bin", data::kShardMagic, 2, 100, ok);
    CHECK(data_error([&] { data::open_bin(p, 256); }).find("unsupported shard version 2") != std::string::npos);
  }
  SECTION("truncated payload") {
    auto p = write_raw(dir, "t.bin", data::kShardMagic, 1, 200, ok);
    auto msg = data_error([&] { data::open_bin(p, 256); });
    CHECK(msg.find("truncated") != std::string::npos);
    CHECK(msg.find("200 tokens") != std::string::npos);
  }
  SECTION("truncated header") {
    auto p = dir.file("h.bin", "short");
    CHECK(data_error([&] { data::open_bin(p, 256); }).find("shorter than the 1024-byte shard header") != std::string::npos);
  }
  SECTION("trailing bytes") {
    auto p = write_raw(dir, "x.bin", data::kShardMagic, 1, 50, ok);
    CHECK(data_error([&] { data::open_bin(p, 256); }).find("trailing bytes") != std::string::npos);
  }
  SECTION("token >= vocab") {
    std::vector<uint16_t> bad = ok;
    bad[17] = 300;
    auto p = write_raw(dir, "big.bin", data::kShardMagic, 1, 100, bad);
    auto msg = data_error([&] { data::open_bin(p, 256); });
    CHECK(msg.find("token 300 at position 17") != std::string::npos);
    CHECK(msg.find("model.vocab_size = 256") != std::string::npos);
  }
  SECTION("missing file") {
    auto p = (dir.path / "nope.bin").string();
    auto msg = data_error([&] { data::open_bin(p, 256); });
    CHECK(msg.find(p) != std::string::npos);
    CHECK(msg.find("cannot open") != std::string::npos);
  }
  SECTION("corpus shorter than one sequence") {
    auto p = write_raw(dir, "s.bin", data::kShardMagic, 1, 100, ok);
    auto cfg = config::load_string("", {"data.path=" + p, "data.val_path=" + p, "train.seq_len=128"});
    auto msg = data_error([&] { data::open_splits(cfg); });
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
  data::Loader r0(src, 4, 32, 5, 0, 2), r1(src, 4, 32, 5, 1, 2), whole(src, 8, 32, 5);
  auto x0 = r0.next().x, x1 = r1.next().x, xw = whole.next().x;
  CHECK(torch::equal(torch::cat({x0, x1}), xw));
}

TEST_CASE("val_path empty holds out the tail of the training file") {
  auto cfg = config::load_string("", {"data.path=" + test::kSourceDir + "/data/corpus_train.bin", "data.val_path=",
                                      "data.val_fraction=0.25"});
  auto s = data::open_splits(cfg);
  const auto total = data::open_bin(cfg.data.path, 256)->size();
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
