// Token sources: mmap'd llm.c shards and headerless token files, byte-level text, synthetic motifs,
// windows of another source; writing an llm.c shard (tokens.h).
#include "data/tokens.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "data/mapped_file.h"
#include "errors.h"

namespace sl::data {
namespace {

class MappedTokens final : public TokenSource {
 public:
  MappedTokens(std::string path, std::shared_ptr<MappedFile> file, size_t offset, int width, int64_t n,
               std::string kind)
      : path_(std::move(path)),
        file_(std::move(file)),
        base_(file_->data() + offset),
        width_(width),
        n_(n),
        kind_(std::move(kind)) {}
  int64_t size() const override { return n_; }
  int64_t at(int64_t i) const {
    if (width_ == 2) {
      uint16_t v;
      std::memcpy(&v, base_ + 2 * i, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, base_ + 4 * i, 4);
    return v;
  }
  void read(int64_t begin, int64_t n, int64_t* out) const override {
    for (int64_t i = 0; i < n; ++i) out[i] = at(begin + i);
  }
  std::string describe() const override { return fmt::format("{} ({}, {} tokens)", path_, kind_, n_); }
  // Throws DataError at the first token >= vocab_size (uint16 tokens are all below 65,536).
  void check_vocab(int64_t vocab_size) const {
    if (width_ == 2 && vocab_size >= 65536) return;
    for (int64_t i = 0; i < n_; ++i)
      if (at(i) >= vocab_size)
        throw DataError(fmt::format("{}: token {} at position {} is >= model.vocab_size = {}; raise "
                                    "model.vocab_size or re-tokenize", path_, at(i), i, vocab_size));
  }

 private:
  std::string path_;
  std::shared_ptr<MappedFile> file_;
  const uint8_t* base_;
  int width_;
  int64_t n_;
  std::string kind_;
};

// The llm.c shard's magic is missing: say what the file probably is and exactly what to run.
std::string no_llmc_header(const std::string& path, int32_t first_word) {
  const std::filesystem::path p(path);
  const std::string converted = (p.parent_path() / (p.stem().string() + ".llmc.bin")).string();
  return fmt::format("{}: no llm.c shard header (first int32 word {}, expected the magic {}). If it holds headerless "
                     "uint16 tokens, as nanoGPT's prepare.py writes them, set data.source: raw (and model.vocab_size), "
                     "or convert it once: python3 scripts/tokens.py to-llmc {} {}. If it is UTF-8 text, use "
                     "data.source: text or python3 scripts/txt_to_bin.py {} {}",
                     path, first_word, kShardMagic, path, converted, path, converted);
}

// The token width an llm.c header's version means: 1 = uint16, 2 = uint32.
int llmc_width(const std::string& path, int32_t version) {
  if (version == 1 || version == 2) return version == 1 ? 2 : 4;
  throw DataError(
      fmt::format("{}: unsupported llm.c shard version {} (1: uint16 tokens, 2: uint32 tokens)", path, version));
}

std::unique_ptr<MappedTokens> map_llmc(const std::string& path) {
  auto file = std::make_shared<MappedFile>(path);
  const size_t header_bytes = kShardHeaderWords * sizeof(int32_t);
  int32_t header[3] = {0, 0, 0};
  std::memcpy(header, file->data(), std::min(sizeof(header), file->size()));
  if (file->size() >= 4 && header[0] != kShardMagic) throw DataError(no_llmc_header(path, header[0]));
  if (file->size() < header_bytes)
    throw DataError(fmt::format("{}: truncated: {} bytes is shorter than the {}-byte llm.c shard header "
                                "(is this a token shard? convert text with scripts/txt_to_bin.py)",
                                path, file->size(), header_bytes));
  const int width = llmc_width(path, header[1]);
  if (header[2] < 0) throw DataError(fmt::format("{}: negative token count {} in the header", path, header[2]));
  const int64_t n = header[2];
  const size_t expected = header_bytes + static_cast<size_t>(n) * static_cast<size_t>(width);
  if (file->size() != expected)
    throw DataError(fmt::format("{}: {} ({} bytes, the header promises {} tokens = {} bytes); re-create the shard",
                                path, file->size() < expected ? "truncated" : "has trailing bytes", file->size(), n,
                                expected));
  return std::make_unique<MappedTokens>(path, std::move(file), header_bytes, width, n,
                                        width == 2 ? "llm.c" : "llm.c uint32");
}

std::unique_ptr<MappedTokens> map_raw(const std::string& path, int width) {
  auto file = std::make_shared<MappedFile>(path);
  int32_t first = 0;
  if (file->size() >= 4) std::memcpy(&first, file->data(), 4);
  if (first == kShardMagic)
    throw DataError(
        fmt::format("{}: this file has an llm.c shard header (magic {}); use data.source: llmc", path, kShardMagic));
  if (file->size() % static_cast<size_t>(width) != 0)
    throw DataError(fmt::format("{}: {} bytes is not a whole number of {}-byte tokens; check data.raw_dtype (uint16 | "
                                "uint32) or whether the file is truncated", path, file->size(), width));
  const auto n = static_cast<int64_t>(file->size() / static_cast<size_t>(width));
  return std::make_unique<MappedTokens>(path, std::move(file), 0, width, n, width == 2 ? "raw uint16" : "raw uint32");
}

class VectorSource final : public TokenSource {
 public:
  VectorSource(std::vector<uint16_t> tokens, std::string what) : tokens_(std::move(tokens)), what_(std::move(what)) {}
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  void read(int64_t begin, int64_t n, int64_t* out) const override {
    for (int64_t i = 0; i < n; ++i) out[i] = tokens_[begin + i];
  }
  std::string describe() const override { return fmt::format("{}, {} tokens)", what_, tokens_.size()); }

 private:
  std::vector<uint16_t> tokens_;
  std::string what_;
};

class SliceSource final : public TokenSource {
 public:
  SliceSource(std::shared_ptr<TokenSource> base, int64_t begin, int64_t n)
      : base_(std::move(base)), begin_(begin), n_(n) {}
  int64_t size() const override { return n_; }
  void read(int64_t begin, int64_t n, int64_t* out) const override { base_->read(begin_ + begin, n, out); }
  std::string describe() const override {
    return fmt::format("{} [tokens {}..{})", base_->describe(), begin_, begin_ + n_);
  }

 private:
  std::shared_ptr<TokenSource> base_;
  int64_t begin_, n_;
};


// The length of the UTF-8 sequence that lead byte c starts; 0 when c cannot start one (a continuation
// byte, an overlong 0xc0/0xc1 or a byte above 0xf4).
size_t utf8_length(uint8_t c) {
  if (c < 0x80) return 1;
  if (c < 0xc2) return 0;
  return c < 0xe0 ? 2 : c < 0xf0 ? 3 : c < 0xf5 ? 4 : 0;
}

// Text that is really tokens or another binary file: NUL bytes, or bytes that are not UTF-8, in its
// first 64 KiB (a multi-byte character cut by the end of the window is fine). "" when it looks like text.
std::string binary_evidence(const uint8_t* p, size_t size) {
  const size_t n = std::min<size_t>(size, 64 << 10);
  const auto nuls = std::count(p, p + n, uint8_t{0});
  if (nuls > 0) return fmt::format("{} NUL bytes in the first {} bytes", nuls, n);
  for (size_t i = 0; i < n;) {
    const size_t len = utf8_length(p[i]);
    if (len == 0) return fmt::format("byte 0x{:02x} at offset {} is not UTF-8", p[i], i);
    if (i + len > n) {
      if (n < size) break;  // cut by the window, not by the end of the file
      return fmt::format("the file ends inside a {}-byte UTF-8 character at offset {}", len, i);
    }
    for (size_t k = 1; k < len; ++k)
      if ((p[i + k] >> 6) != 0x2) return fmt::format("byte 0x{:02x} at offset {} is not UTF-8", p[i + k], i + k);
    i += len;
  }
  return "";
}

}  // namespace

std::unique_ptr<TokenSource> open_llmc(const std::string& path, int64_t vocab_size) {
  auto src = map_llmc(path);
  src->check_vocab(vocab_size);
  return src;
}

std::unique_ptr<TokenSource> open_raw(const std::string& path, int64_t vocab_size, int width) {
  auto src = map_raw(path, width);
  src->check_vocab(vocab_size);
  return src;
}

std::unique_ptr<TokenSource> open_text(const std::string& path, int64_t vocab_size) {
  if (vocab_size < 256)
    throw DataError(
        fmt::format("{}: text data needs model.vocab_size >= 256 (one token per byte), got {}", path, vocab_size));
  MappedFile file(path);
  if (const std::string why = binary_evidence(file.data(), file.size()); !why.empty())
    spdlog::warn("{}: data.source is text but the file looks binary ({}); every byte becomes a token. If it holds "
                 "token ids, use data.source: raw (headerless, as nanoGPT's prepare.py writes) or llmc",
                 path, why);
  std::vector<uint16_t> tokens(file.data(), file.data() + file.size());
  return std::make_unique<VectorSource>(std::move(tokens), fmt::format("{} (text, bytes", path));
}

std::unique_ptr<TokenSource> make_synthetic(int64_t n, int64_t vocab_size, uint64_t seed) {
  // Motifs of 8..23 tokens drawn from a small alphabet, repeated in a random order: the next token
  // is predictable inside a motif, so the loss can fall far below log(vocab).
  uint64_t state = seed;
  const int64_t n_motifs = 64;
  std::vector<std::vector<uint16_t>> motifs(n_motifs);
  const uint64_t alphabet = static_cast<uint64_t>(std::min<int64_t>(vocab_size, 512));
  for (auto& m : motifs) {
    m.resize(8 + splitmix64(state) % 16);
    for (auto& t : m) t = static_cast<uint16_t>(splitmix64(state) % alphabet);
  }
  std::vector<uint16_t> tokens;
  tokens.reserve(static_cast<size_t>(n));
  while (static_cast<int64_t>(tokens.size()) < n) {
    const auto& m = motifs[splitmix64(state) % n_motifs];
    for (auto t : m) {
      if (static_cast<int64_t>(tokens.size()) == n) break;
      tokens.push_back(t);
    }
  }
  return std::make_unique<VectorSource>(std::move(tokens), "synthetic (motifs");
}

std::unique_ptr<TokenSource> slice(std::shared_ptr<TokenSource> base, int64_t begin, int64_t n) {
  return std::make_unique<SliceSource>(std::move(base), begin, n);
}

void write_llmc(const std::string& path, const std::vector<int64_t>& tokens) {
  std::vector<int32_t> header(kShardHeaderWords, 0);
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::vector<uint16_t> body(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > 65535)
      throw DataError(fmt::format("{}: token {} at position {} does not fit in uint16", path, tokens[i], i));
    body[i] = static_cast<uint16_t>(tokens[i]);
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(header.data()),
              static_cast<std::streamsize>(header.size() * sizeof(int32_t)));
    out.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(body.size() * sizeof(uint16_t)));
    if (!out) {
      std::filesystem::remove(tmp);
      throw DataError(fmt::format("{}: write failed (disk full or no permission?)", path));
    }
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace sl::data
