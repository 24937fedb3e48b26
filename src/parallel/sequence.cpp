#include "parallel/sequence.h"

namespace sl::parallel {

void SequenceGroup::all_to_all(const torch::Tensor& out, const torch::Tensor& in) {
  comm_.all_to_all(out, in, "sequence all-to-all").wait();
  const int64_t n = degree();
  sent_ += static_cast<int64_t>(in.nbytes()) / n * (n - 1);
}

std::shared_ptr<model::SequenceExchange> sequence_exchange(Comm* comm) {
  if (comm == nullptr || comm->mesh().sequence() == 1) return nullptr;
  return std::make_shared<SequenceGroup>(*comm);
}

}  // namespace sl::parallel
