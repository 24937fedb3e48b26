// The LM head and the cross-entropy loss as one autograd node, a chunk of positions at a time, so the
// logits of the whole micro-batch never exist (the classifier of GPT-2 in fp32 would be 4 V = 201 KB
// per token: 1.6 GB for 8 x 1024 tokens).
//
// loss = (1/N) sum_i [ logsumexp_v(z_iv) - z_i,t_i ],  z = h W^T   (h: N x C, W: V' x C, t: N targets)
//
// over the rows whose target is not kIgnoreTarget (-100, transformers' label for it); the divisor is N,
// every row, so that a micro-batch's loss times N is its summed loss (train/step.cpp divides the step's
// sum by its trained targets). Without ignored targets: the mean.
//
// Forward, for each chunk of rows: the chunk's logits in the compute dtype (the autocast dtype where
// autocast is on for the device, else W's), widened to fp32; only the first `valid_vocab` columns
// enter the loss (the rest, a padded vocabulary's rows, are set to -inf). When gradients are wanted
// the same pass computes them, as the composition's backward would from those logits:
//   d = softmax(z) - onehot(t)           fp32, in place of the logits, then rounded to the compute dtype
//   dh (chunk rows) = d W                 compute dtype, kept in fp32
//   dW += d^T h                           accumulated in fp32
// and backward only scales them by dL/dloss / N. So the node keeps dh (4 N C bytes) and dW (4 V' C)
// between forward and backward instead of the logits, and the head's matmuls run once each.
//
// Numerics against ATen's composition (cross_entropy_loss of the linear's logits, under the same
// autocast): the same roundings of h, W, the logits and d to the compute dtype, fp32 softmax; sums
// differ in order (dW over chunks, the loss over rows) and d is rounded before it is scaled by 1/N
// (exact when N is a power of two). In fp32 the difference is summation order only.
//
// Memory (the planner's model, predict/activations.cpp, "the fused loss"): while a chunk runs, its
// logits in the compute dtype, their fp32 copy (the same tensor in fp32) and d in the compute dtype
// (rows x V' each); beside them h and W rounded to the compute dtype when they are not in it (W not
// on the CPU's widened path, model/linear.h, which rounds it itself), dh, dW and one chunk's
// product d^T h in the compute dtype before it is added to dW (fp32 runs add in place).
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace sl::model {

// A target the loss skips: transformers' label for it (data/loader.h's kIgnoreTarget, the same value).
constexpr int64_t kIgnoreTarget = -100;

// A chunk's fp32 logits are at most this many bytes under the automatic rule (model.loss_chunk: 0).
constexpr int64_t kLossChunkBytes = int64_t{64} << 20;

// Rows (positions) per chunk: `requested` when > 0, else as many as keep 4 V' bytes a row within
// kLossChunkBytes, in multiples of 8 and at least 8; never more than `rows`.
constexpr int64_t loss_chunk_rows(int64_t rows, int64_t vocab, int64_t requested) {
  int64_t r = requested;
  if (r <= 0) {
    r = kLossChunkBytes / (4 * vocab) / 8 * 8;
    if (r < 8) r = 8;
  }
  return r < rows ? r : rows;
}

// What the fused loss allocates beyond its inputs, in bytes (the planner's model of it,
// predict/activations.cpp, and what tests/test_loss.cpp measures): N rows of width C, V' vocabulary rows,
// chunks of `chunk` rows, compute dtype of c bytes (2 or 4), h and W of h_bytes and w_bytes per element,
// `widened` the CPU's widened path (model/linear.h).
struct FusedLossBytes {
  int64_t kept = 0;  // from forward to backward: the loss (fp32, 0-d), dh and dW in fp32 (without gradients: the loss)
  int64_t peak = 0;  // the forward's largest moment, kept included
};
constexpr int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// A chunk's largest moment (m rows): the logits and their fp32 copy z, the loss's row vectors, then d
// and a product beside it.
//   Every path: z (4 m V') beside the loss's row vectors at their most (24 m: the target logits, the
//         row maxima, the sums, the log and two partial results; then only the sums, 4 m, stay).
//   fp32: the logits are z (the softmax and d in place), then dh's rows (4 m C) beside them; dW grows
//         in place.
//   native compute dtype: the logits and z ((c + 4) m V'), then d made from z (4 + c); then d (c m V')
//         beside dh's rows (c m C), and beside the d^T h product (c V' C).
//   widened: each product in fp32, its compute-dtype rounding and the fp32 result ((8 + c) m V' for
//         the logits, and again for d from z); then d (4 m V') beside dh's rows made the same way
//         ((8 + c) m C); dW grows in place.
//   Beside all of it, the whole chunk: its targets with the ignored ones set to 0 (int64) and which are
//         ignored (bool), 9 m.
// w_grad: dW is made (W trains; a frozen W under model.lora: no dW and no d^T h product).
constexpr int64_t fused_loss_chunk_bytes(int64_t m, int64_t C, int64_t V, int64_t c, bool widened, bool grads,
                                         bool w_grad = true) {
  const int64_t loss = 4 * m * V + 24 * m, sums = 4 * m, targets = 9 * m;
  if (c == 4) return targets + max3(loss, grads ? 4 * m * V + sums + 4 * m * C : 0, 0);
  if (widened)
    return targets + max3(max3((8 + c) * m * V, loss, 0), grads ? (8 + c) * m * V + sums : 0,
                          grads ? 4 * m * V + sums + (8 + c) * m * C : 0);
  const int64_t made = max3((4 + c) * m * V, loss, grads ? (4 + c) * m * V + sums : 0);
  return targets + (grads ? max3(made, c * m * V + sums + c * m * C, w_grad ? c * m * V + sums + c * V * C : 0) : made);
}

constexpr FusedLossBytes fused_loss_bytes(int64_t N, int64_t C, int64_t V, int64_t chunk, int64_t c, int64_t h_bytes,
                                          int64_t w_bytes, bool widened, bool grads, bool w_grad = true) {
  FusedLossBytes b;
  b.kept = 4 + (grads ? 4 * N * C + (w_grad ? 4 * V * C : 0) : 0);
  // The operands in the compute dtype: a copy where the input is in another dtype; on the widened path
  // fp32 tensors of compute-dtype values, each made through a compute-dtype copy.
  const int64_t h_op = widened ? 4 * N * C : (h_bytes != c ? c * N * C : 0);
  const int64_t w_op = widened ? 4 * V * C : (w_bytes != c ? c * V * C : 0);
  const int64_t making = h_op + w_op + (widened ? c * V * C : 0);
  b.peak =
      max3(b.kept + h_op + w_op + fused_loss_chunk_bytes(chunk < N ? chunk : N, C, V, c, widened, grads, w_grad),
           making, 0);
  return b;
}

// Cross-entropy of h W^T against targets, summed over the targets that are not kIgnoreTarget and divided by
// N: h (N, C) in any float dtype, W (V', C), targets (N) int64 in [0, valid_vocab) or kIgnoreTarget.
// Returns a 0-d fp32 tensor; differentiable in h and W (one node).
at::Tensor linear_cross_entropy(const at::Tensor& h, const at::Tensor& W, const at::Tensor& targets, int64_t chunk_rows,
                                int64_t valid_vocab);

}  // namespace sl::model
