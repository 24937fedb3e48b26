// What every data-parallel stage shares: groups, gradient hooks, collectives' order, norm, clip, step
// (engine.h); the stage classes are in stages.cpp and zero3.cpp.
#include "parallel/engine.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/device.h"
#include "device/host.h"
#include "predict/footprint.h"
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

Engine::Engine(model::GPT model, const Spec& spec, std::shared_ptr<Comm> comm)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      stage_name_(spec.parallel.sharding.name()),
      param_dtype_(precision::scalar_type(spec.precision.param_dtype)),
      reduce_dtype_(precision::scalar_type(spec.precision.reduce_dtype)),
      rank_(comm_->rank()),
      world_(comm_->world()),
      device_(comm_->device()),
      host_(spec.offload),
      deferred_(!model_->parameters().empty() && model::is_deferred(model_->parameters().front())) {}

void Engine::init(const Spec& spec) {
  if (deferred_ && !groups_per_unit())
    throw std::logic_error("Engine: a deferred model is materialized by zero3 only");
  torch::NoGradGuard no_grad;
  if (!deferred_)
    for (const auto& p : model_->parameters()) init_sum_ += p.to(torch::kFloat64).sum().item<double>();
  // a deferred model's values are drawn here, and summed
  build_groups(static_cast<int64_t>(spec.parallel.bucket_mb * 1024 * 1024));
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

namespace {
// The name of a unit's first parameter that trains ("" when none does: model.lora's embeddings and head).
std::string first_trained(const std::vector<model::NamedParam>& unit) {
  for (const auto& p : unit)
    if (p.tensor.requires_grad()) return p.name;
  return "";
}
}  // namespace

// Which parameters form which group: zero3 one group per unit, otherwise buckets of bucket_mb; both in
// reverse unit order (the order gradients arrive in).
Engine::Layout Engine::plan_groups(int64_t bucket_bytes,
                                   const std::vector<std::vector<model::NamedParam>>& units) const {
  Layout l;
  l.group_of_unit.assign(units.size(), -1);
  const bool per_unit = groups_per_unit();
  l.members = memory::engine_group_members(units, per_unit, bucket_bytes);
  if (!per_unit) {
    for (size_t g = 0; g < l.members.size(); ++g) l.names.push_back(fmt::format("bucket {}", g));
    return l;
  }
  size_t g = 0;  // the last unit first; a unit with nothing to train (model.lora) has no group
  for (size_t k = 0; k < units.size(); ++k) {
    const size_t u = units.size() - 1 - k;
    if (g == l.members.size() || units[u].empty() || l.members[g].front().name != first_trained(units[u])) continue;
    l.group_of_unit[u] = static_cast<int64_t>(g++);
    l.names.push_back(model::unit_name(model_->cfg, static_cast<int64_t>(u)));
  }
  return l;
}

// One group's layout (matrices first, offsets, padding); the stage binds its buffers. Deferred
// parameters get their values later, from materialize_units.
std::unique_ptr<Group> Engine::make_group(const std::string& name, std::vector<model::NamedParam> named) {
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
  bind_group(*g);
  return g;
}

torch::Tensor Engine::full_values(const Group& g) const {
  auto flat = torch::zeros({g.padded}, fp32_options());
  for (size_t i = 0; i < g.params.size(); ++i)
    flat.narrow(0, g.offsets[i], g.params[i].numel()).copy_(g.params[i].reshape({-1}));
  return flat;
}

void Engine::bind_flat_grad(Group& g) {
  g.flat_grad = torch::zeros({g.padded}, fp32_options());
  if (!low_precision_copy())  // else the gradient hook adds each .grad (compute dtype) into it
    for (size_t i = 0; i < g.params.size(); ++i)
      g.params[i].mutable_grad() = g.flat_grad.narrow(0, g.offsets[i], g.params[i].numel()).view(g.params[i].sizes());
}

std::pair<int64_t, int64_t> Engine::owned_range(const Group& g) const {
  return {rank_ * g.shard, rank_ * g.shard + g.shard};
}

// The parameters become views of flat_param in the compute dtype (a low-precision copy is a second
// buffer, cast from the fp32 one); a non-resident copy (zero3) keeps only flat_param's storage.
void Engine::shard_and_bind(Group& g, torch::Tensor flat, bool resident) {
  g.shard_param = host_.master(flat.narrow(0, rank_ * g.shard, g.shard), !resident || low_precision_copy());
  if (low_precision_copy()) {
    // A non-resident copy is freed at once: only its storage is kept, so the fp32 values go first.
    torch::Tensor copy = resident ? flat.to(param_dtype_) : torch::Tensor();
    flat = resident ? copy : (flat.reset(), torch::empty({g.padded}, fp32_options().dtype(param_dtype_)));
  }
  g.flat_param = flat;
  for (size_t i = 0; i < g.params.size(); ++i)
    g.params[i].set_data(g.flat_param.narrow(0, g.offsets[i], g.params[i].numel()).view(g.params[i].sizes()));
}

void Engine::bind_values(Group&, torch::Tensor) {
  throw std::logic_error("Engine: a deferred model is materialized by zero3 only");
}

// zero3 on a deferred model (parameters without memory): unit by unit, in forward order, the unit's full fp32 values
// are drawn into one buffer (init_parameter, parameters in registration order: the same draws a
// one-process build makes), the rank keeps its shard and the buffer goes. At most one unit is whole.
void Engine::materialize_units(const std::vector<std::vector<model::NamedParam>>& units,
                               const std::vector<int64_t>& group_of_unit) {
  for (size_t u = 0; u < units.size(); ++u) {
    Group* g = group_of_unit[u] < 0 ? nullptr : groups_[static_cast<size_t>(group_of_unit[u])].get();
    auto flat = g ? torch::zeros({g->padded}, fp32_options()) : torch::Tensor();
    for (const auto& np : units[u]) {
      if (!np.tensor.requires_grad()) {  // model.lora's frozen weight: whole on every rank, drawn in turn
        materialize_frozen(np);
        continue;
      }
      const auto i = static_cast<size_t>(std::find(g->names.begin(), g->names.end(), np.name) - g->names.begin());
      model::init_parameter(model_->cfg, np.name,
                            flat.narrow(0, g->offsets[i], g->params[i].numel()).view(g->params[i].sizes()));
    }
    if (!g) continue;
    init_sum_ += flat.sum().item<double>();  // fp32: a float64 sum would first make a float64 copy of the unit
    bind_values(*g, std::move(flat));
  }
}

// A frozen weight of a deferred model: its fp32 values drawn as a one-process build draws them, kept in the
// dtype the model holds it in (model.lora.base_dtype: matrices in bf16), on the device.
void Engine::materialize_frozen(const model::NamedParam& np) {
  auto t = torch::empty(np.tensor.sizes(), fp32_options());
  model::init_parameter(model_->cfg, np.name, t);
  init_sum_ += t.sum().item<double>();
  const bool bf16 = model_->cfg.lora.base_dtype == config::Dtype::kBf16 && np.tensor.dim() >= 2;
  torch::Tensor param = np.tensor;
  param.set_data(bf16 ? t.to(torch::kBFloat16) : t);
}

// unit -> the groups it needs gathered (a group per unit: its own, and the embeddings for a tied head;
// otherwise the buckets that hold its parameters); parameter name -> (group, index).
void Engine::index_units(const std::vector<std::vector<model::NamedParam>>& units,
                         const std::vector<int64_t>& group_of_unit) {
  unit_groups_.assign(units.size(), {});
  if (groups_per_unit()) {
    for (size_t u = 0; u < units.size(); ++u)
      if (group_of_unit[u] >= 0) unit_groups_[u].push_back(static_cast<size_t>(group_of_unit[u]));
    if (model_->cfg.tie_embeddings && group_of_unit[model::kEmbeddingUnit] >= 0)  // the head reads the token embedding
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

void Engine::build_groups(int64_t bucket_bytes) {
  torch::NoGradGuard no_grad;
  const auto units = model_->units();  // forward order
  const Layout l = plan_groups(bucket_bytes, units);
  for (size_t gi = 0; gi < l.members.size(); ++gi) groups_.push_back(make_group(l.names[gi], l.members[gi]));
  if (deferred_) materialize_units(units, l.group_of_unit);
  index_units(units, l.group_of_unit);
  transient_ = transient_peak_ = 0;
  add_grad_hooks();
}

// Runs when parameter i of group gi has its gradient for this backward.
void Engine::on_param_grad(size_t gi, size_t i) {
  auto& g = *groups_[gi];
  take_grad(g, i);
  if (++g.ready == g.params.size()) launch_ready();
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

// The nodes are dropped first (their hooks cleared), so that grad_accumulator, whose cache of a
// parameter's node is a weak reference, makes a new one under the current stream (InputMetadata records
// the current stream at construction); a node a live autograd graph still holds is returned as it was.
// A node off an accelerator (the CPU) has no stream: it counts as where it should be.
bool Engine::hooks_to_current_stream() {
  for (auto& acc : accumulators_) acc->post_hooks().clear();
  accumulators_.clear();
  add_grad_hooks();
  const auto current = c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_);
  return std::all_of(accumulators_.begin(), accumulators_.end(), [&](const auto& acc) {
    const std::optional<c10::Stream> s = acc->stream();
    return !s || *s == current;
  });
}

torch::TensorOptions Engine::fp32_options() const {
  return torch::TensorOptions().dtype(torch::kFloat).device(device_);
}

Strategy::Trainables Engine::shard_pieces() {
  Trainables t;
  for (auto& gp : groups_) {
    auto& g = *gp;
    const auto [lo, hi] = owned_range(g);
    auto piece = [&](int64_t a, int64_t b, std::vector<torch::Tensor>& out) {
      a = std::max(a, lo), b = std::min(b, hi);
      if (a >= b) return;
      auto p = g.shard_param.narrow(0, a - lo, b - a);
      p.mutable_grad() = (g.host_grad.defined() ? g.host_grad : g.step_grad).narrow(0, a - lo, b - a);
      out.push_back(p);
    };
    piece(0, g.decay, t.decay);
    piece(g.decay, g.numel, t.no_decay);
  }
  return t;
}

std::string Engine::describe() const {
  return fmt::format("{} rank(s), backend {}, sharding {}", world_, comm_->backend(), stage_name_);
}

double Engine::global_norm(double summed_shares) const { return std::sqrt(summed_shares); }

void Engine::sum_over_ranks(torch::Tensor& t, const std::string& what) {
  if (world_ > 1) comm_->all_reduce_sum(t, what).wait();
}

void Engine::check_reduction(const std::string& what) {
  if (world_ > 1) comm_->check(what);
}

nlohmann::json Engine::layout() const {
  return {{"largest_group_bytes", largest_unit_bytes()},
          {"groups", groups()},
          {"groups_launched_during_backward", launched_from_hooks()}};
}

// ---- step, memory, saves ----

void Engine::optimizer_step(torch::optim::AdamW& opt) {
  host_.grads_to_host(groups_);
  {
    const auto scope = host_.optimizer_scope();  // the moments AdamW makes on its first step belong to the host
    optim::adamw_step(opt);
  }
  after_step();
}

// This rank's slot of flat_param holding its master shard in the compute dtype (the all-gather's input).
// A master the slot is not (a low-precision copy; masters on the host) is copied into the slot.
torch::Tensor Engine::compute_shard(Group& g) {
  // zero1/2: the slot itself; zero3: its own fp32 buffer
  if (!low_precision_copy() && !host_.masters_on_host()) return g.shard_param;
  auto slot = g.slot();
  host_.master_to_slot(slot, g.shard_param);
  return slot;
}

void Engine::all_gather_params() {
  torch::NoGradGuard no_grad;
  std::vector<Pending> works;
  for (auto& g : groups_)  // in place: the input is this rank's slot of the output (as FSDP does)
    works.push_back(comm_->all_gather(g->flat_param, compute_shard(*g), "parameter all-gather of " + g->name));
  for (auto& w : works) w.wait();
}

StateBytes Engine::state_bytes() const {
  StateBytes s;
  s.optimizer_on_host = host_.masters_on_host();
  for (const auto& g : groups_) {
    count_group(s, *g);
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

std::vector<Span> Engine::shard_spans() const {
  std::vector<Span> out;
  for (const auto& gp : groups_) {
    const auto& g = *gp;
    const auto [lo, hi] = owned_range(g);
    for (size_t i = 0; i < g.params.size(); ++i) {
      const int64_t a = std::max(lo, g.offsets[i]), b = std::min(hi, g.offsets[i] + g.params[i].numel());
      if (a < b)
        out.push_back(
            {g.names[i], a - g.offsets[i], b - g.offsets[i], g.shard_param.detach().narrow(0, a - lo, b - a)});
    }
  }
  return out;
}

std::vector<Span> Engine::param_spans() const {
  std::vector<Span> out;
  for (const auto& gp : groups_)
    for (size_t i = 0; i < gp->params.size(); ++i)
      out.push_back({gp->names[i], 0, gp->params[i].numel(), gp->params[i].detach().view({-1})});
  return out;
}

void Engine::gather_unit(int64_t unit) {
  torch::NoGradGuard no_grad;
  if (!low_precision_copy()) return gather_params(unit);
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) gather_master(*groups_[gi]);
}

void Engine::release_unit(int64_t unit) {
  if (!low_precision_copy()) return release_params(unit);
  for (size_t gi : unit_groups_[static_cast<size_t>(unit)]) {
    auto& g = *groups_[gi];
    if (g.master_full.defined()) add_transient(-g.bytes());
    g.master_full.reset();
  }
}

torch::Tensor Engine::param_values(const std::string& name) const {
  const auto found = where_.find(name);
  if (found == where_.end()) return model_->named_parameters()[name].detach().view({-1});  // frozen: whole here
  const auto [gi, i] = found->second;
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
  const auto shard = host_.master_for_collective(g.shard_param, device_);
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

}  // namespace sl::parallel
