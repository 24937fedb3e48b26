// Examples for fine-tuning (data.source: examples), as scripts/prepare_chat.py writes them: an llm.c shard
// of examples one after another, and beside it <stem>.mask.bin (one byte a token, 1 where the token is a
// trained target) and <stem>.examples.bin (little-endian uint64 offsets: example k is tokens
// [offset k, offset k + 1); the first offset 0, the last the shard's token count).
//
// Each example is one row of a batch, padded: its tokens but the last as inputs, its tokens but the first
// as targets, model::kIgnoreTarget (-100) where the mask is 0 and in the padding after it (input token 0 there: causal
// attention keeps the padding out of the example's positions). Every bad input throws DataError naming
// the file, the example and what to run.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sl::data {


// The mask and offsets files beside an examples shard: <dir>/<stem>.mask.bin, <dir>/<stem>.examples.bin.
std::string mask_path(const std::string& shard);
std::string offsets_path(const std::string& shard);

class ExampleSource {
 public:
  struct Files;  // the shard, mask and offsets, mapped (examples.cpp)

  // Opens the shard (llm.c, tokens < vocab_size), its mask and its offsets, and checks that they agree
  // and that every example has 2 to seq_len + 1 tokens, an untrained first token and a trained target.
  static std::shared_ptr<ExampleSource> open(const std::string& shard, int64_t vocab_size, int64_t seq_len);
  // Examples [first, first + n) of this one (the val_fraction hold-out).
  std::shared_ptr<ExampleSource> slice(int64_t first, int64_t n) const;

  int64_t count() const { return n_; }
  int64_t length(int64_t k) const;  // example k's tokens
  // Example k as a row of T positions, T >= its length - 1: inputs into x, targets (-100 where
  // untrained and past its end) into y. Returns its trained targets.
  int64_t fill_row(int64_t k, int64_t T, int64_t* x, int64_t* y) const;
  std::string describe() const;  // e.g. "data/chat/train.bin (examples 0..120 of 128, 9312 tokens, 4100 trained)"

 private:
  ExampleSource(std::shared_ptr<const Files> files, int64_t first, int64_t n)
      : files_(std::move(files)), first_(first), n_(n) {}
  std::shared_ptr<const Files> files_;
  int64_t first_ = 0, n_ = 0;
};

}  // namespace sl::data
