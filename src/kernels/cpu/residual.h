// The loops of the fused residual adds (model/residual.h, which holds their contract and autograd
// nodes), on n contiguous elements (a piece of the stream, or one row of C with the bias b (C)): the
// bf16 branch y widened exactly as it is loaded, every sum in fp32, rounded once. AVX2 + FMA and
// baseline clones, picked per call (kernels/cpu/clones.h); both give the same bits (adds only).
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {

// out[i] = x[i] + widen(y[i]).
void add_widened(const float* x, const Bf16* y, float* out, int64_t n);
// out[i] = x[i] + (widen(y[i]) + b[i]).
void add_widened_bias(const float* x, const Bf16* y, const float* b, float* out, int64_t n);
// out[i] = x[i] + (y[i] + b[i]): an fp32 branch.
void add_bias(const float* x, const float* y, const float* b, float* out, int64_t n);
// The bias form's backward on one row: dy[i] = bf16(g[i]) (to nearest even), db[i] += g[i].
void narrow_and_sum(const float* g, Bf16* dy, float* db, int64_t n);
// db[i] += g[i]: the same for an fp32 branch (dy is g).
void sum_rows(const float* g, float* db, int64_t n);

}  // namespace sl::kernels::cpu
