// The fused CPU kernels against what ATen runs in their place, interleaved, medians of `reps` runs.
// A benchmark, not a test.
//   attention: SDPA (ATen's CPU flash kernels) on q, k, v split from one QKV buffer (the model's layout),
//              the fused kernel on the same views (src/model/attention.cpp), and its packed form on the
//              QKV buffer itself (one gradient, no split and concatenation);
//   GELU:      ATen's gelu(x, tanh), the fused gelu_tanh (src/model/gelu.cpp), and for the fc bias ATen's
//              x + b, gelu and b's gradient (a column sum) against the fused gelu_tanh_bias.
//   Both in fp32, then in bf16 (the kernels' bf16 forms against ATen's bf16 kernels: precision.compute
//   bf16 on the CPU).
//   LayerNorm: ATen's fp32 layer_norm and autocast's cast of its output to bf16 against the fused
//              layer_norm_bf16 (src/model/layernorm.cpp), on (B T, nh hd).
//   allocator: the tracking CPU allocator's cost (src/memory/tracking_allocator.h): nanoseconds per
//              allocate + free against LibTorch's default allocator, times the allocations of one
//              forward + backward of the l12 model, as a share of that step's time. (Timing the step
//              with and without tracking cannot resolve 2 % on a noisy machine; this can.)
//   model:     the l12 model's forward + backward under bf16 autocast outside the trainer (no optimizer,
//              data or logging), each step right after 0.5 s of 1024^3 bf16 products (the best of them is
//              the bf16 GEMM peak): the model's own share of that peak, the bound on the trainer's `none`
//              figure (docs/precision.md). Only where oneDNN multiplies bf16 natively (elsewhere a bf16
//              a@b takes seconds).
//   build/bench_kernels [B nh T hd threads reps]   (default: the l12 recipe, 8 4 256 64 2 30; GELU on
//                                                   (B T, 4 nh hd))
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "config/config.h"
#include "device/cpu_features.h"
#include "memory/tracking_allocator.h"
#include "model/attention.h"
#include "model/gelu.h"
#include "model/layernorm.h"
#include "model/gpt.h"
#include "precision/autocast.h"
#include "train/peak_flops.h"
#include "train/trainer.h"

namespace {

using namespace sl;

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double time_ms(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// A kernel's forward (no autograd) and forward + backward (gradients of `wrt` for upstream dy).
struct Candidate {
  std::string name;
  std::function<torch::Tensor()> run;
  std::vector<double> fwd, fwd_bwd;
  bool fp32_products = false;  // bf16 attention on fp32 products where AVX512-BF16 would run (model/attention.h)
};

void time_interleaved(std::vector<Candidate>& cs, const std::vector<torch::Tensor>& wrt, const torch::Tensor& dy,
                      int64_t reps) {
  for (int64_t r = 0; r < reps + 3; ++r) {
    const bool keep = r >= 3;  // 3 warm-up rounds
    for (auto& c : cs) {
      const bool before = sl::model::force_fp32_attention_products(c.fp32_products);
      double f = 0.0;
      {
        torch::NoGradGuard no_grad;
        f = time_ms([&] { c.run(); });
      }
      const double fb = time_ms([&] { torch::autograd::grad({c.run()}, wrt, {dy}); });
      sl::model::force_fp32_attention_products(before);
      if (keep) c.fwd.push_back(f), c.fwd_bwd.push_back(fb);
    }
  }
}

void print_table(const char* title, const std::vector<Candidate>& cs) {
  std::printf("\n%s\n| kernel | forward ms | forward + backward ms |\n|---|---|---|\n", title);
  for (const auto& c : cs) std::printf("| %s | %.2f | %.2f |\n", c.name.c_str(), median_ms(c.fwd), median_ms(c.fwd_bwd));
}

// dtype: fp32, or bf16 (q, k, v, the output and its gradient in bf16: SDPA's bf16 flash kernels against
// the fused kernel's bf16 form).
void bench_attention(int64_t B, int64_t nh, int64_t T, int64_t hd, int64_t reps, torch::Dtype dtype) {
  const int64_t C = nh * hd;
  auto qkv = torch::randn({B, T, 3 * C}).to(dtype).requires_grad_(true);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
  std::vector<Candidate> cs;
  cs.push_back({"SDPA (ATen flash)", [&] {
                  auto p = qkv.split(C, 2);
                  auto y = at::scaled_dot_product_attention(heads(p[0]), heads(p[1]), heads(p[2]), std::nullopt, 0.0, true);
                  return y.transpose(1, 2).contiguous().view({B, T, C});
                }, {}, {}});
  cs.push_back({"fused, q k v split", [&] {
                  auto p = qkv.split(C, 2);
                  return sl::model::causal_attention(heads(p[0]), heads(p[1]), heads(p[2]));
                }, {}, {}});
  cs.push_back({"fused, packed qkv", [&] { return sl::model::causal_attention_packed(qkv, nh); }, {}, {}});
  if (dtype == torch::kBFloat16 && sl::model::bf16_attention_products())
    cs.push_back({"fused, packed qkv, fp32 products (no AVX512-BF16)",
                  [&] { return sl::model::causal_attention_packed(qkv, nh); }, {}, {}, true});
  time_interleaved(cs, {qkv}, torch::randn({B, T, C}).to(dtype), reps);
  print_table(dtype == torch::kBFloat16 ? "causal attention, bf16" : "causal attention", cs);
}

// dtype: fp32, or bf16 (x, y and the gradients in bf16; the bias stays fp32, as the model's fc bias
// parameter does under autocast: ATen's composition takes it cast to bf16, as autocast's addmm would).
void bench_gelu(int64_t rows, int64_t H, int64_t reps, torch::Dtype dtype) {
  auto x = torch::randn({rows, H}).to(dtype).requires_grad_(true);
  auto b = torch::randn({H}).requires_grad_(true);
  const bool bf16 = dtype == torch::kBFloat16;
  std::vector<Candidate> plain, bias;
  plain.push_back({"ATen gelu(x, tanh)", [&] { return at::gelu(x, "tanh"); }, {}, {}});
  plain.push_back({"fused gelu_tanh", [&] { return sl::model::gelu_tanh(x); }, {}, {}});
  const auto dy = torch::randn({rows, H}).to(dtype);
  time_interleaved(plain, {x}, dy, reps);
  print_table(bf16 ? "GELU, bf16" : "GELU", plain);
  bias.push_back({"ATen x + b, gelu, b's column sum", [&] { return at::gelu(x + b.to(dtype), "tanh"); }, {}, {}});
  bias.push_back({"fused gelu_tanh_bias", [&] { return sl::model::gelu_tanh_bias(x, b); }, {}, {}});
  time_interleaved(bias, {x, b}, dy, reps);
  print_table(bf16 ? "GELU with the fc bias, bf16 (fp32 bias)" : "GELU with the fc bias", bias);
}

// LayerNorm of an fp32 stream (rows, C) feeding a bf16 linear, as under CPU autocast: ATen's fp32
// layer_norm and the cast to bf16 (backward: the bf16 gradient widened, then layer_norm's backward)
// against the fused layer_norm_bf16 (src/model/layernorm.h). Both under bf16 autocast.
void bench_layer_norm(int64_t rows, int64_t C, int64_t reps) {
  auto x = torch::randn({rows, C}).requires_grad_(true);
  auto w = torch::randn({C}).requires_grad_(true), b = torch::randn({C}).requires_grad_(true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  std::vector<Candidate> cs;
  cs.push_back({"ATen layer_norm, cast to bf16",
                [&] { return at::layer_norm(x, {C}, w, b, 1e-5).to(torch::kBFloat16); }, {}, {}});
  cs.push_back({"fused layer_norm_bf16", [&] { return sl::model::layer_norm_bf16(x, w, b, 1e-5); }, {}, {}});
  time_interleaved(cs, {x, w, b}, torch::randn({rows, C}).to(torch::kBFloat16), reps);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  print_table("LayerNorm of the fp32 stream into bf16 (under bf16 autocast)", cs);
}

// Median ns of one allocate + free over sizes from 1 KiB to 8 MiB (the spread of a step's tensors).
double alloc_free_ns() {
  const std::vector<int64_t> floats = {256, 4096, 65536, 524288, 2097152};
  std::vector<double> per;
  for (int rep = 0; rep < 9; ++rep) {
    constexpr int kN = 20000;
    const double ms = time_ms([&] {
      for (int i = 0; i < kN; ++i) (void)torch::empty({floats[i % floats.size()]});
    });
    per.push_back(ms * 1e6 / kN);
  }
  return median_ms(per);
}

// The l12 recipe's GPT-2 (12 layers, d 256, 4 heads, vocab 256, context 256), fp32 parameters.
model::GPT l12_model() {
  config::ModelConfig c;
  c.n_layer = 12, c.n_head = 4, c.n_embd = 256, c.vocab_size = 256, c.max_seq_len = 256;
  return model::GPT(c, torch::kCPU);
}

// One forward + backward of the l12 GPT-2 (B 8, T 256): median ms, and allocations per step when
// the tracking allocator is installed.
struct StepCost {
  double ms;
  int64_t allocs;
};

StepCost model_step(model::GPT& gpt, int64_t reps) {
  auto idx = torch::randint(0, 256, {8, 256}, torch::kInt64), targets = torch::randint(0, 256, {8, 256}, torch::kInt64);
  auto& tracker = sl::memory::TrackingCPUAllocator::instance();
  std::vector<double> ms;
  int64_t allocs = 0;
  for (int64_t r = 0; r < reps + 2; ++r) {
    const int64_t before = tracker.num_allocs();
    const double t = time_ms([&] {
      gpt->zero_grad();
      gpt->loss(idx, targets).backward();
    });
    allocs = tracker.num_allocs() - before;
    if (r >= 2) ms.push_back(t);
  }
  return {median_ms(ms), allocs};
}

void bench_allocator(int64_t reps) {
  model::GPT gpt = l12_model();
  const double plain_ns = alloc_free_ns();
  const StepCost plain = model_step(gpt, reps);
  sl::memory::TrackingCPUAllocator::install();  // for the rest of the process
  const double tracked_ns = alloc_free_ns();
  const StepCost tracked = model_step(gpt, reps);
  const double overhead_ms = static_cast<double>(tracked.allocs) * (tracked_ns - plain_ns) * 1e-6;
  std::printf("\ntracking allocator (l12 forward + backward)\n| | default allocator | tracking allocator |\n|---|---|---|\n");
  std::printf("| allocate + free, ns (median, 1 KiB-8 MiB) | %.0f | %.0f |\n", plain_ns, tracked_ns);
  std::printf("| step ms (median of %lld) | %.1f | %.1f |\n", static_cast<long long>(reps), plain.ms, tracked.ms);
  std::printf("allocations per step %lld: tracking adds %.3f ms, %.3f %% of the step\n",
              static_cast<long long>(tracked.allocs), overhead_ms, 100.0 * overhead_ms / plain.ms);
}

// One forward, loss and backward of `gpt` under bf16 autocast (gradients zeroed, not freed, as the
// trainer zeroes them), ms.
double autocast_step_ms(model::GPT& gpt, const torch::Tensor& idx, const torch::Tensor& targets) {
  return time_ms([&] {
    gpt->zero_grad(/*set_to_none=*/false);
    torch::Tensor loss;
    {
      const precision::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);  // the trainer's guard
      loss = gpt->loss(idx, targets);
    }
    loss.backward();
  });
}

// The l12 model (B 8, T 256) under bf16 autocast, outside the trainer: each step right after the
// trainer's own bf16 GEMM rate (train::measure_gemm_flops: the best 1024^3 product over 0.5 s).
// Model FLOPs are the trainer's (train::flops_per_token, the PaLM formula).
void bench_model_bf16(int64_t reps) {
  if (device::cpu_features().linear_path(config::Dtype::kBf16) != device::LowpMatmul::native) {
    std::printf("\nl12 model, bf16, outside the trainer: skipped (no native bf16 GEMM on this CPU)\n");
    return;
  }
  model::GPT gpt = l12_model();
  const int64_t B = 8, T = 256;
  const auto idx = torch::randint(0, 256, {B, T}, torch::kInt64), targets = torch::randint(0, 256, {B, T}, torch::kInt64);
  const double step_flops = train::flops_per_token(*gpt, T) * static_cast<double>(B * T);
  std::vector<double> steps, peaks, fractions;
  for (int64_t r = 0; r < reps + 2; ++r) {
    const double peak = train::measure_gemm_flops(torch::kCPU, torch::kBFloat16);
    const double ms = autocast_step_ms(gpt, idx, targets);
    if (r < 2) continue;  // warm-up
    steps.push_back(ms), peaks.push_back(peak), fractions.push_back(step_flops / (ms * 1e-3) / peak);
  }
  const double fastest = *std::min_element(steps.begin(), steps.end());
  const double highest = *std::max_element(peaks.begin(), peaks.end());
  std::printf("\nl12 model, bf16 autocast, forward + backward outside the trainer (%lld steps, %.1f GFLOP each)\n",
              static_cast<long long>(steps.size()), step_flops * 1e-9);
  std::printf("| fastest step ms | median step ms | bf16 1024^3 peak GFLOP/s (highest) | fastest step / highest peak | "
              "step / the peak read before it (median) |\n|---|---|---|---|---|\n");
  std::printf("| %.1f | %.1f | %.1f | %.3f | %.3f |\n", fastest, median_ms(steps), highest * 1e-9,
              step_flops / (fastest * 1e-3) / highest, median_ms(fractions));
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, int64_t dflt) { return argc > i ? std::atoll(argv[i]) : dflt; };
  const int64_t B = arg(1, 8), nh = arg(2, 4), T = arg(3, 256), hd = arg(4, 64), reps = arg(6, 30);
  torch::set_num_threads(static_cast<int>(arg(5, 2)));
  std::printf("B %lld nh %lld T %lld hd %lld, %d threads, median of %lld\n", static_cast<long long>(B),
              static_cast<long long>(nh), static_cast<long long>(T), static_cast<long long>(hd),
              torch::get_num_threads(), static_cast<long long>(reps));
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    bench_attention(B, nh, T, hd, reps, dtype);
    bench_gelu(B * T, 4 * nh * hd, reps, dtype);
  }
  bench_layer_norm(B * T, nh * hd, reps);
  bench_allocator(std::max<int64_t>(reps / 3, 3));
  bench_model_bf16(std::max<int64_t>(reps / 2, 5));
  return 0;
}
