// The MFU denominator: the device's peak FLOP/s in the run's compute dtype (fp32, bf16 or fp16).
// logging.peak_tflops overrides; on CUDA a table of datasheet dense peaks by device name; otherwise
// (any CPU, an unknown GPU) a measured GEMM rate in that dtype.
#pragma once
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>
#include <torch/types.h>

namespace sl::train {

struct PeakFlops {
  double flops = 0.0;    // per device, FLOP/s
  std::string dtype;     // "fp32", "bf16" or "fp16": the compute dtype it is the peak of
  std::string source;    // "logging.peak_tflops", "datasheet: <device name>", "measured_<dtype>_gemm"
};

// Dense tensor-core (bf16/fp16) or plain fp32 (no TF32: PyTorch's default for fp32 matmuls) peak of
// a CUDA device from its name (e.g. "NVIDIA H100 80GB HBM3"), in FLOP/s; nullopt when not in the table.
std::optional<double> datasheet_peak(const std::string& device_name, const std::string& dtype);

// `override_tflops` > 0 (logging.peak_tflops) wins; then the datasheet (CUDA); then a measured rate.
PeakFlops peak_flops(torch::Device device, const std::string& dtype, double override_tflops);

// Best of a few 1024^3 matmuls in `dtype` on `device`, FLOP/s, by the GEMM the model's linears take
// (model::mm: fp32 GEMMs on widened operands where a CPU has no GEMM of its own for the dtype). Its operands come from a generator of
// its own: measuring never draws from the default generators, so it leaves a run's dropout stream as
// it was.
double measure_gemm_flops(torch::Device device, c10::ScalarType dtype = c10::kFloat);

}  // namespace sl::train
