#include "train/peak_flops.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include "config/shape.h"
#include "log/clock.h"
#include "model/linear.h"
#include "precision/autocast.h"

namespace sl::train {
namespace {

struct Datasheet {
  const char* name_part;  // matched as a substring of the device name; the first match wins
  double bf16_tflops, fp16_tflops, fp32_tflops;  // 0: no such tensor-core path
};

// Dense peaks (no sparsity) from the vendors' datasheets, TFLOP/s: bf16 and fp16 tensor cores, plain
// fp32 (no TF32; TF32's is half the bf16 column, datasheet_peak). Longer names first, so "H100 PCIe" is
// not taken for an SXM part.
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

}  // namespace

std::optional<double> datasheet_peak(const std::string& device_name, config::Dtype dtype, bool tf32) {
  for (const auto& d : kDatasheets)
    if (device_name.find(d.name_part) != std::string::npos) {
      const bool tensor_core_fp32 = tf32 && dtype == config::Dtype::kFp32 && d.bf16_tflops > 0;
      const double tflops = tensor_core_fp32                ? d.bf16_tflops / 2
                            : dtype == config::Dtype::kFp32 ? d.fp32_tflops
                            : dtype == config::Dtype::kFp16 ? d.fp16_tflops
                                                            : d.bf16_tflops;
      return tflops > 0 ? std::optional<double>(tflops * 1e12) : std::nullopt;
    }
  return std::nullopt;
}

namespace {

// A flat operand of `n` elements in `dtype` on `device`, drawn on the host from `gen`: a generator of
// the measurement's own, so the default generators (the run's dropout stream) are not touched.
torch::Tensor gemm_operand(int64_t n, at::Generator& gen, torch::Device device, c10::ScalarType dtype) {
  return torch::randn({n}, gen, torch::TensorOptions().dtype(torch::kFloat32)).to(device, dtype);
}

// The leading r x c elements of a flat operand, as a matrix.
torch::Tensor leading(const torch::Tensor& flat, int64_t r, int64_t c) { return flat.narrow(0, 0, r * c).view({r, c}); }

// `shape` cut to at most kProbeOperandElems elements per operand: k to 4096, then n, then m.
GemmShape cut(GemmShape s) {
  const int64_t cap = kProbeOperandElems;
  s.k = std::clamp<int64_t>(s.k, 1, 4096);
  s.n = std::clamp<int64_t>(s.n, 1, cap / s.k);
  s.m = std::clamp<int64_t>(s.m, 1, std::min(cap / s.k, cap / s.n));
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

nlohmann::json GemmProbe::to_json() const {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& s : shapes) list.push_back({s.m, s.k, s.n});
  return {{"shapes_mkn", list}, {"products", products}, {"seconds", seconds}, {"threads", threads},
          {"best_shape_mkn", {best.m, best.k, best.n}}};
}

std::vector<GemmShape> model_gemm_shapes(const config::ModelConfig& m, int64_t rows) {
  const int64_t d = m.n_embd, v = m.padded_vocab();  // the LM head multiplies the padded table
  std::vector<GemmShape> shapes = {{rows, d, 3 * d}, {rows, d, d}, {rows, d, v}, {rows, 3 * d, d}, {rows, v, d},
                                   {d, rows, 3 * d}};
  const config::Shape shape(m);
  for (int64_t layer = 0; layer < std::max<int64_t>(1, m.n_layer); ++layer) {
    const int64_t h = shape.hidden(layer);
    const int64_t up = shape.llama ? 2 * h : h;  // SwiGLU's [gate; up] in one product
    shapes.insert(shapes.end(), {{rows, d, up}, {rows, h, d}, {up, rows, d}});
  }
  return shapes;
}

std::vector<GemmShape> probe_shapes(const std::vector<GemmShape>& model) {
  std::vector<GemmShape> out;
  auto add = [&](const GemmShape& s) {
    if (s.m <= 0 || s.k <= 0 || s.n <= 0) return;
    const GemmShape c = cut(s);
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  add({512, 512, 512});
  add({1024, 1024, 1024});
  for (const auto& s : model) add(s);
  return out;
}

PeakFlops peak_flops(torch::Device device, config::Dtype dtype, double override_tflops,
                     const std::vector<GemmShape>& model_shapes, bool tf32) {
  if (override_tflops > 0.0) return {override_tflops * 1e12, dtype, "logging.peak_tflops", std::nullopt};
  const std::string name = cuda_device_name(device);
  if (!name.empty())
    if (const auto peak = datasheet_peak(name, dtype, tf32)) {
      const bool tensor_cores = dtype == config::Dtype::kFp32 && peak != datasheet_peak(name, dtype, false);  // TF32's
      return {*peak, dtype, fmt::format("datasheet{}: {}", tensor_cores ? " (TF32)" : "", name), std::nullopt};
    }
  GemmProbe probe;
  const double flops =
      measure_gemm_peak(device, precision::scalar_type(dtype), probe_shapes(model_shapes), kProbeWindowS, &probe);
  return {flops, dtype, fmt::format("measured_{}_gemm", dtype.name()), probe};
}

double measure_gemm_peak(torch::Device device, c10::ScalarType dtype, const std::vector<GemmShape>& shapes,
                         double window_s, GemmProbe* report) {
  TORCH_CHECK(!shapes.empty(), "measure_gemm_peak: no shapes");
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/1024);
  // Two operands of kProbeOperandElems elements: every shape's are views of their leading elements.
  const auto a = gemm_operand(kProbeOperandElems, gen, device, dtype),
             b = gemm_operand(kProbeOperandElems, gen, device, dtype);
  auto product = [&](const GemmShape& s) {
    model::mm(leading(a, s.m, s.k), leading(b, s.k, s.n));
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  const auto start = std::chrono::steady_clock::now();
  // Warm-ups, one per shape, as long as the window lasts (a slow GEMM path measures fewer shapes).
  size_t warm = 0;
  while (warm < shapes.size() && (warm == 0 || seconds_since(start) < window_s)) product(shapes[warm++]);
  double best = 0.0;
  GemmProbe probe{shapes, 0, 0.0, at::get_num_threads(), shapes.front()};
  for (size_t i = 0; probe.products == 0 || seconds_since(start) < window_s; i = (i + 1) % warm) {
    const auto t0 = std::chrono::steady_clock::now();
    product(shapes[i]);
    const double rate = shapes[i].flops() / seconds_since(t0);
    if (rate > best) best = rate, probe.best = shapes[i];
    ++probe.products;
  }
  probe.shapes.resize(warm);
  probe.seconds = seconds_since(start);
  if (report) *report = probe;
  return best;
}

double measure_gemm_flops(torch::Device device, c10::ScalarType dtype) {
  return measure_gemm_peak(device, dtype, {{1024, 1024, 1024}});
}

PeakTracker::PeakTracker(PeakFlops initial) : initial_(std::move(initial)), flops_(initial_.flops) {}

bool PeakTracker::observe(double achieved_flops, int64_t step) {
  if (!(achieved_flops > flops_) || !std::isfinite(achieved_flops)) return false;
  flops_ = achieved_flops;
  raised_at_ = step;
  ++raises_;
  return true;
}

double PeakTracker::utilisation(double flops) const { return flops_ > 0.0 ? flops / flops_ : 0.0; }

std::string PeakTracker::source() const {
  return raised_at_ ? fmt::format("{}, raised by step {}", initial_.source, *raised_at_) : initial_.source;
}

std::string peak_raised_message(const PeakTracker& tracker, double previous_flops) {
  return fmt::format("step {} ran at {:.3g} FLOP/s per device, above the peak FLOP/s for MFU {:.3g} ({}): that peak "
                     "was underestimated, so it is raised to the step's rate and MFU is counted against it from here "
                     "on (summary.json: model.peak_flops); set logging.peak_tflops to the device's peak to fix it",
                     tracker.raised_at().value_or(0), tracker.flops(), previous_flops, tracker.initial().source);
}

}  // namespace sl::train
