// Checkpoint engine: forward-state capture (RNG, autocast), the segment Function and the
// recompute-then-linear Function.
#include "recompute/checkpoint.h"

#include <chrono>
#include <cmath>
#include <optional>

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include "device/alloc_tag.h"
#include "device/host.h"
#include "errors.h"
#include "log/clock.h"
#include "model/linear.h"
#include "model/sequence.h"

namespace sl::recompute {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether the current stream of CUDA device `d` is being captured into a CUDA graph (train/cuda_graph.h).
bool capturing(c10::Device d) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(d.index()), &status));
  return status != cudaStreamCaptureStatusNone;
}

// RNG, autocast and host-placement state at the moment a piece ran forward. Thread-local settings all:
// on CUDA the backward, and with it the recompute, runs on autograd's device thread, which has none of
// the forward thread's (a fresh thread's defaults: autocast off with its cache on, no HostScope), so
// the recompute re-applies each of them (as torch.utils.checkpoint re-applies its autocast kwargs).
struct ForwardState {
  bool rng = false;
  at::Tensor cpu_rng, cuda_rng;
  c10::DeviceIndex cuda_device = -1;
  bool autocast_cpu = false, autocast_cuda = false;
  at::ScalarType autocast_cpu_dtype = at::kBFloat16, autocast_cuda_dtype = at::kHalf;
  // zero3 runs with autocast's weight-cast cache off (train/setup.cpp): a recompute that cached the
  // casts would keep a unit's low-precision weights alive past the unit's release.
  bool autocast_cache = true;
  bool host_scope = false;  // device::HostScope::active(): the piece's host allocations count in the host pool

  static ForwardState capture(bool preserve_rng, const std::vector<at::Tensor>& inputs) {
    ForwardState s;
    s.autocast_cache = at::autocast::is_autocast_cache_enabled();
    s.host_scope = device::HostScope::active();
    s.autocast_cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.autocast_cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.autocast_cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.autocast_cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    s.rng = preserve_rng;
    if (!preserve_rng) return s;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu_rng = gen.get_state();
    }
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) {
        // Under a CUDA graph's capture (train.cuda_graphs) the generator's state cannot be read; graphs are
        // captured only without dropout (train/cuda_graph.h), so no recompute there draws a random number.
        if (capturing(t.device())) break;
        s.cuda_device = t.device().index();
        auto gen = at::cuda::detail::getDefaultCUDAGenerator(s.cuda_device);
        std::lock_guard<std::mutex> lock(gen.mutex());
        s.cuda_rng = gen.get_state();
        break;
      }
    return s;
  }
};

// While alive: grad mode on, the forward's autocast state (cache setting included) and host scope
// applied, the forward's RNG state set. Restores the caller's RNG and autocast state on destruction.
class Replay {
 public:
  explicit Replay(const ForwardState& s) : grad_(true), host_(s.host_scope) {
    prev_autocast_cache_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(s.autocast_cache);
    prev_autocast_cpu_ = at::autocast::is_autocast_enabled(at::kCPU);
    prev_autocast_cuda_ = at::autocast::is_autocast_enabled(at::kCUDA);
    prev_cpu_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    prev_cuda_dtype_ = at::autocast::get_autocast_dtype(at::kCUDA);
    at::autocast::set_autocast_enabled(at::kCPU, s.autocast_cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, s.autocast_cuda);
    at::autocast::set_autocast_dtype(at::kCPU, s.autocast_cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, s.autocast_cuda_dtype);
    if (s.autocast_cpu || s.autocast_cuda) {
      at::autocast::increment_nesting();
      nested_ = true;
    }
    if (!s.rng) return;
    swap_rng(s.cpu_rng, s.cuda_rng, s.cuda_device, /*save=*/true);
    cuda_device_ = s.cuda_device;
    rng_ = true;
  }
  ~Replay() {
    if (rng_) swap_rng(prev_cpu_rng_, prev_cuda_rng_, cuda_device_, /*save=*/false);
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, prev_autocast_cpu_);
    at::autocast::set_autocast_enabled(at::kCUDA, prev_autocast_cuda_);
    at::autocast::set_autocast_dtype(at::kCPU, prev_cpu_dtype_);
    at::autocast::set_autocast_dtype(at::kCUDA, prev_cuda_dtype_);
    at::autocast::set_autocast_cache_enabled(prev_autocast_cache_);
  }
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

 private:
  // Sets the generators to the given states; with save, first keeps the current ones to restore.
  void swap_rng(const at::Tensor& cpu, const at::Tensor& cuda, c10::DeviceIndex dev, bool save) {
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      if (save) prev_cpu_rng_ = gen.get_state();
      gen.set_state(cpu);
    }
    if (dev >= 0 && cuda.defined()) {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(dev);
      std::lock_guard<std::mutex> lock(gen.mutex());
      if (save) prev_cuda_rng_ = gen.get_state();
      gen.set_state(cuda);
    }
  }
  torch::AutoGradMode grad_;
  device::HostScope host_;
  bool prev_autocast_cache_ = true;
  bool rng_ = false, nested_ = false;
  at::Tensor prev_cpu_rng_, prev_cuda_rng_;
  c10::DeviceIndex cuda_device_ = -1;
  bool prev_autocast_cpu_ = false, prev_autocast_cuda_ = false;
  at::ScalarType prev_cpu_dtype_ = at::kBFloat16, prev_cuda_dtype_ = at::kHalf;
};

// What a piece's forward leaves for its backward besides the saved input tensors. Held in an
// IValue capsule in ctx->saved_data, so it is freed with the graph node: after backward, or when
// the graph is dropped without one.
struct Saved : torch::CustomClassHolder {
  std::string name;
  SegmentFn fn;          // checkpoint(): the segment
  CheapFn cheap;         // recompute_then_linear(): the cheap op
  Options opts;
  ForwardState state;
  size_t n_inputs = 0;
  std::vector<at::Tensor> params;  // the module's own parameters the piece uses (handles, not copies)
  size_t n_linear = 0;             // recompute_then_linear(): 1 (W) or 2 (W, b) after the cheap op's params
  model::LoraAdapter lora;         // recompute_then_linear(): the projection's adapter, its params last
  struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    double checksum;
  };
  std::vector<Meta> out_meta;  // only with check_recompute
  std::shared_ptr<ActivationOffload::Slot> offloaded;  // offload.activations: the inputs on the host
  // checkpointing.exchange keep: what the first pass's exchanges received, for the recompute (null: redo).
  std::unique_ptr<model::ExchangeMemo> exchanges;
  // The scope a pass of the piece runs in: recording its exchanges (first pass) or taking them back
  // (recompute) when it keeps them, else exchanging (also inside a piece that keeps: nothing nests).
  model::ExchangeMemoScope exchange_scope(bool recompute) {
    if (opts.keep_exchange && !exchanges) exchanges = std::make_unique<model::ExchangeMemo>();
    return model::ExchangeMemoScope(opts.keep_exchange ? exchanges.get() : nullptr, recompute);
  }
};

using SavedPtr = c10::intrusive_ptr<Saved>;

// Index conventions in the Functions below: graph inputs are [state, tensors...]. backward returns
// one slot per forward argument (slot 0, the state, stays undefined), while needs_input_grad()
// counts tensor inputs only: tensor i is slot 1 + i and needs_input_grad(i).

SavedPtr take_saved(AutogradContext* ctx) {
  auto saved = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data.at("state").toCapsule());
  ctx->saved_data.erase("state");
  return saved;
}

// checkpointing.check_recompute (a debugging option) reads each checksum to the host: a device
// synchronization per piece in forward and again in its recompute. Off, nothing here reads.
Saved::Meta meta_of(const at::Tensor& t) {
  return {t.sizes().vec(), t.scalar_type(), t.is_floating_point() ? t.to(at::kDouble).sum().item<double>() : 0.0};
}

void check_outputs(const Saved& s, const std::vector<at::Tensor>& outs) {
  if (!s.opts.check_recompute) return;
  auto fail = [&](const std::string& what) {
    throw Error(kExitInternal,
                fmt::format("recompute check failed in {}: {} (is the piece non-deterministic, or does it "
                            "use randomness with checkpointing.preserve_rng: false?)",
                            s.name, what));
  };
  if (outs.size() != s.out_meta.size())
    fail(fmt::format("{} outputs in recompute, {} in forward", outs.size(), s.out_meta.size()));
  for (size_t i = 0; i < outs.size(); ++i) {
    auto m = meta_of(outs[i].detach());
    const auto& f = s.out_meta[i];
    if (m.sizes != f.sizes)
      fail(fmt::format("output {} has shape {} in recompute, {} in forward", i, fmt::join(m.sizes, "x"),
                       fmt::join(f.sizes, "x")));
    if (m.dtype != f.dtype)
      fail(fmt::format("output {} has dtype {} in recompute, {} in forward", i, c10::toString(m.dtype),
                       c10::toString(f.dtype)));
    if (std::abs(m.checksum - f.checksum) > 1e-6 * (1.0 + std::abs(f.checksum)))
      fail(fmt::format("output {} values differ (sum {} in recompute, {} in forward)", i, m.checksum, f.checksum));
  }
}

// Forward's bookkeeping, common to both Functions: the inputs as saved variables (autograd checks
// they were not modified in place), the parameters as handles, the capsule on the node.
// With offload.activations the inputs go to the host instead (ActivationOffload), outside autograd's
// saved variables, which would keep them on the device.
void keep_for_backward(AutogradContext* ctx, const SavedPtr& saved, const std::vector<at::Tensor>& inputs) {
  saved->n_inputs = inputs.size();
  const auto& off = saved->opts.offload;
  if (off) {
    saved->offloaded = off->offload(inputs, *saved->opts.stats);
    std::vector<at::Tensor> kept;
    for (const auto& t : inputs) kept.push_back(t.requires_grad() ? at::Tensor() : t);
    ctx->save_for_backward(kept);
  } else {
    ctx->save_for_backward(inputs);
  }
  ctx->saved_data["state"] = at::IValue::make_capsule(saved);
  ctx->set_materialize_grads(false);
}

// The saved inputs, detached, requiring grad where this backward needs their gradient.
std::vector<at::Tensor> restore_inputs(AutogradContext* ctx, const Saved& s) {
  auto saved = ctx->get_saved_variables();
  const auto restored = s.offloaded ? s.opts.offload->restore(*s.offloaded, *s.opts.stats) : std::vector<at::Tensor>();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < s.n_inputs; ++i) {
    auto t = (restored.empty() || !restored[i].defined() ? saved[i] : restored[i]).detach();
    t.requires_grad_(ctx->needs_input_grad(i));
    out.push_back(t);
  }
  return out;
}

// What to differentiate: the inputs that need a gradient, then those of the first n_params
// parameters that do, each with its slot in backward's result.
struct Targets {
  std::vector<at::Tensor> wrt;
  std::vector<size_t> slot;
};
Targets targets(AutogradContext* ctx, const Saved& s, const std::vector<at::Tensor>& inputs, size_t n_params) {
  Targets t;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].requires_grad()) t.wrt.push_back(inputs[i]), t.slot.push_back(1 + i);
  for (size_t j = 0; j < n_params; ++j)
    if (ctx->needs_input_grad(s.n_inputs + j)) t.wrt.push_back(s.params[j]), t.slot.push_back(1 + s.n_inputs + j);
  return t;
}

// The CUDA device of the first CUDA tensor among `ts`, if any.
std::optional<c10::Device> cuda_device(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (t.defined() && t.is_cuda()) return t.device();
  return std::nullopt;
}

// An event (with timing) recorded now on `device`'s current stream.
std::shared_ptr<c10::Event> record_event(c10::Device device) {
  auto e = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  e->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  return e;
}

// Times the recompute. CPU: wall clock. CUDA: events around it on the current stream, read once per
// step after the step's host read (settle_device_times), so timing waits for nothing; the old
// device-wide synchronize before and after every recompute stalled the host twice per piece.
template <class F>
auto timed(const Saved& s, std::optional<c10::Device> cuda, F&& f) {
  if (s.opts.pre_recompute_hook) s.opts.pre_recompute_hook(s.name);
  s.opts.stats->recomputes += 1;
  // The recompute's transients, of the unit whose backward runs it (a segment's blocks label their own).
  device::LabelScope label(device::Label::recompute, device::current_phase().unit);
  // Under a CUDA graph's capture the recompute is not timed: events recorded into a graph are not
  // recorded by its replays, so there is no span to read (recompute_ms counts eager micro-batches only).
  if (cuda && capturing(*cuda)) return f();
  if (cuda) {
    auto start = record_event(*cuda);
    auto out = f();
    s.opts.stats->device_spans.push_back({std::move(start), record_event(*cuda)});
    return out;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto out = f();
  s.opts.stats->recompute_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// A linear's backward from its input `a`, with the same kernels as the linear's own node (autograd's
// for addmm(b, a2d, W^T) / mm(a2d, W^T), or the widened linear's: model/linear.h): dW = gy^T a and
// db = sum_rows(gy) (each only when asked for), da = gy W.
struct LinearGrads {
  at::Tensor gy2, dW, db;  // gy2: gy as rows (N columns)
  at::Tensor da(const at::Tensor& W, at::IntArrayRef a_sizes, at::ScalarType a_dtype) const {
    return model::mm(gy2, W).view(a_sizes).to(a_dtype);
  }
};
LinearGrads linear_param_grads(const at::Tensor& gy, const at::Tensor& a, const at::Tensor& W, const at::Tensor& b,
                               bool want_dW, bool want_db) {
  const int64_t N = W.size(0), K = W.size(1);
  LinearGrads g{gy.reshape({-1, N}), {}, {}};
  if (want_dW) g.dW = model::linear_weight_grad(g.gy2, a.detach().reshape({-1, K})).to(W.scalar_type());
  if (want_db) g.db = g.gy2.sum(0).to(b.scalar_type());
  return g;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, SavedPtr saved, at::TensorList inputs, at::TensorList params) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    saved->state = ForwardState::capture(saved->opts.preserve_rng, in);
    std::vector<at::Tensor> outs;
    {
      const auto exchanges = saved->exchange_scope(/*recompute=*/false);
      outs = saved->fn(in);
    }
    if (saved->opts.check_recompute)
      for (const auto& o : outs) saved->out_meta.push_back(meta_of(o));
    saved->params.assign(params.begin(), params.end());
    keep_for_backward(ctx, saved, in);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = take_saved(ctx);
    const size_t n_in = saved->n_inputs, n_params = saved->params.size();
    auto inputs = restore_inputs(ctx, *saved);
    std::vector<at::Tensor> outs;
    {
      Replay replay(saved->state);
      const auto exchanges = saved->exchange_scope(/*recompute=*/true);
      outs = timed(*saved, cuda_device(inputs), [&] { return saved->fn(inputs); });
    }
    check_outputs(*saved, outs);

    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outs.size() && i < grad_outputs.size(); ++i)
      if (grad_outputs[i].defined() && outs[i].requires_grad())
        roots.push_back(outs[i]), root_grads.push_back(grad_outputs[i]);
    const auto [wrt, slot] = targets(ctx, *saved, inputs, n_params);

    variable_list result(1 + n_in + n_params);
    if (!roots.empty() && !wrt.empty()) {
      auto grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                         /*allow_unused=*/true);
      for (size_t i = 0; i < grads.size(); ++i) result[slot[i]] = grads[i];
    }
    return result;
  }
};

// The adapter's part of a selective piece's backward (`delta`: its output recomputed from the leaf `a`,
// with a graph): the gradient of `a` (undefined when `a` needs none) and of each adapter parameter that
// needs one, put in `result` at their slots (`first_slot`: the first adapter parameter's).
at::Tensor adapter_backward(AutogradContext* ctx, const at::Tensor& delta, const at::Tensor& a, const at::Tensor& gy,
                            const std::vector<at::Tensor>& lora_params, size_t first_slot, variable_list& result) {
  if (!delta.defined() || !delta.requires_grad()) return {};
  torch::autograd::edge_list outputs;
  std::vector<size_t> slots;
  if (a.requires_grad()) outputs.push_back(torch::autograd::impl::gradient_edge(a)), slots.push_back(0);
  for (size_t j = 0; j < lora_params.size(); ++j)
    if (ctx->needs_input_grad(first_slot - 1 + j))
      outputs.push_back(torch::autograd::impl::gradient_edge(lora_params[j])), slots.push_back(first_slot + j);
  if (outputs.empty()) return {};
  auto grads = torch::autograd::Engine::get_default_engine().execute(
      {torch::autograd::impl::gradient_edge(delta)}, {gy}, /*keep_graph=*/false, /*create_graph=*/false,
      /*accumulate_grad=*/false, outputs);
  at::Tensor da;
  for (size_t i = 0; i < grads.size(); ++i) (slots[i] == 0 ? da : result[slots[i]]) = grads[i];
  return da;
}

// linear(cheap(inputs), W, b) + lora.delta. Graph inputs: [state, inputs..., cheap_params..., W, b?, lora...].
struct RecomputeLinearFunction : torch::autograd::Function<RecomputeLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, SavedPtr saved, at::TensorList inputs, at::TensorList cheap_params,
                            at::TensorList linear_params, at::TensorList lora_params) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    saved->state = ForwardState::capture(saved->opts.preserve_rng, in);
    at::Tensor a;
    {
      const auto exchanges = saved->exchange_scope(/*recompute=*/false);
      a = saved->cheap(in);
    }
    if (saved->opts.check_recompute) saved->out_meta.push_back(meta_of(a));
    const auto& W = linear_params[0];
    auto y = saved->lora.linear(a, W, linear_params.size() > 1 ? linear_params[1] : at::Tensor());
    saved->params.assign(cheap_params.begin(), cheap_params.end());
    saved->params.insert(saved->params.end(), linear_params.begin(), linear_params.end());
    saved->n_linear = linear_params.size();
    saved->params.insert(saved->params.end(), lora_params.begin(), lora_params.end());
    keep_for_backward(ctx, saved, in);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = take_saved(ctx);
    const size_t n_in = saved->n_inputs, n_params = saved->params.size();
    const bool has_bias = saved->n_linear == 2;
    const auto lora_params = saved->lora.params();
    const size_t n_cheap = n_params - saved->n_linear - lora_params.size();
    const at::Tensor& W = saved->params[n_cheap];
    variable_list result(1 + n_in + n_params);
    const auto& gy = grad_outputs[0];
    if (!gy.defined()) return result;

    auto inputs = restore_inputs(ctx, *saved);
    at::Tensor a, a_leaf, delta;
    {
      Replay replay(saved->state);
      const auto exchanges = saved->exchange_scope(/*recompute=*/true);
      a = timed(*saved, cuda_device(inputs), [&] {
        auto out = saved->cheap(inputs);
        if (!saved->lora.empty()) {  // the adapter after the cheap op, as in forward (its dropout draws next)
          a_leaf = out.detach().requires_grad_(out.requires_grad());
          delta = saved->lora.delta(a_leaf);
        }
        return out;
      });
    }
    check_outputs(*saved, {a});

    const size_t w_at = n_in + n_cheap;  // W's input index (its slot is 1 + w_at), then b's
    const auto lin = linear_param_grads(gy, a, W, has_bias ? saved->params[n_cheap + 1] : at::Tensor(),
                                        ctx->needs_input_grad(w_at), has_bias && ctx->needs_input_grad(w_at + 1));
    result[1 + w_at] = lin.dW;
    if (has_bias) result[1 + w_at + 1] = lin.db;
    auto da_lora = adapter_backward(ctx, delta, a_leaf, gy, lora_params, 1 + w_at + saved->n_linear, result);
    delta.reset(), a_leaf.reset();

    // Then the cheap op's backward. Its output's values are not needed any more, only its graph:
    // keep the graph edge and drop the tensor, so the recomputed output is freed before da and the
    // cheap op's input gradients are allocated (unless the cheap op's own backward saved it, as
    // SDPA does). Same engine call as torch::autograd::grad.
    const auto [wrt, slot] = targets(ctx, *saved, inputs, n_cheap);
    const bool differentiable = a.requires_grad() && !wrt.empty();
    const auto root = differentiable ? torch::autograd::impl::gradient_edge(a) : torch::autograd::Edge();
    const auto a_sizes = a.sizes().vec();
    const auto a_dtype = a.scalar_type();
    a.reset();
    if (differentiable) {
      auto da = lin.da(W, a_sizes, a_dtype);
      if (da_lora.defined()) da.add_(da_lora), da_lora.reset();  // the input's two consumers' sum (either order)
      torch::autograd::edge_list outputs;
      for (const auto& w : wrt) outputs.push_back(torch::autograd::impl::gradient_edge(w));
      auto grads = torch::autograd::Engine::get_default_engine().execute(
          {root}, {da}, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
      for (size_t i = 0; i < grads.size(); ++i) result[slot[i]] = grads[i];
    }
    return result;
  }
};

// linear(a, W, b) whose output's values nobody reads. Graph inputs: [a, W, b?]; a is saved (as the
// linear's own backward would save it), the output is a placeholder of the right shape.
struct OutputFreeLinearFunction : torch::autograd::Function<OutputFreeLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& W, at::TensorList b) {
    ctx->save_for_backward({a, W});
    ctx->saved_data["bias"] = b.empty() ? at::IValue() : at::IValue(b[0]);
    ctx->set_materialize_grads(false);
    auto shape = a.sizes().vec();
    shape.back() = W.size(0);
    const auto dtype = at::autocast::is_autocast_enabled(a.device().type())
                           ? at::autocast::get_autocast_dtype(a.device().type()) : a.scalar_type();
    // The placeholder meets what the forward's output met (the residual dropout), which must draw the
    // forward's mask. The CPU draws a mask element by element whatever the layout: one broadcast zero
    // costs no memory. CUDA's dropout takes its vectorized kernel only on a contiguous input, and the
    // two kernels consume the Philox stream differently: there the placeholder is a contiguous (unread,
    // uninitialized) tensor, as the forward's output was, and the replayed masks are the forward's.
    const auto opts = a.options().dtype(dtype);
    if (a.device().is_cpu()) return at::zeros({1}, opts).expand(shape);
    return at::empty(shape, opts);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& a = saved[0];
    const auto& W = saved[1];
    const auto bias = ctx->saved_data["bias"];
    const at::Tensor b = bias.isTensor() ? bias.toTensor() : at::Tensor();
    variable_list result(b.defined() ? 3 : 2);  // a, W, b?
    const auto& gy = grad_outputs[0];
    if (!gy.defined()) return result;
    const auto lin = linear_param_grads(gy, a, W, b, ctx->needs_input_grad(1), b.defined() && ctx->needs_input_grad(2));
    result[1] = lin.dW;
    if (b.defined()) result[2] = lin.db;
    if (ctx->needs_input_grad(0)) result[0] = lin.da(W, a.sizes(), a.scalar_type());
    return result;
  }
};

std::vector<at::Tensor> defined_only(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts)
    if (t.defined()) out.push_back(t);
  return out;
}

}  // namespace

// ---- offload.activations ----

struct ActivationOffload::Slot {
  std::vector<at::Tensor> host;      // per input: its host copy (undefined: kept on the device)
  std::vector<at::Tensor> restored;  // per input: back on the device (filled by restore or a prefetch)
  device::Arrival prefetched;        // a prefetch's copies back (device/host.h): restore waits on it
  c10::Device device{c10::kCPU};
  size_t index = 0;                  // in the forward's chain
};

namespace {

// The slot's inputs back on the device. A prefetch leaves the current stream's wait to restore (on
// CUDA its copies run on the side stream beside the backward queued meanwhile); the copies are in
// one stream's order, so the last one's Arrival covers them all.
void bring_back(ActivationOffload::Slot& slot, Stats& stats, bool prefetch) {
  if (!slot.restored.empty()) return;
  for (const auto& h : slot.host) {
    if (!h.defined()) {
      slot.restored.emplace_back();
      continue;
    }
    stats.offload_to_device += static_cast<int64_t>(h.nbytes());
    device::LabelScope label(device::Label::offload, device::current_phase().unit);
    slot.restored.push_back(device::to_device_copy(h, slot.device, prefetch ? &slot.prefetched : nullptr));
  }
}
}  // namespace

void ActivationOffload::begin_forward() { chain_.clear(); }

std::shared_ptr<ActivationOffload::Slot> ActivationOffload::offload(const std::vector<at::Tensor>& inputs,
                                                                    Stats& stats) {
  auto slot = std::make_shared<Slot>();
  for (const auto& t : inputs) {
    if (!t.requires_grad()) {
      slot->host.emplace_back();
      continue;
    }
    slot->device = t.device();
    stats.offload_to_host += static_cast<int64_t>(t.nbytes());
    device::LabelScope label(device::Label::offload, device::current_tag().unit);
    // On CUDA the copy runs on the side stream beside the forward queued next: the host copy is read
    // only by the copy back, on that stream after it (device/host.h), so nothing waits for it here.
    device::Arrival sent;
    slot->host.push_back(device::to_host(t.detach(), &sent));
  }
  slot->index = chain_.size();
  chain_.push_back(slot);
  return slot;
}

std::vector<at::Tensor> ActivationOffload::restore(Slot& slot, Stats& stats) {
  bring_back(slot, stats, /*prefetch=*/false);
  slot.prefetched.wait();  // this slot's prefetch, when there was one: before the first use
  slot.prefetched = device::Arrival();
  if (slot.index > 0 && slot.index <= chain_.size())
    // its backward comes next
    if (auto prev = chain_[slot.index - 1].lock()) bring_back(*prev, stats, /*prefetch=*/true);
  std::vector<at::Tensor> out = std::move(slot.restored);
  slot.restored.clear();
  slot.host.clear();  // the host copy is not needed again: backward runs once
  return out;
}

void settle_device_times(Stats& stats) {
  for (const auto& span : stats.device_spans) {
    if (!span.end->query()) span.end->synchronize();  // only when called before the step's host read
    stats.recompute_ms += span.start->elapsedTime(*span.end);
  }
  stats.device_spans.clear();
}

std::vector<at::Tensor> checkpoint(const std::string& name, const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params, const Options& opts) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);  // eval: nothing to save, nothing to recompute
  auto saved = c10::make_intrusive<Saved>();
  saved->name = name;
  saved->fn = fn;
  saved->opts = opts;
  return CheckpointFunction::apply(saved, at::TensorList(inputs), at::TensorList(defined_only(params)));
}

at::Tensor recompute_then_linear(const std::string& name, const CheapFn& cheap, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& cheap_params, const at::Tensor& W, const at::Tensor& b,
                                 const model::LoraAdapter& lora, const Options& opts) {
  if (!torch::GradMode::is_enabled()) {
    return lora.linear(cheap(inputs), W, b);
  }
  auto saved = c10::make_intrusive<Saved>();
  saved->name = name;
  saved->cheap = cheap;
  saved->opts = opts;
  saved->lora = lora;
  std::vector<at::Tensor> linear_params = {W};
  if (b.defined()) linear_params.push_back(b);
  return RecomputeLinearFunction::apply(saved, at::TensorList(inputs), at::TensorList(defined_only(cheap_params)),
                                        at::TensorList(linear_params), at::TensorList(lora.params()));
}

at::Tensor linear_without_output(const at::Tensor& a, const at::Tensor& W, const at::Tensor& b) {
  std::vector<at::Tensor> bias;
  if (b.defined()) bias.push_back(b);
  return OutputFreeLinearFunction::apply(a, W, at::TensorList(bias));
}

}  // namespace sl::recompute
