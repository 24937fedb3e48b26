// Model: preset parameter counts (built on the meta device, no memory), shapes, causality, init; the
// fused CPU kernels against ATen, and their baseline clones against their AVX2 + FMA clones.
#include <cmath>
#include <limits>
#include <map>

#include "catch.h"
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "config/config.h"
#include "device/cpu_features.h"
#include "model/attention.h"
#include "model/gelu.h"
#include "model/gpt.h"

using namespace sl;

namespace {
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
  for (const std::string arch : {"gpt2", "llama"}) {
    DYNAMIC_SECTION(arch) {
      torch::manual_seed(0);
      config::ModelConfig c;
      c.arch = arch, c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 50, c.max_seq_len = 16;
      c.bias = arch == "gpt2", c.tie_embeddings = arch == "gpt2";
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
  c.arch = "llama", c.bias = false, c.n_layer = 1;
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
  CHECK(torch::allclose(y, ref, 1e-5, 1e-6));
  auto g = torch::autograd::grad({y}, {x, b->ln1_w}, {dy});
  auto gr = torch::autograd::grad({ref}, {x, b->ln1_w}, {dy});
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
  CHECK(torch::allclose(got, want, /*rtol=*/2e-6, /*atol=*/5e-7));
  CHECK(torch::isfinite(got).all().item<bool>());
  // Gradient: through autograd, against ATen's backward, for an arbitrary upstream gradient.
  auto xr = x.clone().requires_grad_(true);
  const auto g = torch::randn_like(x);
  model::gelu_tanh(xr).backward(g);
  const auto want_grad = at::gelu_backward(g, x, "tanh");
  CHECK(torch::allclose(xr.grad(), want_grad, /*rtol=*/1e-5, /*atol=*/5e-6));  // the same tail
  // The same values with any thread count and split (each element on its own).
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  CHECK(torch::equal(model::gelu_tanh(x), got));
  torch::set_num_threads(threads);
  // An unaligned start and a partial last vector (the tail goes through the same vector code).
  CHECK(torch::equal(model::gelu_tanh(x.narrow(0, 5, 1003)), got.narrow(0, 5, 1003)));
  auto xs = x.narrow(0, 3, 13).clone().requires_grad_(true);
  model::gelu_tanh(xs).backward(g.narrow(0, 3, 13));
  CHECK(torch::equal(xs.grad(), xr.grad().narrow(0, 3, 13)));
  // A NaN stays NaN (the exp's clamp must not turn it into a number a NaN check would miss).
  CHECK(torch::isnan(model::gelu_tanh(torch::full({11}, std::nanf("")))).all().item<bool>());
  // Anything but contiguous fp32 on the CPU is ATen's.
  CHECK_FALSE(model::gelu_tanh_fused(x.to(torch::kBFloat16)));
  CHECK_FALSE(model::gelu_tanh_fused(x.view({2, -1}).t()));
  CHECK(torch::equal(model::gelu_tanh(x.to(torch::kBFloat16)), at::gelu(x.to(torch::kBFloat16), "tanh")));
}

TEST_CASE("a GPT-2 block (fused attention on packed QKV, fc bias in the GELU) equals the block in ATen ops") {
  // The block as the trainer runs it on fp32 CPU against the textbook composition of ATen ops (SDPA,
  // addmm biases, ATen's tanh GELU) on copies of the same parameters: output, input gradient and every
  // parameter gradient, the fc bias's (now summed inside the GELU's backward) included.
  torch::manual_seed(5);
  config::ModelConfig c;
  c.arch = "gpt2", c.n_layer = 1, c.n_head = 3, c.n_embd = 48, c.vocab_size = 50, c.max_seq_len = 40;
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
  CHECK(torch::allclose(y, want, 1e-5, 1e-5));

  const auto dy = torch::randn_like(want);
  y.backward(dy);
  want.backward(dy);
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
    CHECK(torch::allclose(grads[1], dx.sum(std::vector<int64_t>{0, 1}), 1e-5, 1e-5));
    // The bias gradient's bits do not depend on the thread count (fixed pieces, summed in order).
    const int threads = torch::get_num_threads();
    torch::set_num_threads(1);
    const auto grads1 = torch::autograd::grad({model::gelu_tanh_bias(x, b)}, {x, b}, {g});
    torch::set_num_threads(threads);
    CHECK(torch::equal(grads1[0], grads[0]));
    CHECK(torch::equal(grads1[1], grads[1]));
  }
  // Not fused: another dtype, no bias, CPU autocast (the model then keeps the bias in its linear).
  const auto x = torch::randn({4, 8});
  CHECK_FALSE(model::gelu_tanh_bias_fused(x.to(torch::kBFloat16), torch::randn({8})));
  CHECK_FALSE(model::gelu_tanh_bias_fused(x, torch::Tensor()));
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const bool fused = model::gelu_tanh_bias_fused(x, torch::randn({8}));
    at::autocast::set_autocast_enabled(at::kCPU, false);
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
  // hd 24 and 80 end on a half tile (8 columns), hd 12 on scalar columns; T 2, 5 and 68 leave tiles of
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
    CHECK(torch::allclose(y.to(torch::kDouble), want, 1e-5, 1e-5 * c.logit_scale * c.logit_scale));
    // Gradients for an arbitrary upstream gradient.
    const auto dy = torch::randn_like(y);
    const auto got = torch::autograd::grad({y}, {q, k, v}, {dy});
    const auto ref = torch::autograd::grad({want}, {qd, kd, vd}, {dy.to(torch::kDouble)});
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(torch::allclose(got[i].to(torch::kDouble), ref[i], 1e-4, 1e-4 * c.logit_scale));
    }
    // No thread count changes a bit (each (batch, head) is one thread's, in a fixed order), and a second
    // call (a recompute) gives the same bits.
    const int threads = torch::get_num_threads();
    torch::set_num_threads(1);
    const auto y1 = model::causal_attention(q, k, v);
    const auto got1 = torch::autograd::grad({y1}, {q, k, v}, {dy});
    torch::set_num_threads(threads);
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

// While alive, the fused kernels run the clone asked for (baseline forced, or the CPU's vector clone);
// the setting before is restored after.
class KernelClone {
 public:
  explicit KernelClone(bool baseline) : before_(device::force_baseline_kernels(baseline)) {}
  ~KernelClone() { device::force_baseline_kernels(before_); }
  KernelClone(const KernelClone&) = delete;
  KernelClone& operator=(const KernelClone&) = delete;

 private:
  bool before_;
};

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
  // Shapes whose rows end on scalar columns (hd 12), half tiles (hd 24) and partial row tiles (T 5, 70),
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
    CHECK(torch::allclose(base[0], vec[0], 2e-6, 1e-6));
    for (int i = 1; i < 4; ++i) CHECK(torch::allclose(base[i], vec[i], 1e-5, 1e-5));
    // Both clones did run: the vector one's fused multiply-adds round differently somewhere.
    CHECK_FALSE(torch::equal(base[0], vec[0]));
  }
}

TEST_CASE("fused GELU: the baseline clone equals the AVX2 + FMA clone within 1e-6 relative (+1e-7 absolute), "
          "forward and backward, with and without the fc bias (its gradient, a sum over rows: 1e-5)") {
  torch::manual_seed(9);
  const bool vector = vector_clones_run_here();
  // 7 x 11 rows of H 45 (whole vectors and a partial one), typical values and the saturated tails.
  const auto x0 = torch::cat({torch::randn({7, 11, 40}) * 3, torch::linspace(-30, 30, 7 * 11 * 5).view({7, 11, 5})}, 2);
  const auto b0 = torch::randn({45});
  const auto g = torch::randn_like(x0);
  // (y, dx) of the plain form and (y, dx, db) of the bias form, on one clone.
  auto run = [&](bool baseline) {
    KernelClone clone(baseline);
    auto x = x0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    const auto y = model::gelu_tanh(x);
    const auto dx = torch::autograd::grad({y}, {x}, {g})[0];
    const auto yb = model::gelu_tanh_bias(x, b);
    const auto gb = torch::autograd::grad({yb}, {x, b}, {g});
    return std::vector<torch::Tensor>{y, dx, yb, gb[0], gb[1]};
  };
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
    // db sums 77 rows of dx-sized terms: its rounding grows with the sum (measured 1.4e-6 absolute).
    const double tol = i == 4 ? 1e-5 : 1e-6, abs_tol = i == 4 ? 1e-5 : 1e-7;
    CHECK(torch::allclose(base[i], vec[i], tol, abs_tol));
  }
  CHECK_FALSE(torch::equal(base[1], vec[1]));  // both clones did run
}
