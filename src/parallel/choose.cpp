// The choice of a run's strategy (make_strategy, strategy.h) and of the engine's stage (make_engine,
// engine.h): the one file that knows every strategy, above them all, so no base file includes a derived one.
#include "parallel/engine.h"
#include "parallel/single.h"
#include "parallel/stages.h"
#include "parallel/strategy.h"
#include "parallel/zero3.h"

namespace sl::parallel {

std::unique_ptr<Strategy> make_strategy(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm) {
  if (spec.parallel.uses_engine(comm->world())) return make_engine(std::move(model), spec, std::move(comm));
  return std::make_unique<Single>(std::move(model));
}

std::unique_ptr<Engine> make_engine(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm) {
  std::unique_ptr<Engine> e;
  switch (spec.parallel.sharding.stage()) {
    case config::Sharding::kNone: e = std::make_unique<Ddp>(std::move(model), spec, std::move(comm)); break;
    case config::Sharding::kZero1: e = std::make_unique<Zero1>(std::move(model), spec, std::move(comm)); break;
    case config::Sharding::kZero2: e = std::make_unique<Zero2>(std::move(model), spec, std::move(comm)); break;
    case config::Sharding::kZero3: e = std::make_unique<Zero3>(std::move(model), spec, std::move(comm)); break;
  }
  e->init(spec);
  return e;
}

}  // namespace sl::parallel
