// What every strategy shares (the one AdamW builder) and the choice of a run's strategy (strategy.h).
#include "parallel/strategy.h"

#include "optim/optimizer.h"
#include "parallel/engine.h"
#include "parallel/single.h"

namespace sl::parallel {

std::unique_ptr<torch::optim::AdamW> Strategy::make_optimizer(const config::TrainConfig& t) {
  auto [decay, no_decay] = trainables();
  return optim::make_adamw(std::move(decay), std::move(no_decay), t);
}

std::unique_ptr<Strategy> make_strategy(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm) {
  if (spec.parallel.uses_engine(comm->world())) return make_engine(std::move(model), spec, std::move(comm));
  return std::make_unique<Single>(std::move(model));
}

bool Strategy::writes_model_states(bool rank0) const { return rank0 || shards_states(); }

}  // namespace sl::parallel
