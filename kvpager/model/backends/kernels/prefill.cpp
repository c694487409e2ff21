// kvpager CPU kernels: causal attention of prefill chunks over their paged context (see common.h).
#include "common.h"

namespace {

using kvp::fast_exp;
#if defined(__AVX512F__)
using kvp::fast_exp16;
using kvp::load16;
#endif

// Causal attention of one prefill chunk's query block (up to QB tokens, every query head of one KV
// head) over the chunk's paged context: S = Q K^T with K transposed per 16-key chunk (one broadcast
// multiply-add per query and dim, no horizontal sums), online softmax per query row, O += P V.
template <int HD, typename T>
void prefill_block(const float* __restrict q, int64_t q_stride, float* __restrict out, int64_t out_stride,
                   int64_t row0, int64_t ntok, int64_t pos0, int64_t group, int64_t kh, const T* __restrict k_cache,
                   const T* __restrict v_cache, const int64_t* __restrict table, int64_t block_size, int64_t kv_stride,
                   int64_t window, float scale, float* __restrict work) {
  const int64_t R = ntok * group;  // rows: (token i, head g) -> r = i * group + g
  float* o = work;                 // [R][HD]
  float* m = o + R * HD;           // [R]
  float* l = m + R;                // [R]
  float* kt = l + R;               // [HD][16]
  float* p = kt + HD * 16;         // [R][16]
  float* alpha = p + R * 16;       // [R]
  std::fill(o, o + R * HD, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const int64_t last = pos0 + ntok - 1;  // the block's last query position
  const int64_t begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  int64_t kpos = begin;
  while (kpos <= last) {
    const int64_t off = kpos % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, last + 1 - kpos, 16});
    const int64_t base = (table[kpos / block_size] * block_size + off) * kv_stride + kh * HD;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    alignas(64) float krow[HD];
    for (int64_t j = 0; j < n; ++j) {
      kvp::kv_widen(kb + j * kv_stride, krow, HD);
      for (int64_t d = 0; d < HD; ++d) kt[d * 16 + j] = krow[d];
    }
    for (int64_t j = n; j < 16; ++j)
      for (int64_t d = 0; d < HD; ++d) kt[d * 16 + j] = 0.f;
#if defined(__AVX512F__)
    constexpr int NV = HD / 16;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // Scores, 8 rows at a time (8 independent chains of HD multiply-adds).
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const int64_t nr = std::min<int64_t>(8, R - r0);
      if (kpos > pos0 + (r0 + nr - 1) / group) continue;  // the chunk is in all these rows' future
      __m512 s[8];
      for (int a = 0; a < 8; ++a) s[a] = _mm512_setzero_ps();
      const float* qr[8];
      for (int64_t a = 0; a < 8; ++a) {
        const int64_t r = r0 + std::min<int64_t>(a, nr - 1);
        qr[a] = q + (row0 + r / group) * q_stride + (kh * group + r % group) * HD;
      }
      for (int64_t d = 0; d < HD; ++d) {
        const __m512 k = _mm512_loadu_ps(kt + d * 16);
        for (int a = 0; a < 8; ++a) s[a] = _mm512_fmadd_ps(_mm512_set1_ps(qr[a][d]), k, s[a]);
      }
      for (int64_t a = 0; a < nr; ++a) {
        const int64_t r = r0 + a, pos = pos0 + r / group;
        // keys kpos + j with kpos + j <= pos and (window) kpos + j > pos - window
        const __m512i kj = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(kpos)));
        __mmask16 mask = _mm512_cmple_epi32_mask(kj, _mm512_set1_epi32(int32_t(pos)));
        if (window > 0) mask &= _mm512_cmpgt_epi32_mask(kj, _mm512_set1_epi32(int32_t(pos - window)));
        mask &= n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
        if (mask == 0) {
          alpha[r] = 1.f;
          _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
          continue;
        }
        const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mask, s[a], _mm512_set1_ps(scale));
        const float mb = std::max(m[r], _mm512_reduce_max_ps(sv));
        alpha[r] = fast_exp(m[r] - mb);
        const __m512 e = _mm512_maskz_mov_ps(mask, fast_exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
        _mm512_storeu_ps(p + r * 16, e);
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
        m[r] = mb;
      }
    }
    // O = O * alpha + P V, two rows at a time (each V row loaded once for both).
    for (int64_t r0 = 0; r0 < R; r0 += 2) {
      const int64_t ra = r0, rb = std::min<int64_t>(r0 + 1, R - 1);
      if (kpos > pos0 + rb / group) continue;  // every key of the chunk is in these rows' future
      float* oa = o + ra * HD;
      float* ob = o + rb * HD;
      const float* pa = p + ra * 16;
      const float* pb = p + rb * 16;
      const __m512 ala = _mm512_set1_ps(alpha[ra]), alb = _mm512_set1_ps(alpha[rb]);
      __m512 a0[NV], a1[NV];
      for (int v = 0; v < NV; ++v) {
        a0[v] = _mm512_mul_ps(_mm512_loadu_ps(oa + v * 16), ala);
        a1[v] = _mm512_mul_ps(_mm512_loadu_ps(ob + v * 16), alb);
      }
      for (int64_t j = 0; j < n; ++j) {
        const T* vr = vb + j * kv_stride;
        const __m512 pja = _mm512_set1_ps(pa[j]), pjb = _mm512_set1_ps(pb[j]);
        for (int v = 0; v < NV; ++v) {
          const __m512 vv = load16(vr + v * 16);
          a0[v] = _mm512_fmadd_ps(pja, vv, a0[v]);
          a1[v] = _mm512_fmadd_ps(pjb, vv, a1[v]);
        }
      }
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(oa + v * 16, a0[v]);
        if (rb != ra) _mm512_storeu_ps(ob + v * 16, a1[v]);
      }
    }
#else
    // Any CPU: the same scores, online softmax and row pairs, in 16-lane loops the compiler
    // vectorises for the target (AVX2: two 8-lane halves).
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const int64_t nr = std::min<int64_t>(8, R - r0);
      if (kpos > pos0 + (r0 + nr - 1) / group) continue;  // the chunk is in all these rows' future
      alignas(64) float s[8][16] = {};
      const float* qr[8];
      for (int64_t a = 0; a < 8; ++a) {
        const int64_t r = r0 + std::min<int64_t>(a, nr - 1);
        qr[a] = q + (row0 + r / group) * q_stride + (kh * group + r % group) * HD;
      }
      for (int64_t d = 0; d < HD; ++d) {
        const float* __restrict k = kt + d * 16;
        for (int a = 0; a < 8; ++a) {
          const float qa = qr[a][d];
#pragma omp simd
          for (int j = 0; j < 16; ++j) s[a][j] += qa * k[j];
        }
      }
      for (int64_t a = 0; a < nr; ++a) {
        const int64_t r = r0 + a, pos = pos0 + r / group;
        // keys kpos + j with j < n, kpos + j <= pos and (window) kpos + j > pos - window
        const int64_t hi = std::min<int64_t>(n, pos - kpos + 1);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - kpos) : 0;
        if (hi <= lo) {
          alpha[r] = 1.f;
          std::fill(p + r * 16, p + r * 16 + 16, 0.f);
          continue;
        }
        float mb = m[r];
        for (int64_t j = lo; j < hi; ++j) mb = std::max(mb, s[a][j] * scale);
        alpha[r] = fast_exp(m[r] - mb);
        float* __restrict pr = p + r * 16;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < 16; ++j) {
          const float e = (j >= lo && j < hi) ? fast_exp(s[a][j] * scale - mb) : 0.f;
          pr[j] = e;
          sum += e;
        }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = mb;
      }
    }
    // O = O * alpha + P V, two rows at a time (each V row read once for both).
    for (int64_t r0 = 0; r0 < R; r0 += 2) {
      const int64_t ra = r0, rb = std::min<int64_t>(r0 + 1, R - 1);
      if (kpos > pos0 + rb / group) continue;  // every key of the chunk is in these rows' future
      float* __restrict oa = o + ra * HD;
      float* __restrict ob = o + rb * HD;
      const float* pa = p + ra * 16;
      const float* pb = p + rb * 16;
      alignas(64) float a0[HD], a1[HD];
      const float ala = alpha[ra], alb = alpha[rb];
#pragma omp simd
      for (int i = 0; i < HD; ++i) {
        a0[i] = oa[i] * ala;
        a1[i] = ob[i] * alb;
      }
      alignas(64) float vrow[HD];
      for (int64_t j = 0; j < n; ++j) {
        kvp::kv_widen(vb + j * kv_stride, vrow, HD);  // NOTE: widened once (AVX2: 8 at a time) for both rows
        const float pja = pa[j], pjb = pb[j];
#pragma omp simd
        for (int i = 0; i < HD; ++i) {
          const float v = vrow[i];
          a0[i] += pja * v;
          a1[i] += pjb * v;
        }
      }
      std::copy(a0, a0 + HD, oa);
      if (rb != ra) std::copy(a1, a1 + HD, ob);
    }
#endif
    kpos += n;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* dst = out + (row0 + r / group) * out_stride + (kh * group + r % group) * HD;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < HD; ++d) dst[d] = o[r * HD + d] * inv;
  }
}

constexpr int64_t PREFILL_QB = 32;  // query tokens per task

template <typename T>
void prefill_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t num_chunks,
                       const int64_t* token_start, const int64_t* query_len, const int64_t* seq_len,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const T* k_cache, const T* v_cache,
                       int64_t block_size, const int64_t* block_tables, int64_t max_blocks, int64_t window,
                       float scale) {
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * head_dim;
  const kvp::PrefillTasks tasks(num_chunks, query_len, seq_len, num_kv_heads, PREFILL_QB);
  const int64_t R = PREFILL_QB * group;
  const int64_t work_floats = R * head_dim + 2 * R + head_dim * 16 + R * 16 + R;  // o, m, l, kt, p, alpha
#pragma omp parallel if (omp_get_max_threads() > 1 && tasks.size() > 1)
  {
    std::vector<float> buf(work_floats + 16);  // + room to align to 64 bytes
    float* work = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    kvp::for_each_prefill_task(
        tasks, token_start, block_tables, max_blocks, head_dim,
        [&](auto hd, const kvp::PrefillTask& k, int64_t row0, const int64_t* table) {
          prefill_block<decltype(hd)::value>(q, q_stride, out, out_stride, row0, k.num_queries, k.first_pos, group,
                                             k.kv_head, k_cache, v_cache, table, block_size, kv_stride, window, scale,
                                             work);
        });
  }
}

}  // namespace

extern "C" {

// Prefill chunks (query_len tokens ending at position seq_len - 1, context read through the block
// table row of each chunk): causal (and sliding-window) attention into out. Returns 0 without
// touching out where it does not apply (head_dim other than 64 or 128): use torch.
int64_t kvp_prefill_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t num_chunks,
                           const int64_t* token_start, const int64_t* query_len, const int64_t* seq_len,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const void* k_cache,
                           const void* v_cache, int64_t block_size, const int64_t* block_tables, int64_t max_blocks,
                           int64_t window, float scale, int64_t kv_format) {
  if (head_dim != 64 && head_dim != 128) return 0;
  kvp::with_kv(kv_format, k_cache, [&](auto k) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    prefill_attention(q, q_stride, out, out_stride, num_chunks, token_start, query_len, seq_len, num_heads,
                      num_kv_heads, head_dim, k, static_cast<const T*>(v_cache), block_size, block_tables, max_blocks,
                      window, scale);
  });
  return 1;
}

}  // extern "C"
