// The memory model's input, read from a recipe once.
#include "memory/scenario.h"

#include <algorithm>

namespace sl::memory {

Scenario::Scenario(const config::RunConfig& cfg) : Scenario(cfg, cfg.train.micro_batch.value()) {}

Scenario Scenario::unresolved(const config::RunConfig& cfg) {
  return Scenario(cfg, cfg.train.micro_batch.is_auto() ? 1 : cfg.train.micro_batch.value());
}

Scenario::Scenario(const config::RunConfig& cfg, int64_t micro_batch)
    : model(cfg.model),
      micro_batch(micro_batch),
      seq_len(cfg.train.seq_len),
      grad_accum(cfg.train.grad_accum),
      sequence(std::max<int64_t>(1, cfg.parallel.sequence)),
      checkpointing(cfg.checkpointing),
      placement{cfg.world_size, cfg.parallel.sharding, cfg.parallel.bucket_mb, cfg.offload},
      precision(cfg.precision),
      device(cfg.train.device),
      memory_limit(cfg.memory.limit.bytes),
      async_snapshot(cfg.state.async && cfg.state.every > 0),
      peak_tflops(cfg.logging.peak_tflops),
      all_to_all_gbps(cfg.parallel.all_to_all_gbps) {}

}  // namespace sl::memory
