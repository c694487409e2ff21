// kvpager CPU kernels (float32): the per-layer glue of a decode step, fused, and paged decode
// attention that reads K/V blocks in place.
//
// Plain C ABI, no torch headers: built once per machine by kvpager/kernels/build.py with the system
// C++ compiler (-O3 -march=native -fopenmp) and called through ctypes with tensor data pointers.
// OpenMP resolves to the libgomp torch already loaded, so torch.set_num_threads governs these loops too.
//
// Every function mirrors a torch reference in kvpager/model/ops.py (TorchOps); the tests compare them.
// Layouts (row-major, float32 unless stated):
//   qkv row:   [num_heads * head_dim | num_kv_heads * head_dim (K) | num_kv_heads * head_dim (V)]
//   KV cache:  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
//   cos, sin:  [num_tokens, head_dim / 2] (rotate-half RoPE, as transformers' Llama)

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

template <int HD>
inline float dot_fixed(const float* __restrict a, const float* __restrict b) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < HD; ++i) s += a[i] * b[i];
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

// acc[m][r] = x[m] . w[r] for MS input rows and 4 weight rows (each of K floats): 4 * MS independent
// accumulators, each weight vector loaded once for all inputs.
template <int MS>
inline void dot_tile(const float* __restrict x, int64_t K, const float* __restrict w, float acc[4][4]) {
#if defined(__AVX512F__)
  __m512 a[MS][4];
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r) a[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    // NOTE: prefetch the next tile's weight rows: measured 20 -> 26 GB/s at batch 1 (prefetches never fault).
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 5 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 6 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 7 * K + k), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + K + k);
    const __m512 w2 = _mm512_loadu_ps(w + 2 * K + k), w3 = _mm512_loadu_ps(w + 3 * K + k);
    for (int m = 0; m < MS; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      a[m][0] = _mm512_fmadd_ps(w0, xv, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(w1, xv, a[m][1]);
      a[m][2] = _mm512_fmadd_ps(w2, xv, a[m][2]);
      a[m][3] = _mm512_fmadd_ps(w3, xv, a[m][3]);
    }
  }
  if constexpr (MS == 4) {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(&a[0][0]));  // lane m * 4 + r = x[m] . w[r]
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = sums[m * 4 + r];
  } else {
    for (int m = 0; m < MS; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
  }
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r)
      for (int64_t kk = k; kk < K; ++kk) acc[m][r] += x[m * K + kk] * w[r * K + kk];
#else
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = dot(x + m * K, w + r * K, K);
#endif
}

// 1 / sqrt(mean(x^2) + eps) over `dim` floats.
inline float inv_rms(const float* __restrict x, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
}

inline void rms_norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t dim,
                         float eps) {
  const float inv = inv_rms(x, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * w[i];
}

inline void rms_norm_inplace(float* __restrict x, const float* __restrict w, int64_t dim, float eps) {
  const float inv = inv_rms(x, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) x[i] = x[i] * inv * w[i];
}

inline void rope_head(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// Same for a head_dim known only at run time.
void decode_partition_any(const float* __restrict q, int64_t group, int64_t hd, const float* __restrict k_cache,
                          const float* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
                          int64_t kv_stride, int64_t begin, int64_t end, float scale, float* __restrict acc,
                          float* __restrict m, float* __restrict l, float* __restrict scores) {
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  std::fill(acc, acc + group * hd, 0.f);
  int64_t pos = begin;
  while (pos < end) {
    const int64_t blk = pos / block_size, off = pos % block_size;
    const int64_t n = std::min(block_size - off, end - pos);
    const int64_t base = (table[blk] * block_size + off) * kv_stride;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k_cache + base + j * kv_stride;
      for (int64_t g = 0; g < group; ++g) scores[g * block_size + j] = dot(q + g * hd, kr, hd) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * block_size;
      float mb = m[g];
      for (int64_t j = 0; j < n; ++j) mb = std::max(mb, s[j]);
      const float alpha = fast_exp(m[g] - mb);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        s[j] = fast_exp(s[j] - mb);
        sum += s[j];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = mb;
      float* __restrict a = acc + g * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) a[i] *= alpha;
      for (int64_t j = 0; j < n; ++j) {
        const float p = s[j];
        const float* __restrict vr = v_cache + base + j * kv_stride;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) a[i] += p * vr[i];
      }
    }
    pos += n;
  }
}

// One (sequence, KV head, context partition) of decode attention: online softmax over blocks.
// Writes the unnormalised accumulator acc[group][HD], the running max m[group] and sum l[group].
// HD is a multiple of 16 (one AVX-512 register holds 16 floats).


// One (sequence, KV head, context partition) of decode attention: online softmax over chunks of
// at most 16 positions inside a block. Writes the unnormalised accumulator acc[group][HD], the
// running max m[group] and sum l[group]. HD is a multiple of 16 (one AVX-512 register of floats).
template <int HD>
void decode_partition(const float* __restrict q, int64_t group, const float* __restrict k_cache,
                      const float* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
                      int64_t kv_stride, int64_t begin, int64_t end, float scale, float* __restrict acc,
                      float* __restrict m, float* __restrict l, float* __restrict scores) {
#if defined(__AVX512F__)
  constexpr int NV = HD / 16;
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  std::fill(acc, acc + group * HD, 0.f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  alignas(64) float p[16];
  __m512 t[16];
  int64_t pos = begin;
  while (pos < end) {
    const int64_t blk = pos / block_size, off = pos % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, end - pos, 16});
    const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const int64_t base = (table[blk] * block_size + off) * kv_stride;
    const float* kb = k_cache + base;
    const float* vb = v_cache + base;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * HD;
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qg + v * 16);
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= n) {
          t[j] = _mm512_setzero_ps();
          continue;
        }
        const float* kr = kb + j * kv_stride;
        __m512 acc0 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int v = 1; v < NV; ++v) acc0 = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + v * 16), acc0);
        t[j] = acc0;
      }
      const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mask, reduce16(t), scale_v);
      const float mb = std::max(m[g], _mm512_reduce_max_ps(sv));
      const float alpha = fast_exp(m[g] - mb);  // ~0 on the first chunk (m = -inf), times acc = 0
      const __m512 e = _mm512_maskz_mov_ps(mask, fast_exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
      _mm512_store_ps(p, e);
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
      m[g] = mb;
      float* a = acc + g * HD;
      __m512 av[NV];
      const __m512 al = _mm512_set1_ps(alpha);
      for (int v = 0; v < NV; ++v) av[v] = _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), al);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j]);
        const float* vr = vb + j * kv_stride;
        for (int v = 0; v < NV; ++v) av[v] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + v * 16), av[v]);
      }
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a + v * 16, av[v]);
    }
    pos += n;
  }
#else
  decode_partition_any(q, group, HD, k_cache, v_cache, table, block_size, kv_stride, begin, end, scale, acc, m, l,
                       scores);
#endif
}

}  // namespace

extern "C" {

// OpenMP's thread count is per calling thread: the engine may step on a thread other than the one
// that called torch.set_num_threads, so the caller sets it (per step) to torch's.
void kvp_set_num_threads(int64_t n) { omp_set_num_threads(static_cast<int>(n)); }
int64_t kvp_max_threads() { return omp_get_max_threads(); }

// out[m, n] = x[m] . w[n] (+ bias[n]) for a few rows x [M, K] and weights w [N, K] (torch's Linear
// layout). Batch-1 decode is a matrix-vector product bound by reading the weights: each weight row is
// read once for all M inputs, threads split the rows.
void kvp_linear_small(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* out) {
  const int64_t tiles = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (worth_threads(N * K))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * 4, rows = std::min<int64_t>(4, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t ms = std::min<int64_t>(4, M - m0);
      float acc[4][4];
      if (rows == 4 && ms == 4) {
        dot_tile<4>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 1) {
        dot_tile<1>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 2) {
        dot_tile<2>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 3) {
        dot_tile<3>(x + m0 * K, K, w + n0 * K, acc);
      } else {
        for (int64_t m = 0; m < ms; ++m)
          for (int64_t r = 0; r < rows; ++r) acc[m][r] = dot(x + (m0 + m) * K, w + (n0 + r) * K, K);
      }
      for (int64_t m = 0; m < ms; ++m)
        for (int64_t r = 0; r < rows; ++r)
          out[(m0 + m) * N + n0 + r] = acc[m][r] + (bias != nullptr ? bias[n0 + r] : 0.f);
    }
  }
}

// out[r] = x[r] / rms(x[r]) * w, rows of `dim` (row strides in elements).
void kvp_rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride, int64_t rows,
                  int64_t dim, float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, w, out + r * out_stride, dim, eps);
}

// residual[r] += x[r]; out[r] = rms_norm(residual[r]) * w. All contiguous [rows, dim].
void kvp_add_rms_norm(float* residual, const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                      float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict res = residual + r * dim;
    const float* __restrict xr = x + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) res[i] += xr[i];
    rms_norm_row(res, w, out + r * dim, dim, eps);
  }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up [rows, 2 * inter], out [rows, inter].
void kvp_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (worth_threads(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict g = gate_up + r * 2 * inter;
    const float* __restrict u = g + inter;
    float* __restrict o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= inter; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
  }
}

// In place on qkv [num_tokens, row_stride]: optional per-head RMSNorm of q and k (Qwen3; weights of
// head_dim, null when absent), RoPE of every q and k head, then K and V of token t stored at cache
// slot slots[t] (slot = block * block_size + offset; the caches are viewed as [slots, kv_heads, hd]).
void kvp_rope_and_cache(float* qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const float* cos, const float* sin, const float* q_norm,
                        const float* k_norm, float eps, float* k_cache, float* v_cache, const int64_t* slots) {
  const int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
#pragma omp parallel for if (worth_threads(num_tokens * (num_heads + 2 * num_kv_heads) * head_dim))
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* row = qkv + t * row_stride;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* x = row + h * head_dim;
      const float* w = h < num_heads ? q_norm : k_norm;
      if (w != nullptr) rms_norm_inplace(x, w, head_dim, eps);
      rope_head(x, c, s, half);
    }
    const float* k = row + num_heads * head_dim;
    std::memcpy(k_cache + slots[t] * kv_size, k, kv_size * sizeof(float));
    std::memcpy(v_cache + slots[t] * kv_size, k + kv_size, kv_size * sizeof(float));
  }
}

// Decode attention, one query token per sequence, over paged K/V read in place.
// q: token rows[d] of a [*, q_stride] buffer holding num_heads * head_dim; out likewise (out_stride).
// Sequence d attends positions [max(0, seq_lens[d] - window), seq_lens[d]) (window <= 0: all) through
// block_tables[d, :]. Query head h reads KV head h / (num_heads / num_kv_heads). Long contexts are
// split into partitions of `partition` positions merged afterwards (flash-decoding), so one sequence
// still spreads over every thread.
void kvp_paged_decode(const float* q, int64_t q_stride, float* out, int64_t out_stride, const int64_t* rows,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const float* k_cache, const float* v_cache, int64_t block_size, const int64_t* block_tables,
                      int64_t max_blocks, const int64_t* seq_lens, int64_t window, float scale, int64_t partition) {
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * head_dim;
  std::vector<int64_t> first(num_seqs + 1, 0), begin_pos(num_seqs);
  for (int64_t d = 0; d < num_seqs; ++d) {
    const int64_t n = seq_lens[d];
    const int64_t b = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    begin_pos[d] = b;
    first[d + 1] = first[d] + std::max<int64_t>(1, (n - b + partition - 1) / partition);
  }
  const int64_t num_parts = first[num_seqs];
  const int64_t tasks = num_parts * num_kv_heads;
  const int64_t per_task = group * (head_dim + 2);
  std::vector<float> partial(tasks * per_task);
  int64_t positions = 0;
  for (int64_t d = 0; d < num_seqs; ++d) positions += seq_lens[d] - begin_pos[d];
  // NOTE: below ~256k multiply-adds, waking the second thread costs more than it saves (measured).
  const bool threads = omp_get_max_threads() > 1 && num_parts > 1 && positions * num_heads * head_dim >= (1 << 18);
#pragma omp parallel if (threads)
  {
    std::vector<float> scores(group * block_size);
    // NOTE: one task = one (sequence, partition) with every KV head, heads inner: a block's rows hold
    // all heads side by side, so the other heads' bytes the prefetcher pulls in are used from L2
    // (one task per head measured 16 GB/s at batch 32, context ~450).
#pragma omp for schedule(dynamic, 1)
    for (int64_t part = 0; part < num_parts; ++part) {
      const int64_t d = std::upper_bound(first.begin(), first.end(), part) - first.begin() - 1;
      const int64_t begin = begin_pos[d] + (part - first[d]) * partition;
      const int64_t end = std::min(seq_lens[d], begin + partition);
      const int64_t row = rows != nullptr ? rows[d] : d;
      const int64_t* table = block_tables + d * max_blocks;
      for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
        const float* qd = q + row * q_stride + kh * group * head_dim;
        float* acc = partial.data() + (part * num_kv_heads + kh) * per_task;
        float* m = acc + group * head_dim;
        float* l = m + group;
        if (head_dim == 64) {
          decode_partition<64>(qd, group, k_cache + kh * head_dim, v_cache + kh * head_dim, table, block_size,
                               kv_stride, begin, end, scale, acc, m, l, scores.data());
        } else if (head_dim == 128) {
          decode_partition<128>(qd, group, k_cache + kh * head_dim, v_cache + kh * head_dim, table, block_size,
                                kv_stride, begin, end, scale, acc, m, l, scores.data());
        } else {
          decode_partition_any(qd, group, head_dim, k_cache + kh * head_dim, v_cache + kh * head_dim, table,
                               block_size, kv_stride, begin, end, scale, acc, m, l, scores.data());
        }
      }
    }
  }
  // Merge the partitions of each (sequence, KV head): rescale to the common max, then normalise.
#pragma omp parallel for if (threads && num_seqs * num_kv_heads > 1)
  for (int64_t dk = 0; dk < num_seqs * num_kv_heads; ++dk) {
    const int64_t d = dk / num_kv_heads, kh = dk % num_kv_heads;
    const int64_t row = rows != nullptr ? rows[d] : d;
    for (int64_t g = 0; g < group; ++g) {
      float gm = -INFINITY;
      for (int64_t p = first[d]; p < first[d + 1]; ++p) {
        const float* acc = partial.data() + (p * num_kv_heads + kh) * per_task;
        gm = std::max(gm, acc[group * head_dim + g]);
      }
      float* o = out + row * out_stride + (kh * group + g) * head_dim;
      std::fill(o, o + head_dim, 0.f);
      float total = 0.f;
      for (int64_t p = first[d]; p < first[d + 1]; ++p) {
        const float* acc = partial.data() + (p * num_kv_heads + kh) * per_task;
        const float w = fast_exp(acc[group * head_dim + g] - gm);
        total += acc[group * head_dim + group + g] * w;
        const float* a = acc + g * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) o[i] += w * a[i];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) o[i] *= inv;
    }
  }
}

// Every decoder layer of a decode-only step (M <= a few dozen rows) in one call: the same kernels
// the per-op path calls from Python, in the same order, without ~9 Python/ctypes round trips per
// layer. `layers` holds, per layer, 12 addresses (0 = absent): input norm, qkv weight, qkv bias,
// o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down weight, down bias,
// q norm, k norm. On entry x [M, H] is the embedding output; on return x is the last layer's MLP
// output and residual [M, H] the residual stream before it (the caller adds them in the final norm).
// The KV cache is [L, 2, NB, block_size, kv_heads, head_dim]; scratch holds
// M * (q_size + 2 kv_size + q_size + 2 inter + inter + H) floats.
void kvp_decode_layers(float* x, float* residual, int64_t M, int64_t H, int64_t num_layers, const int64_t* layers,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps,
                       float* kv_cache, int64_t num_blocks, int64_t block_size, const float* cos, const float* sin,
                       const int64_t* slots, const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens,
                       int64_t window, float scale, int64_t partition, float* scratch) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  const int64_t half_stride = num_blocks * block_size * kv_size;  // K -> V of one layer, in floats
  float* qkv = scratch;
  float* attn = qkv + M * qkv_size;
  float* gate_up = attn + M * q_size;
  float* act = gate_up + M * 2 * inter;
  float* h = act + M * inter;
  auto f = [](int64_t address) { return reinterpret_cast<float*>(address); };
  std::memcpy(residual, x, M * H * sizeof(float));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * 12;
    float* k_cache = kv_cache + l * 2 * half_stride;
    if (l == 0) {
      kvp_rms_norm(residual, H, f(p[0]), h, H, M, H, eps);
    } else {
      kvp_add_rms_norm(residual, x, f(p[0]), h, M, H, eps);
    }
    kvp_linear_small(h, M, H, f(p[1]), qkv_size, f(p[2]), qkv);
    kvp_rope_and_cache(qkv, qkv_size, M, num_heads, num_kv_heads, head_dim, cos, sin, f(p[10]), f(p[11]), eps, k_cache,
                       k_cache + half_stride, slots);
    kvp_paged_decode(qkv, qkv_size, attn, q_size, nullptr, M, num_heads, num_kv_heads, head_dim, k_cache,
                     k_cache + half_stride, block_size, block_tables, max_blocks, seq_lens, window, scale, partition);
    kvp_linear_small(attn, M, q_size, f(p[3]), H, f(p[4]), x);
    kvp_add_rms_norm(residual, x, f(p[5]), h, M, H, eps);
    kvp_linear_small(h, M, H, f(p[6]), 2 * inter, f(p[7]), gate_up);
    kvp_silu_mul(gate_up, act, M, inter);
    kvp_linear_small(act, M, inter, f(p[8]), H, f(p[9]), x);
  }
}

}  // extern "C"
