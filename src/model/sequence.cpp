#include "model/sequence.h"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>

namespace sl::model {

namespace {

// The memo of this thread's ExchangeMemoScope (null: none), and whether it replays. Thread-local: on CUDA a
// recompute runs on autograd's device thread, which opens its own scope (recompute/checkpoint.cpp).
thread_local ExchangeMemo* t_memo = nullptr;
thread_local bool t_replay = false;

// One direction of the exchange, through the scope's memo where there is one: a first pass exchanges and
// records what it received; a recompute takes it back.
template <class Exchange>
torch::Tensor exchange_or_take(at::IntArrayRef out_sizes, Exchange&& exchange) {
  if (t_memo && t_replay) return t_memo->take(out_sizes);
  auto out = exchange();
  if (t_memo) t_memo->record(out);
  return out;
}

// (B, T/N, G, nh, hd) -> (B, T, G, nh/N, hd). The send buffer is (N, B, T/N, G, nh/N, hd), chunk j the
// heads rank j takes; the received chunk j holds rank j's positions, so laying the chunks along the
// sequence in rank order gives the whole sequence.
torch::Tensor exchange_to_heads(SequenceExchange& ex, const torch::Tensor& x) {
  const int64_t n = ex.degree(), B = x.size(0), t = x.size(1), G = x.size(2), nh = x.size(3), hd = x.size(4);
  auto send = x.reshape({B, t, G, n, nh / n, hd}).permute({3, 0, 1, 2, 4, 5}).contiguous();
  auto recv = torch::empty_like(send);
  ex.all_to_all(recv, send);
  send = torch::Tensor();  // free before the copy below
  return recv.permute({1, 0, 2, 3, 4, 5}).contiguous().view({B, n * t, G, nh / n, hd});
}

// (B, T, G, nh/N, hd) -> (B, T/N, G, nh, hd): chunk j of the send buffer holds rank j's positions; the
// received chunk j holds rank j's heads, laid side by side in rank order.
torch::Tensor exchange_to_positions(SequenceExchange& ex, const torch::Tensor& y) {
  const int64_t n = ex.degree(), B = y.size(0), T = y.size(1), G = y.size(2), h = y.size(3), hd = y.size(4);
  auto send = y.reshape({B, n, T / n, G, h, hd}).permute({1, 0, 2, 3, 4, 5}).contiguous();
  auto recv = torch::empty_like(send);
  ex.all_to_all(recv, send);
  send = torch::Tensor();
  return recv.permute({1, 2, 3, 0, 4, 5}).contiguous().view({B, T / n, G, n * h, hd});
}

// The exchange is linear and its inverse is its adjoint (a permutation of elements across ranks), so
// each direction's gradient is the other direction applied to the output gradient.
struct ToHeads : torch::autograd::Function<ToHeads> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::shared_ptr<SequenceExchange>& ex);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g);
};
struct ToPositions : torch::autograd::Function<ToPositions> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                               const std::shared_ptr<SequenceExchange>& ex);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g);
};

// The exchange rides in the context as an int64 of its address: AutogradContext keeps IValues only. It
// outlives every graph the model makes (parallel::SequenceGroup lives for the run).
void keep(torch::autograd::AutogradContext* ctx, const std::shared_ptr<SequenceExchange>& ex) {
  ctx->saved_data["exchange"] = reinterpret_cast<int64_t>(ex.get());
}
SequenceExchange& kept(torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<SequenceExchange*>(ctx->saved_data["exchange"].toInt());
}

torch::Tensor ToHeads::forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::shared_ptr<SequenceExchange>& ex) {
  keep(ctx, ex);
  const int64_t n = ex->degree();
  const std::vector<int64_t> sizes = {x.size(0), n * x.size(1), x.size(2), x.size(3) / n, x.size(4)};
  return exchange_or_take(sizes, [&] { return exchange_to_heads(*ex, x); });
}
torch::autograd::variable_list ToHeads::backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
  return {exchange_to_positions(kept(ctx), g[0]), torch::Tensor()};
}
torch::Tensor ToPositions::forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                                   const std::shared_ptr<SequenceExchange>& ex) {
  keep(ctx, ex);
  const int64_t n = ex->degree();
  const std::vector<int64_t> sizes = {y.size(0), y.size(1) / n, y.size(2), n * y.size(3), y.size(4)};
  return exchange_or_take(sizes, [&] { return exchange_to_positions(*ex, y); });
}
torch::autograd::variable_list ToPositions::backward(torch::autograd::AutogradContext* ctx,
                                                     torch::autograd::variable_list g) {
  return {exchange_to_heads(kept(ctx), g[0]), torch::Tensor()};
}

}  // namespace

torch::Tensor ExchangeMemo::take(at::IntArrayRef sizes) {
  if (kept_.empty())
    throw std::logic_error("checkpointing.exchange keep: a recompute exchanged more than its first pass");
  auto t = std::move(kept_.front());
  kept_.pop_front();
  if (t.sizes() != sizes)
    throw std::logic_error(
        fmt::format("checkpointing.exchange keep: the recompute's exchange is {}, its first pass's {}",
                    fmt::join(sizes, "x"), fmt::join(t.sizes(), "x")));
  return t;
}

ExchangeMemoScope::ExchangeMemoScope(ExchangeMemo* memo, bool replay) : prev_memo_(t_memo), prev_replay_(t_replay) {
  t_memo = memo;
  t_replay = replay;
}

ExchangeMemoScope::~ExchangeMemoScope() {
  t_memo = prev_memo_;
  t_replay = prev_replay_;
}

torch::Tensor positions_to_heads(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 5 && x.size(3) % ex->degree() == 0, "positions_to_heads: (B, T/N, G, nh, hd) with N | nh");
  return ToHeads::apply(x, ex);
}

torch::Tensor heads_to_positions(const std::shared_ptr<SequenceExchange>& ex, const torch::Tensor& y) {
  TORCH_CHECK(y.dim() == 5 && y.size(1) % ex->degree() == 0, "heads_to_positions: (B, T, G, nh/N, hd) with N | T");
  return ToPositions::apply(y, ex);
}

}  // namespace sl::model
