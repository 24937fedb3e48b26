// Analytic activation-memory model (see activations.h for the terms).
#include "predict/activations.h"

#include <algorithm>
#include <cmath>

#include "config/lora.h"
#include "config/shape.h"
#include "model/fused_loss.h"
#include "model/linear.h"

namespace sl::memory {

namespace {

// Per-token byte sizes of one recipe under one matmul path.
struct Sizes {
  double C = 0, H = 0, V = 0, nh = 0;
  bool llama = false;
  double f = 4.0, c = 4.0;  // fp32, compute dtype
  double r = 4.0;           // the residual stream: fp32, or c with a low-precision compute copy of the parameters
  bool lowp_params = false;
  bool frozen_bf16 = false;  // model.lora.base_dtype bf16
  double acc = 0;           // the emulated path's fp32 matmul accumulator, per output element
  bool widened = false;     // the widened linears (model/linear.h): no weight copies, fp32 transients
  double tok = 0;           // tokens per micro-batch (the widened linears' scratch depends on them)
  bool fused_attention = false;  // the CPU fp32 attention kernel (model/attention.h): output in (B, T, C)
  double packing = 0;            // packed rows: what a micro-batch holds throughout (packing_bytes)
  // model.dropout > 0 (see "Dropout" in activations.h):
  bool dropout = false;
  double mask = 0;              // bytes per element of a residual branch's dropout mask
  double embed_mask = 0;        // ... of the embeddings' dropout mask
  bool math_attention = false;  // SDPA's math path (CPU with dropout): fp32 T x T matrices
  double T = 0;                 // sequence length: the math path keeps nh * T elements per token per matrix
  // parallel.sequence (see "Sequence parallelism" in activations.h): N > 1 exchanges positions for heads
  // around attention, in elements of xq bytes (the packed q, k, v) and xo bytes (the attention output).
  bool sequence = false;
  double xq = 4.0, xo = 4.0;
  // model.lora (see "LoRA" in activations.h): the base is frozen, so a linear keeps its input only for its
  // projection's adapter. Per projection (w_qkv, w_proj, w_fc, w_out): the adapter's width R (rank times
  // its pieces; 0 = none), and the bytes per element of its input (the dropout's noise on the CPU).
  bool lora = false;
  std::array<double, 4> adapter_width{}, adapter_input{};
  double adapter_noise = 0;  // bytes per input element of the adapter's dropout mask: 0 without dropout
};

// model.lora's adapter widths and input element sizes of block `layer` (z's other fields set).
void set_adapters(const config::ModelConfig& m, int64_t layer, device::LowpMatmul, bool on_cuda, Sizes& z) {
  z.lora = m.lora.enabled();
  if (!z.lora) return;
  const config::Shape shape(m);
  for (const auto& t : config::lora_targets(m, layer))
    z.adapter_width[static_cast<size_t>(t.projection)] += static_cast<double>(m.lora.rank);
  // The norms' outputs: LLaMA's RMSNorm writes the stream's dtype, GPT-2's fused LayerNorm bf16 under bf16
  // autocast (model/layernorm.h), ATen's the stream's; the attention's and the MLP's in the compute dtype.
  const double norm_out = z.llama ? z.r : (z.c == 2.0 && m.arch == config::Arch::kGpt2 ? z.c : z.r);
  z.adapter_input = {norm_out, z.c, norm_out, z.c};
  if (m.lora.dropout > 0) z.adapter_noise = on_cuda ? 1.0 : -1.0;  // CUDA: a bool mask; CPU: the input's dtype
}

// The bytes per token a block's linear inputs and adapters keep beyond the plain model's S under
// model.lora, for the projections whose pair is not recomputed (`recomputed`, in Part order): an
// untargeted projection's input goes (nobody else keeps it), a targeted one keeps it and adds A's output
// (c R) and its dropout's mask. The linear inputs: norm1's and norm2's outputs (c C), LLaMA's contiguous
// copy of the attention output on SDPA's path (c C; GPT-2's and the fused kernel's output is the attention's
// own), the activation's output (c H).
double adapter_delta(const Sizes& z, const std::array<bool, 4>& recomputed) {
  if (!z.lora) return 0.0;
  const double C = z.C, c = z.c;
  const std::array<double, 4> input = {c * C, z.llama && !z.fused_attention ? c * C : 0.0, c * C, c * z.H};
  const std::array<double, 4> width = {C, C, C, z.H};
  double d = 0;
  for (size_t p = 0; p < 4; ++p) {
    if (recomputed[p]) continue;
    if (z.adapter_width[p] == 0) {
      d -= input[p];
      continue;
    }
    d += c * z.adapter_width[p];
    if (z.adapter_noise != 0) d += (z.adapter_noise > 0 ? z.adapter_noise : z.adapter_input[p]) * width[p];
  }
  return d;
}

// Packed rows (data.packing), held by a micro-batch from its embedding to the end of its backward: the
// attention mask over the whole rows, (B, 1, T, T) in the compute dtype (every rank of a sequence group
// holds all of it), the positions (B, T) int64 on the device, and LLaMA's rotation tables gathered per
// row, (B, T/N, hd/2) twice in the tables' dtype (model/gpt.h's Rope). 0 without packing.
double packing_bytes(const Scenario& sc, const Sizes& z) {
  if (!sc.packing) return 0.0;
  const auto B = static_cast<double>(sc.micro_batch), T = static_cast<double>(sc.seq_len);
  const double tables = z.llama ? 2.0 * z.tok * (z.C / z.nh / 2.0) * z.r : 0.0;
  return B * T * T * z.c + 8.0 * B * T + tables;
}

// The sizes of block `layer` (they differ only in H, with model.layer_mlp_hidden).
Sizes sizes_of(const Scenario& sc, device::LowpMatmul lowp, int64_t layer = 0) {
  const auto& m = sc.model;
  const bool lowp_on = sc.precision.compute != config::Dtype::kFp32;
  Sizes z;
  z.C = static_cast<double>(m.n_embd), z.H = static_cast<double>(config::Shape(m).hidden(layer));
  // the head's product has the padded rows
  z.V = static_cast<double>(m.padded_vocab()), z.nh = static_cast<double>(m.n_head);
  z.llama = m.arch == config::Arch::kLlama;
  z.c = lowp_on ? 2.0 : 4.0;
  z.lowp_params = sc.precision.param_dtype != config::Dtype::kFp32;
  // model.lora.base_dtype bf16: the frozen matrices are bf16 themselves (no autocast copies), the stream fp32
  z.frozen_bf16 = m.lora.enabled() && m.lora.base_dtype == config::Dtype::kBf16;
  z.r = z.lowp_params ? z.c : z.f;
  z.acc = lowp_on && lowp == device::LowpMatmul::emulated ? 4.0 : 0.0;
  z.widened = lowp_on && lowp == device::LowpMatmul::widened;
  z.tok = static_cast<double>(sc.local_tokens());
  z.fused_attention = !lowp_on && !sc.on_cuda() && !sc.packing;  // packed rows take SDPA with their mask
  z.packing = packing_bytes(sc, z);
  z.dropout = m.dropout > 0;
  if (z.dropout) {
    // CUDA's fused dropout keeps a bool mask; the CPU's keeps its noise tensor, in the input's dtype
    // (a branch's output: the compute dtype; the embeddings: the parameters').
    z.mask = sc.on_cuda() ? 1.0 : z.c;
    z.embed_mask = sc.on_cuda() ? 1.0 : z.r;
    z.math_attention = !sc.on_cuda();
  }
  z.T = static_cast<double>(sc.seq_len);
  z.sequence = sc.sequence > 1;
  // LLaMA under a low-precision compute dtype stacks RoPE's fp32 q, k with v: the exchanged q, k, v are
  // fp32, and on the CPU the fused fp32 attention runs on them and writes an fp32 output.
  const bool fp32_rotary = z.llama && z.c < z.f;
  z.xq = fp32_rotary ? z.f : z.c;
  z.xo = fp32_rotary && !sc.on_cuda() ? z.f : z.c;
  set_adapters(m, layer, lowp, sc.on_cuda(), z);
  return z;
}

// What the attention keeps for backward on SDPA's flash path or the fused CPU kernel, beyond the
// norm's output: qkv (its views q, k, v are saved), llama's rotated q and k, the log-sum-exp, and
// llama's second copy of the output on SDPA's path (the first, C, is counted apart).
double flash_attention_bytes(const Sizes& z) {
  const double C = z.C, c = z.c;
  const double attn_out = z.llama && !z.fused_attention ? 2 * C : C;
  return c * 3 * C + (z.llama ? c * 2 * C : 0.0) + z.f * z.nh + c * (attn_out - C);
}

// What SDPA's math path (attention dropout on the CPU) keeps instead, all fp32 (it computes in fp32
// whatever the inputs): the scaled q and k and a copy of v, C each, and three nh x T matrices per token
// (the softmax, the dropout noise, the dropped probabilities). qkv and the rotated q, k are not kept.
double math_attention_bytes(const Sizes& z) { return 3 * z.C * z.f + 3 * z.nh * z.T * z.f; }

// Sequence parallelism, an attention that is kept (not recomputed): it keeps the gathered q, k, v
// (B, T, 3C/N: 3C per local token, xq), its output (B, T, C/N: C, xo) and the projection keeps the
// exchanged-back output (B, T/N, C: C, c), in place of the local qkv, llama's rotated q, k and the
// unsharded attention output(s). Returned as the difference from the unsharded S.
double sequence_attention_delta(const Sizes& z) {
  const double C = z.C, c = z.c;
  const double attn_out = z.llama && !z.fused_attention ? 2 * C : C;
  const double unsharded = c * 3 * C + (z.llama ? c * 2 * C : 0.0) + c * attn_out;
  return z.xq * 3 * C + z.xo * C + c * C - unsharded;
}

// S: what one block keeps for backward, after the selective savings.
double block_bytes(const Sizes& z, const SegmentCounts& seg) {
  const double C = z.C, H = z.H, f = z.f, c = z.c;
  // llama's attention output is kept twice on SDPA's path (its strided output, and the projection's
  // contiguous copy); the fused CPU kernel writes it contiguous, one tensor for both.
  const double attn_out = z.llama && !z.fused_attention ? 2 * C : C;
  double S = z.r * 2 * C + (z.llama ? f * (2 + z.nh) + c * (7 * C + 4 * H) : f * (4 + z.nh) + c * (5 * C + 2 * H)) +
             c * attn_out;
  if (seg.norm) S -= c * 2 * C + f * (z.llama ? 2 : 4);
  if (seg.mlp) S -= c * (z.llama ? 2 * H : H);
  if (z.sequence && !seg.attention && !z.math_attention) S += sequence_attention_delta(z);
  if (seg.attention) S -= c * attn_out + f * z.nh;
  // The recomputed attention keeps its inputs; llama's rotated q, k are fp32 there (bf16 q times the
  // fp32 RoPE table), where SDPA would have kept its own compute-dtype copies.
  if (seg.attention && z.llama) S += (f - c) * 2 * C;
  // A plain attention with dropout on the CPU: the math path's tensors in place of the flash path's.
  if (!seg.attention && z.math_attention) S += math_attention_bytes(z) - flash_attention_bytes(z);
  // The two residual branches' dropout masks.
  if (z.dropout) S += 2 * C * z.mask;
  return S + adapter_delta(z, {seg.norm, seg.attention, seg.norm, seg.mlp});
}

// model.lora, block 0 kept: its input (the frozen embeddings' output) needs no gradient, so norm1 keeps
// neither it nor its statistics, and without an adapter on w_qkv nothing before the attention's output
// needs one either: the attention keeps nothing. Per token, what block 0 keeps less than S.
double first_block_saving(const Sizes& z, const SegmentCounts& seg) {
  if (!z.lora) return 0.0;
  double saving = z.r * z.C + z.f * (z.llama ? 1 : 2);
  if (z.adapter_width[0] == 0 && !seg.attention && !z.math_attention)
    saving += flash_attention_bytes(z) + z.c * z.C;  // qkv (llama's rotated q, k), the lse, the output
  return saving;
}

// T: what a block's MLP backward holds beyond S at its worst point.
// The residual gradient, and the branch's own gradient where it is a tensor apart: under autocast its
// compute-dtype copy for the block's last linear; with dropout the gradient times the mask.
double residual_grad_bytes(const Sizes& z) { return z.r * z.C + (z.c < z.r || z.dropout ? z.c * z.C : 0.0); }

double backward_bytes(const Sizes& z, const SegmentCounts& seg) {
  const double H = z.H, c = z.c, M = z.acc;
  double mlp = 0;
  if (!z.llama) mlp = seg.mlp ? c * H + std::max(M, c) * H : (c + M) * H;
  else mlp = seg.mlp ? std::max((2 * c + M) * H, 5 * c * H) : c * H + std::max(M, c) * H;
  // model.lora: without an adapter on w_out the activation's output was never kept, so making its gradient
  // frees nothing beside da (the plain terms assume the output freed first); with one, da comes in two
  // pieces (the linear's and the adapter's) that autograd sums into a third tensor, which GPT-2's plain
  // moment (da alone) does not hold and LLaMA's (da and the product's two gradients) does.
  if (z.lora && !seg.mlp && (!z.llama || z.adapter_width[3] == 0)) mlp += c * H;
  return residual_grad_bytes(z) + mlp;
}

// With SDPA's math path (CPU dropout), the attention's backward can hold more than the MLP's: at its
// softmax's backward the block still keeps its input x, norm1's output and statistics (unless the norm
// is recomputed), the scaled q and k and the softmax (2C + nh T, fp32), a recomputed attention's inputs
// and output; beside them the residual gradient and two nh x T gradients. Returned relative to S, as T
// is (0 without the math path).
double attention_backward_bytes(const Sizes& z, const SegmentCounts& seg) {
  if (!z.math_attention) return 0;
  const double C = z.C, c = z.c, f = z.f, nhT = z.nh * z.T;
  double held = z.r * C + (seg.norm ? 0.0 : c * C + f * (z.llama ? 1 : 2)) + 2 * C * f + 3 * nhT * f + z.r * C;
  if (seg.attention) held += c * 3 * C + (z.llama ? f * 2 * C : 0.0) + c * C;
  return held - block_bytes(z, seg);
}

// A widened linear's fp32 scratch over the micro-batch's tokens, input width K, output width N.
double widened_scratch(const Sizes& z, double K, double N) {
  return static_cast<double>(
      model::widened_scratch_bytes(static_cast<int64_t>(z.tok), static_cast<int64_t>(K), static_cast<int64_t>(N)));
}

// Wg: the weight gradient of the MLP's output projection (C x H, compute dtype), which autograd holds
// beside da until the gradient is accumulated: the backward moment's one term that does not scale with
// the tokens (the same size as da when B*T = C). The widened linears (model/linear.h) hold it in fp32
// and, while da is computed, the weight rounded into fp32 (4CH each) and their scratch.
double weight_grad_bytes(const Sizes& z) {
  // model.lora: the frozen weight has no gradient (its adapter's are r-sized); the widened path still
  // rounds it into fp32 for da
  if (!z.widened) return z.lora ? 0.0 : z.c * z.C * z.H;
  return (z.lora ? 4 : 8) * z.C * z.H + widened_scratch(z, z.H, z.C);
}

// The MLP's backward moment for the micro-batch: Wg + tok T. On the widened path the output projection's
// fp32 weights and scratch live only while its input gradient da (cH) is computed, beside the residual
// gradient (and llama's recomputed silu, which the recomputed product keeps); the activation's backward
// (the rest of T) comes after them, beside the fp32 weight gradient only where the recomputing node runs
// it before returning (a recomputed MLP).
double mlp_backward_bytes(const Sizes& z, const SegmentCounts& seg) {
  const double T = backward_bytes(z, seg);
  if (!z.widened) return weight_grad_bytes(z) + z.tok * T;
  const double at_da = residual_grad_bytes(z) + z.c * z.H * (z.llama && seg.mlp ? 2 : 1);
  return std::max(weight_grad_bytes(z) + z.tok * at_da, (seg.mlp ? 4 * z.C * z.H : 0.0) + z.tok * T);
}

// The widened path's other backward moment, in bytes for the micro-batch: the MLP's first linear (fc,
// llama's [gate; up]: N = H or 2H outputs) computing its input gradient. The MLP's activations are
// gone by then (S without them), but the linear holds its output gradient (cN), its input gradient (cC)
// beside the residual gradient (rC), and N x C weights twice in fp32 (its weight gradient, the rounded
// weight) with its scratch. 0 off the widened path. Relative to S, as T is.
double widened_fc_backward_bytes(const Sizes& z, const SegmentCounts& seg) {
  if (!z.widened) return 0;
  const double C = z.C, H = z.H, c = z.c, N = z.llama ? 2 * H : H;
  const double mlp_kept = z.llama ? (seg.mlp ? 2 : 4) * c * H : (seg.mlp ? 1 : 2) * c * H;
  return z.tok * (z.r * C + c * N + c * C - mlp_kept) + (z.lora ? 4 : 8) * C * N + widened_scratch(z, C, N);
}

// The fused head and loss (model/fused_loss.h) over the micro-batch's rows: its bytes kept from
// forward to backward (dh, dW) and at its peak in the forward. Its input, the final norm's output, is
// in the compute dtype (c); W is fp32, or the compute-dtype copy with precision.param_dtype.
model::FusedLossBytes loss_bytes(const Scenario& sc, const Sizes& z) {
  const auto N = static_cast<int64_t>(z.tok), C = sc.model.n_embd, V = sc.model.padded_vocab();
  const auto c = static_cast<int64_t>(z.c);
  return model::fused_loss_bytes(N, C, V, model::loss_chunk_rows(N, V, sc.model.loss_chunk), c, c,
                                 z.lowp_params || z.frozen_bf16 ? c : 4, z.widened, true, /*w_grad=*/!z.lora);
}

// E: the head's tensors per token at the start of backward, through the final norm's backward: the
// last block's output, which the norm saves, with its statistics (gpt2 mean and rstd, llama rstd), the
// fused loss's dh (fp32), and the norm's input gradient (r C) made beside them. The loss's dW (4 V C)
// does not scale with the tokens: loss_bytes(...).kept less the dh.
double head_bytes(const Sizes& z) { return 2 * z.r * z.C + z.f * (z.llama ? 1 : 2) + 4 * z.C; }

// The head at the end of the forward, for the micro-batch: the norm's saved input and statistics, its
// output (c C) and the fused loss at its peak.
double head_forward_bytes(const Scenario& sc, const Sizes& z) {
  return z.tok * (z.r * z.C + z.f * (z.llama ? 1 : 2) + z.c * z.C) + static_cast<double>(loss_bytes(sc, z).peak);
}

// What the head holds at the start of backward, for the micro-batch: tok E and dW.
double head_start_bytes(const Scenario& sc, const Sizes& z) {
  return z.tok * head_bytes(z) + static_cast<double>(loss_bytes(sc, z).kept) - z.tok * 4 * z.C;
}

// Sequence parallelism: a block run without saving holds, at its exchanges (model/sequence.cpp),
// beyond its input: the local qkv (c 3C, held to the block's end); llama's rotated q, k (2C) and their
// stack with v (3C) in xq; then the send and receive buffers (3C xq each; the send buffer is freed
// before the gathered copy is made, which then sits beside the receive buffer); after the attention
// the gathered q, k, v and its output with the output exchange's two buffers (xo C each).
double sequence_forward_bytes(const Sizes& z) {
  const double C = z.C, q = z.xq, held = z.c * 3 * C + (z.llama ? q * 5 * C : 0.0);
  return held + std::max(2 * q * 3 * C, q * 3 * C + z.xo * 3 * C);
}

// Sequence parallelism: a block recomputed for its backward (saving, this time) holds at its first
// exchange what it has saved so far (its input, norm1's output and statistics) and the exchange's
// tensors (sequence_forward_bytes); 0 at N = 1. Beside the blocks before it in the segment.
double recompute_exchange_bytes(const Sizes& z) {
  if (!z.sequence) return 0;
  return z.r * z.C + z.c * z.C + z.f * (z.llama ? 1 : 2) + sequence_forward_bytes(z);
}

// checkpointing.exchange keep: what a block's first pass keeps of its exchanges for its recompute, Kx
// per local token: the gathered q, k, v (xq 3C) and the attention output (xo C); 0 at N = 1.
double kept_exchange_bytes(const Sizes& z) { return z.sequence ? z.xq * 3 * z.C + z.xo * z.C : 0.0; }

// F: what the forward holds beyond its saved tensors while a block runs without saving (a
// checkpointed segment's first pass): h, then gpt2 u and GELU (or u and the accumulator), llama u
// 2H, silu and product (or u and its accumulator).
double forward_block_bytes(const Sizes& z) {
  const double C = z.C, H = z.H, c = z.c, f = z.f, M = z.acc;
  const double mlp = z.r * C + (z.llama ? std::max(4 * c * H, 2 * (c + M) * H) : std::max(2 * c * H, (c + M) * H));
  const double exchanges = z.sequence ? sequence_forward_bytes(z) : 0.0;
  if (!z.math_attention) return std::max(mlp, exchanges);
  // SDPA's math path with dropout: qkv (and llama's rotated q, k), the fp32 copies of q, k, v it makes
  // from lower-precision inputs, the scaled q and k, and three nh x T matrices at once (the softmax, the
  // noise, their product).
  const double attention = c * 3 * C + (z.llama ? f * 2 * C : 0.0) + (c < f ? 3 * C * f : 0.0) + 2 * C * f +
                           3 * z.nh * z.T * f;
  return std::max({mlp, attention, exchanges});
}

// Moment H, the LM head's backward (where zero3 gathers the head and zero2's first bucket gradient
// appears, predict/footprint.h): A, and the fused loss's scaled gradients cast to their inputs' dtypes
// where those are not fp32 (dh to the norm output's c; dW to W's compute-dtype copy).
int64_t head_moment(const Scenario& sc, const Sizes& z, double start) {
  const double dh_cast = z.c < z.f ? z.tok * z.c * z.C : 0.0;
  const double dW_cast = z.lowp_params && !z.lora ? z.c * static_cast<double>(sc.model.padded_vocab()) * z.C : 0.0;
  return static_cast<int64_t>(start + dh_cast + dW_cast);
}

// Under autocast the compute-dtype copies of one block's matmul weights (0 in fp32): cached through
// the forward, then kept by the linears that saved them until their backward.
double block_cast_bytes(const Sizes& z) {
  const double c = z.c;
  // the parameters are in the compute dtype, or nothing is cached
  if (c >= 4.0 || z.lowp_params || z.frozen_bf16 || z.widened) return 0;
  return c * (4 * z.C * z.C + (z.llama ? 3 : 2) * z.C * z.H);
}

// Sequence parallelism: what one rank sends in one block's exchanges of one micro-batch, one way
// (the forward's two, or the backward's two inverse ones, whose gradients have the same sizes): (N-1)/N
// of each buffer (its own chunk stays), the q, k, v buffer 3C xq and the output's C xo bytes per local
// token. 0 at N = 1.
double block_exchange_bytes(const Sizes& z, int64_t N) {
  if (N <= 1) return 0;
  const double keep = static_cast<double>(N - 1) / static_cast<double>(N);
  return keep * z.tok * (z.xq * 3 * z.C + z.xo * z.C);
}

// Per micro-batch: every block's forward and backward exchanges, and its forward's once more where
// the block or its attention is recomputed.
int64_t exchange_bytes(const Sizes& z, int64_t N, int64_t n_layer, int64_t recomputed) {
  return static_cast<int64_t>(block_exchange_bytes(z, N) * static_cast<double>(2 * n_layer + recomputed));
}

std::string path_name(const Scenario& sc, device::LowpMatmul lowp) {
  if (sc.precision.compute == config::Dtype::kFp32) return "fp32";
  return sc.on_cuda() ? "cuda" : device::to_string(lowp);
}

// n segments of k blocks, the last of last_size blocks (make_plan's layout), all checkpointed but the
// last when skip_last.
SegmentCounts split_counts(int64_t k, int64_t n, int64_t last_size, bool skip_last) {
  SegmentCounts s;
  s.checkpointed = n - (skip_last ? 1 : 0);
  s.kept_blocks = skip_last ? last_size : 0;
  if (s.checkpointed > 0) s.largest_checkpointed = skip_last ? k : std::max(k, last_size);
  return s;
}

}  // namespace

device::LowpMatmul lowp_matmul_path(const Scenario& sc) {
  if (sc.on_cuda()) return device::LowpMatmul::native;
  const auto& cpu = device::cpu_features();
  // Only CPU tensors widen (model/linear.h): the lazy test device keeps the libraries' path.
  if (sc.device == config::DeviceChoice::kLazy) return cpu.matmul_path(sc.precision.compute);
  return cpu.linear_path(sc.precision.compute);
}

SegmentCounts segment_counts(const recompute::Plan& plan) {
  SegmentCounts s;
  for (const auto& seg : plan.segments) {
    if (seg.checkpointed) {
      ++s.checkpointed;
      s.largest_checkpointed = std::max(s.largest_checkpointed, seg.end - seg.begin);
    } else {
      s.kept_blocks += seg.end - seg.begin;
    }
  }
  s.attention = plan.attention, s.mlp = plan.mlp, s.norm = plan.norm;
  return s;
}

SegmentCounts segment_counts(const config::CheckpointingConfig& ck, int64_t L) {
  const recompute::UniformRule r = recompute::uniform_rule(ck, L);
  if (r.checkpointed) return split_counts(std::min(r.size, L), r.count, r.last, r.skip_last);
  SegmentCounts s;
  s.kept_blocks = L;
  s.attention = (r.parts & recompute::kPartAttention) != 0;
  s.mlp = (r.parts & recompute::kPartMlp) != 0;
  s.norm = (r.parts & recompute::kPartNorm) != 0;
  return s;
}

ActivationEstimate estimate_activation_peak(const Scenario& sc, const SegmentCounts& seg, device::LowpMatmul lowp) {
  const Sizes z = sizes_of(sc, lowp);
  const auto n = static_cast<double>(seg.checkpointed), kept = static_cast<double>(seg.kept_blocks);
  const auto k = static_cast<double>(seg.largest_checkpointed), L = static_cast<double>(sc.model.n_layer);
  ActivationEstimate e;
  e.tokens = sc.local_tokens();
  e.matmul_path = path_name(sc, lowp);
  e.block_bytes = block_bytes(z, seg);
  e.head_bytes = head_bytes(z);
  e.backward_bytes = backward_bytes(z, seg);
  e.forward_bytes = forward_block_bytes(z);
  e.attention_backward_bytes = attention_backward_bytes(z, seg);
  const double S = e.block_bytes, fC = z.r * z.C, tok = static_cast<double>(e.tokens);
  e.embed_mask_bytes = static_cast<int64_t>(tok * z.embed_mask * z.C);
  e.packing_bytes = static_cast<int64_t>(z.packing);
  const auto always = static_cast<double>(e.embed_mask_bytes) + z.packing;
  const double Wb = block_cast_bytes(z);
  const double head_end = head_forward_bytes(sc, z), head_start = head_start_bytes(sc, z);
  e.loss_bytes = loss_bytes(sc, z).peak;
  if (sc.model.tie_embeddings && !z.lora) e.tied_grad_bytes = 4 * sc.model.padded_vocab() * sc.model.n_embd;
  const auto tied = static_cast<double>(e.tied_grad_bytes);
  // Autocast caches the blocks' weight copies through the forward; model.lora's frozen weights are not
  // cached (no gradient): only the kept blocks' linears keep theirs.
  const double cached = z.lora ? kept * Wb : L * Wb;
  e.weight_cast_bytes = static_cast<int64_t>(cached);
  // model.lora: block 0 keeps less where it is kept (no checkpointed segment: none, selective).
  const double kept_tok = tok * (fC * n + S * kept) - (n == 0 && kept > 0 ? tok * first_block_saving(z, seg) : 0.0);
  // F: end of the forward (the head, before its gradients) or a checkpointed block's first pass,
  // with every block's weight copies still cached.
  e.moment_f = always + cached + std::max(kept_tok + head_end, n > 0 ? tok * (fC * n + e.forward_bytes) : 0.0);
  e.moment_a = always + kept * Wb + head_start + kept_tok;
  // A block's backward: the MLP's moment (T and Wg), or the math attention's where it holds more.
  const double backward =
      std::max({mlp_backward_bytes(z, seg), tok * e.attention_backward_bytes, widened_fc_backward_bytes(z, seg)});
  if (seg.kept_blocks > 0) e.moment_d = always + kept * Wb + tied + backward + kept_tok;
  // B also holds the recomputed segment's output: its backward starts from it.
  if (seg.checkpointed > 0) {
    e.moment_b = always + k * Wb + tied + backward + tok * (fC * n + S * k);
    // Under sequence parallelism also the last block's exchange in the recompute, the k - 1 before it kept.
    const double exchange = tok * (fC * n + S * (k - 1) + recompute_exchange_bytes(z));
    if (z.sequence) e.moment_b = std::max(e.moment_b, always + k * Wb + tied + exchange);
  }
  e.peak_bytes = static_cast<int64_t>(std::max({e.moment_f, e.moment_a, e.moment_d, e.moment_b}));
  const int64_t recomputed =
      seg.attention ? sc.model.n_layer : (seg.checkpointed > 0 ? sc.model.n_layer - seg.kept_blocks : 0);
  e.all_to_all_bytes = exchange_bytes(z, sc.sequence, sc.model.n_layer, recomputed);
  // The moments a sharded engine's buffers meet (predict/footprint.h): F's two parts (the end of the
  // forward; a block's forward: a first pass, or a kept block's end, with what the blocks before it
  // keep), A, H and the blocks' backward.
  const double weights_now = always + cached;
  e.forward_end_peak_bytes = static_cast<int64_t>(weights_now + kept_tok + head_end);
  e.forward_block_peak_bytes = static_cast<int64_t>(
      weights_now + std::max(n > 0 ? tok * (fC * n + e.forward_bytes) : 0.0, kept_tok));
  e.start_peak_bytes = static_cast<int64_t>(e.moment_a);
  e.head_backward_peak_bytes = head_moment(sc, z, e.moment_a);
  e.backward_peak_bytes = static_cast<int64_t>(std::max(e.moment_d, e.moment_b));
  return e;
}

ChainModel chain_model(const Scenario& sc, device::LowpMatmul lowp) {
  const auto L = sc.model.n_layer;
  const auto tok = static_cast<double>(sc.local_tokens());
  ChainModel m;
  for (int64_t layer = 0; layer < L; ++layer) {  // the blocks differ only by model.layer_mlp_hidden
    const Sizes zl = sizes_of(sc, lowp, layer);
    std::array<double, recompute::kPartSets> kept{}, backward{};
    for (int b = 0; b < recompute::kPartSets; ++b) {
      SegmentCounts parts;
      parts.attention = (b & recompute::kPartAttention) != 0;
      parts.mlp = (b & recompute::kPartMlp) != 0;
      parts.norm = (b & recompute::kPartNorm) != 0;
      kept[static_cast<size_t>(b)] = tok * block_bytes(zl, parts);
      backward[static_cast<size_t>(b)] =
          std::max({mlp_backward_bytes(zl, parts), tok * attention_backward_bytes(zl, parts),
                    widened_fc_backward_bytes(zl, parts)});
    }
    if (layer == 0)  // model.lora: the first block's input needs no gradient
      for (int b = 0; b < recompute::kPartSets; ++b) {
        SegmentCounts parts;
        parts.attention = (b & recompute::kPartAttention) != 0;
        kept[static_cast<size_t>(b)] -= tok * first_block_saving(zl, parts);
      }
    m.kept.push_back(kept);
    m.backward.push_back(backward);
    m.weights.push_back(block_cast_bytes(zl));
    m.forward.push_back(tok * forward_block_bytes(zl));
    m.recompute_exchange.push_back(tok * recompute_exchange_bytes(zl));
    m.exchange_kept.push_back(tok * kept_exchange_bytes(zl));
  }
  const Sizes z = sizes_of(sc, lowp);
  m.input = tok * z.r * z.C;
  m.head = head_start_bytes(sc, z);
  m.head_forward = head_forward_bytes(sc, z);
  if (sc.model.tie_embeddings && !z.lora)
    m.tied_grad = 4.0 * static_cast<double>(sc.model.padded_vocab() * sc.model.n_embd);
  m.weights_cached = !z.lora;
  m.held = tok * z.embed_mask * z.C + z.packing;
  m.offload_inputs = sc.placement.offload.activations && !sc.checkpointing.mode.solved();  // budget: per segment
  return m;
}

namespace {

// Kx of block b where the plan keeps its exchanges (its recompute takes them), else 0.
double kept_exchange(const ChainModel& m, const recompute::Plan& plan, int64_t b) {
  const auto i = static_cast<size_t>(b);
  return i < m.exchange_kept.size() && plan.keeps_exchange(b) ? m.exchange_kept[i] : 0.0;
}

// Rx of block b where its recompute redoes its exchanges, else 0.
double redone_exchange(const ChainModel& m, const recompute::Plan& plan, int64_t b) {
  const auto i = static_cast<size_t>(b);
  return i < m.recompute_exchange.size() && !plan.keeps_exchange(b) ? m.recompute_exchange[i] : 0.0;
}

// Kx of a kept block that recomputes its attention and keeps its exchanges (else 0).
double kept_block_exchange(const ChainModel& m, const recompute::Plan& plan, int64_t b) {
  return (plan.parts_of(b) & recompute::kPartAttention) != 0 ? kept_exchange(m, plan, b) : 0.0;
}

// Moments F (segment first passes and the end of the forward), returned, and in `phases` (less what
// every moment holds) the forward's parts and A; `held` ends as what the forward keeps for backward,
// `kept_weights` as the kept blocks' weight copies.
double forward_moments(const ChainModel& m, const recompute::Plan& plan, double& held, double& kept_weights,
                       double& host, PhasePeaks& phases) {
  double cached = 0, passes = 0, blocks = 0;  // first passes; any block's forward (a bound, for phases)
  for (double w : m.weights) cached += w;
  held = kept_weights = host = 0;
  // the weight copies alive: every block's (autocast's cache), or (model.lora) the kept blocks' so far
  const auto all_weights = [&] { return m.weights_cached ? cached : kept_weights; };
  for (const auto& seg : plan.segments) {
    if (seg.checkpointed) {
      held += m.input;
      double kx = 0;  // the exchanges kept by the segment's blocks so far
      for (int64_t b = seg.begin; b < seg.end; ++b) {
        passes = std::max(passes, all_weights() + held + kx + m.forward[static_cast<size_t>(b)]);
        kx += kept_exchange(m, plan, b);
      }
      held += kx;  // on the device, offloaded input or not
      // to the host once the first pass is over
      if (m.offload_inputs || seg.offloaded) held -= m.input, host += m.input;
      continue;
    }
    for (int64_t b = seg.begin; b < seg.end; ++b) {  // a kept block's forward, ended: what it keeps
      held += m.kept[static_cast<size_t>(b)][plan.parts_of(b)] + kept_block_exchange(m, plan, b);
      kept_weights += m.weights[static_cast<size_t>(b)];
      blocks = std::max(blocks, all_weights() + held);
    }
  }
  phases.forward_end = all_weights() + held + m.head_forward;
  phases.forward_block = std::max(passes, blocks);
  phases.start = kept_weights + held + m.head;
  return std::max(passes, phases.forward_end);
}

}  // namespace

double chain_peak(const ChainModel& m, const recompute::Plan& plan, double* host, PhasePeaks* phases) {
  double held = 0, kept_weights = 0, offloaded = 0;
  bool prefetched = false;  // offload: the input of the segment whose backward comes next is on the device
  PhasePeaks ph;
  const double forward = forward_moments(m, plan, held, kept_weights, offloaded, ph);
  double peak = 0;  // the blocks' backward (D, B)
  if (host) *host = offloaded;
  for (auto seg = plan.segments.rbegin(); seg != plan.segments.rend(); ++seg) {
    if (seg->checkpointed) {  // B: what comes before the segment (kept blocks' weight copies too), its input
      // its input restored (counted below); the previous checkpointed segment's prefetched
      if (m.offload_inputs || seg->offloaded) {
        const bool earlier = std::any_of(
            plan.segments.begin(), plan.segments.begin() + (plan.segments.rend() - seg - 1),
            [&](const recompute::Segment& s) { return s.checkpointed && (m.offload_inputs || s.offloaded); });
        if (prefetched) held -= m.input;
        prefetched = earlier;
        if (earlier) held += m.input;
      } else {
        held -= m.input;
      }
      double saved = 0, weights = 0, worst_backward = 0, worst_exchange = 0;
      for (int64_t b = seg->begin; b < seg->end; ++b) {
        held -= kept_exchange(m, plan, b);  // kept exchanges: the recompute's own tensors now, in `saved`
        const double exchange = redone_exchange(m, plan, b);
        worst_exchange = std::max(worst_exchange, saved + exchange);  // the blocks before b kept
        saved += m.kept[static_cast<size_t>(b)][0];
        weights += m.weights[static_cast<size_t>(b)];
        worst_backward = std::max(worst_backward, m.backward[static_cast<size_t>(b)][0]);
      }
      peak = std::max(peak, kept_weights + weights + m.tied_grad + held + m.input +
                                std::max(saved + worst_backward, worst_exchange));
      continue;
    }
    for (int64_t b = seg->end - 1; b >= seg->begin; --b) {  // D: the block and every unit before it
      const auto i = static_cast<size_t>(b);
      const auto parts = plan.parts_of(b);
      peak = std::max(peak, kept_weights + m.tied_grad + held + m.backward[i][parts]);
      held -= m.kept[i][parts] + kept_block_exchange(m, plan, b);
      kept_weights -= m.weights[i];
    }
  }
  // what every moment holds besides
  if (phases) *phases = {m.held + ph.forward_end, m.held + ph.forward_block, m.held + ph.start, m.held + peak};
  return m.held + std::max({forward, ph.start, peak});
}

namespace {

// Whether some block's recompute keeps its exchanges under sequence parallelism (the walk's terms).
bool keeps_exchanges(const Scenario& sc, const recompute::Plan& plan) {
  if (sc.sequence <= 1) return false;
  for (int64_t b = 0; b < static_cast<int64_t>(plan.exchange_kept.size()); ++b)
    if (plan.keeps_exchange(b) && plan.recomputes_attention(b)) return true;
  return false;
}

}  // namespace

ActivationEstimate estimate_activation_peak(const Scenario& sc, const recompute::Plan& plan) {
  const auto lowp = lowp_matmul_path(sc);
  if (!plan.mode.solved() && sc.shape().uniform() && !sc.placement.offload.activations && !keeps_exchanges(sc, plan))
    return estimate_activation_peak(sc, segment_counts(plan), lowp);
  // Blocks that differ (a budget schedule, or model.layer_mlp_hidden), offloaded inputs, or kept exchanges: the
  // per-token terms of block 0 with no parts recomputed; the moments by walking the plan block by block.
  ActivationEstimate e = estimate_activation_peak(sc, SegmentCounts{}, lowp);
  e.moment_f = e.moment_a = e.moment_d = e.moment_b = 0;
  double host = 0;
  PhasePeaks phases;
  e.peak_bytes = static_cast<int64_t>(chain_peak(chain_model(sc, lowp), plan, &host, &phases));
  e.forward_end_peak_bytes = static_cast<int64_t>(phases.forward_end);
  e.forward_block_peak_bytes = static_cast<int64_t>(phases.forward_block);
  e.start_peak_bytes = static_cast<int64_t>(phases.start);
  e.head_backward_peak_bytes = head_moment(sc, sizes_of(sc, lowp), phases.start);
  e.backward_peak_bytes = static_cast<int64_t>(phases.backward);
  e.host_bytes = static_cast<int64_t>(host);
  int64_t recomputed = 0;  // the blocks whose recompute redoes their exchanges
  for (const auto& seg : plan.segments)
    for (int64_t b = seg.begin; b < seg.end; ++b)
      if ((seg.checkpointed || (plan.parts_of(b) & recompute::kPartAttention) != 0) && !plan.keeps_exchange(b))
        ++recomputed;
  e.all_to_all_bytes = exchange_bytes(sizes_of(sc, lowp), sc.sequence, sc.model.n_layer, recomputed);
  return e;
}

ActivationEstimate estimate_activation_peak(const Scenario& sc) {
  // The recipe's plan keeps its recomputes' exchanges (checkpointing.exchange keep, and some attention recomputed).
  const auto seg = segment_counts(sc.checkpointing, sc.model.n_layer);
  const bool keeps = sc.sequence > 1 && sc.checkpointing.exchange.keeps() && (seg.checkpointed > 0 || seg.attention);
  if (!sc.shape().uniform() || sc.placement.offload.activations || keeps)
    return estimate_activation_peak(sc, recompute::make_plan(sc.checkpointing, sc.model.n_layer));
  return estimate_activation_peak(sc, seg, lowp_matmul_path(sc));
}

}  // namespace sl::memory
