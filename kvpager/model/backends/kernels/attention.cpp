// kvpager CPU kernels: paged decode attention reading K/V blocks in place (see common.h).
#include "common.h"

namespace {

using kvp::fast_exp;
using kvp::kv_axpy;
using kvp::kv_dot;
#if defined(__AVX512F__)
using kvp::fast_exp16;
using kvp::load16;
using kvp::reduce16;
#endif

// One (sequence, KV head, context partition) of decode attention for any head_dim (and every head_dim
// without AVX-512: the AVX2 branch is in kv_dot / kv_axpy): online softmax per block, writing the
// unnormalised accumulator acc[group][hd], the running max m[group] and sum l[group].
template <typename T>
void decode_partition_any(const float* __restrict q, int64_t group, int64_t hd, const T* __restrict k_cache,
                          const T* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
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
      const T* kr = k_cache + base + j * kv_stride;
      for (int64_t g = 0; g < group; ++g) {
        scores[g * block_size + j] = kv_dot(q + g * hd, kr, hd) * scale;
      }
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
      for (int64_t j = 0; j < n; ++j) kv_axpy(s[j], v_cache + base + j * kv_stride, a, hd);
    }
    pos += n;
  }
}

// One (sequence, KV head, context partition) of decode attention: online softmax over chunks of
// at most 16 positions inside a block. Writes the unnormalised accumulator acc[group][HD], the
// running max m[group] and sum l[group]. HD is a multiple of 16 (one AVX-512 register of floats).
#if defined(__AVX512F__)
// Scores of NB query heads (q rows HD apart) against the chunk's n K rows: t[b][j] holds the 16
// partial sums of head b and row j (reduced by reduce16). Each K row is loaded once for all NB heads.
template <int HD, int NB, typename T>
inline void chunk_scores(const float* __restrict q, const T* __restrict kb, int64_t kv_stride, int64_t n,
                         __m512 (*t)[16]) {
  constexpr int NV = HD / 16;
  __m512 qv[NB][NV];
  for (int b = 0; b < NB; ++b)
    for (int v = 0; v < NV; ++v) qv[b][v] = _mm512_loadu_ps(q + b * HD + v * 16);
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kb + j * kv_stride;
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = load16(kr + v * 16);
    for (int b = 0; b < NB; ++b) {
      __m512 s = _mm512_mul_ps(qv[b][0], kv[0]);
      for (int v = 1; v < NV; ++v) s = _mm512_fmadd_ps(qv[b][v], kv[v], s);
      t[b][j] = s;
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int64_t j = n; j < 16; ++j) t[b][j] = _mm512_setzero_ps();
}

// acc[b] = acc[b] * alpha[b] + sum_j p[b][j] * V[j] for NB heads; each V row is loaded once.
template <int HD, int NB, typename T>
inline void chunk_values(const float* __restrict p, const float* __restrict alpha, const T* __restrict vb,
                         int64_t kv_stride, int64_t n, float* __restrict acc) {
  constexpr int NV = HD / 16;
  __m512 av[NB][NV];
  for (int b = 0; b < NB; ++b) {
    const __m512 al = _mm512_set1_ps(alpha[b]);
    for (int v = 0; v < NV; ++v) av[b][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + b * HD + v * 16), al);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vb + j * kv_stride;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vr + v * 16);
    for (int b = 0; b < NB; ++b) {
      const __m512 pj = _mm512_set1_ps(p[b * 16 + j]);
      for (int v = 0; v < NV; ++v) av[b][v] = _mm512_fmadd_ps(pj, vv[v], av[b][v]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + b * HD + v * 16, av[b][v]);
}

template <int HD, typename T>
inline void chunk_scores_any(const float* q, const T* kb, int64_t kv_stride, int64_t n, int nb, __m512 (*t)[16]) {
  switch (nb) {
    case 1: chunk_scores<HD, 1>(q, kb, kv_stride, n, t); break;
    case 2: chunk_scores<HD, 2>(q, kb, kv_stride, n, t); break;
    case 3: chunk_scores<HD, 3>(q, kb, kv_stride, n, t); break;
    default: chunk_scores<HD, 4>(q, kb, kv_stride, n, t); break;
  }
}

template <int HD, typename T>
inline void chunk_values_any(const float* p, const float* alpha, const T* vb, int64_t kv_stride, int64_t n, int nb,
                             float* acc) {
  switch (nb) {
    case 1: chunk_values<HD, 1>(p, alpha, vb, kv_stride, n, acc); break;
    case 2: chunk_values<HD, 2>(p, alpha, vb, kv_stride, n, acc); break;
    case 3: chunk_values<HD, 3>(p, alpha, vb, kv_stride, n, acc); break;
    default: chunk_values<HD, 4>(p, alpha, vb, kv_stride, n, acc); break;
  }
}
#endif

template <int HD, typename T>
void decode_partition(const float* __restrict q, int64_t group, const T* __restrict k_cache,
                      const T* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
                      int64_t kv_stride, int64_t begin, int64_t end, float scale, float* __restrict acc,
                      float* __restrict m, float* __restrict l, float* __restrict scores) {
#if defined(__AVX512F__)
  // Heads per pass: NB * HD / 16 query (and accumulator) registers must fit beside the K/V row.
  constexpr int MAXB = HD <= 64 ? 4 : 2;
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  std::fill(acc, acc + group * HD, 0.f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 t[MAXB][16];
  alignas(64) float p[MAXB * 16];
  float alpha[MAXB];
  int64_t pos = begin;
  while (pos < end) {
    const int64_t blk = pos / block_size, off = pos % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, end - pos, 16});
    const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const int64_t base = (table[blk] * block_size + off) * kv_stride;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    const int64_t next = pos + n;
    if (next < end) {
      // NOTE: the next chunk's block is anywhere in the pool, out of the hardware prefetcher's reach:
      // asking for its rows now keeps the loads below from waiting on memory (+17-20 % at batch 64).
      const int64_t nn = std::min<int64_t>({block_size - next % block_size, end - next, 16});
      const int64_t nbase = (table[next / block_size] * block_size + next % block_size) * kv_stride;
      for (int64_t j = 0; j < nn; ++j)
        for (int64_t c = 0; c < HD; c += 64 / int64_t(sizeof(T))) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + nbase + j * kv_stride + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + nbase + j * kv_stride + c), _MM_HINT_T0);
        }
    }
    for (int64_t g0 = 0; g0 < group; g0 += MAXB) {
      const int nb = int(std::min<int64_t>(MAXB, group - g0));
      chunk_scores_any<HD>(q + g0 * HD, kb, kv_stride, n, nb, t);
      for (int b = 0; b < nb; ++b) {
        const int64_t g = g0 + b;
        const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mask, reduce16(t[b]), scale_v);
        const float mb = std::max(m[g], _mm512_reduce_max_ps(sv));
        alpha[b] = fast_exp(m[g] - mb);  // ~0 on the first chunk (m = -inf), times acc = 0
        const __m512 e = _mm512_maskz_mov_ps(mask, fast_exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
        _mm512_store_ps(p + b * 16, e);
        l[g] = l[g] * alpha[b] + _mm512_reduce_add_ps(e);
        m[g] = mb;
      }
      chunk_values_any<HD>(p, alpha, vb, kv_stride, n, nb, acc + g0 * HD);
    }
    pos = next;
  }
#else
  decode_partition_any(q, group, HD, k_cache, v_cache, table, block_size, kv_stride, begin, end, scale, acc, m, l,
                       scores);
#endif
}

}  // namespace

namespace {

template <typename T>
void paged_decode(const float* q, int64_t q_stride, float* out, int64_t out_stride, const int64_t* rows,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const T* k_cache,
                  const T* v_cache, int64_t block_size, const int64_t* block_tables, int64_t max_blocks,
                  const int64_t* seq_lens, int64_t window, float scale, int64_t partition) {
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

}  // namespace

extern "C" {

void kvp_paged_decode(const float* q, int64_t q_stride, float* out, int64_t out_stride, const int64_t* rows,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const void* k_cache, const void* v_cache, int64_t block_size, const int64_t* block_tables,
                      int64_t max_blocks, const int64_t* seq_lens, int64_t window, float scale, int64_t partition,
                      int64_t kv_format) {
  kvp::with_kv(kv_format, k_cache, [&](auto k) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    paged_decode(q, q_stride, out, out_stride, rows, num_seqs, num_heads, num_kv_heads, head_dim, k,
                 static_cast<const T*>(v_cache), block_size, block_tables, max_blocks, seq_lens, window, scale,
                 partition);
  });
}

}  // extern "C"
