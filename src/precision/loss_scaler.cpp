// Dynamic / static loss scaler over LibTorch's AMP kernels.
#include "precision/loss_scaler.h"

#include <ATen/ATen.h>

namespace sl::precision {

LossScaler::LossScaler(const config::PrecisionConfig& cfg, c10::Device device)
    : enabled_(cfg.compute == "fp16"),
      dynamic_(cfg.loss_scale == "dynamic"),
      growth_factor_(cfg.growth_factor),
      backoff_factor_(cfg.backoff_factor),
      growth_interval_(cfg.growth_interval) {
  if (!enabled_) return;
  const double init = dynamic_ ? cfg.init_scale : std::stod(cfg.loss_scale);
  scale_ = at::full({1}, init, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  found_inf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
}

double LossScaler::scale() const { return enabled_ ? scale_.item<double>() : 1.0; }

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const { return enabled_ ? loss * scale_ : loss; }

bool LossScaler::unscale(const std::vector<at::Tensor>& grads, const std::function<double(double)>& agree) {
  if (!enabled_) return true;
  found_inf_.zero_();
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
  if (agree) found_inf_.fill_(agree(found_inf_.item<double>()));
  return found_inf_.item<float>() == 0.0f;
}

void LossScaler::update() {
  if (!enabled_ || !dynamic_) return;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, growth_factor_, backoff_factor_, growth_interval_);
}

int64_t LossScaler::growth_tracker() const { return enabled_ ? growth_tracker_.item<int64_t>() : 0; }

void LossScaler::restore(double scale, int64_t growth_tracker) {
  if (!enabled_) return;
  scale_.fill_(scale);
  growth_tracker_.fill_(growth_tracker);
}

}  // namespace sl::precision
