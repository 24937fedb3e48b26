// Autocast guard: while alive, ops on the device run in precision.compute's dtype under LibTorch's
// autocast rules (matmuls in bf16/fp16, norms and losses in fp32); fp32 makes it a no-op. The
// forward runs inside it, backward outside (recompute re-applies the forward's state itself).
#pragma once
#include <optional>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "config/choices.h"

namespace sl::precision {

// The tensor type of a recipe dtype: fp32 -> kFloat, bf16 -> kBFloat16, fp16 -> kHalf.
c10::ScalarType scalar_type(config::Dtype dtype);
// precision.compute's autocast dtype: bf16 -> kBFloat16, fp16 -> kHalf, fp32 -> nullopt (no autocast).
std::optional<c10::ScalarType> compute_dtype(config::Dtype compute);

class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool active_ = false, prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::ScalarType::BFloat16;
};

}  // namespace sl::precision
