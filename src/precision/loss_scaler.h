// Loss scaling for fp16: the loss is multiplied by a scale before backward so small gradients do
// not underflow; gradients are unscaled (and checked for inf/NaN) before clipping; a step with
// non-finite gradients is skipped and a dynamic scale backs off, growing again after
// growth_interval clean steps. Uses LibTorch's AMP kernels (_amp_foreach_non_finite_check_and_unscale_,
// _amp_update_scale_). Disabled (scale 1, nothing checked) unless precision.compute is fp16.
#pragma once
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "config/config.h"

namespace sl::precision {

class LossScaler {
 public:
  LossScaler(const config::PrecisionConfig& cfg, c10::Device device);
  bool enabled() const { return enabled_; }
  double scale() const;                                // current scale (1 when disabled)
  at::Tensor scale_loss(const at::Tensor& loss) const;  // loss * scale
  // Divides the gradients by the scale in place; true when all are finite. Disabled: true.
  // `agree` (sharded gradients) turns this rank's found-inf flag (0 or 1) into every rank's maximum,
  // so all ranks skip or step together.
  bool unscale(const std::vector<at::Tensor>& grads, const std::function<double(double)>& agree = {});
  // After a step: dynamic scaling backs off on found_inf, grows after growth_interval clean steps.
  void update();
  // Saved training states: the dynamic scale's growth counter, and both restored.
  int64_t growth_tracker() const;
  void restore(double scale, int64_t growth_tracker);

 private:
  bool enabled_ = false, dynamic_ = false;
  double growth_factor_, backoff_factor_;
  int64_t growth_interval_;
  at::Tensor scale_, growth_tracker_, found_inf_;  // (1) fp32, (1) int32, (1) fp32 on the device
};

}  // namespace sl::precision
