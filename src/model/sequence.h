// Sequence parallelism (Ulysses) as the model sees it: the N ranks of a sequence group hold one
// sequence's positions in N equal consecutive pieces; attention exchanges positions for heads with an
// all-to-all before it (every rank then holds the whole sequence for n_head / N heads) and heads for
// positions after it. Everything else in the model is position-wise and runs on the local piece.
//
// The model owns no communication: whoever runs it (parallel/sequence.h) gives it a SequenceExchange,
// the group's all-to-all. With none (one rank per sequence) the model is exactly the unsharded one.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>

#include <torch/types.h>

namespace sl::model {

class SequenceExchange {
 public:
  virtual ~SequenceExchange() = default;
  virtual int64_t degree() const = 0;  // N
  virtual int64_t rank() const = 0;    // this rank's piece: positions [rank * T/N, (rank + 1) * T/N)
  // out <- all-to-all of `in` over the group: `in` (contiguous) is N equal chunks along dim 0, chunk j
  // goes to the group's rank j; out (same shape, contiguous) gets rank j's chunk for this rank at j.
  // Every rank of the group calls it at the same point with the same shape.
  virtual void all_to_all(const torch::Tensor& out, const torch::Tensor& in) = 0;
  // Bytes this rank has sent to the other ranks of its group so far: (N-1)/N of every `in` (its own chunk
  // stays), the quantity memory::ActivationEstimate::all_to_all_bytes predicts per micro-batch.
  virtual int64_t sent_bytes() const = 0;
};

// checkpointing.exchange: keep. What a piece's first pass received from its exchanges, kept for the
// piece's recompute, which takes them in the same order instead of exchanging again (the values are the
// same bits: an all-to-all only moves them). Owned by the checkpointed piece (recompute/checkpoint.h),
// so it is freed with the piece's graph node. The exchanges' backward (the inverse all-to-all of the
// gradient) is unchanged.
class ExchangeMemo {
 public:
  void record(const torch::Tensor& received) { kept_.push_back(received); }
  // The next kept tensor, which must have `sizes` (a recompute that exchanges differently from its first
  // pass is a bug: std::logic_error).
  torch::Tensor take(at::IntArrayRef sizes);
  bool empty() const { return kept_.empty(); }

 private:
  std::deque<torch::Tensor> kept_;
};

// While alive, this thread's exchanges record into `memo` (replay false: a first pass) or take from it
// (replay true: the recompute); the enclosing scope's memo is restored afterwards. A null memo: exchanges
// communicate (a piece that redoes its exchanges, nested in one that keeps).
class ExchangeMemoScope {
 public:
  ExchangeMemoScope(ExchangeMemo* memo, bool replay);
  ~ExchangeMemoScope();
  ExchangeMemoScope(const ExchangeMemoScope&) = delete;
  ExchangeMemoScope& operator=(const ExchangeMemoScope&) = delete;

 private:
  ExchangeMemo* prev_memo_;
  bool prev_replay_;
};

// x: (B, T/N, G, nh, hd), G groups of nh heads for this rank's positions (qkv: G = 3) -> (B, T, G, nh/N,
// hd), contiguous: the whole sequence for this rank's heads [rank * nh/N, (rank + 1) * nh/N) of every group.
// Differentiable: the gradient takes the inverse exchange. Saves nothing for backward. Inside an
// ExchangeMemoScope it records its output or takes the recorded one (the same for heads_to_positions).
torch::Tensor positions_to_heads(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& x);
// The inverse: y (B, T, G, nh/N, hd) -> (B, T/N, G, nh, hd), contiguous. Differentiable likewise.
torch::Tensor heads_to_positions(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& y);

}  // namespace sl::model
