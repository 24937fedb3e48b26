// The run's device (see device.h).
#include "device/device.h"

#include <cstdlib>
#include <mutex>
#include <string>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/csrc/lazy/backend/backend_device.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>
#include <torch/csrc/lazy/ts_backend/ts_backend_impl.h>
#include <torch/cuda.h>

#include "errors.h"

namespace sl::device {

c10::Device resolve_device(const config::TrainConfig& t, int64_t local_rank) {
  if (t.device == config::DeviceChoice::kLazy) {  // validate_lazy_device (config) allows it at world 1, fp32 only
    static std::once_flag started;
    std::call_once(started, [] { torch::lazy::InitTorchScriptBackend(); });
    return c10::Device(c10::kLazy);
  }
  const bool has_cuda = torch::cuda::is_available();
  if (t.device == config::DeviceChoice::kCuda && !has_cuda)
    throw ConfigError("train.device: 'cuda' was asked for but no CUDA device is available; use cpu or auto");
  if (t.device == config::DeviceChoice::kCuda || (t.device == config::DeviceChoice::kAuto && has_cuda)) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    const char* set = std::getenv("LOCAL_RANK");
    check_local_rank(local_rank, torch::cuda::device_count(), visible ? visible : "", set && *set);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  return c10::Device(c10::kCPU);
}

void check_local_rank(int64_t local_rank, int64_t device_count, const std::string& visible_devices,
                      bool local_rank_set) {
  if (local_rank >= 0 && local_rank < device_count) return;
  const std::string visible = fmt::format(
      "{} CUDA device{} {} visible{}", device_count, device_count == 1 ? "" : "s", device_count == 1 ? "is" : "are",
      visible_devices.empty() ? "" : " (CUDA_VISIBLE_DEVICES=" + visible_devices + ")");
  const std::string more = visible_devices.empty() ? "" : ", or list more devices in CUDA_VISIBLE_DEVICES";
  if (local_rank_set)
    throw ConfigError(fmt::format("LOCAL_RANK={} but only {}: each rank uses the CUDA device numbered by its "
                                  "LOCAL_RANK, so start at most {} rank{} per node (torchrun --nproc-per-node={}){}",
                                  local_rank, visible, device_count, device_count == 1 ? "" : "s", device_count, more));
  throw ConfigError(fmt::format("LOCAL_RANK is not set, so this rank took its RANK={} as its CUDA device number "
                                "(right when every rank runs on one node), but only {}: on several nodes have the "
                                "launcher set LOCAL_RANK (torchrun does); on one, start at most {} rank{}{}",
                                local_rank, visible, device_count, device_count == 1 ? "" : "s", more));
}

at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  if (!device.is_cuda()) return t.to(device);
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

void set_tf32(bool on) {
  // The float32 matmul precision ("high": TF32, "highest": IEEE fp32) and cuDNN's allow_tf32 flag: these
  // setters keep LibTorch's per-backend settings (Context::float32Precision) in step with them, so both
  // ways of reading them agree (set through the per-backend setters alone, the older getters refuse
  // to answer: "mix of the legacy and new APIs").
  auto& ctx = at::globalContext();
  ctx.setFloat32MatmulPrecision(on ? "high" : "highest");
  ctx.setAllowTF32CuDNN(on);
}

bool tf32_matmuls() {
  return at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
         at::Float32Precision::TF32;
}

void end_step(c10::Device device) {
  if (device.type() != c10::kLazy) return;
  const auto backend = torch::lazy::atenDeviceToBackendDevice(device);
  auto* executor = torch::lazy::LazyGraphExecutor::Get();
  executor->SyncLiveTensorsGraph(&backend, /*devices=*/{}, /*wait=*/true);
  executor->MarkStep(backend);
}

}  // namespace sl::device
