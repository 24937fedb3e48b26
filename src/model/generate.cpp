// Generation: a cached block step (the block's own parts around an attention over the cache), the
// prompt pass, the token loop, and the sampler.
#include "model/generate.h"

#include <chrono>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "errors.h"
#include "model/linear.h"

namespace sl::model {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Keys and values of one block for every position so far: (1, n_head, capacity, head_dim) each.
struct LayerCache {
  torch::Tensor k, v;
};

// Attention of the t new queries (positions pos .. pos+t-1) over the cached keys 0 .. pos+t-1. generate()
// runs the whole prompt at pos 0 (plain causal attention) and then one token at a time (it sees every key).
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t pos) {
  const int64_t t = q.size(2);
  TORCH_CHECK(t == 1 || pos == 0, "cached_attention: several new positions after a cached prefix are not supported");
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/t > 1);
}

// One block on the new positions x (1, t, C) at offset pos: the block's norms, projections, RoPE and
// MLP activation, with the new keys and values appended to `cache`.
torch::Tensor block_step(BlockImpl& b, const torch::Tensor& x, int64_t pos, const Rope& rope, LayerCache& cache) {
  const int64_t t = x.size(1);
  const auto n1 = b.norm1(x);
  auto qkv = b.lora[0].linear(n1, b.w_qkv, b.b_qkv);
  auto [q, k, v] = b.heads(qkv, b.n_head);  // (1, nh, t, hd)
  if (b.llama) {
    const auto rotated = b.attention_inputs(qkv, rope);
    q = rotated[0];
    k = rotated[1];
  }
  cache.k.narrow(2, pos, t).copy_(k);
  cache.v.narrow(2, pos, t).copy_(v);
  auto y = cached_attention(q, cache.k.narrow(2, 0, pos + t), cache.v.narrow(2, 0, pos + t), pos);
  y = y.transpose(1, 2).reshape({x.size(0), t, b.n_embd});
  auto h = x + b.lora[1].linear(y, b.w_proj, b.b_proj);
  const auto n2 = b.norm2(h);
  auto u = b.lora[2].linear(n2, b.w_fc, b.b_fc);
  const auto act = b.mlp_act(u, torch::Tensor());
  return h + b.lora[3].linear(act, b.w_out, b.b_out);
}

// The model on new ids (1, t) at offset pos with the caches: the last position's logits (V).
torch::Tensor cached_forward(GPTImpl& m, const torch::Tensor& ids, int64_t pos, std::vector<LayerCache>& caches) {
  const int64_t t = ids.size(1);
  auto x = at::embedding(m.wte, ids);
  if (m.wpe.defined()) x = x + m.wpe.narrow(0, pos, t);
  const Rope rope =
      m.rope_cos.defined() ? Rope{m.rope_cos.narrow(0, pos, t), m.rope_sin.narrow(0, pos, t), {}} : Rope{};
  for (size_t l = 0; l < m.blocks->size(); ++l)
    x = block_step(*m.blocks[l]->as<BlockImpl>(), x, pos, rope, caches[l]);
  return m.head(x.narrow(1, t - 1, 1)).reshape({-1});
}

std::vector<LayerCache> make_caches(const GPTImpl& m, int64_t capacity) {
  const int64_t hd = m.cfg.n_embd / m.cfg.n_head;
  const auto opts = m.wte.options();
  std::vector<LayerCache> caches(static_cast<size_t>(m.cfg.n_layer));
  for (auto& c : caches) {
    c.k = torch::empty({1, m.cfg.n_head, capacity, hd}, opts);
    c.v = torch::empty({1, m.cfg.n_head, capacity, hd}, opts);
  }
  return caches;
}

void check_request(const GPTImpl& m, const std::vector<int64_t>& prompt, const GenerateOptions& o) {
  if (prompt.empty())
    throw ConfigError(
        "sample: the prompt encodes to no tokens; give a prompt (or leave it empty for the end-of-text token)");
  for (int64_t id : prompt)
    if (id < 0 || id >= m.cfg.vocab_size)
      throw ConfigError(fmt::format("sample: prompt token {} is outside the model's vocabulary (model.vocab_size {}); "
                                    "the tokenizer does not belong to these weights", id, m.cfg.vocab_size));
  const int64_t total = static_cast<int64_t>(prompt.size()) + o.max_new_tokens;
  if (total > m.cfg.max_seq_len)
    throw ConfigError(fmt::format("sample: {} prompt tokens + {} new tokens = {} exceed the model's context of {} "
                                  "(model.max_seq_len); shorten the prompt or ask for fewer tokens",
                                  prompt.size(), o.max_new_tokens, total, m.cfg.max_seq_len));
  if (!(o.temperature >= 0.0))
    throw ConfigError(fmt::format("sample: temperature must be >= 0, got {}", o.temperature));
  if (o.top_k < 0) throw ConfigError(fmt::format("sample: top-k must be >= 0, got {}", o.top_k));
}

// Restores the module's training flag when generation ends.
class EvalMode {
 public:
  explicit EvalMode(GPTImpl& m) : m_(m), was_training_(m.is_training()) { m_.eval(); }
  ~EvalMode() { m_.train(was_training_); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  GPTImpl& m_;
  bool was_training_;
};

// The next token from last-position logits (V): argmax when temperature is 0, else a draw from
// softmax(logits / temperature) restricted to the top_k, with `generator` (on the host, any device).
int64_t pick_token(const torch::Tensor& logits, double temperature, int64_t top_k, at::Generator& generator) {
  if (temperature == 0.0) return logits.argmax().item<int64_t>();
  auto scaled = logits.to(torch::kCPU, torch::kFloat) / temperature;
  if (top_k > 0 && top_k < scaled.numel()) {
    const auto kth = std::get<0>(scaled.topk(top_k)).min();
    scaled = scaled.masked_fill(scaled < kth, -std::numeric_limits<float>::infinity());
  }
  const auto probs = torch::softmax(scaled, 0);
  return at::multinomial(probs, 1, false, generator).item<int64_t>();
}

}  // namespace

Generated generate(GPTImpl& model, const std::vector<int64_t>& prompt, const GenerateOptions& o,
                   const std::function<void(int64_t)>& on_token) {
  check_request(model, prompt, o);
  torch::NoGradGuard no_grad;
  EvalMode eval(model);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const auto device = model.wte.device();
  const auto t0 = Clock::now();
  std::vector<int64_t> seq = prompt;
  auto caches = o.use_cache ? make_caches(model, static_cast<int64_t>(prompt.size()) + o.max_new_tokens)
                            : std::vector<LayerCache>{};
  Generated out;
  int64_t pos = 0;  // positions already in the caches
  while (static_cast<int64_t>(out.ids.size()) < o.max_new_tokens) {
    torch::Tensor logits;
    if (o.use_cache) {
      const auto fresh = std::vector<int64_t>(seq.begin() + pos, seq.end());
      logits = cached_forward(model, torch::tensor(fresh, torch::kInt64).view({1, -1}).to(device), pos, caches);
      pos = static_cast<int64_t>(seq.size());
    } else {
      const auto all = torch::tensor(seq, torch::kInt64).view({1, -1}).to(device);
      logits = (o.forward ? o.forward(all) : model.forward(all)).select(1, all.size(1) - 1).reshape({-1});
    }
    const int64_t next = pick_token(logits, o.temperature, o.top_k, generator);
    if (out.ids.empty()) out.prompt_seconds = since(t0);
    out.ids.push_back(next);
    seq.push_back(next);
    if (on_token) on_token(next);
    if (o.stop_id && next == *o.stop_id) break;
  }
  out.seconds = since(t0);
  return out;
}

}  // namespace sl::model
