// The process mesh: the one place that derives where every rank stands in the parallel dimensions, the
// groups those places make, and the batch arithmetic that follows from them. Built once from the launch
// (world size and rank) and the recipe's degrees; Comm, the loaders, saved states, reports, the planner and
// the recipe's validation read it (the memory model's Scenario keeps the degree and the world as plain
// numbers, which its what-ifs vary one at a time). Torch-free.
//
// Dimensions, outermost first: data x sequence. A rank's coordinates are (data_rank, sequence_rank) with
//   rank = data_rank * sequence + sequence_rank,
// so a sequence group (the ranks that share each sequence's positions, parallel.sequence) is `sequence`
// consecutive ranks (one node's GPUs where the degree divides a node) and a data group (the ranks that
// draw different sequences and average their gradients) strides by `sequence`. Adding a dimension adds its
// degree to Degrees, its coordinate and its group here, and nothing elsewhere derives a coordinate.
#pragma once
#include <cstdint>
#include <vector>

namespace sl::layout {

// Each dimension's degree but the data one, which is what the world leaves: world / (the others' product).
struct Degrees {
  int64_t sequence = 1;  // parallel.sequence: ranks that split each sequence's positions (Ulysses)
  bool operator==(const Degrees&) const = default;
};

class Mesh {
 public:
  Mesh() = default;  // one process
  // Throws ConfigError when a degree is below 1, the degrees do not divide `world`, or `rank` is not in
  // [0, world).
  Mesh(int64_t world, int64_t rank, Degrees degrees);
  // Whether the degrees make a mesh of `world` ranks: each at least 1, their product dividing the world.
  static bool fits(int64_t world, const Degrees& degrees) {
    return world >= 1 && degrees.sequence >= 1 && world % degrees.sequence == 0;
  }
  // The same layout seen from another rank.
  Mesh at(int64_t rank) const { return Mesh(world_, rank, degrees_); }

  int64_t world() const { return world_; }
  int64_t rank() const { return rank_; }
  const Degrees& degrees() const { return degrees_; }

  // Degrees: the ranks along each dimension.
  int64_t data() const { return world_ / degrees_.sequence; }  // ranks that draw their own sequences
  int64_t sequence() const { return degrees_.sequence; }       // ranks that share each sequence

  // This rank's coordinates.
  int64_t data_rank() const { return rank_ / degrees_.sequence; }      // which sequences it trains
  int64_t sequence_rank() const { return rank_ % degrees_.sequence; }  // which piece of their positions it holds
  // The rank at coordinates (data_rank, sequence_rank).
  int64_t rank_of(int64_t data_rank, int64_t sequence_rank) const {
    return data_rank * degrees_.sequence + sequence_rank;
  }

  // This rank's groups, each in its own coordinate's order: the ranks that share its sequences (its
  // sequence group) and the ranks that hold the same piece of other sequences (its data group).
  std::vector<int64_t> sequence_group() const;
  std::vector<int64_t> data_group() const;

  // The batch arithmetic. One optimizer step trains micro_batch x grad_accum sequences on every data rank.
  int64_t global_batch(int64_t micro_batch, int64_t grad_accum) const { return micro_batch * grad_accum * data(); }
  int64_t tokens_per_step(int64_t micro_batch, int64_t grad_accum, int64_t seq_len) const {
    return global_batch(micro_batch, grad_accum) * seq_len;
  }
  // A global batch's share per data rank, rounded up (what train.micro_batch: auto splits into micro-batches).
  int64_t sequences_per_rank(int64_t global_batch) const { return (global_batch + data() - 1) / data(); }
  // The positions of a sequence of seq_len that this rank holds.
  int64_t local_positions(int64_t seq_len) const { return seq_len / degrees_.sequence; }

  bool operator==(const Mesh&) const = default;

 private:
  int64_t world_ = 1, rank_ = 0;
  Degrees degrees_;
};

}  // namespace sl::layout
