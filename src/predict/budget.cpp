// checkpointing.mode: budget: the dynamic program, its cost sources and the recipe's plan.
#include "predict/budget.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <variant>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "errors.h"
#include "log/clock.h"
#include "log/metrics.h"
#include "predict/footprint.h"
#include "memory/tracker.h"
#include "model/linear.h"
#include "precision/autocast.h"

namespace sl::budget {

using recompute::Options;
using recompute::selective_linear_after;

int64_t budget_quanta(int64_t n_layer) { return std::max<int64_t>(16384, 16 * n_layer); }

double BlockCost::parts(uint8_t set) const {
  return ((set & kPartAttention) ? attention : 0.0) + ((set & kPartMlp) ? mlp : 0.0) + ((set & kPartNorm) ? norm : 0.0);
}

double schedule_cost(const std::vector<Segment>& segments, const std::vector<uint8_t>& block_parts,
                     const std::vector<BlockCost>& costs, double offload_cost,
                     const std::vector<uint8_t>& exchange_kept) {
  double total = 0;
  for (const auto& s : segments) {
    if (s.offloaded) total += offload_cost;
    for (int64_t b = s.begin; b < s.end; ++b) {
      const auto i = static_cast<size_t>(b);
      const auto& c = costs[i];
      total += s.checkpointed ? c.forward : c.parts(block_parts[i]);
      const bool recomputed = s.checkpointed || (block_parts[i] & kPartAttention) != 0;
      if (recomputed && i < exchange_kept.size() && exchange_kept[i] != 0) total -= c.exchange;
    }
    if (s.checkpointed) total -= costs[static_cast<size_t>(s.end - 1)].output;
  }
  return total;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One DP entry's way in: from state `from` of the position `len` blocks back (0: one kept block).
struct Back {
  int32_t from = -1;
  int32_t len = 0;
  uint8_t parts = 0;
  bool offloaded = false;  // a checkpointed segment whose input goes to host memory
  bool kept_exchange = false;  // the recompute (the segment's, or the block's selective attention) keeps its exchanges
};

// The DP table over positions 0..L and memory buckets 0..Q-1 (bucket = floor(held / delta)). Each
// entry keeps its least-cost path (on a tie the one holding less) with that path's exact bytes.
struct Table {
  int64_t L, Q;
  double delta;
  std::vector<double> cost, held;
  std::vector<Back> back;
  Table(int64_t l, int64_t q, double d)
      : L(l), Q(q), delta(d), cost(static_cast<size_t>((l + 1) * q), kInf), held(cost.size(), 0.0), back(cost.size()) {}
  size_t at(int64_t i, int64_t h) const { return static_cast<size_t>(i * Q + h); }
  void relax(int64_t i, double bytes, double c, Back b) {
    const auto h = static_cast<int64_t>(std::floor(bytes / delta));
    if (h < 0 || h >= Q) return;
    const size_t k = at(i, h);
    if (c < cost[k] || (c == cost[k] && bytes < held[k])) cost[k] = c, held[k] = bytes, back[k] = b;
  }
};

// The memory bounds of the walk (memory::chain_peak) in the DP's terms. `held` is the memory a path
// keeps so far (kept blocks' weight copies included), in bytes.
// With offload allowed, `prefetch` (one segment input) is held beside every backward moment: an
// offloaded segment's backward brings the previous offloaded segment's input back early, and it stays
// through the blocks between them (conservative where nothing is offloaded, exact in the walk).
struct Bounds {
  const memory::ChainModel& m;
  double budget, all_weights = 0, prefetch = 0;
  bool kept_fits(double held_after, int64_t b, uint8_t parts) const {  // D
    return held_after + prefetch + m.tied_grad + m.backward[static_cast<size_t>(b)][parts] <= budget;
  }
  bool first_pass_fits(double held_in, double forward) const {  // F: a segment's first pass, its widest block
    return all_weights + held_in + forward <= budget;
  }
  bool recompute_fits(double held_in, double need) const {  // B: `need`, the segment's recompute and backward
    return prefetch + m.tied_grad + held_in + need <= budget;
  }
  bool end_fits(double held) const {  // F at the end of the forward, and A
    return all_weights + held + m.head_forward <= budget && held + m.head <= budget;
  }
};

// What a recompute may do about a block's exchanges (checkpointing.exchange): redo them, keep them.
// Nothing to keep without sequence parallelism (every Kx 0): redo only.
struct ExchangeChoice {
  bool redo = true, keep = false;
};
ExchangeChoice exchange_choice(const memory::ChainModel& m, config::Exchange exchange) {
  const bool any = std::any_of(m.exchange_kept.begin(), m.exchange_kept.end(), [](double kx) { return kx > 0; });
  if (!any) return {};
  return {!exchange.keeps(), exchange.keeps() || exchange.chosen()};
}

double at_or_zero(const std::vector<double>& v, size_t i) { return i < v.size() ? v[i] : 0.0; }

// Block i kept, with each set of selective parts; where its attention is recomputed, its exchanges
// redone or kept (Kx held through its backward, its exchange's cost saved).
void expand_kept(Table& t, int64_t i, int32_t from, double c, double held, const memory::ChainModel& m,
                 const std::vector<BlockCost>& costs, const Bounds& fit, ExchangeChoice ex) {
  const auto bi = static_cast<size_t>(i);
  for (int s = 0; s < kPartSets; ++s) {
    const auto parts = static_cast<uint8_t>(s);
    const bool attention = (parts & kPartAttention) != 0;
    for (const bool keep : {false, true}) {
      if (keep ? !(attention && ex.keep) : (attention && !ex.redo)) continue;
      const double after = held + m.kept[bi][parts] + m.weights[bi] + (keep ? at_or_zero(m.exchange_kept, bi) : 0.0);
      if (!fit.kept_fits(after, i, parts)) continue;
      t.relax(i + 1, after, c + costs[bi].parts(parts) - (keep ? costs[bi].exchange : 0.0),
              {from, 0, parts, false, keep});
    }
  }
}

// A checkpointed segment [i, j) for every j that fits, its input kept on the device or (offload_cost >=
// 0) in host memory, which holds nothing for backward at the price of the transfers; its exchanges
// redone in the recompute (Rx beside the blocks before) or kept (the blocks' Kx held after the first
// pass, each block's first pass beside the Kx before it; the recompute makes no exchange buffers).
void expand_segments(Table& t, int64_t i, int32_t from, double c, double held, const memory::ChainModel& m,
                     const std::vector<BlockCost>& costs, const Bounds& fit, double offload_cost, ExchangeChoice ex) {
  const double held_in = held + m.input;
  double saved = 0, weights = 0, forward = 0, worst_backward = 0, worst_forward = 0, worst_exchange = 0;
  double kx = 0, exchange_cost = 0, worst_kept_forward = 0;  // keep: the Kx so far; the first pass beside them
  bool redo = ex.redo, keep = ex.keep;
  for (int64_t j = i + 1; j <= t.L; ++j) {
    const auto b = static_cast<size_t>(j - 1);
    worst_exchange = std::max(worst_exchange, saved + at_or_zero(m.recompute_exchange, b));  // the blocks before b kept
    worst_kept_forward = std::max(worst_kept_forward, kx + m.forward[b]);
    saved += m.kept[b][0];
    weights += m.weights[b];
    forward += costs[b].forward;
    kx += at_or_zero(m.exchange_kept, b);
    exchange_cost += costs[b].exchange;
    worst_backward = std::max(worst_backward, m.backward[b][0]);
    worst_forward = std::max(worst_forward, m.forward[b]);
    // Every bound only grows with j: a choice that fails stays failed.
    redo = redo && fit.first_pass_fits(held_in, worst_forward) &&
           fit.recompute_fits(held_in, weights + std::max(saved + worst_backward, worst_exchange));
    keep = keep && fit.first_pass_fits(held_in, worst_kept_forward) &&
           fit.recompute_fits(held_in, weights + saved + worst_backward);
    if (!redo && !keep) break;
    const auto len = static_cast<int32_t>(j - i);
    const double cost = c + forward - costs[b].output;
    if (redo) t.relax(j, held_in, cost, {from, len, 0});
    if (redo && offload_cost >= 0) t.relax(j, held, cost + offload_cost, {from, len, 0, true});
    if (keep) t.relax(j, held_in + kx, cost - exchange_cost, {from, len, 0, false, true});
    if (keep && offload_cost >= 0)
      t.relax(j, held + kx, cost - exchange_cost + offload_cost, {from, len, 0, true, true});
  }
}

// From every reachable state at position i: block i kept, or a checkpointed segment from it.
void expand(Table& t, int64_t i, const memory::ChainModel& m, const std::vector<BlockCost>& costs, const Bounds& fit,
            double offload_cost, ExchangeChoice ex) {
  for (int64_t h = 0; h < t.Q; ++h) {
    const double c = t.cost[t.at(i, h)], held = t.held[t.at(i, h)];
    if (c == kInf) continue;
    const auto from = static_cast<int32_t>(h);
    expand_kept(t, i, from, c, held, m, costs, fit, ex);
    expand_segments(t, i, from, c, held, m, costs, fit, offload_cost, ex);
  }
}

void read_back(const Table& t, int64_t h, Schedule& out) {
  out.block_parts.assign(static_cast<size_t>(t.L), 0);
  out.exchange_kept.assign(static_cast<size_t>(t.L), 0);
  bool any_kept = false;
  for (int64_t i = t.L; i > 0;) {
    const Back b = t.back[t.at(i, h)];
    const int64_t begin = i - std::max<int64_t>(1, b.len);
    if (b.len == 0) {
      out.segments.push_back({begin, i, false});
      out.block_parts[static_cast<size_t>(begin)] = b.parts;
    } else {
      out.segments.push_back({begin, i, true, b.offloaded});
    }
    // a segment's blocks alike
    for (int64_t k = begin; k < i; ++k) out.exchange_kept[static_cast<size_t>(k)] = b.kept_exchange ? 1 : 0;
    any_kept = any_kept || b.kept_exchange;
    i = begin;
    h = b.from;
  }
  std::reverse(out.segments.begin(), out.segments.end());
  if (!any_kept) out.exchange_kept.clear();  // every recompute redoes (recompute::Plan's empty)
}

}  // namespace

Plan as_plan(const Schedule& s) {
  Plan p;
  p.mode = config::CheckpointingMode::kBudget;
  p.segments = s.segments;
  p.block_parts = s.block_parts;
  p.exchange_kept = s.exchange_kept;
  return p;
}

Schedule solve_budget(const memory::ChainModel& m, const std::vector<BlockCost>& costs, double budget_bytes,
                      int64_t quanta, double offload_cost, config::Exchange exchange) {
  Schedule out;
  const auto L = static_cast<int64_t>(costs.size());
  if (!(budget_bytes > 0) || L == 0 || quanta < 1) return out;
  if (quanta >= std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("solve_budget: quanta must fit in int32");
  const double delta = budget_bytes / static_cast<double>(quanta);
  out.quantum_bytes = delta;
  Table t(L, quanta + 1, delta);
  Bounds fit{m, budget_bytes - m.held};  // every moment also holds m.held
  for (double w : m.weights) fit.all_weights += w;
  if (offload_cost >= 0) fit.prefetch = m.input;
  t.cost[t.at(0, 0)] = 0;
  const ExchangeChoice ex = exchange_choice(m, exchange);
  for (int64_t i = 0; i < L; ++i) expand(t, i, m, costs, fit, offload_cost, ex);
  int64_t best = -1;
  for (int64_t h = 0; h < t.Q; ++h)  // least cost; on a tie the least memory
    if (t.cost[t.at(L, h)] < (best < 0 ? kInf : t.cost[t.at(L, best)]) && fit.end_fits(t.held[t.at(L, h)]))
      best = h;
  if (best < 0) return out;
  read_back(t, best, out);
  out.feasible = true;
  out.cost = t.cost[t.at(L, best)];
  out.peak_bytes = memory::chain_peak(m, as_plan(out));
  return out;
}

namespace {

// parallel.sequence = N > 1: the price of a block's two forward all-to-alls (redone by a recomputed
// attention), in the GFLOP a device does meanwhile. Each rank sends (N-1)/N of its q, k, v (3C) and of
// the attention output (C) per local token in the compute dtype; at parallel.all_to_all_gbps that takes
// bytes / rate seconds, worth that many seconds of the device's FLOPs (kModelledMfu of
// logging.peak_tflops, else kFormulaFlopsCpu / kFormulaFlopsCuda, as offload_cost prices transfers).
double exchange_gflop(const Scenario& sc, double tok, double C, double c) {
  if (sc.sequence <= 1) return 0.0;
  const double n = static_cast<double>(sc.sequence);
  const double bytes = (n - 1) / n * tok * 4 * C * c;
  const double device_flops = sc.peak_tflops > 0 ? sc.peak_tflops * 1e12 * kModelledMfu
                                                  : (sc.on_cuda() ? kFormulaFlopsCuda : kFormulaFlopsCpu);
  return bytes / (sc.all_to_all_gbps * 1e9) * device_flops / 1e9;
}

// formula_costs of block `layer` (blocks differ only by their MLP size).
BlockCost formula_block_cost(const Scenario& sc, int64_t layer) {
  const auto& mc = sc.model;
  const bool llama = mc.arch == config::Arch::kLlama;
  // This rank's tokens: B T / N under parallel.sequence, each attending over the whole sequence T.
  const double tok = static_cast<double>(sc.local_tokens()), T = static_cast<double>(sc.seq_len);
  const double C = static_cast<double>(mc.n_embd), H = static_cast<double>(config::Shape(mc).hidden(layer));
  const double c = static_cast<double>(sc.precision.compute.bytes()), f = 4.0;
  const double balance = sc.on_cuda() ? 300.0 : 20.0;  // FLOPs a byte of elementwise traffic costs
  const double matmul = 2 * tok * (4 * C * C + (llama ? 3 : 2) * C * H);
  BlockCost b;
  b.exchange = exchange_gflop(sc, tok, C, c);
  b.attention = 4 * tok * T * C / 1e9 + b.exchange;
  b.norm = 2 * (2 * C * f) * tok * balance / 1e9;                    // two norms: read and write C each
  b.mlp = (llama ? 3 * H : 2 * H) * c * tok * balance / 1e9;         // GELU: H in, H out; SwiGLU: 2H in, H out
  const double residual = 2 * (3 * C * f) * tok * balance / 1e9;     // two residual adds
  b.output = 2 * tok * C * H / 1e9;
  b.forward = matmul / 1e9 + b.attention + b.norm + b.mlp + residual;
  return b;
}

}  // namespace

Costs formula_costs(const Scenario& sc) {
  Costs out{{}, "formula", "GFLOP", {}};
  for (int64_t l = 0; l < sc.model.n_layer; ++l) out.blocks.push_back(formula_block_cost(sc, l));
  return out;
}

namespace {

// A block like the model's block `layer`, with its own weights (drawn from a generator of its own, so
// the run's random stream is untouched; under zero3 the model's blocks hold no whole weights).
model::Block profiling_block(const Scenario& sc, int64_t layer, torch::Device device, at::Generator& gen) {
  model::Block block(sc.model, layer, device, /*defer_params=*/true);
  torch::NoGradGuard no_grad;
  for (auto& item : block->named_parameters()) {
    auto& p = item.value();
    auto value = item.key().rfind("ln", 0) == 0 && item.key().back() == 'w'
                     ? torch::ones(p.sizes())
                     : torch::randn(p.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat32)) * sc.model.init_std;
    p.set_data(value.to(device));
  }
  return block;
}

struct PieceTimes {
  std::vector<double> forward, output, attention, mlp, norm;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds fn() takes on `device` (synchronized on CUDA), with its result.
template <class Fn> auto timed(torch::Device device, Fn&& fn) {
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  sync();
  const auto t0 = log::Clock::now();
  auto out = fn();
  sync();
  return std::pair{out, log::ms_since(t0)};
}

// One block's pieces timed: its forward six times (the first warms up), the median of each piece.
BlockCost time_block(model::Block& block, const torch::Tensor& x, const model::Rope& rope, torch::Device device) {
  PieceTimes t;
  for (int rep = 0; rep < 6; ++rep) {
    double attention = 0, mlp = 0, norm = 0, output = 0;
    const model::LinearAfter timed_parts = [&](model::Part part, const model::CheapFn& cheap,
                                               const std::vector<torch::Tensor>& in, const std::vector<torch::Tensor>&,
                                               const torch::Tensor& W, const torch::Tensor& b,
                                               const model::LoraAdapter& lora) {
      auto [a, cheap_ms] = timed(device, [&] { return cheap(in); });
      auto [y, linear_ms] = timed(device, [&] { return lora.linear(a, W, b); });
      (part == model::Part::attention_proj ? attention : part == model::Part::act_out ? mlp : norm) += cheap_ms;
      if (part == model::Part::act_out) output = linear_ms;
      return y;
    };
    timed(device, [&] { return block->forward_with(x, rope, timed_parts); });
    const double forward = timed(device, [&] { return block->forward(x, rope); }).second;  // without the parts' syncs
    if (rep == 0) continue;
    t.forward.push_back(forward), t.output.push_back(output), t.attention.push_back(attention);
    t.mlp.push_back(mlp), t.norm.push_back(norm);
  }
  return {median(t.forward), median(t.output), median(t.attention), median(t.mlp), median(t.norm)};
}

// Milliseconds of one block's two forward exchanges (model/sequence.h) at the run's shapes: the q, k, v
// (B, T/N, 3, nh, hd) to heads, the attention output (B, T, 1, nh/N, hd) back to positions, in the
// exchanged dtypes (predict/activations.h: xq, xo; LLaMA under a low-precision compute dtype exchanges
// RoPE's fp32 q, k with v, and on the CPU its fp32 attention output). Median of 5 after a warm-up; every
// rank of the group makes the same calls.
double time_exchange(const Scenario& sc, const std::shared_ptr<model::SequenceExchange>& ex, int64_t positions,
                     torch::Device device) {
  const int64_t n = ex->degree(), nh = sc.model.n_head, hd = sc.model.n_embd / nh, B = sc.micro_batch;
  const auto c = precision::compute_dtype(sc.precision.compute).value_or(torch::kFloat32);
  const bool fp32_rotary = sc.model.arch == config::Arch::kLlama && c != torch::kFloat32;
  const auto on = [&](torch::ScalarType t) { return torch::TensorOptions().dtype(t).device(device); };
  const auto qkv = torch::zeros({B, positions, 3, nh, hd}, on(fp32_rotary ? torch::kFloat32 : c));
  const auto y =
      torch::zeros({B, positions * n, 1, nh / n, hd}, on(fp32_rotary && !device.is_cuda() ? torch::kFloat32 : c));
  std::vector<double> ms;
  for (int rep = 0; rep < 6; ++rep) {  // the first warms up
    const double t = timed(device, [&] {
                       model::positions_to_heads(ex, qkv);
                       return model::heads_to_positions(ex, y);
                     }).second;
    if (rep > 0) ms.push_back(t);
  }
  return median(ms);
}

// Bytes allocated on the device now, and the most since reset() (CPU: the tracking allocator; CUDA: the
// caching allocator's stats).
struct ByteMeter {
  memory::Tracker tracker;
  torch::Device device;
  bool works() const { return tracker.source() != "untracked"; }
  void reset() { sync(), tracker.reset_peak(); }
  double now() const { return sync(), static_cast<double>(tracker.read().allocated_bytes); }
  double peak() const { return sync(), static_cast<double>(tracker.read().peak_allocated_bytes); }
  void sync() const {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  }
};

// One forward and backward of `block` with selective parts `parts`: what the forward keeps, and the
// most the backward holds beyond it. The parameters' gradients exist beforehand, as in training, so the
// backward's weight gradients are transients.
void measure_parts(model::Block& block, uint8_t parts, const torch::Tensor& x, const model::Rope& rope,
                   ByteMeter& meter, BlockBytes& out) {
  Options opts;
  auto in = x.detach().requires_grad_();
  const double before = meter.now();
  auto y =
      parts == 0 ? block->forward(in, rope) : block->forward_with(in, rope, selective_linear_after(parts, 0, opts));
  const double after = meter.now();
  out.kept[parts] = std::max(0.0, after - before);
  auto dy = torch::ones_like(y);  // the residual gradient, part of what the model's backward term holds
  meter.reset();
  y.backward(dy);
  out.backward[parts] = std::max(0.0, meter.peak() - after);
}

// A block's bytes for every set of selective parts, and without saving (a segment's first pass). Under
// autocast the block's weight copies are made first, into autocast's cache, where the run's forward
// keeps them too: what is measured excludes them, as the activation model's block terms do (it counts
// them apart, memory::ChainModel::weights).
BlockBytes measure_block(model::Block& block, const torch::Tensor& x, const model::Rope& rope, ByteMeter& meter) {
  {
    torch::NoGradGuard no_grad;
    block->forward(x, rope);  // fills autocast's cache with the weight copies
  }
  torch::AutoGradMode grad_on(true);
  for (auto& p : block->parameters()) p.mutable_grad() = torch::zeros_like(p);
  // One unmeasured backward first: on CUDA it runs on autograd's device thread, whose first matmul
  // makes that thread's cuBLAS handle and workspace (~33 MiB, held for the process's life, as in
  // training, where the model's first backward makes it). Measured, it would count as one block's bytes.
  {
    auto in = x.detach().requires_grad_();
    block->forward(in, rope).sum().backward();
  }
  BlockBytes out;
  for (uint8_t parts = 0; parts < kPartSets; ++parts) measure_parts(block, parts, x, rope, meter, out);
  {
    torch::NoGradGuard no_grad;
    const double before = meter.now();
    meter.reset();
    block->forward(x, rope);
    out.forward = std::max(0.0, meter.peak() - before);
  }
  for (auto& p : block->parameters()) p.mutable_grad() = torch::Tensor();
  return out;
}

// While alive the default generators (CPU, and the run's CUDA device) may be drawn from; their states
// go back on destruction, so what ran meanwhile leaves the run's dropout stream where it was.
class GeneratorsKept {
 public:
  explicit GeneratorsKept(torch::Device device) {
    keep(torch::Device(torch::kCPU));
    if (device.is_cuda()) keep(device);
  }
  ~GeneratorsKept() {
    for (auto& [gen, state] : kept_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  GeneratorsKept(const GeneratorsKept&) = delete;
  GeneratorsKept& operator=(const GeneratorsKept&) = delete;

 private:
  void keep(torch::Device d) {
    at::Generator gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    kept_.emplace_back(gen, gen.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> kept_;
};

}  // namespace

Costs profile_costs(const Scenario& sc, model::GPT& model, torch::Device device, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  // A rank of a sequence group (parallel.sequence) runs its blocks on its own positions, exchanging
  // with its group: every rank of it profiles at once, in the same order.
  const int64_t positions = sc.seq_len / (model->sequence ? model->sequence->degree() : 1);
  auto x = torch::randn({sc.micro_batch, positions, sc.model.n_embd}, gen,
                        torch::TensorOptions().dtype(torch::kFloat32)).to(device);
  const auto rope = model->rope(positions);
  torch::NoGradGuard no_grad;
  precision::AutocastGuard autocast(device.type(), precision::compute_dtype(sc.precision.compute));
  ByteMeter meter{memory::Tracker(device), device};
  GeneratorsKept rng(device);  // the blocks train as the run's do (dropout draws), then the stream goes back
  // Blocks differ only by their MLP size (model.layer_mlp_hidden): each size is measured once, on the
  // first block that has it, and stands for every block of that size.
  std::map<int64_t, std::pair<BlockCost, BlockBytes>> by_width;
  Costs out{{}, "profile", "ms", {}};
  // The exchanges, the same for every block: timed apart for what keeping them saves (BlockCost::exchange);
  // the profiled block exchanges through the run's group as the model's do, so its attention and forward
  // include them (and its attention covers the whole sequence for n_head / N heads).
  const double exchange = model->sequence ? time_exchange(sc, model->sequence, positions, device) : 0.0;
  const config::Shape shape(sc.model);
  for (int64_t l = 0; l < sc.model.n_layer; ++l) {
    const int64_t width = shape.hidden(l);
    if (!by_width.count(width)) {
      auto block = profiling_block(sc, l, device, gen);
      block->sequence = model->sequence;
      block->train();  // as the run trains it: dropout's masks, and on the CPU SDPA's math path with them
      BlockCost time = time_block(block, x, rope, device);
      time.exchange = exchange;
      by_width[width] = {time, meter.works() ? measure_block(block, x, rope, meter) : BlockBytes{}};
    }
    out.blocks.push_back(by_width[width].first);
    if (meter.works()) out.bytes.push_back(by_width[width].second);
  }
  return out;
}

double offload_cost(const Scenario& sc, const Costs& costs, double input_bytes) {
  const auto& o = sc.placement.offload;
  const double exposed_s = 2.0 * input_bytes / (o.bandwidth_gbps * 1e9) * (1.0 - o.overlap);
  if (costs.unit == "ms") return 1e3 * exposed_s;
  const double rate = sc.peak_tflops > 0 ? sc.peak_tflops * 1e12 * kModelledMfu
                      : sc.on_cuda()  ? kFormulaFlopsCuda
                                                   : kFormulaFlopsCpu;
  return exposed_s * rate / 1e9;  // GFLOP the device could have run meanwhile
}

memory::ChainModel solver_model(const Scenario& sc, const Costs& costs) {
  auto mem = memory::chain_model(sc, memory::lowp_matmul_path(sc));
  for (size_t i = 0; i < costs.bytes.size() && i < mem.kept.size(); ++i) {
    mem.kept[i] = costs.bytes[i].kept;
    mem.backward[i] = costs.bytes[i].backward;
    mem.forward[i] = costs.bytes[i].forward;
  }
  return mem;
}

std::optional<Plan> try_budget_plan(const Scenario& sc, const Costs& costs) {
  const auto t0 = log::Clock::now();
  const int64_t budget = memory::activation_budget_bytes(sc);
  const auto mem = solver_model(sc, costs);
  const double offload = sc.placement.offload.activations ? offload_cost(sc, costs, mem.input) : -1.0;
  const Schedule s = solve_budget(mem, costs.blocks, static_cast<double>(budget), budget_quanta(sc.model.n_layer),
                                  offload, sc.checkpointing.exchange);
  if (!s.feasible) return std::nullopt;
  Plan p = as_plan(s);
  p.budget = {budget, static_cast<int64_t>(std::ceil(s.quantum_bytes)), static_cast<int64_t>(s.peak_bytes), s.cost, 0.0,
              costs.source, costs.unit, log::ms_since(t0)};
  for (const auto& c : costs.blocks) p.budget.forward_cost += c.forward;
  p.budget.bytes_source = costs.bytes.empty() ? "formula" : "profile";
  return p;
}

std::optional<Plan> formula_plan(const Scenario& sc) { return try_budget_plan(sc, formula_costs(sc)); }

namespace {

// The least activation budget any schedule fits (bisection on the solver's feasibility, 1 % steps), on
// the bytes the solver refused with (the profile's where it measured them, else the formula's).
int64_t least_budget(const Scenario& sc, const Costs& costs) {
  const auto mem = solver_model(sc, costs);
  double lo = 0, hi = 1;
  const int64_t quanta = budget_quanta(static_cast<int64_t>(costs.blocks.size())) / 4;
  const auto exchange = sc.checkpointing.exchange;
  while (!solve_budget(mem, costs.blocks, hi, quanta, -1.0, exchange).feasible && hi < 1e18) hi *= 2;
  while (hi - lo > 0.01 * hi) {
    const double mid = (lo + hi) / 2;
    (solve_budget(mem, costs.blocks, mid, quanta, -1.0, exchange).feasible ? hi : lo) = mid;
  }
  return static_cast<int64_t>(hi);
}

}  // namespace

Plan budget_plan(const Scenario& sc, const Costs& costs) {
  if (auto p = try_budget_plan(sc, costs)) return *p;
  const int64_t budget = memory::activation_budget_bytes(sc), least = least_budget(sc, costs);
  // What checkpointing.budget would have to say: the activations plus the transient it also counts.
  const int64_t transient = memory::predict_peak(sc, recompute::make_plan({}, sc.model.n_layer)).transient_bytes;
  const double share = std::get<config::mode::Budget>(config::choice(sc.checkpointing)).share;
  std::string needed = log::format_bytes(least + transient);
  if (share > 0) {
    const double room = static_cast<double>(budget + transient) / share;
    needed = room > 0
                 ? fmt::format("{:.0f}% ({})", std::ceil(100.0 * static_cast<double>(least + transient) / room), needed)
                 : "more than memory.limit leaves after the model states";
  }
  throw ConfigError(fmt::format(
      "checkpointing.budget: no schedule fits {} of activations at micro-batch {} x {} tokens (checkpointing.budget "
      "'{}'{}); the least any schedule needs is about {} of activations, i.e. checkpointing.budget: {}. Raise the "
      "budget (or memory.limit), or lower train.micro_batch and raise train.grad_accum",
      log::format_bytes(std::max<int64_t>(0, budget)), sc.micro_batch, sc.seq_len,
      sc.checkpointing.budget.text.empty() ? "100%" : sc.checkpointing.budget.text,
      transient > 0 ? fmt::format(", less the {} the sharding holds beside them", log::format_bytes(transient)) : "",
      log::format_bytes(least), needed));
}

std::optional<Plan> try_plan_for(const Scenario& sc) {
  if (sc.checkpointing.mode.solved()) return formula_plan(sc);
  Plan p = recompute::make_plan(sc.checkpointing, sc.model.n_layer);
  // every input, in the uniform modes
  for (auto& s : p.segments) s.offloaded = s.checkpointed && sc.placement.offload.activations;
  return p;
}

Plan plan_for(const Scenario& sc) {
  if (auto p = try_plan_for(sc)) return *std::move(p);
  return budget_plan(sc, formula_costs(sc));  // none fits: its ConfigError, with the least budget that would
}

}  // namespace sl::budget
