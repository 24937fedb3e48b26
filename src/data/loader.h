// Batches: seeded, rank-sharded sampling of token windows (data/tokens.h) and of examples
// (data/examples.h); the configured train/val splits; the tokenizer the data was made with. Every bad
// input throws DataError naming the file and the problem.
#pragma once
#include <filesystem>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "config/config.h"
#include "data/examples.h"
#include "data/tokens.h"
#include "layout/mesh.h"
#include "model/fused_loss.h"

namespace sl::data {

// A target the loss skips (transformers' label for it): masked-out tokens and padding (data.source: examples).
inline constexpr int64_t kIgnoreTarget = model::kIgnoreTarget;

struct Batch {
  at::Tensor x;  // (B, T) int64 inputs
  at::Tensor y;  // (B, T) int64 targets, x shifted by one; kIgnoreTarget where no loss is taken (examples)
  // Examples only (0 for token streams, where every target is trained): the trained targets of this
  // micro-batch on every rank of the mesh together. Each rank draws every rank's rows, so it knows the
  // optimizer step's total without communication (train/step.cpp divides the summed loss by it).
  int64_t trained_everywhere = 0;
  // Packed rows (data.packing) only: (B, T) int64, each position's index within its example, the whole
  // row on every sequence rank (attention and positions restart where it is 0; model/gpt.h's Rope).
  at::Tensor positions = {};
  bool masked() const { return trained_everywhere > 0; }
};

// Samples (B, T) windows at random offsets from a token source. Deterministic in (seed, the mesh's
// data rank): every data rank draws the same global offsets and keeps its own slice, so batches do not
// overlap across the ranks that draw their own sequences and a run is reproducible for a given mesh.
// With a sequence degree N > 1 each window's positions come in N equal consecutive pieces and the
// loader returns the piece of the mesh's sequence rank, (B, T / N): the tokens and their targets there.
//
// Over examples (data.source: examples) each row is one example (ExampleSource::fill_row), drawn in
// epochs: every example once per epoch, in an order shuffled from (seed, epoch); the data ranks take
// consecutive rows of that order and the sequence ranks their pieces of each row, as above. Packed
// (data.packing), each row takes whole examples of that order until the next one's inputs do not fit
// (it starts the next row), then padding; Batch::positions says where each example starts.
class Loader {
 public:
  Loader(std::shared_ptr<TokenSource> source, int64_t micro_batch, int64_t seq_len, uint64_t seed,
         const layout::Mesh& mesh = {});
  Loader(std::shared_ptr<ExampleSource> examples, int64_t micro_batch, int64_t seq_len, uint64_t seed,
         const layout::Mesh& mesh = {}, bool packing = false);
  Batch next();
  // The sampler's position (the same on every rank), for saved training states: token windows, the RNG
  // state; examples, the examples drawn so far (over every rank).
  uint64_t position() const { return state_; }
  void restore(uint64_t position) { state_ = position; }
  // Back to the first batch: the eval loader rewinds before every eval, so each scores the same windows.
  void rewind() { state_ = start_; }

 private:
  Batch next_window();
  Batch next_examples();
  // The next row of a batch, whole (T positions): one example, or packed examples with their positions.
  // Returns its trained targets.
  int64_t fill_example_row(int64_t* x, int64_t* y);
  int64_t fill_packed_row(int64_t* x, int64_t* y, int64_t* positions);
  int64_t example_at(uint64_t row);  // the example the order of row's epoch puts at row

  std::shared_ptr<TokenSource> source_;
  std::shared_ptr<ExampleSource> examples_;
  int64_t B_, T_;
  bool packing_ = false;
  layout::Mesh mesh_;
  uint64_t seed_;
  uint64_t start_;  // where rewind goes: the seed (token windows) or row 0 (examples)
  uint64_t state_;  // splitmix64 state, or examples drawn
  int64_t epoch_ = -1;            // the epoch whose order `order_` holds
  std::vector<int64_t> order_;    // examples: a permutation of [0, count)
};

// The train and val data: token sources, or (data.source: examples) example sources.
struct Splits {
  std::shared_ptr<TokenSource> train;
  std::shared_ptr<TokenSource> val;
  std::shared_ptr<ExampleSource> train_examples;
  std::shared_ptr<ExampleSource> val_examples;
  bool packing = false;  // data.packing: the example loaders pack rows
  std::string describe_train() const { return train ? train->describe() : train_examples->describe(); }
  std::string describe_val() const { return val ? val->describe() : val_examples->describe(); }
};

// Opens the configured data (train + val), checks every file against the model's vocabulary (model.vocab_size)
// and that each split holds at least one sequence of seq_len + 1 tokens (train.seq_len), or (examples) one
// example, each of at most seq_len + 1 tokens; synthetic data is drawn from `seed` (train.seed). Throws DataError.
Splits open_splits(const config::DataConfig& d, int64_t vocab_size, int64_t seq_len, int64_t seed);

// The tokenizer.json the data was made with: data.tokenizer (DataError, exit 3, when it does not exist), else
// tokenizer.json beside data.path for token files (llmc, raw) when there is one, else "".
std::filesystem::path tokenizer_path(const config::DataConfig& d);

}  // namespace sl::data
