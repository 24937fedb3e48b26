// Dynamic / static loss scaler over LibTorch's AMP kernels.
#include "precision/loss_scaler.h"

#include <ATen/ATen.h>

namespace sl::precision {

LossScaler::LossScaler(const config::PrecisionConfig& cfg, c10::Device device)
    : enabled_(cfg.compute == config::Dtype::kFp16),
      dynamic_(cfg.loss_scale.dynamic()),
      growth_factor_(cfg.growth_factor),
      backoff_factor_(cfg.backoff_factor),
      growth_interval_(cfg.growth_interval) {
  if (!enabled_) return;
  const double init = dynamic_ ? cfg.init_scale : cfg.loss_scale.fixed;
  scale_ = at::full({1}, init, at::TensorOptions().dtype(at::kFloat).device(device));
  scale_host_ = static_cast<double>(static_cast<float>(init));  // what the fp32 tensor holds
  growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  found_inf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const { return enabled_ ? loss * scale_ : loss; }

at::Tensor LossScaler::unscale(const std::vector<at::Tensor>& grads) {
  if (!enabled_) return {};
  found_inf_.zero_();
  const auto inv_scale = scale_.reciprocal();
  std::vector<at::Tensor> here, host;  // offload.gradients: host-resident shards (device/host.h) on a GPU run
  for (const auto& g : grads) (g.device() == found_inf_.device() ? here : host).push_back(g);
  if (!here.empty()) at::_amp_foreach_non_finite_check_and_unscale_(here, found_inf_, inv_scale);
  if (!host.empty()) {
    auto found = at::zeros_like(found_inf_, found_inf_.options().device(host.front().device()));
    at::_amp_foreach_non_finite_check_and_unscale_(host, found, inv_scale.to(host.front().device()));
    found_inf_.add_(found.to(found_inf_.device()));  // a count of flags: read as found when > 0
  }
  return found_inf_;
}

void LossScaler::update(const at::Tensor& found_inf) {
  if (!enabled_ || !dynamic_) return;
  // A sum of per-rank flags (0, 1, 2, ...) becomes the 0/1 flag the kernel expects.
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf.gt(0).to(at::kFloat).reshape({1}), growth_factor_,
                         backoff_factor_, growth_interval_);
}

int64_t LossScaler::growth_tracker() const { return enabled_ ? growth_tracker_.item<int64_t>() : 0; }

void LossScaler::restore(double scale, int64_t growth_tracker) {
  if (!enabled_) return;
  scale_.fill_(scale);
  scale_host_ = static_cast<double>(static_cast<float>(scale));
  growth_tracker_.fill_(growth_tracker);
}

}  // namespace sl::precision
