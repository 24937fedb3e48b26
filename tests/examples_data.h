// Example data sets (data.source: examples) written as scripts/prepare_chat.py lays them out, for the tests:
// <name>.bin (llm.c shard), <name>.mask.bin (a byte a token, 1 = trained target), <name>.examples.bin
// (little-endian uint64 offsets, examples + 1 of them).
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/loader.h"

namespace sl::test {

// One example: its tokens, of which [prompt, end) are trained (prompt >= 1: the first never is).
struct Example {
  std::vector<int64_t> tokens;
  size_t prompt = 1;
};

inline void write_bytes(const std::filesystem::path& p, const void* data, size_t n) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

// Writes the three files; returns the shard's path (data.path).
inline std::string write_examples(const std::filesystem::path& dir, const std::string& name,
                                  const std::vector<Example>& examples) {
  std::vector<int64_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<uint64_t> offsets{0};
  for (const auto& e : examples) {
    for (size_t i = 0; i < e.tokens.size(); ++i) {
      tokens.push_back(e.tokens[i]);
      mask.push_back(i >= e.prompt ? 1 : 0);
    }
    offsets.push_back(tokens.size());
  }
  const auto shard = (dir / (name + ".bin")).string();
  data::write_llmc(shard, tokens);
  write_bytes(dir / (name + ".mask.bin"), mask.data(), mask.size());
  write_bytes(dir / (name + ".examples.bin"), offsets.data(), offsets.size() * 8);
  return shard;
}

// `count` examples of very different lengths, from 3 tokens to max_len, each with a prompt of about
// a third (short examples' few trained tokens are what a mean of per-micro-batch means would weight up),
// token ids from a fixed LCG in [0, vocab).
inline std::vector<Example> varied_examples(int64_t count, int64_t max_len, int64_t vocab, uint64_t seed = 1) {
  std::vector<Example> out;
  uint64_t s = seed;
  const auto next = [&s] { return (s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (int64_t k = 0; k < count; ++k) {
    const int64_t len = count == 1 ? max_len : 3 + (max_len - 3) * k * k / ((count - 1) * (count - 1));
    Example e;
    for (int64_t i = 0; i < len; ++i) e.tokens.push_back(static_cast<int64_t>(next() % static_cast<uint64_t>(vocab)));
    e.prompt = static_cast<size_t>(std::max<int64_t>(1, len / 3));
    out.push_back(e);
  }
  return out;
}

}  // namespace sl::test
