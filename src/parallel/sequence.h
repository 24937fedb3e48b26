// The sequence group's exchange (model/sequence.h) over the Comm's sequence process group
// (parallel.sequence = N): each all-to-all is waited for where it is issued, so its output is ready for
// the attention that reads it (Gloo: the host blocks until it is done; NCCL: the current stream is
// ordered after it). A failed exchange throws DistError (exit 5), from the forward or from backward.
#pragma once
#include <memory>

#include "model/sequence.h"
#include "parallel/comm.h"

namespace sl::parallel {

class SequenceGroup : public model::SequenceExchange {
 public:
  explicit SequenceGroup(Comm& comm) : comm_(comm) {}
  int64_t degree() const override { return comm_.mesh().sequence(); }
  int64_t rank() const override { return comm_.mesh().sequence_rank(); }
  void all_to_all(const torch::Tensor& out, const torch::Tensor& in) override;
  int64_t sent_bytes() const override { return sent_; }

 private:
  Comm& comm_;
  int64_t sent_ = 0;
};

// The exchange a run of `comm` gives its model: null when every rank holds whole sequences (N = 1).
std::shared_ptr<model::SequenceExchange> sequence_exchange(Comm* comm);

}  // namespace sl::parallel
