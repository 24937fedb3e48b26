// The MFU denominator: the device's peak FLOP/s in the run's compute dtype (fp32, bf16 or fp16).
// logging.peak_tflops overrides; on CUDA a table of datasheet dense peaks by device name; otherwise
// (any CPU, an unknown GPU) the best rate of GEMMs in that dtype at several shapes, the model's own
// among them, measured over a window at the run's intra-op thread count. A step that still runs
// faster than the peak raises it (PeakTracker), so no utilisation exceeds 1.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "config/config.h"

namespace sl::train {

// A product a (m, k) @ b (k, n).
struct GemmShape {
  int64_t m = 0, k = 0, n = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n); }
  bool operator==(const GemmShape&) const = default;
};

// What the measured peak was measured on (summary.json's model.peak_flops_probe).
struct GemmProbe {
  std::vector<GemmShape> shapes;  // as run (probe_shapes)
  int64_t products = 0;           // timed products, warm-ups not counted
  double seconds = 0.0;           // the whole probe, warm-ups included
  int threads = 0;                // ATen's intra-op threads it ran on: the run's
  GemmShape best;                 // the shape of the fastest product
  nlohmann::json to_json() const;
};

struct PeakFlops {
  double flops = 0.0;    // per device, FLOP/s
  config::Dtype dtype;   // the compute dtype it is the peak of
  std::string source;    // "logging.peak_tflops", "datasheet: <device name>", "measured_<dtype>_gemm"
  std::optional<GemmProbe> probe;  // set when measured
};

// Dense tensor-core (bf16/fp16) or plain fp32 peak of a CUDA device from its name (e.g. "NVIDIA H100
// 80GB HBM3"), in FLOP/s; nullopt when not in the table. `tf32` (fp32 only: precision.tf32 on): the TF32
// tensor-core peak instead, half the bf16 one on every part that has both (Ampere, Ada, Hopper,
// Blackwell datasheets); a part without TF32 (V100) keeps its plain fp32 peak, as its matmuls do.
std::optional<double> datasheet_peak(const std::string& device_name, config::Dtype dtype, bool tf32 = false);

// The matmuls of a training step of `model` over `rows` = micro_batch x seq_len tokens: the forward
// products of the attention (qkv, output projection), the MLP (up, down) and the LM head, the input
// gradients of qkv and the head, and the weight gradients of qkv and the MLP's up projection (k = rows).
std::vector<GemmShape> model_gemm_shapes(const config::ModelConfig& model, int64_t rows);

// The shapes the probe runs: 512^3 and 1024^3, then `model`'s, each cut to at most kProbeOperandElems
// elements per operand (k first to 4096, then n, then m; so at most 2 x 1024^3 FLOPs a product, and
// 12 MiB of fp32 operands at once, as much as one 1024^3 product), duplicates dropped, order kept.
constexpr int64_t kProbeOperandElems = int64_t{1} << 20;
std::vector<GemmShape> probe_shapes(const std::vector<GemmShape>& model);

// `override_tflops` > 0 (logging.peak_tflops) wins; then the datasheet (CUDA; `tf32`: fp32 matmuls take
// TF32, device::tf32_matmuls, so an fp32 run's peak is the TF32 one, source "datasheet (TF32): <name>");
// then the best of measure_gemm_peak over probe_shapes(model_shapes), which takes TF32 where it is on.
PeakFlops peak_flops(torch::Device device, config::Dtype dtype, double override_tflops,
                     const std::vector<GemmShape>& model_shapes = {}, bool tf32 = false);

// The best FLOP/s of `shapes` in `dtype` on `device`, by the GEMM the model's linears take (model::mm:
// fp32 GEMMs on widened operands where a CPU has no GEMM of its own for the dtype), on ATen's
// intra-op threads as they are set. Each shape once as a warm-up, then round robin (so a change of the
// machine's clock or load during the window reaches every shape alike) until `window_s` has passed,
// at least one timed product. Its operands come from a generator of its own: measuring never draws
// from the default generators, so it leaves a run's dropout stream as it was.
constexpr double kProbeWindowS = 0.5;
double measure_gemm_peak(torch::Device device, c10::ScalarType dtype, const std::vector<GemmShape>& shapes,
                         double window_s = kProbeWindowS, GemmProbe* report = nullptr);

// measure_gemm_peak of 1024^3 products alone: a rate for tools without a model (bench/kernels.cpp).
double measure_gemm_flops(torch::Device device, c10::ScalarType dtype = c10::kFloat);

// The MFU denominator over a run. It starts at the run's PeakFlops; a step whose achieved FLOP/s per
// device (hardware FLOPs: the model's and what recompute re-runs) exceeds it shows the peak was
// underestimated, and becomes the peak. So every utilisation divided by it, that step's and every
// later one's, is at most 1.
class PeakTracker {
 public:
  explicit PeakTracker(PeakFlops initial = {});
  // One step's achieved FLOP/s per device; returns true when it raised the peak.
  bool observe(double achieved_flops, int64_t step);
  // `flops` (FLOP/s per device) over the current peak: at most 1 for any rate observed.
  double utilisation(double flops) const;
  double flops() const { return flops_; }
  const PeakFlops& initial() const { return initial_; }
  std::optional<int64_t> raised_at() const { return raised_at_; }  // the step of the last raise
  int64_t raises() const { return raises_; }
  // The initial source, and once raised ", raised by step N" (N: the step of the last raise).
  std::string source() const;

 private:
  PeakFlops initial_;
  double flops_ = 0.0;
  std::optional<int64_t> raised_at_;
  int64_t raises_ = 0;
};

// The warning for the first raise: both figures, the step, and what it means.
std::string peak_raised_message(const PeakTracker& tracker, double previous_flops);

}  // namespace sl::train
