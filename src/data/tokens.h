// Token sources: llm.c shards (header + uint16/uint32 tokens) and headerless token files (nanoGPT's
// prepare.py output), both memory-mapped; UTF-8 text as bytes; synthetic tokens. Every bad input throws
// DataError naming the file and the problem.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sl::data {

// llm.c shard header: 256 int32 words (magic, version, token count, ...), then the tokens: uint16
// (version 1) or uint32 (version 2).
inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderWords = 256;

// A read-only sequence of token ids (each < the vocab size it was checked against).
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t size() const = 0;
  // Copies tokens [begin, begin + n) into out as int64.
  virtual void read(int64_t begin, int64_t n, int64_t* out) const = 0;
  virtual std::string describe() const = 0;  // e.g. "data/x.bin (llm.c, 123456 tokens)"
};

// Opens an llm.c shard (mmap), checking magic, version, size and that every token is < vocab_size.
// A file without the magic gets a message saying what it probably is and the command that converts it.
std::unique_ptr<TokenSource> open_llmc(const std::string& path, int64_t vocab_size);
// Opens a headerless file of little-endian tokens of `width` bytes (2 or 4; nanoGPT writes uint16),
// checking its size and that every token is < vocab_size. A file with the llm.c magic is refused.
std::unique_ptr<TokenSource> open_raw(const std::string& path, int64_t vocab_size, int width);
// Reads a UTF-8 text file; one token per byte (vocab_size must be >= 256). Warns when the file looks
// binary (NUL bytes or bytes that are not UTF-8 in its first 64 KiB): probably tokens, not text.
std::unique_ptr<TokenSource> open_text(const std::string& path, int64_t vocab_size);
// Deterministic tokens with learnable structure (repeated motifs), n tokens, ids < vocab_size.
std::unique_ptr<TokenSource> make_synthetic(int64_t n, int64_t vocab_size, uint64_t seed);
// A window [begin, begin + n) of another source (used for the val_fraction hold-out).
std::unique_ptr<TokenSource> slice(std::shared_ptr<TokenSource> base, int64_t begin, int64_t n);

// Writes an llm.c shard (header + uint16 tokens, version 1). Throws DataError when a token does not fit.
void write_llmc(const std::string& path, const std::vector<int64_t>& tokens);

// The samplers' generator (splitmix64): the next value of `state`, which it advances.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace sl::data
