// Causal attention kernels side by side: SDPA (ATen's CPU flash kernels) and the fused kernel
// (src/model/attention.cpp), forward and forward + backward, interleaved, on q, k, v as views of one
// QKV buffer (the model's layout). A benchmark, not a test.
//   build/bench_attention [B nh T hd threads reps]   (default: the l12 recipe, 8 4 256 64 2 30)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "model/attention.h"

namespace {

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double time_ms(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, int64_t dflt) { return argc > i ? std::atoll(argv[i]) : dflt; };
  const int64_t B = arg(1, 8), nh = arg(2, 4), T = arg(3, 256), hd = arg(4, 64), reps = arg(6, 30);
  torch::set_num_threads(static_cast<int>(arg(5, 2)));
  const int64_t C = nh * hd;
  auto qkv = torch::randn({B, T, 3 * C}).requires_grad_(true);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
  auto sdpa = [&] {
    auto p = qkv.split(C, 2);
    auto y = at::scaled_dot_product_attention(heads(p[0]), heads(p[1]), heads(p[2]), std::nullopt, 0.0, true);
    return y.transpose(1, 2).contiguous().view({B, T, C});
  };
  auto fused = [&] {
    auto p = qkv.split(C, 2);
    return sl::model::causal_attention(heads(p[0]), heads(p[1]), heads(p[2]));
  };
  const auto dy = torch::randn({B, T, C});
  std::vector<double> f_sdpa, f_fused, fb_sdpa, fb_fused;
  for (int64_t r = 0; r < reps + 3; ++r) {
    const bool keep = r >= 3;  // 3 warm-up rounds
    {
      torch::NoGradGuard no_grad;
      const double a = time_ms([&] { sdpa(); }), b = time_ms([&] { fused(); });
      if (keep) f_sdpa.push_back(a), f_fused.push_back(b);
    }
    const double c = time_ms([&] { torch::autograd::grad({sdpa()}, {qkv}, {dy}); });
    const double d = time_ms([&] { torch::autograd::grad({fused()}, {qkv}, {dy}); });
    if (keep) fb_sdpa.push_back(c), fb_fused.push_back(d);
  }
  std::printf("B %lld nh %lld T %lld hd %lld, %d threads, median of %lld\n", static_cast<long long>(B),
              static_cast<long long>(nh), static_cast<long long>(T), static_cast<long long>(hd),
              torch::get_num_threads(), static_cast<long long>(reps));
  std::printf("| kernel | forward ms | forward + backward ms |\n|---|---|---|\n");
  std::printf("| SDPA (ATen flash) | %.2f | %.2f |\n", median_ms(f_sdpa), median_ms(fb_sdpa));
  std::printf("| fused | %.2f | %.2f |\n", median_ms(f_fused), median_ms(fb_fused));
  return 0;
}
