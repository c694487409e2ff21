// kvpager CPU linear kernels over packed weights: bfloat16, int8 and int4 (weight-only quantization).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x float32 [M, K] row-major, y float32 [M, N].
// The weights are read in their packed form and dequantized in registers; products accumulate in
// float32. Formats (kvpager/model/backends/quant_weights.py builds them):
//   kFmtBf16: w uint16 [N, K] (bfloat16 bits), no scales.
//   kFmtInt8: w int8 [N, K]; w[n, k] = q * scales[n, k / group]           (symmetric)
//   kFmtInt4: w uint8 [N, row_bytes], row_bytes = ceil(K / 16) * 8; within every span of 16 weights
//             byte j (0..7) holds weight j in its low nibble and weight j + 8 in its high nibble;
//             w[n, k] = code * scales[n, g] + offsets[n, g], g = k / group      (asymmetric)
// Groups run along K; the last one may be short (K need not be a multiple of the group). int4 groups
// are multiples of 16 so that a span never straddles two groups.
//
// Two code paths, chosen at run time: AVX2 + FMA (x86-64 CPUs that report both) and a portable loop.
// Built without -march=native (target attributes instead), so one library runs on any x86-64 CPU and
// the tests can force the portable path on a CPU that has AVX2.
//
// Work split: output rows n across OpenMP threads; for each n the weight row is read once from memory
// and stays in L1 while up to kRowTile input rows at a time consume it.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVQ_X86 1
#endif

namespace {

constexpr int64_t kFmtBf16 = 0;
constexpr int64_t kFmtInt8 = 1;
constexpr int64_t kFmtInt4 = 2;
constexpr int64_t kRowTile = 4;

struct Packed {
  int64_t fmt, N, K, group, num_groups, row_bytes;
  const void* w;
  const float* scales;
  const float* offsets;
};

inline float bf16_to_float(uint16_t v) {
  uint32_t b = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The quantized value (code for int4, q for int8, the weight for bf16) before scale/offset.
inline float raw_at(const Packed& p, int64_t n, int64_t k) {
  if (p.fmt == kFmtBf16) return bf16_to_float(static_cast<const uint16_t*>(p.w)[n * p.K + k]);
  if (p.fmt == kFmtInt8) return static_cast<float>(static_cast<const int8_t*>(p.w)[n * p.K + k]);
  const uint8_t* row = static_cast<const uint8_t*>(p.w) + n * p.row_bytes;
  const int64_t span = k / 16, j = k % 16;
  const uint8_t byte = row[span * 8 + (j & 7)];
  return static_cast<float>(j < 8 ? (byte & 0xF) : (byte >> 4));
}

// Per-row group sums of x (int4's offsets multiply them): xs[m * num_groups + g].
std::vector<float> group_sums(const Packed& p, const float* x, int64_t M) {
  std::vector<float> xs;
  if (p.fmt != kFmtInt4) return xs;
  xs.assign(static_cast<size_t>(M * p.num_groups), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < p.num_groups; ++g) {
      const int64_t k0 = g * p.group, k1 = std::min(p.K, k0 + p.group);
      float s = 0.0f;
      for (int64_t k = k0; k < k1; ++k) s += x[m * p.K + k];
      xs[m * p.num_groups + g] = s;
    }
  return xs;
}

// One output row n for input rows [m0, m0 + rows): the portable path.
void row_portable(const Packed& p, const float* x, const float* xs, int64_t m0, int64_t rows, int64_t n,
                  float* acc) {
  for (int64_t r = 0; r < rows; ++r) acc[r] = 0.0f;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t k0 = g * p.group, k1 = std::min(p.K, k0 + p.group);
    float part[kRowTile] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t k = k0; k < k1; ++k) {
      const float w = raw_at(p, n, k);
      for (int64_t r = 0; r < rows; ++r) part[r] += w * x[(m0 + r) * p.K + k];
    }
    const float scale = p.scales ? p.scales[n * p.num_groups + g] : 1.0f;
    for (int64_t r = 0; r < rows; ++r) {
      acc[r] += scale * part[r];
      if (p.fmt == kFmtInt4) acc[r] += p.offsets[n * p.num_groups + g] * xs[(m0 + r) * p.num_groups + g];
    }
  }
}

#if defined(KVQ_X86)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Eight weights starting at k (k a multiple of 8 for int4) as float32, before scale/offset.
template <int64_t FMT>
__attribute__((target("avx2,fma"))) inline __m256 load8(const Packed& p, int64_t n, int64_t k) {
  if constexpr (FMT == kFmtBf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p.w) + n * p.K + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (FMT == kFmtInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p.w) + n * p.K + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    const uint8_t* span = static_cast<const uint8_t*>(p.w) + n * p.row_bytes + (k / 16) * 8;
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(span)));
    const __m256i codes = (k % 16 == 0) ? _mm256_and_si256(b, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(b, 4);
    return _mm256_cvtepi32_ps(codes);
  }
}

// One output row n for ROWS input rows from m0: 16 weights per iteration, two accumulators per row.
template <int64_t FMT, int ROWS>
__attribute__((target("avx2,fma"))) void row_avx2(const Packed& p, const float* x, const float* xs, int64_t m0,
                                                  int64_t n, float* acc) {
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
  const float* x0 = x + m0 * p.K;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t k0 = g * p.group, k1 = std::min(p.K, k0 + p.group);
    const int64_t k16 = k0 + ((k1 - k0) / 16) * 16, k8 = k0 + ((k1 - k0) / 8) * 8;
    __m256 a[ROWS], b[ROWS];
    for (int r = 0; r < ROWS; ++r) a[r] = b[r] = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k < k16; k += 16) {
      __m256 w0, w1;
      if constexpr (FMT == kFmtInt4) {  // one 8-byte span: low nibbles are weights k..k+7, high k+8..k+15
        const uint8_t* span = static_cast<const uint8_t*>(p.w) + n * p.row_bytes + (k / 16) * 8;
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(span)));
        w0 = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
        w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
      } else {
        w0 = load8<FMT>(p, n, k);
        w1 = load8<FMT>(p, n, k + 8);
      }
      for (int r = 0; r < ROWS; ++r) {
        a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + r * p.K + k), a[r]);
        b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + r * p.K + k + 8), b[r]);
      }
    }
    for (; k < k8; k += 8) {
      const __m256 w0 = load8<FMT>(p, n, k);
      for (int r = 0; r < ROWS; ++r) a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + r * p.K + k), a[r]);
    }
    float part[ROWS];
    for (int r = 0; r < ROWS; ++r) part[r] = hsum(_mm256_add_ps(a[r], b[r]));
    for (; k < k1; ++k) {
      const float w = raw_at(p, n, k);
      for (int r = 0; r < ROWS; ++r) part[r] += w * x0[r * p.K + k];
    }
    const float scale = FMT == kFmtBf16 ? 1.0f : p.scales[n * p.num_groups + g];
    for (int r = 0; r < ROWS; ++r) {
      acc[r] += scale * part[r];
      if constexpr (FMT == kFmtInt4) acc[r] += p.offsets[n * p.num_groups + g] * xs[(m0 + r) * p.num_groups + g];
    }
  }
}

template <int64_t FMT>
__attribute__((target("avx2,fma"))) void rows_avx2(const Packed& p, const float* x, const float* xs, int64_t m0,
                                                   int64_t rows, int64_t n, float* acc) {
  switch (rows) {
    case 1: row_avx2<FMT, 1>(p, x, xs, m0, n, acc); break;
    case 2: row_avx2<FMT, 2>(p, x, xs, m0, n, acc); break;
    case 3: row_avx2<FMT, 3>(p, x, xs, m0, n, acc); break;
    default: row_avx2<FMT, 4>(p, x, xs, m0, n, acc); break;
  }
}

void row_avx2_any(const Packed& p, const float* x, const float* xs, int64_t m0, int64_t rows, int64_t n, float* acc) {
  if (p.fmt == kFmtBf16) rows_avx2<kFmtBf16>(p, x, xs, m0, rows, n, acc);
  else if (p.fmt == kFmtInt8) rows_avx2<kFmtInt8>(p, x, xs, m0, rows, n, acc);
  else rows_avx2<kFmtInt4>(p, x, xs, m0, rows, n, acc);
}

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
bool cpu_has_avx2_fma() { return false; }
#endif

bool use_avx2(int64_t force_portable) { return force_portable == 0 && cpu_has_avx2_fma(); }

Packed make_packed(int64_t fmt, const void* w, const float* scales, const float* offsets, int64_t N, int64_t K,
                   int64_t group) {
  Packed p{};
  p.fmt = fmt;
  p.N = N;
  p.K = K;
  p.group = fmt == kFmtBf16 ? K : group;
  p.num_groups = (K + p.group - 1) / p.group;
  p.row_bytes = fmt == kFmtInt4 ? ((K + 15) / 16) * 8 : 0;
  p.w = w;
  p.scales = fmt == kFmtBf16 ? nullptr : scales;
  p.offsets = offsets;
  return p;
}

}  // namespace

extern "C" {

// 1 when the AVX2 + FMA path runs on this CPU (and force_portable is 0), 0 for the portable loop.
int64_t kvq_avx2_path(int64_t force_portable) { return use_avx2(force_portable) ? 1 : 0; }

// y [M, N] = x [M, K] @ dequant(w).T (+ bias [N] when not null). num_threads: OpenMP threads to use.
void kvq_linear(int64_t fmt, const float* x, int64_t M, int64_t K, const void* w, const float* scales,
                const float* offsets, int64_t N, int64_t group, const float* bias, float* y, int64_t num_threads,
                int64_t force_portable) {
  const Packed p = make_packed(fmt, w, scales, offsets, N, K, group);
  const std::vector<float> xs = group_sums(p, x, M);
  const float* xsp = xs.empty() ? nullptr : xs.data();
  const bool avx2 = use_avx2(force_portable);
  const int threads = static_cast<int>(N * K >= (1 << 14) ? std::max<int64_t>(1, num_threads) : 1);
// NOTE: dynamic chunks: a thread that loses its core (a shared machine) does not hold up the others.
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (int64_t n = 0; n < N; ++n) {
    float acc[kRowTile];
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t rows = std::min(kRowTile, M - m0);
#if defined(KVQ_X86)
      if (avx2)
        row_avx2_any(p, x, xsp, m0, rows, n, acc);
      else
#endif
        row_portable(p, x, xsp, m0, rows, n, acc);
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = acc[r] + (bias ? bias[n] : 0.0f);
    }
  }
  (void)avx2;
}

// out [n1 - n0, K] float32 = the dequantized weight rows n0..n1 (for a GEMM on large batches).
void kvq_dequant(int64_t fmt, const void* w, const float* scales, const float* offsets, int64_t N, int64_t K,
                 int64_t group, int64_t n0, int64_t n1, float* out, int64_t num_threads) {
  const Packed p = make_packed(fmt, w, scales, offsets, N, K, group);
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = n0; n < n1; ++n) {
    float* dst = out + (n - n0) * K;
    for (int64_t g = 0; g < p.num_groups; ++g) {
      const int64_t k0 = g * p.group, k1 = std::min(p.K, k0 + p.group);
      const float scale = p.scales ? p.scales[n * p.num_groups + g] : 1.0f;
      const float offset = p.fmt == kFmtInt4 ? p.offsets[n * p.num_groups + g] : 0.0f;
      for (int64_t k = k0; k < k1; ++k) dst[k] = raw_at(p, n, k) * scale + offset;
    }
  }
}

}  // extern "C"
