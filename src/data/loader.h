// Token data: llm.c shards (header + uint16/uint32 tokens) and headerless token files (nanoGPT's
// prepare.py output), both memory-mapped; UTF-8 text as bytes; synthetic tokens;
// train/val splits and seeded, rank-sharded batch sampling. Every bad input throws DataError
// naming the file and the problem.
#pragma once
#include <filesystem>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "config/config.h"
#include "layout/mesh.h"

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

struct Batch {
  at::Tensor x;  // (B, T) int64 inputs
  at::Tensor y;  // (B, T) int64 targets, x shifted by one
};

// Samples (B, T) windows at random offsets from a token source. Deterministic in (seed, the mesh's
// data rank): every data rank draws the same global offsets and keeps its own slice, so batches do not
// overlap across the ranks that draw their own sequences and a run is reproducible for a given mesh.
// With a sequence degree N > 1 each window's positions come in N equal consecutive pieces and the
// loader returns the piece of the mesh's sequence rank, (B, T / N): the tokens and their targets there.
class Loader {
 public:
  Loader(std::shared_ptr<TokenSource> source, int64_t micro_batch, int64_t seq_len, uint64_t seed,
         const layout::Mesh& mesh = {});
  Batch next();
  const TokenSource& source() const { return *source_; }
  // The sampler's position (its RNG state; the same on every rank), for saved training states.
  uint64_t position() const { return state_; }
  void restore(uint64_t position) { state_ = position; }
  // Back to the seed's first batch: the eval loader rewinds before every eval, so each scores the same windows.
  void rewind() { state_ = seed_; }

 private:
  std::shared_ptr<TokenSource> source_;
  int64_t B_, T_;
  layout::Mesh mesh_;
  uint64_t seed_;
  uint64_t state_;  // splitmix64 state
};

struct Splits {
  std::shared_ptr<TokenSource> train;
  std::shared_ptr<TokenSource> val;
};

// Opens the configured data (train + val), checks every file against the model's vocabulary (model.vocab_size)
// and that each split holds at least one sequence of seq_len + 1 tokens (train.seq_len); synthetic data is
// drawn from `seed` (train.seed). Throws DataError.
Splits open_splits(const config::DataConfig& d, int64_t vocab_size, int64_t seq_len, int64_t seed);

// The tokenizer.json the data was made with: data.tokenizer (DataError, exit 3, when it does not exist), else
// tokenizer.json beside data.path for token files (llmc, raw) when there is one, else "".
std::filesystem::path tokenizer_path(const config::DataConfig& d);

}  // namespace sl::data
