// Primitives of the integer-dot kernels (quant_dot.cpp): one struct per instruction set.
//
// A block is 32 activations quantized to int8 with one float32 scale d (symmetric, d = max|x| / 127,
// q = round-half-even(x / d)). w_i8 / w_i4 load a weight block (S::W: int4 codes unpacked, int8 with
// their absolute values), once for every input row it meets; dot_i8 / dot_i4 return the integer
// products of a weight block and an activation block as float32 lanes, each the exact int32 sum of
// some of the 32 products, converted to float: int8 (dot_i8) gives 8 lanes, lane l = stored positions
// 4l..4l+3 (what _mm256_maddubs_epi16 + _mm256_madd_epi16 leave); int4 (dot_i4) gives 4 lanes (V4),
// lane l = positions 4l..4l+3 and 16+4l..16+4l+3 (two 128-bit _mm_maddubs_epi16, one per nibble
// half, added as int16, then _mm_madd_epi16: fewer multiply-port operations than one 256-bit pass,
// and 256-bit operations cost two on CPUs that split them, such as AMD Zen 1).
// Every struct builds the lanes, scales them (a fused multiply-add: rounded once) and sums them in the
// same order, so the portable, AVX2 and VNNI paths agree bit for bit.
//
// A weight's scales are float32 or IEEE float16 (SC: float / uint16_t; GGUF Q8_0 / Q4_0 keep the
// file's float16, which widens exactly): scale(), spread2() and offset_dot() take either, so the
// kernels give the same bits for both when the float32 scales hold the float16 values.
//
// int4 blocks are the 16 bytes of two 8-byte spans (quant.cpp's layout): low nibbles = weights
// 0..7 and 16..23, high nibbles = 8..15 and 24..31. The activation block is stored in that order
// ([0..7, 16..23, 8..15, 24..31], int4_natural), so the nibbles need no shuffle.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half_bits.h"

namespace kvqd_simd {

constexpr int kBlock = 32;

// The natural index of the activation at stored position p of an int4-ordered block.
inline int int4_natural(int p) {
  static constexpr int kBase[4] = {0, 16, 8, 24};
  return kBase[p / 8] + p % 8;
}

// The value range a panel's weights keep (quant_dot_gemm.inc): int8 any (kI8Full) or |w| <= 32 (kI8Small:
// GGUF Q6_K's -32..31), panel_block_i8's; int4 codes with a fifth bit (kFiveBits: GGUF Q5_K's 0..31),
// panel_block's kFive.
constexpr int kI8Full = 0, kI8Small = 1, kFiveBits = 2;

struct Portable {
  struct V {
    float v[8];
  };
  struct V4 {
    float v[4];
  };
  using X = const int8_t*;  // an activation block
  using X4 = X;
  struct W {                 // a weight block: int8 values, or int4 codes in stored order
    int16_t v[kBlock];
  };
  static W w_i8(const int8_t* w) {
    W r;
    for (int p = 0; p < kBlock; ++p) r.v[p] = w[p];
    return r;
  }
  using W4 = W;
  static W4 w_i4(const uint8_t* w) {
    W r;
    for (int p = 0; p < kBlock; ++p) r.v[p] = p < 16 ? (w[p] & 0xF) : (w[p - 16] >> 4);
    return r;
  }
  static V zero() { return V{}; }
  static V4 zero4() { return V4{}; }
  static X load_x(const int8_t* q) { return q; }
  static X4 load_x4(const int8_t* q) { return q; }
  static V madd(V acc, V a, float s) {  // acc + a * s, lane by lane, rounded once (a fused multiply-add)
    for (int l = 0; l < 8; ++l) acc.v[l] = std::fma(a.v[l], s, acc.v[l]);
    return acc;
  }
  static V4 madd(V4 acc, V4 a, float s) {
    for (int l = 0; l < 4; ++l) acc.v[l] = std::fma(a.v[l], s, acc.v[l]);
    return acc;
  }
  // acc + a * (lanes 0..3: lo, lanes 4..7: hi): a block whose two halves of 16 have their own scale
  static V madd2(V acc, V a, float lo, float hi) {
    for (int l = 0; l < 8; ++l) acc.v[l] = std::fma(a.v[l], l < 4 ? lo : hi, acc.v[l]);
    return acc;
  }
  static float hsum(V4 v) {  // _mm_movehl_ps then a shuffle: (0 + 2) + (1 + 3)
    const float a = v.v[0] + v.v[2], b = v.v[1] + v.v[3];
    return a + b;
  }
  static float hsum(V v) {  // the AVX2 order: halves, then pairs
    float s[4];
    for (int i = 0; i < 4; ++i) s[i] = v.v[i] + v.v[i + 4];
    const float a = s[0] + s[2], b = s[1] + s[3];
    return a + b;
  }
  static V dot(const W& w, X x) {
    V r;
    for (int l = 0; l < 8; ++l) {
      int32_t t = 0;
      for (int e = 0; e < 4; ++e) t += static_cast<int32_t>(w.v[4 * l + e]) * x[4 * l + e];
      r.v[l] = static_cast<float>(t);
    }
    return r;
  }
  static V dot_i8(const W& w, X x) { return dot(w, x); }
  static float scale(float s) { return s; }
  static float scale(uint16_t h) { return kvq_simd::f16_bits_to_float(h); }
  // A GGUF Q4_K super-block record (quant_dot.cpp's kKScales): float16 d, dmin, 8 bytes sc, 8 bytes m ->
  // the 8 groups' scales d * sc and offsets -(dmin * m) (-dmin * m: the same value), exact in float32.
  static void expand_k(const uint8_t* rec, float* s, float* o) {
    uint16_t hd, hm;
    std::memcpy(&hd, rec, sizeof hd);
    std::memcpy(&hm, rec + 2, sizeof hm);
    const float d = scale(hd), nm = -scale(hm);
    for (int g = 0; g < 8; ++g) s[g] = d * static_cast<float>(rec[4 + g]), o[g] = nm * static_cast<float>(rec[12 + g]);
  }
  // A GGUF Q6_K super-block record (quant_dot.cpp's kQ6Scales): float16 d, 16 int8 sc -> the 16 groups'
  // scales d * sc, exact in float32.
  static void expand_q6(const uint8_t* rec, float* s) {
    uint16_t hd;
    std::memcpy(&hd, rec, sizeof hd);
    const float d = scale(hd);
    for (int g = 0; g < 16; ++g) s[g] = d * static_cast<float>(static_cast<int8_t>(rec[2 + g]));
  }
  // A Q4_K super-block record's 8 scales and 8 offsets as lanes, expand_k's values (the decode tiles
  // widen them in registers).
  static V k_scales8(const uint8_t* rec) {
    V s, o;
    expand_k(rec, s.v, o.v);
    return s;
  }
  static V k_offsets8(const uint8_t* rec) {
    V s, o;
    expand_k(rec, s.v, o.v);
    return o;
  }
  // Lanes 0..3 = s[2i], 4..7 = s[2i + 1]: spread2 of two neighbouring lanes.
  template <int I>
  static V pair_of(V s) {
    V r;
    for (int l = 0; l < 8; ++l) r.v[l] = s.v[2 * I + l / 4];
    return r;
  }
  // sum_g o[g] * xs[g]: eight lanes of fused multiply-adds (lane l takes g = l mod 8), the AVX2 sum of
  // the lanes, then the last groups one after another (the same bits as Avx2::offset_dot).
  template <class SC>
  static float offset_dot(const SC* o, const float* xs, int64_t groups) {
    V acc{};
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      for (int l = 0; l < 8; ++l) acc.v[l] = std::fma(scale(o[g + l]), xs[g + l], acc.v[l]);
    float t = hsum(acc);
    for (; g < groups; ++g) t = std::fma(scale(o[g]), xs[g], t);
    return t;
  }
  static V4 dot_i4(const W4& w, X4 x) {
    V4 r;
    for (int l = 0; l < 4; ++l) {
      int32_t t = 0;
      for (int e = 0; e < 4; ++e) t += static_cast<int32_t>(w.v[4 * l + e]) * x[4 * l + e];
      for (int e = 0; e < 4; ++e) t += static_cast<int32_t>(w.v[16 + 4 * l + e]) * x[16 + 4 * l + e];
      r.v[l] = static_cast<float>(t);
    }
    return r;
  }
  // Two int4 blocks (b, b + 1) at once, for weights with one scale per block (quant_dot_body.inc's
  // tile_i4_pairs): 8 lanes, 0..3 = dot_i4 of block b, 4..7 = dot_i4 of block b + 1. The weight pair is
  // the 32 stored bytes of both blocks, the activation pair their 64 stored bytes.
  using W4x2 = const uint8_t*;
  using X4x2 = X;
  struct W5x2 {  // two blocks' codes as W (dot_i4x2's pair unpacked; GGUF Q5_K's with their fifth bits)
    W a, b;
  };
  static W4x2 w_i4x2(const uint8_t* w) { return w; }
  static X4x2 x_i4x2(const int8_t* q) { return q; }
  static V dot_i4x2(W4x2 w, X4x2 x) { return dot_i5x2(W5x2{w_i4(w), w_i4(w + 16)}, x); }
  // GGUF Q5_K packed (quant_dot_body.inc's tile_i4_records with a plane): blocks b, b + 1 as dot_i4x2
  // takes them, each code plus 16 where its fifth bit is set. plane: 8 bytes, block b's 32 bits then
  // block b + 1's, bit j (little-endian) the fifth bit of stored position j (as W's v[j]).

  static W5x2 w_i5x2(const uint8_t* w, const uint8_t* plane) {
    W5x2 r{w_i4(w), w_i4(w + 16)};
    for (int j = 0; j < kBlock; ++j) {
      r.a.v[j] = static_cast<int16_t>(r.a.v[j] + 16 * ((plane[j / 8] >> (j % 8)) & 1));
      r.b.v[j] = static_cast<int16_t>(r.b.v[j] + 16 * ((plane[4 + j / 8] >> (j % 8)) & 1));
    }
    return r;
  }
  static V dot_i5x2(const W5x2& w, X4x2 x) {
    const V4 a = dot_i4(w.a, x), b = dot_i4(w.b, x + kBlock);
    V r;
    for (int l = 0; l < 4; ++l) r.v[l] = a.v[l], r.v[4 + l] = b.v[l];
    return r;
  }
  // GGUF Q6_K packed (quant_dot_body.inc's tile_q6_packed): blocks b, b + 1 as dot_i4x2 takes them,
  // each code plus 16 times its two high bits from the pair's 16 plane bytes (q6_plane_bits), minus 32:
  // the weight values, -32..31. The AVX2 build keeps the codes unsigned and subtracts 32 times the
  // activations' sums instead (C6); the same integers.
  static W5x2 w_i6x2(const uint8_t* w, const uint8_t* plane) {
    W5x2 r{w_i4(w), w_i4(w + 16)};
    for (int j = 0; j < kBlock; ++j) {
      r.a.v[j] = static_cast<int16_t>(r.a.v[j] + 16 * q6_plane_bits(plane, 0, j) - 32);
      r.b.v[j] = static_cast<int16_t>(r.b.v[j] + 16 * q6_plane_bits(plane, 1, j) - 32);
    }
    return r;
  }
  // The two high bits of stored position j of block `odd` (0: b, 1: b + 1) of a pair's 16 plane bytes:
  // byte j % 16, bits 2 * odd + 4 * (j / 16) and up (block b's low-nibble positions at bits 0-1, block
  // b + 1's at 2-3, their high-nibble positions at 4-5 and 6-7).
  static int q6_plane_bits(const uint8_t* plane, int odd, int j) { return (plane[j % 16] >> (2 * odd + 4 * (j / 16))) & 3; }
  using C6 = int;  // (the AVX2 build's correction; the portable codes are signed already)
  static C6 x_sum32(X4x2) { return 0; }
  static V dot_i6x2(const W5x2& w, X4x2 x, C6) { return dot_i5x2(w, x); }
  // Lanes 2i, 2i + 1 = s[4P + i]: a block pair's four group-16 scales (of a super-block's 16 at s) over
  // dot_i6x2's lanes (lanes 0, 1 of a block: its natural positions 0..15; lanes 2, 3: 16..31).
  template <int P>
  static V q6_pair(const float* s) {
    V r;
    for (int l = 0; l < 8; ++l) r.v[l] = s[4 * P + l / 2];
    return r;
  }
  // A Q6_K packed block's 32 values (code - 32) in stored order, for the prompt panels: w its 16 stored
  // bytes, plane its pair's 16 plane bytes, odd whether it is the pair's second block.
  static void q6_values(const uint8_t* w, const uint8_t* plane, int odd, int8_t* out) {
    for (int j = 0; j < kBlock; ++j)
      out[j] = static_cast<int8_t>((j < 16 ? w[j] & 0xF : w[j - 16] >> 4) + 16 * q6_plane_bits(plane, odd, j) - 32);
  }
  // A GGUF Q5_K packed block's 32 codes (0..31) in stored order: w its 16 stored bytes, plane its 4 plane
  // bytes (bit j: stored position j's fifth bit).
  static void q5_codes(const uint8_t* w, const uint8_t* plane, uint8_t* out) {
    for (int j = 0; j < kBlock; ++j)
      out[j] = static_cast<uint8_t>((j < 16 ? w[j] & 0xF : w[j - 16] >> 4) + 16 * ((plane[j / 8] >> (j % 8)) & 1));
  }
  // Adds the fifth bits of a panel's block (pack_codes8's layout, [group g][row c][4]: positions 4g..4g+3
  // in stored order) from each row's 4 plane bytes (rows past `cols`: none).
  static void add_plane8(const uint8_t* const (&plane)[8], int cols, uint8_t* dst) {
    for (int c = 0; c < cols; ++c)
      for (int j = 0; j < kBlock; ++j)
        dst[32 * (j / 4) + 4 * c + j % 4] = static_cast<uint8_t>(dst[32 * (j / 4) + 4 * c + j % 4] +
                                                                 16 * ((plane[c][j / 8] >> (j % 8)) & 1));
  }
  template <class SC>
  static V spread2(const SC* f) {  // f[0] in lanes 0..3, f[1] in 4..7
    V r;
    for (int l = 0; l < 8; ++l) r.v[l] = scale(f[l / 4]);
    return r;
  }
  static V mul(V a, V b) {
    for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static V fmadd(V a, V b, V acc) {  // acc + a * b, rounded once
    for (int l = 0; l < 8; ++l) acc.v[l] = std::fma(a.v[l], b.v[l], acc.v[l]);
    return acc;
  }
  static V madd_low(V acc, V4 a, float d, float s) {  // lanes 0..3 += (a * d) * s; lanes 4..7 unchanged
    for (int l = 0; l < 4; ++l) acc.v[l] = std::fma(a.v[l] * d, s, acc.v[l]);
    return acc;
  }
  static V madd_low(V acc, V4 a, float d) {  // lanes 0..3 += a * d, rounded once
    for (int l = 0; l < 4; ++l) acc.v[l] = std::fma(a.v[l], d, acc.v[l]);
    return acc;
  }
  static V splat(float f) {
    V r;
    for (int l = 0; l < 8; ++l) r.v[l] = f;
    return r;
  }
  static V load8(const float* f) {
    V r;
    for (int l = 0; l < 8; ++l) r.v[l] = f[l];
    return r;
  }
  static void store8(float* f, V v) {
    for (int l = 0; l < 8; ++l) f[l] = v.v[l];
  }
  // An int4 panel's codes for one whole block of 8 rows (quant_dot_gemm.inc): row[c] holds row c's 16
  // stored bytes (byte i: position i in the low nibble, 16 + i in the high); dst gets 256 bytes, [group k
  // of 4 positions][row c][4]: group k < 4 is bytes 4k..4k+3's low nibbles, group k + 4 their high ones.
  static void pack_codes8(const uint8_t* const (&row)[8], uint8_t* dst) {
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < 4; ++k)
        for (int e = 0; e < 4; ++e) {
          dst[32 * k + 4 * c + e] = row[c][4 * k + e] & 0xF;
          dst[32 * (k + 4) + 4 * c + e] = row[c][4 * k + e] >> 4;
        }
  }
  // One block of an int4 panel (quant_dot_gemm.inc) for R input rows: lane c of acc[r] += (idot(column
  // c's block, row r's block) * d[r]) * s[c] (two roundings, as the other tiles' per-block step). wb:
  // the block's 256 unpacked codes, [group g of 4 positions][column c][4]; x[r]: row r's 32 activations.
  // kFive (5-bit codes, GGUF Q5_K packed) only changes how the AVX2 build sums.
  template <int R, bool kFive = false>
  static void panel_block(const uint8_t* wb, const int8_t* const (&x)[R], const float (&d)[R], V s, V (&acc)[R]) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 8; ++c) {
        int32_t t = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e) t += static_cast<int32_t>(wb[32 * g + 4 * c + e]) * x[r][4 * g + e];
        acc[r].v[c] = std::fma(static_cast<float>(t) * d[r], s.v[c], acc[r].v[c]);
      }
  }
  // An int8 panel's values for one whole block of 8 rows (quant_dot_gemm.inc): row[c] holds row c's 32
  // values; dst gets 256 bytes, [group g of 4 positions][row c][4]: positions 4g..4g+3 of row c.
  static void pack_values8(const int8_t* const (&row)[8], int8_t* dst) {
    for (int g = 0; g < 8; ++g)
      for (int c = 0; c < 8; ++c)
        for (int e = 0; e < 4; ++e) dst[32 * g + 4 * c + e] = row[c][4 * g + e];
  }
  // One block of an int8 panel for R input rows: lane c of acc[r] += idot(column c's block, row r's
  // block) * (d[r] * s[c]), one rounding in the factor and one in the multiply-add (the one-row int8
  // tiles' step). kHalf (group 16): the block's halves, positions 0..15 and 16..31, each with its own
  // factor (s[c] and s[8 + c]), low half first. kRange (kI8Full, kI8Small: values within -32..32) only
  // changes how the AVX2 build sums; the integer dots are exact either way.
  // kStored (GGUF Q6_K packed): the block is in int4 stored order (int4_natural), where the halves are
  // groups 0, 1, 4, 5 (natural positions 0..15) and 2, 3, 6, 7.
  template <int R, bool kHalf, int kRange, bool kStored = false>
  static void panel_block_i8(const int8_t* wb, const int8_t* const (&x)[R], const float (&d)[R], const float* s,
                             V (&acc)[R]) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 8; ++c) {
        int32_t t[2] = {0, 0};
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e)
            t[kStored ? g / 2 % 2 : g / 4] += static_cast<int32_t>(wb[32 * g + 4 * c + e]) * x[r][4 * g + e];
        if constexpr (kHalf) {
          acc[r].v[c] = std::fma(static_cast<float>(t[0]), d[r] * s[c], acc[r].v[c]);
          acc[r].v[c] = std::fma(static_cast<float>(t[1]), d[r] * s[8 + c], acc[r].v[c]);
        } else {
          acc[r].v[c] = std::fma(static_cast<float>(t[0] + t[1]), d[r] * s[c], acc[r].v[c]);
        }
      }
  }
  // Quantizes x[0..n) (n <= 32; the rest of the block is zero) into q (32 bytes); returns d.
  static float quantize_block(const float* x, int n, int8_t* q, bool int4_order) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    int8_t nat[kBlock] = {};
    if (d > 0.0f)
      for (int i = 0; i < n; ++i) {
        const float r = std::nearbyint(x[i] / d);
        nat[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
      }
    for (int p = 0; p < kBlock; ++p) q[p] = nat[int4_order ? int4_natural(p) : p];
    return d;
  }
};

#if defined(KVQ_X86)
KVQ_PUSH_AVX2
struct Avx2 {
  using V = __m256;
  using V4 = __m128;
  using X = __m256i;
  struct X4 {  // an int4-ordered activation block: positions 0..15 and 16..31
    __m128i lo, hi;
  };
  struct W {  // int8: the values and their absolute values
    __m256i v, abs;
  };
  struct W4 {  // int4: the codes at positions 0..15 (low nibbles) and 16..31 (high nibbles)
    __m128i lo, hi;
  };
  static W w_i8(const int8_t* w) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return W{v, _mm256_abs_epi8(v)};
  }
  static W4 w_i4(const uint8_t* w) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), m = _mm_set1_epi8(0xF);
    return W4{_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m)};
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V4 zero4() { return _mm_setzero_ps(); }
  static X load_x(const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }
  static X4 load_x4(const int8_t* q) {
    return X4{_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))};
  }
  static V madd(V acc, V a, float s) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), acc); }
  static V4 madd(V4 acc, V4 a, float s) { return _mm_fmadd_ps(a, _mm_set1_ps(s), acc); }
  static V madd2(V acc, V a, float lo, float hi) {
    return _mm256_fmadd_ps(a, _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)), acc);
  }
  static float hsum(V4 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float scale(float s) { return s; }
  static float scale(uint16_t h) { return _cvtsh_ss(h); }
  static void expand_k(const uint8_t* rec, float* s, float* o) {  // Portable::expand_k, 8 lanes at once
    uint16_t hd, hm;
    std::memcpy(&hd, rec, sizeof hd);
    std::memcpy(&hm, rec + 2, sizeof hm);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 4))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 12))));
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(hd)), sc));
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(hm)), m));
  }
  static void expand_q6(const uint8_t* rec, float* s) {  // Portable::expand_q6, 8 lanes at once
    uint16_t hd;
    std::memcpy(&hd, rec, sizeof hd);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
    for (int h = 0; h < 2; ++h) {
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 2 + 8 * h));
      _mm256_storeu_ps(s + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    }
  }
  static V k_scales8(const uint8_t* rec) {  // Portable::k_scales8
    uint16_t hd;
    std::memcpy(&hd, rec, sizeof hd);
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(hd)), bytes8(rec + 4));
  }
  static V k_offsets8(const uint8_t* rec) {  // Portable::k_offsets8
    uint16_t hm;
    std::memcpy(&hm, rec + 2, sizeof hm);
    return _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(hm)), bytes8(rec + 12));
  }
  static __m256 bytes8(const uint8_t* b) {  // 8 unsigned bytes as float32
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
  }
  template <int I>
  static V pair_of(V s) {  // Portable::pair_of
    constexpr int lo = 2 * I, hi = 2 * I + 1;
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
  }
  static __m256 load8(const float* s) { return _mm256_loadu_ps(s); }
  static __m256 load8(const uint16_t* s) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  template <class SC>
  static float offset_dot(const SC* o, const float* xs, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(load8(o + g), _mm256_loadu_ps(xs + g), acc);
    float t = hsum(acc);
    for (; g < groups; ++g) t = std::fma(scale(o[g]), xs[g], t);
    return t;
  }
  static V pairs(__m256i p16) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1))); }
  static V dot_i8(const W& w, X x) {
    // |w| * (x with w's sign) = w * x; |w|, |x| <= 127, so a pair sum fits int16 without saturating
    return pairs(_mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.v)));
  }
  static V4 dot_i4(const W4& w, X4 x) {
    // codes 0..15 are unsigned (no sign trick); a pair sum is at most 2 * 15 * 127, so the two halves'
    // int16 sums add without saturating
    const __m128i p16 = _mm_add_epi16(_mm_maddubs_epi16(w.lo, x.lo), _mm_maddubs_epi16(w.hi, x.hi));
    return _mm_cvtepi32_ps(_mm_madd_epi16(p16, _mm_set1_epi16(1)));
  }
  // Portable's block pairs in one 256-bit pass: the two blocks' codes are one 32-byte load, and each
  // 128-bit half of the products is one block's, with the lanes dot_i4 gives (the same int32 sums).
  struct W4x2 {  // [b low nibbles | b + 1 low nibbles], [b high | b + 1 high]
    __m256i lo, hi;
  };
  using X4x2 = W4x2;  // the activations in the same halves
  static W4x2 w_i4x2(const uint8_t* w) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), m = _mm256_set1_epi8(0xF);
    return W4x2{_mm256_and_si256(t, m), _mm256_and_si256(_mm256_srli_epi16(t, 4), m)};
  }
  static __m256i two_halves(const int8_t* a, const int8_t* b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  }
  static X4x2 x_i4x2(const int8_t* q) {
    return X4x2{two_halves(q, q + kBlock), two_halves(q + 16, q + kBlock + 16)};
  }
  static V dot_i4x2(const W4x2& w, const X4x2& x) {
    const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, x.lo), _mm256_maddubs_epi16(w.hi, x.hi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
  }
  // Portable::w_i5x2: each byte of the plane spread to 8 byte lanes ([b bits 0..15 | b + 1 bits 0..15]
  // beside the low nibbles, bits 16..31 beside the high ones), its bit tested, 16 where set.
  using W5x2 = W4x2;
  static W5x2 w_i5x2(const uint8_t* w, const uint8_t* plane) {
    W4x2 r = w_i4x2(w);
    int64_t eight;
    std::memcpy(&eight, plane, sizeof eight);
    const __m256i v = _mm256_set1_epi64x(eight);
    const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL)), sixteen = _mm256_set1_epi8(16);
    const __m256i lo_at = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                           4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5);
    const __m256i hi_at = _mm256_add_epi8(lo_at, _mm256_set1_epi8(2));
    const auto fifth = [&](__m256i at) {
      const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(v, at), bits);
      return _mm256_and_si256(_mm256_cmpeq_epi8(b, bits), sixteen);
    };
    r.lo = _mm256_or_si256(r.lo, fifth(lo_at));
    r.hi = _mm256_or_si256(r.hi, fifth(hi_at));
    return r;
  }
  // codes up to 31: a pair sum is at most 2 * 31 * 127, two of them fit int16 (dot_i4x2's sums)
  static V dot_i5x2(const W5x2& w, const X4x2& x) { return dot_i4x2(w, x); }
  // Portable::w_i6x2 with the codes unsigned (0..63): the pair's 16 plane bytes in both 128-bit halves;
  // a nibble of a plane byte holds two positions' bits (block b's, block b + 1's: q6_plane_bits), and a
  // table lookup per 128-bit half (vpshufb: block b's half takes bits 0-1, block b + 1's bits 2-3) gives
  // 16 times the lane's own.
  static W4x2 w_i6x2(const uint8_t* w, const uint8_t* plane) {
    W4x2 r = w_i4x2(w);
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    const __m256i m = _mm256_set1_epi8(0xF);
    const __m256i table = _mm256_setr_epi8(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48,  //
                                           0, 0, 0, 0, 16, 16, 16, 16, 32, 32, 32, 32, 48, 48, 48, 48);
    r.lo = _mm256_or_si256(r.lo, _mm256_shuffle_epi8(table, _mm256_and_si256(v, m)));
    r.hi = _mm256_or_si256(r.hi, _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m)));
    return r;
  }
  // 32 times each int16 pair sum of an activation pair (both nibble halves added): |.| <= 2 * 2 * 32 * 127
  using C6 = __m256i;
  static C6 x_sum32(const X4x2& x) {
    const __m256i k = _mm256_set1_epi8(32);
    return _mm256_add_epi16(_mm256_maddubs_epi16(k, x.lo), _mm256_maddubs_epi16(k, x.hi));
  }
  // dot_i4x2 on codes 0..63 (a pair sum at most 2 * 63 * 127, two of them 32004: int16) minus x_sum32:
  // wrapping int16 arithmetic whose result, the dot of the values -32..31 (|.| <= 4 * 32 * 127), fits
  static V dot_i6x2(const W4x2& w, const X4x2& x, C6 c) {
    const __m256i p16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, x.lo), _mm256_maddubs_epi16(w.hi, x.hi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_sub_epi16(p16, c), _mm256_set1_epi16(1)));
  }
  template <int P>
  static V q6_pair(const float* s) {  // Portable::q6_pair
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 4 * P)),
                                    _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  static void q6_values(const uint8_t* w, const uint8_t* plane, int odd, int8_t* out) {  // Portable::q6_values
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)), m = _mm_set1_epi8(0xF);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m), _mm_and_si128(p, m));
    // 16 times a nibble's bits 0-1 (block b) or 2-3 (block b + 1)
    const __m256i table = odd ? _mm256_setr_epi8(0, 0, 0, 0, 16, 16, 16, 16, 32, 32, 32, 32, 48, 48, 48, 48,  //
                                                 0, 0, 0, 0, 16, 16, 16, 16, 32, 32, 32, 32, 48, 48, 48, 48)
                              : _mm256_setr_epi8(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48,  //
                                                 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);
    const __m256i v = _mm256_or_si256(codes, _mm256_shuffle_epi8(table, nibbles));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_sub_epi8(v, _mm256_set1_epi8(32)));
  }
  // A Q5_K block's 4 plane bytes as 32 bytes: byte j is 16 where bit j is set, else 0 (byte j / 8 of
  // the plane beside lane j, its bit j % 8 tested: w_i5x2's spread).
  static __m256i fifth_bits16(const uint8_t* plane) {
    int32_t four;
    std::memcpy(&four, plane, sizeof four);
    const __m256i at = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(four), at), bits), bits);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
  }
  static void q5_codes(const uint8_t* w, const uint8_t* plane, uint8_t* out) {  // Portable::q5_codes
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), m = _mm_set1_epi8(0xF);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_or_si256(codes, fifth_bits16(plane)));
  }
  // Portable::add_plane8: each row's fifth bits spread to bytes (fifth_bits16), moved into the panel's
  // [group][row][4] order by pack_values8's transpose of 4-byte words, and or'ed into the codes (0..15).
  static void add_plane8(const uint8_t* const (&plane)[8], int cols, uint8_t* dst) {
    alignas(32) int8_t spread[8][kBlock];
    const int8_t* rows[8];
    for (int c = 0; c < 8; ++c) {
      rows[c] = spread[c];
      _mm256_store_si256(reinterpret_cast<__m256i*>(spread[c]), c < cols ? fifth_bits16(plane[c]) : _mm256_setzero_si256());
    }
    alignas(32) int8_t bits[8 * kBlock];
    pack_values8(rows, bits);
    for (int k = 0; k < 8; ++k) {
      __m256i* d = reinterpret_cast<__m256i*>(dst + 32 * k);
      _mm256_storeu_si256(d, _mm256_or_si256(_mm256_loadu_si256(d), _mm256_load_si256(reinterpret_cast<const __m256i*>(bits + 32 * k))));
    }
  }
  static V spread2(const float* f) { return _mm256_set_m128(_mm_set1_ps(f[1]), _mm_set1_ps(f[0])); }
  static V spread2(const uint16_t* f) {  // the two float16 widened, then spread as the float32 form
    int32_t two;
    std::memcpy(&two, f, sizeof two);
    const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static V madd_low(V acc, V4 a, float d, float s) {
    const __m128 lo = _mm_fmadd_ps(_mm_mul_ps(a, _mm_set1_ps(d)), _mm_set1_ps(s), _mm256_castps256_ps128(acc));
    return _mm256_insertf128_ps(acc, lo, 0);
  }
  static V madd_low(V acc, V4 a, float d) {
    return _mm256_insertf128_ps(acc, _mm_fmadd_ps(a, _mm_set1_ps(d), _mm256_castps256_ps128(acc)), 0);
  }
  static V splat(float f) { return _mm256_set1_ps(f); }
  static void store8(float* f, V v) { _mm256_storeu_ps(f, v); }
  // Portable::pack_codes8 as a transpose of 4-byte words: rows c and c + 4 in one vector's halves, then
  // the 4 x 4 transpose within each half leaves word k of rows 0..7 in vector k.
  static void pack_codes8(const uint8_t* const (&row)[8], uint8_t* dst) {
    __m256i v[4];
    for (int c = 0; c < 4; ++c)
      v[c] = two_halves(reinterpret_cast<const int8_t*>(row[c]), reinterpret_cast<const int8_t*>(row[c + 4]));
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i words[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    const __m256i m = _mm256_set1_epi8(0xF);
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * k), _mm256_and_si256(words[k], m));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * (k + 4)),
                          _mm256_and_si256(_mm256_srli_epi16(words[k], 4), m));
    }
  }
  // Portable::panel_block with one weight load per group of 4 positions for all R rows: each 32-bit
  // lane of a group's load is one column's 4 codes, times row r's 4 activations broadcast to every
  // lane; the 8 groups' int16 pair sums add up in int16 (each at most 2 * 15 * 127, so 8 of them fit),
  // then one vpmaddwd makes lane c column c's exact int32 block dot.
  // kFive (codes up to 31, GGUF Q5_K packed): 4 groups' pair sums fit int16 (4 * 2 * 31 * 127), so each
  // half block gets its own vpmaddwd and the two add in int32.
  template <int R, bool kFive = false>
  static void panel_block(const uint8_t* wb, const int8_t* const (&x)[R], const float (&d)[R], V s, V (&acc)[R]) {
    __m256i t[R], half[R];
    for (int g = 0; g < 8; ++g) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * g));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x[r] + 4 * g, sizeof four);
        const __m256i p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(four));
        t[r] = g == 0 || (kFive && g == 4) ? p : _mm256_add_epi16(t[r], p);
        // keeps each row's sum one running register: left free, the compiler reassociates the adds into
        // a tree over all 8 * R products, which spills them to the stack
        __asm__("" : "+x"(t[r]));
      }
      if (kFive && g == 3)
        for (int r = 0; r < R; ++r) half[r] = _mm256_madd_epi16(t[r], _mm256_set1_epi16(1));
    }
    for (int r = 0; r < R; ++r) {
      __m256i pair = _mm256_madd_epi16(t[r], _mm256_set1_epi16(1));
      if constexpr (kFive) pair = _mm256_add_epi32(half[r], pair);
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(pair), _mm256_set1_ps(d[r]));
      acc[r] = _mm256_fmadd_ps(f, s, acc[r]);
    }
  }
  // Portable::pack_values8 as an 8 x 8 transpose of 4-byte words.
  static void pack_values8(const int8_t* const (&row)[8], int8_t* dst) {
    __m256i v[8];
    for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[c]));
    __m256i t[8], u[8];
    for (int c = 0; c < 8; c += 2) {
      t[c] = _mm256_unpacklo_epi32(v[c], v[c + 1]);      // words 0 1 (4 5) of rows c, c + 1, interleaved
      t[c + 1] = _mm256_unpackhi_epi32(v[c], v[c + 1]);  // words 2 3 (6 7)
    }
    for (int c = 0; c < 8; c += 4)
      for (int h = 0; h < 2; ++h) {
        u[c + 2 * h] = _mm256_unpacklo_epi64(t[c + h], t[c + 2 + h]);      // word 2h (2h + 4) of rows c..c+3
        u[c + 2 * h + 1] = _mm256_unpackhi_epi64(t[c + h], t[c + 2 + h]);  // word 2h + 1 (2h + 5)
      }
    for (int g = 0; g < 4; ++g) {  // u[g]: rows 0..3, words g and g + 4; u[4 + g]: rows 4..7
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * g), _mm256_permute2x128_si256(u[g], u[4 + g], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * (g + 4)),
                          _mm256_permute2x128_si256(u[g], u[4 + g], 0x31));
    }
  }
  // Portable::panel_block_i8: each 32-bit lane of a group's load is one column's 4 values; |w| times
  // row r's 4 activations broadcast with w's signs (vpmaddubsw: a pair sum is at most 2 * 128 * 127, so
  // it fits int16 once), each group's pair sums widened to int32 (vpmaddwd) and added. kI8Small (|w| <=
  // 32): a half block's 4 groups add up in int16 first (4 * 2 * 32 * 127 fits), one vpmaddwd per half.
  template <int R, bool kHalf, int kRange, bool kStored = false>
  static void panel_block_i8(const int8_t* wb, const int8_t* const (&x)[R], const float (&d)[R], const float* s,
                             V (&acc)[R]) {
    constexpr int H = kHalf ? 2 : 1;
    constexpr int kAt[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // kStored: the groups of half h are kAt[4h .. 4h + 3]
    constexpr bool kSmall = kRange == kI8Small;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i t[R][H];
    for (int h = 0; h < 2; ++h) {
      __m256i t16[R];
      for (int i = 4 * h; i < 4 * h + 4; ++i) {
        const int g = kStored ? kAt[i] : i;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * g));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, x[r] + 4 * g, sizeof four);
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(four), w));
          if constexpr (kSmall) {
            t16[r] = i == 4 * h ? p : _mm256_add_epi16(t16[r], p);
            __asm__("" : "+x"(t16[r]));  // one running sum per row (as panel_block)
          } else {
            const __m256i q = _mm256_madd_epi16(p, ones);
            __m256i& dst = t[r][kHalf ? h : 0];
            dst = i == 4 * h && (kHalf || h == 0) ? q : _mm256_add_epi32(dst, q);
            __asm__("" : "+x"(dst));
          }
        }
      }
      if constexpr (kSmall)
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_madd_epi16(t16[r], ones);
          t[r][kHalf ? h : 0] = kHalf || h == 0 ? q : _mm256_add_epi32(t[r][0], q);
        }
    }
    const __m256 s0 = _mm256_loadu_ps(s);
    for (int r = 0; r < R; ++r) {
      const __m256 dr = _mm256_set1_ps(d[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][0]), _mm256_mul_ps(dr, s0), acc[r]);
      if constexpr (kHalf)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][1]), _mm256_mul_ps(dr, _mm256_loadu_ps(s + 8)), acc[r]);
    }
  }
  static float quantize_block(const float* x, int n, int8_t* q, bool int4_order) {
    alignas(32) float buf[kBlock];
    const float* src = x;
    if (n < kBlock) {
      std::memset(buf, 0, sizeof buf);
      std::memcpy(buf, x, sizeof(float) * n);
      src = buf;
    }
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int u = 0; u < 4; ++u) {
      v[u] = _mm256_loadu_ps(src + 8 * u);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[u], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    if (!(d > 0.0f)) {
      std::memset(q, 0, kBlock);
      return d;
    }
    const __m256 vd = _mm256_set1_ps(d);
    __m256i i[4];
    for (int u = 0; u < 4; ++u) i[u] = _mm256_cvtps_epi32(_mm256_div_ps(v[u], vd));  // round half to even
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    b = _mm256_max_epi8(b, _mm256_set1_epi8(-127));
    // the packs leave dwords in the order 0 2 4 6 1 3 5 7 (of 4 activations each)
    const __m256i order =
        int4_order ? _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7) : _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, order));
    return d;
  }
};
KVQ_POP

// AVX-512 VNNI (with VL, 256- and 128-bit forms): vpdpbusd multiplies unsigned by signed bytes and adds
// each group of four products into an int32 lane in one instruction, without the int16 stage. Its lanes
// are the same exact int32 sums as Avx2's (lane l = positions 4l..4l+3; int4: plus 16+4l..16+4l+3), so
// everything after the dot, and the bits, are Avx2's.
KVQ_PUSH_VNNI
struct Vnni : Avx2 {
  using Avx2::hsum;
  static float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }  // the pair tiles' 16 lanes
  static V dot_i8(const W& w, X x) {
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.abs, _mm256_sign_epi8(x, w.v)));
  }
  static V4 dot_i4(const W4& w, X4 x) {
    const __m128i t = _mm_dpbusd_epi32(_mm_setzero_si128(), w.lo, x.lo);
    return _mm_cvtepi32_ps(_mm_dpbusd_epi32(t, w.hi, x.hi));
  }

  // Two blocks (b, b + 1) per 512-bit vector, for weights with one scale per block (quant_dot_pairs.inc).
  // int8: 64 bytes, lanes 0..7 = block b, 8..15 = block b + 1. int4: 16-byte chunks [b low nibbles,
  // b + 1 low, b high, b + 1 high], lanes 4c..4c+3 from chunk c; the activations are put in that order.
  struct WP8 {  // int8: the absolute values and the mask of the negative ones
    __m512i abs;
    __mmask64 neg;
  };
  static WP8 w_pair_i8(const int8_t* w) {
    const __m512i v = _mm512_loadu_si512(w);
    return WP8{_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
  }
  static __m512i w_pair_i4(const uint8_t* w) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0xF));
  }
  static __m512i x_pair_i8(const int8_t* q) { return _mm512_loadu_si512(q); }
  static __m512i x_pair_i4(const int8_t* q) {  // stored [b lo, b hi, b+1 lo, b+1 hi] -> chunks 0 2 1 3
    const __m512i x = _mm512_loadu_si512(q);
    return _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));
  }
  static __m512 dot_pair_i8(const WP8& w, __m512i x) {  // |w| * (x negated where w < 0) = w * x
    const __m512i xs = _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.abs, xs));
  }
  static __m512 dot_pair_i4(__m512i w, __m512i x, __m512i init) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, w, x));
  }
  // int4, four blocks (b .. b + 3) per step: lo holds the four blocks' low-nibble codes (16 bytes each,
  // block b + k in 128-bit lane k), hi their high-nibble codes in the same lanes; the activations in
  // the same two halves. Both halves' products add into one int32 lane (a lane's 8 products, 4 of each
  // half, at most 8 * 15 * 127), so one conversion, multiply and multiply-add serve 128 weights, and
  // one 512-bit unpack (a shift, two masks) serves four blocks where w_pair_i4's serves two.
  struct Quad {
    __m512i lo, hi;
  };
  // a: the 32 stored bytes of blocks b, b + 1; c: those of b + 2, b + 3 (int4_rows.h's chunks)
  static Quad w_quad_i4(const uint8_t* a, const uint8_t* c) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), 1);
    const __m512i m = _mm512_set1_epi8(0xF);
    return Quad{_mm512_and_si512(t, m), _mm512_and_si512(_mm512_srli_epi16(t, 4), m)};
  }
  // The four stored activation blocks at q ([lo 16, hi 16] each) as w_quad_i4's halves.
  static Quad x_quad_i4(const int8_t* q) {
    const __m512i x0 = _mm512_loadu_si512(q), x1 = _mm512_loadu_si512(q + 2 * kBlock);
    return Quad{_mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1))};
  }
  // lanes 4k .. 4k + 3: block b + k's exact integer dot, in four partial sums, plus init's lanes
  static __m512 dot_quad_i4(const Quad& w, const Quad& x, __m512i init) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, w.lo, x.lo), w.hi, x.hi));
  }
  // Symmetric int4 (w = (code - 8) * s: GGUF Q4_0): -8 times the sum of each lane's activations, for
  // the lanes of dot_quad_i4 (neg8_quad), dot_pair_i4 (neg8_pair) and the 8-lane dot8 (neg8_8). Started
  // from it, a dot is the block's exact integer dot with the weights' values, so the tile needs no
  // offset term (|.| <= 8 * 8 * 127 beside a code dot of at most 8 * 15 * 127: int32).
  static __m512i neg8_quad(const Quad& x) {
    const __m512i e = _mm512_set1_epi8(8);
    const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), e, x.lo), e, x.hi);
    return _mm512_sub_epi32(_mm512_setzero_si512(), t);
  }
  static __m512i neg8_pair(__m512i x) {
    const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), x);
    return _mm512_sub_epi32(_mm512_setzero_si512(), t);
  }
  static __m256i neg8_8(const int8_t* q) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(8), x);
    return _mm256_sub_epi32(_mm256_setzero_si256(), t);
  }
  // The two floats at f (block b's and b + 1's) spread over the lanes of their blocks.
  template <class SC>
  static __m512 spread_i8(const SC* f) { return spread(f, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)); }
  template <class SC>
  static __m512 spread_i4(const SC* f) { return spread(f, _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)); }
  // The four group-16 scales at f (blocks b and b + 1, two halves each), each over its four lanes.
  template <class SC>
  static __m512 spread_halves(const SC* f) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(four(f)));
  }
  static __m128 four(const float* f) { return _mm_loadu_ps(f); }
  static __m128 four(const uint16_t* f) {
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f)));
  }
  static __m512 spread(const float* f, __m512i idx) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
  }
  static __m512 spread(const uint16_t* f, __m512i idx) {
    int32_t two;
    std::memcpy(&two, f, sizeof two);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two))));
  }
  // One block's products as 8 float lanes (int4: the low-nibble half in lanes 0..3, the high in 4..7).
  static V dot8(const W& w, const int8_t* q) { return dot_i8(w, load_x(q)); }
  static V dot8(const W4& w, const int8_t* q, __m256i init) {  // plus init's lanes
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, _mm256_set_m128i(w.hi, w.lo), x));
  }
};
KVQ_POP
#endif

}  // namespace kvqd_simd
