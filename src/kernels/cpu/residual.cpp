// The fused residual adds' loops (kernels/cpu/residual.h): one clone per instruction set (AVX2 + FMA,
// baseline; kernels/cpu/clones.h). Built with -fno-trapping-math, so the loops vectorize (CMakeLists.txt).
#include "kernels/cpu/residual.h"

#include <cstdint>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/clones.h"

namespace sl::kernels::cpu {

// out[i] = x[i] + widen(y[i]): the AVX2 clone's loop vectorizes (widening is a shift).
SL_KERNEL_BODY void add_widened_body(const float* x, const Bf16* y, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + widen(y[i]);
}
SL_KERNEL_CLONES(void, add_widened, (const float* x, const Bf16* y, float* out, int64_t n), (x, y, out, n))

// One row: out[i] = x[i] + (widen(y[i]) + b[i]).
SL_KERNEL_BODY void add_widened_bias_body(const float* x, const Bf16* y, const float* b, float* out,
                                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + (widen(y[i]) + b[i]);
}
SL_KERNEL_CLONES(void, add_widened_bias, (const float* x, const Bf16* y, const float* b, float* out, int64_t n),
                 (x, y, b, out, n))

// One row of the bias form's backward: dy[i] = bf16(g[i]), db[i] += g[i].
SL_KERNEL_BODY void narrow_and_sum_body(const float* g, Bf16* dy, float* db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dy[i] = narrow(g[i]);
    db[i] += g[i];
  }
}
SL_KERNEL_CLONES(void, narrow_and_sum, (const float* g, Bf16* dy, float* db, int64_t n), (g, dy, db, n))

// The same for an fp32 branch (an fp32 run): out[i] = x[i] + (y[i] + b[i]); backward db[i] += g[i]
// (dy is g).
SL_KERNEL_BODY void add_bias_body(const float* x, const float* y, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + (y[i] + b[i]);
}
SL_KERNEL_CLONES(void, add_bias, (const float* x, const float* y, const float* b, float* out, int64_t n),
                 (x, y, b, out, n))

SL_KERNEL_BODY void sum_rows_body(const float* g, float* db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) db[i] += g[i];
}
SL_KERNEL_CLONES(void, sum_rows, (const float* g, float* db, int64_t n), (g, db, n))

}  // namespace sl::kernels::cpu
