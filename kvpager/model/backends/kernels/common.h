// kvpager CPU kernels (float32), shared part: math helpers and the C ABI. layers.cpp holds the
// per-layer glue of a decode step (linear, norms, SiLU, RoPE + cache write, the fused layer stack),
// attention.cpp the paged decode attention that reads K/V blocks in place.
//
// Plain C ABI, no torch headers: built once per machine by kvpager/model/backends/kernels/build.py
// with the system C++ compiler (-O3 -march=native -fopenmp; KVPAGER_KERNEL_ISA=portable adds
// -mno-avx512f) and called through the checked binding of binding.py with tensor data pointers.
// Every AVX-512 branch (#if defined(__AVX512F__)) has a portable branch doing the same work.
// OpenMP resolves to the libgomp torch already loaded, so torch.set_num_threads governs these loops too.
//
// Every function mirrors a torch reference in kvpager/model/backends/ops.py (TorchOps); the tests compare them.
// Layouts (row-major, float32 unless stated):
//   qkv row:   [num_heads * head_dim | num_kv_heads * head_dim (K) | num_kv_heads * head_dim (V)]
//   KV cache:  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32, bfloat16 or
//              float16 (kv_format 0 / 1 / 2); 16-bit elements are widened to float32 in registers on
//              load and rounded to nearest even on store, so every kernel computes in float32
//   cos, sin:  [num_tokens, head_dim / 2] (rotate-half RoPE, as transformers' Llama)

#pragma once

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace kvp {

// Entries per layer in kvp_decode_layers' table (kvpager.model.ops builds it with the same width).
constexpr int64_t kLayerTableWidth = 16;
// The layer table's layout code of a quantized weight multiplied part by part as kvp_decode_layers'
// weight_parts describes (fused_stack.PARTS_LAYOUT). Block strides are > 0, packed 16-bit weights
// -(fmt + 1) for fmt 0..3.
constexpr int64_t kPartsLayout = -1024;
// weight_parts [L, 4 weights, kMaxParts, kPartWidth] (fused_stack.MAX_PARTS / PART_WIDTH): per row part
// of a weight, in row order, (kind, codes, scales, offsets, format value, group, rows, 0); kind
// kPartDot: kvq_dot_linear (int8 activations), kPartPacked: kvq_linear (exact int8 / int4), 0: no
// more parts. A GGUF projection whose parts differ in format (gguf_packed.RowStack) has several.
constexpr int64_t kMaxParts = 3;
constexpr int64_t kPartWidth = 8;
constexpr int64_t kPartDot = 1;
constexpr int64_t kPartPacked = 2;

// KV cache elements: float32, bfloat16 held as its upper 16 bits (torch's layout and rounding), or
// IEEE float16 (a distinct type so that every template below picks its own conversion).
using bf16_t = uint16_t;
struct f16_t {
  uint16_t bits;
};
constexpr int64_t kKvFloat32 = 0, kKvBfloat16 = 1, kKvFloat16 = 2;  // kv_format (abi.py)
inline int64_t kv_bytes(int64_t kv_format) { return kv_format == kKvFloat32 ? 4 : 2; }

inline float kv_load(float v) { return v; }
inline float kv_load(bf16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }
// float16 -> float32 is exact: F16C's vcvtph2ps where the target has it, else the bit layout by hand.
inline float kv_load(f16_t v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.bits);
#else
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1Fu, man = v.bits & 0x3FFu;
  if (exp == 0x1Fu) return __builtin_bit_cast(float, sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return __builtin_bit_cast(float, sign | ((exp + 112u) << 23) | (man << 13));
#endif
}
inline void kv_store(float* dst, float v) { *dst = v; }
// Round to nearest even, bit for bit torch's float -> bfloat16 conversion for every number; a NaN is
// written as 0x7FC0 (torch may write another NaN pattern, e.g. 0xFFFF).
inline void kv_store(bf16_t* dst, float v) {
  const uint32_t b = __builtin_bit_cast(uint32_t, v);
  *dst = std::isnan(v) ? bf16_t(0x7FC0) : bf16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
// Round to nearest even (overflow to inf, subnormals kept): what torch's float -> float16 does.
inline void kv_store(f16_t* dst, float v) {
#if defined(__F16C__)
  dst->bits = static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  // Scale so the float32 adder rounds the mantissa at float16's precision (normal and subnormal
  // alike), then read the rounded exponent and mantissa back out of the sum.
  const uint32_t w = __builtin_bit_cast(uint32_t, v), twice = w + w, sign = w & 0x80000000u;
  float base = (std::fabs(v) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = twice & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = __builtin_bit_cast(float, (bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = __builtin_bit_cast(uint32_t, base);
  const uint32_t rounded = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  dst->bits = static_cast<uint16_t>((sign >> 16) | (twice > 0xFF000000u ? 0x7E00u : rounded));
#endif
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVP_AVX2 1
// 8 KV elements widened to float32 (the AVX2 branch of the loops below).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// q . k over n elements, k in any KV format (float32 accumulation).
template <typename T>
inline float kv_dot(const float* __restrict q, const T* __restrict k, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(KVP_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
  s = hsum8(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += q[i] * kv_load(k[i]);
  return s;
}

// a += p * v over n elements, v in any KV format.
template <typename T>
inline void kv_axpy(float p, const T* __restrict v, float* __restrict a, int64_t n) {
  int64_t i = 0;
#if defined(KVP_AVX2)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(a + i)));
#endif
  for (; i < n; ++i) a[i] += p * kv_load(v[i]);
}

// dst[i] = src[i] widened to float32.
template <typename T>
inline void kv_widen(const T* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(KVP_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = kv_load(src[i]);
}

// dst[i] = src[i] rounded to T (the cache write).
inline void kv_store_row(float* __restrict dst, const float* __restrict src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void kv_store_row(bf16_t* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) kv_store(dst + i, src[i]);  // NOTE: the compiler vectorises this loop
}
inline void kv_store_row(f16_t* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) kv_store(dst + i, src[i]);
}

// Call f with the cache pointer cast to its element type (kv_format as in abi.py).
template <typename F>
inline void with_kv(int64_t kv_format, const void* p, F&& f) {
  if (kv_format == kKvBfloat16) {
    f(static_cast<const bf16_t*>(p));
  } else if (kv_format == kKvFloat16) {
    f(static_cast<const f16_t*>(p));
  } else {
    f(static_cast<const float*>(p));
  }
}

// Parallelise a loop only when it is worth waking the thread pool.
inline bool worth_threads(int64_t work) { return work >= (1 << 15) && omp_get_max_threads() > 1; }

// exp(x) for float32 within ~2 ulp (Cephes' expf polynomial) written so the compiler vectorises it
// (libm's expf is a scalar call in these loops). exp(-inf) returns ~1e-38 instead of 0: callers only
// ever multiply it with zeros.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes (same polynomial and clamping).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX512F__)
// Lane j of the result = the sum of the 16 lanes of t[j] (a transpose-and-add tree: 45 shuffles and
// adds for 16 dot products instead of 16 separate horizontal reductions).
inline __m512 reduce16(const __m512* t) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// The prefill attention kernels' tasks: (chunk, block of up to `block` query tokens, KV head), numbered
// chunk by chunk; task t's chunk, head, first query (within the chunk), query count and first position.
struct PrefillTask {
  int64_t chunk, kv_head, first_query, num_queries, first_pos;
};

class PrefillTasks {
 public:
  PrefillTasks(int64_t num_chunks, const int64_t* query_len, const int64_t* seq_len, int64_t num_kv_heads,
               int64_t block)
      : first_(num_chunks + 1, 0), query_len_(query_len), seq_len_(seq_len), heads_(num_kv_heads), block_(block) {
    for (int64_t c = 0; c < num_chunks; ++c) first_[c + 1] = first_[c] + (query_len[c] + block - 1) / block * heads_;
  }
  int64_t size() const { return first_.back(); }
  PrefillTask operator[](int64_t t) const {
    const int64_t c = std::upper_bound(first_.begin(), first_.end(), t) - first_.begin() - 1;
    const int64_t local = t - first_[c], i0 = local / heads_ * block_;
    const int64_t n = std::min(block_, query_len_[c] - i0);
    return {c, local % heads_, i0, n, seq_len_[c] - query_len_[c] + i0};
  }

 private:
  std::vector<int64_t> first_;
  const int64_t* query_len_;
  const int64_t* seq_len_;
  int64_t heads_, block_;
};

// Runs block(std::integral_constant<int, HD>{}, task, row of its first query in q and out, its chunk's
// block table) for every task as the worksharing loop of the enclosing OpenMP parallel region: one task
// at a time per thread, the last tasks (the longest contexts) first; HD is the head size, 64 or 128 (the
// kernels' two instantiations).
template <class Block>
void for_each_prefill_task(const PrefillTasks& tasks, const int64_t* token_start, const int64_t* block_tables,
                           int64_t max_blocks, int64_t head_dim, const Block& block) {
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = tasks.size() - 1; t >= 0; --t) {
    const PrefillTask k = tasks[t];
    const int64_t row0 = token_start[k.chunk] + k.first_query;
    const int64_t* table = block_tables + k.chunk * max_blocks;
    if (head_dim == 64)
      block(std::integral_constant<int, 64>{}, k, row0, table);
    else
      block(std::integral_constant<int, 128>{}, k, row0, table);
  }
}

}  // namespace kvp

// The C ABI: prototypes generated from kvpager/model/backends/kernels/abi.py (the one declaration,
// checked on every call from Python) by build.py; a definition whose parameter types differ from it
// does not compile.
#include "kvp_abi.h"
