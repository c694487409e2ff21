// kvpager CPU kernels: causal attention of prefill chunks over a bfloat16 paged KV cache in AMX tiles.
//
// The computation of prefill.cpp's kernel (a task is a block of up to 32 query tokens x every query head
// of one KV head; online softmax over the chunk's paged context) with its two products in AMX bfloat16
// tiles instead of float32 multiply-adds:
//   S = Q K^T  the float32 queries are split into three bfloat16 pieces whose sum is the query exactly
//              (8 significant bits each); every piece x key product is exact in float32, so a score
//              is a float32 sum of exact products, as in the float32 kernel (in another order);
//   O += P V   the softmax weights likewise in three pieces, times the bfloat16 values.
// A task's keys are gathered through the block table once, 32 at a time (two 16-key tiles), into the
// layouts the tile multiply reads: K^T as [dim pair][key] and V as [key pair][dim], 32-bit pairs of
// bfloat16. Rows are (token, head) as in prefill.cpp, r = token * group + head, so the keys serve all
// the task's heads. Each 16-row block then runs over the whole context with its output in tiles (a
// 64-dim head's in four tile registers throughout, a 128-dim head's in L1 between chunks); the online
// softmax runs in AVX-512 on each 16-row x 32-key score block and moves a row's reference maximum only
// when a score passes it by more than kRescaleAbove, so the output is rarely rescaled.
//
// kvp_amx_attention_ready() says whether this build and this process can run it (AMX-TILE, AMX-BF16,
// AVX512-BF16 and the OS's permission, asked once; AVX-512 builds only: the portable build has no AMX).
// kvp_prefill_attention_amx returns 0 without writing where it does not apply: a KV cache other than
// bfloat16, head_dim other than 64 or 128, or no AMX; the caller then runs prefill.cpp's kernel.
#include "amx.h"
#include "common.h"

#if defined(KVP_AMX) && defined(__AVX512F__)
#define KVP_AMX_ATTENTION 1
#include <immintrin.h>
#endif

#if defined(KVP_AMX_ATTENTION)

namespace {

bool amx_bf16_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16
  return kvp_amx::usable();
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

namespace {

using kvp::fast_exp;
using kvp::fast_exp16;

constexpr int64_t kQB = 32;  // query tokens per task (prefill.cpp's PREFILL_QB)
constexpr int64_t kKC = 32;  // keys per chunk: two tiles of 16
constexpr int kPieces = 3;   // bfloat16 pieces of a float32

// 16 floats as kPieces x 16 bfloat16 whose sums are the floats (exact for finite values: each piece
// takes the next 8 significant bits of what is left).
inline void split16(__m512 x, __m256i* piece) {
  for (int p = 0; p < kPieces; ++p) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    piece[p] = h;
    x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

// r[i] word j -> r[j] word i (a 16 x 16 transpose of 32-bit words).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: word 4L + c of rows 4i .. 4i + 3
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // lane L of u[c], u[4 + c], u[8 + c], u[12 + c] -> r[4L + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

struct Work {
  uint16_t* qa;   // [kPieces][rows][HD]: the query pieces, tile rows
  uint32_t* kt;   // [chunks][HD / 32][2][16][16]: key tiles of the task's context, (dim pair, key) words
  uint32_t* vp;   // [chunks][HD / 16][16][16]: value tiles, (key pair, dim) words
  float* o;       // [16][HD]: one row block's output before the division by l
  float* m;       // [16]: the score each row's weights are taken relative to
  float* l;       // [16]
  float* s;       // [16][32]: one row block's scores
  uint16_t* pa;   // [kPieces][16][32]: its softmax weights, tile rows
  float* alpha;   // [16]
  int64_t* koff;  // [32]: each key's element offset in the cache (-1: none)
};

// A row's weights are exp(score - m) with m its largest score so far, rounded up lazily: m moves (and
// the row's output and sum are rescaled) only when a score exceeds it by more than this, so weights
// stay below e^8 and most chunks leave the output in place for the tiles to accumulate into.
constexpr float kRescaleAbove = 8.f;

// The chunk of kKC keys from kpos, gathered through the block table into the two tile layouts.
template <int HD>
void pack_chunk(int64_t kpos, int64_t n, int64_t kh, const uint16_t* __restrict k_cache,
                const uint16_t* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
                int64_t kv_stride, uint32_t* __restrict kt, uint32_t* __restrict vp, int64_t* koff) {
  for (int64_t j = 0; j < kKC; ++j) {
    const int64_t p = kpos + j;
    koff[j] = j < n ? (table[p / block_size] * block_size + p % block_size) * kv_stride + kh * HD : -1;
  }
  // K^T tiles: word (kk, key) of tile (ks, half) is dims 2kk, 2kk + 1 of dim tile ks for key 16 half + key
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t ks = 0; ks < HD / 32; ++ks) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t off = koff[16 * half + j];
        r[j] = off >= 0 ? _mm512_loadu_si512(k_cache + off + ks * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = kt + (ks * 2 + half) * 256;
      for (int64_t kk = 0; kk < 16; ++kk) _mm512_storeu_si512(tile + kk * 16, r[kk]);
    }
  }
  // V tiles: word (kk, dim) of tile t is keys 2kk, 2kk + 1 at dim 16 t + dim
  for (int64_t kk = 0; kk < 16; ++kk) {
    const int64_t a = koff[2 * kk], b = koff[2 * kk + 1];
    const auto widened = [&](int64_t off, int64_t t) {  // 16 values of a key as 32-bit words (0: no key)
      if (off < 0) return _mm512_setzero_si512();
      return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_cache + off + t * 16)));
    };
    for (int64_t t = 0; t < HD / 16; ++t) {
      const __m512i va = widened(a, t), vb = widened(b, t);
      _mm512_storeu_si512(vp + (t * 16 + kk) * 16, _mm512_or_si512(va, _mm512_slli_epi32(vb, 16)));
    }
  }
}

// One row block's weights for one chunk from its scores in w.s: rows a < 16 of pa (kPieces pieces),
// w.l and w.m updated, w.alpha[a] the factor the row's output must be scaled by first (1: none).
// Returns whether any row needs that scaling.
inline bool block_weights(int64_t r_lo, int64_t R, int64_t group, int64_t pos0, int64_t kpos, int64_t n,
                          int64_t window, float scale, const Work& w) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  bool rescale = false;
  const bool whole = window == 0 && n == kKC && kpos + kKC - 1 <= pos0;  // every row sees every key
  for (int64_t a = 0; a < 16; ++a) {
    const int64_t r = r_lo + a;
    uint16_t* prow[kPieces];
    for (int p = 0; p < kPieces; ++p) prow[p] = w.pa + (p * 16 + a) * 32;
    __mmask16 mask[2] = {0, 0};
    if (r < R && whole) {
      mask[0] = mask[1] = 0xFFFF;
    } else if (r < R) {
      const int64_t pos = pos0 + r / group;
      for (int h = 0; h < 2; ++h) {
        // keys kpos + j with j < n, kpos + j <= pos and (window) kpos + j > pos - window
        const __m512i kj = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(kpos + 16 * h)));
        mask[h] = _mm512_cmple_epi32_mask(kj, _mm512_set1_epi32(int32_t(pos)));
        if (window > 0) mask[h] &= _mm512_cmpgt_epi32_mask(kj, _mm512_set1_epi32(int32_t(pos - window)));
        const int64_t valid = std::min<int64_t>(16, std::max<int64_t>(0, n - 16 * h));
        mask[h] &= valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      }
    }
    w.alpha[a] = 1.f;
    if ((mask[0] | mask[1]) == 0) {
      for (int p = 0; p < kPieces; ++p) std::fill(prow[p], prow[p] + 32, uint16_t(0));
      continue;
    }
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    const __m512 s0 = _mm512_mask_mul_ps(ninf, mask[0], _mm512_loadu_ps(w.s + a * 32), sc);
    const __m512 s1 = _mm512_mask_mul_ps(ninf, mask[1], _mm512_loadu_ps(w.s + a * 32 + 16), sc);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    if (w.m[a] == -INFINITY) {  // the row's first keys: nothing to rescale
      w.m[a] = top;
    } else if (top > w.m[a] + kRescaleAbove) {
      w.alpha[a] = fast_exp(w.m[a] - top);
      w.l[a] *= w.alpha[a];
      w.m[a] = top;
      rescale = true;
    }
    const __m512 mv = _mm512_set1_ps(w.m[a]);
    const __m512 e0 = _mm512_maskz_mov_ps(mask[0], fast_exp16(_mm512_sub_ps(s0, mv)));
    const __m512 e1 = _mm512_maskz_mov_ps(mask[1], fast_exp16(_mm512_sub_ps(s1, mv)));
    w.l[a] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
    __m256i p0[kPieces], p1[kPieces];
    split16(e0, p0);
    split16(e1, p1);
    for (int p = 0; p < kPieces; ++p) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow[p]), p0[p]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow[p] + 16), p1[p]);
    }
  }
  return rescale;
}

// The tiles holding 16 rows x 64 dims of output (4-7) to and from memory at `o`, rows `stride` bytes apart.
inline void store_output_tiles(float* o, int64_t stride) {
  _tile_stored(4, o, stride);
  _tile_stored(5, o + 16, stride);
  _tile_stored(6, o + 32, stride);
  _tile_stored(7, o + 48, stride);
}
inline void load_output_tiles(const float* o, int64_t stride) {
  _tile_loadd(4, o, stride);
  _tile_loadd(5, o + 16, stride);
  _tile_loadd(6, o + 32, stride);
  _tile_loadd(7, o + 48, stride);
}

// Output tiles 4-7 += the three weight pieces (tiles 0-2) x the four value tiles at vt (through tile 3).
inline void add_weighted_values(const uint32_t* vt) {
#define KVP_PV_TILE(C, T)          \
  _tile_loadd(3, vt + T * 256, 64); \
  _tile_dpbf16ps(C, 0, 3);          \
  _tile_dpbf16ps(C, 1, 3);          \
  _tile_dpbf16ps(C, 2, 3)
  KVP_PV_TILE(4, 0);
  KVP_PV_TILE(5, 1);
  KVP_PV_TILE(6, 2);
  KVP_PV_TILE(7, 3);
#undef KVP_PV_TILE
}

template <int HD>
void amx_block(const float* __restrict q, int64_t q_stride, float* __restrict out, int64_t out_stride, int64_t row0,
               int64_t ntok, int64_t pos0, int64_t group, int64_t kh, const uint16_t* __restrict k_cache,
               const uint16_t* __restrict v_cache, const int64_t* __restrict table, int64_t block_size,
               int64_t kv_stride, int64_t window, float scale, const Work& w) {
  const int64_t R = ntok * group, blocks = (R + 15) / 16, rows = blocks * 16;
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst[kPieces];
    for (int p = 0; p < kPieces; ++p) dst[p] = w.qa + (p * rows + r) * HD;
    if (r >= R) {
      for (int p = 0; p < kPieces; ++p) std::fill(dst[p], dst[p] + HD, uint16_t(0));
      continue;
    }
    const float* src = q + (row0 + r / group) * q_stride + (kh * group + r % group) * HD;
    for (int64_t d = 0; d < HD; d += 16) {
      __m256i piece[kPieces];
      split16(_mm512_loadu_ps(src + d), piece);
      for (int p = 0; p < kPieces; ++p) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[p] + d), piece[p]);
    }
  }
  const int64_t last = pos0 + ntok - 1;  // the task's last query position
  const int64_t begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const int64_t chunks = (last - begin) / kKC + 1;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t kpos = begin + c * kKC;
    pack_chunk<HD>(kpos, std::min<int64_t>(kKC, last + 1 - kpos), kh, k_cache, v_cache, table, block_size, kv_stride,
                   w.kt + c * HD * 16, w.vp + c * HD * 16, w.koff);
  }
  // One row block at a time over all its chunks: a 64-dim output stays in tiles 4-7 throughout (stored
  // only to rescale), a 128-dim one in w.o, in L1, loaded into them half by half.
  constexpr int64_t o_stride = HD * 4;
  for (int64_t rb = 0; rb < blocks; ++rb) {
    const int64_t r_lo = rb * 16, r_hi = std::min(R, r_lo + 16) - 1;
    const int64_t block_last = pos0 + r_hi / group;  // the last key any of its rows sees
    std::fill(w.o, w.o + 16 * HD, 0.f);
    if (HD == 64) load_output_tiles(w.o, o_stride);
    for (int64_t a = 0; a < 16; ++a) {
      w.m[a] = -INFINITY;
      w.l[a] = 0.f;
    }
    for (int64_t c = 0; c < chunks && begin + c * kKC <= block_last; ++c) {
      const int64_t kpos = begin + c * kKC;
      const uint32_t* kt = w.kt + c * HD * 16;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t ks = 0; ks < HD / 32; ++ks) {
        for (int64_t half = 0; half < 2; ++half) {
          _tile_loadd(3, kt + (ks * 2 + half) * 256, 64);
          for (int p = 0; p < kPieces; ++p) {
            _tile_loadd(2, w.qa + (p * rows + r_lo) * HD + ks * 32, HD * 2);
            if (half == 0)
              _tile_dpbf16ps(0, 2, 3);
            else
              _tile_dpbf16ps(1, 2, 3);
          }
        }
      }
      _tile_stored(0, w.s, 128);
      _tile_stored(1, w.s + 16, 128);
      if (block_weights(r_lo, R, group, pos0, kpos, std::min<int64_t>(kKC, last + 1 - kpos), window, scale, w)) {
        if (HD == 64) store_output_tiles(w.o, o_stride);
        for (int64_t a = 0; a < 16; ++a) {
          if (w.alpha[a] == 1.f) continue;
          const __m512 al = _mm512_set1_ps(w.alpha[a]);
          for (int64_t d = 0; d < HD; d += 16)
            _mm512_storeu_ps(w.o + a * HD + d, _mm512_mul_ps(_mm512_loadu_ps(w.o + a * HD + d), al));
        }
        if (HD == 64) load_output_tiles(w.o, o_stride);
      }
      _tile_loadd(0, w.pa, 64);
      _tile_loadd(1, w.pa + 16 * 32, 64);
      _tile_loadd(2, w.pa + 2 * 16 * 32, 64);
      for (int64_t half = 0; half < HD / 64; ++half) {
        if (HD != 64) load_output_tiles(w.o + half * 64, o_stride);
        add_weighted_values(w.vp + c * HD * 16 + half * 4 * 256);
        if (HD != 64) store_output_tiles(w.o + half * 64, o_stride);
      }
    }
    if (HD == 64) store_output_tiles(w.o, o_stride);
    for (int64_t a = 0; a < 16 && r_lo + a < R; ++a) {
      const int64_t r = r_lo + a;
      float* dst = out + (row0 + r / group) * out_stride + (kh * group + r % group) * HD;
      const __m512 inv = _mm512_set1_ps(1.f / w.l[a]);
      for (int64_t d = 0; d < HD; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w.o + a * HD + d), inv));
    }
  }
}

template <typename T>
T* carve(char*& at, int64_t count) {  // the next 64-byte aligned array of `count` T in a work buffer
  T* p = reinterpret_cast<T*>(at);
  at += (count * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
  return p;
}

void amx_prefill(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t num_chunks,
                 const int64_t* token_start, const int64_t* query_len, const int64_t* seq_len, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, const uint16_t* k_cache, const uint16_t* v_cache,
                 int64_t block_size, const int64_t* block_tables, int64_t max_blocks, int64_t window, float scale) {
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * head_dim;
  const kvp::PrefillTasks tasks(num_chunks, query_len, seq_len, num_kv_heads, kQB);
  const int64_t rows = (kQB * group + 15) / 16 * 16, HD = head_dim;
  int64_t context = 1;  // the most keys a task reads
  for (int64_t c = 0; c < num_chunks; ++c) context = std::max(context, seq_len[c]);
  const int64_t chunks = (context + kKC - 1) / kKC + 1;  // + 1: a window's first chunk need not be aligned
  const int64_t bytes = (kPieces * rows * HD * 2 + 2 * chunks * HD * 16 * 4 + 16 * HD * 4 + 3 * 16 * 4 + 16 * 32 * 4 +
                         kPieces * 16 * 32 * 2 + 32 * 8) +
                        10 * 64;  // + each array's alignment
#pragma omp parallel if (omp_get_max_threads() > 1 && tasks.size() > 1)
  {
    std::vector<char> buf(bytes + 64);
    char* at = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    Work w;
    w.qa = carve<uint16_t>(at, kPieces * rows * HD);
    w.kt = carve<uint32_t>(at, chunks * HD * 16);
    w.vp = carve<uint32_t>(at, chunks * HD * 16);
    w.o = carve<float>(at, 16 * HD);
    w.m = carve<float>(at, 16);
    w.l = carve<float>(at, 16);
    w.s = carve<float>(at, 16 * 32);
    w.pa = carve<uint16_t>(at, kPieces * 16 * 32);
    w.alpha = carve<float>(at, 16);
    w.koff = carve<int64_t>(at, 32);
    const kvp_amx::TileConfig cfg = kvp_amx::full_tiles();
    _tile_loadconfig(&cfg);
    kvp::for_each_prefill_task(
        tasks, token_start, block_tables, max_blocks, head_dim,
        [&](auto hd, const kvp::PrefillTask& k, int64_t row0, const int64_t* table) {
          amx_block<decltype(hd)::value>(q, q_stride, out, out_stride, row0, k.num_queries, k.first_pos, group,
                                         k.kv_head, k_cache, v_cache, table, block_size, kv_stride, window, scale, w);
        });
    _tile_release();
  }
}

}  // namespace

#pragma GCC pop_options
#endif  // KVP_AMX_ATTENTION

extern "C" {

// 1 where kvp_prefill_attention_amx can run in this process (asked once), else 0.
int64_t kvp_amx_attention_ready() {
#if defined(KVP_AMX_ATTENTION)
  static const bool ready = amx_bf16_usable();
  return ready ? 1 : 0;
#else
  return 0;
#endif
}

// kvp_prefill_attention's computation (same arguments) in AMX tiles over a bfloat16 cache. Returns 0
// without touching out where it does not apply (see the top of the file).
int64_t kvp_prefill_attention_amx(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                  int64_t num_chunks, const int64_t* token_start, const int64_t* query_len,
                                  const int64_t* seq_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  const void* k_cache, const void* v_cache, int64_t block_size,
                                  const int64_t* block_tables, int64_t max_blocks, int64_t window, float scale,
                                  int64_t kv_format) {
  if (kv_format != kvp::kKvBfloat16 || (head_dim != 64 && head_dim != 128) || !kvp_amx_attention_ready()) return 0;
#if defined(KVP_AMX_ATTENTION)
  amx_prefill(q, q_stride, out, out_stride, num_chunks, token_start, query_len, seq_len, num_heads, num_kv_heads,
              head_dim, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache), block_size,
              block_tables, max_blocks, window, scale);
  return 1;
#else
  (void)q, (void)q_stride, (void)out, (void)out_stride, (void)num_chunks, (void)token_start, (void)query_len;
  (void)seq_len, (void)num_heads, (void)num_kv_heads, (void)k_cache, (void)v_cache, (void)block_size;
  (void)block_tables, (void)max_blocks, (void)window, (void)scale;
  return 0;
#endif
}

}  // extern "C"
