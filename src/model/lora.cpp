// LoRA adapters (see lora.h).
#include "model/lora.h"

#include <ATen/ATen.h>

#include "model/linear.h"

namespace sl::model {

std::vector<torch::Tensor> LoraAdapter::params() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : pieces) out.insert(out.end(), {p.A, p.B});
  return out;
}

torch::Tensor LoraAdapter::delta(const torch::Tensor& x) const {
  const bool training = owner != nullptr && owner->is_training();
  const auto d = training && dropout > 0.0 ? at::dropout(x, dropout, true) : x;
  std::vector<torch::Tensor> As;
  for (const auto& p : pieces) As.push_back(p.A);
  const auto u = model::linear(d, As.size() == 1 ? As[0] : at::cat(As, 0));  // (.., sum r)
  const int64_t r = pieces.front().A.size(0);
  std::vector<torch::Tensor> columns;
  int64_t at_row = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    auto v = model::linear(u.narrow(-1, static_cast<int64_t>(i) * r, r), p.B) * scale;  // (.., rows)
    if (p.row0 > at_row) {
      auto shape = v.sizes().vec();
      shape.back() = p.row0 - at_row;
      columns.push_back(at::zeros(shape, v.options()));
    }
    columns.push_back(v);
    at_row = p.row0 + p.rows;
  }
  if (at_row < out_features) {
    auto shape = columns.back().sizes().vec();
    shape.back() = out_features - at_row;
    columns.push_back(at::zeros(shape, columns.back().options()));
  }
  return columns.size() == 1 ? columns[0] : at::cat(columns, -1);
}

torch::Tensor LoraAdapter::linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) const {
  return add_to(model::linear(x, W, b), x);
}

torch::Tensor LoraAdapter::weight_delta(int64_t in_features) const {
  auto w = at::zeros({out_features, in_features}, at::kFloat);
  for (const auto& p : pieces) {
    const auto A = p.A.detach().to(at::kCPU, at::kFloat), B = p.B.detach().to(at::kCPU, at::kFloat);
    w.narrow(0, p.row0, p.rows).copy_(at::mm(B, A) * scale);
  }
  return w;
}

}  // namespace sl::model
