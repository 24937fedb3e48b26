// The fused GELU's rows (kernels/cpu/gelu.h): scalar, AVX2 + FMA and AVX-512 forms. Built with
// -ffp-contract=off (the 8- and 16-lane forms give the same bits only when neither has a multiply-add
// the other lacks) and -fno-trapping-math (CMakeLists.txt).
#include "kernels/cpu/gelu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "device/cpu_features.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/fast_exp.h"

namespace sl::kernels::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

// ---- one row of n elements: y = gelu(x + b), dx = g gelu'(x + b), db += dx; b may be null ----

// sigmoid(2 z(x)) = 0.5 (1 + tanh z(x)).
inline float gate(float x) {
  const float z = kSqrt2OverPi * (x + kCubic * x * x * x);
  return 1.0f / (1.0f + exp_approx(-2.0f * z));
}

// d/dx [x s] with s = sigmoid(2 z): s + x s (1 - s) 2 z', z' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
inline float gelu_grad(float g, float v) {
  const float s = gate(v);
  const float dz = kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
  return g * (s + v * s * (1.0f - s) * 2.0f * dz);
}

// An element of x, y, g or dx as fp32 (T: float, or Bf16 widened exactly), and an fp32
// result stored as T (bf16 rounded to nearest even).
inline float load1(const float* p) { return *p; }
inline float load1(const Bf16* p) { return widen(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(Bf16* p, float v) { *p = narrow(v); }

// Baseline x86-64, for CPUs without AVX2 + FMA. b (fp32) may be null.
template <class T>
void forward_scalar(const T* x, const float* b, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = b ? load1(x + i) + b[i] : load1(x + i);
    store1(y + i, v * gate(v));
  }
}

// db (fp32) sums the unrounded fp32 dx.
template <class T>
void backward_scalar(const T* g, const T* x, const float* b, T* dx, float* db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = gelu_grad(load1(g + i), b ? load1(x + i) + b[i] : load1(x + i));
    store1(dx + i, d);
    if (db) db[i] += d;
  }
}

#if defined(__x86_64__)
// The same on 8 lanes (AVX2 + FMA). The last partial vector is loaded and stored under a mask and goes
// through the same arithmetic, so no element's bits depend on where a row or a piece starts.
__attribute__((target("avx2,fma"))) inline __m256 gate8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 a = _mm256_set1_ps(-2.0f * kSqrt2OverPi), c = _mm256_set1_ps(-2.0f * kSqrt2OverPi * kCubic);
  const __m256 minus_2z = _mm256_mul_ps(x, _mm256_fmadd_ps(c, _mm256_mul_ps(x, x), a));
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_approx8(minus_2z)));
}

__attribute__((target("avx2,fma"))) inline __m256 gelu_grad8(__m256 g, __m256 v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 s = gate8(v);
  // 2 z' = 2 sqrt(2/pi) + 6 sqrt(2/pi) 0.044715 x^2
  const __m256 two_dz = _mm256_fmadd_ps(_mm256_set1_ps(6.0f * kSqrt2OverPi * kCubic), _mm256_mul_ps(v, v),
                                        _mm256_set1_ps(2.0f * kSqrt2OverPi));
  const __m256 slope = _mm256_mul_ps(_mm256_mul_ps(v, s), _mm256_mul_ps(_mm256_sub_ps(one, s), two_dz));
  return _mm256_mul_ps(g, _mm256_add_ps(s, slope));
}

// Lanes [i, i + 8) of an array of n, or those below n for the last partial vector (fp32: under a mask;
// bf16, which has no masked 16-bit load: through a zeroed 8-lane buffer).
struct Lanes {
  __m256i mask;
  int64_t count;  // lanes in the array, 8 unless partial
  bool partial;
  __attribute__((target("avx2,fma"))) static Lanes at(int64_t i, int64_t n) {
    return {lanes_below(n - i), std::min<int64_t>(8, n - i), i + 8 > n};
  }
  __attribute__((target("avx2,fma"))) __m256 load(const float* p) const {
    return partial ? _mm256_maskload_ps(p, mask) : _mm256_loadu_ps(p);
  }
  __attribute__((target("avx2,fma"))) void store(float* p, __m256 v) const {
    if (partial)
      _mm256_maskstore_ps(p, mask, v);
    else
      _mm256_storeu_ps(p, v);
  }
  __attribute__((target("avx2,fma"))) __m256 load(const Bf16* p) const {
    if (!partial) return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(16) uint16_t buf[8] = {};
    std::memcpy(buf, p, count * sizeof(uint16_t));
    return widen8(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  __attribute__((target("avx2,fma"))) void store(Bf16* p, __m256 v) const {
    const __m128i h = narrow8(v);
    if (!partial) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
      return;
    }
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
    std::memcpy(p, buf, count * sizeof(uint16_t));
  }
};

template <class T>
__attribute__((target("avx2,fma"))) void forward_avx2(const T* x, const float* b, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const Lanes l = Lanes::at(i, n);
    __m256 v = l.load(x + i);
    if (b) v = _mm256_add_ps(v, l.load(b + i));
    l.store(y + i, _mm256_mul_ps(v, gate8(v)));
  }
}

template <class T>
__attribute__((target("avx2,fma"))) void backward_avx2(const T* g, const T* x, const float* b, T* dx, float* db,
                                                        int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const Lanes l = Lanes::at(i, n);
    __m256 v = l.load(x + i);
    if (b) v = _mm256_add_ps(v, l.load(b + i));
    const __m256 d = gelu_grad8(l.load(g + i), v);
    l.store(dx + i, d);
    if (db) l.store(db + i, _mm256_add_ps(l.load(db + i), d));
  }
}

// The AVX2 forms on 16 lanes (AVX-512 F/BW/VL/DQ): the same operations in the same order (no
// multiply-add contracted: this file is built with -ffp-contract=off), so every element's bits are the
// 8-lane form's; tails under a mask (bf16 too: AVX-512 BW has 16-bit masked loads and stores). On a
// CPU whose 512-bit units are split in two (AMD Zen 4) it still runs ~1.6x the 8-lane form (fewer
// instructions per element; the divide's throughput), compute-bound either way.
#define SL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

SL_AVX512 inline __m512 gate16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 a = _mm512_set1_ps(-2.0f * kSqrt2OverPi), c = _mm512_set1_ps(-2.0f * kSqrt2OverPi * kCubic);
  const __m512 minus_2z = _mm512_mul_ps(x, _mm512_fmadd_ps(c, _mm512_mul_ps(x, x), a));
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_approx16(minus_2z)));
}

SL_AVX512 inline __m512 gelu_grad16(__m512 g, __m512 v) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 s = gate16(v);
  const __m512 two_dz = _mm512_fmadd_ps(_mm512_set1_ps(6.0f * kSqrt2OverPi * kCubic), _mm512_mul_ps(v, v),
                                        _mm512_set1_ps(2.0f * kSqrt2OverPi));
  const __m512 slope = _mm512_mul_ps(_mm512_mul_ps(v, s), _mm512_mul_ps(_mm512_sub_ps(one, s), two_dz));
  return _mm512_mul_ps(g, _mm512_add_ps(s, slope));
}

// Lanes [i, i + 16) of an array of n, or those below n (masked) for the last partial vector.
struct Lanes16 {
  __mmask16 mask;
  SL_AVX512 static Lanes16 at(int64_t i, int64_t n) {
    return {n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1)};
  }
  SL_AVX512 __m512 load(const float* p) const { return _mm512_maskz_loadu_ps(mask, p); }
  SL_AVX512 void store(float* p, __m512 v) const { _mm512_mask_storeu_ps(p, mask, v); }
  SL_AVX512 __m512 load(const Bf16* p) const { return widen16(_mm256_maskz_loadu_epi16(mask, p)); }
  SL_AVX512 void store(Bf16* p, __m512 v) const { _mm256_mask_storeu_epi16(p, mask, narrow16(v)); }
};

template <class T>
SL_AVX512 void forward_avx512(const T* x, const float* b, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const Lanes16 l = Lanes16::at(i, n);
    __m512 v = l.load(x + i);
    if (b) v = _mm512_add_ps(v, l.load(b + i));
    l.store(y + i, _mm512_mul_ps(v, gate16(v)));
  }
}

template <class T>
SL_AVX512 void backward_avx512(const T* g, const T* x, const float* b, T* dx, float* db, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const Lanes16 l = Lanes16::at(i, n);
    __m512 v = l.load(x + i);
    if (b) v = _mm512_add_ps(v, l.load(b + i));
    const __m512 d = gelu_grad16(l.load(g + i), v);
    l.store(dx + i, d);
    if (db) l.store(db + i, _mm512_add_ps(l.load(db + i), d));
  }
}
#undef SL_AVX512
#endif

// AVX-512 where device::avx512_kernels() says so, else AVX2 + FMA where the CPU has them (x86-64-v3)
// and the baseline is not forced, baseline otherwise (device::vector_kernels(); asked per row).
template <class T>
void forward_row_of(const T* x, const float* b, T* y, int64_t n) {
#if defined(__x86_64__)
  if (device::avx512_kernels()) return forward_avx512(x, b, y, n);
  if (device::vector_kernels()) return forward_avx2(x, b, y, n);
#endif
  forward_scalar(x, b, y, n);
}

template <class T>
void backward_row_of(const T* g, const T* x, const float* b, T* dx, float* db, int64_t n) {
#if defined(__x86_64__)
  if (device::avx512_kernels()) return backward_avx512(g, x, b, dx, db, n);
  if (device::vector_kernels()) return backward_avx2(g, x, b, dx, db, n);
#endif
  backward_scalar(g, x, b, dx, db, n);
}

}  // namespace

void gelu_forward_row(const float* x, const float* b, float* y, int64_t n) { forward_row_of(x, b, y, n); }
void gelu_forward_row(const Bf16* x, const float* b, Bf16* y, int64_t n) { forward_row_of(x, b, y, n); }
void gelu_backward_row(const float* g, const float* x, const float* b, float* dx, float* db, int64_t n) {
  backward_row_of(g, x, b, dx, db, n);
}
void gelu_backward_row(const Bf16* g, const Bf16* x, const float* b, Bf16* dx, float* db, int64_t n) {
  backward_row_of(g, x, b, dx, db, n);
}

}  // namespace sl::kernels::cpu
