// GPT model: parameters, GPT-2 style init, and the forward pass built from named block parts.
#include "model/gpt.h"
#include "config/shape.h"
#include "model/attention.h"
#include "model/block_ops.h"
#include "model/fused_loss.h"
#include "model/gelu.h"
#include "model/layernorm.h"
#include "model/linear.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/dropout.h>

namespace sl::model {
namespace {

// A tensor of `shape` on opts' device whose storage has the size but no memory: a deferred parameter.
// It can be re-pointed (set_data, same device) but never read. (A meta tensor cannot be re-pointed
// at a CPU or CUDA buffer.)
torch::Tensor unbacked(const std::vector<int64_t>& shape, const torch::TensorOptions& opts) {
  const auto bytes = static_cast<size_t>(c10::multiply_integers(shape)) * c10::elementSize(torch::kFloat);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, c10::DataPtr(nullptr, opts.device()), nullptr, false);
  return torch::empty({0}, opts).set_(storage, 0, shape);
}

// model.lora.base_dtype bf16: a frozen matrix (not an adapter, not a norm weight or bias) is held in bf16.
bool held_in_bf16(const config::ModelConfig& cfg, const std::string& name, const std::vector<int64_t>& shape) {
  return cfg.lora.enabled() && cfg.lora.base_dtype == config::Dtype::kBf16 && shape.size() >= 2 &&
         name.rfind("lora_", 0) != 0;
}

// A parameter of `shape`, initialized by init_parameter; deferred (or on the meta device): shape only,
// nothing drawn from the generator. A frozen matrix held in bf16 (held_in_bf16) draws the fp32 values a
// full model draws and keeps their rounding (one fp32 tensor at a time).
torch::Tensor make_param(const config::ModelConfig& cfg, const std::string& name, const std::vector<int64_t>& shape,
                         const torch::TensorOptions& opts, bool defer) {
  if (defer && opts.device() != torch::kMeta) return unbacked(shape, opts);
  const bool bf16 = held_in_bf16(cfg, name, shape);
  if (opts.device() == torch::kMeta) return torch::empty(shape, bf16 ? opts.dtype(torch::kBFloat16) : opts);
  auto t = torch::empty(shape, opts);
  init_parameter(cfg, name, t);
  return bf16 ? t.to(torch::kBFloat16) : t;
}

// RMSNorm as one autograd node: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). A composite of
// several ops would hand its input two gradient pieces that autograd sums in an order that depends
// on the graph around it; one node gives one piece, so gradients are identical whether or not the
// norm is recomputed.
struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               double eps) {
    auto rstd = torch::rsqrt(x.pow(2).mean(/*dim=*/-1, /*keepdim=*/true) + eps);  // (..., 1)
    ctx->save_for_backward({x, w, rstd});
    return x * rstd * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];
    const auto& dy = grads[0];
    auto xhat = x * rstd;
    auto gw = dy * w;  // gradient w.r.t. xhat
    auto dx = rstd * (gw - xhat * (gw * xhat).mean(/*dim=*/-1, /*keepdim=*/true));
    auto dw = (dy * xhat).reshape({-1, x.size(-1)}).sum(0);
    return {dx, dw, torch::Tensor()};
  }
};

// The block's and the head's norms, whose outputs feed linears: under bf16 autocast of the stream's
// device the fused LayerNorm writes them in bf16 itself (model/layernorm.h; on CUDA also from a bf16
// stream of bf16 compute copies), else ATen's.
torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool rms, double eps) {
  if (rms) return RmsNormFunction::apply(x, w, eps);
  if (layer_norm_bf16_fused(x, w, b)) return layer_norm_bf16(x, w, b, eps);
  return at::layer_norm(x, {x.size(-1)}, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, eps);
}

// Rotates pairs (x[i], x[i + hd/2]) of x (B, nh, T, hd) by the angles in cos/sin (T, hd/2).
torch::Tensor apply_rope(const torch::Tensor& x, const Rope& rope) {
  const int64_t half = x.size(-1) / 2;  // narrow, not chunk: see BlockImpl::heads
  const auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * rope.cos - x2 * rope.sin, x1 * rope.sin + x2 * rope.cos}, /*dim=*/-1);
}

}  // namespace

void init_parameter(const config::ModelConfig& cfg, const std::string& name, torch::Tensor t) {
  torch::NoGradGuard no_grad;
  if (!t.device().is_cpu()) {  // drawn on the CPU generator, then copied: one tensor of host memory at a time
    auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU));
    init_parameter(cfg, name, host);
    t.copy_(host);
    return;
  }
  const auto dot = name.rfind('.');
  const std::string leaf = dot == std::string::npos ? name : name.substr(dot + 1);
  if ((leaf == "wte" || leaf == "lm_head") && t.size(0) > cfg.vocab_size) {
    // The vocabulary padding (ModelConfig::padded_vocab): the real rows draw what an unpadded table
    // draws (the first rows of a contiguous tensor: the same elements in the same order), the rest are zero.
    init_parameter(cfg, name, t.narrow(0, 0, cfg.vocab_size));
    t.narrow(0, cfg.vocab_size, t.size(0) - cfg.vocab_size).zero_();
    return;
  }
  if (leaf.rfind("lora_A_", 0) == 0) {  // PEFT's kaiming_uniform_(a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.size(1)));
    t.uniform_(-bound, bound);
  } else if (leaf.rfind("lora_B_", 0) == 0) {  // zero: the adapted model starts as the base
    t.zero_();
  } else if (leaf == "w_proj" || leaf == "w_out") {  // residual projections: GPT-2's 1/sqrt(2 L) scaling
    t.normal_(0.0, cfg.init_std / std::sqrt(2.0 * static_cast<double>(cfg.n_layer)));
  } else if (leaf[0] == 'w' || leaf == "lm_head") {  // wte, wpe, w_qkv, w_fc
    t.normal_(0.0, cfg.init_std);
  } else if (leaf.size() > 2 && leaf.compare(leaf.size() - 2, 2, "_w") == 0) {  // ln1_w, ln2_w, lnf_w
    t.fill_(1.0);
  } else {  // biases
    t.zero_();
  }
}

BlockImpl::BlockImpl(const config::ModelConfig& cfg, int64_t layer_index, torch::Device device, bool defer_params)
    : layer(layer_index),
      n_head(cfg.n_head),
      n_embd(cfg.n_embd),
      hidden(config::Shape(cfg).hidden(layer_index)),
      llama(cfg.arch == config::Arch::kLlama),
      dropout(cfg.dropout),
      eps(cfg.norm_eps) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  const int64_t C = n_embd, H = hidden;
  const bool with_bias = cfg.bias && !llama;
  auto param = [&](const std::string& name, std::vector<int64_t> shape) {
    return register_parameter(name, make_param(cfg, name, shape, opts, defer_params));
  };
  ln1_w = param("ln1_w", {C});
  ln2_w = param("ln2_w", {C});
  w_qkv = param("w_qkv", {3 * C, C});
  w_proj = param("w_proj", {C, C});
  w_fc = param("w_fc", {llama ? 2 * H : H, C});
  w_out = param("w_out", {C, H});
  if (with_bias) {
    ln1_b = param("ln1_b", {C});
    ln2_b = param("ln2_b", {C});
    b_qkv = param("b_qkv", {3 * C});
    b_proj = param("b_proj", {C});
    b_fc = param("b_fc", {H});
    b_out = param("b_out", {C});
  }
  add_adapters(cfg, opts, defer_params);
}

void BlockImpl::add_adapters(const config::ModelConfig& cfg, const torch::TensorOptions& opts, bool defer_params) {
  if (!cfg.lora.enabled()) return;
  const std::array<int64_t, 4> out = {3 * n_embd, n_embd, llama ? 2 * hidden : hidden, n_embd};
  const std::array<int64_t, 4> in = {n_embd, n_embd, n_embd, hidden};
  const int64_t r = cfg.lora.rank;
  for (const auto& t : config::lora_targets(cfg, layer)) {
    auto& adapter = lora[static_cast<size_t>(t.projection)];
    adapter.out_features = out[static_cast<size_t>(t.projection)];
    adapter.scale = cfg.lora.alpha / static_cast<double>(r);
    adapter.dropout = cfg.lora.dropout;
    adapter.owner = this;
    const auto a_name = config::lora_param_name(t, 'A'), b_name = config::lora_param_name(t, 'B');
    LoraPiece piece{t.row0, t.rows, {}, {}};
    piece.A = register_parameter(a_name, make_param(cfg, a_name, {r, in[static_cast<size_t>(t.projection)]}, opts,
                                                    defer_params));
    piece.B = register_parameter(b_name, make_param(cfg, b_name, {t.rows, r}, opts, defer_params));
    adapter.pieces.push_back(piece);
  }
}

torch::Tensor BlockImpl::norm1(const torch::Tensor& x) const { return norm(x, ln1_w, ln1_b, llama, eps); }
torch::Tensor BlockImpl::norm2(const torch::Tensor& x) const { return norm(x, ln2_w, ln2_b, llama, eps); }

std::array<torch::Tensor, 3> BlockImpl::heads(const torch::Tensor& qkv, int64_t nh) const {
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = n_embd / n_head, width = nh * hd;
  // narrow, not split/chunk: the same views, and on the lazy test device split's outputs feed later ops
  // wrong (their results come back as CPU tensors; LibTorch 2.11), which narrow's do not.
  auto part = [&](int64_t i) { return qkv.narrow(2, i * width, width).view({B, T, nh, hd}).transpose(1, 2); };
  return {part(0), part(1), part(2)};  // (B, nh, T, hd)
}

std::vector<torch::Tensor> BlockImpl::attention_inputs(const torch::Tensor& qkv, const Rope& rope) const {
  if (!llama) return {qkv};
  auto [q, k, v] = heads(qkv, n_head);
  return {apply_rope(q, rope), apply_rope(k, rope), v};
}

torch::Tensor BlockImpl::attention_core(const std::vector<torch::Tensor>& in, const torch::Tensor& mask) const {
  return sequence ? sequence_attention(in, mask) : local_attention(in, n_head, mask);
}

torch::Tensor BlockImpl::local_attention(const std::vector<torch::Tensor>& in, int64_t nh,
                                         const torch::Tensor& mask) const {
  const double dropout_p = is_training() ? dropout : 0.0;
  const bool packed = in.size() == 1, causal = !mask.defined();
  if (causal && dropout_p == 0.0 && packed && causal_attention_packed_fused(in[0], nh))
    return causal_attention_packed(in[0], nh);  // (B, T, nh * hd)
  auto [q, k, v] = packed ? heads(in[0], nh) : std::array<torch::Tensor, 3>{in[0], in[1], in[2]};
  if (causal && dropout_p == 0.0 && causal_attention_fused(q, k, v)) return causal_attention(q, k, v);  // (B, T, C')
  const int64_t B = q.size(0), T = q.size(2);
  auto y = causal ? at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, dropout_p, /*is_causal=*/true)
                  : at::scaled_dot_product_attention(q, k, v, mask, dropout_p, /*is_causal=*/false);
  return y.transpose(1, 2).contiguous().view({B, T, nh * q.size(3)});  // (B, T, nh * hd)
}

torch::Tensor BlockImpl::sequence_attention(const std::vector<torch::Tensor>& in, const torch::Tensor& mask) const {
  const int64_t n = sequence->degree(), hd = n_embd / n_head, B = in[0].size(0);
  torch::Tensor mine;  // (B, T/N, 3, nh, hd): this rank's positions of every head
  if (in.size() == 1) {
    mine = in[0].reshape({B, in[0].size(1), 3, n_head, hd});
  } else {  // (B, nh, T/N, hd) each
    mine = torch::stack({in[0].transpose(1, 2), in[1].transpose(1, 2), in[2].transpose(1, 2)}, 2);
  }
  const auto whole = positions_to_heads(sequence, mine);  // (B, T, 3, nh/N, hd)
  const int64_t T = whole.size(1), nh = n_head / n;
  const auto y = local_attention({whole.view({B, T, 3 * nh * hd})}, nh, mask);  // (B, T, nh/N * hd)
  return heads_to_positions(sequence, y.view({B, T, 1, nh, hd})).view({B, T / n, n_embd});
}

torch::Tensor BlockImpl::mlp_act(const torch::Tensor& u, const torch::Tensor& fc_bias) const {
  if (!llama) return fc_bias.defined() ? gelu_tanh_bias(u, fc_bias) : gelu_tanh(u);
  const int64_t H = u.size(-1) / 2;  // [gate; up] (narrow, not chunk: see heads)
  return at::silu(u.narrow(-1, 0, H)) * u.narrow(-1, H, H);
}

torch::Tensor BlockImpl::residual_dropout(const torch::Tensor& y) const {
  return torch::dropout(y, dropout, is_training());
}

// Pre-norm: h = x + attention(norm1(x)); out = h + mlp(norm2(h)). The ops (model/block_ops.h) run each
// norm and activation inside the linear after it, through linear_after, and route biases to the fused
// kernels.
torch::Tensor BlockImpl::forward_with(const torch::Tensor& x, const Rope& rope, const LinearAfter& linear_after) {
  const BlockOps op(*this, rope, linear_after);
  const auto h = op.residual(x, op.attention(op.norm1(x)));
  return op.residual(h, op.mlp(op.norm2(h)));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const Rope& rope) {
  static const LinearAfter plain = [](Part, const CheapFn& cheap, const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>&, const torch::Tensor& W,
                                      const torch::Tensor& b, const LoraAdapter& lora) {
    return lora.linear(cheap(inputs), W, b);
  };
  return forward_with(x, rope, plain);
}

GPTImpl::GPTImpl(const config::ModelConfig& c, torch::Device device, bool defer_params) : cfg(c) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  const int64_t C = cfg.n_embd;
  const bool llama = cfg.arch == config::Arch::kLlama;
  auto param = [&](const std::string& name, std::vector<int64_t> shape) {
    return register_parameter(name, make_param(cfg, name, shape, opts, defer_params));
  };
  wte = param("wte", {cfg.padded_vocab(), C});
  if (!llama) wpe = param("wpe", {cfg.max_seq_len, C});
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t l = 0; l < cfg.n_layer; ++l) blocks->push_back(Block(cfg, l, device, defer_params));
  lnf_w = param("lnf_w", {C});
  if (cfg.bias && !llama) lnf_b = param("lnf_b", {C});
  if (!cfg.tie_embeddings) lm_head = param("lm_head", {cfg.padded_vocab(), C});
  if (llama) {
    const int64_t half = C / cfg.n_head / 2;
    auto inv_freq = torch::pow(cfg.rope_theta, -torch::arange(half, opts) / static_cast<double>(half));  // (hd/2)
    auto angles = torch::outer(torch::arange(cfg.max_seq_len, opts), inv_freq);  // (max_seq_len, hd/2)
    rope_cos = register_buffer("rope_cos", angles.cos());
    rope_sin = register_buffer("rope_sin", angles.sin());
  }
  if (cfg.lora.enabled()) freeze_base();
}

void GPTImpl::freeze_base() {
  for (auto& item : named_parameters())
    if (item.key().find(".lora_") == std::string::npos) item.value().requires_grad_(false);
}

int64_t GPTImpl::first_position(int64_t T) const { return sequence ? sequence->rank() * T : 0; }

void GPTImpl::shard_sequence(std::shared_ptr<SequenceExchange> ex) {
  sequence = ex;
  for (const auto& b : *blocks) b->as<BlockImpl>()->sequence = ex;
}

namespace {

// Packed rows' attention mask from their positions p (B, T'), each position's index within its example:
// query i attends key j when i - p_i <= j <= i (its example starts at i - p_i). Additive, (B, 1, T', T')
// in the attention's dtype (autocast's where it is on, else the weights'): 0 there, -inf elsewhere. One
// tensor for every layer of the micro-batch; SDPA would turn a bool mask into such a one at every call.
torch::Tensor packed_mask(const torch::Tensor& p, const torch::Tensor& weights) {
  const auto type = weights.device().type();
  const bool autocasts = (type == c10::kCPU || type == c10::kCUDA) && at::autocast::is_autocast_enabled(type);
  const auto dtype = autocasts ? at::autocast::get_autocast_dtype(type) : weights.scalar_type();
  const auto i = torch::arange(p.size(1), p.options()).unsqueeze(1);  // (T', 1)
  const auto j = i.view({1, -1});                                   // (1, T')
  const auto start = (j - p).unsqueeze(2);                            // (B, T', 1): each query's example start
  const auto allowed = (j <= i).unsqueeze(0).logical_and(j.unsqueeze(0) >= start).unsqueeze(1);
  return torch::zeros(allowed.sizes(), weights.options().dtype(dtype))
      .masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

}  // namespace

Rope GPTImpl::rope(int64_t T, const torch::Tensor& positions) const {
  const int64_t first = first_position(T);
  if (!positions.defined()) {
    if (!rope_cos.defined()) return {};
    return {rope_cos.narrow(0, first, T), rope_sin.narrow(0, first, T), {}};
  }
  Rope r;
  r.mask = packed_mask(positions, wte);
  if (rope_cos.defined()) {
    const auto mine = positions.narrow(1, first, T);  // (B, T)
    const auto table = [&](const torch::Tensor& t) { return at::embedding(t, mine).unsqueeze(1); };  // (B, 1, T, hd/2)
    r.cos = table(rope_cos), r.sin = table(rope_sin);
  }
  return r;
}

torch::Tensor GPTImpl::embed(const torch::Tensor& idx, const torch::Tensor& positions) {
  auto x = at::embedding(wte, idx);  // (B, T, C)
  const int64_t T = idx.size(1), first = first_position(T);
  if (wpe.defined())
    x = x + (positions.defined() ? at::embedding(wpe, positions.narrow(1, first, T)) : wpe.narrow(0, first, T));
  // model.lora.base_dtype bf16: bf16 tables, an fp32 stream (the norms' weights' dtype)
  if (x.scalar_type() != lnf_w.scalar_type()) x = x.to(lnf_w.scalar_type());
  return torch::dropout(x, cfg.dropout, is_training());
}

torch::Tensor GPTImpl::head(const torch::Tensor& x) {
  auto h = norm(x, lnf_w, lnf_b, cfg.arch == config::Arch::kLlama, cfg.norm_eps);
  auto logits = model::linear(h, cfg.tie_embeddings ? wte : lm_head);  // (B, T, padded_vocab)
  // The padding's logits (zero rows: zero logits) go no further: the loss, evaluation and sampling see
  // vocab_size columns, and narrow's backward gives the padding rows a zero gradient.
  return logits.size(-1) > cfg.vocab_size ? logits.narrow(-1, 0, cfg.vocab_size) : logits;  // (B, T, V)
}

torch::Tensor GPTImpl::final_norm(const torch::Tensor& x) const {
  return norm(x, lnf_w, lnf_b, cfg.arch == config::Arch::kLlama, cfg.norm_eps).reshape({-1, x.size(-1)});
}

torch::Tensor GPTImpl::classifier_loss(const torch::Tensor& h, const torch::Tensor& targets) const {
  const auto& W = cfg.tie_embeddings ? wte : lm_head;
  return linear_cross_entropy(h, W, targets.reshape({-1}), loss_chunk_rows(h.size(0), W.size(0), cfg.loss_chunk),
                              cfg.vocab_size);
}

torch::Tensor GPTImpl::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  return classifier_loss(final_norm(x), targets);
}

namespace {
torch::Tensor trunk(GPTImpl& m, const torch::Tensor& idx, const torch::Tensor& positions) {
  auto x = m.embed(idx, positions);
  auto r = m.rope(idx.size(1), positions);
  for (const auto& b : *m.blocks) x = b->as<BlockImpl>()->forward(x, r);
  return x;
}
}  // namespace

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const torch::Tensor& positions) {
  return head(trunk(*this, idx, positions));
}

torch::Tensor GPTImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& positions) {
  return head_loss(trunk(*this, idx, positions), targets);
}

torch::Tensor GPTImpl::loss_of_logits(const torch::Tensor& logits, const torch::Tensor& targets) {
  const auto flat = logits.reshape({-1, logits.size(-1)});
  // The lazy test device cannot differentiate cross_entropy_loss (its TorchScript graph hands
  // nll_loss_backward a float64 gradient; LibTorch 2.11): there, the two ops cross_entropy_loss is
  // made of (log_softmax, then nll_loss), which it differentiates.
  if (logits.device().type() == c10::kLazy) return at::nll_loss(at::log_softmax(flat, 1), targets.reshape({-1}));
  return at::cross_entropy_loss(flat, targets.reshape({-1}));
}

std::string unit_name(const config::ModelConfig& m, int64_t unit) {
  if (unit == kEmbeddingUnit) return "embeddings";
  if (unit == head_unit(m)) return "head";
  return "block " + std::to_string(unit - 1);
}

std::vector<std::vector<NamedParam>> GPTImpl::units() const {
  std::vector<std::vector<NamedParam>> out(static_cast<size_t>(unit_count(cfg)));
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    int64_t u = head_unit(cfg);  // lnf_w, lnf_b, lm_head
    if (name == "wte" || name == "wpe") u = kEmbeddingUnit;
    if (name.rfind("blocks.", 0) == 0) u = block_unit(std::stoll(name.substr(7)));
    out[static_cast<size_t>(u)].push_back({name, item.value()});
  }
  return out;
}

int64_t GPTImpl::num_params() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

std::vector<torch::Tensor> GPTImpl::trained_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

int64_t GPTImpl::num_trained_params() const {
  int64_t n = 0;
  for (const auto& p : trained_parameters()) n += p.numel();
  return n;
}

int64_t GPTImpl::num_padding_params() const { return config::Shape(cfg).padding_params(); }

int64_t GPTImpl::num_matmul_params() const {
  int64_t n = num_params();
  if (wpe.defined()) n -= wpe.numel();
  if (!cfg.tie_embeddings) n -= wte.numel();
  return n;
}

}  // namespace sl::model
