// The run's device (see device.h).
#include "device/device.h"

#include <mutex>

#include <torch/csrc/lazy/backend/backend_device.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>
#include <torch/csrc/lazy/ts_backend/ts_backend_impl.h>
#include <torch/cuda.h>

#include "errors.h"

namespace sl::device {

c10::Device resolve_device(const config::TrainConfig& t, int64_t local_rank) {
  if (t.device == "lazy") {  // config.cpp (validate_lazy_device) allows it at world 1, fp32 only
    static std::once_flag started;
    std::call_once(started, [] { torch::lazy::InitTorchScriptBackend(); });
    return c10::Device(c10::kLazy);
  }
  const bool has_cuda = torch::cuda::is_available();
  if (t.device == "cuda" && !has_cuda)
    throw ConfigError("train.device: 'cuda' was asked for but no CUDA device is available; use cpu or auto");
  if (t.device == "cuda" || (t.device == "auto" && has_cuda))
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  return c10::Device(c10::kCPU);
}

at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  if (!device.is_cuda()) return t.to(device);
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

void end_step(c10::Device device) {
  if (device.type() != c10::kLazy) return;
  const auto backend = torch::lazy::atenDeviceToBackendDevice(device);
  auto* executor = torch::lazy::LazyGraphExecutor::Get();
  executor->SyncLiveTensorsGraph(&backend, /*devices=*/{}, /*wait=*/true);
  executor->MarkStep(backend);
}

}  // namespace sl::device
