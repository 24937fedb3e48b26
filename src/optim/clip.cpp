#include "optim/clip.h"

#include <algorithm>
#include <cmath>

#include <torch/types.h>
#include <torch/utils.h>

#include "kernels/cpu/clones.h"
#include "model/intra_op.h"

namespace sl::optim {
namespace {

constexpr int64_t kPiece = 1 << 15;  // elements per task of the CPU passes

// x's squares summed in fp64 on 16 lanes (element i into lane i % 16: independent vector sums),
// the lanes in a fixed tree. Every multiply and add rounds on its own (this file is built with
// -ffp-contract=off), so both clones give the same bits.
SL_KERNEL_BODY double sum_squares_body(const float* x, int64_t n) {
  double lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += static_cast<double>(x[i + j]) * static_cast<double>(x[i + j]);
  for (int j = 0; i < n; ++i, ++j) lane[j] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}
SL_KERNEL_CLONES(double, sum_squares, (const float* x, int64_t n), (x, n))

// x *= s, one fp32 product per element (ATen's mul_ by an fp32 scalar: the same bits).
SL_KERNEL_BODY void scale_body(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * s;
}
SL_KERNEL_CLONES(void, scale, (float* x, int64_t n, float s), (x, n, s))

bool cpu_fp32_contiguous(const std::vector<torch::Tensor>& grads) {
  for (const auto& g : grads)
    if (!g.device().is_cpu() || g.scalar_type() != torch::kFloat32 || !g.is_contiguous()) return false;
  return true;
}

// min(1, clip / (norm + 1e-6)), or 1 where the norm is not finite: a 0-d tensor beside the norm.
torch::Tensor clip_coefficient(const torch::Tensor& total, double clip) {
  const auto coef = torch::clamp(clip / (total + 1e-6), std::nullopt, 1.0);
  return torch::where(torch::isfinite(total), coef, torch::ones_like(coef));
}

torch::Tensor clip_with_aten(const std::vector<torch::Tensor>& grads, double clip) {
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.norm());
  const torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm();
  if (clip > 0.0) {
    const auto safe = clip_coefficient(total, clip);
    for (const auto& g : grads) g.mul_(safe);
  }
  return total;
}

// The flat pieces of `grads` (contiguous fp32 CPU tensors).
struct Pieces {
  std::vector<float*> data;
  std::vector<model::ArrayPiece> pieces;
  explicit Pieces(const std::vector<torch::Tensor>& grads) {
    std::vector<int64_t> sizes;
    for (const auto& g : grads) sizes.push_back(g.numel()), data.push_back(g.data_ptr<float>());
    pieces = model::pieces_of_arrays(sizes, kPiece);
  }
  float* begin(const model::ArrayPiece& p) const { return data[p.array] + p.begin; }
};

double sum_of_squares_of(const Pieces& all) {
  std::vector<double> partial(all.pieces.size());
  model::for_each_index(static_cast<int64_t>(all.pieces.size()), [&](int64_t i, int) {
    partial[i] = sum_squares(all.begin(all.pieces[i]), all.pieces[i].size);
  });
  double sq = 0.0;
  for (const double s : partial) sq += s;  // piece order
  return sq;
}

torch::Tensor clip_on_cpu(const std::vector<torch::Tensor>& grads, double clip) {
  const Pieces all(grads);
  const double sq = sum_of_squares_of(all);
  const float norm = static_cast<float>(std::sqrt(sq));
  if (clip > 0.0) {
    // clip_coefficient's formula in fp64, rounded once (no tensor to read back: tests count host
    // reads); ATen's fp32 steps there may give an ulp more or less.
    const float s =
        std::isfinite(norm) ? static_cast<float>(std::min(1.0, clip / (static_cast<double>(norm) + 1e-6))) : 1.0f;
    if (s != 1.0f)
      model::for_each_index(static_cast<int64_t>(all.pieces.size()), [&](int64_t i, int) {
        scale(all.begin(all.pieces[i]), all.pieces[i].size, s);
      });
  }
  return torch::full({}, norm, torch::kFloat32);
}

}  // namespace

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double clip) {
  if (grads.empty()) return {};
  torch::NoGradGuard no_grad;
  return cpu_fp32_contiguous(grads) ? clip_on_cpu(grads, clip) : clip_with_aten(grads, clip);
}

std::optional<double> sum_of_squares(const std::vector<torch::Tensor>& grads) {
  if (!cpu_fp32_contiguous(grads)) return std::nullopt;
  return sum_of_squares_of(Pieces(grads));
}

}  // namespace sl::optim
