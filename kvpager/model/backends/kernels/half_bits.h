// 16-bit float bit patterns widened to float32 without F16C: the packed-weight kernels' bf16 / f16
// weights (quant_simd.h) and the float16 scales of GGUF Q8_0 / Q4_0 weights (quant.cpp, quant_dot.cpp).

#pragma once

#include <cstdint>
#include <cstring>

namespace kvq_simd {

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t b = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// float32 -> bfloat16 bits, rounded to nearest even (finite values: the dequantized weights).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// float16 bits -> float32, exact, from the bit layout (no F16C needed): sign, 5-bit exponent (bias 15),
// 10-bit mantissa; subnormals normalised, infinities and NaN kept.
inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {
    exp = 113u;  // 2^-14 as a float32 exponent (127 - 14), lowered while the mantissa is normalised
    while ((man & 0x400u) == 0) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace kvq_simd
