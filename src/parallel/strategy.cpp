// What every strategy shares (the one AdamW builder, strategy.h).
#include "parallel/strategy.h"

#include "optim/optimizer.h"

namespace sl::parallel {

std::unique_ptr<torch::optim::AdamW> Strategy::make_optimizer(const config::TrainConfig& t) {
  auto [decay, no_decay] = trainables();
  return optim::make_adamw(std::move(decay), std::move(no_decay), t);
}

bool Strategy::writes_model_states(bool rank0) const { return rank0 || shards_states(); }

void Strategy::step_in_backward(torch::optim::AdamW&) {
  throw std::logic_error("optim.in_backward runs in one process without sharding or offloaded states");
}

}  // namespace sl::parallel
