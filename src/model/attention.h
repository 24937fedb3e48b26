// Causal scaled-dot-product attention for fp32 and bf16 CPU tensors without dropout: a fused forward
// and backward that replace SDPA's CPU flash kernels there. Per (batch, head) it walks blocks of 64 query
// rows; each block multiplies against the keys up to its diagonal only (register-tiled GEMMs on the
// strided views, small_gemm.h), takes the softmax in place, and writes its output rows straight into
// the (B, T, C) layout the output projection reads. Backward recomputes each block's probabilities
// from the saved log-sum-exp, as the flash algorithm does. bf16 computes in fp32: each (batch, head)'s
// q, k, v (in backward also its output and output gradient) are widened into the thread's fp32
// scratch, the fp32 kernel runs on them, and its results (output; dq, dk, dv) are rounded to bf16 once
// (the log-sum-exp stays fp32). Other tensors (CUDA, fp16, mixed dtypes, attention dropout) keep
// at::scaled_dot_product_attention, and so does everything under SUBLINEAR_ATEN_KERNELS=1
// (device::fused_kernels()). Its row kernels and GEMM tiles have AVX2 + FMA and baseline clones
// (kernels/cpu/clones.h): results differ between the clones by float rounding. On AVX-512
// (device::avx512_kernels()) the softmax rows take their exps 16 at a time and the fp32 GEMM tiles 16
// columns per instruction, bit for bit the AVX2 clone.
// On a CPU with AVX512-BF16 (device::CpuFeatures::bf16_dot; the vector clones running) a bf16 head's
// six products take bf16 operands instead (small_gemm_bf16: two exact products per instruction, fp32
// sums): q, k, v, the output gradient are bf16 already; the probabilities P and the scores' gradient dS
// are rounded to bf16 first, as ATen's bf16 flash attention rounds them. Softmax, the log-sum-exp, the
// row sums of dO * O and every accumulator stay fp32.
#pragma once
#include <torch/types.h>

namespace sl::model {

// q, k, v: (B, nh, T, hd), one dtype (fp32 or bf16), unit stride along hd (views of the QKV
// projection's output are fine). Returns (B, T, nh * hd) in that dtype, contiguous: the heads side by
// side. Differentiable; saves q, k, v, the output and the per-row log-sum-exp (B, nh, T, fp32), the same
// tensors SDPA's flash path saves, so the activation memory is the planner's flash figure (bf16 adds
// only per-thread scratch, 4 (forward) or 8 (backward) T x hd floats, and with the bf16 products about
// one (forward) or two (backward) T x hd words more plus a block's: no whole-tensor fp32 copy). Each
// (batch, head) is computed by one thread in a fixed order with the project's own GEMM tiles
// (small_gemm.h): the bits do not depend on the thread count, and a recompute gives the same bits. Its
// backward is not differentiable (no double backward).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// True when causal_attention takes q, k, v (all fp32 or all bf16, CPU, strided, unit stride along hd,
// one shape), unless SUBLINEAR_ATEN_KERNELS turns the fused kernels off; bf16 only where the AVX2 + FMA
// clone runs (the baseline clone's bf16 is slower than SDPA's).
bool causal_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// The same attention on the QKV projection's output qkv (B, T, 3C), [q | k | v] along the last dimension
// with unit stride there: the heads are read in place, and backward writes the one gradient (B, T, 3C)
// that splitting qkv into q, k, v would have concatenated from three. Saves qkv, the output and lse.
torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t n_head);

// True when causal_attention_packed takes qkv (fp32 or bf16 CPU, last dimension a multiple of 3 * n_head),
// under causal_attention_fused's conditions.
bool causal_attention_packed_fused(const torch::Tensor& qkv, int64_t n_head);

// Whether bf16 heads take the bf16 products now (AVX512-BF16, vector clones, not forced off).
bool bf16_attention_products();
// Tests: makes bf16 heads take the fp32 products (on = true) even on a CPU with AVX512-BF16, or lets
// them take the bf16 ones again; returns the setting it replaces. Do not switch while a model runs.
bool force_fp32_attention_products(bool on);

}  // namespace sl::model
