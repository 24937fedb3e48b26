// Causal scaled-dot-product attention for fp32 CPU tensors without dropout: a fused forward and
// backward that replace SDPA's CPU flash kernels there. Per (batch, head) it walks blocks of 64 query
// rows; each block multiplies against the keys up to its diagonal only (register-tiled GEMMs on the
// strided views, small_gemm.h), takes the softmax in place, and writes its output rows straight into
// the (B, T, C) layout the output projection reads. Backward recomputes each block's probabilities
// from the saved log-sum-exp, as the flash algorithm does. Other tensors (CUDA, bf16, fp16, attention
// dropout) keep at::scaled_dot_product_attention. Its row kernels and GEMM tiles have AVX2 + FMA and
// baseline clones (model/clones.h): results differ between the clones by float rounding.
#pragma once
#include <torch/types.h>

namespace sl::model {

// q, k, v: (B, nh, T, hd), unit stride along hd (views of the QKV projection's output are fine).
// Returns (B, T, nh * hd), contiguous: the heads side by side. Differentiable; saves q, k, v, the
// output and the per-row log-sum-exp (B, nh, T), the same tensors SDPA's flash path saves, so the
// activation memory is the planner's flash figure. Each (batch, head) is computed by one thread in a
// fixed order with the project's own GEMM tiles (small_gemm.h): the bits do not depend on the thread
// count, and a recompute gives the same bits. Its backward is not differentiable (no double backward).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// True when causal_attention takes q, k, v (all fp32, CPU, strided, unit stride along hd).
bool causal_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// The same attention on the QKV projection's output qkv (B, T, 3C), [q | k | v] along the last dimension
// with unit stride there: the heads are read in place, and backward writes the one gradient (B, T, 3C)
// that splitting qkv into q, k, v would have concatenated from three. Saves qkv, the output and lse.
torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t n_head);

// True when causal_attention_packed takes qkv (fp32 CPU, last dimension a multiple of 3 * n_head).
bool causal_attention_packed_fused(const torch::Tensor& qkv, int64_t n_head);

}  // namespace sl::model
