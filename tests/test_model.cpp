// Model: preset parameter counts (built on the meta device, no memory), shapes, causality, init; the
// fused CPU kernels against ATen, and their baseline clones against their AVX2 + FMA clones.
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "catch.h"
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "config/config.h"
#include "config/shape.h"
#include "device/cpu_features.h"
#include "model/attention.h"
#include "model/gelu.h"
#include "model/gpt.h"
#include "model/linear.h"
#include "model/layernorm.h"
#include "model/residual.h"
#include "kernels/cpu/small_gemm.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;

// How the fp32 tolerances below are derived. u = 2^-24 (fp32's unit roundoff, 6e-8). A sum of n terms t
// computed in fp32 in any order is within (n - 1) u sum|t| of the exact sum (Higham, Accuracy and
// Stability, 4.2); with rounding errors of random sign, within lambda sqrt(n) u sum|t| with probability
// at least 1 - 2 exp(-lambda^2 / 2) (Higham and Mary, SIAM J. Sci. Comput. 2019): lambda = 6 fails one
// element in 3e7. Two kernels that sum in different orders (ours against ATen's or fp64; the baseline
// clone against the FMA clone) each stay within such a bound, so they differ by at most twice it. A
// relative tolerance r then covers a chain of reductions of n terms where r >= 2 lambda sqrt(n) u times
// the chain's length (for n = 128, 2 x 6 x sqrt(128) u = 8.1e-6 per reduction), relative to the terms'
// size sum|t| (so the absolute part covers elements whose sum cancels: atol ~ r times the terms' size).

namespace {

// Runs f at another intra-op thread count than the current one (3 where it is 1, as under ctest, else 1)
// and restores it: the fused kernels promise the same bits at any count.
template <typename F>
auto at_other_thread_count(F&& f) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(threads == 1 ? 3 : 1);
  auto out = f();
  torch::set_num_threads(threads);
  return out;
}

config::ModelConfig preset(const std::string& name) {
  config::ModelConfig m;
  config::apply_preset(m, name);
  return m;
}

// Closed-form count for the gpt2 architecture with biases and tied embeddings.
int64_t gpt2_count(int64_t L, int64_t d, int64_t V, int64_t ctx) {
  const int64_t block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  return V * d + ctx * d + L * block + 2 * d;
}
}  // namespace

TEST_CASE("preset parameter counts") {
  torch::NoGradGuard no_grad;
  const torch::Device meta(torch::kMeta);
  SECTION("gpt2-124m is exactly GPT-2 small") {
    model::GPT m(preset("gpt2-124m"), meta);
    CHECK(m->num_params() == 124'439'808);
  }
  SECTION("7b is exactly LLaMA-7B") {
    model::GPT m(preset("7b"), meta);
    CHECK(m->num_params() == 6'738'415'616);
    CHECK(m->blocks->size() == 32);
  }
  SECTION("gpt2-350m, 1.3b and tiny match the closed form") {
    CHECK(model::GPT(preset("gpt2-350m"), meta)->num_params() == gpt2_count(24, 1024, 50257, 1024));
    CHECK(model::GPT(preset("1.3b"), meta)->num_params() == gpt2_count(24, 2048, 50257, 2048));
    CHECK(model::GPT(preset("tiny"), meta)->num_params() == gpt2_count(4, 128, 256, 256));
  }
  SECTION("matmul parameters drop the position table (tied) or the input embedding (untied)") {
    model::GPT g(preset("gpt2-124m"), meta);
    CHECK(g->num_matmul_params() == 124'439'808 - 1024 * 768);
    model::GPT l(preset("7b"), meta);
    CHECK(l->num_matmul_params() == 6'738'415'616 - 32000LL * 4096);
  }
}

TEST_CASE("forward shapes and causality, both architectures") {
  for (const config::Arch arch : {config::Arch::kGpt2, config::Arch::kLlama}) {
    DYNAMIC_SECTION(arch) {
      torch::manual_seed(0);
      config::ModelConfig c;
      c.arch = arch, c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 50, c.max_seq_len = 16;
      c.bias = arch == config::Arch::kGpt2, c.tie_embeddings = arch == config::Arch::kGpt2;
      model::GPT m(c, torch::kCPU);
      m->eval();
      torch::NoGradGuard no_grad;
      auto idx = torch::randint(0, 50, {3, 12}, torch::kInt64);
      auto logits = m->forward(idx);
      CHECK(logits.sizes() == torch::IntArrayRef({3, 12, 50}));
      // Changing token 7 must leave positions 0..6 untouched and change position 7.
      auto idx2 = idx.clone();
      idx2.index_put_({torch::indexing::Slice(), 7}, (idx.index({torch::indexing::Slice(), 7}) + 1) % 50);
      auto logits2 = m->forward(idx2);
      using torch::indexing::Slice;
      CHECK(torch::equal(logits.index({Slice(), Slice(0, 7)}), logits2.index({Slice(), Slice(0, 7)})));
      CHECK_FALSE(torch::allclose(logits.index({Slice(), 7}), logits2.index({Slice(), 7})));
    }
  }
}

TEST_CASE("GPT-2 init: std 0.02, residual projections 0.02/sqrt(2L), norms at one") {
  torch::manual_seed(0);
  auto c = preset("tiny");
  c.n_layer = 8, c.n_embd = 256, c.n_head = 4;
  model::GPT m(c, torch::kCPU);
  auto* b = m->blocks[0]->as<model::BlockImpl>();
  // Sample std of n normal draws: relative standard error 1/sqrt(2n); w_qkv 256 x 768 (n 196,608: 0.0016),
  // w_out 256 x 1024 (0.0014), w_proj 256 x 256 (0.0028): 2 % and 3 % are more than 10 standard errors.
  CHECK(b->w_qkv.std().item<double>() == Approx(0.02).epsilon(0.02));
  CHECK(b->w_out.std().item<double>() == Approx(0.02 / std::sqrt(16.0)).epsilon(0.02));
  CHECK(b->w_proj.std().item<double>() == Approx(0.02 / std::sqrt(16.0)).epsilon(0.03));
  CHECK(torch::equal(b->ln1_w, torch::ones_like(b->ln1_w)));
  CHECK(torch::equal(b->b_qkv, torch::zeros_like(b->b_qkv)));
}

TEST_CASE("tied embeddings share one tensor; untied adds an LM head") {
  auto c = preset("tiny");
  model::GPT tied(c, torch::kMeta);
  CHECK_FALSE(tied->lm_head.defined());
  c.tie_embeddings = false;
  model::GPT untied(c, torch::kMeta);
  CHECK(untied->num_params() == tied->num_params() + 256 * 128);
}

TEST_CASE("model.vocab_multiple: the padded model's real rows and every later parameter draw the unpadded model's "
          "numbers, the padding rows are zero, and the logits have vocab_size columns") {
  for (const config::Arch arch : {config::Arch::kGpt2, config::Arch::kLlama}) {
    DYNAMIC_SECTION(arch) {
      config::ModelConfig c;
      c.arch = arch, c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 250, c.max_seq_len = 16;
      c.bias = arch == config::Arch::kGpt2, c.tie_embeddings = arch == config::Arch::kGpt2;
      config::ModelConfig p = c;
      p.vocab_multiple = 128;
      REQUIRE(p.padded_vocab() == 256);
      torch::manual_seed(7);
      model::GPT plain(c, torch::kCPU);
      torch::manual_seed(7);
      model::GPT padded(p, torch::kCPU);
      // The tables gain 6 rows each: wte, and lm_head when untied.
      const int64_t tables = c.tie_embeddings ? 1 : 2;
      CHECK(padded->num_params() == plain->num_params() + tables * 6 * 32);
      CHECK(padded->num_padding_params() == tables * 6 * 32);
      CHECK(plain->num_padding_params() == 0);
      CHECK(padded->num_params() == config::Shape(p).total_params());
      auto want = plain->named_parameters();
      for (const auto& item : padded->named_parameters()) {
        INFO(item.key());
        const torch::Tensor& got = item.value();
        const torch::Tensor& ref = want[item.key()];
        if (item.key() == "wte" || item.key() == "lm_head") {
          REQUIRE(got.size(0) == 256);
          CHECK(torch::equal(got.narrow(0, 0, 250), ref));  // bitwise: the same draws
          CHECK(torch::equal(got.narrow(0, 250, 6), torch::zeros({6, 32})));
        } else {
          CHECK(torch::equal(got, ref));  // later parameters: the generator is where the unpadded model left it
        }
      }
      // The logits stop at vocab_size, and with zero padding rows they are the unpadded model's up to
      // the head product's fp32 summation order (the blocks are the same weights on the same input, so the
      // head's input is the same): each logit is a sum of C = 32 products, within 31 u sum|h_i w_i| of the
      // exact sum in any order (u = 2^-24, Higham 4.2). sum|h_i w_i| <= |h| |w| (Cauchy-Schwarz) with
      // |h| = sqrt(32) (the final norm's unit-variance output, weight 1) and |w| ~ 0.02 sqrt(32) = 0.11 (a
      // row of 32 draws of std 0.02; the largest of 256 rows is within 1.5x of that): under 1, so each
      // model is within 31 x 6e-8 = 1.9e-6 of the exact logits and the two within 3.7e-6. 2e-5 leaves 5x;
      // a padding logit in the softmax or a shifted column moves values by O(0.1).
      padded->eval(), plain->eval();
      torch::NoGradGuard no_grad;
      const auto idx = torch::randint(0, 250, {2, 16}, torch::kInt64);
      const auto lp = padded->forward(idx), lu = plain->forward(idx);
      CHECK(lp.sizes() == torch::IntArrayRef({2, 16, 250}));
      CHECK((lp - lu).abs().max().item<double>() <= 2e-5);
    }
  }
}

TEST_CASE("dropout is active in training and off in eval") {
  torch::manual_seed(0);
  auto c = preset("tiny");
  c.dropout = 0.2;
  model::GPT m(c, torch::kCPU);
  auto idx = torch::randint(0, 256, {2, 16}, torch::kInt64);
  torch::NoGradGuard no_grad;
  m->train();
  CHECK_FALSE(torch::equal(m->forward(idx), m->forward(idx)));
  m->eval();
  CHECK(torch::equal(m->forward(idx), m->forward(idx)));
}

TEST_CASE("RMSNorm's own backward matches autograd through at::rms_norm") {
  torch::manual_seed(0);
  auto c = preset("tiny");
  c.arch = config::Arch::kLlama, c.bias = false, c.n_layer = 1;
  model::GPT m(c, torch::kCPU);
  auto* b = m->blocks[0]->as<model::BlockImpl>();
  {
    torch::NoGradGuard g;
    b->ln1_w.uniform_(0.5, 1.5);
  }
  auto x = torch::randn({2, 5, 128}, torch::requires_grad());
  auto dy = torch::randn({2, 5, 128});
  auto y = b->norm1(x);
  auto ref = at::rms_norm(x, {128}, b->ln1_w, c.norm_eps);
  // One reduction of C = 128 squares each side (2 x 6 sqrt(128) u = 8.1e-6, the header's bound) and a
  // few roundings: rtol 1e-5; atol 1e-6 for outputs near 0.
  CHECK(torch::allclose(y, ref, 1e-5, 1e-6));
  auto g = torch::autograd::grad({y}, {x, b->ln1_w}, {dy});
  auto gr = torch::autograd::grad({ref}, {x, b->ln1_w}, {dy});
  // Backward: dx = w dy / r - x (sum w dy x) / (C r^3), two reductions of C terms and a difference that
  // can cancel; dw sums 10 rows. Up to ~4 chained reductions of <= 128 terms (4 x 8.1e-6 = 3.2e-5),
  // 1e-4 relative to the terms; atol 1e-5 (terms ~|dy| ~ 1) where dx cancels.
  CHECK(torch::allclose(g[0], gr[0], 1e-4, 1e-5));
  CHECK(torch::allclose(g[1], gr[1], 1e-4, 1e-5));
}

TEST_CASE("fused GELU (tanh form) equals ATen's gelu(x, tanh) and its gradient to float rounding") {
  torch::manual_seed(3);
  // Typical activations, the tails (where the gate saturates or the exp is clamped), exact zeros.
  auto x = torch::cat({torch::randn({100000}) * 3, torch::linspace(-100, 100, 20001), torch::zeros({7}),
                       torch::tensor({1e-30f, -1e-30f, 87.5f, -87.5f, 1e4f, -1e4f})});
  REQUIRE(model::gelu_tanh_fused(x));
  const auto want = at::gelu(x, "tanh");
  const auto got = model::gelu_tanh(x);
  // atol: in the far negative tail ATen's 1 + tanh(z) cancels (gelu(-5) = -2.98e-7 or 0 there, -2.29e-7
  // exactly, which the sigmoid form gives), so the two differ by up to ~5e-7 absolute.
  // rtol: elementwise, no sums: the tanh/exp formulas' own errors, a few ulps each side (2e-6 = 34 u).
  CHECK(torch::allclose(got, want, /*rtol=*/2e-6, /*atol=*/5e-7));
  CHECK(torch::isfinite(got).all().item<bool>());
  // Gradient: through autograd, against ATen's backward, for an arbitrary upstream gradient.
  auto xr = x.clone().requires_grad_(true);
  const auto g = torch::randn_like(x);
  model::gelu_tanh(xr).backward(g);
  const auto want_grad = at::gelu_backward(g, x, "tanh");
  CHECK(torch::allclose(xr.grad(), want_grad, /*rtol=*/1e-5, /*atol=*/5e-6));  // the same tail
  // The same values with any thread count and split (each element on its own).
  CHECK(torch::equal(at_other_thread_count([&] { return model::gelu_tanh(x); }), got));
  // An unaligned start and a partial last vector (the tail goes through the same vector code).
  CHECK(torch::equal(model::gelu_tanh(x.narrow(0, 5, 1003)), got.narrow(0, 5, 1003)));
  auto xs = x.narrow(0, 3, 13).clone().requires_grad_(true);
  model::gelu_tanh(xs).backward(g.narrow(0, 3, 13));
  CHECK(torch::equal(xs.grad(), xr.grad().narrow(0, 3, 13)));
  // A NaN stays NaN (the exp's clamp must not turn it into a number a NaN check would miss).
  CHECK(torch::isnan(model::gelu_tanh(torch::full({11}, std::nanf("")))).all().item<bool>());
  // Anything but contiguous fp32 or bf16 on the CPU is ATen's (bf16: the bf16 GELU tests below).
  CHECK_FALSE(model::gelu_tanh_fused(x.to(torch::kHalf)));
  CHECK_FALSE(model::gelu_tanh_fused(x.view({2, -1}).t()));
  CHECK(torch::equal(model::gelu_tanh(x.to(torch::kHalf)), at::gelu(x.to(torch::kHalf), "tanh")));
}

TEST_CASE("a GPT-2 block (fused attention on packed QKV, fc bias in the GELU) equals the block in ATen ops") {
  // The block as the trainer runs it on fp32 CPU against the textbook composition of ATen ops (SDPA,
  // addmm biases, ATen's tanh GELU) on copies of the same parameters: output, input gradient and every
  // parameter gradient, the fc bias's (now summed inside the GELU's backward) included.
  torch::manual_seed(5);
  config::ModelConfig c;
  c.arch = config::Arch::kGpt2, c.n_layer = 1, c.n_head = 3, c.n_embd = 48, c.vocab_size = 50, c.max_seq_len = 40;
  model::Block block(c, 0, torch::kCPU);
  {
    torch::NoGradGuard no_grad;  // non-zero biases and norm weights (they start at 0 and 1)
    for (auto& p : block->parameters()) p.add_(torch::randn_like(p) * 0.1);
  }
  const int64_t B = 2, T = 37, C = c.n_embd, nh = c.n_head;
  const auto x0 = torch::randn({B, T, C});
  auto x = x0.clone().requires_grad_(true);
  REQUIRE(model::gelu_tanh_bias_fused(x, block->b_fc));
  const auto y = block->forward(x, model::Rope{});

  std::map<std::string, torch::Tensor> ref;
  for (const auto& p : block->named_parameters()) ref[p.key()] = p.value().detach().clone().requires_grad_(true);
  auto xr = x0.clone().requires_grad_(true);
  auto ln = [&](const torch::Tensor& t, const std::string& n) {
    return at::layer_norm(t, {C}, ref[n + "_w"], ref[n + "_b"], c.norm_eps);
  };
  const auto qkv = at::linear(ln(xr, "ln1"), ref["w_qkv"], ref["b_qkv"]);
  auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, nh, C / nh}).transpose(1, 2); };
  const auto parts = qkv.split(C, 2);
  const auto a = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), std::nullopt,
                                                  0.0, true)
                     .transpose(1, 2)
                     .reshape({B, T, C});
  const auto h = xr + at::linear(a, ref["w_proj"], ref["b_proj"]);
  const auto u = at::linear(ln(h, "ln2"), ref["w_fc"], ref["b_fc"]);
  const auto want = h + at::linear(at::gelu(u, "tanh"), ref["w_out"], ref["b_out"]);
  // A chain of reductions of at most 192 terms (C 48: layer norms and qkv/proj; the fc's 192 hidden;
  // T 37 in the attention) in other orders than ATen's: the header's 2 x 6 sqrt(192) u = 1e-5 per
  // reduction, against outputs of size ~1 (the residual x dominates y): rtol and atol 1e-5.
  CHECK(torch::allclose(y, want, 1e-5, 1e-5));

  const auto dy = torch::randn_like(want);
  y.backward(dy);
  want.backward(dy);
  // Backward: the chain run back (about twice its reductions, with the norms' and softmax's
  // cancelling differences): 1e-4 relative; parameter gradients also sum over B T = 74 rows (1e-4 abs).
  CHECK(torch::allclose(x.grad(), xr.grad(), 1e-4, 1e-5));
  for (const auto& p : block->named_parameters()) {
    CAPTURE(p.key());
    REQUIRE(p.value().grad().defined());
    CHECK(torch::allclose(p.value().grad(), ref[p.key()].grad(), 1e-4, 1e-4));
  }
}

TEST_CASE("fused GELU with the fc bias equals gelu_tanh(x + b); its bias gradient is dx summed over rows") {
  torch::manual_seed(4);
  // 77 rows (pieces of 32 rows and a partial one), H 45 (5 whole vectors and a partial one).
  for (const int64_t H : {45, 64}) {
    CAPTURE(H);
    auto x = (torch::randn({7, 11, H}) * 3).requires_grad_(true);
    auto b = torch::randn({H}).requires_grad_(true);
    REQUIRE(model::gelu_tanh_bias_fused(x, b));
    const auto y = model::gelu_tanh_bias(x, b);
    auto xb = (x.detach() + b.detach()).requires_grad_(true);
    const auto want = model::gelu_tanh(xb);
    CHECK(torch::equal(y, want));  // the same sum x + b, then the same kernel
    const auto g = torch::randn_like(y);
    const auto grads = torch::autograd::grad({y}, {x, b}, {g});
    const auto dx = torch::autograd::grad({want}, {xb}, {g})[0];
    CHECK(torch::equal(grads[0], dx));
    // db sums 77 rows in fixed pieces, ATen's sum in its own order: 2 x 6 sqrt(77) u = 6.3e-6 of the
    // terms' size (|dx| ~ 1): 1e-5.
    CHECK(torch::allclose(grads[1], dx.sum(std::vector<int64_t>{0, 1}), 1e-5, 1e-5));
    // The bias gradient's bits do not depend on the thread count (fixed pieces, summed in order).
    const auto grads1 =
        at_other_thread_count([&] { return torch::autograd::grad({model::gelu_tanh_bias(x, b)}, {x, b}, {g}); });
    CHECK(torch::equal(grads1[0], grads[0]));
    CHECK(torch::equal(grads1[1], grads[1]));
  }
  // Not fused: fp16, no bias, CPU autocast to fp16 (the model then keeps the bias in its linear); bf16
  // (and CPU autocast to bf16) is, see the bf16 tests below.
  const auto x = torch::randn({4, 8});
  CHECK_FALSE(model::gelu_tanh_bias_fused(x.to(torch::kHalf), torch::randn({8})));
  CHECK_FALSE(model::gelu_tanh_bias_fused(x, torch::Tensor()));
  {
    const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const bool fused = model::gelu_tanh_bias_fused(x, torch::randn({8}));
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    CHECK_FALSE(fused);
  }
}

namespace {
// Causal attention in double precision through plain ATen ops (scores, mask, softmax, product): the
// reference the fused kernel is checked against.
torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = q.size(2);
  auto s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  auto mask = torch::ones({T, T}, torch::kBool).triu(1);
  auto p = torch::softmax(s.masked_fill(mask, -std::numeric_limits<double>::infinity()), -1);
  auto y = torch::matmul(p, v);  // (B, nh, T, hd)
  return y.transpose(1, 2).reshape({q.size(0), T, -1});
}
}  // namespace

TEST_CASE("fused causal attention equals softmax(q k^T / sqrt(hd) + mask) v and its gradients") {
  torch::manual_seed(5);
  // T below, at, and across the 64-row blocks; q, k, v as strided views of one QKV buffer (GPT-2) and
  // as separate contiguous tensors (LLaMA's rotated q, k); large logits for the softmax's max shift.
  struct Case {
    int64_t B, nh, T, hd;
    bool views;
    double logit_scale;
  };
  // hd 24 and 80 end on a half tile (8 columns), hd 12 on a narrow edge (4 columns); T 2, 5 and 68 leave tiles of
  // 2, 5 and 4 rows.
  for (const Case c : {Case{2, 3, 1, 16, true, 1}, Case{2, 2, 64, 32, true, 1}, Case{1, 4, 150, 64, true, 1},
                       Case{2, 2, 129, 16, false, 1}, Case{1, 2, 70, 8, false, 8}, Case{1, 2, 5, 24, true, 1},
                       Case{2, 1, 68, 12, false, 1}, Case{1, 1, 2, 80, true, 2}, Case{1, 1, 100, 128, true, 1}}) {
    CAPTURE(c.B, c.nh, c.T, c.hd, c.views, c.logit_scale);
    const int64_t C = c.nh * c.hd;
    torch::Tensor q, k, v, leaf;
    if (c.views) {
      leaf = (torch::randn({c.B, c.T, 3 * C}) * c.logit_scale).requires_grad_(true);
      auto parts = leaf.split(C, 2);
      auto heads = [&](const torch::Tensor& t) { return t.view({c.B, c.T, c.nh, c.hd}).transpose(1, 2); };
      q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    } else {
      leaf = (torch::randn({3, c.B, c.nh, c.T, c.hd}) * c.logit_scale).requires_grad_(true);
      q = leaf[0], k = leaf[1], v = leaf[2];
    }
    REQUIRE(model::causal_attention_fused(q, k, v));
    const auto y = model::causal_attention(q, k, v);
    REQUIRE(y.sizes() == torch::IntArrayRef{c.B, c.T, C});
    CHECK(y.is_contiguous());
    auto qd = q.detach().to(torch::kDouble).requires_grad_(true), kd = k.detach().to(torch::kDouble).requires_grad_(true),
         vd = v.detach().to(torch::kDouble).requires_grad_(true);
    const auto want = attention_reference(qd, kd, vd);
    // Forward: scores (hd <= 128 terms), the softmax's sum (T <= 150) and P v (T terms): per reduction
    // 6 sqrt(150) u = 4.4e-6 against fp64 (exact here), chained 2-3 of them: 1e-5 relative; the scores
    // scale with logit_scale^2 (q and k both scaled), and the exp's relative error with the scores.
    CHECK(torch::allclose(y.to(torch::kDouble), want, 1e-5, 1e-5 * c.logit_scale * c.logit_scale));
    // Gradients for an arbitrary upstream gradient.
    const auto dy = torch::randn_like(y);
    const auto got = torch::autograd::grad({y}, {q, k, v}, {dy});
    const auto ref = torch::autograd::grad({want}, {qd, kd, vd}, {dy.to(torch::kDouble)});
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      // Backward: dP = dy v^T, dS = P (dP - rowsum(dP P)) (a cancelling difference), dq = dS k, dk = dS^T q,
      // dv = P^T dy: up to 4 chained reductions of <= 150 terms, ~10x the forward's bound: 1e-4.
      CHECK(torch::allclose(got[i].to(torch::kDouble), ref[i], 1e-4, 1e-4 * c.logit_scale));
    }
    // No thread count changes a bit (each (batch, head) is one thread's, in a fixed order), and a second
    // call (a recompute) gives the same bits.
    const auto y1 = at_other_thread_count([&] { return model::causal_attention(q, k, v); });
    const auto got1 = at_other_thread_count([&] { return torch::autograd::grad({y1}, {q, k, v}, {dy}); });
    CHECK(torch::equal(y1, y));
    for (int i = 0; i < 3; ++i) CHECK(torch::equal(got1[i], got[i]));
    if (c.views) {
      // The packed form reads the same heads in place from the (B, T, 3C) tensor: the same bits, and its
      // one gradient is what the split's backward concatenates from the three.
      REQUIRE(model::causal_attention_packed_fused(leaf, c.nh));
      const auto yp = model::causal_attention_packed(leaf, c.nh);
      CHECK(torch::equal(yp, y));
      const auto gp = torch::autograd::grad({yp}, {leaf}, {dy});
      auto btc = [&](const torch::Tensor& t) { return t.transpose(1, 2).reshape({c.B, c.T, C}); };
      CHECK(torch::equal(gp[0], torch::cat({btc(got[0]), btc(got[1]), btc(got[2])}, 2)));
    }
  }
  // Anything but fp32 CPU tensors with unit stride along hd is SDPA's.
  const auto x = torch::randn({1, 2, 8, 4});
  CHECK_FALSE(model::causal_attention_fused(x.to(torch::kBFloat16), x, x));
  CHECK_FALSE(model::causal_attention_fused(x.transpose(2, 3), x, x));
  CHECK_FALSE(model::causal_attention_packed_fused(torch::randn({1, 8, 12}), 5));  // 12 is not 3 * 5 * hd
}

namespace {

// While alive, one of the kernel switches of device/cpu_features.h holds `on`; the setting before is
// restored after (also when a REQUIRE throws).
template <bool (*Force)(bool)>
class ForcedKernels {
 public:
  explicit ForcedKernels(bool on) : before_(Force(on)) {}
  ~ForcedKernels() { Force(before_); }
  ForcedKernels(const ForcedKernels&) = delete;
  ForcedKernels& operator=(const ForcedKernels&) = delete;

 private:
  bool before_;
};

// The fused kernels run the baseline clone (on) or the CPU's vector clone (off).
using KernelClone = ForcedKernels<device::force_baseline_kernels>;

// Whether the AVX2 + FMA clones can run on this CPU; where they cannot, says so (the test then checks
// the baseline clone only, against the reference).
bool vector_clones_run_here() {
  if (device::cpu_has_avx2_fma()) return true;
  WARN("this CPU has no AVX2 + FMA: the vector clones cannot run here; only the baseline clone is checked");
  return false;
}

// Output and q, k, v gradients of the fused attention on one clone.
std::vector<torch::Tensor> attention_on(bool baseline, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& dy) {
  KernelClone clone(baseline);
  REQUIRE(device::vector_kernels() == (!baseline && device::cpu_has_avx2_fma()));
  const auto y = model::causal_attention(q, k, v);
  auto out = torch::autograd::grad({y}, {q, k, v}, {dy});
  out.insert(out.begin(), y);
  return out;
}

}  // namespace

TEST_CASE("fused attention: the baseline clone equals the AVX2 + FMA clone within 2e-6 relative (+1e-6 absolute) "
          "forward, 1e-5 (+1e-5) backward; both match the double-precision reference") {
  // Shapes whose rows end on a narrow edge (hd 12), half tiles (hd 24) and partial row tiles (T 5, 70),
  // across the 64-row blocks (T 70, 129).
  torch::manual_seed(8);
  const bool vector = vector_clones_run_here();
  for (const auto& [B, nh, T, hd] : std::vector<std::array<int64_t, 4>>{{2, 3, 70, 12}, {1, 2, 129, 24}, {1, 1, 5, 80}}) {
    CAPTURE(B, nh, T, hd);
    auto leaf = torch::randn({3, B, nh, T, hd}).requires_grad_(true);
    const auto q = leaf[0], k = leaf[1], v = leaf[2];
    const auto dy = torch::randn({B, T, nh * hd});
    const auto base = attention_on(/*baseline=*/true, q, k, v, dy);
    // Against the reference: the baseline clone is as correct as the vector one is (same bounds as the
    // fused-attention test above).
    auto qd = q.detach().to(torch::kDouble).requires_grad_(true), kd = k.detach().to(torch::kDouble).requires_grad_(true),
         vd = v.detach().to(torch::kDouble).requires_grad_(true);
    const auto want = attention_reference(qd, kd, vd);
    const auto ref = torch::autograd::grad({want}, {qd, kd, vd}, {dy.to(torch::kDouble)});
    CHECK(torch::allclose(base[0].to(torch::kDouble), want, 1e-5, 1e-5));
    for (int i = 0; i < 3; ++i) CHECK(torch::allclose(base[i + 1].to(torch::kDouble), ref[i], 1e-4, 1e-4));
    if (!vector) continue;
    const auto vec = attention_on(/*baseline=*/false, q, k, v, dy);
    INFO("max |baseline - vector|: output " << (base[0] - vec[0]).abs().max().item<float>() << ", dq "
                                            << (base[1] - vec[1]).abs().max().item<float>());
    // Two fp32 orders/contractions of the same sums (FMA rounds once where the baseline rounds twice):
    // forward reductions of <= 129 terms, the header's 8.1e-6 of the terms' size worst per reduction,
    // but the two clones sum in the same order and differ only by the FMAs' skipped roundings: one u
    // per term, random in sign, 6 sqrt(129) u = 4e-6 of sum|t|, about half that relative to outputs of
    // size ~sum|t| / 2: 2e-6 (+1e-6 absolute); backward: the chain of ~4 reductions above, 1e-5.
    CHECK(torch::allclose(base[0], vec[0], 2e-6, 1e-6));
    for (int i = 1; i < 4; ++i) CHECK(torch::allclose(base[i], vec[i], 1e-5, 1e-5));
    // Both clones did run: the vector one's fused multiply-adds round differently somewhere.
    CHECK_FALSE(torch::equal(base[0], vec[0]));
  }
}

namespace {
// (y, dx) of the plain fused GELU and (y, dx, db) of the bias form on x0, b0 with output gradient g,
// on one clone (the baseline forced, or the vector clone where the CPU runs it).
std::vector<torch::Tensor> gelu_both_forms(const torch::Tensor& x0, const torch::Tensor& b0, const torch::Tensor& g,
                                           bool baseline) {
  KernelClone clone(baseline);
  REQUIRE(device::vector_kernels() == (!baseline && device::cpu_has_avx2_fma()));
  auto x = x0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
  const auto y = model::gelu_tanh(x);
  const auto dx = torch::autograd::grad({y}, {x}, {g})[0];
  const auto yb = model::gelu_tanh_bias(x, b);
  const auto gb = torch::autograd::grad({yb}, {x, b}, {g});
  return {y, dx, yb, gb[0], gb[1]};
}
}  // namespace

TEST_CASE("fused GELU: the baseline clone equals the AVX2 + FMA clone within 1e-6 relative (+1e-7 absolute), "
          "forward and backward, with and without the fc bias (its gradient, a sum over rows: 1e-5)") {
  torch::manual_seed(9);
  const bool vector = vector_clones_run_here();
  // 7 x 11 rows of H 45 (whole vectors and a partial one), typical values and the saturated tails.
  const auto x0 = torch::cat({torch::randn({7, 11, 40}) * 3, torch::linspace(-30, 30, 7 * 11 * 5).view({7, 11, 5})}, 2);
  const auto b0 = torch::randn({45});
  const auto g = torch::randn_like(x0);
  auto run = [&](bool baseline) { return gelu_both_forms(x0, b0, g, baseline); };
  const auto base = run(/*baseline=*/true);
  // The baseline against ATen (the bounds of the fused-GELU test above).
  CHECK(torch::allclose(base[0], at::gelu(x0, "tanh"), 2e-6, 5e-7));
  CHECK(torch::allclose(base[1], at::gelu_backward(g, x0, "tanh"), 1e-5, 5e-6));
  CHECK(torch::allclose(base[2], at::gelu(x0 + b0, "tanh"), 2e-6, 5e-7));
  if (!vector) return;
  const auto vec = run(/*baseline=*/false);
  for (size_t i = 0; i < base.size(); ++i) {
    CAPTURE(i);
    INFO("max |baseline - vector| " << (base[i] - vec[i]).abs().max().item<float>());
    // Elementwise (y, dx): the FMA clone skips a few of the baseline's roundings, a few u: 1e-6 = 17 u
    // (+1e-7 where the tails' values are tiny). db sums 77 rows of dx-sized terms (|dx| <= ~1.1 |g|)
    // whose few-u differences add with random sign: 6 sqrt(77) x 3 u x |terms| ~ 1e-5 absolute.
    const double tol = i == 4 ? 1e-5 : 1e-6, abs_tol = i == 4 ? 1e-5 : 1e-7;
    CHECK(torch::allclose(base[i], vec[i], tol, abs_tol));
  }
  CHECK_FALSE(torch::equal(base[1], vec[1]));  // both clones did run
}

// The 16-lane (AVX-512) form of the GELU's vector clone: the 8-lane form's operations in the same order
// with nothing contracted, so equal bits are the claim (model/gelu.h), in fp32 and bf16, both forms, rows
// of every length from 1 to 33 (every 16-lane tail, whole vectors and none) and values in the saturated
// tails, +-inf and NaN; compared as raw bits (NaN payloads included).
namespace {
// The vector clones are kept on 8 lanes (on) or may take 16 (off).
using Avx2Lanes = ForcedKernels<device::force_avx2_kernels>;

torch::Tensor bits(const torch::Tensor& t) {
  return t.contiguous().view(t.scalar_type() == torch::kBFloat16 ? torch::kInt16 : torch::kInt32);
}
}  // namespace

TEST_CASE("fused GELU: the AVX-512 form equals the AVX2 form bit for bit (fp32, bf16; plain and with the bias)", "[avx512]") {
  if (!device::cpu_features().avx512_lanes || !device::cpu_has_avx2_fma()) {
    SUBLINEAR_SKIP("this CPU (or ATEN_CPU_CAPABILITY) gives no AVX-512 lanes: only the AVX2 form runs here");
  }
  torch::manual_seed(33);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t H = 1; H <= 33; ++H) {
      CAPTURE(dtype, H);
      auto x0 = (torch::randn({5, 3, H}) * 4).to(dtype);
      const auto specials = torch::tensor({-30.0f, 30.0f, INFINITY, -INFINITY, NAN});
      const int64_t n = std::min<int64_t>(5, x0.numel());
      x0.view(-1).narrow(0, 0, n).copy_(specials.narrow(0, 0, n));
      const auto b0 = torch::randn({H}).to(dtype);
      const auto g = torch::randn({5, 3, H}).to(dtype);
      auto run = [&](bool avx2) {
        const KernelClone vector(/*baseline=*/false);
        const Avx2Lanes lanes(avx2);
        REQUIRE(device::avx512_kernels() == !avx2);
        REQUIRE(device::gelu_lanes() == (avx2 ? 8 : 16));
        return gelu_both_forms(x0, b0, g, /*baseline=*/false);
      };
      const auto avx2 = run(true), avx512 = run(false);
      for (size_t i = 0; i < avx2.size(); ++i) {
        CAPTURE(i);
        CHECK(torch::equal(bits(avx2[i]), bits(avx512[i])));
      }
    }
  }
}

// ---- bf16 forms of the fused kernels ----
//
// How close a bf16 result can be: bf16 keeps 8 significant bits, so one ulp at |x| in [2^(e-1), 2^e) is
// 2^(e-8) (at most 2^-7 |x|) and rounding to nearest is off by at most half of it (2^-9 ~ 0.002
// relative). The fused bf16 kernels and ATen's bf16 kernels alike widen their bf16 inputs exactly,
// compute in fp32 and round each output once, so a result is within half an ulp of its fp32 value,
// which is within the fp32 kernel's own error (the fp32 tests above) of the exact one. The references
// are fp64 computations on the same (widened) bf16 inputs.

namespace {

// One bf16 ulp at |x|, in fp64: 2^(e - 8) for |x| in [2^(e-1), 2^e); below 2^-126 that of 2^-126.
torch::Tensor bf16_ulp(const torch::Tensor& x) {
  const auto [mantissa, exponent] = torch::frexp(x.to(torch::kDouble).abs().clamp_min(std::ldexp(1.0, -126)));
  return torch::ldexp(torch::ones_like(mantissa), exponent - 8);
}

torch::Tensor f64(const torch::Tensor& t) { return t.detach().to(torch::kDouble); }

double max_abs(const torch::Tensor& t) { return f64(t).abs().max().item<double>(); }

// The largest |got - ref|.
double max_err(const torch::Tensor& got, const torch::Tensor& ref) { return max_abs(f64(got) - f64(ref)); }

// Every element of the bf16 `got` within half an ulp of the fp64 `ref` plus rel |ref| + abs (the fp32
// arithmetic's error before the one rounding).
bool rounded_once(const torch::Tensor& got, const torch::Tensor& ref, double rel, const torch::Tensor& abs) {
  const auto r = f64(ref);
  return ((f64(got) - r).abs() <= 0.5 * bf16_ulp(r) + rel * r.abs() + abs).all().item<bool>();
}
bool rounded_once(const torch::Tensor& got, const torch::Tensor& ref, double rel, double abs) {
  return rounded_once(got, ref, rel, torch::scalar_tensor(abs, torch::kDouble));
}

// The largest |got - ref| in ulps of each element's reference, over elements whose |ref| >= floor.
double max_ulps(const torch::Tensor& got, const torch::Tensor& ref, double floor) {
  const auto r = f64(ref);
  return ((f64(got) - r).abs() / bf16_ulp(r)).masked_select(r.abs() >= floor).max().item<double>();
}

// GELU's tanh form in fp64, as x sigmoid(2 z) (the same function, without 1 + tanh z's cancellation in
// the negative tail).
torch::Tensor gelu_fp64(const torch::Tensor& x) {
  const double k = std::sqrt(2.0 / M_PI);
  return x * torch::sigmoid(2.0 * k * (x + 0.044715 * x * x * x));
}

// (y, dx) of gelu_fp64 at the bf16 x, for the upstream gradient g.
std::array<torch::Tensor, 2> gelu_fp64_with_grad(const torch::Tensor& x, const torch::Tensor& g) {
  auto xd = f64(x).requires_grad_(true);
  const auto y = gelu_fp64(xd);
  return {y.detach(), torch::autograd::grad({y}, {xd}, {f64(g)})[0]};
}

// The inputs of the GELU tests in bf16: typical activations, the tails, zeros, tiny and huge values.
torch::Tensor gelu_inputs_bf16() {
  return torch::cat({torch::randn({100000}) * 3, torch::linspace(-100, 100, 20001), torch::zeros({7}),
                     torch::tensor({1e-30f, -1e-30f, 87.5f, -87.5f, 1e4f, -1e4f})})
      .to(torch::kBFloat16);
}

}  // namespace

// The plain bf16 GELU. The kernel widens x, runs the fp32 kernel's arithmetic and rounds once, so:
// (1) it is bitwise the fp32 kernel on the widened x (and g), rounded to bf16;
// (2) against fp64, each element is within half an ulp plus the fp32 kernel's error: 2e-6 relative for
//     y, 1e-5 for dx (the fp32 test's bounds), and for dx 1e-6 |g| absolute near GELU's minimum
//     (x ~ -0.75, where gelu' = 0 and its fp32 terms cancel); no once-rounded result can do better than
//     half an ulp, and ATen's bf16 gelu (the same scheme) does no better: where ATen's fp32 formula is
//     accurate (|ref| >= 1e-3; below, its 1 + tanh cancels) our largest error in ulps is at most
//     ATen's + 0.01 ulp (a fp32 error of 2.6e-5 relative, ten times the kernels');
// (3) against ATen's bf16 gelu on the same input: within one ulp (two fp32 values within the fp32 tests'
//     tolerance may round to neighbours) plus those tolerances (2e-6 rel and, for ATen's tail, 5e-7
//     abs for y; 1e-5 and 5e-6 for dx).
TEST_CASE("bf16 fused GELU: the fp32 kernel rounded once; within half an ulp of fp64 and one ulp of ATen's bf16") {
  torch::manual_seed(13);
  const auto x = gelu_inputs_bf16();
  REQUIRE(model::gelu_tanh_fused(x));
  const auto g = torch::randn({x.numel()}).to(torch::kBFloat16);
  auto xr = x.clone().requires_grad_(true);
  const auto y = model::gelu_tanh(xr);
  y.backward(g);
  const auto dx = xr.grad();
  REQUIRE(y.scalar_type() == torch::kBFloat16);
  REQUIRE(dx.scalar_type() == torch::kBFloat16);
  // (1)
  auto x32 = x.to(torch::kFloat32).requires_grad_(true);
  const auto y32 = model::gelu_tanh(x32);
  y32.backward(g.to(torch::kFloat32));
  CHECK(torch::equal(y, y32.detach().to(torch::kBFloat16)));
  CHECK(torch::equal(dx, x32.grad().to(torch::kBFloat16)));
  // (2)
  const auto [ref, ref_dx] = gelu_fp64_with_grad(x, g);
  CHECK(rounded_once(y, ref, 2e-6, 1e-30));
  CHECK(rounded_once(dx, ref_dx, 1e-5, 1e-6 * f64(g).abs()));
  const auto aten = at::gelu(x, "tanh");
  const auto aten_dx = at::gelu_backward(g, x, "tanh");
  INFO("max ulps vs fp64: y " << max_ulps(y, ref, 1e-3) << " (ATen " << max_ulps(aten, ref, 1e-3) << "), dx "
                              << max_ulps(dx, ref_dx, 1e-3) << " (ATen " << max_ulps(aten_dx, ref_dx, 1e-3) << ")");
  CHECK(max_ulps(y, ref, 1e-3) <= max_ulps(aten, ref, 1e-3) + 0.01);
  CHECK(max_ulps(dx, ref_dx, 1e-3) <= max_ulps(aten_dx, ref_dx, 1e-3) + 0.01);
  // (3)
  auto one_ulp_of = [](const torch::Tensor& a, const torch::Tensor& b, double rel, double abs) {
    const auto bound = bf16_ulp(torch::max(f64(a).abs(), f64(b).abs())) + rel * f64(b).abs() + abs;
    return ((f64(a) - f64(b)).abs() <= bound).all().item<bool>();
  };
  CHECK(one_ulp_of(y, aten, 2e-6, 5e-7));
  CHECK(one_ulp_of(dx, aten_dx, 1e-5, 5e-6));
  // The same bits with another thread count, from an unaligned start and for a partial last vector (bf16's tail
  // goes through a buffer, then the same vector code); NaN stays NaN.
  CHECK(torch::equal(at_other_thread_count([&] { return model::gelu_tanh(x); }), y));
  CHECK(torch::equal(model::gelu_tanh(x.narrow(0, 5, 1003)), y.narrow(0, 5, 1003)));
  auto xs = x.narrow(0, 3, 13).clone().requires_grad_(true);
  model::gelu_tanh(xs).backward(g.narrow(0, 3, 13));
  CHECK(torch::equal(xs.grad(), dx.narrow(0, 3, 13)));
  CHECK(torch::isnan(model::gelu_tanh(torch::full({11}, std::nanf(""), torch::kBFloat16))).all().item<bool>());
}

// bf16 GELU with the fc bias: x bf16 with b fp32 (the model under CPU autocast: a bf16 fc output and
// the fp32 bias parameter) or b bf16 (precision.param_dtype bf16). x + b is taken in fp32 in the kernel:
// (1) bitwise the fp32 bias kernel on the widened x and b, rounded: y, dx, and db (that kernel's fp32
//     sum of the unrounded dx, then in b's dtype);
// (2) against fp64: y and dx within half an ulp plus the fp32 kernel's error (as in the plain test);
//     db (a sum of 77 rows) within 1e-5 of its scale max |ref| (the fp32 test's bound), plus half an
//     ulp when it is returned in bf16;
// (3) ATen's bf16 composition, gelu(x + b) with b in bf16 (autocast's addmm casts the bias, then ATen's
//     bf16 add and gelu), rounds b and x + b before the GELU as well: its largest error in ulps of y
//     and dx (where |ref| >= 1e-3, as above), and its db's largest error, bound ours (+ 0.01 ulp, + one
//     ulp of db's scale). Elementwise, y is within what those two roundings move the GELU's input,
//     times GELU's largest slope 1.13, plus one ulp of the output and the plain test's tolerances.
TEST_CASE("bf16 fused GELU with the fc bias (fp32 or bf16 b): the fp32 kernel rounded once; against fp64 "
          "and ATen's bf16 gelu(x + b)") {
  torch::manual_seed(14);
  for (const auto bias_dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(bias_dtype);
    // 77 rows (pieces of 32 and a partial one) of H 45 (5 whole vectors and a partial one).
    const auto x = (torch::randn({7, 11, 45}) * 3).to(torch::kBFloat16);
    const auto b = torch::randn({45}).to(bias_dtype);
    const auto g = torch::randn({7, 11, 45}).to(torch::kBFloat16);
    REQUIRE(model::gelu_tanh_bias_fused(x, b));
    auto xr = x.clone().requires_grad_(true), br = b.clone().requires_grad_(true);
    const auto y = model::gelu_tanh_bias(xr, br);
    const auto grads = torch::autograd::grad({y}, {xr, br}, {g});
    REQUIRE(y.scalar_type() == torch::kBFloat16);
    REQUIRE(grads[0].scalar_type() == torch::kBFloat16);
    REQUIRE(grads[1].scalar_type() == bias_dtype);
    // (1)
    auto x32 = x.to(torch::kFloat32).requires_grad_(true), b32 = b.to(torch::kFloat32).requires_grad_(true);
    const auto y32 = model::gelu_tanh_bias(x32, b32);
    const auto grads32 = torch::autograd::grad({y32}, {x32, b32}, {g.to(torch::kFloat32)});
    CHECK(torch::equal(y, y32.to(torch::kBFloat16)));
    CHECK(torch::equal(grads[0], grads32[0].to(torch::kBFloat16)));
    CHECK(torch::equal(grads[1], grads32[1].to(bias_dtype)));
    // (2)
    auto sd = (f64(x) + f64(b)).requires_grad_(true);
    const auto ref = gelu_fp64(sd);
    const auto ref_dx = torch::autograd::grad({ref}, {sd}, {f64(g)})[0];
    const auto ref_db = ref_dx.sum(std::vector<int64_t>{0, 1});
    CHECK(rounded_once(y, ref, 2e-6, 1e-30));
    CHECK(rounded_once(grads[0], ref_dx, 1e-5, 1e-6 * f64(g).abs()));
    const double db_scale = max_abs(ref_db);
    const double db_ulp = bf16_ulp(torch::scalar_tensor(db_scale)).item<double>();
    const double db_round = bias_dtype == torch::kBFloat16 ? 0.5 * db_ulp : 0;
    CHECK(max_err(grads[1], ref_db) <= 1e-5 * db_scale + db_round);
    // (3)
    auto xa = x.clone().requires_grad_(true), ba = b.clone().requires_grad_(true);
    const auto aten = at::gelu(xa + ba.to(torch::kBFloat16), "tanh");
    const auto aten_grads = torch::autograd::grad({aten}, {xa, ba}, {g});
    INFO("max ulps vs fp64: y " << max_ulps(y, ref, 1e-3) << " (ATen " << max_ulps(aten, ref, 1e-3) << "), dx "
                                << max_ulps(grads[0], ref_dx, 1e-3) << " (ATen "
                                << max_ulps(aten_grads[0], ref_dx, 1e-3) << "); db max error "
                                << max_err(grads[1], ref_db) << " (ATen " << max_err(aten_grads[1], ref_db) << ")");
    CHECK(max_ulps(y, ref, 1e-3) <= max_ulps(aten, ref, 1e-3) + 0.01);
    CHECK(max_ulps(grads[0], ref_dx, 1e-3) <= max_ulps(aten_grads[0], ref_dx, 1e-3) + 0.01);
    CHECK(max_err(grads[1], ref_db) <= max_err(aten_grads[1], ref_db) + db_ulp);
    const auto s = f64(sd);
    const auto b_rounding = bias_dtype == torch::kFloat32 ? bf16_ulp(f64(b)) : torch::zeros({1}, torch::kDouble);
    const auto input_moves = 0.5 * b_rounding + 0.5 * bf16_ulp(s.abs() * 1.01);
    const auto bound = 1.13 * input_moves + bf16_ulp(ref) + 2e-6 * ref.abs() + 5e-7;
    CHECK(((f64(y) - f64(aten)).abs() <= bound).all().item<bool>());
  }
}

namespace {

// q, k, v of one attention case in bf16, as views of one (B, T, 3C) leaf (GPT-2's packed QKV) or as
// three slices of one (3, B, nh, T, hd) leaf.
struct Bf16Attention {
  torch::Tensor leaf, q, k, v;
};

Bf16Attention bf16_attention_inputs(int64_t B, int64_t nh, int64_t T, int64_t hd, bool views, double logit_scale) {
  Bf16Attention a;
  const int64_t C = nh * hd;
  if (views) {
    a.leaf = (torch::randn({B, T, 3 * C}) * logit_scale).to(torch::kBFloat16).requires_grad_(true);
    auto parts = a.leaf.split(C, 2);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
    a.q = heads(parts[0]), a.k = heads(parts[1]), a.v = heads(parts[2]);
  } else {
    a.leaf = (torch::randn({3, B, nh, T, hd}) * logit_scale).to(torch::kBFloat16).requires_grad_(true);
    a.q = a.leaf[0], a.k = a.leaf[1], a.v = a.leaf[2];
  }
  return a;
}

// Output (B, T, C) and the q, k, v gradients of an attention `fn(q, k, v)` for the upstream gradient dy.
template <class Fn>
std::vector<torch::Tensor> attention_with_grads(Fn fn, const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v, const torch::Tensor& dy) {
  const auto y = fn(q, k, v);
  auto out = torch::autograd::grad({y}, {q, k, v}, {dy});
  out.insert(out.begin(), y);
  return out;
}

// While alive, bf16 attention heads take the fp32 products (on) or may take the AVX512-BF16 ones (off).
class Fp32AttentionProducts {
 public:
  explicit Fp32AttentionProducts(bool on) : before_(model::force_fp32_attention_products(on)) {}
  ~Fp32AttentionProducts() { model::force_fp32_attention_products(before_); }
  Fp32AttentionProducts(const Fp32AttentionProducts&) = delete;
  Fp32AttentionProducts& operator=(const Fp32AttentionProducts&) = delete;

 private:
  bool before_;
};

// Whether the bf16 attention may take the AVX512-BF16 products here (the CPU has them, oneDNN's cap
// allows them and the vector clones run). Where not, the cases that check them report Skipped.
bool bf16_products_run_here() {
  const Fp32AttentionProducts allow(false);
  return model::bf16_attention_products();
}

// SDPA (is_causal) with its output in the (B, T, C) layout.
torch::Tensor sdpa_btc(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true)
      .transpose(1, 2)
      .reshape({q.size(0), q.size(2), -1});
}

}  // namespace

// bf16 causal attention, split q, k, v and packed qkv. Per (batch, head) the kernel widens q, k, v
// exactly into fp32 scratch, runs the fp32 kernel, rounds the output once and keeps lse in fp32:
// (1) forward: bitwise the fp32 kernel on the widened q, k, v, rounded to bf16; so against fp64 each
//     element is within half an ulp plus the fp32 kernel's error (1e-5 relative + 1e-5 logit_scale^2
//     absolute, the fp32 test's bounds).
// (2) Backward reads the saved bf16 output and the bf16 output gradient, as SDPA's flash path does
//     (D = rowsum(dO * O) is taken on the rounded O), so dq, dk, dv are not an fp32 result rounded
//     once; they are compared by scale: against fp64, the largest error of each of y, dq, dk, dv is at
//     most SDPA-bf16's (ATen's CPU flash kernels, which also accumulate in fp32 but round the
//     probabilities and the scores' gradients to bf16 before their products) plus one ulp of that
//     tensor's scale max |ref|; the same against the explicit bf16 composition (bf16 matmul, softmax,
//     matmul: scores and probabilities rounded to bf16).
// (3) Against SDPA-bf16 itself: within 4 ulps of the scale (measured: at most 1; both round their
//     outputs, SDPA its probabilities as well).
// No thread count changes a bit; the packed form gives the split form's bits and one gradient.
// The same cases on the AVX512-BF16 products: the [avx512bf16] case below.
namespace {
void check_bf16_attention(bool fp32_products) {
  {
    CAPTURE(fp32_products);
    const Fp32AttentionProducts products(fp32_products);
    torch::manual_seed(15);
    struct Case {
      int64_t B, nh, T, hd;
      bool views;
      double logit_scale;
    };
    for (const Case c : {Case{2, 3, 70, 12, true, 1}, Case{1, 2, 129, 64, true, 1}, Case{2, 2, 65, 24, false, 1},
                         Case{1, 2, 100, 32, true, 3}, Case{1, 1, 5, 80, false, 1}}) {
      CAPTURE(c.B, c.nh, c.T, c.hd, c.views, c.logit_scale);
      const auto a = bf16_attention_inputs(c.B, c.nh, c.T, c.hd, c.views, c.logit_scale);
      // The model takes bf16 attention where the AVX2 clone runs (the kernel itself runs anywhere).
      REQUIRE(model::causal_attention_fused(a.q, a.k, a.v) == device::vector_kernels());
      const auto dy = torch::randn({c.B, c.T, c.nh * c.hd}).to(torch::kBFloat16);
      auto fused = [](const auto& q, const auto& k, const auto& v) { return model::causal_attention(q, k, v); };
      const auto got = attention_with_grads(fused, a.q, a.k, a.v, dy);
      for (const auto& t : got) REQUIRE(t.scalar_type() == torch::kBFloat16);
      // (1)
      torch::Tensor y32;
      {
        torch::NoGradGuard no_grad;
        y32 = model::causal_attention(a.q.to(torch::kFloat32), a.k.to(torch::kFloat32), a.v.to(torch::kFloat32));
      }
      if (fp32_products) CHECK(torch::equal(got[0], y32.to(torch::kBFloat16)));
      auto qd = f64(a.q).requires_grad_(true), kd = f64(a.k).requires_grad_(true), vd = f64(a.v).requires_grad_(true);
      const auto want = attention_reference(qd, kd, vd);
      const auto ref_grads = torch::autograd::grad({want}, {qd, kd, vd}, {f64(dy)});
      const std::vector<torch::Tensor> ref{want.detach(), ref_grads[0], ref_grads[1], ref_grads[2]};
      if (fp32_products) CHECK(rounded_once(got[0], ref[0], 1e-5, 1e-5 * c.logit_scale * c.logit_scale));
      // (2), (3)
      const auto sdpa = attention_with_grads(sdpa_btc, a.q, a.k, a.v, dy);
      auto composition = [](const auto& q, const auto& k, const auto& v) { return attention_reference(q, k, v); };
      const auto comp = attention_with_grads(composition, a.q, a.k, a.v, dy);
      for (int i = 0; i < 4; ++i) {
        CAPTURE(i);  // y, dq, dk, dv
        const double ulp = bf16_ulp(torch::scalar_tensor(max_abs(ref[i]))).item<double>();
        INFO("max error vs fp64: fused " << max_err(got[i], ref[i]) << ", SDPA-bf16 " << max_err(sdpa[i], ref[i])
                                         << ", bf16 composition " << max_err(comp[i], ref[i]) << "; fused - SDPA "
                                         << max_err(got[i], sdpa[i]) / ulp << " ulps of the scale " << max_abs(ref[i]));
        CHECK(max_err(got[i], ref[i]) <= max_err(sdpa[i], ref[i]) + ulp);
        CHECK(max_err(got[i], ref[i]) <= max_err(comp[i], ref[i]) + ulp);
        CHECK(max_err(got[i], sdpa[i]) <= 4 * ulp);
      }
      // Another thread count: the same bits.
      const auto got1 = at_other_thread_count([&] { return attention_with_grads(fused, a.q, a.k, a.v, dy); });
      for (int i = 0; i < 4; ++i) CHECK(torch::equal(got1[i], got[i]));
      if (c.views) {
        // The packed form: the same bits, its one gradient the split's three side by side.
        REQUIRE(model::causal_attention_packed_fused(a.leaf, c.nh) == device::vector_kernels());
        const auto yp = model::causal_attention_packed(a.leaf, c.nh);
        CHECK(torch::equal(yp, got[0]));
        const auto gp = torch::autograd::grad({yp}, {a.leaf}, {dy})[0];
        REQUIRE(gp.scalar_type() == torch::kBFloat16);
        auto btc = [&](const torch::Tensor& t) { return t.transpose(1, 2).reshape({c.B, c.T, -1}); };
        CHECK(torch::equal(gp, torch::cat({btc(got[1]), btc(got[2]), btc(got[3])}, 2)));
      }
    }
  }
}
}  // namespace

TEST_CASE("bf16 fused causal attention: forward is the fp32 kernel rounded once; output and gradients "
          "against fp64, SDPA-bf16 and the bf16 composition") {
  check_bf16_attention(/*fp32_products=*/true);
  // Mixed dtypes (LLaMA's fp32 rotated q, k beside a bf16 v under autocast) and fp16 stay SDPA's.
  const auto x = torch::randn({1, 2, 8, 4});
  const auto xb = x.to(torch::kBFloat16);
  CHECK(model::causal_attention_fused(xb, xb, xb) == device::vector_kernels());
  CHECK_FALSE(model::causal_attention_fused(x, x, xb));
  CHECK_FALSE(model::causal_attention_fused(x.to(torch::kHalf), x.to(torch::kHalf), x.to(torch::kHalf)));
  CHECK_FALSE(model::causal_attention_packed_fused(torch::randn({1, 8, 12}, torch::kHalf), 2));
}

// The same cases on the AVX512-BF16 products (model/attention.h), which round P and dS to bf16 as SDPA
// does: (1) does not hold there; (2), (3), the thread-count and packed-form checks must.
TEST_CASE("bf16 fused causal attention on the AVX512-BF16 products: output and gradients against fp64, "
          "SDPA-bf16 and the bf16 composition", "[avx512bf16]") {
  if (!bf16_products_run_here()) {
    SUBLINEAR_SKIP("this CPU has no AVX512-BF16 (or oneDNN is capped below avx512_core_bf16, or the vector "
                   "clones are off): the bf16 attention products cannot run here");
  }
  check_bf16_attention(/*fp32_products=*/false);
}

namespace {
struct GemmCase {
  int64_t M, N, K;
  kernels::cpu::Causal causal;
  int64_t diag;
};

// A random M x K operand, 0 where the causal kind says A is (as the attention's P and dS are): past
// each row's diagonal for k_to_diag, before it for k_from_diag.
torch::Tensor causal_operand(const GemmCase& c) {
  auto a = torch::randn({c.M, c.K});
  const auto r = torch::arange(c.M).view({c.M, 1}), k = torch::arange(c.K).view({1, c.K});
  if (c.causal == kernels::cpu::Causal::k_to_diag) a.masked_fill_(k > r + c.diag, 0.0);
  if (c.causal == kernels::cpu::Causal::k_from_diag) a.masked_fill_(k < r - c.diag, 0.0);
  return a;
}
}  // namespace

// The AVX512-BF16 GEMM of the bf16 attention against fp64 products of the operands rounded to bf16:
// each product of two bf16 is exact in fp32 and the sums are fp32, so every element is within the
// fp32 summation bound K 2^-24 sum_k |a||b| (+ the same for the accumulated C). Shapes with a short
// row tile (M 19 = 8 + 8 + 3), a partial vector (N 45 = 32 + 13), odd K (a 0-padded pair), each causal
// kind (A zero past the mask, as the attention's P and dS are), with and without accumulation, A read
// along rows and down columns (pack_row_pairs, pack_column_pairs with strides (1, ld)).
TEST_CASE("bf16 products (AVX512-BF16): fp64 of the rounded operands within the fp32 summation bound", "[avx512bf16]") {
  if (!kernels::cpu::bf16_dot_products()) {
    SUBLINEAR_SKIP("this CPU has no AVX512-BF16 (or oneDNN is capped below avx512_core_bf16): the bf16 products cannot run here");
  }
  torch::manual_seed(31);
  using kernels::cpu::Causal;
  for (const GemmCase c : {GemmCase{19, 45, 33, Causal::all, 0}, GemmCase{64, 256, 64, Causal::cols_to_diag, 192},
                           GemmCase{19, 45, 45, Causal::k_to_diag, 7}, GemmCase{45, 24, 19, Causal::k_from_diag, 5},
                           GemmCase{8, 16, 1, Causal::all, 0}}) {
    for (const bool transposed_a : {false, true}) {
      for (const bool accumulate : {false, true}) {
        CAPTURE(c.M, c.N, c.K, static_cast<int>(c.causal), c.diag, transposed_a, accumulate);
        const auto a = causal_operand(c);
        const auto r = torch::arange(c.M).view({c.M, 1});
        const auto b = torch::randn({c.K, c.N});
        const auto c0 = torch::randn({c.M, c.N});
        const int64_t kp = (c.K + 1) / 2;
        std::vector<uint32_t> aw(static_cast<size_t>(c.M * kp + c.K * c.M + 8)), bw(static_cast<size_t>(kp * c.N));
        kernels::cpu::WordsA wa{aw.data(), kp, 1};
        if (transposed_a) {  // A^T stored (K x M), its pairs down columns: A's pair (r, kp) at kp * M + r
          const auto at = a.t().contiguous();
          kernels::cpu::pack_column_pairs(at.data_ptr<float>(), c.M, c.K, c.M, aw.data(), c.M);
          wa = {aw.data(), 1, c.M};
        } else {
          kernels::cpu::pack_row_pairs(a.data_ptr<float>(), c.K, c.M, c.K, aw.data(), kp);
        }
        kernels::cpu::pack_column_pairs(b.data_ptr<float>(), c.N, c.K, c.N, bw.data(), c.N);
        auto got = c0.clone();
        const float alpha = 0.75f;
        kernels::cpu::small_gemm_bf16({c.M, c.N, c.K, c.causal, c.diag}, alpha, wa, bw.data(), c.N, got.data_ptr<float>(), c.N,
                               accumulate);
        const auto ad = f64(a.to(torch::kBFloat16)), bd = f64(b.to(torch::kBFloat16));
        auto want = alpha * ad.mm(bd);
        auto bound = (c.K * std::ldexp(1.0, -24)) * (alpha * ad.abs().mm(bd.abs())) + 1e-30;
        if (accumulate) want = want + f64(c0), bound = bound + std::ldexp(1.0, -24) * (f64(c0).abs() + want.abs());
        auto ok = (f64(got) - want).abs() <= bound;
        // cols_to_diag promises the columns up to each row's diagonal only.
        if (c.causal == Causal::cols_to_diag) ok = ok | (torch::arange(c.N).view({1, c.N}) > r + c.diag);
        INFO("max error " << max_err(got, want));
        CHECK(ok.all().item<bool>());
      }
    }
  }
}

// The bf16 packings (words moved, not computed) against their definitions in small_gemm.h, word by
// word: row counts and pair counts that leave every partial 16 x 16 block of the transpose (rows 1-17,
// 33; cols 1-35, odd ones pairing their last element with 0), a row stride past the columns (ldx),
// and the destination's words outside the packed ones left as they were.
TEST_CASE("bf16 packings (AVX512-BF16): pairs along rows, down columns and transposed, word by word", "[avx512bf16]") {
  if (!kernels::cpu::bf16_dot_products()) {
    SUBLINEAR_SKIP("this CPU has no AVX512-BF16 (or oneDNN is capped below avx512_core_bf16): the bf16 products cannot run here");
  }
  torch::manual_seed(37);
  constexpr uint32_t kUntouched = 0xDEADBEEFu;
  auto bits = [](const c10::BFloat16* x, int64_t i) { return static_cast<uint32_t>(x[i].x); };
  auto Bf16s = [](const c10::BFloat16* x) { return reinterpret_cast<const kernels::cpu::Bf16*>(x); };
  for (const int64_t rows : {1, 2, 7, 15, 16, 17, 33}) {
    for (const int64_t cols : {1, 2, 3, 16, 31, 32, 33, 35}) {
      CAPTURE(rows, cols);
      const int64_t ldx = cols + 5, cps = (cols + 1) / 2;
      const auto x = torch::randn({rows, ldx}).to(torch::kBFloat16);
      const auto* X = x.const_data_ptr<c10::BFloat16>();
      auto want_pair = [&](int64_t r0, int64_t c0, int64_t r1, int64_t c1, bool has_hi) {
        return bits(X, r0 * ldx + c0) | (has_hi ? bits(X, r1 * ldx + c1) << 16 : 0u);
      };
      const int64_t ld_rows = cps + 3, ld_t = rows + 3, ld_cols = cols + 3;
      std::vector<uint32_t> along(static_cast<size_t>(rows * ld_rows), kUntouched);
      std::vector<uint32_t> transposed(static_cast<size_t>(cps * ld_t), kUntouched);
      std::vector<uint32_t> down(static_cast<size_t>((rows + 1) / 2 * ld_cols), kUntouched);
      kernels::cpu::pack_row_pairs(Bf16s(X), ldx, rows, cols, along.data(), ld_rows);
      kernels::cpu::pack_row_pairs_transposed(Bf16s(X), ldx, rows, cols, transposed.data(), ld_t);
      kernels::cpu::pack_column_pairs(Bf16s(X), ldx, rows, cols, down.data(), ld_cols);
      int64_t wrong = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t cp = 0; cp < ld_rows; ++cp) {
          const uint32_t want = cp < cps ? want_pair(r, 2 * cp, r, 2 * cp + 1, 2 * cp + 1 < cols) : kUntouched;
          wrong += along[r * ld_rows + cp] != want;
        }
      for (int64_t cp = 0; cp < cps; ++cp)
        for (int64_t r = 0; r < ld_t; ++r) {
          const uint32_t want = r < rows ? want_pair(r, 2 * cp, r, 2 * cp + 1, 2 * cp + 1 < cols) : kUntouched;
          wrong += transposed[cp * ld_t + r] != want;
        }
      for (int64_t rp = 0; rp < (rows + 1) / 2; ++rp)
        for (int64_t c = 0; c < ld_cols; ++c) {
          const uint32_t want = c < cols ? want_pair(2 * rp, c, 2 * rp + 1, c, 2 * rp + 1 < rows) : kUntouched;
          wrong += down[rp * ld_cols + c] != want;
        }
      CHECK(wrong == 0);
    }
  }
}

// The fp32 products on 16 lanes (model/small_gemm.h: the AVX2 clone's arithmetic, up to 64 columns a
// tile) against the AVX2 clone, raw bits, over every C element (cols_to_diag's extra columns included:
// both forms write the same ones): every last row-tile height (M 19 = 6 + 6 + 6 + 1, 64 = ... + 4,
// 45 = ... + 3, 8 = 6 + 2, 11 = 6 + 5, 7 = 6 + 1), every column width 1-17 and widths that leave each
// kind of 16-lane tail past whole 64-column tiles and the AVX2 clone's 8-column and narrow edges
// (N 45, 64, 77, 130), each causal kind, with and without accumulation, A along rows and down columns,
// alpha 0.75, NaN and infinity in B.
TEST_CASE("small_gemm: the 16-lane form gives the AVX2 clone's bits", "[avx512]") {
  if (!device::cpu_features().avx512_lanes || !device::cpu_has_avx2_fma()) {
    SUBLINEAR_SKIP("this CPU (or ATEN_CPU_CAPABILITY) gives no AVX-512 lanes: only the AVX2 products run here");
  }
  torch::manual_seed(35);
  using kernels::cpu::Causal;
  std::vector<GemmCase> cases{GemmCase{19, 45, 33, Causal::all, 0}, GemmCase{64, 130, 64, Causal::cols_to_diag, 66},
                              GemmCase{19, 77, 45, Causal::k_to_diag, 7}, GemmCase{45, 64, 19, Causal::k_from_diag, 5},
                              GemmCase{7, 5, 1, Causal::all, 0}, GemmCase{13, 77, 64, Causal::cols_to_diag, 0}};
  for (int64_t n = 1; n <= 17; ++n) cases.push_back({n % 2 ? 11 : 8, n, 9, Causal::all, 0});
  for (const GemmCase& c : cases) {
    for (const bool transposed_a : {false, true}) {
      for (const bool accumulate : {false, true}) {
        CAPTURE(c.M, c.N, c.K, static_cast<int>(c.causal), c.diag, transposed_a, accumulate);
        const auto a = causal_operand(c);
        auto b = torch::randn({c.K, c.N});
        if (c.N > 40) b[0][3] = std::numeric_limits<float>::quiet_NaN(), b[c.K - 1][40] = INFINITY;
        const auto at = a.t().contiguous();
        const kernels::cpu::MatA ma = transposed_a ? kernels::cpu::MatA{at.data_ptr<float>(), 1, c.M} : kernels::cpu::MatA{a.data_ptr<float>(), c.K, 1};
        const auto c0 = torch::randn({c.M, c.N});
        auto run = [&](bool avx2) {
          const KernelClone vector(/*baseline=*/false);
          const Avx2Lanes lanes(avx2);
          REQUIRE(device::avx512_kernels() == !avx2);
          auto got = c0.clone();
          kernels::cpu::small_gemm({c.M, c.N, c.K, c.causal, c.diag}, 0.75f, ma, b.data_ptr<float>(), c.N,
                            got.data_ptr<float>(), c.N, accumulate);
          return got;
        };
        const auto avx2 = run(true), avx512 = run(false);
        const auto differ = (bits(avx2) != bits(avx512)).nonzero();  // (row, column) of each
        const auto first = [&](int i) { return std::to_string(differ[0][i].item<int64_t>()); };
        INFO(differ.size(0) << " elements differ" << (differ.size(0) ? " (the first at " + first(0) + ", " + first(1) + ")" : ""));
        CHECK(differ.size(0) == 0);
      }
    }
  }
}

// The bf16 forms on the baseline clone against the AVX2 + FMA clone. Each computes fp32 values from the
// same widened inputs, which differ between the clones within the fp32 clone tests' bounds (attention
// forward 2e-6 relative + 1e-6, backward 1e-5 + 1e-5; GELU 1e-6 + 1e-7, its bias gradient 1e-5 + 1e-5,
// kept in fp32 here), and rounds them once: two values that close round to the same bf16 or to
// neighbours, one ulp apart, and one ulp is at most 2^-7 of the value. So: within 2^-7 relative plus
// the fp32 bounds. The widening and rounding themselves are exact integer operations on both clones.
TEST_CASE("bf16 fused attention and GELU: the baseline clone equals the AVX2 + FMA clone within one bf16 ulp "
          "(2^-7 relative) plus the fp32 clones' bounds") {
  const Fp32AttentionProducts fp32_products(true);  // the clones of the fp32 products; the bf16 ones have none
  torch::manual_seed(16);
  const bool vector = vector_clones_run_here();
  const double ulp = std::ldexp(1.0, -7);
  const std::vector<std::array<int64_t, 4>> shapes{{2, 3, 70, 12}, {1, 2, 129, 24}, {1, 1, 5, 80}};
  for (const auto& [B, nh, T, hd] : shapes) {
    CAPTURE(B, nh, T, hd);
    const auto a = bf16_attention_inputs(B, nh, T, hd, /*views=*/true, 1);
    const auto dy = torch::randn({B, T, nh * hd}).to(torch::kBFloat16);
    const auto base = attention_on(/*baseline=*/true, a.q, a.k, a.v, dy);
    // Against fp64: the baseline clone is as correct as the vector one (the forward bound of the bf16
    // attention test above).
    const auto want = attention_reference(f64(a.q), f64(a.k), f64(a.v));
    CHECK(rounded_once(base[0], want, 1e-5, 1e-5));
    if (!vector) continue;
    const auto vec = attention_on(/*baseline=*/false, a.q, a.k, a.v, dy);
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i);
      INFO("max |baseline - vector| " << max_err(base[i], vec[i]) << ", elements that differ "
                                      << base[i].ne(vec[i]).sum().item<int64_t>() << " of " << base[i].numel());
      const double rel = i == 0 ? 2e-6 : 1e-5, abs = i == 0 ? 1e-6 : 1e-5;
      CHECK(torch::allclose(f64(base[i]), f64(vec[i]), ulp + rel, abs));
    }
  }
  // GELU, plain and with a bias (fp32 and bf16), on 7 x 11 rows of H 45 (whole vectors and a partial one).
  const auto x0 = torch::cat({torch::randn({7, 11, 40}) * 3, torch::linspace(-30, 30, 7 * 11 * 5).view({7, 11, 5})}, 2)
                      .to(torch::kBFloat16);
  const auto g = torch::randn_like(x0, torch::kFloat32).to(torch::kBFloat16);
  for (const auto bias_dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(bias_dtype);
    const auto b0 = torch::randn({45}).to(bias_dtype);
    auto run = [&](bool baseline) { return gelu_both_forms(x0, b0, g, baseline); };
    const auto base = run(/*baseline=*/true);
    const auto [ref, ref_dx] = gelu_fp64_with_grad(x0, g);
    CHECK(rounded_once(base[0], ref, 2e-6, 1e-30));  // the bounds of the plain bf16 GELU test
    CHECK(rounded_once(base[1], ref_dx, 1e-5, 1e-6 * f64(g).abs()));
    if (!vector) continue;
    const auto vec = run(/*baseline=*/false);
    for (size_t i = 0; i < base.size(); ++i) {
      CAPTURE(i);
      INFO("max |baseline - vector| " << max_err(base[i], vec[i]));
      const bool db = i == 4;  // a sum over 77 rows; one bf16 rounding only when b is bf16
      const double rel = (db ? 1e-5 : 1e-6) + (db && bias_dtype == torch::kFloat32 ? 0 : ulp);
      CHECK(torch::allclose(f64(base[i]), f64(vec[i]), rel, db ? 1e-5 : 1e-7));
    }
  }
}

// The attention's softmax and probability rows on 16 lanes (model/attention.cpp: the AVX2 clone's
// operations in the same order, its exps 16 at a time): the whole attention, forward and backward, gives
// the 8-lane bits, in fp32 and bf16 (on the fp32 products here, on the AVX512-BF16 ones in the
// [avx512bf16] case below), for sequence lengths whose rows leave every kind of tail (T 5, 37, 70, 129:
// blocks of 64 rows, rows of every valid length up to T).
namespace {
void check_16_lane_softmax_rows(const std::vector<std::pair<c10::ScalarType, bool>>& paths) {
  torch::manual_seed(34);
  for (const auto& [dtype, fp32_products] : paths) {
    for (const int64_t T : {5, 37, 70, 129}) {
      CAPTURE(dtype, fp32_products, T);
      const Fp32AttentionProducts products(fp32_products);
      const auto a = bf16_attention_inputs(2, 3, T, 24, /*views=*/true, 2.0);
      const auto q = a.q.to(dtype), k = a.k.to(dtype), v = a.v.to(dtype);
      const auto dy = torch::randn({2, T, 3 * 24}).to(dtype);
      auto run = [&](bool avx2) {
        const KernelClone vector(/*baseline=*/false);
        const Avx2Lanes lanes(avx2);
        REQUIRE(device::avx512_kernels() == !avx2);
        return attention_on(/*baseline=*/false, q, k, v, dy);
      };
      const auto avx2 = run(true), avx512 = run(false);
      for (size_t i = 0; i < avx2.size(); ++i) {
        CAPTURE(i);
        CHECK(torch::equal(bits(avx2[i]), bits(avx512[i])));
      }
    }
  }
}
}  // namespace

TEST_CASE("fused attention: the 16-lane softmax rows give the AVX2 clone's bits, forward and backward", "[avx512]") {
  if (!device::cpu_features().avx512_lanes || !device::cpu_has_avx2_fma()) {
    SUBLINEAR_SKIP("this CPU (or ATEN_CPU_CAPABILITY) gives no AVX-512 lanes: only the AVX2 rows run here");
  }
  check_16_lane_softmax_rows({{torch::kFloat32, true}, {torch::kBFloat16, true}});
}

TEST_CASE("fused attention on the AVX512-BF16 products: the 16-lane softmax rows give the AVX2 clone's bits",
          "[avx512bf16]") {
  if (!device::cpu_features().avx512_lanes || !device::cpu_has_avx2_fma() || !bf16_products_run_here()) {
    SUBLINEAR_SKIP("this CPU (or ATEN_CPU_CAPABILITY, or oneDNN's cap) gives no AVX-512 lanes with AVX512-BF16 "
                   "products: the 16-lane rows on the bf16 products cannot run here");
  }
  check_16_lane_softmax_rows({{torch::kBFloat16, false}});
}

// SUBLINEAR_ATEN_KERNELS: its rule (unset, empty or 0: the fused kernels; anything else: ATen's), read
// once; while ATen's are forced every predicate says false, on tensors the kernels otherwise take, and
// gelu_tanh is at::gelu bit for bit.
TEST_CASE("SUBLINEAR_ATEN_KERNELS turns every fused-kernel predicate off") {
  CHECK(device::fused_kernels_from_env(nullptr));
  CHECK(device::fused_kernels_from_env(""));
  CHECK(device::fused_kernels_from_env("0"));
  CHECK_FALSE(device::fused_kernels_from_env("1"));
  CHECK_FALSE(device::fused_kernels_from_env("yes"));
  // This process's answer, from the documented rule applied to its own environment (not from the
  // function that implements the rule): unset, empty or "0" leave the fused kernels on.
  const char* aten_env = std::getenv("SUBLINEAR_ATEN_KERNELS");
  const bool rule_says_fused = aten_env == nullptr || std::string(aten_env).empty() || std::string(aten_env) == "0";
  CHECK(device::fused_kernels() == rule_says_fused);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    const auto x = torch::randn({2, 16, 24}).to(dtype);
    const auto b = torch::randn({24}).to(dtype);
    const auto q = torch::randn({2, 2, 16, 4}).to(dtype);
    const bool before = device::force_aten_kernels(true);
    const bool gelu = model::gelu_tanh_fused(x), bias = model::gelu_tanh_bias_fused(x, b);
    const bool attention = model::causal_attention_fused(q, q, q), packed = model::causal_attention_packed_fused(x, 2);
    const auto y = model::gelu_tanh(x);
    device::force_aten_kernels(before);
    CHECK_FALSE(gelu);
    CHECK_FALSE(bias);
    CHECK_FALSE(attention);
    CHECK_FALSE(packed);
    CHECK(torch::equal(y, at::gelu(x, "tanh")));
    // Not forced: the same tensors are the fused kernels'.
    device::force_aten_kernels(false);
    CHECK(model::gelu_tanh_fused(x));
    CHECK(model::gelu_tanh_bias_fused(x, b));
    const bool takes_attention = q.scalar_type() != torch::kBFloat16 || device::vector_kernels();  // bf16: AVX2 clone
    CHECK(model::causal_attention_fused(q, q, q) == takes_attention);
    CHECK(model::causal_attention_packed_fused(x, 2) == takes_attention);
    device::force_aten_kernels(before);
  }
}

// The bf16 run's residual add (fp32 stream + bf16 branch) in one pass: ATen's x + y bit for bit, forward
// and backward, on both clones, at two thread counts, over a length that ends in a partial piece and a
// partial vector; the predicate takes exactly that pair of dtypes.
TEST_CASE("fused residual add (fp32 + bf16) is ATen's x + y bit for bit, forward and backward") {
  torch::manual_seed(23);
  const auto x0 = torch::randn({3, 129, 97}) * 5;  // 37539 elements: 2 whole pieces of 16384 and a partial one
  const auto y0 = (torch::randn({3, 129, 97}) * 3).to(torch::kBFloat16);
  const auto g = torch::randn({3, 129, 97});
  auto x_ref = x0.clone().requires_grad_(), y_ref = y0.clone().requires_grad_();
  const auto want = x_ref + y_ref;
  want.backward(g);
  for (const bool baseline : {true, false}) {
    if (!baseline && !vector_clones_run_here()) continue;
    CAPTURE(baseline);
    const bool before = device::force_baseline_kernels(baseline);
    auto x = x0.clone().requires_grad_(), y = y0.clone().requires_grad_();
    REQUIRE(model::residual_add_fused(x, y));
    const auto got = model::residual_add(x, y);
    got.backward(g);
    const auto other = at_other_thread_count([&] {
      torch::NoGradGuard no_grad;
      return model::residual_add(x0, y0);
    });
    device::force_baseline_kernels(before);
    CHECK(got.scalar_type() == torch::kFloat32);
    CHECK(torch::equal(got, want));
    CHECK(torch::equal(other, want));
    REQUIRE(y.grad().scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(x.grad(), x_ref.grad()));
    CHECK(torch::equal(y.grad(), y_ref.grad()));
  }
  // Only fp32 + bf16 of one shape, contiguous, fuses; everything else is ATen's add, and so is every
  // pair under SUBLINEAR_ATEN_KERNELS.
  const auto xf = torch::randn({4, 8}), yb = torch::randn({4, 8}).to(torch::kBFloat16);
  CHECK_FALSE(model::residual_add_fused(xf, xf));
  CHECK_FALSE(model::residual_add_fused(yb, xf));
  CHECK_FALSE(model::residual_add_fused(xf, yb.narrow(1, 0, 1)));
  CHECK_FALSE(model::residual_add_fused(xf, torch::randn({8, 4}).to(torch::kBFloat16).t()));
  CHECK(torch::equal(model::residual_add(xf, yb.narrow(1, 0, 1)), xf + yb.narrow(1, 0, 1)));
  const bool before = device::force_aten_kernels(true);
  const bool fused = model::residual_add_fused(xf, yb);
  device::force_aten_kernels(before);
  CHECK_FALSE(fused);
}

namespace {

// While alive, CPU autocast runs in `dtype` (as precision::AutocastGuard does for the trainer).
class CpuAutocast {
 public:
  explicit CpuAutocast(at::ScalarType dtype)
      : enabled_(at::autocast::is_autocast_enabled(at::kCPU)), dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~CpuAutocast() {
    at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, dtype_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool enabled_;
  at::ScalarType dtype_;
};

}  // namespace

// The fused LayerNorm into bf16 (model/layernorm.h) against fp64 and ATen. Output: within half a bf16
// ulp of the fp64 norm plus the fp32 arithmetic's error before the rounding (2e-6 relative of the
// normalised value times w, plus |b|'s); against ATen's fp32 layer_norm rounded to bf16 it differs
// only where that fp32 value sits near a rounding boundary, by one ulp. Gradients (from a bf16 output
// gradient, widened exactly, as autocast's cast node hands ATen's layer_norm): dx within 1e-5
// relative (+1e-6 of its scale) of ATen's, dw and db (sums over 111 rows) within 1e-5 relative (+1e-5);
// dw and db the same bits at another thread count. Both clones; with and without the bias. (The file's
// header: dx chains two reductions of C = 45 terms, 2 x 6 sqrt(45) u = 4.8e-6 each, within 1e-5 of
// the terms' size; dw, db one of 111 rows, 7.5e-6.)
TEST_CASE("fused LayerNorm into bf16: ATen's fp32 layer_norm rounded once; gradients to fp32 rounding") {
  torch::manual_seed(25);
  const int64_t C = 45;  // 5 whole vectors of 8 and a partial one
  const auto x0 = torch::randn({3, 37, C}) * 3 + 0.5;
  const auto w0 = torch::randn({C}), b0 = torch::randn({C});
  const auto dy = torch::randn({3, 37, C}).to(torch::kBFloat16);
  const double eps = 1e-5;
  for (const bool with_bias : {true, false}) {
    const auto b_ref = with_bias ? b0 : torch::Tensor();
    // fp64 reference and ATen's fp32 norm with its gradients.
    const auto x64 = f64(x0);
    const auto mean = x64.mean(-1, true), var = x64.var(-1, /*unbiased=*/false, true);
    auto want = (x64 - mean) / (var + eps).sqrt() * f64(w0);
    if (with_bias) want = want + f64(b0);
    auto xa = x0.clone().requires_grad_(), wa = w0.clone().requires_grad_(), ba = b0.clone().requires_grad_();
    const auto aten = at::layer_norm(xa, {C}, wa, with_bias ? std::optional<at::Tensor>(ba) : std::nullopt, eps);
    aten.backward(dy.to(torch::kFloat32));  // autocast's cast node widens the bf16 gradient exactly
    for (const bool baseline : {true, false}) {
      if (!baseline && !vector_clones_run_here()) continue;
      CAPTURE(with_bias, baseline);
      const KernelClone clone(baseline);
      auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
      const auto b_arg = with_bias ? b : torch::Tensor();
      torch::Tensor y;
      {
        const CpuAutocast autocast(at::kBFloat16);
        REQUIRE(model::layer_norm_bf16_fused(x, w, b_arg));
        y = model::layer_norm_bf16(x, w, b_arg, eps);
      }
      REQUIRE(y.scalar_type() == torch::kBFloat16);
      y.backward(dy);
      const auto scale = (want - (with_bias ? f64(b0) : torch::zeros_like(want))).abs();
      CHECK(rounded_once(y, want, 0.0, 2e-6 * scale + (with_bias ? 1e-6 * f64(b0).abs() : torch::zeros_like(want))));
      const auto aten_bf16 = aten.detach().to(torch::kBFloat16);
      const auto differ = y.ne(aten_bf16);
      INFO(differ.sum().item<int64_t>() << " of " << y.numel() << " outputs differ from ATen's rounded");
      CHECK((f64(y) - f64(aten_bf16)).abs().le(bf16_ulp(aten_bf16)).all().item<bool>());
      CHECK(differ.sum().item<int64_t>() * 100 <= y.numel());
      CHECK(torch::allclose(x.grad(), xa.grad(), 1e-5, 1e-6 * max_abs(xa.grad())));
      CHECK(torch::allclose(w.grad(), wa.grad(), 1e-5, 1e-5));
      if (with_bias) CHECK(torch::allclose(b.grad(), ba.grad(), 1e-5, 1e-5));
      if (!with_bias) CHECK_FALSE(b.grad().defined());
      const auto other = at_other_thread_count([&] {
        auto xo = x0.clone().requires_grad_(), wo = w0.clone().requires_grad_(), bo = b0.clone().requires_grad_();
        model::layer_norm_bf16(xo, wo, with_bias ? bo : torch::Tensor(), eps).backward(dy);
        return std::vector<torch::Tensor>{wo.grad(), with_bias ? bo.grad() : torch::zeros({C})};
      });
      CHECK(torch::equal(other[0], w.grad()));
      if (with_bias) CHECK(torch::equal(other[1], b.grad()));
    }
  }
}

// The norm takes the fused form only for an fp32 contiguous stream under bf16 autocast with fp32
// parameters of its width, the fused kernels on.
TEST_CASE("fused LayerNorm into bf16: the predicate") {
  const int64_t C = 45;
  const auto x0 = torch::randn({3, 37, C}), w0 = torch::randn({C}), b0 = torch::randn({C});
  CHECK_FALSE(model::layer_norm_bf16_fused(x0, w0, b0));  // no autocast: the linear reads fp32
  const CpuAutocast autocast(at::kBFloat16);
  CHECK(model::layer_norm_bf16_fused(x0, w0, b0));
  CHECK_FALSE(model::layer_norm_bf16_fused(x0.to(torch::kBFloat16), w0, b0));
  const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  CHECK_FALSE(model::layer_norm_bf16_fused(bf16(x0), bf16(w0), bf16(b0)));  // a bf16 stream: the CUDA kernel's alone
  CHECK_FALSE(model::layer_norm_bf16_fused(x0.transpose(0, 1), w0, b0));
  CHECK_FALSE(model::layer_norm_bf16_fused(x0, w0.to(torch::kBFloat16), b0));
  CHECK_FALSE(model::layer_norm_bf16_fused(x0, w0, torch::randn({C + 1})));
  const bool before = device::force_aten_kernels(true);
  const bool fused = model::layer_norm_bf16_fused(x0, w0, b0);
  device::force_aten_kernels(before);
  CHECK_FALSE(fused);
  {
    const CpuAutocast fp16(at::kHalf);
    CHECK_FALSE(model::layer_norm_bf16_fused(x0, w0, b0));
  }
}

// With the projection's bias (model/residual.h), for a bf16 run's bf16 branch and an fp32 run's fp32 one:
// x + (y + b) in fp32, which is ATen's fp32 composition of the same order bit for bit; dx = g and
// dy = g in y's dtype (bf16: rounded to nearest even) bit for bit; db the column sums of g in fp32,
// against fp64 within the bound of a sum of n terms rounded n times (n 2^-24 sum |g|), and the same bits
// at another thread count.
TEST_CASE("fused residual add with the bias: x + (y + b) in fp32, dy = g in y's dtype, db = g summed over rows") {
  torch::manual_seed(24);
  const auto x0 = torch::randn({3, 129, 97}) * 5;  // 387 rows: 12 whole pieces of 32 rows and a partial one
  const auto b0 = torch::randn({97});
  const auto g = torch::randn({3, 129, 97});
  const auto g64 = g.to(torch::kDouble).reshape({-1, 97});
  const auto db_want = g64.sum(0), db_bound = g64.abs().sum(0) * (387 * std::ldexp(1.0, -24));
  // A bf16 run's branch (dy = bf16(g)) and an fp32 run's (dy = g).
  for (const auto& [baseline, branch] : {std::pair{true, torch::kBFloat16}, std::pair{false, torch::kBFloat16},
                                        std::pair{true, torch::kFloat32}, std::pair{false, torch::kFloat32}}) {
    if (!baseline && !vector_clones_run_here()) continue;
    CAPTURE(baseline, branch);
    const auto y0 = (torch::randn({3, 129, 97}) * 3).to(branch);
    const auto want = x0 + (y0.to(torch::kFloat32) + b0);
    const KernelClone clone(baseline);
    auto x = x0.clone().requires_grad_(), y = y0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    const auto got = model::residual_add(x, y, b);
    got.backward(g);
    const auto other = at_other_thread_count([&] {
      auto xo = x0.clone().requires_grad_(), yo = y0.clone().requires_grad_(), bo = b0.clone().requires_grad_();
      model::residual_add(xo, yo, bo).backward(g);
      return bo.grad();
    });
    CHECK(got.scalar_type() == torch::kFloat32);
    CHECK(torch::equal(got, want));
    CHECK(torch::equal(x.grad(), g));
    REQUIRE(y.grad().scalar_type() == branch);
    CHECK(torch::equal(y.grad(), g.to(branch)));
    REQUIRE(b.grad().scalar_type() == torch::kFloat32);
    INFO("max |db - fp64| " << (b.grad().to(torch::kDouble) - db_want).abs().max().item<double>());
    CHECK(((b.grad().to(torch::kDouble) - db_want).abs() <= db_bound).all().item<bool>());
    CHECK(torch::equal(other, b.grad()));
  }
  // A strided y (the checkpointing's output-free linear hands the add an expanded placeholder) gives the
  // same values and the same gradients, bit for bit: what a recomputed block yields cannot depend on it.
  auto grads_of = [&](const torch::Tensor& y0s) {
    auto x = x0.clone().requires_grad_(), y = y0s.detach().requires_grad_(), b = b0.clone().requires_grad_();
    const auto out = model::residual_add(x, y, b);
    out.backward(g);
    return std::vector<torch::Tensor>{out, x.grad(), y.grad(), b.grad()};
  };
  for (const auto branch : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(branch);
    const auto y0 = (torch::randn({3, 129, 97}) * 3).to(branch);
    const auto y_strided = y0.transpose(0, 1).contiguous().transpose(0, 1);
    REQUIRE_FALSE(y_strided.is_contiguous());
    const auto contiguous = grads_of(y0), strided = grads_of(y_strided);
    for (size_t i = 0; i < contiguous.size(); ++i) {
      CAPTURE(i);
      CHECK(torch::equal(contiguous[i], strided[i]));
    }
    // The placeholder's own shape: one value expanded (no copy of it is made).
    const auto placeholder = torch::zeros({1}, y0.options()).expand(y0.sizes());
    const auto expanded = grads_of(placeholder), materialised = grads_of(placeholder.contiguous());
    for (size_t i = 0; i < expanded.size(); ++i) {
      CAPTURE(i);
      CHECK(torch::equal(expanded[i], materialised[i]));
    }
  }
}

// The model asks before its projection: the bias goes to the add only for an fp32 stream (without
// autocast, or under bf16 CPU autocast), an fp32 bias of the stream's width, and the fused kernels on.
TEST_CASE("fused residual add with the bias: the predicate") {
  const auto xf = torch::randn({4, 8}), bf = torch::randn({8});
  CHECK(model::residual_bias_fused(xf, bf));  // no autocast: an fp32 run's fp32 branch
  {
    const CpuAutocast bf16(at::kBFloat16);
    CHECK(model::residual_bias_fused(xf, bf));
    CHECK_FALSE(model::residual_bias_fused(xf, bf.to(torch::kBFloat16)));
    CHECK_FALSE(model::residual_bias_fused(xf, torch::randn({4})));
    CHECK_FALSE(model::residual_bias_fused(xf.to(torch::kBFloat16), bf));
    const bool before = device::force_aten_kernels(true);
    const bool fused = model::residual_bias_fused(xf, bf);
    device::force_aten_kernels(before);
    CHECK_FALSE(fused);
  }
  {
    const CpuAutocast fp16(at::kHalf);
    CHECK_FALSE(model::residual_bias_fused(xf, bf));
  }
  // Other operands (an fp32 branch) take ATen's x + (y + b).
  const auto y32 = torch::randn({4, 8});
  CHECK(torch::equal(model::residual_add(xf, y32, bf), xf + (y32 + bf)));
}

namespace {

// Output, input gradient and parameter gradients (by name) of one GPT-2 block for x and upstream dy.
std::map<std::string, torch::Tensor> block_run(model::Block& block, const torch::Tensor& x0, const torch::Tensor& dy,
                                               bool autocast) {
  auto x = x0.clone().requires_grad_(true);
  block->zero_grad();
  torch::Tensor y;
  {
    std::optional<CpuAutocast> guard;
    if (autocast) guard.emplace(at::kBFloat16);
    y = block->forward(x, model::Rope{});
  }
  y.backward(dy.to(y.scalar_type()));
  std::map<std::string, torch::Tensor> out{{"y", y.detach()}, {"dx", x.grad()}};
  for (const auto& p : block->named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

}  // namespace

// A GPT-2 block under CPU autocast to bf16, as the trainer runs precision.compute bf16: asked with the
// tensors the block has there, the predicates send the fc bias into the bf16 GELU, the projections'
// biases into the residual adds and the bf16 QKV output into the packed attention. Against the same
// block on ATen's kernels (force_aten_kernels: SDPA and gelu in bf16, the biases in the linears), both
// measured against the block in fp32 by the relative error norm |got - fp32| / |fp32|: for every tensor
// (output, input and parameter gradients) ours is at most ATen's plus u = 2^-8, bf16's unit roundoff
// (half an ulp is at most 2^-8 of a value, so a rounding moves a tensor by at most u of its norm).
// Not "at most ATen's": the roundings of the matmuls' operands and outputs, common to both paths,
// dominate (both errors are 0.3-0.8 %, one to two u), and the two paths differ only in where they round
// around them (the bias added in fp32 before the fused kernels' one rounding, the attention's
// probabilities kept in fp32 on its fp32 products): a rounding one path does and the other does not,
// or does at another point, of at most u each; which path lands nearer fp32 in one tensor is chance.
// Such a rounding moves the tensor it rounds by at most u of its norm, and the maps after it (linears
// of random, well-conditioned weights, norms, residual adds) pass a relative change on at about its
// size, so it moves a result's error norm by about u at most. b_out's gradient, dy summed in fp32
// rather than bf16(dy) summed and rounded, is ~1e-7 against ATen's ~u/2.
TEST_CASE("a GPT-2 block under bf16 autocast takes the bf16 fused kernels, as close to fp32 as on ATen's") {
  torch::manual_seed(17);
  config::ModelConfig c;
  c.arch = config::Arch::kGpt2, c.n_layer = 1, c.n_head = 4, c.n_embd = 64, c.vocab_size = 50, c.max_seq_len = 80;
  model::Block block(c, 0, torch::kCPU);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block->parameters()) p.add_(torch::randn_like(p) * 0.1);
  }
  const auto x = torch::randn({2, 70, c.n_embd});
  const auto dy = torch::randn_like(x);
  {
    CpuAutocast autocast(at::kBFloat16);
    const auto qkv = at::linear(x, block->w_qkv, block->b_qkv);
    REQUIRE(qkv.scalar_type() == torch::kBFloat16);
    CHECK(model::causal_attention_packed_fused(qkv, c.n_head) == device::vector_kernels());  // bf16: AVX2 clone
    CHECK(model::gelu_tanh_bias_fused(x, block->b_fc));  // x: the fp32 residual stream, as h in the block
    CHECK(model::residual_bias_fused(x, block->b_proj));  // the projections' biases go to the residual adds
    CHECK(model::residual_bias_fused(x, block->b_out));
  }
  const auto fp32 = block_run(block, x, dy, /*autocast=*/false);
  const auto fused = block_run(block, x, dy, /*autocast=*/true);
  const bool before = device::force_aten_kernels(true);
  const auto aten = block_run(block, x, dy, /*autocast=*/true);
  device::force_aten_kernels(before);
  // The relative error norm |got - fp32| / |fp32|.
  auto rel_err = [](const torch::Tensor& got, const torch::Tensor& want) {
    return (f64(got) - f64(want)).norm().item<double>() / f64(want).norm().item<double>();
  };
  for (const auto& [name, want] : fp32) {
    CAPTURE(name);
    const double ours = rel_err(fused.at(name), want), theirs = rel_err(aten.at(name), want);
    INFO("relative error vs fp32: fused " << ours << ", ATen " << theirs << " (u = 2^-8 = " << 0x1p-8 << ")");
    CHECK(ours <= theirs + 0x1p-8);
  }
  CHECK_FALSE(torch::equal(fused.at("y"), aten.at("y")));  // the two paths did differ
}

// ---- the widened linear (model/linear.h) ----
//
// What a low-precision linear can promise. Its output (and each gradient) element is a sum of n exact
// terms: a product of two bf16 values has at most 16 significant bits, of two fp16 values 22, so each is
// exact in fp32; the bias, rounded, is one more term. Whatever the order of the fp32 sums (the widened
// path's chunked MKL GEMMs, ATen's fallback GEMM, oneDNN's bf16 kernels, AMX pairs), the fp32 result f
// is within (n - 1) u sum|t| of the exact sum e (u = 2^-24; Higham, Accuracy and Stability, 4.2), and
// the result is f rounded once to the compute dtype. The reference is e computed in fp64 from the same
// rounded operands, then rounded to the dtype (through fp32: off by at most u |e| more before the last
// rounding). So, for every element:
//  (a) |got - ref| <= (ulp(got) + ulp(ref)) / 2 + 2 n u sum|t|: the two roundings, the worst-case fp32
//      error, and a factor 2 for the reference's double rounding (u |e| <= u sum|t|) and spare;
//  (b) "within one ulp": the worst case is far from what fp32 sums do (their roundings have random
//      signs, the error grows like sqrt(n): measured |f - e| <= 0.51 u sqrt(n sum t^2) for MKL's fp32
//      GEMM of x W^T at 300 x 768 x 3072). Where E = 4 u sqrt(n sum t^2) + u |e| (8x that margin, and the
//      reference's double rounding) is at most a quarter of ulp(ref), f and the value the reference
//      rounds are within ulp(ref)/4 of each other, and two values that close round at most one grid step
//      apart: |got - ref| <= ulp(ref). This covers every element but those whose sum cancels far below
//      its terms (|e| below ~0.5 % of sqrt(n sum t^2) for bf16, ~2 % for fp16), where no fp32 summation
//      order can promise one ulp (MKL's fp32 GEMM of x W^T at 300 x 768 x 3072, rounded to bf16, is more
//      than one ulp off on 7 of 0.9 M elements, 11 at worst); the covered share is checked to be >= 90 % (it is a
//      property of the data: measured >= 99.2 % for bf16 against fp64 and >= 95.7 % between two fp32
//      orders, >= 94 % for fp16, whose ulp is 8x finer);
//  (c) >= 99 % of the elements are bitwise the rounded reference: they differ only where f and e lie on
//      either side of a rounding boundary (measured below: > 99.96 % for bf16, > 99.79 % for fp16).
// ulp(v): 2^(floor(log2 |v|) - 7) for bf16, 2^(floor(log2 |v|) - 10) for fp16 (below the dtype's
// smallest normal, the subnormal spacing).

namespace {

// While alive, the fused kernels are forced off (on = true) or on; restores the setting.
class ForcedAtenKernels {
 public:
  explicit ForcedAtenKernels(bool on) : before_(device::force_aten_kernels(on)) {}
  ~ForcedAtenKernels() { device::force_aten_kernels(before_); }
  ForcedAtenKernels(const ForcedAtenKernels&) = delete;
  ForcedAtenKernels& operator=(const ForcedAtenKernels&) = delete;

 private:
  bool before_;
};

constexpr double kFp32Unit = 0x1p-24;

const char* dtype_name(c10::ScalarType dt) { return dt == torch::kBFloat16 ? "bf16" : dt == torch::kHalf ? "fp16" : "fp32"; }

// One ulp of dt (bf16 or fp16) at |v|, in fp64.
torch::Tensor lowp_ulp(const torch::Tensor& v, c10::ScalarType dt) {
  const bool bf16 = dt == torch::kBFloat16;
  const auto [mantissa, exponent] = torch::frexp(f64(v).abs().clamp_min(std::ldexp(1.0, bf16 ? -126 : -14)));
  return torch::ldexp(torch::ones_like(mantissa), exponent - (bf16 ? 8 : 11));
}

// The exact product A B (fp64, from A and B as given: pass them rounded), plus an optional extra term
// broadcast over rows (the bias), with what bounds its fp32 summation: sum |t|, sum t^2, n.
struct ProductRef {
  torch::Tensor exact, abs_sum, sq_sum;
  int64_t n;
};
ProductRef product_ref(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& extra = {}) {
  const auto a = f64(A), b = f64(B);
  ProductRef r{a.mm(b), a.abs().mm(b.abs()), a.square().mm(b.square()), a.size(1)};
  if (extra.defined()) {
    const auto e = f64(extra);
    r.exact += e, r.abs_sum += e.abs(), r.sq_sum += e.square(), r.n += 1;
  }
  return r;
}

struct Agreement {
  double max_ulps, equal, covered;
};

// got (dt, or dt's values in another dtype) against the reference rounded to dt: (a), (b) and (c) above.
Agreement check_rounded_product(const std::string& what, const torch::Tensor& got, const ProductRef& ref,
                                c10::ScalarType dt) {
  REQUIRE(got.sizes() == ref.exact.sizes());
  const auto g = f64(got), e = ref.exact;
  const auto r = f64(e.to(torch::kFloat).to(dt));
  const auto ulp_r = lowp_ulp(r, dt), diff = (g - r).abs();
  const double n = static_cast<double>(ref.n);
  const auto worst = 0.5 * (lowp_ulp(g, dt) + ulp_r) + 2 * n * kFp32Unit * ref.abs_sum;
  const auto covered = 4 * kFp32Unit * (n * ref.sq_sum).sqrt() + kFp32Unit * e.abs() <= 0.25 * ulp_r;
  const Agreement a{(diff / ulp_r).max().item<double>(), (g == r).to(torch::kDouble).mean().item<double>(),
                    covered.to(torch::kDouble).mean().item<double>()};
  fmt::print("  {} {}: max {} ulps ({} where covered), {:.5f} bitwise equal, one-ulp bound covers {:.4f}\n",
             dtype_name(dt), what, a.max_ulps, (diff / ulp_r).masked_select(covered).max().item<double>(), a.equal,
             a.covered);
  INFO(what << " (" << dtype_name(dt) << "): max ulps " << a.max_ulps << ", bitwise equal " << a.equal
            << ", covered " << a.covered);
  CHECK((diff <= worst).all().item<bool>());                                             // (a)
  CHECK((diff.masked_select(covered) <= ulp_r.masked_select(covered)).all().item<bool>());  // (b)
  CHECK(a.covered >= 0.90);
  CHECK(a.equal >= 0.99);  // (c)
  return a;
}

// Two results that are each f rounded once, for two fp32 sums f1, f2 of the same exact terms: each
// within E of e, so where 2 E <= ulp(a)/4 they are roundings of values a quarter ulp apart, at most one
// ulp apart ((b) with f1 in e's place); everywhere within the two roundings and twice (a)'s fp32 bound;
// >= 99 % bitwise equal.
Agreement check_same_rounding(const std::string& what, const torch::Tensor& a, const torch::Tensor& b,
                              const ProductRef& ref, c10::ScalarType dt) {
  REQUIRE(a.sizes() == ref.exact.sizes());
  REQUIRE(b.sizes() == ref.exact.sizes());
  const auto fa = f64(a), fb = f64(b);
  const auto ulp_a = lowp_ulp(fa, dt), diff = (fa - fb).abs();
  const double n = static_cast<double>(ref.n);
  const auto worst = 0.5 * (ulp_a + lowp_ulp(fb, dt)) + 4 * n * kFp32Unit * ref.abs_sum;
  const auto covered = 8 * kFp32Unit * (n * ref.sq_sum).sqrt() <= 0.25 * ulp_a;
  const Agreement r{(diff / ulp_a).max().item<double>(), (fa == fb).to(torch::kDouble).mean().item<double>(),
                    covered.to(torch::kDouble).mean().item<double>()};
  fmt::print("  {} {} widened vs ATen: max {} ulps ({} where covered), {:.5f} bitwise equal, one-ulp bound "
             "covers {:.4f}\n",
             dtype_name(dt), what, r.max_ulps, (diff / ulp_a).masked_select(covered).max().item<double>(), r.equal,
             r.covered);
  INFO(what << " (" << dtype_name(dt) << ") widened vs ATen: max ulps " << r.max_ulps << ", bitwise equal "
            << r.equal << ", covered " << r.covered);
  CHECK((diff <= worst).all().item<bool>());
  CHECK((diff.masked_select(covered) <= ulp_a.masked_select(covered)).all().item<bool>());
  CHECK(r.covered >= 0.90);
  CHECK(r.equal >= 0.99);
  return r;
}

struct LinearResult {
  torch::Tensor y, dx, dW, db;
};

// y = f(x, W, b) under CPU autocast to dt (x, W, b: fresh fp32 leaves), then y.backward(gy) outside it.
template <class F>
LinearResult linear_run(F&& f, const torch::Tensor& x0, const torch::Tensor& W0, const torch::Tensor& b0,
                        const torch::Tensor& gy, c10::ScalarType dt) {
  auto x = x0.clone().requires_grad_(true), W = W0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
  torch::Tensor y;
  {
    CpuAutocast autocast(dt);
    y = f(x, W, b);
  }
  y.backward(gy);
  return {y.detach(), x.grad(), W.grad(), b.grad()};
}

const auto widened_linear = [](const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  return model::linear(x, W, b);
};
const auto aten_linear = [](const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  return at::linear(x, W, b);
};

// The fp64 references of a linear's four results (y, dx, dW, db as (N, 1)) from x, W, b and gy rounded
// to dt, as 2-D products.
std::array<ProductRef, 4> linear_refs(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b,
                                      const torch::Tensor& gy, c10::ScalarType dt) {
  const int64_t N = W.size(0), K = W.size(1);
  const auto x2 = x.reshape({-1, K}).to(dt), Wr = W.to(dt), gy2 = gy.reshape({-1, N}).to(dt);
  return {product_ref(x2, Wr.t(), b.to(dt)), product_ref(gy2, Wr), product_ref(gy2.t(), x2),
          product_ref(gy2.t(), torch::ones({x2.size(0), 1}))};
}

// Test 1's checks of one linear under autocast to dt; returns the result.
LinearResult check_linear_against_fp64(const std::vector<int64_t>& x_shape, int64_t N, c10::ScalarType dt) {
  const int64_t K = x_shape.back();
  const auto x = torch::randn(x_shape), W = torch::randn({N, K}), b = torch::randn({N});
  auto gy_shape = x_shape;
  gy_shape.back() = N;
  const auto gy = torch::randn(gy_shape).to(dt);
  const int64_t M = x.numel() / K;
  fmt::print("widened linear {} M {} K {} N {} (chunk rows {}, widened: {}):\n", dtype_name(dt), M, K, N,
             model::widened_chunk_rows(M, K, N), [&] {
               CpuAutocast autocast(dt);
               return model::widened_dtype(x).has_value();
             }());
  const auto got = linear_run(widened_linear, x, W, b, gy, dt);
  CHECK(got.y.scalar_type() == dt);
  CHECK(got.dx.scalar_type() == torch::kFloat);
  CHECK(got.dW.scalar_type() == torch::kFloat);
  CHECK(got.db.scalar_type() == torch::kFloat);
  CHECK(got.y.sizes() == gy.sizes());
  // The gradients are the compute dtype's values, cast to the parameters' (and x's) fp32.
  CHECK(torch::equal(got.dW.to(dt).to(torch::kFloat), got.dW));
  CHECK(torch::equal(got.dx.to(dt).to(torch::kFloat), got.dx));
  CHECK(torch::equal(got.db.to(dt).to(torch::kFloat), got.db));
  const auto refs = linear_refs(x, W, b, gy, dt);
  check_rounded_product("y", got.y.reshape({M, N}), refs[0], dt);
  check_rounded_product("dx", got.dx.reshape({M, K}), refs[1], dt);
  check_rounded_product("dW", got.dW, refs[2], dt);
  check_rounded_product("db", got.db.view({N, 1}), refs[3], dt);
  return got;
}

}  // namespace

TEST_CASE("widened linear: bf16 output, input, weight and bias gradients are the fp64 products of the rounded "
          "operands, rounded once to bf16 (at most one bf16 ulp off where fp32 summation order crosses a "
          "rounding boundary)") {
  torch::manual_seed(21);
  // Several chunks: M = 300 rows of GPT-2 small's fc (768 -> 3072), 273 rows a chunk, the last one short.
  CHECK(model::widened_chunk_rows(300, 768, 3072) == 273);
  check_linear_against_fp64({3, 100, 768}, 3072, torch::kBFloat16);
  // One chunk.
  CHECK(model::widened_chunk_rows(37, 64, 96) == 37);
  check_linear_against_fp64({37, 64}, 96, torch::kBFloat16);
}

TEST_CASE("widened linear: the same bits as ATen's bf16 linear up to fp32 summation order") {
  torch::manual_seed(22);
  const auto dt = torch::kBFloat16;
  // ATen's fallback bf16 GEMM is slow: M K N <= 2e7. One chunk; and several (the 256-row floor of a
  // wide linear: 256 + 44) through a narrow, wide one.
  CHECK(model::widened_chunk_rows(300, 16, 4096) == 256);
  for (const auto& [M, K, N] : std::vector<std::array<int64_t, 3>>{{37, 64, 96}, {20, 768, 1024}, {300, 16, 4096}}) {
    CAPTURE(M, K, N);
    const auto x = torch::randn({M, K}), W = torch::randn({N, K}), b = torch::randn({N});
    const auto gy = torch::randn({M, N}).to(dt);
    const auto ours = linear_run(widened_linear, x, W, b, gy, dt);
    LinearResult aten;
    {
      const ForcedAtenKernels forced(true);
      aten = linear_run(widened_linear, x, W, b, gy, dt);
    }
    // Forced off, the linear is at::linear itself.
    const auto direct = linear_run(aten_linear, x, W, b, gy, dt);
    CHECK(torch::equal(aten.y, direct.y));
    CHECK(torch::equal(aten.dx, direct.dx));
    CHECK(torch::equal(aten.dW, direct.dW));
    CHECK(torch::equal(aten.db, direct.db));
    const bool widened = [&] {
      CpuAutocast autocast(dt);
      return model::widened_dtype(x).has_value();
    }();
    fmt::print("widened linear vs ATen, M {} K {} N {} (widened: {}):\n", M, K, N, widened);
    // ATen's linear, whatever its kernel on this CPU (its fallback GEMM, oneDNN's emulated or native bf16
    // GEMM, AMX), against the independent fp64 reference of the rounded operands: (a), (b), (c) above.
    const auto refs = linear_refs(x, W, b, gy, dt);
    check_rounded_product("ATen y", aten.y.reshape({M, N}), refs[0], dt);
    check_rounded_product("ATen dx", aten.dx.reshape({M, K}), refs[1], dt);
    check_rounded_product("ATen dW", aten.dW, refs[2], dt);
    check_rounded_product("ATen db", aten.db.view({N, 1}), refs[3], dt);
    if (!widened) {
      // The CPU has a low-precision GEMM: model::linear hands the call to at::linear, the same bits. The
      // results' own accuracy is the fp64 check just above.
      CHECK(torch::equal(ours.y, aten.y));
      CHECK(torch::equal(ours.dx, aten.dx));
      CHECK(torch::equal(ours.dW, aten.dW));
      CHECK(torch::equal(ours.db, aten.db));
      continue;
    }
    CHECK(ours.y.scalar_type() == aten.y.scalar_type());
    CHECK(ours.dx.scalar_type() == aten.dx.scalar_type());
    CHECK(ours.dW.scalar_type() == aten.dW.scalar_type());
    CHECK(ours.db.scalar_type() == aten.db.scalar_type());
    check_same_rounding("y", ours.y, aten.y, refs[0], dt);
    check_same_rounding("dx", ours.dx, aten.dx, refs[1], dt);
    check_same_rounding("dW", ours.dW, aten.dW, refs[2], dt);
    check_same_rounding("db", ours.db.view({N, 1}), aten.db.view({N, 1}), refs[3], dt);
  }
}

TEST_CASE("widened linear takes its path exactly where the CPU has no low-precision GEMM") {
  const auto& f = device::cpu_features();
  fmt::print("widened linear paths: bf16 matmul {}, fp16 matmul {}, fused kernels {}\n", device::to_string(f.bf16_matmul),
             device::to_string(f.fp16_matmul), device::fused_kernels());
  // What widened_dtype should say for compute dtype dt, with the fused kernels forced off or not.
  auto expected = [&](c10::ScalarType dt, bool forced_off) -> std::optional<c10::ScalarType> {
    const auto path = dt == torch::kBFloat16 ? f.bf16_matmul : f.fp16_matmul;
    const bool slow = path == device::LowpMatmul::aten || path == device::LowpMatmul::emulated;
    if (slow && device::fused_kernels() && !forced_off) return dt;
    return std::nullopt;
  };
  // Whether a linear on x (W and b in W_dtype) runs as the widened autograd node.
  auto runs_widened = [](const torch::Tensor& x, c10::ScalarType W_dtype) {
    const auto W = torch::randn({6, 8}).to(W_dtype).requires_grad_(true), b = torch::randn({6}).to(W_dtype);
    const auto y = model::linear(x, W, b);
    return y.grad_fn() != nullptr && y.grad_fn()->name().find("WidenedLinear") != std::string::npos;
  };
  const auto x32 = torch::randn({4, 8});
  for (const bool forced_off : {false, true}) {
    CAPTURE(forced_off);
    const ForcedAtenKernels forced(forced_off);
    // No autocast: x's own dtype decides; fp32 never widens.
    CHECK_FALSE(model::widened_dtype(x32).has_value());
    CHECK_FALSE(runs_widened(x32, torch::kFloat));
    for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
      CAPTURE(dt);
      const auto xl = x32.to(dt);
      CHECK(model::widened_dtype(xl) == expected(dt, forced_off));
      CHECK(runs_widened(xl, dt) == expected(dt, forced_off).has_value());
      // Under CPU autocast to dt: autocast's dtype decides, for fp32 x and for x in the other low dtype.
      CpuAutocast autocast(dt);
      CHECK(model::widened_dtype(x32) == expected(dt, forced_off));
      CHECK(runs_widened(x32, torch::kFloat) == expected(dt, forced_off).has_value());
      const auto other = dt == torch::kBFloat16 ? torch::kHalf : torch::kBFloat16;
      CHECK(model::widened_dtype(x32.to(other)) == expected(dt, forced_off));
      // The path the planner and summary.json report for the model's linears says the same.
      CHECK((f.linear_path(dt == torch::kBFloat16 ? config::Dtype::kBf16 : config::Dtype::kFp16) == device::LowpMatmul::widened) ==
            expected(dt, false).has_value());
      // Not on the CPU, or no tensor: never.
      CHECK_FALSE(model::widened_dtype(torch::empty({4, 8}, torch::TensorOptions().device(torch::kMeta))).has_value());
      CHECK_FALSE(model::widened_dtype(torch::Tensor()).has_value());
    }
  }
}

TEST_CASE("widened linear: a recomputed call gives the same bits") {
  torch::manual_seed(23);
  for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
    CAPTURE(dt);
    const auto x = torch::randn({3, 100, 768}), W = torch::randn({3072, 768}), b = torch::randn({3072});
    const auto gy = torch::randn({3, 100, 3072}).to(dt);
    const auto first = linear_run(widened_linear, x, W, b, gy, dt);
    const auto other_memory = torch::randn({12345});  // the second call's buffers elsewhere
    const auto second = linear_run(widened_linear, x, W, b, gy, dt);
    CHECK(torch::equal(first.y, second.y));
    CHECK(torch::equal(first.dx, second.dx));
    CHECK(torch::equal(first.dW, second.dW));
    CHECK(torch::equal(first.db, second.db));
  }
}

TEST_CASE("widened mm and linear_weight_grad equal the fp64 reference of the rounded operands") {
  torch::manual_seed(24);
  // a (M, K) b (K, N) and gy2 (M, N)^T a2 (M, K): 256 rows a chunk (the floor), 256 + 44.
  const int64_t M = 300, K = 256, N = 8192;
  CHECK(model::widened_chunk_rows(M, K, N) == 256);
  for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
    CAPTURE(dt);
    fmt::print("widened mm / linear_weight_grad {} M {} K {} N {} (widens: {}):\n", dtype_name(dt), M, K, N,
               model::widened_dtype(torch::empty({1}, dt)).has_value());
    const auto a = torch::randn({M, K}).to(dt), b = torch::randn({K, N});  // b fp32: rounded to a's dtype
    const auto y = model::mm(a, b);
    CHECK(y.scalar_type() == dt);
    check_rounded_product("mm", y, product_ref(a, b.to(dt)), dt);
    const auto gy2 = torch::randn({M, N}).to(dt), a2 = torch::randn({M, K});  // a2 fp32: rounded to gy2's dtype
    const auto dW = model::linear_weight_grad(gy2, a2);
    // Widened: an fp32 tensor of dt's values (rounded in place); else at::mm's, in dt.
    const bool widens = model::widened_dtype(gy2).has_value();
    CHECK(dW.scalar_type() == (widens ? torch::kFloat : dt));
    CHECK(torch::equal(dW.to(dt).to(dW.scalar_type()), dW));
    check_rounded_product("linear_weight_grad", dW, product_ref(gy2.t(), a2.to(dt)), dt);
  }
  // fp32: at::mm itself.
  const auto a = torch::randn({M, K}), b = torch::randn({K, N}), gy2 = torch::randn({M, N});
  CHECK(torch::equal(model::mm(a, b), at::mm(a, b)));
  CHECK(torch::equal(model::linear_weight_grad(gy2, a), gy2.t().mm(a)));
}

TEST_CASE("widened linear: fp16 output, input, weight and bias gradients are the fp64 products of the rounded "
          "operands, rounded once to fp16 (at most one fp16 ulp off where fp32 summation order crosses a "
          "rounding boundary)") {
  torch::manual_seed(25);
  // randn operands: |y| ~ 28 (sums of 768 products), |dx| ~ 55 (3072), far below fp16's 65504.
  const auto got = check_linear_against_fp64({3, 100, 768}, 3072, torch::kHalf);
  CHECK(torch::isfinite(got.y).all().item<bool>());
  CHECK(torch::isfinite(got.dx).all().item<bool>());
}

TEST_CASE("widened linear: an empty batch gives zero weight and bias gradients, as at::linear does; fp64 is left alone") {
  for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
    CAPTURE(dt);
    const auto x = torch::randn({0, 768}).requires_grad_(true);
    const auto W = torch::randn({96, 768}).requires_grad_(true), b = torch::randn({96}).requires_grad_(true);
    torch::Tensor y;
    {
      CpuAutocast autocast(dt);
      y = model::linear(x, W, b);
    }
    CHECK(y.sizes() == torch::IntArrayRef({0, 96}));
    y.backward(torch::empty({0, 96}, torch::TensorOptions().dtype(dt)));
    CHECK(torch::equal(W.grad(), torch::zeros_like(W)));
    CHECK(torch::equal(b.grad(), torch::zeros_like(b)));
    CHECK(x.grad().sizes() == x.sizes());
    CHECK(torch::equal(model::linear_weight_grad(torch::empty({0, 96}, torch::TensorOptions().dtype(dt)),
                                                 torch::empty({0, 768})).to(torch::kFloat),
                       torch::zeros({96, 768})));
    // fp64 under autocast: autocast leaves it alone, and so does model::linear.
    CpuAutocast autocast(dt);
    const auto x64 = torch::randn({4, 8}, torch::kDouble);
    CHECK_FALSE(model::widened_dtype(x64).has_value());
    CHECK(model::linear(x64, torch::randn({6, 8}, torch::kDouble), torch::Tensor()).scalar_type() == torch::kDouble);
  }
}

// The checkpointing nodes (recompute/checkpoint.cpp) take a linear's gradients with mm and
// linear_weight_grad; the widened node takes both in one pass. Every checkpointing mode promises the
// gradients of mode none bitwise, so the two must agree bit for bit, over several chunks.
TEST_CASE("widened linear: its backward equals mm and linear_weight_grad, the checkpointing nodes' matmuls, bitwise") {
  torch::manual_seed(25);
  for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
    CAPTURE(dt);
    const int64_t K = 256, N = 3072;  // 315 rows a chunk: 200 rows in one, 700 in three (315 + 315 + 70)
    REQUIRE(model::widened_chunk_rows(700, K, N) == 315);
    for (const int64_t rows : {200, 700}) {
      const auto x = torch::randn({rows, K}), W = torch::randn({N, K}), b = torch::randn({N});
      const auto gy = torch::randn({rows, N}).to(dt);
      const auto got = linear_run(widened_linear, x, W, b, gy, dt);
      const auto dW = model::linear_weight_grad(gy, x).to(torch::kFloat);
      const auto dx = model::mm(gy, W).to(torch::kFloat);
      CAPTURE(rows, model::widened_chunk_rows(rows, K, N));
      CHECK(torch::equal(got.dW, dW));
      CHECK(torch::equal(got.dx, dx));
      CHECK(torch::equal(got.db, gy.sum(0).to(torch::kFloat)));
    }
  }
}

}  // namespace SUBLINEAR_TEST_FILE
