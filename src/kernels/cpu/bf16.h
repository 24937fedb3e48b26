// bf16 <-> fp32 for the bf16 forms of the fused CPU kernels (gelu.cpp, attention.cpp), which load
// bf16, compute in fp32 and round once on store. Widening is exact (a bf16 is the high half of a
// float's bits); narrowing rounds to nearest, ties to even, and makes every NaN 0x7FC0: bit for bit what
// c10::BFloat16(float) does, in a branch-free form loops vectorize (the files that use it are built
// with -fno-trapping-math, CMakeLists.txt). Scalar forms, AVX2 forms on 8 lanes and AVX-512 forms on 16
// (the same bits: AVX-512's own vcvtneps2bf16 would flush subnormals, so it is not used).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sl::kernels::cpu {

// A bf16 value as its bits: the layout of c10::BFloat16 (one uint16_t `x`), so the model's wrappers
// hand the kernels a bf16 tensor's data pointer as it is (reinterpret_cast), and the kernels stay
// torch-free.
struct Bf16 {
  uint16_t x;
};

inline float widen(Bf16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline Bf16 narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return Bf16{static_cast<uint16_t>(f != f ? 0x7FC0u : rounded)};
}

#if defined(__x86_64__)
// Called only where device::vector_kernels() says so (device/cpu_features.h).

// 8 bf16 (the low 16 bytes' lanes) to 8 floats.
__attribute__((target("avx2,fma"))) inline __m256 widen8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats to 8 bf16, rounded as narrow() does.
__attribute__((target("avx2,fma"))) inline __m128i narrow8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // Every lane is below 0x10000: the unsigned saturating pack keeps it as it is.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The same on 16 lanes (AVX-512 F); called only where device::avx512_kernels() says so.
__attribute__((target("avx512f"))) inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx512f"))) inline __m256i narrow16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));  // lanes < 0x10000
}
#endif

}  // namespace sl::kernels::cpu
