// The fused CUDA kernels (src/kernels/, through model/layernorm.h, residual.h and gelu.h on CUDA
// tensors) against ATen's composition on the same GPU: values and gradients, odd and even widths,
// two runs bitwise equal, and a GPT-2 model's loss and gradients under bf16 autocast against the same
// model on ATen's kernels. [cuda] cases only (ctest entry cuda_kernels_cuda; bench/gpu.sh runs them on
// a lent GPU); without a CUDA device, or in a build without the CUDA kernels, each skips, reported.
//
// Notation for the bounds: u = 2^-24 (fp32's unit roundoff). A sum of n fp32 terms, each rounded
// once, is within (depth) u sum|t| of the exact sum, depth being the longest chain of additions a term
// goes through (Higham, Accuracy and Stability, 4.2). The kernels' sums: a row of C columns is split
// over 256 threads (ceil(C / 256) additions each), then a butterfly of 5 levels over lanes and 5 over
// warps: depth ceil(C / 256) + 10. A column over rows: pieces of 32 rows in order, then the P pieces in
// order: depth 32 + P. The references are ATen's compositions evaluated in fp64 (the fp32 or bf16
// inputs widened exactly), so the bound is our arithmetic's alone; a bf16 output is compared with
// ATen's fp32 result rounded to bf16: they differ only where that value and ours (a few u apart) sit on
// either side of a rounding boundary, by one bf16 ulp.
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include <torch/cuda.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "model/cuda_fused.h"
#include "model/gelu.h"
#include "model/gpt.h"
#include "model/layernorm.h"
#include "model/residual.h"
#include "precision/autocast.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;

namespace {

constexpr double kU = 0x1p-24;
// Widths: GPT-2 124M's C, LLaMA 1B's C, one neither a multiple of 4 nor of 256, and 4096 + 3.
const std::vector<int64_t> kWidths = {768, 2048, 1000, 4099};
// 2 x 37 rows: two whole pieces of 32 rows and a partial one.
constexpr int64_t kBatch = 2, kSeq = 37;

// Skips the case without a CUDA device; with one, a build without the CUDA kernels fails (its skip would
// pass a GPU run that never ran them). A macro, as SUBLINEAR_SKIP ends the case.
#define REQUIRE_CUDA_KERNELS()                                                                            \
  do {                                                                                                    \
    if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");                              \
    if (!model::kCudaKernels)                                                                             \
      FAIL("a CUDA device is here but this build has no CUDA kernels: rebuild where CMake finds a CUDA "   \
           "compiler, with -DSUBLINEAR_CUDA_KERNELS=ON (trainer --version: CUDA kernels: yes)");           \
  } while (0)

using model::cuda::Kernel;

// How many times wrapper k (model/cuda_fused.h) ran while f ran: the fused path taken, not ATen's.
template <class F>
int64_t launches_during(Kernel k, F&& f) {
  const int64_t before = model::cuda::launches(k);
  std::forward<F>(f)();
  return model::cuda::launches(k) - before;
}

torch::Tensor f64(const torch::Tensor& t) { return t.detach().to(torch::kCPU).to(torch::kDouble); }

// One bf16 ulp at |x|: 2^(e - 8) for |x| in [2^(e-1), 2^e); below 2^-126 that of 2^-126.
torch::Tensor bf16_ulp(const torch::Tensor& x) {
  const auto [mantissa, exponent] = torch::frexp(f64(x).abs().clamp_min(std::ldexp(1.0, -126)));
  return torch::ldexp(torch::ones_like(mantissa), exponent - 8);
}

// Every element of `got` within `tol` (fp64, broadcast) of `ref`.
bool within(const torch::Tensor& got, const torch::Tensor& ref, const torch::Tensor& tol) {
  return (f64(got) - f64(ref)).abs().le(tol).all().item<bool>();
}

// bf16 `got` against ATen's fp32 value rounded to bf16: within one ulp everywhere, and at most 1 % of
// the elements apart at all (those near a rounding boundary).
void check_rounded_like(const torch::Tensor& got, const torch::Tensor& aten_fp32) {
  REQUIRE(got.scalar_type() == torch::kBFloat16);
  const auto ref = aten_fp32.detach().to(torch::kBFloat16);
  const auto differ = got.ne(ref).sum().item<int64_t>();
  INFO(differ << " of " << got.numel() << " differ from ATen's rounded");
  CHECK((f64(got) - f64(ref)).abs().le(bf16_ulp(ref)).all().item<bool>());
  CHECK(differ * 100 <= got.numel());
}

// The column sum bound over rows: (32 + P) u sum_r |t_rj| (+ the terms' own errors, passed in).
torch::Tensor column_bound(const torch::Tensor& abs_terms, int64_t rows) {
  const double pieces = static_cast<double>((rows + 31) / 32);
  return (32 + pieces) * kU * abs_terms.reshape({rows, -1}).sum(0);
}

// While alive, the fused kernels are forced off (ATen's compositions everywhere); restores the setting.
class AtenKernels {
 public:
  AtenKernels() : before_(device::force_aten_kernels(true)) {}
  ~AtenKernels() { device::force_aten_kernels(before_); }
  AtenKernels(const AtenKernels&) = delete;
  AtenKernels& operator=(const AtenKernels&) = delete;

 private:
  bool before_;
};

torch::Tensor leaf(const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// ---- LayerNorm ----

struct NormRun {
  torch::Tensor y, dx, dw, db;
};

NormRun fused_norm(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& dy) {
  auto x = leaf(x0), w = leaf(w0), b = b0.defined() ? leaf(b0) : torch::Tensor();
  torch::Tensor y;
  {
    const precision::AutocastGuard autocast(c10::kCUDA, c10::kBFloat16);
    REQUIRE(model::layer_norm_bf16_fused(x, w, b));
    y = model::layer_norm_bf16(x, w, b, 1e-5);
  }
  y.backward(dy);
  return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

// dx's bound per element (fp64, the reference's quantities; see the file's notation). dx = rstd (gw -
// A - xhat B), A = mean(gw), B = mean(gw xhat). A and B are row sums of depth d = ceil(C / 256) + 10
// over terms rounded up to 3 times; the mean moves xhat by (d + 1) u rstd mean|x|, rstd is off by
// (d + 6) u relative, xhat by 4 u relative more; each of dx's 4 operations rounds once. Every term
// below is one of these errors times its factor in dx, with K = 4 (d + 8) covering each count.
torch::Tensor norm_dx_bound(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dy, const torch::Tensor& dx) {
  const int64_t C = x.size(-1);
  const double d = std::ceil(static_cast<double>(C) / 256.0) + 10, K = 4 * (d + 8);
  const auto X = f64(x), g = f64(dy), W = f64(w);
  const auto mean = X.mean(-1, true), rstd = (X.var(-1, false, true) + 1e-5).rsqrt();
  const auto xhat = (X - mean) * rstd, gw = g * W;
  const auto B = (gw * xhat).mean(-1, true);
  const auto xhat_err = rstd * X.abs().mean(-1, true) + xhat.abs();
  return K * kU *
         (rstd * (gw.abs() + gw.abs().mean(-1, true) + xhat.abs() * (gw * xhat).abs().mean(-1, true) +
                  xhat_err * B.abs()) +
          f64(dx).abs());
}

// fp64 reference: ATen's layer_norm on the widened inputs, its gradients from the widened bf16 dy.
NormRun reference_norm(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& dy) {
  auto x = leaf(f64(x0)), w = leaf(f64(w0)), b = b0.defined() ? leaf(f64(b0)) : torch::Tensor();
  auto y = at::layer_norm(x, {x.size(-1)}, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, 1e-5);
  y.backward(f64(dy));
  return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

void check_norm(int64_t C, bool with_bias) {
  CAPTURE(C, with_bias);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const auto x0 = torch::randn({kBatch, kSeq, C}, cuda) * 3 + 0.5;
  const auto w0 = torch::randn({C}, cuda), b0 = with_bias ? torch::randn({C}, cuda) : torch::Tensor();
  const auto dy = torch::randn({kBatch, kSeq, C}, cuda).to(torch::kBFloat16);
  const auto got = fused_norm(x0, w0, b0, dy);
  // Values: ATen's fp32 layer_norm (as autocast runs it) rounded to bf16.
  const auto aten = at::layer_norm(x0, {C}, w0, with_bias ? std::optional<at::Tensor>(b0) : std::nullopt, 1e-5);
  check_rounded_like(got.y, aten);
  const auto ref = reference_norm(x0, w0, b0, dy);
  CHECK(within(got.dx, ref.dx, norm_dx_bound(x0, w0, dy, ref.dx)));
  // dw sums dy xhat over rows: terms off by xhat's error (norm_dx_bound's xhat_err, K = 4 (d + 8)).
  const int64_t rows = kBatch * kSeq;
  const double d = std::ceil(static_cast<double>(C) / 256.0) + 10;
  const auto X = f64(x0), g = f64(dy);
  const auto rstd = (X.var(-1, false, true) + 1e-5).rsqrt(), mean = X.mean(-1, true);
  const auto xhat_abs = ((X - mean) * rstd).abs() + rstd * X.abs().mean(-1, true);
  CHECK(within(got.dw, ref.dw, column_bound(g.abs() * xhat_abs, rows) + 4 * (d + 8) * kU * (g.abs() * xhat_abs).reshape({rows, C}).sum(0)));
  if (with_bias) CHECK(within(got.db, ref.db, column_bound(g.abs(), rows)));  // exact terms: the sum's bound
  if (!with_bias) CHECK_FALSE(got.db.defined());
  const auto again = fused_norm(x0, w0, b0, dy);  // deterministic: the same bits
  CHECK(torch::equal(again.y, got.y));
  CHECK(torch::equal(again.dx, got.dx));
  CHECK(torch::equal(again.dw, got.dw));
  if (with_bias) CHECK(torch::equal(again.db, got.db));
}

// The bf16 stream (bf16 x, w, b: the compute copies of precision.param_dtype bf16). The kernels widen
// x, w, b exactly and run the fp32 stream's arithmetic on them, so against the fp64 reference on the
// same widened values each fp32 result v has the fp32 stream's bound e (norm_dx_bound; for dw and db
// the column bounds of check_norm). dx, dw and db are v rounded once to bf16: |bf16(v) - ref| <= |v -
// ref| + ulp(v) / 2, and |v| <= |ref| + e, so ulp(v) / 2 <= ulp(|ref| + e): within e + ulp(|ref| + e).
// The output is compared as the fp32 stream's: ATen's fp32 layer_norm on the widened operands (what
// autocast would run), rounded to bf16.
torch::Tensor rounded_bound(const torch::Tensor& ref, const torch::Tensor& e) { return e + bf16_ulp(f64(ref).abs() + e); }

void check_norm_bf16(int64_t C, bool with_bias) {
  CAPTURE(C, with_bias);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const auto x0 = (torch::randn({kBatch, kSeq, C}, cuda) * 3 + 0.5).to(torch::kBFloat16);
  const auto w0 = torch::randn({C}, cuda).to(torch::kBFloat16);
  const auto b0 = with_bias ? torch::randn({C}, cuda).to(torch::kBFloat16) : torch::Tensor();
  const auto dy = torch::randn({kBatch, kSeq, C}, cuda).to(torch::kBFloat16);
  const auto got = fused_norm(x0, w0, b0, dy);
  REQUIRE(got.dx.scalar_type() == torch::kBFloat16);
  REQUIRE(got.dw.scalar_type() == torch::kBFloat16);
  const auto xf = x0.to(torch::kFloat32), wf = w0.to(torch::kFloat32);
  const auto bf = with_bias ? std::optional<at::Tensor>(b0.to(torch::kFloat32)) : std::nullopt;
  check_rounded_like(got.y, at::layer_norm(xf, {C}, wf, bf, 1e-5));
  const auto ref = reference_norm(x0, w0, b0, dy);
  CHECK(within(got.dx, ref.dx, rounded_bound(ref.dx, norm_dx_bound(x0, w0, dy, ref.dx))));
  // dw, db: check_norm's fp32 bounds, then the one rounding.
  const int64_t rows = kBatch * kSeq;
  const double d = std::ceil(static_cast<double>(C) / 256.0) + 10;
  const auto X = f64(x0), g = f64(dy);
  const auto rstd = (X.var(-1, false, true) + 1e-5).rsqrt(), mean = X.mean(-1, true);
  const auto xhat_abs = ((X - mean) * rstd).abs() + rstd * X.abs().mean(-1, true);
  const auto dw_e = column_bound(g.abs() * xhat_abs, rows) + 4 * (d + 8) * kU * (g.abs() * xhat_abs).reshape({rows, C}).sum(0);
  CHECK(within(got.dw, ref.dw, rounded_bound(ref.dw, dw_e)));
  if (with_bias) {
    REQUIRE(got.db.scalar_type() == torch::kBFloat16);
    CHECK(within(got.db, ref.db, rounded_bound(ref.db, column_bound(g.abs(), rows))));
  }
  if (!with_bias) CHECK_FALSE(got.db.defined());
  const auto again = fused_norm(x0, w0, b0, dy);  // deterministic: the same bits
  CHECK(torch::equal(again.y, got.y));
  CHECK(torch::equal(again.dx, got.dx));
  CHECK(torch::equal(again.dw, got.dw));
  if (with_bias) CHECK(torch::equal(again.db, got.db));
}

// ---- GELU ----

constexpr double kBeta = 0.7978845608028654, kKappa = 0.044715;

// The fp32 kernel evaluates ATen's expression for gelu(v) = 0.5 v (1 + tanh(I)), I = beta (v + kappa
// v^3), op for op; the two differ only where the compilers contracted a multiply-add differently and
// in tanhf's last ulps. I's error is at most 4 u |I|' (|I|' = beta (|v| + kappa |v|^3)), which moves t =
// tanh(I) by (1 - t^2) 4 u |I|'; tanhf is within 2 ulp (of 1: 2 u' = 4 u) each; the 3 remaining ops
// round once each. |Delta y| <= 0.5 |v| ((1 - t^2) 4 u |I|' + 4 u + 3 u (1 + |t|)): bounded by
// u (2 |v| (1 - t^2) |I|' + 5 |v|), doubled for both sides.
torch::Tensor gelu_bound(const torch::Tensor& v) {
  const auto V = f64(v), I = kBeta * (V.abs() + kKappa * V.abs().pow(3)), t = (kBeta * (V + kKappa * V.pow(3))).tanh();
  return 2 * kU * (2 * V.abs() * (1 - t * t) * I + 5 * V.abs());
}

// gelu'(v) g = g (0.5 (1 + t) + 0.5 v (1 - t^2) D), D = beta (1 + 3 kappa v^2): t's error as above
// moves 0.5 (1 + t) by half of it and the slope term by |v| D |t| (1 - t^2) of it; the ~10 ops round
// once each. Bounded by 16 u |g| (1 + |v| D (1 + |I|')).
torch::Tensor gelu_grad_bound(const torch::Tensor& v, const torch::Tensor& g) {
  const auto V = f64(v), I = kBeta * (V.abs() + kKappa * V.abs().pow(3)), D = kBeta * (1 + 3 * kKappa * V * V);
  return 16 * kU * f64(g).abs() * (1 + V.abs() * D * (1 + I));
}

struct GeluRun {
  torch::Tensor y, dx, db;
};

GeluRun fused_gelu(const torch::Tensor& x0, const torch::Tensor& b0, const torch::Tensor& g) {
  auto x = leaf(x0), b = b0.defined() ? leaf(b0) : torch::Tensor();
  const bool fused = b.defined() ? model::gelu_tanh_bias_fused(x, b) : model::gelu_tanh_fused(x);
  REQUIRE(fused);
  auto y = b.defined() ? model::gelu_tanh_bias(x, b) : model::gelu_tanh(x);
  y.backward(g);
  return {y.detach(), x.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

// ATen's composition: v = x (+ b) in fp32 (a bf16 x widened exactly), at::gelu(v, "tanh") in fp32, its
// gradient dv from the widened g; the fp32 values the fused kernel rounds to x's dtype.
GeluRun aten_gelu(const torch::Tensor& x0, const torch::Tensor& b0, const torch::Tensor& g) {
  auto v = leaf(b0.defined() ? x0.to(torch::kFloat32) + b0 : x0.to(torch::kFloat32));
  auto y = at::gelu(v, "tanh");
  y.backward(g.to(torch::kFloat32));
  return {y.detach(), v.grad(), b0.defined() ? f64(v.grad()).reshape({-1, v.size(-1)}).sum(0) : torch::Tensor()};
}

void check_gelu(int64_t C, c10::ScalarType dtype, bool with_bias) {
  CAPTURE(C, c10::toString(dtype), with_bias);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const auto x0 = (torch::randn({kBatch, kSeq, C}, cuda) * 2).to(dtype);
  const auto b0 = with_bias ? torch::randn({C}, cuda) * 0.5 : torch::Tensor();
  const auto g = torch::randn({kBatch, kSeq, C}, cuda).to(dtype);
  const auto got = fused_gelu(x0, b0, g);
  const auto aten = aten_gelu(x0, b0, g);
  const auto v = b0.defined() ? x0.to(torch::kFloat32) + b0 : x0.to(torch::kFloat32);
  if (dtype == torch::kBFloat16) {
    check_rounded_like(got.y, aten.y);
    check_rounded_like(got.dx, aten.dx);
  } else {
    CHECK(within(got.y, aten.y, gelu_bound(v)));
    CHECK(within(got.dx, aten.dx, gelu_grad_bound(v, g)));
  }
  if (with_bias) {
    // db sums the unrounded fp32 dx: each term within gelu_grad_bound of ATen's, then the sum's bound.
    const int64_t rows = kBatch * kSeq;
    const auto terms = f64(aten.dx).abs() + gelu_grad_bound(v, g);
    CHECK(within(got.db, aten.db, column_bound(terms, rows) + gelu_grad_bound(v, g).reshape({rows, C}).sum(0)));
  }
  const auto again = fused_gelu(x0, b0, g);
  CHECK(torch::equal(again.y, got.y));
  CHECK(torch::equal(again.dx, got.dx));
  if (with_bias) CHECK(torch::equal(again.db, got.db));
}

// ---- a GPT-2 model ----

// The loss and every gradient of a tiny GPT-2 on CUDA for one batch, under bf16 autocast or in fp32.
std::map<std::string, torch::Tensor> model_run(model::GPT& m, const torch::Tensor& idx, const torch::Tensor& targets,
                                               bool autocast) {
  m->zero_grad();
  torch::Tensor loss;
  {
    const precision::AutocastGuard guard(c10::kCUDA, autocast ? std::optional<c10::ScalarType>(c10::kBFloat16) : std::nullopt);
    loss = m->loss(idx, targets);
  }
  loss.backward();
  std::map<std::string, torch::Tensor> out{{"loss", loss.detach().reshape({1})}};
  for (const auto& p : m->named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

}  // namespace

TEST_CASE("CUDA LayerNorm into bf16: ATen's fp32 layer_norm rounded once, gradients to fp32 rounding, deterministic", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(31);
  for (const int64_t C : kWidths)
    for (const bool with_bias : {true, false}) check_norm(C, with_bias);
}

TEST_CASE("CUDA LayerNorm of a bf16 stream: ATen's fp32 layer_norm rounded once, bf16 gradients rounded once, deterministic", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(33);
  for (const int64_t C : kWidths)
    for (const bool with_bias : {true, false}) check_norm_bf16(C, with_bias);
}

TEST_CASE("CUDA LayerNorm of a bf16 stream: the predicate takes it under CUDA bf16 autocast, not on the CPU", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16);
  const auto x = torch::randn({2, 5, 64}, bf16.device(torch::kCUDA)), w = torch::randn({64}, bf16.device(torch::kCUDA));
  const auto b = torch::randn({64}, bf16.device(torch::kCUDA));
  CHECK_FALSE(model::layer_norm_bf16_fused(x, w, b));  // no autocast
  {
    const precision::AutocastGuard autocast(c10::kCUDA, c10::kBFloat16);
    CHECK(model::layer_norm_bf16_fused(x, w, b));
    CHECK(model::layer_norm_bf16_fused(x, w, torch::Tensor()));
    CHECK_FALSE(model::layer_norm_bf16_fused(x, w.to(torch::kFloat32), b));  // weights of another dtype
    CHECK_FALSE(model::layer_norm_bf16_fused(x.to(torch::kFloat32), w, b));
    CHECK_FALSE(model::layer_norm_bf16_fused(x.transpose(0, 1), w, b));
    const AtenKernels aten;
    CHECK_FALSE(model::layer_norm_bf16_fused(x, w, b));
  }
  const precision::AutocastGuard autocast(c10::kCPU, c10::kBFloat16);  // the CPU kernel takes an fp32 stream only
  CHECK_FALSE(model::layer_norm_bf16_fused(x.cpu(), w.cpu(), b.cpu()));
  const auto f32 = [](const torch::Tensor& t) { return t.cpu().to(torch::kFloat32); };
  CHECK(model::layer_norm_bf16_fused(f32(x), f32(w), f32(b)) == device::fused_kernels());  // (SUBLINEAR_ATEN_KERNELS)
}

// x + y: the fp32 sum of an exactly widened bf16, rounded once, as ATen's promoted add: the same bits;
// dy = g rounded to bf16 (to nearest even) as autograd's cast does. With the bias: x + (y + b), ATen's
// fp32 composition in the same order, bit for bit (two roundings each, no multiply to contract); db the
// column sums of g (exact terms: the sum's bound alone).
TEST_CASE("CUDA residual add: ATen's bits; with the bias x + (y + b), dy = bf16(g), db = g summed over rows", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(32);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  for (const int64_t C : kWidths) {
    CAPTURE(C);
    const auto x0 = torch::randn({kBatch, kSeq, C}, cuda) * 5, g = torch::randn({kBatch, kSeq, C}, cuda);
    const auto y16 = torch::randn({kBatch, kSeq, C}, cuda).to(torch::kBFloat16), b0 = torch::randn({C}, cuda);
    REQUIRE(model::residual_add_fused(x0, y16));
    auto x = leaf(x0), y = leaf(y16);
    torch::Tensor out;
    REQUIRE(launches_during(Kernel::residual_add, [&] { out = model::residual_add(x, y); }) == 1);
    CHECK(torch::equal(out, x0 + y16.to(torch::kFloat32)));
    out.backward(g);
    CHECK(torch::equal(x.grad(), g));
    CHECK(torch::equal(y.grad(), g.to(torch::kBFloat16)));
    for (const auto& branch : {y16, torch::randn({kBatch, kSeq, C}, cuda)}) {  // a bf16 and an fp32 branch
      CAPTURE(c10::toString(branch.scalar_type()));
      auto xb = leaf(x0), yb = leaf(branch), bb = leaf(b0);
      REQUIRE(model::residual_bias_fused(x0, b0));  // the predicate the block asks before its linear
      torch::Tensor outb;
      REQUIRE(launches_during(Kernel::residual_add_bias, [&] { outb = model::residual_add(xb, yb, bb); }) == 1);
      CHECK(torch::equal(outb, x0 + (branch.to(torch::kFloat32) + b0)));
      REQUIRE(launches_during(Kernel::residual_bias_backward, [&] { outb.backward(g); }) == 1);
      CHECK(torch::equal(xb.grad(), g));
      CHECK(torch::equal(yb.grad(), g.to(branch.scalar_type())));
      CHECK(within(bb.grad(), f64(g).reshape({-1, C}).sum(0), column_bound(f64(g).abs(), kBatch * kSeq)));
      auto xa = leaf(x0), ya = leaf(branch), ba = leaf(b0);  // deterministic: the same bits
      model::residual_add(xa, ya, ba).backward(g);
      CHECK(torch::equal(ba.grad(), bb.grad()));
    }
  }
  // An odd element count (no 4-wide vectors) and a stream of another row count.
  const auto x1 = torch::randn({3, 5, 7}, cuda), y1 = torch::randn({3, 5, 7}, cuda).to(torch::kBFloat16);
  CHECK(torch::equal(model::residual_add(x1, y1), x1 + y1.to(torch::kFloat32)));
}

TEST_CASE("CUDA residual add and LayerNorm: the predicates follow CUDA autocast and the build", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const auto x = torch::randn({2, 5, 64}, cuda), w = torch::randn({64}, cuda), b = torch::randn({64}, cuda);
  CHECK_FALSE(model::layer_norm_bf16_fused(x, w, b));  // no autocast: the linear reads fp32
  CHECK(model::residual_bias_fused(x, b));             // an fp32 run's fp32 branch
  CHECK(model::gelu_tanh_bias_fused(x, b));
  {
    const precision::AutocastGuard autocast(c10::kCUDA, c10::kBFloat16);
    CHECK(model::layer_norm_bf16_fused(x, w, b));
    CHECK(model::residual_bias_fused(x, b));
    CHECK(model::gelu_tanh_bias_fused(x, b));  // the fc output is bf16 under autocast
    CHECK_FALSE(model::layer_norm_bf16_fused(x, w.cpu(), b));  // parameters on another device
    CHECK_FALSE(model::layer_norm_bf16_fused(x.transpose(0, 1), w, b));
    const AtenKernels aten;
    CHECK_FALSE(model::layer_norm_bf16_fused(x, w, b));
    CHECK_FALSE(model::residual_bias_fused(x, b));
  }
}

TEST_CASE("CUDA GELU with and without the bias: ATen's tanh GELU, fp32 and bf16, gradients and bias sums", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(33);
  for (const int64_t C : kWidths)
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16})
      for (const bool with_bias : {true, false}) check_gelu(C, dtype, with_bias);
}

// A tiny GPT-2 (2 blocks, C 64, with biases) on CUDA under bf16 autocast: the fused kernels take its
// norms, residual adds and GELUs; against the same model on ATen's kernels (force_aten_kernels, as
// SUBLINEAR_ATEN_KERNELS=1 runs it), both measured against the model in fp32 by the relative error norm
// |got - fp32| / |fp32| of the loss and of every gradient: ours is at most ATen's plus u_bf16 = 2^-8.
// The two paths differ only in where they round: the fused norm rounds its fp32 output once where
// autocast's cast does the same; the fused bias forms add the fp32 bias before their one rounding where
// autocast's biased linear rounds the bias to bf16 and the sum again. Each such rounding moves the
// tensor it rounds by at most u_bf16 of its norm, and the maps after it (linears of random weights,
// norms, residual adds) pass a relative change on at about its size (tests/test_model.cpp's CPU block
// case has the same bound and argument).
TEST_CASE("CUDA fused kernels in a GPT-2 under bf16 autocast: as close to fp32 as ATen's kernels", "[cuda]") {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(34);
  config::ModelConfig c;
  c.arch = config::Arch::kGpt2, c.n_layer = 2, c.n_head = 4, c.n_embd = 64, c.vocab_size = 100, c.max_seq_len = 64;
  model::GPT m(c, torch::kCUDA);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kLong);
  const auto idx = torch::randint(0, c.vocab_size, {4, 48}, cuda), targets = torch::randint(0, c.vocab_size, {4, 48}, cuda);
  const auto fp32 = model_run(m, idx, targets, /*autocast=*/false);
  // The fused kernels ran in the bf16 model, forward and backward (the norms, the GELUs, the residual adds
  // in one of their two forms: with the projection's bias where it is fused, else without): the
  // comparison below is between the two paths, not ATen's against itself.
  const auto residual_adds = [] {
    return model::cuda::launches(Kernel::residual_add) + model::cuda::launches(Kernel::residual_add_bias);
  };
  const std::vector<Kernel> each = {Kernel::layer_norm_forward, Kernel::layer_norm_backward, Kernel::gelu_forward,
                                    Kernel::gelu_backward};
  std::vector<int64_t> before;
  for (const auto k : each) before.push_back(model::cuda::launches(k));
  const int64_t adds_before = residual_adds();
  const auto fused = model_run(m, idx, targets, /*autocast=*/true);
  for (size_t i = 0; i < each.size(); ++i) {
    INFO("model::cuda::Kernel " << static_cast<int>(each[i]));
    CHECK(model::cuda::launches(each[i]) > before[i]);
  }
  CHECK(residual_adds() > adds_before);
  std::map<std::string, torch::Tensor> aten;
  {
    const AtenKernels forced;
    aten = model_run(m, idx, targets, /*autocast=*/true);
  }
  auto rel_err = [](const torch::Tensor& got, const torch::Tensor& want) {
    return (f64(got) - f64(want)).norm().item<double>() / f64(want).norm().item<double>();
  };
  for (const auto& [name, want] : fp32) {
    CAPTURE(name);
    const double ours = rel_err(fused.at(name), want), theirs = rel_err(aten.at(name), want);
    INFO("relative error vs fp32: fused " << ours << ", ATen " << theirs << " (u = 2^-8)");
    CHECK(ours <= theirs + 0x1p-8);
  }
  CHECK_FALSE(torch::equal(fused.at("loss"), aten.at("loss")));  // the two paths did differ
  // The final norm hands the fused loss bf16 rows, as the planner counts them (no fp32 output and copy).
  const precision::AutocastGuard autocast(c10::kCUDA, c10::kBFloat16);
  CHECK(m->final_norm(torch::randn({2, 3, c.n_embd}, torch::TensorOptions().device(torch::kCUDA))).scalar_type() ==
        torch::kBFloat16);
}

}  // namespace SUBLINEAR_TEST_FILE
