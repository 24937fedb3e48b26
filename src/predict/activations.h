// Analytic activation-memory model for this GPT under a recompute plan (SDPA's flash path, or on the
// CPU in fp32 the fused attention, which keeps the same tensors; dropout's terms below). It predicts
// what the trainer reports as activation_peak_bytes (peak allocated bytes minus parameters, gradients
// and optimizer states) for one micro-batch.
//
// Written below in bytes per token: element counts times f = 4 (fp32) or c, the compute dtype's size
// (fp32 4, bf16/fp16 2).
// Under autocast the residual stream (x, h), the norm statistics and the log-sum-exp stay fp32 (f)
// while every other tensor kept for backward (linear inputs and outputs, attention, MLP) takes c.
//
// One block keeps S (its input included):
//   gpt2:  f(2C + 4 + nh) + c(6C + 2H)   x, h; 4 LayerNorm statistics; nh log-sum-exp |
//                                        norm1 out, qkv 3C, attention out, norm2 out, u H, GELU H
//   llama: f(2C + 2 + nh) + c(9C + 4H)   x, h; 2 RMSNorm rstd; lse | norm1 out, qkv 3C, rotated q, k
//                                        2C, attention out 2C (SDPA's own output, which it keeps, and
//                                        the contiguous copy the projection keeps: the rotated q is
//                                        contiguous, so SDPA's output is not), norm2 out, SwiGLU: u 2H,
//                                        silu H, product H. On the CPU in fp32 the fused attention
//                                        (model/attention.h) writes its output contiguous: C, so 8C + 4H.
// Selective recompute removes: norm: both norm outputs (2C) and the statistics; mlp: the activation
//   output (gpt2 H, llama silu + product 2H); attention: the attention output (gpt2 C, llama 2C, or
//   C on the fused CPU path) and
//   the log-sum-exp, but llama's recomputed attention keeps its inputs q, k as the fp32 tensors RoPE
//   made (bf16 q times the fp32 table): + (f - c)2C.
// Around the blocks, at the start of backward: E = fC + 2cC + (2f + c)V (last block output, final norm
//   output, the logits, log-softmax output and the logits' gradients); in fp32 the final norm's output
//   is one tensor, cC.
// H, the LM head's backward once the logits' gradient exists: A less the log-softmax output and its
//   gradient (2fV per token) and less Wx (below), plus the head's weight gradient: 4VC, under autocast
//   + cVC (the compute-dtype product it is cast from), on the widened path 8VC + its scratch. It counts
//   only beside a sharded engine's buffers (predict/footprint.h).
// While a block's MLP runs backward it holds T beyond S: the residual gradient fC, under autocast its
//   compute-dtype copy cC, and (M = the fp32 accumulator of a matmul output, below; 0 on most paths)
//     gpt2  plain: cH + MH (the activation's gradient da, while its matmul runs)
//           mlp recomputed: cH + max(MH, cH) (da and the input gradient of the recomputed GELU)
//     llama plain: cH + max(MH, cH) (da; at the product's backward da, its two gradients, less the product)
//           mlp recomputed: max(2cH + MH, 5cH) (da, recomputed silu; then the product's and silu's
//           gradients and their concatenation, 2H, while da is still held)
// Beside T, at that moment, autograd holds Wg = cCH, the output projection's weight gradient (da and dW
//   of one linear's backward are alive together), a term that does not scale with tok.
// A block run without saving (a checkpointed segment's first pass) holds Fb beyond its input:
//   fC (h) + gpt2 max(2cH, (c + M)H) (u, GELU) | llama max(4cH, 2(c + M)H) (u 2H, silu, product).
// Under autocast, W = one block's compute-dtype weight copies, c(4C^2 + 2CH) gpt2 | c(4C^2 + 3CH)
// llama, and Wh = cVC the LM head's: autocast caches them through the forward; afterwards they live
// only where a linear saved them (kept blocks, the head, a recomputed segment). With n checkpointed
// segments, K kept blocks, k blocks in the largest checkpointed segment, L blocks, tok = B*T tokens,
// the peak is the largest of four moments (D only when K > 0, B only when n > 0):
//   F  end of the forward:  L*W + Wh + tok*max(fC*n + S*K + E - cC,  fC*n + Fb)
//   A  start of backward:   K*W + Wh + tok*(E + fC*n + S*K)
//   D  last kept block's backward:            K*W + G + Wg + tok*(fC*n + S*K + T)
//   B  recompute of the largest segment and its backward (its recomputed output fC included):
//                                              k*W + G + Wg + tok*(fC*n + S*k + T)
// where G = 4VC is the LM head's part of a tied embedding's gradient (autograd holds it until the
// embedding's part arrives; 0 when untied).
//
// Dropout (model.dropout > 0) adds, per token:
//   Me, in all four moments: the embeddings' dropout mask, C times 1 byte on CUDA (its fused kernel's
//     bool mask) or r on the CPU (the noise tensor it multiplies by, in its input's dtype);
//   to S: the two residual branches' masks, 2C times 1 (CUDA) or c (CPU);
//   to T: the branch's gradient times the mask, cC, a tensor apart from the residual gradient (under
//     autocast it takes the place of the compute-dtype copy, so only fp32 grows);
//   on the CPU, attention dropout: neither the fused kernel nor SDPA's CPU flash kernel takes it, so
//     SDPA's math path runs, in fp32 whatever its inputs. S keeps 3Cf + 3 nh T f (scaled q and k, a
//     copy of v; the softmax, the noise, their product) instead of qkv, llama's rotated q, k, the
//     log-sum-exp and llama's second output copy (a recomputed attention keeps its inputs, as without
//     dropout). Its backward holds Ta (at the softmax's backward: x, norm1's output and statistics, the
//     scaled q, k and the softmax, a recomputed attention's inputs and output, the residual gradient
//     and two nh x T gradients, less S), taken in D and B where it exceeds Wg + T; a block run
//     without saving holds the larger of Fb and Fa = cC(3) + the fp32 copies + 2Cf + 3 nh T f.
//   CUDA's flash and memory-efficient kernels take dropout without keeping a mask: only the masks change.
//
// The CPU path (device/cpu_features.h) sets M. bf16 matmuls on CPU take one of three kernels:
//   native   (oneDNN brgemm with avx512_bf16 / AMX / avx_ne_convert): M = 0 (small per-thread blocks)
//   emulated (oneDNN gemm:jit:bf16 on AVX-512 without bf16 instructions, e.g. a Cascade Lake Xeon)
//            under SUBLINEAR_ATEN_KERNELS=1:
//            M = 4 bytes per output element: each matmul fills an fp32 accumulator the size of its
//            output, through LibTorch's allocator, before converting it to bf16
//   aten     (AVX2 only, or oneDNN capped below AVX512_CORE) under SUBLINEAR_ATEN_KERNELS=1: M = 0
//   widened  the aten and emulated CPUs otherwise: the model's linears widen to fp32 GEMMs (model/linear.h). No
//            weight copies (W = Wh = 0); the fp32 weight gradient and rounded weight (4CH each) and
//            the scratch of the linear whose input gradient is computed replace Wg, beside da only
//            (the activation's backward comes after them); and the MLP's first linear (N = H, llama
//            2H) makes a moment of its own: S less the MLP's activations, plus the residual gradient,
//            its output and input gradients (cN + cC) and 8NC + scratch. The LM head's backward adds
//            Wx = max(0, 8VC + its scratch - 2fV tok) to moment A (its fp32 weight gradient and rounded
//            weight, once the loss's fp32 tensors are freed).
// Sequence parallelism (parallel.sequence = N > 1, model/sequence.h): each rank holds T/N positions of
// every sequence, so tok = B*T/N above, and every position-wise term (norms, linears, MLP, residual
// stream, the head and the fused loss, the batch) is per local token as written. Attention gathers the
// whole sequence for nh/N heads: (B, T, 3C/N), (B, T, C/N) and (B, nh/N, T) are 3C, C and nh per local
// token. Let xq be the bytes of an exchanged q, k, v element and xo of an exchanged attention output:
// c, except LLaMA under a low-precision compute dtype, whose stack of RoPE's fp32 q, k with v is fp32
// (xq = f) and, on the CPU, whose fused fp32 attention writes fp32 (xo = f). Then:
//   S, an attention kept for backward: the gathered q, k, v (xq 3C), the attention's output (xo C) and
//     the exchanged-back output the projection keeps (cC) replace qkv, llama's rotated q, k and the
//     unsharded output(s): gpt2 f(2C + 4 + nh) + c(7C + 2H) | llama f(2C + 2 + nh) + c(7C + 4H) (c = xq = xo).
//     A recomputed attention (selective) keeps its inputs, as at N = 1: S is the N = 1 one.
//   Fb, a block run without saving, is the larger of its MLP term and its exchanges: the local qkv
//     (c 3C, held to the block's end), llama's rotated q, k and their stack with v (xq 5C), and the
//     larger of the send and receive buffers (2 xq 3C) or the receive buffer, the gathered q, k, v
//     and the output exchange's buffers (xq 3C + xo 3C).
//   B also takes the recompute's exchanges: the largest segment's k - 1 blocks kept, the last one's
//     input, norm1's output and statistics, and its exchange's tensors as in Fb (Rx per token):
//     k*W + G + tok*(fC*n + S*(k-1) + Rx), where that exceeds the backward's B (only with a narrow MLP).
//   T is unchanged: a block's attention backward (its exchanges' buffers with the residual gradient and
//     the gathered q, k, v's gradient, the MLP's tensors freed) holds less than its MLP's.
//   Sent per rank per micro-batch (all_to_all_bytes): (N-1)/N tok (3C xq + C xo) per exchange pair, two
//     pairs per block (forward, and backward's inverse), and one more per recomputed block or attention
//     whose recompute redoes its exchanges.
//   checkpointing.exchange keep (recompute/plan.h): a block whose recompute keeps its exchanges
//     holds from its first pass what they received, Kx = xq 3C + xo C per local token (the gathered q,
//     k, v and the attention output), and its recompute communicates nothing. In a checkpointed
//     segment the first pass of block b also holds the Kx of the segment's blocks before b; after the
//     segment the forward holds its input and its blocks' Kx (offloaded: the Kx alone, which stays on
//     the device). At the segment's recompute and backward (B) its Kx become the recomputed blocks'
//     own tensors, counted in their S, and the recompute makes no exchange buffers (no Rx). A kept
//     block with selective attention holds its Kx beside S from its forward through its backward (D).
//     The O(1) moments above do not take Kx: a plan that keeps at N > 1 is walked (chain_peak).
// LoRA (model.lora): the base's weights are frozen, so a linear keeps its input only for its adapter, whose
//   own first product (d A^T, R = rank times its pieces per token) is kept too (in c); with the adapter's
//   dropout its mask (CUDA: 1 byte, CPU: its noise in the input's dtype) per input element. Per projection
//   whose pair is not recomputed: untargeted, S loses its linear input (norm1's and norm2's outputs c C,
//   LLaMA's contiguous attention output c C on SDPA's path, the activation's output c H); targeted, S gains
//   c R (+ the mask). No weight gradient: Wg = 0 (widened: the rounded fp32 weight stays, 4CH), the fused
//   loss makes no dW (nor its d^T h product), G = 0, and autocast caches no frozen weight copy (moment F
//   holds the kept blocks' W only). Block 0, when kept: its input needs no gradient, so norm1 keeps neither
//   it (r C) nor its statistics, and without an adapter on w_qkv the attention keeps nothing. With
//   base_dtype bf16 the frozen matrices are bf16 already: W = Wh = 0 (no autocast copies).
// fp16 takes oneDNN only with native fp16 instructions (else aten). fp32 runs and CUDA devices take
// M = 0 (CUDA is not measured here). ATen's own dispatch level (AVX2 / AVX512) changes no memory.
// Measured against it: tests/test_planner.cpp, README "Activation memory".
#pragma once
#include <cstdint>
#include <array>
#include <string>
#include <vector>

#include "recompute/plan.h"
#include "config/config.h"
#include "device/cpu_features.h"
#include "predict/scenario.h"

namespace sl::memory {

// What the model needs of a checkpointing plan.
struct SegmentCounts {
  int64_t checkpointed = 0;           // checkpointed segments
  int64_t kept_blocks = 0;            // blocks outside them (activations kept)
  int64_t largest_checkpointed = 0;   // blocks in the largest checkpointed segment
  bool attention = false, mlp = false, norm = false;  // selective parts
  bool operator==(const SegmentCounts&) const = default;
};
SegmentCounts segment_counts(const recompute::Plan& plan);
// The same from the recipe in O(1) work (no segment list): what make_plan would give.
SegmentCounts segment_counts(const config::CheckpointingConfig& ck, int64_t n_layer);

struct ActivationEstimate {
  int64_t tokens = 0;                // B * T / N, this rank's tokens (N = parallel.sequence)
  std::string matmul_path;           // "fp32", "cuda", or the CPU's device::LowpMatmul path
  double block_bytes = 0;            // S per token, after selective savings
  double head_bytes = 0;             // E per token
  int64_t loss_bytes = 0;            // the fused head and loss at its forward peak (model/fused_loss.h)
  double backward_bytes = 0;         // T per token
  double forward_bytes = 0;          // F_block per token
  double attention_backward_bytes = 0;  // Ta per token (0 off SDPA's math path)
  double moment_f = 0, moment_a = 0, moment_d = 0, moment_b = 0;  // whole moments, in bytes
  int64_t embed_mask_bytes = 0;      // Me, in every moment
  int64_t packing_bytes = 0;         // packed rows' mask, positions (and LLaMA's tables), in every moment
  int64_t tied_grad_bytes = 0;       // in moments D and B
  int64_t weight_cast_bytes = 0;     // autocast's low-precision copies of the blocks' matmul weights
  int64_t peak_bytes = 0;            // max(F, A, D, B)
  // The moments a sharded engine holds different buffers beside (predict/footprint.h), each the largest
  // of its kind: the end of the forward (F's first part); a block's forward (a checkpointed segment's
  // first pass, F's second part, or a kept block's end, with what it and the blocks before keep); the start of
  // backward (A); the LM head's backward (H, above); the blocks' backward (D, B). The kept blocks'
  // forward and H are not in peak_bytes: without sharding A bounds them wherever the activations
  // outweigh the head's weight gradient (the head-heavy known gap, docs/memory.md).
  int64_t forward_end_peak_bytes = 0, forward_block_peak_bytes = 0, start_peak_bytes = 0;
  int64_t head_backward_peak_bytes = 0, backward_peak_bytes = 0;
  // offload.activations: the checkpointed inputs in host memory at the end of the forward
  int64_t host_bytes = 0;
  // parallel.sequence = N > 1: the bytes this rank sends in its sequence group's all-to-alls for one
  // micro-batch (forward, backward and recomputes; "Sequence parallelism" above). 0 at N = 1.
  int64_t all_to_all_bytes = 0;
};

// The recipe's device and precision decide the matmul path (CPU: cpu_features()).
ActivationEstimate estimate_activation_peak(const Scenario& sc, const recompute::Plan& plan);
// O(1) in n_layer; O(n_layer) for a model whose blocks differ (model.layer_mlp_hidden), whose peak is
// always the walk's (chain_peak) since the formula's moments assume one block shape.
ActivationEstimate estimate_activation_peak(const Scenario& sc);
// With the CPU's low-precision matmul path given (`lowp` is ignored for fp32).
ActivationEstimate estimate_activation_peak(const Scenario& sc, const SegmentCounts& seg, device::LowpMatmul lowp);

// The same terms per block, for plans or models whose blocks differ (checkpointing.mode: budget,
// model.layer_mlp_hidden: H is the block's own), in bytes of one
// micro-batch (tok times the per-token sizes above). Index b of kept/backward is a bit set of
// selective parts (recompute::kPartAttention | kPartMlp | kPartNorm), 0 = plain.
struct ChainModel {
  std::vector<std::array<double, recompute::kPartSets>> kept;      // S of block i with parts b
  std::vector<std::array<double, recompute::kPartSets>> backward;  // T of block i with parts b, and its Wg
  std::vector<double> weights;  // W of block i (autocast's copies; 0 in fp32)
  std::vector<double> forward;  // Fb of block i: the block run without saving, beyond its input
  // Rx of block i: its exchange in a recompute (0 at N = 1; empty: 0 for every block)
  std::vector<double> recompute_exchange;
  // Kx of block i: what its first pass keeps for a recompute that keeps its exchanges (0 at N = 1; empty: 0)
  std::vector<double> exchange_kept;
  double input = 0;        // fC: what a checkpointed segment keeps (its input)
  double head = 0;          // the head at the start of backward: tok E and the fused loss's dW
  double head_forward = 0;  // the head at the end of the forward: E's input, the norm's output, the fused loss's peak
  double tied_grad = 0;    // G
  double held = 0;         // Me: held at every moment (the embeddings' dropout mask)
  // offload.activations: a checkpointed segment's input leaves the device after its first pass and
  // comes back for its backward, with the previous segment's prefetched (recompute/checkpoint.h).
  // Every checkpointed segment's (the uniform modes); a budget schedule marks its segments itself.
  bool offload_inputs = false;
  // Autocast's weight copies are cached through the forward (every block's `weights` held); model.lora's
  // frozen weights are not: only the kept blocks' stay, kept by their linears.
  bool weights_cached = true;
};
ChainModel chain_model(const Scenario& sc, device::LowpMatmul lowp);
// The activation peak of a plan by walking it: the forward (every checkpointed segment's first pass
// and the end, moment F; the start of backward, A), then the backward from the last unit to the first
// (each kept block's backward, D, with what the blocks before it keep; each checkpointed segment's
// recompute and backward, B, with the segment inputs and kept blocks before it). For the uniform plans
// it gives estimate_activation_peak's moments, except B, which it takes per segment (the formula's B
// uses the largest segment with every segment input: at most n*fC*tok more). With offload_inputs, the
// inputs count only while their segment runs (first pass; recompute and backward, with the previous
// checkpointed segment's input prefetched beside them); `host` gets what the forward offloaded.
// Blocks whose recompute keeps its exchanges (plan.keeps_exchange) hold their Kx as "Sequence
// parallelism" above says.
// Recipes with offload.activations always take the walk. `phases` gets the largest moment of each kind
// (ActivationEstimate's forward end, block forward, start and backward peaks).
struct PhasePeaks {
  double forward_end = 0, forward_block = 0, start = 0, backward = 0;
};
double chain_peak(const ChainModel& m, const recompute::Plan& plan, double* host = nullptr,
                  PhasePeaks* phases = nullptr);

// The path a recipe's low-precision matmuls take: on CPU cpu_features().linear_path (the libraries' path,
// or widened where that is ATen's gemm or oneDNN's emulated one), on CUDA native.
device::LowpMatmul lowp_matmul_path(const Scenario& sc);

}  // namespace sl::memory
