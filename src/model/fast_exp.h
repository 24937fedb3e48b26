// exp for the fused CPU kernels (gelu.cpp, attention.cpp). Branch-free, so loops that call it
// vectorize; files that use it are built with -fno-trapping-math for that (CMakeLists.txt).
#pragma once
#include <cstdint>
#include <cstring>

namespace sl::model {

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

}  // namespace sl::model
