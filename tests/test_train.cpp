// Training step pieces: accumulation equals one big batch, LR schedule, optimizer groups,
// model-state bytes, FLOPs formula; the loop's handling of non-finite gradients and unexpected
// errors (faults injected through gradient hooks into a real setup()/train_loop()/finish()); one host
// synchronization per optimizer step, counted from a trace of every ATen op and from the lazy device's
// graph runs; precision.tf32 (MFU's peak; on CUDA, the rounding of an fp32 matmul); the casts of a bf16
// step with bf16 parameters; train.cuda_graphs (eligibility, the CPU run eager, on CUDA a replay bitwise).
#include <atomic>
#include <cmath>
#include <csignal>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>

#include "catch.h"
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/csrc/lazy/core/metrics.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "config/config.h"
#include "config/shape.h"
#include "data/loader.h"
#include "device/build_info.h"
#include "device/cpu_features.h"
#include "device/device.h"
#include "predict/footprint.h"
#include "memory/tracker.h"
#include "model/cuda_fused.h"
#include "model/gpt.h"
#include "parallel/comm.h"
#include "parallel/engine.h"
#include "parallel/single.h"
#include "precision/autocast.h"
#include "precision/loss_scaler.h"
#include "recompute/runner.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "train/cuda_graph.h"
#include "train/peak_flops.h"
#include "train/schedule.h"
#include "train/spike.h"
#include "runs.h"
#include "test_util.h"
#include "train/run.h"
#include "train/trainer.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using nlohmann::json;

namespace {
config::RunConfig small_config() {
  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32"});
  return cfg;
}

// train_loop over a session setup() built, as train::run() calls it.
train::Outcome loop(train::Session& s, train::LoopState& st) {
  return train::train_loop(s.cfg, s.proc, s.learn, s.data, s.meter, s.out, st);
}

train::LossFn fwd(model::GPT& m) {
  return [m](const torch::Tensor& idx, const torch::Tensor& y, const torch::Tensor& p) mutable { return m->loss(idx, y, p); };
}

std::vector<torch::Tensor> grads_of(model::GPT& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m->parameters()) g.push_back(p.grad().clone());
  return g;
}
}  // namespace

TEST_CASE("accumulation 4 x micro-batch 2 gives the gradients of micro-batch 8") {
  auto cfg = small_config();
  torch::manual_seed(0);
  model::GPT m(cfg.model, torch::kCPU);
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(20000, 256, 3);
  data::Loader loader(src, 8, 32, 11);
  auto big = loader.next();

  std::vector<data::Batch> micro;
  for (int i = 0; i < 4; ++i) micro.push_back({big.x.narrow(0, 2 * i, 2), big.y.narrow(0, 2 * i, 2)});
  parallel::Single single(m);
  m->zero_grad();
  const double loss_acc = train::forward_backward(fwd(m), micro, torch::kCPU, single).item<double>();
  auto g_acc = grads_of(m);

  m->zero_grad();
  const double loss_big = train::forward_backward(fwd(m), {big}, torch::kCPU, single).item<double>();
  auto g_big = grads_of(m);

  CHECK(loss_acc == Approx(loss_big).epsilon(1e-6));
  REQUIRE(g_acc.size() == g_big.size());
  double worst = 0.0;
  for (size_t i = 0; i < g_acc.size(); ++i) worst = std::max(worst, (g_acc[i] - g_big[i]).abs().max().item<double>());
  CHECK(worst < 1e-6);
  // And the comparison can fail: without the 1/n normalization the gradients are 4x larger.
  CHECK((g_acc[1] * 4 - g_big[1]).abs().max().item<double>() > 1e-6);
}

TEST_CASE("LR: linear warm-up, cosine to min_lr at the last step") {
  config::TrainConfig t;
  t.lr = 1e-3, t.min_lr = 1e-4, t.warmup_steps = 10, t.steps = 110;
  // A few double operations each side (~1e-16 relative); Approx's default, 100 float epsilons
  // (1.2e-5 relative), is far above that and far below any wrong schedule's difference.
  CHECK(train::lr_at(t, 0) == Approx(1e-4));
  CHECK(train::lr_at(t, 9) == Approx(1e-3));
  CHECK(train::lr_at(t, 10) == Approx(1e-3));
  CHECK(train::lr_at(t, 109) == Approx(1e-4));
  CHECK(train::lr_at(t, 60) == Approx(1e-4 + 0.5 * 9e-4 * (1 + std::cos(M_PI * 50.0 / 99.0))));
  for (int64_t s = 10; s < 109; ++s) CHECK(train::lr_at(t, s + 1) <= train::lr_at(t, s));
}

namespace {
// The ATen ops a stepper calls on the calling thread (a RecordFunction callback on every op), by name.
struct OpNames {
  static inline thread_local std::map<std::string, int64_t>* t_seen = nullptr;
  std::map<std::string, int64_t> seen;
  at::CallbackHandle handle;
  OpNames() {
    t_seen = &seen;
    handle = at::addThreadLocalCallback(at::RecordFunctionCallback([](const at::RecordFunction& fn) {
      if (t_seen) ++(*t_seen)[fn.name()];
      return std::unique_ptr<at::ObserverContext>();
    }));
  }
  ~OpNames() {
    at::removeCallback(handle);
    t_seen = nullptr;
  }
};

// Two identical parameter sets on `device`: one stepped by LibTorch's AdamW, one by `stepper`, for 6
// steps. A matrix that decays, a vector that does not (two groups), and a parameter that never gets a
// gradient (both skip it). Tolerances: the same update rounded in another order. Each step forms m, v
// and p with at most 2 fp32 roundings more on either side (u = 2^-24 relative each), and an earlier
// difference carries over damped (beta < 1), so after 6 steps: p within 6 x 2 u ~ 7e-7 of |p| (rtol
// 1e-6) plus 12 u of the updates' size lr x 6 = 0.018 (2e-8, atol 1e-7); m within 12 u (|m| + 0.1 max|g|),
// max|g| ~ 9 (randn x 2 over 19,200 draws, 4.5 sigma): 6.4e-7 where m cancels (atol 1e-6); v a sum of
// positive terms: 12 u |v| (rtol 1e-6; atol 1e-10 for v near 0). Returns the ATen ops the stepper called
// in its last step.
template <typename Stepper>
std::map<std::string, int64_t> check_adamw_against_libtorch(const torch::Device& device, Stepper stepper) {
  torch::manual_seed(11);
  const std::vector<torch::Tensor> init = {torch::randn({64, 300}).to(device), torch::randn({300}).to(device),
                                           torch::randn({7}).to(device)};
  auto make = [&] {
    std::vector<torch::Tensor> ps;
    for (const auto& t : init) ps.push_back(t.clone().requires_grad_(true));
    config::TrainConfig t;
    t.lr = 3e-3, t.weight_decay = 0.1, t.beta1 = 0.9, t.beta2 = 0.95;
    return std::make_pair(ps, optim::make_adamw({ps[0]}, {ps[1], ps[2]}, t));
  };
  auto [ref_p, ref_opt] = make();
  auto [got_p, got_opt] = make();
  std::map<std::string, int64_t> ops;
  for (int step = 1; step <= 6; ++step) {
    for (int i = 0; i < 2; ++i) {
      const auto g = torch::randn(init[i].sizes()).to(device) * (i + 1);
      ref_p[i].mutable_grad() = g.clone();
      got_p[i].mutable_grad() = g.clone();
    }
    ref_opt->step();
    OpNames names;
    stepper(*got_opt);
    ops = names.seen;
  }
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    CHECK(torch::allclose(got_p[i], ref_p[i], 1e-6, 1e-7));
    auto& want = static_cast<torch::optim::AdamWParamState&>(*ref_opt->state().at(ref_p[i].unsafeGetTensorImpl()));
    auto& got = static_cast<torch::optim::AdamWParamState&>(*got_opt->state().at(got_p[i].unsafeGetTensorImpl()));
    CHECK(got.step() == 6);
    CHECK(want.step() == 6);
    INFO("max |diff|: p " << (got_p[i] - ref_p[i]).abs().max().item().toFloat() << " m "
                          << (got.exp_avg() - want.exp_avg()).abs().max().item().toFloat() << " v "
                          << (got.exp_avg_sq() - want.exp_avg_sq()).abs().max().item().toFloat());
    CHECK(got.exp_avg().device() == device);
    CHECK(torch::allclose(got.exp_avg(), want.exp_avg(), 1e-6, 1e-6));
    CHECK(torch::allclose(got.exp_avg_sq(), want.exp_avg_sq(), 1e-6, 1e-10));
  }
  CHECK(torch::equal(got_p[2], init[2]));  // no gradient: untouched, and no state made
  CHECK(got_opt->state().count(got_p[2].unsafeGetTensorImpl()) == 0);
  CHECK_FALSE(torch::equal(got_p[0], init[0]));
  return ops;
}
}  // namespace

TEST_CASE("the fused AdamW step equals torch::optim::AdamW::step to float rounding, on AdamW's own state") {
  const auto ops = check_adamw_against_libtorch(torch::kCPU, [](auto& opt) { optim::adamw_step(opt); });
  CHECK(ops.count("aten::_fused_adamw_") == 0);  // the project's kernel, not ATen's
  for (const char* op : {"aten::mul_", "aten::add_", "aten::addcmul_", "aten::addcdiv_", "aten::lerp_", "aten::sqrt"})
    CHECK(ops.count(op) == 0);  // nor AdamW::step's elementwise ops
}

TEST_CASE("the grouped AdamW step (the CUDA path) is one at::_fused_adamw_ per group, equal to AdamW::step; "
          "run here on the CPU kernel of the same op") {
  const auto ops = check_adamw_against_libtorch(torch::kCPU, [](auto& opt) { REQUIRE(optim::adamw_step_grouped(opt)); });
  CHECK(ops.at("aten::_fused_adamw_") == 2);  // the decay and no-decay groups
  CHECK(ops.count("aten::add_") + ops.count("aten::mul_") + ops.count("aten::addcdiv_") == 0);
}

TEST_CASE("on CUDA, adamw_step is one at::_fused_adamw_ per group, equal to AdamW::step", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  const auto ops = check_adamw_against_libtorch(torch::Device(torch::kCUDA, 0), [](auto& opt) { optim::adamw_step(opt); });
  CHECK(ops.at("aten::_fused_adamw_") == 2);
  CHECK(ops.count("aten::add_") + ops.count("aten::mul_") + ops.count("aten::addcdiv_") == 0);
}

TEST_CASE("adamw_step_grouped: parameters at different step counts equal AdamW::step (the kernel's steps per tensor)") {
  // One group; the vector gets no gradient at step 1, so from step 2 on the two step counts differ and
  // the step scalars go to the kernel from a host list.
  torch::manual_seed(5);
  const std::vector<torch::Tensor> init = {torch::randn({8, 5}), torch::randn({5})};
  auto make = [&] {
    std::vector<torch::Tensor> ps;
    for (const auto& t : init) ps.push_back(t.clone().requires_grad_(true));
    config::TrainConfig t;
    t.lr = 3e-3, t.weight_decay = 0.1;
    return std::make_pair(ps, optim::make_adamw(ps, {}, t));
  };
  auto [ref_p, ref_opt] = make();
  auto [got_p, got_opt] = make();
  for (int step = 1; step <= 4; ++step) {
    for (size_t i = 0; i < init.size(); ++i) {
      const auto g = step == 1 && i == 1 ? torch::Tensor() : torch::randn(init[i].sizes());
      ref_p[i].mutable_grad() = g.defined() ? g.clone() : g;
      got_p[i].mutable_grad() = g.defined() ? g.clone() : g;
    }
    ref_opt->step();
    REQUIRE(optim::adamw_step_grouped(*got_opt));
  }
  for (size_t i = 0; i < init.size(); ++i) {
    CAPTURE(i);
    auto& got = static_cast<torch::optim::AdamWParamState&>(*got_opt->state().at(got_p[i].unsafeGetTensorImpl()));
    CHECK(got.step() == (i == 0 ? 4 : 3));
    CHECK(torch::allclose(got_p[i], ref_p[i], 1e-6, 1e-7));
  }
}

TEST_CASE("adamw_step_grouped refuses what the fused op cannot take (amsgrad, a dtype it has no kernel for), changing nothing") {
  auto p = torch::randn({4}).requires_grad_(true), q = torch::randn({4}, torch::kFloat64).requires_grad_(true);
  p.mutable_grad() = torch::ones({4});
  q.mutable_grad() = torch::ones({4}, torch::kFloat64);
  config::TrainConfig t;
  auto mixed = optim::make_adamw({p}, {q}, t);
  const auto before = p.clone();
  CHECK_FALSE(optim::adamw_step_grouped(*mixed));  // fp64 is not among the fused op's dtypes
  CHECK(mixed->state().empty());
  CHECK(torch::equal(p, before));
  auto ams = optim::make_adamw({p}, {}, t);
  static_cast<torch::optim::AdamWOptions&>(ams->param_groups()[0].options()).amsgrad(true);
  CHECK_FALSE(optim::adamw_step_grouped(*ams));
  CHECK(torch::equal(p, before));
}

TEST_CASE("the fused AdamW update is bitwise the same on the baseline clone and the AVX2 + FMA clone", "[avx2]") {
  // DDP replicas on different CPU kinds must step identical weights. Sizes whose tails are not whole
  // vectors (1, 7, 13, 1031, 16389 = 2^14 + 5: a second piece of 5), a decayed and an undecayed group,
  // gradients of several scales, 5 steps with a changing learning rate.
  if (!device::cpu_has_avx2_fma())
    SUBLINEAR_SKIP("this CPU has no AVX2 + FMA: the vector clone cannot run here; nothing to compare the baseline with");
  torch::manual_seed(12);
  const std::vector<std::vector<int64_t>> shapes = {{1}, {7}, {13}, {1031}, {16389}, {37, 29}};
  std::vector<torch::Tensor> init;
  for (const auto& s : shapes) init.push_back(torch::randn(s));
  auto make = [&] {
    std::vector<torch::Tensor> ps;
    for (const auto& t : init) ps.push_back(t.clone().requires_grad_(true));
    config::TrainConfig t;
    t.lr = 3e-3, t.weight_decay = 0.1, t.beta1 = 0.9, t.beta2 = 0.95;
    return std::make_pair(ps, optim::make_adamw({ps[4], ps[5]}, {ps[0], ps[1], ps[2], ps[3]}, t));
  };
  auto [base_p, base_opt] = make();
  auto [vec_p, vec_opt] = make();
  const bool before = device::force_baseline_kernels(false);
  for (int step = 1; step <= 5; ++step) {
    for (size_t i = 0; i < init.size(); ++i) {
      const auto g = torch::randn_like(init[i]) * std::pow(10.0, static_cast<double>(i % 3) - 1.0);
      base_p[i].mutable_grad() = g.clone();
      vec_p[i].mutable_grad() = g.clone();
    }
    for (auto* opt : {base_opt.get(), vec_opt.get()})
      for (auto& group : opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(3e-3 / step);
    device::force_baseline_kernels(true);
    optim::adamw_step(*base_opt);
    device::force_baseline_kernels(false);
    optim::adamw_step(*vec_opt);
  }
  device::force_baseline_kernels(before);
  for (size_t i = 0; i < init.size(); ++i) {
    CAPTURE(i);
    auto& b = static_cast<torch::optim::AdamWParamState&>(*base_opt->state().at(base_p[i].unsafeGetTensorImpl()));
    auto& v = static_cast<torch::optim::AdamWParamState&>(*vec_opt->state().at(vec_p[i].unsafeGetTensorImpl()));
    INFO("max |baseline - vector| of p " << (base_p[i] - vec_p[i]).abs().max().item<float>());
    CHECK(torch::equal(base_p[i], vec_p[i]));
    CHECK(torch::equal(b.exp_avg(), v.exp_avg()));
    CHECK(torch::equal(b.exp_avg_sq(), v.exp_avg_sq()));
    CHECK_FALSE(torch::equal(base_p[i], init[i]));  // they did step
  }
}

// The CPU path's clipping (two passes over all gradients) against LibTorch's clip_grad_norm_: sizes with
// partial vectors and a second 2^15-element piece (40000), a norm above the threshold (scaled), one
// below (untouched, bit for bit), an infinite gradient (untouched, norm not finite), and the baseline
// clone's norm bit for bit the AVX2 + FMA clone's.
TEST_CASE("clip_grad_norm on CPU: LibTorch's clip_grad_norm_ to float rounding; untouched below the threshold or when not finite") {
  torch::manual_seed(13);
  const std::vector<std::vector<int64_t>> shapes = {{1}, {7}, {40000}, {64, 300}};
  auto params_with_grads = [&](double scale) {
    std::vector<torch::Tensor> ps;
    for (const auto& s : shapes) {
      auto p = torch::zeros(s).requires_grad_(true);
      p.mutable_grad() = torch::randn(s) * scale;
      ps.push_back(p);
    }
    return ps;
  };
  auto grads_of = [](const std::vector<torch::Tensor>& ps) {
    std::vector<torch::Tensor> gs;
    for (const auto& p : ps) gs.push_back(p.grad());
    return gs;
  };
  for (const double clip : {1.0, 1e6}) {
    CAPTURE(clip);
    auto ref = params_with_grads(0.5), got = params_with_grads(0.0);
    for (size_t i = 0; i < ref.size(); ++i) got[i].mutable_grad().copy_(ref[i].grad());
    const auto before = grads_of(got);
    std::vector<torch::Tensor> saved;
    for (const auto& g : before) saved.push_back(g.clone());
    double sq = 0.0;  // the fp64 reference: the norm, and the gradients scaled by its coefficient
    for (const auto& g : saved) sq += g.to(torch::kFloat64).pow(2).sum().item<double>();
    const double exact = std::sqrt(sq), coef = std::min(1.0, clip / (exact + 1e-6));
    // LibTorch's norm: each tensor's in fp32 by ATen's cascade reduction (an error of at most a few tens
    // of u = 2^-24 for these sizes, log2 n levels plus the vector lanes), then the norm of the norms.
    const double libtorch = torch::nn::utils::clip_grad_norm_(ref, clip);
    OpNames names;
    const auto norm = optim::clip_grad_norm(grads_of(got), clip);
    for (const char* op : {"aten::norm", "aten::linalg_vector_norm", "aten::mul_"})
      CHECK(names.seen.count(op) == 0);  // the CPU passes, not the ATen ops
    REQUIRE(norm.scalar_type() == torch::kFloat32);
    // fp64 sum and sqrt (~1e-13), then one fp32 rounding (2^-24 = 6e-8 relative): within 1e-7.
    CHECK(std::abs(norm.item<double>() - exact) <= 1e-7 * exact);
    // LibTorch's fp32 norm (above: tens of u) and ours: 1e-5 = 168 u covers both.
    CHECK(std::abs(norm.item<double>() - libtorch) <= 1e-5 * libtorch);
    for (size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(i);
      // fp32 roundings of the norm, the coefficient and the product: 3 * 2^-24 relative at most
      CHECK(torch::allclose(got[i].grad().to(torch::kFloat64), saved[i].to(torch::kFloat64) * coef, 2.4e-7, 0.0));
      // Scaled by coefficients from the two norms (within 1e-5 relative, above), each product rounded
      // once more on either side: 1e-5 + 3 u.
      CHECK(torch::allclose(got[i].grad(), ref[i].grad(), 1e-5 + 3 * 0x1p-24, 0.0));
      if (clip > exact) CHECK(torch::equal(got[i].grad(), saved[i]));  // below the threshold: untouched
      else CHECK_FALSE(torch::equal(got[i].grad(), saved[i]));
    }
  }
  auto inf = params_with_grads(1.0);
  inf[2].mutable_grad()[5] = std::numeric_limits<float>::infinity();
  std::vector<torch::Tensor> saved;
  for (const auto& p : inf) saved.push_back(p.grad().clone());
  CHECK_FALSE(std::isfinite(optim::clip_grad_norm(grads_of(inf), 1.0).item<double>()));
  for (size_t i = 0; i < inf.size(); ++i) CHECK(torch::equal(inf[i].grad(), saved[i]));
  if (device::cpu_has_avx2_fma()) {
    const auto ps = params_with_grads(3.0);
    const bool was = device::force_baseline_kernels(true);
    const float base = optim::clip_grad_norm(grads_of(ps), 0.0).item<float>();
    device::force_baseline_kernels(false);
    const float vec = optim::clip_grad_norm(grads_of(ps), 0.0).item<float>();
    device::force_baseline_kernels(was);
    CHECK(base == vec);
  }
}

// The engine's gradient norm (ZeRO and DDP, and bf16 parameter copies at world 1) takes the clipping's
// fused float64 pass where its gradients are CPU tensors: no float64 copy (the planner counts none),
// the sum of squares to float64 rounding; anything else (a bf16 or strided tensor) is refused, and
// CUDA keeps the float64 chunks the planner counts (offload.gradients' host shards do not).
TEST_CASE("sum_of_squares: float64 over fp32 CPU gradients, the engine's norm on the CPU without a float64 copy") {
  torch::manual_seed(17);
  std::vector<torch::Tensor> gs;
  double ref = 0.0;
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{40000}, int64_t{70001}}) {
    gs.push_back(torch::randn({n}) * 3.0);
    ref += gs.back().to(torch::kFloat64).pow(2).sum().item<double>();
  }
  // Each square of an fp32 value is exact in float64 and every term is positive, so a sum's error is at
  // most (its number of sequential additions) x u of the sum (u = 2^-53; Higham 4.2): ours adds 2^15 / 16
  // = 2048 terms a lane, 4 tree levels, ~5 pieces (~2057 u); ATen's float64 reference (cascade sum) a few
  // hundred u at most. kSumBound = 4096 u (4.5e-13) covers both, and a float32 sum (~1e-8) fails it.
  constexpr double kSumBound = 4096 * 0x1p-53;
  const auto sq = optim::sum_of_squares(gs);
  REQUIRE(sq.has_value());
  CHECK(std::abs(*sq - ref) <= kSumBound * ref);
  const auto big = torch::randn({40010});  // a view with a storage offset, as zero1's shard of a flat buffer
  const auto part = big.narrow(0, 5, 40000);
  const double part_ref = part.to(torch::kFloat64).pow(2).sum().item<double>();
  CHECK(std::abs(optim::sum_of_squares({part}).value() - part_ref) <= kSumBound * part_ref);
  CHECK_FALSE(optim::sum_of_squares({gs[2].to(torch::kBFloat16)}).has_value());
  CHECK_FALSE(optim::sum_of_squares({gs[0], torch::randn({8, 9}).t()}).has_value());

  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
                                      "train.micro_batch=2", "train.device=cpu", "parallel.timeout_s=60",
                                      "parallel.sharding=zero1"});
  torch::manual_seed(cfg.train.seed);
  model::GPT m(cfg.model, torch::kCPU);
  parallel::LaunchEnv env;
  env.rank = 0, env.world = 1, env.local_rank = 0, env.local_world = 1, env.master_port = test::free_port();
  const auto made = parallel::make_engine(m, parallel::Spec::of(cfg), std::make_shared<parallel::Comm>(env, cfg.parallel, torch::kCPU));
  auto& engine = *made;
  double expected = 0.0;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) {  // the .grad are views of the engine's flat gradient
      REQUIRE(p.grad().defined());
      p.grad().copy_(torch::randn(p.sizes()));
      expected += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
    }
  }
  OpNames names;
  const auto share = engine.grad_norm_sq_share();
  CHECK(names.seen.count("aten::linalg_vector_norm") == 0);
  CHECK(names.seen.count("aten::_to_copy") == 0);
  REQUIRE(share.scalar_type() == torch::kFloat64);
  CHECK(std::abs(share.item<double>() - expected) <= kSumBound * expected);
  CHECK(memory::predict_states(memory::Scenario::of(cfg)).grad_norm_temp_bytes == 0);
  auto cuda = cfg;
  cuda.train.device = config::DeviceChoice::kCuda;
  CHECK(memory::predict_states(memory::Scenario::of(cuda)).grad_norm_temp_bytes > 0);  // the float64 chunks on the GPU
  cuda.parallel.sharding = config::Sharding::kZero2;
  cuda.offload.optimizer = cuda.offload.gradients = true;
  const auto host = memory::predict_states(memory::Scenario::of(cuda));
  CHECK(host.grad_norm_temp_bytes == 0);  // the gradient shards on the host: the CPU pass
  CHECK(host.host_peak_bytes() == host.host_states_bytes() + host.host_snapshot_bytes + host.host_optimizer_temp_bytes);
}

TEST_CASE("AdamW decays matrices only, and its state is two moments per parameter") {
  auto cfg = small_config();
  model::GPT m(cfg.model, torch::kCPU);
  parallel::Single single(m);
  auto opt = single.make_optimizer(cfg.train);
  REQUIRE(opt->param_groups().size() == 2);
  for (const auto& p : opt->param_groups()[0].params()) CHECK(p.dim() >= 2);
  for (const auto& p : opt->param_groups()[1].params()) CHECK(p.dim() < 2);
  auto wd = [&](int g) { return static_cast<torch::optim::AdamWOptions&>(opt->param_groups()[g].options()).weight_decay(); };
  CHECK(wd(0) == cfg.train.weight_decay);
  CHECK(wd(1) == 0.0);

  std::shared_ptr<data::TokenSource> src = data::make_synthetic(5000, 256, 3);
  data::Loader loader(src, 2, 32, 1);
  train::forward_backward(fwd(m), {loader.next()}, torch::kCPU, single);
  opt->step();
  auto bytes = single.state_bytes();
  CHECK(bytes.params == m->num_params() * 4);
  CHECK(bytes.grads == bytes.params);
  CHECK(train::optimizer_state_bytes(*opt) == 2 * bytes.params);
}

TEST_CASE("model FLOPs per token: 6N + 12 L T d") {
  config::ModelConfig c;
  config::apply_preset(c, "gpt2-124m");
  model::GPT m(c, torch::kMeta);
  const double N = 124'439'808.0 - 1024 * 768;
  // Whole numbers far below 2^53 multiplied and added in doubles: exact, so equal.
  CHECK(train::flops_per_token(*m, 1024) == 6 * N + 12.0 * 12 * 1024 * 768);
  // model.vocab_multiple 128: the head's product runs over 50304 rows, 47 more than the vocabulary.
  c.vocab_multiple = 128;
  model::GPT padded(c, torch::kMeta);
  CHECK(padded->num_padding_params() == 47 * 768);
  CHECK(train::flops_per_token(*padded, 1024) == 6 * (N + 47 * 768) + 12.0 * 12 * 1024 * 768);
}

TEST_CASE("eval loss of an untrained model is near log(vocab)") {
  auto cfg = small_config();
  torch::manual_seed(0);
  model::GPT m(cfg.model, torch::kCPU);
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(5000, 256, 3);
  data::Loader loader(src, 4, 32, 1);
  // Not a rounding bound: at GPT-2's init the logits have std ~0.02 sqrt(d) = 0.16 (unit-variance final
  // norm times wte's 0.02 over d = 64), so the expected loss is log V + ~0.16^2 / 2 = log V + 0.013, and
  // the mean over 2 x 4 x 32 = 256 tokens scatters by ~0.16 / sqrt(256) = 0.01: within ~0.05 nats. 5 %
  // of log 256 (0.28 nats) holds that with room and fails a wrong normalisation (a sum, a log2).
  CHECK(train::evaluate(m, loader, 2, torch::kCPU) == Approx(std::log(256.0)).epsilon(0.05));
  CHECK(m->is_training());
}

TEST_CASE("fp16 loss scaling: an inf gradient skips the step, backs off the scale, leaves the weights") {
  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
                                      "precision.compute=fp16", "precision.init_scale=1024"});
  torch::manual_seed(0);
  model::GPT m(cfg.model, torch::kCPU);
  parallel::Single single(m);
  auto opt = single.make_optimizer(cfg.train);
  precision::LossScaler scaler(cfg.precision, torch::kCPU);
  REQUIRE(scaler.enabled());
  const train::StepPrecision prec{precision::compute_dtype(config::Dtype::kFp16), &scaler};
  memory::Tracker tracker(torch::kCPU);
  std::shared_ptr<data::TokenSource> src = data::make_synthetic(5000, 256, 3);
  data::Loader loader(src, 2, 32, 1);

  const train::LossFn loss = fwd(m);
  const train::StepParts parts{.loss = loss, .strategy = single, .opt = *opt, .tracker = tracker,
                               .device = torch::kCPU, .precision = prec, .grad_clip = 1.0};
  // A clean step first: it updates the weights and keeps the scale.
  auto r = train::train_step(parts, {loader.next(), loader.next()});
  CHECK_FALSE(r.skipped);
  CHECK(r.loss_scale == 1024.0);
  CHECK(scaler.scale() == 1024.0);

  // Now an inf in one gradient (a hook on the qkv weight): skip, back off, weights untouched.
  std::vector<torch::Tensor> before;
  for (const auto& p : m->parameters()) before.push_back(p.detach().clone());
  auto* block = m->blocks[0]->as<model::BlockImpl>();
  block->w_qkv.register_hook([](torch::Tensor g) { return g * std::numeric_limits<float>::infinity(); });
  r = train::train_step(parts, {loader.next(), loader.next()});
  CHECK(r.skipped);
  CHECK(r.loss_scale == 1024.0);
  CHECK(scaler.scale() == 512.0);
  auto params = m->parameters();
  for (size_t i = 0; i < params.size(); ++i) CHECK(torch::equal(params[i], before[i]));
}

TEST_CASE("fp16 accumulation: every micro-step uses the same scale; unscaled gradients do not depend on it") {
  auto grads_with = [](const std::string& scale) {
    auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
                                        "precision.compute=fp16", "precision.loss_scale=" + scale});
    torch::manual_seed(0);
    model::GPT m(cfg.model, torch::kCPU);
    precision::LossScaler scaler(cfg.precision, torch::kCPU);
    std::shared_ptr<data::TokenSource> src = data::make_synthetic(5000, 256, 3);
    data::Loader loader(src, 2, 32, 1);
    std::vector<data::Batch> micro;
    for (int i = 0; i < 4; ++i) micro.push_back(loader.next());
    parallel::Single single(m);
    train::forward_backward(fwd(m), micro, torch::kCPU, single, {precision::compute_dtype(config::Dtype::kFp16), &scaler});
    auto g = grads_of(m);
    REQUIRE(scaler.unscale(g).item<float>() == 0.0f);  // no inf/NaN found
    return g;
  };
  // Power-of-two scales are exact in floating point: two scales high enough to avoid underflow give
  // the same unscaled gradients (a scale applied to only some micro-steps would not).
  const auto a = grads_with("1024"), b = grads_with("65536");
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("parameter " << i << " max diff " << (a[i] - b[i]).abs().max().item<double>() << " max " << b[i].abs().max().item<double>());
    // A power-of-two scale moves no rounding boundary of a normal fp16 value, so the two runs round
    // alike except where a backward value is fp16-subnormal at the lower scale (below 2^-14 / 1024 =
    // 6e-8 in gradient units): there its spacing is 2^-24 / 1024 = 5.8e-11 absolute instead of 2^-11
    // relative. A weight gradient sums 4 x 2 x 32 = 256 tokens' terms of activations up to ~10: at most
    // 256 x 10 x 2.9e-11 = 7.4e-8 absolute (atol 2e-6 holds 27 times that); and a normal value one
    // such difference nudges across a rounding boundary moves by one fp16 ulp, 2^-10 relative at most
    // (rtol 1e-3).
    CHECK(torch::allclose(a[i], b[i], 1e-3, 2e-6));
  }
  const auto uneven = grads_with("1");  // no scaling: fp16 gradients underflow, so they differ
  bool all_close = true;
  for (size_t i = 0; i < a.size(); ++i) all_close &= torch::allclose(a[i], uneven[i], 1e-3, 2e-6);
  CHECK_FALSE(all_close);
}

namespace {
// A 3-step run of a 2-layer model on synthetic data into `dir` (no GEMM probe: peak_tflops given).
config::RunConfig loop_config(const std::filesystem::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> sets = {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
                                   "train.micro_batch=2", "train.steps=3", "train.eval_interval=0",
                                   "train.device=cpu", "data.source=synthetic", "data.synthetic_tokens=20000",
                                   "logging.peak_tflops=1", "logging.progress=false", "logging.dir=" + dir.string()};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return config::load_string("", sets);
}

std::vector<torch::Tensor> snapshot(const model::GPT& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// Runs the loop with `fault` applied to block 0's qkv-weight gradient in the backward of every step
// (call = 1, 2, ...); `seen[call]` is a copy of the parameters as that backward found them.
struct FaultRun {
  int code = -1;
  train::LoopState st;
  std::map<int, std::vector<torch::Tensor>> seen;
  std::vector<torch::Tensor> final_params;
  int64_t adam_steps = 0;
};
FaultRun run_with_fault(const config::RunConfig& cfg, std::function<torch::Tensor(int, torch::Tensor)> fault) {
  FaultRun out;
  auto s = train::setup(cfg);
  int call = 0;
  auto* block = s->learn.model->blocks[0]->as<model::BlockImpl>();
  block->w_qkv.register_hook([&, m = s->learn.model](torch::Tensor g) {
    ++call;
    out.seen[call] = snapshot(m);
    return fault(call, g);
  });
  out.code = s->finish(out.st, loop(*s, out.st));
  out.final_params = snapshot(s->learn.model);
  const auto& state = s->learn.opt->state();
  auto it = state.find(block->w_qkv.unsafeGetTensorImpl());
  if (it != state.end()) out.adam_steps = static_cast<torch::optim::AdamWParamState&>(*it->second).step();
  return out;
}

torch::Tensor nan_at_call_2(int call, torch::Tensor g) {
  return call == 2 ? g * std::numeric_limits<float>::quiet_NaN() : g;
}

std::vector<json> records(const std::filesystem::path& dir) {
  std::vector<json> out;
  std::istringstream in(test::read_text(dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}
}  // namespace

TEST_CASE("model.vocab_multiple: a padded run trains as the unpadded one (losses, eval) and its padding rows stay zero "
          "under weight decay") {
  test::TempDir dir("vocab-pad");
  // Vocabulary 250 (synthetic tokens below it), padded to 256; 6 steps with eval after 3 and 6; weight decay 0.1.
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    extra.insert(extra.end(), {"model.vocab_size=250", "train.steps=6", "train.eval_interval=3", "train.eval_batches=2",
                               "train.weight_decay=0.1"});
    auto s = train::setup(loop_config(dir.path / name, extra));
    train::LoopState st;
    REQUIRE(s->finish(st, loop(*s, st)) == kExitOk);
    return s;
  };
  const auto plain = run("plain", {});
  const auto padded = run("padded", {"model.vocab_multiple=128"});
  model::GPT m = padded->learn.model;
  REQUIRE(m->wte.size(0) == 256);
  CHECK(plain->learn.model->wte.size(0) == 250);
  // No gradient reaches the padding rows (their logits are dropped before the loss, no token selects
  // them), and AdamW's decay of a zero weight is zero: exactly zero after every step.
  CHECK(torch::equal(m->wte.detach().narrow(0, 250, 6), torch::zeros({6, 64})));

  // The two runs differ only in the LM head's products: the logits X W^T (sums over C = 64) and the
  // input gradient dZ W (sums over 250 vs 256 rows, the extra 6 terms exactly zero), each an fp32 sum
  // within (n - 1) u sum|t| of the exact one in any order (u = 2^-24, Higham 4.2). Step 1 (the same
  // weights): a logit's sum|t| <= |x| |w| = 8 (unit-variance final norm, sqrt(64)) x 0.16 (a row of 64
  // draws of std 0.02) = 1.3, so |dz| <= 63 u 1.3 = 4.9e-6 per run, 1e-5 apart; a cross-entropy's
  // gradient in its logits has 1-norm <= 2, so the mean loss moves <= 2e-5. Later steps add the weights'
  // drift: gradients within (n - 1) u <= 1.5e-5 relative (n <= 256 terms), and AdamW's update
  // m / (sqrt(v) + eps) is scale-free in the gradient, so it moves by <= lr x 1.5e-5 = 1.5e-8 per weight
  // per step: after 6 steps < 1e-7, under 1e-5 of the weights' 0.02 scale, the size of the rounding
  // above again, per step. 1e-4 covers 6 steps of that with room. The padding in the softmax (6 extra
  // zero logits among 250 near zero) would move the loss by log(256 / 250) = 0.024 at the start.
  constexpr double kTol = 1e-4;
  const auto a = test::step_records(dir.path / "plain" / "metrics.jsonl");
  const auto b = test::step_records(dir.path / "padded" / "metrics.jsonl");
  REQUIRE(a.size() == 6);
  REQUIRE(b.size() == 6);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << a[i].step << ": " << a[i].loss << " vs " << b[i].loss);
    CHECK(std::abs(a[i].loss - b[i].loss) <= kTol);
  }
  const auto ea = test::eval_records(dir.path / "plain" / "metrics.jsonl");
  const auto eb = test::eval_records(dir.path / "padded" / "metrics.jsonl");
  REQUIRE_FALSE(ea.empty());
  REQUIRE(ea.size() == eb.size());
  for (size_t i = 0; i < ea.size(); ++i) CHECK(std::abs(ea[i].second - eb[i].second) <= kTol);

  // The tolerance can fail: the same logits with the padding's zero logits appended (what a loss over the
  // whole product would see) give another loss by far more than it.
  torch::NoGradGuard no_grad;
  m->eval();
  const auto x = torch::randint(0, 250, {2, 32}, torch::kInt64), y = torch::randint(0, 250, {2, 32}, torch::kInt64);
  const auto logits = m->forward(x);
  REQUIRE(logits.size(-1) == 250);
  const auto with_padding = torch::cat({logits, torch::zeros({2, 32, 6})}, -1);
  const double gap = (model::GPTImpl::loss_of_logits(with_padding, y) - model::GPTImpl::loss_of_logits(logits, y)).abs().item<double>();
  CHECK(gap > 10 * kTol);
}

TEST_CASE("NaN gradients with a finite loss: on_nonfinite abort stops before the optimizer step, exit 6") {
  test::TempDir dir("nan-abort");
  const auto r = run_with_fault(loop_config(dir.path / "run"), nan_at_call_2);
  CHECK(r.code == kExitNonFinite);
  CHECK(r.st.steps_done == 1);
  // The weights are those step 2's backward saw: the NaN never reached AdamW.
  REQUIRE(r.seen.count(2));
  CHECK(same(r.final_params, r.seen.at(2)));
  CHECK(r.adam_steps == 1);
  const auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitNonFinite);
  CHECK(summary["exit_status"]["name"] == "non_finite");
  CHECK(summary["exit_status"]["message"].get<std::string>().find("train.on_nonfinite: skip") != std::string::npos);
  const auto recs = records(dir.path / "run");
  REQUIRE(recs.size() == 2);  // step 1, then the event
  CHECK(recs[1]["event"] == "non_finite_grad");
  CHECK(recs[1]["step"] == 2);
  CHECK(std::isfinite(recs[1]["loss"].get<double>()));
}

TEST_CASE("NaN gradients with on_nonfinite skip: that step leaves the weights untouched, a skip event, training goes on") {
  test::TempDir dir("nan-skip");
  const auto r = run_with_fault(loop_config(dir.path / "run", {"train.on_nonfinite=skip"}), nan_at_call_2);
  CHECK(r.code == kExitOk);
  CHECK(r.st.steps_done == 3);
  CHECK(r.st.skipped_steps == 1);
  REQUIRE(r.seen.count(3));
  CHECK(same(r.seen.at(2), r.seen.at(3)));      // step 2 did not move the weights
  CHECK_FALSE(same(r.seen.at(3), r.final_params));  // step 3 did
  CHECK(r.adam_steps == 2);
  for (const auto& p : r.final_params) CHECK(torch::isfinite(p).all().item<bool>());
  const auto recs = records(dir.path / "run");
  int skips = 0;
  for (const auto& rec : recs) {
    if (rec.value("event", "") == "skip") {
      ++skips;
      CHECK(rec["reason"] == "non_finite_grad");
      CHECK(rec["step"] == 2);
    } else if (rec.contains("step") && rec["step"] == 2 && !rec.contains("event")) {
      CHECK(rec["skipped"] == true);
      CHECK(rec["grad_norm"].is_null());
    }
  }
  CHECK(skips == 1);
  const auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  CHECK(summary["skipped_steps"] == 1);
  CHECK(summary["exit_status"]["code"] == kExitOk);
}

TEST_CASE("an unexpected exception inside the loop writes an error event and a complete summary, exit 1") {
  test::TempDir dir("fault");
  const auto r = run_with_fault(loop_config(dir.path / "run"), [](int call, torch::Tensor g) {
    if (call == 2) throw std::runtime_error("injected fault in a gradient hook");
    return g;
  });
  CHECK(r.code == kExitInternal);
  CHECK(r.st.steps_done == 1);
  const auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  CHECK(summary["exit_status"]["code"] == kExitInternal);
  CHECK(summary["exit_status"]["message"].get<std::string>().find("injected fault") != std::string::npos);
  CHECK(summary["steps"] == 1);
  CHECK(summary.contains("memory_breakdown"));
  const auto recs = records(dir.path / "run");
  REQUIRE_FALSE(recs.empty());
  CHECK(recs.back()["event"] == "error");
  CHECK(recs.back()["step"] == 2);
  CHECK(recs.back()["message"].get<std::string>().find("injected fault") != std::string::npos);
}

TEST_CASE("train.global_batch counts sequences per optimizer step over all ranks") {
  struct WorldSize {  // WORLD_SIZE for config::load, restored after
    explicit WorldSize(const char* v) { ::setenv("WORLD_SIZE", v, 1); }
    ~WorldSize() { ::unsetenv("WORLD_SIZE"); }
  };
  const std::vector<std::string> explicit_batch = {"train.micro_batch=4", "train.grad_accum=2", "train.global_batch=16"};
  {
    WorldSize w("2");
    const auto cfg = config::load_string("", explicit_batch);
    CHECK(cfg.world_size == 2);
    CHECK_THROWS_WITH(config::load_string("", {"train.micro_batch=4", "train.grad_accum=2", "train.global_batch=8"}),
                      Catch::Contains("train.global_batch: 8 is not train.micro_batch * train.grad_accum * WORLD_SIZE = 4 * 2 * 2 = 16"));
    // micro_batch: auto divides it by the world size, so it must divide evenly.
    CHECK_NOTHROW(config::load_string("", {"train.micro_batch=auto", "train.global_batch=16", "memory.limit=1GiB"}));
    CHECK_THROWS_WITH(config::load_string("", {"train.micro_batch=auto", "train.global_batch=15", "memory.limit=1GiB"}),
                      Catch::Contains("not divisible by WORLD_SIZE 2"));
  }
  {
    WorldSize w("1");
    CHECK_THROWS_WITH(config::load_string("", explicit_batch), Catch::Contains("train.global_batch: 16 is not"));
    CHECK_NOTHROW(config::load_string("", {"train.micro_batch=4", "train.grad_accum=2", "train.global_batch=8"}));
  }
}

namespace {
// Counts the host synchronizations the calling thread makes, from a RecordFunction callback on every
// ATen op (the mechanism LibTorch's profiler records with): every .item() (aten::_local_scalar_dense),
// every blocking copy between the host and a device (aten::copy_ with non_blocking false: CUDA waits
// for the stream; none on a CPU-only run), and the trainer's one declared read (sublinear::host_read:
// a device-to-host copy on CUDA; on CPU, where nothing waits, the place it would). The ops inside a
// host_read are part of it. Per thread, so in-process ranks (threads) count separately.
namespace syncs {
thread_local int64_t t_count = 0;
thread_local int t_in_read = 0;

bool blocking_cross_device_copy(const at::RecordFunction& fn) {
  const auto in = fn.inputs();
  if (in.size() < 2 || !in[0].isTensor() || !in[1].isTensor()) return false;
  const bool non_blocking = in.size() > 2 && in[2].isBool() && in[2].toBool();
  return !non_blocking && in[0].toTensor().is_cpu() != in[1].toTensor().is_cpu();
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  if (name == "sublinear::host_read") {
    if (t_in_read++ == 0) ++t_count;
  } else if (t_in_read == 0 &&
             (name == "aten::_local_scalar_dense" || (name == "aten::copy_" && blocking_cross_device_copy(fn)))) {
    ++t_count;
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (std::string_view(fn.name()) == "sublinear::host_read") --t_in_read;
}

// Registered while alive (every thread's ops); count() is the calling thread's since reset().
struct Counter {
  at::CallbackHandle handle;
  Counter() : handle(at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end).needsInputs(true))) {}
  ~Counter() { at::removeCallback(handle); }
  static void reset() { t_count = 0; }
  static int64_t count() { return t_count; }
};
}  // namespace syncs

// One rank of an in-process world-2 run (a thread): Comm, runner, engine, optimizer and scaler as
// setup() makes them, then `steps` train_steps of 2 micro-batches; returns its host syncs in them.
// Each step polls the rank's stop reason `stops[rank][step]` and records the agreed one in `agreed`.
int64_t rank_syncs(const config::RunConfig& cfg, model::GPT m, int64_t rank, int port, int64_t steps,
                   const std::vector<int>& stops, std::vector<int>& agreed) {
  parallel::LaunchEnv env;
  env.rank = rank, env.world = 2, env.local_rank = rank, env.local_world = 2, env.master_port = port;
  auto comm = std::make_shared<parallel::Comm>(env, cfg.parallel, torch::kCPU);
  recompute::Runner runner(cfg.checkpointing, m);
  const auto made = parallel::make_engine(m, parallel::Spec::of(cfg), comm);
  auto& engine = *made;
  engine.attach(runner);
  auto opt = engine.make_optimizer(cfg.train);
  precision::LossScaler scaler(cfg.precision, torch::kCPU);
  const train::StepPrecision prec{precision::compute_dtype(cfg.precision.compute), &scaler};
  memory::Tracker tracker(torch::kCPU);
  data::Loader loader(data::make_synthetic(20000, 256, 3), 2, 32, 100 + static_cast<uint64_t>(rank));
  const train::LossFn loss = [&](const torch::Tensor& idx, const torch::Tensor& y, const torch::Tensor& p) { return runner.loss(idx, y, p); };
  syncs::Counter::reset();
  for (int64_t s = 0; s < steps; ++s) {
    const train::StopPoll poll = [&] { return stops[s]; };
    const train::StepParts parts{.loss = loss, .strategy = engine, .opt = *opt, .tracker = tracker,
                                 .device = torch::kCPU, .precision = prec, .grad_clip = 1.0};
    agreed.push_back(train::train_step(parts, {loader.next(), loader.next()}, poll).stop);
  }
  return syncs::Counter::count();
}
}  // namespace

TEST_CASE("the sync counter sees .item()") {
  syncs::Counter counter;
  syncs::Counter::reset();
  CHECK(torch::ones({2}).sum().item<double>() == 2.0);
  CHECK(syncs::Counter::count() == 1);
}

TEST_CASE("one host synchronization per optimizer step: the loop at world 1, accumulation 2, checkpointing full") {
  const std::string compute = GENERATE(as<std::string>{}, "fp32", "fp16");
  test::TempDir dir("syncs");
  // No state saved at the end: a save reads the fp16 growth counter (once per save, not per step).
  auto cfg = loop_config(dir.path / "run", {"train.grad_accum=2", "checkpointing.mode=full", "state.at_end=false",
                                            "precision.compute=" + compute});
  auto s = train::setup(cfg);
  train::LoopState st;
  train::Outcome o;
  int64_t count = 0;
  {
    syncs::Counter counter;
    syncs::Counter::reset();
    o = loop(*s, st);
    count = syncs::Counter::count();
  }
  INFO(compute << ": " << count << " host syncs in " << st.steps_done << " steps: " << o.message);
  REQUIRE(o.code == kExitOk);
  REQUIRE(st.steps_done == 3);
  CHECK(count == st.steps_done);
  s->finish(st, std::move(o));
}

TEST_CASE("one host synchronization per optimizer step on each of two ranks (in-process, Gloo), the stop reason "
          "agreed in it") {
  const std::string sharding = GENERATE(as<std::string>{}, "none", "zero1", "zero2", "zero3");
  const std::string compute = GENERATE(as<std::string>{}, "fp32", "fp16");
  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.dropout=0.0",
                                      "train.seq_len=32", "train.micro_batch=2", "train.grad_accum=2",
                                      "train.device=cpu", "checkpointing.mode=full", "parallel.timeout_s=60",
                                      "parallel.sharding=" + sharding, "precision.compute=" + compute});
  std::vector<model::GPT> models;
  for (int r = 0; r < 2; ++r) {  // built here, one after the other: the seed is process-wide
    torch::manual_seed(cfg.train.seed);
    models.emplace_back(cfg.model, torch::kCPU);
  }
  syncs::Counter counter;
  const int port = test::free_port();
  const int64_t steps = 4;
  // What each rank's poll says at each step (one rank at a time, both, an I/O failure beside a
  // signal) and what both must agree on: the largest.
  const std::vector<std::vector<int>> stops = {{0, 0, SIGINT, train::kStopIo}, {0, SIGTERM, SIGTERM, SIGINT}};
  const std::vector<int> expected = {0, SIGTERM, SIGTERM, train::kStopIo};
  std::vector<std::vector<int>> agreed(2);
  std::vector<int64_t> counts(2, -1);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        counts[r] = rank_syncs(cfg, models[r], r, port, steps, stops[r], agreed[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO(sharding << " " << compute << " rank " << r << ": " << counts[r] << " host syncs in " << steps
                  << " steps " << errors[r]);
    CHECK(errors[r].empty());
    CHECK(counts[r] == steps);
    CHECK(agreed[r] == expected);
  }
}

TEST_CASE("logging.profile_step writes one step's Chrome trace with the GEMMs and the optimizer scope") {
  test::TempDir dir("profile");
  auto cfg = loop_config(dir.path / "run", {"logging.profile_step=2", "checkpointing.mode=full", "checkpointing.skip_last=false"});
  auto s = train::setup(cfg);
  train::LoopState st;
  auto o = loop(*s, st);
  REQUIRE(o.code == kExitOk);
  const auto trace = nlohmann::json::parse(test::read_text(dir.path / "run" / "profile.json"));
  std::map<std::string, int> seen;
  for (const auto& e : trace.at("traceEvents"))
    if (e.value("ph", "") == "X") ++seen[e.at("name").get<std::string>()];
  CHECK(seen["aten::addmm"] + seen["aten::mm"] > 0);
  CHECK(seen["sublinear::optimizer_step"] == 1);  // one step recorded, not two
  CHECK(seen["sublinear::host_read"] == 1);
  CHECK(seen["sublinear::causal_attention"] == 2 * 2);  // 2 blocks: forward + recompute
  CHECK(seen["sublinear::causal_attention_backward"] == 2);
  s->finish(st, std::move(o));
  const auto ev = test::events(dir.path / "run" / "metrics.jsonl", "profile");
  REQUIRE(ev.size() == 1);
  CHECK(ev[0]["step"] == 2);
  CHECK(ev[0]["events"].get<int64_t>() > 100);
  CHECK_THROWS_WITH(loop_config(dir.path / "bad", {"logging.profile_step=-1"}), Catch::Contains("logging.profile_step"));
}

TEST_CASE("MFU's peak is the compute dtype's: datasheet on known GPUs, measured otherwise, overridable") {
  CHECK(train::datasheet_peak("NVIDIA H100 80GB HBM3", config::Dtype::kBf16) == 989e12);
  CHECK(train::datasheet_peak("NVIDIA H100 80GB HBM3", config::Dtype::kFp32) == 67e12);
  CHECK(train::datasheet_peak("NVIDIA H100 PCIe", config::Dtype::kBf16) == 756e12);  // not the SXM part's
  CHECK(train::datasheet_peak("NVIDIA H200", config::Dtype::kFp16) == 989e12);
  CHECK(train::datasheet_peak("NVIDIA A100-SXM4-80GB", config::Dtype::kBf16) == 312e12);
  CHECK(train::datasheet_peak("NVIDIA L40S", config::Dtype::kBf16) == 362e12);
  CHECK_FALSE(train::datasheet_peak("Tesla V100-SXM2-16GB", config::Dtype::kBf16).has_value());  // no bf16 tensor cores
  CHECK(train::datasheet_peak("Tesla V100-SXM2-16GB", config::Dtype::kFp16) == 125e12);
  CHECK_FALSE(train::datasheet_peak("Some Future GPU", config::Dtype::kBf16).has_value());
  const auto over = train::peak_flops(torch::kCPU, config::Dtype::kBf16, 2.5);
  CHECK(over.flops == 2.5e12);
  CHECK(over.source == "logging.peak_tflops");
  CHECK(over.dtype == config::Dtype::kBf16);
  const auto fp32 = train::peak_flops(torch::kCPU, config::Dtype::kFp32, 0.0);
  CHECK(fp32.source == "measured_fp32_gemm");
  CHECK(fp32.flops > 1e8);
  const auto bf16 = train::peak_flops(torch::kCPU, config::Dtype::kBf16, 0.0);  // its own rate, whatever the CPU's bf16 path
  CHECK(bf16.source == "measured_bf16_gemm");
  CHECK(bf16.flops > 1e8);
}

TEST_CASE("the GEMM probe for MFU's peak draws nothing from the run's generators: the same losses with and without "
          "it, dropout 0.1") {
  // In process: the default CPU generator's state is what it was.
  torch::manual_seed(42);
  const auto before = at::detail::getDefaultCPUGenerator().get_state();
  train::measure_gemm_flops(torch::kCPU);
  CHECK(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
  // A trainer run of the tiny recipe with dropout: logging.peak_tflops 0 (the probe runs between the
  // model's init and the first step) against a given peak: every step's loss and gradient norm bitwise equal.
  test::TempDir dir("peak-rng");
  auto run = [&](const std::string& name, const std::string& peak_tflops) {
    const auto run_dir = dir.path / name;
    const auto r = test::trainer("--config configs/tiny.yaml --set model.dropout=0.1 --set train.steps=3 "
                                 "--set train.grad_accum=1 --set train.eval_interval=0 --set state.at_end=false "
                                 "--set logging.progress=false --set logging.peak_tflops=" + peak_tflops +
                                 " --set logging.dir=" + run_dir.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    return run_dir;
  };
  const auto measured = run("measured", "0"), given = run("given", "1");
  const auto source = [](const std::filesystem::path& d) {
    return json::parse(test::read_text(d / "summary.json"))["model"]["peak_flops_source"].get<std::string>();
  };
  CHECK(source(measured).starts_with("measured_fp32_gemm"));  // ", raised by step N" where a step beat the probe
  CHECK(source(given) == "logging.peak_tflops");
  const auto steps = test::step_records(measured / "metrics.jsonl");
  CHECK(steps.size() == 3);
  const std::string diff = test::bitwise_diff(steps, test::step_records(given / "metrics.jsonl"));
  INFO(diff);
  CHECK(diff.empty());
}

TEST_CASE("MFU's peak: a step that beats it raises it, so no utilisation exceeds 1 (synthetic rates)") {
  // The issue's figures: a measured peak of 1.88e11 FLOP/s, steps at 101.5 % and 116.4 % of it.
  const double measured = 1.88e11;
  train::PeakTracker t({measured, config::Dtype::kFp32, "measured_fp32_gemm", std::nullopt});
  CHECK_FALSE(t.observe(0.8 * measured, 1));  // below the peak: kept
  CHECK(t.flops() == measured);
  CHECK(t.source() == "measured_fp32_gemm");
  CHECK_FALSE(t.raised_at().has_value());
  CHECK(t.observe(1.164 * measured, 2));  // beats it: the step's rate becomes the peak
  CHECK(t.flops() == 1.164 * measured);
  CHECK(t.utilisation(1.164 * measured) == 1.0);  // x / x
  CHECK(t.raised_at() == 2);
  CHECK(t.source() == "measured_fp32_gemm, raised by step 2");
  CHECK(t.initial().flops == measured);
  const std::string message = train::peak_raised_message(t, measured);
  CHECK_THAT(message, Catch::Contains("step 2 ran at 2.19e+11 FLOP/s") && Catch::Contains("1.88e+11") &&
                          Catch::Contains("underestimated"));
  CHECK_FALSE(t.observe(1.015 * measured, 3));  // below the raised peak
  CHECK(t.utilisation(1.015 * measured) < 1.0);
  CHECK(t.observe(1.2 * measured, 4));
  CHECK(t.raised_at() == 4);
  CHECK(t.raises() == 2);
  CHECK(t.source() == "measured_fp32_gemm, raised by step 4");
  CHECK_FALSE(t.observe(std::numeric_limits<double>::quiet_NaN(), 5));  // a non-finite rate never becomes the peak
  CHECK_FALSE(t.observe(std::numeric_limits<double>::infinity(), 5));
  CHECK(t.flops() == 1.2 * measured);
  // Any sequence: each rate observed, then divided by the peak, is at most 1 (the loop's order).
  train::PeakTracker u({1.0, config::Dtype::kBf16, "logging.peak_tflops", std::nullopt});
  for (double rate : {0.5, 3.0, 2.0, 7.0, 7.0, 1e-3, 6.9}) {
    u.observe(rate, 1);
    CHECK(u.utilisation(rate) <= 1.0);
  }
  CHECK(u.flops() == 7.0);
}

TEST_CASE("MFU's probe runs the model's own GEMM shapes beside square ones, each operand within 2^20 elements") {
  auto cfg = config::load(test::kSourceDir + "/configs/tiny.yaml", {});
  const int64_t rows = cfg.train.micro_batch * cfg.train.seq_len;  // 16 x 128 = 2048
  const auto model = train::model_gemm_shapes(cfg.model, rows);
  const int64_t d = cfg.model.n_embd, v = cfg.model.vocab_size, h = config::Shape(cfg.model).hidden();  // 128, 256, 512
  const std::vector<train::GemmShape> expected = {{rows, d, 3 * d}, {rows, d, d},     {rows, d, v},
                                                  {rows, 3 * d, d}, {rows, v, d},     {d, rows, 3 * d},
                                                  {rows, d, h},     {rows, h, d},     {h, rows, d}};
  const auto probe = train::probe_shapes(model);
  REQUIRE(probe.size() >= 2);
  CHECK(probe[0] == train::GemmShape{512, 512, 512});
  CHECK(probe[1] == train::GemmShape{1024, 1024, 1024});
  for (const auto& e : expected) {
    INFO(e.m << " x " << e.k << " x " << e.n);
    CHECK(std::find(model.begin(), model.end(), e) != model.end());
    CHECK(std::find(probe.begin(), probe.end(), e) != probe.end());  // tiny's fit uncut: 2048 x 512 = 2^20
  }
  // A 7B model's shapes (rows 4 x 4096): cut to 2^20 elements per operand, so at most 2 x 2^30 FLOPs a
  // product (m k n = sqrt(mk * kn * mn) <= 2^30), none repeated.
  auto big = config::load_string("", {"model.preset=7b", "train.seq_len=4096", "train.micro_batch=4"});
  const auto cut = train::probe_shapes(train::model_gemm_shapes(big.model, 4 * 4096));
  CHECK(cut.size() > 2);
  for (size_t i = 0; i < cut.size(); ++i) {
    const auto& s = cut[i];
    INFO(s.m << " x " << s.k << " x " << s.n);
    CHECK(s.m * s.k <= train::kProbeOperandElems);
    CHECK(s.k * s.n <= train::kProbeOperandElems);
    CHECK(s.m * s.n <= train::kProbeOperandElems);
    CHECK(s.flops() <= 2.0 * std::pow(2.0, 30));
    CHECK(std::count(cut.begin(), cut.end(), s) == 1);
  }
  // A window of 0 s: one warm-up and one timed product, of the first shape, on ATen's threads as set.
  train::GemmProbe report;
  const double flops = train::measure_gemm_peak(torch::kCPU, torch::kFloat, probe, 0.0, &report);
  CHECK(flops > 0.0);
  CHECK(report.products == 1);
  REQUIRE(report.shapes.size() == 1);
  CHECK(report.shapes[0] == probe[0]);
  CHECK(report.best == probe[0]);
  CHECK(report.threads == at::get_num_threads());
}

TEST_CASE("a run whose peak is beaten raises it: every step's mfu and hfu at most 1, the summary's final peak, "
          "one warning") {
  // logging.peak_tflops 1e-9 is 1000 FLOP/s: every step of tiny (6 x 0.86M params x 2048 tokens, ~1e10
  // FLOPs) would have to take 1e7 s not to beat it, so step 1 raises it for certain; later steps raise
  // it again only when faster than every step before (timing: not asserted).
  test::TempDir dir("peak-raise");
  const auto run_dir = dir.path / "run";
  const auto r = test::trainer("--config configs/tiny.yaml --set train.steps=4 --set train.grad_accum=1 "
                               "--set train.eval_interval=0 --set state.at_end=false --set logging.progress=false "
                               "--set logging.interval=1 --set logging.peak_tflops=1e-9 --set logging.dir=" +
                               run_dir.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  size_t warnings = 0;
  for (size_t at = r.output.find("was underestimated"); at != std::string::npos; at = r.output.find("was underestimated", at + 1))
    ++warnings;
  CHECK(warnings == 1);
  const auto records = test::read_jsonl(run_dir / "metrics.jsonl");
  std::vector<json> raised, steps;
  for (const auto& rec : records) {
    if (rec.contains("event") && rec["event"] == "peak_raised") raised.push_back(rec);
    if (!rec.contains("event")) steps.push_back(rec);
  }
  REQUIRE(steps.size() == 4);
  REQUIRE_FALSE(raised.empty());
  CHECK(raised[0]["step"] == 1);
  const double given = 1e-9 * 1e12;  // logging.peak_tflops x 1e12, the product peak_flops makes (not exactly 1000)
  CHECK(raised[0]["previous_peak_flops"].get<double>() == given);
  size_t next = 0;
  for (const auto& rec : steps) {
    INFO(rec.dump());
    CHECK(rec["mfu"].get<double>() <= 1.0);
    CHECK(rec["hfu"].get<double>() <= 1.0);
    if (next < raised.size() && raised[next]["step"] == rec["step"]) {
      CHECK(rec["hfu"].get<double>() == 1.0);  // the step's own rate over itself (the same expression, the same double)
      ++next;
    }
  }
  CHECK(next == raised.size());  // every raise is at a logged step
  const auto summary = json::parse(test::read_text(run_dir / "summary.json"));
  const auto& model = summary["model"];
  CHECK(model["peak_flops_initial"].get<double>() == given);
  CHECK(model["peak_flops"].get<double>() == raised.back()["peak_flops"].get<double>());
  CHECK(model["peak_flops_source"] ==
        "logging.peak_tflops, raised by step " + std::to_string(raised.back()["step"].get<int64_t>()));
  CHECK(model["peak_flops_raised_at_step"] == raised.back()["step"]);
  CHECK(model["peak_flops_probe"].is_null());  // given, not measured
  CHECK(summary["median_mfu"].get<double>() > 0.0);
  CHECK(summary["median_mfu"].get<double>() <= 1.0);
}

TEST_CASE("trainer --version prints the version, commit, LibTorch, CUDA and CPU code; summary.json's build is the same") {
  const auto info = device::build_info();
  const auto r = test::trainer("--version");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(info["version"] == SUBLINEAR_VERSION);
  const std::string commit = info["commit"].get<std::string>();
  // git describe --always --dirty: an abbreviated hash (or tag-count-ghash), maybe -dirty; else unknown.
  const bool described = commit == "unknown" || std::regex_match(commit, std::regex("[0-9A-Za-z._-]*[0-9a-f]{7,}(-dirty)?"));
  CHECK(described);
  CHECK_THAT(r.output, Catch::Contains(std::string("sublinear trainer ") + SUBLINEAR_VERSION + " (commit " + commit + ";"));
  CHECK_THAT(r.output, Catch::Contains(std::string("LibTorch ") + TORCH_VERSION));
  CHECK(info["libtorch"] == TORCH_VERSION);
  const auto& cuda = info["cuda"];
  if (cuda["compiled"].get<bool>()) {
    CHECK_FALSE(cuda["archs"].empty());  // from LibTorch's nvcc flags
    CHECK_THAT(r.output, Catch::Contains("CUDA: compiled, runtime " + cuda["version"].get<std::string>() +
                                         ", architectures " + cuda["archs"][0].get<std::string>()));
  } else {
    CHECK_THAT(r.output, Catch::Contains("CUDA: not compiled in"));
  }
  // Whether the fused CUDA kernels are built in: the line bench/gpu.sh requires to say yes on a GPU.
  CHECK(cuda["kernels"] == model::kCudaKernels);
  CHECK_THAT(r.output, Catch::Contains(std::string("\nCUDA kernels: ") + (model::kCudaKernels ? "yes" : "no") + "\n"));
  CHECK(info["cpu"]["this_cpu"]["avx2_fma"] == device::cpu_has_avx2_fma());
  CHECK_THAT(r.output, Catch::Contains("this CPU: " + device::cpu_features().model_name));
  CHECK_THAT(r.output, Catch::Contains(std::string("avx2_fma ") + (device::cpu_has_avx2_fma() ? "yes" : "no")));
#if defined(__x86_64__)
  CHECK_THAT(r.output, Catch::Contains("fused kernels built for baseline, avx2_fma, avx512, avx512_bf16"));
#endif
  // The architecture list from both nvcc flag spellings.
  CHECK(device::cuda_archs_from_flags("-gencode;arch=compute_75,code=sm_75;-gencode;arch=compute_90,code=sm_90") ==
        std::vector<std::string>{"sm_75", "sm_90"});
  CHECK(device::cuda_archs_from_flags("-gencode arch=compute_90,code=[sm_90,compute_90] -gencode arch=compute_90,code=sm_90") ==
        std::vector<std::string>{"sm_90", "compute_90"});
  CHECK(device::cuda_archs_from_flags("").empty());
  // A run's summary.json records the same build.
  test::TempDir dir("build-info");
  auto cfg = loop_config(dir.path / "run");
  auto s = train::setup(cfg);
  train::LoopState st;
  REQUIRE(s->finish(st, loop(*s, st)) == 0);
  const auto summary = json::parse(test::read_text(dir.path / "run" / "summary.json"));
  REQUIRE(summary.contains("build"));
  CHECK(summary["build"] == info);
}

TEST_CASE("loss spikes: the moving average and the check (train/spike.h)") {
  config::TrainConfig t;
  t.spike_window = 3;
  t.spike_threshold = 1.5;
  state::Counters c;
  for (double loss : {4.0, 4.0}) {
    CHECK_FALSE(train::check_spike(c, 100.0, t).spike);  // fewer than spike_window losses: never a spike
    train::observe_loss(c, loss, t.spike_window);
  }
  train::observe_loss(c, 7.0, t.spike_window);  // the mean of the first three: 5
  // Means of a few doubles (~1e-16 relative error); Approx's default (1.2e-5) is far above that and far
  // below the 1/3-weight steps a wrong average would be off by.
  CHECK(c.loss_average == Approx(5.0));
  CHECK(train::check_spike(c, 7.6, t).spike);
  CHECK_FALSE(train::check_spike(c, 7.4, t).spike);
  CHECK(train::check_spike(c, 7.6, t).average == Approx(5.0));
  train::observe_loss(c, 8.0, t.spike_window);  // then an exponential average of weight 1/3
  CHECK(c.loss_average == Approx(6.0));
  train::observe_loss(c, std::nan(""), t.spike_window);  // a non-finite loss is left out
  CHECK(c.loss_average == Approx(6.0));
  CHECK(c.losses_seen == 4);
  t.on_spike = config::OnSpike::kOff;
  CHECK_FALSE(train::check_spike(c, 100.0, t).spike);
}

namespace {

// Headerless uint16 tokens (data.source: raw).
void write_tokens(const std::filesystem::path& p, const std::vector<uint16_t>& tokens) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()),
                                           static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
}

std::vector<json> step_lines(const std::filesystem::path& run) {
  std::vector<json> out;
  for (const auto& r : test::read_jsonl(run / "metrics.jsonl"))
    if (!r.contains("event")) out.push_back(r);
  return out;
}

}  // namespace

TEST_CASE("train.on_spike: a jump in the loss after resuming on other data is a spike: warn keeps the step, skip "
          "keeps the weights, stop saves and exits 6; the moving average comes back with the state") {
  test::TempDir dir("spike");
  const auto data = dir.path / "tokens.bin";
  std::vector<uint16_t> periodic(100000), noise(100000);
  for (size_t i = 0; i < periodic.size(); ++i) periodic[i] = static_cast<uint16_t>(i % 16);
  uint64_t x = 88172645463325252ull;  // xorshift64: uniform tokens below 256
  for (auto& v : noise) v = static_cast<uint16_t>((x ^= x << 13, x ^= x >> 7, x ^= x << 17) % 256);
  write_tokens(data, periodic);
  const std::string common = fmt::format(
      "--config configs/tiny.yaml --set data.source=raw --set data.path={} --set data.val_path= --set model.n_layer=2 "
      "--set train.seq_len=64 --set train.micro_batch=4 --set train.grad_accum=1 --set train.eval_interval=0 "
      "--set train.spike_window=3 --set train.spike_threshold=1.5 ", data.string());
  // 20 steps on a periodic sequence (learned: loss well under 1), then the same file holds noise (~5.5 nats).
  const auto first = test::trainer(common + "--set train.steps=20 --set logging.dir=" + (dir.path / "base").string());
  INFO(first.output);
  REQUIRE(first.code == 0);
  REQUIRE(step_lines(dir.path / "base").back()["loss"].get<double>() < 2.0);
  write_tokens(data, noise);
  auto resume = [&](const std::string& mode) {
    const auto run = dir.path / mode;
    std::filesystem::copy(dir.path / "base", run, std::filesystem::copy_options::recursive);
    return test::trainer(common + fmt::format("--set train.steps=30 --set train.on_spike={} --set logging.dir={} "
                                              "--resume auto", mode, run.string()));
  };
  const auto warn = resume("warn");
  INFO(warn.output);
  REQUIRE(warn.code == 0);
  const auto spikes = test::events(dir.path / "warn" / "metrics.jsonl", "spike");
  REQUIRE_FALSE(spikes.empty());
  CHECK(spikes.front()["step"] == 21);  // the average came back with the state: step 21 is checked at once
  CHECK(spikes.front()["action"] == "warn");
  CHECK(spikes.front()["loss"].get<double>() > 1.5 * spikes.front()["average"].get<double>());
  CHECK(spikes.size() < 10);  // every loss enters the average: a lasting new level stops being a spike
  const auto warn_steps = step_lines(dir.path / "warn");
  for (const auto& r : warn_steps) CHECK(r["skipped"] == false);

  const auto skip = resume("skip");
  INFO(skip.output);
  REQUIRE(skip.code == 0);
  const auto skip_steps = step_lines(dir.path / "skip");
  const auto skip_spikes = test::events(dir.path / "skip" / "metrics.jsonl", "spike");
  REQUIRE_FALSE(skip_spikes.empty());
  CHECK(skip_spikes.front()["step"] == 21);
  int held = 0;
  for (const auto& r : skip_steps) held += r["skipped"].get<bool>() ? 1 : 0;
  CHECK(held == static_cast<int>(skip_spikes.size()));
  const auto summary = json::parse(test::read_text(dir.path / "skip" / "summary.json"));
  CHECK(summary["skipped_steps"] == held);
  const auto at = [](const std::vector<json>& steps, int64_t step) {
    for (const auto& r : steps)
      if (r["step"] == step) return r["loss"].get<double>();
    return std::nan("");
  };
  CHECK(at(skip_steps, 21) == at(warn_steps, 21));  // the same weights before step 21
  CHECK(at(skip_steps, 22) != at(warn_steps, 22));  // warn applied step 21's update, skip did not

  const auto stop = resume("stop");
  CHECK(stop.code == kExitNonFinite);
  CHECK(stop.output.find("train.on_spike") != std::string::npos);
  CHECK(step_lines(dir.path / "stop").back()["step"] == 21);
  const auto saved = test::events(dir.path / "stop" / "metrics.jsonl", "state_saved");
  REQUIRE_FALSE(saved.empty());
  CHECK(saved.back()["step"] == 21);
  CHECK(saved.back()["reason"] == "spike");
  // Resuming that state goes on with the next batch; step 22 is skip's (weights before 21, the same batch).
  const auto again = test::trainer(common + fmt::format("--set train.steps=30 --set train.on_spike=skip "
                                                        "--set logging.dir={} --resume auto", (dir.path / "stop").string()));
  INFO(again.output);
  CHECK(again.code == 0);
  CHECK(at(step_lines(dir.path / "stop"), 22) == at(skip_steps, 22));
}

// ---- precision.tf32 ----

TEST_CASE("MFU's peak of an fp32 run with TF32 is the TF32 tensor-core peak (half the bf16 one); bf16 runs and "
          "parts without TF32 keep theirs; a CPU run reports TF32 off") {
  CHECK(train::datasheet_peak("NVIDIA H100 80GB HBM3", config::Dtype::kFp32, /*tf32=*/true) == 494.5e12);
  CHECK(train::datasheet_peak("NVIDIA A100-SXM4-80GB", config::Dtype::kFp32, true) == 156e12);
  CHECK(train::datasheet_peak("NVIDIA H100 80GB HBM3", config::Dtype::kBf16, true) == 989e12);
  CHECK(train::datasheet_peak("NVIDIA H100 80GB HBM3", config::Dtype::kFp32, false) == 67e12);
  CHECK(train::datasheet_peak("Tesla V100-SXM2-16GB", config::Dtype::kFp32, true) ==
        train::datasheet_peak("Tesla V100-SXM2-16GB", config::Dtype::kFp32, false));  // no TF32 there: plain fp32
  test::TempDir dir("tf32-cpu");
  auto s = train::setup(loop_config(dir.path / "run"));  // precision.tf32: auto, on the CPU
  CHECK(s->out.environment.at("tf32") == false);
  CHECK(s->meter.peak.initial().source == "logging.peak_tflops");
}

namespace {
// The relative rounding bounds of one fp32 product C = A B with inner size k, as a multiple of
// sum_i |a_i| |b_i| (Higham 3.5, first order; the u^2 terms are far below the slack left here).
// IEEE fp32: each product rounded (u = 2^-24) and k - 1 additions: (k + 1) u; +1 u of slack.
double ieee_matmul_bound(int64_t k) { return static_cast<double>(k + 2) * 0x1p-24; }
// TF32: each input rounded to TF32's 10 mantissa bits, by 2^-11 relative rounded to nearest, 2^-10
// truncated (the larger is taken: the rounding mode is the hardware's), so a product of two by
// 2 x 2^-10 + 2^-20; the product of two 11-bit significands is exact in fp32; the sums in fp32, taken
// as 2 u per addition in case the tensor cores' adders truncate: 2 (k + 2) u.
double tf32_matmul_bound(int64_t k) { return 2 * 0x1p-10 + 0x1p-20 + 2 * ieee_matmul_bound(k); }
}  // namespace

TEST_CASE("precision.tf32 on CUDA: auto sets TF32 for the run's fp32 matmuls (inputs rounded to 10 mantissa "
          "bits), false keeps IEEE fp32", "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  test::TempDir dir("tf32");
  constexpr int64_t k = 256;
  const auto opts = torch::TensorOptions().device(torch::Device(torch::kCUDA, 0));
  // 1 + 2^-12 is an fp32 number (23 mantissa bits) that TF32 (10) cannot hold: rounded to nearest or
  // truncated it enters the tensor core as 1. A row of 256 of them times a column of ones: in IEEE fp32
  // every partial sum j (1 + 2^-12), j <= 256, is a multiple of 2^-12 below 2^9, where fp32's spacing is
  // 2^-15, so exact in any order: 256 + 2^-4. In TF32 every product is 1 and every sum an integer: 256.
  const auto fine = torch::full({k, k}, 1.0 + 0x1p-12, opts), ones = torch::ones({k, k}, opts);
  torch::manual_seed(3);
  const auto x = torch::randn({k, k}, opts), y = torch::randn({k, k}, opts);
  struct Seen {
    bool tf32;
    torch::Tensor exact_case, random_case;
  };
  auto run_with = [&](const std::string& tf32) {
    auto s = train::setup(loop_config(dir.path / tf32, {"train.device=cuda", "precision.tf32=" + tf32}));
    const Seen seen{s->out.environment.at("tf32").get<bool>(), at::mm(fine, ones).cpu(), at::mm(x, y).cpu()};
    CHECK(seen.tf32 == device::tf32_matmuls());
    return seen;
  };
  const Seen on = run_with("auto"), off = run_with("false");
  device::set_tf32(false);  // LibTorch's default for the cases after this one
  CHECK(on.tf32);
  CHECK_FALSE(off.tf32);
  CHECK(torch::equal(on.exact_case, torch::full({k, k}, 256.0)));
  CHECK(torch::equal(off.exact_case, torch::full({k, k}, 256.0 + 0x1p-4)));
  const auto xd = x.cpu().to(torch::kDouble), yd = y.cpu().to(torch::kDouble);
  const auto exact = at::mm(xd, yd), scale = at::mm(xd.abs(), yd.abs());  // sum_i |a_i| |b_i| per element
  const auto rel = [&](const torch::Tensor& c) { return (c.to(torch::kDouble) - exact).abs() / scale; };
  const double on_worst = rel(on.random_case).max().item<double>(), off_worst = rel(off.random_case).max().item<double>();
  INFO("worst error / sum|a||b|: TF32 " << on_worst << " (bound " << tf32_matmul_bound(k) << "), IEEE " << off_worst
                                        << " (bound " << ieee_matmul_bound(k) << ")");
  CHECK(off_worst <= ieee_matmul_bound(k));
  CHECK(on_worst <= tf32_matmul_bound(k));
  // TF32's input rounding shows beyond IEEE's bound: an element's error is a sum of 256 terms a_i b_i
  // (d_a + d_b), each d of rms 2^-11 / sqrt(3) = 2.8e-4 (rounded to nearest; more if truncated), so of
  // rms 16 x 1.41 x 2.8e-4 = 6.4e-3 against sum |a||b| ~ 256 x 2/pi = 163: 3.9e-5, 2.5 x IEEE's bound
  // (1.5e-5) for a typical element, ~10 x for the worst of 65,536.
  CHECK(on_worst > ieee_matmul_bound(k));
}

// ---- casts per micro-batch ----

namespace {
// Counts aten::_to_copy calls (every cast and device copy) on any thread while alive, and among them
// the casts of a parameter: those whose source is one of `params` itself (its data pointer; under
// zero1 every parameter is a view of one flat buffer), matrices (the matmul weights, the embeddings)
// and vectors (norm weights, biases) apart.
struct CastCounter {
  static inline std::atomic<int64_t> total{0}, of_matrices{0}, of_vectors{0};
  static inline const std::map<const void*, bool>* param_is_matrix = nullptr;
  std::map<const void*, bool> params_;
  at::CallbackHandle handle;
  explicit CastCounter(const std::vector<torch::Tensor>& params) {
    for (const auto& p : params) params_[p.data_ptr()] = p.dim() >= 2;
    param_is_matrix = &params_;
    total = 0, of_matrices = 0, of_vectors = 0;
    handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start).needsInputs(true));
  }
  ~CastCounter() {
    at::removeCallback(handle);
    param_is_matrix = nullptr;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (std::string_view(fn.name()) != "aten::_to_copy") return nullptr;
    ++total;
    const auto in = fn.inputs();
    if (in.empty() || !in[0].isTensor() || !in[0].toTensor().has_storage()) return nullptr;
    const auto it = param_is_matrix->find(in[0].toTensor().data_ptr());
    if (it != param_is_matrix->end()) ++(it->second ? of_matrices : of_vectors);
    return nullptr;
  }
};

struct StepCasts {
  int64_t total = 0, of_matrices = 0, of_vectors = 0;
};

// One world-1 zero1 step of a 2-layer model in bf16 autocast, 2 micro-batches, with the parameters in
// `param_dtype`, after a first step (AdamW's state made): its casts.
StepCasts casts_in_a_step(const std::string& param_dtype) {
  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.dropout=0.0",
                                      "train.seq_len=32", "train.micro_batch=2", "train.grad_accum=2",
                                      "train.device=cpu", "parallel.timeout_s=60", "parallel.sharding=zero1",
                                      "precision.compute=bf16", "precision.param_dtype=" + param_dtype});
  torch::manual_seed(cfg.train.seed);
  model::GPT m(cfg.model, torch::kCPU);
  parallel::LaunchEnv env;
  env.rank = 0, env.world = 1, env.local_rank = 0, env.local_world = 1, env.master_port = test::free_port();
  recompute::Runner runner(cfg.checkpointing, m);
  const auto made = parallel::make_engine(m, parallel::Spec::of(cfg), std::make_shared<parallel::Comm>(env, cfg.parallel, torch::kCPU));
  auto& engine = *made;
  engine.attach(runner);
  auto opt = engine.make_optimizer(cfg.train);
  memory::Tracker tracker(torch::kCPU);
  data::Loader loader(data::make_synthetic(20000, 256, 3), 2, 32, 100);
  const train::LossFn loss = [&](const torch::Tensor& idx, const torch::Tensor& y, const torch::Tensor& p) { return runner.loss(idx, y, p); };
  const train::StepParts parts{.loss = loss, .strategy = engine, .opt = *opt, .tracker = tracker,
                               .device = torch::kCPU, .precision = {precision::compute_dtype(cfg.precision.compute), nullptr},
                               .grad_clip = 1.0};
  train::train_step(parts, {loader.next(), loader.next()});
  for (const auto& p : m->parameters()) REQUIRE(p.scalar_type() == precision::scalar_type(cfg.precision.param_dtype));
  CastCounter counter(m->parameters());
  train::train_step(parts, {loader.next(), loader.next()});
  return {CastCounter::total.load(), CastCounter::of_matrices.load(), CastCounter::of_vectors.load()};
}
}  // namespace

TEST_CASE("precision.param_dtype bf16: no matmul weight is cast in a bf16 step, where fp32 parameters have each "
          "cast once per micro-batch, and the step's casts are fewer by at least those") {
  // ATen's linears under autocast, as on CUDA: the widened linears of a CPU without bf16 GEMMs round their
  // weights in kernels of their own, which no aten::_to_copy shows.
  const bool was = device::force_aten_kernels(true);
  const StepCasts bf16 = casts_in_a_step("bf16"), fp32 = casts_in_a_step("fp32");
  device::force_aten_kernels(was);
  INFO("aten::_to_copy in one step: param_dtype bf16 " << bf16.total << " (of parameters: " << bf16.of_matrices
       << " matrices, " << bf16.of_vectors << " vectors), fp32 " << fp32.total << " (" << fp32.of_matrices
       << " matrices, " << fp32.of_vectors << " vectors)");
  // Autocast casts each fp32 weight of a matmul once per autocast region (its cache lives as long as the
  // region: one micro-batch's forward and loss), so at least the blocks' 4 matmul weights x 2 layers x 2
  // micro-batches (the LM head's too, where the loss takes it through autocast).
  constexpr int64_t kBlockWeightCasts = 4 * 2 * 2;
  CHECK(fp32.of_matrices >= kBlockWeightCasts);
  CHECK(bf16.of_matrices == 0);
  // What a bf16 step still casts (the loss to float64, activations into and out of fp32 ops; on CUDA,
  // where autocast runs layer_norm in fp32, the norms' weights too) it casts with fp32 parameters as
  // well: removing the weights' casts adds none in their place.
  CHECK(bf16.of_vectors <= fp32.of_vectors);
  CHECK(bf16.total <= fp32.total - kBlockWeightCasts);
}

// ---- host reads on the lazy device ----

namespace {
// Graph runs of the lazy device so far: LibTorch's lazy core records one TensorsGraphSize sample per
// graph it compiles or takes from its cache and runs (torch/csrc/lazy/core/lazy_graph_executor.cpp),
// whatever asked for it: a host read of a pending value (.item(), a copy to the CPU), an op the
// TorchScript backend has no lowering for (run eagerly on the CPU: its inputs are copied there), or a
// cut (device::end_step).
int64_t lazy_graph_runs() {
  auto* m = torch::lazy::GetMetric("TensorsGraphSize");
  return m ? static_cast<int64_t>(m->TotalSamples()) : 0;
}

// The lazy graph runs of the calling thread while alive, each put down to the outermost profiler scope
// it happened in (an ATen op, or a RecordFunction scope such as sublinear::host_read; "" for a run
// outside every scope).
struct LazyRunsByScope {
  static inline thread_local std::vector<std::pair<std::string, int64_t>> t_open;  // (name, runs at its start)
  static inline thread_local std::map<std::string, int64_t>* t_runs = nullptr;
  std::map<std::string, int64_t> runs;
  int64_t start = lazy_graph_runs();
  at::CallbackHandle handle;
  LazyRunsByScope() {
    t_runs = &runs;
    handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end));
  }
  ~LazyRunsByScope() {
    at::removeCallback(handle);
    t_runs = nullptr;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    t_open.emplace_back(t_open.empty() ? fn.name() : "", lazy_graph_runs());  // nested: the outermost's
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) {
    if (t_open.empty()) return;
    const auto [name, at_start] = t_open.back();
    t_open.pop_back();
    const int64_t n = lazy_graph_runs() - at_start;
    if (!name.empty() && t_runs && n > 0) (*t_runs)[name] += n;
  }
  // Runs outside every scope: the total less the runs put down to a scope.
  int64_t unscoped() const {
    int64_t scoped = 0;
    for (const auto& [name, n] : runs) scoped += n;
    return lazy_graph_runs() - start - scoped;
  }
};
}  // namespace

TEST_CASE("on the lazy test device a step runs the graph for one host read (read_step) and at its cut "
          "(device::end_step); every other graph run is inside an op the backend runs eagerly on the CPU") {
  // On a lazy device nothing runs until a value is needed, so every host read in a step, declared or not
  // (an .item(), a .cpu(), a branch on a tensor), runs the graph pending behind it: counting graph runs
  // by the scope they happen in counts host synchronizations, those the profiler's op names show and
  // any they would not.
  test::TempDir dir("lazy-syncs");
  auto cfg = loop_config(dir.path / "run", {"train.device=lazy", "train.grad_accum=2", "state.at_end=false"});
  auto s = train::setup(cfg);
  train::LoopState st;
  std::map<std::string, int64_t> runs;
  int64_t unscoped = 0;
  train::Outcome o;
  {
    LazyRunsByScope by_scope;
    o = loop(*s, st);
    runs = by_scope.runs, unscoped = by_scope.unscoped();
  }
  std::string seen;
  for (const auto& [name, n] : runs) seen += fmt::format(" {} {},", name, n);
  INFO("lazy graph runs in " << st.steps_done << " steps: outside every scope " << unscoped << "," << seen << " " << o.message);
  REQUIRE(o.code == kExitOk);
  REQUIRE(st.steps_done == 3);
  // Per step: (1) read_step's read of [loss, gradient norm, found-inf] (forward, backward and the norm
  // run then), in its sublinear::host_read scope; (2) end_step's cut after the optimizer step (clipping
  // and AdamW run then, and the next step starts from a fresh graph), outside every op.
  CHECK(runs["sublinear::host_read"] == st.steps_done);
  CHECK(unscoped == st.steps_done);
  // Every other run is inside an op whose parts the TorchScript backend has no lowering for, so it runs
  // them eagerly on the CPU, taking their inputs there (its aten:: fallback counters): the attention
  // (scaled_dot_product_attention's math path masks with isneginf, all and where), the clipping
  // coefficient's where (optim/clip.cpp), slice's backward (a copy into a view), and the fused LM head
  // and loss writing each chunk's rows of its input gradient (a copy into a view too; the node reads
  // nothing back to the host: model/fused_loss.cpp). The lazy device's, not a read of the step's: on
  // CUDA these are kernels. An .item() or a .cpu() of the step's would show as aten::item, aten::to or
  // aten::_to_copy here.
  const std::set<std::string> scopes = {"sublinear::host_read", "aten::scaled_dot_product_attention", "aten::where",
                                        "autograd::engine::evaluate_function: SliceBackward0",
                                        "sublinear::linear_cross_entropy"};
  for (const auto& [name, n] : runs) {
    CAPTURE(name, n);
    CHECK(scopes.count(name) == 1);
  }
  s->finish(st, std::move(o));
}

// ---- train.cuda_graphs ----

TEST_CASE("train.cuda_graphs: each eligibility condition in the order train/cuda_graph.h lists them names why a "
          "run is eager; a one-process CUDA run without them captures") {
  const torch::Device cuda(torch::kCUDA, 0), cpu(torch::kCPU);  // a device to decide for: no GPU is touched
  const auto base = config::load_string("", {"train.cuda_graphs=auto", "train.device=cpu"});
  const auto eligible = train::graph_eligibility(base, 1, cuda);
  CHECK(eligible.capture);
  CHECK(eligible.reason.empty());
  auto on = base;
  on.train.cuda_graphs = config::CudaGraphs::kOn;
  CHECK(train::graph_eligibility(on, 1, cuda).capture);

  struct Case {
    std::string name;
    std::function<void(config::RunConfig&)> change;
    int64_t world;
    torch::Device device;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"off", [](auto& c) { c.train.cuda_graphs = config::CudaGraphs::kOff; }, 1, cuda, "train.cuda_graphs: off"},
      {"not CUDA", [](auto&) {}, 1, cpu, "the run is on the cpu device: CUDA graphs need CUDA"},
      {"two ranks", [](auto&) {}, 2, cuda, "2 rank(s) with parallel.sharding none"},
      // The engine is captured at world 1 with zero1 only (cuda_graph.h, rule 3).
      {"zero1 at two ranks", [](auto& c) { c.parallel.sharding = config::Sharding::kZero1; }, 2, cuda,
       "2 rank(s) with parallel.sharding zero1"},
      {"zero2 at world 1", [](auto& c) { c.parallel.sharding = config::Sharding::kZero2; }, 1, cuda,
       "1 rank(s) with parallel.sharding zero2"},
      {"zero3 at world 1", [](auto& c) { c.parallel.sharding = config::Sharding::kZero3; }, 1, cuda,
       "1 rank(s) with parallel.sharding zero3"},
      {"offload", [](auto& c) { c.offload.activations = true; }, 1, cuda, "offload.*"},
      {"fp16", [](auto& c) { c.precision.compute = config::Dtype::kFp16; }, 1, cuda, "precision.compute fp16"},
      {"memory.limit", [](auto& c) { c.memory.limit.bytes = int64_t{1} << 30; }, 1, cuda, "memory.limit"},
      {"memory timeline", [](auto& c) { c.logging.memory_timeline = 2; }, 1, cuda, "logging.memory_timeline"},
      {"dropout", [](auto& c) { c.model.dropout = 0.1; }, 1, cuda, "model.dropout > 0"},
      // Dropout without any recompute is refused too, as the key's help and docs/recipes.md say.
      {"dropout without recompute",
       [](auto& c) { c.model.dropout = 0.1, c.checkpointing.mode = config::CheckpointingMode::kNone; }, 1, cuda,
       "model.dropout > 0"},
      {"check_recompute", [](auto& c) { c.checkpointing.check_recompute = true; }, 1, cuda,
       "checkpointing.check_recompute"},
      // Two conditions at once: the earlier one in the list is the reason.
      {"cpu and fp16", [](auto& c) { c.precision.compute = config::Dtype::kFp16; }, 1, cpu, "the run is on the cpu device"},
      {"offload and dropout", [](auto& c) { c.offload.activations = true, c.model.dropout = 0.1; }, 1, cuda, "offload.*"},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    auto cfg = base;
    c.change(cfg);
    const auto got = train::graph_eligibility(cfg, c.world, c.device);
    CHECK_FALSE(got.capture);
    CHECK_THAT(got.reason, Catch::StartsWith(c.reason));
  }
  // The key's help (trainer --help-config) names the dropout condition as the check applies it.
  const std::string help = config::help_text();
  const auto at = help.find("\n  cuda_graphs ");  // the train section's key line
  REQUIRE(at != std::string::npos);
  const std::string graphs_help = help.substr(at + 1, help.find('\n', at + 1) - at - 1);
  CHECK_THAT(graphs_help, Catch::Contains("model.dropout 0"));
  CHECK_THAT(graphs_help, !Catch::Contains("dropout only without recompute"));
  // bf16 autocast and checkpointing (full, selective) stay eligible: they add no host work to a micro-batch.
  auto bf16 = base;
  bf16.precision.compute = config::Dtype::kBf16;
  bf16.checkpointing.mode = config::CheckpointingMode::kFull;
  CHECK(train::graph_eligibility(bf16, 1, cuda).capture);
  // configs/gpt2_124m.yaml's settings: zero1 at world 1 with a bf16 compute copy, bf16 compute.
  auto gpt2 = base;
  gpt2.parallel.sharding = config::Sharding::kZero1;
  gpt2.precision.compute = gpt2.precision.param_dtype = config::Dtype::kBf16;
  const auto gpt2_eligible = train::graph_eligibility(gpt2, 1, cuda);
  CHECK(gpt2_eligible.capture);
  CHECK(gpt2_eligible.reason.empty());
  // ... and the recipe itself, as its GPU run resolves it.
  const auto recipe =
      config::load(test::kSourceDir + "/configs/gpt2_124m.yaml", {"train.cuda_graphs=auto", "train.device=cpu"});
  CHECK(train::graph_eligibility(recipe, 1, cuda).capture);
}

namespace {

// The flat fp32 gradients of one world-1 zero1 step of 2 micro-batches with bf16 parameters (its hooks
// add each .grad into them), after `remakes` calls of hooks_to_current_stream (what a CUDA graph does
// on its side stream before its first micro-batch).
std::vector<torch::Tensor> zero1_grads_after_remaking(int remakes) {
  auto cfg = config::load_string("", {"model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.dropout=0.0",
                                      "train.seq_len=32", "train.micro_batch=2", "train.grad_accum=2",
                                      "train.device=cpu", "parallel.timeout_s=60", "parallel.sharding=zero1",
                                      "precision.compute=bf16", "precision.param_dtype=bf16"});
  torch::manual_seed(cfg.train.seed);
  model::GPT m(cfg.model, torch::kCPU);
  parallel::LaunchEnv env;
  env.rank = 0, env.world = 1, env.local_rank = 0, env.local_world = 1, env.master_port = test::free_port();
  const auto made = parallel::make_engine(m, parallel::Spec::of(cfg),
                                          std::make_shared<parallel::Comm>(env, cfg.parallel, torch::kCPU));
  for (int i = 0; i < remakes; ++i) REQUIRE(made->hooks_to_current_stream());
  data::Loader loader(data::make_synthetic(20000, 256, 3), 2, 32, 100);
  made->zero_grad();
  train::forward_backward(fwd(m), {loader.next(), loader.next()}, torch::kCPU, *made,
                          {precision::compute_dtype(cfg.precision.compute), nullptr});
  std::vector<torch::Tensor> out;
  for (const auto& g : made->grads()) out.push_back(g.clone());
  return out;
}

}  // namespace

TEST_CASE("train.cuda_graphs: zero1's gradient hooks made again on the current stream accumulate each gradient "
          "once, bitwise as the hooks made at set-up") {
  const auto want = zero1_grads_after_remaking(0);
  double sum_sq = 0.0;
  for (const auto& g : want) sum_sq += g.to(torch::kFloat64).pow(2).sum().item<double>();
  REQUIRE(sum_sq > 0.0);  // the hooks added the gradients: a lost hook would leave zeros, a doubled one twice them
  for (const int remakes : {1, 2}) {
    INFO(remakes << " remake(s)");
    const auto got = zero1_grads_after_remaking(remakes);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], want[i]));
  }
}

TEST_CASE("train.cuda_graphs: on a CPU run trains as off bitwise and its summary.json says eager and why; a bad "
          "value exits 2 naming the key") {
  test::TempDir dir("graphs-cpu");
  auto run_with = [&](const std::string& setting) {
    const auto run_dir = dir.path / setting;
    REQUIRE(train::run(loop_config(run_dir, {"train.grad_accum=2", "train.steps=4", "train.cuda_graphs=" + setting})) ==
            kExitOk);
    return run_dir;
  };
  const auto off = run_with("off"), on = run_with("on");
  const auto want = test::step_records(off / "metrics.jsonl");
  REQUIRE(want.size() == 4);
  CHECK(test::bitwise_diff(test::step_records(on / "metrics.jsonl"), want).empty());
  const auto graphs = nlohmann::json::parse(test::read_text(on / "summary.json")).at("cuda_graphs");
  CHECK(graphs.at("setting") == "on");
  CHECK(graphs.at("mode") == "eager");
  CHECK_THAT(graphs.at("reason").get<std::string>(), Catch::StartsWith("the run is on the cpu device"));
  CHECK(graphs.at("captured") == false);
  CHECK(graphs.at("replays") == 0);
  CHECK(graphs.at("eager_micro_batches") == 8);  // 4 steps x grad_accum 2, every one eager
  const auto off_graphs = nlohmann::json::parse(test::read_text(off / "summary.json")).at("cuda_graphs");
  CHECK(off_graphs.at("mode") == "eager");
  CHECK(off_graphs.at("reason") == "train.cuda_graphs: off");

  const auto bad = test::trainer("--config configs/tiny.yaml --set train.cuda_graphs=always");
  INFO(bad.output);
  CHECK(bad.code == kExitConfig);
  CHECK_THAT(bad.output, Catch::Contains("train.cuda_graphs: 'always' is not one of off | on | auto"));
}

namespace {

// The tiny recipe at T 64 (one key block per query block in the attention's backward on CUDA: no atomics
// across blocks, so a run is reproducible there, as tests/test_gpu.cpp's control shows), 6 steps of 2
// micro-batches each, on cuda:0.
const std::string kGraphArgs =
    "--config configs/tiny.yaml --set train.device=cuda --set train.seq_len=64 --set train.micro_batch=4 "
    "--set train.grad_accum=2 --set train.steps=6 --set train.eval_interval=0 --set logging.progress=false "
    "--set logging.peak_tflops=1 --set logging.skip_first=0 --set state.at_end=false";

std::filesystem::path graph_run(const std::string& args, const std::filesystem::path& run_dir) {
  const auto r = test::trainer(args + " --set logging.dir=" + run_dir.string());
  INFO(args << "\n" << r.output);
  REQUIRE(r.code == 0);
  return run_dir;
}

}  // namespace

TEST_CASE("train.cuda_graphs on CUDA: a captured micro-batch replayed trains as eager bitwise (fp32 under checkpointing "
          "none and full and selective; bf16; zero1 with a bf16 compute copy as gpt2_124m) and the summary says a "
          "graph was captured and replayed",
          "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  test::TempDir dir("graphs-cuda");
  struct Variant {
    std::string name, sets;
  };
  const std::vector<Variant> variants = {
      {"fp32-none", ""},
      {"fp32-full", " --set checkpointing.mode=full --set checkpointing.skip_last=false"},
      {"fp32-selective", " --set checkpointing.mode=selective --set 'checkpointing.recompute=[attention,mlp,norm]'"},
      {"bf16-none", " --set precision.compute=bf16"},
      // configs/gpt2_124m.yaml's data-parallel and precision settings: the engine's Zero1 at world 1, its
      // gradient hooks adding each bf16 .grad into the fp32 flat gradient inside the graph.
      {"gpt2-zero1-bf16",
       " --set parallel.sharding=zero1 --set precision.compute=bf16 --set precision.param_dtype=bf16"},
      {"zero1-fp32", " --set parallel.sharding=zero1"},
  };
  for (const auto& v : variants) {
    INFO(v.name);
    const auto eager = graph_run(kGraphArgs + v.sets + " --set train.cuda_graphs=off", dir.path / (v.name + "-off"));
    const auto want = test::step_records(eager / "metrics.jsonl");
    REQUIRE(want.size() == 6);
    if (v.name == "fp32-none") {  // control: eager twice; if these differ no replay can match eager here
      const auto again = graph_run(kGraphArgs + v.sets + " --set train.cuda_graphs=off", dir.path / "control");
      REQUIRE(test::bitwise_diff(test::step_records(again / "metrics.jsonl"), want).empty());
    }
    const auto graphed = graph_run(kGraphArgs + v.sets + " --set train.cuda_graphs=on", dir.path / (v.name + "-on"));
    CHECK(test::bitwise_diff(test::step_records(graphed / "metrics.jsonl"), want).empty());
    const auto s = nlohmann::json::parse(test::read_text(graphed / "summary.json")).at("cuda_graphs");
    INFO(s.dump());
    CHECK(s.at("mode") == "graph");
    CHECK(s.at("captured") == true);
    CHECK(s.at("reason").is_null());
    // 12 micro-batches: 3 eager warm-up ones, then the capture (replayed once) and 8 replays.
    CHECK(s.at("eager_micro_batches") == train::StepGraph::kWarmupMicroBatches);
    CHECK(s.at("replays") == 12 - train::StepGraph::kWarmupMicroBatches);
  }
}

namespace {

// configs/gpt2_124m.yaml's model and layout (zero1 at world 1 with a bf16 compute copy, bf16 compute) at
// 2 x 256 tokens, 4 micro-batches a step, 30 steps, every step logged, graphs on.
const std::string kGpt2GraphArgs =
    "--config configs/gpt2_124m.yaml --set train.device=cuda --set train.seq_len=256 --set train.micro_batch=2 "
    "--set train.grad_accum=4 --set train.steps=30 --set train.eval_interval=0 --set logging.interval=1 "
    "--set logging.progress=false --set logging.save_model=false --set state.at_end=false --set train.cuda_graphs=on";

// The cuda_graphs block of a run's summary.json, and each step's reserved bytes.
struct GraphRun {
  nlohmann::json graphs;
  std::vector<int64_t> reserved;
};

GraphRun gpt2_graph_run(const std::string& env, const std::filesystem::path& run_dir) {
  const auto r = test::run("cd " + test::kSourceDir + " && OMP_NUM_THREADS=1 " + env + " " + test::kTrainer + " " +
                           kGpt2GraphArgs + " --set logging.dir=" + run_dir.string());
  INFO(env << "\n" << r.output);
  REQUIRE(r.code == 0);
  GraphRun out{nlohmann::json::parse(test::read_text(run_dir / "summary.json")).at("cuda_graphs"), {}};
  for (const auto& rec : test::read_jsonl(run_dir / "metrics.jsonl"))
    if (!rec.contains("event")) out.reserved.push_back(rec.at("reserved_bytes").get<int64_t>());
  REQUIRE(out.reserved.size() == 30);
  return out;
}

}  // namespace

// A capture that fails must leave the caching allocators as it found them: allocation to the graph's pool
// ended and the pool released, zero1's accumulator nodes back on the caller's stream. Left in capture mode
// the allocator processes no events, and each micro-batch's gradients, record_stream'ed across the two
// streams, are never reused (about 250 MB a micro-batch at this width): the reserved bytes would climb
// step after step. Flat from step 5: the caching allocator has every block size it needs after the first
// steps, and nothing else in an eager step changes what it keeps.
TEST_CASE("train.cuda_graphs on CUDA: a capture that fails (the loss read on the host inside it) goes on eager with "
          "the reason, its reserved memory flat from step 5 (zero1 bf16, GPT-2 shape, 30 steps)",
          "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  test::TempDir dir("graphs-fail");
  const auto run = gpt2_graph_run("SUBLINEAR_TEST_CAPTURE=host_read", dir.path / "run");
  INFO(run.graphs.dump());
  CHECK(run.graphs.at("mode") == "eager");
  CHECK(run.graphs.at("captured") == false);
  CHECK_THAT(run.graphs.at("reason").get<std::string>(), Catch::StartsWith("the capture failed"));
  CHECK(run.graphs.at("replays") == 0);
  CHECK(run.graphs.at("eager_micro_batches") == 30 * 4);
  for (size_t i = 4; i < run.reserved.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(run.reserved[i] == run.reserved[4]);
  }
}

// state.async's writer thread waits on a CUDA event (HostSnapshot::wait) while the next step may capture:
// the capture is thread-local, so another thread's wait leaves it valid. The hook makes a thread wait on an
// event inside the capture, every time.
TEST_CASE("train.cuda_graphs on CUDA: another thread waiting on a CUDA event during the capture (as state.async's "
          "writer does) leaves the capture valid",
          "[cuda]") {
  if (!torch::cuda::is_available()) SUBLINEAR_SKIP("no CUDA device here");
  test::TempDir dir("graphs-writer");
  const auto run = gpt2_graph_run("SUBLINEAR_TEST_CAPTURE=writer_wait", dir.path / "run");
  INFO(run.graphs.dump());
  CHECK(run.graphs.at("mode") == "graph");
  CHECK(run.graphs.at("captured") == true);
  CHECK(run.graphs.at("replays") == 30 * 4 - train::StepGraph::kWarmupMicroBatches);
}

}  // namespace SUBLINEAR_TEST_FILE

namespace SUBLINEAR_TEST_FILE {

// optim.in_backward against the ordinary step where the math is the same (no clipping, accumulation 1):
// the same gradients meet the same AdamW arithmetic, so the losses and the final weights are bitwise
// equal. The logged norm sums the same squares in float64 in another order and is not rounded to fp32:
// within 2^-24 (the ordinary norm's fp32 rounding) + 1e-13 (a reordered float64 sum of < 10^3 pieces)
// relative, < 2^-23. No gradient is held at the end of a step, and the peak falls by the model's
// gradients less at most the one gradient in flight (the largest parameter's).
TEST_CASE("optim.in_backward: losses and weights bitwise the ordinary step's, gpt2 none and llama full; no gradient "
          "held; every setting it cannot hold exits 2 naming its key") {
  test::TempDir dir("in-backward");
  const std::string base = "--config configs/tiny.yaml --set train.grad_accum=1 --set train.micro_batch=4 "
                           "--set train.grad_clip=0 --set train.steps=4 --set train.eval_interval=0 "
                           "--set logging.save_model=true --set logging.progress=false";
  const std::vector<std::pair<std::string, std::string>> shapes = {
      {"gpt2-none", ""},
      {"llama-full", "--set model.preset= --set model.arch=llama --set model.n_layer=4 --set checkpointing.mode=full"}};
  for (const auto& [name, sets] : shapes) {
    INFO(name);
    std::map<bool, std::filesystem::path> runs;
    for (const bool in_backward : {false, true}) {
      runs[in_backward] = dir.path / (name + (in_backward ? "-ib" : "-ordinary"));
      const auto r = test::trainer(fmt::format("{} {} --set optim.in_backward={} --set logging.dir={}", base, sets,
                                               in_backward, runs[in_backward].string()));
      INFO(r.output);
      REQUIRE(r.code == 0);
    }
    const auto a = test::step_records(runs[false] / "metrics.jsonl"), b = test::step_records(runs[true] / "metrics.jsonl");
    REQUIRE(a.size() == 4);
    REQUIRE(b.size() == 4);
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].loss == b[i].loss);
      CHECK(std::abs(a[i].grad_norm - b[i].grad_norm) <= 0x1p-23 * a[i].grad_norm);
    }
    const auto pa = test::load_params(runs[false]), pb = test::load_params(runs[true]);
    REQUIRE(pa.size() == pb.size());
    int64_t params = 0, largest = 0;
    for (const auto& [param, t] : pa) {
      INFO(param);
      CHECK(torch::equal(t, pb.at(param)));
      params += t.numel(), largest = std::max<int64_t>(largest, t.numel());
    }
    const auto sa = json::parse(test::read_text(runs[false] / "summary.json"));
    const auto sb = json::parse(test::read_text(runs[true] / "summary.json"));
    CHECK(sb["memory_breakdown"]["grads_bytes"] == 0);
    CHECK(sa["memory_breakdown"]["grads_bytes"] == 4 * params);
    const int64_t fell = sa["peak_allocated_bytes"].get<int64_t>() - sb["peak_allocated_bytes"].get<int64_t>();
    CHECK(fell >= 4 * (params - largest));
    CHECK(fell <= 4 * params);
  }
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"train.grad_accum", "--set train.grad_accum=2"},
      {"train.grad_clip", "--set train.grad_clip=1.0"},
      {"precision.compute", "--set precision.compute=fp16"},
      {"parallel.sharding", "--set parallel.sharding=zero1"},
      {"train.on_spike", "--set train.on_spike=skip"},
      {"train.on_nonfinite", "--set train.on_nonfinite=skip"},
      {"train.cuda_graphs", "--set train.cuda_graphs=on"},
  };
  for (const auto& [key, sets] : refused) {
    INFO(key);
    const auto run_dir = dir.path / ("refused-" + key);
    const auto r = test::trainer(fmt::format("{} --set optim.in_backward=true {} --set logging.dir={}", base, sets,
                                             run_dir.string()));
    INFO(r.output);
    CHECK(r.code == kExitConfig);
    CHECK(r.output.find(key + ": cannot run with optim.in_backward") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(run_dir));
  }
}

}  // namespace SUBLINEAR_TEST_FILE
