#include "optim/optimizer.h"
#include "device/alloc_tag.h"
#include "predict/footprint.h"
#include "kernels/cpu/clones.h"
#include "model/intra_op.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <ATen/ops/_fused_adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

namespace sl::optim {
namespace {

// The per-element constants of one parameter's update.
struct AdamWCoeffs {
  float decay;         // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^step)
  float eps;
  float neg_step;      // -lr / (1 - beta1^step)
};

AdamWCoeffs coeffs(const torch::optim::AdamWOptions& o, int64_t step) {
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step)), bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  return {static_cast<float>(1.0 - o.lr() * o.weight_decay()),
          static_cast<float>(b1),
          static_cast<float>(1.0 - b1),
          static_cast<float>(b2),
          static_cast<float>(1.0 - b2),
          static_cast<float>(1.0 / std::sqrt(bc2)),
          static_cast<float>(o.eps()),
          static_cast<float>(-o.lr() / bc1)};
}

// m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2; p = decay p - step m / (sqrt(v / bc2) + eps).
// AVX2 + FMA and baseline clones (kernels/cpu/clones.h), bitwise equal: every operation is a separately
// rounded IEEE multiply, add, divide or square root in the order written, in every lane and the scalar
// tail alike. That holds because this file is built with -ffp-contract=off (CMakeLists.txt): otherwise
// GCC fuses a * b + c into one FMA (one rounding) in the AVX2 clone and not in the baseline one, and
// data-parallel replicas on different CPU kinds would drift apart. (-fno-math-errno lets sqrt vectorize.)
SL_KERNEL_BODY void adamw_kernel_body(float* p, float* m, float* v, const float* g, int64_t n, const AdamWCoeffs& k) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] * k.beta1 + gi * k.one_minus_beta1;
    const float vi = v[i] * k.beta2 + gi * gi * k.one_minus_beta2;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * k.decay + k.neg_step * mi / (std::sqrt(vi) * k.inv_sqrt_bc2 + k.eps);
  }
}
SL_KERNEL_CLONES(void, adamw_kernel, (float* p, float* m, float* v, const float* g, int64_t n, const AdamWCoeffs& k),
                 (p, m, v, g, n, k))

// The optimizer's first parameter is a CUDA tensor (the rest are checked by adamw_step_grouped).
bool opt_on_cuda(const torch::optim::AdamW& opt) {
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) return p.device().is_cuda();
  return false;
}

bool fp32_cpu_contiguous(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
}

// Every parameter, gradient and existing moment is a contiguous fp32 CPU tensor (the kernel reads
// them as flat arrays), and no group uses amsgrad.
bool fused_eligible(torch::optim::AdamW& opt) {
  for (const auto& group : opt.param_groups()) {
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) return false;
    for (const auto& p : group.params()) {
      if (!fp32_cpu_contiguous(p)) return false;
      if (p.grad().defined() && !fp32_cpu_contiguous(p.grad())) return false;
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end() || !it->second) continue;
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      if (!fp32_cpu_contiguous(st.exp_avg()) || !fp32_cpu_contiguous(st.exp_avg_sq())) return false;
    }
  }
  return true;
}

// The parameter's state, made as AdamW::step makes it on the first step: step 0, zero moments.
torch::optim::AdamWParamState& state_of(torch::optim::AdamW& opt, const torch::Tensor& p) {
  // Made whole before it enters the map: an allocation that fails (out of memory) leaves no empty entry.
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end() || !it->second) {
    device::LabelScope label(device::Label::optimizer_state);  // for a memory timeline of the first step
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    it = opt.state().insert_or_assign(p.unsafeGetTensorImpl(), std::move(fresh)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

// One parameter's update: its flat arrays and constants.
struct Update {
  float *p, *m, *v;
  const float* g;
  AdamWCoeffs k;
};

// Every update in one pass over pieces of all the parameters on ATen's intra-op threads (each element
// on its own, so the split changes no bit): one thread launch a step, not one per parameter (most of
// them too small to split at all). A parameter listed twice would race with itself: make_adamw's
// groups hold each tensor once (the tied embedding is one parameter).
void fused_updates(const std::vector<Update>& updates, const std::vector<int64_t>& sizes) {
  const auto pieces = model::pieces_of_arrays(sizes, memory::kAdamwPiece);
  model::for_each_index(static_cast<int64_t>(pieces.size()), [&](int64_t i, int) {
    const Update& u = updates[pieces[i].array];
    const int64_t b = pieces[i].begin;
    adamw_kernel(u.p + b, u.m + b, u.v + b, u.g + b, pieces[i].size, u.k);
  });
}

// A parameter, its gradient and both moments, all on one device in one dtype the ATen fused kernel
// takes (fp32, bf16, fp16), dense and contiguous.
bool group_fusable(const torch::Tensor& p, const torch::optim::AdamW& opt) {
  const auto ok = [&](const torch::Tensor& t) {
    return t.layout() == torch::kStrided && t.device() == p.device() && t.scalar_type() == p.scalar_type() &&
           t.is_contiguous();
  };
  const auto dt = p.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16 && dt != torch::kHalf) return false;
  if (!ok(p) || (p.grad().defined() && !ok(p.grad()))) return false;
  const auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end() || !it->second) return true;  // state_of makes it
  const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
  return ok(st.exp_avg()) && ok(st.exp_avg_sq());
}

// The tensor lists of one at::_fused_adamw_ call: the parameters of a group that share a device and
// dtype and have a gradient.
struct FusedLists {
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
  std::vector<int64_t> steps;  // each parameter's step count after this step (the host keeps them)
};

std::map<std::pair<std::string, torch::ScalarType>, FusedLists> fused_lists(torch::optim::AdamW& opt,
                                                                            torch::optim::OptimizerParamGroup& group) {
  std::map<std::pair<std::string, torch::ScalarType>, FusedLists> out;
  for (auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    auto& st = state_of(opt, p);
    st.step(st.step() + 1);
    auto& l = out[{p.device().str(), p.scalar_type()}];
    l.params.push_back(p);
    l.grads.push_back(p.grad());
    l.exp_avgs.push_back(st.exp_avg());
    l.exp_avg_sqs.push_back(st.exp_avg_sq());
    l.steps.push_back(st.step());
  }
  return out;
}

// The kernel's step counts: one fp32 scalar per parameter on its device (it reads, never increments
// them). All equal, the usual case: one fill on the device, no host-to-device copy.
std::vector<torch::Tensor> step_tensors(const std::vector<int64_t>& steps, const torch::Device& device) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  const bool same = std::all_of(steps.begin(), steps.end(), [&](int64_t s) { return s == steps.front(); });
  if (same)
    return torch::full({static_cast<int64_t>(steps.size())}, static_cast<double>(steps.front()), opts).unbind(0);
  std::vector<float> host(steps.begin(), steps.end());
  return torch::tensor(host).to(device).unbind(0);
}

bool every_param_group_fusable(torch::optim::AdamW& opt) {
  for (const auto& group : opt.param_groups()) {
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) return false;
    for (const auto& p : group.params())
      if (!group_fusable(p, opt)) return false;
  }
  return true;
}

}  // namespace

bool adamw_step_grouped(torch::optim::AdamW& opt) {
  if (!every_param_group_fusable(opt)) return false;
  torch::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& [key, l] : fused_lists(opt, group)) {
      const auto steps = step_tensors(l.steps, l.params.front().device());
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                        std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), /*amsgrad=*/false,
                        /*maximize=*/false);
    }
  }
  return true;
}

void adamw_step(torch::optim::AdamW& opt) {
  if (!fused_eligible(opt)) {
    if (opt_on_cuda(opt) && adamw_step_grouped(opt)) return;
    opt.step();
    return;
  }
  torch::NoGradGuard no_grad;
  struct Stepped {
    const torch::Tensor* p;
    torch::optim::AdamWParamState* st;  // the map owns it; later inserts do not move it
    const torch::optim::AdamWOptions* o;
  };
  std::vector<Stepped> stepped;  // every state made first: one that cannot be made changes no step count
  for (auto& group : opt.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined())
        stepped.push_back({&p, &state_of(opt, p), &static_cast<const torch::optim::AdamWOptions&>(group.options())});
  std::vector<Update> updates;
  std::vector<int64_t> sizes;
  for (const auto& [p, st, o] : stepped) {  // fused_eligible: every tensor here is contiguous fp32 on the CPU
    st->step(st->step() + 1);
    updates.push_back({p->data_ptr<float>(), st->exp_avg().data_ptr<float>(), st->exp_avg_sq().data_ptr<float>(),
                       p->grad().const_data_ptr<float>(), coeffs(*o, st->step())});
    sizes.push_back(p->numel());
  }
  fused_updates(updates, sizes);
}

}  // namespace sl::optim
