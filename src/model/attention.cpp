// The fused causal attention's autograd nodes, predicates and split over (batch, head) pairs on ATen's
// intra-op threads; the loops of one head are kernels/cpu/attention.cpp's.
#include "model/attention.h"

#include <array>
#include <atomic>
#include <cmath>
#include <tuple>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "device/cpu_features.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/small_gemm.h"
#include "model/intra_op.h"

namespace sl::model {
namespace {

using kernels::cpu::BackwardScratch;
using kernels::cpu::Bf16;
using kernels::cpu::Bf16Head;
using kernels::cpu::Bf16HeadGrad;
using kernels::cpu::Bf16Rows;
using kernels::cpu::DotScratch;
using kernels::cpu::Head;
using kernels::cpu::HeadGrad;
using kernels::cpu::HeadShape;
using kernels::cpu::kRowBlock;
using kernels::cpu::Rows;

// A (B, nh, T, hd) tensor, fp32 or bf16, with unit stride along hd, addressed per (batch, head).
struct Strided {
  void* base;
  bool bf16;
  int64_t s_batch, s_head, s_row;  // elements
  int64_t offset(int64_t b, int64_t h) const { return b * s_batch + h * s_head; }
  Rows at(int64_t b, int64_t h) const { return {static_cast<float*>(base) + offset(b, h), s_row}; }  // fp32
  Bf16* at_bf16(int64_t b, int64_t h) const { return static_cast<Bf16*>(base) + offset(b, h); }
  Bf16Rows rows_bf16(int64_t b, int64_t h) const { return {at_bf16(b, h), s_row}; }
};

Strided strided(const torch::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 4 && t.stride(3) == 1);
  return {t.data_ptr(), t.scalar_type() == torch::kBFloat16, t.stride(0), t.stride(1), t.stride(2)};
}

// One thread's view of one (batch, head): its fp32 rows. fp32 tensors are read and written in place;
// bf16 ones go through fp32 copies in the thread's staging area (T x hd floats each, taken in order):
// inputs widened when the head is taken, results rounded into the tensor when it is done.
class HeadStage {
 public:
  HeadStage(int64_t b, int64_t h, const HeadShape& sh, float* staging) : b_(b), h_(h), sh_(sh), next_(staging) {}

  // The head's rows of an input.
  Rows in(const Strided& t) {
    if (!t.bf16) return t.at(b_, h_);
    const Rows r = take();
    kernels::cpu::widen_rows(t.at_bf16(b_, h_), t.s_row, sh_.T, sh_.hd, r.p);
    return r;
  }
  // Where the head's rows of a result go; done(t, rows) then stores them.
  Rows out(const Strided& t) { return t.bf16 ? take() : t.at(b_, h_); }
  void done(const Strided& t, const Rows& r) const {
    if (t.bf16) kernels::cpu::narrow_rows(r.p, sh_.T, sh_.hd, t.at_bf16(b_, h_), t.s_row);
  }

 private:
  Rows take() {
    const Rows r{next_, sh_.hd};
    next_ += sh_.T * sh_.hd;
    return r;
  }
  int64_t b_, h_;
  HeadShape sh_;
  float* next_;
};

// Floats of staging a thread needs for `count` operands of one head when they are bf16 (none for fp32).
int64_t staging_floats(bool bf16, int count, const HeadShape& sh) { return bf16 ? count * sh.T * sh.hd : 0; }

// A (B, T, nh, hd) buffer seen as (B, nh, T, hd): the layout of the output and of the gradients.
torch::Tensor heads_view(const torch::Tensor& btc, int64_t nh) {
  return btc.view({btc.size(0), btc.size(1), nh, -1}).transpose(1, 2);
}

// Runs fn(b, h, tid) for every (batch, head) on ATen's intra-op threads; tid indexes per-thread scratch.
template <class Fn>
void for_each_head(int64_t B, int64_t nh, int threads, Fn fn) {
  for_each_index(B * nh, [&](int64_t head, int tid) {
    TORCH_INTERNAL_ASSERT(tid < threads);  // scratch rows
    fn(head / nh, head % nh, tid);
  });
}

HeadShape shape_of(const torch::Tensor& q) {
  const int64_t hd = q.size(3);
  return {q.size(2), hd, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
}

std::atomic<bool>& fp32_products_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}

// bf16 heads multiply on bf16 pairs where the CPU has AVX512-BF16 (and the vector clones run).
bool dot_products(const torch::Tensor& q) {
  return q.scalar_type() == torch::kBFloat16 && kernels::cpu::bf16_dot_products() && device::vector_kernels() &&
         !fp32_products_forced().load(std::memory_order_relaxed);
}

// fp32 per-thread scratch, threads x per_thread floats.
torch::Tensor thread_scratch(int threads, int64_t per_thread) {
  return torch::empty({threads, per_thread}, torch::kFloat32);
}

// (output (B, T, nh * hd) in q's dtype, lse (B, nh, T) fp32).
// dot: bf16 products (dot_products(q), decided once per node so its backward takes the same path).
std::tuple<torch::Tensor, torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                           const torch::Tensor& v, bool dot) {
  RECORD_FUNCTION("sublinear::causal_attention", std::vector<c10::IValue>{});
  const int64_t B = q.size(0), nh = q.size(1);
  const HeadShape sh = shape_of(q);
  auto out = torch::empty({B, sh.T, nh * sh.hd}, q.options());
  auto lse = torch::empty({B, nh, sh.T}, q.options().dtype(torch::kFloat32));
  const int threads = at::get_num_threads();
  // bf16 products: no fp32 k^T (packed instead), the output staged only
  const int64_t blocks = (kRowBlock + (dot ? 0 : sh.hd)) * sh.T;
  const int64_t staging = staging_floats(q.scalar_type() == torch::kBFloat16, dot ? 1 : 4, sh);
  const int64_t per_thread = blocks + staging + (dot ? DotScratch::words(sh, /*backward=*/false) : 0);
  auto scratch = thread_scratch(threads, per_thread);
  const Strided Q = strided(q), K = strided(k), V = strided(v), O = strided(heads_view(out, nh));
  float* L = lse.data_ptr<float>();
  float* S = scratch.data_ptr<float>();
  for_each_head(B, nh, threads, [&](int64_t b, int64_t h, int tid) {
    float* w = S + tid * per_thread;
    HeadStage st(b, h, sh, w + blocks);
    float* lse_h = L + (b * nh + h) * sh.T;
    if (dot) {
      const Rows o = st.out(O);
      kernels::cpu::forward_head_bf16(Q.rows_bf16(b, h), K.rows_bf16(b, h), V.rows_bf16(b, h), o, lse_h, sh, w,
                        DotScratch::at(w + blocks + staging, sh, /*backward=*/false));
      st.done(O, o);
      return;
    }
    const Head x{st.in(Q), st.in(K), st.in(V), st.out(O), lse_h};
    kernels::cpu::forward_head(x, sh, w, w + kRowBlock * sh.T);
    st.done(O, x.o);
  });
  return {out, lse};
}

// Writes dq, dk, dv: (B, nh, T, hd) views in q's dtype, unit stride along hd (of one (B, T, 3C) buffer
// or of three).
void attention_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& grad,
                        const torch::Tensor& dq, const torch::Tensor& dk, const torch::Tensor& dv, bool dot) {
  RECORD_FUNCTION("sublinear::causal_attention_backward", std::vector<c10::IValue>{});
  const int64_t B = q.size(0), nh = q.size(1);
  const HeadShape sh = shape_of(q);
  auto dout = heads_view(grad.to(out.scalar_type()).contiguous(), nh);
  const int threads = at::get_num_threads();
  const int64_t block = kRowBlock * sh.T, head = sh.hd * sh.T, blocks = 2 * block + 2 * head + sh.T;
  // bf16 products: the three gradients staged only
  const int64_t staging = staging_floats(q.scalar_type() == torch::kBFloat16, dot ? 3 : 8, sh);
  const int64_t per_thread = blocks + staging + (dot ? DotScratch::words(sh, /*backward=*/true) : 0);
  auto scratch = thread_scratch(threads, per_thread);
  const Strided Q = strided(q), K = strided(k), V = strided(v), O = strided(heads_view(out, nh));
  const Strided dO = strided(dout), dQ = strided(dq), dK = strided(dk), dV = strided(dv);
  float* L = lse.data_ptr<float>();
  float* S = scratch.data_ptr<float>();
  for_each_head(B, nh, threads, [&](int64_t b, int64_t h, int tid) {
    float* w = S + tid * per_thread;
    HeadStage st(b, h, sh, w + blocks);
    const float* lse_h = L + (b * nh + h) * sh.T;
    const BackwardScratch ws{w, w + block, w + 2 * block, w + 2 * block + head, w + 2 * block + 2 * head};
    if (dot) {
      const Bf16Head x{Q.rows_bf16(b, h), K.rows_bf16(b, h), V.rows_bf16(b, h), O.rows_bf16(b, h), lse_h};
      const Bf16HeadGrad g{dO.rows_bf16(b, h), st.out(dQ), st.out(dK), st.out(dV)};
      kernels::cpu::backward_head_bf16(x, g, sh, ws, DotScratch::at(w + blocks + staging, sh, /*backward=*/true));
      st.done(dQ, g.dq), st.done(dK, g.dk), st.done(dV, g.dv);
      return;
    }
    const Head x{st.in(Q), st.in(K), st.in(V), st.in(O), L + (b * nh + h) * sh.T};
    const HeadGrad g{st.in(dO), st.out(dQ), st.out(dK), st.out(dV)};
    kernels::cpu::backward_head(x, g, sh, ws);
    st.done(dQ, g.dq), st.done(dK, g.dk), st.done(dV, g.dv);
  });
}

// The three (B, nh, T, hd) heads of a (B, T, 3C) [q | k | v] tensor, read in place.
std::array<torch::Tensor, 3> packed_heads(const torch::Tensor& qkv, int64_t nh) {
  const int64_t C = qkv.size(2) / 3;
  return {heads_view(qkv.narrow(2, 0, C), nh), heads_view(qkv.narrow(2, C, C), nh),
          heads_view(qkv.narrow(2, 2 * C, C), nh)};
}

void no_double_backward() {
  TORCH_CHECK(!torch::GradMode::is_enabled(), "causal_attention: double backward is not supported");
}

struct CausalAttentionFunction : torch::autograd::Function<CausalAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v) {
    const bool dot = dot_products(q);
    auto [out, lse] = attention_forward(q, k, v, dot);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["dot"] = dot;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    no_double_backward();
    const auto s = ctx->get_saved_variables();
    const int64_t nh = s[0].size(1);
    auto grad_buffer = [&] { return heads_view(torch::empty_like(s[3]), nh); };  // (B, T, C) like the output
    auto dq = grad_buffer(), dk = grad_buffer(), dv = grad_buffer();
    attention_backward(s[0], s[1], s[2], s[3], s[4], grads[0], dq, dk, dv, ctx->saved_data["dot"].toBool());
    return {dq, dk, dv};
  }
};

// The same on the QKV projection's output: one input, one gradient (B, T, 3C) written in place of the
// split's backward concatenation.
struct PackedAttentionFunction : torch::autograd::Function<PackedAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& qkv, int64_t nh) {
    auto [q, k, v] = packed_heads(qkv, nh);
    const bool dot = dot_products(q);
    auto [out, lse] = attention_forward(q, k, v, dot);
    ctx->save_for_backward({qkv, out, lse});
    ctx->saved_data["nh"] = nh;
    ctx->saved_data["dot"] = dot;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    no_double_backward();
    const auto s = ctx->get_saved_variables();
    const int64_t nh = ctx->saved_data["nh"].toInt();
    auto [q, k, v] = packed_heads(s[0], nh);
    auto dqkv = torch::empty_like(s[0], at::MemoryFormat::Contiguous);
    auto [dq, dk, dv] = packed_heads(dqkv, nh);
    attention_backward(q, k, v, s[1], s[2], grads[0], dq, dk, dv, ctx->saved_data["dot"].toBool());
    return {dqkv, torch::Tensor()};
  }
};

bool fused_operand(const torch::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.device().is_cpu() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
         t.layout() == torch::kStrided && t.dim() == 4 && t.stride(3) == 1 && t.stride(2) >= t.size(3);
}

// The kernel takes q, k, v (whatever SUBLINEAR_ATEN_KERNELS says): one dtype, one shape.
bool kernel_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return fused_operand(q) && fused_operand(k) && fused_operand(v) && q.scalar_type() == k.scalar_type() &&
         q.scalar_type() == v.scalar_type() && q.sizes() == k.sizes() && q.sizes() == v.sizes();
}

bool packed_kernel_takes(const torch::Tensor& qkv, int64_t n_head) {
  if (qkv.dim() != 3 || qkv.numel() == 0 || n_head <= 0 || qkv.size(2) % (3 * n_head) != 0) return false;
  auto [q, k, v] = packed_heads(qkv, n_head);
  return kernel_takes(q, k, v);
}

// Whether the model should take the kernel for tensors of `dtype` on this CPU. bf16 only where the
// AVX2 + FMA clone runs: the baseline clone's bf16 attention is slower than SDPA's bf16 kernels (311 vs
// 197 ms forward + backward at B 8, nh 4, T 256, hd 64, 2 threads, AVX2 EPYC with the baseline forced),
// and a CPU without bf16 instructions must not get slower than it was with SDPA (docs/precision.md).
bool worth_it(torch::ScalarType dtype) {
  return device::fused_kernels() && (dtype != torch::kBFloat16 || device::vector_kernels());
}

}  // namespace

bool force_fp32_attention_products(bool on) { return fp32_products_forced().exchange(on, std::memory_order_relaxed); }

bool bf16_attention_products() {
  return kernels::cpu::bf16_dot_products() && device::vector_kernels() && !fp32_products_forced();
}

bool causal_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return worth_it(q.scalar_type()) && kernel_takes(q, k, v);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(kernel_takes(q, k, v), "causal_attention: q, k, v must be fp32 or bf16 CPU (B, nh, T, hd) tensors "
              "of one dtype, unit stride along hd");
  const bool grad = torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!grad) return std::get<0>(attention_forward(q, k, v, dot_products(q)));
  return CausalAttentionFunction::apply(q, k, v);
}

bool causal_attention_packed_fused(const torch::Tensor& qkv, int64_t n_head) {
  return worth_it(qkv.scalar_type()) && packed_kernel_takes(qkv, n_head);
}

torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t n_head) {
  TORCH_CHECK(packed_kernel_takes(qkv, n_head), "causal_attention_packed: qkv must be an fp32 or bf16 CPU "
              "(B, T, 3 * n_head * hd) tensor, unit stride last");
  if (!torch::GradMode::is_enabled() || !qkv.requires_grad()) {
    auto [q, k, v] = packed_heads(qkv, n_head);
    return std::get<0>(attention_forward(q, k, v, dot_products(q)));
  }
  return PackedAttentionFunction::apply(qkv, n_head);
}

}  // namespace sl::model
