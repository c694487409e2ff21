// kvpager CPU kernels: linear layers on weights stored column-major (see kvpager/model/weight_layout.py).
//
// The weight of out = x @ w.T is kept as wt[k * ldw + n] = w[n, k]: torch sees a [N, K] view with
// strides (1, ldw) and runs its own GEMM on it unchanged (large batches), and this kernel computes
// outer products: a tile of MR input rows x NV * 16 output columns stays in registers over the whole
// of K, each step loads NV vectors of one weight row and broadcasts MR inputs. Against the
// dot-product tile of kvp_linear_small (torch's row-major weights) that is a third of the loads per
// multiply-add at 8+ rows. ldw is padded past N so that successive weight rows do not fall into the
// same cache sets.
#include "common.h"

namespace {

using kvp::worth_threads;

#if defined(__AVX512F__)
// Weight rows are prefetched ~4 KB ahead into L1 and 4x that into L2 while a panel is first read (from
// memory): a panel walks one row per page, which the hardware prefetchers do not follow. Measured over
// 30 streamed SmolLM2 layers at 4 rows: 0.91-0.94x kvp_linear_small with the L1 prefetch alone,
// 1.04-1.08x with both.
constexpr int64_t kPrefetchLines = 64;
constexpr int64_t kFarPrefetch = 4;

// out[0..MR)[0..NV*16) = x[0..MR) . wt columns (+ bias); x rows K apart, out rows N apart.
// first: this tile is the panel's first pass (prefetch its rows ahead; the later tiles find them in
// cache). NOTE: also pulling the next panel into L2 during the second tile was measured 2-15 %
// slower at 8-64 rows than not, and dropped.
template <int MR, int NV>
inline void outer_tile(const float* __restrict x, int64_t K, const float* __restrict wt, int64_t ldw,
                       float* __restrict out, int64_t N, const float* __restrict bias, bool first) {
  constexpr int64_t pf = std::max<int64_t>(4, kPrefetchLines / NV);  // rows
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* row = wt + k * ldw;
    if (first) {
      if (k + pf < K)
        for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(row + pf * ldw + j * 16), _MM_HINT_T0);
      if (k + kFarPrefetch * pf < K)
        for (int j = 0; j < NV; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(row + kFarPrefetch * pf * ldw + j * 16), _MM_HINT_T1);
    }
    __m512 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_ps(row + j * 16);
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
inline void outer_rows(int64_t rows, const float* x, int64_t K, const float* wt, int64_t ldw, float* out, int64_t N,
                       const float* bias, bool first) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      outer_tile<MR, NV>(x, K, wt, ldw, out, N, bias, first);
    } else {
      outer_rows<NV, MR - 1>(rows, x, K, wt, ldw, out, N, bias, first);
    }
  }
}

// One panel of NV * 16 columns for all M rows, MR rows a tile (at most 24 accumulators, 8 rows).
template <int NV>
inline void outer_panel(const float* x, int64_t M, int64_t K, const float* wt, int64_t ldw, float* out, int64_t N,
                        const float* bias) {
  constexpr int MR = std::min(8, 24 / NV);
  int64_t m0 = 0;
  for (int tile = 0; m0 + MR <= M; m0 += MR, ++tile)
    outer_tile<MR, NV>(x + m0 * K, K, wt, ldw, out + m0 * N, N, bias, tile == 0);
  if (m0 < M) outer_rows<NV, MR - 1>(M - m0, x + m0 * K, K, wt, ldw, out + m0 * N, N, bias, m0 == 0);
}

// A panel of `vectors` (<= NV) vectors of 16 columns: dispatch on its width.
template <int NV>
inline void outer_panel_width(int64_t vectors, const float* x, int64_t M, int64_t K, const float* wt, int64_t ldw,
                              float* out, int64_t N, const float* bias) {
  if constexpr (NV > 0) {
    if (vectors == NV) {
      outer_panel<NV>(x, M, K, wt, ldw, out, N, bias);
    } else {
      outer_panel_width<NV - 1>(vectors, x, M, K, wt, ldw, out, N, bias);
    }
  }
}

// Columns in panels of NV vectors (N a multiple of 16).
template <int NV>
void outer_linear(const float* x, int64_t M, int64_t K, const float* wt, int64_t ldw, int64_t N, const float* bias,
                  float* out) {
  const int64_t vectors = N / 16;
  const int threads = worth_threads(N * K) ? omp_get_max_threads() : 1;
  auto panel = [&](int64_t v, int64_t width) {
    const int64_t n0 = v * 16;
    outer_panel_width<NV>(width, x, M, K, wt + n0, ldw, out + n0, N, bias != nullptr ? bias + n0 : nullptr);
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
    // Compute-bound: panels handed out guided (a thread that loses its core holds back no fixed half).
    const int64_t panels = (vectors + NV - 1) / NV;
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p) panel(p * NV, std::min<int64_t>(NV, vectors - p * NV));
  }
}
#endif

}  // namespace

extern "C" {

// 1 when kvp_linear_t runs the AVX-512 outer-product tiles (the column-major layout only pays off then).
int64_t kvp_linear_t_fast() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// out[m, n] = sum_k x[m, k] * wt[k * ldw + n] (+ bias[n]) for x [M, K] row-major, ldw >= N.
void kvp_linear_t(const float* x, int64_t M, int64_t K, const float* wt, int64_t ldw, int64_t N, const float* bias,
                  float* out) {
#if defined(__AVX512F__)
  if (N % 16 == 0) {
    // The widest panel whose tile of all M rows (up to 8) fits 24 accumulators, so that below 8 rows
    // the weights are read once: 1-3 rows 128 columns, 4 rows 96, 5-6 rows 64; 7-15 rows 96 columns
    // 4 rows a tile (the second tile reads the panel from L2); from 16 rows 48 columns, 8 rows a tile.
    // Measured against kvp_linear_small over 30 SmolLM2 layers: 1.0-1.08x at 1-8 rows, 1.03-1.06x
    // at 12, 1.19x at 16, 1.25x at 32, 1.31x at 64.
    if (M <= 3) {
      outer_linear<8>(x, M, K, wt, ldw, N, bias, out);
    } else if (M == 4) {
      outer_linear<6>(x, M, K, wt, ldw, N, bias, out);
    } else if (M <= 6) {
      outer_linear<4>(x, M, K, wt, ldw, N, bias, out);
    } else if (M < 16) {
      outer_linear<6>(x, M, K, wt, ldw, N, bias, out);
    } else {
      outer_linear<3>(x, M, K, wt, ldw, N, bias, out);
    }
    return;
  }
#endif
  // Any width, any CPU: the same outer products, vectorised over the output columns by the compiler.
#pragma omp parallel for if (worth_threads(N * K))
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * N;
    for (int64_t n = 0; n < N; ++n) o[n] = bias != nullptr ? bias[n] : 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[m * K + k];
      const float* row = wt + k * ldw;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) o[n] += a * row[n];
    }
  }
}

}  // extern "C"
