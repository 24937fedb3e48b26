// DDP and ZeRO-1/2/3 over flat parameter groups (see engine.h).
#include "parallel/engine.h"

#include <algorithm>
#include <cmath>

#include <c10/core/StorageImpl.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/device.h"
#include "device/host.h"
#include "memory/footprint.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "precision/autocast.h"

namespace sl::parallel {
namespace {

// Runs after a parameter's AccumulateGrad node: its .grad holds this backward's full gradient.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  explicit GradReadyHook(std::function<void()> fn) : fn(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};

}  // namespace

struct Engine::Group {
  std::string name;
  std::vector<torch::Tensor> params;  // matrices first, then vectors
  std::vector<std::string> names;     // the parameters' names in the model
  std::vector<int64_t> offsets;
  int64_t numel = 0, decay = 0, padded = 0, shard = 0;
  torch::Tensor flat_param;   // zero*: the whole group in the compute dtype (zero3: storage only while gathered)
  torch::Tensor shard_param;  // zero*: this rank's fp32 slice, the optimizer's master (zero3 or a low-precision
                              // compute copy: its own buffer; otherwise a view of flat_param)
  torch::Tensor master_full;  // a low-precision compute copy: the group's fp32 masters, gathered for reading
  torch::Tensor flat_grad;    // none/zero1: persistent, .grad are views; zero2/3: transient
  torch::Tensor shard_grad;   // zero*: this rank's slice of the summed gradient (offload.gradients: on the host)
  torch::Tensor host_grad;    // offload.optimizer with the gradient on the device: the host AdamW's copy of it
  torch::Tensor rs_out;       // zero2/3: reduce-scatter result while in flight
  size_t ready = 0;
  bool gathered = true;
  Pending pending;    // the gradient collective in flight
  Pending gathering;  // zero3: the parameter all-gather in flight (a prefetch until waited)
  int64_t bytes() const { return padded * 4; }  // the group in fp32
  torch::Tensor slot() const { return flat_param.narrow(0, shard * rank, shard); }  // this rank's part of flat_param
  int64_t rank = 0;
};

Engine::Engine(model::GPT model, const config::RunConfig& cfg, std::shared_ptr<Comm> comm)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      sharding_(cfg.parallel.sharding),
      param_dtype_(precision::scalar_type(cfg.precision.param_dtype)),
      reduce_dtype_(precision::scalar_type(cfg.precision.reduce_dtype)),
      rank_(comm_->rank()),
      world_(comm_->world()),
      device_(comm_->device()),
      offload_optimizer_(cfg.offload.optimizer),
      offload_grads_(cfg.offload.gradients),
      deferred_(!model_->parameters().empty() && model::is_deferred(model_->parameters().front())) {
  if (deferred_ && !sharding_.shards_params())
    throw std::logic_error("Engine: a deferred model is materialized by zero3 only");
  torch::NoGradGuard no_grad;
  if (!deferred_)
    for (const auto& p : model_->parameters()) init_sum_ += p.to(torch::kFloat64).sum().item<double>();
  build_groups(cfg);  // a deferred model's values are drawn here, and summed
  check_same_init();
}

// Every rank built its model from train.seed; check they agree before training diverges silently.
void Engine::check_same_init() {
  const auto sums = comm_->all_gather(std::vector<double>{init_sum_}, "parameter check");
  for (size_t r = 0; r < sums.size(); ++r)
    if (sums[r] != sums[0])
      throw DistError(fmt::format("rank {} built different initial parameters than rank 0 (sum {} vs {}): every rank "
                                  "must run the same binary and recipe", r, sums[r], sums[0]));
}

Engine::~Engine() {
  for (auto& acc : accumulators_) acc->post_hooks().clear();
}

bool Engine::low_precision_copy() const { return param_dtype_ != at::kFloat; }

// Which parameters form which group: zero3 one group per unit, otherwise buckets of bucket_mb; both in
// reverse unit order (the order gradients arrive in).
Engine::Layout Engine::plan_groups(const config::RunConfig& cfg, const std::vector<std::vector<model::NamedParam>>& units) const {
  Layout l;
  l.group_of_unit.assign(units.size(), -1);
  const bool per_unit = sharding_.shards_params();
  l.members = memory::engine_group_members(units, per_unit, static_cast<int64_t>(cfg.parallel.bucket_mb * 1024 * 1024));
  for (size_t g = 0; g < l.members.size(); ++g) {
    if (!per_unit) {
      l.names.push_back(fmt::format("bucket {}", g));
      continue;
    }
    const size_t u = units.size() - 1 - g;  // the last unit first
    l.group_of_unit[u] = static_cast<int64_t>(g);
    l.names.push_back(model::unit_name(model_->cfg, static_cast<int64_t>(u)));
  }
  return l;
}

// One group's layout (matrices first, offsets, padding) and its buffers. Deferred parameters
// get their values later, from materialize_units.
std::unique_ptr<Engine::Group> Engine::make_group(const std::string& name, std::vector<model::NamedParam> named) {
  auto g = std::make_unique<Group>();
  g->name = name;
  g->rank = rank_;
  std::stable_partition(named.begin(), named.end(), [](const model::NamedParam& p) { return p.tensor.dim() >= 2; });
  for (const auto& [pname, p] : named) {
    g->offsets.push_back(g->numel);
    if (p.dim() >= 2) g->decay += p.numel();
    g->numel += p.numel();
    g->names.push_back(pname);
    g->params.push_back(p);
  }
  g->shard = memory::shard_elems(g->numel, world_);  // 16-byte aligned shards (the planner counts the padding)
  g->padded = g->shard * world_;
  const auto opts = fp32_options();
  if (!sharding_.shards_grads()) {
    g->flat_grad = torch::zeros({g->padded}, opts);
    if (!low_precision_copy())  // else the gradient hook adds each .grad (compute dtype) into it
      for (size_t i = 0; i < g->params.size(); ++i)
        g->params[i].mutable_grad() = g->flat_grad.narrow(0, g->offsets[i], g->params[i].numel()).view(g->params[i].sizes());
  }
  if (sharding_.replicated()) {
    if (offload_optimizer_) bind_replicated_masters(*g);
    return g;
  }
  g->shard_grad = sharding_ == config::Sharding::kZero1 ? g->flat_grad.narrow(0, rank_ * g->shard, g->shard)
                  : offload_grads_                   ? device::host_zeros(g->shard, torch::kFloat)
                                                     : torch::zeros({g->shard}, opts);
  if (offload_optimizer_ && !offload_grads_) g->host_grad = device::host_zeros(g->shard, torch::kFloat);
  if (!deferred_) {
    auto flat = torch::zeros({g->padded}, opts);
    for (size_t i = 0; i < g->params.size(); ++i)
      flat.narrow(0, g->offsets[i], g->params[i].numel()).copy_(g->params[i].reshape({-1}));
    shard_and_bind(*g, std::move(flat));
  }
  return g;
}

// DDP with offload.optimizer: every rank updates the whole group, so its "shard" is the whole group:
// the fp32 masters and the AdamW's gradient copy on the host; the parameters stay as built.
void Engine::bind_replicated_masters(Group& g) {
  auto flat = torch::zeros({g.padded}, fp32_options());
  for (size_t i = 0; i < g.params.size(); ++i)
    flat.narrow(0, g.offsets[i], g.params[i].numel()).copy_(g.params[i].reshape({-1}));
  g.shard_param = device::to_host(flat);
  g.host_grad = device::host_zeros(g.padded, torch::kFloat);
}

std::pair<int64_t, int64_t> Engine::owned_range(const Group& g) const {
  if (sharding_.replicated()) return {0, g.padded};
  return {rank_ * g.shard, rank_ * g.shard + g.shard};
}

// The fp32 master shard from the group's full fp32 values; the parameters become views of flat_param,
// in the compute dtype (a low-precision copy is a second buffer, cast from the fp32 one). zero3 then
// frees flat_param's memory until the unit is gathered.
void Engine::shard_and_bind(Group& g, torch::Tensor flat) {
  g.shard_param = flat.narrow(0, rank_ * g.shard, g.shard);
  if (offload_optimizer_) g.shard_param = device::to_host(g.shard_param);
  else if (sharding_.shards_params() || low_precision_copy()) g.shard_param = g.shard_param.clone();
  if (low_precision_copy()) {
    // zero3 frees flat_param at once (below): only its storage is kept, so the fp32 values go first.
    const bool keep_values = !sharding_.shards_params();
    torch::Tensor copy = keep_values ? flat.to(param_dtype_) : torch::Tensor();
    flat = keep_values ? copy : (flat.reset(), torch::empty({g.padded}, fp32_options().dtype(param_dtype_)));
  }
  g.flat_param = flat;
  for (size_t i = 0; i < g.params.size(); ++i)
    g.params[i].set_data(g.flat_param.narrow(0, g.offsets[i], g.params[i].numel()).view(g.params[i].sizes()));
  if (sharding_.shards_params()) {
    g.gathered = true;
    release_group(g);
  }
}

// zero3 on a deferred model (parameters without memory): unit by unit, in forward order, the unit's full fp32 values
// are drawn into one buffer (init_parameter, parameters in registration order: the same draws a
// one-process build makes), the rank keeps its shard and the buffer goes. At most one unit is whole.
void Engine::materialize_units(const std::vector<std::vector<model::NamedParam>>& units, const std::vector<int64_t>& group_of_unit) {
  for (size_t u = 0; u < units.size(); ++u) {
    auto& g = *groups_[static_cast<size_t>(group_of_unit[u])];
    auto flat = torch::zeros({g.padded}, fp32_options());
    for (const auto& np : units[u]) {
      const auto i = static_cast<size_t>(std::find(g.names.begin(), g.names.end(), np.name) - g.names.begin());
      model::init_parameter(model_->cfg, np.name, flat.narrow(0, g.offsets[i], g.params[i].numel()).view(g.params[i].sizes()));
    }
    init_sum_ += flat.sum().item<double>();  // fp32: a float64 sum would first make a float64 copy of the unit
    shard_and_bind(g, std::move(flat));
  }
}

// unit -> the groups it needs gathered (zero3: its own, and the embeddings for a tied head; otherwise the
// buckets that hold its parameters); parameter name -> (group, index).
void Engine::index_units(const std::vector<std::vector<model::NamedParam>>& units, const std::vector<int64_t>& group_of_unit) {
  unit_groups_.assign(units.size(), {});
  if (sharding_.shards_params()) {
    for (size_t u = 0; u < units.size(); ++u) unit_groups_[u].push_back(static_cast<size_t>(group_of_unit[u]));
    if (model_->cfg.tie_embeddings)  // the head reads the token embedding
      unit_groups_[static_cast<size_t>(model::head_unit(model_->cfg))].push_back(
          static_cast<size_t>(group_of_unit[model::kEmbeddingUnit]));
  } else {
    for (size_t u = 0; u < units.size(); ++u)
      for (size_t gi = 0; gi < groups_.size(); ++gi)
        for (const auto& np : units[u])
          if (std::find(groups_[gi]->names.begin(), groups_[gi]->names.end(), np.name) != groups_[gi]->names.end()) {
            unit_groups_[u].push_back(gi);
            break;
          }
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi]->names.size(); ++i) where_[groups_[gi]->names[i]] = {gi, i};
}

void Engine::build_groups(const config::RunConfig& cfg) {
  torch::NoGradGuard no_grad;
  const auto units = model_->units();  // forward order
  const Layout l = plan_groups(cfg, units);
  for (size_t gi = 0; gi < l.members.size(); ++gi) groups_.push_back(make_group(l.names[gi], l.members[gi]));
  if (deferred_) materialize_units(units, l.group_of_unit);
  index_units(units, l.group_of_unit);
  transient_ = transient_peak_ = 0;
  add_grad_hooks();
}

// Runs when parameter i of group gi has its gradient for this backward.
void Engine::on_param_grad(size_t gi, size_t i) {
  auto& grp = *groups_[gi];
  auto& p = grp.params[i];
  if (sharding_ == config::Sharding::kZero1 && low_precision_copy()) {
    if (p.grad().defined()) {  // accumulated in fp32 over the micro-batches
      grp.flat_grad.narrow(0, grp.offsets[i], p.numel()).view(p.sizes()).add_(p.grad());
      p.mutable_grad().reset();
    }
  } else if (sharding_.shards_grads()) {
    // No gradient reached this parameter in this backward (e.g. an unused input of a
    // checkpointed piece): it contributes zeros, which the group buffer already holds.
    if (!grp.flat_grad.defined()) {
      // The previous group's reduce-scatter overlapped this group's backward until now; finish
      // it before a second full gradient buffer exists.
      finish_in_flight();
      device::LabelScope label(device::Label::comm);  // a memory timeline's label: the gradient in flight
      grp.flat_grad = torch::zeros({grp.padded}, fp32_options().dtype(reduce_dtype_));
      add_transient(grad_buffer_bytes(grp));
    }
    if (p.grad().defined()) {
      grp.flat_grad.narrow(0, grp.offsets[i], p.numel()).view(p.sizes()).copy_(p.grad());
      p.mutable_grad().reset();
    }
  }
  if (++grp.ready == grp.params.size()) launch_ready();
}

// Gradient-ready hooks on every parameter's accumulator (kept alive here so every graph uses it).
void Engine::add_grad_hooks() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    auto& g = *groups_[gi];
    for (size_t i = 0; i < g.params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(g.params[i]);
      acc->add_post_hook(std::make_unique<GradReadyHook>([this, gi, i] { on_param_grad(gi, i); }));
      accumulators_.push_back(std::move(acc));
    }
  }
}

torch::TensorOptions Engine::fp32_options() const { return torch::TensorOptions().dtype(torch::kFloat).device(device_); }

Strategy::Trainables Engine::trainables() {
  Trainables t;
  auto& decay = t.decay;
  auto& no_decay = t.no_decay;
  if (sharding_.replicated() && !offload_optimizer_) {
    for (const auto& p : model_->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  } else {
    for (auto& gp : groups_) {
      auto& g = *gp;
      const auto [lo, hi] = owned_range(g);
      auto piece = [&](int64_t a, int64_t b, std::vector<torch::Tensor>& out) {
        a = std::max(a, lo), b = std::min(b, hi);
        if (a >= b) return;
        auto p = g.shard_param.narrow(0, a - lo, b - a);
        p.mutable_grad() = (g.host_grad.defined() ? g.host_grad : g.shard_grad).narrow(0, a - lo, b - a);
        out.push_back(p);
      };
      piece(0, g.decay, decay);
      piece(g.decay, g.numel, no_decay);
    }
  }
  return t;
}

std::string Engine::describe() const {
  return fmt::format("{} rank(s), backend {}, sharding {}", world_, comm_->backend(), sharding_.name());
}

double Engine::global_norm(double summed_shares) const { return std::sqrt(summed_shares); }

void Engine::sum_over_ranks(torch::Tensor& t, const std::string& what) {
  if (world_ > 1) comm_->all_reduce_sum(t, what).wait();
}

void Engine::check_reduction(const std::string& what) {
  if (world_ > 1) comm_->check(what);
}

nlohmann::json Engine::layout() const {
  return {{"largest_group_bytes", largest_unit_bytes()}, {"groups", groups()}, {"groups_launched_during_backward", launched_from_hooks()}};
}

void Engine::attach(checkpointing::Runner& runner) {
  if (!sharding_.shards_params()) return;
  checkpointing::UnitHooks h;
  h.before = [this](int64_t u) { unit_before(u); };
  h.after = [this](int64_t u, const torch::Tensor& in, const torch::Tensor& out, bool needs) {
    unit_after(u, in, out, needs);
  };
  h.flush = [this] { unit_flush(); };
  runner.set_unit_hooks(std::move(h));
}

void Engine::zero_grad() {
  release_all();  // a prefetch left behind by a forward that did not finish
  gathers_ = 0;
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) (!sharding_.shards_grads() ? g->flat_grad : g->shard_grad).zero_();
}

void Engine::begin_backward(bool last) {
  last_micro_ = last;
  in_backward_ = true;
  if (last) launched_from_hooks_ = 0;
  cursor_ = 0;
  for (auto& g : groups_) g->ready = 0;
}

void Engine::launch_ready() {
  while (cursor_ < groups_.size() && groups_[cursor_]->ready == groups_[cursor_]->params.size()) launch(cursor_++);
}

void Engine::launch(size_t gi) {
  auto& g = *groups_[gi];
  if (in_backward_ && last_micro_) ++launched_from_hooks_;
  if (!sharding_.shards_grads()) {
    if (last_micro_ && world_ > 1) g.pending = comm_->all_reduce_sum(g.flat_grad, "gradient all-reduce of " + g.name);
    return;
  }
  if (!g.flat_grad.defined()) {  // no gradient reached this group (unused parameters): reduce zeros
    finish_in_flight();
    device::LabelScope label(device::Label::comm);
    // On the device, as the hook path makes it: the collective's buffer (under offload.gradients the
    // shard is on the host, and NCCL takes no host tensor).
    g.flat_grad = torch::zeros({g.padded}, fp32_options().dtype(reduce_dtype_));
    add_transient(grad_buffer_bytes(g));
  }
  if (sharding_.shards_params()) release_group(g);  // its backward is over
  // NCCL takes device tensors only: a buffer on the host here is this engine's bug, named as one.
  TORCH_INTERNAL_ASSERT(g.flat_grad.device() == device_, "gradient buffer of ", g.name, " on ", g.flat_grad.device(),
                        ", not the run's device ", device_);
  // In place: the output is this rank's slice of the group's gradient buffer.
  g.rs_out = g.flat_grad.narrow(0, rank_ * g.shard, g.shard);
  g.pending = comm_->reduce_scatter_sum(g.rs_out, g.flat_grad, "gradient reduce-scatter of " + g.name);
  in_flight_.push_back(gi);
}

void Engine::finish_in_flight() {
  for (size_t gi : in_flight_) finish(gi);
  in_flight_.clear();
}

void Engine::finish(size_t gi) {
  auto& g = *groups_[gi];
  g.pending.wait();
  if (g.rs_out.defined()) {
    torch::NoGradGuard no_grad;
    if (offload_grads_) moved_.to_host += static_cast<int64_t>(g.rs_out.nbytes());
    g.shard_grad.add_(offload_grads_ ? device::host_readable(g.rs_out) : g.rs_out);
    g.rs_out.reset();
    g.flat_grad.reset();
    add_transient(-grad_buffer_bytes(g));
  }
}

void Engine::end_backward() {
  in_backward_ = false;
  for (auto& g : groups_) g->ready = g->params.size();  // parameters that got no gradient count as ready
  launch_ready();
  if (!sharding_.shards_grads()) {
    for (size_t gi = 0; gi < groups_.size(); ++gi) finish(gi);
  } else {
    finish_in_flight();
  }
  pending_out_.reset();
  if (!last_micro_ || world_ == 1) return;
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / static_cast<double>(world_);
  for (auto& g : groups_) (!sharding_.shards_grads() ? g->flat_grad : g->shard_grad).mul_(inv);
}

std::vector<torch::Tensor> Engine::grads() const {
  std::vector<torch::Tensor> out;
  for (const auto& g : groups_)
    out.push_back(sharding_.replicated() ? g->flat_grad : g->shard_grad);
  return out;
}

torch::Tensor Engine::grad_norm_sq_share() {
  torch::NoGradGuard no_grad;
  const auto gs = grads();
  // none: every rank holds the same averaged gradient; one copy of its norm goes into the sum.
  if (sharding_.replicated() && rank_ != 0) return torch::zeros({}, gs.front().options().dtype(torch::kDouble));
  // Accumulated in float64: the norm (and so the clip factor) must not depend on how the gradient is
  // cut into buckets or shards, or the stages would drift apart by rounding (visible under bf16).
  // Gradients on the CPU (the CPU device, or offload.gradients' host shards): the single-process
  // clipping's fused float64 pass, no copy (was 11 float64 conversions on l12: ~3 ms of a ~0.4 s step,
  // 13.6 ms under the profiler).
  if (const auto sq = optim::sum_of_squares(gs))
    return torch::scalar_tensor(*sq, torch::TensorOptions().dtype(torch::kDouble)).to(device_);
  // Elsewhere chunk by chunk: a float64 norm converts its input first, and a whole group's float64
  // copy is twice the group's gradient (memory/footprint.h counts one chunk's copy).
  device::HostScope host(offload_grads_);  // the chunks' float64 copies are made where the gradient lives
  std::vector<torch::Tensor> norms;
  for (const auto& t : gs)
    for (int64_t off = 0; off < t.numel(); off += memory::kGradNormChunk)
      norms.push_back(at::linalg_vector_norm(t.narrow(0, off, std::min(memory::kGradNormChunk, t.numel() - off)), 2,
                                             std::nullopt, false, at::kDouble));
  return torch::stack(norms).pow(2).sum().to(device_);  // offload.gradients: summed on the host, read with the loss
}

void Engine::clip(double max_norm, double norm) {
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0)) return;
  torch::NoGradGuard no_grad;
  for (auto& t : grads()) t.mul_(coef);
}

void Engine::after_step() {
  if (sharding_.replicated() && offload_optimizer_) return masters_to_params();
  if (sharding_.replicated() || sharding_.shards_params()) return;
  torch::NoGradGuard no_grad;
  std::vector<Pending> works;
  for (auto& g : groups_)  // in place: the input is this rank's slot of the output (as FSDP does)
    works.push_back(comm_->all_gather(g->flat_param, compute_shard(*g), "parameter all-gather of " + g->name));
  for (auto& w : works) w.wait();
}

void Engine::optimizer_step(torch::optim::AdamW& opt) {
  grads_to_host();
  {
    device::HostScope host(offload_optimizer_);  // the moments AdamW makes on its first step belong to the host
    optim::adamw_step(opt);
  }
  after_step();
}

// offload.optimizer with the gradient shard on the device: the host AdamW reads a copy, made after
// clipping (the values it would read on the device).
void Engine::grads_to_host() {
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) {
    if (!g->host_grad.defined()) continue;
    device::copy_into(g->host_grad, sharding_.replicated() ? g->flat_grad : g->shard_grad);
    moved_.to_host += static_cast<int64_t>(g->host_grad.nbytes());
  }
}

// DDP with offload.optimizer: the updated host masters into the parameters (every rank made the same update).
void Engine::masters_to_params() {
  torch::NoGradGuard no_grad;
  for (auto& g : groups_)
    for (size_t i = 0; i < g->params.size(); ++i) {
      device::copy_into(g->params[i], g->shard_param.narrow(0, g->offsets[i], g->params[i].numel()));
      moved_.to_device += static_cast<int64_t>(g->params[i].nbytes());
    }
}

Moved Engine::take_moved() {
  const Moved m = moved_;
  moved_ = {};
  return m;
}

void Engine::params_loaded() { after_step(); }

// This rank's slot of flat_param holding its master shard in the compute dtype (the all-gather's input).
// With offload.optimizer the masters are on the host: they are copied into the slot (on the device).
torch::Tensor Engine::compute_shard(Group& g) {
  if (!low_precision_copy() && !offload_optimizer_) return g.shard_param;  // zero1/2: the slot itself; zero3: its own fp32 buffer
  auto slot = g.slot();
  device::copy_into(slot, g.shard_param);  // a low-precision copy: rounded to nearest even
  if (offload_optimizer_) moved_.to_device += static_cast<int64_t>(slot.nbytes());
  return slot;
}

StateBytes Engine::state_bytes() const {
  StateBytes s;
  s.optimizer_on_host = offload_optimizer_;
  for (const auto& g : groups_) {
    if (sharding_.replicated()) {
      for (const auto& p : g->params) s.params += static_cast<int64_t>(p.nbytes());
      if (offload_optimizer_) s.host_params += g->padded * 4;
    } else {
      // fp32 masters of the shard (zero3, a low-precision compute copy, or offload: on the host) or the
      // whole group (zero1/2); plus the compute copy's full group (zero1/2 with a low-precision copy or offload)
      const int64_t master = g->shard * 4;
      const int64_t whole = sharding_.shards_params() ? 0 : g->padded * c10::elementSize(param_dtype_);
      if (offload_optimizer_) s.host_params += master, s.params += whole;
      else s.params += sharding_.shards_params() ? master : low_precision_copy() ? master + whole : whole;
    }
    const int64_t grad = (!sharding_.shards_grads() ? g->padded : g->shard) * 4;
    (offload_grads_ ? s.host_grads : s.grads) += grad;
    if (g->host_grad.defined()) s.host_grads += static_cast<int64_t>(g->host_grad.nbytes());
  }
  return s;
}

// The optimizer tensor whose storage holds the span: a parameter itself (DDP) or a shard piece.
OptSlot Engine::optimizer_slot(torch::optim::AdamW& opt, const Span& span) const {
  const auto* storage = span.values.storage().unsafeGetStorageImpl();
  const int64_t at = span.values.storage_offset(), len = span.end - span.begin;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params())
      if (p.storage().unsafeGetStorageImpl() == storage && at >= p.storage_offset() &&
          at + len <= p.storage_offset() + p.numel())
        return {p, at - p.storage_offset()};
  throw std::logic_error("state: no optimizer tensor holds parameter " + span.param);
}

std::vector<Span> Engine::owned_spans() const {
  if (sharding_.replicated() && !offload_optimizer_) return held_spans();
  std::vector<Span> out;
  for (const auto& gp : groups_) {
    const auto& g = *gp;
    const auto [lo, hi] = owned_range(g);
    for (size_t i = 0; i < g.params.size(); ++i) {
      const int64_t a = std::max(lo, g.offsets[i]), b = std::min(hi, g.offsets[i] + g.params[i].numel());
      if (a < b) out.push_back({g.names[i], a - g.offsets[i], b - g.offsets[i], g.shard_param.detach().narrow(0, a - lo, b - a)});
    }
  }
  return out;
}

std::vector<Span> Engine::held_spans() const {
  if (sharding_.shards_params() || low_precision_copy() || offload_optimizer_) return owned_spans();
  std::vector<Span> out;
  for (const auto& gp : groups_)
    for (size_t i = 0; i < gp->params.size(); ++i)
      out.push_back({gp->names[i], 0, gp->params[i].numel(), gp->params[i].detach().view({-1})});
  return out;
}

void Engine::gather_all() {
  if (!sharding_.shards_params()) return;
  for (auto& g : groups_) gather_group(*g);
}

void Engine::release_all() {
  if (!sharding_.shards_params()) return;
  for (auto& g : groups_) release_group(*g);
}

void Engine::gather_unit(int64_t unit) {
  torch::NoGradGuard no_grad;
  if (low_precision_copy()) {
    for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) gather_master(*groups_[gi]);
  } else if (sharding_.shards_params()) {
    gather(unit);
  }
}

void Engine::release_unit(int64_t unit) {
  if (low_precision_copy()) {
    for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) {
      auto& g = *groups_[gi];
      if (g.master_full.defined()) add_transient(-g.bytes());
      g.master_full.reset();
    }
  } else if (sharding_.shards_params()) {
    release(unit);
  }
}

torch::Tensor Engine::param_values(const std::string& name) const {
  const auto [gi, i] = where_.at(name);
  const auto& g = *groups_[gi];
  const int64_t n = g.params[i].numel();
  if (low_precision_copy()) return g.master_full.narrow(0, g.offsets[i], n);
  return g.params[i].detach().view({-1});
}

// The group's fp32 masters, all-gathered into a buffer of their own (a low-precision compute copy
// cannot give them back).
void Engine::gather_master(Group& g) {
  if (g.master_full.defined()) return;
  g.master_full = torch::empty({g.padded}, fp32_options());
  add_transient(g.bytes());
  // offload.optimizer: the masters are on the host; the collective takes a device copy of the shard
  const auto shard = offload_optimizer_ ? device::to_device(g.shard_param, device_) : g.shard_param;
  comm_->all_gather(g.master_full, shard, "master all-gather of " + g.name).wait();
}

int64_t Engine::take_transient_peak() {
  const int64_t p = transient_peak_;
  transient_peak_ = transient_;
  return p;
}

int64_t Engine::largest_unit_bytes() const {
  int64_t b = 0;
  for (const auto& g : groups_) b = std::max(b, g->bytes());
  return b;
}

int64_t Engine::param_buffer_bytes(const Group& g) const {
  return g.padded * static_cast<int64_t>(c10::elementSize(param_dtype_));
}

int64_t Engine::grad_buffer_bytes(const Group& g) const {
  return g.padded * static_cast<int64_t>(c10::elementSize(reduce_dtype_));
}

void Engine::add_transient(int64_t bytes) {
  transient_ += bytes;
  transient_peak_ = std::max(transient_peak_, transient_);
}

// ---- zero3: parameters exist only while gathered ----

void Engine::start_gather(Group& g) {
  if (g.gathered) return;
  auto* storage = g.flat_param.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(param_buffer_bytes(g));
  device::LabelScope label(device::Label::gathered_params);  // a memory timeline's label
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  g.gathered = true;
  ++gathers_;
  add_transient(param_buffer_bytes(g));
  g.gathering = comm_->all_gather(g.flat_param, compute_shard(g), "parameter all-gather of " + g.name);
}

void Engine::gather_group(Group& g) {
  start_gather(g);
  g.gathering.wait();  // a no-op unless this gather (or its prefetch) is still in flight
}

void Engine::release_group(Group& g) {
  if (!g.gathered) return;
  g.gathering.wait();  // never free a buffer a collective is still writing
  auto* storage = g.flat_param.storage().unsafeGetStorageImpl();
  // The parameters (and any tensor autograd saved from them) keep this storage; only its memory goes.
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, g.flat_param.device()));
  storage->set_nbytes(0);
  g.gathered = false;
  add_transient(-param_buffer_bytes(g));
}

void Engine::gather(int64_t unit) {
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) gather_group(*groups_[gi]);
}

void Engine::release(int64_t unit) {
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) release_group(*groups_[gi]);
}

void Engine::unit_before(int64_t unit) {
  gather(unit);
  // Forward prefetch: start the next unit's all-gather so it overlaps this unit's compute (at most
  // two units' parameters exist). Not in backward: a recompute's next unit is not the one needed.
  if (!in_backward_ && unit + 1 < static_cast<int64_t>(unit_groups_.size()))
    for (size_t gi : unit_groups_[static_cast<size_t>(unit + 1)]) start_gather(*groups_[gi]);
}

void Engine::unit_after(int64_t unit, const torch::Tensor& in, const torch::Tensor& out, bool needs_params_in_backward) {
  release(unit);
  if (!torch::GradMode::is_enabled()) return;  // eval, or the first pass of a checkpointed segment
  if (pending_out_ && in.defined() && pending_out_->first.is_same(in)) {
    // The previous unit's output is this unit's input: one hook, run when this unit's backward is
    // over, frees this unit and gathers the previous one for its backward.
    const int64_t prev = pending_out_->second;
    pending_out_.reset();
    in.register_hook([this, unit, prev](const torch::Tensor&) {
      release(unit);
      gather(prev);
      prefetch_backward(prev);
    });
  } else {
    unit_flush();
    if (in.defined() && in.requires_grad()) in.register_hook([this, unit](const torch::Tensor&) { release(unit); });
  }
  if (needs_params_in_backward && out.requires_grad()) pending_out_.emplace(out, unit);
}

void Engine::unit_flush() {
  if (!pending_out_) return;
  auto [t, unit] = *pending_out_;
  pending_out_.reset();
  t.register_hook([this, unit](const torch::Tensor&) {
    gather(unit);
    prefetch_backward(unit);
  });
}

// Backward prefetch: while `unit`'s backward runs, start the all-gather of the block before it, whose
// backward (or recompute) comes next, so the transfer overlaps this unit's compute. The embeddings need
// no parameters in backward and are never prefetched. At most a third unit's parameters exist beside a
// unit's parameters and gradient (memory/footprint.cpp counts it). Hooks run in the same order on every
// rank, so the all-gathers pair up.
void Engine::prefetch_backward(int64_t unit) {
  const int64_t next = unit - 1;
  if (next < model::block_unit(0)) return;
  for (size_t gi : unit_groups_[static_cast<size_t>(next)]) start_gather(*groups_[gi]);
}

}  // namespace sl::parallel
