// Batch sampling over token sources (random windows) and examples (epochs), splits, the tokenizer beside
// the data (loader.h).
#include "data/loader.h"

#include <algorithm>
#include <filesystem>
#include <numeric>

#include <fmt/format.h>
#include <torch/torch.h>

#include "errors.h"

namespace sl::data {
namespace {

std::shared_ptr<TokenSource> open_file(const config::DataConfig& d, int64_t vocab_size, const std::string& path) {
  if (d.source == config::DataSource::kText) return open_text(path, vocab_size);
  if (d.source == config::DataSource::kRaw) return open_raw(path, vocab_size, static_cast<int>(d.raw_dtype.bytes()));
  return open_llmc(path, vocab_size);  // llmc, or its old name bin
}

}  // namespace

Loader::Loader(std::shared_ptr<TokenSource> source, int64_t micro_batch, int64_t seq_len, uint64_t seed,
               const layout::Mesh& mesh)
    : source_(std::move(source)),
      B_(micro_batch),
      T_(seq_len),
      mesh_(mesh),
      seed_(seed),
      start_(seed),
      state_(seed) {
  if (source_->size() < T_ + 1)
    throw DataError(
        fmt::format("{}: only {} tokens, fewer than one sequence of train.seq_len + 1 = {}; "
                    "use more data or a shorter train.seq_len",
                    source_->describe(), source_->size(), T_ + 1));
}

Loader::Loader(std::shared_ptr<ExampleSource> examples, int64_t micro_batch, int64_t seq_len, uint64_t seed,
               const layout::Mesh& mesh, bool packing)
    : examples_(std::move(examples)),
      B_(micro_batch),
      T_(seq_len),
      packing_(packing),
      mesh_(mesh),
      seed_(seed),
      start_(0),
      state_(0) {
  if (examples_->count() < 1) throw DataError(examples_->describe() + ": no examples");
}

Batch Loader::next() { return examples_ ? next_examples() : next_window(); }

Batch Loader::next_window() {
  const int64_t span = source_->size() - T_;  // valid window starts: [0, span)
  const int64_t t = mesh_.local_positions(T_);  // this piece's positions: window + [piece * t, piece * t + t)
  auto buf = torch::empty({B_, t + 1}, torch::kInt64);
  int64_t* p = buf.data_ptr<int64_t>();
  for (int64_t g = 0; g < B_ * mesh_.data(); ++g) {
    const int64_t start = static_cast<int64_t>(splitmix64(state_) % static_cast<uint64_t>(span));
    if (g / B_ != mesh_.data_rank()) continue;  // another data rank's row
    source_->read(start + mesh_.sequence_rank() * t, t + 1, p + (g % B_) * (t + 1));
  }
  Batch b;
  b.x = buf.narrow(1, 0, t).contiguous(), b.y = buf.narrow(1, 1, t).contiguous();
  return b;
}

int64_t Loader::example_at(uint64_t row) {
  const auto n = static_cast<uint64_t>(examples_->count());
  const auto epoch = static_cast<int64_t>(row / n);
  if (epoch != epoch_) {  // Fisher-Yates from (seed, epoch)
    order_.resize(n);
    for (uint64_t i = 0; i < n; ++i) order_[i] = static_cast<int64_t>(i);
    uint64_t rng = seed_ ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(epoch + 1));
    for (uint64_t i = n - 1; i > 0; --i) std::swap(order_[i], order_[splitmix64(rng) % (i + 1)]);
    epoch_ = epoch;
  }
  return order_[row % n];
}

int64_t Loader::fill_example_row(int64_t* x, int64_t* y) {
  return examples_->fill_row(example_at(state_++), T_, x, y);
}

// Whole examples while their inputs fit (a fresh row takes at least one: none is longer than T + 1 tokens),
// each at positions 0, 1, ...; then padding (input 0, target -100), counted from 0 as one more piece.
int64_t Loader::fill_packed_row(int64_t* x, int64_t* y, int64_t* positions) {
  int64_t used = 0, trained = 0;
  for (int64_t n; used + (n = examples_->length(example_at(state_)) - 1) <= T_; used += n) {
    trained += examples_->fill_row(example_at(state_++), n, x + used, y + used);
    std::iota(positions + used, positions + used + n, int64_t{0});
  }
  std::fill(x + used, x + T_, int64_t{0});
  std::fill(y + used, y + T_, kIgnoreTarget);
  std::iota(positions + used, positions + T_, int64_t{0});
  return trained;
}

// Every rank fills every rank's rows (whole rows, T positions) to count the micro-batch's trained targets
// over the mesh, and keeps its own rows' piece (packed: with the whole rows' positions).
Batch Loader::next_examples() {
  const int64_t t = mesh_.local_positions(T_), piece = mesh_.sequence_rank() * t;
  auto x = torch::empty({B_, t}, torch::kInt64), y = torch::empty({B_, t}, torch::kInt64);
  Batch b;
  if (packing_) b.positions = torch::empty({B_, T_}, torch::kInt64);
  std::vector<int64_t> row_x(static_cast<size_t>(T_)), row_y(static_cast<size_t>(T_)), row_p(static_cast<size_t>(T_));
  for (int64_t g = 0; g < B_ * mesh_.data(); ++g) {
    b.trained_everywhere += packing_ ? fill_packed_row(row_x.data(), row_y.data(), row_p.data())
                                     : fill_example_row(row_x.data(), row_y.data());
    if (g / B_ != mesh_.data_rank()) continue;  // another data rank's row
    const int64_t r = g % B_;
    std::copy_n(row_x.data() + piece, t, x.data_ptr<int64_t>() + r * t);
    std::copy_n(row_y.data() + piece, t, y.data_ptr<int64_t>() + r * t);
    if (packing_) std::copy_n(row_p.data(), T_, b.positions.data_ptr<int64_t>() + r * T_);
  }
  b.x = x, b.y = y;
  return b;
}

namespace {

// data.source: examples: the shard's examples, or two (data.val_path) and the last val_fraction of them
// held out (at least one) when there is no val_path.
Splits open_example_splits(const config::DataConfig& d, int64_t vocab_size, int64_t seq_len) {
  Splits s;
  s.packing = d.packing;
  s.train_examples = ExampleSource::open(d.path, vocab_size, seq_len);
  if (!d.val_path.empty()) {
    s.val_examples = ExampleSource::open(d.val_path, vocab_size, seq_len);
    return s;
  }
  const int64_t n = s.train_examples->count();
  const int64_t n_val = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(n) * d.val_fraction));
  if (n_val >= n)
    throw DataError(fmt::format("{}: {} example(s) cannot be split into train and val (data.val_fraction {}); give "
                                "data.val_path (scripts/prepare_chat.py writes val.bin) or more examples",
                                s.train_examples->describe(), n, d.val_fraction));
  auto all = s.train_examples;
  s.train_examples = all->slice(0, n - n_val);
  s.val_examples = all->slice(n - n_val, n_val);
  return s;
}

}  // namespace

Splits open_splits(const config::DataConfig& d, int64_t vocab_size, int64_t seq_len, int64_t seed) {
  if (d.source.examples()) return open_example_splits(d, vocab_size, seq_len);
  Splits s;
  if (d.source == config::DataSource::kSynthetic) {
    std::shared_ptr<TokenSource> all = make_synthetic(d.synthetic_tokens, vocab_size, static_cast<uint64_t>(seed));
    const int64_t n_val = static_cast<int64_t>(static_cast<double>(all->size()) * d.val_fraction);
    s.train = slice(all, 0, all->size() - n_val);
    s.val = slice(all, all->size() - n_val, n_val);
  } else if (d.val_path.empty()) {
    std::shared_ptr<TokenSource> all = open_file(d, vocab_size, d.path);
    const int64_t n_val = static_cast<int64_t>(static_cast<double>(all->size()) * d.val_fraction);
    s.train = slice(all, 0, all->size() - n_val);
    s.val = slice(all, all->size() - n_val, n_val);
  } else {
    s.train = open_file(d, vocab_size, d.path);
    s.val = open_file(d, vocab_size, d.val_path);
  }
  const int64_t need = seq_len + 1;
  for (const auto* split : {&s.train, &s.val})
    if ((*split)->size() < need)
      throw DataError(fmt::format("{}: only {} tokens, fewer than one sequence of train.seq_len + 1 = {}; "
                                  "use more data or a shorter train.seq_len", (*split)->describe(),
                                  (*split)->size(), need));
  return s;
}

std::filesystem::path tokenizer_path(const config::DataConfig& d) {
  std::error_code ec;
  if (!d.tokenizer.empty()) {
    if (!std::filesystem::is_regular_file(d.tokenizer, ec))
      throw DataError(
          fmt::format("data.tokenizer: {} does not exist; give the tokenizer.json scripts/prepare_data.py wrote "
                      "beside the shards, or \"\" for none",
                      d.tokenizer));
    return d.tokenizer;
  }
  if (!d.source.token_file()) return {};
  const auto beside = std::filesystem::path(d.path).parent_path() / "tokenizer.json";
  return std::filesystem::is_regular_file(beside, ec) ? beside : std::filesystem::path();
}

}  // namespace sl::data
