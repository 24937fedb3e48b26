// Autocast guard over at::autocast's thread-local state.
#include "precision/autocast.h"

#include <stdexcept>

#include <ATen/autocast_mode.h>

namespace sl::precision {

c10::ScalarType scalar_type(config::Dtype dtype) {
  switch (dtype.kind()) {
    case config::Dtype::kFp32: return c10::ScalarType::Float;
    case config::Dtype::kBf16: return c10::ScalarType::BFloat16;
    case config::Dtype::kFp16: return c10::ScalarType::Half;
  }
  throw std::logic_error("scalar_type: a dtype without a tensor type");
}

std::optional<c10::ScalarType> compute_dtype(config::Dtype compute) {
  if (compute == config::Dtype::kFp32) return std::nullopt;
  return scalar_type(compute);
}

AutocastGuard::AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype) : device_(device) {
  if (!dtype) return;
  active_ = true;
  prev_enabled_ = at::autocast::is_autocast_enabled(device_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, *dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();  // drop cached weight casts
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}

}  // namespace sl::precision
