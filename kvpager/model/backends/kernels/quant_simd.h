// Vector primitives for the packed-weight kernels (quant_body.h), one struct per instruction set.
//
// Each struct `S` gives: V (a vector of S::W float32 lanes), U = 16 / W (vectors per 16 weights),
// the row tiles its register file suits (NT1/NT2: output rows per tile of the 1- and 2-row direct
// path, MR: input rows per block of the buffered path), and loads that widen 16 stored weights to
// float32 before scale/offset:
//   bf16(p, w): 16 bfloat16 bit patterns -> float32 (a widen and a 16-bit shift)
//   f16(p, w):  16 IEEE float16 bit patterns -> float32, exactly (F16C's vcvtph2ps; Portable: by the
//               bit layout, subnormals, infinities and NaN included)
//   i8(p, w):   16 int8 -> float32
//   h2f(h), load_h(p): float16 scales (GGUF Q8_0 / Q4_0 weights) widened, one / W at a time
//   i4(span, w): one 8-byte int4 span (byte j: weight j in the low nibble, weight j + 8 in the high)
// Avx2 and Avx512 are compiled under `#pragma GCC target` (KVQ_PUSH_*, quant.cpp), so the library
// needs no -march flag and runs on any x86-64 CPU; Portable uses GCC vector extensions (the baseline
// instruction set). The kernels (quant_body.inc) are compiled once per struct.

#pragma once

#include <cstdint>
#include <cstring>

#include "half_bits.h"

namespace kvq_simd {

struct Portable {
  static constexpr int W = 8, U = 2, NT1 = 4, NT2 = 2, MR = 4;
  typedef float V __attribute__((vector_size(32)));
  static V zero() { return V{}; }
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static float h2f(uint16_t h) { return f16_bits_to_float(h); }  // a float16 scale (GGUF Q8_0 / Q4_0)
  static V load_h(const uint16_t* p) {  // W float16 scales widened
    V v;
    for (int i = 0; i < W; ++i) v[i] = f16_bits_to_float(p[i]);
    return v;
  }
  static V set1(float f) { return V{} + f; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float hsum(V v) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += v[i];
    return s;
  }
  static void reduce4(V a, V b, V c, V d, float out[4]) {
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
  }
  static void bf16(const uint16_t* p, V w[U]) {
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < W; ++i) w[u][i] = bf16_bits_to_float(p[u * W + i]);
  }
  static void f16(const uint16_t* p, V w[U]) {
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < W; ++i) w[u][i] = f16_bits_to_float(p[u * W + i]);
  }
  static void i8(const int8_t* p, V w[U]) {
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < W; ++i) w[u][i] = static_cast<float>(p[u * W + i]);
  }
  static void i4(const uint8_t* span, V w[U]) {
    for (int i = 0; i < 8; ++i) {
      w[0][i] = static_cast<float>(span[i] & 0xF);
      w[1][i] = static_cast<float>(span[i] >> 4);
    }
  }
};

#if defined(KVQ_X86)
KVQ_PUSH_AVX2
struct Avx2 {
  static constexpr int W = 8, U = 2, NT1 = 4, NT2 = 2, MR = 4;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static V load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // The four horizontal sums at once (hadd pairs, then the two 128-bit halves).
  static void reduce4(V a, V b, V c, V d, float out[4]) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lanes: a b c d (low half), a b c d (high half)
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static void bf16(const uint16_t* p, V w[U]) {
    for (int u = 0; u < U; ++u) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + u * W));
      w[u] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  static void f16(const uint16_t* p, V w[U]) {
    for (int u = 0; u < U; ++u) w[u] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + u * W)));
  }
  static void i8(const int8_t* p, V w[U]) {
    for (int u = 0; u < U; ++u)
      w[u] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + u * W))));
  }
  static void i4(const uint8_t* span, V w[U]) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(span)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
    w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};

KVQ_POP

KVQ_PUSH_AVX512
struct Avx512 {
  static constexpr int W = 16, U = 1, NT1 = 8, NT2 = 4, MR = 8;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static V load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static void reduce4(V a, V b, V c, V d, float out[4]) {
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
  }
  static void bf16(const uint16_t* p, V w[U]) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void f16(const uint16_t* p, V w[U]) {
    w[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void i8(const int8_t* p, V w[U]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Lane l < 8 takes weight l (byte l's low nibble, bit 8l), lane l >= 8 weight l (byte l - 8's high
  // nibble): the span's dword (l % 8) / 4 shifted right by 8 (l % 4), plus 4 for the high nibbles. vpermps
  // reads only an index's low 4 bits, so the shifted dword needs no mask, and its table of the 16 codes
  // as floats widens them (the values a conversion gives): three operations per 16 weights where
  // masking, unpacking, widening and converting take six, which bounds batch-1 decode on 4-bit weights.
  static void i4(const uint8_t* span, V w[U]) {
    const __m512i d = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(span)));
    const __m512i dword = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i shift = _mm512_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24, 4, 12, 20, 28, 4, 12, 20, 28);
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_permutexvar_epi32(dword, d), shift), codes);
  }
};
KVQ_POP
#endif

}  // namespace kvq_simd
