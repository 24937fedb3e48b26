// The fused LM head + cross-entropy (model/fused_loss.h) against ATen's composition (the linear's
// logits, then cross_entropy_loss), its memory against its model, and the model's loss through it.
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <cstdint>
#include <vector>

#include <fmt/core.h>

#include "catch.h"
#include <torch/torch.h>

#include "config/config.h"
#include "device/cpu_features.h"
#include "memory/tracking_allocator.h"
#include "model/fused_loss.h"
#include "model/gpt.h"
#include "model/linear.h"
#include "precision/autocast.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;

namespace {

constexpr double kU32 = 1.0 / (1 << 24);  // fp32 unit roundoff
constexpr double kUlpBf16 = 1.0 / (1 << 7);  // one bf16 ulp, relative to the value (8 significant bits)
double gamma(double n) { return n * kU32 / (1 - n * kU32); }  // Higham's gamma_n: an n-term fp32 sum

struct Case {
  torch::Tensor h, W, t;
  int64_t valid;
};

Case make_case(int64_t N, int64_t C, int64_t V, int64_t valid, uint64_t seed) {
  torch::manual_seed(seed);
  Case k{torch::randn({N, C}), torch::randn({V, C}) * 0.3, torch::randint(0, valid, {N}), valid};
  return k;
}

struct Result {
  torch::Tensor loss, dh, dW;
};

Result run(const Case& k, bool fused, int64_t chunk) {
  auto h = k.h.clone().requires_grad_(true), W = k.W.clone().requires_grad_(true);
  torch::Tensor loss;
  if (fused) loss = model::linear_cross_entropy(h, W, k.t, chunk, k.valid);
  else loss = model::GPTImpl::loss_of_logits(model::linear(h, W).narrow(1, 0, k.valid), k.t);
  loss.backward();
  return {loss.detach().to(torch::kDouble), h.grad().to(torch::kDouble), W.grad().to(torch::kDouble)};
}

// The bounds, from the reference run's own values (fp64): z the logits, p their softmax over the valid
// columns, y the one-hot targets.
//   e_z  how far one logit may move between the two runs: 2 gamma_C sum_k |h_k||W_k| (two fp32 dot
//        products of C terms in different orders), plus `flip` |z| where the logits are rounded to a
//        low-precision dtype (two sums on either side of a rounding boundary: one ulp apart);
//   delta the softmax's relative error from that: lse and z_t move by e_z each, and the log-sum-exp
//        itself rounds: (V + 4) u over the V exps, their sum and the log;
//   loss  mean over rows of lse - z_t: 2 e_z + 2 (gamma_V + 4u)(1 + |lse|) per row, and gamma_N of
//        the mean's sum;
//   dh, dW  (p - y) W / N and (p - y)^T h / N: p moves by delta p, d's rounding and the products'
//        output rounding may flip (`flip` each, relative to |p - y| and to the product's absolute
//        sum), and fp32 sums of V (dh) or N (dW) terms differ in order (2 gamma).
struct Bounds {
  double loss = 0;
  torch::Tensor dh, dW;
};

Bounds bounds(const Case& k, double flip) {
  const auto h = k.h.to(torch::kDouble), W = k.W.narrow(0, 0, k.valid).to(torch::kDouble);
  const auto z = h.mm(W.t());
  const double C = static_cast<double>(k.h.size(1)), V = static_cast<double>(k.valid), N = static_cast<double>(k.h.size(0));
  const double e_z = 2 * gamma(C) * h.abs().mm(W.abs().t()).max().item<double>() + flip * z.abs().max().item<double>();
  const double lse_err = gamma(V) + 4 * kU32;
  const double delta = 2 * e_z + 2 * lse_err;
  const auto lse = z.logsumexp(1);
  const auto p = (z - lse.unsqueeze(1)).exp();
  const auto y = torch::zeros_like(p).scatter_(1, k.t.unsqueeze(1), 1.0);
  const auto rows = lse - z.gather(1, k.t.unsqueeze(1)).squeeze(1);
  Bounds b;
  b.loss = 2 * e_z + 2 * lse_err * (1 + lse.abs().max().item<double>()) + gamma(N) * rows.abs().max().item<double>();
  const auto pd = (p - y).abs();
  b.dh = ((delta * p + (2 * flip + 2 * gamma(V)) * pd).mm(W.abs()) / N);
  auto dW = ((delta * p + (2 * flip + 2 * gamma(N)) * pd).t().mm(h.abs()) / N);
  b.dW = torch::zeros({k.W.size(0), k.W.size(1)}, torch::kDouble);
  b.dW.narrow(0, 0, k.valid).copy_(dW);
  return b;
}

void check_within(const Result& got, const Result& want, const Bounds& b) {
  CHECK(std::abs(got.loss.item<double>() - want.loss.item<double>()) <= b.loss);
  // Each element within its own bound (and kU32 of its value for the final fp32 rounding of each).
  const auto over_h = (got.dh - want.dh).abs() - b.dh - kU32 * want.dh.abs();
  const auto over_W = (got.dW - want.dW).abs() - b.dW - kU32 * want.dW.abs();
  CHECK(over_h.max().item<double>() <= 0.0);
  CHECK(over_W.max().item<double>() <= 0.0);
}

}  // namespace

TEST_CASE("fused linear + cross-entropy equals ATen's composition in fp32, loss and gradients, for every chunking") {
  // N = 64 rows: the composition's d / N is then exact in any dtype, as the fused d then / N is.
  const Case k = make_case(64, 24, 40, 40, 7);
  const Result want = run(k, false, 0);
  const Bounds b = bounds(k, 0.0);
  for (int64_t chunk : {1, 7, 16, 64, 1000}) {
    INFO("chunk " << chunk);
    check_within(run(k, true, chunk), want, b);
  }
}

TEST_CASE("fused linear + cross-entropy: a padded vocabulary's rows never enter the loss, and get no gradient") {
  const Case k = make_case(64, 24, 48, 41, 11);  // 41 real rows, 7 padding
  const Result want = run(k, false, 0);
  const Result got = run(k, true, 16);
  check_within(got, want, bounds(k, 0.0));
  CHECK(got.dW.narrow(0, 41, 7).abs().max().item<double>() == 0.0);
}

TEST_CASE("fused linear + cross-entropy: ignored targets (-100) add no loss and no gradient; the sum is over every row") {
  const Case k = make_case(64, 24, 40, 40, 13);
  Case masked = k;
  masked.t = k.t.clone();
  const auto ignored = torch::arange(64) % 3 == 0;  // rows 0, 3, ..., 63: 22 of 64
  masked.t.masked_fill_(ignored, model::kIgnoreTarget);
  // The reference: ATen's cross-entropy summed with the same ignore_index, over all 64 rows.
  auto h = k.h.clone().requires_grad_(true), W = k.W.clone().requires_grad_(true);
  auto ref = at::cross_entropy_loss(model::linear(h, W), masked.t, {}, at::Reduction::Sum, model::kIgnoreTarget) / 64.0;
  ref.backward();
  const Result want{ref.detach().to(torch::kDouble), h.grad().to(torch::kDouble), W.grad().to(torch::kDouble)};
  // The bounds of every row (k's targets): the ignored rows add nothing on either side, and each bound's
  // terms are non-negative, so the kept rows' sums are within them.
  const Bounds b = bounds(k, 0.0);
  for (int64_t chunk : {1, 7, 16, 64}) {
    INFO("chunk " << chunk);
    const Result got = run(masked, true, chunk);
    check_within(got, want, b);
    CHECK(got.dh.index({ignored}).abs().max().item<double>() == 0.0);  // an ignored row's d is zero
  }
  // It is not the mean over the kept rows: that is 64/42 of it.
  CHECK(std::abs(run(masked, true, 16).loss.item<double>() * 64.0 / 42.0 - want.loss.item<double>()) > 100 * b.loss);
  // Every target ignored: loss 0, no gradient (not 0/0).
  Case none = k;
  none.t = torch::full({64}, model::kIgnoreTarget, torch::kInt64);
  const Result zero = run(none, true, 16);
  CHECK(zero.loss.item<double>() == 0.0);
  CHECK(zero.dh.abs().max().item<double>() == 0.0);
  CHECK(zero.dW.abs().max().item<double>() == 0.0);
}

TEST_CASE("fused linear + cross-entropy under bf16 autocast: the composition's roundings, within a bf16 ulp", "[numerics]") {
  // Both round h, W, the logits, d and the products to bf16; fp32 sums in another order may put a value
  // on the other side of a rounding boundary (one bf16 ulp, `flip`), on either path (widened or native).
  const Case k = make_case(64, 32, 40, 40, 3);
  Result want, got;
  {
    precision::AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    want = run(k, false, 0);
  }
  for (int64_t chunk : {16, 64}) {
    precision::AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    INFO("chunk " << chunk);
    check_within(run(k, true, chunk), want, bounds(k, kUlpBf16));
  }
}

TEST_CASE("fused linear + cross-entropy without grad mode computes the loss only and keeps nothing") {
  const Case k = make_case(32, 16, 24, 24, 5);
  const auto want = run(k, false, 0).loss.item<double>();
  torch::NoGradGuard no_grad;
  const auto loss = model::linear_cross_entropy(k.h, k.W.requires_grad_(true), k.t, 8, k.valid);
  CHECK_FALSE(loss.requires_grad());
  CHECK(std::abs(loss.item<double>() - want) <= bounds(k, 0.0).loss);
}

TEST_CASE("fused linear + cross-entropy: bad shapes and vocabularies are refused") {
  const Case k = make_case(8, 4, 6, 6, 1);
  CHECK_THROWS_AS(model::linear_cross_entropy(k.h, k.W, k.t.narrow(0, 0, 4), 4, 6), std::invalid_argument);
  CHECK_THROWS_AS(model::linear_cross_entropy(k.h, k.W, k.t, 4, 7), std::invalid_argument);
  CHECK_THROWS_AS(model::linear_cross_entropy(k.h, k.W, k.t, 0, 6), std::invalid_argument);
}

TEST_CASE("the automatic chunk keeps a chunk's fp32 logits within 64 MiB, in rows of 8") {
  CHECK(model::loss_chunk_rows(8192, 50304, 0) == 328);  // 64 MiB / (4 x 50,304) = 333.5 -> 328
  CHECK(4 * 328 * 50304 <= model::kLossChunkBytes);
  CHECK(model::loss_chunk_rows(8192, 256, 0) == 8192);   // a small vocabulary: the whole micro-batch
  CHECK(model::loss_chunk_rows(8192, 50304, 100) == 100);
  CHECK(model::loss_chunk_rows(64, 50304, 100) == 64);
  CHECK(model::loss_chunk_rows(8192, int64_t{1} << 26, 0) == 8);  // at least 8 rows
}

TEST_CASE("fused linear + cross-entropy: the bytes it allocates are its model's, and far below the logits'") {
  memory::TrackingCPUAllocator::install();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const int64_t N = 4096, C = 32, V = 2048, chunk = 64;
  const Case k = make_case(N, C, V, V, 13);
  struct Dtype {
    c10::ScalarType compute;
    bool autocast;
  };
  for (const Dtype d : {Dtype{c10::kFloat, false}, Dtype{c10::kBFloat16, true}}) {
    auto h = k.h.clone().requires_grad_(true), W = k.W.clone().requires_grad_(true);
    const int64_t c = d.compute == c10::kFloat ? 4 : 2;
    const bool widened = model::widened_path(h.device(), d.compute);
    const auto model_bytes = model::fused_loss_bytes(N, C, V, chunk, c, 4, 4, widened, true);
    INFO("compute bytes " << c << ", widened " << widened);
    alloc.reset_peak();
    const int64_t before = alloc.current_bytes();
    torch::Tensor loss;
    {
      precision::AutocastGuard guard(c10::kCPU, d.autocast ? std::optional<c10::ScalarType>(d.compute) : std::nullopt);
      loss = model::linear_cross_entropy(h, W, k.t, chunk, V);
    }
    const int64_t kept = alloc.current_bytes() - before;
    const int64_t peak = alloc.peak_bytes() - before;
    // kept: the 0-d fp32 loss, dh and dW exactly (the allocator counts requested bytes).
    CHECK(kept == model_bytes.kept);
    // peak: the model's moments, whose row vectors are an upper count (ATen may reuse a temporary):
    // within 2 fp32 values a row below it, and at most the 0-d partial sum (4 bytes) above.
    CHECK(peak >= model_bytes.peak - 2 * 4 * chunk);
    CHECK(peak <= model_bytes.peak + 4);
    CHECK(peak * 4 < N * V * 4);  // a quarter of the fp32 logits of the whole batch
    loss.backward();
  }
}

TEST_CASE("the model's loss is the fused head over the final norm: ATen's composition of its logits, tied and untied") {
  for (const bool tied : {true, false}) {
    config::ModelConfig cfg;
    cfg.n_layer = 1, cfg.n_head = 2, cfg.n_embd = 16, cfg.vocab_size = 40, cfg.max_seq_len = 16;
    cfg.tie_embeddings = tied, cfg.loss_chunk = 8;
    torch::manual_seed(1);
    model::GPT m(cfg, torch::kCPU);
    const auto x = torch::randn({4, 16, 16});  // (B, T, C): 64 rows, as the composition's exact 1/N needs
    const auto y = torch::randint(0, 40, {4, 16});
    const auto& W = tied ? m->wte : m->lm_head;
    const auto fused = m->head_loss(x, y);
    const auto fused_dW = torch::autograd::grad({fused}, {W})[0].to(torch::kDouble);
    const auto composed = model::GPTImpl::loss_of_logits(m->head(x), y);
    const auto composed_dW = torch::autograd::grad({composed}, {W})[0].to(torch::kDouble);
    // The final norm at init (weight 1, bias 0) is ATen's layer_norm: the head's input, for the bounds.
    const Case k{at::layer_norm(x, {16}, {}, {}, cfg.norm_eps).reshape({-1, 16}), W.detach(), y.reshape({-1}), 40};
    const Bounds b = bounds(k, 0.0);
    INFO("tied " << tied);
    CHECK(std::abs(fused.item<double>() - composed.item<double>()) <= b.loss);
    CHECK(((fused_dW - composed_dW).abs() - b.dW - kU32 * composed_dW.abs()).max().item<double>() <= 0.0);
  }
}

// What predicts a GPU step's launches without a GPU: the ATen ops (each at least one kernel on CUDA)
// and autograd nodes of one block, forward and backward, on the device-generic path (the CPU with the
// project's fused CPU kernels off, as a CUDA run takes ATen's ops). Counted, not timed; the ceilings
// are the counts of this design, so an added op or cast fails here and is seen.
namespace {

struct BlockOps {
  int64_t forward = 0, backward = 0, casts = 0, nodes = 0;
  std::map<std::string, int64_t> names;
};
thread_local BlockOps* t_counts = nullptr;

// Ops that make no kernel of their own: views, metadata, allocation without a fill.
bool is_metadata(const std::string& name) {
  static const std::set<std::string> kNames = {
      "aten::as_strided", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t",
      "aten::expand", "aten::slice", "aten::narrow", "aten::detach", "aten::resolve_conj", "aten::resolve_neg",
      "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias", "aten::select", "aten::split",
      "aten::chunk", "aten::unflatten", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_",
      "aten::lift_fresh", "aten::_unsafe_view"};
  return kNames.count(name) > 0;
}
thread_local bool t_in_backward = false;

// Autograd nodes reachable from `out` (AccumulateGrad of the leaves excluded): what backward runs.
int64_t graph_nodes(const torch::Tensor& out) {
  std::set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (!n || seen.count(n) || n->name() == "torch::autograd::AccumulateGrad") continue;
    seen.insert(n);
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return static_cast<int64_t>(seen.size());
}

BlockOps count_block(config::Arch arch, std::optional<c10::ScalarType> autocast) {
  const bool was_aten = device::force_aten_kernels(true);
  config::ModelConfig cfg;
  cfg.arch = arch, cfg.n_layer = 1, cfg.n_head = 4, cfg.n_embd = 64, cfg.vocab_size = 64, cfg.max_seq_len = 32;
  cfg.dropout = 0.0;
  torch::manual_seed(2);
  model::GPT m(cfg, torch::kCPU);
  auto* block = (*m->blocks)[0]->as<model::BlockImpl>();
  const auto x = torch::randn({2, 32, 64}).requires_grad_(true);
  BlockOps counts;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                             if (!t_counts || fn.scope() != at::RecordScope::FUNCTION) return nullptr;
                                             const std::string name = fn.name();
                                             if (name.rfind("aten::", 0) != 0 || is_metadata(name)) return nullptr;
                                             ++(t_in_backward ? t_counts->backward : t_counts->forward);
                                             if (name == "aten::_to_copy") ++t_counts->casts;
                                             ++t_counts->names[name];
                                             return nullptr;
                                           }));
  t_counts = &counts;
  torch::Tensor y;
  {
    precision::AutocastGuard guard(c10::kCPU, autocast);
    y = block->forward(x, m->rope(32));
  }
  counts.nodes = graph_nodes(y);
  t_in_backward = true;
  y.backward(torch::ones_like(y));
  t_in_backward = false;
  t_counts = nullptr;
  at::removeCallback(handle);
  device::force_aten_kernels(was_aten);
  return counts;
}

}  // namespace

TEST_CASE("a block's ATen ops and autograd nodes on the device-generic path, gpt2 and llama, fp32 and bf16") {
  struct Ceiling {
    config::Arch arch;
    std::optional<c10::ScalarType> autocast;
    int64_t forward, backward, casts, nodes;
  };
  // LibTorch 2.11 (scripts/setup.sh pins it), a block of d 64, 4 heads, T 32, dropout 0, one process.
  // Under bf16 autocast each linear casts its input and weight (and llama's RMSNorm and RoPE their
  // operands): the casts are what precision.param_dtype: bf16 and fused kernels take away.
  const std::vector<Ceiling> ceilings = {{config::Arch::kGpt2, std::nullopt, 23, 46, 0, 33},
                                         {config::Arch::kGpt2, c10::kBFloat16, 64, 82, 24, 43},
                                         {config::Arch::kLlama, std::nullopt, 75, 117, 6, 55},
                                         {config::Arch::kLlama, c10::kBFloat16, 136, 171, 42, 63}};
  for (const Ceiling& want : ceilings) {
    const BlockOps c = count_block(want.arch, want.autocast);
    std::string names;
    for (const auto& [n, k] : c.names) names += fmt::format("{} {}, ", n, k);
    INFO((want.arch == config::Arch::kLlama ? "llama" : "gpt2") << (want.autocast ? " bf16" : " fp32") << ": forward "
         << c.forward << " backward " << c.backward << " casts " << c.casts << " nodes " << c.nodes << "\n" << names);
    CHECK(c.forward <= want.forward);
    CHECK(c.backward <= want.backward);
    CHECK(c.casts <= want.casts);
    CHECK(c.nodes <= want.nodes);
    CHECK(c.forward > 0);  // the counter sees the block's ops
  }
}

}  // namespace SUBLINEAR_TEST_FILE
