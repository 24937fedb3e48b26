// Examples with a loss mask and boundaries (examples.h).
#include "data/examples.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "data/mapped_file.h"
#include "data/tokens.h"
#include "model/fused_loss.h"
#include "errors.h"

namespace sl::data {

struct ExampleSource::Files {
  std::string shard, mask_file, offsets_file;
  std::unique_ptr<TokenSource> tokens;
  std::unique_ptr<MappedFile> mask, offsets;
  std::vector<int64_t> trained;  // example k's trained targets

  uint64_t offset(int64_t k) const {
    uint64_t v;
    std::memcpy(&v, offsets->data() + 8 * k, 8);  // little-endian, as x86-64 reads it
    return v;
  }
};

namespace {

std::string beside(const std::string& shard, const char* suffix) {
  const std::filesystem::path p(shard);
  return (p.parent_path() / (p.stem().string() + suffix)).string();
}

// What to run when the mask or offsets do not fit the shard.
constexpr const char* kRemake = "re-create the data set with scripts/prepare_chat.py";

std::unique_ptr<MappedFile> map_beside(const std::string& shard, const std::string& path, const char* what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw DataError(fmt::format("{}: no {} {} beside it; data.source: examples reads scripts/prepare_chat.py's output "
                                "(<name>.bin, <name>.mask.bin, <name>.examples.bin); for plain token shards use "
                                "data.source: llmc", shard, what, path));
  return std::make_unique<MappedFile>(path);
}

// The mask: one byte a token, each 0 or 1.
void check_mask(const ExampleSource::Files& f) {
  const auto n = static_cast<size_t>(f.tokens->size());
  if (f.mask->size() != n)
    throw DataError(fmt::format("{}: {} bytes for the {} tokens of {} (one byte a token); {}", f.mask_file,
                                f.mask->size(), n, f.shard, kRemake));
  const uint8_t* m = f.mask->data();
  for (size_t i = 0; i < n; ++i)
    if (m[i] > 1)
      throw DataError(fmt::format("{}: byte {} at token {} is neither 0 (not trained) nor 1 (trained); {}", f.mask_file,
                                  m[i], i, kRemake));
}

// The offsets: whole uint64s, at least one example, from 0 to the token count, increasing.
int64_t check_offsets(const ExampleSource::Files& f) {
  const size_t bytes = f.offsets->size();
  if (bytes % 8 != 0 || bytes < 16)
    throw DataError(fmt::format("{}: {} bytes is not two or more little-endian uint64 offsets; {}", f.offsets_file,
                                bytes, kRemake));
  const auto n = static_cast<int64_t>(bytes / 8) - 1;
  const auto tokens = static_cast<uint64_t>(f.tokens->size());
  if (f.offset(0) != 0 || f.offset(n) != tokens)
    throw DataError(fmt::format("{}: the offsets run from {} to {}, not from 0 to the {} tokens of {}; {}",
                                f.offsets_file, f.offset(0), f.offset(n), tokens, f.shard, kRemake));
  for (int64_t k = 0; k < n; ++k)
    if (f.offset(k + 1) <= f.offset(k))
      throw DataError(fmt::format("{}: offset {} ({}) is not above offset {} ({}): example {} is empty; {}",
                                  f.offsets_file, k + 1, f.offset(k + 1), k, f.offset(k), k, kRemake));
  return n;
}

// Example k's tokens [s, e) as a row: 2 to seq_len + 1 tokens, the first not trained (nothing precedes it),
// at least one trained target. Returns its trained targets.
int64_t check_example(const ExampleSource::Files& f, int64_t k, int64_t seq_len) {
  const auto s = static_cast<int64_t>(f.offset(k)), e = static_cast<int64_t>(f.offset(k + 1));
  const std::string where = fmt::format("{}: example {} (tokens {}..{})", f.offsets_file, k, s, e);
  if (e - s < 2) throw DataError(where + " has one token: nothing to predict; " + kRemake);
  if (e - s > seq_len + 1)
    throw DataError(fmt::format("{} has {} tokens, more than train.seq_len + 1 = {}; re-run scripts/prepare_chat.py "
                                "--seq-len {} (--too-long drop or truncate), or raise train.seq_len",
                                where, e - s, seq_len + 1, seq_len));
  const uint8_t* m = f.mask->data();
  if (m[s] != 0) throw DataError(where + ": its first token is marked trained, but no token precedes it; " + kRemake);
  const auto trained = static_cast<int64_t>(std::count(m + s + 1, m + e, uint8_t{1}));
  if (trained == 0) throw DataError(where + " has no trained token (its mask is 0 throughout); " + kRemake);
  return trained;
}

}  // namespace

std::string mask_path(const std::string& shard) { return beside(shard, ".mask.bin"); }
std::string offsets_path(const std::string& shard) { return beside(shard, ".examples.bin"); }

std::shared_ptr<ExampleSource> ExampleSource::open(const std::string& shard, int64_t vocab_size, int64_t seq_len) {
  auto f = std::make_shared<Files>();
  f->shard = shard, f->mask_file = mask_path(shard), f->offsets_file = offsets_path(shard);
  f->tokens = open_llmc(shard, vocab_size);
  f->mask = map_beside(shard, f->mask_file, "loss mask");
  f->offsets = map_beside(shard, f->offsets_file, "example offsets");
  check_mask(*f);
  const int64_t n = check_offsets(*f);
  f->trained.resize(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) f->trained[static_cast<size_t>(k)] = check_example(*f, k, seq_len);
  return std::shared_ptr<ExampleSource>(new ExampleSource(std::move(f), 0, n));
}

std::shared_ptr<ExampleSource> ExampleSource::slice(int64_t first, int64_t n) const {
  if (first < 0 || n < 0 || first + n > n_) throw std::out_of_range("ExampleSource::slice: outside the examples");
  return std::shared_ptr<ExampleSource>(new ExampleSource(files_, first_ + first, n));
}

int64_t ExampleSource::length(int64_t k) const {
  return static_cast<int64_t>(files_->offset(first_ + k + 1) - files_->offset(first_ + k));
}

int64_t ExampleSource::fill_row(int64_t k, int64_t T, int64_t* x, int64_t* y) const {
  const auto s = static_cast<int64_t>(files_->offset(first_ + k));
  const int64_t L = length(k);
  if (L - 1 > T) throw std::logic_error("ExampleSource::fill_row: the example is longer than the row");
  std::vector<int64_t> tokens(static_cast<size_t>(L));
  files_->tokens->read(s, L, tokens.data());
  const uint8_t* m = files_->mask->data() + s;
  for (int64_t j = 0; j < L - 1; ++j) {
    x[j] = tokens[static_cast<size_t>(j)];
    y[j] = m[j + 1] ? tokens[static_cast<size_t>(j + 1)] : model::kIgnoreTarget;
  }
  std::fill(x + L - 1, x + T, int64_t{0});
  std::fill(y + L - 1, y + T, model::kIgnoreTarget);
  return files_->trained[static_cast<size_t>(first_ + k)];
}

std::string ExampleSource::describe() const {
  const auto tokens = files_->offset(first_ + n_) - files_->offset(first_);
  int64_t trained = 0;
  for (int64_t k = first_; k < first_ + n_; ++k) trained += files_->trained[static_cast<size_t>(k)];
  const auto total = static_cast<int64_t>(files_->trained.size());
  return fmt::format("{} (examples {}..{} of {}, {} tokens, {} trained)", files_->shard, first_, first_ + n_, total,
                     tokens, trained);
}

}  // namespace sl::data
