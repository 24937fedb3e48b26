// The loops of the fused bf16 LayerNorm (model/layernorm.h, which holds its contract and its autograd
// node), on one row of n fp32 elements. Mean and variance in fp32, two passes over the row (the
// variance a sum of squares of centred values), each sum in 8 lanes added in order, then the tail;
// y = (x - mean) rstd w + b in fp32, rounded once to bf16 (kernels/cpu/bf16.h). Backward from the bf16
// output gradient dy: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - mean) rstd,
// and dy xhat added to dw, dy to db (one piece's partial sums). AVX2 + FMA and baseline clones, picked
// per call (kernels/cpu/clones.h); they differ by float rounding.
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace sl::kernels::cpu {

// One row: y (n, bf16) and the row's mean and rstd = 1 / sqrt(var + eps) through mean_out, rstd_out.
// w (n) the norm weight, b (n) its bias or null.
void layer_norm_forward_row(const float* x, const float* w, const float* b, float eps, int64_t n, Bf16* y,
                            float* mean_out, float* rstd_out);

// One row's dx (n, fp32) from dy and the row's saved mean and rstd; dw[j] += dy xhat, db[j] += dy (db may
// be null).
void layer_norm_backward_row(const Bf16* dy, const float* x, const float* w, float mean, float rstd, int64_t n,
                             float* dx, float* dw, float* db);

}  // namespace sl::kernels::cpu
