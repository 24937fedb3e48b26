// Token data: llm.c/nanoGPT .bin shards (memory-mapped), UTF-8 text as bytes, synthetic tokens;
// train/val splits and seeded, rank-sharded batch sampling. Every bad input throws DataError
// naming the file and the problem.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "config/config.h"

namespace sl::data {

// .bin shard header: 256 int32 words, then uint16 tokens.
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
  virtual std::string describe() const = 0;  // e.g. "data/x.bin (bin, 123456 tokens)"
};

// Opens a .bin shard (mmap), checking magic, version, size and that every token is < vocab_size.
std::unique_ptr<TokenSource> open_bin(const std::string& path, int64_t vocab_size);
// Reads a UTF-8 text file; one token per byte (vocab_size must be >= 256).
std::unique_ptr<TokenSource> open_text(const std::string& path, int64_t vocab_size);
// Deterministic tokens with learnable structure (repeated motifs), n tokens, ids < vocab_size.
std::unique_ptr<TokenSource> make_synthetic(int64_t n, int64_t vocab_size, uint64_t seed);
// A window [begin, begin + n) of another source (used for the val_fraction hold-out).
std::unique_ptr<TokenSource> slice(std::shared_ptr<TokenSource> base, int64_t begin, int64_t n);

// Writes a .bin shard (header + uint16 tokens). Throws DataError when a token does not fit.
void write_bin(const std::string& path, const std::vector<int64_t>& tokens);

struct Batch {
  at::Tensor x;  // (B, T) int64 inputs
  at::Tensor y;  // (B, T) int64 targets, x shifted by one
};

// Samples (B, T) windows at random offsets from a token source. Deterministic in (seed, rank):
// every rank draws the same global offsets and keeps its own slice, so batches do not overlap
// across ranks and a run is reproducible for a given world size.
class Loader {
 public:
  Loader(std::shared_ptr<TokenSource> source, int64_t micro_batch, int64_t seq_len, uint64_t seed,
         int64_t rank = 0, int64_t world_size = 1);
  Batch next();
  const TokenSource& source() const { return *source_; }
  // The sampler's position (its RNG state; the same on every rank), for saved training states.
  uint64_t position() const { return state_; }
  void restore(uint64_t position) { state_ = position; }

 private:
  std::shared_ptr<TokenSource> source_;
  int64_t B_, T_, rank_, world_;
  uint64_t state_;  // splitmix64 state
};

struct Splits {
  std::shared_ptr<TokenSource> train;
  std::shared_ptr<TokenSource> val;
};

// Opens the configured data (train + val), checks every file against model.vocab_size and that
// each split holds at least one sequence of train.seq_len + 1 tokens. Throws DataError.
Splits open_splits(const config::RunConfig& cfg);

}  // namespace sl::data
