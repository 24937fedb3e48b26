// The memory model's input, read from a recipe once.
#include "predict/scenario.h"

#include <algorithm>

#include <torch/cuda.h>

namespace sl::memory {

namespace {

config::DeviceChoice resolved(config::DeviceChoice d) {
  if (d != config::DeviceChoice::kAuto) return d;
  return torch::cuda::is_available() ? config::DeviceChoice::kCuda : config::DeviceChoice::kCpu;
}

}  // namespace

Scenario Scenario::of(const config::RunConfig& cfg) {
  Scenario s;
  s.model = cfg.model;
  s.micro_batch = cfg.train.micro_batch.is_auto() ? 1 : cfg.train.micro_batch.value();
  s.seq_len = cfg.train.seq_len;
  s.grad_accum = cfg.train.grad_accum;
  s.sequence = std::max<int64_t>(1, cfg.parallel.sequence);
  s.packing = cfg.data.packing;
  s.in_backward = cfg.optim.in_backward;
  s.checkpointing = cfg.checkpointing;
  s.placement = {cfg.world_size, cfg.parallel.sharding, cfg.parallel.bucket_mb, cfg.offload};
  s.precision = cfg.precision;
  s.device = resolved(cfg.train.device);
  s.memory_limit = cfg.memory.limit.bytes;
  s.async_snapshot = cfg.state.async && cfg.state.every > 0;
  s.peak_tflops = cfg.logging.peak_tflops;
  s.all_to_all_gbps = cfg.parallel.all_to_all_gbps;
  return s;
}

}  // namespace sl::memory
