// exp for the fused CPU kernels (gelu.cpp, attention.cpp): a scalar form that loops vectorize
// (branch-free; files that use it are built with -fno-trapping-math, CMakeLists.txt), an explicit
// AVX2 + FMA form for kernels written on 8-float vectors, and the same steps on 16 (AVX-512).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sl::kernels::cpu {

// e^x for x in [-87, 88] (clamped), within ~2 ulp: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split
// of ln2), e^r by its degree-6 Taylor polynomial (remainder below 1.2e-7 relative), 2^n from the
// exponent bits.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__x86_64__)
// The AVX2 forms below are called only where device::vector_kernels() says so (device/cpu_features.h).

// exp_approx on 8 lanes, the same steps. NaN stays NaN (max/min return their second operand then).
// GCC's own vectorization of the scalar form above runs 2-3x slower than this (blends around the
// clamps), which is why the hot elementwise kernels are written on vectors.
__attribute__((target("avx2,fma"))) inline __m256 exp_approx8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 round = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), round), round);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// exp_approx8 on 16 lanes (AVX-512 F): the same operations in the same order, so each lane's bits are
// exp_approx8's (where no multiply-add is contracted: gelu.cpp is built with -ffp-contract=off).
// Called only where device::avx512_kernels() says so.
__attribute__((target("avx512f,fma"))) inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 round = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Lanes [0, count) set, for masked loads and stores of an array's last partial vector: the tail goes
// through the same vector arithmetic as the rest, so an element's bits do not depend on where a
// thread's range or the array starts.
__attribute__((target("avx2,fma"))) inline __m256i lanes_below(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

}  // namespace sl::kernels::cpu
