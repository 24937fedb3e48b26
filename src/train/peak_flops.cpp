#include "train/peak_flops.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include "log/clock.h"
#include "model/linear.h"

namespace sl::train {
namespace {

struct Datasheet {
  const char* name_part;  // matched as a substring of the device name; the first match wins
  double bf16_tflops, fp16_tflops, fp32_tflops;  // 0: no such tensor-core path
};

// Dense peaks (no sparsity) from the vendors' datasheets, TFLOP/s: bf16 and fp16 tensor cores, plain
// fp32 (no TF32). Longer names first, so "H100 PCIe" is not taken for an SXM part.
const std::vector<Datasheet> kDatasheets = {
    {"H100 PCIe", 756, 756, 51},     {"H100 NVL", 835, 835, 60},   {"H100", 989, 989, 67},
    {"H200", 989, 989, 67},          {"H800", 989, 989, 67},       {"GH200", 989, 989, 67},
    {"B200", 2250, 2250, 80},        {"A100", 312, 312, 19.5},     {"A800", 312, 312, 19.5},
    {"L40S", 362, 362, 91.6},        {"L40", 181, 181, 90.5},      {"L4", 121, 121, 30.3},
    {"A10G", 70, 70, 31.2},          {"A10", 125, 125, 31.2},      {"RTX 4090", 165.2, 165.2, 82.6},
    {"RTX 3090", 71, 71, 35.6},      {"A6000", 155, 155, 38.7},    {"V100", 0, 125, 15.7},
};

std::string cuda_device_name(torch::Device device) {
  if (!device.is_cuda()) return "";
  return at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
}

c10::ScalarType scalar_type(const std::string& dtype) {
  return dtype == "bf16" ? c10::kBFloat16 : dtype == "fp16" ? c10::kHalf : c10::kFloat;
}

}  // namespace

std::optional<double> datasheet_peak(const std::string& device_name, const std::string& dtype) {
  for (const auto& d : kDatasheets)
    if (device_name.find(d.name_part) != std::string::npos) {
      const double tflops = dtype == "fp32" ? d.fp32_tflops : dtype == "fp16" ? d.fp16_tflops : d.bf16_tflops;
      return tflops > 0 ? std::optional<double>(tflops * 1e12) : std::nullopt;
    }
  return std::nullopt;
}

PeakFlops peak_flops(torch::Device device, const std::string& dtype, double override_tflops) {
  if (override_tflops > 0.0) return {override_tflops * 1e12, dtype, "logging.peak_tflops"};
  const std::string name = cuda_device_name(device);
  if (!name.empty())
    if (const auto peak = datasheet_peak(name, dtype)) return {*peak, dtype, "datasheet: " + name};
  return {measure_gemm_flops(device, scalar_type(dtype)), dtype, "measured_" + dtype + "_gemm"};
}

namespace {

// An n x n operand in `dtype` on `device`, drawn on the host from `gen`: a generator of the
// measurement's own, so the default generators (the run's dropout stream) are not touched.
torch::Tensor gemm_operand(int64_t n, at::Generator& gen, torch::Device device, c10::ScalarType dtype) {
  return torch::randn({n, n}, gen, torch::TensorOptions().dtype(torch::kFloat32)).to(device, dtype);
}

}  // namespace

double measure_gemm_flops(torch::Device device, c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  const int64_t n = 1024;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/1024);
  auto a = gemm_operand(n, gen, device, dtype), b = gemm_operand(n, gen, device, dtype);
  auto wait = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  auto c = model::mm(a, b);  // warm-up
  wait();
  double best_ms = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    c = model::mm(a, b);
    wait();
    best_ms = std::min(best_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(n * n * n) / (best_ms * 1e-3);
}

}  // namespace sl::train
