// Autocast guard: while alive, ops on the device run in precision.compute's dtype under LibTorch's
// autocast rules (matmuls in bf16/fp16, norms and losses in fp32); fp32 makes it a no-op. The
// forward runs inside it, backward outside (recompute re-applies the forward's state itself).
#pragma once
#include <optional>
#include <string>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace sl::precision {

// bf16 -> kBFloat16, fp16 -> kHalf, fp32 -> nullopt.
std::optional<c10::ScalarType> compute_dtype(const std::string& compute);

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
