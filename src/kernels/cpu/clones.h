// Two clones of a fused CPU kernel, AVX2 + FMA (x86-64-v3) and baseline x86-64, and the function that
// picks one at each call: device::vector_kernels(), the CPU's, unless the baseline is forced
// (SUBLINEAR_FORCE_BASELINE=1, or device::force_baseline_kernels; see device/cpu_features.h).
// GCC's target_clones would pick once, at load time, leaving no way to run the baseline clone on a CPU
// that has AVX2; the tests run both clones on every CPU. Used by the kernels beside it (attention.cpp,
// small_gemm.cpp, a bf16 run's residual add and LayerNorm: residual.cpp, layernorm.cpp), by AdamW and the
// clipping (optim/optimizer.cpp, optim/clip.cpp); GELU's vector form is written in intrinsics and picks
// the same way. GELU, the attention's softmax rows and its fp32 GEMM tiles have a 16-lane AVX-512 form
// beside the 8-lane one (device::avx512_kernels), bit for bit the AVX2 clone.
//
//   SL_KERNEL_BODY float dot_body(const float* a, const float* b, int64_t n) { ... }
//   SL_KERNEL_CLONES(float, dot, (const float* a, const float* b, int64_t n), (a, b, n))
//
// defines dot_avx2 and dot_baseline, each with dot_body inlined into it (so the body is compiled once
// per instruction set), and dot(a, b, n), which calls one of them. Off x86-64 only the body exists.
#pragma once
#include "device/cpu_features.h"

// A kernel's body: always inlined, so each clone compiles it for its own instruction set.
#define SL_KERNEL_BODY __attribute__((always_inline)) inline

#if defined(__x86_64__)
#define SL_KERNEL_CLONES(ret, name, params, args)                                                  \
  __attribute__((target("arch=x86-64-v3"), noinline)) ret name##_avx2 params {                     \
    return name##_body args;                                                                       \
  }                                                                                                \
  __attribute__((noinline)) ret name##_baseline params { return name##_body args; }                \
  ret name params { return ::sl::device::vector_kernels() ? name##_avx2 args : name##_baseline args; }
#else
#define SL_KERNEL_CLONES(ret, name, params, args) \
  ret name params { return name##_body args; }
#endif
