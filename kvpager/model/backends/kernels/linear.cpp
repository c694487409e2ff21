// kvpager CPU kernels: linear layers on weights stored in column blocks (see kvpager/model/weight_layout.py).
//
// The weight of out = x @ w.T is kept as blocks of 16 output columns, block b at wb + b * bs holding
// w[16b + i, k] at k * 16 + i: for each input feature one 64-byte line. The kernel computes outer
// products: a tile of MR input rows x NV * 16 output columns stays in registers over the whole of K,
// each step loads NV vectors (one line of each of NV blocks) and broadcasts MR inputs. Against the
// dot-product tile of kvp_linear_small (torch's row-major weights) that is a third of the loads per
// multiply-add at 8+ rows, and a panel's weights are NV sequential streams.
#include "common.h"

namespace {

using kvp::worth_threads;

// Row chunks of a large batch: the inputs of a chunk stay in L2 while every panel passes over them
// (measured 8 SmolLM2 layers against unchunked: 1.15x at 256 rows, 1.04x at 512, 1.10x at 2,048).
constexpr int64_t kRowChunk = 256;

#if defined(__AVX512F__)
// While a panel is first read (from memory) each block stream is prefetched kPrefetchLines lines
// ahead, into L1 and again into L2. Measured over 30 streamed SmolLM2 layers against no prefetch
// (one pass): equal at 1 and 8 rows, 1.09x at 4, 1.13x at 16, 1.38x at 64; the second (L2) hint on
// the same line 1.07-1.14x at 1 row (five passes), no difference at 4-64; 16 or 64 lines ahead, or
// the L2 hint further out, no better.
constexpr int64_t kPrefetchLines = 32;
// out[0..MR)[0..NV*16) = x[0..MR) . the NV blocks at wb, bs apart (+ bias); x rows K apart, out rows
// N apart. first: this tile is the panel's first pass (prefetch ahead; the later tiles find the panel
// in cache).
template <int MR, int NV>
inline void outer_tile(const float* __restrict x, int64_t K, const float* __restrict wb, int64_t bs,
                       float* __restrict out, int64_t N, const float* __restrict bias, bool first) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* line = wb + k * 16;
    if (first && k + kPrefetchLines < K) {
      for (int j = 0; j < NV; ++j) {
        const char* ahead = reinterpret_cast<const char*>(line + kPrefetchLines * 16 + j * bs);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead, _MM_HINT_T1);
      }
    }
    __m512 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_ps(line + j * bs);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(a, b[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const __m512 bj = bias != nullptr ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * N + j * 16, _mm512_add_ps(acc[m][j], bj));
  }
}

// The last rows of a panel (fewer than a full tile): the tile of exactly `rows` rows.
template <int NV, int MR>
inline void outer_rows(int64_t rows, const float* x, int64_t K, const float* wb, int64_t bs, float* out, int64_t N,
                       const float* bias, bool first) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      outer_tile<MR, NV>(x, K, wb, bs, out, N, bias, first);
    } else {
      outer_rows<NV, MR - 1>(rows, x, K, wb, bs, out, N, bias, first);
    }
  }
}

// One panel of NV * 16 columns for all M rows, MR rows a tile (at most 24 accumulators, 8 rows).
template <int NV>
inline void outer_panel(const float* x, int64_t M, int64_t K, const float* wb, int64_t bs, float* out, int64_t N,
                        const float* bias) {
  constexpr int MR = std::min(8, 24 / NV);
  int64_t m0 = 0;
  for (int tile = 0; m0 + MR <= M; m0 += MR, ++tile)
    outer_tile<MR, NV>(x + m0 * K, K, wb, bs, out + m0 * N, N, bias, tile == 0);
  if (m0 < M) outer_rows<NV, MR - 1>(M - m0, x + m0 * K, K, wb, bs, out + m0 * N, N, bias, m0 == 0);
}

// A panel of `vectors` (<= NV) vectors of 16 columns: dispatch on its width.
template <int NV>
inline void outer_panel_width(int64_t vectors, const float* x, int64_t M, int64_t K, const float* wb, int64_t bs,
                              float* out, int64_t N, const float* bias) {
  if constexpr (NV > 0) {
    if (vectors == NV) {
      outer_panel<NV>(x, M, K, wb, bs, out, N, bias);
    } else {
      outer_panel_width<NV - 1>(vectors, x, M, K, wb, bs, out, N, bias);
    }
  }
}

// Columns in panels of NV vectors (N a multiple of 16).
template <int NV>
void outer_linear(const float* x, int64_t M, int64_t K, const float* wb, int64_t bs, int64_t N, const float* bias,
                  float* out) {
  const int64_t vectors = N / 16;
  const int threads = worth_threads(N * K) ? omp_get_max_threads() : 1;
  auto panel = [&](int64_t v, int64_t width) {
    const int64_t n0 = v * 16;
    outer_panel_width<NV>(width, x, M, K, wb + v * bs, bs, out + n0, N, bias != nullptr ? bias + n0 : nullptr);
  };
  if (M < 16) {
    // The weights stream from memory: each thread an equal share of the columns (to 16), so equal
    // bytes. (Whole panels handed out would leave one thread a panel more: 576 columns are 4.5
    // panels of 128.)
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t v0 = vectors * t / nt, v1 = vectors * (t + 1) / nt;
      for (int64_t v = v0; v < v1; v += NV) panel(v, std::min<int64_t>(NV, v1 - v));
    }
  } else {
    // Compute-bound: panels handed out one at a time, so a thread that loses its core (to the server's
    // event loop, a client, another tenant) holds back one panel, not a share of the matrix.
    const int64_t panels = (vectors + NV - 1) / NV;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p) panel(p * NV, std::min<int64_t>(NV, vectors - p * NV));
  }
}
#endif

}  // namespace

extern "C" {

// 1 when kvp_linear_b runs the AVX-512 outer-product tiles (the column blocks only pay off then).
int64_t kvp_linear_b_fast() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for x [M, K] row-major and w in column blocks of
// 16 (N a multiple of 16), block b at wb + b * bs.
void kvp_linear_b(const float* x, int64_t M, int64_t K, const float* wb, int64_t bs, int64_t N, const float* bias,
                  float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    const float* xc = x + m0 * K;
    float* oc = out + m0 * N;
#if defined(__AVX512F__)
    // The widest panel whose tile of all rows (up to 8) fits 24 accumulators, so that below 8 rows
    // the weights are read once: 1-3 rows 128 columns, 4 rows 96, 5-6 rows 64; 7-15 rows 96 columns
    // 4 rows a tile (the second tile reads the panel from L2); from 16 rows 48 columns, 8 rows a tile.
    if (rows <= 3) {
      outer_linear<8>(xc, rows, K, wb, bs, N, bias, oc);
    } else if (rows == 4) {
      outer_linear<6>(xc, rows, K, wb, bs, N, bias, oc);
    } else if (rows <= 6) {
      outer_linear<4>(xc, rows, K, wb, bs, N, bias, oc);
    } else if (rows < 16) {
      outer_linear<6>(xc, rows, K, wb, bs, N, bias, oc);
    } else {
      outer_linear<3>(xc, rows, K, wb, bs, N, bias, oc);
    }
#else
    // Any CPU: the same outer products, 16 columns at a time, vectorised by the compiler.
#pragma omp parallel for if (worth_threads(N * K))
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t n0 = 0; n0 < N; n0 += 16) {
        float acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = bias != nullptr ? bias[n0 + i] : 0.f;
        const float* block = wb + (n0 / 16) * bs;
        for (int64_t k = 0; k < K; ++k) {
          const float a = xc[m * K + k];
#pragma omp simd
          for (int i = 0; i < 16; ++i) acc[i] += a * block[k * 16 + i];
        }
        for (int i = 0; i < 16; ++i) oc[m * N + n0 + i] = acc[i];
      }
    }
#endif
  }
}

// out[k * N + n] = w[n, k]: a weight in column blocks copied out column-major ([K, N]; torch reads it
// as the [N, K] matrix with strides (1, N)) for torch's GEMM on large batches. Lines are copied whole;
// each thread takes whole blocks, read in order. Runs at the machine's copy bandwidth (30 SmolLM2
// layers in 35 ms, ~2 % of a 2,048-token prefill step; tiling over K made no difference).
void kvp_unblock(const float* wb, int64_t bs, int64_t N, int64_t K, float* out) {
#pragma omp parallel for if (worth_threads(N * K))
  for (int64_t b = 0; b < N / 16; ++b) {
    const float* block = wb + b * bs;
    for (int64_t k = 0; k < K; ++k) std::memcpy(out + k * N + b * 16, block + k * 16, 16 * sizeof(float));
  }
}

}  // extern "C"
