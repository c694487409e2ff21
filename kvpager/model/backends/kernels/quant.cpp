// kvpager CPU linear kernels over packed weights: bfloat16, int8 and int4 (weight-only quantization).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x float32 [M, K] row-major, y float32 [M, N].
// The weights are read in their packed form and dequantized in registers (or, for 3+ input rows, into
// an L1 tile shared by all rows); products accumulate in float32. Formats (quant_weights.py):
//   kFmtBf16: w uint16 [N, K] (bfloat16 bits), no scales.
//   kFmtF16:  w uint16 [N, K] (IEEE float16 bits), no scales (widened exactly: F16C / bit layout).
//   kFmtInt8: w int8 [N, K]; w[n, k] = q * scales[n, k / group]           (symmetric)
//             | kvq_int4::kRowsBit: rows interleaved four at a time (int4_rows.h, row_bytes = K)
//   kFmtInt4: w uint8 [N, row_bytes], row_bytes = ceil(K / 16) * 8; within every span of 16 weights
//             byte j (0..7) holds weight j in its low nibble and weight j + 8 in its high nibble;
//             w[n, k] = code * scales[n, g] + offsets[n, g], g = k / group      (asymmetric)
//             offsets null: symmetric, offsets[n, g] = -8 * scales[n, g] (GGUF Q4_0), computed where read
//             | kvq_int4::kRowsBit: rows interleaved four at a time (int4_rows.h), the same codes
// Scales are float32, or IEEE float16 where the format value has kHalfScales set (GGUF Q8_0 / Q4_0: the
// file's float16 scales, widened exactly where read; offsets stay float32).
// Groups run along K; the last one may be short (K need not be a multiple of the group). int4 groups
// are multiples of 16 so that a span never straddles two groups.
//
// Three builds of the same kernels (quant_body.inc) in one library, chosen per call at run time:
// AVX-512 (F/BW/VL/DQ), AVX2 + FMA, and portable (GCC vector extensions on the baseline instruction
// set). The library is compiled without -march (target pragmas instead), so it runs on any x86-64
// CPU, and a caller may cap the level (KVPAGER_KERNEL_ISA=portable, tests) below what the CPU has.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVQ_X86 1
#define KVQ_PUSH_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define KVQ_PUSH_AVX512 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#define KVQ_POP _Pragma("GCC pop_options")
#endif

#include "int4_rows.h"
#include "quant_simd.h"

namespace {

constexpr int64_t kFmtBf16 = 0;
constexpr int64_t kFmtInt8 = 1;
constexpr int64_t kFmtInt4 = 2;
constexpr int64_t kFmtF16 = 3;
// int4 with interleaved rows: not a format value callers pass (they pass kFmtInt4 | kRowsBit) but the
// kernels' own instantiation of int4 reading that layout
constexpr int64_t kFmtInt4Rows = kFmtInt4 | kvq_int4::kRowsBit;
constexpr int64_t kFmtInt8Rows = kFmtInt8 | kvq_int4::kRowsBit;  // the same for int8
constexpr bool is_int4(int64_t fmt) { return fmt == kFmtInt4 || fmt == kFmtInt4Rows; }
constexpr bool is_int8(int64_t fmt) { return fmt == kFmtInt8 || fmt == kFmtInt8Rows; }
// The 16-bit float formats: the weight itself, no scale or offset.
constexpr bool unscaled(int64_t fmt) { return fmt == kFmtBf16 || fmt == kFmtF16; }
constexpr int64_t kLevelPortable = 0, kLevelAvx2 = 1, kLevelAvx512 = 2;

struct Packed {
  int64_t fmt, N, K, group, num_groups, row_bytes;
  const void* w;
  const void* scales;    // float32, or IEEE float16 when half_scales
  bool half_scales;
  const float* offsets;  // int4: null for symmetric groups (offset = kSymmetricOffset * scale)
  int64_t interleaved;   // int4 / int8: the leading rows stored four at a time (int4_rows.h); 0: plain
};

// A format value with this bit set: the scales are IEEE float16 (quant_weights.FMT_HALF_SCALES).
constexpr int64_t kHalfScales = 256;

// A symmetric int4 group's offset per unit of its scale: codes 0..15 stand for -8..7. Scaling by a power
// of two is exact, so -8 * dot(scales, xs) equals dot(offsets, xs) bit for bit with offsets = -8 * scales.
constexpr float kSymmetricOffset = -8.0f;

// The stored value (code for int4, q for int8, the weight for bf16/f16) before scale/offset.
inline float raw_at(const Packed& p, int64_t n, int64_t k) {
  if (p.fmt == kFmtBf16) return kvq_simd::bf16_bits_to_float(static_cast<const uint16_t*>(p.w)[n * p.K + k]);
  if (p.fmt == kFmtF16) return kvq_simd::f16_bits_to_float(static_cast<const uint16_t*>(p.w)[n * p.K + k]);
  if (p.fmt == kFmtInt8)
    return static_cast<float>(static_cast<const int8_t*>(p.w)[kvq_int4::byte_at(p.interleaved, p.row_bytes, n, k)]);
  const int64_t span = k / 16, j = k % 16;
  const uint8_t byte =
      static_cast<const uint8_t*>(p.w)[kvq_int4::byte_at(p.interleaved, p.row_bytes, n, span * 8 + (j & 7))];
  return static_cast<float>(j < 8 ? (byte & 0xF) : (byte >> 4));
}

namespace portable {
using S = kvq_simd::Portable;
#include "quant_body.inc"
}  // namespace portable

#if defined(KVQ_X86)
KVQ_PUSH_AVX2
namespace avx2 {
using S = kvq_simd::Avx2;
#include "quant_body.inc"
}  // namespace avx2
KVQ_POP

KVQ_PUSH_AVX512
namespace avx512 {
using S = kvq_simd::Avx512;
#include "quant_body.inc"
}  // namespace avx512
KVQ_POP

int64_t cpu_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return kLevelAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kLevelAvx2;
  return kLevelPortable;
}
#else
int64_t cpu_level() { return kLevelPortable; }
#endif

int64_t level_for(int64_t max_level) { return std::min(std::max<int64_t>(max_level, 0), cpu_level()); }

Packed make_packed(int64_t fmt, const void* w, const void* scales, const float* offsets, int64_t N, int64_t K,
                   int64_t group) {
  Packed p{};
  p.half_scales = (fmt & kHalfScales) != 0;
  const bool rows4 = (fmt & kvq_int4::kRowsBit) != 0;
  fmt &= ~(kHalfScales | kvq_int4::kRowsBit);
  p.fmt = fmt;
  p.N = N;
  p.K = K;
  p.group = unscaled(fmt) ? K : group;
  p.num_groups = (K + p.group - 1) / p.group;
  p.row_bytes = fmt == kFmtInt4 ? ((K + 15) / 16) * 8 : fmt == kFmtInt8 ? K : 0;
  p.w = w;
  p.scales = unscaled(fmt) ? nullptr : scales;
  p.offsets = offsets;
  p.interleaved = fmt == kFmtInt4 || fmt == kFmtInt8 ? kvq_int4::interleaved_rows(rows4, N, p.row_bytes) : 0;
  return p;
}

}  // namespace

extern "C" {

// The code path kvq_linear takes for a cap of max_level: 2 AVX-512, 1 AVX2 + FMA, 0 portable.
int64_t kvq_level(int64_t max_level) { return level_for(max_level); }

// y [M, N] = x [M, K] @ dequant(w).T (+ bias [N] when not null), through the best path up to max_level.
// num_threads: OpenMP threads to use (small weights run on one).
void kvq_linear(int64_t fmt, const float* x, int64_t M, int64_t K, const void* w, const void* scales,
                const float* offsets, int64_t N, int64_t group, const float* bias, float* y, int64_t num_threads,
                int64_t max_level) {
  if (M <= 0 || N <= 0) return;
  const Packed p = make_packed(fmt, w, scales, offsets, N, K, group);
  // x zero-padded to a multiple of 16 columns (the buffered path reads whole 16-float units)
  const int64_t ldx = (K + 15) / 16 * 16;
  std::vector<float> xpad(static_cast<size_t>(M * ldx), 0.0f);
  for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * ldx, x + m * K, sizeof(float) * K);
  std::vector<float> xs;  // int4: the group sums of x, xs[m * num_groups + g]
  if (p.fmt == kFmtInt4) {
    xs.assign(static_cast<size_t>(M * p.num_groups), 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < p.num_groups; ++g) {
        float s = 0.0f;
        for (int64_t k = g * p.group; k < std::min(K, (g + 1) * p.group); ++k) s += x[m * K + k];
        xs[m * p.num_groups + g] = s;
      }
  }
  const int threads = static_cast<int>(N * K * M >= (1 << 15) ? std::max<int64_t>(1, num_threads) : 1);
  const int64_t level = level_for(max_level);
#if defined(KVQ_X86)
  if (level == kLevelAvx512) return avx512::linear(p, xpad.data(), ldx, xs.data(), M, bias, y, threads);
  if (level == kLevelAvx2) return avx2::linear(p, xpad.data(), ldx, xs.data(), M, bias, y, threads);
#endif
  (void)level;
  portable::linear(p, xpad.data(), ldx, xs.data(), M, bias, y, threads);
}

// out [n1 - n0, K] float32 = the dequantized weight rows n0..n1 (for a GEMM on large batches).
void kvq_dequant(int64_t fmt, const void* w, const void* scales, const float* offsets, int64_t N, int64_t K,
                 int64_t group, int64_t n0, int64_t n1, float* out, int64_t num_threads, int64_t max_level) {
  const Packed p = make_packed(fmt, w, scales, offsets, N, K, group);
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  const int64_t level = level_for(max_level);
#if defined(KVQ_X86)
  if (level == kLevelAvx512) return avx512::dequant(p, n0, n1, out, threads);
  if (level == kLevelAvx2) return avx2::dequant(p, n0, n1, out, threads);
#endif
  (void)level;
  portable::dequant(p, n0, n1, out, threads);
}

// out [n1 - n0, K] bfloat16 bits = the dequantized weight rows n0..n1 rounded to bfloat16 (for a
// bfloat16 GEMM on large batches where the CPU has native bfloat16 matmul).
void kvq_dequant_bf16(int64_t fmt, const void* w, const void* scales, const float* offsets, int64_t N, int64_t K,
                      int64_t group, int64_t n0, int64_t n1, uint16_t* out, int64_t num_threads, int64_t max_level) {
  const Packed p = make_packed(fmt, w, scales, offsets, N, K, group);
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  const int64_t level = level_for(max_level);
#if defined(KVQ_X86)
  if (level == kLevelAvx512) return avx512::dequant_bf16(p, n0, n1, out, threads);
  if (level == kLevelAvx2) return avx2::dequant_bf16(p, n0, n1, out, threads);
#endif
  (void)level;
  portable::dequant_bf16(p, n0, n1, out, threads);
}

}  // extern "C"
