// The loops of the fused tanh GELU (model/gelu.h, which holds its contract and its autograd node), on
// one row of n contiguous elements: y = gelu(x + b), and in backward dx = g gelu'(x + b), db += dx (the
// unrounded fp32 dx); b (fp32, n) and db may be null. gelu(v) = v sigmoid(2 z), z = sqrt(2/pi)
// (v + 0.044715 v^3), one exp per element (kernels/cpu/fast_exp.h). fp32 or bf16 elements (bf16
// loaded into fp32, computed exactly as fp32 is, rounded once on store: kernels/cpu/bf16.h). The form
// is asked per row: 16 lanes where device::avx512_kernels() says so, bit for bit the 8-lane AVX2 + FMA
// form, which runs where device::vector_kernels() says so; the baseline x86-64 form otherwise (it
// differs from the vector forms by float rounding). A partial last vector goes through the same
// arithmetic under a mask, so no element's bits depend on where a row starts.
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {

void gelu_forward_row(const float* x, const float* b, float* y, int64_t n);
void gelu_forward_row(const Bf16* x, const float* b, Bf16* y, int64_t n);
void gelu_backward_row(const float* g, const float* x, const float* b, float* dx, float* db, int64_t n);
void gelu_backward_row(const Bf16* g, const Bf16* x, const float* b, Bf16* dx, float* db, int64_t n);

}  // namespace sl::kernels::cpu
