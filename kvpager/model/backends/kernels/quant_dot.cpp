// kvpager CPU linear kernels with integer dot products: int8 / int4 packed weights (quant.cpp's
// layouts) times activations quantized to int8 per row and block of 32 inside the call (w8a8_int8,
// w4a8_int8; not exact: the activations are rounded).
//
// Per call: every input row of x is quantized per block of 32 (symmetric, d = max|x| / 127,
// q = round-half-even(x / d)); each weight block times each activation block is an exact integer
// dot (on AVX2: _mm256_maddubs_epi16 + _mm256_madd_epi16), scaled by d and accumulated in float32,
// then scaled once per group by the weight's scale (group 32, one scale per block: tile_per_block,
// the same operations without the group loop). int4's asymmetric groups (w = code * s + o) add
// o * (the group's sum of the quantized activations, sum_b d_b * sum q), so y = dequant(w) . x_hat
// where x_hat = d * q is the quantized activation: the result equals a float32 matmul of the
// dequantized weight with x_hat, up to float32 rounding of the accumulation.
// Groups must be multiples of 32 (a block never straddles two), the whole row (int8 per channel), or
// 16 (two scales per block, one per half: int8, or GGUF Q6_K's packed codes).
//
// Three builds of quant_dot_body.inc, chosen per call: AVX-512 VNNI (vpdpbusd, where the CPU has
// AVX512-VNNI and AVX512VL/BW), AVX2 + FMA, and portable C++. All scale with a fused multiply-add
// (std::fma in the portable build: one rounding, as vfmadd) in the same order, so all give the same bits,
// except the VNNI build's group-32 weights, whose blocks go in 512-bit pairs (quant_dot_pairs.inc:
// another order). int4 blocks go in 256-bit pairs in the other builds (tile_i4_pairs) and, at groups of
// an even number of blocks, in all three (tile_i4_group_pairs). In the AVX2 and portable builds, batches
// of kGemmMinRows rows or more take 8-row panels instead (quant_dot_gemm.inc: another order again).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVQ_X86 1
#define KVQ_PUSH_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define KVQ_PUSH_VNNI \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni\")")
#define KVQ_POP _Pragma("GCC pop_options")
#endif

#include "int4_rows.h"
#include "quant_dot_simd.h"

namespace {

constexpr int64_t kFmtInt8 = 1;  // the values of quant.cpp's formats
constexpr int64_t kFmtInt4 = 2;
constexpr int64_t kLevelPortable = 0, kLevelAvx2 = 1, kLevelVnni = 2;  // quant.cpp's numbering (2: AVX-512)

struct DotPacked {
  int64_t fmt, N, K, group, num_groups, row_bytes;
  int64_t blocks;        // activation blocks per row: ceil(K / 32)
  int64_t full_blocks;   // blocks whose weight bytes lie wholly inside the stored row
  int64_t group_blocks;  // blocks per group
  bool half_blocks;      // group 16: two groups per block (int8; GGUF Q6_K's packed codes)
  const void* w;
  const void* scales;    // float32, or IEEE float16 when half_scales (the kernels' SC: float / uint16_t)
  bool half_scales;
  // int4: null for symmetric groups (offset = kSymmetricOffset * scale); int8: null, or per-group offsets
  // (GGUF Q5_K: w = q * scale + offset, groups of whole activation blocks)
  const float* offsets;
  int64_t interleaved;   // the leading rows stored four at a time (int4_rows.h); 0: plain
  // scales and offsets hold rows scale_row0 .. only (a KRows view); row n's are at n - scale_row0
  int64_t scale_row0;
  bool scale_prefetch;      // whether the tiles prefetch the next tile's scale rows (not in a KRows view)
  const uint8_t* k_records;  // fmt | kKScales: GGUF Q4_K's super-block records (scales, offsets null)
  const uint8_t* q6_records;  // fmt | kQ6Scales: GGUF Q6_K's super-block records (scales null)
  const uint8_t* hi_plane;    // fmt | kHiPlane: GGUF Q5_K's fifth bits or Q6_K's high two (int4 codes)
};

// quant.cpp's: a format value with this bit set says the scales are IEEE float16 (GGUF Q8_0 / Q4_0).
constexpr int64_t kHalfScales = 256;

// Row n's scales in the stored type SC.
template <class SC>
inline const SC* scale_row(const DotPacked& p, int64_t n) {
  return static_cast<const SC*>(p.scales) + (n - p.scale_row0) * p.num_groups;
}

// Row n's offsets (int4, asymmetric).
inline const float* offset_row(const DotPacked& p, int64_t n) { return p.offsets + (n - p.scale_row0) * p.num_groups; }

// A format value with this bit set holds GGUF Q4_K's or Q5_K's scales as the file does (int4, group 32,
// K a multiple of 256): per row, one kKRecord-byte record per super-block of kKGroups groups:
// float16 d, float16 dmin, kKGroups six-bit scales sc, kKGroups six-bit mins m (a byte each). Group g's
// scale is d * sc[g] and its offset -(dmin * m[g]), both exact in float32: the float32 form's values,
// so the two forms give the same bits. Q4_K: 0.58 bytes a weight where the float32 form holds 0.75.
constexpr int64_t kKScales = 1024;
constexpr int64_t kKGroups = 8;
constexpr int64_t kKRecord = 20;

// A format value with this bit set (with kKScales, int4) holds GGUF Q5_K's 5-bit codes packed: the int4
// codes are their low 4 bits, and `offsets` points at a plane of their fifth bits, uint8 [N, K / 8]: per
// block of 32, 4 bytes, bit j (little-endian) that of the block's stored position j (int4_rows.h's order:
// position i of the 16 stored bytes' low nibbles, 16 + i of their high ones). 0.70 bytes a weight with the
// records, where int8 codes with float32 scales and offsets hold 1.25. The VNNI build has no such tile:
// the AVX2 build runs it there.
constexpr int64_t kHiPlane = 4096;
constexpr int64_t kPlaneBytesPerBlock = 4;

// A format value with this bit set, with kHiPlane on int4 codes, holds GGUF Q6_K's 6-bit codes and
// scales as the file does (group 16, K a multiple of 256): the int4 codes are the codes' low 4 bits,
// `offsets` points at a plane of their two high bits, uint8 [N, K / 4] (per pair of blocks, b even, 16
// bytes: byte i holds 2 bits each, from bit 0, of block b's stored position i, block b + 1's i, block
// b's 16 + i, block b + 1's 16 + i: S::q6_plane_bits), and `scales` per row one kQ6Record-byte record
// per super-block of kQ6Groups groups: float16 d, then the kQ6Groups int8 scales sc. The values are
// code - 32, group g's scale d * sc[g] (exact in float32): 0.82 bytes a weight, the file's, where int8
// codes with float32 scales hold 1.25. The VNNI build has no such tile: the AVX2 build runs it there.
constexpr int64_t kQ6Scales = 2048;
constexpr int64_t kQ6Groups = 16;
constexpr int64_t kQ6Record = 18;
constexpr int64_t kQ6PlaneBytesPerBlock = 8;

// quant.cpp's: a symmetric int4 group's offset per unit of its scale (codes 0..15 stand for -8..7).
constexpr float kSymmetricOffset = -8.0f;

struct Act {
  const int8_t* q;  // [M, blocks * 32] (int4: each block in the order int4_natural inverts)
  const float* d;   // [M, blocks]
  const float* xs;  // int4: [M, num_groups] the groups' sums of the quantized activations
};

namespace portable {
using S = kvqd_simd::Portable;
#include "quant_dot_body.inc"
}  // namespace portable

#if defined(KVQ_X86)
KVQ_PUSH_AVX2
namespace avx2 {
using S = kvqd_simd::Avx2;
#include "quant_dot_body.inc"
}  // namespace avx2
KVQ_POP
KVQ_PUSH_VNNI
namespace vnni {
using S = kvqd_simd::Vnni;
#define KVQD_PAIR_BLOCKS 1  // group-32 weights: two blocks per 512-bit vector (quant_dot_pairs.inc)
#include "quant_dot_body.inc"
#undef KVQD_PAIR_BLOCKS
}  // namespace vnni
KVQ_POP

int64_t cpu_level() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    return kLevelPortable;
  const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return vnni ? kLevelVnni : kLevelAvx2;
}
#else
int64_t cpu_level() { return kLevelPortable; }
#endif

int64_t dot_level_for(int64_t max_level) { return std::min(std::max<int64_t>(max_level, 0), cpu_level()); }

}  // namespace

extern "C" {

// The path kvq_dot_linear takes for a cap of max_level (quant.cpp's numbering): 2 VNNI, 1 AVX2, 0 portable.
int64_t kvq_dot_level(int64_t max_level) { return dot_level_for(max_level); }

// The fewest input rows a batch needs to take the panel tiles (quant_dot_gemm.inc: int8 and int4) on the
// path a cap of max_level gives; 0 where that path has none (the VNNI build: its block pairs take every batch).
int64_t kvq_dot_panel_rows(int64_t max_level) {
  return dot_level_for(max_level) == kLevelVnni ? 0 : portable::kGemmMinRows;
}

// y [M, N] = quantize_per_block(x [M, K]) . w (+ bias [N] when not null); see the header comment.
// fmt | kHalfScales: `scales` holds IEEE float16; fmt | kvq_int4::kRowsBit: rows interleaved (int4_rows.h;
// int8: on the AVX2 or portable path, whatever max_level allows); fmt | kKScales: `scales` holds Q4_K's
// or Q5_K's super-block records (int4, group 32, K a multiple of 256, `offsets` null, but with
// kHiPlane: `offsets` is the plane of Q5_K's fifth bits); fmt | kQ6Scales | kHiPlane: Q6_K's (int4,
// group 16, K a multiple of 256, `offsets` the plane of the codes' high two bits).
// int8 takes `offsets` too (float32 [N, groups], groups a multiple of 32): y gains offset[n, g] times the
// group's sum of the quantized activations, as int4's asymmetric groups do.
// Returns 0, or -1 when the group size is neither a multiple of 32 nor K, int8 offsets come with other
// groups, or kKScales's or kQ6Scales's conditions do not hold (nothing is written then).
int64_t kvq_dot_linear(int64_t fmt, const float* x, int64_t M, int64_t K, const void* w, const void* scales,
                       const float* offsets, int64_t N, int64_t group, const float* bias, float* y,
                       int64_t num_threads, int64_t max_level) {
  constexpr int64_t B = kvqd_simd::kBlock;
  const bool half_scales = (fmt & kHalfScales) != 0, rows4 = (fmt & kvq_int4::kRowsBit) != 0;
  const bool k_scales = (fmt & kKScales) != 0, q6_scales = (fmt & kQ6Scales) != 0, plane = (fmt & kHiPlane) != 0;
  fmt &= ~(kHalfScales | kvq_int4::kRowsBit | kKScales | kQ6Scales | kHiPlane);
  if (plane && (k_scales == q6_scales || fmt != kFmtInt4 || offsets == nullptr)) return -1;
  if (q6_scales && !plane) return -1;
  const uint8_t* hi_plane = plane ? reinterpret_cast<const uint8_t*>(offsets) : nullptr;
  if (plane) offsets = nullptr;  // the pointer was the plane's
  const bool half = (fmt == kFmtInt8 || q6_scales) && group == B / 2 && K != group;
  if (group < 1 || (group % B != 0 && group != K && !half) || (fmt != kFmtInt8 && fmt != kFmtInt4)) return -1;
  if (k_scales && (fmt != kFmtInt4 || group != B || K % (B * kKGroups) != 0 || half_scales || offsets)) return -1;
  if (fmt == kFmtInt8 && offsets && (half || group % B != 0)) return -1;  // offsets: whole activation blocks
  if (q6_scales && (group != B / 2 || K % (B / 2 * kQ6Groups) != 0 || half_scales))
    return -1;
  if (M <= 0 || N <= 0) return 0;
  DotPacked p{};
  p.fmt = fmt;
  p.N = N;
  p.K = K;
  p.group = group;
  p.num_groups = (K + group - 1) / group;
  p.row_bytes = fmt == kFmtInt4 ? (K + 15) / 16 * 8 : K;
  p.blocks = (K + B - 1) / B;
  p.full_blocks = fmt == kFmtInt4 ? p.row_bytes / 16 : K / B;
  p.group_blocks = half ? 1 : group % B == 0 ? group / B : p.blocks;
  p.half_blocks = half;
  p.w = w;
  p.scales = k_scales || q6_scales ? nullptr : scales;
  p.half_scales = half_scales;
  p.offsets = offsets;
  p.scale_row0 = 0;
  p.scale_prefetch = !k_scales && !q6_scales;
  p.k_records = k_scales ? static_cast<const uint8_t*>(scales) : nullptr;
  p.q6_records = q6_scales ? static_cast<const uint8_t*>(scales) : nullptr;
  p.hi_plane = hi_plane;
  p.interleaved = kvq_int4::interleaved_rows(rows4, N, p.row_bytes);
  const bool int4 = fmt == kFmtInt4;
  // interleaved int8 rows have no VNNI instantiation (its block pairs read plain rows): the AVX2 build
  // runs them there (the weights' classes interleave int8 only where the VNNI build is not the path)
  // (nor have the Q5_K and Q6_K planes: the AVX2 build runs those too)
  const int64_t level =
      std::min(dot_level_for(max_level), (int4 && !plane) || (!int4 && !p.interleaved) ? kLevelVnni : kLevelAvx2);
  const int threads = static_cast<int>(N * K * M >= (1 << 15) ? std::max<int64_t>(1, num_threads) : 1);
  std::vector<int8_t> q(static_cast<size_t>(M * p.blocks * B));
  std::vector<float> d(static_cast<size_t>(M * p.blocks)), xs;
#if defined(KVQ_X86)
  if (level >= kLevelAvx2)  // the VNNI build quantizes with the AVX2 code (its quantize_block)
    avx2::quantize_rows(x, M, K, p.blocks, int4, q.data(), d.data(), threads);
  else
#endif
    portable::quantize_rows(x, M, K, p.blocks, int4, q.data(), d.data(), threads);
  if ((int4 && !q6_scales) || offsets) {  // the zero-point term's group sums: sum_b d_b * sum(q_b), block after block
    xs.assign(static_cast<size_t>(M * p.num_groups), 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < p.blocks; ++b) {
        int32_t s = 0;
        for (int64_t i = 0; i < B; ++i) s += q[(m * p.blocks + b) * B + i];
        float& acc = xs[m * p.num_groups + b / p.group_blocks];
        acc = acc + d[m * p.blocks + b] * static_cast<float>(s);
      }
  }
  const Act a{q.data(), d.data(), xs.data()};
#if defined(KVQ_X86)
  if (level == kLevelVnni) {
    vnni::linear(p, a, M, bias, y, threads);
    return 0;
  }
  if (level == kLevelAvx2) {
    avx2::linear(p, a, M, bias, y, threads);
    return 0;
  }
#endif
  (void)level;
  portable::linear(p, a, M, bias, y, threads);
  return 0;
}

// out [N, K] uint8 = the codes of a GGUF Q5_K or Q6_K packed weight (fmt: int4 | kKScales | kHiPlane or
// int4 | kQ6Scales | kHiPlane, optionally kRowsBit; `plane` its higher bits, as kvq_dot_linear takes
// them) in natural order (Q5_K 0..31, Q6_K 0..63): what the float32 forms hold, built here instead of
// by a torch unpack on every batch the exact or bfloat16 path takes. Returns 0, or -1 for another
// format or K not a multiple of 256 (nothing written then).
int64_t kvq_dot_plane_codes(int64_t fmt, const void* w, const void* plane, int64_t N, int64_t K, uint8_t* out,
                            int64_t num_threads, int64_t max_level) {
  const bool rows4 = (fmt & kvq_int4::kRowsBit) != 0, q6 = (fmt & kQ6Scales) != 0;
  const int64_t kind = fmt & ~kvq_int4::kRowsBit;
  if ((kind != (kFmtInt4 | kQ6Scales | kHiPlane) && kind != (kFmtInt4 | kKScales | kHiPlane)) || K <= 0 ||
      K % (kQ6Groups * 16) != 0 || N < 0 || plane == nullptr)
    return -1;
  const int64_t interleaved = kvq_int4::interleaved_rows(rows4, N, K / 2);
  const int threads = static_cast<int>(N * K >= (1 << 16) ? std::max<int64_t>(1, num_threads) : 1);
  const auto* codes = static_cast<const uint8_t*>(w);
  const auto* bits = static_cast<const uint8_t*>(plane);
#if defined(KVQ_X86)
  if (dot_level_for(max_level) >= kLevelAvx2) {
    avx2::plane_codes_rows(q6, codes, bits, N, K, interleaved, out, threads);
    return 0;
  }
#endif
  (void)max_level;
  portable::plane_codes_rows(q6, codes, bits, N, K, interleaved, out, threads);
  return 0;
}

// The float32 scales (and Q4_K's offsets) of GGUF super-block records, as the float32 forms hold them:
// q6 == 0: `records` [rows, kKRecord] (Q4_K / Q5_K) -> scales and offsets [rows, kKGroups] (d * sc,
// -dmin * m); q6 != 0: [rows, kQ6Record] (Q6_K) -> scales [rows, kQ6Groups] (d * sc; offsets unused).
// Exact in float32 (a float16 times a small integer), so the same values as a torch expansion, built
// here because the exact and bfloat16 paths expand a weight's records on every batch they take.
void kvq_dot_expand_records(int64_t q6, const uint8_t* records, int64_t rows, float* scales, float* offsets,
                            int64_t num_threads) {
  const int threads = static_cast<int>(rows >= (1 << 12) ? std::max<int64_t>(1, num_threads) : 1);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < rows; ++i) {
    if (q6)
      kvqd_simd::Portable::expand_q6(records + i * kQ6Record, scales + i * kQ6Groups);
    else
      kvqd_simd::Portable::expand_k(records + i * kKRecord, scales + i * kKGroups, offsets + i * kKGroups);
  }
}

}  // extern "C"
