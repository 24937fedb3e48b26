// Loss scaling for fp16: the loss is multiplied by a scale before backward so small gradients do
// not underflow; gradients are unscaled (and checked for inf/NaN) before clipping; a step with
// non-finite gradients is skipped and a dynamic scale backs off, growing again after
// growth_interval clean steps. Uses LibTorch's AMP kernels (_amp_foreach_non_finite_check_and_unscale_,
// _amp_update_scale_). Disabled (scale 1, nothing checked) unless precision.compute is fp16.
// Nothing here waits for the device during a step: the found-inf flag and the scale stay device
// tensors, and the trainer reads them with the loss and the gradient norm in its one host read
// (train/step.cpp), then tells the scaler the scale it read (observe()).
#pragma once
#include <vector>

#include <ATen/core/Tensor.h>

#include "config/config.h"

namespace sl::precision {

class LossScaler {
 public:
  LossScaler(const config::PrecisionConfig& cfg, c10::Device device);
  bool enabled() const { return enabled_; }
  // The current scale as of the last observe() or restore() (1 when disabled); no device read.
  double scale() const { return enabled_ ? scale_host_ : 1.0; }
  at::Tensor scale_loss(const at::Tensor& loss) const;  // loss * scale
  // Divides the gradients by the scale in place and returns this rank's found-inf flag: a one-element
  // fp32 device tensor, 1 when some gradient is not finite (0 otherwise). Not read here. Disabled:
  // undefined.
  at::Tensor unscale(const std::vector<at::Tensor>& grads);
  // After the unscale, on the device: dynamic scaling backs off when `found_inf` (the flag agreed by
  // every rank, > 0 = found) is set, grows after growth_interval clean steps. Static: nothing.
  void update(const at::Tensor& found_inf);
  // The scale as a one-element fp32 device tensor (to read it together with other values).
  const at::Tensor& scale_tensor() const { return scale_; }
  // The value of scale_tensor() the caller read after update(): what scale() returns from now on.
  void observe(double scale) { scale_host_ = scale; }
  // Saved training states: the dynamic scale's growth counter (a device read: only when saving),
  // and both restored.
  int64_t growth_tracker() const;
  void restore(double scale, int64_t growth_tracker);

 private:
  bool enabled_ = false, dynamic_ = false;
  double growth_factor_, backoff_factor_;
  int64_t growth_interval_;
  double scale_host_ = 1.0;
  at::Tensor scale_, growth_tracker_, found_inf_;  // (1) fp32, (1) int32, (1) fp32 on the device
};

}  // namespace sl::precision
